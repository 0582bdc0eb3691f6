//! Keyframes (docs/DESIGN.md, Keyframes): consistent per-place snapshots that
//! hold back live changes only for one Redis step per place.
//!
//! For each place:
//! 1. **freeze**, in the partition's worker between two command messages:
//!    mark the place frozen, atomically with reading the applied sequence.
//!    From then on each write to the place's records and generations keeps
//!    the value it replaces (copy on write, in the commit's Lua), so the
//!    freeze is one small Redis step whatever the size of the place;
//! 2. **publish**, in a task while the worker goes on: stream the records
//!    as frozen (HSCAN of the live hash, with the kept values in place of
//!    the written ones, then the kept values of records deleted since) as
//!    `KeyframeBatch`es at the replica's pace
//!    (`storage.keyframe_rate`; slower, when `storage.keyframe_yield_after`
//!    is set, while live changes are late), the last one with the count and
//!    digest;
//!    purge keyframes older than the configured number;
//! 3. **mark**, in the worker between two command messages: put a
//!    `KeyframeMark` on the place's change subject. Its digest is the frozen
//!    one brought up to that point in the stream by the records the worker
//!    changed since the freeze, so a consumer compares its own digest at the
//!    marker exactly as if the place had been snapshotted there; then end
//!    the freeze and drop the kept values.
//!
//! A replica-wide semaphore (`storage.keyframe_concurrency`) bounds the
//! places in hand, and each worker has at most one.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shelfsync_bus::digest::Digest;
use shelfsync_proto::{KeyframeReply, PlaceKey, Record};
use shelfsync_telemetry::chain;
use tokio::sync::{Mutex, Semaphore, oneshot};
use tracing::{info, warn};

/// Records read per HSCAN step: small, because each step holds Redis, and
/// the live commands wait behind it.
pub(crate) const SCAN_COUNT: usize = 250;
/// Records the marker reads back per round trip.
pub(crate) const MARK_CHUNK: usize = 1000;
/// A late live commit makes keyframes give way for this long after it ...
const YIELD_HOLD: Duration = Duration::from_millis(20);
/// ... checked this often.
const YIELD_STEP: Duration = Duration::from_millis(5);
/// A keyframe gives way for at most this many times its share of time
/// (so it goes on at a third of its rate or more).
const YIELD_MAX_FACTOR: u32 = 2;
/// A freeze left behind by a keyframe that never finished expires.
pub(crate) const FROZEN_TTL: std::time::Duration = std::time::Duration::from_secs(6 * 3600);

/// One keyframe request as a worker sees it.
pub struct KeyframeJob {
    pub keyframe_id: String,
    /// CHANGES stream's last sequence when the run started.
    pub changes_seq: u64,
    /// `None`: every place of the partition.
    pub place: Option<PlaceKey>,
    pub progress: Arc<JobProgress>,
}

/// Shared by the workers taking part in one keyframe; the last to finish
/// sends the reply.
pub struct JobProgress {
    pub keyframe_id: String,
    pub replica: u32,
    remaining: AtomicUsize,
    places: AtomicU32,
    records: AtomicU64,
    errors: Mutex<Vec<String>>,
    done: Mutex<Option<oneshot::Sender<KeyframeReply>>>,
    started: Instant,
}

impl JobProgress {
    /// `workers` jobs will report; `done` receives the reply.
    pub fn new(
        keyframe_id: String,
        replica: u32,
        workers: usize,
        done: Option<oneshot::Sender<KeyframeReply>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            keyframe_id,
            replica,
            remaining: AtomicUsize::new(workers),
            places: AtomicU32::new(0),
            records: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            done: Mutex::new(done),
            started: Instant::now(),
        })
    }

    pub fn place_done(&self, records: u64) {
        self.places.fetch_add(1, Ordering::SeqCst);
        self.records.fetch_add(records, Ordering::SeqCst);
    }

    pub async fn place_failed(&self, error: String) {
        self.errors.lock().await.push(error);
    }

    pub async fn worker_done(&self, error: Option<String>) {
        if let Some(e) = error {
            self.errors.lock().await.push(e);
        }
        if self.remaining.fetch_sub(1, Ordering::SeqCst) == 1 {
            let errors = self.errors.lock().await.join("; ");
            let reply = KeyframeReply {
                keyframe_id: self.keyframe_id.clone(),
                places: self.places.load(Ordering::SeqCst),
                records: self.records.load(Ordering::SeqCst),
                error: errors,
                replica: self.replica,
            };
            info!(
                keyframe_id = %reply.keyframe_id,
                places = reply.places,
                records = reply.records,
                elapsed_ms = self.started.elapsed().as_millis() as u64,
                "keyframe published"
            );
            if let Some(tx) = self.done.lock().await.take() {
                let _ = tx.send(reply);
            }
        }
    }
}

/// What bounds the keyframe work of one replica, shared by its workers:
/// places in hand at once, records published per second, and the thread
/// that does the work.
pub struct KeyframeLimits {
    pub permits: Arc<Semaphore>,
    pace: Option<Pace>,
    /// How late the live changes are: paced keyframes give way to them.
    pub live: LiveLateness,
    background: Background,
    /// The keyframes' own NATS and Redis connections, made on the keyframe
    /// thread at first use.
    io: tokio::sync::OnceCell<KeyframeIo>,
}

/// Connections that only keyframes use. Their I/O runs on the keyframe
/// thread (at its lower priority), and the live commands' connections never
/// carry a keyframe's megabytes: a live change published or committed does
/// not wait behind a 250 KB part or scan step on the same socket.
#[derive(Clone)]
pub struct KeyframeIo {
    pub js: async_nats::jetstream::Context,
    pub store: crate::store::Store,
}

impl KeyframeLimits {
    /// `concurrency` places at once; `records_per_s` = 0: unpaced; giving
    /// way to live changes later than `yield_after` (zero: never).
    pub fn new(concurrency: usize, records_per_s: u64, yield_after: Duration) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(concurrency)),
            pace: (records_per_s > 0).then(|| Pace::new(records_per_s)),
            live: LiveLateness::new(yield_after),
            background: Background::start(),
            io: tokio::sync::OnceCell::new(),
        })
    }

    /// The keyframes' own connections, or — when they cannot be made — the
    /// live ones given (tried again next time).
    pub async fn io(&self, config: &crate::config::Config, live: KeyframeIo) -> KeyframeIo {
        let connected = self
            .io
            .get_or_try_init(|| async {
                let client =
                    shelfsync_bus::connect(&config.nats, "shelfsync-storage-keyframes", false)
                        .await?;
                let js = shelfsync_bus::jetstream(client, &config.nats);
                let store = crate::store::Store::connect(&config.redis).await?;
                anyhow::Ok(KeyframeIo { js, store })
            })
            .await;
        match connected {
            Ok(io) => io.clone(),
            Err(e) => {
                warn!(error = %chain(e.as_ref()), "keyframes share the live connections");
                live
            }
        }
    }

    /// Runs `task` (publishing a frozen place) on the keyframe thread.
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self.background.runtime {
            Some(rt) => rt.spawn(task),
            None => tokio::spawn(task),
        }
    }

    /// Waits until `records` more may be published: their share of time at
    /// the keyframe rate, then, while live changes are late, up to twice
    /// that share more. Returns the time given way.
    pub async fn pace(&self, records: usize) -> Duration {
        let Some(p) = &self.pace else { return Duration::ZERO };
        let share = p.take(records).await;
        let most = share * YIELD_MAX_FACTOR;
        let start = Instant::now();
        let mut gave_way = false;
        while self.live.late() {
            let waited = start.elapsed();
            if waited >= most {
                break;
            }
            gave_way = true;
            tokio::time::sleep(YIELD_STEP.min(most - waited)).await;
        }
        if gave_way { start.elapsed().min(most) } else { Duration::ZERO }
    }
}

/// How late the live changes are as storage commits them. Each commit
/// reports the oldest command it holds; one older than the threshold makes
/// the keyframes give way for [`YIELD_HOLD`].
pub struct LiveLateness {
    after_us: i64,
    /// Microseconds since the epoch until which live changes count as late.
    late_until: AtomicI64,
}

impl LiveLateness {
    fn new(after: Duration) -> Self {
        Self { after_us: after.as_micros() as i64, late_until: AtomicI64::new(0) }
    }

    /// A commit of commands published at `oldest_published_us()` at the
    /// earliest (microseconds since the epoch; 0: unknown). Not asked when
    /// giving way is off.
    pub fn committed(&self, oldest_published_us: impl FnOnce() -> i64) {
        if self.after_us == 0 {
            return;
        }
        let oldest_published_us = oldest_published_us();
        if oldest_published_us <= 0 {
            return;
        }
        let now = crate::clock::now_us();
        if now - oldest_published_us > self.after_us {
            self.late_until.fetch_max(now + YIELD_HOLD.as_micros() as i64, Ordering::Relaxed);
        }
    }

    /// Whether live changes were late a moment ago.
    pub fn late(&self) -> bool {
        crate::clock::now_us() < self.late_until.load(Ordering::Relaxed)
    }
}

/// A one-thread runtime whose thread runs at a lower CPU priority (`nice`
/// +5): a keyframe's encoding and its I/O (its own connections, see
/// [`KeyframeIo`]) give way to the live commands, and to the NATS and Redis
/// servers, whenever the CPU is short.
struct Background {
    runtime: Option<tokio::runtime::Runtime>,
}

/// How much lower the keyframe thread's priority is.
const KEYFRAME_NICE: i32 = 5;

impl Background {
    fn start() -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("shelfsync-keyframe")
            .on_thread_start(lower_priority)
            .enable_all()
            .build();
        match runtime {
            Ok(rt) => Self { runtime: Some(rt) },
            Err(e) => {
                tracing::warn!(error = %chain(&e), "no keyframe thread: keyframes run with the live work");
                Self { runtime: None }
            }
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        // Dropped inside the service's runtime: must not block.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Lowers the calling thread's priority (Linux: `setpriority` acts on one
/// thread). Best effort: without it keyframes only run at the live work's
/// priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    if let Err(e) =
        rustix::process::setpriority_process(Some(rustix::thread::gettid()), KEYFRAME_NICE)
    {
        tracing::debug!(error = %chain(&e), "keyframe thread priority unchanged");
    }
}

/// Spreads work at a steady rate: each take books its share of time after
/// the previous ones and waits until that share is over, so that no burst
/// goes beyond the rate, not even the first.
struct Pace {
    per_item: Duration,
    next: std::sync::Mutex<Instant>,
}

impl Pace {
    fn new(per_s: u64) -> Self {
        Self {
            per_item: Duration::from_secs_f64(1.0 / per_s as f64),
            next: std::sync::Mutex::new(Instant::now()),
        }
    }

    /// Books `items` and waits for their turn; returns their share of time.
    async fn take(&self, items: usize) -> Duration {
        let now = Instant::now();
        let share = self.per_item * items as u32;
        let end = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            *next = (*next).max(now) + share;
            *next
        };
        tokio::time::sleep_until(end.into()).await;
        share
    }
}

/// A keyframe id shared by every replica for one schedule tick or request.
pub fn keyframe_id_at(unix_micros: i64) -> String {
    format!("kf-{unix_micros}")
}

/// A place frozen for its keyframe: where it was frozen, and how.
#[derive(Debug, Clone)]
pub(crate) struct Frozen {
    pub keyframe_id: String,
    pub changes_seq: u64,
    pub place: PlaceKey,
    /// The partition's applied command sequence at the freeze.
    pub command_seq: u64,
    pub as_of: i64,
    pub tombstone_cutoff: i64,
}

impl Frozen {
    /// Whether a record counts in the digest: expired tombstones are as
    /// good as purged.
    pub(crate) fn counts(&self, r: &Record) -> bool {
        !(r.deleted && r.updated_at < self.tombstone_cutoff)
    }
}

/// The digest of a frozen place brought up to its marker: each record
/// changed since the freeze leaves the digest as it was frozen (`then`) and
/// enters it as it is now (`now`), each side only if the keyframe counts it
/// (`None`: absent on that side). Pure, so the arithmetic is tested on its
/// own.
pub(crate) fn digest_at_mark<'a>(
    mut digest: Digest,
    f: &Frozen,
    changed: impl IntoIterator<Item = (&'a str, Option<Record>, Option<Record>)>,
) -> Digest {
    for (id, then, now) in changed {
        if let Some(r) = then.filter(|r| f.counts(r)) {
            digest.remove(id, r.updated_at);
        }
        if let Some(r) = now.filter(|r| f.counts(r)) {
            digest.add(id, r.updated_at);
        }
    }
    digest
}

#[cfg(test)]
mod digest_tests {
    use super::*;

    fn frozen(tombstone_cutoff: i64) -> Frozen {
        Frozen {
            keyframe_id: "kf-1".into(),
            changes_seq: 0,
            place: PlaceKey::new(1, 2),
            command_seq: 0,
            as_of: 0,
            tombstone_cutoff,
        }
    }

    fn rec(updated_at: i64, deleted: bool) -> Option<Record> {
        Some(Record { updated_at, deleted, ..Default::default() })
    }

    fn digest_of(records: &[(&str, i64)]) -> Digest {
        let mut d = Digest::default();
        for (id, at) in records {
            d.add(id, *at);
        }
        d
    }

    #[test]
    fn the_marked_digest_is_the_digest_of_the_place_as_it_is_now() {
        let f = frozen(10);
        let at_freeze = digest_of(&[("a", 1), ("b", 2), ("c", 3)]);
        let changed = [
            ("b", rec(2, false), rec(5, false)), // updated
            ("c", rec(3, false), rec(6, true)),  // deleted, tombstone already expired
            ("d", None, rec(7, false)),          // created
            ("a", rec(1, false), rec(1, false)), // written back unchanged
        ];
        let marked = digest_at_mark(at_freeze, &f, changed);
        assert_eq!(marked, digest_of(&[("a", 1), ("b", 5), ("d", 7)]));
    }

    #[test]
    fn a_record_not_counted_when_frozen_is_not_removed_twice() {
        let f = frozen(10);
        // "e" was an expired tombstone at the freeze (not in the digest),
        // and is back since.
        let at_freeze = digest_of(&[("a", 1)]);
        let marked = digest_at_mark(at_freeze, &f, [("e", rec(4, true), rec(12, false))]);
        assert_eq!(marked, digest_of(&[("a", 1), ("e", 12)]));
        // A fresh tombstone still counts, frozen or now.
        let marked = digest_at_mark(marked, &f, [("a", rec(1, false), rec(11, true))]);
        assert_eq!(marked, digest_of(&[("a", 11), ("e", 12)]));
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn my_priority() -> i32 {
        rustix::process::getpriority_process(Some(rustix::thread::gettid())).expect("priority")
    }

    #[tokio::test]
    async fn keyframes_run_on_a_thread_of_lower_priority() {
        let limits = KeyframeLimits::new(1, 0, Duration::ZERO);
        let live = my_priority();
        let theirs = limits.spawn(async { my_priority() }).await.expect("task");
        assert_eq!(theirs, (live + KEYFRAME_NICE).min(19), "live thread at {live}");
        // Dropped inside a runtime without a panic.
        drop(limits);
    }

    fn ms_ago(ms: i64) -> i64 {
        crate::clock::now_us() - ms * 1000
    }

    #[test]
    fn only_commands_older_than_the_threshold_make_live_changes_late() {
        let live = LiveLateness::new(Duration::from_millis(20));
        live.committed(|| 0);
        live.committed(|| ms_ago(5));
        assert!(!live.late(), "a fresh commit or an unknown age is not late");
        live.committed(|| ms_ago(50));
        assert!(live.late());
        std::thread::sleep(YIELD_HOLD + Duration::from_millis(5));
        assert!(!live.late(), "late only for a moment after the late commit");

        let never = LiveLateness::new(Duration::ZERO);
        never.committed(|| ms_ago(60_000));
        assert!(!never.late(), "a zero threshold turns giving way off");
    }

    #[tokio::test]
    async fn a_keyframe_gives_way_to_late_live_changes_at_most_twice_its_share() {
        // 1000 records/s: 10 records are a 10 ms share.
        let limits = KeyframeLimits::new(1, 1000, Duration::from_millis(20));
        assert_eq!(limits.pace(10).await, Duration::ZERO, "live changes on time");

        // Late all along: gives way, but only twice its share.
        limits.live.late_until.store(i64::MAX, Ordering::Relaxed);
        assert_eq!(limits.pace(10).await, Duration::from_millis(20));

        // Unpaced keyframes never wait.
        let unpaced = KeyframeLimits::new(1, 0, Duration::from_millis(20));
        unpaced.live.late_until.store(i64::MAX, Ordering::Relaxed);
        assert_eq!(unpaced.pace(1000).await, Duration::ZERO);
    }
}

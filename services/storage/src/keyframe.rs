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

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use prost::Message;
use shelfsync_bus::Publisher;
use shelfsync_bus::digest::Digest;
use shelfsync_proto::{ChangeBatch, KeyframeBatch, KeyframeMark, KeyframeReply, Record, msg_type};
use tokio::sync::{Mutex, Semaphore, oneshot};
use tracing::{info, warn};

use crate::worker::Worker;

/// Records read per HSCAN step: small, because each step holds Redis, and
/// the live commands wait behind it.
const SCAN_COUNT: usize = 250;
/// Records the marker reads back per round trip.
const MARK_CHUNK: usize = 1000;
/// A late live commit makes keyframes give way for this long after it ...
const YIELD_HOLD: Duration = Duration::from_millis(20);
/// ... checked this often.
const YIELD_STEP: Duration = Duration::from_millis(5);
/// A keyframe gives way for at most this many times its share of time
/// (so it goes on at a third of its rate or more).
const YIELD_MAX_FACTOR: u32 = 2;
/// A freeze left behind by a keyframe that never finished expires.
const FROZEN_TTL: std::time::Duration = std::time::Duration::from_secs(6 * 3600);

/// One keyframe request as a worker sees it.
pub struct KeyframeJob {
    pub keyframe_id: String,
    /// CHANGES stream's last sequence when the run started.
    pub changes_seq: u64,
    /// `None`: every place of the partition.
    pub place: Option<(i64, i64)>,
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
    pub async fn io(
        &self,
        settings: &shelfsync_settings::Settings,
        live: KeyframeIo,
    ) -> KeyframeIo {
        let connected = self
            .io
            .get_or_try_init(|| async {
                let client =
                    shelfsync_bus::connect(&settings.nats, "shelfsync-storage-keyframes", false)
                        .await?;
                let js = shelfsync_bus::jetstream(client, &settings.nats);
                let store = crate::store::Store::connect(&settings.redis).await?;
                anyhow::Ok(KeyframeIo { js, store })
            })
            .await;
        match connected {
            Ok(io) => io.clone(),
            Err(e) => {
                warn!(error = format!("{e:#}"), "keyframes share the live connections");
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
        let now = Worker::now_us();
        if now - oldest_published_us > self.after_us {
            self.late_until.fetch_max(now + YIELD_HOLD.as_micros() as i64, Ordering::Relaxed);
        }
    }

    /// Whether live changes were late a moment ago.
    pub fn late(&self) -> bool {
        Worker::now_us() < self.late_until.load(Ordering::Relaxed)
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
                tracing::warn!(error = %e, "no keyframe thread: keyframes run with the live work");
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
        tracing::debug!(error = %e, "keyframe thread priority unchanged");
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
    pub brand_id: i64,
    pub place_id: i64,
    /// The partition's applied command sequence at the freeze.
    pub command_seq: u64,
    pub as_of: i64,
    pub tombstone_cutoff: i64,
}

impl Frozen {
    /// Whether a record counts in the digest: expired tombstones are as
    /// good as purged.
    fn counts(&self, r: &Record) -> bool {
        !(r.deleted && r.updated_at < self.tombstone_cutoff)
    }
}

impl Worker {
    /// Freezes a place (one Redis step). Runs inside the partition's worker
    /// loop, between two command messages, so the frozen place is the place
    /// exactly after the last applied command.
    pub(crate) async fn freeze(
        &self,
        keyframe_id: &str,
        changes_seq: u64,
        brand_id: i64,
        place_id: i64,
    ) -> anyhow::Result<Frozen> {
        let command_seq =
            self.store.freeze_place(self.partition.0, brand_id, place_id, FROZEN_TTL).await?;
        let as_of = Self::now_us();
        Ok(Frozen {
            keyframe_id: keyframe_id.to_string(),
            changes_seq,
            brand_id,
            place_id,
            command_seq,
            as_of,
            tombstone_cutoff: as_of - self.settings.storage.tombstone_ttl.as_micros() as i64,
        })
    }

    /// Publishes a frozen place as `KeyframeBatch`es at the replica's pace,
    /// the last one with the count and digest, then purges keyframes older
    /// than the configured number. Runs in a task while the partition goes
    /// on. Returns the digest of the frozen records.
    pub(crate) async fn publish_frozen(
        &self,
        f: &Frozen,
        io: &KeyframeIo,
        publisher: &mut Publisher,
    ) -> anyhow::Result<Digest> {
        let started = Instant::now();
        let partition = self.partition.0;
        let subject = self.subjects.keyframes(f.brand_id, f.place_id);
        let part_of = |part: u32, records: Vec<Record>, first_seq: Option<u64>| KeyframeBatch {
            keyframe_id: f.keyframe_id.clone(),
            brand_id: f.brand_id,
            place_id: f.place_id,
            part,
            records,
            as_of: f.as_of,
            command_seq: f.command_seq,
            changes_seq: f.changes_seq,
            // Readers find part 0 from the last part.
            first_seq: first_seq.unwrap_or(0),
            tombstone_cutoff: f.tombstone_cutoff,
            ..Default::default()
        };
        let mut digest = Digest::default();
        let mut seen = HashSet::new();
        let mut pending = Vec::new();
        let mut pending_bytes = 0usize;
        let mut part = 0u32;
        let mut first_seq = None;
        // The live records as frozen, then those written since the freeze
        // that the first pass did not meet (deleted since). Each step is
        // read while the one before is encoded and published.
        let scan = |kept: bool, cursor: u64| {
            let (store, b, p) = (io.store.clone(), f.brand_id, f.place_id);
            tokio::spawn(async move {
                store.scan_frozen(partition, b, p, kept, cursor, SCAN_COUNT).await
            })
        };
        let mut kept = false;
        let mut step = scan(kept, 0);
        loop {
            let (next, records) = step.await??;
            let following = match (next, kept) {
                (0, true) => None,
                (0, false) => Some((true, 0)),
                (cursor, kept) => Some((kept, cursor)),
            };
            let next_step = following.map(|(k, cursor)| {
                kept = k;
                scan(k, cursor)
            });
            for r in records {
                let id = r.key.as_ref().map(|k| k.product_id.clone()).unwrap_or_default();
                // Rehashing can repeat a field across HSCAN steps.
                if !seen.insert(id.clone()) || !f.counts(&r) {
                    continue;
                }
                digest.add(&id, r.updated_at);
                let len = r.encoded_len() + 6;
                if !pending.is_empty()
                    && (pending.len() >= 1000 || pending_bytes + len > self.max_bytes)
                {
                    let records = std::mem::take(&mut pending);
                    self.give_way(records.len()).await;
                    let batch = part_of(part, records, first_seq);
                    let seq = self.publish_keyframe(&io.js, &subject, batch, publisher).await?;
                    first_seq.get_or_insert(seq);
                    part += 1;
                    pending_bytes = 0;
                }
                pending_bytes += len;
                pending.push(r);
            }
            match next_step {
                Some(s) => step = s,
                None => break,
            }
        }
        self.give_way(pending.len()).await;
        let mut last = part_of(part, pending, first_seq);
        last.last = true;
        last.total = digest.count;
        last.digest = digest.sum;
        let seq = self.publish_keyframe(&io.js, &subject, last, publisher).await?;
        let first_seq = first_seq.unwrap_or(seq);
        publisher.flush().await?;

        let keep = self.settings.storage.keyframes_kept;
        if let Some(oldest_kept) =
            io.store.keyframe_published(partition, f.brand_id, f.place_id, first_seq, keep).await?
        {
            let stream = io.js.get_stream(self.subjects.keyframes_stream()).await?;
            if let Err(e) = stream.purge().filter(&subject).sequence(oldest_kept).await {
                warn!(%subject, error = %e, "purging old keyframes failed");
            }
        }
        self.stats.add(&self.stats.keyframe_records, digest.count);
        tracing::debug!(
            brand_id = f.brand_id,
            place_id = f.place_id,
            records = digest.count,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "place keyframe published"
        );
        Ok(digest)
    }

    /// Puts the keyframe's marker on the place's change subject. Runs inside
    /// the partition's worker loop, between two command messages, once the
    /// parts are out: the marker goes after every change of the place applied
    /// so far and before any later one, so its digest is the frozen one
    /// brought up to now by the records `changed` since the freeze.
    pub(crate) async fn mark(
        &self,
        f: &Frozen,
        frozen: Digest,
        changed: &HashSet<String>,
        publisher: &mut Publisher,
    ) -> anyhow::Result<u64> {
        let partition = self.partition.0;
        let records = frozen.count;
        let mut digest = frozen;
        let ids: Vec<String> = changed.iter().cloned().collect();
        for chunk in ids.chunks(MARK_CHUNK) {
            let (then, now) =
                self.store.frozen_and_live(partition, f.brand_id, f.place_id, chunk).await?;
            for ((id, then), now) in chunk.iter().zip(then).zip(now) {
                if let Some(r) = then.filter(|r| f.counts(r)) {
                    digest.remove(id, r.updated_at);
                }
                if let Some(r) = now.filter(|r| f.counts(r)) {
                    digest.add(id, r.updated_at);
                }
            }
        }
        let command_seq = self.store.applied_seq(partition).await?;
        let mark = ChangeBatch {
            partition,
            command_seq,
            keyframe: Some(KeyframeMark {
                keyframe_id: f.keyframe_id.clone(),
                total: digest.count,
                digest: digest.sum,
                as_of: f.as_of,
                tombstone_cutoff: f.tombstone_cutoff,
            }),
            ..Default::default()
        };
        publisher
            .publish(
                self.subjects.changes(f.brand_id, f.place_id),
                format!("kfm:{}:{}:{}:{}", f.keyframe_id, f.brand_id, f.place_id, f.as_of),
                msg_type::CHANGE_BATCH,
                None,
                mark.encode_to_vec().into(),
            )
            .await?;
        publisher.flush().await?;
        Ok(records)
    }

    /// Paces `records` (see [`KeyframeLimits::pace`]), counting the time
    /// given way to late live changes.
    async fn give_way(&self, records: usize) {
        let yielded = self.keyframe_limits.pace(records).await;
        if !yielded.is_zero() {
            self.stats.add(&self.stats.keyframe_yield_us, yielded.as_micros() as u64);
            metrics::histogram!(shelfsync_telemetry::names::KEYFRAME_YIELD_SECONDS)
                .record(yielded.as_secs_f64());
        }
    }

    async fn publish_keyframe(
        &self,
        js: &async_nats::jetstream::Context,
        subject: &str,
        batch: KeyframeBatch,
        publisher: &mut Publisher,
    ) -> anyhow::Result<u64> {
        // The first part's sequence is needed for purging, so wait for its
        // ack; later parts are pipelined.
        // `as_of` makes the ids unique per run: a reused keyframe id can never
        // have its parts dropped as duplicates of an earlier run's.
        let id = format!(
            "kf:{}:{}:{}:{}:{}",
            batch.keyframe_id, batch.brand_id, batch.place_id, batch.as_of, batch.part
        );
        if batch.part == 0 {
            // As the publisher does: the message carries the trace context.
            let mut headers = async_nats::HeaderMap::new();
            shelfsync_telemetry::inject(&mut headers);
            let msg = async_nats::jetstream::message::PublishMessage::build()
                .payload(batch.encode_to_vec().into())
                .headers(headers)
                .message_id(&id)
                .header(shelfsync_bus::TYPE_HEADER, msg_type::KEYFRAME_BATCH);
            let ack = js.send_publish(subject.to_string(), msg).await?.await?;
            return Ok(ack.sequence);
        }
        publisher
            .publish(
                subject.to_string(),
                id,
                msg_type::KEYFRAME_BATCH,
                None,
                batch.encode_to_vec().into(),
            )
            .await?;
        Ok(0)
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
        Worker::now_us() - ms * 1000
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

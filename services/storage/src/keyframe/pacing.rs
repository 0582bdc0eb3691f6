//! How keyframes share a replica with the live work: a bound on the places
//! in hand, a pace in records per second that gives way while live changes
//! are late, and a thread of lower priority with connections of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use shelfsync_telemetry::chain;
use tokio::sync::Semaphore;
use tracing::warn;

/// A late live commit makes keyframes give way for this long after it ...
const YIELD_HOLD: Duration = Duration::from_millis(20);
/// ... checked this often.
const YIELD_STEP: Duration = Duration::from_millis(5);
/// A keyframe gives way for at most this many times its share of time
/// (so it goes on at a third of its rate or more).
const YIELD_MAX_FACTOR: u32 = 2;
/// What bounds the keyframe work of one replica, shared by its workers:
/// places in hand at once, records published per second, and the thread
/// that does the work.
pub(crate) struct KeyframeLimits {
    pub(crate) permits: Arc<Semaphore>,
    pace: Option<Pace>,
    /// How late the live changes are: paced keyframes give way to them.
    pub(crate) live: LiveLateness,
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
pub(crate) struct KeyframeIo {
    pub(crate) js: async_nats::jetstream::Context,
    pub(crate) store: crate::store::Store,
}

impl KeyframeLimits {
    /// `concurrency` places at once; `records_per_s` = 0: unpaced; giving
    /// way to live changes later than `yield_after` (zero: never).
    pub(crate) fn new(concurrency: usize, records_per_s: u64, yield_after: Duration) -> Arc<Self> {
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
    pub(crate) async fn io(&self, config: &crate::config::Config, live: KeyframeIo) -> KeyframeIo {
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
    pub(crate) fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
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
    pub(crate) async fn pace(&self, records: usize) -> Duration {
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
pub(crate) struct LiveLateness {
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
    pub(crate) fn committed(&self, oldest_published_us: impl FnOnce() -> i64) {
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
    pub(crate) fn late(&self) -> bool {
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

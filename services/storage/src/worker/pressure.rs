//! Backpressure: a partition waiting for room. Redis out of memory or disk,
//! short of replicas or away, a stream refusing the relay's publishes, NATS
//! away — none of them is the message's fault, so nothing is set aside: the
//! partition retries with a bounded, jittered backoff for as long as it
//! takes. While it waits it is not ready (`/readyz` 503), its
//! `shelfsync_partition_backpressure{partition,cause}` gauge is 1 (the
//! `ShelfsyncBackpressure` alert), every retry is counted, and the episode
//! is logged twice: when it starts (with the error) and when it ends (with
//! how long it lasted).

use std::sync::Arc;
use std::time::{Duration, Instant};

use shelfsync_bus::Partition;
use tracing::{error, info};

use crate::metrics::Stats;
use crate::readiness::{Cause, PartitionHealth};

/// One partition's backpressure episodes.
pub(crate) struct Pressure {
    partition: Partition,
    ready: Arc<PartitionHealth>,
    stats: Arc<Stats>,
    since: std::sync::Mutex<Option<(Instant, Cause)>>,
}

impl Pressure {
    pub(crate) fn new(
        partition: Partition,
        ready: Arc<PartitionHealth>,
        stats: Arc<Stats>,
    ) -> Self {
        Self { partition, ready, stats, since: Default::default() }
    }

    /// The partition waits for `cause` (`error` says what happened): the
    /// first time of an episode it is logged, and the partition held back.
    pub(crate) fn on(&self, cause: Cause, error: &(dyn std::error::Error + 'static)) {
        self.stats.backpressure_retry(cause.label());
        let mut since = self.since.lock().unwrap_or_else(|e| e.into_inner());
        match *since {
            Some((_, was)) if was == cause => return,
            Some((_, was)) => self.stats.backpressure(self.partition, was.label(), false),
            None => {}
        }
        error!(
            partition = %self.partition, cause = cause.label(), error = %shelfsync_telemetry::chain(error),
            "partition waiting for room: nothing is set aside, retrying with backoff until it \
             goes through (docs/OPERATE.md#backpressure)"
        );
        *since = Some((since.map_or_else(Instant::now, |(t, _)| t), cause));
        self.stats.backpressure(self.partition, cause.label(), true);
        self.ready.hold_back(self.partition.0, cause.label());
    }

    /// The partition went through: the episode, if any, is over.
    pub(crate) fn off(&self) {
        let Some((started, cause)) = self.since.lock().unwrap_or_else(|e| e.into_inner()).take()
        else {
            return;
        };
        info!(
            partition = %self.partition, cause = cause.label(), waited = ?started.elapsed(),
            "partition going again"
        );
        self.stats.backpressure(self.partition, cause.label(), false);
        self.ready.release(self.partition.0);
    }
}

/// `base` doubled per attempt up to `max`, then a random part of the last
/// half taken off, so that partitions held back together do not come back
/// all at once.
pub(crate) fn jittered(base: Duration, attempt: u64, max: Duration) -> Duration {
    let full = (base * (1u32 << attempt.saturating_sub(1).min(16))).min(max);
    let half = full / 2;
    half + half.mul_f64(rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_bound_with_jitter() {
        let (base, max) = (Duration::from_millis(100), Duration::from_secs(30));
        for attempt in 1..40 {
            let d = jittered(base, attempt, max);
            let full = (base * (1u32 << (attempt - 1).min(16))).min(max);
            assert!(d >= full / 2 && d <= full, "attempt {attempt}: {d:?} of {full:?}");
        }
        assert!(jittered(base, 1_000, max) <= max);
    }

    #[test]
    fn an_episode_holds_the_partition_back_until_it_goes_through() {
        let ready = Arc::new(PartitionHealth::default());
        ready.expect(0);
        let p = Pressure::new(Partition(3), ready.clone(), Arc::default());
        assert!(ready.is_ready());
        let e = std::io::Error::other("OOM command not allowed");
        p.on(Cause::RedisFull, &e);
        p.on(Cause::RedisFull, &e);
        assert!(!ready.is_ready());
        assert_eq!(ready.held_back().get(&3), Some(&"redis_full"));
        p.off();
        assert!(ready.is_ready());
        p.off();
        assert!(ready.is_ready());
    }
}

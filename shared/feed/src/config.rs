//! How a feed is set up ([`FeedConfig`], [`Bootstrap`]) and what it counts
//! as it runs ([`FeedStatus`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use shelfsync_telemetry::names;

/// How a feed starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bootstrap {
    /// Load the latest keyframes, then tail from where they were taken. The
    /// durable consumer is recreated at every start (state is in memory).
    Keyframe,
    /// No snapshot: resume the durable consumer (new changes only when it is
    /// created). For stateless services whose replicas share one consumer.
    Resume,
}

#[derive(Debug, Clone)]
pub struct FeedConfig {
    /// Durable consumer name: one per service (and per instance when
    /// bootstrapping from keyframes). With `slots`, the names' stem.
    pub name: String,
    /// 0: the consumer is `name`. N > 0: each instance takes the first of
    /// `<name>-0` … `<name>-<N-1>` that no consumer holds yet, so that its
    /// NATS user can be granted exactly those names (NATS permissions
    /// cannot say "names starting with"); a stopped instance frees its own
    /// ([`crate::ChangeFeed::delete_consumer`]), one that died after the
    /// consumer's hour unused.
    pub slots: u32,
    /// The `consumer` label of the feed's lag metric: the same after a
    /// restart, unlike a per-instance `name` (the service's name then).
    pub metric_label: String,
    pub brand: Option<i64>,
    pub place: Option<i64>,
    pub bootstrap: Bootstrap,
    /// Ask storage for a keyframe when a bootstrap finds none.
    pub request_keyframe_if_missing: bool,
    /// How many storage replicas answer such a request (each keyframes
    /// the partitions it owns): the deployment's `storage.replicas`.
    pub keyframe_responders: u32,
    pub ack_wait: Duration,
    /// Messages in flight to this consumer.
    pub max_ack_pending: i64,
}

impl FeedConfig {
    /// A consumer named `name`, its metrics labelled `name` too.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        Self {
            metric_label: name.clone(),
            name,
            slots: 0,
            brand: None,
            place: None,
            bootstrap: Bootstrap::Keyframe,
            request_keyframe_if_missing: true,
            keyframe_responders: 1,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
        }
    }
}

/// Counters a service exposes (readiness, metrics, tests).
#[derive(Debug, Default)]
pub struct FeedStatus {
    pub bootstrapped: AtomicBool,
    /// Records delivered to the handler (snapshot ones included).
    pub delivered: AtomicU64,
    /// Changes skipped as not newer than what was delivered.
    pub duplicates: AtomicU64,
    pub keyframe_checks: AtomicU64,
    pub drift_repairs: AtomicU64,
    pub poison: AtomicU64,
    /// CHANGES stream sequence of the last message handled.
    pub position: AtomicU64,
}

impl FeedStatus {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    /// True once the bootstrap is done (or was not needed): the feed is
    /// live, what readiness probes wait for.
    pub fn is_bootstrapped(&self) -> bool {
        self.bootstrapped.load(Ordering::SeqCst)
    }

    /// Publishes these counters as the process's `shelfsync_feed_*`
    /// metrics (one feed per service process); drift repairs are counted
    /// where they happen. Call it inside `render_metrics_after`.
    pub fn record_metrics(&self) {
        metrics::counter!(names::FEED_DELIVERED).absolute(Self::get(&self.delivered));
        metrics::counter!(names::FEED_DUPLICATES).absolute(Self::get(&self.duplicates));
        metrics::counter!(names::FEED_POISON).absolute(Self::get(&self.poison));
        metrics::gauge!(names::FEED_POSITION).set(Self::get(&self.position) as f64);
    }
}

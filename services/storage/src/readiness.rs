//! What storage's readiness follows (`/readyz`, the shared probes that
//! `read::probes` builds): every owned partition bound, none refused, none
//! held back by backpressure, not draining; and why a partition is refused
//! or held back.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Why a partition applies nothing until an operator acts (`shelfsync
/// rebase`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Its command stream was replaced (sequences restarted): `found` is
    /// the identity of the stream found.
    StreamReplaced { found: String },
    /// The command message it was applying in steps (`step`, as recorded)
    /// is gone from the command stream: its rest can never be applied.
    StepGone { step: String },
}

/// Why a partition waits for room (the backpressure metric's `cause` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// Redis refuses writes for want of room: `OOM`, `MISCONF` (a full
    /// disk), `NOREPLICAS`.
    RedisFull,
    /// Redis away, restarting, failing over, or refusing for another
    /// reason that is not the input's.
    Redis,
    /// Redis replicas did not confirm a commit in time (`redis.wait_replicas`).
    RedisReplicas,
    /// JetStream answered and refused a publish (a stream or account out of
    /// room, a stream misconfigured).
    NatsRefused,
    /// NATS away or not answering.
    Nats,
}

impl Cause {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Cause::RedisFull => "redis_full",
            Cause::Redis => "redis",
            Cause::RedisReplicas => "redis_replicas",
            Cause::NatsRefused => "nats_refused",
            Cause::Nats => "nats",
        }
    }
}

/// The state of this replica's partitions that its readiness follows: ready
/// once every owned partition's consumer is bound, until shutdown starts;
/// not ready while a partition is refused or held back.
#[derive(Debug, Default)]
pub struct PartitionHealth {
    want: AtomicUsize,
    bound: AtomicUsize,
    draining: AtomicBool,
    refused: std::sync::Mutex<BTreeMap<u32, Refusal>>,
    /// Partitions waiting for room, with the cause.
    held_back: std::sync::Mutex<BTreeMap<u32, &'static str>>,
}

impl PartitionHealth {
    /// `workers` partition workers will report as bound.
    pub fn expect(&self, workers: usize) {
        self.want.store(workers, Ordering::SeqCst);
    }
    pub fn worker_bound(&self) {
        self.bound.fetch_add(1, Ordering::SeqCst);
    }
    /// Shutdown started: not ready any more.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
    pub fn is_ready(&self) -> bool {
        !self.is_draining()
            && self.bound.load(Ordering::SeqCst) >= self.want.load(Ordering::SeqCst)
            && self.refused().is_empty()
            && self.held_back().is_empty()
    }
    /// `partition` applies nothing until an operator acts.
    pub fn refuse(&self, partition: u32, why: Refusal) {
        lock(&self.refused).insert(partition, why);
    }
    pub fn unrefuse(&self, partition: u32) {
        lock(&self.refused).remove(&partition);
    }
    /// The refused partitions and why.
    pub fn refused(&self) -> BTreeMap<u32, Refusal> {
        lock(&self.refused).clone()
    }
    /// `partition` waits for room (`cause`: the backpressure metric's label).
    pub fn hold_back(&self, partition: u32, cause: &'static str) {
        lock(&self.held_back).insert(partition, cause);
    }
    pub fn release(&self, partition: u32) {
        lock(&self.held_back).remove(&partition);
    }
    /// The partitions waiting for room, with the cause.
    pub fn held_back(&self) -> BTreeMap<u32, &'static str> {
        lock(&self.held_back).clone()
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_every_worker_is_bound_and_not_while_draining() {
        let r = PartitionHealth::default();
        r.expect(2);
        assert!(!r.is_ready());
        r.worker_bound();
        assert!(!r.is_ready());
        r.worker_bound();
        assert!(r.is_ready());
        r.drain();
        assert!(!r.is_ready() && r.is_draining());
    }

    #[test]
    fn not_ready_while_a_partition_is_refused_or_held_back() {
        let r = PartitionHealth::default();
        r.expect(0);
        r.refuse(1, Refusal::StepGone { step: "7|1|0|0|0|0|0|0".into() });
        assert!(!r.is_ready());
        r.unrefuse(1);
        r.hold_back(2, "redis_full");
        assert!(!r.is_ready());
        r.release(2);
        assert!(r.is_ready());
    }
}

//! Counters of the storage process, read by tests, the CLI and metrics
//! (the Prometheus ones are recorded next to them), and its readiness.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Ready once every owned partition's consumer is bound, until shutdown
/// starts (`/readyz`); not ready while a partition is refused.
#[derive(Debug, Default)]
pub struct Readiness {
    want: AtomicUsize,
    bound: AtomicUsize,
    draining: AtomicBool,
    /// Partitions refused because their command stream was replaced, with
    /// the identity of the stream found.
    refused: std::sync::Mutex<std::collections::BTreeMap<u32, String>>,
}

impl Readiness {
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
    }
    /// `partition` applies nothing: its command stream is now `found`.
    pub fn refuse(&self, partition: u32, found: String) {
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).insert(partition, found);
    }
    pub fn unrefuse(&self, partition: u32) {
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).remove(&partition);
    }
    /// The refused partitions and the identity of the stream each found.
    pub fn refused(&self) -> std::collections::BTreeMap<u32, String> {
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[derive(Debug, Default)]
pub struct Stats {
    /// Command messages committed.
    pub batches: AtomicU64,
    /// Redelivered command messages skipped as already applied.
    pub batches_skipped: AtomicU64,
    /// Command messages read from the stream behind the one delivered and
    /// committed with it (counted in `batches` too); acked unread later.
    pub batches_ahead: AtomicU64,
    pub commands: AtomicU64,
    pub applied: AtomicU64,
    /// Applied commands that changed nothing observable.
    pub unchanged: AtomicU64,
    /// Unchanged commands the partition owner vouched for without reading
    /// Redis (counted in `unchanged` too; `crate::known`).
    pub known_skipped: AtomicU64,
    pub changes: AtomicU64,
    pub rejected: AtomicU64,
    pub sweeps: AtomicU64,
    pub published: AtomicU64,
    /// Payload bytes of the change batches published (the "bytes out").
    pub change_bytes: AtomicU64,
    pub purged: AtomicU64,
    pub retries: AtomicU64,
    pub fenced: AtomicU64,
    /// Times a partition was refused (its command stream replaced).
    pub refused: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub keyframe_records: AtomicU64,
    /// Time keyframes gave way to late live changes, microseconds.
    pub keyframe_yield_us: AtomicU64,
    /// Longest time one place's keyframe held its partition, microseconds.
    pub keyframe_place_max_us: AtomicU64,
}

impl Stats {
    pub fn add(&self, counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
    pub fn observe_keyframe_place(&self, took: std::time::Duration) {
        self.keyframe_place_max_us.fetch_max(took.as_micros() as u64, Ordering::Relaxed);
    }
    /// Every counter by name.
    pub fn to_json(&self) -> serde_json::Value {
        let g = Self::get;
        serde_json::json!({
            "batches": g(&self.batches),
            "batches_skipped": g(&self.batches_skipped),
            "batches_ahead": g(&self.batches_ahead),
            "commands": g(&self.commands),
            "applied": g(&self.applied),
            "unchanged": g(&self.unchanged),
            "known_skipped": g(&self.known_skipped),
            "changes": g(&self.changes),
            "rejected": g(&self.rejected),
            "sweeps": g(&self.sweeps),
            "published": g(&self.published),
            "change_bytes": g(&self.change_bytes),
            "purged": g(&self.purged),
            "retries": g(&self.retries),
            "fenced": g(&self.fenced),
            "refused": g(&self.refused),
            "dead_lettered": g(&self.dead_lettered),
            "keyframe_records": g(&self.keyframe_records),
            "keyframe_place_max_us": g(&self.keyframe_place_max_us),
            "keyframe_yield_us": g(&self.keyframe_yield_us),
        })
    }
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_every_worker_is_bound_and_not_while_draining() {
        let r = Readiness::default();
        r.expect(2);
        assert!(!r.is_ready());
        r.worker_bound();
        assert!(!r.is_ready());
        r.worker_bound();
        assert!(r.is_ready());
        r.drain();
        assert!(!r.is_ready() && r.is_draining());
    }
}

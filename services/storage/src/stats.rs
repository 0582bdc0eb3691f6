//! Counters of the storage process, read by tests, the CLI and metrics.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Stats {
    /// Command messages committed.
    pub batches: AtomicU64,
    /// Redelivered command messages skipped as already applied.
    pub batches_skipped: AtomicU64,
    pub commands: AtomicU64,
    pub applied: AtomicU64,
    /// Applied commands that changed nothing observable.
    pub unchanged: AtomicU64,
    pub changes: AtomicU64,
    pub rejected: AtomicU64,
    pub sweeps: AtomicU64,
    pub published: AtomicU64,
    /// Payload bytes of the change batches published (the "bytes out").
    pub change_bytes: AtomicU64,
    pub purged: AtomicU64,
    pub retries: AtomicU64,
    pub fenced: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub keyframe_records: AtomicU64,
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
            "commands": g(&self.commands),
            "applied": g(&self.applied),
            "unchanged": g(&self.unchanged),
            "changes": g(&self.changes),
            "rejected": g(&self.rejected),
            "sweeps": g(&self.sweeps),
            "published": g(&self.published),
            "change_bytes": g(&self.change_bytes),
            "purged": g(&self.purged),
            "retries": g(&self.retries),
            "fenced": g(&self.fenced),
            "dead_lettered": g(&self.dead_lettered),
            "keyframe_records": g(&self.keyframe_records),
            "keyframe_place_max_us": g(&self.keyframe_place_max_us),
        })
    }
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

//! Storage's readiness (`/readyz`): every owned partition bound, no
//! partition refused, not draining.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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

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
//!
//! This module: a keyframe job, its progress and the frozen place's
//! digest; `pacing`: how fast and on which thread keyframes run;
//! `schedule`: the keyframer that starts them (cron schedule, requests);
//! the worker's `keyframes` module freezes, publishes and marks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use shelfsync_bus::digest::Digest;
use shelfsync_proto::{KeyframeReply, PlaceKey, Record};
use tokio::sync::{Mutex, oneshot};
use tracing::info;

mod pacing;
mod schedule;

pub(crate) use pacing::{KeyframeIo, KeyframeLimits};
pub(crate) use schedule::{Keyframer, schedule_keyframes};

/// Records read per HSCAN step: small, because each step holds Redis, and
/// the live commands wait behind it.
pub(crate) const SCAN_COUNT: usize = 250;
/// Records the marker reads back per round trip.
pub(crate) const MARK_CHUNK: usize = 1000;
/// A freeze left behind by a keyframe that never finished expires.
pub(crate) const FROZEN_TTL: std::time::Duration = std::time::Duration::from_secs(6 * 3600);

/// One keyframe request as a worker sees it.
pub(crate) struct KeyframeJob {
    pub(crate) keyframe_id: String,
    /// CHANGES stream's last sequence when the run started.
    pub(crate) changes_seq: u64,
    /// `None`: every place of the partition.
    pub(crate) place: Option<PlaceKey>,
    pub(crate) progress: Arc<JobProgress>,
}

/// Shared by the workers taking part in one keyframe; the last to finish
/// sends the reply.
pub(crate) struct JobProgress {
    pub(crate) keyframe_id: String,
    pub(crate) replica: u32,
    remaining: AtomicUsize,
    places: AtomicU32,
    records: AtomicU64,
    errors: Mutex<Vec<String>>,
    done: Mutex<Option<oneshot::Sender<KeyframeReply>>>,
    started: Instant,
}

impl JobProgress {
    /// `workers` jobs will report; `done` receives the reply.
    pub(crate) fn new(
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

    pub(crate) fn place_done(&self, records: u64) {
        self.places.fetch_add(1, Ordering::SeqCst);
        self.records.fetch_add(records, Ordering::SeqCst);
    }

    pub(crate) async fn place_failed(&self, error: String) {
        self.errors.lock().await.push(error);
    }

    pub(crate) async fn worker_done(&self, error: Option<String>) {
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

/// A keyframe id shared by every replica for one schedule tick or request.
pub(crate) fn keyframe_id_at(unix_micros: i64) -> String {
    format!("kf-{unix_micros}")
}

/// A place frozen for its keyframe: where it was frozen, and how.
#[derive(Debug, Clone)]
pub(crate) struct Frozen {
    pub(crate) keyframe_id: String,
    pub(crate) changes_seq: u64,
    pub(crate) place: PlaceKey,
    /// The partition's applied command sequence at the freeze.
    pub(crate) command_seq: u64,
    pub(crate) as_of: i64,
    pub(crate) tombstone_cutoff: i64,
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

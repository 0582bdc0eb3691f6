//! What the kit remembers of every record it delivered: its `updated_at`
//! (for idempotent apply) and whether it is a tombstone, plus a running
//! digest per place (for the keyframe check). Pure; no I/O.

use std::collections::HashMap;

use shelfsync_bus::digest::Digest;
use shelfsync_proto::{KeyframeMark, PlaceKey as Place};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Known {
    updated_at: i64,
    deleted: bool,
}

#[derive(Debug, Default)]
struct PlaceState {
    records: HashMap<String, Known>,
    digest: Digest,
}

/// Outcome of comparing a place with a keyframe marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    Match,
    /// Our digest differs: the place must be resynced from the keyframe.
    Drift {
        ours: Digest,
        theirs: Digest,
    },
}

#[derive(Debug, Default)]
pub struct FeedState {
    places: HashMap<Place, PlaceState>,
}

impl FeedState {
    /// True when `updated_at` is newer than what was delivered for the record
    /// (a record never seen is always newer).
    pub fn is_newer(&self, place: Place, id: &str, updated_at: i64) -> bool {
        self.places
            .get(&place)
            .and_then(|p| p.records.get(id))
            .is_none_or(|k| updated_at > k.updated_at)
    }

    /// Records that the record was delivered at `updated_at`.
    pub fn record(&mut self, place: Place, id: &str, updated_at: i64, deleted: bool) {
        let p = self.places.entry(place).or_default();
        match p.records.get_mut(id) {
            Some(k) => {
                p.digest.replace(id, k.updated_at, updated_at);
                *k = Known { updated_at, deleted };
            }
            None => {
                p.digest.add(id, updated_at);
                p.records.insert(id.to_string(), Known { updated_at, deleted });
            }
        }
    }

    /// Forgets a place (before loading it from a keyframe).
    pub fn reset_place(&mut self, place: Place) {
        self.places.remove(&place);
    }

    pub fn digest(&self, place: Place) -> Digest {
        self.places.get(&place).map(|p| p.digest).unwrap_or_default()
    }

    /// Compares the place with a keyframe marker, after dropping tombstones
    /// that storage purges (deleted before the marker's cutoff).
    pub fn check(&mut self, place: Place, mark: &KeyframeMark) -> Check {
        if let Some(p) = self.places.get_mut(&place) {
            let expired: Vec<(String, i64)> = p
                .records
                .iter()
                .filter(|(_, k)| k.deleted && k.updated_at < mark.tombstone_cutoff)
                .map(|(id, k)| (id.clone(), k.updated_at))
                .collect();
            for (id, at) in expired {
                p.digest.remove(&id, at);
                p.records.remove(&id);
            }
        }
        let ours = self.digest(place);
        let theirs = Digest { sum: mark.digest, count: mark.total };
        if ours == theirs { Check::Match } else { Check::Drift { ours, theirs } }
    }

    /// Records known, over every place.
    pub fn len(&self) -> usize {
        self.places.values().map(|p| p.records.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn places(&self) -> usize {
        self.places.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: Place = Place::new(7, 1);

    fn mark(d: Digest, cutoff: i64) -> KeyframeMark {
        KeyframeMark {
            digest: d.sum,
            total: d.count,
            tombstone_cutoff: cutoff,
            ..Default::default()
        }
    }

    #[test]
    fn newer_only_and_digest_follows() {
        let mut s = FeedState::default();
        assert!(s.is_newer(P, "a", 5));
        s.record(P, "a", 5, false);
        assert!(!s.is_newer(P, "a", 5));
        assert!(!s.is_newer(P, "a", 4));
        assert!(s.is_newer(P, "a", 6));
        s.record(P, "a", 6, false);
        let mut expected = Digest::default();
        expected.add("a", 6);
        assert_eq!(s.digest(P), expected);
        assert_eq!(s.check(P, &mark(expected, 0)), Check::Match);
    }

    #[test]
    fn expired_tombstones_leave_the_digest_at_a_check() {
        let mut s = FeedState::default();
        s.record(P, "live", 10, false);
        s.record(P, "old-tomb", 20, true);
        s.record(P, "new-tomb", 40, true);
        let mut kf = Digest::default();
        kf.add("live", 10);
        kf.add("new-tomb", 40);
        assert_eq!(s.check(P, &mark(kf, 30)), Check::Match);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn a_missed_change_is_drift() {
        let mut s = FeedState::default();
        s.record(P, "a", 1, false);
        let mut kf = Digest::default();
        kf.add("a", 2);
        assert!(matches!(s.check(P, &mark(kf, 0)), Check::Drift { .. }));
        // An unknown place with records in the keyframe is drift too.
        assert!(matches!(s.check(Place::new(7, 2), &mark(kf, 0)), Check::Drift { .. }));
    }

    proptest! {
        /// Any interleaving and duplication of deliveries ends with the digest
        /// of the newest version of each record.
        #[test]
        fn duplicates_and_reordering_converge(
            events in proptest::collection::vec((0u8..5, 1i64..50), 1..200),
            seed in any::<u64>(),
        ) {
            let mut shuffled = events.clone();
            // Deterministic shuffle plus duplicates.
            let n = shuffled.len();
            for i in 0..n {
                let j = ((seed.wrapping_mul(i as u64 + 1)) % n as u64) as usize;
                shuffled.swap(i, j);
            }
            shuffled.extend(events.iter().take(n / 3).cloned());
            let mut s = FeedState::default();
            for (id, at) in &shuffled {
                let id = format!("r{id}");
                if s.is_newer(P, &id, *at) {
                    s.record(P, &id, *at, false);
                }
            }
            let mut newest: HashMap<String, i64> = HashMap::new();
            for (id, at) in &events {
                let e = newest.entry(format!("r{id}")).or_insert(*at);
                *e = (*e).max(*at);
            }
            let mut expected = Digest::default();
            for (id, at) in &newest {
                expected.add(id, *at);
            }
            prop_assert_eq!(s.digest(P), expected);
        }
    }
}

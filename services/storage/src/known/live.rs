//! The live records of a place, as its partition's owner last saw them:
//! enough to count a sweep's census without scanning the place in Redis.
//!
//! A sweep must know how many of the place's records are live and which of
//! them its import did not carry (`apply::sweep::Census`). Counting that in
//! Redis means reading every record of the place (an `HSCAN` of whole
//! records) at every full import, work proportional to the place rather than
//! to what changed. The owner is the only writer of its partition's keys, so
//! once it has scanned a place it can keep, per live record, its stored
//! generation, and keep that true as it writes:
//! - a place is known only from a complete census: a scan (every record of
//!   the place, read while nothing else writes it), or a commit's load that
//!   found no records hash for it (a place with no record, such as one an
//!   initial import creates, is known from its first commit on);
//! - every commit that writes a record of a known place updates it: a live
//!   record is noted with its generation, an absent or deleted one as stored
//!   but not live (neither is live nor a candidate, so neither counts);
//! - a commit that fails or is fenced, and every (re)bind, forgets all of
//!   it, as for [`super::Known`]; past `capacity` records a place is
//!   forgotten rather than kept in part.
//!
//! Knowing every stored record of a place also tells which are not stored:
//! a commit does not load those from Redis ([`LivePlaces::stored`]), so an
//! initial import reads nothing of its places. Records appear only through
//! commits, which keep this true; a tombstone purge may remove a record
//! kept here as stored, which only costs a load that finds nothing.
//!
//! Records are keyed by the same 128-bit key hash as [`super::Known`].

use std::collections::HashSet;

use shelfsync_proto::PlaceKey;

use super::{Budget, key_hash};
use crate::apply::sweep::Census;
use crate::apply::{FastMap, GenEntry, Slots};

#[derive(Debug)]
pub(crate) struct LivePlaces {
    /// Per known place: its records.
    places: FastMap<PlaceKey, Place>,
    /// Records kept, over all places (taken from `budget`).
    records: usize,
    budget: Budget,
}

/// The stored records of a known place.
#[derive(Debug, Default)]
struct Place {
    /// The live ones, with their generations.
    live: FastMap<u128, i64>,
    /// The others (absent, or deleted and not purged yet): not live, but
    /// stored. A purge may have removed some since; never the reverse.
    gone: FastSet<u128>,
}

impl Place {
    fn len(&self) -> usize {
        self.live.len() + self.gone.len()
    }
}

type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

impl LivePlaces {
    pub(crate) fn new(budget: Budget) -> Self {
        Self { places: FastMap::default(), records: 0, budget }
    }

    pub(crate) fn clear(&mut self) {
        self.budget.give(self.records);
        self.places.clear();
        self.records = 0;
    }

    /// A complete census scan of `place` read these records.
    pub(crate) fn scanned(
        &mut self,
        place: PlaceKey,
        records: impl IntoIterator<Item = (u128, GenEntry)>,
    ) {
        self.forget(place);
        let mut kept = Place::default();
        for (k, e) in records {
            if !e.absent && !e.deleted {
                kept.live.insert(k, e.generation);
            } else {
                kept.gone.insert(k);
            }
        }
        if self.budget.take(kept.len()) {
            self.records += kept.len();
            self.places.insert(place, kept);
        }
    }

    /// Whether a record is stored, if its place is known: a record of a
    /// known place that is not kept is not stored (its load can be skipped).
    pub(crate) fn stored(&self, place: PlaceKey, id: &str) -> Option<bool> {
        let kept = self.places.get(&place)?;
        let k = key_hash(place.brand_id, place.place_id, id);
        Some(kept.live.contains_key(&k) || kept.gone.contains(&k))
    }

    /// A commit wrote these slots (those not dirty were not written).
    pub(crate) fn written(&mut self, slots: &Slots) {
        for ((b, p, id), slot) in slots {
            if !(slot.record_dirty || slot.gen_dirty) {
                continue;
            }
            let place = PlaceKey::new(*b, *p);
            let Some(kept) = self.places.get_mut(&place) else { continue };
            let before = kept.len();
            let k = key_hash(*b, *p, id);
            let e = slot.gen_entry();
            match &slot.record {
                Some(_) if !e.absent && !e.deleted => {
                    kept.live.insert(k, e.generation);
                    kept.gone.remove(&k);
                }
                Some(_) => {
                    kept.live.remove(&k);
                    kept.gone.insert(k);
                }
                None => {
                    kept.live.remove(&k);
                    kept.gone.remove(&k);
                }
            }
            let after = kept.len();
            if after < before {
                self.budget.give(before - after);
                self.records -= before - after;
            } else if self.budget.take(after - before) {
                self.records += after - before;
            } else {
                // Past the bound: forgotten whole (what it held given back).
                self.places.remove(&place);
                self.budget.give(before);
                self.records -= before;
            }
        }
    }

    /// The census of a sweep of `generation` over `place`, if the place is
    /// known; `carried`: the ids its import carried (`None`: none kept).
    pub(crate) fn census(
        &self,
        place: PlaceKey,
        generation: i64,
        carried: Option<&HashSet<String>>,
    ) -> Option<Census> {
        let live = &self.places.get(&place)?.live;
        let carried: FastSet<u128> = carried
            .into_iter()
            .flatten()
            .map(|id| key_hash(place.brand_id, place.place_id, id))
            .collect();
        let mut census = Census::default();
        for (k, &g) in live {
            let e = GenEntry { generation: g, ..Default::default() };
            census.count(&e, generation, carried.contains(k));
        }
        Some(census)
    }

    fn forget(&mut self, place: PlaceKey) {
        if let Some(kept) = self.places.remove(&place) {
            self.records -= kept.len();
            self.budget.give(kept.len());
        }
    }
}

impl Drop for LivePlaces {
    fn drop(&mut self) {
        self.budget.give(self.records);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::Slot;
    use shelfsync_proto::Record;

    const PLACE: PlaceKey = PlaceKey { brand_id: 7, place_id: 1 };

    fn entry(id: &str, generation: i64, absent: bool) -> (u128, GenEntry) {
        (key_hash(7, 1, id), GenEntry { generation, absent, ..Default::default() })
    }

    fn written(id: &str, generation: i64, absent: bool, deleted: bool) -> Slots {
        let slot = Slot {
            record: Some(Record { absent, deleted, ..Default::default() }),
            generation,
            record_dirty: true,
            ..Default::default()
        };
        Slots::from_iter([((7, 1, id.to_string()), slot)])
    }

    fn carried(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_place_is_known_only_from_a_scan() {
        let mut live = LivePlaces::new(Budget::new(10));
        live.written(&written("a", 1, false, false));
        assert_eq!(live.census(PLACE, 2, None), None, "a write alone says nothing of the rest");
        live.scanned(PLACE, [entry("a", 1, false), entry("b", 1, false), entry("c", 1, true)]);
        let census = live.census(PLACE, 2, Some(&carried(&["a"]))).expect("known");
        assert_eq!(census, Census { live: 2, candidates: 1 }, "b was not carried; c is absent");
    }

    #[test]
    fn writes_keep_a_known_place_true() {
        let mut live = LivePlaces::new(Budget::new(10));
        live.scanned(PLACE, [entry("a", 1, false), entry("b", 1, false)]);
        live.written(&written("c", 2, false, false));
        live.written(&written("b", 1, true, false));
        live.written(&written("a", 1, false, true));
        assert_eq!(
            live.census(PLACE, 2, Some(&carried(&[]))),
            Some(Census { live: 1, candidates: 0 }),
            "c is new at generation 2; b was marked absent, a deleted"
        );
        live.written(&written("b", 2, false, false));
        assert_eq!(live.census(PLACE, 3, None), Some(Census { live: 2, candidates: 2 }));
        assert_eq!(live.records, 3, "b and c live, a deleted but stored");
    }

    #[test]
    fn a_known_place_says_which_records_are_stored() {
        let mut live = LivePlaces::new(Budget::new(10));
        assert_eq!(live.stored(PLACE, "a"), None, "an unknown place says nothing");
        live.scanned(PLACE, [entry("a", 1, false), entry("b", 1, true)]);
        assert_eq!(live.stored(PLACE, "a"), Some(true));
        assert_eq!(live.stored(PLACE, "b"), Some(true), "absent, still stored");
        assert_eq!(live.stored(PLACE, "c"), Some(false));
        live.written(&written("c", 2, false, false));
        live.written(&written("a", 2, false, true));
        assert_eq!((live.stored(PLACE, "c"), live.stored(PLACE, "a")), (Some(true), Some(true)));
        assert_eq!(live.census(PLACE, 3, None), Some(Census { live: 1, candidates: 1 }));
        live.clear();
        assert_eq!(live.stored(PLACE, "c"), None);
    }

    #[test]
    fn an_unwritten_slot_changes_nothing() {
        let mut live = LivePlaces::new(Budget::new(10));
        live.scanned(PLACE, [entry("a", 1, false)]);
        let mut slots = written("a", 1, true, false);
        slots.values_mut().for_each(|s| s.record_dirty = false);
        live.written(&slots);
        assert_eq!(live.census(PLACE, 2, None), Some(Census { live: 1, candidates: 1 }));
    }

    #[test]
    fn past_its_capacity_a_place_is_forgotten_whole() {
        let mut live = LivePlaces::new(Budget::new(2));
        live.scanned(PLACE, [entry("a", 1, false), entry("b", 1, false), entry("c", 1, false)]);
        assert_eq!(live.census(PLACE, 2, None), None, "too large to keep");
        live.scanned(PLACE, [entry("a", 1, false), entry("b", 1, false)]);
        assert!(live.census(PLACE, 2, None).is_some());
        live.written(&written("c", 2, false, false));
        assert_eq!(live.census(PLACE, 2, None), None, "grew past it");
        assert_eq!(live.records, 0);
        live.scanned(PLACE, [entry("a", 1, false)]);
        live.clear();
        assert_eq!(live.census(PLACE, 2, None), None);
    }
}

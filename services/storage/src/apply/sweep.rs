//! The pure part of a sweep: which records it may mark absent, whether the
//! evidence it carries allows it (the guard), and marking one record. No I/O:
//! the whole-place sweep of [`super::apply_batch`] and storage's sweep in
//! bounded steps (`crate::worker::sweep`) both decide and mark through here, so they
//! cannot disagree.
//!
//! A full import sweeps only what it had the chance to see. A guarded sweep
//! is **held** instead of applied when there is something to sweep and
//! either no item of the place was accepted (every item rejected, or the
//! place missing from the dump) or it would mark absent more than the
//! guard's `max_fraction` of the place's live records. A held sweep is kept
//! for the place until an operator releases it or a newer sweep of the place
//! supersedes it.

use std::collections::HashMap;

use shelfsync_proto::{Change, ChangeKind, Origin, PlaceKey, RecordKey, Sweep, SweepOutcome};

use super::{GenEntry, Key, Limits, Outcome, Slot, Slots, SweptPlace, bump, change};

/// [`SweepOutcome::status`] values.
pub(crate) mod status {
    pub(crate) const APPLIED: &str = "applied";
    pub(crate) const HELD: &str = "held";
    pub(crate) const REFUSED: &str = "refused";
}

/// [`SweepOutcome::reason`] values.
pub(crate) mod why {
    pub(crate) const NO_ITEM_ACCEPTED: &str = "no_item_accepted";
    pub(crate) const MISSING_FROM_DUMP: &str = "missing_from_dump";
    pub(crate) const OVER_FRACTION: &str = "over_fraction";
    pub(crate) const NOT_HELD: &str = "not_held";
    /// The import had items of the place accepted, but storage keeps no set
    /// of what it carried (expired, or every item was rejected by storage):
    /// it cannot tell what the import left out.
    pub(crate) const NOTHING_CARRIED: &str = "nothing_carried";
}

/// A record with this generation entry is one the sweep marks absent.
pub(crate) fn is_candidate(e: &GenEntry, sweep_generation: i64) -> bool {
    !e.absent && !e.deleted && e.generation < sweep_generation
}

/// What a place holds, as far as a sweep's decision goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Census {
    /// Present and not deleted records.
    pub(crate) live: u64,
    /// Of those, the ones below the sweep's generation that its import did
    /// not carry.
    pub(crate) candidates: u64,
}

impl Census {
    /// Counts one stored record (`carried`: the sweep's import carried it).
    pub(crate) fn count(&mut self, e: &GenEntry, sweep_generation: i64, carried: bool) {
        if !e.absent && !e.deleted {
            self.live += 1;
        }
        if !carried && is_candidate(e, sweep_generation) {
            self.candidates += 1;
        }
    }
}

/// What to do with a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    Apply,
    /// Kept for the place, nothing marked; the reason is one of [`why`].
    Hold(&'static str),
    /// Dropped, nothing marked (an operator's release of a sweep that is not
    /// the one held).
    Refuse(&'static str),
}

/// Decides a sweep from what the place holds, whether storage kept a set of
/// what its import carried (`carried`), and the sweep held for the place (if
/// any).
pub(crate) fn decide(
    sweep: &Sweep,
    census: Census,
    carried: bool,
    held: Option<&SweepOutcome>,
) -> Decision {
    if sweep.release_held {
        let is_held = held
            .and_then(|h| h.sweep.as_ref())
            .is_some_and(|h| h.import_id == sweep.import_id && h.generation == sweep.generation);
        return if is_held { Decision::Apply } else { Decision::Refuse(why::NOT_HELD) };
    }
    let Some(guard) = &sweep.guard else { return Decision::Apply };
    if census.candidates == 0 {
        return Decision::Apply;
    }
    if guard.accepted == 0 {
        return Decision::Hold(if guard.missing {
            why::MISSING_FROM_DUMP
        } else {
            why::NO_ITEM_ACCEPTED
        });
    }
    if !carried {
        return Decision::Hold(why::NOTHING_CARRIED);
    }
    // "More than the fraction": exactly the fraction still sweeps.
    if census.candidates as f64 > guard.max_fraction * census.live as f64 {
        return Decision::Hold(why::OVER_FRACTION);
    }
    Decision::Apply
}

/// Marks the record of `slot` absent if the sweep may (it is live and below
/// the sweep's generation), and returns the change. The slot is left dirty
/// for the commit.
pub(crate) fn mark_absent(
    sweep: &Sweep,
    key: &Key,
    slot: &mut Slot,
    now_us: i64,
) -> Option<Change> {
    if slot.record.is_none() || !is_candidate(&slot.gen_entry(), sweep.generation) {
        return None;
    }
    let before = slot.record.take()?;
    let mut next = before.clone();
    next.absent = true;
    next.updated_at = bump(before.updated_at, now_us);
    slot.record_dirty = true;
    slot.gen_dirty = true;
    slot.absent_index = Some(true);
    let origin = Some(Origin {
        source: sweep.source.clone(),
        import_id: sweep.import_id.clone(),
        published_at: 0,
    });
    let record_key = RecordKey::new(key.0, key.1, key.2.clone());
    let generation = slot.generation;
    let change = change(
        &record_key,
        Some((before, generation)),
        &next,
        ChangeKind::Updated,
        generation,
        origin,
        None,
    );
    slot.record = Some(next);
    Some(change)
}

/// The outcome to keep for a decided sweep.
pub(crate) fn outcome(
    sweep: &Sweep,
    decision: Decision,
    census: Census,
    marked_absent: u64,
    decided_at: i64,
) -> SweepOutcome {
    let (status, reason) = match decision {
        Decision::Apply => (status::APPLIED, ""),
        Decision::Hold(r) => (status::HELD, r),
        Decision::Refuse(r) => (status::REFUSED, r),
    };
    SweepOutcome {
        sweep: Some(sweep.clone()),
        status: status.to_string(),
        reason: reason.to_string(),
        live: census.live,
        candidates: census.candidates,
        marked_absent,
        decided_at,
        command_seq: 0,
    }
}

/// A sweep of a whole place at once: census, decision, marks. Storage
/// applies sweeps in bounded steps instead (`crate::worker::sweep`), through the same
/// decision and marking; this one is the reference the tests hold it to.
pub(super) fn apply_sweep(
    sweep: &Sweep,
    slots: &mut Slots,
    swept: &HashMap<PlaceKey, SweptPlace>,
    limits: &Limits,
    out: &mut Outcome,
) {
    let place = sweep.place();
    let stored = swept.get(&place);
    // What the import carried: in earlier batches, and in this one.
    let this_batch = out.touched.iter().filter(|t| t.of() == (place, sweep.generation));
    let mut carried = stored.and_then(|s| s.touched.get(&sweep.generation).cloned());
    for t in this_batch {
        carried.get_or_insert_default().insert(t.product_id.clone());
    }
    let column: HashMap<&str, GenEntry> = stored
        .map(|s| s.column.iter().map(|(p, e)| (p.as_str(), *e)).collect())
        .unwrap_or_default();
    // Records written earlier in this batch may not be in the stored column.
    let mut products: Vec<String> = column.keys().map(|p| p.to_string()).collect();
    products.extend(
        slots
            .keys()
            .filter(|(b, p, _)| PlaceKey::new(*b, *p) == place)
            .map(|(_, _, id)| id.clone()),
    );
    products.sort();
    products.dedup();
    // A slot touched earlier in this batch is newer than the column.
    let entry = |slots: &Slots, k: &Key| match slots.get(k) {
        Some(slot) => slot.record.is_some().then(|| slot.gen_entry()),
        None => column.get(k.2.as_str()).copied(),
    };
    let spared = |id: &str| carried.as_ref().is_some_and(|c| c.contains(id));
    let mut census = Census::default();
    for id in &products {
        if let Some(e) = entry(slots, &(place.brand_id, place.place_id, id.clone())) {
            census.count(&e, sweep.generation, spared(id));
        }
    }
    let decision = decide(sweep, census, carried.is_some(), stored.and_then(|s| s.held.as_ref()));
    let mut marked = 0;
    if decision == Decision::Apply {
        for id in products.into_iter().filter(|id| !spared(id)) {
            let k = (place.brand_id, place.place_id, id);
            // The store loads every candidate; a missing one is skipped, not guessed.
            let Some(slot) = slots.get_mut(&k) else { continue };
            if let Some(c) = mark_absent(sweep, &k, slot, limits.now_us) {
                marked += 1;
                out.changes.push(c);
            }
        }
    }
    out.sweeps.push(outcome(sweep, decision, census, marked, limits.now_us));
}

/// Sweep candidates of a place: products whose stored generation is below
/// the sweep's, that are neither absent nor deleted, and that the import did
/// not carry (`touched`): the reference the stepped sweep is held to.
#[cfg(test)]
pub(crate) fn sweep_candidates(
    sweep: &Sweep,
    column: &[(String, GenEntry)],
    touched: Option<&std::collections::HashSet<String>>,
) -> Vec<String> {
    column
        .iter()
        .filter(|(p, e)| {
            is_candidate(e, sweep.generation) && !touched.is_some_and(|t| t.contains(p))
        })
        .map(|(p, _)| p.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use shelfsync_proto::SweepGuard;

    use super::*;

    fn guarded(accepted: u64, max_fraction: f64) -> Sweep {
        Sweep {
            brand_id: 7,
            place_id: 42,
            generation: 2,
            import_id: "i2".into(),
            guard: Some(SweepGuard { accepted, max_fraction, missing: false }),
            ..Default::default()
        }
    }

    fn census(live: u64, candidates: u64) -> Census {
        Census { live, candidates }
    }

    #[test]
    fn a_healthy_import_sweeps_up_to_the_fraction_and_holds_beyond_it() {
        let s = guarded(150, 0.5);
        assert_eq!(decide(&s, census(300, 150), true, None), Decision::Apply, "exactly half");
        assert_eq!(decide(&s, census(300, 151), true, None), Decision::Hold(why::OVER_FRACTION));
        assert_eq!(decide(&guarded(1, 1.0), census(300, 299), true, None), Decision::Apply);
    }

    #[test]
    fn no_accepted_item_holds_a_sweep_that_would_mark_anything() {
        assert_eq!(
            decide(&guarded(0, 0.5), census(300, 300), false, None),
            Decision::Hold(why::NO_ITEM_ACCEPTED)
        );
        let missing = Sweep {
            guard: Some(SweepGuard { accepted: 0, max_fraction: 0.5, missing: true }),
            ..guarded(0, 0.5)
        };
        assert_eq!(
            decide(&missing, census(3, 3), false, None),
            Decision::Hold(why::MISSING_FROM_DUMP)
        );
        // Nothing to sweep: nothing to hold either.
        assert_eq!(decide(&guarded(0, 0.5), census(0, 0), false, None), Decision::Apply);
        assert_eq!(decide(&guarded(0, 0.5), census(5, 0), false, None), Decision::Apply);
    }

    #[test]
    fn an_unguarded_sweep_applies_and_a_release_needs_the_held_one() {
        let plain = Sweep { guard: None, ..guarded(0, 0.0) };
        assert_eq!(decide(&plain, census(10, 10), false, None), Decision::Apply);

        let held =
            outcome(&guarded(0, 0.5), Decision::Hold(why::NO_ITEM_ACCEPTED), census(10, 10), 0, 5);
        let release = Sweep { guard: None, release_held: true, ..guarded(0, 0.5) };
        assert_eq!(decide(&release, census(10, 10), false, Some(&held)), Decision::Apply);
        assert_eq!(decide(&release, census(10, 10), false, None), Decision::Refuse(why::NOT_HELD));
        let other = Sweep { import_id: "i3".into(), generation: 3, ..release.clone() };
        assert_eq!(
            decide(&other, census(10, 10), false, Some(&held)),
            Decision::Refuse(why::NOT_HELD)
        );
    }

    #[test]
    fn a_guarded_sweep_without_what_its_import_carried_is_held() {
        let s = guarded(150, 0.5);
        assert_eq!(decide(&s, census(300, 1), false, None), Decision::Hold(why::NOTHING_CARRIED));
        assert_eq!(decide(&s, census(300, 0), false, None), Decision::Apply, "nothing to sweep");
        let plain = Sweep { guard: None, ..s };
        assert_eq!(decide(&plain, census(300, 1), false, None), Decision::Apply);
    }

    #[test]
    fn the_census_counts_live_records_and_candidates() {
        let mut c = Census::default();
        let e =
            |generation, absent, deleted| GenEntry { generation, absent, deleted, updated_at: 0 };
        for entry in [e(1, false, false), e(2, false, false), e(1, true, false), e(1, false, true)]
        {
            c.count(&entry, 2, false);
        }
        assert_eq!(c, census(2, 1));
        c.count(&e(1, false, false), 2, true);
        assert_eq!(c, census(3, 1), "a record the import carried is live, not a candidate");
    }
}

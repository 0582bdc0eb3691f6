//! The touched sets full imports leave, held in memory: what storage keeps
//! in Redis under a place's `t:<generation>` keys (appended by each commit,
//! ended by the sweep that applies). For the in-memory models of storage the
//! tests hold the real one to, so that they keep these sets one way.

use std::collections::{HashMap, HashSet};

use shelfsync_proto::{PlaceKey, SweepOutcome};

use super::Touch;
use super::sweep::status;

/// Per place and full import (its generation), the ids it carried so far.
#[derive(Debug, Default, Clone)]
pub struct TouchedSets(HashMap<(PlaceKey, i64), HashSet<String>>);

impl TouchedSets {
    /// What a commit does to the sets: adds what the batch's full-import
    /// commands carried, and drops the sets of the sweeps it applied.
    pub fn commit(&mut self, touched: &[Touch], sweeps: &[SweepOutcome]) {
        for t in touched {
            self.0.entry(t.of()).or_default().insert(t.product_id.clone());
        }
        for o in sweeps.iter().filter(|o| o.status == status::APPLIED) {
            if let Some(s) = &o.sweep {
                self.0.remove(&(s.place(), s.generation));
            }
        }
    }

    /// Per generation, what full imports carried to `place`: what a sweep
    /// of it reads (`SweptPlace::touched`).
    pub fn of_place(&self, place: PlaceKey) -> HashMap<i64, HashSet<String>> {
        self.0
            .iter()
            .filter(|((p, _), _)| *p == place)
            .map(|((_, generation), ids)| (*generation, ids.clone()))
            .collect()
    }
}

//! A command message carrying sweeps, applied in bounded steps: never one
//! Redis call for a whole place, whatever its size.
//!
//! For each sweep: a census of the place (HSCAN steps over its generation
//! column, read only, sparing what the import carried: its touched set)
//! decides it (`apply::sweep::decide`); a held or refused
//! sweep is recorded in one commit; an applied one marks the place's
//! candidates absent [`SWEEP_STEP`] records per commit. Every commit is
//! fenced like any other and records how far the message got in the
//! partition's step (`{ns:pN}:step`), so a crash anywhere resumes where the
//! last commit left off: the message comes back, the commands and sweeps
//! already done are not done again, and a sweep being applied starts its
//! scan over — marking is idempotent (an absent record is no candidate), and
//! each mark was committed with its change. The partition's applied sequence
//! moves only with the message's last commit. The other partitions go on
//! meanwhile; this one finishes the message before its next one.

use shelfsync_proto::{CommandBatch, RecordKey, Rejection, Sweep, SweepOutcome};
use shelfsync_service::Drain;
use tracing::{debug, warn};

use super::{HandleError, Handled, Worker};
use crate::apply::sweep::{self, Census, Decision};
use crate::apply::touched_set::Appends;
use crate::apply::{GenEntry, apply_batch, reason};
use crate::failpoint;
use crate::outbox::Relay;
use crate::outbox::TraceParts;
use crate::store::{Commit, Fence, Position, StoreError, Writes};

/// Records one sweep step marks absent at most (and generation entries one
/// census step reads).
pub(crate) const SWEEP_STEP: usize = 1000;

/// How far a message applied in steps got, as kept in `{ns:pN}:step`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Step {
    seq: u64,
    commands_done: bool,
    /// Index of the sweep in hand.
    sweep: usize,
    /// The sweep in hand was decided "apply", with this census.
    applying: Option<Census>,
    marked: u64,
    /// Next outbox part number of the message.
    part: u32,
}

impl Step {
    fn new(seq: u64) -> Self {
        Step { seq, ..Default::default() }
    }

    /// The sweep in hand is decided: the next one is in hand, nothing of it
    /// marked yet.
    fn next_sweep(&mut self) {
        self.sweep += 1;
        self.applying = None;
        self.marked = 0;
    }

    fn encode(&self) -> String {
        let (live, candidates) = self.applying.map_or((0, 0), |c| (c.live, c.candidates));
        format!(
            "{}|{}|{}|{}|{live}|{candidates}|{}|{}",
            self.seq,
            u8::from(self.commands_done),
            self.sweep,
            u8::from(self.applying.is_some()),
            self.marked,
            self.part
        )
    }

    fn decode(s: &str) -> Option<Step> {
        let f: Vec<&str> = s.split('|').collect();
        let [seq, commands, sweep, applying, live, candidates, marked, part] = f.as_slice() else {
            return None;
        };
        let census = Census { live: live.parse().ok()?, candidates: candidates.parse().ok()? };
        Some(Step {
            seq: seq.parse().ok()?,
            commands_done: *commands == "1",
            sweep: sweep.parse().ok()?,
            applying: (*applying == "1").then_some(census),
            marked: marked.parse().ok()?,
            part: part.parse().ok()?,
        })
    }
}

/// What every step of a message commits and relays with.
struct StepCtx<'a> {
    fence: &'a mut Fence,
    trace: &'a TraceParts,
    relay: &'a mut Relay,
    shutdown: &'a Drain,
}

impl Worker {
    /// Applies command message `seq` (its commands, then its sweeps) in
    /// bounded, resumable steps.
    pub(crate) async fn apply_in_steps(
        &self,
        seq: u64,
        batch: &CommandBatch,
        trace: &TraceParts,
        relay: &mut Relay,
        shutdown: &Drain,
    ) -> Result<Handled, HandleError> {
        let p = self.partition;
        let at = self.shared.store.position(p).await?;
        self.went_back(&at);
        if seq <= at.applied {
            return Ok(Handled::Skipped);
        }
        let mut step = match Step::decode(&at.step) {
            Some(s) if s.seq == seq => s,
            None if at.step.is_empty() => Step::new(seq),
            _ => return Err(HandleError::StepOfAnother { seq, step: at.step.clone() }),
        };
        let mut fence = Fence { at, stream: self.stream_identity() };
        if !step.commands_done && !batch.commands.is_empty() {
            let commands = CommandBatch { sweeps: Vec::new(), ..batch.clone() };
            let mut loaded = self.shared.store.load(p, &commands).await?;
            if loaded.at != fence.at {
                return Err(HandleError::Fenced);
            }
            let outcome =
                apply_batch(&commands, &mut loaded.slots, &Default::default(), &self.limits());
            step.commands_done = true;
            let (outbox, next_part) = self.outbox(trace, relay).entries(
                seq,
                &seq.to_string(),
                step.part,
                outcome.changes.clone(),
                outcome.rejections.clone(),
            );
            step.part = next_part;
            let writes = Writes {
                slots: Some(&loaded.slots),
                touched: &outcome.touched.iter().collect(),
                outbox: &outbox,
                sweeps: &[],
            };
            self.commit_step(&mut fence, &step, batch.sweeps.is_empty(), &writes, relay, shutdown)
                .await?;
            self.note_changed(&loaded.slots);
            self.shared.stats.applied_batch(&commands, outcome.changes.len() as u64, &outcome);
        }
        step.commands_done = true;
        while step.sweep < batch.sweeps.len() {
            let s = &batch.sweeps[step.sweep];
            let last = step.sweep + 1 == batch.sweeps.len();
            // What the import carried to the place (committed with its commands).
            let carried = self.shared.store.touched(p, s.place(), s.generation).await?;
            let held = self.shared.store.held(p, s.place()).await?;
            // A released sweep marks only what was there when it was held:
            // a record written since (created or changed by a delta) was not
            // there for its import to see.
            let written_by = match (s.release_held, &held) {
                (true, Some(h)) => h.decided_at,
                _ => i64::MAX,
            };
            let spared = |id: &str, e: &GenEntry| {
                e.updated_at > written_by || carried.as_ref().is_some_and(|c| c.contains(id))
            };
            let census = match step.applying {
                Some(census) => census,
                None => {
                    // The owner's memory has no `updated_at`: a release scans.
                    let known = match s.release_held {
                        false => {
                            self.known().live.census(s.place(), s.generation, carried.as_ref())
                        }
                        true => None,
                    };
                    let census = match known {
                        Some(census) => census,
                        None => self.census(s, &spared).await?,
                    };
                    match sweep::decide(s, census, carried.is_some(), held.as_ref()) {
                        Decision::Apply => census,
                        decision => {
                            let ctx = StepCtx { fence: &mut fence, trace, relay, shutdown };
                            self.skip_sweep(s, &mut step, decision, census, last, ctx).await?;
                            self.shared.stats.sweep_done();
                            continue;
                        }
                    }
                }
            };
            step.applying = Some(census);
            // With no candidate there is nothing to find: nothing is written
            // between the census and here (this worker is the place's only
            // writer, one message at a time).
            let (mut cursor, mut scanning) = (0, census.candidates > 0);
            while scanning {
                let (next, column) =
                    self.shared.store.scan_gens(p, s.place(), cursor, SWEEP_STEP).await?;
                let ids: Vec<String> = column
                    .into_iter()
                    .filter(|(id, e)| sweep::is_candidate(e, s.generation) && !spared(id, e))
                    .map(|(id, _)| id)
                    .collect();
                if !ids.is_empty() {
                    let mut slots = self.shared.store.load_place(p, s.place(), &ids).await?;
                    let now = Self::now_us();
                    let mut changes = Vec::new();
                    for id in &ids {
                        let k = (s.brand_id, s.place_id, id.clone());
                        if let Some(slot) = slots.get_mut(&k)
                            && let Some(c) = sweep::mark_absent(s, &k, slot, now)
                        {
                            changes.push(c);
                        }
                    }
                    if !changes.is_empty() {
                        step.marked += changes.len() as u64;
                        let (outbox, next_part) = self.outbox(trace, relay).entries(
                            seq,
                            &seq.to_string(),
                            step.part,
                            changes.clone(),
                            Vec::new(),
                        );
                        step.part = next_part;
                        let writes = Writes {
                            slots: Some(&slots),
                            touched: Appends::none(),
                            outbox: &outbox,
                            sweeps: &[],
                        };
                        self.commit_step(&mut fence, &step, false, &writes, relay, shutdown)
                            .await?;
                        self.note_changed(&slots);
                        self.shared.stats.sweep_changes(changes.len() as u64);
                    }
                }
                (cursor, scanning) = (next, next != 0);
            }
            let mut outcome =
                sweep::outcome(s, Decision::Apply, census, step.marked, Self::now_us());
            outcome.command_seq = seq;
            debug!(
                partition = %self.partition, brand_id = s.brand_id, place_id = s.place_id,
                live = census.live, marked_absent = step.marked, "sweep applied"
            );
            self.shared.stats.sweep_applied();
            step.next_sweep();
            let writes = Writes::decided(&[], &outcome);
            self.commit_step(&mut fence, &step, last, &writes, relay, shutdown).await?;
            self.shared.stats.sweep_done();
        }
        self.shared.stats.sweep_message_done();
        Ok(Handled::Applied)
    }

    /// Records a sweep that is held or refused (nothing marked); a held one
    /// is also published as a `sweep_held` rejection on the place's subject.
    async fn skip_sweep(
        &self,
        s: &Sweep,
        step: &mut Step,
        decision: Decision,
        census: Census,
        last: bool,
        ctx: StepCtx<'_>,
    ) -> Result<(), HandleError> {
        let StepCtx { fence, trace, relay, shutdown } = ctx;
        let seq = step.seq;
        let mut outcome = sweep::outcome(s, decision, census, 0, Self::now_us());
        outcome.command_seq = seq;
        let mut rejections = Vec::new();
        if let Decision::Hold(why) = decision {
            warn!(
                partition = %self.partition, brand_id = s.brand_id, place_id = s.place_id,
                import_id = %s.import_id, why, live = census.live, would_mark_absent = census.candidates,
                "sweep held, nothing marked absent (release it with `shelfsync sweep --import`)"
            );
            self.shared.stats.sweep_held(why);
            rejections.push(held_notice(s, &outcome));
        } else {
            warn!(
                partition = %self.partition, brand_id = s.brand_id, place_id = s.place_id,
                import_id = %s.import_id, why = %outcome.reason, "sweep refused, nothing marked absent"
            );
        }
        let (outbox, next_part) = self.outbox(trace, relay).entries(
            seq,
            &seq.to_string(),
            step.part,
            Vec::new(),
            rejections,
        );
        step.part = next_part;
        step.next_sweep();
        let writes = Writes::decided(&outbox, &outcome);
        self.commit_step(fence, step, last, &writes, relay, shutdown).await
    }

    /// Counts the place's live records and the sweep's candidates (below its
    /// generation and not `spared`: not carried by its import), in HSCAN
    /// steps; what it read makes the place known (`crate::known::live`).
    async fn census(
        &self,
        s: &Sweep,
        spared: &impl Fn(&str, &GenEntry) -> bool,
    ) -> Result<Census, StoreError> {
        self.shared.stats.sweep_scanned();
        let mut census = Census::default();
        let mut read = std::collections::HashMap::new();
        let mut cursor = 0;
        loop {
            let (next, column) =
                self.shared.store.scan_gens(self.partition, s.place(), cursor, SWEEP_STEP).await?;
            for (id, e) in column {
                // A rehash can return a field twice.
                let k = crate::known::key_hash(s.brand_id, s.place_id, &id);
                if read.insert(k, e).is_none() {
                    census.count(&e, s.generation, spared(&id, &e));
                }
            }
            if next == 0 {
                self.known().live.scanned(s.place(), read);
                return Ok(census);
            }
            cursor = next;
        }
    }

    /// Commits one step: the partition moves to `step` — or, with `last`,
    /// to the message applied whole — and the outbox is relayed.
    async fn commit_step(
        &self,
        fence: &mut Fence,
        step: &Step,
        last: bool,
        writes: &Writes<'_>,
        relay: &mut Relay,
        shutdown: &Drain,
    ) -> Result<(), HandleError> {
        let to = if last {
            Position::at(step.seq)
        } else {
            Position { applied: fence.at.applied, step: step.encode() }
        };
        match self.commit(fence, &to, writes).await? {
            Commit::Done => {}
            Commit::Fenced => return Err(HandleError::Fenced),
        }
        fence.at = to;
        failpoint::hit("after_sweep_step");
        self.wait_replicas(shutdown).await?;
        self.relay_until_done(relay, shutdown).await;
        if shutdown.is_started() && !last {
            return Err(HandleError::Stopping);
        }
        Ok(())
    }
}

/// A held sweep as a rejection on its place's subject, so that it shows on
/// the REJECTS stream next to the rejected items of the import.
fn held_notice(s: &Sweep, outcome: &SweepOutcome) -> Rejection {
    Rejection {
        reason: reason::SWEEP_HELD.into(),
        detail: format!(
            "sweep of import {} held ({}): it would mark {} of {} live records absent; \
             release it with `shelfsync sweep --import {}`",
            s.import_id, outcome.reason, outcome.candidates, outcome.live, s.import_id
        ),
        key: Some(RecordKey::new(s.brand_id, s.place_id, "")),
        origin: Some(shelfsync_proto::Origin {
            source: s.source.clone(),
            import_id: s.import_id.clone(),
            published_at: 0,
        }),
        sweep: Some(outcome.clone()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_survives_its_encoding() {
        for step in [
            Step::new(7),
            Step {
                seq: 12,
                commands_done: true,
                sweep: 2,
                applying: Some(Census { live: 300, candidates: 12 }),
                marked: 5,
                part: 9,
            },
        ] {
            assert_eq!(Step::decode(&step.encode()), Some(step));
        }
        assert_eq!(Step::decode("garbage"), None);
        assert_eq!(Step::decode(""), None);
    }
}

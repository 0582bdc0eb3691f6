//! One delivered command message, from the intake to its ack, as one
//! [`Delivery`]: read (decoded and walked), joined by the messages read
//! ahead of it, split by what the owner knows, loaded, applied by the pure
//! core, committed with its outbox in one fenced step (`writes`), relayed,
//! then acked; a failure is retried with backoff, and after enough of them
//! dead-lettered.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use shelfsync_bus::intake::{Intake, Pulled, Up};
use shelfsync_proto::{Change, PlaceKey, Rejection};
use shelfsync_service::Drain;
use shelfsync_telemetry::chain;
use tracing::{Instrument, debug, error, info, warn};

use super::{HandleError, Handled, Worker};
use crate::apply::touched_set::Appends;
use crate::apply::{Limits, Outcome, Slot, Slots, apply_batch, reason};
use crate::failpoint;
use crate::known::{ReadError, Scanned, Split};
use crate::outbox::Relay;
use crate::outbox::{Outbox, TraceParts};
use crate::readiness::Refusal;
use crate::store::{Commit, Fence, Loaded, Position, Writes};

/// A non-transient failure is retried this many deliveries, then the batch
/// is dead-lettered so that it cannot block its partition.
const MAX_FAILED_DELIVERIES: u64 = 5;
/// The longest wait before a failed message is delivered again: short
/// enough that a partition held back for an hour goes on within seconds of
/// room coming back, long enough that waiting costs nothing.
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Messages taken behind the first are committed with it as long as they
/// hold this many commands and sweeps together.
const AHEAD_COMMANDS: usize = 1000;
/// How soon a refused partition's message is delivered again (to see
/// whether an operator acted).
const REFUSED_RETRY: Duration = Duration::from_secs(2);

impl Worker {
    /// Applies what `up` names: a sweep message alone, or command messages
    /// from the first (alone when it failed before, else with those behind
    /// it). A failure leaves the first in place, to be tried again at the
    /// returned time (never skipped: the next waits behind it).
    pub(super) async fn apply_up(
        &self,
        intake: &mut Intake,
        up: Up,
        relay: &mut Relay,
        shutdown: &Drain,
    ) -> Option<Instant> {
        let group = intake.group(up);
        let first = group.first()?;
        let (seq, attempts) = (first.seq, first.attempts);
        let span = shelfsync_telemetry::process_span!(
            "storage.apply_batch",
            self.shared.subjects.template(&first.msg.subject),
            first.msg.subject,
            self.consumer_names()[usize::from(up == Up::Sweep)],
            partition = self.partition.0,
            command_seq = seq,
            delivered = attempts + 1,
            messaging.batch.message_count = tracing::field::Empty,
            shelfsync.command_count = tracing::field::Empty,
            shelfsync.sweep_count = tracing::field::Empty,
            shelfsync.read_ahead = tracing::field::Empty,
        );
        shelfsync_telemetry::set_parent(
            &span,
            shelfsync_telemetry::extract_opt(first.msg.headers.as_ref()),
        );
        let started = Instant::now();
        let result = self.handle(group, relay, shutdown).instrument(span).await;
        self.shared.stats.message_took(started.elapsed());
        match result {
            Ok((handled, taken, applied)) => {
                self.pressure.off();
                self.lift_step_refusal();
                failpoint::hit("after_publish");
                if matches!(handled, Handled::Skipped) {
                    self.shared.stats.skipped_redelivery();
                }
                intake.done(up, taken, applied);
                None
            }
            Err(e) => {
                intake.failed(up);
                let mut delay = self.backoff(attempts + 1);
                match (&e, e.pressure()) {
                    (_, Some(cause)) => self.pressure.on(cause, &e),
                    (HandleError::StepOfAnother { step, .. }, _) => {
                        if self.step_gone(step).await {
                            delay = delay.max(REFUSED_RETRY);
                        }
                    }
                    _ => warn!(
                        partition = %self.partition, seq, attempts = attempts + 1, retry_in = ?delay,
                        error = %chain(&e), "batch not applied; will retry"
                    ),
                }
                self.shared.stats.retried(matches!(e, HandleError::Fenced));
                Some(Instant::now() + delay)
            }
        }
    }

    /// How long a failed delivery waits before the next: doubling from
    /// `storage.retry_delay` up to [`RETRY_MAX`], jittered.
    pub(super) fn backoff(&self, delivered: u64) -> Duration {
        let base = self.shared.config.storage.retry_delay;
        super::pressure::jittered(base, delivered, RETRY_MAX)
    }

    /// A partition refused for a vanished half-applied message applied one
    /// again: an operator dropped the step.
    fn lift_step_refusal(&self) {
        let p = self.partition.0;
        if matches!(self.shared.ready.refused().get(&p), Some(Refusal::StepGone { .. })) {
            info!(partition = %self.partition, "the step was dropped; partition resuming");
            self.shared.ready.unrefuse(p);
            self.shared.stats.partition_resumed(self.partition);
        }
    }

    /// Whether the message the partition was applying in steps (`step`) is
    /// gone from the command stream: then it can never be finished, and the
    /// partition is refused — one error, not ready — until an operator
    /// drops the step (`shelfsync rebase --drop-step`). A message still in
    /// the stream is delivered again and finished first.
    async fn step_gone(&self, step: &str) -> bool {
        let Some(seq) = step.split('|').next().and_then(|s| s.parse::<u64>().ok()) else {
            return false;
        };
        let gone = match self.shared.js.get_stream_no_info(self.shared.subjects.cmd_stream()).await
        {
            Ok(stream) => match stream.get_raw_message(seq).await {
                Ok(_) => false,
                Err(e) => e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound,
            },
            Err(_) => false,
        };
        let refused = self.shared.ready.refused().contains_key(&self.partition.0);
        if gone && !refused {
            error!(
                partition = %self.partition, step, missing_seq = seq,
                "the command message this partition was applying in steps is gone from the \
                 command stream: the partition applies nothing until an operator drops what \
                 was left of it (`shelfsync rebase --drop-step`); nothing is acked or dropped \
                 meanwhile"
            );
            self.shared.stats.partition_refused(self.partition, true);
            self.shared.ready.refuse(self.partition.0, Refusal::StepGone { step: step.into() });
        }
        gone
    }

    /// Applies the first of `group` (and, unless it failed before or
    /// carries sweeps, those behind it that may go with it). `Ok`: how it
    /// went, how many messages it took, and the applied sequence it left.
    async fn handle(
        &self,
        group: &[Pulled],
        relay: &mut Relay,
        shutdown: &Drain,
    ) -> Result<(Handled, usize, u64), HandleError> {
        let first = group.first().expect("called with a message");
        let msg = &first.msg;
        let trace = outbox_trace(msg);
        let mut d =
            Delivery { msg, seq: first.seq, attempts: first.attempts, trace, relay, shutdown };
        let scanned = match self.read(msg.headers.as_ref(), &msg.payload) {
            Ok(m) => m,
            Err((why, detail)) => {
                return Ok((self.dead_letter(&mut d, why, detail).await?, 1, d.seq));
            }
        };
        let (scanned, refused) = self.refuse_foreign_sweeps(scanned, &d);
        let result = if scanned.header.sweeps.is_empty() {
            self.apply_with_ahead(group, scanned, refused, &mut d).await
        } else {
            self.apply_sweeps(scanned, &mut d).await
        };
        self.settle(result, &mut d).await
    }

    /// Sweeps count only on the partition's sweep subject, which only
    /// ingest and the CLI may publish to: any other is taken out of the
    /// message and refused (the rejections returned), and the message's
    /// commands apply as usual.
    fn refuse_foreign_sweeps(
        &self,
        mut scanned: Scanned,
        d: &Delivery<'_>,
    ) -> (Scanned, Vec<Rejection>) {
        let on_sweep_subject =
            d.msg.subject.as_str() == self.shared.subjects.cmd_sweep(self.partition);
        let refused = match on_sweep_subject {
            true => Vec::new(),
            false => std::mem::take(&mut scanned.header.sweeps),
        };
        let refused: Vec<Rejection> = refused.iter().map(forbidden_sweep).collect();
        if !refused.is_empty() {
            warn!(
                partition = %self.partition, seq = d.seq, subject = %d.msg.subject, sweeps = refused.len(),
                "sweeps refused: they did not come on the partition's sweep subject"
            );
        }
        (scanned, refused)
    }

    /// A message without sweeps, with the messages behind it that may go
    /// with it (none when it failed before or had sweeps refused), applied,
    /// committed and relayed.
    async fn apply_with_ahead(
        &self,
        group: &[Pulled],
        scanned: Scanned,
        refused: Vec<Rejection>,
        d: &mut Delivery<'_>,
    ) -> Result<(Handled, usize, u64), HandleError> {
        let span = tracing::Span::current();
        let mut parts = vec![(d.seq, scanned)];
        // A message that failed goes alone; so does one whose sweeps
        // were refused.
        if d.attempts == 0 && refused.is_empty() {
            self.take_behind(group, &mut parts);
            span.record("shelfsync.read_ahead", parts.len() - 1);
        }
        // Messages taken behind are applied with this one: a batch
        // operation in the messaging conventions' sense.
        if parts.len() > 1 {
            span.record("messaging.batch.message_count", parts.len());
        }
        let commands: usize = parts.iter().map(|(_, m)| m.len()).sum();
        span.record("shelfsync.command_count", commands);
        let last = parts.last().map_or(d.seq, |(s, _)| *s);
        match self.apply_and_commit(&parts, refused, d).await? {
            Handled::Applied => {
                failpoint::hit("after_commit");
                self.relay_until_done(d.relay, d.shutdown).await;
                Ok((Handled::Applied, parts.len(), last))
            }
            Handled::Skipped => Ok((Handled::Skipped, parts.len(), last)),
        }
    }

    /// A message with sweeps: decoded whole and applied in steps.
    async fn apply_sweeps(
        &self,
        scanned: Scanned,
        d: &mut Delivery<'_>,
    ) -> Result<(Handled, usize, u64), HandleError> {
        let span = tracing::Span::current();
        span.record("shelfsync.command_count", scanned.len());
        span.record("shelfsync.sweep_count", scanned.header.sweeps.len());
        let batch = scanned.decode_all().map_err(HandleError::Decode)?;
        let handled = self.apply_in_steps(d.seq, &batch, &d.trace, d.relay, d.shutdown).await?;
        Ok((handled, 1, d.seq))
    }

    /// What becomes of a handled message: one applied before is confirmed
    /// and its outbox drained; one that keeps failing for a reason of its
    /// own is dead-lettered.
    async fn settle(
        &self,
        result: Result<(Handled, usize, u64), HandleError>,
        d: &mut Delivery<'_>,
    ) -> Result<(Handled, usize, u64), HandleError> {
        match result {
            Ok((Handled::Skipped, taken, last)) => {
                // Applied before, maybe by an owner that died before its
                // commit reached the replicas: confirmed before the partition
                // moves on, and its outbox drained (the relay waits too).
                self.wait_replicas(d.shutdown).await?;
                d.relay.relay().await?;
                Ok((Handled::Skipped, taken, last))
            }
            Ok(done) => Ok(done),
            Err(e) if e.is_transient() || d.attempts + 1 < MAX_FAILED_DELIVERIES => Err(e),
            Err(e) => {
                let detail = format!("failed {} times: {e}", d.attempts + 1);
                Ok((self.dead_letter(d, reason::FAILED, detail).await?, 1, d.seq))
            }
        }
    }

    /// Appends to `parts` the messages pulled behind the first that may be
    /// committed with it: at most `storage.read_ahead`, 1000 commands
    /// together, stopping before one that cannot be read or carries sweeps
    /// (each goes on its own, in order).
    fn take_behind(&self, group: &[Pulled], parts: &mut Vec<(u64, Scanned)>) {
        let size = |m: &Scanned| m.len() + m.header.sweeps.len();
        let mut total: usize = parts.iter().map(|(_, m)| size(m)).sum();
        let mut contexts = Vec::new();
        for p in group.iter().skip(1).take(self.shared.config.storage.read_ahead) {
            let Ok(scanned) = self.read(p.msg.headers.as_ref(), &p.msg.payload) else { break };
            if !scanned.header.sweeps.is_empty() || total + size(&scanned) > AHEAD_COMMANDS {
                break;
            }
            total += size(&scanned);
            contexts.push(shelfsync_telemetry::extract_opt(p.msg.headers.as_ref()));
            parts.push((p.seq, scanned));
        }
        // Their imports' traces, linked from this apply.
        shelfsync_telemetry::add_links(&tracing::Span::current(), &contexts);
    }

    /// A command message's payload read: decoded as its headers say (within
    /// `storage.max_message_bytes`), its commands counted before anything
    /// is allocated for them, then walked. `Err`: why it can never be
    /// applied (a rejection reason and its detail).
    pub(super) fn read(
        &self,
        headers: Option<&async_nats::HeaderMap>,
        payload: &bytes::Bytes,
    ) -> Result<Scanned, (&'static str, String)> {
        use shelfsync_bus::encoding::EncodingError;
        let plain =
            shelfsync_bus::encoding::decode_within(headers, payload, self.shared.max_decoded)
                .map_err(|e| match e {
                    EncodingError::TooLarge(..) => (reason::TOO_LARGE, e.to_string()),
                    e => (reason::UNDECODABLE, format!("cannot decode CommandBatch: {e}")),
                })?;
        Scanned::read(plain).map_err(|e| match e {
            ReadError::TooMany { .. } => (reason::TOO_LARGE, e.to_string()),
            ReadError::Decode(e) => {
                (reason::UNDECODABLE, format!("cannot decode CommandBatch: {e}"))
            }
        })
    }

    /// Limits and clock of a batch applied now.
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            partition: self.partition.0,
            partitions: self.shared.config.storage.partitions,
            max_record_bytes: self.shared.config.storage.max_record_bytes,
            now_us: Self::now_us(),
        }
    }

    /// How this worker names and sizes its outbox entries.
    pub(crate) fn outbox<'a>(&'a self, trace: &'a TraceParts, relay: &Relay) -> Outbox<'a> {
        Outbox {
            partition: self.partition,
            subjects: &self.shared.subjects,
            max_bytes: self.shared.max_bytes,
            floors: relay.floors(),
            trace,
            epoch: crate::outbox::epoch_of(&self.stream_identity()),
        }
    }

    /// Applies the command messages `parts` (ascending, consecutive on the
    /// partition's subject, no sweeps) in order and commits those not
    /// applied yet as one step.
    pub(super) async fn apply_and_commit(
        &self,
        parts: &[(u64, Scanned)],
        refused: Vec<Rejection>,
        d: &mut Delivery<'_>,
    ) -> Result<Handled, HandleError> {
        let Some(&(last, _)) = parts.last() else { return Ok(Handled::Skipped) };
        let (splits, mut loaded) = self.load_parts(parts).await?;
        let todo: Vec<(u64, &Split)> = parts
            .iter()
            .zip(&splits)
            .map(|((seq, _), split)| (*seq, split))
            .filter(|(seq, _)| *seq > loaded.at.applied)
            .collect();
        if todo.is_empty() {
            debug!(partition = %self.partition, last, applied = loaded.at.applied, "already applied");
            return Ok(Handled::Skipped);
        }
        if !loaded.at.step.is_empty() {
            return Err(HandleError::StepOfAnother { seq: last, step: loaded.at.step });
        }
        let applied = self.apply_parts(&todo, &mut loaded.slots, refused);
        let rejected = applied.rejected_keys();
        let (outbox, _) = self.outbox(&d.trace, d.relay).entries(
            last,
            &last.to_string(),
            0,
            applied.changes,
            applied.rejections,
        );
        failpoint::hit("before_commit");
        let fence = Fence { at: loaded.at.clone(), stream: self.stream_identity() };
        let writes = Writes {
            slots: Some(&loaded.slots),
            touched: &applied.carried,
            outbox: &outbox,
            sweeps: &[],
        };
        // A place that had no record at the load has none but what this
        // commit writes: its census is complete without a scan. Noted before
        // the commit, which adds what it wrote (or, failed, forgets it all).
        for place in &loaded.empty_places {
            self.known().live.scanned(*place, std::iter::empty());
        }
        match self.commit(&fence, &Position::at(last), &writes).await? {
            Commit::Done => {}
            Commit::Fenced => return Err(HandleError::Fenced),
        }
        let commands = todo.iter().flat_map(|(_, s)| &s.rest.commands);
        self.known().committed(&loaded.slots, commands, &rejected);
        self.wait_replicas(d.shutdown).await?;
        self.note_committed(&todo, parts[0].0, &loaded.slots, applied.outcomes);
        Ok(Handled::Applied)
    }

    /// A commit of `todo` (`first`: the delivered message's sequence, the
    /// others were read ahead) confirmed: the places frozen for keyframes
    /// see what changed, the keyframes' pacing how late live changes are,
    /// and the counters what was applied.
    fn note_committed(
        &self,
        todo: &[(u64, &Split)],
        first: u64,
        slots: &Slots,
        outcomes: Vec<(&Split, u64, Outcome)>,
    ) {
        self.note_changed(slots);
        self.shared
            .keyframe_limits
            .live
            .committed(|| oldest_published(todo.iter().map(|(_, s)| *s)));
        let ahead = todo.iter().filter(|(seq, _)| *seq != first).count();
        self.shared.stats.committed(todo.len() as u64, ahead as u64);
        for (split, n_changes, o) in outcomes {
            self.shared.stats.applied(split, n_changes, &o);
        }
    }

    /// Splits `parts` into what this owner can vouch for (neither decoded,
    /// loaded nor applied; what full imports carried with them is appended
    /// all the same) and the rest, and loads the records the rest touches.
    async fn load_parts(
        &self,
        parts: &[(u64, Scanned)],
    ) -> Result<(Vec<Split>, Loaded), HandleError> {
        let messages: Vec<&Scanned> = parts.iter().map(|(_, m)| m).collect();
        loop {
            let splits = self.known().split(&messages).map_err(HandleError::Decode)?;
            // Records the owner knows are not stored are not read.
            let (to_load, not_stored): (Vec<_>, Vec<_>) = {
                let known = self.known();
                crate::apply::keys_of(splits.iter().flat_map(|s| &s.rest.commands))
                    .into_iter()
                    .partition(|(b, p, id)| {
                        known.live.stored(PlaceKey::new(*b, *p), id) != Some(false)
                    })
            };
            let mut loaded = self.shared.store.load_keys(self.partition, to_load).await?;
            // What the owner remembers came from a Redis that has gone:
            // split and loaded again, from Redis alone.
            if self.went_back(&loaded.at) {
                continue;
            }
            loaded.slots.extend(not_stored.into_iter().map(|k| (k, Slot::default())));
            return Ok((splits, loaded));
        }
    }

    /// Applies the messages `todo` in order to `slots`: their changes go
    /// out together, per place, in the order they were applied (under the
    /// last one's sequence), after the `refused` sweeps' rejections.
    fn apply_parts<'s>(
        &self,
        todo: &[(u64, &'s Split)],
        slots: &mut Slots,
        refused: Vec<Rejection>,
    ) -> Applied<'s> {
        let limits = self.limits();
        let mut applied = Applied {
            changes: Vec::new(),
            rejections: refused,
            outcomes: Vec::with_capacity(todo.len()),
            carried: Appends::default(),
        };
        for &(_, split) in todo {
            applied.carried.merge(&split.carried);
            let mut outcome = apply_batch(&split.rest, slots, &HashMap::new(), &limits);
            let n = split.skipped;
            (outcome.applied, outcome.unchanged) = (outcome.applied + n, outcome.unchanged + n);
            self.shared.stats.known_skipped(n);
            let n_changes = outcome.changes.len() as u64;
            applied.changes.append(&mut outcome.changes);
            applied.rejections.extend(outcome.rejections.iter().cloned());
            applied.outcomes.push((split, n_changes, outcome));
        }
        applied.carried.extend(applied.outcomes.iter().flat_map(|(_, _, o)| &o.touched));
        applied
    }
}

/// One delivered command message in hand, from its read to its ack: what
/// it came with, and the relay and shutdown its commit and relay use.
pub(super) struct Delivery<'a> {
    pub(super) msg: &'a jetstream::Message,
    pub(super) seq: u64,
    /// Earlier deliveries of it that failed.
    pub(super) attempts: u64,
    /// The trace context its outbox entries keep.
    pub(super) trace: TraceParts,
    pub(super) relay: &'a mut Relay,
    pub(super) shutdown: &'a Drain,
}

/// What the messages of one commit came to once applied.
struct Applied<'s> {
    changes: Vec<Change>,
    rejections: Vec<Rejection>,
    /// Per message: its split, how many changes it made, its outcome.
    outcomes: Vec<(&'s Split, u64, Outcome)>,
    /// What full imports carried, to append to their touched sets.
    carried: Appends,
}

impl Applied<'_> {
    /// The keys of the commands rejected (the owner learns nothing of them).
    fn rejected_keys(&self) -> Vec<crate::apply::Key> {
        self.rejections
            .iter()
            .filter_map(|r| r.key.as_ref())
            .map(|k| (k.brand_id, k.place_id, k.product_id.clone()))
            .collect()
    }
}

/// A sweep refused because it did not come on its partition's sweep subject.
fn forbidden_sweep(s: &shelfsync_proto::Sweep) -> Rejection {
    Rejection {
        reason: reason::SWEEP_FORBIDDEN.into(),
        detail: format!(
            "sweep of import {} refused: a sweep must travel on its partition's sweep subject \
             (<prefix>.cmd.<partition>.sweep), which only ingest and the operator CLI may \
             publish to; nothing was marked absent",
            s.import_id
        ),
        key: Some(shelfsync_proto::RecordKey::new(s.brand_id, s.place_id, "")),
        origin: Some(shelfsync_proto::Origin {
            source: s.source.clone(),
            import_id: s.import_id.clone(),
            published_at: 0,
        }),
        ..Default::default()
    }
}

/// The trace context and baggage to keep with the outbox entries of `msg`:
/// the current (apply) span's, or — tracing not installed — the message's
/// own.
fn outbox_trace(msg: &jetstream::Message) -> TraceParts {
    let mut cx = shelfsync_telemetry::current_context();
    if !shelfsync_telemetry::is_valid(&cx) {
        cx = shelfsync_telemetry::extract_opt(msg.headers.as_ref());
    }
    shelfsync_telemetry::parts(&cx)
}

/// When the oldest command of `splits` was published, microseconds since
/// the epoch (0: none says).
fn oldest_published<'a>(splits: impl IntoIterator<Item = &'a Split>) -> i64 {
    splits
        .into_iter()
        .flat_map(|s| {
            let b = &s.rest;
            let inherited = (s.skipped as usize > s.skipped_published.len())
                .then(|| b.origin.as_ref().map(|o| o.published_at))
                .flatten();
            b.commands
                .iter()
                .filter_map(move |c| b.origin_of(c))
                .map(|o| o.published_at)
                .chain(s.skipped_published.iter().copied())
                .chain(inherited)
        })
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0)
}

//! One delivered command message applied and committed: decoded, joined by
//! the messages read ahead of it, applied by the pure core, committed with
//! its outbox in one fenced step, relayed, then acked; a failure is retried
//! with backoff, and after enough of them dead-lettered.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use shelfsync_proto::{PlaceKey, Rejection};
use shelfsync_service::Drain;
use shelfsync_telemetry::chain;
use tracing::{Instrument, debug, error, warn};

use super::{HandleError, Handled, Worker};
use crate::apply::touched_set::Appends;
use crate::apply::{Limits, Slot, apply_batch, reason};
use crate::failpoint;
use crate::known::Scanned;
use crate::outbox::Relay;
use crate::outbox::{Outbox, TraceParts};
use crate::store::{Commit, Fence, Position, StoreError, Writes};

/// A non-transient failure is retried this many deliveries, then the batch
/// is dead-lettered so that it cannot block its partition.
const MAX_FAILED_DELIVERIES: u64 = 5;

impl Worker {
    pub(super) async fn process(
        &self,
        msg: jetstream::Message,
        stream: Option<&jetstream::stream::Stream>,
        relay: &mut Relay,
        shutdown: &Drain,
    ) {
        let (seq, delivered, pending) = match msg.info() {
            Ok(info) => (info.stream_sequence, info.delivered.max(1) as u64, info.pending),
            Err(e) => {
                error!(partition = %self.partition, error = %chain(&*e), "message without metadata");
                return;
            }
        };
        if seq <= self.committed_through.load(Ordering::Relaxed) {
            // Committed with an earlier delivery, its outbox relayed since.
            if let Err(e) = msg.ack().await {
                warn!(partition = %self.partition, seq, error = %chain(&*e), "ack failed");
            }
            return;
        }
        // Read ahead only on a first delivery: a message that failed goes alone.
        let ahead = stream.filter(|_| delivered == 1 && pending > 0);
        let span = shelfsync_telemetry::process_span!(
            "storage.apply_batch",
            self.subjects.template(&msg.subject),
            msg.subject,
            self.subjects.storage_consumer(self.partition),
            partition = self.partition.0,
            command_seq = seq,
            delivered,
            messaging.batch.message_count = tracing::field::Empty,
            shelfsync.command_count = tracing::field::Empty,
            shelfsync.sweep_count = tracing::field::Empty,
            shelfsync.read_ahead = tracing::field::Empty,
        );
        shelfsync_telemetry::set_parent(
            &span,
            shelfsync_telemetry::extract_opt(msg.headers.as_ref()),
        );
        let started = Instant::now();
        let result = self
            .handle(&msg, seq, delivered, ahead.map(|s| (s, pending)), relay, shutdown)
            .instrument(span)
            .await;
        self.stats.message_took(started.elapsed());
        match result {
            Ok(handled) => {
                failpoint::hit("after_publish");
                if let Err(e) = msg.ack().await {
                    // Redelivery is harmless: the sequence check skips it.
                    warn!(partition = %self.partition, seq, error = %chain(&*e), "ack failed");
                }
                failpoint::hit("after_ack");
                if matches!(handled, Handled::Skipped) {
                    self.stats.skipped_redelivery();
                }
            }
            Err(e) => {
                let delay = self.backoff(delivered);
                warn!(
                    partition = %self.partition, seq, delivered, retry_in = ?delay,
                    error = %chain(&e), "batch not applied; will retry"
                );
                self.stats.retried(matches!(e, HandleError::Fenced));
                let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
            }
        }
    }

    pub(super) fn backoff(&self, delivered: u64) -> Duration {
        let base = self.config.storage.retry_delay;
        let factor = 1u32 << delivered.saturating_sub(1).min(6);
        (base * factor).min(Duration::from_secs(30))
    }

    pub(super) async fn handle(
        &self,
        msg: &jetstream::Message,
        seq: u64,
        delivered: u64,
        ahead: Option<(&jetstream::stream::Stream, u64)>,
        relay: &mut Relay,
        shutdown: &Drain,
    ) -> Result<Handled, HandleError> {
        let trace = outbox_trace(msg);
        // What the message says in plain protobuf (it may travel compressed).
        let plain = shelfsync_bus::encoding::decode(msg.headers.as_ref(), &msg.payload);
        let read = plain
            .clone()
            .map_err(|e| e.to_string())
            .and_then(|p| Scanned::read(p).map_err(|e| e.to_string()));
        let mut scanned = match read {
            Ok(m) => m,
            Err(e) => {
                let detail = format!("cannot decode CommandBatch: {e}");
                return self
                    .dead_letter(
                        seq,
                        reason::UNDECODABLE,
                        detail,
                        &msg.payload,
                        &trace,
                        relay,
                        shutdown,
                    )
                    .await;
            }
        };
        // Sweeps count only on the partition's sweep subject, which only
        // ingest and the CLI may publish to: any other is refused, and the
        // message's commands apply as usual.
        let refused = match msg.subject.as_str() == self.subjects.cmd_sweep(self.partition) {
            true => Vec::new(),
            false => std::mem::take(&mut scanned.header.sweeps),
        };
        let refused: Vec<Rejection> = refused.iter().map(forbidden_sweep).collect();
        if !refused.is_empty() {
            warn!(
                partition = %self.partition, seq, subject = %msg.subject, sweeps = refused.len(),
                "sweeps refused: they did not come on the partition's sweep subject"
            );
        }
        let span = tracing::Span::current();
        let result = if scanned.header.sweeps.is_empty() {
            let mut parts = vec![(seq, scanned)];
            if let Some((stream, pending)) = ahead.filter(|_| refused.is_empty()) {
                self.read_ahead(stream, pending, &mut parts).await;
                span.record("shelfsync.read_ahead", parts.len() - 1);
            }
            // Messages read ahead are applied with this one: a batch
            // operation in the messaging conventions' sense.
            if parts.len() > 1 {
                span.record("messaging.batch.message_count", parts.len());
            }
            let commands: usize = parts.iter().map(|(_, m)| m.len()).sum();
            span.record("shelfsync.command_count", commands);
            match self.apply_and_commit(&parts, refused, &trace, relay).await {
                Ok(Handled::Applied) => {
                    failpoint::hit("after_commit");
                    self.relay_until_done(relay, shutdown).await;
                    if !shutdown.is_started() {
                        let last = parts.last().map_or(seq, |(s, _)| *s);
                        self.committed_through.fetch_max(last, Ordering::Relaxed);
                    }
                    Ok(Handled::Applied)
                }
                other => other,
            }
        } else {
            span.record("shelfsync.command_count", scanned.len());
            span.record("shelfsync.sweep_count", scanned.header.sweeps.len());
            match scanned.decode_all() {
                Ok(batch) => self.apply_in_steps(msg, seq, &batch, &trace, relay, shutdown).await,
                Err(e) => Err(HandleError::Decode(e)),
            }
        };
        match result {
            Ok(Handled::Skipped) => {
                // Published or not, a committed outbox is drained before the ack.
                relay.relay().await?;
                Ok(Handled::Skipped)
            }
            Ok(Handled::Applied) => Ok(Handled::Applied),
            Err(e) if e.is_transient() || delivered < MAX_FAILED_DELIVERIES => Err(e),
            Err(e) => {
                let detail = format!("failed {delivered} times: {e}");
                // Decoded above: kept as plain protobuf, readable as is.
                let raw = plain.as_ref().unwrap_or(&msg.payload);
                self.dead_letter(seq, reason::FAILED, detail, raw, &trace, relay, shutdown).await
            }
        }
    }

    /// Limits and clock of a batch applied now.
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            partition: self.partition.0,
            partitions: self.config.storage.partitions,
            max_record_bytes: self.config.storage.max_record_bytes,
            now_us: Self::now_us(),
        }
    }

    /// How this worker names and sizes its outbox entries.
    pub(crate) fn outbox<'a>(&'a self, trace: &'a TraceParts, relay: &Relay) -> Outbox<'a> {
        Outbox {
            partition: self.partition,
            subjects: &self.subjects,
            max_bytes: self.max_bytes,
            floors: relay.floors(),
            trace,
        }
    }

    /// Applies the command messages `parts` (ascending, consecutive on the
    /// partition's subject, no sweeps) in order and commits those not
    /// applied yet as one step.
    pub(super) async fn apply_and_commit(
        &self,
        parts: &[(u64, Scanned)],
        refused: Vec<Rejection>,
        trace: &TraceParts,
        relay: &mut Relay,
    ) -> Result<Handled, HandleError> {
        let Some(&(last, _)) = parts.last() else { return Ok(Handled::Skipped) };
        // Commands this owner can vouch for are neither decoded, loaded nor
        // applied; what full imports carried with them is appended all the same.
        let messages: Vec<&Scanned> = parts.iter().map(|(_, m)| m).collect();
        let splits = self.known().split(&messages).map_err(HandleError::Decode)?;
        // Records the owner knows are not stored are not read.
        let (to_load, not_stored): (Vec<_>, Vec<_>) = {
            let known = self.known();
            crate::apply::keys_of(splits.iter().flat_map(|s| &s.rest.commands))
                .into_iter()
                .partition(|(b, p, id)| known.live.stored(PlaceKey::new(*b, *p), id) != Some(false))
        };
        let mut loaded = self.store.load_keys(self.partition, to_load).await?;
        loaded.slots.extend(not_stored.into_iter().map(|k| (k, Slot::default())));
        let todo: Vec<(u64, &crate::known::Split)> = parts
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
        let limits = self.limits();
        // The changes of all of them go out together, per place, in the
        // order they were applied, under the last one's sequence.
        let (mut changes, mut rejections) = (Vec::new(), refused);
        let mut outcomes = Vec::with_capacity(todo.len());
        let mut carried = Appends::default();
        for (_, split) in &todo {
            carried.merge(&split.carried);
            let mut outcome = apply_batch(&split.rest, &mut loaded.slots, &HashMap::new(), &limits);
            let n = split.skipped;
            (outcome.applied, outcome.unchanged) = (outcome.applied + n, outcome.unchanged + n);
            self.stats.known_skipped(n);
            let n_changes = outcome.changes.len() as u64;
            changes.append(&mut outcome.changes);
            rejections.extend(outcome.rejections.iter().cloned());
            outcomes.push((*split, n_changes, outcome));
        }
        carried.extend(outcomes.iter().flat_map(|(_, _, o)| &o.touched));
        let rejected: Vec<crate::apply::Key> = rejections
            .iter()
            .filter_map(|r| r.key.as_ref())
            .map(|k| (k.brand_id, k.place_id, k.product_id.clone()))
            .collect();
        let (outbox, _) =
            self.outbox(trace, relay).entries(last, &last.to_string(), 0, changes, rejections);
        failpoint::hit("before_commit");
        let fence = Fence { at: loaded.at.clone(), stream: self.stream_identity() };
        let writes =
            Writes { slots: Some(&loaded.slots), touched: &carried, outbox: &outbox, sweeps: &[] };
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
        let applied = todo.iter().flat_map(|(_, s)| &s.rest.commands);
        self.known().committed(&loaded.slots, applied, &rejected);
        self.wait_replicas().await?;
        self.note_changed(&loaded.slots);
        self.keyframe_limits.live.committed(|| oldest_published(todo.iter().map(|(_, s)| *s)));
        let ahead = todo.iter().filter(|(seq, _)| *seq != parts[0].0).count();
        self.stats.committed(todo.len() as u64, ahead as u64);
        for (split, n_changes, o) in outcomes {
            self.stats.applied(split, n_changes, &o);
        }
        Ok(Handled::Applied)
    }

    /// Commits `writes` and keeps [`Known`] true: the records written are
    /// forgotten, and a commit that failed or was fenced (it may have been
    /// written all the same, or another owner wrote) forgets everything.
    pub(crate) async fn commit(
        &self,
        fence: &Fence,
        to: &Position,
        writes: &Writes<'_>,
    ) -> Result<Commit, StoreError> {
        let result = self.store.commit(self.partition, fence, to, writes).await;
        let mut known = self.known();
        match (&result, writes.slots) {
            (Ok(Commit::Done), Some(slots)) => known.forget_written(slots),
            (Ok(Commit::Done), None) => {}
            _ => known.clear(),
        }
        result
    }

    /// With `redis.wait_replicas`, waits until that many Redis replicas have
    /// every write so far (`WAIT`), however many timeouts it takes: a commit
    /// is not published nor acked before.
    pub(crate) async fn wait_replicas(&self) -> Result<(), StoreError> {
        let want = self.config.redis.wait_replicas;
        if want == 0 {
            return Ok(());
        }
        let mut logged = false;
        loop {
            let have = self.store.wait_replicas(want, self.config.redis.wait_timeout).await?;
            if have >= want {
                return Ok(());
            }
            self.stats.redis_wait_retried();
            if !logged {
                warn!(
                    partition = %self.partition, want, have,
                    "Redis replicas did not confirm the commit in time; waiting (nothing is \
                     published or acked before)"
                );
                logged = true;
            }
        }
    }

    /// Relays until the outbox is empty, backing off while NATS or Redis is
    /// away; gives up only on shutdown (the outbox stays for the next run).
    pub(crate) async fn relay_until_done(&self, relay: &mut Relay, shutdown: &Drain) {
        let mut delay = Duration::from_millis(100);
        loop {
            match relay.relay().await {
                Ok(_) => return,
                Err(e) => {
                    warn!(partition = %self.partition, error = %chain(&e), retry_in = ?delay, "outbox relay failed");
                    if shutdown.is_started() {
                        return;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.started() => return,
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
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
fn oldest_published<'a>(splits: impl IntoIterator<Item = &'a crate::known::Split>) -> i64 {
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

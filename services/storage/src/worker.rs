//! One partition's worker: pulls its command messages strictly in order,
//! applies each batch, commits state + outbox + sequence atomically, relays
//! the outbox to JetStream, then acks.
//!
//! Order of effects for one message (crash anywhere is safe):
//! load → apply → **commit** → publish outbox → trim outbox → ack.
//!
//! A crash before the commit changes nothing (the message is redelivered); a
//! crash after it leaves the outbox to be relayed at restart and the message
//! to be skipped as already applied (its sequence is at or below the stored
//! one); an outbox entry relayed again is not stored twice, however late
//! (`crate::relay`). A message with sweeps is applied in bounded steps
//! (`crate::sweep`).
//!
//! The applied sequence counts in one command stream: the partition records
//! the stream's identity (name and creation time) and refuses to go on when
//! the stream it finds is another one (deleted and created again, its
//! sequences restarted) — one clear error, `shelfsync_partition_refused`,
//! not ready — until an operator re-bases it (`shelfsync rebase`).
//!
//! When more messages of the partition wait behind the one delivered (the
//! delivery's `pending`), the worker reads up to `storage.read_ahead` of them
//! straight from the stream (direct get, "next message on this subject after
//! sequence N", so none can be missed or taken out of order) and commits them
//! together with the delivered one: one load, one commit, one relay for all.
//! Their changes go out together: one change batch per place, in apply
//! order, tagged with the last message's sequence. They are acked when the
//! consumer delivers them, with no Redis round trip: their sequence is at or
//! below what this worker committed. Under load the queue makes
//! the batches larger, so the work per message drops when it matters.
//!
//! Tracing: each command message is handled in a CONSUMER span
//! `process <subject>` (`storage.apply_batch`) whose parent is the context
//! in the message's headers; that span's context is kept in the outbox
//! entries, and each entry is published in a PRODUCER span `send <subject>`
//! (`storage.relay`) under it, so the changes continue the import's trace
//! even when they are relayed after a restart.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures::StreamExt;
use prost::Message;
use shelfsync_bus::digest::Digest;
use shelfsync_bus::{Partition, Publisher, Subjects};
use shelfsync_proto::{CommandBatch, Command, CommandKind, Origin, Rejection};
use shelfsync_settings::Settings;
use shelfsync_telemetry::names;
use tokio::sync::{OwnedSemaphorePermit, mpsc, watch};
use tracing::{Instrument, debug, error, info, warn};

use crate::apply::{Limits, apply_batch, reason};
use crate::failpoint;
use crate::keyframe::{Frozen, KeyframeIo, KeyframeJob, KeyframeLimits};
use crate::known::Known;
use crate::outbox::{Outbox, TraceParts};
use crate::relay::Relay;
use crate::stats::{Readiness, Stats};
use crate::store::{Commit, Fence, Position, Store, StoreError, StreamBinding, Writes};
/// A non-transient failure is retried this many deliveries, then the batch
/// is dead-lettered so that it cannot block its partition.
const MAX_FAILED_DELIVERIES: u64 = 5;
/// Raw bytes kept in a dead-letter rejection.
const MAX_RAW: usize = 128 * 1024;
/// Keyframe parts (up to 1000 records, ~250 KB) of one place awaiting their
/// ack. Small: the parts share the server with the live changes, which must
/// not queue behind megabytes of snapshot.
const KEYFRAME_INFLIGHT: usize = 2;
/// Longest wait between two attempts to bind the command consumer.
const CONSUMER_RETRY_MAX: Duration = Duration::from_secs(10);
/// How long a stopping worker waits for a message already on its way.
const HANDBACK_WAIT: Duration = Duration::from_millis(100);
/// Messages read ahead of the delivered one (at most `storage.read_ahead`)
/// are committed with it as long as they hold this many commands and sweeps
/// together.
const AHEAD_COMMANDS: usize = 1000;
/// How long reading ahead pauses after a direct get failed.
const AHEAD_PAUSE: Duration = Duration::from_secs(60);
/// How often a refused partition looks whether an operator re-based it.
const REFUSED_POLL: Duration = Duration::from_secs(2);
/// Absent records purged per round.
const PURGE_BATCH: usize = 1000;

pub struct Worker {
    pub partition: Partition,
    pub settings: Arc<Settings>,
    pub subjects: Subjects,
    pub js: jetstream::Context,
    pub store: Store,
    pub stats: Arc<Stats>,
    /// Largest payload to publish (server max payload minus headroom).
    pub max_bytes: usize,
    /// Told when this worker's consumer is bound (readiness).
    pub ready: Arc<Readiness>,
    /// Places in hand and records per second of keyframes, across the replica.
    pub keyframe_limits: Arc<KeyframeLimits>,
    /// The place frozen for a keyframe, and the records changed since.
    pub changed_since_freeze: std::sync::Mutex<Option<ChangedSinceFreeze>>,
    /// The highest command sequence this worker committed and relayed:
    /// a delivery at or below it was applied ahead and is only acked.
    pub committed_through: AtomicU64,
    /// Reading ahead failed (no permission, a slow server): paused until then.
    pub ahead_paused_until: std::sync::Mutex<Option<Instant>>,
    /// Identity of the command stream this worker is bound to (`Fence.stream`).
    pub stream_identity: std::sync::Mutex<String>,
    /// What this owner can vouch for without Redis (`crate::known`).
    pub known: std::sync::Mutex<Known>,
}

/// One place waiting for its keyframe in this worker.
struct PlaceSnapshot {
    keyframe_id: String,
    changes_seq: u64,
    brand_id: i64,
    place_id: i64,
    progress: std::sync::Arc<crate::keyframe::JobProgress>,
    last_of_job: bool,
}

/// The frozen place and the ids of its records changed since the freeze.
pub type ChangedSinceFreeze = ((i64, i64), HashSet<String>);

/// A place between its freeze and its marker.
struct InHand {
    snapshot: PlaceSnapshot,
    frozen: Frozen,
    started: Instant,
    /// Publishes the parts; gives the frozen digest.
    task: tokio::task::JoinHandle<anyhow::Result<Digest>>,
    span: tracing::Span,
}

pub(crate) enum Handled {
    Applied,
    Skipped,
}

/// Why a command message was not applied this time (it is retried).
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandleError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("outbox relay: {0}")]
    Relay(#[from] crate::relay::RelayError),
    #[error("the partition moved under this worker (another writer, or an operator's re-base)")]
    Fenced,
    #[error("message {seq} arrived while an earlier message is half applied ({step})")]
    StepOfAnother { seq: u64, step: String },
    #[error("stopping between two steps of a message (the next owner resumes it)")]
    Stopping,
}

impl HandleError {
    fn is_transient(&self) -> bool {
        match self {
            HandleError::Store(e) => e.is_transient(),
            HandleError::Relay(_)
            | HandleError::Fenced
            | HandleError::StepOfAnother { .. }
            | HandleError::Stopping => true,
        }
    }
}

mod keyframes;

impl Worker {
    pub(crate) fn now_us() -> i64 {
        crate::clock::now_us()
    }

    /// The command stream and this partition's consumer on it.
    async fn consumer(
        &self,
    ) -> anyhow::Result<(jetstream::stream::Stream, jetstream::consumer::Consumer<pull::Config>)>
    {
        let stream = self.js.get_stream(self.subjects.cmd_stream()).await?;
        let name = self.subjects.storage_consumer(self.partition);
        let config = pull::Config {
            durable_name: Some(name.clone()),
            description: Some(format!("shelfsync storage, partition {}", self.partition)),
            filter_subject: self.subjects.cmd(self.partition),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: self.settings.storage.ack_wait,
            // One message at a time is what keeps a partition in order, also
            // across redeliveries.
            max_ack_pending: 1,
            max_deliver: -1,
            // Its state (what was delivered and acked) is kept in memory, not
            // rewritten to a file up to ten times a second per partition
            // (≈15% of nats-server's CPU under the bench's live load). Nothing rests
            // on it: an acked command is removed from the work-queue stream,
            // a delivered one is applied at most once by its sequence, and a
            // consumer lost with its servers is created again (`bind`).
            memory_storage: true,
            ..Default::default()
        };
        let consumer = stream.get_or_create_consumer(&name, config).await?;
        Ok((stream, consumer))
    }

    /// Binds the partition's consumer and starts pulling, retrying until it
    /// works: many consumers created at once (R3, a busy cluster) can time
    /// out, and one slow answer must not stop the replica. A command stream
    /// other than the one the partition's sequence counts in is refused until
    /// an operator re-bases the partition. `None`: shutdown.
    async fn bind(
        &self,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Option<(jetstream::stream::Stream, pull::Stream)> {
        let mut delay = Duration::from_millis(500);
        let mut refused_logged = false;
        loop {
            let bound = async {
                let (stream, consumer) = self.consumer().await?;
                let identity = stream_identity(&stream);
                match self.store.bind_stream(self.partition.0, &identity).await? {
                    StreamBinding::Same => {}
                    StreamBinding::Replaced { recorded } => {
                        return Ok(Err((identity, recorded)));
                    }
                }
                let messages = shelfsync_bus::pull_messages(&consumer).await?;
                anyhow::Ok(Ok((stream, messages, identity)))
            };
            match bound.await {
                Ok(Ok((stream, messages, identity))) => {
                    if refused_logged {
                        info!(partition = %self.partition, stream = %identity, "partition re-based; resuming");
                    }
                    metrics::gauge!(names::PARTITION_REFUSED, "partition" => self.partition.to_string())
                        .set(0.0);
                    self.ready.unrefuse(self.partition.0);
                    *self.stream_identity.lock().unwrap_or_else(|e| e.into_inner()) = identity;
                    // Sequences may count in a new stream now: nothing is
                    // taken as committed without asking Redis.
                    self.committed_through.store(0, Ordering::Relaxed);
                    // Another owner may have written meanwhile.
                    self.known().clear();
                    return Some((stream, messages));
                }
                Ok(Err((found, recorded))) => {
                    if !refused_logged {
                        self.stats.add(&self.stats.refused, 1);
                        error!(
                            partition = %self.partition, recorded = %recorded, found = %found,
                            "the command stream was replaced (its sequences restarted): this \
                             partition applies nothing until an operator re-bases it \
                             (`shelfsync rebase`); nothing is acked or dropped meanwhile"
                        );
                        refused_logged = true;
                    }
                    metrics::gauge!(names::PARTITION_REFUSED, "partition" => self.partition.to_string())
                        .set(1.0);
                    self.ready.refuse(self.partition.0, found);
                    tokio::select! {
                        _ = stopped(shutdown) => return None,
                        _ = tokio::time::sleep(REFUSED_POLL) => {}
                    }
                }
                Err(e) => {
                    warn!(
                        partition = %self.partition, retry_in = ?delay, error = format!("{e:#}"),
                        "cannot bind the command consumer; retrying"
                    );
                    tokio::select! {
                        _ = stopped(shutdown) => return None,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(CONSUMER_RETRY_MAX);
                }
            }
        }
    }

    /// The identity of the command stream this worker is bound to.
    pub(crate) fn stream_identity(&self) -> String {
        self.stream_identity.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether a pull error means the consumer no longer exists (asked of
    /// the server: a restart of servers that held it in memory, or an
    /// operator, can remove it).
    async fn consumer_missing(&self, e: &jetstream::consumer::pull::MessagesError) -> bool {
        use jetstream::consumer::pull::MessagesErrorKind as K;
        if matches!(e.kind(), K::ConsumerDeleted) {
            return true;
        }
        let name = self.subjects.storage_consumer(self.partition);
        let Ok(stream) = self.js.get_stream_no_info(self.subjects.cmd_stream()).await else {
            return false;
        };
        let info = stream.consumer_info(&name).await;
        info.is_err_and(|e| e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound)
    }

    /// Runs until `shutdown` flips; the message in hand is finished first.
    /// Keyframe jobs are worked off one place at a time, each frozen between
    /// two command messages once a replica-wide permit is free, with ready
    /// messages served first; the place's parts are published by a task while
    /// the partition goes on, and the next place waits for that task.
    pub async fn run(
        self: Arc<Self>,
        mut shutdown: watch::Receiver<bool>,
        mut jobs: mpsc::Receiver<KeyframeJob>,
    ) -> anyhow::Result<()> {
        let mut relay = Relay::start(
            self.partition,
            self.store.clone(),
            self.js.clone(),
            self.subjects.clone(),
            self.settings.nats.max_inflight,
            self.stats.clone(),
        )
        .await;
        // Whatever a previous owner committed but did not publish goes
        // first, also while the partition is refused (it is committed work).
        {
            let span = tracing::info_span!("storage.relay_outbox", partition = self.partition.0);
            self.relay_until_done(&mut relay, &mut shutdown).instrument(span).await;
        }
        let Some((stream, mut messages)) = self.bind(&mut shutdown).await else { return Ok(()) };
        // Keyframe markers.
        let mut publisher = Publisher::new(self.js.clone(), self.settings.nats.max_inflight);
        // For reading ahead (direct gets on the command stream).
        let stream = (stream.cached_info().config.allow_direct
            && self.settings.storage.read_ahead > 0)
            .then_some(stream);
        self.ready.worker_bound();
        let mut purge = tokio::time::interval(self.settings.storage.purge_interval);
        purge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut snapshots: VecDeque<PlaceSnapshot> = VecDeque::new();
        let mut in_hand: Option<InHand> = None;
        // Its own receiver: one the handlers wait on could miss the change.
        let mut stop = shutdown.clone();
        loop {
            if *stop.borrow() {
                break;
            }
            tokio::select! {
                biased;
                _ = stopped(&mut stop) => break,
                next = messages.next() => {
                    let msg = match next {
                        Some(Ok(msg)) => msg,
                        Some(Err(e)) if !self.consumer_missing(&e).await => {
                            warn!(partition = %self.partition, error = %e, "pull failed; retrying");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                        // The consumer is gone (deleted, or its state lost
                        // with the servers): bound again, it starts over from
                        // the oldest message left, as every acked one was
                        // removed (work queue), and sequences already applied
                        // are only acked.
                        _ => {
                            warn!(partition = %self.partition, "command consumer gone; binding it again");
                            let Some((_, m)) = self.bind(&mut shutdown).await else { break };
                            messages = m;
                            continue;
                        }
                    };
                    self.process(msg, stream.as_ref(), &mut relay, &mut shutdown).await;
                }
                Some(job) = jobs.recv() => self.plan_snapshots(job, &mut snapshots).await,
                published = async { (&mut in_hand.as_mut().expect("guarded").task).await },
                    if in_hand.is_some() =>
                {
                    let hand = in_hand.take().expect("guarded");
                    self.finish_snapshot(hand, published, &mut publisher).await;
                }
                permit = self.keyframe_limits.permits.clone().acquire_owned(),
                    if in_hand.is_none() && !snapshots.is_empty() =>
                {
                    if let (Ok(permit), Some(s)) = (permit, snapshots.pop_front()) {
                        in_hand = self.start_snapshot(s, permit).await;
                    }
                }
                _ = purge.tick() => self.purge(&mut relay, &mut shutdown).await,
            }
        }
        // A keyframe on its way is finished, marker included: a reader would
        // otherwise wait for a keyframe that never completes.
        if let Some(mut hand) = in_hand {
            let published = (&mut hand.task).await;
            self.finish_snapshot(hand, published, &mut publisher).await;
        }
        // Stop pulling. With one message unacked at most, the next one may be
        // on its way already: catch it, unsubscribe, then hand it back (nak)
        // so that the next owner gets it at once instead of after the ack
        // wait. Naked before unsubscribing, it would come back to us.
        let held = match tokio::time::timeout(HANDBACK_WAIT, messages.next()).await {
            Ok(Some(Ok(msg))) => Some(msg),
            _ => None,
        };
        drop(messages);
        if let Some(msg) = held {
            let _ = msg.ack_with(AckKind::Nak(None)).await;
        }
        Ok(())
    }

    async fn plan_snapshots(&self, job: KeyframeJob, queue: &mut VecDeque<PlaceSnapshot>) {
        let places = match job.place {
            Some(place) => vec![place],
            None => match self.store.places(self.partition.0).await {
                Ok(p) => p,
                Err(e) => {
                    job.progress
                        .worker_done(Some(format!("partition {}: {e}", self.partition)))
                        .await;
                    return;
                }
            },
        };
        if places.is_empty() {
            job.progress.worker_done(None).await;
            return;
        }
        let n = places.len();
        for (i, (b, p)) in places.into_iter().enumerate() {
            queue.push_back(PlaceSnapshot {
                keyframe_id: job.keyframe_id.clone(),
                changes_seq: job.changes_seq,
                brand_id: b,
                place_id: p,
                progress: job.progress.clone(),
                last_of_job: i + 1 == n,
            });
        }
    }

    /// Freezes one place, then hands the publication of its parts to a task
    /// holding `permit`.
    async fn start_snapshot(
        self: &Arc<Self>,
        s: PlaceSnapshot,
        permit: OwnedSemaphorePermit,
    ) -> Option<InHand> {
        let started = Instant::now();
        let span = tracing::info_span!(
            "storage.keyframe_place",
            partition = self.partition.0,
            keyframe_id = %s.keyframe_id,
            brand_id = s.brand_id,
            place_id = s.place_id,
        );
        let frozen = self
            .freeze(&s.keyframe_id, s.changes_seq, s.brand_id, s.place_id)
            .instrument(span.clone())
            .await;
        self.stats.observe_keyframe_place(started.elapsed());
        let frozen = match frozen {
            Ok(f) => f,
            Err(e) => {
                self.snapshot_done(&s, Err(e), started).await;
                return None;
            }
        };
        *self.changed_since_freeze.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(((s.brand_id, s.place_id), HashSet::new()));
        let this = self.clone();
        let f = frozen.clone();
        let task = self.keyframe_limits.spawn(
            async move {
                let live = KeyframeIo { js: this.js.clone(), store: this.store.clone() };
                let io = this.keyframe_limits.io(&this.settings, live).await;
                let mut publisher = Publisher::new(io.js.clone(), KEYFRAME_INFLIGHT);
                let published = this.publish_frozen(&f, &io, &mut publisher).await;
                drop(permit);
                published
            }
            .instrument(span.clone()),
        );
        Some(InHand { snapshot: s, frozen, started, task, span })
    }

    /// Once the parts are out: the marker, then the freeze ends.
    async fn finish_snapshot(
        &self,
        hand: InHand,
        published: Result<anyhow::Result<Digest>, tokio::task::JoinError>,
        publisher: &mut Publisher,
    ) {
        let changed = self
            .changed_since_freeze
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|(_, ids)| ids)
            .unwrap_or_default();
        let result = match published {
            Ok(Ok(digest)) => {
                self.mark(&hand.frozen, digest, &changed, publisher)
                    .instrument(hand.span.clone())
                    .await
            }
            Ok(Err(e)) => Err(e),
            Err(e) => Err(anyhow::anyhow!("keyframe task: {e}")),
        };
        let f = &hand.frozen;
        if let Err(e) = self.store.thaw_place(self.partition.0, f.brand_id, f.place_id).await {
            warn!(
                partition = %self.partition, brand_id = f.brand_id, place_id = f.place_id,
                error = %e, "dropping a frozen place failed (it expires)"
            );
        }
        self.snapshot_done(&hand.snapshot, result, hand.started).await;
    }

    /// Notes the records of the frozen place that a commit changed.
    pub(crate) fn note_changed(&self, slots: &HashMap<crate::apply::Key, crate::apply::Slot>) {
        let mut tracked = self.changed_since_freeze.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(((b, p), ids)) = tracked.as_mut() {
            for ((kb, kp, id), slot) in slots {
                if kb == b && kp == p && slot.record_dirty {
                    ids.insert(id.clone());
                }
            }
        }
    }

    async fn snapshot_done(
        &self,
        s: &PlaceSnapshot,
        result: anyhow::Result<u64>,
        started: Instant,
    ) {
        match result {
            Ok(records) => s.progress.place_done(records),
            Err(e) => {
                warn!(
                    partition = %self.partition, brand_id = s.brand_id, place_id = s.place_id,
                    error = format!("{e:#}"), "place keyframe failed"
                );
                s.progress
                    .place_failed(format!("place {}/{}: {e:#}", s.brand_id, s.place_id))
                    .await;
            }
        }
        metrics::histogram!(names::KEYFRAME_SECONDS).record(started.elapsed().as_secs_f64());
        if s.last_of_job {
            s.progress.worker_done(None).await;
        }
    }

    async fn process(
        &self,
        msg: jetstream::Message,
        stream: Option<&jetstream::stream::Stream>,
        relay: &mut Relay,
        shutdown: &mut watch::Receiver<bool>,
    ) {
        let (seq, delivered, pending) = match msg.info() {
            Ok(info) => (info.stream_sequence, info.delivered.max(1) as u64, info.pending),
            Err(e) => {
                error!(partition = %self.partition, error = %e, "message without metadata");
                return;
            }
        };
        if seq <= self.committed_through.load(Ordering::Relaxed) {
            // Committed with an earlier delivery, its outbox relayed since.
            if let Err(e) = msg.ack().await {
                warn!(partition = %self.partition, seq, error = %e, "ack failed");
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
        metrics::histogram!(names::BATCH_SECONDS).record(started.elapsed().as_secs_f64());
        match result {
            Ok(handled) => {
                failpoint::hit("after_publish");
                if let Err(e) = msg.ack().await {
                    // Redelivery is harmless: the sequence check skips it.
                    warn!(partition = %self.partition, seq, error = %e, "ack failed");
                }
                failpoint::hit("after_ack");
                if matches!(handled, Handled::Skipped) {
                    self.stats.add(&self.stats.batches_skipped, 1);
                }
            }
            Err(e) => {
                let delay = self.backoff(delivered);
                warn!(
                    partition = %self.partition, seq, delivered, retry_in = ?delay,
                    error = %e, "batch not applied; will retry"
                );
                self.stats.add(&self.stats.retries, 1);
                if matches!(e, HandleError::Fenced) {
                    self.stats.add(&self.stats.fenced, 1);
                }
                let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
            }
        }
    }

    fn backoff(&self, delivered: u64) -> Duration {
        let base = self.settings.storage.retry_delay;
        let factor = 1u32 << delivered.saturating_sub(1).min(6);
        (base * factor).min(Duration::from_secs(30))
    }

    async fn handle(
        &self,
        msg: &jetstream::Message,
        seq: u64,
        delivered: u64,
        ahead: Option<(&jetstream::stream::Stream, u64)>,
        relay: &mut Relay,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Handled, HandleError> {
        let trace = outbox_trace(msg);
        let batch = match shelfsync_proto::CommandBatch::decode(msg.payload.as_ref()) {
            Ok(b) => b,
            Err(e) => {
                let detail = format!("cannot decode CommandBatch: {e}");
                return self
                    .dead_letter(seq, reason::UNDECODABLE, detail, &msg.payload, &trace, relay, shutdown)
                    .await;
            }
        };
        let span = tracing::Span::current();
        let result = if batch.sweeps.is_empty() {
            let mut parts = vec![(seq, batch)];
            if let Some((stream, pending)) = ahead {
                self.read_ahead(stream, pending, &mut parts).await;
                span.record("shelfsync.read_ahead", parts.len() - 1);
            }
            // Messages read ahead are applied with this one: a batch
            // operation in the messaging conventions' sense.
            if parts.len() > 1 {
                span.record("messaging.batch.message_count", parts.len());
            }
            let commands: usize = parts.iter().map(|(_, b)| b.commands.len()).sum();
            span.record("shelfsync.command_count", commands);
            match self.apply_and_commit(&parts, &trace, relay).await {
                Ok(Handled::Applied) => {
                    failpoint::hit("after_commit");
                    self.relay_until_done(relay, shutdown).await;
                    if !*shutdown.borrow() {
                        let last = parts.last().map_or(seq, |(s, _)| *s);
                        self.committed_through.fetch_max(last, Ordering::Relaxed);
                    }
                    Ok(Handled::Applied)
                }
                other => other,
            }
        } else {
            span.record("shelfsync.command_count", batch.commands.len());
            span.record("shelfsync.sweep_count", batch.sweeps.len());
            self.apply_in_steps(msg, seq, &batch, &trace, relay, shutdown).await
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
                self.dead_letter(seq, reason::FAILED, detail, &msg.payload, &trace, relay, shutdown)
                    .await
            }
        }
    }

    /// Appends to `parts` the partition's messages stored behind the last
    /// one, each the next on the subject after the one before: at most
    /// `pending` (what the consumer has not delivered yet) and the limits.
    /// Stops at the first message it cannot read or decode, and before one
    /// carrying sweeps (applied on its own, in steps); that one is handled
    /// when it is delivered.
    async fn read_ahead(
        &self,
        stream: &jetstream::stream::Stream,
        pending: u64,
        parts: &mut Vec<(u64, CommandBatch)>,
    ) {
        let paused = *self.ahead_paused_until.lock().unwrap_or_else(|e| e.into_inner());
        if paused.is_some_and(|until| Instant::now() < until) {
            return;
        }
        let subject = self.subjects.cmd(self.partition);
        let want = 1 + (pending as usize).min(self.settings.storage.read_ahead);
        let size = |b: &CommandBatch| b.commands.len() + b.sweeps.len();
        let mut total: usize = parts.iter().map(|(_, b)| size(b)).sum();
        let mut contexts = Vec::new();
        while parts.len() < want && total < AHEAD_COMMANDS {
            let after = parts.last().map_or(0, |(s, _)| *s);
            let m = match stream.direct_get_next_for_subject(subject.clone(), Some(after + 1)).await
            {
                Ok(m) => m,
                Err(e) => {
                    if e.kind() != jetstream::stream::DirectGetErrorKind::NotFound {
                        warn!(
                            partition = %self.partition, error = %e, pause = ?AHEAD_PAUSE,
                            "reading ahead failed; one message at a time meanwhile"
                        );
                        *self.ahead_paused_until.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(Instant::now() + AHEAD_PAUSE);
                    }
                    break;
                }
            };
            let Ok(batch) = CommandBatch::decode(m.payload.as_ref()) else { break };
            if !batch.sweeps.is_empty() || total + size(&batch) > AHEAD_COMMANDS {
                break;
            }
            total += size(&batch);
            contexts.push(shelfsync_telemetry::extract_opt(Some(&m.headers)));
            parts.push((m.sequence, batch));
        }
        // Their imports' traces, linked from this apply.
        shelfsync_telemetry::add_links(&tracing::Span::current(), &contexts);
    }

    /// Limits and clock of a batch applied now.
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            partition: self.partition.0,
            partitions: self.settings.storage.partitions,
            max_record_bytes: self.settings.storage.max_record_bytes,
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
    async fn apply_and_commit(
        &self,
        parts: &[(u64, CommandBatch)],
        trace: &TraceParts,
        relay: &mut Relay,
    ) -> Result<Handled, HandleError> {
        let Some(&(last, _)) = parts.last() else { return Ok(Handled::Skipped) };
        // Commands this owner can vouch for are neither loaded nor applied.
        let splits = self.known().split(&parts.iter().map(|(_, b)| b).collect::<Vec<_>>());
        let to_load = CommandBatch {
            commands: splits.iter().flat_map(|s| s.rest.commands.iter().cloned()).collect(),
            ..Default::default()
        };
        let mut loaded = self.store.load(self.partition.0, &to_load).await?;
        let todo: Vec<(&(u64, CommandBatch), &crate::known::Split)> =
            parts.iter().zip(&splits).filter(|((seq, _), _)| *seq > loaded.at.applied).collect();
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
        let (mut changes, mut rejections) = (Vec::new(), Vec::new());
        let mut outcomes = Vec::with_capacity(todo.len());
        let mut skipped = Vec::new();
        for ((_, batch), split) in &todo {
            let mut outcome = apply_batch(&split.rest, &mut loaded.slots, &HashMap::new(), &limits);
            let n = split.skipped.len() as u64;
            (outcome.applied, outcome.unchanged) = (outcome.applied + n, outcome.unchanged + n);
            self.stats.add(&self.stats.known_skipped, n);
            skipped.extend(split.skipped.iter().cloned());
            let n_changes = outcome.changes.len() as u64;
            changes.append(&mut outcome.changes);
            rejections.extend(outcome.rejections.iter().cloned());
            outcomes.push((batch, n_changes, outcome));
        }
        let touched: Vec<crate::apply::Touch> = outcomes
            .iter()
            .flat_map(|(_, _, o)| o.touched.iter().cloned())
            .chain(skipped.iter().filter_map(crate::known::Skipped::touch))
            .collect();
        let rejected: Vec<crate::apply::Key> = rejections
            .iter()
            .filter_map(|r| r.key.as_ref())
            .map(|k| (k.brand_id, k.place_id, k.product_id.clone()))
            .collect();
        let (outbox, _) =
            self.outbox(trace, relay).entries(last, &last.to_string(), 0, changes, rejections);
        failpoint::hit("before_commit");
        let fence = Fence { at: loaded.at.clone(), stream: self.stream_identity() };
        let writes = Writes { slots: Some(&loaded.slots), touched: &touched, outbox: &outbox, sweeps: &[] };
        match self.commit(&fence, &Position::at(last), &writes).await? {
            Commit::Done => {}
            Commit::Fenced => return Err(HandleError::Fenced),
        }
        let applied = todo.iter().flat_map(|(_, s)| &s.rest.commands);
        self.known().committed(&loaded.slots, applied, &rejected);
        self.wait_replicas().await?;
        self.note_changed(&loaded.slots);
        self.keyframe_limits.live.committed(|| oldest_published(todo.iter().map(|(p, _)| *p)));
        let s = &self.stats;
        s.add(&s.batches, todo.len() as u64);
        s.add(&s.batches_ahead, todo.iter().filter(|((seq, _), _)| *seq != parts[0].0).count() as u64);
        for (batch, n_changes, o) in outcomes {
            self.count_applied(batch, n_changes, &o);
        }
        Ok(Handled::Applied)
    }

    /// What this owner can vouch for without Redis.
    pub(crate) fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
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
        let result = self.store.commit(self.partition.0, fence, to, writes).await;
        let mut known = self.known();
        match (&result, writes.slots) {
            (Ok(Commit::Done), Some(slots)) => known.forget_written(slots),
            (Ok(Commit::Done), None) => {}
            _ => known.clear(),
        }
        result
    }

    /// Counts what one applied command message did (`n_changes`: its
    /// changes, which the caller may have moved out of `o` already).
    pub(crate) fn count_applied(
        &self,
        batch: &CommandBatch,
        n_changes: u64,
        o: &crate::apply::Outcome,
    ) {
        let s = &self.stats;
        s.add(&s.commands, batch.commands.len() as u64);
        s.add(&s.applied, o.applied);
        s.add(&s.changes, n_changes);
        s.add(&s.unchanged, o.unchanged);
        s.add(&s.rejected, o.rejections.len() as u64);
        record_applied(batch, o.applied, o.unchanged, n_changes);
        record_rejections(&o.rejections);
    }

    /// With `redis.wait_replicas`, waits until that many Redis replicas have
    /// every write so far (`WAIT`), however many timeouts it takes: a commit
    /// is not published nor acked before.
    pub(crate) async fn wait_replicas(&self) -> Result<(), StoreError> {
        let want = self.settings.redis.wait_replicas;
        if want == 0 {
            return Ok(());
        }
        let mut logged = false;
        loop {
            let have = self.store.wait_replicas(want, self.settings.redis.wait_timeout).await?;
            if have >= want {
                return Ok(());
            }
            metrics::counter!(names::REDIS_WAIT_RETRIES).increment(1);
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

    /// Commits a rejection carrying the raw message and advances the
    /// sequence, so a poison message is recorded once and never blocks.
    #[allow(clippy::too_many_arguments)]
    async fn dead_letter(
        &self,
        seq: u64,
        why: &str,
        detail: String,
        raw: &[u8],
        trace: &TraceParts,
        relay: &mut Relay,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Handled, HandleError> {
        error!(partition = %self.partition, seq, reason = why, %detail, "dead-lettering command message");
        let at = self.store.position(self.partition.0).await?;
        if seq <= at.applied {
            return Ok(Handled::Skipped);
        }
        let rejection = Rejection {
            reason: why.to_string(),
            detail,
            raw: raw[..raw.len().min(MAX_RAW)].to_vec(),
            ..Default::default()
        };
        let (outbox, _) =
            self.outbox(trace, relay).entries(seq, &seq.to_string(), 0, Vec::new(), vec![rejection]);
        let fence = Fence { at, stream: self.stream_identity() };
        let writes = Writes { slots: None, touched: &[], outbox: &outbox, sweeps: &[] };
        match self.commit(&fence, &Position::at(seq), &writes).await? {
            Commit::Done => {
                self.stats.add(&self.stats.dead_lettered, 1);
                metrics::counter!(names::REJECTS, "reason" => why.to_string()).increment(1);
                self.relay_until_done(relay, shutdown).await;
                Ok(Handled::Applied)
            }
            Commit::Fenced => Err(HandleError::Fenced),
        }
    }

    /// Relays until the outbox is empty, backing off while NATS or Redis is
    /// away; gives up only on shutdown (the outbox stays for the next run).
    pub(crate) async fn relay_until_done(
        &self,
        relay: &mut Relay,
        shutdown: &mut watch::Receiver<bool>,
    ) {
        let mut delay = Duration::from_millis(100);
        loop {
            match relay.relay().await {
                Ok(_) => return,
                Err(e) => {
                    warn!(partition = %self.partition, error = %e, retry_in = ?delay, "outbox relay failed");
                    if *shutdown.borrow() {
                        return;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = stopped(shutdown) => return,
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Between messages: purges tombstones older than `tombstone_ttl` and
    /// records absent for longer than `absent_ttl` (a DELETED change each),
    /// every write fenced by the partition's position like a commit.
    async fn purge(&self, relay: &mut Relay, shutdown: &mut watch::Receiver<bool>) {
        let at = match self.store.position(self.partition.0).await {
            Ok(at) if at.step.is_empty() => at,
            Ok(_) => return, // a message is half applied: it goes first
            Err(e) => {
                warn!(partition = %self.partition, error = %e, "purge: cannot read the position");
                return;
            }
        };
        let fence = Fence { at, stream: self.stream_identity() };
        let cutoff = Self::now_us() - self.settings.storage.tombstone_ttl.as_micros() as i64;
        match self.store.purge_tombstones(self.partition.0, &fence, cutoff, PURGE_BATCH).await {
            Ok(Some(0)) => {}
            Ok(Some(n)) => {
                debug!(partition = %self.partition, purged = n, "tombstones purged");
                self.stats.add(&self.stats.purged, n as u64);
            }
            Ok(None) => warn!(partition = %self.partition, "tombstone purge fenced; skipped"),
            Err(e) => warn!(partition = %self.partition, error = %e, "tombstone purge failed"),
        }
        if let Err(e) = self.purge_absent(&fence, relay, shutdown).await {
            warn!(partition = %self.partition, error = %e, "absent purge failed");
        }
        // Entries an operator put back (`shelfsync dead-letters redrive`)
        // go out even when no command comes.
        self.relay_until_done(relay, shutdown).await;
    }

    /// Deletes records absent since before `absent_ttl`: each is a DELETE
    /// through the pure core, compare-and-swapped on the `updated_at` it had
    /// when it was found absent, so that a record that came back meanwhile
    /// is left alone. Its tombstone is purged later like any other.
    async fn purge_absent(
        &self,
        fence: &Fence,
        relay: &mut Relay,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), HandleError> {
        let ttl = self.settings.storage.absent_ttl;
        if ttl.is_zero() {
            return Ok(());
        }
        let cutoff = Self::now_us() - ttl.as_micros() as i64;
        let due = self.store.absent_due(self.partition.0, cutoff, PURGE_BATCH).await?;
        if due.is_empty() {
            return Ok(());
        }
        let probe = CommandBatch {
            partition: self.partition.0,
            commands: due.iter().map(|k| delete_command(k, None)).collect(),
            ..Default::default()
        };
        let mut loaded = self.store.load(self.partition.0, &probe).await?;
        if loaded.at != fence.at {
            return Err(HandleError::Fenced);
        }
        let mut commands = Vec::new();
        for k in &due {
            let Some(slot) = loaded.slots.get_mut(k) else { continue };
            match &slot.record {
                Some(r) if r.absent && !r.deleted && r.updated_at <= cutoff => {
                    commands.push(delete_command(k, Some(r.updated_at)));
                }
                // Back, deleted or gone since: only the index entry goes.
                _ => slot.absent_index = Some(false),
            }
        }
        let batch = CommandBatch { partition: self.partition.0, commands, ..Default::default() };
        let outcome = apply_batch(&batch, &mut loaded.slots, &HashMap::new(), &self.limits());
        let id = format!("purge.{}.{}", fence.at.applied, Self::now_us());
        let (outbox, _) = self
            .outbox(&TraceParts::default(), relay)
            .entries(fence.at.applied, &id, 0, outcome.changes.clone(), Vec::new());
        let writes = Writes { slots: Some(&loaded.slots), touched: &[], outbox: &outbox, sweeps: &[] };
        match self.commit(fence, &fence.at, &writes).await? {
            Commit::Done => {}
            Commit::Fenced => return Err(HandleError::Fenced),
        }
        self.wait_replicas().await?;
        self.note_changed(&loaded.slots);
        let purged = outcome.changes.len() as u64;
        if purged > 0 {
            info!(partition = %self.partition, purged, "absent records purged (absent_ttl)");
            self.stats.add(&self.stats.changes, purged);
            metrics::counter!(names::ABSENT_PURGED).increment(purged);
            metrics::counter!(names::CHANGES_EMITTED).increment(purged);
        }
        self.relay_until_done(relay, shutdown).await;
        Ok(())
    }
}

/// A DELETE of `k` by storage's absent purge (CAS on `updated_at` if given).
fn delete_command(k: &crate::apply::Key, expected_updated_at: Option<i64>) -> Command {
    Command {
        key: Some(shelfsync_proto::RecordKey::new(k.0, k.1, k.2.clone())),
        kind: CommandKind::Delete as i32,
        expected_updated_at,
        origin: Some(Origin {
            source: "storage.absent_purge".into(),
            import_id: String::new(),
            published_at: 0,
        }),
        ..Default::default()
    }
}

/// The identity of a command stream: its name and when it was created. A
/// stream deleted and created again has another.
fn stream_identity(stream: &jetstream::stream::Stream) -> String {
    let info = stream.cached_info();
    format!("{}@{}", info.config.name, info.created.unix_timestamp_nanos())
}

/// Resolves once shutdown is asked (at once if it was already).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
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

/// When the oldest command of `batches` was published, microseconds since
/// the epoch (0: none says).
fn oldest_published<'a>(
    batches: impl IntoIterator<Item = &'a (u64, shelfsync_proto::CommandBatch)>,
) -> i64 {
    batches
        .into_iter()
        .flat_map(|(_, b)| &b.commands)
        .filter_map(|c| c.origin.as_ref().map(|o| o.published_at))
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0)
}

/// Metrics of one committed command message.
fn record_applied(
    batch: &shelfsync_proto::CommandBatch,
    applied: u64,
    unchanged: u64,
    changes: u64,
) {
    metrics::counter!(names::COMMANDS_APPLIED).increment(applied);
    metrics::counter!(names::COMMANDS_UNCHANGED).increment(unchanged);
    metrics::counter!(names::CHANGES_EMITTED).increment(changes);
    let freshness = metrics::histogram!(names::FRESHNESS_SECONDS, "stage" => "storage");
    for c in &batch.commands {
        if let Some(s) =
            c.origin.as_ref().and_then(|o| shelfsync_telemetry::seconds_since_us(o.published_at))
        {
            freshness.record(s);
        }
    }
}

fn record_rejections(rejections: &[Rejection]) {
    for r in rejections {
        if r.reason == reason::CONFLICT {
            metrics::counter!(names::CAS_CONFLICTS).increment(1);
        }
        metrics::counter!(names::REJECTS, "reason" => r.reason.clone()).increment(1);
    }
}

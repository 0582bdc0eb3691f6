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
//! (`crate::outbox::relay`). A message with sweeps is applied in bounded steps
//! (`crate::worker::sweep`).
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

//!
//! The worker's parts: this module (the worker, its constructor and its run
//! loop: binding the consumer, pulling, stopping), `commit` (one delivered
//! message applied and committed, with what was read ahead: `ahead`),
//! `sweep` (a message with sweeps, in steps), `purge` (tombstones and absent
//! records between messages), `dead_letter` (a message that cannot be
//! applied) and `keyframes` (a place frozen, published and marked).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures::StreamExt;
use shelfsync_bus::{Partition, Publisher, Subjects};
use shelfsync_service::Drain;
use shelfsync_telemetry::chain;
use tokio::sync::mpsc;
use tracing::{Instrument, error, info, warn};

use crate::config::Config;
use crate::keyframe::{KeyframeJob, KeyframeLimits};
use crate::known::{Budget, Known};
use crate::metrics::Stats;
use crate::outbox::Relay;
use crate::readiness::{Readiness, Refusal};
use crate::store::{Store, StoreError, StreamBinding};

mod ahead;
mod commit;
mod dead_letter;
mod keyframes;
mod pressure;
mod purge;
pub(crate) mod sweep;

pub(crate) use pressure::Cause;
use pressure::Pressure;

use keyframes::{ChangedSinceFreeze, InHand, PlaceSnapshot};

/// Longest wait between two attempts to bind the command consumer.
const CONSUMER_RETRY_MAX: Duration = Duration::from_secs(10);
/// How long a stopping worker waits for a message already on its way.
const HANDBACK_WAIT: Duration = Duration::from_millis(100);
/// How often a refused partition looks whether an operator re-based it.
const REFUSED_POLL: Duration = Duration::from_secs(2);

/// What every partition worker of a replica shares.
pub(crate) struct Shared {
    pub config: Arc<Config>,
    pub subjects: Subjects,
    pub js: jetstream::Context,
    pub store: Store,
    pub stats: Arc<Stats>,
    /// Largest payload to publish (server max payload minus headroom).
    pub max_bytes: usize,
    /// Largest command message once decoded (`storage.max_message_bytes`).
    pub max_decoded: usize,
    /// Told when a worker's consumer is bound, refused or held back (readiness).
    pub ready: Arc<Readiness>,
    /// Places in hand and records per second of keyframes, across the replica.
    pub keyframe_limits: Arc<KeyframeLimits>,
    /// What the owners remember, bounded over the replica (`crate::known`):
    /// no-op PATCHes, and live records of known places.
    pub known_budgets: (Budget, Budget),
}

/// One owned partition's worker (see the module docs); built by
/// [`Worker::new`], run by [`Worker::run`].
pub(crate) struct Worker {
    partition: Partition,
    shared: Arc<Shared>,
    /// The place frozen for a keyframe, and the records changed since.
    changed_since_freeze: std::sync::Mutex<Option<ChangedSinceFreeze>>,
    /// The highest command sequence this worker committed and relayed:
    /// a delivery at or below it was applied ahead and is only acked.
    committed_through: AtomicU64,
    /// The partition's applied sequence as this worker's last commit left
    /// it (0: none since it bound): Redis showing less went back in time.
    last_commit: AtomicU64,
    /// Reading ahead failed (no permission, a slow server): paused until then.
    ahead_paused_until: std::sync::Mutex<Option<Instant>>,
    /// Identity of the command stream this worker is bound to (`Fence.stream`).
    stream_identity: std::sync::Mutex<String>,
    /// What this owner can vouch for without Redis (`crate::known`).
    known: std::sync::Mutex<Known>,
    /// Waiting for room (Redis, NATS): logged once, counted, not ready.
    pressure: Pressure,
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
    Relay(#[from] crate::outbox::RelayError),
    #[error("the partition moved under this worker (another writer, or an operator's re-base)")]
    Fenced,
    #[error("message {seq} arrived while an earlier message is half applied ({step})")]
    StepOfAnother { seq: u64, step: String },
    #[error("stopping between two steps of a message (the next owner resumes it)")]
    Stopping,
    #[error("{have} of the {want} Redis replicas asked for confirmed the commit in time")]
    Replicas { have: usize, want: usize },
    /// A command the walk of its message located does not decode (the walk
    /// accepts only what prost decodes: not expected).
    #[error("cannot decode a command: {0}")]
    Decode(prost::DecodeError),
}

impl HandleError {
    /// Why the partition waits, when the error is the servers' (not the
    /// message's, not another owner's): backpressure.
    fn pressure(&self) -> Option<Cause> {
        use crate::outbox::RelayError as R;
        match self {
            HandleError::Store(e) | HandleError::Relay(R::Store(e)) => e.pressure(),
            HandleError::Relay(R::Publish(p)) => Some(match p.failure() {
                shelfsync_bus::Failure::Refused(_) => Cause::NatsRefused,
                _ => Cause::Nats,
            }),
            HandleError::Relay(R::ReadBack { .. }) => Some(Cause::Nats),
            HandleError::Relay(R::Replicas { .. }) => Some(Cause::RedisReplicas),
            HandleError::Replicas { .. } => Some(Cause::RedisReplicas),
            HandleError::Relay(R::AckLost)
            | HandleError::Fenced
            | HandleError::StepOfAnother { .. }
            | HandleError::Stopping
            | HandleError::Decode(_) => None,
        }
    }

    fn is_transient(&self) -> bool {
        match self {
            HandleError::Store(e) => e.is_transient(),
            HandleError::Relay(_)
            | HandleError::Replicas { .. }
            | HandleError::Fenced
            | HandleError::StepOfAnother { .. }
            | HandleError::Stopping => true,
            HandleError::Decode(_) => false,
        }
    }
}

impl Worker {
    /// The worker of `partition`, with nothing known yet: it learns where the
    /// partition stands from Redis when it binds.
    pub(crate) fn new(partition: Partition, shared: Arc<Shared>) -> Self {
        let (entries, live) = shared.known_budgets.clone();
        Worker {
            partition,
            pressure: Pressure::new(partition, shared.ready.clone(), shared.stats.clone()),
            shared,
            changed_since_freeze: Default::default(),
            committed_through: Default::default(),
            last_commit: Default::default(),
            ahead_paused_until: Default::default(),
            stream_identity: Default::default(),
            known: std::sync::Mutex::new(Known::new(entries, live)),
        }
    }

    /// The partition this worker owns.
    pub(crate) fn partition(&self) -> Partition {
        self.partition
    }

    pub(crate) fn now_us() -> i64 {
        crate::clock::now_us()
    }

    /// The command stream and this partition's consumer on it.
    async fn consumer(
        &self,
    ) -> anyhow::Result<(jetstream::stream::Stream, jetstream::consumer::Consumer<pull::Config>)>
    {
        let stream = self.shared.js.get_stream(self.shared.subjects.cmd_stream()).await?;
        let name = self.shared.subjects.storage_consumer(self.partition);
        let config = pull::Config {
            durable_name: Some(name.clone()),
            description: Some(format!("shelfsync storage, partition {}", self.partition)),
            // Commands, and the sweeps that only ingest and the CLI may
            // send, in the order the stream stored them.
            filter_subjects: vec![
                self.shared.subjects.cmd(self.partition),
                self.shared.subjects.cmd_sweep(self.partition),
            ],
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: self.shared.config.storage.ack_wait,
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
        // Created, or brought to this shape (an older version filtered on
        // the command subject alone).
        let consumer = match stream.get_or_create_consumer(&name, config.clone()).await? {
            c if c.cached_info().config.filter_subjects == config.filter_subjects => c,
            _ => stream.create_consumer(config).await?,
        };
        Ok((stream, consumer))
    }

    /// Binds the partition's consumer and starts pulling, retrying until it
    /// works: many consumers created at once (R3, a busy cluster) can time
    /// out, and one slow answer must not stop the replica. A command stream
    /// other than the one the partition's sequence counts in is refused until
    /// an operator re-bases the partition. `None`: shutdown.
    async fn bind(&self, shutdown: &Drain) -> Option<(jetstream::stream::Stream, pull::Stream)> {
        let mut delay = Duration::from_millis(500);
        let mut refused_logged = false;
        loop {
            let bound = async {
                let (stream, consumer) = self.consumer().await?;
                let identity = stream_identity(&stream);
                match self.shared.store.bind_stream(self.partition, &identity).await? {
                    StreamBinding::Same => {}
                    StreamBinding::Replaced { recorded } => {
                        return Ok(Err((identity, recorded)));
                    }
                }
                // A partition written by an older version: its layout first.
                match self.shared.store.upgrade_layout(self.partition).await? {
                    Some(0) => {}
                    Some(moved) => info!(
                        partition = %self.partition, moved, layout = crate::store::LAYOUT,
                        "partition upgraded to this version's Redis layout"
                    ),
                    None => anyhow::bail!(
                        "layout upgrade fenced: another owner applied a message meanwhile"
                    ),
                }
                let messages = shelfsync_bus::pull_messages(&consumer).await?;
                anyhow::Ok(Ok((stream, messages, identity)))
            };
            match bound.await {
                Ok(Ok((stream, messages, identity))) => {
                    if refused_logged {
                        info!(partition = %self.partition, stream = %identity, "partition re-based; resuming");
                    }
                    self.shared.stats.partition_resumed(self.partition);
                    self.shared.ready.unrefuse(self.partition.0);
                    *self.stream_identity.lock().unwrap_or_else(|e| e.into_inner()) = identity;
                    // Sequences may count in a new stream now: nothing is
                    // taken as committed without asking Redis.
                    self.committed_through.store(0, Ordering::Relaxed);
                    self.last_commit.store(0, Ordering::Relaxed);
                    // Another owner may have written meanwhile.
                    self.known().clear();
                    return Some((stream, messages));
                }
                Ok(Err((found, recorded))) => {
                    self.shared.stats.partition_refused(self.partition, !refused_logged);
                    if !refused_logged {
                        error!(
                            partition = %self.partition, recorded = %recorded, found = %found,
                            "the command stream was replaced (its sequences restarted): this \
                             partition applies nothing until an operator re-bases it \
                             (`shelfsync rebase`); nothing is acked or dropped meanwhile"
                        );
                        refused_logged = true;
                    }
                    self.shared.ready.refuse(self.partition.0, Refusal::StreamReplaced { found });
                    tokio::select! {
                        _ = shutdown.started() => return None,
                        _ = tokio::time::sleep(REFUSED_POLL) => {}
                    }
                }
                Err(e) => {
                    warn!(
                        partition = %self.partition, retry_in = ?delay, error = %chain(e.as_ref()),
                        "cannot bind the command consumer; retrying"
                    );
                    tokio::select! {
                        _ = shutdown.started() => return None,
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
        let name = self.shared.subjects.storage_consumer(self.partition);
        let Ok(stream) = self.shared.js.get_stream_no_info(self.shared.subjects.cmd_stream()).await
        else {
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
        shutdown: Drain,
        mut jobs: mpsc::Receiver<KeyframeJob>,
    ) -> anyhow::Result<()> {
        let mut relay = Relay::start(
            self.partition,
            self.shared.store.clone(),
            self.shared.js.clone(),
            self.shared.subjects.clone(),
            self.shared.config.nats.max_inflight,
            (self.shared.config.redis.wait_replicas, self.shared.config.redis.wait_timeout),
            self.shared.stats.clone(),
        )
        .await;
        // Whatever a previous owner committed but did not publish goes
        // first, also while the partition is refused (it is committed work).
        {
            let span = tracing::info_span!("storage.relay_outbox", partition = self.partition.0);
            self.relay_until_done(&mut relay, &shutdown).instrument(span).await;
        }
        let Some((stream, mut messages)) = self.bind(&shutdown).await else { return Ok(()) };
        // Keyframe markers.
        let mut publisher =
            Publisher::new(self.shared.js.clone(), self.shared.config.nats.max_inflight);
        // For reading ahead (direct gets on the command stream).
        let stream = (stream.cached_info().config.allow_direct
            && self.shared.config.storage.read_ahead > 0)
            .then_some(stream);
        self.shared.ready.worker_bound();
        let mut purge = tokio::time::interval(self.shared.config.storage.purge_interval);
        purge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut snapshots: VecDeque<PlaceSnapshot> = VecDeque::new();
        let mut in_hand: Option<InHand> = None;
        // Its own receiver: one the handlers wait on could miss the change.
        let stop = shutdown.clone();
        loop {
            if stop.is_started() {
                break;
            }
            tokio::select! {
                biased;
                _ = stop.started() => break,
                next = messages.next() => {
                    let msg = match next {
                        Some(Ok(msg)) => msg,
                        Some(Err(e)) if !self.consumer_missing(&e).await => {
                            warn!(partition = %self.partition, error = %chain(&e), "pull failed; retrying");
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
                            let Some((_, m)) = self.bind(&shutdown).await else { break };
                            messages = m;
                            continue;
                        }
                    };
                    self.process(msg, stream.as_ref(), &mut relay, &shutdown).await;
                }
                Some(job) = jobs.recv() => self.plan_snapshots(job, &mut snapshots).await,
                published = async { (&mut in_hand.as_mut().expect("guarded").task).await },
                    if in_hand.is_some() =>
                {
                    let hand = in_hand.take().expect("guarded");
                    self.finish_snapshot(hand, published, &mut publisher).await;
                }
                permit = self.shared.keyframe_limits.permits.clone().acquire_owned(),
                    if in_hand.is_none() && !snapshots.is_empty() =>
                {
                    if let (Ok(permit), Some(s)) = (permit, snapshots.pop_front()) {
                        self.shared.stats.keyframe_places_queued.fetch_sub(1, Ordering::Relaxed);
                        in_hand = self.start_snapshot(s, permit).await;
                    }
                }
                _ = purge.tick() => self.purge(&mut relay, &shutdown).await,
            }
        }
        let dropped = snapshots.len() as u64;
        self.shared.stats.keyframe_places_queued.fetch_sub(dropped, Ordering::Relaxed);
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

    /// What this owner can vouch for without Redis.
    pub(crate) fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The identity of a command stream: its name and when it was created. A
/// stream deleted and created again has another.
fn stream_identity(stream: &jetstream::stream::Stream) -> String {
    let info = stream.cached_info();
    format!("{}@{}", info.config.name, info.created.unix_timestamp_nanos())
}

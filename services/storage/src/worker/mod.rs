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
//! loop: binding the consumer, pulling, stopping), `message` (one delivered
//! message applied and committed, with what was read ahead, from the
//! intake to the ack), `writes` (the fenced commit, the replicas' wait and
//! the relay every path shares), `sweep` (a message with sweeps, in steps),
//! `purge` (tombstones and absent records between messages), `dead_letter`
//! (a message that cannot be applied), `keyframes` (a place frozen,
//! published and marked) and `pressure` (waiting for room).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use shelfsync_bus::intake::{Intake, Up};
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
use crate::readiness::{Cause, PartitionHealth, Refusal};
use crate::store::{Store, StoreError, StreamBinding};

mod dead_letter;
mod keyframes;
mod message;
mod pressure;
mod purge;
pub(crate) mod sweep;
mod writes;

use pressure::Pressure;

use keyframes::{ChangedSinceFreeze, InHand, PlaceSnapshot};

/// Longest wait between two attempts to bind the command consumer.
const CONSUMER_RETRY_MAX: Duration = Duration::from_secs(10);
/// Pulls failing in a row after which the consumers are bound again.
const PULL_FAILURES_TO_REBIND: u32 = 3;
/// How often a refused partition looks whether an operator re-based it.
const REFUSED_POLL: Duration = Duration::from_secs(2);

/// What every partition worker of a replica shares.
pub(crate) struct Shared {
    pub(crate) config: Arc<Config>,
    pub(crate) subjects: Subjects,
    pub(crate) js: jetstream::Context,
    pub(crate) store: Store,
    pub(crate) stats: Arc<Stats>,
    /// Largest payload to publish (server max payload minus headroom).
    pub(crate) max_bytes: usize,
    /// Largest command message once decoded (`storage.max_message_bytes`).
    pub(crate) max_decoded: usize,
    /// Told when a worker's consumer is bound, refused or held back (readiness).
    pub(crate) ready: Arc<PartitionHealth>,
    /// Places in hand and records per second of keyframes, across the replica.
    pub(crate) keyframe_limits: Arc<KeyframeLimits>,
    /// What the owners remember, bounded over the replica (`crate::known`):
    /// no-op PATCHes, and live records of known places.
    pub(crate) known_budgets: (Budget, Budget),
    /// Names this process's consumers apart from those of any other
    /// process, one that runs with the same settings by mistake included.
    pub(crate) instance: String,
}

/// One owned partition's worker (see the module docs); built by
/// [`Worker::new`], run by [`Worker::run`].
pub(crate) struct Worker {
    partition: Partition,
    shared: Arc<Shared>,
    /// The place frozen for a keyframe, and the records changed since.
    changed_since_freeze: std::sync::Mutex<Option<ChangedSinceFreeze>>,
    /// The partition's applied sequence as this worker's last commit left
    /// it (0: none since it bound): Redis showing less went back in time.
    last_commit: AtomicU64,
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
            last_commit: Default::default(),
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

    /// The names of this owner's consumers of the partition's command and
    /// sweep subjects.
    fn consumer_names(&self) -> [String; 2] {
        let replica = self.shared.config.storage.replica;
        let owner = self.shared.subjects.storage_consumer_of(self.partition, replica);
        let name = format!("{owner}-{}", self.shared.instance);
        [name.clone(), format!("{name}-sweeps")]
    }

    /// The command stream and the intake of this owner, its consumers
    /// created afresh at the partition's applied sequence + 1 (those of an
    /// earlier binding of this process go first: their position is not
    /// Redis's; those of processes gone expire on the server).
    async fn intake(&self, applied: u64) -> anyhow::Result<(jetstream::stream::Stream, Intake)> {
        let stream = self.shared.js.get_stream(self.shared.subjects.cmd_stream()).await?;
        let subjects = [
            self.shared.subjects.cmd(self.partition),
            self.shared.subjects.cmd_sweep(self.partition),
        ];
        let intake = Intake::bind(&stream, self.consumer_names(), subjects, applied).await?;
        Ok((stream, intake))
    }

    /// Binds the partition's consumer and starts pulling, retrying until it
    /// works: many consumers created at once (R3, a busy cluster) can time
    /// out, and one slow answer must not stop the replica. A command stream
    /// other than the one the partition's sequence counts in is refused until
    /// an operator re-bases the partition. `None`: shutdown.
    async fn bind(&self, shutdown: &Drain) -> Option<(jetstream::stream::Stream, Intake)> {
        let mut delay = Duration::from_millis(500);
        let mut refused_logged = false;
        loop {
            let bound = async {
                let stream = self.shared.js.get_stream(self.shared.subjects.cmd_stream()).await?;
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
                // From where the partition stands: a step in hand starts
                // with its own message again.
                let applied = self.shared.store.position(self.partition).await?.applied;
                let (stream, intake) = self.intake(applied).await?;
                anyhow::Ok(Ok((stream, intake, identity)))
            };
            match bound.await {
                Ok(Ok((stream, intake, identity))) => {
                    if refused_logged {
                        info!(partition = %self.partition, stream = %identity, "partition re-based; resuming");
                    }
                    self.shared.stats.partition_resumed(self.partition);
                    self.shared.ready.unrefuse(self.partition.0);
                    *self.stream_identity.lock().unwrap_or_else(|e| e.into_inner()) = identity;
                    self.last_commit.store(0, Ordering::Relaxed);
                    // Another owner may have written meanwhile.
                    self.known().clear();
                    return Some((stream, intake));
                }
                Ok(Err((found, recorded))) => {
                    self.shared.stats.partition_refused(self.partition, !refused_logged);
                    if !refused_logged {
                        error!(
                            partition = %self.partition, recorded = %recorded, found = %found,
                            "the command stream was replaced (its sequences restarted): this \
                             partition applies nothing until an operator re-bases it \
                             (`shelfsync rebase`); nothing is applied or dropped meanwhile"
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
        let Ok(stream) = self.shared.js.get_stream_no_info(self.shared.subjects.cmd_stream()).await
        else {
            return false;
        };
        for name in self.consumer_names() {
            let info = stream.consumer_info(&name).await;
            if info.is_err_and(|e| e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound)
            {
                return true;
            }
        }
        false
    }

    /// Runs until `shutdown` flips; the message in hand is finished first.
    /// Keyframe jobs are worked off one place at a time, each frozen between
    /// two command messages once a replica-wide permit is free, with ready
    /// messages served first; the place's parts are published by a task while
    /// the partition goes on, and the next place waits for that task.
    pub(crate) async fn run(
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
        let Some((mut stream, mut intake)) = self.bind(&shutdown).await else { return Ok(()) };
        // Keyframe markers.
        let mut publisher =
            Publisher::new(self.shared.js.clone(), self.shared.config.nats.max_inflight);
        self.shared.ready.worker_bound();
        self.purge_applied(&mut intake, &stream).await;
        let mut purge = tokio::time::interval(self.shared.config.storage.purge_interval);
        purge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut snapshots: VecDeque<PlaceSnapshot> = VecDeque::new();
        let mut in_hand: Option<InHand> = None;
        // A message that failed waits until then before it is tried again.
        let mut retry_at: Option<Instant> = None;
        // What is pulled waits for a message of the other subject still on
        // its way.
        let mut blocked = false;
        // Pulls that failed in a row: past a few, the consumers are taken as
        // lost (a node of a cluster that held them gone) and bound again.
        let mut pull_failures = 0u32;
        // Its own receiver: one the handlers wait on could miss the change.
        let stop = shutdown.clone();
        loop {
            if stop.is_started() {
                break;
            }
            let waiting = retry_at.is_some_and(|t| Instant::now() < t);
            if intake.has_pending() && !waiting {
                intake.take_ready(self.pull_limit());
                match intake.up(&stream).await {
                    Ok(Up::Wait) => blocked = true,
                    Ok(up) => {
                        blocked = false;
                        retry_at = self.apply_up(&mut intake, up, &mut relay, &shutdown).await;
                        intake.take_ready(self.pull_limit());
                        self.purge_applied(&mut intake, &stream).await;
                    }
                    Err(e) => {
                        warn!(partition = %self.partition, error = %chain(&*e), "cannot tell what comes next; retrying");
                        retry_at = Some(Instant::now() + self.backoff(1));
                    }
                }
            }
            let waiting = retry_at.is_some_and(|t| Instant::now() < t);
            tokio::select! {
                biased;
                _ = stop.started() => break,
                next = intake.next(), if !intake.has_pending() || blocked => match next {
                    Ok(()) => (blocked, pull_failures) = (false, 0),
                    Err(e) if pull_failures < PULL_FAILURES_TO_REBIND && !self.consumer_missing(&e).await => {
                        pull_failures += 1;
                        warn!(partition = %self.partition, error = %chain(&e), "pull failed; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    // A consumer is gone (deleted, or lost with the servers
                    // that held it): both created again, from where the
                    // partition stands.
                    Err(_) => {
                        warn!(partition = %self.partition, "command consumer gone; binding it again");
                        let Some((s, i)) = self.bind(&shutdown).await else { break };
                        (stream, intake, retry_at, blocked, pull_failures) = (s, i, None, false, 0);
                        self.purge_applied(&mut intake, &stream).await;
                    }
                },
                _ = sleep_until(retry_at), if waiting => {}
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
                // Messages in hand go next, once the other work had its turn.
                _ = std::future::ready(()), if intake.has_pending() && !waiting && !blocked => {}
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
        // What was applied is purged; what was pulled and not applied stays
        // in the stream for the next owner (nothing was acked).
        self.purge_applied(&mut intake, &stream).await;
        Ok(())
    }

    /// Messages pulled and held at most: what one commit may take together.
    fn pull_limit(&self) -> usize {
        1 + self.shared.config.storage.read_ahead
    }

    /// Purges what the partition applied from the command stream when it
    /// is due (a failure is logged and tried again later: the messages stay
    /// and are skipped by their sequence meanwhile).
    async fn purge_applied(&self, intake: &mut Intake, stream: &jetstream::stream::Stream) {
        if !intake.purge_due() {
            return;
        }
        if let Err(e) = intake.purge(stream).await {
            warn!(partition = %self.partition, error = %chain(&e), "cannot purge applied commands; later");
        }
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

/// Sleeps until `at` (forever without one).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

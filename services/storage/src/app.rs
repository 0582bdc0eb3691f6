//! Builds storage from settings and runs it until told to stop: one worker
//! per owned partition, the keyframe schedule, the keyframe control subject,
//! the read API (NATS and HTTP, with `/healthz`, `/readyz`, `/metrics`) and
//! the sampling of the lag and outbox gauges.
//!
//! Graceful shutdown (SIGTERM): `/readyz` turns 503, the workers stop
//! pulling and finish (commit, relay, ack) the message in hand, within a
//! grace period; then the read API stops and the NATS connection is flushed
//! and drained. The caller's telemetry guard flushes the spans.

use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use prost::Message;
use shelfsync_bus::{PAYLOAD_HEADROOM, Partition, Subjects};
use shelfsync_proto::{
    KeyframeReply, KeyframeRequest, PlaceKey, RebaseReply, RebaseRequest, RedriveReply,
    RedriveRequest,
};
use shelfsync_service::{Drain, Service};
use shelfsync_settings::Settings;
use shelfsync_telemetry::chain;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

use crate::config::Config;
use crate::keyframe::{JobProgress, KeyframeJob, keyframe_id_at};
use crate::known::Budget;
use crate::metrics::{self, Stats};
use crate::read::ReadApi;
use crate::readiness::{Readiness, Refusal};
use crate::store::Store;
use crate::worker::{Shared, Worker};

/// How long the workers may take to finish the messages in hand once
/// shutdown starts (below Kubernetes' default 30 s grace period).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);
/// How often the consumer lag and outbox depth gauges are sampled.
const GAUGE_EVERY: Duration = Duration::from_secs(5);

pub struct App {
    config: Arc<Config>,
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    store: Store,
    stats: Arc<Stats>,
    ready: Arc<Readiness>,
    http: tokio::net::TcpListener,
}

/// Sends keyframe jobs to the workers of this replica.
#[derive(Clone)]
struct Keyframer {
    js: async_nats::jetstream::Context,
    changes_stream: String,
    replica: u32,
    partitions: u32,
    workers: Vec<(Partition, mpsc::Sender<KeyframeJob>)>,
}

impl Keyframer {
    /// Starts a keyframe of every owned place, or of one place if this
    /// replica owns it (`None` otherwise); the reply arrives when done.
    async fn start(
        &self,
        keyframe_id: String,
        place: Option<PlaceKey>,
    ) -> Option<oneshot::Receiver<KeyframeReply>> {
        let targets: Vec<_> = match place {
            Some(place) => {
                let owner = Partition::of(place, self.partitions);
                self.workers.iter().filter(|(w, _)| *w == owner).collect()
            }
            None => self.workers.iter().collect(),
        };
        if targets.is_empty() {
            return None;
        }
        // Consumers bootstrapping from this run read changes after this point.
        let changes_seq = match self.js.get_stream(&self.changes_stream).await {
            Ok(mut s) => s.info().await.map(|i| i.state.last_sequence).unwrap_or(0),
            Err(_) => 0,
        };
        let (tx, rx) = oneshot::channel();
        let progress = JobProgress::new(keyframe_id.clone(), self.replica, targets.len(), Some(tx));
        for (_, worker) in targets {
            let job = KeyframeJob {
                keyframe_id: keyframe_id.clone(),
                changes_seq,
                place,
                progress: progress.clone(),
            };
            if worker.send(job).await.is_err() {
                progress.worker_done(Some("worker stopped".into())).await;
            }
        }
        Some(rx)
    }
}

impl App {
    /// Connects to NATS and Redis, checks that the streams have the shape
    /// the settings describe (`shelfsync setup` writes it; storage only
    /// reads it, and refuses to start on any difference) and binds the HTTP
    /// listener.
    pub async fn build(settings: Settings) -> anyhow::Result<App> {
        let config = Config::from(&settings);
        shelfsync_telemetry::install_metrics();
        let client = shelfsync_bus::connect(&config.nats, "shelfsync-storage", true).await?;
        let js = shelfsync_bus::jetstream(client.clone(), &config.nats);
        let store = Store::connect(&config.redis).await.with_context(|| {
            format!("cannot connect to Redis at {}", config.redis.url_redacted())
        })?;
        shelfsync_bus::verify(&js, &config.nats, config.topology()).await?;
        crate::read::read_tokens(&config.storage).context("the read API's tokens")?;
        let http = tokio::net::TcpListener::bind(&config.storage.http_listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.storage.http_listen))?;
        Ok(App {
            config: Arc::new(config),
            client,
            js,
            store,
            stats: Arc::default(),
            ready: Arc::default(),
            http,
        })
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Ready once every owned partition's consumer is bound, until
    /// shutdown starts (what `/readyz` says, Redis aside).
    pub fn readiness(&self) -> Arc<Readiness> {
        self.ready.clone()
    }

    /// Where the HTTP read API listens (useful with port 0).
    pub fn http_addr(&self) -> std::net::SocketAddr {
        self.http.local_addr().expect("bound listener has an address")
    }
}

impl Service for App {
    /// Runs every owned partition until `shutdown` resolves, then lets each
    /// worker finish the message in hand (within a grace period), stops the
    /// read API and flushes and drains the connection.
    async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let max_payload = self.client.server_info().max_payload;
        let max_bytes = max_payload.saturating_sub(PAYLOAD_HEADROOM).max(64 * 1024);
        let record_limit = self.config.storage.max_record_bytes;
        if 2 * record_limit + 16 * 1024 > max_bytes {
            warn!(
                max_record_bytes = record_limit,
                max_payload,
                "a change of a record near storage.max_record_bytes (before and after) may not \
                 fit in one message of this server: such a change goes out without its before \
                 image (before_omitted); raise the server's max_payload or lower the limit"
            );
        }
        let owned = self.config.storage.owned_partitions();
        info!(
            replica = self.config.storage.replica,
            replicas = self.config.storage.replicas,
            partitions = owned.len(),
            http = %self.http_addr(),
            "storage starting"
        );
        let subjects = Subjects::new(&self.config.nats.prefix);
        let stop = Drain::new();
        // The read API and probes outlive the workers: `/readyz` says 503
        // while they drain.
        let serving = Drain::new();
        self.ready.expect(owned.len());
        let mut tasks = tokio::task::JoinSet::new();
        let mut keyframer = Keyframer {
            js: self.js.clone(),
            changes_stream: subjects.changes_stream(),
            replica: self.config.storage.replica,
            partitions: self.config.storage.partitions,
            workers: Vec::new(),
        };
        let keyframe_limits = crate::keyframe::KeyframeLimits::new(
            self.config.storage.keyframe_concurrency,
            self.config.storage.keyframe_rate,
            self.config.storage.keyframe_yield_after,
        );
        let known = self.config.storage.known_records;
        let shared = Arc::new(Shared {
            config: self.config.clone(),
            subjects: subjects.clone(),
            js: self.js.clone(),
            store: self.store.clone(),
            stats: self.stats.clone(),
            max_bytes,
            max_decoded: self.config.storage.max_message_bytes_for(max_payload),
            ready: self.ready.clone(),
            keyframe_limits,
            known_budgets: (Budget::new(known), Budget::new(known)),
            instance: instance_id(),
        });
        for &p in &owned {
            let (job_tx, job_rx) = mpsc::channel(16);
            keyframer.workers.push((Partition(p), job_tx));
            let worker = Arc::new(Worker::new(Partition(p), shared.clone()));
            let rx = stop.clone();
            tasks.spawn(async move {
                let p = worker.partition();
                if let Err(e) = worker.run(rx, job_rx).await {
                    error!(partition = %p, error = %chain(e.as_ref()), "partition worker stopped");
                    return Err(e);
                }
                Ok(())
            });
        }
        let mut side = tokio::task::JoinSet::new();
        side.spawn(schedule_keyframes(
            self.config.storage.keyframe_schedule.clone(),
            keyframer.clone(),
            stop.clone(),
        ));
        side.spawn(serve_keyframe_requests(
            self.client.clone(),
            subjects.clone(),
            keyframer,
            stop.clone(),
        ));
        side.spawn(serve_rebase_requests(
            self.client.clone(),
            subjects.clone(),
            self.store.clone(),
            self.ready.clone(),
            self.config.storage.replica,
            stop.clone(),
        ));
        side.spawn(serve_redrive_requests(
            self.client.clone(),
            subjects.clone(),
            self.store.clone(),
            self.config.storage.replica,
            self.config.storage.owned_partitions(),
            stop.clone(),
        ));
        side.spawn(sample_gauges(
            self.js.clone(),
            self.store.clone(),
            subjects.clone(),
            owned,
            (shared.known_budgets.clone(), self.stats.clone()),
            (self.config.storage.replica, shared.instance.clone()),
            serving.clone(),
        ));
        let read = ReadApi::new(
            self.store.clone(),
            Arc::new(self.config.storage.clone()),
            self.stats.clone(),
        )
        .with_readiness(self.ready.clone());
        side.spawn(read.clone().serve_nats(self.client.clone(), subjects, serving.clone()));
        side.spawn(read.serve_http(self.http, serving.clone()));

        tokio::select! {
            _ = shutdown => info!("shutting down: finishing messages in hand"),
            Some(res) = tasks.join_next() => {
                // A worker ended on its own: stop the rest and report why.
                self.ready.drain();
                stop.start();
                serving.start();
                while tasks.join_next().await.is_some() {}
                side.shutdown().await;
                res??;
                anyhow::bail!("a partition worker stopped unexpectedly");
            }
        }
        self.ready.drain();
        stop.start();
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while let Some(res) = tasks.join_next().await {
                if let Err(e) = res {
                    error!(error = %chain(&e), "partition worker panicked");
                }
            }
        })
        .await;
        if drained.is_err() {
            // Unacked messages are redelivered to the next owner; committed
            // outboxes are relayed by it.
            warn!(grace = ?SHUTDOWN_GRACE, "workers still busy after the grace period: cut off");
            tasks.shutdown().await;
        }
        serving.start();
        // Let the HTTP and NATS read servers finish their requests.
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while side.join_next().await.is_some() {}
        })
        .await;
        side.shutdown().await;
        // Acks and publishes on the wire; bounded if the server is gone.
        shelfsync_bus::close(&self.client).await;
        info!("storage stopped");
        Ok(())
    }
}

/// Samples `shelfsync_consumer_lag{consumer}` (messages the partition
/// consumers have not received yet), `shelfsync_outbox_depth` and the size
/// of what is kept (`shelfsync_known_records`, `shelfsync_kept`) every few
/// seconds until `stop` flips.
async fn sample_gauges(
    js: async_nats::jetstream::Context,
    store: Store,
    subjects: Subjects,
    owned: Vec<u32>,
    ((noops, live), stats): ((Budget, Budget), Arc<Stats>),
    (replica, instance): (u32, String),
    stop: Drain,
) {
    let mut tick = tokio::time::interval(GAUGE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.started() => return,
        }
        if let Ok(stream) = js.get_stream(subjects.cmd_stream()).await {
            for &p in &owned {
                let name =
                    format!("{}-{instance}", subjects.storage_consumer_of(Partition(p), replica));
                if let Ok(info) = stream.consumer_info(&name).await {
                    let lag = info.num_pending + info.num_ack_pending as u64;
                    metrics::consumer_lag(name, lag);
                }
            }
        }
        let (mut depth, mut swept, mut touched) = (0u64, 0u64, 0u64);
        for &p in &owned {
            depth += store.outbox_len(Partition(p)).await.unwrap_or(0);
            if let Ok((s, t)) = store.kept(Partition(p)).await {
                (swept, touched) = (swept + s, touched + t);
            }
        }
        metrics::outbox_depth(depth);
        metrics::known_records(noops.used(), live.used());
        metrics::kept("sweep_outcomes", swept);
        metrics::kept("touched_sets", touched);
        metrics::kept("keyframe_places_queued", Stats::get(&stats.keyframe_places_queued));
    }
}

/// Fires keyframes on the configured cron schedule (UTC). Every replica runs
/// the same schedule; the keyframe id derives from the tick, so all replicas
/// of one tick share it.
async fn schedule_keyframes(schedule: String, keyframer: Keyframer, stop: Drain) {
    let expr = schedule.trim();
    if expr.is_empty() {
        return;
    }
    let schedule = match cron::Schedule::from_str(expr) {
        Ok(s) => s,
        Err(e) => {
            error!(error = %chain(&e), "invalid keyframe schedule; keyframes only on demand");
            return;
        }
    };
    loop {
        let Some(next) = schedule.upcoming(chrono::Utc).next() else { return };
        let wait = (next - chrono::Utc::now()).to_std().unwrap_or_default();
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.started() => return,
        }
        let id = keyframe_id_at(next.timestamp_micros());
        info!(keyframe_id = %id, "scheduled keyframe");
        if let Some(done) = keyframer.start(id, None).await {
            // Don't start the next tick's keyframe while this one runs.
            tokio::select! {
                _ = done => {}
                _ = stop.started() => return,
            }
        }
    }
}

/// Answers the requests of one control subject until `stop`: each request
/// with a reply subject is decoded and goes to `handle`, and what it answers
/// (if anything: a handler may reply later by itself) is published as the
/// reply; a request that does not decode is answered with `bad`. `what`
/// names the requests in logs.
async fn serve_requests<Req, Rep, Fut>(
    client: async_nats::Client,
    subject: String,
    what: &'static str,
    stop: Drain,
    bad: impl Fn(prost::DecodeError) -> Rep,
    mut handle: impl FnMut(Req, async_nats::Subject) -> Fut,
) where
    Req: Message + Default,
    Rep: Message,
    Fut: Future<Output = Option<Rep>>,
{
    let mut sub = match client.subscribe(subject).await {
        Ok(s) => s,
        Err(e) => {
            error!(error = %chain(&e), "cannot subscribe to {what} requests");
            return;
        }
    };
    loop {
        let msg = tokio::select! {
            m = sub.next() => match m { Some(m) => m, None => return },
            _ = stop.started() => return,
        };
        let Some(reply_to) = msg.reply.clone() else { continue };
        let reply = match Req::decode(msg.payload) {
            Ok(req) => handle(req, reply_to.clone()).await,
            Err(e) => Some(bad(e)),
        };
        let Some(reply) = reply else { continue };
        if let Err(e) = client.publish(reply_to, reply.encode_to_vec().into()).await {
            warn!(error = %chain(&e), "cannot reply to a {what} request");
        }
    }
}

/// Answers `KeyframeRequest`s on `<prefix>.ctl.keyframe`: every replica
/// keyframes the places it owns and replies when done.
async fn serve_keyframe_requests(
    client: async_nats::Client,
    subjects: Subjects,
    keyframer: Keyframer,
    stop: Drain,
) {
    let bad =
        |e| KeyframeReply { error: format!("bad KeyframeRequest: {e}"), ..Default::default() };
    let replier = client.clone();
    let handle = |req, reply_to| {
        let (keyframer, client) = (keyframer.clone(), replier.clone());
        async move {
            start_keyframe(&keyframer, client, req, reply_to).await;
            None
        }
    };
    serve_requests(client, subjects.ctl_keyframe(), "keyframe", stop, bad, handle).await;
}

/// Starts the keyframe a request asks for; the reply goes out when it is
/// done, while the next requests are served.
async fn start_keyframe(
    keyframer: &Keyframer,
    client: async_nats::Client,
    req: KeyframeRequest,
    reply_to: async_nats::Subject,
) {
    let id = if req.keyframe_id.is_empty() {
        keyframe_id_at(chrono::Utc::now().timestamp_micros())
    } else {
        req.keyframe_id.clone()
    };
    let place = (req.brand_id != 0 || req.place_id != 0)
        .then_some(PlaceKey::new(req.brand_id, req.place_id));
    let Some(done) = keyframer.start(id, place).await else { return };
    tokio::spawn(async move {
        match done.await {
            Ok(reply) => {
                if let Err(e) = client.publish(reply_to, reply.encode_to_vec().into()).await {
                    warn!(error = %chain(&e), "cannot reply to keyframe request");
                }
            }
            Err(_) => warn!("keyframe abandoned before completion"),
        }
    });
}

/// Answers `RebaseRequest`s on `<prefix>.ctl.rebase`: the partitions of
/// this replica refused because their command stream was replaced adopt the
/// stream they found, with the applied sequence asked; their workers resume
/// within a few seconds. Every replica replies.
async fn serve_rebase_requests(
    client: async_nats::Client,
    subjects: Subjects,
    store: Store,
    ready: Arc<Readiness>,
    replica: u32,
    stop: Drain,
) {
    let bad =
        |e| RebaseReply { replica, error: format!("bad RebaseRequest: {e}"), ..Default::default() };
    let handle = |req: RebaseRequest, _| {
        let (store, ready) = (store.clone(), ready.clone());
        async move { Some(rebase_refused(&store, &ready, replica, &req).await) }
    };
    serve_requests(client, subjects.ctl_rebase(), "rebase", stop, bad, handle).await;
}

/// Re-bases the refused partitions `req` names (all when it names none).
async fn rebase_refused(
    store: &Store,
    ready: &Readiness,
    replica: u32,
    req: &RebaseRequest,
) -> RebaseReply {
    let mut reply = RebaseReply { replica, ..Default::default() };
    for (p, why) in ready.refused() {
        if !req.partitions.is_empty() && !req.partitions.contains(&p) {
            reply.refused.push(p);
            continue;
        }
        let done = match &why {
            Refusal::StreamReplaced { found } => {
                store.rebase(Partition(p), found, req.applied_seq).await.map(|()| {
                    info!(partition = p, stream = %found, applied = req.applied_seq, "partition re-based by an operator");
                    true
                })
            }
            // Only when asked: what was left of the message is dropped.
            Refusal::StepGone { step } if req.drop_step => {
                store.drop_step(Partition(p), step).await.inspect(|&dropped| {
                    if dropped {
                        info!(partition = p, step, "half-applied message's step dropped by an operator");
                    }
                })
            }
            Refusal::StepGone { .. } => Ok(false),
        };
        match done {
            Ok(true) => reply.rebased.push(p),
            Ok(false) => reply.refused.push(p),
            Err(e) => {
                reply.error = format!("partition {p}: {e}");
                reply.refused.push(p);
            }
        }
    }
    reply
}

/// Answers `RedriveRequest`s on `<prefix>.ctl.redrive`: outbox entries of
/// this replica's partitions kept aside as unpublishable go back into their
/// outboxes; each partition's worker relays them with its next message (or
/// at its next start).
async fn serve_redrive_requests(
    client: async_nats::Client,
    subjects: Subjects,
    store: Store,
    replica: u32,
    owned: Vec<u32>,
    stop: Drain,
) {
    let bad = |e| RedriveReply {
        replica,
        error: format!("bad RedriveRequest: {e}"),
        ..Default::default()
    };
    let owned: Arc<[u32]> = owned.into();
    let handle = |req: RedriveRequest, _| {
        let (store, owned) = (store.clone(), owned.clone());
        async move { Some(redrive_owned(&store, &owned, replica, &req).await) }
    };
    serve_requests(client, subjects.ctl_redrive(), "redrive", stop, bad, handle).await;
}

/// Puts back the dead outbox entries `req` names, in the owned partitions it
/// names (all when it names none).
async fn redrive_owned(
    store: &Store,
    owned: &[u32],
    replica: u32,
    req: &RedriveRequest,
) -> RedriveReply {
    let mut reply = RedriveReply { replica, ..Default::default() };
    for &p in owned.iter().filter(|p| req.partitions.is_empty() || req.partitions.contains(p)) {
        match store.redrive(Partition(p), &req.msg_ids).await {
            Ok(n) => {
                if n > 0 {
                    info!(partition = p, entries = n, "outbox entries put back by an operator");
                }
                reply.redriven += n;
            }
            Err(e) => reply.error = format!("partition {p}: {e}"),
        }
    }
    reply
}

pub use shelfsync_service::shutdown_signal;

/// A short id of this process, for its consumers' names.
fn instance_id() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let seed = [now.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat();
    format!("{:08x}", xxhash_rust::xxh3::xxh3_64(&seed) as u32)
}

//! Builds storage from settings and runs it until told to stop: one worker
//! per owned partition, the keyframe schedule (`keyframe`), the control
//! subjects (`requests`), the read API (`read`: NATS, and HTTP with the
//! shared probes `/healthz`, `/readyz`, `/metrics`) and the sampling of the
//! lag and outbox gauges (`metrics`). This module is only the wiring.
//!
//! Graceful shutdown (SIGTERM, or a worker that stopped on its own):
//! `/readyz` turns 503, the workers stop pulling and finish (commit, relay,
//! ack) the message in hand, within a grace period; then the read API stops
//! and the NATS connection is flushed and drained. The caller's telemetry
//! guard flushes the spans.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use shelfsync_bus::{PAYLOAD_HEADROOM, Partition, Subjects};
use shelfsync_service::{Drain, Service, serve};
use shelfsync_settings::Settings;
use shelfsync_telemetry::chain;
use tokio::task::JoinSet;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::keyframe::{KeyframeLimits, Keyframer, schedule_keyframes};
use crate::known::Budget;
use crate::metrics::{GaugeSampler, Stats};
use crate::read::ReadApi;
use crate::readiness::PartitionHealth;
use crate::requests;
use crate::store::Store;
use crate::worker::{Shared, Worker};

/// How long the workers may take to finish the messages in hand once
/// shutdown starts (below Kubernetes' default 30 s grace period).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);
/// How long the read API may take to finish its requests once the workers
/// are done.
const SERVING_GRACE: Duration = Duration::from_secs(5);

pub struct App {
    config: Arc<Config>,
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    store: Store,
    stats: Arc<Stats>,
    ready: Arc<PartitionHealth>,
    http: tokio::net::TcpListener,
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
        let http = shelfsync_service::bind(&config.storage.http_listen).await?;
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
    pub fn readiness(&self) -> Arc<PartitionHealth> {
        self.ready.clone()
    }

    /// Where the HTTP read API listens (useful with port 0).
    pub fn http_addr(&self) -> std::net::SocketAddr {
        self.http.local_addr().expect("bound listener has an address")
    }
}

impl Service for App {
    /// Runs every owned partition until `shutdown` resolves (or a worker
    /// stops on its own), then lets each worker finish the message in hand
    /// (within a grace period), stops the read API and flushes and drains
    /// the connection.
    async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let shared = self.shared();
        let storage = &shared.config.storage;
        let owned = storage.owned_partitions();
        info!(
            replica = storage.replica,
            replicas = storage.replicas,
            partitions = owned.len(),
            http = %self.http_addr(),
            "storage starting"
        );
        let App { client, ready, http, .. } = self;
        let stop = Drain::new();
        // The read API and probes outlive the workers: `/readyz` says 503
        // while they drain.
        let serving = Drain::new();
        ready.expect(owned.len());
        let (mut workers, keyframer) = spawn_workers(&shared, &owned, &stop);
        let mut side = spawn_side_tasks(&shared, &client, http, keyframer, &stop, &serving);

        let failed = tokio::select! {
            _ = shutdown => {
                info!("shutting down: finishing messages in hand");
                None
            }
            Some(res) = workers.join_next() => Some(res),
        };
        ready.drain();
        stop.start();
        finish_workers(&mut workers).await;
        serving.start();
        // Let the HTTP and NATS read servers finish their requests.
        let _ = tokio::time::timeout(SERVING_GRACE, async {
            while side.join_next().await.is_some() {}
        })
        .await;
        side.shutdown().await;
        // Acks and publishes on the wire; bounded if the server is gone.
        shelfsync_bus::close(&client).await;
        let Some(res) = failed else {
            info!("storage stopped");
            return Ok(());
        };
        // A worker ended on its own: report why.
        res??;
        anyhow::bail!("a partition worker stopped unexpectedly");
    }
}

impl App {
    /// What the partition workers share, the limits of this server's
    /// messages checked.
    fn shared(&self) -> Arc<Shared> {
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
        let storage = &self.config.storage;
        let known = storage.known_records;
        Arc::new(Shared {
            config: self.config.clone(),
            subjects: Subjects::new(&self.config.nats.prefix),
            js: self.js.clone(),
            store: self.store.clone(),
            stats: self.stats.clone(),
            max_bytes,
            max_decoded: storage.max_message_bytes_for(max_payload),
            ready: self.ready.clone(),
            keyframe_limits: KeyframeLimits::new(
                storage.keyframe_concurrency,
                storage.keyframe_rate,
                storage.keyframe_yield_after,
            ),
            known_budgets: (Budget::new(known), Budget::new(known)),
            instance: instance_id(),
        })
    }
}

/// Everything but the workers: the keyframe schedule and the control
/// subjects until `stop`; the gauges and the read API (NATS, and HTTP on
/// `http` with the probes) until `serving`.
fn spawn_side_tasks(
    shared: &Shared,
    client: &async_nats::Client,
    http: tokio::net::TcpListener,
    keyframer: Keyframer,
    stop: &Drain,
    serving: &Drain,
) -> JoinSet<()> {
    let storage = &shared.config.storage;
    let (subjects, store, replica) = (&shared.subjects, &shared.store, storage.replica);
    let mut side = JoinSet::new();
    side.spawn(schedule_keyframes(
        storage.keyframe_schedule.clone(),
        keyframer.clone(),
        stop.clone(),
    ));
    side.spawn(requests::serve_keyframe_requests(
        client.clone(),
        subjects.clone(),
        keyframer,
        stop.clone(),
    ));
    side.spawn(requests::serve_rebase_requests(
        client.clone(),
        subjects.clone(),
        store.clone(),
        shared.ready.clone(),
        replica,
        stop.clone(),
    ));
    side.spawn(requests::serve_redrive_requests(
        client.clone(),
        subjects.clone(),
        store.clone(),
        replica,
        storage.owned_partitions(),
        stop.clone(),
    ));
    let gauges = GaugeSampler {
        js: shared.js.clone(),
        store: store.clone(),
        subjects: subjects.clone(),
        owned: storage.owned_partitions(),
        known: shared.known_budgets.clone(),
        stats: shared.stats.clone(),
        replica,
        instance: shared.instance.clone(),
    };
    side.spawn(gauges.run(serving.clone()));
    let read = ReadApi::new(store.clone(), Arc::new(storage.clone()), shared.stats.clone());
    side.spawn(read.clone().serve_nats(client.clone(), subjects.clone(), serving.clone()));
    let probes = crate::read::probes(shared.ready.clone(), store.clone());
    let http = serve(http, read.router().merge(probes.router()), serving);
    side.spawn(async move {
        // Cut off with the other side tasks if its requests outlast the grace.
        let _cut_off_with_this_task = AbortOnDrop(http.abort_handle());
        match http.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => error!(error = %chain(&e), "HTTP server failed"),
            Err(e) => error!(error = %chain(&e), "HTTP server failed"),
        }
    });
    side
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One worker per owned partition, each in a task until `stop`, and the
/// keyframer that hands them keyframe jobs.
fn spawn_workers(
    shared: &Arc<Shared>,
    owned: &[u32],
    stop: &Drain,
) -> (JoinSet<anyhow::Result<()>>, Keyframer) {
    let storage = &shared.config.storage;
    let mut keyframer = Keyframer::new(
        shared.js.clone(),
        shared.subjects.changes_stream(),
        storage.replica,
        storage.partitions,
    );
    let mut workers = JoinSet::new();
    for &p in owned {
        let jobs = keyframer.add_worker(Partition(p));
        let worker = Arc::new(Worker::new(Partition(p), shared.clone()));
        let rx = stop.clone();
        workers.spawn(async move {
            let p = worker.partition();
            if let Err(e) = worker.run(rx, jobs).await {
                error!(partition = %p, error = %chain(e.as_ref()), "partition worker stopped");
                return Err(e);
            }
            Ok(())
        });
    }
    (workers, keyframer)
}

/// Waits for the workers to finish the messages in hand, within the grace
/// period; those still busy then are cut off.
async fn finish_workers(workers: &mut JoinSet<anyhow::Result<()>>) {
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while let Some(res) = workers.join_next().await {
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
        workers.shutdown().await;
    }
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

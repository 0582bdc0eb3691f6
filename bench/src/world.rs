//! The servers of one run and what every scenario needs from them: settings for a system
//! (its own prefix, key namespace and Redis db, so storage, the floor and the naive loop share
//! the servers and nothing else), the environment a child reads them from, stream helpers.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream;
use shelfsync_settings::{ImportKind, PartnerSettings, Settings};
use shelfsync_testkit::{NatsCluster, NatsServer, RedisServer};

use crate::measure::{self, RedisInfo};
use crate::profile::Profile;

/// Brand of every generated feed.
pub const BRAND: i64 = 7;

/// Redis as a durable deployment runs it: every write in the append-only file, fsynced before
/// the reply (one fsync per event-loop turn, so pipelined writes share it).
const REDIS_DURABLE: [&str; 4] = ["--appendonly", "yes", "--appendfsync", "always"];

/// How the servers of a durable run keep what they acknowledge (the report says it).
const DURABLE: &str = "durable: Redis appendonly yes + appendfsync always, \
     NATS JetStream sync_interval always";
/// The same for a `--volatile` run.
const VOLATILE: &str = "volatile: Redis without AOF or snapshots, \
     NATS JetStream with its default sync (every 2 minutes)";

/// The NATS side of a `--nats-cluster` run, as the prod overlay runs it.
const CLUSTER: &str = "NATS: 3 nats-server nodes, streams with 3 replicas, JetStream's \
     default sync (a message is acknowledged once 2 of the 3 nodes have it; none fsyncs it)";

/// The run's NATS: one server, or a 3-node cluster with R3 streams (`--nats-cluster`).
pub enum Nats {
    One(NatsServer),
    Cluster(NatsCluster),
}

impl Nats {
    /// Client URL(s): a comma-separated list for the cluster.
    pub fn url(&self) -> String {
        match self {
            Nats::One(n) => n.url(),
            Nats::Cluster(c) => c.urls(),
        }
    }

    /// Every nats-server process of the run.
    fn pids(&self) -> Vec<u32> {
        match self {
            Nats::One(n) => n.pid().into_iter().collect(),
            Nats::Cluster(c) => (0..c.len()).filter_map(|i| c.node(i).pid()).collect(),
        }
    }
}

/// JetStream fsyncing every write. NATS config keys do not merge, so this block replaces the
/// testkit's whole `jetstream` block: it repeats its limits, with the store under `store`.
fn durable_jetstream(store: &Path) -> String {
    format!(
        "jetstream {{\n  store_dir: \"{}\"\n  max_memory_store: 256MB\n  max_file_store: 4GB\n  \
         sync_interval: always\n}}\n",
        store.display()
    )
}

pub struct World {
    pub nats: Nats,
    pub redis: RedisServer,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    info_conn: redis::aio::MultiplexedConnection,
    pub profile: Profile,
    pub work: PathBuf,
    /// Servers fsync what they acknowledge (the default), or not (`--volatile`); with a NATS
    /// cluster only Redis does (the replicas are the cluster's durability).
    pub durable: bool,
}

/// The run's nats-server and redis-server: durable (JetStream's store under `work`), or as the
/// testkit starts them.
async fn start_servers(work: &Path, durable: bool) -> anyhow::Result<(NatsServer, RedisServer)> {
    let (jetstream, redis_args) = if durable {
        (durable_jetstream(&work.join("jetstream")), &REDIS_DURABLE[..])
    } else {
        (String::new(), &[][..])
    };
    tokio::try_join!(
        NatsServer::start_with_config(&jetstream),
        RedisServer::start_with_args(redis_args)
    )
    .context("starting nats-server and redis-server (see shelfsync-testkit)")
}

/// A 3-node NATS cluster with JetStream's default sync (the prod overlay's settings) and Redis
/// durable or not.
async fn start_cluster(durable: bool) -> anyhow::Result<(NatsCluster, RedisServer)> {
    let redis_args = if durable { &REDIS_DURABLE[..] } else { &[][..] };
    tokio::try_join!(NatsCluster::start(3), RedisServer::start_with_args(redis_args))
        .context("starting a 3-node NATS cluster and redis-server (see shelfsync-testkit)")
}

/// `<target dir>/bench-work/run-<pid>`, the target dir being where this binary was built: one
/// dir per run, so that runs sharing a target dir (CI jobs) never delete each other's dumps.
pub fn default_work_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this executable")?;
    // target/<profile>/shelfsync-bench → target/
    let target = exe.parent().and_then(Path::parent).context("executable has no target dir")?;
    Ok(target.join("bench-work").join(format!("run-{}", std::process::id())))
}

impl World {
    /// Starts the run's servers: one nats-server, or a 3-node cluster when `cluster`.
    pub async fn start(
        profile: Profile,
        work: PathBuf,
        durable: bool,
        cluster: bool,
    ) -> anyhow::Result<World> {
        std::fs::create_dir_all(&work)
            .with_context(|| format!("creating the work dir {}", work.display()))?;
        let (nats, redis) = if cluster {
            let (c, r) = start_cluster(durable).await?;
            (Nats::Cluster(c), r)
        } else {
            let (n, r) = start_servers(&work, durable).await?;
            (Nats::One(n), r)
        };
        let urls: Vec<String> = nats.url().split(',').map(String::from).collect();
        let client = async_nats::connect(urls.as_slice()).await.context("connecting to NATS")?;
        let js =
            jetstream::ContextBuilder::new().timeout(Duration::from_secs(30)).build(client.clone());
        let info_conn = redis::Client::open(redis.url())?
            .get_multiplexed_async_connection()
            .await
            .context("connecting to Redis")?;
        Ok(World { nats, redis, client, js, info_conn, profile, work, durable })
    }

    /// NATS is a 3-node cluster with R3 streams.
    pub fn cluster(&self) -> bool {
        matches!(self.nats, Nats::Cluster(_))
    }

    /// Replicas of every stream of the run: one per node.
    pub fn stream_replicas(&self) -> usize {
        match &self.nats {
            Nats::One(_) => 1,
            Nats::Cluster(c) => c.len(),
        }
    }

    /// What the servers of this run keep; the report says it next to every figure.
    pub fn durability(&self) -> String {
        match (self.cluster(), self.durable) {
            (false, true) => DURABLE.into(),
            (false, false) => VOLATILE.into(),
            (true, true) => {
                format!("R3 cluster: {CLUSTER}; Redis appendonly yes + appendfsync always")
            }
            (true, false) => format!("R3 cluster: {CLUSTER}; Redis without AOF or snapshots"),
        }
    }

    /// Settings of one system under test: subjects and streams under `prefix`, keys under the
    /// same namespace in Redis db `db`.
    pub fn settings(&self, prefix: &str, db: u8) -> Settings {
        let mut s = Settings::default();
        s.nats.url = self.nats.url();
        s.nats.prefix = prefix.to_string();
        s.nats.stream_replicas = self.stream_replicas();
        s.redis.url = format!("{}/{db}", self.redis.url());
        s.redis.namespace = prefix.to_string();
        s.storage.partitions = self.profile.partitions;
        // Keyframes only when a scenario asks for one.
        s.storage.keyframe_schedule = String::new();
        s.storage.ack_wait = Duration::from_secs(60);
        s.telemetry.log_level = "warn".into();
        s
    }

    pub async fn provision(&self, settings: &Settings) -> anyhow::Result<()> {
        shelfsync_bus::provision(&self.js, &settings.nats, settings.topology())
            .await
            .context("provisioning streams")
    }

    pub async fn redis_info(&self) -> anyhow::Result<RedisInfo> {
        RedisInfo::fetch(&mut self.info_conn.clone()).await
    }

    /// Compacts Redis' append-only file and waits until it is done: the counterpart of the
    /// PostgreSQL peer's `CHECKPOINT` before each import, untimed. Without it a rewrite that
    /// Redis starts by itself (`auto-aof-rewrite-percentage`) forks a child that takes most of
    /// a core in the middle of whichever import happens to cross the size (seen: 17% of all
    /// CPU samples during a 1% churn re-import), and that child's CPU is not in `used_cpu_*`.
    pub async fn rewrite_aof(&self) -> anyhow::Result<()> {
        let mut conn = self.info_conn.clone();
        let started = Instant::now();
        let mut asked = false;
        loop {
            let info: String = redis::cmd("INFO").arg("persistence").query_async(&mut conn).await?;
            let busy = ["aof_rewrite_in_progress:1", "aof_rewrite_scheduled:1"]
                .iter()
                .any(|field| info.lines().any(|l| l.trim() == *field));
            match (busy, asked) {
                (false, true) => return Ok(()),
                (false, false) => {
                    let _: redis::Value = redis::cmd("BGREWRITEAOF").query_async(&mut conn).await?;
                    asked = true;
                }
                (true, _) => {}
            }
            anyhow::ensure!(started.elapsed() < Duration::from_secs(300), "AOF rewrite stuck");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// CPU seconds of the nats-server processes so far, all nodes (None if none was found).
    pub fn nats_cpu(&self) -> Option<f64> {
        let each: Vec<f64> =
            self.nats.pids().into_iter().filter_map(measure::cpu_seconds).collect();
        (!each.is_empty()).then(|| each.iter().sum())
    }

    pub async fn flush_db(&self, db: u8) -> anyhow::Result<()> {
        let mut conn = redis::Client::open(format!("{}/{db}", self.redis.url()))?
            .get_multiplexed_async_connection()
            .await?;
        // ASYNC: freeing millions of keys must not block Redis (or time this client out).
        let _: () = redis::cmd("FLUSHDB").arg("ASYNC").query_async(&mut conn).await?;
        Ok(())
    }

    /// Drops every message of a stream (disk stays bounded across scenarios).
    pub async fn purge(&self, name: &str) -> anyhow::Result<()> {
        let stream = self.js.get_stream(name).await?;
        stream.purge().await.with_context(|| format!("purging {name}"))?;
        Ok(())
    }
}

/// A partner of the generated feeds: `bench` (full dump, every field) or `bench-prices`
/// (delta feed owning the prices).
pub fn partner(prices_only: bool) -> PartnerSettings {
    let (name, kind, fields): (&str, ImportKind, &[&str]) = if prices_only {
        ("bench-prices", ImportKind::Delta, &["price", "old_price"])
    } else {
        ("bench", ImportKind::Full, &shelfsync_proto::product_field::NAMES)
    };
    PartnerSettings {
        name: name.into(),
        brand_id: BRAND,
        kind,
        fields: fields.iter().map(|f| f.to_string()).collect(),
        ..Default::default()
    }
}

/// A loopback port free right now (the child binds it a moment later).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// JetStream's `sync_always`, and Redis' `appendonly` / `appendfsync`, as the servers say.
    async fn read_back(
        nats: &NatsServer,
        redis: &RedisServer,
    ) -> anyhow::Result<(bool, Vec<String>)> {
        let monitor: std::net::SocketAddr =
            nats.monitor_url().trim_start_matches("http://").parse()?;
        let varz = crate::http::get_json(monitor, "/varz").await?;
        let sync = varz["jetstream"]["config"]["sync_always"].as_bool().unwrap_or(false);
        let mut conn = redis::Client::open(redis.url())?.get_multiplexed_async_connection().await?;
        let mut aof = Vec::new();
        for name in ["appendonly", "appendfsync"] {
            let got: Vec<String> =
                redis::cmd("CONFIG").arg("GET").arg(name).query_async(&mut conn).await?;
            aof.push(got.get(1).cloned().unwrap_or_default());
        }
        Ok((sync, aof))
    }

    #[tokio::test]
    async fn volatile_servers_do_not_fsync_every_write() -> anyhow::Result<()> {
        let work = tempfile::tempdir()?;
        let (nats, redis) = start_servers(work.path(), false).await?;
        let (sync, aof) = read_back(&nats, &redis).await?;
        assert!(!sync);
        assert_eq!(aof[0], "no");
        Ok(())
    }

    #[tokio::test]
    async fn a_cluster_run_has_three_nodes_and_r3_streams() -> anyhow::Result<()> {
        let work = tempfile::tempdir()?;
        let profile = Profile::new(true, Some(1000));
        let world = World::start(profile, work.path().into(), true, true).await?;
        assert!(world.cluster() && world.durability().starts_with("R3 cluster"));
        assert_eq!(world.nats.url().split(',').count(), 3);
        let settings = world.settings("r3", 1);
        world.provision(&settings).await?;
        let subjects = shelfsync_bus::Subjects::new("r3");
        let mut stream = world.js.get_stream(subjects.changes_stream()).await?;
        assert_eq!(stream.info().await?.config.num_replicas, 3);
        assert!(world.nats_cpu().is_some(), "CPU of the three nodes");
        Ok(())
    }

    #[tokio::test]
    async fn servers_start_durable() -> anyhow::Result<()> {
        let work = tempfile::tempdir()?;
        let (nats, redis) = start_servers(work.path(), true).await?;
        assert_eq!(read_back(&nats, &redis).await?, (true, vec!["yes".into(), "always".into()]));
        // The block replaced the testkit's: its store and limits are there too.
        let monitor: std::net::SocketAddr =
            nats.monitor_url().trim_start_matches("http://").parse()?;
        let varz = crate::http::get_json(monitor, "/varz").await?;
        let js = &varz["jetstream"]["config"];
        let store = js["store_dir"].as_str().unwrap_or_default();
        assert!(store.starts_with(&work.path().join("jetstream").display().to_string()), "{js}");
        assert_eq!(js["max_storage"], 4u64 << 30, "{js}");
        Ok(())
    }
}

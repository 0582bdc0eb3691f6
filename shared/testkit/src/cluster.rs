//! Clusters on loopback for scale-out and failover tests: a real Redis Cluster (made by
//! `redis-cli --cluster create`) and a real NATS cluster with clustered JetStream. Each node is
//! one [`RedisServer`] / [`NatsServer`] with its own port and temp dir, killable and restartable
//! on its own.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::bins::redis_cli_bin;
use crate::process::{self, START_ATTEMPTS};
use crate::{NatsServer, RedisServer};

/// How long a cluster gets to agree on its state (slots, a JetStream meta leader).
const FORM_TIMEOUT: Duration = Duration::from_secs(30);
/// A node is marked failing after this long unreachable (Redis `cluster-node-timeout`).
const REDIS_NODE_TIMEOUT_MS: u32 = 2000;

/// A Redis Cluster of masters only (`--cluster-replicas 0`), slots spread evenly. Killing a
/// node takes its slots away (state `fail`) until it is restarted: there is no replica to
/// promote, which is what a test of "cluster down, then back" wants.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` (at least 3) cluster-enabled servers without persistence, joins them
    /// with `redis-cli --cluster create`, and waits until every node says `cluster_state:ok`.
    pub async fn start(masters: usize) -> anyhow::Result<RedisCluster> {
        Self::start_with_args(masters, &[]).await
    }

    /// Like [`RedisCluster::start`], with `args` given to every server (e.g. `--appendonly yes`
    /// so that a restarted node keeps its data).
    pub async fn start_with_args(masters: usize, args: &[&str]) -> anyhow::Result<RedisCluster> {
        if masters < 3 {
            bail!("a Redis Cluster needs at least 3 masters, not {masters}");
        }
        let mut nodes = Vec::with_capacity(masters);
        for _ in 0..masters {
            nodes.push(start_cluster_node(args).await?);
        }
        let cluster = RedisCluster { nodes };
        let mut create = tokio::process::Command::new(redis_cli_bin()?);
        create.arg("--cluster").arg("create");
        create.args(cluster.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())));
        create.args(["--cluster-replicas", "0", "--cluster-yes"]);
        let out = create.output().await.context("running redis-cli --cluster create")?;
        if !out.status.success() {
            bail!(
                "redis-cli --cluster create failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        cluster.wait_ok().await?;
        Ok(cluster)
    }

    /// Node URLs, comma-separated: the `[redis] url` of a `cluster = true` config.
    pub fn urls(&self) -> String {
        self.node_urls().join(",")
    }

    pub fn node_urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn node(&self, i: usize) -> &RedisServer {
        &self.nodes[i]
    }

    /// SIGKILL node `i`: its slots are unavailable until [`RedisCluster::restart`].
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts node `i` again (same port, dir and `nodes.conf`, so the same node id and slots)
    /// and waits until the whole cluster is `ok` again. Without AOF its keys are gone.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.nodes[i].restart().await?;
        self.wait_ok().await
    }

    /// Waits until every running node reports `cluster_state:ok` with all slots assigned and
    /// all nodes known.
    pub async fn wait_ok(&self) -> anyhow::Result<()> {
        let n = self.nodes.len();
        let ports: Vec<u16> = self.nodes.iter().map(RedisServer::port).collect();
        wait_for("the Redis Cluster to be ok", || async {
            for &port in &ports {
                let info = resp_bulk(port, &["CLUSTER", "INFO"]).await?;
                for want in [
                    "cluster_state:ok".to_string(),
                    "cluster_slots_assigned:16384".to_string(),
                    format!("cluster_known_nodes:{n}"),
                ] {
                    if !info.lines().any(|l| l.trim() == want) {
                        bail!("node on port {port} lacks {want}");
                    }
                }
            }
            Ok(())
        })
        .await
    }
}

async fn start_cluster_node(args: &[&str]) -> anyhow::Result<RedisServer> {
    let mut last = None;
    for _ in 0..START_ATTEMPTS {
        // The bus port is set explicitly: the default (port + 10000) overflows for ports the OS
        // hands out above 55535.
        let [bus] = process::free_ports()?;
        let bus = bus.to_string();
        let timeout = REDIS_NODE_TIMEOUT_MS.to_string();
        let mut all = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-port",
            &bus,
            "--cluster-node-timeout",
            &timeout,
        ];
        all.extend_from_slice(args);
        match RedisServer::start_with_args(&all).await {
            Ok(server) => return Ok(server),
            // Most likely the bus port was taken meanwhile: try another one.
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt made")))
}

/// One RESP command on a fresh connection; returns a bulk or simple-string reply as text.
async fn resp_bulk(port: u16, args: &[&str]) -> anyhow::Result<String> {
    let mut request = format!("*{}\r\n", args.len());
    for a in args {
        request.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    let mut conn = BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?);
    conn.get_mut().write_all(request.as_bytes()).await?;
    let mut header = String::new();
    conn.read_line(&mut header).await?;
    let header = header.trim_end();
    if let Some(simple) = header.strip_prefix('+') {
        return Ok(simple.to_string());
    }
    let Some(len) = header.strip_prefix('$').and_then(|n| n.parse::<usize>().ok()) else {
        bail!("{args:?} answered {header:?}");
    };
    let mut body = vec![0; len + 2];
    conn.read_exact(&mut body).await?;
    body.truncate(len);
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// A NATS cluster (full mesh of routes) with JetStream on every node, each with its own store
/// dir and unique `server_name`, so streams can be replicated (R3 on three nodes).
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
    name: String,
}

impl NatsCluster {
    /// Starts `size` servers at once (a JetStream cluster elects its meta leader only once a
    /// quorum is up) and waits until they agree on a meta leader.
    pub async fn start(size: usize) -> anyhow::Result<NatsCluster> {
        if size == 0 {
            bail!("a NATS cluster needs at least one node");
        }
        let name = format!("testkit_{:08x}", process::random_u64() as u32);
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            let routes = process::free_port_list(size)?;
            let route_list = routes
                .iter()
                .map(|p| format!("nats-route://127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(", ");
            let mut starting = tokio::task::JoinSet::new();
            for (i, port) in routes.iter().enumerate() {
                let conf = format!(
                    "cluster {{\n  name: \"{name}\"\n  listen: 127.0.0.1:{port}\n  \
                     routes: [{route_list}]\n}}\n"
                );
                starting.spawn(async move { (i, NatsServer::start_with_config(&conf).await) });
            }
            let mut nodes: Vec<Option<NatsServer>> = (0..size).map(|_| None).collect();
            let mut failed = None;
            while let Some(joined) = starting.join_next().await {
                match joined.context("starting a cluster node")? {
                    (i, Ok(server)) => nodes[i] = Some(server),
                    (_, Err(e)) => failed = Some(e),
                }
            }
            if let Some(e) = failed {
                // A route port taken meanwhile fails one node; start over with fresh ports.
                last = Some(e);
                continue;
            }
            let cluster = NatsCluster { nodes: nodes.into_iter().flatten().collect(), name };
            cluster.wait_meta_leader().await?;
            return Ok(cluster);
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt made")))
    }

    /// Client URLs of every node, comma-separated: the `[nats] url` of a config.
    pub fn urls(&self) -> String {
        self.nodes.iter().map(NatsServer::url).collect::<Vec<_>>().join(",")
    }

    pub fn cluster_name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn node(&self, i: usize) -> &NatsServer {
        &self.nodes[i]
    }

    /// The node whose `server_name` is `name` (e.g. a stream's leader).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name() == name)
    }

    /// SIGKILL node `i`; the others keep quorum (for 3 nodes) and elect new leaders.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts node `i` again with the same ports and store, and waits until the running nodes
    /// agree on a meta leader.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.nodes[i].restart().await?;
        self.wait_meta_leader().await.map(|_| ())
    }

    /// Waits until every running node names the same running node as JetStream meta leader,
    /// and that leader sees the other running nodes as current; returns the leader's name.
    pub async fn wait_meta_leader(&self) -> anyhow::Result<String> {
        let names: Vec<String> = self.nodes.iter().map(|n| n.name().to_string()).collect();
        let monitors: Vec<u16> = self.nodes.iter().map(monitor_port).collect();
        wait_for("a JetStream meta leader", || async {
            // A killed node refuses connections: only the running ones vote here.
            let mut views = Vec::new();
            for (name, &port) in names.iter().zip(&monitors) {
                match http_get(port, "/jsz").await {
                    Ok(body) => views.push((name.clone(), body)),
                    Err(_) => continue,
                }
            }
            let running: Vec<&String> = views.iter().map(|(n, _)| n).collect();
            let mut agreed: Option<String> = None;
            for (name, body) in &views {
                let jsz: serde_json::Value = serde_json::from_str(body)?;
                let meta = &jsz["meta_cluster"];
                let Some(l) = meta["leader"].as_str().filter(|l| !l.is_empty()) else {
                    bail!("{name} knows no meta leader");
                };
                if agreed.as_deref().is_some_and(|a| a != l) {
                    bail!("nodes disagree on the meta leader");
                }
                if !running.iter().any(|r| r.as_str() == l) {
                    bail!("meta leader {l} is not running");
                }
                if name == l {
                    let current = meta["replicas"].as_array().cloned().unwrap_or_default();
                    for peer in running.iter().filter(|r| r.as_str() != l) {
                        let ok = current.iter().any(|r| {
                            r["name"].as_str() == Some(peer.as_str())
                                && r["current"].as_bool() == Some(true)
                        });
                        if !ok {
                            bail!("{peer} is not current with the meta leader");
                        }
                    }
                }
                agreed = Some(l.to_string());
            }
            agreed.context("no node answered")
        })
        .await
    }
}

fn monitor_port(n: &NatsServer) -> u16 {
    n.monitor_url().rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0)
}

/// A minimal HTTP/1.0 GET on loopback; the body of a 200 answer.
async fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes()).await?;
    let mut response = String::new();
    s.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if !head.lines().next().is_some_and(|status| status.contains(" 200 ")) {
        bail!("GET {path}: {head}");
    }
    Ok(body.to_string())
}

/// Polls `check` until it succeeds; the error names the last complaint.
async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let start = Instant::now();
    loop {
        let last = match tokio::time::timeout(Duration::from_secs(2), check()).await {
            Ok(Ok(done)) => return Ok(done),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => "check timed out".to_string(),
        };
        if start.elapsed() > FORM_TIMEOUT {
            bail!("timed out after {FORM_TIMEOUT:?} waiting for {what}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn redis_cluster_spreads_slots_and_survives_a_node_restart() -> anyhow::Result<()> {
        let mut cluster = RedisCluster::start(3).await?;
        assert_eq!(cluster.node_urls().len(), 3);
        assert_eq!(cluster.urls().split(',').count(), 3);
        let mut owners = 0;
        for i in 0..3 {
            let slots = resp_bulk(cluster.node(i).port(), &["CLUSTER", "INFO"]).await?;
            assert!(slots.contains("cluster_state:ok"), "{slots}");
            let nodes = resp_bulk(cluster.node(i).port(), &["CLUSTER", "NODES"]).await?;
            if nodes.lines().any(|l| l.contains("myself,master") && l.split(' ').count() > 8) {
                owners += 1;
            }
        }
        assert_eq!(owners, 3, "every master owns slots");
        cluster.kill(1);
        assert!(resp_bulk(cluster.node(1).port(), &["PING"]).await.is_err());
        cluster.restart(1).await?;
        assert_eq!(resp_bulk(cluster.node(1).port(), &["PING"]).await?, "PONG");
        Ok(())
    }

    #[tokio::test]
    async fn nats_cluster_elects_a_meta_leader_and_reelects_without_it() -> anyhow::Result<()> {
        let mut cluster = NatsCluster::start(3).await?;
        assert_eq!(cluster.urls().split(',').count(), 3);
        let leader = cluster.wait_meta_leader().await?;
        let i = cluster.index_of(&leader).context("leader is a node")?;
        cluster.kill(i);
        let next = cluster.wait_meta_leader().await?;
        assert_ne!(next, leader, "a killed node cannot stay leader");
        cluster.restart(i).await?;
        cluster.wait_meta_leader().await?;
        Ok(())
    }
}

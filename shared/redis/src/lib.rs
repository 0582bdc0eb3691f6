//! Redis plumbing shared by every shelfsync service that keeps state in Redis
//! (storage, ingest, aggregator): one connection type for a standalone server
//! or a Redis Cluster, chosen by config (`[redis] cluster`).
//!
//! - [`RedisConn`]: connect with the configured URL(s), timeouts and retries;
//!   use it anywhere a `redis::aio::ConnectionLike` goes (`query_async`,
//!   pipelines, scripts). Cheap to clone: both variants multiplex one
//!   connection per node and reconnect on their own.
//! - [`is_transient`] / [`is_content_error`]: whether a failed call is worth
//!   retrying later, or the same input will always hit it; [`is_out_of_room`].
//! - [`key_slot`] / [`group_by_slot`]: the cluster hash slot of a key, and
//!   items grouped by slot so that each pipeline stays on one slot.
//!
//! It owns no key layout: each service names its keys, and a service that
//! runs several keys in one step (a pipeline, a MULTI, a Lua script) must give
//! them one hash tag `{...}`, or Redis Cluster refuses the step with
//! `CROSSSLOT` (pipelines are refused before they are sent).
#![forbid(unsafe_code)]

use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};
use shelfsync_settings::RedisSettings;

/// Number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// Longest wait for a TCP connection to one node.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for one reply. A commit of a 1000-record batch is one Lua
/// call of a few MB and takes milliseconds; this only cuts off a dead peer.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Cluster: a whole request, including retries and MOVED/ASK redirections
/// while slots move or a replica is promoted (node timeout + election).
const CLUSTER_OVERALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Cluster: retries of a request on connection errors, TRYAGAIN and
/// CLUSTERDOWN, waiting 100 ms, 200 ms, ... up to 2 s between tries (about
/// 6 s in all) — the client's defaults wait minutes.
const CLUSTER_RETRIES: u32 = 6;
const CLUSTER_RETRY_MIN_MS: u64 = 50;
const CLUSTER_RETRY_MAX_MS: u64 = 2_000;
const CLUSTER_RETRY_FACTOR_MS: u64 = 100;
/// Standalone: longest back-off between reconnection attempts.
const SINGLE_MAX_RECONNECT_DELAY: Duration = Duration::from_secs(2);

/// A standalone or cluster connection, chosen by `[redis] cluster`.
///
/// On a cluster, each command goes to the master of its key's slot, and a
/// pipeline to the master of its first key's slot: every key of a pipeline,
/// transaction or script must share one hash tag.
#[derive(Clone)]
pub enum RedisConn {
    Single(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl RedisConn {
    /// Connects to `cfg.url` (standalone) or to the cluster whose nodes
    /// `cfg.url` lists, comma-separated (any reachable node is enough to
    /// discover the rest). Fails if no server answers now; later outages are
    /// ridden through by reconnecting.
    pub async fn connect(cfg: &RedisSettings) -> RedisResult<RedisConn> {
        let certs = tls_certificates(cfg)?;
        if cfg.url.contains("rediss://") {
            // rustls is built without a default provider: use ring, as NATS does.
            shelfsync_telemetry::install_crypto_provider();
        }
        if cfg.cluster {
            let nodes: Vec<String> = cfg.urls().iter().map(|u| with_scheme(u)).collect();
            let mut builder = redis::cluster::ClusterClient::builder(nodes);
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            let client = builder
                .connection_timeout(CONNECT_TIMEOUT)
                .response_timeout(RESPONSE_TIMEOUT)
                .overall_response_timeout(Some(CLUSTER_OVERALL_TIMEOUT))
                .retries(CLUSTER_RETRIES)
                .min_retry_wait(CLUSTER_RETRY_MIN_MS)
                .max_retry_wait(CLUSTER_RETRY_MAX_MS)
                .retry_wait_formula(CLUSTER_RETRY_FACTOR_MS, 2)
                .build()?;
            Ok(RedisConn::Cluster(client.get_async_connection().await?))
        } else {
            let url = with_scheme(cfg.url.trim());
            let client = match certs {
                Some(certs) => redis::Client::build_with_tls(url, certs)?,
                None => redis::Client::open(url)?,
            };
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_response_timeout(Some(RESPONSE_TIMEOUT))
                .set_max_delay(SINGLE_MAX_RECONNECT_DELAY);
            Ok(RedisConn::Single(client.get_connection_manager_with_config(config).await?))
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(_))
    }
}

/// The CA and client certificate of `[redis] tls_*`, read from their files
/// (`None`: plain connection, or TLS trusting the system roots).
fn tls_certificates(cfg: &RedisSettings) -> RedisResult<Option<redis::TlsCertificates>> {
    if cfg.tls_ca_file.is_none() && cfg.tls_cert_file.is_none() {
        return Ok(None);
    }
    let read = |what: &str, path: &str| {
        std::fs::read(path).map_err(|e| {
            redis::RedisError::from((
                redis::ErrorKind::Io,
                "cannot read a Redis TLS file",
                format!("{what} {path}: {e}"),
            ))
        })
    };
    let root_cert = match &cfg.tls_ca_file {
        Some(p) => Some(read("redis.tls_ca_file", p)?),
        None => None,
    };
    let client_tls = match (&cfg.tls_cert_file, &cfg.tls_key_file) {
        (Some(c), Some(k)) => Some(redis::ClientTlsConfig {
            client_cert: read("redis.tls_cert_file", c)?,
            client_key: read("redis.tls_key_file", k)?,
        }),
        _ => None,
    };
    Ok(Some(redis::TlsCertificates { client_tls, root_cert }))
}

/// `host:port` as printed by `redis-cli --cluster` is accepted for a node.
fn with_scheme(url: &str) -> String {
    if url.contains("://") { url.to_string() } else { format!("redis://{url}") }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

/// Worth retrying later: anything but an error the same command will hit
/// again whatever the server's state ([`is_content_error`]). A server down,
/// restarting, loading, failing over, out of memory (`OOM`), unable to
/// persist (`MISCONF`, a full disk), short of replicas (`NOREPLICAS`), or
/// refusing a user the operator has not granted enough yet (`NOPERM`) will
/// take the same command once it has room again: for a caller that must
/// lose nothing, these are backpressure, never a reason to set data aside.
pub fn is_transient(e: &RedisError) -> bool {
    !is_content_error(e)
}

/// An error the same command hits again however long one waits: a reply
/// the client cannot read, a key of the wrong type, keys across slots, or a
/// plain `ERR` (a script error on this input, a value over a server limit)
/// that names no resource.
pub fn is_content_error(e: &RedisError) -> bool {
    use redis::ErrorKind as K;
    match e.kind() {
        K::Parse | K::UnexpectedReturnType | K::Client => true,
        K::Server(_) | K::Extension => match e.code() {
            Some("WRONGTYPE" | "CROSSSLOT") => true,
            Some("ERR") => !names_a_resource(e),
            _ => false,
        },
        _ => false,
    }
}

/// Whether `e` says the server is out of room (memory, disk, replicas):
/// only more room (or a lower load) ends it.
pub fn is_out_of_room(e: &RedisError) -> bool {
    matches!(e.code(), Some("OOM" | "MISCONF" | "NOREPLICAS")) || names_a_resource(e)
}

/// An error text that names a resource (a script's error keeps the code of
/// the command that failed inside it, but an `ERR` may still quote one).
fn names_a_resource(e: &RedisError) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    // A transaction's abort quotes each refused command's error (`"OOM": …`).
    ["\"oom\"", "oom ", "> 'maxmemory'", "misconf", "no space left", "out of memory", "noreplicas"]
        .iter()
        .any(|m| text.contains(m))
}

/// The Redis Cluster hash slot of `key`: CRC16 (XMODEM) of the key's hash tag
/// — the bytes between the first `{` and the next `}`, if not empty — or of
/// the whole key, modulo [`SLOTS`].
pub fn key_slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key)) % SLOTS
}

/// Groups `items` by the cluster slot of their key, in slot order, so that
/// each group can go in one pipeline or transaction: on a cluster a pipeline
/// whose keys span slots is refused as a whole (`CROSSSLOT`), even when each
/// command in it touches one key. Items keep their relative order.
pub fn group_by_slot<T>(
    items: impl IntoIterator<Item = T>,
    key: impl Fn(&T) -> &[u8],
) -> std::collections::BTreeMap<u16, Vec<T>> {
    let mut groups: std::collections::BTreeMap<u16, Vec<T>> = Default::default();
    for item in items {
        groups.entry(key_slot(key(&item))).or_default().push(item);
    }
    groups
}

/// The part of `key` that decides its slot.
pub fn hash_tag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{')
        && let Some(len) = key[open + 1..].iter().position(|&b| b == b'}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

/// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), as Redis
/// Cluster specifies it.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn slots_match_redis_cluster_keyslot() {
        // Values from `redis-cli CLUSTER KEYSLOT <key>` on Redis 7.
        for (key, slot) in [
            ("foo", 12182),
            ("123456789", 12739),
            ("{user1000}.following", 3443),
            ("{}a", 10875),
            ("a{}{b}", 15033),
            ("{ss:p0}:seq", 5779),
        ] {
            assert_eq!(key_slot(key.as_bytes()), slot, "{key}");
        }
    }

    #[test]
    fn hash_tag_is_the_first_non_empty_braced_part() {
        assert_eq!(hash_tag(b"{ns:p3}:r:7:42"), b"ns:p3");
        assert_eq!(hash_tag(b"x{a}{b}"), b"a");
        assert_eq!(hash_tag(b"{}x{a}"), b"{}x{a}");
        assert_eq!(hash_tag(b"no tag"), b"no tag");
        assert_eq!(hash_tag(b"{unclosed"), b"{unclosed");
    }

    #[test]
    fn grouping_by_slot_keeps_tags_together_and_order_within() {
        let keys = ["{a}1", "{b}1", "{a}2", "{b}2", "{a}3"];
        let groups = group_by_slot(keys, |k| k.as_bytes());
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[&key_slot(b"{a}")], ["{a}1", "{a}2", "{a}3"]);
        assert_eq!(groups[&key_slot(b"{b}")], ["{b}1", "{b}2"]);
    }

    #[test]
    fn node_addresses_get_a_scheme() {
        assert_eq!(with_scheme("127.0.0.1:7000"), "redis://127.0.0.1:7000");
        assert_eq!(with_scheme("rediss://h:1"), "rediss://h:1");
    }

    fn settings(url: String, cluster: bool) -> RedisSettings {
        RedisSettings { url, cluster, ..RedisSettings::default() }
    }

    #[tokio::test]
    async fn a_single_server_serves_and_a_lost_one_is_transient() {
        let mut server = shelfsync_testkit::RedisServer::start().await.expect("redis");
        let mut conn = RedisConn::connect(&settings(server.url(), false)).await.expect("connect");
        assert!(!conn.is_cluster());
        let _: () = redis::cmd("SET").arg("k").arg("v").query_async(&mut conn).await.expect("set");
        server.kill();
        let err =
            redis::cmd("GET").arg("k").query_async::<String>(&mut conn).await.expect_err("down");
        assert!(is_transient(&err), "{err}");
    }

    /// A full Redis (`maxmemory` reached, `noeviction`, as deployments ship
    /// it) refuses writes — plain, in a script, in a transaction — with
    /// errors that are backpressure, never content; a wrong type is content.
    #[tokio::test]
    async fn a_full_redis_is_backpressure_and_a_wrong_type_is_content() {
        let server =
            shelfsync_testkit::RedisServer::start_with_args(&["--maxmemory-policy", "noeviction"])
                .await
                .expect("redis");
        let mut conn = RedisConn::connect(&settings(server.url(), false)).await.expect("connect");
        let _: () = redis::cmd("SET").arg("s").arg("v").query_async(&mut conn).await.expect("set");
        let err = redis::cmd("LPUSH").arg("s").arg(1).query_async::<()>(&mut conn).await;
        let err = err.expect_err("wrong type");
        assert!(is_content_error(&err) && !is_transient(&err), "{err}");
        let err = redis::cmd("EVAL")
            .arg("return redis.call('NOPE')")
            .arg(0)
            .query_async::<()>(&mut conn)
            .await
            .expect_err("script error");
        assert!(is_content_error(&err), "{err}");
        // Full: maxmemory below what is used.
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(1)
            .query_async(&mut conn)
            .await
            .expect("config");
        let plain = redis::cmd("SET").arg("k").arg("v").query_async::<()>(&mut conn).await;
        let script = redis::cmd("EVAL")
            .arg("return redis.call('SET', KEYS[1], 'v')")
            .arg(1)
            .arg("k")
            .query_async::<()>(&mut conn)
            .await;
        let multi = redis::pipe()
            .atomic()
            .cmd("XADD")
            .arg("{t}:s")
            .arg("*")
            .arg("e")
            .arg("v")
            .cmd("SET")
            .arg("{t}:k")
            .arg("v")
            .query_async::<()>(&mut conn)
            .await;
        for (what, result) in [("plain", plain), ("script", script), ("multi", multi)] {
            let err = result.expect_err(what);
            assert!(is_transient(&err) && !is_content_error(&err), "{what}: {err}");
            assert!(is_out_of_room(&err), "{what}: {err}");
        }
    }

    #[tokio::test]
    async fn a_cluster_routes_by_slot_and_refuses_steps_across_slots() {
        let cluster = shelfsync_testkit::RedisCluster::start(3).await.expect("cluster");
        // Bare host:port seeds, as `redis-cli --cluster` prints them.
        let seeds =
            cluster.node_urls().iter().map(|u| u.replace("redis://", "")).collect::<Vec<_>>();
        let mut conn = RedisConn::connect(&settings(seeds.join(","), true)).await.expect("connect");
        assert!(conn.is_cluster());
        // Keys on many slots, hence on every master, each routed to its own.
        for i in 0..30 {
            let _: () = redis::cmd("SET")
                .arg(format!("k{i}"))
                .arg(i)
                .query_async(&mut conn)
                .await
                .expect("set");
        }
        let v: i64 = redis::cmd("GET").arg("k17").query_async(&mut conn).await.expect("get");
        assert_eq!(v, 17);
        // One tag, one slot: a transaction over several keys is fine.
        let (a, b): (i64, i64) = redis::pipe()
            .atomic()
            .incr("{p1}:a", 1)
            .incr("{p1}:b", 2)
            .query_async(&mut conn)
            .await
            .expect("single-slot transaction");
        assert_eq!((a, b), (1, 2));
        // Two tags: refused, and not worth retrying.
        let err = redis::pipe()
            .incr("{p1}:a", 1)
            .incr("{p2}:a", 1)
            .query_async::<()>(&mut conn)
            .await
            .expect_err("cross-slot pipeline");
        assert!(!is_transient(&err), "{err}");
        assert_ne!(key_slot(b"{p1}:a"), key_slot(b"{p2}:a"));
    }

    proptest! {
        #[test]
        fn keys_sharing_a_tag_share_a_slot(tag in "[a-z0-9:]{1,12}", a in ".*", b in ".*") {
            let ka = format!("{{{tag}}}{a}");
            let kb = format!("{{{tag}}}:{b}");
            prop_assert_eq!(key_slot(ka.as_bytes()), key_slot(kb.as_bytes()));
            prop_assert!(key_slot(ka.as_bytes()) < SLOTS);
        }
    }
}

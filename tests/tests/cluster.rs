//! Scale-out against real clusters on loopback: a 3-master Redis Cluster
//! (`redis-cli --cluster create`) and a 3-node NATS cluster with R3 JetStream
//! streams (docs/DESIGN.md, "Redis layout" and "Ordering and the commit").
//!
//! - storage on Redis Cluster: many places of one partition in one batch stay
//!   on one slot (no CROSSSLOT), and every read path works;
//! - two storage replicas (real binaries) splitting the partitions ride
//!   through losing the CMD stream's leader node and one replica, with
//!   nothing lost and nothing duplicated;
//! - owners that overlap (a twin, a stale split) are fenced by the applied
//!   sequence and cannot corrupt state or duplicate changes.
//!
//! The `#[ignore]`d bench at the end times 1 vs 2 storage replicas
//! (docs/SCALING.md).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::message::PublishMessage;
use prost::Message;
use shelfsync_bus::{Partition, partition_of};
use shelfsync_feed::{Bootstrap, ChangeFeed, FeedConfig, Handler, HandlerError, Update};
use shelfsync_proto::{
    ChangeKind, Command, CommandBatch, CommandKind, Origin, Record, RecordKey, msg_type,
};
use shelfsync_settings::Settings;
use shelfsync_storage::client::Store;
use shelfsync_storage::client::{Commit, Keys};
use shelfsync_testkit::{NatsCluster, NatsServer, RedisCluster, unique_name};
use shelfsync_tests::*;

const BRAND: i64 = 7;

type Key = (i64, i64, String);

/// Settings of one test on the given servers, Redis in cluster mode.
fn cluster_settings(nats_url: String, redis: &RedisCluster) -> Settings {
    let prefix = unique_name();
    let mut s = Settings::default();
    s.nats.url = nats_url;
    s.nats.prefix = prefix.clone();
    s.nats.request_timeout = Duration::from_secs(5);
    s.redis.url = redis.urls();
    s.redis.cluster = true;
    s.redis.namespace = prefix;
    s.storage.partitions = 8;
    s.storage.retry_delay = Duration::from_millis(100);
    s.storage.ack_wait = Duration::from_secs(2);
    s.storage.http_listen = "127.0.0.1:0".into();
    s.ingest.listen = "127.0.0.1:0".into();
    s.validate().expect("valid test settings");
    s
}

/// What `settings_env` leaves out and a clustered storage replica needs.
fn replica_env(s: &Settings, replica: u32) -> Vec<(String, String)> {
    vec![
        ("SHELFSYNC__REDIS__CLUSTER".into(), s.redis.cluster.to_string()),
        ("SHELFSYNC__NATS__STREAM_REPLICAS".into(), s.nats.stream_replicas.to_string()),
        ("SHELFSYNC__STORAGE__REPLICAS".into(), s.storage.replicas.to_string()),
        ("SHELFSYNC__STORAGE__REPLICA".into(), replica.to_string()),
    ]
}

fn start_replica(s: &Settings, replica: u32) -> StorageProcess {
    let env = replica_env(s, replica);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    StorageProcess::start(s, &env).expect("storage replica starts")
}

/// A storage replica run as an orchestrator runs it: started again when it
/// exits on its own. On a loaded 2-core machine, creating dozens of R3
/// consumers at start-up can time out, and storage then exits (a pod would
/// be restarted); a kill by the test is not an exit on its own.
struct Supervised {
    settings: Settings,
    ordinal: u32,
    process: StorageProcess,
    restarts: u32,
}

impl Supervised {
    fn start(settings: &Settings, ordinal: u32) -> Supervised {
        let process = start_replica(settings, ordinal);
        Supervised { settings: settings.clone(), ordinal, process, restarts: 0 }
    }

    fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// Restarts the process if it exited.
    fn supervise(&mut self) {
        if let Ok(Some(status)) = self.process.child.try_wait() {
            eprintln!("storage replica {} exited ({status}); restarting it", self.ordinal);
            self.process = start_replica(&self.settings, self.ordinal);
            self.restarts += 1;
        }
    }
}

/// Polls `cond` until it holds, restarting replicas that exit meanwhile;
/// on timeout, panics with the partitions still holding work.
async fn wait_supervised<F, Fut>(
    h: &Harness,
    replicas: &mut [&mut Supervised],
    timeout: Duration,
    what: &str,
    cond: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        for r in replicas.iter_mut() {
            r.supervise();
        }
        if cond().await {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}; {}", stuck_partitions(h).await);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// True once every partition has its owner's storage consumer.
async fn consumers_bound(h: &Harness) -> bool {
    for p in 0..h.settings.storage.partitions {
        if h.storage_consumers(Partition(p)).await.is_empty() {
            return false;
        }
    }
    true
}

/// `n` place ids of `BRAND` that fall in `partition`.
fn places_in(partition: u32, partitions: u32, n: usize) -> Vec<i64> {
    (1..).filter(|&p| partition_of(BRAND, p, partitions).0 == partition).take(n).collect()
}

fn sku(i: usize) -> String {
    format!("sku-{i:03}")
}

fn delete(place: i64, id: &str) -> Command {
    Command {
        key: Some(RecordKey::new(BRAND, place, id)),
        kind: CommandKind::Delete as i32,
        origin: Some(Origin { source: "test".into(), ..Default::default() }),
        ..Default::default()
    }
}

/// The import with churn of the replica and fencing tests, round by round:
/// 1 creates every item, 2 reprices every 10th, 3 every 7th, 4 re-sends
/// round 3 unchanged and deletes every 50th.
/// `pad` bytes of description make records (and the work per batch) larger.
fn round_commands(round: usize, place: i64, items: usize, pad: usize) -> Vec<Command> {
    (0..items)
        .map(|i| {
            if round == 4 && i.is_multiple_of(50) {
                delete(place, &sku(i))
            } else {
                let mut item = product("t", price_after(round.min(3), i), 1);
                if pad > 0 {
                    item.description = Some("d".repeat(pad));
                }
                patch(BRAND, place, &sku(i), &item, 0)
            }
        })
        .collect()
}

fn price_after(round: usize, i: usize) -> i64 {
    match round {
        _ if round >= 3 && i.is_multiple_of(7) => 3_000 + i as i64,
        _ if round >= 2 && i.is_multiple_of(10) => 2_000 + i as i64,
        _ => 1_000 + i as i64,
    }
}

/// Real transitions of an item over the four rounds, applied serially.
fn expected_changes(i: usize) -> usize {
    1 + usize::from(i.is_multiple_of(10))
        + usize::from(i.is_multiple_of(7))
        + usize::from(i.is_multiple_of(50))
}

/// Publishes one command batch and waits for its JetStream ack, retrying
/// with the same `Nats-Msg-Id` while the cluster elects a new leader (a
/// retry of a stored message is dropped as a duplicate). Callers publish one
/// message at a time, so a partition's order is kept.
async fn publish_acked(h: &Harness, p: Partition, batch: &CommandBatch, msg_id: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let msg = PublishMessage::build()
            .payload(batch.encode_to_vec().into())
            .message_id(msg_id)
            .header(shelfsync_bus::TYPE_HEADER, msg_type::COMMAND_BATCH);
        let sent = match h.js.send_publish(h.subjects.cmd(p), msg).await {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match sent {
            Ok(()) => return,
            Err(e) if Instant::now() < deadline => {
                eprintln!("publish {msg_id} attempt {attempt} failed ({e}); retrying");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => panic!("publish {msg_id} never acked: {e}"),
        }
    }
}

/// Publishes one round for every place, `chunk` commands per message.
async fn publish_round(h: &Harness, round: usize, places: &[i64], items: usize, chunk: usize) {
    publish_padded_round(h, round, places, items, chunk, 0).await;
}

async fn publish_padded_round(
    h: &Harness,
    round: usize,
    places: &[i64],
    items: usize,
    chunk: usize,
    pad: usize,
) {
    for &place in places {
        let p = h.partition(BRAND, place);
        for (c, cmds) in round_commands(round, place, items, pad).chunks(chunk).enumerate() {
            let batch =
                CommandBatch { partition: p.0, commands: cmds.to_vec(), ..Default::default() };
            publish_acked(h, p, &batch, &format!("r{round}:{place}:{c}")).await;
        }
    }
}

/// A live consumer: mirrors storage through the ChangeFeed kit.
#[derive(Clone, Default)]
struct Mirror {
    records: Arc<Mutex<HashMap<Key, Record>>>,
}

impl Handler for Mirror {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        let mut m = self.records.lock().expect("lock");
        for u in updates {
            m.insert((u.key.brand_id, u.key.place_id, u.key.product_id.clone()), u.after.clone());
        }
        Ok(())
    }

    async fn reset_place(&mut self, place: shelfsync_feed::PlaceKey) -> Result<(), HandlerError> {
        let shelfsync_feed::PlaceKey { brand_id, place_id } = place;
        self.records.lock().expect("lock").retain(|(b, p, _), _| (*b, *p) != (brand_id, place_id));
        Ok(())
    }
}

fn same_records(a: &HashMap<Key, Record>, b: &HashMap<Key, Record>) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{} records vs {}", a.len(), b.len()));
    }
    for (k, want) in b {
        let Some(have) = a.get(k) else { return Err(format!("missing {k:?}")) };
        if (have.updated_at, &have.data, have.deleted, have.absent)
            != (want.updated_at, &want.data, want.deleted, want.absent)
        {
            return Err(format!("{k:?} differs"));
        }
    }
    Ok(())
}

/// Every change on the CHANGES stream. Right after a node was lost, a
/// JetStream API request (stream info, consumer create) can time out while
/// the stream's leader moves: such a read is tried again, a few times.
async fn changes_after_failover(h: &Harness) -> Vec<shelfsync_proto::Change> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match h.changes().await {
            Ok(changes) => return changes,
            Err(e) if attempt < 4 => {
                eprintln!("reading the CHANGES stream (attempt {attempt}): {e:#}; again");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => panic!("changes: {e:#}"),
        }
    }
}

/// The nothing-lost / nothing-duplicated checks of the crash suite, for the
/// four-round import: exactly the serial transitions per key, the serial
/// final state in Redis, and a replica rebuilt from the change stream equal
/// to storage.
async fn assert_serial_outcome(h: &Harness, places: &[i64], items: usize) {
    let changes = changes_after_failover(h).await;
    let total: usize = (0..items).map(expected_changes).sum::<usize>() * places.len();
    let counts = count_by_key(&changes);
    for &place in places {
        for i in 0..items {
            let n = counts.get(&(BRAND, place, sku(i))).copied().unwrap_or(0);
            assert_eq!(n, expected_changes(i), "changes of {place}/{}", sku(i));
        }
    }
    assert_eq!(changes.len(), total, "a change was lost or duplicated");
    assert!(h.rejections().await.expect("rejections").is_empty(), "nothing may be dead-lettered");

    let mut from_stream: HashMap<Key, Record> = HashMap::new();
    for c in &changes {
        let after = c.after.clone().expect("after");
        let k = c.key.clone().expect("key");
        let key = (k.brand_id, k.place_id, k.product_id);
        if c.kind == ChangeKind::Updated as i32 {
            assert!(c.before.is_some(), "an update carries its before");
        }
        if from_stream.get(&key).is_none_or(|r| r.updated_at < after.updated_at) {
            from_stream.insert(key, after);
        }
    }
    let stored = h.records_of(BRAND, places).await.expect("scan");
    for &place in places {
        for i in 0..items {
            let r = &stored[&(BRAND, place, sku(i))];
            if i.is_multiple_of(50) {
                assert!(r.deleted, "{place}/{} must be a tombstone", sku(i));
            } else {
                assert!(!r.deleted, "{place}/{}", sku(i));
                assert_eq!(decode_product(&r.data).price, Some(price_after(3, i)));
            }
        }
    }
    same_records(&from_stream, &stored).expect("replica from the change stream equals storage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_on_redis_cluster_keeps_each_batch_on_one_slot() {
    let (redis, nats) =
        tokio::try_join!(RedisCluster::start(3), NatsServer::start()).expect("servers");
    let mut settings = cluster_settings(nats.url(), &redis);
    settings.storage.partitions = 16;
    let parts = settings.storage.partitions;
    let h = Harness::connect(settings.clone()).await.expect("harness");
    assert!(h.store.conn().is_cluster());
    let _storage = InProcessStorage::start(settings.clone()).await.expect("storage");

    // One batch: 20 places of partition 3, 50 items each (1000 commands),
    // plus one item in a place of every other partition to spread keys.
    let places = places_in(3, parts, 20);
    let g1 = now_us();
    let mut cmds = Vec::new();
    for &place in &places {
        for i in 0..50 {
            cmds.push(patch(BRAND, place, &sku(i), &product("t", 1_000 + i as i64, 1), g1));
        }
    }
    let others: Vec<i64> =
        (0..parts).filter(|&p| p != 3).map(|p| places_in(p, parts, 1)[0]).collect();
    for &place in &others {
        cmds.push(patch(BRAND, place, &sku(0), &product("t", 1, 1), g1));
    }
    h.send(cmds).await.expect("send");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 1000 + others.len());

    // A full re-import of the first ten places without item 49, swept; the
    // other ten lose item 0 by DELETE. Sweeps read whole generation columns.
    let g2 = g1 + 1_000_000;
    let mut cmds = Vec::new();
    for &place in &places[..10] {
        for i in 0..49 {
            cmds.push(patch(BRAND, place, &sku(i), &product("t", 1_000 + i as i64, 1), g2));
        }
    }
    for &place in &places[10..] {
        cmds.push(delete(place, &sku(0)));
    }
    h.send(cmds).await.expect("send");
    for &place in &places[..10] {
        h.send_sweep(BRAND, place, g2).await.expect("sweep");
    }
    h.wait_settled().await;
    let changes = h.changes().await.expect("changes");
    let new = &changes[1000 + others.len()..];
    assert_eq!(new.len(), 20, "10 swept + 10 deleted");
    assert_eq!(new.iter().filter(|c| c.kind == ChangeKind::Deleted as i32).count(), 10);

    // Point, place and page reads all run on the partition's slot.
    let r = h.get(BRAND, places[0], &sku(7)).await.expect("get").expect("exists");
    // Carried unchanged by g2: its generation stays the last import that wrote it.
    assert_eq!((decode_product(&r.data).price, r.generation), (Some(1_007), g1));
    assert!(h.get(BRAND, places[0], &sku(49)).await.expect("get").expect("exists").absent);
    assert!(h.get(BRAND, places[15], &sku(0)).await.expect("get").expect("exists").deleted);
    let all = h.store.place_records(parts, (BRAND, places[0]).into()).await.expect("place");
    assert_eq!(all.len(), 50);
    let (mut paged, mut cursor) = (Vec::new(), String::new());
    loop {
        let (page, next) =
            h.store.page(parts, (BRAND, places[0]).into(), &cursor, 7).await.expect("page");
        assert!(page.len() <= 7, "a page of {} records at limit 7", page.len());
        paged.extend(page.into_iter().map(|r| r.key.expect("key").product_id));
        match next {
            Some(n) => cursor = n,
            None => break,
        }
    }
    // Pages are in no global order; nothing is written while paging, so
    // every record comes exactly once.
    paged.sort();
    let mut expected: Vec<String> = (0..50).map(sku).collect();
    expected.sort();
    assert_eq!(paged, expected, "every record of the place, each once");

    // Every key of the namespace sits in its partition's slot, and the
    // partitions spread over the masters.
    let ns = &settings.redis.namespace;
    let mut masters_with_keys = 0;
    for url in redis.node_urls() {
        let mut node = redis::Client::open(url.as_str())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("node");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{{{ns}:p*"))
            .query_async(&mut node)
            .await
            .expect("keys");
        for k in &keys {
            let tag = shelfsync_redis::hash_tag(k.as_bytes());
            let p: u32 = std::str::from_utf8(tag)
                .ok()
                .and_then(|t| t.rsplit_once(":p"))
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or_else(|| panic!("key {k} has no partition tag"));
            assert_eq!(
                shelfsync_redis::key_slot(k.as_bytes()),
                shelfsync_redis::key_slot(Keys::new(ns, Partition(p)).seq().as_bytes()),
                "{k}"
            );
        }
        masters_with_keys += usize::from(!keys.is_empty());
    }
    assert!(masters_with_keys >= 2, "16 partitions all on one master of 3");

    // The check above could fail: a step across two tags is refused.
    let mut conn = h.store.conn();
    let crossed: Result<(), _> =
        redis::pipe().set("{a}1", 1).set("{b}2", 1).query_async(&mut conn).await;
    assert!(crossed.is_err(), "a pipeline across slots must fail on a cluster");
    let crossed: Result<(), _> = redis::cmd("EVAL")
        .arg("redis.call('SET', KEYS[1], 1) redis.call('SET', KEYS[2], 1)")
        .arg(2)
        .arg("{a}1")
        .arg("{b}2")
        .query_async(&mut conn)
        .await;
    let err = crossed.expect_err("a script across slots must fail");
    assert!(err.to_string().to_uppercase().contains("CROSSSLOT"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_ride_through_losing_a_nats_node_and_a_replica() {
    const ITEMS: usize = 100;
    let started = Instant::now();
    let (redis, mut nats) =
        tokio::try_join!(RedisCluster::start(3), NatsCluster::start(3)).expect("clusters");
    let mut settings = cluster_settings(nats.urls(), &redis);
    settings.storage.replicas = 2;
    let parts = settings.storage.partitions;
    // Streams created R1 are raised to R3 in place by provisioning again.
    let h = Harness::connect(settings.clone()).await.expect("harness");
    settings.nats.stream_replicas = 3;
    shelfsync_bus::provision(&h.js, &settings.nats, settings.topology())
        .await
        .expect("provision R3");

    let mut cmd_stream = h.js.get_stream(h.subjects.cmd_stream()).await.expect("stream");
    assert_eq!(cmd_stream.info().await.expect("info").config.num_replicas, 3);
    eventually(Duration::from_secs(30), "the CMD stream to have 2 current followers", || async {
        let Ok(mut s) = h.js.get_stream(h.subjects.cmd_stream()).await else { return false };
        let Ok(info) = s.info().await else { return false };
        info.cluster
            .as_ref()
            .is_some_and(|c| c.replicas.len() == 2 && c.replicas.iter().all(|r| r.current))
    })
    .await;

    let mut storage0 = Supervised::start(&settings, 0);
    let mut storage1 = Supervised::start(&settings, 1);
    // Each replica binds the durable consumers of its own partitions.
    wait_supervised(
        &h,
        &mut [&mut storage0, &mut storage1],
        Duration::from_secs(60),
        "every partition to have its consumer",
        || consumers_bound(&h),
    )
    .await;

    // A live consumer riding the same failures.
    let mirror = Mirror::default();
    let mut feed = ChangeFeed::new(
        h.client.clone(),
        &settings.nats,
        FeedConfig { bootstrap: Bootstrap::Resume, ..FeedConfig::new("cluster-mirror") },
    );
    let feed_status = feed.status();
    let (stop_feed, feed_stop) = tokio::sync::oneshot::channel::<()>();
    let mut handler = mirror.clone();
    let feed_task = tokio::spawn(async move {
        feed.run(&mut handler, async move {
            let _ = feed_stop.await;
        })
        .await
    });
    eventually(Duration::from_secs(10), "the mirror's consumer", || async {
        feed_status.bootstrapped.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;

    // Two places per partition, so both replicas have work.
    let places: Vec<i64> = (0..parts).flat_map(|p| places_in(p, parts, 2)).collect();
    publish_round(&h, 1, &places, ITEMS, 50).await;

    // Lose the node leading the command stream: publishes and pulls move on
    // to a new leader elected by the two others.
    let leader =
        cmd_stream.info().await.expect("info").cluster.as_ref().and_then(|c| c.leader.clone());
    let lost = leader.as_deref().and_then(|l| nats.index_of(l)).expect("leader is a node");
    nats.kill(lost);
    eprintln!("[{:?}] killed NATS node {lost} (CMD stream leader)", started.elapsed());
    publish_round(&h, 2, &places, ITEMS, 50).await;

    // Lose storage replica 1 mid-way; its partitions wait for it.
    storage1.process.kill();
    eprintln!("[{:?}] killed storage replica 1", started.elapsed());
    publish_round(&h, 3, &places, ITEMS, 50).await;
    let pending = |p: u32| {
        let h = &h;
        async move {
            let stream = h.js.get_stream(h.subjects.cmd_stream()).await.ok()?;
            let mut pending = None;
            for name in h.storage_consumers(Partition(p)).await {
                let c = stream.consumer_info(&name).await.ok()?;
                pending = Some(pending.unwrap_or(0) + c.num_pending + c.num_ack_pending as u64);
            }
            pending
        }
    };
    wait_supervised(
        &h,
        &mut [&mut storage0],
        Duration::from_secs(60),
        "replica 0 to finish its partitions",
        || async {
            for p in (0..parts).filter(|p| p % 2 == 0) {
                if pending(p).await != Some(0) {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let waiting = std::cell::Cell::new(None);
    eventually(Duration::from_secs(30), "replica 1's consumers to answer", || async {
        let mut sum = 0;
        for p in (0..parts).filter(|p| p % 2 == 1) {
            let Some(n) = pending(p).await else { return false };
            sum += n;
        }
        waiting.set(Some(sum));
        true
    })
    .await;
    let waiting = waiting.get().unwrap_or_default();
    assert!(waiting > 0, "replica 0 must not take replica 1's partitions");
    eprintln!("[{:?}] replica 0 done; {waiting} messages wait for replica 1", started.elapsed());

    // Its successor (same ordinal) takes the partitions back.
    let mut storage1 = Supervised::start(&settings, 1);
    publish_round(&h, 4, &places, ITEMS, 50).await;
    wait_supervised(
        &h,
        &mut [&mut storage0, &mut storage1],
        Duration::from_secs(60),
        "both replicas to apply everything",
        || h.settled(),
    )
    .await;
    eprintln!("[{:?}] settled", started.elapsed());

    assert_serial_outcome(&h, &places, ITEMS).await;
    let stored = h.records_of(BRAND, &places).await.expect("scan");
    eventually(Duration::from_secs(60), "the live mirror to equal storage", || async {
        same_records(&mirror.records.lock().expect("lock"), &stored).is_ok()
    })
    .await;
    let _ = stop_feed.send(());
    feed_task.await.expect("feed task").expect("feed ran");
    eprintln!(
        "[{:?}] done; restarts after exiting on their own: {}",
        started.elapsed(),
        storage0.restarts + storage1.restarts
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_owners_are_fenced_and_duplicate_nothing() {
    // One message per place and round: 1000 commands of ~600 bytes, so a
    // batch takes longer than the ack wait below.
    const ITEMS: usize = 1000;
    let (redis, nats) =
        tokio::try_join!(RedisCluster::start(3), NatsServer::start()).expect("servers");
    let mut settings = cluster_settings(nats.url(), &redis);
    settings.storage.partitions = 4;
    // Redelivery to another owner while the first one is mid-batch.
    settings.storage.ack_wait = Duration::from_millis(50);

    // The store-level guarantees, on a namespace of their own: a commit on a
    // stale sequence writes nothing, and a stale relay trims only what it
    // published.
    let mut fence_cfg = settings.redis.clone();
    fence_cfg.namespace = format!("{}-fence", settings.redis.namespace);
    let (a, b) =
        (Store::connect(&fence_cfg).await.unwrap(), Store::connect(&fence_cfg).await.unwrap());
    const P0: Partition = Partition(0);
    let commit = |store, from: u64, to: u64| commit_outbox(store, P0, from, to, 2);
    assert_eq!(commit(&a, 0, 5).await, Commit::Done);
    assert_eq!(commit(&b, 0, 6).await, Commit::Fenced);
    assert_eq!((a.applied_seq(P0).await.unwrap(), a.outbox_len(P0).await.unwrap()), (5, 2));
    assert_eq!(a.outbox_peek(P0, 256).await.unwrap().len(), 2);
    assert_eq!(b.outbox_peek(P0, 256).await.unwrap().len(), 2);
    b.outbox_trim(P0, 2).await.unwrap();
    assert_eq!(commit(&b, 5, 7).await, Commit::Done);
    a.outbox_trim(P0, 2).await.unwrap(); // stale: its two entries are gone already
    let left: Vec<String> =
        a.outbox_peek(P0, 256).await.unwrap().into_iter().map(|e| e.msg_id).collect();
    assert_eq!(left, ["chg:0:7:0", "chg:0:7:1"], "a stale trim must not drop unpublished entries");

    // Three processes at once: two think they own every partition, one runs
    // a stale split (2 replicas, ordinal 1). They share each partition's
    // durable consumer (max_ack_pending 1) and the sequence fence.
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let mut stale = settings.clone();
    stale.storage.replicas = 2;
    stale.storage.replica = 1;
    let owners = [
        InProcessStorage::start(settings.clone()).await.expect("twin a"),
        InProcessStorage::start(settings.clone()).await.expect("twin b"),
        InProcessStorage::start(stale).await.expect("stale split"),
    ];
    let places: Vec<i64> = (0..4).flat_map(|p| places_in(p, 4, 1)).collect();
    for round in 1..=4 {
        publish_padded_round(&h, round, &places, ITEMS, ITEMS, 500).await;
    }
    eventually(Duration::from_secs(60), "the owners to apply everything", || async {
        h.settled().await
    })
    .await;
    assert_serial_outcome(&h, &places, ITEMS).await;

    let count = |f: fn(&shelfsync_storage::Stats) -> &std::sync::atomic::AtomicU64| {
        owners.iter().map(|o| shelfsync_storage::Stats::get(f(&o.stats))).collect::<Vec<_>>()
    };
    let (batches, skipped, fenced) =
        (count(|s| &s.batches), count(|s| &s.batches_skipped), count(|s| &s.fenced));
    eprintln!("applied {batches:?}, skipped as already applied {skipped:?}, fenced {fenced:?}");
    assert_eq!(batches.iter().sum::<u64>(), 16, "each command message applied exactly once");
    assert!(
        skipped.iter().chain(&fenced).sum::<u64>() > 0,
        "the owners never overlapped: the test proved nothing"
    );
}

/// Servers of one bench run, held until it ends (dropping them kills them).
type KeepAlive = Box<dyn std::any::Any>;

/// The servers of a bench run, its settings, and the pids of its Redis and
/// NATS servers.
async fn bench_servers(clustered: bool) -> (KeepAlive, Settings, Vec<u32>, Vec<u32>) {
    if clustered {
        let (r, n) =
            tokio::try_join!(RedisCluster::start(3), NatsCluster::start(3)).expect("clusters");
        let mut settings = cluster_settings(n.urls(), &r);
        settings.nats.stream_replicas = 3;
        let redis_pids = (0..r.len()).filter_map(|i| r.node(i).pid()).collect();
        let nats_pids = (0..n.len()).filter_map(|i| n.node(i).pid()).collect();
        (Box::new((r, n)), settings, redis_pids, nats_pids)
    } else {
        let env = shelfsync_testkit::TestEnv::start().await.expect("servers");
        let settings = settings_for(&env);
        let (redis_pids, nats_pids) =
            (env.redis.pid().into_iter().collect(), env.nats.pid().into_iter().collect());
        (Box::new(env), settings, redis_pids, nats_pids)
    }
}

/// Queues `records` records (100 per place, 1000 per message) over the
/// partitions; returns the number of messages.
async fn queue_import(h: &Harness, records: usize) -> u64 {
    let mut publisher = shelfsync_bus::Publisher::new(h.js.clone(), 256);
    let mut open: HashMap<Partition, CommandBatch> = HashMap::new();
    let mut full = Vec::new();
    for place in 1..=(records / 100) as i64 {
        let p = h.partition(BRAND, place);
        let b =
            open.entry(p).or_insert_with(|| CommandBatch { partition: p.0, ..Default::default() });
        for i in 0..100 {
            b.commands.push(patch(BRAND, place, &sku(i), &product("t", 1_000 + i as i64, 1), 0));
        }
        if b.commands.len() >= 1000 {
            full.push((p, std::mem::take(&mut b.commands)));
        }
    }
    full.extend(open.into_iter().map(|(p, b)| (p, b.commands)).filter(|(_, c)| !c.is_empty()));
    let n = full.len() as u64;
    for (k, (p, commands)) in full.into_iter().enumerate() {
        let batch = CommandBatch { partition: p.0, commands, ..Default::default() };
        publisher
            .publish(
                h.subjects.cmd(p),
                format!("bench:{k}"),
                msg_type::COMMAND_BATCH,
                None,
                batch.encode_to_vec().into(),
            )
            .await
            .expect("publish");
    }
    publisher.flush().await.expect("flush");
    n
}

/// CPU time of a process in seconds (Linux `/proc/<pid>/stat`, 100 ticks/s).
fn process_cpu(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Busy and total CPU time of the machine in seconds (`/proc/stat`).
fn machine_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let idle = ticks.get(3).copied().unwrap_or(0.0) + ticks.get(4).copied().unwrap_or(0.0);
    let total: f64 = ticks.iter().take(8).sum();
    ((total - idle) / 100.0, total / 100.0)
}

/// One timed run of the bench.
struct BenchRun {
    records_per_s: f64,
    /// Shares of the machine's busy CPU time: storage processes, Redis
    /// servers, NATS servers (the rest is this test and the machine's noise).
    storage: f64,
    redis: f64,
    nats: f64,
    /// This test process (publishing is over; it polls for the end).
    harness: f64,
    /// Busy share of all cores during the run.
    machine_busy: f64,
    /// Records per CPU-second of storage + Redis + NATS: what the work costs,
    /// whatever else the machine was doing.
    per_cpu_s: f64,
}

async fn bench_run(clustered: bool, replicas: u32, records: usize) -> BenchRun {
    let (_servers, mut settings, redis_pids, nats_pids) = bench_servers(clustered).await;
    settings.storage.partitions = 64;
    settings.storage.replicas = replicas;
    settings.storage.ack_wait = Duration::from_secs(30);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let messages = queue_import(&h, records).await;

    let mut storages: Vec<Supervised> =
        (0..replicas).map(|r| Supervised::start(&settings, r)).collect();
    let queued = || async {
        let mut s = h.js.get_stream(h.subjects.cmd_stream()).await.ok()?;
        Some(s.info().await.ok()?.state.messages)
    };
    // Timed from the first applied batch, so start-up is left out.
    let mut all: Vec<&mut Supervised> = storages.iter_mut().collect();
    wait_supervised(&h, &mut all, Duration::from_secs(120), "the first applied batch", || async {
        queued().await.is_some_and(|q| q < messages)
    })
    .await;
    let storage_pids: Vec<u32> = all.iter().map(|s| s.pid()).collect();
    let start = Instant::now();
    let left = queued().await.unwrap_or(messages);
    let cpu = |pids: &[u32]| pids.iter().map(|&p| process_cpu(p)).sum::<f64>();
    let me = [std::process::id()];
    let before = [cpu(&storage_pids), cpu(&redis_pids), cpu(&nats_pids), cpu(&me)];
    let (busy0, total0) = machine_cpu();
    wait_supervised(&h, &mut all, Duration::from_secs(300), "the import to be applied", || {
        h.settled()
    })
    .await;
    let took = start.elapsed();
    let restarts: u32 = all.iter().map(|s| s.restarts).sum();
    if restarts > 0 || all.iter().map(|s| s.pid()).collect::<Vec<_>>() != storage_pids {
        println!("(a storage replica was restarted: its CPU time is partly missing)");
    }
    let after = [cpu(&storage_pids), cpu(&redis_pids), cpu(&nats_pids), cpu(&me)];
    let (busy1, total1) = machine_cpu();
    let busy = (busy1 - busy0).max(0.01);
    let timed = records as f64 * left as f64 / messages as f64;
    let used: f64 = after.iter().zip(&before).take(3).map(|(a, b)| a - b).sum();
    BenchRun {
        records_per_s: timed / took.as_secs_f64(),
        per_cpu_s: timed / used.max(0.01),
        storage: (after[0] - before[0]) / busy,
        redis: (after[1] - before[1]) / busy,
        nats: (after[2] - before[2]) / busy,
        harness: (after[3] - before[3]) / busy,
        machine_busy: busy / (total1 - total0).max(0.01),
    }
}

/// Throughput of 1 vs 2 storage replicas (real binaries) on this machine,
/// on single servers and on the clusters: `BENCH_RECORDS` (default 1M) new
/// records queued in advance over 64 partitions, timed from the first
/// applied batch to the last; `BENCH_REPS` (default 3) alternating runs,
/// medians reported; `BENCH_SETUPS` (default `single,cluster`) picks the
/// setups. Run with `cargo build --release -p shelfsync-storage && cargo
/// test --release -p shelfsync-tests --test cluster -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "bench: prints figures, asserts nothing about speed"]
async fn bench_one_vs_two_storage_replicas() {
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|n| n.parse().ok()).unwrap_or(d);
    let (records, reps) = (env("BENCH_RECORDS", 1_000_000), env("BENCH_REPS", 3));
    let setups = std::env::var("BENCH_SETUPS").unwrap_or_else(|_| "single,cluster".into());
    for clustered in [false, true] {
        if !setups.split(',').any(|s| s.trim() == if clustered { "cluster" } else { "single" }) {
            continue;
        }
        let name = if clustered {
            "Redis Cluster x3 + NATS x3 (R3)"
        } else {
            "single Redis + single NATS"
        };
        let mut runs: HashMap<u32, Vec<BenchRun>> = HashMap::new();
        for rep in 0..reps {
            for replicas in [1u32, 2] {
                let run = bench_run(clustered, replicas, records).await;
                println!("run {rep} | {name:<32} | {replicas} replica(s) | {}", show(&run));
                runs.entry(replicas).or_default().push(run);
            }
        }
        for replicas in [1u32, 2] {
            // The run with the median rate, so that its CPU split belongs to it.
            let mut r: Vec<&BenchRun> = runs[&replicas].iter().collect();
            r.sort_by(|a, b| a.records_per_s.total_cmp(&b.records_per_s));
            let mid = r[r.len() / 2];
            println!("bench | {name:<32} | {replicas} replica(s) | median | {}", show(mid));
        }
    }
}

/// The partitions whose consumer still holds messages, for a stalled run.
async fn stuck_partitions(h: &Harness) -> String {
    let Ok(stream) = h.js.get_stream(h.subjects.cmd_stream()).await else {
        return "CMD stream unavailable".into();
    };
    let mut out = Vec::new();
    for p in 0..h.settings.storage.partitions {
        let names = h.storage_consumers(Partition(p)).await;
        if names.is_empty() {
            out.push(format!("p{p}: no consumer"));
        }
        for name in names {
            match stream.consumer_info(&name).await {
                Ok(c) if c.num_pending + c.num_ack_pending as u64 > 0 => out.push(format!(
                    "p{p}: pending {} ack_pending {} waiting {} redelivered {} leader {:?}",
                    c.num_pending,
                    c.num_ack_pending,
                    c.num_waiting,
                    c.num_redelivered,
                    c.cluster.as_ref().and_then(|c| c.leader.clone())
                )),
                Ok(_) => {}
                Err(e) => out.push(format!("p{p}: {e}")),
            }
        }
        if let Ok(n) = h.store.outbox_len(Partition(p)).await
            && n > 0
        {
            out.push(format!("p{p}: outbox {n}"));
        }
    }
    out.join("; ")
}

fn show(r: &BenchRun) -> String {
    let other = (1.0 - r.storage - r.redis - r.nats - r.harness).max(0.0);
    format!(
        "{:>7.0} records/s | {:>6.0} records/CPU-s | busy CPU: storage {:>2.0}%, redis {:>2.0}%, \
         nats {:>2.0}%, harness {:>2.0}%, other {:>2.0}% | machine {:>3.0}% busy",
        r.records_per_s,
        r.per_cpu_s,
        r.storage * 100.0,
        r.redis * 100.0,
        r.nats * 100.0,
        r.harness * 100.0,
        other * 100.0,
        r.machine_busy * 100.0
    )
}

/// The aggregator keeps its state on the Redis Cluster too: every card and
/// every place under its own hash tag, batches spanning many slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregator_on_redis_cluster_computes_cards() {
    let (redis, nats) =
        tokio::try_join!(RedisCluster::start(3), NatsServer::start()).expect("servers");
    let mut settings = cluster_settings(nats.url(), &redis);
    settings.storage.keyframe_schedule = String::new();
    settings.aggregator.http_listen = "127.0.0.1:0".into();
    settings.aggregator.default_region = Some("all".into());
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let _storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    let app = shelfsync_aggregator::App::build(settings.clone()).await.expect("aggregator");
    let addr = app.http_addr();
    let _aggregator = spawn(app);
    // 40 products in 6 places: cards and category sets spread over slots.
    let mut cmds = Vec::new();
    for place in 1..=6i64 {
        for i in 0..40usize {
            cmds.push(patch(BRAND, place, &sku(i), &product("t", 100 * place + i as i64, 3), 0));
        }
    }
    h.send(cmds).await.expect("send");
    h.wait_settled().await;
    for i in [0usize, 17, 39] {
        let path = format!("/v1/cards/all/{}", sku(i));
        eventually(Duration::from_secs(30), "card computed on the cluster", || async {
            let Ok((200, body)) = http_get(addr, &path).await else { return false };
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            v["min_price"].as_i64() == Some(100 + i as i64) && v["offers"].as_u64() == Some(6)
        })
        .await;
    }
}

//! Fault scenarios 2, 3 and 4 (docs/RELIABILITY.md): the servers fail under
//! storage and a consumer, which must ride through without a manual step.
//!
//! - nats-server SIGKILLed mid-import and restarted on the same store
//!   directory: durable consumers resume, no gap, no duplicate change;
//! - redis-server (AOF, `appendfsync always`) SIGKILLed mid-import and
//!   restarted: no command storage acknowledged is lost;
//! - Redis away for a few seconds: storage naks with a growing delay (a
//!   handful of deliveries, never a burst that would dead-letter), recovers
//!   by itself and loses nothing; a partition is still applied in order.
//!
//! Each test holds storage to the serial model of the same commands and a
//! ChangeFeed mirror, running all along, to storage record by record.

use std::time::Duration;

use shelfsync_proto::CommandBatch;
use shelfsync_storage::Stats;
use shelfsync_testkit::{NatsServer, RedisServer, TestEnv, unique_name};
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACES: [i64; 4] = [1, 2, 3, 4];

/// Servers with Redis persisting every write before it answers.
async fn env_with_aof() -> TestEnv {
    let (nats, redis) = tokio::try_join!(
        NatsServer::start(),
        RedisServer::start_with_args(&["--appendonly", "yes", "--appendfsync", "always"])
    )
    .expect("servers");
    let prefix = unique_name();
    TestEnv { nats, redis, namespace: prefix.clone(), prefix }
}

fn workload(partitions: u32) -> (Vec<CommandBatch>, SerialModel) {
    Churn { brand: BRAND, places: PLACES.to_vec(), items: 80, chunk: 20 }.modelled(partitions)
}

/// Command messages committed so far (over every partition): the sum of
/// the applied sequences would do too, but this reads one counter.
fn committed(stats: &Stats) -> u64 {
    Stats::get(&stats.batches)
}

#[tokio::test]
async fn nats_killed_and_restarted_mid_import_loses_and_duplicates_nothing() {
    let mut env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    // Many small commits (two messages each), so that the kill lands
    // mid-import; committed 32 at a time, the import can be over in a few
    // change messages before "mid-import" is ever seen.
    settings.storage.read_ahead = 1;
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let (batches, model) = workload(settings.storage.partitions);

    // The real binary: a deployment's storage, not a test double.
    // The publishes in flight when the connection drops wait this long for
    // their ack before the relay retries them (default 10 s).
    let mut storage =
        StorageProcess::start(&settings, &[("SHELFSYNC__NATS__REQUEST_TIMEOUT", "4s")])
            .expect("storage");
    let mirror = FeedMirror::default();
    let feed = RunningFeed::tail(&h, "nats-restart-mirror", mirror.clone());

    // The producer retries each message with the same id until acked, the
    // way ingest's publisher does (dedup window): the outage costs it time,
    // not messages.
    let writer = {
        let h = Harness::connect(settings.clone()).await.expect("writer");
        let batches = batches.clone();
        tokio::spawn(async move { h.publish_batches("import", &batches).await })
    };
    eventually(Duration::from_secs(30), "storage to be mid-import", || async {
        h.changes_last_seq().await.is_ok_and(|n| n >= 10)
    })
    .await;
    let mut cmd = h.js.get_stream(h.subjects.cmd_stream()).await.expect("stream");
    let queued = cmd.info().await.expect("info").state.messages;
    env.nats.kill();
    // Down long enough for every client to notice (failed pulls, publishes).
    tokio::time::sleep(Duration::from_secs(2)).await;
    env.nats.restart().await.expect("nats-server restarts on its store");
    let back = std::time::Instant::now();

    writer.await.expect("writer task").expect("every command acked after the restart");
    h.wait_settled().await;
    eprintln!(
        "nats-server killed with {queued} command messages queued; all applied {:?} after it was back",
        back.elapsed()
    );
    assert!(queued > 0, "the kill landed mid-import");
    assert!(
        storage.child.try_wait().expect("status").is_none(),
        "storage rode through the outage without a restart"
    );
    h.assert_serial(&model, BRAND, &PLACES).await;
    // A redelivery whose ack died with the server is dropped by the kit, so
    // the handler still sees each transition once.
    mirror.assert_mirrors(&feed, &h, &model, BRAND, &PLACES).await;
}

#[tokio::test]
async fn redis_with_aof_killed_and_restarted_mid_import_loses_no_acknowledged_command() {
    let mut env = env_with_aof().await;
    let settings = storage_settings(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let (batches, model) = workload(settings.storage.partitions);

    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    let mirror = FeedMirror::default();
    let feed = RunningFeed::tail(&h, "redis-restart-mirror", mirror.clone());
    h.publish_batches("import", &batches).await.expect("publish");
    eventually(Duration::from_secs(30), "storage to be mid-import", || async {
        committed(&storage.stats) >= 10
    })
    .await;
    let acked_before_crash = committed(&storage.stats);
    env.redis.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    env.redis.restart().await.expect("redis-server restarts from its AOF");

    h.wait_settled().await;
    assert!(acked_before_crash < batches.len() as u64, "the crash landed mid-import");
    // Every command storage acked was committed and fsynced first, so the
    // restarted Redis holds it: the end state is the serial one.
    h.assert_serial(&model, BRAND, &PLACES).await;
    assert_eq!(Stats::get(&storage.stats.dead_lettered), 0, "nothing given up on");
    mirror.assert_mirrors(&feed, &h, &model, BRAND, &PLACES).await;
}

#[tokio::test]
async fn redis_away_for_seconds_is_retried_with_backoff_and_recovered_alone() {
    let mut env = env_with_aof().await;
    let settings = storage_settings(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let (batches, model) = workload(settings.storage.partitions);
    let (first, second) = batches.split_at(batches.len() / 2);

    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    let mirror = FeedMirror::default();
    let feed = RunningFeed::tail(&h, "redis-away-mirror", mirror.clone());
    h.publish_batches("first", first).await.expect("publish");
    h.wait_settled().await;

    env.redis.kill();
    // Commands keep coming while Redis is away (NATS takes them).
    h.publish_batches("second", second).await.expect("publish");
    let committed_before = Stats::get(&storage.stats.batches);
    let outage = Duration::from_secs(3);
    tokio::time::sleep(outage).await;
    let retries_during_outage = Stats::get(&storage.stats.retries);
    assert_eq!(
        Stats::get(&storage.stats.batches),
        committed_before,
        "nothing commits without Redis"
    );
    let mut cmd = h.js.get_stream(h.subjects.cmd_stream()).await.expect("stream");
    assert!(cmd.info().await.expect("info").state.messages > 0, "work waits in the stream");
    env.redis.restart().await.expect("redis-server back");
    let back = std::time::Instant::now();
    h.wait_settled().await;

    // A failed attempt is nak'd with a growing delay (retry_delay 100 ms,
    // doubling), and the Redis client itself waits between reconnection
    // attempts (up to 2 s): a handful of deliveries per busy partition in
    // 3 s — not hundreds — and none dead-letters a batch (transient errors
    // never do).
    let busy = {
        let mut p: Vec<u32> = second.iter().map(|b| b.partition).collect();
        p.sort();
        p.dedup();
        p.len() as u64
    };
    eprintln!(
        "redis away {outage:?}: {retries_during_outage} naks on {busy} busy partitions; \
         all applied {:?} after Redis was back",
        back.elapsed()
    );
    assert!(
        retries_during_outage <= busy * 8,
        "{retries_during_outage} retries on {busy} partitions in {outage:?}: backoff missing"
    );
    assert_eq!(Stats::get(&storage.stats.dead_lettered), 0, "no batch dead-lettered");
    h.assert_serial(&model, BRAND, &PLACES).await;

    // Retried or not, each partition was applied in stream order.
    let mut last_seq = std::collections::HashMap::new();
    for b in h.change_batches().await.expect("changes") {
        if b.keyframe.is_some() {
            continue;
        }
        let prev = last_seq.insert(b.partition, b.command_seq).unwrap_or(0);
        assert!(b.command_seq >= prev, "partition {} went back in order", b.partition);
    }
    // The owner reads the partition with a consumer of its own, without
    // acks: what it applied it purges.
    let name = h.storage_consumers(h.partition(BRAND, 1)).await.pop().expect("its consumer");
    let info = h.consumer_info(&h.subjects.cmd_stream(), &name).await.expect("consumer info");
    assert_eq!(info.config.ack_policy, async_nats::jetstream::consumer::AckPolicy::None);

    mirror.assert_mirrors(&feed, &h, &model, BRAND, &PLACES).await;
}

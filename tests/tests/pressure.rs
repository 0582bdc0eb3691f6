//! Under pressure storage waits, it never drops (docs/RELIABILITY.md,
//! scenarios 18 to 21): resource errors are backpressure, only what the same input
//! will always hit is set aside, and then whole.
//!
//! - Redis refusing every write (`maxmemory` reached, `noeviction`, as the
//!   deployments ship it) for longer than any retry budget, mid-import: the
//!   partitions wait (not ready, a gauge, retries counted), nothing is
//!   dead-lettered, and once there is room the exact change set arrives.
//! - CHANGES refusing the relay's publishes (its `max_bytes` reached with
//!   `discard: new`) for longer than the relay's old budget: nothing is
//!   buried, every change is stored once when the stream has room again.
//! - A decompression bomb and messages of more than 1000 commands, sent to
//!   the real binary: each set aside once, whole, before anything is
//!   allocated for it; another partition's change keeps flowing; the
//!   process's peak memory stays small; it stops on SIGTERM at once.
//! - Redis going back in time under a running storage (restarted from a
//!   snapshot taken before the last import): the import sent again is
//!   applied and published again, not skipped on the owner's memory.
//!
//! Figures are printed (`--nocapture`) for docs/RELIABILITY.md; set
//! `SHELFSYNC_PRESSURE_FULL_SECS` to hold Redis full longer (60 for the
//! issue's "a full Redis for a minute").

use std::time::{Duration, Instant};

use prost::Message;
use shelfsync_proto::{Command, CommandBatch};
use shelfsync_storage::Stats;
use shelfsync_testkit::{NatsServer, RedisServer, TestEnv, eventually, unique_name};
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACES: [i64; 4] = [1, 2, 3, 4];

fn workload(partitions: u32) -> (Vec<CommandBatch>, SerialModel) {
    Churn { brand: BRAND, places: PLACES.to_vec(), items: 80, chunk: 20 }.modelled(partitions)
}

async fn redis_config(h: &Harness, key: &str, value: &str) {
    let mut conn = h.store.conn();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(key)
        .arg(value)
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET");
}

fn full_for() -> Duration {
    let secs = std::env::var("SHELFSYNC_PRESSURE_FULL_SECS").ok().and_then(|s| s.parse().ok());
    Duration::from_secs(secs.unwrap_or(8))
}

#[tokio::test]
async fn a_full_redis_for_longer_than_every_retry_budget_loses_nothing() {
    let (nats, redis) = tokio::try_join!(
        NatsServer::start(),
        RedisServer::start_with_args(&["--maxmemory-policy", "noeviction"])
    )
    .expect("servers");
    let env = TestEnv::with_servers(nats, redis);
    let mut settings = storage_settings(&env);
    // Short retries: an error taken for the message's fault would be
    // dead-lettered (5 deliveries) within a second.
    settings.storage.retry_delay = Duration::from_millis(50);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let (batches, model) = workload(settings.storage.partitions);
    let (first, second) = batches.split_at(batches.len() / 2);
    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    let mirror = FeedMirror::default();
    let feed = RunningFeed::tail(&h, "redis-full-mirror", mirror.clone());
    h.publish_batches("first", first).await.expect("publish");
    h.wait_settled().await;

    // Full: every write refused with OOM, reads still answered.
    redis_config(&h, "maxmemory", "1").await;
    h.publish_batches("second", second).await.expect("publish");
    let full = full_for();
    let started = Instant::now();
    eventually(SETTLE, "a partition to wait for room", || async {
        storage.ready.held_back().values().any(|c| *c == "redis_full")
    })
    .await;
    assert!(!storage.ready.is_ready(), "not ready while a partition waits");
    let metrics = shelfsync_telemetry::render_metrics();
    assert!(
        metrics.lines().any(|l| l.starts_with("shelfsync_partition_backpressure{")
            && l.contains("cause=\"redis_full\"")
            && l.ends_with(" 1")),
        "the backpressure gauge is up"
    );
    tokio::time::sleep(full.saturating_sub(started.elapsed())).await;
    let retries = Stats::get(&storage.stats.backpressure_retries);
    assert_eq!(Stats::get(&storage.stats.dead_lettered), 0, "nothing set aside while full");

    // Room again.
    redis_config(&h, "maxmemory", "0").await;
    let back = Instant::now();
    h.wait_settled().await;
    eprintln!(
        "redis full {full:?}: {retries} retries while full, nothing dead-lettered; \
         all applied {:?} after room came back",
        back.elapsed()
    );
    assert!(retries >= 5, "retried for longer than any delivery budget: {retries}");
    eventually(SETTLE, "storage ready again", || async { storage.ready.is_ready() }).await;
    assert_eq!(Stats::get(&storage.stats.dead_lettered), 0, "no batch dead-lettered");
    let failed = h.rejections().await.expect("rejections");
    assert!(failed.iter().all(|r| r.reason != "failed"), "{failed:?}");
    h.assert_serial(&model, BRAND, &PLACES).await;
    // Exactly the change set of the serial model, each change once.
    mirror.assert_mirrors(&feed, &h, &model, BRAND, &PLACES).await;
}

#[tokio::test]
async fn a_stream_refusing_the_relay_for_longer_than_any_budget_buries_nothing() {
    let Stack { h, storage, env: _env, .. } = Stack::start().await;
    let place = 1;
    let p = h.partition(BRAND, place);
    let price = |id: &str, price: i64| patch(BRAND, place, id, &product("Roses", price, 3), 0);
    h.send(vec![price("a", 100)]).await.expect("send");
    h.wait_settled().await;

    // CHANGES full, refusing new messages: what an account or a stream out
    // of room does.
    let name = h.subjects.changes_stream();
    let mut stream = h.js.get_stream(&name).await.expect("CHANGES");
    let info = stream.info().await.expect("info");
    let mut full = info.config.clone();
    full.max_bytes = info.state.bytes as i64 + 1;
    full.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    h.js.update_stream(&full).await.expect("full");
    for i in 0..20 {
        h.send(vec![price(&format!("sku-{i}"), 100 + i)]).await.expect("send");
    }
    // Longer than the 10 refusals after which a relay used to bury an
    // entry (about 26 s of its backoff).
    let refused_for = Duration::from_secs(30);
    eventually(SETTLE, "the partition to wait for the stream", || async {
        storage.ready.held_back().get(&p.0) == Some(&"nats_refused")
    })
    .await;
    tokio::time::sleep(refused_for).await;
    let retries = Stats::get(&storage.stats.backpressure_retries);
    assert_eq!(h.store.dead_entries(p, 10).await.expect("dead").len(), 0, "nothing buried");

    h.js.update_stream(&info.config).await.expect("room again");
    h.wait_settled().await;
    eprintln!("CHANGES refusing for {refused_for:?}: {retries} retries, nothing buried");
    assert!(retries >= 10, "{retries}");
    assert_eq!(h.store.dead_entries(p, 10).await.expect("dead").len(), 0, "nothing buried");
    let changes = h.changes().await.expect("changes");
    let counts = count_by_key(&changes);
    for i in 0..20 {
        assert_eq!(counts.get(&(BRAND, place, format!("sku-{i}"))), Some(&1), "sku-{i} once");
    }
    let metrics = shelfsync_telemetry::render_metrics();
    assert_eq!(metric_value(&metrics, "shelfsync_outbox_unpublishable_total", ""), None);
}

/// An `lz4` payload whose block holds `commands` empty commands (each two
/// bytes: field 2, length 0).
fn packed_empty_commands(commands: usize) -> Vec<u8> {
    shelfsync_bus::encoding::compress(&[0x12, 0x00].repeat(commands))
}

fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
    line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("kB")
}

#[tokio::test]
async fn a_bomb_and_oversized_messages_are_set_aside_once_whole_and_hurt_no_other_partition() {
    use async_nats::jetstream::message::PublishMessage;
    use shelfsync_bus::encoding::{ENCODING_HEADER, LZ4};
    let env = TestEnv::start().await.expect("servers");
    let settings = storage_settings(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let mut storage = StorageProcess::start(&settings, &[]).expect("storage");
    let pid = storage.child.id();
    let (bombed, other) = (1, (2..).find(|p| h.partition(BRAND, *p) != h.partition(BRAND, 1)));
    let other = other.expect("a place on another partition");
    let p = h.partition(BRAND, bombed);
    let good = |place: i64, id: &str| patch(BRAND, place, id, &product("Roses", 100, 3), 0);
    h.send(vec![good(bombed, "before"), good(other, "before")]).await.expect("send");
    h.wait_settled().await;
    let baseline = peak_rss_kib(pid);

    let send = |payload: Vec<u8>, lz4: bool| {
        let mut msg = PublishMessage::build()
            .payload(payload.into())
            .header(shelfsync_bus::TYPE_HEADER, shelfsync_proto::msg_type::COMMAND_BATCH);
        if lz4 {
            msg = msg.header(ENCODING_HEADER, LZ4);
        }
        let (js, subject) = (h.js.clone(), h.subjects.cmd(p));
        async move { js.send_publish(subject, msg).await?.await.map(drop) }
    };
    // 64 MiB of 32M empty commands, about 250 KB on the wire.
    let bomb = packed_empty_commands(32 << 20);
    // 600 000 commands in 1.2 MB once decoded: under the size limit, over
    // the count.
    let many = packed_empty_commands(600_000);
    // 1001 commands, plain.
    let plain = CommandBatch {
        partition: p.0,
        commands: vec![Command::default(); 1001],
        ..Default::default()
    }
    .encode_to_vec();
    let sizes = [bomb.len(), many.len(), plain.len()];
    let sent = Instant::now();
    send(bomb, true).await.expect("bomb");
    send(many, true).await.expect("many");
    send(plain, false).await.expect("plain");
    // Right behind them: a change on the bombed partition and on another.
    h.send(vec![good(other, "during")]).await.expect("send");
    h.send(vec![good(bombed, "after")]).await.expect("send");
    let flowed = async {
        eventually(SETTLE, "the other partition's change", || async {
            count_by_key(&h.changes().await.unwrap_or_default()).contains_key(&(
                BRAND,
                other,
                "during".to_string(),
            ))
        })
        .await;
        sent.elapsed()
    }
    .await;
    h.wait_settled().await;
    let peak = peak_rss_kib(pid);
    eprintln!(
        "bomb ({} B on the wire), 600 000 and 1001 commands: the other partition's change \
         stored {flowed:?} after they were sent; peak RSS {} MiB (before them {} MiB)",
        sizes[0],
        peak / 1024,
        baseline / 1024
    );
    assert!(peak < 256 * 1024, "peak RSS {peak} KiB: memory is not bounded");
    assert!(h.get(BRAND, bombed, "after").await.expect("get").is_some(), "the partition went on");
    let dead: Vec<_> = h
        .rejections()
        .await
        .expect("rejections")
        .into_iter()
        .filter(|r| r.reason == "too_large" && r.key.is_none())
        .collect();
    assert_eq!(dead.len(), 3, "each set aside once: {dead:?}");
    let mut kept: Vec<usize> = dead.iter().map(|r| r.raw.len()).collect();
    kept.sort();
    let mut expected = sizes.to_vec();
    expected.sort();
    assert_eq!(kept, expected, "each kept whole, as it came");
    assert!(dead.iter().any(|r| r.detail.contains("more than the")), "the bomb's size");
    assert!(dead.iter().any(|r| r.detail.contains("600000 commands")), "{dead:?}");
    // SIGTERM is honoured at once.
    let asked = Instant::now();
    signal(pid, "TERM");
    let status = storage.wait_exit(Duration::from_secs(20)).await.expect("stops within its grace");
    eprintln!("stopped {:?} after SIGTERM ({status})", asked.elapsed());
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn redis_gone_back_in_time_under_a_running_storage_is_repaired_by_the_import_sent_again() {
    let Stack { h, storage, mut env, .. } = Stack::start().await;
    let place = 1;
    let import = |price: i64| -> Vec<Command> {
        (0..60)
            .map(|i| patch(BRAND, place, &format!("sku-{i}"), &product("Roses", price, 3), 0))
            .collect()
    };
    h.send(import(100)).await.expect("v1");
    h.wait_settled().await;
    // A snapshot of Redis before the last import.
    let mut conn = h.store.conn();
    let () = redis::cmd("SAVE").query_async(&mut conn).await.expect("SAVE");
    let dump = env.redis.dir().join("dump.rdb");
    let saved = env.redis.dir().join(format!("{}.rdb", unique_name()));
    std::fs::copy(&dump, &saved).expect("copy the snapshot");
    h.send(import(200)).await.expect("v2");
    h.wait_settled().await;
    // The same import again changes nothing: storage skips it from memory.
    h.send(import(200)).await.expect("v2 again");
    h.wait_settled().await;
    let before = h.changes().await.expect("changes").len();
    assert_eq!(before, 120, "60 created, 60 re-priced, nothing for the repeat");
    assert!(Stats::get(&storage.stats.known_skipped) >= 60, "the repeat was skipped from memory");

    // Redis comes back from the older snapshot under the running storage.
    env.redis.kill();
    std::fs::copy(&saved, &dump).expect("restore the snapshot");
    env.redis.restart().await.expect("redis back");
    // (The harness's connection reconnects at its first use after the restart.)
    eventually(SETTLE, "Redis to hold the older state", || async {
        let r = h.get(BRAND, place, "sku-0").await.ok().flatten();
        r.is_some_and(|r| decode_product(&r.data).price == Some(100))
    })
    .await;

    // The last import, sent again, repairs it: applied and published again.
    h.send(import(200)).await.expect("v2 once more");
    h.wait_settled().await;
    let changes = h.changes().await.expect("changes");
    eprintln!("after Redis went back: {} of 60 changes published again", changes.len() - before);
    assert_eq!(changes.len() - before, 60, "every record's change published again");
    for i in 0..60 {
        let r = h.get(BRAND, place, &format!("sku-{i}")).await.expect("get").expect("record");
        assert_eq!(decode_product(&r.data).price, Some(200), "sku-{i} repaired");
    }
    assert!(Stats::get(&storage.stats.redis_went_back) >= 1, "the episode was counted");
}

//! Storage at the edges of its guarantees (docs/RELIABILITY.md, scenarios
//! 11 to 14):
//!
//! - a command stream deleted and created again (sequences restart at 1):
//!   nothing is acked as "already applied", the partition is refused with
//!   one clear error until `shelfsync rebase`, then everything is applied;
//! - a rejection too large to publish (a near-`max_payload` command): it is
//!   reduced, and its partition goes on;
//! - purges: a record absent for longer than `absent_ttl` is deleted (a
//!   DELETED change); a purge on a stale position writes nothing;
//! - `redis.wait_replicas`: a commit is neither published nor acked before a
//!   real Redis replica has it.

use std::time::Duration;

use prost::Message;
use shelfsync_proto::{Command, CommandBatch, CommandKind, RecordKey};
use shelfsync_storage::client::{Fence, Position};
use shelfsync_testkit::{NatsServer, RedisServer, TestEnv, eventually};
use shelfsync_tests::*;

const BRAND: i64 = 7;

fn price_patch(place: i64, id: &str, price: i64) -> Command {
    patch(BRAND, place, id, &product("Roses", price, 3), 0)
}

#[tokio::test]
async fn a_recreated_command_stream_is_refused_until_an_operator_rebases_it() {
    // One message a commit: the new stream's sequences, and so their change
    // batches, repeat the old ones exactly.
    let Stack { h, storage, settings, env: _env } =
        Stack::start_with(|s| s.storage.read_ahead = 0).await;
    let place = 1;
    let p = h.partition(BRAND, place);
    // Ten messages applied: the partition's applied sequence is 10.
    for i in 0..10 {
        h.send(vec![price_patch(place, &format!("sku-{i}"), 100)]).await.expect("send");
    }
    h.wait_settled().await;
    assert_eq!(h.store.applied_seq(p).await.expect("redis"), 10);

    // The stream is deleted and created again: its sequences start at 1.
    h.js.delete_stream(h.subjects.cmd_stream()).await.expect("delete");
    shelfsync_bus::provision(&h.js, &settings.nats, settings.topology()).await.expect("recreate");
    for i in 0..3 {
        h.send(vec![price_patch(place, &format!("sku-{i}"), 200)]).await.expect("send");
    }
    eventually(SETTLE, "storage to refuse the partition", || async {
        shelfsync_storage::Stats::get(&storage.stats.refused) >= 1
    })
    .await;
    // Nothing taken as applied: the three commands wait in the work queue.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut stream = h.js.get_stream(h.subjects.cmd_stream()).await.expect("stream");
    assert_eq!(stream.info().await.expect("info").state.messages, 3, "nothing acked");
    for i in 0..3 {
        let r = h.get(BRAND, place, &format!("sku-{i}")).await.expect("get").expect("record");
        assert_eq!(decode_product(&r.data).price, Some(100), "nothing applied meanwhile");
    }

    let out = cli_ok(&settings, &["rebase"]).await.expect("shelfsync rebase");
    assert!(out.contains(&format!("re-based partitions [{}]", p.0)), "{out}");
    h.wait_settled().await;
    for i in 0..3 {
        let r = h.get(BRAND, place, &format!("sku-{i}")).await.expect("get").expect("record");
        assert_eq!(decode_product(&r.data).price, Some(200), "applied after the re-base");
    }
    assert_eq!(h.store.applied_seq(p).await.expect("redis"), 3, "counts in the new stream");
    // Their changes are stored too, although the new stream's sequences
    // repeat the old ones inside the duplicate window: change message ids
    // name the command stream they count in.
    let repriced = h
        .changes()
        .await
        .expect("changes")
        .into_iter()
        .filter(|c| c.after.as_ref().is_some_and(|a| decode_product(&a.data).price == Some(200)))
        .count();
    assert_eq!(repriced, 3, "every change after the re-base is on CHANGES");
}

#[tokio::test]
async fn a_rejection_too_large_to_publish_is_reduced_and_its_partition_goes_on() {
    // Context passed on without tracing: what storage keeps with an outbox
    // entry is the command's own, and only the entry carries it to a piece.
    shelfsync_telemetry::install_propagators();
    // A small max_payload, so that storage's headroom below it is gone:
    // the rejection of a command near the limit cannot be published whole.
    let nats = NatsServer::start_with_config("max_payload: 65536").await.expect("nats");
    let redis = RedisServer::start().await.expect("redis");
    let env = TestEnv::with_servers(nats, redis);
    let Stack { h, storage: _storage, env: _env, .. } = Stack::on(env, |s| {
        s.storage.max_record_bytes = 16 * 1024;
    })
    .await;
    let place = 1;
    let p = h.partition(BRAND, place);
    // The largest command message the server takes (the client checks the
    // size, so a refused attempt stores nothing).
    let near_max = |len: usize| CommandBatch {
        partition: p.0,
        commands: vec![Command {
            key: Some(RecordKey::new(BRAND, place, "huge")),
            kind: CommandKind::Patch as i32,
            data: shelfsync_proto::Product {
                description: Some("x".repeat(len)),
                ..Default::default()
            }
            .encode_to_vec(),
            // A rejection holds the origin twice (its own and the command's):
            // 20 KiB more than the command, more than the room the command
            // stream leaves under the payload limit (`CMD_HEADROOM`) beyond
            // storage's own headroom, whatever the headers weigh.
            origin: Some(shelfsync_proto::Origin {
                source: "edge".into(),
                import_id: "i".repeat(20 * 1024),
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    };
    // Sent with a trace and baggage, which the reduced rejection keeps.
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let send_traced = |len: usize| {
        let msg = async_nats::jetstream::message::PublishMessage::build()
            .payload(near_max(len).encode_to_vec().into())
            .message_id(format!("huge:{len}"))
            .header(shelfsync_bus::TYPE_HEADER, shelfsync_proto::msg_type::COMMAND_BATCH)
            .header(shelfsync_telemetry::TRACEPARENT, format!("00-{TRACE}-00f067aa0ba902b7-01"))
            .header(shelfsync_telemetry::BAGGAGE, "tenant=acme");
        let (js, subject) = (h.js.clone(), h.subjects.cmd(p));
        async move { anyhow::Ok(js.send_publish(subject, msg).await?.await?) }
    };
    // The command stream takes messages up to CMD_HEADROOM below the
    // limit; the command's origin takes 20 KiB of it.
    let start = 65_536 - shelfsync_bus::CMD_HEADROOM - 20 * 1024;
    let mut len = start;
    let sent = loop {
        assert!(len > start - 4096, "no command near the limit could be sent");
        if send_traced(len).await.is_ok() {
            break len;
        }
        len -= 16;
    };
    eprintln!("a command of {} bytes went through", near_max(sent).encoded_len());
    // The partition goes on.
    h.send(vec![price_patch(place, "after", 100)]).await.expect("send");
    h.wait_settled().await;
    assert!(h.get(BRAND, place, "after").await.expect("get").is_some(), "the partition went on");
    let rejections = h.rejections().await.expect("rejections");
    let r =
        rejections.iter().find(|r| r.reason == "too_large").expect("the rejection is published");
    assert_eq!(r.key, Some(RecordKey::new(BRAND, place, "huge")));
    assert!(r.detail.contains("reduced"), "{}", r.detail);
    assert!(r.command.as_ref().is_some_and(|c| c.data.is_empty()), "the command's data left out");
    // The reduced piece went out with the command's trace and baggage.
    let rejects = h.js.get_stream(h.subjects.rejects_stream()).await.expect("REJECTS");
    let piece = rejects
        .get_last_raw_message_by_subject(&h.subjects.rejects(BRAND, place))
        .await
        .expect("the reduced rejection");
    let header = |name: &str| piece.headers.get(name).map(|v| v.to_string()).unwrap_or_default();
    assert!(header(shelfsync_telemetry::TRACEPARENT).contains(TRACE), "{:?}", piece.headers);
    assert!(header(shelfsync_telemetry::BAGGAGE).contains("tenant=acme"), "{:?}", piece.headers);
}

#[tokio::test]
async fn a_record_absent_for_longer_than_absent_ttl_is_deleted_with_a_deleted_change() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start_with(|s| {
        s.storage.absent_ttl = Duration::from_secs(2);
        s.storage.purge_interval = Duration::from_millis(200);
    })
    .await;
    let place = 1;
    // Imported at G1 with a and b, then at G2 with a only: b is swept.
    let full = |generation: i64, ids: &[&str]| {
        ids.iter()
            .map(|id| patch(BRAND, place, id, &product("Roses", 100, 3), generation))
            .collect::<Vec<_>>()
    };
    h.send(full(1, &["a", "b"])).await.expect("send");
    h.send_sweep(BRAND, place, 1).await.expect("sweep");
    h.send(full(2, &["a"])).await.expect("send");
    h.send_sweep(BRAND, place, 2).await.expect("sweep");
    h.wait_settled().await;
    assert!(h.get(BRAND, place, "b").await.expect("get").expect("b").absent);

    eventually(SETTLE, "the absent record to be purged", || async {
        h.get(BRAND, place, "b").await.ok().flatten().is_some_and(|r| r.deleted)
    })
    .await;
    h.wait_settled().await;
    let changes = h.changes().await.expect("changes");
    let of_b: Vec<_> = changes
        .iter()
        .filter(|c| c.key.as_ref().is_some_and(|k| k.product_id == "b"))
        .map(|c| shelfsync_proto::ChangeKind::try_from(c.kind).expect("kind"))
        .collect();
    use shelfsync_proto::ChangeKind::*;
    assert_eq!(of_b, [Created, Updated, Deleted], "created, swept, purged");
    let a = h.get(BRAND, place, "a").await.expect("get").expect("a");
    assert!(!a.absent && !a.deleted, "a present record is never purged");
}

#[tokio::test]
async fn a_purge_on_a_stale_position_writes_nothing() {
    let Stack { h, storage, env: _env, .. } = Stack::start_with(|s| {
        s.storage.tombstone_ttl = Duration::from_secs(3600);
    })
    .await;
    let place = 1;
    let p = h.partition(BRAND, place);
    h.send(vec![price_patch(place, "gone", 100)]).await.expect("send");
    let delete = Command { kind: CommandKind::Delete as i32, ..price_patch(place, "gone", 100) };
    h.send(vec![delete]).await.expect("send");
    h.wait_settled().await;
    storage.stop().await.expect("stop");
    let applied = h.store.applied_seq(p).await.expect("redis");
    let far_future = now_us() + 10 * 3600 * 1_000_000;
    // A stale owner: the position it read is not where the partition stands.
    let stale = Fence { at: Position::at(applied - 1), stream: String::new() };
    let purged = h.store.purge_tombstones(p, &stale, far_future, 1000).await.expect("redis");
    assert_eq!(purged, None, "fenced");
    assert!(
        h.get(BRAND, place, "gone").await.expect("get").is_some(),
        "the tombstone is still there"
    );
    let current = Fence { at: Position::at(applied), stream: String::new() };
    let purged = h.store.purge_tombstones(p, &current, far_future, 1000).await.expect("redis");
    assert_eq!(purged, Some(1));
    assert!(h.get(BRAND, place, "gone").await.expect("get").is_none(), "purged");
}

#[tokio::test]
async fn a_commit_is_neither_published_nor_acked_before_a_redis_replica_has_it() {
    let nats = NatsServer::start().await.expect("nats");
    let primary = RedisServer::start().await.expect("redis");
    let port = primary.port().to_string();
    let replica =
        RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &port]).await.expect("replica");
    let env = TestEnv::with_servers(nats, primary);
    let Stack { h, storage: _storage, env: _env, .. } = Stack::on(env, |s| {
        s.redis.wait_replicas = 1;
        s.redis.wait_timeout = Duration::from_millis(200);
    })
    .await;
    let place = 1;
    h.send(vec![price_patch(place, "a", 100)]).await.expect("send");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 1);

    // The replica stops answering: the next commit waits for it.
    let pid = replica.pid().expect("replica pid");
    signal(pid, "STOP");
    h.send(vec![price_patch(place, "a", 200)]).await.expect("send");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let waited = h.changes().await.expect("changes").len();
    signal(pid, "CONT");
    assert_eq!(waited, 1, "nothing published while the replica had not confirmed the commit");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 2, "published once it had");
    let metrics = shelfsync_telemetry::render_metrics();
    let retries = metric_value(&metrics, "shelfsync_redis_wait_retries_total", "").unwrap_or(0.0);
    assert!(retries >= 1.0, "the waits were counted: {retries}");
}

/// A sweep applied in steps, its storage killed after the first step, and
/// its message then deleted from the command stream (by an operator, or
/// lost with the stream's files): the partition can never finish it. It is
/// refused — not ready, one error — instead of retrying forever, and
/// `shelfsync rebase --drop-step` lets it go on; what the sweep marked stays.
#[tokio::test]
async fn a_half_applied_sweep_whose_message_is_gone_refuses_its_partition_until_dropped() {
    let env = TestEnv::start().await.expect("servers");
    let settings = storage_settings(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let place = 1;
    let p = h.partition(BRAND, place);
    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    let ids: Vec<String> = (0..2500).map(|i| format!("sku-{i}")).collect();
    for chunk in ids.chunks(1000) {
        let batch =
            chunk.iter().map(|id| patch(BRAND, place, id, &product("Roses", 100, 3), 1)).collect();
        h.send(batch).await.expect("send");
    }
    h.wait_settled().await;
    storage.stop().await.expect("stop");

    // A sweep that marks every record absent, 1000 per step; the storage
    // binary dies right after its first step.
    let mut storage =
        StorageProcess::start(&settings, &[("SHELFSYNC_FAILPOINT", "after_sweep_step")])
            .expect("storage");
    h.send_sweep(BRAND, place, 2).await.expect("sweep");
    storage.wait_exit(SETTLE).await.expect("aborted at the failpoint");
    let at = h.store.position(p).await.expect("position");
    assert!(!at.step.is_empty(), "the sweep is half applied: {at:?}");
    let mut cmd = h.js.get_stream(h.subjects.cmd_stream()).await.expect("CMD");
    let sweep_seq = cmd.info().await.expect("info").state.last_sequence;
    cmd.delete_message(sweep_seq).await.expect("the sweep message deleted");
    let absent = || async {
        let records = h.records_of(BRAND, &[place]).await.expect("records");
        records.values().filter(|r| r.absent).count()
    };
    let marked = absent().await;
    assert!((1..2500).contains(&marked), "one step marked: {marked}");
    h.send(vec![price_patch(place, "after", 100)]).await.expect("send");

    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    eventually(SETTLE, "the partition to be refused", || async {
        matches!(
            storage.ready.refused().get(&p.0),
            Some(shelfsync_storage::Refusal::StepGone { .. })
        )
    })
    .await;
    assert!(!storage.ready.is_ready(), "not ready while refused");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(h.get(BRAND, place, "after").await.expect("get").is_none(), "nothing applied");

    let out = cli_ok(&settings, &["rebase", "--drop-step"]).await.expect("rebase --drop-step");
    assert!(out.contains(&format!("re-based partitions [{}]", p.0)), "{out}");
    h.wait_settled().await;
    assert!(h.get(BRAND, place, "after").await.expect("get").is_some(), "the partition went on");
    assert_eq!(absent().await, marked, "what the sweep marked stays; the rest was dropped");
    eventually(SETTLE, "ready again", || async { storage.ready.is_ready() }).await;
}

/// `redis.wait_replicas` holds on every path that publishes or acks, and
/// cannot be passed by a connection that wrote nothing: a commit whose
/// owner died before it saw the replicas confirm is relayed by the next
/// owner only once they have it; and `WAIT` on a fresh connection (which
/// alone would return at once) counts the replicas that have every write.
#[tokio::test]
async fn a_commit_left_by_a_dead_owner_is_relayed_only_once_the_replicas_have_it() {
    let nats = NatsServer::start().await.expect("nats");
    let primary = RedisServer::start().await.expect("redis");
    let port = primary.port().to_string();
    let replica =
        RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &port]).await.expect("replica");
    let env = TestEnv::with_servers(nats, primary);
    let mut settings = storage_settings(&env);
    settings.redis.wait_replicas = 1;
    settings.redis.wait_timeout = Duration::from_millis(200);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let place = 1;
    let p = h.partition(BRAND, place);
    eventually(SETTLE, "the replica to be in sync", || async {
        h.store.wait_replicas(p, 1, Duration::from_millis(100)).await.is_ok_and(|n| n == 1)
    })
    .await;

    // The replica stops answering; storage commits, then dies before it
    // sees the replica confirm (before publishing or acking).
    let pid = replica.pid().expect("replica pid");
    signal(pid, "STOP");
    let mut storage = StorageProcess::start(&settings, &[]).expect("storage");
    h.send(vec![price_patch(place, "a", 100)]).await.expect("send");
    eventually(SETTLE, "the commit, waiting for the replica", || async {
        h.store.outbox_len(p).await.is_ok_and(|n| n == 1)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.changes().await.expect("changes").len(), 0, "not published while it waits");
    storage.kill();
    assert_eq!(h.store.outbox_len(p).await.expect("outbox"), 1, "committed, not relayed");

    // A fresh connection's WAIT would pass at once: it wrote nothing.
    let fresh = shelfsync_storage::client::Store::connect(&settings.redis).await.expect("connect");
    let have = fresh.wait_replicas(p, 1, Duration::from_millis(200)).await.expect("wait");
    assert_eq!(have, 0, "a stopped replica does not have every write");

    // The next owner relays the outbox only once the replica has it.
    let _storage = StorageProcess::start(&settings, &[]).expect("storage");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = h.changes().await.expect("changes").len();
    signal(pid, "CONT");
    assert_eq!(before, 0, "nothing published while the replica had not confirmed the commit");
    h.wait_settled().await;
    assert_eq!(h.changes().await.expect("changes").len(), 1, "published once it had");
}

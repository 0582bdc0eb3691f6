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
use shelfsync_storage::store::{Fence, Position};
use shelfsync_testkit::{NatsServer, RedisServer, TestEnv, eventually};
use shelfsync_tests::*;

const BRAND: i64 = 7;

fn price_patch(place: i64, id: &str, price: i64) -> Command {
    patch(BRAND, place, id, &product("Roses", price, 3), 0)
}

#[tokio::test]
async fn a_recreated_command_stream_is_refused_until_an_operator_rebases_it() {
    let Stack { h, storage, settings, env: _env } = Stack::start().await;
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
            // a kilobyte more than the command, whatever the headers weigh.
            origin: Some(shelfsync_proto::Origin {
                source: "edge".into(),
                import_id: "i".repeat(1024),
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
    let mut len = 65_536;
    let sent = loop {
        assert!(len > 60_000, "no command near the limit could be sent");
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

//! Fault scenarios 5 to 8 (docs/RELIABILITY.md), about delivery rather than
//! crashes:
//!
//! 5. a publish ack lost (the server frozen with SIGSTOP while it holds the
//!    message): the retry with the same `Nats-Msg-Id` is dropped as a
//!    duplicate; past the dedup window a replayed command changes nothing and
//!    a replayed change is dropped by the consumer kit;
//! 6. a change redelivered after a newer one (nak, then redelivery): the
//!    consumer keeps the newer version — the serial order;
//! 7. a keyframe under live load, a consumer rebuilt from it: its digests
//!    equal storage's and the next keyframe's, no drift repair needed;
//! 8. a consumer that stops acking: its lag shows in the JetStream consumer
//!    info and in `shelfsync_consumer_lag`; resumed, it loses nothing.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use prost::Message;
use shelfsync_bus::{Partition, TYPE_HEADER};
use shelfsync_feed::{ChangeFeed, FeedConfig, FeedStatus, KeyframeReader};
use shelfsync_proto::{Command, CommandBatch, CommandKind, RecordKey, msg_type};
use shelfsync_storage::Stats;
use shelfsync_testkit::{NatsServer, TestEnv};
use shelfsync_tests::*;

const BRAND: i64 = 7;

/// One command message for one place: a PATCH of `price` on `ids`.
fn prices(
    h: &Harness,
    place: i64,
    ids: impl IntoIterator<Item = usize>,
    price: i64,
) -> CommandBatch {
    CommandBatch {
        partition: h.partition(BRAND, place).0,
        commands: ids
            .into_iter()
            .map(|i| patch(BRAND, place, &format!("sku-{i}"), &product("Roses", price, 3), 0))
            .collect(),
        ..Default::default()
    }
}

/// Freezes a process with SIGSTOP; SIGCONT on drop, whatever the test did.
struct Frozen(u32);

impl Frozen {
    /// Returns once every thread of the process is stopped (`kill` returns
    /// when the signal is sent, not when it has taken effect).
    fn new(pid: u32) -> Self {
        signal(pid, "STOP");
        let stopped = |tid: &std::path::Path| {
            let stat = std::fs::read_to_string(tid.join("stat")).unwrap_or_default();
            // The state follows the command name, which is in parentheses.
            stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()) == Some("T")
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("its threads");
            if tasks.flatten().all(|t| stopped(&t.path())) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

fn nats_pid(nats: &NatsServer) -> u32 {
    let conf = nats.log_path().parent().expect("server dir").join("nats-server.conf");
    pid_with_arg(&conf.display().to_string()).expect("our nats-server's pid")
}

#[tokio::test]
async fn a_publish_whose_ack_is_lost_is_retried_and_stored_once() {
    let Stack { h, storage, env, .. } = Stack::start().await;
    let batch = prices(&h, 1, 0..10, 100);
    let subject = h.subjects.cmd(Partition(batch.partition));
    let message = || {
        PublishMessage::build()
            .payload(batch.encode_to_vec().into())
            .message_id("import-1:0")
            .header(TYPE_HEADER, msg_type::COMMAND_BATCH)
    };

    // The server takes the message off the socket only once it runs again:
    // the publisher's wait for the ack times out, as on a lost ack.
    let frozen = Frozen::new(nats_pid(&env.nats));
    let first = tokio::time::timeout(Duration::from_secs(1), async {
        h.js.send_publish(subject.clone(), message()).await?.await
    })
    .await;
    assert!(!matches!(first, Ok(Ok(_))), "no ack from a frozen server");
    drop(frozen);

    // The retry carries the same id: JetStream stores the message once.
    let ack = h.js.send_publish(subject, message()).await.expect("send").await.expect("ack");
    assert!(ack.duplicate, "the first attempt was stored after all; the retry is dropped");
    h.wait_settled().await;
    let mut cmd = h.js.get_stream(h.subjects.cmd_stream()).await.expect("stream");
    assert_eq!(cmd.info().await.expect("info").state.last_sequence, 1, "one message stored");
    assert_eq!(Stats::get(&storage.stats.batches), 1);
    assert_eq!(h.changes().await.expect("changes").len(), 10, "one change per record");
}

#[tokio::test]
async fn replays_past_the_dedup_window_change_nothing_for_storage_or_consumers() {
    let window = Duration::from_secs(3);
    let Stack { h, storage, env: _env, .. } =
        Stack::start_with(|s| s.nats.duplicate_window = window).await;
    let mirror = FeedMirror::default();
    let feed = RunningFeed::tail(&h, "replay-mirror", mirror.clone());
    let first = prices(&h, 1, 0..10, 100);
    let publish = |b: &CommandBatch| {
        let (js, subject, payload) =
            (h.js.clone(), h.subjects.cmd(Partition(b.partition)), b.encode_to_vec());
        async move {
            let msg = PublishMessage::build()
                .payload(payload.into())
                .message_id("import-1:0")
                .header(TYPE_HEADER, msg_type::COMMAND_BATCH);
            js.send_publish(subject, msg).await.expect("send").await.expect("ack")
        }
    };
    assert!(!publish(&first).await.duplicate);
    assert!(publish(&first).await.duplicate, "within the window: dropped by JetStream");
    h.wait_settled().await;
    let sku0 = h.get(BRAND, 1, "sku-0").await.expect("get").expect("record");

    // Past the window the same message is stored again and applied again:
    // an identical PATCH changes nothing, so storage emits nothing.
    tokio::time::sleep(window + Duration::from_secs(1)).await;
    assert!(!publish(&first).await.duplicate, "past the window JetStream stores it again");
    h.wait_settled().await;
    assert_eq!(Stats::get(&storage.stats.batches), 2, "applied twice");
    assert_eq!(Stats::get(&storage.stats.unchanged), 10, "the second time without effect");
    assert_eq!(h.changes().await.expect("changes").len(), 10, "no change event for a replay");
    let again = h.get(BRAND, 1, "sku-0").await.expect("get").expect("record");
    assert_eq!(again.updated_at, sku0.updated_at, "no updated_at bump");

    // A newer version, then storage's first change message replayed with its
    // own id past the window (as a relay after a long outage would): the
    // stream stores it, the consumer kit drops every record of it as older.
    h.publish_batches("newer", &[prices(&h, 1, [0], 200)]).await.expect("publish");
    h.wait_settled().await;
    feed.wait_caught_up(&h, Duration::from_secs(30)).await;
    let changes = h.js.get_stream(h.subjects.changes_stream()).await.expect("stream");
    let old = changes.get_raw_message(1).await.expect("the first change message");
    let msg_id = old.headers.get("Nats-Msg-Id").expect("storage sets a message id").to_string();
    tokio::time::sleep(window + Duration::from_secs(1)).await;
    let msg = PublishMessage::build()
        .payload(old.payload.clone())
        .message_id(&msg_id)
        .header(TYPE_HEADER, msg_type::CHANGE_BATCH);
    let ack =
        h.js.send_publish(old.subject.to_string(), msg).await.expect("send").await.expect("ack");
    assert!(!ack.duplicate, "past the window the replay is stored");
    feed.wait_caught_up(&h, Duration::from_secs(30)).await;
    assert_eq!(FeedStatus::get(&feed.status.duplicates), 10, "every replayed record dropped");
    assert_eq!(mirror.applied.lock().expect("lock").len(), 11, "10 creations and 1 update");
    mirror.assert_equals_storage(&h, BRAND, &[1]).await;
    let kept = mirror.records.lock().expect("lock")[&(BRAND, 1, "sku-0".to_string())].clone();
    assert_eq!(decode_product(&kept.data).price, Some(200), "the consumer did not roll back");
}

// Storage's outbox relayed again past the dedup window (scenario 5c): no
// duplicate on the stream any more — `faults_window.rs`.

/// Two change messages (sku-0..9 at 100, then sku-1 at 200) and a consumer
/// whose first delivery of the first one fails (a dependency blinked): nak
/// with a delay, the second message is applied meanwhile, then the first
/// comes again — out of order. Returns once the redelivery is applied.
async fn redelivered_out_of_order(
    name: &str,
) -> (TestEnv, Harness, InProcessStorage, FeedMirror, RunningFeed) {
    // Two change messages: storage must not commit the two commands as one.
    let Stack { h, storage, env, .. } = Stack::start_with(|s| s.storage.read_ahead = 0).await;
    h.publish_batches("a", &[prices(&h, 1, 0..10, 100), prices(&h, 1, [1], 200)])
        .await
        .expect("publish");
    h.wait_settled().await;
    let mirror = FeedMirror::default();
    mirror.fail_once.lock().expect("lock").insert("sku-0".into());
    let feed = RunningFeed::tail(&h, name, mirror.clone());
    eventually(Duration::from_secs(30), "the redelivered message applied", || async {
        mirror.records.lock().expect("lock").len() == 10
    })
    .await;
    assert_eq!(mirror.failures.load(Ordering::SeqCst), 1);
    (env, h, storage, mirror, feed)
}

#[tokio::test]
async fn a_change_redelivered_after_a_newer_one_does_not_roll_the_consumer_back() {
    let (_env, h, _storage, mirror, feed) = redelivered_out_of_order("reorder-mirror").await;
    let applied = mirror.applied.lock().expect("lock").clone();
    let at = |id: &str| applied.iter().position(|((_, _, p), _)| p == id).expect("applied");
    assert!(at("sku-1") < at("sku-0"), "the newer message was applied first: {applied:?}");
    assert_eq!(
        applied.iter().filter(|((_, _, p), _)| p == "sku-1").count(),
        1,
        "the older sku-1 in the redelivered message was dropped"
    );
    assert!(FeedStatus::get(&feed.status.duplicates) >= 1);
    mirror.assert_equals_storage(&h, BRAND, &[1]).await;
    let sku1 = mirror.records.lock().expect("lock")[&(BRAND, 1, "sku-1".to_string())].clone();
    assert_eq!(decode_product(&sku1.data).price, Some(200));
}

#[tokio::test]
async fn the_feed_position_does_not_go_back_after_a_redelivery() {
    let (_env, h, _storage, _mirror, feed) = redelivered_out_of_order("position-mirror").await;
    feed.wait_caught_up(&h, Duration::from_secs(30)).await;
    let last = h.changes_last_seq().await.expect("seq");
    assert_eq!(FeedStatus::get(&feed.status.position), last, "every message up to {last} handled");
}

/// Writes rounds of changes to the places: prices, and a delete and a
/// re-creation now and then.
async fn live_load(h: &Harness, places: &[i64], items: usize, rounds: usize) {
    for round in 0..rounds {
        let mut batches = Vec::new();
        for &place in places {
            let mut b =
                prices(h, place, (0..items).filter(|i| i % 4 == round % 4), 10_000 + round as i64);
            b.commands.push(Command {
                key: Some(RecordKey::new(BRAND, place, format!("sku-{}", round % items))),
                kind: CommandKind::Delete as i32,
                ..Default::default()
            });
            batches.push(b);
        }
        h.publish_batches(&format!("load-{round}"), &batches).await.expect("publish");
    }
}

#[tokio::test]
async fn a_consumer_rebuilt_from_a_keyframe_taken_under_load_has_storage_digests() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start().await;
    let places = [1, 2, 3, 4];
    let base: Vec<CommandBatch> = places.iter().map(|&p| prices(&h, p, 0..1000, 100)).collect();
    h.publish_batches("base", &base).await.expect("publish");
    h.wait_settled().await;

    let writer = {
        let h = Harness::connect(h.settings.clone()).await.expect("writer");
        tokio::spawn(async move { live_load(&h, &places, 1000, 40).await })
    };
    let first =
        shelfsync_bus::request_keyframe(&h.client, &h.subjects, None, 1, Duration::from_secs(30))
            .await
            .expect("keyframe under load");
    assert_eq!(first.len(), 1, "storage answered");
    assert!(first[0].error.is_empty(), "{}", first[0].error);
    // A new consumer bootstraps from it while the load goes on.
    let mirror = FeedMirror::default();
    let mut cfg = FeedConfig::new("rebuilt");
    cfg.request_keyframe_if_missing = false;
    let feed = RunningFeed::start(
        "rebuilt",
        ChangeFeed::new(h.client.clone(), &h.settings.nats, cfg),
        mirror.clone(),
    );
    eventually(Duration::from_secs(30), "bootstrapped", || async {
        feed.status.bootstrapped.load(Ordering::SeqCst)
    })
    .await;
    // A second keyframe under load: its markers check the rebuilt consumer.
    let second =
        shelfsync_bus::request_keyframe(&h.client, &h.subjects, None, 1, Duration::from_secs(30))
            .await
            .expect("second keyframe");
    assert!(second.first().is_some_and(|r| r.error.is_empty()), "{second:?}");
    writer.await.expect("writer");
    h.wait_settled().await;
    feed.wait_caught_up(&h, Duration::from_secs(30)).await;
    assert!(
        FeedStatus::get(&feed.status.keyframe_checks) >= places.len() as u64,
        "the markers of the second keyframe were checked"
    );
    assert_eq!(FeedStatus::get(&feed.status.drift_repairs), 0, "no drift to repair");

    // At rest: the consumer's digest = storage's = a fresh keyframe's.
    shelfsync_bus::request_keyframe(&h.client, &h.subjects, None, 1, Duration::from_secs(30))
        .await
        .expect("keyframe at rest");
    let reader = KeyframeReader::new(&h.js, h.subjects.clone()).await.expect("reader");
    let stored = h.records_of(BRAND, &places).await.expect("records");
    for p in places {
        let mut storage_digest = shelfsync_bus::digest::Digest::default();
        for ((_, place, id), r) in &stored {
            if *place == p {
                storage_digest.add(id, r.updated_at);
            }
        }
        let kf = reader.latest(BRAND, p).await.expect("read").expect("a keyframe").last;
        assert_eq!(mirror.digest(BRAND, p), storage_digest, "place {p}: consumer vs storage");
        assert_eq!(
            (kf.digest, kf.total),
            (storage_digest.sum, storage_digest.count),
            "place {p}: keyframe vs storage"
        );
    }
    feed.wait_caught_up(&h, Duration::from_secs(30)).await;
    mirror.assert_equals_storage(&h, BRAND, &places).await;
    assert_eq!(FeedStatus::get(&feed.status.drift_repairs), 0, "still no drift");
}

const STALLED_MESSAGES: usize = 40;

/// A consumer whose handler hangs (a stuck dependency) while storage keeps
/// publishing; the test reads the lag while it hangs, then lets it go.
async fn stall_consumer(name: &str, during_stall: impl AsyncFnOnce(&Harness, u64)) {
    // One change message per command message: no commands committed together.
    let Stack { h, storage: _storage, env: _env, .. } =
        Stack::start_with(|s| s.storage.read_ahead = 0).await;
    let mut model = SerialModel::new(h.settings.storage.partitions);
    let warmup = prices(&h, 1, 0..20, 100);
    model.apply(&warmup);
    h.publish_batches("warmup", &[warmup]).await.expect("publish");
    h.wait_settled().await;
    let mirror = FeedMirror::default();
    let feed = RunningFeed::tail(&h, name, mirror.clone());
    feed.wait_caught_up(&h, Duration::from_secs(30)).await;

    let stall = mirror.pause.clone().write_owned().await;
    let before = h.changes_last_seq().await.expect("seq");
    // One change message per command message, all for the stuck consumer.
    let batches: Vec<CommandBatch> = (0..STALLED_MESSAGES)
        .map(|i| prices(&h, 1 + (i as i64 % 2), [i % 20], 200 + i as i64))
        .collect();
    for b in &batches {
        model.apply(b);
    }
    h.publish_batches("stalled", &batches).await.expect("publish");
    h.wait_settled().await;
    let backlog = h.changes_last_seq().await.expect("seq") - before;
    assert_eq!(backlog, STALLED_MESSAGES as u64);
    during_stall(&h, backlog).await;
    assert!(
        FeedStatus::get(&feed.status.position) <= before + 1,
        "the consumer is stuck on its first message"
    );

    drop(stall);
    mirror.assert_mirrors(&feed, &h, &model, BRAND, &[1, 2]).await;
}

#[tokio::test]
async fn a_consumer_that_stops_acking_shows_lag_in_its_consumer_info_and_loses_nothing() {
    stall_consumer("stalled-info", async |h: &Harness, backlog: u64| {
        // Not acked = not yet delivered + delivered but not acked.
        eventually(Duration::from_secs(15), "the backlog in the consumer info", || async {
            let info = h
                .consumer_info(&h.subjects.changes_stream(), "stalled-info")
                .await
                .expect("consumer info");
            info.num_pending + info.num_ack_pending as u64 >= backlog
        })
        .await;
        // The server gives up waiting for the ack and redelivers (ack_wait
        // 5 s); the kit will drop those copies once the handler runs again.
        eventually(Duration::from_secs(15), "a redelivery of the unacked message", || async {
            h.consumer_info(&h.subjects.changes_stream(), "stalled-info")
                .await
                .is_ok_and(|i| i.num_redelivered > 0)
        })
        .await;
    })
    .await;
}

#[tokio::test]
async fn a_consumer_that_stops_acking_shows_its_lag_in_metrics() {
    stall_consumer("stalled-metric", async |_: &Harness, backlog: u64| {
        // The kit samples the gauge every 5 s.
        eventually(
            Duration::from_secs(15),
            "shelfsync_consumer_lag to show the backlog",
            || async {
                let text = shelfsync_telemetry::render_metrics();
                metric_value(&text, "shelfsync_consumer_lag", "consumer=\"stalled-metric\"")
                    .is_some_and(|lag| lag >= backlog as f64)
            },
        )
        .await;
    })
    .await;
}

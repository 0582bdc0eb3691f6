//! The ChangeFeed kit against real servers: bootstrap from a keyframe while
//! writes continue, and repair of a consumer that missed changes.

use std::time::Duration;

use shelfsync_feed::{ChangeFeed, FeedConfig, FeedStatus};
use shelfsync_tests::*;

const BRAND: i64 = 7;

/// A consumer that mirrors storage's records: the simplest possible service.
type Replica = FeedMirror;

fn start_feed(h: &Harness, name: &str, replica: Replica) -> RunningFeed {
    let feed = ChangeFeed::new(h.client.clone(), &h.settings.nats, FeedConfig::new(name));
    RunningFeed::start(name, feed, replica)
}

/// [`start_feed`], once the feed has bootstrapped.
async fn start_bootstrapped_feed(h: &Harness, name: &str, replica: Replica) -> RunningFeed {
    let running = start_feed(h, name, replica);
    eventually(Duration::from_secs(30), "bootstrapped", || async {
        running.status.bootstrapped.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    running
}

async fn write(h: &Harness, places: &[i64], items: usize, price_base: i64) {
    let mut cmds = Vec::new();
    for &p in places {
        for i in 0..items {
            cmds.push(patch(
                BRAND,
                p,
                &format!("sku-{i}"),
                &product("t", price_base + i as i64, 1),
                0,
            ));
            if cmds.len() == 500 {
                h.send(std::mem::take(&mut cmds)).await.expect("send");
            }
        }
    }
    h.send(cmds).await.expect("send");
}

#[tokio::test]
async fn bootstrap_from_a_keyframe_while_writes_continue_ends_equal_to_storage() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start().await;
    let places = [1, 2, 3, 4];
    write(&h, &places, 2500, 100).await; // 10k records
    h.wait_settled().await;

    // Writes keep coming while the consumer bootstraps.
    let writer = {
        let settings = h.settings.clone();
        tokio::spawn(async move {
            let h = Harness::connect(settings).await.expect("writer");
            for round in 0..5 {
                write(&h, &places, 400, 1000 * (round + 1)).await;
            }
        })
    };
    let replica = Replica::default();
    let running = start_feed(&h, "test-bootstrap", replica.clone());
    let status = running.status.clone();
    writer.await.expect("writer");
    h.wait_settled().await;
    eventually(Duration::from_secs(30), "the consumer caught up", || async {
        let last =
            h.js.get_stream(h.subjects.changes_stream())
                .await
                .expect("stream")
                .info()
                .await
                .map(|i| i.state.last_sequence)
                .unwrap_or(0);
        status.bootstrapped.load(std::sync::atomic::Ordering::SeqCst)
            && FeedStatus::get(&status.position) >= last
    })
    .await;
    replica.assert_equals_storage(&h, BRAND, &places).await;
    // The keyframe the consumer asked for was used, and nothing needed repair.
    assert_eq!(FeedStatus::get(&status.drift_repairs), 0);
    running.stop().await;
}

#[tokio::test]
async fn a_consumer_that_missed_changes_is_repaired_at_the_next_keyframe() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start().await;
    write(&h, &[1, 2], 300, 100).await;
    h.wait_settled().await;

    let replica = Replica::default();
    let running = start_bootstrapped_feed(&h, "test-drift", replica.clone()).await;
    // The bootstrap keyframe's markers handled before the pause: one pulled
    // but not handled when the feed stops would come back only after the
    // ack wait (30 s).
    eventually(Duration::from_secs(10), "the bootstrap's markers checked", || async {
        FeedStatus::get(&running.status.keyframe_checks) >= 2
    })
    .await;

    // Lose messages before the consumer sees them: pause the feed, write,
    // and delete the new change messages from the stream.
    let feed = running.stop().await;
    let changes_last = |h: &Harness| {
        let js = h.js.clone();
        let name = h.subjects.changes_stream();
        async move { js.get_stream(name).await.unwrap().info().await.unwrap().state.last_sequence }
    };
    let before = changes_last(&h).await;
    write(&h, &[1], 10, 5000).await;
    h.wait_settled().await;
    let last = changes_last(&h).await;
    let stream = h.js.get_stream(h.subjects.changes_stream()).await.unwrap();
    for seq in before + 1..=last {
        assert!(stream.delete_message(seq).await.unwrap(), "deleted #{seq}");
    }
    let fresh = h.get(BRAND, 1, "sku-0").await.unwrap().unwrap().updated_at;

    // Resumed, the feed never sees the lost changes: the replica is stale.
    let running = RunningFeed::start("test-drift", feed, replica.clone());
    let status = running.status.clone();
    let stale =
        || replica.records.lock().unwrap().get(&(BRAND, 1, "sku-0".into())).map(|r| r.updated_at);
    assert_ne!(stale(), Some(fresh), "the replica missed the change");

    // The next keyframe's marker reveals the drift of place 1 (only) and
    // repairs it.
    let replies =
        shelfsync_bus::request_keyframe(&h.client, &h.subjects, None, 1, Duration::from_secs(30))
            .await
            .expect("keyframe");
    assert_eq!(replies.len(), 1);
    eventually(Duration::from_secs(30), "drift repaired", || async {
        FeedStatus::get(&status.drift_repairs) == 1 && stale() == Some(fresh)
    })
    .await;
    eventually(Duration::from_secs(10), "both markers checked", || async {
        FeedStatus::get(&status.keyframe_checks) >= 4
    })
    .await;
    assert_eq!(FeedStatus::get(&status.drift_repairs), 1, "place 2 did not drift");
    replica.assert_equals_storage(&h, BRAND, &[1, 2]).await;
    running.stop().await;
}

/// A keyframe goes out while writes go on, so its marker comes later in the
/// stream than the point the keyframe was frozen at: a repair reloads the
/// keyframe and applies again what changed in between.
#[tokio::test]
async fn a_repair_keeps_what_changed_between_the_freeze_and_the_marker() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start_with(|s| {
        // 300 records a second: place 1's parts take about a second to go out.
        s.storage.keyframe_rate = 300;
    })
    .await;
    write(&h, &[1], 300, 100).await;
    h.wait_settled().await;

    let replica = Replica::default();
    let running = start_bootstrapped_feed(&h, "test-drift-live", replica.clone()).await;
    // Make the replica drift: lose a change while the feed is paused.
    let feed = running.stop().await;
    let stream = h.js.get_stream(h.subjects.changes_stream()).await.unwrap();
    let before = stream.clone().info().await.unwrap().state.last_sequence;
    write(&h, &[1], 1, 5000).await;
    h.wait_settled().await;
    let last = stream.clone().info().await.unwrap().state.last_sequence;
    for seq in before + 1..=last {
        assert!(stream.delete_message(seq).await.unwrap(), "deleted #{seq}");
    }
    let running = RunningFeed::start("test-drift-live", feed, replica.clone());
    let status = running.status.clone();

    // New records, one every 20 ms, until the keyframe is out: those
    // written between its freeze and its marker are in neither the keyframe
    // nor any change after the marker.
    let done = std::sync::atomic::AtomicBool::new(false);
    let writer = async {
        let mut n = 0usize;
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            let cmd = patch(BRAND, 1, &format!("live-{n}"), &product("t", 7, 1), 0);
            h.send(vec![cmd]).await.expect("send");
            n += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        n
    };
    let keyframe = async {
        let replies = shelfsync_bus::request_keyframe(
            &h.client,
            &h.subjects,
            None,
            1,
            Duration::from_secs(30),
        )
        .await
        .expect("keyframe");
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        replies
    };
    let (written, replies) = tokio::join!(writer, keyframe);
    assert_eq!(replies.len(), 1);
    assert!(written >= 10, "only {written} records written during the keyframe");
    h.wait_settled().await;
    eventually(Duration::from_secs(30), "drift repaired, every live record delivered", || async {
        let have = replica.records.lock().unwrap().len();
        FeedStatus::get(&status.drift_repairs) == 1 && have == 300 + written
    })
    .await;
    replica.assert_equals_storage(&h, BRAND, &[1]).await;
    running.stop().await;
}

/// With slots, each feed takes the first consumer name no other holds, and
/// one feed more than there are slots fails with an error that says why.
#[tokio::test]
async fn slotted_feeds_take_free_names_and_one_past_the_slots_is_refused_clearly() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start().await;
    write(&h, &[1], 10, 100).await;
    h.wait_settled().await;
    let slotted = || {
        let cfg = FeedConfig { slots: 2, ..FeedConfig::new("slot") };
        ChangeFeed::new(h.client.clone(), &h.settings.nats, cfg)
    };
    let (first, second) = (Replica::default(), Replica::default());
    let running = [
        RunningFeed::start("slot", slotted(), first.clone()),
        RunningFeed::start("slot", slotted(), second.clone()),
    ];
    for r in &running {
        eventually(Duration::from_secs(30), "bootstrapped", || async {
            r.status.is_bootstrapped()
        })
        .await;
    }
    let stream = h.js.get_stream(h.subjects.changes_stream()).await.expect("stream");
    let mut names: Vec<String> = futures::StreamExt::collect::<Vec<_>>(stream.consumer_names())
        .await
        .into_iter()
        .map(|n| n.expect("a name"))
        .collect();
    names.sort();
    assert_eq!(names, ["slot-0", "slot-1"]);

    let err = slotted()
        .run(&mut Replica::default(), std::future::pending())
        .await
        .expect_err("no name is free");
    assert!(err.to_string().contains("slot-0 … slot-1 are held by other instances"), "{err}");

    // Each holds its own consumer: both see every change.
    write(&h, &[1], 10, 500).await;
    h.wait_settled().await;
    let last = stream.clone().info().await.expect("info").state.last_sequence;
    for r in &running {
        eventually(Duration::from_secs(20), "every change reached each feed", || async {
            FeedStatus::get(&r.status.position) >= last
        })
        .await;
    }
    for replica in [&first, &second] {
        replica.assert_equals_storage(&h, BRAND, &[1]).await;
    }
    for r in running {
        r.stop().await.delete_consumer().await.expect("deleted");
    }
}

/// A replica that stops hands back what it had pulled and not handled: the
/// replicas sharing its consumer get it at once, not after the ack wait.
#[tokio::test]
async fn a_stopping_replica_hands_back_the_messages_it_holds() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start().await;
    let shared = || {
        let cfg = FeedConfig {
            bootstrap: shelfsync_feed::Bootstrap::Resume,
            ack_wait: Duration::from_secs(120),
            ..FeedConfig::new("shared")
        };
        ChangeFeed::new(h.client.clone(), &h.settings.nats, cfg)
    };
    let (first, second) = (Replica::default(), Replica::default());
    let running = RunningFeed::start("shared", shared(), first.clone());
    eventually(Duration::from_secs(30), "the consumer created", || async {
        running.status.is_bootstrapped()
    })
    .await;
    // The first replica's handler hangs while 40 change messages arrive.
    let paused = first.pause.clone().write_owned().await;
    let places: Vec<i64> = (1..=40).collect();
    write(&h, &places, 1, 100).await;
    h.wait_settled().await;
    let stream = h.js.get_stream(h.subjects.changes_stream()).await.expect("stream");
    eventually(Duration::from_secs(10), "every message delivered to the first replica", || async {
        let info = stream.clone().consumer_info("shared").await.expect("consumer");
        info.num_ack_pending == 40
    })
    .await;
    let stopping = tokio::spawn(running.stop());
    drop(paused);
    stopping.await.expect("the first replica stops");
    let handled = first.records.lock().expect("lock").len();
    assert!(handled < 40, "the first replica held messages it did not handle ({handled})");

    // Well inside the ack wait, the second replica has the rest.
    let running = RunningFeed::start("shared", shared(), second.clone());
    eventually(Duration::from_secs(20), "every change handled by one replica or the other", || {
        let (first, second) = (first.clone(), second.clone());
        async move {
            let mut all = first.records.lock().expect("lock").clone();
            all.extend(second.records.lock().expect("lock").clone());
            all.len() == 40
        }
    })
    .await;
    running.stop().await;
}

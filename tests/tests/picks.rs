//! The example service ("discounted picks") on a small known dataset, end to
//! end: storage → change stream → ChangeFeed kit → HTTP; and two replicas
//! of it, each with the whole state.

use std::time::Duration;

use shelfsync_feed::FeedStatus;
use shelfsync_proto::Product;
use shelfsync_tests::*;

fn offer(price: i64, old_price: Option<i64>, stock: i64) -> Product {
    Product {
        title: Some("t".into()),
        price: Some(price),
        old_price,
        stock: Some(stock),
        ..Default::default()
    }
}

#[tokio::test]
async fn picks_follow_the_change_stream() {
    let Stack { h, storage: _storage, settings, env: _env } = Stack::start().await;
    h.send(vec![
        patch(7, 1, "deep", &offer(30, Some(100), 2), 0),
        patch(7, 1, "shallow", &offer(90, Some(100), 2), 0),
        patch(7, 1, "full-price", &offer(100, None, 2), 0),
        patch(7, 1, "sold-out", &offer(10, Some(100), 0), 0),
        patch(7, 2, "elsewhere", &offer(10, Some(20), 1), 0),
    ])
    .await
    .expect("send");
    h.wait_settled().await;

    let app = shelfsync_picks::App::build(settings, "127.0.0.1:0").await.expect("picks builds");
    let addr = app.http_addr();
    let service = spawn(app);
    let ids = |body: &str| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        v.as_array()
            .expect("array")
            .iter()
            .map(|p| p["product_id"].as_str().unwrap_or("").to_string())
            .collect()
    };
    eventually(Duration::from_secs(20), "picks bootstrapped", || async {
        http_get(addr, "/readyz").await.is_ok_and(|(s, _)| s == 200)
    })
    .await;
    let (_, body) = http_get(addr, "/v1/picks/7/1").await.expect("get");
    assert_eq!(ids(&body), ["deep", "shallow"]);

    // Live: the deep discount sells out, the sold-out one is restocked.
    h.send(vec![
        patch(7, 1, "deep", &Product { stock: Some(0), ..Default::default() }, 0),
        patch(7, 1, "sold-out", &Product { stock: Some(5), ..Default::default() }, 0),
    ])
    .await
    .expect("send");
    eventually(Duration::from_secs(20), "picks updated", || async {
        let (_, body) = http_get(addr, "/v1/picks/7/1").await.expect("get");
        ids(&body) == ["sold-out", "shallow"]
    })
    .await;
    let (_, body) = http_get(addr, "/v1/picks/7/2").await.expect("get");
    assert_eq!(ids(&body), ["elsewhere"]);
    service.stop().await.expect("service stops cleanly");
}

/// The offer `round` makes of product `i`: prices and stock move each
/// round, so picks come and go (stock 0 or no discount: no pick).
fn churned(round: i64, i: i64) -> Product {
    let price = 40 + (round * 7 + i * 13) % 60;
    offer(price, Some(if (round + i) % 4 == 0 { price } else { 100 }), (round + i) % 3)
}

/// Sends one round of changes: every product of every place, one command
/// message per partition.
async fn send_round(h: &Harness, places: &[(i64, i64)], round: i64) {
    let mut commands = Vec::new();
    for &(brand, place) in places {
        for i in 0..6 {
            commands.push(patch(brand, place, &format!("p{i}"), &churned(round, i), 0));
        }
    }
    h.send(commands).await.expect("send");
}

/// What a replica must serve: the picks of every record storage holds.
async fn picks_of_storage(h: &Harness, places: &[(i64, i64)]) -> Vec<Vec<shelfsync_picks::Pick>> {
    use shelfsync_feed::Handler as _;
    let mut truth = shelfsync_picks::Picks::default();
    for &(brand, place) in places {
        let records = h.records_of(brand, &[place]).await.expect("records");
        let updates: Vec<_> =
            records.into_values().filter_map(shelfsync_feed::Update::from_snapshot).collect();
        truth.apply(&updates).await.expect("apply");
    }
    places.iter().map(|&p| truth.of_place(p.into())).collect()
}

/// Two replicas of picks, as a Deployment runs them: the same program, the
/// same host name and the same process id (this test's: two containers are
/// both PID 1), started one after the other. Each must hold every pick of
/// every place — the same as the other's, the same as storage's — through
/// live changes, a keyframe, and live changes after it; each reads through
/// a consumer of its own; each serves the kit's feed metrics. With
/// consumers named after the process id the replicas share one consumer
/// and split its messages (and the keyframe markers): both end with holes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_each_hold_every_pick_through_live_changes_and_a_keyframe() {
    let Stack { h, storage: _storage, settings, env: _env } = Stack::start().await;
    let places = [(7, 1), (7, 2), (8, 3)];
    send_round(&h, &places, 0).await;
    h.wait_settled().await;

    let mut replicas = Vec::new();
    for _ in 0..2 {
        let app =
            shelfsync_picks::App::build(settings.clone(), "127.0.0.1:0").await.expect("picks");
        let (addr, picks, status, consumer) =
            (app.http_addr(), app.picks(), app.status(), app.consumer().to_string());
        let running = spawn(app);
        eventually(Duration::from_secs(20), "a replica bootstrapped", || async {
            http_get(addr, "/readyz").await.is_ok_and(|(s, _)| s == 200)
        })
        .await;
        replicas.push((addr, picks, status, consumer, running));
    }

    for round in 1..=4 {
        send_round(&h, &places, round).await;
    }
    let replies =
        shelfsync_bus::request_keyframe(&h.client, &h.subjects, None, 1, Duration::from_secs(30))
            .await
            .expect("keyframe");
    assert_eq!(replies.len(), 1, "{replies:?}");
    eventually(SETTLE, "every replica to check every place's marker", || async {
        replicas.iter().all(|r| FeedStatus::get(&r.2.keyframe_checks) >= places.len() as u64)
    })
    .await;
    for round in 5..=8 {
        send_round(&h, &places, round).await;
    }
    h.wait_settled().await;

    let truth = picks_of_storage(&h, &places).await;
    assert!(truth.iter().all(|p| !p.is_empty()), "every place has picks: {truth:?}");
    for (addr, picks, _, consumer, _) in &replicas {
        eventually(Duration::from_secs(20), "a replica to hold every pick", || async {
            places.iter().zip(&truth).all(|(&p, want)| &picks.of_place(p.into()) == want)
        })
        .await;
        // What a client sees is that too.
        for (&(b, p), want) in places.iter().zip(&truth) {
            let (_, body) = http_get(*addr, &format!("/v1/picks/{b}/{p}")).await.expect("get");
            let got: Vec<serde_json::Value> = serde_json::from_str(&body).expect("json");
            let ids: Vec<&str> = got.iter().filter_map(|v| v["product_id"].as_str()).collect();
            let wanted: Vec<&str> = want.iter().map(|p| p.product_id.as_str()).collect();
            assert_eq!(ids, wanted, "{consumer}: /v1/picks/{b}/{p}");
        }
    }
    for r in &replicas {
        assert_eq!(FeedStatus::get(&r.2.drift_repairs), 0, "{}: nothing drifted", r.3);
    }

    // Each replica reads through a consumer of its own: the same host part,
    // another random part.
    let (a, b) = (replicas[0].3.clone(), replicas[1].3.clone());
    assert_ne!(a, b, "the replicas share a consumer");
    let host_part = |n: &str| n.rsplit_once('-').map(|(h, _)| h.to_string());
    assert_eq!(host_part(&a), host_part(&b));
    assert!(a.starts_with("picks-"), "{a}");
    let mut on_server = consumers_of_changes(&h).await;
    on_server.sort();
    let mut ours = vec![a.clone(), b.clone()];
    ours.sort();
    assert_eq!(on_server, ours);

    // The kit's counters, as a scrape of a replica shows them.
    let (addr, _, status, _, _) = &replicas[0];
    let (_, text) = http_get(*addr, "/metrics").await.expect("metrics");
    let delivered = metric_value(&text, "shelfsync_feed_delivered_total", "");
    assert_eq!(delivered, Some(FeedStatus::get(&status.delivered) as f64), "{text}");
    assert!(delivered.is_some_and(|d| d > 0.0));
    assert!(metric_value(&text, "shelfsync_feed_position", "").is_some_and(|p| p > 0.0), "{text}");
    assert!(metric_value(&text, "shelfsync_feed_duplicates_total", "").is_some(), "{text}");

    // A replica that stops deletes its consumer; the other keeps its own.
    let (_, _, _, first, running) = replicas.remove(0);
    running.stop().await.expect("the first replica stops cleanly");
    assert_eq!(consumers_of_changes(&h).await, [b], "{first} was deleted");
    let (_, _, _, _, running) = replicas.remove(0);
    running.stop().await.expect("the second replica stops cleanly");
    assert!(consumers_of_changes(&h).await.is_empty());
}

/// The names of the consumers on the CHANGES stream, as the server has them.
async fn consumers_of_changes(h: &Harness) -> Vec<String> {
    use futures::TryStreamExt;
    let stream = h.js.get_stream(h.subjects.changes_stream()).await.expect("stream");
    stream.consumer_names().try_collect().await.expect("consumer names")
}

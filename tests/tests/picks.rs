//! The example service ("discounted picks") on a small known dataset, end to
//! end: storage → change stream → ChangeFeed kit → HTTP.

use std::time::Duration;

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

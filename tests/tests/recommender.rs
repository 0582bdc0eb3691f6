//! The recommender end to end against real servers: storage → keyframe and
//! change stream → ChangeFeed kit → index → HTTP and NATS answers, checked
//! against a brute-force ranking of storage's own records after a mixed
//! workload (creates, price changes, sell-outs, restocks, hides, category
//! moves, a full import with its sweep, deletes, a new place).

use std::time::Duration;

use futures::StreamExt;
use prost::Message;
use shelfsync_feed::FeedStatus;
use shelfsync_proto::{
    Command, CommandKind, Origin, Product, Record, RecordKey, RecordState, TopReply, TopRequest,
};
use shelfsync_recommender::App;
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACES: [i64; 4] = [1, 2, 3, 4];
const CATEGORIES: [&str; 3] = ["roses", "tulips", "lilies"];
/// `recommender.max_top_n` in this test: above any place's offer count, so
/// a query at the maximum compares whole rankings.
const MAX_TOP: usize = 200;

/// One answer, whichever way it came.
#[derive(Debug, Clone, PartialEq)]
struct Item {
    product_id: String,
    category: String,
    price: i64,
    old_price: Option<i64>,
    stock: i64,
    discount: f64,
}

/// Equal, allowing JSON's float parsing its last bit.
fn same(a: &[Item], b: &[Item]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            (&x.product_id, &x.category, x.price, x.old_price, x.stock)
                == (&y.product_id, &y.category, y.price, y.old_price, y.stock)
                && (x.discount - y.discount).abs() < 1e-12
        })
}

/// The ranking, from first principles over storage's records: offered
/// (present, not deleted, not hidden, stock > 0) with a positive price;
/// deepest discount in whole basis points first, then stock, then id.
fn brute_force(
    records: &[Record],
    category: Option<&str>,
    limit: usize,
    exclude: &[String],
) -> Vec<Item> {
    let mut ranked: Vec<(i128, Item)> = records
        .iter()
        .filter_map(|r| {
            let id = r.key.as_ref().expect("key").product_id.clone();
            let state = RecordState::decode(r.state.as_slice()).expect("state");
            let p = Product::decode(r.data.as_slice()).expect("data");
            let (price, stock) = (p.price?, p.stock?);
            let offered = !r.absent && !r.deleted && state.hidden != Some(true) && stock > 0;
            if !offered || price <= 0 || exclude.contains(&id) {
                return None;
            }
            let cat = p.category.unwrap_or_default();
            if category.is_some_and(|c| c != cat) {
                return None;
            }
            let (bp, discount) = match p.old_price {
                Some(old) if old > price => (
                    i128::from(old - price) * 10_000 / i128::from(old),
                    (old - price) as f64 / old as f64,
                ),
                _ => (0, 0.0),
            };
            let item = Item {
                product_id: id,
                category: cat,
                price,
                old_price: p.old_price,
                stock,
                discount,
            };
            Some((bp, item))
        })
        .collect();
    ranked.sort_by(|(ba, a), (bb, b)| {
        bb.cmp(ba).then(b.stock.cmp(&a.stock)).then(a.product_id.cmp(&b.product_id))
    });
    ranked.into_iter().take(limit).map(|(_, i)| i).collect()
}

fn http_path(
    place: i64,
    category: Option<&str>,
    limit: Option<usize>,
    exclude: &[String],
) -> String {
    let mut params = Vec::new();
    if let Some(c) = category {
        params.push(format!("category={c}"));
    }
    if let Some(n) = limit {
        params.push(format!("limit={n}"));
    }
    if !exclude.is_empty() {
        params.push(format!("exclude={}", exclude.join(",")));
    }
    format!("/v1/top/{BRAND}/{place}?{}", params.join("&"))
}

async fn via_http(
    addr: std::net::SocketAddr,
    place: i64,
    category: Option<&str>,
    limit: Option<usize>,
    exclude: &[String],
) -> Result<Vec<Item>, String> {
    let path = http_path(place, category, limit, exclude);
    let (status, body) = http_get(addr, &path).await.map_err(|e| format!("GET {path}: {e}"))?;
    if status != 200 {
        return Err(format!("GET {path}: {status} {body}"));
    }
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
    let items = v.as_array().ok_or_else(|| format!("not a list: {body}"))?;
    Ok(items
        .iter()
        .map(|i| Item {
            product_id: i["product_id"].as_str().unwrap_or_default().into(),
            category: i["category"].as_str().unwrap_or_default().into(),
            price: i["price"].as_i64().unwrap_or(-1),
            old_price: i["old_price"].as_i64(),
            stock: i["stock"].as_i64().unwrap_or(-1),
            discount: i["discount"].as_f64().unwrap_or(-1.0),
        })
        .collect())
}

async fn request(h: &Harness, req: TopRequest) -> Result<TopReply, String> {
    let msg = h
        .client
        .request(h.subjects.recommend_top(), req.encode_to_vec().into())
        .await
        .map_err(|e| format!("request: {e}"))?;
    TopReply::decode(msg.payload.as_ref()).map_err(|e| e.to_string())
}

async fn via_nats(
    h: &Harness,
    place: i64,
    category: Option<&str>,
    limit: Option<usize>,
    exclude: &[String],
) -> Result<Vec<Item>, String> {
    let req = TopRequest {
        brand_id: BRAND,
        place_id: place,
        category: category.map(String::from),
        limit: limit.unwrap_or(0) as u32,
        exclude: exclude.to_vec(),
    };
    let reply = request(h, req).await?;
    if !reply.error.is_empty() {
        return Err(reply.error);
    }
    Ok(reply
        .items
        .into_iter()
        .map(|r| Item {
            product_id: r.product_id,
            category: r.category,
            price: r.price,
            old_price: r.old_price,
            stock: r.stock,
            discount: r.discount,
        })
        .collect())
}

/// Compares every (place, category) and every place without a category, by
/// HTTP and by NATS, at the default limit, at the maximum (whole rankings)
/// and with exclusions; returns the first difference, or how many offers
/// storage has on offer.
async fn compare_all(h: &Harness, addr: std::net::SocketAddr) -> Result<usize, String> {
    let mut offered = 0;
    for place in PLACES {
        let records = h
            .store
            .place_records(h.settings.storage.partitions, (BRAND, place).into())
            .await
            .map_err(|e| e.to_string())?;
        offered += brute_force(&records, None, usize::MAX, &[]).len();
        let categories =
            [None, Some(""), Some(CATEGORIES[0]), Some(CATEGORIES[1]), Some(CATEGORIES[2])];
        for category in categories {
            // An empty category asks for every category, as none does.
            let filter = category.filter(|c| !c.is_empty());
            let full = brute_force(&records, filter, MAX_TOP, &[]);
            // Leave out the first and third of the ranking, and an unknown id.
            let exclude: Vec<String> = full
                .iter()
                .step_by(2)
                .take(2)
                .map(|i| i.product_id.clone())
                .chain(["no-such-sku".to_string()])
                .collect();
            let cases: [(Option<usize>, &[String]); 3] =
                [(None, &[]), (Some(MAX_TOP), &[]), (Some(5), &exclude)];
            for (limit, exclude) in cases {
                let want = brute_force(&records, filter, limit.unwrap_or(10), exclude);
                let by_http = via_http(addr, place, category, limit, exclude).await?;
                let by_nats = via_nats(h, place, category, limit, exclude).await?;
                for (how, got) in [("HTTP", by_http), ("NATS", by_nats)] {
                    if !same(&got, &want) {
                        return Err(format!(
                            "{how} place {place} category {category:?} limit {limit:?} \
                             exclude {exclude:?}:\n got  {got:?}\n want {want:?}"
                        ));
                    }
                }
            }
        }
    }
    Ok(offered)
}

/// Waits until the recommender has handled the last change message, then
/// until its answers match storage (the last message may still be applying).
async fn assert_matches_storage(
    h: &Harness,
    addr: std::net::SocketAddr,
    status: &FeedStatus,
) -> usize {
    let mut stream = h.js.get_stream(h.subjects.changes_stream()).await.expect("changes stream");
    let last = stream.info().await.expect("stream info").state.last_sequence;
    eventually(Duration::from_secs(30), "the recommender to reach the last change", || async {
        FeedStatus::get(&status.position) >= last
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match compare_all(h, addr).await {
            Ok(offered) => return offered,
            Err(diff) if tokio::time::Instant::now() > deadline => {
                panic!("recommender disagrees with storage: {diff}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

fn sku(i: usize) -> String {
    format!("sku-{i:02}")
}

/// A product with many ties in discount and stock; some sold out, some
/// without a category or an old price.
fn initial(place: i64, i: usize) -> Product {
    Product {
        title: Some(format!("item {i}")),
        category: (i % 13 != 5).then(|| CATEGORIES[i % 3].to_string()),
        price: Some([50, 80, 100, 120][i % 4] + place),
        old_price: [None, Some(100 + place), Some(200)][(i / 3) % 3],
        stock: Some([0, 1, 2, 5][(i / 2) % 4]),
        currency: Some("RUB".into()),
        ..Default::default()
    }
}

fn origin() -> Option<Origin> {
    Some(Origin { source: "test".into(), ..Default::default() })
}

fn hide(place: i64, id: &str, hidden: bool) -> Command {
    Command {
        key: Some(RecordKey::new(BRAND, place, id)),
        kind: CommandKind::Patch as i32,
        state: RecordState { hidden: Some(hidden), ..Default::default() }.encode_to_vec(),
        origin: origin(),
        ..Default::default()
    }
}

fn delete(place: i64, id: &str) -> Command {
    Command {
        key: Some(RecordKey::new(BRAND, place, id)),
        kind: CommandKind::Delete as i32,
        origin: origin(),
        ..Default::default()
    }
}

fn data(f: impl FnOnce(&mut Product)) -> Product {
    let mut p = Product::default();
    f(&mut p);
    p
}

#[tokio::test]
async fn recommender_answers_match_a_brute_force_ranking_of_storage() {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    settings.recommender.http_listen = "127.0.0.1:0".into();
    settings.recommender.max_top_n = MAX_TOP;
    let h = Harness::connect(settings.clone()).await.expect("harness");

    // Storage is not running yet: the recommender's request for a keyframe
    // is caught here, so its bootstrap provably cannot finish until we say.
    let mut ctl = h.client.subscribe(h.subjects.ctl_keyframe()).await.expect("subscribe");
    h.client.flush().await.expect("flush");
    let app = App::build(settings.clone()).await.expect("recommender");
    let addr = app.http_addr();
    let status = app.status();
    let service = spawn(app);
    let asked = tokio::time::timeout(Duration::from_secs(30), ctl.next())
        .await
        .expect("the recommender asks for a keyframe")
        .expect("subscription open");
    let reply_to = asked.reply.expect("a keyframe request has a reply subject");
    ctl.unsubscribe().await.expect("unsubscribe");

    assert_eq!(http_get(addr, "/healthz").await.expect("healthz").0, 200);
    assert_eq!(http_get(addr, "/readyz").await.expect("readyz").0, 503, "ready before bootstrap");
    let (code, body) = http_get(addr, "/v1/top/7/1").await.expect("top");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("not ready"), "{body}");
    assert!(
        request(&h, TopRequest { brand_id: BRAND, place_id: 1, ..Default::default() })
            .await
            .is_err(),
        "no replica may answer over NATS before bootstrap"
    );

    // Before the keyframe: a full import of place 1, deltas for 2 and 3.
    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    let g1 = now_us();
    let mut cmds = Vec::new();
    for place in [1, 2, 3] {
        let generation = if place == 1 { g1 } else { 0 };
        for i in 0..36 {
            cmds.push(patch(BRAND, place, &sku(i), &initial(place, i), generation));
        }
    }
    h.send(cmds).await.expect("send");
    h.send_sweep(BRAND, 1, g1).await.expect("sweep");
    h.wait_settled().await;

    // Now storage answers the keyframe request on the recommender's behalf.
    let replies =
        shelfsync_bus::request_keyframe(&h.client, &h.subjects, None, 1, Duration::from_secs(60))
            .await
            .expect("keyframe");
    assert_eq!(replies.len(), 1, "one storage replica");
    assert!(replies[0].error.is_empty(), "keyframe failed: {}", replies[0].error);
    h.client.publish(reply_to, replies[0].encode_to_vec().into()).await.expect("forward");
    h.client.flush().await.expect("flush");
    eventually(Duration::from_secs(30), "the recommender to become ready", || async {
        http_get(addr, "/readyz").await.is_ok_and(|(s, _)| s == 200)
    })
    .await;
    let offered = assert_matches_storage(&h, addr, &status).await;
    assert!(offered > 40, "the initial data offers something ({offered})");

    // Live: every kind of transition.
    let mut cmds = Vec::new();
    for i in 0..36 {
        let id = sku(i);
        if i % 5 == 0 {
            // Deeper discount.
            cmds.push(patch(
                BRAND,
                2,
                &id,
                &data(|p| {
                    p.price = Some(40 + i as i64);
                    p.old_price = Some(200);
                }),
                0,
            ));
        }
        if i % 7 == 1 {
            // No discount any more.
            cmds.push(patch(
                BRAND,
                3,
                &id,
                &data(|p| {
                    p.price = Some(90);
                    p.old_price = Some(90);
                }),
                0,
            ));
        }
        if i % 4 == 1 {
            cmds.push(patch(BRAND, 3, &id, &data(|p| p.stock = Some(0)), 0)); // sold out
        }
        if i % 8 < 2 {
            cmds.push(patch(BRAND, 1, &id, &data(|p| p.stock = Some(7)), 0)); // restocked
        }
        if i % 6 == 3 {
            cmds.push(hide(2, &id, true));
        }
        if i % 6 == 2 {
            let next = CATEGORIES[(i + 1) % 3].to_string();
            cmds.push(patch(BRAND, 3, &id, &data(|p| p.category = Some(next)), 0)); // moved
        }
        if i % 9 == 4 {
            cmds.push(delete(2, &id));
        }
    }
    cmds.push(hide(2, &sku(9), false)); // hidden above, shown again
    for i in 36..44 {
        cmds.push(patch(BRAND, 2, &sku(i), &initial(2, i), 0)); // created
    }
    for i in 0..10 {
        cmds.push(patch(BRAND, 4, &sku(i), &initial(4, i + 1), 0)); // a new place
    }
    h.send(cmds).await.expect("send");
    // A second full import of place 1 without every fourth item: swept.
    let g2 = now_us();
    let reimport: Vec<Command> = (0..36)
        .filter(|i| i % 4 != 0)
        .map(|i| patch(BRAND, 1, &sku(i), &initial(1, i), g2))
        .collect();
    h.send(reimport).await.expect("send");
    h.send_sweep(BRAND, 1, g2).await.expect("sweep");
    h.wait_settled().await;

    // The workload really did all of that.
    let swept = h.get(BRAND, 1, &sku(4)).await.expect("get").expect("record");
    assert!(swept.absent, "sku-04 of place 1 was swept");
    let deleted = h.get(BRAND, 2, &sku(4)).await.expect("get").expect("record");
    assert!(deleted.deleted, "sku-04 of place 2 was deleted");
    let offered = assert_matches_storage(&h, addr, &status).await;
    assert!(offered > 40, "the final data offers something ({offered})");

    // Bad input: explained, over HTTP and NATS.
    let (code, body) =
        http_get(addr, &format!("/v1/top/7/1?limit={}", MAX_TOP + 1)).await.expect("get");
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("over the maximum"), "{body}");
    let (code, body) = http_get(addr, "/v1/top/seven/1").await.expect("get");
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("brand must be an integer"), "{body}");
    let (code, body) = http_get(addr, "/v1/top/7/1?exclude=a,,b").await.expect("get");
    assert_eq!(code, 400, "{body}");
    let reply = request(
        &h,
        TopRequest {
            brand_id: BRAND,
            place_id: 1,
            limit: MAX_TOP as u32 + 1,
            ..Default::default()
        },
    )
    .await
    .expect("reply");
    assert!(reply.error.contains("over the maximum"), "{reply:?}");
    assert!(reply.items.is_empty());
    let (code, metrics) = http_get(addr, "/metrics").await.expect("metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains(&format!("shelfsync_recommender_offers {offered}")), "{metrics}");

    tokio::time::timeout(Duration::from_secs(20), service.stop())
        .await
        .expect("the recommender stops in time")
        .expect("the recommender stops cleanly");
    storage.stop().await.expect("storage stops");
}

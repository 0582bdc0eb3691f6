//! The aggregator against real servers: storage in-process publishes
//! changes, the aggregator (its App, in-process) keeps master cards and the
//! category cache in Redis, publishes `AggregateChange`s and serves HTTP.

use std::time::Duration;

use prost::Message;
use shelfsync_aggregator::aggregate::CardId;
use shelfsync_aggregator::{Aggregator, App, Config};
use shelfsync_feed::{Handler, PlaceKey, Update, UpdateKind};
use shelfsync_proto::{
    AggregateChange, Command, CommandKind, Origin, Product, Record, RecordKey, RecordState,
};
use shelfsync_settings::{PlaceRegion, Settings};
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const WAIT: Duration = Duration::from_secs(30);
const NORTH: &str = "north";

/// The aggregator's part of the settings: places 7/1, 7/2, 7/3 and 8/1 in
/// the north, no default region, a port of its own.
fn aggregator_settings(s: &mut Settings) {
    s.aggregator.http_listen = "127.0.0.1:0".into();
    let north = |brand_id, place_id| PlaceRegion { brand_id, place_id, region: NORTH.into() };
    s.aggregator.places = vec![north(7, 1), north(7, 2), north(7, 3), north(8, 1)];
    s.aggregator.default_region = None;
}

/// A [`Stack`] with [`aggregator_settings`], and the aggregator's App on it.
async fn start_aggregating() -> (Stack, RunningAggregator) {
    let stack = Stack::start_with(aggregator_settings).await;
    let agg = RunningAggregator::start(&stack.settings).await;
    (stack, agg)
}

/// Servers, a harness and an aggregator in this test (no storage: the test
/// applies updates itself).
async fn connected_aggregator() -> (TestEnv, Settings, Harness, Aggregator) {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    aggregator_settings(&mut settings);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let config = Config::from(&settings);
    let agg = Aggregator::connect(&config, h.client.clone()).await.expect("aggregator");
    (env, settings, h, agg)
}

/// A card as the HTTP API shows it: `(min_price, offers, cheapest place)`.
type CardView = (Option<i64>, u64, Option<(i64, i64)>);

/// The aggregator App running in this process.
struct RunningAggregator {
    addr: std::net::SocketAddr,
    running: Running,
}

impl RunningAggregator {
    async fn start(settings: &Settings) -> RunningAggregator {
        let app = App::build(settings.clone()).await.expect("aggregator builds");
        let addr = app.http_addr();
        let running = spawn(app);
        let (status, _) = http_get(addr, "/healthz").await.expect("healthz");
        assert_eq!(status, 200);
        eventually(WAIT, "the aggregator bootstrapped", || async {
            http_get(addr, "/readyz").await.is_ok_and(|(s, _)| s == 200)
        })
        .await;
        RunningAggregator { addr, running }
    }

    async fn stop(self) {
        self.running.stop().await.expect("the aggregator stops cleanly");
    }

    /// The card over HTTP: `(min_price, offers, cheapest place)`, `None` on 404.
    async fn card(&self, product: &str) -> Option<CardView> {
        let (status, body) =
            http_get(self.addr, &format!("/v1/cards/{NORTH}/{product}")).await.expect("get card");
        match status {
            404 => None,
            200 => {
                let v: serde_json::Value = serde_json::from_str(&body).expect("json");
                assert_eq!(v["region"], NORTH);
                assert_eq!(v["product_id"], product);
                let cheapest = v["cheapest"].as_object().map(|k| {
                    assert_eq!(k["product_id"], product);
                    (k["brand_id"].as_i64().expect("brand"), k["place_id"].as_i64().expect("place"))
                });
                Some((v["min_price"].as_i64(), v["offers"].as_u64().expect("offers"), cheapest))
            }
            other => panic!("GET card: {other} {body}"),
        }
    }

    async fn categories(&self, brand: i64, place: i64) -> Vec<String> {
        let (status, body) = http_get(self.addr, &format!("/v1/places/{brand}/{place}/categories"))
            .await
            .expect("get categories");
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).expect("json list")
    }

    async fn wait_card(&self, product: &str, want: Option<CardView>) {
        eventually(WAIT, &format!("card {product} to be {want:?}"), || async {
            self.card(product).await == want
        })
        .await;
    }

    async fn wait_categories(&self, brand: i64, place: i64, want: &[&str]) {
        eventually(WAIT, &format!("categories of {brand}/{place} to be {want:?}"), || async {
            self.categories(brand, place).await == want
        })
        .await;
    }
}

type CardEvent = (Option<i64>, u32, Option<(i64, i64)>);

async fn aggregate_changes(h: &Harness) -> Vec<AggregateChange> {
    h.read_stream(&h.subjects.aggregates_stream())
        .await
        .expect("read the aggregates stream")
        .iter()
        .map(|b| AggregateChange::decode(b.as_slice()).expect("an AggregateChange"))
        .collect()
}

fn card_events(changes: &[AggregateChange], product: &str) -> Vec<CardEvent> {
    changes
        .iter()
        .filter_map(|c| c.card.as_ref())
        .filter(|c| c.product_id == product && c.region == NORTH)
        .map(|c| (c.min_price, c.offers, c.cheapest.as_ref().map(|k| (k.brand_id, k.place_id))))
        .collect()
}

fn flips(changes: &[AggregateChange], brand: i64, place: i64) -> Vec<(String, bool)> {
    changes
        .iter()
        .filter_map(|c| c.category.as_ref())
        .filter(|f| (f.brand_id, f.place_id) == (brand, place))
        .map(|f| (f.category.clone(), f.non_empty))
        .collect()
}

fn offer(price: i64, stock: i64, category: &str) -> Product {
    Product { category: Some(category.into()), ..product("t", price, stock) }
}

fn stock(n: i64) -> Product {
    Product { stock: Some(n), ..Default::default() }
}

fn hide(brand: i64, place: i64, id: &str) -> Command {
    let state = RecordState {
        hidden: Some(true),
        reasons: vec!["test".into()],
        decided_by: Some("test".into()),
        ..Default::default()
    };
    Command {
        key: Some(RecordKey::new(brand, place, id)),
        kind: CommandKind::Patch as i32,
        state: state.encode_to_vec(),
        origin: Some(Origin { source: "test".into(), ..Default::default() }),
        ..Default::default()
    }
}

fn delete(brand: i64, place: i64, id: &str) -> Command {
    Command {
        key: Some(RecordKey::new(brand, place, id)),
        kind: CommandKind::Delete as i32,
        origin: Some(Origin { source: "test".into(), ..Default::default() }),
        ..Default::default()
    }
}

#[tokio::test]
async fn the_minimum_moves_to_the_next_offer_and_the_last_one_retracts_the_card() {
    let (Stack { h, storage: _storage, env: _env, .. }, agg) = start_aggregating().await;

    // Place 3 comes from a full import (generation 1000), so a later import
    // without the rose sweeps it.
    h.send(vec![
        patch(7, 1, "rose", &offer(100, 5, "roses"), 0),
        patch(7, 2, "rose", &offer(200, 5, "roses"), 0),
        patch(7, 3, "rose", &offer(300, 5, "roses"), 1000),
        patch(8, 1, "rose", &offer(400, 5, "roses"), 0),
    ])
    .await
    .expect("send");
    agg.wait_card("rose", Some((Some(100), 4, Some((7, 1))))).await;
    let mark = aggregate_changes(&h).await.len();

    // Out of stock.
    h.send(vec![patch(7, 1, "rose", &stock(0), 0)]).await.expect("send");
    agg.wait_card("rose", Some((Some(200), 3, Some((7, 2))))).await;
    // Hidden by a validator.
    h.send(vec![hide(7, 2, "rose")]).await.expect("send");
    agg.wait_card("rose", Some((Some(300), 2, Some((7, 3))))).await;
    // Swept: a full import of place 3 without the rose.
    h.send(vec![patch(7, 3, "tulip", &offer(50, 5, "tulips"), 2000)]).await.expect("send");
    h.send_sweep(7, 3, 2000).await.expect("sweep");
    agg.wait_card("rose", Some((Some(400), 1, Some((8, 1))))).await;
    assert!(h.get(7, 3, "rose").await.expect("get").expect("record").absent, "swept");
    // Deleted: nothing qualifies any more.
    h.send(vec![delete(8, 1, "rose")]).await.expect("send");
    agg.wait_card("rose", None).await;

    let changes = aggregate_changes(&h).await;
    assert_eq!(
        card_events(&changes[mark..], "rose"),
        [
            (Some(200), 3, Some((7, 2))),
            (Some(300), 2, Some((7, 3))),
            (Some(400), 1, Some((8, 1))),
            (None, 0, None),
        ]
    );
    let last = changes.iter().rev().find_map(|c| c.card.clone()).expect("a card event");
    assert_eq!(last.currency, None, "a retracted card has no currency");
    assert!(changes[mark..].iter().all(|c| c.at > 0), "events carry when they changed");
    // A card of another region is a different card.
    let (status, _) = http_get(agg.addr, "/v1/cards/south/rose").await.expect("get");
    assert_eq!(status, 404);
    agg.stop().await;
}

#[tokio::test]
async fn nothing_is_published_when_no_aggregate_changes() {
    let (Stack { h, storage: _storage, env: _env, .. }, agg) = start_aggregating().await;
    h.send(vec![
        patch(7, 1, "rose", &offer(100, 5, "roses"), 0),
        patch(7, 2, "rose", &offer(200, 5, "roses"), 0),
    ])
    .await
    .expect("send");
    agg.wait_card("rose", Some((Some(100), 2, Some((7, 1))))).await;
    agg.wait_categories(7, 2, &["roses"]).await;
    let mark = aggregate_changes(&h).await.len();

    // A new title on the pricier offer, 5 → 4 in stock on the cheapest: real
    // changes of records, none of any aggregate.
    h.send(vec![
        patch(7, 2, "rose", &Product { title: Some("Red roses".into()), ..Default::default() }, 0),
        patch(7, 1, "rose", &stock(4), 0),
    ])
    .await
    .expect("send");
    // Then, on the same places (so in order after them), changes that do
    // publish: once they are visible, the ones before were aggregated.
    h.send(vec![
        patch(7, 1, "lily", &offer(70, 1, "roses"), 0),
        patch(7, 2, "lily", &offer(60, 1, "roses"), 0),
    ])
    .await
    .expect("send");
    agg.wait_card("lily", Some((Some(60), 2, Some((7, 2))))).await;
    h.wait_settled().await;
    let rose = h.get(7, 1, "rose").await.expect("get").expect("record");
    assert_eq!(decode_product(&rose.data).stock, Some(4), "the record did change");

    let changes = aggregate_changes(&h).await;
    let new = &changes[mark..];
    assert_eq!(card_events(new, "rose"), [], "the rose card did not change");
    assert!(new.iter().all(|c| c.category.is_none()), "no category flipped: {new:?}");
    assert!(
        new.iter().all(|c| c.card.as_ref().is_some_and(|c| c.product_id == "lily")),
        "only lily events: {new:?}"
    );
    agg.wait_card("rose", Some((Some(100), 2, Some((7, 1))))).await;
    agg.stop().await;
}

#[tokio::test]
async fn a_restart_from_an_old_keyframe_publishes_nothing_and_ends_in_the_same_state() {
    let Stack { h, storage: _storage, settings, env: _env } =
        Stack::start_with(aggregator_settings).await;
    h.send(vec![
        patch(7, 1, "rose", &offer(100, 5, "roses"), 0),
        patch(7, 2, "rose", &offer(200, 5, "roses"), 0),
        patch(8, 1, "rose", &offer(300, 5, "roses"), 0),
        patch(7, 1, "tulip", &offer(40, 5, "tulips"), 0),
        patch(7, 2, "tulip", &offer(50, 5, "tulips"), 0),
    ])
    .await
    .expect("send");
    h.wait_settled().await;
    // The first start finds no keyframe and asks storage for one: the
    // keyframe every later start bootstraps from, older and older.
    let agg = RunningAggregator::start(&settings).await;
    agg.wait_card("rose", Some((Some(100), 3, Some((7, 1))))).await;

    // Moves after the keyframe: the cheapest sells out, a price changes, a
    // tulip goes, a new product comes, a category empties.
    h.send(vec![
        patch(7, 1, "rose", &stock(0), 0),
        patch(7, 2, "rose", &Product { price: Some(250), ..Default::default() }, 0),
        delete(7, 2, "tulip"),
        patch(7, 1, "tulip", &stock(0), 0),
        patch(8, 1, "peony", &offer(90, 2, "peonies"), 0),
    ])
    .await
    .expect("send");
    agg.wait_card("rose", Some((Some(250), 2, Some((7, 2))))).await;
    agg.wait_card("tulip", None).await;
    agg.wait_card("peony", Some((Some(90), 1, Some((8, 1))))).await;
    agg.wait_categories(7, 1, &[]).await;
    agg.wait_categories(7, 2, &["roses"]).await;
    agg.wait_categories(8, 1, &["peonies", "roses"]).await;
    h.wait_settled().await;
    let before = aggregate_changes(&h).await;
    agg.stop().await;

    // Restarted: it reloads every place from the old keyframe (older
    // versions than it counted) and replays the changes after it.
    let agg = RunningAggregator::start(&settings).await;
    // A change after the restart, on the places replayed: once it shows,
    // the replay before it is done.
    h.send(vec![
        patch(7, 2, "control", &offer(10, 1, "roses"), 0),
        patch(8, 1, "control", &offer(20, 1, "roses"), 0),
    ])
    .await
    .expect("send");
    agg.wait_card("control", Some((Some(10), 2, Some((7, 2))))).await;
    let after = aggregate_changes(&h).await;
    let new = &after[before.len()..];
    assert!(
        new.iter().all(|c| c.card.as_ref().is_some_and(|c| c.product_id == "control")),
        "the restart published nothing but the control: {new:?}"
    );
    assert_eq!(agg.card("rose").await, Some((Some(250), 2, Some((7, 2)))));
    assert_eq!(agg.card("tulip").await, None);
    assert_eq!(agg.card("peony").await, Some((Some(90), 1, Some((8, 1)))));
    assert_eq!(agg.categories(7, 1).await, Vec::<String>::new());
    assert_eq!(agg.categories(7, 2).await, ["roses"]);
    assert_eq!(agg.categories(8, 1).await, ["peonies", "roses"]);
    agg.stop().await;
}

fn version(
    brand: i64,
    place: i64,
    id: &str,
    p: &Product,
    updated_at: i64,
    kind: UpdateKind,
) -> Update {
    let after = Record {
        key: Some(RecordKey::new(brand, place, id)),
        data: p.encode_to_vec(),
        created_at: 1,
        updated_at,
        ..Default::default()
    };
    Update { key: RecordKey::new(brand, place, id), before: None, after, kind, origin: None }
}

#[tokio::test]
async fn a_batch_applied_twice_publishes_once() {
    let (_env, settings, h, mut agg) = connected_aggregator().await;
    let card = |agg: &Aggregator| {
        let agg = agg.clone();
        async move {
            let id = CardId { region: NORTH.into(), product_id: "peony".into() };
            let c = agg.store().card(&id).await.expect("read").expect("a card");
            (c.min_price, c.offers, c.cheapest.map(|k| (k.brand_id, k.place_id)))
        }
    };
    let u = UpdateKind::Updated;

    let first = [
        version(7, 1, "peony", &offer(300, 1, "peonies"), 10, UpdateKind::Created),
        version(7, 2, "peony", &offer(200, 1, "peonies"), 10, UpdateKind::Created),
        version(8, 1, "peony", &offer(100, 1, "peonies"), 10, UpdateKind::Created),
    ];
    agg.apply(&first).await.expect("apply");
    let once = aggregate_changes(&h).await;
    assert_eq!(card_events(&once, "peony"), [(Some(100), 3, Some((8, 1)))]);
    assert_eq!(flips(&once, 8, 1), [("peonies".to_string(), true)]);
    assert_eq!(once.len(), 4, "one card and three flips: {once:?}");
    agg.apply(&first).await.expect("apply again");
    assert_eq!(aggregate_changes(&h).await.len(), 4, "redelivery publishes nothing");

    let second = [
        version(8, 1, "peony", &offer(100, 0, "peonies"), 11, u),
        version(7, 2, "peony", &offer(250, 1, "peonies"), 11, u),
    ];
    agg.apply(&second).await.expect("apply");
    agg.apply(&second).await.expect("apply again");
    // The older batch, delivered late, is older than what was counted.
    agg.apply(&first).await.expect("apply the old batch");
    let twice = aggregate_changes(&h).await;
    assert_eq!(
        card_events(&twice, "peony"),
        [(Some(100), 3, Some((8, 1))), (Some(250), 2, Some((7, 2)))]
    );
    assert_eq!(
        flips(&twice, 8, 1),
        [("peonies".to_string(), true), ("peonies".to_string(), false)]
    );
    assert_eq!(twice.len(), 6, "{twice:?}");
    assert_eq!(card(&agg).await, (Some(250), 2, Some((7, 2))));
    assert_eq!(
        agg.store().categories(PlaceKey::new(8, 1)).await.expect("read"),
        Vec::<String>::new()
    );
    assert_eq!(agg.store().categories(PlaceKey::new(7, 2)).await.expect("read"), ["peonies"]);

    // A reload of a place with the same snapshot, a second aggregator on the
    // same Redis (as after a restart): nothing to publish. A record no
    // longer in the snapshot (purged) is forgotten when the next live
    // change shows the snapshot complete.
    let mut restarted =
        Aggregator::connect(&Config::from(&settings), h.client.clone()).await.expect("again");
    restarted.reset_place(PlaceKey::new(7, 2)).await.expect("reset");
    restarted
        .apply(&[version(7, 2, "peony", &offer(250, 1, "peonies"), 11, UpdateKind::Snapshot)])
        .await
        .expect("snapshot");
    restarted.reset_place(PlaceKey::new(7, 1)).await.expect("reset");
    restarted.apply(&[]).await.expect("an empty snapshot part");
    assert_eq!(aggregate_changes(&h).await.len(), 6, "an unchanged reload publishes nothing");
    restarted
        .apply(&[version(8, 1, "peony", &offer(80, 1, "peonies"), 12, u)])
        .await
        .expect("live");
    let last = aggregate_changes(&h).await;
    assert_eq!(
        card_events(&last[6..], "peony"),
        [(Some(80), 2, Some((8, 1)))],
        "the purged offer of place 7/1 left with the sweep, in the same batch"
    );
    assert_eq!(flips(&last[6..], 7, 1), [("peonies".to_string(), false)]);
    assert_eq!(flips(&last[6..], 8, 1), [("peonies".to_string(), true)]);
    assert_eq!(last.len(), 9, "{last:?}");
}

#[tokio::test]
async fn the_category_cache_flips_between_empty_and_non_empty() {
    let (Stack { h, storage: _storage, env: _env, .. }, agg) = start_aggregating().await;
    h.send(vec![
        patch(7, 1, "rose", &offer(100, 5, "roses"), 0),
        patch(7, 1, "tulip", &offer(50, 5, "tulips"), 0),
    ])
    .await
    .expect("send");
    agg.wait_categories(7, 1, &["roses", "tulips"]).await;
    assert_eq!(agg.categories(7, 2).await, Vec::<String>::new(), "another place is empty");
    let mark = aggregate_changes(&h).await.len();

    h.send(vec![patch(7, 1, "tulip", &stock(0), 0)]).await.expect("send");
    agg.wait_categories(7, 1, &["roses"]).await;
    h.send(vec![patch(7, 1, "tulip", &stock(3), 0)]).await.expect("send");
    agg.wait_categories(7, 1, &["roses", "tulips"]).await;
    // A second rose: still non-empty, no flip. The first moves category.
    h.send(vec![patch(7, 1, "rose-2", &offer(120, 1, "roses"), 0)]).await.expect("send");
    h.send(vec![patch(
        7,
        1,
        "rose",
        &Product { category: Some("peonies".into()), ..Default::default() },
        0,
    )])
    .await
    .expect("send");
    agg.wait_categories(7, 1, &["peonies", "roses", "tulips"]).await;
    // The last rose goes; hiding the only peony empties that one too.
    h.send(vec![delete(7, 1, "rose-2"), hide(7, 1, "rose")]).await.expect("send");
    agg.wait_categories(7, 1, &["tulips"]).await;

    let changes = aggregate_changes(&h).await;
    let mut got = flips(&changes[mark..], 7, 1);
    let f = |c: &str, ne| (c.to_string(), ne);
    assert_eq!(got.len(), 5, "{got:?}");
    // The last two come from one command message; their order is the
    // aggregator's, not the test's business.
    got[3..].sort();
    assert_eq!(
        got,
        [
            f("tulips", false),
            f("tulips", true),
            f("peonies", true),
            f("peonies", false),
            f("roses", false),
        ]
    );
    agg.stop().await;
}

#[tokio::test]
async fn a_failed_publish_is_retried_and_a_repeated_one_is_deduplicated() {
    let (_env, settings, h, mut agg) = connected_aggregator().await;
    let id = CardId { region: NORTH.into(), product_id: "peony".into() };
    let mut redis = h.store.conn();

    // The publish fails (no stream takes it): the batch fails, nothing is
    // recorded as published, and the retry publishes it.
    h.js.delete_stream(h.subjects.aggregates_stream()).await.expect("delete stream");
    let batch = [version(7, 1, "peony", &offer(300, 1, "peonies"), 10, UpdateKind::Created)];
    let err = agg.apply(&batch).await.expect_err("nothing can be published");
    assert!(matches!(err, shelfsync_feed::HandlerError::Transient(_)), "{err}");
    assert_eq!(agg.store().card(&id).await.expect("read"), None, "not recorded as published");
    shelfsync_bus::provision(&h.js, &settings.nats, settings.topology())
        .await
        .expect("stream back");
    agg.apply(&batch).await.expect("the redelivered batch");
    let changes = aggregate_changes(&h).await;
    assert_eq!(card_events(&changes, "peony"), [(Some(300), 1, Some((7, 1)))]);
    assert_eq!(flips(&changes, 7, 1), [("peonies".to_string(), true)]);

    // A crash after the publish, before it was recorded: the record of the
    // previous state is back and the card still marked dirty. A new process
    // recomputes the same change under the same message id; JetStream drops
    // it as a duplicate.
    // Redis lost its scripts (a restart, a failover): loaded again.
    redis::cmd("SCRIPT").arg("FLUSH").query_async::<()>(&mut redis).await.expect("flush");
    let published = agg.store().keys().card_published(&id);
    let previous: Vec<(String, Vec<u8>)> =
        redis::cmd("HGETALL").arg(&published).query_async(&mut redis).await.expect("hgetall");
    agg.apply(&[version(7, 1, "peony", &offer(280, 1, "peonies"), 11, UpdateKind::Updated)])
        .await
        .expect("apply");
    let before_crash = aggregate_changes(&h).await;
    assert_eq!(card_events(&before_crash, "peony").len(), 2);
    let dirty = shelfsync_aggregator::aggregate::Dirty::Card {
        region: NORTH.into(),
        product_id: "peony".into(),
    };
    let mut pipe = redis::pipe();
    pipe.cmd("DEL").arg(&published).ignore();
    pipe.cmd("HSET").arg(&published).arg(previous).ignore();
    pipe.cmd("SADD").arg(agg.store().keys().dirty()).arg(dirty.encode()).ignore();
    pipe.query_async::<()>(&mut redis).await.expect("rewind");

    let restarted =
        Aggregator::connect(&Config::from(&settings), h.client.clone()).await.expect("again");
    restarted.recover().await.expect("recover");
    assert_eq!(aggregate_changes(&h).await.len(), before_crash.len(), "deduplicated");
    let card = restarted.store().card(&id).await.expect("read").expect("card");
    assert_eq!(card.min_price, Some(280), "recorded as published now");
    let dirty: Vec<String> = redis::cmd("SMEMBERS")
        .arg(agg.store().keys().dirty())
        .query_async(&mut redis)
        .await
        .expect("smembers");
    assert!(dirty.is_empty(), "nothing left dirty: {dirty:?}");
}

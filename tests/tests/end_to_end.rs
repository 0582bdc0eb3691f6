//! The whole suite on one bad price: a partner import → storage → the
//! validator hides the offer → the master card and the recommendations
//! exclude it → the partner fixes the price → both include it again.

use std::time::Duration;

use shelfsync_ingest::{ImportConfig, Importer, Source};
use shelfsync_settings::{ImportKind, PartnerSettings, PlaceRegion};
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const WAIT: Duration = Duration::from_secs(30);

fn feed(price: i64) -> String {
    format!(
        r#"{{"brand_id": 7, "places": [
            {{"place_id": 1, "items": [{{"id": "rose", "title": "Rose", "category": "roses", "price": {price}, "old_price": 900, "currency": "RUB", "stock": 5}}]}},
            {{"place_id": 2, "items": [{{"id": "rose", "title": "Rose", "category": "roses", "price": 700, "old_price": 800, "currency": "RUB", "stock": 5}}]}}
        ]}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_price_is_hidden_everywhere_until_it_is_fixed() {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    settings.validator.http_listen = "127.0.0.1:0".into();
    settings.aggregator.http_listen = "127.0.0.1:0".into();
    settings.recommender.http_listen = "127.0.0.1:0".into();
    settings.aggregator.places = vec![
        PlaceRegion { brand_id: 7, place_id: 1, region: "north".into() },
        PlaceRegion { brand_id: 7, place_id: 2, region: "north".into() },
    ];
    settings.partners = vec![PartnerSettings {
        name: "flowers".into(),
        brand_id: 7,
        kind: ImportKind::Full,
        fields: ["title", "category", "price", "old_price", "currency", "stock"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    }];
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let _storage = InProcessStorage::start(settings.clone()).await.expect("storage");

    let validator = shelfsync_validator::App::build(settings.clone()).await.expect("validator");
    let aggregator = shelfsync_aggregator::App::build(settings.clone()).await.expect("aggregator");
    let recommender =
        shelfsync_recommender::App::build(settings.clone()).await.expect("recommender");
    let (agg, rec) = (aggregator.http_addr(), recommender.http_addr());
    let _running = [spawn(validator), spawn(aggregator), spawn(recommender)];
    for addr in [agg, rec] {
        eventually(WAIT, "consumers ready", || async {
            http_get(addr, "/readyz").await.is_ok_and(|(s, _)| s == 200)
        })
        .await;
    }

    let importer = Importer::connect(ImportConfig::from(&settings)).await.expect("importer");
    let dir = tempfile::tempdir().expect("tmp");
    let import = |price: i64| {
        let path = dir.path().join(format!("feed-{price}.json"));
        std::fs::write(&path, feed(price)).expect("write");
        let partner = settings.partners[0].clone();
        let importer = &importer;
        async move { importer.import(&partner, Source::File(path), None).await.expect("import") }
    };
    let card = || async {
        let (s, body) = http_get(agg, "/v1/cards/north/rose").await.expect("card");
        if s == 404 {
            return (None, Some(0));
        }
        assert_eq!(s, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        (v["min_price"].as_i64(), v["offers"].as_u64())
    };
    let top = || async {
        let (s, body) = http_get(rec, "/v1/top/7/1").await.expect("top");
        assert_eq!(s, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        v.as_array()
            .expect("list")
            .iter()
            .map(|r| r["product_id"].as_str().unwrap_or("").to_string())
            .collect::<Vec<_>>()
    };
    let hidden = |h: &Harness| {
        let store = h.store.clone();
        let partitions = h.settings.storage.partitions;
        async move {
            let r = store
                .get(partitions, &shelfsync_proto::RecordKey::new(7, 1, "rose"))
                .await
                .expect("get")
                .expect("record");
            shelfsync_feed::state_of(&r).hidden.unwrap_or(false)
        }
    };

    // A good price first: visible everywhere, the cheapest in the region.
    import(500).await;
    eventually(WAIT, "card at 500 with two offers", || async {
        card().await == (Some(500), Some(2))
    })
    .await;
    eventually(WAIT, "recommended", || async { top().await == ["rose"] }).await;

    // Price 0 is bad: the validator hides it; the card falls back to place 2
    // and the recommender drops it.
    import(0).await;
    eventually(WAIT, "the validator hid the offer", || async { hidden(&h).await }).await;
    eventually(WAIT, "the card excludes the hidden offer", || async {
        card().await == (Some(700), Some(1))
    })
    .await;
    eventually(WAIT, "the recommendations exclude it", || async { top().await.is_empty() }).await;

    // Fixed: the validator un-hides it and both include it again.
    import(450).await;
    eventually(WAIT, "the validator un-hid the offer", || async { !hidden(&h).await }).await;
    eventually(WAIT, "the card includes it again", || async {
        card().await == (Some(450), Some(2))
    })
    .await;
    eventually(WAIT, "recommended again", || async { top().await == ["rose"] }).await;
}

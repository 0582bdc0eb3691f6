//! The whole pipeline — partner feed → ingest → command stream → storage →
//! change stream — on real servers, through the importer users run.

use shelfsync_proto::{ChangeKind, product_field};
use shelfsync_settings::{ImportKind, PartnerSettings};
use shelfsync_tests::*;

const BRAND: i64 = 7;

fn partner(name: &str, kind: ImportKind, fields: &[&str]) -> PartnerSettings {
    let fields = fields.iter().map(|f| f.to_string()).collect();
    PartnerSettings { name: name.into(), brand_id: BRAND, kind, fields, ..Default::default() }
}

const ALL: &[&str] =
    &["title", "category", "price", "old_price", "currency", "stock", "images", "description"];

async fn start() -> Importing {
    Importing::start(vec![
        partner("full", ImportKind::Full, ALL),
        partner("prices", ImportKind::Delta, &["price", "old_price"]),
        partner("stock", ImportKind::Delta, &["stock"]),
    ])
    .await
}

/// A nested dump of `places` × `items`; `price(place, i)` decides prices.
fn dump(places: &[i64], items: usize, price: impl Fn(i64, usize) -> i64) -> String {
    let mut out = format!("{{\"brand_id\": {BRAND}, \"places\": [");
    for (n, &p) in places.iter().enumerate() {
        if n > 0 {
            out.push(',');
        }
        out.push_str(&format!("{{\"place_id\": {p}, \"items\": ["));
        for i in 0..items {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&format!(
                r#"{{"id": "sku-{i}", "title": "Roses {i}", "category": "roses", "price": {}, "currency": "RUB", "stock": {}, "images": ["https://cdn.example/{i}.jpg"]}}"#,
                price(p, i),
                i % 7
            ));
        }
        out.push_str("]}");
    }
    out.push_str("]}");
    out
}

#[tokio::test]
async fn identical_reimport_emits_nothing_and_one_percent_churn_exactly_the_changed() {
    let p = start().await;
    let places = [1, 2];
    let base = |_: i64, i: usize| 10_000 + i as i64;
    let r = p.import("full", &dump(&places, 500, base)).await.expect("import");
    assert_eq!((r.items, r.sweeps, r.rejected_total), (1000, 2, 0));
    assert_eq!(p.h.changes().await.unwrap().len(), 1000);

    p.import("full", &dump(&places, 500, base)).await.expect("re-import");
    assert_eq!(
        p.h.changes().await.unwrap().len(),
        1000,
        "an identical re-import emits zero changes"
    );

    // 1%: every 100th item of each place gets a new price.
    let churned = |i: usize| i % 100 == 42;
    let r = p
        .import(
            "full",
            &dump(&places, 500, |pl, i| if churned(i) { 99 + base(pl, i) } else { base(pl, i) }),
        )
        .await
        .expect("churn");
    let all = p.h.changes().await.unwrap();
    let new = &all[1000..];
    assert_eq!(new.len(), 10, "exactly the churned records");
    for c in new {
        let id = &c.key.as_ref().unwrap().product_id;
        let i: usize = id.trim_start_matches("sku-").parse().unwrap();
        assert!(churned(i), "{id} did not change");
        assert_eq!(c.kind, ChangeKind::Updated as i32);
        assert_eq!(decode_product(&c.before.as_ref().unwrap().data).price, Some(10_000 + i as i64));
        assert_eq!(decode_product(&c.after.as_ref().unwrap().data).price, Some(10_099 + i as i64));
        assert_eq!(c.changed_data_fields, vec![product_field::PRICE]);
        assert_eq!(c.origin.as_ref().unwrap().import_id, r.import_id);
    }
}

#[tokio::test]
async fn price_and_stock_feeds_glue_into_one_record_and_zero_is_a_value() {
    let p = start().await;
    p.import("full", &dump(&[1], 3, |_, _| 500)).await.expect("content");
    p.import("prices", r#"{"brand_id": 7, "places": [{"place_id": 1, "items": [{"id": "sku-1", "price": 0, "old_price": 700}]}]}"#)
        .await
        .expect("prices");
    p.import("stock", "{\"brand_id\":7,\"place_id\":1,\"id\":\"sku-1\",\"stock\":0}\n{\"brand_id\":7,\"place_id\":1,\"id\":\"sku-2\",\"stock\":9}\n")
        .await
        .expect("stock");
    let r = p.h.get(BRAND, 1, "sku-1").await.unwrap().unwrap();
    let product = decode_product(&r.data);
    assert_eq!(product.title.as_deref(), Some("Roses 1"), "content kept");
    assert_eq!(product.price, Some(0));
    assert_eq!(product.old_price, Some(700));
    assert_eq!(product.stock, Some(0), "stock 0 is a value");
    assert_eq!(product.images.len(), 1, "the stock feed did not clear content");
    let r2 = decode_product(&p.h.get(BRAND, 1, "sku-2").await.unwrap().unwrap().data);
    assert_eq!(
        (r2.price, r2.stock),
        (Some(500), Some(9)),
        "the stock feed did not clear the price"
    );
    // A delta does not move generations, so it cannot save or sweep anything.
    assert!(!p.h.get(BRAND, 1, "sku-0").await.unwrap().unwrap().absent);
}

#[tokio::test]
async fn a_full_import_sweeps_what_vanished_and_a_failed_one_sweeps_nothing() {
    let p = start().await;
    p.import("full", &dump(&[1], 10, |_, _| 100)).await.expect("first");
    // sku-5..9 vanish from the next dump.
    p.import("full", &dump(&[1], 5, |_, _| 100)).await.expect("second");
    for i in 0..10 {
        let r = p.h.get(BRAND, 1, &format!("sku-{i}")).await.unwrap().unwrap();
        assert_eq!(r.absent, i >= 5, "sku-{i}");
    }
    let changes = p.h.changes().await.unwrap().len();
    // A feed that is not JSON, and a truncated one: errors, and no sweep.
    let err = p.import("full", "<html>503 Service Unavailable</html>").await.expect_err("not JSON");
    let err = err.to_string();
    assert!(err.contains("not JSON"), "{err}");
    let truncated = dump(&[1], 2, |_, _| 100);
    let err = p.import("full", &truncated[..truncated.len() - 10]).await.expect_err("truncated");
    assert!(!err.to_string().is_empty());
    assert!(!p.h.get(BRAND, 1, "sku-4").await.unwrap().unwrap().absent, "a failed import swept");
    assert_eq!(p.h.changes().await.unwrap().len(), changes, "a failed import changed nothing");
    // The vanished items come back with the next good import.
    p.import("full", &dump(&[1], 10, |_, _| 100)).await.expect("third");
    assert!(!p.h.get(BRAND, 1, "sku-9").await.unwrap().unwrap().absent);
}

#[tokio::test]
async fn malformed_items_are_rejected_with_reasons_and_good_ones_land() {
    let p = start().await;
    let feed = r#"{"brand_id": 7, "places": [{"place_id": 1, "items": [
        {"id": "good-1", "title": "ok", "price": 100, "stock": 1},
        {"title": "no id", "price": 100},
        {"id": "bad-price", "price": "cheap"},
        {"id": "float", "price": 1.5},
        {"id": "huge", "price": 99999999999999999999999},
        {"id": "good-2", "title": "ok", "price": 0, "stock": -3},
        {"id": "good-1", "title": "duplicate"},
        ["not", "an", "object"]
    ]}]}"#;
    let r = p.import("full", feed).await.expect("import lands despite bad items");
    assert_eq!(r.items, 2);
    assert_eq!(r.rejected_total, 6, "{:?}", r.rejected);
    for reason in ["missing_id", "wrong_type", "out_of_range", "duplicate_id", "not_an_object"] {
        assert!(r.rejected.contains_key(reason), "{reason} missing in {:?}", r.rejected);
    }
    assert!(p.h.get(BRAND, 1, "good-1").await.unwrap().is_some());
    let g2 = decode_product(&p.h.get(BRAND, 1, "good-2").await.unwrap().unwrap().data);
    assert_eq!((g2.price, g2.stock), (Some(0), Some(-3)), "business rules are the validator's job");
    assert!(p.h.get(BRAND, 1, "bad-price").await.unwrap().is_none());
    let rejections = p.h.rejections().await.unwrap();
    assert_eq!(rejections.len(), 6);
    assert!(rejections.iter().all(|r| !r.reason.is_empty() && !r.detail.is_empty()));
}

//! A full import's generation and the places ingest remembers: the
//! generation is taken with the partner's lease, so it grows whatever the
//! clock of the host running the import says, and the places a partner's
//! full imports carried are forgotten once none has carried them for
//! `ingest.forget_places_after`.

use std::sync::Arc;
use std::time::Duration;

use shelfsync_ingest::{Clock, ImportConfig, ImportReport, Importer, Source};
use shelfsync_settings::{ImportKind, PartnerSettings};
use shelfsync_tests::*;

const BRAND: i64 = 7;
const HOUR_US: i64 = 3_600_000_000;

fn flowers() -> PartnerSettings {
    PartnerSettings {
        name: "flowers".into(),
        brand_id: BRAND,
        kind: ImportKind::Full,
        fields: shelfsync_proto::product_field::NAMES.map(String::from).to_vec(),
        ..Default::default()
    }
}

/// A dump of `places`, each with the items `ids`.
fn dump(places: &[i64], ids: std::ops::Range<usize>) -> String {
    let items: Vec<String> = ids
        .map(|i| format!(r#"{{"id":"sku-{i}","title":"t","category":"c","price":100,"stock":1}}"#))
        .collect();
    let places: Vec<String> = places
        .iter()
        .map(|p| format!(r#"{{"place_id":{p},"items":[{}]}}"#, items.join(",")))
        .collect();
    format!(r#"{{"brand_id":{BRAND},"places":[{}]}}"#, places.join(","))
}

/// An importer of `lab`'s settings whose clock is `offset_us` off.
async fn importer_off_by(lab: &Importing, offset_us: i64) -> Importer {
    let clock: Clock = Arc::new(move || now_us() + offset_us);
    Importer::connect(ImportConfig::from(&lab.settings)).await.expect("importer").with_clock(clock)
}

async fn import_with(lab: &Importing, importer: &Importer, body: String) -> ImportReport {
    let path = lab.dir.path().join(format!("feed-{}.json", now_us()));
    std::fs::write(&path, body).expect("feed");
    let partner = lab.settings.partner("flowers").expect("partner").clone();
    let report = importer.import(&partner, Source::File(path), None).await.expect("import");
    lab.h.wait_settled().await;
    report
}

#[tokio::test]
async fn a_full_import_on_a_host_whose_clock_is_an_hour_behind_still_sweeps() {
    let lab = Importing::start(vec![flowers()]).await;
    let first = lab.import("flowers", dump(&[1], 0..100)).await.expect("first import");
    // The next dump leaves 20 items out; its host's clock is an hour behind.
    let behind = importer_off_by(&lab, -HOUR_US).await;
    let second = import_with(&lab, &behind, dump(&[1], 0..80)).await;
    assert!(
        second.generation > first.generation,
        "generations grow: {} after {}",
        second.generation,
        first.generation
    );
    assert_eq!(second.import_id, format!("flowers-{}", second.generation));
    assert_eq!(second.marked_absent, 20, "what the dump left out is marked absent: {second:?}");
    for i in [80, 99] {
        let record = lab.h.get(BRAND, 1, &format!("sku-{i}")).await.expect("get").expect("kept");
        assert!(record.absent, "sku-{i} is absent");
    }
    assert!(!lab.h.get(BRAND, 1, "sku-0").await.expect("get").expect("kept").absent);
}

#[tokio::test]
async fn places_no_full_import_carried_for_a_while_are_forgotten() {
    let mut partner = flowers();
    partner.sweep_max_fraction = 1.0;
    let lab = Importing::start_with(vec![partner], |s| {
        s.ingest.forget_places_after = Duration::from_secs(2 * 3600);
    })
    .await;
    let first = lab.import("flowers", dump(&[1, 2], 0..3)).await.expect("import");
    assert_eq!(first.sweeps, 2);
    // An hour later, place 2 is missing: remembered, it gets a (held) sweep.
    let later = importer_off_by(&lab, HOUR_US).await;
    let second = import_with(&lab, &later, dump(&[1], 0..3)).await;
    assert_eq!(second.sweeps, 2, "place 2 is still remembered: {second:?}");
    assert_eq!(second.held_sweeps.len(), 1, "its sweep is held (missing from the dump)");
    // Three hours after it was last carried, place 2 is forgotten.
    let much_later = importer_off_by(&lab, 3 * HOUR_US).await;
    let third = import_with(&lab, &much_later, dump(&[1], 0..3)).await;
    assert_eq!(third.sweeps, 1, "place 2 is forgotten: {third:?}");
    let mut redis = redis::Client::open(lab.env.redis.url())
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let key = format!("{}:ingest:flowers:seen", lab.settings.redis.namespace);
    let remembered: Vec<String> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query_async(&mut redis)
        .await
        .expect("zrange");
    assert_eq!(remembered, ["1"], "only place 1 is kept");
}

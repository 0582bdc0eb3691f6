//! Sweeps a store can trust (docs/RELIABILITY.md, scenario 15): a full
//! import sweeps only what it had the chance to see. Through the real
//! importer, NATS, storage and the `shelfsync` binary:
//!
//! - every item of a place rejected (the feed is wrong, not the shelf
//!   empty), a place missing from the dump, a sweep over the partner's
//!   `sweep_max_fraction`: nothing swept, the held sweep in the report, on
//!   the REJECTS stream and in a metric; `shelfsync sweep --import ID`
//!   applies it; raising the limit lets the next import through;
//! - a newer full import supersedes a held sweep: releasing the old one is
//!   refused;
//! - a small, healthy import sweeps as it always did;
//! - a place of 200 000 records swept to absent in bounded steps while
//!   another partition takes live changes: that partition's longest commit
//!   stays short (printed; docs/RELIABILITY.md has the figure).

use std::time::{Duration, Instant};

use shelfsync_ingest::ImportReport;
use shelfsync_settings::{ImportKind, PartnerSettings};
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;

fn partner(name: &str, max_fraction: f64) -> PartnerSettings {
    PartnerSettings {
        name: name.into(),
        brand_id: BRAND,
        kind: ImportKind::Full,
        sweep_max_fraction: max_fraction,
        ..Default::default()
    }
}

struct World(Importing);

impl std::ops::Deref for World {
    type Target = Importing;
    fn deref(&self) -> &Importing {
        &self.0
    }
}

async fn start() -> World {
    World(Importing::start(vec![partner("flowers", 0.5), partner("lenient", 0.8)]).await)
}

/// A nested feed: per place, items `sku-<from>`.. `sku-<to - 1>`, or
/// `bad` items whose price is not a number.
fn feed(places: &[(i64, std::ops::Range<usize>, bool)]) -> String {
    let places: Vec<String> = places
        .iter()
        .map(|(place, ids, bad)| {
            let items: Vec<String> = ids
                .clone()
                .map(|i| {
                    let price = if *bad { r#""n/a""#.to_string() } else { (100 + i).to_string() };
                    format!(r#"{{"id":"sku-{i}","title":"Roses","price":{price},"stock":3}}"#)
                })
                .collect();
            format!(r#"{{"place_id":{place},"items":[{}]}}"#, items.join(","))
        })
        .collect();
    format!(r#"{{"brand_id":{BRAND},"places":[{}]}}"#, places.join(","))
}

impl World {
    async fn import_as(&self, partner: &str, body: &str) -> ImportReport {
        self.0.import(partner, body).await.expect("import")
    }

    async fn import(&self, body: &str) -> ImportReport {
        self.import_as("flowers", body).await
    }

    /// Live (present, not deleted) records of a place among `sku-0..n`.
    async fn live(&self, place: i64, n: usize) -> usize {
        let mut live = 0;
        for i in 0..n {
            if let Some(r) = self.h.get(BRAND, place, &format!("sku-{i}")).await.expect("get") {
                live += usize::from(!r.absent && !r.deleted);
            }
        }
        live
    }
}

#[tokio::test]
async fn a_place_whose_every_item_is_rejected_is_not_swept_until_the_operator_says_so() {
    let w = start().await;
    w.import(&feed(&[(1, 0..300, false), (2, 0..10, false)])).await;
    assert_eq!(w.live(1, 300).await, 300);

    // A broken feed: every item of place 1 has a price that is not a number.
    let broken = w.import(&feed(&[(1, 0..300, true), (2, 0..9, false)])).await;
    assert_eq!(broken.rejected_total, 300);
    assert_eq!(w.live(1, 300).await, 300, "the shelf is not emptied by a wrong feed");
    assert_eq!(w.live(2, 10).await, 9, "the healthy place is swept as usual");
    assert_eq!((broken.sweeps, broken.sweeps_applied, broken.marked_absent), (2, 1, 1));
    let [held] = broken.held_sweeps.as_slice() else { panic!("one held sweep: {broken:#?}") };
    assert_eq!(
        (held.place_id, held.reason.as_str(), held.accepted, held.live, held.would_mark_absent),
        (1, "no_item_accepted", 0, 300, 300)
    );
    assert!(
        broken.render().contains("HELD       place 1: no_item_accepted"),
        "{}",
        broken.render()
    );
    let notice =
        w.h.rejections()
            .await
            .expect("rejections")
            .into_iter()
            .find(|r| r.reason == "sweep_held")
            .expect("a sweep_held notice on the REJECTS stream");
    assert_eq!(notice.sweep.as_ref().map(|o| o.candidates), Some(300));
    let metrics = shelfsync_telemetry::render_metrics();
    let held_metric =
        metric_value(&metrics, "shelfsync_sweeps_held_total", r#"reason="no_item_accepted""#);
    assert!(held_metric.is_some_and(|n| n >= 1.0), "counted in a metric");
    let listed = cli_ok(&w.settings, &["sweeps"]).await.expect("shelfsync sweeps");
    assert!(listed.contains(&broken.import_id) && listed.contains("no_item_accepted"), "{listed}");

    // The operator had a look and applies it.
    let out = cli_ok(&w.settings, &["sweep", "--import", &broken.import_id]).await.expect("sweep");
    assert!(out.contains("applied, 300 records marked absent"), "{out}");
    w.h.wait_settled().await;
    assert_eq!(w.live(1, 300).await, 0);
    let again = cli(&w.settings, &["sweep", "--import", &broken.import_id]).await.expect("run");
    assert!(!again.status.success(), "nothing is held any more");
}

#[tokio::test]
async fn a_place_missing_from_the_dump_is_held() {
    let w = start().await;
    w.import(&feed(&[(1, 0..20, false), (2, 0..20, false)])).await;
    let report = w.import(&feed(&[(2, 0..20, false)])).await;
    assert_eq!(w.live(1, 20).await, 20, "a place missing from the dump keeps its records");
    let [held] = report.held_sweeps.as_slice() else { panic!("one held sweep: {report:#?}") };
    assert_eq!((held.place_id, held.reason.as_str(), held.live), (1, "missing_from_dump", 20));
}

#[tokio::test]
async fn a_sweep_over_the_partners_fraction_is_held_and_a_higher_limit_lets_it_through() {
    let w = start().await;
    w.import(&feed(&[(1, 0..300, false)])).await;
    // 100 of 300: two thirds of the place would vanish.
    let report = w.import(&feed(&[(1, 0..100, false)])).await;
    assert_eq!(w.live(1, 300).await, 300);
    let [held] = report.held_sweeps.as_slice() else { panic!("one held sweep: {report:#?}") };
    assert_eq!(
        (held.reason.as_str(), held.accepted, held.live, held.would_mark_absent),
        ("over_fraction", 100, 300, 200)
    );
    // The same feed from a partner allowed to lose 80 % of a place.
    let lenient = w.import_as("lenient", &feed(&[(1, 0..100, false)])).await;
    assert!(lenient.held_sweeps.is_empty(), "{lenient:#?}");
    assert_eq!((lenient.sweeps_applied, lenient.marked_absent), (1, 200));
    assert_eq!(w.live(1, 300).await, 100);
}

#[tokio::test]
async fn a_newer_import_supersedes_a_held_sweep_and_releasing_the_old_one_is_refused() {
    let w = start().await;
    w.import(&feed(&[(1, 0..50, false)])).await;
    let broken = w.import(&feed(&[(1, 0..50, true)])).await;
    assert_eq!(broken.held_sweeps.len(), 1);
    let healthy = w.import(&feed(&[(1, 0..40, false)])).await;
    assert!(healthy.held_sweeps.is_empty());
    assert_eq!(w.live(1, 50).await, 40);
    let out = cli(&w.settings, &["sweep", "--import", &broken.import_id]).await.expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no sweep of import") && err.contains("superseded"), "{err}");
    assert_eq!(w.live(1, 50).await, 40, "nothing more was swept");
}

/// A held sweep released late marks only what was there when it was held:
/// a record a delta created after the hold, and a left-out record a delta
/// changed after it, stay live (the import could not have seen them).
#[tokio::test]
async fn a_late_release_spares_what_was_written_after_the_hold() {
    let w = start().await;
    w.import(&feed(&[(1, 0..10, false)])).await;
    // 2 of 10: held, over the partner's fraction.
    let report = w.import(&feed(&[(1, 0..2, false)])).await;
    let [held] = report.held_sweeps.as_slice() else { panic!("one held sweep: {report:#?}") };
    assert_eq!(held.reason, "over_fraction");
    // After the hold, deltas write to the place: a new record, and one the
    // import left out.
    let delta = |id: &str, price: i64| patch(BRAND, 1, id, &product("Tulips", price, 2), 0);
    w.h.send(vec![delta("sku-new", 5), delta("sku-5", 77)]).await.expect("send");
    w.h.wait_settled().await;
    // What is kept for the release is counted: the held sweep's touched set,
    // and the outcomes of both imports' sweeps.
    let p = w.h.partition(BRAND, 1);
    let (outcomes, touched) = w.h.store.kept(p).await.expect("kept");
    assert_eq!((outcomes, touched), (2, 1), "two imports' outcomes, the held one's touched set");
    let out =
        cli_ok(&w.settings, &["sweep", "--import", &report.import_id]).await.expect("release");
    assert!(out.contains("applied"), "{out}");
    w.h.wait_settled().await;
    assert_eq!(w.h.store.kept(p).await.expect("kept").1, 0, "its touched set goes once applied");
    let mut live = std::collections::BTreeMap::new();
    for id in ["sku-new", "sku-0", "sku-1", "sku-2", "sku-3", "sku-4", "sku-5", "sku-6", "sku-7"] {
        let r = w.h.get(BRAND, 1, id).await.expect("get").expect("record");
        live.insert(id, !r.absent && !r.deleted);
    }
    assert!(live["sku-new"], "created after the hold: not the import's to sweep");
    assert!(live["sku-5"], "changed after the hold: spared");
    assert!(live["sku-0"] && live["sku-1"], "carried by the import");
    for id in ["sku-2", "sku-3", "sku-4", "sku-6", "sku-7"] {
        assert!(!live[id], "{id} left out by the import: absent");
    }
}

#[tokio::test]
async fn a_small_healthy_import_sweeps_as_before() {
    let w = start().await;
    w.import(&feed(&[(1, 0..3, false)])).await;
    let report = w.import(&feed(&[(1, 0..2, false)])).await;
    assert_eq!((report.sweeps_applied, report.marked_absent), (1, 1));
    assert!(report.held_sweeps.is_empty());
    let gone = w.h.get(BRAND, 1, "sku-2").await.expect("get").expect("record");
    assert!(gone.absent);
}

/// A sweep is only taken from the partition's sweep subject, which only
/// ingest and the CLI may publish to: the same sweep sent on the command
/// subject (what a validator or any command producer may publish to) marks
/// nothing, is refused with `sweep_forbidden`, and the commands of its
/// message still apply.
#[tokio::test]
async fn a_sweep_that_does_not_come_on_the_sweep_subject_is_refused() {
    let w = start().await;
    let first = w.import(&feed(&[(1, 0..20, false)])).await;
    assert_eq!(w.live(1, 20).await, 20);
    let p = w.h.partition(BRAND, 1);
    let forged = shelfsync_proto::CommandBatch {
        partition: p.0,
        commands: vec![patch(BRAND, 1, "sku-extra", &product("Tulips", 5, 1), 0)],
        sweeps: vec![shelfsync_proto::Sweep {
            brand_id: BRAND,
            place_id: 1,
            // A generation above every record's: all 20 would go.
            generation: first.generation + 1,
            source: "forged".into(),
            import_id: "forged-1".into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    w.h.send_raw(p, prost::Message::encode_to_vec(&forged)).await.expect("publish");
    w.h.wait_settled().await;
    assert_eq!(w.live(1, 20).await, 20, "a sweep off its subject marks nothing");
    let extra = w.h.get(BRAND, 1, "sku-extra").await.expect("get");
    assert!(extra.is_some_and(|r| !r.absent), "the message's command applied");
    let refused: Vec<_> =
        w.h.rejections()
            .await
            .expect("rejections")
            .into_iter()
            .filter(|r| r.reason == "sweep_forbidden")
            .collect();
    assert_eq!(refused.len(), 1, "{refused:#?}");
    assert_eq!(refused[0].origin.as_ref().map(|o| o.import_id.as_str()), Some("forged-1"));
    // The same sweep where sweeps belong is applied.
    w.h.send_batch(p, &shelfsync_proto::CommandBatch { commands: vec![], ..forged })
        .await
        .expect("publish");
    w.h.wait_settled().await;
    assert_eq!(w.live(1, 20).await, 0, "on the sweep subject it is a sweep like any other");
}

/// A 200 000-record place swept to absent, in steps, while another
/// partition takes live changes one message at a time; the longest commit
/// of that other partition is printed (and kept in docs/RELIABILITY.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_of_a_place_of_200_000_records_goes_in_steps_while_other_partitions_go_on() {
    large_sweep(200_000, None).await;
}

/// The same with the storage binary `SHELFSYNC_SWEEP_STORAGE_BIN` (e.g. a
/// release build of another version), to compare figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "bench: prints figures of a given storage binary, asserts what the test above does"]
async fn a_large_sweep_with_a_given_storage_binary() {
    let bin = std::env::var("SHELFSYNC_SWEEP_STORAGE_BIN").expect("SHELFSYNC_SWEEP_STORAGE_BIN");
    large_sweep(200_000, Some(bin)).await;
}

async fn large_sweep(records: usize, storage_bin: Option<String>) {
    let env = TestEnv::start().await.expect("servers");
    let settings = storage_settings(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let _in_process;
    let _child;
    match &storage_bin {
        None => {
            _in_process = Some(InProcessStorage::start(settings.clone()).await.expect("storage"))
        }
        Some(bin) => {
            let mut cmd = std::process::Command::new(bin);
            cmd.envs(shelfsync_testkit::settings_env(&settings)).env("RUST_LOG", "warn");
            _child = Some(KillOnDrop(cmd.spawn().expect("storage binary")));
        }
    }
    let big = 1;
    let other = (2..).find(|&p| h.partition(BRAND, p) != h.partition(BRAND, big)).expect("place");
    let batches: Vec<_> = (0..records)
        .collect::<Vec<_>>()
        .chunks(1000)
        .map(|ids| {
            let commands = ids
                .iter()
                .map(|i| patch(BRAND, big, &format!("sku-{i}"), &product("Roses", 100, 3), 1))
                .collect();
            shelfsync_proto::CommandBatch {
                partition: h.partition(BRAND, big).0,
                commands,
                ..Default::default()
            }
        })
        .collect();
    h.publish_batches("big", &batches).await.expect("publish");
    h.wait_settled().await;

    // Generation 2 carries none of them: every record of the place goes.
    let sweep_started = Instant::now();
    h.send_sweep(BRAND, big, 2).await.expect("sweep");
    let mut longest = Duration::ZERO;
    let mut n = 0;
    loop {
        let started = Instant::now();
        h.send(vec![patch(BRAND, other, "live", &product("Roses", n, 3), 0)]).await.expect("send");
        shelfsync_testkit::eventually(SETTLE, "the live change", || async {
            let r = h.get(BRAND, other, "live").await.ok().flatten();
            r.is_some_and(|r| decode_product(&r.data).price == Some(n))
        })
        .await;
        longest = longest.max(started.elapsed());
        n += 1;
        let swept = h.get(BRAND, big, &format!("sku-{}", records - 1)).await.expect("get");
        let first = h.get(BRAND, big, "sku-0").await.expect("get");
        if swept.is_some_and(|r| r.absent) && first.is_some_and(|r| r.absent) {
            break;
        }
        assert!(sweep_started.elapsed() < Duration::from_secs(240), "the sweep takes too long");
    }
    h.wait_settled().await;
    let swept_in = sweep_started.elapsed();
    let absent = h
        .changes()
        .await
        .expect("changes")
        .iter()
        .filter(|c| c.after.as_ref().is_some_and(|r| r.absent))
        .count();
    assert_eq!(absent, records, "every record of the place marked absent once");
    eprintln!(
        "sweep of {records} records: {swept_in:?}; {n} live changes of another partition meanwhile, \
         the slowest applied {longest:?} after it was sent"
    );
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

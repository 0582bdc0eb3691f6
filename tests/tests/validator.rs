//! The validator against real servers, with storage and the validator
//! running in-process: hide and un-hide, the CAS race with an integration,
//! replicas sharing one durable consumer, and no feedback loop on its own
//! writes.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer;
use prost::Message;
use shelfsync_feed::FeedStatus;
use shelfsync_proto::{Change, Product, Record, RecordState};
use shelfsync_settings::Settings;
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;
use shelfsync_validator::{DECIDED_BY, Stats};

const BRAND: i64 = 7;
const PRICE_REASON: &str = "price is not positive";

/// The validator's part of the settings: a port of its own.
fn validator_settings(s: &mut Settings) {
    s.validator.http_listen = "127.0.0.1:0".into();
}

/// A validator running in this process (the real `App`).
struct RunningValidator {
    running: Running,
    stats: Arc<Stats>,
    status: Arc<FeedStatus>,
    addr: std::net::SocketAddr,
}

impl RunningValidator {
    async fn start(settings: Settings) -> Self {
        let app = shelfsync_validator::App::build(settings).await.expect("validator builds");
        let (stats, status, addr) = (app.stats(), app.feed_status(), app.http_addr());
        Self { running: spawn(app), stats, status, addr }
    }

    async fn ready(&self) -> bool {
        http_get(self.addr, "/readyz").await.is_ok_and(|(s, _)| s == 200)
    }

    async fn wait_ready(&self) {
        eventually(Duration::from_secs(30), "validator ready", || self.ready()).await;
    }

    /// Graceful stop, as on SIGTERM.
    async fn stop(self) {
        self.running.stop().await.expect("validator stops cleanly");
    }

    fn hides(&self) -> u64 {
        Stats::get(&self.stats.hides)
    }

    fn unhides(&self) -> u64 {
        Stats::get(&self.stats.unhides)
    }

    fn delivered(&self) -> u64 {
        FeedStatus::get(&self.status.delivered)
    }
}

async fn changes_last_seq(h: &Harness) -> Option<u64> {
    let mut stream = h.js.get_stream(h.subjects.changes_stream()).await.ok()?;
    Some(stream.info().await.ok()?.state.last_sequence)
}

/// The validator's shared consumer has handled (and acked) every change.
async fn validator_idle(h: &Harness) -> bool {
    let Ok(stream) = h.js.get_stream(h.subjects.changes_stream()).await else { return false };
    let name = &h.settings.validator.consumer;
    let Ok(mut c) = stream.get_consumer::<consumer::pull::Config>(name).await else {
        return false;
    };
    c.info().await.is_ok_and(|i| i.num_pending == 0 && i.num_ack_pending == 0)
}

/// A fixed point: storage applied every command, the validator judged every
/// change (its commands are stored before it acks), and storage produced no
/// change meanwhile. A validator reacting to its own writes never gets here.
async fn quiet(h: &Harness) -> bool {
    let last = changes_last_seq(h).await;
    h.settled().await
        && validator_idle(h).await
        && h.settled().await
        && changes_last_seq(h).await == last
}

async fn wait_quiet(h: &Harness) {
    eventually(SETTLE, "storage and validator to go quiet", || quiet(h)).await;
}

fn state(r: &Record) -> RecordState {
    RecordState::decode(r.state.as_slice()).expect("state decodes")
}

async fn record(h: &Harness, place: i64, id: &str) -> Record {
    h.get(BRAND, place, id).await.expect("get").unwrap_or_else(|| panic!("{id} exists"))
}

fn of_key<'a>(changes: &'a [Change], place: i64, id: &str) -> Vec<&'a Change> {
    changes
        .iter()
        .filter(|c| {
            c.key.as_ref().is_some_and(|k| {
                (k.brand_id, k.place_id, k.product_id.as_str()) == (BRAND, place, id)
            })
        })
        .collect()
}

fn from_validator(c: &Change) -> bool {
    c.origin.as_ref().is_some_and(|o| o.source == DECIDED_BY)
}

fn price(p: i64) -> Product {
    Product { price: Some(p), ..Default::default() }
}

#[tokio::test]
async fn hides_a_rule_breaker_and_shows_it_again_once_fixed() {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    validator_settings(&mut settings);
    // Started before any stream exists: alive, not ready, binding in the background.
    let validator = RunningValidator::start(settings.clone()).await;
    let (status, _) = http_get(validator.addr, "/healthz").await.expect("healthz");
    assert_eq!(status, 200);
    let (status, _) = http_get(validator.addr, "/readyz").await.expect("readyz");
    assert_eq!(status, 503, "not ready before the change feed is bound");

    let h = Harness::connect(settings.clone()).await.expect("harness"); // creates the streams
    let _storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    validator.wait_ready().await;

    h.send(vec![
        patch(BRAND, 1, "free", &product("Roses", 0, 5), 0),
        patch(BRAND, 1, "fine", &product("Tulips", 900, 5), 0),
    ])
    .await
    .expect("send");
    eventually(SETTLE, "the price-0 offer hidden", || async {
        h.get(BRAND, 1, "free").await.ok().flatten().is_some_and(|r| state(&r).hidden == Some(true))
    })
    .await;
    let hidden = state(&record(&h, 1, "free").await);
    assert_eq!(hidden.reasons, [PRICE_REASON]);
    assert_eq!(hidden.decided_by.as_deref(), Some(DECIDED_BY));
    assert!(hidden.decided_at.is_some());

    // The partner fixes the price: shown again, reasons gone.
    h.send(vec![patch(BRAND, 1, "free", &price(450), 0)]).await.expect("send");
    eventually(SETTLE, "the fixed offer shown again", || async {
        h.get(BRAND, 1, "free")
            .await
            .ok()
            .flatten()
            .is_some_and(|r| state(&r).hidden == Some(false))
    })
    .await;
    wait_quiet(&h).await;
    let shown = state(&record(&h, 1, "free").await);
    assert!(shown.reasons.is_empty(), "{shown:?}");
    assert_eq!(shown.decided_by.as_deref(), Some(DECIDED_BY));
    assert_eq!(decode_product(&record(&h, 1, "free").await.data).price, Some(450));
    assert_eq!(
        state(&record(&h, 1, "fine").await),
        RecordState::default(),
        "a good offer is left alone"
    );
    assert_eq!((validator.hides(), validator.unhides()), (1, 1));
    assert!(h.rejections().await.expect("rejections").is_empty());
    validator.stop().await;
}

/// The race of the issue, made deterministic by the order of the command
/// stream instead of by timing: storage is stopped while the integration's
/// next price is queued, so the validator's hide — decided on the previous
/// version — queues behind it and is applied after it.
#[tokio::test]
async fn a_hide_decided_on_an_old_version_loses_to_the_integration() {
    let Stack { h, storage, settings, env: _env } = Stack::start_with(validator_settings).await;
    let validator = RunningValidator::start(settings.clone()).await;
    validator.wait_ready().await; // its durable consumer exists from here on

    h.send(vec![patch(BRAND, 1, "sku", &product("Roses", 10_000, 5), 0)]).await.expect("send");
    wait_quiet(&h).await;
    validator.stop().await;

    // 10 000 → 100: a 99% drop, beyond the default price_jump rule (90%).
    h.send(vec![patch(BRAND, 1, "sku", &price(100), 0)]).await.expect("send");
    h.wait_settled().await;
    let bad = record(&h, 1, "sku").await;
    assert_eq!(decode_product(&bad.data).price, Some(100));

    // The integration sends 200 while storage is down: first in the queue.
    storage.stop().await.expect("storage stops");
    h.send(vec![patch(BRAND, 1, "sku", &price(200), 0)]).await.expect("send");

    // The validator sees 100 and decides to hide it; the hide is stored
    // behind the 200.
    let validator = RunningValidator::start(settings.clone()).await;
    eventually(SETTLE, "the validator to publish its hide", || async { validator.hides() == 1 })
        .await;

    let _storage = InProcessStorage::start(settings.clone()).await.expect("storage again");
    wait_quiet(&h).await;

    let now = record(&h, 1, "sku").await;
    assert_eq!(decode_product(&now.data).price, Some(200));
    assert_ne!(state(&now).hidden, Some(true), "the 200 version stays visible");

    let rejections = h.rejections().await.expect("rejections");
    assert_eq!(rejections.len(), 1, "{rejections:?}");
    let r = &rejections[0];
    assert_eq!(r.reason, "conflict");
    assert_eq!(r.origin.as_ref().map(|o| o.source.as_str()), Some(DECIDED_BY));
    let cmd = r.command.as_ref().expect("the rejected command");
    assert_eq!(cmd.expected_updated_at, Some(bad.updated_at), "decided on the 100 version");
    assert_eq!(RecordState::decode(cmd.state.as_slice()).expect("state").hidden, Some(true));

    // After seeing 200 (a +100% move from a price that was never hidden),
    // the validator left it alone.
    assert_eq!(validator.delivered(), 2, "the 100 and the 200 changes");
    assert_eq!((validator.hides(), validator.unhides()), (1, 0));
    let changes = h.changes().await.expect("changes");
    let mine = of_key(&changes, 1, "sku");
    assert_eq!(mine.len(), 3, "10 000, 100, 200 and no state change");
    assert!(!mine.iter().any(|c| from_validator(c)));
    validator.stop().await;
}

#[tokio::test]
async fn replicas_share_the_consumer_and_decide_each_change_once() {
    let Stack { h, storage: _storage, settings, env: _env } =
        Stack::start_with(validator_settings).await;
    let a = RunningValidator::start(settings.clone()).await;
    let b = RunningValidator::start(settings.clone()).await;
    a.wait_ready().await;
    b.wait_ready().await;

    // 8 places × 3 bad offers (and a good one each), in several messages.
    let (places, per_place) = (8i64, 3usize);
    for place in 1..=places {
        let mut cmds: Vec<_> = (0..per_place)
            .map(|i| patch(BRAND, place, &format!("bad-{i}"), &product("Roses", -1, 1), 0))
            .collect();
        cmds.push(patch(BRAND, place, "good", &product("Roses", 100, 1), 0));
        h.send(cmds).await.expect("send");
    }
    wait_quiet(&h).await;

    let total = places as u64 * per_place as u64;
    assert_eq!(
        a.hides() + b.hides(),
        total,
        "each bad offer decided once (a: {}, b: {})",
        a.hides(),
        b.hides()
    );
    assert_eq!(Stats::get(&a.stats.duplicates) + Stats::get(&b.stats.duplicates), 0);
    let changes = h.changes().await.expect("changes");
    let hides: Vec<Change> = changes.into_iter().filter(from_validator).collect();
    assert_eq!(hides.len() as u64, total);
    assert_eq!(count_by_key(&hides).values().max(), Some(&1), "one hide per offer");
    for place in 1..=places {
        for i in 0..per_place {
            assert_eq!(state(&record(&h, place, &format!("bad-{i}")).await).hidden, Some(true));
        }
        assert_eq!(state(&record(&h, place, "good").await).hidden, None);
    }
    assert!(h.rejections().await.expect("rejections").is_empty());
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn its_own_writes_do_not_make_it_loop() {
    let Stack { h, storage: _storage, settings, env: _env } =
        Stack::start_with(validator_settings).await;
    let validator = RunningValidator::start(settings.clone()).await;
    validator.wait_ready().await;
    let count = |changes: &[Change]| of_key(changes, 1, "sku").len();

    let untitled = Product { title: None, ..product("", 500, 3) };
    h.send(vec![patch(BRAND, 1, "sku", &untitled, 0)]).await.expect("send");
    wait_quiet(&h).await;
    assert_eq!(count(&h.changes().await.expect("changes")), 2, "created, then hidden");
    assert_eq!(validator.delivered(), 2, "it judged its own change too ...");
    assert_eq!((validator.hides(), validator.unhides()), (1, 0), "... and did nothing");

    let titled = Product { title: Some("Roses".into()), ..Default::default() };
    h.send(vec![patch(BRAND, 1, "sku", &titled, 0)]).await.expect("send");
    wait_quiet(&h).await;
    assert_eq!(count(&h.changes().await.expect("changes")), 4, "fixed, then shown");
    assert_eq!(validator.delivered(), 4);
    assert_eq!((validator.hides(), validator.unhides()), (1, 1));

    // A fine update of a shown offer: one change, no decision.
    let restock = Product { stock: Some(9), ..Default::default() };
    h.send(vec![patch(BRAND, 1, "sku", &restock, 0)]).await.expect("send");
    wait_quiet(&h).await;
    assert_eq!(count(&h.changes().await.expect("changes")), 5);
    assert_eq!(validator.delivered(), 5);
    assert_eq!((validator.hides(), validator.unhides()), (1, 1));
    assert!(h.rejections().await.expect("rejections").is_empty());
    validator.stop().await;
}

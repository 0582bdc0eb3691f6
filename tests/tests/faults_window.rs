//! Exactly once with no time window (docs/RELIABILITY.md, scenario 5c):
//! JetStream's `Nats-Msg-Id` dedup lasts `nats.duplicate_window` only, so
//! these tests set it to one second and make every retry of storage's relay
//! come later than that.
//!
//! - the real storage binary aborted at each step boundary of a batch, one
//!   after the other during one churning import, each time restarted two
//!   seconds later: the CHANGES stream holds every transition exactly once;
//! - the acks of a relay taken as lost (the messages are stored), the relay
//!   retried two seconds later by the same process: stored once.

use std::time::Duration;

use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACES: [i64; 3] = [1, 2, 3];
const FAILPOINTS: [&str; 4] =
    ["before_commit", "after_commit", "after_outbox_publish", "after_publish"];
const WINDOW: (&str, &str) = ("SHELFSYNC__NATS__DUPLICATE_WINDOW", "1s");
/// Longer than the window: whatever is retried is past it.
const PAST_THE_WINDOW: Duration = Duration::from_secs(2);

struct Run {
    _env: TestEnv,
    h: Harness,
    settings: shelfsync_settings::Settings,
    model: SerialModel,
    mirror: FeedMirror,
    feed: RunningFeed,
}

/// A churning import queued before storage starts, a consumer on the kit
/// tailing the changes, a one second dedup window.
async fn queued_import(mirror_name: &str) -> Run {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    settings.nats.duplicate_window = Duration::from_secs(1);
    // Two messages per commit: enough commits for four aborts.
    settings.storage.read_ahead = 1;
    settings.storage.ack_wait = Duration::from_secs(2);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let churn = Churn { brand: BRAND, places: PLACES.to_vec(), items: 60, chunk: 25 };
    let (batches, model) = churn.modelled(settings.storage.partitions);
    let mirror = FeedMirror::default();
    let feed = RunningFeed::tail(&h, mirror_name, mirror.clone());
    h.publish_batches("churn", &batches).await.expect("publish");
    Run { _env: env, h, settings, model, mirror, feed }
}

impl Run {
    /// Exactly the model's transitions on the stream, none twice, and a
    /// consumer that had no copy to drop.
    async fn assert_exactly_once(self) {
        self.h.wait_settled().await;
        self.h.assert_serial(&self.model, BRAND, &PLACES).await;
        let on_stream = self.h.changes().await.expect("changes").len();
        assert_eq!(on_stream, self.model.changes, "every change on the stream once, none twice");
        self.mirror.assert_mirrors(&self.feed, &self.h, &self.model, BRAND, &PLACES).await;
        let status = self.feed.stop().await.status();
        assert_eq!(
            shelfsync_feed::FeedStatus::get(&status.duplicates),
            0,
            "no copy reached the kit"
        );
    }
}

#[tokio::test]
async fn restarts_past_the_dedup_window_at_every_step_boundary_duplicate_and_lose_nothing() {
    let run = queued_import("window-crash-mirror").await;
    for point in FAILPOINTS {
        let spec = format!("{point}@3");
        let env = [WINDOW, ("SHELFSYNC_FAILPOINT", spec.as_str())];
        let mut doomed = StorageProcess::start(&run.settings, &env).expect("storage");
        let status = doomed
            .wait_exit(Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("storage did not reach {spec}: {e}"));
        assert!(!status.success(), "storage must have aborted at {spec}");
        // Down for longer than the dedup window.
        tokio::time::sleep(PAST_THE_WINDOW).await;
    }
    let _storage = StorageProcess::start(&run.settings, &[WINDOW]).expect("storage, last start");
    run.assert_exactly_once().await;
}

#[tokio::test]
async fn a_relay_whose_acks_are_lost_and_retried_past_the_window_stores_once() {
    let run = queued_import("window-ack-mirror").await;
    let env = [
        WINDOW,
        ("SHELFSYNC_FAILPOINT", "lose_relay_ack@2"),
        ("SHELFSYNC_FAILPOINT_PAUSE_MS", "2000"),
    ];
    // Stays up: the same process retries its relay after the pause.
    let _storage = StorageProcess::start(&run.settings, &env).expect("storage");
    run.assert_exactly_once().await;
}

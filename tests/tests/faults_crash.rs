//! Fault scenario 1 (docs/RELIABILITY.md): the real storage binary is
//! aborted (no cleanup, as by SIGKILL) at every step boundary of a batch —
//! before the Redis commit, after it, after the outbox publish, and after the
//! publish before the ack — one after the other during ONE import with churn
//! (full imports with sweeps, a delta feed, deletes and re-creations, a state
//! PATCH, an identical re-import). After each abort it is started again.
//!
//! Asserted: storage ends equal to the serial application of the commands
//! (an in-memory model on storage's pure core), the change stream carries
//! every transition exactly once and in order, and a consumer on the
//! ChangeFeed kit — running all along — saw each transition once and ends
//! equal to storage record by record. `crash.rs` covers each boundary alone
//! with a plain PATCH workload.

use std::time::Duration;

use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACES: [i64; 3] = [1, 2, 3];
const FAILPOINTS: [&str; 4] =
    ["before_commit", "after_commit", "after_outbox_publish", "after_publish"];

#[tokio::test]
async fn storage_aborted_at_every_step_boundary_of_a_churning_import_matches_the_serial_model() {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    // Two messages per commit (one read ahead): enough commits for four
    // aborts, each of them in a commit of two.
    settings.storage.read_ahead = 1;
    // A message in hand when storage dies comes back after the ack wait.
    settings.storage.ack_wait = Duration::from_secs(2);
    let h = Harness::connect(settings.clone()).await.expect("harness");

    let churn = Churn { brand: BRAND, places: PLACES.to_vec(), items: 60, chunk: 25 };
    let (batches, model) = churn.modelled(settings.storage.partitions);
    assert!(model.rejections.is_empty(), "the workload is valid: {:?}", model.rejections);

    let mirror = FeedMirror::default();
    let feed = RunningFeed::tail(&h, "crash-mirror", mirror.clone());
    // Queued before storage starts, so each failpoint lands mid-import.
    h.publish_batches("churn", &batches).await.expect("publish");

    for point in FAILPOINTS {
        let spec = format!("{point}@3");
        let mut doomed =
            StorageProcess::start(&settings, &[("SHELFSYNC_FAILPOINT", spec.as_str())])
                .expect("storage");
        let status = doomed
            .wait_exit(Duration::from_secs(90))
            .await
            .unwrap_or_else(|e| panic!("storage did not reach {spec}: {e}"));
        assert!(!status.success(), "storage must have aborted at {spec}");
    }
    let _storage = StorageProcess::start(&settings, &[]).expect("storage, last start");
    h.wait_settled().await;

    h.assert_serial(&model, BRAND, &PLACES).await;
    mirror.assert_mirrors(&feed, &h, &model, BRAND, &PLACES).await;
    let status = feed.stop().await.status();
    assert_eq!(
        shelfsync_feed::FeedStatus::get(&status.duplicates),
        0,
        "no change reached the stream twice, so the kit had nothing to drop"
    );
}

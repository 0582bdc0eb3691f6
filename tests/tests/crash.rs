//! Crash safety of storage: the real binary is aborted (as by SIGKILL) at each
//! step boundary of a batch, restarted, and must neither lose nor duplicate
//! a change. A consumer-side replica rebuilt from the change stream must
//! equal storage's state record by record.

use std::collections::HashMap;
use std::time::Duration;

use shelfsync_proto::{ChangeKind, Record};
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACES: [i64; 3] = [1, 2, 3];
const ITEMS: usize = 150;

fn price(round: usize, i: usize) -> i64 {
    // Round 1 sets every price; round 2 changes every 10th item.
    if round == 2 && i.is_multiple_of(10) { 9_000 + i as i64 } else { 1_000 + i as i64 }
}

async fn crash_at(failpoint: &str) {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = settings_for(&env);
    // Two messages per commit (one read ahead), so that the 4th commit
    // comes in the middle of the work and lands in a commit of two.
    settings.storage.read_ahead = 1;
    let h = Harness::connect(settings.clone()).await.expect("harness");

    // Everything is queued before storage starts, in batches of ~50 commands,
    // so the failpoint lands in the middle of the work.
    for round in 1..=2 {
        for place in PLACES {
            for chunk in (0..ITEMS).collect::<Vec<_>>().chunks(50) {
                let cmds = chunk
                    .iter()
                    .map(|&i| {
                        patch(
                            BRAND,
                            place,
                            &format!("sku-{i}"),
                            &product("t", price(round, i), 1),
                            0,
                        )
                    })
                    .collect();
                h.send(cmds).await.expect("send");
            }
        }
    }

    let mut doomed =
        StorageProcess::start(&settings, &[("SHELFSYNC_FAILPOINT", &format!("{failpoint}@4"))])
            .expect("storage");
    let status =
        doomed.wait_exit(Duration::from_secs(30)).await.expect("storage reaches the failpoint");
    assert!(!status.success(), "storage must have aborted at {failpoint}");

    let _storage = StorageProcess::start(&settings, &[]).expect("storage restart");
    h.wait_settled().await;

    let changes = h.changes().await.expect("changes");
    if std::env::var("CRASH_DEBUG").is_ok() {
        for b in h.change_batches().await.unwrap() {
            let k = b.changes[0].key.clone().unwrap();
            eprintln!(
                "batch p{} seq{} part{} n={} first={:?} kind={}",
                b.partition,
                b.command_seq,
                b.part,
                b.changes.len(),
                k,
                b.changes[0].kind
            );
        }
    }
    let expected_updates = PLACES.len() * ITEMS / 10;
    assert_eq!(
        changes.len(),
        PLACES.len() * ITEMS + expected_updates,
        "crash at {failpoint}: a change was lost or duplicated"
    );
    for (key, n) in count_by_key(&changes) {
        let i: usize = key.2.trim_start_matches("sku-").parse().expect("id");
        assert_eq!(n, if i.is_multiple_of(10) { 2 } else { 1 }, "changes of {key:?}");
    }

    // Replica from the stream: the latest `after` per key, applied only if
    // newer (as any idempotent consumer would).
    let mut replica: HashMap<(i64, i64, String), Record> = HashMap::new();
    for c in &changes {
        let after = c.after.clone().expect("after");
        let k = c.key.clone().expect("key");
        let key = (k.brand_id, k.place_id, k.product_id);
        if replica.get(&key).is_none_or(|r| r.updated_at < after.updated_at) {
            replica.insert(key, after);
        }
        if c.kind == ChangeKind::Updated as i32 {
            assert!(c.before.is_some());
        }
    }
    for place in PLACES {
        for i in 0..ITEMS {
            let id = format!("sku-{i}");
            let stored = h.get(BRAND, place, &id).await.expect("get").expect("record exists");
            assert_eq!(decode_product(&stored.data).price, Some(price(2, i)));
            let mine = &replica[&(BRAND, place, id)];
            assert_eq!(mine.data, stored.data);
            assert_eq!(mine.updated_at, stored.updated_at);
        }
    }
}

#[tokio::test]
async fn crash_before_commit_loses_nothing() {
    crash_at("before_commit").await;
}

#[tokio::test]
async fn crash_after_commit_before_publish_loses_nothing() {
    crash_at("after_commit").await;
}

#[tokio::test]
async fn crash_after_publish_before_outbox_trim_duplicates_nothing() {
    crash_at("after_outbox_publish").await;
}

#[tokio::test]
async fn crash_after_publish_before_ack_duplicates_nothing() {
    crash_at("after_publish").await;
}

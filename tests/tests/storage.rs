//! Storage against real nats-server and redis-server: change detection,
//! generations and sweeps, CAS, tombstones, poison messages, a removed
//! consumer, reading ahead.

use std::time::Duration;

use prost::Message;
use shelfsync_proto::{ChangeKind, Command, CommandKind, Product, RecordKey, RecordState};
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;

async fn start() -> (TestEnv, Harness, InProcessStorage) {
    let (env, _, h, storage) = start_restartable().await;
    (env, h, storage)
}

/// As [`start`], with the settings to start storage again.
async fn start_restartable() -> (TestEnv, shelfsync_settings::Settings, Harness, InProcessStorage) {
    let env = TestEnv::start().await.expect("servers");
    let settings = settings_for(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");
    (env, settings, h, storage)
}

fn full_import(
    places: &[i64],
    items: usize,
    generation: i64,
    price_of: impl Fn(i64, usize) -> i64,
) -> Vec<Command> {
    let mut out = Vec::new();
    for &place in places {
        for i in 0..items {
            let p = product(&format!("item {i}"), price_of(place, i), (i % 5) as i64);
            out.push(patch(BRAND, place, &format!("sku-{i}"), &p, generation));
        }
    }
    out
}

#[tokio::test]
async fn identical_reimport_emits_nothing_and_churn_emits_exactly_the_changed() {
    let (_env, h, _storage) = start().await;
    let places = [1, 2, 3];
    let g1 = now_us();
    h.send(full_import(&places, 300, g1, |_, i| 1000 + i as i64)).await.unwrap();
    for p in places {
        h.send_sweep(BRAND, p, g1).await.unwrap();
    }
    h.wait_settled().await;
    let first = h.changes().await.unwrap();
    assert_eq!(first.len(), 900);
    assert!(first.iter().all(|c| c.kind == ChangeKind::Created as i32));
    let before = h.get(BRAND, 2, "sku-7").await.unwrap().unwrap();

    // Identical re-import: nothing moves, not even the generation (the last
    // import that wrote the record); its sweep spares what it carried.
    let g2 = g1 + 1_000_000;
    h.send(full_import(&places, 300, g2, |_, i| 1000 + i as i64)).await.unwrap();
    for p in places {
        h.send_sweep(BRAND, p, g2).await.unwrap();
    }
    h.wait_settled().await;
    assert_eq!(h.changes().await.unwrap().len(), 900, "identical re-import emitted changes");
    let after = h.get(BRAND, 2, "sku-7").await.unwrap().unwrap();
    assert_eq!(after.updated_at, before.updated_at, "generation-only update bumped updated_at");
    assert_eq!(after.generation, g1, "an import stamps only the records it writes");
    assert_eq!(before.generation, g1);
    assert!(!after.absent, "the sweep spared a record its import carried");

    // 1% churn: 9 of 900 records get a new price.
    let churned = |place: i64, i: usize| i % 100 == 7 && place != 0;
    let g3 = g2 + 1_000_000;
    h.send(full_import(&places, 300, g3, |place, i| {
        if churned(place, i) { 5000 + i as i64 } else { 1000 + i as i64 }
    }))
    .await
    .unwrap();
    for p in places {
        h.send_sweep(BRAND, p, g3).await.unwrap();
    }
    h.wait_settled().await;
    let all = h.changes().await.unwrap();
    let new = &all[900..];
    assert_eq!(new.len(), 9, "1% churn must emit exactly the changed records");
    for c in new {
        assert_eq!(c.kind, ChangeKind::Updated as i32);
        let key = c.key.as_ref().unwrap();
        let i: usize = key.product_id.trim_start_matches("sku-").parse().unwrap();
        assert!(churned(key.place_id, i));
        let b = decode_product(&c.before.as_ref().unwrap().data);
        let a = decode_product(&c.after.as_ref().unwrap().data);
        assert_eq!(b.price, Some(1000 + i as i64));
        assert_eq!(a.price, Some(5000 + i as i64));
        assert_eq!(c.changed_data_fields, vec![shelfsync_proto::product_field::PRICE]);
        assert!(c.after.as_ref().unwrap().updated_at > c.before.as_ref().unwrap().updated_at);
    }
}

/// The owner skips Redis only for PATCHes it saw change nothing on the
/// record as it is now (applied to it, or tried once more on what it just
/// wrote); whatever else writes a record makes the next PATCH of it go
/// through Redis again, so the outcome is the one without skipping.
#[tokio::test]
async fn the_owner_skips_redis_only_for_patches_it_saw_change_nothing() {
    let (_env, h, storage) = start().await;
    let skipped = || shelfsync_storage::Stats::get(&storage.stats.known_skipped);
    let items = 50;
    let price = |_: i64, i: usize| 1000 + i as i64;
    let h = &h;
    let import = |generation| async move {
        h.send(full_import(&[1], items, generation, price)).await.unwrap();
        h.send_sweep(BRAND, 1, generation).await.unwrap();
        h.wait_settled().await;
    };
    let g1 = now_us();
    import(g1).await;
    assert_eq!(skipped(), 0, "nothing known before the records are written");
    // The owner tried each command once more on the record it wrote: a no-op.
    import(g1 + 1).await;
    assert_eq!(skipped(), items as u64, "the first identical re-import reads no record");
    import(g1 + 2).await;
    assert_eq!(skipped(), 2 * items as u64, "nor does the next");
    let r = h.get(BRAND, 1, "sku-3").await.unwrap().unwrap();
    assert_eq!(r.generation, g1, "vouched for: neither read nor written");
    assert_eq!(h.changes().await.unwrap().len(), items);

    // A sweep takes sku-2 (absent); then another source moves sku-1's price.
    let without_2: Vec<Command> = full_import(&[1], items, g1 + 3, price)
        .into_iter()
        .filter(|c| c.key.as_ref().unwrap().product_id != "sku-2")
        .collect();
    h.send(without_2).await.unwrap();
    h.send_sweep(BRAND, 1, g1 + 3).await.unwrap();
    h.wait_settled().await;
    assert!(h.get(BRAND, 1, "sku-2").await.unwrap().unwrap().absent);
    h.send(vec![patch(BRAND, 1, "sku-1", &product("item 1", 7, 1), 0)]).await.unwrap();
    h.wait_settled().await;
    let changes_before = h.changes().await.unwrap().len();

    // The same import again: sku-1 goes back to its price, sku-2 comes back,
    // every other record is vouched for.
    let at = skipped();
    import(g1 + 4).await;
    let new: Vec<_> = h.changes().await.unwrap().split_off(changes_before);
    let id = |c: &shelfsync_proto::Change| c.key.as_ref().unwrap().product_id.clone();
    let mut ids: Vec<String> = new.iter().map(id).collect();
    ids.sort();
    assert_eq!(ids, ["sku-1", "sku-2"], "exactly the records written by others change back");
    let sku1 = new.iter().find(|c| id(c) == "sku-1").unwrap();
    assert_eq!(decode_product(&sku1.after.as_ref().unwrap().data).price, Some(1001));
    assert!(new.iter().all(|c| !c.after.as_ref().unwrap().absent));
    assert_eq!(skipped() - at, items as u64 - 2, "every record but those two");
}

#[tokio::test]
async fn price_and_stock_feeds_glue_and_zero_is_a_value() {
    let (_env, h, _storage) = start().await;
    let content = Product {
        title: Some("Roses".into()),
        category: Some("roses".into()),
        ..Default::default()
    };
    let price = Product { price: Some(0), old_price: Some(100), ..Default::default() };
    let stock = Product { stock: Some(0), ..Default::default() };
    h.send(vec![patch(BRAND, 1, "a", &content, 0)]).await.unwrap();
    h.send(vec![patch(BRAND, 1, "a", &price, 0)]).await.unwrap();
    h.send(vec![patch(BRAND, 1, "a", &stock, 0)]).await.unwrap();
    h.wait_settled().await;
    let r = h.get(BRAND, 1, "a").await.unwrap().unwrap();
    let p = decode_product(&r.data);
    assert_eq!(p.title.as_deref(), Some("Roses"));
    assert_eq!(p.price, Some(0));
    assert_eq!(p.old_price, Some(100));
    assert_eq!(p.stock, Some(0));
    let changes = h.changes().await.unwrap();
    assert_eq!(changes.len(), 3);
    // The stock feed did not touch the price fields.
    assert_eq!(changes[2].changed_data_fields, vec![shelfsync_proto::product_field::STOCK]);
}

#[tokio::test]
async fn sweep_marks_absent_and_reappearance_restores() {
    let (_env, h, _storage) = start().await;
    let g1 = now_us();
    h.send(vec![
        patch(BRAND, 5, "stays", &product("s", 10, 1), g1),
        patch(BRAND, 5, "goes", &product("g", 20, 1), g1),
    ])
    .await
    .unwrap();
    h.send_sweep(BRAND, 5, g1).await.unwrap();
    let g2 = g1 + 10;
    h.send(vec![patch(BRAND, 5, "stays", &product("s", 10, 1), g2)]).await.unwrap();
    // A delta arriving during the import can neither save the vanished record
    // nor protect it from the sweep.
    h.send(vec![patch(BRAND, 5, "goes", &Product { price: Some(21), ..Default::default() }, 0)])
        .await
        .unwrap();
    h.send_sweep(BRAND, 5, g2).await.unwrap();
    h.wait_settled().await;
    let goes = h.get(BRAND, 5, "goes").await.unwrap().unwrap();
    assert!(goes.absent, "missing from the full import: swept");
    assert!(!h.get(BRAND, 5, "stays").await.unwrap().unwrap().absent);
    let changes = h.changes().await.unwrap();
    // 2 created, 1 price update of "goes", 1 sweep of "goes".
    assert_eq!(changes.len(), 4, "{changes:?}");
    let sweep = changes.last().unwrap();
    assert!(sweep.after.as_ref().unwrap().absent && !sweep.before.as_ref().unwrap().absent);

    // The next full import carries it again: present, one change.
    let g3 = g2 + 10;
    h.send(vec![
        patch(BRAND, 5, "stays", &product("s", 10, 1), g3),
        patch(BRAND, 5, "goes", &product("g", 21, 1), g3),
    ])
    .await
    .unwrap();
    h.send_sweep(BRAND, 5, g3).await.unwrap();
    h.wait_settled().await;
    assert!(!h.get(BRAND, 5, "goes").await.unwrap().unwrap().absent);
    assert_eq!(h.changes().await.unwrap().len(), 5);
}

/// A sweep of a place its owner knows is counted from memory, and still
/// marks exactly what its import left out after the place was written every
/// other way meanwhile (a delta creating a record, a delete, a sweep, a
/// record coming back). The owner knows a place it has counted once, or that
/// had no record when it first wrote it (an initial import); a restarted
/// owner counts a place with records in Redis again.
#[tokio::test]
async fn a_known_place_is_swept_exactly_without_scanning_it() {
    let (_env, settings, h, storage) = start_restartable().await;
    let scans = |s: &InProcessStorage| shelfsync_storage::Stats::get(&s.stats.sweep_scans);
    let p = product("p", 10, 1);
    let import = |ids: &'static [&'static str], generation: i64| {
        let h = &h;
        let p = &p;
        async move {
            h.send(ids.iter().map(|id| patch(BRAND, 3, id, p, generation)).collect())
                .await
                .unwrap();
            h.send_sweep(BRAND, 3, generation).await.unwrap();
            h.wait_settled().await;
        }
    };
    let absent = |id: &'static str| {
        let h = &h;
        async move { h.get(BRAND, 3, id).await.unwrap().unwrap().absent }
    };
    let g1 = now_us();
    import(&["a", "b", "c", "d", "e"], g1).await;
    assert_eq!(scans(&storage), 0, "a place that had no record is known from its first commit");
    // Meanwhile: a delta creates f, b is deleted.
    h.send(vec![patch(BRAND, 3, "f", &p, 0)]).await.unwrap();
    let mut delete = patch(BRAND, 3, "b", &p, 0);
    (delete.kind, delete.data) = (CommandKind::Delete as i32, Vec::new());
    h.send(vec![delete]).await.unwrap();
    h.wait_settled().await;

    import(&["a", "c"], g1 + 1).await;
    assert_eq!(scans(&storage), 0, "counted from memory");
    for (id, gone) in [("a", false), ("c", false), ("d", true), ("e", true), ("f", true)] {
        assert_eq!(absent(id).await, gone, "{id}");
    }
    assert!(h.get(BRAND, 3, "b").await.unwrap().unwrap().deleted, "b stays deleted");

    // d comes back; nothing else is left out.
    import(&["a", "c", "d"], g1 + 2).await;
    assert!(!absent("d").await);
    assert_eq!(scans(&storage), 0);
    let changes = h.changes().await.unwrap().len();
    // 5 created, f created, b deleted, d e f swept, d back.
    assert_eq!(changes, 11);

    // A new owner knows nothing: it reads the place, and sweeps d again.
    storage.stop().await.unwrap();
    let storage = InProcessStorage::start(settings).await.unwrap();
    import(&["a", "c"], g1 + 3).await;
    assert_eq!(scans(&storage), 1, "read again after a restart");
    assert!(absent("d").await);
    assert_eq!(h.changes().await.unwrap().len(), changes + 1);
}

#[tokio::test]
async fn cas_applies_when_current_and_rejects_when_stale() {
    let (_env, h, _storage) = start().await;
    h.send(vec![patch(BRAND, 1, "x", &product("x", 100, 1), 0)]).await.unwrap();
    h.wait_settled().await;
    let seen = h.get(BRAND, 1, "x").await.unwrap().unwrap().updated_at;
    h.send(vec![patch(BRAND, 1, "x", &Product { price: Some(200), ..Default::default() }, 0)])
        .await
        .unwrap();
    h.wait_settled().await;

    let hide = |expected: i64| Command {
        key: Some(RecordKey::new(BRAND, 1, "x")),
        kind: CommandKind::Patch as i32,
        state: RecordState { hidden: Some(true), ..Default::default() }.encode_to_vec(),
        expected_updated_at: Some(expected),
        ..Default::default()
    };
    // Stale: the record moved on since the validator looked.
    h.send(vec![hide(seen)]).await.unwrap();
    h.wait_settled().await;
    let r = h.get(BRAND, 1, "x").await.unwrap().unwrap();
    assert!(r.state.is_empty(), "a stale CAS must change nothing");
    let rejections = h.rejections().await.unwrap();
    assert_eq!(rejections.len(), 1);
    assert_eq!(rejections[0].reason, "conflict");
    assert_eq!(h.changes().await.unwrap().len(), 2);

    // Current: applies.
    h.send(vec![hide(r.updated_at)]).await.unwrap();
    h.wait_settled().await;
    let r2 = h.get(BRAND, 1, "x").await.unwrap().unwrap();
    assert_eq!(RecordState::decode(r2.state.as_slice()).unwrap().hidden, Some(true));
    let changes = h.changes().await.unwrap();
    assert_eq!(changes.len(), 3);
    assert_eq!(changes[2].changed_state_fields, vec![shelfsync_proto::state_field::HIDDEN]);
}

#[tokio::test]
async fn delete_leaves_a_tombstone_that_is_purged_after_the_ttl() {
    let env = TestEnv::start().await.unwrap();
    let mut settings = settings_for(&env);
    settings.storage.tombstone_ttl = Duration::from_secs(1);
    settings.storage.purge_interval = Duration::from_millis(200);
    let h = Harness::connect(settings.clone()).await.unwrap();
    let _storage = InProcessStorage::start(settings).await.unwrap();
    h.send(vec![patch(BRAND, 1, "d", &product("d", 1, 1), 0)]).await.unwrap();
    h.send(vec![Command {
        key: Some(RecordKey::new(BRAND, 1, "d")),
        kind: CommandKind::Delete as i32,
        ..Default::default()
    }])
    .await
    .unwrap();
    h.wait_settled().await;
    let changes = h.changes().await.unwrap();
    assert_eq!(changes.len(), 2);
    assert_eq!(changes[1].kind, ChangeKind::Deleted as i32);
    let tomb = h.get(BRAND, 1, "d").await.unwrap();
    assert!(tomb.is_some_and(|r| r.deleted), "tombstone kept until the TTL");
    eventually(Duration::from_secs(10), "tombstone purged", || async {
        h.get(BRAND, 1, "d").await.unwrap().is_none()
    })
    .await;
}

#[tokio::test]
async fn poison_messages_are_dead_lettered_without_blocking_the_partition() {
    let (_env, h, storage) = start().await;
    let p = h.partition(BRAND, 1);
    // Not a CommandBatch at all.
    h.send_raw(p, b"\xff\xff\xff not protobuf".to_vec()).await.unwrap();
    // A batch mixing good commands with a malformed one and an oversized one.
    let mut bad = patch(BRAND, 1, "bad", &product("b", 1, 1), 0);
    bad.data = vec![0xff, 0xff];
    let mut huge = patch(BRAND, 1, "huge", &product("h", 1, 1), 0);
    huge.data =
        Product { description: Some("x".repeat(300 * 1024)), ..Default::default() }.encode_to_vec();
    h.send(vec![
        patch(BRAND, 1, "good-1", &product("g", 1, 1), 0),
        bad,
        huge,
        patch(BRAND, 1, "good-2", &product("g", 2, 1), 0),
    ])
    .await
    .unwrap();
    h.wait_settled().await;
    assert!(h.get(BRAND, 1, "good-1").await.unwrap().is_some());
    assert!(h.get(BRAND, 1, "good-2").await.unwrap().is_some());
    assert!(h.get(BRAND, 1, "bad").await.unwrap().is_none());
    assert!(h.get(BRAND, 1, "huge").await.unwrap().is_none());
    let mut reasons: Vec<String> =
        h.rejections().await.unwrap().into_iter().map(|r| r.reason).collect();
    reasons.sort();
    assert_eq!(reasons, ["malformed", "too_large", "undecodable"]);
    assert_eq!(shelfsync_storage::Stats::get(&storage.stats.dead_lettered), 1);
    assert_eq!(h.changes().await.unwrap().len(), 2);
}

#[tokio::test]
async fn graceful_stop_and_restart_resume_where_they_left() {
    let (_env, settings, h, storage) = start_restartable().await;
    h.send(full_import(&[1, 2], 100, 0, |_, i| i as i64)).await.unwrap();
    h.wait_settled().await;
    storage.stop().await.unwrap();
    // Commands queue while storage is down.
    h.send(full_import(&[1, 2], 100, 0, |_, i| 1 + i as i64)).await.unwrap();
    let _storage = InProcessStorage::start(settings).await.unwrap();
    h.wait_settled().await;
    assert_eq!(h.changes().await.unwrap().len(), 400);
}

/// An operator, or a restart of servers that held it only in memory, can
/// remove a partition's command consumer: storage binds it again and goes
/// on, without stopping, losing or repeating a change.
#[tokio::test]
async fn a_removed_command_consumer_is_bound_again() {
    let (_env, h, storage) = start().await;
    h.send(full_import(&[1], 50, 0, |_, i| i as i64)).await.unwrap();
    h.wait_settled().await;
    // The owner's consumer of the partition's command subject.
    let name = h.storage_consumers(h.partition(BRAND, 1)).await.pop().expect("its consumer");
    let stream = h.js.get_stream(h.subjects.cmd_stream()).await.unwrap();
    assert!(stream.delete_consumer(&name).await.unwrap().success);
    // Sent while it is gone: applied once it is back.
    h.send(full_import(&[1], 50, 0, |_, i| 1 + i as i64)).await.unwrap();
    h.wait_settled().await;
    assert!(stream.consumer_info(&name).await.is_ok(), "the consumer is back");
    let changes = h.changes().await.unwrap();
    assert_eq!(changes.len(), 100);
    assert!(count_by_key(&changes).values().all(|&n| n == 2), "each record changed twice");
    assert_eq!(shelfsync_storage::Stats::get(&storage.stats.batches), 2);
}

/// Messages queued behind the delivered one are read from the stream and
/// committed with it. The outcome is still the serial one: every record and
/// every transition as if the messages had been applied one by one, sweeps
/// and repeated keys included.
#[tokio::test]
async fn a_queue_is_committed_in_batches_read_ahead_with_the_serial_outcome() {
    let env = TestEnv::start().await.unwrap();
    let settings = settings_for(&env);
    let h = Harness::connect(settings.clone()).await.unwrap();
    let places = [1, 2];
    // Small messages (3 commands), so that many fit in one read-ahead.
    let churn = Churn { brand: BRAND, places: places.to_vec(), items: 40, chunk: 3 };
    let batches = churn.batches(settings.storage.partitions);
    let mut model = SerialModel::new(settings.storage.partitions);
    for b in &batches {
        model.apply(b);
    }
    // The whole workload waits in the stream before storage starts.
    h.publish_batches("queued", &batches).await.unwrap();
    let storage = InProcessStorage::start(settings).await.unwrap();
    h.wait_settled().await;
    h.assert_serial(&model, BRAND, &places).await;
    let stats = &storage.stats;
    let get = shelfsync_storage::Stats::get;
    assert_eq!(get(&stats.batches), batches.len() as u64, "each message committed once");
    assert_eq!(get(&stats.changes), model.changes as u64, "every change counted once");
    let ahead = get(&stats.batches_ahead);
    eprintln!("{} messages, {ahead} committed ahead of their delivery", batches.len());
    assert!(ahead > batches.len() as u64 / 2, "most of the queue was read ahead: {ahead}");
}

/// Redis's count of keys modified (one per hash field, list element,
/// appended string...): the test servers keep no snapshots, so it only grows.
async fn redis_writes(h: &Harness) -> u64 {
    let mut conn = h.store.conn();
    let info: String = redis::cmd("INFO").arg("persistence").query_async(&mut conn).await.unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("rdb_changes_since_last_save:"))
        .expect("rdb_changes_since_last_save")
        .trim()
        .parse()
        .unwrap()
}

/// One place of `records` items, full import of `generation` in messages of
/// 1000, then its sweep.
async fn import_one_place(h: &Harness, place: i64, records: usize, generation: i64) {
    let batches: Vec<_> = (0..records)
        .collect::<Vec<_>>()
        .chunks(1000)
        .map(|ids| shelfsync_proto::CommandBatch {
            partition: h.partition(BRAND, place).0,
            commands: ids
                .iter()
                .map(|i| {
                    patch(
                        BRAND,
                        place,
                        &format!("sku-{i}"),
                        &product("Roses", 100 + *i as i64, 3),
                        generation,
                    )
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    h.publish_batches(&format!("g{generation}"), &batches).await.unwrap();
    h.send_sweep(BRAND, place, generation).await.unwrap();
    h.wait_settled().await;
}

/// Work follows changes: a full import that changes nothing writes no record
/// nor generation field, only what it carried (one append per place and
/// message) and where the partition stands — under 1% of its records, both
/// through Redis (the first time) and vouched for by the owner (after).
#[tokio::test]
async fn an_identical_reimport_writes_under_one_percent_of_its_records_to_redis() {
    let (_env, h, _storage) = start().await;
    let records = 20_000;
    import_one_place(&h, 1, records, 1).await;
    assert_eq!(h.changes().await.unwrap().len(), records);
    for generation in [2, 3] {
        let before = redis_writes(&h).await;
        import_one_place(&h, 1, records, generation).await;
        let writes = redis_writes(&h).await - before;
        eprintln!("identical re-import {generation} of {records} records: {writes} Redis writes");
        assert!(writes * 100 <= records as u64, "{writes} Redis writes for {records} records");
    }
    assert_eq!(h.changes().await.unwrap().len(), records, "identical re-imports emitted changes");
    for id in ["sku-0", "sku-19999"] {
        let r = h.get(BRAND, 1, id).await.unwrap().unwrap();
        assert!(!r.absent, "{id}: the sweep spared what its import carried");
        assert_eq!(r.generation, 1, "{id}: the last import that wrote it");
    }
    // A churned one is written and stamped; one left out is swept.
    let mut batch: Vec<Command> = (0..99)
        .map(|i| patch(BRAND, 1, &format!("sku-{i}"), &product("Roses", 100 + i as i64, 3), 4))
        .collect();
    batch[5] = patch(BRAND, 1, "sku-5", &product("Roses", 1, 3), 4);
    h.send(batch).await.unwrap();
    h.send_sweep(BRAND, 1, 4).await.unwrap();
    h.wait_settled().await;
    let r = h.get(BRAND, 1, "sku-5").await.unwrap().unwrap();
    assert_eq!((decode_product(&r.data).price, r.generation, r.absent), (Some(1), 4, false));
    let kept = h.get(BRAND, 1, "sku-6").await.unwrap().unwrap();
    assert_eq!((kept.generation, kept.absent), (1, false));
    assert!(h.get(BRAND, 1, "sku-99").await.unwrap().unwrap().absent, "not carried: swept");
    assert_eq!(h.changes().await.unwrap().len(), records + 1 + (records - 99));
}

/// The edge of the touched set: an import whose items were accepted but of
/// which storage keeps no trace (the set expired before its sweep came) is
/// not swept from generations alone; the sweep is held, nothing is marked.
#[tokio::test]
async fn a_guarded_sweep_without_a_trace_of_its_import_is_held() {
    let (_env, h, _storage) = start().await;
    h.send(full_import(&[1], 50, 1, |_, i| 1000 + i as i64)).await.unwrap();
    h.send_sweep(BRAND, 1, 1).await.unwrap();
    h.send(full_import(&[1], 40, 2, |_, i| 1000 + i as i64)).await.unwrap();
    h.wait_settled().await;
    let p = h.partition(BRAND, 1);
    let key = h.store.keys(p).touched((BRAND, 1).into(), 2);
    let mut conn = h.store.conn();
    let deleted: u64 = redis::cmd("DEL").arg(&key).query_async(&mut conn).await.unwrap();
    assert_eq!(deleted, 1, "the import's touched set was there");
    let sweep = shelfsync_proto::Sweep {
        brand_id: BRAND,
        place_id: 1,
        generation: 2,
        source: "test".into(),
        import_id: "test-2".into(),
        guard: Some(shelfsync_proto::SweepGuard {
            accepted: 40,
            max_fraction: 0.5,
            missing: false,
        }),
        ..Default::default()
    };
    let batch =
        shelfsync_proto::CommandBatch { partition: p.0, sweeps: vec![sweep], ..Default::default() };
    h.send_batch(p, &batch).await.unwrap();
    h.wait_settled().await;
    let held = h.store.held(p, (BRAND, 1).into()).await.unwrap().expect("held");
    assert_eq!((held.status.as_str(), held.reason.as_str()), ("held", "nothing_carried"));
    assert_eq!(held.candidates, 50, "without the set, every record looks left out");
    for i in 0..50 {
        assert!(!h.get(BRAND, 1, &format!("sku-{i}")).await.unwrap().unwrap().absent);
    }
}

/// A partition as an older version left it (Redis layout 1: generations in
/// a hash of their own, ids in a zset), written here by hand, is upgraded
/// when storage binds it: every generation moves into its record, the old
/// keys go, and imports, sweeps and reads come out as they would have.
#[tokio::test]
async fn a_partition_in_the_old_redis_layout_is_upgraded_when_storage_binds_it() {
    use shelfsync_proto::Record;
    let env = TestEnv::start().await.expect("servers");
    let settings = settings_for(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let keys = h.store.keys(h.partition(BRAND, 1));
    let (g0, g1, g2) = (500, 1_000, 2_000);
    // Recent, so that no purge of tombstones or absent records is due.
    let at = now_us();
    // sku-0..19 live, 20..24 absent, 25..29 deleted, all of g1; sku-30 as
    // an upgrade that stopped half-way leaves one: moved (g0), no entry.
    let mut pipe = redis::pipe();
    for i in 0..31i64 {
        let id = format!("sku-{i}");
        let (absent, deleted) = ((20..25).contains(&i), (25..30).contains(&i));
        let record = Record {
            data: product(&format!("item {i}"), 100 + i, i % 5).encode_to_vec(),
            absent,
            deleted,
            generation: if i == 30 { g0 } else { 0 },
            created_at: at,
            updated_at: at + i,
            ..Default::default()
        };
        pipe.hset(keys.records((BRAND, 1).into()), &id, record.encode_to_vec()).ignore();
        pipe.zadd(keys.legacy_ids((BRAND, 1).into()), &id, 0).ignore();
        if i < 30 {
            let flag = if deleted {
                "d"
            } else if absent {
                "a"
            } else {
                ""
            };
            pipe.hset(keys.legacy_gens((BRAND, 1).into()), &id, format!("{g1}{flag}")).ignore();
        }
        if deleted {
            pipe.zadd(keys.tombstones(), format!("{BRAND}:1:{id}"), at + i).ignore();
        } else if absent {
            pipe.zadd(keys.absent(), format!("{BRAND}:1:{id}"), at + i).ignore();
        }
    }
    pipe.sadd(keys.places(), format!("{BRAND}:1")).ignore();
    let mut conn = h.store.conn();
    let () = pipe.query_async(&mut conn).await.unwrap();

    let _storage = InProcessStorage::start(settings).await.expect("storage");
    // The next full import: sku-0 repriced, 1..15 and 30 as they were,
    // 16..19 left out (swept), then its sweep.
    let item = |i: i64| product(&format!("item {i}"), 100 + i, i % 5);
    let mut import: Vec<Command> =
        (0..16).chain([30]).map(|i| patch(BRAND, 1, &format!("sku-{i}"), &item(i), g2)).collect();
    import[0] = patch(BRAND, 1, "sku-0", &product("item 0", 1, 0), g2);
    h.send(import).await.unwrap();
    h.send_sweep(BRAND, 1, g2).await.unwrap();
    h.wait_settled().await;

    let layout: Option<String> =
        redis::cmd("GET").arg(keys.layout()).query_async(&mut conn).await.unwrap();
    assert_eq!(layout.as_deref(), Some(shelfsync_storage::client::LAYOUT));
    for old in [keys.legacy_gens((BRAND, 1).into()), keys.legacy_ids((BRAND, 1).into())] {
        let exists: bool = redis::cmd("EXISTS").arg(&old).query_async(&mut conn).await.unwrap();
        assert!(!exists, "{old} is gone");
    }
    let changes = h.changes().await.unwrap();
    let mut changed: Vec<&str> =
        changes.iter().map(|c| c.key.as_ref().map_or("", |k| k.product_id.as_str())).collect();
    changed.sort();
    assert_eq!(changed, ["sku-0", "sku-16", "sku-17", "sku-18", "sku-19"], "repriced and swept");
    let all = h.store.place_records(settings_partitions(&h), (BRAND, 1).into()).await.unwrap();
    assert_eq!(all.len(), 31);
    for r in &all {
        let id = &r.key.as_ref().expect("key").product_id;
        let i: i64 = id["sku-".len()..].parse().unwrap();
        let expected = match i {
            0 => (g2, false, false),
            1..=15 => (g1, false, false),
            16..=24 => (g1, true, false),
            25..=29 => (g1, false, true),
            _ => (g0, false, false),
        };
        assert_eq!((r.generation, r.absent, r.deleted), expected, "{id}");
        let read = h.get(BRAND, 1, id).await.unwrap().expect("exists");
        assert_eq!(&read, r, "{id}: a point read says the same");
    }
    // Pages (no id index any more) visit every record.
    let (mut paged, mut cursor) = (Vec::new(), String::new());
    loop {
        let (page, next) =
            h.store.page(settings_partitions(&h), (BRAND, 1).into(), &cursor, 4).await.unwrap();
        assert!(page.len() <= 4);
        paged.extend(page.into_iter().map(|r| r.key.expect("key").product_id));
        match next {
            Some(n) => cursor = n,
            None => break,
        }
    }
    paged.sort();
    paged.dedup();
    assert_eq!(paged.len(), 31, "{paged:?}");
    // Nothing of the old layout is written again, anywhere.
    let ns = &h.settings.redis.namespace;
    let old: Vec<String> =
        redis::cmd("KEYS").arg(format!("{{{ns}:p*}}:[gi]*")).query_async(&mut conn).await.unwrap();
    assert!(old.is_empty(), "old layout keys: {old:?}");
}

fn settings_partitions(h: &Harness) -> u32 {
    h.settings.storage.partitions
}

/// The outbox at the store, with no storage running: a commit's entries are
/// staged outside the commit script; a commit that finds the outbox not
/// empty appends to it in order, a fenced one leaves nothing behind, and an
/// earlier version's outbox list is adopted in order before what follows.
#[tokio::test]
async fn the_outbox_keeps_commit_order_and_a_fenced_commit_adds_nothing() {
    use shelfsync_bus::Partition;
    use shelfsync_storage::client::Commit;
    let env = TestEnv::start().await.expect("servers");
    let settings = settings_for(&env);
    let store = shelfsync_storage::client::Store::connect(&settings.redis).await.expect("store");
    const P: Partition = Partition(0);
    let commit = |from: u64, to: u64, n: u32| commit_outbox(&store, P, from, to, n);
    let ids = |entries: Vec<shelfsync_proto::OutboxEntry>| -> Vec<String> {
        entries.into_iter().map(|e| e.msg_id).collect()
    };
    // An earlier version's outbox: a list of entries, adopted first.
    let keys = store.keys(P);
    let mut conn = store.conn();
    let legacy: Vec<Vec<u8>> = outbox_entries(1, 2).iter().map(Message::encode_to_vec).collect();
    let () = redis::cmd("RPUSH")
        .arg(keys.legacy_outbox())
        .arg(&legacy)
        .query_async(&mut conn)
        .await
        .expect("rpush");
    assert_eq!(store.adopt_legacy_outbox(P).await.expect("adopt"), 2);
    assert_eq!(store.adopt_legacy_outbox(P).await.expect("adopt"), 0, "once");

    assert_eq!(commit(0, 2, 2).await, Commit::Done);
    assert_eq!(commit(0, 3, 1).await, Commit::Fenced);
    assert_eq!(commit(2, 3, 1).await, Commit::Done);
    let stage: bool =
        redis::cmd("EXISTS").arg(keys.outbox_stage()).query_async(&mut conn).await.expect("exists");
    assert!(!stage, "nothing staged is left behind");
    assert_eq!(store.outbox_len(P).await.expect("len"), 5);
    let head = ids(store.outbox_peek(P, 256).await.expect("peek"));
    let expected = ["chg:0:1:0", "chg:0:1:1", "chg:0:2:0", "chg:0:2:1", "chg:0:3:0"];
    assert_eq!(head, expected, "adopted, then in commit order; the fenced commit's not there");
    store.outbox_trim(P, 3).await.expect("trim");
    assert_eq!(ids(store.outbox_peek(P, 256).await.expect("peek")), expected[3..]);
    store.outbox_trim(P, 2).await.expect("trim");
    assert_eq!(store.outbox_len(P).await.expect("len"), 0);
    // Into an empty outbox, the staged entries are the outbox as they are,
    // known to the relay without a read; also when Redis lost the script
    // (a restart flushes them) and the commit is sent again after loading it.
    let () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.expect("flush");
    assert_eq!(commit(3, 4, 2).await, Commit::Done);
    assert_eq!(ids(store.outbox_peek(P, 256).await.expect("peek")), ["chg:0:4:0", "chg:0:4:1"]);
}

/// Outbox ids never repeat over a partition's life: a relay that lost its
/// partition and trims what it peeked late (by ids) never deletes entries a
/// later commit wrote, even when that commit comes within the same
/// millisecond as the entries trimmed before it.
#[tokio::test]
async fn a_stale_trim_never_drops_a_later_commit_s_entries() {
    use shelfsync_bus::Partition;
    use shelfsync_storage::client::Commit;
    let env = TestEnv::start().await.expect("servers");
    let settings = settings_for(&env);
    let connect = || shelfsync_storage::client::Store::connect(&settings.redis);
    let (stale, owner) = (connect().await.expect("store"), connect().await.expect("store"));
    const P: Partition = Partition(0);
    let commit = |store, from: u64, to: u64| commit_outbox(store, P, from, to, 2);
    let mut seq = 0;
    for round in 0..300 {
        assert_eq!(commit(&owner, seq, seq + 1).await, Commit::Done);
        // Both relays see the same two entries; the owner publishes and
        // trims them, then commits again at once (the same millisecond,
        // most rounds); the stale relay trims what it peeked, late.
        assert_eq!(stale.outbox_peek(P, 256).await.expect("peek").len(), 2);
        assert_eq!(owner.outbox_peek(P, 256).await.expect("peek").len(), 2);
        owner.outbox_trim(P, 2).await.expect("trim");
        assert_eq!(commit(&owner, seq + 1, seq + 2).await, Commit::Done);
        stale.outbox_trim(P, 2).await.expect("stale trim");
        let len = owner.outbox_len(P).await.expect("len");
        assert_eq!(len, 2, "round {round}: a stale trim dropped unpublished entries");
        seq += 2;
        let left: Vec<String> =
            owner.outbox_peek(P, 256).await.expect("peek").into_iter().map(|e| e.msg_id).collect();
        let expected = [format!("chg:0:{seq}:0"), format!("chg:0:{seq}:1")];
        assert_eq!(left, expected, "round {round}");
        owner.outbox_trim(P, 2).await.expect("trim");
    }
}

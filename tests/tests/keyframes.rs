//! Keyframes against real nats-server and redis-server: the parts, count and
//! digest of an on-demand snapshot, one-place snapshots, where the marker sits
//! in the change stream under live writes, the cron schedule, retention of old
//! keyframes, expired tombstones, tombstones purged while their place is
//! frozen, giving way to late live changes, and two replicas.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::consumer;
use futures::StreamExt;
use prost::Message;
use shelfsync_bus::digest::Digest;
use shelfsync_proto::{
    ChangeBatch, Command, CommandKind, KeyframeBatch, KeyframeMark, KeyframeReply, KeyframeRequest,
    Product, Record, RecordKey,
};
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;
/// A keyframe of a few thousand records takes well under a second; this is
/// only the point where a test gives up.
const KEYFRAME_TIMEOUT: Duration = Duration::from_secs(30);

fn sku(i: usize) -> String {
    format!("sku-{i}")
}

/// Creates `n` records in each place, at most 1000 commands per message.
async fn write_places(h: &Harness, places: &[i64], n: usize) {
    let mut commands = Vec::new();
    for &place in places {
        for i in 0..n {
            let p = product(&format!("item {i}"), 1000 + i as i64, (i % 5) as i64);
            commands.push(patch(BRAND, place, &sku(i), &p, 0));
        }
    }
    for chunk in commands.chunks(1000) {
        h.send(chunk.to_vec()).await.expect("send");
    }
}

/// One message as the stream holds it.
struct Stored {
    seq: u64,
    payload: Vec<u8>,
}

/// Every message of `stream` on subjects matching `filter`, in stream order.
async fn read_filtered(h: &Harness, stream: &str, filter: &str) -> anyhow::Result<Vec<Stored>> {
    let stream = h.js.get_stream(stream).await?;
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            filter_subject: filter.to_string(),
            ..Default::default()
        })
        .await?;
    let expected = consumer.cached_info().num_pending;
    let mut out = Vec::new();
    if expected == 0 {
        return Ok(out);
    }
    let mut messages = consumer.messages().await?;
    while (out.len() as u64) < expected {
        let msg = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("reading stream timed out")?
            .context("message stream ended")??;
        let seq = msg.info().map_err(|e| anyhow::anyhow!("{e}"))?.stream_sequence;
        out.push(Stored { seq, payload: msg.payload.to_vec() });
    }
    Ok(out)
}

/// The keyframes of one place on the KEYFRAMES stream, grouped by run (id
/// and snapshot time) in stream order, each with its parts in stream order.
async fn keyframes_of(h: &Harness, brand: i64, place: i64) -> Vec<(String, Vec<KeyframeBatch>)> {
    let raw = read_filtered(h, &h.subjects.keyframes_stream(), &h.subjects.keyframes(brand, place))
        .await
        .expect("read keyframes");
    let mut out: Vec<(String, Vec<KeyframeBatch>)> = Vec::new();
    let mut first_seq = 0;
    for m in raw {
        let b = KeyframeBatch::decode(m.payload.as_slice()).expect("KeyframeBatch decodes");
        assert_eq!((b.brand_id, b.place_id), (brand, place), "keyframe part on the wrong subject");
        match out.last_mut() {
            // One run: same id and same snapshot time (an id may be reused).
            Some((id, parts)) if *id == b.keyframe_id && parts[0].as_of == b.as_of => {
                assert_eq!(b.first_seq, first_seq, "part {} points back at part 0", b.part);
                parts.push(b);
            }
            _ => {
                first_seq = m.seq;
                out.push((b.keyframe_id.clone(), vec![b]));
            }
        }
    }
    out
}

/// The messages on one place's change subject, decoded, with their sequence.
async fn place_changes(h: &Harness, brand: i64, place: i64) -> Vec<(u64, ChangeBatch)> {
    read_filtered(h, &h.subjects.changes_stream(), &h.subjects.changes(brand, place))
        .await
        .expect("read changes")
        .into_iter()
        .map(|m| (m.seq, ChangeBatch::decode(m.payload.as_slice()).expect("ChangeBatch decodes")))
        .collect()
}

/// Checks the shape of one keyframe's parts and returns its records and its
/// last part.
fn check_parts(parts: &[KeyframeBatch]) -> (Vec<Record>, &KeyframeBatch) {
    let first = parts.first().expect("a keyframe has at least one part");
    let mut records = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        assert_eq!(p.part as usize, i, "parts numbered 0..n in stream order");
        assert_eq!(p.last, i + 1 == parts.len(), "`last` set on the final part only (part {i})");
        assert!(p.records.len() <= 1000, "part {i} holds {} records", p.records.len());
        assert_eq!(
            (&p.keyframe_id, p.as_of, p.command_seq, p.changes_seq, p.tombstone_cutoff),
            (
                &first.keyframe_id,
                first.as_of,
                first.command_seq,
                first.changes_seq,
                first.tombstone_cutoff
            ),
            "parts of one keyframe describe the same snapshot"
        );
        records.extend(p.records.iter().cloned());
    }
    let last = parts.last().expect("non-empty");
    assert_eq!(last.total as usize, records.len(), "total counts the records carried");
    (records, last)
}

fn delete(place: i64, id: &str) -> Command {
    Command {
        key: Some(RecordKey::new(BRAND, place, id)),
        kind: CommandKind::Delete as i32,
        ..Default::default()
    }
}

fn product_id(r: &Record) -> &str {
    r.key.as_ref().map_or("", |k| k.product_id.as_str())
}

/// The digest as any consumer computes it (docs/DESIGN.md, Keyframes).
fn digest_of<'a>(items: impl IntoIterator<Item = (&'a str, i64)>) -> Digest {
    let mut d = Digest::default();
    for (id, updated_at) in items {
        d.add(id, updated_at);
    }
    d
}

fn sorted(mut records: Vec<Record>) -> Vec<Record> {
    records.sort_by(|a, b| product_id(a).cmp(product_id(b)));
    records
}

async fn request_keyframe(h: &Harness, id: &str, brand: i64, place: i64) -> KeyframeReply {
    let req = KeyframeRequest { keyframe_id: id.to_string(), brand_id: brand, place_id: place };
    let request = async_nats::Request::new()
        .payload(req.encode_to_vec().into())
        .timeout(Some(KEYFRAME_TIMEOUT));
    let msg =
        h.client.send_request(h.subjects.ctl_keyframe(), request).await.expect("a keyframe reply");
    let reply = KeyframeReply::decode(msg.payload.as_ref()).expect("KeyframeReply decodes");
    assert!(reply.error.is_empty(), "keyframe failed: {}", reply.error);
    reply
}

#[tokio::test]
async fn keyframe_of_every_place_is_storage_state_in_parts_with_digest_and_marker() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start().await;
    let places = [1, 2, 3];
    write_places(&h, &places, 1500).await;
    h.wait_settled().await;

    let reply = request_keyframe(&h, "", 0, 0).await;
    assert_eq!((reply.places, reply.records), (3, 4500), "{reply:?}");
    assert!(!reply.keyframe_id.is_empty(), "storage names an unnamed keyframe");

    let partitions = h.settings.storage.partitions;
    for place in places {
        let keyframes = keyframes_of(&h, BRAND, place).await;
        assert_eq!(keyframes.len(), 1, "place {place}: one keyframe");
        let (id, parts) = &keyframes[0];
        assert_eq!(id, &reply.keyframe_id);
        assert!(parts.len() >= 2, "1500 records cannot fit one part of ≤ 1000");
        let (records, last) = check_parts(parts);

        // Exactly storage's state: ids, data, state, flags, timestamps, generations.
        let state =
            sorted(h.store.place_records(partitions, (BRAND, place).into()).await.expect("redis"));
        assert_eq!(state.len(), 1500);
        assert_eq!(sorted(records), state, "place {place}: keyframe differs from storage");
        let d = digest_of(state.iter().map(|r| (product_id(r), r.updated_at)));
        assert_eq!((last.total, last.digest), (d.count, d.sum), "place {place}: total/digest");
        let ttl = h.settings.storage.tombstone_ttl.as_micros() as i64;
        assert_eq!(last.tombstone_cutoff, last.as_of - ttl);
        let partition = h.partition(BRAND, place).0;
        assert_eq!(
            last.command_seq,
            h.store.applied_seq(shelfsync_bus::Partition(partition)).await.expect("redis")
        );

        // The marker follows every change of the place, with the same numbers.
        let changes = place_changes(&h, BRAND, place).await;
        let ((marker_seq, marker), before) = changes.split_last().expect("changes of the place");
        assert!(marker.changes.is_empty(), "a marker carries no changes");
        let expected = KeyframeMark {
            keyframe_id: reply.keyframe_id.clone(),
            total: d.count,
            digest: d.sum,
            as_of: last.as_of,
            tombstone_cutoff: last.tombstone_cutoff,
        };
        assert_eq!(marker.keyframe.as_ref(), Some(&expected), "place {place}: marker");
        assert!(before.iter().all(|(_, b)| b.keyframe.is_none()), "one marker per keyframe");
        assert_eq!(before.iter().map(|(_, b)| b.changes.len()).sum::<usize>(), 1500);
        let last_change_seq = before.last().map_or(0, |(s, _)| *s);
        assert!(
            last_change_seq <= last.changes_seq && last.changes_seq < *marker_seq,
            "changes_seq {} must be at or after the place's last change ({last_change_seq}) \
             and before its marker ({marker_seq})",
            last.changes_seq
        );
    }
}

#[tokio::test]
async fn one_place_keyframe_publishes_only_that_place() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start().await;
    write_places(&h, &[1, 2], 40).await;
    h.wait_settled().await;

    let reply = request_keyframe(&h, "bootstrap-1", BRAND, 2).await;
    assert_eq!(reply.keyframe_id, "bootstrap-1", "a named keyframe keeps its name");
    assert_eq!((reply.places, reply.records), (1, 40), "{reply:?}");

    let all = read_filtered(&h, &h.subjects.keyframes_stream(), &h.subjects.keyframes_all())
        .await
        .expect("read keyframes");
    for m in &all {
        let b = KeyframeBatch::decode(m.payload.as_slice()).expect("decodes");
        assert_eq!((b.brand_id, b.place_id), (BRAND, 2), "only the asked place is snapshotted");
    }
    let keyframes = keyframes_of(&h, BRAND, 2).await;
    assert_eq!(keyframes.len(), 1);
    let (records, last) = check_parts(&keyframes[0].1);
    assert_eq!(records.len(), 40);
    assert!(last.last && last.total == 40);

    let marked = |changes: &[(u64, ChangeBatch)]| {
        changes.iter().filter(|(_, b)| b.keyframe.is_some()).count()
    };
    assert_eq!(marked(&place_changes(&h, BRAND, 2).await), 1);
    assert_eq!(marked(&place_changes(&h, BRAND, 1).await), 0, "no marker for the other place");
}

/// The key properties: the keyframe is the place exactly after the command
/// it was frozen at (`command_seq`), and the marker's digest is the place
/// exactly where the marker sits in the change stream — later, since the
/// keyframe is published (here slowly, paced) while live writes go on.
#[tokio::test]
async fn keyframe_during_live_writes_matches_a_replay_up_to_its_marker() {
    // 300 records a second: each place's parts take a second to go out.
    let Stack { h, storage: _storage, env: _env, .. } =
        Stack::start_with(|s| s.storage.keyframe_rate = 300).await;
    let places = [1, 2, 3];
    const ITEMS: usize = 300;
    write_places(&h, &places, ITEMS).await;
    h.wait_settled().await;
    let initial = h.changes().await.expect("changes").len();
    assert_eq!(initial, places.len() * ITEMS);

    let h = Arc::new(h);
    let stop = Arc::new(AtomicBool::new(false));
    let sends = Arc::new(AtomicU64::new(0));
    let writer = tokio::spawn({
        let (h, stop, sends) = (h.clone(), stop.clone(), sends.clone());
        async move {
            let mut n = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let mut batch = Vec::new();
                for _ in 0..30 {
                    n += 1;
                    let place = places[n % places.len()];
                    let id = sku((n * 7919) % ITEMS);
                    // Prices always move; some records are created and some
                    // deleted (and re-created later), so the set of ids moves too.
                    let cmd = if n.is_multiple_of(11) {
                        patch(BRAND, place, &format!("live-{n}"), &product("new", n as i64, 1), 0)
                    } else if n.is_multiple_of(13) {
                        delete(place, &id)
                    } else {
                        let price =
                            Product { price: Some(100_000 + n as i64), ..Default::default() };
                        patch(BRAND, place, &id, &price, 0)
                    };
                    batch.push(cmd);
                }
                h.send(batch).await?;
                sends.fetch_add(1, Ordering::SeqCst);
            }
            anyhow::Ok(())
        }
    });

    // Live writes are being applied before the keyframe is asked for ...
    eventually(SETTLE, "live writes to reach the change stream", || async {
        h.changes().await.is_ok_and(|c| c.len() > initial + 100)
    })
    .await;
    let reply = request_keyframe(&h, "", 0, 0).await;
    assert_eq!(reply.places, 3, "{reply:?}");
    // ... and go on after it.
    let at_reply = sends.load(Ordering::SeqCst);
    eventually(SETTLE, "more live writes after the keyframe", || async {
        sends.load(Ordering::SeqCst) >= at_reply + 10
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    writer.await.expect("writer task").expect("writer sends");
    h.wait_settled().await;

    let (mut live_before, mut live_after, mut live_between) = (0usize, 0usize, 0usize);
    let mut records_total = 0u64;
    let fold = |batches: &[&ChangeBatch]| {
        let mut state: BTreeMap<String, i64> = BTreeMap::new();
        for b in batches {
            for c in &b.changes {
                let after = c.after.as_ref().expect("every change carries the record after");
                state.insert(c.key.as_ref().expect("key").product_id.clone(), after.updated_at);
            }
        }
        state
    };
    for place in places {
        let keyframes = keyframes_of(&h, BRAND, place).await;
        assert_eq!(keyframes.len(), 1, "place {place}");
        let (records, last) = check_parts(&keyframes[0].1);
        records_total += records.len() as u64;

        let mut ids = HashSet::new();
        for r in &records {
            assert!(
                ids.insert(product_id(r).to_string()),
                "{} twice in the keyframe",
                product_id(r)
            );
            let now = h.get(BRAND, place, product_id(r)).await.expect("redis");
            assert!(now.is_some(), "{} is in the keyframe but not in storage", product_id(r));
        }

        let changes = place_changes(&h, BRAND, place).await;
        let at = changes
            .iter()
            .position(|(_, b)| {
                b.keyframe.as_ref().is_some_and(|k| k.keyframe_id == reply.keyframe_id)
            })
            .expect("the place's marker is on its change subject");
        assert_eq!(changes.iter().filter(|(_, b)| b.keyframe.is_some()).count(), 1);
        let mark = changes[at].1.keyframe.clone().expect("marker");
        let before: Vec<&ChangeBatch> = changes[..at].iter().map(|(_, b)| b).collect();

        // The keyframe: every change of a command up to the frozen one.
        let frozen: Vec<&ChangeBatch> =
            before.iter().copied().filter(|b| b.command_seq <= last.command_seq).collect();
        let at_freeze = fold(&frozen);
        let snapshot: BTreeMap<String, i64> =
            records.iter().map(|r| (product_id(r).to_string(), r.updated_at)).collect();
        assert!(
            at_freeze == snapshot,
            "place {place}: keyframe differs from a replay to its freeze"
        );
        let d = digest_of(at_freeze.iter().map(|(id, at)| (id.as_str(), *at)));
        assert_eq!((last.total, last.digest), (d.count, d.sum), "place {place}: keyframe digest");

        // The marker: every change before it in the stream.
        let at_marker = fold(&before);
        let d = digest_of(at_marker.iter().map(|(id, at)| (id.as_str(), *at)));
        assert_eq!((mark.total, mark.digest), (d.count, d.sum), "place {place}: marker vs replay");

        let changes_before: usize = before.iter().map(|b| b.changes.len()).sum();
        live_before += changes_before - ITEMS;
        live_between += before.len() - frozen.len();
        live_after += changes[at + 1..].iter().map(|(_, b)| b.changes.len()).sum::<usize>();
    }
    println!("live change batches between freezes and markers: {live_between}");
    assert!(live_between > 0, "no live write landed between a freeze and its marker");
    println!("live changes: {live_before} before the markers, {live_after} after");
    assert_eq!(reply.records, records_total);
    assert!(live_before > 0, "no live write landed before the keyframe");
    assert!(live_after > 0, "no live write landed after the keyframe");
}

#[tokio::test]
async fn the_schedule_fires_without_a_request() {
    let Stack { h, storage: _storage, env: _env, .. } =
        Stack::start_with(|s| s.storage.keyframe_schedule = "*/2 * * * * *".into()).await;
    write_places(&h, &[4], 3).await;
    h.wait_settled().await;
    eventually(
        Duration::from_secs(15),
        "a scheduled keyframe of place 4 with its 3 records",
        || async {
            keyframes_of(&h, BRAND, 4)
                .await
                .iter()
                .any(|(_, parts)| parts.last().is_some_and(|p| p.last && p.total == 3))
        },
    )
    .await;
    let keyframes = keyframes_of(&h, BRAND, 4).await;
    let (id, parts) = keyframes
        .iter()
        .find(|(_, parts)| parts.last().is_some_and(|p| p.total == 3))
        .expect("found above");
    // Named after its tick: a whole even second.
    let micros: i64 =
        id.strip_prefix("kf-").and_then(|t| t.parse().ok()).unwrap_or_else(|| panic!("id {id}"));
    assert_eq!(micros % 2_000_000, 0, "tick of */2 s, got {id}");
    let (records, last) = check_parts(parts);
    let d = digest_of(records.iter().map(|r| (product_id(r), r.updated_at)));
    assert_eq!((last.total, last.digest), (d.count, d.sum));
}

#[tokio::test]
async fn only_the_newest_keyframes_of_a_place_are_kept() {
    let Stack { h, storage: _storage, env: _env, .. } =
        Stack::start_with(|s| s.storage.keyframes_kept = 2).await;
    // Two parts per keyframe, so a purge must keep whole keyframes.
    write_places(&h, &[1], 1200).await;
    write_places(&h, &[2], 10).await;
    h.wait_settled().await;

    let first = request_keyframe(&h, "kf-r1", 0, 0).await;
    assert_eq!(first.places, 2);
    for id in ["kf-r2", "kf-r3", "kf-r4"] {
        let reply = request_keyframe(&h, id, BRAND, 1).await;
        assert_eq!((reply.places, reply.records), (1, 1200));
    }

    let kept = keyframes_of(&h, BRAND, 1).await;
    let ids: Vec<&str> = kept.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["kf-r3", "kf-r4"], "place 1 keeps its 2 newest keyframes");
    for (_, parts) in &kept {
        let (records, _) = check_parts(parts);
        assert_eq!(records.len(), 1200, "kept keyframes are whole");
    }
    // Purging is per place: place 2's only keyframe stays.
    let other: Vec<String> =
        keyframes_of(&h, BRAND, 2).await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(other, ["kf-r1"]);
}

#[tokio::test]
async fn expired_tombstones_are_left_out_and_fresh_ones_carried() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start_with(|s| {
        s.storage.tombstone_ttl = Duration::from_secs(1);
        // The purge must not get to the expired tombstone before the keyframe.
        s.storage.purge_interval = Duration::from_secs(3600);
    })
    .await;
    write_places(&h, &[1], 5).await;
    h.send(vec![delete(1, &sku(0))]).await.expect("send");
    h.wait_settled().await;
    let old = h.get(BRAND, 1, &sku(0)).await.expect("redis").expect("tombstone");
    eventually(Duration::from_secs(5), "sku-0's tombstone to pass its TTL", || async {
        now_us() > old.updated_at + 1_100_000
    })
    .await;
    h.send(vec![delete(1, &sku(1))]).await.expect("send");
    h.wait_settled().await;

    let reply = request_keyframe(&h, "", BRAND, 1).await;
    assert_eq!(reply.records, 4, "{reply:?}");
    let keyframes = keyframes_of(&h, BRAND, 1).await;
    let (records, last) = check_parts(&keyframes[0].1);
    let mut ids: Vec<String> = records.iter().map(|r| product_id(r).to_string()).collect();
    ids.sort();
    assert_eq!(
        ids,
        ["sku-1", "sku-2", "sku-3", "sku-4"],
        "the expired tombstone is as good as purged"
    );
    let fresh = records.iter().find(|r| product_id(r) == "sku-1").expect("fresh tombstone");
    assert!(fresh.deleted, "a fresh tombstone is carried as deleted");
    assert!(old.updated_at < last.tombstone_cutoff && last.tombstone_cutoff <= fresh.updated_at);
    let d = digest_of(records.iter().map(|r| (product_id(r), r.updated_at)));
    assert_eq!((last.total, last.digest), (d.count, d.sum));
    // Still in Redis: left out by the keyframe, not by a purge.
    assert!(h.get(BRAND, 1, &sku(0)).await.expect("redis").is_some_and(|r| r.deleted));
    let changes = place_changes(&h, BRAND, 1).await;
    let mark = changes.last().and_then(|(_, b)| b.keyframe.clone()).expect("marker last");
    assert_eq!(mark.tombstone_cutoff, last.tombstone_cutoff);
}

#[tokio::test]
async fn records_purged_while_their_place_is_frozen_stay_in_its_keyframe() {
    // 300 records a second: the 3 000 records go out in three parts, and
    // the last two are read after the purge, ≈2 s after the deletes.
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start_with(|s| {
        s.storage.keyframe_rate = 300;
        s.storage.tombstone_ttl = Duration::from_secs(2);
        s.storage.purge_interval = Duration::from_millis(200);
    })
    .await;
    const ITEMS: usize = 3000;
    write_places(&h, &[1], ITEMS).await;
    h.wait_settled().await;
    let deleted: Vec<String> = (0..ITEMS).step_by(20).map(sku).collect();
    h.send(deleted.iter().map(|id| delete(1, id)).collect()).await.expect("send");
    h.wait_settled().await;
    let first = h.get(BRAND, 1, &deleted[0]).await.expect("redis").expect("tombstone");

    let reply = request_keyframe(&h, "", BRAND, 1).await;
    let mut purged = 0;
    for id in &deleted {
        purged += usize::from(h.get(BRAND, 1, id).await.expect("redis").is_none());
    }
    assert_eq!(purged, deleted.len(), "the tombstones were purged while the keyframe was out");
    let keyframes = keyframes_of(&h, BRAND, 1).await;
    let (records, last) = check_parts(&keyframes[0].1);
    assert!(
        last.tombstone_cutoff <= first.updated_at,
        "premise: the tombstones were fresh when the place was frozen"
    );
    assert_eq!(reply.records as usize, ITEMS, "{reply:?}");
    assert_eq!(records.len(), ITEMS);
    let tombstones: HashSet<&str> = records.iter().filter(|r| r.deleted).map(product_id).collect();
    let expected: HashSet<&str> = deleted.iter().map(String::as_str).collect();
    assert_eq!(tombstones, expected, "every tombstone as frozen, purged since or not");
    let d = digest_of(records.iter().map(|r| (product_id(r), r.updated_at)));
    assert_eq!((last.total, last.digest), (d.count, d.sum));
    let changes = place_changes(&h, BRAND, 1).await;
    let mark = changes.last().and_then(|(_, b)| b.keyframe.clone()).expect("marker last");
    // A purge changes no record's digest term: the tombstones are still
    // counted at the marker, as by a consumer that never saw them go.
    assert_eq!((mark.total, mark.digest), (d.count, d.sum));
}

/// A keyframe of 1 000 records paced at 1 000 a second (a 1 s share of
/// time) while live commands published a minute ago keep arriving; returns
/// the reply and the time the keyframe gave way to them, microseconds.
async fn keyframe_behind_late_commands(yield_after: Duration) -> (KeyframeReply, u64) {
    let Stack { h, storage, env: _env, .. } = Stack::start_with(|s| {
        s.storage.keyframe_rate = 1000;
        s.storage.keyframe_yield_after = yield_after;
    })
    .await;
    const ITEMS: usize = 500;
    write_places(&h, &[1, 2], ITEMS).await;
    h.wait_settled().await;

    let h = Arc::new(h);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn({
        let (h, stop) = (h.clone(), stop.clone());
        async move {
            let a_minute_ago = now_us() - 60_000_000;
            let mut n = 0usize;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let price = Product { price: Some(100_000 + n as i64), ..Default::default() };
                let mut cmd = patch(BRAND, 1 + (n % 2) as i64, &sku(n % ITEMS), &price, 0);
                cmd.origin.as_mut().expect("origin").published_at = a_minute_ago;
                h.send(vec![cmd]).await?;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            anyhow::Ok(())
        }
    });
    let reply = request_keyframe(&h, "", 0, 0).await;
    stop.store(true, Ordering::SeqCst);
    writer.await.expect("writer task").expect("writer sends");
    (reply, storage.stats.keyframe_yield_us.load(Ordering::SeqCst))
}

#[tokio::test]
async fn a_keyframe_gives_way_to_late_live_changes_at_most_twice_its_share_of_time() {
    let (reply, yielded_us) = keyframe_behind_late_commands(Duration::from_millis(20)).await;
    assert_eq!((reply.places, reply.records), (2, 1000), "{reply:?}");
    println!("gave way for {yielded_us} µs");
    assert!(yielded_us > 0, "the keyframe never gave way to late live changes");
    assert!(yielded_us <= 2_000_000, "gave way for {yielded_us} µs, more than twice its 1 s share");
}

#[tokio::test]
async fn a_keyframe_told_not_to_give_way_does_not() {
    let (reply, yielded_us) = keyframe_behind_late_commands(Duration::ZERO).await;
    assert_eq!((reply.places, reply.records), (2, 1000), "{reply:?}");
    assert_eq!(yielded_us, 0);
}

/// Two replicas splitting the partitions: storage started twice with its
/// replica number, the same servers and namespace.
async fn start_two_replicas() -> (TestEnv, Harness, InProcessStorage, InProcessStorage) {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = storage_settings(&env);
    settings.storage.replicas = 2;
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let mut one = settings.clone();
    one.storage.replica = 1;
    let r0 = InProcessStorage::start(settings).await.expect("replica 0");
    let r1 = InProcessStorage::start(one).await.expect("replica 1");
    (env, h, r0, r1)
}

/// Places spread over both replicas' partitions.
fn places_on_both_replicas(h: &Harness) -> Vec<i64> {
    let mut places = Vec::new();
    let mut owners = HashSet::new();
    for place in 1.. {
        places.push(place);
        owners.insert(h.partition(BRAND, place).0 % 2);
        if places.len() >= 3 && owners.len() == 2 {
            return places;
        }
    }
    unreachable!("places are unbounded")
}

#[tokio::test]
async fn every_replica_keyframes_the_places_it_owns() {
    let (_env, h, _r0, _r1) = start_two_replicas().await;
    let places = places_on_both_replicas(&h);
    write_places(&h, &places, 20).await;
    h.wait_settled().await;

    let req = KeyframeRequest { keyframe_id: "kf-both".into(), brand_id: 0, place_id: 0 };
    let inbox = h.client.new_inbox();
    let mut replies = h.client.subscribe(inbox.clone()).await.expect("subscribe");
    h.client
        .publish_with_reply(h.subjects.ctl_keyframe(), inbox, req.encode_to_vec().into())
        .await
        .expect("publish");
    let mut got = Vec::new();
    while got.len() < 2 {
        let msg = tokio::time::timeout(KEYFRAME_TIMEOUT, replies.next())
            .await
            .expect("a reply of each replica")
            .expect("subscription open");
        got.push(KeyframeReply::decode(msg.payload.as_ref()).expect("KeyframeReply"));
    }
    got.sort_by_key(|r| r.replica);
    assert_eq!(got.iter().map(|r| r.replica).collect::<Vec<_>>(), [0, 1], "{got:?}");
    assert!(got.iter().all(|r| r.error.is_empty() && r.keyframe_id == "kf-both"), "{got:?}");
    assert_eq!(got.iter().map(|r| r.places).sum::<u32>() as usize, places.len());
    assert_eq!(got.iter().map(|r| r.records).sum::<u64>() as usize, places.len() * 20);
    for place in places {
        let keyframes = keyframes_of(&h, BRAND, place).await;
        assert_eq!(keyframes.len(), 1, "place {place}: exactly one replica snapshots it");
        assert_eq!(check_parts(&keyframes[0].1).0.len(), 20);
    }
}

/// `keyframe_id_at` promises one id "for one schedule tick or request"; a
/// request that leaves the id to storage gets one id per replica.
#[tokio::test]
async fn one_request_names_one_keyframe_across_replicas() {
    let (_env, h, _r0, _r1) = start_two_replicas().await;
    let places = places_on_both_replicas(&h);
    write_places(&h, &places, 5).await;
    h.wait_settled().await;
    let replies =
        shelfsync_bus::request_keyframe(&h.client, &h.subjects, None, 2, KEYFRAME_TIMEOUT)
            .await
            .expect("request");
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert_eq!(replies[0].keyframe_id, replies[1].keyframe_id, "{replies:?}");
}

/// A keyframe id given twice (a retried request, a client reusing a name)
/// must still leave a well-formed keyframe of the current state.
#[tokio::test]
async fn a_reused_keyframe_id_does_not_mix_two_snapshots() {
    let Stack { h, storage: _storage, env: _env, .. } = Stack::start().await;
    write_places(&h, &[1], 1000).await;
    h.wait_settled().await;
    request_keyframe(&h, "kf-again", BRAND, 1).await;
    // 500 more records: the second snapshot needs a second part.
    let more: Vec<Command> =
        (1000..1500).map(|i| patch(BRAND, 1, &sku(i), &product("more", i as i64, 1), 0)).collect();
    h.send(more).await.expect("send");
    h.wait_settled().await;
    let reply = request_keyframe(&h, "kf-again", BRAND, 1).await;
    assert_eq!(reply.records, 1500);

    let state = sorted(
        h.store
            .place_records(h.settings.storage.partitions, (BRAND, 1).into())
            .await
            .expect("redis"),
    );
    let keyframes = keyframes_of(&h, BRAND, 1).await;
    let (_, parts) = keyframes.last().expect("a keyframe");
    let (records, last) = check_parts(parts);
    assert_eq!(sorted(records), state, "the newest keyframe is the current state");
    let marks: Vec<KeyframeMark> =
        place_changes(&h, BRAND, 1).await.into_iter().filter_map(|(_, b)| b.keyframe).collect();
    assert_eq!(marks.last().map(|m| (m.total, m.digest)), Some((last.total, last.digest)));
}

//! Fault scenario 9 (docs/RELIABILITY.md): a corpus of bad input, for ingest
//! (partner feeds) and for storage (command messages). Each bad piece gets a
//! clear error or a counted rejection with a stable reason; the good data in
//! the same feed or stream lands; nothing crashes and no partition blocks.
//!
//! The item-level rules are unit-tested in `services/ingest/src/item.rs`
//! and `feed.rs`; here the corpus goes end to end, through the importer,
//! NATS and storage, in one feed.

use std::collections::BTreeMap;

use async_nats::jetstream::message::PublishMessage;
use prost::Message;
use shelfsync_bus::{Partition, TYPE_HEADER};
use shelfsync_proto::{Command, CommandBatch, CommandKind, Product, RecordKey, Sweep, msg_type};
use shelfsync_settings::{ImportKind, PartnerSettings};
use shelfsync_storage::Stats;
use shelfsync_tests::*;

const BRAND: i64 = 7;

fn partner(name: &str) -> PartnerSettings {
    PartnerSettings {
        name: name.into(),
        brand_id: BRAND,
        kind: ImportKind::Full,
        fields: [
            "title",
            "category",
            "price",
            "old_price",
            "currency",
            "stock",
            "images",
            "description",
        ]
        .map(String::from)
        .to_vec(),
        ..Default::default()
    }
}

async fn start() -> Importing {
    Importing::start(vec![partner("nested"), partner("lines")]).await
}

/// Last sequences of the CMD and REJECTS streams: what was ever published.
async fn published(h: &Harness) -> (u64, u64) {
    let mut last = [0; 2];
    let names = [h.subjects.cmd_stream(), h.subjects.rejects_stream()];
    for (last, name) in last.iter_mut().zip(names) {
        let mut stream = h.js.get_stream(&name).await.expect("stream");
        *last = stream.info().await.expect("stream info").state.last_sequence;
    }
    (last[0], last[1])
}

async fn stored(h: &Harness, place: i64, id: &str) -> Option<Product> {
    let r = h.get(BRAND, place, id).await.expect("get")?;
    Some(decode_product(&r.data))
}

fn nest(depth: usize) -> String {
    format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
}

#[tokio::test]
async fn a_bad_feed_corpus_is_rejected_item_by_item_and_the_good_items_land() {
    let t = start().await;
    // The nested format: every bad item is rejected alone.
    let nested = format!(
        r#"{{"brand_id": 7, "generator": {{"deep": {deep}}}, "places": [{{"place_id": 1, "items": [
            {{"id": "good-1", "title": "Roses", "price": 100, "stock": 1, "colour": "red", "x": {{"y": [1, {{"z": null}}]}}}},
            17,
            {{"title": "no id"}},
            {{"id": "str-price", "price": "12.50"}},
            {{"id": "float-price", "price": 1.5}},
            {{"id": "huge", "price": 99999999999999999999999}},
            {{"id": "huge-negative", "stock": -1e30}},
            {{"id": "bool-stock", "stock": true}},
            {{"id": "deep-title", "title": {deep}}},
            {{"id": "deep-extra", "title": "ok", "extra": {deep}}},
            {{"id": "{long_id}"}},
            {{"id": "big", "description": "{big}"}},
            {{"id": "negative-stock", "title": "t", "price": 0, "stock": -3}},
            {{"id": "null-title", "title": null, "price": 5}},
            {{"id": "good-1", "title": "duplicate"}},
            {{"id": "emoji", "title": "Розы 🌹 \u00e9"}}
        ]}}]}}"#,
        deep = nest(20_000),
        long_id = "x".repeat(300),
        big = "d".repeat(100 * 1024),
    );
    let r = t.import("nested", nested.as_bytes()).await.expect("the feed lands despite bad items");
    let expected: BTreeMap<String, u64> = [
        ("duplicate_id", 1),
        ("invalid_value", 1),
        ("missing_id", 1),
        ("not_an_object", 1),
        ("out_of_range", 2),
        ("too_large", 1),
        ("wrong_type", 4),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(r.rejected, expected, "rejections by reason");
    assert_eq!(r.items, 5, "good-1, deep-extra, negative-stock, null-title, emoji");
    let good = stored(&t.h, 1, "good-1").await.expect("good-1 landed");
    assert_eq!((good.title.as_deref(), good.price), (Some("Roses"), Some(100)));
    let neg = stored(&t.h, 1, "negative-stock").await.expect("business rules are the validator's");
    assert_eq!((neg.price, neg.stock), (Some(0), Some(-3)));
    assert!(stored(&t.h, 1, "deep-extra").await.is_some(), "deep unknown fields are skipped");
    assert_eq!(stored(&t.h, 1, "null-title").await.expect("landed").title, None);
    assert_eq!(stored(&t.h, 1, "emoji").await.expect("landed").title.as_deref(), Some("Розы 🌹 é"));
    for id in ["str-price", "huge", "deep-title", "big", "bool-stock"] {
        assert!(t.h.get(BRAND, 1, id).await.expect("get").is_none(), "{id} must not land");
    }

    // NDJSON: lines are independent, so even broken JSON, NaN and invalid
    // UTF-8 cost one line each.
    let mut lines: Vec<Vec<u8>> = vec![
        br#"{"id":"n-good-1","brand_id":7,"place_id":2,"title":"ok","price":1}"#.to_vec(),
        br#"{"id":"n-nan","place_id":2,"price":NaN}"#.to_vec(),
        br#"{"id":"n-inf","place_id":2,"price":Infinity}"#.to_vec(),
        br#"{"id":"n-trunc","place_id":2,"pri"#.to_vec(),
        b"not json at all".to_vec(),
        b"{\"id\":\"n-utf8\",\"place_id\":2,\"title\":\"\xff\xfe\"}".to_vec(),
        br#"{"id":"n-surrogate","place_id":2,"title":"\ud800"}"#.to_vec(),
        br#"{"id":"n-brand","brand_id":8,"place_id":2}"#.to_vec(),
        br#"{"id":"n-noplace","brand_id":7}"#.to_vec(),
        br#"{"id":"n-place-type","place_id":"2"}"#.to_vec(),
        format!(r#"{{"id":"n-big","place_id":2,"description":"{}"}}"#, "d".repeat(100 * 1024))
            .into_bytes(),
        format!(r#"{{"id":"n-deep","place_id":2,"title":"deep","x":{}}}"#, nest(20_000))
            .into_bytes(),
        br#"{"id":"n-good-1","place_id":2,"title":"again"}"#.to_vec(),
        br#"{"id":"n-good-2","place_id":2,"title":"ok","stock":-1,"unknown":{"a":[1,2]}}"#.to_vec(),
    ];
    lines.push(Vec::new()); // a blank line is skipped
    let r = t.import("lines", &lines.join(&b'\n')).await.expect("NDJSON lands despite bad lines");
    assert_eq!(r.items, 3, "n-good-1, n-deep, n-good-2: {:?}", r.rejected);
    assert_eq!(r.rejected_total, 11, "{:?}", r.rejected);
    for (reason, n) in [
        ("malformed", 5),
        ("brand_mismatch", 1),
        ("missing_place", 1),
        ("too_large", 1),
        ("duplicate_id", 1),
    ] {
        assert_eq!(r.rejected.get(reason), Some(&n), "{reason} in {:?}", r.rejected);
    }
    assert!(stored(&t.h, 2, "n-good-2").await.is_some());

    // Every rejection is on the REJECTS stream, with its reason and detail.
    let rejections = t.h.rejections().await.expect("rejections");
    assert_eq!(rejections.len(), 11 + 11, "the nested feed's and the NDJSON feed's");
    for rej in &rejections {
        assert!(!rej.reason.is_empty() && !rej.detail.is_empty(), "{rej:?}");
    }
    assert_eq!(Stats::get(&t.storage.stats.dead_lettered), 0);
}

#[tokio::test]
async fn feeds_that_cannot_be_read_fail_clearly_sweep_nothing_and_block_nothing() {
    let t = start().await;
    let good = |n: usize| {
        let items: Vec<String> =
            (0..n).map(|i| format!(r#"{{"id":"sku-{i}","title":"t","price":{i}}}"#)).collect();
        format!(r#"{{"brand_id":7,"places":[{{"place_id":1,"items":[{}]}}]}}"#, items.join(","))
    };
    t.import("nested", good(10).as_bytes()).await.expect("first import");
    let changes = t.h.changes().await.expect("changes").len();

    let truncated = good(10);
    let mut invalid_utf8 = good(3).into_bytes();
    let at = invalid_utf8.windows(3).position(|w| w == b"\"t\"").expect("a title") + 1;
    invalid_utf8[at] = 0xff;
    // Good items and a bad one, the brand after them: nothing may be
    // published before the brand is checked, rejections included.
    let places = r#"[{"place_id":1,"items":[{"id":"sku-0","title":"not ours","price":1},{"id":"x","price":"1"}]}]"#;
    let key = "k".repeat(16 << 20);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("HTML error page", b"<html><body>502 Bad Gateway</body></html>".to_vec(), "not json"),
        ("empty", b"  \n".to_vec(), "empty"),
        ("truncated", truncated.as_bytes()[..truncated.len() / 2].to_vec(), "malformed"),
        ("invalid UTF-8", invalid_utf8, "malformed"),
        (
            "NaN in an item",
            br#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a","price":NaN}]}]}"#
                .to_vec(),
            "malformed",
        ),
        ("wrong brand", br#"{"brand_id":8,"places":[]}"#.to_vec(), "brand"),
        ("places not an array", br#"{"brand_id":7,"places":{"place_id":1}}"#.to_vec(), "malformed"),
        (
            "deeply nested places",
            format!(r#"{{"brand_id":7,"places":{}}}"#, nest(100_000)).into_bytes(),
            "malformed",
        ),
        (
            "wrong brand after places",
            format!(r#"{{"places":{places},"brand_id":8}}"#).into_bytes(),
            "brand 8",
        ),
        ("no brand", format!(r#"{{"places":{places}}}"#).into_bytes(), "no top-level `brand_id`"),
        (
            "brand twice, after places",
            format!(r#"{{"places":{places},"brand_id":7,"brand_id":7}}"#).into_bytes(),
            "given twice",
        ),
        (
            "brand twice, before places",
            format!(r#"{{"brand_id":7,"brand_id":8,"places":{places}}}"#).into_bytes(),
            "given twice",
        ),
        (
            "a 16 MB top-level key",
            format!(r#"{{"{key}":1,"brand_id":7,"places":{places}}}"#).into_bytes(),
            "an object key is larger than",
        ),
        (
            "a 16 MB key in a place",
            format!(r#"{{"brand_id":7,"places":[{{"{key}":1,"place_id":1,"items":[]}}]}}"#)
                .into_bytes(),
            "an object key is larger than",
        ),
        (
            "a 16 MB key in an item",
            format!(
                r#"{{"brand_id":7,"places":[{{"place_id":1,"items":[{{"{key}":1,"id":"a"}}]}}]}}"#
            )
            .into_bytes(),
            "an item is larger than",
        ),
        (
            "a 16 MB key in places before the brand",
            format!(r#"{{"places":[{{"place_id":1,"{key}":1}}],"brand_id":7}}"#).into_bytes(),
            "an object key is larger than",
        ),
    ];
    for (what, body, needle) in cases {
        let before = published(&t.h).await;
        let err = t.import("nested", &body).await.expect_err(what);
        let text = err.to_string();
        assert!(err.is_bad_feed(), "{what}: {err:?}");
        assert!(text.to_lowercase().contains(&needle.to_lowercase()), "{what}: {text}");
        assert!(text.len() < 400, "{what}: the error stays readable: {text}");
        if what != "truncated" {
            // A truncated feed's items before the cut are valid PATCHes and
            // go out; nothing else here has a good item before its fault.
            assert_eq!(published(&t.h).await, before, "{what}: nothing published");
        }
    }
    // Nothing was swept by a failed import, nothing changed.
    for i in 0..10 {
        let r = t.h.get(BRAND, 1, &format!("sku-{i}")).await.expect("get").expect("record");
        assert!(!r.absent, "sku-{i} swept by a failed import");
    }
    assert_eq!(
        t.h.changes().await.expect("changes").len(),
        changes,
        "failed imports changed nothing"
    );
    // Junk nested deep under an unknown key is skipped; the feed lands.
    // sku-0 to sku-8: sweeping sku-9 marks a tenth of the place absent.
    let items: Vec<String> = (1..9).map(|i| format!(r#"{{"id":"sku-{i}","price":{i}}}"#)).collect();
    let deep_meta = format!(
        r#"{{"brand_id":7,"meta":{},"places":[{{"place_id":1,"items":[{{"id":"sku-0","title":"new","price":0}},{}]}}]}}"#,
        nest(100_000),
        items.join(",")
    );
    let r = t.import("nested", deep_meta.as_bytes()).await.expect("deep junk under an unknown key");
    assert_eq!((r.items, r.sweeps, r.sweeps_applied, r.marked_absent), (9, 1, 1, 1));
    assert_eq!(stored(&t.h, 1, "sku-0").await.expect("record").title.as_deref(), Some("new"));
    assert!(
        t.h.get(BRAND, 1, "sku-9").await.expect("get").expect("record").absent,
        "a good full import sweeps"
    );
    // The brand after `places`, right: every item lands and the place is swept.
    let late =
        good(5).replacen(r#""brand_id":7,"#, "", 1).replacen("]}]}", r#"]}],"brand_id":7}"#, 1);
    assert!(late.ends_with(r#""brand_id":7}"#), "{late}");
    let r = t.import("nested", late.as_bytes()).await.expect("the brand may come last");
    assert_eq!((r.items, r.sweeps), (5, 1));
    assert!(!t.h.get(BRAND, 1, "sku-4").await.expect("get").expect("record").absent);
    assert!(t.h.get(BRAND, 1, "sku-9").await.expect("get").expect("record").absent);
}

/// A place of `BRAND` whose partition is not `p`.
fn place_elsewhere(h: &Harness, p: Partition) -> i64 {
    (2..).find(|&place| h.partition(BRAND, place) != p).expect("another partition")
}

fn cmd(place: i64, id: &str, kind: CommandKind, data: Vec<u8>) -> Command {
    Command {
        key: Some(RecordKey::new(BRAND, place, id)),
        kind: kind as i32,
        data,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_bad_command_corpus_is_rejected_or_dead_lettered_and_the_partition_flows_on() {
    let Stack { h, storage, settings, env: _env } = Stack::start().await;
    let p = h.partition(BRAND, 1);
    let other = place_elsewhere(&h, p);
    let good = |id: &str, price: i64| patch(BRAND, 1, id, &product("Roses", price, 1), 0);
    let batch =
        |commands: Vec<Command>| CommandBatch { partition: p.0, commands, ..Default::default() };

    let mut model = SerialModel::new(settings.storage.partitions);
    let mut raw: Vec<Vec<u8>> = Vec::new();
    let mut decodable = |b: CommandBatch, raw: &mut Vec<Vec<u8>>| {
        model.apply(&b);
        raw.push(b.encode_to_vec());
    };
    decodable(batch(vec![good("first", 1)]), &mut raw);
    // Not a CommandBatch: not protobuf, cut short, groups nested 10 000 deep.
    raw.push(b"\xff\xff\xff not protobuf".to_vec());
    let whole = batch(vec![good("cut", 1), good("cut-2", 2)]).encode_to_vec();
    raw.push(whole[..whole.len() - 3].to_vec());
    raw.push([vec![0x7b; 10_000], vec![0x7c; 10_000]].concat());
    // An empty message is an empty batch: nothing to do, nothing to reject.
    raw.push(Vec::new());
    let mut long_id = good("x", 1);
    long_id.key = Some(RecordKey::new(BRAND, 1, "x".repeat(600)));
    let mut keyless = good("x", 1);
    keyless.key = None;
    let mut stale = good("first", 7);
    stale.expected_updated_at = Some(1);
    let mut unknown_kind = good("kind", 1);
    unknown_kind.kind = 99;
    let title_invalid_utf8 = [
        vec![0x0a, 0x02, 0xff, 0xfe],
        Product { price: Some(1), ..Default::default() }.encode_to_vec(),
    ]
    .concat();
    let unknown_field = [
        Product { title: Some("t".into()), ..Default::default() }.encode_to_vec(),
        vec![0xf8, 0x06, 42],
    ]
    .concat();
    decodable(
        batch(vec![
            keyless,
            cmd(1, "", CommandKind::Patch, vec![]),
            long_id,
            cmd(other, "elsewhere", CommandKind::Patch, vec![]),
            unknown_kind,
            cmd(1, "bad-wire", CommandKind::Patch, vec![0xff, 0xff]),
            cmd(1, "group", CommandKind::Patch, vec![0xa3, 0x01, 0xa4, 0x01]),
            cmd(
                1,
                "huge",
                CommandKind::Save,
                Product { description: Some("x".repeat(300 * 1024)), ..Default::default() }
                    .encode_to_vec(),
            ),
            stale,
            // Accepted: storage is schema-agnostic and business rules are
            // the validator's.
            cmd(1, "bad-utf8", CommandKind::Patch, title_invalid_utf8),
            cmd(1, "unknown-field", CommandKind::Patch, unknown_field),
            good("negative", 5),
            patch(BRAND, 1, "negative", &Product { stock: Some(-4), ..Default::default() }, 0),
            good("twice", 1),
            good("twice", 2),
        ]),
        &mut raw,
    );
    // Over the contract: 1001 commands in one message (refused whole,
    // counted before anything is allocated for them).
    raw.push(batch((0..1001).map(|i| good(&format!("many-{i}"), 1)).collect()).encode_to_vec());
    // A sweep on the command subject (only ingest and the CLI may send one,
    // on the sweep subject): refused, the message's commands still apply.
    let mut forged = batch(vec![good("beside-a-forged-sweep", 1)]);
    decodable(forged.clone(), &mut raw);
    forged.sweeps =
        vec![Sweep { brand_id: BRAND, place_id: 1, generation: i64::MAX, ..Default::default() }];
    *raw.last_mut().expect("just pushed") = forged.encode_to_vec();
    decodable(batch(vec![good("last", 1)]), &mut raw);
    for payload in raw {
        h.send_raw(p, payload).await.expect("publish");
    }
    // A message over the server's max payload never gets in.
    let oversized = PublishMessage::build()
        .payload(vec![0u8; 2 << 20].into())
        .header(TYPE_HEADER, msg_type::COMMAND_BATCH);
    let refused = async { h.js.send_publish(h.subjects.cmd(p), oversized).await?.await }.await;
    let err = refused.expect_err("a 2 MB message is refused").to_string();
    assert!(err.to_lowercase().contains("payload"), "{err}");
    h.wait_settled().await;

    h.assert_serial(&model, BRAND, &[1, other]).await;
    assert!(h.get(BRAND, 1, "last").await.expect("get").is_some(), "the partition flowed on");
    let mut reasons: Vec<String> =
        h.rejections().await.expect("rejections").into_iter().map(|r| r.reason).collect();
    reasons.sort();
    let mut expected: Vec<String> = model.rejections.clone();
    expected.extend(["undecodable"; 3].map(String::from));
    expected.extend(["too_large", "sweep_forbidden"].map(String::from));
    expected.sort();
    assert_eq!(reasons, expected);
    assert_eq!(
        model.rejections.iter().filter(|r| *r == "malformed").count(),
        6,
        "keyless, empty id, long id, unknown kind, bad wire, group: {:?}",
        model.rejections
    );
    for r in ["wrong_partition", "too_large", "conflict"] {
        assert!(model.rejections.iter().any(|x| x == r), "{r} in {:?}", model.rejections);
    }
    assert_eq!(
        Stats::get(&storage.stats.dead_lettered),
        4,
        "the undecodable messages and the one over the limit, each once"
    );
    assert!(h.get(BRAND, 1, "many-0").await.expect("get").is_none(), "set aside whole");
    let unknown = h.get(BRAND, 1, "unknown-field").await.expect("get").expect("stored");
    assert!(unknown.data.ends_with(&[0xf8, 0x06, 42]), "an unknown field is kept as is");
    let neg = h.get(BRAND, 1, "negative").await.expect("get").expect("stored");
    assert_eq!(decode_product(&neg.data).stock, Some(-4));
}

#[tokio::test]
async fn compressed_batches_are_read_and_a_bad_encoding_is_dead_lettered_once() {
    use shelfsync_bus::encoding::{ENCODING_HEADER, LZ4, compress};
    let Stack { h, storage, env: _env, .. } = Stack::start().await;
    let p = h.partition(BRAND, 1);
    let good = |id: &str, price: i64| patch(BRAND, 1, id, &product("Roses", price, 1), 0);
    let batch =
        |commands: Vec<Command>| CommandBatch { partition: p.0, commands, ..Default::default() };
    let send = |payload: Vec<u8>, encoding: &'static str| {
        let msg = PublishMessage::build()
            .payload(payload.into())
            .header(TYPE_HEADER, msg_type::COMMAND_BATCH)
            .header(ENCODING_HEADER, encoding);
        let (js, subject) = (h.js.clone(), h.subjects.cmd(p));
        async move { js.send_publish(subject, msg).await?.await.map(drop) }
    };
    send(compress(&batch(vec![good("packed", 3)]).encode_to_vec()), LZ4).await.expect("sent");
    // Not an LZ4 block; a length prefix of 4 GiB; an encoding nobody knows.
    send(b"\x40\x00\x00\x00 not lz4 at all".to_vec(), LZ4).await.expect("sent");
    send(vec![255, 255, 255, 255, 1, 2, 3], LZ4).await.expect("sent");
    send(batch(vec![good("zstd", 1)]).encode_to_vec(), "zstd").await.expect("sent");
    // Plain protobuf still goes through after them.
    h.send_raw(p, batch(vec![good("plain", 4)]).encode_to_vec()).await.expect("sent");
    h.wait_settled().await;

    for (id, price) in [("packed", 3), ("plain", 4)] {
        let got = stored(&h, 1, id).await.unwrap_or_else(|| panic!("{id} stored"));
        assert_eq!(got.price, Some(price), "{id}");
    }
    assert!(stored(&h, 1, "zstd").await.is_none(), "an unknown encoding is not guessed at");
    let rejections = h.rejections().await.expect("rejections");
    let details: Vec<(&str, &str)> =
        rejections.iter().map(|r| (r.reason.as_str(), r.detail.as_str())).collect();
    assert_eq!(details.len(), 3, "each bad message once: {details:?}");
    let has =
        |reason: &str, text: &str| details.iter().any(|(r, d)| *r == reason && d.contains(text));
    assert!(has("undecodable", "corrupt lz4"), "{details:?}");
    // Over the decoded limit (twice the server's max payload), before any allocation.
    assert!(has("too_large", "more than the"), "{details:?}");
    assert!(has("undecodable", "\"zstd\""), "{details:?}");
    // Each kept whole, as it came, with the encoding it came with.
    assert!(rejections.iter().all(|r| !r.raw.is_empty() && !r.raw_encoding.is_empty()));
    assert_eq!(Stats::get(&storage.stats.dead_lettered), 3);
}

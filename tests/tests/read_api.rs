//! Storage's read API against real servers: HTTP (JSON, `data` and `state`
//! decoded) and NATS request/reply (protobuf) answer exactly what storage
//! holds, and a bad request gets a 400 / a `ReadReply.error` that says what
//! is wrong.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use prost::Message;
use serde_json::{Value, json};
use shelfsync_proto::json::record_to_json;
use shelfsync_proto::{
    Command, CommandKind, Product, ReadReply, ReadRequest, Record, RecordKey, RecordState,
};
use shelfsync_service::Service as _;
use shelfsync_settings::Settings;
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;

/// Servers, harness, and a storage built here so that its HTTP port is known.
struct Api {
    h: Harness,
    base: String,
    http: reqwest::Client,
    _storage: Running,
    _env: TestEnv,
}

async fn start(tune: impl FnOnce(&mut Settings)) -> Api {
    let env = TestEnv::start().await.expect("servers");
    let mut settings = settings_for(&env);
    settings.storage.keyframe_schedule = String::new();
    tune(&mut settings);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let app = shelfsync_storage::App::build(settings).await.expect("storage");
    let base = format!("http://{}", app.http_addr());
    let storage = spawn_with(|shutdown| app.run_until(shutdown));
    // reqwest is built without a default TLS provider; plain HTTP still needs one installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder().build().expect("HTTP client");
    Api { h, base, http, _storage: storage, _env: env }
}

impl Api {
    async fn get(&self, path: &str) -> (u16, Value) {
        let resp = self.http.get(format!("{}{path}", self.base)).send().await.expect("GET");
        Self::json(resp).await
    }

    async fn post(&self, path: &str, body: &str) -> (u16, Value) {
        let resp = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("POST");
        Self::json(resp).await
    }

    async fn json(resp: reqwest::Response) -> (u16, Value) {
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.expect("body");
        let value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!("{status} body is not JSON ({e}): {}", String::from_utf8_lossy(&bytes))
        });
        (status, value)
    }

    /// A NATS read; retried while storage has not subscribed yet.
    async fn nats_raw(&self, what: &str, payload: Vec<u8>) -> ReadReply {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.h.client.request(self.h.subjects.read(what), payload.clone().into()).await {
                Ok(msg) => {
                    return ReadReply::decode(msg.payload.as_ref()).expect("ReadReply decodes");
                }
                Err(e)
                    if e.kind() == async_nats::RequestErrorKind::NoResponders
                        && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("read.{what}: {e}"),
            }
        }
    }

    async fn nats(&self, what: &str, req: &ReadRequest) -> ReadReply {
        self.nats_raw(what, req.encode_to_vec()).await
    }

    async fn stored(&self, place: i64, id: &str) -> Option<Record> {
        self.h.get(BRAND, place, id).await.expect("redis")
    }

    async fn place_records(&self, place: i64) -> BTreeMap<String, Record> {
        let partitions = self.h.settings.storage.partitions;
        self.h
            .store
            .place_records(partitions, (BRAND, place).into())
            .await
            .expect("redis")
            .into_iter()
            .map(|r| (product_id(&r).to_string(), r))
            .collect()
    }
}

fn product_id(r: &Record) -> &str {
    r.key.as_ref().map_or("", |k| k.product_id.as_str())
}

fn sku(i: usize) -> String {
    format!("sku-{i}")
}

async fn write_place(h: &Harness, place: i64, n: usize) {
    write_place_with(h, place, n, "").await;
}

/// As `write_place`, each product carrying `description` when not empty.
async fn write_place_with(h: &Harness, place: i64, n: usize, description: &str) {
    let commands: Vec<Command> = (0..n)
        .map(|i| {
            let mut p = product(&format!("item {i}"), 100 + i as i64, 1);
            if !description.is_empty() {
                p.description = Some(description.to_string());
            }
            patch(BRAND, place, &sku(i), &p, 0)
        })
        .collect();
    for chunk in commands.chunks(1000) {
        h.send(chunk.to_vec()).await.expect("send");
    }
}

fn delete(place: i64, id: &str) -> Command {
    Command {
        key: Some(RecordKey::new(BRAND, place, id)),
        kind: CommandKind::Delete as i32,
        ..Default::default()
    }
}

fn error_of(body: &Value) -> &str {
    body["error"].as_str().unwrap_or_else(|| panic!("no JSON error in {body}"))
}

/// Every record of a place over HTTP, page by page (opaque cursors), in
/// visiting order.
async fn http_all_pages(api: &Api, place: i64, limit: usize) -> (Vec<Value>, Vec<usize>) {
    let mut cursor: Option<String> = None;
    let mut records = Vec::new();
    let mut sizes = Vec::new();
    for _ in 0..1000 {
        let from = cursor.as_deref().map(|c| format!("&cursor={}", encode(c))).unwrap_or_default();
        let (status, body) =
            api.get(&format!("/v1/places/{BRAND}/{place}/records?limit={limit}{from}")).await;
        assert_eq!(status, 200, "{body}");
        let page = body["records"].as_array().expect("records array");
        sizes.push(page.len());
        records.extend(page.iter().cloned());
        match body["next_cursor"].as_str() {
            Some(next) => {
                // A client of the old contract (`after`/`next_after`) does
                // not stop after page one: it is told to move on.
                let old = body["next_after"].as_str().expect("next_after while pages remain");
                assert!(!old.is_empty(), "{body}");
                cursor = Some(next.to_string());
            }
            None => {
                assert!(body["next_after"].is_null(), "{body}");
                return (records, sizes);
            }
        }
    }
    panic!("paging did not end after 1000 pages");
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test]
async fn http_point_read_decodes_the_record_and_explains_errors() {
    let api = start(|_| {}).await;
    let state = RecordState {
        hidden: Some(false),
        reasons: vec!["checked".into()],
        decided_by: Some("validator".into()),
        ..Default::default()
    };
    let mut rose = patch(BRAND, 1, "rose-1", &product("Red roses", 0, 3), 0);
    rose.state = state.encode_to_vec();
    let odd = patch(BRAND, 1, "a b/ä", &product("Odd id", 5, 0), 0);
    api.h.send(vec![rose, odd]).await.expect("send");
    api.h.wait_settled().await;
    let stored = api.stored(1, "rose-1").await.expect("stored");

    let (status, body) = api.get("/v1/records/7/1/rose-1").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["key"], json!({"brand_id": 7, "place_id": 1, "product_id": "rose-1"}));
    assert_eq!(body["data"]["title"], "Red roses");
    assert_eq!(body["data"]["price"], json!(0), "a price of 0 is a value: {body}");
    assert_eq!(body["data"]["stock"], json!(3));
    assert_eq!(body["data"]["currency"], "RUB");
    assert_eq!(
        body["state"],
        json!({"hidden": false, "reasons": ["checked"], "decided_by": "validator"})
    );
    assert_eq!((body["absent"].clone(), body["deleted"].clone()), (json!(false), json!(false)));
    assert_eq!(body["updated_at"], json!(stored.updated_at));
    assert_eq!(body["created_at"], json!(stored.created_at));
    assert_eq!(body, record_to_json(&stored), "exactly storage's record");

    // A product id with a space, a slash and a non-ASCII letter, percent-encoded.
    let (status, body) = api.get("/v1/records/7/1/a%20b%2F%C3%A4").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["key"]["product_id"], "a b/ä");

    let (status, body) = api.get("/v1/records/7/1/nope").await;
    assert_eq!(status, 404, "{body}");
    assert!(!error_of(&body).is_empty());

    let (status, body) = api.get(&format!("/v1/records/7/1/{}", "x".repeat(600))).await;
    assert_eq!(status, 400, "{body}");
    assert!(error_of(&body).contains("512"), "the message gives the bound: {body}");

    let (status, body) = api.get("/v1/records/abc/1/rose-1").await;
    assert_eq!(status, 400, "{body}");
    let msg = error_of(&body);
    assert!(msg.contains("brand") && msg.contains("abc"), "the message names the brand: {msg}");

    let (status, body) = api.get("/v1/records/7/x1/rose-1").await;
    assert_eq!(status, 400, "{body}");
    assert!(error_of(&body).contains("place"), "{body}");
}

#[tokio::test]
async fn http_batch_read_splits_found_and_missing_and_refuses_bad_bodies() {
    let api = start(|s| s.storage.read_max_batch = 5).await;
    write_place(&api.h, 1, 2).await;
    api.h.wait_settled().await;

    let (status, body) =
        api.post("/v1/records/7/1", r#"{"product_ids": ["sku-1", "nope", "sku-0"]}"#).await;
    assert_eq!(status, 200, "{body}");
    let expected = json!([
        record_to_json(&api.stored(1, "sku-1").await.expect("stored")),
        record_to_json(&api.stored(1, "sku-0").await.expect("stored")),
    ]);
    assert_eq!(body["records"], expected, "found records, in the order asked");
    assert_eq!(body["missing"], json!(["nope"]));

    // Exactly the limit is fine; one more is refused and says why.
    let five = r#"{"product_ids": ["a", "b", "c", "d", "sku-0"]}"#;
    let (status, body) = api.post("/v1/records/7/1", five).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["missing"].as_array().map(Vec::len), Some(4));
    let (status, body) =
        api.post("/v1/records/7/1", r#"{"product_ids": ["a", "b", "c", "d", "e", "f"]}"#).await;
    assert_eq!(status, 400, "{body}");
    let msg = error_of(&body);
    assert!(msg.contains('6') && msg.contains('5') && msg.contains("limit"), "{msg}");

    let (status, body) = api.post("/v1/records/7/1", r#"{"product_ids": []}"#).await;
    assert_eq!(status, 400, "{body}");
    assert!(error_of(&body).contains("no product ids"), "{body}");

    for bad in
        [r#"{"product_ids": ["a""#, "not json", r#"{"ids": ["a"]}"#, r#"{"product_ids": [1]}"#]
    {
        let (status, body) = api.post("/v1/records/7/1", bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(!error_of(&body).is_empty());
    }

    let (status, body) = api.post("/v1/records/abc/1", r#"{"product_ids": ["a"]}"#).await;
    assert_eq!(status, 400, "{body}");
    assert!(error_of(&body).contains("brand"), "{body}");
}

#[tokio::test]
async fn http_paging_visits_every_record_once_and_bounds_the_limit() {
    let api = start(|_| {}).await;
    // Records over 64 bytes: Redis keeps the place as a real hash table
    // (pages must not depend on how Redis encodes it).
    write_place_with(&api.h, 2, 250, &"long description ".repeat(6)).await;
    // Another place must not leak into the pages.
    write_place(&api.h, 3, 40).await;
    api.h.wait_settled().await;

    let (records, sizes) = http_all_pages(&api, 2, 100).await;
    let stored = api.place_records(2).await;
    let mut seen = HashSet::new();
    for r in &records {
        let id = r["key"]["product_id"].as_str().expect("product id").to_string();
        assert_eq!(r["key"]["place_id"], json!(2));
        assert_eq!(Some(r), stored.get(&id).map(record_to_json).as_ref(), "{id} as stored");
        assert!(seen.insert(id.clone()), "{id} on two pages");
    }
    assert_eq!(seen.len(), 250, "every record visited (page sizes {sizes:?})");
    assert!(sizes.len() >= 2, "250 records at 100 a page take several pages: {sizes:?}");
    println!("page sizes at limit=100: {sizes:?}");

    for (query, what) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        (&*format!("after={}", "x".repeat(600)), "after"),
        // The old contract's product id: refused, not read as something else.
        ("after=sku-1", "cursor"),
        ("cursor=not-a-cursor", "cursor"),
        ("cursor=AAAA", "cursor"),
    ] {
        let (status, body) = api.get(&format!("/v1/places/7/2/records?{query}")).await;
        assert_eq!(status, 400, "{query}: {body}");
        assert!(error_of(&body).contains(what), "{query}: {body}");
    }
}

/// A page is documented as bounded by `limit`, itself at most
/// `storage.read_max_batch`.
#[tokio::test]
async fn pages_never_exceed_the_limit() {
    let api = start(|s| s.storage.read_max_batch = 10).await;
    // 60 small records: Redis keeps them as one listpack.
    write_place(&api.h, 5, 60).await;
    // 300 records over 64 bytes: a real hash table.
    write_place_with(&api.h, 6, 300, &"long description ".repeat(6)).await;
    api.h.wait_settled().await;
    for place in [5, 6] {
        let (_, sizes) = http_all_pages(&api, place, 10).await;
        assert!(
            sizes.iter().all(|&n| n <= 10),
            "place {place}: HTTP limit=10 gave pages of {sizes:?}"
        );
        let mut cursor = String::new();
        loop {
            let req = ReadRequest {
                brand_id: BRAND,
                place_id: place,
                cursor: cursor.clone(),
                limit: 10,
                ..Default::default()
            };
            let reply = api.nats("place", &req).await;
            assert!(reply.error.is_empty(), "{}", reply.error);
            assert!(
                reply.records.len() <= 10,
                "place {place}: NATS limit=10 gave {} records",
                reply.records.len()
            );
            cursor = reply.next_cursor;
            if cursor.is_empty() {
                break;
            }
        }
    }
}

#[tokio::test]
async fn nats_reads_equal_storage_state_and_refuse_bad_requests() {
    let api = start(|s| s.storage.read_max_batch = 50).await;
    write_place(&api.h, 1, 23).await;
    api.h.send(vec![delete(1, "sku-4")]).await.expect("send");
    api.h.wait_settled().await;
    let stored = api.place_records(1).await;
    let req = |ids: &[&str]| ReadRequest {
        brand_id: BRAND,
        place_id: 1,
        product_ids: ids.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };

    let reply = api.nats("get", &req(&["sku-3"])).await;
    assert_eq!(reply, ReadReply { records: vec![stored["sku-3"].clone()], ..Default::default() });
    let reply = api.nats("get", &req(&["sku-4"])).await;
    assert!(reply.records[0].deleted, "a tombstone reads as deleted: {reply:?}");
    let reply = api.nats("get", &req(&["nope"])).await;
    assert_eq!(reply, ReadReply { missing: vec!["nope".into()], ..Default::default() });

    let reply = api.nats("batch", &req(&["sku-1", "nope", "sku-2"])).await;
    assert_eq!(
        reply,
        ReadReply {
            records: vec![stored["sku-1"].clone(), stored["sku-2"].clone()],
            missing: vec!["nope".into()],
            ..Default::default()
        }
    );

    let mut paged = BTreeMap::new();
    let mut cursor = String::new();
    let mut pages = 0;
    let mut old_contract_next = Vec::new();
    for _ in 0..100 {
        let reply = api
            .nats(
                "place",
                &ReadRequest {
                    brand_id: BRAND,
                    place_id: 1,
                    cursor: cursor.clone(),
                    limit: 7,
                    ..Default::default()
                },
            )
            .await;
        assert!(reply.error.is_empty(), "{}", reply.error);
        assert!(reply.records.len() <= 7);
        pages += 1;
        // Nothing is written while paging: no record comes twice.
        for r in reply.records {
            assert!(paged.insert(product_id(&r).to_string(), r).is_none(), "a record on two pages");
        }
        old_contract_next.push(reply.next_after);
        cursor = reply.next_cursor;
        if cursor.is_empty() {
            break;
        }
    }
    // `next_after` is never empty while pages remain (a client of the old
    // contract does not take page one for the whole place), empty at the end.
    let last = old_contract_next.pop().expect("pages");
    assert!(last.is_empty() && old_contract_next.iter().all(|a| !a.is_empty()), "{last:?}");
    assert_eq!(pages, 4, "23 records at 7 a page");
    assert_eq!(paged, stored, "pages over NATS hold exactly storage's records");

    // Refused requests: an error and nothing else.
    let refused = |reply: &ReadReply, what: &str| {
        assert!(!reply.error.is_empty(), "{what}: expected an error, got {reply:?}");
        assert!(reply.records.is_empty() && reply.missing.is_empty(), "{what}: {reply:?}");
    };
    refused(&api.nats_raw("get", b"\x0f garbage, not protobuf".to_vec()).await, "garbage get");
    refused(&api.nats_raw("batch", vec![0xff; 12]).await, "garbage batch");
    refused(&api.nats_raw("place", b"\x0f garbage".to_vec()).await, "garbage place");
    refused(&api.nats("get", &req(&["sku-1", "sku-2"])).await, "get of two ids");
    refused(&api.nats("batch", &req(&[])).await, "empty batch");
    let many: Vec<String> = (0..51).map(sku).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    refused(&api.nats("batch", &req(&many)).await, "batch over the limit");
    let over = ReadRequest { brand_id: BRAND, place_id: 1, limit: 51, ..Default::default() };
    refused(&api.nats("place", &over).await, "page over the limit");
    // The old contract's `after`: an error that points to `cursor`, not a
    // page read some other way.
    let page = |after: &str, cursor: &str| ReadRequest {
        brand_id: BRAND,
        place_id: 1,
        after: after.into(),
        cursor: cursor.into(),
        limit: 5,
        ..Default::default()
    };
    let reply = api.nats("place", &page("sku-1", "")).await;
    refused(&reply, "page after a product id");
    assert!(reply.error.contains("cursor"), "{}", reply.error);
    let reply = api.nats("place", &page("", "%%")).await;
    refused(&reply, "bad cursor");
    assert!(reply.error.contains("cursor"), "{}", reply.error);
}

#[tokio::test]
async fn reads_follow_writes_deletes_and_sweeps() {
    let api = start(|_| {}).await;
    let h = &api.h;
    const PLACE: i64 = 4;
    let g1 = now_us();
    let import = |range: std::ops::Range<usize>, generation: i64| -> Vec<Command> {
        range
            .map(|i| {
                patch(
                    BRAND,
                    PLACE,
                    &sku(i),
                    &product(&format!("item {i}"), 10 * i as i64, 2),
                    generation,
                )
            })
            .collect()
    };
    h.send(import(0..30, g1)).await.expect("send");
    h.send_sweep(BRAND, PLACE, g1).await.expect("sweep");
    // A state decision, deletes.
    let hide = Command {
        key: Some(RecordKey::new(BRAND, PLACE, sku(10))),
        kind: CommandKind::Patch as i32,
        state: RecordState {
            hidden: Some(true),
            reasons: vec!["no price".into()],
            ..Default::default()
        }
        .encode_to_vec(),
        ..Default::default()
    };
    h.send(vec![hide]).await.expect("send");
    h.send((0..3).map(|i| delete(PLACE, &sku(i))).collect()).await.expect("send");
    // The next full import lacks sku-0..2 (deleted) and sku-25..29 (vanished).
    let g2 = g1 + 1_000_000;
    h.send(import(3..25, g2)).await.expect("send");
    h.send_sweep(BRAND, PLACE, g2).await.expect("sweep");
    // A price feed after the import: 0 is a price.
    let free = Product { price: Some(0), ..Default::default() };
    h.send((5..10).map(|i| patch(BRAND, PLACE, &sku(i), &free, 0)).collect()).await.expect("send");
    h.wait_settled().await;

    let stored = api.place_records(PLACE).await;
    assert_eq!(stored.len(), 30);
    for i in 0..30 {
        let id = sku(i);
        let r = &stored[&id];
        assert_eq!(r.deleted, i < 3, "{id}");
        assert_eq!(r.absent, i >= 25, "{id}");
        let (status, body) = api.get(&format!("/v1/records/{BRAND}/{PLACE}/{id}")).await;
        assert_eq!(status, 200, "{id}: {body}");
        assert_eq!(body, record_to_json(r), "{id} over HTTP");
        assert_eq!(body["deleted"], json!(i < 3), "{id}");
        assert_eq!(body["absent"], json!(i >= 25), "{id}");
    }
    let (_, body) = api.get(&format!("/v1/records/{BRAND}/{PLACE}/sku-7")).await;
    assert_eq!(body["data"]["price"], json!(0));
    let (_, body) = api.get(&format!("/v1/records/{BRAND}/{PLACE}/sku-10")).await;
    assert_eq!(body["state"]["hidden"], json!(true));

    // Pages over HTTP and a batch over NATS say the same.
    let (pages, _) = http_all_pages(&api, PLACE, 7).await;
    let paged: BTreeMap<String, Value> = pages
        .into_iter()
        .map(|r| (r["key"]["product_id"].as_str().unwrap_or_default().to_string(), r))
        .collect();
    let expected: BTreeMap<String, Value> =
        stored.iter().map(|(id, r)| (id.clone(), record_to_json(r))).collect();
    assert!(paged == expected, "HTTP pages differ from storage");
    let all: Vec<String> = (0..30).map(sku).collect();
    let reply = api
        .nats(
            "batch",
            &ReadRequest {
                brand_id: BRAND,
                place_id: PLACE,
                product_ids: all.clone(),
                ..Default::default()
            },
        )
        .await;
    assert!(reply.error.is_empty() && reply.missing.is_empty(), "{reply:?}");
    assert_eq!(reply.records, all.iter().map(|id| stored[id].clone()).collect::<Vec<_>>());
}

/// A bench, not a test: prints point-read latency over loopback HTTP.
#[tokio::test]
#[ignore = "bench: prints latency figures, asserts nothing about time"]
async fn bench_http_point_read_latency() {
    let api = start(|_| {}).await;
    write_place(&api.h, 1, 1000).await;
    api.h.wait_settled().await;
    let _ = api.get("/v1/records/7/1/sku-0").await; // warm the connection
    let mut samples = Vec::with_capacity(1000);
    for i in 0..1000 {
        let started = Instant::now();
        let (status, _) = api.get(&format!("/v1/records/7/1/{}", sku(i))).await;
        samples.push(started.elapsed());
        assert_eq!(status, 200);
    }
    samples.sort();
    let pct = |p: usize| samples[(samples.len() * p / 100).min(samples.len() - 1)];
    let total: Duration = samples.iter().sum();
    println!(
        "HTTP point read, 1000 sequential GETs: p50 {:?}, p99 {:?}, max {:?}, mean {:?}",
        pct(50),
        pct(99),
        samples[samples.len() - 1],
        total / 1000
    );
}

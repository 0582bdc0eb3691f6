//! Ingest against real nats-server and redis-server processes (testkit):
//! what lands on the CMD and REJECTS streams, sweeps, HTTP polling with
//! ETag, and the service (push endpoint, poll loop).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use prost::Message;
use shelfsync_bus::{Subjects, encoding, partition_of};
use shelfsync_ingest::{
    App, ImportConfig, ImportError, ImportReport, ImportStatus, Importer, Source,
};
use shelfsync_proto::{Command, CommandBatch, CommandKind, Product, RecordKey, RejectionBatch};
use shelfsync_service::Service as _;
use shelfsync_settings::{Compression, ImportKind, PartnerSettings, Settings};
use shelfsync_testkit::{TestEnv, eventually};

type Result<T = ()> = anyhow::Result<T>;

/// (subject, Nats-Msg-Id, payload) of one stored message.
type Stored = (String, String, bytes::Bytes);

struct Harness {
    _env: TestEnv,
    settings: Settings,
    js: async_nats::jetstream::Context,
    subjects: Subjects,
    dir: tempfile::TempDir,
}

fn partner(name: &str, kind: ImportKind, fields: &[&str]) -> PartnerSettings {
    let fields = fields.iter().map(|f| f.to_string()).collect();
    PartnerSettings { name: name.into(), brand_id: 7, kind, fields, ..Default::default() }
}

fn full(name: &str) -> PartnerSettings {
    partner(name, ImportKind::Full, &shelfsync_proto::product_field::NAMES)
}

async fn harness(partners: Vec<PartnerSettings>) -> Result<Harness> {
    let env = TestEnv::start().await?;
    let mut settings = env.settings();
    settings.storage.partitions = 4;
    settings.ingest.listen = "127.0.0.1:0".into();
    settings.partners = partners;
    settings.validate()?;
    let client = shelfsync_bus::connect(&settings.nats, "ingest-test", false).await?;
    let js = shelfsync_bus::jetstream(client, &settings.nats);
    shelfsync_bus::provision(&js, &settings.nats, settings.topology()).await?;
    let (subjects, dir) = (Subjects::new(&settings.nats.prefix), tempfile::tempdir()?);
    Ok(Harness { _env: env, settings, js, subjects, dir })
}

const PUSHED_TOKEN: &str = "pushed-0123456789abcdef";

impl Harness {
    /// Writes a push tokens file for `partner` in the test's directory.
    fn tokens_file(&self, partner: &str, text: &str) -> Result<std::path::PathBuf> {
        let path = self.dir.path().join(format!("{partner}.tokens"));
        std::fs::write(&path, text)?;
        Ok(path)
    }

    async fn importer(&self) -> Result<Importer> {
        Importer::connect(ImportConfig::from(&self.settings)).await
    }

    /// Writes `feed` to a file and imports it for `partner`.
    async fn import(
        &self,
        partner: &str,
        feed: &str,
    ) -> std::result::Result<ImportReport, ImportError> {
        let path = self.dir.path().join(format!("{partner}.feed"));
        std::fs::write(&path, feed).expect("writes the feed");
        let importer = self.importer().await.expect("connects");
        let partner = self.settings.partner(partner).expect("configured");
        importer.import(partner, Source::File(path), None).await
    }

    /// Every message of a stream, in stream order, its payload decoded as
    /// its `Shelfsync-Encoding` header says.
    async fn stream(&self, name: String) -> Result<Vec<Stored>> {
        Ok(self
            .raw_stream(name)
            .await?
            .into_iter()
            .map(|(s, id, _, plain)| (s, id, plain))
            .collect())
    }

    /// Every message of a stream: subject, id, encoding and plain payload.
    async fn raw_stream(
        &self,
        name: String,
    ) -> Result<Vec<(String, String, Option<String>, bytes::Bytes)>> {
        let mut stream = self.js.get_stream(&name).await?;
        let mut out = Vec::new();
        for seq in 1..=stream.info().await?.state.last_sequence {
            let m = stream.get_raw_message(seq).await?;
            let id = m.headers.get("Nats-Msg-Id").map(|v| v.to_string()).unwrap_or_default();
            let encoding = m.headers.get(encoding::ENCODING_HEADER).map(|v| v.to_string());
            let plain = encoding::decode(Some(&m.headers), &m.payload)?;
            out.push((m.subject.to_string(), id, encoding, plain));
        }
        Ok(out)
    }

    async fn cmd_batches(&self) -> Result<Vec<(String, String, CommandBatch)>> {
        let stored = self.stream(self.subjects.cmd_stream()).await?;
        stored.into_iter().map(|(s, id, p)| Ok((s, id, CommandBatch::decode(p)?))).collect()
    }

    async fn commands(&self) -> Result<Vec<Command>> {
        let batches = self.cmd_batches().await?;
        let mut commands: Vec<Command> = batches.into_iter().flat_map(|b| b.2.commands).collect();
        commands.sort_by_key(|c| c.key.as_ref().map(|k| k.product_id.clone()));
        Ok(commands)
    }

    /// The product ids of [`Harness::commands`], in their order.
    async fn product_ids(&self) -> Result<Vec<String>> {
        let commands = self.commands().await?;
        Ok(commands.iter().filter_map(|c| c.key.as_ref().map(|k| k.product_id.clone())).collect())
    }
}

fn product(c: &Command) -> Product {
    Product::decode(c.data.as_slice()).expect("a Product")
}

#[tokio::test]
async fn a_full_import_publishes_patches_then_one_sweep_per_place() -> Result {
    let h = harness(vec![full("flowers")]).await?;
    let feed = r#"{"brand_id": 7, "places": [
        {"place_id": 42, "items": [
            {"id": "sku-1", "title": "Red roses", "price": 0, "stock": 0, "images": ["1.jpg"]},
            {"id": "sku-2", "title": "Tulips", "price": 1500, "currency": "RUB"}]},
        {"place_id": 43, "items": [{"id": "sku-3", "title": "Lilies"}]},
        {"place_id": 44, "items": []}]}"#;
    let r = h.import("flowers", feed).await?;
    assert_eq!(r.status, ImportStatus::Completed);
    assert_eq!(
        (r.items, r.commands, r.places, r.sweeps, r.bytes_in),
        (3, 3, 3, 3, feed.len() as u64)
    );
    assert_eq!(r.import_id, format!("flowers-{}", r.generation));

    let batches = h.cmd_batches().await?;
    let first_sweep = batches.iter().position(|b| !b.2.sweeps.is_empty()).expect("sweeps");
    let (commands, sweeps) = batches.split_at(first_sweep);
    for (subject, msg_id, batch) in commands {
        assert!(batch.sweeps.is_empty(), "every sweep comes after every command");
        assert_eq!(subject, &h.subjects.cmd(shelfsync_bus::Partition(batch.partition)));
        assert!(msg_id.starts_with(&format!("{}:{}:", r.import_id, batch.partition)), "{msg_id}");
        // The import's origin, once per batch.
        assert_eq!(batch.origin.as_ref().expect("origin").import_id, r.import_id);
        for c in &batch.commands {
            let place = c.key.as_ref().expect("key").place_id;
            assert_eq!(batch.partition, partition_of(7, place, 4).0);
            assert_eq!((c.kind, c.generation), (CommandKind::Patch as i32, r.generation));
            assert_eq!(c.origin, None, "each command has its batch's");
        }
    }
    let commands = h.commands().await?;
    assert_eq!(commands[0].key, Some(RecordKey::new(7, 42, "sku-1")));
    let roses = product(&commands[0]);
    assert_eq!((roses.price, roses.stock), (Some(0), Some(0)), "zero is a value");
    assert_eq!(roses.images, vec!["1.jpg"]);
    assert_eq!(commands[0].clear_data_fields, vec![2, 4, 5, 8], "owned and missing: cleared");
    assert_eq!(product(&commands[1]).currency.as_deref(), Some("RUB"));
    assert_eq!(commands[2].key, Some(RecordKey::new(7, 43, "sku-3")));

    let mut swept = Vec::new();
    for (_, msg_id, batch) in sweeps {
        let [sweep] = batch.sweeps.as_slice() else { panic!("one sweep per message") };
        assert_eq!((sweep.brand_id, sweep.generation), (7, r.generation));
        assert_eq!(
            (sweep.source.as_str(), sweep.import_id.as_str()),
            ("flowers", r.import_id.as_str())
        );
        assert_eq!(batch.partition, partition_of(7, sweep.place_id, 4).0);
        assert_eq!(msg_id, &format!("{}:sweep:{}", r.import_id, sweep.place_id));
        swept.push(sweep.place_id);
    }
    assert_eq!(swept, vec![42, 43, 44], "the place listed with no items is swept too");
    Ok(())
}

#[tokio::test]
async fn a_delta_partner_patches_only_its_fields_and_never_sweeps() -> Result {
    let h = harness(vec![partner("prices", ImportKind::Delta, &["price", "old_price"])]).await?;
    let feed = "{\"id\":\"a\",\"brand_id\":7,\"place_id\":1,\"price\":500,\"title\":\"x\",\"stock\":3}\n\
                {\"id\":\"b\",\"brand_id\":7,\"place_id\":2,\"price\":600,\"old_price\":700}\n";
    let r = h.import("prices", feed).await?;
    assert_eq!((r.items, r.places, r.sweeps, r.generation), (2, 2, 0, 0));
    assert!(h.cmd_batches().await?.iter().all(|b| b.2.sweeps.is_empty()));
    let commands = h.commands().await?;
    assert!(commands.iter().all(|c| c.generation == 0));
    assert_eq!(product(&commands[0]), Product { price: Some(500), ..Default::default() });
    assert_eq!(
        commands[0].clear_data_fields,
        vec![4],
        "old_price is owned and missing, stock is not owned"
    );
    let b = Product { price: Some(600), old_price: Some(700), ..Default::default() };
    assert_eq!(product(&commands[1]), b);
    Ok(())
}

#[tokio::test]
async fn bad_items_are_rejected_with_reasons_and_good_ones_land() -> Result {
    let h = harness(vec![full("flowers")]).await?;
    let feed = r#"{"brand_id": 7, "places": [{"place_id": 42, "items": [
        {"id": "good-1", "price": 100}, {"title": "no id"}, {"id": "bad-price", "price": "12.50"},
        {"id": "good-1", "price": 200}, {"id": "good-2", "stock": -3}]}]}"#;
    let r = h.import("flowers", feed).await?;
    assert_eq!((r.items, r.rejected_total, r.sweeps), (2, 3, 1));
    let by_reason: Vec<_> = r.rejected.iter().map(|(k, v)| format!("{k}={v}")).collect();
    assert_eq!(by_reason, ["duplicate_id=1", "missing_id=1", "wrong_type=1"]);
    let text = r.render();
    assert!(
        text.contains("2 good, 3 rejected (duplicate_id 1, missing_id 1, wrong_type 1)"),
        "{text}"
    );
    assert_eq!(h.commands().await?.len(), 2);

    let mut rejections = Vec::new();
    for (subject, msg_id, payload) in h.stream(h.subjects.rejects_stream()).await? {
        assert_eq!(subject, h.subjects.rejects(7, 42));
        assert!(msg_id.starts_with(&format!("{}:rej:", r.import_id)), "{msg_id}");
        rejections.extend(RejectionBatch::decode(payload)?.rejections);
    }
    let reasons: Vec<&str> = rejections.iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(reasons, ["missing_id", "wrong_type", "duplicate_id"]);
    assert_eq!(rejections[1].key, Some(RecordKey::new(7, 42, "bad-price")));
    assert!(rejections[1].detail.contains("price"));
    assert!(String::from_utf8_lossy(&rejections[1].raw).contains("12.50"));
    Ok(())
}

#[tokio::test]
async fn a_feed_that_is_not_json_or_is_cut_short_fails_and_sweeps_nothing() -> Result {
    let h = harness(vec![full("flowers")]).await?;
    let err = h
        .import("flowers", "<html><body>502 Bad Gateway</body></html>")
        .await
        .expect_err("not JSON");
    assert!(matches!(err, ImportError::NotJson { offset: 0, .. }), "{err:?}");
    assert!(err.to_string().contains("not JSON") && err.to_string().contains("<html>"), "{err}");
    assert!(h.cmd_batches().await?.is_empty());

    let cut = r#"{"brand_id": 7, "places": [{"place_id": 42, "items": [{"id": "a"}, {"id": "b"#;
    let err = h.import("flowers", cut).await.expect_err("truncated");
    assert!(matches!(err, ImportError::Malformed(_)), "{err:?}");
    assert!(h.cmd_batches().await?.iter().all(|b| b.2.sweeps.is_empty()), "no sweep");
    assert_eq!(h.commands().await?.len(), 1, "the item before the failure stays published");

    let reports = h.importer().await?.reports("flowers", 5).await?;
    assert_eq!(reports.len(), 2, "failed imports are recorded");
    assert!(reports.iter().all(|r| r.status == ImportStatus::Failed && r.sweeps == 0));
    assert!(reports[1].error.as_deref().is_some_and(|e| e.contains("not JSON")));
    assert!(reports[0].render().contains("nothing was swept"));
    Ok(())
}

#[tokio::test]
async fn a_file_written_while_it_is_read_fails_and_sweeps_nothing() -> Result {
    // A partner that rewrites its feed in place can be read half-way through
    // a write: an NDJSON feed cut at a line end parses, and what it lacks
    // would be swept. The file is rewritten while the import reads it.
    let h = harness(vec![full("flowers")]).await?;
    let path = h.dir.path().join("feed.ndjson");
    std::fs::write(&path, "{\"id\":\"a\",\"place_id\":1}\n")?;
    let rewrite = || {
        let whole = "{\"id\":\"a\",\"place_id\":1}\n{\"id\":\"b\",\"place_id\":1}\n";
        std::fs::write(&path, whole).expect("rewritten");
    };
    let once = std::sync::Once::new();
    let progress = |_: &shelfsync_ingest::Progress| once.call_once(rewrite);
    let flowers = h.settings.partner("flowers").expect("configured");
    let importer = h.importer().await?;
    let err = importer
        .import(flowers, Source::File(path.clone()), Some(&progress))
        .await
        .expect_err("the file changed under the import");
    assert!(once.is_completed(), "the file was rewritten during the import");
    assert!(err.to_string().contains("changed while it was read"), "{err}");
    assert!(h.cmd_batches().await?.iter().all(|b| b.2.sweeps.is_empty()), "no sweep");
    let [report] = importer.reports("flowers", 5).await?.try_into().expect("one report");
    assert_eq!((report.status, report.sweeps), (ImportStatus::Failed, 0));

    // Read again, whole and unchanged, it imports and sweeps.
    let r = importer.import(flowers, Source::File(path), None).await?;
    assert_eq!((r.items, r.sweeps), (2, 1));
    Ok(())
}

#[tokio::test]
async fn http_polling_with_an_unchanged_etag_publishes_nothing() -> Result {
    use axum::http::{HeaderMap, StatusCode, header};
    let h = harness(vec![full("flowers")]).await?;
    let conditional = Arc::new(AtomicUsize::new(0));
    let seen = conditional.clone();
    let feed = move |headers: HeaderMap| async move {
        let etag = [(header::ETAG, "\"v1\"")];
        if headers.get(header::IF_NONE_MATCH).is_some_and(|v| v == "\"v1\"") {
            seen.fetch_add(1, Ordering::SeqCst);
            return (StatusCode::NOT_MODIFIED, etag, "");
        }
        (StatusCode::OK, etag, r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"}]}]}"#)
    };
    let server = axum::Router::new()
        .route("/feed.json", axum::routing::get(feed))
        .route("/broken", axum::routing::get(|| async { StatusCode::INTERNAL_SERVER_ERROR }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, server).await });

    let importer = h.importer().await?;
    let flowers = h.settings.partner("flowers").expect("configured");
    let poll = |path: &str| importer.import(flowers, Source::parse(&format!("{base}{path}")), None);
    let first = poll("/feed.json").await?;
    assert_eq!((first.status, first.items, first.sweeps), (ImportStatus::Completed, 1, 1));
    let published = h.cmd_batches().await?.len();

    let second = poll("/feed.json").await?;
    assert_eq!((second.status, second.items, second.sweeps), (ImportStatus::Unchanged, 0, 0));
    assert_eq!(conditional.load(Ordering::SeqCst), 1, "the stored ETag was sent back");
    assert_eq!(h.cmd_batches().await?.len(), published, "an unchanged dump publishes nothing");

    let err = poll("/broken").await.expect_err("HTTP 500");
    assert!(matches!(&err, ImportError::Source { detail, .. } if detail.contains("500")), "{err}");
    Ok(())
}

#[tokio::test]
async fn the_service_takes_pushed_feeds_and_polls_files_when_they_change() -> Result {
    let mut h = harness(vec![full("pushed")]).await?;
    h.settings.partners[0].push_tokens_file = Some(h.tokens_file("pushed", PUSHED_TOKEN)?);
    let path = h.dir.path().join("polled.json");
    std::fs::write(&path, r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"}]}]}"#)?;
    let mut polled = full("polled");
    (polled.source, polled.poll_interval) =
        (Some(path.display().to_string()), Some(Duration::from_millis(50)));
    h.settings.partners.push(polled);
    h.settings.ingest.batch_size = 100;
    let app = App::build(h.settings.clone()).await?;
    let base = format!("http://{}", app.local_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(app.run_until(async move { _ = stopped.await }));

    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    assert_eq!(http.get(format!("{base}/healthz")).send().await?.status(), 200);
    eventually(Duration::from_secs(5), "readyz", || {
        let request = http.get(format!("{base}/readyz")).send();
        async move { request.await.is_ok_and(|r| r.status() == 200) }
    })
    .await;
    let push = |partner: &str, body: &'static str| {
        let url = format!("{base}/v1/partners/{partner}/feed");
        http.post(url).bearer_auth(PUSHED_TOKEN).body(body).send()
    };
    let feed =
        r#"{"brand_id":7,"places":[{"place_id":5,"items":[{"id":"a"},{"id":"b"},{"price":2}]}]}"#;
    let response = push("pushed", feed).await?;
    assert_eq!(response.status(), 200);
    let report: serde_json::Value = serde_json::from_slice(&response.bytes().await?)?;
    assert_eq!((report["status"].as_str(), report["items"].as_u64()), (Some("completed"), Some(2)));
    assert_eq!(
        (report["rejected"]["missing_id"].as_u64(), report["sweeps"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(push("nobody", feed).await?.status(), 404);
    let response = push("pushed", "<html>").await?;
    assert_eq!(response.status(), 400);
    let body: serde_json::Value = serde_json::from_slice(&response.bytes().await?)?;
    assert!(body["error"].as_str().is_some_and(|e| e.contains("not JSON")), "{body}");
    let importer = h.importer().await?;
    let importer = &importer;
    let reports =
        move || async move { importer.reports("polled", 20).await.map_or(0, |r| r.len()) };
    eventually(
        Duration::from_secs(5),
        "the first poll",
        move || async move { reports().await == 1 },
    )
    .await;
    // Written elsewhere and renamed into place, as OPERATE asks of partners:
    // a file written in place may be read mid-write, and is read again.
    let next = h.dir.path().join("polled.json.next");
    std::fs::write(
        &next,
        r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"},{"id":"b"}]}]}"#,
    )?;
    std::fs::rename(&next, &path)?;
    eventually(
        Duration::from_secs(5),
        "the changed file",
        move || async move { reports().await == 2 },
    )
    .await;
    // Polls of an unchanged file import nothing: a negative cannot be waited
    // for, so this window of several poll intervals is a deliberate sleep.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // One import per partner at a time: while a slow push runs (it has
    // published a first batch), another push of that partner is refused.
    let published = || async { h.cmd_batches().await.map_or(0, |b| b.len()) };
    let before = published().await;
    let (mut tx, rx) = futures::channel::mpsc::channel::<std::io::Result<String>>(1);
    let slow = http
        .post(format!("{base}/v1/partners/pushed/feed"))
        .bearer_auth(PUSHED_TOKEN)
        .body(reqwest::Body::wrap_stream(rx));
    let slow = tokio::spawn(slow.send());
    let lines: String = (0..300).map(|i| format!("{{\"id\":\"s{i}\",\"place_id\":1}}\n")).collect();
    futures::SinkExt::send(&mut tx, Ok(lines)).await?;
    eventually(Duration::from_secs(5), "a first batch", || async { published().await > before })
        .await;
    assert_eq!(push("pushed", feed).await?.status(), 409);
    drop(tx);
    assert_eq!(slow.await??.status(), 200, "the slow push completes");
    _ = stop.send(());
    running.await??;
    let items: Vec<u64> = importer.reports("polled", 20).await?.iter().map(|r| r.items).collect();
    assert_eq!(items, [2, 1], "imported once per version of the file");
    Ok(())
}

#[tokio::test]
async fn batches_hold_at_most_batch_size_commands() -> Result {
    let h = harness(vec![full("flowers")]).await?;
    let items: Vec<String> =
        (0..2500).map(|i| format!(r#"{{"id":"sku-{i}","price":{i}}}"#)).collect();
    let feed =
        format!(r#"{{"brand_id":7,"places":[{{"place_id":9,"items":[{}]}}]}}"#, items.join(","));
    let path = h.dir.path().join("big.json");
    std::fs::write(&path, feed)?;
    let calls = AtomicUsize::new(0);
    let progress = |_: &shelfsync_ingest::Progress| _ = calls.fetch_add(1, Ordering::Relaxed);
    let flowers = h.settings.partner("flowers").expect("configured");
    let r = h.importer().await?.import(flowers, Source::File(path), Some(&progress)).await?;
    assert_eq!((r.items, r.batches, r.sweeps), (2500, 3, 1));
    assert!(calls.load(Ordering::Relaxed) >= 1, "progress is reported, at least at the end");
    let sizes: Vec<usize> = h.cmd_batches().await?.iter().map(|b| b.2.commands.len()).collect();
    assert_eq!(sizes, [1000, 1000, 500, 0], "three batches, then the sweep");
    Ok(())
}

#[tokio::test]
async fn command_batches_travel_compressed_unless_compression_is_none() -> Result {
    let mut h = harness(vec![full("flowers")]).await?;
    let items: Vec<String> = (0..300)
        .map(|i| format!(r#"{{"id":"sku-{i}","title":"Red roses, {i} stems","price":{i}}}"#))
        .collect();
    let feed =
        format!(r#"{{"brand_id":7,"places":[{{"place_id":9,"items":[{}]}}]}}"#, items.join(","));
    let r = h.import("flowers", &feed).await?;
    let stored = h.raw_stream(h.subjects.cmd_stream()).await?;
    let lz4 = Some(encoding::LZ4.to_string());
    assert!(stored.iter().all(|m| m.2 == lz4), "every CMD message says lz4: {stored:?}");
    assert!(r.bytes_out * 2 < stored.iter().map(|m| m.3.len() as u64).sum::<u64>(), "{r:?}");
    let compressed = commands_of(&stored)?;
    assert_eq!(compressed.len(), 300);

    h.settings.ingest.compression = Compression::None;
    h.import("flowers", &feed).await?;
    let stored = h.raw_stream(h.subjects.cmd_stream()).await?;
    let plain: Vec<_> = stored.into_iter().skip(2).collect();
    assert!(plain.iter().all(|m| m.2.is_none()), "none: plain protobuf, no header");
    let plain = commands_of(&plain)?;
    let data = |cs: &[Command]| cs.iter().map(|c| c.data.clone()).collect::<Vec<_>>();
    assert_eq!(data(&plain), data(&compressed), "the same commands either way");
    Ok(())
}

fn commands_of(stored: &[(String, String, Option<String>, bytes::Bytes)]) -> Result<Vec<Command>> {
    let mut out = Vec::new();
    for m in stored {
        out.extend(CommandBatch::decode(m.3.clone())?.commands);
    }
    Ok(out)
}

// --- the push endpoint's credentials and limits ------------------------------

/// The ingest service running in this test process.
struct Service {
    base: String,
    http: reqwest::Client,
    stop: tokio::sync::oneshot::Sender<()>,
    running: tokio::task::JoinHandle<Result>,
}

async fn serve(settings: &Settings) -> Result<Service> {
    let app = App::build(settings.clone()).await?;
    let base = format!("http://{}", app.local_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(app.run_until(async move { _ = stopped.await }));
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(Service { base, http: reqwest::Client::new(), stop, running })
}

impl Service {
    /// Pushes `body` to `partner` with `token` (none: no `Authorization`);
    /// the status and the JSON answer.
    async fn push(
        &self,
        partner: &str,
        token: Option<&str>,
        body: impl Into<reqwest::Body>,
    ) -> Result<(u16, serde_json::Value)> {
        let mut request = self.http.post(format!("{}/v1/partners/{partner}/feed", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.body(body).send().await?;
        let status = response.status().as_u16();
        Ok((status, serde_json::from_slice(&response.bytes().await?)?))
    }

    async fn stop(self) -> Result {
        _ = self.stop.send(());
        self.running.await?
    }
}

/// One NDJSON item of brand 7.
fn line(id: &str, place: i64) -> String {
    format!("{{\"id\":\"{id}\",\"brand_id\":7,\"place_id\":{place},\"price\":100}}\n")
}

const OLD_TOKEN: &str = "old-token-0123456789abcdef";
const NEW_TOKEN: &str = "new-token-0123456789abcdef";
const NEWER_TOKEN: &str = "newer-token-0123456789abcdef";

#[tokio::test]
async fn a_rewritten_tokens_file_rotates_the_push_tokens_without_a_restart() -> Result {
    let mut h = harness(vec![partner("rotating", ImportKind::Delta, &["price"])]).await?;
    let file = h.tokens_file(
        "rotating",
        &format!("# both during the rotation\n{OLD_TOKEN}\n{NEW_TOKEN}\n"),
    )?;
    h.settings.partners[0].push_tokens_file = Some(file.clone());
    let service = serve(&h.settings).await?;
    let push = |token: &'static str, id: &str| service.push("rotating", Some(token), line(id, 1));

    assert_eq!(push(OLD_TOKEN, "a").await?.0, 200, "the old token, during the rotation");
    assert_eq!(push(NEW_TOKEN, "b").await?.0, 200, "the new token, during the rotation");

    // The partner has moved to the new token: the old one is removed.
    std::fs::write(&file, format!("{NEW_TOKEN}\r\n"))?;
    let (status, body) = push(OLD_TOKEN, "c").await?;
    assert_eq!(status, 401, "the old token after the rotation: {body}");
    assert_eq!(push(NEW_TOKEN, "d").await?.0, 200, "the new token after the rotation");

    // Removing the file revokes its tokens at once; a file put back is read.
    std::fs::remove_file(&file)?;
    let (status, body) = push(NEW_TOKEN, "gone").await?;
    assert_eq!(status, 401, "the file is gone: its tokens are revoked: {body}");
    std::fs::write(&file, format!("{NEW_TOKEN}\n"))?;
    assert_eq!(push(NEW_TOKEN, "e").await?.0, 200, "the file is back");
    // A file that holds a bad token keeps the last good tokens.
    std::fs::write(&file, "short\n")?;
    assert_eq!(push(NEW_TOKEN, "f").await?.0, 200, "a bad file: the last good tokens");
    assert_eq!(push(OLD_TOKEN, "g").await?.0, 401);
    std::fs::write(&file, format!("{NEWER_TOKEN}\n"))?;
    assert_eq!(push(NEWER_TOKEN, "h").await?.0, 200, "a good file again is read");
    assert_eq!(push(NEW_TOKEN, "i").await?.0, 401);

    let ids = h.product_ids().await?;
    assert_eq!(ids, ["a", "b", "d", "e", "f", "h"], "exactly the accepted pushes landed");
    service.stop().await
}

#[tokio::test]
async fn push_bodies_over_the_partners_limit_are_refused_with_413() -> Result {
    let mut small = full("small");
    small.max_push_bytes = Some(256);
    let mut h = harness(vec![small, full("wide")]).await?;
    h.settings.ingest.max_push_bytes = 2048;
    h.settings.partners[0].push_tokens_file = Some(h.tokens_file("small", PUSHED_TOKEN)?);
    h.settings.partners[1].push_tokens_file = Some(h.tokens_file("wide", NEW_TOKEN)?);
    let service = serve(&h.settings).await?;
    let items = |n: usize| (0..n).map(|i| line(&format!("sku-{i}"), 3)).collect::<String>();
    let big = items(40);
    assert!(big.len() > 2048);

    // A declared Content-Length over the limit: refused before the body is
    // read, nothing published.
    let (status, body) = service.push("small", Some(PUSHED_TOKEN), big.clone()).await?;
    assert_eq!(status, 413, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(error.contains("256 bytes") && error.contains("max_push_bytes"), "{body}");
    let (status, body) = service.push("wide", Some(NEW_TOKEN), big.clone()).await?;
    assert_eq!(status, 413, "the ingest-wide limit for a partner without one: {body}");
    assert!(body["error"].as_str().is_some_and(|e| e.contains("2048 bytes")), "{body}");
    assert_eq!(h.cmd_batches().await?.len(), 0, "a refused push publishes nothing");

    // A chunked body (no Content-Length) that grows past the limit: the
    // import fails there and sweeps nothing.
    let (first, rest) = (items(2), items(20));
    assert!(first.len() < 256 && first.len() + rest.len() > 256);
    let chunks = futures::stream::iter([Ok::<_, std::io::Error>(first), Ok(rest)]);
    let (status, body) =
        service.push("small", Some(PUSHED_TOKEN), reqwest::Body::wrap_stream(chunks)).await?;
    assert_eq!(status, 413, "{body}");
    let reports = h.importer().await?.reports("small", 5).await?;
    assert_eq!(reports.len(), 1, "the chunked push was an import (the first was not)");
    assert_eq!((reports[0].status, reports[0].sweeps), (ImportStatus::Failed, 0));

    // Within the limit: accepted, and it is the only import that swept.
    let (status, report) = service.push("small", Some(PUSHED_TOKEN), items(3)).await?;
    assert_eq!((status, report["sweeps"].as_u64()), (200, Some(1)), "{report}");
    let import_id = report["import_id"].as_str().unwrap_or_default().to_string();
    let sweeps: Vec<String> = h
        .cmd_batches()
        .await?
        .into_iter()
        .filter(|b| !b.2.sweeps.is_empty())
        .map(|b| b.2.sweeps[0].import_id.clone())
        .collect();
    assert_eq!(sweeps, [import_id], "no sweep but the accepted push's");
    service.stop().await
}

#[tokio::test]
async fn bad_push_tokens_stop_ingest_at_start_with_a_clear_error() -> Result {
    let dir = tempfile::tempdir()?;
    let start = |partners: Vec<PartnerSettings>| async move {
        match App::build(Settings { partners, ..Default::default() }).await {
            Ok(_) => panic!("ingest started"),
            Err(e) => format!("{e:#}"),
        }
    };
    let mut short = full("flowers");
    let path = dir.path().join("short.tokens");
    std::fs::write(&path, "# comment\n\ntiny-secret\n")?;
    short.push_tokens_file = Some(path);
    let err = start(vec![short]).await;
    assert!(
        err.contains("flowers") && err.contains("line 3") && err.contains("at least 16"),
        "{err}"
    );
    assert!(!err.contains("tiny-secret"), "the token is printed: {err}");

    let mut unset = full("flowers");
    unset.push_tokens_env = Some("SHELFSYNC_TEST_SURELY_UNSET_TOKENS".into());
    let err = start(vec![unset]).await;
    assert!(err.contains("SHELFSYNC_TEST_SURELY_UNSET_TOKENS") && err.contains("not set"), "{err}");

    let mut missing = full("flowers");
    missing.push_tokens_file = Some(dir.path().join("nonexistent"));
    let err = start(vec![missing]).await;
    assert!(err.contains("push_tokens_file") && err.contains("nonexistent"), "{err}");

    let shared = dir.path().join("shared.tokens");
    std::fs::write(&shared, PUSHED_TOKEN)?;
    let (mut a, mut b) = (full("a"), full("b"));
    (a.push_tokens_file, b.push_tokens_file) = (Some(shared.clone()), Some(shared));
    let err = start(vec![a, b]).await;
    assert!(err.contains("share a push token"), "{err}");
    Ok(())
}

/// The real binary, killed on drop.
struct IngestProcess(std::process::Child);

impl Drop for IngestProcess {
    fn drop(&mut self) {
        _ = self.0.kill();
        _ = self.0.wait();
    }
}

#[tokio::test]
async fn push_tokens_from_an_environment_variable_work() -> Result {
    let mut h = harness(Vec::new()).await?;
    // Partners from the file, the token source from the environment, as a
    // deployment would set them.
    let config = h.dir.path().join("shelfsync.toml");
    std::fs::write(
        &config,
        "[[partners]]\nname = \"other\"\nbrand_id = 7\nkind = \"delta\"\n\
         [[partners]]\nname = \"envpushed\"\nbrand_id = 7\nkind = \"delta\"\nfields = [\"price\"]\n",
    )?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    h.settings.ingest.listen = format!("127.0.0.1:{port}");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_shelfsync-ingest"))
        .arg("--config")
        .arg(&config)
        .envs(shelfsync_testkit::settings_env(&h.settings))
        .env("SHELFSYNC__PARTNERS__1__PUSH_TOKENS_ENV", "SHELFSYNC_TEST_PUSH_TOKENS")
        .env("SHELFSYNC_TEST_PUSH_TOKENS", format!("{OLD_TOKEN}, {NEW_TOKEN}"))
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let mut child = IngestProcess(child);
    let base = format!("http://127.0.0.1:{port}");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let mut exited = None;
    eventually(Duration::from_secs(20), "ingest ready", || {
        let request = http.get(format!("{base}/readyz")).send();
        if let Ok(Some(status)) = child.0.try_wait() {
            exited = Some(status);
        }
        async move { request.await.is_ok_and(|r| r.status() == 200) }
    })
    .await;
    assert_eq!(exited, None);
    let push = |token: Option<&str>, id: &str| {
        let mut request = http.post(format!("{base}/v1/partners/envpushed/feed"));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.body(line(id, 2)).send()
    };
    assert_eq!(push(Some(NEW_TOKEN), "a").await?.status(), 200);
    assert_eq!(push(Some(OLD_TOKEN), "b").await?.status(), 200);
    assert_eq!(push(None, "c").await?.status(), 401);
    assert_eq!(push(Some(NEWER_TOKEN), "d").await?.status(), 401);
    let other = http.post(format!("{base}/v1/partners/other/feed")).bearer_auth(NEW_TOKEN);
    assert_eq!(other.body(line("e", 2)).send().await?.status(), 403, "push disabled for `other`");
    let ids = h.product_ids().await?;
    assert_eq!(ids, ["a", "b"]);
    Ok(())
}

// --- what a caller may hold of the push server -------------------------------

/// A raw connection to the push server: what a slow or idle client does.
async fn connect_raw(service: &Service) -> Result<tokio::net::TcpStream> {
    let addr = service.base.trim_start_matches("http://").to_string();
    Ok(tokio::net::TcpStream::connect(addr).await?)
}

/// Reads until the server closes the connection (or `within` passes):
/// what it sent, and whether it closed.
async fn read_until_closed(
    conn: &mut tokio::net::TcpStream,
    within: Duration,
) -> Result<(String, bool)> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Ok((String::from_utf8_lossy(&got).into(), true)),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return Ok((String::from_utf8_lossy(&got).into(), false)),
        }
    }
}

#[tokio::test]
async fn the_push_server_bounds_slow_headers_idle_connections_and_their_number() -> Result {
    use tokio::io::AsyncWriteExt;
    let mut h = harness(vec![full("bounded")]).await?;
    h.settings.partners[0].push_tokens_file = Some(h.tokens_file("bounded", PUSHED_TOKEN)?);
    h.settings.ingest.push_header_timeout = Duration::from_millis(500);
    h.settings.ingest.push_idle_timeout = Duration::from_millis(400);
    h.settings.ingest.push_max_connections = 2;
    let service = serve(&h.settings).await?;

    // Headers trickled in slower than the header timeout: the connection
    // is closed without an answer to the request.
    let mut slow = connect_raw(&service).await?;
    slow.write_all(b"POST /v1/partners/bounded/feed HTTP/1.1\r\nHost: x\r\n").await?;
    let (_, closed) = read_until_closed(&mut slow, Duration::from_secs(5)).await?;
    assert!(closed, "a request whose headers never end is cut off");

    // A kept-alive connection left idle after its request is closed.
    let mut idle = connect_raw(&service).await?;
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await?;
    let (answer, closed) = read_until_closed(&mut idle, Duration::from_secs(5)).await?;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(closed, "an idle kept-alive connection is closed");

    // Two connections held open by callers that send nothing: a third is
    // not served until one of them goes (closed by the header timeout).
    let _a = connect_raw(&service).await?;
    let _b = connect_raw(&service).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    let (status, _) = service.push("bounded", None, "{}").await?;
    assert_eq!(status, 401, "served once a slot is free");
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "the third caller waited for a slot ({:?})",
        started.elapsed()
    );
    service.stop().await
}

#[tokio::test]
async fn a_body_not_received_within_the_push_deadline_fails_the_import_with_408() -> Result {
    let mut h = harness(vec![full("trickle")]).await?;
    h.settings.partners[0].push_tokens_file = Some(h.tokens_file("trickle", PUSHED_TOKEN)?);
    h.settings.ingest.push_body_timeout = Duration::from_millis(700);
    let service = serve(&h.settings).await?;
    // One item, then nothing for longer than the deadline.
    let first = line("sku-1", 4);
    let body = futures::stream::unfold(0, move |n| {
        let first = first.clone();
        async move {
            match n {
                0 => Some((Ok::<_, std::io::Error>(bytes::Bytes::from(first)), 1)),
                1 => {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Some((Ok(bytes::Bytes::from(line("sku-2", 4))), 2))
                }
                _ => None,
            }
        }
    });
    let started = std::time::Instant::now();
    let (status, answer) =
        service.push("trickle", Some(PUSHED_TOKEN), reqwest::Body::wrap_stream(body)).await?;
    assert_eq!(status, 408, "{answer}");
    assert!(started.elapsed() < Duration::from_secs(4), "cut off at the deadline");
    let error = answer["error"].as_str().unwrap_or_default();
    assert!(error.contains("push_body_timeout"), "{answer}");
    assert_eq!(answer["report"]["sweeps"].as_u64(), Some(0), "nothing swept: {answer}");
    service.stop().await
}

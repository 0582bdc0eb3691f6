//! One import is one trace: ingest → storage → a ChangeFeed consumer, all in
//! this process, exporting OTLP/gRPC to an in-process receiver. The spans
//! must share one trace id and chain up as
//! `ingest.import` → `send <cmd>` (ingest) → `process <cmd>` (storage) →
//! `send <changes>` (storage relay) → `process <changes>` (feed).
//!
//! The tracing subscriber is global and can be set once per process: this
//! file is its own test binary with a single test.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};
use shelfsync_feed::{Bootstrap, ChangeFeed, FeedConfig, Handler, HandlerError, Update};
use shelfsync_ingest::{Importer, Source};
use shelfsync_settings::{ImportKind, LogFormat, PartnerSettings, TelemetrySettings};
use shelfsync_telemetry::Options;
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACE: i64 = 1;
const ITEMS: usize = 3;
const FEED: &str = "trace-test";

/// Counts what the feed delivers.
struct Counting(Arc<AtomicUsize>);

impl Handler for Counting {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        self.0.fetch_add(updates.len(), Ordering::SeqCst);
        Ok(())
    }

    async fn reset_place(&mut self, _: i64, _: i64) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn find<'a>(
    spans: &'a [ExportedSpan],
    what: &str,
    pred: impl Fn(&ExportedSpan) -> bool,
) -> &'a ExportedSpan {
    spans.iter().find(|s| pred(s)).unwrap_or_else(|| {
        let names: Vec<_> = spans
            .iter()
            .map(|s| format!("{} [{} parent {}]", s.name, s.span_id, s.parent_span_id))
            .collect();
        panic!("no {what} among the exported spans: {names:#?}")
    })
}

fn attr(span: &ExportedSpan, key: &str) -> String {
    span.attributes.get(key).cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_import_is_one_trace_from_ingest_through_storage_to_a_consumer() {
    let mut collector = FakeCollectorServer::start().await.expect("OTLP receiver");
    let telemetry = shelfsync_telemetry::init_with(
        "shelfsync-tests",
        &TelemetrySettings { log_level: "warn".into(), log_format: LogFormat::Json },
        Options { otlp_endpoint: Some(collector.endpoint()) },
    )
    .expect("telemetry");
    assert!(telemetry.exporting());

    let env = TestEnv::start().await.expect("servers");
    let mut settings = settings_for(&env);
    settings.storage.keyframe_schedule = String::new();
    let partner = PartnerSettings {
        name: "traced".into(),
        brand_id: BRAND,
        kind: ImportKind::Delta,
        fields: vec!["title".into(), "price".into(), "stock".into()],
        source: None,
        poll_interval: None,
        format: Default::default(),
        clear_missing: true,
        ..Default::default()
    };
    settings.partners = vec![partner.clone()];
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");

    // A consumer of the change stream, live before the import.
    let client = shelfsync_bus::connect(&settings.nats, "trace-test", false).await.expect("nats");
    let mut cfg = FeedConfig::new(FEED);
    cfg.bootstrap = Bootstrap::Resume;
    cfg.request_keyframe_if_missing = false;
    let mut feed = ChangeFeed::new(client, &settings, cfg);
    let status = feed.status();
    let delivered = Arc::new(AtomicUsize::new(0));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut handler = Counting(delivered.clone());
    let consumer = tokio::spawn(async move {
        feed.run(&mut handler, async move {
            let _ = stop_rx.await;
        })
        .await
    });
    eventually(SETTLE, "the feed to be live", || async {
        status.bootstrapped.load(Ordering::SeqCst)
    })
    .await;

    // One place, a few items: one command message, one change message.
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("feed.ndjson");
    let lines: String = (0..ITEMS)
        .map(|i| {
            format!(
                "{{\"brand_id\":{BRAND},\"place_id\":{PLACE},\"id\":\"sku-{i}\",\"title\":\"T{i}\",\"price\":{},\"stock\":1}}\n",
                100 + i
            )
        })
        .collect();
    std::fs::write(&path, lines).expect("write feed");
    let importer = Importer::connect(Arc::new(settings.clone())).await.expect("importer");
    let report = importer.import(&partner, Source::File(path), None).await.expect("import");
    assert_eq!(report.items, ITEMS as u64);
    h.wait_settled().await;
    eventually(SETTLE, "the consumer to apply the import", || async {
        delivered.load(Ordering::SeqCst) >= ITEMS
    })
    .await;

    // Everything ended so far goes to the receiver.
    let prefix = &settings.nats.prefix;
    let cmd = format!("send {prefix}.cmd.");
    let changes = format!("{prefix}.changes.{BRAND}.{PLACE}");
    let mut spans: Vec<ExportedSpan> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        telemetry.flush();
        spans.extend(collector.exported_spans(1, Duration::from_millis(500)).await);
        let complete = spans.iter().any(|s| s.name == "ingest.import")
            && spans.iter().any(|s| s.name.starts_with(&cmd))
            && spans.iter().any(|s| s.name == format!("process {changes}"));
        if complete || Instant::now() > deadline {
            break;
        }
    }

    let import = find(&spans, "ingest.import span", |s| s.name == "ingest.import");
    let trace = import.trace_id.clone();
    let ingest_send = find(&spans, "ingest send span", |s| {
        s.name.starts_with(&cmd) && s.parent_span_id == import.span_id
    });
    let cmd_subject = ingest_send.name.trim_start_matches("send ").to_string();
    let storage_process = find(&spans, "storage process span under the ingest send", |s| {
        s.name == format!("process {cmd_subject}") && s.parent_span_id == ingest_send.span_id
    });
    let relay = find(&spans, "storage relay span under the storage process", |s| {
        s.name == format!("send {changes}") && s.parent_span_id == storage_process.span_id
    });
    let feed_process = find(&spans, "feed process span under the relay", |s| {
        s.name == format!("process {changes}") && s.parent_span_id == relay.span_id
    });
    for s in [ingest_send, storage_process, relay, feed_process] {
        assert_eq!(s.trace_id, trace, "{} is in another trace", s.name);
        assert!(attr(s, "messaging.system").contains("nats"), "{}: {:?}", s.name, s.attributes);
    }
    assert_eq!(ingest_send.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(relay.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(storage_process.kind, "SPAN_KIND_CONSUMER");
    assert_eq!(feed_process.kind, "SPAN_KIND_CONSUMER");
    assert!(attr(ingest_send, "messaging.destination.name").contains(&cmd_subject));
    assert!(attr(storage_process, "messaging.consumer.group.name").contains("storage-p"));
    assert!(attr(storage_process, "messaging.batch.message_count").contains(&ITEMS.to_string()));
    assert!(attr(relay, "messaging.destination.name").contains(&changes));
    assert!(attr(feed_process, "messaging.consumer.group.name").contains(FEED));
    assert!(attr(feed_process, "messaging.batch.message_count").contains(&ITEMS.to_string()));

    // The same work in the Prometheus metrics of this process.
    let metrics = shelfsync_telemetry::render_metrics();
    for needle in [
        "shelfsync_commands_applied_total",
        "shelfsync_changes_emitted_total",
        "shelfsync_batch_seconds_bucket",
        "shelfsync_freshness_seconds_bucket{stage=\"storage\"",
        "shelfsync_freshness_seconds_bucket{stage=\"consumer\"",
        "shelfsync_ingest_items_total{partner=\"traced\"} 3",
        "shelfsync_ingest_bytes_total{partner=\"traced\"}",
    ] {
        assert!(metrics.contains(needle), "{needle} missing from\n{metrics}");
    }

    let _ = stop_tx.send(());
    consumer.await.expect("feed task").expect("feed");
    storage.stop().await.expect("storage stop");
    drop(telemetry);
}

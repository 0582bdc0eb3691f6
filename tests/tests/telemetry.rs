//! One push is one trace, continued from the client's `traceparent`:
//! ingest's HTTP server → storage → a ChangeFeed consumer, all in this
//! process, exporting OTLP/gRPC to an in-process receiver. The spans must
//! share the client's trace id and chain up as
//! `POST /v1/partners/{name}/feed` (ingest, SERVER, parent: the client's
//! span) → `ingest.import` → `send <cmd template>` (ingest) →
//! `process <cmd template>` (storage) → `send <changes template>` (storage
//! relay) → `process <changes template>` (feed), named after destination
//! templates with the concrete subject in `messaging.destination.name`.
//! The client's W3C `baggage` goes the same way: through the command
//! message and storage's outbox onto the change message's headers, and
//! into the context the consumer's handler runs in.
//! The same ingest serves `/metrics` with the build info, the process
//! metrics and the HTTP metrics of that push.
//!
//! The baggage is kept with the outbox entry itself, not only by the
//! command being handled: a second test commits a command's changes, kills
//! storage before it publishes them, and finds the command's trace and
//! baggage on the change a new storage relays at its start.
//!
//! The tracing subscriber is global and can be set once per process: only
//! the first test installs it (the second one's storages are processes of
//! their own).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::message::PublishMessage;
use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};
use prost::Message;
use shelfsync_feed::{Bootstrap, ChangeFeed, FeedConfig, Handler, HandlerError, Update};
use shelfsync_ingest::App;
use shelfsync_proto::{CommandBatch, msg_type};
use shelfsync_settings::{ImportKind, LogFormat, PartnerSettings, TelemetrySettings};
use shelfsync_telemetry::Options;
use shelfsync_testkit::TestEnv;
use shelfsync_tests::*;

const BRAND: i64 = 7;
const PLACE: i64 = 1;
const ITEMS: usize = 3;
const FEED: &str = "trace-test";
const PARTNER: &str = "traced";
const TOKEN: &str = "traced-0123456789abcdef";
/// The client's span, as its `traceparent` names it.
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const PUSH_ROUTE: &str = "/v1/partners/{name}/feed";
/// The client's baggage, as its `baggage` header says.
const CLIENT_BAGGAGE: &str = "tenant=acme,shelfsync.test=baggage";

/// Counts what the feed delivers, and notes the `tenant` baggage of the
/// context each delivery is handled in.
struct Counting {
    delivered: Arc<AtomicUsize>,
    tenants: Arc<Mutex<Vec<Option<String>>>>,
}

impl Handler for Counting {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        self.delivered.fetch_add(updates.len(), Ordering::SeqCst);
        let cx = shelfsync_telemetry::current_context();
        let tenant = shelfsync_telemetry::baggage_value(&cx, "tenant");
        self.tenants.lock().expect("tenants").push(tenant);
        Ok(())
    }

    async fn reset_place(&mut self, _: shelfsync_feed::PlaceKey) -> Result<(), HandlerError> {
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

/// An attribute's value as text (the receiver keeps the protobuf value's
/// debug form: `Some(AnyValue { value: Some(StringValue("nats")) })`).
fn attr(span: &ExportedSpan, key: &str) -> Option<String> {
    let raw = span.attributes.get(key)?;
    for tag in ["StringValue(\"", "IntValue(", "BoolValue(", "DoubleValue("] {
        if let Some(at) = raw.find(tag) {
            let value = &raw[at + tag.len()..];
            let end = value.find(['"', ')']).unwrap_or(value.len());
            return Some(value[..end].to_string());
        }
    }
    Some(raw.clone())
}

/// The attribute `key` of `span`, which must be there.
fn must(span: &ExportedSpan, key: &str) -> String {
    attr(span, key).unwrap_or_else(|| panic!("{} has no {key}: {:#?}", span.name, span.attributes))
}

/// Every messaging span is named `<operation> <template>`: a template
/// with its varying tokens named, never a concrete subject.
fn check_messaging_names(spans: &[ExportedSpan]) {
    for s in spans.iter().filter(|s| attr(s, "messaging.system").is_some()) {
        assert_eq!(must(s, "messaging.system"), "nats", "{}", s.name);
        let template = must(s, "messaging.destination.template");
        let operation = must(s, "messaging.operation.name");
        assert_eq!(s.name, format!("{operation} {template}"));
        assert!(template.contains('{'), "{} is no template", s.name);
        assert_ne!(must(s, "messaging.destination.name"), template, "{}", s.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_push_is_one_trace_from_the_client_through_storage_to_a_consumer() {
    let mut collector = FakeCollectorServer::start().await.expect("OTLP receiver");
    let telemetry = shelfsync_telemetry::init_with(
        "shelfsync-tests",
        &TelemetrySettings { log_level: "warn".into(), log_format: LogFormat::Json },
        Options { otlp_endpoint: Some(collector.endpoint()), ..Options::default() },
    )
    .expect("telemetry");
    assert!(telemetry.exporting());

    let env = TestEnv::start().await.expect("servers");
    let dir = tempfile::tempdir().expect("tmp");
    let tokens = dir.path().join("traced.tokens");
    std::fs::write(&tokens, format!("{TOKEN}\n")).expect("tokens file");
    let mut settings = storage_settings(&env);
    let partner = PartnerSettings {
        name: PARTNER.into(),
        brand_id: BRAND,
        kind: ImportKind::Delta,
        fields: vec!["title".into(), "price".into(), "stock".into()],
        push_tokens_file: Some(tokens),
        ..Default::default()
    };
    settings.partners = vec![partner.clone()];
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let storage = InProcessStorage::start(settings.clone()).await.expect("storage");

    // A consumer of the change stream, live before the push.
    let client = shelfsync_bus::connect(&settings.nats, "trace-test", false).await.expect("nats");
    let mut cfg = FeedConfig::new(FEED);
    cfg.bootstrap = Bootstrap::Resume;
    cfg.request_keyframe_if_missing = false;
    let mut feed = ChangeFeed::new(client, &settings.nats, cfg);
    let status = feed.status();
    let delivered = Arc::new(AtomicUsize::new(0));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let tenants = Arc::new(Mutex::new(Vec::new()));
    let mut handler = Counting { delivered: delivered.clone(), tenants: tenants.clone() };
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

    // The ingest service, pushed to by a traced client: one place, a few
    // items, so one command message and one change message.
    let ingest = App::build(settings.clone()).await.expect("ingest");
    let ingest_addr = ingest.local_addr();
    let ingest = spawn(ingest);
    let lines: String = (0..ITEMS)
        .map(|i| {
            format!(
                "{{\"brand_id\":{BRAND},\"place_id\":{PLACE},\"id\":\"sku-{i}\",\"title\":\"T{i}\",\"price\":{},\"stock\":1}}\n",
                100 + i
            )
        })
        .collect();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pushed = reqwest::Client::new()
        .post(format!("http://{ingest_addr}/v1/partners/{PARTNER}/feed"))
        .bearer_auth(TOKEN)
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .header("baggage", CLIENT_BAGGAGE)
        .body(lines)
        .send()
        .await
        .expect("push");
    assert_eq!(pushed.status(), 200);
    let report: serde_json::Value =
        serde_json::from_slice(&pushed.bytes().await.expect("report")).expect("a JSON report");
    assert_eq!(report["items"], ITEMS as u64, "{report}");
    h.wait_settled().await;
    eventually(SETTLE, "the consumer to apply the push", || async {
        delivered.load(Ordering::SeqCst) >= ITEMS
    })
    .await;

    // Everything ended so far goes to the receiver.
    let prefix = &settings.nats.prefix;
    let push_name = format!("POST {PUSH_ROUTE}");
    let cmd_template = format!("{prefix}.cmd.{{partition}}");
    let changes_template = format!("{prefix}.changes.{{brand_id}}.{{place_id}}");
    let changes = format!("{prefix}.changes.{BRAND}.{PLACE}");
    let mut spans: Vec<ExportedSpan> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        telemetry.flush();
        spans.extend(collector.exported_spans(1, Duration::from_millis(500)).await);
        let complete = spans.iter().any(|s| s.name == push_name)
            && spans.iter().any(|s| s.name == format!("send {cmd_template}"))
            && spans.iter().any(|s| {
                s.name == format!("process {changes_template}")
                    && attr(s, "messaging.consumer.group.name").as_deref() == Some(FEED)
            });
        if complete || Instant::now() > deadline {
            break;
        }
    }

    let http = find(&spans, "the push's server span", |s| s.name == push_name);
    assert_eq!(http.kind, "SPAN_KIND_SERVER");
    assert_eq!(http.trace_id, CLIENT_TRACE, "the client's trace goes on");
    assert_eq!(http.parent_span_id, CLIENT_SPAN, "under the client's span");
    assert_eq!(must(http, "http.route"), PUSH_ROUTE);
    assert_eq!(must(http, "http.request.method"), "POST");
    assert_eq!(must(http, "http.response.status_code"), "200");
    let import = find(&spans, "ingest.import under the server span", |s| {
        s.name == "ingest.import" && s.parent_span_id == http.span_id
    });
    let ingest_send = find(&spans, "ingest send span", |s| {
        s.name == format!("send {cmd_template}") && s.parent_span_id == import.span_id
    });
    let cmd_subject = must(ingest_send, "messaging.destination.name");
    assert!(cmd_subject.starts_with(&format!("{prefix}.cmd.")), "{cmd_subject}");
    let storage_process = find(&spans, "storage process span under the ingest send", |s| {
        s.name == format!("process {cmd_template}") && s.parent_span_id == ingest_send.span_id
    });
    let relay = find(&spans, "storage relay span under the storage process", |s| {
        s.name == format!("send {changes_template}") && s.parent_span_id == storage_process.span_id
    });
    let feed_process = find(&spans, "feed process span under the relay", |s| {
        s.name == format!("process {changes_template}") && s.parent_span_id == relay.span_id
    });
    for s in [import, ingest_send, storage_process, relay, feed_process] {
        assert_eq!(s.trace_id, CLIENT_TRACE, "{} is in another trace", s.name);
    }
    check_messaging_names(&spans);
    assert_eq!(ingest_send.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(relay.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(storage_process.kind, "SPAN_KIND_CONSUMER");
    assert_eq!(feed_process.kind, "SPAN_KIND_CONSUMER");
    assert_eq!(must(ingest_send, "messaging.operation.type"), "send");
    assert_eq!(must(feed_process, "messaging.operation.type"), "process");
    assert_eq!(must(ingest_send, "shelfsync.command_count"), ITEMS.to_string());
    assert_eq!(must(storage_process, "messaging.destination.name"), cmd_subject);
    assert!(must(storage_process, "messaging.consumer.group.name").starts_with("storage-p"));
    assert_eq!(must(storage_process, "shelfsync.command_count"), ITEMS.to_string());
    assert_eq!(must(relay, "messaging.destination.name"), changes);
    assert_eq!(must(feed_process, "messaging.destination.name"), changes);
    assert_eq!(must(feed_process, "messaging.consumer.group.name"), FEED);
    assert_eq!(must(feed_process, "shelfsync.change_count"), ITEMS.to_string());
    // One message each: not batch operations in the conventions' sense.
    for s in [ingest_send, storage_process, relay, feed_process] {
        let count = attr(s, "messaging.batch.message_count");
        assert_eq!(count, None, "{} counts records as messages", s.name);
    }

    // The client's baggage is on the change message storage published
    // (through the command message and the outbox entry), and in the
    // context the consumer's handler ran in.
    let changes_stream = h.js.get_stream(h.subjects.changes_stream()).await.expect("CHANGES");
    let change_msg =
        changes_stream.get_last_raw_message_by_subject(&changes).await.expect("the change");
    let baggage = change_msg.headers.get(shelfsync_telemetry::BAGGAGE).map(|v| v.to_string());
    assert_eq!(
        baggage_entries(baggage.as_deref()),
        ["shelfsync.test=baggage", "tenant=acme"],
        "{:?}",
        change_msg.headers
    );
    let tenants = tenants.lock().expect("tenants").clone();
    assert!(!tenants.is_empty());
    assert!(tenants.iter().all(|t| t.as_deref() == Some("acme")), "{tenants:?}");

    // The same work in the ingest's Prometheus metrics (the recorder is
    // process-wide: storage's and the feed's are there too).
    let (code, metrics) = http_get(ingest_addr, "/metrics").await.expect("/metrics");
    assert_eq!(code, 200);
    let build_info = format!(
        "shelfsync_build_info{{version=\"{}\",revision=\"{}\",service=\"shelfsync-tests\"}} 1",
        env!("CARGO_PKG_VERSION"),
        shelfsync_telemetry::REVISION.unwrap_or("unknown")
    );
    let pushed = format!(
        "shelfsync_http_requests_total{{method=\"POST\",status=\"200\",endpoint=\"{PUSH_ROUTE}\"}} 1"
    );
    for needle in [
        build_info.as_str(),
        "# TYPE process_cpu_seconds_total counter",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_start_time_seconds ",
        pushed.as_str(),
        "shelfsync_http_requests_duration_seconds_bucket{method=\"POST\",status=\"200\"",
        "shelfsync_commands_applied_total",
        "shelfsync_changes_emitted_total",
        "shelfsync_batch_seconds_bucket",
        "shelfsync_freshness_seconds_bucket{stage=\"storage\"",
        "shelfsync_freshness_seconds_bucket{stage=\"consumer\"",
        "shelfsync_ingest_items_total{partner=\"traced\"} 3",
        "shelfsync_ingest_bytes_total{partner=\"traced\"}",
        "shelfsync_consumer_lag{consumer=\"trace-test\"}",
    ] {
        assert!(metrics.contains(needle), "{needle} missing from\n{metrics}");
    }

    ingest.stop().await.expect("ingest");
    let _ = stop_tx.send(());
    consumer.await.expect("feed task").expect("feed");
    storage.stop().await.expect("storage stop");
    drop(telemetry);
}

/// The baggage entries of a header value, sorted.
fn baggage_entries(value: Option<&str>) -> Vec<String> {
    let mut entries: Vec<String> =
        value.unwrap_or_default().split(',').map(|e| e.trim().to_string()).collect();
    entries.sort();
    entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commands_baggage_outlives_a_crash_between_commit_and_relay() {
    let env = TestEnv::start().await.expect("servers");
    let settings = storage_settings(&env);
    let h = Harness::connect(settings.clone()).await.expect("harness");
    let p = h.partition(BRAND, PLACE);
    let batch = CommandBatch {
        partition: p.0,
        commands: vec![patch(BRAND, PLACE, "kept", &product("k", 1, 1), 0)],
        ..Default::default()
    };
    let command = PublishMessage::build()
        .payload(batch.encode_to_vec().into())
        .message_id("baggage-test:1")
        .header(shelfsync_bus::TYPE_HEADER, msg_type::COMMAND_BATCH)
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .header("baggage", CLIENT_BAGGAGE);
    h.js.send_publish(h.subjects.cmd(p), command).await.expect("publish").await.expect("ack");

    // The change is committed to the outbox, then storage dies before it
    // publishes it.
    let mut crashed = StorageProcess::start(&settings, &[("SHELFSYNC_FAILPOINT", "after_commit")])
        .expect("storage");
    let status = crashed.wait_exit(SETTLE).await.expect("the failpoint");
    assert!(!status.success(), "{status:?}");
    assert_eq!(h.store.outbox_len(p).await.expect("outbox"), 1, "the entry waits");

    // Another storage relays it at its start, outside any command's span:
    // what it publishes comes from the entry alone.
    let _storage = StorageProcess::start(&settings, &[]).expect("storage");
    h.wait_settled().await;
    let changes = h.js.get_stream(h.subjects.changes_stream()).await.expect("CHANGES");
    let change = changes
        .get_last_raw_message_by_subject(&h.subjects.changes(BRAND, PLACE))
        .await
        .expect("the change");
    let header = |name: &str| change.headers.get(name).map(|v| v.to_string());
    let traceparent = header(shelfsync_telemetry::TRACEPARENT).unwrap_or_default();
    assert!(traceparent.contains(CLIENT_TRACE), "{:?}", change.headers);
    assert_eq!(
        baggage_entries(header(shelfsync_telemetry::BAGGAGE).as_deref()),
        baggage_entries(Some(CLIENT_BAGGAGE)),
        "{:?}",
        change.headers
    );
}

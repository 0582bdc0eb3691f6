//! Process plumbing for every shelfsync binary: tracing initialisation,
//! OpenTelemetry export, trace context in NATS and HTTP headers, HTTP server
//! instrumentation and Prometheus metrics.
//!
//! - [`init`] installs the subscriber — env filter, text or JSON lines (with
//!   `trace_id` / `span_id`), and the OpenTelemetry layer exporting OTLP when
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set — and
//!   returns a [`Guard`] that flushes and shuts the exporter down when
//!   dropped. Without an endpoint spans still get ids (so context propagates
//!   and logs carry trace ids) but nothing is exported: no exporter, no
//!   background thread, no retries. The variables read here are listed in
//!   [`Options::from_vars`] (protocol, sampler, propagators, the CA and
//!   client certificate of an `https` endpoint); the SDK itself
//!   honours `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//!   `OTEL_EXPORTER_OTLP_TIMEOUT` / `_HEADERS` / `_COMPRESSION` and
//!   `OTEL_BSP_*`. What cannot be honoured is logged as a warning at start;
//!   a TLS file that cannot be used is an error (the service does not
//!   start); exports that fail are logged as they happen.
//! - [`inject`] / [`extract`]: trace context in NATS headers
//!   (`shelfsync_bus::Publisher` injects automatically).
//! - [`send_span!`] / [`process_span!`]: producer and consumer spans after
//!   the OpenTelemetry messaging conventions.
//! - [`instrument`]: server spans and HTTP metrics for an axum router.
//! - [`render_metrics`]: the Prometheus text of every `metrics` metric of
//!   the process, process metrics included; metric names are in [`names`].
//! - [`VERSION`] / [`REVISION`]: what was built. On every span as the
//!   resource's `service.version` (and `vcs.ref.head.revision`); in
//!   Prometheus once per process, as the labels of
//!   `shelfsync_build_info{version, revision, service} 1`, which every
//!   other series of the process joins on its `job` and `instance` (the
//!   Prometheus way: a version label on every series would split each
//!   series at every upgrade and every query would have to aggregate it
//!   away; see docs/OPERATE.md, "Versions").
#![forbid(unsafe_code)]

mod chain;
mod env;
mod export;
mod http;
mod json;
mod metrics;
mod propagation;
mod tls;

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use shelfsync_settings::{LogFormat, TelemetrySettings};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::export::{Reported, span_exporter};
use crate::tls::ExportTls;

pub use crate::chain::{Chain, chain};
pub use crate::env::{FileVar, Options, Propagator, Protocol, TlsFiles};
pub use crate::http::{UNMATCHED, instrument};
pub use crate::metrics::{
    install_metrics, names, render_metrics, render_metrics_after, seconds_since_us, set_build_info,
};
pub use crate::propagation::{
    BAGGAGE, Parts, TRACEPARENT, TRACESTATE, add_links, baggage_value, context_of, current_context,
    extract, extract_opt, from_parts, inject, inject_context, is_valid, parts, set_parent,
};
pub use crate::tls::install_crypto_provider;
pub use opentelemetry::Context;
#[doc(hidden)]
pub use tracing;

/// The version of the binaries (the workspace's): every span's
/// `service.version`, the `version` label of `shelfsync_build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git commit the binaries were built from, when the build knew it
/// (`SHELFSYNC_GIT_COMMIT`, or git in a release build: see `build.rs`).
pub const REVISION: Option<&str> = option_env!("SHELFSYNC_REVISION");

/// How long dropping the guard waits for the last spans to be exported.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// Flushes and shuts the trace exporter down when dropped. Hold it until
/// `main` returns.
#[must_use = "telemetry is flushed when the guard is dropped"]
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl Guard {
    /// True when spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports the spans ended so far; waits at most a few seconds.
    pub fn flush(&self) {
        if let Some(p) = &self.provider {
            let p = p.clone();
            run_bounded(move || {
                let _ = p.force_flush();
            });
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            run_bounded(move || {
                let _ = p.shutdown_with_timeout(SHUTDOWN_WAIT);
            });
        }
    }
}

/// Runs `f` on its own thread (an export needs the runtime's other threads
/// free) and waits for it a bounded time: a dead collector never holds a
/// process up at exit.
fn run_bounded(f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new().name("otel-flush".into()).spawn(move || {
        f();
        let _ = tx.send(());
    });
    if spawned.is_ok() {
        let _ = rx.recv_timeout(SHUTDOWN_WAIT + Duration::from_secs(1));
    }
}

/// Installs the global subscriber for `service`, exporting traces where the
/// `OTEL_*` variables say. `RUST_LOG` wins over the configured log level.
/// Calling it twice (tests) keeps the first subscriber.
pub fn init(service: &str, cfg: &TelemetrySettings) -> anyhow::Result<Guard> {
    init_with(service, cfg, Options::from_env())
}

/// Installs the propagators `OTEL_PROPAGATORS` asks for, and no tracer: a
/// process that passes trace context and baggage on without tracing (a
/// test of what storage keeps and relays).
pub fn install_propagators() {
    opentelemetry::global::set_text_map_propagator(Options::from_env().text_map_propagator());
}

/// As [`init`], with the options given (tests).
pub fn init_with(service: &str, cfg: &TelemetrySettings, opts: Options) -> anyhow::Result<Guard> {
    install_metrics();
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log_level))
        .map_err(|e| anyhow::anyhow!("invalid telemetry.log_level {:?}: {e}", cfg.log_level))?;
    let service = service_name(service);
    let tls = export_tls(&opts)?;
    let (provider, exporting, problem) = tracer_provider(&service, &opts, &tls);
    let fmt_layer = match cfg.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_target(false)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .event_format(json::JsonWithTrace)
            .fmt_fields(json::fields())
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    // Spans are traced at INFO whatever the log level: a quiet log must not
    // break the trace of an import.
    let otel_layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(service.clone()))
        .with_filter(LevelFilter::INFO);
    let installed = tracing_subscriber::registry().with(fmt_layer).with(otel_layer).try_init();
    if installed.is_err() {
        // A subscriber exists already (a second init in a test): ours
        // would trace nothing.
        drop(Guard { provider: exporting.then_some(provider) });
        return Ok(Guard { provider: None });
    }
    opentelemetry::global::set_text_map_propagator(opts.text_map_propagator());
    set_build_info(&service);
    for problem in opts.problems.iter().chain(&problem) {
        tracing::warn!(%problem, "telemetry configuration");
    }
    tracing::debug!(
        service,
        exporting,
        endpoint = opts.otlp_endpoint.as_deref().unwrap_or(""),
        protocol = ?opts.protocol,
        sampler = ?opts.sampler,
        propagators = ?opts.propagators,
        "telemetry initialised"
    );
    Ok(Guard { provider: exporting.then_some(provider) })
}

/// The TLS files of an `https` endpoint, read and checked: one that
/// cannot be used is an error (the service does not start), naming the
/// variable and the path. Nothing is read for a plain `http` endpoint or
/// without export.
fn export_tls(opts: &Options) -> anyhow::Result<ExportTls> {
    match &opts.otlp_endpoint {
        Some(endpoint) if env::is_https(endpoint) => ExportTls::load(&opts.tls),
        _ => Ok(ExportTls::default()),
    }
}

/// `OTEL_SERVICE_NAME` when set, else the binary's own name: the
/// resource's `service.name` and the `service` label of the build info.
fn service_name(default: &str) -> String {
    std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_string())
}

/// What every span of the process says of it: `service.name`, and the
/// build's `service.version` (and `vcs.ref.head.revision` when known),
/// which win over the same keys in `OTEL_RESOURCE_ATTRIBUTES`: the binary
/// knows what it is. Other attributes of that variable are kept (pod name,
/// namespace).
pub fn resource(service: &str) -> Resource {
    let mut builder = Resource::builder()
        .with_service_name(service.to_string())
        .with_attribute(opentelemetry::KeyValue::new("service.version", VERSION));
    if let Some(revision) = REVISION {
        builder =
            builder.with_attribute(opentelemetry::KeyValue::new("vcs.ref.head.revision", revision));
    }
    builder.build()
}

/// The tracer provider with the configured sampler: with a batch OTLP
/// exporter when an endpoint is set and a runtime is there to drive it,
/// else one that records span ids only. The second value says whether it
/// exports, the third why not when it was asked to.
fn tracer_provider(
    service: &str,
    opts: &Options,
    tls: &ExportTls,
) -> (SdkTracerProvider, bool, Option<String>) {
    let builder = SdkTracerProvider::builder()
        .with_resource(resource(service))
        .with_sampler(opts.sampler.clone());
    let Some(endpoint) = &opts.otlp_endpoint else {
        return (builder.build(), false, None);
    };
    // The gRPC channel is driven by the Tokio runtime it is built in.
    if tokio::runtime::Handle::try_current().is_err() {
        let problem = "telemetry::init was called outside a Tokio runtime: traces are not \
                       exported"
            .to_string();
        return (builder.build(), false, Some(problem));
    }
    match span_exporter(opts.protocol, endpoint, tls, opts.export_timeout) {
        Ok(exporter) => {
            let exporter = Reported::new(exporter, endpoint);
            (builder.with_batch_exporter(exporter).build(), true, None)
        }
        Err(e) => {
            let problem = format!(
                "OTLP exporter ({:?}) for {endpoint}: {e:#}: traces are not exported",
                opts.protocol
            );
            (builder.build(), false, Some(problem))
        }
    }
}

/// A PRODUCER span after the OpenTelemetry messaging conventions: named
/// `send <template>` (the destination template, `shelfsync.cmd.{partition}`:
/// few names, whatever the subject), with `messaging.system = nats`,
/// `messaging.operation.name` / `.type = send`,
/// `messaging.destination.template` and `messaging.destination.name` (the
/// concrete subject): `send_span!("ingest.send", template, subject,
/// shelfsync.command_count = 3)`. Publish inside it and the message carries
/// its context.
#[macro_export]
macro_rules! send_span {
    ($name:literal, $template:expr, $subject:expr $(, $($field:tt)*)?) => {{
        // `let x = &expr` keeps a temporary (a computed template) alive.
        let (__template, __subject) = (&$template, &$subject);
        let __template: &str = ::std::convert::AsRef::<str>::as_ref(__template);
        let __subject: &str = ::std::convert::AsRef::<str>::as_ref(__subject);
        $crate::tracing::info_span!(
            $name,
            otel.name = %::std::format!("send {}", __template),
            otel.kind = "producer",
            messaging.system = "nats",
            messaging.operation.name = "send",
            messaging.operation.type = "send",
            messaging.destination.template = %__template,
            messaging.destination.name = %__subject,
            $($($field)*)?
        )
    }};
}

/// A CONSUMER span `process <template>` (as [`send_span!`]), with the
/// durable consumer as `messaging.consumer.group.name`. Give it the
/// message's context with [`set_parent`] before entering it. A span that
/// handles several messages at once declares
/// `messaging.batch.message_count = Empty` and records it; counts of
/// records inside one message go in `shelfsync.*` attributes.
#[macro_export]
macro_rules! process_span {
    ($name:literal, $template:expr, $subject:expr, $group:expr $(, $($field:tt)*)?) => {{
        // `let x = &expr` keeps a temporary (a computed template) alive.
        let (__template, __subject) = (&$template, &$subject);
        let __template: &str = ::std::convert::AsRef::<str>::as_ref(__template);
        let __subject: &str = ::std::convert::AsRef::<str>::as_ref(__subject);
        $crate::tracing::info_span!(
            $name,
            otel.name = %::std::format!("process {}", __template),
            otel.kind = "consumer",
            messaging.system = "nats",
            messaging.operation.name = "process",
            messaging.operation.type = "process",
            messaging.destination.template = %__template,
            messaging.destination.name = %__subject,
            messaging.consumer.group.name = %$group,
            $($($field)*)?
        )
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resource_says_which_build_runs() {
        let resource = resource("shelfsync-unit");
        let get = |key: &'static str| {
            resource.get(&opentelemetry::Key::from_static_str(key)).map(|v| v.to_string())
        };
        assert_eq!(get("service.name").as_deref(), Some("shelfsync-unit"));
        assert_eq!(get("service.version").as_deref(), Some(env!("CARGO_PKG_VERSION")));
        assert_eq!(get("vcs.ref.head.revision").as_deref(), REVISION);
    }

    /// The only test of this binary that installs the global subscriber.
    #[test]
    fn without_an_endpoint_spans_get_ids_but_nothing_is_exported() {
        let cfg = TelemetrySettings { log_level: "warn".into(), log_format: LogFormat::Json };
        let guard = init_with("unit", &cfg, Options::default()).expect("init");
        assert!(!guard.exporting());
        let span =
            send_span!("unit.send", "prefix.cmd.{partition}", "prefix.cmd.3", partition = 3u32);
        let _entered = span.enter();
        let mut headers = async_nats::HeaderMap::new();
        inject(&mut headers);
        let tp = headers.get(TRACEPARENT).map(|v| v.as_str().to_string()).expect("traceparent");
        assert!(tp.starts_with("00-") && tp.ends_with("-01"), "{tp}");
        assert_eq!(parts(&extract(&headers)).traceparent, tp);
        guard.flush();
        drop(guard);
    }
}

//! Process plumbing for every shelfsync binary: tracing initialisation,
//! OpenTelemetry export, trace context in NATS headers, Prometheus metrics
//! and the shutdown signal.
//!
//! - [`init`] installs the subscriber — env filter, text or JSON lines (with
//!   `trace_id` / `span_id`), and the OpenTelemetry layer exporting OTLP
//!   over gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`)
//!   is set — and returns a [`Guard`] that flushes and shuts the exporter
//!   down when dropped. Without an endpoint spans still get ids (so context
//!   propagates and logs carry trace ids) but nothing is exported: no
//!   exporter, no background thread, no retries. `OTEL_SERVICE_NAME`,
//!   `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` / `_ARG`,
//!   `OTEL_EXPORTER_OTLP_TIMEOUT` / `_HEADERS` and `OTEL_BSP_*` are honoured
//!   by the SDK; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
//!   turn export off.
//! - [`inject`] / [`extract`]: W3C `traceparent` / `tracestate` in NATS
//!   headers (`shelfsync_bus::Publisher` injects automatically).
//! - [`send_span!`] / [`process_span!`]: producer and consumer spans after
//!   the OpenTelemetry messaging conventions.
//! - [`render_metrics`]: the Prometheus text of every `metrics` metric of
//!   the process; metric names are in [`names`].
#![forbid(unsafe_code)]

mod json;
mod metrics;
mod propagation;

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use shelfsync_settings::{LogFormat, TelemetrySettings};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use crate::metrics::{install_metrics, names, render_metrics, seconds_since_us};
pub use crate::propagation::{
    TRACEPARENT, TRACESTATE, add_links, context_of, current_context, extract, extract_opt,
    from_parts, inject, inject_context, is_valid, parts, set_parent,
};
pub use opentelemetry::Context;
#[doc(hidden)]
pub use tracing;

/// How long dropping the guard waits for the last spans to be exported.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// Where traces go; [`Options::from_env`] reads the standard variables.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// OTLP/gRPC endpoint (`http://jaeger:4317`); `None`: no export.
    pub otlp_endpoint: Option<String>,
}

impl Options {
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`;
    /// none when `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_string());
        let disabled = var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
        let endpoint = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .filter(|v| !v.is_empty())
            .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT").filter(|v| !v.is_empty()));
        Self { otlp_endpoint: if disabled { None } else { endpoint } }
    }
}

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

/// As [`init`], with the trace destination given (tests).
pub fn init_with(service: &str, cfg: &TelemetrySettings, opts: Options) -> anyhow::Result<Guard> {
    install_metrics();
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log_level))
        .map_err(|e| anyhow::anyhow!("invalid telemetry.log_level {:?}: {e}", cfg.log_level))?;
    let (provider, exporting, problem) = tracer_provider(service, &opts);
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
        .with_tracer(provider.tracer(service.to_string()))
        .with_filter(LevelFilter::INFO);
    let installed = tracing_subscriber::registry().with(fmt_layer).with(otel_layer).try_init();
    if installed.is_err() {
        // A subscriber exists already (a second init in a test): ours
        // would trace nothing.
        drop(Guard { provider: exporting.then_some(provider) });
        return Ok(Guard { provider: None });
    }
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    if let Some(problem) = problem {
        tracing::warn!(%problem, "traces are not exported");
    }
    tracing::debug!(service, exporting, "telemetry initialised");
    Ok(Guard { provider: exporting.then_some(provider) })
}

/// The tracer provider: with a batch OTLP exporter when an endpoint is set
/// and a runtime is there to drive it, else one that records span ids only.
fn tracer_provider(service: &str, opts: &Options) -> (SdkTracerProvider, bool, Option<String>) {
    let mut resource = Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").map_or(true, |v| v.trim().is_empty()) {
        resource = resource.with_service_name(service.to_string());
    }
    let builder = SdkTracerProvider::builder().with_resource(resource.build());
    let Some(endpoint) = &opts.otlp_endpoint else {
        return (builder.build(), false, None);
    };
    // The gRPC channel is driven by the Tokio runtime it is built in.
    if tokio::runtime::Handle::try_current().is_err() {
        let problem = "telemetry::init was called outside a Tokio runtime".to_string();
        return (builder.build(), false, Some(problem));
    }
    match opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint.clone())
        .build()
    {
        Ok(exporter) => (builder.with_batch_exporter(exporter).build(), true, None),
        Err(e) => (builder.build(), false, Some(format!("OTLP exporter for {endpoint}: {e}"))),
    }
}

/// A PRODUCER span `send <subject>` (OpenTelemetry messaging conventions):
/// `send_span!("ingest.send", subject, partition = 3)`. Publish inside it
/// and the message carries its context.
#[macro_export]
macro_rules! send_span {
    ($name:literal, $subject:expr $(, $($field:tt)*)?) => {{
        let __subject: &str = ::std::convert::AsRef::<str>::as_ref(&$subject);
        $crate::tracing::info_span!(
            $name,
            otel.name = %::std::format!("send {}", __subject),
            otel.kind = "producer",
            messaging.system = "nats",
            messaging.operation.type = "send",
            messaging.destination.name = %__subject,
            $($($field)*)?
        )
    }};
}

/// A CONSUMER span `process <subject>`, with the durable consumer as
/// `messaging.consumer.group.name` and an empty
/// `messaging.batch.message_count` to record. Give it the message's context
/// with [`set_parent`] before entering it.
#[macro_export]
macro_rules! process_span {
    ($name:literal, $subject:expr, $group:expr $(, $($field:tt)*)?) => {{
        let __subject: &str = ::std::convert::AsRef::<str>::as_ref(&$subject);
        $crate::tracing::info_span!(
            $name,
            otel.name = %::std::format!("process {}", __subject),
            otel.kind = "consumer",
            messaging.system = "nats",
            messaging.operation.type = "process",
            messaging.destination.name = %__subject,
            messaging.consumer.group.name = %$group,
            messaging.batch.message_count = $crate::tracing::field::Empty,
            $($($field)*)?
        )
    }};
}

/// Resolves on SIGTERM or SIGINT: the start of a graceful shutdown.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutdown signal received");
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The only test of this binary that installs the global subscriber.
    #[test]
    fn without_an_endpoint_spans_get_ids_but_nothing_is_exported() {
        let cfg = TelemetrySettings { log_level: "warn".into(), log_format: LogFormat::Json };
        let guard = init_with("unit", &cfg, Options::default()).expect("init");
        assert!(!guard.exporting());
        let span = send_span!("unit.send", "prefix.cmd.3", partition = 3u32);
        let _entered = span.enter();
        let mut headers = async_nats::HeaderMap::new();
        inject(&mut headers);
        let tp = headers.get(TRACEPARENT).map(|v| v.as_str().to_string()).expect("traceparent");
        assert!(tp.starts_with("00-") && tp.ends_with("-01"), "{tp}");
        assert_eq!(parts(&extract(&headers)).0, tp);
        guard.flush();
        drop(guard);
    }
}

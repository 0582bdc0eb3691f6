//! The OTLP span exporter of either protocol, with the TLS the `OTEL_*`
//! variables ask for, and [`Reported`] around it: the SDK's own logs of a
//! failed export are compiled out here, so without it a collector that
//! refuses the connection (an untrusted certificate, a wrong port) would
//! lose every span without a word in the service's log.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};

use crate::env::{Protocol, is_https};
use crate::tls::ExportTls;

/// How often, at most, failing exports are logged while they go on failing.
const SAY_AGAIN_AFTER: Duration = Duration::from_secs(60);

/// The OTLP exporter of `protocol` sending to `endpoint`. An `https`
/// endpoint is verified against the system's trust store (rustls, ring) and
/// the CA of `tls`, which also gives the client certificate, if any.
pub(crate) fn span_exporter(
    protocol: Protocol,
    endpoint: &str,
    tls: &ExportTls,
    timeout: Duration,
) -> anyhow::Result<opentelemetry_otlp::SpanExporter> {
    let https = is_https(endpoint);
    let exporter = match protocol {
        Protocol::Grpc => {
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(timeout);
            if https {
                builder = builder.with_tls_config(tls.tonic());
            }
            builder.build()?
        }
        Protocol::HttpProtobuf => {
            // The HTTP client's TLS takes the process's crypto provider.
            crate::tls::install_crypto_provider();
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(endpoint)
                .with_timeout(timeout);
            // The SDK's own client knows the system's roots only.
            if https && !tls.is_empty() {
                builder = builder.with_http_client(tls.http_client(timeout)?);
            }
            builder.build()?
        }
    };
    Ok(exporter)
}

/// An exporter that logs when its exports fail — the first failure at once,
/// then at most every [`SAY_AGAIN_AFTER`] with what was lost meanwhile —
/// and when they work again.
#[derive(Debug)]
pub(crate) struct Reported<E> {
    inner: E,
    endpoint: String,
    failures: Mutex<Failures>,
}

/// Failed exports not logged yet.
#[derive(Debug, Default)]
struct Failures {
    failing: bool,
    batches: u64,
    spans: u64,
    last_said: Option<Instant>,
}

impl<E> Reported<E> {
    pub(crate) fn new(inner: E, endpoint: &str) -> Self {
        Self { inner, endpoint: endpoint.to_string(), failures: Mutex::default() }
    }

    fn note(&self, result: &OTelSdkResult, spans: usize) {
        let Ok(mut f) = self.failures.lock() else { return };
        match result {
            Ok(()) if f.failing => {
                tracing::info!(endpoint = %self.endpoint, "OTLP export works again");
                *f = Failures::default();
            }
            Ok(()) => {}
            Err(error) => {
                f.failing = true;
                f.batches += 1;
                f.spans += spans as u64;
                if f.last_said.is_some_and(|at| at.elapsed() < SAY_AGAIN_AFTER) {
                    return;
                }
                tracing::warn!(
                    endpoint = %self.endpoint,
                    %error,
                    lost_batches = f.batches,
                    lost_spans = f.spans,
                    hint = hint(&self.endpoint),
                    "OTLP export failed: spans are lost"
                );
                (f.batches, f.spans, f.last_said) = (0, 0, Some(Instant::now()));
            }
        }
    }
}

/// What to look at when exports to `endpoint` fail.
fn hint(endpoint: &str) -> &'static str {
    if is_https(endpoint) {
        "is the collector up, and its certificate signed by a CA the system trusts or the one \
         OTEL_EXPORTER_OTLP_CERTIFICATE names?"
    } else {
        "is the collector up at that address?"
    }
}

impl<E: SpanExporter> SpanExporter for Reported<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        self.note(&result, spans);
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn shutdown(&self) -> OTelSdkResult {
        self.inner.shutdown()
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use super::*;
    use crate::env::{FileVar, TlsFiles};

    const TIMEOUT: Duration = Duration::from_secs(10);

    /// `http/protobuf` really goes out as `POST /v1/traces` with a protobuf
    /// body (the span's name is a plain string in it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn http_protobuf_posts_spans_to_v1_traces() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let receiver = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let kind =
                    headers.get("content-type").and_then(|v| v.to_str().ok()).map(String::from);
                let _ = tx.send((kind, body));
                async { "" }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let endpoint = format!("http://{}/v1/traces", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, receiver).await });
        let exporter =
            span_exporter(Protocol::HttpProtobuf, &endpoint, &ExportTls::default(), TIMEOUT)
                .expect("exporter");
        let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).build();
        provider.tracer("unit").in_span("unit.http-export", |_| {});
        // The blocking client must not hold a runtime thread.
        let flushed = tokio::task::spawn_blocking(move || provider.force_flush()).await;
        assert!(matches!(flushed, Ok(Ok(()))), "{flushed:?}");
        let (kind, body) = rx.recv().await.expect("a POST");
        assert_eq!(kind.as_deref(), Some("application/x-protobuf"));
        assert!(body.windows(16).any(|w| w == b"unit.http-export"), "{body:?}");
    }

    /// An `https` endpoint needs the TLS features: without them the
    /// exporter refuses to build.
    #[tokio::test]
    async fn https_endpoints_build_for_both_protocols() {
        for protocol in [Protocol::Grpc, Protocol::HttpProtobuf] {
            let built = span_exporter(
                protocol,
                "https://collector.invalid:4317",
                &ExportTls::default(),
                TIMEOUT,
            );
            assert!(built.is_ok(), "{protocol:?}: {:?}", built.err());
        }
    }

    /// A failing export is said once, then not again for a while; its
    /// result goes back to the SDK unchanged. Run as the SDK's batch
    /// processor runs exports: blocked on, on a thread of its own.
    #[test]
    fn a_failing_export_is_reported_and_passed_on() {
        // Nothing listens there: every export fails, within the timeout.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = format!("http://{}/v1/traces", closed.local_addr().expect("addr"));
        drop(closed);
        let quick = Duration::from_millis(300);
        let exporter =
            span_exporter(Protocol::HttpProtobuf, &endpoint, &ExportTls::default(), quick)
                .expect("exporter");
        let reported = Reported::new(exporter, &endpoint);
        let results: Vec<_> =
            (0..2).map(|_| futures::executor::block_on(reported.export(Vec::new()))).collect();
        assert!(results.iter().all(Result::is_err), "{results:?}");
        let f = reported.failures.lock().expect("lock");
        // The first failure was said; the second is counted for later.
        assert!(f.failing && f.last_said.is_some());
        assert_eq!(f.batches, 1);
    }

    /// TLS files that cannot be used stop the exporter from being made,
    /// naming the variable and the path.
    #[test]
    fn unusable_tls_files_are_refused_with_their_variable_and_path() {
        let dir = tempfile::tempdir().expect("tmp");
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").expect("write");
        let missing = dir.path().join("missing.pem");
        let file = |var: &str, path: &std::path::Path| FileVar {
            var: var.into(),
            path: path.to_path_buf(),
        };
        let ca = |path: &std::path::Path| TlsFiles {
            certificate: Some(file("OTEL_EXPORTER_OTLP_CERTIFICATE", path)),
            ..TlsFiles::default()
        };
        let cases = [
            (ca(&missing), "cannot be read"),
            (ca(dir.path()), "cannot be read"),
            (ca(&garbage), "no PEM certificate"),
            (
                TlsFiles {
                    client_key: Some(file("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", &garbage)),
                    ..TlsFiles::default()
                },
                "without its pair",
            ),
        ];
        for (files, what) in cases {
            let err = ExportTls::load(&files).expect_err("refused").to_string();
            let named = [&files.certificate, &files.client_key].into_iter().flatten().next();
            let named = named.expect("a file");
            let says = format!("{}={}", named.var, named.path.display());
            assert!(err.contains(&says), "{err:?} does not name {says}");
            assert!(err.contains(what), "{err:?} does not say {what:?}");
        }
        assert!(ExportTls::load(&TlsFiles::default()).expect("nothing to read").is_empty());
    }
}

//! An in-process OTLP trace receiver over TLS, for the tests that point a
//! real service's exporter at an `https` collector: gRPC (the collector's
//! `TraceService`, served by tonic) or HTTP/protobuf (`POST /v1/traces`,
//! served by axum), behind one rustls acceptor on a free loopback port. It
//! tells what arrived (service and span names, and every resource's
//! attributes), which handshakes failed and
//! why, and which client certificates were shown — so a test can tell "no
//! TLS" from "TLS refused" from "spans lost".

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// The OTLP transport the receiver speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Grpc,
    HttpProtobuf,
}

impl Wire {
    /// The `OTEL_EXPORTER_OTLP_PROTOCOL` value of this transport.
    pub fn protocol(self) -> &'static str {
        match self {
            Wire::Grpc => "grpc",
            Wire::HttpProtobuf => "http/protobuf",
        }
    }
}

/// One span as received: the `service.name` of its resource and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
}

/// The attributes of one resource that sent spans, as text (string values
/// as they are, others in their debug form).
pub type ResourceAttributes = BTreeMap<String, String>;

/// Every resource seen, in order of arrival (one per export request and
/// resource in it).
type Resources = Arc<Mutex<Vec<ResourceAttributes>>>;

/// What the TLS acceptor saw.
#[derive(Debug, Default)]
struct Handshakes {
    /// Why each failed handshake failed, in order.
    failed: Vec<String>,
    /// The client certificate (DER) each accepted one showed, if any.
    client_certificates: Vec<Option<Vec<u8>>>,
}

/// A running receiver; stops when dropped.
pub struct TlsReceiver {
    addr: SocketAddr,
    wire: Wire,
    spans: mpsc::UnboundedReceiver<ReceivedSpan>,
    received: Vec<ReceivedSpan>,
    handshakes: Arc<Mutex<Handshakes>>,
    resources: Resources,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl TlsReceiver {
    /// Serves `wire` with the certificate `cert` / `key` (PEM files); with
    /// `client_ca`, a client certificate signed by that CA is required.
    pub async fn start(
        wire: Wire,
        cert: &str,
        key: &str,
        client_ca: Option<&str>,
    ) -> anyhow::Result<Self> {
        let acceptor = TlsAcceptor::from(Arc::new(server_config(wire, cert, key, client_ca)?));
        let tcp = TcpListener::bind("127.0.0.1:0").await?;
        let addr = tcp.local_addr()?;
        let handshakes = Arc::new(Mutex::new(Handshakes::default()));
        let (conn_tx, conn_rx) = mpsc::unbounded_channel();
        let (span_tx, spans) = mpsc::unbounded_channel();
        let resources = Resources::default();
        let sink = Sink { spans: span_tx, resources: resources.clone() };
        let accept = tokio::spawn(accept_loop(tcp, acceptor, handshakes.clone(), conn_tx));
        let serve = match wire {
            Wire::Grpc => tokio::spawn(serve_grpc(conn_rx, sink)),
            Wire::HttpProtobuf => tokio::spawn(serve_http(conn_rx, sink)),
        };
        Ok(Self {
            addr,
            wire,
            spans,
            received: Vec::new(),
            handshakes,
            resources,
            tasks: vec![accept, serve],
        })
    }

    /// The endpoint to give the exporter (`OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub fn endpoint(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The transport served.
    pub fn wire(&self) -> Wire {
        self.wire
    }

    /// Every span received so far, waiting up to `timeout` for `done` to
    /// hold on them.
    pub async fn spans_until(
        &mut self,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> &[ReceivedSpan] {
        let deadline = Instant::now() + timeout;
        while !done(&self.received) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.spans.recv()).await {
                Ok(Some(span)) => self.received.push(span),
                Ok(None) | Err(_) => break,
            }
        }
        &self.received
    }

    /// Why the handshakes that failed failed.
    pub fn failed_handshakes(&self) -> Vec<String> {
        self.handshakes.lock().expect("handshakes").failed.clone()
    }

    /// The client certificate (DER) each accepted connection showed.
    pub fn client_certificates(&self) -> Vec<Option<Vec<u8>>> {
        self.handshakes.lock().expect("handshakes").client_certificates.clone()
    }

    /// The attributes of every resource that sent spans so far.
    pub fn resources(&self) -> Vec<ResourceAttributes> {
        self.resources.lock().expect("resources").clone()
    }
}

impl Drop for TlsReceiver {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The server side: the certificate, the ALPN the exporter expects (gRPC
/// insists on `h2`; the HTTP exporter speaks HTTP/1.1), and client
/// authentication when asked.
fn server_config(
    wire: Wire,
    cert: &str,
    key: &str,
    client_ca: Option<&str>,
) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = CertificateDer::pem_file_iter(cert)
        .context("server certificate")?
        .collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_file(key).context("server key")?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).context("client CA")? {
                roots.add(c?)?;
            }
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key)?;
    config.alpn_protocols = match wire {
        Wire::Grpc => vec![b"h2".to_vec()],
        Wire::HttpProtobuf => vec![b"http/1.1".to_vec()],
    };
    Ok(config)
}

/// Accepts connections and does their handshakes, each on its own task;
/// the established ones go to the server.
async fn accept_loop(
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    handshakes: Arc<Mutex<Handshakes>>,
    conns: mpsc::UnboundedSender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    while let Ok((stream, peer)) = tcp.accept().await {
        let (acceptor, handshakes, conns) = (acceptor.clone(), handshakes.clone(), conns.clone());
        tokio::spawn(async move {
            match acceptor.accept(stream).await {
                Ok(tls) => {
                    let shown = tls
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|certs| certs.first())
                        .map(|c| c.as_ref().to_vec());
                    handshakes.lock().expect("handshakes").client_certificates.push(shown);
                    let _ = conns.send((tls, peer));
                }
                Err(e) => handshakes.lock().expect("handshakes").failed.push(e.to_string()),
            }
        });
    }
}

/// The DER of the first certificate in a PEM file (to compare with what
/// a client showed).
pub fn der_of(pem_file: &str) -> anyhow::Result<Vec<u8>> {
    Ok(CertificateDer::from_pem_file(pem_file).context("certificate")?.as_ref().to_vec())
}

/// Where the servers put what arrives: spans to the test's channel,
/// resources to the shared list.
#[derive(Clone)]
struct Sink {
    spans: mpsc::UnboundedSender<ReceivedSpan>,
    resources: Resources,
}

impl Sink {
    /// Takes the spans of one export request, by service, and its
    /// resources.
    fn take(&self, request: ExportTraceServiceRequest) {
        for rs in request.resource_spans {
            let attributes: ResourceAttributes = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .map(|kv| {
                    let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                        Some(Value::StringValue(s)) => s.clone(),
                        Some(other) => format!("{other:?}"),
                        None => String::new(),
                    };
                    (kv.key.clone(), value)
                })
                .collect();
            let service = attributes.get("service.name").cloned().unwrap_or_default();
            self.resources.lock().expect("resources").push(attributes);
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                let _ = self.spans.send(ReceivedSpan { service: service.clone(), name: span.name });
            }
        }
    }
}

/// The collector's gRPC `TraceService`: hands every span to the test.
struct Collector(Sink);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.take(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

type Conns = mpsc::UnboundedReceiver<(TlsStream<TcpStream>, SocketAddr)>;

async fn serve_grpc(conns: Conns, sink: Sink) {
    let incoming = futures::stream::unfold(conns, |mut conns| async move {
        let (tls, _) = conns.recv().await?;
        Some((Ok::<_, std::io::Error>(tls), conns))
    });
    let _ = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(Collector(sink)))
        .serve_with_incoming(incoming)
        .await;
}

async fn serve_http(conns: Conns, sink: Sink) {
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sink = sink.clone();
            async move {
                let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                    return (axum::http::StatusCode::BAD_REQUEST, Vec::new());
                };
                sink.take(request);
                (axum::http::StatusCode::OK, ExportTraceServiceResponse::default().encode_to_vec())
            }
        }),
    );
    let _ = axum::serve(Accepted(conns), app).await;
}

/// The established TLS connections, as axum's listener.
struct Accepted(Conns);

impl axum::serve::Listener for Accepted {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.0.recv().await {
            Some(conn) => conn,
            // The acceptor is gone: nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(SocketAddr::from(([127, 0, 0, 1], 0)))
    }
}

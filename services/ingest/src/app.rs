//! The ingest service: one poll loop per partner with a `source` and a
//! `poll_interval`, and an HTTP server for pushed feeds, probes and
//! Prometheus `/metrics`. At most one import per partner runs at a time in
//! the process (a lock), and one full import per partner across every
//! replica and the CLI (the importer's lease): the service never waits for
//! a lease held elsewhere — a poll skips that round, a push gets 409. A push
//! needs the partner's bearer token (`auth`) and a body within the partner's
//! limit; both are checked before the import is started, so a refused push
//! publishes nothing. The server bounds what callers may hold of it: a
//! connection cap, a header read timeout and an idle timeout
//! (`serve_bounded`), and a deadline for a pushed body (408 past it).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::Json;
use axum::body::Body;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::StreamExt;
use serde_json::json;
use shelfsync_service::{ConnLimits, Drain, Probes, Readiness, Service, serve_bounded};
use shelfsync_settings::{IngestSettings, PartnerSettings, Settings};
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio_util::io::StreamReader;
use tracing::{debug, info, warn};

use crate::auth::{PushAuth, Refusal};
use crate::import::{ImportConfig, Importer};
use crate::metrics;
use crate::report::ImportError;
use crate::source::{FileSignature, Source};

/// How long running imports may take to finish once shutdown is asked.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// One lock per partner: an import holds it from start to report.
type Locks = Arc<HashMap<String, Arc<Mutex<()>>>>;

#[derive(Clone)]
struct AppState {
    importer: Arc<Importer>,
    partners: Arc<[PartnerSettings]>,
    ingest: Arc<IngestSettings>,
    locks: Locks,
    auth: Arc<PushAuth>,
}

pub struct App {
    state: AppState,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl App {
    /// Reads the partners' push tokens (from their files and the process
    /// environment), connects (NATS in the background, Redis now) and binds
    /// the listener.
    pub async fn build(settings: Settings) -> anyhow::Result<App> {
        let auth =
            PushAuth::load(&settings.partners, &settings.ingest, |var| std::env::var(var).ok())
                .context("cannot load the push tokens")?;
        let auth = Arc::new(auth);
        let importer = Arc::new(Importer::connect_with(ImportConfig::from(&settings), true).await?);
        let listener = shelfsync_service::bind(&settings.ingest.listen).await?;
        let addr = listener.local_addr()?;
        let locks =
            settings.partners.iter().map(|p| (p.name.clone(), Arc::new(Mutex::new(())))).collect();
        let state = AppState {
            importer,
            partners: settings.partners.into(),
            ingest: Arc::new(settings.ingest),
            locks: Arc::new(locks),
            auth,
        };
        Ok(App { state, listener, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Service for App {
    /// Serves and polls until `shutdown` completes, then lets running
    /// imports finish (up to a grace period).
    async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let drain = Drain::new();
        let mut pollers = JoinSet::new();
        for partner in self.state.partners.iter() {
            if let (Some(_), Some(_)) = (&partner.source, partner.poll_interval) {
                pollers.spawn(poll_loop(self.state.clone(), partner.clone(), drain.clone()));
            }
        }
        // A push's import runs inside the request's span: its trace goes on
        // from the client's `traceparent`. The peer's address is what a
        // refusal is logged once per.
        let ingest = &self.state.ingest;
        let limits = ConnLimits {
            max_connections: ingest.push_max_connections,
            header_timeout: ingest.push_header_timeout,
            idle_timeout: ingest.push_idle_timeout,
        };
        let mut server = serve_bounded(self.listener, router(self.state.clone()), &drain, limits);
        info!(addr = %self.addr, pollers = pollers.len(), "ingest running");
        tokio::select! {
            () = shutdown => info!("shutting down"),
            result = &mut server => {
                drain.start();
                return Err(anyhow::anyhow!("the HTTP server stopped: {:?}", result));
            }
        }
        drain.start();
        let finish = async {
            _ = server.await;
            while pollers.join_next().await.is_some() {}
        };
        if tokio::time::timeout(SHUTDOWN_GRACE, finish).await.is_err() {
            warn!(grace = ?SHUTDOWN_GRACE, "imports still running at shutdown were cut off (nothing swept)");
        }
        Ok(())
    }
}

/// The push API and the probes: ready while connected to NATS.
fn router(state: AppState) -> axum::Router {
    let importer = state.importer.clone();
    let probes = Probes::new(move || Readiness::from_bool(importer.nats_connected()));
    axum::Router::new()
        .route("/v1/partners/{name}/feed", post(push))
        .with_state(state)
        .merge(probes.router())
}

fn error(status: StatusCode, message: String) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

/// `POST /v1/partners/{name}/feed`: the body is the feed, streamed into the
/// importer; the answer is the report. The credentials, then the declared
/// size, are checked before the partner's lock is taken or the importer
/// touched: a refused push publishes nothing.
async fn push(
    State(app): State<AppState>,
    ConnectInfo(remote): ConnectInfo<SocketAddr>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let remote = remote.ip();
    let checked = {
        let (auth, name, headers) = (app.auth.clone(), name.clone(), headers.clone());
        // It may re-read a changed tokens file.
        tokio::task::spawn_blocking(move || auth.check(&headers, &name)).await
    };
    match checked {
        Ok(Ok(())) => {}
        Ok(Err(refusal)) => return app.auth.refuse(remote, &name, refusal),
        Err(e) => {
            return error(StatusCode::INTERNAL_SERVER_ERROR, format!("credentials check: {e}"));
        }
    }
    let (Some(partner), Some(lock)) =
        (app.partners.iter().find(|p| p.name == name), app.locks.get(&name))
    else {
        return app.auth.refuse(remote, &name, Refusal::UnknownPartner);
    };
    let max = partner.push_limit(&app.ingest);
    let too_large = |what: &str| {
        let message =
            format!("{what} is over partner `{name}`'s push limit of {max} bytes (max_push_bytes)");
        app.auth.refuse_with(remote, &name, Refusal::TooLarge, message)
    };
    if declared_length(&headers).is_some_and(|n| n > max) {
        return too_large("the declared Content-Length");
    }
    let Ok(_running) = lock.try_lock() else {
        return error(StatusCode::CONFLICT, format!("an import of `{name}` is already running"));
    };
    let mut seen = 0u64;
    let over = Arc::new(AtomicBool::new(false));
    let late = Arc::new(AtomicBool::new(false));
    let body = body.into_data_stream().map({
        let over = over.clone();
        move |chunk| {
            let chunk = chunk.map_err(io::Error::other)?;
            seen += chunk.len() as u64;
            if seen > max {
                over.store(true, Ordering::SeqCst);
                return Err(io::Error::other(format!("the body is over max_push_bytes = {max}")));
            }
            Ok(chunk)
        }
    });
    let body = within(body, app.ingest.push_body_timeout, late.clone());
    let source = Source::Stream(Box::new(StreamReader::new(Box::pin(body))));
    let (report, result) = app.importer.run(partner, source, None).await;
    let status = match &result {
        Ok(()) => return Json(report).into_response(),
        // The import failed at the limit (nothing swept); what it read
        // before stays published, as for any failed import.
        Err(_) if over.load(Ordering::SeqCst) => return too_large("the body"),
        Err(_) if late.load(Ordering::SeqCst) => {
            let limit = app.ingest.push_body_timeout;
            let message = format!(
                "the body was not received within {} (ingest.push_body_timeout); nothing swept",
                humantime::format_duration(limit)
            );
            return (
                StatusCode::REQUEST_TIMEOUT,
                Json(json!({ "error": message, "report": report })),
            )
                .into_response();
        }
        Err(e) if e.is_bad_feed() => StatusCode::BAD_REQUEST,
        Err(ImportError::Busy { .. }) => StatusCode::CONFLICT,
        Err(ImportError::Source { .. }) => StatusCode::BAD_REQUEST,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    let message = result.err().map(|e| e.to_string()).unwrap_or_default();
    (status, Json(json!({ "error": message, "report": report }))).into_response()
}

/// `body`, ending with an error (and `late` set) if it is not over within
/// `limit`: a push that trickles its body cannot hold its partner's lock,
/// its lease and a connection for ever.
fn within(
    body: impl futures::Stream<Item = io::Result<bytes::Bytes>> + Send + 'static,
    limit: Duration,
    late: Arc<AtomicBool>,
) -> impl futures::Stream<Item = io::Result<bytes::Bytes>> + Send + 'static {
    let deadline = tokio::time::Instant::now() + limit;
    futures::stream::unfold((Box::pin(body), false), move |(mut body, done)| {
        let late = late.clone();
        async move {
            if done {
                return None;
            }
            match tokio::time::timeout_at(deadline, body.next()).await {
                Ok(Some(chunk)) => Some((chunk, (body, false))),
                Ok(None) => None,
                Err(_) => {
                    late.store(true, Ordering::SeqCst);
                    let e = io::Error::new(io::ErrorKind::TimedOut, "the body took too long");
                    Some((Err(e), (body, true)))
                }
            }
        }
    })
}

/// The `Content-Length` a request declares, if any (hyper has checked that
/// it is a number and that the body matches it).
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Imports `partner.source` every `poll_interval`, the first time at once.
async fn poll_loop(app: AppState, partner: PartnerSettings, drain: Drain) {
    let (Some(source), Some(every)) = (partner.source.clone(), partner.poll_interval) else {
        return;
    };
    metrics::poll_interval(&partner.name, every);
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A file is imported again only when its signature changed.
    let mut last_file: Option<FileSignature> = None;
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = drain.started() => return,
        }
        let Some(lock) = app.locks.get(&partner.name) else {
            return;
        };
        let Ok(_running) = lock.try_lock() else {
            info!(partner = %partner.name, "previous import still running, poll skipped");
            continue;
        };
        let source = Source::parse(&source);
        let file_sig = FileSignature::of(source.file()).await;
        if file_sig.is_some() && file_sig == last_file {
            debug!(partner = %partner.name, "file unchanged, not imported");
            continue;
        }
        // The importer logs and records the outcome; a failed file is retried.
        // A file written after the look above differs from `file_sig` and
        // is read again at the next poll.
        match app.importer.import(&partner, source, None).await {
            Ok(_) => last_file = file_sig,
            Err(ImportError::Busy { holder, .. }) => {
                info!(partner = %partner.name, holder, "another import holds the lease, poll skipped");
            }
            Err(_) => {}
        }
    }
}

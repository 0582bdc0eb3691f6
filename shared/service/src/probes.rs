//! The three endpoints every service answers besides its own API:
//! `/healthz` (the process runs), `/readyz` (it does its work: the service
//! says when) and `/metrics` (every metric of the process, Prometheus text).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;

/// What `/readyz` answers: 200 or 503, with a short body (may be empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    Ready(&'static str),
    NotReady(&'static str),
}

impl Readiness {
    /// `Ready("")` when `ready`, else `NotReady("")`: for services whose
    /// probe answers by its status alone.
    pub fn from_bool(ready: bool) -> Self {
        if ready { Readiness::Ready("") } else { Readiness::NotReady("") }
    }

    fn response(self) -> (StatusCode, &'static str) {
        match self {
            Readiness::Ready(body) => (StatusCode::OK, body),
            Readiness::NotReady(body) => (StatusCode::SERVICE_UNAVAILABLE, body),
        }
    }
}

type ReadyFn = dyn Fn() -> Readiness + Send + Sync;
type CheckFuture = Pin<Box<dyn Future<Output = Readiness> + Send>>;
type CheckFn = dyn Fn() -> CheckFuture + Send + Sync;
type RefreshFn = dyn Fn() + Send + Sync;

/// The probes of one service instance: its readiness, and optionally the
/// values it sets just before a scrape (gauges of what it holds).
#[derive(Clone)]
pub struct Probes {
    ready: Arc<ReadyFn>,
    check: Option<Arc<CheckFn>>,
    refresh: Option<Arc<RefreshFn>>,
}

impl Probes {
    /// Probes whose `/readyz` asks `ready` at every request.
    pub fn new(ready: impl Fn() -> Readiness + Send + Sync + 'static) -> Self {
        Probes { ready: Arc::new(ready), check: None, refresh: None }
    }

    /// `/readyz` also asks `check` when `ready` says ready: for what only
    /// an I/O round trip can tell (a server that must answer). Its answer
    /// is then the probe's.
    pub fn check<F>(mut self, check: impl Fn() -> F + Send + Sync + 'static) -> Self
    where
        F: Future<Output = Readiness> + Send + 'static,
    {
        self.check = Some(Arc::new(move || Box::pin(check()) as CheckFuture));
        self
    }

    /// Before each `/metrics` render, `refresh` sets the gauges this
    /// instance keeps elsewhere (one scrape at a time, see
    /// `shelfsync_telemetry::render_metrics_after`).
    pub fn refresh_metrics(mut self, refresh: impl Fn() + Send + Sync + 'static) -> Self {
        self.refresh = Some(Arc::new(refresh));
        self
    }

    /// The routes, for any router state: merge the service's API into it
    /// (or it into the API) before serving.
    pub fn router<S>(self) -> Router<S>
    where
        S: Clone + Send + Sync + 'static,
    {
        let Probes { ready, check, refresh } = self;
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route(
                "/readyz",
                get(move || {
                    let answer = ready();
                    let check = check.clone();
                    async move {
                        match (answer, check) {
                            (Readiness::Ready(_), Some(check)) => check().await.response(),
                            _ => answer.response(),
                        }
                    }
                }),
            )
            .route(
                "/metrics",
                get(move || {
                    let refresh = refresh.clone();
                    async move {
                        shelfsync_telemetry::render_metrics_after(|| {
                            if let Some(refresh) = &refresh {
                                refresh();
                            }
                        })
                    }
                }),
            )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    use super::*;

    async fn get_text(app: &Router, path: &str) -> (StatusCode, String) {
        let request = Request::builder().uri(path).body(Body::empty()).expect("request");
        let response = app.clone().oneshot(request).await.expect("infallible");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn readyz_follows_the_service_and_metrics_refresh_first() {
        shelfsync_telemetry::install_metrics();
        let ready = Arc::new(AtomicBool::new(false));
        let scrapes = Arc::new(AtomicU64::new(0));
        let probes = Probes::new({
            let ready = ready.clone();
            move || {
                if ready.load(Ordering::SeqCst) {
                    Readiness::Ready("ready")
                } else {
                    Readiness::NotReady("warming up")
                }
            }
        })
        .refresh_metrics({
            let scrapes = scrapes.clone();
            move || {
                scrapes.fetch_add(1, Ordering::SeqCst);
            }
        });
        let app: Router = probes.router();
        assert_eq!(get_text(&app, "/healthz").await, (StatusCode::OK, "ok".into()));
        let not_ready = (StatusCode::SERVICE_UNAVAILABLE, "warming up".to_string());
        assert_eq!(get_text(&app, "/readyz").await, not_ready);
        ready.store(true, Ordering::SeqCst);
        assert_eq!(get_text(&app, "/readyz").await, (StatusCode::OK, "ready".into()));
        let (status, text) = get_text(&app, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(text.contains("process_cpu_seconds_total"), "{text}");
        assert_eq!(scrapes.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn readyz_asks_the_async_check_only_when_ready() {
        let ready = Arc::new(AtomicBool::new(false));
        let checks = Arc::new(AtomicU64::new(0));
        let answers = Arc::new(AtomicBool::new(false));
        let probes = Probes::new({
            let ready = ready.clone();
            move || Readiness::from_bool(ready.load(Ordering::SeqCst))
        })
        .check({
            let (checks, answers) = (checks.clone(), answers.clone());
            move || {
                checks.fetch_add(1, Ordering::SeqCst);
                let answers = answers.load(Ordering::SeqCst);
                async move {
                    if answers { Readiness::Ready("") } else { Readiness::NotReady("no answer") }
                }
            }
        });
        let app: Router = probes.router();
        let unavailable = |body: &str| (StatusCode::SERVICE_UNAVAILABLE, body.to_string());
        assert_eq!(get_text(&app, "/readyz").await, unavailable(""));
        assert_eq!(checks.load(Ordering::SeqCst), 0, "not asked while not ready");
        ready.store(true, Ordering::SeqCst);
        assert_eq!(get_text(&app, "/readyz").await, unavailable("no answer"));
        answers.store(true, Ordering::SeqCst);
        assert_eq!(get_text(&app, "/readyz").await, (StatusCode::OK, String::new()));
        assert_eq!(checks.load(Ordering::SeqCst), 2);
    }
}

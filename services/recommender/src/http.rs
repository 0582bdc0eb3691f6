//! The HTTP API (axum): top-N queries as JSON, health, readiness and the
//! shared Prometheus `/metrics` (shelfsync-telemetry). Thin: parsing and
//! answers live in `query`.

use std::sync::atomic::Ordering;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics::{counter, gauge};
use serde_json::json;

use crate::query::{Api, QueryError, TopQuery};

impl IntoResponse for QueryError {
    fn into_response(self) -> Response {
        let status = match &self {
            QueryError::BadRequest(_) => StatusCode::BAD_REQUEST,
            QueryError::NotReady => StatusCode::SERVICE_UNAVAILABLE,
        };
        (status, Json(json!({ "error": self.to_string() }))).into_response()
    }
}

pub fn router(api: Api) -> Router {
    let router = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/top/{brand}/{place}", get(top))
        .with_state(api);
    shelfsync_telemetry::instrument(router)
}

async fn readyz(State(api): State<Api>) -> StatusCode {
    if api.ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }
}

async fn top(
    State(api): State<Api>,
    Path((brand, place)): Path<(String, String)>,
    Query(params): Query<Vec<(String, String)>>,
) -> Response {
    api.stats.http.fetch_add(1, Ordering::Relaxed);
    match TopQuery::from_http(&brand, &place, &params, api.limits).and_then(|q| api.top(&q)) {
        Ok(items) => Json(items).into_response(),
        Err(e) => {
            api.stats.rejected.fetch_add(1, Ordering::Relaxed);
            e.into_response()
        }
    }
}

/// The process's Prometheus metrics (the feed kit's lag, freshness and drift
/// repairs among them), with this instance's gauges and counters brought up
/// to date first.
async fn metrics(State(api): State<Api>) -> String {
    use shelfsync_telemetry::names::*;
    let (offers, places) = {
        let index = api.index().read();
        (index.len(), index.places())
    };
    let c = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    shelfsync_telemetry::render_metrics_after(|| {
        gauge!(RECOMMENDER_READY).set(f64::from(u8::from(api.ready())));
        gauge!(RECOMMENDER_OFFERS).set(offers as f64);
        gauge!(RECOMMENDER_PLACES).set(places as f64);
        // The query counters are bumped by both transports on the shared
        // stats; they are published as counters at their current totals.
        counter!(RECOMMENDER_QUERIES, "transport" => "http").absolute(c(&api.stats.http));
        counter!(RECOMMENDER_QUERIES, "transport" => "nats").absolute(c(&api.stats.nats));
        counter!(RECOMMENDER_REJECTED_QUERIES).absolute(c(&api.stats.rejected));
        api.feed().record_metrics();
    })
}

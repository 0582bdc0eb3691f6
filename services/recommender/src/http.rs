//! The HTTP API (axum): top-N queries as JSON, health, readiness and the
//! shared Prometheus `/metrics` (shelfsync-telemetry). Thin: parsing and
//! answers live in `query`.

use std::sync::atomic::Ordering;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics::{counter, describe_counter, describe_gauge, gauge};
use serde_json::json;
use shelfsync_feed::FeedStatus;

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
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/top/{brand}/{place}", get(top))
        .with_state(api)
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

/// Serialises the "set this instance's values, render" of `/metrics`: the
/// recorder is process-wide, and tests run several recommenders at once.
static SCRAPE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The process's Prometheus metrics (the feed kit's lag, freshness and drift
/// repairs among them), with this instance's gauges and counters brought up
/// to date first.
async fn metrics(State(api): State<Api>) -> String {
    let (offers, places) = {
        let index = api.index().read();
        (index.len(), index.places())
    };
    let feed = api.feed();
    let c = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let _one_at_a_time = SCRAPE.lock().unwrap_or_else(|e| e.into_inner());
    gauge!("recommender_ready").set(f64::from(u8::from(api.ready())));
    gauge!("recommender_offers").set(offers as f64);
    gauge!("recommender_places").set(places as f64);
    gauge!("recommender_feed_position").set(FeedStatus::get(&feed.position) as f64);
    // The query counters are bumped by both transports on the shared stats;
    // they are published as counters at their current totals.
    counter!("recommender_http_queries_total").absolute(c(&api.stats.http));
    counter!("recommender_nats_queries_total").absolute(c(&api.stats.nats));
    counter!("recommender_rejected_queries_total").absolute(c(&api.stats.rejected));
    counter!("recommender_feed_delivered_total").absolute(FeedStatus::get(&feed.delivered));
    counter!("recommender_feed_drift_repairs_total").absolute(FeedStatus::get(&feed.drift_repairs));
    counter!("recommender_feed_poison_total").absolute(FeedStatus::get(&feed.poison));
    shelfsync_telemetry::render_metrics()
}

/// Help texts of the recommender's own metrics.
pub(crate) fn describe_metrics() {
    shelfsync_telemetry::install_metrics();
    describe_gauge!("recommender_ready", "1 once bootstrapped");
    describe_gauge!("recommender_offers", "Offers in the index");
    describe_gauge!("recommender_places", "Places with an offer");
    describe_gauge!("recommender_feed_position", "CHANGES stream sequence last handled");
    describe_counter!("recommender_http_queries_total", "HTTP top-N queries");
    describe_counter!("recommender_nats_queries_total", "NATS top-N queries");
    describe_counter!(
        "recommender_rejected_queries_total",
        "Queries refused (bad input, not ready)"
    );
    describe_counter!("recommender_feed_delivered_total", "Record versions applied");
    describe_counter!(
        "recommender_feed_drift_repairs_total",
        "Places reloaded after a digest mismatch"
    );
    describe_counter!("recommender_feed_poison_total", "Change messages dropped as undecodable");
}

//! The HTTP API (axum): top-N queries as JSON, health, readiness and
//! Prometheus counters. Thin: parsing and answers live in `query`.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
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

async fn metrics(State(api): State<Api>) -> String {
    let (offers, places) = {
        let index = api.index().read();
        (index.len(), index.places())
    };
    let feed = api.feed();
    let c = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let mut out = String::new();
    let mut line = |name: &str, kind: &str, help: &str, value: String| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    };
    line("recommender_ready", "gauge", "1 once bootstrapped", u8::from(api.ready()).to_string());
    line("recommender_offers", "gauge", "Offers in the index", offers.to_string());
    line("recommender_places", "gauge", "Places with an offer", places.to_string());
    line(
        "recommender_http_queries_total",
        "counter",
        "HTTP top-N queries",
        c(&api.stats.http).to_string(),
    );
    line(
        "recommender_nats_queries_total",
        "counter",
        "NATS top-N queries",
        c(&api.stats.nats).to_string(),
    );
    line(
        "recommender_rejected_queries_total",
        "counter",
        "Queries refused (bad input, not ready)",
        c(&api.stats.rejected).to_string(),
    );
    line(
        "recommender_feed_delivered_total",
        "counter",
        "Record versions applied",
        FeedStatus::get(&feed.delivered).to_string(),
    );
    line(
        "recommender_feed_drift_repairs_total",
        "counter",
        "Places reloaded after a digest mismatch",
        FeedStatus::get(&feed.drift_repairs).to_string(),
    );
    line(
        "recommender_feed_poison_total",
        "counter",
        "Change messages dropped as undecodable",
        FeedStatus::get(&feed.poison).to_string(),
    );
    line(
        "recommender_feed_position",
        "gauge",
        "CHANGES stream sequence last handled",
        FeedStatus::get(&feed.position).to_string(),
    );
    out
}

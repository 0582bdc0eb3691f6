//! The HTTP API (axum): top-N queries as JSON (behind bearer tokens when
//! `recommender.read_tokens_file` / `_env` are set), and the probes
//! (health, readiness, Prometheus `/metrics`, always open). Thin: parsing and answers live in
//! `query`, the metrics in `metrics`.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use std::sync::Arc;

use shelfsync_service::{ApiTokens, Probes, Readiness};

use crate::metrics::{self, Transport};
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

/// The API (asking for one of `tokens`, if any) and the probes: ready once
/// bootstrapped (and not stopping); the index's gauges are set before each
/// scrape.
pub fn router(api: Api, tokens: Option<Arc<ApiTokens>>) -> Router {
    let ready = api.clone();
    let scraped = api.clone();
    let probes =
        Probes::new(move || Readiness::from_bool(ready.ready())).refresh_metrics(move || {
            let (offers, places) = {
                let index = scraped.index().read();
                (index.len(), index.places())
            };
            metrics::set_index(scraped.ready(), offers, places);
            scraped.feed().record_metrics();
        });
    let top = Router::new().route("/v1/top/{brand}/{place}", get(top)).with_state(api);
    shelfsync_service::protect(top, tokens).merge(probes.router())
}

async fn top(
    State(api): State<Api>,
    Path((brand, place)): Path<(String, String)>,
    Query(params): Query<Vec<(String, String)>>,
) -> Response {
    metrics::query(Transport::Http);
    match TopQuery::from_http(&brand, &place, &params, api.limits).and_then(|q| api.top(&q)) {
        Ok(items) => Json(items).into_response(),
        Err(e) => {
            metrics::rejected();
            e.into_response()
        }
    }
}

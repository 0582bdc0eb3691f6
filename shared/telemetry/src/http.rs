//! HTTP server instrumentation for every axum router of shelfsync (the
//! ingest push API and every service's probes, metrics and read API), done
//! by two crates rather than by hand:
//!
//! - `axum-tracing-opentelemetry`: a SERVER span per request, named
//!   `<METHOD> <route>` (the route template, `/v1/partners/{name}/feed`),
//!   with the HTTP semantic-convention attributes (`http.request.method`,
//!   `http.route`, `url.path`, `http.response.status_code`, ...), continuing
//!   the W3C context the client sent (`traceparent`, through the propagator
//!   `init` installs);
//! - `axum-prometheus`: `shelfsync_http_requests_total`,
//!   `shelfsync_http_requests_duration_seconds` (histogram) and
//!   `shelfsync_http_requests_pending`, labelled `method`, `status` and
//!   `endpoint` (the route template; [`UNMATCHED`] for a path no route
//!   matched, so a scanner cannot blow up the label set).

use std::sync::LazyLock;

use axum::Router;
use axum_prometheus::{EndpointLabel, PrometheusMetricLayer, PrometheusMetricLayerBuilder};
use axum_tracing_opentelemetry::middleware::OtelAxumLayer;

/// The `endpoint` label of requests no route matched.
pub const UNMATCHED: &str = "unmatched";

/// Built once: the crate sets its metric names process-wide, once.
static METRICS: LazyLock<PrometheusMetricLayer<'static>> = LazyLock::new(|| {
    // Our recorder first, so that the layer's help texts land in it.
    crate::install_metrics();
    PrometheusMetricLayerBuilder::new()
        .with_prefix("shelfsync")
        .with_endpoint_label_type(EndpointLabel::MatchedPathWithFallbackFn(|_| {
            UNMATCHED.to_string()
        }))
        .build()
});

/// `router` with a server span and the HTTP metrics around every request.
/// Call it on the finished router (after every `route`), so that the route
/// template is known to both layers.
pub fn instrument<S>(router: Router<S>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    router.layer(METRICS.clone()).layer(OtelAxumLayer::default())
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::get;
    use tower::ServiceExt;

    use super::*;

    async fn call(app: &Router, path: &str) -> StatusCode {
        let request = Request::builder().uri(path).body(Body::empty()).expect("request");
        app.clone().oneshot(request).await.expect("infallible").status()
    }

    #[tokio::test]
    async fn requests_are_counted_by_route_template_never_by_raw_path() {
        let app = instrument(Router::new().route("/unit/things/{id}", get(|| async { "thing" })));
        assert_eq!(call(&app, "/unit/things/1").await, StatusCode::OK);
        assert_eq!(call(&app, "/unit/things/2").await, StatusCode::OK);
        assert_eq!(call(&app, "/unit/scanner/probe-7f3a").await, StatusCode::NOT_FOUND);
        let text = crate::render_metrics();
        let ok = r#"shelfsync_http_requests_total{method="GET",status="200",endpoint="/unit/things/{id}"} 2"#;
        assert!(text.contains(ok), "{text}");
        let unmatched =
            r#"shelfsync_http_requests_total{method="GET",status="404",endpoint="unmatched"} 1"#;
        assert!(text.contains(unmatched), "{text}");
        assert!(!text.contains("probe-7f3a"), "{text}");
        assert!(
            text.contains(r#"shelfsync_http_requests_duration_seconds_bucket{method="GET",status="200",endpoint="/unit/things/{id}",le="#),
            "{text}"
        );
    }
}

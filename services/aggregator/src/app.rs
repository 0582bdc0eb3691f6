//! Builds the aggregator from settings and runs it until told to stop: the
//! change feed (keyframe bootstrap, then the tail), the reload watcher and
//! the HTTP API.
//!
//! - `GET /v1/cards/{region}/{product}`: the master card as last published
//!   (404 when no offer qualifies);
//! - `GET /v1/places/{brand}/{place}/categories`: the place's non-empty
//!   categories, sorted;
//! - `/healthz`; `/readyz` (503 until bootstrapped); `/metrics`.
//!
//! With `aggregator.read_tokens_file` / `_env`, the `/v1/` routes ask for
//! one of those bearer tokens (401 without, 403 with another); the probes
//! and `/metrics` stay open.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use shelfsync_feed::{Bootstrap, ChangeFeed, FeedConfig, FeedStatus};
use shelfsync_proto::MasterCard;
use shelfsync_service::{Drain, Probes, Readiness, Service, serve};
use shelfsync_settings::Settings;
use shelfsync_telemetry::chain;

use crate::Config;
use tracing::{error, info};

use crate::aggregate::{CardId, PlaceKey};
use crate::engine::Aggregator;

/// How often the watcher looks for reloads to sweep.
const RELOAD_POLL: Duration = Duration::from_millis(100);

/// The feed configuration: a durable consumer named by
/// `aggregator.consumer`, bootstrapped from keyframes at every start (asked
/// of the `storage.replicas` storage replicas when there is none).
pub fn feed_config(config: &Config) -> FeedConfig {
    FeedConfig {
        bootstrap: Bootstrap::Keyframe,
        keyframe_responders: config.topology.storage_replicas,
        ..FeedConfig::new(&config.aggregator.consumer)
    }
}

pub struct App {
    config: Config,
    client: async_nats::Client,
    aggregator: Aggregator,
    http: tokio::net::TcpListener,
    /// The HTTP API's bearer tokens (`None`: open).
    tokens: Option<Arc<shelfsync_service::ApiTokens>>,
}

impl App {
    /// Connects to NATS and Redis, checks that the streams have the shape
    /// the settings describe (read-only: `shelfsync setup` writes it) and
    /// binds the HTTP listener.
    pub async fn build(settings: Settings) -> anyhow::Result<App> {
        crate::metrics::register();
        let client = shelfsync_bus::connect(&settings.nats, "shelfsync-aggregator", true).await?;
        let js = shelfsync_bus::jetstream(client.clone(), &settings.nats);
        shelfsync_bus::verify(&js, &settings.nats, settings.topology()).await?;
        let config = Config::from(&settings);
        let aggregator = Aggregator::connect(&config, client.clone()).await.with_context(|| {
            format!("cannot connect to Redis at {}", settings.redis.url_redacted())
        })?;
        let a = &settings.aggregator;
        let tokens = shelfsync_service::ApiTokens::load_for_api(
            "shelfsync-aggregator",
            a.read_tokens_file.as_deref(),
            a.read_tokens_env.as_deref(),
        )?;
        let http = shelfsync_service::bind(&settings.aggregator.http_listen).await?;
        Ok(App { config, client, aggregator, http, tokens })
    }

    /// Where the HTTP API listens (useful with port 0).
    pub fn http_addr(&self) -> std::net::SocketAddr {
        self.http.local_addr().expect("bound listener has an address")
    }

    pub fn aggregator(&self) -> Aggregator {
        self.aggregator.clone()
    }
}

impl Service for App {
    /// Runs until `shutdown` resolves, then finishes the batch in hand (the
    /// feed acks it), stops the watcher and the HTTP server.
    async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let App { config, client, aggregator, http: http_listener, tokens } = self;
        // Whatever a crash left half published goes out before anything new.
        aggregator.recover().await.context("recovering unpublished aggregates")?;
        let mut feed = ChangeFeed::new(client.clone(), &config.nats, feed_config(&config));
        let feed_status = feed.status();
        aggregator.follow(feed_status.clone()).await;
        info!(
            consumer = %config.aggregator.consumer,
            places = config.aggregator.places.len(),
            default_region = ?config.aggregator.default_region,
            http = %http_listener.local_addr()?,
            "aggregator starting"
        );

        let drain = Drain::new();
        let http = Http { aggregator: aggregator.clone(), feed: feed_status.clone() };
        let http_task = serve(http_listener, router(http, tokens), &drain);
        let watcher = tokio::spawn(watch_reloads(aggregator.clone(), drain.clone()));

        let mut handler = aggregator;
        let result = run_feed(&mut feed, &mut handler, &feed_status, shutdown).await;
        drain.start();
        let _ = watcher.await;
        http_task.await.context("http task")?.context("http server")?;
        shelfsync_bus::close(&client).await;
        info!("aggregator stopped");
        result.context("change feed")
    }
}

/// Runs the feed until `shutdown`. Live, the feed itself stops after the
/// message in hand (acked). During the bootstrap it does not look at the
/// shutdown future (it may be waiting minutes for a keyframe), so the
/// bootstrap is abandoned instead: nothing is acked yet, and whatever a
/// half-applied snapshot part left is in the dirty set, recomputed at the
/// next start, which bootstraps again anyway.
async fn run_feed(
    feed: &mut ChangeFeed,
    handler: &mut Aggregator,
    status: &FeedStatus,
    shutdown: impl Future<Output = ()>,
) -> Result<(), shelfsync_feed::FeedError> {
    let stop = Drain::new();
    let run = feed.run(handler, stop.started());
    tokio::pin!(run);
    tokio::pin!(shutdown);
    tokio::select! {
        result = &mut run => result,
        _ = &mut shutdown => {
            stop.start();
            if status.is_bootstrapped() {
                run.await
            } else {
                info!("stopping during the bootstrap");
                Ok(())
            }
        }
    }
}

/// Sweeps reloads once the feed reports them complete (a bootstrap that
/// went live without any further change would otherwise never be swept).
async fn watch_reloads(aggregator: Aggregator, drain: Drain) {
    loop {
        tokio::select! {
            _ = drain.started() => return,
            _ = tokio::time::sleep(RELOAD_POLL) => {}
        }
        if let Err(e) = aggregator.finish_reloads().await {
            error!(error = %chain(&e), "sweeping a reloaded place failed; will retry");
        }
    }
}

#[derive(Clone)]
struct Http {
    aggregator: Aggregator,
    feed: Arc<FeedStatus>,
}

/// A master card as JSON.
#[derive(Debug, Serialize)]
struct CardJson {
    region: String,
    product_id: String,
    min_price: Option<i64>,
    offers: u32,
    cheapest: Option<KeyJson>,
    currency: Option<String>,
}

#[derive(Debug, Serialize)]
struct KeyJson {
    brand_id: i64,
    place_id: i64,
    product_id: String,
}

impl From<MasterCard> for CardJson {
    fn from(c: MasterCard) -> Self {
        CardJson {
            region: c.region,
            product_id: c.product_id,
            min_price: c.min_price,
            offers: c.offers,
            cheapest: c.cheapest.map(|k| KeyJson {
                brand_id: k.brand_id,
                place_id: k.place_id,
                product_id: k.product_id,
            }),
            currency: c.currency,
        }
    }
}

fn unavailable(e: &(dyn std::error::Error + 'static)) -> Response {
    error!(error = %chain(e), "read failed");
    (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"error": e.to_string()})))
        .into_response()
}

/// The read API (asking for one of `tokens`, if any) and the probes
/// (always open).
fn router(state: Http, tokens: Option<Arc<shelfsync_service::ApiTokens>>) -> Router {
    let probes = probes(&state);
    let api = Router::new()
        .route("/v1/cards/{region}/{product}", get(card))
        .route("/v1/places/{brand}/{place}/categories", get(categories))
        .with_state(state);
    shelfsync_service::protect(api, tokens).merge(probes.router())
}

/// Ready once bootstrapped and every reloaded place is swept; before a
/// scrape, the reloads still due and the feed's counters are brought up to
/// date.
fn probes(state: &Http) -> Probes {
    let (feed, status) = (state.feed.clone(), state.aggregator.status());
    let ready = move || {
        if feed.is_bootstrapped() && status.pending_reloads.load(Ordering::SeqCst) == 0 {
            Readiness::Ready("ready")
        } else {
            Readiness::NotReady("bootstrapping")
        }
    };
    let (feed, status) = (state.feed.clone(), state.aggregator.status());
    Probes::new(ready).refresh_metrics(move || {
        crate::metrics::set_pending_reloads(status.pending_reloads.load(Ordering::Relaxed));
        feed.record_metrics();
    })
}

async fn card(
    State(h): State<Http>,
    Path((region, product_id)): Path<(String, String)>,
) -> Response {
    let id = CardId { region, product_id };
    match h.aggregator.store().card(&id).await {
        Ok(Some(c)) if c.offers > 0 => Json(CardJson::from(c)).into_response(),
        Ok(_) => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({
                "error": "no qualifying offer",
                "region": id.region,
                "product_id": id.product_id,
            })),
        )
            .into_response(),
        Err(e) => unavailable(&e),
    }
}

async fn categories(State(h): State<Http>, Path((brand, place)): Path<(i64, i64)>) -> Response {
    match h.aggregator.store().categories(PlaceKey::new(brand, place)).await {
        Ok(list) => Json(list).into_response(),
        Err(e) => unavailable(&e),
    }
}

//! Builds the validator from settings and runs it until told to stop: the
//! change feed (one durable consumer shared by every replica) and the HTTP
//! probes.

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use shelfsync_feed::{Bootstrap, ChangeFeed, FeedConfig, FeedStatus};
use shelfsync_settings::{Settings, ValidatorSettings};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::handler::{Stats, Validator};
use crate::rules::Rules;

/// Longest wait between two attempts to bind the change feed.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(10);

/// The feed every replica runs: the same durable consumer, resumed (no
/// snapshot: the validator judges changes, it keeps no state to rebuild).
pub fn feed_config(settings: &ValidatorSettings) -> FeedConfig {
    FeedConfig {
        bootstrap: Bootstrap::Resume,
        request_keyframe_if_missing: false,
        ..FeedConfig::new(settings.consumer.clone())
    }
}

pub struct App {
    settings: Arc<Settings>,
    client: async_nats::Client,
    rules: Arc<Rules>,
    feed: ChangeFeed,
    stats: Arc<Stats>,
    http: tokio::net::TcpListener,
}

impl App {
    /// Checks the rules, connects to NATS (retrying in the background) and
    /// binds the HTTP listener.
    pub async fn build(settings: Settings) -> anyhow::Result<App> {
        let rules = Rules::from_settings(&settings.validator.rules)?;
        let client = shelfsync_bus::connect(&settings.nats, "shelfsync-validator", true).await?;
        let listen = &settings.validator.http_listen;
        let http = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        let feed = ChangeFeed::new(client.clone(), &settings, feed_config(&settings.validator));
        Ok(App {
            settings: Arc::new(settings),
            client,
            rules: Arc::new(rules),
            feed,
            stats: Arc::default(),
            http,
        })
    }

    /// Where the probes listen (useful with port 0).
    pub fn http_addr(&self) -> SocketAddr {
        self.http.local_addr().expect("a bound listener has an address")
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    pub fn feed_status(&self) -> Arc<FeedStatus> {
        self.feed.status()
    }

    /// Judges changes until `shutdown` resolves, then finishes the message in
    /// hand (its commands published, the message acked) and stops.
    pub async fn run_until(mut self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        info!(
            consumer = %self.settings.validator.consumer,
            rules = self.rules.len(),
            http = %self.http_addr(),
            "validator starting"
        );
        let (stop_tx, stop_rx) = watch::channel(false);
        let http = tokio::spawn(
            axum::serve(self.http, router(self.feed.status()))
                .with_graceful_shutdown(stopped(stop_rx.clone()))
                .into_future(),
        );
        let mut handler =
            Validator::new(self.client.clone(), &self.settings, self.rules.clone(), self.stats);
        let signal = async move {
            shutdown.await;
            info!("shutting down: finishing the message in hand");
            let _ = stop_tx.send(true);
        };
        let feed = &mut self.feed;
        let work = async {
            // Bind (and re-bind) the feed until stopped: the streams may not
            // exist yet (storage or `shelfsync setup` creates them). Not
            // ready meanwhile.
            let mut delay = Duration::from_millis(250);
            loop {
                let result = feed.run(&mut handler, stopped(stop_rx.clone())).await;
                if *stop_rx.borrow() {
                    return;
                }
                match result {
                    Ok(()) => warn!("change feed ended; binding it again"),
                    Err(e) => warn!(error = %e, retry_in = ?delay, "change feed unavailable"),
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = stopped(stop_rx.clone()) => return,
                }
                delay = (delay * 2).min(MAX_RETRY_DELAY);
            }
        };
        tokio::join!(signal, work);
        http.await.context("HTTP task")?.context("HTTP server")?;
        shelfsync_bus::close(&self.client).await;
        info!("validator stopped");
        Ok(())
    }
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// `/healthz` (the process runs) and `/readyz` (the feed's consumer is
/// bound: changes are being judged).
fn router(status: Arc<FeedStatus>) -> Router {
    let router = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(|| async { shelfsync_telemetry::render_metrics() }))
        .route(
            "/readyz",
            get(|State(status): State<Arc<FeedStatus>>| async move {
                if status.bootstrapped.load(Ordering::SeqCst) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "change feed not bound yet")
                }
            }),
        )
        .with_state(status);
    shelfsync_telemetry::instrument(router)
}

//! Builds the validator from settings and runs it until told to stop: the
//! change feed (one durable consumer shared by every replica) and the HTTP
//! probes.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use shelfsync_feed::{Bootstrap, ChangeFeed, FeedConfig, FeedStatus};
use shelfsync_service::{Drain, Probes, Readiness, Service, serve};
use shelfsync_settings::{Settings, ValidatorSettings};
use shelfsync_telemetry::chain;
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

/// The validator, built: the one place that reads the whole settings file
/// and hands each part only its section.
pub struct App {
    consumer: String,
    client: async_nats::Client,
    handler: Validator,
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
        let http = shelfsync_service::bind(&settings.validator.http_listen).await?;
        let feed =
            ChangeFeed::new(client.clone(), &settings.nats, feed_config(&settings.validator));
        let stats = Arc::<Stats>::default();
        let handler = Validator::new(
            client.clone(),
            &settings.nats,
            settings.topology(),
            Arc::new(rules),
            stats.clone(),
        );
        Ok(App { consumer: settings.validator.consumer, client, handler, feed, stats, http })
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
}

impl Service for App {
    /// Judges changes until `shutdown` resolves, then finishes the message in
    /// hand (its commands published, the message acked) and stops.
    async fn run_until(
        mut self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        info!(
            consumer = %self.consumer,
            rules = self.handler.rules(),
            http = %self.http_addr(),
            "validator starting"
        );
        let drain = Drain::new();
        let http = serve(self.http, probes(self.feed.status()).router(), &drain);
        let signal = async {
            shutdown.await;
            info!("shutting down: finishing the message in hand");
            drain.start();
        };
        let work = rebind_until_drained(&mut self.feed, &mut self.handler, &drain);
        tokio::join!(signal, work);
        http.await.context("HTTP task")?.context("HTTP server")?;
        shelfsync_bus::close(&self.client).await;
        info!("validator stopped");
        Ok(())
    }
}

/// Binds (and re-binds) the feed until the drain starts: the streams may
/// not exist yet (storage or `shelfsync setup` creates them). Not ready
/// meanwhile.
async fn rebind_until_drained(feed: &mut ChangeFeed, handler: &mut Validator, drain: &Drain) {
    let mut delay = Duration::from_millis(250);
    loop {
        let result = feed.run(handler, drain.started()).await;
        if drain.is_started() {
            return;
        }
        match result {
            Ok(()) => warn!("change feed ended; binding it again"),
            Err(e) => warn!(error = %chain(&e), retry_in = ?delay, "change feed unavailable"),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = drain.started() => return,
        }
        delay = (delay * 2).min(MAX_RETRY_DELAY);
    }
}

/// `/healthz` (the process runs), `/readyz` (the feed's consumer is bound:
/// changes are being judged) and `/metrics`.
fn probes(status: Arc<FeedStatus>) -> Probes {
    Probes::new(move || {
        if status.is_bootstrapped() {
            Readiness::Ready("ready")
        } else {
            Readiness::NotReady("change feed not bound yet")
        }
    })
}

//! Builds the recommender from settings and runs it until told to stop: the
//! change feed (the index's only writer), the HTTP API and the NATS
//! responder, wired around one shared index.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use shelfsync_bus::Subjects;
use shelfsync_feed::{ChangeFeed, FeedConfig, FeedStatus};
use shelfsync_service::{Drain, Service, serve};
use shelfsync_settings::Settings;
use tracing::{info, warn};

use crate::feed::{IndexHandler, SharedIndex};
use crate::query::{Api, Limits};

/// How long a stop waits for the feed (e.g. stuck in a bootstrap) before
/// leaving it: its state is in memory only, so nothing is lost.
const FEED_STOP_GRACE: Duration = Duration::from_secs(10);

pub struct App {
    client: async_nats::Client,
    subjects: Subjects,
    http: tokio::net::TcpListener,
    feed: ChangeFeed,
    api: Api,
    /// The HTTP API's bearer tokens (`None`: open).
    tokens: Option<Arc<shelfsync_service::ApiTokens>>,
}

/// How many recommender instances may run at once: each takes a consumer
/// of its own, `recommender-0` … `recommender-31`, the names its NATS user
/// is granted one by one (compose/nats/nats.conf, k8s/nats/values.yaml).
/// A stopped instance frees its name; one that died, after an hour.
pub const CONSUMER_SLOTS: u32 = 32;

/// The consumer names' stem.
const CONSUMER_STEM: &str = "recommender";

impl App {
    /// Connects to NATS and binds the HTTP listener; starts nothing yet.
    pub async fn build(settings: Settings) -> anyhow::Result<App> {
        crate::metrics::register();
        let client = shelfsync_bus::connect(&settings.nats, "shelfsync-recommender", true)
            .await
            .with_context(|| {
                format!("cannot connect to NATS at {}", settings.nats.url_redacted())
            })?;
        let r = &settings.recommender;
        let tokens = shelfsync_service::ApiTokens::load_for_api(
            "shelfsync-recommender",
            r.read_tokens_file.as_deref(),
            r.read_tokens_env.as_deref(),
        )?;
        let http = shelfsync_service::bind(&settings.recommender.http_listen).await?;
        let cfg = FeedConfig {
            slots: CONSUMER_SLOTS,
            keyframe_responders: settings.topology().storage_replicas,
            ..FeedConfig::new(CONSUMER_STEM)
        };
        let feed = ChangeFeed::new(client.clone(), &settings.nats, cfg);
        let api =
            Api::new(SharedIndex::default(), feed.status(), Limits::from(&settings.recommender));
        Ok(App { client, subjects: Subjects::new(&settings.nats.prefix), http, feed, api, tokens })
    }

    /// Where the HTTP API listens (useful with port 0).
    pub fn http_addr(&self) -> std::net::SocketAddr {
        self.http.local_addr().expect("a bound listener has an address")
    }

    pub fn status(&self) -> Arc<FeedStatus> {
        self.feed.status()
    }

    pub fn index(&self) -> SharedIndex {
        self.api.index().clone()
    }
}

impl Service for App {
    /// Runs until `shutdown` resolves (or the feed fails): then leaves the
    /// NATS queue group, finishes the change message in hand, drains HTTP
    /// and flushes the connection.
    async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let App { client, subjects, http, mut feed, api, tokens } = self;
        info!(
            http = %http.local_addr().map_or_else(|e| e.to_string(), |a| a.to_string()),
            subject = %subjects.recommend_top(),
            slots = CONSUMER_SLOTS,
            "recommender starting"
        );
        let drain = Drain::new();
        let http_task = serve(http, crate::http::router(api.clone(), tokens), &drain);
        let nats_task = tokio::spawn(crate::nats::serve(
            api.clone(),
            client.clone(),
            subjects.recommend_top(),
            drain.clone(),
        ));
        let mut handler = IndexHandler::new(api.index().clone());
        let result = run_feed(&mut feed, &mut handler, &api, &drain, shutdown).await;
        api.stop();
        drain.start();
        // The consumer is this instance's only (the next start bootstraps
        // anew): deleting it frees its name for another instance.
        match tokio::time::timeout(Duration::from_secs(5), feed.delete_consumer()).await {
            Ok(Ok(())) => info!(consumer = %feed.name(), "consumer deleted, its name is free"),
            Ok(Err(e)) => warn!(error = %e, "the consumer is left to expire"),
            Err(_) => {
                warn!(consumer = %feed.name(), "deleting the consumer timed out; it is left to expire")
            }
        }
        let _ = nats_task.await;
        let served = http_task.await.context("HTTP task panicked")?;
        shelfsync_bus::close(&client).await;
        served.context("HTTP server failed")?;
        result
    }
}

/// Runs the feed until it fails, or until `shutdown` resolves: then the
/// service stops answering and drains, and the feed gets
/// [`FEED_STOP_GRACE`] to finish the message in hand.
async fn run_feed(
    feed: &mut ChangeFeed,
    handler: &mut IndexHandler,
    api: &Api,
    drain: &Drain,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let run = feed.run(handler, drain.started());
    tokio::pin!(run, shutdown);
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let grace = tokio::time::sleep_until(
            deadline
                .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(24 * 3600)),
        );
        tokio::select! {
            r = &mut run => return r.context("change feed failed"),
            _ = &mut shutdown, if deadline.is_none() => {
                info!("recommender stopping");
                api.stop();
                drain.start();
                deadline = Some(tokio::time::Instant::now() + FEED_STOP_GRACE);
            }
            _ = grace, if deadline.is_some() => {
                warn!(grace = ?FEED_STOP_GRACE, "change feed did not stop in time; leaving it");
                return Ok(());
            }
        }
    }
}

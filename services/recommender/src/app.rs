//! Builds the recommender from settings and runs it until told to stop: the
//! change feed (the index's only writer), the HTTP API and the NATS
//! responder, wired around one shared index.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
    feed_name: String,
    api: Api,
    /// The HTTP API's bearer tokens (`None`: open).
    tokens: Option<Arc<shelfsync_service::ApiTokens>>,
}

/// A durable consumer name of its own for this instance: each instance
/// rebuilds its index from keyframes and reads every change.
fn feed_name() -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    format!("recommender-{:x}-{nanos:x}-{seq}", std::process::id())
}

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
        let feed_name = feed_name();
        let cfg = FeedConfig {
            metric_label: "recommender".into(),
            keyframe_responders: settings.topology().storage_replicas,
            ..FeedConfig::new(&feed_name)
        };
        let feed = ChangeFeed::new(client.clone(), &settings.nats, cfg);
        let api =
            Api::new(SharedIndex::default(), feed.status(), Limits::from(&settings.recommender));
        Ok(App {
            client,
            subjects: Subjects::new(&settings.nats.prefix),
            http,
            feed,
            feed_name,
            api,
            tokens,
        })
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
        let App { client, subjects, http, mut feed, feed_name, api, tokens } = self;
        info!(
            http = %http.local_addr().map_or_else(|e| e.to_string(), |a| a.to_string()),
            subject = %subjects.recommend_top(),
            feed = %feed_name,
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

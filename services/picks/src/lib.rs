//! "Discounted picks": an example of a service built on the ChangeFeed kit,
//! short enough to read in a few minutes, and the template a consumer team
//! copies. Per place, it keeps the offers that are visible, present, in
//! stock and discounted (`old_price > price`), and serves them deepest
//! discount first:
//!
//! `GET /v1/picks/{brand}/{place}` → `[{"product_id", "title", "price", "old_price", "discount_pct"}]`
//! (and `/healthz`, `/readyz`, Prometheus `/metrics` with the kit's
//! `shelfsync_feed_*` counters)
//!
//! Everything it knows comes from the change stream; it keeps no state of
//! its own (the kit bootstraps it from a keyframe at every start).
//!
//! **One durable consumer per replica** ([`consumer_name`]): `picks-<n>`
//! when the replica knows its index `n` (`SHELFSYNC_REPLICA`: the pod's
//! ordinal in the StatefulSet that `shelfsync consumer add` generates, or a
//! compose service's number), else `picks-<host>-<random>`. Every replica holds the *whole* state in memory and
//! serves any place, so every replica must see every change: a consumer
//! shared by the replicas would hand each message to one of them only
//! (JetStream spreads a consumer's messages over whoever pulls), and each
//! would hold a different, incomplete picture — until a keyframe marker,
//! which too reaches only one of them. The name must also differ between
//! replicas that start at the same time on different hosts or in
//! different containers: a process id does not (in a container every
//! replica is PID 1, so two replicas shared `picks-1`, each start deleted
//! the other's consumer, and they split its messages). The host name (the
//! pod's name on Kubernetes) says which replica a consumer belongs to in
//! `shelfsync consumers`; the random part keeps two processes with one host
//! name (host networking, a fixed compose `hostname`, two on a laptop)
//! apart. With an index the name is the one the team's NATS user may use
//! (its permissions list `picks-0` … `picks-<replicas-1>` by name: NATS
//! cannot grant "names starting with picks-"), stable across restarts, and
//! a StatefulSet never runs two pods of one ordinal at once (a
//! Deployment's rollout would: hence a StatefulSet). The kit recreates the consumer from the keyframes it loaded at
//! every start; a replica that stops deletes its consumer (the name is
//! never used again), and one that dies leaves it to the server, which
//! deletes it after an hour without a pull (the kit's `inactive_threshold`).
//!
//! A shared durable (`Bootstrap::Resume`, one name for every replica) is
//! right for the other kind of service: stateless workers that split the
//! changes between them (the validator).
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use axum::extract::{Path, State};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use shelfsync_feed::{
    ChangeFeed, FeedConfig, FeedStatus, Handler, HandlerError, PlaceKey, Update, is_offered,
};
use shelfsync_service::{Drain, Probes, Readiness, Service, serve};
use shelfsync_settings::Settings;

/// One discounted offer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pick {
    pub product_id: String,
    pub title: String,
    pub price: i64,
    pub old_price: i64,
    pub discount_pct: f64,
}

/// Picks per place; shared between the feed (writer) and HTTP (readers).
#[derive(Debug, Default, Clone)]
pub struct Picks {
    places: Arc<RwLock<HashMap<PlaceKey, PlacePicks>>>,
}

/// One place's picks by product id.
type PlacePicks = BTreeMap<String, Pick>;

impl Picks {
    /// The pick an update makes, or `None` if the offer does not qualify.
    pub fn pick_of(u: &Update) -> Option<Pick> {
        if !is_offered(&u.after) {
            return None;
        }
        let p = u.product();
        let (price, old_price) = (p.price?, p.old_price?);
        if price <= 0 || old_price <= price {
            return None;
        }
        Some(Pick {
            product_id: u.key.product_id.clone(),
            title: p.title.unwrap_or_default(),
            price,
            old_price,
            discount_pct: 100.0 * (old_price - price) as f64 / old_price as f64,
        })
    }

    /// A place's picks, deepest discount first.
    pub fn of_place(&self, place: PlaceKey) -> Vec<Pick> {
        let places = self.places.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<Pick> =
            places.get(&place).map(|m| m.values().cloned().collect()).unwrap_or_default();
        out.sort_by(|a, b| {
            b.discount_pct.total_cmp(&a.discount_pct).then(a.product_id.cmp(&b.product_id))
        });
        out
    }
}

impl Handler for Picks {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        let mut places = self.places.write().unwrap_or_else(|e| e.into_inner());
        for u in updates {
            let place = places.entry(u.place()).or_default();
            match Self::pick_of(u) {
                Some(pick) => place.insert(u.key.product_id.clone(), pick),
                None => place.remove(&u.key.product_id),
            };
        }
        Ok(())
    }

    async fn reset_place(&mut self, place: PlaceKey) -> Result<(), HandlerError> {
        self.places.write().unwrap_or_else(|e| e.into_inner()).remove(&place);
        Ok(())
    }
}

/// The durable consumer name of one replica: `picks-<replica>` when the
/// replica knows its index, else `picks-<host>-<random>`, the host name cut to what a consumer name may hold (letters, digits, `-`,
/// `_`; at most 40 of them) and 64 random bits (see the module docs for
/// why both). `host` is the host name of the process ([`host_name`]: the
/// pod name on Kubernetes, the container id under Docker).
pub fn consumer_name(replica: Option<u32>, host: Option<&str>) -> String {
    if let Some(n) = replica {
        return format!("picks-{n}");
    }
    let host: String = host
        .unwrap_or_default()
        .chars()
        .filter(|c| !c.is_whitespace())
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .take(40)
        .collect();
    let random: u64 = rand::random();
    if host.is_empty() {
        format!("picks-{random:016x}")
    } else {
        format!("picks-{host}-{random:016x}")
    }
}

/// The replica's index from `SHELFSYNC_REPLICA` (a StatefulSet sets it to
/// the pod's ordinal), `None` when unset; an error when it is not a number.
pub fn replica_index() -> anyhow::Result<Option<u32>> {
    match std::env::var("SHELFSYNC_REPLICA") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map(Some).map_err(|_| {
            anyhow::anyhow!(
                "SHELFSYNC_REPLICA={v:?}: the replica's index, a number (the pod's ordinal)"
            )
        }),
        _ => Ok(None),
    }
}

/// The host name, as the kernel has it, else `HOSTNAME`; `None` when
/// neither says.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
}

/// The HTTP API over the picks, with the probes: ready once the feed has
/// bootstrapped; each scrape publishes the feed's counters first (the
/// kit's `shelfsync_feed_*` metrics).
fn router(picks: Picks, status: Arc<FeedStatus>) -> Router {
    let ready = status.clone();
    let probes = Probes::new(move || Readiness::from_bool(ready.is_bootstrapped()))
        .refresh_metrics(move || status.record_metrics());
    Router::new()
        .route(
            "/v1/picks/{brand}/{place}",
            get(|State(picks): State<Picks>, Path((b, p)): Path<(i64, i64)>| async move {
                Json(picks.of_place(PlaceKey::new(b, p)))
            }),
        )
        .with_state(picks)
        .merge(probes.router())
}

/// The service: built from its settings and where to listen, then run
/// until told to stop (the shape every shelfsync service has).
pub struct App {
    client: async_nats::Client,
    feed: ChangeFeed,
    picks: Picks,
    http: tokio::net::TcpListener,
}

impl App {
    /// Connects to NATS (retrying in the background) and binds `listen`.
    /// The replica's index comes from `SHELFSYNC_REPLICA` ([`replica_index`]).
    pub async fn build(settings: Settings, listen: &str) -> anyhow::Result<App> {
        Self::build_replica(settings, listen, replica_index()?).await
    }

    /// [`App::build`] for replica `replica` (its consumer: [`consumer_name`]).
    pub async fn build_replica(
        settings: Settings,
        listen: &str,
        replica: Option<u32>,
    ) -> anyhow::Result<App> {
        let client = shelfsync_bus::connect(&settings.nats, "shelfsync-picks", true).await?;
        // One consumer per replica: each rebuilds all its picks from a keyframe.
        let name = consumer_name(replica, host_name().as_deref());
        let cfg = FeedConfig {
            metric_label: "picks".into(),
            keyframe_responders: settings.topology().storage_replicas,
            ..FeedConfig::new(name)
        };
        let feed = ChangeFeed::new(client.clone(), &settings.nats, cfg);
        let http = shelfsync_service::bind(listen).await?;
        Ok(App { client, feed, picks: Picks::default(), http })
    }

    /// Where the HTTP API listens (useful with port 0).
    pub fn http_addr(&self) -> SocketAddr {
        self.http.local_addr().expect("a bound listener has an address")
    }

    /// The picks the service serves (its feed is their only writer).
    pub fn picks(&self) -> Picks {
        self.picks.clone()
    }

    /// The feed's counters (bootstrapped, delivered, keyframe checks…).
    pub fn status(&self) -> Arc<FeedStatus> {
        self.feed.status()
    }

    /// This replica's durable consumer on the CHANGES stream.
    pub fn consumer(&self) -> &str {
        self.feed.name()
    }
}

impl Service for App {
    /// Runs the feed and the HTTP API until `shutdown` resolves: then the
    /// feed finishes the message in hand and HTTP drains.
    async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let App { client, mut feed, picks, http } = self;
        tracing::info!(consumer = %feed.name(), "picks starting");
        let drain = Drain::new();
        let http = serve(http, router(picks.clone(), feed.status()), &drain);
        let mut handler = picks;
        let fed = feed.run(&mut handler, shutdown).await;
        drain.start();
        // The consumer is this replica's alone and its name is never used
        // again: a stopped replica leaves nothing behind.
        if let Err(e) = feed.delete_consumer().await {
            tracing::warn!(error = %shelfsync_telemetry::chain(&e), "cannot delete the consumer; the server drops it after an hour unused");
        }
        http.await??;
        shelfsync_bus::close(&client).await;
        Ok(fed?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use shelfsync_feed::UpdateKind;
    use shelfsync_proto::{Product, Record, RecordKey, RecordState};

    fn update(id: &str, price: i64, old: Option<i64>, stock: i64, hidden: bool) -> Update {
        let data = Product {
            title: Some(id.to_uppercase()),
            price: Some(price),
            old_price: old,
            stock: Some(stock),
            ..Default::default()
        };
        let state = RecordState { hidden: Some(hidden), ..Default::default() };
        Update {
            key: RecordKey::new(7, 1, id),
            before: None,
            after: Record {
                data: data.encode_to_vec(),
                state: state.encode_to_vec(),
                ..Default::default()
            },
            kind: UpdateKind::Updated,
            origin: None,
        }
    }

    #[test]
    fn consumer_names_differ_between_replicas_on_one_host() {
        // Two containers: the same process id, possibly the same host name.
        let (a, b) = (
            consumer_name(None, Some("picks-7d9f-x2")),
            consumer_name(None, Some("picks-7d9f-x2")),
        );
        assert_ne!(a, b);
        assert!(a.starts_with("picks-picks-7d9f-x2-"), "{a}");
        // What a consumer name may not hold is replaced; long names are cut.
        let odd = consumer_name(None, Some("web.example.com/a b*>"));
        assert!(odd.starts_with("picks-web_example_com_ab__-"), "{odd}");
        assert!(consumer_name(None, Some(&"h".repeat(300))).len() <= "picks-".len() + 40 + 1 + 16);
        let bare = consumer_name(None, None);
        assert_eq!(consumer_name(Some(1), Some("picks-1")), "picks-1");
        assert_eq!(bare.len(), "picks-".len() + 16, "{bare}");
        for name in [a, odd, bare] {
            assert!(!name.contains(['.', '*', '>', ' ', '/', '\\']), "{name}");
        }
    }

    #[tokio::test]
    async fn keeps_discounted_visible_in_stock_offers_deepest_first() {
        let mut picks = Picks::default();
        picks
            .apply(&[
                update("half", 50, Some(100), 3, false),
                update("tenth", 90, Some(100), 1, false),
                update("no-old", 50, None, 3, false),
                update("pricier", 120, Some(100), 3, false),
                update("sold-out", 10, Some(100), 0, false),
                update("hidden", 10, Some(100), 5, true),
            ])
            .await
            .expect("apply");
        let ids: Vec<String> =
            picks.of_place(PlaceKey::new(7, 1)).into_iter().map(|p| p.product_id).collect();
        assert_eq!(ids, ["half", "tenth"]);
        assert_eq!(picks.of_place(PlaceKey::new(7, 1))[0].discount_pct, 50.0);
        // Selling out removes a pick; a reset forgets the place.
        picks.apply(&[update("half", 50, Some(100), 0, false)]).await.expect("apply");
        assert_eq!(picks.of_place(PlaceKey::new(7, 1)).len(), 1);
        picks.reset_place(PlaceKey::new(7, 1)).await.expect("reset");
        assert!(picks.of_place(PlaceKey::new(7, 1)).is_empty());
    }
}

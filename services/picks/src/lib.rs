//! "Discounted picks": an example of a service built on the ChangeFeed kit,
//! short enough to read in a few minutes. Per place, it keeps the offers
//! that are visible, present, in stock and discounted (`old_price > price`),
//! and serves them deepest discount first:
//!
//! `GET /v1/picks/{brand}/{place}` → `[{"product_id", "title", "price", "old_price", "discount_pct"}]`
//! (and `/healthz`, `/readyz`, Prometheus `/metrics`)
//!
//! Everything it knows comes from the change stream; it keeps no state of
//! its own (the kit bootstraps it from a keyframe at every start).
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

/// The HTTP API over the picks, with the probes: ready once the feed has
/// bootstrapped.
fn router(picks: Picks, status: Arc<FeedStatus>) -> Router {
    let probes = Probes::new(move || Readiness::from_bool(status.is_bootstrapped()));
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
    pub async fn build(settings: Settings, listen: &str) -> anyhow::Result<App> {
        let client = shelfsync_bus::connect(&settings.nats, "shelfsync-picks", true).await?;
        // One consumer per instance: each rebuilds its picks from a keyframe.
        let name = format!("picks-{}", std::process::id());
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
}

impl Service for App {
    /// Runs the feed and the HTTP API until `shutdown` resolves: then the
    /// feed finishes the message in hand and HTTP drains.
    async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let App { client, mut feed, picks, http } = self;
        let drain = Drain::new();
        let http = serve(http, router(picks.clone(), feed.status()), &drain);
        let mut handler = picks;
        let fed = feed.run(&mut handler, shutdown).await;
        drain.start();
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

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
use std::sync::{Arc, RwLock};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use shelfsync_feed::{
    ChangeFeed, FeedConfig, FeedStatus, Handler, HandlerError, Update, is_offered,
};
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
    places: Arc<RwLock<HashMap<(i64, i64), PlacePicks>>>,
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
    pub fn of_place(&self, brand: i64, place: i64) -> Vec<Pick> {
        let places = self.places.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<Pick> =
            places.get(&(brand, place)).map(|m| m.values().cloned().collect()).unwrap_or_default();
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

    async fn reset_place(&mut self, brand_id: i64, place_id: i64) -> Result<(), HandlerError> {
        self.places.write().unwrap_or_else(|e| e.into_inner()).remove(&(brand_id, place_id));
        Ok(())
    }
}

#[derive(Clone)]
struct Http {
    picks: Picks,
    status: Arc<FeedStatus>,
}

/// Builds the HTTP API over the picks, traced and measured.
fn router(picks: Picks, status: Arc<FeedStatus>) -> Router {
    let router = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(|| async { shelfsync_telemetry::render_metrics() }))
        .route(
            "/readyz",
            get(|State(h): State<Http>| async move {
                if h.status.bootstrapped.load(std::sync::atomic::Ordering::SeqCst) {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        )
        .route(
            "/v1/picks/{brand}/{place}",
            get(|State(h): State<Http>, Path((b, p)): Path<(i64, i64)>| async move {
                Json(h.picks.of_place(b, p))
            }),
        )
        .with_state(Http { picks, status });
    shelfsync_telemetry::instrument(router)
}

/// Runs the feed and the HTTP API on `listener` until `shutdown` resolves.
pub async fn run(
    settings: Settings,
    listener: tokio::net::TcpListener,
    picks: Picks,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let client = shelfsync_bus::connect(&settings.nats, "shelfsync-picks", true).await?;
    // One consumer per instance: each rebuilds its picks from a keyframe.
    let name = format!("picks-{}", std::process::id());
    let cfg = FeedConfig { metric_label: "picks".into(), ..FeedConfig::new(name) };
    let mut feed = ChangeFeed::new(client, &settings, cfg);
    let app = router(picks.clone(), feed.status());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http = tokio::spawn(async move {
        let mut rx = stop_rx;
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.changed().await;
            })
            .await
    });
    let mut handler = picks;
    feed.run(&mut handler, shutdown).await?;
    let _ = stop_tx.send(true);
    http.await??;
    Ok(())
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
        let ids: Vec<String> = picks.of_place(7, 1).into_iter().map(|p| p.product_id).collect();
        assert_eq!(ids, ["half", "tenth"]);
        assert_eq!(picks.of_place(7, 1)[0].discount_pct, 50.0);
        // Selling out removes a pick; a reset forgets the place.
        picks.apply(&[update("half", 50, Some(100), 0, false)]).await.expect("apply");
        assert_eq!(picks.of_place(7, 1).len(), 1);
        picks.reset_place(7, 1).await.expect("reset");
        assert!(picks.of_place(7, 1).is_empty());
    }
}

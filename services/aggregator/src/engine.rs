//! The ChangeFeed handler: a batch of updates becomes a plan, the plan runs
//! in Redis (one script per touched aggregate), what changed is published,
//! and only then recorded as published.
//!
//! Why publish before recording: the "last published" state is what the
//! next batch compares with. Recorded first, a crash before the publish
//! would make the redelivered batch find "no change" and the event would be
//! lost. Recorded after, a crash before the record makes the retry publish
//! again, with the same `Nats-Msg-Id` (version + content digest), which
//! JetStream drops as a duplicate. Aggregates a batch may change are kept
//! in a dirty set from before their sets move until after the record, and a
//! restarted (or failed) engine recomputes them first, so a crash between
//! any two steps neither loses an event nor, within the duplicate window,
//! repeats one.
//!
//! A keyframe reload of a place (the kit calls `reset_place`, then hands
//! over the snapshot) is a mark and sweep rather than "drop then re-add":
//! dropping first would publish a retraction and a re-creation for every
//! card of the place at every restart. The marks of a place are swept when
//! the snapshot is known to be complete: at the next handler call that is
//! not part of it, or when the feed reports the bootstrap (or the resync)
//! done — see [`Aggregator::finish_reloads`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use prost::Message;
use shelfsync_bus::{PublishFailed, Publisher, Subjects};
use shelfsync_feed::{FeedStatus, Handler, HandlerError, Update, UpdateKind};
use shelfsync_proto::{AggregateChange, CategoryFlip, msg_type, now_us};
use tokio::sync::Mutex;
use tracing::{Instrument, debug, info_span};

use crate::Config;
use crate::aggregate::{
    self, Action, CardChange, Directory, Flip, Item, PlaceKey, Reload, card_msg_id, flip_msg_id,
};
use crate::metrics;
use crate::store::{Store, StoreError};

/// What readiness and the scrape need to know of an instance (its
/// counters are in `metrics`).
#[derive(Debug, Default)]
pub struct Status {
    /// Places being reloaded from a keyframe whose sweep is still due.
    pub pending_reloads: AtomicUsize,
}

struct PendingReload {
    reload: Reload,
    /// What the feed said when the reload started: it is complete once the
    /// feed is bootstrapped (a bootstrap reload) or has one more drift
    /// repair (a resync).
    bootstrapped: bool,
    drift_repairs: u64,
}

struct Engine {
    store: Store,
    publisher: Publisher,
    subjects: Subjects,
    directory: Directory,
    reloads: BTreeMap<PlaceKey, PendingReload>,
    /// Recompute the dirty set with the next batch (start, or after an error).
    recover: bool,
    tombstone_ttl_us: i64,
    retracted_ttl: Duration,
    feed: Option<Arc<FeedStatus>>,
    status: Arc<Status>,
}

fn transient(what: &str) -> impl Fn(&dyn std::fmt::Display) -> HandlerError + '_ {
    move |e| HandlerError::Transient(format!("{what}: {e}"))
}

impl From<StoreError> for HandlerError {
    fn from(e: StoreError) -> Self {
        // Redis down or failing over: the feed naks and the batch returns.
        HandlerError::Transient(format!("redis: {e}"))
    }
}

impl Engine {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        // A change that is not part of a snapshot means every snapshot in
        // progress has been handed over completely.
        let live = updates.iter().any(|u| u.kind != UpdateKind::Snapshot);
        let finished: Vec<PlaceKey> =
            if live { self.reloads.keys().copied().collect() } else { Vec::new() };
        let mut items = self.leftovers(&finished);
        let forgotten = items.len();
        for u in updates {
            if u.kind == UpdateKind::Snapshot
                && let Some(r) = self.reloads.get_mut(&u.place())
            {
                r.reload.confirm(&u.key.product_id, u.after.updated_at);
            }
            items.push(aggregate::item(&self.directory, &u.key, &u.after));
        }
        self.run(items).await?;
        self.forget_reloads(&finished, forgotten);
        Ok(())
    }

    async fn reset_place(&mut self, place: PlaceKey) -> Result<(), HandlerError> {
        // A reload of the same place again (a retried resync) starts over.
        self.reloads.remove(&place);
        let others: Vec<PlaceKey> = self.reloads.keys().copied().collect();
        self.finish(&others).await?;
        let counted = self.store.counted(place).await?;
        let (bootstrapped, drift_repairs) = self.feed_marks();
        self.reloads.insert(
            place,
            PendingReload { reload: Reload::new(counted), bootstrapped, drift_repairs },
        );
        self.status.pending_reloads.store(self.reloads.len(), Ordering::SeqCst);
        Ok(())
    }

    fn feed_marks(&self) -> (bool, u64) {
        self.feed.as_ref().map_or((false, 0), |f| {
            (f.bootstrapped.load(Ordering::SeqCst), FeedStatus::get(&f.drift_repairs))
        })
    }

    /// Reloads whose snapshot the feed has finished handing over.
    fn completed_reloads(&self) -> Vec<PlaceKey> {
        let (bootstrapped, drift_repairs) = self.feed_marks();
        if !bootstrapped {
            return Vec::new();
        }
        self.reloads
            .iter()
            .filter(|(_, r)| !r.bootstrapped || drift_repairs > r.drift_repairs)
            .map(|(p, _)| *p)
            .collect()
    }

    /// Sweeps the reloads of `places`.
    async fn finish(&mut self, places: &[PlaceKey]) -> Result<(), HandlerError> {
        if places.is_empty() {
            return Ok(());
        }
        let items = self.leftovers(places);
        let forgotten = items.len();
        self.run(items).await?;
        self.forget_reloads(places, forgotten);
        Ok(())
    }

    fn leftovers(&self, places: &[PlaceKey]) -> Vec<Item> {
        let now = now_us();
        let mut items = Vec::new();
        for place in places {
            let Some(r) = self.reloads.get(place) else { continue };
            for id in r.reload.leftovers(now, self.tombstone_ttl_us) {
                items.push(Item {
                    place: *place,
                    product_id: id,
                    action: Action::Forget { at: now },
                });
            }
        }
        items
    }

    /// Ends the reloads of `places`, once their leftovers are forgotten.
    fn forget_reloads(&mut self, places: &[PlaceKey], forgotten: usize) {
        for p in places {
            self.reloads.remove(p);
        }
        metrics::forgotten(forgotten);
        self.status.pending_reloads.store(self.reloads.len(), Ordering::SeqCst);
    }

    async fn run(&mut self, items: Vec<Item>) -> Result<(), HandlerError> {
        let span = info_span!(
            "aggregator.apply",
            batch.size = items.len(),
            cards.changed = tracing::field::Empty,
            categories.flipped = tracing::field::Empty,
        );
        let result = self.run_inner(items).instrument(span).await;
        if result.is_err() {
            // The dirty set tells the next attempt what may be half done.
            // (The caller logs the error: the feed when it naks.)
            self.recover = true;
        }
        result
    }

    async fn run_inner(&mut self, items: Vec<Item>) -> Result<(), HandlerError> {
        let leftover = if self.recover { self.store.dirty().await? } else { Vec::new() };
        if items.is_empty() && leftover.is_empty() {
            self.recover = false;
            return Ok(());
        }
        let mut wanted: BTreeMap<PlaceKey, BTreeSet<String>> = BTreeMap::new();
        for i in &items {
            wanted.entry(i.place).or_default().insert(i.product_id.clone());
        }
        let wanted = wanted.into_iter().map(|(p, ids)| (p, ids.into_iter().collect())).collect();
        let mut seen = self.store.views(&wanted).await?;
        let mut plan = aggregate::plan(&items, &mut seen);
        metrics::stale_versions(plan.stale);
        let now = now_us();
        let recovered = leftover.len();
        for d in leftover {
            plan.touch(d, now);
        }
        if plan.is_empty() {
            self.recover = false;
            return Ok(());
        }
        let dirty = plan.dirty();
        self.store.mark_dirty(&dirty).await?;
        // Cards first: the place step records what was counted, which is
        // what the next retraction starts from; it must not run ahead of the
        // card sets it describes.
        let cards = self.store.apply_cards(&plan.cards).await?;
        let categories = self.store.apply_places(&plan.places).await?;
        let changes: Vec<CardChange> = cards.into_iter().filter_map(|o| o.change()).collect();
        let flips: Vec<Flip> = categories.into_iter().filter_map(|o| o.flip()).collect();
        self.publish(&changes, &flips).await?;
        self.store.commit(&changes, &flips, &dirty, self.retracted_ttl).await?;
        self.recover = false;

        let span = tracing::Span::current();
        span.record("cards.changed", changes.len());
        span.record("categories.flipped", flips.len());
        metrics::batch(changes.len(), flips.len());
        debug!(
            cards = plan.cards.len(),
            places = plan.places.len(),
            recovered,
            changed = changes.len(),
            flipped = flips.len(),
            "batch aggregated"
        );
        Ok(())
    }

    /// Publishes one aggregate change under its message id.
    async fn publish_change(
        &mut self,
        subject: String,
        msg_id: String,
        msg: &AggregateChange,
    ) -> Result<(), PublishFailed> {
        let payload = msg.encode_to_vec().into();
        self.publisher.publish(subject, msg_id, msg_type::AGGREGATE_CHANGE, None, payload).await
    }

    /// Publishes every change and waits for JetStream to store them all.
    async fn publish(&mut self, cards: &[CardChange], flips: &[Flip]) -> Result<(), HandlerError> {
        let result = self.publish_all(cards, flips).await;
        if result.is_err() {
            // Drain what is in flight; the retry republishes the same ids.
            let _ = self.publisher.flush().await;
        }
        result
    }

    async fn publish_all(
        &mut self,
        cards: &[CardChange],
        flips: &[Flip],
    ) -> Result<(), HandlerError> {
        let failed = transient("publish");
        for c in cards {
            let msg = AggregateChange { card: Some(c.card.clone()), category: None, at: c.at };
            let subject = self.subjects.aggregates_card(&c.id.region);
            self.publish_change(subject, card_msg_id(c), &msg).await.map_err(|e| failed(&e))?;
        }
        for f in flips {
            let msg = AggregateChange {
                card: None,
                category: Some(CategoryFlip {
                    brand_id: f.place.brand_id,
                    place_id: f.place.place_id,
                    category: f.category.clone(),
                    non_empty: f.non_empty,
                }),
                at: f.at,
            };
            let subject = self.subjects.aggregates_category(f.place.brand_id, f.place.place_id);
            self.publish_change(subject, flip_msg_id(f), &msg).await.map_err(|e| failed(&e))?;
        }
        self.publisher.flush().await.map_err(|e| failed(&e))
    }
}

/// The aggregator as a ChangeFeed handler. Cheap to clone: clones share one
/// engine (the feed applies through one, the reload watcher uses another).
#[derive(Clone)]
pub struct Aggregator {
    engine: Arc<Mutex<Engine>>,
    status: Arc<Status>,
    store: Store,
}

impl Aggregator {
    /// Connects to Redis; publishes through `client`.
    pub async fn connect(
        config: &Config,
        client: async_nats::Client,
    ) -> Result<Aggregator, StoreError> {
        let store = Store::connect(&config.redis).await?;
        let js = shelfsync_bus::jetstream(client, &config.nats);
        let status = Arc::new(Status::default());
        // A retracted card's version must outlive the duplicate window, or a
        // re-created card could reuse the id of an earlier change.
        let retracted_ttl = (config.nats.duplicate_window * 2).max(Duration::from_secs(24 * 3600));
        let engine = Engine {
            store: store.clone(),
            publisher: Publisher::new(js, config.nats.max_inflight),
            subjects: Subjects::new(&config.nats.prefix),
            directory: Directory::new(&config.aggregator),
            reloads: BTreeMap::new(),
            recover: true,
            tombstone_ttl_us: i64::try_from(config.topology.tombstone_ttl.as_micros())
                .unwrap_or(i64::MAX),
            retracted_ttl,
            feed: None,
            status: status.clone(),
        };
        Ok(Aggregator { engine: Arc::new(Mutex::new(engine)), status, store })
    }

    pub fn status(&self) -> Arc<Status> {
        self.status.clone()
    }

    /// Read access to the aggregates (HTTP API, tests).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The feed whose progress tells when a reload is complete.
    pub async fn follow(&self, feed: Arc<FeedStatus>) {
        self.engine.lock().await.feed = Some(feed);
    }

    /// Publishes what an interrupted run left unpublished.
    pub async fn recover(&self) -> Result<(), HandlerError> {
        self.engine.lock().await.run(Vec::new()).await
    }

    /// Sweeps the reloads that the feed has finished handing over (a
    /// bootstrap that went live, a resync counted as done).
    pub async fn finish_reloads(&self) -> Result<(), HandlerError> {
        if self.status.pending_reloads.load(Ordering::SeqCst) == 0 {
            return Ok(());
        }
        let mut engine = self.engine.lock().await;
        let done = engine.completed_reloads();
        engine.finish(&done).await
    }
}

impl Handler for Aggregator {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        self.engine.lock().await.apply(updates).await
    }

    async fn reset_place(&mut self, place: PlaceKey) -> Result<(), HandlerError> {
        self.engine.lock().await.reset_place(place).await
    }
}

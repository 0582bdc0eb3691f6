//! The ChangeFeed kit: what every consumer of shelfsync changes uses, and
//! what a new service starts from (docs/SUBSCRIBING.md).
//!
//! A service implements [`Handler`] (apply a slice of [`Update`]s, forget a
//! place) and runs a [`ChangeFeed`]. The kit:
//!
//! - **bootstraps** from the latest complete keyframe of every place in its
//!   filter (asking storage for one when none exists), then tails the change
//!   stream from where the oldest keyframe run started — no gap;
//! - **applies idempotently**: a record version is delivered only if its
//!   `updated_at` is newer than the one delivered before — no double apply,
//!   whatever JetStream redelivers;
//! - keeps a **digest per place** and compares it at every keyframe marker in
//!   the change stream; a drifted place is **resynced** from that keyframe;
//! - **acks after** the handler succeeded; a [`HandlerError::Transient`]
//!   naks with a delay, a [`HandlerError::Poison`] terminates the message;
//! - stops cleanly when the shutdown future resolves (the batch in hand is
//!   finished and acked, what was pulled and not handled is nak'd for the
//!   replicas sharing the consumer);
//! - **traces and measures**: each change message is handled in a CONSUMER
//!   span `process <subject>` (`feed.process`) continuing the trace in its
//!   headers, and feeds `shelfsync_freshness_seconds{stage="consumer"}`,
//!   `shelfsync_consumer_lag{consumer}` and
//!   `shelfsync_feed_drift_repairs_total`.
//!
//! Modules: `state` (pure bookkeeping), `keyframes` (reading snapshots back),
//! `update` (typed access), `handler` (the service's side and the errors),
//! `config` (set-up and counters). It never touches Redis.
#![forbid(unsafe_code)]

mod config;
mod handler;
pub mod keyframes;
pub mod state;
pub mod update;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shelfsync_telemetry::{chain, names};

use async_nats::jetstream::{self, AckKind, consumer};
use futures::StreamExt;
use prost::Message;
use shelfsync_bus::Subjects;
use shelfsync_proto::{ChangeBatch, KeyframeMark};
use shelfsync_settings::NatsSettings;
use tracing::{Instrument, debug, info, warn};

pub use config::{Bootstrap, FeedConfig, FeedStatus};
pub use handler::{FeedError, Handler, HandlerError};
pub use keyframes::KeyframeReader;
pub use shelfsync_proto::PlaceKey;
pub use state::{Check, FeedState};
pub use update::{Update, UpdateKind, is_live, is_offered, is_visible, product_of, state_of};

/// How long a stopping feed takes in what is still on its way to it.
const HAND_BACK_WINDOW: Duration = Duration::from_millis(50);
/// How often the consumer's lag is sampled.
const LAG_EVERY: Duration = Duration::from_secs(5);

/// A running subscription to the change stream.
pub struct ChangeFeed {
    client: async_nats::Client,
    js: jetstream::Context,
    subjects: Subjects,
    cfg: FeedConfig,
    /// The slot this instance holds, with [`FeedConfig::slots`].
    held: Option<String>,
    state: FeedState,
    status: Arc<FeedStatus>,
}

impl ChangeFeed {
    /// A feed over the streams `nats` names (the only settings the kit
    /// reads: the rest is in `cfg`).
    pub fn new(client: async_nats::Client, nats: &NatsSettings, cfg: FeedConfig) -> Self {
        shelfsync_telemetry::install_metrics();
        Self {
            js: shelfsync_bus::jetstream(client.clone(), nats),
            client,
            subjects: Subjects::new(&nats.prefix),
            cfg,
            held: None,
            state: FeedState::default(),
            status: Arc::default(),
        }
    }

    pub fn status(&self) -> Arc<FeedStatus> {
        self.status.clone()
    }

    /// The durable consumer's name (with slots: the stem until one is
    /// taken, at the first run).
    pub fn name(&self) -> &str {
        self.held.as_deref().unwrap_or(&self.cfg.name)
    }

    /// Deletes the feed's durable consumer, when it is this instance's own
    /// and the instance stops for good (a name that is never used again:
    /// nothing is left behind for the server to expire). One that is gone
    /// already is no error, nor one with slots that never took one. A feed
    /// run after this starts from new changes only: never call it on a
    /// consumer that replicas share.
    pub async fn delete_consumer(&self) -> Result<(), FeedError> {
        if self.cfg.slots > 0 && self.held.is_none() {
            return Ok(());
        }
        let err = |e: &dyn std::fmt::Display| {
            FeedError::Nats(format!("deleting consumer {}: {e}", self.name()))
        };
        let stream =
            self.js.get_stream(self.subjects.changes_stream()).await.map_err(|e| err(&e))?;
        match stream.delete_consumer(self.name()).await {
            Ok(_) => Ok(()),
            Err(e) if is_consumer_not_found(&e) => Ok(()),
            Err(e) => Err(err(&e)),
        }
    }

    /// Bootstraps (per the config), then applies changes until `shutdown`
    /// resolves. Run again after a stop, it resumes where it stopped with
    /// the state it had (no second bootstrap).
    pub async fn run<H: Handler>(
        &mut self,
        handler: &mut H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), FeedError> {
        tokio::pin!(shutdown);
        let resuming = self.status.bootstrapped.load(Ordering::SeqCst);
        let start = match self.cfg.bootstrap {
            // A bootstrap can wait long for a keyframe: a shutdown ends it.
            Bootstrap::Keyframe if !resuming => tokio::select! {
                start = self.bootstrap(handler) => Some(start?),
                _ = &mut shutdown => return Ok(()),
            },
            _ => None,
        };
        let consumer = self.consumer(start).await?;
        self.status.bootstrapped.store(true, Ordering::SeqCst);
        info!(
            feed = %self.name(),
            records = self.state.len(),
            places = self.state.places(),
            start = ?start,
            "change feed live"
        );
        let mut messages = shelfsync_bus::pull_messages(&consumer)
            .await
            .map_err(|e| FeedError::Nats(format!("pull: {e}")))?;
        // Sampled by its own task: a handler that hangs must show as lag.
        let sampler = {
            let mut consumer = consumer.clone();
            let name = self.cfg.metric_label.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(LAG_EVERY);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    // Not yet delivered plus delivered and not yet acked.
                    if let Ok(info) = consumer.info().await {
                        let lag = info.num_pending + info.num_ack_pending as u64;
                        metrics::gauge!(names::CONSUMER_LAG, "consumer" => name.clone())
                            .set(lag as f64);
                    }
                }
            })
        };
        loop {
            let msg = tokio::select! {
                _ = &mut shutdown => break,
                m = messages.next() => match m {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        warn!(feed = %self.name(), error = %chain(&e), "pull failed; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                    None => break,
                },
            };
            self.handle(msg, handler).await;
        }
        sampler.abort();
        // What was pulled but not handled goes back at once, and so does
        // what was still on its way to this client: another replica, or
        // this feed run again, gets it now, not after the ack wait. Naked
        // only once the pull is gone (the server has seen its inbox
        // unsubscribed), or the server would hand them straight back to
        // this feed's pull request.
        let mut held = Vec::new();
        let until = tokio::time::Instant::now() + HAND_BACK_WINDOW;
        while let Ok(Some(Ok(msg))) = tokio::time::timeout_at(until, messages.next()).await {
            held.push(msg);
        }
        drop(messages);
        let _ = self.client.flush().await;
        let mut returned = 0;
        for msg in held {
            if msg.ack_with(AckKind::Nak(None)).await.is_ok() {
                returned += 1;
            }
        }
        debug!(feed = %self.name(), returned, "stopped; messages in hand handed back");
        Ok(())
    }

    /// Loads the latest keyframe of every place; returns the CHANGES stream
    /// sequence to tail from.
    async fn bootstrap<H: Handler>(&mut self, handler: &mut H) -> Result<u64, FeedError> {
        let reader = KeyframeReader::new(&self.js, self.subjects.clone()).await?;
        let mut places = reader.places(self.cfg.brand, self.cfg.place).await?;
        if places.is_empty() && self.cfg.request_keyframe_if_missing {
            info!(feed = %self.name(), "no keyframe yet: asking storage for one");
            let place = self.cfg.brand.zip(self.cfg.place).map(PlaceKey::from);
            shelfsync_bus::request_keyframe(
                &self.client,
                &self.subjects,
                place,
                self.cfg.keyframe_responders,
                Duration::from_secs(600),
            )
            .await
            .map_err(|e| FeedError::Nats(format!("keyframe request: {e}")))?;
            places = reader.places(self.cfg.brand, self.cfg.place).await?;
        }
        let mut start: Option<u64> = None;
        for place in places {
            let Some(latest) = reader.latest(place.brand_id, place.place_id).await? else {
                continue;
            };
            let seq = latest.last.changes_seq;
            self.load_keyframe(&reader, &latest, handler)
                .await
                .map_err(|e| FeedError::Bootstrap(e.to_string()))?;
            start = Some(start.map_or(seq, |s| s.min(seq)));
        }
        Ok(start.unwrap_or(0))
    }

    /// Replaces a place with a keyframe of it.
    async fn load_keyframe<H: Handler>(
        &mut self,
        reader: &KeyframeReader,
        latest: &keyframes::LatestKeyframe,
        handler: &mut H,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let place = PlaceKey::new(latest.last.brand_id, latest.last.place_id);
        handler.reset_place(place).await?;
        self.state.reset_place(place);
        let mut parts = reader.parts(latest);
        while let Some(part) = parts.next().await? {
            let updates: Vec<Update> =
                part.records.into_iter().filter_map(Update::from_snapshot).collect();
            handler.apply(&updates).await?;
            for u in &updates {
                self.state.record(place, &u.key.product_id, u.after.updated_at, u.after.deleted);
            }
            self.status.delivered.fetch_add(updates.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    async fn consumer(
        &mut self,
        start: Option<u64>,
    ) -> Result<consumer::Consumer<consumer::pull::Config>, FeedError> {
        let stream = self
            .js
            .get_stream(self.subjects.changes_stream())
            .await
            .map_err(|e| FeedError::Nats(format!("changes stream: {e}")))?;
        let mut config = consumer::pull::Config {
            durable_name: Some(self.name().to_string()),
            filter_subject: self.subjects.changes_filter(self.cfg.brand, self.cfg.place),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: self.cfg.ack_wait,
            max_ack_pending: self.cfg.max_ack_pending,
            ..Default::default()
        };
        let fresh = match start {
            Some(seq) => {
                config.deliver_policy = if seq == 0 {
                    consumer::DeliverPolicy::All
                } else {
                    consumer::DeliverPolicy::ByStartSequence { start_sequence: seq + 1 }
                };
                // An instance that disappears leaves no consumer behind.
                config.inactive_threshold = Duration::from_secs(3600);
                true
            }
            None => {
                config.deliver_policy = consumer::DeliverPolicy::New;
                if self.cfg.bootstrap == Bootstrap::Keyframe {
                    config.inactive_threshold = Duration::from_secs(3600);
                }
                false
            }
        };
        if self.cfg.slots > 0 && self.held.is_none() {
            return self.claim(&stream, config).await;
        }
        let err =
            |e: &dyn std::fmt::Display| FeedError::Nats(format!("consumer {}: {e}", self.name()));
        if fresh {
            // State is rebuilt from keyframes at every start: the old
            // position means nothing now.
            let _ = stream.delete_consumer(self.name()).await;
            stream.create_consumer(config).await.map_err(|e| err(&e))
        } else {
            stream.get_or_create_consumer(self.name(), config).await.map_err(|e| err(&e))
        }
    }

    /// Creates the consumer under the first of the config's slot names
    /// that no consumer holds, and keeps it as this instance's.
    async fn claim(
        &mut self,
        stream: &jetstream::stream::Stream,
        mut config: consumer::pull::Config,
    ) -> Result<consumer::Consumer<consumer::pull::Config>, FeedError> {
        use jetstream::stream::ConsumerCreateStrictErrorKind::AlreadyExists;
        // The server hands back an existing consumer whose configuration is
        // the one asked for: one of this instance's own makes every
        // instance's differ, so that a held name is refused.
        config.description = Some(instance_tag());
        let stem = self.cfg.name.clone();
        for slot in 0..self.cfg.slots {
            let name = format!("{stem}-{slot}");
            config.durable_name = Some(name.clone());
            match stream.create_consumer_strict(config.clone()).await {
                Ok(consumer) => {
                    self.held = Some(name);
                    return Ok(consumer);
                }
                Err(e) if e.kind() == AlreadyExists => continue,
                Err(e) => return Err(FeedError::Nats(format!("consumer {name}: {e}"))),
            }
        }
        Err(FeedError::Nats(format!(
            "all {n} consumer names {stem}-0 … {stem}-{last} are held by other instances (a \
             stopped instance frees its own, one that died after an hour unused): more \
             instances than slots, or `nats consumer rm` the dead ones",
            n = self.cfg.slots,
            last = self.cfg.slots - 1,
        )))
    }

    async fn handle<H: Handler>(&mut self, msg: jetstream::Message, handler: &mut H) {
        if let Ok(info) = msg.info() {
            // A redelivery must not move the position back.
            self.status.position.fetch_max(info.stream_sequence, Ordering::Relaxed);
        }
        let span = shelfsync_telemetry::process_span!(
            "feed.process",
            self.subjects.template(&msg.subject),
            msg.subject,
            self.name(),
            feed = %self.name(),
            shelfsync.change_count = tracing::field::Empty,
        );
        shelfsync_telemetry::set_parent(
            &span,
            shelfsync_telemetry::extract_opt(msg.headers.as_ref()),
        );
        let result = self.handle_inner(&msg, handler).instrument(span).await;
        let ack = match result {
            Ok(()) => msg.ack().await,
            Err(HandlerError::Transient(e)) => {
                warn!(feed = %self.name(), error = %e, "handler failed; will retry");
                msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await
            }
            Err(HandlerError::Poison(e)) => {
                warn!(feed = %self.name(), subject = %msg.subject, error = %e, "poison message dropped");
                self.status.poison.fetch_add(1, Ordering::Relaxed);
                msg.ack_with(AckKind::Term).await
            }
        };
        if let Err(e) = ack {
            debug!(error = %chain(&*e), "ack failed (the message will be redelivered and skipped)");
        }
    }

    async fn handle_inner<H: Handler>(
        &mut self,
        msg: &jetstream::Message,
        handler: &mut H,
    ) -> Result<(), HandlerError> {
        let batch = ChangeBatch::decode(msg.payload.as_ref())
            .map_err(|e| HandlerError::Poison(format!("not a ChangeBatch: {e}")))?;
        tracing::Span::current().record("shelfsync.change_count", batch.changes.len());
        if let Some(mark) = &batch.keyframe {
            let Some(place) = place_of_subject(&msg.subject) else {
                return Err(HandlerError::Poison(format!("bad change subject {}", msg.subject)));
            };
            self.status.keyframe_checks.fetch_add(1, Ordering::Relaxed);
            if let Check::Drift { ours, theirs } = self.state.check(place, mark) {
                warn!(
                    feed = %self.name(), brand_id = place.brand_id, place_id = place.place_id,
                    ours = ?ours, keyframe = ?theirs, keyframe_id = %mark.keyframe_id,
                    "place drifted from its keyframe: resyncing"
                );
                let marker_seq = msg.info().map(|i| i.stream_sequence).map_err(|e| {
                    HandlerError::Poison(format!("marker without JetStream metadata: {e}"))
                })?;
                self.resync(place, mark, marker_seq, handler).await?;
            }
            return Ok(());
        }
        self.apply_changes(&batch, handler).await
    }

    /// Hands the handler the changes of a batch that are newer than what it
    /// has, and remembers them.
    async fn apply_changes<H: Handler>(
        &mut self,
        batch: &ChangeBatch,
        handler: &mut H,
    ) -> Result<(), HandlerError> {
        // Only versions newer than what was delivered (also within the batch).
        let mut updates: Vec<Update> = Vec::with_capacity(batch.changes.len());
        let mut seen_here: std::collections::HashMap<(i64, i64, &str), i64> = Default::default();
        for c in &batch.changes {
            let Some(u) = Update::from_change(c) else { continue };
            let id = c.key.as_ref().map_or("", |k| k.product_id.as_str());
            let at = u.after.updated_at;
            let k = (u.key.brand_id, u.key.place_id, id);
            let newer = seen_here
                .get(&k)
                .map_or_else(|| self.state.is_newer(u.place(), id, at), |&prev| at > prev);
            if newer {
                seen_here.insert(k, at);
                updates.push(u);
            } else {
                self.status.duplicates.fetch_add(1, Ordering::Relaxed);
            }
        }
        if updates.is_empty() {
            return Ok(());
        }
        handler.apply(&updates).await?;
        let freshness = metrics::histogram!(names::FRESHNESS_SECONDS, "stage" => "consumer");
        for u in &updates {
            self.state.record(u.place(), &u.key.product_id, u.after.updated_at, u.after.deleted);
            if let Some(s) = u
                .origin
                .as_ref()
                .and_then(|o| shelfsync_telemetry::seconds_since_us(o.published_at))
            {
                freshness.record(s);
            }
        }
        self.status.delivered.fetch_add(updates.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    async fn resync<H: Handler>(
        &mut self,
        place: PlaceKey,
        mark: &KeyframeMark,
        marker_seq: u64,
        handler: &mut H,
    ) -> Result<(), HandlerError> {
        let transient = |e: &dyn std::fmt::Display| HandlerError::Transient(e.to_string());
        let reader = KeyframeReader::new(&self.js, self.subjects.clone())
            .await
            .map_err(|e| transient(&e))?;
        let keyframe = reader
            .of_mark(place.brand_id, place.place_id, mark)
            .await
            .map_err(|e| transient(&e))?;
        let Some(keyframe) = keyframe else {
            // Replaced by a newer keyframe (its own marker comes later), or
            // never completed: the next keyframe repairs the place.
            warn!(
                feed = %self.name(), brand_id = place.brand_id, place_id = place.place_id,
                keyframe_id = %mark.keyframe_id,
                "keyframe of the marker not found complete; the place stays as it is"
            );
            return Ok(());
        };
        self.load_keyframe(&reader, &keyframe, handler).await.map_err(|e| transient(&e))?;
        // The keyframe is the place when storage froze it; the marker comes
        // later in the stream. What changed in between is applied again.
        self.replay(place, keyframe.last.changes_seq + 1, marker_seq, handler).await?;
        self.status.drift_repairs.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(names::FEED_DRIFT_REPAIRS).increment(1);
        Ok(())
    }
}

impl ChangeFeed {
    /// Applies the changes of a place stored in `[from, until)`, newer-only.
    async fn replay<H: Handler>(
        &mut self,
        place: PlaceKey,
        from: u64,
        until: u64,
        handler: &mut H,
    ) -> Result<(), HandlerError> {
        let transient = |e: &dyn std::fmt::Display| HandlerError::Transient(e.to_string());
        let stream =
            self.js.get_stream(self.subjects.changes_stream()).await.map_err(|e| transient(&e))?;
        let subject = self.subjects.changes(place.brand_id, place.place_id);
        let mut seq = from.max(1);
        while seq < until {
            let msg = match stream
                .raw_message_builder()
                .sequence(seq)
                .next_by_subject(subject.clone())
                .send()
                .await
            {
                Ok(m) => m,
                Err(e)
                    if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
                {
                    break;
                }
                Err(e) => return Err(transient(&e)),
            };
            if msg.sequence >= until {
                break;
            }
            seq = msg.sequence + 1;
            match ChangeBatch::decode(msg.payload.as_ref()) {
                Ok(batch) if batch.keyframe.is_none() => {
                    self.apply_changes(&batch, handler).await?
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(%subject, seq = msg.sequence, error = %chain(&e), "not a ChangeBatch; skipped")
                }
            }
        }
        Ok(())
    }
}

/// True when JetStream says the consumer does not exist.
/// This process, for a consumer's description: host, pid and start time.
fn instance_tag() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_default();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("instance {host} pid {} at {nanos}", std::process::id())
}

fn is_consumer_not_found(e: &jetstream::stream::ConsumerError) -> bool {
    matches!(
        e.kind(),
        jetstream::stream::ConsumerErrorKind::JetStream(err)
            if err.error_code() == jetstream::ErrorCode::CONSUMER_NOT_FOUND
    )
}

/// `(brand, place)` from `<prefix>.changes.<brand>.<place>`.
fn place_of_subject(subject: &str) -> Option<PlaceKey> {
    let mut t = subject.rsplit('.');
    let p = t.next()?.parse().ok()?;
    let b = t.next()?.parse().ok()?;
    Some(PlaceKey::new(b, p))
}

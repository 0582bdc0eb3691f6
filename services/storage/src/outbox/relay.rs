//! The outbox relay of one partition: publishes what the partition
//! committed, in order, trims what JetStream stored, and never stores an
//! entry twice — however long after its first attempt it is retried.
//!
//! JetStream's `Nats-Msg-Id` dedup only covers retries within
//! `nats.duplicate_window`. Past it, the stream itself says what is stored:
//! every entry carries a floor, a sequence of its stream at or below where
//! it lands (the highest the worker knew when it committed the entry).
//! Whenever a publish may have landed unseen — the first relay after a start
//! (a previous owner may have died between its publish and its trim) and
//! every relay after a failed attempt (a lost ack, an outage) — the relay
//! reads each entry's subject from just after its floor and skips the
//! entries it finds there by message id. In the steady state (the previous
//! relay went through) nothing is read; the window is only an optimisation.
//!
//! An entry refused as too large is published in halves, or reduced
//! (`crate::outbox::smaller`); one that cannot be made smaller is kept aside
//! in Redis (`{ns:pN}:dead`), counted and logged once, and the partition
//! moves on: the same bytes would be refused forever. Any other refusal (a
//! stream or account out of room, a stream misconfigured) and a publish that
//! gets no answer (NATS away) are backpressure: nothing is set aside, the
//! relay fails and is retried until it works, the partition waiting.
//!
//! With `redis.wait_replicas`, nothing is published before that many Redis
//! replicas confirm every write so far: an entry a previous owner committed
//! may not have reached them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use async_nats::jetstream;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use shelfsync_bus::{Failure, Partition, PublishFailed, Publisher, Subjects};
use shelfsync_proto::{OutboxEntry, msg_type};
use shelfsync_telemetry::chain;
use tracing::{Instrument, error, warn};

use super::smaller;
use crate::failpoint;
use crate::metrics::Stats;
use crate::store::{OUTBOX_PEEK, Store, StoreError};

/// Why a relay did not finish; the outbox stays as it is and is relayed
/// again.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RelayError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Publish(#[from] PublishFailed),
    #[error("cannot read {subject} back from the stream: {detail}")]
    ReadBack { subject: String, detail: String },
    #[error("{have} of the {want} Redis replicas asked for confirmed the outbox in time")]
    Replicas { have: usize, want: usize },
    /// Fault injection only (`lose_relay_ack`): the messages are stored,
    /// their acks taken as lost.
    #[error("publish acks lost (fault injection)")]
    AckLost,
}

pub(crate) struct Relay {
    partition: Partition,
    store: Store,
    js: jetstream::Context,
    subjects: Subjects,
    publisher: Publisher,
    stats: Arc<Stats>,
    /// Per stream, the last sequence its info reported at start.
    known: HashMap<String, u64>,
    /// A publish may have landed without an ack seen: read back first.
    uncertain: bool,
    /// What an earlier version left in the partition's outbox list was
    /// moved to the outbox stream.
    adopted: bool,
    /// Entries refused as too large (message ids): published in pieces.
    too_large: HashSet<String>,
    /// `redis.wait_replicas` and `redis.wait_timeout` (0: none to wait for).
    wait: (usize, std::time::Duration),
}

impl Relay {
    /// A relay that reads back before its first publish: a previous owner
    /// of the partition may have published without trimming.
    pub(crate) async fn start(
        partition: Partition,
        store: Store,
        js: jetstream::Context,
        subjects: Subjects,
        max_inflight: usize,
        wait: (usize, std::time::Duration),
        stats: Arc<Stats>,
    ) -> Relay {
        let publisher = Publisher::new(js.clone(), max_inflight);
        let mut relay = Relay {
            partition,
            store,
            js,
            subjects,
            publisher,
            stats,
            known: HashMap::new(),
            uncertain: true,
            adopted: false,
            too_large: HashSet::new(),
            wait,
        };
        for stream in [relay.subjects.changes_stream(), relay.subjects.rejects_stream()] {
            relay.learn(&stream).await;
        }
        relay
    }

    async fn learn(&mut self, stream: &str) {
        match self.js.get_stream(stream).await {
            Ok(mut s) => match s.info().await {
                Ok(info) => {
                    self.known.insert(stream.to_string(), info.state.last_sequence);
                }
                Err(e) => {
                    warn!(partition = %self.partition, stream, error = %chain(&e), "stream info failed")
                }
            },
            Err(e) => {
                warn!(partition = %self.partition, stream, error = %chain(&e), "stream info failed")
            }
        }
    }

    /// The floors new entries carry: for the CHANGES and the REJECTS stream,
    /// a sequence at or below where a message published from now on lands.
    pub(crate) fn floors(&self) -> (u64, u64) {
        let floor = |stream: String| {
            let known = self.known.get(&stream).copied().unwrap_or(0);
            known.max(self.publisher.last_sequence(&stream))
        };
        (floor(self.subjects.changes_stream()), floor(self.subjects.rejects_stream()))
    }

    fn stream_of(&self, e: &OutboxEntry) -> String {
        if e.msg_type == msg_type::REJECTION_BATCH {
            self.subjects.rejects_stream()
        } else {
            self.subjects.changes_stream()
        }
    }

    /// Publishes the outbox from its head and trims what is stored, until it
    /// is empty. Returns how many entries went out.
    pub(crate) async fn relay(&mut self) -> Result<usize, RelayError> {
        let result = self.relay_all().await;
        if result.is_err() {
            self.uncertain = true;
        }
        result
    }

    async fn relay_all(&mut self) -> Result<usize, RelayError> {
        if !self.adopted {
            let moved = self.store.adopt_legacy_outbox(self.partition).await?;
            if moved > 0 {
                tracing::info!(
                    partition = %self.partition, moved,
                    "outbox entries an earlier version left in its outbox list are relayed now"
                );
            }
            self.adopted = true;
        }
        let mut total = 0;
        loop {
            let entries = self.store.outbox_peek(self.partition, OUTBOX_PEEK).await?;
            if entries.is_empty() {
                self.uncertain = false;
                return Ok(total);
            }
            self.wait_replicas().await?;
            let stored =
                if self.uncertain { self.stored_ids(&entries).await? } else { HashSet::new() };
            let contexts: Vec<_> = entries.iter().map(context_of).collect();
            // Relaying entries of several command messages: link them all.
            shelfsync_telemetry::add_links(&tracing::Span::current(), &contexts);
            let mut again = 0u64;
            for (e, cx) in entries.iter().zip(contexts) {
                if stored.contains(&e.msg_id) {
                    again += 1;
                    continue;
                }
                if self.too_large.contains(&e.msg_id) {
                    self.publish_smaller(e, &stored).await?;
                    continue;
                }
                if let Err(failed) = self.send(e, cx).await {
                    self.note_failure(&failed);
                    // What went before it is still awaited; either way the
                    // next attempt reads back what is stored.
                    let _ = self.publisher.flush().await;
                    return Err(failed.into());
                }
            }
            if let Err(failed) = self.publisher.flush().await {
                self.note_failure(&failed);
                return Err(failed.into());
            }
            if failpoint::triggered("lose_relay_ack") {
                return Err(RelayError::AckLost);
            }
            failpoint::hit("after_outbox_publish");
            self.store.outbox_trim(self.partition, entries.len()).await?;
            total += entries.len();
            self.stats.relayed(&entries, again);
        }
    }

    /// Remembers what a failed publish says about its entry.
    /// Publishes one entry (or a piece of one) in a relay span whose parent
    /// is the entry's command, with the entry's trace and baggage.
    async fn send(
        &mut self,
        e: &OutboxEntry,
        cx: shelfsync_telemetry::Context,
    ) -> Result<(), PublishFailed> {
        let span = shelfsync_telemetry::send_span!(
            "storage.relay",
            self.subjects.template(&e.subject),
            e.subject,
            partition = self.partition.0,
        );
        shelfsync_telemetry::set_parent(&span, cx);
        let headers = relay_headers(&span, e);
        self.publisher
            .publish(e.subject.clone(), e.msg_id.clone(), &e.msg_type, headers, e.payload.clone())
            .instrument(span)
            .await
    }

    fn note_failure(&mut self, failed: &PublishFailed) {
        if failed.failure() == Failure::TooLarge {
            self.too_large.insert(failed.msg_id.clone());
        }
    }

    /// With `redis.wait_replicas`: every write so far is on that many
    /// replicas, or the relay fails (and is retried).
    async fn wait_replicas(&self) -> Result<(), RelayError> {
        let (want, timeout) = self.wait;
        if want == 0 {
            return Ok(());
        }
        let have = self.store.wait_replicas(self.partition, want, timeout).await?;
        if have < want {
            return Err(RelayError::Replicas { have, want });
        }
        Ok(())
    }

    /// The message ids stored on the subjects of `entries` after their
    /// floors (read back with direct reads of the stream, oldest first).
    async fn stored_ids(&mut self, entries: &[OutboxEntry]) -> Result<HashSet<String>, RelayError> {
        let mut floors: HashMap<(&str, String), u64> = HashMap::new();
        for e in entries {
            let floor = floors.entry((e.subject.as_str(), self.stream_of(e))).or_insert(u64::MAX);
            *floor = (*floor).min(e.stream_floor);
        }
        let mut ids = HashSet::new();
        for ((subject, stream), floor) in floors {
            let read_err =
                |detail: String| RelayError::ReadBack { subject: subject.into(), detail };
            let stream =
                self.js.get_stream_no_info(&stream).await.map_err(|e| read_err(e.to_string()))?;
            let mut next = floor.saturating_add(1);
            loop {
                match stream.get_first_raw_message_by_subject(subject, next).await {
                    Ok(m) => {
                        if let Some(id) = m.headers.get(async_nats::header::NATS_MESSAGE_ID) {
                            ids.insert(id.as_str().to_string());
                        }
                        next = m.sequence + 1;
                    }
                    Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
                    Err(e) => return Err(read_err(e.to_string())),
                }
            }
        }
        Ok(ids)
    }

    /// Publishes an entry refused as too large in pieces (halves, then a
    /// reduced item), one at a time with its ack; what cannot be made
    /// smaller is kept aside.
    async fn publish_smaller(
        &mut self,
        entry: &OutboxEntry,
        stored: &HashSet<String>,
    ) -> Result<(), RelayError> {
        let mut todo = vec![entry.clone()];
        while let Some(e) = todo.pop() {
            let pieces = match smaller(&e) {
                Some(p) => p,
                None => {
                    self.bury(&e, "too_large").await?;
                    continue;
                }
            };
            // In order: the last piece is pushed first.
            for piece in pieces.into_iter().rev() {
                if stored.contains(&piece.msg_id) {
                    continue;
                }
                // Each piece carries the entry's trace and baggage.
                let sent = async {
                    self.send(&piece, context_of(&piece)).await?;
                    self.publisher.flush().await
                }
                .await;
                match sent {
                    Ok(()) => {
                        self.stats.outbox_reduced();
                    }
                    Err(f) if f.is_too_large() => todo.push(piece),
                    Err(f) => return Err(f.into()),
                }
            }
        }
        self.too_large.remove(&entry.msg_id);
        Ok(())
    }

    /// Keeps an entry that cannot be published aside, so that the partition
    /// moves on; logged once (the entry is trimmed right after).
    async fn bury(&mut self, e: &OutboxEntry, reason: &'static str) -> Result<(), RelayError> {
        self.store.outbox_bury(self.partition, e).await?;
        self.too_large.remove(&e.msg_id);
        error!(
            partition = %self.partition, subject = %e.subject, msg_id = %e.msg_id,
            bytes = e.payload.len(), reason,
            "an outbox entry cannot be published; kept aside (shelfsync dead-letters) and skipped"
        );
        self.stats.outbox_unpublishable(reason);
        Ok(())
    }
}

/// The context an entry keeps: its command's trace and baggage (an entry
/// written before baggage was kept has none; its trace goes on).
fn context_of(e: &OutboxEntry) -> shelfsync_telemetry::Context {
    shelfsync_telemetry::from_parts(&shelfsync_telemetry::Parts {
        traceparent: e.traceparent.clone(),
        tracestate: e.tracestate.clone(),
        baggage: e.baggage.clone(),
    })
}

/// Headers of a relayed entry: `None` lets the publisher inject the relay
/// span's context — its parent is the entry's, baggage included, which the
/// propagator writes when `OTEL_PROPAGATORS` has `baggage`; without tracing
/// the stored context is passed on as is.
fn relay_headers(span: &tracing::Span, e: &OutboxEntry) -> Option<async_nats::HeaderMap> {
    if e.traceparent.is_empty()
        || shelfsync_telemetry::is_valid(&shelfsync_telemetry::context_of(span))
    {
        return None;
    }
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(shelfsync_telemetry::TRACEPARENT, e.traceparent.as_str());
    let kept = [
        (shelfsync_telemetry::TRACESTATE, &e.tracestate),
        (shelfsync_telemetry::BAGGAGE, &e.baggage),
    ];
    for (name, value) in kept.into_iter().filter(|(_, v)| !v.is_empty()) {
        headers.insert(name, value.as_str());
    }
    Some(headers)
}

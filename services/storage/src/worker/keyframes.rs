//! The partition worker's side of a keyframe: freeze a place between two
//! command messages, publish it from a task, mark it and end the freeze
//! (`crate::keyframe` has the snapshot itself and knows nothing of workers).

use shelfsync_proto::{ChangeBatch, KeyframeBatch, KeyframeMark, PlaceKey, Record, msg_type};
use shelfsync_telemetry::chain;

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use prost::Message;
use shelfsync_bus::Publisher;
use shelfsync_bus::digest::Digest;
use tokio::sync::OwnedSemaphorePermit;

use super::*;
use crate::keyframe::*;

/// Keyframe parts (up to 1000 records, ~250 KB) of one place awaiting their
/// ack. Small: the parts share the server with the live changes, which must
/// not queue behind megabytes of snapshot.
const KEYFRAME_INFLIGHT: usize = 2;
/// Keyframes a partition queues at most (each its places); one more asked
/// for is refused until one is done.
const KEYFRAMES_QUEUED: usize = 4;

/// One place waiting for its keyframe in this worker.
pub(super) struct PlaceSnapshot {
    keyframe_id: String,
    changes_seq: u64,
    place: PlaceKey,
    progress: std::sync::Arc<crate::keyframe::JobProgress>,
    last_of_job: bool,
}

/// The frozen place and the ids of its records changed since the freeze.
pub(super) type ChangedSinceFreeze = (PlaceKey, HashSet<String>);

/// A place between its freeze and its marker.
pub(super) struct InHand {
    snapshot: PlaceSnapshot,
    frozen: Frozen,
    started: Instant,
    /// Publishes the parts; gives the frozen digest.
    pub(super) task: tokio::task::JoinHandle<anyhow::Result<Digest>>,
    span: tracing::Span,
}

impl Worker {
    pub(super) async fn plan_snapshots(
        &self,
        job: KeyframeJob,
        queue: &mut VecDeque<PlaceSnapshot>,
    ) {
        let places = match job.place {
            Some(place) => vec![place],
            None => match self.shared.store.places(self.partition).await {
                Ok(p) => p,
                Err(e) => {
                    job.progress
                        .worker_done(Some(format!("partition {}: {e}", self.partition)))
                        .await;
                    return;
                }
            },
        };
        if places.is_empty() {
            job.progress.worker_done(None).await;
            return;
        }
        // Bounded: a flood of requests (any consumer may ask) cannot grow
        // the queue without end; a keyframe asked for once too often is
        // refused, and the requester asks again later.
        let mut queued: Vec<&str> = queue.iter().map(|s| s.keyframe_id.as_str()).collect();
        queued.dedup();
        if queued.len() >= KEYFRAMES_QUEUED {
            let busy = format!(
                "partition {}: {} keyframes already queued; ask again later",
                self.partition,
                queued.len()
            );
            job.progress.worker_done(Some(busy)).await;
            return;
        }
        let n = places.len();
        self.shared.stats.keyframe_places_queued.fetch_add(n as u64, Ordering::Relaxed);
        for (i, place) in places.into_iter().enumerate() {
            queue.push_back(PlaceSnapshot {
                keyframe_id: job.keyframe_id.clone(),
                changes_seq: job.changes_seq,
                place,
                progress: job.progress.clone(),
                last_of_job: i + 1 == n,
            });
        }
    }

    /// Freezes one place, then hands the publication of its parts to a task
    /// holding `permit`.
    pub(super) async fn start_snapshot(
        self: &Arc<Self>,
        s: PlaceSnapshot,
        permit: OwnedSemaphorePermit,
    ) -> Option<InHand> {
        let started = Instant::now();
        let span = tracing::info_span!(
            "storage.keyframe_place",
            partition = self.partition.0,
            keyframe_id = %s.keyframe_id,
            brand_id = s.place.brand_id,
            place_id = s.place.place_id,
        );
        let frozen =
            self.freeze(&s.keyframe_id, s.changes_seq, s.place).instrument(span.clone()).await;
        self.shared.stats.keyframe_place_held(started.elapsed());
        let frozen = match frozen {
            Ok(f) => f,
            Err(e) => {
                self.snapshot_done(&s, Err(e), started).await;
                return None;
            }
        };
        *self.changed_since_freeze.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((s.place, HashSet::new()));
        let this = self.clone();
        let f = frozen.clone();
        let task = self.shared.keyframe_limits.spawn(
            async move {
                let live =
                    KeyframeIo { js: this.shared.js.clone(), store: this.shared.store.clone() };
                let io = this.shared.keyframe_limits.io(&this.shared.config, live).await;
                let mut publisher = Publisher::new(io.js.clone(), KEYFRAME_INFLIGHT);
                let published = this.publish_frozen(&f, &io, &mut publisher).await;
                drop(permit);
                published
            }
            .instrument(span.clone()),
        );
        Some(InHand { snapshot: s, frozen, started, task, span })
    }

    /// Once the parts are out: the marker, then the freeze ends.
    pub(super) async fn finish_snapshot(
        &self,
        hand: InHand,
        published: Result<anyhow::Result<Digest>, tokio::task::JoinError>,
        publisher: &mut Publisher,
    ) {
        let changed = self
            .changed_since_freeze
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|(_, ids)| ids)
            .unwrap_or_default();
        let result = match published {
            Ok(Ok(digest)) => {
                self.mark(&hand.frozen, digest, &changed, publisher)
                    .instrument(hand.span.clone())
                    .await
            }
            Ok(Err(e)) => Err(e),
            Err(e) => Err(anyhow::anyhow!("keyframe task: {e}")),
        };
        let f = &hand.frozen;
        if let Err(e) = self.shared.store.thaw_place(self.partition, f.place).await {
            warn!(
                partition = %self.partition, brand_id = f.place.brand_id, place_id = f.place.place_id,
                error = %chain(&e), "dropping a frozen place failed (it expires)"
            );
        }
        self.snapshot_done(&hand.snapshot, result, hand.started).await;
    }

    /// Notes the records of the frozen place that a commit changed.
    pub(crate) fn note_changed(&self, slots: &crate::apply::Slots) {
        let mut tracked = self.changed_since_freeze.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((place, ids)) = tracked.as_mut() {
            for ((b, p, id), slot) in slots {
                if PlaceKey::new(*b, *p) == *place && slot.record_dirty {
                    ids.insert(id.clone());
                }
            }
        }
    }

    async fn snapshot_done(
        &self,
        s: &PlaceSnapshot,
        result: anyhow::Result<u64>,
        started: Instant,
    ) {
        match result {
            Ok(records) => s.progress.place_done(records),
            Err(e) => {
                warn!(
                    partition = %self.partition, brand_id = s.place.brand_id, place_id = s.place.place_id,
                    error = %chain(e.as_ref()), "place keyframe failed"
                );
                s.progress
                    .place_failed(format!("place {}/{}: {e:#}", s.place.brand_id, s.place.place_id))
                    .await;
            }
        }
        self.shared.stats.keyframe_took(started.elapsed());
        if s.last_of_job {
            s.progress.worker_done(None).await;
        }
    }

    /// Freezes a place (one Redis step). Runs inside the partition's worker
    /// loop, between two command messages, so the frozen place is the place
    /// exactly after the last applied command.
    pub(crate) async fn freeze(
        &self,
        keyframe_id: &str,
        changes_seq: u64,
        place: PlaceKey,
    ) -> anyhow::Result<Frozen> {
        let command_seq = self.shared.store.freeze_place(self.partition, place, FROZEN_TTL).await?;
        let as_of = Self::now_us();
        Ok(Frozen {
            keyframe_id: keyframe_id.to_string(),
            changes_seq,
            place,
            command_seq,
            as_of,
            tombstone_cutoff: as_of - self.shared.config.storage.tombstone_ttl.as_micros() as i64,
        })
    }

    /// Publishes a frozen place as `KeyframeBatch`es at the replica's pace,
    /// the last one with the count and digest, then purges keyframes older
    /// than the configured number. Runs in a task while the partition goes
    /// on. Returns the digest of the frozen records.
    pub(crate) async fn publish_frozen(
        &self,
        f: &Frozen,
        io: &KeyframeIo,
        publisher: &mut Publisher,
    ) -> anyhow::Result<Digest> {
        let started = Instant::now();
        let partition = self.partition;
        let subject = self.shared.subjects.keyframes(f.place.brand_id, f.place.place_id);
        let part_of = |part: u32, records: Vec<Record>, first_seq: Option<u64>| KeyframeBatch {
            keyframe_id: f.keyframe_id.clone(),
            brand_id: f.place.brand_id,
            place_id: f.place.place_id,
            part,
            records,
            as_of: f.as_of,
            command_seq: f.command_seq,
            changes_seq: f.changes_seq,
            // Readers find part 0 from the last part.
            first_seq: first_seq.unwrap_or(0),
            tombstone_cutoff: f.tombstone_cutoff,
            ..Default::default()
        };
        let mut digest = Digest::default();
        let mut seen = HashSet::new();
        let mut pending = Vec::new();
        let mut pending_bytes = 0usize;
        let mut part = 0u32;
        let mut first_seq = None;
        // The live records as frozen, then those written since the freeze
        // that the first pass did not meet (deleted since). Each step is
        // read while the one before is encoded and published.
        let scan = |kept: bool, cursor: u64| {
            let (store, place) = (io.store.clone(), f.place);
            tokio::spawn(async move {
                store.scan_frozen(partition, place, kept, cursor, SCAN_COUNT).await
            })
        };
        let mut kept = false;
        let mut step = scan(kept, 0);
        loop {
            let (next, records) = step.await??;
            let following = match (next, kept) {
                (0, true) => None,
                (0, false) => Some((true, 0)),
                (cursor, kept) => Some((kept, cursor)),
            };
            let next_step = following.map(|(k, cursor)| {
                kept = k;
                scan(k, cursor)
            });
            for r in records {
                let id = r.key.as_ref().map(|k| k.product_id.clone()).unwrap_or_default();
                // Rehashing can repeat a field across HSCAN steps.
                if !seen.insert(id.clone()) || !f.counts(&r) {
                    continue;
                }
                digest.add(&id, r.updated_at);
                let len = r.encoded_len() + 6;
                if !pending.is_empty()
                    && (pending.len() >= 1000 || pending_bytes + len > self.shared.max_bytes)
                {
                    let records = std::mem::take(&mut pending);
                    self.give_way(records.len()).await;
                    let batch = part_of(part, records, first_seq);
                    let seq = self.publish_keyframe(&io.js, &subject, batch, publisher).await?;
                    first_seq.get_or_insert(seq);
                    part += 1;
                    pending_bytes = 0;
                }
                pending_bytes += len;
                pending.push(r);
            }
            match next_step {
                Some(s) => step = s,
                None => break,
            }
        }
        self.give_way(pending.len()).await;
        let mut last = part_of(part, pending, first_seq);
        last.last = true;
        last.total = digest.count;
        last.digest = digest.sum;
        let seq = self.publish_keyframe(&io.js, &subject, last, publisher).await?;
        let first_seq = first_seq.unwrap_or(seq);
        publisher.flush().await?;

        let keep = self.shared.config.storage.keyframes_kept;
        if let Some(oldest_kept) =
            io.store.keyframe_published(partition, f.place, first_seq, keep).await?
        {
            let stream = io.js.get_stream(self.shared.subjects.keyframes_stream()).await?;
            if let Err(e) = stream.purge().filter(&subject).sequence(oldest_kept).await {
                warn!(%subject, error = %chain(&e), "purging old keyframes failed");
            }
        }
        self.shared.stats.keyframe_records(digest.count);
        tracing::debug!(
            brand_id = f.place.brand_id,
            place_id = f.place.place_id,
            records = digest.count,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "place keyframe published"
        );
        Ok(digest)
    }

    /// Puts the keyframe's marker on the place's change subject. Runs inside
    /// the partition's worker loop, between two command messages, once the
    /// parts are out: the marker goes after every change of the place applied
    /// so far and before any later one, so its digest is the frozen one
    /// brought up to now by the records `changed` since the freeze.
    pub(crate) async fn mark(
        &self,
        f: &Frozen,
        frozen: Digest,
        changed: &HashSet<String>,
        publisher: &mut Publisher,
    ) -> anyhow::Result<u64> {
        let partition = self.partition;
        let records = frozen.count;
        let mut digest = frozen;
        let ids: Vec<String> = changed.iter().cloned().collect();
        for chunk in ids.chunks(MARK_CHUNK) {
            let (then, now) = self.shared.store.frozen_and_live(partition, f.place, chunk).await?;
            let sides = chunk.iter().map(String::as_str).zip(then).zip(now);
            digest = digest_at_mark(digest, f, sides.map(|((id, then), now)| (id, then, now)));
        }
        let command_seq = self.shared.store.applied_seq(partition).await?;
        let mark = ChangeBatch {
            partition: partition.0,
            command_seq,
            keyframe: Some(KeyframeMark {
                keyframe_id: f.keyframe_id.clone(),
                total: digest.count,
                digest: digest.sum,
                as_of: f.as_of,
                tombstone_cutoff: f.tombstone_cutoff,
            }),
            ..Default::default()
        };
        publisher
            .publish(
                self.shared.subjects.changes(f.place.brand_id, f.place.place_id),
                format!("kfm:{}:{}:{}", f.keyframe_id, f.place, f.as_of),
                msg_type::CHANGE_BATCH,
                None,
                mark.encode_to_vec().into(),
            )
            .await?;
        publisher.flush().await?;
        Ok(records)
    }

    /// Paces `records` (see [`KeyframeLimits::pace`]), counting the time
    /// given way to late live changes.
    async fn give_way(&self, records: usize) {
        let yielded = self.shared.keyframe_limits.pace(records).await;
        if !yielded.is_zero() {
            self.shared.stats.keyframe_yielded(yielded);
        }
    }

    async fn publish_keyframe(
        &self,
        js: &async_nats::jetstream::Context,
        subject: &str,
        batch: KeyframeBatch,
        publisher: &mut Publisher,
    ) -> anyhow::Result<u64> {
        // The first part's sequence is needed for purging, so wait for its
        // ack; later parts are pipelined.
        // `as_of` makes the ids unique per run: a reused keyframe id can never
        // have its parts dropped as duplicates of an earlier run's.
        let id = format!(
            "kf:{}:{}:{}:{}:{}",
            batch.keyframe_id, batch.brand_id, batch.place_id, batch.as_of, batch.part
        );
        if batch.part == 0 {
            // As the publisher does: the message carries the trace context.
            let mut headers = async_nats::HeaderMap::new();
            shelfsync_telemetry::inject(&mut headers);
            let msg = async_nats::jetstream::message::PublishMessage::build()
                .payload(batch.encode_to_vec().into())
                .headers(headers)
                .message_id(&id)
                .header(shelfsync_bus::TYPE_HEADER, msg_type::KEYFRAME_BATCH);
            let ack = js.send_publish(subject.to_string(), msg).await?.await?;
            return Ok(ack.sequence);
        }
        publisher
            .publish(
                subject.to_string(),
                id,
                msg_type::KEYFRAME_BATCH,
                None,
                batch.encode_to_vec().into(),
            )
            .await?;
        Ok(0)
    }
}

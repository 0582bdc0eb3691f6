//! Keyframes (DESIGN §4): consistent per-place snapshots published by the
//! partition worker between two command messages, so no command of the place
//! is applied in the middle of its snapshot, and live processing waits for
//! at most one place at a time.
//!
//! For each place: note where the change stream stands, stream the records
//! (HSCAN) as `KeyframeBatch`es, the last one with the count and digest, then
//! put a `KeyframeMark` on the place's change subject — the exact point in the
//! change stream where a consumer compares its own digest — and purge
//! keyframes older than the configured number.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use prost::Message;
use shelfsync_bus::Publisher;
use shelfsync_bus::digest::Digest;
use shelfsync_proto::{ChangeBatch, KeyframeBatch, KeyframeMark, KeyframeReply, msg_type};
use tokio::sync::{Mutex, oneshot};
use tracing::{info, warn};

use crate::worker::Worker;

/// Records read per HSCAN step.
const SCAN_COUNT: usize = 1000;

/// One keyframe request as a worker sees it.
pub struct KeyframeJob {
    pub keyframe_id: String,
    /// CHANGES stream's last sequence when the run started.
    pub changes_seq: u64,
    /// `None`: every place of the partition.
    pub place: Option<(i64, i64)>,
    pub progress: Arc<JobProgress>,
}

/// Shared by the workers taking part in one keyframe; the last to finish
/// sends the reply.
pub struct JobProgress {
    pub keyframe_id: String,
    pub replica: u32,
    remaining: AtomicUsize,
    places: AtomicU32,
    records: AtomicU64,
    errors: Mutex<Vec<String>>,
    done: Mutex<Option<oneshot::Sender<KeyframeReply>>>,
    started: Instant,
}

impl JobProgress {
    /// `workers` jobs will report; `done` receives the reply.
    pub fn new(
        keyframe_id: String,
        replica: u32,
        workers: usize,
        done: Option<oneshot::Sender<KeyframeReply>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            keyframe_id,
            replica,
            remaining: AtomicUsize::new(workers),
            places: AtomicU32::new(0),
            records: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            done: Mutex::new(done),
            started: Instant::now(),
        })
    }

    pub fn place_done(&self, records: u64) {
        self.places.fetch_add(1, Ordering::SeqCst);
        self.records.fetch_add(records, Ordering::SeqCst);
    }

    pub async fn place_failed(&self, error: String) {
        self.errors.lock().await.push(error);
    }

    pub async fn worker_done(&self, error: Option<String>) {
        if let Some(e) = error {
            self.errors.lock().await.push(e);
        }
        if self.remaining.fetch_sub(1, Ordering::SeqCst) == 1 {
            let errors = self.errors.lock().await.join("; ");
            let reply = KeyframeReply {
                keyframe_id: self.keyframe_id.clone(),
                places: self.places.load(Ordering::SeqCst),
                records: self.records.load(Ordering::SeqCst),
                error: errors,
                replica: self.replica,
            };
            info!(
                keyframe_id = %reply.keyframe_id,
                places = reply.places,
                records = reply.records,
                elapsed_ms = self.started.elapsed().as_millis() as u64,
                "keyframe published"
            );
            if let Some(tx) = self.done.lock().await.take() {
                let _ = tx.send(reply);
            }
        }
    }
}

/// A keyframe id shared by every replica for one schedule tick or request.
pub fn keyframe_id_at(unix_micros: i64) -> String {
    format!("kf-{unix_micros}")
}

impl Worker {
    /// Publishes the keyframe of one place. Runs inside the partition's
    /// worker loop, between two command messages.
    pub(crate) async fn snapshot_place(
        &self,
        keyframe_id: &str,
        changes_seq: u64,
        brand_id: i64,
        place_id: i64,
        publisher: &mut Publisher,
    ) -> anyhow::Result<u64> {
        let started = Instant::now();
        let partition = self.partition.0;
        // The outbox is drained after every message, so every change of this
        // place up to `command_seq` is already in the CHANGES stream.
        let command_seq = self.store.applied_seq(partition).await?;
        let as_of = chrono::Utc::now().timestamp_micros();
        let tombstone_cutoff = as_of - self.settings.storage.tombstone_ttl.as_micros() as i64;
        let subject = self.subjects.keyframes(brand_id, place_id);
        let mut digest = Digest::default();
        let mut seen = HashSet::new();
        let mut pending = Vec::new();
        let mut pending_bytes = 0usize;
        let mut part = 0u32;
        let mut first_seq = None;
        let mut cursor = 0u64;
        loop {
            let (next, records) =
                self.store.scan_place(partition, brand_id, place_id, cursor, SCAN_COUNT).await?;
            for r in records {
                let id = r.key.as_ref().map(|k| k.product_id.clone()).unwrap_or_default();
                // Rehashing can repeat a field across HSCAN steps; expired
                // tombstones are as good as purged.
                if !seen.insert(id.clone()) || (r.deleted && r.updated_at < tombstone_cutoff) {
                    continue;
                }
                digest.add(&id, r.updated_at);
                let len = r.encoded_len() + 6;
                if !pending.is_empty()
                    && (pending.len() >= 1000 || pending_bytes + len > self.max_bytes)
                {
                    let batch = KeyframeBatch {
                        keyframe_id: keyframe_id.to_string(),
                        brand_id,
                        place_id,
                        part,
                        records: std::mem::take(&mut pending),
                        as_of,
                        command_seq,
                        changes_seq,
                        first_seq: first_seq.unwrap_or(0),
                        tombstone_cutoff,
                        ..Default::default()
                    };
                    let seq = self.publish_keyframe(&subject, batch, publisher).await?;
                    first_seq.get_or_insert(seq);
                    part += 1;
                    pending_bytes = 0;
                }
                pending_bytes += len;
                pending.push(r);
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        let last = KeyframeBatch {
            keyframe_id: keyframe_id.to_string(),
            brand_id,
            place_id,
            part,
            records: pending,
            last: true,
            total: digest.count,
            digest: digest.sum,
            as_of,
            command_seq,
            changes_seq,
            first_seq: first_seq.unwrap_or(0),
            tombstone_cutoff,
        };
        let seq = self.publish_keyframe(&subject, last, publisher).await?;
        let first_seq = first_seq.unwrap_or(seq);
        publisher.flush().await?;

        // The marker goes after every earlier change of the place and before
        // any later one: this worker applies nothing in between.
        let mark = ChangeBatch {
            partition,
            command_seq,
            keyframe: Some(KeyframeMark {
                keyframe_id: keyframe_id.to_string(),
                total: digest.count,
                digest: digest.sum,
                as_of,
                tombstone_cutoff,
            }),
            ..Default::default()
        };
        publisher
            .publish(
                self.subjects.changes(brand_id, place_id),
                format!("kfm:{keyframe_id}:{brand_id}:{place_id}:{as_of}"),
                msg_type::CHANGE_BATCH,
                None,
                mark.encode_to_vec().into(),
            )
            .await?;
        publisher.flush().await?;

        let keep = self.settings.storage.keyframes_kept;
        if let Some(oldest_kept) =
            self.store.keyframe_published(partition, brand_id, place_id, first_seq, keep).await?
        {
            let stream = self.js.get_stream(self.subjects.keyframes_stream()).await?;
            if let Err(e) = stream.purge().filter(&subject).sequence(oldest_kept).await {
                warn!(%subject, error = %e, "purging old keyframes failed");
            }
        }
        self.stats.add(&self.stats.keyframe_records, digest.count);
        tracing::debug!(
            brand_id,
            place_id,
            records = digest.count,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "place keyframe published"
        );
        Ok(digest.count)
    }

    async fn publish_keyframe(
        &self,
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
            let ack = self.js.send_publish(subject.to_string(), msg).await?.await?;
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

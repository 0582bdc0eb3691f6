//! Keyframes (DESIGN §4): consistent per-place snapshots, copied by the
//! partition worker between two command messages, so no command of the place
//! is applied in the middle of its snapshot.
//!
//! For each place, in the worker: note where the change stream stands, copy
//! the records (HSCAN) into `KeyframeBatch`es, the last one with the count and
//! digest, and put a `KeyframeMark` on the place's change subject — the exact
//! point in the change stream where a consumer compares its own digest. Then,
//! while the worker goes on with commands, a task publishes the parts and
//! purges keyframes older than the configured number. A replica-wide
//! semaphore (`storage.keyframe_concurrency`) bounds the places in hand, so
//! a keyframe of everything holds back one partition at a time, each for the
//! time of one copy, instead of every partition for the time of its places.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use prost::Message;
use shelfsync_bus::Publisher;
use shelfsync_bus::digest::Digest;
use shelfsync_proto::{ChangeBatch, KeyframeBatch, KeyframeMark, KeyframeReply, Record, msg_type};
use tokio::sync::{Mutex, Semaphore, oneshot};
use tracing::{info, warn};

use crate::worker::Worker;

/// Records read per HSCAN step.
const SCAN_COUNT: usize = 1000;
/// Encoded records of one place held in memory between its copy and its
/// publication; beyond it, parts are published during the copy.
const COPY_MAX_BYTES: usize = 64 * 1024 * 1024;

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

/// What bounds the keyframe work of one replica, shared by its workers:
/// places in hand at once, and records published per second.
pub struct KeyframeLimits {
    pub permits: Arc<Semaphore>,
    pace: Option<Pace>,
}

impl KeyframeLimits {
    /// `concurrency` places at once; `records_per_s` = 0: unpaced.
    pub fn new(concurrency: usize, records_per_s: u64) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(concurrency)),
            pace: (records_per_s > 0).then(|| Pace::new(records_per_s)),
        })
    }

    /// Waits until `records` more may be published.
    pub async fn pace(&self, records: usize) {
        if let Some(p) = &self.pace {
            p.take(records).await;
        }
    }
}

/// Spreads work at a steady rate: each take books its share of time after
/// the previous ones and waits for its turn (no burst beyond one take).
struct Pace {
    per_item: Duration,
    next: std::sync::Mutex<Instant>,
}

impl Pace {
    fn new(per_s: u64) -> Self {
        Self {
            per_item: Duration::from_secs_f64(1.0 / per_s as f64),
            next: std::sync::Mutex::new(Instant::now()),
        }
    }

    async fn take(&self, items: usize) {
        let now = Instant::now();
        let start = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let start = (*next).max(now);
            *next = start + self.per_item * items as u32;
            start
        };
        tokio::time::sleep_until(start.into()).await;
    }
}

/// A keyframe id shared by every replica for one schedule tick or request.
pub fn keyframe_id_at(unix_micros: i64) -> String {
    format!("kf-{unix_micros}")
}

/// A place's snapshot copied out of Redis: the parts not yet published, in
/// order, the last one with the count and digest.
pub(crate) struct PlaceCopy {
    subject: String,
    brand_id: i64,
    place_id: i64,
    parts: Vec<KeyframeBatch>,
    /// Sequence of part 0, once published.
    first_seq: Option<u64>,
    records: u64,
}

impl Worker {
    /// Copies one place's records and puts the keyframe's marker in the
    /// change stream. Runs inside the partition's worker loop, between two
    /// command messages, so the copy and the marker's place in the stream
    /// agree; the parts are published afterwards by [`Worker::publish_copy`],
    /// while the partition goes on. Parts beyond [`COPY_MAX_BYTES`] are
    /// published here, so a huge place cannot fill the memory.
    pub(crate) async fn copy_place(
        &self,
        keyframe_id: &str,
        changes_seq: u64,
        brand_id: i64,
        place_id: i64,
        publisher: &mut Publisher,
    ) -> anyhow::Result<PlaceCopy> {
        let partition = self.partition.0;
        // The outbox is drained after every message, so every change of this
        // place up to `command_seq` is already in the CHANGES stream.
        let command_seq = self.store.applied_seq(partition).await?;
        let as_of = chrono::Utc::now().timestamp_micros();
        let tombstone_cutoff = as_of - self.settings.storage.tombstone_ttl.as_micros() as i64;
        let mut copy = PlaceCopy {
            subject: self.subjects.keyframes(brand_id, place_id),
            brand_id,
            place_id,
            parts: Vec::new(),
            first_seq: None,
            records: 0,
        };
        let part_of = |part: u32, records: Vec<Record>| KeyframeBatch {
            keyframe_id: keyframe_id.to_string(),
            brand_id,
            place_id,
            part,
            records,
            as_of,
            command_seq,
            changes_seq,
            tombstone_cutoff,
            ..Default::default()
        };
        let mut digest = Digest::default();
        let mut seen = HashSet::new();
        let mut pending = Vec::new();
        let mut pending_bytes = 0usize;
        let mut held_bytes = 0usize;
        let mut part = 0u32;
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
                    copy.parts.push(part_of(part, std::mem::take(&mut pending)));
                    part += 1;
                    held_bytes += pending_bytes;
                    pending_bytes = 0;
                    if held_bytes > COPY_MAX_BYTES {
                        self.publish_parts(&mut copy, publisher, false).await?;
                        held_bytes = 0;
                    }
                }
                pending_bytes += len;
                pending.push(r);
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        let mut last = part_of(part, pending);
        last.last = true;
        last.total = digest.count;
        last.digest = digest.sum;
        copy.parts.push(last);
        copy.records = digest.count;
        // Parts published here must be in the stream before later ones,
        // which go through another publisher.
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
        Ok(copy)
    }

    /// Publishes the parts of a copied place, then purges keyframes older
    /// than the configured number. Returns the number of records.
    pub(crate) async fn publish_copy(
        &self,
        mut copy: PlaceCopy,
        publisher: &mut Publisher,
    ) -> anyhow::Result<u64> {
        let started = Instant::now();
        self.publish_parts(&mut copy, publisher, true).await?;
        publisher.flush().await?;
        let first_seq = copy.first_seq.context("a keyframe has at least one part")?;
        let keep = self.settings.storage.keyframes_kept;
        let (partition, brand_id, place_id) = (self.partition.0, copy.brand_id, copy.place_id);
        if let Some(oldest_kept) =
            self.store.keyframe_published(partition, brand_id, place_id, first_seq, keep).await?
        {
            let stream = self.js.get_stream(self.subjects.keyframes_stream()).await?;
            if let Err(e) = stream.purge().filter(&copy.subject).sequence(oldest_kept).await {
                warn!(subject = %copy.subject, error = %e, "purging old keyframes failed");
            }
        }
        self.stats.add(&self.stats.keyframe_records, copy.records);
        tracing::debug!(
            brand_id,
            place_id,
            records = copy.records,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "place keyframe published"
        );
        Ok(copy.records)
    }

    /// Publishes the parts held in `copy`, in order; `paced`: at the
    /// replica's keyframe rate (`storage.keyframe_rate`).
    async fn publish_parts(
        &self,
        copy: &mut PlaceCopy,
        publisher: &mut Publisher,
        paced: bool,
    ) -> anyhow::Result<()> {
        for mut batch in std::mem::take(&mut copy.parts) {
            if paced {
                self.keyframe_limits.pace(batch.records.len()).await;
            }
            // Readers find part 0 from the last part.
            batch.first_seq = copy.first_seq.unwrap_or(0);
            let seq = self.publish_keyframe(&copy.subject, batch, publisher).await?;
            copy.first_seq.get_or_insert(seq);
        }
        Ok(())
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

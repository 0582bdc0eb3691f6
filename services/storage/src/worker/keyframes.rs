//! The partition worker's side of a keyframe: freeze a place between two
//! command messages, publish it from a task, mark it and end the freeze
//! (`crate::keyframe` has the snapshot itself and knows nothing of workers).

use shelfsync_proto::{ChangeBatch, KeyframeBatch, KeyframeMark, Record, msg_type};

use super::*;
use crate::keyframe::*;

impl Worker {
    /// Freezes a place (one Redis step). Runs inside the partition's worker
    /// loop, between two command messages, so the frozen place is the place
    /// exactly after the last applied command.
    pub(crate) async fn freeze(
        &self,
        keyframe_id: &str,
        changes_seq: u64,
        brand_id: i64,
        place_id: i64,
    ) -> anyhow::Result<Frozen> {
        let command_seq =
            self.store.freeze_place(self.partition.0, brand_id, place_id, FROZEN_TTL).await?;
        let as_of = Self::now_us();
        Ok(Frozen {
            keyframe_id: keyframe_id.to_string(),
            changes_seq,
            brand_id,
            place_id,
            command_seq,
            as_of,
            tombstone_cutoff: as_of - self.settings.storage.tombstone_ttl.as_micros() as i64,
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
        let partition = self.partition.0;
        let subject = self.subjects.keyframes(f.brand_id, f.place_id);
        let part_of = |part: u32, records: Vec<Record>, first_seq: Option<u64>| KeyframeBatch {
            keyframe_id: f.keyframe_id.clone(),
            brand_id: f.brand_id,
            place_id: f.place_id,
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
            let (store, b, p) = (io.store.clone(), f.brand_id, f.place_id);
            tokio::spawn(async move {
                store.scan_frozen(partition, b, p, kept, cursor, SCAN_COUNT).await
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
                    && (pending.len() >= 1000 || pending_bytes + len > self.max_bytes)
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

        let keep = self.settings.storage.keyframes_kept;
        if let Some(oldest_kept) =
            io.store.keyframe_published(partition, f.brand_id, f.place_id, first_seq, keep).await?
        {
            let stream = io.js.get_stream(self.subjects.keyframes_stream()).await?;
            if let Err(e) = stream.purge().filter(&subject).sequence(oldest_kept).await {
                warn!(%subject, error = %e, "purging old keyframes failed");
            }
        }
        self.stats.add(&self.stats.keyframe_records, digest.count);
        tracing::debug!(
            brand_id = f.brand_id,
            place_id = f.place_id,
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
        let partition = self.partition.0;
        let records = frozen.count;
        let mut digest = frozen;
        let ids: Vec<String> = changed.iter().cloned().collect();
        for chunk in ids.chunks(MARK_CHUNK) {
            let (then, now) =
                self.store.frozen_and_live(partition, f.brand_id, f.place_id, chunk).await?;
            for ((id, then), now) in chunk.iter().zip(then).zip(now) {
                if let Some(r) = then.filter(|r| f.counts(r)) {
                    digest.remove(id, r.updated_at);
                }
                if let Some(r) = now.filter(|r| f.counts(r)) {
                    digest.add(id, r.updated_at);
                }
            }
        }
        let command_seq = self.store.applied_seq(partition).await?;
        let mark = ChangeBatch {
            partition,
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
                self.subjects.changes(f.brand_id, f.place_id),
                format!("kfm:{}:{}:{}:{}", f.keyframe_id, f.brand_id, f.place_id, f.as_of),
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
        let yielded = self.keyframe_limits.pace(records).await;
        if !yielded.is_zero() {
            self.stats.add(&self.stats.keyframe_yield_us, yielded.as_micros() as u64);
            metrics::histogram!(shelfsync_telemetry::names::KEYFRAME_YIELD_SECONDS)
                .record(yielded.as_secs_f64());
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

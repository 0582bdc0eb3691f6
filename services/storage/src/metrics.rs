//! Everything storage counts, in one place: the process's own counters
//! ([`Stats`], read by tests, `shelfsync stats` and the bench through
//! `/stats`) and the Prometheus metrics (names and descriptions in
//! `shelfsync_telemetry::names`). Each event is recorded by one typed
//! function here, which updates both views, so the two cannot disagree and
//! nothing is counted twice at its call site.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use shelfsync_bus::{Partition, Subjects};
use shelfsync_proto::{CommandBatch, OutboxEntry, Rejection, msg_type};
use shelfsync_service::Drain;
use shelfsync_telemetry::names;

use crate::apply::{Outcome, reason};
use crate::known::Budget;
use crate::store::Store;

#[derive(Debug, Default)]
pub struct Stats {
    /// Command messages committed.
    pub batches: AtomicU64,
    /// Redelivered command messages skipped as already applied.
    pub batches_skipped: AtomicU64,
    /// Command messages read from the stream behind the one delivered and
    /// committed with it (counted in `batches` too); acked unread later.
    pub batches_ahead: AtomicU64,
    pub commands: AtomicU64,
    pub applied: AtomicU64,
    /// Applied commands that changed nothing observable.
    pub unchanged: AtomicU64,
    /// Unchanged commands the partition owner vouched for without reading
    /// Redis (counted in `unchanged` too; `crate::known`).
    pub known_skipped: AtomicU64,
    pub changes: AtomicU64,
    pub rejected: AtomicU64,
    pub sweeps: AtomicU64,
    /// Sweeps whose census scanned their place in Redis (the others were
    /// counted from the live records the owner keeps, `crate::known::live`).
    pub sweep_scans: AtomicU64,
    pub published: AtomicU64,
    /// Payload bytes of the change batches published (the "bytes out").
    pub change_bytes: AtomicU64,
    pub purged: AtomicU64,
    pub retries: AtomicU64,
    pub fenced: AtomicU64,
    /// Times a partition was refused (its command stream replaced).
    pub refused: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Retries of partitions waiting for room (Redis full or away, a stream
    /// refusing the relay): backpressure, nothing set aside.
    pub backpressure_retries: AtomicU64,
    /// Times Redis was found behind a partition owner's last commit.
    pub redis_went_back: AtomicU64,
    /// Places queued for keyframes and not started yet, over the replica.
    pub keyframe_places_queued: AtomicU64,
    pub keyframe_records: AtomicU64,
    /// Time keyframes gave way to late live changes, microseconds.
    pub keyframe_yield_us: AtomicU64,
    /// Longest time one place's keyframe held its partition, microseconds.
    pub keyframe_place_max_us: AtomicU64,
}

impl Stats {
    /// Every counter by name.
    pub fn to_json(&self) -> serde_json::Value {
        let g = Self::get;
        serde_json::json!({
            "batches": g(&self.batches),
            "batches_skipped": g(&self.batches_skipped),
            "batches_ahead": g(&self.batches_ahead),
            "commands": g(&self.commands),
            "applied": g(&self.applied),
            "unchanged": g(&self.unchanged),
            "known_skipped": g(&self.known_skipped),
            "changes": g(&self.changes),
            "rejected": g(&self.rejected),
            "sweeps": g(&self.sweeps),
            "sweep_scans": g(&self.sweep_scans),
            "published": g(&self.published),
            "change_bytes": g(&self.change_bytes),
            "purged": g(&self.purged),
            "retries": g(&self.retries),
            "fenced": g(&self.fenced),
            "refused": g(&self.refused),
            "dead_lettered": g(&self.dead_lettered),
            "backpressure_retries": g(&self.backpressure_retries),
            "redis_went_back": g(&self.redis_went_back),
            "keyframe_records": g(&self.keyframe_records),
            "keyframe_place_max_us": g(&self.keyframe_place_max_us),
            "keyframe_yield_us": g(&self.keyframe_yield_us),
        })
    }
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// The commit path.
impl Stats {
    /// `messages` command messages committed at once, `ahead` of them read
    /// from the stream behind the one delivered.
    pub(crate) fn committed(&self, messages: u64, ahead: u64) {
        add(&self.batches, messages);
        add(&self.batches_ahead, ahead);
    }

    /// A message applied (what went through Redis, `split.rest`, and what
    /// the owner vouched for, `split.skipped`; `n_changes`: its changes,
    /// which the caller may have moved out of `o` already), with the
    /// freshness of its commands at storage.
    pub(crate) fn applied(&self, split: &crate::known::Split, n_changes: u64, o: &Outcome) {
        self.applied_with(&split.rest, split.skipped, &split.skipped_published, n_changes, o);
    }

    /// [`Stats::applied`] of a message every command of which went through
    /// Redis.
    pub(crate) fn applied_batch(&self, batch: &CommandBatch, n_changes: u64, o: &Outcome) {
        self.applied_with(batch, 0, &[], n_changes, o);
    }

    fn applied_with(
        &self,
        batch: &CommandBatch,
        skipped: u64,
        skipped_published: &[i64],
        n_changes: u64,
        o: &Outcome,
    ) {
        add(&self.commands, batch.commands.len() as u64 + skipped);
        add(&self.applied, o.applied);
        add(&self.changes, n_changes);
        add(&self.unchanged, o.unchanged);
        add(&self.rejected, o.rejections.len() as u64);
        counter!(names::COMMANDS_APPLIED).increment(o.applied);
        counter!(names::COMMANDS_UNCHANGED).increment(o.unchanged);
        counter!(names::CHANGES_EMITTED).increment(n_changes);
        let freshness = histogram!(names::FRESHNESS_SECONDS, "stage" => "storage");
        // A command without an origin of its own has its batch's.
        let since = shelfsync_telemetry::seconds_since_us;
        let mut inherited = skipped.saturating_sub(skipped_published.len() as u64);
        for t in skipped_published {
            since(*t).into_iter().for_each(|s| freshness.record(s));
        }
        for c in &batch.commands {
            match &c.origin {
                Some(o) => since(o.published_at).into_iter().for_each(|s| freshness.record(s)),
                None => inherited += 1,
            }
        }
        if let Some(s) = batch.origin.as_ref().and_then(|o| since(o.published_at))
            && inherited > 0
        {
            freshness.record_many(s, inherited as usize);
        }
        rejected(&o.rejections);
    }

    /// Unchanged commands the partition owner vouched for without Redis.
    pub(crate) fn known_skipped(&self, n: u64) {
        add(&self.known_skipped, n);
    }

    /// A redelivered message skipped as already applied.
    pub(crate) fn skipped_redelivery(&self) {
        add(&self.batches_skipped, 1);
    }

    /// A message not applied, to be retried; `fenced`: because another
    /// writer moved the partition.
    pub(crate) fn retried(&self, fenced: bool) {
        add(&self.retries, 1);
        if fenced {
            add(&self.fenced, 1);
        }
    }

    /// Time one command message took, from delivery to ack.
    pub(crate) fn message_took(&self, took: Duration) {
        histogram!(names::BATCH_SECONDS).record(took.as_secs_f64());
    }

    /// Redis replicas did not confirm a commit in time; asked again.
    pub(crate) fn redis_wait_retried(&self) {
        counter!(names::REDIS_WAIT_RETRIES).increment(1);
    }

    /// A message that could not be applied at all, dead-lettered.
    pub(crate) fn dead_lettered(&self, why: &str) {
        add(&self.dead_lettered, 1);
        counter!(names::REJECTS, "reason" => why.to_string()).increment(1);
    }

    /// The partition's command stream was replaced: it applies nothing
    /// (`first`: the first time of this refusal, counted once).
    pub(crate) fn partition_refused(&self, partition: Partition, first: bool) {
        if first {
            add(&self.refused, 1);
        }
        gauge!(names::PARTITION_REFUSED, "partition" => partition.to_string()).set(1.0);
    }

    /// The partition applies again.
    pub(crate) fn partition_resumed(&self, partition: Partition) {
        gauge!(names::PARTITION_REFUSED, "partition" => partition.to_string()).set(0.0);
    }

    /// A partition starts (`on`) or stops waiting for room for `cause`.
    pub(crate) fn backpressure(&self, partition: Partition, cause: &'static str, on: bool) {
        let labels = [("partition", partition.to_string()), ("cause", cause.to_string())];
        gauge!(names::PARTITION_BACKPRESSURE, &labels).set(if on { 1.0 } else { 0.0 });
    }

    /// One retry of a partition waiting for room.
    pub(crate) fn backpressure_retry(&self, cause: &'static str) {
        add(&self.backpressure_retries, 1);
        counter!(names::BACKPRESSURE_RETRIES, "cause" => cause).increment(1);
    }

    /// Redis was found behind a partition owner's last commit.
    pub(crate) fn redis_went_back(&self) {
        add(&self.redis_went_back, 1);
        counter!(names::REDIS_WENT_BACK).increment(1);
    }
}

/// The size of what is kept (bounded, or with an expiry).
pub(crate) fn known_records(noops: usize, live: usize) {
    gauge!(names::KNOWN_RECORDS, "kind" => "noops").set(noops as f64);
    gauge!(names::KNOWN_RECORDS, "kind" => "live").set(live as f64);
}

/// `n` things of `kind` kept (sweep outcomes, touched sets, keyframe places).
pub(crate) fn kept(kind: &'static str, n: u64) {
    gauge!(names::KEPT, "kind" => kind).set(n as f64);
}

/// Sweeps and purges.
impl Stats {
    /// A sweep decided (applied, held or skipped).
    pub(crate) fn sweep_done(&self) {
        add(&self.sweeps, 1);
    }

    /// A sweep's census scanned its place in Redis.
    pub(crate) fn sweep_scanned(&self) {
        add(&self.sweep_scans, 1);
        counter!(names::SWEEP_SCANS).increment(1);
    }

    /// A sweep was applied in full.
    pub(crate) fn sweep_applied(&self) {
        counter!(names::SWEEPS_APPLIED).increment(1);
    }

    /// A sweep was held, and why.
    pub(crate) fn sweep_held(&self, why: &'static str) {
        counter!(names::SWEEPS_HELD, "reason" => why).increment(1);
    }

    /// Changes one step of a sweep committed (records marked absent).
    pub(crate) fn sweep_changes(&self, n: u64) {
        add(&self.changes, n);
        counter!(names::CHANGES_EMITTED).increment(n);
    }

    /// A message of sweeps applied whole.
    pub(crate) fn sweep_message_done(&self) {
        add(&self.batches, 1);
    }

    /// Tombstones past their time removed.
    pub(crate) fn tombstones_purged(&self, n: u64) {
        add(&self.purged, n);
    }

    /// Absent records past `absent_ttl` deleted (each a change).
    pub(crate) fn absent_purged(&self, n: u64) {
        add(&self.changes, n);
        counter!(names::ABSENT_PURGED).increment(n);
        counter!(names::CHANGES_EMITTED).increment(n);
    }
}

/// Keyframes.
impl Stats {
    /// How long one place's keyframe held its partition (the longest kept).
    pub(crate) fn keyframe_place_held(&self, took: Duration) {
        self.keyframe_place_max_us.fetch_max(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// Records a keyframe published.
    pub(crate) fn keyframe_records(&self, n: u64) {
        add(&self.keyframe_records, n);
    }

    /// Time a keyframe gave way to late live changes.
    pub(crate) fn keyframe_yielded(&self, yielded: Duration) {
        add(&self.keyframe_yield_us, yielded.as_micros() as u64);
        histogram!(names::KEYFRAME_YIELD_SECONDS).record(yielded.as_secs_f64());
    }

    /// Time one place's keyframe took, freeze to published.
    pub(crate) fn keyframe_took(&self, took: Duration) {
        histogram!(names::KEYFRAME_SECONDS).record(took.as_secs_f64());
    }
}

/// The outbox and its relay.
impl Stats {
    /// Outbox entries published and trimmed; `again` of them JetStream
    /// already had (a duplicate after a crash).
    pub(crate) fn relayed(&self, entries: &[OutboxEntry], again: u64) {
        if again > 0 {
            counter!(names::OUTBOX_ALREADY_STORED).increment(again);
        }
        add(&self.published, entries.len() as u64);
        let change_bytes: usize = entries
            .iter()
            .filter(|e| e.msg_type == msg_type::CHANGE_BATCH)
            .map(|e| e.payload.len())
            .sum();
        add(&self.change_bytes, change_bytes as u64);
    }

    /// A too-large outbox entry published as smaller pieces.
    pub(crate) fn outbox_reduced(&self) {
        counter!(names::OUTBOX_REDUCED).increment(1);
    }

    /// An outbox entry that cannot be published, kept aside.
    pub(crate) fn outbox_unpublishable(&self, reason: &'static str) {
        counter!(names::OUTBOX_UNPUBLISHABLE, "reason" => reason).increment(1);
    }
}

/// Gauges set by the periodic probe of the owned partitions.
pub(crate) fn consumer_lag(consumer: String, lag: u64) {
    gauge!(names::CONSUMER_LAG, "consumer" => consumer).set(lag as f64);
}

pub(crate) fn outbox_depth(depth: u64) {
    gauge!(names::OUTBOX_DEPTH).set(depth as f64);
}

/// How often the consumer lag and outbox depth gauges are sampled.
const GAUGE_EVERY: Duration = Duration::from_secs(5);

/// What the gauges of the owned partitions are sampled from: their
/// consumers, their outboxes and what is kept.
pub(crate) struct GaugeSampler {
    pub js: async_nats::jetstream::Context,
    pub store: Store,
    pub subjects: Subjects,
    pub owned: Vec<u32>,
    /// The budgets of the known records (no-ops, live).
    pub known: (Budget, Budget),
    pub stats: Arc<Stats>,
    pub replica: u32,
    /// This process's id, in its consumers' names.
    pub instance: String,
}

impl GaugeSampler {
    /// Samples `shelfsync_consumer_lag{consumer}` (messages the partition
    /// consumers have not received yet), `shelfsync_outbox_depth` and the
    /// size of what is kept (`shelfsync_known_records`, `shelfsync_kept`)
    /// every few seconds until `stop` starts.
    pub(crate) async fn run(self, stop: Drain) {
        let mut tick = tokio::time::interval(GAUGE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.started() => return,
            }
            self.sample().await;
        }
    }

    async fn sample(&self) {
        let GaugeSampler { js, store, subjects, owned, known: (noops, live), stats, .. } = self;
        if let Ok(stream) = js.get_stream(subjects.cmd_stream()).await {
            for &p in owned {
                let consumer = subjects.storage_consumer_of(Partition(p), self.replica);
                let name = format!("{consumer}-{}", self.instance);
                if let Ok(info) = stream.consumer_info(&name).await {
                    let lag = info.num_pending + info.num_ack_pending as u64;
                    consumer_lag(name, lag);
                }
            }
        }
        let (mut depth, mut swept, mut touched) = (0u64, 0u64, 0u64);
        for &p in owned {
            depth += store.outbox_len(Partition(p)).await.unwrap_or(0);
            if let Ok((s, t)) = store.kept(Partition(p)).await {
                (swept, touched) = (swept + s, touched + t);
            }
        }
        outbox_depth(depth);
        known_records(noops.used(), live.used());
        kept("sweep_outcomes", swept);
        kept("touched_sets", touched);
        kept("keyframe_places_queued", Stats::get(&stats.keyframe_places_queued));
    }
}

/// Rejected commands, by reason (compare-and-swap conflicts also apart).
fn rejected(rejections: &[Rejection]) {
    for r in rejections {
        if r.reason == reason::CONFLICT {
            counter!(names::CAS_CONFLICTS).increment(1);
        }
        counter!(names::REJECTS, "reason" => r.reason.clone()).increment(1);
    }
}

//! Scenarios 4 and 5: freshness at a fixed offered rate, and keyframes of every record — idle,
//! then under that live load.
//!
//! The load generator (`load.rs`) plays the producers of live changes: every tick it hands the
//! PATCHes due at the offered rate (a new price for a random record, so each one is a real
//! change) to the kit's command publisher, with `Origin.published_at` set when they are handed
//! over. A ChangeFeed consumer bootstrapped from
//! the idle keyframe feeds the recommender's own index handler, timed around it: "arrival" is
//! when the kit hands the change to the handler, "indexed" when the index holds it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shelfsync_feed::{ChangeFeed, FeedConfig, FeedStatus, Handler, HandlerError, Update};
use shelfsync_recommender::{IndexHandler, SharedIndex};
use tokio::sync::oneshot;

use crate::children::Target;
use crate::load::{LOAD_SOURCE, Load, now_us};
use crate::measure;
use crate::report::{CpuCores, FreshnessRun, KeyframeRun, Report};
use crate::stats::Percentiles;
use crate::world::{BRAND, World};

/// One timed change: when it was published, applied by storage (the record's
/// `updated_at`), reached the handler, was in the index (µs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    /// The load's run (its changes' import id is `live-<run>`): a change of
    /// an earlier run still on its way counts for none of the later ones.
    run: Option<u64>,
    pub(crate) published: i64,
    applied: i64,
    arrived: i64,
    pub(crate) indexed: i64,
}

/// The recommender's index handler with a stopwatch around it.
struct TimedIndex {
    inner: IndexHandler,
    samples: Arc<Mutex<Vec<Sample>>>,
}

impl Handler for TimedIndex {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        let arrived = now_us();
        self.inner.apply(updates).await?;
        let indexed = now_us();
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        for u in updates {
            if let Some(o) = u.origin.as_ref().filter(|o| o.source == LOAD_SOURCE) {
                samples.push(Sample {
                    run: o.import_id.strip_prefix("live-").and_then(|r| r.parse().ok()),
                    published: o.published_at,
                    applied: u.after.updated_at,
                    arrived,
                    indexed,
                });
            }
        }
        Ok(())
    }

    async fn reset_place(&mut self, place: shelfsync_feed::PlaceKey) -> Result<(), HandlerError> {
        self.inner.reset_place(place).await
    }
}

/// A ChangeFeed consumer running in this process.
pub struct Consumer {
    pub status: Arc<FeedStatus>,
    pub index: SharedIndex,
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), shelfsync_feed::FeedError>>,
}

impl Consumer {
    /// Starts the feed (keyframe bootstrap) and waits until it is live; returns it and how long
    /// the bootstrap took.
    pub async fn start(world: &World, storage: &Target) -> anyhow::Result<(Consumer, Duration)> {
        let mut cfg = FeedConfig::new("bench-live");
        cfg.max_ack_pending = 1000;
        cfg.keyframe_responders = storage.settings.storage.replicas;
        let mut feed = ChangeFeed::new(world.client.clone(), &storage.settings.nats, cfg);
        let status = feed.status();
        let index = SharedIndex::default();
        let samples = Arc::new(Mutex::new(Vec::new()));
        let mut handler =
            TimedIndex { inner: IndexHandler::new(index.clone()), samples: samples.clone() };
        let (stop, stopped) = oneshot::channel::<()>();
        let started = Instant::now();
        let task = tokio::spawn(async move {
            feed.run(&mut handler, async move {
                let _ = stopped.await;
            })
            .await
        });
        let consumer = Consumer { status, index, samples, stop: Some(stop), task };
        while !consumer.status.bootstrapped.load(std::sync::atomic::Ordering::SeqCst) {
            if consumer.task.is_finished() {
                bail!("the change feed stopped during its bootstrap");
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!("the change feed did not bootstrap within 10 minutes");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok((consumer, started.elapsed()))
    }

    /// The samples of `run`; those of other runs are dropped.
    fn take_samples(&self, run: u64) -> Vec<Sample> {
        let all = std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()));
        all.into_iter().filter(|s| s.run == Some(run)).collect()
    }

    fn sample_count(&self, run: u64) -> usize {
        self.samples.lock().map_or(0, |s| s.iter().filter(|s| s.run == Some(run)).count())
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
        self.task.abort();
    }
}

/// Asks storage for a keyframe of every place and waits for it.
pub async fn keyframe(world: &World, storage: &Target, label: &str) -> anyhow::Result<KeyframeRun> {
    let cpu_before = storage.cpu_seconds();
    let max_place_before = storage_stat(world, storage, "keyframe_place_max_us").await;
    let yield_before = storage_stat(world, storage, "keyframe_yield_us").await;
    let started = Instant::now();
    let replies = shelfsync_bus::request_keyframe(
        &world.client,
        &storage.subjects(),
        None,
        storage.settings.storage.replicas,
        Duration::from_secs(1800),
    )
    .await
    .map_err(|e| anyhow::anyhow!("keyframe request: {e}"))?;
    let duration_s = started.elapsed().as_secs_f64();
    let reply = replies.first().context("no keyframe reply")?;
    if !reply.error.is_empty() {
        bail!("keyframe failed: {}", reply.error);
    }
    let max_place_after = storage_stat(world, storage, "keyframe_place_max_us").await;
    let yield_after = storage_stat(world, storage, "keyframe_yield_us").await;
    Ok(KeyframeRun {
        longest_place_ms: (max_place_after > max_place_before)
            .then_some(max_place_after as f64 / 1e3),
        gave_way_s: yield_after.saturating_sub(yield_before) as f64 / 1e6,
        label: label.into(),
        places: reply.places,
        records: reply.records,
        duration_s,
        records_per_s: reply.records as f64 / duration_s,
        storage_cpu_s: storage.cpu_seconds() - cpu_before,
        live_p99_ms: None,
        live_baseline_p99_ms: None,
    })
}

/// A keyframe of every place, requested one place at a time.
async fn keyframe_place_by_place(world: &World, storage: &Target) -> anyhow::Result<KeyframeRun> {
    let cpu_before = storage.cpu_seconds();
    let yield_before = storage_stat(world, storage, "keyframe_yield_us").await;
    let started = Instant::now();
    let (mut records, mut places, mut longest) = (0u64, 0u32, 0f64);
    for place in 1..=i64::from(world.profile.places) {
        let one = Instant::now();
        let replies = shelfsync_bus::request_keyframe(
            &world.client,
            &storage.subjects(),
            Some(shelfsync_proto::PlaceKey::new(BRAND, place)),
            1,
            Duration::from_secs(600),
        )
        .await
        .map_err(|e| anyhow::anyhow!("keyframe request: {e}"))?;
        let reply = replies.first().context("no keyframe reply")?;
        if !reply.error.is_empty() {
            bail!("keyframe of place {place} failed: {}", reply.error);
        }
        longest = longest.max(one.elapsed().as_secs_f64() * 1e3);
        records += reply.records;
        places += reply.places;
    }
    let duration_s = started.elapsed().as_secs_f64();
    Ok(KeyframeRun {
        label: "same, one place at a time (on-demand API)".into(),
        places,
        records,
        duration_s,
        records_per_s: records as f64 / duration_s,
        storage_cpu_s: storage.cpu_seconds() - cpu_before,
        longest_place_ms: Some(longest),
        gave_way_s: storage_stat(world, storage, "keyframe_yield_us")
            .await
            .saturating_sub(yield_before) as f64
            / 1e6,
        live_p99_ms: None,
        live_baseline_p99_ms: None,
    })
}

/// One of storage's counters (`/stats`; 0 when it cannot be read).
async fn storage_stat(world: &World, storage: &Target, name: &str) -> u64 {
    let stats = storage.stats(world).await.unwrap_or_default();
    stats.get(name).and_then(serde_json::Value::as_u64).unwrap_or(0)
}

/// Keyframe idle, the consumer's bootstrap, freshness without a keyframe, and (with
/// `keyframe_under_load`) a keyframe under the same live load.
pub async fn run(
    world: &World,
    storage: &Target,
    keyframe_under_load: bool,
    report: &mut Report,
) -> anyhow::Result<()> {
    let p = &world.profile;
    let idle = keyframe(world, storage, "idle").await?;
    eprintln!("[bench] keyframe idle: {} records in {:.1} s", idle.records, idle.duration_s);
    report.keyframes.push(idle);

    let (consumer, bootstrap) = Consumer::start(world, storage).await?;
    eprintln!(
        "[bench] change feed bootstrapped in {bootstrap:.1?} ({} offers indexed)",
        consumer.index.read().len()
    );
    report.feed_bootstrap_s = Some(bootstrap.as_secs_f64());

    // Without a keyframe.
    let started = now_us();
    let load = Load::start(world, storage, p.fresh_rate, 1);
    tokio::time::sleep(p.fresh_run / 4).await;
    let cpu = CpuSnapshot::take(world, storage);
    tokio::time::sleep(p.fresh_run - p.fresh_run / 4).await;
    let cpu = cpu.cores_since(world, storage);
    let sent = load.stop().await?;
    let ended = now_us();
    let samples = drain(&consumer, sent, 1).await;
    let warmup = (p.fresh_run.as_micros() as i64 / 4).min(1_000_000);
    let mut baseline = freshness(
        "without a keyframe",
        p.fresh_rate,
        sent,
        &samples,
        started + warmup,
        ended,
        started,
    );
    eprintln!(
        "[bench] freshness: {} (applied by storage: {}); CPU {}",
        baseline.indexed.render(),
        baseline.applied.render(),
        cpu.render()
    );
    baseline.cpu_cores = Some(cpu);
    let baseline_p99 = baseline.indexed.p99;
    report.freshness.push(baseline);

    if keyframe_under_load {
        let started = now_us();
        let load = Load::start(world, storage, p.fresh_rate, 2);
        tokio::time::sleep(p.keyframe_margin).await;
        let kf_start = now_us();
        let cpu = CpuSnapshot::take(world, storage);
        let run = keyframe(world, storage, &format!("under {} changes/s", p.fresh_rate)).await;
        let cpu = cpu.cores_since(world, storage);
        let kf_end = now_us();
        tokio::time::sleep(p.keyframe_margin).await;
        let sent = load.stop().await?;
        let mut run = run?;
        let samples = drain(&consumer, sent, 2).await;
        // Every sample (publish time, latency, µs) for a look at when the
        // slow ones happened (docs/PERFORMANCE.md, "Reproduce").
        if let Ok(path) = std::env::var("SHELFSYNC_BENCH_DUMP") {
            let mut out = format!("kf_start {kf_start} kf_end {kf_end}\n");
            for s in &samples {
                out.push_str(&format!(
                    "{} {} {}\n",
                    s.published,
                    s.indexed - s.published,
                    s.applied - s.published
                ));
            }
            let _ = std::fs::write(path, out);
        }
        let mut during =
            freshness("during a keyframe", p.fresh_rate, sent, &samples, kf_start, kf_end, started);
        eprintln!(
            "[bench] keyframe under load: {:.1} s, gave way {:.1} s; freshness during it: {} \
             (applied by storage: {}); CPU {}",
            run.duration_s,
            run.gave_way_s,
            during.indexed.render(),
            during.applied.render(),
            cpu.render()
        );
        during.cpu_cores = Some(cpu);
        run.live_p99_ms = Some(during.indexed.p99);
        run.live_baseline_p99_ms = Some(baseline_p99);
        report.keyframes.push(run);
        report.freshness.push(during);

        // The same records, one place per request (the on-demand API): what storage would do
        // with at most one place snapshot at a time per replica. An experiment, not a target.
        let started = now_us();
        let load = Load::start(world, storage, p.fresh_rate, 4);
        tokio::time::sleep(p.keyframe_margin).await;
        let kf_start = now_us();
        let run = keyframe_place_by_place(world, storage).await;
        let kf_end = now_us();
        tokio::time::sleep(p.keyframe_margin).await;
        let sent = load.stop().await?;
        let mut run = run?;
        let samples = drain(&consumer, sent, 4).await;
        let during = freshness(
            "during a place-by-place keyframe",
            p.fresh_rate,
            sent,
            &samples,
            kf_start,
            kf_end,
            started,
        );
        eprintln!(
            "[bench] keyframe place by place under load: {:.1} s; freshness during it: {}",
            run.duration_s,
            during.indexed.render()
        );
        run.live_p99_ms = Some(during.indexed.p99);
        run.live_baseline_p99_ms = Some(baseline_p99);
        report.keyframes.push(run);
        report.freshness.push(during);
    }
    let drift = shelfsync_feed::FeedStatus::get(&consumer.status.drift_repairs);
    let checks = shelfsync_feed::FeedStatus::get(&consumer.status.keyframe_checks);
    report.notes.push(format!(
        "ChangeFeed consumer: {checks} keyframe digest checks, {drift} drift repairs (0 expected)."
    ));
    consumer.stop().await;
    Ok(())
}

/// CPU seconds of the processes sharing the machine, at one instant.
pub(crate) struct CpuSnapshot {
    at: Instant,
    cpu: CpuCores,
}

impl CpuSnapshot {
    pub(crate) fn take(world: &World, storage: &Target) -> Self {
        let of = |pid: Option<u32>| pid.and_then(measure::cpu_seconds).unwrap_or(0.0);
        Self {
            at: Instant::now(),
            cpu: CpuCores {
                storage: storage.cpu_seconds(),
                nats: world.nats_cpu().unwrap_or(0.0),
                redis: of(world.redis.pid()),
                harness: measure::self_cpu_seconds(),
            },
        }
    }

    /// Cores each process used on average since the snapshot.
    pub(crate) fn cores_since(self, world: &World, storage: &Target) -> CpuCores {
        let now = Self::take(world, storage);
        let s = now.at.duration_since(self.at).as_secs_f64().max(1e-9);
        CpuCores {
            storage: (now.cpu.storage - self.cpu.storage) / s,
            nats: (now.cpu.nats - self.cpu.nats) / s,
            redis: (now.cpu.redis - self.cpu.redis) / s,
            harness: (now.cpu.harness - self.cpu.harness) / s,
        }
    }
}

/// Waits (at most 60 s) until every published change was timed; returns the samples.
pub(crate) async fn drain(consumer: &Consumer, sent: u64, run: u64) -> Vec<Sample> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while (consumer.sample_count(run) as u64) < sent && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    consumer.take_samples(run)
}

/// Latencies of the samples published in `[from, to]` µs.
pub(crate) fn freshness(
    label: &str,
    rate: u64,
    sent: u64,
    samples: &[Sample],
    from: i64,
    to: i64,
    load_started: i64,
) -> FreshnessRun {
    let window: Vec<&Sample> =
        samples.iter().filter(|s| (from..=to).contains(&s.published)).collect();
    let ms =
        |f: fn(&Sample) -> i64| -> Vec<f64> { window.iter().map(|s| f(s) as f64 / 1e3).collect() };
    let load_s = (to.max(from) - load_started) as f64 / 1e6;
    FreshnessRun {
        label: label.into(),
        offered_per_s: rate as f64,
        published: sent,
        received: samples.len() as u64,
        window_s: (to - from) as f64 / 1e6,
        load_s,
        applied: Percentiles::of(ms(|s| s.applied - s.published), "ms"),
        arrival: Percentiles::of(ms(|s| s.arrived - s.published), "ms"),
        indexed: Percentiles::of(ms(|s| s.indexed - s.published), "ms"),
        cpu_cores: None,
        drained_after_s: None,
        cpu_s_per_1k: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freshness_splits_each_sample_where_storage_applied_it() {
        // Published at t, applied 2 ms later, handed over 5 ms after, indexed 1 ms after that.
        let at = |t: i64| Sample {
            run: Some(1),
            published: t,
            applied: t + 2_000,
            arrived: t + 7_000,
            indexed: t + 8_000,
        };
        let mut samples: Vec<Sample> = (0..100).map(|i| at(1_000_000 + i * 1_000)).collect();
        // Outside the window: not counted.
        samples.push(Sample { published: 5_000_000, applied: 5_900_000, ..at(5_000_000) });
        let run = freshness("t", 5000, 101, &samples, 1_000_000, 1_099_000, 0);
        assert_eq!(run.applied.samples, 100);
        assert_eq!((run.applied.p50, run.applied.max), (2.0, 2.0));
        assert_eq!((run.arrival.p99, run.indexed.p99), (7.0, 8.0));
        assert_eq!(run.received, 101, "every sample received, in the window or not");
    }
}

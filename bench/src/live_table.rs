//! The live path's table: live changes (single-offer PATCHes spread over `live_places` places ×
//! `live_items` offers and the 64 command partitions) offered at fixed rates, sent the two ways
//! producers send ([`Mode`]: through the kit's coalescing command publisher, or one command per
//! raw JetStream publish), each timed from publish to the change in a ChangeFeed consumer's
//! index; then the ceiling: the offered rate stepped up through the kit until p99 passes 100 ms
//! or a backlog remains. Each row says what was published and delivered, p50/p99, how long after
//! the load stopped the last change arrived, and the CPU each process spent per 1000 changes.
//! The servers are those of the run (durable unless `--volatile`).

use std::time::Duration;

use crate::children::Target;
use crate::live::{Consumer, CpuSnapshot, drain, freshness};
use crate::load::{Load, Mode, Spec, now_us};
use crate::report::{FreshnessRun, Report, TargetCheck};
use crate::stats::fmt_num;
use crate::world::World;

/// A ceiling step holds when its p99 stays within this (ms)…
pub const CEILING_P99_MS: f64 = 100.0;
/// … and the backlog is gone this soon after the load stops (s).
pub const CEILING_DRAIN_S: f64 = 1.0;

pub async fn run(world: &World, storage: &Target, report: &mut Report) -> anyhow::Result<()> {
    let p = &world.profile;
    report.live_store_floor = Some(crate::store_floor::measure(world).await?);
    let (consumer, _) = Consumer::start(world, storage).await?;
    let (places, items) = (p.live_places, p.live_items);
    let mut run_id = 100;
    for (mode, rates) in [(Mode::Kit, &p.live_rates_kit), (Mode::Single, &p.live_rates_single)] {
        for &rate in rates {
            run_id += 1;
            let spec = Spec { rate, mode, places, items };
            let row = measure(world, storage, &consumer, spec, p.live_run, run_id).await?;
            report.live.push(row);
        }
    }
    for &rate in &p.ceiling_rates {
        run_id += 1;
        let spec = Spec { rate, mode: Mode::Kit, places, items };
        let mut row = measure(world, storage, &consumer, spec, p.ceiling_hold, run_id).await?;
        row.label = format!("ceiling step: {}", row.label);
        let held = holds(&row);
        report.live.push(row);
        if !held {
            break;
        }
        report.live_ceiling_per_s = Some(rate as f64);
    }
    consumer.stop().await;
    Ok(())
}

/// Whether a row kept up: every change delivered, p99 within [`CEILING_P99_MS`], drained within
/// [`CEILING_DRAIN_S`].
pub fn holds(row: &FreshnessRun) -> bool {
    row.received >= row.published
        && row.indexed.p99 <= CEILING_P99_MS
        && row.drained_after_s.is_some_and(|s| s <= CEILING_DRAIN_S)
}

async fn measure(
    world: &World,
    storage: &Target,
    consumer: &Consumer,
    spec: Spec,
    length: Duration,
    run_id: u64,
) -> anyhow::Result<FreshnessRun> {
    let label = format!("{}, {}/s", spec.mode.name(), spec.rate);
    let started = now_us();
    let cpu = CpuSnapshot::take(world, storage);
    let load = Load::start_spec(world, storage, spec, run_id);
    tokio::time::sleep(length).await;
    let ended = now_us();
    let sent = load.stop().await?;
    let samples = drain(consumer, sent, run_id).await;
    let cpu = cpu.cores_since(world, storage);
    let warmup = (length.as_micros() as i64 / 4).min(1_000_000);
    let mut row = freshness(&label, spec.rate, sent, &samples, started + warmup, ended, started);
    row.drained_after_s =
        samples.iter().map(|s| s.indexed).max().map(|last| (last - ended).max(0) as f64 / 1e6);
    // CPU seconds per 1000 changes: cores over the window (load and drain) × its length / sent.
    let window_s = (now_us() - started) as f64 / 1e6;
    let per_1k = |cores: f64| if sent == 0 { 0.0 } else { cores * window_s * 1000.0 / sent as f64 };
    row.cpu_s_per_1k = Some(crate::report::CpuCores {
        storage: per_1k(cpu.storage),
        nats: per_1k(cpu.nats),
        redis: per_1k(cpu.redis),
        harness: per_1k(cpu.harness),
    });
    row.cpu_cores = Some(cpu);
    eprintln!(
        "[bench] live {label}: {} of {} delivered, {}, drained {:.2} s after",
        row.received,
        row.published,
        row.indexed.render(),
        row.drained_after_s.unwrap_or(f64::NAN)
    );
    Ok(row)
}

impl Report {
    /// The live table, the ceiling and the PostgreSQL peer's, as markdown.
    pub(crate) fn md_live_table(&self, md: &mut String) {
        use std::fmt::Write;
        if self.live.is_empty() && self.postgres_live.is_none() {
            return;
        }
        let _ = writeln!(
            md,
            "### Live path: publish → ChangeFeed consumer ({} servers, {} places)\n\n\
             | run | offered /s | delivered / published | p50 ms | p99 ms | drained after s | CPU s per 1k changes: storage / nats / redis / harness |\n\
             |---|---:|---:|---:|---:|---:|---|",
            self.durability_word(),
            self.live_places,
        );
        let peer = self.postgres_live.as_ref();
        let rows =
            self.live.iter().chain(peer.into_iter().flat_map(|p| p.probe.iter().chain(&p.rows)));
        for r in rows {
            let cpu = r.cpu_s_per_1k.as_ref().map_or("—".to_string(), |c| {
                format!("{:.3} / {:.3} / {:.3} / {:.3}", c.storage, c.nats, c.redis, c.harness)
            });
            let _ = writeln!(
                md,
                "| {} | {} | {} / {} | {} | {} | {} | {cpu} |",
                r.label,
                fmt_num(r.offered_per_s),
                r.received,
                r.published,
                fmt_num(r.indexed.p50),
                fmt_num(r.indexed.p99),
                r.drained_after_s.map_or("—".into(), |s| format!("{s:.2}")),
            );
        }
        let ceiling = |c: Option<f64>| {
            c.map_or("below the first step".to_string(), |c| format!("{} /s", fmt_num(c)))
        };
        let _ = writeln!(
            md,
            "\nCeiling (highest step held: every change delivered, p99 ≤ {CEILING_P99_MS} ms, \
             drained within {CEILING_DRAIN_S} s): shelfsync through the kit {}; PostgreSQL {}{}. \
             PostgreSQL: each change its own transaction (upsert where distinct + outbox \
             insert), submit → commit.\n",
            ceiling(self.live_ceiling_per_s),
            peer.map_or("not run".into(), |p| ceiling(p.ceiling_per_s)),
            peer.map_or(String::new(), |p| format!(" ({} connections)", p.connections)),
        );
        if let Some(f) = &self.live_store_floor {
            let _ = writeln!(
                md,
                "What this NATS stores, one stream, {} messages over {} subjects: {} msgs/s as \
                 separate publishes ({} in flight), {} msgs/s as atomic batches of {}. Each \
                 place changed in a commit round is one change message, so on a server that \
                 fsyncs every write this bounds the live path.\n",
                f.messages,
                f.subjects,
                fmt_num(f.separate_per_s),
                f.in_flight,
                fmt_num(f.atomic_per_s),
                f.batch
            );
        }
    }

    /// The live targets: p99 at 5,000/s through the kit, p99 at 2,000/s one command per
    /// message, the ceiling, and both against the PostgreSQL peer.
    pub(crate) fn live_targets(&self) -> Vec<TargetCheck> {
        let mut out = Vec::new();
        if self.live.is_empty() {
            return out;
        }
        let row = |mode: Mode, rate: f64| {
            self.live.iter().find(|r| r.label.starts_with(mode.name()) && r.offered_per_s == rate)
        };
        let mut push = |target: &str, measured: String, holds: Option<bool>| {
            out.push(TargetCheck { target: target.into(), measured, holds })
        };
        let describe = |r: &FreshnessRun| {
            format!(
                "p50 {} ms, p99 {} ms, {} of {} delivered, drained {} s after",
                fmt_num(r.indexed.p50),
                fmt_num(r.indexed.p99),
                r.received,
                r.published,
                r.drained_after_s.map_or("—".into(), |s| format!("{s:.2}"))
            )
        };
        let kit = row(Mode::Kit, 5000.0);
        match kit {
            Some(r) => push(
                "live 5,000/s through the kit: p99 < 50 ms, p50 < 15 ms, drained within 1 s",
                describe(r),
                Some(
                    r.indexed.p99 < 50.0
                        && r.indexed.p50 < 15.0
                        && r.received >= r.published
                        && r.drained_after_s.is_some_and(|s| s <= 1.0),
                ),
            ),
            None => push("live 5,000/s through the kit", "not measured".into(), None),
        }
        match row(Mode::Single, 2000.0) {
            Some(r) => push(
                "live 2,000/s one command per message: p99 < 100 ms",
                describe(r),
                Some(r.indexed.p99 < 100.0 && r.received >= r.published),
            ),
            None => push("live 2,000/s one command per message", "not measured".into(), None),
        }
        let ceiling = self.live_ceiling_per_s.unwrap_or(0.0);
        push(
            "live ceiling ≥ 20,000/s (through the kit)",
            format!("{} /s", fmt_num(ceiling)),
            Some(ceiling >= 20_000.0),
        );
        if let Some(pg) = &self.postgres_live {
            let pg_ceiling = pg.ceiling_per_s.unwrap_or(0.0);
            push(
                "live ceiling ≥ 2× PostgreSQL's",
                format!("{} /s vs {} /s", fmt_num(ceiling), fmt_num(pg_ceiling)),
                Some(pg_ceiling > 0.0 && ceiling >= 2.0 * pg_ceiling),
            );
            let kept = format!(", {} connections,", pg.connections);
            let pg_top = pg.probe.iter().find(|r| r.label.contains(&kept));
            if let (Some(k), Some(p)) = (kit, pg_top) {
                push(
                    "live p99 at 5,000/s (kit) ≤ PostgreSQL's",
                    format!("{} ms vs {} ms", fmt_num(k.indexed.p99), fmt_num(p.indexed.p99)),
                    Some(k.indexed.p99 <= p.indexed.p99),
                );
            }
        }
        out
    }
}

//! The shelfsync benchmark harness (docs/DESIGN.md, Performance targets): starts its own
//! nats-server and redis-server on loopback, generates feeds with gen-feed's generator, and in one
//! run measures every scenario next to its references, so every figure is a ratio against
//! something measured on the same machine, minutes apart.
//!
//! - `cli` / `profile`: the command line and the sizes of `--quick` and the full run;
//! - `world`: the servers, settings per system (prefix, namespace, Redis db), stream helpers;
//! - `children`: the processes under test — storage, the floor, the naive loop, an import —
//!   each a child of this binary (or a given storage binary), so its CPU and RSS are its own;
//! - `roles`: what those children run (storage is `shelfsync_storage::App` exactly as
//!   `shelfsync-storage`'s `main` runs it);
//! - `reference`: the floor (consume + batched Redis read + generation write, no logic) and the
//!   naive way (rewrite and republish every record);
//! - scenarios: `reimport` (1–3, 8), `live` (4, 5: freshness and keyframes), `rss` (6),
//!   `recommender` (7), `live_table` (the live path: rates × producers, the ceiling; `load` is
//!   its load generator, `store_floor` what the run's NATS stores per second);
//! - next to the re-imports: `parse_floor` (ingest's parser alone) and `postgres`, the same
//!   dumps into a private PostgreSQL (offers table and outbox, change detection in SQL);
//! - `measure`: `/proc` CPU and RSS, Redis `INFO`; `stats`: percentiles; `http`: a tiny client
//!   and the keep-alive load loop; `report`: the table, `bench.json`, `bench.md`, the targets.
//!
//! It owns its servers, work dir and output dir; it never touches servers on the default ports.
//! Its servers are durable (Redis fsyncs its AOF on every write, JetStream every write,
//! PostgreSQL keeps `fsync` and `synchronous_commit` on), unless `--volatile`; with
//! `--nats-cluster` NATS is three nodes with R3 streams and its default sync, as in prod.
//! Times are never asserted on: the harness reports, CI only checks that it runs.
#![forbid(unsafe_code)]

mod children;
mod cli;
mod feeds;
mod http;
mod live;
mod live_table;
mod load;
mod measure;
mod parse_floor;
mod postgres;
mod profile;
mod recommender;
mod reference;
mod reimport;
mod report;
mod roles;
mod rss;
mod stats;
mod store_floor;
mod world;

use std::time::Instant;

use anyhow::Context;

pub use cli::{ChildRole, Cli, Scenario};

use crate::report::Report;
use crate::world::World;

/// Runs the harness, or one child role of it.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(role) = cli.child {
        return roles::run(role).await;
    }
    let started = Instant::now();
    let profile = profile::Profile::new(cli.quick, cli.records);
    let wants = |s: Scenario| cli.only.is_empty() || cli.only.contains(&s);
    let work = match &cli.work_dir {
        Some(dir) => dir.clone(),
        None => world::default_work_dir()?,
    };
    std::fs::create_dir_all(&cli.out)
        .with_context(|| format!("creating the output dir {}", cli.out.display()))?;
    let world =
        World::start(profile.clone(), work.clone(), !cli.volatile, cli.nats_cluster).await?;
    let mut report = Report::new(&profile, &world).await;
    eprintln!(
        "[bench] profile {}: {} records in {} places; nats {} redis {}; work dir {}",
        profile.name,
        profile.records(),
        profile.places,
        world.nats.url(),
        world.redis.url(),
        work.display()
    );

    let needs_data = [
        Scenario::Reimport,
        Scenario::Memory,
        Scenario::Freshness,
        Scenario::Keyframe,
        Scenario::Recommender,
        Scenario::Live,
    ]
    .into_iter()
    .any(wants);
    let scenarios = async {
        if needs_data {
            let feeds = feeds::Feeds::generate(&profile, &work).await?;
            let storage =
                children::Target::start_storage(&world, "bs", cli.storage_bin.as_deref()).await?;
            reimport::run(&world, &storage, &feeds, wants(Scenario::Reimport), &mut report).await?;
            if wants(Scenario::Reimport) {
                report.parse_floor = Some(parse_floor::measure(&feeds.base).await?);
                if !cli.no_postgres {
                    let connections: Vec<usize> =
                        cli.postgres_connections.iter().map(|&n| usize::from(n)).collect();
                    postgres::run(&world, &feeds, &connections, &mut report).await?;
                }
            }
            if !wants(Scenario::Memory) {
                report.redis_memory = None;
            }
            feeds.remove();
            if wants(Scenario::Freshness) || wants(Scenario::Keyframe) {
                live::run(&world, &storage, wants(Scenario::Keyframe), &mut report).await?;
            }
            if wants(Scenario::Recommender) {
                recommender::run(&world, &storage, &mut report).await?;
            }
            if wants(Scenario::Live) {
                live_table::run(&world, &storage, &mut report).await?;
                if !cli.no_postgres {
                    postgres::live::run(&world, &mut report).await?;
                }
            }
        }
        if wants(Scenario::Rss) {
            rss::run(&world, &mut report).await?;
        }
        anyhow::Ok(())
    };
    // On SIGINT / SIGTERM the scenario future is dropped, which kills the children and then
    // the servers (their handles kill on drop), instead of orphaning them.
    let outcome = tokio::select! {
        r = scenarios => r,
        _ = shelfsync_storage::shutdown_signal() => Err(anyhow::anyhow!("interrupted")),
    };
    report.finish(started.elapsed());
    // Whatever was measured is written, also when a later scenario failed.
    let written = report.write(&cli.out);
    println!("{}", report.markdown());
    if !cli.keep_work {
        let _ = std::fs::remove_dir_all(&work);
    }
    written?;
    eprintln!("[bench] wrote {}/bench.json and bench.md", cli.out.display());
    outcome?;
    // A peer figure that failed its verification is not one: the run fails (after the report
    // says which).
    if let Some(failed) = report.postgres.as_ref().map(|p| p.failures()).filter(|f| !f.is_empty()) {
        let lines: Vec<String> = failed.iter().map(|r| r.summary()).collect();
        anyhow::bail!("the PostgreSQL peer failed verification:\n{}", lines.join("\n"));
    }
    Ok(())
}

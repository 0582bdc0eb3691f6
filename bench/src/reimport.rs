//! Scenarios 1–3 and 8: the same dumps imported, end to end, into shelfsync, into the floor and
//! into the naive loop, one after the other on the same servers; Redis memory per record around
//! shelfsync's initial import.
//!
//! End to end = from the start of the ingest import (in this process) until the system has
//! applied all of it (its command work queue is empty; for storage also its outboxes).

use std::path::Path;
use std::time::{Duration, Instant};

use shelfsync_ingest::{ImportConfig, Importer, Source};

use crate::children::Target;
use crate::feeds::Feeds;
use crate::measure::{self, RedisInfo};
use crate::reference::RefKind;
use crate::report::{CHURN, CHURN_BACK, IDENTICAL, INITIAL, ImportRow, RedisMemory, Report};
use crate::world::{World, partner};

/// Longest an import may take to settle before the run is declared broken.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30 * 60);

struct Step<'a> {
    scenario: &'static str,
    feed: &'a Path,
    prices_only: bool,
    expected_changes: u64,
}

/// What is read before and after an import.
struct Snap {
    self_cpu: f64,
    target_cpu: f64,
    nats_cpu: Option<f64>,
    redis: RedisInfo,
    stats: serde_json::Value,
}

async fn snap(world: &World, target: &Target) -> anyhow::Result<Snap> {
    Ok(Snap {
        self_cpu: measure::self_cpu_seconds(),
        target_cpu: target.cpu_seconds(),
        nats_cpu: world.nats_cpu(),
        redis: world.redis_info().await?,
        stats: target.stats(world).await?,
    })
}

/// Runs the re-import steps; with `compare` also on the floor and the naive loop.
pub async fn run(
    world: &World,
    storage: &Target,
    feeds: &Feeds,
    compare: bool,
    report: &mut Report,
) -> anyhow::Result<()> {
    let records = world.profile.records();
    let mut steps = vec![Step {
        scenario: INITIAL,
        feed: &feeds.base,
        prices_only: false,
        expected_changes: records,
    }];
    if compare {
        steps.extend([
            Step {
                scenario: IDENTICAL,
                feed: &feeds.base,
                prices_only: false,
                expected_changes: 0,
            },
            Step {
                scenario: CHURN,
                feed: &feeds.churn,
                prices_only: false,
                expected_changes: feeds.churned,
            },
            Step {
                scenario: CHURN_BACK,
                feed: &feeds.base,
                prices_only: false,
                expected_changes: feeds.churned,
            },
            Step {
                scenario: "price-only feed, 1%",
                feed: &feeds.prices,
                prices_only: true,
                expected_changes: feeds.price_changes,
            },
        ]);
    }
    let mut targets: Vec<(&Target, Importer)> = vec![(storage, importer_for(storage).await?)];
    let references = if compare {
        let floor = Target::start_reference(world, "bf", RefKind::Floor).await?;
        let naive = Target::start_reference(world, "bn", RefKind::Naive).await?;
        Some((floor, naive))
    } else {
        None
    };
    if let Some((floor, naive)) = &references {
        targets.push((floor, importer_for(floor).await?));
        targets.push((naive, importer_for(naive).await?));
    }

    for step in &steps {
        for (target, importer) in &targets {
            let memory_before = world.redis_info().await?;
            let row = import_once(world, target, importer, step).await?;
            if step.scenario == INITIAL && target.name() == "shelfsync" {
                let after = world.redis_info().await?;
                let mut memory = RedisMemory::between(&memory_before, &after, row.records);
                memory.per_key_type = key_memory(world, target).await.unwrap_or_default();
                report.redis_memory = Some(memory);
            }
            eprintln!("[bench] {}", row.summary());
            report.imports.push(row);
            // Disk stays bounded: nobody reads these changes again.
            world.purge(&target.subjects().changes_stream()).await?;
        }
    }
    report.link_floor();
    drop(targets);
    if references.is_some() {
        drop(references);
        if let Err(e) = world.flush_db(1).await {
            eprintln!("[bench] warning: could not flush the references' Redis db: {e:#}");
        }
    }
    Ok(())
}

/// `MEMORY USAGE` (exact) of place 1's keys in storage's layout, per record of the place.
async fn key_memory(world: &World, storage: &Target) -> anyhow::Result<Vec<(String, f64)>> {
    let s = &storage.settings;
    let partition = shelfsync_bus::partition_of(crate::world::BRAND, 1, s.storage.partitions);
    let keys = shelfsync_storage::client::Keys::new(&s.redis.namespace, partition);
    let mut conn =
        redis::Client::open(s.redis.url.as_str())?.get_multiplexed_async_connection().await?;
    let per_place = f64::from(world.profile.items_per_place);
    let mut out = Vec::new();
    for (what, key) in [
        ("records hash", keys.records((crate::world::BRAND, 1).into())),
        // Layout 1's keys: none are written any more (0 B), listed so that a
        // measurement of an older storage binary (`--storage-bin`) shows them.
        ("generations hash", keys.legacy_gens((crate::world::BRAND, 1).into())),
        ("id index zset", keys.legacy_ids((crate::world::BRAND, 1).into())),
    ] {
        let bytes: Option<u64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .arg("SAMPLES")
            .arg(0)
            .query_async(&mut conn)
            .await?;
        out.push((what.to_string(), bytes.unwrap_or(0) as f64 / per_place));
    }
    Ok(out)
}

async fn importer_for(target: &Target) -> anyhow::Result<Importer> {
    Importer::connect(ImportConfig::from(&target.settings)).await
}

async fn import_once(
    world: &World,
    target: &Target,
    importer: &Importer,
    step: &Step<'_>,
) -> anyhow::Result<ImportRow> {
    if world.durable {
        // Untimed, as the PostgreSQL peer's VACUUM and CHECKPOINT are.
        world.rewrite_aof().await?;
    }
    let before = snap(world, target).await?;
    let started = Instant::now();
    let imported = importer
        .import(&partner(step.prices_only), Source::File(step.feed.to_path_buf()), None)
        .await?;
    let import_s = started.elapsed().as_secs_f64();
    let ingest_cpu = measure::self_cpu_seconds() - before.self_cpu;
    target.wait_settled(world, SETTLE_TIMEOUT).await?;
    let e2e_s = started.elapsed().as_secs_f64();
    let after = snap(world, target).await?;

    let stat = |k: &str| {
        let v = |s: &serde_json::Value| s.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        v(&after.stats).saturating_sub(v(&before.stats))
    };
    let per_m = |cpu: f64| cpu * 1e6 / imported.items.max(1) as f64;
    let changes = stat("changes");
    let change_bytes = stat("change_bytes");
    Ok(ImportRow {
        scenario: step.scenario.into(),
        system: target.name().into(),
        records: imported.items,
        raw_bytes: imported.bytes_in,
        command_bytes: imported.bytes_out,
        import_s,
        e2e_s,
        records_per_s: imported.items as f64 / e2e_s,
        raw_mb_per_s: imported.bytes_in as f64 / 1e6 / e2e_s,
        vs_floor: None,
        ingest_cpu_s_per_m: per_m(ingest_cpu),
        apply_cpu_s_per_m: per_m(target.cpu_seconds() - before.target_cpu),
        redis_cpu_s_per_m: per_m(after.redis.cpu_seconds() - before.redis.cpu_seconds()),
        nats_cpu_s_per_m: match (after.nats_cpu, before.nats_cpu) {
            (Some(a), Some(b)) => Some(per_m(a - b)),
            _ => None,
        },
        changes,
        expected_changes: step.expected_changes,
        change_bytes,
        out_over_in: change_bytes as f64 / imported.bytes_in.max(1) as f64,
        redis_writes: (after.redis.writes() - before.redis.writes()).max(0.0) as u64,
        redis_bytes_in: (after.redis.num("total_net_input_bytes")
            - before.redis.num("total_net_input_bytes"))
        .max(0.0) as u64,
        aof_rewrites: (after.redis.num("aof_rewrites") - before.redis.num("aof_rewrites")).max(0.0)
            as u64,
        redis_children_cpu_s_per_m: per_m(
            after.redis.children_cpu_seconds() - before.redis.children_cpu_seconds(),
        ),
    })
}

//! The PostgreSQL peer of the live job, in the same run: the same live changes (a new price for
//! a random offer, spread over the same places), each its own transaction — the upsert that
//! writes only a distinct payload and its outbox event, one statement, committed with
//! `synchronous_commit` on (off with `--volatile`, like the other servers) — over a few
//! connections; a record always goes to the same connection, so its changes keep their order.
//! Timed from submit to commit. The connection counts of the profile are tried at the highest
//! table rate and the one with the lowest p99 is kept for the other rates and the ceiling.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::mpsc;

use super::load;
use super::server::PgServer;
use super::sql::{self, Variant};
use crate::live_table;
use crate::load::{Offers, now_us};
use crate::report::{FreshnessRun, PostgresLive, Report};
use crate::stats::Percentiles;
use crate::world::{BRAND, World};

/// One change handed to a connection: the record, its payload, when it was submitted (µs).
struct Change {
    place: i64,
    product_id: String,
    payload: String,
    submitted: i64,
}

pub async fn run(world: &World, report: &mut Report) -> anyhow::Result<()> {
    let mut peer = PostgresLive::default();
    let outcome = measure(world, &mut peer).await;
    report.postgres_live = Some(peer);
    outcome
}

async fn measure(world: &World, peer: &mut PostgresLive) -> anyhow::Result<()> {
    let p = &world.profile;
    let (dir, durable) = (world.work.join("postgres-live"), world.durable);
    let server = tokio::task::spawn_blocking(move || PgServer::start(&dir, durable))
        .await?
        .context("starting the bench's PostgreSQL for the live peer")?;
    let most = p.pg_live_connections.iter().copied().max().unwrap_or(4);
    let clients = Arc::new(load::connect(&server.conninfo(), most).await?);
    load::execute_all(&clients[0], &[sql::create_schema(Variant::Default)]).await?;
    let top = p.live_rates_kit.iter().copied().max().unwrap_or(1000);
    let mut run_id = 0;
    let mut best: Option<(usize, f64)> = None;
    for &n in &p.pg_live_connections {
        run_id += 1;
        let row = timed(&clients, n, top, p.live_run, run_id, world).await?;
        if best.is_none_or(|(_, p99)| row.indexed.p99 < p99) {
            best = Some((n, row.indexed.p99));
        }
        peer.probe.push(row);
    }
    let n = best.map_or(4, |(n, _)| n);
    peer.connections = n;
    for &rate in p.live_rates_kit.iter().filter(|&&r| r != top) {
        run_id += 1;
        peer.rows.push(timed(&clients, n, rate, p.live_run, run_id, world).await?);
    }
    for &rate in &p.ceiling_rates {
        run_id += 1;
        let mut row = timed(&clients, n, rate, p.ceiling_hold, run_id, world).await?;
        row.label = format!("ceiling step: {}", row.label);
        let held = live_table::holds(&row);
        peer.rows.push(row);
        if !held {
            break;
        }
        peer.ceiling_per_s = Some(rate as f64);
    }
    drop(clients);
    drop(server);
    Ok(())
}

/// Offers `rate` changes/s for `length` over the first `n` connections; waits (at most 60 s)
/// until every change committed.
async fn timed(
    clients: &Arc<Vec<tokio_postgres::Client>>,
    n: usize,
    rate: u64,
    length: Duration,
    run_id: u64,
    world: &World,
) -> anyhow::Result<FreshnessRun> {
    let p = &world.profile;
    let label = format!("postgres, {n} connections, {rate}/s");
    let latencies = Arc::new(Mutex::new(Vec::<(i64, i64)>::new()));
    let mut senders = Vec::with_capacity(n);
    let mut workers = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, mut rx) = mpsc::unbounded_channel::<Change>();
        senders.push(tx);
        let (clients, latencies) = (clients.clone(), latencies.clone());
        workers.push(tokio::spawn(async move {
            let client = &clients[i];
            let upsert = client.prepare(&sql::upsert(Variant::Default)).await?;
            let generation = run_id as i64;
            while let Some(c) = rx.recv().await {
                client
                    .query_one(
                        &upsert,
                        &[
                            &BRAND,
                            &generation,
                            &vec![c.place],
                            &vec![c.product_id],
                            &vec![c.payload],
                        ],
                    )
                    .await?;
                let committed = now_us();
                latencies.lock().expect("lock").push((c.submitted, committed));
            }
            anyhow::Ok(())
        }));
    }
    let started = now_us();
    let clock = Instant::now();
    let mut interval = tokio::time::interval(p.fresh_tick);
    let mut offers = Offers::new(run_id, p.live_places, p.live_items);
    let mut sent = 0u64;
    while clock.elapsed() < length {
        interval.tick().await;
        let due = (clock.elapsed().as_secs_f64() * rate as f64) as u64;
        for k in sent..due {
            let offer = offers.change(k);
            // A record always goes to the same connection: its changes keep their order.
            let connection = {
                let mut h = std::hash::DefaultHasher::new();
                std::hash::Hash::hash(&offer.product_id, &mut h);
                std::hash::Hasher::finish(&h) % n as u64
            };
            let change = Change {
                place: offer.place,
                product_id: offer.product_id,
                payload: format!("{{\"price\": {}}}", offer.price),
                submitted: now_us(),
            };
            senders[connection as usize].send(change).context("a connection stopped")?;
        }
        sent = due.max(sent);
    }
    let ended = now_us();
    drop(senders);
    let wait = tokio::time::timeout(Duration::from_secs(60), async {
        for w in workers.iter_mut() {
            w.await??;
        }
        anyhow::Ok(())
    })
    .await;
    if wait.is_err() {
        // What is left would run into the next measurement.
        workers.iter().for_each(tokio::task::JoinHandle::abort);
    }
    let committed = std::mem::take(&mut *latencies.lock().expect("lock"));
    let warmup = (length.as_micros() as i64 / 4).min(1_000_000);
    let window: Vec<f64> = committed
        .iter()
        .filter(|(s, _)| *s >= started + warmup && *s <= ended)
        .map(|(s, c)| (c - s) as f64 / 1e3)
        .collect();
    let ms = Percentiles::of(window, "ms");
    let row = FreshnessRun {
        label,
        offered_per_s: rate as f64,
        published: sent,
        received: committed.len() as u64,
        window_s: (ended - started - warmup) as f64 / 1e6,
        load_s: (ended - started) as f64 / 1e6,
        applied: ms.clone(),
        arrival: Percentiles::of(Vec::new(), "ms"),
        indexed: ms,
        cpu_cores: None,
        drained_after_s: committed
            .iter()
            .map(|(_, c)| *c)
            .max()
            .map(|last| (last - ended).max(0) as f64 / 1e6),
        cpu_s_per_1k: None,
    };
    eprintln!(
        "[bench] live {}: {} of {} committed, {}, drained {:.2} s after{}",
        row.label,
        row.received,
        row.published,
        row.indexed.render(),
        row.drained_after_s.unwrap_or(f64::NAN),
        if wait.is_err() { " (not all within 60 s)" } else { "" }
    );
    // A backlog left after 60 s is a figure (committed < published), not an error.
    if let Ok(finished) = wait {
        finished?;
    }
    Ok(row)
}

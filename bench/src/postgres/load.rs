//! Running the peer's SQL: connections, one import of a prepared dump (one transaction per
//! batch, its statements pipelined, batches spread over the connections), and reading back
//! what verification looks at.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Instant, SystemTime};

use anyhow::Context;
use futures::future::try_join_all;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Statement};

use super::rows::Dump;
use super::sql::{self, Variant};
use super::verify::Observed;
use crate::world::BRAND;

/// Opens `n` connections; each one's socket is driven by its own task, which ends when its
/// client is dropped.
pub async fn connect(conninfo: &str, n: usize) -> anyhow::Result<Vec<Client>> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        let (client, connection) = tokio_postgres::connect(conninfo, NoTls)
            .await
            .with_context(|| format!("connecting to the bench's postgres ({conninfo})"))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                eprintln!("[bench] postgres connection ended: {e}");
            }
        });
        clients.push(client);
    }
    Ok(clients)
}

/// Runs `statements` one after the other (simple protocol: no transaction around them).
pub async fn execute_all(client: &Client, statements: &[String]) -> anyhow::Result<()> {
    for s in statements {
        client.batch_execute(s).await.with_context(|| format!("running {s}"))?;
    }
    Ok(())
}

/// The server's clock now: rows whose `updated_at` is later were written after this.
pub async fn server_now(client: &Client) -> anyhow::Result<SystemTime> {
    Ok(client.query_one("SELECT clock_timestamp()", &[]).await?.get(0))
}

/// What an import's statements returned, and how long it took.
#[derive(Debug, Default)]
pub struct Applied {
    pub upserted: u64,
    pub events_written: u64,
    pub stamped: u64,
    pub seconds: f64,
}

/// Imports `dump` into the variant's tables with `generation`, over every client. The
/// statements are prepared before the clock starts.
pub async fn import(
    clients: &[Client],
    v: Variant,
    dump: &Dump,
    generation: i64,
) -> anyhow::Result<Applied> {
    let (upsert, stamp) = (sql::upsert(v), sql::stamp(v));
    let mut prepared = Vec::with_capacity(clients.len());
    for c in clients {
        let up = c.prepare(&upsert).await.context("preparing the upsert")?;
        let st = c.prepare(&stamp).await.context("preparing the generation stamp")?;
        prepared.push((c, up, st));
    }
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let per_connection = try_join_all(
        prepared.iter().map(|(c, up, st)| import_batches(c, up, st, dump, generation, &next)),
    )
    .await?;
    let mut total = Applied { seconds: started.elapsed().as_secs_f64(), ..Default::default() };
    for a in per_connection {
        total.upserted += a.upserted;
        total.events_written += a.events_written;
        total.stamped += a.stamped;
    }
    Ok(total)
}

/// One connection's share: the next batch not taken yet, until none is left. Each batch is
/// `BEGIN; upsert; stamp; COMMIT`, sent without waiting for the replies in between (a failed
/// statement aborts the transaction, and its error is returned).
async fn import_batches(
    client: &Client,
    upsert: &Statement,
    stamp: &Statement,
    dump: &Dump,
    generation: i64,
    next: &AtomicUsize,
) -> anyhow::Result<Applied> {
    let mut out = Applied::default();
    while let Some(b) = dump.batches.get(next.fetch_add(1, Ordering::Relaxed)) {
        let upsert_params: [&(dyn ToSql + Sync); 5] =
            [&BRAND, &generation, &b.places, &b.ids, &b.payloads];
        let stamp_params: [&(dyn ToSql + Sync); 4] = [&BRAND, &generation, &b.places, &b.ids];
        let (_, counts, stamped, _) = futures::try_join!(
            client.batch_execute("BEGIN"),
            client.query_one(upsert, &upsert_params),
            client.execute(stamp, &stamp_params),
            client.batch_execute("COMMIT"),
        )
        .context("applying a batch")?;
        out.upserted += counts.get::<_, i64>(0) as u64;
        out.events_written += counts.get::<_, i64>(1) as u64;
        out.stamped += stamped;
    }
    Ok(out)
}

/// Reads back what [`super::verify::problems`] checks.
pub async fn observe(
    client: &Client,
    v: Variant,
    applied: &Applied,
    generation: i64,
    since: SystemTime,
) -> anyhow::Result<Observed> {
    let stamps = client.query_one(&sql::count_stamps(v), &[&generation]).await?;
    let events = client.query_one(&sql::count_events(v), &[&generation]).await?;
    let moved: HashSet<(i64, String)> = client
        .query(&sql::moved_keys(v), &[&since])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let count = |row: &tokio_postgres::Row, i: usize| row.get::<_, i64>(i) as u64;
    Ok(Observed {
        upserted: applied.upserted,
        events_written: applied.events_written,
        stamped: applied.stamped,
        rows: count(&stamps, 0),
        unstamped: count(&stamps, 1),
        moved,
        events: count(&events, 0),
        events_without_before: count(&events, 1),
    })
}

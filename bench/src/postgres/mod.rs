//! The PostgreSQL peer of the re-import scenario: the same dumps, in the same run, applied the
//! way one would with PostgreSQL alone — an `offers` table and a transactional outbox, change
//! detection in SQL — on a private cluster, durable like the rest of the run (`fsync` and
//! `synchronous_commit` at their defaults, on; `--volatile` turns `synchronous_commit` off).
//!
//! Per batch of 1000 rows, one transaction: one statement that locks the current rows (the
//! before images), upserts the rows whose payload is distinct and writes one outbox event per
//! change, then a generation-only UPDATE of the others. Batches are spread over a few
//! connections; the first import tries several counts and keeps the fastest. Two variants:
//! `jsonb` at fillfactor 100, and `text` at fillfactor 50. Its input is parsed before the clock
//! starts (JSON parsing is counted on shelfsync's side only; the parse floor says what it costs).
//! Every import is verified; one that fails is reported as such, without its figures.

pub mod live;
mod load;
mod rows;
mod server;
mod sql;
mod verify;

use std::path::Path;

use anyhow::Context;
use tokio_postgres::Client;

use self::rows::{Diff, Dump};
use self::server::PgServer;
use self::sql::Variant;
use crate::feeds::Feeds;
use crate::measure;
use crate::report::{CHURN, CHURN_BACK, IDENTICAL, INITIAL, PeerImportRow, PostgresPeer, Report};
use crate::world::World;

/// Rows per statement (ingest's batch size).
const BATCH_ROWS: usize = 1000;

/// One import of the peer and what it must change.
struct PeerStep<'a> {
    scenario: &'static str,
    dump: &'a Dump,
    diff: Diff,
    /// The feed generator's prediction.
    feed_changes: u64,
}

/// The peer's imports in order: the base dump (`records` changes, the feed generator's count),
/// the same again (none), the churned dump and back to the base (`churned` each).
fn peer_steps<'a>(
    base: &'a Dump,
    churn: &'a Dump,
    records: u64,
    churned: u64,
) -> [PeerStep<'a>; 4] {
    let step = |scenario, from: Option<&Dump>, dump: &'a Dump, feed_changes| PeerStep {
        scenario,
        dump,
        diff: rows::diff(from, dump),
        feed_changes,
    };
    [
        step(INITIAL, None, base, records),
        step(IDENTICAL, Some(base), base, 0),
        step(CHURN, Some(base), churn, churned),
        step(CHURN_BACK, Some(churn), base, churned),
    ]
}

/// Runs the peer on the base and churn dumps and puts what it measured into `report`, also
/// when it fails part way.
pub async fn run(
    world: &World,
    feeds: &Feeds,
    connections: &[usize],
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut peer = PostgresPeer { batch_rows: BATCH_ROWS, ..Default::default() };
    let outcome = measure_peer(world, feeds, connections, &mut peer).await;
    report.postgres = Some(peer);
    outcome
}

async fn measure_peer(
    world: &World,
    feeds: &Feeds,
    connections: &[usize],
    peer: &mut PostgresPeer,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let (base, churn) = tokio::try_join!(prepare(&feeds.base), prepare(&feeds.churn))?;
    let steps = peer_steps(&base, &churn, base.records(), feeds.churned);
    peer.prepare_s = started.elapsed().as_secs_f64();

    let (dir, durable) = (world.work.join("postgres"), world.durable);
    let server = tokio::task::spawn_blocking(move || PgServer::start(&dir, durable))
        .await?
        .context("starting the bench's PostgreSQL")?;
    let most = connections.iter().copied().max().unwrap_or(1);
    let clients = load::connect(&server.conninfo(), most).await?;
    describe_server(&clients[0], peer).await?;
    eprintln!(
        "[bench] postgres {} on port {} ({}); input parsed in {:.1} s",
        peer.server_version,
        server.port(),
        peer.settings,
        peer.prepare_s
    );

    let mut generation = 0;
    peer.connections = match connections {
        [only] => *only,
        _ => {
            for &n in connections {
                load::execute_all(&clients[0], &[sql::create_schema(Variant::Default)]).await?;
                generation += 1;
                let row =
                    import_step(&server, &clients[..n], Variant::Default, &steps[0], generation)
                        .await?;
                eprintln!("[bench] postgres probe: {}", row.summary());
                peer.probe.push(row);
            }
            best_connections(&peer.probe).unwrap_or(connections[0])
        }
    };
    let chosen = &clients[..peer.connections];
    for v in Variant::ALL {
        import_variant(&server, chosen, v, &steps, &mut generation, |_, row| {
            eprintln!("[bench] postgres: {}", row.summary());
            peer.imports.push(row);
        })
        .await?;
        // Disk stays bounded, as for shelfsync's change streams.
        load::execute_all(&clients[0], &[format!("DROP SCHEMA {} CASCADE", v.schema())]).await?;
    }
    drop(clients);
    drop(server);
    Ok(())
}

async fn prepare(path: &Path) -> anyhow::Result<Dump> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || rows::prepare(&path, BATCH_ROWS)).await?
}

async fn describe_server(client: &Client, peer: &mut PostgresPeer) -> anyhow::Result<()> {
    let show = |name: &'static str| async move {
        let row = client.query_one(&format!("SHOW {name}"), &[]).await?;
        anyhow::Ok(format!("{name} {}", row.get::<_, String>(0)))
    };
    let version = client.query_one("SHOW server_version", &[]).await?;
    peer.server_version = version.get(0);
    let mut settings = Vec::new();
    for name in
        ["fsync", "synchronous_commit", "full_page_writes", "shared_buffers", "max_wal_size"]
    {
        settings.push(show(name).await?);
    }
    peer.settings = settings.join(", ");
    Ok(())
}

/// The connection count of the fastest verified probe run.
fn best_connections(probe: &[PeerImportRow]) -> Option<usize> {
    probe
        .iter()
        .filter_map(|r| Some((r.connections, r.records_per_s?)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(n, _)| n)
}

/// One untimed maintenance pass, one timed import, its verification, the outbox drained.
/// Every step imported in turn into a fresh schema of variant `v`, each
/// with the next generation; `on_row` gets each step's row as it comes.
async fn import_variant(
    server: &PgServer,
    clients: &[Client],
    v: Variant,
    steps: &[PeerStep<'_>],
    generation: &mut i64,
    mut on_row: impl FnMut(&PeerStep<'_>, PeerImportRow),
) -> anyhow::Result<()> {
    load::execute_all(&clients[0], &[sql::create_schema(v)]).await?;
    for step in steps {
        *generation += 1;
        on_row(step, import_step(server, clients, v, step, *generation).await?);
    }
    Ok(())
}

async fn import_step(
    server: &PgServer,
    clients: &[Client],
    v: Variant,
    step: &PeerStep<'_>,
    generation: i64,
) -> anyhow::Result<PeerImportRow> {
    let admin = &clients[0];
    load::execute_all(admin, &sql::maintenance(v)).await?;
    let since = load::server_now(admin).await?;
    let server_cpu = || server.postmaster_pid().and_then(measure::family_cpu_seconds);
    let (server_before, self_before) = (server_cpu(), measure::self_cpu_seconds());
    let applied = load::import(clients, v, step.dump, generation)
        .await
        .with_context(|| format!("{} into postgres ({})", step.scenario, v.name()))?;
    let (server_after, self_after) = (server_cpu(), measure::self_cpu_seconds());
    let observed = load::observe(admin, v, &applied, generation, since).await?;
    let records = step.dump.records();
    let expected = verify::Expected {
        records,
        changed: &step.diff.changed,
        new_rows: step.diff.new_rows,
        feed_changes: step.feed_changes,
    };
    let problems = verify::problems(&expected, &observed);
    load::execute_all(admin, &[sql::drain_outbox(v)]).await?;
    let per_m = |cpu: f64| cpu * 1e6 / records.max(1) as f64;
    Ok(PeerImportRow {
        scenario: step.scenario.into(),
        variant: v.name().into(),
        layout: v.describe(),
        connections: clients.len(),
        records,
        seconds: applied.seconds,
        records_per_s: problems.is_empty().then(|| records as f64 / applied.seconds),
        server_cpu_s_per_m: match (server_after, server_before) {
            (Some(a), Some(b)) => Some(per_m(a - b)),
            _ => None,
        },
        client_cpu_s_per_m: per_m(self_after - self_before),
        changes: observed.events,
        expected_changes: step.feed_changes,
        stamped: observed.stamped,
        problems,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(connections: usize, rate: Option<f64>) -> PeerImportRow {
        PeerImportRow { connections, records_per_s: rate, ..Default::default() }
    }

    /// `n` rows over 3 places; every 100th row's price differs when `churned`.
    fn dump(n: i64, churned: bool) -> Dump {
        let rows = (0..n).map(|i| {
            let price = if churned && i % 100 == 0 { i + 1 } else { i };
            (i % 3, format!("p{i}"), format!("{{\"price\":{price},\"title\":\"t{i}\"}}"))
        });
        Dump::from_rows(rows, BATCH_ROWS)
    }

    /// The SQL against a real cluster: every variant's imports pass verification, and the
    /// cluster is stopped when its guard is dropped.
    #[tokio::test]
    async fn imports_into_a_private_cluster_verify() -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir()?;
        // The server's user must reach its dir.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let pg_dir = dir.path().join("pg");
        let server = tokio::task::spawn_blocking(move || PgServer::start(&pg_dir, true)).await??;
        let clients = load::connect(&server.conninfo(), 2).await?;
        let (base, churn) = (dump(2500, false), dump(2500, true));
        // The first three steps: the base, the same again, the churn.
        let [initial, identical, churned, _] = peer_steps(&base, &churn, 2500, 25);
        let steps = [initial, identical, churned];
        let mut generation = 0;
        for v in Variant::ALL {
            import_variant(&server, &clients, v, &steps, &mut generation, |step, row| {
                assert!(row.problems.is_empty(), "{}", row.summary());
                assert_eq!(row.changes, step.feed_changes, "{}", row.summary());
                assert_eq!(row.stamped, 2500 - step.feed_changes, "{}", row.summary());
            })
            .await?;
        }
        // A prediction the tables do not meet is caught.
        let wrong = PeerStep { feed_changes: 1, ..steps.into_iter().nth(1).expect("identical") };
        let row = import_step(&server, &clients, Variant::Tuned, &wrong, generation + 1).await?;
        assert!(row.records_per_s.is_none() && !row.problems.is_empty(), "{}", row.summary());

        let pid_file = dir.path().join("pg/data/postmaster.pid");
        assert!(pid_file.exists());
        drop(clients);
        drop(server);
        assert!(!pid_file.exists(), "the cluster still runs");
        Ok(())
    }

    #[test]
    fn keeps_the_fastest_verified_connection_count() {
        let runs =
            [probe(1, Some(10.0)), probe(2, Some(30.0)), probe(4, None), probe(8, Some(20.0))];
        assert_eq!(best_connections(&runs), Some(2));
        assert_eq!(best_connections(&[probe(4, None)]), None);
    }
}

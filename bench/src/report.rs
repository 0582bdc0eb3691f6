//! What a run found: the data (`bench.json`), the tables (`bench.md`, also printed), and the
//! The performance targets (docs/DESIGN.md) checked against same-run references.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::measure::RedisInfo;
use crate::profile::Profile;
use crate::stats::{Percentiles, fmt_num};
use crate::world::World;

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub profile: String,
    pub started_at: String,
    pub duration_s: f64,
    pub machine: Machine,
    pub records: u64,
    pub places: u32,
    /// Places the live table's changes are spread over.
    pub live_places: u32,
    pub partitions: u32,
    /// Whether the servers fsync what they acknowledge, and how (every figure is under it).
    pub durable: bool,
    pub durability: String,
    pub imports: Vec<ImportRow>,
    /// Ingest's parser alone over the base dump.
    pub parse_floor: Option<ParseFloor>,
    /// The same full-dump imports into PostgreSQL.
    pub postgres: Option<PostgresPeer>,
    pub redis_memory: Option<RedisMemory>,
    pub keyframes: Vec<KeyframeRun>,
    pub feed_bootstrap_s: Option<f64>,
    pub freshness: Vec<FreshnessRun>,
    pub rss: Vec<RssRow>,
    pub recommender: Option<RecommenderRun>,
    /// The live path's table (`live_table`), its ceiling, and the PostgreSQL peer's.
    pub live: Vec<FreshnessRun>,
    pub live_ceiling_per_s: Option<f64>,
    pub postgres_live: Option<PostgresLive>,
    pub targets: Vec<TargetCheck>,
    pub notes: Vec<String>,
}

#[derive(Debug, Default, Serialize)]
pub struct Machine {
    pub cpu_model: String,
    pub cores: usize,
    pub memory_gb: f64,
    pub kernel: String,
    pub nats_server: String,
    pub redis_server: String,
    pub commit: String,
}

/// One import, end to end, into one system.
#[derive(Debug, Default, Serialize)]
pub struct ImportRow {
    pub scenario: String,
    /// `shelfsync`, `floor` or `naive`.
    pub system: String,
    pub records: u64,
    pub raw_bytes: u64,
    /// CommandBatch payload bytes ingest published.
    pub command_bytes: u64,
    /// Ingest alone: parse, batch, publish, acked.
    pub import_s: f64,
    pub e2e_s: f64,
    pub records_per_s: f64,
    pub raw_mb_per_s: f64,
    /// Records/s over the floor's records/s in the same scenario.
    pub vs_floor: Option<f64>,
    pub ingest_cpu_s_per_m: f64,
    /// The applying process: storage, the floor or the naive loop.
    pub apply_cpu_s_per_m: f64,
    pub redis_cpu_s_per_m: f64,
    pub nats_cpu_s_per_m: Option<f64>,
    pub changes: u64,
    pub expected_changes: u64,
    pub change_bytes: u64,
    /// Change bytes out over raw bytes in.
    pub out_over_in: f64,
    /// Keys modified in Redis (hash fields, list elements, ...).
    pub redis_writes: u64,
    pub redis_bytes_in: u64,
    /// AOF rewrites Redis started by itself during the import (`auto-aof-rewrite-*`), and the
    /// CPU of its children that ended meanwhile (not in `redis_cpu_s_per_m`, but on the cores).
    pub aof_rewrites: u64,
    pub redis_children_cpu_s_per_m: f64,
}

impl ImportRow {
    pub fn summary(&self) -> String {
        format!(
            "{} / {}: {} records in {:.2} s e2e ({:.0}/s), {} changes, out/in {:.2}%, {} Redis writes, \
             {} AOF rewrites ({:.2} CPU s / 1M)",
            self.scenario,
            self.system,
            self.records,
            self.e2e_s,
            self.records_per_s,
            self.changes,
            self.out_over_in * 100.0,
            self.redis_writes,
            self.aof_rewrites,
            self.redis_children_cpu_s_per_m,
        )
    }
}

/// Ingest's parser over a dump, each item into the feed's fields and nothing else.
#[derive(Debug, Default, Serialize)]
pub struct ParseFloor {
    pub records: u64,
    pub raw_bytes: u64,
    pub seconds: f64,
    pub records_per_s: f64,
    pub raw_mb_per_s: f64,
    pub cpu_s_per_m: f64,
}

/// The PostgreSQL peer: its server, how it was run, and its imports.
#[derive(Debug, Default, Serialize)]
pub struct PostgresPeer {
    pub server_version: String,
    /// Durability and memory settings as the server reports them.
    pub settings: String,
    pub batch_rows: usize,
    /// Connections of the measured imports (the fastest of the probe, or the one given).
    pub connections: usize,
    /// The first import once per connection count tried (default variant).
    pub probe: Vec<PeerImportRow>,
    pub imports: Vec<PeerImportRow>,
    /// Parsing the dumps into rows before any timing (not part of any figure).
    pub prepare_s: f64,
}

/// One import of a dump into PostgreSQL, verified.
#[derive(Debug, Default, Serialize)]
pub struct PeerImportRow {
    pub scenario: String,
    /// `default` or `tuned`.
    pub variant: String,
    /// Payload type and fillfactor of the variant.
    pub layout: String,
    pub connections: usize,
    pub records: u64,
    /// First batch sent → last batch committed.
    pub seconds: f64,
    /// None when verification failed: such a figure is not reported.
    pub records_per_s: Option<f64>,
    /// The postmaster and its children (backends, WAL writer, checkpointer, ...).
    pub server_cpu_s_per_m: Option<f64>,
    /// This process: binding and sending the batches.
    pub client_cpu_s_per_m: f64,
    /// Outbox events of the import.
    pub changes: u64,
    pub expected_changes: u64,
    /// Rows whose generation alone was stamped.
    pub stamped: u64,
    /// Why verification failed; empty when it passed.
    pub problems: Vec<String>,
}

impl PeerImportRow {
    pub fn summary(&self) -> String {
        let rate = self
            .records_per_s
            .map_or_else(|| "FAILED VERIFICATION".to_string(), |r| format!("{r:.0}/s"));
        format!(
            "{} / postgres {} ({} connections): {} records in {:.2} s ({rate}), {} changes ({} expected){}",
            self.scenario,
            self.variant,
            self.connections,
            self.records,
            self.seconds,
            self.changes,
            self.expected_changes,
            if self.problems.is_empty() {
                String::new()
            } else {
                format!(": {}", self.problems.join("; "))
            }
        )
    }
}

impl PostgresPeer {
    /// Imports whose verification failed (probe included).
    pub fn failures(&self) -> Vec<&PeerImportRow> {
        self.probe.iter().chain(&self.imports).filter(|r| !r.problems.is_empty()).collect()
    }

    fn row(&self, scenario: &str, variant: &str) -> Option<&PeerImportRow> {
        self.imports.iter().find(|r| r.scenario == scenario && r.variant == variant)
    }
}

#[derive(Debug, Default, Serialize)]
pub struct RedisMemory {
    pub records: u64,
    pub used_memory_before: u64,
    pub used_memory_after: u64,
    pub bytes_per_record: f64,
    pub dataset_bytes_per_record: f64,
    /// `MEMORY USAGE` of one place's keys, per record of the place: (key, bytes per record).
    pub per_key_type: Vec<(String, f64)>,
}

impl RedisMemory {
    pub fn between(before: &RedisInfo, after: &RedisInfo, records: u64) -> RedisMemory {
        let n = records.max(1) as f64;
        RedisMemory {
            records,
            used_memory_before: before.num("used_memory") as u64,
            used_memory_after: after.num("used_memory") as u64,
            bytes_per_record: (after.num("used_memory") - before.num("used_memory")) / n,
            dataset_bytes_per_record: (after.num("used_memory_dataset")
                - before.num("used_memory_dataset"))
                / n,
            per_key_type: Vec::new(),
        }
    }
}

#[derive(Debug, Default, Serialize)]
pub struct KeyframeRun {
    pub label: String,
    pub places: u32,
    pub records: u64,
    pub duration_s: f64,
    pub records_per_s: f64,
    pub storage_cpu_s: f64,
    /// Longest time one place's snapshot held its partition (storage's counter), when it grew.
    pub longest_place_ms: Option<f64>,
    /// Time storage's keyframes gave way to late live changes (its counter).
    pub gave_way_s: f64,
    /// Freshness p99 (index updated) of changes published during the keyframe, ms.
    pub live_p99_ms: Option<f64>,
    /// The same without a keyframe, ms.
    pub live_baseline_p99_ms: Option<f64>,
}

#[derive(Debug, Default, Serialize)]
pub struct FreshnessRun {
    pub label: String,
    pub offered_per_s: f64,
    pub published: u64,
    pub received: u64,
    /// Changes published in this window are the samples.
    pub window_s: f64,
    pub load_s: f64,
    /// Ingest publish → storage applied the command (the record's `updated_at`,
    /// storage's clock; the same machine): the first half of the path.
    pub applied: Percentiles,
    /// Ingest publish → the ChangeFeed kit hands the change to the consumer.
    pub arrival: Percentiles,
    /// Ingest publish → the recommender index holds it.
    pub indexed: Percentiles,
    /// CPU of each process over the load (or the keyframe) window.
    pub cpu_cores: Option<CpuCores>,
    /// From the load's end until the last change arrived (the live table).
    pub drained_after_s: Option<f64>,
    /// CPU seconds of each process per 1000 changes (the live table).
    pub cpu_s_per_1k: Option<CpuCores>,
}

/// The PostgreSQL peer of the live job (`postgres::live`).
#[derive(Debug, Default, Serialize)]
pub struct PostgresLive {
    /// The connection count kept (lowest p99 at the highest table rate).
    pub connections: usize,
    /// The trial of each connection count at the highest table rate.
    pub probe: Vec<FreshnessRun>,
    pub rows: Vec<FreshnessRun>,
    pub ceiling_per_s: Option<f64>,
}

/// Cores used on average by each process on the machine over a window.
#[derive(Debug, Default, Serialize)]
pub struct CpuCores {
    pub storage: f64,
    pub nats: f64,
    pub redis: f64,
    /// This process: the load generator and the ChangeFeed consumer.
    pub harness: f64,
}

impl CpuCores {
    pub fn render(&self) -> String {
        format!(
            "storage {:.2} / nats {:.2} / redis {:.2} / harness {:.2} cores",
            self.storage, self.nats, self.redis, self.harness
        )
    }
}

#[derive(Debug, Default, Serialize)]
pub struct RssRow {
    pub dump_mb: f64,
    pub items: u64,
    pub peak_rss_mb: f64,
    pub rss_at_start_mb: f64,
    pub import_s: f64,
    pub items_per_s: f64,
    pub mb_per_s: f64,
    pub cpu_s: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct RecommenderRun {
    pub offers: u64,
    pub bootstrap_s: f64,
    pub query_idle: Percentiles,
    pub query_live: Percentiles,
    pub http: Vec<HttpRun>,
}

#[derive(Debug, Default, Serialize)]
pub struct HttpRun {
    pub tool: String,
    pub connections: usize,
    pub seconds: f64,
    pub requests: u64,
    pub errors: u64,
    pub requests_per_s: f64,
    pub latency: Option<Percentiles>,
}

#[derive(Debug, Default, Serialize)]
pub struct TargetCheck {
    pub target: String,
    pub measured: String,
    /// None: not measured in this run.
    pub holds: Option<bool>,
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default()
}

fn command_line(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

impl Machine {
    async fn describe(world: &World) -> Machine {
        let cpuinfo = read_trimmed("/proc/cpuinfo");
        let meminfo = read_trimmed("/proc/meminfo");
        let mem_kb: f64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        let nats = shelfsync_testkit::nats_server_bin()
            .map(|bin| command_line(&bin.to_string_lossy(), &["--version"]))
            .unwrap_or_default();
        let redis = world.redis_info().await.map(|i| i.text("redis_version")).unwrap_or_default();
        Machine {
            cpu_model: cpuinfo
                .lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
                .unwrap_or_default(),
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            memory_gb: mem_kb / 1024.0 / 1024.0,
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            nats_server: nats,
            redis_server: redis,
            commit: command_line("git", &["describe", "--always", "--dirty"]),
        }
    }
}

impl Report {
    pub async fn new(profile: &Profile, world: &World) -> Report {
        Report {
            profile: profile.name.into(),
            started_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            machine: Machine::describe(world).await,
            records: profile.records(),
            places: profile.places,
            live_places: profile.live_places,
            partitions: profile.partitions,
            durable: world.durable,
            durability: world.durability().into(),
            ..Default::default()
        }
    }

    /// Fills `vs_floor` of every row from the floor row of its scenario.
    pub fn link_floor(&mut self) {
        let floors: Vec<(String, f64)> = self
            .imports
            .iter()
            .filter(|r| r.system == "floor")
            .map(|r| (r.scenario.clone(), r.records_per_s))
            .collect();
        for row in &mut self.imports {
            if let Some((_, f)) = floors.iter().find(|(s, _)| *s == row.scenario) {
                row.vs_floor = Some(row.records_per_s / f);
            }
        }
    }

    fn row(&self, scenario: &str, system: &str) -> Option<&ImportRow> {
        self.imports.iter().find(|r| r.scenario == scenario && r.system == system)
    }

    pub fn finish(&mut self, took: Duration) {
        self.duration_s = took.as_secs_f64();
        self.targets = self.check_targets();
    }

    /// The performance targets, each against its same-run reference.
    fn check_targets(&self) -> Vec<TargetCheck> {
        let mut out = Vec::new();
        let mut push = |target: &str, measured: String, holds: Option<bool>| {
            out.push(TargetCheck { target: target.into(), measured, holds });
        };
        let churn: Vec<&ImportRow> = ["re-import, 1% churn", "re-import, 1% churn back"]
            .iter()
            .filter_map(|s| self.row(s, "shelfsync"))
            .collect();
        let ratios: Vec<f64> = churn.iter().filter_map(|r| r.vs_floor).collect();
        if ratios.is_empty() {
            push(
                "re-import with 1% churn, end to end ≥ 50% of the floor",
                "not measured".into(),
                None,
            );
        } else {
            let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
            let each: Vec<String> = ratios.iter().map(|r| format!("{:.0}%", r * 100.0)).collect();
            push(
                "re-import with 1% churn, end to end ≥ 50% of the floor",
                format!("{:.0}% of the floor (runs: {})", mean * 100.0, each.join(", ")),
                Some(mean >= 0.5),
            );
        }
        match self.row("identical re-import", "shelfsync") {
            Some(r) => push(
                "identical re-import emits 0 changes",
                format!("{} changes", r.changes),
                Some(r.changes == 0),
            ),
            None => push("identical re-import emits 0 changes", "not measured".into(), None),
        }
        let exact: Vec<String> = self
            .imports
            .iter()
            .filter(|r| r.system == "shelfsync")
            .map(|r| format!("{}: {}/{}", r.scenario, r.changes, r.expected_changes))
            .collect();
        if !exact.is_empty() {
            let all = self
                .imports
                .iter()
                .filter(|r| r.system == "shelfsync")
                .all(|r| r.changes == r.expected_changes);
            push(
                "exactly one change per real transition (changes/expected)",
                exact.join("; "),
                Some(all),
            );
        }
        match churn.first() {
            Some(r) => {
                let naive = self
                    .row(&r.scenario, "naive")
                    .map_or(String::new(), |n| format!(" (naive: {:.0}%)", n.out_over_in * 100.0));
                push(
                    "change bytes out / raw bytes in ≤ 2% at 1% churn",
                    format!("{:.2}%{naive}", r.out_over_in * 100.0),
                    Some(r.out_over_in <= 0.02),
                );
            }
            None => push(
                "change bytes out / raw bytes in ≤ 2% at 1% churn",
                "not measured".into(),
                None,
            ),
        }
        if self.rss.is_empty() {
            push("ingest peak RSS < 64 MB (100 MB and 1 GB dumps)", "not measured".into(), None);
        }
        for r in &self.rss {
            push(
                &format!("ingest peak RSS < 64 MB ({:.0} MB dump)", r.dump_mb),
                format!("{:.1} MB", r.peak_rss_mb),
                Some(r.peak_rss_mb < 64.0),
            );
        }
        match self.freshness.iter().find(|f| f.label == "without a keyframe") {
            Some(f) => push(
                &format!(
                    "freshness p99 < 50 ms at {} changes/s (publish → index)",
                    fmt_num(f.offered_per_s)
                ),
                format!(
                    "p99 {} ms (arrival p99 {} ms)",
                    fmt_num(f.indexed.p99),
                    fmt_num(f.arrival.p99)
                ),
                Some(f.indexed.samples > 0 && f.indexed.p99 < 50.0 && f.received >= f.published),
            ),
            None => push("freshness p99 < 50 ms at 5k changes/s", "not measured".into(), None),
        }
        match self
            .keyframes
            .iter()
            .find(|k| k.live_p99_ms.is_some() && k.label.starts_with("under"))
        {
            Some(k) => {
                push(
                    &format!("keyframe of {} records < 30 s", k.records),
                    format!("{:.1} s under load ({:.0} records/s)", k.duration_s, k.records_per_s),
                    Some(k.duration_s < 30.0),
                );
                let (during, base) =
                    (k.live_p99_ms.unwrap_or(0.0), k.live_baseline_p99_ms.unwrap_or(0.0));
                push(
                    "live freshness p99 during a keyframe < 2× without",
                    format!(
                        "{} ms vs {} ms ({:.1}×)",
                        fmt_num(during),
                        fmt_num(base),
                        during / base.max(1e-9)
                    ),
                    Some(during < 2.0 * base),
                );
            }
            None => push("keyframe < 30 s with live p99 under 2×", "not measured".into(), None),
        }
        match &self.recommender {
            Some(r) => push(
                "recommender top-N p99 < 1 ms in-process",
                format!(
                    "p99 {} µs idle, {} µs under live load",
                    fmt_num(r.query_idle.p99),
                    fmt_num(r.query_live.p99)
                ),
                Some(r.query_idle.p99 < 1000.0),
            ),
            None => push("recommender top-N p99 < 1 ms in-process", "not measured".into(), None),
        }
        self.check_peer_targets(&mut push);
        out.extend(self.live_targets());
        out
    }

    /// shelfsync's records/s over the PostgreSQL peer's (`variant`) on the
    /// same import, when both were measured (and the peer verified).
    fn over_peer(&self, scenario: &str, variant: &str) -> Option<f64> {
        let ours = self.row(scenario, "shelfsync")?.records_per_s;
        Some(ours / self.postgres.as_ref()?.row(scenario, variant)?.records_per_s?)
    }

    /// The targets against what users would pick instead (the PostgreSQL
    /// peer, both sides durable) and of work proportional to changes.
    fn check_peer_targets(&self, push: &mut impl FnMut(&str, String, Option<bool>)) {
        use crate::reimport::{CHURN, IDENTICAL, INITIAL};
        // Only durable servers are the target's conditions.
        let judged = |holds: bool| self.durable.then_some(holds);
        let target = "1% churn re-import ≥ 3× PostgreSQL default (both durable, same run)";
        match self.over_peer(CHURN, "default") {
            Some(r) => push(target, format!("{r:.2}×"), judged(r >= 3.0)),
            None => push(target, "not measured".into(), None),
        }
        let target = "ahead of PostgreSQL tuned on the initial, identical and 1% churn imports";
        let tuned: Vec<(&str, f64)> = [INITIAL, IDENTICAL, CHURN]
            .into_iter()
            .filter_map(|s| Some((s, self.over_peer(s, "tuned")?)))
            .collect();
        if tuned.len() == 3 {
            let each: Vec<String> = tuned.iter().map(|(s, r)| format!("{s} {r:.2}×")).collect();
            push(target, each.join(", "), judged(tuned.iter().all(|(_, r)| *r > 1.0)));
        } else {
            push(target, "not measured".into(), None);
        }
        let target = "ingest CPU per record ≤ 3× the parse floor";
        let full_dumps = [INITIAL, IDENTICAL, CHURN, crate::reimport::CHURN_BACK];
        let worst = self.parse_floor.as_ref().filter(|f| f.cpu_s_per_m > 0.0).and_then(|f| {
            full_dumps
                .iter()
                .filter_map(|s| self.row(s, "shelfsync"))
                .map(|r| r.ingest_cpu_s_per_m / f.cpu_s_per_m)
                .max_by(f64::total_cmp)
        });
        match worst {
            Some(w) => push(target, format!("at most {w:.2}× its floor"), Some(w <= 3.0)),
            None => push(target, "not measured".into(), None),
        }
        let target = "identical re-import writes ≤ 1% as many Redis fields as it has records";
        match self.row(IDENTICAL, "shelfsync") {
            Some(r) => {
                let share = r.redis_writes as f64 / r.records.max(1) as f64;
                push(
                    target,
                    format!("{} for {} records ({:.2}%)", r.redis_writes, r.records, share * 100.0),
                    Some(share <= 0.01),
                );
            }
            None => push(target, "not measured".into(), None),
        }
        let target = "Redis memory ≤ 280 bytes per record";
        match &self.redis_memory {
            Some(m) => push(
                target,
                format!("{:.0} bytes per record", m.bytes_per_record),
                Some(m.bytes_per_record <= 280.0),
            ),
            None => push(target, "not measured".into(), None),
        }
    }

    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::write(dir.join("bench.json"), serde_json::to_string_pretty(self)?)?;
        std::fs::write(dir.join("bench.md"), self.markdown())?;
        Ok(())
    }

    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let m = &self.machine;
        let _ =
            writeln!(md, "## shelfsync-bench — profile `{}`, {}\n", self.profile, self.started_at);
        let _ = writeln!(
            md,
            "Machine: {} × {} cores, {:.0} GB RAM, Linux {}; {}; Redis {}; commit `{}`. \
             {} records in {} places, {} partitions; run took {:.0} s. Servers {}.\n",
            m.cores,
            m.cpu_model,
            m.memory_gb,
            m.kernel,
            m.nats_server,
            m.redis_server,
            m.commit,
            self.records,
            self.places,
            self.partitions,
            self.duration_s,
            self.durability
        );
        self.md_imports(&mut md);
        self.md_postgres(&mut md);
        self.md_live(&mut md);
        self.md_live_table(&mut md);
        self.md_rss(&mut md);
        self.md_recommender(&mut md);
        let _ = writeln!(md, "### Targets\n\n| target | measured | holds |\n|---|---|---|");
        for t in &self.targets {
            let verdict = match t.holds {
                Some(true) => "yes",
                Some(false) => "**NO**",
                None => "—",
            };
            let _ = writeln!(md, "| {} | {} | {} |", t.target, t.measured, verdict);
        }
        for n in &self.notes {
            let _ = writeln!(md, "\n{n}");
        }
        md
    }

    fn md_imports(&self, md: &mut String) {
        if self.imports.is_empty() {
            return;
        }
        let _ = writeln!(
            md,
            "### Re-imports, end to end (import start → applied), {} servers\n\n\
             | scenario | system | records/s | raw MB/s | e2e s | vs floor | CPU s / 1M: ingest | apply | Redis | NATS | changes (expected) | change bytes / raw | Redis writes |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            self.durability_word()
        );
        for r in &self.imports {
            let vs = r.vs_floor.map_or("—".into(), |v| format!("{:.0}%", v * 100.0));
            let nats = r.nats_cpu_s_per_m.map_or("—".into(), fmt_num);
            let changes = if r.system == "shelfsync" {
                format!("{} ({})", r.changes, r.expected_changes)
            } else {
                r.changes.to_string()
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2}% | {} |",
                r.scenario,
                r.system,
                fmt_num(r.records_per_s),
                fmt_num(r.raw_mb_per_s),
                fmt_num(r.e2e_s),
                vs,
                fmt_num(r.ingest_cpu_s_per_m),
                fmt_num(r.apply_cpu_s_per_m),
                fmt_num(r.redis_cpu_s_per_m),
                nats,
                changes,
                r.out_over_in * 100.0,
                r.redis_writes
            );
        }
        let scenarios: Vec<&str> = {
            let mut s: Vec<&str> = self.imports.iter().map(|r| r.scenario.as_str()).collect();
            s.dedup();
            s
        };
        let mut naive_lines = Vec::new();
        for s in scenarios {
            if let (Some(ours), Some(naive)) = (self.row(s, "shelfsync"), self.row(s, "naive")) {
                naive_lines.push(format!(
                    "| {s} | {} | {} | {} | {} | {} |",
                    ratio(naive.change_bytes, ours.change_bytes),
                    ratio(naive.redis_writes, ours.redis_writes),
                    ratio(naive.redis_bytes_in, ours.redis_bytes_in),
                    format_args!("{:.1}%", naive.out_over_in * 100.0),
                    format_args!("{:.2}%", ours.out_over_in * 100.0),
                ));
            }
        }
        if !naive_lines.is_empty() {
            let _ = writeln!(
                md,
                "\nThe naive way (rewrite and republish every record) against shelfsync, same dumps:\n\n\
                 | scenario | bytes out naive / shelfsync | Redis writes naive / shelfsync | bytes to Redis naive / shelfsync | naive out / raw in | shelfsync out / raw in |\n\
                 |---|---:|---:|---:|---:|---:|"
            );
            for l in naive_lines {
                let _ = writeln!(md, "{l}");
            }
        }
        let rewrites: Vec<String> = self
            .imports
            .iter()
            .filter(|r| r.aof_rewrites > 0)
            .map(|r| {
                format!(
                    "{} / {}: {} ({} CPU s / 1M)",
                    r.scenario,
                    r.system,
                    r.aof_rewrites,
                    fmt_num(r.redis_children_cpu_s_per_m)
                )
            })
            .collect();
        if !rewrites.is_empty() {
            let _ = writeln!(
                md,
                "\nAOF rewrites Redis started during an import (the CPU of its forked child is not in \
                 the Redis column): {}.",
                rewrites.join("; ")
            );
        }
        if let Some(mem) = &self.redis_memory {
            let _ = writeln!(
                md,
                "\nRedis memory: {:.0} bytes per record (`used_memory` delta over {} records; dataset {:.0} bytes per record).",
                mem.bytes_per_record, mem.records, mem.dataset_bytes_per_record
            );
            if !mem.per_key_type.is_empty() {
                let parts: Vec<String> =
                    mem.per_key_type.iter().map(|(k, b)| format!("{k} {b:.0}")).collect();
                let _ = writeln!(
                    md,
                    "By key type (`MEMORY USAGE` of place 1, bytes per record): {}.",
                    parts.join(", ")
                );
            }
        }
        let _ = writeln!(md);
    }

    fn durability_word(&self) -> &'static str {
        if self.durable { "durable" } else { "volatile" }
    }

    /// shelfsync next to the PostgreSQL peer, the parse floor and how the peer ran.
    fn md_postgres(&self, md: &mut String) {
        if let Some(pg) = &self.postgres {
            let _ = writeln!(
                md,
                "### PostgreSQL peer, {} (same dumps, same run)\n\n\
                 PostgreSQL {} on its own loopback cluster ({}). Batches of {} rows, one \
                 transaction each: one statement locks the current rows, upserts those whose \
                 payload is distinct and writes their outbox events (before, after), then a \
                 generation-only UPDATE of the others; {} connections. Its input is parsed \
                 before its clock starts; shelfsync's figures are end to end, parsing \
                 included.\n\n\
                 | import | shelfsync records/s | PostgreSQL default records/s | shelfsync ÷ default | PostgreSQL tuned records/s | shelfsync ÷ tuned |\n\
                 |---|---:|---:|---:|---:|---:|",
                self.durability_word(),
                pg.server_version,
                pg.settings,
                pg.batch_rows,
                pg.connections
            );
            let mut scenarios: Vec<&str> = Vec::new();
            for r in &pg.imports {
                if !scenarios.contains(&r.scenario.as_str()) {
                    scenarios.push(&r.scenario);
                }
            }
            for s in scenarios {
                let ours = self.row(s, "shelfsync").map(|r| r.records_per_s);
                let mut cells = vec![s.to_string(), ours.map_or("—".into(), fmt_num)];
                for variant in ["default", "tuned"] {
                    let peer = pg.row(s, variant);
                    let rate = peer.and_then(|r| r.records_per_s);
                    cells.push(match (peer, rate) {
                        (None, _) => "—".into(),
                        (Some(_), None) => "**failed verification**".into(),
                        (Some(_), Some(r)) => fmt_num(r),
                    });
                    cells.push(match (ours, rate) {
                        (Some(a), Some(b)) => format!("{}×", fmt_num(a / b)),
                        _ => "—".into(),
                    });
                }
                let _ = writeln!(md, "| {} |", cells.join(" | "));
            }
            let layouts: Vec<String> = ["default", "tuned"]
                .iter()
                .filter_map(|v| pg.imports.iter().find(|r| r.variant == *v))
                .map(|r| format!("{}: {}", r.variant, r.layout))
                .collect();
            let _ = writeln!(md, "\nVariants — {}.", layouts.join("; "));
            if !pg.probe.is_empty() {
                let tried: Vec<String> = pg
                    .probe
                    .iter()
                    .map(|r| {
                        let rate = r.records_per_s.map_or("failed verification".into(), fmt_num);
                        format!("{} → {rate}", r.connections)
                    })
                    .collect();
                let _ = writeln!(
                    md,
                    "Connections tried on the initial import (default variant, records/s): {}; \
                     kept {}.",
                    tried.join(", "),
                    pg.connections
                );
            }
            let _ = writeln!(
                md,
                "\n| import | variant | records/s | s | server CPU s / 1M | client CPU s / 1M | outbox events (expected) | generation-only updates | verified |\n\
                 |---|---|---:|---:|---:|---:|---:|---:|---|"
            );
            for r in &pg.imports {
                let verified = if r.problems.is_empty() {
                    "yes".to_string()
                } else {
                    format!("**NO**: {}", r.problems.join("; "))
                };
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} ({}) | {} | {} |",
                    r.scenario,
                    r.variant,
                    r.records_per_s.map_or("—".into(), fmt_num),
                    fmt_num(r.seconds),
                    r.server_cpu_s_per_m.map_or("—".into(), fmt_num),
                    fmt_num(r.client_cpu_s_per_m),
                    r.changes,
                    r.expected_changes,
                    r.stamped,
                    verified
                );
            }
            let _ = writeln!(md);
        }
        if let Some(f) = &self.parse_floor {
            let _ = writeln!(
                md,
                "Parse floor (ingest's parser alone, each item of the base dump into the feed's \
                 fields and nothing else): {} records/s, {} MB/s, {} CPU s per 1M records.\n",
                fmt_num(f.records_per_s),
                fmt_num(f.raw_mb_per_s),
                fmt_num(f.cpu_s_per_m)
            );
        }
    }

    fn md_live(&self, md: &mut String) {
        if !self.keyframes.is_empty() {
            let _ = writeln!(
                md,
                "### Keyframes\n\n| keyframe | records | places | duration s | records/s | storage CPU s | longest partition hold ms | gave way to live s | live p99 during / without |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for k in &self.keyframes {
                let live = match (k.live_p99_ms, k.live_baseline_p99_ms) {
                    (Some(d), Some(b)) => format!("{} / {} ms", fmt_num(d), fmt_num(b)),
                    _ => "—".into(),
                };
                let longest = k.longest_place_ms.map_or("≤ previous".into(), fmt_num);
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    k.label,
                    k.records,
                    k.places,
                    fmt_num(k.duration_s),
                    fmt_num(k.records_per_s),
                    fmt_num(k.storage_cpu_s),
                    longest,
                    fmt_num(k.gave_way_s),
                    live
                );
            }
            if let Some(b) = self.feed_bootstrap_s {
                let _ = writeln!(
                    md,
                    "\nChangeFeed consumer bootstrap from the idle keyframe: {} s.",
                    fmt_num(b)
                );
            }
            let _ = writeln!(md);
        }
        if !self.freshness.is_empty() {
            let _ = writeln!(
                md,
                "### Freshness (ingest publish → ChangeFeed consumer → recommender index)\n\n\
                 | run | offered /s | changes timed / published | window s | publish → applied by storage | publish → consumer | publish → index updated |\n|---|---:|---:|---:|---|---|---|"
            );
            for f in &self.freshness {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} / {} | {} | {} | {} | {} |",
                    f.label,
                    fmt_num(f.offered_per_s),
                    f.received,
                    f.published,
                    fmt_num(f.window_s),
                    f.applied.render(),
                    f.arrival.render(),
                    f.indexed.render()
                );
            }
            let _ = writeln!(md);
        }
    }

    fn md_rss(&self, md: &mut String) {
        if self.rss.is_empty() {
            return;
        }
        let _ = writeln!(
            md,
            "### Ingest memory (import in a child process)\n\n| dump MB | items | peak RSS MB | RSS at start MB | import s | items/s | MB/s | CPU s |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.rss {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                fmt_num(r.dump_mb),
                r.items,
                fmt_num(r.peak_rss_mb),
                fmt_num(r.rss_at_start_mb),
                fmt_num(r.import_s),
                fmt_num(r.items_per_s),
                fmt_num(r.mb_per_s),
                fmt_num(r.cpu_s)
            );
        }
        let _ = writeln!(md);
    }

    fn md_recommender(&self, md: &mut String) {
        let Some(r) = &self.recommender else { return };
        let _ = writeln!(
            md,
            "### Recommender\n\n{} offers indexed, bootstrapped from the keyframe in {} s.\n\n\
             | measurement | result |\n|---|---|\n\
             | top-10 in-process (`Api::top`), idle | {} |\n\
             | top-10 in-process, index updated at the live rate | {} |",
            r.offers,
            fmt_num(r.bootstrap_s),
            r.query_idle.render(),
            r.query_live.render()
        );
        for h in &r.http {
            let lat = h.latency.as_ref().map_or(String::new(), |l| format!(", {}", l.render()));
            let _ = writeln!(
                md,
                "| HTTP `GET /v1/top`, {} connections, {} | {} req/s ({} requests, {} errors{}) |",
                h.connections,
                h.tool,
                fmt_num(h.requests_per_s),
                h.requests,
                h.errors,
                lat
            );
        }
        let _ = writeln!(md);
    }
}

fn ratio(a: u64, b: u64) -> String {
    if b == 0 {
        if a == 0 { "—".into() } else { "∞".into() }
    } else {
        format!("{}×", fmt_num(a as f64 / b as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(scenario: &str, system: &str, rps: f64, changes: u64) -> ImportRow {
        ImportRow {
            scenario: scenario.into(),
            system: system.into(),
            records: 1000,
            raw_bytes: 240_000,
            records_per_s: rps,
            changes,
            expected_changes: changes,
            // 1% of 1000 records at 400 bytes each: 1.67% of the raw bytes.
            change_bytes: changes * 400,
            out_over_in: changes as f64 * 400.0 / 240_000.0,
            ..Default::default()
        }
    }

    /// The peer's targets: ratios of the same imports in the same run, judged
    /// only on durable servers; an unverified peer figure is not measured.
    #[test]
    fn peer_targets_are_same_run_ratios_on_durable_servers() {
        use crate::reimport::{CHURN, IDENTICAL, INITIAL};
        let ours = |s: &str, rps: f64, ingest: f64, writes: u64| ImportRow {
            ingest_cpu_s_per_m: ingest,
            redis_writes: writes,
            ..row(s, "shelfsync", rps, 0)
        };
        let peer = |s: &str, v: &str, rps: Option<f64>| PeerImportRow {
            scenario: s.into(),
            variant: v.into(),
            records_per_s: rps,
            ..Default::default()
        };
        let report = |churn: f64, tuned_initial: Option<f64>, durable: bool| {
            let mut r = Report {
                durable,
                imports: vec![
                    ours(INITIAL, 120.0, 1.0, 1000),
                    ours(IDENTICAL, 500.0, 1.2, 5),
                    ours(CHURN, churn, 2.9, 20),
                ],
                parse_floor: Some(ParseFloor { cpu_s_per_m: 1.0, ..Default::default() }),
                postgres: Some(PostgresPeer {
                    imports: vec![
                        peer(CHURN, "default", Some(100.0)),
                        peer(INITIAL, "tuned", tuned_initial),
                        peer(IDENTICAL, "tuned", Some(200.0)),
                        peer(CHURN, "tuned", Some(150.0)),
                    ],
                    ..Default::default()
                }),
                redis_memory: Some(RedisMemory { bytes_per_record: 250.0, ..Default::default() }),
                ..Default::default()
            };
            r.finish(Duration::from_secs(1));
            r
        };
        let holds = |r: &Report, name: &str| {
            r.targets.iter().find(|t| t.target.starts_with(name)).expect(name).holds
        };
        let good = report(310.0, Some(100.0), true);
        assert_eq!(holds(&good, "1% churn re-import ≥ 3× PostgreSQL default"), Some(true));
        assert_eq!(holds(&good, "ahead of PostgreSQL tuned"), Some(true));
        assert_eq!(holds(&good, "ingest CPU per record ≤ 3×"), Some(true));
        assert_eq!(holds(&good, "identical re-import writes ≤ 1%"), Some(true));
        assert_eq!(holds(&good, "Redis memory ≤ 280"), Some(true));
        let short = report(290.0, Some(130.0), true);
        assert_eq!(holds(&short, "1% churn re-import ≥ 3× PostgreSQL default"), Some(false));
        assert_eq!(holds(&short, "ahead of PostgreSQL tuned"), Some(false), "initial 0.92×");
        let volatile = report(310.0, Some(100.0), false);
        assert_eq!(holds(&volatile, "1% churn re-import ≥ 3× PostgreSQL default"), None);
        let unverified = report(310.0, None, true);
        assert_eq!(holds(&unverified, "ahead of PostgreSQL tuned"), None);
    }

    #[test]
    fn targets_compare_against_the_same_run_floor() {
        let mut r = Report {
            imports: vec![
                row("identical re-import", "shelfsync", 100.0, 0),
                row("re-import, 1% churn", "shelfsync", 60.0, 10),
                row("re-import, 1% churn", "floor", 100.0, 0),
                row("re-import, 1% churn", "naive", 50.0, 1000),
            ],
            ..Default::default()
        };
        r.link_floor();
        r.finish(Duration::from_secs(1));
        let t = |name: &str| r.targets.iter().find(|t| t.target.starts_with(name)).expect(name);
        assert_eq!(t("re-import with 1% churn").holds, Some(true));
        assert!(t("re-import with 1% churn").measured.starts_with("60%"));
        assert_eq!(t("identical re-import").holds, Some(true));
        assert_eq!(t("change bytes out").holds, Some(true));
        assert_eq!(t("freshness").holds, None);

        let md = r.markdown();
        assert!(md.contains("| re-import, 1% churn | shelfsync | 60.0 |"), "{md}");
        assert!(md.contains("naive / shelfsync"), "{md}");
        assert!(md.contains("| 100× |") || md.contains("100×"), "{md}");
    }

    fn peer_row(scenario: &str, variant: &str, rate: Option<f64>) -> PeerImportRow {
        PeerImportRow {
            scenario: scenario.into(),
            variant: variant.into(),
            layout: format!("{variant} layout"),
            connections: 4,
            records: 1000,
            records_per_s: rate,
            problems: if rate.is_some() { Vec::new() } else { vec!["3 rows not stamped".into()] },
            ..Default::default()
        }
    }

    #[test]
    fn the_postgres_table_sets_shelfsync_against_each_variant() {
        let r = Report {
            durable: true,
            imports: vec![row("initial import", "shelfsync", 300.0, 1000)],
            postgres: Some(PostgresPeer {
                connections: 4,
                probe: vec![peer_row("initial import", "default", Some(50.0))],
                imports: vec![
                    peer_row("initial import", "default", Some(100.0)),
                    peer_row("identical re-import", "default", None),
                    peer_row("initial import", "tuned", Some(150.0)),
                    peer_row("identical re-import", "tuned", Some(120.0)),
                ],
                ..Default::default()
            }),
            parse_floor: Some(ParseFloor { records_per_s: 4000.0, ..Default::default() }),
            ..Default::default()
        };
        let md = r.markdown();
        assert!(md.contains("| initial import | 300 | 100 | 3.00× | 150 | 2.00× |"), "{md}");
        assert!(md.contains("### PostgreSQL peer, durable"), "{md}");
        assert!(!md.contains("volatile"), "{md}");
        assert!(
            md.contains("| identical re-import | — | **failed verification** | — | 120 | — |"),
            "{md}"
        );
        // One line per import kind, whatever the order of the peer's rows.
        assert_eq!(md.matches("| initial import | 300 |").count(), 1, "{md}");
        assert!(md.contains("**NO**: 3 rows not stamped"), "{md}");
        assert!(md.contains("4 → 50.0; kept 4"), "{md}");
        assert!(md.contains("Parse floor") && md.contains("4000 records/s"), "{md}");
        assert_eq!(r.postgres.as_ref().map(|p| p.failures().len()), Some(1));
    }

    #[test]
    fn aof_rewrites_during_an_import_are_listed_with_their_cpu() {
        let quiet = Report {
            imports: vec![row("identical re-import", "shelfsync", 300.0, 0)],
            ..Default::default()
        };
        assert!(!quiet.markdown().contains("AOF rewrites"), "{}", quiet.markdown());
        let r = Report {
            imports: vec![ImportRow {
                aof_rewrites: 3,
                redis_children_cpu_s_per_m: 1.74,
                ..row("initial import", "shelfsync", 300.0, 1000)
            }],
            ..Default::default()
        };
        let md = r.markdown();
        assert!(md.contains("initial import / shelfsync: 3 (1.74 CPU s / 1M)"), "{md}");
        assert!(r.imports[0].summary().ends_with("3 AOF rewrites (1.74 CPU s / 1M)"));
    }

    #[test]
    fn a_slow_churn_import_misses_its_target() {
        let mut r = Report {
            imports: vec![
                row("re-import, 1% churn", "shelfsync", 40.0, 10),
                row("re-import, 1% churn", "floor", 100.0, 0),
            ],
            ..Default::default()
        };
        r.link_floor();
        r.finish(Duration::from_secs(1));
        assert_eq!(r.targets[0].holds, Some(false));
        assert!(r.markdown().contains("**NO**"));
    }
}

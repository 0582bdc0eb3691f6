//! What a run found: the data (`bench.json`), the tables (`bench.md`, also printed), and the
//! The performance targets (docs/DESIGN.md) checked against same-run references.

use std::time::Duration;

use serde::Serialize;

use crate::measure::RedisInfo;
use crate::profile::Profile;
use crate::stats::Percentiles;
use crate::world::World;

mod markdown;
mod targets;
#[cfg(test)]
mod tests;

/// Names of the full-dump scenarios, shared with the PostgreSQL peer so the report can put
/// the same imports side by side.
pub const INITIAL: &str = "initial import";
pub const IDENTICAL: &str = "identical re-import";
pub const CHURN: &str = "re-import, 1% churn";
pub const CHURN_BACK: &str = "re-import, 1% churn back";

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
    /// NATS was a 3-node cluster with R3 streams (`--nats-cluster`).
    pub nats_cluster: bool,
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
    /// What the run's NATS stores per second, separate publishes vs atomic batches.
    pub live_store_floor: Option<StoreFloor>,
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

/// Messages per second one stream of the run's NATS stores (`store_floor`).
#[derive(Debug, Default, Serialize)]
pub struct StoreFloor {
    pub messages: u64,
    pub subjects: u64,
    /// Separate publishes, `in_flight` at once.
    pub separate_per_s: f64,
    pub in_flight: u64,
    /// Atomic batches of `batch` messages.
    pub atomic_per_s: f64,
    pub batch: u64,
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
            nats_cluster: world.cluster(),
            durability: world.durability(),
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
}

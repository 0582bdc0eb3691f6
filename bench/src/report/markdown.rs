//! The tables of a run: `bench.md`, also printed, and `bench.json` next to it.

use std::fmt::Write as _;
use std::path::Path;

use super::Report;
use crate::stats::fmt_num;

impl Report {
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

    pub(crate) fn durability_word(&self) -> &'static str {
        match (self.nats_cluster, self.durable) {
            (true, true) => "R3 NATS cluster, Redis durable",
            (true, false) => "R3 NATS cluster, Redis volatile",
            (false, true) => "durable",
            (false, false) => "volatile",
        }
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

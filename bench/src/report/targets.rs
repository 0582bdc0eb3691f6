//! The performance targets (docs/DESIGN.md) checked against same-run references.

use super::{CHURN, CHURN_BACK, IDENTICAL, INITIAL, ImportRow, Report, TargetCheck};
use crate::stats::fmt_num;

impl Report {
    /// The performance targets, each against its same-run reference.
    pub(super) fn check_targets(&self) -> Vec<TargetCheck> {
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
        // Only durable servers are the target's conditions.
        let judged = |holds: bool| (self.durable && !self.nats_cluster).then_some(holds);
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
        let full_dumps = [INITIAL, IDENTICAL, CHURN, CHURN_BACK];
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
}

//! Prometheus metrics: one process-wide recorder (`metrics` crate, rendered
//! by `metrics-exporter-prometheus`), installed on first use, so recording
//! works the same in services and in tests; [`render_metrics`] is what a
//! `/metrics` endpoint returns.

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Metric names shared by the services and the dashboards.
pub mod names {
    /// Storage: commands applied (unchanged ones included).
    pub const COMMANDS_APPLIED: &str = "shelfsync_commands_applied_total";
    /// Storage: applied commands that changed nothing observable.
    pub const COMMANDS_UNCHANGED: &str = "shelfsync_commands_unchanged_total";
    /// Storage: changes emitted (records that really changed).
    pub const CHANGES_EMITTED: &str = "shelfsync_changes_emitted_total";
    /// Storage: commands refused by their compare-and-swap.
    pub const CAS_CONFLICTS: &str = "shelfsync_cas_conflicts_total";
    /// Rejected commands (storage) and feed items (ingest), label `reason`.
    pub const REJECTS: &str = "shelfsync_rejects_total";
    /// Storage: time to handle one command message (histogram).
    pub const BATCH_SECONDS: &str = "shelfsync_batch_seconds";
    /// From a command's `Origin.published_at` to its application, label
    /// `stage` (`storage`, `consumer`).
    pub const FRESHNESS_SECONDS: &str = "shelfsync_freshness_seconds";
    /// Messages a consumer has not received yet, label `consumer`.
    pub const CONSUMER_LAG: &str = "shelfsync_consumer_lag";
    /// Storage: outbox entries waiting to be published.
    pub const OUTBOX_DEPTH: &str = "shelfsync_outbox_depth";
    /// Storage: time one place's keyframe took (histogram).
    pub const KEYFRAME_SECONDS: &str = "shelfsync_keyframe_seconds";
    /// Storage: time keyframes gave way to late live changes.
    pub const KEYFRAME_YIELD_US: &str = "shelfsync_keyframe_yield_microseconds_total";
    /// Ingest: valid feed items turned into commands.
    pub const INGEST_ITEMS: &str = "shelfsync_ingest_items_total";
    /// Ingest: raw feed bytes read.
    pub const INGEST_BYTES: &str = "shelfsync_ingest_bytes_total";
    /// Ingest: when the last import of a partner completed (Unix seconds; an
    /// unchanged feed counts), label `partner`.
    pub const INGEST_LAST_SUCCESS: &str = "shelfsync_ingest_last_success_timestamp_seconds";
    /// Ingest: a polled partner's poll interval (seconds), label `partner`.
    pub const INGEST_POLL_INTERVAL: &str = "shelfsync_ingest_poll_interval_seconds";
    /// Ingest: push requests refused, labels `partner` (a configured name,
    /// or `unknown`) and `reason`.
    pub const INGEST_PUSH_REFUSED: &str = "shelfsync_ingest_push_refused_total";
    /// Feed kit: places reloaded after a digest mismatch.
    pub const FEED_DRIFT_REPAIRS: &str = "shelfsync_feed_drift_repairs_total";
    /// Storage: outbox entries a retried relay found already stored (by
    /// message id, past any dedup window) and did not publish again.
    pub const OUTBOX_ALREADY_STORED: &str = "shelfsync_outbox_already_stored_total";
    /// Storage: outbox entries published split or reduced because they were
    /// refused as too large.
    pub const OUTBOX_REDUCED: &str = "shelfsync_outbox_reduced_total";
    /// Storage: outbox entries that could not be published at all and were
    /// kept aside (`shelfsync dead-letters`), label `reason`.
    pub const OUTBOX_UNPUBLISHABLE: &str = "shelfsync_outbox_unpublishable_total";
    /// Storage: partitions refused because their command stream was replaced
    /// (1 while refused), label `partition`.
    pub const PARTITION_REFUSED: &str = "shelfsync_partition_refused";
    /// Storage: sweeps held instead of applied, label `reason`.
    pub const SWEEPS_HELD: &str = "shelfsync_sweeps_held_total";
    /// Storage: sweeps applied (records marked absent counted apart).
    pub const SWEEPS_APPLIED: &str = "shelfsync_sweeps_applied_total";
    /// Storage: absent records purged after `storage.absent_ttl`.
    pub const ABSENT_PURGED: &str = "shelfsync_absent_purged_total";
    /// Storage: commits that waited for Redis replicas (`redis.wait_replicas`)
    /// longer than one `redis.wait_timeout`.
    pub const REDIS_WAIT_RETRIES: &str = "shelfsync_redis_wait_retries_total";
}

/// Bucket bounds (seconds) of every `*_seconds` histogram.
const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
];

/// How often histogram samples are folded into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder if it is not yet (idempotent, cheap).
/// Metrics recorded before it is installed are lost, so services call it
/// when they start; `init` does too.
pub fn install_metrics() {
    handle();
}

fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .ok()?;
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // Another recorder already installed (by a library or a test):
            // keep ours for rendering, it just stays empty.
            let _ = metrics::set_global_recorder(recorder);
            describe();
            let upkeep = handle.clone();
            let _ = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || {
                loop {
                    std::thread::sleep(UPKEEP_EVERY);
                    upkeep.run_upkeep();
                }
            });
            Some(handle)
        })
        .as_ref()
}

/// Every metric of this process in the Prometheus text format.
pub fn render_metrics() -> String {
    handle().map(|h| h.render()).unwrap_or_default()
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    use names::*;
    describe_counter!(COMMANDS_APPLIED, "Commands applied by storage (unchanged ones included)");
    describe_counter!(COMMANDS_UNCHANGED, "Applied commands that changed nothing observable");
    describe_counter!(CHANGES_EMITTED, "Record changes emitted by storage");
    describe_counter!(CAS_CONFLICTS, "Commands refused by their compare-and-swap");
    describe_counter!(REJECTS, "Rejected commands and feed items, by reason");
    describe_histogram!(BATCH_SECONDS, Unit::Seconds, "Storage time per command message");
    describe_histogram!(
        FRESHNESS_SECONDS,
        Unit::Seconds,
        "From a command's publication to its application, by stage"
    );
    describe_gauge!(CONSUMER_LAG, "Messages not yet delivered to a consumer");
    describe_gauge!(OUTBOX_DEPTH, "Storage outbox entries waiting to be published");
    describe_histogram!(KEYFRAME_SECONDS, Unit::Seconds, "Time of one place's keyframe");
    describe_counter!(
        KEYFRAME_YIELD_US,
        Unit::Microseconds,
        "Time keyframes gave way to late live changes"
    );
    describe_counter!(INGEST_ITEMS, "Valid feed items turned into commands");
    describe_counter!(INGEST_BYTES, Unit::Bytes, "Raw feed bytes read by ingest");
    describe_gauge!(INGEST_LAST_SUCCESS, Unit::Seconds, "When a partner's last import completed (Unix time)");
    describe_gauge!(INGEST_POLL_INTERVAL, Unit::Seconds, "A polled partner's poll interval");
    describe_counter!(
        INGEST_PUSH_REFUSED,
        "Push requests refused by ingest (credentials, size), by partner and reason"
    );
    describe_counter!(FEED_DRIFT_REPAIRS, "Places reloaded after a digest mismatch");
    describe_counter!(
        OUTBOX_ALREADY_STORED,
        "Outbox entries a retried relay found already on the stream and did not publish again"
    );
    describe_counter!(OUTBOX_REDUCED, "Outbox entries published split or reduced (too large)");
    describe_counter!(
        OUTBOX_UNPUBLISHABLE,
        "Outbox entries that could not be published and were kept aside, by reason"
    );
    describe_gauge!(PARTITION_REFUSED, "1 while a partition is refused: its command stream was replaced");
    describe_counter!(SWEEPS_HELD, "Sweeps held instead of applied, by reason");
    describe_counter!(SWEEPS_APPLIED, "Sweeps applied");
    describe_counter!(ABSENT_PURGED, "Absent records purged after the absent TTL");
    describe_counter!(
        REDIS_WAIT_RETRIES,
        "Commits whose Redis replicas did not confirm within one wait timeout"
    );
}

/// Seconds from `published_at_us` (microseconds since the epoch) to now;
/// `None` when it is unset. Clock skew between hosts can make it negative:
/// clamped to zero.
pub fn seconds_since_us(published_at_us: i64) -> Option<f64> {
    if published_at_us <= 0 {
        return None;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    Some((now - published_at_us).max(0) as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_renders() {
        install_metrics();
        metrics::counter!(names::REJECTS, "reason" => "unit_test").increment(2);
        metrics::histogram!(names::BATCH_SECONDS).record(0.003);
        let text = render_metrics();
        assert!(text.contains("shelfsync_rejects_total{reason=\"unit_test\"} 2"), "{text}");
        assert!(text.contains("shelfsync_batch_seconds_bucket{le=\"0.005\"} 1"), "{text}");
        assert_eq!(seconds_since_us(0), None);
        assert!(seconds_since_us(1).is_some_and(|s| s > 1e6));
    }
}

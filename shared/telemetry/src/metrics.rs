//! Prometheus metrics: one process-wide recorder (`metrics` crate, rendered
//! by `metrics-exporter-prometheus`), installed on first use, so recording
//! works the same in services and in tests; [`render_metrics`] is what a
//! `/metrics` endpoint returns, the process metrics (`metrics-process`:
//! CPU seconds, resident memory, open file descriptors, start time)
//! brought up to date first.
//!
//! Names follow the Prometheus conventions: base units (seconds, bytes) in
//! the name, `_total` on counters, and label values that are the same after
//! a restart (configured names, reasons, route templates; never a pid, a
//! host name or a per-instance consumer name).

use std::sync::{LazyLock, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Metric names shared by the services and the dashboards. A service whose
/// metrics are its own alone keeps them in its own `metrics` module (the
/// aggregator's, the recommender's).
pub mod names {
    /// 1, labels `version` (the workspace version), `revision` (the git
    /// commit built, `unknown` when the build did not know it) and
    /// `service`: what every other series of the process joins on.
    pub const BUILD_INFO: &str = "shelfsync_build_info";
    /// HTTP servers: requests answered, labels `method`, `status`,
    /// `endpoint` (the route template). Recorded by `axum-prometheus`.
    pub const HTTP_REQUESTS: &str = "shelfsync_http_requests_total";
    /// HTTP servers: time to answer a request (histogram), same labels.
    pub const HTTP_REQUEST_SECONDS: &str = "shelfsync_http_requests_duration_seconds";
    /// HTTP servers: requests being answered, labels `method`, `endpoint`.
    pub const HTTP_REQUESTS_PENDING: &str = "shelfsync_http_requests_pending";
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
    /// Storage: each time a keyframe gave way to late live changes, how
    /// long (histogram; its `_sum` is the total time given way).
    pub const KEYFRAME_YIELD_SECONDS: &str = "shelfsync_keyframe_yield_seconds";
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
    /// Gauge, per partner: the places ingest remembers its full imports
    /// carried (each gets a sweep at every full import until forgotten).
    pub const INGEST_KNOWN_PLACES: &str = "shelfsync_ingest_known_places";
    /// Feed kit: places reloaded after a digest mismatch.
    pub const FEED_DRIFT_REPAIRS: &str = "shelfsync_feed_drift_repairs_total";
    /// Feed kit: record versions delivered to the service's handler.
    pub const FEED_DELIVERED: &str = "shelfsync_feed_delivered_total";
    /// Feed kit: changes skipped as not newer than what was delivered.
    pub const FEED_DUPLICATES: &str = "shelfsync_feed_duplicates_total";
    /// Feed kit: change messages dropped as undecodable.
    pub const FEED_POISON: &str = "shelfsync_feed_poison_total";
    /// Feed kit: CHANGES stream sequence last handled.
    pub const FEED_POSITION: &str = "shelfsync_feed_position";
    /// Validator: hide / un-hide decisions, label `decision`.
    pub const VALIDATOR_DECISIONS: &str = "shelfsync_validator_decisions_total";
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
    /// Storage: sweeps whose census scanned their place in Redis (the
    /// others were counted from the live records the partition owner keeps).
    pub const SWEEP_SCANS: &str = "shelfsync_sweep_scans_total";
    /// Storage: absent records purged after `storage.absent_ttl`.
    pub const ABSENT_PURGED: &str = "shelfsync_absent_purged_total";
    /// Storage: commits that waited for Redis replicas (`redis.wait_replicas`)
    /// longer than one `redis.wait_timeout`.
    pub const REDIS_WAIT_RETRIES: &str = "shelfsync_redis_wait_retries_total";
    /// Storage: 1 while a partition waits for room (`cause`: redis_full,
    /// redis, redis_replicas, nats_refused, nats).
    pub const PARTITION_BACKPRESSURE: &str = "shelfsync_partition_backpressure";
    /// Storage: retries of a partition waiting for room, by cause.
    pub const BACKPRESSURE_RETRIES: &str = "shelfsync_backpressure_retries_total";
    /// Storage: times Redis was found behind a partition owner's last commit
    /// (a failover to a lagging replica, a restart from an older file).
    pub const REDIS_WENT_BACK: &str = "shelfsync_redis_went_back_total";
    /// Storage: what the partition owners of a replica remember, by kind
    /// (noops, live), against `storage.known_records` each.
    pub const KNOWN_RECORDS: &str = "shelfsync_known_records";
    /// Storage: sweep outcomes and touched sets kept in Redis, by kind, and
    /// keyframe places queued in memory.
    pub const KEPT: &str = "shelfsync_kept";
}

/// Bucket bounds (seconds) of every `*_seconds` histogram.
const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
];

/// How often histogram samples are folded into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Reads this process's CPU time, memory, file descriptors and start time.
static PROCESS: LazyLock<metrics_process::Collector> =
    LazyLock::new(metrics_process::Collector::default);

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

/// Every metric of this process in the Prometheus text format, the process
/// metrics read just before.
pub fn render_metrics() -> String {
    let Some(handle) = handle() else {
        return String::new();
    };
    PROCESS.collect();
    handle.render()
}

/// Serialises [`render_metrics_after`].
static SCRAPE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// As [`render_metrics`], `update` having first set the values a service
/// keeps elsewhere (atomics it publishes as counters and gauges). One
/// scrape at a time: the recorder is process-wide, and a test process may
/// run several instances of a service.
pub fn render_metrics_after(update: impl FnOnce()) -> String {
    let _one_at_a_time = SCRAPE.lock().unwrap_or_else(|e| e.into_inner());
    update();
    render_metrics()
}

/// Sets `shelfsync_build_info{version, revision, service}` to 1: what runs
/// where, to join on in queries and dashboards
/// (`… * on (job, instance) group_left (version, revision) shelfsync_build_info`).
pub fn set_build_info(service: &str) {
    install_metrics();
    metrics::gauge!(
        names::BUILD_INFO,
        "version" => crate::VERSION,
        "revision" => crate::REVISION.unwrap_or("unknown"),
        "service" => service.to_string()
    )
    .set(1.0);
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    use names::*;
    PROCESS.describe();
    describe_gauge!(BUILD_INFO, "1, labelled with the version, the git revision and the service");
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
    describe_histogram!(
        KEYFRAME_YIELD_SECONDS,
        Unit::Seconds,
        "Each time a keyframe gave way to late live changes, how long"
    );
    describe_counter!(INGEST_ITEMS, "Valid feed items turned into commands");
    describe_counter!(INGEST_BYTES, Unit::Bytes, "Raw feed bytes read by ingest");
    describe_gauge!(
        INGEST_LAST_SUCCESS,
        Unit::Seconds,
        "When a partner's last import completed (Unix time)"
    );
    describe_gauge!(INGEST_POLL_INTERVAL, Unit::Seconds, "A polled partner's poll interval");
    describe_gauge!(
        INGEST_KNOWN_PLACES,
        "Places a partner's full imports carried that ingest still remembers (ingest.forget_places_after)"
    );
    describe_counter!(
        INGEST_PUSH_REFUSED,
        "Push requests refused by ingest (credentials, size), by partner and reason"
    );
    describe_counter!(FEED_DRIFT_REPAIRS, "Places reloaded after a digest mismatch");
    describe_counter!(FEED_DELIVERED, "Record versions delivered to the handler");
    describe_counter!(FEED_DUPLICATES, "Changes skipped as not newer than what was delivered");
    describe_counter!(FEED_POISON, "Change messages dropped as undecodable");
    describe_gauge!(FEED_POSITION, "CHANGES stream sequence last handled");
    describe_counter!(VALIDATOR_DECISIONS, "Validator decisions, by decision (hide, unhide)");
    describe_counter!(
        OUTBOX_ALREADY_STORED,
        "Outbox entries a retried relay found already on the stream and did not publish again"
    );
    describe_counter!(OUTBOX_REDUCED, "Outbox entries published split or reduced (too large)");
    describe_counter!(
        OUTBOX_UNPUBLISHABLE,
        "Outbox entries that could not be published and were kept aside, by reason"
    );
    describe_gauge!(
        PARTITION_REFUSED,
        "1 while a partition is refused: its command stream was replaced, or the message it was \
         applying in steps is gone"
    );
    describe_counter!(SWEEPS_HELD, "Sweeps held instead of applied, by reason");
    describe_counter!(SWEEPS_APPLIED, "Sweeps applied");
    describe_counter!(
        SWEEP_SCANS,
        "Sweep censuses that scanned their place in Redis (the others were counted in memory)"
    );
    describe_counter!(ABSENT_PURGED, "Absent records purged after the absent TTL");
    describe_counter!(
        REDIS_WAIT_RETRIES,
        "Commits whose Redis replicas did not confirm within one wait timeout"
    );
    describe_gauge!(
        PARTITION_BACKPRESSURE,
        "1 while a partition waits for room (Redis full or away, a stream refusing), by cause"
    );
    describe_counter!(BACKPRESSURE_RETRIES, "Retries of partitions waiting for room, by cause");
    describe_counter!(
        REDIS_WENT_BACK,
        "Times Redis was found behind a partition owner's last commit (what it remembered dropped)"
    );
    describe_gauge!(KNOWN_RECORDS, "Records the partition owners remember in memory, by kind");
    describe_gauge!(
        KEPT,
        "Things kept that have a bound or an expiry (sweep outcomes, touched sets, keyframe places queued)"
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
        set_build_info("unit-test");
        let text = render_metrics();
        assert!(text.contains("shelfsync_rejects_total{reason=\"unit_test\"} 2"), "{text}");
        let build = format!(
            "shelfsync_build_info{{version=\"{}\",revision=\"{}\",service=\"unit-test\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::REVISION.unwrap_or("unknown")
        );
        assert!(text.contains(&build), "{text}");
        for process in [
            "# TYPE process_cpu_seconds_total counter",
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_start_time_seconds ",
        ] {
            assert!(text.contains(process), "{process} missing from\n{text}");
        }
        assert!(text.contains("shelfsync_batch_seconds_bucket{le=\"0.005\"} 1"), "{text}");
        assert_eq!(seconds_since_us(0), None);
        assert!(seconds_since_us(1).is_some_and(|s| s > 1e6));
    }
}

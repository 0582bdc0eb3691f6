//! The environment that hands a process's settings to a child process.

use std::time::Duration;

use shelfsync_settings::Settings;

/// The `SHELFSYNC__SECTION__KEY` variables that reproduce `s` for a child
/// process (a service binary started by a test or the benchmark harness):
/// the servers, names and timings those set; the rest stays at its default.
pub fn settings_env(s: &Settings) -> Vec<(String, String)> {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    vec![
        ("SHELFSYNC__NATS__URL".into(), s.nats.url.clone()),
        ("SHELFSYNC__NATS__PREFIX".into(), s.nats.prefix.clone()),
        // The streams' shape: services verify the streams against it at start.
        ("SHELFSYNC__NATS__STREAM_REPLICAS".into(), s.nats.stream_replicas.to_string()),
        ("SHELFSYNC__NATS__DUPLICATE_WINDOW".into(), ms(s.nats.duplicate_window)),
        ("SHELFSYNC__NATS__CHANGES_MAX_AGE".into(), ms(s.nats.changes_max_age)),
        ("SHELFSYNC__NATS__CMD_MAX_BYTES".into(), s.nats.cmd_max_bytes.to_string()),
        ("SHELFSYNC__NATS__CHANGES_MAX_BYTES".into(), s.nats.changes_max_bytes.to_string()),
        ("SHELFSYNC__NATS__KEYFRAMES_MAX_BYTES".into(), s.nats.keyframes_max_bytes.to_string()),
        ("SHELFSYNC__NATS__AGGREGATES_MAX_BYTES".into(), s.nats.aggregates_max_bytes.to_string()),
        ("SHELFSYNC__NATS__REJECTS_MAX_BYTES".into(), s.nats.rejects_max_bytes.to_string()),
        ("SHELFSYNC__REDIS__URL".into(), s.redis.url.clone()),
        ("SHELFSYNC__REDIS__NAMESPACE".into(), s.redis.namespace.clone()),
        ("SHELFSYNC__REDIS__WAIT_REPLICAS".into(), s.redis.wait_replicas.to_string()),
        ("SHELFSYNC__REDIS__WAIT_TIMEOUT".into(), ms(s.redis.wait_timeout)),
        ("SHELFSYNC__STORAGE__PARTITIONS".into(), s.storage.partitions.to_string()),
        ("SHELFSYNC__STORAGE__ACK_WAIT".into(), ms(s.storage.ack_wait)),
        ("SHELFSYNC__STORAGE__RETRY_DELAY".into(), ms(s.storage.retry_delay)),
        ("SHELFSYNC__STORAGE__TOMBSTONE_TTL".into(), ms(s.storage.tombstone_ttl)),
        ("SHELFSYNC__STORAGE__PURGE_INTERVAL".into(), ms(s.storage.purge_interval)),
        ("SHELFSYNC__STORAGE__HTTP_LISTEN".into(), s.storage.http_listen.clone()),
        ("SHELFSYNC__STORAGE__KEYFRAME_SCHEDULE".into(), s.storage.keyframe_schedule.clone()),
        ("SHELFSYNC__STORAGE__READ_AHEAD".into(), s.storage.read_ahead.to_string()),
        ("SHELFSYNC__INGEST__LISTEN".into(), s.ingest.listen.clone()),
        ("SHELFSYNC__TELEMETRY__LOG_LEVEL".into(), s.telemetry.log_level.clone()),
    ]
}

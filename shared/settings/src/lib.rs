//! Typed settings shared by every shelfsync binary (docs/DESIGN.md,
//! Configuration).
//!
//! Layers, lowest first: built-in defaults, the TOML files given with
//! `--config FILE` (several, in order: a later file overrides an earlier
//! one key by key, and replaces an array such as `[[partners]]` whole), the
//! conventional `NATS_URL` / `REDIS_URL` variables, then
//! `SHELFSYNC__SECTION__KEY` overrides. Every service reads the same file
//! shape and takes the sections it needs. Owns parsing and validation only
//! (of the push-token formats too, in `push_tokens`; the files themselves
//! are read by the service that uses them); it must not connect to anything.
#![forbid(unsafe_code)]

mod push_tokens;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};

pub use push_tokens::{
    MIN_PUSH_TOKEN_BYTES, PushToken, PushTokenError, parse_push_tokens_file, parse_push_tokens_list,
};

/// Why settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("cannot read settings: {0}")]
    Load(#[from] config::ConfigError),
    #[error("invalid setting `{key}`: {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> SettingsError {
    SettingsError::Invalid { key: key.into(), reason: reason.into() }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub nats: NatsSettings,
    pub redis: RedisSettings,
    pub storage: StorageSettings,
    pub ingest: IngestSettings,
    pub telemetry: TelemetrySettings,
    pub partners: Vec<PartnerSettings>,
    pub validator: ValidatorSettings,
    pub aggregator: AggregatorSettings,
    pub recommender: RecommenderSettings,
}

/// One validation rule: `kind` picks the check, `reason` is what a hidden
/// record's state says.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSettings {
    pub name: String,
    pub kind: RuleKind,
    #[serde(default)]
    pub reason: Option<String>,
    /// For `price_jump`: the largest allowed drop, in percent of the old price.
    #[serde(default)]
    pub max_drop_pct: Option<f64>,
    /// For `price_jump`: the largest allowed rise, in percent of the old price.
    #[serde(default)]
    pub max_rise_pct: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleKind {
    NonPositivePrice,
    PriceJump,
    OldPriceBelowPrice,
    NegativeStock,
    MissingTitle,
    MissingCategory,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValidatorSettings {
    /// Durable consumer shared by every validator replica.
    pub consumer: String,
    pub http_listen: String,
    pub rules: Vec<RuleSettings>,
}

impl Default for ValidatorSettings {
    fn default() -> Self {
        let rule = |name: &str, kind, reason: &str| RuleSettings {
            name: name.into(),
            kind,
            reason: Some(reason.into()),
            max_drop_pct: None,
            max_rise_pct: None,
        };
        Self {
            consumer: "validator".into(),
            http_listen: "127.0.0.1:8082".into(),
            rules: vec![
                rule("non_positive_price", RuleKind::NonPositivePrice, "price is not positive"),
                RuleSettings {
                    max_drop_pct: Some(90.0),
                    max_rise_pct: Some(1000.0),
                    ..rule("price_jump", RuleKind::PriceJump, "price moved too far at once")
                },
                rule(
                    "old_price_below_price",
                    RuleKind::OldPriceBelowPrice,
                    "old price is below the price",
                ),
                rule("negative_stock", RuleKind::NegativeStock, "stock is negative"),
                rule("missing_title", RuleKind::MissingTitle, "title is missing"),
                rule("missing_category", RuleKind::MissingCategory, "category is missing"),
            ],
        }
    }
}

/// A place of the region directory.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PlaceRegion {
    pub brand_id: i64,
    pub place_id: i64,
    pub region: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AggregatorSettings {
    pub consumer: String,
    pub http_listen: String,
    /// The place → region directory (reference data).
    pub places: Vec<PlaceRegion>,
    /// Region of places not in the directory; unset: such places are ignored.
    pub default_region: Option<String>,
}

impl Default for AggregatorSettings {
    fn default() -> Self {
        Self {
            consumer: "aggregator".into(),
            http_listen: "127.0.0.1:8083".into(),
            places: Vec::new(),
            default_region: Some("default".into()),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecommenderSettings {
    pub http_listen: String,
    pub default_top_n: usize,
    pub max_top_n: usize,
}

impl Default for RecommenderSettings {
    fn default() -> Self {
        Self { http_listen: "127.0.0.1:8084".into(), default_top_n: 10, max_top_n: 100 }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsSettings {
    /// One URL or a comma-separated list.
    #[serde(serialize_with = "redacted_url")]
    pub url: String,
    /// Prefix of every subject and (upper-cased) of every stream name.
    pub prefix: String,
    pub stream_replicas: usize,
    pub user: Option<String>,
    #[serde(serialize_with = "redacted")]
    pub password: Option<String>,
    #[serde(serialize_with = "redacted")]
    pub token: Option<String>,
    /// A `.creds` file (NKey + JWT).
    pub credentials_file: Option<String>,
    /// Require TLS to the server (also implied by `tls_ca_file` or a
    /// `tls://` URL).
    pub tls_required: bool,
    /// CA certificate (PEM) to trust for the server's certificate.
    pub tls_ca_file: Option<String>,
    /// Client certificate and key (PEM) for mutual TLS.
    pub tls_cert_file: Option<String>,
    pub tls_key_file: Option<String>,
    /// Publishes awaiting a JetStream ack at once, per publisher.
    pub max_inflight: usize,
    /// JetStream deduplication window of the streams (Nats-Msg-Id).
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
    /// How long the CHANGES, KEYFRAMES, AGGREGATES and REJECTS streams keep
    /// messages.
    #[serde(with = "humantime_serde")]
    pub changes_max_age: Duration,
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Largest size of each stream, in bytes; 0: unlimited. JetStream
    /// reserves a stream's limit out of the server's (and the account's)
    /// file storage, so the five must fit in it together. A full CMD stream
    /// refuses new commands (publishers see an error and retry: nothing
    /// queued is dropped), a full KEYFRAMES stream refuses a new keyframe
    /// (the complete ones stay); CHANGES, AGGREGATES and REJECTS drop their
    /// oldest messages, as they do past `changes_max_age`.
    pub cmd_max_bytes: u64,
    pub changes_max_bytes: u64,
    pub keyframes_max_bytes: u64,
    pub aggregates_max_bytes: u64,
    pub rejects_max_bytes: u64,
}

impl Default for NatsSettings {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            prefix: "shelfsync".into(),
            stream_replicas: 1,
            user: None,
            password: None,
            token: None,
            credentials_file: None,
            tls_required: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            max_inflight: 256,
            duplicate_window: Duration::from_secs(120),
            changes_max_age: Duration::from_secs(7 * 24 * 3600),
            request_timeout: Duration::from_secs(10),
            // A backlog of a few full imports of large partners; far more
            // means storage is down, and refusing beats filling the disk
            // that every stream shares.
            cmd_max_bytes: 1024 * 1024 * 1024,
            changes_max_bytes: 0,
            keyframes_max_bytes: 0,
            aggregates_max_bytes: 0,
            rejects_max_bytes: 0,
        }
    }
}

impl NatsSettings {
    /// The server URLs, split on commas.
    pub fn urls(&self) -> Vec<String> {
        self.url.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisSettings {
    /// A URL; with `cluster = true`, a comma-separated list of cluster nodes.
    #[serde(serialize_with = "redacted_url")]
    pub url: String,
    pub cluster: bool,
    /// Prefix of every Redis key.
    pub namespace: String,
    /// With a `rediss://` URL: a CA certificate (PEM) to trust instead of
    /// the system roots, and a client certificate and key for mutual TLS.
    pub tls_ca_file: Option<String>,
    pub tls_cert_file: Option<String>,
    pub tls_key_file: Option<String>,
    /// Storage: after each commit, wait until this many Redis replicas have
    /// it (`WAIT`) before publishing its changes or acking its command; 0
    /// (the default): don't wait. Standalone Redis only.
    pub wait_replicas: usize,
    /// How long one `WAIT` may take; storage waits again (and counts it)
    /// until the replicas confirm.
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
}

impl Default for RedisSettings {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            cluster: false,
            namespace: "ss".into(),
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            wait_replicas: 0,
            wait_timeout: Duration::from_secs(1),
        }
    }
}

impl RedisSettings {
    pub fn urls(&self) -> Vec<String> {
        self.url.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageSettings {
    /// Number of command partitions; fixed when the streams are created.
    pub partitions: u32,
    /// Storage replicas splitting the partitions between them ...
    pub replicas: u32,
    /// ... and which one this is (e.g. the StatefulSet ordinal).
    pub replica: u32,
    /// A merged record (data + state) larger than this is rejected.
    pub max_record_bytes: usize,
    /// How long a DELETE tombstone is kept before it is purged.
    #[serde(with = "humantime_serde")]
    pub tombstone_ttl: Duration,
    /// How long a record stays absent (swept) before it is deleted (a
    /// DELETED change; its tombstone is then purged after `tombstone_ttl`).
    /// 0 s: absent records are kept.
    #[serde(with = "humantime_serde")]
    pub absent_ttl: Duration,
    /// How often expired tombstones are looked for.
    #[serde(with = "humantime_serde")]
    pub purge_interval: Duration,
    /// JetStream ack wait of the command consumers.
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// First delay of a nak after a transient failure (doubles up to 30 s).
    #[serde(with = "humantime_serde")]
    pub retry_delay: Duration,
    /// When keyframes are published: a cron expression in UTC with seconds
    /// (`sec min hour day-of-month month day-of-week`); empty disables.
    pub keyframe_schedule: String,
    /// Keyframes kept per place in the KEYFRAMES stream.
    pub keyframes_kept: u32,
    /// Place snapshots a replica takes at once (copy and publish). Each
    /// holds its partition's commands back only while it copies the place;
    /// a low number keeps live changes fresh during a keyframe.
    pub keyframe_concurrency: usize,
    /// Keyframe records a replica publishes per second (0: as fast as it
    /// can). A keyframe is background work: paced, it leaves the machine to
    /// the live changes. The default keyframes 1M records in 20 s; on the
    /// 2-core bench machine it kept live p99 during a keyframe about a
    /// quarter lower than 100 000 did (docs/PERFORMANCE.md, finding 1).
    pub keyframe_rate: u64,
    /// Keyframes give way to live changes later than this: while storage
    /// commits commands published longer ago, a paced keyframe waits (at
    /// most twice its share of time, so it goes on at a third of its rate
    /// or more). 0 s (the default): never.
    #[serde(with = "humantime_serde")]
    pub keyframe_yield_after: Duration,
    /// Command messages a partition worker reads from the stream behind the
    /// one delivered, to commit them together (0: one message at a time).
    /// More means fewer Redis and NATS round trips per message under load.
    pub read_ahead: usize,
    /// Records per partition whose owner remembers, in memory, the PATCHes
    /// that change nothing on them (a few hashes, about 70 bytes a record),
    /// so that an identical re-import of them reads nothing from Redis
    /// (0: off). Past it, records not yet remembered go through Redis.
    pub known_records: usize,
    /// HTTP listen address of storage (read API, health).
    pub http_listen: String,
    /// Largest number of keys in one batch read, and of records in one page.
    pub read_max_batch: usize,
}

impl Default for StorageSettings {
    fn default() -> Self {
        Self {
            partitions: 64,
            replicas: 1,
            replica: 0,
            max_record_bytes: 256 * 1024,
            tombstone_ttl: Duration::from_secs(7 * 24 * 3600),
            absent_ttl: Duration::from_secs(30 * 24 * 3600),
            purge_interval: Duration::from_secs(60),
            ack_wait: Duration::from_secs(30),
            retry_delay: Duration::from_millis(500),
            keyframe_schedule: "0 0 3 * * *".into(),
            keyframes_kept: 2,
            keyframe_concurrency: 2,
            keyframe_rate: 50_000,
            keyframe_yield_after: Duration::ZERO,
            read_ahead: 32,
            known_records: 1_000_000,
            http_listen: "127.0.0.1:8081".into(),
            read_max_batch: 1000,
        }
    }
}

impl StorageSettings {
    /// Partitions owned by this replica: `p % replicas == replica`.
    pub fn owned_partitions(&self) -> Vec<u32> {
        (0..self.partitions).filter(|p| p % self.replicas == self.replica).collect()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngestSettings {
    /// HTTP listen address of the ingest service (push endpoint, health).
    pub listen: String,
    /// A feed item larger than this (raw JSON bytes) is rejected.
    pub max_item_bytes: usize,
    /// Commands per CommandBatch (at most 1000).
    pub batch_size: usize,
    /// Largest request body the push endpoint accepts, for partners that
    /// set no `max_push_bytes` of their own (default 1 GiB). A larger
    /// `Content-Length` is refused (413) before anything is read; a body
    /// that grows past it fails the import (413, nothing swept).
    pub max_push_bytes: u64,
    /// How long a full import waits for storage to decide its sweeps
    /// (applied or held) before its report says "not decided yet".
    #[serde(with = "humantime_serde")]
    pub sweep_report_wait: Duration,
    /// A full import holds a lease on its partner in Redis, so that two full
    /// imports of one partner (ingest replicas, the CLI) never interleave.
    /// The holder renews it every third of this; a holder that stops (a
    /// crash) loses it after this long.
    #[serde(with = "humantime_serde")]
    pub import_lease_ttl: Duration,
}

impl Default for IngestSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            max_item_bytes: 64 * 1024,
            batch_size: 1000,
            max_push_bytes: 1024 * 1024 * 1024,
            sweep_report_wait: Duration::from_secs(60),
            import_lease_ttl: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    /// `tracing` env-filter directive; `RUST_LOG` wins when set.
    pub log_level: String,
    pub log_format: LogFormat,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self { log_level: "info".into(), log_format: LogFormat::Text }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ImportKind {
    /// A whole dump: records of a place missing from it are swept afterwards.
    Full,
    /// A partial feed: never sweeps, never stamps generations.
    Delta,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FeedFormat {
    /// Detected from the content (NDJSON when the first line is a whole item).
    #[default]
    Auto,
    Json,
    Ndjson,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PartnerSettings {
    pub name: String,
    pub brand_id: i64,
    pub kind: ImportKind,
    /// Product fields this partner's feed owns, by their names in the feed.
    #[serde(default = "all_fields")]
    pub fields: Vec<String>,
    /// File path, `file://` URL or `http(s)://` URL polled by the ingest service.
    #[serde(default)]
    pub source: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub poll_interval: Option<Duration>,
    #[serde(default)]
    pub format: FeedFormat,
    /// An owned field missing from an item is cleared (the partner owns it and
    /// no longer reports a value). Off: missing fields are left as they are.
    #[serde(default = "yes")]
    pub clear_missing: bool,
    /// A full import's sweep that would mark absent more than this share of
    /// a place's live records is held instead of applied (released with
    /// `shelfsync sweep --import ID`); so is one of a place in which no item
    /// was accepted, or that is missing from the dump.
    #[serde(default = "half")]
    pub sweep_max_fraction: f64,
    /// A file of tokens that may push this partner's feed
    /// (`POST /v1/partners/{name}/feed` with `Authorization: Bearer <token>`):
    /// one token a line, at least 16 bytes each; blank lines and lines
    /// starting with `#` are ignored. Several may be valid at once, for
    /// rotation. Ingest reads it at start (a bad file stops it) and again
    /// whenever its modification time, size or inode changes, so a mounted
    /// secret rotates with no restart; a file that cannot be read or parsed
    /// later keeps the last good tokens (and is logged once).
    #[serde(default)]
    pub push_tokens_file: Option<PathBuf>,
    /// The name of an environment variable holding push tokens, separated by
    /// commas or whitespace; read once at start (the variable must be set).
    /// With `push_tokens_file` too, both sets are valid. A partner with
    /// neither cannot be pushed to (403): tokens never come from the config
    /// file itself.
    #[serde(default)]
    pub push_tokens_env: Option<String>,
    /// Largest push body for this partner; unset: `ingest.max_push_bytes`.
    #[serde(default)]
    pub max_push_bytes: Option<u64>,
}

impl PartnerSettings {
    /// Whether the push endpoint can be used for this partner at all: some
    /// source of tokens is configured.
    pub fn push_enabled(&self) -> bool {
        self.push_tokens_file.is_some() || self.push_tokens_env.is_some()
    }

    /// The largest push body accepted for this partner.
    pub fn push_limit(&self, ingest: &IngestSettings) -> u64 {
        self.max_push_bytes.unwrap_or(ingest.max_push_bytes)
    }
}

fn half() -> f64 {
    0.5
}

impl Default for PartnerSettings {
    /// A full partner owning every field, with no source; `name` and
    /// `brand_id` are for the caller to set.
    fn default() -> Self {
        Self {
            name: String::new(),
            brand_id: 0,
            kind: ImportKind::Full,
            fields: all_fields(),
            source: None,
            poll_interval: None,
            format: FeedFormat::default(),
            clear_missing: true,
            sweep_max_fraction: half(),
            push_tokens_file: None,
            push_tokens_env: None,
            max_push_bytes: None,
        }
    }
}

fn all_fields() -> Vec<String> {
    ["title", "category", "price", "old_price", "currency", "stock", "images", "description"]
        .map(String::from)
        .to_vec()
}

fn yes() -> bool {
    true
}

const KNOWN_FIELDS: [&str; 8] =
    ["title", "category", "price", "old_price", "currency", "stock", "images", "description"];

impl Settings {
    /// Loads defaults, then `file` (if any), then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, SettingsError> {
        Self::load_files(file.as_slice())
    }

    /// Loads defaults, then each of `files` in order, then the process
    /// environment. A later file overrides what an earlier one sets, key by
    /// key, so a deployment can give each service a common file plus one of
    /// its own (`--config common.toml --config storage.toml`).
    pub fn load_files<P: AsRef<Path>>(files: &[P]) -> Result<Self, SettingsError> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::load_files_from(files, &env)
    }

    /// As [`Settings::load`], with the environment given explicitly (tests).
    pub fn load_from(file: Option<&Path>, env: &[(String, String)]) -> Result<Self, SettingsError> {
        Self::load_files_from(file.as_slice(), env)
    }

    /// As [`Settings::load_files`], with the environment given explicitly.
    pub fn load_files_from<P: AsRef<Path>>(
        files: &[P],
        env: &[(String, String)],
    ) -> Result<Self, SettingsError> {
        let mut builder = config::Config::builder();
        for path in files.iter().map(AsRef::as_ref) {
            if !path.exists() {
                return Err(invalid("--config", format!("file {} does not exist", path.display())));
            }
            builder = builder.add_source(config::File::from(path).format(config::FileFormat::Toml));
        }
        let get = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        if let Some(url) = get("NATS_URL") {
            builder = builder.set_override("nats.url", url)?;
        }
        if let Some(url) = get("REDIS_URL") {
            builder = builder.set_override("redis.url", url)?;
        }
        for (key, value) in env {
            let Some(path) = key.strip_prefix("SHELFSYNC__") else {
                continue;
            };
            builder = builder.set_override(env_key_path(path), parse_env_value(value))?;
        }
        let settings: Settings = builder.build()?.try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Parses a TOML document on top of the defaults (no environment).
    pub fn from_toml(text: &str) -> Result<Self, SettingsError> {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()?
            .try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.nats.urls().is_empty() {
            return Err(invalid("nats.url", "no server URL"));
        }
        validate_prefix(&self.nats.prefix)?;
        if !(1..=5).contains(&self.nats.stream_replicas) {
            return Err(invalid("nats.stream_replicas", "must be between 1 and 5"));
        }
        for (key, value) in [
            ("nats.cmd_max_bytes", self.nats.cmd_max_bytes),
            ("nats.changes_max_bytes", self.nats.changes_max_bytes),
            ("nats.keyframes_max_bytes", self.nats.keyframes_max_bytes),
            ("nats.aggregates_max_bytes", self.nats.aggregates_max_bytes),
            ("nats.rejects_max_bytes", self.nats.rejects_max_bytes),
        ] {
            if value > i64::MAX as u64 {
                return Err(invalid(key, "must be below 2^63"));
            }
        }
        if self.nats.max_inflight == 0 {
            return Err(invalid("nats.max_inflight", "must be at least 1"));
        }
        if self.nats.tls_cert_file.is_some() != self.nats.tls_key_file.is_some() {
            return Err(invalid(
                "nats.tls_cert_file",
                "a client certificate needs its key (tls_key_file), and the reverse",
            ));
        }
        if self.redis.tls_cert_file.is_some() != self.redis.tls_key_file.is_some() {
            return Err(invalid(
                "redis.tls_cert_file",
                "a client certificate needs its key (tls_key_file), and the reverse",
            ));
        }
        if self.redis.urls().is_empty() {
            return Err(invalid("redis.url", "no server URL"));
        }
        if !self.redis.cluster && self.redis.urls().len() > 1 {
            return Err(invalid("redis.url", "several URLs need `redis.cluster = true`"));
        }
        if self.redis.cluster && self.redis.wait_replicas > 0 {
            return Err(invalid(
                "redis.wait_replicas",
                "is supported with a standalone Redis (and its replicas) only, not with `cluster = true`",
            ));
        }
        if self.redis.wait_replicas > 0 && self.redis.wait_timeout.is_zero() {
            return Err(invalid("redis.wait_timeout", "must be more than 0 s with wait_replicas"));
        }
        if self.redis.namespace.is_empty()
            || !self.redis.namespace.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
        {
            return Err(invalid("redis.namespace", "must be non-empty [A-Za-z0-9_.-]"));
        }
        let s = &self.storage;
        if !(1..=4096).contains(&s.partitions) {
            return Err(invalid("storage.partitions", "must be between 1 and 4096"));
        }
        if s.replicas == 0 || s.replicas > s.partitions {
            return Err(invalid("storage.replicas", "must be between 1 and storage.partitions"));
        }
        if s.replica >= s.replicas {
            return Err(invalid(
                "storage.replica",
                format!("{} is not below storage.replicas = {}", s.replica, s.replicas),
            ));
        }
        if !s.keyframe_schedule.trim().is_empty() {
            use std::str::FromStr;
            cron::Schedule::from_str(&s.keyframe_schedule).map_err(|e| {
                invalid(
                    "storage.keyframe_schedule",
                    format!("{e} (expected `sec min hour day month weekday`, UTC)"),
                )
            })?;
        }
        if s.keyframes_kept == 0 {
            return Err(invalid("storage.keyframes_kept", "must be at least 1"));
        }
        if !(1..=1024).contains(&s.keyframe_concurrency) {
            return Err(invalid("storage.keyframe_concurrency", "must be between 1 and 1024"));
        }
        if s.read_ahead > 1000 {
            return Err(invalid("storage.read_ahead", "must be at most 1000"));
        }
        if !(1..=10_000).contains(&s.read_max_batch) {
            return Err(invalid("storage.read_max_batch", "must be between 1 and 10000"));
        }
        if s.max_record_bytes < 1024 {
            return Err(invalid("storage.max_record_bytes", "must be at least 1024"));
        }
        if !(1..=1000).contains(&self.ingest.batch_size) {
            return Err(invalid("ingest.batch_size", "must be between 1 and 1000"));
        }
        if self.ingest.max_push_bytes == 0 {
            return Err(invalid("ingest.max_push_bytes", "must be at least 1"));
        }
        if self.ingest.import_lease_ttl < Duration::from_secs(1) {
            return Err(invalid("ingest.import_lease_ttl", "must be at least 1s"));
        }
        let mut rule_names = HashSet::new();
        for (i, r) in self.validator.rules.iter().enumerate() {
            if !rule_names.insert(r.name.as_str()) {
                return Err(invalid(
                    format!("validator.rules[{i}].name"),
                    format!("rule `{}` is defined twice", r.name),
                ));
            }
            for (k, v) in [("max_drop_pct", r.max_drop_pct), ("max_rise_pct", r.max_rise_pct)] {
                if v.is_some_and(|v| !(v > 0.0 && v.is_finite())) {
                    return Err(invalid(
                        format!("validator.rules[{i}].{k}"),
                        "must be a positive number",
                    ));
                }
            }
        }
        let mut seen_places = HashSet::new();
        for (i, p) in self.aggregator.places.iter().enumerate() {
            if p.region.is_empty() {
                return Err(invalid(format!("aggregator.places[{i}].region"), "must not be empty"));
            }
            if !seen_places.insert((p.brand_id, p.place_id)) {
                return Err(invalid(
                    format!("aggregator.places[{i}]"),
                    format!("place {}/{} is listed twice", p.brand_id, p.place_id),
                ));
            }
        }
        if self.recommender.default_top_n == 0
            || self.recommender.default_top_n > self.recommender.max_top_n
        {
            return Err(invalid(
                "recommender.default_top_n",
                "must be between 1 and recommender.max_top_n",
            ));
        }
        let mut names = HashSet::new();
        for (i, p) in self.partners.iter().enumerate() {
            let key = |k: &str| format!("partners[{i}].{k}");
            if p.name.is_empty()
                || !p.name.chars().all(|c| c.is_ascii_alphanumeric() || "_-".contains(c))
            {
                return Err(invalid(key("name"), "must be non-empty [A-Za-z0-9_-]"));
            }
            if !names.insert(p.name.as_str()) {
                return Err(invalid(key("name"), format!("partner `{}` is defined twice", p.name)));
            }
            if p.brand_id <= 0 {
                return Err(invalid(key("brand_id"), "must be positive"));
            }
            if p.fields.is_empty() {
                return Err(invalid(key("fields"), "a partner must own at least one field"));
            }
            for f in &p.fields {
                if !KNOWN_FIELDS.contains(&f.as_str()) {
                    return Err(invalid(
                        key("fields"),
                        format!("unknown field `{f}` (known: {})", KNOWN_FIELDS.join(", ")),
                    ));
                }
            }
            if p.poll_interval.is_some() && p.source.is_none() {
                return Err(invalid(key("poll_interval"), "set without a `source`"));
            }
            if !(0.0..=1.0).contains(&p.sweep_max_fraction) {
                return Err(invalid(key("sweep_max_fraction"), "must be between 0 and 1"));
            }
            if p.push_tokens_file.as_ref().is_some_and(|f| f.as_os_str().is_empty()) {
                return Err(invalid(key("push_tokens_file"), "must be a path"));
            }
            if let Some(var) = &p.push_tokens_env {
                let mut chars = var.chars();
                let ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
                if !ok {
                    return Err(invalid(
                        key("push_tokens_env"),
                        "must be the name of an environment variable ([A-Za-z_][A-Za-z0-9_]*)",
                    ));
                }
            }
            if p.max_push_bytes == Some(0) {
                return Err(invalid(key("max_push_bytes"), "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The region of a place, from the aggregator's directory.
    pub fn region_of(&self, brand_id: i64, place_id: i64) -> Option<&str> {
        self.aggregator
            .places
            .iter()
            .find(|p| p.brand_id == brand_id && p.place_id == place_id)
            .map(|p| p.region.as_str())
            .or(self.aggregator.default_region.as_deref())
    }

    pub fn partner(&self, name: &str) -> Option<&PartnerSettings> {
        self.partners.iter().find(|p| p.name == name)
    }
}

/// Serializes a secret as `***` (when set): settings are printed
/// (`shelfsync config check`) but a secret never is.
fn redacted<S: Serializer>(secret: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match secret {
        Some(_) => s.serialize_str("***"),
        None => s.serialize_none(),
    }
}

/// Serializes a URL with the password in its userinfo replaced by `***`.
fn redacted_url<S: Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_url(url))
}

/// A server URL (or comma-separated list) fit for logs and errors: any
/// password in it is replaced by `***`.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|u| {
            let Some((scheme, rest)) = u.split_once("://") else { return u.to_string() };
            let Some((userinfo, host)) = rest.rsplit_once('@') else { return u.to_string() };
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            if userinfo.contains(':') {
                format!("{scheme}://{user}:***@{host}")
            } else if scheme.starts_with("redis") || scheme.starts_with("nats") {
                // A lone userinfo may be a token or a password.
                format!("{scheme}://***@{host}")
            } else {
                u.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl NatsSettings {
    /// The URL(s) without secrets, for logs and errors.
    pub fn url_redacted(&self) -> String {
        redact_url(&self.url)
    }
}

impl RedisSettings {
    /// The URL(s) without secrets, for logs and errors.
    pub fn url_redacted(&self) -> String {
        redact_url(&self.url)
    }
}

/// The settings path of a `SHELFSYNC__` variable (without the prefix):
/// sections and keys are separated by `__`, and a number is an index into an
/// array, so `PARTNERS__0__PUSH_TOKENS_ENV` sets `partners[0].push_tokens_env`
/// (the bracket form `PARTNERS[0]__…` works too).
fn env_key_path(name: &str) -> String {
    let mut path = String::new();
    for part in name.to_ascii_lowercase().split("__") {
        if !path.is_empty() && !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            path.push_str(&format!("[{part}]"));
        } else {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(part);
        }
    }
    path
}

/// Environment values are strings; give numbers and booleans their type so
/// that `SHELFSYNC__STORAGE__PARTITIONS=16` deserializes into a `u32`.
fn parse_env_value(value: &str) -> config::Value {
    if let Ok(n) = value.parse::<i64>() {
        return n.into();
    }
    match value {
        "true" => true.into(),
        "false" => false.into(),
        _ => value.into(),
    }
}

fn validate_prefix(prefix: &str) -> Result<(), SettingsError> {
    let ok = !prefix.is_empty()
        && prefix.split('.').all(|t| {
            !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        });
    if ok {
        Ok(())
    } else {
        Err(invalid("nats.prefix", "must be dot-separated tokens of [A-Za-z0-9_-]"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_are_valid() {
        let s = Settings::load_from(None, &[]).expect("defaults");
        assert_eq!(s.nats.prefix, "shelfsync");
        assert_eq!(s.storage.partitions, 64);
        assert_eq!(s.storage.owned_partitions().len(), 64);
        assert_eq!(s.ingest.import_lease_ttl, Duration::from_secs(30));
    }

    #[test]
    fn file_then_env_overrides() {
        let dir = std::env::temp_dir().join(format!("ss-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("c.toml");
        std::fs::write(
            &path,
            r#"
[nats]
url = "nats://a:4222"
prefix = "demo"
[storage]
partitions = 8
[[partners]]
name = "flowers"
brand_id = 7
kind = "full"
fields = ["price", "stock"]
poll_interval = "5m"
source = "https://partner.example/feed.json"
"#,
        )
        .expect("write");
        let s = Settings::load_from(
            Some(&path),
            &env(&[
                ("NATS_URL", "nats://b:4222"),
                ("SHELFSYNC__STORAGE__REPLICAS", "2"),
                ("SHELFSYNC__STORAGE__REPLICA", "1"),
                ("SHELFSYNC__REDIS__NAMESPACE", "x"),
                ("SHELFSYNC__INGEST__IMPORT_LEASE_TTL", "2s"),
                ("UNRELATED", "1"),
            ]),
        )
        .expect("load");
        assert_eq!(s.nats.url, "nats://b:4222");
        assert_eq!(s.nats.prefix, "demo");
        assert_eq!(s.redis.namespace, "x");
        assert_eq!(s.ingest.import_lease_ttl, Duration::from_secs(2));
        assert_eq!(s.storage.owned_partitions(), vec![1, 3, 5, 7]);
        let p = s.partner("flowers").expect("partner");
        assert_eq!(p.kind, ImportKind::Full);
        assert_eq!(p.poll_interval, Some(Duration::from_secs(300)));
        assert!(p.clear_missing);

        // SHELFSYNC__ wins over NATS_URL.
        let s = Settings::load_from(
            None,
            &env(&[("NATS_URL", "nats://b:4222"), ("SHELFSYNC__NATS__URL", "nats://c:4222")]),
        )
        .expect("load");
        assert_eq!(s.nats.url, "nats://c:4222");
    }

    #[test]
    fn later_files_override_earlier_ones() {
        let dir = std::env::temp_dir().join(format!("ss-settings-layers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let common = dir.join("common.toml");
        let own = dir.join("storage.toml");
        let partners = dir.join("partners.toml");
        std::fs::write(
            &common,
            "[nats]\nurl = \"nats://common:4222\"\nprefix = \"demo\"\n[storage]\npartitions = 8\nkeyframes_kept = 3\n",
        )
        .expect("write");
        std::fs::write(&own, "[storage]\nreplicas = 4\nkeyframes_kept = 5\n").expect("write");
        std::fs::write(
            &partners,
            "[[partners]]\nname = \"flowers\"\nbrand_id = 7\nkind = \"full\"\n",
        )
        .expect("write");
        let s = Settings::load_files_from(
            &[&common, &own, &partners],
            &env(&[("SHELFSYNC__STORAGE__REPLICA", "3")]),
        )
        .expect("layers");
        // Kept from the first file, overridden key by key by the second, the
        // environment last.
        assert_eq!(s.nats.url, "nats://common:4222");
        assert_eq!(s.nats.prefix, "demo");
        assert_eq!(s.storage.partitions, 8);
        assert_eq!(s.storage.replicas, 4);
        assert_eq!(s.storage.keyframes_kept, 5);
        assert_eq!(s.storage.owned_partitions(), vec![3, 7]);
        assert_eq!(s.partners.len(), 1);
        // The order matters: the common file last puts its value back.
        let s = Settings::load_files_from(&[&own, &common], &[]).expect("reversed");
        assert_eq!(s.storage.keyframes_kept, 3);
        assert_eq!(s.storage.replicas, 4);
        // The single-file API is the one-element case.
        let one = Settings::load_from(Some(&common), &[]).expect("one file");
        assert_eq!(one.storage.keyframes_kept, 3);
        assert_eq!(one.storage.replicas, 1);
        // An array (the partners) is replaced whole, never merged item by item.
        let more = dir.join("more-partners.toml");
        std::fs::write(
            &more,
            "[[partners]]\nname = \"prices\"\nbrand_id = 8\nkind = \"delta\"\nfields = [\"price\"]\n",
        )
        .expect("write");
        let s = Settings::load_files_from(&[&partners, &more], &[]).expect("partners twice");
        let names: Vec<&str> = s.partners.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["prices"]);
        assert_eq!(s.partners[0].fields, ["price"]);
        // A missing file anywhere in the list is an error naming it.
        let err = Settings::load_files_from(&[common.clone(), dir.join("nope.toml")], &[])
            .expect_err("missing")
            .to_string();
        assert!(err.contains("nope.toml"), "{err}");
    }

    #[test]
    fn bad_values_have_clear_errors() {
        let cases = [
            ("[storage]\nreplica = 3\nreplicas = 2", "storage.replica"),
            ("[nats]\nprefix = \"a.>\"", "nats.prefix"),
            ("[storage]\npartitions = 0", "storage.partitions"),
            (
                "[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"full\"\nfields = [\"colour\"]",
                "unknown field `colour`",
            ),
            ("[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"sometimes\"", "sometimes"),
            ("[storage]\npartitions = \"many\"", "partitions"),
            ("[storage]\ntombstone_ttl = \"soon\"", "tombstone_ttl"),
            ("[storage]\nkeyframe_schedule = \"nightly\"", "keyframe_schedule"),
            ("[[validator.rules]]\nname = \"x\"\nkind = \"sometimes\"", "sometimes"),
            (
                "[[validator.rules]]\nname = \"j\"\nkind = \"price_jump\"\nmax_drop_pct = -1",
                "max_drop_pct",
            ),
            (
                "[[aggregator.places]]\nbrand_id = 1\nplace_id = 2\nregion = \"a\"\n[[aggregator.places]]\nbrand_id = 1\nplace_id = 2\nregion = \"b\"",
                "listed twice",
            ),
            ("[nats]\nurl = \"nats://x\"\nbogus = 1", "bogus"),
            (
                "[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"full\"\npush_tokens_env = \"1-TOKENS\"",
                "partners[0].push_tokens_env",
            ),
            (
                "[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"full\"\nmax_push_bytes = 0",
                "partners[0].max_push_bytes",
            ),
            ("[ingest]\nmax_push_bytes = 0", "ingest.max_push_bytes"),
            // Tokens never come from the committed config itself.
            (
                "[[partners]]\nname = \"x\"\nbrand_id = 1\nkind = \"full\"\npush_tokens = [\"0123456789abcdef\"]",
                "unknown field `push_tokens`",
            ),
            ("[ingest]\nimport_lease_ttl = \"500ms\"", "ingest.import_lease_ttl"),
        ];
        for (text, needle) in cases {
            let err = Settings::from_toml(text).expect_err(text).to_string();
            assert!(err.contains(needle), "error for {text:?} was {err:?}, expected {needle:?}");
        }
    }

    #[test]
    fn push_keys_per_partner_with_the_ingest_default_limit() {
        let s = Settings::from_toml(
            r#"
[ingest]
max_push_bytes = 1000
[[partners]]
name = "a"
brand_id = 1
kind = "full"
push_tokens_file = "/run/secrets/a-push"
push_tokens_env = "A_PUSH_TOKENS"
max_push_bytes = 10
[[partners]]
name = "b"
brand_id = 1
kind = "delta"
"#,
        )
        .expect("valid");
        let (a, b) = (s.partner("a").expect("a"), s.partner("b").expect("b"));
        assert_eq!(a.push_tokens_file.as_deref(), Some(Path::new("/run/secrets/a-push")));
        assert_eq!(a.push_tokens_env.as_deref(), Some("A_PUSH_TOKENS"));
        assert!(a.push_enabled() && !b.push_enabled(), "no token source: push disabled");
        assert_eq!((a.push_limit(&s.ingest), b.push_limit(&s.ingest)), (10, 1000));
        assert_eq!(Settings::default().ingest.max_push_bytes, 1 << 30, "1 GiB by default");
    }

    #[test]
    fn partner_keys_can_be_set_from_the_environment_by_index() {
        let dir = std::env::temp_dir().join(format!("ss-settings-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("c.toml");
        std::fs::write(
            &path,
            "[[partners]]\nname = \"a\"\nbrand_id = 1\nkind = \"full\"\n\
             [[partners]]\nname = \"b\"\nbrand_id = 2\nkind = \"delta\"\n",
        )
        .expect("write");
        let s = Settings::load_from(
            Some(&path),
            &env(&[
                ("SHELFSYNC__PARTNERS__1__PUSH_TOKENS_ENV", "B_TOKENS"),
                ("SHELFSYNC__PARTNERS__1__MAX_PUSH_BYTES", "4096"),
                ("SHELFSYNC__PARTNERS[0]__PUSH_TOKENS_FILE", "/run/secrets/a"),
            ]),
        )
        .expect("load");
        let (a, b) = (s.partner("a").expect("a"), s.partner("b").expect("b"));
        assert_eq!((b.brand_id, b.kind), (2, ImportKind::Delta), "the rest of the entry stays");
        assert_eq!(
            (b.push_tokens_env.as_deref(), b.max_push_bytes),
            (Some("B_TOKENS"), Some(4096))
        );
        assert_eq!(a.push_tokens_file.as_deref(), Some(Path::new("/run/secrets/a")));
        assert_eq!(env_key_path("STORAGE__PARTITIONS"), "storage.partitions");
        assert_eq!(env_key_path("PARTNERS__10__NAME"), "partners[10].name");
    }

    #[test]
    fn urls_are_redacted_for_logs() {
        assert_eq!(redact_url("redis://app:s3cret@h:6379"), "redis://app:***@h:6379");
        assert_eq!(redact_url("redis://:s3cret@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(
            redact_url("nats://tok@h:4222,nats://h2:4222"),
            "nats://***@h:4222,nats://h2:4222"
        );
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
    }

    #[test]
    fn missing_file_is_an_error() {
        let err = Settings::load_from(Some(Path::new("/nonexistent/x.toml")), &[])
            .expect_err("missing")
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
    }

    #[test]
    fn the_shipped_config_files_load() {
        // Each deployment's files as its workloads layer them (ingest.toml, the partners, joins
        // these once the partners' push token keys exist in the settings).
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for files in [
            &["config/example.toml"][..],
            &["compose/config/shelfsync.toml", "compose/config/storage.toml"],
            &["k8s/base/config/shelfsync.toml", "k8s/base/config/storage.toml"],
        ] {
            let paths: Vec<_> = files.iter().map(|f| root.join(f)).collect();
            if let Err(e) = Settings::load_files_from(&paths, &[]) {
                panic!("{files:?}: {e}");
            }
        }
    }
}

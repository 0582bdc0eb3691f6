//! Typed settings shared by every shelfsync binary (DESIGN §6, §8).
//!
//! Layers, lowest first: built-in defaults, the TOML file given with
//! `--config FILE`, the conventional `NATS_URL` / `REDIS_URL` variables, then
//! `SHELFSYNC__SECTION__KEY` overrides. Every service reads the same file
//! shape and takes the sections it needs. Owns parsing and validation only;
//! it must not connect to anything.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

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

#[derive(Debug, Clone, Default, Deserialize)]
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
#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleKind {
    NonPositivePrice,
    PriceJump,
    OldPriceBelowPrice,
    NegativeStock,
    MissingTitle,
    MissingCategory,
}

#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaceRegion {
    pub brand_id: i64,
    pub place_id: i64,
    pub region: String,
}

#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsSettings {
    /// One URL or a comma-separated list.
    pub url: String,
    /// Prefix of every subject and (upper-cased) of every stream name.
    pub prefix: String,
    pub stream_replicas: usize,
    pub user: Option<String>,
    pub password: Option<String>,
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
    /// How long the CHANGES and REJECTS streams keep messages.
    #[serde(with = "humantime_serde")]
    pub changes_max_age: Duration,
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
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
        }
    }
}

impl NatsSettings {
    /// The server URLs, split on commas.
    pub fn urls(&self) -> Vec<String> {
        self.url.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisSettings {
    /// A URL; with `cluster = true`, a comma-separated list of cluster nodes.
    pub url: String,
    pub cluster: bool,
    /// Prefix of every Redis key.
    pub namespace: String,
    /// With a `rediss://` URL: a CA certificate (PEM) to trust instead of
    /// the system roots, and a client certificate and key for mutual TLS.
    pub tls_ca_file: Option<String>,
    pub tls_cert_file: Option<String>,
    pub tls_key_file: Option<String>,
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
        }
    }
}

impl RedisSettings {
    pub fn urls(&self) -> Vec<String> {
        self.url.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
    }
}

#[derive(Debug, Clone, Deserialize)]
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
            purge_interval: Duration::from_secs(60),
            ack_wait: Duration::from_secs(30),
            retry_delay: Duration::from_millis(500),
            keyframe_schedule: "0 0 3 * * *".into(),
            keyframes_kept: 2,
            keyframe_concurrency: 2,
            keyframe_rate: 50_000,
            keyframe_yield_after: Duration::ZERO,
            read_ahead: 32,
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

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngestSettings {
    /// HTTP listen address of the ingest service (push endpoint, health).
    pub listen: String,
    /// A feed item larger than this (raw JSON bytes) is rejected.
    pub max_item_bytes: usize,
    /// Commands per CommandBatch (at most 1000).
    pub batch_size: usize,
    /// Largest request body accepted by the push endpoint.
    pub max_push_bytes: u64,
}

impl Default for IngestSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            max_item_bytes: 64 * 1024,
            batch_size: 1000,
            max_push_bytes: 4 * 1024 * 1024 * 1024,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImportKind {
    /// A whole dump: records of a place missing from it are swept afterwards.
    Full,
    /// A partial feed: never sweeps, never stamps generations.
    Delta,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FeedFormat {
    /// Detected from the content (NDJSON when the first line is a whole item).
    #[default]
    Auto,
    Json,
    Ndjson,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartnerSettings {
    pub name: String,
    pub brand_id: i64,
    pub kind: ImportKind,
    /// Product fields this partner's feed owns (feed names, DESIGN §8).
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
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::load_from(file, &env)
    }

    /// As [`Settings::load`], with the environment given explicitly (tests).
    pub fn load_from(file: Option<&Path>, env: &[(String, String)]) -> Result<Self, SettingsError> {
        let mut builder = config::Config::builder();
        if let Some(path) = file {
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
            let path = path.to_ascii_lowercase().replace("__", ".");
            builder = builder.set_override(path, parse_env_value(value))?;
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
                ("UNRELATED", "1"),
            ]),
        )
        .expect("load");
        assert_eq!(s.nats.url, "nats://b:4222");
        assert_eq!(s.nats.prefix, "demo");
        assert_eq!(s.redis.namespace, "x");
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
        ];
        for (text, needle) in cases {
            let err = Settings::from_toml(text).expect_err(text).to_string();
            assert!(err.contains(needle), "error for {text:?} was {err:?}, expected {needle:?}");
        }
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
        for file in [
            "config/example.toml",
            "compose/config/shelfsync.toml",
            "k8s/base/config/shelfsync.toml",
        ] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(file);
            if let Err(e) = Settings::load_from(Some(&path), &[]) {
                panic!("{file}: {e}");
            }
        }
    }
}

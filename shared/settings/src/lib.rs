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

mod aggregator;
mod ingest;
mod load;
mod nats;
mod partners;
mod push_tokens;
mod recommender;
mod redact;
mod redis;
mod storage;
mod telemetry;
mod validator;

use serde::{Deserialize, Serialize};

pub use aggregator::{AggregatorSettings, PlaceRegion};
pub use ingest::{Compression, IngestSettings};
pub use nats::NatsSettings;
pub use partners::{FeedFormat, ImportKind, PartnerSettings};
pub use push_tokens::{
    MIN_PUSH_TOKEN_BYTES, PushToken, PushTokenError, parse_push_tokens_file, parse_push_tokens_list,
};
pub use recommender::RecommenderSettings;
pub use redact::redact_url;
pub use redis::RedisSettings;
pub use storage::{StorageSettings, Topology};
pub use telemetry::{LogFormat, TelemetrySettings};
pub use validator::{RuleKind, RuleSettings, ValidatorSettings};

/// Why settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("cannot read settings: {0}")]
    Load(#[from] config::ConfigError),
    #[error("invalid setting `{key}`: {reason}")]
    Invalid { key: String, reason: String },
}

pub(crate) fn invalid(key: impl Into<String>, reason: impl Into<String>) -> SettingsError {
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

impl Settings {
    /// Checks what types alone cannot, section by section (each section
    /// checks itself; components handed one section can call its own).
    pub fn validate(&self) -> Result<(), SettingsError> {
        self.nats.validate()?;
        self.redis.validate()?;
        self.storage.validate()?;
        self.ingest.validate()?;
        self.validator.validate()?;
        self.aggregator.validate()?;
        self.recommender.validate()?;
        partners::validate(&self.partners)
    }

    /// What every service follows of storage's section.
    pub fn topology(&self) -> Topology {
        self.storage.topology()
    }

    /// The region of a place, from the aggregator's directory.
    pub fn region_of(&self, brand_id: i64, place_id: i64) -> Option<&str> {
        self.aggregator.region_of(brand_id, place_id)
    }

    pub fn partner(&self, name: &str) -> Option<&PartnerSettings> {
        self.partners.iter().find(|p| p.name == name)
    }
}

#[cfg(test)]
mod tests;

//! `[ingest]`: the ingest service's listener, batching, push limit and
//! import lease (the partners it imports are in `partners`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{SettingsError, invalid};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngestSettings {
    /// HTTP listen address of the ingest service (push endpoint, health).
    pub listen: String,
    /// A feed item larger than this (raw JSON bytes) is rejected.
    pub max_item_bytes: usize,
    /// Commands per CommandBatch (at most 1000).
    pub batch_size: usize,
    /// How command batches travel: `lz4` (compressed, said in the
    /// `Shelfsync-Encoding` header) or `none`. Storage reads both.
    pub compression: Compression,
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

/// How ingest encodes the command batches it publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum Compression {
    /// Plain protobuf.
    None,
    /// An LZ4 block of the protobuf bytes (≈4× smaller on catalogue data).
    Lz4,
}

impl TryFrom<String> for Compression {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "none" => Ok(Self::None),
            "lz4" => Ok(Self::Lz4),
            _ => Err(format!("ingest.compression: {s:?} is not one of \"lz4\", \"none\"")),
        }
    }
}

impl Default for IngestSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            max_item_bytes: 64 * 1024,
            batch_size: 1000,
            compression: Compression::Lz4,
            max_push_bytes: 1024 * 1024 * 1024,
            sweep_report_wait: Duration::from_secs(60),
            import_lease_ttl: Duration::from_secs(30),
        }
    }
}

impl IngestSettings {
    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if !(1..=1000).contains(&self.batch_size) {
            return Err(invalid("ingest.batch_size", "must be between 1 and 1000"));
        }
        if self.max_push_bytes == 0 {
            return Err(invalid("ingest.max_push_bytes", "must be at least 1"));
        }
        if self.import_lease_ttl < Duration::from_secs(1) {
            return Err(invalid("ingest.import_lease_ttl", "must be at least 1s"));
        }
        Ok(())
    }
}

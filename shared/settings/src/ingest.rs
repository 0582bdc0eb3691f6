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
    /// set no `max_push_bytes` of their own (default 256 MiB: a full dump
    /// of a million offers is about 100 MB; a partner with a larger one
    /// gets its own limit). A larger `Content-Length` is refused (413)
    /// before anything is read; a body that grows past it fails the import
    /// (413, nothing swept).
    pub max_push_bytes: u64,
    /// The push server: connections served at once (the others wait to be
    /// accepted).
    pub push_max_connections: usize,
    /// The push server: a request's headers must be in within this (a
    /// connection trickling them ties up nothing for long).
    #[serde(with = "humantime_serde")]
    pub push_header_timeout: Duration,
    /// The push server: a kept-alive connection with no request in flight
    /// is closed after this.
    #[serde(with = "humantime_serde")]
    pub push_idle_timeout: Duration,
    /// A pushed body must be read whole within this, counted from its
    /// request's start; later, the import fails (408, nothing swept).
    /// 10 minutes is 256 MiB at 450 kB/s.
    #[serde(with = "humantime_serde")]
    pub push_body_timeout: Duration,
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
    /// A place a partner's full imports carried is remembered (and sent a
    /// sweep by every later full import, held when the dump lacks it) until
    /// no full import has carried it for this long; 0 s: forever. The
    /// default matches `storage.absent_ttl` (30 days), after which storage
    /// has purged the place's absent records anyway.
    #[serde(with = "humantime_serde")]
    pub forget_places_after: Duration,
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
            max_push_bytes: 256 * 1024 * 1024,
            push_max_connections: 64,
            push_header_timeout: Duration::from_secs(10),
            push_idle_timeout: Duration::from_secs(30),
            push_body_timeout: Duration::from_secs(600),
            sweep_report_wait: Duration::from_secs(60),
            import_lease_ttl: Duration::from_secs(30),
            forget_places_after: Duration::from_secs(30 * 24 * 3600),
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
        if self.push_max_connections == 0 {
            return Err(invalid("ingest.push_max_connections", "must be at least 1"));
        }
        for (key, value) in [
            ("ingest.push_header_timeout", self.push_header_timeout),
            ("ingest.push_idle_timeout", self.push_idle_timeout),
            ("ingest.push_body_timeout", self.push_body_timeout),
        ] {
            if value.is_zero() {
                return Err(invalid(key, "must be more than 0 s"));
            }
        }
        if self.import_lease_ttl < Duration::from_secs(1) {
            return Err(invalid("ingest.import_lease_ttl", "must be at least 1s"));
        }
        Ok(())
    }
}

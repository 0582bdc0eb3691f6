//! `[redis]`: the Redis connection (standalone or cluster), its key
//! namespace and how long a commit waits for replicas.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::redact::{redact_url, redacted_url};
use crate::{SettingsError, invalid};

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

impl RedisSettings {
    /// The URL(s) without secrets, for logs and errors.
    pub fn url_redacted(&self) -> String {
        redact_url(&self.url)
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(invalid(
                "redis.tls_cert_file",
                "a client certificate needs its key (tls_key_file), and the reverse",
            ));
        }
        if self.urls().is_empty() {
            return Err(invalid("redis.url", "no server URL"));
        }
        if !self.cluster && self.urls().len() > 1 {
            return Err(invalid("redis.url", "several URLs need `redis.cluster = true`"));
        }
        if self.cluster && self.wait_replicas > 0 {
            return Err(invalid(
                "redis.wait_replicas",
                "is supported with a standalone Redis (and its replicas) only, not with `cluster = true`",
            ));
        }
        if self.wait_replicas > 0 && self.wait_timeout.is_zero() {
            return Err(invalid("redis.wait_timeout", "must be more than 0 s with wait_replicas"));
        }
        if self.namespace.is_empty()
            || !self.namespace.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
        {
            return Err(invalid("redis.namespace", "must be non-empty [A-Za-z0-9_.-]"));
        }
        Ok(())
    }
}

//! `[nats]`: the NATS connection and the JetStream streams every service
//! shares (their names under `prefix`, sizes, replicas).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::redact::{redact_url, redacted, redacted_url};
use crate::{SettingsError, invalid};

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
    /// The subject prefix of this client's reply inboxes (JetStream API
    /// replies, publish acks, pulled messages, request replies). The
    /// shipped NATS users each get their own (`_INBOX_<user>`) and may
    /// subscribe to nothing else under `_INBOX`, so one service cannot read
    /// another's replies.
    pub inbox_prefix: String,
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
            inbox_prefix: "_INBOX".into(),
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

impl NatsSettings {
    /// The URL(s) without secrets, for logs and errors.
    pub fn url_redacted(&self) -> String {
        redact_url(&self.url)
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.urls().is_empty() {
            return Err(invalid("nats.url", "no server URL"));
        }
        validate_prefix(&self.prefix)?;
        if !valid_subject_tokens(&self.inbox_prefix) {
            return Err(invalid(
                "nats.inbox_prefix",
                "must be dot-separated tokens of [A-Za-z0-9_-] (no wildcard)",
            ));
        }
        if !(1..=5).contains(&self.stream_replicas) {
            return Err(invalid("nats.stream_replicas", "must be between 1 and 5"));
        }
        for (key, value) in [
            ("nats.cmd_max_bytes", self.cmd_max_bytes),
            ("nats.changes_max_bytes", self.changes_max_bytes),
            ("nats.keyframes_max_bytes", self.keyframes_max_bytes),
            ("nats.aggregates_max_bytes", self.aggregates_max_bytes),
            ("nats.rejects_max_bytes", self.rejects_max_bytes),
        ] {
            if value > i64::MAX as u64 {
                return Err(invalid(key, "must be below 2^63"));
            }
        }
        if self.max_inflight == 0 {
            return Err(invalid("nats.max_inflight", "must be at least 1"));
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(invalid(
                "nats.tls_cert_file",
                "a client certificate needs its key (tls_key_file), and the reverse",
            ));
        }
        Ok(())
    }
}

fn valid_subject_tokens(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.split('.').all(|t| {
            !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        })
}

fn validate_prefix(prefix: &str) -> Result<(), SettingsError> {
    if valid_subject_tokens(prefix) {
        Ok(())
    } else {
        Err(invalid("nats.prefix", "must be dot-separated tokens of [A-Za-z0-9_-]"))
    }
}

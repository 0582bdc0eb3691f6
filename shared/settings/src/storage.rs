//! `[storage]`: partitions and replicas of the storage service, record
//! lifetimes, keyframes and the read API's limits.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{SettingsError, invalid};

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
    /// Ignored since storage stopped acking command messages (it reads the
    /// command stream without acks and purges what it applied); still
    /// accepted so that old config files keep loading. It was the JetStream
    /// ack wait of the command consumers.
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// First delay of a nak after a transient failure (doubles up to 5 s).
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
    /// Records per replica (over all its partitions) whose owners remember,
    /// in memory, the PATCHes that change nothing on them (a few hashes,
    /// about 70 bytes a record), so that an identical re-import of them
    /// reads nothing from Redis (0: off). Past it, records not yet
    /// remembered go through Redis. The same bound, separately, holds the
    /// live records' generations kept per place (about 30 bytes a record),
    /// so a sweep counts without scanning Redis: at most about 100 bytes
    /// times this, whatever the number of partitions.
    pub known_records: usize,
    /// Largest command message once decoded (an `lz4` payload says how
    /// large it is before anything is allocated); a larger one is set aside
    /// whole as `too_large`. 0: twice the server's `max_payload` (a command
    /// batch is under it uncompressed).
    pub max_message_bytes: usize,
    /// HTTP listen address of storage (read API, health).
    pub http_listen: String,
    /// Largest number of keys in one batch read, and of records in one page.
    pub read_max_batch: usize,
    /// Bearer tokens the HTTP read API asks for (`Authorization: Bearer
    /// <token>`; 401 without, 403 with another): a file, one token a line
    /// (re-read when it changes; removing it revokes them), and/or an
    /// environment variable naming them (read at start). Neither: the API
    /// is open (behind the network policies). `/healthz`, `/readyz` and
    /// `/metrics` stay open either way.
    pub read_tokens_file: Option<std::path::PathBuf>,
    pub read_tokens_env: Option<String>,
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
            known_records: 2_000_000,
            max_message_bytes: 0,
            http_listen: "127.0.0.1:8081".into(),
            read_max_batch: 1000,
            read_tokens_file: None,
            read_tokens_env: None,
        }
    }
}

/// What the other services must agree on with storage about the record
/// space: how many partitions it is cut into, how many storage replicas
/// answer a keyframe request, and how long a deletion is remembered.
/// Storage owns these settings; every other component is handed this
/// instead of the whole `[storage]` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    pub partitions: u32,
    pub storage_replicas: u32,
    pub tombstone_ttl: Duration,
}

impl StorageSettings {
    /// The part of this section the other services follow.
    pub fn topology(&self) -> Topology {
        Topology {
            partitions: self.partitions,
            storage_replicas: self.replicas,
            tombstone_ttl: self.tombstone_ttl,
        }
    }

    /// The decoded size limit of a command message on a server of
    /// `max_payload` (`max_message_bytes`, or twice `max_payload`).
    pub fn max_message_bytes_for(&self, max_payload: usize) -> usize {
        match self.max_message_bytes {
            0 => max_payload.saturating_mul(2),
            n => n,
        }
    }

    /// Partitions owned by this replica: `p % replicas == replica`.
    pub fn owned_partitions(&self) -> Vec<u32> {
        (0..self.partitions).filter(|p| p % self.replicas == self.replica).collect()
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if !(1..=4096).contains(&self.partitions) {
            return Err(invalid("storage.partitions", "must be between 1 and 4096"));
        }
        if self.replicas == 0 || self.replicas > self.partitions {
            return Err(invalid("storage.replicas", "must be between 1 and storage.partitions"));
        }
        if self.replica >= self.replicas {
            return Err(invalid(
                "storage.replica",
                format!("{} is not below storage.replicas = {}", self.replica, self.replicas),
            ));
        }
        if !self.keyframe_schedule.trim().is_empty() {
            use std::str::FromStr;
            cron::Schedule::from_str(&self.keyframe_schedule).map_err(|e| {
                invalid(
                    "storage.keyframe_schedule",
                    format!("{e} (expected `sec min hour day month weekday`, UTC)"),
                )
            })?;
        }
        if self.keyframes_kept == 0 {
            return Err(invalid("storage.keyframes_kept", "must be at least 1"));
        }
        if !(1..=1024).contains(&self.keyframe_concurrency) {
            return Err(invalid("storage.keyframe_concurrency", "must be between 1 and 1024"));
        }
        if self.read_ahead > 1000 {
            return Err(invalid("storage.read_ahead", "must be at most 1000"));
        }
        if !(1..=10_000).contains(&self.read_max_batch) {
            return Err(invalid("storage.read_max_batch", "must be between 1 and 10000"));
        }
        if self.max_record_bytes < 1024 {
            return Err(invalid("storage.max_record_bytes", "must be at least 1024"));
        }
        Ok(())
    }
}

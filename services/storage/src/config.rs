//! What storage reads of the settings: the NATS and Redis connections every
//! service shares, and its own `[storage]` section. Built once from the
//! whole settings at start; the workers and the keyframes' connections take
//! this, the read API only the storage section.

use shelfsync_settings::{NatsSettings, RedisSettings, Settings, StorageSettings, Topology};

#[derive(Debug, Clone)]
pub struct Config {
    pub nats: NatsSettings,
    pub redis: RedisSettings,
    pub storage: StorageSettings,
}

impl From<&Settings> for Config {
    fn from(s: &Settings) -> Self {
        Config { nats: s.nats.clone(), redis: s.redis.clone(), storage: s.storage.clone() }
    }
}

impl Config {
    /// The part of the storage section the other services follow too.
    pub fn topology(&self) -> Topology {
        self.storage.topology()
    }
}

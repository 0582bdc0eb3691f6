//! What the aggregator reads of the settings file: the parts every service
//! shares (NATS, Redis, the record space's topology) and its own section.
//! The App cuts it out of the whole file once; nothing below sees the rest.

use shelfsync_settings::{AggregatorSettings, NatsSettings, RedisSettings, Settings, Topology};

#[derive(Debug, Clone)]
pub struct Config {
    pub nats: NatsSettings,
    pub redis: RedisSettings,
    pub topology: Topology,
    pub aggregator: AggregatorSettings,
}

impl From<&Settings> for Config {
    fn from(s: &Settings) -> Self {
        Config {
            nats: s.nats.clone(),
            redis: s.redis.clone(),
            topology: s.topology(),
            aggregator: s.aggregator.clone(),
        }
    }
}

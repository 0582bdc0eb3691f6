//! Test harness: starts REAL `nats-server` (JetStream) and `redis-server` processes on loopback
//! ports, each with its own temp dir, so tests run in parallel against real servers, never mocks.
//! It owns only those child processes and temp dirs; it must not touch the shared servers on the
//! default ports (4222/6379) or the process environment.
//!
//! - [`NatsServer`] / [`RedisServer`]: one child process each, killed on drop, restartable on the
//!   same port and data dir for fault tests.
//! - [`RedisCluster`] / [`NatsCluster`]: a real Redis Cluster (`redis-cli --cluster create`) and
//!   a NATS cluster with clustered JetStream, node by node killable, for scale-out tests.
//! - [`TestEnv`]: both servers plus a unique prefix/namespace for one test, and default settings
//!   pointed at them.
//! - [`eventually`]: wait for a condition with a deadline instead of sleeping.
//! - [`settings_env`]: the environment that hands settings to a child process.
//! - [`workspace_bin`], [`nats_server_bin`], [`redis_server_bin`], [`redis_cli_bin`]: locate the
//!   binaries to run; [`stdout_of_success`]: what a run of one printed, if it succeeded.

#![forbid(unsafe_code)]

mod bins;
mod cluster;
mod env;
mod nats;
mod process;
mod redis;

use std::future::Future;
use std::time::{Duration, Instant};

use shelfsync_settings::Settings;

pub use bins::{
    nats_server_bin, redis_cli_bin, redis_server_bin, stdout_of_success, workspace_bin,
};
pub use cluster::{NatsCluster, RedisCluster};
pub use env::settings_env;
pub use nats::NatsServer;
pub use process::signal;
pub use redis::RedisServer;

/// Both servers plus a unique prefix/namespace, so many tests can share nothing but the machine.
pub struct TestEnv {
    pub nats: NatsServer,
    pub redis: RedisServer,
    /// Prefix for subjects and stream names, e.g. `tq3x9k0a7mz`.
    pub prefix: String,
    /// Redis key namespace; the same value as `prefix` so a test's subjects and keys correlate.
    pub namespace: String,
}

impl TestEnv {
    /// Starts NATS and Redis concurrently (they are independent, so start-up costs the slower one).
    pub async fn start() -> anyhow::Result<TestEnv> {
        let (nats, redis) = tokio::try_join!(NatsServer::start(), RedisServer::start())?;
        let prefix = unique_name();
        Ok(TestEnv { nats, redis, namespace: prefix.clone(), prefix })
    }

    /// Servers started by the caller (a special config), with a fresh
    /// prefix and namespace.
    pub fn with_servers(nats: NatsServer, redis: RedisServer) -> TestEnv {
        let prefix = unique_name();
        TestEnv { nats, redis, namespace: prefix.clone(), prefix }
    }

    /// Default settings pointed at these servers, with this test's prefix and namespace.
    pub fn settings(&self) -> Settings {
        let mut s = Settings::default();
        s.nats.url = self.nats.url();
        s.nats.prefix = self.prefix.clone();
        s.redis.url = self.redis.url();
        s.redis.namespace = self.namespace.clone();
        s
    }
}

/// `t` + 10 random lowercase alphanumerics: valid in NATS subjects, stream names and Redis keys.
pub fn unique_name() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut bits = process::random_u64() as u128 | ((process::random_u64() as u128) << 64);
    let mut name = String::from("t");
    for _ in 0..10 {
        name.push(ALPHABET[(bits % 36) as usize] as char);
        bits /= 36;
    }
    name
}

/// Polls `cond` every 20ms until it returns true; panics with `what` and the elapsed time once
/// `timeout` passes. A `cond` that hangs is cut off at the deadline too, so the test still fails.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        let remaining = timeout.saturating_sub(start.elapsed());
        if let Ok(true) = tokio::time::timeout(remaining, cond()).await {
            return;
        }
        if start.elapsed() >= timeout {
            panic!("timed out waiting for {what} after {:?}", start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_have_the_documented_shape() {
        let (a, b) = (unique_name(), unique_name());
        assert_ne!(a, b);
        for name in [a, b] {
            assert_eq!(name.len(), 11, "{name}");
            assert!(name.starts_with('t'));
            assert!(name.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()), "{name}");
        }
    }

    #[tokio::test]
    async fn eventually_returns_once_the_condition_holds() {
        let mut calls = 0;
        eventually(Duration::from_secs(5), "third call", || {
            calls += 1;
            let done = calls >= 3;
            async move { done }
        })
        .await;
        assert_eq!(calls, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "timed out waiting for the impossible")]
    async fn eventually_panics_on_timeout() {
        eventually(Duration::from_millis(100), "the impossible", || async { false }).await;
    }

    #[tokio::test]
    async fn test_envs_get_distinct_prefixes() -> anyhow::Result<()> {
        let (a, b) = tokio::try_join!(TestEnv::start(), TestEnv::start())?;
        assert_ne!(a.prefix, b.prefix);
        assert_eq!(a.prefix, a.namespace);
        assert_ne!(a.nats.port(), b.nats.port());
        assert_ne!(a.redis.port(), b.redis.port());
        Ok(())
    }
}

//! Ingest's own state in Redis: per partner, the HTTP validators of the last
//! successful import, the last reports, and the lease of the running full
//! import (its logic is in `lease`). Never touches records (storage owns
//! those).
//!
//! Keys: `{namespace}:ingest:{partner}:etag`, `…:last_modified`, `…:reports`
//! (a list, newest first), `…:places` (a set: the places full imports
//! carried, so that a place missing from a later dump is noticed), `…:lease`
//! (a string with a TTL: the holder). Every step touches one key, so it runs
//! unchanged on a Redis Cluster (`[redis] cluster = true`).

use std::time::Duration;

use redis::{Cmd, FromRedisValue, RedisResult, Script};
use shelfsync_redis::RedisConn;
use shelfsync_settings::RedisSettings;

use crate::source::Validators;

/// Reports kept per partner.
pub const KEPT_REPORTS: isize = 20;

/// Extends the lease only if it still holds our value.
const RENEW_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0"#;

/// Deletes the lease only if it still holds our value.
const RELEASE_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0"#;

#[derive(Clone)]
pub(crate) struct State {
    conn: RedisConn,
    namespace: String,
    renew: Script,
    release: Script,
}

impl State {
    pub async fn connect(cfg: &RedisSettings) -> RedisResult<State> {
        Ok(State {
            conn: RedisConn::connect(cfg).await?,
            namespace: cfg.namespace.clone(),
            renew: Script::new(RENEW_LUA),
            release: Script::new(RELEASE_LUA),
        })
    }

    fn key(&self, partner: &str, what: &str) -> String {
        format!("{}:ingest:{partner}:{what}", self.namespace)
    }

    async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        cmd.query_async(&mut self.conn.clone()).await
    }

    pub async fn validators(&self, partner: &str) -> RedisResult<Validators> {
        Ok(Validators {
            etag: self.query(redis::cmd("GET").arg(self.key(partner, "etag"))).await?,
            last_modified: self
                .query(redis::cmd("GET").arg(self.key(partner, "last_modified")))
                .await?,
        })
    }

    pub async fn save_validators(&self, partner: &str, v: &Validators) -> RedisResult<()> {
        for (what, value) in [("etag", &v.etag), ("last_modified", &v.last_modified)] {
            let key = self.key(partner, what);
            let cmd = match value {
                Some(value) => redis::cmd("SET").arg(key).arg(value).to_owned(),
                None => redis::cmd("DEL").arg(key).to_owned(),
            };
            self.query::<()>(&cmd).await?;
        }
        Ok(())
    }

    pub async fn push_report(&self, partner: &str, json: &str) -> RedisResult<()> {
        // One key, so the transaction is single-slot on a cluster too.
        let key = self.key(partner, "reports");
        redis::pipe()
            .atomic()
            .lpush(&key, json)
            .ignore()
            .ltrim(&key, 0, KEPT_REPORTS - 1)
            .ignore()
            .query_async(&mut self.conn.clone())
            .await
    }

    /// The places earlier full imports of `partner` carried.
    pub async fn known_places(
        &self,
        partner: &str,
    ) -> RedisResult<std::collections::BTreeSet<i64>> {
        let raw: Vec<String> =
            self.query(redis::cmd("SMEMBERS").arg(self.key(partner, "places"))).await?;
        Ok(raw.iter().filter_map(|p| p.parse().ok()).collect())
    }

    /// Remembers places a full import of `partner` carried: a later import
    /// missing one of them sends a (held) sweep for it.
    pub async fn add_known_places(
        &self,
        partner: &str,
        places: &std::collections::BTreeSet<i64>,
    ) -> RedisResult<()> {
        if places.is_empty() {
            return Ok(());
        }
        let members: Vec<String> = places.iter().map(i64::to_string).collect();
        self.query(redis::cmd("SADD").arg(self.key(partner, "places")).arg(members)).await
    }

    /// The last `n` reports, newest first, as stored (JSON).
    pub async fn reports(&self, partner: &str, n: usize) -> RedisResult<Vec<String>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let stop = n.min(KEPT_REPORTS as usize) as isize - 1;
        self.query(redis::cmd("LRANGE").arg(self.key(partner, "reports")).arg(0).arg(stop)).await
    }

    /// `SET lease holder NX PX ttl`: true when taken.
    pub async fn lease_take(
        &self,
        partner: &str,
        holder: &str,
        ttl: Duration,
    ) -> RedisResult<bool> {
        let key = self.key(partner, "lease");
        let cmd =
            redis::cmd("SET").arg(key).arg(holder).arg("NX").arg("PX").arg(millis(ttl)).to_owned();
        Ok(self.query::<Option<String>>(&cmd).await?.is_some())
    }

    /// Who holds the lease now, as stored (`None`: nobody).
    pub async fn lease_holder(&self, partner: &str) -> RedisResult<Option<String>> {
        self.query(redis::cmd("GET").arg(self.key(partner, "lease"))).await
    }

    /// Extends the lease to `ttl` if `holder` still holds it.
    pub async fn lease_renew(
        &self,
        partner: &str,
        holder: &str,
        ttl: Duration,
    ) -> RedisResult<bool> {
        let mut invocation = self.renew.key(self.key(partner, "lease"));
        invocation.arg(holder).arg(millis(ttl));
        let renewed: i64 = invocation.invoke_async(&mut self.conn.clone()).await?;
        Ok(renewed == 1)
    }

    /// Deletes the lease if `holder` still holds it.
    pub async fn lease_release(&self, partner: &str, holder: &str) -> RedisResult<bool> {
        let mut invocation = self.release.key(self.key(partner, "lease"));
        invocation.arg(holder);
        let released: i64 = invocation.invoke_async(&mut self.conn.clone()).await?;
        Ok(released == 1)
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis().max(1) as u64
}

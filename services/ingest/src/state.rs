//! Ingest's own state in Redis: per partner, the HTTP validators of the last
//! successful import and the last reports. Never touches records (storage
//! owns those).
//!
//! Keys: `{namespace}:ingest:{partner}:etag`, `…:last_modified`, `…:reports`
//! (a list, newest first). Every step touches one key, so it runs unchanged
//! on a Redis Cluster (`[redis] cluster = true`).

use redis::{Cmd, FromRedisValue, RedisResult};
use shelfsync_redis::RedisConn;
use shelfsync_settings::RedisSettings;

use crate::source::Validators;

/// Reports kept per partner.
pub const KEPT_REPORTS: isize = 20;

#[derive(Clone)]
pub(crate) struct State {
    conn: RedisConn,
    namespace: String,
}

impl State {
    pub async fn connect(cfg: &RedisSettings) -> RedisResult<State> {
        Ok(State { conn: RedisConn::connect(cfg).await?, namespace: cfg.namespace.clone() })
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

    /// The last `n` reports, newest first, as stored (JSON).
    pub async fn reports(&self, partner: &str, n: usize) -> RedisResult<Vec<String>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let stop = n.min(KEPT_REPORTS as usize) as isize - 1;
        self.query(redis::cmd("LRANGE").arg(self.key(partner, "reports")).arg(0).arg(stop)).await
    }
}

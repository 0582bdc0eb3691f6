//! Ingest's own state in Redis: per partner, the HTTP validators of the last
//! successful import and the last reports. Never touches records (storage
//! owns those).
//!
//! Keys: `{namespace}:ingest:{partner}:etag`, `…:last_modified`, `…:reports`
//! (a list, newest first).

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, RedisResult};
use shelfsync_settings::RedisSettings;

use crate::source::Validators;

/// Reports kept per partner.
pub const KEPT_REPORTS: isize = 20;

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

#[derive(Clone)]
pub(crate) struct State {
    conn: Conn,
    namespace: String,
}

impl State {
    pub async fn connect(cfg: &RedisSettings) -> RedisResult<State> {
        let conn = if cfg.cluster {
            Conn::Cluster(
                redis::cluster::ClusterClient::new(cfg.urls())?.get_async_connection().await?,
            )
        } else {
            Conn::Single(redis::Client::open(cfg.url.as_str())?.get_connection_manager().await?)
        };
        Ok(State { conn, namespace: cfg.namespace.clone() })
    }

    fn key(&self, partner: &str, what: &str) -> String {
        format!("{}:ingest:{partner}:{what}", self.namespace)
    }

    async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        async fn on<T: FromRedisValue>(mut c: impl ConnectionLike, cmd: &Cmd) -> RedisResult<T> {
            cmd.query_async(&mut c).await
        }
        match self.conn.clone() {
            Conn::Single(c) => on(c, cmd).await,
            Conn::Cluster(c) => on(c, cmd).await,
        }
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
        let key = self.key(partner, "reports");
        self.query::<()>(redis::cmd("LPUSH").arg(&key).arg(json)).await?;
        self.query::<()>(redis::cmd("LTRIM").arg(&key).arg(0).arg(KEPT_REPORTS - 1)).await
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

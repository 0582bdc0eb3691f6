//! Ingest's own state in Redis: per partner, the HTTP validators of the last
//! successful import, the last reports, the places full imports carried,
//! and the lease and generation of full imports (the lease's logic is in
//! `lease`). Never touches records (storage owns those).
//!
//! Keys: `{namespace}:ingest:{partner}:etag`, `…:last_modified`, `…:reports`
//! (a list, newest first), `…:seen` (a sorted set: each place full imports
//! carried, scored by the generation of the last one that did, so that a
//! place missing from a later dump is noticed, and forgotten after
//! `ingest.forget_places_after`); under the partner's hash tag,
//! `{{namespace}:ingest:{partner}}:lease` (a string with a TTL: the holder)
//! and `…:generation` (the last full import's generation), which one script
//! takes together. Every step touches one key or one hash tag, so it runs
//! unchanged on a Redis Cluster (`[redis] cluster = true`).

use std::time::Duration;

use redis::{Cmd, FromRedisValue, RedisResult, Script};
use shelfsync_redis::RedisConn;
use shelfsync_settings::RedisSettings;

use crate::source::Validators;

/// Reports kept per partner.
pub const KEPT_REPORTS: isize = 20;

/// What the holder's value says in place of the import's generation, which
/// [`TAKE_LUA`] writes in when it decides it.
pub(crate) const GENERATION_SLOT: &str = "@GENERATION@";

/// Takes the lease (KEYS[1]) if nobody holds it and, in the same atomic
/// step, the import's generation: its start ARGV[3] (µs), or the last
/// generation of the partner (KEYS[2]) + 1 when the clock says otherwise,
/// so that generations only grow whatever a host's clock says. Stores the
/// holder ARGV[1] with the generation written in, for ARGV[2] ms, records
/// the generation and returns it (as a string: a Lua number is a double);
/// `false` when the lease is held.
const TAKE_LUA: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local gen = tonumber(ARGV[3])
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if gen <= last then gen = last + 1 end
local id = string.format('%d', gen)
local holder = string.gsub(ARGV[1], '@GENERATION@', id)
redis.call('SET', KEYS[1], holder, 'PX', ARGV[2])
redis.call('SET', KEYS[2], id)
return id"#;

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
    take: Script,
    renew: Script,
    release: Script,
}

impl State {
    pub async fn connect(cfg: &RedisSettings) -> RedisResult<State> {
        Ok(State {
            conn: RedisConn::connect(cfg).await?,
            namespace: cfg.namespace.clone(),
            take: Script::new(TAKE_LUA),
            renew: Script::new(RENEW_LUA),
            release: Script::new(RELEASE_LUA),
        })
    }

    fn key(&self, partner: &str, what: &str) -> String {
        format!("{}:ingest:{partner}:{what}", self.namespace)
    }

    /// A key of the partner's hash tag: the lease and the generation, which
    /// one script reads and writes together.
    fn tagged(&self, partner: &str, what: &str) -> String {
        format!("{{{}:ingest:{partner}}}:{what}", self.namespace)
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

    /// The places earlier full imports of `partner` carried, not forgotten
    /// yet: those an import of generation `generation` has seen since
    /// `generation - forget_after` (every one with `forget_after` 0). A
    /// set an earlier version kept (`…:places`) is moved in first, as seen
    /// by this import.
    pub async fn known_places(
        &self,
        partner: &str,
        generation: i64,
        forget_after: Duration,
    ) -> RedisResult<std::collections::BTreeSet<i64>> {
        let seen = self.key(partner, "seen");
        let legacy: Vec<String> =
            self.query(redis::cmd("SMEMBERS").arg(self.key(partner, "places"))).await?;
        if !legacy.is_empty() {
            let mut add = redis::cmd("ZADD");
            add.arg(&seen);
            for p in &legacy {
                add.arg(generation).arg(p);
            }
            self.query::<()>(&add).await?;
            self.query::<()>(redis::cmd("DEL").arg(self.key(partner, "places"))).await?;
        }
        let from = cutoff(generation, forget_after).map_or("-inf".into(), |g| g.to_string());
        let raw: Vec<String> =
            self.query(redis::cmd("ZRANGEBYSCORE").arg(&seen).arg(from).arg("+inf")).await?;
        Ok(raw.iter().filter_map(|p| p.parse().ok()).collect())
    }

    /// Remembers that the full import `generation` of `partner` carried
    /// `places`, and forgets the places no import has carried for
    /// `forget_after` (0: never): by then storage has purged their absent
    /// records (`storage.absent_ttl`), and a sweep for them would find
    /// nothing. Returns how many places are remembered.
    pub async fn remember_places(
        &self,
        partner: &str,
        places: &std::collections::BTreeSet<i64>,
        generation: i64,
        forget_after: Duration,
    ) -> RedisResult<u64> {
        let seen = self.key(partner, "seen");
        let mut pipe = redis::pipe();
        pipe.atomic();
        if !places.is_empty() {
            let add = pipe.cmd("ZADD").arg(&seen);
            for p in places {
                add.arg(generation).arg(p);
            }
            add.ignore();
        }
        if let Some(oldest) = cutoff(generation, forget_after) {
            pipe.cmd("ZREMRANGEBYSCORE").arg(&seen).arg("-inf").arg(format!("({oldest}")).ignore();
        }
        pipe.cmd("ZCARD").arg(&seen);
        let (count,): (u64,) = pipe.query_async(&mut self.conn.clone()).await?;
        Ok(count)
    }

    /// The last `n` reports, newest first, as stored (JSON).
    pub async fn reports(&self, partner: &str, n: usize) -> RedisResult<Vec<String>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let stop = n.min(KEPT_REPORTS as usize) as isize - 1;
        self.query(redis::cmd("LRANGE").arg(self.key(partner, "reports")).arg(0).arg(stop)).await
    }

    /// Takes the lease for `holder` (its [`GENERATION_SLOT`] filled in) and
    /// the import's generation ([`TAKE_LUA`]): `None` when another holds it.
    pub async fn lease_take(
        &self,
        partner: &str,
        holder: &str,
        ttl: Duration,
        start: i64,
    ) -> RedisResult<Option<i64>> {
        let mut invocation = self.take.key(self.tagged(partner, "lease"));
        invocation.key(self.tagged(partner, "generation")).arg(holder).arg(millis(ttl)).arg(start);
        let taken: Option<String> = invocation.invoke_async(&mut self.conn.clone()).await?;
        Ok(taken.and_then(|g| g.parse().ok()))
    }

    /// Who holds the lease now, as stored (`None`: nobody).
    pub async fn lease_holder(&self, partner: &str) -> RedisResult<Option<String>> {
        self.query(redis::cmd("GET").arg(self.tagged(partner, "lease"))).await
    }

    /// Extends the lease to `ttl` if `holder` still holds it.
    pub async fn lease_renew(
        &self,
        partner: &str,
        holder: &str,
        ttl: Duration,
    ) -> RedisResult<bool> {
        let mut invocation = self.renew.key(self.tagged(partner, "lease"));
        invocation.arg(holder).arg(millis(ttl));
        let renewed: i64 = invocation.invoke_async(&mut self.conn.clone()).await?;
        Ok(renewed == 1)
    }

    /// Deletes the lease if `holder` still holds it.
    pub async fn lease_release(&self, partner: &str, holder: &str) -> RedisResult<bool> {
        let mut invocation = self.release.key(self.tagged(partner, "lease"));
        invocation.arg(holder);
        let released: i64 = invocation.invoke_async(&mut self.conn.clone()).await?;
        Ok(released == 1)
    }
}

/// The oldest generation still remembered by an import of `generation`
/// (µs): `forget_after` before it; `None` (every one) with 0.
fn cutoff(generation: i64, forget_after: Duration) -> Option<i64> {
    if forget_after.is_zero() {
        return None;
    }
    Some(generation.saturating_sub(i64::try_from(forget_after.as_micros()).unwrap_or(i64::MAX)))
}

fn millis(d: Duration) -> u64 {
    d.as_millis().max(1) as u64
}

//! The writes of the commit path as a list interpreted by Lua
//! ([`OPS_LUA`]): built by [`CommitOps`] and the write builders below
//! (slots, touched sets, decided sweeps), run by [`COMMIT_LUA`] — fenced, so
//! that a second owner of a partition writes nothing. The purges, sweeps
//! and layout upgrades write through the same list.

use std::collections::{BTreeMap, HashMap};

use prost::Message;
use redis::Value;
use shelfsync_proto::{PlaceKey, SweepOutcome};

use super::{Fence, Keys, Position, RedisConn, StoreError, stored_bytes};
use crate::apply::Slots;
use crate::apply::touched_set::Appends;

/// How long a sweep's outcome is kept for its import's report, and a
/// touched set whose sweep did not come (refreshed by every append).
const SWEPT_TTL_MS: u64 = 7 * 24 * 3600 * 1000;
/// How long the touched set of a held sweep is kept, for its release.
const HELD_TOUCHED_TTL_MS: u64 = 30 * 24 * 3600 * 1000;

/// The interpreter of a list of writes, shared by [`COMMIT_LUA`] and
/// the purges. From ARGV[i] on, each write is `op key-index count
/// args...`. `CHSET` and `CHDEL` are `HSET` and `HDEL` on a place's records:
/// their first two args are the key indices of the place's
/// frozen marker and of its frozen hash, and while the marker exists, the
/// value each field had before its first write since the freeze is kept
/// there (`=`value, or `-` when it had none): copy on write, so a freeze is
/// one small step whatever the size of the place.
const OPS_LUA: &str = r#"
local function keep(marker, frozen, key, from, to, stride)
  if redis.call('EXISTS', marker) == 0 then return end
  for j = from, to, stride do
    local f = ARGV[j]
    if redis.call('HEXISTS', frozen, f) == 0 then
      local old = redis.call('HGET', key, f)
      if old then redis.call('HSET', frozen, f, '=' .. old) else redis.call('HSET', frozen, f, '-') end
    end
  end
  local ttl = redis.call('PTTL', marker)
  if ttl > 0 then redis.call('PEXPIRE', frozen, ttl) end
end
local function run_ops(i)
  local n = #ARGV
  while i <= n do
    local op = ARGV[i]
    local key = KEYS[tonumber(ARGV[i + 1])]
    local count = tonumber(ARGV[i + 2])
    i = i + 3
    local from = i
    if op == 'IDX' then
      -- An index of expiring keys: member scored by when it expires, the
      -- expired ones dropped (its size is a metric).
      local t = redis.call('TIME')
      local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      redis.call('ZADD', key, ms + tonumber(ARGV[i + 1]), ARGV[i])
      redis.call('ZREMRANGEBYSCORE', key, '-inf', ms)
    else
      if op == 'CHSET' or op == 'CHDEL' then
        local stride = 1
        if op == 'CHSET' then stride = 2 end
        keep(KEYS[tonumber(ARGV[i])], KEYS[tonumber(ARGV[i + 1])], key, i + 2, i + count - 1, stride)
        op = string.sub(op, 2)
        from = i + 2
      elseif op ~= 'ZADD' and op ~= 'ZREM' and op ~= 'RPUSH' and op ~= 'SADD' and op ~= 'HSET'
          and op ~= 'HDEL' and op ~= 'PEXPIRE' and op ~= 'LTRIM' and op ~= 'APPEND'
          and op ~= 'DEL' then
        return 'unknown op ' .. op
      end
      redis.call(op, key, unpack(ARGV, from, i + count - 1))
    end
    i = i + count
  end
end
"#;

/// Checks that the partition stands where the caller read it (KEYS[1] the
/// applied sequence = ARGV[1], KEYS[3] the step = ARGV[3], and — when ARGV[5]
/// is not empty — KEYS[4] the command stream's identity = ARGV[5]), then runs
/// every write ([`OPS_LUA`] from ARGV[7] on) and moves the partition to
/// ARGV[2] / ARGV[4] (an empty step: none), all in one atomic step.
///
/// The commit's outbox entries (ARGV[6] of them, `0`: none) were added to
/// the staging stream KEYS[5] just before, in the same `MULTI`, so that
/// their bytes never pass through Lua (which hashes every byte of every
/// string it is given). Fenced, the script drops them; done, it makes them
/// the outbox (KEYS[2]): by renaming the stream when the outbox is empty,
/// as it is after every relay, else by appending them one by one. The
/// outbox's ids never repeat over its life, since a relay that lost the
/// partition may still delete the ids it peeked: the stage's ids come from
/// the clock, so it is renamed only when they all follow the outbox's last
/// id (checked without reading an entry's bytes); when the clock has not
/// moved on since the last entries (the same millisecond) or went back,
/// the entries are appended instead, with ids that follow.
///
/// Returns 0 when fenced, else the outbox's length, 1 when the staged
/// entries became the outbox as they are (their ids kept) or 0, and then
/// the ids of the entries appended: when the length equals the count of
/// this commit's entries, the outbox holds exactly them, which the relay
/// then publishes from memory instead of reading them back.
const COMMIT_LUA: &str = r#"
local function after_last(outbox, stage)
  if redis.call('EXISTS', outbox) == 0 then return true end
  local info = redis.call('XINFO', 'STREAM', outbox)
  for j = 1, #info, 2 do
    if info[j] == 'last-generated-id' then
      return #redis.call('XRANGE', stage, '-', info[j + 1], 'COUNT', 1) == 0
    end
  end
  return false
end
local function fenced()
  if ARGV[6] ~= '0' then redis.call('DEL', KEYS[5]) end
  return 0
end
local cur = redis.call('GET', KEYS[1]) or '0'
if cur ~= ARGV[1] then return fenced() end
local step = redis.call('GET', KEYS[3]) or ''
if step ~= ARGV[3] then return fenced() end
if ARGV[5] ~= '' and (redis.call('GET', KEYS[4]) or '') ~= ARGV[5] then return fenced() end
local err = run_ops(7)
if err then return redis.error_reply('commit: ' .. err) end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[4] == '' then redis.call('DEL', KEYS[3]) else redis.call('SET', KEYS[3], ARGV[4]) end
local kept, added = 0, {}
if ARGV[6] ~= '0' then
  if redis.call('XLEN', KEYS[2]) == 0 and after_last(KEYS[2], KEYS[5]) then
    redis.call('RENAME', KEYS[5], KEYS[2])
    kept = 1
  else
    for _, e in ipairs(redis.call('XRANGE', KEYS[5], '-', '+')) do
      added[#added + 1] = redis.call('XADD', KEYS[2], '*', e[2][1], e[2][2])
    end
    redis.call('DEL', KEYS[5])
  end
end
local out = {redis.call('XLEN', KEYS[2]), kept}
for _, id in ipairs(added) do out[#out + 1] = id end
return out
"#;

/// The script of the commit (and of the purges, fenced the same way).
pub(super) fn commit_script() -> redis::Script {
    redis::Script::new(&format!("{OPS_LUA}{COMMIT_LUA}"))
}

/// Lua's `unpack` is bounded by the C stack (~8000 values): ops are chunked.
const MAX_OP_ARGS: usize = 1000;

/// Builds the argument list of [`COMMIT_LUA`].
pub(super) struct CommitOps {
    keys: Vec<String>,
    key_index: HashMap<String, usize>,
    args: Vec<Vec<u8>>,
}

impl CommitOps {
    /// For [`COMMIT_LUA`]: the fence and the position it moves to.
    pub(super) fn new(keys: &Keys, fence: &Fence, to: &Position) -> Self {
        let mut ops = Self::empty();
        for k in [keys.seq(), keys.outbox(), keys.step(), keys.stream(), keys.outbox_stage()] {
            ops.key(&k);
        }
        for a in [
            fence.at.applied.to_string(),
            to.applied.to_string(),
            fence.at.step.clone(),
            to.step.clone(),
            fence.stream.clone(),
            // Outbox entries staged (see `COMMIT_LUA`): none unless said.
            "0".into(),
        ] {
            ops.args.push(a.into_bytes());
        }
        ops
    }

    /// Says that `n` outbox entries were staged for this commit.
    pub(super) fn staged(&mut self, n: usize) {
        self.args[STAGED_ARG] = n.to_string().into_bytes();
    }

    fn empty() -> Self {
        Self { keys: Vec::new(), key_index: HashMap::new(), args: Vec::new() }
    }

    fn key(&mut self, k: &str) -> usize {
        if let Some(&i) = self.key_index.get(k) {
            return i;
        }
        self.keys.push(k.to_string());
        self.key_index.insert(k.to_string(), self.keys.len());
        self.keys.len()
    }

    /// Adds `op key args...`, split into chunks whose length is a multiple of
    /// `stride` (field/value pairs stay together).
    pub(super) fn op(&mut self, op: &str, key: &str, args: Vec<Vec<u8>>, stride: usize) {
        self.op_with(op, key, &[], args, stride);
    }

    /// `HSET` (stride 2) or `HDEL` (stride 1) on a place's records, keeping the frozen values while a keyframe has the place
    /// frozen (`CHSET`/`CHDEL` of [`OPS_LUA`]).
    pub(super) fn kept_op(
        &mut self,
        key: &str,
        marker: &str,
        frozen: &str,
        args: Vec<Vec<u8>>,
        stride: usize,
    ) {
        let op = if stride == 2 { "CHSET" } else { "CHDEL" };
        let prefix = [self.key(marker), self.key(frozen)].map(|i| i.to_string().into_bytes());
        self.op_with(op, key, &prefix, args, stride);
    }

    /// Notes `member` in the index `key` of expiring keys, expiring in
    /// `ttl_ms` (`IDX` of [`OPS_LUA`]).
    fn indexed(&mut self, key: &str, member: Vec<u8>, ttl_ms: u64) {
        self.op_with("IDX", key, &[], vec![member, ttl_ms.to_string().into_bytes()], 2);
    }

    /// Adds `op key` with no args (`DEL`).
    fn bare_op(&mut self, op: &str, key: &str) {
        let ki = self.key(key);
        self.args.extend([op.as_bytes().to_vec(), ki.to_string().into_bytes(), b"0".to_vec()]);
    }

    fn op_with(
        &mut self,
        op: &str,
        key: &str,
        prefix: &[Vec<u8>],
        args: Vec<Vec<u8>>,
        stride: usize,
    ) {
        if args.is_empty() {
            return;
        }
        let ki = self.key(key);
        let chunk = MAX_OP_ARGS - MAX_OP_ARGS % stride;
        let (total, mut args) = (args.len(), args.into_iter());
        for start in (0..total).step_by(chunk) {
            let n = chunk.min(total - start);
            self.args.push(op.as_bytes().to_vec());
            self.args.push(ki.to_string().into_bytes());
            self.args.push((prefix.len() + n).to_string().into_bytes());
            self.args.extend(prefix.iter().cloned());
            self.args.extend(args.by_ref().take(n));
        }
    }

    /// `EVALSHA` of the script (by its hash) with these keys and args, built
    /// in one buffer of the right size (a commit is hundreds of KB).
    pub(super) fn command(&self, verb: &str, script: &str) -> redis::Cmd {
        let count = 3 + self.keys.len() + self.args.len();
        let bytes = script.len()
            + self.keys.iter().map(String::len).sum::<usize>()
            + self.args.iter().map(Vec::len).sum::<usize>()
            + 64;
        let mut cmd = redis::Cmd::with_capacity(count, bytes);
        cmd.arg(verb).arg(script).arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k);
        }
        for a in &self.args {
            cmd.arg(a.as_slice());
        }
        cmd
    }

    /// Runs `script` with these keys and args (`EVALSHA`; the script is
    /// loaded first if Redis does not have it: a restart flushes scripts).
    pub(super) async fn invoke(
        &self,
        script: &redis::Script,
        conn: &mut RedisConn,
    ) -> Result<Value, StoreError> {
        let cmd = self.command("EVALSHA", script.get_hash());
        match cmd.query_async(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                script.load_async(conn).await?;
                Ok(cmd.query_async(conn).await?)
            }
            other => Ok(other?),
        }
    }
}

/// ARGV index (from 0) of the count of staged outbox entries.
const STAGED_ARG: usize = 5;

/// The writes of dirty slots: records (their generations inside), the
/// tombstone and absent indexes, and the place list.
pub(super) fn slot_ops(keys: &Keys, ops: &mut CommitOps, slots: &Slots) {
    let mut records: BTreeMap<PlaceKey, Vec<Vec<u8>>> = BTreeMap::new();
    let (mut tombstones, mut absent) = (IndexWrites::default(), IndexWrites::default());
    for ((b, p, id), slot) in slots {
        // A new generation alone rewrites the record too: it is stored in it.
        if (slot.record_dirty || slot.gen_dirty)
            && let Some(r) = &slot.record
        {
            let v = records.entry(PlaceKey::new(*b, *p)).or_default();
            v.push(id.as_bytes().to_vec());
            v.push(stored_bytes(r, slot.generation));
        }
        let member = || format!("{b}:{p}:{id}").into_bytes();
        let at = slot.record.as_ref().map_or(0, |r| r.updated_at);
        tombstones.note(slot.tombstone, at, member);
        absent.note(slot.absent_index, at, member);
    }
    let mut new_places = Vec::new();
    for (place, args) in records {
        new_places.push(place.to_string().into_bytes());
        let (marker, frozen) = (keys.frozen_marker(place), keys.frozen_records(place));
        ops.kept_op(&keys.records(place), &marker, &frozen, args, 2);
    }
    ops.op("SADD", &keys.places(), new_places, 1);
    tombstones.write(ops, &keys.tombstones());
    absent.write(ops, &keys.absent());
}

/// What one commit adds to (scored) and removes from an index zset of
/// records (tombstones, absent records).
#[derive(Default)]
struct IndexWrites {
    add: Vec<Vec<u8>>,
    rem: Vec<Vec<u8>>,
}

impl IndexWrites {
    /// Notes a slot's index change: `Some(true)` adds `member` scored `at`,
    /// `Some(false)` removes it.
    fn note(&mut self, change: Option<bool>, at: i64, member: impl FnOnce() -> Vec<u8>) {
        match change {
            Some(true) => {
                self.add.push(at.to_string().into_bytes());
                self.add.push(member());
            }
            Some(false) => self.rem.push(member()),
            None => {}
        }
    }

    /// The `ZADD`, then the `ZREM`, on the index `key`.
    fn write(self, ops: &mut CommitOps, key: &str) {
        ops.op("ZADD", key, self.add, 2);
        ops.op("ZREM", key, self.rem, 1);
    }
}

/// Appends what full imports carried to their touched sets, one `APPEND`
/// per place and import, each set noted in the partition's index of them.
pub(super) fn touched_ops(keys: &Keys, ops: &mut CommitOps, touched: &Appends) {
    for (place, generation, ids) in touched.iter() {
        let key = keys.touched(place, generation);
        ops.op("APPEND", &key, vec![ids.to_vec()], 1);
        ops.op("PEXPIRE", &key, vec![SWEPT_TTL_MS.to_string().into_bytes()], 1);
        ops.indexed(&keys.touched_index(), touched_member(place, generation), SWEPT_TTL_MS);
    }
}

/// A touched set's member in the partition's index of them.
fn touched_member(place: PlaceKey, generation: i64) -> Vec<u8> {
    format!("{place}:{generation}").into_bytes()
}

/// The writes of decided sweeps: each outcome under its import (expiring),
/// the place's held sweep set (held) or ended (applied), and the import's
/// touched set kept for a release (held) or dropped (applied).
pub(super) fn sweep_ops(keys: &Keys, ops: &mut CommitOps, sweeps: &[SweepOutcome]) {
    use crate::apply::sweep::status;
    for o in sweeps {
        let Some(sweep) = &o.sweep else { continue };
        let place = sweep.place().to_string().into_bytes();
        let bytes = o.encode_to_vec();
        let swept = keys.swept(&sweep.import_id);
        ops.op("HSET", &swept, vec![place.clone(), bytes.clone()], 2);
        ops.op("PEXPIRE", &swept, vec![SWEPT_TTL_MS.to_string().into_bytes()], 1);
        ops.indexed(&keys.swept_index(), sweep.import_id.clone().into_bytes(), SWEPT_TTL_MS);
        let carried = keys.touched(sweep.place(), sweep.generation);
        let member = touched_member(sweep.place(), sweep.generation);
        match o.status.as_str() {
            status::HELD => {
                ops.op("HSET", &keys.held(), vec![place, bytes], 2);
                ops.op("PEXPIRE", &carried, vec![HELD_TOUCHED_TTL_MS.to_string().into_bytes()], 1);
                ops.indexed(&keys.touched_index(), member, HELD_TOUCHED_TTL_MS);
            }
            status::APPLIED => {
                ops.op("HDEL", &keys.held(), vec![place], 1);
                ops.bare_op("DEL", &carried);
                ops.op("ZREM", &keys.touched_index(), vec![member], 1);
            }
            _ => {}
        }
    }
}

//! Redis: the only place storage state lives. Owns the key layout and the
//! atomic commit; knows nothing of NATS or of merge rules.
//!
//! Key layout, all of one partition under one hash tag `{<ns>:p<N>}` so that
//! every batch is single-slot and runs unchanged on Redis Cluster:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `{ns:pN}:r:<brand>:<place>` | hash | product_id → `Record` bytes (no key, no generation) |
//! | `{ns:pN}:g:<brand>:<place>` | hash | product_id → generation + absent/deleted flag |
//! | `{ns:pN}:seq` | string | stream sequence of the last applied command message |
//! | `{ns:pN}:stream` | string | identity (name and creation time) of the command stream that sequence counts in |
//! | `{ns:pN}:step` | string | while a message is applied in several commits (a sweep in steps): how far it got |
//! | `{ns:pN}:outbox` | list | `OutboxEntry` bytes not yet published |
//! | `{ns:pN}:tomb` | zset | `<brand>:<place>:<product_id>` scored by deletion time |
//! | `{ns:pN}:absent` | zset | `<brand>:<place>:<product_id>` of absent records, scored by when they became absent |
//! | `{ns:pN}:held` | hash | `<brand>:<place>` → `SweepOutcome` of the sweep held for the place |
//! | `{ns:pN}:swept:<import_id>` | hash | `<brand>:<place>` → `SweepOutcome` of that import's sweep (expires after a week) |
//! | `{ns:pN}:dead` | list | `OutboxEntry` bytes that could not be published at all (the last 1000) |
//! | `{ns:pN}:t:<brand>:<place>:<generation>` | string | ids the full import of that generation carried to the place (`apply::touched_set`); deleted when its sweep is applied, else expiring |
//! | `{ns:pN}:places` | set | `<brand>:<place>` of the partition |
//! | `{ns:pN}:ids:<brand>:<place>` | zset | product ids of the place (score 0: ordered pages) |
//! | `{ns:pN}:kf:<brand>:<place>` | list | first KEYFRAMES stream sequence of each kept keyframe |
//! | `{ns:pN}:kfm:<brand>:<place>` | string | set while a keyframe has the place frozen |
//! | `{ns:pN}:kfo:r:<brand>:<place>` | hash | while frozen: product_id → `=`record bytes as frozen, or `-` (absent) |
//! | `{ns:pN}:kfo:g:<brand>:<place>` | hash | the same for generations |
//!
//! Generations live apart from records so that a sweep's census reads small
//! entries. A full import stamps its generation only on the records it
//! writes; the ids it carried go to the place's touched set, one `APPEND`
//! per place and commit, so an identical re-import writes no record field.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use prost::Message;
use redis::Value;
use shelfsync_proto::{CommandBatch, OutboxEntry, Record, RecordKey, SweepOutcome};
use shelfsync_settings::RedisSettings;

use crate::apply::{GenEntry, Key, Slot, Touch, touched, touched_set};

/// The connection type lives in `shelfsync-redis` (shared with ingest and the
/// aggregator); re-exported so `shelfsync_storage::RedisConn` keeps working.
pub use shelfsync_redis::RedisConn;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected redis reply: {0}")]
    Reply(#[from] redis::ParsingError),
    #[error("stored data is corrupt at {key}: {detail}")]
    Corrupt { key: String, detail: String },
}

impl StoreError {
    /// Worth retrying later (server down, loading, failover), as opposed to
    /// an error that the same input will hit again.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Redis(e) => shelfsync_redis::is_transient(e),
            StoreError::Corrupt { .. } | StoreError::Reply(_) => false,
        }
    }
}

/// Key names of one partition.
#[derive(Debug, Clone)]
pub struct Keys {
    tag: String,
}

impl Keys {
    pub fn new(namespace: &str, partition: u32) -> Self {
        Self { tag: format!("{{{namespace}:p{partition}}}") }
    }
    pub fn records(&self, brand: i64, place: i64) -> String {
        format!("{}:r:{brand}:{place}", self.tag)
    }
    pub fn gens(&self, brand: i64, place: i64) -> String {
        format!("{}:g:{brand}:{place}", self.tag)
    }
    pub fn seq(&self) -> String {
        format!("{}:seq", self.tag)
    }
    pub fn stream(&self) -> String {
        format!("{}:stream", self.tag)
    }
    pub fn step(&self) -> String {
        format!("{}:step", self.tag)
    }
    pub fn absent(&self) -> String {
        format!("{}:absent", self.tag)
    }
    pub fn held(&self) -> String {
        format!("{}:held", self.tag)
    }
    pub fn swept(&self, import_id: &str) -> String {
        format!("{}:swept:{import_id}", self.tag)
    }
    pub fn dead(&self) -> String {
        format!("{}:dead", self.tag)
    }
    pub fn outbox(&self) -> String {
        format!("{}:outbox", self.tag)
    }
    pub fn tombstones(&self) -> String {
        format!("{}:tomb", self.tag)
    }
    pub fn places(&self) -> String {
        format!("{}:places", self.tag)
    }
    /// What the full import of `generation` carried to the place.
    pub fn touched(&self, brand: i64, place: i64, generation: i64) -> String {
        format!("{}:t:{brand}:{place}:{generation}", self.tag)
    }
    pub fn ids(&self, brand: i64, place: i64) -> String {
        format!("{}:ids:{brand}:{place}", self.tag)
    }
    pub fn keyframes(&self, brand: i64, place: i64) -> String {
        format!("{}:kf:{brand}:{place}", self.tag)
    }
    /// Exists while a keyframe has the place frozen: every write to the
    /// place's records or generations then keeps the value it replaces.
    pub fn frozen_marker(&self, brand: i64, place: i64) -> String {
        format!("{}:kfm:{brand}:{place}", self.tag)
    }
    /// The frozen values of the place's records written since the freeze
    /// (copy on write; dropped once the keyframe is published).
    pub fn frozen_records(&self, brand: i64, place: i64) -> String {
        format!("{}:kfo:r:{brand}:{place}", self.tag)
    }
    /// The same for the place's generations.
    pub fn frozen_gens(&self, brand: i64, place: i64) -> String {
        format!("{}:kfo:g:{brand}:{place}", self.tag)
    }
}

/// What a batch needs from Redis before it is applied.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Where the partition stands (applied sequence 0: none).
    pub at: Position,
    pub slots: HashMap<Key, Slot>,
}

/// Where a partition stands: the last command message applied whole, and
/// how far the one after it got when it is applied in several commits (a
/// sweep in steps; empty: none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Position {
    pub applied: u64,
    pub step: String,
}

impl Position {
    pub fn at(applied: u64) -> Self {
        Position { applied, step: String::new() }
    }
}

/// What a commit requires to still hold, or it is [`Commit::Fenced`]: the
/// partition where it was read, and the command stream it counts in (empty:
/// not checked).
#[derive(Debug, Clone, Default)]
pub struct Fence {
    pub at: Position,
    pub stream: String,
}

/// Everything one commit writes besides the position.
#[derive(Debug, Default)]
pub struct Writes<'a> {
    pub slots: Option<&'a HashMap<Key, Slot>>,
    /// Records full imports carried (appended to their touched sets).
    pub touched: &'a [Touch],
    pub outbox: &'a [OutboxEntry],
    /// Decided sweeps: kept per import; a held one is kept for its place,
    /// an applied one ends what was held for its place.
    pub sweeps: &'a [SweepOutcome],
}

/// What binding a partition to its command stream found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamBinding {
    /// The stream is the one the applied sequence counts in (or none was
    /// recorded and this one now is).
    Same,
    /// The sequence counts in another stream, recorded as this identity: the
    /// stream was replaced and its sequences restarted.
    Replaced { recorded: String },
}

/// How long a sweep's outcome is kept for its import's report, and a
/// touched set whose sweep did not come (refreshed by every append).
const SWEPT_TTL_MS: u64 = 7 * 24 * 3600 * 1000;
/// How long the touched set of a held sweep is kept, for its release.
const HELD_TOUCHED_TTL_MS: u64 = 30 * 24 * 3600 * 1000;
/// Entries kept in the partition's list of unpublishable outbox entries.
const DEAD_KEPT: i64 = 1000;

/// Result of the atomic commit.
#[derive(Debug, PartialEq, Eq)]
pub enum Commit {
    Done,
    /// Another writer moved the partition's sequence since it was read: this
    /// process is not (or no longer) the only owner. Nothing was written.
    Fenced,
}

/// The interpreter of a list of writes, shared by [`COMMIT_LUA`] and
/// the purges. From ARGV[i] on, each write is `op key-index count
/// args...`. `CHSET` and `CHDEL` are `HSET` and `HDEL` on a place's records
/// or generations: their first two args are the key indices of the place's
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
    i = i + count
  end
end
"#;

/// Checks that the partition stands where the caller read it (KEYS[1] the
/// applied sequence = ARGV[1], KEYS[3] the step = ARGV[3], and — when ARGV[5]
/// is not empty — KEYS[4] the command stream's identity = ARGV[5]), then runs
/// every write ([`OPS_LUA`] from ARGV[6] on) and moves the partition to
/// ARGV[2] / ARGV[4] (an empty step: none), all in one atomic step. Returns 0
/// when fenced, else the head of the outbox (KEYS[2]).
const COMMIT_LUA: &str = r#"
local cur = redis.call('GET', KEYS[1]) or '0'
if cur ~= ARGV[1] then return 0 end
local step = redis.call('GET', KEYS[3]) or ''
if step ~= ARGV[3] then return 0 end
if ARGV[5] ~= '' and (redis.call('GET', KEYS[4]) or '') ~= ARGV[5] then return 0 end
local err = run_ops(6)
if err then return redis.error_reply('commit: ' .. err) end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[4] == '' then redis.call('DEL', KEYS[3]) else redis.call('SET', KEYS[3], ARGV[4]) end
return redis.call('LRANGE', KEYS[2], 0, 255)
"#;

/// Adopts the command stream a partition's sequence counts in: ARGV[1] is
/// its identity. Returns `adopted` when none was recorded (a new partition,
/// or one written by a version that did not record it) or when nothing was
/// applied yet (KEYS[2], the sequence, is 0 and KEYS[3], the step, unset:
/// nothing can be mistaken for applied), `same`, or else the identity
/// recorded, which differs: the stream was replaced.
const BIND_STREAM_LUA: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return 'same' end
local fresh = (redis.call('GET', KEYS[2]) or '0') == '0' and redis.call('EXISTS', KEYS[3]) == 0
if not cur or fresh then redis.call('SET', KEYS[1], ARGV[1]); return 'adopted' end
return cur
"#;

/// A value kept by the copy on write of [`OPS_LUA`]: what the field held
/// when the place was frozen.
fn frozen_value(kept: Option<Vec<u8>>) -> Option<Option<Vec<u8>>> {
    let mut kept = kept?;
    match kept.first() {
        Some(b'=') => {
            kept.remove(0);
            Some(Some(kept))
        }
        _ => Some(None),
    }
}

/// Outbox entries read back by the commit and the trim (`LRANGE 0 255` in
/// [`COMMIT_LUA`] and [`TRIM_LUA`]): the relay's next peek comes with the
/// write before it instead of costing a round trip.
pub const OUTBOX_PEEK: usize = 256;
/// A head read with a write is used by a peek this soon after it only.
const HEAD_FRESH: std::time::Duration = std::time::Duration::from_secs(2);

/// Lua's `unpack` is bounded by the C stack (~8000 values): ops are chunked.
const MAX_OP_ARGS: usize = 1000;

/// Builds the argument list of [`COMMIT_LUA`].
struct CommitOps {
    keys: Vec<String>,
    key_index: HashMap<String, usize>,
    args: Vec<Vec<u8>>,
}

impl CommitOps {
    /// For [`COMMIT_LUA`]: the fence and the position it moves to.
    fn new(keys: &Keys, fence: &Fence, to: &Position) -> Self {
        let mut ops = Self::empty();
        for k in [keys.seq(), keys.outbox(), keys.step(), keys.stream()] {
            ops.key(&k);
        }
        for a in [
            fence.at.applied.to_string(),
            to.applied.to_string(),
            fence.at.step.clone(),
            to.step.clone(),
            fence.stream.clone(),
        ] {
            ops.args.push(a.into_bytes());
        }
        ops
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
    fn op(&mut self, op: &str, key: &str, args: Vec<Vec<u8>>, stride: usize) {
        self.op_with(op, key, &[], args, stride);
    }

    /// `HSET` (stride 2) or `HDEL` (stride 1) on a place's records or
    /// generations, keeping the frozen values while a keyframe has the place
    /// frozen (`CHSET`/`CHDEL` of [`OPS_LUA`]).
    fn kept_op(
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
        for part in args.chunks(chunk) {
            self.args.push(op.as_bytes().to_vec());
            self.args.push(ki.to_string().into_bytes());
            self.args.push((prefix.len() + part.len()).to_string().into_bytes());
            self.args.extend(prefix.iter().cloned());
            self.args.extend(part.iter().cloned());
        }
    }

    /// Runs `script` with these keys and args.
    async fn invoke(
        &self,
        script: &redis::Script,
        conn: &mut RedisConn,
    ) -> Result<Value, StoreError> {
        let mut invocation = script.prepare_invoke();
        for k in &self.keys {
            invocation.key(k);
        }
        for a in &self.args {
            invocation.arg(a.as_slice());
        }
        Ok(invocation.invoke_async(conn).await?)
    }
}

/// Removes the head of the outbox up to and including ARGV[1], an entry this
/// process published, if it is still there. Entries are unique (their
/// message ids carry partition, sequence and part) and only ever appended at
/// the tail and removed from the head, so everything before it was published
/// too. A plain `LTRIM n` is not safe when two processes relay one partition
/// for a while (a stale owner during a rescale): the other one may already
/// have trimmed those entries, and `n` would then remove newer, unpublished
/// ones.
/// Returns the head of the outbox after the trim.
const TRIM_LUA: &str = r#"
local i = redis.call('LPOS', KEYS[1], ARGV[1])
if i then redis.call('LTRIM', KEYS[1], i + 1, -1) end
return redis.call('LRANGE', KEYS[1], 0, 255)
"#;

/// The raw outbox head a write read back, and when.
type HeadRead = (std::time::Instant, Vec<Vec<u8>>);

/// How many entries a peek returned, and the last one as stored.
type LastPeek = (usize, Vec<u8>);

/// Values of an `HMGET`, in the order asked (`None`: no such field).
type Column = Vec<Option<Vec<u8>>>;

/// The writes of dirty slots: records, generations, the id, tombstone and
/// absent indexes, and the place list.
fn slot_ops(keys: &Keys, ops: &mut CommitOps, slots: &HashMap<Key, Slot>) {
    let mut records: BTreeMap<(i64, i64), Vec<Vec<u8>>> = BTreeMap::new();
    let mut ids: BTreeMap<(i64, i64), Vec<Vec<u8>>> = BTreeMap::new();
    let mut gens: BTreeMap<(i64, i64), Vec<Vec<u8>>> = BTreeMap::new();
    let (mut tomb_add, mut tomb_rem) = (Vec::new(), Vec::new());
    let (mut absent_add, mut absent_rem) = (Vec::new(), Vec::new());
    for ((b, p, id), slot) in slots {
        if slot.record_dirty
            && let Some(r) = &slot.record
        {
            let stored = Record { key: None, generation: 0, ..r.clone() };
            let v = records.entry((*b, *p)).or_default();
            v.push(id.as_bytes().to_vec());
            v.push(stored.encode_to_vec());
            let v = ids.entry((*b, *p)).or_default();
            v.push(b"0".to_vec());
            v.push(id.as_bytes().to_vec());
        }
        if slot.gen_dirty {
            let v = gens.entry((*b, *p)).or_default();
            v.push(id.as_bytes().to_vec());
            v.push(slot.gen_entry().encode().into_bytes());
        }
        let member = || format!("{b}:{p}:{id}").into_bytes();
        let at = slot.record.as_ref().map_or(0, |r| r.updated_at);
        match slot.tombstone {
            Some(true) => {
                tomb_add.push(at.to_string().into_bytes());
                tomb_add.push(member());
            }
            Some(false) => tomb_rem.push(member()),
            None => {}
        }
        match slot.absent_index {
            Some(true) => {
                absent_add.push(at.to_string().into_bytes());
                absent_add.push(member());
            }
            Some(false) => absent_rem.push(member()),
            None => {}
        }
    }
    let mut new_places = Vec::new();
    for ((b, p), args) in records {
        new_places.push(format!("{b}:{p}").into_bytes());
        let (marker, frozen) = (keys.frozen_marker(b, p), keys.frozen_records(b, p));
        ops.kept_op(&keys.records(b, p), &marker, &frozen, args, 2);
    }
    for ((b, p), args) in gens {
        let (marker, frozen) = (keys.frozen_marker(b, p), keys.frozen_gens(b, p));
        ops.kept_op(&keys.gens(b, p), &marker, &frozen, args, 2);
    }
    for ((b, p), args) in ids {
        ops.op("ZADD", &keys.ids(b, p), args, 2);
    }
    ops.op("SADD", &keys.places(), new_places, 1);
    ops.op("ZADD", &keys.tombstones(), tomb_add, 2);
    ops.op("ZREM", &keys.tombstones(), tomb_rem, 1);
    ops.op("ZADD", &keys.absent(), absent_add, 2);
    ops.op("ZREM", &keys.absent(), absent_rem, 1);
}

/// Appends what full imports carried to their touched sets, one `APPEND`
/// per place and import.
fn touched_ops(keys: &Keys, ops: &mut CommitOps, touched: &[Touch]) {
    let mut by_set: BTreeMap<(i64, i64, i64), Vec<&str>> = BTreeMap::new();
    for t in touched {
        by_set.entry(t.of()).or_default().push(&t.product_id);
    }
    for ((b, p, generation), ids) in by_set {
        let key = keys.touched(b, p, generation);
        ops.op("APPEND", &key, vec![touched_set::encode(ids)], 1);
        ops.op("PEXPIRE", &key, vec![SWEPT_TTL_MS.to_string().into_bytes()], 1);
    }
}

/// The writes of decided sweeps: each outcome under its import (expiring),
/// the place's held sweep set (held) or ended (applied), and the import's
/// touched set kept for a release (held) or dropped (applied).
fn sweep_ops(keys: &Keys, ops: &mut CommitOps, sweeps: &[SweepOutcome]) {
    use crate::apply::sweep::status;
    for o in sweeps {
        let Some(sweep) = &o.sweep else { continue };
        let place = format!("{}:{}", sweep.brand_id, sweep.place_id).into_bytes();
        let bytes = o.encode_to_vec();
        let swept = keys.swept(&sweep.import_id);
        ops.op("HSET", &swept, vec![place.clone(), bytes.clone()], 2);
        ops.op("PEXPIRE", &swept, vec![SWEPT_TTL_MS.to_string().into_bytes()], 1);
        let carried = keys.touched(sweep.brand_id, sweep.place_id, sweep.generation);
        match o.status.as_str() {
            status::HELD => {
                ops.op("HSET", &keys.held(), vec![place, bytes], 2);
                ops.op("PEXPIRE", &carried, vec![HELD_TOUCHED_TTL_MS.to_string().into_bytes()], 1);
            }
            status::APPLIED => {
                ops.op("HDEL", &keys.held(), vec![place], 1);
                ops.bare_op("DEL", &carried);
            }
            _ => {}
        }
    }
}

fn decode_outcome(key: &str, bytes: &[u8]) -> Result<SweepOutcome, StoreError> {
    SweepOutcome::decode(bytes)
        .map_err(|e| StoreError::Corrupt { key: key.to_string(), detail: e.to_string() })
}

/// `<brand>:<place>:<product_id>`, as the index zsets hold records.
fn parse_member(m: &str) -> Option<Key> {
    let mut parts = m.splitn(3, ':');
    let (b, p, id) = (parts.next()?, parts.next()?, parts.next()?);
    Some((b.parse().ok()?, p.parse().ok()?, id.to_string()))
}

/// Storage's handle on Redis.
#[derive(Clone)]
pub struct Store {
    conn: RedisConn,
    namespace: String,
    commit_script: redis::Script,
    bind_script: redis::Script,
    trim_script: redis::Script,
    /// Per partition, how many outbox entries [`Store::outbox_peek`] last
    /// returned and the raw bytes of the last one, so that
    /// [`Store::outbox_trim`] removes exactly those.
    peeked: Arc<Mutex<HashMap<u32, LastPeek>>>,
    /// Per partition, the head of the outbox (raw) as the last commit or
    /// trim left it: the next [`Store::outbox_peek`], read with that write.
    read_with_write: Arc<Mutex<HashMap<u32, HeadRead>>>,
}

impl Store {
    pub async fn connect(cfg: &RedisSettings) -> Result<Store, StoreError> {
        Ok(Store {
            conn: RedisConn::connect(cfg).await?,
            namespace: cfg.namespace.clone(),
            commit_script: redis::Script::new(&format!("{OPS_LUA}{COMMIT_LUA}")),
            bind_script: redis::Script::new(BIND_STREAM_LUA),
            trim_script: redis::Script::new(TRIM_LUA),
            peeked: Arc::default(),
            read_with_write: Arc::default(),
        })
    }

    pub fn keys(&self, partition: u32) -> Keys {
        Keys::new(&self.namespace, partition)
    }

    pub fn conn(&self) -> RedisConn {
        self.conn.clone()
    }

    /// Reads where the partition stands and every record the batch's
    /// commands touch: one HMGET per place for records and one for
    /// generations. Sweeps are not loaded here (see `crate::sweep`).
    pub async fn load(&self, partition: u32, batch: &CommandBatch) -> Result<Loaded, StoreError> {
        let keys = self.keys(partition);
        let (touched_keys, _) = touched(batch);
        let mut by_place: BTreeMap<(i64, i64), Vec<String>> = BTreeMap::new();
        for (b, p, id) in touched_keys {
            by_place.entry((b, p)).or_default().push(id);
        }
        let mut pipe = redis::pipe();
        pipe.get(keys.seq()).get(keys.step());
        for ((b, p), ids) in &by_place {
            pipe.cmd("HMGET").arg(keys.records(*b, *p)).arg(ids);
            pipe.cmd("HMGET").arg(keys.gens(*b, *p)).arg(ids);
        }
        let mut conn = self.conn.clone();
        let mut values: std::vec::IntoIter<Value> =
            pipe.query_async::<Vec<Value>>(&mut conn).await?.into_iter();
        let mut loaded = Loaded::default();
        loaded.at.applied =
            redis::from_redis_value::<Option<u64>>(values.next().unwrap_or(Value::Nil))?
                .unwrap_or(0);
        loaded.at.step =
            redis::from_redis_value::<Option<String>>(values.next().unwrap_or(Value::Nil))?
                .unwrap_or_default();
        for ((b, p), ids) in by_place {
            let recs: Vec<Option<Vec<u8>>> =
                redis::from_redis_value(values.next().unwrap_or(Value::Nil))?;
            let gens: Vec<Option<Vec<u8>>> =
                redis::from_redis_value(values.next().unwrap_or(Value::Nil))?;
            for ((id, rec), generation) in ids.into_iter().zip(recs).zip(gens) {
                let slot = self.slot(&keys, b, p, &id, rec.as_deref(), generation.as_deref())?;
                loaded.slots.insert((b, p, id), slot);
            }
        }
        Ok(loaded)
    }

    /// Where the partition stands.
    pub async fn position(&self, partition: u32) -> Result<Position, StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let (applied, step): (Option<u64>, Option<String>) =
            redis::pipe().get(keys.seq()).get(keys.step()).query_async(&mut conn).await?;
        Ok(Position { applied: applied.unwrap_or(0), step: step.unwrap_or_default() })
    }

    /// Some records of one place with their generations, as slots.
    pub async fn load_place(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
        ids: &[String],
    ) -> Result<HashMap<Key, Slot>, StoreError> {
        let mut out = HashMap::with_capacity(ids.len());
        if ids.is_empty() {
            return Ok(out);
        }
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let (recs, gens): (Column, Column) = redis::pipe()
            .cmd("HMGET")
            .arg(keys.records(brand_id, place_id))
            .arg(ids)
            .cmd("HMGET")
            .arg(keys.gens(brand_id, place_id))
            .arg(ids)
            .query_async(&mut conn)
            .await?;
        for ((id, rec), generation) in ids.iter().zip(recs).zip(gens) {
            let slot =
                self.slot(&keys, brand_id, place_id, id, rec.as_deref(), generation.as_deref())?;
            out.insert((brand_id, place_id, id.clone()), slot);
        }
        Ok(out)
    }

    /// One HSCAN step over a place's generation column: up to about `count`
    /// entries and the next cursor (0: done). An entry may come twice.
    pub async fn scan_gens(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<(String, GenEntry)>), StoreError> {
        let key = self.keys(partition).gens(brand_id, place_id);
        let mut conn = self.conn.clone();
        let (next, flat): (u64, Vec<Vec<u8>>) = redis::cmd("HSCAN")
            .arg(&key)
            .arg(cursor)
            .arg("COUNT")
            .arg(count)
            .query_async(&mut conn)
            .await?;
        let mut out = Vec::with_capacity(flat.len() / 2);
        for pair in flat.chunks_exact(2) {
            let id = String::from_utf8(pair[0].clone())
                .map_err(|e| StoreError::Corrupt { key: key.clone(), detail: e.to_string() })?;
            let entry = GenEntry::decode(&pair[1]).ok_or_else(|| StoreError::Corrupt {
                key: key.clone(),
                detail: format!("bad generation entry for {id}"),
            })?;
            out.push((id, entry));
        }
        Ok((next, out))
    }

    /// The ids the full import of `generation` carried to a place, as far as
    /// committed (`None`: none kept, or expired).
    pub async fn touched(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
        generation: i64,
    ) -> Result<Option<std::collections::HashSet<String>>, StoreError> {
        let key = self.keys(partition).touched(brand_id, place_id, generation);
        let mut conn = self.conn.clone();
        let blob: Option<Vec<u8>> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
        blob.map(|b| {
            touched_set::decode(&b)
                .ok_or_else(|| StoreError::Corrupt { key: key.clone(), detail: "bad touched set".into() })
        })
        .transpose()
    }

    /// The sweep held for a place, if any.
    pub async fn held(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
    ) -> Result<Option<SweepOutcome>, StoreError> {
        let key = self.keys(partition).held();
        let mut conn = self.conn.clone();
        let raw: Option<Vec<u8>> =
            redis::cmd("HGET").arg(&key).arg(format!("{brand_id}:{place_id}")).query_async(&mut conn).await?;
        raw.map(|b| decode_outcome(&key, &b)).transpose()
    }

    /// Every sweep held in a partition.
    pub async fn held_all(&self, partition: u32) -> Result<Vec<SweepOutcome>, StoreError> {
        let key = self.keys(partition).held();
        let mut conn = self.conn.clone();
        let raw: Vec<Vec<u8>> = redis::cmd("HVALS").arg(&key).query_async(&mut conn).await?;
        raw.iter().map(|b| decode_outcome(&key, b)).collect()
    }

    /// The outcomes of an import's sweeps of some places of a partition
    /// (`None`: not decided yet, or expired).
    pub async fn sweep_outcomes(
        &self,
        partition: u32,
        import_id: &str,
        places: &[(i64, i64)],
    ) -> Result<Vec<Option<SweepOutcome>>, StoreError> {
        if places.is_empty() {
            return Ok(Vec::new());
        }
        let key = self.keys(partition).swept(import_id);
        let fields: Vec<String> = places.iter().map(|(b, p)| format!("{b}:{p}")).collect();
        let mut conn = self.conn.clone();
        let raw: Column = redis::cmd("HMGET").arg(&key).arg(&fields).query_async(&mut conn).await?;
        raw.into_iter().map(|b| b.map(|b| decode_outcome(&key, &b)).transpose()).collect()
    }

    /// Records the command stream the partition's sequence counts in, or
    /// says that it counts in another one.
    pub async fn bind_stream(
        &self,
        partition: u32,
        identity: &str,
    ) -> Result<StreamBinding, StoreError> {
        let mut conn = self.conn.clone();
        let keys = self.keys(partition);
        let answer: String = self
            .bind_script
            .key(keys.stream())
            .key(keys.seq())
            .key(keys.step())
            .arg(identity)
            .invoke_async(&mut conn)
            .await?;
        Ok(match answer.as_str() {
            "adopted" | "same" => StreamBinding::Same,
            _ => StreamBinding::Replaced { recorded: answer },
        })
    }

    /// An operator's re-base: the partition's sequence now counts in the
    /// stream `identity`, with every message up to `applied` taken as
    /// applied. A message half applied in steps starts over.
    pub async fn rebase(
        &self,
        partition: u32,
        identity: &str,
        applied: u64,
    ) -> Result<(), StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let () = redis::pipe()
            .atomic()
            .set(keys.stream(), identity)
            .ignore()
            .set(keys.seq(), applied)
            .ignore()
            .del(keys.step())
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    fn slot(
        &self,
        keys: &Keys,
        b: i64,
        p: i64,
        id: &str,
        rec: Option<&[u8]>,
        generation: Option<&[u8]>,
    ) -> Result<Slot, StoreError> {
        let record = match rec {
            Some(bytes) => Some(Record::decode(bytes).map_err(|e| StoreError::Corrupt {
                key: format!("{} {id}", keys.records(b, p)),
                detail: e.to_string(),
            })?),
            None => None,
        };
        let generation = generation.and_then(GenEntry::decode).map_or(0, |g| g.generation);
        Ok(Slot { record, generation, ..Default::default() })
    }

    /// Writes the dirty slots, the outbox entries, the decided sweeps and the
    /// new position in one atomic step, if the partition still stands where
    /// `fence` says.
    pub async fn commit(
        &self,
        partition: u32,
        fence: &Fence,
        to: &Position,
        writes: &Writes<'_>,
    ) -> Result<Commit, StoreError> {
        let keys = self.keys(partition);
        let mut ops = CommitOps::new(&keys, fence, to);
        if let Some(slots) = writes.slots {
            slot_ops(&keys, &mut ops, slots);
        }
        touched_ops(&keys, &mut ops, writes.touched);
        sweep_ops(&keys, &mut ops, writes.sweeps);
        ops.op(
            "RPUSH",
            &keys.outbox(),
            writes.outbox.iter().map(Message::encode_to_vec).collect(),
            1,
        );
        let mut conn = self.conn.clone();
        match ops.invoke(&self.commit_script, &mut conn).await? {
            Value::Int(0) => Ok(Commit::Fenced),
            head => {
                self.keep_head(partition, head)?;
                Ok(Commit::Done)
            }
        }
    }

    /// Keeps the outbox head a write read back, for the next peek.
    fn keep_head(&self, partition: u32, head: Value) -> Result<(), StoreError> {
        let raw: Vec<Vec<u8>> = match head {
            Value::Nil => Vec::new(),
            v => redis::from_redis_value(v)?,
        };
        let now = std::time::Instant::now();
        self.read_with_write
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(partition, (now, raw));
        Ok(())
    }

    /// `WAIT n timeout`: how many replicas have every write made on this
    /// connection so far (every partition of this process shares it).
    pub async fn wait_replicas(
        &self,
        n: usize,
        timeout: std::time::Duration,
    ) -> Result<usize, StoreError> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("WAIT").arg(n).arg(timeout.as_millis() as u64).query_async(&mut conn).await?)
    }

    /// The last applied command sequence of a partition.
    pub async fn applied_seq(&self, partition: u32) -> Result<u64, StoreError> {
        let mut conn = self.conn.clone();
        let v: Option<u64> =
            redis::cmd("GET").arg(self.keys(partition).seq()).query_async(&mut conn).await?;
        Ok(v.unwrap_or(0))
    }

    /// Up to `n` outbox entries from the head, oldest first.
    pub async fn outbox_peek(
        &self,
        partition: u32,
        n: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        let key = self.keys(partition).outbox();
        let kept =
            self.read_with_write.lock().unwrap_or_else(|e| e.into_inner()).remove(&partition);
        let raw: Vec<Vec<u8>> = match kept {
            // As fresh as a peek: the worker relays right after its write.
            Some((at, mut head)) if n <= OUTBOX_PEEK && at.elapsed() < HEAD_FRESH => {
                head.truncate(n);
                head
            }
            _ => {
                let mut conn = self.conn.clone();
                redis::cmd("LRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(n.saturating_sub(1) as i64)
                    .query_async(&mut conn)
                    .await?
            }
        };
        let entries = raw
            .iter()
            .map(|b| {
                OutboxEntry::decode(b.as_slice())
                    .map_err(|e| StoreError::Corrupt { key: key.clone(), detail: e.to_string() })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut peeked = self.peeked.lock().unwrap_or_else(|e| e.into_inner());
        match raw.into_iter().last() {
            Some(last) => peeked.insert(partition, (entries.len(), last)),
            None => peeked.remove(&partition),
        };
        Ok(entries)
    }

    /// Removes the `n` entries the last [`Store::outbox_peek`] of the
    /// partition returned, once they are published — only those, even if
    /// another process trimmed them meanwhile (see `TRIM_LUA`). Without such
    /// a peek, trims the first `n` of the list.
    pub async fn outbox_trim(&self, partition: u32, n: usize) -> Result<(), StoreError> {
        if n == 0 {
            return Ok(());
        }
        let last = {
            let mut peeked = self.peeked.lock().unwrap_or_else(|e| e.into_inner());
            peeked.remove(&partition).and_then(|(len, last)| (len == n).then_some(last))
        };
        let key = self.keys(partition).outbox();
        let mut conn = self.conn.clone();
        let head: Value = match last {
            Some(last) => self.trim_script.key(key).arg(last).invoke_async(&mut conn).await?,
            None => {
                let (_, head): (Value, Value) = redis::pipe()
                    .cmd("LTRIM")
                    .arg(&key)
                    .arg(n as i64)
                    .arg(-1)
                    .cmd("LRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(OUTBOX_PEEK as i64 - 1)
                    .query_async(&mut conn)
                    .await?;
                head
            }
        };
        self.keep_head(partition, head)
    }

    pub async fn outbox_len(&self, partition: u32) -> Result<u64, StoreError> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("LLEN").arg(self.keys(partition).outbox()).query_async(&mut conn).await?)
    }

    /// Purges up to `limit` tombstones deleted before `cutoff_us`, fenced
    /// like a commit (the partition must still stand at `fence`; nothing
    /// moves it). Runs in the partition's worker between messages.
    pub async fn purge_tombstones(
        &self,
        partition: u32,
        fence: &Fence,
        cutoff_us: i64,
        limit: usize,
    ) -> Result<Option<usize>, StoreError> {
        let keys = self.keys(partition);
        let members = self.due(&keys.tombstones(), cutoff_us, limit).await?;
        if members.is_empty() {
            return Ok(Some(0));
        }
        // One HDEL per place and hash, keeping frozen values (a keyframe may
        // have the place frozen), all in one atomic step.
        let mut by_place: BTreeMap<(i64, i64), Vec<Vec<u8>>> = BTreeMap::new();
        for (b, p, id) in members.iter().filter_map(|m| parse_member(m)) {
            by_place.entry((b, p)).or_default().push(id.as_bytes().to_vec());
        }
        let mut ops = CommitOps::new(&keys, fence, &fence.at);
        for ((b, p), ids) in by_place {
            let marker = keys.frozen_marker(b, p);
            ops.kept_op(&keys.records(b, p), &marker, &keys.frozen_records(b, p), ids.clone(), 1);
            ops.kept_op(&keys.gens(b, p), &marker, &keys.frozen_gens(b, p), ids.clone(), 1);
            ops.op("ZREM", &keys.ids(b, p), ids, 1);
        }
        let members_raw = members.iter().map(|m| m.as_bytes().to_vec()).collect();
        ops.op("ZREM", &keys.tombstones(), members_raw, 1);
        let mut conn = self.conn.clone();
        match ops.invoke(&self.commit_script, &mut conn).await? {
            Value::Int(0) => Ok(None),
            head => {
                self.keep_head(partition, head)?;
                Ok(Some(members.len()))
            }
        }
    }

    /// Up to `limit` absent records that became absent before `cutoff_us`.
    pub async fn absent_due(
        &self,
        partition: u32,
        cutoff_us: i64,
        limit: usize,
    ) -> Result<Vec<Key>, StoreError> {
        let members = self.due(&self.keys(partition).absent(), cutoff_us, limit).await?;
        Ok(members.iter().filter_map(|m| parse_member(m)).collect())
    }

    /// Members of an index zset scored at or below `cutoff`, oldest first.
    async fn due(&self, key: &str, cutoff: i64, limit: usize) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("ZRANGEBYSCORE")
            .arg(key)
            .arg("-inf")
            .arg(cutoff)
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut conn)
            .await?)
    }

    /// The newest `limit` outbox entries kept aside as unpublishable.
    pub async fn dead_entries(
        &self,
        partition: u32,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        let key = self.keys(partition).dead();
        let mut conn = self.conn.clone();
        let raw: Vec<Vec<u8>> = redis::cmd("LRANGE")
            .arg(&key)
            .arg(-(limit.max(1) as i64))
            .arg(-1)
            .query_async(&mut conn)
            .await?;
        raw.iter()
            .map(|b| {
                OutboxEntry::decode(b.as_slice())
                    .map_err(|e| StoreError::Corrupt { key: key.clone(), detail: e.to_string() })
            })
            .collect()
    }

    /// Moves outbox entries kept aside back to the tail of the partition's
    /// outbox (all of them, or those with these message ids), in one
    /// atomic step; returns how many.
    pub async fn redrive(&self, partition: u32, msg_ids: &[String]) -> Result<u64, StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let raw: Vec<Vec<u8>> =
            redis::cmd("LRANGE").arg(keys.dead()).arg(0).arg(-1).query_async(&mut conn).await?;
        let chosen: Vec<Vec<u8>> = raw
            .into_iter()
            .filter(|b| {
                msg_ids.is_empty()
                    || OutboxEntry::decode(b.as_slice()).is_ok_and(|e| msg_ids.contains(&e.msg_id))
            })
            .collect();
        if chosen.is_empty() {
            return Ok(0);
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        for b in &chosen {
            pipe.cmd("LREM").arg(keys.dead()).arg(1).arg(b.as_slice()).ignore();
            pipe.cmd("RPUSH").arg(keys.outbox()).arg(b.as_slice()).ignore();
        }
        let () = pipe.query_async(&mut conn).await?;
        Ok(chosen.len() as u64)
    }

    /// Keeps an outbox entry that can never be published (for an operator
    /// to look at), bounded to the last [`DEAD_KEPT`].
    pub async fn outbox_bury(&self, partition: u32, entry: &OutboxEntry) -> Result<(), StoreError> {
        let key = self.keys(partition).dead();
        let mut conn = self.conn.clone();
        let () = redis::pipe()
            .atomic()
            .rpush(&key, entry.encode_to_vec())
            .ignore()
            .ltrim(&key, -DEAD_KEPT as isize, -1)
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// One record as storage holds it (key and generation filled in), or
    /// `None`. A purged tombstone is `None`; a tombstone awaiting purge is
    /// returned with `deleted = true`.
    pub async fn get(
        &self,
        partitions: u32,
        key: &RecordKey,
    ) -> Result<Option<Record>, StoreError> {
        let p = shelfsync_bus::partition_of(key.brand_id, key.place_id, partitions).0;
        let keys = self.keys(p);
        let mut conn = self.conn.clone();
        let (rec, generation): (Option<Vec<u8>>, Option<Vec<u8>>) = redis::pipe()
            .hget(keys.records(key.brand_id, key.place_id), &key.product_id)
            .hget(keys.gens(key.brand_id, key.place_id), &key.product_id)
            .query_async(&mut conn)
            .await?;
        let slot = self.slot(
            &keys,
            key.brand_id,
            key.place_id,
            &key.product_id,
            rec.as_deref(),
            generation.as_deref(),
        )?;
        Ok(slot.record.map(|r| Record { key: Some(key.clone()), generation: slot.generation, ..r }))
    }

    /// Every record of a place (key and generation filled in), in no order.
    pub async fn place_records(
        &self,
        partitions: u32,
        brand_id: i64,
        place_id: i64,
    ) -> Result<Vec<Record>, StoreError> {
        let keys = self.keys(shelfsync_bus::partition_of(brand_id, place_id, partitions).0);
        let mut conn = self.conn.clone();
        let (recs, gens): (HashMap<String, Vec<u8>>, HashMap<String, Vec<u8>>) = redis::pipe()
            .hgetall(keys.records(brand_id, place_id))
            .hgetall(keys.gens(brand_id, place_id))
            .query_async(&mut conn)
            .await?;
        let mut out = Vec::with_capacity(recs.len());
        for (id, bytes) in recs {
            let slot = self.slot(
                &keys,
                brand_id,
                place_id,
                &id,
                Some(&bytes),
                gens.get(&id).map(Vec::as_slice),
            )?;
            if let Some(r) = slot.record {
                out.push(Record {
                    key: Some(RecordKey::new(brand_id, place_id, id)),
                    generation: slot.generation,
                    ..r
                });
            }
        }
        Ok(out)
    }

    /// The places of a partition that ever held a record.
    pub async fn places(&self, partition: u32) -> Result<Vec<(i64, i64)>, StoreError> {
        let mut conn = self.conn.clone();
        let raw: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.keys(partition).places())
            .query_async(&mut conn)
            .await?;
        let mut out: Vec<(i64, i64)> = raw
            .iter()
            .filter_map(|s| {
                let (b, p) = s.split_once(':')?;
                Some((b.parse().ok()?, p.parse().ok()?))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// Freezes a place for its keyframe, in one small atomic step whatever
    /// its size: reads the partition's applied sequence and sets the place's
    /// frozen marker, after which every write to the place keeps the value it
    /// replaces (copy on write, see [`OPS_LUA`]); what a keyframe left behind
    /// is dropped first. Returns the applied sequence. The marker, and with
    /// it what was kept, expires after `ttl` if the keyframe never gets to
    /// [`Store::thaw_place`].
    pub async fn freeze_place(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
        ttl: std::time::Duration,
    ) -> Result<u64, StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let (seq,): (Option<u64>,) = redis::pipe()
            .atomic()
            .get(keys.seq())
            .cmd("UNLINK")
            .arg(keys.frozen_records(brand_id, place_id))
            .arg(keys.frozen_gens(brand_id, place_id))
            .ignore()
            .cmd("SET")
            .arg(keys.frozen_marker(brand_id, place_id))
            .arg(1)
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(seq.unwrap_or(0))
    }

    /// Ends what [`Store::freeze_place`] started: writes stop keeping
    /// values, and the kept ones are dropped.
    pub async fn thaw_place(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
    ) -> Result<(), StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        // UNLINK: freed in the background, not while every partition's
        // commands wait for Redis.
        let _: () = redis::cmd("UNLINK")
            .arg(keys.frozen_marker(brand_id, place_id))
            .arg(keys.frozen_records(brand_id, place_id))
            .arg(keys.frozen_gens(brand_id, place_id))
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// Some records of a place, as frozen and as they are now (`None`:
    /// absent), in the order of `ids`.
    pub async fn frozen_and_live(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
        ids: &[String],
    ) -> Result<(Vec<Option<Record>>, Vec<Option<Record>>), StoreError> {
        if ids.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let (kept, live): (Column, Column) = redis::pipe()
            .cmd("HMGET")
            .arg(keys.frozen_records(brand_id, place_id))
            .arg(ids)
            .cmd("HMGET")
            .arg(keys.records(brand_id, place_id))
            .arg(ids)
            .query_async(&mut conn)
            .await?;
        // Not kept: not written since the freeze.
        let frozen: Column = kept
            .into_iter()
            .zip(&live)
            .map(|(kept, live)| frozen_value(kept).unwrap_or_else(|| live.clone()))
            .collect();
        let decode = |col: Column| -> Result<Vec<Option<Record>>, StoreError> {
            ids.iter()
                .zip(col)
                .map(|(id, raw)| {
                    Ok(self.slot(&keys, brand_id, place_id, id, raw.as_deref(), None)?.record)
                })
                .collect()
        };
        Ok((decode(frozen)?, decode(live)?))
    }

    /// One HSCAN step over a place's records as [`Store::freeze_place`]
    /// froze them (key and generation filled in). `kept`: over the records
    /// written since the freeze, which finds those deleted since (a scan of
    /// the live records may miss them); else over the live records, with
    /// those written since read as they were frozen. Returns the next cursor
    /// (0 when done). Duplicates are possible, within a pass when the hash is
    /// rehashed and across the two passes: callers dedupe.
    pub async fn scan_frozen(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
        kept: bool,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<Record>), StoreError> {
        let keys = self.keys(partition);
        let (live, frozen) =
            (keys.records(brand_id, place_id), keys.frozen_records(brand_id, place_id));
        let mut conn = self.conn.clone();
        let (next, flat): (u64, Vec<Vec<u8>>) = redis::cmd("HSCAN")
            .arg(if kept { &frozen } else { &live })
            .arg(cursor)
            .arg("COUNT")
            .arg(count)
            .query_async(&mut conn)
            .await?;
        if flat.is_empty() {
            return Ok((next, Vec::new()));
        }
        // Read after the step, and still as frozen: a record or generation
        // written since the step has its frozen value kept by then, and a
        // kept value never changes.
        let ids: Vec<&[u8]> = flat.chunks_exact(2).map(|pair| pair[0].as_slice()).collect();
        let (gens, kept_recs, kept_gens): (Column, Column, Column) = redis::pipe()
            .cmd("HMGET")
            .arg(keys.gens(brand_id, place_id))
            .arg(&ids)
            .cmd("HMGET")
            .arg(&frozen)
            .arg(&ids)
            .cmd("HMGET")
            .arg(keys.frozen_gens(brand_id, place_id))
            .arg(&ids)
            .query_async(&mut conn)
            .await?;
        let mut out = Vec::with_capacity(flat.len() / 2);
        let fields = flat.chunks_exact(2).zip(gens).zip(kept_recs).zip(kept_gens);
        for (((pair, generation), kept_rec), kept_gen) in fields {
            let id = String::from_utf8_lossy(&pair[0]).into_owned();
            // As frozen: the kept value if the record was written since.
            let Some(bytes) = frozen_value(kept_rec).unwrap_or_else(|| Some(pair[1].clone()))
            else {
                continue;
            };
            let generation = frozen_value(kept_gen).unwrap_or(generation);
            let slot =
                self.slot(&keys, brand_id, place_id, &id, Some(&bytes), generation.as_deref())?;
            if let Some(r) = slot.record {
                out.push(Record {
                    key: Some(RecordKey::new(brand_id, place_id, id)),
                    generation: slot.generation,
                    ..r
                });
            }
        }
        Ok((next, out))
    }

    /// Records that a keyframe of a place starts at `first_seq` in the
    /// KEYFRAMES stream; returns the sequence below which older keyframes of
    /// the place may be purged once more than `keep` are recorded.
    pub async fn keyframe_published(
        &self,
        partition: u32,
        brand_id: i64,
        place_id: i64,
        first_seq: u64,
        keep: u32,
    ) -> Result<Option<u64>, StoreError> {
        let key = self.keys(partition).keyframes(brand_id, place_id);
        let mut conn = self.conn.clone();
        let (oldest_kept,): (Vec<u64>,) = redis::pipe()
            .atomic()
            .rpush(&key, first_seq)
            .ignore()
            .ltrim(&key, -(keep.max(1) as isize), -1)
            .ignore()
            .lrange(&key, 0, 0)
            .query_async(&mut conn)
            .await?;
        Ok(oldest_kept.first().copied())
    }

    /// Several records of one place, in the order asked (`None`: missing).
    pub async fn get_many(
        &self,
        partitions: u32,
        brand_id: i64,
        place_id: i64,
        ids: &[String],
    ) -> Result<Vec<Option<Record>>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys = self.keys(shelfsync_bus::partition_of(brand_id, place_id, partitions).0);
        let mut conn = self.conn.clone();
        let (recs, gens): (Column, Column);
        (recs, gens) = redis::pipe()
            .cmd("HMGET")
            .arg(keys.records(brand_id, place_id))
            .arg(ids)
            .cmd("HMGET")
            .arg(keys.gens(brand_id, place_id))
            .arg(ids)
            .query_async(&mut conn)
            .await?;
        let mut out = Vec::with_capacity(ids.len());
        for ((id, rec), generation) in ids.iter().zip(recs).zip(gens) {
            let slot =
                self.slot(&keys, brand_id, place_id, id, rec.as_deref(), generation.as_deref())?;
            out.push(slot.record.map(|r| Record {
                key: Some(RecordKey::new(brand_id, place_id, id.clone())),
                generation: slot.generation,
                ..r
            }));
        }
        Ok(out)
    }

    /// Up to `limit` records of a place after product id `after` (empty: from
    /// the start), in product id order, and the id to continue after (`None`
    /// when the place is done).
    pub async fn page(
        &self,
        partitions: u32,
        brand_id: i64,
        place_id: i64,
        after: &str,
        limit: usize,
    ) -> Result<(Vec<Record>, Option<String>), StoreError> {
        let keys = self.keys(shelfsync_bus::partition_of(brand_id, place_id, partitions).0);
        let start = if after.is_empty() { "-".to_string() } else { format!("({after}") };
        let mut conn = self.conn.clone();
        let mut ids: Vec<String> = redis::cmd("ZRANGE")
            .arg(keys.ids(brand_id, place_id))
            .arg(&start)
            .arg("+")
            .arg("BYLEX")
            .arg("LIMIT")
            .arg(0)
            .arg(limit + 1)
            .query_async(&mut conn)
            .await?;
        let more = ids.len() > limit;
        ids.truncate(limit);
        let found = self.get_many(partitions, brand_id, place_id, &ids).await?;
        let next = if more { ids.last().cloned() } else { None };
        Ok((found.into_iter().flatten().collect(), next))
    }
}

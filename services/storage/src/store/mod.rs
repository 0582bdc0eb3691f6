//! Redis: the only place storage state lives. Owns the key layout and the
//! atomic commit; knows nothing of NATS or of merge rules.
//!
//! Key layout, all of one partition under one hash tag `{<ns>:p<N>}` so that
//! every batch is single-slot and runs unchanged on Redis Cluster:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `{ns:pN}:r:<brand>:<place>` | hash | product_id → `Record` bytes (no key; the generation and the absent/deleted flags inside) |
//! | `{ns:pN}:layout` | string | the layout version of the partition's keys (`upgrade`): `2` |
//! | `{ns:pN}:seq` | string | stream sequence of the last applied command message |
//! | `{ns:pN}:stream` | string | identity (name and creation time) of the command stream that sequence counts in |
//! | `{ns:pN}:step` | string | while a message is applied in several commits (a sweep in steps): how far it got |
//! | `{ns:pN}:w` | string | a counter written right before each `WAIT` for replicas (`wait_replicas`) |
//! | `{ns:pN}:obx` | stream | `OutboxEntry` bytes not yet published (field `e`), in commit order |
//! | `{ns:pN}:obx:in` | stream | a commit's outbox entries, staged in its `MULTI` (renamed to `obx` or dropped by the commit script) |
//! | `{ns:pN}:tomb` | zset | `<brand>:<place>:<product_id>` scored by deletion time |
//! | `{ns:pN}:absent` | zset | `<brand>:<place>:<product_id>` of absent records, scored by when they became absent |
//! | `{ns:pN}:held` | hash | `<brand>:<place>` → `SweepOutcome` of the sweep held for the place |
//! | `{ns:pN}:swept:<import_id>` | hash | `<brand>:<place>` → `SweepOutcome` of that import's sweep (expires after a week) |
//! | `{ns:pN}:swept`, `{ns:pN}:t` | zset | indexes of the sweep outcomes (import ids) and touched sets (`<brand>:<place>:<generation>`) kept, scored by when they expire; the expired dropped at each write (their sizes are the `shelfsync_kept` metric) |
//! | `{ns:pN}:dead` | list | `OutboxEntry` bytes that could not be published at all (the last 1000) |
//! | `{ns:pN}:t:<brand>:<place>:<generation>` | string | ids the full import of that generation carried to the place (`apply::touched_set`); deleted when its sweep is applied, else expiring |
//! | `{ns:pN}:places` | set | `<brand>:<place>` of the partition |
//! | `{ns:pN}:kf:<brand>:<place>` | list | first KEYFRAMES stream sequence of each kept keyframe |
//! | `{ns:pN}:kfm:<brand>:<place>` | string | set while a keyframe has the place frozen |
//! | `{ns:pN}:kfo:r:<brand>:<place>` | hash | while frozen: product_id → `=`record bytes as frozen, or `-` (absent) |
//!
//! One hash field per record, and nothing else per record: the generation
//! (start time of the last full import that wrote the record) is the
//! `Record`'s own field 4, stored with it. A full import stamps it only on
//! the records it writes; the ids it carried go to the place's touched set,
//! one `APPEND` per place and commit, so an identical re-import writes no
//! record field. A sweep's census scans the records hash and reads the
//! generation and flags off the wire ([`gen_entry_of`]) without decoding the
//! record. Reads of a whole place page with `HSCAN` of the same hash (no
//! order). Layout 1 kept the generations in a hash of their own
//! (`:g:<brand>:<place>`, and `:kfo:g:` while frozen) and the ids in a zset
//! (`:ids:<brand>:<place>`, for ordered pages): `upgrade` moves a partition
//! from it once, when storage binds the partition.
//!
//! The store is split by concern, each child adding an `impl Store` block:
//! [`keys`] (the names above), `commit` (the Lua interpreter of writes, the
//! atomic commit, loads and the stream binding), `outbox` (peek, trim, dead
//! letters, redrive), `sweeps` (census scans, touched sets, held sweeps,
//! outcomes, purges), `reads` (records for other tools, pages), `frozen` (the
//! copy on write of keyframes) and `upgrade` (from layout 1).

use shelfsync_bus::Partition;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prost::Message;
use shelfsync_proto::{PlaceKey, Record, RecordKey};
use shelfsync_settings::RedisSettings;

use crate::apply::touched_set::Appends;
use crate::apply::{GenEntry, Slot, Slots};
use shelfsync_proto::{OutboxEntry, SweepOutcome};

mod binding;
mod commit;
mod frozen;
mod keys;
mod ops;
mod outbox;
mod reads;
mod sweeps;
mod upgrade;

pub use keys::Keys;
pub use outbox::OUTBOX_PEEK;
pub use upgrade::LAYOUT;

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
    /// A page cursor that no page handed out.
    #[error("{0}")]
    BadCursor(String),
}

impl StoreError {
    /// Worth retrying later (server down, loading, failover), as opposed to
    /// an error that the same input will hit again.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Redis(e) => shelfsync_redis::is_transient(e),
            StoreError::Corrupt { .. } | StoreError::Reply(_) | StoreError::BadCursor(_) => false,
        }
    }

    /// Why the partition waits when this is backpressure (the servers', not
    /// the input's): `None` for an error the same input will hit again.
    pub(crate) fn pressure(&self) -> Option<crate::readiness::Cause> {
        use crate::readiness::Cause;
        match self {
            StoreError::Redis(e) if shelfsync_redis::is_out_of_room(e) => Some(Cause::RedisFull),
            StoreError::Redis(e) if shelfsync_redis::is_transient(e) => Some(Cause::Redis),
            _ => None,
        }
    }

    /// Stored bytes at `key` that do not decode.
    fn corrupt(key: &str, detail: impl ToString) -> Self {
        StoreError::Corrupt { key: key.to_string(), detail: detail.to_string() }
    }
}

/// What a batch needs from Redis before it is applied.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Where the partition stands (applied sequence 0: none).
    pub at: Position,
    pub slots: Slots,
    /// The places loaded whose records hash did not exist: no record of
    /// theirs is stored (`Store::load_keys` only).
    pub empty_places: Vec<PlaceKey>,
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
#[derive(Debug)]
pub struct Writes<'a> {
    pub slots: Option<&'a Slots>,
    /// Records full imports carried (appended to their touched sets).
    pub touched: &'a Appends,
    pub outbox: &'a [OutboxEntry],
    /// Decided sweeps: kept per import; a held one is kept for its place,
    /// an applied one ends what was held for its place.
    pub sweeps: &'a [SweepOutcome],
}

impl Default for Writes<'_> {
    fn default() -> Self {
        Writes { slots: None, touched: Appends::none(), outbox: &[], sweeps: &[] }
    }
}

impl<'a> Writes<'a> {
    /// What deciding one sweep writes: its outcome and what it publishes,
    /// no records.
    pub fn decided(outbox: &'a [OutboxEntry], outcome: &'a SweepOutcome) -> Self {
        Writes {
            slots: None,
            touched: Appends::none(),
            outbox,
            sweeps: std::slice::from_ref(outcome),
        }
    }
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

/// Result of the atomic commit.
#[derive(Debug, PartialEq, Eq)]
pub enum Commit {
    Done,
    /// Another writer moved the partition's sequence since it was read: this
    /// process is not (or no longer) the only owner. Nothing was written.
    Fenced,
}

impl Commit {
    /// `Some(value)` once written, `None` when fenced.
    pub(crate) fn done<T>(self, value: T) -> Option<T> {
        match self {
            Commit::Done => Some(value),
            Commit::Fenced => None,
        }
    }
}

/// Values of an `HMGET`, in the order asked (`None`: no such field).
type Column = Vec<Option<Vec<u8>>>;

/// Storage's handle on Redis.
#[derive(Clone)]
pub struct Store {
    conn: RedisConn,
    namespace: String,
    commit_script: redis::Script,
    bind_script: redis::Script,
    adopt_script: redis::Script,
    /// Per partition, the stream ids of the outbox entries
    /// [`Store::outbox_peek`] last returned, so that [`Store::outbox_trim`]
    /// removes exactly those.
    peeked: Arc<Mutex<HashMap<u32, Vec<String>>>>,
    /// Per partition, the head of the outbox as the last commit or trim
    /// left it: the next [`Store::outbox_peek`], known without a read.
    read_with_write: Arc<Mutex<HashMap<u32, outbox::HeadRead>>>,
}

impl Store {
    pub async fn connect(cfg: &RedisSettings) -> Result<Store, StoreError> {
        Ok(Store {
            conn: RedisConn::connect(cfg).await?,
            namespace: cfg.namespace.clone(),
            commit_script: ops::commit_script(),
            bind_script: binding::bind_script(),
            adopt_script: outbox::adopt_script(),
            peeked: Arc::default(),
            read_with_write: Arc::default(),
        })
    }

    pub fn keys(&self, partition: Partition) -> Keys {
        Keys::new(&self.namespace, partition)
    }

    pub fn conn(&self) -> RedisConn {
        self.conn.clone()
    }

    /// Whether Redis answers a `PING` (storage's readiness).
    pub(crate) async fn answers(&self) -> bool {
        self.query::<String>(&redis::cmd("PING")).await.is_ok()
    }

    /// Runs one command on the shared connection (each call its own clone
    /// of the multiplexed handle).
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        Ok(cmd.query_async(&mut conn).await?)
    }

    /// Some records of one place with their generations, as slots in the
    /// order of `ids`: one `HMGET` of the place's records.
    async fn read_slots(
        &self,
        keys: &Keys,
        place: PlaceKey,
        ids: &[String],
    ) -> Result<Vec<Slot>, StoreError> {
        let mut pipe = redis::pipe();
        hmget_place(&mut pipe, keys, place, ids);
        let mut conn = self.conn.clone();
        let (recs,): (Column,) = pipe.query_async(&mut conn).await?;
        self.slots_of(keys, place, ids, recs)
    }

    /// Decodes what [`hmget_place`] read: one slot per id, in order.
    fn slots_of(
        &self,
        keys: &Keys,
        place: PlaceKey,
        ids: &[String],
        recs: Column,
    ) -> Result<Vec<Slot>, StoreError> {
        ids.iter().zip(recs).map(|(id, rec)| self.slot(keys, place, id, rec.as_deref())).collect()
    }

    /// A slot of stored record bytes: the generation moves from the record
    /// to the slot (the slot's record carries none, as apply expects).
    fn slot(
        &self,
        keys: &Keys,
        place: PlaceKey,
        id: &str,
        rec: Option<&[u8]>,
    ) -> Result<Slot, StoreError> {
        let Some(bytes) = rec else { return Ok(Slot::default()) };
        let mut record = Record::decode(bytes)
            .map_err(|e| StoreError::corrupt(&format!("{} {id}", keys.records(place)), e))?;
        let generation = std::mem::take(&mut record.generation);
        Ok(Slot { record: Some(record), generation, ..Default::default() })
    }
}

/// Adds the `HMGET` of some of a place's records to `pipe`.
fn hmget_place(pipe: &mut redis::Pipeline, keys: &Keys, place: PlaceKey, ids: &[String]) {
    pipe.cmd("HMGET").arg(keys.records(place)).arg(ids);
}

/// The bytes a record is stored as: no key, its generation inside — what
/// prost encodes for `Record { key: None, generation, ..record }`, written
/// without copying the record first.
fn stored_bytes(record: &Record, generation: i64) -> Vec<u8> {
    use prost::encoding::{bool, bytes, int64};
    let r = record;
    let mut len = 0;
    len += if r.data.is_empty() { 0 } else { bytes::encoded_len(2, &r.data) };
    len += if r.state.is_empty() { 0 } else { bytes::encoded_len(3, &r.state) };
    len += if generation == 0 { 0 } else { int64::encoded_len(4, &generation) };
    len += if r.absent { bool::encoded_len(5, &r.absent) } else { 0 };
    len += if r.deleted { bool::encoded_len(6, &r.deleted) } else { 0 };
    len += if r.created_at == 0 { 0 } else { int64::encoded_len(7, &r.created_at) };
    len += if r.updated_at == 0 { 0 } else { int64::encoded_len(8, &r.updated_at) };
    let mut out = Vec::with_capacity(len);
    if !r.data.is_empty() {
        bytes::encode(2, &r.data, &mut out);
    }
    if !r.state.is_empty() {
        bytes::encode(3, &r.state, &mut out);
    }
    if generation != 0 {
        int64::encode(4, &generation, &mut out);
    }
    if r.absent {
        bool::encode(5, &r.absent, &mut out);
    }
    if r.deleted {
        bool::encode(6, &r.deleted, &mut out);
    }
    if r.created_at != 0 {
        int64::encode(7, &r.created_at, &mut out);
    }
    if r.updated_at != 0 {
        int64::encode(8, &r.updated_at, &mut out);
    }
    out
}

/// The generation entry of stored record bytes, read off the wire without
/// decoding the record: fields 4 (generation), 5 (absent), 6 (deleted) and
/// 8 (updated_at),
/// the last occurrence of a field winning as in protobuf. `None`: not a
/// protobuf message.
pub(crate) fn gen_entry_of(bytes: &[u8]) -> Option<GenEntry> {
    let mut buf = bytes;
    let mut e = GenEntry::default();
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        match key & 7 {
            0 => {
                let v = varint(&mut buf)?;
                match key >> 3 {
                    4 => e.generation = v as i64,
                    5 => e.absent = v != 0,
                    6 => e.deleted = v != 0,
                    8 => e.updated_at = v as i64,
                    _ => {}
                }
            }
            1 => buf = buf.get(8..)?,
            2 => {
                let n = usize::try_from(varint(&mut buf)?).ok()?;
                buf = buf.get(n..)?;
            }
            5 => buf = buf.get(4..)?,
            _ => return None,
        }
    }
    Some(e)
}

/// A protobuf varint off the front of `buf`.
fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first()?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// A slot's record as storage hands it out: key and generation filled in
/// (neither is stored in the record bytes).
fn full_record(place: PlaceKey, id: impl Into<String>, slot: Slot) -> Option<Record> {
    let generation = slot.generation;
    let key = |id| Some(RecordKey::new(place.brand_id, place.place_id, id));
    slot.record.map(|r| Record { key: key(id), generation, ..r })
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// What `stored_bytes` writes is prost's encoding of the record
        /// without its key, with its generation.
        #[test]
        fn stored_bytes_are_prosts_encoding(
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
            state in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..5),
            generation in proptest::prelude::any::<i64>(),
            flags in 0u8..4,
            created_at in proptest::prelude::any::<i64>(),
            updated_at in proptest::prop_oneof![proptest::strategy::Just(0i64), proptest::prelude::any::<i64>()],
        ) {
            let key = Some(RecordKey::new(7, 1, "k"));
            let r = Record {
                key, data, state, generation: 99, absent: flags & 1 != 0, deleted: flags & 2 != 0,
                created_at, updated_at,
            };
            let prost = Record { key: None, generation, ..r.clone() }.encode_to_vec();
            proptest::prop_assert_eq!(stored_bytes(&r, generation), prost);
        }
    }

    #[test]
    fn the_generation_entry_is_read_off_the_stored_bytes_as_decoding_would() {
        let base = Record {
            data: vec![0x0a, 3, b'a', b'b', b'c'],
            state: vec![8, 1],
            created_at: 1,
            updated_at: 1_764_000_000_000_123,
            ..Default::default()
        };
        for generation in [0, 1, 1_764_000_000_000_000, i64::MAX, -5] {
            for (absent, deleted) in [(false, false), (true, false), (false, true)] {
                let r = Record { absent, deleted, ..base.clone() };
                let bytes = stored_bytes(&r, generation);
                let e = gen_entry_of(&bytes).expect("decodes");
                let updated_at = r.updated_at;
                assert_eq!(e, GenEntry { generation, absent, deleted, updated_at }, "{r:?}");
                let decoded = Record::decode(bytes.as_slice()).expect("decodes");
                assert_eq!(decoded.generation, generation);
            }
        }
        assert_eq!(gen_entry_of(&[]), Some(GenEntry::default()));
        // Cut in the middle of a field, or an unknown wire type: not a record.
        let bytes = stored_bytes(&base, 7);
        assert_eq!(gen_entry_of(&bytes[..3]), None);
        assert_eq!(gen_entry_of(&[0x27]), None);
    }
}

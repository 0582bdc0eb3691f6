//! The commit path: what a batch reads before it is applied, and the one
//! atomic step that writes its slots, touched sets, decided sweeps, outbox
//! entries and new position — fenced, so that a second owner of a partition
//! writes nothing. The writes travel as a list interpreted by Lua (`ops`).

use std::collections::BTreeMap;

use prost::Message;
use redis::Value;
use shelfsync_bus::Partition;
use shelfsync_proto::{CommandBatch, OutboxEntry, PlaceKey};

use super::ops::{CommitOps, slot_ops, sweep_ops, touched_ops};
use super::outbox::OUTBOX_FIELD;
use super::{Column, Commit, Fence, Loaded, Position, Store, StoreError, Writes, hmget_place};
use crate::apply::{Key, Slots, touched};

impl Store {
    /// Reads where the partition stands and every record the batch's
    /// commands touch: one HMGET per place (generations are in the record
    /// bytes). Sweeps are not loaded here (see `crate::worker::sweep`).
    pub async fn load(
        &self,
        partition: Partition,
        batch: &CommandBatch,
    ) -> Result<Loaded, StoreError> {
        self.load_keys(partition, touched(batch).0).await
    }

    /// [`Store::load`] of the records `touched_keys` (sorted, each once).
    pub async fn load_keys(
        &self,
        partition: Partition,
        touched_keys: Vec<Key>,
    ) -> Result<Loaded, StoreError> {
        let keys = self.keys(partition);
        let mut by_place: BTreeMap<PlaceKey, Vec<String>> = BTreeMap::new();
        for (b, p, id) in touched_keys {
            by_place.entry(PlaceKey::new(b, p)).or_default().push(id);
        }
        let mut pipe = redis::pipe();
        pipe.get(keys.seq()).get(keys.step());
        for (place, ids) in &by_place {
            hmget_place(&mut pipe, &keys, *place, ids);
            pipe.exists(keys.records(*place));
        }
        let mut conn = self.conn.clone();
        let mut values: std::vec::IntoIter<Value> =
            pipe.query_async::<Vec<Value>>(&mut conn).await?.into_iter();
        let mut next = || values.next().unwrap_or(Value::Nil);
        let mut loaded = Loaded::default();
        loaded.at.applied = redis::from_redis_value::<Option<u64>>(next())?.unwrap_or(0);
        loaded.at.step = redis::from_redis_value::<Option<String>>(next())?.unwrap_or_default();
        for (place, ids) in by_place {
            let recs: Column = redis::from_redis_value(next())?;
            if !redis::from_redis_value::<bool>(next())? {
                loaded.empty_places.push(place);
            }
            let slots = self.slots_of(&keys, place, &ids, recs)?;
            for (id, slot) in ids.into_iter().zip(slots) {
                loaded.slots.insert((place.brand_id, place.place_id, id), slot);
            }
        }
        Ok(loaded)
    }

    /// Where the partition stands.
    pub async fn position(&self, partition: Partition) -> Result<Position, StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let (applied, step): (Option<u64>, Option<String>) =
            redis::pipe().get(keys.seq()).get(keys.step()).query_async(&mut conn).await?;
        Ok(Position { applied: applied.unwrap_or(0), step: step.unwrap_or_default() })
    }

    /// Some records of one place with their generations, as slots.
    pub async fn load_place(
        &self,
        partition: Partition,
        place: PlaceKey,
        ids: &[String],
    ) -> Result<Slots, StoreError> {
        if ids.is_empty() {
            return Ok(Slots::default());
        }
        let slots = self.read_slots(&self.keys(partition), place, ids).await?;
        Ok(ids.iter().map(|id| (place.brand_id, place.place_id, id.clone())).zip(slots).collect())
    }

    /// Writes the dirty slots, the outbox entries, the decided sweeps and the
    /// new position in one atomic step, if the partition still stands where
    /// `fence` says.
    pub async fn commit(
        &self,
        partition: Partition,
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
        if writes.outbox.is_empty() {
            return self.commit_ops(partition, &ops).await;
        }
        // The entries are staged in the same MULTI, outside the script (see
        // `COMMIT_LUA`). Should Redis not have the script (a restart), the
        // staged entries are left in the stage, not the outbox: the script
        // is loaded and the MULTI sent again, which empties the stage first.
        ops.staged(writes.outbox.len());
        let stage = keys.outbox_stage();
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.atomic();
        pipe.cmd("DEL").arg(&stage).ignore();
        for entry in writes.outbox {
            pipe.cmd("XADD").arg(&stage).arg("*").arg(OUTBOX_FIELD).arg(entry.encode_to_vec());
        }
        pipe.add_command(ops.command("EVALSHA", self.commit_script.get_hash()));
        let mut replies: Vec<Value> = match pipe.query_async(&mut conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.commit_script.load_async(&mut conn).await?;
                pipe.query_async(&mut conn).await?
            }
            other => other?,
        };
        let reply = replies.pop().unwrap_or(Value::Nil);
        let staged = replies.into_iter().map(redis::from_redis_value).collect::<Result<_, _>>()?;
        self.committed(partition, reply, writes.outbox, staged)
    }

    /// Runs the write list `ops` alone (no outbox entries) as one fenced
    /// step: the commit's, the purges', the layout upgrade's.
    pub(super) async fn commit_ops(
        &self,
        partition: Partition,
        ops: &CommitOps,
    ) -> Result<Commit, StoreError> {
        let mut conn = self.conn.clone();
        let reply = ops.invoke(&self.commit_script, &mut conn).await?;
        self.committed(partition, reply, &[], Vec::new())
    }

    /// What a commit's reply (`COMMIT_LUA`'s) says: fenced, or done; when
    /// the outbox holds only the entries the commit added (`pushed`, staged
    /// with the ids `staged`), they are kept as its head for the relay's
    /// next peek.
    pub(super) fn committed(
        &self,
        partition: Partition,
        reply: Value,
        pushed: &[OutboxEntry],
        staged: Vec<String>,
    ) -> Result<Commit, StoreError> {
        let Value::Array(reply) = reply else { return Ok(Commit::Fenced) };
        let mut reply = reply.into_iter();
        let mut next = || reply.next().unwrap_or(Value::Nil);
        let len: usize = redis::from_redis_value(next())?;
        let kept: u8 = redis::from_redis_value(next())?;
        let ids: Vec<String> = if kept == 1 {
            staged
        } else {
            reply.map(redis::from_redis_value).collect::<Result<_, _>>()?
        };
        let head = (len == ids.len() && ids.len() == pushed.len())
            .then(|| ids.into_iter().zip(pushed.iter().cloned()).collect());
        self.keep_head(partition, head);
        Ok(Commit::Done)
    }

    /// How many replicas have every write made so far, by anyone: `WAIT n
    /// timeout` right after a write of its own on the same connection (one
    /// pipeline, so also on a connection just re-established). `WAIT` alone
    /// counts only the writes of its connection: on a fresh one it returns
    /// at once, whatever the replicas lack. The replication stream is one
    /// ordered log, so a replica that has this write has every write before
    /// it, whoever made them.
    pub async fn wait_replicas(
        &self,
        partition: Partition,
        n: usize,
        timeout: std::time::Duration,
    ) -> Result<usize, StoreError> {
        let mut conn = self.conn.clone();
        let (have,): (usize,) = redis::pipe()
            .cmd("INCR")
            .arg(self.keys(partition).wait_mark())
            .ignore()
            .cmd("WAIT")
            .arg(n)
            .arg(timeout.as_millis() as u64)
            .query_async(&mut conn)
            .await?;
        Ok(have)
    }

    /// The last applied command sequence of a partition.
    pub async fn applied_seq(&self, partition: Partition) -> Result<u64, StoreError> {
        let mut conn = self.conn.clone();
        let v: Option<u64> =
            redis::cmd("GET").arg(self.keys(partition).seq()).query_async(&mut conn).await?;
        Ok(v.unwrap_or(0))
    }
}

//! The outbox as the relay sees it: a Redis stream per partition
//! (`{ns:pN}:obx`, one entry per `OutboxEntry`, its bytes in the field
//! [`OUTBOX_FIELD`]), in commit order. Peek the head (usually kept from the
//! commit that wrote it), delete exactly what was published by the entries'
//! ids, and the dead letters kept aside for an operator, with their redrive.
//!
//! A stream rather than a list because its entries have ids: a trim deletes
//! the entries it published and nothing else, also when two processes relay
//! one partition for a while (a stale owner during a rescale), without
//! sending their bytes back to Redis to find them; and a commit learns the
//! ids of what it added, so the relay publishes them from memory. The
//! outbox of an earlier version (a list, `{ns:pN}:outbox`) is moved into
//! the stream when the partition's relay starts
//! ([`Store::adopt_legacy_outbox`]).

use std::time::{Duration, Instant};

use prost::Message;
use redis::Value;
use shelfsync_bus::Partition;
use shelfsync_proto::OutboxEntry;

use super::{Store, StoreError};

/// Most outbox entries one peek returns.
pub const OUTBOX_PEEK: usize = 256;
/// A head kept with a write is used by a peek this soon after it only.
const HEAD_FRESH: Duration = Duration::from_secs(2);
/// The stream field holding an entry's `OutboxEntry` bytes.
pub(super) const OUTBOX_FIELD: &str = "e";

/// Entries kept in the partition's list of unpublishable outbox entries.
const DEAD_KEPT: i64 = 1000;

/// Moves an earlier version's outbox list (KEYS[1]) to the end of the
/// outbox stream (KEYS[2]), in order, in one step; returns how many.
const ADOPT_LUA: &str = r#"
local items = redis.call('LRANGE', KEYS[1], 0, -1)
for _, e in ipairs(items) do redis.call('XADD', KEYS[2], '*', ARGV[1], e) end
redis.call('DEL', KEYS[1])
return #items
"#;

/// The script of [`Store::adopt_legacy_outbox`].
pub(super) fn adopt_script() -> redis::Script {
    redis::Script::new(ADOPT_LUA)
}

/// Outbox entries with their stream ids, oldest first.
pub(super) type Head = Vec<(String, OutboxEntry)>;

/// The head a write left, and when.
pub(super) type HeadRead = (Instant, Head);

impl Store {
    /// Up to `n` outbox entries from the head, oldest first. The entries
    /// peeked are the ones [`Store::outbox_trim`] removes next.
    pub async fn outbox_peek(
        &self,
        partition: Partition,
        n: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        let kept =
            self.read_with_write.lock().unwrap_or_else(|e| e.into_inner()).remove(&partition.0);
        let head = match kept {
            // As fresh as a read: the worker relays right after its write.
            Some((at, mut head)) if n <= OUTBOX_PEEK && at.elapsed() < HEAD_FRESH => {
                head.truncate(n);
                head
            }
            _ => self.read_outbox(partition, n).await?,
        };
        let (ids, entries): (Vec<String>, Vec<OutboxEntry>) = head.into_iter().unzip();
        let mut peeked = self.peeked.lock().unwrap_or_else(|e| e.into_inner());
        if ids.is_empty() {
            peeked.remove(&partition.0);
        } else {
            peeked.insert(partition.0, ids);
        }
        Ok(entries)
    }

    /// `XRANGE` of the first `n` entries.
    async fn read_outbox(&self, partition: Partition, n: usize) -> Result<Head, StoreError> {
        let key = self.keys(partition).outbox();
        let reply: Value = self
            .query(redis::cmd("XRANGE").arg(&key).arg("-").arg("+").arg("COUNT").arg(n))
            .await?;
        stream_entries(&key, reply)
    }

    /// Removes the first `n` entries the last [`Store::outbox_peek`] of the
    /// partition returned, once they are published, by their ids: only
    /// those, even if another process removed them meanwhile. Without such
    /// a peek, removes the first `n` of the stream.
    pub async fn outbox_trim(&self, partition: Partition, n: usize) -> Result<(), StoreError> {
        if n == 0 {
            return Ok(());
        }
        let peeked = self.peeked.lock().unwrap_or_else(|e| e.into_inner()).remove(&partition.0);
        let ids = match peeked {
            Some(mut ids) if ids.len() >= n => {
                ids.truncate(n);
                ids
            }
            _ => self.read_outbox(partition, n).await?.into_iter().map(|(id, _)| id).collect(),
        };
        let key = self.keys(partition).outbox();
        let mut conn = self.conn.clone();
        let (_, left): (Value, usize) = redis::pipe()
            .cmd("XDEL")
            .arg(&key)
            .arg(&ids)
            .cmd("XLEN")
            .arg(&key)
            .query_async(&mut conn)
            .await?;
        // An empty outbox is a head known without reading it.
        self.keep_head(partition, (left == 0).then(Vec::new));
        Ok(())
    }

    /// Keeps the head a write left (`None`: not known), for the next peek.
    /// Forgets the outbox head the last commit left in memory (Redis went
    /// back in time: it may not hold it).
    pub(crate) fn forget_head(&self, partition: Partition) {
        self.keep_head(partition, None);
    }

    pub(super) fn keep_head(&self, partition: Partition, head: Option<Head>) {
        let mut kept = self.read_with_write.lock().unwrap_or_else(|e| e.into_inner());
        match head {
            Some(head) => kept.insert(partition.0, (Instant::now(), head)),
            None => kept.remove(&partition.0),
        };
    }

    pub async fn outbox_len(&self, partition: Partition) -> Result<u64, StoreError> {
        self.query(redis::cmd("XLEN").arg(self.keys(partition).outbox())).await
    }

    /// Moves what an earlier version left in the partition's outbox list to
    /// the end of its outbox stream, to be relayed like the rest; returns
    /// how many entries it moved.
    pub async fn adopt_legacy_outbox(&self, partition: Partition) -> Result<u64, StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let moved: u64 = self
            .adopt_script
            .key(keys.legacy_outbox())
            .key(keys.outbox())
            .arg(OUTBOX_FIELD)
            .invoke_async(&mut conn)
            .await?;
        if moved > 0 {
            self.keep_head(partition, None);
        }
        Ok(moved)
    }

    /// The newest `limit` outbox entries kept aside as unpublishable.
    pub async fn dead_entries(
        &self,
        partition: Partition,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        let key = self.keys(partition).dead();
        let raw: Vec<Vec<u8>> =
            self.query(redis::cmd("LRANGE").arg(&key).arg(-(limit.max(1) as i64)).arg(-1)).await?;
        decode_entries(&key, &raw)
    }

    /// Moves outbox entries kept aside back to the tail of the partition's
    /// outbox (all of them, or those with these message ids), in one
    /// atomic step; returns how many.
    pub async fn redrive(
        &self,
        partition: Partition,
        msg_ids: &[String],
    ) -> Result<u64, StoreError> {
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
            pipe.cmd("XADD")
                .arg(keys.outbox())
                .arg("*")
                .arg(OUTBOX_FIELD)
                .arg(b.as_slice())
                .ignore();
        }
        let () = pipe.query_async(&mut conn).await?;
        self.keep_head(partition, None);
        Ok(chosen.len() as u64)
    }

    /// Keeps an outbox entry that can never be published (for an operator
    /// to look at), bounded to the last [`DEAD_KEPT`].
    pub async fn outbox_bury(
        &self,
        partition: Partition,
        entry: &OutboxEntry,
    ) -> Result<(), StoreError> {
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
}

/// The entries of an `XRANGE` reply: `[[id, [field, value, ...]], ...]`.
fn stream_entries(key: &str, reply: Value) -> Result<Head, StoreError> {
    let corrupt = |what: &str| StoreError::corrupt(key, what);
    let Value::Array(items) = reply else { return Err(corrupt("not a stream reply")) };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let (id, fields): (String, Vec<Vec<u8>>) = redis::from_redis_value(item)?;
        let bytes = fields
            .chunks(2)
            .find(|pair| pair.len() == 2 && pair[0] == OUTBOX_FIELD.as_bytes())
            .map(|pair| &pair[1])
            .ok_or_else(|| corrupt("an outbox entry without its bytes"))?;
        let entry =
            OutboxEntry::decode(bytes.as_slice()).map_err(|e| StoreError::corrupt(key, e))?;
        out.push((id, entry));
    }
    Ok(out)
}

/// Decodes outbox entries as stored under `key`.
fn decode_entries(key: &str, raw: &[Vec<u8>]) -> Result<Vec<OutboxEntry>, StoreError> {
    raw.iter()
        .map(|b| OutboxEntry::decode(b.as_slice()).map_err(|e| StoreError::corrupt(key, e)))
        .collect()
}

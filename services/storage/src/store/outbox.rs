//! The outbox as the relay sees it: peek the head (often read with the write
//! before it), trim exactly what was published, and the dead letters kept
//! aside for an operator, with their redrive.

use prost::Message;
use redis::Value;
use shelfsync_bus::Partition;
use shelfsync_proto::OutboxEntry;

use super::{Store, StoreError, decode_entries};

/// Outbox entries read back by the commit and the trim (`LRANGE 0 255` in
/// `COMMIT_LUA` and [`TRIM_LUA`]): the relay's next peek comes with the
/// write before it instead of costing a round trip.
pub const OUTBOX_PEEK: usize = 256;
/// A head read with a write is used by a peek this soon after it only.
const HEAD_FRESH: std::time::Duration = std::time::Duration::from_secs(2);

/// Entries kept in the partition's list of unpublishable outbox entries.
const DEAD_KEPT: i64 = 1000;

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
pub(super) type HeadRead = (std::time::Instant, Vec<Vec<u8>>);

/// How many entries a peek returned, and the last one as stored.
pub(super) type LastPeek = (usize, Vec<u8>);

/// The script of [`Store::outbox_trim`].
pub(super) fn trim_script() -> redis::Script {
    redis::Script::new(TRIM_LUA)
}

impl Store {
    /// Up to `n` outbox entries from the head, oldest first.
    pub async fn outbox_peek(
        &self,
        partition: Partition,
        n: usize,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        let key = self.keys(partition).outbox();
        let kept =
            self.read_with_write.lock().unwrap_or_else(|e| e.into_inner()).remove(&partition.0);
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
        let entries = decode_entries(&key, &raw)?;
        let mut peeked = self.peeked.lock().unwrap_or_else(|e| e.into_inner());
        match raw.into_iter().last() {
            Some(last) => peeked.insert(partition.0, (entries.len(), last)),
            None => peeked.remove(&partition.0),
        };
        Ok(entries)
    }

    /// Removes the `n` entries the last [`Store::outbox_peek`] of the
    /// partition returned, once they are published — only those, even if
    /// another process trimmed them meanwhile (see `TRIM_LUA`). Without such
    /// a peek, trims the first `n` of the list.
    pub async fn outbox_trim(&self, partition: Partition, n: usize) -> Result<(), StoreError> {
        if n == 0 {
            return Ok(());
        }
        let last = {
            let mut peeked = self.peeked.lock().unwrap_or_else(|e| e.into_inner());
            peeked.remove(&partition.0).and_then(|(len, last)| (len == n).then_some(last))
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

    pub async fn outbox_len(&self, partition: Partition) -> Result<u64, StoreError> {
        self.query(redis::cmd("LLEN").arg(self.keys(partition).outbox())).await
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
            pipe.cmd("RPUSH").arg(keys.outbox()).arg(b.as_slice()).ignore();
        }
        let () = pipe.query_async(&mut conn).await?;
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

//! The copy on write of keyframes: a place is frozen in one small step,
//! writes keep what they replace while it is, and the keyframe reads the
//! place as it was frozen however long its publishing takes; then the place
//! is thawed and the keyframe's start recorded.

use shelfsync_bus::Partition;
use shelfsync_proto::PlaceKey;
use shelfsync_proto::Record;

use super::{Column, Store, StoreError, full_record};

/// A value kept by the copy on write of the commit's interpreter (`OPS_LUA`): what the field held
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

impl Store {
    /// Freezes a place for its keyframe, in one small atomic step whatever
    /// its size: reads the partition's applied sequence and sets the place's
    /// frozen marker, after which every write to the place keeps the value it
    /// replaces (copy on write, see `OPS_LUA` in the commit path); what a keyframe left behind
    /// is dropped first. Returns the applied sequence. The marker, and with
    /// it what was kept, expires after `ttl` if the keyframe never gets to
    /// [`Store::thaw_place`].
    pub async fn freeze_place(
        &self,
        partition: Partition,
        place: PlaceKey,
        ttl: std::time::Duration,
    ) -> Result<u64, StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let (seq,): (Option<u64>,) = redis::pipe()
            .atomic()
            .get(keys.seq())
            .cmd("UNLINK")
            .arg(keys.frozen_records(place))
            .ignore()
            .cmd("SET")
            .arg(keys.frozen_marker(place))
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
        partition: Partition,
        place: PlaceKey,
    ) -> Result<(), StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        // UNLINK: freed in the background, not while every partition's
        // commands wait for Redis.
        let _: () = redis::cmd("UNLINK")
            .arg(keys.frozen_marker(place))
            .arg(keys.frozen_records(place))
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// Some records of a place, as frozen and as they are now (`None`:
    /// absent), in the order of `ids`.
    pub async fn frozen_and_live(
        &self,
        partition: Partition,
        place: PlaceKey,
        ids: &[String],
    ) -> Result<(Vec<Option<Record>>, Vec<Option<Record>>), StoreError> {
        if ids.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let keys = self.keys(partition);
        let mut conn = self.conn.clone();
        let (kept, live): (Column, Column) = redis::pipe()
            .cmd("HMGET")
            .arg(keys.frozen_records(place))
            .arg(ids)
            .cmd("HMGET")
            .arg(keys.records(place))
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
                .map(|(id, raw)| Ok(self.slot(&keys, place, id, raw.as_deref())?.record))
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
        partition: Partition,
        place: PlaceKey,
        kept: bool,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<Record>), StoreError> {
        let keys = self.keys(partition);
        let (live, frozen) = (keys.records(place), keys.frozen_records(place));
        let (next, flat): (u64, Vec<Vec<u8>>) = self
            .query(
                redis::cmd("HSCAN")
                    .arg(if kept { &frozen } else { &live })
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(count),
            )
            .await?;
        if flat.is_empty() {
            return Ok((next, Vec::new()));
        }
        // Read after the step, and still as frozen: a record written since
        // the step has its frozen value kept by then (its generation inside),
        // and a kept value never changes.
        let ids: Vec<&[u8]> = flat.chunks_exact(2).map(|pair| pair[0].as_slice()).collect();
        let kept_recs: Column = self.query(redis::cmd("HMGET").arg(&frozen).arg(&ids)).await?;
        let mut out = Vec::with_capacity(flat.len() / 2);
        for (pair, kept_rec) in flat.chunks_exact(2).zip(kept_recs) {
            let id = String::from_utf8_lossy(&pair[0]).into_owned();
            // As frozen: the kept value if the record was written since.
            let Some(bytes) = frozen_value(kept_rec).unwrap_or_else(|| Some(pair[1].clone()))
            else {
                continue;
            };
            let slot = self.slot(&keys, place, &id, Some(&bytes))?;
            out.extend(full_record(place, id, slot));
        }
        Ok((next, out))
    }

    /// Records that a keyframe of a place starts at `first_seq` in the
    /// KEYFRAMES stream; returns the sequence below which older keyframes of
    /// the place may be purged once more than `keep` are recorded.
    pub async fn keyframe_published(
        &self,
        partition: Partition,
        place: PlaceKey,
        first_seq: u64,
        keep: u32,
    ) -> Result<Option<u64>, StoreError> {
        let key = self.keys(partition).keyframes(place);
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
}

//! What sweeps and purges read and remove: census scans of a place's
//! records (their generations), the touched sets full imports leave, held sweeps and the
//! outcomes kept per import, and the fenced purge of old tombstones and the
//! index of absent records.

use shelfsync_bus::Partition;
use shelfsync_proto::PlaceKey;
use std::collections::{BTreeMap, HashSet};

use prost::Message;
use shelfsync_proto::SweepOutcome;

use super::ops::CommitOps;
use super::{Column, Fence, Store, StoreError, gen_entry_of};
use crate::apply::{GenEntry, Key, touched_set};

impl Store {
    /// One HSCAN step over a place's records, read as generation entries
    /// (generation and flags off the record bytes, not decoded): up to about
    /// `count` entries and the next cursor (0: done). An entry may come twice.
    pub async fn scan_gens(
        &self,
        partition: Partition,
        place: PlaceKey,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<(String, GenEntry)>), StoreError> {
        let key = self.keys(partition).records(place);
        let (next, flat): (u64, Vec<Vec<u8>>) =
            self.query(redis::cmd("HSCAN").arg(&key).arg(cursor).arg("COUNT").arg(count)).await?;
        let mut out = Vec::with_capacity(flat.len() / 2);
        for pair in flat.chunks_exact(2) {
            let id =
                String::from_utf8(pair[0].clone()).map_err(|e| StoreError::corrupt(&key, e))?;
            let entry = gen_entry_of(&pair[1])
                .ok_or_else(|| StoreError::corrupt(&key, format!("bad record bytes for {id}")))?;
            out.push((id, entry));
        }
        Ok((next, out))
    }

    /// The ids the full import of `generation` carried to a place, as far as
    /// committed (`None`: none kept, or expired).
    pub async fn touched(
        &self,
        partition: Partition,
        place: PlaceKey,
        generation: i64,
    ) -> Result<Option<HashSet<String>>, StoreError> {
        let key = self.keys(partition).touched(place, generation);
        let blob: Option<Vec<u8>> = self.query(redis::cmd("GET").arg(&key)).await?;
        blob.map(|b| {
            touched_set::decode(&b).ok_or_else(|| StoreError::corrupt(&key, "bad touched set"))
        })
        .transpose()
    }

    /// How many sweep outcomes and touched sets the partition keeps (the
    /// indexes of them; the expired ones are dropped at the next write).
    pub async fn kept(&self, partition: Partition) -> Result<(u64, u64), StoreError> {
        let keys = self.keys(partition);
        let mut conn = self.conn();
        Ok(redis::pipe()
            .zcard(keys.swept_index())
            .zcard(keys.touched_index())
            .query_async(&mut conn)
            .await?)
    }

    /// The sweep held for a place, if any.
    pub async fn held(
        &self,
        partition: Partition,
        place: PlaceKey,
    ) -> Result<Option<SweepOutcome>, StoreError> {
        let key = self.keys(partition).held();
        let raw: Option<Vec<u8>> =
            self.query(redis::cmd("HGET").arg(&key).arg(place.to_string())).await?;
        raw.map(|b| decode_outcome(&key, &b)).transpose()
    }

    /// Every sweep held in a partition.
    pub async fn held_all(&self, partition: Partition) -> Result<Vec<SweepOutcome>, StoreError> {
        let key = self.keys(partition).held();
        let raw: Vec<Vec<u8>> = self.query(redis::cmd("HVALS").arg(&key)).await?;
        raw.iter().map(|b| decode_outcome(&key, b)).collect()
    }

    /// The outcomes of an import's sweeps of some places of a partition
    /// (`None`: not decided yet, or expired).
    pub async fn sweep_outcomes(
        &self,
        partition: Partition,
        import_id: &str,
        places: &[PlaceKey],
    ) -> Result<Vec<Option<SweepOutcome>>, StoreError> {
        if places.is_empty() {
            return Ok(Vec::new());
        }
        let key = self.keys(partition).swept(import_id);
        let fields: Vec<String> = places.iter().map(PlaceKey::to_string).collect();
        let raw: Column = self.query(redis::cmd("HMGET").arg(&key).arg(&fields)).await?;
        raw.into_iter().map(|b| b.map(|b| decode_outcome(&key, &b)).transpose()).collect()
    }

    /// Purges up to `limit` tombstones deleted before `cutoff_us`, fenced
    /// like a commit (the partition must still stand at `fence`; nothing
    /// moves it). Runs in the partition's worker between messages.
    pub async fn purge_tombstones(
        &self,
        partition: Partition,
        fence: &Fence,
        cutoff_us: i64,
        limit: usize,
    ) -> Result<Option<usize>, StoreError> {
        let keys = self.keys(partition);
        let members = self.due(&keys.tombstones(), cutoff_us, limit).await?;
        if members.is_empty() {
            return Ok(Some(0));
        }
        // One HDEL per place, keeping frozen values (a keyframe may have the
        // place frozen), all in one atomic step.
        let mut by_place: BTreeMap<PlaceKey, Vec<Vec<u8>>> = BTreeMap::new();
        for (b, p, id) in members.iter().filter_map(|m| parse_member(m)) {
            by_place.entry(PlaceKey::new(b, p)).or_default().push(id.as_bytes().to_vec());
        }
        let mut ops = CommitOps::new(&keys, fence, &fence.at);
        for (place, ids) in by_place {
            let marker = keys.frozen_marker(place);
            ops.kept_op(&keys.records(place), &marker, &keys.frozen_records(place), ids, 1);
        }
        let members_raw = members.iter().map(|m| m.as_bytes().to_vec()).collect();
        ops.op("ZREM", &keys.tombstones(), members_raw, 1);
        Ok(self.commit_ops(partition, &ops).await?.done(members.len()))
    }

    /// Up to `limit` absent records that became absent before `cutoff_us`.
    pub async fn absent_due(
        &self,
        partition: Partition,
        cutoff_us: i64,
        limit: usize,
    ) -> Result<Vec<Key>, StoreError> {
        let members = self.due(&self.keys(partition).absent(), cutoff_us, limit).await?;
        Ok(members.iter().filter_map(|m| parse_member(m)).collect())
    }

    /// Members of an index zset scored at or below `cutoff`, oldest first.
    async fn due(&self, key: &str, cutoff: i64, limit: usize) -> Result<Vec<String>, StoreError> {
        self.query(
            redis::cmd("ZRANGEBYSCORE")
                .arg(key)
                .arg("-inf")
                .arg(cutoff)
                .arg("LIMIT")
                .arg(0)
                .arg(limit),
        )
        .await
    }
}

fn decode_outcome(key: &str, bytes: &[u8]) -> Result<SweepOutcome, StoreError> {
    SweepOutcome::decode(bytes).map_err(|e| StoreError::corrupt(key, e))
}

/// `<brand>:<place>:<product_id>`, as the index zsets hold records.
fn parse_member(m: &str) -> Option<Key> {
    let mut parts = m.splitn(3, ':');
    let (b, p, id) = (parts.next()?, parts.next()?, parts.next()?);
    Some((b.parse().ok()?, p.parse().ok()?, id.to_string()))
}

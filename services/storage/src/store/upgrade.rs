//! The upgrade of a partition from layout 1 to this version's layout (2),
//! once, when storage binds the partition, before it applies anything there.
//!
//! Layout 1 kept a place's generations in a hash of their own
//! (`:g:<brand>:<place>`: `<generation>`, `a` or `d` after it for an absent
//! or deleted record), their frozen values in `:kfo:g:`, and the place's ids
//! in a zset (`:ids:<brand>:<place>`). Layout 2 keeps the generation in the
//! record bytes (the flags were there already) and pages by `HSCAN`. The
//! upgrade moves each generation into its record, a step of
//! [`UPGRADE_STEP`] records per commit that also removes those entries (so
//! a crash resumes where it stopped), drops the zset and the frozen
//! generations once a place's generations are gone, and then records the
//! partition's layout. Each step is fenced like a commit: another owner
//! that applied a message meanwhile fences it, and the bind is retried.
//! Until a partition is upgraded, readers of other replicas see its records
//! not yet moved with generation 0.

use prost::Message;
use shelfsync_bus::Partition;
use shelfsync_proto::PlaceKey;
use shelfsync_proto::Record;

use super::ops::CommitOps;
use super::{Column, Fence, Keys, Store, StoreError, stored_bytes};
use crate::apply::GenEntry;

/// The layout version this version writes, kept at `{ns:pN}:layout`.
pub const LAYOUT: &str = "2";

/// Records moved per commit.
const UPGRADE_STEP: usize = 500;

impl Store {
    /// Brings the partition to this version's layout if it is not there yet
    /// (a new partition is there at once). Returns how many records got
    /// their generation moved in, or `None` when a step was fenced (another
    /// owner applied a message meanwhile): nothing of that step was written,
    /// and the upgrade resumes when called again.
    pub async fn upgrade_layout(&self, partition: Partition) -> Result<Option<u64>, StoreError> {
        let keys = self.keys(partition);
        let layout: Option<String> = self.query(redis::cmd("GET").arg(keys.layout())).await?;
        if layout.as_deref() == Some(LAYOUT) {
            return Ok(Some(0));
        }
        let mut moved = 0;
        for place in self.places(partition).await? {
            match self.upgrade_place(partition, &keys, place).await? {
                Some(n) => moved += n,
                None => return Ok(None),
            }
        }
        let _: () = self.query(redis::cmd("SET").arg(keys.layout()).arg(LAYOUT)).await?;
        Ok(Some(moved))
    }

    async fn upgrade_place(
        &self,
        partition: Partition,
        keys: &Keys,
        place: PlaceKey,
    ) -> Result<Option<u64>, StoreError> {
        let gens = keys.legacy_gens(place);
        let mut moved = 0;
        // Entries are removed as they move: scan until none is left.
        loop {
            let mut cursor = 0u64;
            loop {
                let (next, flat): (u64, Vec<Vec<u8>>) = self
                    .query(
                        redis::cmd("HSCAN").arg(&gens).arg(cursor).arg("COUNT").arg(UPGRADE_STEP),
                    )
                    .await?;
                for step in flat.chunks(2 * UPGRADE_STEP) {
                    match self.upgrade_step(partition, keys, place, step).await? {
                        Some(n) => moved += n,
                        None => return Ok(None),
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
            let left: u64 = self.query(redis::cmd("HLEN").arg(&gens)).await?;
            if left == 0 {
                break;
            }
        }
        let _: u64 = self
            .query(
                redis::cmd("UNLINK")
                    .arg(keys.legacy_ids(place))
                    .arg(keys.legacy_frozen_gens(place))
                    .arg(&gens),
            )
            .await?;
        Ok(Some(moved))
    }

    /// Moves the generations of `flat` (field, value pairs of the old
    /// generations hash) into their records and removes them, in one
    /// fenced commit (`None`: fenced, nothing written).
    async fn upgrade_step(
        &self,
        partition: Partition,
        keys: &Keys,
        place: PlaceKey,
        flat: &[Vec<u8>],
    ) -> Result<Option<u64>, StoreError> {
        let gens = keys.legacy_gens(place);
        let records = keys.records(place);
        let ids: Vec<&[u8]> = flat.chunks_exact(2).map(|pair| pair[0].as_slice()).collect();
        let position = self.position(partition).await?;
        let recs: Column = self.query(redis::cmd("HMGET").arg(&records).arg(&ids)).await?;
        let mut sets = Vec::new();
        for (pair, rec) in flat.chunks_exact(2).zip(recs) {
            let Some(rec) = rec else { continue };
            let corrupt = |detail: String| StoreError::corrupt(&gens, detail);
            let entry = GenEntry::decode(&pair[1]).ok_or_else(|| {
                corrupt(format!("bad generation entry for {}", String::from_utf8_lossy(&pair[0])))
            })?;
            let record = Record::decode(rec.as_slice())
                .map_err(|e| StoreError::corrupt(&format!("{records} (upgrade)"), e))?;
            // Written by this version already (no generation hash entry
            // would be left then, but never overwrite one).
            if record.generation != 0 || entry.generation == 0 {
                continue;
            }
            sets.push(pair[0].clone());
            sets.push(stored_bytes(&record, entry.generation));
        }
        let moved = (sets.len() / 2) as u64;
        let fence = Fence { at: position.clone(), stream: String::new() };
        let mut ops = CommitOps::new(keys, &fence, &position);
        let (marker, frozen) = (keys.frozen_marker(place), keys.frozen_records(place));
        ops.kept_op(&records, &marker, &frozen, sets, 2);
        ops.op("HDEL", &gens, ids.iter().map(|id| id.to_vec()).collect(), 1);
        Ok(self.commit_ops(partition, &ops).await?.done(moved))
    }
}

//! Reads for other tools (the read API, the CLI, tests): records as storage
//! holds them, with key and generation filled in, found by key, by place or
//! in pages of a place's ids.

use std::collections::HashMap;

use shelfsync_proto::{Record, RecordKey};

use super::{Store, StoreError, full_record};

impl Store {
    /// One record as storage holds it (key and generation filled in), or
    /// `None`. A purged tombstone is `None`; a tombstone awaiting purge is
    /// returned with `deleted = true`.
    pub async fn get(
        &self,
        partitions: u32,
        key: &RecordKey,
    ) -> Result<Option<Record>, StoreError> {
        let found = self
            .get_many(partitions, key.brand_id, key.place_id, &[key.product_id.clone()])
            .await?;
        Ok(found.into_iter().next().flatten())
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
            let generation = gens.get(&id).map(Vec::as_slice);
            let slot = self.slot(&keys, brand_id, place_id, &id, Some(&bytes), generation)?;
            out.extend(full_record(brand_id, place_id, id, slot));
        }
        Ok(out)
    }

    /// The places of a partition that ever held a record.
    pub async fn places(&self, partition: u32) -> Result<Vec<(i64, i64)>, StoreError> {
        let raw: Vec<String> =
            self.query(redis::cmd("SMEMBERS").arg(self.keys(partition).places())).await?;
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
        let slots = self.read_slots(&keys, brand_id, place_id, ids).await?;
        Ok(ids
            .iter()
            .zip(slots)
            .map(|(id, slot)| full_record(brand_id, place_id, id.as_str(), slot))
            .collect())
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
        let mut ids: Vec<String> = self
            .query(
                redis::cmd("ZRANGE")
                    .arg(keys.ids(brand_id, place_id))
                    .arg(&start)
                    .arg("+")
                    .arg("BYLEX")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(limit + 1),
            )
            .await?;
        let more = ids.len() > limit;
        ids.truncate(limit);
        let found = self.get_many(partitions, brand_id, place_id, &ids).await?;
        let next = if more { ids.last().cloned() } else { None };
        Ok((found.into_iter().flatten().collect(), next))
    }
}

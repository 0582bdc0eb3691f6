//! Reads for other tools (the read API, the CLI, tests): records as storage
//! holds them, with key and generation filled in, found by key, by place or
//! in pages of a scan of a place's records.

use shelfsync_bus::Partition;
use shelfsync_proto::PlaceKey;
use std::collections::HashMap;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use shelfsync_proto::{Record, RecordKey};

use super::{Store, StoreError, full_record};
use crate::apply::touched_set;

/// `HSCAN` calls one page makes at most: a scan of a sparse hash (after many
/// deletes) may find nothing for a while, and a page then ends short, its
/// cursor going on.
const PAGE_SCAN_STEPS: usize = 64;

/// Where paging a place's records goes on: the place's `HSCAN` cursor
/// (`None`: the scan is done) and the ids a scan step found beyond the
/// page's limit, returned first by the next page. Opaque to clients:
/// URL-safe base64 of a version byte (1), a flag (1: the scan is done), the
/// cursor (u64, little endian) and the ids left over (as a touched set).
/// Ids are left over only beyond the limit, from one scan step: a bucket of
/// the hash table, or a small hash that Redis keeps whole (at most 128
/// fields of at most 64 bytes by default), so a cursor stays small.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PageCursor {
    scan: Option<u64>,
    pending: Vec<String>,
}

impl PageCursor {
    const VERSION: u8 = 1;

    /// Empty: the first page.
    fn parse(s: &str) -> Result<Self, StoreError> {
        if s.is_empty() {
            return Ok(PageCursor { scan: Some(0), pending: Vec::new() });
        }
        let bad = || {
            StoreError::BadCursor(format!(
                "bad `cursor` (pass the `next_cursor` of the previous page, or none to start): {:?}",
                s.chars().take(40).collect::<String>()
            ))
        };
        let raw = URL_SAFE_NO_PAD.decode(s).map_err(|_| bad())?;
        let (head, ids) = raw.split_at_checked(10).ok_or_else(bad)?;
        let (version, done) = (head[0], head[1]);
        if version != Self::VERSION || done > 1 {
            return Err(bad());
        }
        let cursor = u64::from_le_bytes(head[2..10].try_into().map_err(|_| bad())?);
        let mut pending: Vec<String> =
            touched_set::decode(ids).ok_or_else(bad)?.into_iter().collect();
        pending.sort();
        Ok(PageCursor { scan: (done == 0).then_some(cursor), pending })
    }

    fn encode(&self) -> String {
        let mut raw = vec![Self::VERSION, u8::from(self.scan.is_none())];
        raw.extend_from_slice(&self.scan.unwrap_or(0).to_le_bytes());
        raw.extend(touched_set::encode(self.pending.iter().map(String::as_str)));
        URL_SAFE_NO_PAD.encode(raw)
    }
}

impl Store {
    /// One record as storage holds it (key and generation filled in), or
    /// `None`. A purged tombstone is `None`; a tombstone awaiting purge is
    /// returned with `deleted = true`.
    pub async fn get(
        &self,
        partitions: u32,
        key: &RecordKey,
    ) -> Result<Option<Record>, StoreError> {
        let found =
            self.get_many(partitions, key.place(), std::slice::from_ref(&key.product_id)).await?;
        Ok(found.into_iter().next().flatten())
    }

    /// Every record of a place (key and generation filled in), in no order.
    pub async fn place_records(
        &self,
        partitions: u32,
        place: PlaceKey,
    ) -> Result<Vec<Record>, StoreError> {
        let keys = self.keys(Partition::of(place, partitions));
        let mut conn = self.conn.clone();
        let recs: HashMap<String, Vec<u8>> =
            redis::cmd("HGETALL").arg(keys.records(place)).query_async(&mut conn).await?;
        let mut out = Vec::with_capacity(recs.len());
        for (id, bytes) in recs {
            let slot = self.slot(&keys, place, &id, Some(&bytes))?;
            out.extend(full_record(place, id, slot));
        }
        Ok(out)
    }

    /// The places of a partition that ever held a record.
    pub async fn places(&self, partition: Partition) -> Result<Vec<PlaceKey>, StoreError> {
        let raw: Vec<String> =
            self.query(redis::cmd("SMEMBERS").arg(self.keys(partition).places())).await?;
        let mut out: Vec<PlaceKey> = raw
            .iter()
            .filter_map(|s| {
                let (b, p) = s.split_once(':')?;
                Some(PlaceKey::new(b.parse().ok()?, p.parse().ok()?))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// Several records of one place, in the order asked (`None`: missing).
    pub async fn get_many(
        &self,
        partitions: u32,
        place: PlaceKey,
        ids: &[String],
    ) -> Result<Vec<Option<Record>>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys = self.keys(Partition::of(place, partitions));
        let slots = self.read_slots(&keys, place, ids).await?;
        Ok(ids.iter().zip(slots).map(|(id, slot)| full_record(place, id.as_str(), slot)).collect())
    }

    /// One page of a place's records: up to `limit` of them (key and
    /// generation filled in) from where `cursor` says (empty: the start),
    /// and the cursor of the next page (`None`: the place is done). Pages
    /// follow an `HSCAN` of the place's records: in no order, a page may end
    /// short (even empty) before the end, and a record may come twice (the
    /// hash was rehashed meanwhile; callers dedupe), but every record that
    /// exists for the whole of the paging comes at least once. Ids a scan
    /// step found beyond `limit` travel in the cursor and are read again,
    /// as they are then, by the next page.
    pub async fn page(
        &self,
        partitions: u32,
        place: PlaceKey,
        cursor: &str,
        limit: usize,
    ) -> Result<(Vec<Record>, Option<String>), StoreError> {
        let mut at = PageCursor::parse(cursor)?;
        let keys = self.keys(Partition::of(place, partitions));
        let key = keys.records(place);
        let mut out = Vec::new();
        let now: Vec<String> = at.pending.drain(..at.pending.len().min(limit)).collect();
        if !now.is_empty() {
            let found = self.get_many(partitions, place, &now).await?;
            out.extend(found.into_iter().flatten());
        }
        let mut steps = 0;
        while out.len() < limit
            && at.pending.is_empty()
            && steps < PAGE_SCAN_STEPS
            && let Some(c) = at.scan
        {
            steps += 1;
            let (next, flat): (u64, Vec<Vec<u8>>) = self
                .query(redis::cmd("HSCAN").arg(&key).arg(c).arg("COUNT").arg(limit - out.len()))
                .await?;
            at.scan = (next != 0).then_some(next);
            for pair in flat.chunks_exact(2) {
                let id =
                    String::from_utf8(pair[0].clone()).map_err(|e| StoreError::corrupt(&key, e))?;
                if out.len() < limit {
                    let slot = self.slot(&keys, place, &id, Some(&pair[1]))?;
                    out.extend(full_record(place, id, slot));
                } else {
                    at.pending.push(id);
                }
            }
        }
        let done = at.scan.is_none() && at.pending.is_empty();
        Ok((out, (!done).then(|| at.encode())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_cursor_round_trips_and_anything_else_is_refused() {
        for c in [
            PageCursor { scan: Some(0), pending: vec![] },
            PageCursor { scan: Some(u64::MAX), pending: vec!["a".into(), "b/ä c".into()] },
            PageCursor { scan: None, pending: vec!["x".repeat(64)] },
        ] {
            assert_eq!(PageCursor::parse(&c.encode()).expect("parses"), c);
        }
        assert_eq!(
            PageCursor::parse("").expect("start"),
            PageCursor { scan: Some(0), pending: vec![] }
        );
        let good = PageCursor { scan: Some(5), pending: vec!["a".into()] }.encode();
        for bad in ["sku-1", "AAAA", "%%", &good[..good.len() - 1], &format!("{good}A")] {
            assert!(
                matches!(PageCursor::parse(bad), Err(StoreError::BadCursor(_))),
                "{bad:?} is no cursor"
            );
        }
    }
}

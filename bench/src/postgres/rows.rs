//! The peer's input: a dump parsed before any timing starts, with ingest's own parser, into
//! batches of rows (place, product id, the record's fields as JSON text), and the keys whose
//! payload differs between two dumps (where `updated_at` must move).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{Context, bail};
use shelfsync_ingest::feed::{FeedEvent, Stopped, parse_feed};
use shelfsync_settings::FeedFormat;

use crate::parse_floor::item_rules;

/// A row's key within the brand: (place, product id).
pub type Key = (i64, String);

/// One statement's worth of rows, as the arrays it binds.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Batch {
    pub places: Vec<i64>,
    pub ids: Vec<String>,
    pub payloads: Vec<String>,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.places.len()
    }

    fn push(&mut self, place: i64, id: String, payload: String) {
        self.places.push(place);
        self.ids.push(id);
        self.payloads.push(payload);
    }

    fn rows(&self) -> impl Iterator<Item = (i64, &str, &str)> {
        self.places
            .iter()
            .zip(&self.ids)
            .zip(&self.payloads)
            .map(|((p, id), payload)| (*p, id.as_str(), payload.as_str()))
    }
}

/// A whole dump, in feed order.
#[derive(Debug, Default)]
pub struct Dump {
    pub batches: Vec<Batch>,
}

impl Dump {
    /// Splits rows into batches of `batch_rows`.
    pub fn from_rows(
        rows: impl IntoIterator<Item = (i64, String, String)>,
        batch_rows: usize,
    ) -> Dump {
        let mut dump = Dump::default();
        let mut batch = Batch::default();
        for (place, id, payload) in rows {
            batch.push(place, id, payload);
            if batch.len() == batch_rows {
                dump.batches.push(std::mem::take(&mut batch));
            }
        }
        if batch.len() > 0 {
            dump.batches.push(batch);
        }
        dump
    }

    pub fn records(&self) -> u64 {
        self.batches.iter().map(|b| b.len() as u64).sum()
    }

    fn rows(&self) -> impl Iterator<Item = (i64, &str, &str)> {
        self.batches.iter().flat_map(Batch::rows)
    }
}

/// Parses `path` with ingest's parser into batches; the payload is the item's fields as the
/// project writes a `Product` in JSON. A rejected item fails: the dumps are generated valid.
pub fn prepare(path: &Path, batch_rows: usize) -> anyhow::Result<Dump> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut rows = Vec::new();
    let mut rejected = 0u64;
    let mut undecodable = None;
    let parsed = parse_feed(file, FeedFormat::Auto, &item_rules(), &mut |event| {
        match event {
            FeedEvent::Item(item) => {
                // The item carries its fields encoded, as the PATCH does.
                let product = item.product().map_err(|e| {
                    undecodable = Some(e);
                    Stopped
                })?;
                let payload = shelfsync_proto::json::product_to_json(&product).to_string();
                rows.push((item.place_id, item.id, payload));
            }
            FeedEvent::Reject(_) => rejected += 1,
            FeedEvent::Place(_) => {}
        }
        Ok(())
    });
    if let Some(e) = undecodable {
        return Err(e).context("an item's fields do not decode");
    }
    parsed.with_context(|| format!("parsing {}", path.display()))?;
    if rejected > 0 {
        bail!("{}: {rejected} items rejected by the parser", path.display());
    }
    Ok(Dump::from_rows(rows, batch_rows))
}

/// What importing `after` over `before` (nothing for the first import) must change.
#[derive(Debug, Default, PartialEq)]
pub struct Diff {
    /// Keys whose payload is new or different: exactly where `updated_at` must move.
    pub changed: HashSet<Key>,
    /// Keys `before` does not have (events without a before image).
    pub new_rows: u64,
}

pub fn diff(before: Option<&Dump>, after: &Dump) -> Diff {
    let old: HashMap<(i64, &str), &str> = before
        .map(|d| d.rows().map(|(place, id, payload)| ((place, id), payload)).collect())
        .unwrap_or_default();
    let mut out = Diff::default();
    for (place, id, payload) in after.rows() {
        match old.get(&(place, id)) {
            Some(previous) if *previous == payload => {}
            Some(_) => {
                out.changed.insert((place, id.to_string()));
            }
            None => {
                out.new_rows += 1;
                out.changed.insert((place, id.to_string()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(place: i64, id: &str, payload: &str) -> (i64, String, String) {
        (place, id.to_string(), payload.to_string())
    }

    #[test]
    fn batches_hold_at_most_the_batch_size() {
        let rows = (0..2500).map(|i| row(i % 7, &format!("p{i}"), "{}"));
        let dump = Dump::from_rows(rows, 1000);
        let sizes: Vec<usize> = dump.batches.iter().map(Batch::len).collect();
        assert_eq!(sizes, [1000, 1000, 500]);
        assert_eq!(dump.records(), 2500);
        assert_eq!(dump.batches[2].ids[0], "p2000");
        assert_eq!(dump.batches[0].places[8], 1);
        assert!(Dump::from_rows(Vec::new(), 1000).batches.is_empty());
    }

    #[test]
    fn diff_finds_new_and_changed_payloads_only() {
        let base = Dump::from_rows(
            [row(1, "a", "{\"price\":1}"), row(1, "b", "{}"), row(2, "a", "{}")],
            2,
        );
        let first = diff(None, &base);
        assert_eq!(first.changed.len(), 3);
        assert_eq!(first.new_rows, 3);
        assert_eq!(diff(Some(&base), &base), Diff::default());

        let churn = Dump::from_rows(
            [row(1, "a", "{\"price\":2}"), row(1, "b", "{}"), row(2, "a", "{}"), row(3, "c", "{}")],
            1000,
        );
        let d = diff(Some(&base), &churn);
        assert_eq!(d.changed, HashSet::from([(1, "a".to_string()), (3, "c".to_string())]));
        assert_eq!(d.new_rows, 1);
        // The same product id in another place is another row.
        let moved = Dump::from_rows(
            [row(1, "a", "{\"price\":1}"), row(1, "b", "{}"), row(9, "a", "{}")],
            2,
        );
        assert_eq!(diff(Some(&base), &moved).changed, HashSet::from([(9, "a".to_string())]));
    }

    #[test]
    fn prepares_a_generated_dump_with_ingests_parser() -> anyhow::Result<()> {
        use crate::world::BRAND;
        use shelfsync_cli::genfeed::{FeedSpec, Format, Variant, write_feed};
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("feed.json");
        let spec = FeedSpec {
            brand_id: BRAND,
            places: 3,
            items_per_place: 5,
            seed: 1,
            format: Format::Json,
            variant: Variant::Full,
            churn: 0.0,
            churn_seed: 0,
        };
        write_feed(&spec, std::fs::File::create(&path)?)?;
        let dump = prepare(&path, 4)?;
        assert_eq!(dump.records(), 15);
        assert_eq!(dump.batches.len(), 4);
        let payload: serde_json::Value = serde_json::from_str(&dump.batches[0].payloads[0])?;
        for field in ["title", "price", "currency", "stock"] {
            assert!(payload.get(field).is_some(), "{field} missing from {payload}");
        }
        assert!(payload.get("id").is_none() && payload.get("place_id").is_none(), "{payload}");
        Ok(())
    }
}

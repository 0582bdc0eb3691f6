//! The parse floor: ingest's parser over a dump, each item into the feed's fields (the owned ones
//! as the PATCH carries them, `Product` wire bytes) and nothing else (no command, no batch, no
//! publish). What parsing alone costs, next to shelfsync's end
//! to end import and the PostgreSQL peer, whose input is parsed before its clock starts.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail};
use shelfsync_ingest::feed::{FeedEvent, parse_feed};
use shelfsync_ingest::item::{ItemRules, OwnedFields};
use shelfsync_settings::{FeedFormat, IngestSettings};

use crate::measure;
use crate::report::ParseFloor;
use crate::world::{BRAND, partner};

/// The item rules ingest applies to the bench's full feed.
pub fn item_rules() -> ItemRules {
    ItemRules {
        brand_id: BRAND,
        owned: OwnedFields::from_names(&partner(false).fields),
        max_item_bytes: IngestSettings::default().max_item_bytes,
    }
}

/// Parses `path` on a blocking thread; this process does nothing else meanwhile, so its CPU
/// delta is the parser's.
pub async fn measure(path: &Path) -> anyhow::Result<ParseFloor> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || parse(&path)).await?
}

fn parse(path: &Path) -> anyhow::Result<ParseFloor> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let raw_bytes = file.metadata()?.len();
    let (mut items, mut rejected) = (0u64, 0u64);
    let cpu = measure::self_cpu_seconds();
    let started = Instant::now();
    parse_feed(file, FeedFormat::Auto, &item_rules(), &mut |event| {
        match event {
            FeedEvent::Item(_) => items += 1,
            FeedEvent::Reject(_) => rejected += 1,
            FeedEvent::Place(_) => {}
        }
        Ok(())
    })
    .with_context(|| format!("parsing {}", path.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = measure::self_cpu_seconds() - cpu;
    if rejected > 0 {
        bail!("{}: {rejected} items rejected by the parser", path.display());
    }
    Ok(ParseFloor {
        records: items,
        raw_bytes,
        seconds,
        records_per_s: items as f64 / seconds,
        raw_mb_per_s: raw_bytes as f64 / 1e6 / seconds,
        cpu_s_per_m: cpu * 1e6 / items.max(1) as f64,
    })
}

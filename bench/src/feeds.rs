//! The generated dumps of a run (gen-feed's generator, feed format) and the number of
//! changes each must cause, predicted from the generator itself.

use std::path::{Path, PathBuf};

use anyhow::Context;
use shelfsync_cli::genfeed::{FeedSpec, Format, Variant, write_feed};

use crate::profile::Profile;
use crate::world::BRAND;

pub struct Feeds {
    /// The base dump.
    pub base: PathBuf,
    /// The base dump with 1% of items repriced and restocked (churn seed 1).
    pub churn: PathBuf,
    /// A price-only partial feed, 1% repriced against the base (churn seed 2).
    pub prices: PathBuf,
    /// Records whose price or stock differ between `churn` and `base`.
    pub churned: u64,
    /// Records whose price differs between `prices` and `base` (the price feed follows the
    /// re-import that brings the base back).
    pub price_changes: u64,
}

pub fn base_spec(profile: &Profile) -> FeedSpec {
    FeedSpec {
        brand_id: BRAND,
        places: profile.places,
        items_per_place: profile.items_per_place,
        seed: 42,
        format: Format::Json,
        variant: Variant::Full,
        churn: 0.0,
        churn_seed: 0,
    }
}

/// Writes `spec` to `path` on a blocking thread.
pub async fn write(
    spec: FeedSpec,
    path: PathBuf,
) -> anyhow::Result<shelfsync_cli::genfeed::FeedSummary> {
    tokio::task::spawn_blocking(move || {
        let file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        write_feed(&spec, file).with_context(|| format!("writing {}", path.display()))
    })
    .await?
}

impl Feeds {
    pub async fn generate(profile: &Profile, dir: &Path) -> anyhow::Result<Feeds> {
        let started = std::time::Instant::now();
        let base = base_spec(profile);
        let churn = FeedSpec { churn: 0.01, churn_seed: 1, ..base.clone() };
        let prices =
            FeedSpec { variant: Variant::Price, churn: 0.01, churn_seed: 2, ..base.clone() };
        let paths = [dir.join("base.json"), dir.join("churn.json"), dir.join("prices.json")];
        // Churn always moves the price, so a churned item of the price dump is a change.
        let (b, c, p) = tokio::try_join!(
            write(base, paths[0].clone()),
            write(churn, paths[1].clone()),
            write(prices, paths[2].clone()),
        )?;
        eprintln!(
            "[bench] feeds: {} items, {:.0} MB each (~{} bytes/item), generated in {:.1?}",
            b.items,
            b.bytes as f64 / 1e6,
            b.bytes / b.items.max(1),
            started.elapsed()
        );
        let [base, churn, prices] = paths;
        Ok(Feeds { base, churn, prices, churned: c.churned, price_changes: p.churned })
    }

    pub fn remove(&self) {
        for p in [&self.base, &self.churn, &self.prices] {
            let _ = std::fs::remove_file(p);
        }
    }
}

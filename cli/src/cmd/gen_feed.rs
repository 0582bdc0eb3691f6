//! `shelfsync gen-feed`: a deterministic synthetic dump on stdout or in a
//! file, with a one-line summary on stderr. The generator is
//! [`crate::genfeed`]; this is only its command line.

use std::fs::File;
use std::io;

use anyhow::Context as _;

use crate::genfeed::{self, FeedSpec, Format, Variant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Brand of every item.
    #[arg(long, default_value_t = 7)]
    brand: i64,
    /// Number of places (place ids 1..=N).
    #[arg(long, default_value_t = 100)]
    places: u32,
    /// Items per place.
    #[arg(long, default_value_t = 1000)]
    items: u32,
    /// Seed of the base values; the same arguments give the same bytes.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Feed format: one JSON document, or one item per line.
    #[arg(long, value_enum, default_value_t = Format::Json)]
    format: Format,
    /// Where to write: a file, or `-` for stdout.
    #[arg(long, default_value = "-", value_name = "FILE|-")]
    out: String,
    /// Fraction of items whose price and stock differ from the base dump of
    /// the same seed (0..=1).
    #[arg(long, default_value_t = 0.0, value_parser = fraction)]
    churn: f64,
    /// Picks which items churn; vary it for successive updates.
    #[arg(long, default_value_t = 0)]
    churn_seed: u64,
    /// Fields written: all, or those of a price-only / stock-only feed.
    #[arg(long, value_enum, default_value_t = Variant::Full)]
    variant: Variant,
}

fn fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) { Ok(v) } else { Err(format!("{v} is not between 0 and 1")) }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let spec = FeedSpec {
        brand_id: args.brand,
        places: args.places,
        items_per_place: args.items,
        seed: args.seed,
        format: args.format,
        variant: args.variant,
        churn: args.churn,
        churn_seed: args.churn_seed,
    };
    let summary = if args.out == "-" {
        genfeed::write_feed(&spec, io::stdout().lock()).context("cannot write to stdout")?
    } else {
        let file =
            File::create(&args.out).with_context(|| format!("cannot create {}", args.out))?;
        genfeed::write_feed(&spec, file).with_context(|| format!("cannot write {}", args.out))?
    };
    let target = if args.out == "-" { "stdout" } else { args.out.as_str() };
    eprintln!(
        "gen-feed: {} items in {} places, {} churned, {} bytes ({:.1} MiB) to {target}",
        summary.items,
        summary.places,
        summary.churned,
        summary.bytes,
        summary.bytes as f64 / (1024.0 * 1024.0),
    );
    Ok(())
}

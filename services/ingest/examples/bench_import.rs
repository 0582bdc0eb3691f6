//! Measures the parser alone and a whole import (real nats-server and
//! redis-server from the testkit) on a generated nested or NDJSON dump, and
//! prints items/s and the peak RSS of this process.
//!
//! `cargo run --release -p shelfsync-ingest --example bench_import -- [MB] [nested|late-brand|ndjson] [parse|import]`
//!
//! `late-brand` is the nested format with `brand_id` after `places`, which the parser
//! spools to a temporary file before parsing it.
use std::io::Write;
use std::time::Instant;

use shelfsync_ingest::feed::{FeedEvent, parse_feed};
use shelfsync_ingest::item::{ItemRules, OwnedFields};
use shelfsync_ingest::{ImportConfig, Importer, Source};
use shelfsync_settings::{FeedFormat, ImportKind, PartnerSettings, Settings};

/// Writes about `mb` MiB of feed, 10 000 items per place; returns the item count.
fn generate(
    path: &std::path::Path,
    mb: usize,
    ndjson: bool,
    late_brand: bool,
) -> std::io::Result<u64> {
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    let (mut written, mut items, mut place) = (0, 0, 0);
    match (ndjson, late_brand) {
        (true, _) => {}
        (false, false) => write!(w, r#"{{"brand_id":7,"places":["#)?,
        (false, true) => write!(w, r#"{{"places":["#)?,
    }
    while written < mb << 20 {
        if !ndjson {
            let comma = if place > 0 { "," } else { "" };
            write!(w, r#"{comma}{{"place_id":{place},"items":["#)?;
        }
        for i in 0..10_000 {
            let head =
                if ndjson { format!(r#"{{"brand_id":7,"place_id":{place},"#) } else { "{".into() };
            let comma = if ndjson || i == 0 { "" } else { "," };
            let line = format!(
                r#"{comma}{head}"id":"sku-{place}-{i}","title":"Red roses, 25 pcs","category":"roses","price":{},"old_price":399000,"currency":"RUB","stock":{},"images":["https://cdn.example/{i}.jpg"],"description":"Fresh flowers"}}{}"#,
                1000 + i,
                i % 7,
                if ndjson { "\n" } else { "" }
            );
            written += line.len();
            items += 1;
            w.write_all(line.as_bytes())?;
        }
        if !ndjson {
            write!(w, "]}}")?;
        }
        place += 1;
    }
    match (ndjson, late_brand) {
        (true, _) => {}
        (false, false) => write!(w, "]}}")?,
        (false, true) => write!(w, r#"],"brand_id":7}}"#)?,
    }
    Ok(items)
}

fn peak_rss() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM"))
        .unwrap_or("VmHWM: ?")
        .split_whitespace()
        .skip(1)
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let mb: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100);
    let ndjson = args.get(2).is_some_and(|s| s == "ndjson");
    let late_brand = args.get(2).is_some_and(|s| s == "late-brand");
    let import = args.get(3).is_some_and(|s| s == "import");
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("feed");
    let items = generate(&path, mb, ndjson, late_brand)?;
    println!("{mb} MiB, {items} items, ndjson: {ndjson}, brand after places: {late_brand}");
    let started = Instant::now();
    if !import {
        let rules = ItemRules { brand_id: 7, owned: OwnedFields::ALL, max_item_bytes: 64 * 1024 };
        let mut good = 0u64;
        let file = std::fs::File::open(&path)?;
        parse_feed(file, FeedFormat::Auto, &rules, &mut |e| {
            good += u64::from(matches!(e, FeedEvent::Item(_)));
            Ok(())
        })?;
        let secs = started.elapsed().as_secs_f64();
        println!(
            "parse: {:.0} items/s, {:.0} MiB/s, peak RSS {}",
            good as f64 / secs,
            mb as f64 / secs,
            peak_rss()
        );
        return Ok(());
    }
    let env = shelfsync_testkit::TestEnv::start().await?;
    let mut settings = Settings::default();
    (settings.nats.url, settings.nats.prefix) = (env.nats.url(), env.prefix.clone());
    (settings.redis.url, settings.redis.namespace) = (env.redis.url(), env.namespace.clone());
    settings.storage.partitions = 16;
    let client = shelfsync_bus::connect(&settings.nats, "bench", false).await?;
    let js = shelfsync_bus::jetstream(client, &settings.nats);
    shelfsync_bus::provision(&js, &settings.nats, settings.topology()).await?;
    let fields = shelfsync_proto::product_field::NAMES.map(String::from).to_vec();
    let partner = PartnerSettings {
        name: "bench".into(),
        brand_id: 7,
        kind: ImportKind::Full,
        fields,
        ..Default::default()
    };
    let importer = Importer::connect(ImportConfig::from(&settings)).await?;
    let started = Instant::now();
    let report = importer.import(&partner, Source::File(path), None).await?;
    let secs = started.elapsed().as_secs_f64();
    println!("{}", report.render());
    println!("import: {:.0} items/s, peak RSS {}", report.items as f64 / secs, peak_rss());
    Ok(())
}

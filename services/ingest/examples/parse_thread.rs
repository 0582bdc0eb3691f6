//! The work of an import's parser thread over a dump, alone, to count it
//! (e.g. `valgrind --tool=callgrind`): `parse` is the parse floor (every
//! item into its fields, nothing else), `full` adds what the thread does
//! next with each item, its command in wire bytes pushed to the batcher.
//! Every field is owned; mimalloc, as in the binaries.
//!
//! `cargo build --release -p shelfsync-ingest --example parse_thread`, then
//! `parse_thread FEED [parse|full]`.

use anyhow::Context;
use shelfsync_bus::{EncodedBatcher, command_bytes_limit};
use shelfsync_ingest::feed::{FeedEvent, parse_feed};
use shelfsync_ingest::item::{CommandContext, ItemRules, OwnedFields, to_encoded_command};
use shelfsync_settings::{FeedFormat, Settings};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().context("usage: parse_thread FEED [parse|full]")?;
    let full = args.next().is_some_and(|s| s == "full");
    let settings = Settings::default();
    let rules = ItemRules {
        brand_id: 7,
        owned: OwnedFields::ALL,
        max_item_bytes: settings.ingest.max_item_bytes,
    };
    let ctx = CommandContext {
        brand_id: 7,
        generation: 1_700_000_000_000_000,
        clear_missing: true,
        source: "parse_thread".into(),
        import_id: "parse_thread".into(),
    };
    // NATS's default max_payload, as the importer's batcher sees it.
    let mut batcher = EncodedBatcher::new(
        settings.storage.partitions,
        settings.ingest.batch_size,
        command_bytes_limit(1 << 20),
    );
    let (mut items, mut rejects, mut batches) = (0u64, 0u64, 0usize);
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    parse_feed(file, FeedFormat::Auto, &rules, &mut |event| {
        match event {
            FeedEvent::Item(item) if full => {
                items += 1;
                batches += batcher.push(to_encoded_command(&item, &ctx)).len();
            }
            FeedEvent::Item(_) => items += 1,
            FeedEvent::Reject(_) => rejects += 1,
            FeedEvent::Place(_) => {}
        }
        Ok(())
    })
    .with_context(|| format!("parsing {path}"))?;
    batches += batcher.drain().len();
    println!("{items} items, {rejects} rejected, {batches} batches");
    Ok(())
}

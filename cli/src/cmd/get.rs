//! `shelfsync get BRAND PLACE PRODUCT`: one record as storage holds it, as
//! pretty JSON with data and state decoded ([`crate::json`]).

use std::io::Write;

use anyhow::Context as _;
use shelfsync_proto::RecordKey;

use crate::{Context, json};

#[derive(Debug, clap::Args)]
pub struct Args {
    brand: i64,
    place: i64,
    product: String,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let key = RecordKey::new(args.brand, args.place, args.product);
    let store = ctx.store().await?;
    let record = store
        .get(ctx.settings.storage.partitions, &key)
        .await
        .context("cannot read the record")?
        .with_context(|| {
            format!(
                "record not found: brand {} place {} product {:?}",
                key.brand_id, key.place_id, key.product_id
            )
        })?;
    let text = serde_json::to_string_pretty(&json::record_to_json(&record))?;
    writeln!(std::io::stdout().lock(), "{text}")?;
    Ok(())
}

//! `shelfsync get BRAND PLACE PRODUCT`: one record as storage holds it, as
//! pretty JSON with data and state decoded ([`crate::json`]).
//!
//! Asked through storage's read API (`<prefix>.read.get`, any replica
//! answers), so an operator needs NATS only — no Redis password. Exit 3
//! when the record does not exist, 5 when no storage replica answers.

use std::io::Write;

use anyhow::Context as _;
use prost::Message;
use shelfsync_proto::{ReadReply, ReadRequest};

use super::rpc;
use crate::{CliError, Context, json};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Brand id of the record.
    brand: i64,
    /// Place id of the record (within the brand).
    place: i64,
    /// Product id of the record, as the partner's feed names it.
    product: String,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let request = ReadRequest {
        brand_id: args.brand,
        place_id: args.place,
        product_ids: vec![args.product.clone()],
        ..Default::default()
    };
    let client = ctx.nats().await?;
    let msg = rpc::ask(&client, ctx.subjects().read("get"), request.encode_to_vec()).await?;
    let reply =
        ReadReply::decode(msg.payload.as_ref()).context("storage sent an undecodable ReadReply")?;
    if !reply.error.is_empty() {
        return Err(rpc::refused(&reply.error));
    }
    let Some(record) = reply.records.first() else {
        return Err(CliError::NotFound(format!(
            "record not found: brand {} place {} product {:?}",
            args.brand, args.place, args.product
        ))
        .into());
    };
    let text = serde_json::to_string_pretty(&json::record_to_json(record))?;
    writeln!(std::io::stdout().lock(), "{text}")?;
    Ok(())
}

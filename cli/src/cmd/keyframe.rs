//! `shelfsync keyframe [--brand B --place P]`: ask storage to publish a
//! keyframe now and wait until it is out.
//!
//! The request goes to `<prefix>.ctl.keyframe` over core NATS; every storage
//! replica keyframes the places it owns and replies when done, so the
//! replies are gathered until `storage.replicas` have answered or the
//! timeout passes.

use std::time::Duration;

use serde_json::json;
use shelfsync_proto::{KeyframeReply, KeyframeRequest};

use super::rpc;
use crate::Context;

/// Exit 4 when fewer than `storage.replicas` replicas answered in time, 5
/// when none listens, 1 when one reported a failure.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only the place of this brand (with --place).
    #[arg(long, value_name = "B", requires = "place")]
    brand: Option<i64>,
    /// Only this place (with --brand).
    #[arg(long, value_name = "P", requires = "brand")]
    place: Option<i64>,
    /// Name of the keyframe (default `kf-<now in µs>`); every replica uses it.
    #[arg(long, value_name = "ID")]
    id: Option<String>,
    /// How long to wait for the storage replicas to finish.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Print the replies as JSON lines.
    #[arg(long)]
    json: bool,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let request = KeyframeRequest {
        // Named here so that every replica answering uses the same id.
        keyframe_id: args
            .id
            .clone()
            .unwrap_or_else(|| format!("kf-{}", chrono::Utc::now().timestamp_micros())),
        brand_id: args.brand.unwrap_or(0),
        place_id: args.place.unwrap_or(0),
    };
    let expected = ctx.settings.storage.replicas;
    let subject = ctx.subjects().ctl_keyframe();
    let is_failure = |r: &KeyframeReply| !r.error.is_empty();
    let line = |r: &KeyframeReply| render(r, args.json);
    let failed =
        rpc::print_every_reply(ctx, subject, &request, args.timeout, is_failure, line).await?;
    anyhow::ensure!(failed == 0, "{failed} of {expected} storage replicas failed the keyframe");
    Ok(())
}

fn render(reply: &KeyframeReply, json: bool) -> String {
    if json {
        json!({
            "replica": reply.replica,
            "keyframe_id": reply.keyframe_id,
            "places": reply.places,
            "records": reply.records,
            "error": (!reply.error.is_empty()).then_some(&reply.error),
        })
        .to_string()
    } else if reply.error.is_empty() {
        format!(
            "replica {}: keyframe {} published: {} places, {} records",
            reply.replica, reply.keyframe_id, reply.places, reply.records
        )
    } else {
        format!("replica {}: keyframe {} FAILED: {}", reply.replica, reply.keyframe_id, reply.error)
    }
}

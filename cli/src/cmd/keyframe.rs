//! `shelfsync keyframe [--brand B --place P]`: ask storage to publish a
//! keyframe now (DESIGN §4, §8) and wait until it is out.
//!
//! The request goes to `<prefix>.ctl.keyframe` over core NATS; every storage
//! replica keyframes the places it owns and replies when done, so the
//! replies are gathered until `storage.replicas` have answered or the
//! timeout passes.

use std::io::Write;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::StatusCode;
use futures::StreamExt;
use prost::Message;
use serde_json::json;
use shelfsync_proto::{KeyframeReply, KeyframeRequest};

use crate::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only the place of this brand (with --place).
    #[arg(long, value_name = "B", requires = "place")]
    brand: Option<i64>,
    /// Only this place (with --brand).
    #[arg(long, value_name = "P", requires = "brand")]
    place: Option<i64>,
    /// Name of the keyframe (default `kf-<now in µs>`); every replica uses it.
    #[arg(long)]
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
    let subject = ctx.subjects().ctl_keyframe();
    let client = ctx.nats().await?;
    let inbox = client.new_inbox();
    let mut replies =
        client.subscribe(inbox.clone()).await.context("cannot subscribe to the reply inbox")?;
    client
        .publish_with_reply(subject.clone(), inbox, request.encode_to_vec().into())
        .await
        .with_context(|| format!("cannot publish the keyframe request on {subject}"))?;
    client.flush().await.context("cannot flush the keyframe request")?;

    let expected = ctx.settings.storage.replicas as usize;
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut got = Vec::new();
    let mut out = std::io::stdout();
    while got.len() < expected {
        let msg = match tokio::time::timeout_at(deadline, replies.next()).await {
            Ok(Some(msg)) => msg,
            Ok(None) => anyhow::bail!("the NATS connection closed while waiting for replies"),
            Err(_) => break,
        };
        if msg.status == Some(StatusCode::NO_RESPONDERS) {
            anyhow::bail!("no storage replica is listening on {subject} (is storage running?)");
        }
        let reply = KeyframeReply::decode(msg.payload.as_ref())
            .context("a storage replica sent an undecodable KeyframeReply")?;
        let line = if args.json {
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
            format!(
                "replica {}: keyframe {} FAILED: {}",
                reply.replica, reply.keyframe_id, reply.error
            )
        };
        writeln!(out, "{line}")?;
        out.flush()?;
        got.push(reply);
    }

    let failed = got.iter().filter(|r| !r.error.is_empty()).count();
    if got.len() < expected {
        anyhow::bail!(
            "{} of {expected} storage replicas answered within {}",
            got.len(),
            humantime::format_duration(args.timeout)
        );
    }
    anyhow::ensure!(failed == 0, "{failed} of {expected} storage replicas failed the keyframe");
    Ok(())
}

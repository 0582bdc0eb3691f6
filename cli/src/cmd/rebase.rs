//! `shelfsync rebase [--partition N]... [--applied-seq N] [--drop-step]`:
//! resume the partitions storage refused.
//!
//! - Refused because their command stream was replaced (deleted and created
//!   again: its sequences restarted, so the applied sequence storage kept
//!   counts in a stream that no longer exists): each storage replica adopts
//!   the stream as it is now, taking every command up to `--applied-seq` as
//!   applied (0, the default: apply everything the new stream holds).
//! - Refused because the command message they were applying in steps (a
//!   sweep) is gone from the command stream (deleted by an operator, or
//!   lost with the stream's files): with `--drop-step`, what was left of it
//!   is dropped and the partition goes on with the messages after it; its
//!   applied sequence and stream stay.
//!
//! Every replica replies; the workers resume within seconds. A partition
//! that is not refused is left alone.

use std::time::Duration;

use serde_json::json;
use shelfsync_proto::{RebaseReply, RebaseRequest};

use super::rpc;
use crate::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only these partitions (default: every refused one).
    #[arg(long = "partition", value_name = "N")]
    partitions: Vec<u32>,
    /// Commands of the new stream up to this sequence are taken as applied
    /// (0: apply everything the new stream holds).
    #[arg(long, value_name = "SEQ", default_value_t = 0)]
    applied_seq: u64,
    /// Also resume the partitions whose half-applied message is gone,
    /// dropping what was left of it (what it already applied stays).
    #[arg(long)]
    drop_step: bool,
    /// How long to wait for every storage replica's reply.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Print the replies as JSON lines.
    #[arg(long)]
    json: bool,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let request = RebaseRequest {
        partitions: args.partitions.clone(),
        applied_seq: args.applied_seq,
        drop_step: args.drop_step,
    };
    let subject = ctx.subjects().ctl_rebase();
    let is_failure = |r: &RebaseReply| !r.error.is_empty();
    let line = |r: &RebaseReply| render(r, args.json);
    let failed =
        rpc::print_every_reply(ctx, subject, &request, args.timeout, is_failure, line).await?;
    anyhow::ensure!(failed == 0, "{failed} replicas could not re-base every partition");
    Ok(())
}

fn render(reply: &RebaseReply, json: bool) -> String {
    if json {
        return json!({
            "replica": reply.replica,
            "rebased": reply.rebased,
            "still_refused": reply.refused,
            "error": (!reply.error.is_empty()).then_some(&reply.error),
        })
        .to_string();
    }
    if reply.rebased.is_empty() && reply.refused.is_empty() && reply.error.is_empty() {
        return format!("replica {}: no partition is refused", reply.replica);
    }
    let mut t = format!("replica {}: re-based partitions {:?}", reply.replica, reply.rebased);
    if !reply.refused.is_empty() {
        t.push_str(&format!(", still refused {:?}", reply.refused));
    }
    if !reply.error.is_empty() {
        t.push_str(&format!(", error: {}", reply.error));
    }
    t
}

//! `shelfsync tail`: changes (or rejections) as JSON lines on stdout, one
//! line per `Change` / `Rejection`, until interrupted or `--limit` is
//! reached.
//!
//! Reads through an ephemeral ordered consumer: no durable state is left on
//! the server, nothing is acked, and a gap (e.g. a lost connection) makes the
//! client recreate the consumer where it stopped, so lines stay in stream
//! order.

use std::io::{self, BufWriter, Write};

use anyhow::Context as _;
use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use prost::Message;
use serde_json::Value;
use shelfsync_proto::{ChangeBatch, RejectionBatch};

use crate::{Context, json};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only this brand.
    #[arg(long, value_name = "B")]
    brand: Option<i64>,
    /// Only this place (of any brand unless --brand is given).
    #[arg(long, value_name = "P")]
    place: Option<i64>,
    /// Start from the oldest message the stream still holds instead of only
    /// new ones.
    #[arg(long)]
    from_start: bool,
    /// Exit after N lines.
    #[arg(long, value_name = "N")]
    limit: Option<u64>,
    /// Tail the REJECTS stream (refused commands and feed items) instead of
    /// CHANGES.
    #[arg(long)]
    rejects: bool,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let limit = args.limit.unwrap_or(u64::MAX);
    if limit == 0 {
        return Ok(());
    }
    let subjects = ctx.subjects();
    let (stream_name, filter) = if args.rejects {
        // Rejects are `<p>.rejects.<brand>.<place>`, like changes.
        let token = |v: Option<i64>| v.map_or_else(|| "*".to_string(), |v| v.to_string());
        (
            subjects.rejects_stream(),
            format!("{}.rejects.{}.{}", subjects.prefix(), token(args.brand), token(args.place)),
        )
    } else {
        (subjects.changes_stream(), subjects.changes_filter(args.brand, args.place))
    };

    let js = ctx.jetstream().await?;
    let stream = js.get_stream(&stream_name).await.with_context(|| {
        format!("cannot open stream {stream_name} (has `shelfsync setup` run?)")
    })?;
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: filter.clone(),
            deliver_policy: if args.from_start { DeliverPolicy::All } else { DeliverPolicy::New },
            ..Default::default()
        })
        .await
        .with_context(|| format!("cannot create a consumer on {stream_name} for {filter}"))?;
    let mut messages =
        consumer.messages().await.with_context(|| format!("cannot read {stream_name}"))?;

    let mut out = BufWriter::new(io::stdout());
    let mut printed = 0u64;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        let next = tokio::select! {
            _ = &mut interrupted => break,
            next = messages.next() => next,
        };
        let msg = next
            .with_context(|| format!("the consumer on {stream_name} ended"))?
            .with_context(|| format!("cannot read {stream_name}"))?;
        let stream_seq = msg.info().map(|i| i.stream_sequence).ok();
        let lines = match decode(&msg.payload, args.rejects) {
            Ok(lines) => lines,
            Err(e) => {
                // One bad message must not end the tail.
                eprintln!(
                    "warning: skipping undecodable message {stream_seq:?} on {}: {e}",
                    msg.subject
                );
                continue;
            }
        };
        for mut line in lines {
            if let Value::Object(m) = &mut line {
                m.insert("subject".into(), msg.subject.as_str().into());
                m.insert("stream_seq".into(), stream_seq.into());
            }
            writeln!(out, "{line}")?;
            printed += 1;
            if printed >= limit {
                out.flush()?;
                return Ok(());
            }
        }
        out.flush()?;
    }
    out.flush()?;
    Ok(())
}

/// The JSON lines of one message: a `ChangeBatch` gives one line per change
/// (with the batch's `command_seq` and `partition`) and one for a keyframe
/// marker, a `RejectionBatch` one per rejection.
fn decode(payload: &[u8], rejects: bool) -> Result<Vec<Value>, prost::DecodeError> {
    if rejects {
        let batch = RejectionBatch::decode(payload)?;
        return Ok(batch.rejections.iter().map(json::rejection_to_json).collect());
    }
    let batch = ChangeBatch::decode(payload)?;
    let changes = batch.changes.iter().map(json::change_to_json);
    let mark = batch.keyframe.as_ref().map(json::keyframe_mark_to_json);
    Ok(changes
        .chain(mark)
        .map(|mut v| {
            if let Value::Object(m) = &mut v {
                m.insert("command_seq".into(), batch.command_seq.into());
                m.insert("partition".into(), batch.partition.into());
            }
            v
        })
        .collect())
}

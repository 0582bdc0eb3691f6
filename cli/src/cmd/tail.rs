//! `shelfsync tail`: one stream's messages as JSON lines on stdout, until
//! interrupted or `--limit` is reached — changes by default, or keyframes,
//! aggregates or rejects. Like `nats sub` on a stream: start at new
//! messages, at the oldest (`--from-start`), at a time (`--since`), at a
//! sequence (`--start-seq`) or at the last N messages (`--last`); print
//! the protobuf payloads themselves with `--raw`.
//!
//! Reads through an ephemeral ordered consumer: no durable state is left on
//! the server, nothing is acked, and a gap (e.g. a lost connection) makes the
//! client recreate the consumer where it stopped, so lines stay in stream
//! order.

use std::io::{self, BufWriter, Write};

use anyhow::Context as _;
use async_nats::jetstream::consumer::{self, DeliverPolicy, pull::OrderedConfig};
use async_nats::jetstream::stream::Stream;
use base64::Engine as _;
use futures::StreamExt;
use prost::Message;
use serde_json::{Map, Value, json};
use shelfsync_proto::{AggregateChange, ChangeBatch, KeyframeBatch, RecordKey, RejectionBatch};

use super::streams;
use crate::{Context, json};

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("stream").args(["keyframes", "aggregates", "rejects"])))]
#[command(group(clap::ArgGroup::new("start").args(["from_start", "since", "start_seq", "last"])))]
pub struct Args {
    /// Only this brand (a subject filter). With --aggregates: only the
    /// category flips of the brand's places (master cards have no brand).
    #[arg(long, value_name = "B")]
    brand: Option<i64>,
    /// Only this place (of any brand unless --brand is given).
    #[arg(long, value_name = "P")]
    place: Option<i64>,
    /// Only lines about this product id (checked after decoding, so every
    /// message of the filter is still read; with --raw, a message is printed
    /// when anything in it is about the product).
    #[arg(long, value_name = "ID")]
    product: Option<String>,
    /// Start from the oldest message the stream still holds instead of only
    /// new ones.
    #[arg(long)]
    from_start: bool,
    /// Start from the messages stored since this long ago (`10m`, `2h`) or
    /// since this time (RFC 3339, `2026-05-01T08:00:00Z`).
    #[arg(long, value_name = "DURATION|RFC3339", value_parser = parse_since)]
    since: Option<time::OffsetDateTime>,
    /// Start from this stream sequence (a `stream_seq` of an earlier line).
    #[arg(long, value_name = "N")]
    start_seq: Option<u64>,
    /// Start with the last N messages of the filter (messages, not lines: a
    /// message holds a batch), then follow new ones.
    #[arg(long, value_name = "N")]
    last: Option<u64>,
    /// Exit after N lines.
    #[arg(long, value_name = "N")]
    limit: Option<u64>,
    /// Tail the REJECTS stream (refused commands and feed items, dead
    /// letters) instead of CHANGES.
    #[arg(long)]
    rejects: bool,
    /// Tail the KEYFRAMES stream: one line per record of a snapshot, and a
    /// `keyframe_end` line after its last part.
    #[arg(long)]
    keyframes: bool,
    /// Tail the AGGREGATES stream: master cards and category flips.
    #[arg(long)]
    aggregates: bool,
    /// Print each message's protobuf payload, base64-encoded (standard
    /// alphabet, padded), one message a line, instead of JSON.
    #[arg(long)]
    raw: bool,
}

/// The stream a tail reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Changes,
    Keyframes,
    Aggregates,
    Rejects,
}

fn parse_since(s: &str) -> Result<time::OffsetDateTime, String> {
    let at = match humantime::parse_duration(s) {
        Ok(ago) => {
            let ago = chrono::Duration::from_std(ago).map_err(|e| e.to_string())?;
            chrono::Utc::now() - ago
        }
        Err(_) => chrono::DateTime::parse_from_rfc3339(s)
            .map_err(|e| format!("neither a duration (`10m`) nor an RFC 3339 time: {e}"))?
            .to_utc(),
    };
    let nanos = at.timestamp_nanos_opt().ok_or("the time is out of range")?;
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(nanos)).map_err(|e| e.to_string())
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let limit = args.limit.unwrap_or(u64::MAX);
    if limit == 0 {
        return Ok(());
    }
    let kind = if args.rejects {
        Kind::Rejects
    } else if args.keyframes {
        Kind::Keyframes
    } else if args.aggregates {
        Kind::Aggregates
    } else {
        Kind::Changes
    };
    let subjects = ctx.subjects();
    let prefix = subjects.prefix();
    let token = |v: Option<i64>| v.map_or_else(|| "*".to_string(), |v| v.to_string());
    let (stream_name, filter) = match kind {
        Kind::Changes => {
            (subjects.changes_stream(), subjects.changes_filter(args.brand, args.place))
        }
        // Rejects are `<p>.rejects.<brand>.<place>`, like changes.
        Kind::Rejects => (
            subjects.rejects_stream(),
            format!("{prefix}.rejects.{}.{}", token(args.brand), token(args.place)),
        ),
        Kind::Keyframes => {
            (subjects.keyframes_stream(), subjects.keyframes_filter(args.brand, args.place))
        }
        Kind::Aggregates if args.brand.is_none() && args.place.is_none() => {
            (subjects.aggregates_stream(), subjects.aggregates_all())
        }
        Kind::Aggregates => (
            subjects.aggregates_stream(),
            format!("{prefix}.aggregates.categories.{}.{}", token(args.brand), token(args.place)),
        ),
    };

    let js = ctx.jetstream().await?;
    let stream = streams::open(&js, &stream_name).await?;
    let deliver_policy = match (&args.since, args.start_seq, args.last) {
        _ if args.from_start => DeliverPolicy::All,
        (Some(at), _, _) => DeliverPolicy::ByStartTime { start_time: *at },
        (_, Some(seq), _) => DeliverPolicy::ByStartSequence { start_sequence: seq },
        (_, _, Some(n)) => match start_of_last(&stream, &filter, n).await? {
            Some(seq) => DeliverPolicy::ByStartSequence { start_sequence: seq },
            None => DeliverPolicy::New,
        },
        _ => DeliverPolicy::New,
    };
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: filter.clone(),
            deliver_policy,
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
        let lines = match decode(&msg.payload, kind) {
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
        let lines: Vec<Value> = match &args.product {
            Some(id) => lines.into_iter().filter(|l| about_product(l, id)).collect(),
            None => lines,
        };
        if args.raw {
            if !lines.is_empty() {
                let text = base64::engine::general_purpose::STANDARD.encode(&msg.payload);
                writeln!(out, "{text}")?;
                printed += 1;
            }
        } else {
            for mut line in lines {
                if let Value::Object(m) = &mut line {
                    m.insert("subject".into(), msg.subject.as_str().into());
                    m.insert("stream_seq".into(), stream_seq.into());
                }
                writeln!(out, "{line}")?;
                printed += 1;
                if printed >= limit {
                    break;
                }
            }
        }
        out.flush()?;
        if printed >= limit {
            return Ok(());
        }
    }
    out.flush()?;
    Ok(())
}

/// Whether a decoded line is about `product`: its key, or a master card's
/// product id. A keyframe marker or end, a category flip, a rejection of an
/// item with no key are about no product.
fn about_product(line: &Value, product: &str) -> bool {
    line["key"]["product_id"].as_str() == Some(product)
        || (line["kind"] == "card" && line["product_id"].as_str() == Some(product))
}

/// The first sequence of the last `n` messages of `filter`, `None` when the
/// filter has none. Counted by the server: a consumer starting at a sequence
/// knows how many messages of its filter lie ahead (`num_pending`), so the
/// start is found by bisection, a few dozen short-lived consumers at most.
async fn start_of_last(stream: &Stream, filter: &str, n: u64) -> anyhow::Result<Option<u64>> {
    let state = &stream.cached_info().state;
    let (first, last) = (state.first_sequence.max(1), state.last_sequence);
    if n == 0 || state.messages == 0 {
        return Ok(None);
    }
    let pending_from = |seq: u64| async move {
        let config = consumer::pull::Config {
            filter_subject: filter.to_string(),
            deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: seq },
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: std::time::Duration::from_secs(5),
            memory_storage: true,
            ..Default::default()
        };
        let mut probe = stream
            .create_consumer(config)
            .await
            .with_context(|| format!("cannot count the messages of {filter}"))?;
        let pending = probe.info().await.context("cannot read a consumer's state")?.num_pending;
        let name = probe.cached_info().name.clone();
        // Best effort: the server drops an idle one after 5 s anyway.
        let _ = stream.delete_consumer(&name).await;
        anyhow::Ok(pending)
    };
    let total = pending_from(first).await?;
    if total == 0 {
        return Ok(None);
    }
    if total <= n {
        return Ok(Some(first));
    }
    // The largest `lo` with pending_from(lo) >= n: pending_from is
    // non-increasing in the sequence.
    let (mut lo, mut hi) = (first, last);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if pending_from(mid).await? >= n {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(Some(lo))
}

/// The JSON lines of one message of `kind`'s stream.
fn decode(payload: &[u8], kind: Kind) -> Result<Vec<Value>, prost::DecodeError> {
    Ok(match kind {
        Kind::Changes => changes(&ChangeBatch::decode(payload)?),
        Kind::Rejects => RejectionBatch::decode(payload)?
            .rejections
            .iter()
            .map(json::rejection_to_json)
            .collect(),
        Kind::Keyframes => keyframe(&KeyframeBatch::decode(payload)?),
        Kind::Aggregates => vec![aggregate(&AggregateChange::decode(payload)?)],
    })
}

/// One line per change (with the batch's `command_seq` and `partition`),
/// and one for a keyframe marker.
fn changes(batch: &ChangeBatch) -> Vec<Value> {
    let changes = batch.changes.iter().map(json::change_to_json);
    let mark = batch.keyframe.as_ref().map(json::keyframe_mark_to_json);
    changes
        .chain(mark)
        .map(|mut v| {
            if let Value::Object(m) = &mut v {
                m.insert("command_seq".into(), batch.command_seq.into());
                m.insert("partition".into(), batch.partition.into());
            }
            v
        })
        .collect()
}

/// One line per record of a keyframe part (the record with the keyframe's
/// id and part), then after the last part a `keyframe_end` line with the
/// snapshot's total, digest and stream positions.
fn keyframe(batch: &KeyframeBatch) -> Vec<Value> {
    let mut lines: Vec<Value> = batch
        .records
        .iter()
        .map(|r| {
            let mut v = json::record_to_json(r);
            if let Value::Object(m) = &mut v {
                m.insert("keyframe_id".into(), batch.keyframe_id.clone().into());
                m.insert("part".into(), batch.part.into());
            }
            v
        })
        .collect();
    if batch.last {
        lines.push(json!({
            "kind": "keyframe_end",
            "keyframe_id": batch.keyframe_id,
            "brand_id": batch.brand_id,
            "place_id": batch.place_id,
            "parts": batch.part + 1,
            "total": batch.total,
            "digest": batch.digest,
            "as_of": batch.as_of,
            "as_of_rfc3339": json::rfc3339_micros(batch.as_of),
            "command_seq": batch.command_seq,
            "changes_seq": batch.changes_seq,
        }));
    }
    lines
}

/// A master card (`kind: card`) or a category flip (`kind: category`).
fn aggregate(a: &AggregateChange) -> Value {
    let key = |k: &RecordKey| json!({"brand_id": k.brand_id, "place_id": k.place_id, "product_id": k.product_id});
    let mut m = Map::new();
    if let Some(c) = &a.card {
        m.insert("kind".into(), "card".into());
        m.insert("region".into(), c.region.clone().into());
        m.insert("product_id".into(), c.product_id.clone().into());
        m.insert("min_price".into(), c.min_price.into());
        m.insert("offers".into(), c.offers.into());
        m.insert("cheapest".into(), c.cheapest.as_ref().map_or(Value::Null, key));
        m.insert("currency".into(), c.currency.clone().into());
    } else if let Some(f) = &a.category {
        m.insert("kind".into(), "category".into());
        m.insert("brand_id".into(), f.brand_id.into());
        m.insert("place_id".into(), f.place_id.into());
        m.insert("category".into(), f.category.clone().into());
        m.insert("non_empty".into(), f.non_empty.into());
    } else {
        m.insert("kind".into(), Value::Null);
    }
    m.insert("at".into(), a.at.into());
    m.insert("at_rfc3339".into(), json::rfc3339_micros(a.at).into());
    Value::Object(m)
}

//! `shelfsync dead-letters`: what storage could not deliver, and putting it
//! back once the cause is fixed.
//!
//! Two kinds:
//! - outbox entries storage could not publish at all (refused as too large
//!   even split and reduced, or refused by JetStream again and again) and
//!   kept aside in Redis instead of blocking their partition (storage's read
//!   API, `<prefix>.read.dead`). `redrive` asks every storage replica
//!   (`<prefix>.ctl.redrive`) to put them back into their outbox, relayed
//!   at the partition's next message or purge tick;
//! - with `--commands`, the command messages storage dead-lettered (not
//!   decodable, or failing every delivery): rejections with reason
//!   `undecodable` or `failed` among the newest 10 000 messages of the
//!   REJECTS stream, each carrying the message as it was (cut at 128 KiB).
//!   `redrive --command SEQ` publishes that message again on its
//!   partition's command subject.

use std::io::Write;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::Stream;
use prost::Message;
use serde_json::{Value, json};
use shelfsync_bus::{Partition, TYPE_HEADER};
use shelfsync_proto::{
    ChangeBatch, CommandBatch, DeadEntriesReply, DeadEntriesRequest, DeadEntry, RedriveReply,
    RedriveRequest, Rejection, RejectionBatch, msg_type,
};

use super::{rpc, streams};
use crate::{CliError, Context, json as wire_json};

/// REJECTS messages `--commands` looks through, newest first.
const SCAN_REJECTS: u64 = 10_000;

/// Storage keeps at most this much of a dead-lettered message in its
/// rejection; a message that long may have been cut.
const MAX_RAW: usize = 128 * 1024;

/// Outbox entries asked for by `show` and `redrive` checks, per partition.
const ALL_ENTRIES: u32 = 10_000;

/// `dead-letters` alone lists; `show` decodes one, `redrive` puts back.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    action: Option<Action>,
    #[command(flatten)]
    list: ListArgs,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Decode one: an outbox entry by its message id (the ChangeBatch or
    /// RejectionBatch it holds), or with --command a dead-lettered command
    /// message by its REJECTS sequence; as pretty JSON.
    Show(ShowArgs),
    /// Put outbox entries back into their outbox (all, or those of some
    /// partitions or message ids), or with --command publish a
    /// dead-lettered command message again.
    Redrive(RedriveArgs),
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    /// Newest entries per partition.
    #[arg(long, value_name = "N", default_value_t = 100)]
    limit: u32,
    /// Also list the dead-lettered command messages from the REJECTS stream.
    #[arg(long)]
    commands: bool,
    /// Print JSON lines.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("what").args(["msg_id", "command"]).required(true)))]
struct ShowArgs {
    /// Message id of the outbox entry (as `dead-letters` lists it).
    #[arg(value_name = "MSG_ID")]
    msg_id: Option<String>,
    /// The REJECTS stream sequence of a dead-lettered command message (as
    /// `dead-letters --commands` lists it).
    #[arg(long, value_name = "SEQ")]
    command: Option<u64>,
}

#[derive(Debug, clap::Args)]
struct RedriveArgs {
    /// Outbox entries to put back (default: every entry of the partitions).
    #[arg(value_name = "MSG_ID", conflicts_with = "command")]
    msg_ids: Vec<String>,
    /// Only these partitions (default: all). With --command: the partition
    /// whose command subject to publish on, when the message does not tell.
    #[arg(long = "partition", value_name = "N")]
    partitions: Vec<u32>,
    /// Publish again the dead-lettered command message at this REJECTS
    /// sequence (refused when storage kept only a cut copy of it).
    #[arg(long, value_name = "SEQ")]
    command: Option<u64>,
    /// How long to wait for every storage replica's reply.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Print the replies as JSON lines.
    #[arg(long)]
    json: bool,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    match args.action {
        None => list(ctx, args.list).await,
        Some(Action::Show(a)) => match (a.msg_id, a.command) {
            (_, Some(seq)) => show_command(ctx, seq).await,
            (Some(id), None) => show_entry(ctx, &id).await,
            (None, None) => Err(CliError::BadInput("give MSG_ID or --command SEQ".into()).into()),
        },
        Some(Action::Redrive(a)) => match a.command {
            Some(seq) => redrive_command(ctx, seq, &a.partitions, a.json).await,
            None => redrive_entries(ctx, a).await,
        },
    }
}

async fn dead_entries(ctx: &Context, limit: u32) -> anyhow::Result<Vec<DeadEntry>> {
    let client = ctx.nats().await?;
    let req = DeadEntriesRequest { limit };
    let msg = rpc::ask(&client, ctx.subjects().read("dead"), req.encode_to_vec()).await?;
    let reply = DeadEntriesReply::decode(msg.payload.as_ref()).context("an undecodable reply")?;
    if !reply.error.is_empty() {
        return Err(rpc::refused(&reply.error));
    }
    Ok(reply.entries)
}

async fn list(ctx: &Context, args: ListArgs) -> anyhow::Result<()> {
    let entries = dead_entries(ctx, args.limit).await?;
    let mut out = std::io::stdout();
    for d in &entries {
        let Some(e) = &d.entry else { continue };
        let text = if args.json {
            json!({
                "kind": "outbox",
                "partition": d.partition,
                "subject": e.subject,
                "msg_id": e.msg_id,
                "msg_type": e.msg_type,
                "bytes": e.payload.len(),
            })
            .to_string()
        } else {
            format!(
                "outbox  partition {:>3}  {}  {}  {} ({} bytes)",
                d.partition,
                e.subject,
                e.msg_id,
                e.msg_type,
                e.payload.len()
            )
        };
        writeln!(out, "{text}")?;
    }
    if args.commands {
        let js = ctx.jetstream().await?;
        let stream = streams::open(&js, &ctx.subjects().rejects_stream()).await?;
        let last = stream.cached_info().state.last_sequence;
        // The newest messages only: the stream also holds every rejected item.
        let first =
            stream.cached_info().state.first_sequence.max(last.saturating_sub(SCAN_REJECTS));
        for seq in first..=last {
            let Ok(m) = stream.get_raw_message(seq).await else { continue };
            let Ok(batch) = RejectionBatch::decode(m.payload.as_ref()) else { continue };
            let partition = partition_of_msg_id(
                m.headers.get(async_nats::header::NATS_MESSAGE_ID).map(|v| v.as_str()),
            );
            for r in batch.rejections.iter().filter(|r| is_dead_letter(r)) {
                let text = if args.json {
                    dead_command_json(seq, partition, r).to_string()
                } else {
                    format!(
                        "command rejects seq {seq}  partition {}  {}: {} ({} raw bytes kept{})",
                        partition.map_or("?".to_string(), |p| p.to_string()),
                        r.reason,
                        r.detail,
                        r.raw.len(),
                        if is_cut(r) { ", cut" } else { "" }
                    )
                };
                writeln!(out, "{text}")?;
            }
        }
    }
    if entries.is_empty() && !args.commands && !args.json {
        writeln!(out, "no outbox entry was kept aside")?;
    }
    Ok(())
}

/// A rejection storage wrote for a command message it dead-lettered (a
/// `too_large` one of a whole message, not of one command: no key).
fn is_dead_letter(r: &Rejection) -> bool {
    r.reason == "undecodable"
        || r.reason == "failed"
        || (r.reason == "too_large" && r.key.is_none() && r.command.is_none())
}

/// Whether storage kept less than the whole message. It keeps it whole and
/// says how it is encoded (`raw_encoding`); versions before kept the first
/// 128 KiB, and less when the rejection had to be reduced to fit a message
/// (its detail says so): from them, a message of exactly 128 KiB counts as
/// cut too, as nothing tells it from a longer one.
fn is_cut(r: &Rejection) -> bool {
    if !r.raw_encoding.is_empty() {
        return false;
    }
    r.raw.len() >= MAX_RAW || r.detail.contains("[reduced to fit one message")
}

/// The plain protobuf of a dead-lettered message's raw copy (`None`: it
/// does not decode as its encoding says).
fn plain_raw(r: &Rejection) -> Option<bytes::Bytes> {
    let raw = bytes::Bytes::copy_from_slice(&r.raw);
    match r.raw_encoding.as_str() {
        "" | "none" => Some(raw),
        encoding => {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(shelfsync_bus::encoding::ENCODING_HEADER, encoding);
            shelfsync_bus::encoding::decode(Some(&headers), &raw).ok()
        }
    }
}

/// The partition in a rejection's message id: storage names the rejection
/// of a dead-lettered message `rej:<partition>:<seq>:<part>`.
fn partition_of_msg_id(msg_id: Option<&str>) -> Option<u32> {
    let mut parts = msg_id?.split(':');
    (parts.next()? == "rej").then_some(())?;
    parts.next()?.parse().ok()
}

async fn show_entry(ctx: &Context, msg_id: &str) -> anyhow::Result<()> {
    let entries = dead_entries(ctx, ALL_ENTRIES).await?;
    let Some((partition, e)) = entries
        .iter()
        .find_map(|d| d.entry.as_ref().filter(|e| e.msg_id == msg_id).map(|e| (d.partition, e)))
    else {
        return Err(CliError::NotFound(format!(
            "no outbox entry {msg_id:?} is kept aside (see `shelfsync dead-letters`)"
        ))
        .into());
    };
    let payload = match e.msg_type.as_str() {
        msg_type::CHANGE_BATCH => match ChangeBatch::decode(&e.payload[..]) {
            Ok(b) => json!({
                "partition": b.partition,
                "command_seq": b.command_seq,
                "part": b.part,
                "changes": b.changes.iter().map(wire_json::change_to_json).collect::<Vec<_>>(),
                "keyframe": b.keyframe.as_ref().map(wire_json::keyframe_mark_to_json),
            }),
            Err(err) => json!({ "error": format!("undecodable ChangeBatch: {err}") }),
        },
        msg_type::REJECTION_BATCH => match RejectionBatch::decode(&e.payload[..]) {
            Ok(b) => json!({
                "rejections": b.rejections.iter().map(wire_json::rejection_to_json).collect::<Vec<_>>(),
            }),
            Err(err) => json!({ "error": format!("undecodable RejectionBatch: {err}") }),
        },
        other => json!({ "error": format!("a payload of type {other:?} is not decoded") }),
    };
    let text = serde_json::to_string_pretty(&json!({
        "kind": "outbox",
        "partition": partition,
        "subject": e.subject,
        "msg_id": e.msg_id,
        "msg_type": e.msg_type,
        "bytes": e.payload.len(),
        "payload": payload,
    }))?;
    writeln!(std::io::stdout(), "{text}")?;
    Ok(())
}

/// A dead-lettered command message: the rejection at `seq` of REJECTS and
/// the partition it came from, when its message id tells.
async fn dead_command(stream: &Stream, seq: u64) -> anyhow::Result<(Rejection, Option<u32>)> {
    let not_found = || {
        CliError::NotFound(format!(
            "no dead-lettered command message at REJECTS sequence {seq} (see `shelfsync \
             dead-letters --commands`)"
        ))
    };
    let m = stream.get_raw_message(seq).await.map_err(|_| not_found())?;
    let batch = RejectionBatch::decode(m.payload.as_ref()).map_err(|_| not_found())?;
    let r = batch.rejections.into_iter().find(is_dead_letter).ok_or_else(not_found)?;
    let id = m.headers.get(async_nats::header::NATS_MESSAGE_ID).map(|v| v.as_str().to_string());
    Ok((r, partition_of_msg_id(id.as_deref())))
}

/// A dead-lettered command message as `dead-letters --json` lists it and
/// `--show` starts its answer.
fn dead_command_json(seq: u64, partition: Option<u32>, r: &Rejection) -> Value {
    json!({
        "kind": "command",
        "seq": seq,
        "partition": partition,
        "reason": r.reason,
        "detail": r.detail,
        "raw_bytes": r.raw.len(),
        "raw_encoding": r.raw_encoding,
        "cut": is_cut(r),
    })
}

async fn show_command(ctx: &Context, seq: u64) -> anyhow::Result<()> {
    let js = ctx.jetstream().await?;
    let stream = streams::open(&js, &ctx.subjects().rejects_stream()).await?;
    let (r, partition) = dead_command(&stream, seq).await?;
    let mut v = dead_command_json(seq, partition, &r);
    // What the message says, when it decodes (a `failed` one does).
    if let Some(batch) = plain_raw(&r).and_then(|p| CommandBatch::decode(p).ok())
        && let Value::Object(m) = &mut v
    {
        m.insert(
            "command_batch".into(),
            json!({
                "partition": batch.partition,
                "commands": batch.commands.iter().map(wire_json::command_to_json).collect::<Vec<_>>(),
                "sweeps": batch.sweeps.len(),
            }),
        );
    }
    writeln!(std::io::stdout(), "{}", serde_json::to_string_pretty(&v)?)?;
    Ok(())
}

async fn redrive_command(
    ctx: &Context,
    seq: u64,
    partitions: &[u32],
    json_out: bool,
) -> anyhow::Result<()> {
    let js = ctx.jetstream().await?;
    let stream = streams::open(&js, &ctx.subjects().rejects_stream()).await?;
    let (r, from_id) = dead_command(&stream, seq).await?;
    if r.raw.is_empty() || is_cut(&r) {
        anyhow::bail!(
            "refusing to publish REJECTS {seq} again: storage kept only {} bytes of it (a cut \
             copy), which would be applied as a different message",
            r.raw.len()
        );
    }
    let decoded = plain_raw(&r).and_then(|p| CommandBatch::decode(p).ok());
    let has_sweeps = decoded.as_ref().is_some_and(|b| !b.sweeps.is_empty());
    let from_batch = decoded.map(|b| b.partition);
    let partition = match (partitions, from_id.or(from_batch)) {
        ([p], _) => *p,
        ([], Some(p)) => p,
        ([], None) => {
            return Err(CliError::BadInput(format!(
                "REJECTS {seq} does not tell its partition: give --partition N"
            ))
            .into());
        }
        _ => return Err(CliError::BadInput("--command takes one --partition".into()).into()),
    };
    let count = ctx.settings.storage.partitions;
    if partition >= count {
        return Err(CliError::BadInput(format!(
            "partition {partition} does not exist (storage.partitions = {count})"
        ))
        .into());
    }
    let subject = ctx.subjects().cmd_for(Partition(partition), has_sweeps);
    // Named after the dead letter: the same re-drive given twice within the
    // stream's duplicate window is stored once.
    let msg_id = format!("redrive:rejects:{seq}");
    let mut publish = PublishMessage::build()
        .payload(r.raw.clone().into())
        .message_id(&msg_id)
        .header(TYPE_HEADER, msg_type::COMMAND_BATCH);
    // As it came: compressed again, with the header that says so.
    if !matches!(r.raw_encoding.as_str(), "" | "none") {
        publish = publish.header(shelfsync_bus::encoding::ENCODING_HEADER, r.raw_encoding.as_str());
    }
    let ack = js
        .send_publish(subject.clone(), publish)
        .await
        .with_context(|| format!("cannot publish on {subject}"))?
        .await
        .with_context(|| format!("JetStream did not take the message on {subject}"))?;
    let text = if json_out {
        json!({
            "seq": seq,
            "partition": partition,
            "subject": subject,
            "cmd_seq": ack.sequence,
            "duplicate": ack.duplicate,
        })
        .to_string()
    } else if ack.duplicate {
        format!(
            "REJECTS {seq} was published again already (CMD seq {}): nothing done",
            ack.sequence
        )
    } else {
        format!(
            "REJECTS {seq}: {} bytes published again on {subject} (CMD seq {})",
            r.raw.len(),
            ack.sequence
        )
    };
    writeln!(std::io::stdout(), "{text}")?;
    Ok(())
}

async fn redrive_entries(ctx: &Context, args: RedriveArgs) -> anyhow::Result<()> {
    let request =
        RedriveRequest { partitions: args.partitions.clone(), msg_ids: args.msg_ids.clone() };
    let expected = ctx.settings.storage.replicas;
    let mut redriven = 0;
    let subject = ctx.subjects().ctl_redrive();
    let is_failure = |r: &RedriveReply| !r.error.is_empty();
    let line = |reply: &RedriveReply| {
        redriven += reply.redriven;
        render_redrive(reply, args.json)
    };
    let failed =
        rpc::print_every_reply(ctx, subject, &request, args.timeout, is_failure, line).await?;
    anyhow::ensure!(failed == 0, "{failed} of {expected} storage replicas failed the redrive");
    if redriven == 0 && !args.msg_ids.is_empty() {
        return Err(CliError::NotFound(format!(
            "none of {} is kept aside (see `shelfsync dead-letters`)",
            args.msg_ids.join(", ")
        ))
        .into());
    }
    Ok(())
}

fn render_redrive(reply: &RedriveReply, json: bool) -> String {
    if json {
        json!({
            "replica": reply.replica,
            "redriven": reply.redriven,
            "error": (!reply.error.is_empty()).then_some(&reply.error),
        })
        .to_string()
    } else if reply.error.is_empty() {
        format!("replica {}: {} entries put back into their outbox", reply.replica, reply.redriven)
    } else {
        format!(
            "replica {}: {} entries put back, error: {}",
            reply.replica, reply.redriven, reply.error
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_comes_from_storage_message_ids() {
        assert_eq!(partition_of_msg_id(Some("rej:3:17:0")), Some(3));
        assert_eq!(partition_of_msg_id(Some("chg:3:17:0")), None);
        assert_eq!(partition_of_msg_id(Some("rej:x")), None);
        assert_eq!(partition_of_msg_id(None), None);
    }

    #[test]
    fn a_copy_at_the_limit_or_reduced_is_cut() {
        let r = |raw: usize, detail: &str| Rejection {
            reason: "failed".into(),
            detail: detail.into(),
            raw: vec![1; raw],
            ..Default::default()
        };
        assert!(!is_cut(&r(100, "failed 5 times")));
        assert!(is_cut(&r(MAX_RAW, "failed 5 times")));
        assert!(is_cut(&r(100, "x [reduced to fit one message: 9 bytes of input left out]")));
        // Kept whole, and saying so: never cut, whatever its size.
        let whole = Rejection { raw_encoding: "lz4".into(), ..r(4 * MAX_RAW, "too_large") };
        assert!(!is_cut(&whole));
    }
}

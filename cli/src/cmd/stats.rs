//! `shelfsync stats`: stream sizes, storage lag per partition, outbox depth
//! per partition, and what flowed in and out — as a table or JSON.
//!
//! Honest about what the servers can tell: the CMD stream is a work queue,
//! so acked command batches are gone and only its `last_seq` (messages ever
//! published) survives; neither stream counts the records inside its
//! messages. So "in" is command *messages* and "out" is change *messages*
//! and bytes, labelled as such.

use std::collections::BTreeMap;

use anyhow::Context as _;
use async_nats::jetstream::{self, context::ConsumerInfoErrorKind};
use futures::{StreamExt, TryStreamExt, stream};
use serde::Serialize;
use shelfsync_bus::Partition;

use super::streams::{self, StreamState};
use crate::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Requests in flight at once when asking about every partition.
const CONCURRENCY: usize = 16;

#[derive(Debug, Serialize)]
struct Report {
    prefix: String,
    partitions: u32,
    /// By role (`cmd`, `changes`, `rejects`, ...); null when the stream is
    /// missing.
    streams: BTreeMap<String, Option<StreamState>>,
    /// Roles in creation order, for the table.
    #[serde(skip)]
    roles: Vec<String>,
    /// Storage consumers that exist, by partition.
    storage_consumers: Vec<ConsumerLag>,
    /// Partitions whose outbox is not empty.
    outbox: Vec<OutboxDepth>,
    flow: Flow,
}

#[derive(Debug, Serialize)]
struct ConsumerLag {
    partition: u32,
    name: String,
    /// Command messages not yet delivered to the storage worker.
    num_pending: u64,
    /// Delivered, not yet acked (being applied, or to be redelivered).
    num_ack_pending: u64,
    /// `num_pending + num_ack_pending`, in command messages.
    lag: u64,
}

#[derive(Debug, Serialize)]
struct OutboxDepth {
    partition: u32,
    /// Change messages committed in Redis and not yet published.
    entries: u64,
}

#[derive(Debug, Serialize)]
struct Flow {
    /// CMD `last_seq`: command messages (batches of up to 1000 commands)
    /// ever published.
    command_messages_published: u64,
    /// CMD `messages`: command messages not yet acked by storage.
    command_messages_queued: u64,
    /// CHANGES `last_seq`: change messages (batches) ever published.
    change_messages_published: u64,
    /// CHANGES `messages` / `bytes`: what the stream still holds (it ages
    /// out after `nats.changes_max_age`).
    change_messages_retained: u64,
    change_bytes_retained: u64,
    /// REJECTS `last_seq`.
    reject_messages_published: u64,
    /// Sum of the storage consumers' lag, in command messages.
    storage_lag: u64,
    /// Sum of the outbox depths, in change messages.
    outbox_entries: u64,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let js = ctx.jetstream().await?;
    let subjects = ctx.subjects();
    let partitions = ctx.settings.storage.partitions;

    let mut streams_by_role = BTreeMap::new();
    let mut roles = Vec::new();
    for (role, name) in streams::names(&ctx.settings) {
        streams_by_role.insert(role.clone(), streams::state(&js, &name).await?);
        roles.push(role);
    }

    let storage_consumers = if streams_by_role.get("cmd").is_some_and(Option::is_some) {
        let cmd =
            js.get_stream(subjects.cmd_stream()).await.context("cannot open the command stream")?;
        consumer_lags(&cmd, partitions).await?
    } else {
        Vec::new()
    };

    let store = ctx.store().await?;
    let outbox: Vec<OutboxDepth> = stream::iter(0..partitions)
        .map(|p| {
            let store = store.clone();
            async move {
                let entries = store
                    .outbox_len(Partition(p))
                    .await
                    .with_context(|| format!("cannot read the outbox of partition {p}"))?;
                anyhow::Ok(OutboxDepth { partition: p, entries })
            }
        })
        .buffered(CONCURRENCY)
        .try_filter(|o| std::future::ready(o.entries > 0))
        .try_collect()
        .await?;

    let get = |role: &str, f: fn(&StreamState) -> u64| {
        streams_by_role.get(role).and_then(Option::as_ref).map_or(0, f)
    };
    let flow = Flow {
        command_messages_published: get("cmd", |s| s.last_seq),
        command_messages_queued: get("cmd", |s| s.messages),
        change_messages_published: get("changes", |s| s.last_seq),
        change_messages_retained: get("changes", |s| s.messages),
        change_bytes_retained: get("changes", |s| s.bytes),
        reject_messages_published: get("rejects", |s| s.last_seq),
        storage_lag: storage_consumers.iter().map(|c| c.lag).sum(),
        outbox_entries: outbox.iter().map(|o| o.entries).sum(),
    };
    let report = Report {
        prefix: ctx.settings.nats.prefix.clone(),
        partitions,
        streams: streams_by_role,
        roles,
        storage_consumers,
        outbox,
        flow,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

/// Lag of every storage consumer that exists on the command stream.
async fn consumer_lags(
    cmd: &jetstream::stream::Stream,
    partitions: u32,
) -> anyhow::Result<Vec<ConsumerLag>> {
    // Each storage replica reads a partition with a consumer of its own
    // (`storage-p<N>-r<replica>`): every one there is listed.
    let names: Vec<String> = cmd.consumer_names().try_collect().await?;
    let mut owned: Vec<(u32, String)> = names
        .into_iter()
        .filter_map(|n| {
            let p = shelfsync_bus::Subjects::partition_of_storage_consumer(&n)?;
            (p.0 < partitions).then_some((p.0, n))
        })
        .collect();
    owned.sort();
    let found: Vec<Option<ConsumerLag>> = stream::iter(owned)
        .map(|(p, name)| async move {
            match cmd.consumer_info(&name).await {
                Ok(info) => Ok(Some(ConsumerLag {
                    partition: p,
                    name,
                    num_pending: info.num_pending,
                    num_ack_pending: info.num_ack_pending as u64,
                    lag: info.num_pending + info.num_ack_pending as u64,
                })),
                Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => Ok(None),
                Err(e) => Err(e).with_context(|| format!("cannot read consumer {name}")),
            }
        })
        .buffered(CONCURRENCY)
        .try_collect()
        .await?;
    Ok(found.into_iter().flatten().collect())
}

fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "prefix `{}`, {} command partitions", r.prefix, r.partitions);
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<10} {:<28} {:>12} {:>14} {:>12} {:>12} {:>9}",
        "stream", "name", "messages", "bytes", "first_seq", "last_seq", "consumers"
    );
    for role in &r.roles {
        match r.streams.get(role).and_then(Option::as_ref) {
            Some(st) => {
                let _ = writeln!(
                    s,
                    "{:<10} {:<28} {:>12} {:>14} {:>12} {:>12} {:>9}",
                    role, st.name, st.messages, st.bytes, st.first_seq, st.last_seq, st.consumers
                );
            }
            None => {
                let _ = writeln!(s, "{role:<10} missing (run `shelfsync setup`)");
            }
        }
    }

    let _ = writeln!(s);
    let lagging: Vec<_> = r.storage_consumers.iter().filter(|c| c.lag > 0).collect();
    let _ = writeln!(
        s,
        "storage consumers: {} of {} partitions have one; {} lagging (lag = pending + ack pending, in command messages)",
        r.storage_consumers.len(),
        r.partitions,
        lagging.len()
    );
    for c in lagging {
        let _ = writeln!(
            s,
            "  p{:<5} {:<16} pending {:>10}  ack pending {:>8}  lag {:>10}",
            c.partition, c.name, c.num_pending, c.num_ack_pending, c.lag
        );
    }

    let _ = writeln!(
        s,
        "outbox: {} entries in {} partitions (changes committed in Redis, not yet published)",
        r.flow.outbox_entries,
        r.outbox.len()
    );
    for o in &r.outbox {
        let _ = writeln!(s, "  p{:<5} {:>10} entries", o.partition, o.entries);
    }

    let f = &r.flow;
    let _ = writeln!(s);
    let _ = writeln!(s, "flow (messages are batches; the streams do not count records):");
    let rows: [(&str, u64); 7] = [
        ("command messages ever published (CMD last_seq)", f.command_messages_published),
        ("command messages queued, not yet acked (CMD now)", f.command_messages_queued),
        ("change messages ever published (CHANGES last_seq)", f.change_messages_published),
        ("change messages retained (CHANGES now)", f.change_messages_retained),
        ("change bytes retained (CHANGES now)", f.change_bytes_retained),
        ("reject messages ever published (REJECTS last_seq)", f.reject_messages_published),
        ("storage lag, command messages", f.storage_lag),
    ];
    for (label, value) in rows {
        let _ = writeln!(s, "  {label:<52} {value:>14}");
    }
    s
}

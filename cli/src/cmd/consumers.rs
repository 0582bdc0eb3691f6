//! `shelfsync consumers`: every consumer of every shelfsync stream, as
//! JetStream itself keeps it (one `CONSUMER.LIST` page after another per
//! stream: each consumer's info), as a table or JSON.
//!
//! What a consumer says of itself (`shelfsync_consumer_lag`, the kit's
//! counters) needs the consumer to be alive and scraped; a stalled, dead or
//! forgotten consumer says nothing. The server's view does not depend on
//! it: messages not yet delivered, delivered and not acked, redeliveries,
//! and when the consumer last got a message and last acked one. A consumer
//! whose pending grows while its last activity gets older is stuck or gone
//! (the kit's per-instance consumers expire after an hour without a pull).

use std::collections::BTreeMap;

use anyhow::Context as _;
use async_nats::jetstream::consumer;
use futures::TryStreamExt;
use serde::Serialize;

use super::streams;
use crate::{CliError, Context};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only the consumers of this stream: its role (`changes`, `cmd`,
    /// `keyframes`, ...) or its name (`SHELFSYNC_CHANGES`).
    #[arg(long, value_name = "STREAM")]
    stream: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// One consumer, as the server reports it.
#[derive(Debug, Serialize)]
struct ConsumerState {
    /// The stream's role (`changes`, `cmd`, ...) and name.
    role: String,
    stream: String,
    name: String,
    /// Durable (kept with no one pulling, until `inactive_threshold`) or
    /// ephemeral.
    durable: bool,
    filter_subjects: Vec<String>,
    /// Messages of the filter not yet delivered.
    pending: u64,
    /// Delivered, not yet acked (in the consumer's hands, or to be
    /// redelivered after `ack_wait`).
    ack_pending: u64,
    /// Messages delivered more than once (their ack did not come in time,
    /// or they were nak'd).
    redelivered: u64,
    /// Pull requests waiting for messages: 0 when nobody is pulling.
    waiting: u64,
    /// Stream sequence of the last message delivered, and of the ack floor
    /// (every message up to it acked).
    delivered_seq: u64,
    ack_floor_seq: u64,
    /// When the last message was delivered, and when the ack floor last
    /// moved (RFC 3339, UTC); null: never.
    last_delivered: Option<String>,
    last_acked: Option<String>,
    /// Seconds since then, as of this report.
    last_delivered_ago_s: Option<f64>,
    last_acked_ago_s: Option<f64>,
    created: String,
    /// Seconds without a pull after which the server deletes the consumer
    /// (null: never).
    inactive_threshold_s: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    prefix: String,
    /// Streams that do not exist (`shelfsync setup` has not run).
    missing_streams: Vec<String>,
    consumers: Vec<ConsumerState>,
}

pub async fn run(ctx: &Context, args: Args) -> anyhow::Result<()> {
    let js = ctx.jetstream().await?;
    let now = time::OffsetDateTime::now_utc();
    let mut consumers = Vec::new();
    let mut missing_streams = Vec::new();
    let names = streams::names(&ctx.settings);
    let wanted: Vec<&(String, String)> = names
        .iter()
        .filter(|(role, name)| {
            args.stream.as_deref().is_none_or(|s| s.eq_ignore_ascii_case(role) || s == name)
        })
        .collect();
    if wanted.is_empty() {
        let known: Vec<&str> = names.iter().map(|(role, _)| role.as_str()).collect();
        return Err(CliError::BadInput(format!(
            "no stream {:?}: one of {}, or its name",
            args.stream.unwrap_or_default(),
            known.join(", ")
        ))
        .into());
    }
    for (role, name) in wanted.iter().copied() {
        let stream = match js.get_stream(name).await {
            Ok(s) => s,
            Err(e) if streams::is_not_found(&e) => {
                missing_streams.push(name.clone());
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("cannot open stream {name}")),
        };
        let infos: Vec<consumer::Info> = stream
            .consumers()
            .try_collect()
            .await
            .with_context(|| format!("cannot list the consumers of {name}"))?;
        consumers.extend(infos.into_iter().map(|i| state_of(role, i, now)));
    }
    if missing_streams.len() == wanted.len() {
        return Err(CliError::NotFound(format!(
            "none of the streams exists ({}): has `shelfsync setup` run with these settings?",
            missing_streams.join(", ")
        ))
        .into());
    }
    // In creation order of the streams, then by name with numbers in
    // numeric order (storage-p2 before storage-p10).
    let order = |stream: &str| names.iter().position(|(_, n)| n == stream);
    consumers.sort_by(|a, b| {
        (order(&a.stream), natural(&a.name)).cmp(&(order(&b.stream), natural(&b.name)))
    });
    let report = Report { prefix: ctx.settings.nats.prefix.clone(), missing_streams, consumers };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

fn state_of(role: &str, info: consumer::Info, now: time::OffsetDateTime) -> ConsumerState {
    let ago = |t: Option<time::OffsetDateTime>| t.map(|t| (now - t).as_seconds_f64().max(0.0));
    let (delivered_at, acked_at) = (info.delivered.last_active, info.ack_floor.last_active);
    let mut filter_subjects = info.config.filter_subjects.clone();
    if !info.config.filter_subject.is_empty() {
        filter_subjects.insert(0, info.config.filter_subject.clone());
    }
    ConsumerState {
        role: role.to_string(),
        stream: info.stream_name,
        name: info.name,
        durable: info.config.durable_name.is_some(),
        filter_subjects,
        pending: info.num_pending,
        ack_pending: info.num_ack_pending as u64,
        redelivered: info.num_redelivered as u64,
        waiting: info.num_waiting as u64,
        delivered_seq: info.delivered.stream_sequence,
        ack_floor_seq: info.ack_floor.stream_sequence,
        last_delivered: delivered_at.map(rfc3339),
        last_acked: acked_at.map(rfc3339),
        last_delivered_ago_s: ago(delivered_at),
        last_acked_ago_s: ago(acked_at),
        created: rfc3339(info.created),
        inactive_threshold_s: Some(info.config.inactive_threshold)
            .filter(|d| !d.is_zero())
            .map(|d| d.as_secs_f64()),
    }
}

/// A name as runs of text and numbers, numbers compared as numbers.
fn natural(name: &str) -> Vec<(String, u128)> {
    let mut out = Vec::new();
    let mut rest = name;
    while !rest.is_empty() {
        let text_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let (text, tail) = rest.split_at(text_len);
        let digits_len = tail.find(|c: char| !c.is_ascii_digit()).unwrap_or(tail.len());
        let (digits, tail) = tail.split_at(digits_len);
        out.push((text.to_string(), digits.parse().unwrap_or(u128::MAX)));
        rest = tail;
    }
    out
}

/// `t` as RFC 3339 in UTC, to the millisecond.
fn rfc3339(t: time::OffsetDateTime) -> String {
    let nanos = t.unix_timestamp_nanos();
    let (secs, sub) = (nanos.div_euclid(1_000_000_000), nanos.rem_euclid(1_000_000_000));
    chrono::DateTime::from_timestamp(secs as i64, sub as u32)
        .map(|d| d.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| t.to_string())
}

/// An age for the table: `never`, `4s ago`, `3m ago`, `2h ago`, `5d ago`.
fn age(seconds: Option<f64>) -> String {
    let Some(s) = seconds else { return "never".into() };
    let s = s.round() as u64;
    match s {
        0..120 => format!("{s}s ago"),
        120..7200 => format!("{}m ago", s / 60),
        7200..172_800 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86_400),
    }
}

fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let mut per_stream: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &r.consumers {
        *per_stream.entry(c.stream.as_str()).or_default() += 1;
    }
    let _ = writeln!(
        s,
        "prefix `{}`: {} consumers ({})",
        r.prefix,
        r.consumers.len(),
        per_stream.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
    );
    for m in &r.missing_streams {
        let _ = writeln!(s, "stream {m} missing (run `shelfsync setup`)");
    }
    if r.consumers.is_empty() {
        return s;
    }
    let width = r.consumers.iter().map(|c| c.name.len()).max().unwrap_or(8).max(8);
    let _ = writeln!(
        s,
        "{:<10} {:<width$} {:>10} {:>11} {:>11} {:>7}  {:<14} {:<14} kind",
        "stream",
        "consumer",
        "pending",
        "ack pending",
        "redelivered",
        "waiting",
        "last delivered",
        "last acked",
    );
    for c in &r.consumers {
        let _ = writeln!(
            s,
            "{:<10} {:<width$} {:>10} {:>11} {:>11} {:>7}  {:<14} {:<14} {}",
            c.role,
            c.name,
            c.pending,
            c.ack_pending,
            c.redelivered,
            c.waiting,
            age(c.last_delivered_ago_s),
            age(c.last_acked_ago_s),
            if c.durable { "durable" } else { "ephemeral" },
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(None), "never");
        assert_eq!(age(Some(0.4)), "0s ago");
        assert_eq!(age(Some(119.0)), "119s ago");
        assert_eq!(age(Some(600.0)), "10m ago");
        assert_eq!(age(Some(3.0 * 3600.0)), "3h ago");
        assert_eq!(age(Some(3.0 * 86_400.0)), "3d ago");
        let t = time::OffsetDateTime::from_unix_timestamp_nanos(1_700_000_000_123_456_789)
            .expect("a time");
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.123Z");
    }

    #[test]
    fn numbers_in_names_sort_as_numbers() {
        let mut names = vec!["storage-p10", "storage-p2", "picks-a", "storage-p1", "aggregator"];
        names.sort_by_key(|n| natural(n));
        assert_eq!(names, ["aggregator", "picks-a", "storage-p1", "storage-p2", "storage-p10"]);
    }
}

//! The two references a re-import is measured against, each run in a child process on the same
//! servers, consuming the same command batches (ingest publishes the same dump under another
//! prefix) the way storage consumes them — `shelfsync_bus::intake`: two consumers per partition
//! without acks, the messages applied in stream order one at a time, what was applied purged — and
//! with the same Redis connection type and key layout:
//!
//! - **floor**: only what cannot be avoided — decode the batch, read the records it touches, their
//!   generations inside (one pipelined round trip: `HMGET` records per place, and the records of a
//!   swept place for its census), then append the ids a full import carried to its
//!   touched set (one `APPEND` per place, as storage does) and write the records that do not
//!   exist yet, in one `MULTI`. No merge, no change detection, no outbox.
//! - **naive**: what shelfsync replaces — rewrite every record (its generation inside), and
//!   republish every record as a change, at every import.
//!
//! Counters answer on `<prefix>.bench.stats` (core NATS request/reply).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream;
use futures::StreamExt;
use prost::Message;
use redis::Value;
use shelfsync_bus::intake::{Intake, Up};
use shelfsync_bus::{Partition, Publisher, Subjects, command_bytes_limit};
use shelfsync_proto::{Change, ChangeBatch, ChangeKind, Command, CommandBatch, Record, msg_type};
use shelfsync_settings::Settings;
use shelfsync_storage::client::Keys;
use shelfsync_storage::client::RedisConn;

/// Which reference loop a child runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefKind {
    Floor,
    Naive,
}

impl RefKind {
    pub fn name(self) -> &'static str {
        match self {
            RefKind::Floor => "floor",
            RefKind::Naive => "naive",
        }
    }
}

pub fn stats_subject(prefix: &str) -> String {
    format!("{prefix}.bench.stats")
}

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    commands: AtomicU64,
    changes_out: AtomicU64,
    bytes_out: AtomicU64,
    errors: AtomicU64,
}

impl Counters {
    fn to_json(&self) -> serde_json::Value {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "batches": g(&self.batches),
            "commands": g(&self.commands),
            "changes": g(&self.changes_out),
            "change_bytes": g(&self.bytes_out),
            "errors": g(&self.errors),
        })
    }
}

/// Everything one partition loop shares.
struct Ctx {
    kind: RefKind,
    settings: Settings,
    subjects: Subjects,
    js: jetstream::Context,
    redis: RedisConn,
    counters: Counters,
    max_bytes: usize,
}

/// Runs the reference loop of `kind` until SIGTERM (or the parent kills it).
pub async fn run(kind: RefKind, settings: Settings) -> anyhow::Result<()> {
    let client = shelfsync_bus::connect(&settings.nats, kind.name(), false).await?;
    let js = shelfsync_bus::jetstream(client.clone(), &settings.nats);
    shelfsync_bus::provision(&js, &settings.nats, settings.topology()).await?;
    let redis = RedisConn::connect(&settings.redis).await.context("connecting to Redis")?;
    let max_bytes = command_bytes_limit(client.server_info().max_payload);
    let ctx = Arc::new(Ctx {
        kind,
        subjects: Subjects::new(&settings.nats.prefix),
        settings,
        js,
        redis,
        counters: Counters::default(),
        max_bytes,
    });
    let mut tasks = tokio::task::JoinSet::new();
    for p in 0..ctx.settings.storage.partitions {
        let ctx = ctx.clone();
        tasks.spawn(async move { partition_loop(ctx, Partition(p)).await });
    }
    let mut stats = client.subscribe(stats_subject(&ctx.settings.nats.prefix)).await?;
    let shutdown = shelfsync_storage::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            Some(done) = tasks.join_next() => {
                done??;
                anyhow::bail!("a partition loop ended");
            }
            Some(msg) = stats.next() => {
                if let Some(reply) = msg.reply {
                    let body = serde_json::to_vec(&ctx.counters.to_json())?;
                    client.publish(reply, body.into()).await?;
                }
            }
        }
    }
}

async fn partition_loop(ctx: Arc<Ctx>, partition: Partition) -> anyhow::Result<()> {
    let stream = ctx.js.get_stream(ctx.subjects.cmd_stream()).await?;
    let name = format!("{}-p{}", ctx.kind.name(), partition.0);
    let names = [name.clone(), format!("{name}-sweeps")];
    let subjects = [ctx.subjects.cmd(partition), ctx.subjects.cmd_sweep(partition)];
    let mut intake = Intake::bind(&stream, names, subjects, 0).await?;
    let mut publisher = Publisher::new(ctx.js.clone(), ctx.settings.nats.max_inflight);
    let mut seq = 0u64;
    loop {
        if intake.purge_due() {
            intake.purge(&stream).await?;
        }
        if !intake.has_pending() {
            intake.next().await?;
        }
        intake.take_ready(64);
        let up = intake.up(&stream).await.map_err(|e| anyhow::anyhow!(e))?;
        if up == Up::Wait {
            intake.next().await?;
            continue;
        }
        // One message at a time, as storage with read_ahead 0.
        let Some(pulled) = intake.group(up).first() else { continue };
        let applied = pulled.seq;
        seq += 1;
        // The same wire as storage's: ingest sends the batches compressed.
        let msg = &pulled.msg;
        let result = match shelfsync_bus::encoding::decode(msg.headers.as_ref(), &msg.payload) {
            Err(e) => Err(anyhow::Error::from(e)),
            Ok(plain) => match ctx.kind {
                RefKind::Floor => floor_batch(&ctx, partition, &plain).await,
                RefKind::Naive => naive_batch(&ctx, partition, seq, &plain, &mut publisher).await,
            },
        };
        match result {
            Ok(()) => intake.done(up, 1, applied),
            Err(e) => {
                // Tried again in place, as storage does.
                eprintln!("{} p{}: batch failed: {e:#}", ctx.kind.name(), partition.0);
                ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Commands of a batch by place, in order.
fn by_place(batch: &CommandBatch) -> BTreeMap<(i64, i64), Vec<&Command>> {
    let mut out: BTreeMap<(i64, i64), Vec<&Command>> = BTreeMap::new();
    for c in &batch.commands {
        let k = c.key.as_ref().map_or((0, 0), |k| (k.brand_id, k.place_id));
        out.entry(k).or_default().push(c);
    }
    out
}

fn product_id(c: &Command) -> &str {
    c.key.as_ref().map_or("", |k| k.product_id.as_str())
}

fn count(ctx: &Ctx, batch: &CommandBatch) {
    ctx.counters.batches.fetch_add(1, Ordering::Relaxed);
    ctx.counters.commands.fetch_add(batch.commands.len() as u64, Ordering::Relaxed);
}

async fn floor_batch(ctx: &Ctx, partition: Partition, payload: &[u8]) -> anyhow::Result<()> {
    let batch = CommandBatch::decode(payload)?;
    let keys = Keys::new(&ctx.settings.redis.namespace, partition);
    let places = by_place(&batch);
    let mut read = redis::pipe();
    for ((b, p), cmds) in &places {
        let ids: Vec<&str> = cmds.iter().map(|c| product_id(c)).collect();
        read.cmd("HMGET").arg(keys.records((*b, *p).into())).arg(&ids);
    }
    for s in &batch.sweeps {
        read.cmd("HGETALL").arg(keys.records(s.place()));
    }
    let mut conn = ctx.redis.clone();
    let values: Vec<Value> = read.query_async(&mut conn).await?;
    let mut values = values.into_iter();
    let mut write = redis::pipe();
    write.atomic();
    let mut writes = 0;
    for ((b, p), cmds) in &places {
        let records: Vec<Option<Vec<u8>>> =
            redis::from_redis_value(values.next().unwrap_or(Value::Nil))?;
        let mut carried: BTreeMap<i64, Vec<&str>> = BTreeMap::new();
        let mut new_records: Vec<Vec<u8>> = Vec::new();
        for (c, existing) in cmds.iter().zip(records) {
            if c.generation != 0 {
                carried.entry(c.generation).or_default().push(product_id(c));
            }
            if existing.is_none() {
                new_records.push(product_id(c).as_bytes().to_vec());
                new_records.push(c.data.clone());
            }
        }
        // What the import carried, as storage keeps it: one APPEND per place.
        for (generation, ids) in carried {
            let blob = shelfsync_storage::client::touched_set::encode(ids);
            write.cmd("APPEND").arg(keys.touched((*b, *p).into(), generation)).arg(blob).ignore();
            writes += 1;
        }
        if !new_records.is_empty() {
            write.cmd("HSET").arg(keys.records((*b, *p).into())).arg(new_records).ignore();
            writes += 1;
        }
    }
    if writes > 0 {
        let _: () = write.query_async(&mut conn).await?;
    }
    count(ctx, &batch);
    Ok(())
}

async fn naive_batch(
    ctx: &Ctx,
    partition: Partition,
    seq: u64,
    payload: &[u8],
    publisher: &mut Publisher,
) -> anyhow::Result<()> {
    let batch = CommandBatch::decode(payload)?;
    let keys = Keys::new(&ctx.settings.redis.namespace, partition);
    let places = by_place(&batch);
    let now = chrono::Utc::now().timestamp_micros();
    // Rewrite every record of the batch, its generation inside.
    let mut write = redis::pipe();
    write.atomic();
    for ((b, p), cmds) in &places {
        let mut records = Vec::with_capacity(cmds.len() * 2);
        for c in cmds {
            let record = Record {
                data: c.data.clone(),
                generation: c.generation,
                created_at: now,
                updated_at: now,
                ..Default::default()
            };
            records.push(product_id(c).as_bytes().to_vec());
            records.push(record.encode_to_vec());
        }
        write.cmd("HSET").arg(keys.records((*b, *p).into())).arg(records).ignore();
    }
    if !places.is_empty() {
        let mut conn = ctx.redis.clone();
        let _: () = write.query_async(&mut conn).await?;
    }
    // Republish every record, per place, in messages of at most 1000 under the payload limit.
    let mut part = 0u32;
    for ((b, p), cmds) in &places {
        let mut changes: Vec<Change> = Vec::new();
        let mut size = 16;
        for c in cmds {
            let change = Change {
                key: c.key.clone(),
                before: None,
                after: Some(Record {
                    key: c.key.clone(),
                    data: c.data.clone(),
                    generation: c.generation,
                    created_at: now,
                    updated_at: now,
                    ..Default::default()
                }),
                kind: ChangeKind::Updated as i32,
                origin: batch.origin_of(c).cloned(),
                ..Default::default()
            };
            let len = change.encoded_len() + 6;
            if !changes.is_empty() && (size + len > ctx.max_bytes || changes.len() >= 1000) {
                publish_changes(
                    ctx,
                    partition,
                    seq,
                    &mut part,
                    (*b, *p),
                    std::mem::take(&mut changes),
                    publisher,
                )
                .await?;
                size = 16;
            }
            size += len;
            changes.push(change);
        }
        if !changes.is_empty() {
            publish_changes(ctx, partition, seq, &mut part, (*b, *p), changes, publisher).await?;
        }
    }
    publisher.flush().await?;
    count(ctx, &batch);
    Ok(())
}

async fn publish_changes(
    ctx: &Ctx,
    partition: Partition,
    seq: u64,
    part: &mut u32,
    (b, p): (i64, i64),
    changes: Vec<Change>,
    publisher: &mut Publisher,
) -> anyhow::Result<()> {
    let n = changes.len() as u64;
    let payload = ChangeBatch {
        changes,
        partition: partition.0,
        command_seq: seq,
        part: *part,
        ..Default::default()
    }
    .encode_to_vec();
    let len = payload.len() as u64;
    let msg_id = format!("naive:{}:{}:{seq}:{part}", std::process::id(), partition.0);
    *part += 1;
    publisher
        .publish(ctx.subjects.changes(b, p), msg_id, msg_type::CHANGE_BATCH, None, payload.into())
        .await?;
    ctx.counters.changes_out.fetch_add(n, Ordering::Relaxed);
    ctx.counters.bytes_out.fetch_add(len, Ordering::Relaxed);
    Ok(())
}

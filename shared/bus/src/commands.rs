//! The command publisher every producer shares: commands handed over one at
//! a time, by any number of callers, go out coalesced.
//!
//! A server that fsyncs every write pays one fsync per stored message, so a
//! service that publishes one command per message (a validator judging one
//! record, a service pushing one price) is held to the disk's fsync rate.
//! The publisher groups what is waiting into one `CommandBatch` per
//! partition, and — on a stream that allows it — all those batches into one
//! atomic batch, which the server stores in one go:
//!
//! - **no added wait when idle**: the first command after a quiet spell is
//!   sent at once;
//! - **under load**, commands that arrive while a flush is in flight wait
//!   for it (at most `max_delay`, then a second flush goes out beside it, up
//!   to `max_inflight`), so the batches grow with the load and the cost per
//!   command falls;
//! - **order**: a command is sent after every command handed over before it
//!   (one task, one queue), so two commands on one record keep their order;
//!   flushes are committed in order;
//! - **durability**: [`CommandPublisher::publish`] returns once JetStream
//!   stored the command (its flush's acknowledgement); a flush whose answer
//!   is lost is sent again with the same message ids, which JetStream's
//!   duplicate window drops.
//!
//! Each flush's messages are named `<producer>:<flush>:<i>`, the producer a
//! random id of this publisher.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream;
use prost::Message;
use shelfsync_proto::{Command, msg_type};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tracing::warn;

use crate::atomic::{BatchMessage, MAX_ATOMIC_BATCH, publish_atomic};
use crate::{CommandBatcher, Subjects, TYPE_HEADER};

/// Commands one flush takes at most.
const MAX_FLUSH_COMMANDS: usize = 10_000;

/// How a [`CommandPublisher`] flushes.
#[derive(Debug, Clone)]
pub struct CommandPublisherConfig {
    /// Partitions of the command stream (`storage.partitions`).
    pub partitions: u32,
    /// Largest command message payload (`command_bytes_limit`).
    pub max_bytes: usize,
    /// Longest a command waits for a flush in flight before another one
    /// goes out beside it.
    pub max_delay: Duration,
    /// Flushes in flight at most.
    pub max_inflight: usize,
    /// Commands waiting at most: a caller beyond it waits for room.
    pub queue: usize,
    /// One atomic batch per flush (the command stream must allow atomic
    /// publishing); otherwise one publish per batch, acknowledged together
    /// (the default: nats-server 2.14 fsyncs each message of an atomic batch
    /// as it does separate ones, docs/PERFORMANCE.md).
    pub atomic: bool,
    /// How long a flush waits for its acknowledgement before it is sent
    /// again.
    pub timeout: Duration,
    /// The `Nats-Msg-Id` of a message from its commands (say, ids that
    /// name each decision, so that a decision published twice within the
    /// duplicate window is stored once); by default `<producer>:<flush>:<i>`.
    pub id_of: Option<fn(&[Command]) -> String>,
}

impl CommandPublisherConfig {
    /// The defaults for a stream of `partitions` and a server of
    /// `max_payload`.
    pub fn new(partitions: u32, max_payload: usize) -> Self {
        Self {
            partitions,
            max_bytes: crate::command_bytes_limit(max_payload),
            max_delay: Duration::from_millis(2),
            max_inflight: 4,
            queue: 100_000,
            atomic: false,
            timeout: Duration::from_secs(10),
            id_of: None,
        }
    }
}

/// Why a command was not stored.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommandPublishError {
    /// JetStream refused its flush for good (too large, a permission, a
    /// stream misconfigured); a refusal for room is retried, not reported.
    #[error("the command stream refused the command: {0}")]
    Refused(String),
    #[error("the command publisher has stopped")]
    Stopped,
}

struct Job {
    command: Command,
    done: oneshot::Sender<Result<(), CommandPublishError>>,
    queued: Instant,
}

/// Coalescing command publisher (module docs). Cheap to clone; the flushing
/// task stops when every clone is dropped, after sending what it holds.
#[derive(Clone)]
pub struct CommandPublisher {
    tx: mpsc::Sender<Job>,
    counts: Arc<Counts>,
}

/// What a [`CommandPublisher`] sent.
#[derive(Debug, Default)]
pub struct Counts {
    pub commands: AtomicU64,
    /// Command messages stored.
    pub messages: AtomicU64,
    /// Messages JetStream already had (a flush sent again, or an id given
    /// by `id_of` seen before): dropped by its duplicate window.
    pub duplicates: AtomicU64,
    pub flushes: AtomicU64,
}

impl CommandPublisher {
    /// Starts the flushing task.
    pub fn start(
        client: async_nats::Client,
        js: jetstream::Context,
        subjects: Subjects,
        config: CommandPublisherConfig,
    ) -> Self {
        let (tx, rx) = mpsc::channel(config.queue.max(1));
        let counts = Arc::<Counts>::default();
        let producer = producer_id();
        let flusher =
            Flusher { client, js, subjects, producer, flushes: 0, config, counts: counts.clone() };
        tokio::spawn(flusher.run(rx));
        Self { tx, counts }
    }

    /// What it sent so far.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Hands `command` over and waits until JetStream stored it.
    pub async fn publish(&self, command: Command) -> Result<(), CommandPublishError> {
        self.submit(command).await?.await.unwrap_or(Err(CommandPublishError::Stopped))
    }

    /// Hands `command` over; the receiver resolves once it is stored (to
    /// pipeline many without waiting for each).
    pub async fn submit(
        &self,
        command: Command,
    ) -> Result<oneshot::Receiver<Result<(), CommandPublishError>>, CommandPublishError> {
        let (done, stored) = oneshot::channel();
        let job = Job { command, done, queued: Instant::now() };
        self.tx.send(job).await.map_err(|_| CommandPublishError::Stopped)?;
        Ok(stored)
    }
}

struct Flusher {
    client: async_nats::Client,
    js: jetstream::Context,
    subjects: Subjects,
    producer: String,
    flushes: u64,
    config: CommandPublisherConfig,
    counts: Arc<Counts>,
}

/// One flush: its messages and who waits for them.
struct Flush {
    messages: Vec<BatchMessage>,
    waiting: Vec<oneshot::Sender<Result<(), CommandPublishError>>>,
    counts: Arc<Counts>,
}

impl Flusher {
    async fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut inflight: JoinSet<()> = JoinSet::new();
        let mut open = true;
        loop {
            // Take what is there without waiting.
            while let Ok(job) = rx.try_recv() {
                waiting.push_back(job);
            }
            let idle = inflight.is_empty();
            let overdue =
                waiting.front().is_some_and(|j| j.queued.elapsed() >= self.config.max_delay);
            if !waiting.is_empty()
                && (idle || (overdue && inflight.len() < self.config.max_inflight))
            {
                let flush = self.flush(&mut waiting);
                inflight.spawn(send(
                    self.client.clone(),
                    self.js.clone(),
                    self.config.clone(),
                    flush,
                ));
                continue;
            }
            if !open && waiting.is_empty() && inflight.is_empty() {
                return;
            }
            // Wait for a command, a flush to end, or the oldest to be due.
            let due = waiting.front().map(|j| j.queued + self.config.max_delay);
            tokio::select! {
                job = rx.recv(), if open => match job {
                    Some(job) => waiting.push_back(job),
                    None => open = false,
                },
                Some(_) = inflight.join_next(), if !inflight.is_empty() => {}
                _ = sleep_until(due), if due.is_some() && inflight.len() < self.config.max_inflight => {}
            }
        }
    }

    /// Everything waiting, as one batch per partition (split by count and
    /// size), in order.
    fn flush(&mut self, waiting: &mut VecDeque<Job>) -> Flush {
        let mut batcher = CommandBatcher::new(self.config.partitions, 1000, self.config.max_bytes);
        let mut batches = Vec::new();
        let mut waiters = Vec::new();
        // A flush holds at most a few full batches' worth: a caller's wait
        // stays bounded however deep the queue.
        while waiters.len() < MAX_FLUSH_COMMANDS
            && let Some(job) = waiting.pop_front()
        {
            batches.extend(batcher.push(job.command));
            waiters.push(job.done);
        }
        batches.extend(batcher.drain());
        self.flushes += 1;
        self.counts.flushes.fetch_add(1, Ordering::Relaxed);
        self.counts.commands.fetch_add(waiters.len() as u64, Ordering::Relaxed);
        let messages = batches
            .into_iter()
            .enumerate()
            .map(|(i, (p, batch))| {
                let mut headers = HeaderMap::new();
                headers.insert(TYPE_HEADER, msg_type::COMMAND_BATCH);
                let id = match self.config.id_of {
                    Some(id_of) => id_of(&batch.commands),
                    None => format!("{}:{}:{i}", self.producer, self.flushes),
                };
                headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
                shelfsync_telemetry::inject(&mut headers);
                BatchMessage {
                    subject: self.subjects.cmd(p),
                    headers,
                    payload: batch.encode_to_vec().into(),
                }
            })
            .collect();
        Flush { messages, waiting: waiters, counts: self.counts.clone() }
    }
}

/// Sends one flush until it is stored (or refused for good), then tells
/// everyone waiting for it.
async fn send(
    client: async_nats::Client,
    js: jetstream::Context,
    config: CommandPublisherConfig,
    flush: Flush,
) {
    let mut delay = Duration::from_millis(50);
    let result = loop {
        let attempt = if config.atomic {
            send_atomic(&client, &flush.messages, config.timeout).await
        } else {
            send_each(&js, &flush.messages).await
        };
        match attempt {
            Ok(duplicates) => {
                let c = &flush.counts;
                c.messages.fetch_add(flush.messages.len() as u64, Ordering::Relaxed);
                c.duplicates.fetch_add(duplicates, Ordering::Relaxed);
                break Ok(());
            }
            Err(Attempt::Refused(e)) => break Err(CommandPublishError::Refused(e)),
            Err(Attempt::Again(e)) => {
                warn!(error = %e, retry_in = ?delay, "command flush not stored; sending it again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    };
    for done in flush.waiting {
        let _ = done.send(result.clone());
    }
}

enum Attempt {
    /// Not stored for good: reported to the callers.
    Refused(String),
    /// Maybe not stored, and worth sending again (same ids).
    Again(String),
}

/// Sends the flush's messages as atomic batches; `Ok`: how many were
/// duplicates.
async fn send_atomic(
    client: &async_nats::Client,
    messages: &[BatchMessage],
    timeout: Duration,
) -> Result<u64, Attempt> {
    let mut duplicates = 0;
    for chunk in messages.chunks(MAX_ATOMIC_BATCH) {
        match publish_atomic(client, chunk.to_vec(), timeout).await {
            Ok(_) => {}
            // Sent before, its answer lost: stored.
            Err(e) if e.is_duplicate() => duplicates += chunk.len() as u64,
            Err(e @ crate::atomic::AtomicError::Refused { code: 400, .. })
            | Err(e @ crate::atomic::AtomicError::TooLarge(_)) => {
                return Err(Attempt::Refused(e.to_string()));
            }
            Err(e) => return Err(Attempt::Again(e.to_string())),
        }
    }
    Ok(duplicates)
}

/// Sends the flush's messages one publish each, acknowledged together;
/// `Ok`: how many were duplicates.
async fn send_each(js: &jetstream::Context, messages: &[BatchMessage]) -> Result<u64, Attempt> {
    use async_nats::jetstream::context::PublishErrorKind as K;
    let failed = |e: async_nats::jetstream::context::PublishError| match e.kind() {
        K::MaxPayloadExceeded => Attempt::Refused(e.to_string()),
        _ => match refusal(&e) {
            Some(400) => Attempt::Refused(e.to_string()),
            _ => Attempt::Again(e.to_string()),
        },
    };
    let mut acks = Vec::with_capacity(messages.len());
    for m in messages {
        let ack = js
            .publish_with_headers(m.subject.clone(), m.headers.clone(), m.payload.clone())
            .await
            .map_err(failed)?;
        acks.push(ack);
    }
    let mut duplicates = 0;
    for ack in acks {
        duplicates += u64::from(ack.await.map_err(failed)?.duplicate);
    }
    Ok(duplicates)
}

/// The HTTP-like code of a JetStream refusal (400: the message's own fault;
/// 503: room, or the server), if JetStream answered at all.
fn refusal(e: &async_nats::jetstream::context::PublishError) -> Option<usize> {
    let api = std::error::Error::source(e)?.downcast_ref::<async_nats::jetstream::Error>()?;
    Some(api.code())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// A random id of this publisher, for its message ids.
fn producer_id() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = xxhash_rust::xxh3::xxh3_64(
        &[now.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat(),
    );
    format!("cp-{mixed:016x}")
}

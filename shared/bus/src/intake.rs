//! How a partition's command messages come in, and go once applied: what
//! storage consumes the command stream with (and the benchmark's references,
//! so that they pay what storage pays).
//!
//! The command stream keeps every message until storage purges it (limits
//! retention): nothing is acked. Each owner of a partition reads it with two
//! consumers of its own, one on the command subject and one on the sweep
//! subject (`storage-p<N>-r<replica>-<instance>` and `…-sweeps`), created when it binds
//! at the partition's applied sequence + 1, without acks: so that it
//! receives every message of the partition once, and a purge of one subject
//! never moves the other's consumer (JetStream moves a consumer filtering on
//! several subjects to the end of a subject purged empty, past what it had
//! not delivered of the others). What the owner applied it purges, by
//! subject, up to its applied sequence: one request and one write on the
//! server for many messages, where an ack per message costs a stored
//! tombstone — and an fsync — each (docs/PERFORMANCE.md).
//!
//! The two subjects are applied in stream order: the next message is the
//! lowest sequence of the two, once the server confirms (a get of the
//! other subject's next message) that no lower one of the other subject is
//! still on its way. A message that fails is kept and tried again in place,
//! never skipped: the next one waits behind it.
//!
//! Two owners of a partition for a while (a rescale with a stale split)
//! each receive every message; the commit's fence lets one apply each, and
//! the other skips it by its sequence.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use async_nats::jetstream::stream::{DirectGetErrorKind, RawMessageErrorKind};
use async_nats::jetstream::{self, consumer::pull};
use futures::{FutureExt, StreamExt};

/// How long a bind waits for a new consumer's leader at most.
const LEADER_WAIT: Duration = Duration::from_secs(10);
/// Messages and bytes one pull brings at most: bounded memory per
/// partition, and enough to commit many together under load.
const PULL_MESSAGES: usize = 64;
const PULL_BYTES: usize = 4 * 1024 * 1024;
/// Under load, the applied part of the stream is purged this often at most;
/// idle, at once.
const PURGE_EVERY: Duration = Duration::from_millis(250);
/// An owner's consumers outlive a process gone without removing them this
/// long (a live one pulls every few seconds).
const INACTIVE_THRESHOLD: Duration = Duration::from_secs(60);

/// Why the server could not say what comes next.
pub type NextError = Box<dyn std::error::Error + Send + Sync>;

/// One message pulled and not applied yet.
pub struct Pulled {
    pub msg: jetstream::Message,
    pub seq: u64,
    /// Attempts to apply it that failed (its dead-lettering counts these).
    pub attempts: u64,
}

/// What to apply next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Up {
    /// The first `n` command messages pulled (none of the sweep subject
    /// comes between them).
    Commands(usize),
    /// The first sweep message pulled.
    Sweep,
    /// A message of the other subject comes first and is still on its way.
    Wait,
}

/// One of the partition's subjects: its consumer and what it pulled.
struct Feed {
    subject: String,
    consumer: jetstream::consumer::PullConsumer,
    messages: pull::Stream,
    buffer: VecDeque<Pulled>,
    /// Messages of it were applied since its last purge.
    dirty: bool,
}

impl Feed {
    fn push(&mut self, msg: jetstream::Message) {
        if let Ok(info) = msg.info() {
            let seq = info.stream_sequence;
            self.buffer.push_back(Pulled { msg, seq, attempts: 0 });
        }
    }

    /// A pull stream that failed is replaced with a new one, which asks
    /// again: async-nats keeps counting the failed request's messages as
    /// on their way and asks no more (a first pull that met no responders,
    /// the consumer's interest not yet across a cluster's routes, left a
    /// partition idle until it was bound again, 12 s later).
    async fn pull_again(&mut self) {
        match pull(&self.consumer).await {
            Ok(messages) => self.messages = messages,
            Err(e) => tracing::debug!(subject = %self.subject, error = %e, "cannot pull again yet"),
        }
    }

    fn front(&self) -> Option<u64> {
        self.buffer.front().map(|p| p.seq)
    }

    /// Takes in what has been pulled already, without waiting.
    fn take_ready(&mut self, limit: usize) {
        while self.buffer.len() < limit {
            match self.messages.next().now_or_never() {
                Some(Some(Ok(msg))) => self.push(msg),
                _ => return,
            }
        }
    }
}

/// The partition's two consumers, what they pulled and what was purged.
pub struct Intake {
    commands: Feed,
    sweeps: Feed,
    /// The partition's applied sequence as far as this owner knows.
    applied: u64,
    last_purge: Instant,
}

/// The consumer config of an owner's consumer of `subject`, starting after
/// `applied`.
fn consumer_config(name: String, subject: String, applied: u64) -> pull::Config {
    pull::Config {
        description: Some(format!("shelfsync storage, {subject}")),
        // Durable, so that it is removed by the server once its owner is
        // gone for `INACTIVE_THRESHOLD`.
        durable_name: Some(name),
        filter_subject: subject,
        deliver_policy: match applied {
            0 => jetstream::consumer::DeliverPolicy::All,
            n => jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: n + 1 },
        },
        ack_policy: jetstream::consumer::AckPolicy::None,
        inactive_threshold: INACTIVE_THRESHOLD,
        // Nothing rests on its state: the position is Redis's. It is still
        // replicated like the stream, so that it outlives the loss of a
        // node: an unreplicated one lost with its node left its partition
        // waiting until a rebind, which timed out while the cluster was one
        // node short (tests/tests/cluster.rs).
        memory_storage: true,
        ..Default::default()
    }
}

/// On a cluster, a consumer just created answers pulls once its own Raft
/// group has elected a leader: a pull sent before meets no responders, or
/// nobody (bounded; a pull that fails is asked again anyway).
async fn wait_for_leader(consumer: &mut jetstream::consumer::PullConsumer) {
    let deadline = Instant::now() + LEADER_WAIT;
    loop {
        let elected = match consumer.info().await {
            Ok(info) => info.cluster.as_ref().is_none_or(|c| c.leader.is_some()),
            Err(_) => false,
        };
        if elected || Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn pull(
    consumer: &jetstream::consumer::PullConsumer,
) -> Result<pull::Stream, jetstream::consumer::StreamError> {
    consumer
        .stream()
        .max_messages_per_batch(PULL_MESSAGES)
        .max_bytes_per_batch(PULL_BYTES)
        .expires(crate::PULL_EXPIRES)
        .heartbeat(crate::PULL_HEARTBEAT)
        .messages()
        .await
}

/// Why an intake could not start.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("cannot create consumer {name}: {source}")]
    Create { name: String, source: jetstream::stream::ConsumerError },
    #[error("cannot pull: {0}")]
    Pull(#[from] jetstream::consumer::StreamError),
}

impl Intake {
    /// Creates the consumers `names` of the command and sweep subjects
    /// (`subjects`, in that order) afresh at `applied` + 1 — consumers of
    /// these names from before go first: their position is not the
    /// caller's — and starts pulling from them.
    pub async fn bind(
        stream: &jetstream::stream::Stream,
        names: [String; 2],
        subjects: [String; 2],
        applied: u64,
    ) -> Result<Intake, BindError> {
        let create = |name: String, subject: String| async move {
            // Not there is the usual case; anything else shows at the create.
            let _ = stream.delete_consumer(&name).await;
            let config = consumer_config(name.clone(), subject, applied);
            let mut consumer = stream
                .create_consumer(config)
                .await
                .map_err(|source| BindError::Create { name, source })?;
            wait_for_leader(&mut consumer).await;
            Ok::<_, BindError>(consumer)
        };
        let [command_name, sweep_name] = names;
        let [commands, sweeps] = subjects;
        let command_consumer = create(command_name, commands.clone()).await?;
        let sweep_consumer = create(sweep_name, sweeps.clone()).await?;
        let feed = |subject, consumer, messages| Feed {
            subject,
            consumer,
            messages,
            buffer: VecDeque::new(),
            // What an earlier owner applied may not have been purged (it
            // stopped in between): purged at the first chance.
            dirty: true,
        };
        let (command_messages, sweep_messages) =
            (pull(&command_consumer).await?, pull(&sweep_consumer).await?);
        Ok(Intake {
            commands: feed(commands, command_consumer, command_messages),
            sweeps: feed(sweeps, sweep_consumer, sweep_messages),
            applied,
            last_purge: Instant::now(),
        })
    }

    pub fn has_pending(&self) -> bool {
        !self.commands.buffer.is_empty() || !self.sweeps.buffer.is_empty()
    }

    /// Waits for the next message of either subject and keeps it.
    /// A pull that failed is asked again before the error is returned.
    pub async fn next(&mut self) -> Result<(), pull::MessagesError> {
        let (commands, sweeps) = (&mut self.commands, &mut self.sweeps);
        let failed = tokio::select! {
            m = commands.messages.next() => match m {
                Some(Ok(msg)) => {
                    commands.push(msg);
                    return Ok(());
                }
                Some(Err(e)) => (commands, e),
                None => std::future::pending().await,
            },
            m = sweeps.messages.next() => match m {
                Some(Ok(msg)) => {
                    sweeps.push(msg);
                    return Ok(());
                }
                Some(Err(e)) => (sweeps, e),
                None => std::future::pending().await,
            },
        };
        let (feed, e) = failed;
        feed.pull_again().await;
        Err(e)
    }

    /// Takes in what has been pulled already, without waiting.
    pub fn take_ready(&mut self, limit: usize) {
        self.commands.take_ready(limit);
        self.sweeps.take_ready(limit);
    }

    /// What comes next in stream order. With messages of one subject only
    /// in hand, the server says whether one of the other subject comes
    /// before them (a message stored later has a higher sequence than every
    /// one in hand). A replicated stream is asked through its leader: a
    /// follower answers direct gets and may not have the newest message yet.
    pub async fn up(&self, stream: &jetstream::stream::Stream) -> Result<Up, NextError> {
        let after = self.applied + 1;
        let replicated = stream.cached_info().config.num_replicas > 1;
        let next_of = |subject: &str| {
            let subject = subject.to_string();
            async move {
                if replicated {
                    let asked =
                        stream.raw_message_builder().sequence(after).next_by_subject(subject);
                    return match asked.send().await {
                        Ok(m) => Ok(Some(m.sequence)),
                        Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
                        Err(e) => Err(NextError::from(e)),
                    };
                }
                match stream.direct_get_next_for_subject(subject, Some(after)).await {
                    Ok(m) => Ok(Some(m.sequence)),
                    Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(None),
                    Err(e) => Err(NextError::from(e)),
                }
            }
        };
        let below = |limit: u64| self.commands.buffer.iter().take_while(|p| p.seq < limit).count();
        Ok(match (self.commands.front(), self.sweeps.front()) {
            (None, None) => Up::Wait,
            (Some(c), Some(w)) if c < w => Up::Commands(below(w)),
            (Some(_), Some(_)) => Up::Sweep,
            (Some(c), None) => match next_of(&self.sweeps.subject).await? {
                None => Up::Commands(self.commands.buffer.len()),
                Some(w) if w < c => Up::Wait,
                Some(w) => Up::Commands(below(w)),
            },
            (None, Some(w)) => match next_of(&self.commands.subject).await? {
                Some(c) if c < w => Up::Wait,
                _ => Up::Sweep,
            },
        })
    }

    /// The messages `up` names, in order.
    pub fn group(&mut self, up: Up) -> &[Pulled] {
        match up {
            Up::Commands(n) => &self.commands.buffer.make_contiguous()[..n],
            Up::Sweep => &self.sweeps.buffer.make_contiguous()[..1],
            Up::Wait => &[],
        }
    }

    /// The first message of what `up` names failed once more.
    pub fn failed(&mut self, up: Up) {
        let buffer = match up {
            Up::Commands(_) => &mut self.commands.buffer,
            Up::Sweep => &mut self.sweeps.buffer,
            Up::Wait => return,
        };
        if let Some(p) = buffer.front_mut() {
            p.attempts += 1;
        }
    }

    /// The first `taken` messages of what `up` names were applied (or
    /// skipped: applied before), the partition standing at `applied`.
    pub fn done(&mut self, up: Up, taken: usize, applied: u64) {
        let buffer = match up {
            Up::Commands(_) => &mut self.commands.buffer,
            Up::Sweep => &mut self.sweeps.buffer,
            Up::Wait => return,
        };
        buffer.drain(..taken.min(buffer.len()));
        self.applied = self.applied.max(applied);
        match up {
            Up::Sweep => self.sweeps.dirty = true,
            _ => self.commands.dirty = true,
        }
    }

    /// Whether the applied part of the stream should be purged now: idle
    /// (nothing pending), or not for a while.
    pub fn purge_due(&self) -> bool {
        let dirty = self.commands.dirty || self.sweeps.dirty;
        dirty
            && self.applied > 0
            && (!self.has_pending() || self.last_purge.elapsed() >= PURGE_EVERY)
    }

    /// Purges what was applied from each subject (a purge of one subject
    /// moves its own consumer only, past nothing it has not delivered: all
    /// of it below the applied sequence is applied).
    pub async fn purge(
        &mut self,
        stream: &jetstream::stream::Stream,
    ) -> Result<(), jetstream::stream::PurgeError> {
        let upto = self.applied;
        for feed in [&mut self.commands, &mut self.sweeps] {
            if feed.dirty {
                stream.purge().filter(feed.subject.as_str()).sequence(upto + 1).await?;
                feed.dirty = false;
            }
        }
        self.last_purge = Instant::now();
        Ok(())
    }
}

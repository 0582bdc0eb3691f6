//! The feed handler: judges each update, publishes the resulting CAS
//! commands in batches on the place's command partition, and returns only
//! once JetStream has stored them — the kit acks the change message after
//! that, so a crash in between means a redelivery, and the redelivered
//! decisions carry the same message ids (dropped as duplicates).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prost::Message;
use shelfsync_bus::{CommandBatcher, Publisher, Subjects, command_bytes_limit};
use shelfsync_feed::{Handler, HandlerError, Update};
use shelfsync_proto::{Command, CommandBatch, msg_type, now_us};
use shelfsync_settings::{NatsSettings, Topology};
use tracing::{Instrument, debug, info_span};

use crate::decide::{Decision, batch_id, decide};
use crate::rules::Rules;

/// Largest payload assumed before the server said its own.
const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// What the validator did (readiness, metrics, tests).
#[derive(Debug, Default)]
pub struct Stats {
    /// Updates judged (state-only, deleted and absent ones included).
    pub judged: AtomicU64,
    /// Hide commands stored in the command stream (a decision published
    /// again after a redelivery counts again, and in `duplicates`).
    pub hides: AtomicU64,
    pub unhides: AtomicU64,
    /// Command messages JetStream already had (dropped by its duplicate
    /// window: a decision published twice).
    pub duplicates: AtomicU64,
}

impl Stats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// The validator as a [`Handler`] of the change feed.
pub struct Validator {
    rules: Arc<Rules>,
    client: async_nats::Client,
    subjects: Subjects,
    partitions: u32,
    publisher: Publisher,
    stats: Arc<Stats>,
}

impl Validator {
    pub fn new(
        client: async_nats::Client,
        nats: &NatsSettings,
        topology: Topology,
        rules: Arc<Rules>,
        stats: Arc<Stats>,
    ) -> Self {
        let js = shelfsync_bus::jetstream(client.clone(), nats);
        Self {
            rules,
            client,
            subjects: Subjects::new(&nats.prefix),
            partitions: topology.partitions,
            publisher: Publisher::new(js, nats.max_inflight),
            stats,
        }
    }

    /// How many rules judge each change.
    pub fn rules(&self) -> usize {
        self.rules.len()
    }

    /// The commands these updates call for, in update order.
    pub fn commands(&self, updates: &[Update], now_us: i64) -> Vec<(Decision, Command)> {
        updates
            .iter()
            .filter_map(|u| {
                let d = decide(&self.rules, u);
                let cmd = d.command(u, now_us)?;
                debug!(
                    brand_id = u.key.brand_id,
                    place_id = u.key.place_id,
                    product_id = %u.key.product_id,
                    updated_at = u.after.updated_at,
                    decision = ?d,
                    "decided"
                );
                Some((d, cmd))
            })
            .collect()
    }

    /// Publishes commands batched per partition and waits until JetStream
    /// stored every batch.
    pub async fn publish(
        &mut self,
        commands: Vec<(Decision, Command)>,
    ) -> Result<(), HandlerError> {
        let (mut hides, mut unhides) = (0, 0);
        let max_payload = match self.client.server_info().max_payload {
            0 => DEFAULT_MAX_PAYLOAD,
            n => n,
        };
        let max_bytes = command_bytes_limit(max_payload);
        let mut batcher = CommandBatcher::new(self.partitions, 1000, max_bytes);
        let mut batches: Vec<(shelfsync_bus::Partition, CommandBatch)> = Vec::new();
        for (d, cmd) in commands {
            match d {
                Decision::Hide { .. } => hides += 1,
                Decision::Unhide => unhides += 1,
                Decision::Nothing => {}
            }
            batches.extend(batcher.push(cmd));
        }
        batches.extend(batcher.drain());
        if batches.is_empty() {
            return Ok(());
        }
        let before = self.publisher.duplicates;
        let transient = |e: shelfsync_bus::PublishFailed| HandlerError::Transient(e.to_string());
        for (partition, batch) in batches {
            let id = batch_id(&batch.commands);
            let subject = self.subjects.cmd(partition);
            let span = shelfsync_telemetry::send_span!(
                "validator.send",
                self.subjects.template(&subject),
                subject,
                shelfsync.command_count = batch.commands.len()
            );
            self.publisher
                .publish(subject, id, msg_type::COMMAND_BATCH, None, batch.encode_to_vec().into())
                .instrument(span)
                .await
                .map_err(transient)?;
        }
        self.publisher.flush().await.map_err(transient)?;
        self.stats.hides.fetch_add(hides, Ordering::Relaxed);
        self.stats.unhides.fetch_add(unhides, Ordering::Relaxed);
        metrics::counter!(shelfsync_telemetry::names::VALIDATOR_DECISIONS, "decision" => "hide")
            .increment(hides);
        metrics::counter!(shelfsync_telemetry::names::VALIDATOR_DECISIONS, "decision" => "unhide")
            .increment(unhides);
        self.stats.duplicates.fetch_add(self.publisher.duplicates - before, Ordering::Relaxed);
        Ok(())
    }
}

impl Handler for Validator {
    async fn apply(&mut self, updates: &[Update]) -> Result<(), HandlerError> {
        let span = info_span!("validator.apply", updates = updates.len(), commands = 0usize);
        async {
            self.stats.judged.fetch_add(updates.len() as u64, Ordering::Relaxed);
            let commands = self.commands(updates, now_us());
            tracing::Span::current().record("commands", commands.len());
            self.publish(commands).await
        }
        .instrument(span)
        .await
    }

    /// The validator keeps nothing per place.
    async fn reset_place(&mut self, _: shelfsync_feed::PlaceKey) -> Result<(), HandlerError> {
        Ok(())
    }
}

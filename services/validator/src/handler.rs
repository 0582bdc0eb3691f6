//! The feed handler: judges each update, hands the resulting CAS commands to
//! the kit's coalescing command publisher (batched per partition with what
//! other updates decide meanwhile), and returns only once JetStream has
//! stored them — the kit acks the change message after that, so a crash in
//! between means a redelivery; a message of decisions published again
//! carries the same id (named after its decisions) and is dropped as a
//! duplicate, and one coalesced otherwise is refused as a CAS `conflict`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use shelfsync_bus::{CommandPublisher, CommandPublisherConfig, Subjects};
use shelfsync_feed::{Handler, HandlerError, Update};
use shelfsync_proto::{Command, now_us};
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
    publisher: CommandPublisher,
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
        let max_payload = match client.server_info().max_payload {
            0 => DEFAULT_MAX_PAYLOAD,
            n => n,
        };
        let config = CommandPublisherConfig {
            // A message named after its decisions: published again after
            // a redelivery, it is dropped as a duplicate.
            id_of: Some(batch_id),
            ..CommandPublisherConfig::new(topology.partitions, max_payload)
        };
        let publisher = CommandPublisher::start(client, js, Subjects::new(&nats.prefix), config);
        Self { rules, publisher, stats }
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

    /// Hands the commands to the coalescing publisher and waits until
    /// JetStream stored every one.
    pub async fn publish(
        &mut self,
        commands: Vec<(Decision, Command)>,
    ) -> Result<(), HandlerError> {
        let (mut hides, mut unhides) = (0, 0);
        if commands.is_empty() {
            return Ok(());
        }
        let before = self.publisher.counts().duplicates.load(Ordering::Relaxed);
        let failed = |e: shelfsync_bus::CommandPublishError| HandlerError::Transient(e.to_string());
        let span = tracing::info_span!("validator.send", shelfsync.command_count = commands.len());
        async {
            let mut stored = Vec::with_capacity(commands.len());
            for (d, cmd) in commands {
                match d {
                    Decision::Hide { .. } => hides += 1,
                    Decision::Unhide => unhides += 1,
                    Decision::Nothing => {}
                }
                stored.push(self.publisher.submit(cmd).await.map_err(failed)?);
            }
            for s in stored {
                s.await
                    .unwrap_or(Err(shelfsync_bus::CommandPublishError::Stopped))
                    .map_err(failed)?;
            }
            Ok::<_, HandlerError>(())
        }
        .instrument(span)
        .await?;
        self.stats.hides.fetch_add(hides, Ordering::Relaxed);
        self.stats.unhides.fetch_add(unhides, Ordering::Relaxed);
        crate::metrics::decisions(hides, unhides);
        let after = self.publisher.counts().duplicates.load(Ordering::Relaxed);
        self.stats.duplicates.fetch_add(after - before, Ordering::Relaxed);
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

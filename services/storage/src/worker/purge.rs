//! Purges between messages: tombstones older than `tombstone_ttl`, and
//! records absent for longer than `absent_ttl` (a DELETED change each), every
//! write fenced by the partition's position like a commit.

use std::collections::HashMap;

use shelfsync_proto::{Command, CommandBatch, CommandKind, Origin};
use shelfsync_service::Drain;
use shelfsync_telemetry::chain;
use tracing::{debug, info, warn};

use super::{HandleError, Worker};
use crate::apply::apply_batch;
use crate::apply::touched_set::Appends;
use crate::outbox::Relay;
use crate::outbox::TraceParts;
use crate::store::{Commit, Fence, Writes};

/// Absent records purged per round.
const PURGE_BATCH: usize = 1000;

impl Worker {
    /// Between messages: purges tombstones older than `tombstone_ttl` and
    /// records absent for longer than `absent_ttl` (a DELETED change each),
    /// every write fenced by the partition's position like a commit.
    pub(super) async fn purge(&self, relay: &mut Relay, shutdown: &Drain) {
        let at = match self.shared.store.position(self.partition).await {
            Ok(at) if at.step.is_empty() => at,
            Ok(_) => return, // a message is half applied: it goes first
            Err(e) => {
                warn!(partition = %self.partition, error = %chain(&e), "purge: cannot read the position");
                return;
            }
        };
        let fence = Fence { at, stream: self.stream_identity() };
        let cutoff = Self::now_us() - self.shared.config.storage.tombstone_ttl.as_micros() as i64;
        match self.shared.store.purge_tombstones(self.partition, &fence, cutoff, PURGE_BATCH).await
        {
            Ok(Some(0)) => {}
            Ok(Some(n)) => {
                debug!(partition = %self.partition, purged = n, "tombstones purged");
                self.shared.stats.tombstones_purged(n as u64);
            }
            Ok(None) => warn!(partition = %self.partition, "tombstone purge fenced; skipped"),
            Err(e) => {
                warn!(partition = %self.partition, error = %chain(&e), "tombstone purge failed")
            }
        }
        if let Err(e) = self.purge_absent(&fence, relay, shutdown).await {
            warn!(partition = %self.partition, error = %chain(&e), "absent purge failed");
        }
        // Entries an operator put back (`shelfsync dead-letters redrive`)
        // go out even when no command comes.
        self.relay_until_done(relay, shutdown).await;
    }

    /// Deletes records absent since before `absent_ttl`: each is a DELETE
    /// through the pure core, compare-and-swapped on the `updated_at` it had
    /// when it was found absent, so that a record that came back meanwhile
    /// is left alone. Its tombstone is purged later like any other.
    async fn purge_absent(
        &self,
        fence: &Fence,
        relay: &mut Relay,
        shutdown: &Drain,
    ) -> Result<(), HandleError> {
        let ttl = self.shared.config.storage.absent_ttl;
        if ttl.is_zero() {
            return Ok(());
        }
        let cutoff = Self::now_us() - ttl.as_micros() as i64;
        let due = self.shared.store.absent_due(self.partition, cutoff, PURGE_BATCH).await?;
        if due.is_empty() {
            return Ok(());
        }
        let probe = CommandBatch {
            partition: self.partition.0,
            commands: due.iter().map(|k| delete_command(k, None)).collect(),
            ..Default::default()
        };
        let mut loaded = self.shared.store.load(self.partition, &probe).await?;
        if loaded.at != fence.at {
            return Err(HandleError::Fenced);
        }
        let mut commands = Vec::new();
        for k in &due {
            let Some(slot) = loaded.slots.get_mut(k) else { continue };
            match &slot.record {
                Some(r) if r.absent && !r.deleted && r.updated_at <= cutoff => {
                    commands.push(delete_command(k, Some(r.updated_at)));
                }
                // Back, deleted or gone since: only the index entry goes.
                _ => slot.absent_index = Some(false),
            }
        }
        let batch = CommandBatch { partition: self.partition.0, commands, ..Default::default() };
        let outcome = apply_batch(&batch, &mut loaded.slots, &HashMap::new(), &self.limits());
        let id = format!("purge.{}.{}", fence.at.applied, Self::now_us());
        let (outbox, _) = self.outbox(&TraceParts::default(), relay).entries(
            fence.at.applied,
            &id,
            0,
            outcome.changes.clone(),
            Vec::new(),
        );
        let writes = Writes {
            slots: Some(&loaded.slots),
            touched: Appends::none(),
            outbox: &outbox,
            sweeps: &[],
        };
        match self.commit(fence, &fence.at, &writes).await? {
            Commit::Done => {}
            Commit::Fenced => return Err(HandleError::Fenced),
        }
        self.wait_replicas(shutdown).await?;
        self.note_changed(&loaded.slots);
        let purged = outcome.changes.len() as u64;
        if purged > 0 {
            info!(partition = %self.partition, purged, "absent records purged (absent_ttl)");
            self.shared.stats.absent_purged(purged);
        }
        self.relay_until_done(relay, shutdown).await;
        Ok(())
    }
}

/// A DELETE of `k` by storage's absent purge (CAS on `updated_at` if given).
fn delete_command(k: &crate::apply::Key, expected_updated_at: Option<i64>) -> Command {
    Command {
        key: Some(shelfsync_proto::RecordKey::new(k.0, k.1, k.2.clone())),
        kind: CommandKind::Delete as i32,
        expected_updated_at,
        origin: Some(Origin {
            source: "storage.absent_purge".into(),
            import_id: String::new(),
            published_at: 0,
        }),
        ..Default::default()
    }
}

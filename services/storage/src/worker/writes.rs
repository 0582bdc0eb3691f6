//! How a worker writes, whatever it applies (a message, a step of a
//! sweep, a purge, a dead letter): the fenced commit that keeps what the
//! owner remembers true, Redis going back in time under it, the wait for
//! Redis replicas, and the relay retried until the outbox is empty.

use std::sync::atomic::Ordering;
use std::time::Duration;

use shelfsync_service::Drain;
use shelfsync_telemetry::chain;
use tracing::{error, warn};

use super::{HandleError, Worker};
use crate::outbox::Relay;
use crate::readiness::Cause;
use crate::store::{Commit, Fence, Position, StoreError, Writes};

/// First and longest wait between two attempts of a failed relay.
const RELAY_RETRY: Duration = Duration::from_millis(100);
const RELAY_RETRY_MAX: Duration = Duration::from_secs(5);

impl Worker {
    /// Whether Redis went back in time under this owner (a failover to a
    /// replica that lagged, a restart from an older snapshot or AOF, a
    /// restore): it says the partition stands before this worker's last
    /// commit. Then everything the owner remembers may be false (records it
    /// vouches for as unchanged may have been lost), so it is forgotten —
    /// the next import then repairs what was lost — and the episode is
    /// logged and counted.
    pub(crate) fn went_back(&self, at: &Position) -> bool {
        let last = self.last_commit.load(Ordering::Relaxed);
        if at.applied >= last {
            return false;
        }
        error!(
            partition = %self.partition, committed = last, redis_says = at.applied,
            "Redis went back in time (failover to a lagging replica, restart from an older \
             snapshot, restore): what this owner remembered is forgotten and the partition goes \
             on from what Redis holds; commands acked since are lost unless sent again (a full \
             import repairs its records)"
        );
        self.known().clear();
        self.shared.store.forget_head(self.partition);
        self.last_commit.store(0, Ordering::Relaxed);
        self.shared.stats.redis_went_back();
        true
    }

    /// Commits `writes` and keeps [`Known`] true: the records written are
    /// forgotten, and a commit that failed or was fenced (it may have been
    /// written all the same, or another owner wrote) forgets everything.
    pub(crate) async fn commit(
        &self,
        fence: &Fence,
        to: &Position,
        writes: &Writes<'_>,
    ) -> Result<Commit, StoreError> {
        let result = self.shared.store.commit(self.partition, fence, to, writes).await;
        if let Ok(Commit::Done) = result {
            self.last_commit.fetch_max(to.applied, Ordering::Relaxed);
        }
        let mut known = self.known();
        match (&result, writes.slots) {
            (Ok(Commit::Done), Some(slots)) => known.forget_written(slots),
            (Ok(Commit::Done), None) => {}
            _ => known.clear(),
        }
        result
    }

    /// With `redis.wait_replicas`, waits until that many Redis replicas have
    /// every write made so far, by this process or any other (`WAIT` after
    /// a write of its own, so that a fresh connection cannot pass it
    /// trivially: `Store::wait_replicas`), however many timeouts it takes:
    /// a commit is neither published nor acked before. Stops waiting (an
    /// error: nothing acked) when shutdown starts.
    pub(crate) async fn wait_replicas(&self, shutdown: &Drain) -> Result<(), HandleError> {
        let want = self.shared.config.redis.wait_replicas;
        if want == 0 {
            return Ok(());
        }
        let timeout = self.shared.config.redis.wait_timeout;
        loop {
            let have = self.shared.store.wait_replicas(self.partition, want, timeout).await?;
            if have >= want {
                return Ok(());
            }
            self.shared.stats.redis_wait_retried();
            self.pressure.on(Cause::RedisReplicas, &HandleError::Replicas { have, want });
            if shutdown.is_started() {
                return Err(HandleError::Stopping);
            }
        }
    }

    /// Relays until the outbox is empty, waiting (backpressure) while NATS
    /// or Redis is away or out of room; gives up only on shutdown (the
    /// outbox stays for the next run).
    pub(crate) async fn relay_until_done(&self, relay: &mut Relay, shutdown: &Drain) {
        let mut attempt = 0;
        loop {
            let e = match relay.relay().await {
                Ok(_) if attempt == 0 => return,
                Ok(_) => return self.pressure.off(),
                Err(e) => HandleError::Relay(e),
            };
            attempt += 1;
            let delay = super::pressure::jittered(RELAY_RETRY, attempt, RELAY_RETRY_MAX);
            match e.pressure() {
                Some(cause) => self.pressure.on(cause, &e),
                None => {
                    warn!(partition = %self.partition, error = %chain(&e), retry_in = ?delay, "outbox relay failed")
                }
            }
            if shutdown.is_started() {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.started() => return,
            }
        }
    }
}

//! A command message that cannot be applied (undecodable, or failing again
//! and again) is committed as a rejection carrying its raw bytes, and the
//! partition moves past it: recorded once, it never blocks the partition.

use shelfsync_proto::Rejection;
use shelfsync_service::Drain;
use tracing::error;

use super::{HandleError, Handled, Worker};
use crate::apply::touched_set::Appends;
use crate::outbox::Relay;
use crate::outbox::TraceParts;
use crate::store::{Commit, Fence, Position, Writes};

/// Raw bytes kept in a dead-letter rejection.
const MAX_RAW: usize = 128 * 1024;

impl Worker {
    /// Commits a rejection carrying the raw message and advances the
    /// sequence, so a poison message is recorded once and never blocks.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn dead_letter(
        &self,
        seq: u64,
        why: &str,
        detail: String,
        raw: &[u8],
        trace: &TraceParts,
        relay: &mut Relay,
        shutdown: &Drain,
    ) -> Result<Handled, HandleError> {
        error!(partition = %self.partition, seq, reason = why, %detail, "dead-lettering command message");
        let at = self.store.position(self.partition).await?;
        if seq <= at.applied {
            return Ok(Handled::Skipped);
        }
        let rejection = Rejection {
            reason: why.to_string(),
            detail,
            raw: raw[..raw.len().min(MAX_RAW)].to_vec(),
            ..Default::default()
        };
        let (outbox, _) = self.outbox(trace, relay).entries(
            seq,
            &seq.to_string(),
            0,
            Vec::new(),
            vec![rejection],
        );
        let fence = Fence { at, stream: self.stream_identity() };
        let writes = Writes { slots: None, touched: Appends::none(), outbox: &outbox, sweeps: &[] };
        match self.commit(&fence, &Position::at(seq), &writes).await? {
            Commit::Done => {
                self.stats.dead_lettered(why);
                self.relay_until_done(relay, shutdown).await;
                Ok(Handled::Applied)
            }
            Commit::Fenced => Err(HandleError::Fenced),
        }
    }
}

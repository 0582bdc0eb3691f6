//! A command message that cannot be applied (undecodable, over the limits,
//! or failing again and again for a reason its content causes) is committed
//! as a rejection carrying the whole message as it arrived, and the
//! partition moves past it: recorded once, it never blocks the partition,
//! and it can be published again as it was (`shelfsync dead-letters
//! redrive --command`). The command stream refuses messages within
//! `CMD_HEADROOM` of the server's payload limit (`shelfsync_bus::provision`),
//! so the rejection that carries one always fits in one message.

use shelfsync_proto::Rejection;
use tracing::error;

use super::message::Delivery;
use super::{HandleError, Handled, Worker};
use crate::apply::touched_set::Appends;
use crate::store::{Commit, Fence, Position, Writes};

/// Detail kept in a dead-letter rejection.
const MAX_DETAIL: usize = 1024;

impl Worker {
    /// Commits a rejection carrying the message `msg` whole and advances
    /// the sequence, so a poison message is recorded once and never blocks.
    pub(super) async fn dead_letter(
        &self,
        d: &mut Delivery<'_>,
        why: &str,
        mut detail: String,
    ) -> Result<Handled, HandleError> {
        let (seq, msg) = (d.seq, d.msg);
        if detail.len() > MAX_DETAIL {
            let mut end = MAX_DETAIL;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail.truncate(end);
        }
        let at = self.shared.store.position(self.partition).await?;
        if seq <= at.applied {
            return Ok(Handled::Skipped);
        }
        error!(
            partition = %self.partition, seq, reason = why, %detail, bytes = msg.payload.len(),
            "dead-lettering command message (kept whole on the REJECTS stream)"
        );
        let encoding = shelfsync_bus::encoding::encoding_of(msg.headers.as_ref());
        let rejection = Rejection {
            reason: why.to_string(),
            detail,
            raw: msg.payload.to_vec(),
            raw_encoding: encoding.unwrap_or("none").to_string(),
            ..Default::default()
        };
        let (outbox, _) = self.outbox(&d.trace, d.relay).entries(
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
                self.shared.stats.dead_lettered(why);
                self.relay_until_done(d.relay, d.shutdown).await;
                Ok(Handled::Applied)
            }
            Commit::Fenced => Err(HandleError::Fenced),
        }
    }
}

//! Reading ahead: the messages of the partition waiting behind the delivered
//! one, read straight from the stream in order (direct gets) so that they
//! are committed with it: one load, one commit, one relay for all.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use shelfsync_telemetry::chain;
use tracing::warn;

use super::Worker;
use crate::known::Scanned;

/// Messages read ahead of the delivered one (at most `storage.read_ahead`)
/// are committed with it as long as they hold this many commands and sweeps
/// together.
const AHEAD_COMMANDS: usize = 1000;
/// How long reading ahead pauses after a direct get failed.
const AHEAD_PAUSE: Duration = Duration::from_secs(60);

impl Worker {
    /// Appends to `parts` the partition's messages stored behind the last
    /// one, each the next on the subject after the one before: at most
    /// `pending` (what the consumer has not delivered yet) and the limits.
    /// Stops at the first message it cannot read or decode, and before one
    /// carrying sweeps (applied on its own, in steps); that one is handled
    /// when it is delivered.
    pub(super) async fn read_ahead(
        &self,
        stream: &jetstream::stream::Stream,
        pending: u64,
        parts: &mut Vec<(u64, Scanned)>,
    ) {
        let paused = *self.ahead_paused_until.lock().unwrap_or_else(|e| e.into_inner());
        if paused.is_some_and(|until| Instant::now() < until) {
            return;
        }
        let subject = self.shared.subjects.cmd(self.partition);
        let want = 1 + (pending as usize).min(self.shared.config.storage.read_ahead);
        let size = |m: &Scanned| m.len() + m.header.sweeps.len();
        let mut total: usize = parts.iter().map(|(_, b)| size(b)).sum();
        let mut contexts = Vec::new();
        while parts.len() < want && total < AHEAD_COMMANDS {
            let after = parts.last().map_or(0, |(s, _)| *s);
            let m = match stream.direct_get_next_for_subject(subject.clone(), Some(after + 1)).await
            {
                Ok(m) => m,
                Err(e) => {
                    if e.kind() != jetstream::stream::DirectGetErrorKind::NotFound {
                        warn!(
                            partition = %self.partition, error = %chain(&e), pause = ?AHEAD_PAUSE,
                            "reading ahead failed; one message at a time meanwhile"
                        );
                        *self.ahead_paused_until.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(Instant::now() + AHEAD_PAUSE);
                    }
                    break;
                }
            };
            let Ok(plain) = shelfsync_bus::encoding::decode(Some(&m.headers), &m.payload) else {
                break;
            };
            let Ok(batch) = Scanned::read(plain) else { break };
            if !batch.header.sweeps.is_empty() || total + size(&batch) > AHEAD_COMMANDS {
                break;
            }
            total += size(&batch);
            contexts.push(shelfsync_telemetry::extract_opt(Some(&m.headers)));
            parts.push((m.sequence, batch));
        }
        // A message on the partition's sweep subject stored between two of
        // them must be applied first: read ahead stops before it. Asked
        // after reading, so that a sweep stored meanwhile comes after them.
        if parts.len() > 1 {
            let first = parts[0].0;
            let sweep = self.shared.subjects.cmd_sweep(self.partition);
            match stream.direct_get_next_for_subject(sweep, Some(first + 1)).await {
                Ok(m) => {
                    parts.retain(|(seq, _)| *seq < m.sequence);
                    contexts.truncate(parts.len() - 1);
                }
                Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => {}
                Err(e) => {
                    warn!(
                        partition = %self.partition, error = %chain(&e),
                        "cannot tell whether a sweep waits behind; not reading ahead this time"
                    );
                    parts.truncate(1);
                    contexts.clear();
                }
            }
        }
        // Their imports' traces, linked from this apply.
        shelfsync_telemetry::add_links(&tracing::Span::current(), &contexts);
    }
}

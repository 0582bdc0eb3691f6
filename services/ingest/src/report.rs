//! What one import did (kept in Redis, returned by the push endpoint, printed
//! by the CLI), what can make it fail, and the running counts shown while it
//! runs.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use shelfsync_telemetry::chain;

use crate::feed::FeedError;

/// How an import ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImportStatus {
    #[default]
    Completed,
    /// The source said the feed did not change (HTTP 304): nothing published.
    Unchanged,
    Failed,
}

/// The summary of one import. Counts are of this import only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ImportReport {
    pub import_id: String,
    pub partner: String,
    /// `"full"` or `"delta"`.
    pub kind: String,
    /// The file, URL or `push` the feed came from.
    pub source: String,
    pub status: ImportStatus,
    pub error: Option<String>,
    /// Valid items (each one PATCH command).
    pub items: u64,
    pub commands: u64,
    /// Rejected items by reason.
    pub rejected: BTreeMap<String, u64>,
    pub rejected_total: u64,
    /// Places seen in the feed (listed with no items included).
    pub places: u64,
    /// Sweeps sent (full imports: one per place seen, and one per place of
    /// an earlier import missing from this one).
    pub sweeps: u64,
    /// Of those, the ones storage applied, and the records they marked absent.
    #[serde(default)]
    pub sweeps_applied: u64,
    #[serde(default)]
    pub marked_absent: u64,
    /// Sweeps storage held instead of applying (`shelfsync sweep --import`
    /// releases them).
    #[serde(default)]
    pub held_sweeps: Vec<HeldSweep>,
    /// Places whose sweep storage had not decided when the report was made.
    #[serde(default)]
    pub sweeps_pending: Vec<i64>,
    /// Command batch messages (sweeps not included).
    pub batches: u64,
    /// Raw feed bytes read.
    pub bytes_in: u64,
    /// Command payload bytes published (sweeps included).
    pub bytes_out: u64,
    pub duration_ms: u64,
    /// The generation stamped on commands: import start (µs) for a full
    /// import, 0 for a delta.
    pub generation: i64,
}

/// A sweep storage held: nothing of the place was marked absent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HeldSweep {
    pub place_id: i64,
    /// `no_item_accepted`, `missing_from_dump`, `nothing_carried` or `over_fraction`.
    pub reason: String,
    /// Items of the place this import accepted.
    pub accepted: u64,
    /// Live records of the place, and how many the sweep would mark absent.
    pub live: u64,
    pub would_mark_absent: u64,
}

impl ImportReport {
    /// A human-readable summary, a few lines.
    pub fn render(&self) -> String {
        let mut out = format!(
            "import {} of {} ({}) from {}: ",
            self.import_id, self.partner, self.kind, self.source
        );
        let secs = self.duration_ms as f64 / 1000.0;
        match self.status {
            ImportStatus::Completed => _ = write!(out, "completed in {secs:.2} s"),
            ImportStatus::Unchanged => {
                _ = write!(out, "unchanged since the last import, nothing published ({secs:.2} s)");
                return out;
            }
            ImportStatus::Failed => _ = write!(out, "FAILED after {secs:.2} s"),
        }
        if let Some(error) = &self.error {
            _ = write!(out, "\n  error      {error}");
        }
        _ = write!(out, "\n  items      {} good, {} rejected", self.items, self.rejected_total);
        if !self.rejected.is_empty() {
            let reasons: Vec<String> =
                self.rejected.iter().map(|(r, n)| format!("{r} {n}")).collect();
            _ = write!(out, " ({})", reasons.join(", "));
        }
        _ = write!(out, "\n  places     {}", self.places);
        if self.sweeps > 0 {
            _ = write!(
                out,
                "\n  sweeps     {} sent, {} applied ({} records marked absent), {} held",
                self.sweeps,
                self.sweeps_applied,
                self.marked_absent,
                self.held_sweeps.len()
            );
            if !self.sweeps_pending.is_empty() {
                _ = write!(out, ", {} not decided yet", self.sweeps_pending.len());
            }
        }
        for h in &self.held_sweeps {
            _ = write!(
                out,
                "\n  HELD       place {}: {} (accepted {}, would mark {} of {} live records absent)",
                h.place_id, h.reason, h.accepted, h.would_mark_absent, h.live
            );
        }
        if !self.held_sweeps.is_empty() {
            _ = write!(
                out,
                "\n  note       nothing was marked absent in the held places; to apply: shelfsync sweep --import {}",
                self.import_id
            );
        }
        _ = write!(
            out,
            "\n  messages   {} command batches, {} out, {} in",
            self.batches,
            human_bytes(self.bytes_out),
            human_bytes(self.bytes_in)
        );
        if self.status == ImportStatus::Failed {
            out.push_str("\n  note       commands published before the failure stay published (valid PATCHes); nothing was swept");
        }
        out
    }
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// Running counts, handed to the progress callback now and then.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    pub bytes_in: u64,
    pub items: u64,
    pub rejected: u64,
    pub batches: u64,
}

/// Why an import failed. Nothing was swept; commands published before the
/// failure stay published (see the report).
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("the feed is not JSON: expected `{{` at byte {offset}, found {found:?}")]
    NotJson { found: String, offset: u64 },
    #[error("the feed is empty")]
    Empty,
    #[error("the feed is malformed: {0}")]
    Malformed(String),
    #[error("the feed is for brand {found}, but the partner's brand is {expected}")]
    BrandMismatch { expected: i64, found: i64 },
    #[error("cannot read {what}: {detail}")]
    Source { what: String, detail: String },
    #[error("cannot publish: {0}")]
    Publish(#[from] shelfsync_bus::PublishFailed),
    #[error("import state in Redis: {0}")]
    State(#[from] redis::RedisError),
    #[error("the import task failed: {0}")]
    Internal(String),
    /// Another full import of the partner holds its lease (nothing was done).
    #[error("another full import of `{partner}` is running: {holder}")]
    Busy { partner: String, holder: String },
    #[error(
        "the import lost its lease on `{partner}` ({reason}); it stopped publishing and swept nothing"
    )]
    LeaseLost { partner: String, reason: String },
}

impl ImportError {
    /// True when the feed itself is at fault (not the source, bus or Redis).
    pub fn is_bad_feed(&self) -> bool {
        matches!(
            self,
            ImportError::NotJson { .. }
                | ImportError::Empty
                | ImportError::Malformed(_)
                | ImportError::BrandMismatch { .. }
        )
    }

    pub(crate) fn from_feed(e: FeedError, what: &str) -> ImportError {
        match e {
            FeedError::Empty => ImportError::Empty,
            FeedError::NotJson { found, offset } => ImportError::NotJson { found, offset },
            FeedError::Malformed(m) => ImportError::Malformed(m),
            FeedError::BrandMismatch { expected, found } => {
                ImportError::BrandMismatch { expected, found }
            }
            FeedError::Io(e) => {
                ImportError::Source { what: what.into(), detail: chain(&e).to_string() }
            }
            FeedError::Stopped => ImportError::Internal("the parse was stopped".into()),
        }
    }
}

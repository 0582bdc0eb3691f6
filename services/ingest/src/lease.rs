//! The partner lease: one full import per partner at a time, across every
//! ingest replica and the CLI, so that the generations and sweeps of two
//! imports never interleave (one would sweep what the other just imported).
//! Owns the lease's logic — who holds it, the renewal schedule, when it
//! counts as lost; the Redis steps are in `state` (key
//! `{{namespace}:ingest:{partner}}:lease`, one key per step but the take,
//! which also writes the partner's generation beside it).
//!
//! - Taken by a full import before it opens its source, together with the
//!   import's generation, in one script on the partner's hash tag (the key
//!   if free, `PX ttl` — `ingest.import_lease_ttl`, default 30 s; the
//!   generation: the import's start, or the partner's last generation + 1
//!   when the host's clock is behind). The value says who holds it (import
//!   id, host, pid, program, source, start) and, being unique, is also the
//!   token the other steps compare against.
//! - Renewed every ttl/3 by a task while the import runs (compare-and-
//!   `PEXPIRE` in Lua); a failed renewal is retried every ttl/10.
//! - Lost when the value is no longer ours (it expired and another import
//!   took it, or it was deleted), or when no renewal succeeded for 2/3 of the
//!   ttl (Redis unreachable or too slow), while the key still has a third of
//!   its ttl left. The import is stopped at once — it publishes nothing more
//!   and sends no sweep — and fails with [`ImportError::LeaseLost`].
//! - Confirmed (renewed once more, so that a full ttl is ahead) right before
//!   the sweeps go out.
//! - Released at the end, also on failure (compare-and-`DEL`); dropped
//!   without a release (an import cut off at shutdown), it is released in
//!   the background; a crashed holder's lease expires after the ttl.
//!
//! A second full import of the partner waits for the lease up to its
//! `lease_wait` (the CLI's `--wait`; none by default, and never in the
//! service, whose poller skips a round and whose push endpoint answers 409),
//! then fails with [`ImportError::Busy`] naming the holder. Delta imports
//! take no lease: they stamp no generation and never sweep, so one running
//! beside a full import cannot make it sweep the wrong records.
//!
//! What it does not do is fence: storage does not check a lease token, so a
//! holder frozen for longer than a third of the ttl (a stopped process, a
//! paused VM) right between two publishes could still publish once its lease
//! has expired. A holder that runs stops before its key can expire.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use shelfsync_telemetry::chain;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::warn;

use crate::report::ImportError;
use crate::state::{GENERATION_SLOT, State};

/// Who holds a lease: its stored value, shown to an import that finds it taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Holder {
    pub import_id: String,
    pub host: String,
    pub pid: u32,
    pub program: String,
    pub source: String,
    /// RFC 3339, UTC.
    pub started: String,
    /// Unique per lease in this process: the value is then unique even for
    /// two imports with one id, and can serve as the token.
    pub nonce: u64,
}

impl Holder {
    /// An import of this process.
    pub fn this_process(import_id: &str, source: &str) -> Holder {
        static NONCE: AtomicU64 = AtomicU64::new(0);
        let program = std::env::args()
            .next()
            .and_then(|a| a.rsplit('/').next().map(String::from))
            .unwrap_or_default();
        Holder {
            import_id: import_id.into(),
            host: hostname(),
            pid: std::process::id(),
            program,
            source: source.into(),
            started: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            nonce: NONCE.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A stored value, for a message: which import, where, since when.
    pub fn describe(stored: &str) -> String {
        match serde_json::from_str::<Holder>(stored) {
            Ok(h) => format!(
                "import {} by {} (pid {} on {}), running since {}, from {}",
                h.import_id, h.program, h.pid, h.host, h.started, h.source
            ),
            Err(_) => {
                let clipped: String = stored.chars().take(200).collect();
                format!("a holder shelfsync does not know: {clipped:?}")
            }
        }
    }
}

/// The host name, as the kernel has it (on Kubernetes: the pod's name).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".into())
}

/// What one renewal attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Renewal {
    Renewed,
    /// The key holds another value, or none.
    NotHeld,
    /// Redis failed or did not answer in time.
    Failed(String),
}

/// What the holder does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Next {
    RenewAt(Instant),
    Lost(String),
}

/// When to renew and when to give up. Pure, so that it is tested without a
/// clock or a server.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Schedule {
    ttl: Duration,
    /// When the last successful renewal (or the take) was sent: the key
    /// lives at least until then + ttl.
    last_ok: Instant,
}

impl Schedule {
    pub fn new(ttl: Duration, taken_at: Instant) -> Schedule {
        Schedule { ttl, last_ok: taken_at }
    }

    pub fn first(&self) -> Instant {
        self.last_ok + self.ttl / 3
    }

    /// The holder must have stopped by then: a third of the ttl is left
    /// before the key can expire and another import take it.
    pub fn deadline(&self) -> Instant {
        self.last_ok + self.ttl * 2 / 3
    }

    /// After an attempt sent at `sent`, with its outcome known at `now`.
    pub fn after(&mut self, sent: Instant, now: Instant, outcome: Renewal) -> Next {
        match outcome {
            Renewal::Renewed => {
                self.last_ok = sent;
                Next::RenewAt(sent + self.ttl / 3)
            }
            Renewal::NotHeld => Next::Lost("it expired or another import took it over".into()),
            Renewal::Failed(error) => {
                let retry = now + self.ttl / 10;
                if retry < self.deadline() {
                    return Next::RenewAt(retry);
                }
                let secs = now.saturating_duration_since(self.last_ok).as_secs_f64();
                Next::Lost(format!("it could not be renewed for {secs:.1} s: {error}"))
            }
        }
    }
}

/// A lease held by this process, renewed by a task until released or lost.
pub(crate) struct Lease {
    state: State,
    partner: String,
    /// The stored value: the token.
    holder: String,
    ttl: Duration,
    lost: watch::Receiver<Option<String>>,
    renewer: JoinHandle<()>,
    released: bool,
}

impl Lease {
    /// Takes the lease of `partner`, waiting up to `wait` while another
    /// import holds it, and with it the import's generation (returned):
    /// `start()` (µs) at the attempt that got it, or the partner's last
    /// generation + 1 if that is not more. `holder` says who takes it,
    /// afresh at each attempt; its import id may hold
    /// [`GENERATION_SLOT`], which becomes the generation.
    pub async fn take(
        state: &State,
        partner: &str,
        ttl: Duration,
        wait: Duration,
        mut holder: impl FnMut() -> Holder,
        start: impl Fn() -> i64,
    ) -> Result<(Lease, i64), ImportError> {
        let give_up = Instant::now() + wait;
        let poll = (ttl / 20).clamp(Duration::from_millis(50), Duration::from_secs(1));
        loop {
            let value = serde_json::to_string(&holder())
                .map_err(|e| ImportError::Internal(e.to_string()))?;
            let sent = Instant::now();
            if let Some(generation) = state.lease_take(partner, &value, ttl, start()).await? {
                let value = value.replace(GENERATION_SLOT, &generation.to_string());
                return Ok((Lease::start(state.clone(), partner, value, ttl, sent), generation));
            }
            if Instant::now() >= give_up {
                // Released in between: try again at once.
                if let Some(held) = state.lease_holder(partner).await? {
                    let holder = Holder::describe(&held);
                    return Err(ImportError::Busy { partner: partner.into(), holder });
                }
                continue;
            }
            tokio::time::sleep(poll.min(give_up.saturating_duration_since(Instant::now()))).await;
        }
    }

    fn start(state: State, partner: &str, holder: String, ttl: Duration, taken: Instant) -> Lease {
        let (tx, lost) = watch::channel(None);
        let schedule = Schedule::new(ttl, taken);
        let task = renew(state.clone(), partner.to_string(), holder.clone(), schedule, tx);
        let renewer = tokio::spawn(task);
        Lease { state, partner: partner.into(), holder, ttl, lost, renewer, released: false }
    }

    /// Completes when the lease is lost, with why.
    pub async fn lost(&self) -> String {
        let mut lost = self.lost.clone();
        match lost.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => "its renewal stopped".into(),
        }
    }

    pub fn lost_error(&self, reason: String) -> ImportError {
        ImportError::LeaseLost { partner: self.partner.clone(), reason }
    }

    /// Renews once more (before the sweeps): `Ok` when still ours, with a
    /// full ttl ahead.
    pub async fn confirm(&self) -> Result<(), ImportError> {
        let known = self.lost.borrow().clone();
        if let Some(reason) = known {
            return Err(self.lost_error(reason));
        }
        match self.state.lease_renew(&self.partner, &self.holder, self.ttl).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.lost_error("it expired or another import took it over".into())),
            Err(e) => {
                Err(self.lost_error(format!("it could not be confirmed before the sweep: {e}")))
            }
        }
    }

    pub async fn release(mut self) {
        self.renewer.abort();
        self.released = true;
        if let Err(e) = self.state.lease_release(&self.partner, &self.holder).await {
            warn!(error = %chain(&e), "cannot release the import lease; it expires on its own");
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.renewer.abort();
        if !self.released
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (state, partner, holder) =
                (self.state.clone(), self.partner.clone(), self.holder.clone());
            runtime.spawn(async move { _ = state.lease_release(&partner, &holder).await });
        }
    }
}

/// The renewal task: runs until the lease is lost (it says why) or aborted.
async fn renew(
    state: State,
    partner: String,
    holder: String,
    mut schedule: Schedule,
    lost: watch::Sender<Option<String>>,
) {
    let mut at = schedule.first();
    let mut failing = false;
    loop {
        tokio::time::sleep_until(at).await;
        let sent = Instant::now();
        let attempt = state.lease_renew(&partner, &holder, schedule.ttl);
        let outcome = match tokio::time::timeout_at(schedule.deadline(), attempt).await {
            Ok(Ok(true)) => Renewal::Renewed,
            Ok(Ok(false)) => Renewal::NotHeld,
            Ok(Err(e)) => Renewal::Failed(e.to_string()),
            Err(_) => Renewal::Failed("Redis did not answer in time".into()),
        };
        if let Renewal::Failed(error) = &outcome
            && !failing
        {
            warn!(%partner, error, "cannot renew the import lease; retrying");
        }
        failing = matches!(outcome, Renewal::Failed(_));
        match schedule.after(sent, Instant::now(), outcome) {
            Next::RenewAt(next) => at = next,
            Next::Lost(reason) => {
                _ = lost.send(Some(reason));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(30);

    #[test]
    fn a_healthy_holder_renews_every_third_of_the_ttl() {
        let t0 = Instant::now();
        let mut s = Schedule::new(TTL, t0);
        assert_eq!(s.first(), t0 + Duration::from_secs(10));
        assert_eq!(s.deadline(), t0 + Duration::from_secs(20));
        let sent = t0 + Duration::from_secs(10);
        let next = s.after(sent, sent + Duration::from_millis(3), Renewal::Renewed);
        assert_eq!(next, Next::RenewAt(t0 + Duration::from_secs(20)));
        assert_eq!(s.deadline(), sent + Duration::from_secs(20), "counted from the send");
    }

    #[test]
    fn a_lease_that_is_not_ours_any_more_is_lost_at_once() {
        let t0 = Instant::now();
        let at = t0 + Duration::from_secs(10);
        let next = Schedule::new(TTL, t0).after(at, at, Renewal::NotHeld);
        assert!(matches!(next, Next::Lost(r) if r.contains("another import took it over")));
    }

    #[test]
    fn failed_renewals_are_retried_and_given_up_while_a_third_of_the_ttl_is_left() {
        let t0 = Instant::now();
        let mut s = Schedule::new(TTL, t0);
        let mut now = s.first();
        let mut attempts = 0;
        let reason = loop {
            attempts += 1;
            match s.after(now, now, Renewal::Failed("connection refused".into())) {
                Next::RenewAt(next) => {
                    assert!(next > now && next < s.deadline(), "retried before the deadline");
                    now = next;
                }
                Next::Lost(reason) => break reason,
            }
        };
        assert!(now < t0 + TTL - TTL / 4, "gave up with time to stop before the key expires");
        assert!(now + TTL / 10 >= t0 + TTL * 2 / 3, "and not before its last chance");
        assert_eq!(attempts, 4, "at 10 s, 13 s, 16 s, 19 s");
        assert!(reason.contains("connection refused") && reason.contains("19.0 s"), "{reason}");

        // One success in between starts the count again.
        let mut s = Schedule::new(TTL, t0);
        let at = s.first();
        assert!(matches!(s.after(at, at, Renewal::Failed("slow".into())), Next::RenewAt(_)));
        let again = at + TTL / 10;
        assert_eq!(s.after(again, again, Renewal::Renewed), Next::RenewAt(again + TTL / 3));
        assert_eq!(s.deadline(), again + TTL * 2 / 3);
    }

    #[test]
    fn the_holder_is_stored_and_described_for_the_import_that_finds_it() {
        let a = Holder::this_process("flowers-1", "feeds/a.json");
        let b = Holder::this_process("flowers-1", "feeds/a.json");
        assert_ne!(a.nonce, b.nonce, "two leases of one process differ");
        let stored = serde_json::to_string(&a).expect("json");
        assert_eq!(serde_json::from_str::<Holder>(&stored).expect("parses"), a);
        let text = Holder::describe(&stored);
        for part in ["import flowers-1", &format!("pid {}", std::process::id()), "feeds/a.json"] {
            assert!(text.contains(part), "{text} lacks {part}");
        }
        assert!(text.contains(&a.host) && text.contains(&a.started), "{text}");
        let odd = Holder::describe(&"x".repeat(1000));
        assert!(odd.starts_with("a holder shelfsync does not know") && odd.len() < 300, "{odd}");
    }
}

//! Crash points for fault tests: `SHELFSYNC_FAILPOINT=<name>[@<n>]` aborts
//! the process (no cleanup, like SIGKILL) the n-th time (default first) the
//! named point is reached. Unset, a hit costs one atomic load.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

struct Armed {
    name: String,
    at: u64,
    hits: AtomicU64,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var("SHELFSYNC_FAILPOINT").ok()?;
            let (name, at) = match spec.split_once('@') {
                Some((n, k)) => (n.to_string(), k.parse().unwrap_or(1)),
                None => (spec, 1),
            };
            Some(Armed { name, at, hits: AtomicU64::new(0) })
        })
        .as_ref()
}

/// Points: `before_commit`, `after_commit`, `after_outbox_publish` (published,
/// outbox not trimmed), `after_publish` (before the ack), `after_ack`,
/// `after_sweep_step` (a step of a message applied in steps committed).
pub(crate) fn hit(name: &str) {
    if reached(name) {
        eprintln!("failpoint {name} reached: aborting");
        std::process::abort();
    }
}

/// For faults that do not end the process: true the n-th time the named
/// point is reached (`lose_relay_ack`: the relay's acks are taken as lost,
/// after a pause of `SHELFSYNC_FAILPOINT_PAUSE_MS`, default 2000, so that
/// the retry comes after a short dedup window).
pub(crate) fn triggered(name: &str) -> bool {
    if !reached(name) {
        return false;
    }
    eprintln!("failpoint {name} reached");
    let pause = std::env::var("SHELFSYNC_FAILPOINT_PAUSE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    std::thread::sleep(std::time::Duration::from_millis(pause));
    true
}

fn reached(name: &str) -> bool {
    armed().is_some_and(|a| a.name == name && a.hits.fetch_add(1, Ordering::SeqCst) + 1 == a.at)
}

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
/// outbox not trimmed), `after_publish` (before the ack), `after_ack`.
pub fn hit(name: &str) {
    if let Some(a) = armed()
        && a.name == name
        && a.hits.fetch_add(1, Ordering::SeqCst) + 1 == a.at
    {
        eprintln!("failpoint {name} reached: aborting");
        std::process::abort();
    }
}

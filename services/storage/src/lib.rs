//! shelfsync storage (docs/DESIGN.md, Storage semantics): the current state
//! of every record in Redis, and a change published only when something
//! really changed.
//!
//! - `apply`: the pure core — merge, change detection, CAS, generations,
//!   sweeps, tombstones. No I/O; most tests live here.
//! - `store`: Redis — key layout, batched loads, the atomic commit of
//!   state + outbox + applied sequence, reads for other tools.
//! - `worker`: one task per owned partition — ordered consumption, commit,
//!   ack, retries, dead-lettering, purges; `worker::sweep`: a message with sweeps,
//!   applied in bounded steps.
//! - `outbox` (`outbox::relay`): what a commit puts in the outbox, and
//!   publishing it exactly once with no time window.
//! - `keyframe` (`keyframe::pacing`, `keyframe::schedule`): a keyframe job and the digest at its
//!   mark; how fast and on which thread keyframes run (the worker freezes,
//!   publishes and marks).
//! - `requests`: the control subjects (keyframe, rebase, redrive); `read`:
//!   the read API (NATS and HTTP) and the probes.
//! - [`App`]: wiring and graceful shutdown.
//!
//! Public: [`App`] and what tests see of it ([`Stats`], [`PartitionHealth`],
//! [`Refusal`]); [`client`], what the CLI, the bench and the tests use of
//! storage's Redis without running it; [`pure`], the pure core a model is
//! checked against. Everything else is the crate's own.
#![forbid(unsafe_code)]

mod app;
mod apply;
mod clock;
mod config;
mod failpoint;
mod keyframe;
mod known;
mod metrics;
mod outbox;
mod read;
mod readiness;
mod requests;
mod store;
mod worker;

pub use app::{App, shutdown_signal};
pub use config::Config;
pub use metrics::Stats;
pub use readiness::{PartitionHealth, Refusal};

/// Storage's Redis for other tools: [`Store`](client::Store) (connect,
/// reads, the outbox, commits for tests), the key layout and the
/// touched-set encoding.
pub mod client {
    pub use crate::apply::touched_set;
    pub use crate::store::{
        Commit, Fence, Keys, LAYOUT, Position, RedisConn, Store, StoreError, Writes,
    };
}

/// The pure core (no I/O): one batch applied to loaded records.
pub mod pure {
    pub use crate::apply::{Limits, Slots, SweptPlace, TouchedSets, apply_batch};
}

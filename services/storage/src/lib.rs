//! shelfsync storage (docs/DESIGN.md, Storage semantics): the current state
//! of every record in Redis, and a change published only when something
//! really changed.
//!
//! - [`apply`]: the pure core — merge, change detection, CAS, generations,
//!   sweeps, tombstones. No I/O; most tests live here.
//! - [`store`]: Redis — key layout, batched loads, the atomic commit of
//!   state + outbox + applied sequence, reads for other tools.
//! - `worker`: one task per owned partition — ordered consumption, commit,
//!   ack, retries, dead-lettering, purges; `worker::sweep`: a message with sweeps,
//!   applied in bounded steps.
//! - `outbox` (`outbox::relay`): what a commit puts in the outbox, and
//!   publishing it exactly once with no time window.
//! - [`keyframe`] (`keyframe::pacing`): a keyframe job and the digest at its
//!   mark; how fast and on which thread keyframes run (the worker freezes,
//!   publishes and marks).
//! - [`App`]: wiring and graceful shutdown.
#![forbid(unsafe_code)]

mod app;
pub mod apply;
mod clock;
mod config;
pub mod failpoint;
pub mod keyframe;
mod known;
pub mod metrics;
mod outbox;
pub mod read;
mod readiness;
mod requests;
pub mod store;
mod worker;

pub use app::{App, shutdown_signal};
pub use config::Config;
pub use metrics::Stats;
pub use readiness::{PartitionHealth, Refusal};
pub use store::{RedisConn, Store, StoreError};

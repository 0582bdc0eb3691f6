//! shelfsync storage (DESIGN §4): the current state of every record in
//! Redis, and a change published only when something really changed.
//!
//! - [`apply`]: the pure core — merge, change detection, CAS, generations,
//!   sweeps, tombstones. No I/O; most tests live here.
//! - [`store`]: Redis — key layout, batched loads, the atomic commit of
//!   state + outbox + applied sequence, reads for other tools.
//! - `worker`: one task per owned partition — ordered consumption, commit,
//!   outbox relay, ack, retries and dead-lettering.
//! - [`App`]: wiring and graceful shutdown.
#![forbid(unsafe_code)]

mod app;
pub mod apply;
pub mod failpoint;
pub mod keyframe;
pub mod read;
pub mod stats;
pub mod store;
mod worker;

pub use app::{App, shutdown_signal};
pub use stats::Stats;
pub use store::{RedisConn, Store, StoreError};

//! shelfsync validator: hides offers whose data breaks a configured rule, and
//! shows them again once fixed, by a `state` PATCH conditional on the
//! `updated_at` it judged (CAS). Stateless: every replica shares one durable
//! consumer of the change stream; a conflict (the record moved on) is normal —
//! the newer version is judged when it arrives.
//!
//! - [`rules`]: the rule kinds and the registry building them from settings
//!   (pure);
//! - [`decide`]: hide / un-hide / nothing for one update, and the CAS command
//!   carrying it out (pure);
//! - [`handler`]: the ChangeFeed handler — decide, publish in batches, return
//!   once stored (the kit acks after);
//! - [`App`]: wiring, the `/healthz` and `/readyz` probes, graceful shutdown.
//!
//! It writes nothing but state PATCHes, never data, and never touches Redis.
#![forbid(unsafe_code)]

mod app;
pub mod decide;
pub mod handler;
mod metrics;
pub mod rules;

pub use app::{App, feed_config};
pub use decide::{DECIDED_BY, Decision, decide};
pub use handler::{Stats, Validator};
pub use rules::{Rule, Rules, Violation};

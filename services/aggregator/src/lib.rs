//! shelfsync aggregator: **master cards** — per product and region, the minimum
//! price over offers that are visible, present, not deleted and in stock, with
//! the offer count and where the minimum is — and the **category cache** — per
//! place, the categories with at least one such offer. It follows the change
//! stream with the ChangeFeed kit, keeps the aggregates in Redis with set
//! semantics (a redelivered batch changes nothing), publishes an
//! `AggregateChange` on `<prefix>.aggregates.…` only when an aggregate actually
//! changed, and serves them over HTTP.
//!
//! - [`aggregate`]: qualification, regions, the plan a batch turns into and
//!   when an aggregate changed (pure, where most tests live);
//! - [`store`]: the Redis layout and its two scripts (Redis only);
//! - [`engine`]: the feed handler — plan, apply, publish, record; crash
//!   behaviour and keyframe reloads;
//! - [`metrics`]: every metric it exports, recorded by typed functions;
//! - [`Config`]: the slice of the settings it reads;
//! - [`App`]: wiring, the HTTP API, probes, graceful shutdown.
//!
//! It reads the change stream and writes only its own Redis keys and the
//! AGGREGATES stream; it never writes records.
#![forbid(unsafe_code)]

pub mod aggregate;
mod app;
mod config;
pub mod engine;
pub mod metrics;
pub mod store;

pub use app::{App, feed_config};
pub use config::Config;
pub use engine::{Aggregator, Status};
pub use store::{Store, StoreError};

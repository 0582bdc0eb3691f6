//! The lifecycle every shelfsync service shares, written once so that a
//! service's own code is only what it does:
//!
//! - [`ConfigArgs`] and [`start`]: the `--config` files (or
//!   `SHELFSYNC_CONFIG`) loaded into settings, and telemetry initialised;
//!   [`main`], the whole `main` of a service that takes nothing else;
//! - [`shutdown_signal`]: SIGTERM or SIGINT, the start of a graceful stop;
//! - [`Drain`]: the one stop signal a service hands to its tasks (HTTP
//!   server, pollers, responders) instead of an ad-hoc channel;
//! - [`Probes`]: `/healthz`, `/readyz` and Prometheus `/metrics`;
//! - [`ApiTokens`] and [`protect`]: an HTTP API behind bearer tokens;
//! - [`serve`]: an axum router on a listener until the drain starts;
//!   [`serve_bounded`], the same for callers that may not be friendly
//!   (connection cap, header and idle timeouts);
//! - [`without_huge_pages`]: transparent huge pages off for the process
//!   ([`start`] does it).
//!
//! A service's `main` is then three lines (see `services/picks`), and its
//! [`Service::run_until`] starts its work with a [`Drain`], starts the
//! drain when `shutdown` resolves and waits for its tasks.
#![forbid(unsafe_code)]

mod api_tokens;
mod args;
mod bounded;
mod drain;
mod file_signature;
mod pages;
mod probes;
mod serve;
mod signal;

pub use api_tokens::{ApiTokens, protect};
pub use args::{ConfigArgs, main, start};
pub use bounded::{ConnLimits, serve_bounded};
pub use drain::Drain;
pub use file_signature::FileSignature;
pub use pages::without_huge_pages;
pub use probes::{Probes, Readiness};
pub use serve::{bind, serve, serve_with_peer_addr};
pub use signal::shutdown_signal;

use std::future::Future;

/// A service built from its settings and ready to run: what `main` runs
/// until the shutdown signal, and what a test spawns and stops at will.
/// `run_until` starts the service's work, and once `shutdown` resolves
/// drains it (the work in hand finished, connections closed) and returns.
pub trait Service: Send + 'static {
    fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;
}

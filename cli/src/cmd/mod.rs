//! One module per verb, each the same shape: `Args` (clap derive) and
//! `run(&Context, Args) -> anyhow::Result<()>`; a failure a script must
//! tell apart carries a [`crate::CliError`]. Output goes to stdout,
//! progress and summaries to stderr, so that stdout can be piped.

pub mod completions;
pub mod config;
pub mod consumer;
pub mod consumers;
pub mod dead_letters;
pub mod gen_feed;
pub mod get;
pub mod import;
pub mod keyframe;
pub mod rebase;
pub mod setup;
pub mod stats;
pub mod sweep;
pub mod tail;
pub mod wait;

/// Requests to storage over core NATS.
mod rpc;
/// Stream names and states shared by `setup`, `stats`, `consumers` and the
/// readers.
mod streams;

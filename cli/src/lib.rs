//! The shelfsync operator CLI as a library, so that tests and benchmarks
//! drive the very code the `shelfsync` binary runs.
//!
//! - [`Cli`] / [`run`]: the command line and its dispatch; `main` only
//!   parses, calls [`run`] and turns an error into an exit code;
//! - [`CliError`] / [`exit_code`]: the failures a script must tell apart
//!   (bad input, not found, timeout, unavailable), each its exit code;
//! - `cmd`: one module per verb, each the same small shape — an `Args`
//!   struct (clap derive) and `run(&Context, Args)`;
//! - [`json`]: `Record`, `Change` and `Rejection` as JSON, with `data` and
//!   `state` decoded (used by `get` and `tail`);
//! - [`genfeed`]: the deterministic synthetic feed generator behind
//!   `gen-feed`, pure and streaming, for demos, tests and benchmarks.
//!
//! The CLI is a client: it reaches NATS and Redis only through the shared
//! crates and the storage / ingest libraries, and keeps no state of its own.
#![forbid(unsafe_code)]

mod cmd;
mod context;
mod error;
pub mod genfeed;
pub mod team;
pub use shelfsync_proto::json;

use std::path::PathBuf;

use clap::{ArgAction, Parser, Subcommand};

pub use context::Context;
pub use error::{CliError, EXIT_CODES, exit_code};

/// Operate a shelfsync deployment: create its streams, run imports, read
/// records, watch changes and consumers, release held sweeps, re-drive dead
/// letters, check settings, generate demo feeds.
#[derive(Debug, Parser)]
#[command(name = "shelfsync", version, propagate_version = true, after_help = EXIT_CODES)]
pub struct Cli {
    /// Settings files (TOML), in order: repeat --config, or separate them
    /// with `:` in SHELFSYNC_CONFIG; a later file overrides an earlier one,
    /// and SHELFSYNC__SECTION__KEY environment variables override them all.
    #[arg(
        long,
        global = true,
        env = "SHELFSYNC_CONFIG",
        value_name = "FILE",
        value_delimiter = ':'
    )]
    pub config: Vec<PathBuf>,

    /// More log output on stderr (-v: info, -vv: debug). RUST_LOG wins.
    #[arg(short, long, global = true, action = ArgAction::Count)]
    pub verbose: u8,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The verbs.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or update the streams (idempotent) and show what exists.
    Setup(cmd::setup::Args),
    /// Run one import of a partner's feed from a file, a URL or stdin.
    Import(cmd::import::Args),
    /// Show one record as JSON, data and state decoded.
    Get(cmd::get::Args),
    /// Print a stream's messages as JSON lines: changes (default),
    /// keyframes, aggregates or rejects; new ones, or from a time, a
    /// sequence, the last N.
    Tail(cmd::tail::Args),
    /// Ask storage to publish a keyframe now (every place, or one).
    Keyframe(cmd::keyframe::Args),
    /// Write a deterministic synthetic partner feed.
    GenFeed(cmd::gen_feed::Args),
    /// Stream sizes, storage lag and outbox depth.
    Stats(cmd::stats::Args),
    /// Every consumer of every stream as JetStream reports it: pending,
    /// ack pending, redeliveries, last delivery and ack.
    Consumers(cmd::consumers::Args),
    /// A consumer team's least-privilege NATS user, Secret, NetworkPolicies
    /// and StatefulSet skeleton: add, remove, list (offline: edits files).
    Consumer(cmd::consumer::Args),
    /// Wait until storage has applied every queued command.
    Wait(cmd::wait::Args),
    /// List the sweeps storage held instead of applying them, or show what
    /// became of one import's sweeps.
    Sweeps(cmd::sweep::SweepsArgs),
    /// Apply the sweeps held for an import (after a look at its report).
    Sweep(cmd::sweep::ReleaseArgs),
    /// Resume partitions refused because their command stream was replaced.
    Rebase(cmd::rebase::Args),
    /// What storage could not publish (kept aside) or dead-lettered: list,
    /// show, re-drive.
    DeadLetters(cmd::dead_letters::Args),
    /// Check the settings the services would load, and print them
    /// resolved (secrets redacted).
    Config(cmd::config::Args),
    /// Print a shell completion script (e.g. `shelfsync completions bash >
    /// /etc/bash_completion.d/shelfsync`).
    Completions(cmd::completions::Args),
}

/// Runs one verb to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    // Settings are loaded per verb: gen-feed and completions are pure and
    // need neither settings nor servers, so a broken config file must not
    // stop them (and `config check` reports it).
    let ctx = || Context::load(&cli.config, cli.verbose);
    match cli.command {
        Command::GenFeed(args) => cmd::gen_feed::run(args),
        Command::Completions(args) => cmd::completions::run(args),
        Command::Config(args) => cmd::config::run(&cli.config, args),
        Command::Setup(args) => cmd::setup::run(&ctx()?, args).await,
        Command::Import(args) => cmd::import::run(&ctx()?, args).await,
        Command::Get(args) => cmd::get::run(&ctx()?, args).await,
        Command::Tail(args) => cmd::tail::run(&ctx()?, args).await,
        Command::Keyframe(args) => cmd::keyframe::run(&ctx()?, args).await,
        Command::Stats(args) => cmd::stats::run(&ctx()?, args).await,
        Command::Consumers(args) => cmd::consumers::run(&ctx()?, args).await,
        Command::Consumer(args) => cmd::consumer::run(&ctx()?, args),
        Command::Wait(args) => cmd::wait::run(&ctx()?, args).await,
        Command::Sweeps(args) => cmd::sweep::run(&ctx()?, args).await,
        Command::Sweep(args) => cmd::sweep::release(&ctx()?, args).await,
        Command::Rebase(args) => cmd::rebase::run(&ctx()?, args).await,
        Command::DeadLetters(args) => cmd::dead_letters::run(&ctx()?, args).await,
    }
}

/// True when the error comes from writing to a closed pipe (`… | head`):
/// the reader has all it wanted, which is not a failure.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

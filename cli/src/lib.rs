//! The shelfsync operator CLI (DESIGN §8, "CLI verbs") as a library, so that
//! tests and benchmarks drive the very code the `shelfsync` binary runs.
//!
//! - [`Cli`] / [`run`]: the command line and its dispatch; `main` only
//!   parses, calls [`run`] and turns an error into an exit code;
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
pub mod genfeed;
pub use shelfsync_proto::json;

use std::path::PathBuf;

use clap::{ArgAction, Parser, Subcommand};

pub use context::Context;

/// Operate a shelfsync deployment: create its streams, run imports, read
/// records, watch changes, generate demo feeds.
#[derive(Debug, Parser)]
#[command(name = "shelfsync", version, propagate_version = true)]
pub struct Cli {
    /// Settings file (TOML); every key can be overridden by
    /// SHELFSYNC__SECTION__KEY environment variables.
    #[arg(long, global = true, env = "SHELFSYNC_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// More log output on stderr (-v: info, -vv: debug). RUST_LOG wins.
    #[arg(short, long, global = true, action = ArgAction::Count)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or update the streams (idempotent) and show what exists.
    Setup(cmd::setup::Args),
    /// Run one import of a partner's feed from a file, a URL or stdin.
    Import(cmd::import::Args),
    /// Show one record as JSON, data and state decoded.
    Get(cmd::get::Args),
    /// Print changes (or rejections) as JSON lines as they happen.
    Tail(cmd::tail::Args),
    /// Ask storage to publish a keyframe now (every place, or one).
    Keyframe(cmd::keyframe::Args),
    /// Write a deterministic synthetic partner feed.
    GenFeed(cmd::gen_feed::Args),
    /// Stream sizes, storage lag and outbox depth.
    Stats(cmd::stats::Args),
    /// Wait until storage has applied every queued command.
    Wait(cmd::wait::Args),
}

/// Runs one verb to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    // Settings are loaded per verb: gen-feed is pure and needs neither
    // settings nor servers, so a broken config file must not stop it.
    let ctx = || Context::load(cli.config.as_deref(), cli.verbose);
    match cli.command {
        Command::GenFeed(args) => cmd::gen_feed::run(args),
        Command::Setup(args) => cmd::setup::run(&ctx()?, args).await,
        Command::Import(args) => cmd::import::run(&ctx()?, args).await,
        Command::Get(args) => cmd::get::run(&ctx()?, args).await,
        Command::Tail(args) => cmd::tail::run(&ctx()?, args).await,
        Command::Keyframe(args) => cmd::keyframe::run(&ctx()?, args).await,
        Command::Stats(args) => cmd::stats::run(&ctx()?, args).await,
        Command::Wait(args) => cmd::wait::run(&ctx()?, args).await,
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

//! `shelfsync`, the operator CLI. All logic lives in the `shelfsync_cli` library.
#![forbid(unsafe_code)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    // As every service does: `shelfsync import` is ingest in a process of its own.
    shelfsync_service::without_huge_pages();
    let cli = shelfsync_cli::Cli::parse();
    match shelfsync_cli::run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if shelfsync_cli::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(shelfsync_cli::exit_code(&e))
        }
    }
}

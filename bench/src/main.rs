//! `shelfsync-bench`: the benchmark harness (see the library docs and docs/PERFORMANCE.md).
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    shelfsync_bench::run(shelfsync_bench::Cli::parse()).await
}

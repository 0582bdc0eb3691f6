//! `shelfsync-bench`: the benchmark harness (see the library docs and docs/PERFORMANCE.md).
use clap::Parser;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    shelfsync_bench::run(shelfsync_bench::Cli::parse()).await
}

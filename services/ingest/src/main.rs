//! `shelfsync-ingest`: the ingest service (see the library for what it does).

use clap::Parser;
use shelfsync_service::{ConfigArgs, Service};

#[derive(Parser)]
#[command(version, about = "shelfsync ingest: partner feeds to PATCH commands")]
struct Args {
    #[command(flatten)]
    config: ConfigArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (settings, _telemetry) = shelfsync_service::start("shelfsync-ingest", &args.config)?;
    let app = shelfsync_ingest::App::build(settings).await?;
    app.run_until(shelfsync_service::shutdown_signal()).await
}

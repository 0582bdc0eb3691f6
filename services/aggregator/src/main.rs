//! `shelfsync-aggregator`: master cards and the category cache, from the
//! change stream.

use clap::Parser;
use shelfsync_service::{ConfigArgs, Service};

#[derive(Parser)]
#[command(
    name = "shelfsync-aggregator",
    version,
    about = "master cards (min price per product and region) and non-empty categories per place"
)]
struct Args {
    #[command(flatten)]
    config: ConfigArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (settings, _telemetry) = shelfsync_service::start("shelfsync-aggregator", &args.config)?;
    shelfsync_aggregator::App::build(settings)
        .await?
        .run_until(shelfsync_service::shutdown_signal())
        .await
}

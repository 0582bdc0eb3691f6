//! `shelfsync-recommender`: top-N offers per place and category, from the
//! change stream.

use clap::Parser;
use shelfsync_service::{ConfigArgs, Service};

#[derive(Parser)]
#[command(
    name = "shelfsync-recommender",
    version,
    about = "in-memory top-N offers per place and category, over HTTP and NATS"
)]
struct Args {
    #[command(flatten)]
    config: ConfigArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (settings, _telemetry) = shelfsync_service::start("shelfsync-recommender", &args.config)?;
    shelfsync_recommender::App::build(settings)
        .await?
        .run_until(shelfsync_service::shutdown_signal())
        .await
}

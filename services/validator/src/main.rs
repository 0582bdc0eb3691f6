//! `shelfsync-validator`: hides offers that break the configured rules.

use clap::Parser;
use shelfsync_service::{ConfigArgs, Service};

#[derive(Parser)]
#[command(name = "shelfsync-validator", version, about = "shelfsync validator service")]
struct Args {
    #[command(flatten)]
    config: ConfigArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (settings, _telemetry) = shelfsync_service::start("shelfsync-validator", &args.config)?;
    shelfsync_validator::App::build(settings)
        .await?
        .run_until(shelfsync_service::shutdown_signal())
        .await
}

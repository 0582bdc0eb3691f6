//! `shelfsync-recommender`: top-N offers per place and category, from the
//! change stream.
use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "shelfsync-recommender",
    version,
    about = "in-memory top-N offers per place and category, over HTTP and NATS"
)]
struct Args {
    /// TOML settings file; SHELFSYNC__SECTION__KEY variables override it.
    #[arg(long, env = "SHELFSYNC_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = shelfsync_settings::Settings::load(args.config.as_deref())?;
    let _telemetry = shelfsync_telemetry::init("shelfsync-recommender", &settings.telemetry)?;
    shelfsync_recommender::App::build(settings)
        .await?
        .run_until(shelfsync_telemetry::shutdown_signal())
        .await
}

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
    /// TOML settings files, in order (repeat --config, or separate them with
    /// `:` in SHELFSYNC_CONFIG): a later file overrides an earlier one, and
    /// SHELFSYNC__SECTION__KEY variables override them all.
    #[arg(long, env = "SHELFSYNC_CONFIG", value_name = "FILE", value_delimiter = ':')]
    config: Vec<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = shelfsync_settings::Settings::load_files(&args.config)?;
    let _telemetry = shelfsync_telemetry::init("shelfsync-recommender", &settings.telemetry)?;
    shelfsync_recommender::App::build(settings)
        .await?
        .run_until(shelfsync_telemetry::shutdown_signal())
        .await
}

//! `shelfsync-storage`: applies partitioned command batches to Redis.
use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(name = "shelfsync-storage", version, about = "shelfsync storage service")]
struct Args {
    /// TOML settings file; SHELFSYNC__SECTION__KEY variables override it.
    #[arg(long, env = "SHELFSYNC_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = shelfsync_settings::Settings::load(args.config.as_deref())?;
    let _telemetry = shelfsync_telemetry::init("shelfsync-storage", &settings.telemetry)?;
    shelfsync_storage::App::build(settings)
        .await?
        .run_until(shelfsync_storage::shutdown_signal())
        .await
}

//! `shelfsync-ingest`: the ingest service (see the library for what it does).
use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(version, about = "shelfsync ingest: partner feeds to PATCH commands")]
struct Args {
    /// TOML settings file (every key can be overridden by SHELFSYNC__SECTION__KEY).
    #[arg(long, env = "SHELFSYNC_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = shelfsync_settings::Settings::load(args.config.as_deref())?;
    let _telemetry = shelfsync_telemetry::init("ingest", &settings.telemetry)?;
    let app = shelfsync_ingest::App::build(settings).await?;
    app.run_until(shelfsync_ingest::shutdown_signal()).await
}

//! `shelfsync-ingest`: the ingest service (see the library for what it does).
use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(version, about = "shelfsync ingest: partner feeds to PATCH commands")]
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
    let _telemetry = shelfsync_telemetry::init("shelfsync-ingest", &settings.telemetry)?;
    let app = shelfsync_ingest::App::build(settings).await?;
    app.run_until(shelfsync_ingest::shutdown_signal()).await
}

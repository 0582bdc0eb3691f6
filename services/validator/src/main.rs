//! `shelfsync-validator`: hides offers that break the configured rules.
use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(name = "shelfsync-validator", version, about = "shelfsync validator service")]
struct Args {
    /// TOML settings file; SHELFSYNC__SECTION__KEY variables override it.
    #[arg(long, env = "SHELFSYNC_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = shelfsync_settings::Settings::load(args.config.as_deref())?;
    let _telemetry = shelfsync_telemetry::init("shelfsync-validator", &settings.telemetry)?;
    shelfsync_validator::App::build(settings)
        .await?
        .run_until(shelfsync_validator::shutdown_signal())
        .await
}

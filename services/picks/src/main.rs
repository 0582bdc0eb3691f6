//! `shelfsync-picks`: the example ChangeFeed service (discounted picks).
use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "shelfsync-picks",
    version,
    about = "discounted picks per place, from the change stream"
)]
struct Args {
    /// TOML settings file; SHELFSYNC__SECTION__KEY variables override it.
    #[arg(long, env = "SHELFSYNC_CONFIG")]
    config: Option<PathBuf>,
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = shelfsync_settings::Settings::load(args.config.as_deref())?;
    let _telemetry = shelfsync_telemetry::init("shelfsync-picks", &settings.telemetry)?;
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    let picks = shelfsync_picks::Picks::default();
    shelfsync_picks::run(settings, listener, picks, shelfsync_telemetry::shutdown_signal()).await
}

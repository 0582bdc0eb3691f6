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
    /// TOML settings files, in order (repeat --config, or separate them with
    /// `:` in SHELFSYNC_CONFIG): a later file overrides an earlier one, and
    /// SHELFSYNC__SECTION__KEY variables override them all.
    #[arg(long, env = "SHELFSYNC_CONFIG", value_name = "FILE", value_delimiter = ':')]
    config: Vec<PathBuf>,
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = shelfsync_settings::Settings::load_files(&args.config)?;
    let _telemetry = shelfsync_telemetry::init("shelfsync-picks", &settings.telemetry)?;
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    let picks = shelfsync_picks::Picks::default();
    shelfsync_picks::run(settings, listener, picks, shelfsync_telemetry::shutdown_signal()).await
}

//! `shelfsync-picks`: the example ChangeFeed service (discounted picks).

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use shelfsync_service::{ConfigArgs, Service};

#[derive(Parser)]
#[command(
    name = "shelfsync-picks",
    version,
    about = "discounted picks per place, from the change stream"
)]
struct Args {
    #[command(flatten)]
    config: ConfigArgs,
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (settings, _telemetry) = shelfsync_service::start("shelfsync-picks", &args.config)?;
    shelfsync_picks::App::build(settings, &args.listen)
        .await?
        .run_until(shelfsync_service::shutdown_signal())
        .await
}

//! `shelfsync-validator`: hides offers that break the configured rules.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let about = "shelfsync validator service";
    shelfsync_service::main("shelfsync-validator", about, shelfsync_validator::App::build).await
}

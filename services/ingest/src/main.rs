//! `shelfsync-ingest`: the ingest service (see the library for what it does).

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let about = "shelfsync ingest: partner feeds to PATCH commands";
    shelfsync_service::main("shelfsync-ingest", about, shelfsync_ingest::App::build).await
}

//! `shelfsync-storage`: applies partitioned command batches to Redis.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let about = "shelfsync storage service";
    shelfsync_service::main("shelfsync-storage", about, shelfsync_storage::App::build).await
}

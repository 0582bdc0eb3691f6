//! `shelfsync-aggregator`: master cards and the category cache, from the
//! change stream.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let about =
        "master cards (min price per product and region) and non-empty categories per place";
    shelfsync_service::main("shelfsync-aggregator", about, shelfsync_aggregator::App::build).await
}

//! `shelfsync-recommender`: top-N offers per place and category, from the
//! change stream.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let about = "in-memory top-N offers per place and category, over HTTP and NATS";
    shelfsync_service::main("shelfsync-recommender", about, shelfsync_recommender::App::build).await
}

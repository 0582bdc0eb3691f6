//! Compiles `proto/` with protox (pure Rust), so no system `protoc` is needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("shelfsync/v1/shelfsync.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    // An outbox entry's payload is handed from the commit to the relay and
    // to the publish: shared bytes, not a copy at each step.
    prost_build::Config::new().bytes([".shelfsync.v1.OutboxEntry.payload"]).compile_fds(fds)?;
    Ok(())
}

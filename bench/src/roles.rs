//! What the child processes run. Settings come from `SHELFSYNC__*` variables (the parent sets
//! them), loaded exactly as the services load theirs.

use std::path::Path;

use shelfsync_ingest::{ImportConfig, Importer, Source};
use shelfsync_service::Service as _;
use shelfsync_settings::Settings;

use crate::cli::ChildRole;
use crate::measure;
use crate::reference::RefKind;

pub async fn run(role: ChildRole) -> anyhow::Result<()> {
    // As `shelfsync_service::start` does in every service (and `shelfsync import`); only in the
    // children, so that the servers the harness starts keep the machine's setting.
    shelfsync_service::without_huge_pages();
    let settings = Settings::load(None)?;
    match role {
        ChildRole::Storage => storage(settings).await,
        ChildRole::Floor => crate::reference::run(RefKind::Floor, settings).await,
        ChildRole::Naive => crate::reference::run(RefKind::Naive, settings).await,
        ChildRole::Import { path } => import(settings, &path).await,
    }
}

/// What `shelfsync_service::main` does for storage once the settings are loaded.
async fn storage(settings: Settings) -> anyhow::Result<()> {
    let _telemetry = shelfsync_telemetry::init("shelfsync-storage", &settings.telemetry)?;
    shelfsync_storage::App::build(settings)
        .await?
        .run_until(shelfsync_storage::shutdown_signal())
        .await
}

/// One full import of `path` by the ingest library, then one JSON line on stdout: the report's
/// counts, this process' CPU seconds and its peak RSS (`VmHWM`, read before exiting).
async fn import(settings: Settings, path: &Path) -> anyhow::Result<()> {
    let importer = Importer::connect(ImportConfig::from(&settings)).await?;
    let rss_before_kb = measure::status_kb("self", "VmRSS").unwrap_or(0);
    let report = importer
        .import(&crate::world::partner(false), Source::File(path.to_path_buf()), None)
        .await?;
    let line = serde_json::json!({
        "items": report.items,
        "bytes_in": report.bytes_in,
        "bytes_out": report.bytes_out,
        "duration_ms": report.duration_ms,
        "cpu_s": measure::self_cpu_seconds(),
        "rss_before_kb": rss_before_kb,
        "vm_hwm_kb": measure::status_kb("self", "VmHWM").unwrap_or(0),
    });
    println!("{line}");
    Ok(())
}

//! Process plumbing for every shelfsync binary: tracing initialisation and
//! the shutdown signal.
//!
//! `init` installs the subscriber (env filter, text or JSON lines) and returns
//! a guard to hold for the life of the process. OpenTelemetry export is added
//! here, behind the same call, so services never touch exporters themselves.
#![forbid(unsafe_code)]

use shelfsync_settings::{LogFormat, TelemetrySettings};
use tracing_subscriber::EnvFilter;

/// Flushes telemetry when dropped. Hold it until `main` returns.
#[must_use = "telemetry is flushed when the guard is dropped"]
pub struct Guard {
    _private: (),
}

/// Installs the global subscriber for `service`. `RUST_LOG` wins over the
/// configured level. Calling it twice (tests) keeps the first subscriber.
pub fn init(service: &str, cfg: &TelemetrySettings) -> anyhow::Result<Guard> {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log_level))
        .map_err(|e| anyhow::anyhow!("invalid telemetry.log_level {:?}: {e}", cfg.log_level))?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let installed = match cfg.log_format {
        LogFormat::Text => builder.with_target(false).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).try_init(),
    };
    if installed.is_ok() {
        tracing::debug!(service, "telemetry initialised");
    }
    Ok(Guard { _private: () })
}

/// Resolves on SIGTERM or SIGINT: the start of a graceful shutdown.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutdown signal received");
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

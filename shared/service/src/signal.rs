//! The process signal that starts a graceful shutdown.

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

//! Serving a service's HTTP router: bound where the settings say, traced
//! and measured, until the service's drain starts (then in-flight requests
//! finish).

use std::io;
use std::net::SocketAddr;

use anyhow::Context as _;
use axum::Router;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::Drain;

/// Binds `listen` (`host:port`; port 0 picks a free one).
pub async fn bind(listen: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))
}

/// Serves `router` (instrumented: server spans and HTTP metrics) on
/// `listener` in a task, until `drain` starts.
pub fn serve(listener: TcpListener, router: Router, drain: &Drain) -> JoinHandle<io::Result<()>> {
    let router = shelfsync_telemetry::instrument(router);
    tokio::spawn(
        axum::serve(listener, router).with_graceful_shutdown(drain.started()).into_future(),
    )
}

/// As [`serve`], the handlers able to take the peer's address
/// (`ConnectInfo<SocketAddr>`).
pub fn serve_with_peer_addr(
    listener: TcpListener,
    router: Router,
    drain: &Drain,
) -> JoinHandle<io::Result<()>> {
    let router =
        shelfsync_telemetry::instrument(router).into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(
        axum::serve(listener, router).with_graceful_shutdown(drain.started()).into_future(),
    )
}

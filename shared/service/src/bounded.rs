//! Serving an HTTP/1.1 router to callers that may not be friendly (ingest's
//! push endpoint faces partners and the internet): at most
//! `max_connections` connections at once (the others wait in the listen
//! backlog), a request's headers within `header_timeout` of when the
//! connection started waiting for them, and a connection with no request
//! in flight closed after `idle_timeout`. What a request may then take (its
//! body's size and time) is the handler's to bound.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::ServiceExt as _;
use tracing::debug;

use crate::Drain;

/// What one caller may hold of a server.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// A request's headers must be in by then (hyper's header read timeout,
    /// armed whenever the connection waits for the next request).
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub idle_timeout: Duration,
}

/// In-flight requests of one connection and when it last had none.
struct Activity {
    in_flight: AtomicUsize,
    idle_since: Mutex<Instant>,
}

impl Activity {
    async fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(self.idle_since.lock().await.elapsed())
    }
}

/// Serves `router` (instrumented, with the peer's address as
/// `ConnectInfo<SocketAddr>`) on `listener` within `limits`, until `drain`
/// starts; then connections finish the request in hand and close.
pub fn serve_bounded(
    listener: TcpListener,
    router: Router,
    drain: &Drain,
    limits: ConnLimits,
) -> JoinHandle<io::Result<()>> {
    let router = shelfsync_telemetry::instrument(router);
    let drain = drain.clone();
    tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
        let mut connections = tokio::task::JoinSet::new();
        loop {
            // A slot first: past the cap, callers wait in the backlog.
            let slot = tokio::select! {
                slot = slots.clone().acquire_owned() => slot.map_err(io::Error::other)?,
                () = drain.started() => break,
            };
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        debug!(error = %e, "accept failed");
                        continue;
                    }
                },
                () = drain.started() => break,
            };
            let router = router.clone();
            let drain = drain.clone();
            connections.spawn(async move {
                serve_connection(stream, peer, router, limits, drain).await;
                drop(slot);
            });
            while connections.try_join_next().is_some() {}
        }
        while connections.join_next().await.is_some() {}
        Ok(())
    })
}

async fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    router: Router,
    limits: ConnLimits,
    drain: Drain,
) {
    let activity = Arc::new(Activity {
        in_flight: AtomicUsize::new(0),
        idle_since: Mutex::new(Instant::now()),
    });
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            let (router, activity) = (router.clone(), activity.clone());
            request.extensions_mut().insert(ConnectInfo(peer));
            async move {
                activity.in_flight.fetch_add(1, Ordering::SeqCst);
                let response = router.oneshot(request).await;
                *activity.idle_since.lock().await = Instant::now();
                activity.in_flight.fetch_sub(1, Ordering::SeqCst);
                response
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let mut check = tokio::time::interval((limits.idle_timeout / 4).max(Duration::from_millis(50)));
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    debug!(%peer, error = %e, "connection ended");
                }
                return;
            }
            _ = check.tick(), if !closing => {
                if activity.idle_for().await.is_some_and(|idle| idle >= limits.idle_timeout) {
                    debug!(%peer, "idle connection closed");
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
            () = drain.started(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    }
}

//! Builds storage from settings and runs its partition workers until told
//! to stop.

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use shelfsync_bus::{PAYLOAD_HEADROOM, Partition, Subjects};
use shelfsync_settings::Settings;
use tokio::sync::watch;
use tracing::{error, info};

use crate::stats::Stats;
use crate::store::Store;
use crate::worker::Worker;

pub struct App {
    settings: Arc<Settings>,
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    store: Store,
    stats: Arc<Stats>,
}

impl App {
    /// Connects to NATS and Redis and makes sure the streams exist.
    pub async fn build(settings: Settings) -> anyhow::Result<App> {
        let client = shelfsync_bus::connect(&settings.nats, "shelfsync-storage", true).await?;
        let js = shelfsync_bus::jetstream(client.clone(), &settings.nats);
        shelfsync_bus::provision(&js, &settings).await?;
        let store = Store::connect(&settings.redis)
            .await
            .with_context(|| format!("cannot connect to Redis at {}", settings.redis.url))?;
        Ok(App {
            settings: Arc::new(settings),
            client,
            js,
            store,
            stats: Arc::default(),
        })
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Runs every owned partition until `shutdown` resolves, then lets each
    /// worker finish the message in hand and flushes the connection.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let max_payload = self.client.server_info().max_payload;
        let max_bytes = max_payload.saturating_sub(PAYLOAD_HEADROOM).max(64 * 1024);
        let owned = self.settings.storage.owned_partitions();
        info!(
            replica = self.settings.storage.replica,
            replicas = self.settings.storage.replicas,
            partitions = owned.len(),
            "storage starting"
        );
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        for p in owned {
            let worker = Worker {
                partition: Partition(p),
                settings: self.settings.clone(),
                subjects: Subjects::new(&self.settings.nats.prefix),
                js: self.js.clone(),
                store: self.store.clone(),
                stats: self.stats.clone(),
                max_bytes,
            };
            let rx = stop_rx.clone();
            tasks.spawn(async move {
                let p = worker.partition;
                if let Err(e) = worker.run(rx).await {
                    error!(partition = %p, error = format!("{e:#}"), "partition worker stopped");
                    return Err(e);
                }
                Ok(())
            });
        }
        tokio::select! {
            _ = shutdown => info!("shutting down: finishing messages in hand"),
            Some(res) = tasks.join_next() => {
                // A worker ended on its own: stop the rest and report why.
                let _ = stop_tx.send(true);
                while tasks.join_next().await.is_some() {}
                res??;
                anyhow::bail!("a partition worker stopped unexpectedly");
            }
        }
        let _ = stop_tx.send(true);
        while let Some(res) = tasks.join_next().await {
            if let Err(e) = res {
                error!(error = %e, "partition worker panicked");
            }
        }
        self.client.flush().await.ok();
        info!("storage stopped");
        Ok(())
    }
}

/// Resolves on SIGTERM or SIGINT.
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
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

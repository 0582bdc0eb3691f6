//! One stop signal per running service: started once (by the shutdown
//! future, or by a task that failed), seen by every task that holds a clone.
//! It replaces the watch channels each service used to make by hand.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;

/// A stop signal and its watchers in one clonable value: [`Drain::start`]
/// begins the drain, [`Drain::started`] resolves once it has begun (at once
/// if it already has).
#[derive(Debug, Clone)]
pub struct Drain {
    tx: Arc<watch::Sender<bool>>,
    rx: watch::Receiver<bool>,
}

impl Default for Drain {
    fn default() -> Self {
        Self::new()
    }
}

impl Drain {
    pub fn new() -> Self {
        let (tx, rx) = watch::channel(false);
        Drain { tx: Arc::new(tx), rx }
    }

    /// Begins the drain: every [`Drain::started`] resolves. Idempotent.
    pub fn start(&self) {
        self.tx.send_replace(true);
    }

    /// True once the drain has begun.
    pub fn is_started(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once the drain has begun; owns what it needs, so it can be
    /// handed to a spawned task or a graceful-shutdown hook.
    pub fn started(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.rx.clone();
        async move {
            // The sender lives as long as any clone of the drain, this one
            // included: an error is impossible while we wait.
            let _ = rx.wait_for(|started| *started).await;
        }
    }

    /// Starts the drain once `shutdown` resolves (then returns).
    pub async fn start_on(&self, shutdown: impl Future<Output = ()>) {
        shutdown.await;
        self.start();
    }

    /// The underlying receiver, for code that selects on a
    /// `watch::Receiver<bool>` (true once draining).
    pub fn receiver(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn every_clone_sees_the_start_even_a_late_one() {
        let drain = Drain::new();
        let early = tokio::spawn(drain.started());
        assert!(!drain.is_started());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!early.is_finished(), "resolved before the drain started");
        drain.clone().start();
        tokio::time::timeout(Duration::from_secs(1), early).await.expect("early").expect("task");
        assert!(drain.is_started());
        // A watcher made after the start resolves at once.
        tokio::time::timeout(Duration::from_secs(1), drain.started()).await.expect("late");
        drain.start();
        assert!(*drain.receiver().borrow());
    }

    #[tokio::test]
    async fn start_on_waits_for_the_shutdown_future() {
        let drain = Drain::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn({
            let drain = drain.clone();
            async move {
                drain
                    .start_on(async move {
                        let _ = rx.await;
                    })
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!drain.is_started());
        tx.send(()).expect("send");
        task.await.expect("task");
        assert!(drain.is_started());
    }
}

//! Starting keyframes: the [`Keyframer`] hands a keyframe job to the
//! workers of this replica, on the configured cron schedule
//! ([`schedule_keyframes`]) or on request (`crate::requests`).

use std::str::FromStr;

use shelfsync_bus::Partition;
use shelfsync_proto::{KeyframeReply, PlaceKey};
use shelfsync_service::Drain;
use shelfsync_telemetry::chain;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info};

use super::{JobProgress, KeyframeJob, keyframe_id_at};

/// Sends keyframe jobs to the workers of this replica.
#[derive(Clone)]
pub(crate) struct Keyframer {
    js: async_nats::jetstream::Context,
    changes_stream: String,
    replica: u32,
    partitions: u32,
    workers: Vec<(Partition, mpsc::Sender<KeyframeJob>)>,
}

impl Keyframer {
    /// A keyframer of no worker yet (see [`Keyframer::add_worker`]).
    pub(crate) fn new(
        js: async_nats::jetstream::Context,
        changes_stream: String,
        replica: u32,
        partitions: u32,
    ) -> Self {
        Keyframer { js, changes_stream, replica, partitions, workers: Vec::new() }
    }

    /// The worker of `partition` takes its keyframe jobs from the receiver
    /// returned.
    pub(crate) fn add_worker(&mut self, partition: Partition) -> mpsc::Receiver<KeyframeJob> {
        let (job_tx, job_rx) = mpsc::channel(16);
        self.workers.push((partition, job_tx));
        job_rx
    }

    /// Starts a keyframe of every owned place, or of one place if this
    /// replica owns it (`None` otherwise); the reply arrives when done.
    pub(crate) async fn start(
        &self,
        keyframe_id: String,
        place: Option<PlaceKey>,
    ) -> Option<oneshot::Receiver<KeyframeReply>> {
        let targets: Vec<_> = match place {
            Some(place) => {
                let owner = Partition::of(place, self.partitions);
                self.workers.iter().filter(|(w, _)| *w == owner).collect()
            }
            None => self.workers.iter().collect(),
        };
        if targets.is_empty() {
            return None;
        }
        // Consumers bootstrapping from this run read changes after this point.
        let changes_seq = match self.js.get_stream(&self.changes_stream).await {
            Ok(mut s) => s.info().await.map(|i| i.state.last_sequence).unwrap_or(0),
            Err(_) => 0,
        };
        let (tx, rx) = oneshot::channel();
        let progress = JobProgress::new(keyframe_id.clone(), self.replica, targets.len(), Some(tx));
        for (_, worker) in targets {
            let job = KeyframeJob {
                keyframe_id: keyframe_id.clone(),
                changes_seq,
                place,
                progress: progress.clone(),
            };
            if worker.send(job).await.is_err() {
                progress.worker_done(Some("worker stopped".into())).await;
            }
        }
        Some(rx)
    }
}

/// Fires keyframes on the configured cron schedule (UTC). Every replica runs
/// the same schedule; the keyframe id derives from the tick, so all replicas
/// of one tick share it.
pub(crate) async fn schedule_keyframes(schedule: String, keyframer: Keyframer, stop: Drain) {
    let expr = schedule.trim();
    if expr.is_empty() {
        return;
    }
    let schedule = match cron::Schedule::from_str(expr) {
        Ok(s) => s,
        Err(e) => {
            error!(error = %chain(&e), "invalid keyframe schedule; keyframes only on demand");
            return;
        }
    };
    loop {
        let Some(next) = schedule.upcoming(chrono::Utc).next() else { return };
        let wait = (next - chrono::Utc::now()).to_std().unwrap_or_default();
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.started() => return,
        }
        let id = keyframe_id_at(next.timestamp_micros());
        info!(keyframe_id = %id, "scheduled keyframe");
        if let Some(done) = keyframer.start(id, None).await {
            // Don't start the next tick's keyframe while this one runs.
            tokio::select! {
                _ = done => {}
                _ = stop.started() => return,
            }
        }
    }
}

//! A consumer on the ChangeFeed kit that mirrors storage ([`FeedMirror`],
//! with fault knobs), run in a task until stopped ([`RunningFeed`]).

use std::collections::HashMap;
use std::time::Duration;

use shelfsync_proto::Record;
use tokio::sync::oneshot;

use crate::model::{RecordId, SerialModel, id_of, observed};
use crate::{Harness, eventually};

/// A consumer-side replica on the ChangeFeed kit: the latest version of
/// every record, and a log of every version the kit handed over (to check
/// that each transition arrives exactly once). Fault knobs: `pause` (a
/// write-locked pause makes `apply` hang, as a stuck dependency would) and
/// `fail_once` (the first delivery of these product ids fails transiently,
/// so the message is nak'd and redelivered later, out of order).
#[derive(Clone, Default)]
pub struct FeedMirror {
    pub records: std::sync::Arc<std::sync::Mutex<HashMap<RecordId, Record>>>,
    pub applied: std::sync::Arc<std::sync::Mutex<Vec<(RecordId, i64)>>>,
    pub pause: std::sync::Arc<tokio::sync::RwLock<()>>,
    pub fail_once: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    pub failures: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl shelfsync_feed::Handler for FeedMirror {
    async fn apply(
        &mut self,
        updates: &[shelfsync_feed::Update],
    ) -> Result<(), shelfsync_feed::HandlerError> {
        let _running = self.pause.read().await;
        {
            let mut fail = self.fail_once.lock().expect("lock");
            if let Some(u) = updates.iter().find(|u| fail.contains(&u.key.product_id)) {
                fail.remove(&u.key.product_id);
                self.failures.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                return Err(shelfsync_feed::HandlerError::Transient("injected".into()));
            }
        }
        let mut records = self.records.lock().expect("lock");
        let mut applied = self.applied.lock().expect("lock");
        for u in updates {
            records.insert(id_of(&u.key), u.after.clone());
            applied.push((id_of(&u.key), u.after.updated_at));
        }
        Ok(())
    }

    async fn reset_place(
        &mut self,
        place: shelfsync_feed::PlaceKey,
    ) -> Result<(), shelfsync_feed::HandlerError> {
        let shelfsync_feed::PlaceKey { brand_id, place_id } = place;
        self.records.lock().expect("lock").retain(|(b, p, _), _| (*b, *p) != (brand_id, place_id));
        Ok(())
    }
}

impl FeedMirror {
    /// The mirror equals storage record by record (timestamps included).
    pub async fn assert_equals_storage(&self, h: &Harness, brand: i64, places: &[i64]) {
        let stored = h.records_of(brand, places).await.expect("storage records");
        let mine = self.records.lock().expect("lock").clone();
        assert_eq!(mine.len(), stored.len(), "mirror vs storage record count");
        for (k, s) in &stored {
            let m = mine.get(k).unwrap_or_else(|| panic!("the mirror lacks {k:?}"));
            assert_eq!(m.updated_at, s.updated_at, "{k:?}: updated_at");
            assert!(observed(m) == observed(s), "{k:?}: the mirror differs from storage");
        }
    }

    /// Once `feed`, this mirror's, caught up (30 s at the most): the mirror
    /// equals storage in `places` of `brand`, and it saw each of `model`'s
    /// transitions once.
    pub async fn assert_mirrors(
        &self,
        feed: &RunningFeed,
        h: &Harness,
        model: &SerialModel,
        brand: i64,
        places: &[i64],
    ) {
        feed.wait_caught_up(h, Duration::from_secs(30)).await;
        self.assert_equals_storage(h, brand, places).await;
        self.assert_each_transition_once(model);
    }

    /// Every version was handed over once, and per record the versions are
    /// the serial model's transitions (for a feed that saw every change).
    pub fn assert_each_transition_once(&self, model: &SerialModel) {
        let applied = self.applied.lock().expect("lock").clone();
        let mut seen = std::collections::HashSet::new();
        for a in &applied {
            assert!(seen.insert(a.clone()), "{a:?} was handed to the consumer twice");
        }
        let mut per_key: HashMap<RecordId, usize> = HashMap::new();
        for (k, _) in &applied {
            *per_key.entry(k.clone()).or_default() += 1;
        }
        for (k, want) in &model.transitions {
            assert_eq!(per_key.get(k).copied().unwrap_or(0), want.len(), "{k:?}: transitions seen");
        }
        assert_eq!(applied.len(), model.changes, "transitions handed to the consumer in all");
    }

    /// The digest of one place as the mirror holds it.
    pub fn digest(&self, brand: i64, place: i64) -> shelfsync_bus::digest::Digest {
        let mut d = shelfsync_bus::digest::Digest::default();
        for ((b, p, id), r) in self.records.lock().expect("lock").iter() {
            if (*b, *p) == (brand, place) {
                d.add(id, r.updated_at);
            }
        }
        d
    }
}

/// A ChangeFeed running in a task until stopped; hands the feed back so it
/// can be resumed with its state.
pub struct RunningFeed {
    pub status: std::sync::Arc<shelfsync_feed::FeedStatus>,
    /// The durable consumer's name.
    pub name: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<shelfsync_feed::ChangeFeed>>,
}

impl RunningFeed {
    /// Runs `feed`, whose durable consumer is `name`, with `handler`.
    pub fn start(
        name: &str,
        mut feed: shelfsync_feed::ChangeFeed,
        handler: impl shelfsync_feed::Handler + 'static,
    ) -> Self {
        let status = feed.status();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut handler = handler;
            feed.run(&mut handler, async move {
                let _ = rx.await;
            })
            .await
            .expect("the change feed runs");
            feed
        });
        Self { status, name: name.to_string(), stop: Some(tx), task: Some(task) }
    }

    /// A feed over every place from the first change (see
    /// [`tail_from_start`]), durable consumer `name`.
    pub fn tail(h: &Harness, name: &str, handler: FeedMirror) -> Self {
        Self::start(name, tail_from_start(h, name), handler)
    }

    /// Asks the feed to stop and returns it once the batch in hand is done.
    pub async fn stop(mut self) -> shelfsync_feed::ChangeFeed {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.take().expect("running").await.expect("the feed task")
    }

    /// Waits until the feed has handled and acked the CHANGES stream up to
    /// its end (as it stands when called). Read from the consumer's info:
    /// the kit's `position` is the last message handled, which after a
    /// redelivery is an older one.
    pub async fn wait_caught_up(&self, h: &Harness, timeout: Duration) {
        let last = h.changes_last_seq().await.expect("changes stream");
        let stream = h.subjects.changes_stream();
        eventually(timeout, "the consumer to catch up with the change stream", || async {
            self.status.bootstrapped.load(std::sync::atomic::Ordering::SeqCst)
                && h.consumer_info(&stream, &self.name).await.is_ok_and(|i| {
                    i.delivered.stream_sequence >= last
                        && i.num_pending == 0
                        && i.num_ack_pending == 0
                })
        })
        .await;
    }
}

impl Drop for RunningFeed {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A ChangeFeed over every place that tails from the first change (no
/// keyframe asked for), so it sees every transition.
pub fn tail_from_start(h: &Harness, name: &str) -> shelfsync_feed::ChangeFeed {
    let mut cfg = shelfsync_feed::FeedConfig::new(name);
    cfg.request_keyframe_if_missing = false;
    cfg.ack_wait = Duration::from_secs(5);
    shelfsync_feed::ChangeFeed::new(h.client.clone(), &h.settings.nats, cfg)
}

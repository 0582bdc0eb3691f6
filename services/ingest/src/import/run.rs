//! The publishing side of one running import: the parser thread's events
//! batched per partition and published (commands, rejections), progress,
//! and the sweeps of a good full import.

use super::*;
use crate::metrics;

/// What the parser thread sends: commands are built there, off the runtime,
/// already in their wire bytes (batched as they are, never encoded again).
/// A rejection is boxed: it is rare and several times a command's size,
/// and every event is moved twice (into its chunk, out of it). A command is
/// not: nearly every event is one, and boxing it would add an allocation
/// per item.
pub(super) enum Event {
    Place(i64),
    Command(EncodedCommand),
    Reject(i64, Box<Rejection>),
}

/// Counts raw feed bytes for progress and the report.
pub(super) struct Counting<R> {
    pub(super) inner: R,
    pub(super) count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The state of one running import on the publishing side.
pub(super) struct Run<'a> {
    pub(super) partner: &'a PartnerSettings,
    pub(super) subjects: &'a Subjects,
    pub(super) partitions: u32,
    pub(super) publisher: Publisher,
    pub(super) batcher: EncodedBatcher,
    /// How command batches are encoded on the wire.
    pub(super) compression: Compression,
    /// Batches published per partition, for deterministic message ids.
    pub(super) batch_seq: HashMap<Partition, u64>,
    /// Rejections waiting, all of one place.
    pub(super) rejects: (i64, Vec<Rejection>),
    pub(super) reject_seq: u64,
    /// Places seen, with how many of their items were accepted.
    pub(super) places: BTreeMap<i64, u64>,
    pub(super) report: &'a mut ImportReport,
}

impl Run<'_> {
    /// Parses on a blocking thread and publishes what it sends. Commands of
    /// good items before a feed error are still published (they are valid
    /// PATCHes); the error is returned after.
    pub(super) async fn pipeline(
        &mut self,
        reader: FeedReader,
        cfg: &shelfsync_settings::IngestSettings,
        progress: ProgressFn<'_>,
    ) -> Result<(), ImportError> {
        let bytes_in = Arc::new(AtomicU64::new(0));
        let (tx, mut rx) = mpsc::channel::<Vec<Event>>(CHANNEL_CHUNKS);
        let rules = ItemRules {
            brand_id: self.partner.brand_id,
            owned: OwnedFields::from_names(&self.partner.fields),
            max_item_bytes: cfg.max_item_bytes,
        };
        let ctx = self.context();
        let format = self.partner.format;
        let reader = Counting { inner: reader, count: bytes_in.clone() };
        let parser = tokio::task::spawn_blocking(move || {
            let mut chunk = Vec::with_capacity(CHUNK);
            let mut sink = |event: FeedEvent| {
                chunk.push(match event {
                    FeedEvent::Place(place) => Event::Place(place),
                    FeedEvent::Item(item) => Event::Command(to_encoded_command(&item, &ctx)),
                    FeedEvent::Reject(r) => Event::Reject(
                        r.place_id.unwrap_or(0),
                        Box::new(to_rejection(r, &ctx, now_us())),
                    ),
                });
                if chunk.len() >= CHUNK {
                    tx.blocking_send(std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK)))
                        .map_err(|_| Stopped)?;
                }
                Ok(())
            };
            let result = parse_feed(reader, format, &rules, &mut sink);
            if !chunk.is_empty() {
                let _ = tx.blocking_send(chunk);
            }
            result
        });

        let mut last_progress = Instant::now();
        let mut published = Ok(());
        while let Some(events) = rx.recv().await {
            if let Err(e) = self.handle(events).await {
                published = Err(e);
                break;
            }
            if let Some(callback) = progress
                && last_progress.elapsed() >= PROGRESS_EVERY
            {
                last_progress = Instant::now();
                callback(&self.progress(&bytes_in));
            }
        }
        drop(rx); // a parser still running stops at its next send
        let parsed = parser.await.map_err(|e| ImportError::Internal(e.to_string()))?;
        self.report.bytes_in = bytes_in.load(Ordering::Relaxed);
        metrics::bytes_read(&self.partner.name, self.report.bytes_in);
        published?;
        self.finish().await?;
        if let Some(callback) = progress {
            callback(&self.progress(&bytes_in));
        }
        parsed.map(drop).map_err(|e| ImportError::from_feed(e, &self.report.source))
    }

    pub(super) fn progress(&self, bytes_in: &AtomicU64) -> Progress {
        Progress {
            bytes_in: bytes_in.load(Ordering::Relaxed),
            items: self.report.items,
            rejected: self.report.rejected_total,
            batches: self.report.batches,
        }
    }

    pub(super) async fn handle(&mut self, events: Vec<Event>) -> Result<(), ImportError> {
        let items = events.iter().filter(|e| matches!(e, Event::Command(_))).count();
        metrics::items(&self.partner.name, items);
        for event in events {
            match event {
                Event::Place(place) => {
                    self.places.entry(place).or_default();
                }
                Event::Command(command) => {
                    self.report.items += 1;
                    *self.places.entry(command.place_id).or_default() += 1;
                    for (partition, batch) in self.batcher.push(command) {
                        self.publish_batch(partition, batch).await?;
                    }
                }
                Event::Reject(place, rejection) => self.reject(place, *rejection).await?,
            }
        }
        Ok(())
    }

    /// What the import's commands and rejections are made with.
    fn context(&self) -> CommandContext {
        CommandContext {
            brand_id: self.partner.brand_id,
            generation: self.report.generation,
            clear_missing: self.partner.clear_missing,
            source: self.partner.name.clone(),
            import_id: self.report.import_id.clone(),
        }
    }

    /// Publishes a batch of commands, with the import's origin once for all.
    pub(super) async fn publish_batch(
        &mut self,
        partition: Partition,
        batch: EncodedBatch,
    ) -> Result<(), ImportError> {
        let origin = self.context().origin(now_us());
        let seq = self.batch_seq.entry(partition).or_default();
        let msg_id = format!("{}:{partition}:{seq}", self.report.import_id);
        *seq += 1;
        self.report.batches += 1;
        let commands = batch.len();
        self.report.commands += commands as u64;
        self.publish_cmd(partition, msg_id, batch.finish(origin.as_ref()), (commands, 0)).await
    }

    /// Publishes the bytes of a `CommandBatch` of `counts` (commands, sweeps).
    pub(super) async fn publish_cmd(
        &mut self,
        partition: Partition,
        msg_id: String,
        batch: Vec<u8>,
        counts: (usize, usize),
    ) -> Result<(), ImportError> {
        let (payload, headers) = encoding::encode(self.compression, batch);
        self.report.bytes_out += payload.len() as u64;
        let subject = self.subjects.cmd_for(partition, counts.1 > 0);
        let span = shelfsync_telemetry::send_span!(
            "ingest.send",
            self.subjects.template(&subject),
            subject,
            messaging.message.id = %msg_id,
            shelfsync.command_count = counts.0,
            shelfsync.sweep_count = counts.1,
        );
        let kind = msg_type::COMMAND_BATCH;
        self.publisher.publish(subject, msg_id, kind, headers, payload).instrument(span).await?;
        Ok(())
    }

    /// Rejections go out in batches of one place (0: unknown), in feed order.
    pub(super) async fn reject(
        &mut self,
        place: i64,
        rejection: Rejection,
    ) -> Result<(), ImportError> {
        metrics::rejected(&rejection.reason);
        *self.report.rejected.entry(rejection.reason.clone()).or_default() += 1;
        self.report.rejected_total += 1;
        if self.rejects.0 != place || self.rejects.1.len() >= REJECTS_PER_BATCH {
            self.flush_rejects().await?;
            self.rejects.0 = place;
        }
        self.rejects.1.push(rejection);
        Ok(())
    }

    pub(super) async fn flush_rejects(&mut self) -> Result<(), ImportError> {
        let rejections = std::mem::take(&mut self.rejects.1);
        if rejections.is_empty() {
            return Ok(());
        }
        let msg_id = format!("{}:rej:{}", self.report.import_id, self.reject_seq);
        self.reject_seq += 1;
        let subject = self.subjects.rejects(self.partner.brand_id, self.rejects.0);
        let span = shelfsync_telemetry::send_span!(
            "ingest.send",
            self.subjects.template(&subject),
            subject,
            messaging.message.id = %msg_id,
            shelfsync.rejection_count = rejections.len(),
        );
        let payload = Bytes::from(RejectionBatch { rejections }.encode_to_vec());
        let kind = msg_type::REJECTION_BATCH;
        self.publisher.publish(subject, msg_id, kind, None, payload).instrument(span).await?;
        Ok(())
    }

    /// Publishes what is still batched and waits for every ack.
    pub(super) async fn finish(&mut self) -> Result<(), ImportError> {
        for (partition, batch) in self.batcher.drain() {
            self.publish_batch(partition, batch).await?;
        }
        self.flush_rejects().await?;
        self.publisher.flush().await?;
        self.report.places = self.places.len() as u64;
        Ok(())
    }

    /// One sweep per place seen and per place of an earlier import missing
    /// from this one (`known`), each on its place's partition, after every
    /// command of the import is acked (so storage applies them first). Each
    /// carries its evidence (items accepted, the partner's
    /// `sweep_max_fraction`), from which storage decides to apply or hold it.
    /// Returns the places swept.
    pub(super) async fn sweep(&mut self, known: &BTreeSet<i64>) -> Result<Vec<i64>, ImportError> {
        let brand_id = self.partner.brand_id;
        let mut places: BTreeMap<i64, (u64, bool)> =
            known.iter().map(|&p| (p, (0, true))).collect();
        for (&place, &accepted) in &self.places {
            places.insert(place, (accepted, false));
        }
        for (&place_id, &(accepted, missing)) in &places {
            let partition = partition_of(brand_id, place_id, self.partitions);
            let batch = CommandBatch {
                partition: partition.0,
                commands: Vec::new(),
                sweeps: vec![Sweep {
                    brand_id,
                    place_id,
                    generation: self.report.generation,
                    source: self.partner.name.clone(),
                    import_id: self.report.import_id.clone(),
                    guard: Some(SweepGuard {
                        accepted,
                        max_fraction: self.partner.sweep_max_fraction,
                        missing,
                    }),
                    release_held: false,
                }],
                origin: None,
            };
            let msg_id = format!("{}:sweep:{place_id}", self.report.import_id);
            let counts = (batch.commands.len(), batch.sweeps.len());
            self.publish_cmd(partition, msg_id, batch.encode_to_vec(), counts).await?;
            self.report.sweeps += 1;
        }
        self.publisher.flush().await?;
        Ok(places.into_keys().collect())
    }
}

//! One import, end to end: open the source, parse on a blocking thread,
//! batch and publish commands and rejections, sweep after a good full
//! import, report.
//!
//! A full import holds its partner's lease (see `lease`) from before its
//! source is opened to its report: a second one, in any process, waits or
//! fails with [`ImportError::Busy`]; a lost lease stops the import where it
//! is (no sweep), and the lease is confirmed right before the sweeps. Its
//! generation is decided with the lease, in the same Redis step: its start
//! time, or the partner's last generation + 1 when the host's clock is
//! behind, so generations grow in the order the imports of a partner ran,
//! whatever the clocks of the hosts running them say. Its id is
//! `<partner>-<generation>`.
//!
//! The parser thread and the async publisher are joined by a small bounded
//! channel, and JetStream acks in flight are bounded by the `Publisher`, so
//! memory does not grow with the feed: a slow NATS slows the parser down.
//!
//! One import is one trace: the `ingest.import` span is its root, and each
//! message goes out in a PRODUCER span `send <subject>` (`ingest.send`)
//! whose context the message carries to storage.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{self, Read};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use prost::Message;
use shelfsync_bus::{
    EncodedBatch, EncodedBatcher, EncodedCommand, Partition, Publisher, Subjects,
    command_bytes_limit, encoding, partition_of,
};
use shelfsync_proto::{
    CommandBatch, Rejection, RejectionBatch, Sweep, SweepGuard, SweepsReply, SweepsRequest,
    msg_type, now_us,
};
use shelfsync_settings::{
    Compression, ImportKind, IngestSettings, NatsSettings, PartnerSettings, RedisSettings,
    Settings, Topology,
};
use shelfsync_telemetry::chain;
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info, warn};

use crate::feed::{FeedEvent, Stopped, parse_feed};
use crate::item::{CommandContext, ItemRules, OwnedFields, to_encoded_command, to_rejection};
use crate::lease::{Holder, Lease};
use crate::metrics;
use crate::report::{HeldSweep, ImportError, ImportReport, ImportStatus, Progress};
use crate::source::{self, FeedReader, FileSignature, Opened, Source, Validators};
use crate::state::{GENERATION_SLOT, State};

mod run;

use run::Run;

/// Events per message of the parser → publisher channel, and messages the
/// channel holds: at most 4096 parsed events wait for the publisher.
const CHUNK: usize = 256;
const CHANNEL_CHUNKS: usize = 16;
/// Rejections per message.
const REJECTS_PER_BATCH: usize = 100;
const PROGRESS_EVERY: Duration = Duration::from_millis(100);
/// How often the outcomes of an import's sweeps are asked for: soon after
/// the sweeps are sent (storage decides them as soon as it has applied the
/// import's commands), then less and less often.
const SWEEP_POLL_FIRST: Duration = Duration::from_millis(5);
const SWEEP_POLL_MAX: Duration = Duration::from_millis(200);

/// Called now and then with running counts.
pub type ProgressFn<'a> = Option<&'a (dyn Fn(&Progress) + Send + Sync)>;

/// What an [`Importer`] reads of the settings file: the common parts and
/// the `[ingest]` section (partners come with each import).
#[derive(Debug, Clone)]
pub struct ImportConfig {
    pub nats: NatsSettings,
    pub redis: RedisSettings,
    pub topology: Topology,
    pub ingest: IngestSettings,
}

impl From<&Settings> for ImportConfig {
    fn from(s: &Settings) -> Self {
        ImportConfig {
            nats: s.nats.clone(),
            redis: s.redis.clone(),
            topology: s.topology(),
            ingest: s.ingest.clone(),
        }
    }
}

/// What an importer reads the time from: µs since the Unix epoch.
/// [`now_us`] unless a test gives another ([`Importer::with_clock`]).
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// Runs imports. Cheap to share (`Arc`); imports of different partners may
/// run at once.
pub struct Importer {
    settings: ImportConfig,
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    subjects: Subjects,
    state: State,
    http: reqwest::Client,
    /// How long a full import waits for its partner's lease (0: fails at once).
    lease_wait: Duration,
    clock: Clock,
}

impl Importer {
    /// Connects to NATS (and Redis for state) from settings; fails at once
    /// if a server is down.
    pub async fn connect(settings: ImportConfig) -> anyhow::Result<Importer> {
        Self::connect_with(settings, false).await
    }

    /// `retry`: keep trying to reach NATS in the background (services).
    pub(crate) async fn connect_with(
        settings: ImportConfig,
        retry: bool,
    ) -> anyhow::Result<Importer> {
        shelfsync_telemetry::install_metrics();
        let client = shelfsync_bus::connect(&settings.nats, "shelfsync-ingest", retry).await?;
        let js = shelfsync_bus::jetstream(client.clone(), &settings.nats);
        let state = State::connect(&settings.redis).await.with_context(|| {
            format!("cannot connect to Redis at {}", settings.redis.url_redacted())
        })?;
        // reqwest is built without a default crypto provider; install ours
        // (an error only means one is installed already).
        shelfsync_telemetry::install_crypto_provider();
        let http = reqwest::Client::builder()
            .user_agent(concat!("shelfsync-ingest/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(60))
            .build()
            .context("cannot build the HTTP client")?;
        let subjects = Subjects::new(&settings.nats.prefix);
        let lease_wait = Duration::ZERO;
        let clock: Clock = Arc::new(now_us);
        Ok(Importer { settings, client, js, subjects, state, http, lease_wait, clock })
    }

    /// Reads the time from `clock` instead of the host's (tests: a host
    /// whose clock is off).
    pub fn with_clock(mut self, clock: Clock) -> Importer {
        self.clock = clock;
        self
    }

    /// A full import finding another one of its partner running waits up to
    /// `wait` for it to end, instead of failing at once with
    /// [`ImportError::Busy`].
    pub fn with_lease_wait(mut self, wait: Duration) -> Importer {
        self.lease_wait = wait;
        self
    }

    pub fn nats_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// The last `n` reports of `partner` (at most 20), newest first.
    pub async fn reports(&self, partner: &str, n: usize) -> Result<Vec<ImportReport>, ImportError> {
        let stored = self.state.reports(partner, n).await?;
        Ok(stored.iter().filter_map(|json| serde_json::from_str(json).ok()).collect())
    }

    /// Runs one import of `source` for `partner`; `progress` is called now
    /// and then (at most ~10 times/s) with running counts. A failed import
    /// is recorded too (its report is in Redis).
    pub async fn import(
        &self,
        partner: &PartnerSettings,
        source: Source,
        progress: ProgressFn<'_>,
    ) -> Result<ImportReport, ImportError> {
        let (report, result) = self.run(partner, source, progress).await;
        result.map(|()| report)
    }

    /// As [`Importer::import`], with the report also when it failed. An
    /// import refused because another one holds the lease is not recorded.
    pub async fn run(
        &self,
        partner: &PartnerSettings,
        source: Source,
        progress: ProgressFn<'_>,
    ) -> (ImportReport, Result<(), ImportError>) {
        let full = partner.kind == ImportKind::Full;
        let (lease, started) = match full {
            true => match self.take_lease(partner, source.describe()).await {
                Ok((lease, generation)) => (Some(Ok(lease)), generation),
                Err(e) => (Some(Err(e)), (self.clock)()),
            },
            false => (None, (self.clock)()),
        };
        let import_id = format!("{}-{started}", partner.name);
        let span =
            tracing::info_span!("ingest.import", partner = %partner.name, import_id = %import_id);
        async {
            let clock = Instant::now();
            let mut report = ImportReport {
                import_id: import_id.clone(),
                partner: partner.name.clone(),
                kind: if full { "full" } else { "delta" }.into(),
                source: source.describe(),
                generation: if full { started } else { 0 },
                ..ImportReport::default()
            };
            let lease = match lease {
                None => None,
                Some(Ok(lease)) => Some(lease),
                Some(Err(e)) => {
                    report.status = ImportStatus::Failed;
                    report.error = Some(e.to_string());
                    if !matches!(e, ImportError::Busy { .. }) {
                        self.record(&report).await;
                    }
                    return (report, Err(e));
                }
            };
            let result = match &lease {
                None => self.run_source(partner, source, &mut report, progress, None).await,
                // A lost lease stops the import wherever it is.
                Some(lease) => tokio::select! {
                    biased;
                    result = self.run_source(partner, source, &mut report, progress, Some(lease)) => result,
                    reason = lease.lost() => Err(lease.lost_error(reason)),
                },
            };
            if let Some(lease) = lease {
                lease.release().await;
            }
            report.duration_ms = clock.elapsed().as_millis() as u64;
            if let Err(e) = &result {
                report.status = ImportStatus::Failed;
                report.error = Some(e.to_string());
            }
            self.record(&report).await;
            (report, result)
        }
        .instrument(span)
        .await
    }

    /// The partner's lease, for a full import, and the import's generation
    /// (µs), decided with the lease: its start, or the partner's last
    /// generation + 1 (`lease`).
    async fn take_lease(
        &self,
        partner: &PartnerSettings,
        what: String,
    ) -> Result<(Lease, i64), ImportError> {
        let ttl = self.settings.ingest.import_lease_ttl;
        let id = format!("{}-{GENERATION_SLOT}", partner.name);
        let holder = || Holder::this_process(&id, &what);
        let clock = self.clock.clone();
        Lease::take(&self.state, &partner.name, ttl, self.lease_wait, holder, move || clock()).await
    }

    /// Logs the one line of this import and keeps its report.
    async fn record(&self, r: &ImportReport) {
        let (items, rejected, sweeps, bytes_in) = (r.items, r.rejected_total, r.sweeps, r.bytes_in);
        match &r.error {
            None => {
                info!(status = ?r.status, items, rejected, sweeps, bytes_in, ms = r.duration_ms, "import finished");
                let now =
                    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
                metrics::last_success(&r.partner, now);
            }
            Some(error) => warn!(error, items, rejected, bytes_in, "import failed, nothing swept"),
        }
        let json = serde_json::to_string(r).unwrap_or_default();
        if let Err(e) = self.state.push_report(&r.partner, &json).await {
            warn!(error = %chain(&e), "cannot store the import report in Redis");
        }
    }

    async fn run_source(
        &self,
        partner: &PartnerSettings,
        source: Source,
        report: &mut ImportReport,
        progress: ProgressFn<'_>,
        lease: Option<&Lease>,
    ) -> Result<(), ImportError> {
        let is_url = matches!(source, Source::Url(_));
        let (what, file) = (source.describe(), source.file().map(Path::to_path_buf));
        let file_before = FileSignature::of(file.as_deref()).await;
        let known = if is_url {
            self.state.validators(&partner.name).await?
        } else {
            Validators::default()
        };
        let (reader, fresh) = match source::open(source, &self.http, &known).await? {
            Opened::Unchanged => {
                report.status = ImportStatus::Unchanged;
                return Ok(());
            }
            Opened::Feed(reader, fresh) => (reader, fresh),
        };
        let max_payload = match self.client.server_info().max_payload {
            0 => 1 << 20,
            n => n,
        };
        let mut run = Run {
            partner,
            subjects: &self.subjects,
            partitions: self.settings.topology.partitions,
            publisher: Publisher::new(self.js.clone(), self.settings.nats.max_inflight),
            batcher: EncodedBatcher::new(
                self.settings.topology.partitions,
                self.settings.ingest.batch_size,
                command_bytes_limit(max_payload),
            ),
            compression: self.settings.ingest.compression,
            batch_seq: HashMap::new(),
            rejects: (0, Vec::new()),
            reject_seq: 0,
            places: BTreeMap::new(),
            report,
        };
        run.pipeline(reader, &self.settings.ingest, progress).await?;
        // A file written in place while it was read may have been read cut
        // short: what it was missing must not be swept.
        if file_before.is_some() && FileSignature::of(file.as_deref()).await != file_before {
            let detail = "the file changed while it was read (write it elsewhere and rename it \
                          into place); nothing swept, it is read again at the next import"
                .into();
            return Err(ImportError::Source { what, detail });
        }
        if partner.kind == ImportKind::Full {
            let seen: BTreeSet<i64> = run.places.keys().copied().collect();
            let (generation, forget) =
                (run.report.generation, self.settings.ingest.forget_places_after);
            let known = self.state.known_places(&partner.name, generation, forget).await?;
            if let Some(lease) = lease {
                lease.confirm().await?;
            }
            let swept = run.sweep(&known).await?;
            let remembered =
                self.state.remember_places(&partner.name, &seen, generation, forget).await?;
            metrics::known_places(&partner.name, remembered);
            self.sweep_outcomes(partner, &swept, run.report).await?;
        }
        if is_url && fresh != known {
            self.state.save_validators(&partner.name, &fresh).await?;
        }
        Ok(())
    }
}

impl Importer {
    /// Waits (up to `ingest.sweep_report_wait`) for storage to decide the
    /// import's sweeps and puts the outcomes in the report: applied, held
    /// (with counts), or not decided yet.
    async fn sweep_outcomes(
        &self,
        partner: &PartnerSettings,
        places: &[i64],
        report: &mut ImportReport,
    ) -> Result<(), ImportError> {
        let request = SweepsRequest {
            import_id: report.import_id.clone(),
            brand_id: partner.brand_id,
            place_ids: places.to_vec(),
        };
        let deadline = Instant::now() + self.settings.ingest.sweep_report_wait;
        let (mut last, mut poll) = (None, SWEEP_POLL_FIRST);
        while last.as_ref().is_none_or(|r: &SweepsReply| !r.pending.is_empty()) {
            if last.is_some() {
                if Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(poll).await;
                poll = (poll * 5 / 4).min(SWEEP_POLL_MAX);
            }
            let asked = self
                .client
                .request(self.subjects.read("sweeps"), request.encode_to_vec().into())
                .await;
            match asked.map(|m| SweepsReply::decode(m.payload.as_ref())) {
                Ok(Ok(reply)) if reply.error.is_empty() => last = Some(reply),
                Ok(Ok(reply)) => {
                    warn!(error = %reply.error, "storage cannot say how the sweeps went");
                    if last.is_none() {
                        last = Some(SweepsReply { pending: places.to_vec(), ..Default::default() });
                    }
                }
                Ok(Err(e)) => return Err(ImportError::Internal(format!("bad SweepsReply: {e}"))),
                // Storage not answering: the sweeps are applied when it is
                // back; the report says not decided. With no storage
                // listening at all there is nothing to wait for.
                Err(e) => {
                    debug!(error = %chain(&e), "storage did not answer the sweeps request");
                    if last.is_none() {
                        last = Some(SweepsReply { pending: places.to_vec(), ..Default::default() });
                    }
                    if e.kind() == async_nats::client::RequestErrorKind::NoResponders {
                        break;
                    }
                }
            }
        }
        let reply = last.unwrap_or_default();
        for o in &reply.outcomes {
            let Some(s) = &o.sweep else { continue };
            match o.status.as_str() {
                "applied" => {
                    report.sweeps_applied += 1;
                    report.marked_absent += o.marked_absent;
                }
                "held" => report.held_sweeps.push(HeldSweep {
                    place_id: s.place_id,
                    reason: o.reason.clone(),
                    accepted: s.guard.as_ref().map_or(0, |g| g.accepted),
                    live: o.live,
                    would_mark_absent: o.candidates,
                }),
                _ => {}
            }
        }
        report.sweeps_pending = reply.pending;
        if !report.held_sweeps.is_empty() {
            warn!(
                partner = %partner.name, import_id = %report.import_id, held = report.held_sweeps.len(),
                "sweeps held: nothing marked absent there (shelfsync sweep --import {})",
                report.import_id
            );
        }
        Ok(())
    }
}

//! Harness for cross-service tests: real nats-server and redis-server on
//! loopback (from `shelfsync_testkit`), storage running in-process or as its
//! real binary, and helpers to publish commands and read the change stream.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::process::{Child, Command as Process, Stdio};
use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use prost::Message;
use shelfsync_bus::{Partition, Subjects, partition_of};
use shelfsync_proto::{
    Change, ChangeBatch, Command, CommandBatch, CommandKind, Origin, Product, Record, RecordKey,
    Rejection, RejectionBatch, Sweep, msg_type,
};
use shelfsync_settings::Settings;
use shelfsync_storage::Store;
use shelfsync_testkit::TestEnv;
use tokio::sync::oneshot;

pub use shelfsync_testkit::{eventually, settings_env};

pub mod otlp;

/// How long a test waits for the pipeline to settle.
pub const SETTLE: Duration = Duration::from_secs(30);

/// Settings for one test: its own servers, prefix and namespace.
pub fn settings_for(env: &TestEnv) -> Settings {
    let mut s = Settings::default();
    s.nats.url = env.nats.url();
    s.nats.prefix = env.prefix.clone();
    s.redis.url = env.redis.url();
    s.redis.namespace = env.namespace.clone();
    s.storage.partitions = 4;
    s.storage.retry_delay = Duration::from_millis(100);
    s.storage.ack_wait = Duration::from_secs(5);
    // Several storages run at once in tests: no fixed ports.
    s.storage.http_listen = "127.0.0.1:0".into();
    s.ingest.listen = "127.0.0.1:0".into();
    s
}

/// A storage process running in this test process.
pub struct InProcessStorage {
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    pub stats: std::sync::Arc<shelfsync_storage::Stats>,
}

impl InProcessStorage {
    pub async fn start(settings: Settings) -> anyhow::Result<Self> {
        let app = shelfsync_storage::App::build(settings).await?;
        let stats = app.stats();
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(app.run_until(async move {
            let _ = rx.await;
        }));
        Ok(Self { stop: Some(tx), task: Some(task), stats })
    }

    /// Graceful stop, as on SIGTERM.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await??;
        }
        Ok(())
    }
}

impl Drop for InProcessStorage {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The real `shelfsync-storage` binary, killed on drop.
pub struct StorageProcess {
    pub child: Child,
}

impl StorageProcess {
    /// Starts the binary with the test's settings in the environment, plus
    /// `extra` variables (e.g. `SHELFSYNC_FAILPOINT`).
    pub fn start(settings: &Settings, extra: &[(&str, &str)]) -> anyhow::Result<Self> {
        let bin = shelfsync_testkit::workspace_bin("shelfsync-storage")?;
        let mut cmd = Process::new(bin);
        cmd.envs(settings_env(settings))
            .envs(extra.iter().copied())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = cmd.spawn().context("spawning shelfsync-storage")?;
        Ok(Self { child })
    }

    /// Waits for the process to exit on its own (e.g. at a failpoint).
    pub async fn wait_exit(
        &mut self,
        timeout: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("storage did not exit within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for StorageProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs the `shelfsync` CLI binary with the test's settings in its
/// environment (nothing inherited) and returns what it printed.
pub async fn cli(settings: &Settings, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let bin = shelfsync_testkit::workspace_bin("shelfsync")?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(args)
        .env_clear()
        .envs(settings_env(settings))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = tokio::time::timeout(SETTLE, cmd.output())
        .await
        .with_context(|| format!("shelfsync {args:?} did not finish"))??;
    Ok(out)
}

/// [`cli`], requiring success; returns stdout.
pub async fn cli_ok(settings: &Settings, args: &[&str]) -> anyhow::Result<String> {
    let out = cli(settings, args).await?;
    anyhow::ensure!(
        out.status.success(),
        "shelfsync {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// A connection to the test's NATS and Redis, with helpers.
pub struct Harness {
    pub settings: Settings,
    pub subjects: Subjects,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub store: Store,
    msg_counter: std::sync::atomic::AtomicU64,
}

impl Harness {
    pub async fn connect(settings: Settings) -> anyhow::Result<Self> {
        let client = shelfsync_bus::connect(&settings.nats, "test-harness", false).await?;
        let js = shelfsync_bus::jetstream(client.clone(), &settings.nats);
        shelfsync_bus::provision(&js, &settings).await?;
        let store = Store::connect(&settings.redis).await?;
        Ok(Self {
            subjects: Subjects::new(&settings.nats.prefix),
            settings,
            client,
            js,
            store,
            msg_counter: Default::default(),
        })
    }

    pub fn partition(&self, brand: i64, place: i64) -> Partition {
        partition_of(brand, place, self.settings.storage.partitions)
    }

    /// Publishes commands, grouped into one batch per partition, in order.
    pub async fn send(&self, commands: Vec<Command>) -> anyhow::Result<()> {
        let mut by_partition: std::collections::BTreeMap<Partition, CommandBatch> =
            Default::default();
        for c in commands {
            let k = c.key.clone().unwrap_or_default();
            let p = self.partition(k.brand_id, k.place_id);
            by_partition
                .entry(p)
                .or_insert_with(|| CommandBatch { partition: p.0, ..Default::default() })
                .commands
                .push(c);
        }
        for (p, batch) in by_partition {
            self.send_batch(p, &batch).await?;
        }
        Ok(())
    }

    pub async fn send_sweep(&self, brand: i64, place: i64, generation: i64) -> anyhow::Result<()> {
        let p = self.partition(brand, place);
        let batch = CommandBatch {
            partition: p.0,
            sweeps: vec![Sweep {
                brand_id: brand,
                place_id: place,
                generation,
                source: "test".into(),
                import_id: format!("test-{generation}"),
                ..Default::default()
            }],
            ..Default::default()
        };
        self.send_batch(p, &batch).await
    }

    pub async fn send_batch(&self, p: Partition, batch: &CommandBatch) -> anyhow::Result<()> {
        self.send_raw(p, batch.encode_to_vec()).await
    }

    pub async fn send_raw(&self, p: Partition, payload: Vec<u8>) -> anyhow::Result<()> {
        let n = self.msg_counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let msg = jetstream::message::PublishMessage::build()
            .payload(payload.into())
            .message_id(format!("test:{n}"))
            .header(shelfsync_bus::TYPE_HEADER, msg_type::COMMAND_BATCH);
        self.js.send_publish(self.subjects.cmd(p), msg).await?.await?;
        Ok(())
    }

    /// True when every command was acked by storage — the command stream is a
    /// work queue, so it is then empty (a nak'd message stays in it) — and
    /// every outbox is empty.
    pub async fn settled(&self) -> bool {
        let Ok(mut stream) = self.js.get_stream(self.subjects.cmd_stream()).await else {
            return false;
        };
        match stream.info().await {
            Ok(info) if info.state.messages == 0 => {}
            _ => return false,
        }
        for p in 0..self.settings.storage.partitions {
            if self.store.outbox_len(p).await.map_or(true, |n| n > 0) {
                return false;
            }
        }
        true
    }

    pub async fn wait_settled(&self) {
        eventually(SETTLE, "storage to apply everything and empty its outboxes", || async {
            self.settled().await
        })
        .await;
    }

    /// Every ChangeBatch on the CHANGES stream, in stream order.
    pub async fn change_batches(&self) -> anyhow::Result<Vec<ChangeBatch>> {
        let raw = self.read_stream(&self.subjects.changes_stream()).await?;
        Ok(raw.iter().map(|b| ChangeBatch::decode(b.as_slice())).collect::<Result<_, _>>()?)
    }

    /// Every Change on the CHANGES stream, in stream order.
    pub async fn changes(&self) -> anyhow::Result<Vec<Change>> {
        Ok(self.change_batches().await?.into_iter().flat_map(|b| b.changes).collect())
    }

    /// Every Rejection on the REJECTS stream, in stream order.
    pub async fn rejections(&self) -> anyhow::Result<Vec<Rejection>> {
        let raw = self.read_stream(&self.subjects.rejects_stream()).await?;
        let mut out = Vec::new();
        for b in raw {
            out.extend(RejectionBatch::decode(b.as_slice())?.rejections);
        }
        Ok(out)
    }

    /// Reads a whole stream with an ephemeral ordered consumer.
    pub async fn read_stream(&self, name: &str) -> anyhow::Result<Vec<Vec<u8>>> {
        let mut stream = self.js.get_stream(name).await?;
        let last = stream.info().await?.state.last_sequence;
        let mut out = Vec::new();
        if last == 0 {
            return Ok(out);
        }
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await?;
        let mut messages = consumer.messages().await?;
        while let Some(msg) = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("reading stream timed out")?
        {
            let msg = msg?;
            let seq = msg.info().map_err(|e| anyhow::anyhow!("{e}"))?.stream_sequence;
            out.push(msg.payload.to_vec());
            if seq >= last {
                break;
            }
        }
        Ok(out)
    }

    pub async fn get(
        &self,
        brand: i64,
        place: i64,
        product: &str,
    ) -> anyhow::Result<Option<Record>> {
        Ok(self
            .store
            .get(self.settings.storage.partitions, &RecordKey::new(brand, place, product))
            .await?)
    }
}

/// A PATCH of `product` fields for a record.
pub fn patch(brand: i64, place: i64, id: &str, product: &Product, generation: i64) -> Command {
    Command {
        key: Some(RecordKey::new(brand, place, id)),
        kind: CommandKind::Patch as i32,
        data: product.encode_to_vec(),
        generation,
        origin: Some(Origin { source: "test".into(), ..Default::default() }),
        ..Default::default()
    }
}

pub fn product(title: &str, price: i64, stock: i64) -> Product {
    Product {
        title: Some(title.into()),
        category: Some("roses".into()),
        price: Some(price),
        stock: Some(stock),
        currency: Some("RUB".into()),
        ..Default::default()
    }
}

pub fn decode_product(bytes: &[u8]) -> Product {
    Product::decode(bytes).expect("stored data decodes as Product")
}

/// Changes counted per record key.
pub fn count_by_key(changes: &[Change]) -> HashMap<(i64, i64, String), usize> {
    let mut out = HashMap::new();
    for c in changes {
        let k = c.key.clone().unwrap_or_default();
        *out.entry((k.brand_id, k.place_id, k.product_id)).or_default() += 1;
    }
    out
}

pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// A minimal HTTP/1.1 GET on loopback: `(status, body)`.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

// ---------------------------------------------------------------------------
// Fault-injection helpers (tests/tests/faults_*.rs, docs/RELIABILITY.md): a
// serial model of storage to compare against, a deterministic churn
// workload, a consumer-side mirror on the ChangeFeed kit, publishing that
// rides through a NATS outage, and small probes (consumer info, metrics,
// server pids).
// ---------------------------------------------------------------------------

/// A record key as the fault tests use it: `(brand, place, product_id)`.
pub type RecordId = (i64, i64, String);

/// What a consumer can observe of a record version: `(data, state, absent,
/// deleted)` — everything but the timestamps, which differ between runs.
pub type Observed = (Vec<u8>, Vec<u8>, bool, bool);

pub fn observed(r: &Record) -> Observed {
    (r.data.clone(), r.state.clone(), r.absent, r.deleted)
}

fn id_of(key: &RecordKey) -> RecordId {
    (key.brand_id, key.place_id, key.product_id.clone())
}

/// Storage applied serially, in memory, with its own pure core
/// (`shelfsync_storage::apply::apply_batch`): the state and the transitions
/// that one fault-free worker applying the batches in publish order yields.
/// The fault tests hold the distributed machinery (crashes, redeliveries,
/// restarts) to it.
#[derive(Default)]
pub struct SerialModel {
    partitions: u32,
    slots: HashMap<RecordId, shelfsync_storage::apply::Slot>,
    /// Per record, every observable version a change announced, in order.
    pub transitions: HashMap<RecordId, Vec<Observed>>,
    /// Changes emitted in all.
    pub changes: usize,
    /// Rejection reasons, in order.
    pub rejections: Vec<String>,
    /// Per place, the sweep held for it.
    pub held: HashMap<(i64, i64), shelfsync_proto::SweepOutcome>,
    /// Every sweep's outcome, in order.
    pub sweeps: Vec<shelfsync_proto::SweepOutcome>,
    /// Per (brand, place, generation), what that full import carried so far.
    touched: HashMap<(i64, i64, i64), std::collections::HashSet<String>>,
    clock: i64,
}

impl SerialModel {
    pub fn new(partitions: u32) -> Self {
        Self { partitions, clock: 1, ..Default::default() }
    }

    /// Applies one command message, as the worker owning its partition would.
    pub fn apply(&mut self, batch: &CommandBatch) {
        self.clock += 1_000;
        let limits = shelfsync_storage::apply::Limits {
            partition: batch.partition,
            partitions: self.partitions,
            max_record_bytes: shelfsync_settings::StorageSettings::default().max_record_bytes,
            now_us: self.clock,
        };
        // Every record the model knows is in `slots`, so the sweep finds its
        // candidates there and needs no separate generation column.
        let swept: HashMap<(i64, i64), shelfsync_storage::apply::SweptPlace> = batch
            .sweeps
            .iter()
            .map(|s| {
                let place = (s.brand_id, s.place_id);
                let held = self.held.get(&place).cloned();
                let touched = self
                    .touched
                    .iter()
                    .filter(|((b, p, _), _)| (*b, *p) == place)
                    .map(|((_, _, g), ids)| (*g, ids.clone()))
                    .collect();
                (place, shelfsync_storage::apply::SweptPlace { column: Vec::new(), held, touched })
            })
            .collect();
        let out = shelfsync_storage::apply::apply_batch(batch, &mut self.slots, &swept, &limits);
        for t in &out.touched {
            self.touched.entry(t.of()).or_default().insert(t.product_id.clone());
        }
        for o in &out.sweeps {
            let Some(s) = &o.sweep else { continue };
            let place = (s.brand_id, s.place_id);
            match o.status.as_str() {
                "held" => {
                    self.held.insert(place, o.clone());
                }
                "applied" => {
                    self.held.remove(&place);
                    self.touched.remove(&(s.brand_id, s.place_id, s.generation));
                }
                _ => {}
            }
        }
        self.sweeps.extend(out.sweeps.iter().cloned());
        for c in &out.changes {
            let after = c.after.as_ref().expect("a change has an after");
            let key = c.key.as_ref().expect("a change has a key");
            self.transitions.entry(id_of(key)).or_default().push(observed(after));
        }
        self.changes += out.changes.len();
        self.rejections.extend(out.rejections.into_iter().map(|r| r.reason));
    }

    /// The final observable state of every record the model holds.
    pub fn records(&self) -> HashMap<RecordId, Observed> {
        self.slots
            .iter()
            .filter_map(|(k, s)| s.record.as_ref().map(|r| (k.clone(), observed(r))))
            .collect()
    }
}

/// A deterministic import with churn over several places of one brand:
/// full imports with generations and sweeps, items vanishing and coming
/// back, a delta price feed, deletes and re-creations, a validator-style
/// state PATCH, one key twice in a batch, and an identical re-import. Each
/// command message holds at most `chunk` commands of one place.
#[derive(Debug, Clone)]
pub struct Churn {
    pub brand: i64,
    pub places: Vec<i64>,
    pub items: usize,
    pub chunk: usize,
}

impl Churn {
    /// Command messages in publish order, each for one partition.
    pub fn batches(&self, partitions: u32) -> Vec<CommandBatch> {
        let mut out = Vec::new();
        let sku = |i: usize| format!("sku-{i}");
        for &place in &self.places {
            let p = partition_of(self.brand, place, partitions).0;
            let mut emit = |commands: Vec<Command>, sweeps: Vec<Sweep>| {
                let mut commands = commands.into_iter().peekable();
                while commands.peek().is_some() {
                    let chunk: Vec<Command> = commands.by_ref().take(self.chunk).collect();
                    out.push(CommandBatch { partition: p, commands: chunk, ..Default::default() });
                }
                if !sweeps.is_empty() {
                    out.push(CommandBatch { partition: p, sweeps, ..Default::default() });
                }
            };
            let sweep = |generation: i64| Sweep {
                brand_id: self.brand,
                place_id: place,
                generation,
                source: "churn".into(),
                import_id: format!("churn-{generation}"),
                ..Default::default()
            };
            let full =
                |generation: i64, keep: &dyn Fn(usize) -> bool, price: &dyn Fn(usize) -> i64| {
                    (0..self.items)
                        .filter(|&i| keep(i))
                        .map(|i| {
                            patch(
                                self.brand,
                                place,
                                &sku(i),
                                &product("Roses", price(i), 5),
                                generation,
                            )
                        })
                        .collect::<Vec<_>>()
                };
            let base = |i: usize| 1_000 + i as i64;
            // 1: first full import.
            emit(full(1_000, &|_| true, &base), vec![sweep(1_000)]);
            // 2: a tenth of the prices move; every 7th item vanishes (swept).
            let moved = |i: usize| if i.is_multiple_of(10) { 9_000 + i as i64 } else { base(i) };
            emit(full(2_000, &|i| i % 7 != 3, &moved), vec![sweep(2_000)]);
            // 3: a delta price feed (no generation), deletes, a hidden state,
            // and one key twice in one message (both transitions count).
            let mut delta = Vec::new();
            for i in 0..self.items {
                if i % 5 == 1 {
                    let price = Product { price: Some(5_000 + i as i64), ..Default::default() };
                    delta.push(patch(self.brand, place, &sku(i), &price, 0));
                }
                if i % 11 == 5 {
                    delta.push(Command {
                        key: Some(RecordKey::new(self.brand, place, sku(i))),
                        kind: CommandKind::Delete as i32,
                        ..Default::default()
                    });
                }
                if i.is_multiple_of(13) {
                    let state =
                        shelfsync_proto::RecordState { hidden: Some(true), ..Default::default() };
                    delta.push(Command {
                        key: Some(RecordKey::new(self.brand, place, sku(i))),
                        kind: CommandKind::Patch as i32,
                        state: state.encode_to_vec(),
                        ..Default::default()
                    });
                }
            }
            let stock = |n: i64| Product { stock: Some(n), ..Default::default() };
            delta.push(patch(self.brand, place, &sku(2), &stock(0), 0));
            delta.push(patch(self.brand, place, &sku(2), &stock(9), 0));
            emit(delta, vec![]);
            // 4: a full import brings everything back (deleted ones are
            // re-created, vanished ones un-swept), prices as at first.
            emit(full(3_000, &|_| true, &base), vec![sweep(3_000)]);
            // 5: identical re-import: generation-only writes, no change.
            emit(full(4_000, &|_| true, &base), vec![sweep(4_000)]);
        }
        out
    }
}

/// Publishes one message and waits for its JetStream ack, retrying with the
/// same `Nats-Msg-Id` until `deadline` — through a NATS restart, the way a
/// careful producer does; the stream's duplicate window drops a retry whose
/// first attempt was stored after all. Returns the attempts it took.
pub async fn publish_until_acked(
    js: &jetstream::Context,
    subject: &str,
    msg_id: &str,
    msg_type: &str,
    payload: Vec<u8>,
    deadline: Duration,
) -> anyhow::Result<u32> {
    let give_up = tokio::time::Instant::now() + deadline;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let msg = jetstream::message::PublishMessage::build()
            .payload(payload.clone().into())
            .message_id(msg_id)
            .header(shelfsync_bus::TYPE_HEADER, msg_type);
        let result = async {
            let ack = js.send_publish(subject.to_string(), msg).await?;
            anyhow::Ok(tokio::time::timeout(Duration::from_secs(2), ack).await??)
        }
        .await;
        match result {
            Ok(_) => return Ok(attempts),
            Err(e) if tokio::time::Instant::now() > give_up => {
                return Err(e.context(format!("publishing {msg_id} to {subject}")));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

impl Harness {
    /// Publishes command messages in order with ids `<tag>:<index>`, each
    /// retried until acked (see [`publish_until_acked`]).
    pub async fn publish_batches(&self, tag: &str, batches: &[CommandBatch]) -> anyhow::Result<()> {
        for (i, b) in batches.iter().enumerate() {
            publish_until_acked(
                &self.js,
                &self.subjects.cmd(Partition(b.partition)),
                &format!("{tag}:{i}"),
                msg_type::COMMAND_BATCH,
                b.encode_to_vec(),
                SETTLE,
            )
            .await?;
        }
        Ok(())
    }

    /// Every record storage holds in the places, by key.
    pub async fn records_of(
        &self,
        brand: i64,
        places: &[i64],
    ) -> anyhow::Result<HashMap<RecordId, Record>> {
        let mut out = HashMap::new();
        for &p in places {
            for r in self.store.place_records(self.settings.storage.partitions, brand, p).await? {
                out.insert(id_of(r.key.as_ref().expect("stored records have keys")), r);
            }
        }
        Ok(out)
    }

    /// A durable consumer's info (`num_pending`, `num_ack_pending`,
    /// `num_redelivered`, ...).
    pub async fn consumer_info(
        &self,
        stream: &str,
        consumer: &str,
    ) -> anyhow::Result<consumer::Info> {
        let stream = self.js.get_stream(stream).await?;
        Ok(stream.consumer_info(consumer).await?)
    }

    /// The CHANGES stream's last sequence.
    pub async fn changes_last_seq(&self) -> anyhow::Result<u64> {
        let mut s = self.js.get_stream(self.subjects.changes_stream()).await?;
        Ok(s.info().await?.state.last_sequence)
    }

    /// Holds storage to the serial model: its records equal the model's
    /// (observably), and the change stream carries, per record, exactly the
    /// model's transitions in order — nothing lost, nothing twice — with a
    /// strictly increasing `updated_at`. Returns the changes.
    pub async fn assert_serial(
        &self,
        model: &SerialModel,
        brand: i64,
        places: &[i64],
    ) -> Vec<Change> {
        let stored = self.records_of(brand, places).await.expect("storage records");
        let want = model.records();
        assert_eq!(stored.len(), want.len(), "record count: storage vs serial model");
        for (k, w) in &want {
            let s = stored.get(k).unwrap_or_else(|| panic!("storage lacks {k:?}"));
            assert!(observed(s) == *w, "{k:?}: storage differs from the serial model");
        }
        let changes = self.changes().await.expect("changes");
        let mut seen: HashMap<RecordId, Vec<&Change>> = HashMap::new();
        for c in &changes {
            seen.entry(id_of(c.key.as_ref().expect("key"))).or_default().push(c);
        }
        let lost_or_extra: Vec<_> = seen
            .iter()
            .filter(|(k, v)| model.transitions.get(*k).map_or(0, Vec::len) != v.len())
            .map(|(k, v)| (k.clone(), v.len(), model.transitions.get(k).map_or(0, Vec::len)))
            .take(5)
            .collect();
        assert!(lost_or_extra.is_empty(), "(record, seen, expected) changes: {lost_or_extra:?}");
        for (k, want) in &model.transitions {
            let got = seen.get(k).unwrap_or_else(|| panic!("no change at all for {k:?}"));
            for (i, (c, w)) in got.iter().zip(want).enumerate() {
                let after = c.after.as_ref().expect("after");
                assert!(observed(after) == *w, "{k:?}: change #{i} is not the serial one");
                if i > 0 {
                    let prev = got[i - 1].after.as_ref().expect("after").updated_at;
                    assert!(after.updated_at > prev, "{k:?}: updated_at went back");
                }
            }
        }
        assert_eq!(changes.len(), model.changes, "changes in all");
        changes
    }
}

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
        brand_id: i64,
        place_id: i64,
    ) -> Result<(), shelfsync_feed::HandlerError> {
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
    pub fn start(name: &str, mut feed: shelfsync_feed::ChangeFeed, handler: FeedMirror) -> Self {
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
    shelfsync_feed::ChangeFeed::new(h.client.clone(), &h.settings, cfg)
}

/// The value of a Prometheus sample `name{labels}` in `text` (labels as
/// written, e.g. `consumer="x"`; empty for none).
pub fn metric_value(text: &str, name: &str, labels: &str) -> Option<f64> {
    let wanted = if labels.is_empty() { name.to_string() } else { format!("{name}{{{labels}}}") };
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(&wanted)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The pid of the running process whose command line contains `needle`
/// (e.g. a server's config path, unique to the test) — to signal exactly
/// that process.
pub fn pid_with_arg(needle: &str) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            return Some(pid);
        }
    }
    None
}

/// Sends `signal` (e.g. `STOP`, `CONT`, `KILL`) to one process by its id.
pub fn signal(pid: u32, signal: &str) {
    let status = Process::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill -{signal} {pid} failed");
}

/// A private CA and a certificate for 127.0.0.1 signed by it, made with the
/// `openssl` CLI: `(dir, ca.pem, cert.pem, key.pem)`.
pub fn test_certificates() -> (tempfile::TempDir, String, String, String) {
    let dir = tempfile::tempdir().expect("tmp");
    let p = |f: &str| dir.path().join(f).display().to_string();
    let run = |args: &[&str]| {
        let ok = std::process::Command::new("openssl").args(args).output().expect("openssl");
        assert!(ok.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&ok.stderr));
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=shelfsync test CA",
        "-keyout",
        &p("ca-key.pem"),
        "-out",
        &p("ca.pem"),
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        &p("key.pem"),
        "-out",
        &p("req.csr"),
    ]);
    std::fs::write(p("ext.cnf"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").expect("ext");
    run(&[
        "x509",
        "-req",
        "-in",
        &p("req.csr"),
        "-CA",
        &p("ca.pem"),
        "-CAkey",
        &p("ca-key.pem"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &p("ext.cnf"),
        "-out",
        &p("cert.pem"),
    ]);
    let (ca, cert, key) = (p("ca.pem"), p("cert.pem"), p("key.pem"));
    (dir, ca, cert, key)
}

/// A client certificate (`CN=shelfsync test client`, for TLS client
/// authentication) signed by the CA that [`test_certificates`] made in
/// `dir`: `(client.pem, client-key.pem)`.
pub fn test_client_certificate(dir: &std::path::Path) -> (String, String) {
    let p = |f: &str| dir.join(f).display().to_string();
    let run = |args: &[&str]| {
        let ok = std::process::Command::new("openssl").args(args).output().expect("openssl");
        assert!(ok.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&ok.stderr));
    };
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=shelfsync test client",
        "-keyout",
        &p("client-key.pem"),
        "-out",
        &p("client.csr"),
    ]);
    std::fs::write(p("client.cnf"), "extendedKeyUsage=clientAuth\n").expect("ext");
    run(&[
        "x509",
        "-req",
        "-in",
        &p("client.csr"),
        "-CA",
        &p("ca.pem"),
        "-CAkey",
        &p("ca-key.pem"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &p("client.cnf"),
        "-out",
        &p("client.pem"),
    ]);
    (p("client.pem"), p("client-key.pem"))
}

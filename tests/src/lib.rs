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

pub use shelfsync_testkit::eventually;

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

/// The environment variables that reproduce `settings` for a child process.
pub fn settings_env(s: &Settings) -> Vec<(String, String)> {
    vec![
        ("SHELFSYNC__NATS__URL".into(), s.nats.url.clone()),
        ("SHELFSYNC__NATS__PREFIX".into(), s.nats.prefix.clone()),
        ("SHELFSYNC__REDIS__URL".into(), s.redis.url.clone()),
        ("SHELFSYNC__REDIS__NAMESPACE".into(), s.redis.namespace.clone()),
        ("SHELFSYNC__STORAGE__PARTITIONS".into(), s.storage.partitions.to_string()),
        ("SHELFSYNC__STORAGE__ACK_WAIT".into(), humantime(s.storage.ack_wait)),
        ("SHELFSYNC__STORAGE__RETRY_DELAY".into(), humantime(s.storage.retry_delay)),
        ("SHELFSYNC__STORAGE__TOMBSTONE_TTL".into(), humantime(s.storage.tombstone_ttl)),
        ("SHELFSYNC__STORAGE__PURGE_INTERVAL".into(), humantime(s.storage.purge_interval)),
        ("SHELFSYNC__STORAGE__HTTP_LISTEN".into(), s.storage.http_listen.clone()),
        ("SHELFSYNC__STORAGE__KEYFRAME_SCHEDULE".into(), s.storage.keyframe_schedule.clone()),
        ("SHELFSYNC__INGEST__LISTEN".into(), s.ingest.listen.clone()),
    ]
}

fn humantime(d: Duration) -> String {
    format!("{}ms", d.as_millis())
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

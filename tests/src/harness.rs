//! The test's connection to its NATS and Redis ([`Harness`]): publishing
//! commands (retried through outages where asked), reading the streams
//! back, and reading what storage holds; and the commands and products the
//! tests are made of.

use std::collections::HashMap;
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
use shelfsync_storage::client::Store;

use crate::model::{RecordId, id_of};
use crate::{SETTLE, eventually};

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
        shelfsync_bus::provision(&js, &settings.nats, settings.topology()).await?;
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

    /// The consumers of a partition's command subject of the storage
    /// replica that owns it (`p % storage.replicas`): one per process bound
    /// to it (their `-sweeps` twins left out).
    pub async fn storage_consumers(&self, p: Partition) -> Vec<String> {
        use futures::TryStreamExt;
        let owner =
            self.subjects.storage_consumer_of(p, p.0 % self.settings.storage.replicas.max(1));
        let Ok(stream) = self.js.get_stream(self.subjects.cmd_stream()).await else {
            return Vec::new();
        };
        let names: Vec<String> = stream.consumer_names().try_collect().await.unwrap_or_default();
        names
            .into_iter()
            .filter(|n| n.starts_with(&format!("{owner}-")) && !n.ends_with("-sweeps"))
            .collect()
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

    /// Publishes `batch` where its producer would: on the partition's sweep
    /// subject when it carries sweeps.
    pub async fn send_batch(&self, p: Partition, batch: &CommandBatch) -> anyhow::Result<()> {
        let subject = self.subjects.cmd_for(p, !batch.sweeps.is_empty());
        self.send_raw_to(subject, batch.encode_to_vec()).await
    }

    pub async fn send_raw(&self, p: Partition, payload: Vec<u8>) -> anyhow::Result<()> {
        self.send_raw_to(self.subjects.cmd(p), payload).await
    }

    pub async fn send_raw_to(&self, subject: String, payload: Vec<u8>) -> anyhow::Result<()> {
        let n = self.msg_counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let msg = jetstream::message::PublishMessage::build()
            .payload(payload.into())
            .message_id(format!("test:{n}"))
            .header(shelfsync_bus::TYPE_HEADER, msg_type::COMMAND_BATCH);
        self.js.send_publish(subject, msg).await?.await?;
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
            if self.store.outbox_len(Partition(p)).await.map_or(true, |n| n > 0) {
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
                &self.subjects.cmd_for(Partition(b.partition), !b.sweeps.is_empty()),
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
            for r in self
                .store
                .place_records(self.settings.storage.partitions, (brand, p).into())
                .await?
            {
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
}

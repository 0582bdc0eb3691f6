//! The coalescing command publisher against a real nats-server: what it
//! stores, in how many messages, in what order.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;
use prost::Message;
use shelfsync_bus::{CommandPublisher, CommandPublisherConfig, Subjects, partition_of, provision};
use shelfsync_proto::{Command, CommandBatch, CommandKind, Product, RecordKey};
use shelfsync_settings::Settings;
use shelfsync_testkit::{NatsServer, unique_name};

fn price(place: i64, id: &str, price: i64) -> Command {
    Command {
        key: Some(RecordKey::new(7, place, id)),
        kind: CommandKind::Patch as i32,
        data: Product { price: Some(price), ..Default::default() }.encode_to_vec(),
        ..Default::default()
    }
}

struct World {
    _server: NatsServer,
    client: async_nats::Client,
    js: jetstream::Context,
    subjects: Subjects,
    settings: Settings,
}

async fn world(atomic: bool) -> World {
    let server = NatsServer::start().await.expect("nats");
    let client = async_nats::connect(server.url()).await.expect("connect");
    let js = jetstream::new(client.clone());
    let mut settings = Settings::default();
    settings.nats.prefix = unique_name();
    settings.storage.partitions = 8;
    provision(&js, &settings.nats, settings.topology()).await.expect("provision");
    let subjects = Subjects::new(&settings.nats.prefix);
    if atomic {
        let mut cmd = js.get_stream(subjects.cmd_stream()).await.expect("CMD");
        let mut config = cmd.info().await.expect("info").config.clone();
        config.allow_atomic_publish = true;
        js.update_stream(&config).await.expect("allow atomic");
    }
    World { _server: server, client, js, subjects, settings }
}

impl World {
    fn publisher(&self, atomic: bool) -> CommandPublisher {
        let mut config = CommandPublisherConfig::new(
            self.settings.storage.partitions,
            self.client.server_info().max_payload,
        );
        config.atomic = atomic;
        CommandPublisher::start(self.client.clone(), self.js.clone(), self.subjects.clone(), config)
    }

    /// Every command message stored, in stream order.
    async fn stored(&self) -> Vec<(String, CommandBatch)> {
        let mut stream = self.js.get_stream(self.subjects.cmd_stream()).await.expect("CMD");
        let last = stream.info().await.expect("info").state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            let m = stream.get_raw_message(seq).await.expect("message");
            let batch = CommandBatch::decode(m.payload.as_ref()).expect("batch");
            out.push((m.subject.to_string(), batch));
        }
        out
    }
}

async fn coalesces_and_keeps_order(atomic: bool) {
    let w = world(atomic).await;
    let publisher = w.publisher(atomic);
    // One command alone goes out at once, in a message of its own.
    publisher.publish(price(1, "alone", 1)).await.expect("stored");
    assert_eq!(w.stored().await.len(), 1);
    // 2 000 commands handed over at once by 20 callers, 100 each, every
    // caller re-pricing its own records in order.
    let mut tasks = tokio::task::JoinSet::new();
    for caller in 0..20i64 {
        let publisher = publisher.clone();
        tasks.spawn(async move {
            let mut pending = Vec::new();
            for k in 0..100i64 {
                let cmd = price(caller % 16, &format!("c{caller}-r{}", k % 5), k);
                pending.push(publisher.submit(cmd).await.expect("queued"));
            }
            for p in pending {
                p.await.expect("answered").expect("stored");
            }
        });
    }
    while let Some(t) = tasks.join_next().await {
        t.expect("caller");
    }
    let stored = w.stored().await;
    let commands: Vec<&Command> = stored.iter().skip(1).flat_map(|(_, b)| &b.commands).collect();
    assert_eq!(commands.len(), 2000, "every command stored once");
    assert!(
        stored.len() - 1 < 2000 / 4,
        "coalesced: {} messages for 2000 commands",
        stored.len() - 1
    );
    // Each message holds commands of its subject's partition only.
    for (subject, batch) in &stored {
        for c in &batch.commands {
            let k = c.key.as_ref().expect("key");
            let p = partition_of(k.brand_id, k.place_id, w.settings.storage.partitions);
            assert_eq!(subject, &w.subjects.cmd(p));
        }
    }
    // Per record, the prices arrive in the order they were handed over.
    let mut last: HashMap<String, i64> = HashMap::new();
    for c in commands {
        let id = c.key.as_ref().expect("key").product_id.clone();
        let p = Product::decode(c.data.as_slice()).expect("product").price.expect("price");
        if let Some(prev) = last.insert(id.clone(), p) {
            assert!(p > prev, "{id}: {p} after {prev}");
        }
    }
}

#[tokio::test]
async fn commands_are_coalesced_per_partition_and_keep_their_order() {
    coalesces_and_keeps_order(false).await;
}

#[tokio::test]
async fn flushes_go_as_atomic_batches_where_the_stream_allows_them() {
    coalesces_and_keeps_order(true).await;
}

#[tokio::test]
async fn a_command_the_stream_refuses_for_good_is_reported_and_the_rest_go_on() {
    let w = world(false).await;
    let publisher = w.publisher(false);
    // Commands for a stream that has no subject for them: no responders,
    // retried, so give the refusal case a real one: a payload over the
    // stream's largest message.
    let mut huge = price(1, "huge", 1);
    huge.data = vec![0u8; 2 << 20];
    let refused = tokio::time::timeout(Duration::from_secs(30), publisher.publish(huge)).await;
    assert!(matches!(refused, Ok(Err(_))), "a message over the limit is refused: {refused:?}");
    publisher.publish(price(1, "after", 1)).await.expect("the next one is stored");
    assert_eq!(w.stored().await.len(), 1);
}

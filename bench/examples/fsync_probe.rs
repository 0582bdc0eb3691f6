//! How many messages a durable JetStream stores per second, by way of
//! publishing, and what consuming them costs: a probe for the live path's
//! design (docs/PERFORMANCE.md). Starts its own nats-server with
//! `sync_interval: always` in a temp dir.
//!
//! cargo run --release -p shelfsync-bench --example fsync_probe

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use futures::StreamExt;
use shelfsync_bus::atomic::{BatchMessage, publish_atomic};
use shelfsync_testkit::NatsServer;

const N: usize = 6000;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let durable = std::env::args().nth(1).as_deref() != Some("volatile");
    let conf = if durable { "jetstream { sync_interval: always }" } else { "" };
    let server = NatsServer::start_with_config(conf).await?;
    let client = async_nats::connect(server.url()).await?;
    let js = jetstream::new(client.clone());
    let payload = Bytes::from(vec![b'x'; 200]);
    let mut name = 0;
    let mut fresh = |retention| {
        name += 1;
        stream::Config {
            name: format!("S{name}"),
            subjects: vec![format!("s{name}.>")],
            retention,
            allow_atomic_publish: true,
            ..Default::default()
        }
    };
    // 1. one publish a message, 64 in flight.
    let cfg = fresh(stream::RetentionPolicy::Limits);
    js.create_stream(cfg.clone()).await?;
    let subj = |i: usize| format!("{}.{}", cfg.name.to_lowercase(), i % 64);
    let t = Instant::now();
    let mut acks = std::collections::VecDeque::new();
    for i in 0..N {
        acks.push_back(js.publish(subj(i), payload.clone()).await?);
        if acks.len() >= 64 {
            acks.pop_front().expect("a full window").await?;
        }
    }
    for a in acks {
        a.await?;
    }
    println!("publish each, 64 in flight: {:.0} msg/s", N as f64 / t.elapsed().as_secs_f64());
    // 2. atomic batches of k messages, one at a time and 4 at once.
    for (k, par) in [(16, 1), (64, 1), (64, 4), (500, 1)] {
        let cfg = fresh(stream::RetentionPolicy::Limits);
        js.create_stream(cfg.clone()).await?;
        let prefix = cfg.name.to_lowercase();
        let t = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..par {
            let (client, payload, prefix) = (client.clone(), payload.clone(), prefix.clone());
            tasks.spawn(async move {
                for b in (w..N / k).step_by(par) {
                    let msgs = (0..k)
                        .map(|i| BatchMessage {
                            subject: format!("{prefix}.{}", (b * k + i) % 64),
                            headers: HeaderMap::new(),
                            payload: payload.clone(),
                        })
                        .collect();
                    publish_atomic(&client, msgs, Duration::from_secs(10)).await.expect("stored");
                }
            });
        }
        while tasks.join_next().await.is_some() {}
        println!(
            "atomic batches of {k}, {par} at once: {:.0} msg/s",
            N as f64 / t.elapsed().as_secs_f64()
        );
    }
    // 3. consuming a work queue, one ack a message.
    let cfg = fresh(stream::RetentionPolicy::WorkQueue);
    let s = js.create_stream(cfg.clone()).await?;
    let prefix = cfg.name.to_lowercase();
    fill(&client, &prefix, &payload).await?;
    let consumer = s
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("c".into()),
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let t = Instant::now();
    for _ in 0..N {
        let m = messages.next().await.expect("a message").map_err(|e| anyhow::anyhow!("{e}"))?;
        m.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    client.flush().await?;
    // Wait until the stream is empty (acks processed).
    let mut s = js.get_stream(&cfg.name).await?;
    while s.info().await?.state.messages > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!("work queue, ack each: {:.0} msg/s", N as f64 / t.elapsed().as_secs_f64());
    // 4. the same consumed with no acks, purged per subject.
    let cfg = fresh(stream::RetentionPolicy::Limits);
    let s = js.create_stream(cfg.clone()).await?;
    let prefix = cfg.name.to_lowercase();
    fill(&client, &prefix, &payload).await?;
    let t = Instant::now();
    for p in 0..64 {
        s.purge().filter(format!("{prefix}.{p}")).sequence(N as u64 + 1).await?;
    }
    println!("64 purges (one a partition): {:?}", t.elapsed());
    Ok(())
}

/// Stores `N` messages over the 64 subjects under `prefix`, in atomic
/// batches of 500.
async fn fill(client: &async_nats::Client, prefix: &str, payload: &Bytes) -> anyhow::Result<()> {
    for b in 0..N / 500 {
        let msgs = (0..500)
            .map(|i| BatchMessage {
                subject: format!("{prefix}.{}", (b * 500 + i) % 64),
                headers: HeaderMap::new(),
                payload: payload.clone(),
            })
            .collect();
        publish_atomic(client, msgs, Duration::from_secs(10)).await?;
    }
    Ok(())
}

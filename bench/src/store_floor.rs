//! The live path's floor on the run's NATS: how many messages per second one stream stores when
//! they come as separate publishes (many in flight, one subject per place, as the relay's
//! change messages), and when they come as atomic batches of [`BATCH`] (`allow_atomic`). On a
//! server that fsyncs every write this is the bound on change messages per second: one change
//! message per place changed in a commit round, whatever storage does before it.

use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use futures::StreamExt;
use shelfsync_bus::atomic::{BatchMessage, publish_atomic};

use crate::report::StoreFloor;
use crate::world::World;

/// Messages each way.
const MESSAGES: usize = 5_000;
/// Subjects they are spread over (the live table's places).
const SUBJECTS: usize = 2_000;
/// Separate publishes in flight at once.
const IN_FLIGHT: usize = 256;
/// Messages per atomic batch, and batches in flight at once.
const BATCH: usize = 100;
const BATCHES_IN_FLIGHT: usize = 8;
/// About a change message's size.
const PAYLOAD: usize = 300;

const STREAM: &str = "BENCH_STORE_FLOOR";

pub async fn measure(world: &World) -> anyhow::Result<StoreFloor> {
    let config = stream::Config {
        name: STREAM.into(),
        subjects: vec!["bench.floor.>".into()],
        storage: stream::StorageType::File,
        num_replicas: world.stream_replicas(),
        allow_atomic_publish: true,
        ..Default::default()
    };
    let _ = world.js.delete_stream(STREAM).await;
    world.js.create_stream(config).await.context("creating the store-floor stream")?;
    let payload = Bytes::from(vec![b'x'; PAYLOAD]);
    let subject = |i: usize| format!("bench.floor.{}", i % SUBJECTS);

    let started = Instant::now();
    let js = world.js.clone();
    let publishes = futures::stream::iter(0..MESSAGES)
        .map(|i| {
            let (js, payload) = (js.clone(), payload.clone());
            async move { js.publish(subject(i), payload).await?.await }
        })
        .buffer_unordered(IN_FLIGHT);
    log_failures(publishes, "a publish").await;
    let single = MESSAGES as f64 / started.elapsed().as_secs_f64();

    let started = Instant::now();
    let client = world.client.clone();
    let batches = futures::stream::iter(0..MESSAGES / BATCH)
        .map(|b| {
            let (client, payload) = (client.clone(), payload.clone());
            let messages = (0..BATCH)
                .map(|i| BatchMessage {
                    subject: subject(b * BATCH + i),
                    headers: async_nats::HeaderMap::new(),
                    payload: payload.clone(),
                })
                .collect();
            async move { publish_atomic(&client, messages, Duration::from_secs(30)).await }
        })
        .buffer_unordered(BATCHES_IN_FLIGHT);
    log_failures(batches, "an atomic batch").await;
    let atomic = MESSAGES as f64 / started.elapsed().as_secs_f64();

    let stored = stored(&world.js).await?;
    let _ = world.js.delete_stream(STREAM).await;
    anyhow::ensure!(
        stored == 2 * MESSAGES as u64,
        "the store floor stored {stored} of {} messages",
        2 * MESSAGES
    );
    eprintln!(
        "[bench] store floor: {single:.0} msgs/s as separate publishes, {atomic:.0} msgs/s as \
         atomic batches of {BATCH}"
    );
    Ok(StoreFloor {
        messages: MESSAGES as u64,
        subjects: SUBJECTS as u64,
        separate_per_s: single,
        in_flight: IN_FLIGHT as u64,
        atomic_per_s: atomic,
        batch: BATCH as u64,
    })
}

/// Runs `results` to the end, logging each failure (the count check after says if any was lost).
async fn log_failures<T, E: std::fmt::Display>(
    results: impl futures::Stream<Item = Result<T, E>>,
    what: &str,
) {
    results
        .for_each(|r| {
            if let Err(e) = r {
                eprintln!("[bench] store floor: {what} failed: {e}");
            }
            async {}
        })
        .await;
}

async fn stored(js: &jetstream::Context) -> anyhow::Result<u64> {
    let mut stream = js.get_stream(STREAM).await?;
    Ok(stream.info().await?.state.messages)
}

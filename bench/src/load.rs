//! The live load generator: it plays the producers of live changes (ingest's partial feeds, a
//! validator, a service pushing one price), offering PATCHes at a fixed rate — each a new price
//! for a random offer, so each is a real change — with `Origin.published_at` set when the
//! command is handed over. Two ways to send, as the two kinds of producers do:
//!
//! - [`Mode::Kit`]: through the kit's `CommandPublisher` (what ingest, the validator and any
//!   service using `shelfsync_bus` send): one command at a time, coalesced by the publisher;
//! - [`Mode::Single`]: one command per message, raw JetStream publishes (256 in flight), what
//!   a producer that uses no kit sends: the worst case the server allows.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use prost::Message;
use shelfsync_bus::{CommandPublisher, CommandPublisherConfig, Publisher, Subjects};
use shelfsync_proto::{Command, CommandBatch, CommandKind, Origin, Product, RecordKey, msg_type};
use tokio::sync::watch;

use crate::children::Target;
use crate::world::{BRAND, World};

/// `Origin.source` of the load generator's commands: only these are timed.
pub const LOAD_SOURCE: &str = "bench-live";

/// Wall-clock microseconds (what `Origin.published_at` carries).
pub fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

/// How the load is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Kit,
    Single,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Kit => "kit publisher",
            Mode::Single => "one command per message",
        }
    }
}

/// What to offer: the rate, how it is sent, over which offers.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub rate: u64,
    pub mode: Mode,
    /// Places 1..=places of the bench's brand, `items` offers each.
    pub places: u32,
    pub items: u32,
}

/// The load generator, running until stopped.
pub struct Load {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<u64>>,
}

struct Ctx {
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    subjects: Subjects,
    partitions: u32,
    spec: Spec,
    tick: Duration,
    run_id: u64,
}

impl Load {
    /// The profile's load: its rate, through the kit, over the data set's places.
    pub fn start(world: &World, storage: &Target, rate: u64, run_id: u64) -> Load {
        let p = &world.profile;
        let spec = Spec { rate, mode: Mode::Kit, places: p.places, items: p.items_per_place };
        Load::start_spec(world, storage, spec, run_id)
    }

    pub fn start_spec(world: &World, storage: &Target, spec: Spec, run_id: u64) -> Load {
        let (stop, stopped) = watch::channel(false);
        let ctx = Ctx {
            client: world.client.clone(),
            js: world.js.clone(),
            subjects: storage.subjects(),
            partitions: storage.settings.storage.partitions,
            spec,
            tick: world.profile.fresh_tick,
            run_id,
        };
        Load { stop, task: tokio::spawn(generate(ctx, stopped)) }
    }

    /// Stops, waits until JetStream stored everything handed over, and returns how many
    /// changes were published.
    pub async fn stop(self) -> anyhow::Result<u64> {
        let _ = self.stop.send(true);
        self.task.await?
    }
}

/// splitmix64: deterministic and dependency-free.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n.max(1)
    }
}

/// Where a command goes: the kit's publisher, or raw publishes of one command each.
enum Sender {
    Kit(CommandPublisher),
    Single(Box<Publisher>),
}

async fn generate(ctx: Ctx, mut stopped: watch::Receiver<bool>) -> anyhow::Result<u64> {
    let max_payload = ctx.client.server_info().max_payload;
    let mut sender = match ctx.spec.mode {
        Mode::Kit => Sender::Kit(CommandPublisher::start(
            ctx.client.clone(),
            ctx.js.clone(),
            ctx.subjects.clone(),
            CommandPublisherConfig::new(ctx.partitions, max_payload),
        )),
        Mode::Single => Sender::Single(Box::new(Publisher::new(ctx.js.clone(), 256))),
    };
    let mut stored = FuturesUnordered::new();
    let mut offers = Offers::new(ctx.run_id, ctx.spec.places, ctx.spec.items);
    let mut interval = tokio::time::interval(ctx.tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    let mut sent = 0u64;
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            _ = interval.tick() => {}
            Some(done) = stored.next(), if !stored.is_empty() => {
                let done: Result<Result<(), _>, _> = done;
                done??;
                continue;
            }
        }
        // What is due by now at the offered rate, whatever the tick jitter was.
        let due = (started.elapsed().as_secs_f64() * ctx.spec.rate as f64) as u64;
        for k in sent..due {
            let command = change(&ctx, &mut offers, k);
            match &mut sender {
                Sender::Kit(publisher) => stored.push(publisher.submit(command).await?),
                Sender::Single(publisher) => {
                    let partition = shelfsync_bus::Partition::of(
                        command.key.as_ref().expect("a key").place(),
                        ctx.partitions,
                    );
                    let batch = CommandBatch { commands: vec![command], ..Default::default() };
                    publisher
                        .publish(
                            ctx.subjects.cmd(partition),
                            format!("live:{}:{k}", ctx.run_id),
                            msg_type::COMMAND_BATCH,
                            None,
                            batch.encode_to_vec().into(),
                        )
                        .await?;
                }
            }
        }
        sent = due.max(sent);
    }
    while let Some(done) = stored.next().await {
        done??;
    }
    if let Sender::Single(mut publisher) = sender {
        publisher.flush().await?;
    }
    Ok(sent)
}

/// One live change: an offer of the bench's brand and a price no record had before.
pub struct Offer {
    pub place: i64,
    pub product_id: String,
    pub price: i64,
}

/// The changes of one run, in order: a random offer each (places 1..=places, `items` offers
/// each), deterministic per run — what shelfsync's load and the PostgreSQL peer both send.
pub struct Offers {
    rng: Rng,
    places: u32,
    items: u32,
    run_id: u64,
}

impl Offers {
    pub fn new(run_id: u64, places: u32, items: u32) -> Offers {
        Offers { rng: Rng(run_id), places, items, run_id }
    }

    /// The `k`-th change of the run.
    pub fn change(&mut self, k: u64) -> Offer {
        let place = 1 + self.rng.below(u64::from(self.places)) as i64;
        let n = 1 + self.rng.below(u64::from(self.items));
        let price = 1_000_000 + (self.run_id << 32 | k) as i64 % 1_000_000_000;
        Offer { place, product_id: format!("sku-{place}-{n}"), price }
    }
}

/// The `k`-th change of the run as a PATCH command.
fn change(ctx: &Ctx, offers: &mut Offers, k: u64) -> Command {
    let Offer { place, product_id, price } = offers.change(k);
    Command {
        key: Some(RecordKey::new(BRAND, place, product_id)),
        kind: CommandKind::Patch as i32,
        data: Product { price: Some(price), ..Default::default() }.encode_to_vec(),
        origin: Some(Origin {
            source: LOAD_SOURCE.into(),
            import_id: format!("live-{}", ctx.run_id),
            published_at: now_us(),
        }),
        ..Default::default()
    }
}

//! Memory and latency of the recommender index (a bench, not a test).
//!
//! `cargo run --release -p shelfsync-recommender --example bench [-- OFFERS]`
//!
//! 1. Memory: indexes OFFERS (default 1M) synthetic offers — 100 places of
//!    OFFERS/100 products across 20 categories, ids like `sku-0001234` — and
//!    prints the process RSS delta per offer (Linux `/proc/self/statm`).
//! 2. Latency: one place of 100k offers across 20 categories; 100k top-10
//!    queries through the same read path the APIs use (read lock + query),
//!    with and without a category, then again while a writer thread applies
//!    ~5k upserts/s in lock-sized chunks. Prints p50 / p99 / max.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use shelfsync_feed::FeedStatus;
use shelfsync_recommender::{Api, Index, Limits, Offer, PlaceKey, SharedIndex, TopQuery};

const CATEGORIES: usize = 20;

/// splitmix64: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn category_names() -> Vec<String> {
    (0..CATEGORIES).map(|c| format!("category-{c:02}")).collect()
}

fn offer(rng: &mut Rng, categories: &[String]) -> Offer {
    let old_price = 1_000 + rng.below(100_000) as i64;
    let price = if rng.below(3) == 0 {
        old_price
    } else {
        old_price - rng.below(old_price as u64 / 2) as i64
    };
    Offer {
        category: categories[rng.below(categories.len() as u64) as usize].clone(),
        price,
        old_price: (rng.below(4) != 0).then_some(old_price),
        stock: 1 + rng.below(50) as i64,
    }
}

fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn memory(offers: usize) {
    let categories = category_names();
    let places = 100usize;
    let per_place = offers.div_ceil(places);
    let mut rng = Rng(1);
    let before = rss_bytes();
    let started = Instant::now();
    let mut index = Index::new();
    let mut n = 0;
    'outer: for place in 0..places {
        for i in 0..per_place {
            if n == offers {
                break 'outer;
            }
            index.upsert(
                PlaceKey::new(7, place as i64),
                &format!("sku-{i:07}"),
                offer(&mut rng, &categories),
            );
            n += 1;
        }
    }
    let took = started.elapsed();
    let after = rss_bytes();
    println!(
        "memory: {} offers in {} places, {CATEGORIES} categories, built in {took:.2?} ({:.0} upserts/s)",
        index.len(),
        index.places(),
        index.len() as f64 / took.as_secs_f64()
    );
    match (before, after) {
        (Some(b), Some(a)) => println!(
            "memory: RSS delta {:.1} MiB = {:.0} bytes per offer",
            (a - b) as f64 / (1024.0 * 1024.0),
            (a - b) as f64 / index.len() as f64
        ),
        _ => println!("memory: RSS not available on this platform"),
    }
    drop(index);
}

struct Percentiles {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn percentiles(mut samples: Vec<Duration>) -> Percentiles {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    Percentiles { p50: at(0.50), p99: at(0.99), max: *samples.last().unwrap() }
}

fn run_queries(
    api: &Api,
    place: PlaceKey,
    categories: &[String],
    queries: usize,
    seed: u64,
) -> (Percentiles, Percentiles) {
    let mut rng = Rng(seed);
    let (mut with, mut without) =
        (Vec::with_capacity(queries / 2), Vec::with_capacity(queries / 2));
    for i in 0..queries {
        let category =
            (i % 2 == 0).then(|| categories[rng.below(categories.len() as u64) as usize].clone());
        let q = TopQuery { place, category, limit: 10, exclude: Vec::new() };
        let started = Instant::now();
        let items = api.top(&q).unwrap();
        let took = started.elapsed();
        assert_eq!(items.len(), 10);
        if q.category.is_some() { with.push(took) } else { without.push(took) }
    }
    (percentiles(with), percentiles(without))
}

fn print(label: &str, p: &Percentiles) {
    println!("latency: {label:<44} p50 {:>8.2?}  p99 {:>8.2?}  max {:>8.2?}", p.p50, p.p99, p.max);
}

fn latency() {
    let categories = category_names();
    let place = PlaceKey::new(7, 1);
    let offers = 100_000;
    let index = SharedIndex::default();
    let mut rng = Rng(2);
    {
        let mut ix = index.write();
        for i in 0..offers {
            ix.upsert(place, &format!("sku-{i:07}"), offer(&mut rng, &categories));
        }
    }
    let status = Arc::new(FeedStatus::default());
    status.bootstrapped.store(true, Ordering::SeqCst);
    let api = Api::new(index.clone(), status, Limits { default_top_n: 10, max_top_n: 100 });
    let queries = 100_000;
    println!(
        "latency: {offers} offers in one place, {CATEGORIES} categories, {queries} top-10 queries"
    );
    // Warm up caches and the allocator.
    run_queries(&api, place, &categories, 10_000, 3);
    let (with, without) = run_queries(&api, place, &categories, queries, 4);
    print("with a category", &with);
    print("without a category (20-way merge)", &without);

    // Again, while a writer changes ~5k offers/s, 128 per lock hold.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (index, stop, categories) = (index.clone(), stop.clone(), categories.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(5);
            let mut written = 0u64;
            while !stop.load(Ordering::Relaxed) {
                {
                    let mut ix = index.write();
                    for _ in 0..128 {
                        let id = format!("sku-{:07}", rng.below(offers as u64));
                        ix.upsert(place, &id, offer(&mut rng, &categories));
                    }
                }
                written += 128;
                std::thread::sleep(Duration::from_millis(25));
            }
            written
        })
    };
    let started = Instant::now();
    let (with, without) = run_queries(&api, place, &categories, queries, 6);
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().unwrap();
    let rate = written as f64 / started.elapsed().as_secs_f64();
    print(&format!("with a category, writer at {rate:.0}/s"), &with);
    print(&format!("without a category, writer at {rate:.0}/s"), &without);
}

fn main() {
    let offers = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    memory(offers);
    latency();
}

//! The sizes of a run: the full profile the targets speak of, and `--quick` for CI.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Profile {
    pub name: &'static str,
    pub places: u32,
    pub items_per_place: u32,
    /// Command partitions (the settings default).
    pub partitions: u32,
    /// Dumps whose ingest peak RSS is measured, in MB (10^6 bytes).
    pub rss_dumps_mb: Vec<u64>,
    /// Offered rate of the freshness runs, changes per second.
    pub fresh_rate: u64,
    /// The load generator publishes what is due every tick.
    pub fresh_tick: Duration,
    /// Length of the freshness run without a keyframe.
    pub fresh_run: Duration,
    /// Live load before and after the keyframe of the live keyframe run.
    pub keyframe_margin: Duration,
    /// In-process top-N queries.
    pub queries: usize,
    pub http_run: Duration,
    pub http_connections: usize,
    /// The live table: places and offers per place its changes are spread over, the offered
    /// rates through the kit's publisher and one command per message, how long each runs.
    pub live_places: u32,
    pub live_items: u32,
    pub live_rates_kit: Vec<u64>,
    pub live_rates_single: Vec<u64>,
    pub live_run: Duration,
    /// The ceiling search: rates stepped up through the kit, each held this long.
    pub ceiling_rates: Vec<u64>,
    pub ceiling_hold: Duration,
    /// Connection counts of the PostgreSQL peer of the live job (the best is kept).
    pub pg_live_connections: Vec<usize>,
}

impl Profile {
    pub fn new(quick: bool, records: Option<u64>) -> Profile {
        let mut p = if quick {
            Profile {
                name: "quick",
                places: 100,
                items_per_place: 200,
                partitions: 64,
                rss_dumps_mb: vec![10],
                fresh_rate: 5_000,
                fresh_tick: Duration::from_millis(10),
                fresh_run: Duration::from_secs(3),
                keyframe_margin: Duration::from_secs(1),
                queries: 20_000,
                http_run: Duration::from_secs(2),
                http_connections: 16,
                live_places: 2_000,
                live_items: 5,
                live_rates_kit: vec![1_000],
                live_rates_single: vec![500],
                live_run: Duration::from_millis(1500),
                ceiling_rates: vec![2_000, 4_000],
                ceiling_hold: Duration::from_millis(1500),
                pg_live_connections: vec![4],
            }
        } else {
            Profile {
                name: "full",
                places: 100,
                items_per_place: 10_000,
                partitions: 64,
                rss_dumps_mb: vec![100, 1000],
                fresh_rate: 5_000,
                fresh_tick: Duration::from_millis(10),
                fresh_run: Duration::from_secs(20),
                keyframe_margin: Duration::from_secs(3),
                queries: 200_000,
                http_run: Duration::from_secs(10),
                http_connections: 16,
                live_places: 2_000,
                live_items: 5,
                live_rates_kit: vec![1_000, 2_000, 5_000],
                live_rates_single: vec![1_000, 2_000],
                live_run: Duration::from_secs(10),
                ceiling_rates: vec![
                    1_000, 2_000, 3_000, 4_000, 5_000, 10_000, 15_000, 20_000, 25_000,
                ],
                ceiling_hold: Duration::from_secs(20),
                pg_live_connections: vec![4, 8, 16],
            }
        };
        if let Some(n) = records {
            p.items_per_place = (n / u64::from(p.places)).clamp(1, u64::from(u32::MAX)) as u32;
        }
        p
    }

    pub fn records(&self) -> u64 {
        u64::from(self.places) * u64::from(self.items_per_place)
    }
}

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

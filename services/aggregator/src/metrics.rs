//! Every metric the aggregator exports, in one place: the names (the
//! dashboards, alerts and docs/OPERATE.md use them as they are), their
//! descriptions, and one typed function per thing recorded. Counters are
//! counted once, where the event happens; the reloads still to sweep are
//! set just before a scrape, from the instance that is scraped.

use metrics::{counter, describe_counter, describe_gauge, gauge};

/// Change messages handled.
pub const BATCHES: &str = "shelfsync_aggregator_batches_total";
/// Master card changes published.
pub const CARDS_PUBLISHED: &str = "shelfsync_aggregator_cards_published_total";
/// Category flips published.
pub const FLIPS_PUBLISHED: &str = "shelfsync_aggregator_category_flips_published_total";
/// Changes ignored as older than what it holds.
pub const STALE_VERSIONS: &str = "shelfsync_aggregator_stale_versions_total";
/// Records forgotten (absent, purged, place reset).
pub const FORGOTTEN: &str = "shelfsync_aggregator_forgotten_records_total";
/// Reloaded places not yet swept.
pub const PENDING_RELOADS: &str = "shelfsync_aggregator_pending_reloads";

/// Describes the metrics and registers every counter at zero, so that a
/// scrape shows them before the first batch. Idempotent.
pub fn register() {
    shelfsync_telemetry::install_metrics();
    describe_counter!(BATCHES, "Change messages handled by the aggregator");
    describe_counter!(CARDS_PUBLISHED, "Master card changes published");
    describe_counter!(FLIPS_PUBLISHED, "Category flips published");
    describe_counter!(STALE_VERSIONS, "Changes older than what the aggregator holds");
    describe_counter!(FORGOTTEN, "Records the aggregator forgot");
    describe_gauge!(PENDING_RELOADS, "Reloaded places not yet swept");
    for name in [BATCHES, CARDS_PUBLISHED, FLIPS_PUBLISHED, STALE_VERSIONS, FORGOTTEN] {
        counter!(name).increment(0);
    }
}

/// A batch was aggregated and what it changed published.
pub fn batch(cards_published: usize, flips_published: usize) {
    counter!(BATCHES).increment(1);
    counter!(CARDS_PUBLISHED).increment(cards_published as u64);
    counter!(FLIPS_PUBLISHED).increment(flips_published as u64);
}

/// Record versions older than what was already counted.
pub fn stale_versions(n: usize) {
    counter!(STALE_VERSIONS).increment(n as u64);
}

/// Records forgotten at the end of a reload (gone from storage).
pub fn forgotten(n: usize) {
    counter!(FORGOTTEN).increment(n as u64);
}

/// Reloaded places whose sweep is still due, set before a scrape.
pub fn set_pending_reloads(n: usize) {
    gauge!(PENDING_RELOADS).set(n as f64);
}

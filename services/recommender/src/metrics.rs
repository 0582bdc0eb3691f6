//! Every metric the recommender exports, in one place: the names (the
//! dashboards, alerts and docs/OPERATE.md use them as they are), their
//! descriptions, and one typed function per thing recorded. Counters are
//! counted once, where the event happens; the gauges of what the index
//! holds are set just before a scrape.

use metrics::{counter, describe_counter, describe_gauge, gauge};

/// 1 once bootstrapped (and not stopping).
pub const READY: &str = "shelfsync_recommender_ready";
/// Offers in the index.
pub const OFFERS: &str = "shelfsync_recommender_offers";
/// Places with an offer.
pub const PLACES: &str = "shelfsync_recommender_places";
/// Top-N queries received, label `transport` (`http`, `nats`).
pub const QUERIES: &str = "shelfsync_recommender_queries_total";
/// Queries refused (bad input, not ready).
pub const REJECTED_QUERIES: &str = "shelfsync_recommender_rejected_queries_total";

/// How a query came in: the `transport` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Http,
    Nats,
}

impl Transport {
    fn label(self) -> &'static str {
        match self {
            Transport::Http => "http",
            Transport::Nats => "nats",
        }
    }
}

/// Describes the metrics and registers every series at zero, so that a
/// scrape shows them before the first query. Idempotent.
pub fn register() {
    shelfsync_telemetry::install_metrics();
    describe_gauge!(READY, "1 once the recommender is bootstrapped");
    describe_gauge!(OFFERS, "Offers in the recommender's index");
    describe_gauge!(PLACES, "Places with an offer in the recommender's index");
    describe_counter!(QUERIES, "Top-N queries answered, by transport");
    describe_counter!(REJECTED_QUERIES, "Queries refused (bad input, not ready)");
    for transport in [Transport::Http, Transport::Nats] {
        counter!(QUERIES, "transport" => transport.label()).increment(0);
    }
    counter!(REJECTED_QUERIES).increment(0);
}

/// A query came in over `transport` (answered or not).
pub fn query(transport: Transport) {
    counter!(QUERIES, "transport" => transport.label()).increment(1);
}

/// A query was refused.
pub fn rejected() {
    counter!(REJECTED_QUERIES).increment(1);
}

/// What the index holds and whether it answers, set before a scrape.
pub fn set_index(ready: bool, offers: usize, places: usize) {
    gauge!(READY).set(f64::from(u8::from(ready)));
    gauge!(OFFERS).set(offers as f64);
    gauge!(PLACES).set(places as f64);
}

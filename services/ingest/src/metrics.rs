//! Every metric ingest records, in one place: one typed function per thing
//! recorded, so the rest of the service names what happened instead of
//! recording inline.
//!
//! The names themselves and their descriptions stay in
//! `shelfsync_telemetry::names` and its `describe()`: the dashboards and
//! alerts in k8s/base/monitoring use them, the deployment checks read them
//! there, and `shelfsync_rejects_total` is storage's too. They are
//! re-exported here so that this module lists what ingest exports.

use metrics::{counter, gauge};

pub use shelfsync_telemetry::names::{
    INGEST_BYTES, INGEST_ITEMS, INGEST_KNOWN_PLACES, INGEST_LAST_SUCCESS, INGEST_POLL_INTERVAL,
    INGEST_PUSH_REFUSED, REJECTS,
};

/// Raw feed bytes an import read.
pub fn bytes_read(partner: &str, bytes: u64) {
    counter!(INGEST_BYTES, "partner" => partner.to_owned()).increment(bytes);
}

/// Valid feed items turned into commands.
pub fn items(partner: &str, items: usize) {
    counter!(INGEST_ITEMS, "partner" => partner.to_owned()).increment(items as u64);
}

/// One feed item rejected, by reason.
pub fn rejected(reason: &str) {
    counter!(REJECTS, "reason" => reason.to_owned()).increment(1);
}

/// An import of `partner` completed, at `unix_seconds`.
pub fn last_success(partner: &str, unix_seconds: f64) {
    gauge!(INGEST_LAST_SUCCESS, "partner" => partner.to_owned()).set(unix_seconds);
}

/// A polled partner's poll interval.
pub fn poll_interval(partner: &str, every: std::time::Duration) {
    gauge!(INGEST_POLL_INTERVAL, "partner" => partner.to_owned()).set(every.as_secs_f64());
}

/// A push request refused; `partner` is a configured name or `unknown`.
pub fn push_refused(partner: &str, reason: &'static str) {
    counter!(INGEST_PUSH_REFUSED, "partner" => partner.to_owned(), "reason" => reason).increment(1);
}

/// The places ingest remembers a partner's full imports carried.
pub fn known_places(partner: &str, places: u64) {
    gauge!(INGEST_KNOWN_PLACES, "partner" => partner.to_owned()).set(places as f64);
}

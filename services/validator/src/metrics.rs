//! Every metric the validator records, in one place: one typed function per
//! thing recorded, so the rest of the service names what happened instead of
//! recording inline.
//!
//! The name itself, `shelfsync_validator_decisions_total`, and its
//! description stay in `shelfsync_telemetry::names` and its `describe()`
//! (described once for every process at install; the deployment checks read
//! the names there); it is re-exported here so that this module lists what
//! the validator exports.

use metrics::counter;

/// Hide / un-hide decisions, label `decision` (`hide`, `unhide`).
pub use shelfsync_telemetry::names::VALIDATOR_DECISIONS;

/// The decisions of one batch carried out.
pub fn decisions(hides: u64, unhides: u64) {
    counter!(VALIDATOR_DECISIONS, "decision" => "hide").increment(hides);
    counter!(VALIDATOR_DECISIONS, "decision" => "unhide").increment(unhides);
}

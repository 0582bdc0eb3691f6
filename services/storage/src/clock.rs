//! Storage's one wall clock.

/// Now, in microseconds since the Unix epoch (`updated_at`, generations).
pub(crate) fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

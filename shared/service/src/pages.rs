//! Transparent huge pages, off for the process.

/// Turns transparent huge pages off for this process (and the processes it
/// starts); [`crate::start`] does it for every service. With THP on, the
/// allocator's fresh pages fault in 2 MiB at a time, each zeroed whole, and
/// resident memory grows in 2 MiB steps. Measured on a machine with THP
/// `always` (docs/PERFORMANCE.md): a third of storage's CPU on an initial
/// import was that zeroing (storage 11.7–12.2 → 8.3–8.9 CPU s per 1M
/// records, the import 1.3× faster), and ingest's peak RSS on a 1 GB dump
/// fell from 56–60 MB to 37–39 MB at the same speed. Redis gives the same
/// advice for itself. A failure (not Linux, a kernel without the call) is
/// logged and changes nothing else.
pub fn without_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(e) = rustix::thread::disable_transparent_huge_pages(true) {
        tracing::info!(error = %e, "cannot turn transparent huge pages off; running with them");
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn turns_them_off() {
        super::without_huge_pages();
        assert!(rustix::thread::transparent_huge_pages_are_disabled().expect("prctl"));
    }
}

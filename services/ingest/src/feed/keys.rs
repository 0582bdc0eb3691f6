//! The vocabulary of the nested document's top levels, shared by the walk
//! (`nested.rs`), the reader under serde_json's buffer (`intake.rs`) and the
//! cutter (`cut.rs`): the keys they look at and where a byte scan stands
//! between a key and its value. It depends on none of them.

/// The keys the walk looks at; any other is skipped with its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Key {
    BrandId,
    Places,
    PlaceId,
    Items,
    Other,
}

/// Longest top-level key the scan compares (an escaped `brand_id` is 48
/// bytes); a longer one is some other key.
pub(super) const SCAN_KEY_BYTES: usize = 256;

/// Where the scan stands in the top-level object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum TopAt {
    #[default]
    Key,
    Colon,
    Value,
    /// After a spooled value: nothing to watch until the next `,`.
    Comma,
}

//! Streaming parse of a partner feed: a sync reader in, events (places
//! seen, valid items, rejected items) out, one at a time. No I/O besides the
//! reader and, in one case below, an anonymous temporary file; no clock, no
//! bus.
//!
//! Memory is bounded independently of the feed size: the nested document is
//! walked with hand-written serde visitors that hand over each item as soon
//! as it is parsed, and NDJSON is read line by line with a bounded line
//! buffer. What still grows, by design and documented here:
//!
//! - a place whose `items` come before its `place_id` is buffered until the
//!   `place_id` is known (memory then grows with that one place);
//! - duplicate ids are tracked per place, as 128-bit hashes (about 20 to 40
//!   bytes per id): for the nested format only for the current place; for
//!   NDJSON, where places interleave, for every place of the feed (a 1 GB
//!   NDJSON feed of 5M items needs ~150 MB for it). A place repeated in the
//!   nested `places` array starts a fresh set.
//!
//! serde_json does not read the items themselves: the reader under its
//! buffer cuts each object of an `items` array out of what serde_json is
//! given (`cut.rs`). A well-formed item whole in one read is parsed as it
//! is cut, its bytes read once; any other is cut by scanning it only for
//! strings and brackets, and the item parser reads it from its slice.
//! Errors keep serde_json's text, line and column.
//!
//! Whatever is read whole — one raw item (cut out, or read by serde_json
//! where it is not an object), an object key, the `brand_id` and
//! `place_id` values, a value of the wrong type where an array or object
//! was expected — is read with a hard cap (well above `max_item_bytes`): a
//! bad item is rejected alone while the rest of the feed lands, and a 1 GB
//! "item" or key fails the feed before it is in memory.
//! Keys and values under keys the parser does not know are skipped without
//! being buffered, however large (serde_json's skip copies nothing), so they
//! are ignored like any unknown field.
//!
//! **The brand is checked before anything is handed over, wherever it
//! stands.** The top-level `brand_id` must be present, once, and equal to
//! the partner's brand. When it precedes `places` (the usual order) items
//! stream as they are parsed. When `places` comes first, the reader under
//! serde_json's buffer moves the raw bytes of that array to an anonymous
//! temporary file (checking that its strings end and its brackets balance)
//! and gives serde_json `[]` instead; the rest of the document is parsed and
//! checked to its end, and only then is the copy parsed and its events
//! handed over. Every later `places` of that document is moved too, so events
//! keep document order. That case costs temporary disk space (`TMPDIR`) about
//! the size of the feed, not memory, and error positions say how they are
//! counted (from the start of the copied array, or without it). Until the
//! top-level `brand_id` key or the first `places` goes by, the reader looks
//! at each byte; after a leading `brand_id` it passes bytes through
//! untouched, so the usual order costs nothing. A `brand_id` given twice is
//! malformed: when both come before `places`, or `places` came first,
//! nothing is handed over; when the second follows a streamed `places`, the
//! feed fails after its items, like any document broken after its items.

use std::collections::HashSet;
use std::io::{self, BufReader, Read};
use std::rc::Rc;

use shelfsync_settings::FeedFormat;

use crate::item::{Item, ItemRules, Reason, Reject};

mod cut;
mod intake;
mod keys;
mod ndjson;
mod nested;
#[cfg(test)]
mod tests;

use cut::Cut;
use intake::{Intake, ReadState, Scan};
use ndjson::ndjson;
use nested::Parser;

/// Read buffer of the parser: large, so that a slow source is read in few calls.
const BUFFER_BYTES: usize = 256 * 1024;
/// How much of the first line format detection looks at.
const HEAD_BYTES: usize = 64 * 1024;

/// What the parser hands over, in feed order.
#[derive(Debug, Clone, PartialEq)]
pub enum FeedEvent {
    /// A place present in the feed (possibly with no items); sent before its items.
    Place(i64),
    Item(Item),
    Reject(Reject),
}

/// Returned by the event sink to stop the parse (e.g. publishing failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped;

/// The two shapes of the feed format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `{"brand_id": .., "places": [{"place_id": .., "items": [..]}]}`
    Nested,
    /// One item per line, each with `brand_id` and `place_id`.
    Ndjson,
}

/// A feed that cannot be read to its end. Events sent before stay sent.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    #[error("the feed is empty")]
    Empty,
    #[error("the feed is not JSON: expected `{{` at byte {offset}, found {found:?}")]
    NotJson { found: String, offset: u64 },
    #[error("the feed is malformed: {0}")]
    Malformed(String),
    #[error("the feed is for brand {found}, but the partner's brand is {expected}")]
    BrandMismatch { expected: i64, found: i64 },
    #[error("cannot read the feed: {0}")]
    Io(#[source] io::Error),
    #[error("the parse was stopped")]
    Stopped,
}

/// Parses a whole feed, sending every event to `sink` as soon as it is known
/// (for the nested format: as soon as its brand is known to be right).
pub fn parse_feed<R: Read>(
    reader: R,
    format: FeedFormat,
    rules: &ItemRules,
    sink: &mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
) -> Result<Layout, FeedError> {
    parse(reader, format, rules, sink, true)
}

/// [`parse_feed`], with the items of the nested format cut out under
/// serde_json or not (the tests compare the two).
fn parse<R: Read>(
    mut reader: R,
    format: FeedFormat,
    rules: &ItemRules,
    sink: &mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
    cutting: bool,
) -> Result<Layout, FeedError> {
    let (mut head, eof) = read_head(&mut reader).map_err(FeedError::Io)?;
    let bom = if head.starts_with(b"\xEF\xBB\xBF") { 3 } else { 0 };
    head.drain(..bom);
    let start = head.iter().position(|b| !b.is_ascii_whitespace());
    let layout = match (start, format) {
        (None, _) if eof => return Err(FeedError::Empty),
        (None, _) => Layout::Nested,
        (Some(i), _) if head[i] != b'{' => {
            let found = head[i..].split(|&b| b == b'\n').next().unwrap_or_default();
            let found = String::from_utf8_lossy(&found[..found.len().min(32)]).into_owned();
            return Err(FeedError::NotJson { found, offset: (bom + i) as u64 });
        }
        (_, FeedFormat::Json) => Layout::Nested,
        (_, FeedFormat::Ndjson) => Layout::Ndjson,
        (Some(i), FeedFormat::Auto) => detect(&head[i..], eof),
    };
    let bytes = io::Cursor::new(head).chain(reader);
    match layout {
        Layout::Nested => {
            let state = Rc::new(ReadState { cutting, ..ReadState::default() });
            let mut parser = Parser {
                rules: *rules,
                sink,
                state: state.clone(),
                fatal: None,
                ids: IdSet::default(),
                items_arrays: 0,
            };
            let cut = cutting.then(|| Cut::new(parser.hard_cap(), *rules));
            let intake = Intake { inner: bytes, state, scan: Some(Scan::default()), cut };
            parser.nested(BufReader::with_capacity(BUFFER_BYTES, intake))?;
        }
        Layout::Ndjson => ndjson(BufReader::with_capacity(BUFFER_BYTES, bytes), rules, sink)?,
    }
    Ok(layout)
}

/// NDJSON when the first line is by itself one complete object with an `id`.
fn detect(head: &[u8], eof: bool) -> Layout {
    let line = match head.iter().position(|&b| b == b'\n') {
        Some(end) => &head[..end],
        None if eof => head,
        None => return Layout::Nested,
    };
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(line) {
        Ok(first) if first.contains_key("id") => Layout::Ndjson,
        _ => Layout::Nested,
    }
}

/// Reads until the first non-blank line is complete, or [`HEAD_BYTES`], or
/// the end. Returns the bytes and whether the end was reached.
fn read_head(r: &mut impl Read) -> io::Result<(Vec<u8>, bool)> {
    let mut head: Vec<u8> = Vec::with_capacity(8 * 1024);
    let mut chunk = [0u8; 8 * 1024];
    while head.len() < HEAD_BYTES {
        let start = head.iter().position(|b| !b.is_ascii_whitespace());
        if start.is_some_and(|s| head[s..].contains(&b'\n')) {
            return Ok((head, false));
        }
        match r.read(&mut chunk) {
            Ok(0) => return Ok((head, true)),
            Ok(n) => head.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok((head, false))
}

/// The ids of a place handed over, as [`id_key`]s. Those are hashes
/// already: the set hashes them again with foldhash, seeded per process,
/// at a fraction of what SipHash costs per item.
pub(super) type IdSet = HashSet<u128, foldhash::fast::RandomState>;

/// Ids are tracked by a 128-bit hash: a quarter of the memory of the
/// strings, and a collision is as likely as never.
pub(super) fn id_key(id: &str) -> u128 {
    xxhash_rust::xxh3::xxh3_128(id.as_bytes())
}

pub(super) fn duplicate(item: Item, raw: &[u8]) -> Reject {
    let detail = format!(
        "`id` {:?} appears again in place {}; the first one is kept",
        item.id, item.place_id
    );
    Reject {
        place_id: Some(item.place_id),
        id: Some(item.id),
        ..Reject::new(Reason::DuplicateId, detail, raw)
    }
}

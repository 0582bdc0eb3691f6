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
//! Whatever serde_json reads whole — one raw item, an object key, the
//! `brand_id` and `place_id` values, a value of the wrong type where an
//! array or object was expected — is read with a hard cap armed (well above
//! `max_item_bytes`): a bad item is rejected alone while the rest of the feed
//! lands, and a 1 GB "item" or key fails the feed before it is in memory.
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

use std::cell::{Cell, RefCell};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, Write};
use std::rc::Rc;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use shelfsync_settings::FeedFormat;

use crate::item::{self, Item, ItemRules, Reason, Reject, parse_item};

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
    mut reader: R,
    format: FeedFormat,
    rules: &ItemRules,
    sink: &mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
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
            let state = Rc::new(ReadState::default());
            let intake = Intake { inner: bytes, state: state.clone(), scan: Some(Scan::default()) };
            let mut parser =
                Parser { rules: *rules, sink, state, fatal: None, ids: HashSet::new() };
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

/// What the parser shares with the reader under serde_json's buffer: how
/// many bytes serde_json was given, the hard cap armed while one value is
/// read whole (serde_json buffers a raw item or a key whole, so a 1 GB one
/// must be cut off by the reader before it is in memory), and the spool.
#[derive(Default)]
struct ReadState {
    read: Cell<u64>,
    /// While armed: the byte count not to read past, and what is being read.
    cap: Cell<Option<(u64, &'static str)>>,
    /// What was being read when the cap was hit.
    tripped: Cell<Option<&'static str>>,
    spool: RefCell<Option<Spool>>,
}

impl ReadState {
    /// Arms the cap: `what` may take up to `bytes` more of the input.
    fn arm(&self, what: &'static str, bytes: u64) {
        self.cap.set(Some((self.read.get() + bytes, what)));
    }

    fn disarm(&self) {
        self.cap.set(None);
    }
}

/// `places` arrays that came before `brand_id`, one a line, in document order.
struct Spool {
    file: File,
    arrays: usize,
}

impl Spool {
    fn write(spool: &RefCell<Option<Spool>>, bytes: &[u8], last: bool) -> io::Result<()> {
        let mut spool = spool.borrow_mut();
        let spool = match &mut *spool {
            Some(spool) => spool,
            None => {
                spool.insert(Spool { file: tempfile::tempfile().map_err(spool_error)?, arrays: 0 })
            }
        };
        spool.file.write_all(bytes).map_err(spool_error)?;
        if last {
            spool.file.write_all(b"\n").map_err(spool_error)?;
            spool.arrays += 1;
        }
        Ok(())
    }
}

fn spool_error(e: io::Error) -> io::Error {
    let detail = format!(
        "`places` comes before `brand_id`, so it is kept in a temporary file until the brand is \
         checked, and that file failed (is TMPDIR full?): {e}"
    );
    io::Error::new(e.kind(), detail)
}

/// The reader under serde_json's `BufReader` (which keeps std's fast
/// one-byte reads): counts and caps what serde_json is given and, until the
/// top-level `brand_id` key has gone by, watches the top level of the
/// document ([`Scan`]) to move each `places` array that comes before it into
/// the spool; serde_json gets `[]` in its place. Once `brand_id` shows up
/// first (the usual order) the bytes pass through untouched.
struct Intake<R> {
    inner: R,
    state: Rc<ReadState>,
    scan: Option<Scan>,
}

impl<R: Read> Read for Intake<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let state = &self.state;
        if let Some((limit, what)) = state.cap.get()
            && state.read.get() > limit
        {
            state.tripped.set(Some(what));
            return Err(io::Error::new(io::ErrorKind::InvalidData, "over the hard size cap"));
        }
        loop {
            let n = self.inner.read(buf)?;
            let kept = match &mut self.scan {
                Some(scan) if n > 0 => {
                    let (kept, done) = scan.filter(&mut buf[..n], &state.spool)?;
                    if done {
                        self.scan = None;
                    }
                    kept
                }
                _ => n,
            };
            state.read.set(state.read.get() + kept as u64);
            // A read that went to the spool whole is not the end of the feed.
            if kept > 0 || n == 0 {
                return Ok(kept);
            }
        }
    }
}

/// Longest top-level key the scan compares (an escaped `brand_id` is 48
/// bytes); a longer one is some other key.
const SCAN_KEY_BYTES: usize = 256;

/// Where the scan stands in the top-level object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum TopAt {
    #[default]
    Key,
    Colon,
    Value,
    /// After a spooled value: nothing to watch until the next `,`.
    Comma,
}

/// The top level of the document, byte by byte: strings, nesting, and the
/// keys of the top-level object, for as long as [`Intake`] must watch.
/// Strings and bracket balance are all it checks; serde_json parses the
/// document (with `[]` for each spooled array) and then each spooled array
/// in full, so a malformed feed fails there as it would have anyway.
#[derive(Default)]
struct Scan {
    started: bool,
    depth: u64,
    in_string: bool,
    escaped: bool,
    at: TopAt,
    /// The top-level key being read (with its quotes), and the last one read.
    key: Option<Vec<u8>>,
    last_key: Option<Key>,
    /// Nesting inside the `places` array being spooled (0: none).
    spooling: u64,
    spooled: usize,
}

impl Scan {
    /// Filters `buf` in place: the bytes serde_json gets are moved to the
    /// front; returns their count and whether the watch is over.
    fn filter(
        &mut self,
        buf: &mut [u8],
        spool: &RefCell<Option<Spool>>,
    ) -> io::Result<(usize, bool)> {
        // `buf[from..i]` is the run (kept or spooled) not yet moved or written.
        let (mut out, mut from) = (0, 0);
        let keep = |buf: &mut [u8], out: &mut usize, range: std::ops::Range<usize>| {
            let len = range.len();
            buf.copy_within(range, *out);
            *out += len;
        };
        for i in 0..buf.len() {
            let b = buf[i];
            if self.spooling > 0 {
                if self.string_byte(b) {
                    continue;
                }
                match b {
                    b'"' => self.in_string = true,
                    b'[' | b'{' => self.spooling += 1,
                    b']' | b'}' => {
                        self.spooling -= 1;
                        if self.spooling == 0 {
                            // The closing bracket ends the copy and is kept:
                            // serde_json reads `[]`.
                            Spool::write(spool, &buf[from..=i], true)?;
                            self.spooled += 1;
                            buf[out] = b;
                            (out, from) = (out + 1, i + 1);
                        }
                    }
                    _ => {}
                }
                continue;
            }
            if self.string_byte(b) {
                if let Some(key) = &mut self.key {
                    if key.len() <= SCAN_KEY_BYTES {
                        key.push(b);
                    }
                    if !self.in_string {
                        let key = self.key.take().unwrap_or_default();
                        let name = serde_json::from_slice::<String>(&key).ok();
                        let key = match name.as_deref() {
                            Some("brand_id") => Key::BrandId,
                            Some("places") => Key::Places,
                            _ => Key::Other,
                        };
                        (self.last_key, self.at) = (Some(key), TopAt::Colon);
                        if key == Key::BrandId && self.spooled == 0 {
                            // The brand comes first: nothing to move, ever.
                            keep(buf, &mut out, from..buf.len());
                            return Ok((out, true));
                        }
                    }
                }
                continue;
            }
            match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b'{' if !self.started => (self.started, self.depth) = (true, 1),
                _ if !self.started => {
                    // Not an object: serde_json says so.
                    keep(buf, &mut out, from..buf.len());
                    return Ok((out, true));
                }
                b'"' => {
                    self.in_string = true;
                    if self.depth == 1 && self.at == TopAt::Key {
                        self.key = Some(vec![b]);
                    }
                }
                b'[' if self.depth == 1
                    && self.at == TopAt::Value
                    && self.last_key == Some(Key::Places) =>
                {
                    // `places` before `brand_id`: serde_json gets the `[`,
                    // the spool gets the array, from this `[` on.
                    keep(buf, &mut out, from..i + 1);
                    from = i;
                    (self.spooling, self.at) = (1, TopAt::Comma);
                }
                b'[' | b'{' => self.depth += 1,
                b']' | b'}' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        // The top-level object is closed.
                        keep(buf, &mut out, from..buf.len());
                        return Ok((out, true));
                    }
                }
                b':' if self.depth == 1 => self.at = TopAt::Value,
                b',' if self.depth == 1 => (self.at, self.last_key) = (TopAt::Key, None),
                _ => {}
            }
        }
        if self.spooling > 0 {
            Spool::write(spool, &buf[from..], false)?;
        } else {
            keep(buf, &mut out, from..buf.len());
        }
        Ok((out, false))
    }

    /// Follows a byte inside a string; false when not in one (the byte is
    /// not consumed).
    fn string_byte(&mut self, b: u8) -> bool {
        if !self.in_string {
            return false;
        }
        match b {
            _ if self.escaped => self.escaped = false,
            b'\\' => self.escaped = true,
            b'"' => self.in_string = false,
            _ => {}
        }
        true
    }
}

struct Parser<'s> {
    rules: ItemRules,
    sink: &'s mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
    state: Rc<ReadState>,
    /// The real cause when a visitor had to bail out with a serde error.
    fatal: Option<FeedError>,
    /// Hashed ids of the current place (nested format).
    ids: HashSet<u128>,
}

impl Parser<'_> {
    /// Largest raw item (or key, or value read whole) before the parse
    /// fails; an item between `max_item_bytes` and this is rejected as
    /// `too_large`.
    fn hard_cap(&self) -> u64 {
        (4 * self.rules.max_item_bytes).max(1 << 20) as u64 + BUFFER_BYTES as u64
    }

    fn emit<E: de::Error>(&mut self, event: FeedEvent) -> Result<(), E> {
        (self.sink)(event).map_err(|Stopped| self.fail(FeedError::Stopped))
    }

    fn fail<E: de::Error>(&mut self, error: FeedError) -> E {
        let e = E::custom(&error);
        self.fatal = Some(error);
        e
    }

    /// Reads one value whole (`what` names it in the error) with the cap armed.
    fn capture<T>(&mut self, what: &'static str, read: impl FnOnce() -> T) -> T {
        self.state.arm(what, self.hard_cap());
        let value = read();
        self.state.disarm();
        value
    }

    /// The next key of an object, known or not: serde_json reads a key whole
    /// (into its scratch buffer), so it is capped like an item.
    fn key<'de, A: MapAccess<'de>>(&mut self, map: &mut A) -> Result<Option<Key>, A::Error> {
        self.capture("an object key", || map.next_key_seed(KeySeed))
    }

    fn nested_item<E: de::Error>(&mut self, place_id: i64, raw: &str) -> Result<(), E> {
        let event = match parse_item(raw, Some(place_id), &self.rules) {
            Ok(item) if !self.ids.insert(id_key(&item.id)) => {
                FeedEvent::Reject(duplicate(item, raw.as_bytes()))
            }
            Ok(item) => FeedEvent::Item(item),
            Err(reject) => FeedEvent::Reject(reject),
        };
        self.emit(event)
    }

    /// The whole document, then the `places` arrays that came before
    /// `brand_id` (spooled), once the document is known to be right.
    fn nested(&mut self, reader: impl Read) -> Result<(), FeedError> {
        let mut de = serde_json::Deserializer::from_reader(reader);
        let result = Walk(self, Level::Top).deserialize(&mut de).and_then(|()| de.end());
        let moved = self.state.spool.borrow().is_some();
        self.outcome(result, moved.then_some("not counting what was read ahead of `brand_id`"))?;
        let spool = self.state.spool.borrow_mut().take();
        match spool {
            Some(spool) => self.replay(spool),
            None => Ok(()),
        }
    }

    fn replay(&mut self, spool: Spool) -> Result<(), FeedError> {
        let mut file = spool.file;
        file.rewind().map_err(|e| FeedError::Io(spool_error(e)))?;
        self.state = Rc::new(ReadState::default());
        let intake = Intake { inner: file, state: self.state.clone(), scan: None };
        let mut de =
            serde_json::Deserializer::from_reader(BufReader::with_capacity(BUFFER_BYTES, intake));
        let mut result = Ok(());
        for _ in 0..spool.arrays {
            result = Walk(self, Level::Places).deserialize(&mut de);
            if result.is_err() {
                break;
            }
        }
        let result = result.and_then(|()| de.end());
        self.outcome(result, Some("counted from the start of a `places` read ahead of `brand_id`"))
    }

    /// The feed error behind a serde_json result; `position` says how its
    /// line and column are counted when that is not from the feed's start.
    fn outcome(
        &mut self,
        result: Result<(), serde_json::Error>,
        position: Option<&str>,
    ) -> Result<(), FeedError> {
        let e = match (result, self.fatal.take()) {
            (Ok(()), _) => return Ok(()),
            (Err(_), Some(fatal)) => return Err(fatal),
            (Err(e), None) => e,
        };
        if let Some(what) = self.state.tripped.get() {
            let cap = self.hard_cap();
            return Err(FeedError::Malformed(format!(
                "{what} is larger than {cap} bytes (hard cap)"
            )));
        }
        if e.is_io() {
            return Err(FeedError::Io(e.into()));
        }
        let mut message = e.to_string();
        if let Some(how) = position
            && e.line() > 0
        {
            message = format!("{message} ({how})");
        }
        Err(FeedError::Malformed(message))
    }
}

/// The items of an NDJSON feed, each line on its own.
fn ndjson(
    mut reader: impl BufRead,
    rules: &ItemRules,
    sink: &mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
) -> Result<(), FeedError> {
    let max = rules.max_item_bytes;
    let mut ids: HashMap<i64, HashSet<u128>> = HashMap::new();
    let mut buf = Vec::new();
    let mut line_no = 0u64;
    while let Some(len) =
        read_line_bounded(&mut reader, &mut buf, max + 1).map_err(FeedError::Io)?
    {
        line_no += 1;
        let line = buf.trim_ascii();
        if line.is_empty() {
            continue;
        }
        let result = if len > max {
            let detail = format!("item is {len} bytes, the limit is {max}");
            Err(Reject::new(Reason::TooLarge, detail, line))
        } else {
            ndjson_item(line, rules)
        };
        let mut event = match result {
            Ok(item) => FeedEvent::Item(item),
            Err(reject) => FeedEvent::Reject(reject),
        };
        let place = match &event {
            FeedEvent::Item(item) => Some(item.place_id),
            FeedEvent::Reject(reject) => reject.place_id,
            FeedEvent::Place(_) => None,
        };
        if let Some(place) = place {
            let seen = match ids.entry(place) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    sink(FeedEvent::Place(place)).map_err(|_| FeedError::Stopped)?;
                    e.insert(HashSet::new())
                }
            };
            if let FeedEvent::Item(item) = event {
                event = match seen.insert(id_key(&item.id)) {
                    true => FeedEvent::Item(item),
                    false => FeedEvent::Reject(duplicate(item, line)),
                };
            }
        }
        if let FeedEvent::Reject(r) = &mut event {
            r.detail = format!("line {line_no}: {}", r.detail);
        }
        sink(event).map_err(|_| FeedError::Stopped)?;
    }
    Ok(())
}

fn ndjson_item(line: &[u8], rules: &ItemRules) -> Result<Item, Reject> {
    let malformed = |detail: String| Reject::new(Reason::Malformed, detail, line);
    let text = std::str::from_utf8(line).map_err(|e| malformed(format!("not UTF-8: {e}")))?;
    parse_item(text, None, rules).map_err(|reject| match reject.reason {
        // `hello` or `{"id": ` is not "not an object": it is not JSON at all.
        Reason::NotAnObject | Reason::Malformed => match serde_json::from_str::<IgnoredAny>(text) {
            Err(e) => malformed(format!("not JSON: {e}")),
            Ok(_) => reject,
        },
        _ => reject,
    })
}

/// Ids are tracked by a 128-bit hash: a quarter of the memory of the
/// strings, and a collision is as likely as never.
fn id_key(id: &str) -> u128 {
    xxhash_rust::xxh3::xxh3_128(id.as_bytes())
}

fn duplicate(item: Item, raw: &[u8]) -> Reject {
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

/// Reads one line (newline excluded) into `buf`, keeping at most `keep`
/// bytes of it. Returns the full length of the line, or `None` at the end.
fn read_line_bounded(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    keep: usize,
) -> io::Result<Option<usize>> {
    buf.clear();
    let mut len = 0;
    let mut started = false;
    loop {
        let chunk = match r.fill_buf() {
            Ok(chunk) => chunk,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            return Ok(started.then_some(len));
        }
        started = true;
        let newline = chunk.iter().position(|&b| b == b'\n');
        let part = &chunk[..newline.unwrap_or(chunk.len())];
        let room = keep.saturating_sub(buf.len());
        buf.extend_from_slice(&part[..part.len().min(room)]);
        len += part.len();
        let used = part.len() + usize::from(newline.is_some());
        r.consume(used);
        if newline.is_some() {
            return Ok(Some(len));
        }
    }
}

// The nested format, walked by one serde visitor that knows its level.

/// The keys the walk looks at; any other is skipped with its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    BrandId,
    Places,
    PlaceId,
    Items,
    Other,
}

/// Reads a key without keeping it: serde_json hands over its own copy.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Key;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Key, E> {
        Ok(match key {
            "brand_id" => Key::BrandId,
            "places" => Key::Places,
            "place_id" => Key::PlaceId,
            "items" => Key::Items,
            _ => Key::Other,
        })
    }
}

enum Level<'b> {
    Top,
    Places,
    Place,
    /// Items of a place; buffered in `pending` while its `place_id` is unknown.
    Items {
        place_id: Option<i64>,
        pending: &'b mut Vec<Box<RawValue>>,
    },
}

struct Walk<'p, 'a, 'b>(&'p mut Parser<'a>, Level<'b>);

impl<'de> DeserializeSeed<'de> for Walk<'_, '_, '_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        // Armed until the visitor is called: where a value of the wrong type
        // stands (a string instead of an array), serde_json reads it whole
        // to name it in the error.
        let what = match self.1 {
            Level::Top => "the feed object",
            Level::Places => "the value of `places`",
            Level::Place => "a place",
            Level::Items { .. } => "the value of `items`",
        };
        self.0.state.arm(what, self.0.hard_cap());
        match self.1 {
            Level::Top | Level::Place => d.deserialize_map(self),
            Level::Places | Level::Items { .. } => d.deserialize_seq(self),
        }
    }
}

impl<'de> Visitor<'de> for Walk<'_, '_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self.1 {
            Level::Top => r#"a feed object {"brand_id": .., "places": [..]}"#,
            Level::Places => "an array of places",
            Level::Place => r#"a place object {"place_id": .., "items": [..]}"#,
            Level::Items { .. } => "an array of items",
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        self.0.state.disarm();
        match self.1 {
            Level::Top => self.0.top(map),
            _ => self.0.place(map),
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let parser = self.0;
        parser.state.disarm();
        let Level::Items { place_id, pending } = self.1 else {
            while seq.next_element_seed(Walk(&mut *parser, Level::Place))?.is_some() {}
            return Ok(());
        };
        while let Some(raw) = parser.capture("an item", || seq.next_element::<Box<RawValue>>())? {
            match place_id {
                Some(place_id) => parser.nested_item(place_id, raw.get())?,
                None => pending.push(raw),
            }
        }
        Ok(())
    }
}

impl Parser<'_> {
    fn top<'de, A: MapAccess<'de>>(&mut self, mut map: A) -> Result<(), A::Error> {
        let mut brand = None;
        while let Some(key) = self.key(&mut map)? {
            match key {
                Key::BrandId => {
                    let raw: Box<RawValue> =
                        self.capture("the `brand_id` value", || map.next_value())?;
                    let found = match item::int("brand_id", &raw) {
                        Ok(found) => found,
                        Err((_, detail)) => return Err(self.fail(FeedError::Malformed(detail))),
                    };
                    if let Some(first) = brand {
                        let detail = format!("`brand_id` is given twice ({first}, then {found})");
                        return Err(self.fail(FeedError::Malformed(detail)));
                    }
                    let expected = self.rules.brand_id;
                    if found != expected {
                        return Err(self.fail(FeedError::BrandMismatch { expected, found }));
                    }
                    brand = Some(found);
                }
                // One that came before `brand_id` was spooled by the reader: `[]` here.
                Key::Places => map.next_value_seed(Walk(self, Level::Places))?,
                _ => _ = map.next_value::<IgnoredAny>()?,
            }
        }
        if brand.is_none() {
            let detail = format!(
                "the feed has no top-level `brand_id` (the partner's brand is {})",
                self.rules.brand_id
            );
            return Err(self.fail(FeedError::Malformed(detail)));
        }
        Ok(())
    }

    fn place<'de, A: MapAccess<'de>>(&mut self, mut map: A) -> Result<(), A::Error> {
        self.ids.clear();
        let (mut place_id, mut bad_place) = (None, None);
        let mut pending: Vec<Box<RawValue>> = Vec::new();
        while let Some(key) = self.key(&mut map)? {
            match key {
                Key::PlaceId => {
                    let raw: Box<RawValue> =
                        self.capture("a `place_id` value", || map.next_value())?;
                    match item::int("place_id", &raw) {
                        Ok(id) => {
                            place_id = Some(id);
                            self.emit(FeedEvent::Place(id))?;
                            for raw in std::mem::take(&mut pending) {
                                self.nested_item(id, raw.get())?;
                            }
                        }
                        Err((_, detail)) => bad_place = Some(detail),
                    }
                }
                Key::Items => {
                    let items = Level::Items { place_id, pending: &mut pending };
                    map.next_value_seed(Walk(self, items))?;
                }
                _ => _ = map.next_value::<IgnoredAny>()?,
            }
        }
        let detail = bad_place.unwrap_or_else(|| "the place has no `place_id`".into());
        for raw in pending {
            let reject = Reject::new(Reason::MissingPlace, &*detail, raw.get().as_bytes());
            self.emit(FeedEvent::Reject(reject))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::item::OwnedFields;

    const RULES: ItemRules =
        ItemRules { brand_id: 7, owned: OwnedFields::ALL, max_item_bytes: 1024 };

    /// Runs a feed; events as one string: `P42` place, `I42/a` item,
    /// `R42/a:reason` rejection (`-` where unknown).
    fn run_as(input: &str, format: FeedFormat) -> (String, Result<Layout, FeedError>) {
        run_reader(input.as_bytes(), format)
    }

    fn run_reader(input: impl Read, format: FeedFormat) -> (String, Result<Layout, FeedError>) {
        let mut events = Vec::new();
        let result = parse_feed(input, format, &RULES, &mut |e| {
            events.push(match e {
                FeedEvent::Place(p) => format!("P{p}"),
                FeedEvent::Item(i) => format!("I{}/{}", i.place_id, i.id),
                FeedEvent::Reject(r) => {
                    let place = r.place_id.map_or("-".into(), |p| p.to_string());
                    format!("R{place}/{}:{}", r.id.as_deref().unwrap_or("-"), r.reason.as_str())
                }
            });
            Ok(())
        });
        (events.join(" "), result)
    }

    fn run(input: &str) -> (String, Result<Layout, FeedError>) {
        run_as(input, FeedFormat::Auto)
    }

    fn malformed(result: Result<Layout, FeedError>, needle: &str) {
        assert!(
            matches!(&result, Err(FeedError::Malformed(m)) if m.contains(needle)),
            "{result:?}"
        );
    }

    #[test]
    fn nested_and_ndjson_feeds_stream_places_and_items() {
        let nested = r#"{"brand_id": 7, "generated": "today", "places": [
              {"place_id": 42, "name": "x", "items": [{"id": "a", "price": 0}, {"id": "b"}]},
              {"place_id": 43, "items": []},
              {"place_id": 44}]}"#;
        let (events, result) = run(nested);
        assert_eq!(result.expect("parses"), Layout::Nested);
        assert_eq!(events, "P42 I42/a I42/b P43 P44", "places without items are seen");
        let ndjson = "{\"id\":\"a\",\"brand_id\":7,\"place_id\":1}\r\n\n\
                      {\"id\":\"b\",\"place_id\":2}\n{\"id\":\"c\",\"place_id\":1}";
        let (events, result) = run(ndjson);
        assert_eq!(result.expect("parses"), Layout::Ndjson);
        assert_eq!(events, "P1 I1/a P2 I2/b I1/c");
    }

    #[test]
    fn auto_detection_and_explicit_formats() {
        let one_line = r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"}]}]}"#;
        assert_eq!(run(one_line).1.expect("nested"), Layout::Nested);
        let pretty = "{\n  \"brand_id\": 7,\n  \"places\": []\n}\n";
        assert_eq!(run(pretty).1.expect("nested"), Layout::Nested);
        let ndjson = "\u{feff}  {\"id\":\"a\",\"place_id\":1}\n{\"id\":\"b\",\"place_id\":1}";
        assert_eq!(run(ndjson).1.expect("ndjson"), Layout::Ndjson);
        // A forced format wins over detection (an item is no feed object).
        malformed(run_as(ndjson, FeedFormat::Json).1, "no top-level `brand_id`");
        let (events, forced) = run_as(one_line, FeedFormat::Ndjson);
        assert_eq!(
            (events.as_str(), forced.expect("ndjson")),
            ("R-/-:missing_place", Layout::Ndjson)
        );
    }

    #[test]
    fn keys_may_come_in_any_order() {
        let feed = r#"{"places": [
            {"items": [{"id": "a"}, {"id": "b", "price": "x"}], "place_id": 5},
            {"items": [{"id": "c"}]}
        ], "brand_id": 7}"#;
        let (events, result) = run(feed);
        result.expect("parses");
        assert_eq!(events, "P5 I5/a R5/b:wrong_type R-/-:missing_place");
    }

    #[test]
    fn a_bad_item_is_rejected_alone() {
        let deep = format!("{}1{}", "[".repeat(500), "]".repeat(500));
        let feed = format!(
            r#"{{"brand_id":7,"places":[{{"place_id":1,"items":[
              {{"title":"no id"}}, 17, {{"id":"a","extra":{deep}}}, {{"id":"b","title":{deep}}},
              {{"id":"a","price":5}}, {{"id":"big","description":"{}"}}, {{"id":"c","price":1.5}},
              {{"id":"d","price":123456789012345678901}}, {{"id":"e","stock":null}}]}}]}}"#,
            "x".repeat(2000)
        );
        let (events, result) = run(&feed);
        result.expect("one bad item does not fail the feed");
        let expected = "P1 R1/-:missing_id R1/-:not_an_object I1/a R1/b:wrong_type R1/a:duplicate_id \
                        R1/-:too_large R1/c:wrong_type R1/d:out_of_range I1/e";
        assert_eq!(events, expected);

        let lines = [
            r#"{"id":"a","brand_id":7,"place_id":1}"#,
            r#"{"id":"b","brand_id":8,"place_id":1}"#,
            r#"{"id":"c","brand_id":7}"#,
            r#"{"id":"a","brand_id":7,"place_id":1}"#,
            r#"{"id":"d","place_id":1,"price": garbage}"#,
            &format!(r#"{{"id":"e","place_id":1,"title":"{}"}}"#, "t".repeat(5000)),
            r#"{"id":"f","place_id":2,"price":"1"}"#,
        ];
        let (events, result) = run(&lines.join("\n"));
        assert_eq!(result.expect("lines are independent"), Layout::Ndjson);
        let expected = "P1 I1/a R-/b:brand_mismatch R-/c:missing_place R1/a:duplicate_id R-/-:malformed \
                        R-/-:too_large P2 R2/f:wrong_type";
        assert_eq!(events, expected);
        let mut details = Vec::new();
        parse_feed(lines.join("\n").as_bytes(), FeedFormat::Auto, &RULES, &mut |e| {
            if let FeedEvent::Reject(r) = e {
                details.push(r.detail);
            }
            Ok(())
        })
        .expect("parses");
        assert!(details[3].starts_with("line 5: not JSON"), "{}", details[3]);
    }

    #[test]
    fn not_json_fails_clearly() {
        let (events, result) = run("\n  <html><body>Bad gateway</body></html>");
        assert!(events.is_empty());
        let err = result.expect_err("not JSON");
        let msg = err.to_string();
        assert!(matches!(err, FeedError::NotJson { offset: 3, .. }), "{err:?}");
        assert!(
            msg.contains("not JSON") && msg.contains("byte 3") && msg.contains("<html>"),
            "{msg}"
        );
        assert!(matches!(run(" \n ").1, Err(FeedError::Empty)));
        assert!(matches!(run("[1, 2]").1, Err(FeedError::NotJson { .. })));
    }

    #[test]
    fn a_broken_document_fails_after_what_came_before() {
        let (events, result) =
            run(r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"},{"id":"b"#);
        assert_eq!(events, "P1 I1/a", "a truncated feed is not a short feed");
        malformed(result, "EOF while parsing");
        // Garbage inside an item of the nested format cannot be skipped over.
        malformed(
            run(r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":1x}]}]}"#).1,
            "line 1 column",
        );
        malformed(run(r#"{"brand_id":"7","places":[]}"#).1, "`brand_id` must be an integer");
        let result = run(r#"{"places":[],"brand_id":8}"#).1;
        assert!(
            matches!(result, Err(FeedError::BrandMismatch { expected: 7, found: 8 })),
            "{result:?}"
        );
        // An item too big to hold fails the parse before it is in memory.
        let huge = format!(
            r#"{{"brand_id":7,"places":[{{"place_id":1,"items":[{{"id":"a"}},{{"id":"b","x":"{}"}}]}}]}}"#,
            "x".repeat(3 << 20)
        );
        let (events, result) = run(&huge);
        assert_eq!(events, "P1 I1/a");
        malformed(result, "hard cap");
    }

    /// A reader that hands out one byte per call: every state of the
    /// top-level scan meets a buffer boundary.
    struct Trickle<R>(R);

    impl<R: Read> Read for Trickle<R> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(1);
            self.0.read(&mut buf[..n])
        }
    }

    /// Runs `input` whole and one byte at a time; both must agree.
    fn run_both(input: &str) -> (String, Result<Layout, FeedError>) {
        let (events, result) = run(input);
        let (trickled, trickle_result) = run_reader(Trickle(input.as_bytes()), FeedFormat::Auto);
        assert_eq!(events, trickled, "{input}");
        assert_eq!(format!("{result:?}"), format!("{trickle_result:?}"), "{input}");
        (events, result)
    }

    #[test]
    fn the_brand_is_checked_before_any_event_wherever_it_stands() {
        // Brackets, quotes and key names inside strings must not fool the
        // reader that moves an early `places` aside.
        let places = r#"[
            {"place_id": 1, "items": [{"id": "a]\"}[", "title": "\"brand_id\": 8, \"places\": ["},
                                      {"id": "b", "price": "x"}, {"id": "a"}]},
            {"items": [{"id": "c"}], "name": {"places": [1, {"x": "]"}]}},
            {"place_id": 2}]"#;
        let expected = r#"P1 I1/a]"}[ R1/b:wrong_type I1/a R-/-:missing_place P2"#;
        let first = run_both(&format!(r#"{{"brand_id": 7, "places": {places}}}"#));
        assert_eq!(first.0, expected);
        for feed in [
            format!(r#"{{"places": {places}, "brand_id": 7}}"#),
            format!(r#"{{"x": [{{"places": []}}], "places":{places} , "y": "]", "brand_id":7 }}"#),
            format!(r#"{{"places": {places}, "\u0062rand_id": 7}}"#),
            format!(r#"{{"\u0062rand_id": 7, "places": {places}}}"#),
        ] {
            let (events, result) = run_both(&feed);
            result.expect("parses");
            assert_eq!(events, first.0, "{feed}");
        }
        // Several `places`, before and after the brand: document order.
        let (events, result) = run_both(
            r#"{"places": [{"place_id": 1}], "places": [{"place_id": 2}], "brand_id": 7,
                "places": [{"place_id": 3}]}"#,
        );
        result.expect("parses");
        assert_eq!(events, "P1 P2 P3");

        // Wrong, missing, or not a number: nothing at all is handed over,
        // rejections included.
        for (feed, needle) in [
            (format!(r#"{{"places": {places}, "brand_id": 8}}"#), "brand 8"),
            (format!(r#"{{"places": {places}, "br\u0061nd_id": 8}}"#), "brand 8"),
            (format!(r#"{{"places": {places}}}"#), "no top-level `brand_id`"),
            (format!(r#"{{"places": {places}, "meta": {{"brand_id": 7}}}}"#), "no top-level"),
            (format!(r#"{{"places": {places}, "brand_id": "7"}}"#), "must be an integer"),
            (format!(r#"{{"places": {places}, "brand_id": 7"#), "EOF while parsing"),
            (format!(r#"{{"places": {places}, "brand_id": 7}} trailing"#), "trailing"),
            (r#"{"places": [{"place_id": 1, "items": [{"id": "a"}"#.into(), "EOF while parsing"),
            (r#"{"places": "x", "brand_id": 7}"#.into(), "invalid type"),
            (r#"{"places": [{"place_id": 1}, 5, "brand_id": 7}"#.into(), "not counting what"),
        ] {
            let (events, result) = run_both(&feed);
            assert_eq!(events, "", "{feed}: nothing before the brand is known good");
            let err = result.expect_err(&feed).to_string();
            assert!(err.contains(needle), "{feed}: {err}");
        }
        let (events, result) = run_both(&format!(r#"{{"places": {places}, "brand_id": 8}}"#));
        assert!(matches!(result, Err(FeedError::BrandMismatch { expected: 7, found: 8 })));
        assert_eq!(events, "");
        // A `places` that parses badly once the brand is known fails like a
        // streamed one: after what came before, at a position within it.
        let (events, result) = run_both(
            r#"{"places": [{"place_id": 1, "items": [{"id": "a"}, {"id": 1x}]}], "brand_id": 7}"#,
        );
        assert_eq!(events, "P1 I1/a");
        malformed(result, "counted from the start of a `places` read ahead of `brand_id`");
    }

    #[test]
    fn a_brand_id_given_twice_is_malformed() {
        let items = r#"[{"place_id": 1, "items": [{"id": "a"}]}]"#;
        for feed in [
            format!(r#"{{"brand_id": 7, "brand_id": 7, "places": {items}}}"#),
            format!(r#"{{"brand_id": 7, "brand_id": 8, "places": {items}}}"#),
            format!(r#"{{"places": {items}, "brand_id": 7, "brand_id": 7}}"#),
            format!(r#"{{"places": {items}, "brand_id": 7, "places": [], "brand_id": 7}}"#),
        ] {
            let (events, result) = run_both(&feed);
            assert_eq!(events, "", "{feed}");
            malformed(result, "`brand_id` is given twice");
        }
        // After a streamed `places`, the items before it are out already.
        let (events, result) =
            run_both(&format!(r#"{{"brand_id": 7, "places": {items}, "brand_id": 7}}"#));
        assert_eq!(events, "P1 I1/a");
        malformed(result, "`brand_id` is given twice (7, then 7)");
    }

    /// `prefix`, then `n` bytes of `k`, then `suffix`, made as they are read.
    fn huge(prefix: &str, n: u64, suffix: &str) -> impl Read {
        let (prefix, suffix) = (prefix.to_string().into_bytes(), suffix.to_string().into_bytes());
        io::Cursor::new(prefix).chain(io::repeat(b'k').take(n)).chain(io::Cursor::new(suffix))
    }

    /// Counts the bytes the parser took from its source.
    struct Counted<R>(R, Rc<Cell<u64>>);

    impl<R: Read> Read for Counted<R> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.0.read(buf)?;
            self.1.set(self.1.get() + n as u64);
            Ok(n)
        }
    }

    #[test]
    fn a_huge_key_fails_at_the_hard_cap_before_it_is_read_whole() {
        const KEY: u64 = 100 << 20;
        let cases = [
            (r#"{""#, r#"": 1, "brand_id": 7, "places": []}"#, "", "an object key"),
            (r#"{"brand_id": 7, ""#, r#"": 1, "places": []}"#, "", "an object key"),
            (
                r#"{"brand_id": 7, "places": [{"place_id": 1, ""#,
                r#"": 1}]}"#,
                "P1",
                "an object key",
            ),
            (
                r#"{"brand_id": 7, "places": [{"place_id": 1, "items": [{"id": "a"}, {""#,
                r#"": 1}]}]}"#,
                "P1 I1/a",
                "an item",
            ),
            (r#"{"brand_id": ""#, r#""}"#, "", "the `brand_id` value"),
            (r#"{"brand_id": 7, "places": ""#, r#""}"#, "", "the value of `places`"),
            (r#"{"brand_id": 7, "places": [""#, r#""]}"#, "", "a place"),
        ];
        for (prefix, suffix, expected, what) in cases {
            let read = Rc::new(Cell::new(0));
            let (events, result) =
                run_reader(Counted(huge(prefix, KEY, suffix), read.clone()), FeedFormat::Auto);
            assert_eq!(events, expected, "{prefix}");
            malformed(result, &format!("{what} is larger than"));
            assert!(read.get() < 2 << 20, "{prefix}: {} bytes read of a 100 MB key", read.get());
        }
        // In a `places` spooled ahead of its brand: the copy is on disk, and
        // the key fails when the copy is parsed.
        let (events, result) = run_reader(
            huge(r#"{"places": [{"place_id": 1, ""#, 8 << 20, r#"": 1}], "brand_id": 7}"#),
            FeedFormat::Auto,
        );
        assert_eq!(events, "P1");
        malformed(result, "an object key is larger than");
        // Keys and values under unknown keys are skipped without being read
        // into memory, so there they cost nothing and are ignored.
        let (events, result) = run_reader(
            huge(
                r#"{"brand_id": 7, "meta": {""#,
                KEY,
                r#"": {"x": 1}}, "places": [{"place_id": 1, "items": [{"id": "a"}]}]}"#,
            ),
            FeedFormat::Auto,
        );
        result.expect("skipped");
        assert_eq!(events, "P1 I1/a");
        // A key that makes its item too large, but not huge, rejects that item alone.
        let feed = format!(
            r#"{{"brand_id": 7, "places": [{{"place_id": 1, "items": [{{"id": "a", "{}": 1}}, {{"id": "b"}}]}}]}}"#,
            "k".repeat(2000)
        );
        let (events, result) = run(&feed);
        result.expect("one bad item does not fail the feed");
        assert_eq!(events, "P1 R1/-:too_large I1/b");
    }

    #[test]
    fn the_sink_can_stop_the_parse() {
        let feed = r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"},{"id":"b"}]}]}"#;
        let mut n = 0;
        let result = parse_feed(feed.as_bytes(), FeedFormat::Auto, &RULES, &mut |_| {
            n += 1;
            if n == 2 { Err(Stopped) } else { Ok(()) }
        });
        assert!(matches!(result, Err(FeedError::Stopped)), "{result:?}");
        assert_eq!(n, 2);
    }

    #[test]
    fn bounded_lines_keep_a_prefix_and_measure_the_whole() {
        let mut r = io::BufReader::with_capacity(4, &b"abcdefgh\nij\n\nk"[..]);
        let mut buf = Vec::new();
        let mut next = || read_line_bounded(&mut r, &mut buf, 3).expect("reads");
        assert_eq!(
            [next(), next(), next(), next(), next()],
            [Some(8), Some(2), Some(0), Some(1), None]
        );
        read_line_bounded(&mut io::BufReader::new(&b"abcdefgh"[..]), &mut buf, 3).expect("reads");
        assert_eq!(buf, b"abc");
    }
}

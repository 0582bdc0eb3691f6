//! Streaming parse of a partner feed (DESIGN §8): a sync reader in, events
//! (places seen, valid items, rejected items) out, one at a time. No I/O
//! besides the reader, no clock, no bus.
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
//! A single item is captured raw (up to a hard cap well above
//! `max_item_bytes`), so that a bad item is rejected alone while the rest
//! of the feed lands.

use std::cell::Cell;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::{self, BufRead, BufReader, Read};
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

/// The two shapes of DESIGN §8.
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

/// Parses a whole feed, sending every event to `sink` as soon as it is known.
pub fn parse_feed<R: Read>(
    reader: R,
    format: FeedFormat,
    rules: &ItemRules,
    sink: &mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
) -> Result<Layout, FeedError> {
    let meter = Rc::new(Meter::default());
    let mut reader = Metered { inner: reader, meter: meter.clone() };
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
    let reader = BufReader::with_capacity(BUFFER_BYTES, io::Cursor::new(head).chain(reader));
    let mut parser = Parser { rules: *rules, sink, meter, fatal: None, ids: HashSet::new() };
    match layout {
        Layout::Nested => parser.nested(reader)?,
        Layout::Ndjson => parser.ndjson(reader)?,
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

/// Bytes read so far, and a limit armed while one item is being captured:
/// serde_json buffers a raw item whole, so a 1 GB "item" must be cut off by
/// the reader before it is in memory.
#[derive(Default)]
struct Meter {
    read: Cell<u64>,
    limit: Cell<Option<u64>>,
    tripped: Cell<bool>,
}

struct Metered<R> {
    inner: R,
    meter: Rc<Meter>,
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let m = &self.meter;
        if m.limit.get().is_some_and(|limit| m.read.get() > limit) {
            m.tripped.set(true);
            return Err(io::Error::new(io::ErrorKind::InvalidData, "item over the hard size cap"));
        }
        let n = self.inner.read(buf)?;
        m.read.set(m.read.get() + n as u64);
        Ok(n)
    }
}

struct Parser<'s> {
    rules: ItemRules,
    sink: &'s mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
    meter: Rc<Meter>,
    /// The real cause when a visitor had to bail out with a serde error.
    fatal: Option<FeedError>,
    /// Hashed ids of the current place (nested format).
    ids: HashSet<u128>,
}

impl Parser<'_> {
    /// Largest raw item captured before the parse fails (it is rejected as
    /// `too_large` when between `max_item_bytes` and this cap).
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

    /// Captures one raw value with the size cap armed.
    fn capture<T>(&mut self, read: impl FnOnce() -> T) -> T {
        self.meter.limit.set(Some(self.meter.read.get() + self.hard_cap()));
        let value = read();
        self.meter.limit.set(None);
        value
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

    fn nested(&mut self, reader: impl Read) -> Result<(), FeedError> {
        let mut de = serde_json::Deserializer::from_reader(reader);
        let result = Walk(self, Level::Top).deserialize(&mut de).and_then(|()| de.end());
        match (result, self.fatal.take()) {
            (Ok(()), _) => Ok(()),
            (Err(_), Some(fatal)) => Err(fatal),
            (Err(e), None) if e.is_io() && self.meter.tripped.get() => Err(FeedError::Malformed(
                format!("an item is larger than {} bytes (hard cap)", self.hard_cap()),
            )),
            (Err(e), None) if e.is_io() => Err(FeedError::Io(e.into())),
            (Err(e), None) => Err(FeedError::Malformed(e.to_string())),
        }
    }

    fn ndjson(&mut self, mut reader: impl BufRead) -> Result<(), FeedError> {
        let max = self.rules.max_item_bytes;
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
                ndjson_item(line, &self.rules)
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
                        (self.sink)(FeedEvent::Place(place)).map_err(|_| FeedError::Stopped)?;
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
            (self.sink)(event).map_err(|_| FeedError::Stopped)?;
        }
        Ok(())
    }
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

struct Walk<'p, 's, 'b>(&'p mut Parser<'s>, Level<'b>);

impl<'de> DeserializeSeed<'de> for Walk<'_, '_, '_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
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
        match self.1 {
            Level::Top => self.0.top(map),
            _ => self.0.place(map),
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let parser = self.0;
        let Level::Items { place_id, pending } = self.1 else {
            while seq.next_element_seed(Walk(&mut *parser, Level::Place))?.is_some() {}
            return Ok(());
        };
        while let Some(raw) = parser.capture(|| seq.next_element::<Box<RawValue>>())? {
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
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "brand_id" => {
                    let found: i64 = map.next_value()?;
                    let expected = self.rules.brand_id;
                    if found != expected {
                        return Err(self.fail(FeedError::BrandMismatch { expected, found }));
                    }
                }
                "places" => map.next_value_seed(Walk(self, Level::Places))?,
                _ => _ = map.next_value::<IgnoredAny>()?,
            }
        }
        Ok(())
    }

    fn place<'de, A: MapAccess<'de>>(&mut self, mut map: A) -> Result<(), A::Error> {
        self.ids.clear();
        let (mut place_id, mut bad_place) = (None, None);
        let mut pending: Vec<Box<RawValue>> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "place_id" => {
                    let raw: Box<RawValue> = self.capture(|| map.next_value())?;
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
                "items" => {
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
        let mut events = Vec::new();
        let result = parse_feed(input.as_bytes(), format, &RULES, &mut |e| {
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
        // A forced format wins over detection.
        malformed(run_as(ndjson, FeedFormat::Json).1, "trailing characters");
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
        malformed(run(r#"{"brand_id":"7","places":[]}"#).1, "invalid type");
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

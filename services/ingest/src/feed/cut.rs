//! Items cut out of the nested document before serde_json reads it.
//!
//! serde_json reads a document from a stream a byte at a time, and an item
//! it hands over whole (`Box<RawValue>`) is then parsed again from its
//! slice: every item byte went through serde_json twice. [`Cut`] sits under
//! serde_json's buffer and moves each object in an `items` array to
//! [`Cuts`] instead; serde_json reads a placeholder where it stood, `{` +
//! the item's newlines + `}`, and the walk takes the item from [`Cuts`] as
//! it reaches the placeholder. Knowing which element of which `items` array
//! each waiting item is ([`Slot`]), the walk reads a placeholder already
//! there as an empty object, not as a raw value (which is copied).
//!
//! An item whole in the read that the item parser's fast path takes is
//! parsed right there, its bytes read once ([`Cut::whole`]); any other is
//! cut by scanning it only for strings and brackets (a string's plain bytes
//! with `memchr`), and parsed by the walk from its bytes. Nothing else
//! changes: keys, values, non-object items and every byte outside `items`
//! reach serde_json as before, and the spooled copy of a `places` that came
//! before `brand_id` is not cut.
//!
//! The feed's errors stay serde_json's own, with the same text, line and
//! column (a test compares both ways on thousands of broken feeds):
//! - a cut ends at the item's closing bracket, or at the first byte that
//!   cannot be JSON there (a bracket that closes what is not open, a
//!   control character in a string), or at the end of the input, or at the
//!   hard cap. Its bytes are checked by parsing them as serde_json reads
//!   an item in the document whenever they are not accepted as they are: a
//!   rejection, bytes that are not UTF-8, an item kept until its place's
//!   `place_id` is known, a cut that did not end at a bracket. A syntax
//!   error there fails the feed, placed in the feed ([`CutItem::position`]);
//! - the placeholder keeps the lines (each newline of an item is kept) and
//!   where the item starts, so only columns after an item on its line
//!   move. serde_json can only fail after the last item handed over, and
//!   [`Cuts`] keeps by how much that item's line moved ([`Cuts::column`]).

use std::collections::VecDeque;

use super::keys::{Key, SCAN_KEY_BYTES, TopAt};
use crate::item::{self, Item, ItemRules};

/// Where a string stands in an escape. serde_json takes the four bytes
/// after `\u` whatever they are (a quote, a newline) before it looks at
/// them, so they are taken as it takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    None,
    Backslash,
    /// Bytes of a `\u` escape still to come.
    Hex(u8),
}

impl Escape {
    /// After byte `b` of the escape.
    fn next(self, b: u8) -> Escape {
        match self {
            Escape::Backslash if b == b'u' => Escape::Hex(4),
            Escape::Hex(n) if n > 1 => Escape::Hex(n - 1),
            _ => Escape::None,
        }
    }
}

/// How an item's cut ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    /// At its closing bracket, or at the first byte that cannot be JSON
    /// there (a bracket that closes what is not open, a control character
    /// in a string): the item is read from its slice either way.
    Closed,
    /// At the end of the input, the item still open.
    Eof,
    /// At the hard cap, the item still open: nothing more is read.
    Capped,
}

/// Where an item stood: which `items` array the cutter cut in (from 1) and
/// which element of it. The walk counts alike, so that it knows the
/// placeholder of an item already cut before serde_json reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Slot {
    pub(super) array: u64,
    pub(super) index: u64,
}

/// An item cut out of the document, waiting for the walk.
#[derive(Debug, Clone)]
pub(super) struct CutItem {
    /// `None` where serde_json cannot read it as an element: a value came
    /// before it with no comma between (serde_json fails there).
    slot: Option<Slot>,
    /// Its bytes in [`Cuts`], as offsets counted from the first item.
    start: u64,
    end: u64,
    /// Where its `{` stands in the feed: the line (from 1) and the bytes
    /// before it on that line.
    line: u64,
    column: u64,
    newlines: u64,
    /// Bytes after its last newline, its last byte included.
    tail: u64,
    pub(super) ended: End,
    /// The item parsed as it was cut ([`Cut::whole`]); its `place_id` is
    /// the walk's to set. Like the bytes, the items waiting are those of one
    /// read at most.
    pub(super) item: Option<Item>,
}

impl CutItem {
    /// The place in the feed of a position serde_json gave in the item's slice.
    pub(super) fn position(&self, line: usize, column: usize) -> (u64, u64) {
        match line as u64 {
            0 | 1 => (self.line, self.column + column as u64),
            line => (self.line + line - 1, column as u64),
        }
    }
}

/// The items cut out and not yet handed to the walk, and how far the ones
/// handed over moved the columns of their line.
#[derive(Default)]
pub(super) struct Cuts {
    bytes: Vec<u8>,
    /// The offset of `bytes[0]`.
    base: u64,
    queue: VecDeque<CutItem>,
    /// A line, and by how many bytes the items handed over took its columns
    /// back as serde_json counts them.
    shift: (u64, u64),
}

impl Cuts {
    /// Whether the item at `slot` is cut and waiting: then serde_json will
    /// read its placeholder there.
    pub(super) fn waiting(&self, slot: Slot) -> bool {
        self.queue.front().is_some_and(|item| item.slot == Some(slot))
    }

    /// Hands over the next item, whose placeholder serde_json just read.
    pub(super) fn next(&mut self) -> Option<CutItem> {
        let item = self.queue.pop_front()?;
        self.shift = match item.newlines {
            // `{}` stood for the whole item.
            0 => {
                let shift = if self.shift.0 == item.line { self.shift.1 } else { 0 };
                (item.line, shift + (item.end - item.start).saturating_sub(2))
            }
            // `}` alone stood for the item's last line.
            n => (item.line + n, item.tail.saturating_sub(1)),
        };
        Some(item)
    }

    /// The bytes of an item just handed over.
    pub(super) fn bytes(&self, item: &CutItem) -> &[u8] {
        &self.bytes[(item.start - self.base) as usize..(item.end - self.base) as usize]
    }

    /// The column in the feed of a column serde_json gave on `line`.
    pub(super) fn column(&self, line: usize, column: usize) -> u64 {
        let shift = if self.shift.0 == line as u64 { self.shift.1 } else { 0 };
        column as u64 + shift
    }

    /// Drops the bytes of the items handed over; those of `open`, the
    /// start of an item still being cut, are kept.
    fn compact(&mut self, open: Option<u64>) {
        let keep = self.queue.front().map(|q| q.start).or(open).unwrap_or(self.offset());
        self.bytes.drain(..(keep - self.base) as usize);
        self.base = keep;
    }

    fn offset(&self) -> u64 {
        self.base + self.bytes.len() as u64
    }

    /// Queues the item cut up to here.
    fn queue(&mut self, open: Open, tail: u64, ended: End) {
        self.queue.push_back(CutItem {
            slot: open.slot,
            start: open.start,
            end: self.offset(),
            line: open.line,
            column: open.column,
            newlines: open.newlines,
            tail,
            ended,
            item: None,
        });
    }
}

/// What a container outside the items is, as far as the walk cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Within {
    Top,
    Places,
    Place,
    Items,
    Other,
}

/// The item being cut.
struct Open {
    slot: Option<Slot>,
    /// Open brackets, innermost last.
    brackets: Vec<u8>,
    in_string: bool,
    escape: Escape,
    start: u64,
    line: u64,
    column: u64,
    newlines: u64,
}

/// The filter under serde_json's buffer that cuts the items out (see the
/// module). Counts lines and offsets of the document as it came, uncut.
pub(super) struct Cut {
    hard_cap: u64,
    rules: ItemRules,
    /// Bytes gone by, the current line (from 1) and the offset it starts at.
    seen: u64,
    line: u64,
    line_start: u64,
    /// Open containers outside items, and what the first four are.
    depth: usize,
    within: [Within; 5],
    /// Where the walk stands in the feed object or a place (depths 1 and 3).
    at: TopAt,
    /// The last `items` array opened, the element it is at, and whether
    /// that element has no value yet.
    slot: Slot,
    fresh: bool,
    in_string: bool,
    escape: Escape,
    /// The key being read (from its opening quote) and the last one read,
    /// in the feed object or a place.
    key: Option<Vec<u8>>,
    last_key: Option<Key>,
    item: Option<Open>,
    /// An item went over the hard cap: nothing more is read.
    over: bool,
}

impl Cut {
    pub(super) fn new(hard_cap: u64, rules: ItemRules) -> Cut {
        Cut {
            hard_cap,
            rules,
            seen: 0,
            line: 1,
            line_start: 0,
            depth: 0,
            within: [Within::Other; 5],
            at: TopAt::Key,
            slot: Slot::default(),
            fresh: false,
            in_string: false,
            escape: Escape::None,
            key: None,
            last_key: None,
            item: None,
            over: false,
        }
    }

    /// Filters `buf` in place: the bytes serde_json gets are moved to the
    /// front, their count returned; each item cut goes to `cuts`.
    pub(super) fn filter(&mut self, buf: &mut [u8], cuts: &mut Cuts) -> usize {
        cuts.compact(self.item.as_ref().map(|open| open.start));
        let (mut out, mut i) = (0, 0);
        while i < buf.len() {
            if self.item.is_some() {
                let (next, closed) = self.cut(buf, i, &mut out, cuts);
                if !closed {
                    break;
                }
                i = next;
                continue;
            }
            let b = buf[i];
            buf[out] = b;
            out += 1;
            i += 1;
            if self.in_string {
                self.string_byte(b);
                continue;
            }
            if self.depth == 4 && !matches!(b, b' ' | b'\n' | b'\t' | b'\r' | b',' | b'{') {
                self.fresh = false;
            }
            match b {
                b'\n' => (self.line, self.line_start) = (self.line + 1, self.seen + i as u64),
                b'"' => {
                    self.in_string = true;
                    if matches!(self.depth, 1 | 3) && self.at == TopAt::Key {
                        self.key = Some(vec![b]);
                    }
                }
                b'{' if self.depth == 4 && self.within[4] == Within::Items => {
                    // An item: its `{` stays, what follows is cut.
                    let slot = std::mem::take(&mut self.fresh).then_some(self.slot);
                    if let Some(end) = self.whole(buf, i - 1, slot, &mut out, cuts) {
                        i = end;
                        continue;
                    }
                    self.item = Some(Open {
                        slot,
                        brackets: vec![b'{'],
                        in_string: false,
                        escape: Escape::None,
                        start: cuts.offset(),
                        line: self.line,
                        column: self.seen + i as u64 - 1 - self.line_start,
                        newlines: 0,
                    });
                    cuts.bytes.push(b);
                }
                b'{' | b'[' => self.open(b),
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if matches!(self.depth, 1 | 3) {
                        self.at = TopAt::Comma;
                    }
                }
                b':' if matches!(self.depth, 1 | 3) => self.at = TopAt::Value,
                b',' if matches!(self.depth, 1 | 3) => {
                    (self.at, self.last_key) = (TopAt::Key, None)
                }
                b',' if self.depth == 4 && self.within[4] == Within::Items => {
                    (self.slot.index, self.fresh) = (self.slot.index + 1, true)
                }
                _ => {}
            }
        }
        self.seen += buf.len() as u64;
        out
    }

    /// An item went over the hard cap: nothing more may be read.
    pub(super) fn over(&self) -> bool {
        self.over
    }

    /// At the end of the input: an item still open is handed over as it is
    /// (its check fails where serde_json would have). Returns the bytes put in `buf`.
    pub(super) fn finish(&mut self, buf: &mut [u8], cuts: &mut Cuts) -> usize {
        match self.item.take() {
            Some(open) if !buf.is_empty() => {
                buf[0] = b'}';
                cuts.queue(open, 0, End::Eof);
                1
            }
            open => {
                self.item = open;
                0
            }
        }
    }

    /// Cuts the open item from `buf[from..]`: its bytes go to `cuts`, its
    /// placeholder's part in this buffer to `buf[*out..]`. Returns where the
    /// document goes on and whether the item was closed there (if not, the
    /// buffer ended or the item went over the cap).
    fn cut(
        &mut self,
        buf: &mut [u8],
        from: usize,
        out: &mut usize,
        cuts: &mut Cuts,
    ) -> (usize, bool) {
        let Some(mut open) = self.item.take() else { return (from, true) };
        let (mut i, mut closed, before) = (from, false, open.newlines);
        while i < buf.len() {
            if open.in_string {
                if open.escape != Escape::None {
                    open.escape = open.escape.next(buf[i]);
                    i += 1;
                    continue;
                }
                // Plain string bytes in one go, to the next quote or backslash.
                let rest = &buf[i..];
                let n = memchr::memchr2(b'"', b'\\', rest).unwrap_or(rest.len());
                if let Some(c) = rest[..n].iter().position(|&c| c < 0x20) {
                    // A control character: not JSON, the check says where.
                    (i, closed) = (i + c, true);
                    break;
                }
                i += n;
                match buf.get(i) {
                    Some(b'"') => open.in_string = false,
                    Some(_) => open.escape = Escape::Backslash,
                    None => break,
                }
                i += 1;
                continue;
            }
            match buf[i] {
                b'"' => open.in_string = true,
                b @ (b'{' | b'[') => open.brackets.push(b),
                b @ (b'}' | b']') => {
                    let opener = if b == b'}' { b'{' } else { b'[' };
                    if open.brackets.pop() != Some(opener) || open.brackets.is_empty() {
                        // Its end, or a bracket that closes what is not open.
                        closed = true;
                        break;
                    }
                }
                b'\n' => {
                    open.newlines += 1;
                    self.line += 1;
                    self.line_start = self.seen + i as u64 + 1;
                }
                _ => {}
            }
            i += 1;
        }
        let end = if closed { i + 1 } else { buf.len() };
        cuts.bytes.extend_from_slice(&buf[from..end]);
        // The `{` stayed where the item starts; this part of it brings its
        // newlines, and its end a `}`: never more bytes than it covers.
        let newlines = (open.newlines - before) as usize;
        buf[*out..*out + newlines].fill(b'\n');
        *out += newlines;
        let capped = !closed && cuts.offset() - open.start > self.hard_cap;
        if !(closed || capped) {
            self.item = Some(open);
            return (end, false);
        }
        if *out == end {
            // Capped in a run of newlines: the `}` takes the last one's place.
            *out -= 1;
        }
        buf[*out] = b'}';
        *out += 1;
        let tail = self.seen + end as u64 - self.line_start;
        cuts.queue(open, tail, if closed { End::Closed } else { End::Capped });
        self.over = capped;
        (end, closed)
    }

    /// Cuts the item whose `{` is at `buf[at]` (already in `buf[..*out]`) at
    /// once when it is all in this buffer and the item parser's fast path
    /// takes it: it is then well-formed JSON, and its cut ends at its
    /// closing bracket as [`Cut::cut`] would end it, with nothing to check;
    /// parsed here, it is not scanned twice. Returns where the document goes
    /// on; `None` leaves the item to [`Cut::cut`].
    fn whole(
        &mut self,
        buf: &mut [u8],
        at: usize,
        slot: Option<Slot>,
        out: &mut usize,
        cuts: &mut Cuts,
    ) -> Option<usize> {
        let (item, len) = item::parse_leading(&buf[at..], &self.rules)?;
        let end = at + len;
        let bytes = &buf[at..end];
        let start = cuts.offset();
        cuts.bytes.extend_from_slice(bytes);
        let (line, column) = (self.line, self.seen + at as u64 - self.line_start);
        // Well-formed, the item has newlines only between its tokens; most
        // items have none, and one search says so.
        let mut newlines = 0;
        if let Some(last) = memchr::memrchr(b'\n', bytes) {
            newlines = memchr::memchr_iter(b'\n', bytes).count();
            self.line += newlines as u64;
            self.line_start = self.seen + (at + last) as u64 + 1;
        }
        // The placeholder, `{` + newlines + `}`, is never longer than the item.
        buf[*out..*out + newlines].fill(b'\n');
        buf[*out + newlines] = b'}';
        *out += newlines + 1;
        cuts.queue.push_back(CutItem {
            slot,
            start,
            end: cuts.offset(),
            line,
            column,
            newlines: newlines as u64,
            tail: self.seen + end as u64 - self.line_start,
            ended: End::Closed,
            item: Some(item),
        });
        Some(end)
    }

    /// A container opens outside items: what it is to the walk.
    fn open(&mut self, b: u8) {
        let parent = match self.depth {
            0 => None,
            d @ 1..=4 => Some(self.within[d]),
            _ => Some(Within::Other),
        };
        let at_value = self.at == TopAt::Value;
        let within = match (parent, b, self.last_key) {
            (None, b'{', _) => Within::Top,
            (Some(Within::Top), b'[', Some(Key::Places)) if at_value => Within::Places,
            (Some(Within::Places), b'{', _) => Within::Place,
            (Some(Within::Place), b'[', Some(Key::Items)) if at_value => Within::Items,
            _ => Within::Other,
        };
        self.depth += 1;
        if self.depth <= 4 {
            self.within[self.depth] = within;
        }
        if matches!(within, Within::Top | Within::Place) {
            (self.at, self.last_key) = (TopAt::Key, None);
        }
        if within == Within::Items {
            self.slot = Slot { array: self.slot.array + 1, index: 0 };
            self.fresh = true;
        }
    }

    /// Follows a byte inside a string outside items; a key of the feed
    /// object or a place is kept until it ends.
    fn string_byte(&mut self, b: u8) {
        match b {
            _ if self.escape != Escape::None => self.escape = self.escape.next(b),
            b'\\' => self.escape = Escape::Backslash,
            b'"' => self.in_string = false,
            _ => {}
        }
        let Some(key) = &mut self.key else { return };
        if key.len() <= SCAN_KEY_BYTES {
            key.push(b);
        }
        if self.in_string {
            return;
        }
        let key = self.key.take().unwrap_or_default();
        let name = serde_json::from_slice::<String>(&key).ok();
        let key = match (self.depth, name.as_deref()) {
            (1, Some("places")) => Key::Places,
            (3, Some("items")) => Key::Items,
            _ => Key::Other,
        };
        (self.last_key, self.at) = (Some(key), TopAt::Colon);
    }
}

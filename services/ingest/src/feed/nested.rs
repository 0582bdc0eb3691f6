//! The nested format (`{"brand_id", "places": [{"place_id", "items"}]}`),
//! walked by one serde visitor that knows its level and hands over each
//! item as soon as it is parsed.

use std::fmt;
use std::io::{BufReader, Read, Seek};
use std::rc::Rc;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::error::Category;
use serde_json::value::RawValue;

use super::cut::{CutItem, End, Slot};
use super::intake::{Intake, ReadState, Spool, spool_error};
use super::keys::Key;
use super::{BUFFER_BYTES, FeedError, FeedEvent, IdSet, Stopped, duplicate, id_key};
use crate::item::{self, Item, ItemRules, Reason, Reject, parse_item};

pub(super) struct Parser<'s> {
    pub(super) rules: ItemRules,
    pub(super) sink: &'s mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
    pub(super) state: Rc<ReadState>,
    /// The real cause when a visitor had to bail out with a serde error.
    pub(super) fatal: Option<FeedError>,
    /// Hashed ids of the current place (nested format).
    pub(super) ids: IdSet,
    /// `items` arrays walked in a document whose items are cut ([`Slot`]).
    pub(super) items_arrays: u64,
}

impl Parser<'_> {
    /// Largest raw item (or key, or value read whole) before the parse
    /// fails; an item between `max_item_bytes` and this is rejected as
    /// `too_large`.
    pub(super) fn hard_cap(&self) -> u64 {
        (4 * self.rules.max_item_bytes).max(1 << 20) as u64 + BUFFER_BYTES as u64
    }

    pub(super) fn emit<E: de::Error>(&mut self, event: FeedEvent) -> Result<(), E> {
        (self.sink)(event).map_err(|Stopped| self.fail(FeedError::Stopped))
    }

    pub(super) fn fail<E: de::Error>(&mut self, error: FeedError) -> E {
        let e = E::custom(&error);
        self.fatal = Some(error);
        e
    }

    /// Reads one value whole (`what` names it in the error) with the cap armed.
    pub(super) fn capture<T>(&mut self, what: &'static str, read: impl FnOnce() -> T) -> T {
        self.state.arm(what, self.hard_cap());
        let value = read();
        self.state.disarm();
        value
    }

    /// The next key of an object, known or not: serde_json reads a key whole
    /// (into its scratch buffer), so it is capped like an item.
    pub(super) fn key<'de, A: MapAccess<'de>>(
        &mut self,
        map: &mut A,
    ) -> Result<Option<Key>, A::Error> {
        self.capture("an object key", || map.next_key_seed(KeySeed))
    }

    /// One item of a place. A cut item (with its place in the feed) is
    /// checked when it is rejected: a syntax error fails the feed.
    pub(super) fn nested_item<E: de::Error>(
        &mut self,
        place_id: i64,
        raw: &str,
        cut: Option<&CutItem>,
    ) -> Result<(), E> {
        match parse_item(raw, Some(place_id), &self.rules) {
            Ok(item) => self.accept(item, raw.as_bytes()),
            Err(reject) => {
                if let Some(cut) = cut {
                    self.check(cut, raw.as_bytes())?;
                }
                self.emit(FeedEvent::Reject(reject))
            }
        }
    }

    /// Hands over a valid item of the current place, unless its id came before.
    fn accept<E: de::Error>(&mut self, item: Item, raw: &[u8]) -> Result<(), E> {
        let event = match self.ids.insert(id_key(&item.id)) {
            true => FeedEvent::Item(item),
            false => FeedEvent::Reject(duplicate(item, raw)),
        };
        self.emit(event)
    }

    /// An item cut out of the document, as serde_json reaches its
    /// placeholder: handed over, kept until the `place_id` is known, or
    /// failing the feed where serde_json would have.
    fn cut_item<E: de::Error>(
        &mut self,
        place_id: Option<i64>,
        pending: &mut Vec<Box<str>>,
    ) -> Result<(), E> {
        let state = self.state.clone();
        let Some(mut cut) = state.cuts.borrow_mut().next() else {
            let detail = "an item was read that was not cut out (a bug in the feed parser)";
            return Err(self.fail(FeedError::Malformed(detail.into())));
        };
        // Only the reader under serde_json changes the cuts, and it is not
        // reading now.
        let cuts = state.cuts.borrow();
        let bytes = cuts.bytes(&cut);
        if let (Some(mut item), Some(place_id)) = (cut.item.take(), place_id) {
            // Parsed as it was cut: what `nested_item` would have got.
            item.place_id = place_id;
            return self.accept(item, bytes);
        }
        match (cut.ended, std::str::from_utf8(bytes), place_id) {
            (End::Closed, Ok(raw), Some(place_id)) => self.nested_item(place_id, raw, Some(&cut)),
            (End::Closed, Ok(raw), None) => {
                self.check(&cut, bytes)?;
                pending.push(raw.into());
                Ok(())
            }
            _ => {
                self.check(&cut, bytes)?;
                let (line, column) = cut.position(1, 1);
                let detail = format!("an item at line {line} column {column} was cut short");
                Err(self.fail(FeedError::Malformed(detail)))
            }
        }
    }

    /// Reads a cut item as serde_json would have in the document: its
    /// syntax error fails the feed, placed in the feed.
    fn check<E: de::Error>(&mut self, cut: &CutItem, bytes: &[u8]) -> Result<(), E> {
        let mut de = serde_json::Deserializer::from_reader(bytes);
        let e = match Box::<RawValue>::deserialize(&mut de) {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let error = match cut.ended {
            End::Capped if e.classify() == Category::Eof => self.over_cap("an item"),
            _ => {
                let (line, column) = cut.position(e.line(), e.column());
                FeedError::Malformed(placed(&e, line, column))
            }
        };
        Err(self.fail(error))
    }

    fn over_cap(&self, what: &str) -> FeedError {
        let cap = self.hard_cap();
        FeedError::Malformed(format!("{what} is larger than {cap} bytes (hard cap)"))
    }

    /// The whole document, then the `places` arrays that came before
    /// `brand_id` (spooled), once the document is known to be right.
    pub(super) fn nested(&mut self, reader: impl Read) -> Result<(), FeedError> {
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

    pub(super) fn replay(&mut self, spool: Spool) -> Result<(), FeedError> {
        let mut file = spool.file;
        file.rewind().map_err(|e| FeedError::Io(spool_error(e)))?;
        self.state = Rc::new(ReadState::default());
        let intake = Intake { inner: file, state: self.state.clone(), scan: None, cut: None };
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
    pub(super) fn outcome(
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
            return Err(self.over_cap(what));
        }
        if e.is_io() {
            return Err(FeedError::Io(e.into()));
        }
        let mut message = e.to_string();
        if self.state.cutting && e.line() > 0 {
            // Columns after a cut item on its line, as in the feed.
            let column = self.state.cuts.borrow().column(e.line(), e.column());
            message = placed(&e, e.line() as u64, column);
        }
        if let Some(how) = position
            && e.line() > 0
        {
            message = format!("{message} ({how})");
        }
        Err(FeedError::Malformed(message))
    }
}

/// serde_json's message for `e`, at another line and column.
fn placed(e: &serde_json::Error, line: u64, column: u64) -> String {
    let message = e.to_string();
    let at = format!(" at line {} column {}", e.line(), e.column());
    let message = message.strip_suffix(&at).unwrap_or(&message);
    format!("{message} at line {line} column {column}")
}

// The nested format, walked by one serde visitor that knows its level.

/// Reads a key without keeping it: serde_json hands over its own copy.
pub(super) struct KeySeed;

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

pub(super) enum Level<'b> {
    Top,
    Places,
    Place,
    /// Items of a place; buffered in `pending` while its `place_id` is unknown.
    Items {
        place_id: Option<i64>,
        pending: &'b mut Vec<Box<str>>,
    },
}

pub(super) struct Walk<'p, 'a, 'b>(&'p mut Parser<'a>, Level<'b>);

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
        let cutting = parser.state.cutting;
        parser.items_arrays += u64::from(cutting);
        let mut slot = Slot { array: parser.items_arrays, index: 0 };
        loop {
            // The placeholder of an item already cut is read without a copy;
            // one whose item is cut only as serde_json reads on is read raw.
            if cutting && parser.state.cuts.borrow().waiting(slot) {
                if parser.capture("an item", || seq.next_element_seed(Placeholder))?.is_none() {
                    break;
                }
                parser.cut_item(place_id, pending)?;
            } else {
                let raw = parser.capture("an item", || seq.next_element::<Box<RawValue>>())?;
                let Some(raw) = raw else { break };
                match place_id {
                    _ if cutting && raw.get().starts_with('{') => {
                        parser.cut_item(place_id, pending)?
                    }
                    Some(place_id) => parser.nested_item(place_id, raw.get(), None)?,
                    None => pending.push(raw.get().into()),
                }
            }
            slot.index += 1;
        }
        Ok(())
    }
}

/// The placeholder of an item cut out under serde_json (`{`, the item's
/// newlines, `}`), read without the copy a `Box<RawValue>` makes. It is an
/// empty object, read without fail as a raw value would be; were it
/// something else (the walk and the cutter counting elements apart), the
/// feed fails rather than an element be skipped.
struct Placeholder;

impl<'de> DeserializeSeed<'de> for Placeholder {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Placeholder {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("the placeholder of an item cut out")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        match map.next_key::<IgnoredAny>()? {
            None => Ok(()),
            Some(_) => Err(de::Error::custom("an item was not cut out (a bug in the feed parser)")),
        }
    }
}

impl Parser<'_> {
    pub(super) fn top<'de, A: MapAccess<'de>>(&mut self, mut map: A) -> Result<(), A::Error> {
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

    pub(super) fn place<'de, A: MapAccess<'de>>(&mut self, mut map: A) -> Result<(), A::Error> {
        self.ids.clear();
        let (mut place_id, mut bad_place) = (None, None);
        let mut pending: Vec<Box<str>> = Vec::new();
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
                                self.nested_item(id, &raw, None)?;
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
            let reject = Reject::new(Reason::MissingPlace, &*detail, raw.as_bytes());
            self.emit(FeedEvent::Reject(reject))?;
        }
        Ok(())
    }
}

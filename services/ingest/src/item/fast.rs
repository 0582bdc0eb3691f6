//! The item parser's fast path: one pass over a well-formed item's bytes,
//! then its owned fields written straight as `Product` wire bytes (prost's
//! encoding, fields in number order). It never rejects: what it is not sure
//! the reference parser accepts, with the very same result, it leaves to it
//! (`None`), so every rejection keeps one producer.
//!
//! "Sure" means it accepts a subset of what serde_json accepts, read the way
//! serde_json reads it: the grammar of `ignore_value` for every value it
//! skips, the derive's refusal of a known key given twice, `null` as absent,
//! `str::parse::<i64>` for integers, strict surrogates for decoded strings.
//! It gives up on a key with an escape, a known value of an unexpected
//! type, a number that is not a plain i64, a size at a limit, nesting deeper
//! than [`MAX_DEPTH`], and any syntax error.

use std::borrow::Cow;

use memchr::memchr;
use shelfsync_proto::product_field as pf;

use super::{Item, ItemRules, MAX_ID_BYTES, MAX_IMAGES, MAX_STRING_BYTES, wire};

#[cfg(test)]
mod tests;

/// Nesting followed in a skipped value (a bit per level records its
/// bracket); deeper, the reference decides.
const MAX_DEPTH: u32 = 64;

/// Slots of the known keys: a `Product` field's slot is its number.
const ID: usize = 0;
const BRAND_ID: usize = 9;
const PLACE_ID: usize = 10;
const KEYS: usize = 11;

/// The value of a known key, as far as the fast path needs it. Its text is
/// where it stands in the item: the scan reads bytes, and the item is known
/// to be UTF-8 only once its end is found ([`parse_leading`]).
#[derive(Debug, Clone, Copy)]
enum Value {
    /// Not there, or `null` (serde reads `null` into an `Option` as `None`).
    Absent,
    /// A string: its text between the quotes, and whether it has escapes.
    Str { body: Span, escaped: bool },
    /// A plain JSON integer that fits in i64.
    Int(i64),
    /// An array of strings: its text from `[` to `]`, how many, the bytes
    /// their fields take at most, and the longest text between quotes.
    Strings { text: Span, count: usize, size: usize, longest: usize },
    /// Any other valid value.
    Other,
}

/// Where some text stands in the item.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: usize,
    end: usize,
}

impl Span {
    fn len(self) -> usize {
        self.end - self.start
    }

    fn of(self, raw: &str) -> Option<&str> {
        raw.get(self.start..self.end)
    }
}

/// Parses `raw` when it is a well-formed item that the reference parser
/// accepts; `None` leaves it to the reference (see the module's doc).
pub(super) fn parse(raw: &str, place_id: Option<i64>, rules: &ItemRules) -> Option<Item> {
    if raw.len() > rules.max_item_bytes {
        return None;
    }
    let mut fields = [Value::Absent; KEYS];
    let end = scan(raw.as_bytes(), &mut fields)?;
    if ws(raw.as_bytes(), end) != raw.len() {
        return None;
    }
    build(raw, &fields, place_id, rules)
}

/// The item that `bytes` start with, when it is all there and the fast path
/// accepts it: what [`parse`] gives for its bytes (and a `place_id` of 0,
/// for the caller to set), and their length. Nothing after its closing
/// bracket is read: the item may be followed by anything.
pub(super) fn parse_leading(bytes: &[u8], rules: &ItemRules) -> Option<(Item, usize)> {
    // A longer item is not taken by `parse` either.
    let bytes = &bytes[..bytes.len().min(rules.max_item_bytes)];
    if bytes.first() != Some(&b'{') {
        return None;
    }
    let mut fields = [Value::Absent; KEYS];
    let end = scan(bytes, &mut fields)?;
    let raw = std::str::from_utf8(&bytes[..end]).ok()?;
    Some((build(raw, &fields, Some(0), rules)?, end))
}

/// The item from its scanned fields.
fn build(
    raw: &str,
    fields: &[Value; KEYS],
    place_id: Option<i64>,
    rules: &ItemRules,
) -> Option<Item> {
    let place_id = match place_id {
        Some(place_id) => place_id,
        None => {
            match fields[BRAND_ID] {
                Value::Absent => {}
                Value::Int(brand) if brand == rules.brand_id => {}
                _ => return None,
            }
            match fields[PLACE_ID] {
                Value::Int(place_id) => place_id,
                _ => return None,
            }
        }
    };
    let id = match fields[ID] {
        Value::Str { body, escaped } => decode(body.of(raw)?, escaped)?,
        _ => return None,
    };
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return None;
    }

    // Every owned field is checked, and its bytes counted, before any is written.
    let mut size = 0;
    let mut missing = Vec::new();
    for number in pf::TITLE..=pf::DESCRIPTION {
        if !rules.owned.contains(number) {
            continue;
        }
        size += match (number, fields[number as usize]) {
            (_, Value::Absent) => {
                missing.push(number);
                0
            }
            (pf::PRICE | pf::OLD_PRICE | pf::STOCK, Value::Int(n)) => wire::int_len(number, n),
            (pf::IMAGES, Value::Strings { count, size, longest, .. }) => {
                if count > MAX_IMAGES || longest > MAX_STRING_BYTES {
                    return None;
                }
                size
            }
            (pf::PRICE | pf::OLD_PRICE | pf::STOCK | pf::IMAGES, _) => return None,
            // Escapes only shorten a string: its text is a bound on its size.
            (_, Value::Str { body, .. }) if body.len() <= MAX_STRING_BYTES => {
                wire::bytes_len(number, body.len())
            }
            _ => return None,
        };
    }

    let mut data = Vec::with_capacity(size);
    for number in pf::TITLE..=pf::DESCRIPTION {
        if !rules.owned.contains(number) {
            continue;
        }
        match fields[number as usize] {
            Value::Int(n) => wire::int(&mut data, number, n),
            Value::Str { body, escaped } => put_string(&mut data, number, body.of(raw)?, escaped)?,
            Value::Strings { text, .. } => put_strings(&mut data, number, text.of(raw)?)?,
            Value::Absent | Value::Other => {}
        }
    }
    Some(Item { place_id, id: id.into_owned(), data, missing })
}

#[inline]
fn put_string(data: &mut Vec<u8>, number: u32, body: &str, escaped: bool) -> Option<()> {
    match escaped {
        false => wire::bytes(data, number, body.as_bytes()),
        true => wire::bytes(data, number, unescape(body)?.as_bytes()),
    }
    Some(())
}

/// Writes each string of an array (already scanned: strings only) as one
/// repeated-field entry.
fn put_strings(data: &mut Vec<u8>, number: u32, text: &str) -> Option<()> {
    let b = text.as_bytes();
    // Between the strings there are only brackets, commas and whitespace.
    let mut i = 1;
    loop {
        match b.get(i)? {
            b'"' => {
                let (end, escaped) = string(b, i + 1)?;
                put_string(data, number, text.get(i + 1..end - 1)?, escaped)?;
                i = end;
            }
            b']' => return Some(()),
            _ => i += 1,
        }
    }
}

/// The item's known keys and their values (into `fields`, all absent to
/// begin with: returning them would copy them), when the text starts with
/// one JSON object read without doubt (after whitespace); where it ends.
fn scan(b: &[u8], fields: &mut [Value; KEYS]) -> Option<usize> {
    let mut seen = 0u16;
    let mut i = ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = ws(b, i + 1);
    if b.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            if b.get(i) != Some(&b'"') {
                return None;
            }
            let (end, escaped) = string(b, i + 1)?;
            // serde matches a key after unescaping it; not worth doing here.
            if escaped {
                return None;
            }
            let slot = slot(&b[i + 1..end - 1]);
            i = ws(b, end);
            if b.get(i) != Some(&b':') {
                return None;
            }
            i = ws(b, i + 1);
            i = match slot {
                Some(slot) => {
                    // The derive refuses a known key given twice (even after a `null`).
                    if seen & 1 << slot != 0 {
                        return None;
                    }
                    seen |= 1 << slot;
                    let (value, end) = known(b, i, slot == pf::IMAGES as usize)?;
                    fields[slot] = value;
                    end
                }
                None => skip(b, i)?,
            };
            i = ws(b, i);
            match b.get(i) {
                Some(b',') => i = ws(b, i + 1),
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    Some(i)
}

/// The slot of a known key.
fn slot(key: &[u8]) -> Option<usize> {
    Some(match key {
        b"id" => ID,
        b"title" => pf::TITLE as usize,
        b"category" => pf::CATEGORY as usize,
        b"price" => pf::PRICE as usize,
        b"old_price" => pf::OLD_PRICE as usize,
        b"currency" => pf::CURRENCY as usize,
        b"stock" => pf::STOCK as usize,
        b"images" => pf::IMAGES as usize,
        b"description" => pf::DESCRIPTION as usize,
        b"brand_id" => BRAND_ID,
        b"place_id" => PLACE_ID,
        _ => return None,
    })
}

/// The value of a known key at `i` (not whitespace), and where it ends.
fn known(b: &[u8], i: usize, images: bool) -> Option<(Value, usize)> {
    match b.get(i)? {
        b'"' => {
            let (end, escaped) = string(b, i + 1)?;
            Some((Value::Str { body: Span { start: i + 1, end: end - 1 }, escaped }, end))
        }
        b'-' | b'0'..=b'9' => match number(b, i)? {
            (end, Some(n)) => Some((Value::Int(n), end)),
            (end, None) => Some((Value::Other, end)),
        },
        b'n' => Some((Value::Absent, literal(b, i, b"null")?)),
        b'[' if images => match strings(b, i) {
            Some(found) => Some(found),
            None => Some((Value::Other, skip(b, i)?)),
        },
        _ => Some((Value::Other, skip(b, i)?)),
    }
}

/// An array of strings only at `start` (`[`); `None` for anything else, valid
/// or not.
fn strings(b: &[u8], start: usize) -> Option<(Value, usize)> {
    let (mut count, mut size, mut longest) = (0, 0, 0);
    let mut i = ws(b, start + 1);
    if b.get(i) != Some(&b']') {
        loop {
            if b.get(i) != Some(&b'"') {
                return None;
            }
            let (end, _) = string(b, i + 1)?;
            let len = end - i - 2;
            count += 1;
            size += wire::bytes_len(pf::IMAGES, len);
            longest = longest.max(len);
            i = ws(b, end);
            match b.get(i) {
                Some(b',') => i = ws(b, i + 1),
                Some(b']') => break,
                _ => return None,
            }
        }
    }
    let text = Span { start, end: i + 1 };
    Some((Value::Strings { text, count, size, longest }, i + 1))
}

/// Skips JSON whitespace (serde_json's four bytes, nothing else).
fn ws(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\t' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

/// The end of `word` at `i`.
fn literal(b: &[u8], i: usize, word: &[u8]) -> Option<usize> {
    b.get(i..)?.starts_with(word).then_some(i + word.len())
}

/// A string whose text starts at `i` (after its opening quote), checked as
/// serde_json's `ignore_str` checks it: where it ends (after the closing
/// quote) and whether it has escapes.
#[inline(always)]
fn string(b: &[u8], mut i: usize) -> Option<(usize, bool)> {
    let mut escaped = false;
    loop {
        i = plain(b, i);
        match *b.get(i)? {
            b'"' => return Some((i + 1, escaped)),
            b'\\' => {
                escaped = true;
                i += match *b.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                    b'u' => {
                        hex4(b, i + 2)?;
                        6
                    }
                    _ => return None,
                };
            }
            0..=0x1f => return None,
            _ => i += 1,
        }
    }
}

/// Skips a string's plain run from `i`, eight bytes at a time as serde_json
/// does: stops at the first quote, backslash or control character, or where
/// fewer than eight bytes are left (the caller reads those one by one).
#[inline(always)]
fn plain(b: &[u8], mut i: usize) -> usize {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    while let Some(&word) = b.get(i..).and_then(|rest| rest.first_chunk::<8>()) {
        let word = u64::from_le_bytes(word);
        // Each term sets the high bit of a byte that matches, and maybe of
        // some after it (a borrow), never before: the lowest one is exact.
        let control = word.wrapping_sub(ONES * 0x20) & !word;
        let quote = word ^ (ONES * u64::from(b'"'));
        let quote = quote.wrapping_sub(ONES) & !quote;
        let backslash = word ^ (ONES * u64::from(b'\\'));
        let backslash = backslash.wrapping_sub(ONES) & !backslash;
        let found = (control | quote | backslash) & HIGH;
        if found != 0 {
            return i + (found.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    i
}

/// Four hex digits at `i`.
fn hex4(b: &[u8], i: usize) -> Option<u32> {
    let digits = b.get(i..i + 4)?;
    digits.iter().try_fold(0, |n, &d| Some(n << 4 | char::from(d).to_digit(16)?))
}

/// A JSON number at `i` in serde_json's grammar: where it ends, and its
/// value when it is an integer that fits in i64 (what `str::parse` reads).
fn number(b: &[u8], start: usize) -> Option<(usize, Option<i64>)> {
    let negative = b.get(start) == Some(&b'-');
    let first = start + usize::from(negative);
    let (mut i, mut n) = (first, 0u64);
    while let Some(&d) = b.get(i).filter(|d| d.is_ascii_digit()) {
        n = n.wrapping_mul(10).wrapping_add(u64::from(d - b'0'));
        i += 1;
    }
    // At least one digit, and one leading zero at most.
    if i == first || (b[first] == b'0' && i > first + 1) {
        return None;
    }
    // Eighteen digits cannot overflow; more are read as the reference reads them.
    let mut value = match i - first {
        ..=18 if negative => Some(-(n as i64)),
        ..=18 => Some(n as i64),
        _ => std::str::from_utf8(&b[start..i]).ok()?.parse().ok(),
    };
    if b.get(i) == Some(&b'.') {
        value = None;
        i = digits(b, i + 1)?;
    }
    if let Some(b'e' | b'E') = b.get(i) {
        value = None;
        i += 1;
        if let Some(b'+' | b'-') = b.get(i) {
            i += 1;
        }
        i = digits(b, i)?;
    }
    Some((i, value))
}

/// The end of one or more digits at `i`.
fn digits(b: &[u8], start: usize) -> Option<usize> {
    let mut i = start;
    while b.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    (i > start).then_some(i)
}

/// Skips one value at `i` (not whitespace) as serde_json's `ignore_value`
/// reads it, without recursion: a bit per open bracket says which it is.
fn skip(b: &[u8], mut i: usize) -> Option<usize> {
    let (mut depth, mut objects) = (0u32, 0u64);
    loop {
        // A value starts at `i`.
        match *b.get(i)? {
            b'"' => i = string(b, i + 1)?.0,
            b'-' | b'0'..=b'9' => i = number(b, i)?.0,
            b't' => i = literal(b, i, b"true")?,
            b'f' => i = literal(b, i, b"false")?,
            b'n' => i = literal(b, i, b"null")?,
            open @ (b'[' | b'{') => {
                if depth == MAX_DEPTH {
                    return None;
                }
                let object = open == b'{';
                objects = objects << 1 | u64::from(object);
                depth += 1;
                i = ws(b, i + 1);
                match b.get(i) {
                    Some(b']') if !object => i += 1,
                    Some(b'}') if object => i += 1,
                    _ if object => {
                        i = key(b, i)?;
                        continue;
                    }
                    _ => continue,
                }
                depth -= 1;
                objects >>= 1;
            }
            _ => return None,
        }
        // After a value: close what it ends, or find the next one.
        loop {
            if depth == 0 {
                return Some(i);
            }
            i = ws(b, i);
            let object = objects & 1 == 1;
            match b.get(i) {
                Some(b',') => {
                    i = ws(b, i + 1);
                    if object {
                        i = key(b, i)?;
                    }
                    break;
                }
                Some(b']') if !object => {}
                Some(b'}') if object => {}
                _ => return None,
            }
            i += 1;
            depth -= 1;
            objects >>= 1;
        }
    }
}

/// A key of a skipped object at `i`, its colon and the whitespace after:
/// where its value starts.
fn key(b: &[u8], i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let (end, _) = string(b, i + 1)?;
    let i = ws(b, end);
    (b.get(i) == Some(&b':')).then(|| ws(b, i + 1))
}

/// The text of a string between its quotes (already checked by [`string`]),
/// decoded as serde_json decodes a `String`: `None` where that fails (a lone
/// or unpaired surrogate).
#[inline]
fn decode(body: &str, escaped: bool) -> Option<Cow<'_, str>> {
    match escaped {
        false => Some(Cow::Borrowed(body)),
        true => unescape(body).map(Cow::Owned),
    }
}

/// [`decode`] of a string with escapes.
fn unescape(body: &str) -> Option<String> {
    let b = body.as_bytes();
    let mut out = String::with_capacity(body.len());
    let mut i = 0;
    while let Some(at) = memchr(b'\\', b.get(i..)?) {
        // An escape is ASCII: `i` and `i + at` are on char boundaries.
        out.push_str(body.get(i..i + at)?);
        i += at + 1;
        let c = *b.get(i)?;
        i += 1;
        out.push(match c {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\x08',
            b'f' => '\x0c',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let n = hex4(b, i)?;
                i += 4;
                match n {
                    0xD800..=0xDBFF => {
                        if b.get(i..i + 2) != Some(b"\\u") {
                            return None;
                        }
                        let low = hex4(b, i + 2)?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return None;
                        }
                        i += 6;
                        char::from_u32(0x10000 + ((n - 0xD800) << 10) + (low - 0xDC00))?
                    }
                    _ => char::from_u32(n)?,
                }
            }
            _ => return None,
        });
    }
    out.push_str(body.get(i..)?);
    Some(out)
}

//! NDJSON feeds: one item a line, each on its own, read with a bounded
//! line buffer.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::io::{self, BufRead};

use serde::de::IgnoredAny;

use super::{FeedError, FeedEvent, IdSet, Stopped, duplicate, id_key};
use crate::item::{Item, ItemRules, Reason, Reject, parse_item};

/// The items of an NDJSON feed, each line on its own.
pub(super) fn ndjson(
    mut reader: impl BufRead,
    rules: &ItemRules,
    sink: &mut dyn FnMut(FeedEvent) -> Result<(), Stopped>,
) -> Result<(), FeedError> {
    let max = rules.max_item_bytes;
    let mut ids: HashMap<i64, IdSet> = HashMap::new();
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
                    e.insert(IdSet::default())
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

pub(super) fn ndjson_item(line: &[u8], rules: &ItemRules) -> Result<Item, Reject> {
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

/// Reads one line (newline excluded) into `buf`, keeping at most `keep`
/// bytes of it. Returns the full length of the line, or `None` at the end.
pub(super) fn read_line_bounded(
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

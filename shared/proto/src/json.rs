//! Wire types as JSON for people and scripts (`get`, `tail`): `data` decoded
//! as `Product`, `state` as `RecordState`, timestamps also in RFC 3339,
//! field numbers as names where known. Pure; no I/O.
//!
//! Only fields present on the wire appear (a price of 0 is present and shows
//! as 0; an unset price is left out). Field numbers this build does not know
//! — a newer `Product` merged by a schema-agnostic storage — would be lost by
//! decoding, so they are listed under `unknown_data_fields` /
//! `unknown_state_fields` instead of vanishing silently.

use crate::{
    Change, ChangeKind, Command, CommandKind, KeyframeMark, Origin, Product, Record, RecordKey,
    RecordState, Rejection, product_field,
};
use chrono::{DateTime, SecondsFormat};
use prost::Message;
use serde_json::{Map, Value, json};

/// Names of `RecordState` fields by number (1-based).
const STATE_FIELD_NAMES: [&str; 4] = ["hidden", "reasons", "decided_by", "decided_at"];

/// A record: key, envelope fields, timestamps (µs and RFC 3339), decoded
/// `data` and `state`.
pub fn record_to_json(record: &Record) -> Value {
    let mut m = Map::new();
    m.insert("key".into(), key_json(record.key.as_ref()));
    m.insert("generation".into(), record.generation.into());
    m.insert("absent".into(), record.absent.into());
    m.insert("deleted".into(), record.deleted.into());
    insert_time(&mut m, "created_at", record.created_at);
    insert_time(&mut m, "updated_at", record.updated_at);
    insert_decoded(&mut m, "data", &record.data, product_field::NAMES.len(), |b| {
        Product::decode(b).map(|p| product_to_json(&p))
    });
    insert_decoded(&mut m, "state", &record.state, STATE_FIELD_NAMES.len(), |b| {
        RecordState::decode(b).map(|s| state_to_json(&s))
    });
    Value::Object(m)
}

/// One change: kind, key, `before` / `after` records (null when unset),
/// changed fields by name, origin.
pub fn change_to_json(change: &Change) -> Value {
    let kind = ChangeKind::try_from(change.kind)
        .map_or_else(|_| Value::from(change.kind), |k| Value::from(change_kind_name(k)));
    let mut v = json!({
        "kind": kind,
        "key": key_json(change.key.as_ref()),
        "before": change.before.as_ref().map_or(Value::Null, record_to_json),
        "after": change.after.as_ref().map_or(Value::Null, record_to_json),
        "changed_data_fields": field_names(&change.changed_data_fields, &product_field::NAMES),
        "changed_state_fields": field_names(&change.changed_state_fields, &STATE_FIELD_NAMES),
        "origin": change.origin.as_ref().map_or(Value::Null, origin_json),
    });
    if change.before_omitted {
        v["before_omitted"] = true.into();
    }
    v
}

/// A keyframe marker carried by an otherwise empty `ChangeBatch`: the
/// place's record count and digest at that exact point of the stream.
pub fn keyframe_mark_to_json(mark: &KeyframeMark) -> Value {
    let mut m = Map::new();
    m.insert("kind".into(), "keyframe".into());
    m.insert("keyframe_id".into(), mark.keyframe_id.clone().into());
    m.insert("total".into(), mark.total.into());
    m.insert("digest".into(), mark.digest.into());
    insert_time(&mut m, "as_of", mark.as_of);
    Value::Object(m)
}

/// One rejection: reason, detail, key, origin, the refused command (decoded)
/// and the raw input when there was no command.
pub fn rejection_to_json(rejection: &Rejection) -> Value {
    let mut m = Map::new();
    m.insert("reason".into(), rejection.reason.clone().into());
    m.insert("detail".into(), rejection.detail.clone().into());
    let key =
        rejection.key.as_ref().or_else(|| rejection.command.as_ref().and_then(|c| c.key.as_ref()));
    m.insert("key".into(), key_json(key));
    m.insert("origin".into(), rejection.origin.as_ref().map_or(Value::Null, origin_json));
    if let Some(cmd) = &rejection.command {
        m.insert("command".into(), command_to_json(cmd));
    }
    if !rejection.raw.is_empty() {
        m.insert("raw".into(), String::from_utf8_lossy(&rejection.raw).into_owned().into());
    }
    Value::Object(m)
}

/// A command as it was sent: kind, fields set (decoded), fields cleared,
/// CAS condition, generation.
pub fn command_to_json(cmd: &Command) -> Value {
    let kind = CommandKind::try_from(cmd.kind)
        .map_or_else(|_| Value::from(cmd.kind), |k| Value::from(command_kind_name(k)));
    let mut m = Map::new();
    m.insert("kind".into(), kind);
    m.insert("key".into(), key_json(cmd.key.as_ref()));
    insert_decoded(&mut m, "data", &cmd.data, product_field::NAMES.len(), |b| {
        Product::decode(b).map(|p| product_to_json(&p))
    });
    insert_decoded(&mut m, "state", &cmd.state, STATE_FIELD_NAMES.len(), |b| {
        RecordState::decode(b).map(|s| state_to_json(&s))
    });
    if !cmd.clear_data_fields.is_empty() {
        m.insert(
            "clear_data_fields".into(),
            field_names(&cmd.clear_data_fields, &product_field::NAMES),
        );
    }
    if !cmd.clear_state_fields.is_empty() {
        m.insert(
            "clear_state_fields".into(),
            field_names(&cmd.clear_state_fields, &STATE_FIELD_NAMES),
        );
    }
    if let Some(expected) = cmd.expected_updated_at {
        m.insert("expected_updated_at".into(), expected.into());
    }
    m.insert("generation".into(), cmd.generation.into());
    Value::Object(m)
}

/// The fields of a product that are present, by their feed names.
pub fn product_to_json(p: &Product) -> Value {
    let mut m = Map::new();
    let mut put = |name: &str, v: Option<Value>| {
        if let Some(v) = v {
            m.insert(name.into(), v);
        }
    };
    put("title", p.title.clone().map(Value::from));
    put("category", p.category.clone().map(Value::from));
    put("price", p.price.map(Value::from));
    put("old_price", p.old_price.map(Value::from));
    put("currency", p.currency.clone().map(Value::from));
    put("stock", p.stock.map(Value::from));
    // A repeated field has no presence of its own: empty is not on the wire.
    put("images", (!p.images.is_empty()).then(|| Value::from(p.images.clone())));
    put("description", p.description.clone().map(Value::from));
    Value::Object(m)
}

/// The fields of a record state that are present.
pub fn state_to_json(s: &RecordState) -> Value {
    let mut m = Map::new();
    if let Some(hidden) = s.hidden {
        m.insert("hidden".into(), hidden.into());
    }
    if !s.reasons.is_empty() {
        m.insert("reasons".into(), s.reasons.clone().into());
    }
    if let Some(by) = &s.decided_by {
        m.insert("decided_by".into(), by.clone().into());
    }
    if let Some(at) = s.decided_at {
        insert_time(&mut m, "decided_at", at);
    }
    Value::Object(m)
}

/// Microseconds since the epoch as RFC 3339 (UTC, µs precision); `None` when
/// out of range.
pub fn rfc3339_micros(us: i64) -> Option<String> {
    DateTime::from_timestamp_micros(us).map(|t| t.to_rfc3339_opts(SecondsFormat::Micros, true))
}

fn key_json(key: Option<&RecordKey>) -> Value {
    key.map_or(
        Value::Null,
        |k| json!({"brand_id": k.brand_id, "place_id": k.place_id, "product_id": k.product_id}),
    )
}

fn origin_json(o: &Origin) -> Value {
    let mut m = Map::new();
    m.insert("source".into(), o.source.clone().into());
    m.insert("import_id".into(), o.import_id.clone().into());
    insert_time(&mut m, "published_at", o.published_at);
    Value::Object(m)
}

/// `name` in µs and, when set, `name_rfc3339` beside it.
fn insert_time(m: &mut Map<String, Value>, name: &str, us: i64) {
    m.insert(name.into(), us.into());
    if us != 0
        && let Some(t) = rfc3339_micros(us)
    {
        m.insert(format!("{name}_rfc3339"), t.into());
    }
}

/// Decodes `bytes` into `name`. Field numbers above `known` are listed in
/// `unknown_<name>_fields`; bytes that do not decode are shown in hex under
/// `<name>_hex` with the error in `<name>_error`, `name` itself being null.
fn insert_decoded(
    m: &mut Map<String, Value>,
    name: &str,
    bytes: &[u8],
    known: usize,
    decode: impl Fn(&[u8]) -> Result<Value, prost::DecodeError>,
) {
    match decode(bytes) {
        Ok(v) => {
            m.insert(name.into(), v);
            let unknown = unknown_fields(bytes, known as u32);
            if !unknown.is_empty() {
                m.insert(format!("unknown_{name}_fields"), unknown.into());
            }
        }
        Err(e) => {
            m.insert(name.into(), Value::Null);
            m.insert(format!("{name}_error"), e.to_string().into());
            m.insert(format!("{name}_hex"), hex(bytes).into());
        }
    }
}

/// Top-level field numbers above `known` present in a protobuf message,
/// sorted and deduplicated.
fn unknown_fields(bytes: &[u8], known: u32) -> Vec<u32> {
    let mut out: Vec<u32> =
        wire_field_numbers(bytes).unwrap_or_default().into_iter().filter(|&f| f > known).collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Top-level field numbers of a message in wire order; `None` when it is
/// not well-formed. (Groups, wire types 3 and 4, do not exist in proto3.)
fn wire_field_numbers(mut buf: &[u8]) -> Option<Vec<u32>> {
    let mut fields = Vec::new();
    while !buf.is_empty() {
        let key = read_varint(&mut buf)?;
        let field = u32::try_from(key >> 3).ok().filter(|&f| f > 0)?;
        let skip = match key & 7 {
            0 => {
                read_varint(&mut buf)?;
                0
            }
            1 => 8,
            2 => usize::try_from(read_varint(&mut buf)?).ok()?,
            5 => 4,
            _ => return None,
        };
        buf = buf.get(skip..)?;
        fields.push(field);
    }
    Some(fields)
}

fn read_varint(buf: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&byte, rest) = buf.split_first()?;
        *buf = rest;
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Some(value);
        }
    }
    None
}

/// Field numbers as names where `names` knows them (1-based), as numbers
/// otherwise.
fn field_names(numbers: &[u32], names: &[&str]) -> Value {
    numbers
        .iter()
        .map(|&n| {
            (n as usize)
                .checked_sub(1)
                .and_then(|i| names.get(i))
                .map_or_else(|| Value::from(n), |name| Value::from(*name))
        })
        .collect()
}

fn change_kind_name(kind: ChangeKind) -> &'static str {
    match kind {
        ChangeKind::Unspecified => "unspecified",
        ChangeKind::Created => "created",
        ChangeKind::Updated => "updated",
        ChangeKind::Deleted => "deleted",
    }
}

fn command_kind_name(kind: CommandKind) -> &'static str {
    match kind {
        CommandKind::Unspecified => "unspecified",
        CommandKind::Save => "save",
        CommandKind::Patch => "patch",
        CommandKind::Delete => "delete",
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(product: &Product, state: &RecordState) -> Record {
        Record {
            key: Some(RecordKey::new(7, 42, "sku-1")),
            data: product.encode_to_vec(),
            state: state.encode_to_vec(),
            generation: 5,
            absent: false,
            deleted: false,
            created_at: 1_700_000_000_000_000,
            updated_at: 1_700_000_000_123_456,
        }
    }

    #[test]
    fn zero_is_present_and_unset_is_absent() {
        let p = Product {
            price: Some(0),
            stock: Some(0),
            title: Some("Roses".into()),
            ..Default::default()
        };
        let v = record_to_json(&record(&p, &RecordState::default()));
        assert_eq!(v["data"], json!({"title": "Roses", "price": 0, "stock": 0}), "{v:#}");
        assert_eq!(v["state"], json!({}));
        assert_eq!(v["key"]["product_id"], "sku-1");
        assert_eq!(v["updated_at"], 1_700_000_000_123_456_i64);
        assert_eq!(v["updated_at_rfc3339"], "2023-11-14T22:13:20.123456Z");
        assert!(v.get("unknown_data_fields").is_none());
    }

    #[test]
    fn images_are_an_array_and_state_is_decoded() {
        let p = Product { images: vec!["a.jpg".into(), "b.jpg".into()], ..Default::default() };
        let s = RecordState {
            hidden: Some(true),
            reasons: vec!["price_jump".into()],
            decided_by: Some("validator".into()),
            decided_at: Some(1_700_000_000_000_000),
        };
        let v = record_to_json(&record(&p, &s));
        assert_eq!(v["data"], json!({"images": ["a.jpg", "b.jpg"]}));
        assert_eq!(v["state"]["hidden"], true);
        assert_eq!(v["state"]["reasons"], json!(["price_jump"]));
        assert_eq!(v["state"]["decided_by"], "validator");
        assert_eq!(v["state"]["decided_at_rfc3339"], "2023-11-14T22:13:20.000000Z");
    }

    #[test]
    fn unknown_fields_are_listed_not_lost() {
        let mut data = Product { price: Some(100), ..Default::default() }.encode_to_vec();
        // Field 12, varint 1; field 9, length-delimited "x".
        data.extend_from_slice(&[12 << 3, 1, (9 << 3) | 2, 1, b'x']);
        let r = Record { data, ..Default::default() };
        let v = record_to_json(&r);
        assert_eq!(v["data"], json!({"price": 100}));
        assert_eq!(v["unknown_data_fields"], json!([9, 12]));
    }

    #[test]
    fn undecodable_data_is_shown_raw() {
        let r = Record { data: vec![0x0a, 0x05, b'a'], ..Default::default() };
        let v = record_to_json(&r);
        assert!(v["data"].is_null());
        assert_eq!(v["data_hex"], "0a0561");
        assert!(v["data_error"].is_string());
    }

    #[test]
    fn change_names_fields_and_kind() {
        let before =
            record(&Product { price: Some(100), ..Default::default() }, &RecordState::default());
        let after =
            record(&Product { price: Some(90), ..Default::default() }, &RecordState::default());
        let c = Change {
            key: before.key.clone(),
            before: Some(before),
            after: Some(after),
            kind: ChangeKind::Updated as i32,
            changed_data_fields: vec![product_field::PRICE, 11],
            changed_state_fields: vec![1],
            origin: Some(Origin {
                source: "flowers".into(),
                import_id: "imp-1".into(),
                published_at: 0,
            }),
            before_omitted: false,
        };
        let v = change_to_json(&c);
        assert_eq!(v["kind"], "updated");
        assert_eq!(v["changed_data_fields"], json!(["price", 11]));
        assert_eq!(v["changed_state_fields"], json!(["hidden"]));
        assert_eq!(v["before"]["data"]["price"], 100);
        assert_eq!(v["after"]["data"]["price"], 90);
        assert_eq!(v["origin"]["source"], "flowers");
        assert!(v["origin"].get("published_at_rfc3339").is_none());

        let created = Change { kind: ChangeKind::Created as i32, before: None, ..c };
        let v = change_to_json(&created);
        assert_eq!(v["kind"], "created");
        assert!(v["before"].is_null());
    }

    #[test]
    fn rejection_carries_reason_key_and_command() {
        let r = Rejection {
            command: Some(Command {
                key: Some(RecordKey::new(7, 1, "sku-9")),
                kind: CommandKind::Patch as i32,
                data: Product { stock: Some(3), ..Default::default() }.encode_to_vec(),
                clear_data_fields: vec![product_field::OLD_PRICE],
                expected_updated_at: Some(0),
                ..Default::default()
            }),
            reason: "conflict".into(),
            detail: "updated_at is 5".into(),
            ..Default::default()
        };
        let v = rejection_to_json(&r);
        assert_eq!(v["reason"], "conflict");
        assert_eq!(v["key"]["product_id"], "sku-9");
        assert_eq!(v["command"]["kind"], "patch");
        assert_eq!(v["command"]["data"], json!({"stock": 3}));
        assert_eq!(v["command"]["clear_data_fields"], json!(["old_price"]));
        assert_eq!(v["command"]["expected_updated_at"], 0);
    }
}

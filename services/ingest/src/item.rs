//! One feed item: validation with stable reasons, and its mapping to a PATCH
//! command. Pure: no I/O, no clock.
//!
//! Only the fields the partner owns are looked at; the others are ignored even
//! when present or malformed. Business rules (negative stock, price 0) are not
//! ingest's business: such items land and the validator service decides.

use prost::Message;
use serde::Deserialize;
use serde_json::value::RawValue;
use shelfsync_bus::EncodedCommand;
use shelfsync_proto::{Command, CommandKind, Origin, Product, RecordKey, Rejection, product_field};

mod fast;
mod wire;

/// Longest product id accepted, in bytes.
pub const MAX_ID_BYTES: usize = 256;
/// Most images one item may carry.
pub const MAX_IMAGES: usize = 64;
/// Longest string field (title, description, one image URL), in bytes.
pub const MAX_STRING_BYTES: usize = 64 * 1024;
/// Raw input kept in a rejection.
pub const MAX_RAW_BYTES: usize = 1024;

/// Why an item was rejected. The strings are stable: they are counted in
/// reports and published in `Rejection.reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    MissingId,
    TooLarge,
    WrongType,
    OutOfRange,
    InvalidValue,
    NotAnObject,
    MissingPlace,
    DuplicateId,
    BrandMismatch,
    /// Not valid JSON (an NDJSON line; in the nested format this is fatal).
    Malformed,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::MissingId => "missing_id",
            Reason::TooLarge => "too_large",
            Reason::WrongType => "wrong_type",
            Reason::OutOfRange => "out_of_range",
            Reason::InvalidValue => "invalid_value",
            Reason::NotAnObject => "not_an_object",
            Reason::MissingPlace => "missing_place",
            Reason::DuplicateId => "duplicate_id",
            Reason::BrandMismatch => "brand_mismatch",
            Reason::Malformed => "malformed",
        }
    }
}

/// A rejected item, with what is known of its key.
#[derive(Debug, Clone, PartialEq)]
pub struct Reject {
    pub reason: Reason,
    pub detail: String,
    pub place_id: Option<i64>,
    pub id: Option<String>,
    /// The raw item, truncated to [`MAX_RAW_BYTES`].
    pub raw: Vec<u8>,
}

impl Reject {
    pub fn new(reason: Reason, detail: impl Into<String>, raw: &[u8]) -> Self {
        let raw = raw[..raw.len().min(MAX_RAW_BYTES)].to_vec();
        Reject { reason, detail: detail.into(), place_id: None, id: None, raw }
    }
}

/// The Product fields a partner owns, as a bit set over field numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OwnedFields(u16);

impl OwnedFields {
    /// Unknown names are ignored (settings validation refuses them earlier).
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Self {
        let bits = names.iter().filter_map(|n| product_field::by_name(n.as_ref()));
        OwnedFields(bits.fold(0, |acc, f| acc | 1 << f))
    }

    /// Every Product field (numbers 1 to 8).
    pub const ALL: OwnedFields = OwnedFields(0b1_1111_1110);

    pub fn contains(self, field: u32) -> bool {
        self.0 & (1 << field) != 0
    }
}

/// A valid item: its key and the owned fields it carries.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub place_id: i64,
    pub id: String,
    /// A `Product` of only the owned fields, only those present (a `null` is
    /// absent), as the PATCH carries it: prost's encoding, byte for byte.
    pub data: Vec<u8>,
    /// Owned fields the item does not carry, in field-number order.
    pub missing: Vec<u32>,
}

impl Item {
    /// The owned fields decoded (the item carries them encoded).
    pub fn product(&self) -> Result<Product, prost::DecodeError> {
        Product::decode(self.data.as_slice())
    }
}

/// What an item is checked against.
#[derive(Debug, Clone, Copy)]
pub struct ItemRules {
    pub brand_id: i64,
    pub owned: OwnedFields,
    pub max_item_bytes: usize,
}

/// Every key the item parser looks at, borrowed unparsed from the raw item so
/// that non-owned fields cost nothing and each owned one gets its own reason.
#[derive(Deserialize)]
struct RawFields<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    brand_id: Option<&'a RawValue>,
    #[serde(borrow)]
    place_id: Option<&'a RawValue>,
    #[serde(borrow)]
    title: Option<&'a RawValue>,
    #[serde(borrow)]
    category: Option<&'a RawValue>,
    #[serde(borrow)]
    price: Option<&'a RawValue>,
    #[serde(borrow)]
    old_price: Option<&'a RawValue>,
    #[serde(borrow)]
    currency: Option<&'a RawValue>,
    #[serde(borrow)]
    stock: Option<&'a RawValue>,
    #[serde(borrow)]
    images: Option<&'a RawValue>,
    #[serde(borrow)]
    description: Option<&'a RawValue>,
}

type Invalid = (Reason, String);

/// Validates one raw item. `place_id` is the enclosing place (nested format);
/// `None` means the item carries its own `place_id` and `brand_id` (NDJSON).
///
/// A well-formed item takes the fast path; whatever that path is not sure
/// of, it leaves to the reference parser, which alone rejects.
pub fn parse_item(raw: &str, place_id: Option<i64>, rules: &ItemRules) -> Result<Item, Reject> {
    match fast::parse(raw, place_id, rules) {
        Some(item) => Ok(item),
        None => reference(raw, place_id, rules),
    }
}

/// The item that `bytes` start with (its `{` first), when it ends within
/// them and the fast path takes it: what [`parse_item`] gives for its bytes
/// in a place (`place_id` 0 here, for the caller to set), and their length.
/// `None` says nothing about the item: [`parse_item`] decides.
pub(crate) fn parse_leading(bytes: &[u8], rules: &ItemRules) -> Option<(Item, usize)> {
    fast::parse_leading(bytes, rules)
}

/// The item parser written for clarity: serde_json borrows each known key's
/// raw value, then each owned one is parsed from it. The fast path must give
/// exactly what this gives (`item/fast/tests.rs` checks it).
fn reference(raw: &str, place_id: Option<i64>, rules: &ItemRules) -> Result<Item, Reject> {
    let reject = |(reason, detail): Invalid| Reject {
        place_id,
        ..Reject::new(reason, detail, raw.as_bytes())
    };
    if raw.len() > rules.max_item_bytes {
        let detail = format!("item is {} bytes, the limit is {}", raw.len(), rules.max_item_bytes);
        return Err(reject((Reason::TooLarge, detail)));
    }
    if !raw.trim_start().starts_with('{') {
        let detail = format!("an item must be a JSON object, got {}", kind_of(raw));
        return Err(reject((Reason::NotAnObject, detail)));
    }
    let fields: RawFields = serde_json::from_str(raw)
        .map_err(|e| reject((Reason::Malformed, format!("item is not valid JSON: {e}"))))?;

    // Both parts of the key are worked out before failing, so that a
    // rejection carries as much of the key as the item had.
    let place = match place_id {
        Some(p) => Ok(p),
        None => own_place(&fields, rules.brand_id),
    };
    let id = own_id(&fields);
    let (place_id, id) = match (place, id) {
        (Ok(place_id), Ok(id)) => (place_id, id),
        (Ok(place_id), Err(e)) => {
            return Err(Reject { place_id: Some(place_id), ..reject(e) });
        }
        (Err(e), id) => {
            return Err(Reject { id: id.ok(), ..reject(e) });
        }
    };
    let mut product = Product::default();
    let mut missing = Vec::new();
    if let Err(e) = fill_product(&fields, rules.owned, &mut product, &mut missing) {
        return Err(Reject { place_id: Some(place_id), id: Some(id), ..reject(e) });
    }
    Ok(Item { place_id, id, data: product.encode_to_vec(), missing })
}

fn own_id(fields: &RawFields) -> Result<String, Invalid> {
    let Some(raw) = fields.id else {
        return Err((Reason::MissingId, "no `id`".into()));
    };
    match serde_json::from_str::<String>(raw.get()) {
        Ok(id) if id.is_empty() => Err((Reason::MissingId, "`id` is empty".into())),
        Ok(id) if id.len() > MAX_ID_BYTES => Err((
            Reason::InvalidValue,
            format!("`id` is {} bytes, the limit is {MAX_ID_BYTES}", id.len()),
        )),
        Ok(id) => Ok(id),
        Err(_) => {
            Err((Reason::MissingId, format!("`id` must be a string, got {}", kind_of(raw.get()))))
        }
    }
}

/// The place of an NDJSON line, after checking its brand (when it has one:
/// the partner's configured brand is authoritative).
fn own_place(fields: &RawFields, brand_id: i64) -> Result<i64, Invalid> {
    if let Some(brand) = fields.brand_id {
        let brand = int("brand_id", brand)?;
        if brand != brand_id {
            let detail = format!("brand_id {brand}, the partner's brand is {brand_id}");
            return Err((Reason::BrandMismatch, detail));
        }
    }
    match fields.place_id {
        Some(p) => int("place_id", p),
        None => Err((Reason::MissingPlace, "no `place_id`".into())),
    }
}

impl<'a> RawFields<'a> {
    /// The raw value of `Product` field `number`.
    fn product_field(&self, number: u32) -> Option<&'a RawValue> {
        use product_field as pf;
        match number {
            pf::TITLE => self.title,
            pf::CATEGORY => self.category,
            pf::PRICE => self.price,
            pf::OLD_PRICE => self.old_price,
            pf::CURRENCY => self.currency,
            pf::STOCK => self.stock,
            pf::IMAGES => self.images,
            _ => self.description,
        }
    }
}

fn fill_product(
    f: &RawFields,
    owned: OwnedFields,
    p: &mut Product,
    missing: &mut Vec<u32>,
) -> Result<(), Invalid> {
    use product_field as pf;
    for (number, name) in (1..).zip(product_field::NAMES) {
        if !owned.contains(number) {
            continue;
        }
        let Some(raw) = f.product_field(number) else {
            missing.push(number);
            continue;
        };
        match number {
            pf::TITLE => p.title = Some(string(name, raw)?),
            pf::CATEGORY => p.category = Some(string(name, raw)?),
            pf::PRICE => p.price = Some(int(name, raw)?),
            pf::OLD_PRICE => p.old_price = Some(int(name, raw)?),
            pf::CURRENCY => p.currency = Some(string(name, raw)?),
            pf::STOCK => p.stock = Some(int(name, raw)?),
            pf::IMAGES => p.images = strings(name, raw)?,
            _ => p.description = Some(string(name, raw)?),
        }
    }
    Ok(())
}

/// A JSON integer in i64. A float (even `2.0`) is the wrong type: prices and
/// stock are integers in minor units, and guessing a rounding would be worse.
pub(crate) fn int(name: &str, raw: &RawValue) -> Result<i64, Invalid> {
    let text = raw.get();
    if let Ok(n) = text.parse::<i64>() {
        return Ok(n);
    }
    let wrong =
        || (Reason::WrongType, format!("`{name}` must be an integer, got {}", kind_of(text)));
    let out_of_range =
        || (Reason::OutOfRange, format!("`{name}` = {} does not fit in 64 bits", clip(text)));
    if !text.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
        return Err(wrong());
    }
    if text.contains(['.', 'e', 'E']) {
        return match text.parse::<f64>() {
            Ok(x) if x.fract() == 0.0 && (x >= i64::MAX as f64 || x < i64::MIN as f64) => {
                Err(out_of_range())
            }
            _ => Err(wrong()),
        };
    }
    Err(out_of_range())
}

fn string(name: &str, raw: &RawValue) -> Result<String, Invalid> {
    let s: String = serde_json::from_str(raw.get()).map_err(|_| {
        (Reason::WrongType, format!("`{name}` must be a string, got {}", kind_of(raw.get())))
    })?;
    if s.len() > MAX_STRING_BYTES {
        let detail = format!("`{name}` is {} bytes, the limit is {MAX_STRING_BYTES}", s.len());
        return Err((Reason::InvalidValue, detail));
    }
    Ok(s)
}

fn strings(name: &str, raw: &RawValue) -> Result<Vec<String>, Invalid> {
    let wrong = || (Reason::WrongType, format!("`{name}` must be an array of strings"));
    let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| wrong())?;
    if items.len() > MAX_IMAGES {
        let detail = format!("{} `{name}`, the limit is {MAX_IMAGES}", items.len());
        return Err((Reason::InvalidValue, detail));
    }
    items
        .into_iter()
        .map(|v| string(name, v).map_err(|e| if e.0 == Reason::WrongType { wrong() } else { e }))
        .collect()
}

/// The JSON type of a raw value, for error details.
fn kind_of(text: &str) -> &'static str {
    match text.trim_start().bytes().next() {
        Some(b'"') => "a string",
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        Some(b'-' | b'0'..=b'9') if text.contains(['.', 'e', 'E']) => "a float",
        Some(b'-' | b'0'..=b'9') => "an integer",
        _ => "something that is not JSON",
    }
}

fn clip(text: &str) -> &str {
    text.get(..40).unwrap_or(text)
}

/// What a command needs beyond the item.
#[derive(Debug, Clone)]
pub struct CommandContext {
    pub brand_id: i64,
    /// Import start (µs) for a full import, 0 for a delta.
    pub generation: i64,
    pub clear_missing: bool,
    pub source: String,
    pub import_id: String,
}

impl CommandContext {
    pub fn origin(&self, published_at: i64) -> Option<Origin> {
        let (source, import_id) = (self.source.clone(), self.import_id.clone());
        Some(Origin { source, import_id, published_at })
    }
}

/// One item, one PATCH: the owned fields it carries, and (with
/// `clear_missing`) the owned fields it no longer carries. Its origin is its
/// batch's ([`CommandContext::origin`], set once per message when it is published).
pub fn to_command(item: Item, ctx: &CommandContext) -> Command {
    Command {
        key: Some(RecordKey::new(ctx.brand_id, item.place_id, item.id)),
        kind: CommandKind::Patch as i32,
        data: item.data,
        clear_data_fields: if ctx.clear_missing { item.missing } else { Vec::new() },
        generation: ctx.generation,
        ..Default::default()
    }
}

/// [`to_command`] in its wire bytes, written straight from the item: what
/// `to_command(item, ctx).encode_to_vec()` gives, without the `Command`.
pub fn to_encoded_command(item: &Item, ctx: &CommandContext) -> EncodedCommand {
    // `RecordKey` and `Command` fields. proto3 writes no zero, no empty
    // string or bytes, no empty packed list; a message it writes even empty.
    let (brand_id, place_id, id) = (ctx.brand_id, item.place_id, item.id.as_bytes());
    let key_len = if brand_id != 0 { wire::int_len(1, brand_id) } else { 0 }
        + if place_id != 0 { wire::int_len(2, place_id) } else { 0 }
        + if id.is_empty() { 0 } else { wire::bytes_len(3, id.len()) };
    let kind = i64::from(CommandKind::Patch as i32);
    let clear: &[u32] = if ctx.clear_missing { &item.missing } else { &[] };
    let clear_len: usize = clear.iter().map(|&f| wire::varint_len(u64::from(f))).sum();
    let len = wire::bytes_len(1, key_len)
        + if kind != 0 { wire::int_len(2, kind) } else { 0 }
        + if item.data.is_empty() { 0 } else { wire::bytes_len(3, item.data.len()) }
        + if clear.is_empty() { 0 } else { wire::bytes_len(5, clear_len) }
        + if ctx.generation != 0 { wire::int_len(8, ctx.generation) } else { 0 };
    let mut buf = Vec::with_capacity(len);
    wire::len(&mut buf, 1, key_len);
    if brand_id != 0 {
        wire::int(&mut buf, 1, brand_id);
    }
    if place_id != 0 {
        wire::int(&mut buf, 2, place_id);
    }
    if !id.is_empty() {
        wire::bytes(&mut buf, 3, id);
    }
    if kind != 0 {
        wire::int(&mut buf, 2, kind);
    }
    if !item.data.is_empty() {
        wire::bytes(&mut buf, 3, &item.data);
    }
    if !clear.is_empty() {
        wire::len(&mut buf, 5, clear_len);
        for &field in clear {
            wire::varint(&mut buf, u64::from(field));
        }
    }
    if ctx.generation != 0 {
        wire::int(&mut buf, 8, ctx.generation);
    }
    EncodedCommand { brand_id, place_id, bytes: buf }
}

/// A rejected item as published on the rejects subject; the key only when
/// both its place and its id are known.
pub fn to_rejection(r: Reject, ctx: &CommandContext, published_at: i64) -> Rejection {
    let key = match (r.place_id, r.id) {
        (Some(place_id), Some(id)) => Some(RecordKey::new(ctx.brand_id, place_id, id)),
        _ => None,
    };
    let (reason, detail, raw) = (r.reason.as_str().into(), r.detail, r.raw);
    Rejection { reason, detail, key, raw, origin: ctx.origin(published_at), ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(owned: OwnedFields) -> ItemRules {
        ItemRules { brand_id: 7, owned, max_item_bytes: 1 << 20 }
    }

    fn context(clear_missing: bool) -> CommandContext {
        let (source, import_id) = ("p".into(), "p-5".into());
        CommandContext { brand_id: 7, generation: 5, clear_missing, source, import_id }
    }

    #[test]
    fn an_item_maps_to_one_patch_where_zero_is_a_value() {
        let raw = r#"{"id":"sku-1","title":"Roses","category":"roses","price":0,"old_price":399000,
            "currency":"RUB","stock":0,"images":["a.jpg","b.jpg"],"description":"d","extra":{"x":[1]}}"#;
        let item = parse_item(raw, Some(42), &rules(OwnedFields::ALL)).expect("valid");
        assert!(item.missing.is_empty());
        let cmd = to_command(item, &context(true));
        assert_eq!((cmd.kind, cmd.generation), (CommandKind::Patch as i32, 5));
        assert_eq!(cmd.key, Some(RecordKey::new(7, 42, "sku-1")));
        let p = Product::decode(cmd.data.as_slice()).expect("decodes");
        assert_eq!((p.price, p.stock), (Some(0), Some(0)), "0 is present on the wire");
        assert_eq!((p.title.as_deref(), p.old_price), (Some("Roses"), Some(399000)));
        assert_eq!(p.images, vec!["a.jpg", "b.jpg"]);
        // Business rules are the validator's business: these land.
        let odd =
            parse_item(r#"{"id":"a","price":-5,"stock":-1}"#, Some(1), &rules(OwnedFields::ALL));
        assert_eq!(odd.expect("lands").product().expect("decodes").stock, Some(-1));
    }

    #[test]
    fn only_owned_fields_are_kept_and_missing_owned_ones_cleared() {
        let owned = OwnedFields::from_names(&["price", "old_price", "stock"]);
        // `title` is not owned: ignored even though it has the wrong type.
        let raw = r#"{"id":"a","price":100,"title":42,"currency":"RUB","stock":null}"#;
        let item = parse_item(raw, Some(1), &rules(owned)).expect("valid");
        assert_eq!(item.product(), Ok(Product { price: Some(100), ..Default::default() }));
        assert_eq!(item.missing, vec![product_field::OLD_PRICE, product_field::STOCK]);
        assert!(to_command(item.clone(), &context(false)).clear_data_fields.is_empty());
        assert_eq!(to_command(item, &context(true)).clear_data_fields, vec![4, 6]);
        assert_eq!(OwnedFields::from_names(&product_field::NAMES), OwnedFields::ALL);
    }

    /// The command's bytes written from the item are `to_command`'s, zeros
    /// and empties included.
    #[test]
    fn an_encoded_command_is_the_command_encoded() {
        let items = [
            (r#"{"id":"sku-1","title":"Roses","price":0,"images":["a.jpg"]}"#, 42),
            (r#"{"id":"a","price":-5,"stock":-1}"#, -3),
            (r#"{"id":"a"}"#, 0),
            (&*format!(r#"{{"id":"{}","description":"{}"}}"#, "i".repeat(200), "d".repeat(300)), 1),
        ];
        for (raw, place) in items {
            for owned in [OwnedFields::ALL, OwnedFields::from_names(&["price"]), OwnedFields(0)] {
                let item = parse_item(raw, Some(place), &rules(owned)).expect("valid");
                for (brand_id, generation, clear_missing) in
                    [(7, 5, true), (0, 0, false), (-1, i64::MIN, true), (i64::MAX, 1, false)]
                {
                    let ctx =
                        CommandContext { brand_id, generation, clear_missing, ..context(true) };
                    let encoded = to_encoded_command(&item, &ctx);
                    assert_eq!((encoded.brand_id, encoded.place_id), (brand_id, place));
                    let expected = to_command(item.clone(), &ctx).encode_to_vec();
                    assert_eq!(encoded.bytes, expected, "{raw:.60} {ctx:?}");
                    assert_eq!(encoded.bytes.capacity(), expected.len());
                }
            }
        }
    }

    #[test]
    fn rejections_have_stable_reasons() {
        use Reason::*;
        let long_id = format!(r#"{{"id":"{}"}}"#, "x".repeat(MAX_ID_BYTES + 1));
        let images = format!(r#"{{"id":"a","images":[{}]}}"#, vec!["\"i\""; 65].join(","));
        let long_text = format!(r#"{{"id":"a","title":"{}"}}"#, "t".repeat(MAX_STRING_BYTES + 1));
        let cases: &[(&str, Option<i64>, Reason)] = &[
            (r#"{"title":"x"}"#, Some(1), MissingId),
            (r#"{"id":""}"#, Some(1), MissingId),
            (r#"{"id":12}"#, Some(1), MissingId),
            (r#"{"id":null}"#, Some(1), MissingId),
            (r#"{"id":"a","price":"12"}"#, Some(1), WrongType),
            (r#"{"id":"a","price":1.5}"#, Some(1), WrongType),
            (r#"{"id":"a","stock":true}"#, Some(1), WrongType),
            (r#"{"id":"a","images":"x.jpg"}"#, Some(1), WrongType),
            (r#"{"id":"a","images":[1]}"#, Some(1), WrongType),
            (r#"{"id":"a","title":["t"]}"#, Some(1), WrongType),
            (r#"{"id":"a","price":99999999999999999999}"#, Some(1), OutOfRange),
            (r#"{"id":"a","price":-1e30}"#, Some(1), OutOfRange),
            (&long_id, Some(1), InvalidValue),
            (&images, Some(1), InvalidValue),
            (&long_text, Some(1), InvalidValue),
            ("[1,2]", Some(1), NotAnObject),
            ("\"sku\"", Some(1), NotAnObject),
            (r#"{"id":"a","id":"b"}"#, Some(1), Malformed),
            // NDJSON: the item carries its own brand and place.
            (r#"{"id":"a","brand_id":8,"place_id":9}"#, None, BrandMismatch),
            (r#"{"id":"a","brand_id":7}"#, None, MissingPlace),
            (r#"{"id":"a","place_id":"9"}"#, None, WrongType),
        ];
        for (raw, place, reason) in cases {
            let rejected = parse_item(raw, *place, &rules(OwnedFields::ALL)).expect_err(raw);
            assert_eq!(rejected.reason, *reason, "{raw:.80}: {}", rejected.detail);
            assert!(rejected.raw.len() <= MAX_RAW_BYTES);
        }
        let small = ItemRules { max_item_bytes: 20, ..rules(OwnedFields::ALL) };
        let rejected = parse_item(r#"{"id":"a","title":"a long title"}"#, Some(1), &small);
        assert_eq!(rejected.expect_err("too large").reason, TooLarge);
    }

    #[test]
    fn a_rejection_names_the_field_and_keeps_the_key() {
        let all = rules(OwnedFields::ALL);
        let r = parse_item(r#"{"id":"a","price":"12"}"#, Some(3), &all).expect_err("bad");
        assert!(r.detail.contains("`price`"), "{}", r.detail);
        assert_eq!((r.place_id, r.id.as_deref()), (Some(3), Some("a")));
        let item = parse_item(r#"{"id":"a","brand_id":7,"place_id":9}"#, None, &all);
        assert_eq!(item.expect("valid NDJSON item").place_id, 9);
    }
}

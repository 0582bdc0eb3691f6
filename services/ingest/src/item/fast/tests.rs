//! The fast path against the reference parser. For every item, under every
//! owned-field set, both layouts and item limits around its size,
//! `parse_item` gives exactly what the reference gives (accepted: key, wire
//! bytes, missing fields; rejected: the same `Reject`), and whatever the fast
//! path accepts the reference accepts alike. The fast path must also take
//! the well-formed items: one that always gave up would pass the rest.

use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::super::{
    Item, ItemRules, MAX_ID_BYTES, MAX_IMAGES, MAX_STRING_BYTES, OwnedFields, parse_item, reference,
};

const BRAND: i64 = 7;

/// The owned-field sets every item is read with.
fn owned_sets() -> Vec<OwnedFields> {
    [
        &["title", "category", "price", "old_price", "currency", "stock", "images", "description"]
            as &[&str],
        &["price", "old_price"],
        &["stock"],
        &["images"],
        &["title", "description", "currency"],
        &[],
    ]
    .iter()
    .map(|names| OwnedFields::from_names(names))
    .collect()
}

/// `raw` read by both parsers with `rules`; returns whether the fast path
/// took it.
fn same(raw: &str, place: Option<i64>, rules: &ItemRules) -> Result<bool, TestCaseError> {
    let expected = reference(raw, place, rules);
    let fast = super::parse(raw, place, rules);
    if let Some(item) = &fast {
        prop_assert_eq!(
            Ok(item),
            expected.as_ref(),
            "fast path: {:?} {:?} {:?}",
            raw,
            place,
            rules
        );
    }
    prop_assert_eq!(parse_item(raw, place, rules), expected, "{:?} {:?} {:?}", raw, place, rules);
    if let Some(place) = place {
        leading(raw, place, rules, fast.as_ref())?;
    }
    Ok(fast.is_some())
}

/// `raw` followed by more of a document, read by the fast path from its
/// start as the feed's cutter reads it: what it takes is the reference's
/// item for the bytes it says the item has, and it takes `raw` whole
/// exactly when `parse` takes it as one item from its first byte to its last.
fn leading(
    raw: &str,
    place: i64,
    rules: &ItemRules,
    fast: Option<&Item>,
) -> Result<(), TestCaseError> {
    let mut bytes = raw.as_bytes().to_vec();
    bytes.extend_from_slice(b" ,{\"id\": \"z\"}]}\n\xff");
    let taken = super::parse_leading(&bytes, rules).map(|(mut item, len)| {
        item.place_id = place;
        (item, len)
    });
    if let Some((item, len)) = &taken {
        let expected =
            std::str::from_utf8(&bytes[..*len]).map(|raw| reference(raw, Some(place), rules));
        prop_assert_eq!(Ok(Ok(item)), expected.as_ref().map(Result::as_ref), "leading: {:?}", raw);
    }
    // `raw` is the item `parse` took with nothing around it, or the one
    // taken here.
    let alone = fast.is_some() && raw.starts_with('{') && raw.ends_with('}');
    if alone || taken.as_ref().is_some_and(|(_, len)| *len == raw.len()) {
        prop_assert_eq!(taken, fast.cloned().map(|item| (item, raw.len())), "leading: {:?}", raw);
    }
    Ok(())
}

/// `raw` under every owned set, both layouts, and limits around its size.
/// Returns whether the fast path took it with every field owned, nested.
fn check(raw: &str) -> Result<bool, TestCaseError> {
    let mut taken = false;
    for (n, owned) in owned_sets().into_iter().enumerate() {
        for place in [Some(3), None] {
            let len = raw.len();
            for max_item_bytes in [1 << 20, len + 1, len, len.saturating_sub(1)] {
                let rules = ItemRules { brand_id: BRAND, owned, max_item_bytes };
                let fast = same(raw, place, &rules)?;
                if n == 0 && place.is_some() && max_item_bytes == 1 << 20 {
                    taken = fast;
                }
            }
        }
    }
    Ok(taken)
}

fn check_all(items: &[&str], must_take: bool) {
    for raw in items {
        let taken = check(raw).unwrap_or_else(|e| panic!("{e}"));
        if must_take {
            assert!(taken, "the fast path gave up on {raw:.200}");
        }
    }
}

#[test]
fn well_formed_items_take_the_fast_path_with_the_same_result() {
    let items = [
        r#"{"id":"sku-1","title":"Roses","category":"roses","price":0,"old_price":399000,"currency":"RUB","stock":0,"images":["a.jpg","b.jpg"],"description":"d","extra":{"x":[1]}}"#,
        r#"{"id":"a"}"#,
        r#"{"id":"a","brand_id":7,"place_id":9}"#,
        r#"{"place_id":9,"id":"a"}"#,
        r#"{"id":"a","price":-5,"stock":-1}"#,
        r#"{"id":"a","price":-0,"old_price":9223372036854775807,"stock":-9223372036854775808}"#,
        r#"{"description":"z","images":["i"],"stock":1,"currency":"EUR","old_price":2,"price":3,"category":"c","title":"t","id":"a"}"#,
        " \t\r\n{ \"id\" : \"a\" , \"price\" :\n1 ,\"images\" : [ \"x\" , \"y\" ] } \n\r\t ",
        r#"{"id":"a","title":"","images":[],"description":""}"#,
        r#"{"id":"a","title":null,"price":null,"images":null,"brand_id":null}"#,
        r#"{"id":"é日本🌹","title":"Розы — 🌹","category":"\u00e9"}"#,
        r#"{"id":"a\"b","title":"line\nbreak \"quoted\" back\\slash \/ \b\f\r\t","description":"\u00e9\u65e5\ud83c\udf39\u0000"}"#,
        r#"{"id":"\u0061","images":["\ud83c\udf39","a\\b"]}"#,
        r#"{"id":"a","x":{"y":[1,2.5,-3e-2,1E+9,true,false,null,"}{][\"",{}],"z":{"w":[]}},"y":[[[]]],"z":"\ud800"}"#,
        r#"{"id":"a","x":1,"x":2,"y":null,"y":"[}"}"#,
        r#"{"id":"a","":3,"ID":4,"id ":5,"titlé":6,"place":7}"#,
        r#"{"id":"a","brand_id":"x","place_id":"y"}"#, // ignored when nested
    ];
    check_all(&items, true);
}

#[test]
fn doubtful_items_read_alike() {
    let long = |n: usize| "x".repeat(n);
    let owned: Vec<String> = vec![
        // Keys with escapes, duplicates of known keys (even after `null`).
        r#"{"\u0069d":"a"}"#.into(),
        r#"{"id":"a","\u0070rice":"x"}"#.into(),
        r#"{"id":"a","\u0000x":1}"#.into(),
        r#"{"id":"a","id":"b"}"#.into(),
        r#"{"id":"a","price":null,"price":1}"#.into(),
        r#"{"id":"a","brand_id":7,"brand_id":7}"#.into(),
        r#"{"id":"a","images":[],"images":[]}"#.into(),
        // Ids.
        r#"{"title":"x"}"#.into(),
        r#"{"id":""}"#.into(),
        r#"{"id":12}"#.into(),
        r#"{"id":null}"#.into(),
        r#"{"id":["a"]}"#.into(),
        r#"{"id":"\ud800"}"#.into(),
        r#"{"id":"\udc00x"}"#.into(),
        r#"{"id":"\ud83c\u0041"}"#.into(),
        r#"{"id":"\ud83c\n"}"#.into(),
        r#"{"id":"\ud83c"}"#.into(),
        r#"{"id":"\ud83c\ud83c"}"#.into(),
        r#"{"id":"\uD83C\uDF39"}"#.into(),
        r#"{"id":"\u12G4"}"#.into(),
        r#"{"id":"\x"}"#.into(),
        r#"{"id":"\u00"}"#.into(),
        "{\"id\":\"a\u{1}\"}".into(),
        "{\"id\":\"a\u{7f}\"}".into(),
        "{\"id\":\"a\tb\"}".into(),
        // Numbers.
        r#"{"id":"a","price":01}"#.into(),
        r#"{"id":"a","price":-01}"#.into(),
        r#"{"id":"a","price":1.0}"#.into(),
        r#"{"id":"a","price":1.}"#.into(),
        r#"{"id":"a","price":.5}"#.into(),
        r#"{"id":"a","price":1e3}"#.into(),
        r#"{"id":"a","price":1E+3}"#.into(),
        r#"{"id":"a","price":1e}"#.into(),
        r#"{"id":"a","price":-}"#.into(),
        r#"{"id":"a","price":+1}"#.into(),
        r#"{"id":"a","price":--1}"#.into(),
        r#"{"id":"a","price":9223372036854775808}"#.into(),
        r#"{"id":"a","price":-9223372036854775809}"#.into(),
        r#"{"id":"a","price":99999999999999999999}"#.into(),
        r#"{"id":"a","price":-1e30}"#.into(),
        r#"{"id":"a","price":1e400}"#.into(),
        r#"{"id":"a","price":0x10}"#.into(),
        r#"{"id":"a","price":"12"}"#.into(),
        r#"{"id":"a","stock":true}"#.into(),
        r#"{"id":"a","x":01}"#.into(),
        r#"{"id":"a","x":1.}"#.into(),
        r#"{"id":"a","x":-}"#.into(),
        r#"{"id":"a","x":1e400}"#.into(),
        // Strings and arrays of the wrong type.
        r#"{"id":"a","images":"x.jpg"}"#.into(),
        r#"{"id":"a","images":[1]}"#.into(),
        r#"{"id":"a","images":[1,"x",null]}"#.into(),
        r#"{"id":"a","title":42,"category":[1],"currency":{}}"#.into(),
        r#"{"id":"a","images":[["x"]]}"#.into(),
        r#"{"id":"a","images":["x",]}"#.into(),
        r#"{"id":"a","images":["\ud800"]}"#.into(),
        r#"{"id":"a","title":["t"]}"#.into(),
        r#"{"id":"a","title":"\ud800"}"#.into(),
        r#"{"id":"a","title":tru}"#.into(),
        r#"{"id":"a","title":nul}"#.into(),
        r#"{"id":"a","title":True}"#.into(),
        r#"{"id":"a","title":nope}"#.into(),
        r#"{"id":"a","price":nil }"#.into(),
        r#"{"id":"a","images":nUll,"x":1}"#.into(),
        r#"{"id":"a","x":nope}"#.into(),
        r#"{"id":"a","x":[trUe]}"#.into(),
        // NDJSON keys.
        r#"{"id":"a","brand_id":8,"place_id":9}"#.into(),
        r#"{"id":"a","brand_id":7}"#.into(),
        r#"{"id":"a","place_id":"9"}"#.into(),
        r#"{"id":"a","place_id":9.0}"#.into(),
        r#"{"id":"a","place_id":null}"#.into(),
        r#"{"id":"a","brand_id":7.0,"place_id":9}"#.into(),
        r#"{"id":"a","brand_id":-7,"place_id":9}"#.into(),
        // Not one object, or broken.
        "".into(),
        " ".into(),
        "[1,2]".into(),
        "\"sku\"".into(),
        "null".into(),
        "{".into(),
        "{}".into(),
        "{ }".into(),
        r#"{"id":"a""#.into(),
        r#"{"id":"a"}}"#.into(),
        r#"{"id":"a"} x"#.into(),
        r#"{"id":"a"},"#.into(),
        r#"{"id":"a"}{}"#.into(),
        r#"{"id":"a",}"#.into(),
        r#"{"id":"a",,"x":1}"#.into(),
        r#"{"id" "a"}"#.into(),
        r#"{"id":}"#.into(),
        r#"{id:"a"}"#.into(),
        r#"{'id':'a'}"#.into(),
        r#"{"id":"a","x":[1,]}"#.into(),
        r#"{"id":"a","x":{"y"}}"#.into(),
        r#"{"id":"a","x":{"y":1,}}"#.into(),
        r#"{"id":"a","x":{1:2}}"#.into(),
        r#"{"id":"a","x":[}"#.into(),
        r#"{"id":"a","x":{]}"#.into(),
        r#"{"id":"a","x":"\q"}"#.into(),
        "{\"id\":\"a\",\"x\":\"\u{1f}\"}".into(),
        "\u{a0}{\"id\":\"a\"}".into(),
        "{\"id\":\"a\"}\u{a0}".into(),
        "{\"id\":\"a\"\u{c}}".into(),
        "\u{feff}{\"id\":\"a\"}".into(),
        // Nesting in unknown fields, at and past what the fast path follows.
        format!(r#"{{"id":"a","x":{}1{}}}"#, "[".repeat(63), "]".repeat(63)),
        format!(r#"{{"id":"a","x":{}1{}}}"#, "[".repeat(64), "]".repeat(64)),
        format!(r#"{{"id":"a","x":{}1{}}}"#, "[".repeat(65), "]".repeat(65)),
        format!(r#"{{"id":"a","x":{}1{}}}"#, "[".repeat(500), "]".repeat(500)),
        format!(r#"{{"id":"a","x":{}1{}}}"#, r#"{"k":"#.repeat(70), "}".repeat(70)),
        format!(r#"{{"id":"a","title":{}1{}}}"#, "[".repeat(200), "]".repeat(200)),
        format!(r#"{{"id":"a","x":{}1{}}}"#, "[".repeat(70), "]".repeat(69)),
        // An object closed by `]` under deep arrays.
        format!(r#"{{"id":"a","x":{{"y":{}1{}]}}"#, "[".repeat(70), "]".repeat(70)),
        format!(r#"{{"id":"a","x":{{"y":{}1{}]}}"#, "[".repeat(62), "]".repeat(62)),
        // Sizes at and around the limits.
        format!(r#"{{"id":"{}"}}"#, long(MAX_ID_BYTES - 1)),
        format!(r#"{{"id":"{}"}}"#, long(MAX_ID_BYTES)),
        format!(r#"{{"id":"{}"}}"#, long(MAX_ID_BYTES + 1)),
        format!(r#"{{"id":"{}"}}"#, "é".repeat(MAX_ID_BYTES / 2)),
        format!(r#"{{"id":"{}x"}}"#, "é".repeat(MAX_ID_BYTES / 2)),
        format!(r#"{{"id":"{}"}}"#, r"\u00e9".repeat(MAX_ID_BYTES / 2)),
        format!(r#"{{"id":"{}x"}}"#, r"\u00e9".repeat(MAX_ID_BYTES / 2)),
        format!(r#"{{"id":"{}"}}"#, r"\n".repeat(MAX_ID_BYTES)),
        format!(r#"{{"id":"a","title":"{}"}}"#, long(MAX_STRING_BYTES)),
        format!(r#"{{"id":"a","title":"{}"}}"#, long(MAX_STRING_BYTES + 1)),
        format!(r#"{{"id":"a","title":"{}\n"}}"#, long(MAX_STRING_BYTES - 1)),
        format!(r#"{{"id":"a","title":"{}\n"}}"#, long(MAX_STRING_BYTES)),
        format!(r#"{{"id":"a","description":"{}"}}"#, "日".repeat(MAX_STRING_BYTES / 3 + 1)),
        format!(r#"{{"id":"a","images":["{}"]}}"#, long(MAX_STRING_BYTES)),
        format!(r#"{{"id":"a","images":["{}"]}}"#, long(MAX_STRING_BYTES + 1)),
        format!(r#"{{"id":"a","images":[{}]}}"#, vec!["\"i\""; MAX_IMAGES].join(",")),
        format!(r#"{{"id":"a","images":[{}]}}"#, vec!["\"i\""; MAX_IMAGES + 1].join(",")),
        format!(r#"{{"id":"a","images":[{}]}}"#, vec!["1"; MAX_IMAGES + 1].join(",")),
        format!(r#"{{"id":"a","images":[{}]}}"#, vec!["\"\\u00e9\""; MAX_IMAGES].join(" , ")),
        format!(r#"{{"id":"a","title":"{}"}}"#, long(200)), // 128+ bytes: a 2-byte length
        format!(r#"{{"id":"a","title":"{}"}}"#, long(20_000)), // a 3-byte length
    ];
    let items: Vec<&str> = owned.iter().map(String::as_str).collect();
    check_all(&items, false);
    // Every item cut short, at every byte.
    let whole = r#"{"id":"sku-1","title":"R\u00e9 \"x\"","price":-12,"images":["a", "b"],"x":{"y":[1.5e3,null,true]},"brand_id":7,"place_id":9}"#;
    let cuts: Vec<&str> = (0..whole.len()).filter_map(|n| whole.get(..n)).collect();
    check_all(&cuts, false);
}

// The generated corpus: items built from a model of known and unknown keys
// with good and bad values, then written with random whitespace, and some
// of them broken as text.

/// A JSON value, its leaves already written (as they would be, or broken).
#[derive(Debug, Clone)]
enum Json {
    Leaf(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    fn write(&self, out: &mut String, ws: &mut impl Iterator<Item = &'static str>) {
        match self {
            Json::Leaf(text) => out.push_str(text),
            Json::Array(items) => {
                out.push('[');
                for (n, item) in items.iter().enumerate() {
                    if n > 0 {
                        out.push(',');
                    }
                    out.push_str(ws.next().unwrap_or_default());
                    item.write(out, ws);
                    out.push_str(ws.next().unwrap_or_default());
                }
                out.push(']');
            }
            Json::Object(entries) => write_object(entries, out, ws),
        }
    }
}

fn write_object(
    entries: &[(String, Json)],
    out: &mut String,
    ws: &mut impl Iterator<Item = &'static str>,
) {
    out.push('{');
    for (n, (key, value)) in entries.iter().enumerate() {
        if n > 0 {
            out.push(',');
        }
        out.push_str(ws.next().unwrap_or_default());
        out.push_str(key);
        out.push_str(ws.next().unwrap_or_default());
        out.push(':');
        out.push_str(ws.next().unwrap_or_default());
        value.write(out, ws);
        out.push_str(ws.next().unwrap_or_default());
    }
    out.push('}');
}

fn whitespace() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        40 => Just(""),
        8 => Just(" "),
        4 => Just("\n"),
        4 => Just("\t"),
        4 => Just("\r\n  "),
    ]
}

/// A piece of a string's text, as written between the quotes.
fn fragment() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        40 => prop::sample::select(vec![
            "a", "sku-1", "Roses", "RUB", "https://cdn.example/7/1/1-0.jpg", " ", "0", "é", "日本",
            "🌹", "Розы", "{", "}", "[", "]", ":", ",", "\u{7f}", "\u{a0}",
        ]),
        10 => prop::sample::select(vec![
            r"\n", r#"\""#, r"\\", r"\/", r"\b", r"\f", r"\r", r"\t", r"\u00e9", r"\u0000",
            r"\u65E5", r"\ud83c\udf39", r"\uD83C\uDF39", r"\u001f", r"\u0041",
        ]),
        1 => prop::sample::select(vec![
            r"\ud83c", r"\udf39", r"\ud83cx", r"\ud83c\u0041", r"\ud83c\n", r"\ud83c\ud83c",
            r"\u12G4", r"\u00", r"\x", r"\'", "\u{1}", "\t", "\n", "\"", "\\",
        ]),
    ]
}

fn string() -> impl Strategy<Value = String> {
    prop::collection::vec(fragment(), 0..6).prop_map(|parts| format!("\"{}\"", parts.concat()))
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => any::<i64>().prop_map(|n| n.to_string()),
        6 => (0i64..1_000_000).prop_map(|n| n.to_string()),
        2 => prop::sample::select(vec![
            "0", "-0", "01", "-01", "1.0", "1.", ".5", "1e3", "1E+3", "1e-3", "1e", "-", "+1", "--1",
            "9223372036854775807", "9223372036854775808", "-9223372036854775808",
            "-9223372036854775809", "99999999999999999999", "1e400", "-1e30", "0.0", "00", "2.5",
        ])
        .prop_map(String::from),
    ]
}

fn leaf() -> impl Strategy<Value = Json> {
    prop_oneof![
        4 => string(),
        3 => number(),
        6 => prop::sample::select(vec!["true", "false", "null"]).prop_map(String::from),
        1 => prop::sample::select(vec!["nul", "True", "tru", "nulls", "nope", "nil ", "fals"]).prop_map(String::from),
    ]
    .prop_map(Json::Leaf)
}

fn value() -> impl Strategy<Value = Json> {
    leaf().prop_recursive(4, 24, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Json::Array),
            prop::collection::vec((key(), inner), 0..4).prop_map(Json::Object),
        ]
    })
}

/// A key of a nested object: known names too.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => prop::sample::select(KNOWN.to_vec()).prop_map(|k| format!("\"{k}\"")),
        1 => unknown_key(),
    ]
}

/// A key the item parser does not know, or does not know without unescaping it.
fn unknown_key() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(vec!["x", "extra", "ID", "id ", "", "titlé", "place", "日本"])
            .prop_map(|k| format!("\"{k}\"")),
        1 => prop::sample::select(vec![r"\u0069d", r"\u0078", r#"a\"b"#, r"\n", "\u{1}"])
            .prop_map(|k| format!("\"{k}\"")),
        1 => string(),
    ]
}

const KNOWN: [&str; 11] = [
    "id",
    "title",
    "category",
    "price",
    "old_price",
    "currency",
    "stock",
    "images",
    "description",
    "brand_id",
    "place_id",
];

/// A good value for a known key, most of the time.
fn good(key: &'static str) -> BoxedStrategy<Json> {
    let text = || {
        prop::collection::vec(
            prop_oneof![20 => prop::sample::select(vec!["a", "Rose", "é", "🌹", " "]), 1 => fragment()],
            1..6,
        )
        .prop_map(|parts| format!("\"{}\"", parts.concat()))
    };
    let good = match key {
        "price" | "old_price" | "stock" => {
            prop_oneof![20 => any::<i64>().prop_map(|n| n.to_string()), 1 => number()]
                .prop_map(Json::Leaf)
                .boxed()
        }
        "brand_id" => {
            prop_oneof![20 => Just("7".to_string()), 1 => number()].prop_map(Json::Leaf).boxed()
        }
        "place_id" => prop_oneof![20 => (1i64..100).prop_map(|n| n.to_string()), 1 => number()]
            .prop_map(Json::Leaf)
            .boxed(),
        "images" => {
            let image = prop_oneof![40 => text().prop_map(Json::Leaf), 1 => leaf()];
            let few = prop::collection::vec(image.clone(), 0..4);
            // Around the limit on their count.
            let many = prop::collection::vec(image, 60..70);
            prop_oneof![20 => few, 1 => many].prop_map(Json::Array).boxed()
        }
        _ => text().prop_map(Json::Leaf).boxed(),
    };
    prop_oneof![
        40 => good,
        2 => Just(Json::Leaf("null".into())),
        1 => value(),
    ]
    .boxed()
}

/// An item: some known keys with mostly good values, unknown keys, maybe a
/// key twice, in any order.
fn item() -> impl Strategy<Value = Vec<(String, Json)>> {
    let known: Vec<_> = KNOWN
        .iter()
        .map(|&k| {
            let weight = if k == "id" { 0.95 } else { 0.6 };
            prop::option::weighted(weight, good(k).prop_map(move |v| (format!("\"{k}\""), v)))
        })
        .collect();
    let unknown = prop::collection::vec((unknown_key(), value()), 0..3);
    let twice = prop::option::weighted(0.05, any::<prop::sample::Index>());
    (known, unknown, twice, any::<prop::sample::Index>()).prop_flat_map(
        |(known, unknown, twice, at)| {
            let mut entries: Vec<(String, Json)> = known.into_iter().flatten().collect();
            if let Some(twice) = twice.filter(|_| !entries.is_empty()) {
                let again = entries[twice.index(entries.len())].clone();
                entries.push(again);
            }
            for (n, entry) in unknown.into_iter().enumerate() {
                let len = entries.len();
                entries.insert((at.index(len + 1) + n) % (len + 1), entry);
            }
            Just(entries).prop_shuffle()
        },
    )
}

/// How a written item is broken as text.
#[derive(Debug, Clone)]
enum Mangle {
    Whole,
    /// Cut short (on a char boundary).
    Cut(prop::sample::Index),
    Append(&'static str),
    /// Something inserted anywhere (on a char boundary).
    Insert(prop::sample::Index, &'static str),
}

/// An item written out, sometimes broken as text.
fn raw_item() -> impl Strategy<Value = String> {
    let mangle = prop_oneof![
        40 => Just(Mangle::Whole),
        2 => any::<prop::sample::Index>().prop_map(Mangle::Cut),
        2 => prop::sample::select(vec![" x", "}", ",", "\n", "  ", "{}", "\u{a0}", "1"])
            .prop_map(Mangle::Append),
        2 => (any::<prop::sample::Index>(), prop::sample::select(vec![
            // Not JSON whitespace, or not where it lands.
            "\u{a0}", "\u{c}", "\u{feff}", "\u{1}", " ", "\"", "\\", ",", ":", "{", "]",
        ]))
            .prop_map(|(at, what)| Mangle::Insert(at, what)),
    ];
    (item(), prop::collection::vec(whitespace(), 1..12), mangle, whitespace()).prop_map(
        |(entries, spaces, mangle, lead)| {
            let mut out = lead.to_string();
            write_object(&entries, &mut out, &mut spaces.into_iter().cycle());
            match mangle {
                Mangle::Whole => {}
                Mangle::Cut(at) => {
                    let mut end = at.index(out.len());
                    while !out.is_char_boundary(end) {
                        end -= 1;
                    }
                    out.truncate(end);
                }
                Mangle::Append(tail) => out.push_str(tail),
                Mangle::Insert(at, what) => {
                    let mut at = at.index(out.len() + 1);
                    while !out.is_char_boundary(at) {
                        at -= 1;
                    }
                    out.insert_str(at, what);
                }
            }
            out
        },
    )
}

#[test]
fn generated_items_read_alike() {
    let config = Config { cases: 5000, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    let (cases, taken) = (Cell::new(0u32), Cell::new(0u32));
    let result = runner.run(&raw_item(), |raw| {
        cases.set(cases.get() + 1);
        taken.set(taken.get() + u32::from(check(&raw)?));
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (cases, taken) = (cases.get(), taken.get());
    // About half the generated items are good: the fast path must take them.
    assert!(taken * 3 > cases, "the fast path took {taken} of {cases} generated items");
}

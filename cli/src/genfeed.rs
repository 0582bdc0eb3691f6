//! Deterministic synthetic partner feeds (the feed format ingest reads) for demos,
//! tests and benchmarks. Pure and streaming: items are generated one at a
//! time straight into the writer, so a 1 GB dump needs no more memory than a
//! 1 KB one.
//!
//! Every value of item `n` of place `p` is a hash of `(seed, p, n, field)`,
//! not a draw from a shared RNG, so one item never depends on another: the
//! same spec yields byte-identical output, and churn changes exactly the
//! items [`is_churned`] names — a churned dump differs from the base dump
//! (same seed, churn 0) only there. That is what lets a benchmark say "1%
//! churn" and a test predict which records must change.

use std::io::{self, BufWriter, Write};

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedSpec {
    pub brand_id: i64,
    /// Places `1..=places`.
    pub places: u32,
    /// Items per place: `sku-<place>-<n>` for `n` in `1..=items_per_place`.
    pub items_per_place: u32,
    /// Seeds every base value.
    pub seed: u64,
    pub format: Format,
    pub variant: Variant,
    /// Fraction (0..=1) of items whose price and stock differ from the base
    /// dump of the same seed.
    pub churn: f64,
    /// Picks which items churn and how; vary it for successive updates.
    pub churn_seed: u64,
}

impl Default for FeedSpec {
    fn default() -> Self {
        FeedSpec {
            brand_id: 7,
            places: 100,
            items_per_place: 1000,
            seed: 42,
            format: Format::Json,
            variant: Variant::Full,
            churn: 0.0,
            churn_seed: 0,
        }
    }
}

/// The two feed shapes ingest reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// `{"brand_id": B, "places": [{"place_id": P, "items": [...]}, ...]}`.
    Json,
    /// One item per line, each with its `brand_id` and `place_id`.
    Ndjson,
}

/// Which fields items carry: the feeds of partners owning different parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Variant {
    /// Every field: a content + price + stock feed.
    Full,
    /// `id`, `price` and `old_price` (when the item has one).
    Price,
    /// `id` and `stock`.
    Stock,
}

/// What was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FeedSummary {
    pub places: u64,
    pub items: u64,
    /// Items whose price / stock differ from the base dump.
    pub churned: u64,
    pub bytes: u64,
}

/// One generated item, every field filled (the variant picks what is
/// written).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedItem {
    pub id: String,
    pub title: String,
    pub category: &'static str,
    /// Minor units.
    pub price: i64,
    /// Minor units; above `price` when present.
    pub old_price: Option<i64>,
    pub currency: &'static str,
    pub stock: i64,
    pub images: Vec<String>,
    pub description: String,
}

pub const CATEGORIES: [&str; 20] = [
    "roses",
    "tulips",
    "peonies",
    "chrysanthemums",
    "orchids",
    "lilies",
    "carnations",
    "gerberas",
    "hydrangeas",
    "alstroemerias",
    "mixed-bouquets",
    "wedding",
    "potted-plants",
    "succulents",
    "gift-boxes",
    "balloons",
    "soft-toys",
    "sweets",
    "greeting-cards",
    "vases",
];

const COLOURS: [&str; 8] = ["Red", "White", "Pink", "Yellow", "Cream", "Purple", "Peach", "Mixed"];

const DESCRIPTIONS: [&str; 6] = [
    "Hand-tied by our florists.",
    "Wrapped in kraft paper.",
    "Fresh stems, cut this week.",
    "Shades may vary slightly.",
    "Packed in a water box.",
    "A favourite for birthdays.",
];

// Salts: one independent hash stream per field.
const S_CATEGORY: u64 = 1;
const S_COLOUR: u64 = 2;
const S_COUNT: u64 = 3;
const S_PRICE: u64 = 4;
const S_OLD_PRICE: u64 = 5;
const S_STOCK: u64 = 6;
const S_IMAGES: u64 = 7;
const S_DESCRIPTION: u64 = 8;
const S_CHURN: u64 = 100;
const S_CHURN_PRICE: u64 = 101;
const S_CHURN_STOCK: u64 = 102;

fn hash(seed: u64, place: u32, n: u32, salt: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..4].copy_from_slice(&place.to_le_bytes());
    buf[4..8].copy_from_slice(&n.to_le_bytes());
    buf[8..].copy_from_slice(&salt.to_le_bytes());
    xxh3_64_with_seed(&buf, seed)
}

/// A hash as a uniform fraction in `[0, 1)`.
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// Whether item `n` of `place` is churned under `spec`.
pub fn is_churned(spec: &FeedSpec, place: u32, n: u32) -> bool {
    spec.churn > 0.0 && unit(hash(spec.churn_seed, place, n, S_CHURN)) < spec.churn
}

/// Item `n` of `place` as the base dump has it (churn ignored).
pub fn base_item(spec: &FeedSpec, place: u32, n: u32) -> FeedItem {
    let h = |salt| hash(spec.seed, place, n, salt);
    let category = CATEGORIES[(h(S_CATEGORY) % CATEGORIES.len() as u64) as usize];
    let colour = COLOURS[(h(S_COLOUR) % COLOURS.len() as u64) as usize];
    let count = 3 + h(S_COUNT) % 49;
    // 10.00 .. 5 000.00 in whole roubles.
    let price = (10 + (h(S_PRICE) % 4991) as i64) * 100;
    // Half the items are on sale: the old price is 10–60% above.
    let old = h(S_OLD_PRICE);
    let old_price = old
        .is_multiple_of(2)
        .then(|| price + price * (10 + (old >> 1) % 51) as i64 / 100 / 100 * 100);
    // One item in ten is out of stock.
    let s = h(S_STOCK);
    let stock = if s.is_multiple_of(10) { 0 } else { 1 + (s >> 4) % 50 } as i64;
    // Mostly one or two photos, sometimes three.
    let images = (0..[1, 1, 1, 2, 2, 3][(h(S_IMAGES) % 6) as usize])
        .map(|i| format!("https://cdn.example/{}/{place}/{n}-{i}.jpg", spec.brand_id))
        .collect();
    let description = DESCRIPTIONS[(h(S_DESCRIPTION) % DESCRIPTIONS.len() as u64) as usize];
    FeedItem {
        id: format!("sku-{place}-{n}"),
        title: format!("{colour} {category}, {count} pcs"),
        category,
        price,
        old_price,
        currency: "RUB",
        stock,
        images,
        description: description.to_string(),
    }
}

/// Item `n` of `place` as `spec` writes it: the base item, with a different
/// price and stock when churned.
pub fn item(spec: &FeedSpec, place: u32, n: u32) -> FeedItem {
    let mut item = base_item(spec, place, n);
    if is_churned(spec, place, n) {
        churn(spec, place, n, &mut item);
    }
    item
}

fn churn(spec: &FeedSpec, place: u32, n: u32, item: &mut FeedItem) {
    let h = hash(spec.churn_seed, place, n, S_CHURN_PRICE);
    // A step of 1–50 roubles, down when the price allows, up otherwise;
    // never zero, so the price always differs.
    let step = (1 + (h >> 1) % 50) as i64 * 100;
    let new_price = if h.is_multiple_of(2) && item.price > step {
        item.price - step
    } else {
        item.price + step
    };
    // Keep a sale a sale: the old price moves with the price.
    if let Some(old) = item.old_price.as_mut() {
        *old += new_price - item.price;
    }
    item.price = new_price;
    // (stock + 1..=50) mod 51 never lands back on stock (0..=50).
    let k = 1 + hash(spec.churn_seed, place, n, S_CHURN_STOCK) % 50;
    item.stock = ((item.stock as u64 + k) % 51) as i64;
}

/// The wire shape of one item: only what the variant carries.
#[derive(Serialize)]
struct ItemOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    brand_id: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    place_id: Option<u32>,
    id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    title: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    category: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    price: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    old_price: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    currency: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stock: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    images: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a str>,
}

impl<'a> ItemOut<'a> {
    fn new(item: &'a FeedItem, variant: Variant) -> Self {
        let full = variant == Variant::Full;
        let price = variant != Variant::Stock;
        ItemOut {
            brand_id: None,
            place_id: None,
            id: &item.id,
            title: full.then_some(item.title.as_str()),
            category: full.then_some(item.category),
            price: price.then_some(item.price),
            old_price: item.old_price.filter(|_| price),
            currency: full.then_some(item.currency),
            stock: (variant != Variant::Price).then_some(item.stock),
            images: full.then_some(item.images.as_slice()),
            description: full.then_some(item.description.as_str()),
        }
    }
}

/// Counts bytes on their way to the inner writer.
struct Counting<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the feed `spec` describes to `writer` (buffered here), one item
/// per line, and flushes it.
pub fn write_feed<W: Write>(spec: &FeedSpec, writer: W) -> io::Result<FeedSummary> {
    let mut out = BufWriter::with_capacity(256 * 1024, Counting { inner: writer, bytes: 0 });
    let mut summary = FeedSummary::default();
    if spec.format == Format::Json {
        writeln!(out, "{{\"brand_id\":{},\"places\":[", spec.brand_id)?;
    }
    for place in 1..=spec.places {
        if spec.format == Format::Json {
            let sep = if place > 1 { "," } else { "" };
            writeln!(out, "{sep}{{\"place_id\":{place},\"items\":[")?;
        }
        for n in 1..=spec.items_per_place {
            let item = item(spec, place, n);
            let mut wire = ItemOut::new(&item, spec.variant);
            if spec.format == Format::Ndjson {
                wire.brand_id = Some(spec.brand_id);
                wire.place_id = Some(place);
            } else if n > 1 {
                out.write_all(b",")?;
            }
            serde_json::to_writer(&mut out, &wire)?;
            out.write_all(b"\n")?;
            summary.items += 1;
            summary.churned += u64::from(is_churned(spec, place, n));
        }
        if spec.format == Format::Json {
            writeln!(out, "]}}")?;
        }
        summary.places += 1;
    }
    if spec.format == Format::Json {
        writeln!(out, "]}}")?;
    }
    out.flush()?;
    summary.bytes = out.get_ref().bytes;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use serde_json::Value;

    use super::*;

    fn generate(spec: &FeedSpec) -> (Vec<u8>, FeedSummary) {
        let mut buf = Vec::new();
        let summary = write_feed(spec, &mut buf).expect("write to a Vec");
        assert_eq!(summary.bytes, buf.len() as u64);
        (buf, summary)
    }

    fn small(format: Format) -> FeedSpec {
        FeedSpec { places: 3, items_per_place: 50, format, ..Default::default() }
    }

    /// `(place, id) -> item` of a JSON or NDJSON feed, checking its shape.
    fn parse(spec: &FeedSpec, bytes: &[u8]) -> BTreeMap<(u64, String), Value> {
        let mut items = BTreeMap::new();
        match spec.format {
            Format::Json => {
                let doc: Value = serde_json::from_slice(bytes).expect("valid JSON");
                assert_eq!(doc["brand_id"], spec.brand_id);
                let places = doc["places"].as_array().expect("places");
                assert_eq!(places.len(), spec.places as usize);
                for p in places {
                    let place = p["place_id"].as_u64().expect("place_id");
                    for item in p["items"].as_array().expect("items") {
                        let id = item["id"].as_str().expect("id").to_string();
                        items.insert((place, id), item.clone());
                    }
                }
            }
            Format::Ndjson => {
                for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                    let mut item: Value = serde_json::from_slice(line).expect("a JSON line");
                    assert_eq!(item["brand_id"], spec.brand_id);
                    let place = item["place_id"].as_u64().expect("place_id");
                    let obj = item.as_object_mut().expect("object");
                    obj.remove("brand_id");
                    obj.remove("place_id");
                    let id = item["id"].as_str().expect("id").to_string();
                    items.insert((place, id), item);
                }
            }
        }
        items
    }

    #[test]
    fn same_spec_same_bytes() {
        for format in [Format::Json, Format::Ndjson] {
            let spec = FeedSpec { churn: 0.1, churn_seed: 9, ..small(format) };
            assert_eq!(generate(&spec).0, generate(&spec).0);
            let other = FeedSpec { seed: 43, ..spec.clone() };
            assert_ne!(generate(&spec).0, generate(&other).0);
        }
    }

    #[test]
    fn both_formats_parse_and_carry_the_same_items() {
        let json = small(Format::Json);
        let ndjson = small(Format::Ndjson);
        let (a, sa) = generate(&json);
        let (b, sb) = generate(&ndjson);
        let (ia, ib) = (parse(&json, &a), parse(&ndjson, &b));
        assert_eq!(ia.len(), 150);
        assert_eq!(ia, ib);
        assert_eq!((sa.items, sa.places), (150, 3));
        assert_eq!(sb.items, 150);

        // Items look like the feed format's example and are about 200–250 bytes.
        let per_item = sa.bytes / sa.items;
        assert!((180..=280).contains(&per_item), "{per_item} bytes per item");
        let categories: BTreeSet<String> = ia.values().map(|i| i["category"].to_string()).collect();
        assert!(categories.len() > 10, "{categories:?}");
        let mut zero_stock = 0;
        let mut on_sale = 0;
        for item in ia.values() {
            let price = item["price"].as_i64().expect("price");
            assert!(price > 0 && price % 100 == 0);
            if let Some(old) = item.get("old_price") {
                assert!(old.as_i64().expect("int") > price);
                on_sale += 1;
            }
            zero_stock += usize::from(item["stock"] == 0);
            assert_eq!(item["currency"], "RUB");
            let images = item["images"].as_array().expect("images").len();
            assert!((1..=3).contains(&images));
            assert!(item["title"].as_str().is_some_and(|t| !t.is_empty()));
            assert!(item["description"].is_string());
        }
        assert!(zero_stock > 0 && zero_stock < 50, "{zero_stock}");
        assert!(on_sale > 30 && on_sale < 120, "{on_sale}");
    }

    #[test]
    fn churn_changes_exactly_the_predicted_items() {
        let base = FeedSpec {
            places: 10,
            items_per_place: 1000,
            format: Format::Ndjson,
            ..Default::default()
        };
        let churned = FeedSpec { churn: 0.01, churn_seed: 5, ..base.clone() };
        let (a, sa) = generate(&base);
        let (b, sb) = generate(&churned);
        assert_eq!(sa.churned, 0);
        let (ia, ib) = (parse(&base, &a), parse(&churned, &b));
        assert_eq!(ia.len(), 10_000);

        let changed: BTreeSet<(u64, String)> =
            ia.iter().filter(|(k, v)| ib[*k] != **v).map(|(k, _)| k.clone()).collect();
        let predicted: BTreeSet<(u64, String)> = (1..=10u32)
            .flat_map(|p| (1..=1000u32).map(move |n| (p, n)))
            .filter(|&(p, n)| is_churned(&churned, p, n))
            .map(|(p, n)| (u64::from(p), format!("sku-{p}-{n}")))
            .collect();
        assert_eq!(changed, predicted);
        assert_eq!(sb.churned, changed.len() as u64);
        // ~1% of 10 000: 100 ± a generous margin.
        assert!((60..=140).contains(&changed.len()), "{}", changed.len());

        for key in &changed {
            let (before, after) = (&ia[key], &ib[key]);
            assert_ne!(before["price"], after["price"], "{key:?}");
            assert_ne!(before["stock"], after["stock"], "{key:?}");
            assert_eq!(before["title"], after["title"]);
            assert!(after["price"].as_i64().expect("price") > 0);
            if let Some(old) = after.get("old_price") {
                assert!(old.as_i64() > after["price"].as_i64());
            }
        }

        // Another churn seed picks other items.
        let other = FeedSpec { churn_seed: 6, ..churned.clone() };
        let picked: BTreeSet<_> = (1..=1000).filter(|&n| is_churned(&other, 1, n)).collect();
        let before: BTreeSet<_> = (1..=1000).filter(|&n| is_churned(&churned, 1, n)).collect();
        assert_ne!(picked, before);
    }

    #[test]
    fn variants_carry_only_their_fields() {
        let keys = |variant| {
            let spec = FeedSpec { variant, ..small(Format::Json) };
            let (bytes, _) = generate(&spec);
            let mut keys = BTreeSet::new();
            for item in parse(&spec, &bytes).values() {
                keys.extend(item.as_object().expect("object").keys().cloned());
            }
            keys.into_iter().collect::<Vec<_>>()
        };
        assert_eq!(keys(Variant::Price), ["id", "old_price", "price"]);
        assert_eq!(keys(Variant::Stock), ["id", "stock"]);
        assert_eq!(keys(Variant::Full).len(), 9);

        // A price feed agrees with the full feed on prices.
        let full = small(Format::Ndjson);
        let price = FeedSpec { variant: Variant::Price, ..full.clone() };
        let (f, p) = (generate(&full).0, generate(&price).0);
        let (f, p) = (parse(&full, &f), parse(&price, &p));
        for (k, v) in &p {
            assert_eq!(v["price"], f[k]["price"]);
            assert_eq!(v.get("old_price"), f[k].get("old_price"));
        }
    }

    #[test]
    fn empty_feed_is_still_valid_json() {
        let spec = FeedSpec { places: 0, ..Default::default() };
        let (bytes, summary) = generate(&spec);
        let doc: Value = serde_json::from_slice(&bytes).expect("valid JSON");
        assert_eq!(doc["places"], serde_json::json!([]));
        assert_eq!(summary.items, 0);
    }
}

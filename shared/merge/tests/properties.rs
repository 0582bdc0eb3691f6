//! Properties of the wire merge, checked against a tiny model (field lists
//! encoded by hand) and against real `Product` messages encoded by prost.
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use prost::Message;
use shelfsync_merge::{canonicalize, changed_fields, field_numbers, merge, merge_changes};
use shelfsync_proto::Product;

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Varint(u64),
    Fixed64(u64),
    Fixed32(u32),
    Bytes(Vec<u8>),
}

type Fields = Vec<(u32, Value)>;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Minimal encoding of `fields` in the order given.
fn encode(fields: &[(u32, Value)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (field, value) in fields {
        let tag = u64::from(*field) << 3;
        match value {
            Value::Varint(v) => {
                put_varint(&mut out, tag);
                put_varint(&mut out, *v);
            }
            Value::Fixed64(v) => {
                put_varint(&mut out, tag | 1);
                out.extend(v.to_le_bytes());
            }
            Value::Bytes(b) => {
                put_varint(&mut out, tag | 2);
                put_varint(&mut out, b.len() as u64);
                out.extend(b);
            }
            Value::Fixed32(v) => {
                put_varint(&mut out, tag | 5);
                out.extend(v.to_le_bytes());
            }
        }
    }
    out
}

fn numbers(fields: &[(u32, Value)]) -> Vec<u32> {
    let mut n: Vec<u32> = fields.iter().map(|(f, _)| *f).collect();
    n.sort_unstable();
    n.dedup();
    n
}

fn entries_of(fields: &[(u32, Value)], field: u32) -> Fields {
    fields.iter().filter(|(f, _)| *f == field).cloned().collect()
}

/// The PATCH rule, spelled out the slow and obvious way.
fn model_merge(base: &[(u32, Value)], patch: &[(u32, Value)], clear: &[u32]) -> Fields {
    let mut all: Fields = base.iter().chain(patch).cloned().collect();
    all.sort_by_key(|(f, _)| *f);
    let mut out = Fields::new();
    for field in numbers(&all).into_iter().filter(|f| !clear.contains(f)) {
        let from_patch = entries_of(patch, field);
        out.extend(if from_patch.is_empty() { entries_of(base, field) } else { from_patch });
    }
    out
}

fn model_changed(a: &[(u32, Value)], b: &[(u32, Value)]) -> Vec<u32> {
    let all: Fields = a.iter().chain(b).cloned().collect();
    numbers(&all).into_iter().filter(|&f| entries_of(a, f) != entries_of(b, f)).collect()
}

/// Known Product numbers, unknown ones and the largest legal one, drawn so
/// that messages often share numbers and repeat them.
fn field_number() -> impl Strategy<Value = u32> {
    prop_oneof![4 => 1u32..=8, 2 => 9u32..=1000, 1 => Just(536_870_911)]
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(Value::Varint),
        Just(Value::Varint(0)),
        any::<u64>().prop_map(Value::Fixed64),
        any::<u32>().prop_map(Value::Fixed32),
        vec(any::<u8>(), 0..12).prop_map(Value::Bytes),
    ]
}

fn fields(max: usize) -> impl Strategy<Value = Fields> {
    vec((field_number(), value()), 0..max)
}

fn clears() -> impl Strategy<Value = Vec<u32>> {
    vec(field_number(), 0..4)
}

fn text() -> impl Strategy<Value = String> {
    "[a-zа-я ]{0,8}"
}

fn amount() -> impl Strategy<Value = i64> {
    // Zero must survive as a present value, so draw it often.
    prop_oneof![Just(0i64), any::<i64>()]
}

fn product() -> impl Strategy<Value = Product> {
    let (opt_text, opt_amount) = (|| option::of(text()), || option::of(amount()));
    let parts = (opt_text(), opt_text(), opt_amount(), opt_amount(), opt_text(), opt_amount());
    (parts, vec(text(), 0..4), opt_text()).prop_map(|(p, images, description)| Product {
        title: p.0,
        category: p.1,
        price: p.2,
        old_price: p.3,
        currency: p.4,
        stock: p.5,
        images,
        description,
    })
}

/// `base` with every field present in `patch` overwritten and `clear` removed.
fn overlay(base: &Product, patch: &Product, clear: &[u32]) -> Product {
    let mut p = base.clone();
    macro_rules! take {
        ($($field:ident = $n:expr),*) => {$(
            if patch.$field.is_some() { p.$field = patch.$field.clone(); }
            if clear.contains(&$n) { p.$field = None; }
        )*};
    }
    take!(
        title = 1,
        category = 2,
        price = 3,
        old_price = 4,
        currency = 5,
        stock = 6,
        description = 8
    );
    // An empty repeated field is absent on the wire, so it cannot replace.
    if !patch.images.is_empty() {
        p.images = patch.images.clone();
    }
    if clear.contains(&7) {
        p.images.clear();
    }
    p
}

fn decode(bytes: &[u8]) -> Product {
    Product::decode(bytes).unwrap_or_else(|e| panic!("merge output is not a Product: {e}"))
}

proptest! {
    #[test]
    fn canonicalize_is_a_stable_sort(f in fields(64)) {
        let mut sorted = f.clone();
        sorted.sort_by_key(|(n, _)| *n);
        let out = canonicalize(&encode(&f)).expect("valid input");
        prop_assert_eq!(&out, &encode(&sorted));
        prop_assert_eq!(canonicalize(&out).expect("valid input"), out);
    }

    #[test]
    fn merge_matches_the_model(b in fields(12), p in fields(6), c in clears()) {
        let out = merge(&encode(&b), &encode(&p), &c).expect("valid input");
        prop_assert_eq!(&out, &encode(&model_merge(&b, &p, &c)));
        prop_assert_eq!(canonicalize(&out).expect("valid output"), out);
    }

    #[test]
    fn merge_changes_is_merge_then_changed_fields(
        b in fields(12),
        p in fields(6),
        c in clears(),
        sorted in any::<bool>(),
    ) {
        // A stored base is canonical; a patch may come in any order.
        let b = if sorted { canonicalize(&encode(&b)).expect("valid") } else { encode(&b) };
        let p = encode(&p);
        let merged = merge(&b, &p, &c).expect("valid input");
        let changed = changed_fields(&b, &merged).expect("valid input");
        prop_assert_eq!(merge_changes(&b, &p, &c).expect("valid input"), (merged, changed));
    }

    #[test]
    fn merge_is_idempotent(b in fields(12), p in fields(6), c in clears()) {
        let p = encode(&p);
        let once = merge(&encode(&b), &p, &c).expect("valid input");
        prop_assert_eq!(merge(&once, &p, &c).expect("valid input"), once);
    }

    #[test]
    fn later_patch_wins_per_field(b in fields(12), p1 in fields(6), p2 in fields(6)) {
        let (b, p1, p2) = (encode(&b), encode(&p1), encode(&p2));
        let out = merge(&merge(&b, &p1, &[]).expect("valid"), &p2, &[]).expect("valid");
        let in_p2 = field_numbers(&p2).expect("valid");
        let in_p1 = field_numbers(&p1).expect("valid");
        let vs_p2 = changed_fields(&out, &canonicalize(&p2).expect("valid")).expect("valid");
        let vs_p1 = changed_fields(&out, &canonicalize(&p1).expect("valid")).expect("valid");
        let vs_b = changed_fields(&out, &canonicalize(&b).expect("valid")).expect("valid");
        for f in field_numbers(&out).expect("valid") {
            if in_p2.contains(&f) {
                prop_assert!(!vs_p2.contains(&f), "field {} is not p2's", f);
            } else if in_p1.contains(&f) {
                prop_assert!(!vs_p1.contains(&f), "field {} is not p1's", f);
            } else {
                prop_assert!(!vs_b.contains(&f), "field {} is not base's", f);
            }
        }
        let mut union = [b, p1, p2].iter().flat_map(|m| field_numbers(m).expect("valid")).collect::<Vec<_>>();
        union.sort_unstable();
        union.dedup();
        prop_assert_eq!(field_numbers(&out).expect("valid"), union);
    }

    #[test]
    fn clear_removes_exactly_the_listed_fields(b in fields(12), c in clears()) {
        let base = canonicalize(&encode(&b)).expect("valid");
        let out = merge(&base, &[], &c).expect("valid");
        let before = field_numbers(&base).expect("valid");
        let kept: Vec<u32> = before.iter().copied().filter(|f| !c.contains(f)).collect();
        let cleared: Vec<u32> = before.iter().copied().filter(|f| c.contains(f)).collect();
        prop_assert_eq!(field_numbers(&out).expect("valid"), kept);
        prop_assert_eq!(changed_fields(&base, &out).expect("valid"), cleared);
        // Nothing to patch or clear: the stored bytes come back untouched.
        prop_assert_eq!(merge(&base, &[], &[]).expect("valid"), base);
    }

    #[test]
    fn changed_fields_is_exact_and_symmetric(a in fields(10), p in fields(3), c in vec(1u32..=8, 0..2)) {
        // b is a small edit of a, so a == b happens often.
        let ca = canonicalize(&encode(&a)).expect("valid");
        let cb = merge(&ca, &encode(&p), &c).expect("valid");
        let changed = changed_fields(&ca, &cb).expect("valid");
        prop_assert_eq!(changed.is_empty(), ca == cb);
        prop_assert_eq!(&changed, &changed_fields(&cb, &ca).expect("valid"));
        prop_assert_eq!(changed, model_changed(&a, &model_merge(&a, &p, &c)));
    }

    #[test]
    fn malformed_or_truncated_input_never_panics(f in fields(8), cut in any::<prop::sample::Index>(), noise in vec(any::<u8>(), 0..32)) {
        let valid = encode(&f);
        let truncated = &valid[..cut.index(valid.len() + 1)];
        for bytes in [truncated, &noise[..]] {
            if let Ok(out) = canonicalize(bytes) {
                prop_assert_eq!(canonicalize(&out).expect("canonical output is valid"), out);
            }
            let _ = merge(bytes, &valid, &[1]);
            let _ = merge(&valid, bytes, &[]);
            let _ = changed_fields(bytes, &valid);
            let _ = field_numbers(bytes);
        }
    }

    #[test]
    fn product_merge_overwrites_present_fields(base in product(), patch in product(), c in vec(1u32..=8, 0..3)) {
        let base_bytes = base.encode_to_vec();
        // prost writes fields in number order, minimally: already canonical.
        prop_assert_eq!(&canonicalize(&base_bytes).expect("valid"), &base_bytes);
        let out = merge(&base_bytes, &patch.encode_to_vec(), &c).expect("valid");
        prop_assert_eq!(&canonicalize(&out).expect("valid"), &out);
        prop_assert_eq!(decode(&out), overlay(&base, &patch, &c));
    }

    #[test]
    fn repeated_images_are_replaced_whole(base in product(), old in vec(text(), 1..5), new in vec(text(), 1..3)) {
        let base = Product { images: old, ..base };
        let patch = Product { images: new.clone(), ..Product::default() };
        let out = merge(&base.encode_to_vec(), &patch.encode_to_vec(), &[]).expect("valid");
        prop_assert_eq!(decode(&out).images, new);
    }

    #[test]
    fn unknown_fields_survive_and_product_still_decodes(
        base in product(),
        patch in product(),
        unknown in vec((9u32..=1000, value()), 1..6),
    ) {
        let mut stored = base.encode_to_vec();
        stored.extend(encode(&unknown));
        let out = merge(&stored, &patch.encode_to_vec(), &[]).expect("valid");
        prop_assert_eq!(decode(&out), overlay(&base, &patch, &[]));
        let unchanged = changed_fields(&out, &canonicalize(&stored).expect("valid")).expect("valid");
        prop_assert!(unchanged.iter().all(|&f| f <= 8), "unknown field changed: {:?}", unchanged);
        let present = field_numbers(&out).expect("valid");
        prop_assert!(numbers(&unknown).iter().all(|f| present.contains(f)));
    }
}

//! The ranking index: per place and category, the offers that can be
//! recommended, kept in rank order. Pure data structure — no I/O, no locks,
//! no knowledge of records or the change stream (`feed` decides what goes in).
//!
//! Rank: deepest discount first (integer basis points), then largest stock,
//! then product id ascending, so every query has one right answer.
//!
//! Layout, per place:
//! - `offers`: product id → [`Slot`] (prices, stock, category, rank inputs),
//!   to find an offer's current rank key on update or removal;
//! - `ranked`: category → `BTreeSet<RankKey>`, the ordered view queries walk.
//!
//! A product id is allocated once per place (an `Arc<str>` shared by the map
//! key and the rank key); category names are interned index-wide as `u32`
//! (categories are few; the interner only grows). Upsert and remove are
//! O(log n); a top-N query walks at most N + |exclude| keys of one category,
//! or k-way merges the place's categories without a category.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet, btree_set};
use std::sync::Arc;

use serde::Serialize;

/// One place of one brand: the unit the index is partitioned by.
pub use shelfsync_proto::PlaceKey;

/// What the index keeps of an offer that can be recommended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// Empty when the product has no category.
    pub category: String,
    /// Minor units, positive.
    pub price: i64,
    pub old_price: Option<i64>,
    /// Positive.
    pub stock: i64,
}

/// One answer of a top-N query.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopItem {
    pub product_id: String,
    pub category: String,
    pub price: i64,
    pub old_price: Option<i64>,
    pub stock: i64,
    /// `(old_price - price) / old_price`, 0 when not discounted.
    pub discount: f64,
}

/// What to ask the index (already validated by the caller).
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    /// `None`: every category of the place.
    pub category: Option<&'a str>,
    pub limit: usize,
    /// Product ids to leave out.
    pub exclude: &'a [String],
}

/// The discount in whole basis points (0..10000), the ranking's first key:
/// `(old_price - price) / old_price` when `old_price > price > 0`, else 0.
pub fn discount_bp(price: i64, old_price: Option<i64>) -> u16 {
    match old_price {
        Some(old) if old > price && price > 0 => {
            // i128: (old - price) * 10_000 overflows i64 for huge prices.
            let bp = (i128::from(old - price) * 10_000) / i128::from(old);
            u16::try_from(bp).unwrap_or(u16::MAX)
        }
        _ => 0,
    }
}

/// The discount as a fraction, as reported to clients.
pub fn discount(price: i64, old_price: Option<i64>) -> f64 {
    match old_price {
        Some(old) if old > price && price > 0 => (old - price) as f64 / old as f64,
        _ => 0.0,
    }
}

/// A product id, allocated once per place and shared by both structures.
type Id = Arc<str>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct CategoryId(u32);

/// Position of an offer in its category; the derived order *is* the rank
/// (fields compare in declaration order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct RankKey {
    discount_bp: Reverse<u16>,
    stock: Reverse<i64>,
    id: Id,
}

/// Everything about an offer except its id (the map key): 32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    price: i64,
    /// Meaningful only when `has_old_price` (keeps the slot at 32 bytes).
    old_price: i64,
    stock: i64,
    category: CategoryId,
    discount_bp: u16,
    has_old_price: bool,
}

impl Slot {
    fn old_price(&self) -> Option<i64> {
        self.has_old_price.then_some(self.old_price)
    }

    fn rank_key(&self, id: Id) -> RankKey {
        RankKey { discount_bp: Reverse(self.discount_bp), stock: Reverse(self.stock), id }
    }
}

/// Category names ↔ small ids, index-wide.
#[derive(Debug, Default)]
struct Categories {
    ids: HashMap<Arc<str>, CategoryId>,
    names: Vec<Arc<str>>,
}

impl Categories {
    fn intern(&mut self, name: &str) -> CategoryId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = CategoryId(u32::try_from(self.names.len()).expect("fewer than 2^32 categories"));
        let name: Arc<str> = Arc::from(name);
        self.names.push(name.clone());
        self.ids.insert(name, id);
        id
    }

    fn lookup(&self, name: &str) -> Option<CategoryId> {
        self.ids.get(name).copied()
    }

    fn name(&self, id: CategoryId) -> &str {
        &self.names[id.0 as usize]
    }
}

#[derive(Debug, Default)]
struct PlaceIndex {
    offers: HashMap<Id, Slot>,
    /// Never holds an empty set.
    ranked: HashMap<CategoryId, BTreeSet<RankKey>>,
}

impl PlaceIndex {
    fn unrank(&mut self, slot: &Slot, id: Id) {
        if let Some(set) = self.ranked.get_mut(&slot.category) {
            set.remove(&slot.rank_key(id));
            if set.is_empty() {
                self.ranked.remove(&slot.category);
            }
        }
    }

    fn rank(&mut self, slot: &Slot, id: Id) {
        self.ranked.entry(slot.category).or_default().insert(slot.rank_key(id));
    }
}

/// The offers that can be recommended, per place and category.
#[derive(Debug, Default)]
pub struct Index {
    categories: Categories,
    places: HashMap<PlaceKey, PlaceIndex>,
    offers: usize,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Offers indexed, over every place.
    pub fn len(&self) -> usize {
        self.offers
    }

    pub fn is_empty(&self) -> bool {
        self.offers == 0
    }

    /// Places with at least one offer.
    pub fn places(&self) -> usize {
        self.places.len()
    }

    /// Inserts an offer or replaces what the index had of it, moving it in
    /// the ranking (and between categories) as needed. O(log n).
    pub fn upsert(&mut self, place: PlaceKey, product_id: &str, offer: Offer) {
        let category = self.categories.intern(&offer.category);
        let slot = Slot {
            price: offer.price,
            old_price: offer.old_price.unwrap_or(0),
            stock: offer.stock,
            category,
            discount_bp: discount_bp(offer.price, offer.old_price),
            has_old_price: offer.old_price.is_some(),
        };
        let p = self.places.entry(place).or_default();
        match p.offers.get_key_value(product_id).map(|(id, old)| (id.clone(), *old)) {
            Some((id, old)) => {
                // A price change that keeps the discount (in basis points)
                // and the stock keeps the rank: no tree operation.
                if (old.discount_bp, old.stock, old.category)
                    != (slot.discount_bp, slot.stock, slot.category)
                {
                    p.unrank(&old, id.clone());
                    p.rank(&slot, id.clone());
                }
                p.offers.insert(id, slot);
            }
            None => {
                let id: Id = Arc::from(product_id);
                p.rank(&slot, id.clone());
                p.offers.insert(id, slot);
                self.offers += 1;
            }
        }
    }

    /// Forgets an offer; `false` if the index did not have it. O(log n).
    pub fn remove(&mut self, place: PlaceKey, product_id: &str) -> bool {
        let Some(p) = self.places.get_mut(&place) else { return false };
        let Some((id, slot)) = p.offers.remove_entry(product_id) else { return false };
        p.unrank(&slot, id);
        self.offers -= 1;
        if p.offers.is_empty() {
            self.places.remove(&place);
        }
        true
    }

    /// Forgets every offer of a place.
    pub fn reset_place(&mut self, place: PlaceKey) {
        if let Some(p) = self.places.remove(&place) {
            self.offers -= p.offers.len();
        }
    }

    /// The best `limit` offers of a place, best first.
    pub fn top(&self, place: PlaceKey, q: Query<'_>) -> Vec<TopItem> {
        let Some(p) = self.places.get(&place) else { return Vec::new() };
        if q.limit == 0 {
            return Vec::new();
        }
        let excluded = Excluded::new(q.exclude);
        let keep = |k: &&RankKey| !excluded.contains(&k.id);
        let keys: Vec<&RankKey> = match q.category {
            Some(name) => {
                let Some(set) = self.categories.lookup(name).and_then(|c| p.ranked.get(&c)) else {
                    return Vec::new();
                };
                set.iter().filter(keep).take(q.limit).collect()
            }
            None => Merge::new(p.ranked.values()).filter(keep).take(q.limit).collect(),
        };
        keys.into_iter()
            .filter_map(|k| {
                let slot = p.offers.get(&k.id)?;
                Some(TopItem {
                    product_id: k.id.to_string(),
                    category: self.categories.name(slot.category).to_string(),
                    price: slot.price,
                    old_price: slot.old_price(),
                    stock: slot.stock,
                    discount: discount(slot.price, slot.old_price()),
                })
            })
            .collect()
    }
}

/// Exclusion lookup: a scan for a few ids, a hash set for many.
enum Excluded<'a> {
    Few(&'a [String]),
    Many(HashSet<&'a str>),
}

impl<'a> Excluded<'a> {
    fn new(ids: &'a [String]) -> Self {
        if ids.len() <= 8 {
            Excluded::Few(ids)
        } else {
            Excluded::Many(ids.iter().map(String::as_str).collect())
        }
    }

    fn contains(&self, id: &str) -> bool {
        match self {
            Excluded::Few(ids) => ids.iter().any(|e| e == id),
            Excluded::Many(set) => set.contains(id),
        }
    }
}

/// K-way merge of a place's category rankings: yields every key of the
/// place in rank order, costing O(k) to start and O(log k) per key. An
/// offer is in exactly one category, so keys never repeat.
struct Merge<'a> {
    iters: Vec<btree_set::Iter<'a, RankKey>>,
    heads: BinaryHeap<Reverse<(&'a RankKey, usize)>>,
}

impl<'a> Merge<'a> {
    fn new(sets: impl Iterator<Item = &'a BTreeSet<RankKey>>) -> Self {
        let mut iters: Vec<_> = sets.map(BTreeSet::iter).collect();
        let mut heads = BinaryHeap::with_capacity(iters.len());
        for (i, it) in iters.iter_mut().enumerate() {
            if let Some(k) = it.next() {
                heads.push(Reverse((k, i)));
            }
        }
        Self { iters, heads }
    }
}

impl<'a> Iterator for Merge<'a> {
    type Item = &'a RankKey;

    fn next(&mut self) -> Option<&'a RankKey> {
        let Reverse((key, i)) = self.heads.pop()?;
        if let Some(next) = self.iters[i].next() {
            self.heads.push(Reverse((next, i)));
        }
        Some(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: PlaceKey = PlaceKey { brand_id: 7, place_id: 1 };

    fn offer(category: &str, price: i64, old_price: Option<i64>, stock: i64) -> Offer {
        Offer { category: category.into(), price, old_price, stock }
    }

    fn q(category: Option<&str>, limit: usize) -> Query<'_> {
        Query { category, limit, exclude: &[] }
    }

    fn ids(items: &[TopItem]) -> Vec<&str> {
        items.iter().map(|i| i.product_id.as_str()).collect()
    }

    #[test]
    fn discount_is_integer_basis_points_and_zero_unless_discounted() {
        assert_eq!(discount_bp(50, Some(100)), 5000);
        assert_eq!(discount_bp(2, Some(3)), 3333); // floor
        assert_eq!(discount_bp(100, Some(100)), 0);
        assert_eq!(discount_bp(120, Some(100)), 0);
        assert_eq!(discount_bp(50, None), 0);
        assert_eq!(discount_bp(0, Some(100)), 0);
        assert_eq!(discount_bp(1, Some(i64::MAX)), 9999); // no overflow
        assert_eq!(discount(25, Some(100)), 0.75);
        assert_eq!(discount(100, Some(50)), 0.0);
    }

    #[test]
    fn ranks_by_discount_then_stock_then_id() {
        let mut ix = Index::new();
        ix.upsert(P, "b-half-few", offer("roses", 50, Some(100), 1));
        ix.upsert(P, "a-half-few", offer("roses", 50, Some(100), 1));
        ix.upsert(P, "half-many", offer("roses", 50, Some(100), 9));
        ix.upsert(P, "tenth", offer("roses", 90, Some(100), 100));
        ix.upsert(P, "none-many", offer("roses", 100, None, 1000));
        ix.upsert(P, "none-few", offer("roses", 10, None, 1));
        let top = ix.top(P, q(None, 10));
        assert_eq!(
            ids(&top),
            ["half-many", "a-half-few", "b-half-few", "tenth", "none-many", "none-few"]
        );
        assert_eq!(top[0].discount, 0.5);
        assert_eq!(top[0].old_price, Some(100));
        assert_eq!(top[4].old_price, None);
        assert_eq!(ix.top(P, q(Some("roses"), 10)), top);
    }

    #[test]
    fn filters_by_category_and_merges_without_one() {
        let mut ix = Index::new();
        ix.upsert(P, "r1", offer("roses", 10, Some(100), 1)); // 90%
        ix.upsert(P, "r2", offer("roses", 70, Some(100), 1)); // 30%
        ix.upsert(P, "t1", offer("tulips", 20, Some(100), 1)); // 80%
        ix.upsert(P, "t2", offer("tulips", 60, Some(100), 1)); // 40%
        ix.upsert(P, "x", offer("", 50, Some(100), 1)); // 50%, no category
        ix.upsert(PlaceKey::new(7, 2), "elsewhere", offer("roses", 1, Some(100), 1));
        assert_eq!(ids(&ix.top(P, q(Some("roses"), 10))), ["r1", "r2"]);
        assert_eq!(ids(&ix.top(P, q(Some("tulips"), 10))), ["t1", "t2"]);
        assert_eq!(ids(&ix.top(P, q(Some(""), 10))), ["x"]);
        assert_eq!(ids(&ix.top(P, q(None, 10))), ["r1", "t1", "x", "t2", "r2"]);
        assert!(ix.top(P, q(Some("lilies"), 10)).is_empty());
        assert!(ix.top(PlaceKey::new(7, 3), q(None, 10)).is_empty());
        assert_eq!(ix.top(P, q(Some("tulips"), 1))[0].category, "tulips");
    }

    #[test]
    fn limit_and_exclusions() {
        let mut ix = Index::new();
        for i in 0..20 {
            ix.upsert(
                P,
                &format!("p{i:02}"),
                offer(["a", "b"][i % 2], 100 - i as i64, Some(100), 1),
            );
        }
        // Deeper discount for higher i.
        assert_eq!(ids(&ix.top(P, q(None, 3))), ["p19", "p18", "p17"]);
        assert!(ix.top(P, q(None, 0)).is_empty());
        assert_eq!(ix.top(P, q(None, 1000)).len(), 20);
        let few = ["p19".to_string(), "p17".into(), "nope".into()];
        let top = ix.top(P, Query { category: None, limit: 3, exclude: &few });
        assert_eq!(ids(&top), ["p18", "p16", "p15"]);
        let top = ix.top(P, Query { category: Some("a"), limit: 2, exclude: &few });
        assert_eq!(ids(&top), ["p18", "p16"]);
        // Many exclusions take the hash-set path.
        let many: Vec<String> = (0..19).map(|i| format!("p{i:02}")).collect();
        let top = ix.top(P, Query { category: None, limit: 5, exclude: &many });
        assert_eq!(ids(&top), ["p19"]);
    }

    #[test]
    fn upsert_moves_an_offer_between_ranks_and_categories() {
        let mut ix = Index::new();
        ix.upsert(P, "a", offer("roses", 50, Some(100), 1));
        ix.upsert(P, "b", offer("roses", 80, Some(100), 1));
        assert_eq!(ids(&ix.top(P, q(None, 10))), ["a", "b"]);
        // b becomes the deeper discount.
        ix.upsert(P, "b", offer("roses", 10, Some(100), 1));
        assert_eq!(ids(&ix.top(P, q(None, 10))), ["b", "a"]);
        // Stock breaks a tie.
        ix.upsert(P, "a", offer("roses", 10, Some(100), 5));
        assert_eq!(ids(&ix.top(P, q(None, 10))), ["a", "b"]);
        // Same rank, new price: kept in place, new price reported.
        ix.upsert(P, "a", offer("roses", 20, Some(200), 5));
        let top = ix.top(P, q(None, 10));
        assert_eq!((top[0].product_id.as_str(), top[0].price), ("a", 20));
        // a moves to tulips.
        ix.upsert(P, "a", offer("tulips", 20, Some(200), 5));
        assert_eq!(ids(&ix.top(P, q(Some("roses"), 10))), ["b"]);
        assert_eq!(ids(&ix.top(P, q(Some("tulips"), 10))), ["a"]);
        assert_eq!(ix.len(), 2);
    }

    #[test]
    fn removal_and_reset() {
        let mut ix = Index::new();
        ix.upsert(P, "a", offer("roses", 50, Some(100), 1));
        ix.upsert(P, "b", offer("tulips", 50, Some(100), 1));
        ix.upsert(PlaceKey::new(7, 2), "a", offer("roses", 50, Some(100), 1));
        assert!(ix.remove(P, "a"));
        assert!(!ix.remove(P, "a"));
        assert!(!ix.remove(PlaceKey::new(9, 9), "a"));
        assert!(ix.top(P, q(Some("roses"), 10)).is_empty());
        assert_eq!(ids(&ix.top(P, q(None, 10))), ["b"]);
        assert_eq!((ix.len(), ix.places()), (2, 2));
        ix.reset_place(P);
        assert!(ix.top(P, q(None, 10)).is_empty());
        assert_eq!((ix.len(), ix.places()), (1, 1));
        assert!(ix.remove(PlaceKey::new(7, 2), "a"));
        assert!(ix.is_empty());
        assert_eq!(ix.places(), 0);
    }

    /// The model: live offers per (place, id), ranked by a plain sort.
    fn brute_force(
        live: &HashMap<(PlaceKey, String), Offer>,
        place: PlaceKey,
        q: Query<'_>,
    ) -> Vec<TopItem> {
        let mut all: Vec<(&String, &Offer)> = live
            .iter()
            .filter(|((p, id), o)| {
                *p == place && q.category.is_none_or(|c| o.category == c) && !q.exclude.contains(id)
            })
            .map(|((_, id), o)| (id, o))
            .collect();
        all.sort_by(|(ia, a), (ib, b)| {
            discount_bp(b.price, b.old_price)
                .cmp(&discount_bp(a.price, a.old_price))
                .then(b.stock.cmp(&a.stock))
                .then(ia.cmp(ib))
        });
        all.into_iter()
            .take(q.limit)
            .map(|(id, o)| TopItem {
                product_id: id.clone(),
                category: o.category.clone(),
                price: o.price,
                old_price: o.old_price,
                stock: o.stock,
                discount: discount(o.price, o.old_price),
            })
            .collect()
    }

    #[derive(Debug, Clone)]
    enum Op {
        Upsert(i64, String, Offer),
        Remove(i64, String),
        Reset(i64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Small domains so that ties (discount, stock) and moves are common.
        let id = (0..12u8).prop_map(|i| format!("sku-{i}"));
        let place = 1..3i64;
        let offer = (
            prop::sample::select(vec!["roses", "tulips", "lilies", ""]),
            1..6i64,
            prop::option::of(prop::sample::select(vec![3i64, 5, 6, 10])),
            1..4i64,
        )
            .prop_map(|(c, price, old, stock)| offer(c, price, old, stock));
        prop_oneof![
            6 => (place.clone(), id.clone(), offer).prop_map(|(p, i, o)| Op::Upsert(p, i, o)),
            3 => (place.clone(), id).prop_map(|(p, i)| Op::Remove(p, i)),
            1 => place.prop_map(Op::Reset),
        ]
    }

    proptest! {
        #[test]
        fn top_n_equals_a_brute_force_sort_of_the_live_offers(
            ops in prop::collection::vec(op(), 1..120),
            limit in 0..15usize,
            exclude in prop::collection::vec((0..12u8).prop_map(|i| format!("sku-{i}")), 0..4),
        ) {
            let mut ix = Index::new();
            let mut live: HashMap<(PlaceKey, String), Offer> = HashMap::new();
            for op in ops {
                match op {
                    Op::Upsert(p, id, o) => {
                        ix.upsert(PlaceKey::new(7, p), &id, o.clone());
                        live.insert((PlaceKey::new(7, p), id), o);
                    }
                    Op::Remove(p, id) => {
                        let had = live.remove(&(PlaceKey::new(7, p), id.clone())).is_some();
                        prop_assert_eq!(ix.remove(PlaceKey::new(7, p), &id), had);
                    }
                    Op::Reset(p) => {
                        ix.reset_place(PlaceKey::new(7, p));
                        live.retain(|(pk, _), _| pk.place_id != p);
                    }
                }
            }
            prop_assert_eq!(ix.len(), live.len());
            for p in 1..3 {
                let place = PlaceKey::new(7, p);
                for category in [None, Some("roses"), Some("tulips"), Some("lilies"), Some("")] {
                    for exclude in [&[][..], &exclude[..]] {
                        let q = Query { category, limit, exclude };
                        prop_assert_eq!(ix.top(place, q), brute_force(&live, place, q));
                    }
                }
            }
        }
    }

    #[test]
    fn sizes_stay_compact() {
        // The per-offer footprint the README figure is built on.
        assert_eq!(std::mem::size_of::<Slot>(), 32);
        assert_eq!(std::mem::size_of::<RankKey>(), 32);
    }
}

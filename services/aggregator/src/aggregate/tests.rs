//! The pure core against an in-memory model of the Redis scripts: the same
//! set operations, the same "first member at the lowest score" rule, the same
//! compare-with-published, so that plans, retraction, ties and redelivery are
//! tested without servers (the integration tests run the real scripts).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::prelude::*;
use prost::Message;
use shelfsync_proto::{Product, RecordState};
use shelfsync_settings::PlaceRegion;

use super::*;

/// A card event as the tests compare it: min price, offers, cheapest (brand, place).
type CardEvent = (Option<i64>, u32, Option<(i64, i64)>);

const NORTH: &str = "north";

fn directory() -> Directory {
    let place = |b, p, r: &str| PlaceRegion { brand_id: b, place_id: p, region: r.into() };
    Directory::new(&AggregatorSettings {
        places: vec![
            place(7, 1, NORTH),
            place(7, 2, NORTH),
            place(8, 1, NORTH),
            place(7, 3, "south"),
        ],
        default_region: None,
        ..Default::default()
    })
}

#[derive(Debug, Clone)]
struct Offer {
    price: Option<i64>,
    stock: Option<i64>,
    category: Option<&'static str>,
    currency: Option<&'static str>,
    hidden: bool,
    absent: bool,
    deleted: bool,
}

impl Default for Offer {
    fn default() -> Self {
        Offer {
            price: Some(100),
            stock: Some(5),
            category: Some("roses"),
            currency: Some("RUB"),
            hidden: false,
            absent: false,
            deleted: false,
        }
    }
}

fn record(o: &Offer, updated_at: i64) -> Record {
    let data = Product {
        title: Some("t".into()),
        category: o.category.map(String::from),
        price: o.price,
        stock: o.stock,
        currency: o.currency.map(String::from),
        ..Default::default()
    };
    let state = RecordState { hidden: Some(o.hidden), ..Default::default() };
    Record {
        data: data.encode_to_vec(),
        state: state.encode_to_vec(),
        absent: o.absent,
        deleted: o.deleted,
        updated_at,
        ..Default::default()
    }
}

fn version(place: impl Into<PlaceKey>, id: &str, o: &Offer, at: i64) -> Item {
    let place = place.into();
    item(&directory(), &RecordKey::new(place.brand_id, place.place_id, id), &record(o, at))
}

#[derive(Debug, Clone, PartialEq)]
enum Event {
    Card(MasterCard),
    Flip(PlaceKey, String, bool),
}

/// The Redis layout in memory, run the way the engine runs a batch.
#[derive(Debug, Clone, Default, PartialEq)]
struct Model {
    cards: BTreeMap<CardId, BTreeMap<String, (i64, String)>>,
    categories: BTreeMap<(PlaceKey, String), BTreeSet<String>>,
    views: BTreeMap<(PlaceKey, String), Seen>,
    published_cards: BTreeMap<CardId, (MasterCard, u64)>,
    published_categories: BTreeMap<(PlaceKey, String), (bool, u64)>,
    events: Vec<Event>,
    msg_ids: BTreeSet<String>,
}

impl Model {
    fn run(&mut self, items: &[Item]) {
        let mut seen: HashMap<(PlaceKey, String), Seen> = items
            .iter()
            .filter_map(|i| {
                let k = (i.place, i.product_id.clone());
                self.views.get(&k).map(|s| (k, s.clone()))
            })
            .collect();
        let plan = plan(items, &mut seen);
        let mut changes = Vec::new();
        for (id, work) in &plan.cards {
            let set = self.cards.entry(id.clone()).or_default();
            for op in &work.ops {
                match op {
                    CardOp::Put { place, price, currency } => set
                        .insert(member(*place), (*price, offer_entry(*price, currency.as_deref()))),
                    CardOp::Remove { place } => set.remove(&member(*place)),
                };
            }
            // ZRANGE 0 0: lowest score, then lowest member bytes.
            let top = set.iter().min_by(|a, b| a.1.0.cmp(&b.1.0).then(a.0.cmp(b.0)));
            let cheapest = top.map(|(m, (_, e))| {
                let (price, currency) = parse_offer_entry(e).expect("entry");
                Cheapest { place: parse_member(m).expect("member"), price, currency }
            });
            let current = master_card(id, set.len() as u64, cheapest.as_ref());
            let (published, version) =
                self.published_cards.get(id).cloned().map_or((None, 0), |(c, v)| (Some(c), v));
            let outcome = CardOutcome { id: id.clone(), current, published, version, at: work.at };
            changes.extend(outcome.change());
        }
        self.cards.retain(|_, s| !s.is_empty());
        let mut flips = Vec::new();
        for (place, work) in &plan.places {
            for op in &work.ops {
                if let Some(c) = &op.remove {
                    self.categories.entry((*place, c.clone())).or_default().remove(&op.product_id);
                }
                if let Some(c) = &op.add {
                    self.categories
                        .entry((*place, c.clone()))
                        .or_default()
                        .insert(op.product_id.clone());
                }
                match &op.seen {
                    Some(s) => self.views.insert((*place, op.product_id.clone()), s.clone()),
                    None => self.views.remove(&(*place, op.product_id.clone())),
                };
            }
            for (category, at) in &work.categories {
                let k = (*place, category.clone());
                let (published, version) =
                    self.published_categories.get(&k).copied().unwrap_or((false, 0));
                let outcome = CategoryOutcome {
                    place: *place,
                    category: category.clone(),
                    count: self.categories.get(&k).map_or(0, |s| s.len() as u64),
                    published,
                    version,
                    at: *at,
                };
                flips.extend(outcome.flip());
            }
        }
        self.categories.retain(|_, s| !s.is_empty());
        // Publish, then store what was published.
        for c in changes {
            assert!(self.msg_ids.insert(card_msg_id(&c)), "msg id reused: {c:?}");
            self.events.push(Event::Card(c.card.clone()));
            self.published_cards.insert(c.id, (c.card, c.version));
        }
        for f in flips {
            assert!(self.msg_ids.insert(flip_msg_id(&f)), "msg id reused: {f:?}");
            self.events.push(Event::Flip(f.place, f.category.clone(), f.non_empty));
            self.published_categories.insert((f.place, f.category), (f.non_empty, f.version));
        }
    }

    fn card(&self, product: &str) -> MasterCard {
        let id = CardId { region: NORTH.into(), product_id: product.into() };
        self.published_cards.get(&id).map_or_else(|| master_card(&id, 0, None), |(c, _)| c.clone())
    }

    fn non_empty(&self, place: impl Into<PlaceKey>) -> Vec<String> {
        let place = place.into();
        self.published_categories
            .iter()
            .filter(|((p, _), (ne, _))| *p == place && *ne)
            .map(|((_, c), _)| c.clone())
            .collect()
    }

    fn card_events(&self) -> Vec<CardEvent> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::Card(c) => Some((
                    c.min_price,
                    c.offers,
                    c.cheapest.as_ref().map(|k| (k.brand_id, k.place_id)),
                )),
                Event::Flip(..) => None,
            })
            .collect()
    }
}

#[test]
fn qualification() {
    let r = |o: Offer| contribution(&record(&o, 1), Some(NORTH));
    let full = r(Offer::default());
    assert_eq!(
        full,
        Contribution {
            card: Some(CardOffer {
                region: NORTH.into(),
                price: 100,
                currency: Some("RUB".into())
            }),
            category: Some("roses".into()),
        }
    );
    for (why, o) in [
        ("hidden", Offer { hidden: true, ..Offer::default() }),
        ("absent", Offer { absent: true, ..Offer::default() }),
        ("deleted", Offer { deleted: true, ..Offer::default() }),
        ("stock 0", Offer { stock: Some(0), ..Offer::default() }),
        ("negative stock", Offer { stock: Some(-1), ..Offer::default() }),
        ("stock unknown", Offer { stock: None, ..Offer::default() }),
    ] {
        assert!(r(o).is_empty(), "{why} disqualifies");
    }
    // Without a usable price it still fills its category, but no card.
    for price in [None, Some(0), Some(-5)] {
        let c = r(Offer { price, ..Offer::default() });
        assert_eq!(c.card, None, "price {price:?}");
        assert_eq!(c.category.as_deref(), Some("roses"));
    }
    let c = r(Offer { category: Some(""), currency: Some(""), ..Offer::default() });
    assert_eq!(c.category, None);
    assert_eq!(c.card.and_then(|o| o.currency), None);
    // Outside the directory: nothing, and the item forgets the record.
    assert!(contribution(&record(&Offer::default(), 1), None).is_empty());
    let outside = version((9, 9), "a", &Offer::default(), 5);
    assert_eq!(outside.action, Action::Forget { at: 5 });
}

#[test]
fn the_minimum_with_ties_goes_to_the_smallest_brand_then_place() {
    let mut m = Model::default();
    let at = |p: i64| Offer { price: Some(p), ..Offer::default() };
    m.run(&[
        version((8, 1), "rose", &at(100), 1),
        version((7, 2), "rose", &at(100), 2),
        version((7, 1), "rose", &at(150), 3),
    ]);
    let card = m.card("rose");
    assert_eq!(card.min_price, Some(100));
    assert_eq!(card.offers, 3);
    assert_eq!(card.cheapest, Some(RecordKey::new(7, 2, "rose")));
    assert_eq!(card.currency.as_deref(), Some("RUB"));
    // A cheaper offer elsewhere in the same region takes over.
    m.run(&[version((7, 1), "rose", &at(99), 4)]);
    assert_eq!(m.card("rose").cheapest, Some(RecordKey::new(7, 1, "rose")));
    // Another region has its own card.
    m.run(&[version((7, 3), "rose", &at(1), 5)]);
    assert_eq!(m.card("rose").min_price, Some(99));
    let south = CardId { region: "south".into(), product_id: "rose".into() };
    assert_eq!(m.published_cards[&south].0.min_price, Some(1));
}

#[test]
fn retraction_moves_to_the_next_cheapest_then_retracts_the_card() {
    let mut m = Model::default();
    let priced = |p: i64| Offer { price: Some(p), ..Offer::default() };
    m.run(&[
        version((7, 1), "rose", &priced(100), 1),
        version((7, 2), "rose", &priced(200), 1),
        version((8, 1), "rose", &priced(300), 1),
    ]);
    m.events.clear();
    m.run(&[version((7, 1), "rose", &Offer { stock: Some(0), ..priced(100) }, 2)]);
    m.run(&[version((7, 2), "rose", &Offer { hidden: true, ..priced(200) }, 3)]);
    // A change that touches nothing counted: no event.
    m.run(&[version((7, 2), "rose", &Offer { hidden: true, ..priced(250) }, 4)]);
    m.run(&[version((8, 1), "rose", &Offer { absent: true, ..priced(300) }, 5)]);
    assert_eq!(
        m.card_events(),
        [(Some(200), 2, Some((7, 2))), (Some(300), 1, Some((8, 1))), (None, 0, None)]
    );
    let retracted = m.card("rose");
    assert_eq!(retracted, master_card(&retracted_id("rose"), 0, None));
    // Back in stock: the card returns.
    m.run(&[version((7, 1), "rose", &priced(120), 6)]);
    assert_eq!(m.card("rose").min_price, Some(120));
}

fn retracted_id(product: &str) -> CardId {
    CardId { region: NORTH.into(), product_id: product.into() }
}

#[test]
fn moves_between_prices_categories_and_regions_leave_nothing_behind() {
    let mut m = Model::default();
    m.run(&[
        version((7, 1), "rose", &Offer::default(), 1),
        version((7, 1), "tulip", &Offer { category: Some("tulips"), ..Offer::default() }, 1),
    ]);
    assert_eq!(m.non_empty((7, 1)), ["roses", "tulips"]);
    // A category move without `before`: the counted view knows the old one.
    m.run(&[version((7, 1), "rose", &Offer { category: Some("tulips"), ..Offer::default() }, 2)]);
    assert_eq!(m.non_empty((7, 1)), ["tulips"]);
    assert_eq!(m.events.last(), Some(&Event::Flip(PlaceKey::new(7, 1), "roses".into(), false)));
    // Two versions of one record in one batch: only the net effect counts.
    let before = m.events.len();
    m.run(&[
        version((7, 1), "tulip", &Offer { stock: Some(0), ..Offer::default() }, 3),
        version((7, 1), "tulip", &Offer { category: Some("tulips"), ..Offer::default() }, 4),
    ]);
    assert_eq!(m.events.len(), before, "out and back within a batch is no change");
    // The place leaves the directory: everything it counted is retracted.
    let moved = Directory::new(&AggregatorSettings { default_region: None, ..Default::default() });
    let key = RecordKey::new(7, 1, "rose");
    m.run(&[item(&moved, &key, &record(&Offer::default(), 5))]);
    assert_eq!(m.card("rose").offers, 0);
    assert_eq!(m.categories.get(&(PlaceKey::new(7, 1), "tulips".into())).map(|s| s.len()), Some(1));
}

#[test]
fn older_versions_never_override_newer_ones() {
    let mut m = Model::default();
    m.run(&[version((7, 1), "rose", &Offer { stock: Some(0), ..Offer::default() }, 10)]);
    let after = m.clone();
    // An old keyframe says it was in stock: ignored.
    m.run(&[version((7, 1), "rose", &Offer::default(), 9)]);
    assert_eq!(m, after);
    // The same version again is harmless; a newer one applies.
    m.run(&[version((7, 1), "rose", &Offer { stock: Some(0), ..Offer::default() }, 10)]);
    assert_eq!(m, after);
    m.run(&[version((7, 1), "rose", &Offer::default(), 11)]);
    assert_eq!(m.card("rose").offers, 1);
}

#[test]
fn a_reload_forgets_only_what_the_keyframe_no_longer_has() {
    let mut r = Reload::new(
        [("kept".to_string(), 50), ("purged".into(), 10), ("newer".into(), 500)].into(),
    );
    r.confirm("kept", 50);
    r.confirm("other", 100);
    assert_eq!(r.leftovers(1000, 900), ["purged"]);
    // An empty snapshot: only what is older than the tombstone TTL goes.
    let r = Reload::new([("old".to_string(), 10), ("recent".into(), 950)].into());
    assert_eq!(r.leftovers(1000, 900), ["old"]);
}

#[test]
fn message_ids_follow_version_and_content() {
    let id = retracted_id("rose");
    let change = |v, price| CardChange {
        id: id.clone(),
        card: master_card(
            &id,
            1,
            Some(&Cheapest { place: PlaceKey::new(7, 1), price, currency: None }),
        ),
        version: v,
        at: 0,
    };
    assert_eq!(card_msg_id(&change(1, 10)), card_msg_id(&change(1, 10)));
    assert_ne!(card_msg_id(&change(1, 10)), card_msg_id(&change(3, 10)));
    assert_ne!(card_msg_id(&change(1, 10)), card_msg_id(&change(1, 11)));
    let d = Dirty::Category { brand_id: 7, place_id: 1, category: "a:b\"c".into() };
    assert_eq!(Dirty::decode(&d.encode()), Some(d));
}

proptest! {
    #[test]
    fn members_sort_like_places(a in any::<(i64, i64)>(), b in any::<(i64, i64)>()) {
        let (a, b) = (PlaceKey::from(a), PlaceKey::from(b));
        prop_assert_eq!(member(a).cmp(&member(b)), a.cmp(&b));
        prop_assert_eq!(parse_member(&member(a)), Some(a));
    }
}

const PLACES: [PlaceKey; 5] = [
    PlaceKey::new(7, 1),
    PlaceKey::new(7, 2),
    PlaceKey::new(8, 1),
    PlaceKey::new(7, 3),
    PlaceKey::new(9, 9),
];
const CATEGORIES: [&str; 3] = ["roses", "tulips", "lilies"];

fn arb_offer() -> impl Strategy<Value = Offer> {
    (
        prop_oneof![Just(None), (0i64..4).prop_map(Some)],
        prop_oneof![Just(None), (0i64..3).prop_map(Some)],
        prop_oneof![Just(None), (0usize..3).prop_map(|i| Some(CATEGORIES[i]))],
        prop::bool::weighted(0.15),
        prop::bool::weighted(0.15),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(price, stock, category, hidden, absent, deleted)| Offer {
            price,
            stock,
            category,
            currency: Some("RUB"),
            hidden,
            absent,
            deleted,
        })
}

/// Batches of record versions, `updated_at` strictly increasing per record
/// (as storage stamps them).
fn arb_batches() -> impl Strategy<Value = Vec<Vec<Item>>> {
    let one = (0usize..PLACES.len(), 0usize..3, arb_offer());
    prop::collection::vec(prop::collection::vec(one, 1..6), 1..12).prop_map(|batches| {
        let mut at = 0;
        batches
            .into_iter()
            .map(|b| {
                b.into_iter()
                    .map(|(p, id, o)| {
                        at += 1;
                        version(PLACES[p], &format!("sku-{id}"), &o, at)
                    })
                    .collect()
            })
            .collect()
    })
}

/// The aggregates computed from scratch out of the newest version of every
/// record: what the published state must be.
fn expected(batches: &[Vec<Item>]) -> (BTreeMap<CardId, MasterCard>, BTreeSet<(PlaceKey, String)>) {
    let mut newest: BTreeMap<(PlaceKey, String), &Item> = BTreeMap::new();
    for i in batches.iter().flatten() {
        newest.insert((i.place, i.product_id.clone()), i);
    }
    let mut offers: BTreeMap<CardId, Vec<Cheapest>> = BTreeMap::new();
    let mut categories = BTreeSet::new();
    for ((place, id), item) in newest {
        let Action::Version { contribution, .. } = &item.action else { continue };
        if let Some(c) = &contribution.card {
            offers
                .entry(CardId { region: c.region.clone(), product_id: id.clone() })
                .or_default()
                .push(Cheapest { place, price: c.price, currency: c.currency.clone() });
        }
        if let Some(c) = &contribution.category {
            categories.insert((place, c.clone()));
        }
    }
    let cards = offers
        .into_iter()
        .map(|(id, v)| {
            let min = v.iter().min_by_key(|c| (c.price, c.place)).cloned();
            let card = master_card(&id, v.len() as u64, min.as_ref());
            (id, card)
        })
        .collect();
    (cards, categories)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Applied once, the published aggregates are those computed from
    /// scratch; every batch delivered twice, and then the whole history
    /// delivered again, changes nothing and publishes nothing more.
    #[test]
    fn redelivery_changes_nothing(batches in arb_batches()) {
        let mut once = Model::default();
        for b in &batches {
            once.run(b);
        }
        let (cards, categories) = expected(&batches);
        let published: BTreeMap<CardId, MasterCard> = once
            .published_cards
            .iter()
            .filter(|(_, (c, _))| c.offers > 0)
            .map(|(id, (c, _))| (id.clone(), c.clone()))
            .collect();
        prop_assert_eq!(published, cards);
        let non_empty: BTreeSet<(PlaceKey, String)> = once
            .published_categories
            .iter()
            .filter(|(_, (ne, _))| *ne)
            .map(|(k, _)| k.clone())
            .collect();
        prop_assert_eq!(non_empty, categories);

        let mut twice = Model::default();
        for b in &batches {
            twice.run(b);
            twice.run(b);
        }
        prop_assert_eq!(&twice, &once);
        for b in &batches {
            twice.run(b);
        }
        prop_assert_eq!(&twice, &once);
    }

    /// A reload from a keyframe of the current state (every newest version,
    /// in any order, after marking everything) publishes nothing.
    #[test]
    fn a_reload_of_the_same_state_publishes_nothing(batches in arb_batches(), seed in any::<u64>()) {
        let mut m = Model::default();
        for b in &batches {
            m.run(b);
        }
        let before = m.clone();
        let mut newest: BTreeMap<(PlaceKey, String), Item> = BTreeMap::new();
        for i in batches.iter().flatten() {
            newest.insert((i.place, i.product_id.clone()), i.clone());
        }
        for place in PLACES {
            let counted: HashMap<String, i64> = m
                .views
                .iter()
                .filter(|((p, _), _)| *p == place)
                .map(|((_, id), s)| (id.clone(), s.updated_at))
                .collect();
            let mut reload = Reload::new(counted);
            let mut snapshot: Vec<Item> =
                newest.iter().filter(|((p, _), _)| *p == place).map(|(_, i)| i.clone()).collect();
            if !snapshot.is_empty() {
                let k = (seed % snapshot.len() as u64) as usize;
                snapshot.rotate_left(k);
            }
            for i in &snapshot {
                let at = match i.action { Action::Version { updated_at, .. } => updated_at, Action::Forget { at } => at };
                reload.confirm(&i.product_id, at);
            }
            m.run(&snapshot);
            let forget: Vec<Item> = reload
                .leftovers(i64::MAX / 2, 0)
                .into_iter()
                .map(|id| Item { place, product_id: id, action: Action::Forget { at: 0 } })
                .collect();
            prop_assert!(forget.is_empty(), "a full snapshot leaves nothing: {:?}", forget);
        }
        prop_assert_eq!(m, before);
    }
}

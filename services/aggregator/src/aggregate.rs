//! The pure core of the aggregator: which offers count and where, what one
//! record version contributes to a master card and to its place's category
//! cache, the plan of idempotent set operations a batch turns into, and when
//! an aggregate has changed. No I/O: the store executes plans, the engine
//! publishes.
//!
//! Everything is **set semantics**. An offer is a member of its card's set
//! (scored by price) and its product id a member of its category's set;
//! applying the same record version twice puts the same member in the same
//! set with the same score. Counts are set sizes, never counters, so a
//! redelivered batch cannot count anything twice.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use shelfsync_feed::{is_visible, product_of};
use shelfsync_proto::{MasterCard, Record, RecordKey};

pub use shelfsync_proto::PlaceKey;
use shelfsync_settings::AggregatorSettings;

/// The place → region directory: reference data from config.
#[derive(Debug, Clone, Default)]
pub struct Directory {
    places: HashMap<PlaceKey, String>,
    default: Option<String>,
}

impl Directory {
    pub fn new(settings: &AggregatorSettings) -> Self {
        Self {
            places: settings
                .places
                .iter()
                .map(|p| (PlaceKey::new(p.brand_id, p.place_id), p.region.clone()))
                .collect(),
            default: settings.default_region.clone(),
        }
    }

    /// The region of a place; `None`: the place is not aggregated at all.
    pub fn region_of(&self, place: PlaceKey) -> Option<&str> {
        self.places.get(&place).or(self.default.as_ref()).map(String::as_str)
    }
}

/// What an offer adds to a master card.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CardOffer {
    #[serde(rename = "r")]
    pub region: String,
    #[serde(rename = "p")]
    pub price: i64,
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
}

/// What one record version adds to the aggregates. Empty: nothing (the
/// offer does not qualify).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Contribution {
    #[serde(rename = "o", default, skip_serializing_if = "Option::is_none")]
    pub card: Option<CardOffer>,
    #[serde(rename = "k", default, skip_serializing_if = "Option::is_none")]
    pub category: Option<String>,
}

impl Contribution {
    pub fn is_empty(&self) -> bool {
        self.card.is_none() && self.category.is_none()
    }
}

/// True when a record is an offer a customer can buy: visible (not hidden
/// by a validator), present (not swept absent), not deleted, in stock.
pub fn qualifies(record: &Record) -> bool {
    is_visible(record) && product_of(record).stock.unwrap_or(0) > 0
}

/// What a record version contributes, given its place's region (`None`: the
/// place is outside the directory and contributes nothing).
///
/// A qualifying offer counts in its category (if it has one) and, if it has
/// a positive price, in its product's master card. A price of zero or below
/// is not a price anyone can be offered (the validator hides such offers;
/// the aggregator does not rely on it).
pub fn contribution(record: &Record, region: Option<&str>) -> Contribution {
    let Some(region) = region else { return Contribution::default() };
    if !qualifies(record) {
        return Contribution::default();
    }
    let p = product_of(record);
    Contribution {
        card: p.price.filter(|&price| price > 0).map(|price| CardOffer {
            region: region.to_string(),
            price,
            currency: p.currency.filter(|c| !c.is_empty()),
        }),
        category: p.category.filter(|c| !c.is_empty()),
    }
}

/// What the aggregator last counted for a record: the version it saw and
/// what that version contributed. Kept per record (qualifying or not) so
/// that retraction knows where to retract from even when the update carries
/// no `before` (a keyframe snapshot), and so that an older version (an old
/// keyframe replayed after a restart) never overrides a newer one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    #[serde(rename = "t")]
    pub updated_at: i64,
    #[serde(flatten)]
    pub contribution: Contribution,
}

/// One unit of input: a record version, or "forget this record".
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub place: PlaceKey,
    pub product_id: String,
    pub action: Action,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// A record version; ignored if a newer one was already counted.
    Version { updated_at: i64, contribution: Contribution },
    /// The record is gone from storage (or its place left the directory):
    /// retract what it contributed and forget it. `at` stamps the events.
    Forget { at: i64 },
}

/// The item a record version makes: counted under its place's region, or
/// forgotten when its place is not in the directory (which also retracts
/// what it counted while the place was in it).
pub fn item(directory: &Directory, key: &RecordKey, record: &Record) -> Item {
    let place = key.place();
    let action = match directory.region_of(place) {
        Some(region) => Action::Version {
            updated_at: record.updated_at,
            contribution: contribution(record, Some(region)),
        },
        None => Action::Forget { at: record.updated_at },
    };
    Item { place, product_id: key.product_id.clone(), action }
}

/// A place being reloaded from a keyframe: mark and sweep, as storage does
/// with generations. Every record counted for the place is marked when the
/// reload starts; each record of the snapshot unmarks its own. What is left
/// when the snapshot ends is gone from storage, unless it is newer than the
/// snapshot (created after it: the change stream replays it next).
#[derive(Debug, Clone, Default)]
pub struct Reload {
    marked: HashMap<String, i64>,
    newest_in_snapshot: i64,
}

impl Reload {
    /// `counted`: product id → `updated_at` of every record counted for the
    /// place.
    pub fn new(counted: HashMap<String, i64>) -> Self {
        Self { marked: counted, newest_in_snapshot: i64::MIN }
    }

    /// A record of the snapshot.
    pub fn confirm(&mut self, product_id: &str, updated_at: i64) {
        self.marked.remove(product_id);
        self.newest_in_snapshot = self.newest_in_snapshot.max(updated_at);
    }

    /// Records to forget once the snapshot is complete.
    ///
    /// A record counted at `t` but missing from a keyframe taken at `as_of`
    /// was either purged before it (a tombstone older than the TTL, so
    /// `t < as_of - ttl`) or created after it (`t > as_of`). `as_of` is not
    /// handed to handlers; `max(newest record in the snapshot, now - ttl)`
    /// stands in for it: at or below it, a record cannot be newer than the
    /// snapshot unless the keyframe is older than the TTL.
    pub fn leftovers(&self, now_us: i64, tombstone_ttl_us: i64) -> Vec<String> {
        let watermark = self.newest_in_snapshot.max(now_us.saturating_sub(tombstone_ttl_us));
        let mut out: Vec<String> = self
            .marked
            .iter()
            .filter(|(_, t)| **t <= watermark)
            .map(|(id, _)| id.clone())
            .collect();
        out.sort();
        out
    }
}

/// A master card: one product in one region.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CardId {
    pub region: String,
    pub product_id: String,
}

/// An aggregate that a batch may have changed; kept in a "dirty" set until
/// its change is published, so a crash in between is repaired on restart.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dirty {
    Card { region: String, product_id: String },
    Category { brand_id: i64, place_id: i64, category: String },
}

impl Dirty {
    /// The canonical text stored in Redis (JSON: stable field order).
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn decode(text: &str) -> Option<Dirty> {
        serde_json::from_str(text).ok()
    }
}

/// A change to one card's set of qualifying offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CardOp {
    Put { place: PlaceKey, price: i64, currency: Option<String> },
    Remove { place: PlaceKey },
}

/// The operations of one card in a batch, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CardWork {
    pub ops: Vec<CardOp>,
    /// Newest `updated_at` that touched the card (the event's `at`).
    pub at: i64,
}

/// One record's step in its place: leave a category set, join one, and
/// what to remember of it (`None`: forget it).
#[derive(Debug, Clone, PartialEq)]
pub struct PlaceOp {
    pub product_id: String,
    pub remove: Option<String>,
    pub add: Option<String>,
    pub seen: Option<Seen>,
}

/// The operations of one place in a batch, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlaceWork {
    pub ops: Vec<PlaceOp>,
    /// Categories whose emptiness may have changed, with the newest `at`.
    pub categories: BTreeMap<String, i64>,
}

/// What a batch does to Redis: per card and per place, in order.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    pub cards: BTreeMap<CardId, CardWork>,
    pub places: BTreeMap<PlaceKey, PlaceWork>,
    /// Versions older than what was already counted (skipped).
    pub stale: usize,
}

impl Plan {
    fn card(&mut self, id: CardId, at: i64) -> &mut CardWork {
        let w = self.cards.entry(id).or_default();
        w.at = w.at.max(at);
        w
    }

    fn category(&mut self, place: PlaceKey, category: &str, at: i64) {
        let w = self.places.entry(place).or_default();
        let e = w.categories.entry(category.to_string()).or_insert(at);
        *e = (*e).max(at);
    }

    /// Adds an aggregate to recompute without changing its sets (recovery).
    pub fn touch(&mut self, dirty: Dirty, at: i64) {
        match dirty {
            Dirty::Card { region, product_id } => {
                self.card(CardId { region, product_id }, at);
            }
            Dirty::Category { brand_id, place_id, category } => {
                self.category(PlaceKey::new(brand_id, place_id), &category, at);
            }
        }
    }

    /// Every aggregate the plan may change.
    pub fn dirty(&self) -> Vec<Dirty> {
        let cards = self
            .cards
            .keys()
            .map(|id| Dirty::Card { region: id.region.clone(), product_id: id.product_id.clone() });
        let categories = self.places.iter().flat_map(|(place, w)| {
            w.categories.keys().map(|c| Dirty::Category {
                brand_id: place.brand_id,
                place_id: place.place_id,
                category: c.clone(),
            })
        });
        cards.chain(categories).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.cards.is_empty() && self.places.is_empty()
    }
}

/// Turns items into set operations. `seen` holds what was counted before
/// the batch for (at least) every record of the batch; it is updated as the
/// items are planned, so a record appearing twice in a batch moves from its
/// first new state to its second.
///
/// Each qualifying version re-asserts its membership (a put of the same
/// member with the same score is a no-op), so replaying a keyframe repairs
/// sets that drifted; retraction is driven by what was counted, never by the
/// update's `before`.
pub fn plan(items: &[Item], seen: &mut HashMap<(PlaceKey, String), Seen>) -> Plan {
    let mut plan = Plan::default();
    for item in items {
        let key = (item.place, item.product_id.clone());
        let old = seen.get(&key);
        let (new, at) = match &item.action {
            Action::Version { updated_at, contribution } => {
                if old.is_some_and(|o| *updated_at < o.updated_at) {
                    plan.stale += 1;
                    continue;
                }
                (
                    Some(Seen { updated_at: *updated_at, contribution: contribution.clone() }),
                    *updated_at,
                )
            }
            Action::Forget { at } => {
                if old.is_none() {
                    continue;
                }
                (None, *at)
            }
        };
        let old_c = old.map(|o| o.contribution.clone()).unwrap_or_default();
        let new_c = new.as_ref().map(|s| s.contribution.clone()).unwrap_or_default();

        if let Some(o) = &old_c.card
            && new_c.card.as_ref().is_none_or(|n| n.region != o.region)
        {
            let id = CardId { region: o.region.clone(), product_id: item.product_id.clone() };
            plan.card(id, at).ops.push(CardOp::Remove { place: item.place });
        }
        if let Some(n) = &new_c.card {
            let id = CardId { region: n.region.clone(), product_id: item.product_id.clone() };
            plan.card(id, at).ops.push(CardOp::Put {
                place: item.place,
                price: n.price,
                currency: n.currency.clone(),
            });
        }

        let remove = old_c.category.filter(|c| new_c.category.as_ref() != Some(c));
        let add = new_c.category;
        for c in remove.iter().chain(add.iter()) {
            plan.category(item.place, c, at);
        }
        plan.places.entry(item.place).or_default().ops.push(PlaceOp {
            product_id: item.product_id.clone(),
            remove,
            add,
            seen: new.clone(),
        });
        match new {
            Some(s) => seen.insert(key, s),
            None => seen.remove(&key),
        };
    }
    plan
}

/// A set member naming an offer's place, ordered like `(brand, place)`:
/// Redis orders equal scores by member bytes, so fixed-width hex of the
/// sign-flipped ids makes the first member at the minimum price the one
/// with the smallest brand, then place — the tie rule of `MasterCard`.
pub fn member(place: PlaceKey) -> String {
    let flip = |x: i64| (x as u64) ^ (1 << 63);
    format!("{:016x}:{:016x}", flip(place.brand_id), flip(place.place_id))
}

pub fn parse_member(member: &str) -> Option<PlaceKey> {
    let (b, p) = member.split_once(':')?;
    let unflip = |s: &str| -> Option<i64> {
        if s.len() != 16 {
            return None;
        }
        u64::from_str_radix(s, 16).ok().map(|x| (x ^ (1 << 63)) as i64)
    };
    Some(PlaceKey::new(unflip(b)?, unflip(p)?))
}

/// An offer's price and currency as stored next to its member.
pub fn offer_entry(price: i64, currency: Option<&str>) -> String {
    format!("{price}:{}", currency.unwrap_or(""))
}

pub fn parse_offer_entry(entry: &str) -> Option<(i64, Option<String>)> {
    let (price, currency) = entry.split_once(':')?;
    Some((price.parse().ok()?, Some(currency).filter(|c| !c.is_empty()).map(String::from)))
}

/// The cheapest qualifying offer of a card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cheapest {
    pub place: PlaceKey,
    pub price: i64,
    pub currency: Option<String>,
}

/// The card for `offers` qualifying offers with `cheapest` the minimum
/// (`None`, with 0 offers: retracted).
pub fn master_card(id: &CardId, offers: u64, cheapest: Option<&Cheapest>) -> MasterCard {
    MasterCard {
        region: id.region.clone(),
        product_id: id.product_id.clone(),
        min_price: cheapest.map(|c| c.price),
        offers: u32::try_from(offers).unwrap_or(u32::MAX),
        cheapest: cheapest
            .map(|c| RecordKey::new(c.place.brand_id, c.place.place_id, id.product_id.clone())),
        currency: cheapest.and_then(|c| c.currency.clone()),
    }
}

/// A card as it stands after a batch, next to what was last published.
#[derive(Debug, Clone, PartialEq)]
pub struct CardOutcome {
    pub id: CardId,
    pub current: MasterCard,
    /// `None`: never published (or forgotten): the same as retracted.
    pub published: Option<MasterCard>,
    /// Version of the last published change (0: none).
    pub version: u64,
    pub at: i64,
}

/// A card change to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct CardChange {
    pub id: CardId,
    pub card: MasterCard,
    /// The version this change becomes once published.
    pub version: u64,
    pub at: i64,
}

impl CardOutcome {
    /// The change to publish, if the card differs from the published one.
    pub fn change(self) -> Option<CardChange> {
        let published = self.published.unwrap_or_else(|| master_card(&self.id, 0, None));
        (published != self.current).then(|| CardChange {
            id: self.id,
            card: self.current,
            version: self.version + 1,
            at: self.at,
        })
    }
}

/// A category of a place as it stands after a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct CategoryOutcome {
    pub place: PlaceKey,
    pub category: String,
    /// Qualifying offers in it now.
    pub count: u64,
    /// Whether it was last published non-empty.
    pub published: bool,
    pub version: u64,
    pub at: i64,
}

/// A category flip to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct Flip {
    pub place: PlaceKey,
    pub category: String,
    pub non_empty: bool,
    pub version: u64,
    pub at: i64,
}

impl CategoryOutcome {
    pub fn flip(self) -> Option<Flip> {
        let non_empty = self.count > 0;
        (non_empty != self.published).then(|| Flip {
            place: self.place,
            category: self.category,
            non_empty,
            version: self.version + 1,
            at: self.at,
        })
    }
}

fn hash(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// `Nats-Msg-Id` of a card change: the card, the version it becomes and a
/// digest of its content. A change recomputed after a crash (same version,
/// same content) is dropped by JetStream as a duplicate; a different content
/// at the same version is not; the same content again later (A→B→A→B) has
/// another version.
pub fn card_msg_id(change: &CardChange) -> String {
    use prost::Message;
    let name = format!("{}\0{}", change.id.region, change.id.product_id);
    format!(
        "agg:card:{:016x}:{}:{:016x}",
        hash(name.as_bytes()),
        change.version,
        hash(&change.card.encode_to_vec())
    )
}

/// `Nats-Msg-Id` of a category flip (flips alternate, so the version and
/// the direction say everything).
pub fn flip_msg_id(flip: &Flip) -> String {
    format!(
        "agg:cat:{}:{}:{:016x}:{}:{}",
        flip.place.brand_id,
        flip.place.place_id,
        hash(flip.category.as_bytes()),
        flip.version,
        u8::from(flip.non_empty)
    )
}

#[cfg(test)]
mod tests;

//! Tests of the pure storage core (docs/DESIGN.md, Storage semantics).
//! Batches go through [`Store`], an in-memory stand-in that loads slots and
//! commits dirty ones the way `store` does against Redis, so scenarios
//! spanning several batches behave as they do in production. Properties at
//! the end compare the core with a deliberately naive model of the merge.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::prelude::*;
use prost::Message;
use shelfsync_proto::product_field::{
    CURRENCY, DESCRIPTION, IMAGES, OLD_PRICE, PRICE, STOCK, TITLE,
};
use shelfsync_proto::state_field::HIDDEN;
use shelfsync_proto::{Product, RecordState};

use super::*;

// ------------------------------------------------------------------ fixtures

const BRAND: i64 = 7;
const PLACE: i64 = 42;
const OTHER_PLACE: i64 = 43;
/// Wall clock of a store's first batch; every batch runs one second later.
const T0: i64 = 1_700_000_000_000_000;
const SECOND: i64 = 1_000_000;
/// Generations of full imports (their start times).
const G1: i64 = 1_000;
const G2: i64 = 2_000;
const G3: i64 = 3_000;

fn key(id: &str) -> Key {
    (BRAND, PLACE, id.to_string())
}

fn key_of(c: &Change) -> Key {
    let k = c.key.as_ref().expect("a change carries its key");
    (k.brand_id, k.place_id, k.product_id.clone())
}

fn origin() -> Origin {
    Origin { source: "flowers".into(), import_id: "run-1".into(), published_at: 0 }
}

fn title(t: &str) -> Product {
    Product { title: Some(t.into()), ..Default::default() }
}

fn price(price: i64, old_price: i64) -> Product {
    Product { price: Some(price), old_price: Some(old_price), ..Default::default() }
}

fn stock(n: i64) -> Product {
    Product { stock: Some(n), ..Default::default() }
}

fn hidden(h: bool) -> RecordState {
    RecordState { hidden: Some(h), ..Default::default() }
}

fn data_of(r: &Record) -> Product {
    Product::decode(r.data.as_slice()).expect("record data is a Product")
}

fn state_of(r: &Record) -> RecordState {
    RecordState::decode(r.state.as_slice()).expect("record state is a RecordState")
}

/// A delta PATCH (generation 0) of `id` in `place`.
fn patch_at(place: i64, id: &str, data: &Product) -> Command {
    Command {
        key: Some(RecordKey::new(BRAND, place, id)),
        kind: CommandKind::Patch as i32,
        data: data.encode_to_vec(),
        origin: Some(origin()),
        ..Default::default()
    }
}

/// A delta PATCH (generation 0) of `id` in [`PLACE`].
fn patch(id: &str, data: &Product) -> Command {
    patch_at(PLACE, id, data)
}

/// A PATCH of the state only, as a validator sends it.
fn state_patch(id: &str, state: &RecordState) -> Command {
    Command { state: state.encode_to_vec(), ..patch(id, &Product::default()) }
}

fn save(id: &str, data: &Product, state: &RecordState) -> Command {
    Command { kind: CommandKind::Save as i32, state: state.encode_to_vec(), ..patch(id, data) }
}

fn delete(id: &str) -> Command {
    Command { kind: CommandKind::Delete as i32, ..patch(id, &Product::default()) }
}

/// The same command, sent by a full import that started at `generation`.
fn imported(generation: i64, cmd: Command) -> Command {
    Command { generation, ..cmd }
}

/// The same command, applied only if the record is at `updated_at` (CAS).
fn expecting(updated_at: i64, cmd: Command) -> Command {
    Command { expected_updated_at: Some(updated_at), ..cmd }
}

fn clearing(fields: &[u32], cmd: Command) -> Command {
    Command { clear_data_fields: fields.to_vec(), ..cmd }
}

fn sweep_at(place: i64, generation: i64) -> Sweep {
    Sweep {
        brand_id: BRAND,
        place_id: place,
        generation,
        source: "flowers".into(),
        import_id: format!("import-{generation}"),
        ..Default::default()
    }
}

fn sweep(generation: i64) -> Sweep {
    sweep_at(PLACE, generation)
}

fn batch(commands: Vec<Command>) -> CommandBatch {
    CommandBatch { partition: 0, commands, sweeps: Vec::new(), origin: None }
}

fn batch_then_sweep(commands: Vec<Command>, sweep: Sweep) -> CommandBatch {
    CommandBatch { sweeps: vec![sweep], ..batch(commands) }
}

fn kind(c: &Change) -> ChangeKind {
    ChangeKind::try_from(c.kind).expect("a known change kind")
}

fn after(c: &Change) -> &Record {
    c.after.as_ref().expect("a change carries the record after it")
}

fn before(c: &Change) -> &Record {
    c.before.as_ref().expect("this change carries the record before it")
}

// ------------------------------------------------------- the in-memory store

/// Redis as `store` lays it out for one partition: records (without key
/// and generation), the generation column, and the tombstone index.
#[derive(Debug, Clone)]
struct Store {
    records: BTreeMap<Key, Record>,
    gens: BTreeMap<Key, GenEntry>,
    tombstones: BTreeSet<Key>,
    /// Per place and generation: what that full import carried.
    touched: TouchedSets,
    limits: Limits,
}

/// Per swept place, its generation column as `apply_batch` takes it.
type SweepGens = HashMap<PlaceKey, SweptPlace>;

/// One applied batch: what the core said and the slots it left to commit.
struct Applied {
    outcome: Outcome,
    slots: Slots,
}

impl Applied {
    fn only_change(&self) -> &Change {
        match self.outcome.changes.as_slice() {
            [c] => c,
            other => panic!("expected exactly one change, got {other:#?}"),
        }
    }

    fn slot(&self, id: &str) -> &Slot {
        self.slots.get(&key(id)).expect("the batch loaded this key")
    }

    fn reasons(&self) -> Vec<&str> {
        self.outcome.rejections.iter().map(|r| r.reason.as_str()).collect()
    }

    /// `(product_id, kind, after.absent)` of every change, in order.
    fn summary(&self) -> Vec<(String, ChangeKind, bool)> {
        self.outcome.changes.iter().map(|c| (key_of(c).2, kind(c), after(c).absent)).collect()
    }
}

impl Store {
    /// One partition owning every place, so every key is valid.
    fn new() -> Self {
        Self::with_partitions(1)
    }

    /// `partitions` partitions; this store owns the one of [`PLACE`].
    fn with_partitions(partitions: u32) -> Self {
        Store {
            records: BTreeMap::new(),
            gens: BTreeMap::new(),
            tombstones: BTreeSet::new(),
            touched: TouchedSets::default(),
            limits: Limits {
                partition: shelfsync_bus::partition_of(BRAND, PLACE, partitions).0,
                partitions,
                max_record_bytes: 4096,
                now_us: T0,
            },
        }
    }

    /// Wall clock the next batch will run at.
    fn now(&self) -> i64 {
        self.limits.now_us
    }

    /// Load, apply, commit; the clock then moves on by a second.
    fn run(&mut self, batch: &CommandBatch) -> Applied {
        let (mut slots, sweep_gens) = self.load(batch);
        let outcome = apply_batch(batch, &mut slots, &sweep_gens, &self.limits);
        self.commit(&slots);
        self.touched.commit(&outcome.touched, &outcome.sweeps);
        self.limits.now_us += SECOND;
        Applied { outcome, slots }
    }

    /// [`Store::run`] with the wall clock at `now_us` (clock skew).
    fn run_at(&mut self, batch: &CommandBatch, now_us: i64) -> Applied {
        self.limits.now_us = now_us;
        self.run(batch)
    }

    fn slot(&self, k: &Key) -> Slot {
        Slot {
            record: self.records.get(k).cloned(),
            generation: self.gens.get(k).map_or(0, |e| e.generation),
            ..Default::default()
        }
    }

    /// What `Store::load` reads: a slot for every command key, and per swept
    /// place its generation column plus a slot for every sweep candidate.
    fn load(&self, batch: &CommandBatch) -> (Slots, SweepGens) {
        let (keys, places) = touched(batch);
        let mut slots: Slots = keys
            .into_iter()
            .map(|k| {
                let slot = self.slot(&k);
                (k, slot)
            })
            .collect();
        let mut sweep_gens = HashMap::new();
        for place in places {
            let column: Vec<(String, GenEntry)> = self
                .gens
                .iter()
                .filter(|((b, p, _), _)| PlaceKey::new(*b, *p) == place)
                .map(|((_, _, id), e)| (id.clone(), *e))
                .collect();
            let touched = self.touched.of_place(place);
            for s in batch.sweeps.iter().filter(|s| s.place() == place) {
                for id in sweep_candidates(s, &column, touched.get(&s.generation)) {
                    let k = (place.brand_id, place.place_id, id);
                    let slot = self.slot(&k);
                    slots.entry(k).or_insert(slot);
                }
            }
            sweep_gens.insert(place, SweptPlace { column, held: None, touched });
        }
        (slots, sweep_gens)
    }

    /// What `Store::commit` writes, through the same encodings Redis holds.
    fn commit(&mut self, slots: &Slots) {
        for (k, slot) in slots {
            if slot.record_dirty
                && let Some(r) = &slot.record
            {
                let stored = Record { key: None, generation: 0, ..r.clone() };
                let stored = Record::decode(stored.encode_to_vec().as_slice())
                    .expect("a record survives its encoding");
                self.records.insert(k.clone(), stored);
            }
            if slot.gen_dirty {
                let entry = GenEntry::decode(slot.gen_entry().encode().as_bytes())
                    .expect("a generation entry survives its encoding");
                self.gens.insert(k.clone(), entry);
            }
            match slot.tombstone {
                Some(true) => {
                    self.tombstones.insert(k.clone());
                }
                Some(false) => {
                    self.tombstones.remove(k);
                }
                None => {}
            }
        }
    }

    fn get(&self, id: &str) -> Option<&Record> {
        self.records.get(&key(id))
    }

    fn record(&self, id: &str) -> &Record {
        self.get(id).expect("the record is stored")
    }

    fn data(&self, id: &str) -> Product {
        data_of(self.record(id))
    }

    fn gen_entry(&self, id: &str) -> GenEntry {
        *self.gens.get(&key(id)).expect("the generation is stored")
    }

    /// Every record as a consumer observes it, with its generation.
    fn snapshot(&self) -> BTreeMap<Key, Observed> {
        self.records
            .iter()
            .map(|(k, r)| {
                let generation = self.gens.get(k).map_or(0, |e| e.generation);
                (k.clone(), Observed::of(r, generation))
            })
            .collect()
    }
}

// ------------------------------------------------------------ create, patch

#[test]
fn a_patch_of_a_missing_record_creates_it() {
    let mut store = Store::new();
    let roses = Product {
        title: Some("Red roses, 25 pcs".into()),
        price: Some(349_000),
        ..Default::default()
    };

    let run = store.run(&batch(vec![patch("sku-1", &roses)]));

    let c = run.only_change();
    assert_eq!(kind(c), ChangeKind::Created);
    assert_eq!(c.before, None);
    assert_eq!(c.key, Some(RecordKey::new(BRAND, PLACE, "sku-1")));
    assert_eq!(c.origin, Some(origin()));
    assert_eq!(c.changed_data_fields, vec![TITLE, PRICE]);
    assert_eq!(c.changed_state_fields, Vec::<u32>::new());
    let a = after(c);
    assert_eq!(data_of(a), roses);
    assert_eq!(a.key, c.key);
    assert_eq!((a.created_at, a.updated_at), (T0, T0));
    assert!(!a.absent && !a.deleted);
    assert_eq!((run.outcome.applied, run.outcome.unchanged), (1, 0));
    let slot = run.slot("sku-1");
    assert!(slot.record_dirty, "a new record is written");
    assert!(slot.gen_dirty, "a new record enters the generation column");
    assert_eq!(slot.tombstone, None);
    assert_eq!(store.record("sku-1"), &Record { key: None, ..a.clone() });
    assert_eq!(store.gen_entry("sku-1"), GenEntry::default());
}

#[test]
fn a_command_without_an_origin_has_its_batch_s() {
    let mut store = Store::new();
    let of_batch = Origin { source: "batch".into(), ..origin() };
    let own = patch("own", &price(100, 120));
    let bare = Command { origin: None, ..patch("bare", &price(100, 120)) };
    let bad = Command { kind: 99, origin: None, ..patch("bad", &price(1, 1)) };
    let b = CommandBatch { origin: Some(of_batch.clone()), ..batch(vec![own, bare, bad]) };

    let run = store.run(&b);

    let origins: Vec<_> = run.outcome.changes.iter().map(|c| c.origin.clone()).collect();
    assert_eq!(origins, vec![Some(origin()), Some(of_batch.clone())]);
    assert_eq!(run.outcome.rejections[0].origin, Some(of_batch));
}

#[test]
fn an_identical_patch_changes_nothing_and_keeps_updated_at() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &price(100, 120))]));
    let stored = store.record("sku").clone();

    let run = store.run(&batch(vec![patch("sku", &price(100, 120))]));

    assert!(run.outcome.changes.is_empty(), "{:#?}", run.outcome.changes);
    assert_eq!((run.outcome.applied, run.outcome.unchanged), (1, 1));
    let slot = run.slot("sku");
    assert!(!slot.record_dirty && !slot.gen_dirty);
    assert_eq!(store.record("sku"), &stored);
    assert_eq!(store.record("sku").updated_at, T0);
}

#[test]
fn price_and_stock_feeds_glue_without_clearing_each_other() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &title("Roses"))]));
    store.run(&batch(vec![patch("sku", &price(0, 399))]));
    store.run(&batch(vec![patch("sku", &stock(0))]));

    assert_eq!(
        store.data("sku"),
        Product {
            title: Some("Roses".into()),
            price: Some(0),
            old_price: Some(399),
            stock: Some(0),
            ..Default::default()
        }
    );

    let run = store.run(&batch(vec![patch("sku", &price(349, 399))]));
    let c = run.only_change();
    assert_eq!(kind(c), ChangeKind::Updated);
    assert_eq!(c.changed_data_fields, vec![PRICE]);
    let glued = data_of(after(c));
    assert_eq!(glued.stock, Some(0), "the price feed must not clear stock");
    assert_eq!(glued.title.as_deref(), Some("Roses"));
    assert_eq!(glued.price, Some(349));
}

#[test]
fn zero_is_a_value_not_an_absence() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &stock(3))]));

    let run = store.run(&batch(vec![patch("sku", &stock(0))]));
    let c = run.only_change();
    assert_eq!(c.changed_data_fields, vec![STOCK]);
    assert_eq!(data_of(after(c)).stock, Some(0));

    let again = store.run(&batch(vec![patch("sku", &stock(0))]));
    assert!(again.outcome.changes.is_empty(), "stock 0 again is no change");

    let priced =
        store.run(&batch(vec![patch("sku", &Product { price: Some(0), ..Default::default() })]));
    assert_eq!(priced.only_change().changed_data_fields, vec![PRICE]);
    assert_eq!(store.data("sku").price, Some(0));
}

#[test]
fn clearing_a_data_field_removes_it_and_reports_that_field() {
    let mut store = Store::new();
    let full = Product {
        title: Some("Tulips".into()),
        description: Some("Fresh".into()),
        ..Default::default()
    };
    store.run(&batch(vec![patch("sku", &full)]));

    let run = store.run(&batch(vec![clearing(&[DESCRIPTION], patch("sku", &Product::default()))]));

    let c = run.only_change();
    assert_eq!(kind(c), ChangeKind::Updated);
    assert_eq!(c.changed_data_fields, vec![DESCRIPTION]);
    assert_eq!(data_of(after(c)), title("Tulips"));
    assert_eq!(data_of(before(c)), full);
    assert_eq!(store.data("sku"), title("Tulips"));

    let again =
        store.run(&batch(vec![clearing(&[DESCRIPTION], patch("sku", &Product::default()))]));
    assert!(again.outcome.changes.is_empty(), "clearing an absent field changes nothing");
}

#[test]
fn a_clear_wins_over_the_same_field_in_the_patch() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &stock(4))]));

    store.run(&batch(vec![clearing(&[STOCK], patch("sku", &stock(9)))]));

    assert_eq!(store.data("sku").stock, None);
}

#[test]
fn changed_data_fields_lists_exactly_the_fields_that_changed() {
    let mut store = Store::new();
    store.run(&batch(vec![patch(
        "sku",
        &Product {
            title: Some("Lilies".into()),
            price: Some(10),
            stock: Some(2),
            images: vec!["1.jpg".into(), "2.jpg".into()],
            ..Default::default()
        },
    )]));

    let run = store.run(&batch(vec![patch(
        "sku",
        &Product {
            title: Some("Lilies".into()),
            price: Some(11),
            images: vec!["1.jpg".into()],
            currency: Some("RUB".into()),
            ..Default::default()
        },
    )]));

    let c = run.only_change();
    assert_eq!(c.changed_data_fields, vec![PRICE, CURRENCY, IMAGES]);
    assert_eq!(c.changed_state_fields, Vec::<u32>::new());
    let merged = data_of(after(c));
    assert_eq!(merged.images, vec!["1.jpg".to_string()], "repeated fields are replaced whole");
    assert_eq!(merged.stock, Some(2));
}

#[test]
fn a_state_patch_reports_state_fields_and_keeps_the_data() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &price(5, 6))]));

    let run = store.run(&batch(vec![state_patch("sku", &hidden(true))]));

    let c = run.only_change();
    assert_eq!(c.changed_data_fields, Vec::<u32>::new());
    assert_eq!(c.changed_state_fields, vec![HIDDEN]);
    assert_eq!(state_of(after(c)), hidden(true));
    assert_eq!(data_of(after(c)), price(5, 6));

    let unhide = store.run(&batch(vec![state_patch("sku", &hidden(false))]));
    assert_eq!(
        state_of(after(unhide.only_change())).hidden,
        Some(false),
        "false is present, not cleared"
    );
}

#[test]
fn save_replaces_data_and_state_whole() {
    let mut store = Store::new();
    store.run(&batch(vec![
        patch(
            "sku",
            &Product {
                title: Some("Roses".into()),
                price: Some(1),
                stock: Some(2),
                ..Default::default()
            },
        ),
        state_patch("sku", &hidden(true)),
    ]));

    let run = store.run(&batch(vec![save(
        "sku",
        &Product { price: Some(1), ..Default::default() },
        &RecordState::default(),
    )]));

    let c = run.only_change();
    assert_eq!(c.changed_data_fields, vec![TITLE, STOCK]);
    assert_eq!(c.changed_state_fields, vec![HIDDEN]);
    let r = store.record("sku");
    assert_eq!(data_of(r), Product { price: Some(1), ..Default::default() });
    assert!(r.state.is_empty());
}

#[test]
fn unknown_product_fields_survive_a_patch() {
    let mut store = Store::new();
    // Field 100 (varint 5) from a newer integration, unknown to `Product`.
    let newer = vec![0xa0, 0x06, 0x05];
    store.run(&batch(vec![Command { data: newer.clone(), ..patch("sku", &Product::default()) }]));

    store.run(&batch(vec![patch("sku", &stock(1))]));

    let stored = &store.record("sku").data;
    assert_eq!(shelfsync_merge::field_numbers(stored), Ok(vec![STOCK, 100]));
    assert!(stored.ends_with(&newer), "canonical order: 6 before 100");
}

#[test]
fn a_patch_with_fields_out_of_order_is_the_same_patch() {
    let mut store = Store::new();
    let mut reversed = stock(3).encode_to_vec();
    reversed.extend(title("Roses").encode_to_vec());
    store.run(&batch(vec![Command { data: reversed, ..patch("sku", &Product::default()) }]));

    let run = store.run(&batch(vec![patch(
        "sku",
        &Product { title: Some("Roses".into()), stock: Some(3), ..Default::default() },
    )]));

    assert!(run.outcome.changes.is_empty(), "stored bytes are canonical");
}

// --------------------------------------------------------------- generations

#[test]
fn a_full_import_that_changes_nothing_writes_nothing_and_counts_as_carried() {
    let mut store = Store::new();
    store.run(&batch(vec![imported(G1, patch("sku", &price(1, 2)))]));
    let stored = store.record("sku").clone();

    let run = store.run(&batch(vec![imported(G2, patch("sku", &price(1, 2)))]));

    assert!(run.outcome.changes.is_empty(), "{:#?}", run.outcome.changes);
    assert_eq!(run.outcome.unchanged, 1);
    let slot = run.slot("sku");
    assert!(!slot.gen_dirty, "no generation is written");
    assert!(!slot.record_dirty, "no record bytes are written");
    assert_eq!(store.record("sku"), &stored);
    assert_eq!(store.gen_entry("sku").generation, G1, "the last import that wrote it");
    let carried: Vec<(i64, &str)> =
        run.outcome.touched.iter().map(|t| (t.generation, t.product_id.as_str())).collect();
    assert_eq!(carried, [(G2, "sku")], "its sweep will spare it");

    // Why it matters: a validator's CAS on what it saw still wins.
    let cas = store.run(&batch(vec![expecting(T0, state_patch("sku", &hidden(true)))]));
    assert_eq!(cas.reasons(), Vec::<&str>::new());
    assert_eq!(cas.outcome.changes.len(), 1);
}

#[test]
fn a_delta_leaves_the_generation_alone() {
    let mut store = Store::new();
    store.run(&batch(vec![imported(G1, patch("sku", &price(1, 2)))]));

    let run = store.run(&batch(vec![patch("sku", &stock(5))]));

    assert_eq!(run.outcome.changes.len(), 1);
    assert_eq!(after(run.only_change()).generation, G1);
    assert_eq!(store.gen_entry("sku").generation, G1);
}

// -------------------------------------------------------------------- sweeps

/// A place imported at G1 with a, b, c, then at G2 with a only.
fn store_after_second_import_without_b_and_c() -> (Store, Applied) {
    let mut store = Store::new();
    store.run(&batch_then_sweep(
        vec![
            imported(G1, patch("a", &stock(1))),
            imported(G1, patch("b", &stock(2))),
            imported(G1, patch("c", &stock(3))),
        ],
        sweep(G1),
    ));
    let run = store.run(&batch_then_sweep(vec![imported(G2, patch("a", &stock(1)))], sweep(G2)));
    (store, run)
}

#[test]
fn a_sweep_marks_records_missing_from_the_import_absent() {
    let (store, run) = store_after_second_import_without_b_and_c();
    let swept_at = T0 + SECOND;

    assert_eq!(
        run.summary(),
        vec![
            ("b".to_string(), ChangeKind::Updated, true),
            ("c".to_string(), ChangeKind::Updated, true),
        ]
    );
    for c in &run.outcome.changes {
        assert!(!before(c).absent);
        assert_eq!(after(c).updated_at, swept_at);
        assert!(after(c).updated_at > before(c).updated_at);
        assert_eq!(after(c).data, before(c).data);
        assert_eq!(c.changed_data_fields, Vec::<u32>::new());
        assert_eq!(after(c).generation, G1);
        let o = c.origin.as_ref().expect("a sweep change names its origin");
        assert_eq!((o.source.as_str(), o.import_id.as_str()), ("flowers", "import-2000"));
    }
    assert!(store.record("b").absent && store.record("c").absent);
    assert_eq!(
        store.gen_entry("b"),
        GenEntry { generation: G1, absent: true, deleted: false, updated_at: 0 }
    );
    let a = store.record("a");
    assert!(!a.absent);
    assert_eq!(a.updated_at, T0, "a record of the sweeping import is untouched");
    assert!(!run.slot("a").record_dirty);
}

#[test]
fn a_sweep_reports_an_already_absent_record_only_once() {
    let (mut store, _) = store_after_second_import_without_b_and_c();
    let b = store.record("b").clone();

    let run = store.run(&batch_then_sweep(vec![imported(G3, patch("a", &stock(1)))], sweep(G3)));

    assert!(run.outcome.changes.is_empty(), "{:#?}", run.outcome.changes);
    assert_eq!(store.record("b"), &b);
}

#[test]
fn a_full_import_brings_an_absent_record_back() {
    let (mut store, _) = store_after_second_import_without_b_and_c();

    let run = store.run(&batch_then_sweep(
        vec![imported(G3, patch("a", &stock(1))), imported(G3, patch("b", &stock(2)))],
        sweep(G3),
    ));

    let c = run.only_change();
    assert_eq!(key_of(c), key("b"));
    assert_eq!(kind(c), ChangeKind::Updated);
    assert!(before(c).absent && !after(c).absent);
    assert_eq!(c.changed_data_fields, Vec::<u32>::new());
    assert_eq!(after(c).generation, G3);
    assert!(!store.record("b").absent);
    assert_eq!(store.gen_entry("b").generation, G3);
}

#[test]
fn a_delta_patch_does_not_bring_an_absent_record_back() {
    let (mut store, _) = store_after_second_import_without_b_and_c();

    let same = store.run(&batch(vec![patch("b", &stock(2))]));
    assert!(same.outcome.changes.is_empty());

    let changed = store.run(&batch(vec![patch("b", &stock(7))]));
    let c = changed.only_change();
    assert_eq!(c.changed_data_fields, vec![STOCK]);
    assert!(after(c).absent, "only a full import makes a record present");
    assert!(store.record("b").absent);
    assert_eq!(store.gen_entry("b").generation, G1);
}

#[test]
fn a_sweep_spares_other_places_deleted_records_and_newer_generations() {
    let mut store = Store::new();
    store.run(&batch(vec![
        imported(G1, patch_at(OTHER_PLACE, "elsewhere", &stock(1))),
        imported(G1, patch("deleted", &stock(1))),
        imported(G3, patch("newer", &stock(1))),
    ]));
    store.run(&batch(vec![delete("deleted")]));
    let before_sweep = store.records.clone();

    let run = store.run(&batch_then_sweep(vec![], sweep(G2)));

    assert!(run.outcome.changes.is_empty(), "{:#?}", run.outcome.changes);
    assert_eq!(store.records, before_sweep);
}

#[test]
fn a_record_created_by_a_delta_earlier_in_the_sweeping_batch_is_swept() {
    let mut store = Store::new();

    let run = store.run(&batch_then_sweep(
        vec![patch("delta", &stock(1)), imported(G1, patch("full", &stock(2)))],
        sweep(G1),
    ));

    assert_eq!(
        run.summary(),
        vec![
            ("delta".to_string(), ChangeKind::Created, false),
            ("full".to_string(), ChangeKind::Created, false),
            ("delta".to_string(), ChangeKind::Updated, true),
        ]
    );
    assert!(store.record("delta").absent);
    assert!(!store.record("full").absent);
    assert_eq!(store.gen_entry("full").generation, G1);
}

#[test]
fn a_delta_during_a_full_import_neither_saves_a_vanished_record_nor_gets_a_live_one_swept() {
    let mut store = Store::new();
    store.run(&batch_then_sweep(
        vec![imported(G1, patch("kept", &stock(1))), imported(G1, patch("vanished", &stock(1)))],
        sweep(G1),
    ));

    store.run(&batch_then_sweep(
        vec![
            imported(G2, patch("kept", &stock(1))),
            patch("kept", &stock(5)),
            patch("vanished", &stock(5)),
        ],
        sweep(G2),
    ));

    let kept = store.record("kept");
    assert!(!kept.absent);
    assert_eq!(data_of(kept).stock, Some(5));
    // Carried unchanged by G2, then changed by a delta: the last import
    // that wrote it is still G1; the touched set spared it.
    assert_eq!(store.gen_entry("kept").generation, G1);
    let vanished = store.record("vanished");
    assert!(vanished.absent);
    assert_eq!(data_of(vanished).stock, Some(5));
}

// ----------------------------------------------------------------------- CAS

#[test]
fn cas_on_the_current_updated_at_applies() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &price(1, 2))]));

    let run = store.run(&batch(vec![expecting(T0, state_patch("sku", &hidden(true)))]));

    assert_eq!(run.reasons(), Vec::<&str>::new());
    assert_eq!(after(run.only_change()).updated_at, T0 + SECOND);
    assert_eq!(state_of(store.record("sku")), hidden(true));
}

#[test]
fn cas_on_a_stale_updated_at_is_a_conflict_and_moves_nothing() {
    let mut store = Store::new();
    store.run(&batch(vec![imported(G1, patch("sku", &price(1, 2)))]));
    let stored = store.record("sku").clone();

    let stale = imported(G2, expecting(T0 - 1, state_patch("sku", &hidden(true))));
    let run = store.run(&batch(vec![stale.clone()]));

    assert_eq!(run.reasons(), vec![reason::CONFLICT]);
    let r = &run.outcome.rejections[0];
    assert_eq!(r.command.as_ref(), Some(&stale));
    assert_eq!(r.key, stale.key);
    assert_eq!(r.origin, Some(origin()));
    assert!(run.outcome.changes.is_empty());
    assert_eq!(run.outcome.applied, 0);
    let slot = run.slot("sku");
    assert!(!slot.record_dirty && !slot.gen_dirty);
    assert_eq!(store.record("sku"), &stored);
    assert_eq!(store.gen_entry("sku").generation, G1, "not even the generation");
}

#[test]
fn cas_expecting_zero_creates_a_missing_record() {
    let mut store = Store::new();

    let run = store.run(&batch(vec![expecting(0, patch("sku", &stock(1)))]));

    assert_eq!(kind(run.only_change()), ChangeKind::Created);
    assert_eq!(store.data("sku"), stock(1));
}

#[test]
fn cas_expecting_a_time_on_a_missing_record_is_a_conflict() {
    let mut store = Store::new();

    let run = store.run(&batch(vec![expecting(T0, patch("sku", &stock(1)))]));

    assert_eq!(run.reasons(), vec![reason::CONFLICT]);
    assert!(run.outcome.changes.is_empty());
    assert_eq!(store.get("sku"), None);
    assert!(store.gens.is_empty());
}

#[test]
fn cas_expecting_zero_on_an_existing_record_is_a_conflict() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &stock(1))]));

    let run = store.run(&batch(vec![expecting(0, patch("sku", &stock(2)))]));

    assert_eq!(run.reasons(), vec![reason::CONFLICT]);
    assert_eq!(store.data("sku"), stock(1));
}

// ------------------------------------------------------------------- deletes

#[test]
fn delete_leaves_a_tombstone_and_reports_deleted() {
    let mut store = Store::new();
    store.run(&batch(vec![imported(G1, patch("sku", &stock(1)))]));

    let run = store.run(&batch(vec![delete("sku")]));

    let c = run.only_change();
    assert_eq!(kind(c), ChangeKind::Deleted);
    assert!(!before(c).deleted && after(c).deleted);
    assert_eq!(after(c).updated_at, T0 + SECOND);
    assert_eq!(run.slot("sku").tombstone, Some(true));
    assert!(store.tombstones.contains(&key("sku")));
    assert!(store.record("sku").deleted);
    assert_eq!(
        store.gen_entry("sku"),
        GenEntry { generation: G1, absent: false, deleted: true, updated_at: 0 }
    );
}

#[test]
fn deleting_a_missing_record_changes_nothing() {
    let mut store = Store::new();

    let run = store.run(&batch(vec![delete("sku")]));

    assert!(run.outcome.changes.is_empty());
    assert_eq!((run.outcome.applied, run.outcome.unchanged), (1, 1));
    assert_eq!(run.slot("sku").tombstone, None);
    assert_eq!(store.get("sku"), None);
    assert!(store.tombstones.is_empty() && store.gens.is_empty());
}

#[test]
fn deleting_a_deleted_record_changes_nothing() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &stock(1)), delete("sku")]));
    let tombstone = store.record("sku").clone();

    let run = store.run(&batch(vec![delete("sku")]));

    assert!(run.outcome.changes.is_empty());
    assert_eq!(store.record("sku"), &tombstone);
}

#[test]
fn a_patch_after_delete_recreates_the_record_from_empty_data() {
    let mut store = Store::new();
    store.run(&batch(vec![patch(
        "sku",
        &Product { title: Some("Roses".into()), price: Some(10), ..Default::default() },
    )]));
    store.run(&batch(vec![state_patch("sku", &hidden(true))]));
    store.run(&batch(vec![delete("sku")]));
    let now = store.now();

    let run = store.run(&batch(vec![patch("sku", &stock(0))]));

    let c = run.only_change();
    assert_eq!(kind(c), ChangeKind::Created);
    let a = after(c);
    assert_eq!(data_of(a), stock(0), "the old fields are gone");
    assert!(a.state.is_empty(), "the old state is gone");
    assert!(!a.deleted);
    assert_eq!((a.created_at, a.updated_at), (now, now));
    assert_eq!(run.slot("sku").tombstone, Some(false));
    assert!(store.tombstones.is_empty());
    assert!(!store.gen_entry("sku").deleted);
}

#[test]
fn a_save_after_delete_recreates_the_record() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &stock(1)), delete("sku")]));

    let run = store.run(&batch(vec![save("sku", &stock(1), &hidden(false))]));

    assert_eq!(kind(run.only_change()), ChangeKind::Created);
    assert!(!store.record("sku").deleted);
    assert!(store.tombstones.is_empty());
}

#[test]
fn a_record_recreated_after_delete_is_reported_like_a_new_one() {
    let mut store = Store::new();
    store.run(&batch(vec![patch(
        "sku",
        &Product { title: Some("Roses".into()), price: Some(10), ..Default::default() },
    )]));
    store.run(&batch(vec![delete("sku")]));

    let run = store.run(&batch(vec![patch("sku", &price(10, 12))]));

    let c = run.only_change();
    assert_eq!(kind(c), ChangeKind::Created);
    assert_eq!(c.before, None, "proto: the record before; unset for CREATED");
    assert_eq!(
        c.changed_data_fields,
        vec![PRICE, OLD_PRICE],
        "every field of the new record, as for any creation"
    );
}

// ---------------------------------------------------------------- size limit

/// A product whose encoding is exactly `bytes` long (a description only).
fn product_of_size(bytes: usize) -> Product {
    assert!((3..=129).contains(&bytes), "one-byte length prefix");
    Product { description: Some("x".repeat(bytes - 2)), ..Default::default() }
}

#[test]
fn a_record_of_exactly_the_size_limit_is_accepted() {
    let mut store = Store::new();
    store.limits.max_record_bytes = 64;

    let run = store.run(&batch(vec![patch("sku", &product_of_size(64))]));

    assert_eq!(run.reasons(), Vec::<&str>::new());
    assert_eq!(store.record("sku").data.len(), 64);
}

#[test]
fn a_patch_over_the_size_limit_is_rejected_and_the_rest_of_the_batch_applies() {
    let mut store = Store::new();
    store.limits.max_record_bytes = 64;
    store.run(&batch(vec![patch("big", &product_of_size(40))]));
    let stored = store.record("big").clone();

    // Each part fits; merged with what is stored they do not (40 + 32).
    let run = store.run(&batch(vec![
        imported(G1, patch("big", &title(&"t".repeat(30)))),
        patch("small", &stock(1)),
    ]));

    assert_eq!(run.reasons(), vec![reason::TOO_LARGE]);
    assert_eq!(run.summary(), vec![("small".to_string(), ChangeKind::Created, false)]);
    assert_eq!(store.record("big"), &stored);
    assert_eq!(store.gen_entry("big").generation, 0, "a rejected command stamps nothing");
}

#[test]
fn the_size_limit_counts_data_and_state_together() {
    let mut store = Store::new();
    store.limits.max_record_bytes = 64;
    store.run(&batch(vec![patch("sku", &product_of_size(63))]));

    let run = store.run(&batch(vec![state_patch("sku", &hidden(true))]));

    assert_eq!(run.reasons(), vec![reason::TOO_LARGE]);
    assert!(store.record("sku").state.is_empty());
}

#[test]
fn a_record_over_a_lowered_size_limit_can_still_be_deleted() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &product_of_size(100))]));
    store.limits.max_record_bytes = 64;

    let run = store.run(&batch(vec![delete("sku")]));

    assert_eq!(run.reasons(), Vec::<&str>::new());
    assert!(store.record("sku").deleted);
}

// ----------------------------------------------------------- bad commands

/// Runs `bad` followed by a good command and returns the one rejection,
/// checking that the good command still applied.
fn rejected(store: &mut Store, bad: Command) -> Rejection {
    let good = format!("good-{}", store.now());
    let run = store.run(&batch(vec![bad.clone(), patch(&good, &stock(1))]));
    assert_eq!(run.outcome.rejections.len(), 1, "{:#?}", run.outcome);
    assert_eq!(
        run.summary(),
        vec![(good, ChangeKind::Created, false)],
        "a bad command must not block the rest of the batch"
    );
    let r = run.outcome.rejections[0].clone();
    assert_eq!(r.command.as_ref(), Some(&bad));
    r
}

#[test]
fn data_that_is_not_protobuf_is_malformed() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &stock(1))]));
    let stored = store.record("sku").clone();

    let bad = Command { data: vec![0xff, 0xff], ..patch("sku", &Product::default()) };
    assert_eq!(rejected(&mut store, bad).reason, reason::MALFORMED);
    assert_eq!(store.record("sku"), &stored);

    let bad_save = Command {
        data: vec![0xff, 0xff],
        ..save("new", &Product::default(), &RecordState::default())
    };
    assert_eq!(rejected(&mut store, bad_save).reason, reason::MALFORMED);
    assert_eq!(store.get("new"), None);
}

#[test]
fn state_that_is_not_protobuf_is_malformed() {
    let mut store = Store::new();
    let bad = Command { state: vec![0x08], ..patch("sku", &stock(1)) };

    assert_eq!(rejected(&mut store, bad).reason, reason::MALFORMED);
    assert_eq!(store.get("sku"), None);
}

#[test]
fn a_command_without_a_key_is_malformed() {
    let mut store = Store::new();
    let bad = Command { key: None, ..patch("sku", &stock(1)) };

    let r = rejected(&mut store, bad);
    assert_eq!(r.reason, reason::MALFORMED);
    assert_eq!(r.key, None);
}

#[test]
fn a_command_of_unknown_kind_is_malformed() {
    let mut store = Store::new();
    for k in [CommandKind::Unspecified as i32, 99] {
        let bad = Command { kind: k, ..patch("sku", &stock(1)) };
        assert_eq!(rejected(&mut store, bad).reason, reason::MALFORMED);
    }
    assert_eq!(store.get("sku"), None);
}

#[test]
fn a_product_id_must_be_1_to_512_bytes() {
    let mut store = Store::new();
    assert_eq!(rejected(&mut store, patch("", &stock(1))).reason, reason::MALFORMED);
    let too_long = "x".repeat(513);
    assert_eq!(rejected(&mut store, patch(&too_long, &stock(1))).reason, reason::MALFORMED);
    assert_eq!(store.get(&too_long), None);

    let longest = "x".repeat(512);
    let run = store.run(&batch(vec![patch(&longest, &stock(1))]));
    assert_eq!(run.reasons(), Vec::<&str>::new());
}

#[test]
fn a_command_for_a_place_of_another_partition_is_rejected() {
    let mut store = Store::with_partitions(8);
    let foreign = (1..)
        .find(|&p| shelfsync_bus::partition_of(BRAND, p, 8).0 != store.limits.partition)
        .expect("some place hashes to another partition");

    let r = rejected(&mut store, patch_at(foreign, "sku", &stock(1)));

    assert_eq!(r.reason, reason::WRONG_PARTITION);
    assert!(store.records.keys().all(|(_, p, _)| *p == PLACE));
}

#[test]
fn every_bad_command_in_a_batch_is_rejected_in_order_and_the_good_ones_apply() {
    let mut store = Store::with_partitions(8);
    let foreign = (1..)
        .find(|&p| shelfsync_bus::partition_of(BRAND, p, 8).0 != store.limits.partition)
        .expect("some place hashes to another partition");

    let run = store.run(&batch(vec![
        patch("good-1", &stock(1)),
        Command { data: vec![0xff, 0xff], ..patch("bad-data", &Product::default()) },
        Command { key: None, ..patch("no-key", &stock(1)) },
        Command { kind: 0, ..patch("kind-0", &stock(1)) },
        patch("", &stock(1)),
        patch_at(foreign, "elsewhere", &stock(1)),
        patch("good-2", &stock(2)),
    ]));

    assert_eq!(
        run.reasons(),
        vec![
            reason::MALFORMED,
            reason::MALFORMED,
            reason::MALFORMED,
            reason::MALFORMED,
            reason::WRONG_PARTITION
        ]
    );
    assert_eq!(
        run.summary(),
        vec![
            ("good-1".to_string(), ChangeKind::Created, false),
            ("good-2".to_string(), ChangeKind::Created, false),
        ]
    );
    assert_eq!((run.outcome.applied, run.outcome.unchanged), (2, 0));
    let stored: Vec<&str> = store.records.keys().map(|(_, _, id)| id.as_str()).collect();
    assert_eq!(stored, vec!["good-1", "good-2"]);
}

// ------------------------------------------------------------------ ordering

#[test]
fn updated_at_increases_strictly_even_when_the_clock_goes_back() {
    let mut store = Store::new();
    let steps = [
        (T0, batch(vec![patch("sku", &title("a"))])),
        (T0 - 10 * SECOND, batch(vec![patch("sku", &title("b"))])),
        (T0 - 20 * SECOND, batch(vec![delete("sku")])),
        (T0 - 30 * SECOND, batch(vec![patch("sku", &title("c"))])),
        (T0 - 40 * SECOND, batch_then_sweep(vec![], sweep(G1))),
    ];

    let mut last = 0;
    for (now, b) in &steps {
        let run = store.run_at(b, *now);
        let c = run.only_change();
        if let Some(prev) = &c.before {
            assert_eq!(prev.updated_at, last);
        }
        assert!(
            after(c).updated_at > last,
            "{:?} at {now}: {} after {last}",
            kind(c),
            after(c).updated_at
        );
        last = after(c).updated_at;
    }
    assert_eq!(last, T0 + 4);
    assert!(store.record("sku").absent);
    assert_eq!(store.record("sku").created_at, T0 + 3, "recreated at its new time");
}

#[test]
fn two_commands_on_one_record_in_a_batch_chain_before_and_after() {
    let mut store = Store::new();
    let now = store.now();

    let run = store
        .run(&batch(vec![imported(G1, patch("sku", &price(1, 2))), patch("sku", &price(3, 2))]));

    let [first, second] = run.outcome.changes.as_slice() else {
        panic!("two changes expected: {:#?}", run.outcome.changes);
    };
    assert_eq!(kind(first), ChangeKind::Created);
    assert_eq!(kind(second), ChangeKind::Updated);
    assert_eq!(second.before.as_ref(), Some(after(first)));
    assert_eq!(after(first).updated_at, now);
    assert_eq!(after(second).updated_at, now + 1, "strictly increasing within a batch");
    assert_eq!(second.changed_data_fields, vec![PRICE]);
    assert_eq!(store.record("sku"), &Record { key: None, generation: 0, ..after(second).clone() });
}

#[test]
fn delete_and_recreate_in_one_batch_leave_no_tombstone() {
    let mut store = Store::new();
    store.run(&batch(vec![patch("sku", &stock(1))]));

    let run = store.run(&batch(vec![delete("sku"), patch("sku", &stock(2))]));

    let kinds: Vec<ChangeKind> = run.outcome.changes.iter().map(kind).collect();
    assert_eq!(kinds, vec![ChangeKind::Deleted, ChangeKind::Created]);
    assert_eq!(run.slot("sku").tombstone, Some(false));
    assert!(store.tombstones.is_empty());

    let run = store.run(&batch(vec![patch("sku", &stock(3)), delete("sku")]));
    assert_eq!(run.slot("sku").tombstone, Some(true));
    assert!(store.tombstones.contains(&key("sku")));
}

// ------------------------------------------------------- loader helpers

#[test]
fn touched_lists_each_valid_key_once_and_each_swept_place_once() {
    let b = CommandBatch {
        partition: 0,
        commands: vec![
            patch("b", &stock(1)),
            patch("a", &stock(1)),
            patch("b", &stock(2)),
            patch("", &stock(1)),
            Command { key: None, ..patch("x", &stock(1)) },
        ],
        sweeps: vec![sweep(G2), sweep_at(OTHER_PLACE, G1), sweep(G1)],
        origin: None,
    };

    let (keys, places) = touched(&b);

    assert_eq!(keys, vec![key("a"), key("b")]);
    assert_eq!(places, vec![PlaceKey::new(BRAND, PLACE), PlaceKey::new(BRAND, OTHER_PLACE)]);
}

#[test]
fn sweep_candidates_are_live_entries_below_the_generation() {
    let entry =
        |generation, absent, deleted| GenEntry { generation, absent, deleted, updated_at: 0 };
    let column = vec![
        ("old".to_string(), entry(G1, false, false)),
        ("delta".to_string(), entry(0, false, false)),
        ("current".to_string(), entry(G2, false, false)),
        ("newer".to_string(), entry(G3, false, false)),
        ("absent".to_string(), entry(G1, true, false)),
        ("deleted".to_string(), entry(G1, false, true)),
    ];

    assert_eq!(sweep_candidates(&sweep(G2), &column, None), vec!["old", "delta"]);
    let carried = std::collections::HashSet::from(["old".to_string()]);
    assert_eq!(
        sweep_candidates(&sweep(G2), &column, Some(&carried)),
        vec!["delta"],
        "carried: spared"
    );
}

// ----------------------------------------------------------------- GenEntry

#[test]
fn gen_entry_round_trips_every_flag_it_encodes() {
    for generation in [0, 1, G1, -5, i64::MAX, i64::MIN] {
        for (absent, deleted, suffix) in
            [(false, false, ""), (true, false, "a"), (false, true, "d")]
        {
            let e = GenEntry { generation, absent, deleted, updated_at: 0 };
            assert_eq!(e.encode(), format!("{generation}{suffix}"));
            assert_eq!(GenEntry::decode(e.encode().as_bytes()), Some(e));
        }
    }
}

/// Not a round trip: the column keeps one flag and deleted wins. The sweep
/// skips absent and deleted records alike, so nothing depends on the loss.
#[test]
fn gen_entry_of_an_absent_deleted_record_decodes_as_deleted() {
    let both = GenEntry { generation: G1, absent: true, deleted: true, updated_at: 0 };

    let decoded = GenEntry::decode(both.encode().as_bytes()).expect("decodes");

    assert_eq!(both.encode(), "1000d");
    assert_eq!(decoded, GenEntry { absent: false, ..both });
    let column = |e| vec![("sku".to_string(), e)];
    assert_eq!(
        sweep_candidates(&sweep(G2), &column(both), None),
        sweep_candidates(&sweep(G2), &column(decoded), None)
    );
}

#[test]
fn gen_entry_decode_rejects_garbage() {
    let garbage: [&[u8]; 11] = [
        b"",
        b"a",
        b"d",
        b"x",
        b"12x",
        b"1a2",
        b"1ad",
        b"1.5",
        b" 1",
        b"99999999999999999999",
        &[0xff, 0x31],
    ];
    for g in garbage {
        assert_eq!(GenEntry::decode(g), None, "{:?}", String::from_utf8_lossy(g));
    }
}

// ---------------------------------------------------- model for properties

/// What a consumer observes of a record, plus its generation.
#[derive(Debug, Clone, PartialEq, Default)]
struct Observed {
    data: Product,
    state: RecordState,
    absent: bool,
    deleted: bool,
    generation: i64,
}

impl Observed {
    fn of(r: &Record, generation: i64) -> Self {
        Observed {
            data: data_of(r),
            state: state_of(r),
            absent: r.absent,
            deleted: r.deleted,
            generation,
        }
    }

    fn visible(&self) -> (&Product, &RecordState, bool, bool) {
        (&self.data, &self.state, self.absent, self.deleted)
    }
}

/// One step of a random history.
#[derive(Debug, Clone)]
enum Op {
    Patch { at: Key, data: Product, state: RecordState, clear: Vec<u32>, generation: i64 },
    Save { at: Key, data: Product, state: RecordState, generation: i64 },
    Delete { at: Key },
    Sweep { place: i64, generation: i64 },
}

impl Op {
    fn command(&self) -> Option<Command> {
        let base = |at: &Key, kind: CommandKind, generation: i64| Command {
            key: Some(RecordKey::new(at.0, at.1, at.2.clone())),
            kind: kind as i32,
            generation,
            ..Default::default()
        };
        Some(match self {
            Op::Patch { at, data, state, clear, generation } => Command {
                data: data.encode_to_vec(),
                state: state.encode_to_vec(),
                clear_data_fields: clear.clone(),
                ..base(at, CommandKind::Patch, *generation)
            },
            Op::Save { at, data, state, generation } => Command {
                data: data.encode_to_vec(),
                state: state.encode_to_vec(),
                ..base(at, CommandKind::Save, *generation)
            },
            Op::Delete { at } => base(at, CommandKind::Delete, 0),
            Op::Sweep { .. } => return None,
        })
    }

    fn with_generation(&self, g: i64) -> Op {
        let mut op = self.clone();
        if let Op::Patch { generation, .. } | Op::Save { generation, .. } = &mut op {
            *generation = g;
        }
        op
    }
}

/// `(key, kind, after)` of a change, as the model predicts it.
type Seen = (Key, ChangeKind, Observed);

fn seen(changes: &[Change]) -> Vec<Seen> {
    changes
        .iter()
        .map(|c| (key_of(c), kind(c), Observed::of(after(c), after(c).generation)))
        .collect()
}

/// The naive reading of the merge rule: decode, overwrite present fields, clear.
fn overwrite(mut base: Product, patch: &Product, clear: &[u32]) -> Product {
    macro_rules! take {
        ($($f:ident),*) => { $( if patch.$f.is_some() { base.$f = patch.$f.clone(); } )* };
    }
    take!(title, category, price, old_price, currency, stock, description);
    if !patch.images.is_empty() {
        base.images = patch.images.clone();
    }
    for f in clear {
        match *f {
            TITLE => base.title = None,
            PRICE => base.price = None,
            STOCK => base.stock = None,
            IMAGES => base.images.clear(),
            other => unreachable!("the strategy does not clear field {other}"),
        }
    }
    base
}

#[derive(Debug, Default)]
struct Model {
    records: BTreeMap<Key, Observed>,
    /// (place, generation, product): what each full import carried, until
    /// its sweep.
    carried: BTreeSet<(i64, i64, String)>,
}

impl Model {
    fn apply(&mut self, op: &Op) -> Vec<Seen> {
        match op {
            Op::Patch { at, data, state, clear, generation } => {
                let before = self.records.get(at).cloned();
                // A tombstone is not a base to merge onto.
                let live = before.as_ref().filter(|r| !r.deleted).cloned().unwrap_or_default();
                // Written over a tombstone, a record starts afresh.
                let mut next = before.clone().filter(|r| !r.deleted).unwrap_or_default();
                next.data = overwrite(live.data, data, clear);
                next.state =
                    RecordState { hidden: state.hidden.or(live.state.hidden), ..live.state };
                next.deleted = false;
                self.write(at, before, next, *generation)
            }
            Op::Save { at, data, state, generation } => {
                let before = self.records.get(at).cloned();
                // Written over a tombstone, a record starts afresh.
                let mut next = before.clone().filter(|r| !r.deleted).unwrap_or_default();
                next.data = data.clone();
                next.state = state.clone();
                next.deleted = false;
                self.write(at, before, next, *generation)
            }
            Op::Delete { at } => {
                let Some(before) = self.records.get(at).cloned() else {
                    return Vec::new();
                };
                let next = Observed { deleted: true, ..before.clone() };
                self.write(at, Some(before), next, 0)
            }
            Op::Sweep { place, generation } => {
                let mut out = Vec::new();
                let carried = std::mem::take(&mut self.carried);
                let (of_this, others) =
                    carried.into_iter().partition(|(p, g, _)| (*p, *g) == (*place, *generation));
                self.carried = others;
                let of_this: BTreeSet<String> = of_this.into_iter().map(|(_, _, id)| id).collect();
                for (k, r) in self.records.iter_mut().filter(|(k, _)| k.1 == *place) {
                    if !r.absent
                        && !r.deleted
                        && r.generation < *generation
                        && !of_this.contains(&k.2)
                    {
                        r.absent = true;
                        out.push((k.clone(), ChangeKind::Updated, r.clone()));
                    }
                }
                out
            }
        }
    }

    fn write(
        &mut self,
        at: &Key,
        before: Option<Observed>,
        mut next: Observed,
        generation: i64,
    ) -> Vec<Seen> {
        if generation > 0 {
            next.absent = false;
            self.carried.insert((at.1, generation, at.2.clone()));
        }
        // An import stamps its generation only on what it writes.
        if before.as_ref().is_some_and(|b| b.visible() == next.visible()) {
            return Vec::new();
        }
        if generation > 0 {
            next.generation = generation;
        }
        self.records.insert(at.clone(), next.clone());
        let kind = match &before {
            _ if next.deleted => ChangeKind::Deleted,
            Some(b) if !b.deleted => ChangeKind::Updated,
            _ => ChangeKind::Created,
        };
        vec![(at.clone(), kind, next)]
    }
}

/// Applies `ops` in batches, closing a batch after op `i` when `cut(i)`, and
/// always after a sweep (a batch applies its sweeps after its commands).
fn replay(ops: &[Op], cut: impl Fn(usize) -> bool) -> (Store, Vec<Change>) {
    let mut store = Store::new();
    let mut changes = Vec::new();
    let mut pending = CommandBatch::default();
    for (i, op) in ops.iter().enumerate() {
        match (op.command(), op) {
            (Some(cmd), _) => pending.commands.push(cmd),
            (None, Op::Sweep { place, generation }) => {
                pending.sweeps.push(sweep_at(*place, *generation));
            }
            (None, _) => unreachable!("only sweeps are not commands"),
        }
        let last = i + 1 == ops.len();
        if last || !pending.sweeps.is_empty() || cut(i) {
            let run = store.run(&std::mem::take(&mut pending));
            assert_eq!(run.reasons(), Vec::<&str>::new());
            changes.extend(run.outcome.changes);
        }
    }
    (store, changes)
}

/// Every change of a record continues from the previous one (its `before`
/// is the previous `after`) and moves `updated_at` forward.
fn check_chained(changes: &[Change]) -> Result<(), TestCaseError> {
    let sans_generation = |r: &Record| Record { generation: 0, ..r.clone() };
    let mut last: HashMap<Key, Record> = HashMap::new();
    for c in changes {
        let k = key_of(c);
        let a = after(c);
        match (last.get(&k), &c.before) {
            (None, None) => {}
            (None, Some(b)) => prop_assert!(false, "first change of {k:?} has a before: {b:?}"),
            (Some(prev), Some(b)) => {
                prop_assert_eq!(sans_generation(b), sans_generation(prev));
                prop_assert!(a.updated_at > b.updated_at);
            }
            (Some(prev), None) => prop_assert!(prev.deleted && kind(c) == ChangeKind::Created),
        }
        if kind(c) == ChangeKind::Created {
            prop_assert_eq!(a.created_at, a.updated_at);
        } else if let Some(b) = &c.before {
            prop_assert_eq!(a.created_at, b.created_at);
        }
        last.insert(k, a.clone());
    }
    Ok(())
}

// ------------------------------------------------------------- strategies

const IDS: [&str; 3] = ["a", "b", "c"];
/// Full imports in the properties start after every generation of
/// [`any_op`].
const IMPORT_GEN: i64 = 10;

fn any_key() -> impl Strategy<Value = Key> {
    (prop::sample::select(vec![PLACE, OTHER_PLACE]), prop::sample::select(IDS.to_vec()))
        .prop_map(|(place, id)| (BRAND, place, id.to_string()))
}

fn small_int() -> impl Strategy<Value = Option<i64>> {
    prop_oneof![Just(None), Just(Some(0)), (1i64..3).prop_map(Some)]
}

fn any_product() -> impl Strategy<Value = Product> {
    (
        prop::option::of(prop::sample::select(vec!["x", "y"])),
        small_int(),
        small_int(),
        small_int(),
        prop::collection::vec(prop::sample::select(vec!["1.jpg", "2.jpg"]), 0..3),
    )
        .prop_map(|(title, price, old_price, stock, images)| Product {
            title: title.map(Into::into),
            price,
            old_price,
            stock,
            images: images.into_iter().map(Into::into).collect(),
            ..Default::default()
        })
}

fn any_state() -> impl Strategy<Value = RecordState> {
    prop::option::of(any::<bool>()).prop_map(|hidden| RecordState { hidden, ..Default::default() })
}

fn any_clear() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        3 => Just(Vec::new()),
        1 => prop::collection::vec(prop::sample::select(vec![TITLE, PRICE, STOCK, IMAGES]), 1..3),
    ]
}

/// Mostly deltas (0); full imports from a few small, unordered generations.
fn any_generation() -> impl Strategy<Value = i64> {
    prop_oneof![2 => Just(0i64), 1 => 1i64..4]
}

fn patch_op(
    at: impl Strategy<Value = Key>,
    generation: impl Strategy<Value = i64>,
) -> impl Strategy<Value = Op> {
    (at, any_product(), any_state(), any_clear(), generation).prop_map(
        |(at, data, state, clear, generation)| Op::Patch { at, data, state, clear, generation },
    )
}

fn save_op(
    at: impl Strategy<Value = Key>,
    generation: impl Strategy<Value = i64>,
) -> impl Strategy<Value = Op> {
    (at, any_product(), any_state(), generation)
        .prop_map(|(at, data, state, generation)| Op::Save { at, data, state, generation })
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => patch_op(any_key(), any_generation()),
        2 => save_op(any_key(), any_generation()),
        2 => any_key().prop_map(|at| Op::Delete { at }),
        1 => (prop::sample::select(vec![PLACE, OTHER_PLACE]), 1i64..5)
            .prop_map(|(place, generation)| Op::Sweep { place, generation }),
    ]
}

/// One command per product of [`PLACE`] (some not carried), as one batch
/// of a full import carries them; `deltas` mixes in deltas and deletes.
fn any_import(deltas: bool) -> impl Strategy<Value = Vec<Op>> {
    let item = move |id: &str| {
        let at = Just(key(id));
        let full = prop_oneof![
            3 => patch_op(at.clone(), Just(IMPORT_GEN)),
            2 => save_op(at.clone(), Just(IMPORT_GEN)),
        ];
        let op = if deltas {
            prop_oneof![
                5 => full,
                2 => patch_op(at.clone(), Just(0)),
                1 => at.prop_map(|at| Op::Delete { at }),
            ]
            .boxed()
        } else {
            full.boxed()
        };
        prop::option::of(op)
    };
    ["a", "b", "c", "d"]
        .into_iter()
        .map(item)
        .collect::<Vec<_>>()
        .prop_map(|items| items.into_iter().flatten().collect())
}

fn import_batch(items: &[Op], generation: i64) -> CommandBatch {
    batch_then_sweep(
        items.iter().filter_map(|op| op.with_generation(generation).command()).collect(),
        sweep(generation),
    )
}

/// Data a partner's PATCH may carry on the wire: a Product, and around it
/// fields it does not know (any number, varint or bytes) and fields that
/// appear twice (the later one wins), as a newer or sloppier sender writes.
fn any_patch_data() -> impl Strategy<Value = Vec<u8>> {
    let extra = (
        1u32..14,
        prop_oneof![
            any::<u64>().prop_map(|v| (0u8, v.to_le_bytes().to_vec())),
            prop::collection::vec(any::<u8>(), 0..5).prop_map(|b| (2u8, b)),
        ],
    );
    (any_product(), prop::collection::vec(extra, 0..4), any::<bool>()).prop_map(
        |(product, extra, first)| {
            let mut raw = Vec::new();
            use prost::encoding::{WireType, encode_key, encode_varint};
            for (number, (wire, bytes)) in extra {
                if wire == 0 {
                    encode_key(number, WireType::Varint, &mut raw);
                    let v = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
                    encode_varint(v, &mut raw);
                } else {
                    encode_key(number, WireType::LengthDelimited, &mut raw);
                    encode_varint(bytes.len() as u64, &mut raw);
                    raw.extend_from_slice(&bytes);
                }
            }
            let product = product.encode_to_vec();
            if first { [product, raw].concat() } else { [raw, product].concat() }
        },
    )
}

// ----------------------------------------------------------------- properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn batching_does_not_change_what_is_stored_or_reported(
        ops in prop::collection::vec(any_op(), 1..40),
        cuts in prop::collection::vec(any::<bool>(), 40),
    ) {
        let (one_by_one, single_changes) = replay(&ops, |_| true);
        let (batched, batched_changes) = replay(&ops, |i| cuts[i]);
        let mut model = Model::default();
        let expected: Vec<Seen> = ops.iter().flat_map(|op| model.apply(op)).collect();

        prop_assert_eq!(seen(&single_changes), expected.clone());
        prop_assert_eq!(seen(&batched_changes), expected);
        prop_assert_eq!(one_by_one.snapshot(), model.records.clone());
        prop_assert_eq!(batched.snapshot(), model.records);
        for store in [&one_by_one, &batched] {
            let deleted: BTreeSet<Key> = store
                .records
                .iter()
                .filter(|(_, r)| r.deleted)
                .map(|(k, _)| k.clone())
                .collect();
            prop_assert_eq!(&store.tombstones, &deleted);
            for (k, r) in &store.records {
                let e = store.gens.get(k).copied().unwrap_or_default();
                prop_assert_eq!(e.deleted, r.deleted);
                prop_assert!(e.absent == (r.absent && !r.deleted));
            }
        }
        check_chained(&single_changes)?;
        check_chained(&batched_changes)?;
    }

    #[test]
    fn a_redelivered_batch_applied_again_changes_and_writes_nothing(
        history in prop::collection::vec(any_op(), 0..24),
        items in any_import(true),
    ) {
        let (mut store, _) = replay(&history, |_| true);
        let import = import_batch(&items, IMPORT_GEN);
        store.run(&import);
        let stored = store.clone();

        let again = store.run(&import);

        prop_assert!(again.outcome.changes.is_empty(), "{:#?}", again.outcome.changes);
        prop_assert_eq!(again.reasons(), Vec::<&str>::new());
        for (k, slot) in &again.slots {
            prop_assert!(
                !slot.record_dirty && !slot.gen_dirty && slot.tombstone.is_none(),
                "{:?} would be written: {:?}", k, slot
            );
        }
        prop_assert_eq!(&store.records, &stored.records);
        prop_assert_eq!(&store.gens, &stored.gens);
    }

    #[test]
    fn an_identical_reimport_writes_no_record_and_spares_all_it_carried(
        history in prop::collection::vec(any_op(), 0..24),
        items in any_import(false),
    ) {
        let (mut store, _) = replay(&history, |_| true);
        store.run(&import_batch(&items, IMPORT_GEN));
        let stored = store.clone();

        let next = IMPORT_GEN + 1;
        let reimport = store.run(&import_batch(&items, next));

        prop_assert!(reimport.outcome.changes.is_empty(), "{:#?}", reimport.outcome.changes);
        prop_assert_eq!(reimport.outcome.unchanged, items.len() as u64);
        prop_assert!(reimport.slots.values().all(|s| !s.record_dirty && !s.gen_dirty));
        prop_assert_eq!(&store.records, &stored.records);
        prop_assert_eq!(&store.gens, &stored.gens);
        prop_assert_eq!(reimport.outcome.sweeps[0].marked_absent, 0);
    }

    /// A plain PATCH (no compare-and-swap) applied once more to the record
    /// it just wrote changes nothing and writes nothing: what lets the
    /// partition's owner vouch for it without trying (`known`), whatever the
    /// record was before (none, present, absent, deleted), the data (unknown
    /// and repeated fields included), the fields cleared and the import.
    #[test]
    fn a_plain_patch_changes_nothing_on_what_it_wrote(
        history in prop::collection::vec(any_op(), 0..24),
        at in any_key(),
        data in any_patch_data(),
        state in any_state(),
        clear_data in any_clear(),
        clear_state in prop_oneof![3 => Just(Vec::new()), 1 => Just(vec![HIDDEN])],
        generation in prop_oneof![Just(0i64), 1i64..12],
    ) {
        let (store, _) = replay(&history, |_| true);
        let cmd = Command {
            key: Some(RecordKey::new(at.0, at.1, at.2.clone())),
            kind: CommandKind::Patch as i32,
            data,
            state: state.encode_to_vec(),
            clear_data_fields: clear_data,
            clear_state_fields: clear_state,
            generation,
            ..Default::default()
        };
        let mut slots = Slots::from_iter([(at.clone(), store.slot(&at))]);
        let out = apply_batch(&batch(vec![cmd.clone()]), &mut slots, &HashMap::new(), &store.limits);
        if out.rejections.is_empty() {
            let written = slots[&at].clone();
            prop_assert!(
                changes_nothing(&cmd, &at, &written, &store.limits, &mut Slots::default()),
                "{:?} on {:?}", cmd, written
            );
        }
    }

    #[test]
    fn gen_entry_round_trips_any_generation(generation in any::<i64>(), flag in 0..3u8) {
        let e = GenEntry { generation, absent: flag == 1, deleted: flag == 2, updated_at: 0 };
        prop_assert_eq!(GenEntry::decode(e.encode().as_bytes()), Some(e));
    }
}

//! The serial model of storage the fault tests compare against, the
//! deterministic churn workload they publish, and the check that holds
//! storage (records and change stream) to the model.

use std::collections::HashMap;

use prost::Message;
use shelfsync_bus::partition_of;
use shelfsync_proto::{
    Change, Command, CommandBatch, CommandKind, PlaceKey, Product, Record, RecordKey, Sweep,
};

use crate::{Harness, patch, product};

/// A record key as the fault tests use it: `(brand, place, product_id)`.
pub type RecordId = (i64, i64, String);

/// What a consumer can observe of a record version: `(data, state, absent,
/// deleted)` — everything but the timestamps, which differ between runs.
pub type Observed = (Vec<u8>, Vec<u8>, bool, bool);

pub fn observed(r: &Record) -> Observed {
    (r.data.clone(), r.state.clone(), r.absent, r.deleted)
}

pub(crate) fn id_of(key: &RecordKey) -> RecordId {
    (key.brand_id, key.place_id, key.product_id.clone())
}

/// Storage applied serially, in memory, with its own pure core
/// (`shelfsync_storage::pure::apply_batch`): the state and the transitions
/// that one fault-free worker applying the batches in publish order yields.
/// The fault tests hold the distributed machinery (crashes, redeliveries,
/// restarts) to it.
#[derive(Default)]
pub struct SerialModel {
    partitions: u32,
    slots: shelfsync_storage::pure::Slots,
    /// Per record, every observable version a change announced, in order.
    pub transitions: HashMap<RecordId, Vec<Observed>>,
    /// Changes emitted in all.
    pub changes: usize,
    /// Rejection reasons, in order.
    pub rejections: Vec<String>,
    /// Per place, the sweep held for it.
    pub held: HashMap<PlaceKey, shelfsync_proto::SweepOutcome>,
    /// Every sweep's outcome, in order.
    pub sweeps: Vec<shelfsync_proto::SweepOutcome>,
    /// Per place and generation, what that full import carried so far.
    touched: shelfsync_storage::pure::TouchedSets,
    clock: i64,
}

impl SerialModel {
    pub fn new(partitions: u32) -> Self {
        Self { partitions, clock: 1, ..Default::default() }
    }

    /// Applies one command message, as the worker owning its partition would.
    pub fn apply(&mut self, batch: &CommandBatch) {
        self.clock += 1_000;
        let limits = shelfsync_storage::pure::Limits {
            partition: batch.partition,
            partitions: self.partitions,
            max_record_bytes: shelfsync_settings::StorageSettings::default().max_record_bytes,
            now_us: self.clock,
        };
        // Every record the model knows is in `slots`, so the sweep finds its
        // candidates there and needs no separate generation column.
        let swept: HashMap<PlaceKey, shelfsync_storage::pure::SweptPlace> = batch
            .sweeps
            .iter()
            .map(|s| {
                let place = s.place();
                let held = self.held.get(&place).cloned();
                let touched = self.touched.of_place(place);
                (place, shelfsync_storage::pure::SweptPlace { column: Vec::new(), held, touched })
            })
            .collect();
        let out = shelfsync_storage::pure::apply_batch(batch, &mut self.slots, &swept, &limits);
        self.touched.commit(&out.touched, &out.sweeps);
        for o in &out.sweeps {
            let Some(s) = &o.sweep else { continue };
            let place = s.place();
            match o.status.as_str() {
                "held" => {
                    self.held.insert(place, o.clone());
                }
                "applied" => {
                    self.held.remove(&place);
                }
                _ => {}
            }
        }
        self.sweeps.extend(out.sweeps.iter().cloned());
        for c in &out.changes {
            let after = c.after.as_ref().expect("a change has an after");
            let key = c.key.as_ref().expect("a change has a key");
            self.transitions.entry(id_of(key)).or_default().push(observed(after));
        }
        self.changes += out.changes.len();
        self.rejections.extend(out.rejections.into_iter().map(|r| r.reason));
    }

    /// The final observable state of every record the model holds.
    pub fn records(&self) -> HashMap<RecordId, Observed> {
        self.slots
            .iter()
            .filter_map(|(k, s)| s.record.as_ref().map(|r| (k.clone(), observed(r))))
            .collect()
    }
}

/// A deterministic import with churn over several places of one brand:
/// full imports with generations and sweeps, items vanishing and coming
/// back, a delta price feed, deletes and re-creations, a validator-style
/// state PATCH, one key twice in a batch, and an identical re-import. Each
/// command message holds at most `chunk` commands of one place.
#[derive(Debug, Clone)]
pub struct Churn {
    pub brand: i64,
    pub places: Vec<i64>,
    pub items: usize,
    pub chunk: usize,
}

impl Churn {
    /// [`Churn::batches`], and the serial model with all of them applied.
    pub fn modelled(&self, partitions: u32) -> (Vec<CommandBatch>, SerialModel) {
        let batches = self.batches(partitions);
        let mut model = SerialModel::new(partitions);
        for b in &batches {
            model.apply(b);
        }
        (batches, model)
    }

    /// Command messages in publish order, each for one partition.
    pub fn batches(&self, partitions: u32) -> Vec<CommandBatch> {
        let mut out = Vec::new();
        let sku = |i: usize| format!("sku-{i}");
        for &place in &self.places {
            let p = partition_of(self.brand, place, partitions).0;
            let mut emit = |commands: Vec<Command>, sweeps: Vec<Sweep>| {
                let mut commands = commands.into_iter().peekable();
                while commands.peek().is_some() {
                    let chunk: Vec<Command> = commands.by_ref().take(self.chunk).collect();
                    out.push(CommandBatch { partition: p, commands: chunk, ..Default::default() });
                }
                if !sweeps.is_empty() {
                    out.push(CommandBatch { partition: p, sweeps, ..Default::default() });
                }
            };
            let sweep = |generation: i64| Sweep {
                brand_id: self.brand,
                place_id: place,
                generation,
                source: "churn".into(),
                import_id: format!("churn-{generation}"),
                ..Default::default()
            };
            let full =
                |generation: i64, keep: &dyn Fn(usize) -> bool, price: &dyn Fn(usize) -> i64| {
                    (0..self.items)
                        .filter(|&i| keep(i))
                        .map(|i| {
                            patch(
                                self.brand,
                                place,
                                &sku(i),
                                &product("Roses", price(i), 5),
                                generation,
                            )
                        })
                        .collect::<Vec<_>>()
                };
            let base = |i: usize| 1_000 + i as i64;
            // 1: first full import.
            emit(full(1_000, &|_| true, &base), vec![sweep(1_000)]);
            // 2: a tenth of the prices move; every 7th item vanishes (swept).
            let moved = |i: usize| if i.is_multiple_of(10) { 9_000 + i as i64 } else { base(i) };
            emit(full(2_000, &|i| i % 7 != 3, &moved), vec![sweep(2_000)]);
            // 3: a delta price feed (no generation), deletes, a hidden state,
            // and one key twice in one message (both transitions count).
            let mut delta = Vec::new();
            for i in 0..self.items {
                if i % 5 == 1 {
                    let price = Product { price: Some(5_000 + i as i64), ..Default::default() };
                    delta.push(patch(self.brand, place, &sku(i), &price, 0));
                }
                if i % 11 == 5 {
                    delta.push(Command {
                        key: Some(RecordKey::new(self.brand, place, sku(i))),
                        kind: CommandKind::Delete as i32,
                        ..Default::default()
                    });
                }
                if i.is_multiple_of(13) {
                    let state =
                        shelfsync_proto::RecordState { hidden: Some(true), ..Default::default() };
                    delta.push(Command {
                        key: Some(RecordKey::new(self.brand, place, sku(i))),
                        kind: CommandKind::Patch as i32,
                        state: state.encode_to_vec(),
                        ..Default::default()
                    });
                }
            }
            let stock = |n: i64| Product { stock: Some(n), ..Default::default() };
            delta.push(patch(self.brand, place, &sku(2), &stock(0), 0));
            delta.push(patch(self.brand, place, &sku(2), &stock(9), 0));
            emit(delta, vec![]);
            // 4: a full import brings everything back (deleted ones are
            // re-created, vanished ones un-swept), prices as at first.
            emit(full(3_000, &|_| true, &base), vec![sweep(3_000)]);
            // 5: identical re-import: generation-only writes, no change.
            emit(full(4_000, &|_| true, &base), vec![sweep(4_000)]);
        }
        out
    }
}

impl Harness {
    /// Holds storage to the serial model: its records equal the model's
    /// (observably), and the change stream carries, per record, exactly the
    /// model's transitions in order — nothing lost, nothing twice — with a
    /// strictly increasing `updated_at`. Returns the changes.
    pub async fn assert_serial(
        &self,
        model: &SerialModel,
        brand: i64,
        places: &[i64],
    ) -> Vec<Change> {
        let stored = self.records_of(brand, places).await.expect("storage records");
        let want = model.records();
        assert_eq!(stored.len(), want.len(), "record count: storage vs serial model");
        for (k, w) in &want {
            let s = stored.get(k).unwrap_or_else(|| panic!("storage lacks {k:?}"));
            assert!(observed(s) == *w, "{k:?}: storage differs from the serial model");
        }
        let changes = self.changes().await.expect("changes");
        let mut seen: HashMap<RecordId, Vec<&Change>> = HashMap::new();
        for c in &changes {
            seen.entry(id_of(c.key.as_ref().expect("key"))).or_default().push(c);
        }
        let lost_or_extra: Vec<_> = seen
            .iter()
            .filter(|(k, v)| model.transitions.get(*k).map_or(0, Vec::len) != v.len())
            .map(|(k, v)| (k.clone(), v.len(), model.transitions.get(k).map_or(0, Vec::len)))
            .take(5)
            .collect();
        assert!(lost_or_extra.is_empty(), "(record, seen, expected) changes: {lost_or_extra:?}");
        for (k, want) in &model.transitions {
            let got = seen.get(k).unwrap_or_else(|| panic!("no change at all for {k:?}"));
            for (i, (c, w)) in got.iter().zip(want).enumerate() {
                let after = c.after.as_ref().expect("after");
                assert!(observed(after) == *w, "{k:?}: change #{i} is not the serial one");
                if i > 0 {
                    let prev = got[i - 1].after.as_ref().expect("after").updated_at;
                    assert!(after.updated_at > prev, "{k:?}: updated_at went back");
                }
            }
        }
        assert_eq!(changes.len(), model.changes, "changes in all");
        changes
    }
}

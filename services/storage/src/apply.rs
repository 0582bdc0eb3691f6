//! The pure core of storage (docs/DESIGN.md, Storage semantics): applies one
//! command batch to the records it touches and says what changed. No I/O: the
//! caller loads the touched records, calls [`apply_batch`], and commits the
//! [`Outcome`].

use std::collections::HashMap;

use shelfsync_proto::{
    Change, ChangeKind, Command, CommandBatch, CommandKind, Origin, PlaceKey, Record, RecordKey,
    Rejection, Sweep, SweepOutcome,
};

mod command;
pub(crate) mod sweep;
mod touched;
pub mod touched_set;

pub use touched::TouchedSets;

use command::apply_command;
#[cfg(test)]
pub use command::changes_nothing;
use sweep::apply_sweep;
#[cfg(test)]
use sweep::sweep_candidates;

/// Identifies a record inside one brand: `(place_id, product_id)`. The brand
/// is part of the key too; kept as the full triple to keep mistakes out.
pub type Key = (i64, i64, String);

/// The maps of the hot path: a fast hasher, seeded per process (partner ids
/// are keys, so not a fixed one).
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The records one commit loaded, by key.
pub type Slots = FastMap<Key, Slot>;

/// The generation of a record, with the two flags the sweep needs without
/// decoding the record (the store reads all three off the record bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GenEntry {
    pub generation: i64,
    pub absent: bool,
    pub deleted: bool,
    /// When the record last changed (read off the record bytes too; 0 where
    /// it is not known: layout 1's hash, the owner's memory).
    pub updated_at: i64,
}

impl GenEntry {
    /// `"<gen>"`, `"<gen>a"` (absent) or `"<gen>d"` (deleted): the values
    /// of layout 1's generation hash, which the store's upgrade reads.
    pub fn encode(&self) -> String {
        let flag = if self.deleted {
            "d"
        } else if self.absent {
            "a"
        } else {
            ""
        };
        format!("{}{flag}", self.generation)
    }

    pub fn decode(s: &[u8]) -> Option<GenEntry> {
        let s = std::str::from_utf8(s).ok()?;
        let (num, absent, deleted) = match s.as_bytes().last()? {
            b'a' => (&s[..s.len() - 1], true, false),
            b'd' => (&s[..s.len() - 1], false, true),
            _ => (s, false, false),
        };
        Some(GenEntry { generation: num.parse().ok()?, absent, deleted, updated_at: 0 })
    }
}

/// One record as loaded from, and written back to, Redis.
#[derive(Debug, Clone, Default)]
pub struct Slot {
    /// The stored envelope, without key and generation (the store keeps the
    /// generation in the record bytes and moves it to `generation`).
    pub record: Option<Record>,
    pub generation: i64,
    /// The record bytes must be written back.
    pub record_dirty: bool,
    /// The generation must be written back (with the record: it is stored
    /// in it).
    pub gen_dirty: bool,
    /// Tombstone index change: Some(true) add, Some(false) remove.
    pub tombstone: Option<bool>,
    /// Index of absent records (for their purge): Some(true) add (scored by
    /// the record's `updated_at`, when it became absent), Some(false) remove.
    pub absent_index: Option<bool>,
}

impl Slot {
    pub fn gen_entry(&self) -> GenEntry {
        let r = self.record.as_ref();
        GenEntry {
            generation: self.generation,
            absent: r.is_some_and(|r| r.absent),
            deleted: r.is_some_and(|r| r.deleted),
            updated_at: r.map_or(0, |r| r.updated_at),
        }
    }
}

/// Limits and clock for one batch.
#[derive(Debug, Clone)]
pub struct Limits {
    pub partition: u32,
    pub partitions: u32,
    pub max_record_bytes: usize,
    /// Wall clock of this batch, microseconds.
    pub now_us: i64,
}

/// What applying a batch produced, in command order.
#[derive(Debug, Default)]
pub struct Outcome {
    pub changes: Vec<Change>,
    pub rejections: Vec<Rejection>,
    /// Commands that changed nothing but the generation, or nothing at all.
    pub unchanged: u64,
    pub applied: u64,
    /// What became of each sweep, in order (`command_seq` left 0).
    pub sweeps: Vec<SweepOutcome>,
    /// Every record a full-import command of the batch carried and storage
    /// accepted, changed or not: what the import's sweep must spare.
    pub touched: Vec<Touch>,
}

/// A record carried by a full import (`generation`): the place's sweep of
/// that import does not mark it absent, whatever its stored generation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Touch {
    pub place: PlaceKey,
    pub generation: i64,
    pub product_id: String,
}

impl Touch {
    /// The touched set a sweep reads: this import's, for this place.
    pub fn of(&self) -> (PlaceKey, i64) {
        (self.place, self.generation)
    }
}

/// What a sweep needs of its place besides the loaded slots: the stored
/// generation column, the sweep held for the place, if any, and the ids the
/// imports carried to it in earlier batches, per generation (a generation
/// missing: no such set is kept).
#[derive(Debug, Clone, Default)]
pub struct SweptPlace {
    pub column: Vec<(String, GenEntry)>,
    pub held: Option<SweepOutcome>,
    pub touched: HashMap<i64, std::collections::HashSet<String>>,
}

/// Stable reasons carried by rejections.
pub mod reason {
    pub const CONFLICT: &str = "conflict";
    pub const TOO_LARGE: &str = "too_large";
    pub const MALFORMED: &str = "malformed";
    pub const WRONG_PARTITION: &str = "wrong_partition";
    pub const UNDECODABLE: &str = "undecodable";
    pub const FAILED: &str = "failed";
    /// Not a command: a sweep storage held instead of applying it.
    pub const SWEEP_HELD: &str = "sweep_held";
    /// Not a command: a sweep that did not come on the partition's sweep
    /// subject (which only ingest and the CLI may publish to), refused.
    pub const SWEEP_FORBIDDEN: &str = "sweep_forbidden";
}

/// The records a batch needs loaded: every command key and, for sweeps, the
/// whole generation column of the swept places.
pub fn touched(batch: &CommandBatch) -> (Vec<Key>, Vec<PlaceKey>) {
    let keys = keys_of(&batch.commands);
    let mut places: Vec<PlaceKey> = batch.sweeps.iter().map(Sweep::place).collect();
    places.sort();
    places.dedup();
    (keys, places)
}

/// The keys of `commands`, sorted, each once.
pub fn keys_of<'a>(commands: impl IntoIterator<Item = &'a Command>) -> Vec<Key> {
    let mut keys: Vec<Key> = commands
        .into_iter()
        .filter_map(|c| c.key.as_ref())
        .filter(|k| !k.product_id.is_empty())
        .map(|k| (k.brand_id, k.place_id, k.product_id.clone()))
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

fn reject(cmd: &Command, reason: &str, detail: String) -> Box<Rejection> {
    Box::new(Rejection {
        command: Some(cmd.clone()),
        reason: reason.to_string(),
        detail,
        key: cmd.key.clone(),
        origin: cmd.origin.clone(),
        ..Default::default()
    })
}

pub(crate) fn bump(prev: i64, now: i64) -> i64 {
    now.max(prev + 1)
}

/// Applies the commands in order, then the sweeps. `slots` holds every key of
/// [`touched`] (missing records as empty slots) and every sweep candidate;
/// `swept` holds, per swept place, its stored generation column and held
/// sweep. Slots are updated in place with dirty flags for the commit.
pub fn apply_batch(
    batch: &CommandBatch,
    slots: &mut Slots,
    swept: &HashMap<PlaceKey, SweptPlace>,
    limits: &Limits,
) -> Outcome {
    let mut out = Outcome::default();
    // A command without an origin of its own has its batch's.
    let inherit = |origin: &mut Option<Origin>| {
        if origin.is_none() {
            origin.clone_from(&batch.origin);
        }
    };
    for cmd in &batch.commands {
        match apply_command(cmd, slots, limits) {
            Ok(change) => {
                out.applied += 1;
                match change {
                    Some(mut change) => {
                        inherit(&mut change.origin);
                        out.changes.push(change);
                    }
                    None => out.unchanged += 1,
                }
                if let Some(touch) = touch_of(cmd) {
                    out.touched.push(touch);
                }
            }
            Err(mut rejection) => {
                inherit(&mut rejection.origin);
                out.rejections.push(*rejection);
            }
        }
    }
    for sweep in &batch.sweeps {
        apply_sweep(sweep, slots, swept, limits, &mut out);
    }
    // An applied sweep ends its import's touched set (storage deletes it).
    let applied: Vec<(PlaceKey, i64)> = out
        .sweeps
        .iter()
        .filter(|o| o.status == sweep::status::APPLIED)
        .filter_map(|o| o.sweep.as_ref().map(|s| (s.place(), s.generation)))
        .collect();
    out.touched.retain(|t| !applied.contains(&t.of()));
    out
}

/// The touch of an accepted command: full-import commands that keep a
/// record (not deletes) carry it for their import's sweep.
fn touch_of(cmd: &Command) -> Option<Touch> {
    let key = cmd.key.as_ref()?;
    let keeps = cmd.generation > 0 && cmd.kind != CommandKind::Delete as i32;
    keeps.then(|| Touch {
        place: key.place(),
        generation: cmd.generation,
        product_id: key.product_id.clone(),
    })
}

fn with_key(r: &Record, key: &RecordKey, generation: i64) -> Record {
    Record { key: Some(key.clone()), generation, ..r.clone() }
}

/// The change from `before` (the record as it was, with its generation;
/// moved into the change) to `after`; `changed`: the data and state fields
/// that differ, when the caller found them already.
pub(crate) fn change(
    key: &RecordKey,
    before: Option<(Record, i64)>,
    after: &Record,
    kind: ChangeKind,
    generation: i64,
    origin: Option<Origin>,
    changed: Option<(Vec<u32>, Vec<u32>)>,
) -> Change {
    let (changed_data, changed_state) = changed.unwrap_or_else(|| {
        let empty: &[u8] = &[];
        let (b_data, b_state) =
            before.as_ref().map_or((empty, empty), |(r, _)| (&r.data[..], &r.state[..]));
        // Both sides are canonical (merge output), so an error means stored
        // garbage; the field lists are then left empty (a hint only: before
        // and after stay exact).
        (
            shelfsync_merge::changed_fields(b_data, &after.data).unwrap_or_default(),
            shelfsync_merge::changed_fields(b_state, &after.state).unwrap_or_default(),
        )
    });
    Change {
        key: Some(key.clone()),
        before: before.map(|(r, g)| Record { key: Some(key.clone()), generation: g, ..r }),
        after: Some(with_key(after, key, generation)),
        kind: kind as i32,
        changed_data_fields: changed_data,
        changed_state_fields: changed_state,
        origin,
        before_omitted: false,
    }
}

#[cfg(test)]
mod tests;

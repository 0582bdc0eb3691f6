//! The pure core of storage (docs/DESIGN.md, Storage semantics): applies one
//! command batch to the records it touches and says what changed. No I/O: the
//! caller loads the touched records, calls [`apply_batch`], and commits the
//! [`Outcome`].

use std::collections::HashMap;

use shelfsync_proto::{
    Change, ChangeKind, Command, CommandBatch, CommandKind, Origin, PlaceKey, Record, RecordKey,
    Rejection, Sweep, SweepOutcome,
};

pub mod sweep;
mod touched;

pub use touched::TouchedSets;

use sweep::{Census, Decision};

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

/// The ids of a place a full import carried, as storage keeps them (one
/// blob per place and import, appended by each commit): per id, its length
/// (u16, little endian) and its bytes. Exact, so no collision can spare a
/// record the import did not carry.
pub mod touched_set {
    use std::collections::{BTreeMap, HashSet};

    use shelfsync_proto::PlaceKey;

    use super::Touch;

    pub fn encode<'a>(ids: impl IntoIterator<Item = &'a str>) -> Vec<u8> {
        let mut out = Vec::new();
        for id in ids {
            push(&mut out, id);
        }
        out
    }

    fn push(out: &mut Vec<u8>, id: &str) {
        // Product ids are 1..=512 bytes (validated before any touch).
        out.extend_from_slice(&(id.len() as u16).to_le_bytes());
        out.extend_from_slice(id.as_bytes());
    }

    /// What one commit appends to touched sets: per place and full import
    /// (its generation), the ids it carried, encoded as they are appended.
    #[derive(Debug, Default, Clone, PartialEq, Eq)]
    pub struct Appends(BTreeMap<(PlaceKey, i64), Vec<u8>>);

    impl Appends {
        /// Nothing to append.
        pub fn none() -> &'static Appends {
            static NONE: Appends = Appends(BTreeMap::new());
            &NONE
        }

        pub fn add(&mut self, place: PlaceKey, generation: i64, id: &str) {
            push(self.0.entry((place, generation)).or_default(), id);
        }

        pub fn merge(&mut self, other: &Appends) {
            for (k, blob) in &other.0 {
                self.0.entry(*k).or_default().extend_from_slice(blob);
            }
        }

        pub fn extend<'a>(&mut self, touches: impl IntoIterator<Item = &'a Touch>) {
            for t in touches {
                self.add(t.place, t.generation, &t.product_id);
            }
        }

        /// Per place and generation, the encoded ids.
        pub fn iter(&self) -> impl Iterator<Item = (PlaceKey, i64, &[u8])> {
            self.0.iter().map(|((place, generation), blob)| (*place, *generation, &blob[..]))
        }
    }

    impl<'a> FromIterator<&'a Touch> for Appends {
        fn from_iter<I: IntoIterator<Item = &'a Touch>>(touches: I) -> Self {
            let mut out = Appends::default();
            out.extend(touches);
            out
        }
    }

    /// `None`: the blob is not one [`encode`] wrote.
    pub fn decode(mut blob: &[u8]) -> Option<HashSet<String>> {
        let mut ids = HashSet::new();
        while !blob.is_empty() {
            let (len, rest) = blob.split_first_chunk::<2>()?;
            let len = u16::from_le_bytes(*len) as usize;
            let id = rest.get(..len)?;
            ids.insert(String::from_utf8(id.to_vec()).ok()?);
            blob = &rest[len..];
        }
        Some(ids)
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

fn validate<'c>(cmd: &'c Command, limits: &Limits) -> Result<&'c RecordKey, Box<Rejection>> {
    let Some(key) = cmd.key.as_ref() else {
        return Err(reject(cmd, reason::MALFORMED, "command without a key".into()));
    };
    if key.product_id.is_empty() || key.product_id.len() > 512 {
        return Err(reject(cmd, reason::MALFORMED, "product_id must be 1..=512 bytes".into()));
    }
    let p = shelfsync_bus::partition_of(key.brand_id, key.place_id, limits.partitions);
    if p.0 != limits.partition {
        return Err(reject(
            cmd,
            reason::WRONG_PARTITION,
            format!("place belongs to partition {p}, sent to {}", limits.partition),
        ));
    }
    Ok(key)
}

/// Whether applying `cmd` once more to `slot` (a record as a commit just
/// wrote it) would change nothing at all, found by doing it, on a copy in
/// `scratch` (emptied first), with the same code as any command: the
/// oracle of the property test that lets the owner vouch for a PATCH it
/// wrote without trying it (`known`).
#[cfg(test)]
pub fn changes_nothing(
    cmd: &Command,
    key: &Key,
    slot: &Slot,
    limits: &Limits,
    scratch: &mut Slots,
) -> bool {
    scratch.clear();
    let copy = Slot { record: slot.record.clone(), generation: slot.generation, ..Slot::default() };
    scratch.insert(key.clone(), copy);
    let outcome = apply_command(cmd, scratch, limits);
    let after = scratch.get(key);
    matches!(outcome, Ok(None))
        && after.is_some_and(|s| {
            !s.record_dirty && !s.gen_dirty && s.tombstone.is_none() && s.absent_index.is_none()
        })
}

/// Applies one command to its slot. `Ok(None)`: nothing observable changed
/// (the generation may have been written silently).
fn apply_command(
    cmd: &Command,
    slots: &mut Slots,
    limits: &Limits,
) -> Result<Option<Change>, Box<Rejection>> {
    let key = validate(cmd, limits)?;
    let kind = CommandKind::try_from(cmd.kind).unwrap_or(CommandKind::Unspecified);
    if kind == CommandKind::Unspecified {
        return Err(reject(cmd, reason::MALFORMED, format!("unknown command kind {}", cmd.kind)));
    }
    let slot_key = (key.brand_id, key.place_id, key.product_id.clone());
    let slot = slots.entry(slot_key).or_default();
    let current_updated = slot.record.as_ref().map_or(0, |r| r.updated_at);
    if let Some(expected) = cmd.expected_updated_at
        && expected != current_updated
    {
        return Err(reject(
            cmd,
            reason::CONFLICT,
            format!("expected updated_at {expected}, record is at {current_updated}"),
        ));
    }
    let before = slot.record.as_ref();
    let before_generation = slot.generation;
    let was_deleted = before.is_some_and(|b| b.deleted);
    // A deleted record is gone: a later write starts from nothing.
    let live = before.filter(|r| !r.deleted);
    let base_data = live.map_or(&[][..], |r| &r.data[..]);
    let base_state = live.map_or(&[][..], |r| &r.state[..]);
    let malformed = |what: &str, e: shelfsync_merge::MergeError| {
        reject(cmd, reason::MALFORMED, format!("{what}: {e}"))
    };
    // A record written after its deletion starts afresh, exactly as it would
    // once the tombstone is purged: not absent, no generation.
    let recreate = was_deleted && kind != CommandKind::Delete;
    let mut generation = if recreate { 0 } else { slot.generation };
    // The record's flags and times; its data and state come from the command.
    // The fields the command changed, when the merge found them.
    let mut changed = None;
    let mut next = match before {
        Some(b) if recreate => Record { updated_at: b.updated_at, ..Default::default() },
        Some(b) => Record {
            key: None,
            data: Vec::new(),
            state: Vec::new(),
            generation: b.generation,
            absent: b.absent,
            deleted: b.deleted,
            created_at: b.created_at,
            updated_at: b.updated_at,
        },
        None => Record::default(),
    };
    match kind {
        CommandKind::Save => {
            next.data =
                shelfsync_merge::canonicalize(&cmd.data).map_err(|e| malformed("data", e))?;
            next.state =
                shelfsync_merge::canonicalize(&cmd.state).map_err(|e| malformed("state", e))?;
            next.deleted = false;
        }
        CommandKind::Patch => {
            let (data, changed_data) =
                shelfsync_merge::merge_changes(base_data, &cmd.data, &cmd.clear_data_fields)
                    .map_err(|e| malformed("data", e))?;
            let (state, changed_state) =
                shelfsync_merge::merge_changes(base_state, &cmd.state, &cmd.clear_state_fields)
                    .map_err(|e| malformed("state", e))?;
            (next.data, next.state) = (data, state);
            next.deleted = false;
            // Against the live record (a deleted one's change is a creation,
            // compared with nothing, as the merge's base was).
            changed = Some((changed_data, changed_state));
        }
        CommandKind::Delete => {
            let Some(b) = before else {
                // Deleting what never existed changes nothing.
                return Ok(None);
            };
            (next.data, next.state) = (b.data.clone(), b.state.clone());
            next.deleted = true;
        }
        CommandKind::Unspecified => unreachable!("rejected above"),
    }
    let size = next.data.len() + next.state.len();
    // A delete never grows a record: it must work even under a lowered limit.
    if kind != CommandKind::Delete && size > limits.max_record_bytes {
        return Err(reject(
            cmd,
            reason::TOO_LARGE,
            format!("record would be {size} bytes, limit {}", limits.max_record_bytes),
        ));
    }
    // A record a full import carries is present; the import's generation is
    // stamped only on records it writes (the others are spared by its sweep
    // through the touched set, see [`Touch`]).
    if cmd.generation > 0 && kind != CommandKind::Delete {
        next.absent = false;
    }
    let observable = before.is_none_or(|b| {
        b.data != next.data
            || b.state != next.state
            || b.absent != next.absent
            || b.deleted != next.deleted
    });
    if !observable {
        return Ok(None);
    }
    // Accepted and changed: from here on the slot moves.
    if cmd.generation > 0 && kind != CommandKind::Delete {
        generation = cmd.generation;
    }
    let before = slot.record.take();
    slot.generation = generation;
    next.updated_at = bump(current_updated, limits.now_us);
    if before.is_none() || was_deleted {
        next.created_at = next.updated_at;
    }
    let kind = if next.deleted {
        ChangeKind::Deleted
    } else if before.is_none() || was_deleted {
        ChangeKind::Created
    } else {
        ChangeKind::Updated
    };
    slot.tombstone = match (was_deleted, next.deleted) {
        (false, true) => Some(true),
        (true, false) => Some(false),
        _ => slot.tombstone,
    };
    let absent_live = |r: &Record| r.absent && !r.deleted;
    let was_absent = before.as_ref().is_some_and(absent_live);
    if was_absent != absent_live(&next) {
        slot.absent_index = Some(absent_live(&next));
    }
    slot.record_dirty = true;
    slot.gen_dirty = true; // the generation is stored with the record
    // Re-creating a deleted record is a CREATED change: no `before`.
    let before = before.filter(|_| !was_deleted).map(|r| (r, before_generation));
    let change = change(key, before, &next, kind, slot.generation, cmd.origin.clone(), changed);
    slot.record = Some(next);
    Ok(Some(change))
}

/// A sweep of a whole place at once: census, decision, marks. Storage
/// applies sweeps in bounded steps instead (`crate::worker::sweep`), through the same
/// decision and marking; this one is the reference the tests hold it to.
fn apply_sweep(
    sweep: &Sweep,
    slots: &mut Slots,
    swept: &HashMap<PlaceKey, SweptPlace>,
    limits: &Limits,
    out: &mut Outcome,
) {
    let place = sweep.place();
    let stored = swept.get(&place);
    // What the import carried: in earlier batches, and in this one.
    let this_batch = out.touched.iter().filter(|t| t.of() == (place, sweep.generation));
    let mut carried = stored.and_then(|s| s.touched.get(&sweep.generation).cloned());
    for t in this_batch {
        carried.get_or_insert_default().insert(t.product_id.clone());
    }
    let column: HashMap<&str, GenEntry> = stored
        .map(|s| s.column.iter().map(|(p, e)| (p.as_str(), *e)).collect())
        .unwrap_or_default();
    // Records written earlier in this batch may not be in the stored column.
    let mut products: Vec<String> = column.keys().map(|p| p.to_string()).collect();
    products.extend(
        slots
            .keys()
            .filter(|(b, p, _)| PlaceKey::new(*b, *p) == place)
            .map(|(_, _, id)| id.clone()),
    );
    products.sort();
    products.dedup();
    // A slot touched earlier in this batch is newer than the column.
    let entry = |slots: &Slots, k: &Key| match slots.get(k) {
        Some(slot) => slot.record.is_some().then(|| slot.gen_entry()),
        None => column.get(k.2.as_str()).copied(),
    };
    let spared = |id: &str| carried.as_ref().is_some_and(|c| c.contains(id));
    let mut census = Census::default();
    for id in &products {
        if let Some(e) = entry(slots, &(place.brand_id, place.place_id, id.clone())) {
            census.count(&e, sweep.generation, spared(id));
        }
    }
    let decision =
        sweep::decide(sweep, census, carried.is_some(), stored.and_then(|s| s.held.as_ref()));
    let mut marked = 0;
    if decision == Decision::Apply {
        for id in products.into_iter().filter(|id| !spared(id)) {
            let k = (place.brand_id, place.place_id, id);
            // The store loads every candidate; a missing one is skipped, not guessed.
            let Some(slot) = slots.get_mut(&k) else { continue };
            if let Some(c) = sweep::mark_absent(sweep, &k, slot, limits.now_us) {
                marked += 1;
                out.changes.push(c);
            }
        }
    }
    out.sweeps.push(sweep::outcome(sweep, decision, census, marked, limits.now_us));
}

/// Sweep candidates of a place: products whose stored generation is below
/// the sweep's, that are neither absent nor deleted, and that the import did
/// not carry (`touched`).
pub fn sweep_candidates(
    sweep: &Sweep,
    column: &[(String, GenEntry)],
    touched: Option<&std::collections::HashSet<String>>,
) -> Vec<String> {
    column
        .iter()
        .filter(|(p, e)| {
            sweep::is_candidate(e, sweep.generation) && !touched.is_some_and(|t| t.contains(p))
        })
        .map(|(p, _)| p.clone())
        .collect()
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

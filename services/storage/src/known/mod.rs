//! What a partition's owner knows, in memory, of the records it applied:
//! enough to tell without Redis that a PATCH would change nothing.
//!
//! The owner is the only writer of its partition's keys (every commit is
//! fenced), so what it saw stays true until it writes the record again. For
//! each record it keeps the hashes of a few PATCHes that were applied to the
//! record **as it is now** and changed nothing (an identical re-import sends
//! the same PATCH again). A command with such a hash is not loaded, merged
//! nor compared: it is counted as unchanged, and a full import's only counts
//! as carried (its touch) without reading the record.
//!
//! Rules that keep it exact:
//! - a hash is learned only from an observation (never from a guess that a
//!   patch is idempotent): the command was applied to the stored record and
//!   changed nothing, or it was the only command of its commit on a record
//!   it wrote, and applying it once more to the record as written, on a copy
//!   with the same code, changed nothing (so the first re-import after an
//!   initial one is vouched for too);
//! - any commit that writes a record forgets it; a commit that fails or is
//!   fenced, and every (re)bind of the partition, forgets everything;
//! - only plain PATCHes are vouched for (no SAVE, DELETE or compare-and-swap),
//!   and a full import's PATCH only while the record is present (not
//!   absent, not deleted): bringing an absent record back is a change;
//! - a key is skipped only if every command on it in the commit is vouched
//!   for; otherwise all of them go through Redis in order.

use std::borrow::Cow;

use shelfsync_proto::{Command, CommandBatch, CommandKind};
use xxhash_rust::xxh3::{Xxh3, xxh3_64, xxh3_128};

use crate::apply::{FastMap, Key, Limits, Slots, Touch, changes_nothing};

pub mod live;

pub use live::LivePlaces;

/// Hashes of no-op PATCHes kept per record (say, a price feed and a stock
/// feed of the same record).
const NOOPS: usize = 3;

/// One record as its owner last saw it.
#[derive(Debug, Clone, Default)]
struct Entry {
    /// Stored, not absent, not deleted.
    present: bool,
    /// Its stored generation.
    generation: i64,
    /// PATCHes (by [`command_hash`]) that change nothing on it; 0 = free.
    noops: [u64; NOOPS],
}

impl Entry {
    fn vouches(&self, hash: u64, generation: i64) -> bool {
        hash != 0 && self.noops.contains(&hash) && (generation == 0 || self.present)
    }

    fn learn(&mut self, hash: u64) {
        if hash == 0 || self.noops.contains(&hash) {
            return;
        }
        self.noops.rotate_right(1);
        self.noops[0] = hash;
    }
}

/// A command that [`Known`] vouched for: it changes nothing; a full
/// import's still counts as carried by its import (its touch).
#[derive(Debug, Clone)]
pub struct Skipped {
    pub key: Key,
    /// The full import's generation (0: none).
    pub generation: i64,
}

impl Skipped {
    /// What the commit appends to the import's touched set, if anything.
    pub fn touch(&self) -> Option<Touch> {
        let (brand_id, place_id, product_id) = self.key.clone();
        let place = shelfsync_proto::PlaceKey::new(brand_id, place_id);
        (self.generation > 0).then_some(Touch { place, generation: self.generation, product_id })
    }
}

/// The commands of one message split by [`Known::split`].
#[derive(Debug, Default)]
pub struct Split<'b> {
    /// The commands that go through Redis, in order: the message itself
    /// when none is skipped (no copy of it is made).
    pub rest: Cow<'b, CommandBatch>,
    pub skipped: Vec<Skipped>,
}

/// The records a partition's owner can vouch for. Bounded: once
/// `capacity` records are known, new ones are not added.
#[derive(Debug)]
pub struct Known {
    entries: FastMap<u128, Entry>,
    capacity: usize,
    /// The live records of the places whose census it has seen, kept by the
    /// same rules.
    pub live: LivePlaces,
}

/// Inputs up to this long are hashed in one pass from the stack; longer
/// ones are streamed. XXH3 gives the same hash either way.
const ONE_PASS: usize = 1024;

/// The brand, the place (fixed width) and the product id, end to end.
pub(crate) fn key_hash(brand_id: i64, place_id: i64, product_id: &str) -> u128 {
    let id = product_id.as_bytes();
    if 16 + id.len() <= ONE_PASS {
        let mut buf = [0u8; ONE_PASS];
        buf[..8].copy_from_slice(&brand_id.to_le_bytes());
        buf[8..16].copy_from_slice(&place_id.to_le_bytes());
        buf[16..16 + id.len()].copy_from_slice(id);
        return xxh3_128(&buf[..16 + id.len()]);
    }
    let mut h = Xxh3::new();
    h.update(&brand_id.to_le_bytes());
    h.update(&place_id.to_le_bytes());
    h.update(id);
    h.digest128()
}

fn command_key(cmd: &Command) -> Option<u128> {
    let k = cmd.key.as_ref()?;
    Some(key_hash(k.brand_id, k.place_id, &k.product_id))
}

/// The content of a plain PATCH (what it sets and clears), or 0 for a
/// command that is never vouched for.
pub fn command_hash(cmd: &Command) -> u64 {
    if cmd.kind != CommandKind::Patch as i32 || cmd.expected_updated_at.is_some() {
        return 0;
    }
    // Each part after its length: data, state, then the two lists of fields.
    let (data, state) = (&cmd.data[..], &cmd.state[..]);
    let plain = cmd.clear_data_fields.is_empty() && cmd.clear_state_fields.is_empty();
    if plain && 32 + data.len() + state.len() <= ONE_PASS {
        let mut buf = [0u8; ONE_PASS];
        let mut at = 0;
        for part in [data, state] {
            buf[at..at + 8].copy_from_slice(&(part.len() as u64).to_le_bytes());
            buf[at + 8..at + 8 + part.len()].copy_from_slice(part);
            at += 8 + part.len();
        }
        // The two empty lists: their lengths, zero (the buffer's bytes).
        return xxh3_64(&buf[..at + 16]).max(1);
    }
    let mut h = Xxh3::new();
    for part in [data, state] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    for fields in [&cmd.clear_data_fields, &cmd.clear_state_fields] {
        h.update(&(fields.len() as u64).to_le_bytes());
        for f in fields {
            h.update(&f.to_le_bytes());
        }
    }
    h.digest().max(1)
}

impl Known {
    pub fn new(capacity: usize) -> Self {
        Self { entries: FastMap::default(), capacity, live: LivePlaces::new(capacity) }
    }

    /// Forgets everything (a failed or fenced commit, a new binding).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.live.clear();
    }

    /// Splits the commands of `batches` (applied in this order, as one
    /// commit) into those that must go through Redis and those vouched for.
    pub fn split<'b>(&self, batches: &[&'b CommandBatch]) -> Vec<Split<'b>> {
        let whole = |b: &'b CommandBatch| Split { rest: Cow::Borrowed(b), skipped: Vec::new() };
        if self.entries.is_empty() {
            return batches.iter().map(|b| whole(b)).collect();
        }
        // A key is skipped only when every command on it is vouched for.
        let n: usize = batches.iter().map(|b| b.commands.len()).sum();
        let mut skippable: FastMap<u128, bool> = FastMap::default();
        skippable.reserve(n);
        let mut keys = Vec::with_capacity(n);
        for cmd in batches.iter().flat_map(|b| &b.commands) {
            let k = command_key(cmd);
            keys.push(k);
            let Some(k) = k else { continue };
            let ok =
                self.entries.get(&k).is_some_and(|e| e.vouches(command_hash(cmd), cmd.generation));
            skippable.entry(k).and_modify(|s| *s &= ok).or_insert(ok);
        }
        let mut keys = keys.into_iter();
        batches
            .iter()
            .map(|b| {
                let n = b.commands.len();
                let these: Vec<Option<u128>> = keys.by_ref().take(n).collect();
                let skips = |k: &Option<u128>| k.is_some_and(|k| skippable.get(&k) == Some(&true));
                if !these.iter().any(skips) {
                    return whole(b);
                }
                let mut rest = CommandBatch {
                    partition: b.partition,
                    commands: Vec::new(),
                    sweeps: b.sweeps.clone(),
                    origin: b.origin.clone(),
                };
                let mut skipped = Vec::with_capacity(n);
                for (cmd, k) in b.commands.iter().zip(&these) {
                    match cmd.key.as_ref() {
                        Some(key) if skips(k) => skipped.push(Skipped {
                            key: (key.brand_id, key.place_id, key.product_id.clone()),
                            generation: cmd.generation,
                        }),
                        _ => rest.commands.push(cmd.clone()),
                    }
                }
                Split { rest: Cow::Owned(rest), skipped }
            })
            .collect()
    }

    /// After a successful commit (and its [`Known::forget_written`]):
    /// learns the commands of `applied` that left a record as it was, or
    /// wrote it and would leave it as written (tried under `limits`, the
    /// commit's); `rejected`: keys with a rejected command, learned nothing
    /// from.
    pub fn committed<'a>(
        &mut self,
        slots: &Slots,
        applied: impl IntoIterator<Item = &'a Command>,
        rejected: &[Key],
        limits: &Limits,
    ) {
        let applied: Vec<(&Command, Option<u128>)> =
            applied.into_iter().map(|cmd| (cmd, command_key(cmd))).collect();
        let mut commands_on: FastMap<u128, u32> = FastMap::default();
        for k in applied.iter().filter_map(|(_, k)| *k) {
            *commands_on.entry(k).or_default() += 1;
        }
        let mut scratch = Slots::default();
        for (cmd, k) in applied {
            let hash = command_hash(cmd);
            let (Some(key), Some(k)) = (cmd.key.as_ref(), k) else { continue };
            let slot_key = (key.brand_id, key.place_id, key.product_id.clone());
            let Some(slot) = slots.get(&slot_key) else { continue };
            if hash == 0 || slot.record.is_none() || rejected.contains(&slot_key) {
                continue;
            }
            if !self.entries.contains_key(&k) && self.entries.len() >= self.capacity {
                continue;
            }
            if slot.record_dirty
                && (commands_on.get(&k) != Some(&1)
                    || !changes_nothing(cmd, &slot_key, slot, limits, &mut scratch))
            {
                continue;
            }
            let r = slot.record.as_ref().expect("checked above");
            let e = self.entries.entry(k).or_default();
            e.present = !r.absent && !r.deleted;
            e.generation = slot.generation;
            e.learn(hash);
        }
    }

    /// Forgets the records a commit wrote and notes the generations it
    /// wrote. Every successful commit that writes records comes here (once),
    /// so the live places are kept here too.
    pub fn forget_written(&mut self, slots: &Slots) {
        self.live.written(slots);
        for ((b, p, id), slot) in slots {
            let k = key_hash(*b, *p, id);
            if slot.record_dirty {
                self.entries.remove(&k);
            } else if slot.gen_dirty
                && let Some(e) = self.entries.get_mut(&k)
            {
                e.generation = slot.generation;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::{Slot, apply_batch};
    use prost::Message;
    use shelfsync_proto::{Product, Record, RecordKey};

    fn limits() -> Limits {
        Limits { partition: 0, partitions: 1, max_record_bytes: 1 << 20, now_us: 1_000 }
    }

    fn price(id: &str, price: i64, generation: i64) -> Command {
        let data = Product { price: Some(price), ..Default::default() }.encode_to_vec();
        patch(id, &data, generation)
    }

    fn patch(id: &str, data: &[u8], generation: i64) -> Command {
        Command {
            key: Some(RecordKey { brand_id: 7, place_id: 1, product_id: id.into() }),
            kind: CommandKind::Patch as i32,
            data: data.to_vec(),
            generation,
            ..Default::default()
        }
    }

    fn key(id: &str) -> Key {
        (7, 1, id.to_string())
    }

    fn clean(absent: bool, generation: i64) -> Slot {
        Slot {
            record: Some(Record { absent, ..Default::default() }),
            generation,
            ..Default::default()
        }
    }

    fn batch(cmds: Vec<Command>) -> CommandBatch {
        CommandBatch { commands: cmds, ..Default::default() }
    }

    /// The one-pass hashes are the streamed ones, on each side of the
    /// stack buffer's size, so no key nor command hashes two ways.
    #[test]
    fn hashes_in_one_pass_are_the_streamed_ones() {
        let streamed_key = |id: &str| {
            let mut h = Xxh3::new();
            for part in [&7i64.to_le_bytes()[..], &(-3i64).to_le_bytes(), id.as_bytes()] {
                h.update(part);
            }
            h.digest128()
        };
        let streamed_command = |cmd: &Command| {
            let mut h = Xxh3::new();
            for part in [&cmd.data[..], &cmd.state[..]] {
                h.update(&(part.len() as u64).to_le_bytes());
                h.update(part);
            }
            for fields in [&cmd.clear_data_fields, &cmd.clear_state_fields] {
                h.update(&(fields.len() as u64).to_le_bytes());
                fields.iter().for_each(|f| h.update(&f.to_le_bytes()));
            }
            h.digest().max(1)
        };
        for len in [0, 1, 15, 16, 17, 240, 1000, 1007, 1008, 1009, 3000] {
            let id = "x".repeat(len);
            assert_eq!(key_hash(7, -3, &id), streamed_key(&id), "id of {len} bytes");
            let mut cmd = patch("a", &vec![5u8; len], 0);
            cmd.state = vec![9u8; len / 3];
            assert_eq!(command_hash(&cmd), streamed_command(&cmd), "data of {len} bytes");
            cmd.clear_state_fields = vec![2];
            assert_eq!(command_hash(&cmd), streamed_command(&cmd), "and a field cleared");
        }
        assert_ne!(key_hash(7, 1, "ab"), key_hash(7, 1, "ba"));
    }

    #[test]
    fn only_an_observed_no_op_is_vouched_for() {
        let mut known = Known::new(10);
        let a = patch("a", b"x", 5);
        let b = batch(vec![a.clone()]);
        assert!(known.split(&[&b])[0].skipped.is_empty(), "nothing known yet");
        known.committed(&Slots::from_iter([(key("a"), clean(false, 5))]), [&a], &[], &limits());
        let split = &known.split(&[&b])[0];
        assert_eq!(split.skipped.len(), 1);
        assert!(split.rest.commands.is_empty());
        let next = batch(vec![patch("a", b"x", 6)]);
        let split = &known.split(&[&next])[0];
        let touch = split.skipped[0].touch().expect("a full import's command is carried");
        assert_eq!((touch.product_id.as_str(), touch.generation), ("a", 6));
        let delta = batch(vec![patch("a", b"x", 0)]);
        assert_eq!(known.split(&[&delta])[0].skipped[0].touch(), None, "a delta carries nothing");
        let other = batch(vec![patch("a", b"y", 6)]);
        let split = &known.split(&[&other])[0];
        assert_eq!(split.skipped.len(), 0, "another patch is loaded");
        assert!(
            matches!(split.rest, Cow::Borrowed(_)),
            "a message none is skipped of is not copied"
        );
        let both = batch(vec![patch("a", b"x", 6), patch("b", b"x", 6)]);
        let split = &known.split(&[&both])[0];
        assert_eq!((split.skipped.len(), split.rest.commands.len()), (1, 1));
        assert_eq!(split.rest.commands[0].key.as_ref().map(|k| k.product_id.as_str()), Some("b"));
    }

    #[test]
    fn a_written_record_is_forgotten() {
        let mut known = Known::new(10);
        let a = patch("a", b"x", 5);
        known.committed(&Slots::from_iter([(key("a"), clean(false, 5))]), [&a], &[], &limits());
        let mut dirty = clean(false, 5);
        dirty.record_dirty = true;
        known.forget_written(&Slots::from_iter([(key("a"), dirty)]));
        assert!(known.entries.is_empty());
    }

    #[test]
    fn a_key_with_any_unknown_command_goes_through_redis_whole() {
        let mut known = Known::new(10);
        let a = patch("a", b"x", 0);
        known.committed(&Slots::from_iter([(key("a"), clean(false, 0))]), [&a], &[], &limits());
        let first = batch(vec![a.clone()]);
        let second = batch(vec![patch("a", b"y", 0)]);
        let split = known.split(&[&first, &second]);
        assert!(split.iter().all(|s| s.skipped.is_empty()));
        assert_eq!(split[0].rest.commands.len() + split[1].rest.commands.len(), 2);
    }

    #[test]
    fn an_absent_record_is_not_vouched_for_a_full_import() {
        let mut known = Known::new(10);
        let delta = patch("a", b"x", 0);
        known.committed(&Slots::from_iter([(key("a"), clean(true, 3))]), [&delta], &[], &limits());
        assert_eq!(known.split(&[&batch(vec![delta.clone()])])[0].skipped.len(), 1);
        let full = batch(vec![patch("a", b"x", 9)]);
        assert!(known.split(&[&full])[0].skipped.is_empty(), "bringing it back is a change");
    }

    #[test]
    fn cas_saves_deletes_and_rejected_keys_are_never_learned() {
        let mut known = Known::new(10);
        let mut cas = patch("a", b"x", 0);
        cas.expected_updated_at = Some(1);
        let mut save = patch("b", b"x", 0);
        save.kind = CommandKind::Save as i32;
        let c = patch("c", b"x", 0);
        let slots = Slots::from_iter([
            (key("a"), clean(false, 0)),
            (key("b"), clean(false, 0)),
            (key("c"), clean(false, 0)),
        ]);
        known.committed(&slots, [&cas, &save, &c], &[key("c")], &limits());
        assert!(known.entries.is_empty());
    }

    #[test]
    fn it_stops_growing_at_its_capacity() {
        let mut known = Known::new(1);
        let (a, b) = (patch("a", b"x", 0), patch("b", b"x", 0));
        let slots = Slots::from_iter([(key("a"), clean(false, 0)), (key("b"), clean(false, 0))]);
        known.committed(&slots, [&a, &b], &[], &limits());
        assert_eq!(known.entries.len(), 1);
    }

    #[test]
    fn a_record_written_is_vouched_for_when_its_command_would_leave_it_as_written() {
        let mut known = Known::new(10);
        let written = |cmds: Vec<Command>| {
            let mut slots = Slots::default();
            let out = apply_batch(&batch(cmds), &mut slots, &Default::default(), &limits());
            assert!(out.rejections.is_empty(), "{:?}", out.rejections);
            slots
        };
        let a = price("a", 5, 1);
        let slots = written(vec![a.clone()]);
        assert!(slots[&key("a")].record_dirty);
        known.forget_written(&slots);
        known.committed(&slots, [&a], &[], &limits());
        let next = batch(vec![price("a", 5, 2)]);
        let split = &known.split(&[&next])[0];
        assert_eq!(split.skipped.len(), 1, "the next import's same command is vouched for");
        assert!(known.split(&[&batch(vec![price("a", 6, 2)])])[0].skipped.is_empty());

        // Two commands on the record in one commit: nothing is learned.
        let (b1, b2) = (price("b", 5, 1), price("b", 6, 1));
        let slots = written(vec![b1.clone(), b2.clone()]);
        known.forget_written(&slots);
        known.committed(&slots, [&b1, &b2], &[], &limits());
        assert!(known.split(&[&batch(vec![price("b", 6, 2)])])[0].skipped.is_empty());
    }
}

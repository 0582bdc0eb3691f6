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
//! - a hash is learned from a commit that applied the command: to the stored
//!   record, changing nothing, or as the only command of its commit on a
//!   record it wrote — a plain PATCH applied once more to what it wrote
//!   changes nothing, which the apply core's property test
//!   `a_plain_patch_changes_nothing_on_what_it_wrote` holds it to (so the
//!   first re-import after an initial one is vouched for too);
//! - any commit that writes a record forgets it; a commit that fails or is
//!   fenced, and every (re)bind of the partition, forgets everything;
//! - only plain PATCHes are vouched for (no SAVE, DELETE or compare-and-swap),
//!   and a full import's PATCH only while the record is present (not
//!   absent, not deleted): bringing an absent record back is a change;
//! - a key is skipped only if every command on it in the commit is vouched
//!   for; otherwise all of them go through Redis in order.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use shelfsync_proto::{Command, CommandBatch, CommandKind};
use xxhash_rust::xxh3::{Xxh3, xxh3_64, xxh3_64_with_seed, xxh3_128_with_seed};

use crate::apply::touched_set::Appends;
use crate::apply::{FastMap, Key, Slots};

pub(crate) mod live;
pub(crate) mod scan;
mod wire;

pub(crate) use live::LivePlaces;
use scan::CommandView;
pub(crate) use scan::{ReadError, Scanned};

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

/// The commands of one message split by [`Known::split`].
#[derive(Debug, Default)]
pub(crate) struct Split {
    /// The commands that go through Redis, in order, decoded (with the
    /// message's partition, sweeps and origin).
    pub(crate) rest: CommandBatch,
    /// Commands vouched for: they change nothing.
    pub(crate) skipped: u64,
    /// What the skipped commands of full imports carried.
    pub(crate) carried: Appends,
    /// When the skipped commands that have an origin of their own were
    /// published (the others have their batch's).
    pub(crate) skipped_published: Vec<i64>,
}

/// A bound on what every partition of a replica keeps together
/// (`storage.known_records`): records are taken from it as they are kept and
/// given back as they are forgotten, so the replica's memory for them is
/// bounded however many partitions it owns.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    used: Arc<AtomicUsize>,
    limit: usize,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Self {
        Self { used: Arc::default(), limit }
    }

    /// Takes `n` records if they fit.
    fn take(&self, n: usize) -> bool {
        n == 0
            || self
                .used
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                    u.checked_add(n).filter(|&t| t <= self.limit)
                })
                .is_ok()
    }

    fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::Relaxed);
    }

    /// Records kept now, over every partition sharing the budget.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// The records a partition's owner can vouch for. Bounded: once the
/// replica's budget is used up, new ones are not added.
#[derive(Debug)]
pub(crate) struct Known {
    entries: FastMap<u128, Entry>,
    budget: Budget,
    /// The live records of the places whose census it has seen, kept by the
    /// same rules.
    pub(crate) live: LivePlaces,
    /// Scratch of [`Known::split`], kept for its capacity.
    skippable: FastMap<u128, bool>,
}

/// The product id, hashed with a seed made of its brand and place: no
/// copy of the id, whatever its length.
pub(crate) fn key_hash(brand_id: i64, place_id: i64, product_id: &str) -> u128 {
    xxh3_128_with_seed(product_id.as_bytes(), place_seed(brand_id, place_id))
}

/// The seed of [`key_hash`] for the ids of one place.
fn place_seed(brand_id: i64, place_id: i64) -> u64 {
    let mut place = [0u8; 16];
    place[..8].copy_from_slice(&brand_id.to_le_bytes());
    place[8..].copy_from_slice(&place_id.to_le_bytes());
    xxh3_64(&place)
}

fn command_key(cmd: &Command) -> Option<u128> {
    let k = cmd.key.as_ref()?;
    Some(key_hash(k.brand_id, k.place_id, &k.product_id))
}

/// The content of a plain PATCH (what it sets and clears), or 0 for a
/// command that is never vouched for.
pub(crate) fn command_hash(cmd: &Command) -> u64 {
    if cmd.kind != CommandKind::Patch as i32 || cmd.expected_updated_at.is_some() {
        return 0;
    }
    content_hash(&cmd.data, &cmd.state, &cmd.clear_data_fields, &cmd.clear_state_fields)
}

/// [`command_hash`] of a command located in its message.
fn view_hash(view: &CommandView<'_>) -> u64 {
    if !view.plain_patch() {
        return 0;
    }
    let (clear_data, clear_state) = view.clears();
    content_hash(view.data(), view.state(), clear_data, clear_state)
}

/// What a PATCH sets and clears: the data hashed with a seed made of the
/// state and (rarely any) the fields cleared; never 0. Each part is hashed
/// where it lies, with no copy.
fn content_hash(data: &[u8], state: &[u8], clear_data: &[u32], clear_state: &[u32]) -> u64 {
    let mut seed = xxh3_64(state);
    if !clear_data.is_empty() || !clear_state.is_empty() {
        let mut h = Xxh3::with_seed(seed);
        for fields in [clear_data, clear_state] {
            h.update(&(fields.len() as u64).to_le_bytes());
            for f in fields {
                h.update(&f.to_le_bytes());
            }
        }
        seed = h.digest();
    }
    xxh3_64_with_seed(data, seed).max(1)
}

impl Known {
    /// A partition's, its no-op PATCHes taken from `entries` and its live
    /// places from `live` (each shared by every partition of the replica).
    pub(crate) fn new(entries: Budget, live: Budget) -> Self {
        Self {
            entries: FastMap::default(),
            budget: entries,
            live: LivePlaces::new(live),
            skippable: FastMap::default(),
        }
    }

    /// Forgets everything (a failed or fenced commit, a new binding, a
    /// Redis that went back in time).
    pub(crate) fn clear(&mut self) {
        self.budget.give(self.entries.len());
        self.entries.clear();
        self.live.clear();
    }

    /// Splits the commands of `messages` (applied in this order, as one
    /// commit) into those that must go through Redis, decoded, and those
    /// vouched for, which are neither decoded nor loaded (what the skipped
    /// commands of full imports carried is kept with each split).
    pub(crate) fn split(
        &mut self,
        messages: &[&Scanned],
    ) -> Result<Vec<Split>, prost::DecodeError> {
        let whole = |m: &Scanned| Ok(Split { rest: m.decode_all()?, ..Split::default() });
        if self.entries.is_empty() {
            return messages.iter().map(|m| whole(m)).collect();
        }
        // A key is skipped only when every command on it is vouched for.
        let n: usize = messages.iter().map(|m| m.len()).sum();
        let mut skippable = std::mem::take(&mut self.skippable);
        skippable.clear();
        skippable.reserve(n);
        let mut keys = Vec::with_capacity(n);
        // Commands come place after place: the key's seed is the place's.
        let mut seed = None;
        for m in messages {
            let Some(views) = m.views() else {
                // Decoded whole: nothing in it is vouched for.
                keys.extend(std::iter::repeat_n(None, m.len()));
                continue;
            };
            for view in views {
                let k = view.key().map(|(place, id)| {
                    let s = match seed {
                        Some((p, s)) if p == place => s,
                        _ => {
                            let s = place_seed(place.brand_id, place.place_id);
                            seed = Some((place, s));
                            s
                        }
                    };
                    xxh3_128_with_seed(id.as_bytes(), s)
                });
                keys.push(k);
                let Some(k) = k else { continue };
                let ok = self
                    .entries
                    .get(&k)
                    .is_some_and(|e| e.vouches(view_hash(&view), view.generation()));
                skippable.entry(k).and_modify(|s| *s &= ok).or_insert(ok);
            }
        }
        let skips = |k: &Option<u128>| k.is_some_and(|k| skippable.get(&k) == Some(&true));
        let mut from = 0;
        let mut out = Vec::with_capacity(messages.len());
        for m in messages {
            let these = &keys[from..from + m.len()];
            from += m.len();
            let (Some(views), true) = (m.views(), these.iter().any(skips)) else {
                out.push(whole(m)?);
                continue;
            };
            let mut split = Split::default();
            for (view, k) in views.zip(these) {
                if !skips(k) {
                    continue;
                }
                split.skipped += 1;
                split.skipped_published.extend(view.published_at());
                if let Some((place, id)) = view.key()
                    && view.generation() > 0
                {
                    split.carried.add(place, view.generation(), id);
                }
            }
            split.rest = m.decode_some(|i| !skips(&these[i]))?;
            out.push(split);
        }
        self.skippable = skippable;
        Ok(out)
    }

    /// After a successful commit (and its [`Known::forget_written`]):
    /// learns the commands of `applied` that left a record as it was, or
    /// wrote it and would leave it as written (tried under `limits`, the
    /// commit's); `rejected`: keys with a rejected command, learned nothing
    /// from.
    pub(crate) fn committed<'a>(
        &mut self,
        slots: &Slots,
        applied: impl IntoIterator<Item = &'a Command>,
        rejected: &[Key],
    ) {
        let applied: Vec<(&Command, Option<u128>)> =
            applied.into_iter().map(|cmd| (cmd, command_key(cmd))).collect();
        let mut commands_on: FastMap<u128, u32> = FastMap::default();
        for k in applied.iter().filter_map(|(_, k)| *k) {
            *commands_on.entry(k).or_default() += 1;
        }
        // One key to look slots up with, its id buffer reused.
        let mut slot_key: Key = (0, 0, String::new());
        for (cmd, k) in applied {
            let hash = command_hash(cmd);
            let (Some(key), Some(k)) = (cmd.key.as_ref(), k) else { continue };
            (slot_key.0, slot_key.1) = (key.brand_id, key.place_id);
            slot_key.2.clear();
            slot_key.2.push_str(&key.product_id);
            let Some(slot) = slots.get(&slot_key) else { continue };
            if hash == 0 || slot.record.is_none() || rejected.contains(&slot_key) {
                continue;
            }
            // Written by this command alone: a plain PATCH applied once
            // more to what it wrote changes nothing (the apply core's
            // property `a_plain_patch_changes_nothing_on_what_it_wrote`).
            if slot.record_dirty && commands_on.get(&k) != Some(&1) {
                continue;
            }
            if !self.entries.contains_key(&k) && !self.budget.take(1) {
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
    pub(crate) fn forget_written(&mut self, slots: &Slots) {
        self.live.written(slots);
        for ((b, p, id), slot) in slots {
            let k = key_hash(*b, *p, id);
            if slot.record_dirty {
                if self.entries.remove(&k).is_some() {
                    self.budget.give(1);
                }
            } else if slot.gen_dirty
                && let Some(e) = self.entries.get_mut(&k)
            {
                e.generation = slot.generation;
            }
        }
    }
}

impl Drop for Known {
    fn drop(&mut self) {
        self.budget.give(self.entries.len());
    }
}

#[cfg(test)]
mod tests;

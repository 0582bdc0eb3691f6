//! One command applied to its record: the checks every kind shares (key,
//! partition, kind, expected `updated_at`), the kind's own step ([`save`],
//! [`patch`], [`delete`]: the record's data, state and `deleted` flag), then
//! the shared rest (size limit, presence, whether anything observable
//! changed, and the slot moved with its change).

use shelfsync_proto::{Change, ChangeKind, Command, CommandKind, Record, RecordKey, Rejection};

use super::{Limits, Slot, Slots, bump, change, reason, reject};

/// The data and state fields a command changed, when its merge found them.
type ChangedFields = Option<(Vec<u32>, Vec<u32>)>;

/// Applies one command to its slot. `Ok(None)`: nothing observable changed
/// (the generation may have been written silently).
pub(super) fn apply_command(
    cmd: &Command,
    slots: &mut Slots,
    limits: &Limits,
) -> Result<Option<Change>, Box<Rejection>> {
    let key = validate(cmd, limits)?;
    let kind = kind_of(cmd)?;
    let slot = slots.entry((key.brand_id, key.place_id, key.product_id.clone())).or_default();
    check_expected(cmd, slot)?;
    let before = slot.record.as_ref();
    // A record written after its deletion starts afresh, exactly as it would
    // once the tombstone is purged: not absent, no generation.
    let recreate = before.is_some_and(|b| b.deleted) && kind != CommandKind::Delete;
    let mut next = start_from(before, recreate);
    let changed = match kind {
        CommandKind::Save => save(cmd, &mut next)?,
        CommandKind::Patch => patch(cmd, before, &mut next)?,
        CommandKind::Delete => {
            if !delete(before, &mut next) {
                return Ok(None);
            }
            None
        }
        CommandKind::Unspecified => unreachable!("rejected by kind_of"),
    };
    let keeps = kind != CommandKind::Delete;
    // A delete never grows a record: it must work even under a lowered limit.
    let size = next.data.len() + next.state.len();
    if keeps && size > limits.max_record_bytes {
        return Err(reject(
            cmd,
            reason::TOO_LARGE,
            format!("record would be {size} bytes, limit {}", limits.max_record_bytes),
        ));
    }
    // A record a full import carries is present; the import's generation is
    // stamped only on records it writes (the others are spared by its sweep
    // through the touched set, see [`super::Touch`]).
    let carried = cmd.generation > 0 && keeps;
    if carried {
        next.absent = false;
    }
    if !observable(before, &next) {
        return Ok(None);
    }
    let generation = if carried {
        cmd.generation
    } else if recreate {
        0
    } else {
        slot.generation
    };
    Ok(Some(write(slot, cmd, key, next, generation, changed, limits.now_us)))
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

/// The command's kind; an unknown one is malformed.
fn kind_of(cmd: &Command) -> Result<CommandKind, Box<Rejection>> {
    match CommandKind::try_from(cmd.kind).unwrap_or(CommandKind::Unspecified) {
        CommandKind::Unspecified => {
            Err(reject(cmd, reason::MALFORMED, format!("unknown command kind {}", cmd.kind)))
        }
        kind => Ok(kind),
    }
}

/// Compare-and-swap: a command that expects an `updated_at` applies only to
/// the record at that point (0: no record).
fn check_expected(cmd: &Command, slot: &Slot) -> Result<(), Box<Rejection>> {
    let current_updated = slot.record.as_ref().map_or(0, |r| r.updated_at);
    match cmd.expected_updated_at {
        Some(expected) if expected != current_updated => Err(reject(
            cmd,
            reason::CONFLICT,
            format!("expected updated_at {expected}, record is at {current_updated}"),
        )),
        _ => Ok(()),
    }
}

/// The record's flags and times as the command finds them; its data and
/// state come from the command's kind.
fn start_from(before: Option<&Record>, recreate: bool) -> Record {
    match before {
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
    }
}

fn malformed(cmd: &Command, what: &str, e: shelfsync_merge::MergeError) -> Box<Rejection> {
    reject(cmd, reason::MALFORMED, format!("{what}: {e}"))
}

/// SAVE: the record's data and state are the command's, canonical.
fn save(cmd: &Command, next: &mut Record) -> Result<ChangedFields, Box<Rejection>> {
    next.data = shelfsync_merge::canonicalize(&cmd.data).map_err(|e| malformed(cmd, "data", e))?;
    next.state =
        shelfsync_merge::canonicalize(&cmd.state).map_err(|e| malformed(cmd, "state", e))?;
    next.deleted = false;
    Ok(None)
}

/// PATCH: the command's fields merged into the live record's (a deleted
/// record is gone: a later write starts from nothing), and the fields that
/// changed.
fn patch(
    cmd: &Command,
    before: Option<&Record>,
    next: &mut Record,
) -> Result<ChangedFields, Box<Rejection>> {
    let live = before.filter(|r| !r.deleted);
    let base_data = live.map_or(&[][..], |r| &r.data[..]);
    let base_state = live.map_or(&[][..], |r| &r.state[..]);
    let (data, changed_data) =
        shelfsync_merge::merge_changes(base_data, &cmd.data, &cmd.clear_data_fields)
            .map_err(|e| malformed(cmd, "data", e))?;
    let (state, changed_state) =
        shelfsync_merge::merge_changes(base_state, &cmd.state, &cmd.clear_state_fields)
            .map_err(|e| malformed(cmd, "state", e))?;
    (next.data, next.state) = (data, state);
    next.deleted = false;
    // Against the live record (a deleted one's change is a creation,
    // compared with nothing, as the merge's base was).
    Ok(Some((changed_data, changed_state)))
}

/// DELETE: the record kept as it was, marked deleted. `false`: there is
/// nothing to delete (deleting what never existed changes nothing).
fn delete(before: Option<&Record>, next: &mut Record) -> bool {
    let Some(b) = before else { return false };
    (next.data, next.state) = (b.data.clone(), b.state.clone());
    next.deleted = true;
    true
}

/// Whether `next` differs from `before` in what a consumer sees.
fn observable(before: Option<&Record>, next: &Record) -> bool {
    before.is_none_or(|b| {
        b.data != next.data
            || b.state != next.state
            || b.absent != next.absent
            || b.deleted != next.deleted
    })
}

/// Accepted and changed: the slot moves to `next` (at `generation`, its
/// times bumped to `now_us`), with dirty flags for the commit, and the
/// change says how.
fn write(
    slot: &mut Slot,
    cmd: &Command,
    key: &RecordKey,
    mut next: Record,
    generation: i64,
    changed: ChangedFields,
    now_us: i64,
) -> Change {
    let current_updated = slot.record.as_ref().map_or(0, |r| r.updated_at);
    let before_generation = slot.generation;
    let before = slot.record.take();
    let was_deleted = before.as_ref().is_some_and(|b| b.deleted);
    slot.generation = generation;
    next.updated_at = bump(current_updated, now_us);
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
    change
}

/// Whether applying `cmd` once more to `slot` (a record as a commit just
/// wrote it) would change nothing at all, found by doing it, on a copy in
/// `scratch` (emptied first), with the same code as any command: the
/// oracle of the property test that lets the owner vouch for a PATCH it
/// wrote without trying it (`known`).
#[cfg(test)]
pub fn changes_nothing(
    cmd: &Command,
    key: &super::Key,
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

use super::*;
use crate::apply::{Limits, Slot, apply_batch};
use prost::Message;
use shelfsync_proto::{Product, Record, RecordKey};

fn limits() -> Limits {
    Limits { partition: 0, partitions: 1, max_record_bytes: 1 << 20, now_us: 1_000 }
}

impl Known {
    /// One partition with budgets of its own.
    fn alone(capacity: usize) -> Self {
        Known::new(Budget::new(capacity), Budget::new(capacity))
    }
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
    Slot { record: Some(Record { absent, ..Default::default() }), generation, ..Default::default() }
}

/// A message as storage reads it off the wire.
fn batch(cmds: Vec<Command>) -> Scanned {
    let bytes = CommandBatch { commands: cmds, ..Default::default() }.encode_to_vec();
    Scanned::read(bytes.into()).expect("reads")
}

impl Known {
    fn split_ok(&mut self, messages: &[&Scanned]) -> Vec<Split> {
        self.split(messages).expect("decodes")
    }
}

/// What a split carried, as (place, generation, ids).
fn carried(split: &Split) -> Vec<(i64, i64, Vec<String>)> {
    let ids = |blob: &[u8]| {
        let mut v: Vec<String> =
            crate::apply::touched_set::decode(blob).expect("a set").into_iter().collect();
        v.sort();
        v
    };
    split.carried.iter().map(|(p, g, blob)| (p.place_id, g, ids(blob))).collect()
}

/// Each part of a key and of a command counts, including where one
/// part ends and the next begins.
#[test]
fn hashes_tell_their_parts_apart() {
    assert_ne!(key_hash(7, 1, "ab"), key_hash(7, 1, "ba"));
    assert_ne!(key_hash(7, 1, "a"), key_hash(1, 7, "a"));
    assert_ne!(key_hash(7, 1, "a"), key_hash(7, 2, "a"));
    let long = "x".repeat(3000);
    assert_eq!(key_hash(7, 1, &long), key_hash(7, 1, &long.clone()));
    let h = |data: &[u8], state: &[u8], cd: &[u32], cs: &[u32]| content_hash(data, state, cd, cs);
    let base = h(b"ab", b"", &[], &[]);
    for other in [
        h(b"a", b"b", &[], &[]),
        h(b"", b"ab", &[], &[]),
        h(b"ab", b"", &[1], &[]),
        h(b"ab", b"", &[], &[1]),
        h(b"ab", b"", &[1, 2], &[]),
        h(b"ab", b"", &[1], &[2]),
    ] {
        assert_ne!(base, other);
    }
    assert_ne!(h(b"ab", b"", &[1], &[2]), h(b"ab", b"", &[1, 2], &[]));
    assert_ne!(h(b"ab", b"", &[1], &[2]), h(b"ab", b"", &[2], &[1]));
    assert_eq!(base, h(b"ab", b"", &[], &[]));
}

#[test]
fn only_an_observed_no_op_is_vouched_for() {
    let mut known = Known::alone(10);
    let a = patch("a", b"x", 5);
    let b = batch(vec![a.clone()]);
    assert_eq!(known.split_ok(&[&b])[0].skipped, 0, "nothing known yet");
    known.committed(&Slots::from_iter([(key("a"), clean(false, 5))]), [&a], &[]);
    let split = &known.split_ok(&[&b])[0];
    assert_eq!(split.skipped, 1);
    assert!(split.rest.commands.is_empty());
    let next = batch(vec![patch("a", b"x", 6)]);
    let split = &known.split_ok(&[&next])[0];
    assert_eq!(carried(split), [(1, 6, vec!["a".to_string()])], "a full import's is carried");
    let delta = batch(vec![patch("a", b"x", 0)]);
    let split = &known.split_ok(&[&delta])[0];
    assert_eq!((split.skipped, carried(split)), (1, vec![]), "a delta carries nothing");
    let other = batch(vec![patch("a", b"y", 6)]);
    let split = &known.split_ok(&[&other])[0];
    assert_eq!(split.skipped, 0, "another patch is loaded");
    assert_eq!(split.rest.commands, vec![patch("a", b"y", 6)]);
    let both = batch(vec![patch("a", b"x", 6), patch("b", b"x", 6)]);
    let split = &known.split_ok(&[&both])[0];
    assert_eq!((split.skipped, split.rest.commands.len()), (1, 1));
    assert_eq!(split.rest.commands[0].key.as_ref().map(|k| k.product_id.as_str()), Some("b"));
}

#[test]
fn a_skipped_command_with_its_own_origin_keeps_when_it_was_published() {
    let mut known = Known::alone(10);
    let a = patch("a", b"x", 0);
    known.committed(&Slots::from_iter([(key("a"), clean(false, 0))]), [&a], &[]);
    let mut own = a.clone();
    own.origin = Some(shelfsync_proto::Origin { published_at: 77, ..Default::default() });
    let split = &known.split_ok(&[&batch(vec![own, a])])[0];
    assert_eq!((split.skipped, &split.skipped_published[..]), (2, &[77][..]));
}

/// The hash of a command read off the wire is the decoded command's,
/// so that what is learned from one vouches for the other.
#[test]
fn a_command_read_off_the_wire_hashes_as_decoded() {
    let mut cmds = vec![patch("a", b"x", 0), patch("b", &vec![3u8; 2000], 4)];
    let mut c = patch("c", b"", 0);
    c.state = vec![8, 1];
    c.clear_data_fields = vec![3, 7];
    cmds.push(c);
    let mut cas = patch("d", b"x", 0);
    cas.expected_updated_at = Some(1);
    cmds.push(cas);
    let mut save = patch("e", b"x", 0);
    save.kind = CommandKind::Save as i32;
    cmds.push(save);
    let read = batch(cmds.clone());
    for (view, cmd) in read.views().expect("walked").zip(&cmds) {
        assert_eq!(view_hash(&view), command_hash(cmd));
        let (place, id) = view.key().expect("a key");
        assert_eq!(Some(key_hash(place.brand_id, place.place_id, id)), command_key(cmd));
    }
}

#[test]
fn a_written_record_is_forgotten() {
    let mut known = Known::alone(10);
    let a = patch("a", b"x", 5);
    known.committed(&Slots::from_iter([(key("a"), clean(false, 5))]), [&a], &[]);
    let mut dirty = clean(false, 5);
    dirty.record_dirty = true;
    known.forget_written(&Slots::from_iter([(key("a"), dirty)]));
    assert!(known.entries.is_empty());
}

#[test]
fn a_key_with_any_unknown_command_goes_through_redis_whole() {
    let mut known = Known::alone(10);
    let a = patch("a", b"x", 0);
    known.committed(&Slots::from_iter([(key("a"), clean(false, 0))]), [&a], &[]);
    let first = batch(vec![a.clone()]);
    let second = batch(vec![patch("a", b"y", 0)]);
    let split = known.split_ok(&[&first, &second]);
    assert!(split.iter().all(|s| s.skipped == 0));
    assert_eq!(split[0].rest.commands.len() + split[1].rest.commands.len(), 2);
}

#[test]
fn an_absent_record_is_not_vouched_for_a_full_import() {
    let mut known = Known::alone(10);
    let delta = patch("a", b"x", 0);
    known.committed(&Slots::from_iter([(key("a"), clean(true, 3))]), [&delta], &[]);
    assert_eq!(known.split_ok(&[&batch(vec![delta.clone()])])[0].skipped, 1);
    let full = batch(vec![patch("a", b"x", 9)]);
    assert_eq!(known.split_ok(&[&full])[0].skipped, 0, "bringing it back is a change");
}

#[test]
fn cas_saves_deletes_and_rejected_keys_are_never_learned() {
    let mut known = Known::alone(10);
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
    known.committed(&slots, [&cas, &save, &c], &[key("c")]);
    assert!(known.entries.is_empty());
}

#[test]
fn it_stops_growing_at_its_capacity() {
    let mut known = Known::alone(1);
    let (a, b) = (patch("a", b"x", 0), patch("b", b"x", 0));
    let slots = Slots::from_iter([(key("a"), clean(false, 0)), (key("b"), clean(false, 0))]);
    known.committed(&slots, [&a, &b], &[]);
    assert_eq!(known.entries.len(), 1);
}

#[test]
fn partitions_of_a_replica_share_one_bound() {
    let (entries, live) = (Budget::new(3), Budget::new(3));
    let mut p1 = Known::new(entries.clone(), live.clone());
    let mut p2 = Known::new(entries.clone(), live.clone());
    let cmds: Vec<Command> = ["a", "b"].iter().map(|id| patch(id, b"x", 0)).collect();
    let slots = Slots::from_iter([(key("a"), clean(false, 0)), (key("b"), clean(false, 0))]);
    p1.committed(&slots, &cmds, &[]);
    p2.committed(&slots, &cmds, &[]);
    assert_eq!((p1.entries.len(), p2.entries.len(), entries.used()), (2, 1, 3));
    p1.clear();
    assert_eq!(entries.used(), 1, "what a partition forgets is given back");
    p1.committed(&slots, &cmds, &[]);
    assert_eq!(entries.used(), 3);
    drop(p2);
    assert_eq!(entries.used(), 2, "and what a dropped one kept");
}

#[test]
fn a_record_written_is_vouched_for_when_its_command_would_leave_it_as_written() {
    let mut known = Known::alone(10);
    let written = |cmds: Vec<Command>| {
        let mut slots = Slots::default();
        let out = apply_batch(
            &batch(cmds).decode_all().expect("decodes"),
            &mut slots,
            &Default::default(),
            &limits(),
        );
        assert!(out.rejections.is_empty(), "{:?}", out.rejections);
        slots
    };
    let a = price("a", 5, 1);
    let slots = written(vec![a.clone()]);
    assert!(slots[&key("a")].record_dirty);
    known.forget_written(&slots);
    known.committed(&slots, [&a], &[]);
    let next = batch(vec![price("a", 5, 2)]);
    let split = &known.split_ok(&[&next])[0];
    assert_eq!(split.skipped, 1, "the next import's same command is vouched for");
    assert_eq!(known.split_ok(&[&batch(vec![price("a", 6, 2)])])[0].skipped, 0);

    // Two commands on the record in one commit: nothing is learned.
    let (b1, b2) = (price("b", 5, 1), price("b", 6, 1));
    let slots = written(vec![b1.clone(), b2.clone()]);
    known.forget_written(&slots);
    known.committed(&slots, [&b1, &b2], &[]);
    assert_eq!(known.split_ok(&[&batch(vec![price("b", 6, 2)])])[0].skipped, 0);
}

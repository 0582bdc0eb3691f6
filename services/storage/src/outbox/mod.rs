//! What goes into the outbox: the changes and rejections of one commit as
//! `OutboxEntry`s — per place, in order, at most 1000 per message and under
//! the payload limit, with message ids that are the same on every replay —
//! and how an entry that cannot be published as it is gets split or reduced.
//! This module is pure (no I/O); [`relay`] publishes what a commit left in
//! the outbox, exactly once.

pub(crate) mod relay;

pub(crate) use relay::{Relay, RelayError};

use std::collections::BTreeMap;

use prost::Message;
use shelfsync_bus::{Partition, Subjects};
use shelfsync_proto::{
    Change, ChangeBatch, Command, OutboxEntry, PlaceKey, RecordKey, Rejection, RejectionBatch,
    msg_type,
};

/// Raw bytes a reduced rejection keeps of its input.
const REDUCED_RAW: usize = 1024;
/// Detail a reduced rejection keeps.
const REDUCED_DETAIL: usize = 1024;

/// W3C trace context and baggage kept with outbox entries.
pub(crate) type TraceParts = shelfsync_telemetry::Parts;

/// Where the entries of one commit go and how they are named.
pub(crate) struct Outbox<'a> {
    pub(crate) partition: Partition,
    pub(crate) subjects: &'a Subjects,
    /// Largest payload to publish (server max payload minus headroom).
    pub(crate) max_bytes: usize,
    /// Sequences of the CHANGES and REJECTS streams at or below where the
    /// entries will land (see `OutboxEntry.stream_floor`).
    pub(crate) floors: (u64, u64),
    pub(crate) trace: &'a TraceParts,
    /// Names the command stream the sequences count in ([`epoch_of`]): the
    /// same sequence in a stream created again makes other ids, so that
    /// JetStream's dedup never takes a real change for a copy.
    pub(crate) epoch: String,
}

/// A short name of a command stream's identity, in the ids of the outbox
/// entries whose sequences count in it: `chg:<partition>:<epoch>:<id>:<part>`.
pub(crate) fn epoch_of(stream_identity: &str) -> String {
    format!("{:08x}", xxhash_rust::xxh3::xxh3_64(stream_identity.as_bytes()) as u32)
}

impl Outbox<'_> {
    /// The entries of `changes` and `rejections` of command message(s)
    /// `seq`. `id` names them (`chg:<partition>:<id>:<part>`, `rej:…`), the
    /// same on every replay; parts are numbered from `first_part`, and the
    /// next free part is returned with the entries.
    pub(crate) fn entries(
        &self,
        seq: u64,
        id: &str,
        first_part: u32,
        changes: Vec<Change>,
        rejections: Vec<Rejection>,
    ) -> (Vec<OutboxEntry>, u32) {
        let mut out = Vec::new();
        let mut part = first_part;
        let fit = |c| fit_change(c, self.max_bytes);
        for (place, list) in by_place(changes, |c: &Change| c.key.as_ref(), fit) {
            for chunk in split_by_size(list, self.max_bytes) {
                let batch = ChangeBatch {
                    changes: chunk,
                    partition: self.partition.0,
                    command_seq: seq,
                    part,
                    ..Default::default()
                };
                out.push(self.entry(
                    self.subjects.changes(place.brand_id, place.place_id),
                    format!("chg:{}:{}:{id}:{part}", self.partition, self.epoch),
                    batch.encode_to_vec(),
                    msg_type::CHANGE_BATCH,
                    self.floors.0,
                ));
                part += 1;
            }
        }
        let fit = |r| fit_rejection(r, self.max_bytes);
        for (place, list) in by_place(rejections, |r: &Rejection| r.key.as_ref(), fit) {
            for chunk in split_by_size(list, self.max_bytes) {
                out.push(self.entry(
                    self.subjects.rejects(place.brand_id, place.place_id),
                    format!("rej:{}:{}:{id}:{part}", self.partition, self.epoch),
                    RejectionBatch { rejections: chunk }.encode_to_vec(),
                    msg_type::REJECTION_BATCH,
                    self.floors.1,
                ));
                part += 1;
            }
        }
        (out, part)
    }

    fn entry(
        &self,
        subject: String,
        msg_id: String,
        payload: Vec<u8>,
        kind: &str,
        floor: u64,
    ) -> OutboxEntry {
        OutboxEntry {
            subject,
            msg_id,
            payload: payload.into(),
            msg_type: kind.into(),
            traceparent: self.trace.traceparent.clone(),
            tracestate: self.trace.tracestate.clone(),
            baggage: self.trace.baggage.clone(),
            stream_floor: floor,
        }
    }
}

/// `items` per place (keyless ones under place 0:0), in order within a place,
/// each made to fit by `fit`, with its encoded length.
fn by_place<T: Message>(
    items: Vec<T>,
    key: impl Fn(&T) -> Option<&RecordKey>,
    fit: impl Fn(T) -> (T, usize),
) -> BTreeMap<PlaceKey, Vec<(T, usize)>> {
    let mut out: BTreeMap<PlaceKey, Vec<(T, usize)>> = BTreeMap::new();
    for item in items {
        let place = key(&item).map_or(PlaceKey::new(0, 0), RecordKey::place);
        out.entry(place).or_default().push(fit(item));
    }
    out
}

/// A change too large for one message loses its `before` data and state
/// (flagged `before_omitted`); the `after` is what consumers apply. With
/// the change's encoded length.
fn fit_change(c: Change, max_bytes: usize) -> (Change, usize) {
    fit(c, max_bytes, reduce_change)
}

/// `m` with its encoded length; reduced by `reduce` first when it does not
/// fit in one message of `max_bytes` (with room for the envelope).
fn fit<M: Message>(m: M, max_bytes: usize, reduce: impl FnOnce(M) -> M) -> (M, usize) {
    let len = m.encoded_len();
    if len + 64 <= max_bytes {
        return (m, len);
    }
    let m = reduce(m);
    let len = m.encoded_len();
    (m, len)
}

fn reduce_change(mut c: Change) -> Change {
    if let Some(b) = c.before.as_mut() {
        b.data.clear();
        b.state.clear();
        c.before_omitted = true;
    }
    c
}

/// A rejection too large for one message keeps the command's key, kind and
/// origin but not its data and state, and at most 1 KiB of raw input and
/// of detail (a rejection is a report, not a copy of the input).
fn fit_rejection(r: Rejection, max_bytes: usize) -> (Rejection, usize) {
    fit(r, max_bytes, reduce_rejection)
}

fn reduce_rejection(mut r: Rejection) -> Rejection {
    let dropped = r.command.as_ref().map_or(0, |c| c.data.len() + c.state.len()) + r.raw.len();
    if let Some(c) = r.command.as_mut() {
        *c = Command {
            key: c.key.take(),
            kind: c.kind,
            expected_updated_at: c.expected_updated_at,
            generation: c.generation,
            origin: c.origin.take(),
            ..Default::default()
        };
    }
    r.raw.truncate(REDUCED_RAW);
    if r.detail.len() > REDUCED_DETAIL {
        let mut end = REDUCED_DETAIL;
        while !r.detail.is_char_boundary(end) {
            end -= 1;
        }
        r.detail.truncate(end);
    }
    r.detail.push_str(&format!(" [reduced to fit one message: {dropped} bytes of input left out]"));
    r
}

/// What to publish instead of an entry that was refused as too large:
/// its items in two halves, or — a single item — the item reduced. `None`:
/// nothing smaller can be made (the entry cannot be published).
pub(crate) fn smaller(entry: &OutboxEntry) -> Option<Vec<OutboxEntry>> {
    let piece = |suffix: usize, payload: Vec<u8>| OutboxEntry {
        msg_id: format!("{}/{suffix}", entry.msg_id),
        payload: payload.into(),
        ..entry.clone()
    };
    match entry.msg_type.as_str() {
        msg_type::CHANGE_BATCH => {
            let batch = ChangeBatch::decode(&entry.payload[..]).ok()?;
            match batch.changes.len() {
                0 => None,
                1 => {
                    let c = batch.changes[0].clone();
                    if c.before_omitted || c.before.is_none() {
                        return None;
                    }
                    let one = ChangeBatch { changes: vec![reduce_change(c)], ..batch };
                    Some(vec![piece(0, one.encode_to_vec())])
                }
                n => {
                    let (a, b) = batch.changes.split_at(n / 2);
                    let half = |changes: &[Change]| {
                        ChangeBatch { changes: changes.to_vec(), ..batch.clone() }.encode_to_vec()
                    };
                    Some(vec![piece(0, half(a)), piece(1, half(b))])
                }
            }
        }
        msg_type::REJECTION_BATCH => {
            let batch = RejectionBatch::decode(&entry.payload[..]).ok()?;
            match batch.rejections.len() {
                0 => None,
                1 => {
                    let r = batch.rejections[0].clone();
                    let reduced = reduce_rejection(r.clone());
                    if reduced.encoded_len() >= r.encoded_len() {
                        return None;
                    }
                    let one = RejectionBatch { rejections: vec![reduced] };
                    Some(vec![piece(0, one.encode_to_vec())])
                }
                n => {
                    let (a, b) = batch.rejections.split_at(n / 2);
                    let half =
                        |r: &[Rejection]| RejectionBatch { rejections: r.to_vec() }.encode_to_vec();
                    Some(vec![piece(0, half(a)), piece(1, half(b))])
                }
            }
        }
        _ => None,
    }
}

/// Splits items into runs of at most 1000 whose encoded size stays under
/// `max_bytes` (an item larger than that goes alone).
pub(crate) fn split_by_size<T: Message>(items: Vec<(T, usize)>, max_bytes: usize) -> Vec<Vec<T>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut size = 16;
    for (item, len) in items {
        let len = len + 6;
        if !cur.is_empty() && (size + len > max_bytes || cur.len() >= 1000) {
            out.push(std::mem::take(&mut cur));
            size = 16;
        }
        size += len;
        cur.push(item);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use shelfsync_proto::{Record, RecordKey};

    use super::*;

    fn change(id: &str, bytes: usize) -> Change {
        let r = |n| Record { data: vec![7; n], ..Default::default() };
        Change {
            key: Some(RecordKey::new(7, 42, id)),
            before: Some(r(bytes)),
            after: Some(r(bytes)),
            ..Default::default()
        }
    }

    /// An outbox of `partition` with the stream floors `floors`, for
    /// payloads up to `max_bytes`.
    fn outbox<'a>(
        subjects: &'a Subjects,
        trace: &'a TraceParts,
        partition: u32,
        max_bytes: usize,
        floors: (u64, u64),
    ) -> Outbox<'a> {
        let epoch = epoch_of("T_CMD@1");
        Outbox { partition: Partition(partition), subjects, max_bytes, floors, trace, epoch }
    }

    fn plain() -> (Subjects, TraceParts) {
        (Subjects::new("t"), TraceParts::default())
    }

    #[test]
    fn ids_are_the_same_on_every_replay_and_parts_continue() {
        let ((subjects, trace), max) = (plain(), 64 * 1024);
        let o = outbox(&subjects, &trace, 3, max, (10, 20));
        let (a, next) = o.entries(120, "120", 4, vec![change("a", 10)], vec![]);
        let (b, _) = o.entries(120, "120", 4, vec![change("a", 10)], vec![]);
        assert_eq!(a, b);
        assert_eq!(a[0].msg_id, format!("chg:3:{}:120:4", epoch_of("T_CMD@1")));
        assert_eq!((a[0].stream_floor, next), (10, 5));
        // The same sequence in a command stream created again: other ids.
        let again = Outbox { epoch: epoch_of("T_CMD@2"), ..o };
        let (c, _) = again.entries(120, "120", 4, vec![change("a", 10)], vec![]);
        assert_ne!(a[0].msg_id, c[0].msg_id);
        assert!(c[0].msg_id.starts_with("chg:3:") && c[0].msg_id.ends_with(":120:4"));
    }

    #[test]
    fn a_change_over_the_limit_goes_out_without_its_before_data() {
        let ((subjects, trace), max) = (plain(), 64 * 1024);
        let o = outbox(&subjects, &trace, 0, max, (0, 0));
        let (e, _) = o.entries(1, "1", 0, vec![change("big", 40 * 1024)], vec![]);
        let batch = ChangeBatch::decode(&e[0].payload[..]).expect("a change batch");
        assert!(batch.changes[0].before_omitted);
        assert!(batch.changes[0].before.as_ref().expect("before kept").data.is_empty());
        assert_eq!(batch.changes[0].after.as_ref().expect("after").data.len(), 40 * 1024);
        assert!(e[0].payload.len() < max);
    }

    #[test]
    fn a_rejection_of_a_huge_command_is_reduced_to_fit() {
        let ((subjects, trace), max) = (plain(), 64 * 1024);
        let o = outbox(&subjects, &trace, 0, max, (0, 0));
        let r = Rejection {
            command: Some(Command {
                key: Some(RecordKey::new(7, 1, "x")),
                data: vec![1; 200_000],
                ..Default::default()
            }),
            reason: "too_large".into(),
            raw: vec![2; 100_000],
            key: Some(RecordKey::new(7, 1, "x")),
            ..Default::default()
        };
        let (e, _) = o.entries(1, "1", 0, vec![], vec![r]);
        assert_eq!(e.len(), 1);
        assert!(e[0].payload.len() < 4096, "{}", e[0].payload.len());
        let batch = RejectionBatch::decode(&e[0].payload[..]).expect("rejections");
        let r = &batch.rejections[0];
        assert_eq!(r.reason, "too_large");
        assert_eq!(r.command.as_ref().and_then(|c| c.key.clone()), Some(RecordKey::new(7, 1, "x")));
        assert!(r.detail.contains("reduced"));
    }

    #[test]
    fn a_refused_entry_is_halved_then_reduced_then_given_up() {
        let ((subjects, trace), max) = (plain(), 1 << 20);
        let o = outbox(&subjects, &trace, 0, max, (0, 0));
        let (e, _) = o.entries(1, "1", 0, vec![change("a", 1000), change("b", 1000)], vec![]);
        let halves = smaller(&e[0]).expect("two halves");
        assert_eq!(halves.len(), 2);
        assert_eq!(halves[1].msg_id, format!("{}/1", e[0].msg_id));
        let reduced = smaller(&halves[0]).expect("reduced");
        let one = ChangeBatch::decode(&reduced[0].payload[..]).expect("batch");
        assert!(one.changes[0].before_omitted);
        assert!(smaller(&reduced[0]).is_none(), "nothing smaller is left");
    }

    /// `OutboxEntry` as the previous version wrote it: no `baggage`.
    #[derive(Clone, PartialEq, prost::Message)]
    struct PreviousOutboxEntry {
        #[prost(string, tag = "1")]
        subject: String,
        #[prost(string, tag = "2")]
        msg_id: String,
        #[prost(bytes = "vec", tag = "3")]
        payload: Vec<u8>,
        #[prost(string, tag = "4")]
        msg_type: String,
        #[prost(string, tag = "5")]
        traceparent: String,
        #[prost(string, tag = "6")]
        tracestate: String,
        #[prost(uint64, tag = "7")]
        stream_floor: u64,
    }

    #[test]
    fn entries_keep_the_baggage_and_old_entries_still_decode() {
        let subjects = Subjects::new("t");
        let trace = TraceParts {
            traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
            tracestate: String::new(),
            baggage: "tenant=acme".into(),
        };
        let o = outbox(&subjects, &trace, 0, 1 << 20, (3, 4));
        let (e, _) = o.entries(1, "1", 0, vec![change("a", 10)], vec![]);
        assert_eq!(
            (e[0].traceparent.as_str(), e[0].baggage.as_str()),
            (trace.traceparent.as_str(), "tenant=acme")
        );
        // Pieces of a refused entry keep it too.
        let (two, _) = o.entries(1, "1", 0, vec![change("a", 10), change("b", 10)], vec![]);
        assert!(smaller(&two[0]).expect("halves").iter().all(|p| p.baggage == "tenant=acme"));

        // Written by the previous version: decodes, without baggage.
        let previous = PreviousOutboxEntry {
            subject: e[0].subject.clone(),
            msg_id: e[0].msg_id.clone(),
            payload: e[0].payload.to_vec(),
            msg_type: e[0].msg_type.clone(),
            traceparent: e[0].traceparent.clone(),
            tracestate: String::new(),
            stream_floor: 3,
        };
        let read = OutboxEntry::decode(previous.encode_to_vec().as_slice()).expect("an old entry");
        assert_eq!(read, OutboxEntry { baggage: String::new(), ..e[0].clone() });
        // And the previous version reads a new entry, the baggage left out.
        let back =
            PreviousOutboxEntry::decode(e[0].encode_to_vec().as_slice()).expect("a new entry");
        assert_eq!(back, previous);
    }
}

//! A command message read without building its commands: the plain
//! protobuf of a `CommandBatch` is walked once, its header (partition,
//! sweeps, origin) decoded, and each command located, with the parts
//! [`super::Known`] hashes to vouch for it. Only the commands that go
//! through Redis are decoded, each from its own bytes; at a re-import that
//! is about one in a hundred, and the other 99 cost a walk and two hashes
//! instead of a decode into owned strings and buffers and their drop.
//!
//! The walk accepts only what it reads exactly as prost would (wire types,
//! lengths, UTF-8 of the product id, no field merged from two occurrences).
//! Anything else — a malformed message, a command with two keys, groups —
//! is decoded by prost as a whole instead ([`Scanned::read`]), which either
//! gives the same message with every command decoded up front, or the
//! decode error the message is dead-lettered for.

use std::ops::Range;

use bytes::Bytes;
use prost::Message;
use shelfsync_proto::{Command, CommandBatch, CommandKind, Origin, PlaceKey, Sweep};

use super::wire::{LEN, VARINT, Wire};

/// A command message, read.
#[derive(Debug, Clone)]
pub(crate) struct Scanned {
    /// Partition, sweeps and origin; no commands.
    pub(crate) header: CommandBatch,
    commands: Commands,
}

#[derive(Debug, Clone)]
enum Commands {
    /// Located in the message's bytes, decoded on demand.
    Located { bytes: Bytes, at: Vec<At> },
    /// Decoded by prost with the message (it did not walk exactly).
    Decoded(Vec<Command>),
}

/// Where one command is in its message, and what a vouch needs of it.
#[derive(Debug, Clone)]
pub(crate) struct At {
    /// The `Command` message.
    range: Range<usize>,
    key: Option<KeyAt>,
    /// A PATCH without compare-and-swap: the only kind ever vouched for.
    plain_patch: bool,
    data: Range<usize>,
    state: Range<usize>,
    /// The fields cleared (data, state), when any is.
    clears: Option<Box<(Vec<u32>, Vec<u32>)>>,
    generation: i64,
    /// When the command's own origin says it was published (it has none:
    /// its batch's).
    published_at: Option<i64>,
}

#[derive(Debug, Clone)]
struct KeyAt {
    place: PlaceKey,
    id: Range<usize>,
}

/// One command of a [`Scanned`] message, as [`super::Known`] looks at it.
pub(crate) struct CommandView<'a> {
    pub(crate) at: &'a At,
    bytes: &'a [u8],
}

impl CommandView<'_> {
    /// Brand and place, and the product id (`None`: the command has no key).
    pub(crate) fn key(&self) -> Option<(PlaceKey, &str)> {
        let k = self.at.key.as_ref()?;
        // Checked to be UTF-8 by the walk.
        let id = std::str::from_utf8(&self.bytes[k.id.clone()]).ok()?;
        Some((k.place, id))
    }

    pub(crate) fn plain_patch(&self) -> bool {
        self.at.plain_patch
    }

    pub(crate) fn data(&self) -> &[u8] {
        &self.bytes[self.at.data.clone()]
    }

    pub(crate) fn state(&self) -> &[u8] {
        &self.bytes[self.at.state.clone()]
    }

    pub(crate) fn clears(&self) -> (&[u32], &[u32]) {
        self.at.clears.as_deref().map_or((&[], &[]), |(d, s)| (&d[..], &s[..]))
    }

    pub(crate) fn generation(&self) -> i64 {
        self.at.generation
    }

    pub(crate) fn published_at(&self) -> Option<i64> {
        self.at.published_at
    }
}

/// Why a command message is not read.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ReadError {
    #[error(transparent)]
    Decode(#[from] prost::DecodeError),
    /// Over the contract (at most [`MAX_ITEMS`] commands, and as many
    /// sweeps, per message): refused before anything is allocated for them.
    #[error(
        "the message holds {commands} commands and {sweeps} sweeps, more than the {MAX_ITEMS} of each a message may carry"
    )]
    TooMany { commands: usize, sweeps: usize },
}

/// Commands (and sweeps) one command message may carry: the contract's
/// batch size, and what one commit is sized for.
pub(crate) const MAX_ITEMS: usize = 1000;

impl Scanned {
    /// Reads a message's plain protobuf: walked when it walks exactly,
    /// decoded whole by prost otherwise (the error is prost's). Its
    /// commands and sweeps are counted first, without allocating, and a
    /// message with more than [`MAX_ITEMS`] of either is refused.
    pub(crate) fn read(bytes: Bytes) -> Result<Scanned, ReadError> {
        match count(&bytes) {
            Some((commands, sweeps)) if commands > MAX_ITEMS || sweeps > MAX_ITEMS => {
                return Err(ReadError::TooMany { commands, sweeps });
            }
            Some(_) => {}
            // Not protobuf the count can skip, so not what prost reads
            // either: its decode says why (had it read it, it is counted).
            None => {
                let batch = CommandBatch::decode(bytes)?;
                let (commands, sweeps) = (batch.commands.len(), batch.sweeps.len());
                if commands > MAX_ITEMS || sweeps > MAX_ITEMS {
                    return Err(ReadError::TooMany { commands, sweeps });
                }
                return Ok(Self::from_batch(batch));
            }
        }
        match walk(&bytes) {
            Some((header, at)) => Ok(Scanned { header, commands: Commands::Located { bytes, at } }),
            None => Ok(Self::from_batch(CommandBatch::decode(bytes)?)),
        }
    }

    /// A message already decoded (tests, and what did not walk).
    pub(crate) fn from_batch(mut batch: CommandBatch) -> Scanned {
        let commands = Commands::Decoded(std::mem::take(&mut batch.commands));
        Scanned { header: batch, commands }
    }

    pub(crate) fn len(&self) -> usize {
        match &self.commands {
            Commands::Located { at, .. } => at.len(),
            Commands::Decoded(c) => c.len(),
        }
    }

    /// The located commands, in order (`None`: decoded up front, so
    /// nothing is vouched for in this message).
    pub(crate) fn views(&self) -> Option<impl Iterator<Item = CommandView<'_>>> {
        match &self.commands {
            Commands::Located { bytes, at } => {
                Some(at.iter().map(move |at| CommandView { at, bytes: &bytes[..] }))
            }
            Commands::Decoded(_) => None,
        }
    }

    /// The whole message, every command decoded.
    pub(crate) fn decode_all(&self) -> Result<CommandBatch, prost::DecodeError> {
        self.decode_some(|_| true)
    }

    /// The message with the commands `keep` says yes to (by index), decoded.
    pub(crate) fn decode_some(
        &self,
        mut keep: impl FnMut(usize) -> bool,
    ) -> Result<CommandBatch, prost::DecodeError> {
        let commands = match &self.commands {
            Commands::Located { bytes, at } => {
                let mut out = Vec::with_capacity(at.len());
                for (i, a) in at.iter().enumerate() {
                    if keep(i) {
                        out.push(Command::decode(bytes.slice(a.range.clone()))?);
                    }
                }
                out
            }
            Commands::Decoded(c) => {
                c.iter().enumerate().filter(|(i, _)| keep(*i)).map(|(_, c)| c.clone()).collect()
            }
        };
        Ok(CommandBatch { commands, ..self.header.clone() })
    }
}

/// The commands and sweeps of a `CommandBatch`, counted on its top-level
/// fields, each skipped by its length: nothing decoded, nothing allocated
/// (`None`: not protobuf).
fn count(buf: &[u8]) -> Option<(usize, usize)> {
    let mut w = Wire::new(buf, 0);
    let (mut commands, mut sweeps) = (0, 0);
    while !w.done() {
        let (number, wire) = w.key()?;
        match (number, wire) {
            (2, LEN) => commands += 1,
            (3, LEN) => sweeps += 1,
            _ => {}
        }
        w.skip_any(number, wire, 0)?;
    }
    Some((commands, sweeps))
}

/// Walks a `CommandBatch`: its header decoded, its commands located.
fn walk(buf: &[u8]) -> Option<(CommandBatch, Vec<At>)> {
    let mut w = Wire::new(buf, 0);
    let mut header = CommandBatch::default();
    // A command of the bench's feeds is about 200 bytes: room for all of
    // them without growing, and not much more.
    let mut at = Vec::with_capacity((buf.len() / 128).clamp(1, 1024));
    let mut origin_seen = false;
    while !w.done() {
        match w.key()? {
            (1, VARINT) => header.partition = w.varint()? as u32,
            (2, LEN) => {
                let range = w.len()?;
                at.push(command(buf, range)?);
            }
            (3, LEN) => header.sweeps.push(Sweep::decode(&buf[w.len()?]).ok()?),
            (4, LEN) if !origin_seen => {
                origin_seen = true;
                header.origin = Some(Origin::decode(&buf[w.len()?]).ok()?);
            }
            (1..=4, _) => return None,
            (_, wire) => w.skip(wire)?,
        }
    }
    Some((header, at))
}

/// Locates one `Command` (the bytes `range` of `buf`).
fn command(buf: &[u8], range: Range<usize>) -> Option<At> {
    let mut w = Wire::new(&buf[..range.end], range.start);
    let mut a = At {
        range: range.clone(),
        key: None,
        plain_patch: false,
        data: range.start..range.start,
        state: range.start..range.start,
        clears: None,
        generation: 0,
        published_at: None,
    };
    let (mut kind, mut cas, mut origin_seen) = (0i32, false, false);
    while !w.done() {
        match w.key()? {
            (1, LEN) if a.key.is_none() => a.key = Some(record_key(buf, w.len()?)?),
            (2, VARINT) => kind = w.varint()? as i32,
            (3, LEN) => a.data = w.len()?,
            (4, LEN) => a.state = w.len()?,
            (5, wire) => w.uint32s(wire, &mut a.clears.get_or_insert_default().0)?,
            (6, wire) => w.uint32s(wire, &mut a.clears.get_or_insert_default().1)?,
            (7, VARINT) => {
                w.varint()?;
                cas = true;
            }
            (8, VARINT) => a.generation = w.varint()? as i64,
            (9, LEN) if !origin_seen => {
                origin_seen = true;
                a.published_at = Some(Origin::decode(&buf[w.len()?]).ok()?.published_at);
            }
            (1..=9, _) => return None,
            (_, wire) => w.skip(wire)?,
        }
    }
    a.plain_patch = kind == CommandKind::Patch as i32 && !cas;
    Some(a)
}

/// Locates a `RecordKey`: brand and place read, the product id checked to be
/// UTF-8 (prost refuses a string that is not).
fn record_key(buf: &[u8], range: Range<usize>) -> Option<KeyAt> {
    let mut w = Wire::new(&buf[..range.end], range.start);
    let (mut brand, mut place, mut id) = (0i64, 0i64, range.start..range.start);
    while !w.done() {
        match w.key()? {
            (1, VARINT) => brand = w.varint()? as i64,
            (2, VARINT) => place = w.varint()? as i64,
            (3, LEN) => {
                id = w.len()?;
                std::str::from_utf8(&buf[id.clone()]).ok()?;
            }
            (1..=3, _) => return None,
            (_, wire) => w.skip(wire)?,
        }
    }
    Some(KeyAt { place: PlaceKey::new(brand, place), id })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use shelfsync_proto::RecordKey;

    fn command(id: &str, data: &[u8], generation: i64) -> Command {
        Command {
            key: Some(RecordKey { brand_id: 7, place_id: -3, product_id: id.into() }),
            kind: CommandKind::Patch as i32,
            data: data.to_vec(),
            generation,
            ..Default::default()
        }
    }

    /// What a walk saw, as the decoded command says it.
    fn agrees(view: &CommandView<'_>, cmd: &Command) {
        let key = cmd.key.as_ref().map(|k| (k.place(), k.product_id.as_str()));
        assert_eq!(view.key(), key);
        let plain = cmd.kind == CommandKind::Patch as i32 && cmd.expected_updated_at.is_none();
        assert_eq!(view.plain_patch(), plain);
        assert_eq!(view.data(), &cmd.data[..]);
        assert_eq!(view.state(), &cmd.state[..]);
        assert_eq!(view.clears(), (&cmd.clear_data_fields[..], &cmd.clear_state_fields[..]));
        assert_eq!(view.generation(), cmd.generation);
        assert_eq!(view.published_at(), cmd.origin.as_ref().map(|o| o.published_at));
    }

    fn check(bytes: &[u8]) {
        let decoded = CommandBatch::decode(bytes);
        let read = Scanned::read(Bytes::copy_from_slice(bytes));
        match (&decoded, &read) {
            (Ok(batch), Ok(scanned)) => {
                assert_eq!(&scanned.decode_all().expect("decodes"), batch);
                assert_eq!(scanned.len(), batch.commands.len());
                if let Some(views) = scanned.views() {
                    for (view, cmd) in views.zip(&batch.commands) {
                        agrees(&view, cmd);
                    }
                }
            }
            (Err(e), Err(f)) => assert_eq!(e.to_string(), f.to_string()),
            _ => panic!("prost says {decoded:?}, the walk {read:?}"),
        }
    }

    #[test]
    fn a_plain_message_is_walked_and_reads_as_decoded() {
        let mut cas = command("b", b"\x18\x05", 0);
        cas.expected_updated_at = Some(42);
        let mut full = command("c", b"", 9);
        full.state = vec![8, 1];
        full.clear_data_fields = vec![3, 300, 7];
        full.clear_state_fields = vec![1];
        full.origin = Some(Origin { source: "s".into(), import_id: "i".into(), published_at: 5 });
        let mut save = command("d", b"x", 0);
        save.kind = CommandKind::Save as i32;
        let batch = CommandBatch {
            partition: 3,
            commands: vec![command("a", b"\x0a\x01r", 1), cas, full, save, Command::default()],
            sweeps: vec![Sweep { place_id: 4, generation: 9, ..Default::default() }],
            origin: Some(Origin { source: "p".into(), import_id: "p-1".into(), published_at: 1 }),
        };
        let bytes = batch.encode_to_vec();
        let scanned = Scanned::read(Bytes::from(bytes.clone())).expect("reads");
        assert!(scanned.views().is_some(), "walked, not decoded");
        assert_eq!(scanned.header.sweeps, batch.sweeps);
        check(&bytes);
        let only = scanned.decode_some(|i| i == 1).expect("decodes");
        assert_eq!(only.commands, vec![batch.commands[1].clone()]);
        assert_eq!((only.partition, &only.origin), (3, &batch.origin));
    }

    #[test]
    fn what_does_not_walk_exactly_is_decoded_whole() {
        let one = command("a", b"x", 1);
        let mut bytes =
            CommandBatch { commands: vec![one.clone()], ..Default::default() }.encode_to_vec();
        // A second key inside the command: prost merges the two.
        let key = RecordKey { brand_id: 0, place_id: 9, product_id: String::new() };
        let mut inner = one.encode_to_vec();
        prost::encoding::message::encode(1, &key, &mut inner);
        let mut merged = Vec::new();
        prost::encoding::bytes::encode(2, &inner, &mut merged);
        let scanned = Scanned::read(Bytes::from(merged.clone())).expect("prost reads it");
        assert!(scanned.views().is_none());
        assert_eq!(
            scanned.decode_all().expect("decoded").commands[0].key.as_ref().map(|k| k.place_id),
            Some(9)
        );
        check(&merged);
        // Cut short, or a product id that is not UTF-8: prost's error.
        bytes.truncate(bytes.len() - 1);
        assert!(Scanned::read(Bytes::from(bytes)).is_err());
        let mut bad = command("a", b"x", 1);
        bad.key.as_mut().expect("key").product_id = "\u{e9}".into();
        let mut raw = CommandBatch { commands: vec![bad], ..Default::default() }.encode_to_vec();
        let at = raw.iter().position(|&b| b == 0xc3).expect("the id's first byte");
        raw[at] = 0xff;
        check(&raw);
        assert!(Scanned::read(Bytes::from(raw)).is_err());
    }

    fn arb_command() -> impl Strategy<Value = Command> {
        (
            prop::option::of(("[a-z\u{e9}]{0,6}", -3i64..3, any::<i64>())),
            0i32..5,
            prop::collection::vec(any::<u8>(), 0..12),
            prop::collection::vec(any::<u8>(), 0..4),
            prop::collection::vec(any::<u32>(), 0..3),
            prop::collection::vec(0u32..300, 0..2),
            prop::option::of(any::<i64>()),
            any::<i64>(),
            prop::option::of(any::<i64>()),
        )
            .prop_map(|(key, kind, data, state, cd, cs, cas, generation, origin)| {
                Command {
                    key: key.map(|(id, place, brand)| RecordKey {
                        brand_id: brand,
                        place_id: place,
                        product_id: id,
                    }),
                    kind,
                    data,
                    state,
                    clear_data_fields: cd,
                    clear_state_fields: cs,
                    expected_updated_at: cas,
                    generation,
                    origin: origin.map(|t| Origin { published_at: t, ..Default::default() }),
                }
            })
    }

    /// Every byte of a small message replaced by every value, deleted, or
    /// the message cut there: the walk reads what prost decodes, or leaves
    /// it to prost (a wire type or tag changed anywhere is among these).
    #[test]
    fn every_one_byte_edit_reads_as_prost_decodes() {
        let mut full = command("c\u{e9}", b"\x0a\x01r", 9);
        full.state = vec![8, 1];
        full.clear_data_fields = vec![3, 300];
        full.clear_state_fields = vec![1];
        full.expected_updated_at = Some(-1);
        full.origin = Some(Origin { source: "s".into(), import_id: "i".into(), published_at: 5 });
        let batch = CommandBatch {
            partition: 3,
            commands: vec![command("a", b"x", 1), full],
            sweeps: vec![Sweep { place_id: 4, generation: 9, ..Default::default() }],
            origin: Some(Origin { source: "p".into(), import_id: "q".into(), published_at: 1 }),
        };
        let bytes = batch.encode_to_vec();
        check(&bytes);
        for i in 0..bytes.len() {
            for v in 0..=255u8 {
                let mut b = bytes.clone();
                b[i] = v;
                check(&b);
            }
            let mut b = bytes.clone();
            b.remove(i);
            check(&b);
            check(&bytes[..i]);
        }
    }

    proptest! {
        /// Any message, or any message with bytes changed, cut or added:
        /// the walk reads what prost decodes, or leaves it to prost.
        #[test]
        fn the_walk_reads_what_prost_decodes(
            commands in prop::collection::vec(arb_command(), 0..4),
            partition in any::<u32>(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 0..3),
        ) {
            let batch = CommandBatch { partition, commands, ..Default::default() };
            let mut bytes = batch.encode_to_vec();
            check(&bytes);
            for (at, byte, how) in edits {
                if bytes.is_empty() {
                    break;
                }
                let i = at.index(bytes.len());
                match how {
                    0 => bytes[i] = byte,
                    1 => bytes.truncate(i),
                    _ => bytes.insert(i, byte),
                }
                check(&bytes);
            }
        }
    }
}

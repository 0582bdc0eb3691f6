//! Batching as a contract: at most `max_commands` commands per message, all
//! of one partition, and an encoded size under the server's max payload.
//! [`CommandBatcher`] takes `Command`s; [`EncodedBatcher`] takes commands
//! already encoded where they were made, and closes its batches exactly
//! where the other would.

use std::collections::HashMap;

use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};
use shelfsync_proto::{Command, CommandBatch, Origin};

use crate::{Partition, partition_of};

/// Bytes a batch message spends on framing beyond its commands.
pub fn batch_overhead() -> usize {
    16
}

fn framed_len(len: usize) -> usize {
    1 + prost::length_delimiter_len(len) + len
}

/// A batch a [`Batcher`] fills: the commands of one partition, as a
/// `CommandBatch` ([`CommandBatcher`]) or as its message's bytes
/// ([`EncodedBatcher`]).
pub trait PartitionBatch {
    /// What a command is when it is added.
    type Command;
    /// An empty batch of `partition`.
    fn empty(partition: Partition) -> Self;
    /// The brand and place a command is routed by.
    fn key(cmd: &Self::Command) -> (i64, i64);
    /// A command's encoded length, unframed.
    fn command_len(cmd: &Self::Command) -> usize;
    fn add(&mut self, cmd: Self::Command);
    /// How many commands the batch holds.
    fn count(&self) -> usize;
}

/// Groups commands by partition and hands out full batches.
pub struct Batcher<B> {
    partitions: u32,
    max_commands: usize,
    max_bytes: usize,
    pending: HashMap<Partition, (B, usize)>,
}

/// [`Batcher`] of `Command`s.
pub type CommandBatcher = Batcher<CommandBatch>;

/// [`Batcher`] for commands encoded once, where they are made: none is
/// measured or encoded again here, and a batch is its message's bytes. It
/// closes its batches exactly where [`CommandBatcher`] would.
pub type EncodedBatcher = Batcher<EncodedBatch>;

impl<B: PartitionBatch> Batcher<B> {
    pub fn new(partitions: u32, max_commands: usize, max_bytes: usize) -> Self {
        Self {
            partitions,
            max_commands: max_commands.clamp(1, 1000),
            max_bytes,
            pending: HashMap::new(),
        }
    }

    /// Adds a command; returns the batches that became full. A batch is
    /// closed before a command that would push it over `max_bytes`, and when
    /// it reaches `max_commands`.
    pub fn push(&mut self, cmd: B::Command) -> Vec<(Partition, B)> {
        let (brand_id, place_id) = B::key(&cmd);
        let partition = partition_of(brand_id, place_id, self.partitions);
        let len = framed_len(B::command_len(&cmd));
        let mut out = Vec::new();
        let entry = self
            .pending
            .entry(partition)
            .or_insert_with(|| (B::empty(partition), batch_overhead()));
        if entry.0.count() > 0 && entry.1 + len > self.max_bytes {
            out.push((partition, Self::close(entry, partition)));
        }
        entry.0.add(cmd);
        entry.1 += len;
        if entry.0.count() >= self.max_commands {
            out.push((partition, Self::close(entry, partition)));
        }
        out
    }

    /// Takes the batch of `entry` out, leaving an empty one.
    fn close(entry: &mut (B, usize), partition: Partition) -> B {
        entry.1 = batch_overhead();
        std::mem::replace(&mut entry.0, B::empty(partition))
    }

    /// Every non-empty pending batch, in partition order.
    pub fn drain(&mut self) -> Vec<(Partition, B)> {
        let mut out: Vec<_> = self
            .pending
            .drain()
            .filter(|(_, (b, _))| b.count() > 0)
            .map(|(p, (b, _))| (p, b))
            .collect();
        out.sort_by_key(|(p, _)| *p);
        out
    }

    pub fn pending_commands(&self) -> usize {
        self.pending.values().map(|(b, _)| b.count()).sum()
    }
}

impl PartitionBatch for CommandBatch {
    type Command = Command;

    fn empty(partition: Partition) -> Self {
        CommandBatch { partition: partition.0, ..Default::default() }
    }

    fn key(cmd: &Command) -> (i64, i64) {
        cmd.key.as_ref().map_or((0, 0), |k| (k.brand_id, k.place_id))
    }

    fn command_len(cmd: &Command) -> usize {
        cmd.encoded_len()
    }

    fn add(&mut self, cmd: Command) {
        self.commands.push(cmd);
    }

    fn count(&self) -> usize {
        self.commands.len()
    }
}

/// One command in its wire bytes (prost's encoding of a `Command`), with
/// the key it is routed by.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedCommand {
    pub brand_id: i64,
    pub place_id: i64,
    pub bytes: Vec<u8>,
}

/// A batch of encoded commands, no sweep: the bytes of its `CommandBatch`
/// but the origin, which is added when it is sent ([`EncodedBatch::finish`]).
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedBatch {
    bytes: Vec<u8>,
    commands: usize,
}

/// `CommandBatch` field numbers.
const PARTITION: u32 = 1;
const COMMANDS: u32 = 2;
const ORIGIN: u32 = 4;

impl EncodedBatch {
    fn new(partition: Partition) -> Self {
        let mut bytes = Vec::new();
        // proto3: a zero is not written.
        if partition.0 != 0 {
            encode_key(PARTITION, WireType::Varint, &mut bytes);
            encode_varint(u64::from(partition.0), &mut bytes);
        }
        EncodedBatch { bytes, commands: 0 }
    }

    fn push(&mut self, command: &[u8]) {
        encode_key(COMMANDS, WireType::LengthDelimited, &mut self.bytes);
        encode_varint(command.len() as u64, &mut self.bytes);
        self.bytes.extend_from_slice(command);
        self.commands += 1;
    }

    /// How many commands the batch holds.
    pub fn len(&self) -> usize {
        self.commands
    }

    pub fn is_empty(&self) -> bool {
        self.commands == 0
    }

    /// The batch's message: what `CommandBatch::encode_to_vec` gives for its
    /// partition, its commands and `origin`.
    pub fn finish(mut self, origin: Option<&Origin>) -> Vec<u8> {
        if let Some(origin) = origin {
            encode_key(ORIGIN, WireType::LengthDelimited, &mut self.bytes);
            encode_varint(origin.encoded_len() as u64, &mut self.bytes);
            origin.encode_raw(&mut self.bytes);
        }
        self.bytes
    }
}

impl PartitionBatch for EncodedBatch {
    type Command = EncodedCommand;

    fn empty(partition: Partition) -> Self {
        EncodedBatch::new(partition)
    }

    fn key(cmd: &EncodedCommand) -> (i64, i64) {
        (cmd.brand_id, cmd.place_id)
    }

    fn command_len(cmd: &EncodedCommand) -> usize {
        cmd.bytes.len()
    }

    fn add(&mut self, cmd: EncodedCommand) {
        self.push(&cmd.bytes);
    }

    fn count(&self) -> usize {
        self.commands
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shelfsync_proto::RecordKey;

    fn cmd(place: i64, id: usize, data_len: usize) -> Command {
        Command {
            key: Some(RecordKey::new(7, place, format!("sku-{id}"))),
            data: vec![b'x'; data_len],
            ..Default::default()
        }
    }

    #[test]
    fn splits_by_count_and_partition() {
        let mut b = CommandBatcher::new(4, 1000, 1 << 20);
        let mut full = Vec::new();
        for i in 0..2500 {
            full.extend(b.push(cmd(1, i, 10)));
        }
        assert_eq!(full.len(), 2);
        assert!(full.iter().all(|(_, batch)| batch.commands.len() == 1000));
        let rest = b.drain();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].1.commands.len(), 500);
        assert_eq!(rest[0].0, partition_of(7, 1, 4));
    }

    #[test]
    fn stays_under_max_bytes() {
        let max = 64 * 1024;
        let mut b = CommandBatcher::new(1, 1000, max);
        let mut batches = Vec::new();
        for i in 0..1000 {
            batches.extend(b.push(cmd(1, i, 700)));
        }
        batches.extend(b.drain());
        assert!(batches.len() > 1);
        let total: usize = batches.iter().map(|(_, b)| b.commands.len()).sum();
        assert_eq!(total, 1000);
        for (_, batch) in &batches {
            assert!(batch.encoded_len() <= max, "{} > {max}", batch.encoded_len());
        }
    }

    /// Both batchers on the same commands: the same batches, and each
    /// encoded batch is its `CommandBatch`'s bytes.
    #[test]
    fn encoded_batches_are_the_command_batches() {
        for (partitions, max_commands, max_bytes) in [(4, 1000, 1 << 20), (3, 7, 600), (1, 1, 64)] {
            let mut plain = CommandBatcher::new(partitions, max_commands, max_bytes);
            let mut encoded = EncodedBatcher::new(partitions, max_commands, max_bytes);
            let (mut expected, mut got) = (Vec::new(), Vec::new());
            for i in 0..3000 {
                let place = (i * 7 % 13) as i64 - 2;
                let command = Command { generation: i as i64, ..cmd(place, i, i * 31 % 200) };
                let bytes = command.encode_to_vec();
                expected.extend(plain.push(command));
                got.extend(encoded.push(EncodedCommand { brand_id: 7, place_id: place, bytes }));
            }
            expected.extend(plain.drain());
            got.extend(encoded.drain());
            assert_eq!(plain.pending_commands() + encoded.pending_commands(), 0);
            assert_eq!(expected.len(), got.len());
            let origin = Origin { source: "p".into(), import_id: "p-1".into(), published_at: 5 };
            for (n, ((p, mut batch), (q, encoded))) in expected.into_iter().zip(got).enumerate() {
                assert_eq!((p, batch.commands.len()), (q, encoded.len()));
                let origin = (n % 2 == 0).then(|| origin.clone());
                batch.origin = origin.clone();
                assert_eq!(encoded.finish(origin.as_ref()), batch.encode_to_vec());
            }
        }
    }
}

//! Batching as a contract: at most `max_commands` commands per message, all
//! of one partition, and an encoded size under the server's max payload.

use std::collections::HashMap;

use prost::Message;
use shelfsync_proto::{Command, CommandBatch};

use crate::{Partition, partition_of};

/// Bytes a batch message spends on framing beyond its commands.
pub fn batch_overhead() -> usize {
    16
}

fn framed_len(len: usize) -> usize {
    1 + prost::length_delimiter_len(len) + len
}

/// Groups commands by partition and hands out full batches.
pub struct CommandBatcher {
    partitions: u32,
    max_commands: usize,
    max_bytes: usize,
    pending: HashMap<Partition, (CommandBatch, usize)>,
}

impl CommandBatcher {
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
    pub fn push(&mut self, cmd: Command) -> Vec<(Partition, CommandBatch)> {
        let key = cmd.key.as_ref().map_or((0, 0), |k| (k.brand_id, k.place_id));
        let partition = partition_of(key.0, key.1, self.partitions);
        let len = framed_len(cmd.encoded_len());
        let mut out = Vec::new();
        let entry = self.pending.entry(partition).or_insert_with(|| {
            (CommandBatch { partition: partition.0, ..Default::default() }, batch_overhead())
        });
        if !entry.0.commands.is_empty() && entry.1 + len > self.max_bytes {
            let full = std::mem::replace(
                &mut entry.0,
                CommandBatch { partition: partition.0, ..Default::default() },
            );
            entry.1 = batch_overhead();
            out.push((partition, full));
        }
        entry.0.commands.push(cmd);
        entry.1 += len;
        if entry.0.commands.len() >= self.max_commands {
            let full = std::mem::replace(
                &mut entry.0,
                CommandBatch { partition: partition.0, ..Default::default() },
            );
            entry.1 = batch_overhead();
            out.push((partition, full));
        }
        out
    }

    /// Every non-empty pending batch, in partition order.
    pub fn drain(&mut self) -> Vec<(Partition, CommandBatch)> {
        let mut out: Vec<_> = self
            .pending
            .drain()
            .filter(|(_, (b, _))| !b.commands.is_empty())
            .map(|(p, (b, _))| (p, b))
            .collect();
        out.sort_by_key(|(p, _)| *p);
        out
    }

    pub fn pending_commands(&self) -> usize {
        self.pending.values().map(|(b, _)| b.commands.len()).sum()
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
}

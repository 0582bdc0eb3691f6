//! Subject and stream names, all derived from the configured prefix, and the
//! stable partition function.

use std::fmt;

/// A command partition: `(brand_id, place_id)` hash modulo the partition count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Partition(pub u32);

impl Partition {
    /// The partition a place's records live in, of `partitions`.
    pub fn of(place: shelfsync_proto::PlaceKey, partitions: u32) -> Partition {
        partition_of(place.brand_id, place.place_id, partitions)
    }
}

impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Stable across processes, versions and languages: xxh3-64 (seed 0) of
/// `brand_id` then `place_id`, each 8 little-endian bytes, modulo `partitions`.
pub fn partition_of(brand_id: i64, place_id: i64, partitions: u32) -> Partition {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&brand_id.to_le_bytes());
    buf[8..].copy_from_slice(&place_id.to_le_bytes());
    let h = xxhash_rust::xxh3::xxh3_64(&buf);
    Partition((h % u64::from(partitions.max(1))) as u32)
}

/// Every subject and stream name of one deployment.
#[derive(Debug, Clone)]
pub struct Subjects {
    prefix: String,
    stream_prefix: String,
}

impl Subjects {
    pub fn new(prefix: &str) -> Self {
        let stream_prefix = prefix
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' })
            .collect();
        Self { prefix: prefix.to_string(), stream_prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn cmd(&self, partition: Partition) -> String {
        format!("{}.cmd.{}", self.prefix, partition.0)
    }
    /// Where command messages carrying sweeps go: a subject of their own in
    /// the CMD stream, which only ingest and the operator CLI may publish to
    /// (storage refuses a sweep that arrives on [`Subjects::cmd`]). Storage's
    /// consumer of the partition reads both subjects, in stream order.
    pub fn cmd_sweep(&self, partition: Partition) -> String {
        format!("{}.cmd.{}.sweep", self.prefix, partition.0)
    }
    /// [`Subjects::cmd_sweep`] when a message carries sweeps, else [`Subjects::cmd`].
    pub fn cmd_for(&self, partition: Partition, has_sweeps: bool) -> String {
        if has_sweeps { self.cmd_sweep(partition) } else { self.cmd(partition) }
    }
    pub fn cmd_all(&self) -> String {
        format!("{}.cmd.>", self.prefix)
    }
    pub fn changes(&self, brand_id: i64, place_id: i64) -> String {
        format!("{}.changes.{brand_id}.{place_id}", self.prefix)
    }
    pub fn changes_all(&self) -> String {
        format!("{}.changes.>", self.prefix)
    }
    /// Changes filtered by brand and/or place (`*` where not given).
    pub fn changes_filter(&self, brand_id: Option<i64>, place_id: Option<i64>) -> String {
        let b = brand_id.map_or("*".to_string(), |b| b.to_string());
        let p = place_id.map_or("*".to_string(), |p| p.to_string());
        format!("{}.changes.{b}.{p}", self.prefix)
    }
    /// Rejects; `place_id` 0 when the place is unknown (unparseable item).
    pub fn rejects(&self, brand_id: i64, place_id: i64) -> String {
        format!("{}.rejects.{brand_id}.{place_id}", self.prefix)
    }
    pub fn rejects_all(&self) -> String {
        format!("{}.rejects.>", self.prefix)
    }

    pub fn keyframes(&self, brand_id: i64, place_id: i64) -> String {
        format!("{}.keyframes.{brand_id}.{place_id}", self.prefix)
    }
    pub fn keyframes_all(&self) -> String {
        format!("{}.keyframes.>", self.prefix)
    }
    pub fn keyframes_filter(&self, brand_id: Option<i64>, place_id: Option<i64>) -> String {
        let b = brand_id.map_or("*".to_string(), |b| b.to_string());
        let p = place_id.map_or("*".to_string(), |p| p.to_string());
        format!("{}.keyframes.{b}.{p}", self.prefix)
    }
    /// Core NATS request subject: publish a keyframe now (KeyframeRequest).
    pub fn ctl_keyframe(&self) -> String {
        format!("{}.ctl.keyframe", self.prefix)
    }
    /// Core NATS request subject: re-base partitions refused because their
    /// command stream was replaced (RebaseRequest).
    pub fn ctl_rebase(&self) -> String {
        format!("{}.ctl.rebase", self.prefix)
    }
    /// Core NATS request subject: put outbox entries kept aside back into
    /// their outboxes (RedriveRequest).
    pub fn ctl_redrive(&self) -> String {
        format!("{}.ctl.redrive", self.prefix)
    }
    /// Core NATS request subjects of the read API.
    pub fn read(&self, what: &str) -> String {
        format!("{}.read.{what}", self.prefix)
    }

    /// Master card changes of a region.
    pub fn aggregates_card(&self, region: &str) -> String {
        format!("{}.aggregates.cards.{}", self.prefix, token(region))
    }
    /// Category flips of a place.
    pub fn aggregates_category(&self, brand_id: i64, place_id: i64) -> String {
        format!("{}.aggregates.categories.{brand_id}.{place_id}", self.prefix)
    }
    pub fn aggregates_all(&self) -> String {
        format!("{}.aggregates.>", self.prefix)
    }
    /// Core NATS request subject of the recommender (TopRequest → TopReply).
    pub fn recommend_top(&self) -> String {
        format!("{}.recommend.top", self.prefix)
    }

    pub fn aggregates_stream(&self) -> String {
        format!("{}_AGGREGATES", self.stream_prefix)
    }
    pub fn keyframes_stream(&self) -> String {
        format!("{}_KEYFRAMES", self.stream_prefix)
    }
    pub fn cmd_stream(&self) -> String {
        format!("{}_CMD", self.stream_prefix)
    }
    pub fn changes_stream(&self) -> String {
        format!("{}_CHANGES", self.stream_prefix)
    }
    pub fn rejects_stream(&self) -> String {
        format!("{}_REJECTS", self.stream_prefix)
    }

    /// The destination template of `subject` (OpenTelemetry messaging
    /// conventions): the varying tokens named, `<prefix>.cmd.{partition}`,
    /// `<prefix>.changes.{brand_id}.{place_id}`, so that span names stay
    /// few. Subjects without varying tokens (`ctl.*`, `read.*`) and foreign
    /// ones come back as they are.
    pub fn template(&self, subject: &str) -> String {
        /// The leading tokens of a kind of subject and the names of the
        /// tokens that follow them.
        const SHAPES: &[(&[&str], &[&str])] = &[
            (&["cmd"], &["{partition}"]),
            (&["changes"], &["{brand_id}", "{place_id}"]),
            (&["rejects"], &["{brand_id}", "{place_id}"]),
            (&["keyframes"], &["{brand_id}", "{place_id}"]),
            (&["aggregates", "cards"], &["{region}"]),
            (&["aggregates", "categories"], &["{brand_id}", "{place_id}"]),
        ];
        let Some(rest) = subject.strip_prefix(&self.prefix).and_then(|r| r.strip_prefix('.'))
        else {
            return subject.to_string();
        };
        let tokens: Vec<&str> = rest.split('.').collect();
        if let ["cmd", _, "sweep"] = tokens.as_slice() {
            return format!("{}.cmd.{{partition}}.sweep", self.prefix);
        }
        for (lead, names) in SHAPES {
            if tokens.len() == lead.len() + names.len() && tokens.starts_with(lead) {
                return [&[self.prefix.as_str()][..], lead, names].concat().join(".");
            }
        }
        subject.to_string()
    }

    /// Durable consumer name of the storage worker of one partition. Named
    /// by partition, not by replica, so that a new owner resumes where the
    /// old one stopped.
    pub fn storage_consumer(&self, partition: Partition) -> String {
        format!("storage-p{}", partition.0)
    }

    /// The consumer of the partition of storage replica `replica`: each
    /// owner reads the partition with its own (no acks; it purges what it
    /// applied), so that two owners during a rescale each see every message.
    pub fn storage_consumer_of(&self, partition: Partition, replica: u32) -> String {
        format!("{}-r{replica}", self.storage_consumer(partition))
    }

    /// The partition a storage consumer's name says (`storage-p<N>`, or
    /// `storage-p<N>-r<replica>-<process>` and its `-sweeps` twin).
    pub fn partition_of_storage_consumer(name: &str) -> Option<Partition> {
        let rest = name.strip_prefix("storage-p")?;
        let n = rest.split_once("-r").map_or(rest, |(n, _)| n);
        n.parse().ok().map(Partition)
    }
}

/// A free-form name as one subject token (dots, spaces and wildcards
/// replaced by `_`).
pub fn token(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_prefix() {
        let s = Subjects::new("t1.shelf-x");
        assert_eq!(s.cmd(Partition(3)), "t1.shelf-x.cmd.3");
        assert_eq!(s.changes(7, 42), "t1.shelf-x.changes.7.42");
        assert_eq!(s.changes_filter(Some(7), None), "t1.shelf-x.changes.7.*");
        assert_eq!(s.cmd_stream(), "T1_SHELF_X_CMD");
        assert_eq!(Subjects::new("shelfsync").changes_stream(), "SHELFSYNC_CHANGES");
    }

    #[test]
    fn templates_name_the_varying_tokens() {
        let s = Subjects::new("t1.shelf-x");
        assert_eq!(s.template(&s.cmd(Partition(3))), "t1.shelf-x.cmd.{partition}");
        assert_eq!(s.template(&s.cmd_sweep(Partition(3))), "t1.shelf-x.cmd.{partition}.sweep");
        assert_eq!(s.cmd_for(Partition(3), true), s.cmd_sweep(Partition(3)));
        assert_eq!(s.cmd_for(Partition(3), false), s.cmd(Partition(3)));
        assert_eq!(s.template(&s.changes(7, 42)), "t1.shelf-x.changes.{brand_id}.{place_id}");
        assert_eq!(s.template(&s.rejects(7, 0)), "t1.shelf-x.rejects.{brand_id}.{place_id}");
        assert_eq!(s.template(&s.keyframes(7, 42)), "t1.shelf-x.keyframes.{brand_id}.{place_id}");
        assert_eq!(
            s.template(&s.aggregates_card("eu west")),
            "t1.shelf-x.aggregates.cards.{region}"
        );
        assert_eq!(
            s.template(&s.aggregates_category(7, 42)),
            "t1.shelf-x.aggregates.categories.{brand_id}.{place_id}"
        );
        assert_eq!(s.template(&s.ctl_keyframe()), "t1.shelf-x.ctl.keyframe");
        assert_eq!(s.template("other.cmd.3"), "other.cmd.3");
        assert_eq!(s.template("t1.shelf-x.cmd.3.extra"), "t1.shelf-x.cmd.3.extra");
    }

    #[test]
    fn partition_is_stable_and_spread() {
        // Pinned: other languages and older versions compute the same value.
        assert_eq!(partition_of(7, 42, 64), partition_of(7, 42, 64));
        let mut counts = [0u32; 16];
        for place in 0..16_000 {
            counts[partition_of(7, place, 16).0 as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
    }
}

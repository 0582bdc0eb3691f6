//! The names of a partition's Redis keys, in one place, so that the layout
//! documented in the parent module is the layout written and read.

use shelfsync_bus::Partition;
use shelfsync_proto::PlaceKey;

/// Key names of one partition.
#[derive(Debug, Clone)]
pub struct Keys {
    tag: String,
}

impl Keys {
    pub fn new(namespace: &str, partition: Partition) -> Self {
        Self { tag: format!("{{{namespace}:p{partition}}}") }
    }
    pub fn records(&self, place: PlaceKey) -> String {
        format!("{}:r:{place}", self.tag)
    }
    /// The layout version the partition's keys are in (see `upgrade`).
    pub fn layout(&self) -> String {
        format!("{}:layout", self.tag)
    }
    /// Layout 1 (before the generation moved into the record bytes): a
    /// place's generations, product_id → generation and flag. Read only by
    /// the upgrade, which removes it.
    pub fn legacy_gens(&self, place: PlaceKey) -> String {
        format!("{}:g:{place}", self.tag)
    }
    /// Layout 1: a place's product ids in order (paged reads), removed by the
    /// upgrade.
    pub fn legacy_ids(&self, place: PlaceKey) -> String {
        format!("{}:ids:{place}", self.tag)
    }
    /// Layout 1: the frozen values of a place's generations, removed by the
    /// upgrade.
    pub fn legacy_frozen_gens(&self, place: PlaceKey) -> String {
        format!("{}:kfo:g:{place}", self.tag)
    }
    pub fn seq(&self) -> String {
        format!("{}:seq", self.tag)
    }
    pub fn stream(&self) -> String {
        format!("{}:stream", self.tag)
    }
    pub fn step(&self) -> String {
        format!("{}:step", self.tag)
    }
    /// A counter written right before `WAIT` (`Store::wait_replicas`).
    pub fn wait_mark(&self) -> String {
        format!("{}:w", self.tag)
    }
    pub fn absent(&self) -> String {
        format!("{}:absent", self.tag)
    }
    pub fn held(&self) -> String {
        format!("{}:held", self.tag)
    }
    pub fn swept(&self, import_id: &str) -> String {
        format!("{}:swept:{import_id}", self.tag)
    }
    /// Index of the partition's sweep outcomes (import ids, scored by when
    /// their hash expires): their number is a metric.
    pub fn swept_index(&self) -> String {
        format!("{}:swept", self.tag)
    }
    /// Index of the partition's touched sets (`<brand>:<place>:<generation>`,
    /// scored by when each expires).
    pub fn touched_index(&self) -> String {
        format!("{}:t", self.tag)
    }
    pub fn dead(&self) -> String {
        format!("{}:dead", self.tag)
    }
    /// The outbox stream.
    pub fn outbox(&self) -> String {
        format!("{}:obx", self.tag)
    }
    /// Where a commit stages its outbox entries (see `COMMIT_LUA`).
    pub fn outbox_stage(&self) -> String {
        format!("{}:obx:in", self.tag)
    }
    /// The outbox of versions before the stream (a list), adopted by
    /// [`super::Store::adopt_legacy_outbox`].
    pub fn legacy_outbox(&self) -> String {
        format!("{}:outbox", self.tag)
    }
    pub fn tombstones(&self) -> String {
        format!("{}:tomb", self.tag)
    }
    pub fn places(&self) -> String {
        format!("{}:places", self.tag)
    }
    /// What the full import of `generation` carried to the place.
    pub fn touched(&self, place: PlaceKey, generation: i64) -> String {
        format!("{}:t:{place}:{generation}", self.tag)
    }
    pub fn keyframes(&self, place: PlaceKey) -> String {
        format!("{}:kf:{place}", self.tag)
    }
    /// Exists while a keyframe has the place frozen: every write to the
    /// place's records then keeps the value it replaces.
    pub fn frozen_marker(&self, place: PlaceKey) -> String {
        format!("{}:kfm:{place}", self.tag)
    }
    /// The frozen values of the place's records written since the freeze
    /// (copy on write; dropped once the keyframe is published).
    pub fn frozen_records(&self, place: PlaceKey) -> String {
        format!("{}:kfo:r:{place}", self.tag)
    }
}

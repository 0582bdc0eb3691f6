//! What a handler receives: one record's new version, with typed access to
//! its `Product` and `RecordState`.

use prost::Message;
use shelfsync_proto::{
    Change, ChangeKind, Origin, PlaceKey, Product, Record, RecordKey, RecordState,
};

/// Where an update comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateKind {
    Created,
    Updated,
    Deleted,
    /// Loaded from a keyframe (bootstrap or resync of a place).
    Snapshot,
}

/// A record's new version, as the kit delivers it to a handler.
#[derive(Debug, Clone)]
pub struct Update {
    pub key: RecordKey,
    /// The previous version as storage saw it (`None` for a creation or a
    /// snapshot).
    pub before: Option<Record>,
    pub after: Record,
    pub kind: UpdateKind,
    pub origin: Option<Origin>,
}

impl Update {
    pub fn from_change(c: &Change) -> Option<Update> {
        let after = c.after.clone()?;
        let key = c.key.clone().or_else(|| after.key.clone())?;
        let kind = match ChangeKind::try_from(c.kind) {
            Ok(ChangeKind::Created) => UpdateKind::Created,
            Ok(ChangeKind::Deleted) => UpdateKind::Deleted,
            _ => UpdateKind::Updated,
        };
        Some(Update { key, before: c.before.clone(), after, kind, origin: c.origin.clone() })
    }

    pub fn from_snapshot(r: Record) -> Option<Update> {
        let key = r.key.clone()?;
        Some(Update { key, before: None, after: r, kind: UpdateKind::Snapshot, origin: None })
    }

    pub fn product(&self) -> Product {
        product_of(&self.after)
    }

    pub fn state(&self) -> RecordState {
        state_of(&self.after)
    }

    pub fn place(&self) -> PlaceKey {
        self.key.place()
    }
}

/// The record's `Product` (empty if `data` does not decode: storage only
/// stores well-formed bytes, so this means a newer, incompatible schema).
pub fn product_of(r: &Record) -> Product {
    Product::decode(r.data.as_slice()).unwrap_or_default()
}

pub fn state_of(r: &Record) -> RecordState {
    RecordState::decode(r.state.as_slice()).unwrap_or_default()
}

/// Present in the latest full import and not deleted.
pub fn is_live(r: &Record) -> bool {
    !r.absent && !r.deleted
}

/// Live and not hidden by a validator.
pub fn is_visible(r: &Record) -> bool {
    is_live(r) && !state_of(r).hidden.unwrap_or(false)
}

/// Visible with a positive stock.
pub fn is_offered(r: &Record) -> bool {
    is_visible(r) && product_of(r).stock.unwrap_or(0) > 0
}

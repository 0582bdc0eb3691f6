//! The `shelfsync.v1` wire contract (docs/DESIGN.md, Messages), generated
//! from `proto/`.
//!
//! Owns the message types and the names of message types carried in the
//! `Shelfsync-Type` header. Holds no logic beyond small constructors and
//! the clock its timestamps are read from ([`now_us`]).
#![forbid(unsafe_code)]

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/shelfsync.v1.rs"));
}

pub mod json;
mod place;

pub use place::PlaceKey;
pub use prost::Message;
pub use v1::*;

/// Now, as the contract's timestamps count time: microseconds since the
/// Unix epoch (0 before it, `i64::MAX` past the year 294,000).
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// Top-level field numbers of `Product`, for `clear_data_fields` and
/// `changed_data_fields`.
pub mod product_field {
    pub const TITLE: u32 = 1;
    pub const CATEGORY: u32 = 2;
    pub const PRICE: u32 = 3;
    pub const OLD_PRICE: u32 = 4;
    pub const CURRENCY: u32 = 5;
    pub const STOCK: u32 = 6;
    pub const IMAGES: u32 = 7;
    pub const DESCRIPTION: u32 = 8;

    /// Field number of a `Product` field by its feed name.
    pub fn by_name(name: &str) -> Option<u32> {
        Some(match name {
            "title" => TITLE,
            "category" => CATEGORY,
            "price" => PRICE,
            "old_price" => OLD_PRICE,
            "currency" => CURRENCY,
            "stock" => STOCK,
            "images" => IMAGES,
            "description" => DESCRIPTION,
            _ => return None,
        })
    }

    /// All feed field names, in field-number order.
    pub const NAMES: [&str; 8] =
        ["title", "category", "price", "old_price", "currency", "stock", "images", "description"];
}

/// Top-level field numbers of `RecordState`.
pub mod state_field {
    pub const HIDDEN: u32 = 1;
    pub const REASONS: u32 = 2;
    pub const DECIDED_BY: u32 = 3;
    pub const DECIDED_AT: u32 = 4;
}

/// Values of the `Shelfsync-Type` header.
pub mod msg_type {
    pub const COMMAND_BATCH: &str = "shelfsync.v1.CommandBatch";
    pub const CHANGE_BATCH: &str = "shelfsync.v1.ChangeBatch";
    pub const REJECTION_BATCH: &str = "shelfsync.v1.RejectionBatch";
    pub const KEYFRAME_BATCH: &str = "shelfsync.v1.KeyframeBatch";
    pub const AGGREGATE_CHANGE: &str = "shelfsync.v1.AggregateChange";
}

impl RecordKey {
    pub fn new(brand_id: i64, place_id: i64, product_id: impl Into<String>) -> Self {
        Self { brand_id, place_id, product_id: product_id.into() }
    }
}

impl CommandBatch {
    /// The origin of `command`, one of this batch's: its own, else the batch's.
    pub fn origin_of<'a>(&'a self, command: &'a Command) -> Option<&'a Origin> {
        command.origin.as_ref().or(self.origin.as_ref())
    }
}

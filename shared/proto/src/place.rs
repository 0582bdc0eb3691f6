//! A place of a brand: the unit records are partitioned, published,
//! keyframed and swept by. On the wire it is two fields of each message
//! (`brand_id`, `place_id`); in code it is this one value.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct PlaceKey {
    pub brand_id: i64,
    pub place_id: i64,
}

impl PlaceKey {
    pub const fn new(brand_id: i64, place_id: i64) -> Self {
        Self { brand_id, place_id }
    }
}

/// `<brand>:<place>`, as in storage's Redis members and logs.
impl fmt::Display for PlaceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.brand_id, self.place_id)
    }
}

impl From<(i64, i64)> for PlaceKey {
    fn from((brand_id, place_id): (i64, i64)) -> Self {
        Self { brand_id, place_id }
    }
}

/// `place()` on the messages that name a place in two fields.
macro_rules! place_of {
    ($($msg:ident: $doc:literal),* $(,)?) => {$(
        impl crate::$msg {
            #[doc = $doc]
            pub fn place(&self) -> PlaceKey {
                PlaceKey::new(self.brand_id, self.place_id)
            }
        }
    )*};
}

place_of! {
    RecordKey: "The place this record belongs to.",
    Sweep: "The place this sweep is of.",
    KeyframeBatch: "The place this keyframe batch is of.",
    ReadRequest: "The place this read asks of.",
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_shows_as_brand_colon_place_and_orders_by_brand_first() {
        assert_eq!(PlaceKey::new(7, -2).to_string(), "7:-2");
        assert!(PlaceKey::new(1, 9) < PlaceKey::new(2, 0));
        assert_eq!(crate::RecordKey::new(3, 4, "x").place(), PlaceKey::new(3, 4));
        let sweep = crate::Sweep { brand_id: 5, place_id: 6, ..Default::default() };
        assert_eq!(sweep.place(), PlaceKey::new(5, 6));
    }
}

//! The ids of a place a full import carried, as storage keeps them (one
//! blob per place and import, appended by each commit): per id, its length
//! (u16, little endian) and its bytes. Exact, so no collision can spare a
//! record the import did not carry.

use std::collections::{BTreeMap, HashSet};

use shelfsync_proto::PlaceKey;

use super::Touch;

pub fn encode<'a>(ids: impl IntoIterator<Item = &'a str>) -> Vec<u8> {
    let mut out = Vec::new();
    for id in ids {
        push(&mut out, id);
    }
    out
}

fn push(out: &mut Vec<u8>, id: &str) {
    // Product ids are 1..=512 bytes (validated before any touch).
    out.extend_from_slice(&(id.len() as u16).to_le_bytes());
    out.extend_from_slice(id.as_bytes());
}

/// What one commit appends to touched sets: per place and full import
/// (its generation), the ids it carried, encoded as they are appended.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Appends(BTreeMap<(PlaceKey, i64), Vec<u8>>);

impl Appends {
    /// Nothing to append.
    pub fn none() -> &'static Appends {
        static NONE: Appends = Appends(BTreeMap::new());
        &NONE
    }

    pub fn add(&mut self, place: PlaceKey, generation: i64, id: &str) {
        push(self.0.entry((place, generation)).or_default(), id);
    }

    pub fn merge(&mut self, other: &Appends) {
        for (k, blob) in &other.0 {
            self.0.entry(*k).or_default().extend_from_slice(blob);
        }
    }

    pub fn extend<'a>(&mut self, touches: impl IntoIterator<Item = &'a Touch>) {
        for t in touches {
            self.add(t.place, t.generation, &t.product_id);
        }
    }

    /// Per place and generation, the encoded ids.
    pub fn iter(&self) -> impl Iterator<Item = (PlaceKey, i64, &[u8])> {
        self.0.iter().map(|((place, generation), blob)| (*place, *generation, &blob[..]))
    }
}

impl<'a> FromIterator<&'a Touch> for Appends {
    fn from_iter<I: IntoIterator<Item = &'a Touch>>(touches: I) -> Self {
        let mut out = Appends::default();
        out.extend(touches);
        out
    }
}

/// `None`: the blob is not one [`encode`] wrote.
pub fn decode(mut blob: &[u8]) -> Option<HashSet<String>> {
    let mut ids = HashSet::new();
    while !blob.is_empty() {
        let (len, rest) = blob.split_first_chunk::<2>()?;
        let len = u16::from_le_bytes(*len) as usize;
        let id = rest.get(..len)?;
        ids.insert(String::from_utf8(id.to_vec()).ok()?);
        blob = &rest[len..];
    }
    Some(ids)
}

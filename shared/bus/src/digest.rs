//! The order-independent digest of a place (docs/DESIGN.md, Keyframes): the
//! wrapping (mod 2^64) sum, over every record, of xxh3-64 (seed 0) of the
//! `product_id` UTF-8 bytes followed by `updated_at` as 8 little-endian bytes.
//! A consumer keeps it incrementally (subtract the old term, add the new) and
//! compares it with a keyframe's to detect drift without re-reading anything.

/// One record's term of the digest.
pub fn term(product_id: &str, updated_at: i64) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(product_id.as_bytes());
    h.update(&updated_at.to_le_bytes());
    h.digest()
}

/// A running digest with its record count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digest {
    pub sum: u64,
    pub count: u64,
}

impl Digest {
    pub fn add(&mut self, product_id: &str, updated_at: i64) {
        self.sum = self.sum.wrapping_add(term(product_id, updated_at));
        self.count += 1;
    }

    pub fn remove(&mut self, product_id: &str, updated_at: i64) {
        self.sum = self.sum.wrapping_sub(term(product_id, updated_at));
        self.count = self.count.saturating_sub(1);
    }

    /// A record moved from `old` to `new` updated_at.
    pub fn replace(&mut self, product_id: &str, old: i64, new: i64) {
        self.sum = self.sum.wrapping_sub(term(product_id, old)).wrapping_add(term(product_id, new));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn term_is_pinned() {
        // Pinned so that an accidental change of the formula fails here, and
        // other languages can check their implementation against it.
        let mut bytes = b"sku-1".to_vec();
        bytes.extend_from_slice(&1_700_000_000_000_000i64.to_le_bytes());
        assert_eq!(term("sku-1", 1_700_000_000_000_000), xxhash_rust::xxh3::xxh3_64(&bytes));
    }

    #[test]
    fn order_independent_and_incremental() {
        let mut a = Digest::default();
        a.add("x", 1);
        a.add("y", 2);
        let mut b = Digest::default();
        b.add("y", 2);
        b.add("x", 1);
        assert_eq!(a, b);
        b.replace("x", 1, 5);
        let mut c = Digest::default();
        c.add("y", 2);
        c.add("x", 5);
        assert_eq!(b, c);
        c.remove("x", 5);
        assert_eq!(c.count, 1);
        assert_ne!(c.sum, b.sum);
    }
}

//! Schema-agnostic PATCH merge and change detection of protobuf messages at
//! the wire level.
//!
//! Owns the rule for combining a stored record with a partial update: per
//! top-level field number, the patch replaces the base whole. It never looks
//! inside nested messages and never needs the schema, so field numbers storage
//! does not know (added by a newer integration) survive a merge untouched.
//!
//! Canonical form: top-level entries stably sorted by field number, every tag,
//! varint value and length prefix in its minimal encoding, payload bytes as
//! given. Two canonical messages holding the same entries are equal byte for
//! byte, which is what change detection and digests rely on. (Packed versus
//! unpacked repeated scalars cannot be unified without the schema.)
#![forbid(unsafe_code)]

/// Largest field number protobuf allows (2^29 - 1).
const MAX_FIELD: u64 = (1 << 29) - 1;

/// A varint never needs more than 10 bytes for 64 bits.
const MAX_VARINT_LEN: usize = 10;

/// Why a message could not be read. Every variant is a malformed input, so
/// callers treat it as poison: retrying the same bytes cannot succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MergeError {
    #[error("malformed protobuf: truncated varint at byte {offset}")]
    TruncatedVarint { offset: usize },
    /// More than 10 bytes, or a 10th byte carrying bits beyond 64.
    #[error("malformed protobuf: varint too long at byte {offset}")]
    VarintTooLong { offset: usize },
    #[error("malformed protobuf: truncated length-delimited field {field} at byte {offset}")]
    TruncatedLengthDelimited { field: u32, offset: usize },
    /// Field numbers are 1..=2^29-1.
    #[error("malformed protobuf: field number {field} out of range at byte {offset}")]
    InvalidFieldNumber { field: u64, offset: usize },
    /// Groups (3, 4) and the undefined types 6 and 7.
    #[error(
        "malformed protobuf: unsupported wire type {wire_type} for field {field} at byte {offset}"
    )]
    UnsupportedWireType { wire_type: u8, field: u32, offset: usize },
    #[error("malformed protobuf: truncated fixed{bits} field {field} at byte {offset}")]
    TruncatedFixed { bits: u8, field: u32, offset: usize },
}

/// Wire types we accept. Groups (3, 4) are deprecated and would need nested
/// parsing to find their end; 6 and 7 are not defined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Wire {
    Varint = 0,
    Fixed64 = 1,
    Len = 2,
    Fixed32 = 5,
}

/// One top-level entry, pointing into the message it was parsed from.
/// `start..end` is the raw varint, the fixed bytes, or the LEN payload
/// (without its prefix, which is re-encoded on output).
#[derive(Debug, Clone, Copy)]
struct Entry {
    field: u32,
    wire: Wire,
    /// Decoded value for `Wire::Varint`, so it can be re-encoded minimally.
    varint: u64,
    start: usize,
    end: usize,
}

impl Entry {
    fn same_as(&self, bytes: &[u8], other: &Entry, other_bytes: &[u8]) -> bool {
        self.field == other.field
            && self.wire == other.wire
            && match self.wire {
                Wire::Varint => self.varint == other.varint,
                _ => bytes[self.start..self.end] == other_bytes[other.start..other.end],
            }
    }
}

/// Parse `bytes` and return it canonical: top-level fields ordered by field
/// number (stable: entries of the same field number keep their relative
/// order, so repeated fields keep their order), tags re-encoded minimally
/// (varint values and length prefixes too, see the crate docs). Validates
/// wire format.
pub fn canonicalize(bytes: &[u8]) -> Result<Vec<u8>, MergeError> {
    let entries = parse_sorted(bytes)?;
    let mut out = Vec::with_capacity(bytes.len());
    put_entries(&mut out, bytes, &entries);
    Ok(out)
}

/// PATCH: the result holds, for every top-level field number present in
/// `patch`, exactly the patch's entries of that number (a repeated field is
/// replaced whole, never appended); every other field of `base` is kept; then
/// every field number in `clear` is removed. Output canonical (as
/// [`canonicalize`]). Unknown field numbers are handled like any other. Both
/// inputs validated.
pub fn merge(base: &[u8], patch: &[u8], clear: &[u32]) -> Result<Vec<u8>, MergeError> {
    let base_entries = parse_sorted(base)?;
    let patch_entries = parse_sorted(patch)?;
    let mut out = Vec::with_capacity(base.len() + patch.len());
    // `clear` is a handful of field numbers, so a linear scan beats sorting it.
    for_each_field(&base_entries, &patch_entries, |field, from_base, from_patch| {
        if clear.contains(&field) {
            return;
        }
        let (bytes, run) =
            if from_patch.is_empty() { (base, from_base) } else { (patch, from_patch) };
        put_entries(&mut out, bytes, run);
    });
    Ok(out)
}

/// [`merge`], and the top-level field numbers whose entries it changed:
/// what [`changed_fields`] of `base` and the result gives, found in the
/// same walk instead of parsing both messages again.
pub fn merge_changes(
    base: &[u8],
    patch: &[u8],
    clear: &[u32],
) -> Result<(Vec<u8>, Vec<u32>), MergeError> {
    let base_entries = parse_sorted(base)?;
    let patch_entries = parse_sorted(patch)?;
    let mut out = Vec::with_capacity(base.len() + patch.len());
    let mut changed = Vec::new();
    for_each_field(&base_entries, &patch_entries, |field, from_base, from_patch| {
        let (bytes, run) = if clear.contains(&field) {
            (patch, &[][..])
        } else if from_patch.is_empty() {
            (base, from_base)
        } else {
            (patch, from_patch)
        };
        let same = from_base.len() == run.len()
            && from_base.iter().zip(run).all(|(x, y)| x.same_as(base, y, bytes));
        if !same {
            changed.push(field);
        }
        put_entries(&mut out, bytes, run);
    });
    Ok((out, changed))
}

/// Top-level field numbers whose entries differ between two messages (by
/// bytes of their entries), sorted ascending, deduplicated. Entries are
/// compared in their canonical encoding, so a redundant tag or varint
/// encoding alone is not a change.
pub fn changed_fields(a: &[u8], b: &[u8]) -> Result<Vec<u32>, MergeError> {
    let a_entries = parse_sorted(a)?;
    let b_entries = parse_sorted(b)?;
    let mut changed = Vec::new();
    for_each_field(&a_entries, &b_entries, |field, from_a, from_b| {
        let same = from_a.len() == from_b.len()
            && from_a.iter().zip(from_b).all(|(x, y)| x.same_as(a, y, b));
        if !same {
            changed.push(field);
        }
    });
    Ok(changed)
}

/// Field numbers present at top level (sorted, dedup).
pub fn field_numbers(bytes: &[u8]) -> Result<Vec<u32>, MergeError> {
    let mut fields: Vec<u32> = parse(bytes)?.iter().map(|e| e.field).collect();
    fields.sort_unstable();
    fields.dedup();
    Ok(fields)
}

/// Walk two field-sorted entry lists in step, calling `visit` once per field
/// number present in either, with that field's run from each side (possibly
/// empty). Field numbers are visited in ascending order.
fn for_each_field(a: &[Entry], b: &[Entry], mut visit: impl FnMut(u32, &[Entry], &[Entry])) {
    let (mut a, mut b) = (a, b);
    loop {
        let field = match (a.first(), b.first()) {
            (Some(x), Some(y)) => x.field.min(y.field),
            (Some(x), None) => x.field,
            (None, Some(y)) => y.field,
            (None, None) => return,
        };
        let (run_a, rest_a) = a.split_at(a.iter().take_while(|e| e.field == field).count());
        let (run_b, rest_b) = b.split_at(b.iter().take_while(|e| e.field == field).count());
        visit(field, run_a, run_b);
        (a, b) = (rest_a, rest_b);
    }
}

fn parse_sorted(bytes: &[u8]) -> Result<Vec<Entry>, MergeError> {
    let mut entries = parse(bytes)?;
    // Stable, so repeated entries keep their order; on already sorted input
    // (the usual case: prost writes fields in number order) this is one pass.
    entries.sort_by_key(|e| e.field);
    Ok(entries)
}

fn parse(bytes: &[u8]) -> Result<Vec<Entry>, MergeError> {
    let mut entries = Vec::with_capacity(16);
    let mut pos = 0;
    while pos < bytes.len() {
        let offset = pos;
        let tag = read_varint(bytes, &mut pos)?;
        let field = tag >> 3;
        if field == 0 || field > MAX_FIELD {
            return Err(MergeError::InvalidFieldNumber { field, offset });
        }
        // In range 1..=2^29-1 by the check above, so the cast is lossless.
        let field = field as u32;
        let wire_type = (tag & 7) as u8;
        let start = pos;
        let (wire, varint, end) = match wire_type {
            0 => (Wire::Varint, read_varint(bytes, &mut pos)?, pos),
            1 | 5 => {
                let (wire, bits) =
                    if wire_type == 1 { (Wire::Fixed64, 64) } else { (Wire::Fixed32, 32) };
                let end = start + usize::from(bits / 8);
                if end > bytes.len() {
                    return Err(MergeError::TruncatedFixed { bits, field, offset });
                }
                (wire, 0, end)
            }
            2 => {
                let len = read_varint(bytes, &mut pos)?;
                let start = pos;
                let end = usize::try_from(len)
                    .ok()
                    .and_then(|len| start.checked_add(len))
                    .filter(|&end| end <= bytes.len())
                    .ok_or(MergeError::TruncatedLengthDelimited { field, offset })?;
                entries.push(Entry { field, wire: Wire::Len, varint: 0, start, end });
                pos = end;
                continue;
            }
            _ => {
                return Err(MergeError::UnsupportedWireType { wire_type, field, offset });
            }
        };
        entries.push(Entry { field, wire, varint, start, end });
        pos = end;
    }
    Ok(entries)
}

/// Read a varint at `*pos`, advancing past it.
fn read_varint(bytes: &[u8], pos: &mut usize) -> Result<u64, MergeError> {
    let offset = *pos;
    let mut value = 0u64;
    for i in 0..MAX_VARINT_LEN {
        let Some(&byte) = bytes.get(offset + i) else {
            return Err(MergeError::TruncatedVarint { offset });
        };
        // The 10th byte carries only bit 63; anything more overflows u64.
        if i == MAX_VARINT_LEN - 1 && byte > 1 {
            return Err(MergeError::VarintTooLong { offset });
        }
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            *pos = offset + i + 1;
            return Ok(value);
        }
    }
    Err(MergeError::VarintTooLong { offset })
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_entries(out: &mut Vec<u8>, bytes: &[u8], entries: &[Entry]) {
    for e in entries {
        put_varint(out, (u64::from(e.field) << 3) | e.wire as u64);
        match e.wire {
            Wire::Varint => put_varint(out, e.varint),
            Wire::Len => {
                put_varint(out, (e.end - e.start) as u64);
                out.extend_from_slice(&bytes[e.start..e.end]);
            }
            Wire::Fixed32 | Wire::Fixed64 => out.extend_from_slice(&bytes[e.start..e.end]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MergeError::*;

    fn err(bytes: &[u8]) -> MergeError {
        let e = canonicalize(bytes).expect_err("malformed input must be rejected");
        // Every entry point validates the same way.
        assert_eq!(merge(&[], bytes, &[]), Err(e.clone()));
        assert_eq!(merge_changes(&[], bytes, &[]), Err(e.clone()));
        assert_eq!(merge_changes(bytes, &[], &[]), Err(e.clone()));
        assert_eq!(changed_fields(&[], bytes), Err(e.clone()));
        assert_eq!(field_numbers(bytes), Err(e.clone()));
        e
    }

    /// A 10-byte varint (after a tag of field 1 / varint) ending in `last`.
    fn ten_byte_varint(last: u8) -> Vec<u8> {
        let mut bytes = vec![0x08];
        bytes.extend([0xff; 9]);
        bytes.push(last);
        bytes
    }

    #[test]
    fn empty_input_is_an_empty_message() {
        assert_eq!(canonicalize(&[]), Ok(vec![]));
        assert_eq!(merge(&[], &[], &[]), Ok(vec![]));
        assert_eq!(field_numbers(&[]), Ok(vec![]));
        assert_eq!(changed_fields(&[], &[]), Ok(vec![]));
    }

    #[test]
    fn malformed_input_of_every_kind_is_rejected() {
        let mut too_big = Vec::new();
        put_varint(&mut too_big, (MAX_FIELD + 1) << 3);
        let mut huge_len = ten_byte_varint(0x01);
        huge_len[0] = 0x0a;
        let mut eleven = ten_byte_varint(0xff);
        eleven.push(0x01);
        let cases: &[(&[u8], &str)] = &[
            (&[0x88], "truncated varint at byte 0"),
            (&[0x08, 0x96], "truncated varint at byte 1"),
            (&[0x08, 0x01, 0x12], "truncated varint at byte 3"),
            (&eleven, "varint too long at byte 1"),
            (&ten_byte_varint(0x02), "varint too long at byte 1"),
            (&[0x08, 1, 0x3a, 5, b'a'], "truncated length-delimited field 7 at byte 2"),
            (&huge_len, "truncated length-delimited field 1 at byte 0"),
            (&[0x00, 0x01], "field number 0 out of range at byte 0"),
            (&too_big, "field number 536870912 out of range at byte 0"),
            (&[0x0d, 1, 2, 3], "truncated fixed32 field 1 at byte 0"),
            (&[0x08, 0, 0x11, 1, 2, 3, 4, 5, 6, 7], "truncated fixed64 field 2 at byte 2"),
        ];
        for (bytes, want) in cases {
            assert_eq!(err(bytes).to_string(), format!("malformed protobuf: {want}"));
        }
    }

    #[test]
    fn groups_and_undefined_wire_types_are_rejected() {
        for wire_type in [3u8, 4, 6, 7] {
            let e = err(&[(2 << 3) | wire_type, 0x00]);
            assert!(
                matches!(e, UnsupportedWireType { wire_type: w, field: 2, offset: 0 } if w == wire_type)
            );
        }
    }

    #[test]
    fn edge_values_are_accepted() {
        assert_eq!(canonicalize(&ten_byte_varint(0x01)), Ok(ten_byte_varint(0x01)));
        assert_eq!(canonicalize(&[0x0d, 1, 2, 3, 4]), Ok(vec![0x0d, 1, 2, 3, 4]));
        let mut max_field = Vec::new();
        put_varint(&mut max_field, MAX_FIELD << 3);
        max_field.push(0x01);
        assert_eq!(field_numbers(&max_field), Ok(vec![(1 << 29) - 1]));
    }

    #[test]
    fn tags_varints_and_lengths_are_re_encoded_minimally() {
        // Tag of field 1 / varint written 0x88 0x00, the value 1 as 0x81 0x00.
        assert_eq!(canonicalize(&[0x88, 0x00, 0x81, 0x00]), Ok(vec![0x08, 0x01]));
        // Field 2 LEN with its length 1 written 0x81 0x80 0x00.
        assert_eq!(canonicalize(&[0x12, 0x81, 0x80, 0x00, b'x']), Ok(vec![0x12, 0x01, b'x']));
        // Redundant encodings alone are not a change.
        assert_eq!(changed_fields(&[0x88, 0x00, 0x81, 0x00], &[0x08, 0x01]), Ok(vec![]));
    }

    #[test]
    fn canonicalize_sorts_stably() {
        // 3:"a", 1:5, 3:"b", 2:7  ->  1:5, 2:7, 3:"a", 3:"b"
        let bytes = [0x1a, 1, b'a', 0x08, 5, 0x1a, 1, b'b', 0x10, 7];
        let want = [0x08, 5, 0x10, 7, 0x1a, 1, b'a', 0x1a, 1, b'b'];
        assert_eq!(canonicalize(&bytes), Ok(want.to_vec()));
    }

    #[test]
    fn merge_replaces_repeated_whole_and_clears() {
        // base: 1:1, 7:"a", 7:"b", 8:"z"; patch: 7:"c"; clear 8.
        let base = [0x08, 1, 0x3a, 1, b'a', 0x3a, 1, b'b', 0x42, 1, b'z'];
        let patch = [0x3a, 1, b'c'];
        assert_eq!(merge(&base, &patch, &[8]), Ok(vec![0x08, 1, 0x3a, 1, b'c']));
        assert_eq!(changed_fields(&base, &patch), Ok(vec![1, 7, 8]));
        assert_eq!(field_numbers(&base), Ok(vec![1, 7, 8]));
    }
}

//! The few pieces of protobuf's wire format ingest writes by hand: the very
//! bytes `prost::encoding` writes, inlined (nearly every varint here is one
//! byte, and a call per varint was a large share of writing a command).

pub(super) use prost::encoding::encoded_len_varint as varint_len;

const VARINT: u64 = 0;
const LEN: u64 = 2;

#[inline]
pub(super) fn varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push(value as u8 | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

/// A varint field (`int64`, `int32`, `uint32`, enum): negative numbers take
/// ten bytes, as in prost.
#[inline]
pub(super) fn int(buf: &mut Vec<u8>, number: u32, value: i64) {
    varint(buf, u64::from(number) << 3 | VARINT);
    varint(buf, value as u64);
}

/// A length-delimited field's key and length; its bytes follow.
#[inline]
pub(super) fn len(buf: &mut Vec<u8>, number: u32, len: usize) {
    varint(buf, u64::from(number) << 3 | LEN);
    varint(buf, len as u64);
}

/// A length-delimited field (string, bytes).
#[inline]
pub(super) fn bytes(buf: &mut Vec<u8>, number: u32, bytes: &[u8]) {
    len(buf, number, bytes.len());
    buf.extend_from_slice(bytes);
}

/// Bytes a varint field takes.
#[inline]
pub(super) fn int_len(number: u32, value: i64) -> usize {
    varint_len(u64::from(number) << 3) + varint_len(value as u64)
}

/// Bytes a length-delimited field of `len` bytes takes.
#[inline]
pub(super) fn bytes_len(number: u32, len: usize) -> usize {
    varint_len(u64::from(number) << 3) + varint_len(len as u64) + len
}

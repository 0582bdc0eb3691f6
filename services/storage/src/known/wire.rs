//! The protobuf wire format as the walk of a command message reads it
//! (`super::scan`): a cursor that reads exactly what prost would, and gives
//! up on anything else.

use std::ops::Range;

/// A protobuf cursor that gives up (`None`) on anything it does not read
/// exactly as prost.
pub(super) struct Wire<'a> {
    buf: &'a [u8],
    at: usize,
}

/// Wire types read (groups and the rest are left to prost).
pub(super) const VARINT: u8 = 0;
const FIXED64: u8 = 1;
pub(super) const LEN: u8 = 2;
const FIXED32: u8 = 5;

impl<'a> Wire<'a> {
    pub(super) fn new(buf: &'a [u8], at: usize) -> Self {
        Wire { buf, at }
    }

    pub(super) fn done(&self) -> bool {
        self.at >= self.buf.len()
    }

    /// A varint as prost reads one: at most ten bytes, the tenth at most 1.
    pub(super) fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = *self.buf.get(self.at)?;
            self.at += 1;
            if i == 9 && b > 1 {
                return None;
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    /// A field's number and wire type.
    pub(super) fn key(&mut self) -> Option<(u32, u8)> {
        let key = self.varint()?;
        let number = u32::try_from(key >> 3).ok().filter(|&n| n > 0)?;
        Some((number, (key & 7) as u8))
    }

    /// The range of a length-delimited field's bytes.
    pub(super) fn len(&mut self) -> Option<Range<usize>> {
        let n = usize::try_from(self.varint()?).ok()?;
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len())?;
        let range = self.at..end;
        self.at = end;
        Some(range)
    }

    /// Skips a field of an unknown number.
    pub(super) fn skip(&mut self, wire: u8) -> Option<()> {
        let n = match wire {
            VARINT => return self.varint().map(drop),
            FIXED64 => 8,
            LEN => return self.len().map(drop),
            FIXED32 => 4,
            _ => return None,
        };
        self.at = self.at.checked_add(n).filter(|&e| e <= self.buf.len())?;
        Some(())
    }

    /// Skips any field, groups (deprecated, but prost skips them) included,
    /// nested at most as deep as prost allows.
    pub(super) fn skip_any(&mut self, number: u32, wire: u8, depth: u32) -> Option<()> {
        const START_GROUP: u8 = 3;
        const END_GROUP: u8 = 4;
        if wire != START_GROUP {
            return self.skip(wire);
        }
        if depth >= 100 {
            return None;
        }
        loop {
            match self.key()? {
                (n, END_GROUP) if n == number => return Some(()),
                (_, END_GROUP) => return None,
                (n, w) => self.skip_any(n, w, depth + 1)?,
            }
        }
    }

    /// The `uint32` values of one occurrence of a repeated field, packed or
    /// not, appended to `out`.
    pub(super) fn uint32s(&mut self, wire: u8, out: &mut Vec<u32>) -> Option<()> {
        match wire {
            VARINT => out.push(self.varint()? as u32),
            LEN => {
                let range = self.len()?;
                let mut inner = Wire::new(&self.buf[..range.end], range.start);
                while !inner.done() {
                    out.push(inner.varint()? as u32);
                }
            }
            _ => return None,
        }
        Some(())
    }
}

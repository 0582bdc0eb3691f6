//! The reader under serde_json's buffer for the nested format: counts and
//! caps what serde_json is given, and moves each `places` array that comes
//! before `brand_id` to a temporary file (the spool) until the brand is
//! checked.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io::{self, Read, Write};
use std::rc::Rc;

use super::cut::{Cut, Cuts};
use super::keys::{Key, SCAN_KEY_BYTES, TopAt};

/// What the parser shares with the reader under serde_json's buffer: how
/// many bytes serde_json was given, the hard cap armed while one value is
/// read whole (serde_json buffers a raw item or a key whole, so a 1 GB one
/// must be cut off by the reader before it is in memory), and the spool.
#[derive(Default)]
pub(super) struct ReadState {
    pub(super) read: Cell<u64>,
    /// While armed: the byte count not to read past, and what is being read.
    pub(super) cap: Cell<Option<(u64, &'static str)>>,
    /// What was being read when the cap was hit.
    pub(super) tripped: Cell<Option<&'static str>>,
    pub(super) spool: RefCell<Option<Spool>>,
    /// Items are cut out of the document under serde_json ([`Cut`]).
    pub(super) cutting: bool,
    pub(super) cuts: RefCell<Cuts>,
}

impl ReadState {
    /// Arms the cap: `what` may take up to `bytes` more of the input.
    pub(super) fn arm(&self, what: &'static str, bytes: u64) {
        self.cap.set(Some((self.read.get() + bytes, what)));
    }

    pub(super) fn disarm(&self) {
        self.cap.set(None);
    }
}

/// `places` arrays that came before `brand_id`, one a line, in document order.
pub(super) struct Spool {
    pub(super) file: File,
    pub(super) arrays: usize,
}

impl Spool {
    pub(super) fn write(
        spool: &RefCell<Option<Spool>>,
        bytes: &[u8],
        last: bool,
    ) -> io::Result<()> {
        let mut spool = spool.borrow_mut();
        let spool = match &mut *spool {
            Some(spool) => spool,
            None => {
                spool.insert(Spool { file: tempfile::tempfile().map_err(spool_error)?, arrays: 0 })
            }
        };
        spool.file.write_all(bytes).map_err(spool_error)?;
        if last {
            spool.file.write_all(b"\n").map_err(spool_error)?;
            spool.arrays += 1;
        }
        Ok(())
    }
}

pub(super) fn spool_error(e: io::Error) -> io::Error {
    let detail = format!(
        "`places` comes before `brand_id`, so it is kept in a temporary file until the brand is \
         checked, and that file failed (is TMPDIR full?): {e}"
    );
    io::Error::new(e.kind(), detail)
}

/// The reader under serde_json's `BufReader` (which keeps std's fast
/// one-byte reads): counts and caps what serde_json is given and, until the
/// top-level `brand_id` key has gone by, watches the top level of the
/// document ([`Scan`]) to move each `places` array that comes before it into
/// the spool; serde_json gets `[]` in its place. Once `brand_id` shows up
/// first (the usual order) the bytes pass through that watch untouched.
/// Then, in the document (not in a spooled copy), each item is cut out of
/// what serde_json is given ([`Cut`]).
pub(super) struct Intake<R> {
    pub(super) inner: R,
    pub(super) state: Rc<ReadState>,
    pub(super) scan: Option<Scan>,
    pub(super) cut: Option<Cut>,
}

impl<R: Read> Read for Intake<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let state = &self.state;
        if let Some((limit, what)) = state.cap.get()
            && state.read.get() > limit
        {
            state.tripped.set(Some(what));
            return Err(io::Error::new(io::ErrorKind::InvalidData, "over the hard size cap"));
        }
        if self.cut.as_ref().is_some_and(Cut::over) {
            // Not a byte more: the walk fails on the item that went over.
            return Err(io::Error::new(io::ErrorKind::InvalidData, "over the hard size cap"));
        }
        loop {
            let n = self.inner.read(buf)?;
            let kept = match &mut self.scan {
                Some(scan) if n > 0 => {
                    let (kept, done) = scan.filter(&mut buf[..n], &state.spool)?;
                    if done {
                        self.scan = None;
                    }
                    kept
                }
                _ => n,
            };
            let kept = match &mut self.cut {
                Some(cut) if n == 0 => cut.finish(buf, &mut state.cuts.borrow_mut()),
                Some(cut) => cut.filter(&mut buf[..kept], &mut state.cuts.borrow_mut()),
                None => kept,
            };
            state.read.set(state.read.get() + kept as u64);
            // A read that went to the spool or to the cuts whole is not the
            // end of the feed.
            if kept > 0 || n == 0 {
                return Ok(kept);
            }
        }
    }
}

/// The top level of the document, byte by byte: strings, nesting, and the
/// keys of the top-level object, for as long as [`Intake`] must watch.
/// Strings and bracket balance are all it checks; serde_json parses the
/// document (with `[]` for each spooled array) and then each spooled array
/// in full, so a malformed feed fails there as it would have anyway.
#[derive(Default)]
pub(super) struct Scan {
    pub(super) started: bool,
    pub(super) depth: u64,
    pub(super) in_string: bool,
    pub(super) escaped: bool,
    pub(super) at: TopAt,
    /// The top-level key being read (with its quotes), and the last one read.
    pub(super) key: Option<Vec<u8>>,
    pub(super) last_key: Option<Key>,
    /// Nesting inside the `places` array being spooled (0: none).
    pub(super) spooling: u64,
    pub(super) spooled: usize,
}

impl Scan {
    /// Filters `buf` in place: the bytes serde_json gets are moved to the
    /// front; returns their count and whether the watch is over.
    pub(super) fn filter(
        &mut self,
        buf: &mut [u8],
        spool: &RefCell<Option<Spool>>,
    ) -> io::Result<(usize, bool)> {
        // `buf[from..i]` is the run (kept or spooled) not yet moved or written.
        let (mut out, mut from) = (0, 0);
        let keep = |buf: &mut [u8], out: &mut usize, range: std::ops::Range<usize>| {
            let len = range.len();
            buf.copy_within(range, *out);
            *out += len;
        };
        for i in 0..buf.len() {
            let b = buf[i];
            if self.spooling > 0 {
                if self.string_byte(b) {
                    continue;
                }
                match b {
                    b'"' => self.in_string = true,
                    b'[' | b'{' => self.spooling += 1,
                    b']' | b'}' => {
                        self.spooling -= 1;
                        if self.spooling == 0 {
                            // The closing bracket ends the copy and is kept:
                            // serde_json reads `[]`.
                            Spool::write(spool, &buf[from..=i], true)?;
                            self.spooled += 1;
                            buf[out] = b;
                            (out, from) = (out + 1, i + 1);
                        }
                    }
                    _ => {}
                }
                continue;
            }
            if self.string_byte(b) {
                if let Some(key) = &mut self.key {
                    if key.len() <= SCAN_KEY_BYTES {
                        key.push(b);
                    }
                    if !self.in_string {
                        let key = self.key.take().unwrap_or_default();
                        let name = serde_json::from_slice::<String>(&key).ok();
                        let key = match name.as_deref() {
                            Some("brand_id") => Key::BrandId,
                            Some("places") => Key::Places,
                            _ => Key::Other,
                        };
                        (self.last_key, self.at) = (Some(key), TopAt::Colon);
                        if key == Key::BrandId && self.spooled == 0 {
                            // The brand comes first: nothing to move, ever.
                            keep(buf, &mut out, from..buf.len());
                            return Ok((out, true));
                        }
                    }
                }
                continue;
            }
            match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b'{' if !self.started => (self.started, self.depth) = (true, 1),
                _ if !self.started => {
                    // Not an object: serde_json says so.
                    keep(buf, &mut out, from..buf.len());
                    return Ok((out, true));
                }
                b'"' => {
                    self.in_string = true;
                    if self.depth == 1 && self.at == TopAt::Key {
                        self.key = Some(vec![b]);
                    }
                }
                b'[' if self.depth == 1
                    && self.at == TopAt::Value
                    && self.last_key == Some(Key::Places) =>
                {
                    // `places` before `brand_id`: serde_json gets the `[`,
                    // the spool gets the array, from this `[` on.
                    keep(buf, &mut out, from..i + 1);
                    from = i;
                    (self.spooling, self.at) = (1, TopAt::Comma);
                }
                b'[' | b'{' => self.depth += 1,
                b']' | b'}' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        // The top-level object is closed.
                        keep(buf, &mut out, from..buf.len());
                        return Ok((out, true));
                    }
                }
                b':' if self.depth == 1 => self.at = TopAt::Value,
                b',' if self.depth == 1 => (self.at, self.last_key) = (TopAt::Key, None),
                _ => {}
            }
        }
        if self.spooling > 0 {
            Spool::write(spool, &buf[from..], false)?;
        } else {
            keep(buf, &mut out, from..buf.len());
        }
        Ok((out, false))
    }

    /// Follows a byte inside a string; false when not in one (the byte is
    /// not consumed).
    pub(super) fn string_byte(&mut self, b: u8) -> bool {
        if !self.in_string {
            return false;
        }
        match b {
            _ if self.escaped => self.escaped = false,
            b'\\' => self.escaped = true,
            b'"' => self.in_string = false,
            _ => {}
        }
        true
    }
}

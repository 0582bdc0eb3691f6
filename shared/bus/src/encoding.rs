//! Compressed payloads: a producer may send a message's protobuf bytes
//! compressed, saying so in [`ENCODING_HEADER`]; a consumer reads either.
//!
//! The one encoding is `lz4`: an LZ4 block (`lz4_flex`'s block format)
//! after the length of the bytes it holds, a little-endian `u32`. A message
//! without the header is plain protobuf, so producers that never compress
//! (validators, the CLI, older versions) are read as before.

use async_nats::HeaderMap;
use bytes::Bytes;
use shelfsync_settings::Compression;

/// Header naming how the payload is encoded (absent: plain protobuf).
pub const ENCODING_HEADER: &str = "Shelfsync-Encoding";

/// The value of [`ENCODING_HEADER`] for an LZ4 block after its length.
pub const LZ4: &str = "lz4";

/// No decoded payload is larger than this, whatever its length prefix says
/// (a reader may set a lower limit: [`decode_within`]).
pub const MAX_DECODED_BYTES: usize = 64 * 1024 * 1024;

/// Why a payload cannot be decoded.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum EncodingError {
    #[error("unknown {ENCODING_HEADER} {0:?} (known: {LZ4})")]
    Unknown(String),
    #[error("{LZ4} payload of {0} bytes is too short for its length prefix")]
    Short(usize),
    #[error("{LZ4} payload says it holds {0} bytes, more than the {1} allowed")]
    TooLarge(usize, usize),
    #[error("corrupt {LZ4} payload: {0}")]
    Corrupt(String),
}

/// `raw` as an `lz4` payload.
pub fn compress(raw: &[u8]) -> Vec<u8> {
    lz4_flex::block::compress_prepend_size(raw)
}

/// `raw` encoded for the wire as `compression` says, with the headers that
/// say so (none for plain protobuf); [`decode`] reads it back.
pub fn encode(compression: Compression, raw: Vec<u8>) -> (Bytes, Option<HeaderMap>) {
    match compression {
        Compression::None => (Bytes::from(raw), None),
        Compression::Lz4 => {
            let mut headers = HeaderMap::new();
            headers.insert(ENCODING_HEADER, LZ4);
            (Bytes::from(compress(&raw)), Some(headers))
        }
    }
}

/// The plain bytes of a payload encoded as `headers` say: the payload
/// itself (not copied) when it is plain. Decode protobuf from the `Bytes`
/// (not a slice of it): prost then copies each `bytes` field once, not twice.
pub fn decode(headers: Option<&HeaderMap>, payload: &Bytes) -> Result<Bytes, EncodingError> {
    decode_within(headers, payload, MAX_DECODED_BYTES)
}

/// [`decode`] refusing, before allocating anything, a payload that says it
/// holds more than `max` bytes once decoded (a plain payload is what the
/// server let through: its own limit holds it).
pub fn decode_within(
    headers: Option<&HeaderMap>,
    payload: &Bytes,
    max: usize,
) -> Result<Bytes, EncodingError> {
    match encoding_of(headers) {
        None => Ok(payload.clone()),
        Some(LZ4) => decompress(payload, max.min(MAX_DECODED_BYTES)).map(Bytes::from),
        Some(other) => Err(EncodingError::Unknown(other.to_string())),
    }
}

/// The encoding `headers` name (`None`: plain protobuf).
pub fn encoding_of(headers: Option<&HeaderMap>) -> Option<&str> {
    headers.and_then(|h| h.get(ENCODING_HEADER)).map(|v| v.as_str())
}

fn decompress(payload: &[u8], max: usize) -> Result<Vec<u8>, EncodingError> {
    let Some((len, block)) = payload.split_first_chunk::<4>() else {
        return Err(EncodingError::Short(payload.len()));
    };
    let len = u32::from_le_bytes(*len) as usize;
    if len > max {
        return Err(EncodingError::TooLarge(len, max));
    }
    let mut out = vec![0; len];
    match lz4_flex::block::decompress_into(block, &mut out) {
        Ok(n) if n == len => Ok(out),
        Ok(n) => Err(EncodingError::Corrupt(format!("holds {n} bytes, not the {len} it says"))),
        Err(e) => Err(EncodingError::Corrupt(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lz4_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(ENCODING_HEADER, LZ4);
        h
    }

    #[test]
    fn round_trips_and_reads_plain_payloads_as_they_are() {
        let raw: Vec<u8> = (0..50_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        let packed = compress(&raw);
        assert!(packed.len() < raw.len() / 2, "{} of {}", packed.len(), raw.len());
        let (raw, packed) = (Bytes::from(raw), Bytes::from(packed));
        assert_eq!(decode(Some(&lz4_headers()), &packed).unwrap(), raw);
        // Plain: the same buffer, not a copy.
        assert_eq!(decode(None, &raw).unwrap().as_ptr(), raw.as_ptr());
        assert_eq!(decode(Some(&HeaderMap::new()), &raw).unwrap().as_ptr(), raw.as_ptr());
        assert_eq!(decode(Some(&lz4_headers()), &compress(b"").into()).unwrap(), &b""[..]);
        // What `encode` sends, `decode` reads back; `none` sends the bytes as they are.
        let (sent, headers) = encode(Compression::Lz4, raw.to_vec());
        assert!(sent.len() < raw.len() / 2);
        assert_eq!(decode(headers.as_ref(), &sent).unwrap(), raw);
        let (sent, headers) = encode(Compression::None, raw.to_vec());
        assert!(headers.is_none());
        assert_eq!(sent, raw);
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        let mut zstd = HeaderMap::new();
        zstd.insert(ENCODING_HEADER, "zstd");
        let b = |v: &[u8]| Bytes::copy_from_slice(v);
        assert_eq!(decode(Some(&zstd), &b(b"x")), Err(EncodingError::Unknown("zstd".into())));
        let h = lz4_headers();
        assert_eq!(decode(Some(&h), &b(b"ab")), Err(EncodingError::Short(2)));
        // A length prefix claiming 4 GiB is refused before anything is allocated.
        let huge = b(&[255, 255, 255, 255, 0]);
        let too_large = EncodingError::TooLarge(u32::MAX as usize, MAX_DECODED_BYTES);
        assert_eq!(decode(Some(&h), &huge), Err(too_large));
        // A reader's own limit is checked the same way, before anything is allocated.
        let packed = b(&compress(&[7u8; 10_000]));
        assert_eq!(
            decode_within(Some(&h), &packed, 9_999),
            Err(EncodingError::TooLarge(10_000, 9_999))
        );
        assert_eq!(decode_within(Some(&h), &packed, 10_000).map(|d| d.len()), Ok(10_000));
        let mut packed = compress(&[7u8; 10_000]);
        // Says one byte more than the block holds.
        packed[..4].copy_from_slice(&10_001u32.to_le_bytes());
        assert!(matches!(decode(Some(&h), &b(&packed)), Err(EncodingError::Corrupt(_))));
        let packed = compress(b"some bytes that do not repeat much, 0123456789");
        let cut = b(&packed[..packed.len() - 3]);
        assert!(matches!(decode(Some(&h), &cut), Err(EncodingError::Corrupt(_))));
    }
}

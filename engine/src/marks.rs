//! Two small files beside a shard's segments that let recovery tell what a
//! scan of the segments alone cannot (`docs/internals/storage-format.md`).
//!
//! * `tail.mark` — the base offset of the newest segment the log has rolled
//!   to, rewritten (atomically) at each roll, and written at the first open.
//!   Retention removes only older segments, so the newest segment file is
//!   never older than the mark: if it is, or none is left, segment files
//!   were lost, and opening the shard would give their offsets out again.
//! * `clean.mark` — where the log ended when it was last closed cleanly
//!   (everything flushed, the reservation released). No write can have been
//!   torn since, so damage to the last batches is damage, not a torn write,
//!   and a log that ends anywhere else has lost records. Recovery removes it
//!   (durably) before the log takes a write.
//!
//! Each is a magic, little-endian `u64` fields and a CRC32C of both. One
//! written with the wrong magic, length or checksum is damage: recovery
//! refuses the shard rather than guess.

use crate::types::Offset;

pub(crate) const TAIL_MARK: &str = "tail.mark";
pub(crate) const CLEAN_MARK: &str = "clean.mark";

const TAIL_MAGIC: &[u8; 8] = b"FXTAIL01";
const CLEAN_MAGIC: &[u8; 8] = b"FXCLEAN1";

/// Where a cleanly closed log ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Clean {
    /// The log's end offset.
    pub end: Offset,
    /// Base offset of its newest segment.
    pub tail_base: Offset,
    /// Bytes of data in that segment.
    pub tail_len: u64,
}

fn encode<const N: usize>(magic: &[u8; 8], fields: [u64; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 8 * N + 4);
    out.extend_from_slice(magic);
    for f in fields {
        out.extend_from_slice(&f.to_le_bytes());
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn decode<const N: usize>(magic: &[u8; 8], bytes: &[u8]) -> Option<[u64; N]> {
    if bytes.len() != 8 + 8 * N + 4 || &bytes[..8] != magic {
        return None;
    }
    let (body, crc) = bytes.split_at(8 + 8 * N);
    if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().ok()?) {
        return None;
    }
    let mut fields = [0u64; N];
    for (i, f) in fields.iter_mut().enumerate() {
        let at = 8 + 8 * i;
        *f = u64::from_le_bytes(body[at..at + 8].try_into().ok()?);
    }
    Some(fields)
}

pub(crate) fn encode_tail(newest: Offset) -> Vec<u8> {
    encode(TAIL_MAGIC, [newest.0])
}

pub(crate) fn decode_tail(bytes: &[u8]) -> Option<Offset> {
    decode::<1>(TAIL_MAGIC, bytes).map(|[b]| Offset(b))
}

pub(crate) fn encode_clean(c: Clean) -> Vec<u8> {
    encode(CLEAN_MAGIC, [c.end.0, c.tail_base.0, c.tail_len])
}

pub(crate) fn decode_clean(bytes: &[u8]) -> Option<Clean> {
    decode::<3>(CLEAN_MAGIC, bytes).map(|[end, tail_base, tail_len]| Clean {
        end: Offset(end),
        tail_base: Offset(tail_base),
        tail_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_round_trip_and_refuse_any_damage() {
        let t = encode_tail(Offset(123_456));
        assert_eq!(decode_tail(&t), Some(Offset(123_456)));
        let c = Clean {
            end: Offset(9),
            tail_base: Offset(4),
            tail_len: 4096 + 17,
        };
        let e = encode_clean(c);
        assert_eq!(decode_clean(&e), Some(c));
        // Every flipped bit, every cut, and the other kind's bytes.
        for bytes in [&t, &e] {
            for i in 0..bytes.len() * 8 {
                let mut b = bytes.clone();
                b[i / 8] ^= 1 << (i % 8);
                assert_eq!(decode_tail(&b), None);
                assert_eq!(decode_clean(&b), None);
            }
            for n in 0..bytes.len() {
                assert_eq!(decode_tail(&bytes[..n]), None);
                assert_eq!(decode_clean(&bytes[..n]), None);
            }
        }
        assert_eq!(decode_tail(&e), None);
        assert_eq!(decode_clean(&t), None);
    }
}

//! Primitive encoders and a bounds-checked reader.
//!
//! Everything is fixed-width little-endian. Strings are `u16 len + UTF-8`,
//! byte blobs `u32 len + bytes`, optional fields a presence byte (0 or 1)
//! followed by the value when present, vectors a `u32` count followed by the
//! elements.
//!
//! The reader is the only place that touches untrusted lengths, so it is the
//! only place that has to get the "check before allocating" rule right.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::DecodeError;

type Result<T> = std::result::Result<T, DecodeError>;

/// Minimum wire sizes, used to bound element counts (see [`Reader::vec`]).
pub(crate) const U8: usize = 1;
pub(crate) const U16: usize = 2;
pub(crate) const U32: usize = 4;
pub(crate) const U64: usize = 8;
/// A presence byte with nothing after it.
pub(crate) const OPT: usize = 1;
/// An empty string: just its `u16` length.
pub(crate) const STR: usize = 2;
/// An empty blob: just its `u32` length.
pub(crate) const BLOB: usize = 4;
/// An empty vector: just its `u32` count.
pub(crate) const VEC: usize = 4;

/// A type with a fixed place in message bodies.
pub(crate) trait Wire: Sized {
    /// The fewest bytes any value of this type occupies. Must be a true lower
    /// bound (an overestimate would reject valid input) and at least 1 (so a
    /// hostile count cannot make the decoder spin without consuming bytes).
    const MIN_BYTES: usize;
    fn put(&self, out: &mut BytesMut);
    fn get(r: &mut Reader) -> Result<Self>;
}

pub(crate) fn put_bool(out: &mut BytesMut, v: bool) {
    out.put_u8(v as u8);
}

/// Longest string the `u16` length can describe, cut back to a character
/// boundary. Encoding is infallible, so over-long text (an error message, a
/// dead-letter reason) is truncated rather than refused; names are limited to
/// 128 bytes by the broker long before this matters.
pub(crate) fn put_str(out: &mut BytesMut, s: &str) {
    let mut end = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.put_u16_le(end as u16);
    out.put_slice(&s.as_bytes()[..end]);
}

/// # Panics
/// If `b` is 4 GiB or more, which no frame could carry anyway.
pub(crate) fn put_blob(out: &mut BytesMut, b: &[u8]) {
    let len = u32::try_from(b.len()).expect("felix-wire: blob of 4 GiB or more cannot be encoded");
    out.put_u32_le(len);
    out.put_slice(b);
}

pub(crate) fn put_opt<T>(out: &mut BytesMut, v: Option<&T>, f: impl FnOnce(&mut BytesMut, &T)) {
    match v {
        None => out.put_u8(0),
        Some(v) => {
            out.put_u8(1);
            f(out, v);
        }
    }
}

pub(crate) fn put_opt_u32(out: &mut BytesMut, v: Option<u32>) {
    put_opt(out, v.as_ref(), |o, v| o.put_u32_le(*v));
}

pub(crate) fn put_opt_u64(out: &mut BytesMut, v: Option<u64>) {
    put_opt(out, v.as_ref(), |o, v| o.put_u64_le(*v));
}

pub(crate) fn put_opt_str(out: &mut BytesMut, v: Option<&String>) {
    put_opt(out, v, |o, v| put_str(o, v));
}

pub(crate) fn put_opt_blob(out: &mut BytesMut, v: Option<&Bytes>) {
    put_opt(out, v, |o, v| put_blob(o, v));
}

/// # Panics
/// If the vector has 2^32 or more elements.
pub(crate) fn put_vec<T>(out: &mut BytesMut, items: &[T], mut f: impl FnMut(&mut BytesMut, &T)) {
    let n = u32::try_from(items.len())
        .expect("felix-wire: vector of 2^32 or more elements cannot be encoded");
    out.put_u32_le(n);
    for item in items {
        f(out, item);
    }
}

pub(crate) fn put_wire_vec<T: Wire>(out: &mut BytesMut, items: &[T]) {
    put_vec(out, items, |o, v| v.put(o));
}

/// Reads a message body out of a frozen frame. Blob fields are `slice`s of
/// the frame, so payloads share the receive buffer instead of being copied.
pub(crate) struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    pub(crate) fn new(buf: Bytes) -> Reader {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The bytes not read yet.
    pub(crate) fn rest(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    /// `start..end` of [`rest`](Reader::rest), sharing the frame.
    pub(crate) fn slice_rest(&self, start: usize, end: usize) -> Bytes {
        self.buf.slice(self.pos + start..self.pos + end)
    }

    /// Skip `n` bytes of [`rest`](Reader::rest), which the caller checked.
    pub(crate) fn advance(&mut self, n: usize) {
        debug_assert!(n <= self.remaining());
        self.pos = (self.pos + n).min(self.buf.len());
    }

    /// Fails with [`DecodeError::TrailingBytes`] unless everything was read.
    pub(crate) fn finish(&self) -> Result<()> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes)
        }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8]> {
        if n > self.remaining() {
            return Err(DecodeError::Truncated { what });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn bool(&mut self, what: &'static str) -> Result<bool> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::BadValue { what }),
        }
    }

    pub(crate) fn string(&mut self, what: &'static str) -> Result<String> {
        let len = self.u16(what)? as usize;
        // `take` checks the length against the bytes left before the copy
        // into a fresh String allocates.
        let raw = self.take(len, what)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(DecodeError::BadUtf8 { what }),
        }
    }

    pub(crate) fn blob(&mut self, what: &'static str) -> Result<Bytes> {
        let len = self.u32(what)? as usize;
        if len > self.remaining() {
            return Err(DecodeError::Truncated { what });
        }
        let b = self.buf.slice(self.pos..self.pos + len);
        self.pos += len;
        Ok(b)
    }

    pub(crate) fn opt<T>(
        &mut self,
        what: &'static str,
        f: impl FnOnce(&mut Reader) -> Result<T>,
    ) -> Result<Option<T>> {
        if self.bool(what)? {
            f(self).map(Some)
        } else {
            Ok(None)
        }
    }

    pub(crate) fn opt_u32(&mut self, what: &'static str) -> Result<Option<u32>> {
        self.opt(what, |r| r.u32(what))
    }

    pub(crate) fn opt_u64(&mut self, what: &'static str) -> Result<Option<u64>> {
        self.opt(what, |r| r.u64(what))
    }

    pub(crate) fn opt_string(&mut self, what: &'static str) -> Result<Option<String>> {
        self.opt(what, |r| r.string(what))
    }

    pub(crate) fn opt_blob(&mut self, what: &'static str) -> Result<Option<Bytes>> {
        self.opt(what, |r| r.blob(what))
    }

    /// A `u32` count followed by that many elements of at least
    /// `min_item_bytes` each. The count is checked against the bytes left
    /// *before* the vector is allocated, so a frame claiming a billion
    /// records in ten bytes fails here instead of reserving gigabytes, and
    /// the loop below runs at most `remaining / min_item_bytes` times.
    pub(crate) fn vec<T>(
        &mut self,
        what: &'static str,
        min_item_bytes: usize,
        mut item: impl FnMut(&mut Reader) -> Result<T>,
    ) -> Result<Vec<T>> {
        debug_assert!(min_item_bytes >= 1);
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_item_bytes.max(1)) > self.remaining() {
            return Err(DecodeError::Truncated { what });
        }
        // An element in memory is larger than its smallest encoding (a
        // `RecordIn` is ~100 bytes, its minimum encoding ~15), so the count
        // is capped too: a frame of empty elements cannot make the decoder
        // allocate many times the frame's size.
        if n > crate::MAX_ITEMS_PER_VEC {
            return Err(DecodeError::TooMany {
                what,
                count: n,
                max: crate::MAX_ITEMS_PER_VEC,
            });
        }
        // Exact: the checks above bound `n` by the bytes left and the cap,
        // and doubling would leave up to half the vector unused.
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(item(self)?);
        }
        Ok(v)
    }

    pub(crate) fn wire_vec<T: Wire>(&mut self, what: &'static str) -> Result<Vec<T>> {
        self.vec(what, T::MIN_BYTES, T::get)
    }
}

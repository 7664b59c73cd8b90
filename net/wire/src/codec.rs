//! Primitive encoders and a bounds-checked reader.
//!
//! Everything is fixed-width little-endian. Strings are `u16 len + UTF-8`,
//! byte blobs `u32 len + bytes`, optional fields a presence byte (0 or 1)
//! followed by the value when present, vectors a `u32` count followed by the
//! elements.
//!
//! [`Cursor`] is the only place that reads untrusted lengths and counts, so
//! it is the only place that has to get the "check before allocating" rule
//! right; [`Reader`] and the publish view (`publish.rs`) read through it.

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

/// Reads borrowed bytes: every length and count read from untrusted input
/// is checked here, against the bytes left, before anything uses it.
/// [`Reader`] wraps one to decode message bodies; a publish's records are
/// checked with one in place (`publish.rs`).
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Cursor<'a> {
        Cursor { buf, pos: 0 }
    }

    /// Bytes read so far.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8]> {
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

    /// A `u16` length and that many bytes of UTF-8.
    pub(crate) fn str(&mut self, what: &'static str) -> Result<&'a str> {
        let len = self.u16(what)? as usize;
        std::str::from_utf8(self.take(len, what)?).map_err(|_| DecodeError::BadUtf8 { what })
    }

    /// A `u32` length and that many bytes.
    pub(crate) fn blob(&mut self, what: &'static str) -> Result<&'a [u8]> {
        let len = self.u32(what)? as usize;
        self.take(len, what)
    }

    /// A vector's `u32` count of elements of at least `min_item_bytes`
    /// each. The count is checked against the bytes left *before* anything
    /// is allocated for it, so a frame claiming a billion records in ten
    /// bytes fails here instead of reserving gigabytes, and a loop over the
    /// elements runs at most `remaining / min_item_bytes` times. It is
    /// capped too (an element in memory is larger than its smallest
    /// encoding), so a frame of empty elements cannot make a decoder
    /// allocate many times the frame's size.
    pub(crate) fn count(&mut self, what: &'static str, min_item_bytes: usize) -> Result<usize> {
        debug_assert!(min_item_bytes >= 1);
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_item_bytes.max(1)) > self.remaining() {
            return Err(DecodeError::Truncated { what });
        }
        if n > crate::MAX_ITEMS_PER_VEC {
            return Err(DecodeError::TooMany {
                what,
                count: n,
                max: crate::MAX_ITEMS_PER_VEC,
            });
        }
        Ok(n)
    }
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

    /// Fails with [`DecodeError::TrailingBytes`] unless everything was read.
    pub(crate) fn finish(&self) -> Result<()> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes)
        }
    }

    /// Run `f` over a [`Cursor`] of the bytes not read yet; what it read is
    /// read. Returns what `f` did and where in the frame it started.
    pub(crate) fn with_cursor<T>(
        &mut self,
        f: impl FnOnce(&mut Cursor<'_>) -> Result<T>,
    ) -> Result<(T, usize)> {
        let start = self.pos;
        let mut c = Cursor::new(&self.buf[start..]);
        let out = f(&mut c);
        self.pos = start + c.pos;
        out.map(|t| (t, start))
    }

    /// `start..end` of the frame, sharing it.
    pub(crate) fn slice(&self, start: usize, end: usize) -> Bytes {
        debug_assert!(start <= end && end <= self.pos, "a slice of what was read");
        self.buf.slice(start..end)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8> {
        Ok(self.with_cursor(|c| c.u8(what))?.0)
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16> {
        Ok(self.with_cursor(|c| c.u16(what))?.0)
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(self.with_cursor(|c| c.u32(what))?.0)
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(self.with_cursor(|c| c.u64(what))?.0)
    }

    pub(crate) fn bool(&mut self, what: &'static str) -> Result<bool> {
        Ok(self.with_cursor(|c| c.bool(what))?.0)
    }

    pub(crate) fn string(&mut self, what: &'static str) -> Result<String> {
        // The length is checked against the bytes left before the copy into
        // a fresh String allocates.
        Ok(self.with_cursor(|c| c.str(what).map(str::to_owned))?.0)
    }

    pub(crate) fn blob(&mut self, what: &'static str) -> Result<Bytes> {
        let (len, start) = self.with_cursor(|c| c.blob(what).map(<[u8]>::len))?;
        // After the `u32` length.
        let at = start + U32;
        Ok(self.buf.slice(at..at + len))
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
    /// `min_item_bytes` each, the count checked as [`Cursor::count`] checks
    /// it before the vector is allocated.
    pub(crate) fn vec<T>(
        &mut self,
        what: &'static str,
        min_item_bytes: usize,
        mut item: impl FnMut(&mut Reader) -> Result<T>,
    ) -> Result<Vec<T>> {
        let (n, _) = self.with_cursor(|c| c.count(what, min_item_bytes))?;
        // Exact: the count is bounded by the bytes left and the cap, and
        // doubling would leave up to half the vector unused.
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

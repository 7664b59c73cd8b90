//! The records of a publish, as a producer builds them and as a broker reads
//! them.
//!
//! A producer hands over owned [`RecordIn`]s. A broker decodes the same bytes
//! into a view: [`PublishRecords::get`] checks every record once, exactly as
//! decoding them into `RecordIn`s would (the same errors for the same
//! input), and keeps only the frame's bytes and the count. Reading the
//! records back ([`PublishRecords::iter`]) walks those checked bytes again
//! and hands out borrowed [`RecordView`]s: no vector of records, no
//! allocated header names, no reference count taken and dropped per key and
//! payload. Outside a cluster the broker copies each record once, into the
//! log's batch (in a cluster, into the replicated entry).

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};

use crate::codec::{put_wire_vec, Cursor, Reader, Wire, BLOB, OPT, U16, U32, U64, VEC};
use crate::error::DecodeError;
use crate::types::{RecordIn, HEADER};

type Result<T> = std::result::Result<T, DecodeError>;

/// The records of a [`Request::Publish`](crate::Request::Publish): owned
/// records on the producer's side (`From<Vec<RecordIn>>`), a checked view of
/// the frame on the broker's. Both encode to the same bytes, and two compare
/// equal when their records do, whichever way each is held.
#[derive(Clone)]
pub struct PublishRecords(Held);

#[derive(Clone)]
enum Held {
    Owned(Vec<RecordIn>),
    /// The records' encoding (after the count), checked when decoded.
    Checked {
        bytes: Bytes,
        count: u32,
    },
}

impl PublishRecords {
    /// How many records.
    pub fn len(&self) -> usize {
        match &self.0 {
            Held::Owned(v) => v.len(),
            Held::Checked { count, .. } => *count as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The records in order, borrowed.
    pub fn iter(&self) -> Iter<'_> {
        Iter(match &self.0 {
            Held::Owned(v) => IterHeld::Owned(v.iter()),
            Held::Checked { bytes, count } => IterHeld::Checked {
                bytes,
                pos: 0,
                left: *count,
            },
        })
    }

    /// Owned copies of the records (their keys, header values and payloads
    /// share the frame's bytes).
    pub fn to_records(&self) -> Vec<RecordIn> {
        match &self.0 {
            Held::Owned(v) => v.clone(),
            Held::Checked { bytes, .. } => self
                .iter()
                .map(|r| RecordIn {
                    timestamp_ms: r.timestamp_ms,
                    key: r.key.map(|k| bytes.slice_ref(k)),
                    headers: r
                        .headers
                        .iter()
                        .map(|(n, v)| (n.to_owned(), bytes.slice_ref(v)))
                        .collect(),
                    payload: bytes.slice_ref(r.payload),
                })
                .collect(),
        }
    }

    /// Memory the records hold besides the frame's bytes: the owned
    /// vectors and header names (nothing, for a decoded view).
    pub(crate) fn overhead(&self) -> usize {
        use std::mem::size_of;
        /// What the allocator takes per allocation beyond the bytes asked.
        const PER_ALLOCATION: usize = 16;
        let name = |n: &String| match n.capacity() {
            0 => 0,
            c => c.max(PER_ALLOCATION) + PER_ALLOCATION,
        };
        match &self.0 {
            Held::Checked { .. } => 0,
            Held::Owned(records) => {
                records.capacity() * size_of::<RecordIn>()
                    + records
                        .iter()
                        .map(|r| {
                            r.headers.capacity() * size_of::<(String, Bytes)>()
                                + r.headers.iter().map(|(n, _)| name(n)).sum::<usize>()
                        })
                        .sum::<usize>()
            }
        }
    }

    pub(crate) fn put(&self, out: &mut BytesMut) {
        match &self.0 {
            Held::Owned(v) => put_wire_vec(out, v),
            Held::Checked { bytes, count } => {
                out.put_u32_le(*count);
                out.put_slice(bytes);
            }
        }
    }

    /// Decode the records of a publish (the `u32` count and the records),
    /// checking each as [`RecordIn`]'s decoder would, without keeping more
    /// than the bytes they occupy.
    pub(crate) fn get(r: &mut Reader) -> Result<PublishRecords> {
        let ((count, first, end), start) = r.with_cursor(|c| {
            let count = c.count("records", RecordIn::MIN_BYTES)?;
            let first = c.pos();
            for _ in 0..count {
                check_record(c)?;
            }
            Ok((count, first, c.pos()))
        })?;
        Ok(PublishRecords(Held::Checked {
            bytes: r.slice(start + first, start + end),
            // At most MAX_ITEMS_PER_VEC.
            count: count as u32,
        }))
    }
}

impl From<Vec<RecordIn>> for PublishRecords {
    fn from(v: Vec<RecordIn>) -> Self {
        PublishRecords(Held::Owned(v))
    }
}

impl FromIterator<RecordIn> for PublishRecords {
    fn from_iter<T: IntoIterator<Item = RecordIn>>(iter: T) -> Self {
        PublishRecords(Held::Owned(iter.into_iter().collect()))
    }
}

impl PartialEq for PublishRecords {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for PublishRecords {}

impl fmt::Debug for PublishRecords {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<'a> IntoIterator for &'a PublishRecords {
    type Item = RecordView<'a>;
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// One record of a publish, borrowed from where the records are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordView<'a> {
    pub timestamp_ms: Option<u64>,
    pub key: Option<&'a [u8]>,
    pub headers: HeadersView<'a>,
    pub payload: &'a [u8],
}

impl RecordView<'_> {
    /// Bytes the record carries: key, header names and values, payload.
    pub fn carried_bytes(&self) -> usize {
        let headers = if self.headers.is_empty() {
            0
        } else {
            self.headers.iter().map(|(n, v)| n.len() + v.len()).sum()
        };
        self.payload.len() + self.key.map_or(0, <[u8]>::len) + headers
    }
}

/// A record's headers, borrowed: name and value pairs in order.
#[derive(Clone, Copy)]
pub struct HeadersView<'a>(HeadersHeld<'a>);

#[derive(Clone, Copy)]
enum HeadersHeld<'a> {
    Owned(&'a [(String, Bytes)]),
    /// Checked encoding of `count` headers.
    Checked {
        bytes: &'a [u8],
        count: u32,
    },
}

impl<'a> HeadersView<'a> {
    pub fn len(&self) -> usize {
        match self.0 {
            HeadersHeld::Owned(h) => h.len(),
            HeadersHeld::Checked { count, .. } => count as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Name and value of each header, the name as bytes: what a writer
    /// copies, without checking the name's UTF-8 again.
    pub fn raw(&self) -> RawHeadersIter<'a> {
        RawHeadersIter(self.iter())
    }

    pub fn iter(&self) -> HeadersIter<'a> {
        HeadersIter(match self.0 {
            HeadersHeld::Owned(h) => HeadersIterHeld::Owned(h.iter()),
            HeadersHeld::Checked { bytes, count } => HeadersIterHeld::Checked {
                bytes,
                pos: 0,
                left: count,
            },
        })
    }
}

impl PartialEq for HeadersView<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for HeadersView<'_> {}

impl fmt::Debug for HeadersView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The records of a [`PublishRecords`], in order.
#[derive(Clone)]
pub struct Iter<'a>(IterHeld<'a>);

#[derive(Clone)]
enum IterHeld<'a> {
    Owned(std::slice::Iter<'a, RecordIn>),
    Checked {
        bytes: &'a [u8],
        pos: usize,
        left: u32,
    },
}

impl<'a> Iterator for Iter<'a> {
    type Item = RecordView<'a>;

    fn next(&mut self) -> Option<RecordView<'a>> {
        match &mut self.0 {
            IterHeld::Owned(i) => i.next().map(|r| RecordView {
                timestamp_ms: r.timestamp_ms,
                key: r.key.as_deref(),
                headers: HeadersView(HeadersHeld::Owned(&r.headers)),
                payload: &r.payload,
            }),
            IterHeld::Checked { bytes, pos, left } => {
                if *left == 0 {
                    return None;
                }
                *left -= 1;
                Some(walk(bytes, pos))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = match &self.0 {
            IterHeld::Owned(i) => i.len(),
            IterHeld::Checked { left, .. } => *left as usize,
        };
        (n, Some(n))
    }
}

impl ExactSizeIterator for Iter<'_> {}

/// A record's headers, in order: name and value.
#[derive(Clone)]
pub struct HeadersIter<'a>(HeadersIterHeld<'a>);

#[derive(Clone)]
enum HeadersIterHeld<'a> {
    Owned(std::slice::Iter<'a, (String, Bytes)>),
    Checked {
        bytes: &'a [u8],
        pos: usize,
        left: u32,
    },
}

impl<'a> HeadersIter<'a> {
    fn next_raw(&mut self) -> Option<(&'a [u8], &'a [u8])> {
        match &mut self.0 {
            HeadersIterHeld::Owned(i) => i.next().map(|(n, v)| (n.as_bytes(), &v[..])),
            HeadersIterHeld::Checked { bytes, pos, left } => {
                if *left == 0 {
                    return None;
                }
                *left -= 1;
                Some(walk_header(bytes, pos))
            }
        }
    }

    fn left(&self) -> usize {
        match &self.0 {
            HeadersIterHeld::Owned(i) => i.len(),
            HeadersIterHeld::Checked { left, .. } => *left as usize,
        }
    }
}

impl<'a> Iterator for HeadersIter<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<(&'a str, &'a [u8])> {
        let (name, value) = self.next_raw()?;
        let name = std::str::from_utf8(name)
            .expect("felix-wire: header names were checked as UTF-8 when decoded");
        Some((name, value))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left(), Some(self.left()))
    }
}

impl ExactSizeIterator for HeadersIter<'_> {}

/// A record's headers, in order, the names as bytes
/// ([`HeadersView::raw`]).
#[derive(Clone)]
pub struct RawHeadersIter<'a>(HeadersIter<'a>);

impl<'a> Iterator for RawHeadersIter<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<(&'a [u8], &'a [u8])> {
        self.0.next_raw()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.0.left(), Some(self.0.left()))
    }
}

impl ExactSizeIterator for RawHeadersIter<'_> {}

/// Take `n` bytes at `*pos` of bytes already checked.
#[inline]
fn step<'a>(buf: &'a [u8], pos: &mut usize, n: usize) -> &'a [u8] {
    let s = &buf[*pos..*pos + n];
    *pos += n;
    s
}

#[inline]
fn step_u32(buf: &[u8], pos: &mut usize) -> usize {
    let mut a = [0u8; U32];
    a.copy_from_slice(step(buf, pos, U32));
    u32::from_le_bytes(a) as usize
}

/// The record at `*pos` of records [`check_record`] checked: the same
/// fields without the checks (a slice out of bounds here would mean the
/// checked bytes changed, which `Bytes` does not allow).
#[inline]
fn walk<'a>(buf: &'a [u8], pos: &mut usize) -> RecordView<'a> {
    let timestamp_ms = match step(buf, pos, OPT)[0] {
        0 => None,
        _ => {
            let mut a = [0u8; U64];
            a.copy_from_slice(step(buf, pos, U64));
            Some(u64::from_le_bytes(a))
        }
    };
    let key = match step(buf, pos, OPT)[0] {
        0 => None,
        _ => {
            let len = step_u32(buf, pos);
            Some(step(buf, pos, len))
        }
    };
    let count = step_u32(buf, pos);
    let start = *pos;
    for _ in 0..count {
        walk_header(buf, pos);
    }
    let headers = HeadersView(HeadersHeld::Checked {
        bytes: &buf[start..*pos],
        count: count as u32,
    });
    let len = step_u32(buf, pos);
    let payload = step(buf, pos, len);
    RecordView {
        timestamp_ms,
        key,
        headers,
        payload,
    }
}

/// The header at `*pos` of headers [`check_record`] checked.
#[inline]
fn walk_header<'a>(buf: &'a [u8], pos: &mut usize) -> (&'a [u8], &'a [u8]) {
    let mut a = [0u8; U16];
    a.copy_from_slice(step(buf, pos, U16));
    let name = step(buf, pos, u16::from_le_bytes(a) as usize);
    let len = step_u32(buf, pos);
    (name, step(buf, pos, len))
}

/// Check one record, laid out as [`RecordIn`]'s `Wire` encoding, reading
/// exactly what its decoder reads, with the same errors.
fn check_record(c: &mut Cursor) -> Result<()> {
    if c.bool("record timestamp")? {
        c.u64("record timestamp")?;
    }
    if c.bool("record key")? {
        c.blob("record key")?;
    }
    let headers = c.count("headers", HEADER)?;
    crate::headers::check(c, headers)?;
    c.blob("record payload")?;
    Ok(())
}

// The layout walked above is `RecordIn`'s: keep the two in step.
const _: () = assert!(RecordIn::MIN_BYTES == OPT + OPT + VEC + BLOB);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record() -> impl Strategy<Value = RecordIn> {
        (
            proptest::option::of(any::<u64>()),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..6)),
            proptest::collection::vec(
                ("[a-zé]{0,3}", proptest::collection::vec(any::<u8>(), 0..4)),
                0..3,
            ),
            proptest::collection::vec(any::<u8>(), 0..8),
        )
            .prop_map(|(timestamp_ms, key, headers, payload)| RecordIn {
                timestamp_ms,
                key: key.map(Bytes::from),
                headers: headers
                    .into_iter()
                    .map(|(n, v)| (n, Bytes::from(v)))
                    .collect(),
                payload: Bytes::from(payload),
            })
    }

    /// What decoding `bytes` into owned records gives: the records and the
    /// bytes read, or the error.
    fn owned(bytes: &Bytes) -> Result<(Vec<RecordIn>, usize)> {
        let mut r = Reader::new(bytes.clone());
        let v = r.wire_vec::<RecordIn>("records")?;
        Ok((v, bytes.len() - r.remaining()))
    }

    fn viewed(bytes: &Bytes) -> Result<(Vec<RecordIn>, usize)> {
        let mut r = Reader::new(bytes.clone());
        let p = PublishRecords::get(&mut r)?;
        let n = bytes.len() - r.remaining();
        // Walked more than once, the view hands out the same records.
        assert_eq!(p.to_records(), p.to_records());
        assert_eq!(p.iter().len(), p.len());
        for r in &p {
            let names = r.headers.iter().map(|(n, v)| (n.as_bytes(), v));
            assert!(r.headers.raw().eq(names));
        }
        Ok((p.to_records(), n))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// The view checks exactly what decoding into `RecordIn`s checks:
        /// for well-formed records and for any byte of them changed, cut
        /// off or grown, both accept the same records reading the same
        /// bytes, or fail with the same error.
        #[test]
        fn the_view_decodes_as_owned_records_do(
            records in proptest::collection::vec(record(), 0..5),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
            how in 0u8..4,
        ) {
            let mut out = BytesMut::new();
            PublishRecords::from(records.clone()).put(&mut out);
            let mut bytes = out.to_vec();
            if !bytes.is_empty() {
                let i = at.index(bytes.len());
                match how {
                    0 => {}
                    1 => bytes[i] = byte,
                    2 => bytes.truncate(i),
                    _ => bytes.insert(i, byte),
                }
            }
            let bytes = Bytes::from(bytes);
            let (a, b) = (owned(&bytes), viewed(&bytes));
            prop_assert_eq!(&a, &b);
            if how == 0 {
                prop_assert_eq!(a.unwrap().0, records);
            }
        }
    }
}

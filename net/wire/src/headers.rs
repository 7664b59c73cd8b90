//! A read-back record's headers, held as their encoding.
//!
//! A `Records` or `GroupRecords` answer carries each record's headers as a
//! `u32` count and, per header, a `u16`-prefixed UTF-8 name and a
//! `u32`-prefixed value: the same layout a record's headers have in the
//! storage format after its `u16` count. [`Headers`] keeps that encoding as
//! one shared slice and reads names and values out of it on demand, so a
//! broker answering a read copies a record's headers as one piece, and a
//! client decoding the answer checks them once and allocates nothing for
//! them.

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};

use crate::codec::{put_blob, put_str, Cursor, Reader};
use crate::error::DecodeError;
use crate::types::HEADER;

type Result<T> = std::result::Result<T, DecodeError>;

/// A stored record's headers: names and values in the order they were
/// published (names may repeat). Cheap to clone (a shared slice).
#[derive(Clone, Default)]
pub struct Headers {
    count: u32,
    /// `count` headers, checked: `u16 len, name (UTF-8), u32 len, value`.
    raw: Bytes,
}

impl Headers {
    /// No headers.
    pub fn new() -> Headers {
        Headers::default()
    }

    /// Headers from their encoding (`count` of them, exactly `raw`), as a
    /// record's header section holds them in the storage format and on the
    /// wire after its count. Checked: a name that is not UTF-8, a length
    /// past the end or bytes after the last header is an error.
    pub fn from_encoded(count: u32, raw: Bytes) -> Result<Headers> {
        let mut c = Cursor::new(&raw);
        check(&mut c, count as usize)?;
        if c.remaining() != 0 {
            return Err(DecodeError::TrailingBytes);
        }
        Ok(Headers { count, raw })
    }

    /// Headers from an encoding already checked as
    /// [`Headers::from_encoded`] checks it (by the storage engine's
    /// decoder, which reads the same layout), without checking it again
    /// (debug builds do). Were it not well formed after all, reading it
    /// would stop at the first header that is not, never panic.
    pub fn from_checked(count: u32, raw: Bytes) -> Headers {
        debug_assert_eq!(
            Headers::from_encoded(count, raw.clone()).map(|h| h.count),
            Ok(count),
            "headers said to be checked are not well formed"
        );
        Headers { count, raw }
    }

    pub fn len(&self) -> usize {
        self.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Name and value of each header, in order.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            raw: &self.raw,
            left: self.count,
        }
    }

    /// The value of the first header named `name`.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// The headers as owned pairs (the values share this encoding).
    pub fn to_vec(&self) -> Vec<(String, Bytes)> {
        let mut out = Vec::with_capacity(self.len());
        let mut pos = 0;
        for _ in 0..self.count {
            let Some((name, value)) = walk(&self.raw, &mut pos) else {
                break;
            };
            let start = pos - value.len();
            out.push((name.to_owned(), self.raw.slice(start..pos)));
        }
        out
    }

    /// Their encoding after the count (see [`Headers::from_encoded`]).
    pub fn encoded(&self) -> &Bytes {
        &self.raw
    }

    /// Bytes the names and values take (without their lengths).
    pub fn carried_bytes(&self) -> usize {
        self.raw.len().saturating_sub(self.len() * HEADER)
    }

    pub(crate) fn put(&self, out: &mut BytesMut) {
        out.put_u32_le(self.count);
        out.put_slice(&self.raw);
    }

    /// Decode a `u32` count and that many headers, checked, as a slice of
    /// the frame.
    pub(crate) fn get_from(r: &mut Reader) -> Result<Headers> {
        let ((count, from, to), start) = r.with_cursor(|c| {
            let count = c.count("headers", HEADER)?;
            let from = c.pos();
            check(c, count)?;
            Ok((count, from, c.pos()))
        })?;
        Ok(Headers {
            count: count as u32,
            raw: r.slice(start + from, start + to),
        })
    }
}

/// Check `count` headers at the cursor, as decoding them into owned pairs
/// would (the same errors).
pub(crate) fn check(c: &mut Cursor, count: usize) -> Result<()> {
    for _ in 0..count {
        c.str("header name")?;
        c.blob("header value")?;
    }
    Ok(())
}

/// The header at `*pos` of a checked encoding (`None`, and `*pos` left,
/// where it is not well formed after all).
fn walk<'a>(raw: &'a [u8], pos: &mut usize) -> Option<(&'a str, &'a [u8])> {
    let mut c = Cursor::new(raw.get(*pos..)?);
    let name = c.str("header name").ok()?;
    let value = c.blob("header value").ok()?;
    *pos += c.pos();
    Some((name, value))
}

/// The headers of a [`Headers`], in order.
#[derive(Clone, Debug)]
pub struct Iter<'a> {
    raw: &'a [u8],
    left: u32,
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<(&'a str, &'a [u8])> {
        if self.left == 0 {
            return None;
        }
        let mut pos = 0;
        let Some(h) = walk(self.raw, &mut pos) else {
            self.left = 0;
            return None;
        };
        self.left -= 1;
        self.raw = &self.raw[pos..];
        Some(h)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl std::iter::FusedIterator for Iter<'_> {}

impl<'a> IntoIterator for &'a Headers {
    type Item = (&'a str, &'a [u8]);
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl<N: AsRef<str>, V: AsRef<[u8]>> FromIterator<(N, V)> for Headers {
    /// Encode the headers (a name over 65,535 bytes is cut there, at a
    /// character boundary, as the wire does).
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Headers {
        let mut raw = BytesMut::new();
        let mut count = 0u32;
        for (name, value) in iter {
            put_str(&mut raw, name.as_ref());
            put_blob(&mut raw, value.as_ref());
            count += 1;
        }
        Headers {
            count,
            raw: raw.freeze(),
        }
    }
}

impl From<Vec<(String, Bytes)>> for Headers {
    fn from(v: Vec<(String, Bytes)>) -> Headers {
        v.into_iter().collect()
    }
}

/// The same headers in the same order (their encodings are equal).
impl PartialEq for Headers {
    fn eq(&self, other: &Headers) -> bool {
        self.count == other.count && self.raw == other.raw
    }
}

impl Eq for Headers {}

impl<N: AsRef<str>, V: AsRef<[u8]>> PartialEq<[(N, V)]> for Headers {
    fn eq(&self, other: &[(N, V)]) -> bool {
        let mut mine = self.iter();
        self.len() == other.len()
            && other.iter().all(|(on, ov)| {
                mine.next()
                    .is_some_and(|(n, v)| n == on.as_ref() && v == ov.as_ref())
            })
    }
}

impl std::hash::Hash for Headers {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.count.hash(state);
        self.raw.hash(state);
    }
}

impl<N: AsRef<str>, V: AsRef<[u8]>> PartialEq<Vec<(N, V)>> for Headers {
    fn eq(&self, other: &Vec<(N, V)>) -> bool {
        *self == other[..]
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|(n, v)| (n, Bytes::copy_from_slice(v))))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Headers {
        [("a", &b"1"[..]), ("", b""), ("é", b"xyz"), ("a", b"2")]
            .into_iter()
            .collect()
    }

    #[test]
    fn headers_read_back_in_order_and_by_name() {
        let h = sample();
        assert_eq!(h.len(), 4);
        let got: Vec<(&str, &[u8])> = h.iter().collect();
        assert_eq!(
            got,
            vec![("a", &b"1"[..]), ("", b""), ("é", b"xyz"), ("a", b"2")]
        );
        assert_eq!(h.get("a"), Some(&b"1"[..]));
        assert_eq!(h.get("é"), Some(&b"xyz"[..]));
        assert_eq!(h.get("b"), None);
        assert_eq!(h.carried_bytes(), 1 + 1 + 2 + 3 + 1 + 1);
        let owned = h.to_vec();
        assert_eq!(h, owned);
        assert_eq!(Headers::from(owned), h);
        assert!(Headers::new().is_empty() && Headers::new().iter().next().is_none());
        // On the wire: a u32 count, then per header a u16-prefixed name
        // and a u32-prefixed value.
        let mut wire = BytesMut::new();
        Headers::from(vec![
            ("ab".to_string(), Bytes::from_static(b"v")),
            (String::new(), Bytes::new()),
        ])
        .put(&mut wire);
        assert_eq!(
            &wire[..],
            &[2, 0, 0, 0, 2, 0, b'a', b'b', 1, 0, 0, 0, b'v', 0, 0, 0, 0, 0, 0][..]
        );
    }

    #[test]
    fn only_a_whole_well_formed_encoding_is_taken() {
        let raw = sample().encoded().clone();
        assert_eq!(Headers::from_encoded(4, raw.clone()), Ok(sample()));
        assert_eq!(
            Headers::from_encoded(3, raw.clone()),
            Err(DecodeError::TrailingBytes)
        );
        assert!(matches!(
            Headers::from_encoded(5, raw.clone()),
            Err(DecodeError::Truncated { .. })
        ));
        for cut in 0..raw.len() {
            assert!(
                Headers::from_encoded(4, raw.slice(..cut)).is_err(),
                "cut at {cut}"
            );
        }
        // "é" is the third header's name: cut in the middle of it.
        let mut bad = raw.to_vec();
        let at = bad.iter().position(|&b| b == 0xC3).unwrap();
        bad[at + 1] = b'x';
        assert!(matches!(
            Headers::from_encoded(4, Bytes::from(bad)),
            Err(DecodeError::BadUtf8 { .. })
        ));
    }

    /// Reading an encoding that is not well formed (which no constructor
    /// lets in) stops early rather than panic.
    #[test]
    fn a_bad_encoding_is_read_no_further_than_it_holds() {
        let raw = sample().encoded().clone();
        for cut in 0..=raw.len() {
            for count in 0..6 {
                let h = Headers {
                    count,
                    raw: raw.slice(..cut),
                };
                let n = h.iter().count();
                assert!(n <= count as usize);
                assert_eq!(h.to_vec().len(), n);
                let _ = (h.get("é"), h.carried_bytes(), format!("{h:?}"));
                // Equal to the pairs it holds only if it holds them all.
                assert_eq!(h == h.to_vec(), n == count as usize);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Decoded from a frame, headers are taken and refused exactly as
        /// decoding them into owned pairs takes and refuses them (well
        /// formed, changed at one byte, cut, or with another count).
        #[test]
        fn decoding_agrees_with_the_owned_decoder(
            pairs in proptest::collection::vec(("[a-zé]{0,3}", proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4)), 0..4),
            at in proptest::prelude::any::<proptest::sample::Index>(),
            byte in proptest::prelude::any::<u8>(),
            change in 0..4u8,
        ) {
            let h: Headers = pairs.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
            let mut wire = BytesMut::new();
            h.put(&mut wire);
            let mut bytes = wire.to_vec();
            match change {
                0 => {}
                1 => { let i = at.index(bytes.len()); bytes[i] = byte; }
                2 => bytes.truncate(at.index(bytes.len())),
                _ => bytes[0] = byte % 8,
            }
            let frame = Bytes::from(bytes);
            let mut owned = Reader::new(frame.clone());
            let mut viewed = Reader::new(frame);
            let want = crate::types::get_headers(&mut owned);
            let got = Headers::get_from(&mut viewed);
            match (want, got) {
                (Ok(w), Ok(g)) => {
                    proptest::prop_assert_eq!(&g, &w);
                    proptest::prop_assert_eq!(g.to_vec(), w);
                    proptest::prop_assert_eq!(owned.remaining(), viewed.remaining());
                }
                (w, g) => proptest::prop_assert_eq!(w.err(), g.err()),
            }
        }
    }
}

//! On-disk framing of batches and records. The byte tables are in
//! `docs/internals/storage-format.md`; this file is their implementation.
//!
//! A batch is the unit of writing and of checksumming: a fixed 40-byte header,
//! then a body whose meaning depends on the batch kind. The CRC32C covers every
//! byte after the checksum field, so a torn or flipped byte anywhere in the
//! batch (header included) is caught.

use crate::types::Offset;
use bytes::{Buf, Bytes};
use std::mem::MaybeUninit;

pub const FORMAT_VERSION: u8 = 1;
pub const BATCH_HEADER_BYTES: usize = 40;
/// Fixed part of an encoded record, before key, headers and payload.
pub const RECORD_FIXED_BYTES: usize = 26;
/// No batch may be larger than this (a sanity bound for recovery, far above
/// the wire's frame cap).
pub const BATCH_MAX_BYTES: u32 = 1 << 30;
/// Key length meaning "no key".
const NO_KEY: u32 = u32::MAX;

/// What a batch holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum BatchKind {
    /// User records; `record_count` offsets from `base_offset`.
    Records = 1,
    /// One control record (e.g. a leader's generation start): takes one offset,
    /// never delivered.
    Control = 2,
    /// Consumer-group state: takes no offset.
    Group = 3,
}

impl BatchKind {
    fn from_u8(b: u8) -> Option<BatchKind> {
        match b {
            1 => Some(BatchKind::Records),
            2 => Some(BatchKind::Control),
            3 => Some(BatchKind::Group),
            _ => None,
        }
    }
}

/// A decoded batch header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    pub len: u32,
    pub crc: u32,
    pub kind: BatchKind,
    /// Low 16 bits of the sequence number of the group-commit flush that
    /// wrote the batch (0 in files written before it was recorded). Recovery
    /// uses it to tell a torn last write from damage to older data.
    pub flush: u16,
    pub record_count: u32,
    pub base_offset: Offset,
    /// Replication term / leader generation (0 until replication exists).
    pub term: u64,
    pub max_timestamp_ms: u64,
}

impl BatchHeader {
    /// Offsets this batch takes.
    pub fn offsets(&self) -> u64 {
        match self.kind {
            BatchKind::Records | BatchKind::Control => self.record_count as u64,
            BatchKind::Group => 0,
        }
    }
    /// One past the last offset of the batch.
    pub fn end_offset(&self) -> Offset {
        self.base_offset.plus(self.offsets())
    }

    /// Does the record count fit the kind and the length? (Every batch the
    /// encoders write passes; a cheap filter for bytes that may not be a
    /// batch at all.)
    pub fn plausible(&self) -> bool {
        match self.kind {
            BatchKind::Records => {
                self.record_count >= 1
                    && BATCH_HEADER_BYTES as u64
                        + RECORD_FIXED_BYTES as u64 * self.record_count as u64
                        <= self.len as u64
            }
            BatchKind::Control => self.record_count == 1,
            BatchKind::Group => self.record_count == 0,
        }
    }
}

/// A record as a producer hands it in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordIn {
    pub timestamp_ms: u64,
    pub key: Option<Bytes>,
    pub headers: Vec<(String, Bytes)>,
    pub payload: Bytes,
}

impl RecordIn {
    pub fn encoded_len(&self) -> usize {
        AppendRecord::encoded_len(self)
    }
}

/// A record to append, however its holder keeps it: an owned [`RecordIn`],
/// or a view of the request it came in (the broker encodes a publish's
/// records straight from the frame, without a vector of them or a reference
/// count per field). The log reads the records more than once, through
/// clones of the iterator it is given: to check and size the batch, then to
/// encode it. So every clone must yield the same records with the same
/// fields, and [`header_count`](AppendRecord::header_count) must be the
/// number of pairs [`headers`](AppendRecord::headers) yields: the batch's
/// length and header counts are written from them.
pub trait AppendRecord {
    fn timestamp_ms(&self) -> u64;
    fn key(&self) -> Option<&[u8]>;
    /// How many pairs [`headers`](AppendRecord::headers) yields.
    fn header_count(&self) -> usize;
    /// Name and value of each header, in order.
    fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])>;
    fn payload(&self) -> &[u8];

    /// Bytes the record takes in a batch.
    fn encoded_len(&self) -> usize {
        RECORD_FIXED_BYTES
            + self.key().map_or(0, <[u8]>::len)
            + headers_len(self)
            + self.payload().len()
    }
}

/// Bytes a record's headers take in a batch (none walked for a record
/// without any, the usual case).
fn headers_len<R: AppendRecord + ?Sized>(r: &R) -> usize {
    if r.header_count() == 0 {
        return 0;
    }
    r.headers().map(|(n, v)| 6 + n.len() + v.len()).sum()
}

impl AppendRecord for RecordIn {
    fn timestamp_ms(&self) -> u64 {
        self.timestamp_ms
    }
    fn key(&self) -> Option<&[u8]> {
        self.key.as_deref()
    }
    fn header_count(&self) -> usize {
        self.headers.len()
    }
    fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.headers.iter().map(|(n, v)| (n.as_bytes(), &v[..]))
    }
    fn payload(&self) -> &[u8] {
        &self.payload
    }
}

impl<R: AppendRecord + ?Sized> AppendRecord for &R {
    fn timestamp_ms(&self) -> u64 {
        (**self).timestamp_ms()
    }
    fn key(&self) -> Option<&[u8]> {
        (**self).key()
    }
    fn header_count(&self) -> usize {
        (**self).header_count()
    }
    fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        (**self).headers()
    }
    fn payload(&self) -> &[u8] {
        (**self).payload()
    }
    fn encoded_len(&self) -> usize {
        (**self).encoded_len()
    }
}

/// Most headers one record may carry (the count is a `u16` on disk).
pub const RECORD_HEADERS_MAX: usize = 1024;

/// Check that `records` fit the on-disk format (header counts and name
/// lengths are `u16`, lengths `u32`, a batch at most [`BATCH_MAX_BYTES`]) and
/// return the encoded batch length and the number of records. Anything
/// refused here must never reach the disk: it would be unreadable.
pub fn check_records<R: AppendRecord>(
    records: impl IntoIterator<Item = R>,
) -> Result<Checked, String> {
    let mut len = BATCH_HEADER_BYTES;
    let mut count = 0;
    let too_long = |x: usize| x >= u32::MAX as usize;
    for (i, r) in records.into_iter().enumerate() {
        let headers = r.header_count();
        if headers > RECORD_HEADERS_MAX {
            return Err(format!(
                "record {i} has {headers} headers; the limit is {RECORD_HEADERS_MAX}"
            ));
        }
        // One pass over the headers (none for a record without): names
        // first, then any field too long.
        let mut headers_len = 0;
        let mut value_too_long = false;
        if headers > 0 {
            for (n, v) in r.headers() {
                if n.len() > u16::MAX as usize {
                    return Err(format!(
                        "record {i} has a header name of {} bytes; the limit is 65535",
                        n.len()
                    ));
                }
                value_too_long |= too_long(v.len());
                headers_len += 6 + n.len() + v.len();
            }
        }
        let key = r.key().map_or(0, <[u8]>::len);
        let payload = r.payload().len();
        if value_too_long || too_long(key) || too_long(payload) {
            return Err(format!("record {i} has a field of 4 GiB or more"));
        }
        len += RECORD_FIXED_BYTES + key + headers_len + payload;
        if len > BATCH_MAX_BYTES as usize {
            return Err(format!("the batch is over {BATCH_MAX_BYTES} bytes"));
        }
        count += 1;
    }
    Ok(Checked { len, count })
}

/// What [`check_records`] found of records it accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checked {
    /// Bytes of the batch.
    pub len: usize,
    pub count: usize,
}

/// A record read back from the log. Key, headers and payload share the
/// batch's buffer (no copies).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub offset: Offset,
    pub timestamp_ms: u64,
    pub key: Option<Bytes>,
    pub headers: StoredHeaders,
    pub payload: Bytes,
}

impl Record {
    /// Bytes of everything the record carries: key, header names and values,
    /// payload.
    pub fn size_bytes(&self) -> usize {
        self.key.as_ref().map_or(0, |k| k.len()) + self.headers.carried_bytes() + self.payload.len()
    }

    /// Bytes the record holds in memory: what it carries and
    /// [`Self::header_table_bytes`].
    pub fn memory_bytes(&self) -> usize {
        self.size_bytes() + self.header_table_bytes()
    }

    /// What holding the record's headers takes beyond the bytes they carry:
    /// their lengths, which are held with them (a record of many empty
    /// headers holds more than it carries). Zero for a record without
    /// headers.
    pub fn header_table_bytes(&self) -> usize {
        self.headers.raw.len() - self.headers.carried_bytes()
    }
}

/// A stored record's headers as its batch holds them, a slice of it: after
/// the record's `u16` count, per header a `u16` name length, the name
/// (UTF-8), a `u32` value length and the value. Checked when the record was
/// read; names and values are read out of it on demand, so reading a
/// record allocates nothing for its headers. This is also their layout in
/// a `Records` answer after its `u32` count.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StoredHeaders {
    count: u16,
    raw: Bytes,
}

/// Bytes of one header's lengths.
const HEADER_LENGTHS: usize = 2 + 4;

impl StoredHeaders {
    pub fn len(&self) -> usize {
        self.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Their encoding (see the type's docs), shared with the batch.
    pub fn encoded(&self) -> &Bytes {
        &self.raw
    }

    /// Bytes of the names and values.
    pub fn carried_bytes(&self) -> usize {
        self.raw.len() - self.len() * HEADER_LENGTHS
    }

    /// Name and value of each header, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &[u8])> + '_ {
        let mut pos = 0;
        (0..self.len()).map(move |_| {
            let n = u16::from_le_bytes([self.raw[pos], self.raw[pos + 1]]) as usize;
            // Checked when read; never fails.
            let name = std::str::from_utf8(&self.raw[pos + 2..pos + 2 + n]).unwrap_or_default();
            pos += 2 + n;
            let v =
                u32::from_le_bytes(self.raw[pos..pos + 4].try_into().expect("4 bytes")) as usize;
            let value = &self.raw[pos + 4..pos + 4 + v];
            pos += 4 + v;
            (name, value)
        })
    }

    /// The headers as owned pairs (the values share the batch).
    pub fn to_vec(&self) -> Vec<(String, Bytes)> {
        self.iter()
            .map(|(n, v)| (n.to_owned(), self.raw.slice_ref(v)))
            .collect()
    }
}

impl PartialEq<Vec<(String, Bytes)>> for StoredHeaders {
    fn eq(&self, other: &Vec<(String, Bytes)>) -> bool {
        self.len() == other.len()
            && self
                .iter()
                .zip(other)
                .all(|((n, v), (on, ov))| n == on && v == &ov[..])
    }
}

impl std::fmt::Debug for StoredHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|(n, v)| (n, Bytes::copy_from_slice(v))))
            .finish()
    }
}

/// Why bytes are not a valid batch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("need {0} more bytes")]
    Incomplete(usize),
    #[error("zero length (end of written data)")]
    Zero,
    #[error("bad length {0}")]
    BadLength(u32),
    #[error("checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("unknown format version {0}")]
    Version(u8),
    #[error("unknown batch kind {0}")]
    Kind(u8),
    #[error("malformed body: {0}")]
    Body(&'static str),
    #[error("base offset {0} is past any offset a log reaches")]
    OffsetRange(u64),
}

/// Bytes of the batch [`encode_records`] makes of `records` (what
/// [`check_records`] returns for records it accepts).
pub fn records_batch_len<R: AppendRecord>(records: impl IntoIterator<Item = R>) -> usize {
    BATCH_HEADER_BYTES + records.into_iter().map(|r| r.encoded_len()).sum::<usize>()
}

/// Append a records batch to `out`, stamped with the flush that will write it
/// (`flush`). Returns the header as written.
pub fn encode_records<I>(
    out: &mut Vec<u8>,
    base: Offset,
    term: u64,
    flush: u16,
    records: I,
) -> BatchHeader
where
    I: IntoIterator + Clone,
    I::Item: AppendRecord,
{
    encode_checked_records(
        out,
        records_batch_len(records.clone()),
        base,
        term,
        flush,
        records,
    )
}

/// [`encode_records`] of records whose batch length `len` a
/// [`check_records`] of them returned.
pub fn encode_checked_records<R: AppendRecord>(
    out: &mut Vec<u8>,
    len: usize,
    base: Offset,
    term: u64,
    flush: u16,
    records: impl IntoIterator<Item = R>,
) -> BatchHeader {
    append_batch(out, len, |dst| {
        encode_records_into(dst, base, term, flush, records)
    })
}

/// Encode a records batch into `out`, which is exactly as long as the batch
/// ([`records_batch_len`]) and may hold anything: the log encodes straight
/// into the memory it writes to disk. Every byte of `out` is written (or the
/// call panics, if `out` has the wrong length).
pub fn encode_records_into<R: AppendRecord>(
    out: &mut [MaybeUninit<u8>],
    base: Offset,
    term: u64,
    flush: u16,
    records: impl IntoIterator<Item = R>,
) -> BatchHeader {
    let mut w = Put::after_header(out);
    let mut max_ts = 0u64;
    let mut count = 0u32;
    for r in records {
        let ts = r.timestamp_ms();
        max_ts = max_ts.max(ts);
        let key = r.key();
        let payload = r.payload();
        let len =
            (RECORD_FIXED_BYTES - 4 + key.map_or(0, <[u8]>::len) + headers_len(&r) + payload.len())
                as u32;
        let key_len = key.map_or(NO_KEY, |k| k.len() as u32);
        let mut fixed = [0u8; RECORD_FIXED_BYTES];
        fixed[0..4].copy_from_slice(&len.to_le_bytes());
        fixed[4..8].copy_from_slice(&count.to_le_bytes());
        fixed[8..16].copy_from_slice(&ts.to_le_bytes());
        fixed[16..20].copy_from_slice(&key_len.to_le_bytes());
        fixed[20..22].copy_from_slice(&(r.header_count() as u16).to_le_bytes());
        fixed[22..26].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        w.put(&fixed);
        if let Some(k) = key {
            w.put(k);
        }
        let mut written = 0;
        for (name, value) in r.headers() {
            w.put(&(name.len() as u16).to_le_bytes());
            w.put(name);
            w.put(&(value.len() as u32).to_le_bytes());
            w.put(value);
            written += 1;
        }
        debug_assert_eq!(
            written,
            r.header_count(),
            "header_count disagrees with headers"
        );
        w.put(payload);
        count += 1;
    }
    w.finish(BatchKind::Records, count, base, (term, flush), max_ts)
}

/// Encode a control batch (one offset, never delivered) into `out`, exactly
/// `BATCH_HEADER_BYTES + body.len()` bytes long (see
/// [`encode_records_into`]).
pub fn encode_control_into(
    out: &mut [MaybeUninit<u8>],
    base: Offset,
    term: u64,
    flush: u16,
    body: &[u8],
) -> BatchHeader {
    encode_body_into(out, BatchKind::Control, 1, base, (term, flush), body)
}

/// Encode a group-state batch (no offset) into `out`, exactly
/// `BATCH_HEADER_BYTES + body.len()` bytes long. `at` is the log's next
/// offset when it was written, which orders it among the records.
pub fn encode_group_into(
    out: &mut [MaybeUninit<u8>],
    at: Offset,
    term: u64,
    flush: u16,
    body: &[u8],
) -> BatchHeader {
    encode_body_into(out, BatchKind::Group, 0, at, (term, flush), body)
}

/// Append a group-state batch to `out` (see [`encode_group_into`]).
pub fn encode_group(
    out: &mut Vec<u8>,
    at: Offset,
    term: u64,
    flush: u16,
    body: &[u8],
) -> BatchHeader {
    append_batch(out, BATCH_HEADER_BYTES + body.len(), |dst| {
        encode_group_into(dst, at, term, flush, body)
    })
}

/// A batch whose body is `body` as it is.
fn encode_body_into(
    out: &mut [MaybeUninit<u8>],
    kind: BatchKind,
    count: u32,
    base: Offset,
    stamp: (u64, u16),
    body: &[u8],
) -> BatchHeader {
    let mut w = Put::after_header(out);
    w.put(body);
    w.finish(kind, count, base, stamp, 0)
}

/// Run `encode` over `len` new bytes at the end of `out` and keep them.
fn append_batch(
    out: &mut Vec<u8>,
    len: usize,
    encode: impl FnOnce(&mut [MaybeUninit<u8>]) -> BatchHeader,
) -> BatchHeader {
    out.reserve(len);
    let start = out.len();
    let h = encode(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: the encoders write every byte of the slice they are given
    // (`Put::finish` checks it got to the end) before returning; a panic
    // leaves `out` as it was.
    unsafe { out.set_len(start + len) };
    h
}

/// Writes one batch into its exact-sized buffer: the body front to back,
/// then the header, then the checksum over both.
struct Put<'a> {
    out: &'a mut [MaybeUninit<u8>],
    at: usize,
}

impl<'a> Put<'a> {
    fn after_header(out: &'a mut [MaybeUninit<u8>]) -> Put<'a> {
        assert!(
            out.len() >= BATCH_HEADER_BYTES,
            "no room for a batch header"
        );
        Put {
            out,
            at: BATCH_HEADER_BYTES,
        }
    }

    #[inline]
    fn put(&mut self, b: &[u8]) {
        let dst = &mut self.out[self.at..self.at + b.len()];
        // SAFETY: `dst` is exactly `b.len()` bytes (the slice above checks
        // the bounds) and cannot overlap `b`, a shared borrow of other
        // memory.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr(), dst.as_mut_ptr().cast::<u8>(), b.len())
        };
        self.at += b.len();
    }

    /// Write the header of the batch that is all of the buffer and checksum
    /// it. The body must have filled the buffer exactly: a caller that sized
    /// it wrong would otherwise leave bytes inside the batch never written.
    fn finish(
        mut self,
        kind: BatchKind,
        count: u32,
        base: Offset,
        (term, flush): (u64, u16),
        max_ts: u64,
    ) -> BatchHeader {
        assert_eq!(self.at, self.out.len(), "batch buffer sized wrong");
        assert!(
            self.out.len() <= BATCH_MAX_BYTES as usize,
            "batch of {} bytes over the bound",
            self.out.len()
        );
        let len = self.out.len() as u32;
        let mut h = [0u8; BATCH_HEADER_BYTES];
        h[0..4].copy_from_slice(&len.to_le_bytes());
        // h[4..8]: the checksum, below.
        h[8] = FORMAT_VERSION;
        h[9] = kind as u8;
        h[10..12].copy_from_slice(&flush.to_le_bytes());
        h[12..16].copy_from_slice(&count.to_le_bytes());
        h[16..24].copy_from_slice(&base.0.to_le_bytes());
        h[24..32].copy_from_slice(&term.to_le_bytes());
        h[32..40].copy_from_slice(&max_ts.to_le_bytes());
        self.at = 0;
        self.put(&h);
        // SAFETY: every byte is written now: the body by `put` up to the end
        // (asserted above), the header just now.
        let out: &mut [u8] =
            unsafe { &mut *(std::ptr::from_mut::<[MaybeUninit<u8>]>(self.out) as *mut [u8]) };
        let crc = crc32c::crc32c(&out[8..]);
        out[4..8].copy_from_slice(&crc.to_le_bytes());
        BatchHeader {
            len,
            crc,
            kind,
            flush,
            record_count: count,
            base_offset: base,
            term,
            max_timestamp_ms: max_ts,
        }
    }
}

/// The declared length of the batch at the start of `buf`, checked to be
/// one a batch can have.
fn batch_len(buf: &[u8]) -> Result<u32, FrameError> {
    if buf.len() < 4 {
        return Err(FrameError::Incomplete(4 - buf.len()));
    }
    let len = u32::from_le_bytes(buf[0..4].try_into().unwrap());
    if len == 0 {
        return Err(FrameError::Zero);
    }
    if (len as usize) < BATCH_HEADER_BYTES || len > BATCH_MAX_BYTES {
        return Err(FrameError::BadLength(len));
    }
    Ok(len)
}

/// Decode the header at the start of `buf` (at least
/// [`BATCH_HEADER_BYTES`]) and check its length, version and kind, but not
/// the checksum: the batch's bytes are `buf[..len]`, which may not all be
/// there.
pub fn parse_header(buf: &[u8]) -> Result<BatchHeader, FrameError> {
    let len = batch_len(buf)?;
    if buf.len() < BATCH_HEADER_BYTES {
        return Err(FrameError::Incomplete(BATCH_HEADER_BYTES - buf.len()));
    }
    if buf[8] != FORMAT_VERSION {
        return Err(FrameError::Version(buf[8]));
    }
    let kind = BatchKind::from_u8(buf[9]).ok_or(FrameError::Kind(buf[9]))?;
    let rd64 = |at: usize| u64::from_le_bytes(buf[at..at + 8].try_into().unwrap());
    if rd64(16) >= Offset::LIMIT.0 {
        return Err(FrameError::OffsetRange(rd64(16)));
    }
    Ok(BatchHeader {
        len,
        crc: u32::from_le_bytes(buf[4..8].try_into().unwrap()),
        kind,
        flush: u16::from_le_bytes(buf[10..12].try_into().unwrap()),
        record_count: u32::from_le_bytes(buf[12..16].try_into().unwrap()),
        base_offset: Offset(rd64(16)),
        term: rd64(24),
        max_timestamp_ms: rd64(32),
    })
}

/// Parse and verify the batch at the start of `buf`. On success the batch is
/// `buf[..header.len]`.
pub fn parse_batch(buf: &[u8]) -> Result<BatchHeader, FrameError> {
    let len = batch_len(buf)?;
    if buf.len() < len as usize {
        return Err(FrameError::Incomplete(len as usize - buf.len()));
    }
    let stored = u32::from_le_bytes(buf[4..8].try_into().unwrap());
    let computed = crc32c::crc32c(&buf[8..len as usize]);
    if stored != computed {
        return Err(FrameError::Checksum { stored, computed });
    }
    parse_header(buf)
}

/// The body of a verified batch (after the header).
pub fn batch_body(batch: &Bytes, header: &BatchHeader) -> Bytes {
    batch.slice(BATCH_HEADER_BYTES..header.len as usize)
}

/// Decode the records of a verified records batch, those at or above `from`,
/// calling `f` for each until it returns false.
pub fn for_each_record(
    batch: &Bytes,
    header: &BatchHeader,
    from: Offset,
    f: impl FnMut(Record) -> bool,
) -> Result<(), FrameError> {
    for_each_record_from(batch, header, from, None, f).map(|_| ())
}

/// Where a record starts in its batch: its index and its byte position in
/// the batch's body. A reader that stopped inside a batch can start the next
/// read there instead of stepping over every record before it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordPos {
    pub index: u32,
    pub at: usize,
}

/// [`for_each_record`], starting the walk at `start` (a position an earlier
/// call returned for this same batch, at or below `from`) when given.
/// Returns where the first record not handed to `f` starts, if `f` stopped
/// before the end of the batch. A position that does not fit the batch is
/// caught by the same checks as a corrupt batch.
pub fn for_each_record_from(
    batch: &Bytes,
    header: &BatchHeader,
    from: Offset,
    start: Option<RecordPos>,
    mut f: impl FnMut(Record) -> bool,
) -> Result<Option<RecordPos>, FrameError> {
    debug_assert_eq!(header.kind, BatchKind::Records);
    let mut body = batch_body(batch, header);
    let body_len = body.len();
    let mut first = 0;
    if let Some(p) = start {
        if p.at > body_len || p.index > header.record_count {
            return Err(FrameError::Body("record position past the batch"));
        }
        body.advance(p.at);
        first = p.index;
    }
    for i in first..header.record_count {
        let at = body_len - body.remaining();
        if body.remaining() < 4 {
            return Err(FrameError::Body("record length"));
        }
        let len = body.get_u32_le() as usize;
        if body.remaining() < len || len < RECORD_FIXED_BYTES - 4 {
            return Err(FrameError::Body("record overruns batch"));
        }
        let delta = u32::from_le_bytes(body[..4].try_into().expect("4 bytes checked"));
        if delta != i {
            return Err(FrameError::Body("offset delta out of sequence"));
        }
        let offset = header.base_offset.plus(delta as u64);
        if offset < from {
            // Stepped over without a slice of the batch (that would count
            // a reference up and down for every record passed: a small
            // poll in a large batch passes hundreds).
            body.advance(len);
            continue;
        }
        let mut rec = body.split_to(len);
        rec.advance(4);
        let timestamp_ms = rec.get_u64_le();
        let key_len = rec.get_u32_le();
        let header_count = rec.get_u16_le();
        let payload_len = rec.get_u32_le() as usize;
        let key = if key_len == NO_KEY {
            None
        } else {
            if rec.remaining() < key_len as usize {
                return Err(FrameError::Body("key overruns record"));
            }
            Some(rec.split_to(key_len as usize))
        };
        // The headers are checked in place and kept as one slice.
        let pos = check_headers(&rec, header_count)?;
        let headers = StoredHeaders {
            count: header_count,
            raw: if header_count == 0 {
                Bytes::new()
            } else {
                rec.split_to(pos)
            },
        };
        if rec.remaining() != payload_len {
            return Err(FrameError::Body("payload length mismatch"));
        }
        let keep_going = f(Record {
            offset,
            timestamp_ms,
            key,
            headers,
            payload: rec,
        });
        if !keep_going {
            return Ok(Some(RecordPos { index: i, at }));
        }
    }
    Ok(None)
}

/// Check the `count` headers at the start of `rec` (a record's bytes after
/// its fixed fields and key): lengths within `rec`, UTF-8 names. Returns
/// the bytes they take.
#[inline]
fn check_headers(rec: &[u8], count: u16) -> Result<usize, FrameError> {
    let mut pos = 0;
    for _ in 0..count {
        if rec.len() < pos + 2 {
            return Err(FrameError::Body("header name length"));
        }
        let n = u16::from_le_bytes([rec[pos], rec[pos + 1]]) as usize;
        pos += 2;
        if rec.len() < pos + n + 4 {
            return Err(FrameError::Body("header name overruns record"));
        }
        std::str::from_utf8(&rec[pos..pos + n])
            .map_err(|_| FrameError::Body("header name not utf-8"))?;
        pos += n;
        let v = u32::from_le_bytes(rec[pos..pos + 4].try_into().expect("4 bytes")) as usize;
        pos += 4;
        if rec.len() - pos < v {
            return Err(FrameError::Body("header value overruns record"));
        }
        pos += v;
    }
    Ok(pos)
}

/// Check that `body` holds exactly `count` well-formed records, as
/// [`for_each_record`] would decode them (lengths that fit, offset deltas
/// in sequence, UTF-8 header names, payload lengths that match) and
/// nothing after them, without decoding any. Returns their newest
/// timestamp.
pub fn check_records_body(body: &[u8], count: u32) -> Result<u64, FrameError> {
    fn take<'a>(rest: &mut &'a [u8], n: usize, what: &'static str) -> Result<&'a [u8], FrameError> {
        if rest.len() < n {
            return Err(FrameError::Body(what));
        }
        let (now, later) = rest.split_at(n);
        *rest = later;
        Ok(now)
    }
    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
    }
    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
    }
    let mut rest = body;
    let mut max_timestamp_ms = 0;
    for i in 0..count {
        let len = u32_at(take(&mut rest, 4, "record length")?, 0) as usize;
        if len < RECORD_FIXED_BYTES - 4 {
            return Err(FrameError::Body("record overruns batch"));
        }
        let mut rec = take(&mut rest, len, "record overruns batch")?;
        // After the length: delta u32, timestamp u64, key length u32,
        // header count u16, payload length u32.
        let fixed = take(&mut rec, RECORD_FIXED_BYTES - 4, "record length")?;
        if u32_at(fixed, 0) != i {
            return Err(FrameError::Body("offset delta out of sequence"));
        }
        let timestamp_ms = u64::from_le_bytes(fixed[4..12].try_into().expect("8 bytes"));
        max_timestamp_ms = max_timestamp_ms.max(timestamp_ms);
        let key_len = u32_at(fixed, 12);
        let header_count = u16_at(fixed, 16);
        let payload_len = u32_at(fixed, 18) as usize;
        if key_len != NO_KEY {
            take(&mut rec, key_len as usize, "key overruns record")?;
        }
        rec = &rec[check_headers(rec, header_count)?..];
        if rec.len() != payload_len {
            return Err(FrameError::Body("payload length mismatch"));
        }
    }
    if !rest.is_empty() {
        return Err(FrameError::Body("bytes after the last record"));
    }
    Ok(max_timestamp_ms)
}

/// Encode a records batch holding the records of `body` (the body of a
/// records batch of `count` records whose newest timestamp is
/// `max_timestamp_ms`, as [`check_records_body`] found) unchanged, at
/// `base`: `BATCH_HEADER_BYTES + body.len()` bytes (see
/// [`encode_records_into`]).
pub fn encode_records_copy_into(
    out: &mut [MaybeUninit<u8>],
    base: Offset,
    stamp: (u64, u16),
    (count, max_timestamp_ms): (u32, u64),
    body: &[u8],
) -> BatchHeader {
    let mut w = Put::after_header(out);
    w.put(body);
    w.finish(BatchKind::Records, count, base, stamp, max_timestamp_ms)
}

#[cfg(test)]
mod tests {

    /// A batch based just below the offset limit parses; one based at it is
    /// damage (its checksum matches, so only the range check catches it).
    #[test]
    fn a_batch_based_at_the_offset_limit_is_refused() {
        let rec = [RecordIn {
            payload: Bytes::from_static(b"x"),
            ..RecordIn::default()
        }];
        let mut ok = Vec::new();
        encode_records(&mut ok, Offset(Offset::LIMIT.0 - 1), 0, 1, &rec);
        assert_eq!(
            parse_batch(&ok).unwrap().base_offset,
            Offset(Offset::LIMIT.0 - 1)
        );
        let mut bad = Vec::new();
        encode_records(&mut bad, Offset::LIMIT, 0, 1, &rec);
        assert_eq!(
            parse_batch(&bad),
            Err(FrameError::OffsetRange(Offset::LIMIT.0))
        );
    }

    use super::*;

    fn rec(p: &str) -> RecordIn {
        RecordIn {
            timestamp_ms: 7,
            key: Some(Bytes::from_static(b"k")),
            headers: vec![("h".into(), Bytes::from_static(b"v"))],
            payload: Bytes::copy_from_slice(p.as_bytes()),
        }
    }

    #[test]
    fn records_round_trip_and_every_bit_flip_is_caught() {
        let mut out = Vec::new();
        let h = encode_records(&mut out, Offset(10), 3, 9, &[rec("a"), rec("bc")]);
        assert_eq!(h.len as usize, out.len());
        let parsed = parse_batch(&out).unwrap();
        assert_eq!(parsed, h);
        let bytes = Bytes::from(out.clone());
        let mut got = Vec::new();
        for_each_record(&bytes, &parsed, Offset(0), |r| {
            got.push(r);
            true
        })
        .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].offset, Offset(11));
        assert_eq!(&got[1].payload[..], b"bc");
        assert_eq!(got[0].headers.iter().next(), Some(("h", &b"v"[..])));
        for byte in 4..out.len() {
            let mut bad = out.clone();
            bad[byte] ^= 0x10;
            assert!(parse_batch(&bad).is_err(), "flip at {byte} not caught");
        }
    }

    #[test]
    fn reads_started_where_the_last_stopped_see_the_same_records() {
        let records: Vec<_> = (0..300)
            .map(|i| {
                let mut r = rec(&"x".repeat(i % 37));
                if i % 3 == 0 {
                    r.key = None;
                    r.headers.clear();
                }
                r
            })
            .collect();
        let mut out = Vec::new();
        let h = encode_records(&mut out, Offset(1000), 3, 9, &records);
        let bytes = Bytes::from(out);
        let mut whole = Vec::new();
        for_each_record(&bytes, &h, Offset(0), |r| {
            whole.push(r);
            true
        })
        .unwrap();
        assert_eq!(whole.len(), 300);
        for step in [1usize, 7, 16, 299, 300] {
            let (mut from, mut pos, mut got) = (Offset(1000), None, Vec::new());
            loop {
                let mut n = 0;
                let stopped = for_each_record_from(&bytes, &h, from, pos, |r| {
                    if n == step {
                        return false;
                    }
                    n += 1;
                    from = r.offset.next();
                    got.push(r);
                    true
                })
                .unwrap();
                match stopped {
                    Some(p) => {
                        assert_eq!(Offset(1000).plus(p.index as u64), from);
                        pos = Some(p);
                    }
                    None => break,
                }
            }
            assert_eq!(got, whole, "reading {step} at a time");
        }
        // A start below `from` steps forward to it.
        let p = for_each_record_from(&bytes, &h, Offset(1010), None, |_| false)
            .unwrap()
            .unwrap();
        assert_eq!(p.index, 10);
        let mut first = None;
        for_each_record_from(&bytes, &h, Offset(1020), Some(p), |r| {
            first = Some(r.offset);
            false
        })
        .unwrap();
        assert_eq!(first, Some(Offset(1020)));
        // A position that does not fit the batch is an error, not a panic.
        for bad in [
            RecordPos { index: 0, at: 5 },
            RecordPos { index: 2, at: 0 },
            RecordPos { index: 400, at: 0 },
            RecordPos {
                index: 0,
                at: usize::MAX,
            },
        ] {
            assert!(
                for_each_record_from(&bytes, &h, Offset(0), Some(bad), |_| true).is_err(),
                "{bad:?}"
            );
        }
    }

    /// Initialised bytes seen as possibly uninitialised (the encoders only
    /// write through it).
    fn uninit(b: &mut [u8]) -> &mut [MaybeUninit<u8>] {
        // SAFETY: same layout; nothing writes uninitialised bytes through it.
        unsafe { &mut *(std::ptr::from_mut::<[u8]>(b) as *mut [MaybeUninit<u8>]) }
    }

    #[test]
    fn encoding_into_memory_that_held_anything_writes_the_same_batch() {
        let records = [rec("a"), rec(""), rec("payload")];
        let mut want = Vec::new();
        let h = encode_records(&mut want, Offset(5), 2, 3, &records);
        assert_eq!(want.len(), records_batch_len(&records));
        let mut got = vec![0xA5; want.len()];
        assert_eq!(
            encode_records_into(uninit(&mut got), Offset(5), 2, 3, &records),
            h
        );
        assert_eq!(got, want);
        // Control and group batches: the same bytes whatever the memory
        // held, and each parses as what it was encoded as.
        for body in [&b""[..], b"state"] {
            let encode = |fill: u8, kind| {
                let mut out = vec![fill; BATCH_HEADER_BYTES + body.len()];
                let h = match kind {
                    BatchKind::Control => {
                        encode_control_into(uninit(&mut out), Offset(9), 1, 1, body)
                    }
                    _ => encode_group_into(uninit(&mut out), Offset(9), 1, 1, body),
                };
                (h, out)
            };
            for kind in [BatchKind::Control, BatchKind::Group] {
                let (h, zeros) = encode(0, kind);
                assert_eq!(encode(0xA5, kind), (h, zeros.clone()));
                assert_eq!(parse_batch(&zeros).unwrap(), h);
                assert_eq!(
                    (h.kind, h.offsets()),
                    (kind, u64::from(kind == BatchKind::Control))
                );
                assert_eq!(&zeros[BATCH_HEADER_BYTES..], body);
            }
        }
    }

    #[test]
    #[should_panic(expected = "batch buffer sized wrong")]
    fn a_buffer_larger_than_the_batch_is_refused() {
        let mut out = vec![0; records_batch_len(&[rec("a")]) + 1];
        encode_records_into(uninit(&mut out), Offset(0), 0, 0, &[rec("a")]);
    }

    fn any_record() -> impl proptest::strategy::Strategy<Value = RecordIn> {
        use proptest::prelude::*;
        let bytes = |n| proptest::collection::vec(any::<u8>(), 0..n);
        (
            any::<u64>(),
            proptest::option::of(bytes(8)),
            proptest::collection::vec(("[a-zé]{0,3}", bytes(4)), 0..3),
            bytes(40),
        )
            .prop_map(|(ts, key, headers, payload)| RecordIn {
                timestamp_ms: ts,
                key: key.map(Bytes::from),
                headers: headers
                    .into_iter()
                    .map(|(n, v)| (n, Bytes::from(v)))
                    .collect(),
                payload: Bytes::from(payload),
            })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// The body check accepts exactly the bodies the decoder reads to
        /// their end (well-formed, changed at one byte, cut, grown), and a
        /// copy of a records batch is the batch its records encode to.
        #[test]
        fn the_body_check_agrees_with_the_decoder_and_a_copy_is_a_fresh_encoding(
            records in proptest::collection::vec(any_record(), 1..6),
            at in proptest::prelude::any::<proptest::sample::Index>(),
            byte in proptest::prelude::any::<u8>(),
            change in 0..4u8,
        ) {
            let mut batch = Vec::new();
            let h = encode_records(&mut batch, Offset(100), 4, 2, &records);
            let body = batch[BATCH_HEADER_BYTES..].to_vec();
            proptest::prop_assert_eq!(
                check_records_body(&body, h.record_count),
                Ok(h.max_timestamp_ms)
            );
            let mut copy = vec![0xA5; batch.len()];
            let c = encode_records_copy_into(
                uninit(&mut copy),
                Offset(7),
                (0, 9),
                (h.record_count, h.max_timestamp_ms),
                &body,
            );
            let mut fresh = Vec::new();
            proptest::prop_assert_eq!(encode_records(&mut fresh, Offset(7), 0, 9, &records), c);
            proptest::prop_assert_eq!(&copy, &fresh);

            let mut bad = body.clone();
            match change {
                0 => bad[at.index(body.len())] = byte,
                1 => bad.truncate(at.index(body.len())),
                2 => bad.push(byte),
                _ => bad.insert(at.index(body.len()), byte),
            }
            // What the decoder makes of it, reading every record.
            let mut header = h;
            header.len = (BATCH_HEADER_BYTES + bad.len()) as u32;
            let mut whole = batch[..BATCH_HEADER_BYTES].to_vec();
            whole.extend_from_slice(&bad);
            let whole = Bytes::from(whole);
            let mut end = 0;
            let decoded = for_each_record(&whole, &header, Offset(0), |r| {
                // A record ends with its payload.
                end = r.payload.as_ptr() as usize + r.payload.len();
                true
            });
            let checked = check_records_body(&bad, h.record_count).map(|_| ());
            match decoded {
                Err(e) => proptest::prop_assert_eq!(checked, Err(e)),
                // Every record read: the check also refuses bytes after the
                // last one, which the decoder never looks at.
                Ok(()) if end == whole.as_ptr() as usize + whole.len() => {
                    proptest::prop_assert_eq!(checked, Ok(()))
                }
                Ok(()) => proptest::prop_assert_eq!(
                    checked,
                    Err(FrameError::Body("bytes after the last record"))
                ),
            }
        }
    }

    #[test]
    fn truncated_batches_are_incomplete() {
        let mut out = Vec::new();
        encode_records(&mut out, Offset(0), 0, 0, &[rec("hello")]);
        for cut in 0..out.len() {
            assert!(parse_batch(&out[..cut]).is_err());
        }
    }
}

//! A shard's log: a sequence of segment files named by base offset, written
//! append-only with aligned (O_DIRECT) writes, with group commit.
//!
//! # Frontiers
//!
//! Every batch appended gets a log sequence number ([`Lsn`]: its end in the
//! stream of batch bytes, counted from the oldest segment at open) and, for
//! records, offsets. Three frontiers, each kept in both units, move forward
//! only and always satisfy `durable ≤ written ≤ queued`:
//!
//! * **queued** — encoded into the open write buffer, in memory only;
//! * **written** — handed to the disk and completed, not yet synced;
//! * **durable** — covered by a completed `fdatasync`.
//!
//! They live in one `Frontiers` value whose only mutators (`queue`,
//! `mark_written`, `mark_durable`) assert both rules on every update: no
//! code path can move a frontier without the check.
//!
//! An appender waits ([`ShardLog::wait`]) for its batch's lsn to reach the
//! frontier it asked for. Readers see records up to the durable frontier
//! only: on one broker that is the committed tail, and a record a reader saw
//! can never vanish in a crash.
//!
//! # Group commit
//!
//! `append` is synchronous: it encodes the batch straight into the aligned
//! memory the flush will write (see `Chunk`) and returns the batch's lsn.
//! The flusher (one task per shard, [`ShardLog::run_flusher`]) takes
//! everything queued, writes it (in pieces that tile the segment, at most
//! `io_depth` in flight) with one `fdatasync`, then wakes every caller
//! waiting on a frontier at or below what it reached. The written pieces
//! become the tail cache's memory as they are (what the cache keeps of a
//! piece it keeps little of is copied out, so the piece is freed).
//!
//! Every batch carries the stamp of the flush that writes it, and a flush is
//! written only once the one before it is synced. Recovery relies on both to
//! tell a torn last write from damage to older data (see
//! `look_past_damage`): a flusher that wrote a flush while an earlier one
//! was still unsynced would have to change that rule.
//!
//! # Partial pages
//!
//! O_DIRECT writes whole pages. The log keeps the last partial page of the
//! active segment in memory and rewrites it, extended, on the next flush. The
//! rewritten prefix is byte-identical to what is on disk, so a write torn at
//! any byte leaves the previously durable bytes intact.
//!
//! # Failure
//!
//! A failed write or fsync stops the shard: every waiter gets
//! [`LogError::Stopped`], further appends are refused, and nothing is retried
//! (after a failed fsync the kernel may have dropped the dirty pages, so a
//! retry that "succeeds" would be a lie). So does a flush dropped while its
//! round is in flight: what the round took from the queue is gone from it.

use crate::format::{
    self, encode_control_into, encode_group_into, encode_records_into, BatchHeader, BatchKind,
    FrameError, Record, RecordIn,
};
use crate::marks::{self, Clean, CLEAN_MARK, TAIL_MARK};
use crate::notify::WaitList;
use crate::storage::{self, align_down, align_up, PageBuf, Storage, StorageFile, ALIGN};
use crate::types::Offset;
use bytes::Bytes;
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Settings of one shard log. Sized once, at open.
#[derive(Clone, Debug)]
pub struct LogConfig {
    /// A segment rolls when the next batch would take it past this size.
    pub segment_bytes: u64,
    /// Delete the oldest sealed segments while the shard holds more than this.
    pub retention_bytes: Option<u64>,
    /// Delete sealed segments whose newest record is older than this.
    pub retention_ms: Option<u64>,
    /// Recent batches kept in memory for tail reads.
    pub read_cache_bytes: usize,
    /// Most writes in flight at once for one flush.
    pub io_depth: usize,
    /// A flush is written in pieces of about this many bytes (a multiple
    /// of 4 KiB); a batch larger than this is written as one piece.
    pub write_chunk_bytes: usize,
    /// One sparse-index entry per this many bytes of segment.
    pub index_interval_bytes: u64,
    /// Appends wait (see [`ShardLog::wait_room`]) while more than this is queued.
    pub max_queued_bytes: usize,
    /// Bytes read at a time by cold reads and recovery.
    pub read_chunk_bytes: usize,
    /// Chunks of cold reads kept for the next read: a consumer group or
    /// reader working through a backlog in small polls reads each chunk from
    /// disk once, not once a poll, and has the next one read ahead (see
    /// [`ShardLog::run_read_ahead`]). Two per reader moving through the
    /// shard at once (the chunk it is in and the next one); read-ahead is
    /// off below two.
    pub cold_chunks: usize,
    /// Reserve the active segment's blocks ahead of its writes (fallocate,
    /// [`Self::preallocate_step`] bytes at a time), so a flush writes inside
    /// the file instead of growing it. On ext4 an O_DIRECT write that grows
    /// the file is handed by io_uring to a kernel worker thread (the inode
    /// lock it needs cannot be taken without blocking); one into reserved
    /// blocks is issued inline, and the `fdatasync` after it is cheaper.
    /// Small flushes also write zeros ahead of their data inside the
    /// reservation (see `write_chunk`), so that later flushes overwrite
    /// written blocks. Sealing cuts the reservation off; recovery reads the
    /// zeros past the last batch of the last segment as its end.
    pub preallocate: bool,
    /// How far ahead of the data the active segment is reserved at most: a
    /// flush whose writes would pass the reservation first extends it, to
    /// the next power of two past its writes (at least 256 KiB) while that
    /// is smaller than this, else to the next multiple of this (so a crash
    /// leaves at most this much to scan, and a shard barely written holds
    /// little disk).
    pub preallocate_step: u64,
    /// Free space the disk keeps in hand (`storage::free_space_floor`: 0 is
    /// the smaller of 256 MiB and 5 % of the disk). A reservation is made
    /// only while what is free beyond it is at least twice the reservation:
    /// blocks reserved ahead are an optimisation, and must not take the
    /// room that publishes admitted against the free space will write into.
    pub min_free_bytes: u64,
}

/// Index of the first nonzero byte of `b`. Recovery runs this over the
/// zeros of a reserved tail (megabytes per shard at every open), so it tests
/// 64 bytes at a time (a loop the compiler vectorises) before looking for
/// the byte.
fn first_nonzero(b: &[u8]) -> Option<usize> {
    const BLOCK: usize = 64;
    let mut blocks = b.chunks_exact(BLOCK);
    let mut at = 0;
    for block in blocks.by_ref() {
        if !block.iter().all(|x| *x == 0) {
            return block.iter().position(|x| *x != 0).map(|n| at + n);
        }
        at += BLOCK;
    }
    blocks
        .remainder()
        .iter()
        .position(|x| *x != 0)
        .map(|n| at + n)
}

/// Zeros a small flush round writes ahead of its data when preallocation is
/// on (see `write_chunk`). Against the piece a round adds, the rounds that
/// follow it find written blocks for this many bytes of data.
const ZERO_AHEAD_PIECE: usize = 256 << 10;
/// A round writes a piece of zeros when fewer than this many bytes of
/// written zeros are left past its end.
const ZERO_AHEAD_LOW: u64 = 64 << 10;
/// Largest chunk of data (a round's last chunk: the part in the segment that
/// stays active) that writes zeros ahead. A disk near
/// its bandwidth makes rounds larger than this (more data gathers while each
/// one is written), so zeros never take bandwidth the data needs.
const ZERO_AHEAD_ROUND: usize = 64 << 10;

thread_local! {
    /// A piece of zeros this thread's logs write ahead of small rounds,
    /// kept between writes so that it is not filled again each time (a
    /// DMA write only reads it). One a thread (a core), not one a shard:
    /// a core may own thousands of shards.
    static ZEROS: std::cell::RefCell<Option<PageBuf>> = const { std::cell::RefCell::new(None) };
}

/// At least `len` zero bytes to write from (`len` a multiple of [`ALIGN`]).
fn take_zeros(len: usize) -> PageBuf {
    match ZEROS.with(|z| z.borrow_mut().take()) {
        Some(b) if b.writable() >= len => b,
        _ => PageBuf::zeroed(len.max(ZERO_AHEAD_PIECE)),
    }
}

/// Keep a written piece of zeros for the next [`take_zeros`].
fn give_back_zeros(buf: PageBuf) {
    ZEROS.with(|z| {
        let mut z = z.borrow_mut();
        if z.as_ref().is_none_or(|k| k.writable() < buf.writable()) {
            *z = Some(buf);
        }
    });
}
/// Smallest reservation step. A segment's reservation grows to the next
/// power of two past its writes (at least this) until that reaches
/// `preallocate_step`, then a step at a time: a shard that is barely written
/// reserves little disk (thousands of shards would otherwise each hold a
/// full step), and one written fast reaches full steps after a few extends.
const MIN_RESERVE_STEP: u64 = 256 << 10;

/// How far a segment whose writes end at `need` is reserved, with steps of
/// at most `step` (see [`MIN_RESERVE_STEP`]).
fn reservation_for(need: u64, step: u64) -> u64 {
    let step = step.max(ALIGN as u64);
    let grow = need.max(MIN_RESERVE_STEP).checked_next_power_of_two();
    match grow {
        Some(to) if to < step => to,
        _ => need.div_ceil(step).saturating_mul(step),
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            segment_bytes: 128 << 20,
            retention_bytes: None,
            retention_ms: None,
            read_cache_bytes: 8 << 20,
            io_depth: 8,
            write_chunk_bytes: 1 << 20,
            index_interval_bytes: 4096,
            max_queued_bytes: 64 << 20,
            read_chunk_bytes: 256 << 10,
            cold_chunks: 8,
            preallocate: false,
            preallocate_step: 16 << 20,
            min_free_bytes: 0,
        }
    }
}

const _: () = assert!(ALIGN.is_power_of_two());

/// Fills in the bodies of group-state entries to open a new segment with.
pub type SnapshotProvider = Box<dyn Fn(&mut Vec<Vec<u8>>)>;

/// Which frontier an appender waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frontier {
    Queued,
    Written,
    Durable,
}

/// A log sequence number: a position in the stream of batch bytes of a log,
/// counted from the start of the oldest segment present when the log was
/// opened. An append's lsn is the position just past its batch. Lsns are
/// not stored and are meaningful only while the log stays open (they
/// restart from the retained bytes on the next open): they exist to say
/// "has this batch reached that frontier yet".
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);

    /// Bytes of the batch stream before this position.
    #[inline]
    pub fn get(self) -> u64 {
        self.0
    }

    /// The position `bytes` further on.
    #[inline]
    pub fn plus(self, bytes: u64) -> Lsn {
        Lsn(self.0 + bytes)
    }
}

impl fmt::Debug for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lsn {}", self.0)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A place in the log in both of its units: the offset and the lsn just
/// past the same batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Point {
    offset: Offset,
    lsn: Lsn,
}

impl Point {
    /// At or past `o` in both units.
    fn reaches(self, o: Point) -> bool {
        self.offset >= o.offset && self.lsn >= o.lsn
    }
}

/// The queued, written and durable frontiers of a log (see the module
/// docs), each in offsets and in lsns. The fields are private and the only
/// mutators are [`queue`](Self::queue), [`mark_written`](Self::mark_written)
/// and [`mark_durable`](Self::mark_durable): each asserts that its frontier
/// does not move back (in either unit) and that `durable ≤ written ≤ queued`
/// still holds, so a broken update stops the process where it happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Frontiers {
    queued: Point,
    written: Point,
    durable: Point,
}

impl Frontiers {
    /// All three at `at` (a log just opened: everything on disk is durable).
    fn new(at: Point) -> Frontiers {
        Frontiers {
            queued: at,
            written: at,
            durable: at,
        }
    }

    fn at(&self, frontier: Frontier) -> Point {
        match frontier {
            Frontier::Queued => self.queued,
            Frontier::Written => self.written,
            Frontier::Durable => self.durable,
        }
    }

    /// The offset just past the last batch at `frontier` (for `Queued`: the
    /// next offset to assign).
    fn offset(&self, frontier: Frontier) -> Offset {
        self.at(frontier).offset
    }

    /// The lsn just past the last batch at `frontier`.
    fn lsn(&self, frontier: Frontier) -> Lsn {
        self.at(frontier).lsn
    }

    /// A batch ending at `to` was encoded into the write buffer.
    fn queue(&mut self, to: Point) {
        self.advance(Frontier::Queued, to);
    }

    /// Everything up to `to` was written (and the writes completed).
    fn mark_written(&mut self, to: Point) {
        self.advance(Frontier::Written, to);
    }

    /// Everything up to `to` is covered by a completed fdatasync.
    fn mark_durable(&mut self, to: Point) {
        self.advance(Frontier::Durable, to);
    }

    fn advance(&mut self, frontier: Frontier, to: Point) {
        let slot = match frontier {
            Frontier::Queued => &mut self.queued,
            Frontier::Written => &mut self.written,
            Frontier::Durable => &mut self.durable,
        };
        assert!(
            to.reaches(*slot),
            "{frontier:?} frontier moved back: from {:?} / {:?} to {:?} / {:?}",
            slot.offset,
            slot.lsn,
            to.offset,
            to.lsn
        );
        *slot = to;
        assert!(
            self.queued.reaches(self.written) && self.written.reaches(self.durable),
            "frontier order broken by {frontier:?}: durable {:?} / {:?}, written {:?} / {:?}, \
             queued {:?} / {:?}",
            self.durable.offset,
            self.durable.lsn,
            self.written.offset,
            self.written.lsn,
            self.queued.offset,
            self.queued.lsn
        );
    }
}

/// Why the log refused or failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    #[error("shard stopped after an I/O failure: {0}")]
    Stopped(String),
    #[error("shard is closed")]
    Closed,
    #[error("{path}: corrupt at byte {position}: {reason}")]
    Corrupt {
        path: String,
        position: u64,
        reason: String,
    },
    #[error("I/O error: {0}")]
    Io(String),
    #[error("batch is empty")]
    Empty,
    #[error("records cannot be stored: {0}")]
    Invalid(String),
}

/// The result of an append: where the batch landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Appended {
    /// First offset taken (for group batches: the log's next offset at the time).
    pub base: Offset,
    /// Offsets taken.
    pub count: u32,
    /// Log sequence number just past the batch: wait on it.
    pub lsn: Lsn,
}

/// What a read returns.
#[derive(Clone, Debug, Default)]
pub struct ReadResult {
    pub records: Vec<Record>,
    /// The offset to read from next (past records and control records seen).
    pub next: Offset,
    /// The log's start offset (oldest retained).
    pub start: Offset,
    /// The visible (durable) end.
    pub end: Offset,
    /// Bytes the records carry (key, headers, payload), as the byte cap
    /// counted them.
    pub bytes: usize,
}

/// Limits of one read.
#[derive(Clone, Copy, Debug)]
pub struct ReadLimits {
    pub max_records: usize,
    pub max_bytes: usize,
}

/// One entry found during recovery that is not a record batch.
pub enum Replayed<'a> {
    /// A group-state entry's body.
    Group(&'a [u8]),
    /// A control record at this offset.
    Control(Offset, &'a [u8]),
}

/// Upper bounds (µs) of the fsync latency histogram buckets.
pub const SYNC_BUCKETS_US: [u64; 12] = [
    50, 100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 50_000, 100_000, 1_000_000,
];

/// fsync latency: a fixed-bucket histogram (cumulative buckets are computed
/// by whoever renders it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncStats {
    pub count: u64,
    pub sum_us: u64,
    /// Count per bucket of [`SYNC_BUCKETS_US`]; the last slot is "over".
    pub buckets: [u64; 13],
}

impl SyncStats {
    fn record(&mut self, us: u64) {
        self.count += 1;
        self.sum_us += us;
        let i = SYNC_BUCKETS_US
            .iter()
            .position(|b| us <= *b)
            .unwrap_or(SYNC_BUCKETS_US.len());
        self.buckets[i] += 1;
    }

    pub fn merge(&mut self, o: &SyncStats) {
        self.count += o.count;
        self.sum_us += o.sum_us;
        for (a, b) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *a += b;
        }
    }
}

/// Public, cheap snapshot of a log's shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogStats {
    pub start: Offset,
    pub end: Offset,
    pub queued: Offset,
    pub bytes: u64,
    pub segments: u32,
    pub stopped: Option<String>,
    pub flushes: u64,
    pub bytes_written: u64,
    pub sync: SyncStats,
    /// Cold reads that went to disk, and those served from a recent chunk.
    pub cold_reads: u64,
    pub cold_hits: u64,
    /// Chunks read ahead of a sequential reader (see [`ShardLog::run_read_ahead`]).
    pub cold_read_ahead: u64,
    /// Bytes held for reads: recent batches and cold-read chunks.
    pub cache_bytes: u64,
}

/// Bytes read from a segment by a cold read. Bytes below a segment's length
/// never change while the log is open, so a chunk stays valid until its
/// segment is removed.
struct ColdChunk {
    segment: Offset,
    pos: u64,
    bytes: Bytes,
    /// Segment positions `[start, end)` of a run of whole batches in this
    /// chunk whose checksums were verified: read again from the chunk, they
    /// are not checked again (the bytes cannot change in memory; the disk is
    /// what the checksum guards against). Small polls of a backlog otherwise
    /// re-check the same large batch once per poll.
    verified: (u64, u64),
    /// `Inner::cold_hits` when a read last used it (or it was kept): the
    /// least recently used chunk goes first.
    used: u64,
    /// Read ahead and not used yet: a reader is on its way to it, so it
    /// goes only after every chunk a reader has used.
    ahead: bool,
}

impl ColdChunk {
    fn holds(&self, segment: Offset, pos: u64, len: u64) -> bool {
        self.segment == segment
            && self.pos <= pos
            && pos + len <= self.pos + self.bytes.len() as u64
    }
}

struct Segment<F> {
    base: Offset,
    path: PathBuf,
    file: Rc<F>,
    /// Bytes of valid batches written (and completed) to the file.
    len: u64,
    /// The file's size as the log left it: at least `len`, more where
    /// blocks were reserved ahead (`LogConfig::preallocate`).
    reserved: u64,
    /// Bytes from the file's start known written, with data or with zeros
    /// written ahead of it: a write below this overwrites blocks that hold
    /// data already, so the `fdatasync` after it has no extent to convert.
    zeroed: u64,
    /// One past the last offset written into this segment.
    end: Offset,
    /// Sparse index: (first offset of a batch, its position), ascending.
    index: Vec<(Offset, u64)>,
    last_indexed_pos: Option<u64>,
    max_timestamp_ms: u64,
}

impl<F> Segment<F> {
    fn note_batch(&mut self, h: &BatchHeader, pos: u64, interval: u64) {
        let due = match self.last_indexed_pos {
            None => true,
            Some(last) => pos >= last + interval,
        };
        if due && h.offsets() > 0 {
            self.index.push((h.base_offset, pos));
            self.last_indexed_pos = Some(pos);
        }
        self.end = self.end.max(h.end_offset());
        self.max_timestamp_ms = self.max_timestamp_ms.max(h.max_timestamp_ms);
    }
}

/// Batches queued for one segment, encoded straight into the page-aligned
/// pieces a flush writes and the tail cache then keeps (no copy between).
///
/// Piece `k` holds the segment's bytes from `pieces[k].at` (a page boundary)
/// for its filled length. The first piece opens with room for the bytes of
/// the segment's partial last page before the chunk (copied in from
/// `tail_page` when it is written); each later piece opens with a copy of
/// the previous piece's partial last page (under 4 KiB), which it writes
/// again. So a batch always lies whole in one piece, every write starts on
/// a page, and a round larger than expected takes another piece rather
/// than reallocating and copying what it has.
struct Chunk {
    /// The segment this goes to; a new segment when it is past the active one.
    segment_base: Offset,
    /// Segment position of the chunk's first batch: the segment's length
    /// once everything queued before the chunk is written.
    start: u64,
    pieces: Vec<Piece>,
    /// Batch bytes queued.
    len: usize,
    /// Batch headers, their segment positions and the piece each is in.
    batches: Vec<(BatchHeader, u64, usize)>,
    /// Offset and lsn just past the chunk.
    end: Point,
}

struct Piece {
    /// Segment position of its first byte (a page boundary).
    at: u64,
    buf: PageBuf,
}

impl Chunk {
    fn new(segment_base: Offset, start: u64, end: Point) -> Chunk {
        Chunk {
            segment_base,
            start,
            pieces: Vec::new(),
            len: 0,
            batches: Vec::new(),
            end,
        }
    }

    /// Start a piece with room for `room` bytes of batches past what it
    /// carries over.
    fn add_piece(&mut self, room: usize) {
        let piece = match self.pieces.last() {
            None => {
                let at = align_down(self.start);
                let carry = (self.start - at) as usize;
                let mut buf = PageBuf::with_capacity(carry + room);
                // Overwritten with the segment's tail page when written (not
                // zeros meanwhile: zeros on disk would read as the end).
                buf.fill(carry, 0xA5);
                Piece { at, buf }
            }
            Some(p) => {
                let end = p.at + p.buf.len() as u64;
                let at = align_down(end);
                let carried = &p.buf.filled()[(at - p.at) as usize..];
                let mut buf = PageBuf::with_capacity(carried.len() + room);
                buf.extend_from_slice(carried);
                Piece { at, buf }
            }
        };
        self.pieces.push(piece);
    }
}

struct CachedBatch {
    header: BatchHeader,
    bytes: Bytes,
    /// Where it is on disk: its segment and byte position (for errors).
    segment: Offset,
    pos: u64,
}

struct Inner<F> {
    config: LogConfig,
    dir: PathBuf,
    segments: BTreeMap<Offset, Segment<F>>,
    start: Offset,
    /// Just past the last data record queued (0 with none in the log): the
    /// offsets from here to the end are control records.
    data_end: Offset,
    /// Queued, written, durable. The queued offset is the next to assign.
    frontiers: Frontiers,
    /// Projected length of the newest target segment once all pending flushes land.
    projected_len: u64,
    /// Bytes of that segment taken by the group snapshots it opened with
    /// (0 for a segment recovered at open: not known, and at most one roll
    /// early). They do not count toward `segment_bytes`: group state larger
    /// than a segment would otherwise roll a new segment, and write the
    /// snapshot again, for every batch.
    snapshot_len: u64,
    /// Base of the segment new appends go to: the active segment, or the one
    /// a queued roll will create.
    target_base: Offset,
    pending: VecDeque<Chunk>,
    pending_bytes: usize,
    /// Bytes the last round wrote: a new chunk's pieces are sized to hold
    /// about as much (see [`piece_room`]). One piece per batch would mean a
    /// write per batch and 4 KiB carried over per batch.
    chunk_hint: usize,
    /// Stamp of the flush that will write what is queued now (low 16 bits of
    /// its sequence number; see `format::BatchHeader::flush`). It moves on
    /// when a flush takes the queue, so every flush's batches carry one
    /// stamp and consecutive flushes different ones.
    flush_stamp: u16,
    /// Bytes of the active segment from its last page boundary to its end.
    tail_page: Vec<u8>,
    cache: VecDeque<CachedBatch>,
    cache_bytes: usize,
    /// Recent cold-read chunks, newest at the back (see `LogConfig::cold_chunks`).
    cold: VecDeque<ColdChunk>,
    /// The last batch joined from two kept chunks (see `straddle`), kept so
    /// that the small polls of a backlog do not copy it, and check its
    /// checksum, once per poll.
    joined: Option<Joined>,
    cold_hits: u64,
    cold_reads: u64,
    cold_read_ahead: u64,
    /// Chunks to read ahead of sequential readers, oldest first (at most
    /// `cold_chunks`): (segment, position).
    ahead: VecDeque<(Offset, u64)>,
    /// Cold reads in flight, a reader's or one ahead of readers: (segment,
    /// position, length). A reader that needs bytes one of them brings
    /// waits for it instead of reading them again.
    reading: Vec<(Offset, u64, u64)>,
    stopped: Option<String>,
    closed: bool,
    flushing: bool,
    /// Retention removed a segment and the directory sync after it failed:
    /// owed before the next removal.
    removal_unsynced: bool,
    flushes: u64,
    bytes_written: u64,
    sync: SyncStats,
    snapshot: Option<SnapshotProvider>,
    /// Complete group snapshots this process queued: (segment, lsn just
    /// past the snapshot's last batch). Retention removes a segment only
    /// once a later segment holds one of these durably: a snapshot that
    /// opens a segment recovered from disk may have been cut short by a
    /// crash, and the segments before it may hold the only copy of group
    /// state.
    covers: Vec<(Offset, Lsn)>,
}

impl<F> Inner<F> {
    /// A flush round failed or was abandoned: stop the shard (the first
    /// reason stands) and drop what was queued, which nothing will write.
    fn stop_after_round(&mut self, why: String) {
        if self.stopped.is_none() {
            tracing::error!(dir = %self.dir.display(), "shard stopped: {why}");
            self.stopped = Some(why);
        }
        self.pending.clear();
        self.pending_bytes = 0;
    }

    fn refuse(&self) -> Result<(), LogError> {
        if let Some(r) = &self.stopped {
            return Err(LogError::Stopped(r.clone()));
        }
        if self.closed {
            return Err(LogError::Closed);
        }
        Ok(())
    }

    fn active_base(&self) -> Offset {
        *self
            .segments
            .keys()
            .next_back()
            .expect("a log has a segment")
    }

    /// The chunk the next batch of `len` bytes goes into, rolling if needed.
    fn chunk_for(&mut self, len: usize) -> &mut Chunk {
        // Not the active segment: a roll may be queued or in flight (the
        // flusher creates the new segment when it reaches that chunk).
        let target_base = self.target_base;
        let data_len = self.projected_len - self.snapshot_len;
        // A segment is named by its first offset, so one that holds no
        // record yet (group entries only) cannot roll: the next one would
        // have its name.
        let base = self.frontiers.offset(Frontier::Queued);
        let roll =
            data_len > 0 && data_len + len as u64 > self.config.segment_bytes && base > target_base;
        if roll {
            self.projected_len = 0;
            self.snapshot_len = 0;
            self.target_base = base;
            let at = self.frontiers.at(Frontier::Queued);
            self.pending.push_back(Chunk::new(base, 0, at));
            // Every segment opens with a snapshot of group state, so that
            // retention deleting older segments never loses it.
            if let Some(snap) = self.snapshot.take() {
                let mut bodies = Vec::new();
                snap(&mut bodies);
                self.snapshot = Some(snap);
                self.queue_snapshot(&bodies);
            }
        } else if self.pending.back().map(|c| c.segment_base) != Some(target_base) {
            let at = self.frontiers.at(Frontier::Queued);
            self.pending
                .push_back(Chunk::new(target_base, self.projected_len, at));
        }
        self.pending.back_mut().unwrap()
    }

    /// Queue group-state snapshot bodies into the chunk `chunk_for` made
    /// ready (they do not count toward `segment_bytes`), and note the
    /// complete snapshot for retention (see `covers`).
    fn queue_snapshot(&mut self, bodies: &[Vec<u8>]) {
        let before = self.projected_len;
        for body in bodies {
            let len = format::BATCH_HEADER_BYTES + body.len();
            self.push_batch(len, |out, next, flush| {
                encode_group_into(out, next, 0, flush, body)
            });
        }
        self.snapshot_len += self.projected_len - before;
        let point = (self.target_base, self.frontiers.lsn(Frontier::Queued));
        self.covers.push(point);
    }

    /// Encode a batch of `len` bytes into the last chunk (`chunk_for`
    /// made it ready), in a new piece if the last one has no room for it.
    fn push_batch(
        &mut self,
        len: usize,
        encode: impl FnOnce(&mut [MaybeUninit<u8>], Offset, u16) -> BatchHeader,
    ) -> Appended {
        let queued = self.frontiers.at(Frontier::Queued);
        let flush = self.flush_stamp;
        let segment_room = self
            .config
            .segment_bytes
            .saturating_sub(self.projected_len - self.snapshot_len);
        let (hint, max_piece) = (self.chunk_hint, self.config.write_chunk_bytes);
        let chunk = self.pending.back_mut().expect("chunk_for first");
        if chunk.pieces.last().is_none_or(|p| p.buf.room() < len) {
            chunk.add_piece(piece_room(hint, chunk.len, len, segment_room, max_piece));
        }
        let k = chunk.pieces.len() - 1;
        let piece = &mut chunk.pieces[k];
        let pos = piece.at + piece.buf.len() as u64;
        // SAFETY: `encode` is one of the `format::encode_*_into`, which
        // write every byte of the batch they are given or panic.
        let h = unsafe {
            piece
                .buf
                .append_with(len, |out| encode(out, queued.offset, flush))
        };
        debug_assert_eq!(h.len as usize, len);
        let end = Point {
            offset: h.end_offset(),
            lsn: queued.lsn.plus(h.len as u64),
        };
        chunk.batches.push((h, pos, k));
        chunk.len += len;
        chunk.end = end;
        self.frontiers.queue(end);
        self.projected_len += h.len as u64;
        self.pending_bytes += h.len as usize;
        Appended {
            base: h.base_offset,
            count: h.offsets() as u32,
            lsn: end.lsn,
        }
    }

    fn append_with(
        &mut self,
        len: usize,
        encode: impl FnOnce(&mut [MaybeUninit<u8>], Offset, u16) -> BatchHeader,
    ) -> Result<Appended, LogError> {
        self.refuse()?;
        // Offsets past the limit read back as damage; no log gets near it
        // (a record batch takes at most 2^32 offsets).
        if self.frontiers.offset(Frontier::Queued).0 >= Offset::LIMIT.0 - (1 << 32) {
            return Err(LogError::Invalid(format!(
                "the log is at offset {}, the most a log holds",
                self.frontiers.offset(Frontier::Queued)
            )));
        }
        self.chunk_for(len);
        Ok(self.push_batch(len, encode))
    }
}

/// Least room a piece gets when the last round tells nothing (the first
/// round of a log) or the round has outgrown what it told: a round of small
/// batches past its first piece does not go on in a write per page.
const MIN_PIECE: usize = 64 << 10;

/// Bytes of batches a new piece of a chunk has room for, its first batch
/// being `len` bytes: what is left of the last round's size (`hint`; a
/// round takes every chunk queued, so the next is likely about as large)
/// past the `queued` bytes the chunk holds; [`MIN_PIECE`] when there was
/// no last round; once the round has outgrown the last one, as much again
/// as it holds, at least [`MIN_PIECE`]. At most `max_piece` (a write each)
/// and what the segment has left, and never less than the batch. A shard
/// of small rounds so holds a page or so per round, however many shards a
/// core has.
fn piece_room(
    hint: usize,
    queued: usize,
    len: usize,
    segment_room: u64,
    max_piece: usize,
) -> usize {
    let left = hint.saturating_sub(queued);
    let want = if left > 0 {
        left
    } else if hint == 0 && queued == 0 {
        MIN_PIECE
    } else {
        queued.max(MIN_PIECE)
    };
    want.min(max_piece)
        .min(usize::try_from(segment_room).unwrap_or(usize::MAX))
        .max(len)
}

/// A shard's log. Cheap to clone; all clones live on the owning core.
pub struct ShardLog<S: Storage> {
    storage: S,
    inner: Rc<RefCell<Inner<S::File>>>,
    /// Woken when the durable frontier moves, the log stops or closes.
    progress: Rc<WaitList>,
    /// Woken when something is queued (the flusher waits on it) or room frees.
    queued: Rc<WaitList>,
    /// Woken when the written frontier moves, for waiters on
    /// [`Frontier::Written`] (apart from `progress` so that durable waiters,
    /// the many, are not woken once per write as well).
    written: Rc<WaitList>,
    /// Woken when a chunk is wanted ahead of a reader, or one read ahead
    /// arrives (or the log closes).
    ahead: Rc<WaitList>,
    /// Where recent reads stopped inside a batch (see [`ReadHints`]).
    hints: Rc<RefCell<ReadHints>>,
}

impl<S: Storage> Clone for ShardLog<S> {
    fn clone(&self) -> Self {
        ShardLog {
            storage: self.storage.clone(),
            inner: self.inner.clone(),
            progress: self.progress.clone(),
            queued: self.queued.clone(),
            written: self.written.clone(),
            ahead: self.ahead.clone(),
            hints: self.hints.clone(),
        }
    }
}

impl<S: Storage> fmt::Debug for ShardLog<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = self.inner.borrow();
        write!(f, "ShardLog({})", i.dir.display())
    }
}

fn segment_name(base: Offset) -> String {
    format!("{:020}.log", base.0)
}

/// A log closed cleanly (`clean`) must end exactly where it did then, in
/// its newest segment (`base`, scanned to `valid_len`, `problem` where the
/// scan stopped short): nothing can have been torn since. Checked before
/// recovery cuts anything.
fn held_to_clean<F>(
    clean: Option<Clean>,
    path: &Path,
    base: Offset,
    seg: &Segment<F>,
    valid_len: u64,
    problem: Option<(u64, &str)>,
) -> Result<(), LogError> {
    let Some(c) = clean else { return Ok(()) };
    if c.tail_base == base && c.tail_len == valid_len && c.end == seg.end {
        // Zeros past the end at most (a reservation cut short).
        return Ok(());
    }
    if (base, valid_len) > (c.tail_base, c.tail_len) && seg.end >= c.end {
        // Whole past where it was closed, and written on since by a broker
        // that did not take the mark away (an older one): nothing of what
        // the mark vouches for is missing, and what came after it is
        // recovered as after a crash.
        tracing::warn!(
            segment = %path.display(),
            "the log goes on past where it was closed cleanly (offset {}, {CLEAN_MARK}); \
             recovering what follows as after a crash",
            c.end
        );
        return Ok(());
    }
    let found = match problem {
        Some((pos, reason)) => format!("it is damaged at byte {pos}: {reason}"),
        None => format!(
            "it now ends at offset {} (byte {valid_len} of this segment)",
            seg.end
        ),
    };
    Err(LogError::Corrupt {
        path: path.display().to_string(),
        position: problem.map_or(valid_len, |p| p.0),
        reason: format!(
            "the shard was closed cleanly with its log ending at offset {} (byte {} of the \
             segment starting at offset {}, {CLEAN_MARK}), but {found}; no write can have been \
             torn since, so acknowledged records are damaged or missing, and the shard is not \
             opened (to open it anyway, accepting the loss, remove {CLEAN_MARK})",
            c.end, c.tail_len, c.tail_base
        ),
    })
}

/// The shard's marks (see [`marks`]); one that cannot be read or decoded
/// refuses the open.
async fn read_marks<S: Storage>(
    storage: &S,
    dir: &Path,
) -> Result<(Option<Offset>, Option<Clean>), LogError> {
    async fn read<S: Storage, T>(
        storage: &S,
        dir: &Path,
        name: &str,
        decode: fn(&[u8]) -> Option<T>,
    ) -> Result<Option<T>, LogError> {
        let path = dir.join(name);
        let Some(bytes) = storage
            .read_file(&path)
            .await
            .map_err(|e| io_err(&format!("read {}", path.display()), e))?
        else {
            return Ok(None);
        };
        match decode(&bytes) {
            Some(v) => Ok(Some(v)),
            None => Err(LogError::Corrupt {
                path: path.display().to_string(),
                position: 0,
                reason: format!(
                    "not a valid {name} ({} bytes); it is written whole or not at all, so this \
                     is damage (see docs/operations.md before removing it)",
                    bytes.len()
                ),
            }),
        }
    }
    Ok((
        read(storage, dir, TAIL_MARK, marks::decode_tail).await?,
        read(storage, dir, CLEAN_MARK, marks::decode_clean).await?,
    ))
}

fn io_err(what: &str, e: std::io::Error) -> LogError {
    LogError::Io(format!("{what}: {e}"))
}

/// Cut a segment file back to `len` bytes (its data) and make that durable:
/// how recovery trims a torn tail, sealing drops the reservation, and a clean
/// close gives it back. `what` names the step in errors.
async fn cut_to<F: StorageFile>(file: &F, len: u64, what: &str) -> Result<(), LogError> {
    file.truncate(len)
        .await
        .map_err(|e| io_err(&format!("{what}: truncate"), e))?;
    file.sync()
        .await
        .map_err(|e| io_err(&format!("{what}: sync"), e))
}

impl<S: Storage> ShardLog<S> {
    /// Open (or create) the log in `dir`, recovering its tail. Entries that
    /// are not user records are passed to `replay` in log order.
    pub async fn open(
        storage: S,
        dir: &Path,
        config: LogConfig,
        replay: &mut dyn FnMut(Replayed<'_>),
    ) -> Result<Self, LogError> {
        assert!(config.write_chunk_bytes.is_multiple_of(ALIGN) && config.write_chunk_bytes > 0);
        assert!(config.io_depth > 0, "io_depth must be at least 1");
        storage
            .create_dir_all(dir)
            .await
            .map_err(|e| io_err("create shard directory", e))?;
        let mut bases: Vec<Offset> = storage
            .list_dir(dir)
            .await
            .map_err(|e| io_err("list shard directory", e))?
            .iter()
            .filter_map(|n| n.strip_suffix(".log")?.parse::<u64>().ok().map(Offset))
            .collect();
        bases.sort();
        let (tail_mark, clean) = read_marks(&storage, dir).await?;
        if let Some(newest) = tail_mark {
            if bases.last().is_none_or(|b| *b < newest) {
                let left = match bases.last() {
                    None => "no segment file is left".to_string(),
                    Some(b) => format!("the newest segment file left starts at offset {b}"),
                };
                return Err(LogError::Corrupt {
                    path: dir.join(segment_name(newest)).display().to_string(),
                    position: 0,
                    reason: format!(
                        "missing: the log had rolled to a segment starting at offset {newest} \
                         ({TAIL_MARK}), but {left}; segment files were lost, and opening the \
                         shard would give their offsets out again, so it is not opened (to \
                         open it anyway, accepting the loss, remove {TAIL_MARK}, and \
                         {CLEAN_MARK} if there is one)"
                    ),
                });
            }
        }

        let mut segments = BTreeMap::new();
        let mut expected: Option<Offset> = None;
        let mut lsn = Lsn::ZERO;
        let mut tail_page = Vec::new();
        // Stamp of the last flush found on disk: new flushes continue after it.
        let mut last_flush: Option<u16> = None;
        let mut data_end = Offset::ZERO;
        let count = bases.len();
        for (i, base) in bases.iter().copied().enumerate() {
            let path = dir.join(segment_name(base));
            let is_tail = i + 1 == count;
            if base >= Offset::LIMIT {
                return Err(LogError::Corrupt {
                    path: path.display().to_string(),
                    position: 0,
                    reason: format!("segment named for offset {base}, past any a log reaches"),
                });
            }
            if let Some(exp) = expected {
                if exp != base {
                    return Err(LogError::Corrupt {
                        path: path.display().to_string(),
                        position: 0,
                        reason: format!(
                            "segment starts at offset {base} but the previous one ends at {exp}"
                        ),
                    });
                }
            }
            let file = storage
                .open(&path, false)
                .await
                .map_err(|e| io_err("open segment", e))?;
            let size = file.size().await.map_err(|e| io_err("size", e))?;
            let mut seg = Segment {
                base,
                path: path.clone(),
                file: Rc::new(file),
                len: 0,
                reserved: size,
                zeroed: 0,
                end: base,
                index: Vec::new(),
                last_indexed_pos: None,
                max_timestamp_ms: 0,
            };
            let mut notes = Vec::new();
            let scanned = scan_segment(&seg, size, &config, replay, &mut notes).await?;
            let valid_len = scanned.valid_len;
            for (h, pos) in &notes {
                seg.note_batch(h, *pos, config.index_interval_bytes);
                if h.kind == BatchKind::Records {
                    data_end = h.end_offset();
                }
            }
            if let Some((h, _)) = notes.last() {
                last_flush = Some(h.flush);
            }
            if is_tail && scanned.problem.is_none() {
                held_to_clean(clean, &path, base, &seg, valid_len, None)?;
            }
            if let Some((pos, reason)) = scanned.problem {
                if !is_tail {
                    return Err(LogError::Corrupt {
                        path: path.display().to_string(),
                        position: pos,
                        reason,
                    });
                }
                // The last segment: a torn last write is cut off, damage to
                // data written before it refuses the open (see
                // `look_past_damage`).
                let chunk = config.read_chunk_bytes.max(1 << 20);
                let past = look_past_damage(&*seg.file, size, pos, scanned.expected, chunk).await?;
                if !matches!(
                    past,
                    Some(PastDamage {
                        later_flush: Some(_),
                        ..
                    })
                ) {
                    held_to_clean(clean, &path, base, &seg, valid_len, Some((pos, &reason)))?;
                }
                match past {
                    Some(PastDamage {
                        first: (q, h),
                        later_flush: Some((q2, h2)),
                    }) => {
                        return Err(LogError::Corrupt {
                            path: path.display().to_string(),
                            position: pos,
                            reason: format!(
                                "{reason}; the batch here should start at offset {}, but valid \
                                 batches written by more than one flush follow it (the next at \
                                 byte {q}, offset {}; one from a later flush at byte {q2}, \
                                 offset {}): this is damage to data written before the last \
                                 flush, not a torn write, and cutting the log here would drop \
                                 acknowledged records, so the shard is not opened",
                                scanned.expected, h.base_offset, h2.base_offset
                            ),
                        });
                    }
                    Some(PastDamage { first: (q, h), .. }) => {
                        tracing::warn!(
                            segment = %path.display(),
                            position = pos,
                            dropped = size - pos,
                            "truncating a torn last write: {reason}; the valid batches after it \
                             (from byte {q}, offset {}) were all written by the same, last flush, \
                             which never completed",
                            h.base_offset
                        );
                    }
                    // An unsealed tail normally ends in zeros (the partial
                    // last page, or preallocated space).
                    None if reason.starts_with("zero") => {}
                    None => {
                        tracing::warn!(
                            segment = %path.display(),
                            position = pos,
                            dropped = size - pos,
                            "truncating a torn or corrupt tail: {reason}"
                        );
                    }
                }
            }
            seg.len = valid_len;
            seg.zeroed = valid_len;
            if is_tail {
                if size != valid_len {
                    cut_to(&*seg.file, valid_len, "trim tail").await?;
                    seg.reserved = valid_len;
                }
                let page_start = align_down(valid_len);
                if valid_len > page_start {
                    let bytes = seg
                        .file
                        .read_at(page_start, (valid_len - page_start) as usize)
                        .await
                        .map_err(|e| io_err("read tail page", e))?;
                    tail_page = bytes.to_vec();
                }
            }
            lsn = lsn.plus(seg.len);
            expected = Some(seg.end);
            segments.insert(base, seg);
        }
        if segments.is_empty() {
            let path = dir.join(segment_name(Offset::ZERO));
            let file = storage
                .open(&path, true)
                .await
                .map_err(|e| io_err("create segment", e))?;
            storage
                .sync_dir(dir)
                .await
                .map_err(|e| io_err("sync shard directory", e))?;
            segments.insert(
                Offset::ZERO,
                Segment {
                    base: Offset::ZERO,
                    path,
                    file: Rc::new(file),
                    len: 0,
                    reserved: 0,
                    zeroed: 0,
                    end: Offset::ZERO,
                    index: Vec::new(),
                    last_indexed_pos: None,
                    max_timestamp_ms: 0,
                },
            );
        }
        // Before the log takes a write: a clean mark left behind would make
        // the next open after a crash refuse a torn write as damage, and
        // a log from before tail marks (or a new one) gets its first.
        if clean.is_some() {
            storage
                .remove_file(&dir.join(CLEAN_MARK))
                .await
                .map_err(|e| io_err(&format!("remove {CLEAN_MARK}"), e))?;
            storage
                .sync_dir(dir)
                .await
                .map_err(|e| io_err("sync shard directory", e))?;
        }
        if tail_mark.is_none() {
            let newest = *segments.keys().next_back().unwrap();
            storage
                .write_file_atomic(&dir.join(TAIL_MARK), &marks::encode_tail(newest))
                .await
                .map_err(|e| io_err(&format!("write {TAIL_MARK}"), e))?;
        }
        let start = *segments.keys().next().unwrap();
        let (end, projected_len, end_base) = {
            let tail = segments.values().next_back().unwrap();
            (tail.end, tail.len, tail.base)
        };
        let inner = Inner {
            flush_stamp: last_flush.map_or(1, |f| f.wrapping_add(1)),
            data_end,
            config,
            dir: dir.to_path_buf(),
            segments,
            start,
            frontiers: Frontiers::new(Point { offset: end, lsn }),
            projected_len,
            snapshot_len: 0,
            target_base: end_base,
            pending: VecDeque::new(),
            pending_bytes: 0,
            chunk_hint: 0,
            tail_page,
            cache: VecDeque::new(),
            cache_bytes: 0,
            cold: VecDeque::new(),
            joined: None,
            cold_hits: 0,
            cold_reads: 0,
            cold_read_ahead: 0,
            ahead: VecDeque::new(),
            reading: Vec::new(),
            stopped: None,
            closed: false,
            flushing: false,
            removal_unsynced: false,
            flushes: 0,
            bytes_written: 0,
            sync: SyncStats::default(),
            snapshot: None,
            covers: Vec::new(),
        };
        Ok(ShardLog {
            storage,
            inner: Rc::new(RefCell::new(inner)),
            progress: Rc::new(WaitList::new()),
            queued: Rc::new(WaitList::new()),
            written: Rc::new(WaitList::new()),
            ahead: Rc::new(WaitList::new()),
            hints: Rc::new(RefCell::new(ReadHints::default())),
        })
    }

    /// Set the provider of group-state snapshot bodies written at the start
    /// of every new segment, and queue one snapshot now: the segments
    /// recovered from disk cannot show that theirs are complete (a crash
    /// may have cut the newest short), so retention waits for this one (see
    /// `Inner::covers`). Call it once the group state is replayed.
    pub fn set_snapshot_provider(&self, f: SnapshotProvider) {
        let mut bodies = Vec::new();
        f(&mut bodies);
        let mut i = self.inner.borrow_mut();
        i.snapshot = Some(f);
        if i.refuse().is_err() {
            return;
        }
        // All in one segment: one roll decision for the whole snapshot. A
        // roll queues its own snapshot, which is as good. With no group
        // state there is nothing to queue, only the mark for retention.
        let before = i.target_base;
        if !bodies.is_empty() {
            let len = bodies
                .iter()
                .map(|b| format::BATCH_HEADER_BYTES + b.len())
                .sum();
            i.chunk_for(len);
        }
        if i.target_base == before {
            i.queue_snapshot(&bodies);
        }
        drop(i);
        self.queued.wake_all();
    }

    /// Queue a batch of records. Offsets are assigned now.
    pub fn append(&self, records: &[RecordIn]) -> Result<Appended, LogError> {
        if records.is_empty() {
            return Err(LogError::Empty);
        }
        let len = format::check_records(records).map_err(LogError::Invalid)?;
        let a = {
            let mut i = self.inner.borrow_mut();
            let a = i.append_with(len, |out, next, flush| {
                encode_records_into(out, next, 0, flush, records)
            })?;
            i.data_end = Offset(a.base.0 + u64::from(a.count));
            a
        };
        self.queued.wake_all();
        Ok(a)
    }

    /// Queue a control record (takes one offset, never delivered).
    pub fn append_control(&self, body: &[u8]) -> Result<Appended, LogError> {
        let len = format::BATCH_HEADER_BYTES + body.len();
        let a = self
            .inner
            .borrow_mut()
            .append_with(len, |out, next, flush| {
                encode_control_into(out, next, 0, flush, body)
            })?;
        self.queued.wake_all();
        Ok(a)
    }

    /// Queue a group-state entry (takes no offset).
    pub fn append_group(&self, body: &[u8]) -> Result<Appended, LogError> {
        let len = format::BATCH_HEADER_BYTES + body.len();
        let a = self
            .inner
            .borrow_mut()
            .append_with(len, |out, next, flush| {
                encode_group_into(out, next, 0, flush, body)
            })?;
        self.queued.wake_all();
        Ok(a)
    }

    /// Wait until less than the configured maximum is queued.
    pub async fn wait_room(&self) -> Result<(), LogError> {
        loop {
            {
                let i = self.inner.borrow();
                i.refuse()?;
                if i.pending_bytes < i.config.max_queued_bytes {
                    return Ok(());
                }
            }
            self.progress.wait().await;
        }
    }

    /// Wait until the batch ending at `lsn` has reached `frontier`.
    pub async fn wait(&self, lsn: Lsn, frontier: Frontier) -> Result<(), LogError> {
        loop {
            {
                let i = self.inner.borrow();
                if i.frontiers.lsn(frontier) >= lsn {
                    return Ok(());
                }
                i.refuse()?;
            }
            if frontier == Frontier::Written {
                // The written frontier moves without the durable one.
                futures_lite::future::or(self.progress.wait(), self.written.wait()).await;
            } else {
                self.progress.wait().await;
            }
        }
    }

    /// Wait until the visible end passes `offset` (a record at `offset` is
    /// readable), the log stops, or it closes.
    pub async fn wait_for_offset(&self, offset: Offset) -> Result<(), LogError> {
        loop {
            {
                let i = self.inner.borrow();
                if i.frontiers.offset(Frontier::Durable) > offset {
                    return Ok(());
                }
                i.refuse()?;
            }
            self.progress.wait().await;
        }
    }

    /// A future that resolves the next time the log makes progress (for
    /// callers composing their own wait with a timeout).
    pub fn progress(&self) -> Rc<WaitList> {
        self.progress.clone()
    }

    pub fn start(&self) -> Offset {
        self.inner.borrow().start
    }

    /// The visible (durable, committed) end: one past the last readable offset.
    pub fn end(&self) -> Offset {
        self.inner.borrow().frontiers.offset(Frontier::Durable)
    }

    /// Just past the last data record queued: every offset from here to
    /// the end is a control record (a generation start), settled and never
    /// delivered. 0 when the log holds no data record.
    pub fn data_end(&self) -> Offset {
        self.inner.borrow().data_end
    }

    /// One past the last offset assigned (queued).
    pub fn queued_end(&self) -> Offset {
        self.inner.borrow().frontiers.offset(Frontier::Queued)
    }

    pub fn stopped(&self) -> Option<String> {
        self.inner.borrow().stopped.clone()
    }

    /// Closed (by [`ShardLog::close`] or [`ShardLog::destroy`]): waits on
    /// it end at once.
    pub fn is_closed(&self) -> bool {
        self.inner.borrow().closed
    }

    pub fn stats(&self) -> LogStats {
        let i = self.inner.borrow();
        LogStats {
            start: i.start,
            end: i.frontiers.offset(Frontier::Durable),
            queued: i.frontiers.offset(Frontier::Queued),
            bytes: i.segments.values().map(|s| s.len).sum(),
            segments: i.segments.len() as u32,
            stopped: i.stopped.clone(),
            flushes: i.flushes,
            bytes_written: i.bytes_written,
            sync: i.sync,
            cold_reads: i.cold_reads,
            cold_hits: i.cold_hits,
            cold_read_ahead: i.cold_read_ahead,
            cache_bytes: (i.cache_bytes + i.cold.iter().map(|c| c.bytes.len()).sum::<usize>())
                as u64,
        }
    }

    /// Change how much this log keeps for reads: recent batches
    /// ([`LogConfig::read_cache_bytes`], at least the newest batch is kept)
    /// and cold-read chunks ([`LogConfig::cold_chunks`]). Anything over the
    /// new limits is dropped now. A broker running thousands of shards on a
    /// core shares one memory budget between them this way.
    pub fn set_cache_limits(&self, read_cache_bytes: usize, cold_chunks: usize) {
        let mut i = self.inner.borrow_mut();
        let lowered = read_cache_bytes < i.config.read_cache_bytes;
        i.config.read_cache_bytes = read_cache_bytes;
        i.config.cold_chunks = cold_chunks;
        while i.cache_bytes > read_cache_bytes && i.cache.len() > 1 {
            let b = i.cache.pop_front().unwrap();
            i.cache_bytes -= b.bytes.len();
        }
        if lowered {
            // What is kept may be slices of whole written pieces (see the
            // write path): copy it out so that the pieces are freed now, not
            // whenever this shard next writes.
            for b in i.cache.iter_mut() {
                b.bytes = Bytes::copy_from_slice(&b.bytes);
            }
        }
        while i.cold.len() > cold_chunks {
            i.cold.pop_front();
        }
    }

    /// Each segment's base offset and the bytes of batches written to it
    /// (what [`LogStats::bytes`] sums and retention by bytes counts), oldest
    /// first; the last is the active segment.
    pub fn segment_sizes(&self) -> Vec<(Offset, u64)> {
        let i = self.inner.borrow();
        i.segments.values().map(|s| (s.base, s.len)).collect()
    }

    /// Is anything queued and not yet written?
    pub fn has_pending(&self) -> bool {
        !self.inner.borrow().pending.is_empty()
    }

    /// Run the group-commit loop until the log stops or closes.
    pub async fn run_flusher(&self) {
        loop {
            {
                let i = self.inner.borrow();
                if i.stopped.is_some() || (i.closed && i.pending.is_empty()) {
                    return;
                }
            }
            if self.has_pending() {
                // A failure stops the shard; the loop exits at the top.
                let _ = self.flush().await;
            } else {
                let wait = self.queued.wait();
                if self.has_pending() || self.inner.borrow().closed {
                    continue;
                }
                wait.await;
            }
        }
    }

    /// Make everything appended before this call durable: when it returns
    /// `Ok`, every batch queued before the call is covered by a completed
    /// fdatasync (and its records are visible to readers).
    ///
    /// With no flush in flight, this runs one group-commit round: write
    /// everything queued, fdatasync, advance the frontiers and wake waiters.
    /// With one in flight (the flusher task's or another caller's), it waits
    /// for that round to finish and then, if what it must cover is still not
    /// durable (queued after that round took the queue), runs the next round
    /// itself. Rounds never overlap, and a caller whose batches the round in
    /// flight already covers adds no write or sync.
    ///
    /// Returns an error if the log stopped before everything was durable (a
    /// failed round, its own or the one it waited for). On a closed log
    /// (`close` flushed everything) it returns `Ok`. Dropping a flush while
    /// its round is in flight stops the shard: what the round took from the
    /// queue may be partly written and is not retried.
    pub async fn flush(&self) -> Result<(), LogError> {
        // The position just past everything queued before this call.
        let target = self.inner.borrow().frontiers.lsn(Frontier::Queued);
        loop {
            // Registered before the check, so a round ending in between
            // still wakes it.
            let progressed = self.progress.wait();
            {
                let mut i = self.inner.borrow_mut();
                // A closed log flushed everything, unless it stopped: a
                // stopped log is an error whether or not it is also closed
                // (never let a later round mark a failed one durable).
                i.refuse().or_else(|e| match e {
                    LogError::Closed => Ok(()),
                    e => Err(e),
                })?;
                if i.frontiers.lsn(Frontier::Durable) >= target {
                    return Ok(());
                }
                if !i.flushing {
                    // A round makes everything it took durable, so what is
                    // not durable with no round in flight is still queued.
                    debug_assert!(!i.pending.is_empty());
                    i.flushing = true;
                    break;
                }
            }
            progressed.await;
        }
        let mut round = RoundGuard {
            log: self,
            done: false,
        };
        let result = self.flush_inner().await;
        round.done = true;
        let mut i = self.inner.borrow_mut();
        i.flushing = false;
        if let Err(e) = &result {
            i.stop_after_round(e.to_string());
        }
        drop(i);
        self.progress.wake_all();
        result.map_err(|e| match e {
            LogError::Stopped(_) => e,
            other => LogError::Stopped(other.to_string()),
        })
    }

    async fn flush_inner(&self) -> Result<(), LogError> {
        let chunks: Vec<Chunk> = {
            let mut i = self.inner.borrow_mut();
            // Only a round that syncs what it wrote marks it durable.
            if let Some(r) = &i.stopped {
                return Err(LogError::Stopped(r.clone()));
            }
            i.chunk_hint = i.pending_bytes;
            i.pending_bytes = 0;
            i.flush_stamp = i.flush_stamp.wrapping_add(1);
            i.pending.drain(..).collect()
        };
        let mut dirty: Option<Rc<S::File>> = None;
        let count = chunks.len();
        for (n, chunk) in chunks.into_iter().enumerate() {
            let (active_base, dir) = {
                let i = self.inner.borrow();
                (i.active_base(), i.dir.clone())
            };
            if chunk.segment_base != active_base {
                assert!(
                    chunk.segment_base > active_base,
                    "segments only move forward"
                );
                // Seal the active segment: make its data durable, cut its
                // padding, then create the next one and make its name durable.
                if let Some(f) = dirty.take() {
                    f.sync().await.map_err(|e| io_err("fdatasync", e))?;
                }
                let (file, len) = {
                    let i = self.inner.borrow();
                    let s = i.segments.get(&active_base).unwrap();
                    (s.file.clone(), s.len)
                };
                cut_to(&*file, len, "seal segment").await?;
                let path = dir.join(segment_name(chunk.segment_base));
                let new = self
                    .storage
                    .open(&path, true)
                    .await
                    .map_err(|e| io_err("create segment", e))?;
                self.storage
                    .sync_dir(&dir)
                    .await
                    .map_err(|e| io_err("sync shard directory", e))?;
                // Recovery's proof that this segment existed.
                self.storage
                    .write_file_atomic(
                        &dir.join(TAIL_MARK),
                        &marks::encode_tail(chunk.segment_base),
                    )
                    .await
                    .map_err(|e| io_err(&format!("write {TAIL_MARK}"), e))?;
                let mut i = self.inner.borrow_mut();
                i.segments.insert(
                    chunk.segment_base,
                    Segment {
                        base: chunk.segment_base,
                        path,
                        file: Rc::new(new),
                        len: 0,
                        reserved: 0,
                        zeroed: 0,
                        end: chunk.segment_base,
                        index: Vec::new(),
                        last_indexed_pos: None,
                        max_timestamp_ms: 0,
                    },
                );
                i.tail_page.clear();
            }
            // Only the round's last chunk is in the segment that stays
            // active: zeros ahead of an earlier one would be cut at its seal.
            let file = self.write_chunk(chunk, n + 1 == count).await?;
            dirty = Some(file);
        }
        if let Some(f) = dirty {
            let t = std::time::Instant::now();
            f.sync().await.map_err(|e| io_err("fdatasync", e))?;
            let us = t.elapsed().as_micros() as u64;
            self.inner.borrow_mut().sync.record(us);
        }
        {
            let mut i = self.inner.borrow_mut();
            let written = i.frontiers.at(Frontier::Written);
            i.frontiers.mark_durable(written);
            i.flushes += 1;
        }
        Ok(())
    }

    /// Write one chunk at the end of the active segment (rewriting its
    /// partial last page), in pieces with at most `io_depth` in flight.
    async fn write_chunk(
        &self,
        chunk: Chunk,
        last_in_round: bool,
    ) -> Result<Rc<S::File>, LogError> {
        let (file, seg_len, reserved, zeroed, depth, step, segment_bytes) = {
            let i = self.inner.borrow();
            let s = &i.segments[&chunk.segment_base];
            debug_assert_eq!(Some(&s.base), i.segments.keys().next_back());
            (
                s.file.clone(),
                s.len,
                s.reserved,
                s.zeroed,
                i.config.io_depth,
                i.config.preallocate.then_some(i.config.preallocate_step),
                i.config.segment_bytes,
            )
        };
        let Chunk {
            segment_base,
            start,
            mut pieces,
            len: chunk_len,
            batches,
            end: chunk_end,
        } = chunk;
        assert_eq!(start, seg_len, "a chunk starts where its segment ends");
        let new_len = seg_len + chunk_len as u64;
        let write_end = align_up(new_len);
        {
            // The segment's partial last page, written again in front of
            // the new bytes: into the first piece's room for it, and into
            // the pieces after it that start on the same page (they carried
            // that room over before it was filled).
            let i = self.inner.borrow();
            let page = align_down(seg_len);
            // Checked always: a wrong tail would write over durable bytes.
            assert_eq!(
                i.tail_page.len() as u64,
                seg_len - page,
                "tail page out of step"
            );
            for p in pieces.iter_mut().take_while(|p| p.at == page) {
                p.buf.filled_mut()[..i.tail_page.len()].copy_from_slice(&i.tail_page);
            }
        }
        // The last partial page of the segment after this chunk, and zeros
        // to the page boundary (recovery reads them as the end of the log).
        let new_tail = match pieces.last_mut() {
            Some(last) => {
                let from = (align_down(new_len) - last.at) as usize;
                let to = (new_len - last.at) as usize;
                debug_assert_eq!(to, last.buf.len());
                let t = last.buf.filled()[from..to].to_vec();
                last.buf.pad_to_page();
                t
            }
            None => self.inner.borrow().tail_page.clone(),
        };
        // Zeros ahead of the data, from a small round only. Blocks reserved
        // by fallocate are unwritten extents: the first write into one
        // converts it, and the fdatasync after that write must commit the
        // conversion to the filesystem journal (fio on ext4: 75-79 us a sync
        // after 64 KiB written into new or reserved blocks, 44 us after an
        // overwrite). So when less than ZERO_AHEAD_LOW of written zeros is
        // left past this round's end, the round also writes a piece of
        // zeros there, inside the reservation: the rounds after it overwrite
        // written blocks and sync only their data, and one round in every
        // ZERO_AHEAD_PIECE of data pays for the conversion. A large round
        // does not (it is bandwidth-bound, and zeros would double its disk
        // writes), nor one whose reservation failed (zeros would grow the
        // file).
        let zeros = match step {
            Some(_) if last_in_round && chunk_len <= ZERO_AHEAD_ROUND && reserved != u64::MAX => {
                let at = zeroed.max(write_end);
                debug_assert_eq!(at % ALIGN as u64, 0);
                let until = align_down(
                    at.saturating_add(ZERO_AHEAD_PIECE as u64)
                        .min(align_up(segment_bytes)),
                );
                (at - write_end < ZERO_AHEAD_LOW && until > at).then(|| (at, (until - at) as usize))
            }
            _ => None,
        };
        let need = zeros.map_or(write_end, |(at, len)| at + len as u64);
        let mut reserved = reserved;
        if let Some(step) = step.filter(|_| need > reserved) {
            // Reserve past these writes (`reservation_for`). Best effort: a
            // filesystem without fallocate grows the file as it is written,
            // and it is not asked again for this segment.
            //
            // Nor while the disk is short of room (looked at again at the
            // next flush that needs it): a reservation takes its step at once,
            // between two looks of the broker's free-space guard, from the
            // room the publishes it let through will write into.
            let to = reservation_for(need, step);
            let had = file.size().await.map_err(|e| io_err("size", e))?;
            let (dir, floor) = {
                let i = self.inner.borrow();
                (i.dir.clone(), i.config.min_free_bytes)
            };
            let grow = to.saturating_sub(had);
            let roomy = match self.storage.space(&dir) {
                Ok((free, total)) => {
                    free.saturating_sub(storage::free_space_floor(floor, total))
                        >= grow.saturating_mul(2)
                }
                Err(_) => true,
            };
            if roomy {
                reserved = match file.allocate(to).await {
                    Ok(()) => to,
                    Err(e) => {
                        tracing::debug!("reserving segment blocks failed: {e}");
                        // A reservation cut short (ENOSPC) can keep what it
                        // took: give it back.
                        if let Err(e) = file.truncate(had).await {
                            tracing::debug!("giving back a failed reservation: {e}");
                        }
                        // Not again in this segment: after an ENOSPC the
                        // free space read is not to be trusted, and each
                        // try would fill the disk for a moment.
                        u64::MAX
                    }
                };
            } else {
                tracing::debug!(
                    segment = chunk.segment_base.0,
                    "not reserving blocks ahead: the disk is short of room"
                );
            }
            let mut i = self.inner.borrow_mut();
            if let Some(s) = i.segments.get_mut(&chunk.segment_base) {
                s.reserved = reserved;
            }
        }
        // Zeros only inside the reservation (none where it failed, or was
        // not made for want of room): past it they would grow the file.
        let zeros = zeros.filter(|(at, len)| reserved != u64::MAX && at + *len as u64 <= reserved);
        // Each piece but the last ends inside a page the next one writes
        // again whole; the last one is padded to its page.
        let count = pieces.len();
        let piece_at: Vec<u64> = pieces.iter().map(|p| p.at).collect();
        let mut writes: Vec<(Option<usize>, PageBuf, usize, u64)> = Vec::with_capacity(count + 1);
        // Each piece's memory, by index: a piece not written (all its
        // bytes are in the next one's first page) stays; a written one comes
        // back into its slot below.
        let mut kept: Vec<Option<PageBuf>> = Vec::with_capacity(count);
        for (k, p) in pieces.into_iter().enumerate() {
            let n = if k + 1 == count {
                p.buf.len()
            } else {
                align_down(p.buf.len() as u64) as usize
            };
            if n == 0 {
                kept.push(Some(p.buf));
            } else {
                writes.push((Some(k), p.buf, n, p.at));
                kept.push(None);
            }
        }
        // The zeros go last, so they are the last write of the last group.
        if let Some((pos, len)) = zeros {
            writes.push((None, take_zeros(len), len, pos));
        }
        let mut written_bytes = 0u64;
        let mut zeros_written = zeros.is_some();
        let mut iter = writes.into_iter();
        loop {
            let group: Vec<_> = iter.by_ref().take(depth).collect();
            if group.is_empty() {
                break;
            }
            let futs = group.into_iter().map(|(k, buf, n, pos)| {
                written_bytes += n as u64;
                let file = &file;
                async move { (k, file.write_at(buf, n, pos).await) }
            });
            for (k, r) in futures_util::future::join_all(futs).await {
                match (k, r) {
                    (Some(k), Ok(buf)) => kept[k] = Some(buf),
                    (None, Ok(buf)) => give_back_zeros(buf),
                    // Zeros are an optimisation inside reserved blocks that
                    // read as zeros anyway: a failure costs nothing but the
                    // speed-up, never the shard.
                    (None, Err(e)) => {
                        tracing::debug!("writing zeros ahead failed: {e}");
                        zeros_written = false;
                    }
                    (Some(_), Err(e)) => return Err(io_err("write", e)),
                }
            }
        }
        // The bytes are on the device (not yet synced): advance `written`,
        // index the batches, keep them for tail reads.
        let mut i = self.inner.borrow_mut();
        {
            let seg = i.segments.get_mut(&segment_base).unwrap();
            seg.zeroed = seg.zeroed.max(write_end);
            if let (Some((pos, len)), true) = (zeros, zeros_written) {
                seg.zeroed = seg.zeroed.max(pos + len as u64);
            }
        }
        let interval = i.config.index_interval_bytes;
        let cache_max = i.config.read_cache_bytes;
        i.tail_page = new_tail;
        i.bytes_written += written_bytes;
        {
            let seg = i.segments.values_mut().next_back().unwrap();
            for (h, pos, _) in &batches {
                seg.note_batch(h, *pos, interval);
            }
            seg.len = new_len;
        }
        // The pieces become the cache's memory without a copy.
        let kept: Vec<PageBuf> = kept
            .into_iter()
            .map(|p| p.expect("every piece is back"))
            .collect();
        let capacity: Vec<usize> = kept.iter().map(PageBuf::capacity).collect();
        let shared: Vec<Bytes> = kept.into_iter().map(PageBuf::into_bytes).collect();
        // Pieces of the batches this round adds to the cache, in order.
        let mut round_pieces = Vec::with_capacity(batches.len());
        for (h, pos, k) in &batches {
            // Control batches are cached too: a reader must be able to step
            // over their offsets without going to disk.
            if h.kind != BatchKind::Group {
                let at = (*pos - piece_at[*k]) as usize;
                let bytes = shared[*k].slice(at..at + h.len as usize);
                i.cache_bytes += bytes.len();
                i.cache.push_back(CachedBatch {
                    header: *h,
                    bytes,
                    segment: segment_base,
                    pos: *pos,
                });
                round_pieces.push(*k);
            }
        }
        while i.cache_bytes > cache_max && i.cache.len() > 1 {
            let b = i.cache.pop_front().unwrap();
            i.cache_bytes -= b.bytes.len();
        }
        // A cached batch keeps its whole piece alive. Where the cache keeps
        // less than half of a piece's memory (a shard with a small share of
        // its core's budget, a piece sized for more than the round brought,
        // a small round in a page), copy what it keeps out so the piece is
        // freed; where it keeps more, the copy would cost more than the
        // memory it frees.
        let survivors = round_pieces.len().min(i.cache.len());
        let round_pieces = &round_pieces[round_pieces.len() - survivors..];
        let first = i.cache.len() - survivors;
        let mut kept_of = vec![0usize; shared.len()];
        for (b, &k) in i.cache.range(first..).zip(round_pieces) {
            kept_of[k] += b.bytes.len();
        }
        // A piece copied out goes into one new buffer its batches share.
        let mut copied: Vec<Option<Vec<u8>>> = kept_of
            .iter()
            .zip(&capacity)
            .map(|(&kept, &cap)| (kept > 0 && kept * 2 <= cap).then(|| Vec::with_capacity(kept)))
            .collect();
        for (b, &k) in i.cache.range(first..).zip(round_pieces) {
            if let Some(v) = &mut copied[k] {
                v.extend_from_slice(&b.bytes);
            }
        }
        let copied: Vec<Option<Bytes>> = copied.into_iter().map(|v| v.map(Bytes::from)).collect();
        let mut at = vec![0usize; shared.len()];
        for (b, &k) in i.cache.range_mut(first..).zip(round_pieces) {
            if let Some(all) = &copied[k] {
                let n = b.bytes.len();
                b.bytes = all.slice(at[k]..at[k] + n);
                at[k] += n;
            }
        }
        i.frontiers.mark_written(chunk_end);
        drop(i);
        self.written.wake_all();
        Ok(file)
    }

    /// Read records from `from` (clamped up to the log start) up to the
    /// visible end, within `limits` (at least one record if any is there).
    pub async fn read(&self, from: Offset, limits: ReadLimits) -> Result<ReadResult, LogError> {
        let (start, end) = {
            let i = self.inner.borrow();
            if let Some(r) = &i.stopped {
                return Err(LogError::Stopped(r.clone()));
            }
            (i.start, i.frontiers.offset(Frontier::Durable))
        };
        let from = from.max(start);
        let mut out = ReadResult {
            records: Vec::new(),
            next: from,
            start,
            end,
            bytes: 0,
        };
        if from >= end || limits.max_records == 0 {
            return Ok(out);
        }
        let mut bytes = 0usize;
        // Tail reads from memory.
        let served = {
            let i = self.inner.borrow();
            match i.cache.front() {
                Some(first) if first.header.base_offset <= from => {
                    let idx = i.cache.partition_point(|b| b.header.end_offset() <= from);
                    for b in i.cache.iter().skip(idx) {
                        if b.header.base_offset >= end {
                            break;
                        }
                        let more = take_batch(
                            &b.bytes,
                            &b.header,
                            &mut out,
                            limits,
                            &mut bytes,
                            &self.hints,
                        )
                        .map_err(|e| {
                            let path = i.segments.get(&b.segment).map_or_else(
                                || i.dir.join(segment_name(b.segment)),
                                |s| s.path.clone(),
                            );
                            undecodable(&path, b.pos, &b.header, "in the tail cache", e)
                        })?;
                        if !more {
                            break;
                        }
                    }
                    true
                }
                _ => false,
            }
        };
        if served {
            out.next = out.next.min(end);
            out.bytes = bytes;
            return Ok(out);
        }
        self.read_cold(from, end, limits, &mut out, &mut bytes)
            .await?;
        out.next = out.next.min(end);
        out.bytes = bytes;
        Ok(out)
    }

    async fn read_cold(
        &self,
        from: Offset,
        end: Offset,
        limits: ReadLimits,
        out: &mut ReadResult,
        bytes: &mut usize,
    ) -> Result<(), LogError> {
        let mut seg_base = {
            let i = self.inner.borrow();
            match i.segments.range(..=from).next_back() {
                Some((b, _)) => *b,
                None => return Ok(()),
            }
        };
        loop {
            let (file, path, mut pos, seg_len, seg_end, chunk) = {
                let i = self.inner.borrow();
                let Some(s) = i.segments.get(&seg_base) else {
                    return Ok(()); // removed by retention meanwhile
                };
                let idx = s.index.partition_point(|(o, _)| *o <= out.next);
                let pos = if idx == 0 { 0 } else { s.index[idx - 1].1 };
                (
                    s.file.clone(),
                    s.path.clone(),
                    pos,
                    s.len,
                    s.end,
                    i.config.read_chunk_bytes,
                )
            };
            let mut buf = Bytes::new();
            'segment: while pos < seg_len {
                if buf.len() < format::BATCH_HEADER_BYTES {
                    let want = chunk.min((seg_len - pos) as usize);
                    buf = self
                        .cold_read(
                            &file,
                            seg_base,
                            pos,
                            format::BATCH_HEADER_BYTES,
                            want.max(format::BATCH_HEADER_BYTES),
                        )
                        .await?;
                }
                loop {
                    let parsed = match format::parse_header(&buf) {
                        Ok(h)
                            if buf.len() >= h.len as usize
                                && self.cold_verified(seg_base, pos, &buf[..h.len as usize]) =>
                        {
                            Ok(h)
                        }
                        _ => format::parse_batch(&buf).inspect(|h| {
                            self.mark_cold_verified(seg_base, pos, h.len);
                        }),
                    };
                    match parsed {
                        Ok(h) => {
                            let batch = buf.split_to(h.len as usize);
                            let at = pos;
                            pos += h.len as u64;
                            if h.base_offset >= end {
                                return Ok(());
                            }
                            let more = take_batch(&batch, &h, out, limits, bytes, &self.hints)
                                .map_err(|e| undecodable(&path, at, &h, "read from disk", e))?;
                            if !more {
                                return Ok(());
                            }
                        }
                        Err(FrameError::Incomplete(more)) => {
                            let want = (buf.len() + more).max(chunk).min((seg_len - pos) as usize);
                            if want < buf.len() + more {
                                return Err(LogError::Corrupt {
                                    path: path.display().to_string(),
                                    position: pos,
                                    reason: "batch runs past the segment's end".into(),
                                });
                            }
                            buf = self
                                .cold_read(&file, seg_base, pos, buf.len() + more, want)
                                .await?;
                            continue 'segment;
                        }
                        Err(e) => {
                            return Err(LogError::Corrupt {
                                path: path.display().to_string(),
                                position: pos,
                                reason: e.to_string(),
                            })
                        }
                    }
                    if buf.is_empty() {
                        continue 'segment;
                    }
                }
            }
            // Next segment.
            let next = {
                let i = self.inner.borrow();
                i.segments
                    .range(seg_end..)
                    .next()
                    .map(|(b, _)| *b)
                    .filter(|b| *b > seg_base)
            };
            match next {
                Some(b) if b < end => {
                    seg_base = b;
                    out.next = out.next.max(b);
                }
                _ => return Ok(()),
            }
        }
    }

    /// Whether `batch`, the bytes at `pos` of `segment`, is memory of a cold
    /// chunk (the very bytes, not a later read of the same place) in which
    /// it was verified.
    fn cold_verified(&self, segment: Offset, pos: u64, batch: &[u8]) -> bool {
        let len = batch.len() as u64;
        let i = self.inner.borrow();
        let joined = i.joined.as_ref().is_some_and(|j| {
            j.verified
                && (j.segment, j.pos) == (segment, pos)
                && len <= j.bytes.len() as u64
                && std::ptr::eq(batch.as_ptr(), j.bytes.as_ptr())
        });
        joined
            || i.cold.iter().any(|c| {
                c.holds(segment, pos, len)
                    && c.verified.0 <= pos
                    && pos + len <= c.verified.1
                    && std::ptr::eq(batch.as_ptr(), c.bytes[(pos - c.pos) as usize..].as_ptr())
            })
    }

    /// Note that the batch of `len` bytes at `pos` of `segment` passed its
    /// checksum, in every cold chunk that holds it.
    fn mark_cold_verified(&self, segment: Offset, pos: u64, len: u32) {
        let end = pos + u64::from(len);
        let mut i = self.inner.borrow_mut();
        if let Some(j) = i.joined.as_mut() {
            if (j.segment, j.pos) == (segment, pos) && u64::from(len) <= j.bytes.len() as u64 {
                j.verified = true;
            }
        }
        for c in i.cold.iter_mut() {
            if !c.holds(segment, pos, u64::from(len)) {
                continue;
            }
            let (a, b) = c.verified;
            c.verified = if a == b {
                (pos, end)
            } else if pos == b {
                (a, end)
            } else if end == a {
                (pos, b)
            } else if a <= pos && end <= b {
                (a, b)
            } else {
                // Not adjacent: keep the newer run (readers move forward).
                (pos, end)
            };
        }
    }

    /// Bytes of segment `segment` from `pos`: from a recent chunk that
    /// holds at least `need` bytes from there, at most `max(want, need)`
    /// of them (no more than a disk read returns); otherwise `want` bytes
    /// read from disk and kept as a chunk. A reader moving forward through
    /// the chunks asks for the next one to be read ahead (see
    /// [`ShardLog::run_read_ahead`]); one that needs a chunk being read
    /// ahead waits for it rather than reading it again.
    async fn cold_read(
        &self,
        file: &S::File,
        segment: Offset,
        pos: u64,
        need: usize,
        want: usize,
    ) -> Result<Bytes, LogError> {
        loop {
            let arrived = self.ahead.wait();
            match self.kept_or_claim(segment, pos, need, want) {
                Cold::Kept(bytes) => return Ok(bytes),
                Cold::Read => break,
                Cold::Coming => arrived.await,
            }
        }
        let in_flight = Reading {
            log: self,
            read: (segment, pos, want as u64),
        };
        let read = file.read_at(pos, want).await;
        drop(in_flight);
        let bytes = read.map_err(|e| io_err("read", e))?;
        let mut i = self.inner.borrow_mut();
        i.cold_reads += 1;
        // A miss past the start of a kept chunk, up to where it ends, is a
        // reader moving forward out of it.
        let sequential = i
            .cold
            .iter()
            .any(|c| c.segment == segment && c.pos < pos && pos <= c.pos + c.bytes.len() as u64);
        keep_cold(&mut i, segment, pos, bytes.clone(), false);
        if sequential && bytes.len() >= want {
            self.want_ahead(&mut *i, segment, pos + bytes.len() as u64);
        }
        Ok(bytes)
    }

    /// The bytes a cold read wants, from the kept chunks (one, or two a
    /// batch straddles), asking for the next chunk to be read ahead. If
    /// they are not kept and no read in flight brings them, lists this
    /// reader's own read in `reading` for it to issue.
    fn kept_or_claim(&self, segment: Offset, pos: u64, need: usize, want: usize) -> Cold {
        let mut i = self.inner.borrow_mut();
        if let Some(k) = i
            .cold
            .iter()
            .position(|c| c.holds(segment, pos, need as u64))
        {
            i.cold_hits += 1;
            let tick = i.cold_hits;
            let whole = i.config.read_chunk_bytes;
            let c = &mut i.cold[k];
            c.used = tick;
            c.ahead = false;
            // At most what a disk read would return: a chunk another reader
            // read after the segment grew can run past the end this reader
            // took, into a batch it must not see cut short.
            let at = (pos - c.pos) as usize;
            let out = c.bytes.slice(at..(at + want.max(need)).min(c.bytes.len()));
            // A reader in a whole chunk (not the short one at a segment's
            // written end) will want the next one.
            let (end, full) = (c.pos + c.bytes.len() as u64, c.bytes.len() >= whole);
            if full {
                self.want_ahead(&mut i, segment, end);
            }
            return Cold::Kept(out);
        }
        // Across the end of one kept chunk into the one read after it
        // (chunks read ahead tile the segment, so a batch can straddle two):
        // the `need` bytes, copied into one piece.
        // The same batch joined for the last read (a poll of a few of its
        // records after another): already copied, and maybe verified.
        if let Some(j) = i.joined.as_ref() {
            if (j.segment, j.pos) == (segment, pos) && j.bytes.len() >= need {
                let out = j.bytes.clone();
                i.cold_hits += 1;
                return Cold::Kept(out);
            }
        }
        let tick = i.cold_hits + 1;
        if let Some((joined, (end, len))) = straddle(&mut i.cold, segment, pos, need, tick) {
            i.cold_hits = tick;
            if len >= i.config.read_chunk_bytes {
                self.want_ahead(&mut i, segment, end);
            }
            i.joined = Some(Joined {
                segment,
                pos,
                bytes: joined.clone(),
                verified: false,
            });
            return Cold::Kept(joined);
        }
        // Wait for a read in flight only if it brings all the bytes needed
        // that no kept chunk holds, and they will be kept.
        let from = i
            .cold
            .iter()
            .find(|c| c.holds(segment, pos, 1))
            .map_or(pos, |c| c.pos + c.bytes.len() as u64);
        if i.config.cold_chunks > 0 && reading_brings(&i, segment, from, pos + need as u64) {
            return Cold::Coming;
        }
        i.reading.push((segment, pos, want as u64));
        Cold::Read
    }

    /// Ask for the chunk of `segment` at `pos` to be read ahead, unless it
    /// is kept, wanted or being read already, or keeping it would push out
    /// a chunk a reader may still be in: one used within the last
    /// `cold_chunks` reads served from chunks (with more readers moving
    /// through the shard than the chunks can hold, each keeps the chunk it
    /// is in and reads the next itself, as without read-ahead).
    fn want_ahead(&self, i: &mut Inner<S::File>, segment: Offset, pos: u64) {
        if i.config.cold_chunks < 2
            || crowded(i)
            || at_hand(i, segment, pos)
            || i.ahead.contains(&(segment, pos))
        {
            return;
        }
        if i.ahead.len() >= i.config.cold_chunks {
            i.ahead.pop_front();
        }
        i.ahead.push_back((segment, pos));
        self.ahead.wake_all();
    }

    /// Read ahead of sequential readers until the log closes: each chunk a
    /// reader is about to need (see `cold_read`) is read from disk and kept
    /// with the recent chunks, so a consumer working through a backlog
    /// rarely waits on the disk. One read at a time; a failed one is left
    /// to the reader to meet (and report) itself.
    pub async fn run_read_ahead(&self) {
        loop {
            let wanted = self.ahead.wait();
            let job = {
                let mut i = self.inner.borrow_mut();
                if i.closed || i.stopped.is_some() {
                    i.ahead.clear();
                    return;
                }
                let mut job = None;
                while let Some((segment, pos)) = i.ahead.pop_front() {
                    let chunk = i.config.read_chunk_bytes;
                    let Some(s) = i.segments.get(&segment) else {
                        continue; // removed by retention meanwhile
                    };
                    // Crowded since it was wanted: no chunk may go for it now.
                    if pos >= s.len || crowded(&i) || at_hand(&i, segment, pos) {
                        continue;
                    }
                    // Never past the segment's written length: bytes below
                    // it do not change while the log is open.
                    let len = chunk.min((s.len - pos) as usize);
                    job = Some((s.file.clone(), segment, pos, len));
                    break;
                }
                if let Some((_, segment, pos, len)) = &job {
                    i.reading.push((*segment, *pos, *len as u64));
                }
                job
            };
            let Some((file, segment, pos, len)) = job else {
                wanted.await;
                continue;
            };
            let in_flight = Reading {
                log: self,
                read: (segment, pos, len as u64),
            };
            let read = file.read_at(pos, len).await;
            drop(in_flight);
            {
                let mut i = self.inner.borrow_mut();
                match read {
                    Ok(bytes) if !bytes.is_empty() && i.segments.contains_key(&segment) => {
                        i.cold_read_ahead += 1;
                        keep_cold(&mut i, segment, pos, bytes, true);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(segment = segment.0, pos, "read ahead failed: {e}");
                    }
                }
            }
            self.ahead.wake_all();
        }
    }

    /// Delete whole sealed segments past the retention limits. Returns how
    /// many segments were removed.
    pub async fn enforce_retention(&self, now_ms: u64) -> Result<usize, LogError> {
        let mut removed = 0;
        loop {
            // Each removal is made durable before the next: then a crash can
            // bring back only the newest removed segment, never an older one
            // without the ones after it (a gap recovery would refuse). A
            // sync that failed last time is owed before anything else goes.
            if self.inner.borrow().removal_unsynced && !self.inner.borrow().closed {
                let dir = self.inner.borrow().dir.clone();
                self.storage.sync_dir(&dir).await.map_err(|e| {
                    tracing::error!(dir = %dir.display(), "syncing a shard directory after retention: {e}");
                    io_err(&format!("sync {}", dir.display()), e)
                })?;
                self.inner.borrow_mut().removal_unsynced = false;
            }
            let victim = {
                let i = self.inner.borrow();
                // A closed log's files may be gone, or another log's by
                // now (a stream deleted and created again): never touch
                // them. Checked with no await before the removal below.
                if i.closed || i.stopped.is_some() || i.segments.len() < 2 {
                    break;
                }
                let (base, first) = i.segments.iter().next().unwrap();
                let total: u64 = i.segments.values().map(|s| s.len).sum();
                let by_bytes = i.config.retention_bytes.is_some_and(|b| total > b);
                let by_age = i
                    .config
                    .retention_ms
                    .is_some_and(|ms| first.max_timestamp_ms.saturating_add(ms) < now_ms);
                // Never remove a segment that is not fully durable, nor one
                // whose group state no later durable snapshot holds.
                let durable = i.frontiers.lsn(Frontier::Durable);
                let covered = i.snapshot.is_none()
                    || i.covers.iter().any(|&(b, l)| b > *base && l <= durable);
                if (by_bytes || by_age)
                    && covered
                    && first.end <= i.frontiers.offset(Frontier::Durable)
                {
                    Some(*base)
                } else {
                    None
                }
            };
            let Some(base) = victim else { break };
            // Remove the file first: until that is done the segment stays
            // readable and the log start does not move (a group must not
            // settle offsets as removed that a failed removal keeps).
            let (path, dir) = {
                let i = self.inner.borrow();
                (i.segments[&base].path.clone(), i.dir.clone())
            };
            if let Err(e) = self.storage.remove_file(&path).await {
                tracing::error!(segment = %path.display(), "retention cannot remove segment: {e}");
                return Err(io_err(&format!("remove {}", path.display()), e));
            }
            {
                let mut i = self.inner.borrow_mut();
                i.removal_unsynced = true;
                i.segments.remove(&base);
                i.covers.retain(|&(b, _)| b > base);
                i.cold.retain(|c| c.segment != base);
                if i.joined.as_ref().is_some_and(|j| j.segment == base) {
                    i.joined = None;
                }
                i.start = *i.segments.keys().next().unwrap();
                let start = i.start;
                while i
                    .cache
                    .front()
                    .is_some_and(|b| b.header.end_offset() <= start)
                {
                    let b = i.cache.pop_front().unwrap();
                    i.cache_bytes -= b.bytes.len();
                }
            }
            tracing::info!(segment = %path.display(), "retention removed segment");
            // The start moved: waiting readers and polls look again, even
            // if the sync below fails.
            self.progress.wake_all();
            self.storage.sync_dir(&dir).await.map_err(|e| {
                tracing::error!(dir = %dir.display(), "syncing a shard directory after retention: {e}");
                io_err(&format!("sync {}", dir.display()), e)
            })?;
            self.inner.borrow_mut().removal_unsynced = false;
            removed += 1;
        }
        Ok(removed)
    }

    /// Flush everything queued (waiting out a flush already in flight), then
    /// refuse further appends and wake everyone.
    pub async fn close(&self) -> Result<(), LogError> {
        let mut result = Ok(());
        loop {
            let progressed = self.progress.wait();
            let (flushing, pending, stopped) = {
                let i = self.inner.borrow();
                (i.flushing, !i.pending.is_empty(), i.stopped.clone())
            };
            if let Some(why) = stopped {
                result = Err(LogError::Stopped(why));
                break;
            }
            if flushing {
                progressed.await;
            } else if pending {
                if let Err(e) = self.flush().await {
                    result = Err(e);
                    break;
                }
            } else {
                break;
            }
        }
        self.inner.borrow_mut().closed = true;
        self.progress.wake_all();
        self.queued.wake_all();
        self.ahead.wake_all();
        if result.is_ok() {
            result = self.release_reservation().await;
        }
        if result.is_ok() {
            result = self.mark_clean().await;
        }
        result
    }

    /// Record where the closed log ends, for the next open to hold it to.
    async fn mark_clean(&self) -> Result<(), LogError> {
        let (dir, clean) = {
            let i = self.inner.borrow();
            if i.stopped.is_some() {
                return Ok(());
            }
            let Some(s) = i.segments.values().next_back() else {
                return Ok(());
            };
            let clean = Clean {
                end: s.end,
                tail_base: s.base,
                tail_len: s.len,
            };
            (i.dir.clone(), clean)
        };
        self.storage
            .write_file_atomic(&dir.join(CLEAN_MARK), &marks::encode_clean(clean))
            .await
            .map_err(|e| io_err(&format!("write {CLEAN_MARK}"), e))
    }

    /// Cut the active segment back to its data, as sealing does: a clean
    /// stop leaves no reserved blocks (nor zeros written ahead) for the next
    /// open to read through, and gives the space back. Nothing is lost if
    /// this is cut short: recovery reads zeros past the data as the end.
    async fn release_reservation(&self) -> Result<(), LogError> {
        let (file, len, reserved) = {
            let i = self.inner.borrow();
            if i.stopped.is_some() {
                return Ok(());
            }
            let Some(s) = i.segments.values().next_back() else {
                return Ok(());
            };
            (s.file.clone(), s.len, s.reserved.max(s.zeroed))
        };
        if reserved <= len {
            return Ok(());
        }
        cut_to(&*file, len, "release reservation").await?;
        let mut i = self.inner.borrow_mut();
        if let Some(s) = i.segments.values_mut().next_back() {
            s.reserved = len;
            s.zeroed = len;
        }
        Ok(())
    }

    /// Delete every file of this log (after close).
    pub async fn destroy(&self) -> Result<(), LogError> {
        let dir = self.inner.borrow().dir.clone();
        self.inner.borrow_mut().closed = true;
        self.progress.wake_all();
        self.queued.wake_all();
        self.ahead.wake_all();
        self.storage.remove_dir_all(&dir).await.map_err(|e| {
            tracing::error!(dir = %dir.display(), "cannot remove a deleted shard's files: {e}");
            io_err(&format!("remove {}", dir.display()), e)
        })
    }
}

/// Stops the log if a flush round is dropped before it finished (its
/// future cancelled): the chunks it took from the queue may be partly
/// written and are gone from the queue, so nothing can make them durable.
/// Without this, `flushing` would stay set and every later flush, and every
/// waiter on the durable frontier, would wait forever.
struct RoundGuard<'a, S: Storage> {
    log: &'a ShardLog<S>,
    done: bool,
}

impl<S: Storage> Drop for RoundGuard<'_, S> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Ok(mut i) = self.log.inner.try_borrow_mut() {
            i.flushing = false;
            i.stop_after_round("a flush was dropped before it completed".into());
        }
        self.log.progress.wake_all();
        self.log.queued.wake_all();
    }
}

/// A batch whose checksum matched but whose records do not decode.
fn undecodable(path: &Path, pos: u64, h: &BatchHeader, from: &str, e: FrameError) -> LogError {
    LogError::Corrupt {
        path: path.display().to_string(),
        position: pos,
        reason: format!(
            "the batch of offsets {}..{} ({from}) does not decode: {e}",
            h.base_offset,
            h.end_offset()
        ),
    }
}

/// Where the last few reads stopped inside a batch: the batch (by its base
/// offset, which names one batch of a shard for the life of the log), the
/// offset of the first record not read, and where that record starts. Small
/// reads working through a large batch in order (a group polling 16 at a
/// time through batches of 1,000) start where the last one stopped instead
/// of stepping over every record before it again.
#[derive(Default)]
struct ReadHints {
    slots: [Option<(Offset, Offset, format::RecordPos)>; 4],
    next: usize,
}

impl ReadHints {
    /// The furthest known start in batch `base` at or below `from`, and the
    /// slot it is in.
    fn find(&self, base: Offset, from: Offset) -> Option<(usize, format::RecordPos)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(k, s)| s.map(|s| (k, s)))
            .filter(|(_, (b, o, _))| *b == base && *o <= from)
            .max_by_key(|(_, (_, o, _))| *o)
            .map(|(k, (_, _, p))| (k, p))
    }

    /// Remember where a read of batch `base` stopped. A read that started at
    /// a hint (`used`, the slot `find` gave it) replaces that hint; another
    /// takes the oldest slot, never a hint another reader is using.
    fn note(&mut self, base: Offset, pos: format::RecordPos, used: Option<usize>) {
        let slot = used.unwrap_or_else(|| {
            let n = self.next;
            self.next = (n + 1) % self.slots.len();
            n
        });
        self.slots[slot] = Some((base, base.plus(pos.index as u64), pos));
    }
}

/// Take the records of one batch at or above `out.next`. Returns false when
/// a limit was reached and reading should stop.
fn take_batch(
    batch: &Bytes,
    h: &BatchHeader,
    out: &mut ReadResult,
    limits: ReadLimits,
    bytes: &mut usize,
    hints: &RefCell<ReadHints>,
) -> Result<bool, FrameError> {
    if h.end_offset() <= out.next {
        return Ok(true);
    }
    match h.kind {
        BatchKind::Group => Ok(true),
        BatchKind::Control => {
            out.next = h.end_offset();
            Ok(true)
        }
        BatchKind::Records => {
            let mut full = false;
            let from = out.next;
            let hint = hints.borrow().find(h.base_offset, from);
            let start = hint.map(|(_, p)| p);
            let stopped = format::for_each_record_from(batch, h, from, start, |r| {
                // The byte cap counts everything a record carries (key,
                // headers, payload) and is never crossed, except by the
                // first record, so a response stays within the cap plus one
                // record however large keys or headers are.
                let size = r.size_bytes();
                if out.records.len() >= limits.max_records
                    || (!out.records.is_empty() && *bytes + size > limits.max_bytes)
                {
                    full = true;
                    return false;
                }
                *bytes += size;
                out.next = r.offset.next();
                out.records.push(r);
                true
            })?;
            if let Some(pos) = stopped {
                hints
                    .borrow_mut()
                    .note(h.base_offset, pos, hint.map(|(k, _)| k));
            }
            Ok(!full && out.records.len() < limits.max_records && *bytes < limits.max_bytes)
        }
    }
}

/// What [`scan_segment`] found.
struct Scanned {
    /// Length of the valid prefix.
    valid_len: u64,
    /// The offset the next batch after the valid prefix should start at.
    expected: Offset,
    /// If the scan stopped before the end of the file: where and why.
    problem: Option<(u64, String)>,
}

/// Scan a segment from its start, verifying every batch.
async fn scan_segment<F: StorageFile>(
    seg: &Segment<F>,
    size: u64,
    config: &LogConfig,
    replay: &mut dyn FnMut(Replayed<'_>),
    notes: &mut Vec<(BatchHeader, u64)>,
) -> Result<Scanned, LogError> {
    let (valid_len, expected, problem) = scan_batches(seg, size, config, replay, notes).await?;
    Ok(Scanned {
        valid_len,
        expected,
        problem,
    })
}

async fn scan_batches<F: StorageFile>(
    seg: &Segment<F>,
    size: u64,
    config: &LogConfig,
    replay: &mut dyn FnMut(Replayed<'_>),
    notes: &mut Vec<(BatchHeader, u64)>,
) -> Result<(u64, Offset, Option<(u64, String)>), LogError> {
    let mut pos = 0u64;
    let mut expected = seg.base;
    let mut buf = Bytes::new();
    let chunk = config.read_chunk_bytes.max(1 << 20);
    while pos < size {
        match format::parse_batch(&buf) {
            Ok(h) => {
                if h.base_offset != expected {
                    return Ok((
                        pos,
                        expected,
                        Some((
                            pos,
                            format!(
                                "batch at offset {} where {} was expected",
                                h.base_offset, expected
                            ),
                        )),
                    ));
                }
                let batch = buf.split_to(h.len as usize);
                match h.kind {
                    BatchKind::Group => {
                        replay(Replayed::Group(&batch[format::BATCH_HEADER_BYTES..]))
                    }
                    BatchKind::Control => replay(Replayed::Control(
                        h.base_offset,
                        &batch[format::BATCH_HEADER_BYTES..],
                    )),
                    BatchKind::Records => {
                        // Check the records decode, so a bad batch is found
                        // here and not by a reader later.
                        format::for_each_record(&batch, &h, Offset::ZERO, |_| true).map_err(
                            |e| LogError::Corrupt {
                                path: seg.path.display().to_string(),
                                position: pos,
                                reason: e.to_string(),
                            },
                        )?;
                    }
                }
                notes.push((h, pos));
                expected = h.end_offset();
                pos += h.len as u64;
            }
            Err(FrameError::Incomplete(more)) => {
                let have = buf.len() as u64;
                if pos + have >= size {
                    return Ok((
                        pos,
                        expected,
                        Some((pos, "batch cut short by the end of the file".into())),
                    ));
                }
                let want = ((have as usize + more).max(chunk) as u64).min(size - pos) as usize;
                buf = seg
                    .file
                    .read_at(pos, want)
                    .await
                    .map_err(|e| io_err("read segment", e))?;
                if buf.len() as u64 <= have {
                    return Ok((pos, expected, Some((pos, "short read".into()))));
                }
            }
            Err(FrameError::Zero) => {
                // Zeros to the end of the file are padding of an unsealed
                // tail; anything else after them is damage.
                return Ok((
                    pos,
                    expected,
                    Some((pos, "zero bytes where a batch was expected".into())),
                ));
            }
            Err(e) => return Ok((pos, expected, Some((pos, e.to_string())))),
        }
    }
    Ok((pos, expected, None))
}

/// Valid batches found past a bad spot in the last segment.
struct PastDamage {
    /// The first: its byte position and header.
    first: (u64, BatchHeader),
    /// One written by a different flush than `first`, if there is one.
    later_flush: Option<(u64, BatchHeader)>,
}

/// Where a cold read's bytes are to come from.
enum Cold {
    /// Kept in memory: here they are.
    Kept(Bytes),
    /// A read in flight brings them: wait for it, then look again.
    Coming,
    /// Nowhere yet: read them (the read is listed as in flight).
    Read,
}

/// A cold read in flight, listed in `Inner::reading` from before it is
/// issued until it completes or its future is dropped, whichever comes
/// first: readers waiting for its bytes look again either way.
struct Reading<'a, S: Storage> {
    log: &'a ShardLog<S>,
    read: (Offset, u64, u64),
}

impl<S: Storage> Drop for Reading<'_, S> {
    fn drop(&mut self) {
        if let Ok(mut i) = self.log.inner.try_borrow_mut() {
            if let Some(k) = i.reading.iter().position(|r| *r == self.read) {
                i.reading.swap_remove(k);
            }
        }
        self.log.ahead.wake_all();
    }
}

/// A batch `straddle` joined, with whether its checksum was verified.
struct Joined {
    segment: Offset,
    pos: u64,
    bytes: Bytes,
    verified: bool,
}

/// The `need` bytes of `segment` from `pos`, copied from two kept chunks
/// when one ends inside them and another holds the rest (both marked used
/// at `tick`); with the end and length of the second.
fn straddle(
    cold: &mut VecDeque<ColdChunk>,
    segment: Offset,
    pos: u64,
    need: usize,
    tick: u64,
) -> Option<(Bytes, (u64, usize))> {
    let a = cold.iter().position(|c| c.holds(segment, pos, 1))?;
    let split = cold[a].pos + cold[a].bytes.len() as u64;
    let rest = (pos + need as u64).checked_sub(split)?;
    let b = cold.iter().position(|c| c.holds(segment, split, rest))?;
    let mut joined = Vec::with_capacity(need);
    joined.extend_from_slice(&cold[a].bytes[(pos - cold[a].pos) as usize..]);
    let from = (split - cold[b].pos) as usize;
    joined.extend_from_slice(&cold[b].bytes[from..from + rest as usize]);
    for k in [a, b] {
        cold[k].used = tick;
        cold[k].ahead = false;
    }
    let second = &cold[b];
    Some((
        Bytes::from(joined),
        (second.pos + second.bytes.len() as u64, second.bytes.len()),
    ))
}

/// The chunk to let go of first: the least recently used of those a reader
/// has used, else the oldest read ahead.
fn victim(cold: &VecDeque<ColdChunk>) -> Option<usize> {
    (0..cold.len()).min_by_key(|&k| (cold[k].ahead, cold[k].used))
}

/// Whether every chunk is taken: the one that would go for a chunk read
/// ahead was used within the last `cold_chunks` reads served from chunks
/// (a reader may still be in it), or is itself read ahead and unused.
fn crowded<F>(i: &Inner<F>) -> bool {
    if i.cold.len() < i.config.cold_chunks {
        return false;
    }
    victim(&i.cold).is_none_or(|k| {
        let c = &i.cold[k];
        c.ahead || c.used + i.config.cold_chunks as u64 > i.cold_hits
    })
}

/// Whether a cold read in flight brings bytes `[from, to)` of `segment`.
fn reading_brings<F>(i: &Inner<F>, segment: Offset, from: u64, to: u64) -> bool {
    i.reading
        .iter()
        .any(|&(s, p, len)| s == segment && p <= from && to <= p + len)
}

/// Whether the byte of `segment` at `pos` is kept in a chunk or on its way.
fn at_hand<F>(i: &Inner<F>, segment: Offset, pos: u64) -> bool {
    i.cold.iter().any(|c| c.holds(segment, pos, 1)) || reading_brings(i, segment, pos, pos + 1)
}

/// Keep `bytes`, read from `segment` at `pos`, as the newest cold chunk
/// (letting go of `victim`s past `cold_chunks`, and of any older chunk read
/// from the same place).
fn keep_cold<F>(i: &mut Inner<F>, segment: Offset, pos: u64, bytes: Bytes, ahead: bool) {
    if i.config.cold_chunks == 0 || bytes.is_empty() {
        return;
    }
    i.cold
        .retain(|c| !(c.segment == segment && c.pos >= pos && c.pos < pos + bytes.len() as u64));
    while i.cold.len() >= i.config.cold_chunks {
        let Some(k) = victim(&i.cold) else { break };
        i.cold.remove(k);
    }
    let used = i.cold_hits;
    i.cold.push_back(ColdChunk {
        segment,
        pos,
        bytes,
        verified: (pos, pos),
        used,
        ahead,
    });
}

/// Look past a bad spot at byte `bad` of the last segment (the batch there
/// should have started at offset `expected`) for valid batches that continue
/// the log.
///
/// A torn last write and damage to older data both leave a bad batch, and
/// both can have valid batches after it: a multi-page O_DIRECT write is not
/// atomic, so pages of the last, unsynced flush can reach the disk after a
/// page before them did not. What tells them apart is which flushes wrote
/// what follows. Only the last flush can be unsynced (the flusher writes a
/// flush only after the one before it was synced), and every batch carries
/// its flush's stamp. Valid batches after the bad spot from two different
/// flushes mean the bad batch was written, and synced, before the last
/// flush: damage to acknowledged data. Valid batches from one flush only are
/// the last flush's surviving pages around a torn one.
///
/// Batches are packed back to back (flushes pad only the end of the file,
/// and the next flush overwrites that padding), so a batch can start at any
/// byte: this tries every position, skipping runs of zeros, and computes a
/// checksum only for a header that fits what continuing the log allows: a
/// known version and kind, a record count its length can hold, an end inside
/// the file, and a base offset at least `expected` and at most one offset per
/// [`format::RECORD_FIXED_BYTES`] bytes since the last valid batch. A
/// candidate's bytes are checksummed in chunks of at most `chunk`: nothing
/// is allocated from a length read from the file.
async fn look_past_damage<F: StorageFile>(
    file: &F,
    size: u64,
    bad: u64,
    expected: Offset,
    chunk: usize,
) -> Result<Option<PastDamage>, LogError> {
    const HEADER: u64 = format::BATCH_HEADER_BYTES as u64;
    let chunk = (chunk as u64).max(2 * HEADER);
    let mut first: Option<(u64, BatchHeader)> = None;
    // Start of the stretch since the last valid batch, and the offset the
    // next batch starts at or after.
    let mut gap = bad;
    let mut exp = expected;
    let mut q = bad + 1;
    let mut buf = Bytes::new();
    let mut buf_pos = q;
    while q + HEADER <= size {
        if q < buf_pos || q + HEADER > buf_pos + buf.len() as u64 {
            buf_pos = q;
            buf = file
                .read_at(q, chunk.min(size - q) as usize)
                .await
                .map_err(|e| io_err("read segment", e))?;
            if (buf.len() as u64) < HEADER {
                break;
            }
        }
        let b = &buf[(q - buf_pos) as usize..];
        let h = match format::parse_header(b) {
            Ok(h) => h,
            Err(FrameError::Zero) => {
                // A batch's length field has a nonzero byte: skip to three
                // bytes before the next one (the first four are zero).
                q = match first_nonzero(b) {
                    Some(n) => q + n as u64 - 3,
                    None => buf_pos + buf.len() as u64 - 3,
                };
                continue;
            }
            Err(_) => {
                q += 1;
                continue;
            }
        };
        let most = exp
            .0
            .saturating_add((q - gap) / format::RECORD_FIXED_BYTES as u64);
        let fits = h.plausible()
            && q + h.len as u64 <= size
            && h.base_offset >= exp
            && h.base_offset.0 <= most;
        if !fits || !checksum_matches(file, &buf, buf_pos, q, &h, chunk).await? {
            q += 1;
            continue;
        }
        match first {
            None => first = Some((q, h)),
            Some((_, f)) if f.flush != h.flush => {
                return Ok(Some(PastDamage {
                    first: first.unwrap(),
                    later_flush: Some((q, h)),
                }))
            }
            Some(_) => {}
        }
        q += h.len as u64;
        gap = q;
        exp = h.end_offset();
    }
    Ok(first.map(|first| PastDamage {
        first,
        later_flush: None,
    }))
}

/// Does the checksum of the batch at `q` (header `h`, its first bytes in
/// `buf`, which starts at `buf_pos`) match? Reads what `buf` lacks in pieces
/// of at most `chunk` bytes.
async fn checksum_matches<F: StorageFile>(
    file: &F,
    buf: &Bytes,
    buf_pos: u64,
    q: u64,
    h: &BatchHeader,
    chunk: u64,
) -> Result<bool, LogError> {
    let at = (q - buf_pos) as usize;
    let end = q + h.len as u64;
    let have = buf_pos + buf.len() as u64;
    if end <= have {
        return Ok(crc32c::crc32c(&buf[at + 8..at + h.len as usize]) == h.crc);
    }
    let mut crc = crc32c::crc32c(&buf[at + 8..]);
    let mut pos = have;
    while pos < end {
        let piece = file
            .read_at(pos, chunk.min(end - pos) as usize)
            .await
            .map_err(|e| io_err("read segment", e))?;
        if piece.is_empty() {
            return Ok(false);
        }
        crc = crc32c::crc32c_append(crc, &piece);
        pos += piece.len() as u64;
    }
    Ok(crc == h.crc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_holds_about_what_is_left_of_the_last_round_within_its_segment() {
        const MIB: usize = 1 << 20;
        // Nothing known yet: the least an unknown round gets.
        assert_eq!(piece_room(0, 0, 100, 1 << 30, MIB), MIN_PIECE);
        // What is left of the last round, a write's worth at most; small
        // rounds keep small pieces.
        assert_eq!(piece_room(300 << 10, 0, 100, 1 << 30, MIB), 300 << 10);
        assert_eq!(
            piece_room(300 << 10, 100 << 10, 100, 1 << 30, MIB),
            200 << 10
        );
        assert_eq!(piece_room(200, 0, 100, 1 << 30, MIB), 200);
        assert_eq!(piece_room(4 * MIB, 0, 100, 1 << 30, MIB), MIB);
        // A round past the last one's size: as much again as it holds, at
        // least the least.
        assert_eq!(
            piece_room(100 << 10, 150 << 10, 100, 1 << 30, MIB),
            150 << 10
        );
        assert_eq!(
            piece_room(300 << 10, 300 << 10, 100, 1 << 30, MIB),
            300 << 10
        );
        assert_eq!(piece_room(200, 300, 100, 1 << 30, MIB), MIN_PIECE);
        assert_eq!(piece_room(100 << 10, 3 * MIB, 100, 1 << 30, MIB), MIB);
        // Never past a write's worth, nor what the segment can still take...
        assert_eq!(piece_room(0, 0, 100, 1 << 30, 4096), 4096);
        assert_eq!(piece_room(4 * MIB, 0, 100, 4096, MIB), 4096);
        // ...nor less than the batch.
        assert_eq!(piece_room(4 * MIB, 0, 9 * MIB, 0, MIB), 9 * MIB);
    }

    #[test]
    fn two_readers_in_one_batch_keep_their_own_hints() {
        let pos = |index: u32| format::RecordPos {
            index,
            at: index as usize * 10,
        };
        let base = Offset(1000);
        let mut h = ReadHints::default();
        // Two readers start in the batch, far apart, neither from a hint.
        h.note(base, pos(100), None);
        h.note(base, pos(500), None);
        // Each moves on from its own hint; neither takes the other's.
        for step in 1..20u32 {
            let (k, a) = h
                .find(base, base.plus(100 + 16 * (step - 1) as u64))
                .unwrap();
            assert_eq!(a.index, 100 + 16 * (step - 1));
            h.note(base, pos(a.index + 16), Some(k));
            let (k, b) = h
                .find(base, base.plus(500 + 16 * (step - 1) as u64))
                .unwrap();
            assert_eq!(b.index, 500 + 16 * (step - 1));
            h.note(base, pos(b.index + 16), Some(k));
        }
        // Another batch, and offsets below every hint, find nothing.
        assert_eq!(h.find(Offset(7), Offset(2000)), None);
        assert_eq!(h.find(base, base.plus(50)), None);
    }

    #[test]
    fn reservations_double_up_to_the_step_then_go_a_step_at_a_time() {
        let mib = 1u64 << 20;
        let step = 8 * mib;
        // A barely written segment holds 256 KiB, not a whole step.
        assert_eq!(reservation_for(4096, step), 256 << 10);
        assert_eq!(reservation_for(260 << 10, step), 512 << 10);
        assert_eq!(reservation_for(3 * mib, step), 4 * mib);
        assert_eq!(reservation_for(5 * mib, step), step);
        assert_eq!(reservation_for(8 * mib, step), step);
        assert_eq!(reservation_for(8 * mib + 1, step), 2 * step);
        assert_eq!(reservation_for(100 * mib, step), 104 * mib);
        // Always past the writes.
        for need in [1, 4096, 300 << 10, 7 * mib, 9 * mib, 33 * mib] {
            for step in [4096, 12288, 32 << 10, mib, 3 * mib, 8 * mib] {
                let to = reservation_for(need, step);
                assert!(to >= need, "need {need} step {step}: {to}");
                assert!(
                    to - need < step.max(MIN_RESERVE_STEP).max(need),
                    "need {need} step {step}: {to}"
                );
            }
        }
        // Steps at or under the smallest are used as they are.
        assert_eq!(reservation_for(40 << 10, 32 << 10), 64 << 10);
        assert_eq!(reservation_for(u64::MAX - 5, mib), u64::MAX);
    }

    #[test]
    fn first_nonzero_finds_the_first_set_byte_anywhere() {
        for len in [0usize, 1, 7, 63, 64, 65, 200, 4096] {
            assert_eq!(first_nonzero(&vec![0u8; len]), None, "len {len}");
            for at in 0..len {
                let mut b = vec![0u8; len];
                b[at] = 1;
                if at + 1 < len {
                    b[len - 1] = 9;
                }
                assert_eq!(first_nonzero(&b), Some(at), "len {len} at {at}");
            }
        }
    }

    fn at(offset: u64, lsn: u64) -> Point {
        Point {
            offset: Offset(offset),
            lsn: Lsn::ZERO.plus(lsn),
        }
    }

    #[test]
    fn frontiers_report_what_was_set() {
        let mut f = Frontiers::new(at(5, 100));
        for fr in [Frontier::Queued, Frontier::Written, Frontier::Durable] {
            assert_eq!((f.offset(fr), f.lsn(fr).get()), (Offset(5), 100));
        }
        f.queue(at(7, 180));
        // A group-state entry takes bytes, not offsets.
        f.queue(at(7, 220));
        f.mark_written(at(7, 180));
        assert_eq!(f.offset(Frontier::Queued), Offset(7));
        assert_eq!(f.lsn(Frontier::Queued), Lsn::ZERO.plus(220));
        assert_eq!(f.at(Frontier::Written), at(7, 180));
        assert_eq!(f.at(Frontier::Durable), at(5, 100));
        f.mark_written(at(7, 220));
        f.mark_durable(at(7, 220));
        for fr in [Frontier::Queued, Frontier::Written, Frontier::Durable] {
            assert_eq!(f.at(fr), at(7, 220));
        }
        // Staying put is not moving back.
        f.mark_durable(at(7, 220));
    }

    #[test]
    #[should_panic(expected = "frontier order broken by Written")]
    fn written_past_queued_panics() {
        let mut f = Frontiers::new(at(0, 0));
        f.queue(at(3, 90));
        f.mark_written(at(4, 120));
    }

    #[test]
    #[should_panic(expected = "frontier order broken by Durable")]
    fn durable_past_written_panics() {
        let mut f = Frontiers::new(at(0, 0));
        f.queue(at(3, 90));
        f.mark_written(at(2, 60));
        f.mark_durable(at(3, 90));
    }

    #[test]
    #[should_panic(expected = "Queued frontier moved back")]
    fn queued_moving_back_panics() {
        let mut f = Frontiers::new(at(0, 0));
        f.queue(at(3, 90));
        // The offset stays, the lsn goes back: either unit is checked.
        f.queue(at(3, 80));
    }

    #[test]
    #[should_panic(expected = "Written frontier moved back")]
    fn written_moving_back_panics() {
        let mut f = Frontiers::new(at(0, 0));
        f.queue(at(3, 90));
        f.mark_written(at(3, 90));
        f.mark_written(at(2, 90));
    }
}

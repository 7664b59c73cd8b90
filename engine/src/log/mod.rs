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
//!
//! # Where things are
//!
//! This file holds the state (frontiers, segments, the write queue, the
//! caches) and the append path; `flush` the group-commit loop, `read` reads
//! and the caches' upkeep, `recovery` opening a log, `retention` removing
//! old segments, `close` closing one.

use crate::format::{
    self, encode_control_into, encode_group_into, encode_records_into, AppendRecord, BatchHeader,
    BatchKind, FrameError, Record,
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

mod close;
mod flush;
mod read;
mod recovery;
mod retention;
mod summary;

use read::{Joined, ReadHints};

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
    /// Scan every segment at open, checking every batch's checksum, instead
    /// of taking a sealed segment's summary for what it holds (see
    /// `summary`): an open then reads all the data the shard retains.
    pub verify_on_open: bool,
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
            verify_on_open: false,
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
    /// Bytes the records hold in memory ([`crate::format::Record::memory_bytes`]),
    /// as the byte cap counted them.
    pub bytes: usize,
    /// For [`ShardLog::read_within`]: no record was returned, as the first
    /// (or the bytes brought from disk to reach it) takes this much room,
    /// more than the read had; `next` is where the read stopped (past any
    /// control records before it).
    pub first_needs: Option<usize>,
}

/// Limits of one read.
#[derive(Clone, Copy, Debug)]
pub struct ReadLimits {
    pub max_records: usize,
    pub max_bytes: usize,
}

/// One entry recovery hands back, in log order. Group entries are handed
/// back from the newest complete group snapshot a sealed segment's summary
/// vouches for (the state before it is in it), else from the log's start.
#[non_exhaustive]
pub enum Replayed<'a> {
    /// A group-state entry's body.
    Group(&'a [u8]),
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
    /// Damaged batches reads met in segments, failing at one or passing it
    /// on the way to later records (see `read_cold`).
    pub corrupt_reads: u64,
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
    /// One past the last data record in it (none: it holds none).
    data_end: Option<Offset>,
    /// Does it hold group entries?
    groups: bool,
    /// Flush stamp of its last batch.
    last_flush: Option<u16>,
    /// Where a complete group snapshot starts in it, as its summary (or
    /// this process, which queued it) says.
    snapshot_at: Option<u64>,
}

impl<F> Segment<F> {
    /// A segment holding nothing yet, `reserved` bytes long on disk.
    fn empty(base: Offset, path: PathBuf, file: Rc<F>, reserved: u64) -> Segment<F> {
        Segment {
            base,
            path,
            file,
            len: 0,
            reserved,
            zeroed: 0,
            end: base,
            index: Vec::new(),
            last_indexed_pos: None,
            max_timestamp_ms: 0,
            data_end: None,
            groups: false,
            last_flush: None,
            snapshot_at: None,
        }
    }

    /// A sealed segment as its summary describes it.
    fn summarised(path: PathBuf, file: Rc<F>, s: summary::Summary) -> Segment<F> {
        Segment {
            base: s.base,
            path,
            file,
            len: s.len,
            reserved: s.len,
            zeroed: s.len,
            end: s.end,
            index: s.index,
            last_indexed_pos: s.last_indexed_pos,
            max_timestamp_ms: s.max_timestamp_ms,
            data_end: s.data_end,
            groups: s.groups,
            last_flush: s.last_flush,
            snapshot_at: s.snapshot_at,
        }
    }

    /// Its summary, once sealed (see also `Inner::summary_of`).
    fn summary(&self) -> summary::Summary {
        summary::Summary {
            next_snapshot: None,
            base: self.base,
            len: self.len,
            end: self.end,
            data_end: self.data_end,
            max_timestamp_ms: self.max_timestamp_ms,
            last_flush: self.last_flush,
            groups: self.groups,
            snapshot_at: self.snapshot_at,
            last_indexed_pos: self.last_indexed_pos,
            index: self.index.clone(),
        }
    }

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
        match h.kind {
            BatchKind::Records => self.data_end = Some(h.end_offset()),
            BatchKind::Group => self.groups = true,
            BatchKind::Control => {}
        }
        self.last_flush = Some(h.flush);
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
    corrupt_reads: u64,
    /// The last damaged places reads met and the log reported: (file,
    /// byte), at most 16.
    damage_reported: Vec<(String, u64)>,
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
    /// Complete group snapshots this process queued. Retention removes a
    /// segment only once a later segment holds one of these durably: a
    /// snapshot that opens a segment recovered from disk may have been cut
    /// short by a crash, and the segments before it may hold the only copy
    /// of group state. A segment's summary names the last one in it and
    /// the one the next segment opens with: the next open replays group
    /// entries from the newest of these.
    covers: Vec<Cover>,
    /// The open replayed group entries from a segment before the newest
    /// (no summary vouched for a snapshot in the newest): once the snapshot
    /// queued after the open is durable, the summary of the segment before
    /// the newest is written again to vouch for it, so the next open starts
    /// there (see `vouch_for_snapshot`).
    vouch_pending: bool,
}

/// A complete group snapshot this process queued (see `Inner::covers`).
#[derive(Clone, Copy, Debug)]
struct Cover {
    segment: Offset,
    /// Position in the segment of its first batch.
    at: u64,
    /// Position in the segment just past its last batch.
    until: u64,
    /// Lsn just past its last batch.
    end: Lsn,
}

impl<F> Inner<F> {
    /// The summary of segment `base` as it stands, naming the last complete
    /// group snapshot this process queued into it (else the one its own
    /// summary named).
    fn summary_of(&self, base: Offset) -> Option<summary::Summary> {
        let mut s = self.segments.get(&base)?.summary();
        if let Some(c) = self.covers.iter().rev().find(|c| c.segment == base) {
            s.snapshot_at = Some(c.at);
        }
        Some(s)
    }

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
        self.covers.push(Cover {
            segment: self.target_base,
            at: before,
            until: self.projected_len,
            end: self.frontiers.lsn(Frontier::Queued),
        });
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
    /// Set the provider of group-state snapshot bodies written at the start
    /// of every new segment, and queue one snapshot now: the segments
    /// recovered from disk cannot show that theirs are complete (a crash
    /// may have cut the newest short), so retention waits for this one (see
    /// `Inner::covers`). Call it once the group state is replayed.
    ///
    /// What it writes must be the whole group state as of the call: applied
    /// in order, its bodies replace whatever the entries before them built
    /// (a group missing from them was deleted by an entry before them).
    /// Retention removes the segments before a snapshot, and an open
    /// replays group entries only from the newest one a summary vouches for.
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
    pub fn append<I>(&self, records: I) -> Result<Appended, LogError>
    where
        I: IntoIterator + Clone,
        I::Item: AppendRecord,
    {
        let checked = format::check_records(records.clone()).map_err(LogError::Invalid)?;
        if checked.count == 0 {
            return Err(LogError::Empty);
        }
        let len = checked.len;
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

    /// Queue the records of `batch`, a whole records batch another log
    /// encoded (a replica's committed entry), at this log's next offsets:
    /// its body is checked ([`format::check_records_body`]) and copied as
    /// it is, with no record decoded or encoded again. Its checksum is not
    /// checked here (the caller has).
    pub fn append_copy(&self, batch: &[u8]) -> Result<Appended, LogError> {
        let h = format::parse_header(batch).map_err(|e| LogError::Invalid(e.to_string()))?;
        if h.kind != format::BatchKind::Records || batch.len() != h.len as usize {
            return Err(LogError::Invalid(format!(
                "not a whole records batch ({:?}, {} bytes of {})",
                h.kind,
                batch.len(),
                h.len
            )));
        }
        if h.record_count == 0 {
            return Err(LogError::Empty);
        }
        let body = &batch[format::BATCH_HEADER_BYTES..];
        // The header's own newest timestamp is not trusted (retention goes
        // by it): the records' is taken.
        let max_timestamp_ms = format::check_records_body(body, h.record_count)
            .map_err(|e| LogError::Invalid(e.to_string()))?;
        let a = {
            let mut i = self.inner.borrow_mut();
            let a = i.append_with(batch.len(), |out, next, flush| {
                format::encode_records_copy_into(
                    out,
                    next,
                    (0, flush),
                    (h.record_count, max_timestamp_ms),
                    body,
                )
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
            corrupt_reads: i.corrupt_reads,
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

//! A replica's Raft log on disk: the journal.
//!
//! Every entry a replica accepts — proposed by itself as leader or sent by
//! its leader — is written here and synced before the replica acts on it
//! as durable (a follower's append response, a leader counting its own
//! copy toward a commit). The shard's own log takes an entry only once it
//! is committed, so the shard's segments never hold bytes Raft could take
//! back, and cutting an uncommitted suffix — a new leader's log winning
//! over this replica's — happens here and nowhere else.
//!
//! Files are segments named by the index of their first entry
//! (`{index:020}.rlog`); an entry is one frame, little-endian:
//!
//! ```text
//! crc32c u32 | len u32 | index u64 | term u64 | version u8 = 1 | entry type u8 | zero u16 | zero u32 | data (len bytes)
//! ```
//!
//! The checksum covers every byte after it, data included. Each write
//! starts on a fresh page and is padded with zeros to the end of its last
//! page: a synced byte is never written again, so a write torn by a crash
//! can only damage itself (rewriting a partly filled last page would put
//! entries already acknowledged at the mercy of the next write).
//!
//! Recovery reads every segment from its start and keeps the frames that
//! check, each one index past the last with a term no lower; where the
//! bytes after a frame are zeros to the end of its page, that is a write's
//! padding and the next frame starts on the next page. The first frame
//! that does not check otherwise is where the last write was torn: the segment is
//! cut there (and the cut synced) so a later write cannot leave stale
//! frames behind it. A segment cut short with another after it is damage
//! (a roll syncs the old segment before the new one is written), and so
//! is a segment whose name does not follow the one before: both stop the
//! open rather than hand Raft a log with a hole.
//!
//! Cutting a suffix (`append` at an index already held) removes later
//! segments, truncates the one holding the index and syncs both before a
//! byte of the new entries is written: otherwise a crash could leave new
//! frames followed by old ones that still check, a log that never existed.
//!
//! Compaction ([`Journal::compact`]) first stores the compaction point
//! (`compacted`: the last entry compacted away, its term and the shard
//! offset after it, checksummed, replaced atomically), then removes the
//! segments whose entries all lie at or below it, oldest first, never the
//! last one. A crash part way leaves older segments the point already
//! covers: the next open removes them, and the entries of a kept segment
//! at or below the point are the caller's to drop.
//!
//! Any I/O error stops the journal: every later call fails with the first
//! error, and the replica above it stops with it rather than claim
//! durability it does not have.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use bytes::Bytes;
use felix_engine::format::BATCH_MAX_BYTES;
use felix_engine::storage::{align_up, PageBuf, Storage, StorageFile};
use raft::eraftpb::{Entry, EntryType};

use crate::log::Compacted;

/// Bytes of a frame before its data.
pub const FRAME_HEADER_BYTES: usize = 32;
const VERSION: u8 = 1;
const SUFFIX: &str = ".rlog";
/// Bytes read at a time when a segment is recovered.
const RECOVERY_READ: usize = 8 << 20;
/// The file holding the compaction point.
const COMPACTED_FILE: &str = "compacted";
const COMPACTED_MAGIC: &[u8; 4] = b"FXJC";
/// magic, version u8, zero u8 * 3, index, term, end: u64 each, crc32c u32.
const COMPACTED_BYTES: usize = 4 + 4 + 3 * 8 + 4;

fn encode_compacted(c: &Compacted) -> Vec<u8> {
    let mut b = Vec::with_capacity(COMPACTED_BYTES);
    b.extend_from_slice(COMPACTED_MAGIC);
    b.extend_from_slice(&[VERSION, 0, 0, 0]);
    b.extend_from_slice(&c.index.to_le_bytes());
    b.extend_from_slice(&c.term.to_le_bytes());
    b.extend_from_slice(&c.end.to_le_bytes());
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

fn decode_compacted(b: &[u8]) -> Option<Compacted> {
    if b.len() != COMPACTED_BYTES || &b[..4] != COMPACTED_MAGIC || b[4..8] != [VERSION, 0, 0, 0] {
        return None;
    }
    let (body, crc) = b.split_at(COMPACTED_BYTES - 4);
    if crc32c::crc32c(body).to_le_bytes() != crc {
        return None;
    }
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("eight bytes"));
    Some(Compacted {
        index: u64_at(8),
        term: u64_at(16),
        end: u64_at(24),
    })
}

/// How the journal lays out its files.
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// A segment past this many bytes is closed and the next entry starts
    /// a new one (a segment holds at least one entry, however large).
    pub segment_bytes: u64,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            segment_bytes: 64 << 20,
        }
    }
}

/// Why the journal could not do what was asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JournalError {
    /// An I/O call failed; the journal is stopped.
    #[error("journal {dir}: {what}: {error}")]
    Io {
        dir: String,
        what: String,
        error: String,
    },
    /// What is on disk is not a log this journal wrote (or lost data it
    /// had synced).
    #[error("journal {dir}: damaged: {why}")]
    Damaged { dir: String, why: String },
    /// The caller broke the log's rules (a gap, an index below the first).
    #[error("journal: {0}")]
    Invalid(String),
    /// An earlier I/O error stopped the journal.
    #[error("journal stopped: {0}")]
    Stopped(String),
}

struct Segment<F> {
    /// Index of the segment's first entry (its name).
    first: u64,
    path: PathBuf,
    file: Rc<F>,
    /// Bytes of whole frames.
    len: u64,
    /// `starts[i]`: position and term of the frame of entry `first + i`.
    starts: Vec<(u64, u64)>,
    /// Written since its last sync.
    unsynced: bool,
}

impl<F> Segment<F> {
    fn last(&self) -> u64 {
        self.first + self.starts.len() as u64 - 1
    }
}

/// One replica's journal. Lives on its core; calls must not overlap (the
/// replica's persister awaits each before the next).
pub struct Journal<S: Storage> {
    storage: S,
    dir: PathBuf,
    config: JournalConfig,
    /// Ascending by `first`; never empty once open.
    segments: Vec<Segment<S::File>>,
    last_term: u64,
    /// The compaction point stored, if the log was ever compacted.
    compacted: Option<Compacted>,
    stopped: Option<String>,
}

fn segment_name(first: u64) -> String {
    format!("{first:020}{SUFFIX}")
}

fn parse_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(SUFFIX)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn entry_type_of(b: u8) -> Option<EntryType> {
    match b {
        0 => Some(EntryType::EntryNormal),
        1 => Some(EntryType::EntryConfChange),
        2 => Some(EntryType::EntryConfChangeV2),
        _ => None,
    }
}

fn entry_type_byte(t: EntryType) -> u8 {
    match t {
        EntryType::EntryNormal => 0,
        EntryType::EntryConfChange => 1,
        EntryType::EntryConfChangeV2 => 2,
    }
}

/// The frame of `e`'s header (the data follows it).
fn frame_header(e: &Entry) -> [u8; FRAME_HEADER_BYTES] {
    let mut h = [0u8; FRAME_HEADER_BYTES];
    h[4..8].copy_from_slice(&(e.data.len() as u32).to_le_bytes());
    h[8..16].copy_from_slice(&e.index.to_le_bytes());
    h[16..24].copy_from_slice(&e.term.to_le_bytes());
    h[24] = VERSION;
    h[25] = entry_type_byte(e.get_entry_type());
    let mut crc = crc32c::crc32c(&h[4..]);
    crc = crc32c::crc32c_append(crc, &e.data);
    h[..4].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The frame at the start of `buf` if it is whole and checks, and is
/// entry `index` of a term at least `min_term`. Never panics.
fn parse_frame(buf: &Bytes, index: u64, min_term: u64) -> Option<Entry> {
    let h = buf.get(..FRAME_HEADER_BYTES)?;
    let u32_at = |at: usize| u32::from_le_bytes(h[at..at + 4].try_into().expect("four bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("eight bytes"));
    let len = u32_at(4);
    if len > BATCH_MAX_BYTES || h[24] != VERSION || h[26..32] != [0; 6] {
        return None;
    }
    let end = FRAME_HEADER_BYTES + len as usize;
    let data = buf.get(FRAME_HEADER_BYTES..end)?;
    let crc = crc32c::crc32c_append(crc32c::crc32c(&h[4..]), data);
    if crc != u32_at(0) || u64_at(8) != index || u64_at(16) < min_term {
        return None;
    }
    let mut e = Entry {
        index,
        term: u64_at(16),
        data: buf.slice(FRAME_HEADER_BYTES..end),
        ..Entry::default()
    };
    e.set_entry_type(entry_type_of(h[25])?);
    Some(e)
}

impl<S: Storage> Journal<S> {
    /// Open the journal in `dir` (created if missing), recovering its
    /// entries; they are returned in index order. An empty journal starts
    /// at index 1. A compacted one ([`Journal::compacted`]) can return
    /// entries at or below its compaction point (a segment is kept whole):
    /// the caller drops them.
    pub async fn open(
        storage: S,
        dir: &Path,
        config: JournalConfig,
    ) -> Result<(Journal<S>, Vec<Entry>), JournalError> {
        let mut j = Journal {
            storage,
            dir: dir.to_path_buf(),
            config,
            segments: Vec::new(),
            last_term: 0,
            compacted: None,
            stopped: None,
        };
        j.storage
            .create_dir_all(dir)
            .await
            .map_err(|e| j.io("creating the directory", e))?;
        let point = dir.join(COMPACTED_FILE);
        match j.storage.read_file(&point).await {
            Ok(None) => {}
            Ok(Some(b)) => match decode_compacted(&b) {
                // No log reaches half of u64's indices: one that says so is
                // damage (and the index after it would overflow).
                Some(c) if c.index < u64::MAX >> 1 => j.compacted = Some(c),
                Some(c) => {
                    return Err(j.damaged(format!(
                        "{} names index {}, past any a log reaches: the log's start is unknown",
                        point.display(),
                        c.index
                    )))
                }
                None => {
                    return Err(j.damaged(format!(
                        "{} does not check: the log's start is unknown",
                        point.display()
                    )))
                }
            },
            Err(e) => return Err(j.io("reading the compaction point", e)),
        }
        let names = j
            .storage
            .list_dir(dir)
            .await
            .map_err(|e| j.io("listing the directory", e))?;
        let mut firsts: Vec<u64> = names.iter().filter_map(|n| parse_name(n)).collect();
        firsts.sort_unstable();
        // Segments a compaction was removing when it was cut short: every
        // entry in them is at or below the point (the next segment starts
        // at or before the entry after it).
        if let Some(c) = j.compacted {
            let covered = firsts
                .windows(2)
                .take_while(|w| w[1] <= c.index + 1)
                .count();
            for first in firsts.drain(..covered) {
                let path = dir.join(segment_name(first));
                j.storage
                    .remove_file(&path)
                    .await
                    .map_err(|e| j.io(&format!("removing {}", path.display()), e))?;
            }
            if let Some(&first) = firsts.first() {
                if first > c.index + 1 {
                    return Err(j.damaged(format!(
                        "the log was compacted to entry {}, and the first segment left is {}",
                        c.index,
                        segment_name(first)
                    )));
                }
            }
        }
        let mut entries = Vec::new();
        let count = firsts.len();
        for (k, first) in firsts.into_iter().enumerate() {
            let expected = match j.segments.last() {
                None => first,
                Some(prev) if prev.starts.is_empty() => prev.first,
                Some(prev) => prev.last() + 1,
            };
            if first != expected || first == 0 {
                return Err(j.damaged(format!(
                    "segment {} does not follow the log before it (expected {})",
                    segment_name(first),
                    segment_name(expected)
                )));
            }
            let seg = j
                .recover_segment(first, k + 1 == count, &mut entries)
                .await?;
            j.segments.push(seg);
        }
        if j.segments.is_empty() {
            let first = j.compacted.map_or(1, |c| c.index + 1);
            let seg = j.create_segment(first).await?;
            j.segments.push(seg);
        } else {
            // A segment a crash interrupted the creation of may be here
            // without its directory entry being durable; the entries
            // written to it next must not vanish with it.
            j.storage
                .sync_dir(dir)
                .await
                .map_err(|e| j.io("syncing the directory", e))?;
        }
        Ok((j, entries))
    }

    /// Read segment `first` back, pushing its entries onto `entries`; the
    /// last segment is cut after its last whole frame, an earlier one must
    /// end exactly there.
    async fn recover_segment(
        &mut self,
        first: u64,
        is_last: bool,
        entries: &mut Vec<Entry>,
    ) -> Result<Segment<S::File>, JournalError> {
        let path = self.dir.join(segment_name(first));
        let file = self
            .storage
            .open(&path, false)
            .await
            .map_err(|e| self.io(&format!("opening {}", path.display()), e))?;
        let size = file
            .size()
            .await
            .map_err(|e| self.io(&format!("sizing {}", path.display()), e))?;
        let mut raw = Vec::with_capacity(size as usize);
        while (raw.len() as u64) < size {
            let want = RECOVERY_READ.min((size - raw.len() as u64) as usize);
            let got = file
                .read_at(raw.len() as u64, want)
                .await
                .map_err(|e| self.io(&format!("reading {}", path.display()), e))?;
            if got.is_empty() {
                break;
            }
            raw.extend_from_slice(&got);
        }
        let raw = Bytes::from(raw);
        let mut seg = Segment {
            first,
            path,
            file: Rc::new(file),
            len: 0,
            starts: Vec::new(),
            unsynced: false,
        };
        let mut pos = 0usize;
        let mut index = first;
        loop {
            if let Some(e) = parse_frame(&raw.slice(pos..), index, self.last_term) {
                seg.starts.push((pos as u64, e.term));
                pos += FRAME_HEADER_BYTES + e.data.len();
                seg.len = pos as u64;
                self.last_term = e.term;
                index += 1;
                entries.push(e);
                continue;
            }
            // A write's padding: zeros to the end of the page, the next
            // write on the next page.
            let page_end = (align_up(pos as u64) as usize).min(raw.len());
            if pos == page_end || raw[pos..page_end].iter().any(|&b| b != 0) {
                break;
            }
            pos = page_end;
        }
        let pos = seg.len as usize;
        if seg.len < size {
            let rest_is_zero = raw[pos..].iter().all(|&b| b == 0);
            if !is_last && !rest_is_zero {
                return Err(self.damaged(format!(
                    "{} holds {} bytes that are not whole entries after entry {}, and a later segment follows",
                    seg.path.display(),
                    size - seg.len,
                    index - 1
                )));
            }
            if !rest_is_zero {
                tracing::warn!(
                    journal = %self.dir.display(),
                    "cutting a torn write of {} bytes after entry {}",
                    size - seg.len,
                    index - 1
                );
            }
            // Cut even zeros: the next write must not find stale frames
            // past its end on the next recovery.
            seg.file
                .truncate(seg.len)
                .await
                .map_err(|e| self.io("cutting a torn tail", e))?;
            seg.file
                .sync()
                .await
                .map_err(|e| self.io("syncing a cut tail", e))?;
        }
        Ok(seg)
    }

    async fn create_segment(&mut self, first: u64) -> Result<Segment<S::File>, JournalError> {
        let path = self.dir.join(segment_name(first));
        let file = self
            .storage
            .open(&path, true)
            .await
            .map_err(|e| self.io(&format!("creating {}", path.display()), e))?;
        // Left from an earlier cut that removed it only partly? Start empty.
        file.truncate(0)
            .await
            .map_err(|e| self.io(&format!("emptying {}", path.display()), e))?;
        file.sync()
            .await
            .map_err(|e| self.io(&format!("syncing {}", path.display()), e))?;
        self.storage
            .sync_dir(&self.dir)
            .await
            .map_err(|e| self.io("syncing the directory", e))?;
        Ok(Segment {
            first,
            path,
            file: Rc::new(file),
            len: 0,
            starts: Vec::new(),
            unsynced: false,
        })
    }

    fn io(&mut self, what: &str, e: std::io::Error) -> JournalError {
        let err = JournalError::Io {
            dir: self.dir.display().to_string(),
            what: what.to_string(),
            error: e.to_string(),
        };
        if self.stopped.is_none() {
            tracing::error!("replica journal stopped: {err}");
            self.stopped = Some(err.to_string());
        }
        err
    }

    fn damaged(&self, why: String) -> JournalError {
        JournalError::Damaged {
            dir: self.dir.display().to_string(),
            why,
        }
    }

    fn refuse(&self) -> Result<(), JournalError> {
        match &self.stopped {
            Some(why) => Err(JournalError::Stopped(why.clone())),
            None => Ok(()),
        }
    }

    /// Index of the first entry held (its segment's first: entries at or
    /// below the compaction point can be among them).
    pub fn first_index(&self) -> u64 {
        self.segments[0].first
    }

    /// The compaction point stored, if the log was compacted.
    pub fn compacted(&self) -> Option<Compacted> {
        self.compacted
    }

    /// Compact the journal to `point` (an entry held, committed, applied and
    /// needed by no replica): store the point, then remove every segment
    /// but the last whose entries all lie at or below it. The entries left
    /// at or below it in the first segment kept are dropped by the next
    /// open's caller. Returns the segments removed.
    pub async fn compact(&mut self, point: Compacted) -> Result<usize, JournalError> {
        self.refuse()?;
        if self.compacted.is_some_and(|c| c.index >= point.index) {
            return Ok(0);
        }
        if point.index > self.last_index() {
            return Err(JournalError::Invalid(format!(
                "compacting to entry {} of a journal ending at {}",
                point.index,
                self.last_index()
            )));
        }
        let path = self.dir.join(COMPACTED_FILE);
        if let Err(e) = self
            .storage
            .write_file_atomic(&path, &encode_compacted(&point))
            .await
        {
            return Err(self.io("storing the compaction point", e));
        }
        self.compacted = Some(point);
        let mut removed = 0;
        while self.segments.len() > 1 && self.segments[0].last() <= point.index {
            let seg = self.segments.remove(0);
            if let Ok(file) = Rc::try_unwrap(seg.file) {
                if let Err(e) = file.close().await {
                    return Err(self.io(&format!("closing {}", seg.path.display()), e));
                }
            }
            if let Err(e) = self.storage.remove_file(&seg.path).await {
                return Err(self.io(&format!("removing {}", seg.path.display()), e));
            }
            removed += 1;
        }
        if removed > 0 {
            if let Err(e) = self.storage.sync_dir(&self.dir).await {
                return Err(self.io("syncing the directory", e));
            }
        }
        Ok(removed)
    }

    /// Index of the last entry held (`first_index() - 1` when empty).
    pub fn last_index(&self) -> u64 {
        let seg = self.segments.last().expect("never empty");
        seg.first + seg.starts.len() as u64 - 1
    }

    /// Bytes of entries held, frames included.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Segment files.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The error that stopped the journal, if one did.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// Write `entries` (contiguous, the first at most one past the last
    /// held): an entry at an index already held replaces it and every
    /// entry after it. Not durable until [`Journal::sync`].
    pub async fn append(&mut self, entries: &[Entry]) -> Result<(), JournalError> {
        self.refuse()?;
        let Some(first) = entries.first() else {
            return Ok(());
        };
        let hi = self.last_index();
        // Nothing at or below the compaction point is written again.
        let lo = self
            .compacted
            .map_or(self.first_index(), |c| c.index + 1)
            .max(self.first_index());
        if first.index < lo || first.index > hi + 1 {
            return Err(JournalError::Invalid(format!(
                "an append at index {} to a journal holding {lo}..={hi}",
                first.index
            )));
        }
        for (i, e) in entries.iter().enumerate() {
            if e.index != first.index + i as u64 {
                return Err(JournalError::Invalid(format!(
                    "entries are not contiguous: {} after {}",
                    e.index,
                    first.index + i as u64 - 1
                )));
            }
            if e.data.len() as u64 > BATCH_MAX_BYTES as u64 {
                return Err(JournalError::Invalid(format!(
                    "entry {} of {} bytes",
                    e.index,
                    e.data.len()
                )));
            }
            debug_assert!(e.context.is_empty(), "entry contexts are not kept");
        }
        let min_term = self.term_of(first.index - 1);
        if entries.iter().any(|e| e.term < min_term)
            || entries.windows(2).any(|w| w[1].term < w[0].term)
        {
            return Err(JournalError::Invalid(format!(
                "entry terms go backwards (the log before ends at term {min_term})"
            )));
        }
        if first.index <= hi {
            self.cut(first.index).await?;
        }
        let mut rest = entries;
        while !rest.is_empty() {
            let seg = self.segments.last().expect("never empty");
            if !seg.starts.is_empty() && seg.len >= self.config.segment_bytes {
                self.roll(rest[0].index).await?;
            }
            let seg = self.segments.last().expect("never empty");
            // As many entries as fit the segment, one at least.
            let room = self.config.segment_bytes.saturating_sub(seg.len);
            let mut take = 0;
            let mut bytes = 0u64;
            for e in rest {
                let len = (FRAME_HEADER_BYTES + e.data.len()) as u64;
                if take > 0 && bytes + len > room {
                    break;
                }
                take += 1;
                bytes += len;
            }
            let (now, later) = rest.split_at(take);
            self.write(now, bytes as usize).await?;
            rest = later;
        }
        self.last_term = entries.last().expect("not empty").term;
        Ok(())
    }

    /// Write `entries` (`bytes` of frames) on the page after the last
    /// segment's end.
    async fn write(&mut self, entries: &[Entry], bytes: usize) -> Result<(), JournalError> {
        let seg = self.segments.last_mut().expect("never empty");
        let at = align_up(seg.len);
        let mut buf = PageBuf::with_capacity(bytes);
        let mut starts = Vec::with_capacity(entries.len());
        for e in entries {
            starts.push((at + buf.len() as u64, e.term));
            buf.extend_from_slice(&frame_header(e));
            buf.extend_from_slice(&e.data);
        }
        let end = at + buf.len() as u64;
        buf.pad_to_page();
        let len = buf.len();
        let file = seg.file.clone();
        if let Err(e) = file.write_at(buf, len, at).await {
            return Err(self.io("writing entries", e));
        }
        let seg = self.segments.last_mut().expect("never empty");
        seg.starts.extend(starts);
        seg.len = end;
        seg.unsynced = true;
        Ok(())
    }

    /// Close the last segment (synced, so a torn write can only be in the
    /// newest) and start one at `first`.
    async fn roll(&mut self, first: u64) -> Result<(), JournalError> {
        self.sync().await?;
        let seg = self.create_segment(first).await?;
        self.segments.push(seg);
        Ok(())
    }

    /// Drop entry `index` and everything after it, durably.
    async fn cut(&mut self, index: u64) -> Result<(), JournalError> {
        let mut removed = false;
        while self.segments.len() > 1 && self.segments.last().expect("never empty").first >= index {
            let seg = self.segments.pop().expect("checked");
            if let Err(e) = self.storage.remove_file(&seg.path).await {
                return Err(self.io(&format!("removing {}", seg.path.display()), e));
            }
            removed = true;
        }
        if removed {
            if let Err(e) = self.storage.sync_dir(&self.dir).await {
                return Err(self.io("syncing the directory", e));
            }
        }
        let seg = self.segments.last_mut().expect("never empty");
        let keep = index.saturating_sub(seg.first) as usize;
        let pos = seg.starts.get(keep).map_or(seg.len, |&(pos, _)| pos);
        seg.starts.truncate(keep);
        seg.len = pos;
        let file = seg.file.clone();
        if let Err(e) = file.truncate(pos).await {
            return Err(self.io("cutting a suffix", e));
        }
        if let Err(e) = file.sync().await {
            return Err(self.io("syncing a cut suffix", e));
        }
        self.segments.last_mut().expect("never empty").unsynced = false;
        self.last_term = self.term_of(index - 1);
        Ok(())
    }

    /// The term of entry `index` (the compaction point's own, once its
    /// segment is gone; 0 if not held).
    fn term_of(&self, index: u64) -> u64 {
        if let Some(c) = self.compacted.filter(|c| c.index == index) {
            return c.term;
        }
        self.segments
            .iter()
            .rev()
            .find(|s| s.first <= index)
            .and_then(|s| s.starts.get((index - s.first) as usize))
            .map_or(0, |&(_, term)| term)
    }

    /// Make every entry written so far durable.
    pub async fn sync(&mut self) -> Result<(), JournalError> {
        self.refuse()?;
        for k in 0..self.segments.len() {
            if !self.segments[k].unsynced {
                continue;
            }
            let file = self.segments[k].file.clone();
            if let Err(e) = file.sync().await {
                return Err(self.io("syncing entries", e));
            }
            self.segments[k].unsynced = false;
        }
        Ok(())
    }

    /// Close every file (after a sync; unsynced writes may be lost).
    pub async fn close(self) -> Result<(), JournalError> {
        let dir = self.dir.display().to_string();
        for seg in self.segments {
            let Ok(file) = Rc::try_unwrap(seg.file) else {
                continue;
            };
            file.close().await.map_err(|e| JournalError::Io {
                dir: dir.clone(),
                what: "closing a segment".into(),
                error: e.to_string(),
            })?;
        }
        Ok(())
    }
}

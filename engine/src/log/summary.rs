//! A sealed segment's summary: what opening the log would otherwise scan
//! the whole segment to learn.
//!
//! When the flusher seals a segment (its data durable, its padding cut,
//! the next segment created and named in `tail.mark`, so the sealed one can
//! no longer grow) it writes `<base>.sum` beside it, atomically, once the
//! round is durable: the segment's length and end, the end of its last data
//! record, the stamp of its last flush, its newest timestamp, its sparse
//! index, whether it holds group entries, where in it a complete group
//! snapshot starts (one this process queued), and where a complete
//! snapshot in the next segment lies (durable by then): the one that
//! segment opened with, or the one a start-up that had to replay older
//! segments queued into it (the summary is then written again).
//! Opening a log then reads the summaries instead of the sealed segments.
//! It scans the newest segment whole, and replays group entries only from
//! the newest complete snapshot a summary vouches for (the state before a
//! complete snapshot is in it), reading the segment that holds it and any
//! after it if they hold group entries. That is normally the newest
//! segment's opening snapshot, so opening a shard costs one segment's read
//! however much data it retains (and one more per sealed segment without a
//! summary it can take; the open writes those it lacked).
//!
//! A summary is trusted only if it decodes (magic, checksum, fields that fit
//! together), names its segment and matches the segment file's size; else
//! the segment is scanned as before, which is always correct. An open
//! removes summaries that stand for no sealed segment (the newest segment's,
//! one whose segment retention removed). An open that finds the newest
//! segment ending inside the snapshot its predecessor's summary vouches
//! for refuses the shard (durable data is missing) rather than rebuild
//! group state from part of it. Batches in a summarised segment
//! are checked when they are read (checksum, and the offset each should
//! start at), not at open (`LogConfig::verify_on_open` scans them all).
//!
//! Layout, little-endian: the magic `FXSUMM02`; `u64` fields base, len,
//! end, data end (`u64::MAX`: none), newest timestamp, last flush stamp
//! (`u64::MAX`: none), flags (bit 0: holds group entries), snapshot
//! position (`u64::MAX`: none), last indexed position (`u64::MAX`: none),
//! the next segment's opening snapshot's start and end (`u64::MAX`: none),
//! index count; the index as (offset, position) pairs of `u64`; a CRC32C of
//! everything before it.

use crate::types::Offset;

const MAGIC: &[u8; 8] = b"FXSUMM02";
/// The magic of the layout before `next_snapshot` (never released): such a
/// summary is not used, and the open replaces it.
const OLD_MAGIC: &[u8; 8] = b"FXSUMM01";
const NONE: u64 = u64::MAX;
const FIXED: usize = 8 + 12 * 8;
/// Most index entries a summary keeps (512 KiB of them): a segment indexed
/// more densely keeps every other entry until it fits. The index only
/// shortens a read's walk to its offset; any subset of it serves.
pub(super) const MAX_INDEX: usize = 32 * 1024;

/// Extension of a summary file (`<twenty digits>.sum`).
pub(super) const SUMMARY_EXT: &str = "sum";

pub(super) fn summary_name(base: Offset) -> String {
    format!("{:020}.{SUMMARY_EXT}", base.0)
}

/// Write `summary` beside its segment in `dir`. Only the next open's speed
/// depends on it: a failure is reported, and (unless the summary is a
/// rewrite of a good one, which a failed atomic write leaves in place)
/// whatever is under the name removed, so that open reads the segment.
pub(super) async fn write_summary<S: crate::storage::Storage>(
    storage: &S,
    dir: &std::path::Path,
    summary: &Summary,
    rewrite: bool,
) {
    let path = dir.join(summary_name(summary.base));
    if let Err(e) = storage.write_file_atomic(&path, &summary.encode()).await {
        tracing::warn!(
            summary = %path.display(),
            "cannot write a sealed segment's summary: {e}"
        );
        if !rewrite {
            let _ = storage.remove_file(&path).await;
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Summary {
    pub base: Offset,
    /// Bytes of batches in the segment (its file's size once sealed).
    pub len: u64,
    pub end: Offset,
    /// One past the last data record in the segment (none: it holds none).
    pub data_end: Option<Offset>,
    pub max_timestamp_ms: u64,
    /// Flush stamp of its last batch.
    pub last_flush: Option<u16>,
    /// Does it hold group entries?
    pub groups: bool,
    /// Position of the first batch of a complete group snapshot in it.
    pub snapshot_at: Option<u64>,
    /// Positions of the first batch and just past the last of a complete
    /// group snapshot in the next segment, durable when this summary was
    /// written: the snapshot that segment opened with, or the one a
    /// start-up that had to replay older segments queued into it.
    pub next_snapshot: Option<(u64, u64)>,
    pub last_indexed_pos: Option<u64>,
    pub index: Vec<(Offset, u64)>,
}

fn opt(v: Option<u64>) -> u64 {
    v.unwrap_or(NONE)
}

fn from_opt(v: u64) -> Option<u64> {
    (v != NONE).then_some(v)
}

impl Summary {
    pub fn encode(&self) -> Vec<u8> {
        let mut index: &[(Offset, u64)] = &self.index;
        let thinned: Vec<(Offset, u64)>;
        if index.len() > MAX_INDEX {
            let step = index.len().div_ceil(MAX_INDEX);
            thinned = index.iter().step_by(step).copied().collect();
            index = &thinned;
        }
        let mut out = Vec::with_capacity(FIXED + index.len() * 16 + 4);
        out.extend_from_slice(MAGIC);
        for f in [
            self.base.0,
            self.len,
            self.end.0,
            opt(self.data_end.map(|o| o.0)),
            self.max_timestamp_ms,
            opt(self.last_flush.map(u64::from)),
            u64::from(self.groups),
            opt(self.snapshot_at),
            opt(self.last_indexed_pos),
            opt(self.next_snapshot.map(|n| n.0)),
            opt(self.next_snapshot.map(|n| n.1)),
            index.len() as u64,
        ] {
            out.extend_from_slice(&f.to_le_bytes());
        }
        for (o, p) in index {
            out.extend_from_slice(&o.0.to_le_bytes());
            out.extend_from_slice(&p.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Is `bytes` a summary in a layout this build no longer writes?
    pub fn is_old(bytes: &[u8]) -> bool {
        bytes.starts_with(OLD_MAGIC)
    }

    /// The summary in `bytes`, if they are one whose fields fit together.
    pub fn decode(bytes: &[u8]) -> Option<Summary> {
        if bytes.len() < FIXED + 4 || &bytes[..8] != MAGIC {
            return None;
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().ok()?) {
            return None;
        }
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(body.get(i..i + 8)?.try_into().ok()?))
        };
        let f: Vec<u64> = (0..12).map(|k| word(8 + 8 * k)).collect::<Option<_>>()?;
        let count = usize::try_from(f[11]).ok().filter(|c| *c <= MAX_INDEX)?;
        if body.len() != FIXED + count * 16 {
            return None;
        }
        let mut index = Vec::with_capacity(count);
        for k in 0..count {
            let at = FIXED + 16 * k;
            index.push((Offset(word(at)?), word(at + 8)?));
        }
        let s = Summary {
            base: Offset(f[0]),
            len: f[1],
            end: Offset(f[2]),
            data_end: from_opt(f[3]).map(Offset),
            max_timestamp_ms: f[4],
            last_flush: match f[5] {
                NONE => None,
                v => Some(u16::try_from(v).ok()?),
            },
            groups: match f[6] {
                0 => false,
                1 => true,
                _ => return None,
            },
            snapshot_at: from_opt(f[7]),
            last_indexed_pos: from_opt(f[8]),
            next_snapshot: match (from_opt(f[9]), from_opt(f[10])) {
                (None, None) => None,
                (Some(at), Some(until)) => Some((at, until)),
                _ => return None,
            },
            index,
        };
        s.consistent().then_some(s)
    }

    /// Do the fields describe a segment the log could have written?
    fn consistent(&self) -> bool {
        let in_segment = |o: Offset| o >= self.base && o < self.end;
        self.base <= self.end
            && self.end < Offset::LIMIT
            && self
                .data_end
                .is_none_or(|d| d > self.base && d <= self.end)
            && self.snapshot_at.is_none_or(|p| p <= self.len)
            && self.next_snapshot.is_none_or(|(at, until)| at <= until)
            && self.last_indexed_pos.is_none_or(|p| p < self.len)
            && self
                .index
                .iter()
                .all(|&(o, p)| in_segment(o) && p < self.len)
            && self
                .index
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1)
            // Batches, records and offsets come together: an empty segment
            // has none of them, one with records has an end past its base.
            && (self.len > 0 || (self.end == self.base && self.index.is_empty()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Summary {
        Summary {
            base: Offset(1000),
            len: 1 << 20,
            end: Offset(9000),
            data_end: Some(Offset(8999)),
            max_timestamp_ms: 1_700_000_000_000,
            last_flush: Some(65_535),
            groups: true,
            snapshot_at: Some(0),
            next_snapshot: Some((0, 4096)),
            last_indexed_pos: Some(1 << 19),
            index: vec![(Offset(1000), 0), (Offset(5000), 1 << 19)],
        }
    }

    #[test]
    fn a_summary_round_trips_and_any_flipped_bit_or_cut_is_refused() {
        let s = sample();
        let bytes = s.encode();
        assert_eq!(Summary::decode(&bytes), Some(s));
        for i in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[i / 8] ^= 1 << (i % 8);
            assert_eq!(Summary::decode(&b), None, "bit {i} flipped");
        }
        for n in 0..bytes.len() {
            assert_eq!(Summary::decode(&bytes[..n]), None, "cut at {n}");
        }
        let none = Summary {
            data_end: None,
            last_flush: None,
            groups: false,
            snapshot_at: None,
            next_snapshot: None,
            ..sample()
        };
        assert_eq!(Summary::decode(&none.encode()), Some(none));
    }

    #[test]
    fn fields_that_do_not_fit_together_are_refused_even_with_a_good_checksum() {
        let bad = [
            Summary {
                end: Offset(999),
                ..sample()
            },
            Summary {
                data_end: Some(Offset(9001)),
                ..sample()
            },
            Summary {
                snapshot_at: Some((1 << 20) + 1),
                ..sample()
            },
            Summary {
                next_snapshot: Some((90, 10)),
                ..sample()
            },
            Summary {
                index: vec![(Offset(5000), 10), (Offset(1000), 20)],
                ..sample()
            },
            Summary {
                index: vec![(Offset(9000), 10)],
                ..sample()
            },
            // No bytes, yet offsets.
            Summary {
                len: 0,
                snapshot_at: None,
                last_indexed_pos: None,
                index: Vec::new(),
                ..sample()
            },
        ];
        for s in bad {
            assert_eq!(Summary::decode(&s.encode()), None, "{s:?}");
        }
    }

    #[test]
    fn a_dense_index_is_thinned_to_fit_and_keeps_its_first_entry() {
        let n = MAX_INDEX * 2 + 3;
        let s = Summary {
            base: Offset(0),
            len: 1 << 40,
            end: Offset(n as u64 * 10),
            index: (0..n as u64).map(|k| (Offset(k * 10), k * 4096)).collect(),
            last_indexed_pos: Some((n as u64 - 1) * 4096),
            ..sample()
        };
        let back = Summary::decode(&s.encode()).expect("decodes");
        assert!(back.index.len() <= MAX_INDEX);
        assert_eq!(back.index[0], (Offset(0), 0));
        assert!(back.index.iter().all(|e| s.index.contains(e)));
    }
}

//! What one Raft entry is to a shard.
//!
//! A Raft entry's data is one whole batch in the storage format
//! (`docs/internals/storage-format.md`), stamped with the entry's term and
//! the offset it starts at, so the shard's log takes the same records
//! (a replica copies the batch's body under a header of its own). The one
//! exception is the empty entry raft-rs appends for
//! a new leader: that is the shard's **generation-start record**, a control
//! record that takes one offset and is never delivered.

use bytes::Bytes;
use felix_engine::format::{self, BatchKind, FrameError};
use felix_engine::Offset;
use raft::eraftpb::{Entry, EntryType};

/// What a Raft entry holds, once checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// The empty entry of a new leader: the generation-start record.
    GenerationStart,
    /// A batch of `count` user records.
    Records { count: u32 },
    /// Consumer-group state (takes no offset).
    Group,
}

/// A checked entry: its kind and the offsets it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryInfo {
    pub kind: EntryKind,
    /// Offsets the entry takes (generation start: 1; group: 0).
    pub offsets: u64,
    /// The offset the batch says it starts at (`None` for the generation
    /// start, which starts wherever the log before it ends).
    pub base: Option<Offset>,
}

/// Why an entry is not one this shard can take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    #[error(
        "entry {index}: {kind:?} entries are not used (membership changes are not supported yet)"
    )]
    NotNormal { index: u64, kind: EntryType },
    #[error("entry {index}: not one whole batch: {reason}")]
    Batch { index: u64, reason: String },
    #[error("entry {index}: a {kind:?} batch cannot be replicated (generation starts are empty entries)")]
    Kind { index: u64, kind: BatchKind },
    #[error("entry {index}: batch says term {batch}, entry says {entry}")]
    Term { index: u64, batch: u64, entry: u64 },
    #[error("entry {index}: batch starts at offset {base}, the log before it ends at {expected}")]
    Offset {
        index: u64,
        base: u64,
        expected: u64,
    },
}

/// Check an entry's data without trusting it: a generation start (empty),
/// exactly one verified records batch, or a run of verified group batches
/// (the group-state writes of one request), all of the entry's own term.
/// Never panics.
pub fn inspect(entry: &Entry) -> Result<EntryInfo, EntryError> {
    let index = entry.index;
    if entry.get_entry_type() != EntryType::EntryNormal {
        return Err(EntryError::NotNormal {
            index,
            kind: entry.get_entry_type(),
        });
    }
    let data = &entry.data[..];
    if data.is_empty() {
        return Ok(EntryInfo {
            kind: EntryKind::GenerationStart,
            offsets: 1,
            base: None,
        });
    }
    let bad = |reason: String| EntryError::Batch { index, reason };
    let mut at = 0;
    let mut first: Option<EntryInfo> = None;
    while at < data.len() {
        let header =
            format::parse_batch(&data[at..]).map_err(|e: FrameError| bad(e.to_string()))?;
        if !header.plausible() {
            return Err(bad("record count does not fit the batch".into()));
        }
        if header.term != entry.term {
            return Err(EntryError::Term {
                index,
                batch: header.term,
                entry: entry.term,
            });
        }
        let kind = match header.kind {
            BatchKind::Records => EntryKind::Records {
                count: header.record_count,
            },
            BatchKind::Group => EntryKind::Group,
            other => return Err(EntryError::Kind { index, kind: other }),
        };
        match first {
            None => {
                first = Some(EntryInfo {
                    kind,
                    offsets: header.offsets(),
                    base: Some(header.base_offset),
                })
            }
            Some(f) => {
                if f.kind != EntryKind::Group || kind != EntryKind::Group {
                    return Err(bad("only group batches share an entry".into()));
                }
                if f.base != Some(header.base_offset) {
                    return Err(bad(
                        "group batches of one entry disagree on their offset".into()
                    ));
                }
            }
        }
        at += header.len as usize;
    }
    Ok(first.expect("data is not empty"))
}

/// What an entry this replica already checked is (with [`inspect`] when
/// it came from a peer, or because this replica built it): one header
/// read, no checksum.
pub(crate) fn info_of(entry: &Entry) -> EntryInfo {
    if entry.data.is_empty() {
        return EntryInfo {
            kind: EntryKind::GenerationStart,
            offsets: 1,
            base: None,
        };
    }
    match format::parse_header(&entry.data) {
        Ok(h) => EntryInfo {
            kind: match h.kind {
                BatchKind::Records => EntryKind::Records {
                    count: h.record_count,
                },
                _ => EntryKind::Group,
            },
            offsets: h.offsets(),
            base: Some(h.base_offset),
        },
        // Not reached for checked entries; taking no offset keeps it inert.
        Err(_) => EntryInfo {
            kind: EntryKind::Group,
            offsets: 0,
            base: None,
        },
    }
}

/// Check the entry at `index`, described by `info`, starts where a log
/// ending at offset `end` ends, and return the end after it.
pub fn follows(index: u64, info: &EntryInfo, end: u64) -> Result<u64, EntryError> {
    match info.base {
        Some(base) if base.0 != end => Err(EntryError::Offset {
            index,
            base: base.0,
            expected: end,
        }),
        _ => Ok(end + info.offsets),
    }
}

/// The bodies of a checked group entry's batches, in order (each one
/// encoded `GroupEntry`).
pub fn group_bodies(data: &Bytes) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let Ok(header) = format::parse_header(&data[at..]) else {
            break;
        };
        if header.kind != BatchKind::Group || header.len as usize > data.len() - at {
            break;
        }
        let batch = data.slice(at..at + header.len as usize);
        out.push(format::batch_body(&batch, &header));
        at += header.len as usize;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_engine::format::{encode_group, encode_records, RecordIn};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    fn entry(term: u64, data: Vec<u8>) -> Entry {
        Entry {
            index: 7,
            term,
            data: data.into(),
            ..Entry::default()
        }
    }

    fn one_record(base: u64, term: u64) -> Vec<u8> {
        let mut data = Vec::new();
        let r = RecordIn {
            payload: Bytes::from_static(b"hello"),
            ..RecordIn::default()
        };
        encode_records(&mut data, Offset(base), term, 0, &[r]);
        data
    }

    #[test]
    fn kinds_and_offsets() {
        let g = inspect(&entry(3, Vec::new())).unwrap();
        assert_eq!(
            (g.kind, g.offsets, g.base),
            (EntryKind::GenerationStart, 1, None)
        );
        let r = inspect(&entry(3, one_record(10, 3))).unwrap();
        assert_eq!(r.kind, EntryKind::Records { count: 1 });
        assert_eq!((r.offsets, r.base), (1, Some(Offset(10))));
        let mut data = Vec::new();
        encode_group(&mut data, Offset(11), 3, 0, b"a");
        encode_group(&mut data, Offset(11), 3, 0, b"b");
        let gr = inspect(&entry(3, data.clone())).unwrap();
        assert_eq!((gr.kind, gr.offsets), (EntryKind::Group, 0));
        let bodies = group_bodies(&Bytes::from(data));
        assert_eq!(
            bodies,
            vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")]
        );
    }

    #[test]
    fn entries_that_break_a_rule_are_refused() {
        // A batch stamped with another term.
        assert!(matches!(
            inspect(&entry(4, one_record(0, 3))),
            Err(EntryError::Term {
                batch: 3,
                entry: 4,
                ..
            })
        ));
        // Trailing bytes after a records batch.
        let mut data = one_record(0, 3);
        data.extend_from_slice(&one_record(1, 3));
        assert!(matches!(
            inspect(&entry(3, data)),
            Err(EntryError::Batch { .. })
        ));
        // A control batch (generation starts are empty entries).
        let mut data = vec![0u8; format::BATCH_HEADER_BYTES];
        let mut out = Vec::with_capacity(data.len());
        out.resize(data.len(), std::mem::MaybeUninit::new(0));
        format::encode_control_into(&mut out, Offset(0), 3, 0, &[]);
        for (d, o) in data.iter_mut().zip(out) {
            // SAFETY: encode_control_into wrote every byte.
            *d = unsafe { o.assume_init() };
        }
        assert!(matches!(
            inspect(&entry(3, data)),
            Err(EntryError::Kind { .. })
        ));
        // Group batches that disagree on their offset.
        let mut data = Vec::new();
        encode_group(&mut data, Offset(1), 3, 0, b"a");
        encode_group(&mut data, Offset(2), 3, 0, b"b");
        assert!(matches!(
            inspect(&entry(3, data)),
            Err(EntryError::Batch { .. })
        ));
        // A flipped bit.
        let mut data = one_record(0, 3);
        let last = data.len() - 1;
        data[last] ^= 1;
        assert!(matches!(
            inspect(&entry(3, data)),
            Err(EntryError::Batch { .. })
        ));
        // Offsets that do not follow the log.
        assert!(matches!(
            follows(7, &inspect(&entry(3, one_record(5, 3))).unwrap(), 4),
            Err(EntryError::Offset {
                base: 5,
                expected: 4,
                ..
            })
        ));
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut rng = SmallRng::seed_from_u64(7);
        let valid = one_record(0, 1);
        for _ in 0..20_000 {
            let mut data = if rng.gen_bool(0.5) {
                valid.clone()
            } else {
                (0..rng.gen_range(0..200)).map(|_| rng.gen()).collect()
            };
            if !data.is_empty() {
                for _ in 0..rng.gen_range(1..4) {
                    let i = rng.gen_range(0..data.len());
                    data[i] = rng.gen();
                }
                data.truncate(rng.gen_range(0..=data.len()));
            }
            let e = entry(1, data.clone());
            let _ = inspect(&e);
            let _ = group_bodies(&Bytes::from(data));
        }
    }
}

//! The replica's copy of the shard's Raft log, as raft-rs reads it.
//!
//! The entries are kept in memory, where raft-rs reads them. What makes
//! them durable is the owner's: a durable [`crate::host::Host`] writes what
//! the replica asks to its [`crate::journal::Journal`] and restores the log
//! from it ([`ReplicaLog::restore`]); the simulation "persists" an entry by
//! keeping the `ReplicaLog` across a crash of its `Replica`.
//!
//! Entries every replica of the shard holds and this one has applied (and
//! whose shard log has them durably) are compacted away
//! ([`ReplicaLog::compact`]): the log then starts after a [`Compacted`]
//! point, which keeps the term and the shard offset of the entry it ends
//! at. No replica ever needs them again (Raft sends a follower the entries
//! after the ones it holds), so snapshots are never asked for; see
//! [`crate::replica::Replica::compact`] for how the point is chosen.

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use crate::entry::{follows, info_of, EntryError};

/// Where a compacted log starts: the last entry compacted away, its term
/// and the shard offset after it. All zeros for a log never compacted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compacted {
    pub index: u64,
    pub term: u64,
    pub end: u64,
}

/// Entries, hard state and voters of one replica of one shard.
#[derive(Clone, Debug)]
pub struct ReplicaLog {
    hard: HardState,
    conf: ConfState,
    /// The entries before `entries[0]`, compacted away.
    base: Compacted,
    /// `entries[i]` has Raft index `base.index + 1 + i`.
    entries: Vec<Entry>,
    /// `ends[i]`: the shard offset after `entries[i]`.
    ends: Vec<u64>,
}

impl ReplicaLog {
    /// An empty log for a shard replicated on `voters` (replica ids, the
    /// same list on every replica).
    pub fn new(voters: &[u64]) -> ReplicaLog {
        ReplicaLog {
            hard: HardState::default(),
            conf: ConfState {
                voters: voters.to_vec(),
                ..ConfState::default()
            },
            base: Compacted::default(),
            entries: Vec::new(),
            ends: Vec::new(),
        }
    }

    /// A log read back from disk: the stored hard state, the compaction
    /// point (if the log was compacted) and the entries the journal kept
    /// (those at or below the point are dropped: a journal keeps whole
    /// segments). Refused when the entries do not start right after the
    /// point, break the offset rule, or when the hard state's commit index
    /// is past the last entry (entries known committed were lost: a
    /// replica must not serve, or vote, on such a log).
    pub fn restore(
        voters: &[u64],
        mut hard: HardState,
        base: Option<Compacted>,
        entries: &[Entry],
    ) -> Result<ReplicaLog, String> {
        let mut log = ReplicaLog::new(voters);
        let base = base.unwrap_or_default();
        log.base = base;
        let entries = match entries.iter().position(|e| e.index > base.index) {
            Some(k) => &entries[k..],
            None => &[],
        };
        if let Some(first) = entries.first() {
            if first.index != base.index + 1 {
                return Err(format!(
                    "the entries kept start at index {}, and the log was compacted to {}",
                    first.index, base.index
                ));
            }
        }
        for (i, e) in entries.iter().enumerate() {
            if e.index != base.index + 1 + i as u64 {
                return Err(format!("entry {} follows entry {}", e.index, e.index - 1));
            }
            crate::entry::inspect(e).map_err(|e| e.to_string())?;
        }
        log.append(entries).map_err(|e| e.to_string())?;
        if hard.commit > log.last() {
            return Err(format!(
                "the hard state says entries up to {} are committed, and the log ends at {}",
                hard.commit,
                log.last()
            ));
        }
        // Only what was committed is compacted, and the commit index is
        // stored with term and vote changes only: it can be older.
        hard.commit = hard.commit.max(base.index);
        log.hard = hard;
        Ok(log)
    }

    /// Index of the last entry (the compaction point's when none follow
    /// it; 0 when empty).
    pub fn last(&self) -> u64 {
        self.base.index + self.entries.len() as u64
    }

    /// Index of the first entry held.
    pub fn first(&self) -> u64 {
        self.base.index + 1
    }

    /// Where the log starts (all zeros if never compacted).
    pub fn compacted(&self) -> Compacted {
        self.base
    }

    /// Entries held in memory.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn slot(&self, index: u64) -> Option<usize> {
        index
            .checked_sub(self.base.index + 1)
            .map(|i| i as usize)
            .filter(|&i| i < self.entries.len())
    }

    /// The entry at `index`, if held.
    pub fn entry(&self, index: u64) -> Option<&Entry> {
        self.slot(index).map(|i| &self.entries[i])
    }

    /// The shard offset after the entry at `index` (0 for index 0), for
    /// the entries held and the compaction point.
    pub fn end_after(&self, index: u64) -> Option<u64> {
        if index == self.base.index {
            return Some(self.base.end);
        }
        self.slot(index).map(|i| self.ends[i])
    }

    /// The shard offset after the last entry.
    pub fn end(&self) -> u64 {
        self.ends.last().copied().unwrap_or(self.base.end)
    }

    pub fn hard_state(&self) -> &HardState {
        &self.hard
    }

    pub fn voters(&self) -> &[u64] {
        &self.conf.voters
    }

    /// Append entries from raft-rs's `Ready`: an entry at an index already
    /// held replaces it and everything after it (Raft only does that to
    /// entries never committed). Each entry is checked to start where the
    /// log before it ends; on an error nothing is appended.
    pub fn append(&mut self, entries: &[Entry]) -> Result<(), EntryError> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        assert!(
            first.index > self.base.index && first.index <= self.last() + 1,
            "append at index {} leaves a gap after {} or rewrites the compacted log (to {})",
            first.index,
            self.last(),
            self.base.index
        );
        let keep = (first.index - self.base.index - 1) as usize;
        let mut end = self.end_after(first.index - 1).expect("index is held");
        let mut ends = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(e.index, first.index + i as u64, "entries are contiguous");
            // Entries reach the log checked (a peer's in `Replica::step`,
            // or built here): the header is enough to hold the offset rule.
            end = follows(e.index, &info_of(e), end)?;
            ends.push(end);
        }
        self.entries.truncate(keep);
        self.ends.truncate(keep);
        self.entries.extend_from_slice(entries);
        self.ends.extend(ends);
        Ok(())
    }

    /// Drop the entries up to `index` (at most the last): the log then
    /// starts after it. Returns the new compaction point, `None` if the log
    /// already started past `index`. The caller guarantees no replica
    /// needs them and that they are applied.
    pub fn compact(&mut self, index: u64) -> Option<Compacted> {
        let index = index.min(self.last());
        if index <= self.base.index {
            return None;
        }
        let base = Compacted {
            index,
            term: self.entry(index).expect("held").term,
            end: self.end_after(index).expect("held"),
        };
        let n = (index - self.base.index) as usize;
        self.entries.drain(..n);
        self.ends.drain(..n);
        // A long log compacted down to a few entries gives the memory back.
        if self.entries.capacity() > 4 * self.entries.len().max(256) {
            self.entries.shrink_to_fit();
            self.ends.shrink_to_fit();
        }
        self.base = base;
        // What is compacted was committed; the stored hard state must say
        // so, or raft-rs refuses it when a log kept across a crash (the
        // simulation's) opens again.
        self.hard.commit = self.hard.commit.max(index);
        Some(base)
    }

    /// Store a hard state. Its commit index is never taken below the
    /// compaction point: a hard state made before a compaction and stored
    /// after it (persistence is asynchronous) would otherwise say less was
    /// committed than the log dropped, which raft-rs refuses on open.
    pub fn set_hard_state(&mut self, mut hard: HardState) {
        hard.commit = hard.commit.max(self.base.index);
        self.hard = hard;
    }

    pub fn set_commit(&mut self, commit: u64) {
        self.hard.commit = commit.max(self.base.index);
    }
}

impl Storage for ReplicaLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState {
            hard_state: self.hard.clone(),
            conf_state: self.conf.clone(),
        })
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.base.index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let from = (low - self.base.index - 1) as usize;
        let to = (high - self.base.index - 1) as usize;
        let mut out = self.entries[from..to].to_vec();
        raft::util::limit_size(&mut out, max_size.into());
        Ok(out)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        if index == self.base.index {
            return Ok(self.base.term);
        }
        if index < self.base.index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.entry(index)
            .map(|e| e.term)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.first())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        // Logs are compacted only below what every replica holds, so this
        // is asked only for a replica that lost its log (its disk was
        // replaced): it cannot rejoin until snapshots exist.
        tracing::warn!(
            replica = to,
            request_index,
            compacted_to = self.base.index,
            "a replica needs entries this log compacted away; it lost its log and cannot \
             catch up (snapshots are not supported yet)"
        );
        Err(raft::Error::Store(
            StorageError::SnapshotTemporarilyUnavailable,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use felix_engine::format::{encode_records, RecordIn};
    use felix_engine::Offset;

    fn records(index: u64, term: u64, base: u64, n: usize) -> Entry {
        let rs: Vec<RecordIn> = (0..n)
            .map(|i| RecordIn {
                payload: Bytes::from(vec![i as u8; 8]),
                ..RecordIn::default()
            })
            .collect();
        let mut data = Vec::new();
        encode_records(&mut data, Offset(base), term, 0, &rs);
        Entry {
            index,
            term,
            data: data.into(),
            ..Entry::default()
        }
    }

    fn generation(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            ..Entry::default()
        }
    }

    #[test]
    fn offsets_follow_the_entries_and_a_generation_start_takes_one() {
        let mut log = ReplicaLog::new(&[1, 2, 3]);
        log.append(&[generation(1, 1), records(2, 1, 1, 3), records(3, 1, 4, 2)])
            .unwrap();
        assert_eq!((log.last(), log.end()), (3, 6));
        assert_eq!(log.end_after(1), Some(1));
        assert_eq!(log.end_after(2), Some(4));
        assert_eq!(log.term(3).unwrap(), 1);
    }

    #[test]
    fn a_newer_leader_replaces_an_uncommitted_suffix() {
        let mut log = ReplicaLog::new(&[1, 2, 3]);
        log.append(&[generation(1, 1), records(2, 1, 1, 3), records(3, 1, 4, 2)])
            .unwrap();
        // Term 2 overwrote index 3 on: its generation start takes offset 4.
        log.append(&[generation(3, 2), records(4, 2, 5, 1)])
            .unwrap();
        assert_eq!((log.last(), log.end()), (4, 6));
        assert_eq!(log.term(3).unwrap(), 2);
    }

    #[test]
    fn an_entry_at_the_wrong_offset_is_refused_and_nothing_is_appended() {
        let mut log = ReplicaLog::new(&[1, 2, 3]);
        log.append(&[generation(1, 1)]).unwrap();
        let err = log
            .append(&[records(2, 1, 1, 2), records(3, 1, 2, 1)])
            .unwrap_err();
        assert!(
            matches!(
                err,
                EntryError::Offset {
                    index: 3,
                    base: 2,
                    expected: 3
                }
            ),
            "{err}"
        );
        assert_eq!((log.last(), log.end()), (1, 1));
    }

    #[test]
    fn storage_answers_ranges_and_refuses_what_it_does_not_hold() {
        let mut log = ReplicaLog::new(&[1]);
        log.append(&[generation(1, 1), records(2, 1, 1, 1), records(3, 1, 2, 1)])
            .unwrap();
        let got = log
            .entries(1, 4, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(got.len(), 3);
        // A size limit still returns at least one entry.
        let one = log
            .entries(2, 4, 1, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(one.len(), 1);
        assert!(log
            .entries(2, 6, None, GetEntriesContext::empty(false))
            .is_err());
        assert!(log.term(9).is_err());
        assert_eq!(log.term(0).unwrap(), 0);
    }

    #[test]
    fn a_compacted_log_answers_from_its_point_and_refuses_below_it() {
        let mut log = ReplicaLog::new(&[1]);
        log.append(&[
            generation(1, 1),
            records(2, 1, 1, 3),
            records(3, 2, 4, 2),
            records(4, 2, 6, 1),
        ])
        .unwrap();
        let base = log.compact(3).unwrap();
        assert_eq!(
            base,
            Compacted {
                index: 3,
                term: 2,
                end: 6
            }
        );
        assert_eq!(log.compact(2), None, "already past it");
        assert_eq!(
            log.hard_state().commit,
            3,
            "what is compacted was committed"
        );
        // A hard state made before the compaction and stored after it
        // (persistence is asynchronous) keeps the commit at the point.
        let mut older = log.hard_state().clone();
        older.commit = 2;
        log.set_hard_state(older);
        assert_eq!(log.hard_state().commit, 3);
        log.set_commit(1);
        assert_eq!(log.hard_state().commit, 3);
        assert_eq!((log.first(), log.last(), log.end()), (4, 4, 7));
        assert_eq!(log.first_index().unwrap(), 4);
        assert_eq!(log.term(3).unwrap(), 2, "the point keeps its term");
        assert!(matches!(
            log.term(2),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        assert!(matches!(
            log.entries(3, 5, None, GetEntriesContext::empty(false)),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        let got = log
            .entries(4, 5, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(got[0].index, 4);
        assert_eq!(log.end_after(3), Some(6));
        assert_eq!(log.end_after(2), None);
        // Appending after the point carries the offsets on.
        log.append(&[records(5, 2, 7, 2)]).unwrap();
        assert_eq!((log.last(), log.end()), (5, 9));
        // Compacted to the very last entry: an empty log that still knows
        // where it ends.
        log.compact(9).unwrap();
        assert_eq!(
            (log.first(), log.last(), log.end(), log.len()),
            (6, 5, 9, 0)
        );
        log.append(&[generation(6, 3)]).unwrap();
        assert_eq!(log.end(), 10);
    }

    #[test]
    fn a_log_restored_after_compaction_starts_after_its_point() {
        let all = [
            generation(1, 1),
            records(2, 1, 1, 3),
            records(3, 1, 4, 2),
            records(4, 1, 6, 1),
        ];
        let base = Compacted {
            index: 2,
            term: 1,
            end: 4,
        };
        // The journal kept a whole segment from entry 1: those up to the
        // point are dropped. The stored commit index can be older than
        // the point (it is stored with votes only): it is raised to it.
        let hard = HardState {
            term: 1,
            commit: 1,
            ..HardState::default()
        };
        let log = ReplicaLog::restore(&[1], hard.clone(), Some(base), &all).unwrap();
        assert_eq!((log.first(), log.last(), log.end()), (3, 4, 7));
        assert_eq!(log.hard_state().commit, 2);
        assert_eq!(log.term(2).unwrap(), 1);
        // Entries that do not reach the point leave a hole: refused.
        let err = ReplicaLog::restore(&[1], hard.clone(), Some(base), &all[3..]).unwrap_err();
        assert!(err.contains("compacted to 2"), "{err}");
        // Nothing after the point (every entry compacted): empty, at it.
        let log = ReplicaLog::restore(&[1], hard, Some(base), &all[..2]).unwrap();
        assert_eq!((log.first(), log.last(), log.end()), (3, 2, 4));
    }
}

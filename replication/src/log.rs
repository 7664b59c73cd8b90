//! The replica's copy of the shard's Raft log, as raft-rs reads it.
//!
//! The entries are kept in memory, where raft-rs reads them. What makes
//! them durable is the owner's: a durable [`crate::host::Host`] writes what
//! the replica asks to its [`crate::journal::Journal`] and restores the log
//! from it ([`ReplicaLog::restore`]); the simulation "persists" an entry by
//! keeping the `ReplicaLog` across a crash of its `Replica`.

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use crate::entry::{follows, info_of, EntryError};

/// Entries, hard state and voters of one replica of one shard.
#[derive(Clone, Debug)]
pub struct ReplicaLog {
    hard: HardState,
    conf: ConfState,
    /// `entries[i]` has Raft index `i + 1` (nothing is compacted yet).
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
            entries: Vec::new(),
            ends: Vec::new(),
        }
    }

    /// A log read back from disk: the stored hard state and the entries
    /// the journal kept, from index 1. Refused when the entries break the
    /// offset rule, or when the hard state's commit index is past the last
    /// entry (entries known committed were lost: a replica must not serve,
    /// or vote, on such a log).
    pub fn restore(
        voters: &[u64],
        hard: HardState,
        entries: &[Entry],
    ) -> Result<ReplicaLog, String> {
        let mut log = ReplicaLog::new(voters);
        if let Some(first) = entries.first() {
            if first.index != 1 {
                return Err(format!(
                    "the entries kept start at index {}, and compacted logs are not supported yet",
                    first.index
                ));
            }
        }
        for (i, e) in entries.iter().enumerate() {
            if e.index != i as u64 + 1 {
                return Err(format!("entry {} follows entry {i}", e.index));
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
        log.hard = hard;
        Ok(log)
    }

    /// Index of the last entry (0 when empty).
    pub fn last(&self) -> u64 {
        self.entries.len() as u64
    }

    /// The entry at `index`, if held.
    pub fn entry(&self, index: u64) -> Option<&Entry> {
        index
            .checked_sub(1)
            .and_then(|i| self.entries.get(i as usize))
    }

    /// The shard offset after the entry at `index` (0 for index 0).
    pub fn end_after(&self, index: u64) -> Option<u64> {
        match index {
            0 => Some(0),
            i => self.ends.get(i as usize - 1).copied(),
        }
    }

    /// The shard offset after the last entry.
    pub fn end(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
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
            first.index >= 1 && first.index <= self.last() + 1,
            "append at index {} leaves a gap after {}",
            first.index,
            self.last()
        );
        let keep = first.index as usize - 1;
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

    pub fn set_hard_state(&mut self, hard: HardState) {
        self.hard = hard;
    }

    pub fn set_commit(&mut self, commit: u64) {
        self.hard.commit = commit;
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
        if low < 1 {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let mut out = self.entries[low as usize - 1..high as usize - 1].to_vec();
        raft::util::limit_size(&mut out, max_size.into());
        Ok(out)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        if index == 0 {
            return Ok(0);
        }
        self.entry(index)
            .map(|e| e.term)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, _request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        // Nothing is compacted, so no follower ever needs one.
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
}

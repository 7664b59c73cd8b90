//! Durable group state and the entries that change it.
//!
//! # Encoding (version 1, little-endian)
//!
//! Every entry:
//!
//! | bytes | field |
//! | --- | --- |
//! | 1 | version = 1 |
//! | 1 | kind: 1 Create, 2 Seek, 3 Delete, 4 Position, 5 DeadLetter, 6 Redrive, 7 Discard, 8 RedriveFinished, 9 Snapshot, 10 SnapshotDeadLetters, 11 Position with *skipped*, 12 Snapshot with *skipped* |
//! | 2 | group name length n, 1..=255 |
//! | n | group name, UTF-8 |
//! | … | body |
//!
//! Bodies:
//!
//! | kind | body |
//! | --- | --- |
//! | Create, Seek | u64 position |
//! | Position | u64 position |
//! | Position with *skipped* | u64 position; u64 *skipped* (> 0) |
//! | Delete | (empty) |
//! | Redrive, Discard, RedriveFinished | u64 offset |
//! | DeadLetter | u64 offset, then *info* |
//! | Snapshot | u64 position; u32 dead-letter count d; d × (u64 offset, *info*) in strictly increasing offset order; u32 redriven count r; r × u64 offset, strictly increasing, none a dead letter (those at or above the position: redriven ahead of the cursor, see [`DurableGroup::redriven_ahead`]; an older broker refuses a snapshot with any) |
//! | Snapshot with *skipped* | as Snapshot, then u64 *skipped* (> 0) |
//! | SnapshotDeadLetters | u32 dead-letter count d; d × (u64 offset, *info*) in strictly increasing offset order: more of the `Snapshot` that follows (a long list is split, [`SNAPSHOT_DEAD_LETTERS`] a piece, so no entry nears the batch size limit). The pieces come first and the `Snapshot` last, so a snapshot a crash cut short is ignored whole on replay |
//!
//! *skipped*: how many offsets directly below the position were settled
//! without being delivered (retention, control records): the
//! `skipped_before` of the record at the position, so that a restart that
//! hands it out again still says so. Kinds 11 and 12 are written only when
//! it is not 0, so a log without skips reads as it always did; an older
//! broker refuses a log that has them.
//!
//! *info*: u32 attempts, u64 at_ms, u8 flags (bit 0 by_consumer, bit 1 reason
//! present, bit 2 discarded — in a snapshot only: a dead letter discarded at
//! or above the position, still finished; other bits zero), then if a reason is present u16 length (at most
//! [`REASON_MAX_BYTES`]) and that many bytes of UTF-8.
//!
//! Decoding never panics, allocates at most in proportion to the input, and
//! refuses trailing bytes, so every accepted input re-encodes to itself.

use std::collections::{BTreeMap, BTreeSet};

use crate::types::Offset;

/// The encoding version this build writes and reads.
pub const ENTRY_VERSION: u8 = 1;
/// Longest dead-letter reason kept, in bytes; longer ones are cut.
pub const REASON_MAX_BYTES: usize = 1024;

/// Reason bytes one group keeps across all its dead letters. Past it, new
/// dead letters are kept without their reason: the group's state goes into
/// every new segment as one snapshot batch, and into one `GroupDeadLetters`
/// answer, and both must stay far below their size limits however many
/// records a group gives up on.
pub const REASON_BUDGET_BYTES: usize = 16 << 20;
/// Longest group name an entry can carry.
pub const GROUP_NAME_MAX_BYTES: usize = 255;

const KIND_CREATE: u8 = 1;
const KIND_SEEK: u8 = 2;
const KIND_DELETE: u8 = 3;
const KIND_POSITION: u8 = 4;
const KIND_DEAD_LETTER: u8 = 5;
const KIND_REDRIVE: u8 = 6;
const KIND_DISCARD: u8 = 7;
const KIND_REDRIVE_FINISHED: u8 = 8;
const KIND_SNAPSHOT: u8 = 9;
const KIND_SNAPSHOT_DEAD_LETTERS: u8 = 10;
const KIND_POSITION_SKIPPED: u8 = 11;
const KIND_SNAPSHOT_SKIPPED: u8 = 12;

/// Dead letters one snapshot entry carries at most; the rest follow in
/// `SnapshotDeadLetters` entries of as many. About 21 bytes each without a
/// reason, plus at most the group's 16 MiB of reasons in all: a few tens of
/// MiB an entry, far below the 1 GiB batch limit whatever the list's length.
pub const SNAPSHOT_DEAD_LETTERS: usize = 1 << 20;

const FLAG_BY_CONSUMER: u8 = 1;
const FLAG_REASON: u8 = 2;
const FLAG_DISCARDED: u8 = 4;
/// Smallest encoded *info*: attempts, at_ms, flags.
const INFO_MIN_BYTES: usize = 4 + 8 + 1;

/// A record the group gave up on. The record stays in the log at its offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// Deliveries it had when it was given up on.
    pub attempts: u32,
    /// When (the tracker's `now_ms`).
    pub at_ms: u64,
    /// The consumer's reason, if it gave one (cut to [`REASON_MAX_BYTES`]).
    pub reason: Option<String>,
    /// Set by a consumer's `dead_letter` rather than the attempt bound.
    pub by_consumer: bool,
    /// Discarded while at or above the group's position: no longer listed,
    /// but still finished, so the group does not deliver it again once it
    /// reaches it (dropped when the position passes it).
    pub discarded: bool,
}

impl DeadLetter {
    fn reason_len(&self) -> usize {
        self.reason.as_ref().map_or(0, String::len)
    }
}

/// The durable part of a group: what its entries in the log rebuild.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DurableGroup {
    position: Offset,
    /// Offsets directly below the position settled without delivery (see
    /// *skipped* above).
    position_skipped: u64,
    dead_letters: BTreeMap<Offset, DeadLetter>,
    /// The offsets of `dead_letters` discarded (no longer listed), kept as
    /// they change: a describe counts the listed ones, and a position that
    /// moves drops the discarded ones it passes, without walking the whole
    /// list (which has no bound: a poison queue can hold millions).
    discarded: BTreeSet<Offset>,
    /// Sum of the reasons' lengths in `dead_letters`.
    reason_bytes: usize,
    /// Redriven offsets below the position: owed again until finished.
    redriven: BTreeSet<Offset>,
    /// Redriven offsets at or above the position, not finished yet. Owed
    /// anyway (the cursor has not passed them); kept so that a seek
    /// forward past them leaves them owed, below the new position, as a
    /// redrive stays owed until it is finished.
    redriven_ahead: BTreeSet<Offset>,
}

impl DurableGroup {
    pub fn new(position: Offset) -> DurableGroup {
        DurableGroup {
            position,
            ..DurableGroup::default()
        }
    }

    /// Build from parts, checking that no redriven offset is also a dead
    /// letter (those at or above the position are redriven ahead of it).
    pub fn from_parts(
        position: Offset,
        dead_letters: BTreeMap<Offset, DeadLetter>,
        mut redriven: BTreeSet<Offset>,
    ) -> Result<DurableGroup, GroupEntryError> {
        let redriven_ahead = redriven.split_off(&position);
        if redriven
            .iter()
            .chain(&redriven_ahead)
            .any(|r| dead_letters.contains_key(r))
        {
            return Err(GroupEntryError::Malformed(
                "an offset is both redriven and a dead letter",
            ));
        }
        let reason_bytes = dead_letters.values().map(DeadLetter::reason_len).sum();
        Ok(DurableGroup {
            position,
            position_skipped: 0,
            discarded: discarded_in(&dead_letters),
            dead_letters,
            reason_bytes,
            redriven,
            redriven_ahead,
        })
    }

    /// The cursor: everything below it is finished, except `redriven`.
    pub fn position(&self) -> Offset {
        self.position
    }

    /// How many offsets directly below the position were settled without
    /// being delivered, as the last entry that moved it said.
    pub fn position_skipped(&self) -> u64 {
        self.position_skipped
    }

    /// Every offset given up on and not yet passed by a discard below the
    /// position: these are finished. Includes discarded ones (see
    /// [`DeadLetter::discarded`]); [`listed_dead_letters`] leaves them out.
    ///
    /// [`listed_dead_letters`]: DurableGroup::listed_dead_letters
    pub fn dead_letters(&self) -> &BTreeMap<Offset, DeadLetter> {
        &self.dead_letters
    }

    /// The dead letters the group lists (not discarded).
    pub fn listed_dead_letters(&self) -> impl Iterator<Item = (&Offset, &DeadLetter)> {
        self.dead_letters.iter().filter(|(_, d)| !d.discarded)
    }

    /// How many dead letters the group lists.
    pub fn listed_count(&self) -> usize {
        debug_assert_eq!(self.discarded, discarded_in(&self.dead_letters));
        self.dead_letters.len() - self.discarded.len()
    }

    /// The listed dead letters at `from` and above, in offset order.
    pub fn listed_dead_letters_from(
        &self,
        from: Offset,
    ) -> impl Iterator<Item = (&Offset, &DeadLetter)> {
        self.dead_letters
            .range(from..)
            .filter(|(_, d)| !d.discarded)
    }

    pub fn redriven(&self) -> &BTreeSet<Offset> {
        &self.redriven
    }

    /// Redriven offsets at or above the position, not finished yet.
    pub fn redriven_ahead(&self) -> &BTreeSet<Offset> {
        &self.redriven_ahead
    }

    /// The cursor moves to `position` by a seek: every redriven offset not
    /// finished stays owed, below it or ahead of it.
    fn seek_to(&mut self, position: Offset) {
        let mut all = std::mem::take(&mut self.redriven);
        all.append(&mut self.redriven_ahead);
        self.redriven_ahead = all.split_off(&position);
        self.redriven = all;
        self.position = position;
        self.position_skipped = 0;
        self.forget_discarded_below(position);
    }

    fn forget_discarded_below(&mut self, position: Offset) {
        while let Some(&o) = self.discarded.first() {
            if o >= position {
                break;
            }
            self.discarded.pop_first();
            if let Some(d) = self.dead_letters.remove(&o) {
                self.reason_bytes -= d.reason_len();
            }
        }
    }

    /// Bytes of reasons kept (see [`REASON_BUDGET_BYTES`]).
    pub fn reason_bytes(&self) -> usize {
        self.reason_bytes
    }

    /// The entries that write this state whole: `SnapshotDeadLetters` of
    /// `piece` dead letters each for all but the first `piece`, then the
    /// `Snapshot` with those and everything else. Replayed in order (pieces
    /// staged until their `Snapshot`, see [`with_pieces`](Self::with_pieces))
    /// they rebuild exactly this state; a crash that keeps only some of
    /// them leaves no `Snapshot`, and the state before it stands.
    pub fn snapshot(&self, group: &str, piece: usize) -> Vec<GroupEntry> {
        let piece = piece.max(1);
        let mut letters = self.dead_letters.iter();
        let first: BTreeMap<Offset, DeadLetter> = letters
            .by_ref()
            .take(piece)
            .map(|(o, d)| (*o, d.clone()))
            .collect();
        let head = DurableGroup {
            position: self.position,
            position_skipped: self.position_skipped,
            reason_bytes: first.values().map(DeadLetter::reason_len).sum(),
            discarded: discarded_in(&first),
            dead_letters: first,
            redriven: self.redriven.clone(),
            redriven_ahead: self.redriven_ahead.clone(),
        };
        let mut out = Vec::new();
        loop {
            let more: Vec<(Offset, DeadLetter)> = letters
                .by_ref()
                .take(piece)
                .map(|(o, d)| (*o, d.clone()))
                .collect();
            if more.is_empty() {
                break;
            }
            out.push(GroupEntry::SnapshotDeadLetters {
                group: group.to_string(),
                letters: more,
            });
        }
        out.push(GroupEntry::Snapshot {
            group: group.to_string(),
            state: head,
        });
        out
    }

    /// A `Snapshot`'s state with the `SnapshotDeadLetters` pieces staged
    /// before it.
    pub(crate) fn with_pieces(&self, pieces: Vec<(Offset, DeadLetter)>) -> DurableGroup {
        let mut g = self.clone();
        for (offset, info) in pieces {
            // As the snapshot itself holds them: never also redriven.
            g.redriven.remove(&offset);
            g.redriven_ahead.remove(&offset);
            g.insert_dead_letter(offset, info);
        }
        g
    }

    fn insert_dead_letter(&mut self, offset: Offset, info: DeadLetter) {
        self.reason_bytes += info.reason_len();
        if info.discarded {
            self.discarded.insert(offset);
        } else {
            self.discarded.remove(&offset);
        }
        if let Some(old) = self.dead_letters.insert(offset, info) {
            self.reason_bytes -= old.reason_len();
        }
    }

    fn remove_dead_letter(&mut self, offset: &Offset) -> Option<DeadLetter> {
        let old = self.dead_letters.remove(offset)?;
        self.reason_bytes -= old.reason_len();
        self.discarded.remove(offset);
        Some(old)
    }

    /// Mark a dead letter above the position discarded (kept finished, no
    /// longer listed).
    fn discard_dead_letter(&mut self, offset: &Offset) {
        if let Some(d) = self.dead_letters.get_mut(offset) {
            if !d.discarded {
                d.discarded = true;
                self.discarded.insert(*offset);
            }
        }
    }
}

fn discarded_in(letters: &BTreeMap<Offset, DeadLetter>) -> BTreeSet<Offset> {
    letters
        .iter()
        .filter(|(_, d)| d.discarded)
        .map(|(o, _)| *o)
        .collect()
}

/// A change to durable group state, appended to the shard's log (taking no
/// stream offset). See the module docs for the byte layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupEntry {
    /// The group comes into being at `position` (no-op if it exists).
    Create { group: String, position: Offset },
    /// The group moves to `position`, backwards or forwards; redriven
    /// offsets not finished stay owed wherever they fall.
    Seek { group: String, position: Offset },
    /// The group, its position and dead letters are gone.
    Delete { group: String },
    /// The cursor advanced to `position`; the `skipped` offsets directly
    /// below it were settled without being delivered.
    Position {
        group: String,
        position: Offset,
        skipped: u64,
    },
    /// `offset` is a dead letter (and, if it was redriven, no longer owed).
    DeadLetter {
        group: String,
        offset: Offset,
        info: DeadLetter,
    },
    /// The dead letter at `offset` is owed again (tracked as redriven, below
    /// the position or ahead of it).
    Redrive { group: String, offset: Offset },
    /// The dead letter at `offset` is no longer tracked.
    Discard { group: String, offset: Offset },
    /// The redriven `offset` was finished.
    RedriveFinished { group: String, offset: Offset },
    /// The whole durable state, written at the start of each log segment
    /// (for a long dead-letter list, after `SnapshotDeadLetters` pieces that
    /// hold all but its first [`SNAPSHOT_DEAD_LETTERS`]).
    Snapshot { group: String, state: DurableGroup },
    /// More dead letters of the `Snapshot` that follows.
    SnapshotDeadLetters {
        group: String,
        letters: Vec<(Offset, DeadLetter)>,
    },
}

/// Why bytes did not decode as a [`GroupEntry`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupEntryError {
    #[error("group entry is truncated at byte {at}")]
    Truncated { at: usize },
    #[error("group entry version {0} is not supported (this build reads version {ENTRY_VERSION})")]
    Version(u8),
    #[error("unknown group entry kind {0}")]
    Kind(u8),
    #[error("group entry has {0} trailing bytes")]
    Trailing(usize),
    #[error("group entry is malformed: {0}")]
    Malformed(&'static str),
}

impl GroupEntry {
    /// The group this entry belongs to.
    pub fn group(&self) -> &str {
        match self {
            GroupEntry::Create { group, .. }
            | GroupEntry::Seek { group, .. }
            | GroupEntry::Delete { group }
            | GroupEntry::Position { group, .. }
            | GroupEntry::DeadLetter { group, .. }
            | GroupEntry::Redrive { group, .. }
            | GroupEntry::Discard { group, .. }
            | GroupEntry::RedriveFinished { group, .. }
            | GroupEntry::Snapshot { group, .. }
            | GroupEntry::SnapshotDeadLetters { group, .. } => group,
        }
    }

    /// Append the encoding to `out`.
    ///
    /// Panics if the group name is empty or longer than
    /// [`GROUP_NAME_MAX_BYTES`], or a reason is longer than
    /// [`REASON_MAX_BYTES`]: the tracker never builds such entries.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let group = self.group();
        assert!(
            !group.is_empty() && group.len() <= GROUP_NAME_MAX_BYTES,
            "group name of {} bytes cannot be encoded",
            group.len()
        );
        out.push(ENTRY_VERSION);
        out.push(self.kind());
        out.extend_from_slice(&(group.len() as u16).to_le_bytes());
        out.extend_from_slice(group.as_bytes());
        match self {
            GroupEntry::Create { position, .. } | GroupEntry::Seek { position, .. } => {
                put_u64(out, position.0)
            }
            GroupEntry::Position {
                position, skipped, ..
            } => {
                put_u64(out, position.0);
                put_skipped(out, *skipped);
            }
            GroupEntry::Delete { .. } => {}
            GroupEntry::Redrive { offset, .. }
            | GroupEntry::Discard { offset, .. }
            | GroupEntry::RedriveFinished { offset, .. } => put_u64(out, offset.0),
            GroupEntry::DeadLetter { offset, info, .. } => {
                put_u64(out, offset.0);
                put_info(out, info);
            }
            GroupEntry::Snapshot { state, .. } => {
                put_u64(out, state.position.0);
                let dead = u32::try_from(state.dead_letters.len()).expect("dead letters fit u32");
                out.extend_from_slice(&dead.to_le_bytes());
                for (offset, info) in &state.dead_letters {
                    put_u64(out, offset.0);
                    put_info(out, info);
                }
                // Below the position, then ahead of it: one increasing list.
                let redriven = u32::try_from(state.redriven.len() + state.redriven_ahead.len())
                    .expect("redriven fit u32");
                out.extend_from_slice(&redriven.to_le_bytes());
                for offset in state.redriven.iter().chain(&state.redriven_ahead) {
                    put_u64(out, offset.0);
                }
                put_skipped(out, state.position_skipped);
            }
            GroupEntry::SnapshotDeadLetters { letters, .. } => {
                let n = u32::try_from(letters.len()).expect("dead letters fit u32");
                out.extend_from_slice(&n.to_le_bytes());
                for (offset, info) in letters {
                    put_u64(out, offset.0);
                    put_info(out, info);
                }
            }
        }
    }

    /// The encoding as a new buffer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decode one entry occupying all of `bytes`. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<GroupEntry, GroupEntryError> {
        let mut r = Reader { bytes, at: 0 };
        let version = r.u8()?;
        if version != ENTRY_VERSION {
            return Err(GroupEntryError::Version(version));
        }
        let kind = r.u8()?;
        let name_len = r.u16()? as usize;
        if name_len == 0 || name_len > GROUP_NAME_MAX_BYTES {
            return Err(GroupEntryError::Malformed("group name length out of range"));
        }
        let group = r.string(name_len)?;
        let entry = match kind {
            KIND_CREATE => GroupEntry::Create {
                group,
                position: Offset(r.u64()?),
            },
            KIND_SEEK => GroupEntry::Seek {
                group,
                position: Offset(r.u64()?),
            },
            KIND_DELETE => GroupEntry::Delete { group },
            KIND_POSITION | KIND_POSITION_SKIPPED => {
                let position = r.u64()?;
                let skipped = if kind == KIND_POSITION_SKIPPED {
                    r.skipped(position)?
                } else {
                    0
                };
                GroupEntry::Position {
                    group,
                    position: Offset(position),
                    skipped,
                }
            }
            KIND_DEAD_LETTER => {
                let offset = Offset(r.u64()?);
                let info = r.info()?;
                GroupEntry::DeadLetter {
                    group,
                    offset,
                    info,
                }
            }
            KIND_REDRIVE => GroupEntry::Redrive {
                group,
                offset: Offset(r.u64()?),
            },
            KIND_DISCARD => GroupEntry::Discard {
                group,
                offset: Offset(r.u64()?),
            },
            KIND_REDRIVE_FINISHED => GroupEntry::RedriveFinished {
                group,
                offset: Offset(r.u64()?),
            },
            KIND_SNAPSHOT_DEAD_LETTERS => GroupEntry::SnapshotDeadLetters {
                group,
                letters: r.dead_letters()?.into_iter().collect(),
            },
            KIND_SNAPSHOT | KIND_SNAPSHOT_SKIPPED => {
                let position = Offset(r.u64()?);
                let dead_letters = r.dead_letters()?;
                let count = r.u32()? as usize;
                if count > r.remaining() / 8 {
                    return Err(GroupEntryError::Truncated { at: r.at });
                }
                let mut redriven = BTreeSet::new();
                let mut last: Option<Offset> = None;
                for _ in 0..count {
                    let offset = Offset(r.u64()?);
                    if last.is_some_and(|l| offset <= l) {
                        return Err(GroupEntryError::Malformed(
                            "snapshot redriven offsets are not in increasing order",
                        ));
                    }
                    last = Some(offset);
                    redriven.insert(offset);
                }
                let mut state = DurableGroup::from_parts(position, dead_letters, redriven)?;
                if kind == KIND_SNAPSHOT_SKIPPED {
                    state.position_skipped = r.skipped(position.0)?;
                }
                GroupEntry::Snapshot { group, state }
            }
            other => return Err(GroupEntryError::Kind(other)),
        };
        if r.remaining() != 0 {
            return Err(GroupEntryError::Trailing(r.remaining()));
        }
        Ok(entry)
    }

    fn kind(&self) -> u8 {
        match self {
            GroupEntry::Create { .. } => KIND_CREATE,
            GroupEntry::Seek { .. } => KIND_SEEK,
            GroupEntry::Delete { .. } => KIND_DELETE,
            GroupEntry::Position { skipped: 0, .. } => KIND_POSITION,
            GroupEntry::Position { .. } => KIND_POSITION_SKIPPED,
            GroupEntry::DeadLetter { .. } => KIND_DEAD_LETTER,
            GroupEntry::Redrive { .. } => KIND_REDRIVE,
            GroupEntry::Discard { .. } => KIND_DISCARD,
            GroupEntry::RedriveFinished { .. } => KIND_REDRIVE_FINISHED,
            GroupEntry::Snapshot { state, .. } if state.position_skipped == 0 => KIND_SNAPSHOT,
            GroupEntry::Snapshot { .. } => KIND_SNAPSHOT_SKIPPED,
            GroupEntry::SnapshotDeadLetters { .. } => KIND_SNAPSHOT_DEAD_LETTERS,
        }
    }
}

/// Apply one entry to a group's durable state (`None`: the group does not
/// exist). Entries for a group that does not exist, other than `Create`,
/// `Seek` and `Snapshot`, change nothing.
pub(crate) fn apply(state: &mut Option<DurableGroup>, entry: &GroupEntry) {
    match entry {
        GroupEntry::Create { position, .. } => {
            if state.is_none() {
                *state = Some(DurableGroup::new(*position));
            }
        }
        GroupEntry::Seek { position, .. } => {
            state
                .get_or_insert_with(|| DurableGroup::new(*position))
                .seek_to(*position);
        }
        GroupEntry::Delete { .. } => *state = None,
        GroupEntry::Snapshot { state: s, .. } => *state = Some(s.clone()),
        // Staged by the replaying tracker until the `Snapshot` after them
        // (see `GroupTracker::apply_entry`); alone they change nothing.
        GroupEntry::SnapshotDeadLetters { .. } => {}
        GroupEntry::Position {
            position, skipped, ..
        } => {
            if let Some(g) = state {
                g.position = *position;
                g.position_skipped = *skipped;
                g.redriven.retain(|&r| r < *position);
                // The cursor passed these: finished.
                g.redriven_ahead.retain(|&r| r >= *position);
                g.forget_discarded_below(*position);
            }
        }
        GroupEntry::DeadLetter { offset, info, .. } => {
            if let Some(g) = state {
                g.redriven.remove(offset);
                g.redriven_ahead.remove(offset);
                g.insert_dead_letter(*offset, info.clone());
            }
        }
        GroupEntry::Redrive { offset, .. } => {
            if let Some(g) = state {
                if g.remove_dead_letter(offset).is_some() {
                    if *offset < g.position {
                        g.redriven.insert(*offset);
                    } else {
                        g.redriven_ahead.insert(*offset);
                    }
                }
            }
        }
        GroupEntry::Discard { offset, .. } => {
            if let Some(g) = state {
                if *offset < g.position {
                    g.remove_dead_letter(offset);
                } else {
                    // Above a cursor held back by an earlier offset: keep it
                    // finished until the position passes it.
                    g.discard_dead_letter(offset);
                }
            }
        }
        GroupEntry::RedriveFinished { offset, .. } => {
            if let Some(g) = state {
                g.redriven.remove(offset);
                g.redriven_ahead.remove(offset);
            }
        }
    }
}

/// Cut a reason to [`REASON_MAX_BYTES`] on a character boundary.
pub(crate) fn cut_reason(reason: Option<&str>) -> Option<String> {
    let reason = reason?;
    let mut end = reason.len().min(REASON_MAX_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    Some(reason[..end].to_string())
}

/// The *skipped* count, written only by the kinds that carry one (it is not
/// 0): entries without skips keep the kinds and encoding they always had.
fn put_skipped(out: &mut Vec<u8>, skipped: u64) {
    if skipped > 0 {
        put_u64(out, skipped);
    }
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_info(out: &mut Vec<u8>, info: &DeadLetter) {
    out.extend_from_slice(&info.attempts.to_le_bytes());
    put_u64(out, info.at_ms);
    let mut flags = 0;
    if info.by_consumer {
        flags |= FLAG_BY_CONSUMER;
    }
    if info.reason.is_some() {
        flags |= FLAG_REASON;
    }
    if info.discarded {
        flags |= FLAG_DISCARDED;
    }
    out.push(flags);
    if let Some(reason) = &info.reason {
        assert!(
            reason.len() <= REASON_MAX_BYTES,
            "dead-letter reason of {} bytes cannot be encoded",
            reason.len()
        );
        out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
        out.extend_from_slice(reason.as_bytes());
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], GroupEntryError> {
        if n > self.remaining() {
            return Err(GroupEntryError::Truncated { at: self.at });
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, GroupEntryError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, GroupEntryError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, GroupEntryError> {
        let mut a = [0; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    /// The *skipped* count of the kinds that carry one; never 0 (a count of
    /// 0 is written as the kind without it, so it would not encode back to
    /// itself) and never more than the offsets below the position.
    fn skipped(&mut self, position: u64) -> Result<u64, GroupEntryError> {
        match self.u64()? {
            0 => Err(GroupEntryError::Malformed(
                "a skipped count of 0 is written as none",
            )),
            n if n > position => Err(GroupEntryError::Malformed(
                "more offsets skipped than lie below the position",
            )),
            n => Ok(n),
        }
    }

    fn u64(&mut self) -> Result<u64, GroupEntryError> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self, n: usize) -> Result<String, GroupEntryError> {
        let b = self.take(n)?;
        std::str::from_utf8(b)
            .map(str::to_string)
            .map_err(|_| GroupEntryError::Malformed("text is not UTF-8"))
    }

    /// A count, then that many (offset, info) in strictly increasing
    /// offset order.
    fn dead_letters(&mut self) -> Result<BTreeMap<Offset, DeadLetter>, GroupEntryError> {
        let dead = self.u32()? as usize;
        if dead > self.remaining() / (8 + INFO_MIN_BYTES) {
            return Err(GroupEntryError::Truncated { at: self.at });
        }
        let mut dead_letters = BTreeMap::new();
        let mut last: Option<Offset> = None;
        for _ in 0..dead {
            let offset = Offset(self.u64()?);
            if last.is_some_and(|l| offset <= l) {
                return Err(GroupEntryError::Malformed(
                    "snapshot dead letters are not in increasing order",
                ));
            }
            last = Some(offset);
            dead_letters.insert(offset, self.info()?);
        }
        Ok(dead_letters)
    }

    fn info(&mut self) -> Result<DeadLetter, GroupEntryError> {
        let attempts = self.u32()?;
        let at_ms = self.u64()?;
        let flags = self.u8()?;
        if flags & !(FLAG_BY_CONSUMER | FLAG_REASON | FLAG_DISCARDED) != 0 {
            return Err(GroupEntryError::Malformed("unknown dead-letter flags"));
        }
        let reason = if flags & FLAG_REASON != 0 {
            let len = self.u16()? as usize;
            if len > REASON_MAX_BYTES {
                return Err(GroupEntryError::Malformed("dead-letter reason too long"));
            }
            Some(self.string(len)?)
        } else {
            None
        };
        Ok(DeadLetter {
            attempts,
            at_ms,
            reason,
            by_consumer: flags & FLAG_BY_CONSUMER != 0,
            discarded: flags & FLAG_DISCARDED != 0,
        })
    }
}

#[cfg(test)]
mod codec_tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_info() -> impl Strategy<Value = DeadLetter> {
        (
            any::<u32>(),
            any::<u64>(),
            proptest::option::of("\\PC{0,40}"),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(
                |(attempts, at_ms, reason, by_consumer, discarded)| DeadLetter {
                    attempts,
                    at_ms,
                    reason,
                    by_consumer,
                    discarded,
                },
            )
    }

    fn arb_state() -> impl Strategy<Value = DurableGroup> {
        (
            any::<u64>(),
            proptest::collection::btree_map(any::<u64>(), arb_info(), 0..8),
            proptest::collection::btree_set(any::<u64>(), 0..8),
            any::<u64>(),
            any::<bool>(),
        )
            .prop_map(|(position, dead, redriven, skipped, with_skips)| {
                let dead_letters: BTreeMap<Offset, DeadLetter> =
                    dead.into_iter().map(|(o, i)| (Offset(o), i)).collect();
                let redriven = redriven
                    .into_iter()
                    .map(Offset)
                    .filter(|r| *r < Offset(position) && !dead_letters.contains_key(r))
                    .collect();
                let mut g =
                    DurableGroup::from_parts(Offset(position), dead_letters, redriven).unwrap();
                if with_skips && position > 0 {
                    g.position_skipped = 1 + skipped % position;
                }
                g
            })
    }

    fn arb_entry() -> impl Strategy<Value = GroupEntry> {
        let group = "[a-zA-Z0-9._-]{1,128}";
        prop_oneof![
            (group, any::<u64>()).prop_map(|(group, p)| GroupEntry::Create {
                group,
                position: Offset(p)
            }),
            (group, any::<u64>()).prop_map(|(group, p)| GroupEntry::Seek {
                group,
                position: Offset(p)
            }),
            group.prop_map(|group| GroupEntry::Delete { group }),
            (group, any::<u64>(), any::<u64>(), any::<bool>()).prop_map(
                |(group, p, skipped, with_skips)| GroupEntry::Position {
                    group,
                    position: Offset(p),
                    skipped: if with_skips && p > 0 {
                        1 + skipped % p
                    } else {
                        0
                    },
                }
            ),
            (group, any::<u64>(), arb_info()).prop_map(|(group, o, info)| {
                GroupEntry::DeadLetter {
                    group,
                    offset: Offset(o),
                    info,
                }
            }),
            (group, any::<u64>()).prop_map(|(group, o)| GroupEntry::Redrive {
                group,
                offset: Offset(o)
            }),
            (group, any::<u64>()).prop_map(|(group, o)| GroupEntry::Discard {
                group,
                offset: Offset(o)
            }),
            (group, any::<u64>()).prop_map(|(group, o)| GroupEntry::RedriveFinished {
                group,
                offset: Offset(o)
            }),
            (group, arb_state()).prop_map(|(group, state)| GroupEntry::Snapshot { group, state }),
            (
                group,
                proptest::collection::btree_map(any::<u64>(), arb_info(), 0..8)
            )
                .prop_map(|(group, dead)| GroupEntry::SnapshotDeadLetters {
                    group,
                    letters: dead.into_iter().map(|(o, i)| (Offset(o), i)).collect(),
                }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn group_entries_round_trip(entry in arb_entry()) {
            let bytes = entry.to_bytes();
            prop_assert_eq!(GroupEntry::decode(&bytes), Ok(entry.clone()));
            // Every strict prefix is refused, never misread.
            for cut in 0..bytes.len() {
                prop_assert!(GroupEntry::decode(&bytes[..cut]).is_err());
            }
            let mut longer = bytes.clone();
            longer.push(0);
            prop_assert_eq!(GroupEntry::decode(&longer), Err(GroupEntryError::Trailing(1)));
        }

        #[test]
        fn a_snapshot_split_into_pieces_rebuilds_the_state(state in arb_state(), piece in 1usize..5) {
            let entries = state.snapshot("g", piece);
            let letters = state.dead_letters().len();
            prop_assert_eq!(entries.len(), 1 + letters.saturating_sub(1) / piece);
            // Replayed as the tracker does: pieces staged until the head.
            let mut staged = Vec::new();
            let mut rebuilt = None;
            for e in &entries {
                match GroupEntry::decode(&e.to_bytes()).unwrap() {
                    GroupEntry::SnapshotDeadLetters { letters, .. } => staged.extend(letters),
                    GroupEntry::Snapshot { state, .. } => {
                        rebuilt = Some(state.with_pieces(std::mem::take(&mut staged)));
                    }
                    other => panic!("{other:?}"),
                }
            }
            let last_is_head = matches!(entries.last(), Some(GroupEntry::Snapshot { .. }));
            prop_assert!(last_is_head, "the Snapshot closes the pieces");
            let rebuilt = rebuilt.unwrap();
            prop_assert_eq!(rebuilt.reason_bytes(), state.reason_bytes());
            prop_assert_eq!(rebuilt, state);
        }

        #[test]
        fn group_entry_decode_never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(entry) = GroupEntry::decode(&bytes) {
                // Whatever decodes is canonical: it re-encodes to the same bytes.
                prop_assert_eq!(entry.to_bytes(), bytes);
            }
        }

        #[test]
        fn group_entry_decode_survives_mutations(entry in arb_entry(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
            let mut bytes = entry.to_bytes();
            for (at, v) in flips {
                let i = at % bytes.len();
                bytes[i] = v;
            }
            if let Ok(decoded) = GroupEntry::decode(&bytes) {
                prop_assert_eq!(decoded.to_bytes(), bytes);
            }
        }
    }

    #[test]
    fn group_entry_with_a_huge_count_is_refused_without_allocating() {
        let mut bytes = vec![ENTRY_VERSION, KIND_SNAPSHOT, 1, 0, b'g'];
        bytes.extend_from_slice(&5u64.to_le_bytes());
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            GroupEntry::decode(&bytes),
            Err(GroupEntryError::Truncated { .. })
        ));
    }

    #[test]
    fn a_position_or_snapshot_keeps_its_skips_in_their_own_kinds() {
        let plain = GroupEntry::Position {
            group: "g".into(),
            position: Offset(9),
            skipped: 0,
        };
        let skips = GroupEntry::Position {
            group: "g".into(),
            position: Offset(9),
            skipped: 4,
        };
        // Without skips, the bytes entries always had.
        assert_eq!(plain.to_bytes()[1], KIND_POSITION);
        assert_eq!(plain.to_bytes().len(), 4 + 1 + 8);
        assert_eq!(skips.to_bytes()[1], KIND_POSITION_SKIPPED);
        assert_eq!(GroupEntry::decode(&skips.to_bytes()), Ok(skips.clone()));
        // A skip count of 0 in the kind that carries one is refused: it
        // would not encode back to itself.
        let mut zero = plain.to_bytes();
        zero[1] = KIND_POSITION_SKIPPED;
        zero.extend_from_slice(&0u64.to_le_bytes());
        assert!(matches!(
            GroupEntry::decode(&zero),
            Err(GroupEntryError::Malformed(_))
        ));
        // A snapshot carries it too, so retention cannot lose it.
        let mut g = Some(DurableGroup::new(Offset(0)));
        apply(&mut g, &skips);
        let state = g.unwrap();
        assert_eq!(state.position_skipped(), 4);
        let snap = state.snapshot("g", 8);
        assert_eq!(snap.len(), 1);
        assert_eq!(snap[0].to_bytes()[1], KIND_SNAPSHOT_SKIPPED);
        let mut replayed = None;
        apply(
            &mut replayed,
            &GroupEntry::decode(&snap[0].to_bytes()).unwrap(),
        );
        assert_eq!(replayed.unwrap().position_skipped(), 4);
    }

    /// A dead letter the broker set aside at its fifth attempt.
    fn given_up() -> DeadLetter {
        DeadLetter {
            attempts: 5,
            at_ms: 1,
            reason: None,
            by_consumer: false,
            discarded: false,
        }
    }

    /// A snapshot keeps redriven offsets on both sides of the position
    /// (one list), and refuses one that is also a dead letter.
    #[test]
    fn group_entry_snapshot_keeps_redriven_offsets_ahead_of_the_position() {
        let state = DurableGroup::from_parts(
            Offset(3),
            BTreeMap::new(),
            [Offset(1), Offset(3), Offset(7)].into_iter().collect(),
        )
        .unwrap();
        assert_eq!(state.redriven(), &[Offset(1)].into_iter().collect());
        assert_eq!(
            state.redriven_ahead(),
            &[Offset(3), Offset(7)].into_iter().collect()
        );
        let entry = GroupEntry::Snapshot {
            group: "g".into(),
            state: state.clone(),
        };
        let decoded = GroupEntry::decode(&entry.to_bytes()).unwrap();
        assert_eq!(decoded, entry);
        let mut dead = BTreeMap::new();
        dead.insert(Offset(7), given_up());
        let both = DurableGroup {
            dead_letters: dead,
            ..state
        };
        let bytes = GroupEntry::Snapshot {
            group: "g".into(),
            state: both,
        }
        .to_bytes();
        assert!(matches!(
            GroupEntry::decode(&bytes),
            Err(GroupEntryError::Malformed(_))
        ));
    }

    /// A seek keeps every redriven offset not finished owed, wherever it
    /// falls; the cursor passing one ahead of it (acked) drops it.
    #[test]
    fn group_entry_seeks_keep_redriven_offsets_owed() {
        let info = given_up();
        let g = |s: &Option<DurableGroup>| {
            let g = s.as_ref().unwrap();
            (
                g.position().0,
                g.redriven().iter().map(|o| o.0).collect::<Vec<_>>(),
                g.redriven_ahead().iter().map(|o| o.0).collect::<Vec<_>>(),
            )
        };
        let group = || "g".to_string();
        let mut s = None;
        for e in [
            GroupEntry::Create {
                group: group(),
                position: Offset(0),
            },
            GroupEntry::DeadLetter {
                group: group(),
                offset: Offset(1),
                info: info.clone(),
            },
            GroupEntry::DeadLetter {
                group: group(),
                offset: Offset(6),
                info,
            },
            GroupEntry::Redrive {
                group: group(),
                offset: Offset(1),
            },
            GroupEntry::Redrive {
                group: group(),
                offset: Offset(6),
            },
        ] {
            apply(&mut s, &e);
        }
        assert_eq!(g(&s), (0, vec![], vec![1, 6]));
        // Forwards past 1: still owed, now below the cursor.
        apply(
            &mut s,
            &GroupEntry::Seek {
                group: group(),
                position: Offset(5),
            },
        );
        assert_eq!(g(&s), (5, vec![1], vec![6]));
        // Backwards below both: ahead again.
        apply(
            &mut s,
            &GroupEntry::Seek {
                group: group(),
                position: Offset(0),
            },
        );
        assert_eq!(g(&s), (0, vec![], vec![1, 6]));
        // The cursor passing 1 (acked) finishes it.
        apply(
            &mut s,
            &GroupEntry::Position {
                group: group(),
                position: Offset(2),
                skipped: 0,
            },
        );
        assert_eq!(g(&s), (2, vec![], vec![6]));
        apply(
            &mut s,
            &GroupEntry::RedriveFinished {
                group: group(),
                offset: Offset(6),
            },
        );
        assert_eq!(g(&s), (2, vec![], vec![]));
    }

    #[test]
    fn group_entry_reasons_are_cut_on_a_char_boundary() {
        let long = "é".repeat(REASON_MAX_BYTES);
        let cut = cut_reason(Some(&long)).unwrap();
        assert!(cut.len() <= REASON_MAX_BYTES);
        assert!(long.starts_with(&cut));
        assert_eq!(cut_reason(None), None);
    }
}

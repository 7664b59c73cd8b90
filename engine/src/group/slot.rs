//! The per-offset slot (16 bytes) and the index of upcoming deadlines.

use crate::types::Offset;

/// Times are kept in 48 bits of milliseconds (about 8,900 years).
pub(super) const TIME_MAX_MS: u64 = (1 << 48) - 1;
/// Attempts are 16 bits.
pub(super) const ATTEMPTS_MAX: u32 = u16::MAX as u32;
/// Holder ids are 24 bits; id 0 means nobody (anonymous or delayed).
pub(super) const HOLDER_MAX: u32 = (1 << 24) - 1;
/// Longest span between a slot's `since` and its deadline that is kept
/// exactly; longer ones (many extensions) saturate, which only affects ages.
pub(super) const SPAN_MAX_MS: u64 = u32::MAX as u64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(super) enum State {
    /// Handed out; the claim stands until the deadline.
    Claimed = 0,
    /// A claim set aside for a reclaiming connection (the holder).
    Reserved = 1,
    /// Handed back with a delay; owed at the deadline. Holds no claim.
    Delayed = 2,
    /// Waiting for the next poll.
    Owed = 3,
}

/// One unfinished offset.
///
/// * `word`: bits 0..48 the deadline (timed states) or the time it became
///   owed (`Owed`); bits 48..64 the attempts so far.
/// * `span_ms`: deadline minus the time the slot entered its state
///   (saturating), so ages can be reported.
/// * `tag`: bits 0..24 the holder, bits 24..32 the state.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    word: u64,
    span_ms: u32,
    tag: u32,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 16);
const _: () = assert!(std::mem::size_of::<(Offset, Slot)>() == 24);

impl Slot {
    /// A claim, reservation or delay standing until `deadline_ms`.
    pub(super) fn timed(
        state: State,
        deadline_ms: u64,
        since_ms: u64,
        attempts: u32,
        holder: u32,
    ) -> Slot {
        assert!(state != State::Owed, "an owed slot has no deadline");
        assert!(
            deadline_ms <= TIME_MAX_MS,
            "deadline {deadline_ms} out of range"
        );
        assert!(attempts <= ATTEMPTS_MAX, "attempts {attempts} out of range");
        assert!(holder <= HOLDER_MAX, "holder {holder} out of range");
        assert!(
            state != State::Delayed || holder == 0,
            "a delayed slot is held by nobody"
        );
        let span = deadline_ms.saturating_sub(since_ms).min(SPAN_MAX_MS) as u32;
        Slot {
            word: deadline_ms | ((attempts as u64) << 48),
            span_ms: span,
            tag: holder | ((state as u32) << 24),
        }
    }

    /// Owed since `since_ms`.
    pub(super) fn owed(since_ms: u64, attempts: u32) -> Slot {
        assert!(since_ms <= TIME_MAX_MS, "time {since_ms} out of range");
        assert!(attempts <= ATTEMPTS_MAX, "attempts {attempts} out of range");
        Slot {
            word: since_ms | ((attempts as u64) << 48),
            span_ms: 0,
            tag: (State::Owed as u32) << 24,
        }
    }

    pub(super) fn state(&self) -> State {
        match self.tag >> 24 {
            0 => State::Claimed,
            1 => State::Reserved,
            2 => State::Delayed,
            _ => State::Owed,
        }
    }

    pub(super) fn is_timed(&self) -> bool {
        self.state() != State::Owed
    }

    /// A standing claim (possibly reserved), not a delay.
    pub(super) fn is_claim(&self) -> bool {
        matches!(self.state(), State::Claimed | State::Reserved)
    }

    pub(super) fn holder(&self) -> u32 {
        self.tag & HOLDER_MAX
    }

    pub(super) fn attempts(&self) -> u32 {
        (self.word >> 48) as u32
    }

    /// The deadline of a timed slot.
    pub(super) fn deadline_ms(&self) -> u64 {
        debug_assert!(self.is_timed());
        self.word & TIME_MAX_MS
    }

    /// When the slot entered its state.
    pub(super) fn since_ms(&self) -> u64 {
        let t = self.word & TIME_MAX_MS;
        if self.is_timed() {
            t.saturating_sub(self.span_ms as u64)
        } else {
            t
        }
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?}(attempts {}, time {}, since {}, holder {})",
            self.state(),
            self.attempts(),
            self.word & TIME_MAX_MS,
            self.since_ms(),
            self.holder()
        )
    }
}

/// How many upcoming deadlines the index keeps at most after a rebuild.
pub(super) const DUE_MAX: usize = 256;

/// The next deadlines, exactly: every timed slot whose `(deadline, offset)`
/// is at or below `horizon` is in `due` (sorted descending, so the next one
/// is last), and nothing else is. Timed slots above the horizon are found by
/// a rescan, made only when the horizon's time comes with `due` drained:
/// acks drain it all the time, and a rescan each time would cost a pass over
/// every claim. This keeps no per-claim memory.
#[derive(Debug)]
pub(super) struct Timers {
    due: Vec<(u64, Offset)>,
    horizon: (u64, Offset),
}

impl Timers {
    pub(super) fn new() -> Timers {
        Timers {
            due: Vec::new(),
            horizon: (0, Offset(0)),
        }
    }

    pub(super) fn clear(&mut self) {
        self.due = Vec::new();
        self.horizon = (0, Offset(0));
    }

    pub(super) fn is_empty(&self) -> bool {
        self.due.is_empty()
    }

    /// The earliest deadline of all timed slots (when `rebuild` has run after
    /// `due` drained).
    pub(super) fn next(&self) -> Option<(u64, Offset)> {
        self.due.last().copied()
    }

    /// Start again from one timed slot, the only one there is.
    pub(super) fn restart(&mut self, deadline_ms: u64, offset: Offset) {
        debug_assert!(self.due.is_empty(), "restart with timers standing");
        self.due.push((deadline_ms, offset));
        self.horizon = (deadline_ms, offset);
    }

    pub(super) fn insert(&mut self, deadline_ms: u64, offset: Offset) {
        let key = (deadline_ms, offset);
        if key <= self.horizon {
            match self.due.binary_search_by(|e| key.cmp(e)) {
                Ok(_) => panic!("timer {key:?} indexed twice"),
                Err(at) => self.due.insert(at, key),
            }
        }
    }

    pub(super) fn remove(&mut self, deadline_ms: u64, offset: Offset) {
        let key = (deadline_ms, offset);
        if key <= self.horizon {
            match self.due.binary_search_by(|e| key.cmp(e)) {
                Ok(at) => {
                    self.due.remove(at);
                }
                Err(_) => panic!("timer {key:?} missing from the due list"),
            }
        }
    }

    /// Refill from every timed slot: keep the `DUE_MAX` earliest.
    pub(super) fn rebuild(&mut self, timed: impl Iterator<Item = (u64, Offset)>) {
        let mut heap = std::collections::BinaryHeap::with_capacity(DUE_MAX + 1);
        for key in timed {
            if heap.len() < DUE_MAX {
                heap.push(key);
            } else if key < *heap.peek().expect("heap is full") {
                heap.pop();
                heap.push(key);
            }
        }
        let mut due = heap.into_vec();
        due.sort_unstable_by(|a, b| b.cmp(a));
        self.horizon = due.first().copied().unwrap_or((0, Offset(0)));
        self.due = due;
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.due.len()
    }

    pub(super) fn contains(&self, deadline_ms: u64, offset: Offset) -> bool {
        let key = (deadline_ms, offset);
        self.due.binary_search_by(|e| key.cmp(e)).is_ok()
    }

    pub(super) fn horizon(&self) -> (u64, Offset) {
        self.horizon
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.due.capacity() * std::mem::size_of::<(u64, Offset)>()
    }

    /// Check the list is sorted descending with no duplicates.
    pub(super) fn check_sorted(&self) {
        for w in self.due.windows(2) {
            assert!(w[0] > w[1], "due list out of order: {:?}", w);
        }
        if let Some(first) = self.due.first() {
            assert!(*first <= self.horizon, "due entry above the horizon");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_slot_packs_its_fields() {
        let s = Slot::timed(State::Reserved, TIME_MAX_MS, 5, 65_535, HOLDER_MAX);
        assert_eq!(s.state(), State::Reserved);
        assert_eq!(s.deadline_ms(), TIME_MAX_MS);
        assert_eq!(s.attempts(), 65_535);
        assert_eq!(s.holder(), HOLDER_MAX);
        assert_eq!(s.since_ms(), TIME_MAX_MS - SPAN_MAX_MS);
        let o = Slot::owed(1234, 3);
        assert_eq!(o.state(), State::Owed);
        assert_eq!(o.since_ms(), 1234);
        assert_eq!(o.attempts(), 3);
        assert_eq!(o.holder(), 0);
        let d = Slot::timed(State::Delayed, 100, 40, 2, 0);
        assert_eq!((d.since_ms(), d.deadline_ms()), (40, 100));
    }

    #[test]
    fn group_timers_keep_the_earliest_exactly() {
        let mut t = Timers::new();
        t.rebuild((0..1000u64).rev().map(|i| (i * 3 % 1000, Offset(i))));
        assert_eq!(t.len(), DUE_MAX);
        t.check_sorted();
        let first = t.next().unwrap();
        assert_eq!(first.0, 0);
        t.remove(first.0, first.1);
        // Above the horizon: not indexed until a rebuild.
        t.insert(5_000, Offset(7));
        assert!(!t.contains(5_000, Offset(7)));
        // Below: indexed at once.
        t.insert(0, Offset(5_000));
        assert_eq!(t.next(), Some((0, Offset(5_000))));
        t.check_sorted();
    }
}

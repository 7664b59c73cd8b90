//! Unit tests of the tracker, one rule each. `guide` holds the tracker-level
//! versions of the guide's own tests.

use std::collections::BTreeSet;

use super::*;

/// A tracker over a fake log, recording every entry written.
pub(super) struct Harness {
    pub t: GroupTracker,
    pub start: u64,
    pub end: u64,
    pub now: u64,
    pub control: BTreeSet<u64>,
    pub payload: u32,
    pub written: Vec<GroupEntry>,
}

impl Harness {
    pub fn new() -> Harness {
        Harness::with(GroupConfig::default())
    }

    pub fn with(config: GroupConfig) -> Harness {
        Harness {
            t: GroupTracker::new("workers", config),
            start: 0,
            end: 0,
            now: 1_000,
            control: BTreeSet::new(),
            payload: 100,
            written: Vec::new(),
        }
    }

    pub fn log(&self) -> LogView {
        LogView::new(self.start, self.end)
    }

    pub fn append(&mut self, n: u64) {
        self.end += n;
    }

    /// Append a control record (a generation start): settled, never delivered.
    pub fn append_control(&mut self) {
        self.control.insert(self.end);
        self.end += 1;
    }

    pub fn advance(&mut self, ms: u64) {
        self.now += ms;
    }

    fn record(&mut self, writes: Vec<GroupEntry>) {
        self.written.extend(writes);
        self.t.check_invariants();
    }

    pub fn poll_as(&mut self, caller: &Caller, max: u32) -> Vec<Delivery> {
        self.poll_full(caller, max, None).deliveries
    }

    pub fn poll_full(&mut self, caller: &Caller, max: u32, vis: Option<u64>) -> PollOutcome {
        let (start, control, payload) = (self.start, self.control.clone(), self.payload);
        let log = self.log();
        let mut lookup = |o: Offset| {
            if o.0 < start || control.contains(&o.0) {
                Lookup::Skipped
            } else {
                Lookup::Record {
                    payload_bytes: payload,
                }
            }
        };
        let out = self.t.poll(self.now, caller, max, vis, log, &mut lookup);
        self.record(out.writes.clone());
        out
    }

    /// A poll from connection 1 that finds the offsets below `n` settled
    /// (control records) and nothing loaded from `n` on: it steps over the
    /// run and stops there.
    pub fn poll_unloaded_from(&mut self, n: u64) -> PollOutcome {
        let log = self.log();
        let mut lookup = |o: Offset| {
            if o.0 < n {
                Lookup::Skipped
            } else {
                Lookup::NotLoaded
            }
        };
        let out = self
            .t
            .poll(self.now, &Caller::anonymous(1), 10, None, log, &mut lookup);
        self.record(out.writes.clone());
        out
    }

    /// An anonymous poll from connection 1.
    pub fn poll(&mut self, max: u32) -> Vec<Delivery> {
        self.poll_as(&Caller::anonymous(1), max)
    }

    pub fn poll_offsets(&mut self, max: u32) -> Vec<u64> {
        offsets(&self.poll(max))
    }

    pub fn ack(&mut self, o: u64) -> Result<(), GroupError> {
        let w = self.t.ack(self.now, &[Offset(o)], self.log())?;
        self.record(w);
        Ok(())
    }

    pub fn nack(&mut self, o: u64, attempts: u32, delay: Option<u64>) -> Result<(), GroupError> {
        let w = self.t.nack(
            self.now,
            Offset(o),
            attempts,
            delay,
            Some("boom"),
            self.log(),
        )?;
        self.record(w);
        Ok(())
    }

    pub fn extend(&mut self, o: u64, attempts: u32, ms: u64) -> Result<u64, GroupError> {
        let r = self.t.extend(self.now, Offset(o), attempts, ms, self.log());
        self.t.check_invariants();
        r
    }

    pub fn dead_letter(&mut self, o: u64, attempts: u32) -> Result<(), GroupError> {
        let w = self
            .t
            .dead_letter(self.now, Offset(o), attempts, Some("bad input"), self.log())?;
        self.record(w);
        Ok(())
    }

    pub fn redrive(&mut self, o: u64) -> Result<(), GroupError> {
        let w = self.t.redrive(self.now, Offset(o), self.log())?;
        self.record(w);
        Ok(())
    }

    pub fn discard(&mut self, o: u64) -> Result<(), GroupError> {
        let w = self.t.discard(self.now, Offset(o))?;
        self.record(w);
        Ok(())
    }

    pub fn seek(&mut self, to: StartAt) -> Result<(), GroupError> {
        let w = self.t.seek(self.now, to, self.log())?;
        self.record(w);
        Ok(())
    }

    pub fn create(&mut self, at: StartAt) -> Result<(), GroupError> {
        let w = self.t.create(self.now, at, self.log())?;
        self.record(w);
        Ok(())
    }

    pub fn tick(&mut self) {
        let w = self.t.tick(self.now);
        self.record(w);
    }

    pub fn position(&self) -> u64 {
        self.t.position().0
    }

    pub fn dead(&self) -> Vec<u64> {
        self.t
            .dead_letters()
            .unwrap()
            .into_iter()
            .map(|(o, _)| o.0)
            .collect()
    }

    pub fn describe(&mut self) -> GroupStatus {
        self.t.describe(self.now, self.log()).unwrap()
    }

    /// A new tracker rebuilt from every entry written so far, as a restart
    /// does; checks it matches the durable state of the live one.
    pub fn restart(&mut self) {
        let mut fresh = GroupTracker::new("workers", self.t.config().clone());
        for e in &self.written {
            let bytes = e.to_bytes();
            assert!(fresh.apply_entry(&GroupEntry::decode(&bytes).unwrap()));
        }
        assert_eq!(fresh.durable(), self.t.durable(), "replay differs");
        self.t = fresh;
    }
}

pub(super) fn offsets(ds: &[Delivery]) -> Vec<u64> {
    ds.iter().map(|d| d.offset.0).collect()
}

fn attempts(ds: &[Delivery]) -> Vec<u32> {
    ds.iter().map(|d| d.attempts).collect()
}

fn is_stale<T: std::fmt::Debug>(r: Result<T, GroupError>) -> bool {
    matches!(r, Err(GroupError::StaleClaim(_)))
}

fn is_invalid<T: std::fmt::Debug>(r: Result<T, GroupError>) -> bool {
    matches!(r, Err(GroupError::InvalidRequest(_)))
}

fn small(f: impl FnOnce(&mut GroupConfig)) -> GroupConfig {
    let mut c = GroupConfig {
        visibility_ms: 1_000,
        ..GroupConfig::default()
    };
    f(&mut c);
    c
}

/// The guide's tests, at tracker level.
mod guide {
    use super::*;

    #[test]
    fn an_offset_in_flight_is_not_handed_out_again() {
        let mut h = Harness::new();
        h.append(3);
        assert_eq!(h.poll_offsets(10), vec![0, 1, 2]);
        assert!(h.poll_as(&Caller::anonymous(2), 10).is_empty());
        h.advance(29_999);
        assert!(h.poll_offsets(10).is_empty());
        h.append(1);
        assert_eq!(h.poll_offsets(10), vec![3]);
    }

    #[test]
    fn a_lapsed_claim_is_handed_out_again() {
        let mut h = Harness::with(small(|_| {}));
        h.append(1);
        assert_eq!(attempts(&h.poll(10)), vec![1]);
        h.advance(999);
        assert!(h.poll(10).is_empty());
        h.advance(1);
        let again = h.poll_as(&Caller::anonymous(2), 10);
        assert_eq!(offsets(&again), vec![0]);
        assert_eq!(attempts(&again), vec![2]);
    }

    #[test]
    fn the_cursor_does_not_advance_over_a_gap() {
        let mut h = Harness::new();
        h.append(7);
        assert_eq!(h.poll_offsets(10).len(), 7);
        for o in 0..5 {
            h.ack(o).unwrap();
        }
        h.ack(6).unwrap();
        assert_eq!(h.position(), 5, "the cursor waits at the unacked 5");
        h.restart();
        // A restart redelivers 5 and 6 (the ack above the cursor was memory).
        assert_eq!(h.poll_offsets(10), vec![5, 6]);
        h.ack(5).unwrap();
        h.ack(6).unwrap();
        assert_eq!(h.position(), 7);
    }

    #[test]
    fn owed_records_go_out_before_new_ones() {
        let mut h = Harness::new();
        h.append(2);
        assert_eq!(h.poll_offsets(2), vec![0, 1]);
        h.nack(1, 1, None).unwrap();
        h.append(5);
        let d = h.poll(3);
        assert_eq!(offsets(&d), vec![1, 2, 3]);
        assert_eq!(attempts(&d), vec![2, 1, 1]);
    }

    #[test]
    fn a_record_is_given_up_on_after_the_attempt_bound() {
        let mut h = Harness::with(small(|c| c.max_attempts = 3));
        h.append(2);
        for attempt in 1..=3 {
            let d = h.poll(1);
            assert_eq!(offsets(&d), vec![0]);
            assert_eq!(attempts(&d), vec![attempt]);
            h.advance(1_000);
        }
        // The third lapse gives up on it: the group moves past.
        assert_eq!(h.poll_offsets(1), vec![1]);
        assert_eq!(h.dead(), vec![0]);
        let dl = &h.t.dead_letters().unwrap()[0].1;
        assert_eq!((dl.attempts, dl.by_consumer), (3, false));
        // The broker says why it gave up.
        assert_eq!(dl.reason.as_deref(), Some("claim lapsed after attempt 3"));
        h.ack(1).unwrap();
        assert_eq!(h.position(), 2);
        // The dead letter is written before the position that passes it.
        let dl_at = h
            .written
            .iter()
            .position(|e| matches!(e, GroupEntry::DeadLetter { .. }))
            .unwrap();
        let pos_at = h
            .written
            .iter()
            .position(|e| matches!(e, GroupEntry::Position { position, .. } if position.0 >= 1))
            .unwrap();
        assert!(dl_at < pos_at);
    }

    #[test]
    fn a_redriven_record_is_handed_out_again() {
        let mut h = Harness::new();
        h.append(3);
        h.poll(3);
        h.dead_letter(1, 1).unwrap();
        h.ack(0).unwrap();
        h.ack(2).unwrap();
        assert_eq!(h.position(), 3);
        h.redrive(1).unwrap();
        assert!(h.dead().is_empty());
        assert_eq!(h.position(), 3, "a redrive never moves the cursor back");
        h.append(1);
        assert_eq!(h.poll_offsets(10), vec![1, 3], "owed before new");
        h.ack(1).unwrap();
        assert!(h.t.durable().unwrap().redriven().is_empty());
        assert_eq!(h.position(), 3);
    }

    #[test]
    fn a_redriven_record_gets_its_attempts_back() {
        let mut h = Harness::with(small(|c| c.max_attempts = 2));
        h.append(1);
        h.poll(1);
        h.advance(1_000);
        h.poll(1);
        h.advance(1_000);
        h.tick();
        assert_eq!(h.dead(), vec![0]);
        assert_eq!(h.position(), 1);
        h.redrive(0).unwrap();
        let d = h.poll(1);
        assert_eq!((offsets(&d), attempts(&d)), (vec![0], vec![1]));
        // And it can fail its attempts again, back onto the list.
        h.advance(1_000);
        assert_eq!(attempts(&h.poll(1)), vec![2]);
        h.advance(1_000);
        h.tick();
        assert_eq!(h.dead(), vec![0]);
        assert!(h.t.durable().unwrap().redriven().is_empty());
    }

    #[test]
    fn a_redriven_record_is_still_owed_after_a_restart() {
        let mut h = Harness::new();
        h.append(2);
        h.poll(2);
        h.dead_letter(0, 1).unwrap();
        h.ack(1).unwrap();
        h.redrive(0).unwrap();
        h.restart();
        let d = h.poll(10);
        assert_eq!((offsets(&d), attempts(&d)), (vec![0], vec![1]));
        h.ack(0).unwrap();
        h.restart();
        assert!(h.poll(10).is_empty());
    }

    #[test]
    fn an_extended_claim_outlasts_the_visibility_timeout() {
        let mut h = Harness::with(small(|_| {}));
        h.append(1);
        h.poll(1);
        h.advance(900);
        assert_eq!(h.extend(0, 1, 5_000).unwrap(), 5_000);
        h.advance(4_000);
        h.tick();
        assert!(h.poll_as(&Caller::anonymous(2), 1).is_empty());
        h.ack(0).unwrap();
        assert_eq!(h.position(), 1);
    }

    #[test]
    fn an_extend_after_the_record_was_handed_out_again_is_refused() {
        let mut h = Harness::with(small(|_| {}));
        h.append(1);
        h.poll(1);
        h.advance(1_000);
        // Lapsed and owed, not yet handed out again: the late worker may
        // still take it back (the guide refuses only once it went out).
        assert_eq!(h.extend(0, 1, 5_000).unwrap(), 5_000);
        assert!(h.poll_as(&Caller::anonymous(2), 1).is_empty());
        h.advance(5_000);
        h.tick();
        assert_eq!(attempts(&h.poll_as(&Caller::anonymous(2), 1)), vec![2]);
        assert!(is_stale(h.extend(0, 1, 5_000)));
        assert!(is_stale(h.nack(0, 1, Some(5_000))));
        assert!(is_stale(h.nack(0, 1, None)));
        // The current holder still can.
        assert_eq!(h.extend(0, 2, 5_000).unwrap(), 5_000);
    }

    #[test]
    fn a_delayed_nack_is_redelivered_after_the_delay() {
        let mut h = Harness::new();
        h.append(2);
        h.poll(1);
        h.nack(0, 1, Some(5_000)).unwrap();
        assert_eq!(h.t.next_deadline(), Some(h.now + 5_000));
        assert_eq!(h.poll_offsets(1), vec![1], "the delayed record waits");
        h.advance(4_999);
        assert!(h.poll(1).is_empty());
        h.advance(1);
        let d = h.poll(1);
        assert_eq!((offsets(&d), attempts(&d)), (vec![0], vec![2]));
    }

    #[test]
    fn a_consumer_dead_letter_is_listed_finished_and_redrivable() {
        let mut h = Harness::new();
        h.append(2);
        h.poll(2);
        let w =
            h.t.dead_letter(h.now, Offset(0), 1, Some("unparseable"), h.log())
                .unwrap();
        assert!(matches!(&w[0], GroupEntry::DeadLetter { info, .. } if info.by_consumer));
        assert!(matches!(&w[1], GroupEntry::Position { position, .. } if position.0 == 1));
        h.written.extend(w);
        let (o, info) = h.t.dead_letters().unwrap()[0].clone();
        assert_eq!(o, Offset(0));
        assert_eq!(info.reason.as_deref(), Some("unparseable"));
        assert!(info.by_consumer);
        // Finished: refused now, and an ack is a duplicate.
        assert!(is_invalid(h.dead_letter(0, 1)));
        h.ack(0).unwrap();
        assert_eq!(h.position(), 1);
        h.redrive(0).unwrap();
        let d = h.poll(10);
        assert_eq!((offsets(&d), attempts(&d)), (vec![0], vec![1]));
    }

    #[test]
    fn a_tracker_with_a_standing_claim_is_not_evicted() {
        let mut h = Harness::with(small(|c| c.idle_ms = 10_000));
        h.append(2);
        h.poll(1);
        h.t.extend(h.now, Offset(0), 1, 60_000, h.log()).unwrap();
        h.advance(20_000);
        assert!(h.t.is_idle(h.now));
        assert!(!h.t.can_evict(h.now), "a claim still stands");
        h.advance(40_000);
        assert!(h.t.can_evict(h.now), "the claim lapsed");
        // Delayed nacks hold it too.
        let mut h = Harness::with(small(|c| c.idle_ms = 10_000));
        h.append(1);
        h.poll(1);
        h.nack(0, 1, Some(30_000)).unwrap();
        h.advance(10_000);
        assert!(h.t.is_idle(h.now) && !h.t.can_evict(h.now));
        h.advance(20_000);
        assert!(h.t.can_evict(h.now));
        // Evicted: rebuilt from disk, the record comes again at attempt 1.
        h.t.reset_to_durable();
        let d = h.poll(1);
        assert_eq!((offsets(&d), attempts(&d)), (vec![0], vec![1]));
    }

    #[test]
    fn a_seek_backwards_replays_what_the_group_finished() {
        let mut h = Harness::new();
        h.append(4);
        h.poll(4);
        for o in 0..4 {
            h.ack(o).unwrap();
        }
        assert_eq!(h.position(), 4);
        h.seek(StartAt::Offset(Offset(1))).unwrap();
        assert_eq!(h.position(), 1);
        let d = h.poll(10);
        assert_eq!((offsets(&d), attempts(&d)), (vec![1, 2, 3], vec![1, 1, 1]));
        h.restart();
        assert_eq!(h.position(), 1);
        assert_eq!(h.poll_offsets(10), vec![1, 2, 3]);
    }

    #[test]
    fn an_ack_for_a_claim_from_before_a_seek_is_refused() {
        let mut h = Harness::new();
        h.append(4);
        h.poll(4);
        h.seek(StartAt::Offset(Offset(1))).unwrap();
        assert!(is_stale(h.ack(2)));
        assert!(is_stale(h.nack(2, 1, None)));
        assert!(is_stale(h.extend(2, 1, 1_000)));
        // Delivered again from the new position.
        assert_eq!(h.poll_offsets(10), vec![1, 2, 3]);
        h.ack(2).unwrap();
    }

    #[test]
    fn an_ack_racing_a_seek_does_not_move_the_new_cursor() {
        let mut h = Harness::new();
        h.append(10);
        h.poll(10);
        h.seek(StartAt::Offset(Offset(5))).unwrap();
        let before = h.written.len();
        // Below the new position: a harmless duplicate, nothing written.
        h.ack(3).unwrap();
        assert_eq!(h.written.len(), before);
        // At or above it: refused, the cursor stays.
        assert!(is_stale(h.ack(5)));
        assert_eq!(h.position(), 5);
        assert_eq!(h.poll_offsets(10), vec![5, 6, 7, 8, 9]);
    }

    #[test]
    fn a_group_is_created_moved_described_and_deleted() {
        let mut h = Harness::new();
        h.append(10);
        assert!(matches!(
            h.t.describe(h.now, h.log()),
            Err(GroupError::NotFound(_))
        ));
        h.create(StartAt::Latest).unwrap();
        assert_eq!(h.position(), 10);
        // A no-op for an existing group, even with an offset now out of range.
        let n = h.written.len();
        h.create(StartAt::Offset(Offset(99))).unwrap();
        assert_eq!((h.written.len(), h.position()), (n, 10));
        h.seek(StartAt::Earliest).unwrap();
        h.poll(3);
        let st = h.describe();
        assert_eq!((st.position, st.in_flight, st.lag()), (Offset(0), 3, 10));
        h.t.delete(h.now).unwrap();
        assert!(!h.t.exists());
        assert!(matches!(h.t.dead_letters(), Err(GroupError::NotFound(_))));
        // The next poll makes it again at 0.
        assert_eq!(h.poll_offsets(2), vec![0, 1]);
    }

    #[test]
    fn a_consumer_extends_delays_and_dead_letters_its_claims() {
        let mut h = Harness::with(small(|_| {}));
        h.append(3);
        h.poll(3);
        assert_eq!(h.extend(0, 1, 10_000).unwrap(), 10_000);
        h.nack(1, 1, Some(2_000)).unwrap();
        h.dead_letter(2, 1).unwrap();
        h.advance(2_000);
        let d = h.poll(10);
        assert_eq!((offsets(&d), attempts(&d)), (vec![1], vec![2]));
        assert_eq!(h.dead(), vec![2]);
    }
}

/// Every other rule of the guide, one test each.
mod rules {
    use super::*;

    #[test]
    fn only_offsets_handed_out_can_be_acked() {
        let mut h = Harness::new();
        h.append(5);
        h.poll(2);
        assert!(is_invalid(h.ack(5)), "past the tail");
        assert!(is_invalid(h.ack(3)), "never handed out");
        assert!(is_invalid(h.nack(3, 1, None)));
        assert!(is_invalid(h.dead_letter(3, 1)));
        assert!(is_invalid(h.nack(0, 0, None)), "attempts count from 1");
        // A batch is all or nothing.
        assert!(is_invalid(
            h.t.ack(h.now, &[Offset(0), Offset(3)], h.log()).map(|_| ())
        ));
        assert_eq!(h.describe().in_flight, 2);
        h.ack(0).unwrap();
        h.ack(0).unwrap();
        assert_eq!(h.position(), 1);
    }

    #[test]
    fn a_missing_group_is_not_found() {
        let mut h = Harness::new();
        h.append(1);
        // A group that does not exist handed nothing out: acks and the
        // other calls about a delivery are invalid_request, as for any
        // offset the group did not hand out.
        assert!(matches!(h.ack(0), Err(GroupError::InvalidRequest(_))));
        assert!(matches!(h.redrive(0), Err(GroupError::NotFound(_))));
        assert!(matches!(
            h.seek(StartAt::Earliest),
            Err(GroupError::NotFound(_))
        ));
        assert!(matches!(h.t.delete(h.now), Err(GroupError::NotFound(_))));
        h.poll(1);
        assert!(matches!(h.redrive(0), Err(GroupError::NotFound(_))));
        assert!(matches!(h.discard(0), Err(GroupError::NotFound(_))));
        assert_eq!(GroupError::NotFound(String::new()).code(), "not_found");
    }

    #[test]
    fn an_ack_of_a_lapsed_claim_finishes_it() {
        let mut h = Harness::with(small(|_| {}));
        h.append(1);
        h.poll(1);
        h.advance(5_000);
        h.ack(0).unwrap();
        assert_eq!(h.position(), 1);
        assert!(h.poll(1).is_empty());
    }

    #[test]
    fn a_nack_of_a_lapsed_claim_is_stale_once_it_went_out_again() {
        let mut h = Harness::with(small(|_| {}));
        h.append(1);
        h.poll(1);
        h.advance(1_000);
        // Lapsed, and owed after the tick, but not handed out again: the
        // late nack (with a delay) still applies to its delivery.
        h.tick();
        h.nack(0, 1, Some(3_000)).unwrap();
        assert!(h.poll(1).is_empty(), "held back by the delay");
        h.advance(3_000);
        h.tick();
        assert_eq!(attempts(&h.poll(1)), vec![2]);
        // Now it went out again: the first delivery's nack is stale.
        assert!(is_stale(h.nack(0, 1, None)));
        h.nack(0, 2, None).unwrap();
    }

    #[test]
    fn a_nack_at_the_attempt_bound_dead_letters_with_its_reason() {
        let mut h = Harness::with(small(|c| c.max_attempts = 2));
        h.append(1);
        h.poll(1);
        h.nack(0, 1, None).unwrap();
        h.poll(1);
        h.nack(0, 2, Some(10_000)).unwrap();
        let dl = &h.t.dead_letters().unwrap()[0].1;
        assert_eq!((dl.attempts, dl.reason.as_deref()), (2, Some("boom")));
        assert_eq!(h.position(), 1);
    }

    /// However many records a group gives up on with long reasons, the
    /// reasons it keeps stay within REASON_BUDGET_BYTES (the group's state is
    /// one snapshot batch in every new segment): past it, dead letters are
    /// kept without their reason, and replay agrees.
    #[test]
    fn dead_letter_reasons_stay_within_the_group_budget() {
        use crate::group::entry::{REASON_BUDGET_BYTES, REASON_MAX_BYTES};
        let mut h = Harness::new();
        let n = (REASON_BUDGET_BYTES / REASON_MAX_BYTES + 10) as u64;
        h.append(n);
        let long = "r".repeat(REASON_MAX_BYTES);
        let mut done = 0u64;
        while done < n {
            let batch = h.poll_offsets(1000);
            assert!(!batch.is_empty());
            for o in batch {
                let log = h.log();
                let w =
                    h.t.dead_letter(h.now, Offset(o), 1, Some(&long), log)
                        .unwrap();
                h.record(w);
                done += 1;
            }
        }
        let g = h.t.durable().unwrap();
        assert_eq!(g.dead_letters().len() as u64, n, "every record is listed");
        assert!(g.reason_bytes() <= REASON_BUDGET_BYTES);
        let with = g
            .dead_letters()
            .values()
            .filter(|d| d.reason.is_some())
            .count();
        assert_eq!(with, REASON_BUDGET_BYTES / REASON_MAX_BYTES);
        h.restart();
        assert_eq!(
            h.t.durable().unwrap().reason_bytes(),
            with * REASON_MAX_BYTES
        );
        // A redrive gives budget back.
        h.redrive(0).unwrap();
        assert_eq!(
            h.t.durable().unwrap().reason_bytes(),
            (with - 1) * REASON_MAX_BYTES
        );
    }

    /// Discard stops tracking a dead letter; it does not make it new again.
    /// Above a cursor held back by an earlier claim, the discarded offset
    /// stays finished through a restart, and is forgotten once the cursor
    /// passes it.
    #[test]
    fn a_discarded_dead_letter_above_the_cursor_stays_finished() {
        let mut h = Harness::new();
        h.append(3);
        assert_eq!(h.poll_offsets(3), vec![0, 1, 2]);
        h.dead_letter(1, 1).unwrap();
        h.ack(2).unwrap();
        assert_eq!(h.position(), 0, "offset 0 is still claimed");
        h.discard(1).unwrap();
        assert!(h.dead().is_empty(), "no longer listed");
        assert_eq!(h.describe().dead_letters, 0);
        assert!(h.discard(1).is_err(), "gone from the list");
        assert!(h.redrive(1).is_err(), "gone from the list");
        h.restart();
        assert!(h.dead().is_empty());
        // The restart forgot the claim on 0 and the ack of 2 (memory): both
        // come back; the discarded 1 does not.
        assert_eq!(h.poll_offsets(10), vec![0, 2]);
        h.ack(0).unwrap();
        h.ack(2).unwrap();
        assert_eq!(h.position(), 3);
        assert!(
            h.t.durable().unwrap().dead_letters().is_empty(),
            "forgotten once the cursor passed it"
        );
        h.restart();
        assert!(h.poll_offsets(10).is_empty());
    }

    #[test]
    fn a_delayed_nack_holds_an_in_flight_place_and_cannot_be_extended() {
        let mut h = Harness::with(small(|c| c.max_in_flight = 1));
        h.append(2);
        h.poll(1);
        h.nack(0, 1, Some(3_000)).unwrap();
        let out = h.poll_full(&Caller::anonymous(1), 10, None);
        assert!(
            out.deliveries.is_empty() && out.capped,
            "the delay holds the only place"
        );
        assert!(is_stale(h.extend(0, 1, 1_000)));
        assert!(is_stale(h.nack(0, 1, None)));
        let st = h.describe();
        assert_eq!((st.in_flight, st.delayed), (1, 1));
        // It can still be acked or given up on by whoever held it.
        h.ack(0).unwrap();
        assert_eq!(h.poll_offsets(10), vec![1]);
    }

    #[test]
    fn the_in_flight_cap_answers_empty_until_room_frees() {
        let mut h = Harness::with(small(|c| c.max_in_flight = 2));
        h.append(5);
        assert_eq!(h.poll_offsets(10), vec![0, 1]);
        let out = h.poll_full(&Caller::anonymous(2), 10, None);
        assert!(out.deliveries.is_empty() && out.capped);
        // Nothing waiting at all is not "capped".
        let mut idle = Harness::with(small(|c| c.max_in_flight = 2));
        idle.append(2);
        idle.poll(2);
        assert!(!idle.poll_full(&Caller::anonymous(2), 10, None).capped);
        // An ack frees one place.
        h.ack(0).unwrap();
        assert_eq!(h.poll_offsets(10), vec![2]);
        // A lapse frees both: the lapsed records go first.
        assert_eq!(h.t.next_deadline(), Some(h.now + 1_000));
        h.advance(1_000);
        h.tick();
        assert_eq!(h.describe().in_flight, 0);
        assert_eq!(h.poll_offsets(10), vec![1, 2]);
        assert!(h.poll_full(&Caller::anonymous(1), 10, None).capped);
    }

    #[test]
    fn a_waiting_poll_knows_when_work_arrives() {
        let mut h = Harness::with(small(|c| c.max_in_flight = 1));
        let anon = Caller::anonymous(1);
        assert!(!h.t.has_work_for(h.now, &anon, h.log()));
        h.append(2);
        assert!(
            h.t.has_work_for(h.now, &anon, h.log()),
            "a first poll creates the group"
        );
        h.poll(1);
        assert!(!h.t.has_work_for(h.now, &anon, h.log()), "at the cap");
        h.advance(1_000);
        assert!(
            h.t.has_work_for(h.now, &anon, h.log()),
            "a lapse frees room"
        );
        h.tick();
        h.poll(1);
        h.ack(0).unwrap();
        assert!(h.t.has_work_for(h.now, &anon, h.log()), "an ack frees room");
        h.poll(1);
        h.ack(1).unwrap();
        assert!(!h.t.has_work_for(h.now, &anon, h.log()), "nothing left");
    }

    #[test]
    fn one_poll_hands_out_at_most_the_record_cap() {
        let mut h = Harness::new();
        h.append(2_500);
        assert_eq!(h.poll(5_000).len(), 1_000);
        assert_eq!(h.poll(0).len(), 1_000, "0 asks for the broker's cap");
        assert_eq!(h.poll(7).len(), 7);
    }

    #[test]
    fn one_poll_stops_after_the_record_that_crosses_the_byte_cap() {
        let mut h = Harness::with(GroupConfig {
            poll_max_bytes: 1_000,
            ..GroupConfig::default()
        });
        h.payload = 300;
        h.append(10);
        assert_eq!(
            h.poll_offsets(100),
            vec![0, 1, 2, 3],
            "1,200 bytes: stops after crossing"
        );
        h.payload = 5_000;
        assert_eq!(h.poll_offsets(100), vec![4], "always at least one record");
    }

    #[test]
    fn a_poll_stops_at_the_first_record_not_loaded() {
        let mut h = Harness::new();
        h.append(6);
        let log = h.log();
        let plan = h.t.plan_poll(h.now, &Caller::anonymous(1), 3, log);
        assert_eq!(plan.offsets, vec![Offset(0), Offset(1), Offset(2)]);
        // Another consumer takes 0 and 1 in between: the poll re-decides.
        h.poll_as(&Caller::anonymous(2), 2);
        let loaded: BTreeSet<Offset> = plan.offsets.iter().copied().collect();
        let mut lookup = |o: Offset| {
            if loaded.contains(&o) {
                Lookup::Record { payload_bytes: 1 }
            } else {
                Lookup::NotLoaded
            }
        };
        let out =
            h.t.poll(h.now, &Caller::anonymous(1), 3, None, log, &mut lookup);
        assert_eq!(offsets(&out.deliveries), vec![2]);
        assert_eq!(h.t.describe(h.now, log).unwrap().frontier, Offset(3));
    }

    #[test]
    fn control_records_are_settled_and_counted_as_skipped_before() {
        let mut h = Harness::new();
        h.append(1);
        h.append_control();
        h.append_control();
        h.append(1);
        let d = h.poll(10);
        assert_eq!(offsets(&d), vec![0, 3]);
        assert_eq!(
            d.iter().map(|d| d.skipped_before).collect::<Vec<_>>(),
            vec![0, 2]
        );
        h.ack(0).unwrap();
        assert_eq!(
            h.position(),
            3,
            "the cursor passes the settled control records"
        );
        // A redelivery says the same.
        h.nack(3, 1, None).unwrap();
        assert_eq!(h.poll(10)[0].skipped_before, 2);
    }

    #[test]
    fn a_skipped_run_split_across_polls_is_counted_whole() {
        let mut h = Harness::new();
        h.append_control();
        h.append_control();
        h.append(1);
        assert!(h.poll_unloaded_from(2).deliveries.is_empty());
        assert_eq!(h.poll(10)[0].skipped_before, 2);
    }

    #[test]
    fn a_skipped_run_below_the_position_is_told_again_after_a_restart() {
        // Not handed out yet: the poll stepped over the run and stopped at
        // a record it had not loaded; the position moved up to it.
        let mut h = Harness::new();
        h.append_control();
        h.append_control();
        h.append(1);
        assert!(h.poll_unloaded_from(2).deliveries.is_empty());
        assert_eq!(h.position(), 2);
        h.restart();
        assert_eq!(h.poll(10)[0].skipped_before, 2);

        // Handed out and in flight: the same count comes back with it.
        h.restart();
        let d = h.poll(10);
        assert_eq!((offsets(&d), d[0].skipped_before), (vec![2], 2));
    }

    #[test]
    fn a_restart_then_retention_past_the_position_adds_to_the_kept_run() {
        let mut h = Harness::new();
        h.append_control();
        h.append(6);
        // 0 skipped; 1 handed out with it, then the broker restarts.
        assert_eq!(h.poll(1)[0].skipped_before, 1);
        h.restart();
        // Retention removed 1..4 meanwhile: 4 is told of 0..4, all settled
        // without delivery since the position (1 was handed out, but below
        // the log start it is gone for good).
        h.start = 4;
        let d = h.poll(1);
        assert_eq!((offsets(&d), d[0].skipped_before), (vec![4], 1 + 3));
    }

    /// A delivery a seek voided comes back saying what it said, whether
    /// the seek lands on it or below it, and after a restart too.
    #[test]
    fn a_redelivery_after_a_seek_says_the_same_skipped_before() {
        let mut h = Harness::new();
        h.append(10);
        h.start = 4;
        assert_eq!(h.poll(1)[0].skipped_before, 4);
        h.seek(StartAt::Offset(Offset(4))).unwrap();
        let d = h.poll(1);
        assert_eq!(
            (offsets(&d), attempts(&d), d[0].skipped_before),
            (vec![4], vec![2], 4)
        );
        h.seek(StartAt::Earliest).unwrap();
        assert_eq!(h.poll(1)[0].skipped_before, 4);
        h.restart();
        assert_eq!(h.poll(1)[0].skipped_before, 4);
    }

    #[test]
    fn a_new_group_starts_at_the_log_start_when_zero_was_removed() {
        let mut h = Harness::new();
        h.append(10);
        h.start = 4;
        let d = h.poll(1);
        assert_eq!((offsets(&d), d[0].skipped_before), (vec![4], 4));
        assert!(matches!(
            &h.written[0],
            GroupEntry::Create { position, .. } if position.0 == 0
        ));
        h.ack(4).unwrap();
        assert_eq!(h.position(), 5);
    }

    #[test]
    fn owed_records_removed_by_retention_are_settled() {
        let mut h = Harness::with(small(|_| {}));
        h.append(4);
        h.poll(4);
        h.ack(2).unwrap();
        h.ack(3).unwrap();
        h.advance(1_000);
        h.start = 2;
        assert!(h.poll(10).is_empty());
        assert_eq!(h.position(), 4);
    }

    #[test]
    fn attempts_count_every_delivery() {
        let mut h = Harness::with(small(|c| c.max_attempts = 10));
        h.append(1);
        for n in 1..=4 {
            assert_eq!(attempts(&h.poll(1)), vec![n]);
            if n % 2 == 0 {
                h.nack(0, n, None).unwrap();
            } else {
                h.advance(1_000);
            }
        }
    }

    #[test]
    fn visibility_extensions_and_delays_are_capped() {
        let mut h = Harness::with(small(|c| c.max_visibility_ms = 5_000));
        h.append(3);
        let out = h.poll_full(&Caller::anonymous(1), 1, Some(1_000_000));
        assert_eq!(out.deliveries.len(), 1);
        assert_eq!(h.t.next_deadline(), Some(h.now + 5_000));
        assert_eq!(h.extend(0, 1, 99_999_999).unwrap(), 5_000);
        h.poll(1);
        h.nack(1, 1, Some(1 << 40)).unwrap();
        h.advance(5_000);
        assert_eq!(h.poll_offsets(10), vec![0, 1, 2]);
        // The cap is never below the visibility.
        let c = GroupConfig {
            visibility_ms: 9_000,
            max_visibility_ms: 10,
            ..GroupConfig::default()
        }
        .clamped();
        assert_eq!(c.max_visibility_ms, 9_000);
        assert_eq!(c.effective_idle_ms(), 600_000);
    }

    #[test]
    fn a_seek_keeps_dead_letters_and_voids_delays() {
        let mut h = Harness::new();
        h.append(4);
        h.poll(4);
        h.dead_letter(1, 1).unwrap();
        h.nack(2, 1, Some(10_000)).unwrap();
        h.seek(StartAt::Earliest).unwrap();
        assert_eq!(h.dead(), vec![1]);
        assert_eq!(h.describe().in_flight, 0);
        // A listed dead letter stays set aside: the replay skips it.
        assert_eq!(h.poll_offsets(10), vec![0, 2, 3]);
        h.redrive(1).unwrap();
        assert_eq!(h.poll_offsets(10), vec![1]);
    }

    #[test]
    fn a_dead_letter_retention_removed_is_not_redriven_and_stays_listed() {
        let mut h = Harness::new();
        h.append(6);
        h.poll(2);
        h.dead_letter(0, 1).unwrap();
        h.dead_letter(1, 1).unwrap();
        h.start = 1;
        match h.redrive(0) {
            Err(GroupError::NotFound(m)) => assert!(m.contains("retention"), "{m}"),
            other => panic!("redrive of a removed record: {other:?}"),
        }
        assert_eq!(h.dead(), vec![0, 1], "still listed, for a discard");
        // The one still in the log goes out again; the other is discarded.
        h.redrive(1).unwrap();
        assert_eq!(h.poll_offsets(10), vec![1, 2, 3, 4, 5]);
        h.discard(0).unwrap();
        assert_eq!(h.dead(), Vec::<u64>::new());
    }

    #[test]
    fn a_bad_start_position_is_refused() {
        let mut h = Harness::new();
        h.append(10);
        h.start = 3;
        assert!(is_invalid(h.create(StartAt::Offset(Offset(2)))));
        assert!(is_invalid(h.create(StartAt::Offset(Offset(11)))));
        h.create(StartAt::Offset(Offset(10))).unwrap();
        assert!(is_invalid(h.seek(StartAt::Offset(Offset(1)))));
        h.seek(StartAt::Earliest).unwrap();
        assert_eq!(h.position(), 3);
    }

    #[test]
    fn a_restart_redelivers_from_the_position_with_fresh_attempts() {
        let mut h = Harness::with(small(|_| {}));
        h.append(3);
        h.poll(3);
        h.advance(1_000);
        h.poll(3);
        h.ack(0).unwrap();
        h.restart();
        // An ack of a delivery from before the restart is stale, not invalid.
        assert!(is_stale(h.ack(1)));
        let d = h.poll(10);
        assert_eq!((offsets(&d), attempts(&d)), (vec![1, 2], vec![1, 1]));
    }

    #[test]
    fn a_dead_letter_above_the_position_stays_finished_after_a_restart() {
        let mut h = Harness::new();
        h.append(3);
        h.poll(3);
        h.dead_letter(1, 1).unwrap();
        h.restart();
        assert_eq!(h.poll_offsets(10), vec![0, 2]);
        h.ack(0).unwrap();
        h.ack(2).unwrap();
        assert_eq!(h.position(), 3);
        h.discard(1).unwrap();
        assert!(h.dead().is_empty());
        assert!(matches!(h.discard(1), Err(GroupError::NotFound(_))));
    }

    /// A redrive stays owed until it is finished, whichever way a seek
    /// moves the cursor: one ahead of the cursor that a seek forward passes
    /// is owed below the new position, after a restart too, and once
    /// acknowledged is not handed out again by the next seek.
    #[test]
    fn a_redriven_record_a_seek_passes_stays_owed() {
        let mut h = Harness::new();
        h.append(10);
        h.poll(3);
        // 0 stays unacknowledged, holding the cursor at 0.
        h.dead_letter(1, 1).unwrap();
        h.redrive(1).unwrap();
        h.seek(StartAt::Offset(Offset(5))).unwrap();
        assert!(h.dead().is_empty());
        assert_eq!(h.poll_offsets(1), vec![1]);
        h.restart();
        assert_eq!(h.poll_offsets(2), vec![1, 5]);
        h.ack(1).unwrap();
        h.seek(StartAt::Offset(Offset(3))).unwrap();
        assert_eq!(h.poll_offsets(10), vec![3, 4, 5, 6, 7, 8, 9]);
    }

    #[test]
    fn a_snapshot_replaces_the_history_before_it() {
        let mut h = Harness::new();
        h.append(5);
        h.poll(5);
        h.dead_letter(0, 1).unwrap();
        h.ack(1).unwrap();
        h.redrive(0).unwrap();
        h.ack(2).unwrap();
        let snap = h.t.snapshot_entries();
        assert_eq!(snap.len(), 1);
        let mut fresh = GroupTracker::new("workers", GroupConfig::default());
        assert!(fresh.apply_entry(&GroupEntry::decode(&snap[0].to_bytes()).unwrap()));
        assert_eq!(fresh.durable(), h.t.durable());
        assert!(!fresh.apply_entry(&GroupEntry::Delete {
            group: "other".into()
        }));
        let log = h.log();
        let mut lookup = |_| Lookup::Record { payload_bytes: 1 };
        let out = fresh.poll(h.now, &Caller::anonymous(9), 10, None, log, &mut lookup);
        assert_eq!(offsets(&out.deliveries), vec![0, 3, 4]);
    }

    #[test]
    fn describe_counts_what_the_group_holds() {
        let mut h = Harness::with(small(|c| c.max_attempts = 1));
        h.append(6);
        h.poll(4);
        h.advance(500);
        h.nack(1, 1, None).unwrap(); // bound 1: dead letter
        h.ack(2).unwrap();
        h.t.extend(h.now, Offset(3), 1, 10_000, h.log()).unwrap();
        h.advance(600); // 0 lapsed (at the bound: counts as dead)
        let st = h.describe();
        assert_eq!(st.position, Offset(0));
        assert_eq!((st.in_flight, st.delayed, st.owed), (1, 0, 0));
        assert_eq!(st.dead_letters, 2);
        assert_eq!(st.oldest_in_flight_age_ms, 1_100);
        assert_eq!(
            st.last_active_ms,
            h.now - 600,
            "the extend: looking is not activity"
        );
        h.tick();
        assert_eq!(h.dead(), vec![0, 1]);
        assert_eq!(h.position(), 3);
    }

    #[test]
    fn counters_count_deliveries_redeliveries_acks_and_dead_letters() {
        let mut h = Harness::with(small(|c| c.max_attempts = 2));
        h.append(3);
        assert_eq!(h.poll(3).len(), 3);
        h.ack(0).unwrap();
        h.ack(0).unwrap(); // a duplicate: not counted again
        h.nack(1, 1, None).unwrap();
        let again = h.poll(1);
        assert_eq!((offsets(&again), attempts(&again)), (vec![1], vec![2]));
        h.nack(1, 2, None).unwrap(); // at the bound: a dead letter
        assert_eq!(h.dead(), vec![1]);
        // Kept across an eviction.
        h.t.reset_to_durable();
        assert_eq!(
            h.t.counters(),
            GroupCounters {
                delivered: 4,
                redelivered: 1,
                acked: 1,
                dead_lettered: 1,
            }
        );
    }

    #[test]
    fn idle_means_untouched_for_the_effective_idle_time() {
        let mut h = Harness::with(GroupConfig {
            visibility_ms: 400_000,
            ..GroupConfig::default()
        });
        h.append(1);
        h.poll(1);
        h.ack(0).unwrap();
        h.advance(799_999);
        assert!(!h.t.is_idle(h.now));
        // Describing the group does not keep it busy.
        h.describe();
        h.advance(1);
        assert!(h.t.is_idle(h.now) && h.t.can_evict(h.now));
        // Evicted once: nothing more to drop until the group is used again.
        h.t.reset_to_durable();
        assert!(!h.t.can_evict(h.now));
        h.describe();
        h.advance(1_000_000);
        assert!(h.t.is_idle(h.now) && !h.t.can_evict(h.now));
        h.poll(1);
        assert!(!h.t.can_evict(h.now), "just used");
        h.advance(800_000);
        assert!(h.t.can_evict(h.now), "idle again after its request");
    }

    /// Acks drain the index of upcoming deadlines long before the claims
    /// past its horizon lapse; those still lapse exactly on time, in one
    /// tick, and the next deadline is exact again after it.
    #[test]
    fn claims_past_a_drained_deadline_index_lapse_on_time() {
        let mut h = Harness::with(small(|c| c.max_in_flight = 10_000));
        h.append(1_000);
        let first = h.now + 1_000;
        assert_eq!(h.poll(600).len(), 600);
        h.ack(0).unwrap();
        h.advance(100);
        assert_eq!(h.poll(10).len(), 10);
        let second = h.now + 1_000;
        let bound = h.t.next_deadline().unwrap();
        assert!(bound <= first, "{bound} is past the earliest deadline");
        h.advance(first - h.now - 1);
        h.tick();
        assert_eq!(h.describe().in_flight, 609, "nothing lapses early");
        h.advance(1);
        h.tick();
        assert_eq!(h.describe().in_flight, 10, "the first poll's claims lapse");
        assert_eq!(h.t.next_deadline(), Some(second));
        h.advance(second - h.now);
        h.tick();
        assert_eq!(h.describe().in_flight, 0);
        assert_eq!(h.t.next_deadline(), None);
    }

    #[test]
    fn a_claim_costs_at_most_64_bytes() {
        let mut h = Harness::new();
        h.append(10_000);
        for _ in 0..10 {
            h.poll(1_000);
        }
        assert_eq!(h.t.in_flight(), 10_000);
        let per_claim = h.t.slot_table_bytes() as f64 / 10_000.0;
        let total = h.t.memory_bytes() as f64 / 10_000.0;
        println!("slot table {per_claim:.1} B/claim, all memory {total:.1} B/claim");
        assert!(per_claim <= 64.0, "{per_claim} bytes per claim");
        assert!(total <= 64.0, "{total} bytes per claim");
        // Across sizes, including just after the table grows.
        let mut h = Harness::new();
        h.append(20_000);
        let mut worst: f64 = 0.0;
        for _ in 0..200 {
            h.poll(97);
            worst = worst.max(h.t.slot_table_bytes() as f64 / h.t.in_flight() as f64);
        }
        println!("worst slot table {worst:.1} B/claim");
        assert!(worst <= 64.0, "{worst} bytes per claim");
    }

    /// Pages of the dead-letter list: from an offset, in order, capped by
    /// count and by size (never empty while letters remain), discarded ones
    /// left out, and `next` just past the page until the list ends.
    #[test]
    fn dead_letters_are_listed_a_page_at_a_time() {
        let mut h = Harness::new();
        assert!(matches!(
            h.t.dead_letter_page(Offset(0), 10, 1_000, |_| 1),
            Err(GroupError::NotFound(_))
        ));
        h.append(10);
        h.poll(10);
        for o in 0..10 {
            h.dead_letter(o, 1).unwrap();
        }
        h.discard(4).unwrap();
        let listed = |p: &DeadLetterPage| p.letters.iter().map(|(o, _)| o.0).collect::<Vec<_>>();

        let p =
            h.t.dead_letter_page(Offset(0), 3, usize::MAX, |_| 1)
                .unwrap();
        assert_eq!((listed(&p), p.next), (vec![0, 1, 2], Some(Offset(3))));
        let p =
            h.t.dead_letter_page(Offset(3), 3, usize::MAX, |_| 1)
                .unwrap();
        assert_eq!(
            (listed(&p), p.next),
            (vec![3, 5, 6], Some(Offset(7))),
            "the discarded 4 is not listed"
        );
        let p =
            h.t.dead_letter_page(Offset(7), 3, usize::MAX, |_| 1)
                .unwrap();
        assert_eq!((listed(&p), p.next), (vec![7, 8, 9], None), "ends exactly");
        let p =
            h.t.dead_letter_page(Offset(10), 3, usize::MAX, |_| 1)
                .unwrap();
        assert_eq!((listed(&p), p.next), (vec![], None));
        // A `from` between letters starts at the next one.
        let p =
            h.t.dead_letter_page(Offset(4), 1, usize::MAX, |_| 1)
                .unwrap();
        assert_eq!((listed(&p), p.next), (vec![5], Some(Offset(6))));
        // By size: 10 bytes each, 25 allowed: two fit.
        let p = h.t.dead_letter_page(Offset(0), 100, 25, |_| 10).unwrap();
        assert_eq!((listed(&p), p.next), (vec![0, 1], Some(Offset(2))));
        // One letter over the byte budget still comes back alone; a count
        // of 0 is taken as 1.
        let p = h.t.dead_letter_page(Offset(0), 100, 5, |_| 10).unwrap();
        assert_eq!((listed(&p), p.next), (vec![0], Some(Offset(1))));
        let p = h.t.dead_letter_page(Offset(9), 0, 5, |_| 10).unwrap();
        assert_eq!((listed(&p), p.next), (vec![9], None));
        // The whole list in one page matches `dead_letters`.
        let p =
            h.t.dead_letter_page(Offset(0), 100, usize::MAX, |_| 1)
                .unwrap();
        assert_eq!(p.letters, h.t.dead_letters().unwrap());
        assert_eq!(p.next, None);
    }
}

/// Reclaim: a member that restarts takes its records back.
mod reclaim {
    use super::*;

    fn member(connection: u64, reclaim: bool) -> Caller {
        Caller::named(connection, "worker-a", reclaim)
    }

    #[test]
    fn a_reclaiming_poll_takes_back_what_the_member_held() {
        let mut h = Harness::new();
        h.append(6);
        assert_eq!(offsets(&h.poll_as(&member(1, false), 3)), vec![0, 1, 2]);
        assert_eq!(offsets(&h.poll_as(&Caller::anonymous(2), 1)), vec![3]);
        h.advance(100);
        // The restarted member comes back first for its own records, over as
        // many polls as it takes, each one another attempt.
        let d = h.poll_as(&member(3, true), 2);
        assert_eq!((offsets(&d), attempts(&d)), (vec![0, 1], vec![2, 2]));
        // Nobody else gets the reserved one meanwhile.
        assert_eq!(offsets(&h.poll_as(&Caller::anonymous(4), 10)), vec![4, 5]);
        let d = h.poll_as(&member(3, true), 10);
        assert_eq!((offsets(&d), attempts(&d)), (vec![2], vec![2]));
        // The old connection's late ack is still an ack of the record.
        h.ack(2).unwrap();
    }

    /// The old connection's delivery of a record reserved for the newer
    /// one can no longer extend it or hand it back (nobody else may get it
    /// meanwhile, and the newer connection is about to hold it); it can
    /// still finish it.
    #[test]
    fn the_old_delivery_of_a_reserved_record_neither_keeps_nor_returns_it() {
        let mut h = Harness::new();
        h.append(4);
        assert_eq!(offsets(&h.poll_as(&member(1, false), 3)), vec![0, 1, 2]);
        // Takes back 0 now; 1 and 2 are reserved for connection 2.
        assert_eq!(offsets(&h.poll_as(&member(2, true), 1)), vec![0]);
        assert!(matches!(
            h.extend(1, 1, 60_000),
            Err(GroupError::StaleClaim(_))
        ));
        assert!(matches!(h.nack(2, 1, None), Err(GroupError::StaleClaim(_))));
        assert_eq!(offsets(&h.poll_as(&Caller::anonymous(9), 10)), vec![3]);
        // An ack finishes it: the newer connection does not get it.
        h.ack(2).unwrap();
        let d = h.poll_as(&member(2, true), 10);
        assert_eq!((offsets(&d), attempts(&d)), (vec![1], vec![2]));
    }

    #[test]
    fn reserved_records_go_before_owed_ones() {
        let mut h = Harness::with(small(|_| {}));
        h.append(3);
        h.poll_as(&Caller::anonymous(1), 1);
        h.advance(1_000);
        h.tick();
        h.poll_as(&member(2, false), 2); // takes owed 0 and new 1
        h.advance(10);
        let d = h.poll_as(&member(5, true), 10);
        assert_eq!(offsets(&d), vec![0, 1, 2]);
    }

    #[test]
    fn a_lapsed_reserved_claim_goes_to_the_whole_group() {
        let mut h = Harness::with(small(|_| {}));
        h.append(2);
        h.poll_as(&member(1, false), 2);
        h.advance(500);
        assert_eq!(h.poll_as(&member(2, true), 1).len(), 1);
        h.advance(500);
        // 1 was reserved for connection 2 and lapsed: anyone may take it.
        let d = h.poll_as(&Caller::anonymous(7), 10);
        assert_eq!((offsets(&d), attempts(&d)), (vec![1], vec![2]));
    }

    #[test]
    fn only_the_first_reclaim_on_a_newer_connection_counts() {
        let mut h = Harness::new();
        h.append(4);
        h.poll_as(&member(5, false), 1); // 0 held by connection 5
        h.poll_as(&member(3, true), 1); // older connection reclaiming: nothing
        assert_eq!(h.describe().in_flight, 2);
        // Reserves 0 (from 5) and 1 (from 3), and takes 0 back at once.
        assert_eq!(offsets(&h.poll_as(&member(8, true), 1)), vec![0]);
        // Connection 6 is older than the last reclaiming one: takes nothing back.
        assert_eq!(offsets(&h.poll_as(&member(6, true), 10)), vec![2, 3]);
        // Reclaim left set on connection 8 is harmless; 1 is still its own.
        assert_eq!(offsets(&h.poll_as(&member(8, true), 10)), vec![1]);
        assert_eq!(h.describe().in_flight, 4);
    }

    #[test]
    fn member_names_belong_to_their_principal() {
        let mut h = Harness::new();
        h.append(2);
        h.poll_as(&member(1, false), 1);
        let mut other = member(2, true);
        other.principal = "mallory".into();
        assert_eq!(offsets(&h.poll_as(&other, 10)), vec![1]);
    }

    #[test]
    fn a_delayed_nack_is_not_reclaimed() {
        let mut h = Harness::new();
        h.append(2);
        h.poll_as(&member(1, false), 2);
        h.nack(0, 1, Some(60_000)).unwrap();
        let d = h.poll_as(&member(2, true), 10);
        assert_eq!(offsets(&d), vec![1]);
    }

    #[test]
    fn a_reserved_record_at_the_attempt_bound_is_given_up_on() {
        let mut h = Harness::with(small(|c| c.max_attempts = 1));
        h.append(2);
        h.poll_as(&member(1, false), 1);
        let d = h.poll_as(&member(2, true), 10);
        assert_eq!(offsets(&d), vec![1]);
        assert_eq!(h.dead(), vec![0]);
    }

    /// A reserved record on its last attempt is reserved like the others
    /// and never delivered again: until the newer connection's poll
    /// reaches it, the older connection's ack still finishes it; after,
    /// it is a dead letter and that ack changes nothing.
    #[test]
    fn a_reserved_record_on_its_last_attempt_is_acked_or_dead_lettered_never_redelivered() {
        let mut h = Harness::with(small(|c| c.max_attempts = 2));
        h.append(4);
        // Connection 1 holds 0 on its first attempt, 1 and 2 on their last.
        assert_eq!(offsets(&h.poll_as(&member(1, false), 3)), vec![0, 1, 2]);
        h.nack(1, 1, None).unwrap();
        h.nack(2, 1, None).unwrap();
        let d = h.poll_as(&member(1, false), 2);
        assert_eq!((offsets(&d), attempts(&d)), (vec![1, 2], vec![2, 2]));
        // Connection 2 reclaims one record at a time: 0 comes back; 1 and 2
        // stay reserved, still in flight.
        let d = h.poll_as(&member(2, true), 1);
        assert_eq!((offsets(&d), attempts(&d)), (vec![0], vec![2]));
        assert_eq!(h.describe().in_flight, 3);
        assert!(h.dead().is_empty());
        // Before the newer poll reaches it, the older ack finishes 1.
        h.ack(1).unwrap();
        // The next poll reaches 2: a dead letter, not a third delivery.
        let d = h.poll_as(&member(2, true), 10);
        assert_eq!(offsets(&d), vec![3]);
        assert_eq!(h.dead(), vec![2]);
        // The older connection's late ack of 2 is a harmless duplicate.
        h.ack(2).unwrap();
        assert_eq!(h.dead(), vec![2]);
        assert_eq!(h.describe().in_flight, 2);
    }
}

/// Replaying a long snapshot: its pieces wait for the `Snapshot` that
/// closes it, and pieces a crash left without it change nothing.
#[test]
fn a_snapshot_cut_short_by_a_crash_leaves_the_earlier_state() {
    let letter = |o: u64| {
        (
            Offset(o),
            DeadLetter {
                attempts: 5,
                at_ms: 1,
                reason: None,
                by_consumer: false,
                discarded: false,
            },
        )
    };
    let mut full = GroupTracker::new("g", GroupConfig::default());
    full.apply_entry(&GroupEntry::Create {
        group: "g".into(),
        position: Offset(0),
    });
    for o in 0..5 {
        let (offset, info) = letter(o);
        full.apply_entry(&GroupEntry::DeadLetter {
            group: "g".into(),
            offset,
            info,
        });
    }
    full.apply_entry(&GroupEntry::Position {
        group: "g".into(),
        position: Offset(10),
        skipped: 3,
    });
    let state = full.durable().unwrap().clone();
    let entries = state.snapshot("g", 2);
    assert_eq!(
        entries.len(),
        3,
        "pieces [2, 3] and [4], then the head with 0 and 1"
    );

    // Replay with the snapshot complete: the same state.
    let mut t = GroupTracker::new("g", GroupConfig::default());
    for e in &entries {
        t.apply_entry(e);
    }
    assert_eq!(t.durable(), Some(&state));

    // The log before it, then only the pieces (the head was torn off): the
    // earlier state stands; a later entry drops the stray pieces.
    let mut t = GroupTracker::new("g", GroupConfig::default());
    t.apply_entry(&GroupEntry::Create {
        group: "g".into(),
        position: Offset(0),
    });
    let (offset, info) = letter(0);
    t.apply_entry(&GroupEntry::DeadLetter {
        group: "g".into(),
        offset,
        info,
    });
    let before = t.durable().unwrap().clone();
    for e in &entries[..2] {
        t.apply_entry(e);
    }
    assert_eq!(t.durable(), Some(&before));
    t.apply_entry(&GroupEntry::Position {
        group: "g".into(),
        position: Offset(1),
        skipped: 0,
    });
    t.apply_entry(&entries[2]);
    let listed: Vec<u64> = t
        .durable()
        .unwrap()
        .dead_letters()
        .keys()
        .map(|o| o.0)
        .collect();
    assert_eq!(
        listed,
        vec![0, 1],
        "the head alone, the stray pieces dropped"
    );
}

/// Trackers sharing a claim count (one core's groups) stop handing out
/// records at the shared limit, whatever room each group has, and every way
/// a claim ends gives its place back: ack, nack, lapse, rebuild, drop.
#[test]
fn trackers_sharing_a_claim_limit_stop_at_it_and_give_back_every_place() {
    let shared = SharedClaims::new(5);
    let config = small(|c| c.shared_claims = shared.clone());
    let mut a = Harness::with(config.clone());
    let mut b = Harness::with(config);
    a.append(10);
    b.append(10);

    assert_eq!(a.poll_offsets(3), vec![0, 1, 2]);
    let capped = b.poll_full(&Caller::anonymous(1), 10, None);
    assert_eq!(offsets(&capped.deliveries), vec![0, 1], "two places left");
    assert_eq!(shared.held(), 5);
    assert!(shared.full());
    let capped = b.poll_full(&Caller::anonymous(1), 10, None);
    assert!(capped.deliveries.is_empty());
    assert!(capped.capped, "answered empty for the shared limit");
    assert!(!b.t.has_work_for(b.now, &Caller::anonymous(1), b.log()));

    // An ack in one group frees a place for the other, and wakes its waiters.
    let freed = shared.freed();
    a.ack(0).unwrap();
    assert_eq!(shared.held(), 4);
    assert!(futures_lite::future::block_on(futures_lite::future::poll_once(freed)).is_some());
    assert_eq!(b.poll_offsets(10), vec![2]);

    // A nack hands the record back: owed, not held.
    a.nack(1, 1, None).unwrap();
    assert_eq!(shared.held(), 4);
    // A delayed nack holds its place until it ends.
    b.nack(0, 1, Some(60_000)).unwrap();
    assert_eq!(shared.held(), 4);
    // Lapses give places back.
    a.advance(1_000);
    a.tick();
    assert_eq!(shared.held(), 3, "a's claim on 2 lapsed");
    // A tracker rebuilt from the log (a restart, a new leader) holds none,
    // and the one it replaced gave its claims back.
    b.restart();
    assert_eq!(shared.held(), 0);
    assert_eq!(b.poll_offsets(2), vec![0, 1]);
    assert_eq!(a.poll_offsets(10), vec![1, 2, 3], "owed first, then new");
    assert_eq!(shared.held(), 5);
    // A dropped tracker gives back what it held.
    drop(a);
    assert_eq!(shared.held(), 2);
    drop(b);
    assert_eq!(shared.held(), 0);
}

/// A record the broker cannot hand out (`Lookup::GiveUp`: no answer could
/// carry it) is a dead letter at once, new or owed, with the broker's
/// reason and the attempts it had; the poll hands out the records after it,
/// and the position moves past it once they are acked.
#[test]
fn a_record_that_cannot_be_handed_out_is_given_up_at_once() {
    let mut h = Harness::new();
    h.append(4);
    let caller = Caller::anonymous(1);
    let poll = |h: &mut Harness, unsendable: u64| {
        let log = h.log();
        let mut lookup = |o: Offset| {
            if o.0 == unsendable {
                Lookup::GiveUp("too big".to_string())
            } else {
                Lookup::Record { payload_bytes: 1 }
            }
        };
        let out = h.t.poll(h.now, &caller, 10, None, log, &mut lookup);
        h.record(out.writes.clone());
        out.deliveries
    };
    // New: never handed out, so the record after it says one offset below
    // it was settled without delivery (a hole, as for a control record).
    let got = poll(&mut h, 1);
    assert_eq!(offsets(&got), vec![0, 2, 3]);
    let skipped: Vec<u64> = got.iter().map(|d| d.skipped_before).collect();
    assert_eq!(skipped, vec![0, 1, 0]);
    // Owed after a nack: given up with the attempt it had.
    h.nack(2, 1, None).unwrap();
    assert!(poll(&mut h, 2).is_empty());
    let letters = h.t.dead_letters().unwrap();
    let got: Vec<(u64, u32, bool, Option<&str>)> = letters
        .iter()
        .map(|(o, d)| (o.0, d.attempts, d.by_consumer, d.reason.as_deref()))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, 0, false, Some("too big")),
            (2, 1, false, Some("too big"))
        ]
    );
    assert_eq!(h.t.in_flight(), 2);
    h.ack(0).unwrap();
    h.ack(3).unwrap();
    assert_eq!(h.t.position(), Offset(4));
    // A redrive hands it out again once it fits.
    let w = h.t.redrive(h.now, Offset(1), h.log()).unwrap();
    h.record(w);
    assert_eq!(h.poll_offsets(10), vec![1]);
}

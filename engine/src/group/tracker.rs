//! [`GroupTracker`]: the state machine of one group on one shard.

use std::collections::BTreeSet;

use super::entry::{
    self, cut_reason, DeadLetter, DurableGroup, GroupEntry, GROUP_NAME_MAX_BYTES,
    REASON_BUDGET_BYTES,
};
use super::members::{fast_map, FastMap, Members};
use super::slot::{Slot, State, Timers, ATTEMPTS_MAX, TIME_MAX_MS};
use super::{
    Caller, DeadLetterPage, Delivery, GroupConfig, GroupCounters, GroupError, GroupStatus, LogView,
    Lookup, PollOutcome, PollPlan, StartAt,
};
use crate::types::Offset;

/// The consumer-group tracker of one (shard, group). See the module docs.
#[derive(Debug)]
pub struct GroupTracker {
    group: String,
    config: GroupConfig,
    /// `None`: the group does not exist (never created, or deleted).
    durable: Option<DurableGroup>,
    /// Entries were applied from outside: rebuild the memory before use.
    stale: bool,
    /// The next offset not yet handed out or settled since the last rebuild.
    /// Offsets in `[position, frontier)` without a slot are finished.
    frontier: Offset,
    /// Every unfinished offset: `[position, frontier)` ones and the redriven
    /// ones below the position.
    slots: FastMap<Offset, Slot>,
    /// Slots in state `Owed`, in offset order.
    owed: BTreeSet<Offset>,
    /// Slots in state `Reserved`, by (reclaiming holder, offset).
    reserved: BTreeSet<(u32, Offset)>,
    timers: Timers,
    /// Claimed + Reserved + Delayed slots.
    in_flight: u32,
    /// Delayed slots.
    delayed: u32,
    members: Members,
    /// The run of settled, never-delivered offsets that ends at
    /// `skip_run_end` (exclusive) and is `skip_run_len` long.
    skip_run_end: Offset,
    skip_run_len: u64,
    /// `skipped_before` of unfinished records that had one, for redeliveries.
    skipped_below: FastMap<Offset, u64>,
    /// Records whose deliveries a seek voided (at or above the new position,
    /// or redriven), with their attempts, until each goes out again. The
    /// guide has each delivered again from the new position, so the next
    /// delivery counts on from these attempts (a call from before the seek,
    /// named by its attempts, can never match the delivery after it:
    /// `stale_claim`) and is made even at the attempt bound; the bound
    /// applies again after it. Empty except after a seek; a rebuild forgets
    /// it, as it forgets every attempt count.
    carried: FastMap<Offset, u32>,
    /// The `skipped_before` of carried records not handed out since the
    /// seek (no slot), for that delivery: a redelivery says it again.
    carried_skipped: FastMap<Offset, u64>,
    /// `SnapshotDeadLetters` pieces replayed, waiting for their `Snapshot`.
    staged: Vec<(Offset, DeadLetter)>,
    /// No offset at or above this was handed out by this tracker. `None`
    /// after a rebuild: learned (conservatively, as the log end) from the
    /// next `LogView`.
    handed_out_end: Option<Offset>,
    last_active_ms: u64,
    /// Memory holds nothing an eviction would drop: true when new, after
    /// `reset_to_durable`, and until the next request. An idle group is
    /// evicted once per idle period, not on every timer pass.
    at_rest: bool,
    counters: GroupCounters,
}

enum Step {
    Go,
    Stop,
}

/// One poll in progress.
struct PollRun<'a> {
    caller: &'a Caller,
    now_ms: u64,
    /// Deadline of the claims this poll makes.
    deadline: u64,
    log: LogView,
    /// Records this poll may hand out.
    max: usize,
    /// The caller's holder id, once interned (on its first claim).
    holder: Option<u32>,
    bytes: u64,
    out: PollOutcome,
}

impl PollRun<'_> {
    fn full(&self, max_bytes: u64) -> bool {
        self.out.deliveries.len() >= self.max || self.bytes >= max_bytes
    }
}

impl GroupTracker {
    /// A tracker for `group` with no state: replay the group's entries with
    /// [`apply_entry`](Self::apply_entry), or let the first poll or create
    /// make the group.
    pub fn new(group: impl Into<String>, config: GroupConfig) -> GroupTracker {
        let group = group.into();
        assert!(
            !group.is_empty() && group.len() <= GROUP_NAME_MAX_BYTES,
            "group name must be 1 to {GROUP_NAME_MAX_BYTES} bytes"
        );
        GroupTracker {
            group,
            config: config.clamped(),
            durable: None,
            stale: false,
            frontier: Offset(0),
            slots: fast_map(),
            owed: BTreeSet::new(),
            reserved: BTreeSet::new(),
            timers: Timers::new(),
            in_flight: 0,
            delayed: 0,
            members: Members::new(),
            skip_run_end: Offset(0),
            skip_run_len: 0,
            skipped_below: fast_map(),
            carried: fast_map(),
            carried_skipped: fast_map(),
            staged: Vec::new(),
            handed_out_end: None,
            last_active_ms: 0,
            at_rest: true,
            counters: GroupCounters::default(),
        }
    }

    pub fn group(&self) -> &str {
        &self.group
    }

    /// The configuration in force (clamped).
    pub fn config(&self) -> &GroupConfig {
        &self.config
    }

    pub fn exists(&self) -> bool {
        self.durable.is_some()
    }

    /// What the group has done since this tracker was created.
    pub fn counters(&self) -> GroupCounters {
        self.counters
    }

    /// The durable state, `None` if the group does not exist.
    pub fn durable(&self) -> Option<&DurableGroup> {
        self.durable.as_ref()
    }

    /// The group's cursor (0 if it does not exist).
    pub fn position(&self) -> Offset {
        self.durable.as_ref().map_or(Offset(0), |d| d.position())
    }

    /// Standing claims plus delayed nacks, including any past their deadline
    /// that no `tick` has applied yet.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The next offset not handed out or settled since the last rebuild.
    pub fn frontier(&self) -> Offset {
        self.frontier
    }

    pub fn last_active_ms(&self) -> u64 {
        self.last_active_ms
    }

    /// When to call [`tick`](Self::tick) next (and wake polls waiting at the
    /// in-flight cap): the earliest claim or delay deadline, or a moment
    /// before it. `None` with nothing in flight.
    ///
    /// Exact while the due list holds entries. Once acks have drained it, the
    /// deadlines still standing all lie past its horizon, and the horizon is
    /// answered instead of rescanning every claim after each request: a tick
    /// there rescans once and finds the exact next deadline (after a tick
    /// this is always later than the tick's time).
    pub fn next_deadline(&self) -> Option<u64> {
        if self.in_flight == 0 {
            return None;
        }
        Some(
            self.timers
                .next()
                .map_or(self.timers.horizon().0, |(d, _)| d),
        )
    }

    /// Whether a poll by `caller` now could hand something out: records
    /// reserved for it, a deadline that has passed (a `tick` would free room
    /// or owe records), or room under the cap with records owed or past the
    /// frontier. The broker re-polls a waiting poll when this turns true
    /// (after appends, acks, nacks and ticks). A true may still answer empty
    /// when what lies past the frontier is control records.
    pub fn has_work_for(&self, now_ms: u64, caller: &Caller, log: LogView) -> bool {
        let Some(g) = &self.durable else {
            return log.start < log.end;
        };
        if self.stale {
            return g.position() < log.end || !g.redriven().is_empty();
        }
        if self.existing_holder(caller).is_some_and(|me| {
            self.reserved
                .range((me, Offset(0))..)
                .next()
                .is_some_and(|&(h, _)| h == me)
        }) {
            return true;
        }
        if self.next_deadline().is_some_and(|d| d <= now_ms) {
            return true;
        }
        if caller.reclaim && self.would_reclaim(caller) {
            // Taking claims back can hand them out, or give up on them.
            return true;
        }
        !self.at_cap() && (!self.owed.is_empty() || self.frontier.max(log.start) < log.end)
    }

    // ----------------------------------------------------------------- polls

    /// Which offsets the broker should read for this poll, best first:
    /// records reserved for the caller, then owed, then new ones. Applies
    /// lapses and reclaim as the poll would; its writes are lazy.
    pub fn plan_poll(
        &mut self,
        now_ms: u64,
        caller: &Caller,
        max_records: u32,
        log: LogView,
    ) -> PollPlan {
        let mut plan = PollPlan::default();
        self.prepare_poll(now_ms, caller, log, &mut plan.writes);
        let max = self.records_max(max_records);
        if let Some(me) = self.existing_holder(caller) {
            for &(h, o) in self.reserved.range((me, Offset(0))..) {
                if h != me || plan.offsets.len() >= max {
                    break;
                }
                plan.offsets.push(o);
            }
        }
        let mut room = self.config.max_in_flight.saturating_sub(self.in_flight);
        room = room.min(u32::try_from(self.config.shared_claims.room()).unwrap_or(u32::MAX));
        for &o in &self.owed {
            if plan.offsets.len() >= max || room == 0 {
                break;
            }
            plan.offsets.push(o);
            room -= 1;
        }
        let mut o = self.frontier;
        while o < log.end && plan.offsets.len() < max && room > 0 {
            if !self.is_dead_letter(o) {
                plan.offsets.push(o);
                room -= 1;
            }
            o = o.next();
        }
        self.settle_position(&mut plan.writes);
        plan
    }

    /// Hand out records: reserved for this connection first, then owed, then
    /// new ones from the frontier up to `log.end`. Stops at the first
    /// [`Lookup::NotLoaded`], after `max_records` (0: the group's `poll_max_records`; the broker passes at least 1) or
    /// `poll_max_records` deliveries, after the record that reaches
    /// `poll_max_bytes`, and when `max_in_flight` leaves no room.
    /// `visibility_ms` overrides the group's visibility for these claims
    /// (clamped to `[1, max_visibility_ms]`). Writes are lazy.
    pub fn poll(
        &mut self,
        now_ms: u64,
        caller: &Caller,
        max_records: u32,
        visibility_ms: Option<u64>,
        log: LogView,
        lookup: &mut dyn FnMut(Offset) -> Lookup,
    ) -> PollOutcome {
        let mut run = PollRun {
            caller,
            now_ms,
            deadline: 0,
            log,
            max: self.records_max(max_records),
            holder: None,
            bytes: 0,
            out: PollOutcome::default(),
        };
        self.prepare_poll(now_ms, caller, log, &mut run.out.writes);
        let visibility = visibility_ms
            .unwrap_or(self.config.visibility_ms)
            .clamp(1, self.config.max_visibility_ms);
        run.deadline = deadline_at(now_ms, visibility);
        let mut hit_cap = false;
        'poll: {
            // 1. What this connection reclaimed. These are claims already, so
            //    they need no room under the cap.
            if let Some(me) = self.existing_holder(caller) {
                let mut from = Offset(0);
                while let Some(&(h, o)) = self.reserved.range((me, from)..).next() {
                    if h != me {
                        break;
                    }
                    from = o.next();
                    if run.full(self.config.poll_max_bytes) {
                        break 'poll;
                    }
                    if let Step::Stop = self.redeliver(o, &mut run, lookup) {
                        break 'poll;
                    }
                }
            }
            // 2. Owed records, before anything new.
            let mut from = Offset(0);
            while let Some(&o) = self.owed.range(from..).next() {
                from = o.next();
                if run.full(self.config.poll_max_bytes) {
                    break 'poll;
                }
                if self.at_cap() {
                    hit_cap = true;
                    break 'poll;
                }
                if let Step::Stop = self.redeliver(o, &mut run, lookup) {
                    break 'poll;
                }
            }
            // 3. New records from the frontier.
            while self.frontier < log.end {
                if run.full(self.config.poll_max_bytes) {
                    break 'poll;
                }
                let o = self.frontier;
                if self.is_dead_letter(o) {
                    // Given up on before a restart or seek: still finished.
                    self.frontier = o.next();
                    continue;
                }
                if self.at_cap() {
                    hit_cap = true;
                    break 'poll;
                }
                match lookup(o) {
                    Lookup::Record { payload_bytes } => {
                        let (carried, carried_skipped) = self.take_carried(o);
                        // The run the frontier stepped over, or what a voided
                        // delivery of it said (the larger: each counts
                        // settled offsets directly below it).
                        let stepped_over = if self.skip_run_end == o {
                            self.skip_run_len
                        } else {
                            0
                        };
                        let skipped_before = stepped_over.max(carried_skipped);
                        self.frontier = o.next();
                        let attempts = 1 + carried;
                        debug_assert!(attempts <= ATTEMPTS_MAX);
                        let h = self.holder_for(caller, &mut run.holder);
                        self.claim(o, attempts, h, run.deadline, now_ms);
                        if skipped_before > 0 {
                            self.skipped_below.insert(o, skipped_before);
                        }
                        run.out.deliveries.push(Delivery {
                            offset: o,
                            attempts,
                            skipped_before,
                        });
                        self.count_delivery(attempts);
                        run.bytes += payload_bytes as u64;
                    }
                    Lookup::Skipped => {
                        self.frontier = o.next();
                        self.take_carried(o);
                        self.note_skipped(o, o.next());
                        self.settle_redriven_ahead(o, o.next(), &mut run.out.writes);
                    }
                    Lookup::NotLoaded => {
                        run.out.unread = true;
                        break 'poll;
                    }
                    Lookup::GiveUp(why) => {
                        // Never handed out: a hole the next record's
                        // `skipped_before` counts, as for a control record.
                        self.frontier = o.next();
                        let (carried, _) = self.take_carried(o);
                        self.note_skipped(o, o.next());
                        let why = cut_reason(Some(&why));
                        self.give_up(o, carried, now_ms, why, false, &mut run.out.writes);
                    }
                }
            }
        }
        let mut out = run.out;
        self.settle_position(&mut out.writes);
        out.capped = out.deliveries.is_empty() && hit_cap;
        out
    }

    /// Apply lapses and ended delays (dead-lettering at the attempt bound).
    /// Call when [`next_deadline`](Self::next_deadline) passes. Lazy writes.
    pub fn tick(&mut self, now_ms: u64) -> Vec<GroupEntry> {
        check_time(now_ms);
        self.refresh(now_ms);
        let mut w = Vec::new();
        if self.durable.is_some() {
            self.expire(now_ms, &mut w);
            self.settle_position(&mut w);
        }
        w
    }

    // ---------------------------------------------------------- acknowledging

    /// Finish records. Each offset must have been handed out: one in play is
    /// finished (whoever holds it, even past its deadline), one already
    /// finished or below the position is a harmless duplicate. Validated as a
    /// whole before anything changes. Writes: wait before answering.
    pub fn ack(
        &mut self,
        now_ms: u64,
        offsets: &[Offset],
        log: LogView,
    ) -> Result<Vec<GroupEntry>, GroupError> {
        self.begin_record_request(now_ms)?;
        self.observe(log);
        for &o in offsets {
            if o >= log.end {
                return Err(past_tail(o, log));
            }
            if self.voided_by_seek(o) {
                return Err(voided(o));
            }
            if !(self.slots.contains_key(&o) || o < self.frontier || o < self.position()) {
                return Err(self.not_handed_out(o));
            }
        }
        let mut w = Vec::new();
        for &o in offsets {
            if self.slots.contains_key(&o) {
                self.finish(o, &mut w);
                self.counters.acked += 1;
            }
        }
        self.settle_position(&mut w);
        Ok(w)
    }

    /// Hand back the delivery held (named by `attempts`): owed again at once,
    /// or after `delay_ms` (clamped to `max_visibility_ms`; holds an
    /// in-flight place meanwhile). At the attempt bound it becomes a dead
    /// letter instead. Refused with `stale_claim` once the claim lapsed and
    /// the record went out again. Writes: wait before answering.
    pub fn nack(
        &mut self,
        now_ms: u64,
        offset: Offset,
        attempts: u32,
        delay_ms: Option<u64>,
        reason: Option<&str>,
        log: LogView,
    ) -> Result<Vec<GroupEntry>, GroupError> {
        self.begin_record_request(now_ms)?;
        self.observe(log);
        let s = self.held_claim(now_ms, offset, attempts, log)?;
        if s.state() == State::Owed && delay_ms.is_some_and(|d| d > 0) {
            // A delay holds an in-flight place the lapsed claim gave up.
            self.room_to_take_back(offset)?;
        }
        let mut w = Vec::new();
        if s.attempts() >= self.config.max_attempts {
            let why =
                cut_reason(reason).unwrap_or_else(|| format!("nacked at attempt {}", s.attempts()));
            self.give_up(offset, s.attempts(), now_ms, Some(why), false, &mut w);
        } else {
            match delay_ms.filter(|&d| d > 0) {
                Some(d) => {
                    let until = deadline_at(now_ms, d.min(self.config.max_visibility_ms));
                    let slot = Slot::timed(State::Delayed, until, now_ms, s.attempts(), 0);
                    self.transition(offset, Some(slot));
                }
                None => self.transition(offset, Some(Slot::owed(now_ms, s.attempts()))),
            }
        }
        self.settle_position(&mut w);
        Ok(w)
    }

    /// Let the delivery held stand for `extend_ms` from now (clamped to
    /// `[1, max_visibility_ms]`); returns how long it now stands. A claim
    /// that lapsed but whose record has not gone out again is taken back.
    /// Refused with `stale_claim` once the record went out again, or for a
    /// delayed nack (nobody holds it).
    pub fn extend(
        &mut self,
        now_ms: u64,
        offset: Offset,
        attempts: u32,
        extend_ms: u64,
        log: LogView,
    ) -> Result<u64, GroupError> {
        self.begin_record_request(now_ms)?;
        self.observe(log);
        let s = self.held_claim(now_ms, offset, attempts, log)?;
        if s.is_claim() && s.deadline_ms() <= now_ms && s.attempts() >= self.config.max_attempts {
            // Lapsed at the bound: the broker gives up on it at its next
            // look (describe already counts it a dead letter).
            return Err(GroupError::StaleClaim(format!(
                "the claim on offset {offset} lapsed at the attempt bound ({}); the record is being set aside as a dead letter",
                self.config.max_attempts
            )));
        }
        if s.state() == State::Owed {
            self.room_to_take_back(offset)?;
        }
        let stands_ms = extend_ms.clamp(1, self.config.max_visibility_ms);
        // A standing claim stays as it is (a standing reservation was
        // refused above). A lapsed claim not yet given back keeps its
        // holder (a member that reconnects with reclaim still takes it
        // back); a lapsed reservation went to the group, and a record the
        // group owes is nobody's: either is taken back by this delivery's
        // consumer as a plain claim.
        let standing = s.state() != State::Owed && s.deadline_ms() > now_ms;
        let (state, holder) = if standing {
            (s.state(), s.holder())
        } else if s.state() == State::Claimed {
            (State::Claimed, s.holder())
        } else {
            (State::Claimed, 0)
        };
        let slot = Slot::timed(
            state,
            deadline_at(now_ms, stands_ms),
            s.since_ms(),
            s.attempts(),
            holder,
        );
        self.transition(offset, Some(slot));
        Ok(stands_ms)
    }

    /// The consumer gives up on the delivery it holds (named by `attempts`;
    /// also taken while the record waits owed or delayed, as long as it has
    /// not gone out again): listed as a dead letter and finished. Refused
    /// with `invalid_request` for a finished record. Writes: **durable before
    /// answering**.
    pub fn dead_letter(
        &mut self,
        now_ms: u64,
        offset: Offset,
        attempts: u32,
        reason: Option<&str>,
        log: LogView,
    ) -> Result<Vec<GroupEntry>, GroupError> {
        self.begin_record_request(now_ms)?;
        self.observe(log);
        if offset >= log.end {
            return Err(past_tail(offset, log));
        }
        if attempts == 0 {
            return Err(GroupError::InvalidRequest(
                "attempts count from 1".to_string(),
            ));
        }
        if self.voided_by_seek(offset) {
            return Err(voided(offset));
        }
        let Some(&s) = self.slots.get(&offset) else {
            if offset < self.frontier || offset < self.position() {
                return Err(GroupError::InvalidRequest(format!(
                    "offset {offset} is already finished"
                )));
            }
            return Err(self.not_handed_out(offset));
        };
        if s.attempts() != attempts {
            return Err(went_out_again(offset, attempts, s.attempts()));
        }
        let mut w = Vec::new();
        self.give_up(
            offset,
            s.attempts(),
            now_ms,
            cut_reason(reason),
            true,
            &mut w,
        );
        self.settle_position(&mut w);
        Ok(w)
    }

    // ----------------------------------------------------------- dead letters

    /// The group's dead letters, in offset order.
    pub fn dead_letters(&self) -> Result<Vec<(Offset, DeadLetter)>, GroupError> {
        let g = self.durable.as_ref().ok_or_else(|| self.no_group())?;
        Ok(g.listed_dead_letters()
            .map(|(o, d)| (*o, d.clone()))
            .collect())
    }

    /// One page of the group's dead letters: those at `from` and above, in
    /// offset order, at most `max_entries` of them, and only as many as keep
    /// the sum of their `size_of` within `max_bytes` (the first is taken
    /// whatever its size, so a page is never empty while letters remain).
    /// Clones the page only, and looks one letter past it to tell whether
    /// the list goes on.
    pub fn dead_letter_page(
        &self,
        from: Offset,
        max_entries: usize,
        max_bytes: usize,
        size_of: impl Fn(&DeadLetter) -> usize,
    ) -> Result<DeadLetterPage, GroupError> {
        let g = self.durable.as_ref().ok_or_else(|| self.no_group())?;
        let mut page = DeadLetterPage::default();
        let mut bytes = 0usize;
        for (o, d) in g.listed_dead_letters_from(from) {
            let size = size_of(d);
            let full = page.letters.len() >= max_entries.max(1)
                || (!page.letters.is_empty() && bytes.saturating_add(size) > max_bytes);
            if full {
                // `o` is above the last letter taken, so this cannot wrap.
                page.next = page.letters.last().map(|(last, _)| last.next());
                break;
            }
            bytes = bytes.saturating_add(size);
            page.letters.push((*o, d.clone()));
        }
        Ok(page)
    }

    /// Make a dead letter owed again with its attempts reset. Never moves the
    /// cursor back. A dead letter whose record retention removed is refused
    /// (`NotFound`, the letter kept for a discard): there is nothing left to
    /// hand out, and an answered redrive that then settles without a
    /// delivery would tell the operator it was put back. Writes: **durable
    /// before answering**.
    pub fn redrive(
        &mut self,
        now_ms: u64,
        offset: Offset,
        log: LogView,
    ) -> Result<Vec<GroupEntry>, GroupError> {
        self.begin_request(now_ms)?;
        self.require_dead_letter(offset)?;
        if offset < log.start {
            return Err(GroupError::NotFound(format!(
                "the record at offset {offset} is no longer in the log: retention removed \
                 everything below offset {}, so there is nothing to redrive; discard the dead \
                 letter instead",
                log.start
            )));
        }
        let mut w = Vec::new();
        self.write(
            GroupEntry::Redrive {
                group: self.group.clone(),
                offset,
            },
            &mut w,
        );
        let finished_here = offset < self.position()
            || (offset < self.frontier && !self.slots.contains_key(&offset));
        if finished_here {
            self.transition(offset, Some(Slot::owed(now_ms, 0)));
        }
        Ok(w)
    }

    /// Stop tracking a dead letter. Writes: wait before answering.
    pub fn discard(&mut self, now_ms: u64, offset: Offset) -> Result<Vec<GroupEntry>, GroupError> {
        self.begin_request(now_ms)?;
        self.require_dead_letter(offset)?;
        let mut w = Vec::new();
        self.write(
            GroupEntry::Discard {
                group: self.group.clone(),
                offset,
            },
            &mut w,
        );
        Ok(w)
    }

    // ------------------------------------------------------------------ admin

    /// Create the group at `start`; a no-op (no writes) if it exists.
    /// Writes: wait before answering.
    pub fn create(
        &mut self,
        now_ms: u64,
        start: StartAt,
        log: LogView,
    ) -> Result<Vec<GroupEntry>, GroupError> {
        check_time(now_ms);
        self.refresh(now_ms);
        self.touch(now_ms);
        let mut w = Vec::new();
        if self.durable.is_none() {
            let position = resolve(start, log)?;
            self.create_at(position, &mut w);
        }
        self.observe(log);
        Ok(w)
    }

    /// Move the group to `to`, backwards to replay or forwards to skip. Voids
    /// every standing claim and delay; keeps dead letters. A voided record
    /// at or above the new position (or redriven) is delivered again,
    /// counting on from its attempts (see `carried`). Writes: wait before
    /// answering.
    pub fn seek(
        &mut self,
        now_ms: u64,
        to: StartAt,
        log: LogView,
    ) -> Result<Vec<GroupEntry>, GroupError> {
        self.begin_request(now_ms)?;
        self.observe(log);
        let position = resolve(to, log)?;
        let mut voided: Vec<(Offset, u32)> = self
            .slots
            .iter()
            .filter(|(_, s)| s.attempts() > 0)
            .map(|(o, s)| (*o, s.attempts()))
            .chain(self.carried.iter().map(|(o, a)| (*o, *a)))
            .collect();
        voided.sort_unstable();
        // What each voided delivery said lay settled below it: its next
        // delivery, a redelivery of the same record, says it again.
        let skips: FastMap<Offset, u64> = voided
            .iter()
            .filter_map(|(o, _)| {
                let k = self.skipped_below.get(o).or(self.carried_skipped.get(o));
                k.map(|k| (*o, *k))
            })
            .collect();
        let mut w = Vec::new();
        self.write(
            GroupEntry::Seek {
                group: self.group.clone(),
                position,
            },
            &mut w,
        );
        self.rebuild_memory(now_ms);
        for (o, attempts) in voided {
            // A slot now is a redriven record, owed again; any other record
            // below the new position is finished.
            let redriven = self.slots.contains_key(&o);
            if !redriven && o < position {
                continue;
            }
            if attempts >= self.config.max_attempts {
                // Out of attempts, as a claim lapsing at the bound would
                // be: set aside now, never delivered past the bound.
                let why = format!("claim voided by a seek after attempt {attempts}");
                self.give_up(o, attempts, now_ms, Some(why), false, &mut w);
                continue;
            }
            let attempts = attempts.min(ATTEMPTS_MAX - 1);
            if redriven {
                let since = self.slots[&o].since_ms();
                self.transition(o, Some(Slot::owed(since, attempts)));
            }
            self.carried.insert(o, attempts);
            if let Some(&k) = skips.get(&o) {
                if redriven {
                    self.skipped_below.insert(o, k);
                } else {
                    self.carried_skipped.insert(o, k);
                }
            }
        }
        // The record at the new position says it again after a restart
        // too: kept with the position, as the cursor's moves keep it.
        if let Some(&skipped) = self.carried_skipped.get(&position) {
            // A run settled further up from here adds to it.
            self.skip_run_end = position;
            self.skip_run_len = skipped;
            self.write(
                GroupEntry::Position {
                    group: self.group.clone(),
                    position,
                    skipped,
                },
                &mut w,
            );
        }
        Ok(w)
    }

    /// Remove the group: its position, dead letters and all it holds.
    /// Writes: wait before answering.
    pub fn delete(&mut self, now_ms: u64) -> Result<Vec<GroupEntry>, GroupError> {
        self.begin_request(now_ms)?;
        let mut w = Vec::new();
        self.write(
            GroupEntry::Delete {
                group: self.group.clone(),
            },
            &mut w,
        );
        self.rebuild_memory(now_ms);
        Ok(w)
    }

    /// Where the group stands. Claims past their deadline count as owed (or
    /// as dead letters at the attempt bound) even before a `tick`. Looking
    /// is not activity: `last_active_ms` stays the group's last request of
    /// any other kind, and a group only described still goes idle.
    pub fn describe(&mut self, now_ms: u64, log: LogView) -> Result<GroupStatus, GroupError> {
        check_time(now_ms);
        self.refresh(now_ms);
        if self.durable.is_none() {
            return Err(self.no_group());
        }
        self.observe(log);
        let g = self.durable.as_ref().expect("checked above");
        let mut st = GroupStatus {
            position: g.position(),
            frontier: self.frontier,
            log_start: log.start,
            log_end: log.end,
            dead_letters: g.listed_count() as u64,
            last_active_ms: self.last_active_ms,
            ..GroupStatus::default()
        };
        for s in self.slots.values() {
            let lapsed_at = match s.state() {
                State::Owed => Some(s.since_ms()),
                _ if s.deadline_ms() <= now_ms => Some(s.deadline_ms()),
                state => {
                    st.in_flight += 1;
                    if state == State::Delayed {
                        st.delayed += 1;
                    }
                    st.oldest_in_flight_age_ms = st
                        .oldest_in_flight_age_ms
                        .max(now_ms.saturating_sub(s.since_ms()));
                    None
                }
            };
            if let Some(at) = lapsed_at {
                if s.is_claim() && s.attempts() >= self.config.max_attempts {
                    st.dead_letters += 1;
                } else {
                    st.owed += 1;
                    st.oldest_owed_age_ms = st.oldest_owed_age_ms.max(now_ms.saturating_sub(at));
                }
            }
        }
        Ok(st)
    }

    // ------------------------------------------------------ memory lifecycle

    /// Untouched by requests for the effective idle time.
    pub fn is_idle(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.last_active_ms) >= self.config.effective_idle_ms()
    }

    /// Idle, not already evicted since its last request, and no claim or
    /// delayed nack still stands: the broker may drop the in-memory state
    /// (`reset_to_durable`, or drop the tracker and replay).
    pub fn can_evict(&self, now_ms: u64) -> bool {
        !self.at_rest
            && self.is_idle(now_ms)
            && !self
                .slots
                .values()
                .any(|s| s.is_timed() && s.deadline_ms() > now_ms)
    }

    /// Drop everything that is only memory (claims, owed and delayed
    /// records, acks above the position, attempt counts, reservations,
    /// members), as eviction or a restart does. Redriven records stay owed.
    /// Members that reclaimed are kept with their last reclaiming
    /// connection: an idle group's connections may still be open.
    pub fn reset_to_durable(&mut self) {
        self.members.keep_only_reclaims();
        self.rebuild_memory(self.last_active_ms);
        self.handed_out_end = None;
        self.stale = false;
        self.at_rest = true;
    }

    /// Replay one entry from the log (on start). Entries of other groups are
    /// ignored (returns false). The memory is rebuilt from the durable state
    /// before the next request.
    pub fn apply_entry(&mut self, entry: &GroupEntry) -> bool {
        if entry.group() != self.group {
            return false;
        }
        match entry {
            // A long snapshot's pieces wait for the `Snapshot` that closes
            // it: pieces a crash left without it are dropped, and the state
            // written before them stands.
            GroupEntry::SnapshotDeadLetters { letters, .. } => {
                self.staged.extend(letters.iter().cloned());
            }
            GroupEntry::Snapshot { state, .. } => {
                self.durable = Some(state.with_pieces(std::mem::take(&mut self.staged)));
            }
            other => {
                self.staged = Vec::new();
                entry::apply(&mut self.durable, other);
            }
        }
        self.stale = true;
        self.handed_out_end = None;
        true
    }

    /// The whole durable state as entries (one, or a few for a long
    /// dead-letter list), for the start of a new log segment; none if the
    /// group does not exist.
    pub fn snapshot_entries(&self) -> Vec<GroupEntry> {
        self.durable.as_ref().map_or_else(Vec::new, |state| {
            state.snapshot(&self.group, super::entry::SNAPSHOT_DEAD_LETTERS)
        })
    }

    /// Heap bytes held by the in-memory state (estimated from capacities).
    pub fn memory_bytes(&self) -> usize {
        let btree_entry = |key: usize| key * 2 + 8;
        map_bytes::<Offset, Slot>(self.slots.capacity())
            + map_bytes::<Offset, u64>(self.skipped_below.capacity())
            + map_bytes::<Offset, u32>(self.carried.capacity())
            + map_bytes::<Offset, u64>(self.carried_skipped.capacity())
            + self.owed.len() * btree_entry(8)
            + self.reserved.len() * btree_entry(16)
            + self.timers.heap_bytes()
            + self.members.heap_bytes()
    }

    /// Bytes the claim table holds, from its capacity (see the module docs).
    pub fn slot_table_bytes(&self) -> usize {
        map_bytes::<Offset, Slot>(self.slots.capacity())
    }

    /// Check every internal invariant; panics with a message if one fails.
    /// O(claims): for tests and debug builds.
    pub fn check_invariants(&self) {
        if self.stale {
            return;
        }
        let Some(g) = &self.durable else {
            assert!(self.slots.is_empty(), "a missing group has slots");
            assert_eq!(self.in_flight, 0);
            assert!(self.owed.is_empty() && self.reserved.is_empty());
            return;
        };
        let position = g.position();
        // A carried record is either redriven and owed again (below the
        // position) or not handed out since the seek (no slot, at or above
        // the frontier).
        for o in self.carried.keys() {
            match self.slots.get(o) {
                Some(s) => assert!(
                    s.state() == State::Owed && g.redriven().contains(o),
                    "carried {o:?} has slot {s:?}"
                ),
                None => assert!(*o >= self.frontier, "carried {o:?} below the frontier"),
            }
        }
        assert!(
            position <= self.frontier,
            "position {position} passed the frontier {}",
            self.frontier
        );
        assert!(
            position == self.frontier || self.slots.contains_key(&position),
            "position {position} sits on a finished offset below the frontier {}",
            self.frontier
        );
        let below: BTreeSet<Offset> = self
            .slots
            .keys()
            .copied()
            .filter(|&o| o < position)
            .collect();
        assert_eq!(
            &below,
            g.redriven(),
            "slots below the position are not the redriven set"
        );
        // Redriven ahead of the cursor: in play (or not reached yet), never
        // finished.
        for o in g.redriven_ahead() {
            assert!(*o >= position, "redriven ahead {o:?} below the position");
            assert!(
                *o >= self.frontier || self.slots.contains_key(o),
                "redriven ahead {o:?} finished"
            );
            assert!(!g.dead_letters().contains_key(o), "{o:?} redriven and dead");
        }
        let (mut in_flight, mut delayed) = (0u32, 0u32);
        let mut refs: FastMap<u32, u32> = fast_map();
        for (&o, s) in &self.slots {
            assert!(o < self.frontier, "slot {o:?} at or above the frontier");
            assert!(
                !g.dead_letters().contains_key(&o),
                "dead letter {o:?} still has a slot"
            );
            // Past the bound only by a delivery a seek voided (carried, or
            // claimed again since).
            assert!(
                s.attempts() <= self.config.max_attempts
                    || s.is_claim()
                    || self.carried.contains_key(&o),
                "{o:?} has {} attempts",
                s.attempts()
            );
            match s.state() {
                State::Owed => {
                    assert!(self.owed.contains(&o), "owed {o:?} not indexed");
                    assert!(
                        s.attempts() < self.config.max_attempts || self.carried.contains_key(&o),
                        "owed {o:?} at the bound"
                    );
                    assert_eq!(s.holder(), 0);
                }
                state => {
                    in_flight += 1;
                    let key = (s.deadline_ms(), o);
                    assert_eq!(
                        key <= self.timers.horizon(),
                        self.timers.contains(key.0, o),
                        "timer of {o:?} indexed wrongly"
                    );
                    if state == State::Delayed {
                        delayed += 1;
                        assert_eq!(s.holder(), 0, "a delayed slot has a holder");
                    } else {
                        assert!(s.attempts() >= 1, "a claim with no attempts");
                    }
                    if state == State::Reserved {
                        assert!(self.reserved.contains(&(s.holder(), o)));
                    }
                }
            }
            if s.holder() != 0 {
                *refs.entry(s.holder()).or_default() += 1;
            }
        }
        assert_eq!(self.in_flight, in_flight, "in-flight count");
        assert_eq!(self.delayed, delayed, "delayed count");
        assert!(
            self.in_flight <= self.config.max_in_flight,
            "in flight {} over the cap {}",
            self.in_flight,
            self.config.max_in_flight
        );
        assert_eq!(
            self.owed.len(),
            self.slots
                .values()
                .filter(|s| s.state() == State::Owed)
                .count()
        );
        assert_eq!(
            self.reserved.len(),
            self.slots
                .values()
                .filter(|s| s.state() == State::Reserved)
                .count()
        );
        self.timers.check_sorted();
        assert!(
            self.timers.is_empty() || in_flight > 0,
            "due list holds timers with nothing in flight"
        );
        let live: FastMap<u32, u32> = self.members.live_holder_refs().collect();
        assert_eq!(live, refs, "holder references");
        self.members.check();
        for o in self.carried_skipped.keys() {
            assert!(
                self.carried.contains_key(o) && !self.slots.contains_key(o),
                "carried skipped_before for {o:?}, not a carried record without a slot"
            );
        }
        for o in self.skipped_below.keys() {
            assert!(
                self.slots.contains_key(o),
                "skipped_before kept for finished {o:?}"
            );
        }
    }

    /// Every slot as (state letter C/R/D/O, attempts, deadline or 0), for
    /// the simulation's model comparison.
    #[cfg(test)]
    pub(super) fn slot_view(&self) -> std::collections::BTreeMap<u64, (char, u32, u64)> {
        self.slots
            .iter()
            .map(|(o, s)| {
                let (c, t) = match s.state() {
                    State::Claimed => ('C', s.deadline_ms()),
                    State::Reserved => ('R', s.deadline_ms()),
                    State::Delayed => ('D', s.deadline_ms()),
                    State::Owed => ('O', 0),
                };
                (o.0, (c, s.attempts(), t))
            })
            .collect()
    }

    // -------------------------------------------------------------- internals

    fn records_max(&self, max_records: u32) -> usize {
        let cap = self.config.poll_max_records;
        (if max_records == 0 {
            cap
        } else {
            max_records.min(cap)
        }) as usize
    }

    fn touch(&mut self, now_ms: u64) {
        self.last_active_ms = self.last_active_ms.max(now_ms);
        self.at_rest = false;
    }

    /// Rebuild a replayed group's memory now, when its shard opens, rather
    /// than at its first request, which may come much later: its redrives
    /// are owed from `now_ms`.
    pub fn rebuild(&mut self, now_ms: u64) {
        check_time(now_ms);
        self.refresh(now_ms);
    }

    /// Rebuild the memory of a replayed tracker before its first use. Its
    /// redriven records are owed from now: when they were redriven is not
    /// durable, and the start of the epoch would make them look decades old.
    fn refresh(&mut self, now_ms: u64) {
        if self.stale {
            self.stale = false;
            self.rebuild_memory(now_ms);
        }
    }

    /// Common start of a request on an existing group.
    fn begin_request(&mut self, now_ms: u64) -> Result<(), GroupError> {
        check_time(now_ms);
        self.refresh(now_ms);
        self.touch(now_ms);
        if self.durable.is_none() {
            return Err(self.no_group());
        }
        Ok(())
    }

    /// [`begin_request`](Self::begin_request) for a call about a record
    /// the group handed out (ack, nack, extend, dead letter): a group that
    /// does not exist has handed out nothing, so the guide's rule answers,
    /// `invalid_request`, not `not_found`.
    fn begin_record_request(&mut self, now_ms: u64) -> Result<(), GroupError> {
        self.begin_request(now_ms).map_err(|e| match e {
            GroupError::NotFound(_) => GroupError::InvalidRequest(format!(
                "group {} has handed out nothing on this shard (it does not exist; \
                 a group appears on its first poll or group_create)",
                self.group
            )),
            other => other,
        })
    }

    fn no_group(&self) -> GroupError {
        GroupError::NotFound(format!("group {} does not exist", self.group))
    }

    fn require_dead_letter(&self, offset: Offset) -> Result<(), GroupError> {
        let g = self.durable.as_ref().ok_or_else(|| self.no_group())?;
        if g.dead_letters().get(&offset).is_none_or(|d| d.discarded) {
            return Err(GroupError::NotFound(format!(
                "offset {offset} is not a dead letter of group {}",
                self.group
            )));
        }
        Ok(())
    }

    fn is_dead_letter(&self, o: Offset) -> bool {
        self.durable
            .as_ref()
            .is_some_and(|g| g.dead_letters().contains_key(&o))
    }

    /// Learn an upper bound on what was handed out, if it was forgotten.
    fn observe(&mut self, log: LogView) {
        assert!(log.start <= log.end, "log view {log:?} is inverted");
        if self.handed_out_end.is_none() {
            self.handed_out_end = Some(log.end);
        }
    }

    /// Why an untracked offset at or above the frontier cannot be acked.
    fn not_handed_out(&self, o: Offset) -> GroupError {
        let maybe_handed_out = match self.handed_out_end {
            None => true,
            Some(h) => o < h,
        };
        if maybe_handed_out {
            GroupError::StaleClaim(format!(
                "offset {o} may have been handed out before a seek or a restart (which voids \
                 every claim; what went out before a restart is not remembered), so it is \
                 refused as a stale claim; the group owes it again from position {}",
                self.position()
            ))
        } else {
            GroupError::InvalidRequest(format!("offset {o} was never handed out"))
        }
    }

    /// A lapsed claim gave its in-flight place to the group; taking the
    /// record back needs a free one.
    fn room_to_take_back(&self, o: Offset) -> Result<(), GroupError> {
        if self.in_flight >= self.config.max_in_flight {
            return Err(GroupError::StaleClaim(format!(
                "the claim on offset {o} lapsed and the group is at its in-flight cap; \
                 the record stays owed to the group"
            )));
        }
        if self.config.shared_claims.full() {
            return Err(GroupError::StaleClaim(format!(
                "the claim on offset {o} lapsed and the broker holds as many claims as it \
                 allows on this core; the record stays owed to the group"
            )));
        }
        Ok(())
    }

    /// No room for another claim: the group is at its in-flight cap, or the
    /// trackers it shares a claim count with are at their limit.
    fn at_cap(&self) -> bool {
        self.in_flight >= self.config.max_in_flight || self.config.shared_claims.full()
    }

    /// The delivery `attempts` of `o`, if it is still the latest one.
    fn held_claim(
        &self,
        now_ms: u64,
        o: Offset,
        attempts: u32,
        log: LogView,
    ) -> Result<Slot, GroupError> {
        if o >= log.end {
            return Err(past_tail(o, log));
        }
        if attempts == 0 {
            return Err(GroupError::InvalidRequest(
                "attempts count from 1".to_string(),
            ));
        }
        if self.voided_by_seek(o) {
            return Err(voided(o));
        }
        let Some(&s) = self.slots.get(&o) else {
            if o < self.frontier || o < self.position() {
                return Err(GroupError::StaleClaim(format!(
                    "offset {o} is finished or no longer held"
                )));
            }
            return Err(self.not_handed_out(o));
        };
        if s.attempts() != attempts {
            return Err(went_out_again(o, attempts, s.attempts()));
        }
        // The delivery named by `attempts` is still the latest one: its
        // claim stands, or it lapsed and the record waits owed, not yet
        // handed out again (that would have counted another attempt). The
        // guide refuses only once the record has gone out again, which a
        // standing reservation is on its way to: its member's newer
        // connection takes it back next, and nobody else may have it
        // meanwhile, so this delivery can neither keep it nor hand it
        // back. (An ack or a dead letter, which finish it, are taken.)
        match s.state() {
            State::Reserved if s.deadline_ms() > now_ms => Err(GroupError::StaleClaim(format!(
                "offset {o} was taken back by a newer connection of the member that held it \
                 (a poll with reclaim) and goes to that connection next: this delivery no \
                 longer holds it"
            ))),
            State::Claimed | State::Reserved | State::Owed => Ok(s),
            State::Delayed => Err(GroupError::StaleClaim(format!(
                "offset {o} was handed back with a delay; nobody holds it"
            ))),
        }
    }

    fn create_at(&mut self, position: Offset, w: &mut Vec<GroupEntry>) {
        self.write(
            GroupEntry::Create {
                group: self.group.clone(),
                position,
            },
            w,
        );
        // This tracker made the group: nothing at or above `position` went out.
        self.handed_out_end = Some(self.handed_out_end.map_or(position, |h| h.max(position)));
        self.rebuild_memory(self.last_active_ms);
    }

    fn prepare_poll(
        &mut self,
        now_ms: u64,
        caller: &Caller,
        log: LogView,
        w: &mut Vec<GroupEntry>,
    ) {
        check_time(now_ms);
        self.refresh(now_ms);
        self.touch(now_ms);
        if self.durable.is_none() {
            // A group appears at offset 0 on its first poll; whatever
            // retention removed below the log start is skipped.
            self.create_at(Offset(0), w);
        }
        self.observe(log);
        self.expire(now_ms, w);
        self.reclaim(caller);
        // Owed records retention removed: settled, never delivered.
        let removed: Vec<Offset> = self.owed.range(..log.start).copied().collect();
        for o in removed {
            self.finish(o, w);
        }
        if self.frontier < log.start {
            self.note_skipped(self.frontier, log.start);
            self.settle_redriven_ahead(self.frontier, log.start, w);
            self.frontier = log.start;
            if !self.carried.is_empty() {
                self.carried.retain(|o, _| *o >= log.start);
                self.carried_skipped.retain(|o, _| *o >= log.start);
            }
        }
    }

    /// Redriven records ahead of the cursor that the frontier passed in
    /// `[from, to)` without handing them out (retention removed them):
    /// settled, so no longer owed.
    fn settle_redriven_ahead(&mut self, from: Offset, to: Offset, w: &mut Vec<GroupEntry>) {
        let passed: Vec<Offset> = match &self.durable {
            Some(g) => g.redriven_ahead().range(from..to).copied().collect(),
            None => return,
        };
        for offset in passed {
            self.write(
                GroupEntry::RedriveFinished {
                    group: self.group.clone(),
                    offset,
                },
                w,
            );
        }
    }

    /// A seek voided the delivery of `o` and it has not gone out since: the
    /// group owes it, and nothing from before the seek may settle it.
    fn voided_by_seek(&self, o: Offset) -> bool {
        !self.carried.is_empty() && self.carried.contains_key(&o)
    }

    /// Attempts a seek carried for `o` (0 if none), and the
    /// `skipped_before` it carried for a record with no slot (0 if none),
    /// forgotten once used.
    fn take_carried(&mut self, o: Offset) -> (u32, u64) {
        if self.carried.is_empty() {
            (0, 0)
        } else {
            (
                self.carried.remove(&o).unwrap_or(0),
                self.carried_skipped.remove(&o).unwrap_or(0),
            )
        }
    }

    fn note_skipped(&mut self, from: Offset, to: Offset) {
        let n = to.0 - from.0;
        if self.skip_run_end == from {
            self.skip_run_len = self.skip_run_len.saturating_add(n);
        } else {
            self.skip_run_len = n;
        }
        self.skip_run_end = to;
    }

    fn existing_holder(&self, caller: &Caller) -> Option<u32> {
        let member = self
            .members
            .member(&caller.principal, caller.member.as_deref()?)?;
        self.members.holder(member, caller.connection)
    }

    /// Whether a poll by `caller` would reclaim: a named member it knows,
    /// on a connection newer than the member's last reclaiming one.
    fn would_reclaim(&self, caller: &Caller) -> bool {
        let Some(name) = caller.member.as_deref() else {
            return false;
        };
        self.members
            .member(&caller.principal, name)
            .is_some_and(|m| match self.members.last_reclaim(m) {
                None => true,
                Some(last) => caller.connection > last,
            })
    }

    /// The holder id the caller's claims carry (0 for anonymous callers),
    /// interned on first use within a poll.
    fn holder_for(&mut self, caller: &Caller, cache: &mut Option<u32>) -> u32 {
        if let Some(h) = *cache {
            return h;
        }
        let h = match caller.member.as_deref() {
            None => 0,
            Some(name) => {
                let member = self.members.intern_member(&caller.principal, name);
                self.members.intern_holder(member, caller.connection)
            }
        };
        *cache = Some(h);
        h
    }

    /// The first poll with reclaim on a connection newer than the member's
    /// last reclaiming one reserves every claim the member holds from older
    /// connections.
    fn reclaim(&mut self, caller: &Caller) {
        if !caller.reclaim {
            return;
        }
        let Some(name) = caller.member.as_deref() else {
            return;
        };
        let member = self.members.intern_member(&caller.principal, name);
        if self
            .members
            .last_reclaim(member)
            .is_some_and(|last| caller.connection <= last)
        {
            return;
        }
        self.members.set_last_reclaim(member, caller.connection);
        let members = &self.members;
        let mut targets: Vec<Offset> = self
            .slots
            .iter()
            .filter(|(_, s)| {
                s.is_claim() && s.holder() != 0 && {
                    let (m, connection) = members.holder_of(s.holder());
                    m == member && connection < caller.connection
                }
            })
            .map(|(o, _)| *o)
            .collect();
        if targets.is_empty() {
            return;
        }
        targets.sort_unstable();
        let me = self.members.intern_holder(member, caller.connection);
        for o in targets {
            let s = self.slots[&o];
            let slot = Slot::timed(
                State::Reserved,
                s.deadline_ms(),
                s.since_ms(),
                s.attempts(),
                me,
            );
            self.transition(o, Some(slot));
        }
    }

    /// Offer a reserved or owed record again.
    fn redeliver(
        &mut self,
        o: Offset,
        run: &mut PollRun<'_>,
        lookup: &mut dyn FnMut(Offset) -> Lookup,
    ) -> Step {
        let s = self.slots[&o];
        let carried = !self.carried.is_empty() && self.carried.contains_key(&o);
        if s.attempts() >= self.config.max_attempts && !carried {
            self.give_up(
                o,
                s.attempts(),
                run.now_ms,
                Some(format!("out of attempts ({})", s.attempts())),
                false,
                &mut run.out.writes,
            );
            return Step::Go;
        }
        if o < run.log.start {
            self.finish(o, &mut run.out.writes);
            return Step::Go;
        }
        match lookup(o) {
            Lookup::Record { payload_bytes } => {
                let attempts = (s.attempts() + 1).min(ATTEMPTS_MAX);
                self.take_carried(o);
                let h = self.holder_for(run.caller, &mut run.holder);
                self.claim(o, attempts, h, run.deadline, run.now_ms);
                run.out.deliveries.push(Delivery {
                    offset: o,
                    attempts,
                    skipped_before: self.skipped_below.get(&o).copied().unwrap_or(0),
                });
                self.count_delivery(attempts);
                run.bytes += payload_bytes as u64;
                Step::Go
            }
            Lookup::Skipped => {
                self.finish(o, &mut run.out.writes);
                Step::Go
            }
            Lookup::NotLoaded => {
                run.out.unread = true;
                Step::Stop
            }
            Lookup::GiveUp(why) => {
                let why = cut_reason(Some(&why));
                self.give_up(o, s.attempts(), run.now_ms, why, false, &mut run.out.writes);
                Step::Go
            }
        }
    }

    fn claim(&mut self, o: Offset, attempts: u32, holder: u32, deadline: u64, now_ms: u64) {
        self.transition(
            o,
            Some(Slot::timed(
                State::Claimed,
                deadline,
                now_ms,
                attempts,
                holder,
            )),
        );
        let end = o.next();
        self.handed_out_end = Some(self.handed_out_end.map_or(end, |h| h.max(end)));
    }

    /// Lapse claims and end delays whose deadline is at or before `now_ms`.
    fn expire(&mut self, now_ms: u64, w: &mut Vec<GroupEntry>) {
        loop {
            if self.timers.is_empty() && self.in_flight > 0 && self.timers.horizon().0 <= now_ms {
                // Drained, and deadlines past the horizon may be due now.
                self.timers.rebuild(
                    self.slots
                        .iter()
                        .filter(|(_, s)| s.is_timed())
                        .map(|(o, s)| (s.deadline_ms(), *o)),
                );
            }
            let Some((deadline, o)) = self.timers.next() else {
                break;
            };
            if deadline > now_ms {
                break;
            }
            let s = self.slots[&o];
            debug_assert!(s.is_timed() && s.deadline_ms() == deadline);
            if s.attempts() >= self.config.max_attempts {
                // Out of attempts: the broker gives up on it.
                let why = format!("claim lapsed after attempt {}", s.attempts());
                self.give_up(o, s.attempts(), deadline, Some(why), false, w);
            } else {
                self.transition(o, Some(Slot::owed(deadline, s.attempts())));
            }
        }
    }

    fn give_up(
        &mut self,
        o: Offset,
        attempts: u32,
        at_ms: u64,
        reason: Option<String>,
        by_consumer: bool,
        w: &mut Vec<GroupEntry>,
    ) {
        // Past the group's reason budget a dead letter is kept without its
        // reason (decided here, so replay of the entry is exact).
        let kept = self.durable.as_ref().map_or(0, |g| g.reason_bytes());
        let reason = reason.filter(|r| kept + r.len() <= REASON_BUDGET_BYTES);
        self.write(
            GroupEntry::DeadLetter {
                group: self.group.clone(),
                offset: o,
                info: DeadLetter {
                    attempts,
                    at_ms,
                    reason,
                    by_consumer,
                    discarded: false,
                },
            },
            w,
        );
        self.transition(o, None);
        self.counters.dead_lettered += 1;
    }

    fn count_delivery(&mut self, attempts: u32) {
        self.counters.delivered += 1;
        self.counters.redelivered += u64::from(attempts > 1);
    }

    /// The record at `o` is done (acked, or settled without delivery).
    fn finish(&mut self, o: Offset, w: &mut Vec<GroupEntry>) {
        self.transition(o, None);
        // A redriven record, below the cursor or ahead of it (where a seek
        // forward would otherwise keep it owed).
        let redriven = self
            .durable
            .as_ref()
            .is_some_and(|g| g.redriven_ahead().contains(&o));
        if o < self.position() || redriven {
            self.write(
                GroupEntry::RedriveFinished {
                    group: self.group.clone(),
                    offset: o,
                },
                w,
            );
        }
    }

    /// Move the cursor over the finished run above it, writing `Position`.
    fn settle_position(&mut self, w: &mut Vec<GroupEntry>) {
        let Some(g) = &self.durable else { return };
        let p = g.position();
        if p >= self.frontier || self.slots.contains_key(&p) {
            return;
        }
        let window = self.slots.len() - g.redriven().len();
        let next = if window == 0 {
            self.frontier
        } else {
            // Walk while that is cheaper than scanning the slots; each offset
            // is walked over once, so this is amortised O(1) per record.
            let mut q = p.next();
            let mut budget = window;
            loop {
                if q >= self.frontier || self.slots.contains_key(&q) {
                    break q.min(self.frontier);
                }
                if budget == 0 {
                    break self
                        .slots
                        .keys()
                        .copied()
                        .filter(|&o| o > p)
                        .min()
                        .unwrap_or(self.frontier);
                }
                budget -= 1;
                q = q.next();
            }
        };
        // What the record at the new position was (or will be) told lies
        // settled below it, kept with the position so a restart says it
        // again.
        let skipped = if next == self.frontier {
            // Not handed out yet: the run the frontier stepped over, or
            // what a delivery a seek voided said (as that record will be
            // told when it goes out).
            let stepped_over = if self.skip_run_end == next {
                self.skip_run_len
            } else {
                0
            };
            let carried = if self.carried_skipped.is_empty() {
                0
            } else {
                self.carried_skipped.get(&next).copied().unwrap_or(0)
            };
            stepped_over.max(carried)
        } else {
            self.skipped_below.get(&next).copied().unwrap_or(0)
        };
        self.write(
            GroupEntry::Position {
                group: self.group.clone(),
                position: next,
                skipped,
            },
            w,
        );
    }

    /// Change durable state only through an entry, so replay reproduces it.
    fn write(&mut self, entry: GroupEntry, w: &mut Vec<GroupEntry>) {
        entry::apply(&mut self.durable, &entry);
        w.push(entry);
    }

    /// Forget all memory and rebuild it from the durable state: the frontier
    /// at the position, redriven records owed.
    fn rebuild_memory(&mut self, since_ms: u64) {
        self.slots = fast_map();
        self.owed.clear();
        self.reserved.clear();
        self.timers.clear();
        self.config.shared_claims.sub(u64::from(self.in_flight));
        self.in_flight = 0;
        self.delayed = 0;
        self.members.clear_holders();
        self.skipped_below = fast_map();
        self.carried = fast_map();
        self.carried_skipped = fast_map();
        self.staged = Vec::new();
        let position = self.position();
        self.frontier = position;
        // The skips the last position entry recorded below the position:
        // the record there is handed out again with them.
        self.skip_run_end = position;
        self.skip_run_len = self
            .durable
            .as_ref()
            .map_or(0, DurableGroup::position_skipped);
        let redriven: Vec<Offset> = self
            .durable
            .as_ref()
            .map(|g| g.redriven().iter().copied().collect())
            .unwrap_or_default();
        for o in redriven {
            self.transition(o, Some(Slot::owed(since_ms, 0)));
        }
    }

    /// Put `o` in a new state (or finish it), keeping every index in step.
    fn transition(&mut self, o: Offset, new: Option<Slot>) {
        if let Some(n) = new {
            if n.holder() != 0 {
                self.members.acquire(n.holder());
            }
        }
        let old = match new {
            Some(n) => self.slots.insert(o, n),
            None => {
                if !self.carried.is_empty() {
                    self.carried.remove(&o);
                    self.carried_skipped.remove(&o);
                }
                self.slots.remove(&o)
            }
        };
        if let Some(old) = old {
            match old.state() {
                State::Owed => {
                    let was = self.owed.remove(&o);
                    debug_assert!(was, "owed {o:?} was not indexed");
                }
                state => {
                    self.timers.remove(old.deadline_ms(), o);
                    self.in_flight -= 1;
                    self.config.shared_claims.sub(1);
                    if state == State::Delayed {
                        self.delayed -= 1;
                    }
                    if state == State::Reserved {
                        self.reserved.remove(&(old.holder(), o));
                    }
                }
            }
            if old.holder() != 0 {
                self.members.release(old.holder());
            }
        }
        match new {
            Some(n) => match n.state() {
                State::Owed => {
                    self.owed.insert(o);
                }
                state => {
                    if self.in_flight == 0 {
                        // The only timed slot: the due list restarts at it.
                        self.timers.restart(n.deadline_ms(), o);
                    } else {
                        self.timers.insert(n.deadline_ms(), o);
                    }
                    self.in_flight += 1;
                    self.config.shared_claims.add(1);
                    if state == State::Delayed {
                        self.delayed += 1;
                    }
                    if state == State::Reserved {
                        self.reserved.insert((n.holder(), o));
                    }
                }
            },
            None => {
                self.skipped_below.remove(&o);
            }
        }
    }
}

/// What it holds leaves the shared count with it.
impl Drop for GroupTracker {
    fn drop(&mut self) {
        self.config.shared_claims.sub(u64::from(self.in_flight));
    }
}

fn check_time(now_ms: u64) {
    assert!(now_ms <= TIME_MAX_MS, "now_ms {now_ms} is out of range");
}

fn deadline_at(now_ms: u64, span_ms: u64) -> u64 {
    now_ms.saturating_add(span_ms).min(TIME_MAX_MS)
}

fn past_tail(o: Offset, log: LogView) -> GroupError {
    GroupError::InvalidRequest(format!(
        "offset {o} is at or past the tail {}: no record there has been handed out (settling \
         one that does not exist yet would skip it when it is written)",
        log.end
    ))
}

fn voided(o: Offset) -> GroupError {
    GroupError::StaleClaim(format!(
        "the delivery of offset {o} was voided by a seek; the group owes the record again"
    ))
}

fn went_out_again(o: Offset, attempts: u32, now_attempts: u32) -> GroupError {
    GroupError::StaleClaim(format!(
        "delivery {attempts} of offset {o} is no longer held: the record is at attempt {now_attempts}"
    ))
}

fn resolve(start: StartAt, log: LogView) -> Result<Offset, GroupError> {
    match start {
        StartAt::Earliest => Ok(log.start),
        StartAt::Latest => Ok(log.end),
        StartAt::Offset(o) if o >= log.start && o <= log.end => Ok(o),
        StartAt::Offset(o) => Err(GroupError::InvalidRequest(format!(
            "start offset {o} is outside [{}, {}]",
            log.start, log.end
        ))),
    }
}

/// Heap bytes of a std `HashMap` with this capacity (hashbrown layout:
/// buckets of `(K, V)`, one control byte each plus a group's worth).
fn map_bytes<K, V>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        capacity + 1
    } else {
        capacity / 7 * 8
    };
    buckets * std::mem::size_of::<(K, V)>() + buckets + 16
}

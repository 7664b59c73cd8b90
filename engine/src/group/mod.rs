//! The consumer-group tracker: a sans-IO state machine per (shard, group).
//!
//! Normative source: the user guide, *Queues and Consumer Groups*. This module
//! does no I/O, reads no clock and never awaits. Every input is a request plus
//! `now_ms`; every output says what to deliver, what to append to the shard's
//! log (as [`GroupEntry`] records that take no stream offset) and what to
//! answer. The broker keeps one [`GroupTracker`] per (shard, group) on the
//! shard's core.
//!
//! # A record's life
//!
//! ```text
//!   (new) ──── poll ──────────────────────────> Claimed   attempts + 1, for its visibility
//!   Claimed ── extend ────────────────────────> Claimed   same attempts, new deadline
//!   Claimed ── reclaim by a newer connection ─> Reserved  of the same (principal, name)
//!   Reserved ─ poll on that connection ───────> Claimed   attempts + 1, before anything else
//!   Claimed, Reserved ── lapse, or nack ──────> Owed
//!   Claimed ── nack with a delay ─────────────> Delayed ── delay passes ──> Owed
//!   Owed ───── poll ──────────────────────────> Claimed   attempts + 1, before new records
//!   Claimed, Reserved, Delayed, Owed ── ack ──> Finished
//!   any of those ── dead_letter (same attempts) ──────────> DeadLetter
//!   lapse, nack or reclaim of the max_attempts-th delivery ─> DeadLetter
//!   DeadLetter ── redrive ────────────────────> Owed      attempts 0, cursor unmoved
//!   DeadLetter ── discard ────────────────────> untracked
//!   seek, restart, eviction: every slot is dropped; redriven records below
//!   the position are Owed (those at or above it are reached from the position)
//! ```
//!
//! Finished and dead-lettered records have no slot; everything else has one.
//!
//! * One slot per unfinished offset: a record is held by at most one claim.
//! * `Owed` records go out before new ones; records reserved for a reclaiming
//!   connection go to that connection before anything else.
//! * `Claimed`, `Reserved` and `Delayed` count under `max_in_flight`; `Owed`
//!   does not (a lapse or a nack frees room), and neither do finished records.
//! * The position (the cursor) is the lowest unfinished offset at or above the
//!   old position: it passes only a contiguous run of finished offsets (acked,
//!   dead-lettered, skipped by the log, removed by retention). Records below it
//!   are finished, except redriven ones, which the durable state lists.
//! * A listed dead letter at or above the position is finished: the frontier
//!   settles it without delivering it (after a restart or a seek backwards),
//!   until it is redriven.
//!
//! # Durability
//!
//! Durable state ([`DurableGroup`]) is the position (with how many offsets
//! directly below it were settled without delivery), the dead-letter list and
//! the redriven offsets not yet finished (below the position, and ahead of
//! it, so that a seek forward past one keeps it owed). The tracker changes it
//! *only* by applying the entries it hands back, so replaying the written
//! entries (after the latest [`GroupEntry::Snapshot`]) rebuilds it exactly.
//! Entries must be appended in the order returned, and the broker waits for
//! durability as follows:
//!
//! | call | entries | wait for durability before answering? |
//! | --- | --- | --- |
//! | `plan_poll`, `poll`, `tick` | `Create` (implicit), `Position`, `DeadLetter` (attempt bound), `RedriveFinished` | no: append, answer at once; losing them only redelivers |
//! | `ack`, `nack` | `Position`, `RedriveFinished`, `DeadLetter` (bound) | yes (the guide: group writes are acknowledged once durable on the leader) |
//! | `dead_letter`, `redrive` | `DeadLetter` / `Redrive`, then `Position` | **yes, required** by the guide |
//! | `discard`, `create`, `delete` | one entry each | yes |
//! | `seek` | `Seek`, then `DeadLetter` for voided deliveries at the bound, then `Position` when the record at the new position carries a skip count | yes |
//!
//! Because the log is ordered, a `DeadLetter` always precedes the `Position`
//! that passes it: no replica holds a position without the dead letters
//! written before it. Claims, owed and delayed records, acks above the
//! position, attempt counts and reservations are memory: a restart or an
//! eviction ([`GroupTracker::reset_to_durable`]) redelivers them from the
//! position, as the guide says. Write [`GroupTracker::snapshot_entries`] at the
//! start of each new log segment so retention never removes group state.
//!
//! # Time
//!
//! Lapses and delay ends are applied by `plan_poll`, `poll` and `tick`; call
//! `tick` when [`GroupTracker::next_deadline`] passes (that is also when a
//! poll waiting at the in-flight cap may be woken). That time may come a
//! little early (see Memory) and a tick then applies nothing. Other calls look at the
//! deadlines directly, so a claim past its deadline counts as lapsed
//! everywhere even before a `tick` applies it.
//!
//! # Memory
//!
//! Each unfinished offset costs one 16-byte slot in a hash map keyed by
//! offset: 24 bytes a bucket plus a control byte. Measured from the table's
//! capacity (test `a_claim_costs_at_most_64_bytes`): 41 bytes per claim at
//! 10,000 claims (16,384 buckets), at most 57 bytes just after the table
//! grows. Finished offsets cost nothing, however far the position lags.
//! Deadlines need no per-claim memory: a list holds the next 256 due timers
//! (plus any set earlier than its horizon). Acks drain it all the time; a
//! drained list answers its horizon as the next deadline (all others lie
//! past it) and is rebuilt by a scan only when that time comes, not after
//! every ack that empties it. Member names are interned once per member; a claim carries a
//! 24-bit holder id. [`GroupTracker::memory_bytes`] reports the total.

mod entry;
mod members;
mod slot;
mod tracker;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

pub use entry::{
    DeadLetter, DurableGroup, GroupEntry, GroupEntryError, ENTRY_VERSION, GROUP_NAME_MAX_BYTES,
    REASON_MAX_BYTES,
};
pub use tracker::GroupTracker;

use crate::notify::WaitList;
use crate::types::Offset;
use std::cell::Cell;
use std::fmt;
use std::rc::Rc;

/// Tunables of a group, named after the guide's variables. Build with
/// `GroupConfig::default()` and override; [`GroupTracker::new`] clamps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    /// FELIX_GROUP_VISIBILITY_TIMEOUT_MS: how long a claim stands.
    pub visibility_ms: u64,
    /// FELIX_GROUP_MAX_ATTEMPTS: deliveries before a record is dead-lettered
    /// (clamped to 1..=65535).
    pub max_attempts: u32,
    /// FELIX_GROUP_MAX_IN_FLIGHT: claims plus delayed nacks at once.
    pub max_in_flight: u32,
    /// FELIX_GROUP_MAX_VISIBILITY_MS: cap on a poll's visibility, an
    /// extension and a nack delay; never below `visibility_ms`.
    pub max_visibility_ms: u64,
    /// Records one poll hands out at most.
    pub poll_max_records: u32,
    /// Payload bytes after which a poll stops (after the record crossing it).
    pub poll_max_bytes: u64,
    /// Idle time before the in-memory state may be dropped; the effective
    /// value is `max(idle_ms, 2 * visibility_ms)`.
    pub idle_ms: u64,
    /// The claims this tracker holds counted together with others' (one
    /// core's), against a limit they share. The default is a count of its
    /// own with no limit.
    pub shared_claims: SharedClaims,
}

/// Claims and delayed nacks held by many trackers together, against one
/// limit: a core's, so that memory for claims is bounded per core and not
/// only per group. Clones share the count. Each tracker counts its own
/// changes as they happen (and gives back what it holds when dropped or
/// rebuilt), so the count is exact, not sampled. Not `Send`: one core's.
#[derive(Clone)]
pub struct SharedClaims(Rc<SharedInner>);

struct SharedInner {
    held: Cell<u64>,
    limit: u64,
    /// Polls waiting for room under the limit, woken when a release takes
    /// the count below it.
    room: WaitList,
}

impl SharedClaims {
    /// A count starting at 0, full at `limit`.
    pub fn new(limit: u64) -> SharedClaims {
        SharedClaims(Rc::new(SharedInner {
            held: Cell::new(0),
            limit,
            room: WaitList::new(),
        }))
    }

    /// Claims and delayed nacks held now, across every tracker counting here.
    pub fn held(&self) -> u64 {
        self.0.held.get()
    }

    pub fn limit(&self) -> u64 {
        self.0.limit
    }

    /// No room for one more claim.
    pub fn full(&self) -> bool {
        self.held() >= self.0.limit
    }

    /// Claims that may still be taken.
    pub fn room(&self) -> u64 {
        self.0.limit.saturating_sub(self.held())
    }

    /// Resolves when a release next takes the count below the limit (a
    /// poll waiting at the limit waits on this as well as on its shard).
    pub fn freed(&self) -> crate::notify::Wait<'_> {
        self.0.room.wait()
    }

    pub(crate) fn add(&self, n: u64) {
        self.0.held.set(self.0.held.get() + n);
    }

    pub(crate) fn sub(&self, n: u64) {
        let was = self.0.held.get();
        debug_assert!(was >= n, "claims released that were not counted");
        let now = was.saturating_sub(n);
        self.0.held.set(now);
        if was >= self.0.limit && now < self.0.limit {
            self.0.room.wake_all();
        }
    }
}

impl Default for SharedClaims {
    fn default() -> Self {
        SharedClaims::new(u64::MAX)
    }
}

impl fmt::Debug for SharedClaims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedClaims({} of {})", self.held(), self.0.limit)
    }
}

/// Two configurations are the same when they count claims in the same place.
impl PartialEq for SharedClaims {
    fn eq(&self, other: &Self) -> bool {
        Rc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SharedClaims {}

/// Most claims plus delays a group may hold: claims carry a 24-bit holder id
/// (one more holder than this can be interned by a reclaiming poll at the
/// cap).
pub const MAX_IN_FLIGHT_LIMIT: u32 = slot::HOLDER_MAX - 1;
/// Longest visibility, extension or delay a claim can hold (about 49 days).
pub const MAX_VISIBILITY_LIMIT_MS: u64 = slot::SPAN_MAX_MS;
/// Most attempts a record can be counted.
pub const MAX_ATTEMPTS_LIMIT: u32 = u16::MAX as u32;

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            visibility_ms: 30_000,
            max_attempts: 5,
            max_in_flight: 10_000,
            max_visibility_ms: 43_200_000,
            poll_max_records: 1_000,
            poll_max_bytes: 4 << 20,
            idle_ms: 600_000,
            shared_claims: SharedClaims::default(),
        }
    }
}

impl GroupConfig {
    /// The configuration the tracker actually runs with.
    pub fn clamped(&self) -> GroupConfig {
        let visibility_ms = self.visibility_ms.clamp(1, slot::SPAN_MAX_MS);
        GroupConfig {
            visibility_ms,
            max_attempts: self.max_attempts.clamp(1, u16::MAX as u32),
            max_in_flight: self.max_in_flight.clamp(1, MAX_IN_FLIGHT_LIMIT),
            max_visibility_ms: self
                .max_visibility_ms
                .clamp(visibility_ms, slot::SPAN_MAX_MS.max(visibility_ms)),
            poll_max_records: self.poll_max_records.max(1),
            poll_max_bytes: self.poll_max_bytes.max(1),
            idle_ms: self.idle_ms,
            shared_claims: self.shared_claims.clone(),
        }
    }

    /// How long a group must be untouched before it counts as idle.
    pub fn effective_idle_ms(&self) -> u64 {
        self.idle_ms.max(self.visibility_ms.saturating_mul(2))
    }
}

/// Who is asking: the connection a request came on and an optional member
/// name. Names are scoped to the authenticated principal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The authenticated principal ("anonymous" on a broker without
    /// authentication).
    /// Shared with the connection (no copy per request).
    pub principal: std::sync::Arc<str>,
    /// Unique per connection, increasing with each new connection.
    pub connection: u64,
    /// A stable consumer name (1 to 128 bytes, checked by the wire layer).
    pub member: Option<String>,
    /// Take back what this member holds from older connections.
    pub reclaim: bool,
}

impl Caller {
    /// An unnamed consumer on `connection`.
    pub fn anonymous(connection: u64) -> Caller {
        Caller {
            principal: "anonymous".into(),
            connection,
            member: None,
            reclaim: false,
        }
    }

    /// A named consumer of the anonymous principal.
    pub fn named(connection: u64, member: &str, reclaim: bool) -> Caller {
        Caller {
            principal: "anonymous".into(),
            connection,
            member: Some(member.to_string()),
            reclaim,
        }
    }
}

/// The shard's log as the tracker needs to see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogView {
    /// Oldest offset retention still holds.
    pub start: Offset,
    /// Committed tail, exclusive.
    pub end: Offset,
}

impl LogView {
    pub fn new(start: u64, end: u64) -> LogView {
        LogView {
            start: Offset(start),
            end: Offset(end),
        }
    }
}

/// How a looked-up offset turned out, filled in by the broker from the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// A data record of this many payload bytes.
    Record { payload_bytes: u32 },
    /// A control record (generation start) or a record retention removed:
    /// settled, never delivered.
    Skipped,
    /// The broker did not read it: the poll stops here.
    NotLoaded,
    /// The broker cannot hand it out at all (no answer could carry it: it
    /// was written under a larger frame cap than the broker has now). The
    /// group gives up on it at once, a dead letter with this reason, rather
    /// than stop at it for ever; a redrive hands it out again once it fits.
    GiveUp(String),
}

/// Where a group starts (create) or moves to (seek).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartAt {
    /// The oldest offset the shard still holds.
    Earliest,
    /// The shard's committed tail.
    Latest,
    /// An offset in `[log start, log end]`.
    Offset(Offset),
}

/// Offsets worth reading for a poll, best first. A hint only: `poll`
/// re-decides against the state it finds then.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PollPlan {
    pub offsets: Vec<Offset>,
    /// Entries to append (lazily, see the durability table).
    pub writes: Vec<GroupEntry>,
}

/// One record handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub offset: Offset,
    /// Counting this delivery: 1 is a first attempt.
    pub attempts: u32,
    /// Offsets directly below this one that were settled and never delivered.
    pub skipped_before: u64,
}

/// What a poll decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PollOutcome {
    /// In the order they should be sent.
    pub deliveries: Vec<Delivery>,
    /// Entries to append (lazily, see the durability table).
    pub writes: Vec<GroupEntry>,
    /// The group was at `max_in_flight` with work waiting, so nothing could
    /// be handed out (`felix_group_polls_capped_total`).
    pub capped: bool,
    /// The poll stopped at a record that was not looked up for it: the plan
    /// it was read for went stale (another poll on the group took the
    /// planned records while they were being read). With no deliveries the
    /// caller plans and reads again at once rather than answering empty or
    /// waiting while records are there.
    pub unread: bool,
}

/// What a group has done since its tracker was created (the broker started,
/// or the group was first used): plain counters for metrics, kept across
/// evictions, not durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupCounters {
    /// Records handed out, redeliveries included.
    pub delivered: u64,
    /// Of those, handed out again (attempt 2 or later).
    pub redelivered: u64,
    /// Records finished by an ack (duplicates not counted).
    pub acked: u64,
    /// Records set aside as dead letters, by the broker or a consumer.
    pub dead_lettered: u64,
}

/// Where a group stands (`group_describe`). Counts are the leader's memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupStatus {
    pub position: Offset,
    /// The next offset never handed out since the last restart or seek.
    pub frontier: Offset,
    pub log_start: Offset,
    pub log_end: Offset,
    /// Standing claims plus delayed nacks (what `max_in_flight` caps).
    pub in_flight: u32,
    /// Of `in_flight`, the delayed nacks.
    pub delayed: u32,
    /// Handed out, unfinished, waiting for the next poll.
    pub owed: u64,
    pub dead_letters: u64,
    /// Longest a standing claim or delay has stood, 0 if none.
    pub oldest_in_flight_age_ms: u64,
    /// Longest a record has been owed, 0 if none.
    pub oldest_owed_age_ms: u64,
    pub last_active_ms: u64,
}

impl GroupStatus {
    /// Records between the position and the tail, leaving out those
    /// retention removed (settled, never delivered).
    pub fn lag(&self) -> u64 {
        self.log_end
            .0
            .saturating_sub(self.position.0.max(self.log_start.0))
    }
}

/// One page of a group's dead-letter list
/// ([`GroupTracker::dead_letter_page`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterPage {
    /// In offset order.
    pub letters: Vec<(Offset, DeadLetter)>,
    /// Where the following page starts (just past the last letter here);
    /// `None` when no listed dead letter lies beyond this page.
    pub next: Option<Offset>,
}

/// Why a group request was refused. Maps 1:1 to the wire codes
/// `invalid_request`, `stale_claim` and `not_found`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("stale claim: {0}")]
    StaleClaim(String),
    #[error("not found: {0}")]
    NotFound(String),
}

impl GroupError {
    /// The wire error code.
    pub fn code(&self) -> &'static str {
        match self {
            GroupError::InvalidRequest(_) => "invalid_request",
            GroupError::StaleClaim(_) => "stale_claim",
            GroupError::NotFound(_) => "not_found",
        }
    }
}

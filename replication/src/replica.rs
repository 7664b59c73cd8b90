//! One replica of one shard: raft-rs's `RawNode` with Felix's rules around
//! it, and no I/O of its own.
//!
//! The owner (the shard's core, or the simulation) feeds it ticks and peer
//! messages and takes out what to send and what happened: entries applied
//! in order, proposals acknowledged or superseded, reads answered or
//! refused. Rules it adds to Raft:
//!
//! * offsets are stamped by the leader when it proposes, from the end of its
//!   own log; every replica checks each entry starts where the log before
//!   it ends, so replicas agree on every record's offset;
//! * a new leader's empty entry is the shard's generation-start record (one
//!   offset, never delivered);
//! * a leader takes proposals and reads only once it has applied its own
//!   generation start, so it knows everything committed before it (group
//!   state included: the position and the dead letters written before it
//!   arrive together, in log order);
//! * a proposal is acknowledged once committed (on a majority) and applied
//!   here; one overwritten by a newer leader is reported superseded, never
//!   acknowledged;
//! * a read is answered only after a majority confirmed, after the read was
//!   asked, that this replica still leads (raft-rs's `ReadIndex` in its safe
//!   mode), and only from state that includes everything committed before;
//!   a deposed leader refuses instead of answering from stale state.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use felix_engine::format::{self, AppendRecord};
use felix_engine::group::GroupEntry;
use felix_engine::Offset;
use raft::eraftpb::{Entry, HardState, Message, MessageType};
use raft::{Config, RawNode, ReadOnlyOption, StateRole};

use crate::entry::{follows, info_of, inspect, EntryError, EntryKind};
use crate::log::{Compacted, ReplicaLog};
use crate::wire::PEER_MESSAGE_TYPES;

/// Terms, indices and commits from a peer at or past this are refused.
pub const NUMBER_LIMIT: u64 = 1 << 62;
/// A peer's term more than this past a replica's own is refused.
pub const TERM_JUMP_LIMIT: u64 = 1 << 32;

/// A replica's part in its group, as [`Replica::status`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Leads, with its generation start applied: takes proposals and reads.
    Leader,
    /// Elected, still applying its generation start: refuses for now.
    Elected,
    /// Follows the leader it names.
    Follower,
    /// Knows of no leader: an election is on, or no majority is reachable.
    Electing,
    /// Stopped after an error it cannot go past.
    Stopped,
}

/// What a replica knows of its group, for operators (`felix shard
/// describe` on a cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaStatus {
    pub role: Role,
    pub term: u64,
    /// Who leads, as far as this replica knows.
    pub leader: Option<u64>,
    /// Highest index this replica knows committed.
    pub commit: u64,
    /// Highest index applied here (written to the shard's log).
    pub applied: u64,
    /// Last index in this replica's log.
    pub last_index: u64,
    /// The log's compaction point: entries up to it are gone.
    pub compacted: u64,
    /// Why it stopped, if it did ([`Role::Stopped`]).
    pub stopped: Option<String>,
    /// On a leader, every other voter with the highest index it is known
    /// to hold; empty elsewhere.
    pub peers: Vec<(u64, u64)>,
}

/// How a replica runs. Ticks are the owner's clock: one call to
/// [`Replica::tick`] each.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    /// This replica's id (non-zero), one of `voters`.
    pub id: u64,
    /// Ticks without word from a leader before standing for election: a
    /// fresh draw from `[min, max)` each time.
    pub election_ticks: (usize, usize),
    /// Ticks between a leader's heartbeats.
    pub heartbeat_ticks: usize,
    /// Ticks a read may wait for a majority to confirm the leader.
    pub read_timeout_ticks: u64,
    /// Most entry bytes in one append message to a peer.
    pub max_append_bytes: u64,
    /// Most append messages in flight to one peer.
    pub max_inflight_appends: usize,
    /// The owner persists entries and hard state itself, told by
    /// [`Event::Persist`], and reports with [`Replica::persisted`]; until
    /// then nothing that depends on them (an append's acknowledgement, a
    /// vote) is sent. Off: [`Replica::drain`] keeps them in the log at once.
    pub async_persist: bool,
    /// With `async_persist`: keep a second copy of the log as far as the
    /// owner reported it durable, for [`Replica::into_log`] to give back as
    /// a crash would leave it (the simulation's disk). An owner with a real
    /// disk leaves it off: the copy would double the replica's memory.
    pub keep_durable_copy: bool,
}

impl ReplicaConfig {
    pub fn new(id: u64) -> ReplicaConfig {
        ReplicaConfig {
            id,
            election_ticks: (10, 20),
            heartbeat_ticks: 2,
            read_timeout_ticks: 20,
            max_append_bytes: 1 << 20,
            max_inflight_appends: 256,
            async_persist: false,
            keep_durable_copy: false,
        }
    }
}

/// Why a replica refused or gave up on something.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplicationError {
    /// Only the leader takes writes and reads; `leader` is who leads as far
    /// as this replica knows.
    #[error("not the shard's leader (leader: {leader:?})")]
    NotLeader { leader: Option<u64> },
    /// This replica was just elected and has not yet applied its own
    /// generation start, so it may not know all that was committed.
    #[error("the new leader is not ready yet")]
    NotReady,
    /// A newer leader wrote another entry where this proposal was: it was
    /// never committed and never will be (safe to send again).
    #[error("the proposal was superseded by a newer leader's entry")]
    Superseded,
    /// Bytes from a peer that are not a valid entry, or a message this
    /// replica does not take.
    #[error("refused from a peer: {0}")]
    Refused(String),
    /// A read was not confirmed in time (no majority answered): whether
    /// this replica still leads is not known.
    #[error("leadership was not confirmed in time")]
    Timeout,
    /// This replica's own log broke a rule; it has stopped. A proposal
    /// settled with this may still be committed by the other replicas: its
    /// outcome is unknown, and sending it again may write it twice.
    #[error("replica stopped: {0}")]
    Stopped(String),
}

impl From<EntryError> for ReplicationError {
    fn from(e: EntryError) -> Self {
        ReplicationError::Refused(e.to_string())
    }
}

/// Where an acknowledged proposal landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Landed {
    pub index: u64,
    pub term: u64,
    /// First offset (for group entries: the log's end when written).
    pub base: Offset,
    /// One past the last offset it took.
    pub end: Offset,
}

/// An entry applied on this replica (every replica applies the same ones,
/// in the same order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub index: u64,
    pub term: u64,
    pub kind: EntryKind,
    pub base: Offset,
    pub end: Offset,
    /// The batch bytes (empty for a generation start).
    pub data: Bytes,
    /// Proposed by this replica (as leader, in this life of the replica):
    /// an owner that applied the proposal's effects when it made it knows
    /// not to apply them twice.
    pub local: bool,
}

/// What the owner learns from [`Replica::drain`].
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The next committed entry.
    Applied(Applied),
    /// A proposal made here was committed and applied, or superseded.
    Acked {
        token: u64,
        result: Result<Landed, ReplicationError>,
    },
    /// A read may be answered from state through `applied` (or is refused).
    Read {
        token: u64,
        result: Result<u64, ReplicationError>,
    },
    /// Who leads changed (as this replica sees it).
    Leader { leader: Option<u64>, term: u64 },
    /// With `async_persist`: make these entries (replacing any at the same
    /// indices and after) and this hard state durable, then call
    /// [`Replica::persisted`] with `number` (in order).
    Persist {
        number: u64,
        entries: Vec<Entry>,
        hard_state: Option<HardState>,
    },
}

/// A ready's writes waiting for the owner to make them durable.
struct Unpersisted {
    number: u64,
    entries: Vec<Entry>,
    hard_state: Option<HardState>,
    messages: Vec<Message>,
}

struct PendingRead {
    token: u64,
    ctx: u64,
    asked_tick: u64,
    /// The commit index the leader confirmed for it.
    index: Option<u64>,
}

/// One replica of a shard.
pub struct Replica {
    node: RawNode<ReplicaLog>,
    config: ReplicaConfig,
    /// Proposals made here, by (index, term), waiting to be applied.
    waiting: BTreeMap<(u64, u64), u64>,
    reads: Vec<PendingRead>,
    next_ctx: u64,
    ticks: u64,
    applied: u64,
    applied_term: u64,
    applied_end: u64,
    leader: Option<u64>,
    /// The log's last (index, term) and offset end, as last computed.
    tail: Option<(u64, u64, u64)>,
    stopped: Option<String>,
    unpersisted: VecDeque<Unpersisted>,
    /// With `async_persist`, the log as far as the owner has reported it
    /// durable: what [`Replica::into_log`] gives back (a crash loses the
    /// rest). A durable host keeps its own copy on disk instead.
    durable: ReplicaLog,
    /// An index every voter's log is known to hold (durably): a leader's
    /// own count of its followers' matched entries, or what a leader said
    /// ([`Replica::note_compact_hint`]). Nothing at or below it is ever sent
    /// to a replica again, so [`Replica::compact`] may drop it once applied.
    held_by_all: u64,
}

impl Replica {
    /// Start a replica over `log` (empty, or kept from before a restart).
    /// Committed entries are applied again from the first: the owner
    /// rebuilds its state from the `Applied` events. Proposals a replica
    /// was waiting on when it stopped are not settled by the new one: their
    /// outcome is unknown (they may have been committed).
    pub fn open(config: ReplicaConfig, log: ReplicaLog) -> Result<Replica, ReplicationError> {
        let raft_config = Config {
            id: config.id,
            election_tick: config.election_ticks.0,
            min_election_tick: config.election_ticks.0,
            max_election_tick: config.election_ticks.1,
            heartbeat_tick: config.heartbeat_ticks,
            max_size_per_msg: config.max_append_bytes,
            max_inflight_msgs: config.max_inflight_appends,
            check_quorum: true,
            pre_vote: true,
            read_only_option: ReadOnlyOption::Safe,
            applied: 0,
            ..Config::default()
        };
        raft_config
            .validate()
            .map_err(|e| ReplicationError::Stopped(format!("configuration: {e}")))?;
        if !log.voters().contains(&config.id) {
            return Err(ReplicationError::Stopped(format!(
                "replica {} is not one of the shard's voters {:?}",
                config.id,
                log.voters()
            )));
        }
        let durable = if config.async_persist && config.keep_durable_copy {
            log.clone()
        } else {
            ReplicaLog::new(log.voters())
        };
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        // A compacted log starts applied at its compaction point.
        let base = log.compacted();
        let node = RawNode::new(&raft_config, log, &logger)
            .map_err(|e| ReplicationError::Stopped(e.to_string()))?;
        Ok(Replica {
            node,
            config,
            waiting: BTreeMap::new(),
            reads: Vec::new(),
            next_ctx: 1,
            ticks: 0,
            applied: base.index,
            applied_term: base.term,
            applied_end: base.end,
            leader: None,
            tail: None,
            stopped: None,
            unpersisted: VecDeque::new(),
            durable,
            held_by_all: base.index,
        })
    }

    /// Give up the replica, keeping its log as a crash would: everything
    /// (without `async_persist`), or what the owner reported durable (with
    /// `keep_durable_copy`; without it, the whole log, durable or not).
    pub fn into_log(self) -> ReplicaLog {
        if self.config.async_persist && self.config.keep_durable_copy {
            return self.durable;
        }
        let RawNode { raft, .. } = self.node;
        raft.r.raft_log.store
    }

    pub fn id(&self) -> u64 {
        self.config.id
    }

    pub fn log(&self) -> &ReplicaLog {
        self.node.store()
    }

    pub fn term(&self) -> u64 {
        self.node.raft.term
    }

    pub fn is_leader(&self) -> bool {
        self.node.raft.state == StateRole::Leader
    }

    /// Who leads, as far as this replica knows.
    pub fn leader(&self) -> Option<u64> {
        match self.node.raft.leader_id {
            0 => None,
            id => Some(id),
        }
    }

    /// What this replica knows of its group, for an operator: see
    /// [`ReplicaStatus`].
    pub fn status(&self) -> ReplicaStatus {
        let raft = &self.node.raft;
        let role = if self.stopped.is_some() {
            Role::Stopped
        } else if self.is_leader() {
            if self.serving() {
                Role::Leader
            } else {
                Role::Elected
            }
        } else if self.leader().is_some() {
            Role::Follower
        } else {
            Role::Electing
        };
        let peers = if self.is_leader() {
            self.node
                .store()
                .voters()
                .iter()
                .filter(|id| **id != self.config.id)
                .map(|id| (*id, raft.prs().get(*id).map_or(0, |p| p.matched)))
                .collect()
        } else {
            Vec::new()
        };
        ReplicaStatus {
            role,
            term: self.term(),
            leader: self.leader(),
            commit: raft.raft_log.committed,
            applied: self.applied,
            last_index: raft.raft_log.last_index(),
            compacted: self.log().compacted().index,
            stopped: self.stopped.clone(),
            peers,
        }
    }

    /// Index of the last entry applied here.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The offset after the last entry applied here: the shard's committed
    /// end as this replica knows it.
    pub fn applied_end(&self) -> Offset {
        Offset(self.applied_end)
    }

    /// Leader, and has applied its own generation start: it takes
    /// proposals and reads.
    pub fn serving(&self) -> bool {
        self.refuse_unless_serving().is_ok()
    }

    fn refuse_unless_serving(&self) -> Result<(), ReplicationError> {
        if let Some(why) = &self.stopped {
            return Err(ReplicationError::Stopped(why.clone()));
        }
        if !self.is_leader() {
            return Err(ReplicationError::NotLeader {
                leader: self.leader(),
            });
        }
        if self.applied_term != self.term() {
            return Err(ReplicationError::NotReady);
        }
        Ok(())
    }

    /// An index every voter of the shard holds, as far as this replica
    /// knows: a leader counts its followers' acknowledged entries (its own
    /// included); a follower has it from its leader. It only grows, and
    /// stays true whoever leads later: an entry acknowledged durable is
    /// never taken back from a log. Sent to followers with every message
    /// (the host does it), so each compacts its own log in step.
    pub fn compact_hint(&mut self) -> u64 {
        if self.stopped.is_none() && self.is_leader() {
            let raft = &self.node.raft;
            let voters = self.node.store().voters();
            let matched = voters
                .iter()
                .map(|id| raft.prs().get(*id).map_or(0, |p| p.matched))
                .min()
                .unwrap_or(0);
            self.held_by_all = self.held_by_all.max(matched);
        }
        self.held_by_all
    }

    /// A leader's [`Replica::compact_hint`], from a message it sent.
    pub fn note_compact_hint(&mut self, hint: u64) {
        self.held_by_all = self.held_by_all.max(hint);
    }

    /// Drop the entries up to `upto` from memory, or fewer: never past what
    /// every voter holds (no replica will be sent them again) nor past
    /// what is applied here. The owner calls it once the entries it has
    /// applied are durable in its own state (the shard log), then compacts
    /// its journal to the point returned (`None`: nothing to drop).
    pub fn compact(&mut self, upto: u64) -> Option<Compacted> {
        if self.stopped.is_some() {
            return None;
        }
        let to = upto.min(self.applied).min(self.held_by_all);
        if self.config.keep_durable_copy {
            // What is applied is durable (raft-rs applies only persisted
            // entries), so the copy holds it.
            self.durable.compact(to);
        }
        self.node.mut_store().compact(to)
    }

    /// Entries [`Replica::compact`] would drop now.
    pub fn compactable(&self) -> u64 {
        let to = self.applied.min(self.held_by_all);
        to.saturating_sub(self.log().compacted().index)
    }

    /// Entries held in memory (the log past its compaction point).
    pub fn log_len(&self) -> usize {
        self.node.store().len()
    }

    /// Tell Raft a message to `peer` may have been lost (its connection
    /// failed or its queue overflowed): the leader goes back to probing it
    /// instead of waiting on a window of appends that never arrived.
    pub fn report_unreachable(&mut self, peer: u64) {
        if self.stopped.is_none() {
            self.node.report_unreachable(peer);
        }
    }

    /// One tick of the owner's clock.
    pub fn tick(&mut self) {
        self.ticks += 1;
        if self.stopped.is_none() {
            self.node.tick();
        }
    }

    /// A message from a peer. raft-rs trusts what it steps (some malformed
    /// messages make it panic), so everything a peer could get wrong is
    /// checked here first, and a message that fails is dropped whole:
    /// sender and recipient, the message types replicas exchange, append
    /// entries contiguous after the index they follow with terms in order,
    /// each one whole batch of its term starting where the log before it
    /// ends, and heartbeats that commit no further than this log reaches.
    ///
    /// Raft does not defend against a peer that lies (a false append
    /// response can make a leader commit what no majority holds): peers
    /// must be authenticated brokers of the cluster.
    pub fn step(&mut self, mut msg: Message) -> Result<(), ReplicationError> {
        if let Some(why) = &self.stopped {
            return Err(ReplicationError::Stopped(why.clone()));
        }
        let me = self.config.id;
        if msg.to != me || msg.from == me || !self.log().voters().contains(&msg.from) {
            return Err(ReplicationError::Refused(format!(
                "message from {} to {} reached replica {me}",
                msg.from, msg.to
            )));
        }
        // No honest group gets near 2^62 terms or entries; numbers past
        // that only overflow raft-rs's arithmetic.
        let fields = [
            msg.term,
            msg.log_term,
            msg.index,
            msg.commit,
            msg.commit_term,
            msg.reject_hint,
        ];
        let entries = msg.get_entries().iter().flat_map(|e| [e.index, e.term]);
        if let Some(v) = fields
            .into_iter()
            .chain(entries)
            .find(|&v| v >= NUMBER_LIMIT)
        {
            return Err(ReplicationError::Refused(format!(
                "{:?} from {} carries {v}, past any term or index",
                msg.get_msg_type(),
                msg.from
            )));
        }
        // A term far ahead of this replica's can only be inflation by a
        // forger (which would leave the group unable to elect past the
        // limit above); honest terms move one election at a time.
        if msg.term > self.term().saturating_add(TERM_JUMP_LIMIT) {
            return Err(ReplicationError::Refused(format!(
                "term {} is implausibly far past this replica's {}",
                msg.term,
                self.term()
            )));
        }
        // Election priorities are not used (an honest peer sends 0); a
        // negative one makes raft-rs answer a term-0 vote and panic.
        if msg.priority != 0 {
            return Err(ReplicationError::Refused(format!(
                "election priority {} (not used)",
                msg.priority
            )));
        }
        if msg.request_snapshot != 0 {
            return Err(ReplicationError::Refused(
                "snapshots are not supported yet".into(),
            ));
        }
        // raft-rs takes a message of term 0 as its owner's own (and some of
        // them make it panic); every message a peer sends carries its term.
        if msg.term == 0 {
            return Err(ReplicationError::Refused(format!(
                "{:?} from {} carries no term",
                msg.get_msg_type(),
                msg.from
            )));
        }
        let kind = msg.get_msg_type();
        // Snapshots are not supported yet, leadership transfer and
        // forwarded reads are never used, and the rest are the owner's own.
        if !PEER_MESSAGE_TYPES.contains(&kind) {
            return Err(ReplicationError::Refused(format!(
                "{kind:?} is not taken from a peer"
            )));
        }
        match kind {
            MessageType::MsgAppend => self.check_append(&msg)?,
            MessageType::MsgHeartbeat => {
                // An honest leader commits no further than it knows this
                // log matches; raft-rs panics on more. Clamped rather than
                // refused, so the heartbeat still resets the election timer
                // and names the leader.
                let last = self.node.raft.raft_log.last_index();
                msg.commit = msg.commit.min(last);
            }
            MessageType::MsgAppendResponse => {
                let last = self.node.raft.raft_log.last_index();
                if !msg.reject && msg.index > last {
                    return Err(ReplicationError::Refused(format!(
                        "append response acknowledges index {} past this log's last, {last}",
                        msg.index
                    )));
                }
            }
            // A campaign marked as a leadership transfer skips the check
            // that a leader is still heard from; transfers are never used.
            MessageType::MsgRequestVote | MessageType::MsgRequestPreVote
                if &msg.context[..] == raft::CAMPAIGN_TRANSFER =>
            {
                return Err(ReplicationError::Refused(
                    "a campaign claiming a leadership transfer".into(),
                ));
            }
            _ => {}
        }
        if kind != MessageType::MsgAppend && !msg.get_entries().is_empty() {
            return Err(ReplicationError::Refused(format!(
                "{kind:?} carries entries"
            )));
        }
        self.node
            .step(msg)
            .map_err(|e| ReplicationError::Refused(e.to_string()))
    }

    fn check_append(&self, msg: &Message) -> Result<(), ReplicationError> {
        let refuse = |why: String| Err(ReplicationError::Refused(why));
        // raft-rs takes the term of an index past the log as 0, so an
        // append "following" such an index at term 0 would match and make
        // it panic. Only index 0 has term 0.
        if msg.log_term == 0 && msg.index != 0 {
            return refuse(format!("append follows index {} at term 0", msg.index));
        }
        let mut prev_term = msg.log_term;
        for (k, e) in msg.get_entries().iter().enumerate() {
            if Some(e.index) != msg.index.checked_add(1 + k as u64) {
                return refuse(format!(
                    "append after index {} carries entry {} in place {k}",
                    msg.index, e.index
                ));
            }
            if e.term < prev_term.max(1) || e.term > msg.term {
                return refuse(format!(
                    "entry {} has term {} after term {prev_term} in a term-{} append",
                    e.index, e.term, msg.term
                ));
            }
            prev_term = e.term;
            inspect(e)?;
        }
        // Where this replica holds the entry the append follows (else Raft
        // refuses the append itself), every entry must start where the log
        // before it ends: refused here, never taken and then found wrong
        // (checked above, so the headers are enough).
        let raft_log = &self.node.raft.raft_log;
        if raft_log.term(msg.index).ok() == Some(msg.log_term) {
            if let Some(mut end) = self.end_at(msg.index) {
                for e in msg.get_entries() {
                    end = follows(e.index, &info_of(e), end)?;
                }
            }
        }
        Ok(())
    }

    /// The offset after the entry at `index` in this replica's log, stable
    /// or not yet persisted (`None` if the log does not reach it).
    fn end_at(&self, index: u64) -> Option<u64> {
        let unstable = &self.node.raft.raft_log.unstable;
        if unstable.entries.is_empty() || index < unstable.offset {
            return self.node.store().end_after(index);
        }
        let upto = (index - unstable.offset + 1) as usize;
        let before = self.node.store().end_after(unstable.offset - 1)?;
        let taken = unstable.entries.get(..upto)?;
        Some(before + taken.iter().map(|e| info_of(e).offsets).sum::<u64>())
    }

    /// The offset after the last entry of this replica's log, committed or
    /// not: where the next proposal starts.
    fn log_end(&mut self) -> u64 {
        let raft_log = &self.node.raft.raft_log;
        let (last, last_term) = (raft_log.last_index(), raft_log.last_term());
        if let Some((i, t, end)) = self.tail {
            if (i, t) == (last, last_term) {
                return end;
            }
        }
        let end = self.end_at(last).expect("the log reaches its last entry");
        self.tail = Some((last, last_term, end));
        end
    }

    /// Propose one batch of records. `token` comes back in the
    /// [`Event::Acked`] that settles it.
    pub fn propose_records<I>(&mut self, token: u64, records: I) -> Result<Landed, ReplicationError>
    where
        I: IntoIterator + Clone,
        I::Item: AppendRecord,
    {
        self.refuse_unless_serving()?;
        let checked = format::check_records(records.clone()).map_err(ReplicationError::Refused)?;
        if checked.count == 0 {
            return Err(ReplicationError::Refused(
                "a batch needs at least one record".into(),
            ));
        }
        let base = self.log_end();
        let term = self.term();
        let mut data = Vec::new();
        let h =
            format::encode_checked_records(&mut data, checked.len, Offset(base), term, 0, records);
        debug_assert_eq!(h.record_count as usize, checked.count);
        self.propose(token, data, base, base + checked.count as u64)
    }

    /// Propose a group's state changes (one request's writes) as one entry.
    pub fn propose_group(
        &mut self,
        token: u64,
        entries: &[GroupEntry],
    ) -> Result<Landed, ReplicationError> {
        self.refuse_unless_serving()?;
        if entries.is_empty() {
            return Err(ReplicationError::Refused("no group entries".into()));
        }
        let base = self.log_end();
        let term = self.term();
        let mut data = Vec::new();
        let mut body = Vec::new();
        for e in entries {
            body.clear();
            e.encode(&mut body);
            if format::BATCH_HEADER_BYTES + body.len() > format::BATCH_MAX_BYTES as usize {
                return Err(ReplicationError::Refused(format!(
                    "a group entry of {} bytes is over the batch limit",
                    body.len()
                )));
            }
            format::encode_group(&mut data, Offset(base), term, 0, &body);
        }
        self.propose(token, data, base, base)
    }

    fn propose(
        &mut self,
        token: u64,
        data: Vec<u8>,
        base: u64,
        end: u64,
    ) -> Result<Landed, ReplicationError> {
        let before = self.node.raft.raft_log.last_index();
        self.node.propose(Vec::new(), data).map_err(|e| match e {
            raft::Error::ProposalDropped => ReplicationError::NotLeader {
                leader: self.leader(),
            },
            other => ReplicationError::Refused(other.to_string()),
        })?;
        let index = self.node.raft.raft_log.last_index();
        debug_assert_eq!(index, before + 1);
        let term = self.term();
        self.tail = Some((index, term, end));
        self.waiting.insert((index, term), token);
        Ok(Landed {
            index,
            term,
            base: Offset(base),
            end: Offset(end),
        })
    }

    /// Ask for a read: answered with an [`Event::Read`] once a majority
    /// confirmed, after it was asked, that this replica still leads, and
    /// this replica has applied everything committed at that point. It is
    /// settled `NotLeader` if leadership is lost first, `Timeout` if no
    /// majority confirms within `read_timeout_ticks`.
    pub fn read(&mut self, token: u64) -> Result<(), ReplicationError> {
        self.refuse_unless_serving()?;
        let ctx = self.next_ctx;
        self.next_ctx += 1;
        self.node.read_index(ctx.to_le_bytes().to_vec());
        self.reads.push(PendingRead {
            token,
            ctx,
            asked_tick: self.ticks,
            index: None,
        });
        Ok(())
    }

    /// Take what raft-rs has ready: `out` gets the messages to send (each
    /// names its peer in `to`), `events` what happened, in order.
    pub fn drain(&mut self, out: &mut Vec<Message>, events: &mut Vec<Event>) {
        if self.stopped.is_none() && self.node.has_ready() {
            if let Err(why) = self.handle_ready(out, events) {
                self.stop(why, events);
            }
        }
        self.settle_reads(events);
    }

    fn handle_ready(
        &mut self,
        out: &mut Vec<Message>,
        events: &mut Vec<Event>,
    ) -> Result<(), String> {
        let mut rd = self.node.ready();
        if let Some(ss) = rd.ss() {
            let leader = match ss.leader_id {
                0 => None,
                id => Some(id),
            };
            let leads = ss.raft_state == StateRole::Leader;
            if leader != self.leader {
                self.leader = leader;
                events.push(Event::Leader {
                    leader,
                    term: self.node.raft.term,
                });
            }
            if !leads {
                for r in self.reads.drain(..) {
                    events.push(Event::Read {
                        token: r.token,
                        result: Err(ReplicationError::NotLeader { leader }),
                    });
                }
            }
        }
        out.extend(rd.take_messages());
        if !rd.snapshot().is_empty() {
            return Err("a snapshot arrived, and snapshots are not supported yet".into());
        }
        let committed = rd.take_committed_entries();
        self.apply(committed, events)?;
        for rs in rd.take_read_states() {
            let ctx = <[u8; 8]>::try_from(&rs.request_ctx[..])
                .map(u64::from_le_bytes)
                .unwrap_or(0);
            if let Some(r) = self.reads.iter_mut().find(|r| r.ctx == ctx) {
                r.index = Some(rs.index);
            }
        }
        // raft-rs reads what a ready appends from the log at once (with
        // `async_persist` too: it is the write cache then).
        self.node
            .mut_store()
            .append(rd.entries())
            .map_err(|e| e.to_string())?;
        if let Some(hs) = rd.hs() {
            self.node.mut_store().set_hard_state(hs.clone());
        }
        if self.config.async_persist {
            // The owner makes the entries and hard state durable, then
            // calls `persisted`; what depends on them waits until then.
            let number = rd.number();
            let entries = rd.take_entries();
            let hard_state = rd.hs().cloned();
            let messages = rd.take_persisted_messages();
            self.node.advance_append_async(rd);
            self.node.advance_apply_to(self.applied);
            let nothing = entries.is_empty() && hard_state.is_none() && messages.is_empty();
            if nothing && self.unpersisted.is_empty() {
                self.node.on_persist_ready(number);
            } else if nothing {
                // Reporting it persisted now would report the writes of
                // the readies before it too: it waits its turn.
                self.unpersisted.push_back(Unpersisted {
                    number,
                    entries,
                    hard_state,
                    messages,
                });
            } else {
                events.push(Event::Persist {
                    number,
                    entries: entries.clone(),
                    hard_state: hard_state.clone(),
                });
                self.unpersisted.push_back(Unpersisted {
                    number,
                    entries,
                    hard_state,
                    messages,
                });
            }
            return Ok(());
        }
        out.extend(rd.take_persisted_messages());
        let mut light = self.node.advance(rd);
        if let Some(commit) = light.commit_index() {
            self.node.mut_store().set_commit(commit);
        }
        out.extend(light.take_messages());
        self.apply(light.take_committed_entries(), events)?;
        self.node.advance_apply();
        Ok(())
    }

    /// The owner has made durable what every [`Event::Persist`] up to
    /// `number` asked for: it is kept in the log now, and the messages
    /// that had to wait for it go into `out`.
    pub fn persisted(&mut self, number: u64, out: &mut Vec<Message>, events: &mut Vec<Event>) {
        if self.stopped.is_some() {
            return;
        }
        let mut done = number;
        // Readies up to `number`, and any with nothing to write right after.
        while let Some(u) = self.unpersisted.front() {
            let empty = u.entries.is_empty() && u.hard_state.is_none() && u.messages.is_empty();
            if u.number > done && !empty {
                break;
            }
            done = done.max(u.number);
            let u = self.unpersisted.pop_front().expect("checked");
            if self.config.keep_durable_copy {
                // Checked when they went into the log: cannot fail here.
                if let Err(e) = self.durable.append(&u.entries) {
                    self.stop(e.to_string(), events);
                    return;
                }
                if let Some(hs) = u.hard_state {
                    self.durable.set_hard_state(hs);
                }
            }
            out.extend(u.messages);
        }
        self.node.on_persist_ready(done);
    }

    fn apply(&mut self, entries: Vec<Entry>, events: &mut Vec<Event>) -> Result<(), String> {
        for e in entries {
            if e.index != self.applied + 1 {
                return Err(format!(
                    "entry {} committed after {}",
                    e.index, self.applied
                ));
            }
            let end = self
                .node
                .store()
                .end_after(e.index)
                .ok_or_else(|| format!("committed entry {} is not in the log", e.index))?;
            let base = self.applied_end;
            let kind = info_of(&e).kind;
            self.applied = e.index;
            self.applied_term = e.term;
            self.applied_end = end;
            events.push(Event::Applied(Applied {
                index: e.index,
                term: e.term,
                kind,
                base: Offset(base),
                end: Offset(end),
                data: e.data.clone(),
                local: self.waiting.contains_key(&(e.index, e.term)),
            }));
            // Every proposal at or below this index is settled now: the one
            // of this entry's term landed, any other was overwritten.
            while let Some((&(index, term), &token)) = self.waiting.first_key_value() {
                if index > e.index {
                    break;
                }
                self.waiting.pop_first();
                let result = if (index, term) == (e.index, e.term) {
                    Ok(Landed {
                        index,
                        term,
                        base: Offset(base),
                        end: Offset(end),
                    })
                } else {
                    Err(ReplicationError::Superseded)
                };
                events.push(Event::Acked { token, result });
            }
        }
        Ok(())
    }

    fn settle_reads(&mut self, events: &mut Vec<Event>) {
        let (applied, ticks, timeout) = (self.applied, self.ticks, self.config.read_timeout_ticks);
        let mut i = 0;
        while i < self.reads.len() {
            let r = &self.reads[i];
            let result = match r.index {
                Some(index) if index <= applied => Some(Ok(applied)),
                // Confirmed: waits for this replica to apply that far.
                Some(_) => None,
                None if ticks.saturating_sub(r.asked_tick) > timeout => {
                    Some(Err(ReplicationError::Timeout))
                }
                None => None,
            };
            match result {
                Some(result) => {
                    let token = self.reads.swap_remove(i).token;
                    events.push(Event::Read { token, result });
                }
                None => i += 1,
            }
        }
    }

    /// Stop the replica from outside (its owner could not make its writes
    /// durable): every waiting proposal and read fails with `why`, and the
    /// replica takes nothing more.
    pub fn fail(&mut self, why: String, events: &mut Vec<Event>) {
        if self.stopped.is_none() {
            self.stop(why, events);
        }
    }

    /// Why the replica stopped, if it did.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    fn stop(&mut self, why: String, events: &mut Vec<Event>) {
        for r in self.reads.drain(..) {
            events.push(Event::Read {
                token: r.token,
                result: Err(ReplicationError::Stopped(why.clone())),
            });
        }
        for (_, token) in std::mem::take(&mut self.waiting) {
            events.push(Event::Acked {
                token,
                result: Err(ReplicationError::Stopped(why.clone())),
            });
        }
        self.stopped = Some(why);
    }
}

//! Consumer-group requests, served on the shard's owning core.
//!
//! The tracker ([`felix_engine::group`]) decides; this module does its I/O:
//! it reads the records a poll wants from the shard's log, appends the group
//! entries the tracker returns (in order, taking no stream offset) and waits
//! for them to be durable where the guide requires it before answering.
//! Nothing here takes a lock or leaves the core.

use crate::acl::Perm;
use crate::broker::{now_ms, wire_err, Core};
use crate::conn::{answer_size, records_room, to_wire_record, with_timeout, AnswerRoom, ConnInfo};
use crate::shard::Shard;
use felix_engine::format::Record;
use felix_engine::group::{
    Caller, DeadLetter, GroupEntry, GroupError, GroupTracker, LogView, Lookup, StartAt,
};
use felix_engine::log::{Frontier, Lsn, ReadLimits};
use felix_engine::storage::Storage;
use felix_engine::types::validate_name;
use felix_engine::Offset;
use felix_wire::{
    DeadLetterInfo, ErrorCode, GroupInfo, GroupKey, GroupMemberRef, GroupRecord, Request, Response,
    StartPosition,
};
use std::cell::Cell;
use std::rc::Rc;

/// A tracker's refusal as the wire carries it; what was not found is named
/// with its stream and shard (the tracker knows only its group).
fn group_err<S: Storage>(e: GroupError, shard: &Shard<S>) -> Response {
    match e {
        GroupError::InvalidRequest(m) => wire_err(ErrorCode::InvalidRequest, m),
        GroupError::StaleClaim(m) => wire_err(ErrorCode::StaleClaim, m),
        GroupError::NotFound(m) => wire_err(
            ErrorCode::NotFound,
            format!("{m} on {} shard {}", shard.stream, shard.index),
        ),
    }
}

/// A dead letter as the wire carries it.
fn dead_letter_info(o: Offset, d: DeadLetter) -> DeadLetterInfo {
    DeadLetterInfo {
        offset: o.0,
        attempts: d.attempts,
        at_ms: d.at_ms,
        reason: d.reason,
        by_consumer: d.by_consumer,
    }
}

/// Bytes a dead letter takes in an answer.
fn dead_letter_size(d: &DeadLetter) -> usize {
    DeadLetterInfo::wire_size(d.reason.as_deref())
}

/// Frame bytes counted in `len` that are not a message body: the header
/// after the length field.
const FRAME_OVERHEAD: usize = felix_wire::FRAME_HEADER_BYTES - 4;

fn start_at(p: StartPosition) -> StartAt {
    match p {
        StartPosition::Earliest => StartAt::Earliest,
        StartPosition::Latest => StartAt::Latest,
        StartPosition::Offset(n) => StartAt::Offset(Offset(n)),
    }
}

pub(crate) async fn handle<S: Storage>(
    core: &Rc<Core<S>>,
    info: &Rc<ConnInfo>,
    room: &AnswerRoom,
    req: Request,
) -> Response {
    let name = req.name();
    let key = match &req {
        Request::GroupPoll { key, .. }
        | Request::GroupAck { key, .. }
        | Request::GroupNack { key, .. }
        | Request::GroupExtend { key, .. }
        | Request::GroupDeadLetter { key, .. }
        | Request::GroupDeadLetters { key }
        | Request::GroupDeadLettersPage { key, .. }
        | Request::GroupRedrive { key, .. }
        | Request::GroupDiscard { key, .. }
        | Request::GroupCreate { key, .. }
        | Request::GroupSeek { key, .. }
        | Request::GroupDescribe { key }
        | Request::GroupDelete { key } => key.clone(),
        Request::ListGroups { stream, shard } => {
            return match core.shard(stream, *shard) {
                Ok(s) => {
                    if let Some(rep) = s.replica.get() {
                        if let Err(e) = rep.confirm(&s).await {
                            return e;
                        }
                        if let Err(e) = rep.ensure_serving(&s) {
                            return e;
                        }
                    }
                    let names: Vec<String> = s
                        .groups
                        .borrow()
                        .iter()
                        .filter(|(_, t)| t.exists())
                        .map(|(n, _)| n.clone())
                        .collect();
                    // Only the groups the principal may consume or manage.
                    let mut names = core.with_security(|sec| match &sec.acl {
                        None => names,
                        Some(acl) => {
                            let p = info.principal.borrow();
                            names
                                .into_iter()
                                .filter(|n| {
                                    acl.allows(&p, Perm::GroupConsume, stream, Some(n))
                                        || acl.allows(&p, Perm::GroupManage, stream, Some(n))
                                })
                                .collect()
                        }
                    });
                    names.sort();
                    Response::Groups(names)
                }
                Err(e) => e,
            };
        }
        _ => {
            return wire_err(
                ErrorCode::Unsupported,
                format!("{name} is not supported by this broker"),
            )
        }
    };
    if let Err(e) = validate_name("group", &key.group) {
        return wire_err(ErrorCode::InvalidRequest, e.to_string());
    }
    let shard = match core.shard(&key.stream, key.shard) {
        Ok(s) => s,
        Err(e) => return e,
    };
    if let Some(rep) = shard.replica.get() {
        // Only the shard's leader serves its groups; reads of group state
        // wait for a round confirming it still leads.
        let reads = matches!(
            req,
            Request::GroupDescribe { .. }
                | Request::GroupDeadLetters { .. }
                | Request::GroupDeadLettersPage { .. }
        );
        if reads {
            if let Err(e) = rep.confirm(&shard).await {
                return e;
            }
        }
        if let Err(e) = rep.ensure_serving(&shard) {
            return e;
        }
    }
    // Looking changes nothing a waiting poll could want: a stream of
    // describes must not make every waiting poll of the shard plan again.
    let settles = !matches!(req, Request::GroupDescribe { .. });
    let r = match req {
        Request::GroupPoll {
            max_records,
            wait_ms,
            member,
            visibility_ms,
            ..
        } => {
            return poll(
                core,
                info,
                room,
                &shard,
                &key,
                max_records,
                wait_ms,
                member,
                visibility_ms,
            )
            .await;
        }
        Request::GroupAck { offsets, .. } => {
            let offsets: Vec<Offset> = offsets.into_iter().map(Offset).collect();
            let n = offsets.len() as u64;
            let r = write_op(&shard, &key.group, true, |t, now, view| {
                t.ack(now, &offsets, view)
            })
            .await;
            if matches!(r, Response::Ok) {
                core.metrics
                    .group_acked
                    .set(core.metrics.group_acked.get() + n);
            }
            r
        }
        Request::GroupNack {
            offset,
            attempts,
            delay_ms,
            reason,
            ..
        } => {
            write_op(&shard, &key.group, true, |t, now, view| {
                t.nack(
                    now,
                    Offset(offset),
                    attempts,
                    delay_ms,
                    reason.as_deref(),
                    view,
                )
            })
            .await
        }
        Request::GroupExtend { extend_ms: 0, .. } => wire_err(
            ErrorCode::InvalidRequest,
            "an extension must be more than zero (group_nack hands a record back now)",
        ),
        Request::GroupExtend {
            offset,
            attempts,
            extend_ms,
            ..
        } => {
            let view = view(&shard);
            let now = now_ms();
            let r = with_tracker(&shard, &key.group, |t| {
                t.extend(now, Offset(offset), attempts, extend_ms, view)
            });
            match r {
                // How long the claim now stands, from now (the wire's
                // `Extended.stands_ms`).
                Ok(stands_ms) => Response::Extended { stands_ms },
                Err(e) => group_err(e, &shard),
            }
        }
        Request::GroupDeadLetter {
            offset,
            attempts,
            reason,
            ..
        } => {
            write_op(&shard, &key.group, true, |t, now, view| {
                t.dead_letter(now, Offset(offset), attempts, reason.as_deref(), view)
            })
            .await
        }
        Request::GroupDeadLetters { .. } => {
            if let Err(e) = apply_due(&shard, &key.group) {
                return e;
            }
            // The whole list, unless it would not fit in one frame (or one
            // list): then the caller must page, rather than get a frame it
            // cannot take.
            let max_frame = core.shared.config.max_frame_bytes as usize;
            let budget = max_frame.saturating_sub(FRAME_OVERHEAD + 4);
            let page = with_tracker(&shard, &key.group, |t| {
                t.dead_letter_page(
                    Offset(0),
                    felix_wire::MAX_ITEMS_PER_VEC,
                    budget,
                    dead_letter_size,
                )
            });
            match page {
                Ok(page) => {
                    let bytes: usize = page.letters.iter().map(|(_, d)| dead_letter_size(d)).sum();
                    if page.next.is_some() || bytes > budget {
                        let pages = felix_wire::FEATURE_GROUP_DEAD_LETTER_PAGES;
                        let how = if info.features.get() & pages != 0 {
                            "page through them with group_dead_letters_page \
                             (FEATURE_GROUP_DEAD_LETTER_PAGES)"
                        } else {
                            "this client predates paging (FEATURE_GROUP_DEAD_LETTER_PAGES): \
                             upgrade it to list them a page at a time"
                        };
                        return wire_err(
                            ErrorCode::TooLarge,
                            format!(
                                "group {}'s dead letters do not fit in one answer \
                                 (max_frame_bytes {max_frame}, at most {} letters); {how}",
                                key.group,
                                felix_wire::MAX_ITEMS_PER_VEC
                            ),
                        );
                    }
                    Response::DeadLetters(
                        page.letters
                            .into_iter()
                            .map(|(o, d)| dead_letter_info(o, d))
                            .collect(),
                    )
                }
                Err(e) => group_err(e, &shard),
            }
        }
        Request::GroupDeadLettersPage { from, max, .. } => {
            if let Err(e) = apply_due(&shard, &key.group) {
                return e;
            }
            // A page is a read: capped like one, and always within a frame
            // (a `vec` count and the `next` field besides the letters).
            let cfg = &core.shared.config;
            let max_entries = max.clamp(1, cfg.max_records_per_read) as usize;
            let budget = (cfg.max_bytes_per_read as usize)
                .min((cfg.max_frame_bytes as usize).saturating_sub(FRAME_OVERHEAD + 4 + 1 + 8))
                // Past the core's budget its room may be less.
                .min(room.held().max(1));
            let page = with_tracker(&shard, &key.group, |t| {
                t.dead_letter_page(Offset(from), max_entries, budget, dead_letter_size)
            });
            match page {
                Ok(page) => Response::DeadLetterPage {
                    letters: page
                        .letters
                        .into_iter()
                        .map(|(o, d)| dead_letter_info(o, d))
                        .collect(),
                    next: page.next.map(|o| o.0),
                },
                Err(e) => group_err(e, &shard),
            }
        }
        Request::GroupRedrive { offset, .. } => {
            if let Err(e) = apply_due(&shard, &key.group) {
                return e;
            }
            write_op(&shard, &key.group, true, |t, now, view| {
                t.redrive(now, Offset(offset), view)
            })
            .await
        }
        Request::GroupDiscard { offset, .. } => {
            if let Err(e) = apply_due(&shard, &key.group) {
                return e;
            }
            write_op(&shard, &key.group, true, |t, now, _| {
                t.discard(now, Offset(offset))
            })
            .await
        }
        Request::GroupCreate { start, .. } => {
            if let Err(e) = room_for_group(core, &shard, &key.group) {
                return e;
            }
            write_op(&shard, &key.group, true, |t, now, view| {
                t.create(now, start_at(start), view)
            })
            .await
        }
        Request::GroupSeek { start, .. } => {
            write_op(&shard, &key.group, true, |t, now, view| {
                t.seek(now, start_at(start), view)
            })
            .await
        }
        Request::GroupDelete { .. } => {
            // The tracker leaves memory with the delete (`with_tracker`
            // drops a group that no longer exists). Not removed again after
            // the wait for durability: a poll meanwhile may have created
            // the group anew, and its tracker must stay.
            write_op(&shard, &key.group, true, |t, now, _| t.delete(now)).await
        }
        Request::GroupDescribe { .. } => {
            let view = view(&shard);
            match with_tracker(&shard, &key.group, |t| described(&shard, t, view)) {
                Ok(st) => Response::Group(GroupInfo {
                    group: key.group.clone(),
                    position: st.position.0,
                    end_offset: st.log_end.0,
                    start_offset: st.log_start.0,
                    in_flight: st.in_flight,
                    owed: st.owed.min(u32::MAX as u64) as u32,
                    delayed: st.delayed,
                    dead_letters: st.dead_letters.min(u32::MAX as u64) as u32,
                    oldest_in_flight_age_ms: (st.in_flight > 0)
                        .then_some(st.oldest_in_flight_age_ms),
                    oldest_owed_age_ms: (st.owed > 0).then_some(st.oldest_owed_age_ms),
                    // None: no request since the broker started.
                    last_active_ms: (st.last_active_ms > 0).then_some(st.last_active_ms),
                }),
                Err(e) => group_err(e, &shard),
            }
        }
        _ => unreachable!("matched above"),
    };
    // Anything that settled a claim may free room for a waiting poll.
    if settles {
        shard.group_wake.wake_all();
    }
    r
}

/// A group's status as its describe and metrics report it. A group past
/// every data record of its shard stands at the shard's end: what lies
/// between its saved position and the end is control records (a new
/// leader's generation starts), which its next poll settles without handing
/// anything out. So a group that has finished everything shows no lag, not
/// one record for each leader change since it last polled.
pub(crate) fn described<S: Storage>(
    shard: &Shard<S>,
    t: &mut GroupTracker,
    view: LogView,
) -> Result<felix_engine::group::GroupStatus, GroupError> {
    let mut st = t.describe(now_ms(), view)?;
    let from = st.position.max(st.log_start);
    if from < st.log_end && from >= shard.log.data_end() {
        st.position = st.log_end;
    }
    Ok(st)
}

pub(crate) fn view<S: Storage>(shard: &Shard<S>) -> LogView {
    LogView {
        start: shard.log.start(),
        end: shard.log.end(),
    }
}

/// Run `f` on the group's tracker (created empty if unknown, and dropped
/// again if the call did not bring the group into being).
/// Refuse a call that would add a group to a shard already keeping
/// `groups.max_groups_per_shard` of them.
fn room_for_group<S: Storage>(
    core: &Core<S>,
    shard: &Shard<S>,
    group: &str,
) -> Result<(), Response> {
    let groups = shard.groups.borrow();
    let cap = core.shared.config.max_groups_per_shard;
    if groups.contains_key(group) || groups.len() < cap {
        return Ok(());
    }
    Err(wire_err(
        ErrorCode::TooLarge,
        format!(
            "shard {} keeps {} consumer groups, its limit (groups.max_groups_per_shard); \
             delete groups no longer used",
            shard.name(),
            groups.len()
        ),
    ))
}

fn with_tracker<S: Storage, R>(
    shard: &Shard<S>,
    group: &str,
    f: impl FnOnce(&mut GroupTracker) -> R,
) -> R {
    let mut groups = shard.groups.borrow_mut();
    if !groups.contains_key(group) {
        groups.insert(
            group.to_string(),
            GroupTracker::new(group, shard.group_config.clone()),
        );
    }
    let t = groups.get_mut(group).unwrap();
    let r = f(t);
    // A deadline newly listed before the timer task's next wake (a short
    // visibility, a short delay): wake it so the lapse is applied on time.
    // (One not listed anew has an entry at or before it, which the timer
    // already wakes for.)
    let listed = shard.deadlines.borrow_mut().note(group, t.next_deadline());
    if listed.is_some_and(|d| d < shard.timer_at.get()) {
        shard.timer_at.set(0);
        shard.timer_wake.wake_all();
    }
    if !t.exists() && t.in_flight() == 0 {
        groups.remove(group);
    }
    r
}

/// Apply the group's lapses and ended delays that fell due, now rather than
/// when the timer task next runs, so that a claim that lapsed at the attempt
/// bound is a dead letter to the calls that list and act on dead letters.
fn apply_due<S: Storage>(shard: &Shard<S>, group: &str) -> Result<(), Response> {
    let due = with_tracker(shard, group, |t| t.tick(now_ms()));
    append_entries(shard, &due)?;
    shard.group_wake.wake_all();
    Ok(())
}

/// What a group request's writes wait on to be durable.
enum Written {
    /// Nothing was written.
    Nothing,
    /// A single broker's log: the lsn of the last entry.
    Log(Lsn),
    /// A replicated shard: the proposal, settled once committed.
    Replicated(crate::cluster::Committed),
}

/// Append the tracker's entries to the log, in order (on a replicated
/// shard: propose them, in order). Returns what to wait on for their
/// durability. The groups table must not be borrowed here (a segment roll
/// asks it for a snapshot).
fn append_entries<S: Storage>(
    shard: &Shard<S>,
    entries: &[GroupEntry],
) -> Result<Written, Response> {
    if let Some(rep) = shard.replica.get() {
        if entries.is_empty() {
            return Ok(Written::Nothing);
        }
        return rep.propose(shard, entries).map(Written::Replicated);
    }
    let mut lsn = None;
    let mut body = Vec::with_capacity(64);
    for e in entries {
        body.clear();
        e.encode(&mut body);
        match shard.log.append_group(&body) {
            Ok(a) => lsn = Some(a.lsn),
            // Deleted while the request was on its way here.
            Err(_) if shard.log.is_closed() => return Err(shard.closed_answer()),
            Err(e) => {
                return Err(wire_err(
                    ErrorCode::Unavailable,
                    format!("shard {}: {e}", shard.name()),
                ))
            }
        }
    }
    Ok(lsn.map_or(Written::Nothing, Written::Log))
}

/// A tracker call that returns entries to write; answer `Ok` once they are
/// durable (when `durable`).
async fn write_op<S: Storage>(
    shard: &Rc<Shard<S>>,
    group: &str,
    durable: bool,
    f: impl FnOnce(&mut GroupTracker, u64, LogView) -> Result<Vec<GroupEntry>, GroupError>,
) -> Response {
    if let Some(r) = shard.log.stopped() {
        return wire_err(
            ErrorCode::Unavailable,
            format!("shard {} is stopped: {r}", shard.name()),
        );
    }
    let view = view(shard);
    let entries = match with_tracker(shard, group, |t| f(t, now_ms(), view)) {
        Ok(e) => e,
        Err(e) => return group_err(e, shard),
    };
    let written = match append_entries(shard, &entries) {
        Ok(w) => w,
        Err(e) => return e,
    };
    if !durable {
        return Response::Ok;
    }
    match written {
        Written::Nothing => {}
        Written::Log(lsn) => {
            if let Err(e) = shard.log.wait(lsn, Frontier::Durable).await {
                return wire_err(
                    ErrorCode::Unavailable,
                    format!("shard {}: {e}", shard.name()),
                );
            }
        }
        Written::Replicated(committed) => {
            let rep = shard.replica.get().expect("a replicated write");
            let timeout = crate::cluster::COMMIT_TIMEOUT;
            match glommio::timer::timeout(timeout, async { Ok(committed.await) }).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return rep.refusal(&shard.name(), e),
                Err(_) => {
                    return wire_err(
                        ErrorCode::Unavailable,
                        format!(
                            "shard {}: not committed within {timeout:?} (no majority \
                             reachable?); it may still be",
                            shard.name()
                        ),
                    )
                }
            }
        }
    }
    Response::Ok
}

/// How often one poll request plans and reads again after another poll on
/// its group took what it had read. Each retry follows a read in which the
/// other poll made progress, so a few are plenty.
const MAX_REPLANS: u32 = 16;

#[allow(clippy::too_many_arguments)]
async fn poll<S: Storage>(
    core: &Rc<Core<S>>,
    info: &Rc<ConnInfo>,
    room: &AnswerRoom,
    shard: &Rc<Shard<S>>,
    key: &GroupKey,
    max_records: u32,
    wait_ms: u32,
    member: Option<GroupMemberRef>,
    visibility_ms: Option<u64>,
) -> Response {
    if let Some(m) = &member {
        if m.name.is_empty() || m.name.len() > 128 {
            return wire_err(
                ErrorCode::InvalidRequest,
                format!(
                    "member name is {} bytes; names are 1 to 128 bytes",
                    m.name.len()
                ),
            );
        }
    }
    if visibility_ms == Some(0) {
        // A claim that lapses as it is made would spend an attempt a poll.
        return wire_err(
            ErrorCode::InvalidRequest,
            "a poll's visibility must be more than zero (leave it out for the group's \
             visibility timeout)",
        );
    }
    let caller = Caller {
        principal: info.principal.borrow().clone(),
        connection: info.id,
        member: member.as_ref().map(|m| m.name.clone()),
        reclaim: member.as_ref().is_some_and(|m| m.reclaim),
    };
    let cfg = &core.shared.config;
    let max_records = max_records.clamp(1, cfg.max_records_per_read);
    let wait = (wait_ms as u64).min(cfg.max_wait_ms);
    let deadline = now_ms() + wait;
    let skipped = info.features.get() & felix_wire::FEATURE_GROUP_SKIPPED != 0;
    let mut counted_capped = false;
    // Plans gone stale under this poll (see `PollOutcome::unread`), read
    // again at once; bounded so that a poll can never spin.
    let mut replans = 0;
    loop {
        if shard.log.is_closed() {
            // Deleted while the poll waited (or the broker is stopping).
            return shard.closed_answer();
        }
        if let Some(r) = shard.log.stopped() {
            return wire_err(
                ErrorCode::Unavailable,
                format!("shard {} is stopped: {r}", shard.name()),
            );
        }
        if info.hung_up() {
            // Nobody to hand records to: claim nothing.
            return Response::GroupRecords {
                records: Vec::new(),
            };
        }
        // A waiting poll may outlive a change of leadership: it serves
        // only while this broker leads, from trackers built for its term.
        if let Some(rep) = shard.replica.get() {
            if let Err(e) = rep.ensure_serving(shard) {
                return e;
            }
        }
        // Checked on every pass: a group deleted while this poll waited is
        // created again by it, and the shard's group limit holds for that
        // too.
        if let Err(e) = room_for_group(core, shard, &key.group) {
            return e;
        }
        let view = view(shard);
        let plan = with_tracker(shard, &key.group, |t| {
            t.plan_poll(now_ms(), &caller, max_records, view)
        });
        if let Err(e) = append_entries(shard, &plan.writes) {
            return e;
        }
        if !plan.offsets.is_empty() {
            // A waiting poll takes its answer room only now (a no-op for
            // one that took it before it ran).
            room.take(cfg.max_bytes_per_read as usize).await;
        }
        let mut loaded = match read_offsets(core, shard, &plan.offsets, view, room.held()).await {
            Ok(r) => r,
            Err(e) => return e,
        };
        let need = loaded.needs.unwrap_or(0).max(loaded.held);
        if need > room.held() {
            // The first record passes the poll's byte cap and the room
            // taken for it (or reaching it from disk would): let it go
            // (nothing is claimed yet), wait for room for what it takes,
            // and plan again. So polls pipelined on one connection hold,
            // and bring from disk, no more than its room, however large
            // the records.
            drop(loaded);
            room.grow(need).await;
            continue;
        }
        if info.hung_up() {
            // The client left while the records were read: claim nothing.
            return Response::GroupRecords {
                records: Vec::new(),
            };
        }
        if let Some(rep) = shard.replica.get() {
            // Leadership may have moved while the records were read: the
            // plan was made from trackers that no longer serve.
            let planned_for = shard.served_term.get();
            if let Err(e) = rep.ensure_serving(shard) {
                return e;
            }
            if shard.served_term.get() != planned_for {
                continue;
            }
        }
        if !shard.groups.borrow().contains_key(&key.group) {
            // Deleted while the records were read: plan again (which
            // checks the group limit before creating it anew).
            continue;
        }
        let view = self::view(shard);
        let mut freed = false;
        let outcome = with_tracker(shard, &key.group, |t| {
            let before = t.in_flight();
            let outcome = t.poll(
                now_ms(),
                &caller,
                max_records,
                visibility_ms,
                view,
                &mut |o| match loaded.get(o) {
                    // Keys and headers count toward the poll's byte cap too.
                    Some(r) => Lookup::Record {
                        payload_bytes: r.size_bytes().min(u32::MAX as usize) as u32,
                    },
                    None if o < view.start || loaded.skipped(o) => Lookup::Skipped,
                    None => match loaded.unsendable(o) {
                        Some(why) => Lookup::GiveUp(why.to_string()),
                        None => Lookup::NotLoaded,
                    },
                },
            );
            // Reserved records dead-lettered at the attempt bound, or
            // claims on records retention removed, settle here too.
            freed = t.in_flight() < before;
            outcome
        });
        if freed {
            shard.group_wake.wake_all();
        }
        if let Err(e) = append_entries(shard, &outcome.writes) {
            return e;
        }
        // Once per poll request, however often a waiting poll looks again.
        if outcome.capped && !counted_capped {
            counted_capped = true;
            core.metrics
                .group_polls_capped
                .set(core.metrics.group_polls_capped.get() + 1);
            if core.claims.full() {
                crate::conn::warn_rate_limited(&CLAIMS_FULL_LOG, || {
                    format!(
                        "core {} holds {} claims and delayed nacks, its limit \
                         (groups.max_claims_per_core): polls on its shards answer empty \
                         until consumers ack, nack or let claims lapse",
                        core.core_id(),
                        core.claims.held()
                    )
                });
            }
        }
        if !outcome.deliveries.is_empty() {
            core.metrics
                .group_delivered
                .set(core.metrics.group_delivered.get() + outcome.deliveries.len() as u64);
            let mut out = Vec::with_capacity(outcome.deliveries.len());
            out.extend(outcome.deliveries.iter().filter_map(|d| {
                let r = loaded.take(d.offset)?;
                let w = to_wire_record(r);
                Some(GroupRecord {
                    offset: w.offset,
                    attempts: d.attempts,
                    timestamp_ms: w.timestamp_ms,
                    key: w.key,
                    headers: w.headers,
                    payload: w.payload,
                    skipped_before: skipped.then_some(d.skipped_before),
                })
            }));
            return Response::GroupRecords { records: out };
        }
        if outcome.unread && replans < MAX_REPLANS {
            replans += 1;
            continue;
        }
        let now = now_ms();
        // A client that sends nothing more gets no claims it waited for.
        if now >= deadline || info.done_sending() {
            return Response::GroupRecords {
                records: Vec::new(),
            };
        }
        // Wait for new records, for room (acks, nacks, lapses) or for the
        // next claim deadline, whichever comes first.
        let next = shard
            .groups
            .borrow()
            .get(&key.group)
            .and_then(|t| t.next_deadline())
            .unwrap_or(u64::MAX);
        let until = deadline.min(next.max(now + 1));
        // Nothing to answer yet: hold no answer room while waiting.
        room.give_back();
        let end = shard.log.end();
        let wake = shard.group_wake.clone();
        let log = shard.log.clone();
        // A poll parked at the core's claim limit also waits for room freed
        // by another shard's groups (only those listen: a release wakes
        // nobody else).
        let claims = core.claims.full().then(|| core.claims.clone());
        let _parked = Parked::new(&core.metrics.group_polls_waiting);
        let _ = with_timeout(until - now, async move {
            let woken = futures_lite::future::or(wake.wait(), async {
                let _ = log.wait_for_offset(end).await;
            });
            let woken = futures_lite::future::or(woken, async {
                match &claims {
                    Some(c) => c.freed().await,
                    None => std::future::pending().await,
                }
            });
            futures_lite::future::or(
                woken,
                futures_lite::future::or(core.until_stopping(), info.until_hung_up()),
            )
            .await
        })
        .await;
        // A backstop against a wait that keeps ending at once: give the
        // core's other tasks their turn once this one used its slice.
        glommio::yield_if_needed().await;
        if core.stopping.get() {
            return Response::GroupRecords {
                records: Vec::new(),
            };
        }
    }
}

thread_local! {
    /// Polls refused for the core's claim limit, logged at most once a
    /// second.
    static CLAIMS_FULL_LOG: crate::conn::LogLimit = const { std::cell::Cell::new(None) };
    /// Records no answer can carry, given up on by the groups polling them.
    static UNSENDABLE_LOG: crate::conn::LogLimit = const { std::cell::Cell::new(None) };
}

/// Counts a parked poll in `felix_group_polls_waiting` for as long as it
/// lives (a poll dropped while parked is uncounted too).
struct Parked<'a>(&'a Cell<u64>);

impl<'a> Parked<'a> {
    fn new(gauge: &'a Cell<u64>) -> Parked<'a> {
        gauge.set(gauge.get() + 1);
        Parked(gauge)
    }
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

/// What a poll read for its plan: the records found, and the offsets the log
/// showed to hold no deliverable record (control records, or removed by
/// retention); offsets in neither were not reached (a byte cap) and must
/// not be settled. Both sorted by offset, looked up by binary search (a
/// poll asks for each offset a few times; no hashing on this path).
#[derive(Default)]
struct Loaded {
    offsets: Vec<Offset>,
    records: Vec<Option<Record>>,
    skipped: Vec<Offset>,
    /// Records no answer can carry, and why (see `Lookup::GiveUp`).
    unsendable: Vec<(Offset, String)>,
    /// Bytes the records loaded hold, as the poll's byte cap counts them.
    held: usize,
    /// Nothing was loaded: the first record, or what reaching it takes
    /// from disk, needs this much room, more than the poll holds.
    needs: Option<usize>,
}

impl Loaded {
    fn insert(&mut self, r: Record) {
        self.offsets.push(r.offset);
        self.records.push(Some(r));
    }

    /// Sort what the runs added (usually in order already).
    fn finish(&mut self) {
        if !self.offsets.is_sorted() {
            let mut pairs: Vec<(Offset, Option<Record>)> =
                self.offsets.drain(..).zip(self.records.drain(..)).collect();
            pairs.sort_unstable_by_key(|(o, _)| *o);
            pairs.dedup_by_key(|(o, _)| *o);
            (self.offsets, self.records) = pairs.into_iter().unzip();
        }
        self.skipped.sort_unstable();
    }

    fn index(&self, o: Offset) -> Option<usize> {
        self.offsets.binary_search(&o).ok()
    }

    fn get(&self, o: Offset) -> Option<&Record> {
        self.records[self.index(o)?].as_ref()
    }

    /// The record at `o`, moved out (each is delivered once).
    fn take(&mut self, o: Offset) -> Option<Record> {
        let i = self.index(o)?;
        self.records[i].take()
    }

    fn skipped(&self, o: Offset) -> bool {
        self.skipped.binary_search(&o).is_ok()
    }

    fn unsendable(&self, o: Offset) -> Option<&str> {
        self.unsendable
            .iter()
            .find(|(u, _)| *u == o)
            .map(|(_, why)| why.as_str())
    }
}

/// Read the records at `offsets` (runs of consecutive offsets in one read),
/// within `room` bytes of memory for the first (see `Loaded::needs`).
async fn read_offsets<S: Storage>(
    core: &Rc<Core<S>>,
    shard: &Shard<S>,
    offsets: &[Offset],
    view: LogView,
    room: usize,
) -> Result<Loaded, Response> {
    let mut out = Loaded {
        offsets: Vec::with_capacity(offsets.len()),
        records: Vec::with_capacity(offsets.len()),
        skipped: Vec::new(),
        unsendable: Vec::new(),
        held: 0,
        needs: None,
    };
    // One byte budget for the whole plan, not one per run: owed records
    // scattered among finished ones make many short runs, and each read
    // returns at least one record. It counts each record as its answer will
    // (its fields too), and never more than the frame cap leaves: a record
    // loaded is a record claimed, and a claim whose answer could not be
    // sent would spend an attempt on nothing.
    let cfg = &core.shared.config;
    let frame_room = records_room(
        cfg.max_frame_bytes,
        felix_wire::Response::GROUP_RECORDS_FIXED_BYTES,
    );
    // Room taken past the core's budget may be less than the cap.
    let mut budget = (cfg.max_bytes_per_read as usize).min(frame_room).min(room);
    let mut i = 0;
    while i < offsets.len() && budget > 0 {
        let start = offsets[i];
        let mut j = i + 1;
        while j < offsets.len() && offsets[j] == offsets[j - 1].next() {
            j += 1;
        }
        let run_end = offsets[j - 1].next();
        // The read counts records, and steps over control records (a new
        // leader's generation start): one in the last run leaves room for
        // the records just past it, which that run keeps, so a poll
        // crossing one still fills up. (Earlier runs end where the next
        // begins.)
        let keep_end = if j == offsets.len() {
            view.end.max(run_end)
        } else {
            run_end
        };
        if run_end > view.start {
            // A run may begin below the log start (a reclaimed claim on a
            // record retention removed, next to the first retained ones):
            // read what is retained; the offsets below it hold nothing.
            // The first record loaded may take up to the poll's room; a
            // later run's what is left of the budget, and what it brings
            // from disk what is left of the room.
            let first_run = out.offsets.is_empty();
            let r = shard
                .log
                .read_within(
                    start.max(view.start),
                    ReadLimits {
                        max_records: j - i,
                        max_bytes: budget,
                    },
                    if first_run {
                        room
                    } else {
                        room.saturating_sub(out.held)
                    },
                )
                .await
                .map_err(|e| {
                    wire_err(
                        ErrorCode::Unavailable,
                        format!("shard {}: {e}", shard.name()),
                    )
                })?;
            if let Some(n) = r.first_needs {
                if first_run {
                    out.needs = Some(n);
                    return Ok(out);
                }
                // Not loaded, and nothing from it on is settled.
                break;
            }
            // Everything below the read's `next` (or below the log's start,
            // which retention removed) that came back without a record
            // holds none: the read stepped over it.
            let reached = r.next.max(r.start).min(keep_end);
            let first = out.offsets.len();
            let mut expect = start;
            let mut cut = false;
            for rec in r.records {
                if rec.offset >= keep_end {
                    break;
                }
                if rec.offset < start {
                    continue;
                }
                // A read lets its first record pass the byte cap; only the
                // poll's first may (a run further on leaves the record
                // unloaded for the next poll), so an answer stays within
                // the budget plus one record, and within the frame.
                // (`skipped_before` counted whether or not it is sent.)
                let size = answer_size(&rec, Some(true));
                let sendable = size <= frame_room;
                // The budget is memory: the answer, and while it is built
                // the record's headers' lengths.
                let held = size + rec.header_table_bytes();
                if sendable && !out.offsets.is_empty() && held > budget {
                    // Not loaded, and nothing from it on is settled.
                    budget = 0;
                    cut = true;
                    break;
                }
                // Offsets the read stepped over below this record hold none.
                out.skipped.extend((expect.0..rec.offset.0).map(Offset));
                expect = rec.offset.next();
                if !sendable {
                    // Written before the frame cap was lowered: no answer
                    // can carry it. Claimed, each poll would spend an
                    // attempt on an answer never sent; left, it would stop
                    // the group at it for ever. The group gives it up now,
                    // a dead letter saying why.
                    let why = format!(
                        "its answer takes {size} bytes, over what server.max_frame_bytes ({}) \
                         leaves (it was written under a larger cap): raise the cap and redrive it",
                        cfg.max_frame_bytes
                    );
                    crate::conn::warn_rate_limited(&UNSENDABLE_LOG, || {
                        format!(
                            "shard {}: the record at offset {} fits no answer: {why}; groups \
                             polling it dead-letter it",
                            shard.name(),
                            rec.offset
                        )
                    });
                    out.unsendable.push((rec.offset, why));
                    continue;
                }
                budget = budget.saturating_sub(held);
                out.held += held;
                out.insert(rec);
            }
            if expect < reached && !cut {
                out.skipped.extend((expect.0..reached.0).map(Offset));
            }
            debug_assert!(out.offsets[first..].is_sorted());
        } else {
            out.skipped.extend_from_slice(&offsets[i..j]);
        }
        i = j;
    }
    out.finish();
    Ok(out)
}

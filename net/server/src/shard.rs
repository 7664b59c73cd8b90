//! A shard as the broker holds it on its owning core: the log, its flusher,
//! and the consumer-group trackers, all touched only by this core.

use crate::broker::{now_ms, wire_err, Core};
use felix_engine::catalog::StreamMeta;
use felix_engine::group::{GroupConfig, GroupEntry, GroupTracker};
use felix_engine::log::{LogError, Replayed, ShardLog};
use felix_engine::notify::WaitList;
use felix_engine::storage::Storage;
use felix_engine::StreamName;
use felix_wire::{ErrorCode, Response};
use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

pub(crate) type Groups = Rc<RefCell<ahash::AHashMap<String, GroupTracker>>>;

/// The shard's upcoming group deadlines (claims lapsing, delays ending), so
/// the group timer finds what falls due without visiting every group. Each
/// group with a deadline has an entry at or before it: a request that moves
/// a group's next deadline earlier than the one it has listed lists the new
/// one (see `groups::with_tracker`); one that moves it later leaves the
/// entry, which the timer finds early, and then lists the group's real next
/// deadline. Entries a newer, earlier one replaced are skipped when popped.
#[derive(Default)]
pub(crate) struct Deadlines {
    heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, String)>>,
    listed: ahash::AHashMap<String, u64>,
}

impl Deadlines {
    /// `group`'s next deadline is now `next`: list it if it comes before the
    /// one the group has listed (or it has none). Returns the deadline it
    /// listed, if it did.
    pub fn note(&mut self, group: &str, next: Option<u64>) -> Option<u64> {
        let d = next?;
        if self.listed.get(group).is_some_and(|&l| l <= d) {
            return None;
        }
        self.listed.insert(group.to_string(), d);
        self.heap.push(std::cmp::Reverse((d, group.to_string())));
        // Replaced entries wait in the heap until their time (up to the
        // longest visibility): past twice the live ones, drop them all.
        if self.heap.len() > 2 * self.listed.len() + 1024 {
            self.heap = self
                .listed
                .iter()
                .map(|(g, &d)| std::cmp::Reverse((d, g.clone())))
                .collect();
        }
        Some(d)
    }

    /// The earliest listed deadline.
    pub fn earliest(&self) -> Option<u64> {
        self.heap.peek().map(|e| e.0 .0)
    }

    /// The groups whose listed deadline is at or before `now`, unlisted
    /// (the caller ticks them and notes their next deadline).
    pub fn due(&mut self, now: u64) -> Vec<String> {
        let mut out = Vec::new();
        while self.heap.peek().is_some_and(|e| e.0 .0 <= now) {
            let std::cmp::Reverse((d, group)) = self.heap.pop().expect("peeked");
            if self.listed.get(&group) == Some(&d) {
                self.listed.remove(&group);
                out.push(group);
            }
        }
        out
    }
}

pub(crate) struct Shard<S: Storage> {
    pub stream: StreamName,
    pub index: u32,
    /// In a cluster: the replica group this shard is, the same on every
    /// broker that holds this incarnation of its stream (worked out once:
    /// every replicated publish names it).
    pub replica_group: u64,
    pub log: ShardLog<S>,
    pub groups: Groups,
    pub group_config: GroupConfig,
    /// Its stream was deleted (its log is closed and its files go).
    pub deleted: std::cell::Cell<bool>,
    /// Woken when group state changes in a way a waiting poll cares about.
    pub group_wake: Rc<WaitList>,
    /// When the group timer task next wakes (ms since the epoch) ...
    pub timer_at: std::cell::Cell<u64>,
    /// ... and how to wake it sooner, when a request sets an earlier
    /// deadline (see `groups::with_tracker`).
    pub timer_wake: Rc<WaitList>,
    /// Upcoming group deadlines, for the timer.
    pub deadlines: RefCell<Deadlines>,
    /// In a cluster: the shard's replica (set once it joined the host).
    pub replica: std::cell::OnceCell<crate::cluster::ShardReplica>,
    /// In a cluster: every group's state as the committed log has it
    /// (what a replica that becomes leader serves from, and what the log's
    /// snapshots hold); `groups` is then the leader's serving state, which
    /// runs ahead of it by the proposals in flight.
    pub committed: Groups,
    /// In a cluster: the Raft index of the last group entry the log holds
    /// (a restart applies committed entries again; these are skipped).
    pub group_index: Rc<std::cell::Cell<u64>>,
    /// In a cluster: the term whose leadership `groups` was built for (0:
    /// none; rebuilt from `committed` before the next request is served).
    pub served_term: Rc<std::cell::Cell<u64>>,
}

impl<S: Storage> Shard<S> {
    pub async fn open(
        core: Rc<Core<S>>,
        meta: &StreamMeta,
        index: u32,
        dir: &Path,
    ) -> Result<Rc<Shard<S>>, LogError> {
        let c = &core.shared.config;
        let group_config = GroupConfig {
            visibility_ms: c.visibility_timeout_ms,
            max_attempts: c.max_attempts,
            max_in_flight: c.max_in_flight,
            max_visibility_ms: c.max_visibility_ms,
            poll_max_records: c.max_records_per_read,
            poll_max_bytes: c.max_bytes_per_read as u64,
            idle_ms: c.group_idle_ms,
            shared_claims: core.claims.clone(),
        };
        // Replay group entries in log order, each applied as it is read
        // (a shard's log may hold millions of them).
        let mut groups: ahash::AHashMap<String, GroupTracker> = Default::default();
        let mut apply = |e: GroupEntry| match groups.get_mut(e.group()) {
            Some(t) => {
                t.apply_entry(&e);
            }
            None => {
                let mut t = GroupTracker::new(e.group(), group_config.clone());
                t.apply_entry(&e);
                groups.insert(e.group().to_string(), t);
            }
        };
        let mut bad = None;
        let mut group_index = 0;
        let log = ShardLog::open(core.storage.clone(), dir, core.log_config(meta), &mut |e| {
            if let Replayed::Group(body) = e {
                // A replicated shard's group entries carry their Raft index.
                match crate::cluster::decode_replicated(body) {
                    Some(Ok((index, bodies))) => {
                        group_index = group_index.max(index);
                        for b in bodies {
                            match GroupEntry::decode(b) {
                                Ok(g) => apply(g),
                                Err(err) => bad = Some(err.to_string()),
                            }
                        }
                    }
                    Some(Err(err)) => bad = Some(err),
                    None => match GroupEntry::decode(body) {
                        Ok(g) => apply(g),
                        Err(err) => bad = Some(err.to_string()),
                    },
                }
            }
        })
        .await?;
        if let Some(err) = bad {
            return Err(LogError::Corrupt {
                path: dir.display().to_string(),
                position: 0,
                reason: format!("undecodable group entry: {err}"),
            });
        }
        groups.retain(|_, t| t.exists());
        let replicated = core.shared.config.cluster.is_some();
        // In a cluster the log holds only committed group state: it is
        // kept apart from the leader's serving state.
        let mut committed: ahash::AHashMap<String, GroupTracker> = Default::default();
        if replicated {
            for (name, t) in &groups {
                let mut c = GroupTracker::new(name.as_str(), group_config.clone());
                for e in t.snapshot_entries() {
                    c.apply_entry(&e);
                }
                committed.insert(name.clone(), c);
            }
        }
        let opened = now_ms();
        for t in groups.values_mut() {
            t.rebuild(opened);
        }
        let groups: Groups = Rc::new(RefCell::new(groups));
        let committed: Groups = Rc::new(RefCell::new(committed));
        let group_index_cell = Rc::new(std::cell::Cell::new(group_index));
        if replicated {
            // Snapshots of what is committed, and the index they reach.
            let snap = committed.clone();
            let index = group_index_cell.clone();
            log.set_snapshot_provider(Box::new(move |out| {
                for t in snap.borrow().values() {
                    for e in t.snapshot_entries() {
                        out.push(e.to_bytes());
                    }
                }
                out.push(crate::cluster::encode_replicated(index.get(), &[]));
            }));
        } else {
            let snap = groups.clone();
            log.set_snapshot_provider(Box::new(move |out| {
                for t in snap.borrow().values() {
                    for e in t.snapshot_entries() {
                        out.push(e.to_bytes());
                    }
                }
            }));
        }
        let shard = Rc::new(Shard {
            stream: meta.name.clone(),
            index,
            replica_group: crate::cluster::group_id(&meta.name, index, meta.incarnation),
            log,
            groups,
            group_config,
            deleted: std::cell::Cell::new(false),
            group_wake: Rc::new(WaitList::new()),
            timer_at: std::cell::Cell::new(0),
            timer_wake: Rc::new(WaitList::new()),
            deadlines: RefCell::new(Deadlines::default()),
            replica: std::cell::OnceCell::new(),
            committed,
            group_index: group_index_cell,
            served_term: Rc::new(std::cell::Cell::new(0)),
        });
        let flusher = shard.log.clone();
        glommio::spawn_local(async move { flusher.run_flusher().await }).detach();
        let reader = shard.log.clone();
        glommio::spawn_local(async move { reader.run_read_ahead().await }).detach();
        glommio::spawn_local(run_group_timers(Rc::downgrade(&shard))).detach();
        Ok(shard)
    }

    pub fn name(&self) -> String {
        format!("{}/{}", self.stream, self.index)
    }

    /// The answer to a request that finds this shard's log closed: its
    /// stream was deleted while the request waited, or the broker is
    /// shutting down.
    pub fn closed_answer(&self) -> Response {
        if self.deleted.get() {
            wire_err(
                ErrorCode::NotFound,
                format!("stream {} was deleted", self.stream),
            )
        } else {
            wire_err(
                ErrorCode::Unavailable,
                format!("shard {} is shutting down", self.name()),
            )
        }
    }

    /// Close the log and delete its files. A failure to flush what was
    /// queued does not matter (the records are being deleted) and is only
    /// logged; a failure to delete is returned.
    pub async fn destroy(&self) -> Result<(), LogError> {
        self.deleted.set(true);
        if let Err(e) = self.log.close().await {
            tracing::warn!(
                "shard {} failed its last flush before deletion: {e}",
                self.name()
            );
        }
        self.log.destroy().await
    }
}

/// Apply lapses and delay ends when they fall due (waking polls waiting at
/// the in-flight cap, and dead-lettering records out of attempts), and drop
/// the memory of idle groups.
async fn run_group_timers<S: Storage>(shard: std::rc::Weak<Shard<S>>) {
    // Idle periods are minutes long: looking for groups to evict twice a
    // second is enough, however often short claims wake the timer.
    // Paced by the monotonic clock: a wall clock stepped back must not
    // stop evictions.
    let mut next_evict_scan = std::time::Instant::now();
    loop {
        let (sleep_ms, wake) = {
            let Some(s) = shard.upgrade() else { return };
            let now = now_ms();
            let next = s.deadlines.borrow().earliest();
            let sleep_ms = next
                .map(|d| d.saturating_sub(now))
                .unwrap_or(1000)
                .clamp(1, 1000);
            s.timer_at.set(now + sleep_ms);
            (sleep_ms, s.timer_wake.clone())
        };
        // Until the earliest deadline, or sooner if a request sets an
        // earlier one (a claim with a short visibility made meanwhile).
        futures_lite::future::or(
            glommio::timer::sleep(Duration::from_millis(sleep_ms)),
            async {
                wake.wait().await;
            },
        )
        .await;
        let Some(s) = shard.upgrade() else { return };
        if s.log.stopped().is_some() {
            // Claims and polls are refused from now on: the claims can
            // neither lapse nor be settled, so let them go rather than keep
            // them in the core's claim count. The groups' durable state
            // stays, for describes, lists and metrics.
            for t in s.groups.borrow_mut().values_mut() {
                t.reset_to_durable();
            }
            s.served_term.set(0);
            return;
        }
        if let Some(rep) = s.replica.get() {
            // A replicated shard's trackers are served only by its leader,
            // built for its term: otherwise nothing falls due here (they
            // are rebuilt from the committed state when it leads again).
            let current = s.served_term.get() != 0
                && rep.host.term(rep.group) == Some(s.served_term.get())
                && rep.host.serving(rep.group);
            if !current {
                // Drop what fell due, so the timer sleeps rather than spin.
                let _ = s.deadlines.borrow_mut().due(now_ms());
                if rep.host.serving(rep.group) {
                    // Leading, but serving state not built for this term
                    // yet (no request since the election, or a failed
                    // proposal voided it): build it now, so that the
                    // leader's groups show in its metrics before a
                    // consumer comes back, and the old claims go.
                    let _ = rep.ensure_serving(&s);
                } else if !s.groups.borrow().is_empty() {
                    // Not leading (deposed, or a follower): the trackers
                    // serve nobody (requests are refused, and the next
                    // leadership rebuilds them from the committed state),
                    // so their claims leave the core's claim count.
                    s.groups.borrow_mut().clear();
                    s.served_term.set(0);
                }
                continue;
            }
        }
        let now = now_ms();
        let mut writes = Vec::new();
        let mut woke = false;
        let mono = std::time::Instant::now();
        let evict = mono >= next_evict_scan;
        if evict {
            next_evict_scan = mono + Duration::from_millis(500);
        }
        {
            let mut groups = s.groups.borrow_mut();
            let mut deadlines = s.deadlines.borrow_mut();
            for name in deadlines.due(now) {
                let Some(t) = groups.get_mut(&name) else {
                    continue; // deleted meanwhile
                };
                if t.next_deadline().is_some_and(|d| d <= now) {
                    writes.extend(t.tick(now));
                    woke = true;
                }
                deadlines.note(&name, t.next_deadline());
            }
            if evict {
                // Every group, twice a second: idle ones let their memory
                // go, and (belt and braces) any deadline the list missed
                // is applied at most half a second late.
                for (name, t) in groups.iter_mut() {
                    if t.next_deadline().is_some_and(|d| d <= now) {
                        writes.extend(t.tick(now));
                        woke = true;
                        deadlines.note(name, t.next_deadline());
                    }
                    if t.can_evict(now) {
                        t.reset_to_durable();
                    }
                }
            }
        }
        if let Some(rep) = s.replica.get() {
            // A replicated shard's leader proposes what fell due (in the
            // background: nobody waits on it); a follower's trackers are
            // not served and are rebuilt when it leads.
            if !writes.is_empty() {
                match rep.propose(&s, &writes) {
                    Ok(committed) => {
                        glommio::spawn_local(async move {
                            let _ = committed.await;
                        })
                        .detach();
                    }
                    // Voided: rebuilt before the next request is served.
                    Err(_) => s.served_term.set(0),
                }
            }
        } else {
            let mut body = Vec::new();
            for e in &writes {
                body.clear();
                e.encode(&mut body);
                if s.log.append_group(&body).is_err() {
                    return;
                }
            }
        }
        if woke {
            s.group_wake.wake_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Deadlines;

    #[test]
    fn deadlines_list_each_groups_earliest_and_skip_replaced_ones() {
        let mut d = Deadlines::default();
        assert_eq!(d.note("a", Some(100)), Some(100));
        // Later: the entry at 100 stands for it.
        assert_eq!(d.note("a", Some(150)), None);
        assert_eq!(d.note("b", Some(120)), Some(120));
        // Earlier: replaces 120.
        assert_eq!(d.note("b", Some(90)), Some(90));
        assert_eq!(d.note("c", None), None);
        assert_eq!(d.earliest(), Some(90));
        assert!(d.due(80).is_empty());
        assert_eq!(d.due(100), vec!["b".to_string(), "a".to_string()]);
        // Both unlisted now; the replaced entry for b (120) is skipped.
        assert!(d.due(200).is_empty());
        assert_eq!(d.earliest(), None);
        // Listed again after being due.
        d.note("a", Some(300));
        assert_eq!(d.due(300), vec!["a".to_string()]);
    }

    #[test]
    fn replaced_deadlines_do_not_pile_up() {
        let mut d = Deadlines::default();
        // One group whose deadline keeps moving earlier: every move leaves
        // a replaced entry behind, far in the future.
        for k in 0..100_000u64 {
            d.note("g", Some(1_000_000_000 - k));
        }
        assert!(
            d.heap.len() <= 2 * d.listed.len() + 1025,
            "{}",
            d.heap.len()
        );
        assert_eq!(d.due(u64::MAX), vec!["g".to_string()]);
        assert!(d.heap.is_empty());
    }
}

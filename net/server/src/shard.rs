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

pub(crate) struct Shard<S: Storage> {
    pub stream: StreamName,
    pub index: u32,
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
        };
        // Replay group entries in log order.
        let mut entries = Vec::new();
        let mut bad = None;
        let log = ShardLog::open(core.storage.clone(), dir, core.log_config(meta), &mut |e| {
            if let Replayed::Group(body) = e {
                match GroupEntry::decode(body) {
                    Ok(g) => entries.push(g),
                    Err(err) => bad = Some(err.to_string()),
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
        let mut groups: ahash::AHashMap<String, GroupTracker> = Default::default();
        for e in &entries {
            let t = groups
                .entry(e.group().to_string())
                .or_insert_with(|| GroupTracker::new(e.group(), group_config.clone()));
            t.apply_entry(e);
        }
        groups.retain(|_, t| t.exists());
        let opened = now_ms();
        for t in groups.values_mut() {
            t.rebuild(opened);
        }
        let groups: Groups = Rc::new(RefCell::new(groups));
        let snap = groups.clone();
        log.set_snapshot_provider(Box::new(move |out| {
            for t in snap.borrow().values() {
                for e in t.snapshot_entries() {
                    out.push(e.to_bytes());
                }
            }
        }));
        let shard = Rc::new(Shard {
            stream: meta.name.clone(),
            index,
            log,
            groups,
            group_config,
            deleted: std::cell::Cell::new(false),
            group_wake: Rc::new(WaitList::new()),
            timer_at: std::cell::Cell::new(0),
            timer_wake: Rc::new(WaitList::new()),
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
            let next = s
                .groups
                .borrow()
                .values()
                .filter_map(|t| t.next_deadline())
                .min();
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
            return;
        }
        let now = now_ms();
        let mut writes = Vec::new();
        let mut woke = false;
        let mono = std::time::Instant::now();
        let evict = mono >= next_evict_scan;
        if evict {
            next_evict_scan = mono + Duration::from_millis(500);
        }
        for t in s.groups.borrow_mut().values_mut() {
            if t.next_deadline().is_some_and(|d| d <= now) {
                writes.extend(t.tick(now));
                woke = true;
            }
            if evict && t.can_evict(now) {
                t.reset_to_durable();
            }
        }
        let mut body = Vec::new();
        for e in &writes {
            body.clear();
            e.encode(&mut body);
            if s.log.append_group(&body).is_err() {
                return;
            }
        }
        if woke {
            s.group_wake.wake_all();
        }
    }
}

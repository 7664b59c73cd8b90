//! One core of the broker: its listener, the connections it owns, the shards
//! it owns, and the handling of every request.
//!
//! Everything here runs on one glommio executor. Shard state is `Rc`/`RefCell`
//! on its core; the publish, read and group paths take no lock and make no
//! cross-core hop. Cross-core messages ([`CoreMsg`]) carry connection hand-offs
//! and admin fan-out (stream create/delete, metrics scrape) only.

use crate::config::Config;
use crate::conn;
use crate::metrics::{CoreMetrics, GroupSnapshot, MetricsSnapshot, ShardSnapshot};
use crate::shard::Shard;
use felix_engine::catalog::{self, StreamMeta};
use felix_engine::log::LogConfig;
use felix_engine::mailbox;
use felix_engine::notify::WaitList;
use felix_engine::runtime::{placement, CoreContext};
use felix_engine::storage::Storage;
use felix_engine::{ShardId, StreamName};
use felix_wire::{ErrorCode, Response, StreamInfo, StreamRef, WireError};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod signals;
mod start;

pub(crate) use start::run;

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A connection whose HELLO asked for another core: the socket (a duplicate
/// the receiving core now owns) and every byte read from it so far, starting
/// with the HELLO frame.
pub(crate) struct Handoff {
    pub fd: OwnedFd,
    pub buffered: Vec<u8>,
}

/// A reply to a [`CoreMsg`]: a one-message mailbox back to the asking core.
pub(crate) type Reply<T> = mailbox::Sender<T>;

/// Messages between cores, over each core's [`mailbox`]: connection
/// hand-offs, admin fan-out (stream create/delete, metrics scrape) and
/// shutdown, which also comes from the signal thread. Never the publish,
/// read or group path.
pub(crate) enum CoreMsg {
    /// Serve this connection here (its HELLO named this core).
    Handoff(Handoff),
    /// Open (creating if needed) this core's shards of a stream.
    OpenStream {
        meta: StreamMeta,
        reply: Reply<Result<(), String>>,
    },
    /// Close this core's shards of a stream and delete their files.
    DeleteStream {
        name: StreamName,
        reply: Reply<Result<(), String>>,
    },
    /// Report this core's metrics.
    Scrape { reply: Reply<MetricsSnapshot> },
    /// Stop accepting, finish in-flight requests, flush, exit.
    Shutdown,
}

/// Failures for an answer: the first two and how many more (every one is
/// in the broker's log), so a thousand shards that could not open make one
/// line, not a thousand.
fn summarize(failures: &[String]) -> String {
    match failures {
        [] => String::new(),
        [one] => one.clone(),
        [a, b] => format!("{a}; {b}"),
        [a, b, rest @ ..] => format!("{a}; {b}; and {} more (see the broker's log)", rest.len()),
    }
}

/// State shared by all cores: admin-only.
pub(crate) struct Shared {
    pub config: Config,
    pub cores: u32,
    pub durable: bool,
    pub catalog: Mutex<BTreeMap<StreamName, StreamMeta>>,
    /// Streams whose metadata did not read at start-up (and why): not
    /// served, their files kept, and their names refused to a create.
    pub damaged: BTreeMap<StreamName, String>,
    /// Streams with a create or delete in progress: a second one is refused
    /// with `unavailable` instead of interleaving with the first.
    pub busy: Mutex<std::collections::HashSet<StreamName>>,
    pub senders: Vec<mailbox::Sender<CoreMsg>>,
    pub connections: AtomicUsize,
    pub shutting_down: AtomicBool,
    /// Cores ready to serve; the last one announces the broker's addresses.
    pub ready: AtomicUsize,
    /// Cores that have finished their stop (answers sent, shards closed).
    pub stopped: AtomicUsize,
    /// Where each core is in its start-up (see [`watch_start_up`]).
    pub start_stage: Vec<std::sync::atomic::AtomicU8>,
    pub announce: Mutex<Option<(String, Option<std::net::SocketAddr>)>>,
    pub broker_id: String,
    /// Set once the executors run: how the watchdog's wake-ups are counted.
    pub kicker: std::sync::OnceLock<felix_engine::runtime::Kicker>,
    /// The tokens and permissions files as last read (at start, then on
    /// SIGHUP). Cores keep their own copy and look here only when
    /// `security_gen` moved, so the request path takes no lock.
    pub security: Mutex<Arc<crate::auth::Security>>,
    pub security_gen: std::sync::atomic::AtomicU64,
    /// SIGHUP reloads that took, and that failed.
    pub security_reloads: [std::sync::atomic::AtomicU64; 2],
    /// Each core's buffered bytes (its budget's use), as of its last
    /// second: what the allocator trimmer watches (see `crate::trim`).
    pub buffered: Vec<std::sync::atomic::AtomicU64>,
    /// The allocator trimmer's requests to the cores (see `crate::trim`).
    pub trim: crate::trim::Handshake,
}

impl Shared {
    /// The answer for a stream that is not in the catalog: `not_found`,
    /// unless its metadata is damaged (then it exists, and is refused).
    pub fn no_stream(&self, name: &StreamName) -> Response {
        self.refused_as_damaged(name)
            .unwrap_or_else(|| wire_err(ErrorCode::NotFound, format!("no stream {name}")))
    }

    /// The refusal for a stream whose metadata did not read at start-up.
    pub fn refused_as_damaged(&self, name: &StreamName) -> Option<Response> {
        let why = self.damaged.get(name)?;
        Some(wire_err(ErrorCode::Unavailable, damaged_message(name, why)))
    }

    pub fn features(&self) -> u64 {
        let mut f = felix_wire::FEATURE_PUBLISH_ACK_MODE | felix_wire::FEATURE_ERROR_NOT_APPLIED;
        if self.durable {
            f |= felix_wire::FEATURE_GROUPS
                | felix_wire::FEATURE_GROUP_SKIPPED
                | felix_wire::FEATURE_GROUP_CLAIM_CONTROL
                | felix_wire::FEATURE_GROUP_ADMIN
                | felix_wire::FEATURE_GROUP_DEAD_LETTER_PAGES;
        }
        if self.config.cluster.is_some() {
            f |= felix_wire::FEATURE_REPLICA_INFO
                | felix_wire::FEATURE_STREAM_INCARNATION
                | felix_wire::FEATURE_CLUSTER_INFO;
        }
        f
    }
}

/// One shard of a stream as one core sees it.
pub(crate) enum Slot<S: Storage> {
    /// Owned by another core.
    Elsewhere,
    /// Owned here and open.
    Open(Rc<Shard<S>>),
    /// Owned here but it could not be opened (e.g. corruption in a sealed
    /// segment): refused with `unavailable` and the reason, while the rest of
    /// the broker serves.
    Failed(String),
}

impl<S: Storage> Slot<S> {
    pub fn open(&self) -> Option<&Rc<Shard<S>>> {
        match self {
            Slot::Open(s) => Some(s),
            _ => None,
        }
    }
}

/// A stream as one core knows it.
pub(crate) struct LocalStream<S: Storage> {
    pub meta: StreamMeta,
    pub shards: Vec<Slot<S>>,
}

pub(crate) struct Core<S: Storage> {
    pub ctx: CoreContext,
    pub shared: Arc<Shared>,
    pub storage: S,
    pub streams: RefCell<HashMap<StreamRef, LocalStream<S>>>,
    pub metrics: CoreMetrics,
    /// I/O totals of the shards this core deleted, so that the broker-wide
    /// counters built from them never go backwards.
    pub retired: RefCell<ShardSnapshot>,
    /// Shards of a deleted stream still closing: out of `streams`, still
    /// counted in the metrics until `retired` holds their final numbers.
    pub retiring: RefCell<Vec<Rc<Shard<S>>>>,
    pub next_conn: Cell<u64>,
    /// Connections over the limit being answered `busy` (see `refuse`).
    refusing: Cell<usize>,
    pub in_flight: Cell<usize>,
    pub stopping: Cell<bool>,
    /// Woken each time a request finishes (shutdown waits for in-flight
    /// work to drain; backpressure waits for room).
    pub lifecycle: WaitList,
    /// Woken once, when the core starts stopping. Separate from `lifecycle`
    /// so that request completions never wake the accept loop or idle
    /// readers: re-polling a pending glommio accept or read registers its
    /// waker again, and millions of spurious polls overflow the task's
    /// waker count.
    pub stop_signal: WaitList,
    /// This core's view of the data disk's free space.
    pub disk: crate::disk::DiskGuard,
    /// Bytes this core's connections hold, against
    /// `server.max_buffered_bytes_per_core`.
    pub budget: Rc<crate::memory::Budget>,
    /// Claims and delayed nacks held by every group of this core's shards,
    /// against `groups.max_claims_per_core`.
    pub claims: felix_engine::group::SharedClaims,
    /// This core's copy of `Shared::security`, and the generation it is.
    security: RefCell<(u64, Arc<crate::auth::Security>)>,
    /// In a cluster: this core's replication (set once at start).
    pub replication: std::cell::OnceCell<crate::cluster::Replication<S>>,
    /// Shards (and stream directories) being opened at once: see
    /// [`OPEN_AT_ONCE`].
    opening: glommio::sync::Semaphore,
}

/// Shards a core opens at once (at start-up, or creating a stream): the
/// files, marks and directory syncs of one shard wait on the disk while
/// others' are in flight or their segments are read, so a core with
/// thousands of shards is not opening them one after another.
const OPEN_AT_ONCE: u64 = 16;

/// Largest `retention_bytes` / `retention_ms` a stream may have: what a
/// TOML integer (`stream.meta`) holds.
pub(crate) const MAX_STORED_RETENTION: u64 = i64::MAX as u64;

pub(crate) fn wire_err(code: ErrorCode, msg: impl Into<String>) -> Response {
    Response::Error(WireError::new(code, msg))
}

pub(crate) fn to_ref(name: &StreamName) -> StreamRef {
    StreamRef {
        tenant: name.tenant().to_string(),
        namespace: name.namespace().to_string(),
        stream: name.stream().to_string(),
    }
}

pub(crate) fn to_name(r: &StreamRef) -> Result<StreamName, Response> {
    StreamName::new(&r.tenant, &r.namespace, &r.stream)
        .map_err(|e| wire_err(ErrorCode::InvalidRequest, e.to_string()))
}

impl<S: Storage> Core<S> {
    fn new(
        ctx: CoreContext,
        shared: Arc<Shared>,
        storage: S,
        disk: crate::disk::DiskGuard,
    ) -> Rc<Core<S>> {
        let budget = Rc::new(crate::memory::Budget::new(
            shared.config.max_buffered_bytes_per_core,
        ));
        let claims = felix_engine::group::SharedClaims::new(shared.config.max_claims_per_core);
        let security = RefCell::new((
            shared.security_gen.load(Ordering::Acquire),
            shared
                .security
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        ));
        Rc::new(Core {
            ctx,
            shared,
            storage,
            streams: RefCell::new(HashMap::new()),
            metrics: CoreMetrics::default(),
            retired: RefCell::new(ShardSnapshot::default()),
            retiring: RefCell::new(Vec::new()),
            next_conn: Cell::new(0),
            refusing: Cell::new(0),
            in_flight: Cell::new(0),
            stopping: Cell::new(false),
            lifecycle: WaitList::new(),
            stop_signal: WaitList::new(),
            budget,
            claims,
            disk,
            security,
            replication: std::cell::OnceCell::new(),
            opening: glommio::sync::Semaphore::new(OPEN_AT_ONCE),
        })
    }

    /// `f` of the tokens and permissions in force: this core's copy,
    /// refreshed after a reload (one atomic load otherwise; nothing shared
    /// is written). `f` must not reach this again.
    pub fn with_security<R>(&self, f: impl FnOnce(&crate::auth::Security) -> R) -> R {
        let gen = self.shared.security_gen.load(Ordering::Acquire);
        if self.security.borrow().0 != gen {
            let fresh = self
                .shared
                .security
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            *self.security.borrow_mut() = (gen, fresh);
        }
        f(&self.security.borrow().1)
    }

    pub fn core_id(&self) -> u32 {
        self.ctx.core.0
    }

    pub fn log_config(&self, meta: &StreamMeta) -> LogConfig {
        let c = &self.shared.config;
        LogConfig {
            segment_bytes: c.segment_bytes,
            retention_bytes: meta.retention_bytes,
            retention_ms: meta.retention_ms,
            read_cache_bytes: c.read_cache_bytes,
            io_depth: c.io_queue_depth,
            write_chunk_bytes: c.write_chunk_bytes,
            max_queued_bytes: c.max_queued_bytes,
            preallocate: c.preallocate_bytes > 0,
            preallocate_step: c.preallocate_bytes,
            min_free_bytes: c.min_free_bytes,
            verify_on_open: c.verify_on_open,
            ..LogConfig::default()
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.shared
            .config
            .data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("/felix-memory"))
    }

    pub fn stream_info(&self, meta: &StreamMeta) -> StreamInfo {
        StreamInfo {
            stream: to_ref(&meta.name),
            shards: meta.shards,
            retention_bytes: meta.retention_bytes,
            retention_ms: meta.retention_ms,
            placement: (0..meta.shards)
                .map(|s| placement(&meta.name, ShardId(s), self.shared.cores).0)
                .collect(),
            incarnation: Some(meta.incarnation).filter(|i| *i != 0),
        }
    }

    /// Open this core's shards of a stream being created (making their
    /// directories), and share the read-cache budget again (see
    /// [`Self::open_stream_only`]). All or nothing on a single broker: if a
    /// shard fails to open, those this core opened are closed and removed
    /// again at once (the create is being undone, and they hold the
    /// descriptors the undoing needs). In a cluster, where their replicas
    /// may already have voted, they stay (failed shards refusing requests)
    /// until the stream is deleted on every broker.
    pub async fn open_stream(self: &Rc<Self>, meta: StreamMeta) -> Result<(), String> {
        let name = meta.name.clone();
        let r = self.open_stream_only(meta).await;
        if r.is_err() && self.replication.get().is_none() {
            if let Err(e) = self.delete_local_stream(&name).await {
                tracing::error!(stream = %name, "undoing a create that failed: {e}");
            }
        }
        self.share_caches();
        r
    }

    /// Open a stream's shards, leaving the read-cache budget as it is: at
    /// start-up the budget is shared once, after every stream is open.
    /// Not to be cancelled: the shards open in tasks of their own, and one
    /// opened but not taken into the stream would run on unclosed.
    pub async fn open_stream_only(self: &Rc<Self>, meta: StreamMeta) -> Result<(), String> {
        let key = to_ref(&meta.name);
        if self.streams.borrow().contains_key(&key) {
            return Ok(());
        }
        // A stream's shard directories are made (and made durable) before
        // its metadata, so each one the metadata names must be there. One
        // that is not has lost its records: opening it would start it again
        // at offset 0 and hand out offsets a second time.
        // A directory that cannot be listed (out of open files, say) says
        // nothing of which shards are there: its shards are refused for
        // that reason, not reported lost.
        let present: Option<Result<Vec<String>, String>> = if self.shared.durable {
            let _slot = self.opening.acquire_permit(1).await;
            let sdir = catalog::stream_dir(&self.data_dir(), &meta.name);
            Some(
                self.storage
                    .list_dir(&sdir)
                    .await
                    .map_err(|e| format!("cannot list {}: {e}", sdir.display())),
            )
        } else {
            None
        };
        // This core's shards open side by side (up to `OPEN_AT_ONCE` on the
        // core, across streams too), and take their places in order.
        enum Opening<S: Storage> {
            Decided(Slot<S>),
            Opening(glommio::Task<Slot<S>>),
        }
        let meta = Rc::new(meta);
        let mut opening = Vec::with_capacity(meta.shards as usize);
        for s in 0..meta.shards {
            if placement(&meta.name, ShardId(s), self.shared.cores) != self.ctx.core {
                opening.push(Opening::Decided(Slot::Elsewhere));
                continue;
            }
            let dir = catalog::shard_dir(&self.data_dir(), &meta.name, s);
            let refused = match &present {
                Some(Err(e)) => Some(format!(
                    "{}/{s}: {e}; the shard refuses requests until the broker is restarted \
                     and can read it",
                    meta.name
                )),
                Some(Ok(names)) if !names.iter().any(|n| *n == s.to_string()) => Some(format!(
                    "{}/{s}: shard directory {} is missing, so its records are gone; the \
                     shard refuses requests rather than start again at offset 0 \
                     (restore the directory, or delete and re-create the stream)",
                    meta.name,
                    dir.display()
                )),
                _ => None,
            };
            if let Some(why) = refused {
                tracing::error!("shard cannot be opened and will refuse requests: {why}");
                opening.push(Opening::Decided(Slot::Failed(why)));
                continue;
            }
            let core = self.clone();
            let meta = meta.clone();
            opening.push(Opening::Opening(glommio::spawn_local(async move {
                let _slot = core.opening.acquire_permit(1).await;
                core.open_shard(&meta, s, dir).await
            })));
        }
        let mut shards = Vec::with_capacity(opening.len());
        for o in opening {
            shards.push(match o {
                Opening::Decided(slot) => slot,
                Opening::Opening(task) => task.await,
            });
        }
        let failures: Vec<String> = shards
            .iter()
            .filter_map(|s| match s {
                Slot::Failed(why) => Some(why.clone()),
                _ => None,
            })
            .collect();
        let meta = Rc::unwrap_or_clone(meta);
        self.streams
            .borrow_mut()
            .insert(key, LocalStream { meta, shards });
        if failures.is_empty() {
            Ok(())
        } else {
            Err(summarize(&failures))
        }
    }

    /// Open shard `s` of `meta` from `dir`, and join it to the cluster's
    /// replication if there is one; a shard that cannot be either refuses
    /// requests with the reason.
    async fn open_shard(self: &Rc<Self>, meta: &StreamMeta, s: u32, dir: PathBuf) -> Slot<S> {
        let shard = match Shard::open(self.clone(), meta, s, &dir).await {
            Ok(shard) => shard,
            Err(e) => {
                let why = format!("{}/{s}: {e}", meta.name);
                tracing::error!("shard cannot be opened and will refuse requests: {why}");
                return Slot::Failed(why);
            }
        };
        let replicated = match self.replication.get() {
            Some(r) => r.add(&shard, dir).await,
            None => Ok(()),
        };
        match replicated {
            Ok(()) => Slot::Open(shard),
            Err(why) => {
                tracing::error!("shard cannot be replicated and will refuse requests: {why}");
                let _ = shard.log.close().await;
                Slot::Failed(why)
            }
        }
    }

    /// Share `storage.read_cache_bytes_per_core` evenly between this core's
    /// open shards (each keeping at most `storage.read_cache_bytes` of
    /// recent batches): thousands of shards on a core must not each keep a
    /// full cache. A quarter of a share (at most the default count of
    /// chunks; none for a share under 1 MiB) goes to chunks of cold reads:
    /// without one, every small poll of a backlog reads a chunk from disk.
    /// Each shard also keeps its newest batch whatever its share. Run
    /// whenever shards open or close.
    pub fn share_caches(&self) {
        let streams = self.streams.borrow();
        let open: Vec<_> = streams
            .values()
            .flat_map(|ls| ls.shards.iter().filter_map(Slot::open))
            .collect();
        if open.is_empty() {
            return;
        }
        let c = &self.shared.config;
        let d = LogConfig::default();
        let share = c.read_cache_bytes_per_core / open.len();
        let cold = (share / 4 / d.read_chunk_bytes.max(1)).min(d.cold_chunks);
        let recent = c
            .read_cache_bytes
            .min(share.saturating_sub(cold * d.read_chunk_bytes));
        for s in open {
            s.log.set_cache_limits(recent, cold);
        }
    }

    /// Close and delete this core's shards of a stream. Every shard is
    /// deleted even when one fails; the failures are logged and returned.
    pub async fn delete_local_stream(&self, name: &StreamName) -> Result<(), String> {
        let removed = self.streams.borrow_mut().remove(&to_ref(name));
        let mut problems = Vec::new();
        if let Some(ls) = removed {
            let open: Vec<_> = ls
                .shards
                .into_iter()
                .filter_map(|slot| match slot {
                    Slot::Open(shard) => Some(shard),
                    _ => None,
                })
                .collect();
            // The shards left get the room these free (they let theirs go
            // first, as they close).
            for shard in &open {
                shard.log.set_cache_limits(0, 0);
            }
            self.share_caches();
            // Counted as retiring before the first await, so a scrape while
            // they close misses none of their counters.
            self.retiring.borrow_mut().extend(open.iter().cloned());
            for shard in open {
                if let Some(r) = self.replication.get() {
                    r.remove(&shard).await;
                }
                let result = shard.destroy().await;
                self.retiring
                    .borrow_mut()
                    .retain(|s| !Rc::ptr_eq(s, &shard));
                self.retired
                    .borrow_mut()
                    .add_io(&ShardSnapshot::io_of(&shard.log.stats()));
                if let Err(e) = result {
                    tracing::error!("deleting shard {}: {e}", shard.name());
                    problems.push(format!("shard {}: {e}", shard.name()));
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(summarize(&problems))
        }
    }

    /// The shard a request names, if this core owns it; otherwise the typed
    /// error the client should get (`not_found`, `wrong_core`, ...).
    pub fn shard(&self, stream: &StreamRef, shard: u32) -> Result<Rc<Shard<S>>, Response> {
        if let Some(ls) = self.streams.borrow().get(stream) {
            return match ls.shards.get(shard as usize) {
                Some(Slot::Open(s)) => Ok(s.clone()),
                Some(Slot::Failed(why)) => Err(wire_err(
                    ErrorCode::Unavailable,
                    format!("shard {shard} of {stream} could not be opened: {why}"),
                )),
                Some(Slot::Elsewhere) => {
                    let right = placement(&ls.meta.name, ShardId(shard), self.shared.cores);
                    Err(Response::Error(WireError::wrong_core(
                        right.0,
                        format!(
                            "shard {shard} of {stream} is owned by core {}, not core {}",
                            right.0,
                            self.core_id()
                        ),
                    )))
                }
                None => Err(wire_err(
                    ErrorCode::NotFound,
                    format!(
                        "{stream} has {} shards; there is no shard {shard}",
                        ls.meta.shards
                    ),
                )),
            };
        }
        // Not known on this core: the stream may not exist, or may be being
        // created right now (its open message not yet processed here).
        let name = to_name(stream)?;
        let exists = self.shared.catalog.lock().unwrap().contains_key(&name);
        if exists {
            Err(wire_err(
                ErrorCode::Unavailable,
                format!("{stream} is being created or deleted; retry"),
            ))
        } else {
            Err(self.shared.no_stream(&name))
        }
    }

    /// Shard count of a stream known on this core.
    pub fn shard_count(&self, stream: &StreamRef) -> Option<u32> {
        self.streams.borrow().get(stream).map(|s| s.meta.shards)
    }

    /// Mark a stream busy for the length of a create or delete.
    fn claim(&self, name: &StreamName) -> Option<BusyGuard> {
        if !self.shared.busy.lock().unwrap().insert(name.clone()) {
            return None;
        }
        Some(BusyGuard {
            shared: self.shared.clone(),
            name: name.clone(),
        })
    }

    /// Create a stream: persist its metadata, then have every core open its shards.
    pub async fn create_stream(
        self: &Rc<Self>,
        stream: &StreamRef,
        shards: u32,
        retention_bytes: Option<u64>,
        retention_ms: Option<u64>,
        incarnation: Option<u64>,
    ) -> Response {
        let name = match to_name(stream) {
            Ok(n) => n,
            Err(e) => return e,
        };
        let Some(_busy) = self.claim(&name) else {
            return wire_err(
                ErrorCode::Unavailable,
                format!("{name} is being created or deleted; retry"),
            );
        };
        if let Some(refused) = self.shared.refused_as_damaged(&name) {
            return refused;
        }
        let c = &self.shared.config;
        if shards == 0 || shards > c.max_shards {
            return wire_err(
                ErrorCode::InvalidRequest,
                format!(
                    "a stream has between 1 and {} shards (limits.max_shards), not {shards}",
                    c.max_shards
                ),
            );
        }
        let meta = StreamMeta {
            name: name.clone(),
            shards,
            retention_bytes: retention_bytes.or(c.retention_bytes).filter(|b| *b > 0),
            retention_ms: retention_ms.or(c.retention_ms).filter(|b| *b > 0),
            created_ms: now_ms(),
            incarnation: incarnation.unwrap_or(0),
        };
        if meta.incarnation > i64::MAX as u64 {
            return wire_err(
                ErrorCode::InvalidRequest,
                format!("incarnation {} is over {}", meta.incarnation, i64::MAX),
            );
        }
        // `stream.meta` is TOML, whose integers are i64: a larger limit
        // would be written but refused when the broker next starts.
        for (what, v) in [
            ("retention_bytes", meta.retention_bytes),
            ("retention_ms", meta.retention_ms),
        ] {
            if let Some(v) = v.filter(|v| *v > MAX_STORED_RETENTION) {
                return wire_err(
                    ErrorCode::InvalidRequest,
                    format!(
                        "{what} {v} is over the largest the broker stores, \
                         {MAX_STORED_RETENTION}; leave it out for no limit"
                    ),
                );
            }
        }
        // Not under the catalog's lock: it lists this process's files. (A
        // stream that exists is told so first.)
        // Held until the shards are open (the end of this call).
        let _files =
            if self.shared.durable && !self.shared.catalog.lock().unwrap().contains_key(&name) {
                match crate::fds::promise_for_shards(shards) {
                    Ok(p) => Some(p),
                    Err(why) => return wire_err(ErrorCode::Unavailable, why),
                }
            } else {
                None
            };
        {
            let mut cat = self.shared.catalog.lock().unwrap();
            if cat.contains_key(&name) {
                return wire_err(
                    ErrorCode::AlreadyExists,
                    format!("stream {name} already exists"),
                );
            }
            let held: u64 = cat.values().map(|m| u64::from(m.shards)).sum();
            if held + u64::from(shards) > c.max_total_shards {
                return wire_err(
                    ErrorCode::TooLarge,
                    format!(
                        "the broker holds {held} shards; {shards} more would pass \
                         limits.max_total_shards ({})",
                        c.max_total_shards
                    ),
                );
            }
            cat.insert(name.clone(), meta.clone());
        }
        let undo = |why: String| {
            self.shared.catalog.lock().unwrap().remove(&name);
            wire_err(ErrorCode::Unavailable, why)
        };
        if self.shared.durable {
            let dir = meta.dir(&self.data_dir());
            // Anything left under the name must not come back as this
            // stream's records: cleared if `leftovers_may_go` says it is
            // left by a deletion or creation cut short, else refused.
            let leftover = match self.storage.list_dir(&dir).await {
                Ok(v) => !v.is_empty(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                Err(e) => {
                    return undo(format!(
                        "cannot look for files left in {}: {e}",
                        dir.display()
                    ))
                }
            };
            if leftover {
                let clear = match catalog::leftovers_may_go(&self.storage, &dir, &name).await {
                    Ok(clear) => clear,
                    Err(e) => return undo(format!("cannot look into {}: {e}", dir.display())),
                };
                if !clear {
                    return undo(format!(
                        "{} holds the records of a stream {name} whose metadata ({}) is \
                         missing or does not read; they are not cleared without a word: \
                         restore the metadata, or remove the directory to create the stream \
                         afresh (docs/operations.md, Recovery)",
                        dir.display(),
                        catalog::META_FILE
                    ));
                }
                if let Err(e) = self.storage.remove_dir_all(&dir).await {
                    return undo(format!(
                        "cannot clear files left by an earlier {name} in {}: {e}",
                        dir.display()
                    ));
                }
                // Durably, before the new metadata exists: a crash must not
                // bring the old files back under the new stream.
                if let Some(parent) = dir.parent() {
                    if let Err(e) = self.storage.sync_dir(parent).await {
                        return undo(format!("cannot sync {}: {e}", parent.display()));
                    }
                }
                tracing::warn!("removed files left by an earlier {name} before creating it again");
            }
            if let Err(e) = self.storage.create_dir_all(&dir).await {
                return undo(format!("cannot create {}: {e}", dir.display()));
            }
            // Shard directories first, metadata last: a stream exists on
            // disk once its metadata file does.
            for s in 0..shards {
                let sd = catalog::shard_dir(&self.data_dir(), &name, s);
                if let Err(e) = self.storage.create_dir_all(&sd).await {
                    return undo(format!("cannot create {}: {e}", sd.display()));
                }
            }
            // The shard directories' names durable before the metadata
            // that names them.
            if let Err(e) = self.storage.sync_dir(&dir).await {
                return undo(format!("cannot sync {}: {e}", dir.display()));
            }
            if let Err(e) = self
                .storage
                .write_file_atomic(&dir.join(catalog::META_FILE), meta.encode().as_bytes())
                .await
            {
                return undo(format!("cannot write stream metadata: {e}"));
            }
            // Make the new directories' names durable up to the data dir.
            let root = self.data_dir();
            let mut d = dir.clone();
            while d != root {
                let Some(parent) = d.parent().map(|p| p.to_path_buf()) else {
                    break;
                };
                if let Err(e) = self.storage.sync_dir(&parent).await {
                    return undo(format!("cannot sync {}: {e}", parent.display()));
                }
                d = parent;
            }
        }
        if let Err(e) = self.broadcast_open(&meta).await {
            tracing::error!(stream = %name, "creating: its shards did not all open: {e}");
            if self.replication.get().is_some() {
                // Its replicas may have voted already: removing them here
                // alone would let them vote again when it is created anew.
                return wire_err(
                    ErrorCode::Unavailable,
                    format!(
                        "stream {name} was created, but its shards here did not all open: {e}; \
                         those refuse requests: delete the stream on every broker and create \
                         it again once the cause is fixed"
                    ),
                );
            }
            // Not half a stream: one whose shards do not all open (out of
            // file descriptors, a full disk) is removed again (each core
            // already closed its part), so it neither lingers refusing
            // requests nor stops the next start.
            self.shared.catalog.lock().unwrap().remove(&name);
            return match self.remove_stream(meta).await {
                Ok(p) if p.is_empty() => wire_err(
                    ErrorCode::Unavailable,
                    format!("stream {name} was not created: {e}"),
                ),
                Ok(p) => wire_err(
                    ErrorCode::Unavailable,
                    format!(
                        "stream {name} was not created: {e}; and removing what was made: {}",
                        summarize(&p)
                    ),
                ),
                // Its metadata stayed, so it is back in the catalog.
                Err(_) => wire_err(
                    ErrorCode::Unavailable,
                    format!(
                        "stream {name} was made, but its shards did not all open: {e}; and it \
                         could not be removed again: delete it once the cause is fixed"
                    ),
                ),
            };
        }
        tracing::info!(stream = %name, shards, "stream created");
        Response::Stream(self.stream_info(&meta))
    }

    /// Every core opens its shards of `meta`. Waits for every core that got
    /// the message, failures or not: until then a core may still be
    /// opening, and a delete let in before it finished would miss what it
    /// opens after.
    pub async fn broadcast_open(&self, meta: &StreamMeta) -> Result<(), String> {
        let mut waits = Vec::new();
        let mut errors = Vec::new();
        for (core, tx) in self.shared.senders.iter().enumerate() {
            let (reply, rx) = match mailbox::channel() {
                Ok(c) => c,
                Err(e) => {
                    errors.push(format!("core {core}: no mailbox: {e}"));
                    continue;
                }
            };
            match tx.send(CoreMsg::OpenStream {
                meta: meta.clone(),
                reply,
            }) {
                Ok(()) => waits.push((core, rx)),
                Err(_) => errors.push(format!("core {core} has stopped")),
            }
        }
        for (core, rx) in waits {
            match rx.attach().recv().await {
                Some(Ok(())) => {}
                Some(Err(e)) => errors.push(e),
                None => errors.push(format!("core {core} has stopped")),
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(summarize(&errors))
        }
    }

    pub async fn delete_stream(&self, stream: &StreamRef) -> Response {
        let name = match to_name(stream) {
            Ok(n) => n,
            Err(e) => return e,
        };
        let Some(_busy) = self.claim(&name) else {
            return wire_err(
                ErrorCode::Unavailable,
                format!("{name} is being created or deleted; retry"),
            );
        };
        let meta = self.shared.catalog.lock().unwrap().remove(&name);
        let Some(meta) = meta else {
            return self.shared.no_stream(&name);
        };
        match self.remove_stream(meta).await {
            Err(answer) => answer,
            Ok(problems) if problems.is_empty() => {
                tracing::info!(stream = %name, "stream deleted");
                Response::Ok
            }
            Ok(problems) => wire_err(
                ErrorCode::Internal,
                format!(
                    "stream {name} is deleted, but not cleanly: {}",
                    summarize(&problems)
                ),
            ),
        }
    }

    /// Remove a stream already out of the catalog (under its claim): its
    /// metadata first, then every core's shards, then its files. `Err` (the
    /// answer) if its metadata could not go, in which case it is put back
    /// whole; otherwise what went wrong on the way, if anything.
    async fn remove_stream(&self, meta: StreamMeta) -> Result<Vec<String>, Response> {
        let name = meta.name.clone();
        let mut problems = Vec::new();
        let mut keep_files = false;
        if self.shared.durable {
            // Metadata first: once it says `deleted` the stream does not
            // come back after a crash, whatever shard files remain, and a
            // create of the name may clear them (files whose metadata is
            // simply missing it does not clear).
            let dir = meta.dir(&self.data_dir());
            let meta_file = dir.join(catalog::META_FILE);
            match self
                .storage
                .write_file_atomic(&meta_file, meta.encode_deleted().as_bytes())
                .await
            {
                Ok(()) => {}
                Err(e) => {
                    // Nothing is deleted yet: the stream stays, whole.
                    tracing::error!(
                        "cannot delete {name}: marking {} deleted: {e}",
                        meta_file.display()
                    );
                    self.shared
                        .catalog
                        .lock()
                        .unwrap()
                        .insert(name.clone(), meta);
                    return Err(wire_err(
                        ErrorCode::Internal,
                        format!(
                            "cannot delete {name}: marking {} deleted: {e}; the stream is \
                             unchanged",
                            meta_file.display()
                        ),
                    ));
                }
            }
            if let Err(e) = self.storage.sync_dir(&dir).await {
                // The deletion goes on, but its files stay (a crash could
                // bring the metadata back: it must find them); creating the
                // name again clears them. The answer says so.
                tracing::error!("deleting {name}: syncing {}: {e}", dir.display());
                problems.push(format!(
                    "syncing {} failed, so the deletion may not survive a crash; its files \
                     are left until the name is created again: {e}",
                    dir.display()
                ));
                keep_files = true;
            }
        }
        let mut waits = Vec::new();
        for tx in &self.shared.senders {
            let (reply, rx) = match mailbox::channel() {
                Ok(x) => x,
                Err(e) => {
                    problems.push(format!("no mailbox: {e}"));
                    continue;
                }
            };
            if tx
                .send(CoreMsg::DeleteStream {
                    name: name.clone(),
                    reply,
                })
                .is_ok()
            {
                waits.push(rx);
            }
        }
        for rx in waits {
            if let Some(Err(e)) = rx.attach().recv().await {
                problems.push(e);
            }
        }
        if self.shared.durable && !keep_files {
            let dir = meta.dir(&self.data_dir());
            if let Err(e) = self.remove_stream_dir(&dir).await {
                // The stream is gone (its metadata says so); the files left
                // are removed when the name is created again.
                tracing::error!("deleting {name}: removing {}: {e}", dir.display());
                problems.push(format!("removing {}: {e}", dir.display()));
            }
        }
        Ok(problems)
    }

    /// Remove a deleted stream's directory: the shards' files first (those
    /// of shards that never opened are still there), durably, and only then
    /// the metadata. Removing it all at once could let a crash keep the
    /// metadata's removal and not the segments', leaving records with no
    /// metadata, which a create then refuses to clear.
    async fn remove_stream_dir(&self, dir: &Path) -> std::io::Result<()> {
        let names = match self.storage.list_dir(dir).await {
            Ok(v) => v,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        for n in names.iter().filter(|n| n.as_str() != catalog::META_FILE) {
            let p = dir.join(n);
            match self.storage.remove_dir_all(&p).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
                    self.storage.remove_file(&p).await?
                }
                Err(e) => return Err(e),
            }
        }
        self.storage.sync_dir(dir).await?;
        self.storage.remove_dir_all(dir).await
    }

    /// Metrics of this core, as plain numbers another core can merge.
    /// Yields between groups: describing thousands of groups with full
    /// in-flight tables must not hold up the core's connections.
    pub async fn snapshot(&self) -> MetricsSnapshot {
        let mut snap = self.metrics.snapshot();
        let read_cache = self
            .streams
            .borrow()
            .values()
            .flat_map(|ls| ls.shards.iter().filter_map(Slot::open))
            .map(|s| s.log.stats().cache_bytes)
            .sum();
        snap.buffered.push(crate::metrics::BufferedSnapshot {
            core: self.core_id(),
            bytes: self.budget.used() as u64,
            peak: self.budget.peak() as u64,
            waits: self.budget.waits(),
            read_cache,
            claims: self.claims.held(),
            overdraft_frames: self.budget.overdraft(crate::memory::Past::Frames) as u64,
            overdraft_requests: self.budget.overdraft(crate::memory::Past::Requests) as u64,
            overdraft_answers: (self.budget.overdraft(crate::memory::Past::Answers)
                + self.budget.overdraft(crate::memory::Past::CutAnswers))
                as u64,
        });
        snap.retired = self.retired.borrow().clone();
        snap.max_groups = self.shared.config.metrics_max_groups;
        for s in self.retiring.borrow().iter() {
            snap.retired.add_io(&ShardSnapshot::io_of(&s.log.stats()));
        }
        // (stream, shard, group, its shard) of every group on this core.
        let mut named = Vec::new();
        for (r, ls) in self.streams.borrow().iter() {
            for (i, s) in ls.shards.iter().enumerate() {
                if let Slot::Failed(_) = s {
                    snap.shards.push(ShardSnapshot {
                        stream: r.to_string(),
                        shard: i as u32,
                        stopped: true,
                        unopened: true,
                        ..Default::default()
                    });
                }
                if let Some(s) = s.open() {
                    let st = s.log.stats();
                    snap.shards.push(ShardSnapshot {
                        stream: r.to_string(),
                        shard: i as u32,
                        start: st.start.0,
                        end: st.end.0,
                        bytes: st.bytes,
                        stopped: st.stopped.is_some(),
                        replica: s.replica.get().map(|r| crate::metrics::ReplicaSnapshot {
                            term: r.host.term(r.group).unwrap_or(0),
                            leads: r.host.serving(r.group),
                            log_entries: r.host.log_len(r.group).unwrap_or(0) as u64,
                            compacted: r.host.compacted(r.group).map_or(0, |c| c.index),
                        }),
                        ..ShardSnapshot::io_of(&st)
                    });
                    for (name, t) in s.groups.borrow().iter() {
                        // A tracker kept only for standing claims after a
                        // delete has no group to report.
                        if t.exists() {
                            named.push((r.to_string(), i as u32, name.clone(), s.clone()));
                        }
                    }
                }
            }
        }
        // The first groups by name (each core's first are enough for the
        // first of all), and only those described: a describe walks the
        // group's claims.
        named.sort_unstable_by(|a, b| (&a.0, a.1, &a.2).cmp(&(&b.0, b.1, &b.2)));
        snap.groups_omitted = named.len().saturating_sub(snap.max_groups) as u64;
        named.truncate(snap.max_groups);
        snap.groups.reserve(named.len());
        for (stream, index, group, shard) in named {
            snap.groups
                .extend(describe_group(stream, index, group, &shard));
            glommio::yield_if_needed().await;
        }
        snap
    }

    /// Process cross-core messages until shutdown.
    pub async fn run_mailbox(self: Rc<Self>, rx: mailbox::Receiver<CoreMsg>) {
        let mut rx = rx.attach();
        while let Some(msg) = rx.recv().await {
            match msg {
                CoreMsg::Handoff(Handoff { fd, buffered }) => {
                    let stream = <glommio::net::TcpStream as std::os::fd::FromRawFd>::from_raw_fd;
                    // SAFETY: the descriptor is ours alone (the sending core
                    // dup'ed it and dropped its own); glommio takes it over.
                    let stream = unsafe { stream(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
                    glommio::spawn_local(conn::serve(self.clone(), stream, buffered, true))
                        .detach();
                }
                // Stream opens and deletes run beside each other (the busy
                // set keeps two on one stream apart) and never hold up a
                // hand-off.
                CoreMsg::OpenStream { meta, reply } => {
                    let core = self.clone();
                    glommio::spawn_local(async move {
                        let r = core.open_stream(meta).await;
                        let _ = reply.send(r);
                    })
                    .detach();
                }
                CoreMsg::DeleteStream { name, reply } => {
                    let core = self.clone();
                    glommio::spawn_local(async move {
                        let r = core.delete_local_stream(&name).await;
                        let _ = reply.send(r);
                    })
                    .detach();
                }
                CoreMsg::Scrape { reply } => {
                    // Its own task: a scrape that yields must not hold up
                    // the connections handed to this core meanwhile.
                    let core = self.clone();
                    glommio::spawn_local(async move {
                        let _ = reply.send(core.snapshot().await);
                    })
                    .detach();
                }
                CoreMsg::Shutdown => {
                    self.stopping.set(true);
                    self.lifecycle.wake_all();
                    self.stop_signal.wake_all();
                    break;
                }
            }
        }
    }

    /// Resolves once this core starts shutting down.
    pub async fn until_stopping(&self) {
        while !self.stopping.get() {
            self.stop_signal.wait().await;
        }
    }

    /// Finish in-flight requests (up to the grace period), then close every
    /// shard: flush and sync what is queued.
    pub async fn drain_and_close(&self) {
        let grace = Duration::from_millis(self.shared.config.shutdown_grace_ms);
        let deadline = std::time::Instant::now() + grace;
        while self.in_flight.get() > 0 && std::time::Instant::now() < deadline {
            let _ = glommio::timer::timeout(Duration::from_millis(50), async {
                self.lifecycle.wait().await;
                Ok(())
            })
            .await;
        }
        if self.in_flight.get() > 0 {
            tracing::warn!(
                core = self.core_id(),
                requests = self.in_flight.get(),
                "shutdown grace period over with requests in flight"
            );
        }
        // Then the connections: each answers what it read meanwhile
        // (refused) and sends its answers before it closes. The process
        // exits after this, and an answer still queued would be lost with
        // it, its request carried out or not. A client that reads takes
        // them in milliseconds; one that does not is not waited for long.
        let sent_by = deadline.min(std::time::Instant::now() + ANSWERS_GRACE);
        while self.metrics.connections_open.get() > 0 && std::time::Instant::now() < sent_by {
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
        let shards: Vec<Rc<Shard<S>>> = self
            .streams
            .borrow()
            .values()
            .flat_map(|ls| ls.shards.iter().filter_map(|s| s.open().cloned()))
            .collect();
        // All at once: each close syncs and writes its shard's clean mark.
        let closes: Vec<_> = shards
            .into_iter()
            .map(|s| {
                glommio::spawn_local(async move {
                    if let Err(e) = s.log.close().await {
                        tracing::error!("closing {}: {e}", s.name());
                    }
                })
            })
            .collect();
        for c in closes {
            c.await;
        }
    }
}

fn damaged_message(name: &StreamName, why: &str) -> String {
    format!(
        "stream {name} is not served: its metadata does not read ({why}); its files are kept \
         as they are (see docs/operations.md, Recovery)"
    )
}

/// How long a stopping core waits, once its requests are done, for its
/// connections to send their last answers: room for a connection's
/// refusing (up to 0.5 s and a quiet read of 100 ms), its client taking the
/// answers (a busy machine may not run it for a while) and its linger
/// after them (0.5 s), so that none closes with answers undelivered or
/// unread bytes (see `conn.rs`). Within the shutdown grace.
const ANSWERS_GRACE: Duration = Duration::from_secs(4);

/// Releases a stream's busy mark when a create or delete ends.
pub(crate) struct BusyGuard {
    shared: Arc<Shared>,
    name: StreamName,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.shared.busy.lock().unwrap().remove(&self.name);
    }
}

/// Where a group stands on a shard (what `group_describe` answers), for the
/// per-group gauges; `None` if it is gone. Describing is not activity:
/// scrapes never keep an idle group's state in memory.
fn describe_group<S: Storage>(
    stream: String,
    index: u32,
    group: String,
    shard: &Shard<S>,
) -> Option<GroupSnapshot> {
    let view = crate::groups::view(shard);
    let mut groups = shard.groups.borrow_mut();
    let t = groups.get_mut(&group)?;
    Some(GroupSnapshot {
        stream,
        shard: index,
        group,
        status: crate::groups::described(shard, t, view).ok()?,
        counters: t.counters(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_engine::storage::sim::SimStorage;
    use felix_engine::CoreId;
    use std::path::Path;

    /// One durable core on the simulated disk, its mailbox served.
    fn core_on(storage: SimStorage) -> Rc<Core<SimStorage>> {
        let mut config =
            Config::load_with_env(None, &Default::default(), &Default::default()).unwrap();
        config.data_dir = Some(PathBuf::from("/data"));
        let (tx, rx) = mailbox::channel().unwrap();
        let shared = Arc::new(Shared {
            config,
            cores: 1,
            durable: true,
            catalog: Mutex::new(BTreeMap::new()),
            damaged: BTreeMap::new(),
            busy: Mutex::new(Default::default()),
            senders: vec![tx],
            connections: AtomicUsize::new(0),
            shutting_down: AtomicBool::new(false),
            ready: AtomicUsize::new(0),
            stopped: AtomicUsize::new(0),
            start_stage: vec![Default::default()],
            announce: Mutex::new(None),
            broker_id: "felix-test".into(),
            kicker: std::sync::OnceLock::new(),
            security: Mutex::new(Arc::new(Default::default())),
            security_gen: std::sync::atomic::AtomicU64::new(0),
            security_reloads: Default::default(),
            buffered: vec![Default::default()],
            trim: crate::trim::Handshake::new(1),
        });
        let ctx = CoreContext {
            core: CoreId(0),
            cores: 1,
            cpu: None,
        };
        let core = Core::new(
            ctx,
            shared,
            storage,
            crate::disk::DiskGuard::new(None, 0, 1),
        );
        glommio::spawn_local(core.clone().run_mailbox(rx)).detach();
        core
    }

    fn stream_ref() -> StreamRef {
        StreamRef {
            tenant: "t".into(),
            namespace: "n".into(),
            stream: "s".into(),
        }
    }

    /// A stream created again over files a deleted one left behind, cut off
    /// by a power cut at every point it can be, on a disk that loses every
    /// directory entry not synced: once the new stream's metadata is on
    /// disk, the old records are not.
    #[test]
    fn a_stream_created_again_never_gets_its_leftover_files_back_after_a_crash() {
        glommio::LocalExecutorBuilder::default()
            .spawn(|| async {
                let old = felix_engine::format::RecordIn {
                    payload: bytes::Bytes::from_static(b"old record"),
                    ..Default::default()
                };
                for k in 0.. {
                    let storage = SimStorage::new();
                    let core = core_on(storage.clone());
                    let stream = stream_ref();
                    let created = core.create_stream(&stream, 1, None, None, None).await;
                    assert!(matches!(created, Response::Stream(_)), "{created:?}");
                    let shard = core.shard(&stream, 0).unwrap();
                    shard.log.append(std::slice::from_ref(&old)).unwrap();
                    shard.log.flush().await.unwrap();
                    drop(shard);
                    // Deleted, then a crash brings its files back: the
                    // sync after their removal failed (the metadata's
                    // `deleted` was durable already).
                    storage.fail_dir_sync_after(2);
                    let deleted = core.delete_stream(&stream).await;
                    assert!(
                        error_of(deleted).message.contains("not cleanly"),
                        "the failed sync is reported"
                    );
                    storage.crash_lose_unsynced();
                    let seg = PathBuf::from("/data/t/n/s/0/00000000000000000000.log");
                    assert!(storage.file_len(&seg).unwrap() > 0);
                    storage.set_yielding(true);
                    let mut create =
                        std::pin::pin!(core.create_stream(&stream, 1, None, None, None));
                    let mut done = false;
                    for _ in 0..k {
                        if futures_lite::future::poll_once(&mut create).await.is_some() {
                            done = true;
                            break;
                        }
                        // Let the mailbox task and its socket run (the open
                        // fan-out); how long does not matter, every step is
                        // tried.
                        glommio::timer::sleep(Duration::from_millis(1)).await;
                    }
                    storage.set_yielding(false);
                    storage.crash_lose_unsynced();
                    let _ = core.shared.senders[0].send(CoreMsg::Shutdown);
                    // The new stream's metadata (not the old one's, marked
                    // deleted).
                    let meta = futures_lite::future::block_on(
                        storage.read_file(Path::new("/data/t/n/s/stream.meta")),
                    )
                    .unwrap()
                    .filter(|m| !String::from_utf8_lossy(m).contains("deleted = true"));
                    if meta.is_some() {
                        assert!(
                            storage.file_len(&seg).unwrap_or(0) == 0,
                            "step {k}: the new stream has the old one's records"
                        );
                    }
                    if done {
                        assert!(meta.is_some());
                        break;
                    }
                    assert!(k < 200, "the create never finished");
                }
            })
            .unwrap()
            .join()
            .unwrap();
    }

    /// A stream directory that cannot be listed at start-up (the process
    /// out of open files) says nothing of which shards are there: its
    /// shards are refused for that reason, never reported lost (the advice
    /// for a lost shard is to delete and re-create the stream).
    #[test]
    fn an_unlistable_stream_directory_refuses_its_shards_without_calling_them_lost() {
        glommio::LocalExecutorBuilder::default()
            .spawn(|| async {
                let storage = SimStorage::new();
                let core = core_on(storage.clone());
                let stream = stream_ref();
                let created = core.create_stream(&stream, 2, None, None, None).await;
                assert!(matches!(created, Response::Stream(_)), "{created:?}");
                let name = to_name(&stream).unwrap();
                let meta = core.shared.catalog.lock().unwrap()[&name].clone();
                let _ = core.shared.senders[0].send(CoreMsg::Shutdown);
                // A broker starting again over the same files.
                let again = core_on(storage.clone());
                storage.fail_list_dir_after(1);
                let why = again.open_stream_only(meta.clone()).await.unwrap_err();
                assert!(why.contains("cannot list /data/t/n/s"), "{why}");
                assert!(why.contains("os error 24"), "{why}");
                assert!(
                    !why.contains("missing") && !why.contains("re-create"),
                    "{why}"
                );
                let e = match again.shard(&stream, 0) {
                    Err(Response::Error(e)) => e,
                    other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
                };
                assert!(e.message.contains("cannot list"), "{}", e.message);
                // Listed, the same files open.
                let third = core_on(storage.clone());
                third.open_stream_only(meta).await.unwrap();
                assert!(third.shard(&stream, 1).is_ok());
            })
            .unwrap()
            .join()
            .unwrap();
    }

    fn error_of(r: Response) -> WireError {
        match r {
            Response::Error(e) => e,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    /// A stream deletion that cannot remove files answers an error saying
    /// what was not removed: the metadata (the stream stays, whole), or a
    /// shard's files (the stream is gone, the answer names the shard).
    #[test]
    fn deleting_a_stream_whose_files_cannot_be_removed_answers_an_error() {
        glommio::LocalExecutorBuilder::default()
            .spawn(|| async {
                let storage = SimStorage::new();
                let core = core_on(storage.clone());
                let stream = StreamRef {
                    tenant: "t".into(),
                    namespace: "n".into(),
                    stream: "s".into(),
                };
                let name = to_name(&stream).unwrap();
                let created = core.create_stream(&stream, 2, None, None, None).await;
                assert!(matches!(created, Response::Stream(_)), "{created:?}");

                // The metadata cannot be marked deleted.
                storage.fail_atomic_write_after(1);
                let e = error_of(core.delete_stream(&stream).await);
                assert_eq!(e.code, ErrorCode::Internal);
                assert!(
                    e.message.contains("/data/t/n/s/stream.meta"),
                    "{}",
                    e.message
                );
                assert!(e.message.contains("unchanged"), "{}", e.message);
                assert!(core.shared.catalog.lock().unwrap().contains_key(&name));
                assert!(core.shard(&stream, 0).is_ok());
                assert!(core.shard(&stream, 1).is_ok());

                // Shard 0's files cannot be removed (remove 1 is shard 0,
                // 2 shard 1, 3 the stream directory).
                storage.fail_remove_after(1);
                let e = error_of(core.delete_stream(&stream).await);
                assert_eq!(e.code, ErrorCode::Internal);
                assert!(e.message.contains("shard t/n/s/0"), "{}", e.message);
                assert!(
                    e.message.contains("simulated remove failure"),
                    "{}",
                    e.message
                );
                assert!(!core.shared.catalog.lock().unwrap().contains_key(&name));
                let deleted = core.delete_stream(&stream).await;
                assert_eq!(error_of(deleted).code, ErrorCode::NotFound);

                // The stream directory cannot be removed: deleted, not cleanly.
                let created = core.create_stream(&stream, 1, None, None, None).await;
                assert!(matches!(created, Response::Stream(_)), "{created:?}");
                storage.fail_remove_after(2);
                let e = error_of(core.delete_stream(&stream).await);
                assert!(e.message.contains("removing /data/t/n/s"), "{}", e.message);
                // What is left says the stream is deleted (it does not
                // come back at a restart), and a create clears it.
                let left = storage
                    .read_file(Path::new("/data/t/n/s/stream.meta"))
                    .await
                    .unwrap()
                    .expect("the metadata was left");
                assert!(String::from_utf8_lossy(&left).contains("deleted = true"));
                let created = core.create_stream(&stream, 1, None, None, None).await;
                assert!(matches!(created, Response::Stream(_)), "{created:?}");
            })
            .unwrap()
            .join()
            .unwrap();
    }
}

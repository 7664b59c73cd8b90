//! The replicas of one core, driven over TCP on a glommio executor.
//!
//! A `Host` owns every replica one core holds (one per replica group, all
//! with the host's id as their replica id), and runs three kinds of task:
//!
//! * a ticker: every `tick` it ticks every replica;
//! * a pass: whenever something happened (a tick, a message, a proposal),
//!   it drains every replica once, sends **one frame per peer** holding all
//!   of that pass's messages for it (heartbeats and appends of every group
//!   together), and settles the owner's waiting proposals and reads;
//! * links: one outgoing connection per peer, reconnecting with backoff and
//!   a timeout on connecting, on the handshake and on each write (frames queued past a byte
//!   bound, or while the link is down, are dropped and the peer reported
//!   unreachable to every replica, so leaders probe it again instead of
//!   waiting on appends that never arrived), and a reader per incoming
//!   connection (at most `max_inbound` at once, each closed after
//!   `idle_timeout` without a byte) that decodes frames and steps the
//!   replicas they are for. Every connection opens with a [`handshake`]:
//!   the dialer proves it knows the cluster's [`PeerKey`] and names itself,
//!   and its reader then takes only messages from that peer.
//!
//! [`handshake`]: crate::handshake
//!
//! Nothing here crosses cores: core *i* of a broker talks to core *i* of
//! its peers.
//!
//! With a `data_dir` ([`Host::open`]) each replica's log is durable: a
//! persister task takes what the replicas ask to be made durable
//! ([`Event::Persist`]), writes it to each group's [`Journal`] (a run of
//! contiguous entries in one append, however many asks it came in: one
//! write per segment it reaches) and syncs it, the groups at once, stores a hard state whose term or vote
//! changed, and only then tells the replicas (`Replica::persisted`), which
//! releases the append responses and votes that waited on it. One round
//! takes whatever queued while the last was on disk: group commit. A host
//! reopened on the same directory carries on with its term, vote and
//! entries, and applies its committed entries again from the first. An
//! I/O error stops the group's replica (its proposals and reads fail)
//! rather than let it answer as if its writes were durable.
//!
//! Without a `data_dir` ([`Host::start`]) the logs are in memory: a host
//! that stops loses its replicas' state and must not be restarted under
//! the same id (its vote and acknowledged entries would be forgotten).
//!
//! The tasks hold the host weakly: dropping the last `Host` handle stops
//! them as `close` does. `publish` and `read` have no timeout of their own
//! (a deposed leader's proposal settles only once its index is applied);
//! callers bound them.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::rc::{Rc, Weak};
use std::time::Duration;

use bytes::Bytes;
use felix_engine::format::{self, AppendRecord};
use felix_engine::notify::WaitList;
use felix_engine::storage::dma::DmaStorage;
use felix_engine::storage::Storage;
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::channels::local_channel::{self, LocalSender};
use glommio::net::{TcpListener, TcpStream};
use glommio::Task;

use crate::handshake::{self, PeerKey, ACCEPT_BYTES, CHALLENGE_BYTES, PROOF_BYTES};
use crate::hard_state;
use crate::journal::{Journal, JournalConfig, JournalError};
use crate::log::{Compacted, ReplicaLog};
use crate::replica::{Applied, Event, Landed, Replica, ReplicaConfig, ReplicationError};
use crate::wire::{
    decode_frame, encode_frame, frame_len, framed_len, PeerMessage, FRAME_HEADER_BYTES,
    FRAME_MAX_MESSAGES,
};
use crate::Message;
use raft::eraftpb::{Entry, HardState};

/// How a host runs.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// This host's id (the replica id of all its replicas).
    pub id: u64,
    /// Every host of the cluster but this one: where its replication
    /// listener for this core is.
    pub peers: BTreeMap<u64, SocketAddr>,
    /// One replica tick.
    pub tick: Duration,
    /// Largest frame sent or taken (at most 4 GiB; at least room for a
    /// full append of `replica.max_append_bytes`).
    pub max_frame: usize,
    /// Bytes of frames queued for one peer before the oldest are dropped.
    pub max_queued_bytes: usize,
    /// Connecting to a peer, and each write to it, gives up after this.
    pub io_timeout: Duration,
    /// An incoming connection without a byte for this long is closed
    /// (a live peer sends heartbeats every few ticks).
    pub idle_timeout: Duration,
    /// Incoming connections served at once.
    pub max_inbound: usize,
    /// Replica settings (the id is set per host).
    pub replica: ReplicaConfig,
    /// Where the replicas' logs and hard states live (one directory per
    /// group, `group-{id}`); `None` keeps them in memory. Only
    /// [`Host::open`] reads it.
    pub data_dir: Option<PathBuf>,
    /// How each group's journal lays out its files.
    pub journal: JournalConfig,
    /// The key peers prove themselves with ([`handshake`]): the same on
    /// every host of the cluster. Default: the key of no secret.
    ///
    /// [`handshake`]: crate::handshake
    pub peer_key: PeerKey,
}

impl HostConfig {
    pub fn new(id: u64, peers: BTreeMap<u64, SocketAddr>) -> HostConfig {
        HostConfig {
            id,
            peers,
            tick: Duration::from_millis(10),
            max_frame: 64 << 20,
            max_queued_bytes: 64 << 20,
            io_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(10),
            max_inbound: 64,
            replica: ReplicaConfig::new(id),
            data_dir: None,
            journal: JournalConfig::default(),
            peer_key: PeerKey::open(),
        }
    }

    /// A group's directory under `data_dir`.
    pub fn group_dir(data_dir: &Path, group: u64) -> PathBuf {
        data_dir.join(format!("group-{group}"))
    }

    fn check(&self, groups: &[(u64, Vec<u64>)]) -> Result<(), ReplicationError> {
        let bad = |why: String| Err(ReplicationError::Stopped(format!("host config: {why}")));
        if self.max_frame > u32::MAX as usize {
            return bad(format!("max_frame {} is over 4 GiB", self.max_frame));
        }
        if (self.replica.max_append_bytes as usize).saturating_add(FRAME_SLACK) > self.max_frame {
            return bad(format!(
                "max_frame {} has no room for an append of {} bytes",
                self.max_frame, self.replica.max_append_bytes
            ));
        }
        for (group, voters) in groups {
            if let Some(v) = voters
                .iter()
                .find(|&&v| v != self.id && !self.peers.contains_key(&v))
            {
                return bad(format!("group {group}: no address for voter {v}"));
            }
        }
        Ok(())
    }
}

/// What a group asked to be made durable, waiting for the persister.
struct PersistAsk {
    group: u64,
    number: u64,
    entries: Vec<Entry>,
    hard_state: Option<HardState>,
}

/// A group's durable state, owned by the persister task.
struct GroupDisk {
    dir: PathBuf,
    journal: Journal<DmaStorage>,
    /// The term and vote last stored.
    stored: (u64, u64),
}

/// Called with every entry a replica applies, in order: (group, entry).
pub type ApplyHook = Box<dyn FnMut(u64, &Applied)>;

/// What a proposal or read is settled with.
type Settled = Result<Settle, ReplicationError>;

#[derive(Debug)]
enum Settle {
    Landed(Landed),
    Read(u64),
}

struct Link {
    queue: RefCell<VecDeque<Bytes>>,
    queued_bytes: Cell<usize>,
    ready: WaitList,
    /// Frames were lost (dropped, or the connection failed): the next pass
    /// reports the peer unreachable to every replica.
    lost: Cell<bool>,
    /// Frames or messages dropped so far (not counting a failed write).
    dropped: Cell<u64>,
}

impl Link {
    fn push(&self, frame: Bytes, max_bytes: usize) {
        let mut q = self.queue.borrow_mut();
        self.queued_bytes.set(self.queued_bytes.get() + frame.len());
        q.push_back(frame);
        while self.queued_bytes.get() > max_bytes && q.len() > 1 {
            let old = q.pop_front().expect("more than one queued");
            self.queued_bytes.set(self.queued_bytes.get() - old.len());
            self.drop_one();
        }
        drop(q);
        self.ready.wake_all();
    }

    fn pop(&self) -> Option<Bytes> {
        let f = self.queue.borrow_mut().pop_front()?;
        self.queued_bytes.set(self.queued_bytes.get() - f.len());
        Some(f)
    }

    fn drop_one(&self) {
        self.lost.set(true);
        self.dropped.set(self.dropped.get() + 1);
    }

    fn clear(&self) {
        for _ in 0..self.queue.borrow().len() {
            self.drop_one();
        }
        self.queue.borrow_mut().clear();
        self.queued_bytes.set(0);
    }
}

struct Inner {
    config: HostConfig,
    replicas: RefCell<BTreeMap<u64, Replica>>,
    waiting: RefCell<HashMap<u64, LocalSender<Settled>>>,
    next_token: Cell<u64>,
    links: BTreeMap<u64, Rc<Link>>,
    /// Something happened since the last pass.
    dirty: Cell<bool>,
    wake_pass: Rc<WaitList>,
    on_applied: RefCell<ApplyHook>,
    tasks: RefCell<Vec<Task<()>>>,
    closed: Cell<bool>,
    /// Writes waiting for the persister (durable hosts only).
    persist: RefCell<Vec<PersistAsk>>,
    /// Journals to compact, after the writes (durable hosts only).
    compactions: RefCell<Vec<(u64, Compacted)>>,
    wake_persister: Rc<WaitList>,
    /// Durable hosts: the storage, and groups added or removed since the
    /// persister last looked (it owns the groups' disks).
    storage: Option<DmaStorage>,
    added: RefCell<Vec<(u64, GroupDisk)>>,
    removed: RefCell<Vec<(u64, LocalSender<()>)>>,
    /// When a refused incoming connection was last logged as a warning
    /// (a peer with the wrong secret retries every second).
    refusal_logged: Cell<Option<std::time::Instant>>,
}

/// The replicas of one core and their connections to their peers.
#[derive(Clone)]
pub struct Host {
    inner: Rc<Inner>,
}

impl Host {
    /// Start a host on the current glommio executor, serving `listener`
    /// (this core's replication port), with one replica per group in
    /// `groups` (group id → its voters, this host among them, and every
    /// other one in `config.peers`).
    pub fn start(
        config: HostConfig,
        listener: TcpListener,
        groups: &[(u64, Vec<u64>)],
        on_applied: ApplyHook,
    ) -> Result<Host, ReplicationError> {
        config.check(groups)?;
        if config.data_dir.is_some() {
            return Err(ReplicationError::Stopped(
                "host config: a data_dir is opened with Host::open, not kept in memory".into(),
            ));
        }
        let mut replicas = BTreeMap::new();
        for (group, voters) in groups {
            let mut rc = config.replica.clone();
            rc.id = config.id;
            rc.async_persist = false;
            replicas.insert(*group, Replica::open(rc, ReplicaLog::new(voters))?);
        }
        Ok(Host::run(config, listener, replicas, None, on_applied))
    }

    /// Start a host as [`Host::start`] does, with each group's log and hard
    /// state kept under `config.data_dir` (in memory without one): a
    /// group's replica comes back with the term, vote and entries it had
    /// made durable. A damaged journal or hard state, or a commit index
    /// past the entries kept, is an error: a replica that forgot what it
    /// acknowledged or voted must not take part.
    pub async fn open(
        config: HostConfig,
        listener: TcpListener,
        groups: &[(u64, Vec<u64>)],
        on_applied: ApplyHook,
    ) -> Result<Host, ReplicationError> {
        let Some(data_dir) = config.data_dir.clone() else {
            return Host::start(config, listener, groups, on_applied);
        };
        config.check(groups)?;
        // glommio settles how it reads a disk at the first DMA file an
        // executor opens; an empty one (a new journal) makes it guess
        // wrong. The broker's runtime does this at each core's start; a
        // second time costs a small file.
        felix_engine::runtime::warm_up_dma(&data_dir)
            .await
            .map_err(|e| ReplicationError::Stopped(format!("{}: {e}", data_dir.display())))?;
        let storage = DmaStorage::new();
        let mut replicas = BTreeMap::new();
        let mut disks = BTreeMap::new();
        for (group, voters) in groups {
            let dir = HostConfig::group_dir(&data_dir, *group);
            let (replica, disk) = open_group(&storage, &config, &dir, *group, voters).await?;
            replicas.insert(*group, replica);
            disks.insert(*group, disk);
        }
        Ok(Host::run(
            config,
            listener,
            replicas,
            Some((storage, disks)),
            on_applied,
        ))
    }

    fn run(
        config: HostConfig,
        listener: TcpListener,
        replicas: BTreeMap<u64, Replica>,
        disks: Option<(DmaStorage, BTreeMap<u64, GroupDisk>)>,
        on_applied: ApplyHook,
    ) -> Host {
        let links = config
            .peers
            .keys()
            .map(|&p| {
                (
                    p,
                    Rc::new(Link {
                        queue: RefCell::new(VecDeque::new()),
                        queued_bytes: Cell::new(0),
                        ready: WaitList::new(),
                        lost: Cell::new(false),
                        dropped: Cell::new(0),
                    }),
                )
            })
            .collect();
        let host = Host {
            inner: Rc::new(Inner {
                config,
                replicas: RefCell::new(replicas),
                waiting: RefCell::new(HashMap::new()),
                next_token: Cell::new(1),
                links,
                dirty: Cell::new(false),
                wake_pass: Rc::new(WaitList::new()),
                on_applied: RefCell::new(on_applied),
                tasks: RefCell::new(Vec::new()),
                closed: Cell::new(false),
                persist: RefCell::new(Vec::new()),
                compactions: RefCell::new(Vec::new()),
                wake_persister: Rc::new(WaitList::new()),
                storage: disks.as_ref().map(|(s, _)| s.clone()),
                added: RefCell::new(Vec::new()),
                removed: RefCell::new(Vec::new()),
                refusal_logged: Cell::new(None),
            }),
        };
        let weak = Rc::downgrade(&host.inner);
        let mut tasks = vec![
            glommio::spawn_local(run_ticker(weak.clone())),
            glommio::spawn_local(run_passes(weak.clone())),
        ];
        if let Some((storage, disks)) = disks {
            tasks.push(glommio::spawn_local(run_persister(
                weak.clone(),
                storage,
                disks,
            )));
        }
        tasks.push(glommio::spawn_local(run_listener(weak, listener)));
        for (&peer, link) in &host.inner.links {
            let c = &host.inner.config;
            tasks.push(glommio::spawn_local(run_link(
                Dial {
                    addr: c.peers[&peer],
                    me: c.id,
                    peer,
                    key: c.peer_key.clone(),
                    io_timeout: c.io_timeout,
                },
                link.clone(),
            )));
        }
        host.inner.tasks.borrow_mut().extend(tasks);
        host
    }

    pub fn id(&self) -> u64 {
        self.inner.config.id
    }

    /// Add a replica of `group` (a shard created or opened after the host
    /// started), durable as the host is: from its directory under the
    /// `data_dir` if the host was opened on one.
    pub async fn add_group(&self, group: u64, voters: &[u64]) -> Result<(), ReplicationError> {
        let dir = self
            .inner
            .config
            .data_dir
            .as_deref()
            .map(|d| HostConfig::group_dir(d, group));
        self.add_group_in(group, voters, dir).await
    }

    /// [`Host::add_group`] with the group's journal and hard state in `dir`
    /// (the shard's own directory, say) instead of under the `data_dir`;
    /// ignored by a host kept in memory.
    pub async fn add_group_in(
        &self,
        group: u64,
        voters: &[u64],
        dir: Option<PathBuf>,
    ) -> Result<(), ReplicationError> {
        let inner = &self.inner;
        if inner.closed.get() {
            return Err(ReplicationError::Stopped("host closed".into()));
        }
        let groups = [(group, voters.to_vec())];
        inner.config.check(&groups)?;
        if inner.replicas.borrow().contains_key(&group) {
            return Err(ReplicationError::Refused(format!(
                "group {group} already has a replica here"
            )));
        }
        let (replica, disk) = match (&inner.storage, dir) {
            (Some(storage), Some(dir)) => {
                let (replica, disk) =
                    open_group(storage, &inner.config, &dir, group, voters).await?;
                (replica, Some(disk))
            }
            _ => {
                let mut rc = inner.config.replica.clone();
                rc.id = inner.config.id;
                rc.async_persist = false;
                (Replica::open(rc, ReplicaLog::new(voters))?, None)
            }
        };
        // Opening waited on the disk: the group may have been added
        // meanwhile. Only the first one's journal goes to the persister.
        if inner.replicas.borrow().contains_key(&group) {
            return Err(ReplicationError::Refused(format!(
                "group {group} was added twice at once"
            )));
        }
        if let Some(disk) = disk {
            inner.added.borrow_mut().push((group, disk));
        }
        inner.replicas.borrow_mut().insert(group, replica);
        inner.kick();
        Ok(())
    }

    /// Stop this host's replica of `group`: its owner could not apply what
    /// it committed (a shard log that stopped, an entry it cannot read).
    /// Its waiting proposals and reads fail, and it takes no further part:
    /// a replica whose state missed a committed entry must not vote or
    /// lead.
    pub fn fail_group(&self, group: u64, why: String) {
        let mut events = Vec::new();
        if let Some(r) = self.inner.replicas.borrow_mut().get_mut(&group) {
            r.fail(why, &mut events);
        }
        let mut out = Vec::new();
        self.inner.route(group, &mut out, &mut events);
    }

    /// Remove this host's replica of `group` and, on a durable host, its
    /// journal and hard state (the shard is being deleted). Waiting
    /// proposals and reads fail.
    pub async fn remove_group(&self, group: u64) -> Result<(), ReplicationError> {
        let inner = &self.inner;
        let Some(mut replica) = inner.replicas.borrow_mut().remove(&group) else {
            return Ok(());
        };
        let mut events = Vec::new();
        replica.fail(format!("group {group} was removed"), &mut events);
        let mut out = Vec::new();
        inner.route(group, &mut out, &mut events);
        if inner.storage.is_none() {
            return Ok(());
        }
        let (tx, rx) = local_channel::new_bounded(1);
        inner.removed.borrow_mut().push((group, tx));
        inner.wake_persister.wake_all();
        rx.recv()
            .await
            .ok_or_else(|| ReplicationError::Stopped("host closed".into()))
    }

    /// Does this host's replica of `group` serve (lead, with its
    /// generation start applied)? Never after `close`.
    pub fn serving(&self, group: u64) -> bool {
        !self.inner.closed.get()
            && self
                .inner
                .replicas
                .borrow()
                .get(&group)
                .is_some_and(Replica::serving)
    }

    /// The term `group`'s replica is in (`None` after `close` or for a
    /// group not here).
    pub fn term(&self, group: u64) -> Option<u64> {
        if self.inner.closed.get() {
            return None;
        }
        self.inner.replicas.borrow().get(&group).map(Replica::term)
    }

    /// Propose group-state entries to `group` now (so proposals made one
    /// after another keep their order); the future resolves once they are
    /// committed and applied here. A refusal (not the leader, say) is
    /// returned at once.
    pub fn propose_group_now(
        &self,
        group: u64,
        entries: &[felix_engine::group::GroupEntry],
    ) -> Result<impl std::future::Future<Output = Result<Landed, ReplicationError>>, ReplicationError>
    {
        let inner = &self.inner;
        if inner.closed.get() {
            return Err(ReplicationError::Stopped("host closed".into()));
        }
        let token = inner.next_token.get();
        inner.next_token.set(token + 1);
        {
            let mut replicas = inner.replicas.borrow_mut();
            let r = replicas.get_mut(&group).ok_or_else(|| {
                ReplicationError::Refused(format!("no replica of group {group} here"))
            })?;
            r.propose_group(token, entries)?;
        }
        let (tx, rx) = local_channel::new_bounded(1);
        inner.waiting.borrow_mut().insert(token, tx);
        inner.kick();
        Ok(async move {
            match rx.recv().await {
                Some(Ok(Settle::Landed(l))) => Ok(l),
                Some(Ok(Settle::Read(_))) => unreachable!("a proposal settles as landed"),
                Some(Err(e)) => Err(e),
                None => Err(ReplicationError::Stopped("host closed".into())),
            }
        })
    }

    /// Why `group`'s replica stopped, if it did (an I/O error, an entry
    /// its owner could not apply).
    pub fn stopped(&self, group: u64) -> Option<String> {
        self.inner
            .replicas
            .borrow()
            .get(&group)?
            .stopped()
            .map(str::to_string)
    }

    /// What `group`'s replica here knows of its group (`None` after
    /// `close` or for a group not here).
    pub fn status(&self, group: u64) -> Option<crate::ReplicaStatus> {
        if self.inner.closed.get() {
            return None;
        }
        self.inner
            .replicas
            .borrow()
            .get(&group)
            .map(Replica::status)
    }

    /// Index of the last entry `group`'s replica applied here.
    pub fn applied(&self, group: u64) -> Option<u64> {
        self.inner
            .replicas
            .borrow()
            .get(&group)
            .map(Replica::applied)
    }

    /// Entries [`Host::compact`] would drop from `group`'s log now.
    pub fn compactable(&self, group: u64) -> Option<u64> {
        self.inner
            .replicas
            .borrow()
            .get(&group)
            .map(Replica::compactable)
    }

    /// Where `group`'s log starts: its compaction point.
    pub fn compacted(&self, group: u64) -> Option<Compacted> {
        self.inner
            .replicas
            .borrow()
            .get(&group)
            .map(|r| r.log().compacted())
    }

    /// The host was closed (or dropped by its owner).
    pub fn closed(&self) -> bool {
        self.inner.closed.get()
    }

    /// Entries `group`'s replica holds in memory, past its compaction point.
    pub fn log_len(&self, group: u64) -> Option<usize> {
        self.inner
            .replicas
            .borrow()
            .get(&group)
            .map(Replica::log_len)
    }

    /// Compact `group`'s log up to `upto`, or less ([`Replica::compact`]:
    /// never past what every replica holds or what is applied here). The
    /// owner calls it once what it applied up to `upto` is durable in its
    /// own state, since the entries are gone from memory at once and from
    /// the journal (whole segments) when the persister gets to it. Returns
    /// the new compaction point, `None` if nothing was dropped.
    pub fn compact(&self, group: u64, upto: u64) -> Option<Compacted> {
        let inner = &self.inner;
        let point = inner.replicas.borrow_mut().get_mut(&group)?.compact(upto)?;
        if inner.storage.is_some() {
            inner.compactions.borrow_mut().push((group, point));
            inner.wake_persister.wake_all();
        }
        Some(point)
    }

    /// Who leads `group`, as this host's replica knows (`None` after
    /// `close`).
    pub fn leader(&self, group: u64) -> Option<u64> {
        if self.inner.closed.get() {
            return None;
        }
        self.inner.replicas.borrow().get(&group)?.leader()
    }

    /// Frames (or single messages too large for one) dropped for any peer
    /// so far: queued past the byte bound, queued while its link was down,
    /// or unframeable.
    pub fn frames_dropped(&self) -> u64 {
        self.inner.links.values().map(|l| l.dropped.get()).sum()
    }

    /// Stop: every task ends, every connection closes, waiting callers
    /// are told the host stopped.
    pub fn close(&self) {
        self.inner.close();
    }

    async fn settle(
        &self,
        group: u64,
        ask: impl FnOnce(&mut Replica, u64) -> Result<(), ReplicationError>,
    ) -> Settled {
        if self.inner.closed.get() {
            return Err(ReplicationError::Stopped("host closed".into()));
        }
        let token = self.inner.next_token.get();
        self.inner.next_token.set(token + 1);
        {
            let mut replicas = self.inner.replicas.borrow_mut();
            let r = replicas.get_mut(&group).ok_or_else(|| {
                ReplicationError::Refused(format!("no replica of group {group} here"))
            })?;
            ask(r, token)?;
        }
        let (tx, rx) = local_channel::new_bounded(1);
        self.inner.waiting.borrow_mut().insert(token, tx);
        self.inner.kick();
        rx.recv()
            .await
            .unwrap_or(Err(ReplicationError::Stopped("host closed".into())))
    }

    /// Publish a batch of records to `group` through this host's replica;
    /// resolves once committed on a majority and applied here. A batch too
    /// large to be sent to a peer in one frame is refused.
    pub async fn publish<I>(&self, group: u64, records: I) -> Result<Landed, ReplicationError>
    where
        I: IntoIterator + Clone,
        I::Item: AppendRecord,
    {
        let len = format::records_batch_len(records.clone());
        if len.saturating_add(FRAME_SLACK) > self.inner.config.max_frame {
            return Err(ReplicationError::Refused(format!(
                "a batch of {len} bytes does not fit a {}-byte replication frame",
                self.inner.config.max_frame
            )));
        }
        match self
            .settle(group, |r, t| r.propose_records(t, records).map(|_| ()))
            .await?
        {
            Settle::Landed(l) => Ok(l),
            Settle::Read(_) => unreachable!("a proposal settles as landed"),
        }
    }

    /// A read of `group` by round: resolves with the applied index to
    /// answer from once a majority confirmed this host still leads.
    pub async fn read(&self, group: u64) -> Result<u64, ReplicationError> {
        match self.settle(group, |r, t| r.read(t)).await? {
            Settle::Read(i) => Ok(i),
            Settle::Landed(_) => unreachable!("a read settles as read"),
        }
    }
}

/// Open one group's replica from its directory under `data_dir`.
async fn open_group(
    storage: &DmaStorage,
    config: &HostConfig,
    dir: &Path,
    group: u64,
    voters: &[u64],
) -> Result<(Replica, GroupDisk), ReplicationError> {
    let stop = |why: String| ReplicationError::Stopped(format!("group {group}: {why}"));
    let dir = dir.to_path_buf();
    let (journal, entries) = Journal::open(storage.clone(), &dir, config.journal.clone())
        .await
        .map_err(|e| stop(e.to_string()))?;
    let hs = hard_state::load(storage, &dir)
        .await
        .map_err(|e| stop(e.to_string()))?;
    let stored = (hs.term, hs.vote);
    let log = ReplicaLog::restore(voters, hs, journal.compacted(), &entries).map_err(stop)?;
    drop(entries);
    let mut rc = config.replica.clone();
    rc.id = config.id;
    rc.async_persist = true;
    let replica = Replica::open(rc, log)?;
    Ok((
        replica,
        GroupDisk {
            dir,
            journal,
            stored,
        },
    ))
}

/// Room a frame needs besides its entries' data: the frame header, one
/// message's fixed part and its context, one entry's fixed part.
const FRAME_SLACK: usize = 64 << 10;

impl Inner {
    fn close(&self) {
        self.closed.set(true);
        // Dropping a task cancels it (and what it owns: connections,
        // readers).
        let tasks = std::mem::take(&mut *self.tasks.borrow_mut());
        drop(tasks);
        for (_, tx) in self.waiting.borrow_mut().drain() {
            let _ = tx.try_send(Err(ReplicationError::Stopped("host closed".into())));
        }
    }

    fn kick(&self) {
        self.dirty.set(true);
        self.wake_pass.wake_all();
    }

    fn on_event(&self, group: u64, e: Event) {
        let settle = |token: u64, s: Settled| {
            if let Some(tx) = self.waiting.borrow_mut().remove(&token) {
                let _ = tx.try_send(s);
            }
        };
        match e {
            Event::Applied(a) => (self.on_applied.borrow_mut())(group, &a),
            Event::Acked { token, result } => settle(token, result.map(Settle::Landed)),
            Event::Read { token, result } => settle(token, result.map(Settle::Read)),
            Event::Persist {
                number,
                entries,
                hard_state,
            } => {
                self.persist.borrow_mut().push(PersistAsk {
                    group,
                    number,
                    entries,
                    hard_state,
                });
                self.wake_persister.wake_all();
            }
            Event::Leader { .. } => {}
        }
    }

    /// Send what a replica produced outside a pass (messages to peers,
    /// events to their owners).
    fn route(&self, group: u64, out: &mut Vec<Message>, events: &mut Vec<Event>) {
        let mut by_peer: BTreeMap<u64, Vec<PeerMessage>> = BTreeMap::new();
        // (The map may be borrowed by a caller up the stack: then the hint
        // waits for the next pass.)
        let held_by_all = self
            .replicas
            .try_borrow_mut()
            .ok()
            .and_then(|mut rs| rs.get_mut(&group).map(Replica::compact_hint))
            .unwrap_or(0);
        for m in out.drain(..) {
            by_peer.entry(m.to).or_default().push(PeerMessage {
                group,
                held_by_all,
                message: m,
            });
        }
        for e in events.drain(..) {
            self.on_event(group, e);
        }
        for (peer, msgs) in by_peer {
            self.send(peer, msgs);
        }
    }

    /// Queue `msgs` for `peer` in as many frames as the limits need; a
    /// message that cannot be framed alone is dropped (and the peer
    /// reported unreachable next pass).
    fn send(&self, peer: u64, msgs: Vec<PeerMessage>) {
        let Some(link) = self.links.get(&peer) else {
            return;
        };
        let (max_frame, max_queued) = (self.config.max_frame, self.config.max_queued_bytes);
        let mut pending: Vec<PeerMessage> = Vec::new();
        let mut pending_len = FRAME_HEADER_BYTES;
        let flush = |pending: &mut Vec<PeerMessage>| {
            if pending.is_empty() {
                return;
            }
            let mut frame = Vec::new();
            match encode_frame(pending, max_frame, &mut frame) {
                Ok(()) => link.push(Bytes::from(frame), max_queued),
                Err(e) => {
                    tracing::warn!(peer, "replication frame not sent: {e}");
                    link.drop_one();
                }
            }
            pending.clear();
        };
        for m in msgs {
            let len = framed_len(&m.message);
            if len + FRAME_HEADER_BYTES > max_frame {
                tracing::warn!(
                    peer,
                    group = m.group,
                    len,
                    "replication message over the frame limit, dropped"
                );
                link.drop_one();
                continue;
            }
            if pending_len + len > max_frame || pending.len() == FRAME_MAX_MESSAGES {
                flush(&mut pending);
                pending_len = FRAME_HEADER_BYTES;
            }
            pending_len += len;
            pending.push(m);
        }
        flush(&mut pending);
    }

    /// A refused incoming connection: a warning at most every ten seconds
    /// (a peer with the wrong secret retries every second), debug between.
    fn log_refusal(&self, what: &str) {
        let now = std::time::Instant::now();
        let quiet = self
            .refusal_logged
            .get()
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(10));
        if quiet {
            tracing::debug!("{what}");
        } else {
            self.refusal_logged.set(Some(now));
            tracing::warn!("{what}");
        }
    }

    fn deliver(&self, msgs: Vec<PeerMessage>) {
        {
            let mut replicas = self.replicas.borrow_mut();
            for pm in msgs {
                match replicas.get_mut(&pm.group) {
                    Some(r) => {
                        let (from, term) = (pm.message.from, pm.message.term);
                        match r.step(pm.message) {
                            // Only the leader of the replica's own term is
                            // heard on what every replica holds (a message
                            // of an older term is one raft-rs ignores).
                            Ok(()) if r.term() == term && r.leader() == Some(from) => {
                                r.note_compact_hint(pm.held_by_all)
                            }
                            Ok(()) => {}
                            Err(e) => {
                                tracing::debug!(group = pm.group, "peer message refused: {e}")
                            }
                        }
                    }
                    None => tracing::debug!(group = pm.group, "message for a group not here"),
                }
            }
        }
        self.kick();
    }
}

async fn run_ticker(host: Weak<Inner>) {
    loop {
        let tick = match host.upgrade() {
            Some(h) => h.config.tick,
            None => return,
        };
        glommio::timer::sleep(tick).await;
        let Some(h) = host.upgrade() else {
            return;
        };
        for r in h.replicas.borrow_mut().values_mut() {
            r.tick();
        }
        h.kick();
    }
}

async fn run_passes(host: Weak<Inner>) {
    let mut out: Vec<Message> = Vec::new();
    let mut events = Vec::new();
    let mut by_peer: BTreeMap<u64, Vec<PeerMessage>> = BTreeMap::new();
    let mut groups: Vec<u64> = Vec::new();
    loop {
        {
            let Some(h) = host.upgrade() else {
                return;
            };
            if !h.dirty.get() {
                // Wait without holding the host, so dropping its last
                // handle still ends this task.
                let wake = h.wake_pass.clone();
                let w = wake.wait();
                drop(h);
                w.await;
                continue;
            }
            h.dirty.set(false);
            // Links that lost frames since the last pass: Raft hears of it.
            for (&peer, link) in &h.links {
                if link.lost.replace(false) {
                    for r in h.replicas.borrow_mut().values_mut() {
                        r.report_unreachable(peer);
                    }
                }
            }
            // Each replica is drained with the map borrowed only for that
            // (the apply hook may ask the host about its replicas).
            groups.clear();
            groups.extend(h.replicas.borrow().keys().copied());
            for &group in &groups {
                let mut held_by_all = 0;
                if let Some(r) = h.replicas.borrow_mut().get_mut(&group) {
                    r.drain(&mut out, &mut events);
                    held_by_all = r.compact_hint();
                }
                for m in out.drain(..) {
                    by_peer.entry(m.to).or_default().push(PeerMessage {
                        group,
                        held_by_all,
                        message: m,
                    });
                }
                for e in events.drain(..) {
                    h.on_event(group, e);
                }
            }
            for (peer, msgs) in std::mem::take(&mut by_peer) {
                h.send(peer, msgs);
            }
        }
        // Let ticks, readers and callers in between passes.
        glommio::yield_if_needed().await;
    }
}

/// Make durable what the replicas ask, a round at a time (see the module
/// docs), and tell them.
async fn run_persister(
    host: Weak<Inner>,
    storage: DmaStorage,
    mut disks: BTreeMap<u64, GroupDisk>,
) {
    let mut out = Vec::new();
    let mut events = Vec::new();
    loop {
        let asks = {
            let Some(h) = host.upgrade() else {
                return;
            };
            disks.extend(h.added.borrow_mut().drain(..));
            let removed = std::mem::take(&mut *h.removed.borrow_mut());
            for (group, done) in removed {
                // Drop the asks still queued for it, then its files.
                h.persist.borrow_mut().retain(|a| a.group != group);
                if let Some(disk) = disks.remove(&group) {
                    let dir = disk.dir.clone();
                    if let Err(e) = disk.journal.close().await {
                        tracing::warn!(group, "closing a removed group's journal: {e}");
                    }
                    if let Err(e) = storage.remove_dir_all(&dir).await {
                        tracing::warn!(group, "removing {}: {e}", dir.display());
                    }
                }
                let _ = done.try_send(());
            }
            let compactions = std::mem::take(&mut *h.compactions.borrow_mut());
            if !compactions.is_empty() {
                // After every write asked before them: the journals hold
                // the entries (what is applied was persisted first).
                drop(h);
                compact_journals(&mut disks, compactions).await;
                continue;
            }
            // Groups added while the removals above were awaited: their
            // asks may be queued already.
            disks.extend(h.added.borrow_mut().drain(..));
            if h.persist.borrow().is_empty() {
                if !h.added.borrow().is_empty() || !h.removed.borrow().is_empty() {
                    continue;
                }
                let wake = h.wake_persister.clone();
                let w = wake.wait();
                drop(h);
                w.await;
                continue;
            }
            let asks = std::mem::take(&mut *h.persist.borrow_mut());
            asks
        };
        // Each group's asks go to its journal in order, runs of contiguous
        // entries in one write, then one sync; the groups at once.
        let mut rounds: BTreeMap<u64, Vec<PersistAsk>> = BTreeMap::new();
        for ask in asks {
            rounds.entry(ask.group).or_default().push(ask);
        }
        let mut done: BTreeMap<u64, u64> = BTreeMap::new();
        let mut failed: BTreeMap<u64, String> = BTreeMap::new();
        let mut hard: BTreeMap<u64, HardState> = BTreeMap::new();
        let mut writing = Vec::with_capacity(rounds.len());
        for (group, mine) in rounds {
            let Some(disk) = disks.remove(&group) else {
                continue;
            };
            writing.push(glommio::spawn_local(persist_round(group, disk, mine)));
        }
        for task in writing {
            let (group, disk, r) = task.await;
            disks.insert(group, disk);
            match r {
                Ok((number, hs)) => {
                    done.insert(group, number);
                    if let Some(hs) = hs {
                        hard.insert(group, hs);
                    }
                }
                Err(e) => {
                    failed.insert(group, e.to_string());
                }
            }
        }
        // Then the hard states whose term or vote changed (the commit
        // index alone is not worth a file replacement: a lower one read
        // back is learned again from the leader).
        for (group, hs) in hard {
            if failed.contains_key(&group) {
                continue;
            }
            let disk = disks.get_mut(&group).expect("held");
            if (hs.term, hs.vote) == disk.stored {
                continue;
            }
            match hard_state::store(&storage, &disk.dir, &hs).await {
                Ok(()) => disk.stored = (hs.term, hs.vote),
                Err(e) => {
                    failed.insert(group, format!("storing the hard state: {e}"));
                }
            }
        }
        let Some(h) = host.upgrade() else {
            return;
        };
        for (group, number) in done {
            if failed.contains_key(&group) {
                continue;
            }
            if let Some(r) = h.replicas.borrow_mut().get_mut(&group) {
                r.persisted(number, &mut out, &mut events);
            }
            h.route(group, &mut out, &mut events);
        }
        for (group, why) in failed {
            tracing::error!(group, "replica stopped: {why}");
            if let Some(r) = h.replicas.borrow_mut().get_mut(&group) {
                r.fail(why, &mut events);
            }
            // A failed group takes no more writes.
            disks.remove(&group);
            h.route(group, &mut out, &mut events);
        }
        h.kick();
    }
}

/// What one persister round asks of one group.
#[derive(Debug, Default)]
struct GroupRound {
    /// The asks' entries in order, as runs of contiguous entries: one
    /// journal append each (a write per segment the run reaches). A run starts where an ask does not follow the
    /// entries before it (a newer leader's entries cutting a suffix).
    runs: Vec<Vec<Entry>>,
    /// The last ask's number: what the replica is told is persisted.
    number: u64,
    /// The newest hard state asked for.
    hard_state: Option<HardState>,
}

impl GroupRound {
    fn of(asks: Vec<PersistAsk>) -> GroupRound {
        let mut round = GroupRound::default();
        for ask in asks {
            round.number = ask.number;
            if ask.hard_state.is_some() {
                round.hard_state = ask.hard_state;
            }
            let Some(first) = ask.entries.first() else {
                continue;
            };
            match round.runs.last_mut() {
                Some(run) if run.last().is_some_and(|last| first.index == last.index + 1) => {
                    run.extend(ask.entries)
                }
                _ => round.runs.push(ask.entries),
            }
        }
        round
    }
}

/// One group's part of a persister round: its runs of entries written in
/// order, then one sync. Returns the round's number and hard state.
async fn persist_round(
    group: u64,
    mut disk: GroupDisk,
    asks: Vec<PersistAsk>,
) -> (
    u64,
    GroupDisk,
    Result<(u64, Option<HardState>), JournalError>,
) {
    let round = GroupRound::of(asks);
    let result = async {
        for run in &round.runs {
            disk.journal.append(run).await?;
        }
        disk.journal.sync().await
    }
    .await;
    (
        group,
        disk,
        result.map(|()| (round.number, round.hard_state)),
    )
}

/// Compact each group's journal to its point (the last one asked for a
/// group wins). A failure is logged and leaves the journal as it was, or
/// stops it on an I/O error (its replica stops at its next write).
async fn compact_journals(disks: &mut BTreeMap<u64, GroupDisk>, asks: Vec<(u64, Compacted)>) {
    let mut last: BTreeMap<u64, Compacted> = BTreeMap::new();
    for (group, point) in asks {
        let e = last.entry(group).or_insert(point);
        if point.index > e.index {
            *e = point;
        }
    }
    for (group, point) in last {
        let Some(disk) = disks.get_mut(&group) else {
            continue;
        };
        match disk.journal.compact(point).await {
            Ok(0) => {}
            Ok(removed) => tracing::debug!(
                group,
                to = point.index,
                removed,
                "replica journal compacted"
            ),
            Err(e) => tracing::warn!(group, "compacting the replica journal: {e}"),
        }
    }
}

async fn run_listener(host: Weak<Inner>, listener: TcpListener) {
    // Readers end with their connection; they are kept (and so end with
    // this task when the host closes) until then.
    let mut readers: Vec<(Rc<Cell<bool>>, Task<()>)> = Vec::new();
    loop {
        let stream = listener.accept().await;
        let Some(h) = host.upgrade() else {
            return;
        };
        match stream {
            Ok(stream) => {
                readers.retain(|(done, _)| !done.get());
                if readers.len() >= h.config.max_inbound {
                    h.log_refusal(&format!(
                        "replication listener: {} connections already, refusing one",
                        readers.len()
                    ));
                    continue;
                }
                let _ = stream.set_read_timeout(Some(h.config.idle_timeout));
                let done = Rc::new(Cell::new(false));
                let flag = done.clone();
                let reader = run_reader(host.clone(), stream, h.config.max_frame);
                drop(h);
                let task = glommio::spawn_local(async move {
                    reader.await;
                    flag.set(true);
                });
                readers.push((done, task));
            }
            Err(e) => {
                drop(h);
                tracing::warn!("replication listener: {e}");
                glommio::timer::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serve one incoming connection: its handshake (which must end within
/// `io_timeout`), then frames until it closes, idles out or sends a bad
/// frame or a message from any other node than the one it proved to be,
/// or to any other than this one. Each frame gets its own buffer of
/// exactly its length, so entries kept in the log pin nothing else.
async fn run_reader(host: Weak<Inner>, mut stream: TcpStream, max: usize) {
    // Nothing of the host is held across a wait: a host dropped without
    // `close` must not be kept alive by a connection.
    let Some(h) = host.upgrade() else {
        return;
    };
    let (me, key, deadline) = (h.config.id, h.config.peer_key.clone(), h.config.io_timeout);
    let peers: Vec<u64> = h.config.peers.keys().copied().collect();
    drop(h);
    let shake = glommio::timer::timeout(deadline, async {
        Ok(accept_peer(&mut stream, &key, me, |id| peers.contains(&id)).await)
    })
    .await;
    let from = match shake {
        Ok(Ok(from)) => from,
        refused => {
            let why = match refused {
                Ok(Err(e)) => e,
                _ => format!("no handshake within {deadline:?}"),
            };
            let addr = stream
                .peer_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string());
            if let Some(h) = host.upgrade() {
                h.log_refusal(&format!(
                    "replication connection from {addr} refused: {why}"
                ));
            }
            return;
        }
    };
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        // Take every whole frame buffered, then drop them from the buffer
        // in one move.
        let mut at = 0;
        loop {
            let rest = &buf[at..];
            let len = match frame_len(rest, max) {
                Ok(Some(len)) if rest.len() >= len => len,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!("replication peer sent a bad frame: {e}; closing");
                    return;
                }
            };
            let frame = Bytes::copy_from_slice(&rest[..len]);
            at += len;
            match decode_frame(&frame, max) {
                Ok(Some((msgs, _))) => {
                    if let Some(m) = msgs
                        .iter()
                        .find(|m| m.message.from != from || m.message.to != me)
                    {
                        tracing::warn!(
                            "replication peer {from} sent a message from node {} to node {}; closing",
                            m.message.from,
                            m.message.to
                        );
                        return;
                    }
                    match host.upgrade() {
                        Some(h) => h.deliver(msgs),
                        None => return,
                    }
                }
                Ok(None) => unreachable!("the whole frame is there"),
                Err(e) => {
                    tracing::warn!("replication peer sent a bad frame: {e}; closing");
                    return;
                }
            }
        }
        buf.drain(..at);
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        glommio::yield_if_needed().await;
    }
}

/// The listener's side of the [`handshake`](crate::handshake): the peer
/// on the other end, once it proved itself and was told it was taken.
async fn accept_peer(
    stream: &mut TcpStream,
    key: &PeerKey,
    me: u64,
    is_peer: impl Fn(u64) -> bool,
) -> Result<u64, String> {
    let nonce = handshake::nonce();
    stream
        .write_all(&handshake::challenge(&nonce))
        .await
        .map_err(|e| format!("sending the challenge: {e}"))?;
    let mut proof = [0u8; PROOF_BYTES];
    stream
        .read_exact(&mut proof)
        .await
        .map_err(|e| format!("no handshake: {e}"))?;
    let from =
        handshake::check_proof(key, &nonce, me, is_peer, &proof).map_err(|e| e.to_string())?;
    stream
        .write_all(&handshake::accept(key, &nonce, from, me))
        .await
        .map_err(|e| format!("sending the acceptance: {e}"))?;
    Ok(from)
}

/// Where and as whom a link dials.
struct Dial {
    addr: SocketAddr,
    me: u64,
    peer: u64,
    key: PeerKey,
    io_timeout: Duration,
}

impl Dial {
    /// Connect, prove this host to the peer and check its acceptance. An
    /// error says why, and whether it is worth a warning (not for a peer
    /// that is down or busy, which is not a configuration to fix).
    async fn connect(&self) -> Result<TcpStream, (String, bool)> {
        let mut s = TcpStream::connect_timeout(self.addr, self.io_timeout)
            .await
            .map_err(|e| (format!("connecting: {e}"), false))?;
        let _ = s.set_nodelay(true);
        let _ = s.set_write_timeout(Some(self.io_timeout));
        let _ = s.set_read_timeout(Some(self.io_timeout));
        let mut challenge = [0u8; CHALLENGE_BYTES];
        s.read_exact(&mut challenge)
            .await
            .map_err(|e| (format!("waiting for its handshake: {e}"), false))?;
        let nonce = handshake::read_challenge(&challenge).map_err(|e| (e.to_string(), true))?;
        s.write_all(&handshake::prove(&self.key, &nonce, self.me, self.peer))
            .await
            .map_err(|e| (format!("sending the proof: {e}"), false))?;
        let mut accept = [0u8; ACCEPT_BYTES];
        s.read_exact(&mut accept).await.map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
                    "it refused this node's proof (another cluster.secret_file, or it does not \
                     list this node? its log says which)"
                        .to_string()
                }
                _ => format!("waiting for its answer to the proof: {e}"),
            };
            (why, true)
        })?;
        handshake::check_accept(&self.key, &nonce, self.me, self.peer, &accept)
            .map_err(|e| (e.to_string(), true))?;
        Ok(s)
    }
}

/// One peer's outgoing connection: connect and shake hands (again, with
/// backoff), then write whatever frames are queued. Frames queued while it
/// is down are dropped (Raft sends again what matters once told the peer
/// was lost).
async fn run_link(dial: Dial, link: Rc<Link>) {
    let mut backoff = Duration::from_millis(20);
    // The reason the link is down, once logged (not again each retry).
    let mut down: Option<String> = None;
    loop {
        let mut stream = match dial.connect().await {
            Ok(s) => {
                backoff = Duration::from_millis(20);
                if down.take().is_some() {
                    tracing::info!(
                        peer = dial.peer,
                        "replication link to node {} is up",
                        dial.peer
                    );
                }
                s
            }
            Err((e, serious)) => {
                if down.as_deref() != Some(e.as_str()) {
                    let what = format!(
                        "replication link to node {} at {}: {e}",
                        dial.peer, dial.addr
                    );
                    if serious {
                        tracing::warn!(peer = dial.peer, "{what}");
                    } else {
                        tracing::debug!(peer = dial.peer, "{what}");
                    }
                    down = Some(e);
                }
                link.clear();
                glommio::timer::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        loop {
            let Some(frame) = link.pop() else {
                let w = link.ready.wait();
                if link.queue.borrow().is_empty() {
                    w.await;
                }
                continue;
            };
            if stream.write_all(&frame).await.is_err() {
                link.lost.set(true);
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(number: u64, indices: std::ops::Range<u64>, commit: Option<u64>) -> PersistAsk {
        PersistAsk {
            group: 7,
            number,
            entries: indices
                .map(|index| Entry {
                    index,
                    term: 1,
                    ..Default::default()
                })
                .collect(),
            hard_state: commit.map(|commit| HardState {
                term: 1,
                commit,
                ..Default::default()
            }),
        }
    }

    fn runs(round: &GroupRound) -> Vec<Vec<u64>> {
        let indices = |run: &Vec<Entry>| run.iter().map(|e| e.index).collect();
        round.runs.iter().map(indices).collect()
    }

    #[test]
    fn a_rounds_asks_are_written_as_contiguous_runs() {
        // Asks that follow each other are one write; an empty ask (a hard
        // state alone) joins nothing and breaks nothing.
        let round = GroupRound::of(vec![
            ask(1, 5..7, None),
            ask(2, 7..8, Some(6)),
            ask(3, 0..0, Some(7)),
            ask(4, 8..10, None),
        ]);
        assert_eq!(runs(&round), vec![vec![5, 6, 7, 8, 9]]);
        assert_eq!(round.number, 4);
        assert_eq!(round.hard_state.map(|h| h.commit), Some(7));

        // A newer leader's entries cutting a suffix start a write of their
        // own, after the entries they replace; so does an ask past a gap
        // (which the journal refuses, as it would alone).
        let round = GroupRound::of(vec![
            ask(1, 5..9, Some(4)),
            ask(2, 7..9, None),
            ask(3, 9..10, None),
            ask(4, 12..13, None),
        ]);
        assert_eq!(
            runs(&round),
            vec![vec![5, 6, 7, 8], vec![7, 8, 9], vec![12]]
        );
        assert_eq!(round.number, 4);
        assert_eq!(round.hard_state.map(|h| h.commit), Some(4));

        // Nothing but hard states: nothing to write.
        let round = GroupRound::of(vec![ask(9, 0..0, Some(3))]);
        assert!(round.runs.is_empty());
        assert_eq!(round.number, 9);
    }
}

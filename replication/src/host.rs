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
//! * links: one outgoing connection per peer, reconnecting with backoff
//!   (frames queued while it is down are dropped beyond a small bound —
//!   Raft sends again what matters), and a reader per incoming connection
//!   that decodes frames and steps the replicas they are for.
//!
//! Nothing here crosses cores: core *i* of a broker talks to core *i* of
//! its peers. The log is still the in-memory [`ReplicaLog`] (stage two
//! puts it on the shard's segment files), so a host that stops loses its
//! replicas' state: this is the transport and the event loop, tested with
//! three hosts over loopback TCP.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_engine::format::RecordIn;
use felix_engine::notify::WaitList;
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::channels::local_channel::{self, LocalSender};
use glommio::net::{TcpListener, TcpStream};
use glommio::Task;

use crate::log::ReplicaLog;
use crate::replica::{Applied, Event, Landed, Replica, ReplicaConfig, ReplicationError};
use crate::wire::{decode_frame, encode_frame, frame_len, PeerMessage};
use crate::Message;

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
    /// Largest frame sent or taken.
    pub max_frame: usize,
    /// Frames kept for a peer whose connection is down.
    pub max_queued_frames: usize,
    /// Replica settings (the id is set per host).
    pub replica: ReplicaConfig,
}

impl HostConfig {
    pub fn new(id: u64, peers: BTreeMap<u64, SocketAddr>) -> HostConfig {
        HostConfig {
            id,
            peers,
            tick: Duration::from_millis(10),
            max_frame: 64 << 20,
            max_queued_frames: 64,
            replica: ReplicaConfig::new(id),
        }
    }
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
    ready: WaitList,
}

struct Inner {
    config: HostConfig,
    replicas: RefCell<BTreeMap<u64, Replica>>,
    waiting: RefCell<HashMap<u64, LocalSender<Settled>>>,
    next_token: Cell<u64>,
    links: BTreeMap<u64, Rc<Link>>,
    /// Something happened since the last pass.
    dirty: Cell<bool>,
    wake_pass: WaitList,
    on_applied: RefCell<ApplyHook>,
    tasks: RefCell<Vec<Task<()>>>,
    closed: Cell<bool>,
}

/// The replicas of one core and their connections to their peers.
#[derive(Clone)]
pub struct Host {
    inner: Rc<Inner>,
}

impl Host {
    /// Start a host on the current glommio executor, serving `listener`
    /// (this core's replication port), with one replica per group in
    /// `groups` (group id → its voters, this host among them).
    pub fn start(
        config: HostConfig,
        listener: TcpListener,
        groups: &[(u64, Vec<u64>)],
        on_applied: ApplyHook,
    ) -> Result<Host, ReplicationError> {
        let mut replicas = BTreeMap::new();
        for (group, voters) in groups {
            let mut rc = config.replica.clone();
            rc.id = config.id;
            replicas.insert(*group, Replica::open(rc, ReplicaLog::new(voters))?);
        }
        let links = config
            .peers
            .keys()
            .map(|&p| {
                (
                    p,
                    Rc::new(Link {
                        queue: RefCell::new(VecDeque::new()),
                        ready: WaitList::new(),
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
                wake_pass: WaitList::new(),
                on_applied: RefCell::new(on_applied),
                tasks: RefCell::new(Vec::new()),
                closed: Cell::new(false),
            }),
        };
        let mut tasks = Vec::new();
        tasks.push(glommio::spawn_local(host.clone().run_ticker()));
        tasks.push(glommio::spawn_local(host.clone().run_passes()));
        tasks.push(glommio::spawn_local(host.clone().run_listener(listener)));
        for (&peer, link) in &host.inner.links {
            let addr = host.inner.config.peers[&peer];
            tasks.push(glommio::spawn_local(run_link(
                addr,
                link.clone(),
                host.inner.config.max_frame,
            )));
        }
        host.inner.tasks.borrow_mut().extend(tasks);
        Ok(host)
    }

    pub fn id(&self) -> u64 {
        self.inner.config.id
    }

    /// Does this host's replica of `group` serve (lead, with its
    /// generation start applied)?
    pub fn serving(&self, group: u64) -> bool {
        self.inner
            .replicas
            .borrow()
            .get(&group)
            .is_some_and(Replica::serving)
    }

    /// Who leads `group`, as this host's replica knows.
    pub fn leader(&self, group: u64) -> Option<u64> {
        self.inner.replicas.borrow().get(&group)?.leader()
    }

    /// Stop: every task ends, every connection closes, waiting callers
    /// are told the host stopped.
    pub fn close(&self) {
        self.inner.closed.set(true);
        self.inner.tasks.borrow_mut().clear();
        for (_, tx) in self.inner.waiting.borrow_mut().drain() {
            let _ = tx.try_send(Err(ReplicationError::Stopped("host closed".into())));
        }
    }

    fn kick(&self) {
        self.inner.dirty.set(true);
        self.inner.wake_pass.wake_all();
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
        self.kick();
        rx.recv()
            .await
            .unwrap_or(Err(ReplicationError::Stopped("host closed".into())))
    }

    /// Publish a batch of records to `group` through this host's replica;
    /// resolves once committed on a majority and applied here.
    pub async fn publish(
        &self,
        group: u64,
        records: &[RecordIn],
    ) -> Result<Landed, ReplicationError> {
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

    async fn run_ticker(self) {
        loop {
            glommio::timer::sleep(self.inner.config.tick).await;
            for r in self.inner.replicas.borrow_mut().values_mut() {
                r.tick();
            }
            self.kick();
        }
    }

    async fn run_passes(self) {
        let mut out: Vec<Message> = Vec::new();
        let mut events = Vec::new();
        let mut by_peer: BTreeMap<u64, Vec<PeerMessage>> = BTreeMap::new();
        loop {
            while !self.inner.dirty.get() {
                let w = self.inner.wake_pass.wait();
                if self.inner.dirty.get() {
                    break;
                }
                w.await;
            }
            self.inner.dirty.set(false);
            let groups: Vec<u64> = self.inner.replicas.borrow().keys().copied().collect();
            for group in groups {
                if let Some(r) = self.inner.replicas.borrow_mut().get_mut(&group) {
                    r.drain(&mut out, &mut events);
                }
                for m in out.drain(..) {
                    by_peer
                        .entry(m.to)
                        .or_default()
                        .push(PeerMessage { group, message: m });
                }
                for e in events.drain(..) {
                    self.on_event(group, e);
                }
            }
            for (peer, msgs) in std::mem::take(&mut by_peer) {
                let Some(link) = self.inner.links.get(&peer) else {
                    continue;
                };
                let mut frame = Vec::new();
                match encode_frame(&msgs, self.inner.config.max_frame, &mut frame) {
                    Ok(()) => {
                        let mut q = link.queue.borrow_mut();
                        q.push_back(Bytes::from(frame));
                        while q.len() > self.inner.config.max_queued_frames {
                            q.pop_front();
                        }
                        drop(q);
                        link.ready.wake_all();
                    }
                    Err(e) => tracing::warn!(peer, "replication frame not sent: {e}"),
                }
            }
            // Let ticks, readers and callers in between passes.
            glommio::yield_if_needed().await;
        }
    }

    fn on_event(&self, group: u64, e: Event) {
        let settle = |token: u64, s: Settled| {
            if let Some(tx) = self.inner.waiting.borrow_mut().remove(&token) {
                let _ = tx.try_send(s);
            }
        };
        match e {
            Event::Applied(a) => (self.inner.on_applied.borrow_mut())(group, &a),
            Event::Acked { token, result } => settle(token, result.map(Settle::Landed)),
            Event::Read { token, result } => settle(token, result.map(Settle::Read)),
            Event::Leader { .. } => {}
        }
    }

    async fn run_listener(self, listener: TcpListener) {
        // Readers end with their connection; they are kept (and so end
        // with this task when the host closes) until then.
        let mut readers: Vec<(Rc<Cell<bool>>, Task<()>)> = Vec::new();
        loop {
            match listener.accept().await {
                Ok(stream) => {
                    readers.retain(|(done, _)| !done.get());
                    let done = Rc::new(Cell::new(false));
                    let reader = self.clone().run_reader(stream);
                    let flag = done.clone();
                    let task = glommio::spawn_local(async move {
                        reader.await;
                        flag.set(true);
                    });
                    readers.push((done, task));
                }
                Err(e) => {
                    tracing::warn!("replication listener: {e}");
                    glommio::timer::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn run_reader(self, mut stream: TcpStream) {
        let max = self.inner.config.max_frame;
        let mut buf = BytesMut::with_capacity(64 << 10);
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            // Take every whole frame buffered.
            loop {
                let len = match frame_len(&buf, max) {
                    Ok(Some(len)) if buf.len() >= len => len,
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!("replication peer sent a bad frame: {e}; closing");
                        return;
                    }
                };
                let frame = buf.split_to(len).freeze();
                match decode_frame(&frame, max) {
                    Ok(Some((msgs, _))) => self.deliver(msgs),
                    Ok(None) => unreachable!("the whole frame is there"),
                    Err(e) => {
                        tracing::warn!("replication peer sent a bad frame: {e}; closing");
                        return;
                    }
                }
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn deliver(&self, msgs: Vec<PeerMessage>) {
        {
            let mut replicas = self.inner.replicas.borrow_mut();
            for pm in msgs {
                match replicas.get_mut(&pm.group) {
                    Some(r) => {
                        if let Err(e) = r.step(pm.message) {
                            tracing::debug!(group = pm.group, "peer message refused: {e}");
                        }
                    }
                    None => tracing::debug!(group = pm.group, "message for a group not here"),
                }
            }
        }
        self.kick();
    }
}

/// One peer's outgoing connection: connect (again, with backoff), then
/// write whatever frames are queued.
async fn run_link(addr: SocketAddr, link: Rc<Link>, _max_frame: usize) {
    let mut backoff = Duration::from_millis(20);
    loop {
        let mut stream = match TcpStream::connect(addr).await {
            Ok(s) => {
                backoff = Duration::from_millis(20);
                let _ = s.set_nodelay(true);
                s
            }
            Err(_) => {
                link.queue.borrow_mut().clear();
                glommio::timer::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        loop {
            let next = link.queue.borrow_mut().pop_front();
            let Some(frame) = next else {
                let w = link.ready.wait();
                if link.queue.borrow().is_empty() {
                    w.await;
                }
                continue;
            };
            if stream.write_all(&frame).await.is_err() {
                break;
            }
        }
    }
}

//! A broker in a cluster (`cluster.nodes`): every shard is one Raft group
//! replicated on every node, driven by the core that owns the shard.
//!
//! Each core runs a replication [`Host`] on its own port (the node's
//! replication address, port + core), talking to the same core of every
//! other node, so a shard's replicas live on the same core number
//! everywhere (every node runs the same number of cores). A shard's replica
//! keeps its journal and vote in the shard's directory (`raft/`).
//!
//! A publish to a replicated shard goes through its leader's replica: it
//! is acknowledged once a majority's journals hold it and the leader's
//! shard log has it durably (so a read right after the acknowledgement
//! sees it). Every replica writes each committed entry to its shard log
//! (`apply`), in order: records at the offsets the leader gave them, a new
//! leader's generation start as a control record. A replica that restarts
//! applies its committed entries again from the first; those its shard
//! log already holds (below its end) are skipped, so nothing is written
//! twice. Reads are served by any replica from its shard log, which holds
//! only committed entries. Publishes to a follower are refused with
//! `not_leader` naming the leader's client address.
//!
//! Consumer groups are served by the shard's leader. A group request's
//! state changes are applied to the leader's trackers (`Shard::groups`) as
//! on a single broker, and its writes proposed as one entry; it is answered
//! once that entry is committed. Every replica applies committed group
//! entries to `Shard::committed` and writes them to its log, wrapped with
//! their Raft index (`encode_replicated`) so a restart skips those already
//! there. A replica that becomes leader rebuilds its serving trackers from
//! `committed` before it serves a group request of its term: claims,
//! extensions and delays were the old leader's memory, so records come
//! out again from the durable position. Describes and dead-letter lists
//! are answered only after a round of heartbeats confirms the leadership.
//!
//! Each replica's Raft log is compacted (`run_compactor`): entries every
//! replica holds and this one applied, once its shard log has them
//! durably, leave memory and, a journal segment at a time, the disk.
//!
//! Any replica describes itself (`DescribeReplica`): its role, term, the
//! leader it knows and its indices, and on the leader each follower's
//! progress.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::{Rc, Weak};
use std::time::Duration;

use felix_engine::catalog::CLUSTER_FILE;
use felix_engine::format::AppendRecord;
use felix_engine::storage::Storage;
use felix_engine::StreamName;
use felix_replication::host::{Host, HostConfig};
use felix_replication::{Applied, EntryKind, ReplicationError, Role};
use felix_wire::{
    ErrorCode, PeerProgress, ReplicaInfo, ReplicaRole, Response, StreamRef, WireError,
};
use sha2::{Digest, Sha256};

use crate::broker::{wire_err, Core};
use crate::config::ClusterConfig;
use crate::shard::Shard;

/// Shards of one core by replica group.
type Registry<S> = Rc<RefCell<HashMap<u64, Weak<Shard<S>>>>>;

/// A proposal of group writes, settled once committed.
pub(crate) type Committed =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), ReplicationError>>>>;

/// A replicated group entry read back: its Raft index and its bodies.
pub(crate) type ReplicatedEntry<'a> = (u64, Vec<&'a [u8]>);

/// A shard's replica, as the shard's requests need it.
pub(crate) struct ShardReplica {
    pub host: Host,
    pub group: u64,
    pub cluster: Rc<ClusterConfig>,
}

/// First byte of a replicated group entry's body in a shard's log: never a
/// `GroupEntry`'s version byte.
const REPLICATED: u8 = 0xFE;

/// A group entry's bodies as a replicated shard's log holds them: one
/// group batch, `REPLICATED | index u64 | count u32 | (len u32 | body)*`,
/// so the bodies and the index land (or tear) together. With no bodies it
/// only records the index (closing a segment's snapshot).
pub(crate) fn encode_replicated(index: u64, bodies: &[bytes::Bytes]) -> Vec<u8> {
    let mut out = Vec::with_capacity(13 + bodies.iter().map(|b| 4 + b.len()).sum::<usize>());
    out.push(REPLICATED);
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(&(bodies.len() as u32).to_le_bytes());
    for b in bodies {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

/// The index and bodies of a replicated group entry; `None` for a body
/// that is not one (a single broker's group entry). Never panics.
pub(crate) fn decode_replicated(body: &[u8]) -> Option<Result<ReplicatedEntry<'_>, String>> {
    if body.first() != Some(&REPLICATED) {
        return None;
    }
    let bad = || Some(Err("a replicated group entry is cut short".to_string()));
    let Some(head) = body.get(1..13) else {
        return bad();
    };
    let index = u64::from_le_bytes(head[..8].try_into().expect("eight bytes"));
    let count = u32::from_le_bytes(head[8..12].try_into().expect("four bytes"));
    let mut at = 13;
    let mut out = Vec::new();
    for _ in 0..count {
        let Some(len) = body.get(at..at + 4) else {
            return bad();
        };
        let len = u32::from_le_bytes(len.try_into().expect("four bytes")) as usize;
        at += 4;
        let Some(b) = body.get(at..at.saturating_add(len)) else {
            return bad();
        };
        out.push(b);
        at += len;
    }
    if at != body.len() {
        return Some(Err(format!(
            "a replicated group entry has {} bytes past its bodies",
            body.len() - at
        )));
    }
    Some(Ok((index, out)))
}

impl ShardReplica {
    /// Refuse unless this replica leads the shard and serves; on the first
    /// request of a new leadership, rebuild the serving trackers from the
    /// committed state (claims and delays were the old leader's memory).
    pub fn ensure_serving<S: Storage>(&self, shard: &Shard<S>) -> Result<(), Response> {
        if let Some(why) = self.host.stopped(self.group) {
            return Err(wire_err(
                ErrorCode::Unavailable,
                format!("shard {}: its replica stopped: {why}", shard.name()),
            ));
        }
        if !self.host.serving(self.group) {
            let leader = self.host.leader(self.group);
            return Err(refusal(
                &self.cluster,
                &shard.name(),
                ReplicationError::NotLeader { leader },
            ));
        }
        let term = self.host.term(self.group).unwrap_or(0);
        if shard.served_term.get() != term {
            let now = crate::broker::now_ms();
            let committed = shard.committed.borrow();
            let mut serving = shard.groups.borrow_mut();
            serving.clear();
            for (name, c) in committed.iter() {
                let mut t = felix_engine::group::GroupTracker::new(
                    name.as_str(),
                    shard.group_config.clone(),
                );
                for e in c.snapshot_entries() {
                    t.apply_entry(&e);
                }
                if t.exists() {
                    t.rebuild(now);
                    serving.insert(name.clone(), t);
                }
            }
            shard.served_term.set(term);
            tracing::info!(shard = %shard.name(), term, "leading: group state rebuilt from the committed log");
        }
        Ok(())
    }

    /// A round of heartbeats confirming this replica still leads, before a
    /// read of group state is answered.
    pub async fn confirm<S: Storage>(&self, shard: &Shard<S>) -> Result<(), Response> {
        match self.host.read(self.group).await {
            Ok(_) => Ok(()),
            Err(e) => Err(refusal(&self.cluster, &shard.name(), e)),
        }
    }

    /// Propose a group request's writes (in order, now); the future
    /// settles once they are committed. Refused unless the serving
    /// trackers were built for the current term (a request that ran across
    /// a change of leadership must not propose what stale trackers
    /// decided). A proposal that fails voids the serving state it was made
    /// from, unless that was already rebuilt for a later term.
    pub fn propose<S: Storage>(
        &self,
        shard: &Shard<S>,
        entries: &[felix_engine::group::GroupEntry],
    ) -> Result<Committed, Response> {
        let term = shard.served_term.get();
        if term == 0 || self.host.term(self.group) != Some(term) {
            return Err(wire_err(
                ErrorCode::Unavailable,
                format!(
                    "shard {}: its leadership changed while the request ran; retry",
                    shard.name()
                ),
            ));
        }
        let served = shard.served_term.clone();
        match self.host.propose_group_now(self.group, entries) {
            Ok(f) => Ok(Box::pin(async move {
                let r = f.await.map(|_| ());
                if r.is_err() && served.get() == term {
                    // What the trackers did for it is not committed.
                    served.set(0);
                }
                r
            })),
            Err(e) => {
                served.set(0);
                Err(refusal(&self.cluster, &shard.name(), e))
            }
        }
    }

    pub fn refusal(&self, shard: &str, e: ReplicationError) -> Response {
        refusal(&self.cluster, shard, e)
    }
}

/// A core's replication: its host and the shards it replicates.
pub(crate) struct Replication<S: Storage> {
    pub host: Host,
    pub cluster: Rc<ClusterConfig>,
    shards: Registry<S>,
}

/// Check (or, on the first start in a cluster, record in its
/// [`CLUSTER_FILE`]) that `data_dir`
/// holds the state of this node of this cluster. Raft's safety rests on
/// every replica counting the same voters: a broker started once with
/// another peer list (only itself, say) would make its own majority,
/// acknowledge what the cluster never committed, and later win elections
/// with a log the others do not hold. Ids are compared, not addresses
/// (brokers may move). A data directory of a cluster is not started
/// outside one either, nor one of a single broker inside one after it
/// was recorded (that case is the shards' own check: a stream written
/// before the broker joined is refused).
pub(crate) fn check_membership(
    data_dir: &std::path::Path,
    cluster: Option<&ClusterConfig>,
) -> Result<(), String> {
    use std::io::Write;
    let path = data_dir.join(CLUSTER_FILE);
    let recorded = match std::fs::read_to_string(&path) {
        Ok(text) => Some(parse_membership(&text).map_err(|e| format!("{}: {e}", path.display()))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let wanted = cluster.map(|c| {
        let mut ids = c.voters();
        ids.sort_unstable();
        (c.node_id, ids)
    });
    let show = |ids: &[u64]| {
        ids.iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match (recorded, wanted) {
        (None, None) => Ok(()),
        (Some((id, ids)), None) => Err(format!(
            "data directory {} holds node {id} of a cluster of nodes {}: start it with \
             --node-id {id} and --peers naming those nodes (a broker does not leave a cluster)",
            data_dir.display(),
            show(&ids)
        )),
        (Some(r), Some(w)) if r == w => Ok(()),
        (Some((id, ids)), Some((wid, wids))) => Err(format!(
            "data directory {} holds node {id} of a cluster of nodes {}, but this start names \
             node {wid} of nodes {}: membership changes are not supported (a broker counting \
             other voters could acknowledge what the cluster never committed); start it with \
             --node-id {id} and --peers naming nodes {} (their addresses may change)",
            data_dir.display(),
            show(&ids),
            show(&wids),
            show(&ids)
        )),
        (None, Some((id, ids))) => {
            let text = format!(
                "# Written by felix on this data directory's first start in a cluster:\n\
                 # the node it holds the state of, and every node of its cluster.\n\
                 node_id = {id}\nnodes = [{}]\n",
                show(&ids)
            );
            let tmp = data_dir.join(format!("{CLUSTER_FILE}.tmp"));
            let write = || -> std::io::Result<()> {
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(text.as_bytes())?;
                f.sync_all()?;
                std::fs::rename(&tmp, &path)?;
                std::fs::File::open(data_dir)?.sync_all()
            };
            write().map_err(|e| {
                format!(
                    "cannot record cluster membership in {}: {e}",
                    path.display()
                )
            })
        }
    }
}

/// `node_id` and `nodes` of a membership file.
fn parse_membership(text: &str) -> Result<(u64, Vec<u64>), String> {
    let mut id = None;
    let mut nodes = None;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| format!("not `key = value`: {line:?}"))?;
        match k.trim() {
            "node_id" => {
                id = Some(
                    v.trim()
                        .parse::<u64>()
                        .map_err(|e| format!("node_id: {e}"))?,
                )
            }
            "nodes" => {
                let list = v
                    .trim()
                    .strip_prefix('[')
                    .and_then(|l| l.strip_suffix(']'))
                    .ok_or_else(|| format!("nodes is not a list: {v:?}"))?;
                let mut ids = list
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse::<u64>().map_err(|e| format!("nodes: {s:?}: {e}")))
                    .collect::<Result<Vec<_>, _>>()?;
                ids.sort_unstable();
                nodes = Some(ids);
            }
            other => return Err(format!("unknown key {other:?}")),
        }
    }
    match (id, nodes) {
        (Some(id), Some(nodes)) => Ok((id, nodes)),
        _ => Err("needs node_id and nodes".to_string()),
    }
}

/// How long a replicated publish may wait for its commit before the broker
/// answers `unavailable` (the outcome is then unknown: it may still be
/// committed).
pub(crate) const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// The replica group of a shard: the same on every node (a hash of the
/// stream's name, its incarnation and the shard), below 2^62 as replica
/// numbers must be. The incarnation keeps a stream apart from an earlier
/// one of the same name that a broker down for its deletion still holds:
/// their replicas are different groups, and never vote for each other.
/// (0, a stream created without one, hashes as before incarnations.)
pub(crate) fn group_id(name: &StreamName, shard: u32, incarnation: u64) -> u64 {
    let mut h = Sha256::new();
    h.update(name.to_string().as_bytes());
    h.update(b"#");
    h.update(shard.to_le_bytes());
    if incarnation != 0 {
        h.update(b"@");
        h.update(incarnation.to_le_bytes());
    }
    let d = h.finalize();
    let v = u64::from_le_bytes(d[..8].try_into().expect("eight bytes")) & ((1 << 62) - 1);
    v.max(1)
}

/// `addr` with its port moved up by `by` (core `by`'s replication port).
fn port_plus(addr: SocketAddr, by: u32) -> Result<SocketAddr, String> {
    let port = u32::from(addr.port()) + by;
    let port = u16::try_from(port)
        .map_err(|_| format!("replication port {} + core {by} is past 65535", addr.port()))?;
    let mut a = addr;
    a.set_port(port);
    Ok(a)
}

/// Start this core's replication host, if the broker is in a cluster.
pub(crate) async fn start<S: Storage>(core: &Rc<Core<S>>) -> Result<(), String> {
    let Some(cluster) = core.shared.config.cluster.clone() else {
        return Ok(());
    };
    let me = cluster
        .node(cluster.node_id)
        .expect("the config checks the node is listed")
        .clone();
    let core_no = core.core_id();
    let addr = port_plus(me.replication, core_no)?;
    let listener = glommio::net::TcpListener::bind(addr)
        .map_err(|e| format!("cannot listen for replication on {addr}: {e}"))?;
    let mut peers = std::collections::BTreeMap::new();
    for n in cluster.nodes.iter().filter(|n| n.id != me.id) {
        peers.insert(n.id, port_plus(n.replication, core_no)?);
    }
    let mut config = HostConfig::new(me.id, peers);
    config.tick = Duration::from_millis(cluster.tick_ms);
    config.journal.segment_bytes = cluster.journal_segment_bytes;
    config.peer_key = cluster.peer_key.clone();
    // Groups are added with their shard's own directory.
    config.data_dir = Some(
        core.shared
            .config
            .data_dir
            .clone()
            .ok_or("a cluster needs a data directory")?,
    );
    // A record the broker takes must fit a replication frame.
    config.max_frame = config
        .max_frame
        .max(core.shared.config.max_frame_bytes as usize + (1 << 20));
    let shards: Registry<S> = Rc::new(RefCell::new(HashMap::new()));
    let hook_shards = shards.clone();
    // The hook stops a replica whose entry could not be applied: it needs
    // the host, which is made with the hook.
    let hook_host: Rc<std::cell::OnceCell<Host>> = Rc::default();
    let for_hook = hook_host.clone();
    let hook = Box::new(move |group: u64, a: &Applied| {
        // After a failure nothing more is applied: the entries after the
        // one that failed must not move the shard's state past it.
        if for_hook.get().is_some_and(|h| h.stopped(group).is_some()) {
            return;
        }
        if let Err(why) = apply(&hook_shards, group, a) {
            if let Some(h) = for_hook.get() {
                h.fail_group(group, why);
            }
        }
    });
    let host = Host::open(config, listener, &[], hook)
        .await
        .map_err(|e| format!("replication: {e}"))?;
    let _ = hook_host.set(host.clone());
    tracing::info!(
        node = me.id,
        core = core_no,
        %addr,
        "replicating with {} other node(s)",
        cluster.nodes.len() - 1
    );
    if cluster.compact_entries > 0 {
        glommio::spawn_local(run_compactor(
            Rc::downgrade(&shards),
            host.clone(),
            cluster.compact_entries,
        ))
        .detach();
    }
    let _ = core.replication.set(Replication {
        host,
        cluster: Rc::new(cluster),
        shards,
    });
    Ok(())
}

/// How often a core looks for replica logs to compact.
const COMPACT_EVERY: Duration = Duration::from_millis(200);

/// Compact the replica logs of this core's shards, each once at least
/// `min_entries` of its entries can go: every replica holds them and this
/// one applied them. The shard's log is flushed first, so what they wrote
/// there is durable before the journal lets go of them (a restart then
/// finds them in the shard log, not the journal).
async fn run_compactor<S: Storage>(
    shards: Weak<RefCell<HashMap<u64, Weak<Shard<S>>>>>,
    host: Host,
    min_entries: u64,
) {
    loop {
        glommio::timer::sleep(COMPACT_EVERY).await;
        if host.closed() {
            return;
        }
        let Some(registry) = shards.upgrade() else {
            return;
        };
        let due: Vec<(u64, Rc<Shard<S>>)> = registry
            .borrow()
            .iter()
            .filter(|(group, _)| host.compactable(**group).unwrap_or(0) >= min_entries)
            .filter_map(|(group, shard)| Some((*group, shard.upgrade()?)))
            .collect();
        drop(registry);
        for (group, shard) in due {
            if host.stopped(group).is_some() {
                continue;
            }
            // Everything applied so far is queued in the shard log.
            let Some(applied) = host.applied(group) else {
                continue;
            };
            if let Err(e) = shard.log.flush().await {
                tracing::warn!(shard = %shard.name(), "replica log not compacted: the shard log did not flush: {e}");
                continue;
            }
            if let Some(point) = host.compact(group, applied) {
                tracing::debug!(shard = %shard.name(), to = point.index, "replica log compacted");
            }
        }
    }
}

impl<S: Storage> Replication<S> {
    /// Replicate `shard` (just opened from `dir`): its replica joins the
    /// host, with its journal in the shard's directory.
    pub async fn add(&self, shard: &Rc<Shard<S>>, dir: PathBuf) -> Result<(), String> {
        let group = shard.replica_group;
        // A shard written by a single broker has records no replica's
        // journal holds: its offsets would clash with the entries the
        // cluster commits. It is refused rather than quietly diverge.
        if shard.log.queued_end().0 > 0 && !dir.join("raft").exists() {
            return Err(format!(
                "{} holds records written before this broker joined a cluster; a cluster \
                 replicates only streams created in it (create the stream anew)",
                shard.name()
            ));
        }
        self.shards.borrow_mut().insert(group, Rc::downgrade(shard));
        let r = self
            .host
            .add_group_in(group, &self.cluster.voters(), Some(dir.join("raft")))
            .await;
        if let Err(e) = r {
            self.shards.borrow_mut().remove(&group);
            return Err(format!("replica of {}: {e}", shard.name()));
        }
        let _ = shard.replica.set(ShardReplica {
            host: self.host.clone(),
            group,
            cluster: self.cluster.clone(),
        });
        Ok(())
    }

    /// Stop replicating `shard` and delete its replica's files.
    pub async fn remove(&self, shard: &Shard<S>) {
        let group = shard.replica_group;
        self.shards.borrow_mut().remove(&group);
        if let Err(e) = self.host.remove_group(group).await {
            tracing::warn!("removing the replica of {}: {e}", shard.name());
        }
    }

    /// Publish `records` to `shard` through its replica; the answer once a
    /// majority holds them and this shard log has them durably.
    pub async fn publish<I>(&self, shard: &Shard<S>, records: I) -> Response
    where
        I: IntoIterator + Clone,
        I::Item: AppendRecord,
    {
        let group = shard.replica_group;
        let landed = match glommio::timer::timeout(COMMIT_TIMEOUT, async {
            Ok(self.host.publish(group, records).await)
        })
        .await
        {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => return proposal_refusal(&self.cluster, &shard.name(), e),
            Err(_) => {
                return wire_err(
                    ErrorCode::Unavailable,
                    format!(
                        "shard {}: not committed within {COMMIT_TIMEOUT:?} (no majority \
                             reachable?); it may still be, so a retry can duplicate it",
                        shard.name()
                    ),
                )
            }
        };
        if landed.end > landed.base {
            let last = felix_engine::Offset(landed.end.0 - 1);
            let written = glommio::timer::timeout(COMMIT_TIMEOUT, async {
                Ok(shard.log.wait_for_offset(last).await)
            })
            .await;
            let failed = match written {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("not written within {COMMIT_TIMEOUT:?}")),
            };
            if let Some(why) = failed {
                return wire_err(
                    ErrorCode::Unavailable,
                    format!(
                        "shard {}: committed, but its log here failed: {why}",
                        shard.name()
                    ),
                );
            }
        }
        Response::Published {
            shard: shard.index,
            base_offset: landed.base.0,
            count: (landed.end.0 - landed.base.0) as u32,
        }
    }

    /// This broker's replica of `shard`, as it sees it (`DescribeReplica`):
    /// any replica answers, leader or not, from what it knows now.
    pub fn describe(&self, shard: &Shard<S>, stream: StreamRef) -> Response {
        let group = shard.replica_group;
        let Some(st) = self.host.status(group) else {
            return wire_err(
                ErrorCode::Unavailable,
                format!(
                    "shard {}: this broker holds no replica of it (a stream written before \
                     the broker joined the cluster, or one being deleted)",
                    shard.name()
                ),
            );
        };
        let role = match st.role {
            Role::Leader => ReplicaRole::Leader,
            Role::Elected => ReplicaRole::Elected,
            Role::Follower => ReplicaRole::Follower,
            Role::Electing => ReplicaRole::Electing,
            Role::Stopped => ReplicaRole::Stopped,
        };
        Response::Replica(Box::new(ReplicaInfo {
            stream,
            shard: shard.index,
            node: self.cluster.node_id,
            role,
            term: st.term,
            leader: st.leader,
            leader_addr: st
                .leader
                .and_then(|id| self.cluster.node(id))
                .map(|n| n.client.clone()),
            commit: st.commit,
            applied: st.applied,
            last_index: st.last_index,
            compacted: st.compacted,
            stopped: st.stopped,
            peers: st
                .peers
                .iter()
                .map(|&(node, matched)| PeerProgress { node, matched })
                .collect(),
        }))
    }
}

/// The answer for a replication error on the shard named `shard`.
pub(crate) fn refusal(cluster: &ClusterConfig, shard: &str, e: ReplicationError) -> Response {
    match e {
        ReplicationError::NotLeader { leader } => {
            let addr = leader
                .and_then(|id| cluster.node(id))
                .map(|n| n.client.clone());
            let msg = match (&addr, leader) {
                (Some(a), Some(id)) => format!("shard {shard} is led by node {id} at {a}"),
                _ => format!(
                    "shard {shard} has no leader this node knows of: an election may be on, \
                     or too few of its replicas can reach each other to elect one; retry"
                ),
            };
            Response::Error(WireError::not_leader(addr, msg))
        }
        // Safe to send again (nothing was proposed), so the same code a
        // client retries on: this broker does not serve as leader yet.
        ReplicationError::NotReady => Response::Error(WireError::not_leader(
            None,
            format!("shard {shard}: its new leader is still catching up; retry"),
        )),
        ReplicationError::Superseded => wire_err(
            ErrorCode::Unavailable,
            format!(
                "shard {shard}: the leader changed before this was committed, and it was not: \
                 safe to send again"
            ),
        ),
        ReplicationError::Timeout => wire_err(
            ErrorCode::Unavailable,
            format!("shard {shard}: no majority confirmed the leader in time; retry"),
        ),
        other => wire_err(ErrorCode::Unavailable, format!("shard {shard}: {other}")),
    }
}

/// [`refusal`] for one proposal that was all the request did (a publish):
/// refused as not leading or not ready, it was never proposed, and
/// superseded, it never commits, so the answer says nothing was applied.
/// (Not for requests that may have proposed other writes first, such as a
/// poll's.)
pub(crate) fn proposal_refusal(
    cluster: &ClusterConfig,
    shard: &str,
    e: ReplicationError,
) -> Response {
    let nothing = matches!(
        e,
        ReplicationError::NotLeader { .. }
            | ReplicationError::NotReady
            | ReplicationError::Superseded
    );
    let mut answer = refusal(cluster, shard, e);
    if let Response::Error(w) = &mut answer {
        w.not_applied |= nothing;
    }
    answer
}

/// Write a committed entry into its shard's log. An entry that cannot be
/// applied stops the shard's replica (the error says why): a replica
/// whose state missed a committed entry must not go on voting or lead.
fn apply<S: Storage>(shards: &Registry<S>, group: u64, a: &Applied) -> Result<(), String> {
    let shard = shards.borrow().get(&group).and_then(Weak::upgrade);
    let Some(shard) = shard else {
        tracing::warn!(
            group,
            index = a.index,
            "a committed entry for a shard not open here"
        );
        return Ok(());
    };
    apply_to(&shard, a).map_err(|why| {
        tracing::error!(
            shard = %shard.name(),
            index = a.index,
            "a committed entry could not be applied; the shard's replica stops: {why}"
        );
        format!(
            "shard {}: entry {} not applied: {why}",
            shard.name(),
            a.index
        )
    })
}

fn apply_to<S: Storage>(shard: &Shard<S>, a: &Applied) -> Result<(), String> {
    if a.kind == EntryKind::Group {
        return apply_group(shard, a);
    }
    let end = shard.log.queued_end();
    if a.base < end {
        // Applied before this restart: the log holds it.
        return Ok(());
    }
    if a.base > end {
        return Err(format!(
            "the entry starts at offset {} and the log ends at {end}",
            a.base
        ));
    }
    let appended = match a.kind {
        EntryKind::GenerationStart => shard
            .log
            .append_control(&a.term.to_le_bytes())
            .map_err(|e| e.to_string())?,
        EntryKind::Records { .. } => shard.log.append_copy(&a.data).map_err(|e| e.to_string())?,
        EntryKind::Group => unreachable!("applied above"),
    };
    if appended.base != a.base {
        return Err(format!(
            "the log put it at offset {}, the leader at {}",
            appended.base, a.base
        ));
    }
    Ok(())
}

/// A committed group entry: into the log (with its index) and the
/// committed state. The leader's serving trackers made these changes when
/// the request came, and a new leader rebuilds its own from the committed
/// state, so they are not touched here.
fn apply_group<S: Storage>(shard: &Shard<S>, a: &Applied) -> Result<(), String> {
    if a.index <= shard.group_index.get() {
        // In the log before this restart.
        return Ok(());
    }
    let bodies = felix_replication::entry::group_bodies(&a.data);
    let mut entries = Vec::with_capacity(bodies.len());
    for b in &bodies {
        entries.push(felix_engine::group::GroupEntry::decode(b).map_err(|e| e.to_string())?);
    }
    shard
        .log
        .append_group(&encode_replicated(a.index, &bodies))
        .map_err(|e| e.to_string())?;
    shard.group_index.set(a.index);
    let mut committed = shard.committed.borrow_mut();
    for e in &entries {
        let name = e.group();
        let t = committed.entry(name.to_string()).or_insert_with(|| {
            felix_engine::group::GroupTracker::new(name, shard.group_config.clone())
        });
        t.apply_entry(e);
        if !t.exists() {
            committed.remove(name);
        }
    }
    Ok(())
}

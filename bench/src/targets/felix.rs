//! The Felix driver: `felix-client`, pipelined.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use felix_client::{
    Client, ClientConfig, ClientError, ClusterClient, ErrorCode, GroupRecord, PendingPublish,
    RecordIn, StartPosition, StreamOptions,
};

use super::{Delivery, Handle, Spec, StreamKind};

pub const GROUP: &str = "bench";

#[derive(Debug, Clone)]
pub struct FelixTarget {
    clients: Vec<Client>,
    /// With `--broker A,B,C`: the cluster, its brokers' connections, and
    /// once the stream exists, each connection slot's client of every
    /// shard's leader.
    cluster: Option<Cluster>,
    spec: Arc<Spec>,
    /// Whether this run created the stream: only then does `delete` remove
    /// it. A stream that already existed (`--stream` naming a user's own) is
    /// refused by `create` and never touched.
    created: Arc<std::sync::atomic::AtomicBool>,
}

fn e(err: felix_client::ClientError) -> String {
    err.to_string()
}

#[derive(Debug, Clone)]
struct Cluster {
    cc: ClusterClient,
    /// `connections` clients of each broker, by address.
    by_broker: Arc<std::collections::HashMap<String, Vec<Client>>>,
    /// `leaders[slot][shard]`: connection `slot`'s client of the shard's
    /// leader.
    leaders: Arc<std::sync::OnceLock<Vec<Arc<Vec<Client>>>>>,
}

/// Where a producer, reader or consumer sends a shard's requests: its one
/// broker, or (a cluster) the shard's leader.
#[derive(Debug, Clone)]
enum Route {
    One(Client),
    PerShard(Arc<Vec<Client>>),
}

impl Route {
    fn get(&self, shard: u32) -> &Client {
        match self {
            Route::One(c) => c,
            Route::PerShard(v) => &v[shard as usize],
        }
    }
}

impl FelixTarget {
    pub async fn connect(
        addr: &str,
        connections: usize,
        ack_on_commit: bool,
        token: Option<String>,
        spec: Arc<Spec>,
    ) -> Result<FelixTarget, String> {
        let config = ClientConfig {
            client_name: concat!("felix-bench/", env!("CARGO_PKG_VERSION")).into(),
            ack_on_commit,
            token,
            request_timeout: Duration::from_secs(60),
            ..ClientConfig::default()
        };
        let brokers: Vec<&str> = addr.split(',').map(str::trim).collect();
        let mut by_broker = std::collections::HashMap::new();
        for b in &brokers {
            by_broker.insert(b.to_string(), connect_all(b, connections, &config).await?);
        }
        let clients = by_broker[brokers[0]].clone();
        let cluster = if brokers.len() > 1 {
            let cc = ClusterClient::connect(&brokers, config)
                .await
                .map_err(|err| format!("cannot connect to the Felix cluster {addr}: {err}"))?;
            Some(Cluster {
                cc,
                by_broker: Arc::new(by_broker),
                leaders: Default::default(),
            })
        } else {
            None
        };
        Ok(FelixTarget {
            clients,
            cluster,
            spec,
            created: Default::default(),
        })
    }

    /// Run against a cluster (`--broker A,B,C`).
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    fn client(&self, idx: usize) -> &Client {
        &self.clients[idx % self.clients.len()]
    }

    /// Connection slot `idx`'s route to each shard.
    fn route(&self, idx: usize) -> Route {
        match self.cluster.as_ref().and_then(|c| c.leaders.get()) {
            Some(slots) => Route::PerShard(slots[idx % slots.len()].clone()),
            None => Route::One(self.client(idx).clone()),
        }
    }

    /// The client of a shard's leader (a cluster) or of the broker.
    fn shard_client(&self, shard: u32) -> &Client {
        match self.cluster.as_ref().and_then(|c| c.leaders.get()) {
            Some(slots) => &slots[0][shard as usize],
            None => self.client(0),
        }
    }

    /// A cluster's stream: created on every broker, then each shard's
    /// leader found (asked for a group that does not exist: the leader
    /// answers `not_found`, a follower `not_leader` naming it), waiting out
    /// elections.
    async fn create_on_cluster(&self, cluster: &Cluster) -> Result<(), String> {
        let s = &self.spec.name;
        cluster
            .cc
            .create_stream(
                &s.tenant,
                &s.namespace,
                &s.stream,
                self.spec.shards,
                KEEP_ALL,
            )
            .await
            .map_err(|err| create_failed(s, err))?;
        self.created
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let mut leaders = Vec::with_capacity(self.spec.shards as usize);
        for shard in 0..self.spec.shards {
            leaders.push(self.find_leader(cluster, shard).await?);
        }
        let slots = self.clients.len();
        let per_slot = (0..slots)
            .map(|slot| {
                Arc::new(
                    leaders
                        .iter()
                        .map(|l| cluster.by_broker[l][slot].clone())
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        let _ = cluster.leaders.set(per_slot);
        Ok(())
    }

    async fn find_leader(&self, cluster: &Cluster, shard: u32) -> Result<String, String> {
        let s = &self.spec.name;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let mut brokers: Vec<&String> = cluster.by_broker.keys().collect();
        brokers.sort();
        loop {
            for b in &brokers {
                let c = &cluster.by_broker[*b][0];
                match c
                    .group_describe(
                        &s.tenant,
                        &s.namespace,
                        &s.stream,
                        shard,
                        "felix-bench-probe",
                    )
                    .await
                {
                    Err(ClientError::Server {
                        code: ErrorCode::NotFound,
                        ..
                    })
                    | Ok(_) => return Ok((*b).clone()),
                    Err(ClientError::NotLeader {
                        leader: Some(l), ..
                    }) if cluster.by_broker.contains_key(&l) => return Ok(l),
                    Err(ClientError::NotLeader { .. }) => {}
                    Err(err) => {
                        return Err(format!("finding shard {shard}'s leader at {b}: {err}"))
                    }
                }
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!("shard {shard} of {s} elected no leader in 20 s"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn version(&self) -> String {
        self.clients[0].broker()
    }

    pub fn cores(&self) -> u32 {
        self.clients[0].cores()
    }

    pub async fn create(&self) -> Result<(), String> {
        let s = &self.spec.name;
        match &self.cluster {
            Some(cluster) => self.create_on_cluster(cluster).await?,
            None => {
                self.client(0)
                    .create_stream(
                        &s.tenant,
                        &s.namespace,
                        &s.stream,
                        self.spec.shards,
                        KEEP_ALL,
                    )
                    .await
                    .map_err(|err| create_failed(s, err))?;
                self.created
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                // Every client learns the placement once, before the clock
                // starts.
                for c in &self.clients {
                    c.describe_stream(&s.tenant, &s.namespace, &s.stream)
                        .await
                        .map_err(e)?;
                }
            }
        }
        if self.spec.kind == StreamKind::Queue {
            for shard in 0..self.spec.shards {
                self.shard_client(shard)
                    .group_create(
                        &s.tenant,
                        &s.namespace,
                        &s.stream,
                        shard,
                        GROUP,
                        StartPosition::Earliest,
                    )
                    .await
                    .map_err(|err| format!("group_create shard {shard}: {err}"))?;
            }
        }
        Ok(())
    }

    /// Remove the benchmark stream, if this run created it.
    pub async fn delete(&self) -> Result<(), String> {
        if !self.created.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let s = &self.spec.name;
        match &self.cluster {
            Some(cluster) => cluster
                .cc
                .delete_stream(&s.tenant, &s.namespace, &s.stream)
                .await
                .map_err(e),
            None => self
                .client(0)
                .delete_stream(&s.tenant, &s.namespace, &s.stream)
                .await
                .map_err(e),
        }
    }

    /// Records the shard holds.
    pub async fn stored(&self, shard: u32) -> Result<u64, String> {
        let s = &self.spec.name;
        let info = self
            .shard_client(shard)
            .describe_shard(&s.tenant, &s.namespace, &s.stream, shard)
            .await
            .map_err(e)?;
        Ok(info.end_offset - info.start_offset)
    }

    /// Records of the shard the group has not finished: behind its position
    /// plus anything owed or in flight.
    pub async fn unfinished(&self, shard: u32) -> Result<Option<u64>, String> {
        let s = &self.spec.name;
        let info = self
            .shard_client(shard)
            .group_describe(&s.tenant, &s.namespace, &s.stream, shard, GROUP)
            .await
            .map_err(e)?;
        Ok(Some(
            info.lag() + u64::from(info.in_flight) + u64::from(info.owed),
        ))
    }

    pub fn producer(&self, idx: usize) -> PubTx {
        PubTx {
            route: self.route(idx),
            spec: self.spec.clone(),
        }
    }

    pub fn reader(&self, idx: usize) -> Reader {
        Reader {
            route: self.route(idx),
            spec: self.spec.clone(),
            next: vec![None; self.spec.shards as usize],
        }
    }

    pub fn consumer(&self, idx: usize, ack_inflight: usize) -> Consumer {
        Consumer {
            route: self.route(idx),
            spec: self.spec.clone(),
            acks: VecDeque::new(),
            ack_inflight,
        }
    }
}

/// The sending half of a publisher: `begin_publish_batch` returns once the
/// request is on the connection, with a [`PendingPublish`] to await.
#[derive(Debug)]
pub struct PubTx {
    route: Route,
    spec: Arc<Spec>,
}

impl PubTx {
    pub async fn send(
        &mut self,
        shard: u32,
        payloads: Vec<Bytes>,
    ) -> Result<PendingPublish, String> {
        let s = &self.spec.name;
        let records = payloads
            .into_iter()
            .map(|payload| RecordIn {
                payload,
                headers: self.spec.headers.clone(),
                ..RecordIn::default()
            })
            .collect();
        self.route
            .get(shard)
            .begin_publish_batch(&s.tenant, &s.namespace, &s.stream, shard, records)
            .await
            .map_err(e)
    }
}

pub async fn complete(p: PendingPublish) -> Result<u64, String> {
    let published = p.await.map_err(e)?;
    Ok(u64::from(published.count))
}

#[derive(Debug)]
pub struct Reader {
    route: Route,
    spec: Arc<Spec>,
    /// Next offset per shard; `None`: from the earliest.
    next: Vec<Option<StartPosition>>,
}

impl Reader {
    pub async fn seek_start(&mut self, shard: u32) -> Result<(), String> {
        self.next[shard as usize] = Some(StartPosition::Earliest);
        Ok(())
    }

    pub async fn seek_end(&mut self, shard: u32) -> Result<(), String> {
        let s = &self.spec.name;
        let info = self
            .route
            .get(shard)
            .describe_shard(&s.tenant, &s.namespace, &s.stream, shard)
            .await
            .map_err(e)?;
        self.next[shard as usize] = Some(StartPosition::Offset(info.end_offset));
        Ok(())
    }

    pub async fn read(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Bytes>, String> {
        let s = &self.spec.name;
        let from = self.next[shard as usize].unwrap_or(StartPosition::Earliest);
        let wait = (!wait.is_zero()).then_some(wait);
        let batch = self
            .route
            .get(shard)
            .read(&s.tenant, &s.namespace, &s.stream, shard, from, max, wait)
            .await
            .map_err(e)?;
        self.next[shard as usize] = Some(StartPosition::Offset(batch.next_offset));
        Ok(batch.records.into_iter().map(|r| r.payload).collect())
    }
}

#[derive(Debug)]
pub struct Consumer {
    route: Route,
    spec: Arc<Spec>,
    acks: VecDeque<felix_client::PendingAck>,
    ack_inflight: usize,
}

impl Consumer {
    pub async fn poll(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Delivery>, String> {
        let s = &self.spec.name;
        let records = self
            .route
            .get(shard)
            .group_poll_wait(&s.tenant, &s.namespace, &s.stream, shard, GROUP, max, wait)
            .await
            .map_err(e)?;
        Ok(records
            .into_iter()
            .map(|r| Delivery {
                payload: r.payload.clone(),
                attempts: r.attempts,
                handle: Handle::Felix(r),
            })
            .collect())
    }

    /// Send an ack for `handles` without waiting for its answer (at most
    /// `ack_inflight` outstanding; the oldest is awaited first).
    pub async fn ack(&mut self, shard: u32, handles: Vec<Handle>) -> Result<(), String> {
        let offsets: Vec<u64> = handles
            .into_iter()
            .map(|h| match h {
                Handle::Felix(r) => r.offset,
                _ => unreachable!("felix consumer got a foreign handle"),
            })
            .collect();
        if offsets.is_empty() {
            return Ok(());
        }
        while self.acks.len() >= self.ack_inflight {
            self.wait_oldest().await?;
        }
        // Queued on the connection now, so the next poll leaves with it.
        let s = &self.spec.name;
        let pending = self
            .route
            .get(shard)
            .begin_group_ack_many(&s.tenant, &s.namespace, &s.stream, shard, GROUP, &offsets)
            .await
            .map_err(e)?;
        self.acks.push_back(pending);
        Ok(())
    }

    async fn wait_oldest(&mut self) -> Result<(), String> {
        if let Some(p) = self.acks.pop_front() {
            p.await.map_err(e)?;
        }
        Ok(())
    }

    pub async fn nack(&mut self, shard: u32, handle: Handle) -> Result<(), String> {
        let Handle::Felix(r) = handle else {
            unreachable!("felix consumer got a foreign handle")
        };
        let r: GroupRecord = r;
        let s = &self.spec.name;
        self.route
            .get(shard)
            .group_nack(&s.tenant, &s.namespace, &s.stream, shard, GROUP, &r)
            .await
            .map_err(e)
    }

    /// Wait for every outstanding ack.
    pub async fn finish(&mut self) -> Result<(), String> {
        while !self.acks.is_empty() {
            self.wait_oldest().await?;
        }
        Ok(())
    }
}

/// `connections` clients of the broker at `addr`. The broker prints its
/// address before every core has bound it: a refused connection is tried
/// again for a few seconds.
async fn connect_all(
    addr: &str,
    connections: usize,
    config: &ClientConfig,
) -> Result<Vec<Client>, String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut clients = Vec::with_capacity(connections);
    for _ in 0..connections {
        let c = loop {
            match Client::connect(addr, config.clone()).await {
                Ok(c) => break c,
                Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(err) => return Err(format!("cannot connect to Felix at {addr}: {err}")),
            }
        };
        clients.push(c);
    }
    Ok(clients)
}

/// The benchmark's stream keeps every record whatever the broker's default
/// retention: its check counts the records each shard holds.
const KEEP_ALL: StreamOptions = StreamOptions {
    retention_bytes: Some(0),
    retention_ms: Some(0),
    incarnation: None,
};

/// Why the benchmark's stream could not be made, with what to do about a
/// stream of that name already there (one left by a run that was killed).
fn create_failed(s: &impl std::fmt::Display, err: ClientError) -> String {
    let name = s.to_string();
    if err.code() == Some(ErrorCode::AlreadyExists) && name.starts_with("bench/default/") {
        format!(
            "create_stream {s}: {err}: the benchmark never writes into a stream it did not \
             make; pass another --stream (this one looks left behind by a run stopped before \
             it cleaned up: it may be deleted with `felix stream delete {s}` once nothing \
             uses it)"
        )
    } else if err.code() == Some(ErrorCode::AlreadyExists) {
        format!(
            "create_stream {s}: {err}: the benchmark never writes into a stream it did not \
             make; pass another --stream, or leave it out for a fresh bench/default/... name"
        )
    } else {
        format!("create_stream {s}: {err}")
    }
}

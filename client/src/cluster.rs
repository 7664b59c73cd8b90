//! [`ClusterClient`]: one client for a cluster of brokers, sending each
//! shard's requests to the broker that leads it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use felix_wire::{ErrorCode, RecordIn, StartPosition, StreamInfo, StreamRef};

use crate::{Client, ClientConfig, ClientError, Published, ReadBatch, Result, StreamOptions};

/// How many times a call tries before giving up (following a leader, or
/// waiting out an election, takes a few).
const ATTEMPTS: u32 = 40;
const BACKOFF_FIRST: Duration = Duration::from_millis(25);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// A client for a cluster (brokers run with `cluster.nodes`), where every
/// shard is replicated on every broker and served by its elected leader.
///
/// It keeps a [`Client`] per broker it has talked to and, per shard, the
/// broker that last led it. A publish goes there; a broker that does not
/// lead the shard answers `not_leader` naming the one that does, and the
/// call follows it. While no leader is known (an election after a leader
/// was lost), or a broker cannot be reached, the call tries the others in
/// turn, backing off, for about ten seconds.
///
/// A publish that was sent and whose answer was lost (the broker died, the
/// connection dropped, the request timed out) is sent again, so it can be
/// written twice: records are at least once, as the guide says of
/// failovers. Stream creation and deletion go to every broker.
///
/// ```no_run
/// # async fn demo() -> felix_client::Result<()> {
/// use felix_client::{ClientConfig, ClusterClient, StreamOptions};
///
/// let cluster = ClusterClient::connect(
///     &["127.0.0.1:7400", "127.0.0.1:7410", "127.0.0.1:7420"],
///     ClientConfig::default(),
/// )
/// .await?;
/// cluster
///     .create_stream("t1", "default", "orders", 2, StreamOptions::default())
///     .await?;
/// let offset = cluster.publish("t1", "default", "orders", 0, "hello").await?;
/// println!("written at {offset}");
/// # Ok(())
/// # }
/// ```
pub struct ClusterClient {
    brokers: Vec<String>,
    config: ClientConfig,
    clients: tokio::sync::Mutex<HashMap<String, Client>>,
    /// The broker that last led each shard.
    leaders: Mutex<HashMap<(StreamRef, u32), String>>,
}

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient")
            .field("brokers", &self.brokers)
            .finish_non_exhaustive()
    }
}

/// Worth trying another broker (or the same one again) for: nothing was
/// applied, or what was may be applied again harmlessly at least once.
fn retryable(e: &ClientError) -> bool {
    match e {
        ClientError::NotLeader { .. }
        | ClientError::Io(_)
        | ClientError::Disconnected
        | ClientError::Timeout => true,
        ClientError::Server { code, .. } => *code == ErrorCode::Unavailable,
        _ => false,
    }
}

impl ClusterClient {
    /// Connect to the cluster's brokers (their client addresses). At least
    /// one must answer now; the others are connected to when needed.
    pub async fn connect(
        brokers: &[impl AsRef<str>],
        config: ClientConfig,
    ) -> Result<ClusterClient> {
        let brokers: Vec<String> = brokers.iter().map(|b| b.as_ref().to_string()).collect();
        if brokers.is_empty() {
            return Err(ClientError::InvalidArgument(
                "a cluster client needs at least one broker address".into(),
            ));
        }
        let c = ClusterClient {
            brokers,
            config,
            clients: tokio::sync::Mutex::new(HashMap::new()),
            leaders: Mutex::new(HashMap::new()),
        };
        let mut last = None;
        for b in c.brokers.clone() {
            match c.client(&b).await {
                Ok(_) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one broker"))
    }

    /// The brokers given at connect.
    pub fn brokers(&self) -> &[String] {
        &self.brokers
    }

    /// The broker that last led `shard` of the stream, if one is known.
    pub fn leader_of(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
    ) -> Option<String> {
        self.leaders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(StreamRef::new(tenant, namespace, stream), shard))
            .cloned()
    }

    async fn client(&self, addr: &str) -> Result<Client> {
        let mut clients = self.clients.lock().await;
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let c = Client::connect(addr, self.config.clone()).await?;
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Forget a broker's client (it failed): the next call connects anew.
    async fn drop_client(&self, addr: &str) {
        self.clients.lock().await.remove(addr);
    }

    /// Run `call` against the leader of `shard`, following `not_leader`
    /// answers and trying the other brokers while none is known.
    async fn on_leader<T, F, Fut>(&self, stream: &StreamRef, shard: u32, call: F) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let key = (stream.clone(), shard);
        let cached = self
            .leaders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&key)
            .cloned();
        let mut next = 0usize;
        let mut target = cached.unwrap_or_else(|| self.brokers[0].clone());
        let mut backoff = BACKOFF_FIRST;
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let result = match self.client(&target).await {
                Ok(c) => call(c).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(v) => {
                    self.leaders
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(key, target);
                    return Ok(v);
                }
                Err(ClientError::NotLeader {
                    leader: Some(l), ..
                }) if l != target => {
                    // Follow the broker that leads it.
                    target = l;
                    continue;
                }
                Err(e) if retryable(&e) => {
                    if matches!(
                        e,
                        ClientError::Io(_) | ClientError::Disconnected | ClientError::Timeout
                    ) {
                        self.drop_client(&target).await;
                    }
                    last = Some(e);
                    // No leader known here: try the next broker after a
                    // pause (an election takes a few hundred ms).
                    next = (next + 1) % self.brokers.len();
                    target = self.brokers[next].clone();
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(ClientError::Timeout))
    }

    /// Run `call` on every broker: streams are created and deleted on each.
    async fn on_every<F, Fut>(&self, call: F) -> Result<()>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        for b in &self.brokers {
            let c = self.client(b).await?;
            call(c).await?;
        }
        Ok(())
    }

    /// Create a stream on every broker (one already there with the same
    /// shard count is left as it is, so a create interrupted part way can
    /// be run again).
    pub async fn create_stream(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shards: u32,
        options: StreamOptions,
    ) -> Result<()> {
        self.on_every(|c| async move {
            match c
                .create_stream(tenant, namespace, stream, shards, options)
                .await
            {
                Ok(_) => Ok(()),
                Err(ClientError::Server {
                    code: ErrorCode::AlreadyExists,
                    ..
                }) => {
                    let info = c.describe_stream(tenant, namespace, stream).await?;
                    if info.shards == shards {
                        Ok(())
                    } else {
                        Err(ClientError::Server {
                            code: ErrorCode::AlreadyExists,
                            message: format!(
                                "{tenant}/{namespace}/{stream} exists on {} with {} shards, not {shards}",
                                c.broker(),
                                info.shards
                            ),
                        })
                    }
                }
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Delete a stream on every broker (one already gone is fine).
    pub async fn delete_stream(&self, tenant: &str, namespace: &str, stream: &str) -> Result<()> {
        self.on_every(|c| async move {
            match c.delete_stream(tenant, namespace, stream).await {
                Ok(()) => Ok(()),
                Err(ClientError::Server {
                    code: ErrorCode::NotFound,
                    ..
                }) => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Describe a stream (as the first broker that answers has it).
    pub async fn describe_stream(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
    ) -> Result<StreamInfo> {
        let mut last = None;
        for b in &self.brokers {
            match self.client(b).await {
                Ok(c) => match c.describe_stream(tenant, namespace, stream).await {
                    Ok(i) => return Ok(i),
                    Err(e) if retryable(&e) => last = Some(e),
                    Err(e) => return Err(e),
                },
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(ClientError::Timeout))
    }

    /// Publish one record to `shard` through its leader; returns its offset.
    pub async fn publish(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        payload: impl Into<Bytes>,
    ) -> Result<u64> {
        let record = RecordIn {
            payload: payload.into(),
            ..RecordIn::default()
        };
        let p = self
            .publish_batch(tenant, namespace, stream, shard, vec![record])
            .await?;
        Ok(p.base_offset)
    }

    /// Publish records to `shard` in one request through its leader; they
    /// get consecutive offsets.
    pub async fn publish_batch(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        records: Vec<RecordIn>,
    ) -> Result<Published> {
        let r = StreamRef::new(tenant, namespace, stream);
        self.on_leader(&r, shard, |c| {
            let records = records.clone();
            async move {
                c.publish_batch(tenant, namespace, stream, shard, records)
                    .await
            }
        })
        .await
    }

    /// Read up to `max_records` of `shard` from `from`, from the broker
    /// that last led it (every replica serves reads of what is committed;
    /// a follower's copy can be a little behind its leader's).
    #[allow(clippy::too_many_arguments)]
    pub async fn read(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: StartPosition,
        max_records: u32,
        wait: Option<Duration>,
    ) -> Result<ReadBatch> {
        let r = StreamRef::new(tenant, namespace, stream);
        self.on_leader(&r, shard, |c| async move {
            c.read(tenant, namespace, stream, shard, from, max_records, wait)
                .await
        })
        .await
    }
}

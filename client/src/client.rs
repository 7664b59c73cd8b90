//! [`Client`]: connections per core, placement, and every call.

use std::collections::HashMap;
use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_wire::{
    AckMode, ClusterInfo, DeadLetterInfo, ErrorCode, GroupInfo, GroupKey, GroupMemberRef,
    GroupRecord, PublishTarget, RecordIn, ReplicaInfo, Request, Response, ShardInfo, StartPosition,
    StreamInfo, StreamRef, FEATURE_CLUSTER_INFO, FEATURE_GROUPS, FEATURE_GROUP_ADMIN,
    FEATURE_GROUP_CLAIM_CONTROL, FEATURE_GROUP_DEAD_LETTER_PAGES, FEATURE_GROUP_SKIPPED,
    FEATURE_PUBLISH_ACK_MODE, FEATURE_REPLICA_INFO, FEATURE_STREAM_INCARNATION,
};
use tokio::net::ToSocketAddrs;

use crate::config::ClientConfig;
use crate::conn::Conn;
use crate::error::{ClientError, Result};
use crate::subscribe::Subscription;
use crate::types::{
    DeadLetterPage, GroupMember, GroupPollOptions, Published, ReadBatch, StreamOptions,
};

/// A connection to one Felix broker.
///
/// Cheap to clone: clones share connections and the placement cache, and
/// can be used from many tasks at once. Every call may be issued
/// concurrently; requests are pipelined on each connection and answered out
/// of order, so a long poll never holds up an acknowledgement.
///
/// The client keeps one connection per broker core. A request about a shard
/// goes to the connection of the core that owns the shard (learned from
/// [`describe_stream`](Client::describe_stream) and cached); if the broker
/// answers `wrong_core`, the client refreshes the placement and retries once
/// on the core the broker named. Connections open lazily and are reopened
/// after a failure, waiting an exponentially growing delay between failed
/// attempts. A request in flight on a connection that drops fails with
/// [`ClientError::Disconnected`]; nothing is resent behind your back.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("addrs", &self.inner.addrs)
            .field("cores", &self.cores())
            .field("features", &format_args!("{:#x}", self.features()))
            .finish()
    }
}

struct Inner {
    config: ClientConfig,
    addrs: Vec<SocketAddr>,
    /// Features of the most recent HELLO: what every check uses.
    features: AtomicU64,
    cores: AtomicU32,
    /// The broker's frame limit, from the most recent HELLO.
    max_frame_bytes: AtomicU32,
    broker: Mutex<String>,
    /// Core of the first connection; carries requests not about a shard.
    /// The core `call_any` uses: where the first connection landed, moved
    /// if the broker comes back without that core.
    home_core: AtomicU32,
    slots: Mutex<HashMap<u32, Arc<Slot>>>,
    placement: Mutex<HashMap<StreamRef, Arc<Placement>>>,
}

/// Shard count and owning core per shard of one stream.
#[derive(Debug)]
struct Placement {
    shards: u32,
    cores: Vec<u32>,
}

/// The connection to one core, and its reconnect state.
struct Slot {
    /// Bumped after every connection attempt, so callers that queued behind
    /// a failed attempt share its failure instead of each trying in turn.
    attempts: AtomicU64,
    state: tokio::sync::Mutex<SlotState>,
}

struct SlotState {
    conn: Option<Arc<Conn>>,
    backoff: Duration,
    retry_at: Option<Instant>,
    last_error: Option<(std::io::ErrorKind, String)>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Milliseconds for a wire field, rounding a non-zero sub-millisecond
/// duration up so it does not turn into "none".
fn ms_u64(d: Duration) -> u64 {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 && !d.is_zero() {
        1
    } else {
        ms
    }
}

fn ms_u32(d: Duration) -> u32 {
    u32::try_from(ms_u64(d)).unwrap_or(u32::MAX)
}

fn unexpected(resp: Response, call: &str) -> ClientError {
    ClientError::Protocol(format!("broker answered {call} with {}", resp.name()))
}

/// `Extended.stands_ms`: how long the claim now stands, from the broker's
/// answer.
fn claim_stands_for(stands_ms: u64) -> Duration {
    Duration::from_millis(stands_ms)
}

/// A dead-letter page must move forward: letters ascending, at or above
/// `from`, below `next`, and not empty while more are promised. Anything
/// else is a broker fault (and would make a paging loop repeat or stall).
fn check_dead_letter_page(from: u64, page: &DeadLetterPage) -> Result<()> {
    let mut prev: Option<u64> = None;
    for d in &page.letters {
        if d.offset < from || prev.is_some_and(|p| d.offset <= p) {
            return Err(ClientError::Protocol(format!(
                "dead-letter page from {from} lists offset {} out of order",
                d.offset
            )));
        }
        prev = Some(d.offset);
    }
    match (page.next, page.letters.last()) {
        (Some(next), None) => Err(ClientError::Protocol(format!(
            "empty dead-letter page from {from} promised more from {next}"
        ))),
        (Some(next), Some(last)) if next <= last.offset => Err(ClientError::Protocol(format!(
            "dead-letter page from {from} ends at {} but says next {next}",
            last.offset
        ))),
        _ => Ok(()),
    }
}

fn published(resp: Response) -> Result<Published> {
    match resp {
        Response::Published {
            shard,
            base_offset,
            count,
        } => Ok(Published {
            base_offset,
            count,
            shard,
        }),
        other => Err(unexpected(other, "publish")),
    }
}

/// A request already sent whose answer is still to come: `.await` it for
/// the answer. Dropping it does not recall the request (a publish may still
/// be written, an ack still applied).
#[must_use = "the request was sent; await it to learn whether it was applied"]
pub struct Pending<T> {
    fut: Pin<Box<dyn Future<Output = Result<T>> + Send>>,
}

impl<T> Pending<T> {
    fn new(fut: impl Future<Output = Result<T>> + Send + 'static) -> Self {
        Pending { fut: Box::pin(fut) }
    }
}

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").finish_non_exhaustive()
    }
}

impl<T> IntoFuture for Pending<T> {
    type Output = Result<T>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<T>> + Send>>;
    fn into_future(self) -> Self::IntoFuture {
        self.fut
    }
}

/// A publish sent by [`Client::begin_publish_batch`]: `.await` it for the
/// [`Published`] offsets.
pub type PendingPublish = Pending<Published>;

/// An acknowledgement sent by [`Client::begin_group_ack_many`]: `.await` it
/// to learn that the records are finished (their position change, if any,
/// durable).
pub type PendingAck = Pending<()>;

fn feature_name(bit: u64) -> &'static str {
    match bit {
        FEATURE_GROUPS => "FEATURE_GROUPS",
        FEATURE_GROUP_SKIPPED => "FEATURE_GROUP_SKIPPED",
        FEATURE_GROUP_CLAIM_CONTROL => "FEATURE_GROUP_CLAIM_CONTROL",
        FEATURE_GROUP_ADMIN => "FEATURE_GROUP_ADMIN",
        FEATURE_PUBLISH_ACK_MODE => "FEATURE_PUBLISH_ACK_MODE",
        FEATURE_GROUP_DEAD_LETTER_PAGES => "FEATURE_GROUP_DEAD_LETTER_PAGES",
        FEATURE_REPLICA_INFO => "FEATURE_REPLICA_INFO",
        FEATURE_STREAM_INCARNATION => "FEATURE_STREAM_INCARNATION",
        FEATURE_CLUSTER_INFO => "FEATURE_CLUSTER_INFO",
        _ => "an unknown feature",
    }
}

impl Client {
    /// Resolve `addr`, open a first connection and say HELLO.
    ///
    /// Fails if no address answers within `config.connect_timeout`, or the
    /// broker refuses HELLO (a bad token, an unsupported version).
    pub async fn connect(addr: impl ToSocketAddrs, config: ClientConfig) -> Result<Client> {
        let addrs: Vec<SocketAddr> =
            match tokio::time::timeout(config.connect_timeout, tokio::net::lookup_host(addr)).await
            {
                Ok(r) => r?.collect(),
                Err(_) => return Err(ClientError::Timeout),
            };
        if addrs.is_empty() {
            return Err(ClientError::InvalidArgument(
                "broker address resolved to nothing".into(),
            ));
        }
        let conn = Conn::open(&addrs, None, &config).await?;
        let hello = conn.hello.clone();
        let slot = Arc::new(Slot {
            attempts: AtomicU64::new(0),
            state: tokio::sync::Mutex::new(SlotState {
                conn: Some(Arc::new(conn)),
                backoff: config.reconnect_backoff_initial,
                retry_at: None,
                last_error: None,
            }),
        });
        tracing::debug!(broker = %hello.broker, cores = hello.cores, core = hello.core,
            features = hello.features, "connected to felix broker");
        Ok(Client {
            inner: Arc::new(Inner {
                config,
                addrs,
                features: AtomicU64::new(hello.features),
                cores: AtomicU32::new(hello.cores),
                max_frame_bytes: AtomicU32::new(hello.max_frame_bytes),
                broker: Mutex::new(hello.broker),
                home_core: AtomicU32::new(hello.core),
                slots: Mutex::new(HashMap::from([(hello.core, slot)])),
                placement: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The settings this client was built with.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// Feature bits negotiated with the broker (`FEATURE_*`), from the most
    /// recent HELLO.
    pub fn features(&self) -> u64 {
        self.inner.features.load(Ordering::Relaxed)
    }

    /// Whether the broker advertised every bit of `feature`.
    pub fn has_feature(&self, feature: u64) -> bool {
        self.features() & feature == feature
    }

    /// How many cores (shard owners) the broker runs.
    pub fn cores(&self) -> u32 {
        self.inner.cores.load(Ordering::Relaxed)
    }

    /// The largest frame the broker takes (its `server.max_frame_bytes`),
    /// from the most recent HELLO. A publish whose records hold more bytes
    /// than this is refused before it is sent; a record that alone holds
    /// more can never be published.
    pub fn max_frame_bytes(&self) -> u32 {
        self.inner.max_frame_bytes.load(Ordering::Relaxed)
    }

    /// The broker's name and version, as it gave them in HELLO.
    pub fn broker(&self) -> String {
        lock(&self.inner.broker).clone()
    }

    // ----- connections and routing -------------------------------------

    fn slot(&self, core: u32) -> Arc<Slot> {
        lock(&self.inner.slots)
            .entry(core)
            .or_insert_with(|| {
                Arc::new(Slot {
                    attempts: AtomicU64::new(0),
                    state: tokio::sync::Mutex::new(SlotState {
                        conn: None,
                        backoff: self.inner.config.reconnect_backoff_initial,
                        retry_at: None,
                        last_error: None,
                    }),
                })
            })
            .clone()
    }

    /// The live connection to `core`, opening one if needed.
    async fn conn(&self, core: u32) -> Result<Arc<Conn>> {
        let slot = self.slot(core);
        let seen = slot.attempts.load(Ordering::Acquire);
        let mut st = slot.state.lock().await;
        if let Some(c) = &st.conn {
            if !c.is_closed() {
                return Ok(c.clone());
            }
            let config = &self.inner.config;
            if c.proved() {
                st.backoff = config.reconnect_backoff_initial;
            } else {
                // Closed before it answered anything (a broker taking
                // connections and dropping them): a failed attempt, so the
                // next one waits out the backoff too, and it keeps growing.
                st.retry_at = Instant::now().checked_add(st.backoff);
                st.backoff = st
                    .backoff
                    .saturating_mul(2)
                    .min(config.reconnect_backoff_max);
            }
            st.conn = None;
        }
        // Someone else tried while we queued for the lock, and failed.
        if slot.attempts.load(Ordering::Acquire) != seen {
            if let Some((kind, msg)) = &st.last_error {
                return Err(ClientError::Io(std::io::Error::new(*kind, msg.clone())));
            }
        }
        if let Some(at) = st.retry_at {
            tokio::time::sleep_until(at.into()).await;
        }
        let config = &self.inner.config;
        let result = Conn::open(&self.inner.addrs, Some(core), config).await;
        slot.attempts.fetch_add(1, Ordering::AcqRel);
        match result {
            Ok(conn) => {
                let hello = &conn.hello;
                self.inner.features.store(hello.features, Ordering::Relaxed);
                self.inner
                    .max_frame_bytes
                    .store(hello.max_frame_bytes, Ordering::Relaxed);
                let was = self.inner.cores.swap(hello.cores, Ordering::Relaxed);
                if was != hello.cores {
                    // Restarted with another core count: placements moved.
                    lock(&self.inner.placement).clear();
                }
                *lock(&self.inner.broker) = hello.broker.clone();
                // The backoff is reset once the broker answers on this
                // connection (above), not by a HELLO alone.
                st.retry_at = None;
                st.last_error = None;
                let conn = Arc::new(conn);
                st.conn = Some(conn.clone());
                Ok(conn)
            }
            Err(e)
                if e.code() == Some(ErrorCode::InvalidRequest)
                    && core > 0
                    && self.learn_cores().await
                    && core >= self.cores() =>
            {
                // The broker refused the core asked for because it came
                // back with fewer cores (learnt from a connection that asks
                // for none; home moved if it was that core, placements
                // refreshed). Nothing was sent; the callers that route by
                // core try again where the shard is now.
                let msg = format!(
                    "the broker no longer runs core {core} (it runs {}): {e}",
                    self.cores()
                );
                st.last_error = Some((std::io::ErrorKind::NotFound, msg.clone()));
                Err(ClientError::Io(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    msg,
                )))
            }
            Err(e) => {
                tracing::debug!(core, error = %e, backoff = ?st.backoff, "felix connect failed");
                st.retry_at = Instant::now().checked_add(st.backoff);
                st.backoff = st
                    .backoff
                    .saturating_mul(2)
                    .min(config.reconnect_backoff_max);
                let kind = match &e {
                    ClientError::Io(io) => io.kind(),
                    ClientError::Timeout => std::io::ErrorKind::TimedOut,
                    _ => std::io::ErrorKind::Other,
                };
                st.last_error = Some((kind, e.to_string()));
                Err(e)
            }
        }
    }

    /// After the broker refused a core: HELLO without asking for one, take
    /// its core count (dropping placements if it changed) and move home to
    /// the core the connection landed on if home is out of range. False if
    /// the broker could not be reached.
    async fn learn_cores(&self) -> bool {
        let Ok(conn) = Conn::open(&self.inner.addrs, None, &self.inner.config).await else {
            return false;
        };
        let hello = &conn.hello;
        self.inner.features.store(hello.features, Ordering::Relaxed);
        self.inner
            .max_frame_bytes
            .store(hello.max_frame_bytes, Ordering::Relaxed);
        if self.inner.cores.swap(hello.cores, Ordering::Relaxed) != hello.cores {
            lock(&self.inner.placement).clear();
        }
        *lock(&self.inner.broker) = hello.broker.clone();
        if self.home() >= hello.cores {
            tracing::debug!(core = hello.core, "home core gone; moving home");
            self.inner.home_core.store(hello.core, Ordering::Relaxed);
        }
        true
    }

    fn home(&self) -> u32 {
        self.inner.home_core.load(Ordering::Relaxed)
    }

    /// Send on `core`'s connection; `wait` is the server-side wait the
    /// request carries, added to the request timeout.
    async fn call_core(&self, core: u32, req: &Request, wait: Duration) -> Result<Response> {
        let conn = self.conn(core).await?;
        let timeout = self.inner.config.request_timeout.saturating_add(wait);
        conn.call(req, timeout).await
    }

    /// `core`'s connection; if the broker no longer runs that core (so
    /// nothing was sent), the connection to the core `again` picks now.
    async fn conn_or_moved(
        &self,
        core: u32,
        again: impl AsyncFnOnce() -> Result<u32>,
    ) -> Result<Arc<Conn>> {
        match self.conn(core).await {
            Err(_) if core >= self.cores() => self.conn(again().await?).await,
            r => r,
        }
    }

    /// A request not about one shard: any core serves it.
    async fn call_any(&self, req: &Request) -> Result<Response> {
        // Home gone (the broker came back with fewer cores): the new home.
        let conn = self
            .conn_or_moved(self.home(), async || Ok(self.home()))
            .await?;
        match conn.call(req, self.inner.config.request_timeout).await? {
            Response::Error(e) => Err(e.into()),
            resp => Ok(resp),
        }
    }

    fn cache_placement(&self, info: &StreamInfo) -> Arc<Placement> {
        let p = Arc::new(Placement {
            shards: info.shards,
            cores: info.placement.clone(),
        });
        lock(&self.inner.placement).insert(info.stream.clone(), p.clone());
        p
    }

    async fn placement(&self, stream: &StreamRef, refresh: bool) -> Result<Arc<Placement>> {
        if !refresh {
            if let Some(p) = lock(&self.inner.placement).get(stream) {
                return Ok(p.clone());
            }
        }
        let info = self.describe_stream_ref(stream).await?;
        Ok(self.cache_placement(&info))
    }

    /// The core to send a request about `shard` to. An error looking it up
    /// is returned as the request's, which was not sent (so
    /// [`ClientError::not_applied`] where the error can say it).
    async fn core_for(&self, stream: &StreamRef, shard: u32) -> Result<u32> {
        if self.cores() <= 1 {
            return Ok(self.home());
        }
        let cores = self.cores();
        let mut p = self
            .placement(stream, false)
            .await
            .map_err(ClientError::unsent)?;
        if p.cores.get(shard as usize).is_some_and(|&c| c >= cores) {
            // Cached before the broker came back with fewer cores.
            p = self
                .placement(stream, true)
                .await
                .map_err(ClientError::unsent)?;
        }
        // A shard the placement does not know (or a core the broker does
        // not have): let the broker answer, with the right core.
        Ok(p.cores
            .get(shard as usize)
            .copied()
            .filter(|&c| c < cores)
            .unwrap_or(self.home()))
    }

    /// Send a request about `shard` to the core that owns it, following one
    /// `wrong_core` redirect.
    async fn call_shard(
        &self,
        stream: &StreamRef,
        shard: u32,
        req: &Request,
        wait: Duration,
    ) -> Result<Response> {
        let core = self.core_for(stream, shard).await?;
        // That core gone (the broker came back with fewer cores): the
        // shard's core now.
        let conn = self
            .conn_or_moved(core, async || self.core_for(stream, shard).await)
            .await?;
        let timeout = self.inner.config.request_timeout.saturating_add(wait);
        match conn.call(req, timeout).await? {
            Response::Error(e) if e.code == ErrorCode::WrongCore => {
                self.redirect(stream, shard, req, e, wait).await
            }
            Response::Error(e) => Err(e.into()),
            resp => Ok(resp),
        }
    }

    /// After a `wrong_core` answer: refresh the stream's placement and send
    /// once more, to the core the broker named (or the fresh placement's).
    async fn redirect(
        &self,
        stream: &StreamRef,
        shard: u32,
        req: &Request,
        e: felix_wire::WireError,
        wait: Duration,
    ) -> Result<Response> {
        tracing::debug!(%stream, shard, right = ?e.core, "wrong_core; refreshing placement");
        let fresh = match self.placement(stream, true).await {
            Ok(p) => p.cores.get(shard as usize).copied(),
            Err(_) => None,
        };
        let cores = self.cores();
        let in_range = |c: &u32| *c < cores;
        let Some(right) = e.core.filter(in_range).or(fresh.filter(in_range)) else {
            return Err(e.into());
        };
        match self.call_core(right, req, wait).await? {
            Response::Error(e) => Err(e.into()),
            resp => Ok(resp),
        }
    }

    fn require(&self, bits: u64, what: &str) -> Result<()> {
        let missing = bits & !self.features();
        if missing == 0 {
            return Ok(());
        }
        let names: Vec<&str> = (0..64)
            .map(|i| 1u64 << i)
            .filter(|b| missing & b != 0)
            .map(feature_name)
            .collect();
        // The usual reason, named: groups need the broker's durable storage.
        let why = if missing & FEATURE_GROUPS != 0 {
            " (a broker without durable storage offers no consumer groups)"
        } else {
            ""
        };
        Err(ClientError::Unsupported(format!(
            "{what} needs {}, which the broker does not advertise{why}",
            names.join(" and ")
        )))
    }

    // ----- streams -------------------------------------------------------

    /// Create a stream of `shards` shards.
    pub async fn create_stream(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shards: u32,
        options: StreamOptions,
    ) -> Result<StreamInfo> {
        if shards == 0 {
            return Err(ClientError::InvalidArgument(
                "a stream needs at least one shard".into(),
            ));
        }
        if let Some(i) = options
            .incarnation
            .filter(|i| *i == 0 || *i > i64::MAX as u64)
        {
            return Err(ClientError::InvalidArgument(format!(
                "a stream incarnation is 1..={}, not {i}",
                i64::MAX
            )));
        }
        let stream = StreamRef::new(tenant, namespace, stream);
        let req = Request::CreateStream {
            stream: stream.clone(),
            shards,
            retention_bytes: options.retention_bytes,
            retention_ms: options.retention_ms,
            incarnation: options.incarnation,
        };
        lock(&self.inner.placement).remove(&stream);
        match self.call_any(&req).await? {
            Response::Stream(info) => {
                self.cache_placement(&info);
                Ok(info)
            }
            Response::Ok => self.describe_stream_ref(&stream).await.inspect(|info| {
                self.cache_placement(info);
            }),
            other => Err(unexpected(other, "create_stream")),
        }
    }

    /// A stream's shard count, retention and placement.
    pub async fn describe_stream(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
    ) -> Result<StreamInfo> {
        let info = self
            .describe_stream_ref(&StreamRef::new(tenant, namespace, stream))
            .await?;
        self.cache_placement(&info);
        Ok(info)
    }

    async fn describe_stream_ref(&self, stream: &StreamRef) -> Result<StreamInfo> {
        let req = Request::DescribeStream {
            stream: stream.clone(),
        };
        match self.call_any(&req).await {
            Ok(Response::Stream(info)) => Ok(info),
            Ok(other) => Err(unexpected(other, "describe_stream")),
            Err(e) => {
                if e.code() == Some(ErrorCode::NotFound) {
                    lock(&self.inner.placement).remove(stream);
                }
                Err(e)
            }
        }
    }

    /// Every stream, or those of one tenant.
    pub async fn list_streams(&self, tenant: Option<&str>) -> Result<Vec<StreamInfo>> {
        let req = Request::ListStreams {
            tenant: tenant.map(str::to_string),
        };
        match self.call_any(&req).await? {
            Response::Streams(v) => {
                for info in &v {
                    self.cache_placement(info);
                }
                Ok(v)
            }
            other => Err(unexpected(other, "list_streams")),
        }
    }

    /// Delete a stream and everything in it.
    pub async fn delete_stream(&self, tenant: &str, namespace: &str, stream: &str) -> Result<()> {
        let stream = StreamRef::new(tenant, namespace, stream);
        let req = Request::DeleteStream {
            stream: stream.clone(),
        };
        let result = self.call_any(&req).await;
        lock(&self.inner.placement).remove(&stream);
        match result? {
            Response::Ok => Ok(()),
            other => Err(unexpected(other, "delete_stream")),
        }
    }

    /// One shard's offsets, size and owning core.
    pub async fn describe_shard(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
    ) -> Result<ShardInfo> {
        let stream = StreamRef::new(tenant, namespace, stream);
        let req = Request::DescribeShard {
            stream: stream.clone(),
            shard,
        };
        match self
            .call_shard(&stream, shard, &req, Duration::ZERO)
            .await?
        {
            Response::Shard(info) => Ok(info),
            other => Err(unexpected(other, "describe_shard")),
        }
    }

    /// This broker's replica of one shard, as it sees it: its role, term,
    /// the leader it knows (with its client address) and its replication
    /// indices; on the leader, every other broker's progress. Any broker of
    /// a cluster answers, leader or not. Needs
    /// [`FEATURE_REPLICA_INFO`](felix_wire::FEATURE_REPLICA_INFO), which
    /// only a broker in a cluster advertises.
    ///
    /// ```no_run
    /// # async fn demo(client: felix_client::Client) -> felix_client::Result<()> {
    /// let replica = client.describe_replica("t1", "default", "orders", 0).await?;
    /// match &replica.leader_addr {
    ///     Some(addr) => println!("shard 0 is led by {addr} (term {})", replica.term),
    ///     None => println!("shard 0 has no leader this broker knows of"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn describe_replica(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
    ) -> Result<ReplicaInfo> {
        self.require(FEATURE_REPLICA_INFO, "describe_replica")?;
        let stream = StreamRef::new(tenant, namespace, stream);
        let req = Request::DescribeReplica {
            stream: stream.clone(),
            shard,
        };
        match self
            .call_shard(&stream, shard, &req, Duration::ZERO)
            .await?
        {
            Response::Replica(info) => Ok(*info),
            other => Err(unexpected(other, "describe_replica")),
        }
    }

    /// Every broker of the cluster this broker belongs to, with the address
    /// clients reach it at (its `server.listen`), in node order. Needs
    /// [`FEATURE_CLUSTER_INFO`](felix_wire::FEATURE_CLUSTER_INFO), which
    /// only a broker in a cluster advertises: from one broker's address a
    /// client learns the others ([`ClusterClient`](crate::ClusterClient)
    /// does, at connect).
    ///
    /// ```no_run
    /// # async fn demo(client: felix_client::Client) -> felix_client::Result<()> {
    /// let cluster = client.describe_cluster().await?;
    /// for m in &cluster.members {
    ///     println!("node {} at {}", m.node, m.addr);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn describe_cluster(&self) -> Result<ClusterInfo> {
        self.require(FEATURE_CLUSTER_INFO, "describe_cluster")?;
        match self.call_any(&Request::DescribeCluster).await? {
            Response::Cluster(info) => Ok(info),
            other => Err(unexpected(other, "describe_cluster")),
        }
    }

    /// Round trip to the broker's home connection.
    pub async fn ping(&self) -> Result<Duration> {
        let start = Instant::now();
        match self.call_any(&Request::Ping).await? {
            Response::Pong => Ok(start.elapsed()),
            other => Err(unexpected(other, "ping")),
        }
    }

    // ----- publishing ----------------------------------------------------

    fn ack_mode(&self) -> Result<AckMode> {
        if self.inner.config.ack_on_commit {
            self.require(FEATURE_PUBLISH_ACK_MODE, "ack_on_commit")?;
            Ok(AckMode::Durable)
        } else {
            Ok(AckMode::Default)
        }
    }

    /// Publish one record to `shard`; returns its offset.
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

    /// Publish records to `shard` in one request; they get consecutive
    /// offsets.
    pub async fn publish_batch(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        records: Vec<RecordIn>,
    ) -> Result<Published> {
        if records.is_empty() {
            return Err(ClientError::InvalidArgument(
                "publish_batch needs at least one record".into(),
            ));
        }
        let stream = StreamRef::new(tenant, namespace, stream);
        let req = Request::Publish {
            stream: stream.clone(),
            target: PublishTarget::Shard(shard),
            ack: self.ack_mode()?,
            records: records.into(),
        };
        self.publish_req(&stream, shard, &req).await
    }

    /// Publish one record with a routing key. The record goes to the shard
    /// [`shard_for_key`](felix_wire::shard_for_key) picks over the stream's
    /// shard count, so records with one key keep their order; the key is
    /// stored with the record.
    pub async fn publish_keyed(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        key: impl Into<Bytes>,
        payload: impl Into<Bytes>,
    ) -> Result<Published> {
        let stream = StreamRef::new(tenant, namespace, stream);
        let key = key.into();
        // Unsent if the lookup fails (as in `core_for`).
        let placement = self
            .placement(&stream, false)
            .await
            .map_err(ClientError::unsent)?;
        let shard = felix_wire::shard_for_key(&key, placement.shards);
        let req = Request::Publish {
            stream: stream.clone(),
            target: PublishTarget::Key(key.clone()),
            ack: self.ack_mode()?,
            records: vec![RecordIn {
                key: Some(key),
                payload: payload.into(),
                ..RecordIn::default()
            }]
            .into(),
        };
        self.publish_req(&stream, shard, &req).await
    }

    async fn publish_req(
        &self,
        stream: &StreamRef,
        shard: u32,
        req: &Request,
    ) -> Result<Published> {
        published(self.call_shard(stream, shard, req, Duration::ZERO).await?)
    }

    /// Send a batch like [`publish_batch`](Client::publish_batch), but
    /// return as soon as the request is on its way, with a
    /// [`PendingPublish`] to await its answer.
    ///
    /// This pipelines publishes while keeping their order: batches begun
    /// one after another (each `begin_publish_batch` awaited before the
    /// next) are sent on the shard's connection in that order, and so get
    /// ascending offsets. Await the pending answers in the same order. A
    /// `wrong_core` answer (the shard's core changed: the broker came back
    /// with another core count) is returned, not followed: following it
    /// when awaited would send that batch after batches begun later. The
    /// batch was not written; the client has refreshed the shard's
    /// placement, so batches begun from then on, resent ones included, go
    /// to the right core.
    ///
    /// Order holds on one connection. If the connection drops, every answer
    /// pending on it fails with `Disconnected` (those batches may or may not
    /// be stored), and the next `begin_publish_batch` opens a new one: a
    /// caller that needs no gaps stops sending at the first failed answer
    /// rather than going on behind it.
    ///
    /// ```no_run
    /// # async fn demo(client: felix_client::Client) -> Result<(), felix_client::ClientError> {
    /// use felix_client::RecordIn;
    /// let mut pending = std::collections::VecDeque::new();
    /// for chunk in 0..10 {
    ///     let records = (0..100)
    ///         .map(|i| RecordIn { payload: format!("{chunk}-{i}").into(), ..Default::default() })
    ///         .collect();
    ///     pending.push_back(client.begin_publish_batch("t1", "default", "events", 0, records).await?);
    ///     if pending.len() >= 4 {
    ///         pending.pop_front().unwrap().await?;
    ///     }
    /// }
    /// for p in pending {
    ///     p.await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn begin_publish_batch(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        records: Vec<RecordIn>,
    ) -> Result<PendingPublish> {
        if records.is_empty() {
            return Err(ClientError::InvalidArgument(
                "publish_batch needs at least one record".into(),
            ));
        }
        let stream = StreamRef::new(tenant, namespace, stream);
        let req = Request::Publish {
            stream: stream.clone(),
            target: PublishTarget::Shard(shard),
            ack: self.ack_mode()?,
            records: records.into(),
        };
        let answer = self.begin_shard_call(stream, shard, req).await?;
        Ok(Pending::new(async move { published(answer.await?) }))
    }

    /// Put `req` on the connection to `shard`'s core and return once it is
    /// queued there, with the answer to come. Error answers become errors;
    /// a `wrong_core` one also refreshes the stream's placement (it is not
    /// followed: requests pipelined after this one may already be on their
    /// way, and resending it would reorder them).
    async fn begin_shard_call(
        &self,
        stream: StreamRef,
        shard: u32,
        req: Request,
    ) -> Result<impl Future<Output = Result<Response>> + Send + 'static> {
        let core = self.core_for(&stream, shard).await?;
        let conn = self
            .conn_or_moved(core, async || self.core_for(&stream, shard).await)
            .await?;
        let waiter = conn.send(&req, self.inner.config.request_timeout).await?;
        let client = self.clone();
        Ok(async move {
            match waiter.wait().await? {
                Response::Error(e) if e.code == ErrorCode::WrongCore => {
                    tracing::debug!(%stream, shard, right = ?e.core, "wrong_core on a pipelined call; refreshing placement");
                    let _ = client.placement(&stream, true).await;
                    Err(e.into())
                }
                Response::Error(e) => Err(e.into()),
                resp => Ok(resp),
            }
        })
    }

    // ----- reading -------------------------------------------------------

    /// Largest batch of payload a read asks for: half the smaller frame
    /// limit, leaving room for per-record overhead.
    fn read_max_bytes(&self) -> u32 {
        (self.inner.config.max_frame_bytes / 2).max(64 * 1024)
    }

    /// Read up to `max_records` records of `shard` from `from`. With
    /// `wait`, the broker holds the read up to that long for records to
    /// arrive when there are none; an empty batch is not an error.
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
        self.read_ref(
            &StreamRef::new(tenant, namespace, stream),
            shard,
            from,
            max_records,
            wait.unwrap_or(Duration::ZERO),
        )
        .await
    }

    pub(crate) async fn read_ref(
        &self,
        stream: &StreamRef,
        shard: u32,
        from: StartPosition,
        max_records: u32,
        wait: Duration,
    ) -> Result<ReadBatch> {
        if max_records == 0 {
            return Err(ClientError::InvalidArgument(
                "max_records must be at least 1".into(),
            ));
        }
        let wait_ms = ms_u32(wait);
        let req = Request::Read {
            stream: stream.clone(),
            shard,
            from,
            max_records,
            max_bytes: self.read_max_bytes(),
            wait_ms,
        };
        let wait = Duration::from_millis(u64::from(wait_ms));
        match self.call_shard(stream, shard, &req, wait).await? {
            Response::Records {
                start_offset,
                next_offset,
                end_offset,
                records,
            } => Ok(ReadBatch {
                records,
                next_offset,
                start_offset,
                end_offset,
            }),
            other => Err(unexpected(other, "read")),
        }
    }

    /// Follow `shard` from `from`, long-polling at the tail. See
    /// [`Subscription`].
    pub fn subscribe(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: StartPosition,
    ) -> Subscription {
        Subscription::new(
            self.clone(),
            StreamRef::new(tenant, namespace, stream),
            shard,
            from,
        )
    }

    // ----- consumer groups: consuming ------------------------------------

    pub(crate) fn group_key(
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> GroupKey {
        GroupKey {
            stream: StreamRef::new(tenant, namespace, stream),
            shard,
            group: group.to_string(),
        }
    }

    async fn group_call(&self, key: &GroupKey, req: &Request, wait: Duration) -> Result<Response> {
        self.call_shard(&key.stream, key.shard, req, wait).await
    }

    async fn group_ok(&self, key: &GroupKey, req: &Request, call: &str) -> Result<()> {
        match self.group_call(key, req, Duration::ZERO).await? {
            Response::Ok => Ok(()),
            other => Err(unexpected(other, call)),
        }
    }

    /// Claim up to `max_records` records for the group, without waiting.
    /// An empty batch means nothing was available.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_poll(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        max_records: u32,
    ) -> Result<Vec<GroupRecord>> {
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        self.poll(key, max_records, Duration::ZERO, None, None)
            .await
    }

    /// Claim up to `max_records` records for the group, waiting up to `wait`
    /// for one to become available. An empty batch means nothing was.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_poll_wait(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        max_records: u32,
        wait: Duration,
    ) -> Result<Vec<GroupRecord>> {
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        self.poll(key, max_records, wait, None, None).await
    }

    /// Poll as a named member of the group (see [`GroupMember`]), with
    /// [`GroupPollOptions`]. A `visibility` needs
    /// [`FEATURE_GROUP_CLAIM_CONTROL`](crate::FEATURE_GROUP_CLAIM_CONTROL)
    /// and is refused with [`ClientError::Unsupported`] without it.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_poll_as(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        member: &GroupMember,
        options: GroupPollOptions,
    ) -> Result<Vec<GroupRecord>> {
        let name_len = member.name().len();
        if name_len == 0 || name_len > GroupMember::MAX_NAME_BYTES {
            return Err(ClientError::InvalidArgument(format!(
                "a group member name is 1 to {} bytes, not {name_len}",
                GroupMember::MAX_NAME_BYTES
            )));
        }
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let member = GroupMemberRef {
            name: member.name().to_string(),
            reclaim: member.reclaims(),
        };
        self.poll(
            key,
            options.max_records,
            options.wait,
            Some(member),
            options.visibility,
        )
        .await
    }

    /// A poll of one shard's group, anonymous or as `member` (its name
    /// already checked).
    pub(crate) async fn poll_group(
        &self,
        key: GroupKey,
        max_records: u32,
        wait: Duration,
        member: Option<GroupMember>,
        visibility: Option<Duration>,
    ) -> Result<Vec<GroupRecord>> {
        let member = member.map(|m| GroupMemberRef {
            reclaim: m.reclaims(),
            name: m.name,
        });
        self.poll(key, max_records, wait, member, visibility).await
    }

    async fn poll(
        &self,
        key: GroupKey,
        max_records: u32,
        wait: Duration,
        member: Option<GroupMemberRef>,
        visibility: Option<Duration>,
    ) -> Result<Vec<GroupRecord>> {
        self.require(FEATURE_GROUPS, "a group poll")?;
        if max_records == 0 {
            return Err(ClientError::InvalidArgument(
                "max_records must be at least 1".into(),
            ));
        }
        let visibility_ms = match visibility {
            None => None,
            Some(v) => {
                self.require(FEATURE_GROUP_CLAIM_CONTROL, "a poll visibility")?;
                if v.is_zero() {
                    return Err(ClientError::InvalidArgument(
                        "a poll visibility must be more than zero".into(),
                    ));
                }
                Some(ms_u64(v))
            }
        };
        let wait_ms = ms_u32(wait);
        let req = Request::GroupPoll {
            key: key.clone(),
            max_records,
            wait_ms,
            member,
            visibility_ms,
        };
        let wait = Duration::from_millis(u64::from(wait_ms));
        match self.group_call(&key, &req, wait).await? {
            Response::GroupRecords { mut records } => {
                if !self.has_feature(FEATURE_GROUP_SKIPPED) {
                    for r in &mut records {
                        r.skipped_before = None;
                    }
                }
                Ok(records)
            }
            other => Err(unexpected(other, "group_poll")),
        }
    }

    /// Finish a record: the group will not hand it out again.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_ack(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        offset: u64,
    ) -> Result<()> {
        self.group_ack_many(tenant, namespace, stream, shard, group, &[offset])
            .await
    }

    /// Finish several records in one request. An empty slice sends nothing.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_ack_many(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        offsets: &[u64],
    ) -> Result<()> {
        self.require(FEATURE_GROUPS, "group_ack")?;
        if offsets.is_empty() {
            return Ok(());
        }
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupAck {
            key: key.clone(),
            offsets: offsets.to_vec(),
        };
        self.group_ok(&key, &req, "group_ack").await
    }

    /// Send [`group_ack_many`](Client::group_ack_many) and return as soon as
    /// the request is queued on the shard's connection, with a
    /// [`PendingAck`] to await its answer.
    ///
    /// A consumer that acknowledges one batch and at once polls for the next
    /// does not wait a round trip (and the broker's sync of the group's
    /// position) between the two: requests queued together also leave
    /// together, usually in one write to the socket. An empty slice sends nothing
    /// and answers at once.
    ///
    /// ```no_run
    /// # async fn demo(client: felix_client::Client) -> Result<(), felix_client::ClientError> {
    /// let (s, g) = (("t1", "default", "jobs"), "workers");
    /// let batch = client.group_poll(s.0, s.1, s.2, 0, g, 16).await?;
    /// let offsets: Vec<u64> = batch.iter().map(|r| r.offset).collect();
    /// let ack = client.begin_group_ack_many(s.0, s.1, s.2, 0, g, &offsets).await?;
    /// let next = client.group_poll(s.0, s.1, s.2, 0, g, 16).await?;
    /// ack.await?; // the first batch is finished
    /// # let _ = next;
    /// # Ok(())
    /// # }
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub async fn begin_group_ack_many(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        offsets: &[u64],
    ) -> Result<PendingAck> {
        self.require(FEATURE_GROUPS, "group_ack")?;
        if offsets.is_empty() {
            return Ok(Pending::new(async { Ok(()) }));
        }
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupAck {
            key: key.clone(),
            offsets: offsets.to_vec(),
        };
        let answer = self.begin_shard_call(key.stream, key.shard, req).await?;
        Ok(Pending::new(async move {
            match answer.await? {
                Response::Ok => Ok(()),
                other => Err(unexpected(other, "group_ack")),
            }
        }))
    }

    /// Hand a claimed record back now, to be owed to the group again.
    /// Refused with `stale_claim` if the claim has lapsed and the record
    /// went out again.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_nack(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
    ) -> Result<()> {
        self.require(FEATURE_GROUPS, "group_nack")?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        self.nack(key, record, None, None).await
    }

    /// Hand a claimed record back, to be owed again only once `delay` has
    /// passed. Needs
    /// [`FEATURE_GROUP_CLAIM_CONTROL`](crate::FEATURE_GROUP_CLAIM_CONTROL)
    /// unless `delay` is zero (a plain nack).
    #[allow(clippy::too_many_arguments)]
    pub async fn group_nack_after(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
        delay: Duration,
    ) -> Result<()> {
        self.require(FEATURE_GROUPS, "group_nack_after")?;
        let delay_ms = if delay.is_zero() {
            None
        } else {
            self.require(FEATURE_GROUP_CLAIM_CONTROL, "a nack delay")?;
            Some(ms_u64(delay))
        };
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        self.nack(key, record, delay_ms, None).await
    }

    /// [`group_nack_after`](Self::group_nack_after) with a short reason
    /// (the broker keeps up to 1 KiB). If this hand-back uses up the
    /// record's last attempt, the dead letter lists the reason.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_nack_with_reason(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
        delay: Duration,
        reason: &str,
    ) -> Result<()> {
        self.require(FEATURE_GROUPS, "group_nack_with_reason")?;
        let delay_ms = if delay.is_zero() {
            None
        } else {
            self.require(FEATURE_GROUP_CLAIM_CONTROL, "a nack delay")?;
            Some(ms_u64(delay))
        };
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        self.nack(key, record, delay_ms, Some(reason.to_string()))
            .await
    }

    async fn nack(
        &self,
        key: GroupKey,
        record: &GroupRecord,
        delay_ms: Option<u64>,
        reason: Option<String>,
    ) -> Result<()> {
        let req = Request::GroupNack {
            key: key.clone(),
            offset: record.offset,
            attempts: record.attempts,
            delay_ms,
            reason,
        };
        self.group_ok(&key, &req, "group_nack").await
    }

    /// Let the claim on a record this consumer holds stand for `by` from
    /// now (a `by` shorter than what is left shortens it). Returns how long
    /// the claim now stands from now (the broker caps it at
    /// FELIX_GROUP_MAX_VISIBILITY_MS). Refused with `stale_claim` once the claim has
    /// lapsed and the record went out again. Needs
    /// [`FEATURE_GROUP_CLAIM_CONTROL`](crate::FEATURE_GROUP_CLAIM_CONTROL).
    #[allow(clippy::too_many_arguments)]
    pub async fn group_extend(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
        by: Duration,
    ) -> Result<Duration> {
        self.require(FEATURE_GROUPS | FEATURE_GROUP_CLAIM_CONTROL, "group_extend")?;
        if by.is_zero() {
            return Err(ClientError::InvalidArgument(
                "an extension must be more than zero".into(),
            ));
        }
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupExtend {
            key: key.clone(),
            offset: record.offset,
            attempts: record.attempts,
            extend_ms: ms_u64(by),
        };
        match self.group_call(&key, &req, Duration::ZERO).await? {
            Response::Extended { stands_ms } => Ok(claim_stands_for(stands_ms)),
            other => Err(unexpected(other, "group_extend")),
        }
    }

    /// Give up on a claimed record: list it as a dead letter of the group
    /// and finish it (durable before the answer; refused for a record
    /// already finished). Needs
    /// [`FEATURE_GROUP_CLAIM_CONTROL`](crate::FEATURE_GROUP_CLAIM_CONTROL).
    /// [`group_dead_letter_with_reason`](Client::group_dead_letter_with_reason)
    /// also says why.
    pub async fn group_dead_letter(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
    ) -> Result<()> {
        self.dead_letter(tenant, namespace, stream, shard, group, record, None)
            .await
    }

    /// [`group_dead_letter`](Client::group_dead_letter) with a short reason
    /// the dead-letter list keeps (up to 1 KiB).
    #[allow(clippy::too_many_arguments)]
    pub async fn group_dead_letter_with_reason(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
        reason: &str,
    ) -> Result<()> {
        self.dead_letter(
            tenant,
            namespace,
            stream,
            shard,
            group,
            record,
            Some(reason),
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn dead_letter(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
        reason: Option<&str>,
    ) -> Result<()> {
        self.require(
            FEATURE_GROUPS | FEATURE_GROUP_CLAIM_CONTROL,
            "group_dead_letter",
        )?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupDeadLetter {
            key: key.clone(),
            offset: record.offset,
            attempts: record.attempts,
            reason: reason.map(str::to_string),
        };
        self.group_ok(&key, &req, "group_dead_letter").await
    }

    /// Offsets of the group's dead letters, in order.
    ///
    /// The whole list, however long: with
    /// [`FEATURE_GROUP_DEAD_LETTER_PAGES`](crate::FEATURE_GROUP_DEAD_LETTER_PAGES)
    /// the client fetches it a page at a time (see
    /// [`group_dead_letters_page`](Client::group_dead_letters_page)); from an
    /// older broker it asks for the list in one answer. The pages are not
    /// one snapshot: a letter dead-lettered, redriven or discarded while
    /// they are fetched may or may not be in the result.
    ///
    /// ```no_run
    /// # async fn demo(client: felix_client::Client) -> Result<(), felix_client::ClientError> {
    /// for offset in client.group_dead_letters("t1", "default", "jobs", 0, "workers").await? {
    ///     client.group_redrive("t1", "default", "jobs", 0, "workers", offset).await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn group_dead_letters(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> Result<Vec<u64>> {
        let v = self
            .group_dead_letters_detailed(tenant, namespace, stream, shard, group)
            .await?;
        Ok(v.into_iter().map(|d| d.offset).collect())
    }

    /// The group's dead letters with attempts, time, reason and who gave
    /// up on each, in offset order: the whole list, fetched as
    /// [`group_dead_letters`](Client::group_dead_letters) does.
    pub async fn group_dead_letters_detailed(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> Result<Vec<DeadLetterInfo>> {
        self.require(FEATURE_GROUPS, "group_dead_letters")?;
        if self.has_feature(FEATURE_GROUP_DEAD_LETTER_PAGES) {
            let mut all = Vec::new();
            let mut from = 0;
            loop {
                // As many per page as the broker allows.
                let page = self
                    .group_dead_letters_page(
                        tenant,
                        namespace,
                        stream,
                        shard,
                        group,
                        from,
                        u32::MAX,
                    )
                    .await?;
                all.extend(page.letters);
                match page.next {
                    None => return Ok(all),
                    Some(next) => from = next,
                }
            }
        }
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupDeadLetters { key: key.clone() };
        match self.group_call(&key, &req, Duration::ZERO).await? {
            Response::DeadLetters(v) => Ok(v),
            other => Err(unexpected(other, "group_dead_letters")),
        }
    }

    /// One page of the group's dead letters: those at offset `from` and
    /// above, in offset order, at most `max` of them. The broker caps a
    /// page further (by default at 1,000 letters and about 4 MiB; `max` 0
    /// counts as 1) and never sends an empty page while letters remain
    /// past `from`. [`DeadLetterPage::next`] is the `from` of the following
    /// page, `None` once the list is exhausted. Needs
    /// [`FEATURE_GROUP_DEAD_LETTER_PAGES`](crate::FEATURE_GROUP_DEAD_LETTER_PAGES).
    ///
    /// ```no_run
    /// # async fn demo(client: felix_client::Client) -> Result<(), felix_client::ClientError> {
    /// let mut from = 0;
    /// loop {
    ///     let page = client
    ///         .group_dead_letters_page("t1", "default", "jobs", 0, "workers", from, 500)
    ///         .await?;
    ///     for d in &page.letters {
    ///         println!("{} after {} attempts: {:?}", d.offset, d.attempts, d.reason);
    ///     }
    ///     match page.next {
    ///         Some(next) => from = next,
    ///         None => break,
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub async fn group_dead_letters_page(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        from: u64,
        max: u32,
    ) -> Result<DeadLetterPage> {
        self.require(
            FEATURE_GROUPS | FEATURE_GROUP_DEAD_LETTER_PAGES,
            "group_dead_letters_page",
        )?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupDeadLettersPage {
            key: key.clone(),
            from,
            max,
        };
        match self.group_call(&key, &req, Duration::ZERO).await? {
            Response::DeadLetterPage { letters, next } => {
                let page = DeadLetterPage { letters, next };
                check_dead_letter_page(from, &page)?;
                Ok(page)
            }
            other => Err(unexpected(other, "group_dead_letters_page")),
        }
    }

    /// Put a dead letter back: its attempts reset and it is owed again.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_redrive(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        offset: u64,
    ) -> Result<()> {
        self.require(FEATURE_GROUPS, "group_redrive")?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupRedrive {
            key: key.clone(),
            offset,
        };
        self.group_ok(&key, &req, "group_redrive").await
    }

    /// Stop tracking a dead letter. The record stays in the log.
    #[allow(clippy::too_many_arguments)]
    pub async fn group_discard(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        offset: u64,
    ) -> Result<()> {
        self.require(FEATURE_GROUPS, "group_discard")?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupDiscard {
            key: key.clone(),
            offset,
        };
        self.group_ok(&key, &req, "group_discard").await
    }

    // ----- consumer groups: administration -------------------------------

    /// Create the group at `start`. A group that already exists is left
    /// alone and this succeeds, so it is safe on every start of a consumer.
    /// Needs [`FEATURE_GROUP_ADMIN`](crate::FEATURE_GROUP_ADMIN).
    #[allow(clippy::too_many_arguments)]
    pub async fn group_create(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        start: StartPosition,
    ) -> Result<()> {
        self.require(FEATURE_GROUPS | FEATURE_GROUP_ADMIN, "group_create")?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupCreate {
            key: key.clone(),
            start,
        };
        match self.group_call(&key, &req, Duration::ZERO).await {
            Ok(Response::Ok | Response::Group(_)) => Ok(()),
            Ok(other) => Err(unexpected(other, "group_create")),
            Err(e) if e.code() == Some(ErrorCode::AlreadyExists) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Move an existing group to `start`, backwards to replay or forwards
    /// to skip. Voids every standing claim. Needs
    /// [`FEATURE_GROUP_ADMIN`](crate::FEATURE_GROUP_ADMIN).
    #[allow(clippy::too_many_arguments)]
    pub async fn group_seek(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        start: StartPosition,
    ) -> Result<()> {
        self.require(FEATURE_GROUPS | FEATURE_GROUP_ADMIN, "group_seek")?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupSeek {
            key: key.clone(),
            start,
        };
        match self.group_call(&key, &req, Duration::ZERO).await? {
            Response::Ok | Response::Group(_) => Ok(()),
            other => Err(unexpected(other, "group_seek")),
        }
    }

    /// Where the group stands: position, lag, in-flight, owed and dead
    /// letter counts. Needs [`FEATURE_GROUP_ADMIN`](crate::FEATURE_GROUP_ADMIN).
    pub async fn group_describe(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> Result<GroupInfo> {
        self.require(FEATURE_GROUPS | FEATURE_GROUP_ADMIN, "group_describe")?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupDescribe { key: key.clone() };
        match self.group_call(&key, &req, Duration::ZERO).await? {
            Response::Group(info) => Ok(info),
            other => Err(unexpected(other, "group_describe")),
        }
    }

    /// Remove the group's position and dead letters. Needs
    /// [`FEATURE_GROUP_ADMIN`](crate::FEATURE_GROUP_ADMIN).
    pub async fn group_delete(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> Result<()> {
        self.require(FEATURE_GROUPS | FEATURE_GROUP_ADMIN, "group_delete")?;
        let key = Self::group_key(tenant, namespace, stream, shard, group);
        let req = Request::GroupDelete { key: key.clone() };
        self.group_ok(&key, &req, "group_delete").await
    }

    // ----- consumer groups: a whole stream -------------------------------

    /// The shard count, and `start` checked for a call on every shard: an
    /// offset names a position in one shard's log, so it is refused for a
    /// stream with more than one shard.
    async fn stream_shards(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        start: Option<StartPosition>,
    ) -> Result<u32> {
        let shards = self
            .describe_stream(tenant, namespace, stream)
            .await?
            .shards;
        if shards > 1 && matches!(start, Some(StartPosition::Offset(_))) {
            return Err(ClientError::InvalidArgument(format!(
                "{tenant}/{namespace}/{stream} has {shards} shards and offsets are per \
                 shard; use Earliest or Latest, or the per-shard call"
            )));
        }
        Ok(shards)
    }

    crate::stream_groups::stream_group_calls!(stream_shards);

    /// Names of the groups on one shard.
    pub async fn list_groups(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
    ) -> Result<Vec<String>> {
        self.require(FEATURE_GROUPS, "list_groups")?;
        let stream = StreamRef::new(tenant, namespace, stream);
        let req = Request::ListGroups {
            stream: stream.clone(),
            shard,
        };
        match self
            .call_shard(&stream, shard, &req, Duration::ZERO)
            .await?
        {
            Response::Groups(v) => Ok(v),
            other => Err(unexpected(other, "list_groups")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(offsets: &[u64], next: Option<u64>) -> DeadLetterPage {
        DeadLetterPage {
            letters: offsets
                .iter()
                .map(|&offset| DeadLetterInfo {
                    offset,
                    attempts: 1,
                    at_ms: 0,
                    reason: None,
                    by_consumer: false,
                })
                .collect(),
            next,
        }
    }

    #[test]
    fn a_dead_letter_page_must_move_forward() {
        assert!(check_dead_letter_page(0, &page(&[], None)).is_ok());
        assert!(check_dead_letter_page(5, &page(&[5, 9, 12], Some(13))).is_ok());
        assert!(check_dead_letter_page(5, &page(&[5, 9, 12], None)).is_ok());
        for (from, bad) in [
            (0, page(&[], Some(10))),    // empty, yet more promised
            (5, page(&[4, 9], None)),    // below `from`
            (0, page(&[3, 3], None)),    // repeated
            (0, page(&[7, 3], None)),    // descending
            (0, page(&[3, 7], Some(7))), // next not past the last
            (0, page(&[3, 7], Some(2))), // next going back
        ] {
            assert!(
                matches!(
                    check_dead_letter_page(from, &bad),
                    Err(ClientError::Protocol(_))
                ),
                "from {from}: {bad:?}"
            );
        }
    }
}

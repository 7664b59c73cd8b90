//! [`ClusterClient`]: one client for a cluster of brokers, sending each
//! shard's requests to the broker that leads it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use felix_wire::{
    DeadLetterInfo, ErrorCode, GroupInfo, GroupKey, GroupRecord, RecordIn, ReplicaInfo, ShardInfo,
    StartPosition, StreamInfo, StreamRef, FEATURE_CLUSTER_INFO,
};

use crate::{
    Client, ClientConfig, ClientError, GroupMember, GroupPollOptions, Published, ReadBatch, Result,
    StreamOptions,
};

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
/// turn, backing off (25 ms doubling to 500 ms), for 40 tries: about 18
/// seconds.
///
/// A publish (or a read) that was sent and whose answer was lost (the
/// broker died, the connection dropped, the request timed out) is sent
/// again, so a record can be written twice: at least once, as the guide
/// says of failovers; so are polls, acks, group creates and describes and
/// dead-letter lists, also after an `unavailable` answer (its outcome may
/// be unknown). The other group calls are tried again only where nothing was applied
/// (`not_leader`, a broker not reached); a lost answer or an
/// `unavailable` is returned as the error it is, since a seek to `Latest`
/// or a redrive made twice is not the same as once. Stream creation and
/// deletion go to every broker.
///
/// Clone it freely: clones share the connections and what is known of the
/// leaders. [`ShardedGroup::on_cluster`](crate::ShardedGroup::on_cluster)
/// consumes a group on every shard of a stream through one.
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
#[derive(Clone)]
pub struct ClusterClient {
    /// The brokers given at connect, then those of the cluster not among
    /// them: where a call looks for a shard's leader.
    brokers: Arc<[String]>,
    /// The cluster's brokers as the first broker reached named them
    /// (`describe_cluster`), when it could: those a stream is created on,
    /// deleted from and described by. Else the brokers given.
    members: Arc<[String]>,
    config: ClientConfig,
    clients: Arc<tokio::sync::Mutex<HashMap<String, Client>>>,
    /// The broker that last led each shard.
    leaders: Arc<Mutex<HashMap<(StreamRef, u32), String>>>,
}

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient")
            .field("brokers", &self.brokers)
            .finish_non_exhaustive()
    }
}

/// How a call may be tried again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// Only where nothing was applied: `not_leader` (an election, a new
    /// leader catching up), a broker that could not be reached, an
    /// `unavailable` the broker marks as not applied (it was stopping).
    Refused,
    /// Also after a lost answer (a timeout, a dropped connection) or an
    /// `unavailable` (whose outcome may be unknown): for calls that may
    /// run twice (publishes at least once, polls, acks, creates,
    /// describes).
    Lost,
    /// As `Lost`, for a read: any replica answers one, so the broker that
    /// did is not remembered as the leader.
    Read,
}

/// The incarnation a stream `name` of `shards` shards is created with on
/// the brokers that lack it, given `held`: those of the `brokers` brokers
/// asked (reachable or not) that hold it, and their description of it.
/// Theirs, when more than half of the brokers hold it and they agree (`None`
/// for a stream created without one); a new one when no broker holds it.
///
/// Every broker must hold the same incarnation: a shard's replicas are
/// found by it, and a broker holding an older stream of the same name (down
/// while it was deleted and created again) must not vote in the new one's
/// elections. Nor may a copy that only a minority holds be spread to the
/// others: it may be a stream the others deleted while those brokers were
/// down, whose log would win the elections. `already_exists`, naming the
/// brokers, when one holds it with another shard count, the holders
/// disagree, or too few hold it: delete it on the brokers named, then
/// create it again.
pub fn incarnation_to_create(
    name: &str,
    shards: u32,
    brokers: usize,
    held: &[(String, StreamInfo)],
) -> Result<Option<u64>> {
    let exists = |message: String| ClientError::Server {
        code: ErrorCode::AlreadyExists,
        message,
        not_applied: false,
    };
    if let Some((b, info)) = held.iter().find(|(_, i)| i.shards != shards) {
        return Err(exists(format!(
            "{name} exists on {b} with {} shards, not {shards}",
            info.shards
        )));
    }
    let Some((first, info)) = held.first() else {
        return Ok(Some(new_incarnation()));
    };
    if let Some((other, o)) = held.iter().find(|(_, i)| i.incarnation != info.incarnation) {
        return Err(exists(format!(
            "{name} is not the same stream everywhere: {first} holds incarnation {} and \
             {other} {} (one was deleted and created again while a broker was down); \
             delete it on the brokers whose copy should go, then create it again",
            show_incarnation(info.incarnation),
            show_incarnation(o.incarnation)
        )));
    }
    if held.len() * 2 <= brokers {
        let names: Vec<&str> = held.iter().map(|(b, _)| b.as_str()).collect();
        return Err(exists(format!(
            "{name} is held by only {} of the {brokers} brokers ({}): a create cut short, or \
             a stream the others deleted while these were down; delete it on {}, then create \
             it again",
            held.len(),
            names.join(", "),
            if held.len() == 1 {
                "that broker"
            } else {
                "those brokers"
            }
        )));
    }
    Ok(info.incarnation)
}

/// An incarnation as `felix stream describe` shows it.
/// Whether a create of `name` may go ahead with some of the cluster's
/// `total` brokers not reached (`unreached`, named for the message): only
/// when more than half answered (`answered`, of which `held` hold the
/// stream already), and when whether the holders are a majority does not
/// turn on the brokers that did not answer. `unavailable` saying why, and
/// that nothing was created, otherwise.
pub fn enough_answered(
    name: &str,
    total: usize,
    answered: usize,
    held: usize,
    unreached: &[String],
) -> Result<()> {
    if unreached.is_empty() {
        return Ok(());
    }
    let refuse = |message: String| {
        Err(ClientError::Server {
            code: ErrorCode::Unavailable,
            message,
            not_applied: false,
        })
    };
    // A stream on fewer than a majority could elect no leader.
    if answered * 2 <= total {
        return refuse(format!(
            "only {answered} of the {total} brokers answered ({} did not): nothing created; \
             run the same create again once more of them are back",
            unreached.join(", ")
        ));
    }
    // Whether the holders are a majority turns on brokers not asked.
    if held * 2 <= total && held > 0 {
        return refuse(format!(
            "{name} is on {held} of the {total} brokers, and {} did not answer: nothing \
             created; run the same create again once they are back",
            unreached.join(", ")
        ));
    }
    Ok(())
}

pub fn show_incarnation(i: Option<u64>) -> String {
    i.map_or("none".to_string(), |i| format!("{i:#018x}"))
}

/// `unsupported` unless the broker `c` can create a stream as
/// `incarnation`: a broker that does not keep incarnations (an older build)
/// would put its replicas in a group of their own.
pub fn keeps_incarnations(c: &Client, broker: &str, incarnation: Option<u64>) -> Result<()> {
    if incarnation.is_some() && !c.has_feature(felix_wire::FEATURE_STREAM_INCARNATION) {
        return Err(ClientError::Unsupported(format!(
            "{broker} does not keep stream incarnations (FEATURE_STREAM_INCARNATION): an \
             older build? Upgrade every broker of the cluster first"
        )));
    }
    Ok(())
}

/// Create a stream on one broker of a cluster as `incarnation` (see
/// [`incarnation_to_create`]): `Some(info)` once created, `None` when it
/// was there already as the same stream (created meanwhile by another
/// run). Refused (`unsupported`) when `incarnation` is set and the broker
/// does not keep incarnations (an older build: its replicas would not be
/// the others'), and `already_exists` when what it holds is another stream.
pub async fn create_on_broker(
    c: &Client,
    broker: &str,
    stream: &StreamRef,
    shards: u32,
    options: StreamOptions,
    incarnation: Option<u64>,
) -> Result<Option<StreamInfo>> {
    keeps_incarnations(c, broker, incarnation)?;
    let options = StreamOptions {
        incarnation,
        ..options
    };
    let (t, n, s) = (&stream.tenant, &stream.namespace, &stream.stream);
    match c.create_stream(t, n, s, shards, options).await {
        Ok(info) => Ok(Some(info)),
        Err(ClientError::Server {
            code: ErrorCode::AlreadyExists,
            ..
        }) => {
            let info = c.describe_stream(t, n, s).await?;
            if info.shards == shards && info.incarnation == incarnation {
                return Ok(None);
            }
            Err(ClientError::Server {
                code: ErrorCode::AlreadyExists,
                message: format!(
                    "{stream} was created on {broker} meanwhile as another stream ({} shards, \
                     incarnation {}); delete it there, then create it again",
                    info.shards,
                    show_incarnation(info.incarnation)
                ),
                not_applied: false,
            })
        }
        Err(e) => Err(e),
    }
}

/// A new stream incarnation: nonzero, at most `i64::MAX`, and in practice
/// never the same twice (the standard library's per-process random hash
/// keys over the time and the process id).
fn new_incarnation() -> u64 {
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let h = std::collections::hash_map::RandomState::new().hash_one((now, std::process::id()));
    (h & i64::MAX as u64).max(1)
}

/// Worth trying another broker (or the same one again) for.
fn retryable(e: &ClientError, retry: Retry) -> bool {
    match e {
        ClientError::NotLeader { .. } | ClientError::Io(_) => true,
        ClientError::Disconnected | ClientError::Timeout => retry != Retry::Refused,
        // `unavailable` can mean the outcome is unknown (a commit that timed
        // out): tried again only where doing it twice is harmless, or where
        // the broker says it did nothing (it was stopping).
        ClientError::Server {
            code, not_applied, ..
        } => *code == ErrorCode::Unavailable && (retry != Retry::Refused || *not_applied),
        _ => false,
    }
}

impl ClusterClient {
    /// Connect to the cluster's brokers (their client addresses). At least
    /// one must answer now; the others are connected to when needed. The
    /// first that answers names every broker of its cluster
    /// ([`Client::describe_cluster`], on brokers that advertise
    /// [`FEATURE_CLUSTER_INFO`](felix_wire::FEATURE_CLUSTER_INFO)), so one
    /// address is enough: the client finds the others, and creates,
    /// deletes and describes streams on every broker of the cluster,
    /// however many of them were given.
    pub async fn connect(
        brokers: &[impl AsRef<str>],
        config: ClientConfig,
    ) -> Result<ClusterClient> {
        // Each once: a broker listed twice must not count twice (a
        // create counts the brokers holding a stream).
        let mut seen = std::collections::HashSet::new();
        let brokers: Arc<[String]> = brokers
            .iter()
            .map(|b| b.as_ref().trim().to_string())
            .filter(|b| seen.insert(b.clone()))
            .collect();
        if brokers.is_empty() {
            return Err(ClientError::InvalidArgument(
                "a cluster client needs at least one broker address".into(),
            ));
        }
        let mut last = None;
        for b in brokers.iter() {
            let first = match Client::connect(b.as_str(), config.clone()).await {
                Ok(c) => c,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let members: Arc<[String]> = if first.has_feature(FEATURE_CLUSTER_INFO) {
                match first.describe_cluster().await {
                    Ok(info) => info.members.into_iter().map(|m| m.addr).collect(),
                    Err(e) => {
                        last = Some(e);
                        continue;
                    }
                }
            } else {
                brokers.clone()
            };
            let known: Arc<[String]> = brokers
                .iter()
                .chain(members.iter().filter(|m| !brokers.contains(m)))
                .cloned()
                .collect();
            return Ok(ClusterClient {
                brokers: known,
                members,
                config,
                clients: Arc::new(tokio::sync::Mutex::new(HashMap::from([(b.clone(), first)]))),
                leaders: Arc::default(),
            });
        }
        Err(last.expect("at least one broker"))
    }

    /// The brokers given at connect, then those of the cluster the client
    /// learned of and was not given.
    pub fn brokers(&self) -> &[String] {
        &self.brokers
    }

    /// The cluster's brokers, as the first broker reached at connect named
    /// them (their client addresses, in node order); the brokers given, on
    /// a broker too old to say. Streams are created and deleted on these.
    pub fn members(&self) -> &[String] {
        &self.members
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
        if let Some(c) = self.clients.lock().await.get(addr) {
            return Ok(c.clone());
        }
        // Connected without the map locked: a broker that does not answer
        // must not hold up calls to the others.
        let c = Client::connect(addr, self.config.clone())
            .await
            .map_err(|e| match e {
                // Which broker, since a cluster call may try several.
                ClientError::Io(io) => ClientError::Io(std::io::Error::new(
                    io.kind(),
                    format!("cannot connect to {addr}: {io}"),
                )),
                other => other,
            })?;
        Ok(self
            .clients
            .lock()
            .await
            .entry(addr.to_string())
            .or_insert(c)
            .clone())
    }

    /// Forget a broker's client (it failed): the next call connects anew.
    async fn drop_client(&self, addr: &str) {
        self.clients.lock().await.remove(addr);
    }

    /// Run `call` with a [`Client`] of the broker that leads `shard` of
    /// the stream: any per-shard call of `Client` not wrapped here. A
    /// `not_leader` answer is followed, and while no leader is known the
    /// other brokers are tried, backing off; a call whose answer was lost,
    /// or that was answered `unavailable` (its outcome may be unknown), is
    /// not made again but returned.
    pub async fn with_leader<T, F, Fut>(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        call: F,
    ) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.on_leader(
            &StreamRef::new(tenant, namespace, stream),
            shard,
            Retry::Refused,
            call,
        )
        .await
    }

    /// [`ClusterClient::with_leader`] with its own retry rule.
    async fn named<T, F, Fut>(
        &self,
        (tenant, namespace, stream, shard): (&str, &str, &str, u32),
        retry: Retry,
        call: F,
    ) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.on_leader(
            &StreamRef::new(tenant, namespace, stream),
            shard,
            retry,
            call,
        )
        .await
    }

    /// Run `call` against the leader of `shard`, following `not_leader`
    /// answers and trying the other brokers while none is known.
    async fn on_leader<T, F, Fut>(
        &self,
        stream: &StreamRef,
        shard: u32,
        retry: Retry,
        call: F,
    ) -> Result<T>
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
        let mut follows = 0;
        for _ in 0..ATTEMPTS {
            let result = match self.client(&target).await {
                Ok(c) => call(c).await,
                // Not connected: nothing was sent, so any call may try
                // another broker.
                Err(ClientError::Timeout) => Err(ClientError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connecting to {target} timed out"),
                ))),
                Err(e) => Err(e),
            };
            match result {
                Ok(v) => {
                    if retry != Retry::Read {
                        self.leaders
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .insert(key, target);
                    }
                    return Ok(v);
                }
                Err(ClientError::NotLeader {
                    leader: Some(l), ..
                }) if l != target => {
                    // Follow the broker that leads it; brokers naming each
                    // other (an election under way) are waited out.
                    follows += 1;
                    if follows > 2 {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                    target = l;
                    continue;
                }
                Err(e) if retryable(&e, retry) => {
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
                Err(e) => {
                    if matches!(e, ClientError::Disconnected | ClientError::Timeout) {
                        // Not tried again (it may have been applied); the
                        // next call connects anew and finds the leader.
                        self.drop_client(&target).await;
                        self.leaders
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .remove(&key);
                    }
                    return Err(e);
                }
            }
        }
        Err(last.unwrap_or(ClientError::Timeout))
    }

    /// Create a stream on every broker of the cluster
    /// ([`ClusterClient::members`]), as one incarnation (see
    /// [`incarnation_to_create`], which chooses it: `options.incarnation`
    /// is not used). Where more than half of them hold the stream already
    /// (a create interrupted part way, or a broker that was down for it),
    /// the others get its incarnation, and those that hold it are left as
    /// they are. Refused (`already_exists`) where a broker holds it with
    /// another shard count, brokers hold different incarnations of it, or
    /// half of them or fewer hold it; `unsupported` where a broker does not
    /// keep incarnations.
    ///
    /// A broker that cannot be reached is passed over: the stream is made
    /// on the others, and the call returns `unavailable` naming it, to be
    /// run again once it is back (until then that broker takes no part in
    /// the stream). Nothing is made ([`enough_answered`]) when half of the
    /// brokers or fewer answer, or when whether the brokers holding the
    /// stream are a majority turns on those that did not. A create that
    /// fails part way can be run again.
    pub async fn create_stream(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shards: u32,
        options: StreamOptions,
    ) -> Result<()> {
        let name = StreamRef::new(tenant, namespace, stream);
        let mut held = Vec::new();
        let mut clients = Vec::new();
        let mut unreached = Vec::new();
        for b in self.members.iter() {
            let described = match self.client(b).await {
                Ok(c) => match c.describe_stream(tenant, namespace, stream).await {
                    Ok(info) => Ok(Some(info)),
                    Err(e) if e.code() == Some(ErrorCode::NotFound) => {
                        clients.push((b, c));
                        Ok(None)
                    }
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            match described {
                Ok(Some(info)) => held.push((b.clone(), info)),
                Ok(None) => {}
                Err(
                    e @ (ClientError::Io(_) | ClientError::Timeout | ClientError::Disconnected),
                ) => {
                    self.drop_client(b).await;
                    unreached.push(format!("{b} ({e})"));
                }
                Err(e) => return Err(e),
            }
        }
        let total = self.members.len();
        let text = name.to_string();
        enough_answered(
            &text,
            total,
            held.len() + clients.len(),
            held.len(),
            &unreached,
        )?;
        let incarnation = incarnation_to_create(&text, shards, total, &held)?;
        for (b, c) in &clients {
            keeps_incarnations(c, b, incarnation)?;
        }
        for (b, c) in clients {
            create_on_broker(&c, b, &name, shards, options, incarnation).await?;
        }
        if unreached.is_empty() {
            return Ok(());
        }
        Err(ClientError::Server {
            code: ErrorCode::Unavailable,
            message: format!(
                "{text} was created on the other brokers, not on {}: run the same create \
                 again once {} back",
                unreached.join(", "),
                if unreached.len() == 1 {
                    "it is"
                } else {
                    "they are"
                }
            ),
            // Created on the others.
            not_applied: false,
        })
    }

    /// Delete a stream on every broker of the cluster
    /// ([`ClusterClient::members`]; one already gone is fine). Every
    /// broker is tried, one that cannot be reached or refuses included;
    /// the first such error is returned after the others were done, naming
    /// its broker and the brokers the stream was deleted on, so the call can
    /// be run again once that broker is back. It says
    /// [`not_applied`](ClientError::not_applied) only when no broker
    /// deleted anything.
    pub async fn delete_stream(&self, tenant: &str, namespace: &str, stream: &str) -> Result<()> {
        let mut first = None;
        let mut deleted = Vec::new();
        for b in self.members.iter() {
            let done = match self.client(b).await {
                Ok(c) => c.delete_stream(tenant, namespace, stream).await,
                Err(e) => Err(e),
            };
            match done {
                Ok(()) => deleted.push(b.as_str()),
                Err(e) if e.code() == Some(ErrorCode::NotFound) => {}
                Err(e) => {
                    first.get_or_insert((b.as_str(), e));
                }
            }
        }
        let Some((broker, e)) = first else {
            return Ok(());
        };
        if deleted.is_empty() {
            return Err(e.noted(&format!("broker {broker}; deleted on no broker")));
        }
        Err(e
            .noted(&format!(
                "broker {broker}; deleted on {}",
                deleted.join(", ")
            ))
            .partly_done())
    }

    /// Describe a stream (as the first broker that answers has it).
    pub async fn describe_stream(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
    ) -> Result<StreamInfo> {
        let mut last = None;
        for b in self.members.iter() {
            match self.client(b).await {
                Ok(c) => match c.describe_stream(tenant, namespace, stream).await {
                    Ok(i) => return Ok(i),
                    Err(e) if retryable(&e, Retry::Read) => last = Some(e),
                    Err(e) => return Err(e),
                },
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(ClientError::Timeout))
    }

    /// Every broker's replica of `shard`, as each sees it, in the order of
    /// [`ClusterClient::members`]: a broker that could not be reached, or
    /// refused, has its error in its place. A broker that says it leads is
    /// remembered as the shard's leader, so the next call goes there
    /// first. See [`Client::describe_replica`].
    pub async fn describe_replicas(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
    ) -> Vec<(String, Result<ReplicaInfo>)> {
        // Asked all at once: a broker that does not answer holds up only
        // its own place.
        let mut asks = tokio::task::JoinSet::new();
        for (i, b) in self.members.iter().enumerate() {
            let (me, b) = (self.clone(), b.clone());
            let (t, n, s) = (
                tenant.to_string(),
                namespace.to_string(),
                stream.to_string(),
            );
            asks.spawn(async move {
                let info = match me.client(&b).await {
                    Ok(c) => c.describe_replica(&t, &n, &s, shard).await,
                    Err(e) => Err(e),
                };
                if matches!(&info, Err(ClientError::Io(_) | ClientError::Disconnected)) {
                    me.drop_client(&b).await;
                }
                (i, b, info)
            });
        }
        let mut answers: Vec<Option<(String, Result<ReplicaInfo>)>> =
            (0..self.members.len()).map(|_| None).collect();
        while let Some(done) = asks.join_next().await {
            // A task panics only if the client does; keep its place empty.
            if let Ok((i, b, info)) = done {
                answers[i] = Some((b, info));
            }
        }
        let answers: Vec<(String, Result<ReplicaInfo>)> = answers
            .into_iter()
            .zip(self.members.iter())
            .map(|(a, b)| a.unwrap_or_else(|| (b.clone(), Err(ClientError::Disconnected))))
            .collect();
        // The newest term's leader, as its own broker reports it.
        let leader = answers
            .iter()
            .filter_map(|(b, r)| r.as_ref().ok().map(|i| (b, i)))
            .filter(|(_, i)| i.role == felix_wire::ReplicaRole::Leader)
            .max_by_key(|(_, i)| i.term)
            .map(|(b, _)| b.clone());
        if let Some(b) = leader {
            self.leaders
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert((StreamRef::new(tenant, namespace, stream), shard), b);
        }
        answers
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
        self.on_leader(&r, shard, Retry::Lost, |c| {
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
        self.on_leader(&r, shard, Retry::Read, |c| async move {
            // Any replica serves a read: one that answers is not known to
            // lead, so it is not cached as the leader.
            c.read(tenant, namespace, stream, shard, from, max_records, wait)
                .await
        })
        .await
    }

    // Consumer groups: each call goes to the shard's leader, as `Client`'s
    // of the same name does to its broker.

    /// [`Client::group_poll`] on the shard's leader.
    pub async fn group_poll(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        max_records: u32,
    ) -> Result<Vec<GroupRecord>> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_poll(tenant, namespace, stream, shard, group, max_records)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_poll_wait`] on the shard's leader.
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
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_poll_wait(tenant, namespace, stream, shard, group, max_records, wait)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_poll_as`] on the shard's leader. A member that polls
    /// with `reclaim` after a failover finds nothing to reclaim: claims were
    /// the old leader's memory, and the records are owed to the group again.
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
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_poll_as(tenant, namespace, stream, shard, group, member, options)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_ack`] on the shard's leader.
    pub async fn group_ack(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        offset: u64,
    ) -> Result<()> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_ack(tenant, namespace, stream, shard, group, offset)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_ack_many`] on the shard's leader: several records
    /// in one request.
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
        if offsets.is_empty() {
            return Ok(());
        }
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_ack_many(tenant, namespace, stream, shard, group, offsets)
                    .await
            },
        )
        .await
    }

    /// A poll of one shard's group on its leader, anonymous or as `member`
    /// (its name already checked): what [`ShardedGroup`](crate::ShardedGroup)
    /// sends.
    pub(crate) async fn poll_group(
        &self,
        key: &GroupKey,
        max_records: u32,
        wait: Duration,
        member: Option<&GroupMember>,
        visibility: Option<Duration>,
    ) -> Result<Vec<GroupRecord>> {
        self.on_leader(&key.stream, key.shard, Retry::Lost, |c| async move {
            c.poll_group(key.clone(), max_records, wait, member.cloned(), visibility)
                .await
        })
        .await
    }

    /// [`Client::group_nack`] on the shard's leader.
    pub async fn group_nack(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
    ) -> Result<()> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_nack(tenant, namespace, stream, shard, group, record)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_nack_after`] on the shard's leader.
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
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_nack_after(tenant, namespace, stream, shard, group, record, delay)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_nack_with_reason`] on the shard's leader.
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
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_nack_with_reason(
                    tenant, namespace, stream, shard, group, record, delay, reason,
                )
                .await
            },
        )
        .await
    }

    /// [`Client::group_extend`] on the shard's leader.
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
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_extend(tenant, namespace, stream, shard, group, record, by)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_dead_letter`] on the shard's leader.
    pub async fn group_dead_letter(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        record: &GroupRecord,
    ) -> Result<()> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_dead_letter(tenant, namespace, stream, shard, group, record)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_dead_letter_with_reason`] on the shard's leader.
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
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_dead_letter_with_reason(
                    tenant, namespace, stream, shard, group, record, reason,
                )
                .await
            },
        )
        .await
    }

    /// [`Client::group_dead_letters_detailed`] on the shard's leader
    /// (answered only once a majority confirms it still leads).
    pub async fn group_dead_letters_detailed(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> Result<Vec<DeadLetterInfo>> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_dead_letters_detailed(tenant, namespace, stream, shard, group)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_dead_letters`] on the shard's leader (answered only
    /// once a majority confirms it still leads).
    pub async fn group_dead_letters(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> Result<Vec<u64>> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_dead_letters(tenant, namespace, stream, shard, group)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_redrive`] on the shard's leader.
    pub async fn group_redrive(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        offset: u64,
    ) -> Result<()> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_redrive(tenant, namespace, stream, shard, group, offset)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_discard`] on the shard's leader.
    pub async fn group_discard(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        offset: u64,
    ) -> Result<()> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_discard(tenant, namespace, stream, shard, group, offset)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_create`] on the shard's leader.
    pub async fn group_create(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        start: StartPosition,
    ) -> Result<()> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_create(tenant, namespace, stream, shard, group, start)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_seek`] on the shard's leader.
    pub async fn group_seek(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
        start: StartPosition,
    ) -> Result<()> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_seek(tenant, namespace, stream, shard, group, start)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_describe`] on the shard's leader (answered only once
    /// a majority confirms it still leads).
    pub async fn group_describe(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> Result<GroupInfo> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Lost,
            |c| async move {
                c.group_describe(tenant, namespace, stream, shard, group)
                    .await
            },
        )
        .await
    }

    /// [`Client::group_delete`] on the shard's leader.
    pub async fn group_delete(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        group: &str,
    ) -> Result<()> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Refused,
            |c| async move {
                c.group_delete(tenant, namespace, stream, shard, group)
                    .await
            },
        )
        .await
    }

    /// The stream's shard count, refusing an offset for a stream of more
    /// than one shard (offsets are per shard).
    async fn shards_for(
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
                "{tenant}/{namespace}/{stream} has {shards} shards, and an offset names a \
                 position in one shard: use Earliest or Latest, or the per-shard call"
            )));
        }
        Ok(shards)
    }

    /// A shard's start, end and size as a broker holding it has them (the
    /// leader if known, else any: a follower's may trail the leader's). See
    /// [`Client::describe_shard`].
    pub async fn describe_shard(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
    ) -> Result<ShardInfo> {
        self.named(
            (tenant, namespace, stream, shard),
            Retry::Read,
            |c| async move { c.describe_shard(tenant, namespace, stream, shard).await },
        )
        .await
    }

    // The group calls on every shard of the stream, each on its leader.
    crate::stream_groups::stream_group_calls!(shards_for);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call that must not run twice is tried again only where nothing
    /// of it was done: an `unavailable` counts when the broker says so.
    #[test]
    fn only_what_did_nothing_is_tried_again_for_calls_that_must_not_run_twice() {
        let unavailable = |not_applied| ClientError::Server {
            code: ErrorCode::Unavailable,
            message: String::new(),
            not_applied,
        };
        let not_found = ClientError::Server {
            code: ErrorCode::NotFound,
            message: String::new(),
            not_applied: true,
        };
        let cases = [
            (unavailable(true), true, true),
            (unavailable(false), false, true),
            (ClientError::Timeout, false, true),
            (ClientError::Disconnected, false, true),
            // Nothing done, but another try would be refused the same way.
            (not_found, false, false),
        ];
        for (e, refused, lost) in cases {
            assert_eq!(retryable(&e, Retry::Refused), refused, "{e:?}");
            assert_eq!(retryable(&e, Retry::Lost), lost, "{e:?}");
        }
    }

    fn info(shards: u32, incarnation: Option<u64>) -> StreamInfo {
        StreamInfo {
            stream: StreamRef::new("t", "n", "s"),
            shards,
            retention_bytes: None,
            retention_ms: None,
            placement: vec![0; shards as usize],
            incarnation,
        }
    }

    fn held(v: &[(&str, StreamInfo)]) -> Vec<(String, StreamInfo)> {
        v.iter().map(|(b, i)| (b.to_string(), i.clone())).collect()
    }

    fn refused(r: Result<Option<u64>>, says: &str) {
        match r {
            Err(ClientError::Server {
                code: ErrorCode::AlreadyExists,
                message,
                ..
            }) => assert!(message.contains(says), "{message}"),
            other => panic!("expected already_exists ({says}), got {other:?}"),
        }
    }

    /// Which incarnation a create uses, and when it refuses.
    #[test]
    fn a_create_takes_the_majoritys_incarnation_or_refuses() {
        // Nobody holds it: a new one, within the range a broker stores.
        let fresh = incarnation_to_create("t/n/s", 2, 3, &[]).unwrap().unwrap();
        assert!((1..=i64::MAX as u64).contains(&fresh));
        assert_ne!(
            incarnation_to_create("t/n/s", 2, 3, &[]).unwrap(),
            Some(fresh),
            "a new one each time"
        );
        // A majority agree: theirs, a stream without one included.
        let two = held(&[("a", info(2, Some(7))), ("b", info(2, Some(7)))]);
        assert_eq!(incarnation_to_create("t/n/s", 2, 3, &two).unwrap(), Some(7));
        let legacy = held(&[("a", info(2, None)), ("b", info(2, None))]);
        assert_eq!(incarnation_to_create("t/n/s", 2, 3, &legacy).unwrap(), None);
        // Disagreeing holders, a None among them included.
        let split = held(&[("a", info(2, Some(7))), ("b", info(2, Some(8)))]);
        refused(
            incarnation_to_create("t/n/s", 2, 3, &split),
            "not the same stream everywhere",
        );
        let mixed = held(&[("a", info(2, Some(7))), ("b", info(2, None))]);
        refused(
            incarnation_to_create("t/n/s", 2, 3, &mixed),
            "holds incarnation 0x0000000000000007 and b none",
        );
        // Too few hold it: perhaps a stream the others deleted.
        let one = held(&[("c", info(2, Some(7)))]);
        refused(
            incarnation_to_create("t/n/s", 2, 3, &one),
            "held by only 1 of the 3 brokers (c)",
        );
        let half = held(&[("a", info(2, Some(7))), ("b", info(2, Some(7)))]);
        refused(
            incarnation_to_create("t/n/s", 2, 4, &half),
            "only 2 of the 4",
        );
        // Another shard count is said first.
        let other = held(&[("a", info(3, Some(7))), ("b", info(2, Some(8)))]);
        refused(
            incarnation_to_create("t/n/s", 2, 3, &other),
            "exists on a with 3 shards, not 2",
        );
    }

    /// A create goes ahead without the brokers not reached only when a
    /// majority answered and the holders' majority does not turn on them.
    #[test]
    fn a_create_passes_over_unreached_brokers_only_with_a_sure_majority() {
        let gone = |n: usize| (0..n).map(|i| format!("b{i}")).collect::<Vec<_>>();
        let ok =
            |total, answered, holding, n| enough_answered("s", total, answered, holding, &gone(n));
        assert!(ok(3, 3, 0, 0).is_ok(), "everyone answered");
        assert!(ok(3, 2, 0, 1).is_ok(), "a new stream, two of three");
        assert!(ok(3, 2, 2, 1).is_ok(), "held by a majority already");
        let unavailable = |r: Result<()>, says: &str| match r {
            Err(ClientError::Server {
                code: ErrorCode::Unavailable,
                message,
                ..
            }) => assert!(message.contains(says), "{message}"),
            other => panic!("expected unavailable ({says}), got {other:?}"),
        };
        unavailable(ok(3, 1, 0, 2), "only 1 of the 3 brokers answered");
        unavailable(ok(4, 2, 0, 2), "only 2 of the 4 brokers answered");
        // One of three holds it, one did not answer: that one may hold it
        // too (a majority: spread it) or not (a copy to keep out).
        unavailable(
            ok(3, 2, 1, 1),
            "is on 1 of the 3 brokers, and b0 did not answer",
        );
    }
}

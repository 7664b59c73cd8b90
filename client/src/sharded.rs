//! A consumer group read across every shard of a stream.
//!
//! A group is per shard on the broker; [`ShardedGroup`] is the client
//! polling all of a stream's shards as one queue. It assigns nothing: every
//! `ShardedGroup` of a group polls every shard, and the broker's one claim
//! per record is what divides the work between them.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use felix_wire::{ErrorCode, GroupInfo, GroupRecord};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::{Client, ClientError, ClusterClient, GroupMember, Result};

/// A record claimed through a [`ShardedGroup`], with the shard it came from
/// (acks, nacks and extensions go to that shard's group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedRecord {
    pub shard: u32,
    pub record: GroupRecord,
}

/// How long a waiting poll lasts before it is sent again, unless
/// [`ShardedGroup::wait_slice`] says otherwise.
const DEFAULT_WAIT_SLICE: Duration = Duration::from_secs(1);

/// With fewer records wanted than shards, how long each of the rotating
/// waiting polls lasts.
const SHORT_WAIT_SLICE: Duration = Duration::from_millis(100);

/// How long [`ShardedGroup::close`] waits for answers beyond the wait the
/// polls still out were sent with.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// A poll's answer, from the task that sent it.
type Answer = (u32, Result<Vec<GroupRecord>>);

/// One consumer of a group on every shard of a stream.
///
/// [`poll`](ShardedGroup::poll) first claims what is available on the
/// shards without waiting, starting from a different shard each time so
/// none is served before the others for ever. When none has anything and
/// the poll may wait, it sends waiting polls to the shards and answers as
/// soon as one of them brings records.
///
/// The broker cannot take a sent poll back, so the waiting polls still out
/// when the first one answers keep waiting, and what they claim later is
/// kept here and handed out first by the next `poll`
/// ([`held`](Self::held) counts it). Those records' visibility timeouts run
/// from when they were claimed, so keep polling. The waiting polls of one
/// `poll` ask for `max_records` in all: each shard its part when there are
/// at least as many records as shards; otherwise one record each on as
/// many shards as records, taking turns in slices of 100 ms. Each lasts at
/// most a [`wait_slice`](Self::wait_slice) (a second unless set) and is
/// sent again, no sooner, while the `poll`'s own wait lasts.
///
/// [`close`](Self::close) waits for the polls still out (about a wait
/// slice, longer only if the broker is slow to answer) and hands back
/// (nacks) everything claimed and not yet returned, so another consumer
/// gets it at once; a handed-back record has had the attempt counted, as
/// any nack does. Dropping a `ShardedGroup` starts the same in a background
/// task, which a runtime shutting down may cut short (the claims then
/// lapse back to the group after their visibility timeout): call `close`.
///
/// A `poll` may be cancelled (dropped by a timeout or a `select!`) at any
/// point: whatever its polls claim is kept for the next one. An error a
/// shard answers while records from others are at hand is returned by the
/// next `poll` that has no records to give.
///
/// Acks, nacks, extensions and dead letters take the [`ShardedRecord`] and
/// go to its shard. Clone the [`Client`] freely: several `ShardedGroup`s of
/// one group share its connections.
///
/// ```no_run
/// # async fn demo(client: felix_client::Client) -> Result<(), felix_client::ClientError> {
/// use std::time::Duration;
/// use felix_client::ShardedGroup;
///
/// let mut jobs = ShardedGroup::new(client, "t1", "default", "jobs", "workers").await?;
/// loop {
///     let batch = jobs.poll(16, Duration::from_secs(5)).await?;
///     if batch.is_empty() {
///         break;
///     }
///     // ... handle each record's payload ...
///     jobs.ack_many(&batch).await?;
/// }
/// jobs.close().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ShardedGroup {
    via: Via,
    tenant: String,
    namespace: String,
    stream: String,
    group: String,
    shards: u32,
    /// The broker core of each shard: shards on one core share a
    /// connection.
    placement: Vec<u32>,
    member: Option<GroupMember>,
    visibility: Option<Duration>,
    wait_slice: Duration,
    /// Where the next sweep (and the next rotating wait) starts.
    next: u32,
    /// Claimed, not yet handed out; handed out before anything else.
    ready: VecDeque<ShardedRecord>,
    /// An error answered while records were at hand, for the next poll
    /// with none.
    deferred: Option<ClientError>,
    /// Shards with a poll out (at most one each).
    waiting: Vec<bool>,
    /// No new waiting poll goes to a shard before this (its last one's
    /// slice), so waits the broker ends early are not re-sent in a loop.
    quiet_until: Vec<Instant>,
    answers_tx: mpsc::UnboundedSender<Answer>,
    answers: mpsc::UnboundedReceiver<Answer>,
}

impl ShardedGroup {
    /// The group `group` on every shard of `tenant/namespace/stream`
    /// (asks the broker how many shards the stream has).
    pub async fn new(
        client: Client,
        tenant: &str,
        namespace: &str,
        stream: &str,
        group: &str,
    ) -> Result<ShardedGroup> {
        let info = client.describe_stream(tenant, namespace, stream).await?;
        Self::build(
            Via::Broker(client),
            info.placement,
            info.shards,
            [tenant, namespace, stream, group],
        )
    }

    /// The group `group` on every shard of `tenant/namespace/stream` of a
    /// cluster: each shard's polls, acks, nacks, extensions and dead
    /// letters go to the broker that leads it, following a new leader
    /// after a failover as [`ClusterClient`] does.
    ///
    /// Claims are the leader's memory: after a failover the records a lost
    /// leader had handed out are owed again from the group's durable
    /// position, so an ack of one of them may be refused (`stale_claim`,
    /// once it has gone out again) and a record can arrive twice. A
    /// member's `reclaim` takes back only what it held on the leader it
    /// polls.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), felix_client::ClientError> {
    /// use std::time::Duration;
    /// use felix_client::{ClientConfig, ClusterClient, ShardedGroup};
    ///
    /// let cluster = ClusterClient::connect(
    ///     &["127.0.0.1:7400", "127.0.0.1:7410", "127.0.0.1:7420"],
    ///     ClientConfig::default(),
    /// )
    /// .await?;
    /// let mut jobs = ShardedGroup::on_cluster(cluster, "t1", "default", "jobs", "workers").await?;
    /// let batch = jobs.poll(16, Duration::from_secs(5)).await?;
    /// jobs.ack_many(&batch).await?;
    /// jobs.close().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn on_cluster(
        cluster: ClusterClient,
        tenant: &str,
        namespace: &str,
        stream: &str,
        group: &str,
    ) -> Result<ShardedGroup> {
        let info = cluster.describe_stream(tenant, namespace, stream).await?;
        // Each shard is on its own leader's connection: no placement says
        // which shards share one.
        Self::build(
            Via::Cluster(cluster),
            Vec::new(),
            info.shards,
            [tenant, namespace, stream, group],
        )
    }

    fn build(
        via: Via,
        placement: Vec<u32>,
        shards: u32,
        [tenant, namespace, stream, group]: [&str; 4],
    ) -> Result<ShardedGroup> {
        if shards == 0 {
            return Err(ClientError::InvalidArgument(format!(
                "{tenant}/{namespace}/{stream} has no shards"
            )));
        }
        let (answers_tx, answers) = mpsc::unbounded_channel();
        let now = Instant::now();
        Ok(ShardedGroup {
            via,
            tenant: tenant.to_string(),
            namespace: namespace.to_string(),
            stream: stream.to_string(),
            group: group.to_string(),
            shards,
            placement,
            member: None,
            visibility: None,
            wait_slice: DEFAULT_WAIT_SLICE,
            next: 0,
            ready: VecDeque::new(),
            deferred: None,
            waiting: vec![false; shards as usize],
            quiet_until: vec![now; shards as usize],
            answers_tx,
            answers,
        })
    }

    /// Poll as this named member on every shard (see [`GroupMember`]); with
    /// `reclaim` set, the first poll of each shard on a new connection
    /// takes back what the member held there.
    pub fn member(mut self, member: GroupMember) -> Result<ShardedGroup> {
        let len = member.name().len();
        if len == 0 || len > GroupMember::MAX_NAME_BYTES {
            return Err(ClientError::InvalidArgument(format!(
                "a group member name is 1 to {} bytes, not {len}",
                GroupMember::MAX_NAME_BYTES
            )));
        }
        self.member = Some(member);
        Ok(self)
    }

    /// Claims from this group's polls stand for `visibility` instead of
    /// the broker's visibility timeout (needs
    /// [`FEATURE_GROUP_CLAIM_CONTROL`](crate::FEATURE_GROUP_CLAIM_CONTROL),
    /// checked on each poll).
    pub fn visibility(mut self, visibility: Duration) -> ShardedGroup {
        self.visibility = Some(visibility);
        self
    }

    /// How long each waiting poll lasts before it is sent again (default
    /// one second, at least 10 ms). Longer sends fewer requests while the
    /// stream is idle; shorter makes [`close`](Self::close) quicker.
    pub fn wait_slice(mut self, slice: Duration) -> ShardedGroup {
        self.wait_slice = slice.max(Duration::from_millis(10));
        self
    }

    /// The stream's shard count.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The group's name.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// Records claimed by earlier polls' waiting polls and not yet returned
    /// by [`poll`](Self::poll) (answers still on their way not counted).
    pub fn held(&self) -> usize {
        self.ready.len()
    }

    /// Claim up to `max_records` records from any of the stream's shards,
    /// waiting up to `wait` for one when none is available. An empty batch
    /// means nothing was.
    pub async fn poll(&mut self, max_records: u32, wait: Duration) -> Result<Vec<ShardedRecord>> {
        if max_records == 0 {
            return Err(ClientError::InvalidArgument(
                "max_records must be at least 1".into(),
            ));
        }
        let max = max_records as usize;
        let now = Instant::now();
        let deadline = now
            .checked_add(wait)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600));
        // Answers that came in since the last poll.
        self.drain();
        if !self.ready.is_empty() {
            return Ok(self.hand_out(max));
        }
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }

        // Every poll, waiting or not, runs in a task that answers through
        // `answers`, and what it claims goes to `ready` before it is handed
        // out: a caller that drops this future (a timeout, a `select!`) at
        // any point leaves the records here for the next poll.
        let start = self.next;
        self.next = (self.next + 1) % self.shards;
        for i in 0..self.shards {
            let shard = (start + i) % self.shards;
            // A waiting poll is already out there and gets what arrives.
            if self.waiting[shard as usize] {
                continue;
            }
            let want = max.saturating_sub(self.ready.len());
            if want == 0 {
                break;
            }
            self.spawn_poll(shard, want as u32, Duration::ZERO);
            while self.waiting[shard as usize] {
                // `answers_tx` lives in `self`, so the channel never closes.
                let Some(answer) = self.answers.recv().await else {
                    break;
                };
                self.note(answer)?;
            }
        }
        if !self.ready.is_empty() || wait.is_zero() {
            return Ok(self.hand_out(max));
        }

        // Nothing anywhere: wait.
        loop {
            let now = Instant::now();
            if deadline.saturating_duration_since(now) < Duration::from_millis(1) {
                return Ok(Vec::new());
            }
            let free_at = self.spread_waits(max_records, deadline - now, now);
            let wake = free_at.map_or(deadline, |t| t.min(deadline));
            match tokio::time::timeout_at(wake, self.answers.recv()).await {
                Ok(Some(answer)) => {
                    self.note(answer)?;
                    if !self.ready.is_empty() {
                        self.drain();
                        return Ok(self.hand_out(max));
                    }
                }
                // `answers_tx` lives in `self`, so the channel never closes.
                Ok(None) => return Ok(Vec::new()),
                // The deadline, or a shard that may wait again.
                Err(_) => {}
            }
        }
    }

    /// Send waiting polls for up to `max_records` records in all, so that
    /// what they claim after the first answer never exceeds it. With at
    /// least as many records as shards, every shard waits for its part of
    /// `max_records`, a wait slice at a time; with fewer, one record each
    /// on as many shards as records, in turn, a short slice at a time. A
    /// shard whose last wait's slice is not over yet waits its turn;
    /// returns the earliest such turn.
    fn spread_waits(
        &mut self,
        max_records: u32,
        remaining: Duration,
        now: Instant,
    ) -> Option<Instant> {
        let n = self.shards;
        let free =
            |g: &ShardedGroup, s: u32| !g.waiting[s as usize] && g.quiet_until[s as usize] <= now;
        if max_records >= n {
            let (base, extra) = (max_records / n, max_records % n);
            let slice = remaining.min(self.wait_slice);
            for shard in 0..n {
                if free(self, shard) {
                    self.spawn_wait(shard, base + u32::from(shard < extra), slice, now);
                }
            }
        } else {
            let slice = remaining.min(SHORT_WAIT_SLICE);
            let out = self.waiting.iter().filter(|w| **w).count() as u32;
            for _ in out..max_records {
                let idle = (0..n).map(|i| (self.next + i) % n).find(|s| free(self, *s));
                let Some(shard) = idle else { break };
                self.next = (shard + 1) % n;
                self.spawn_wait(shard, 1, slice, now);
            }
        }
        (0..n)
            .filter(|s| !self.waiting[*s as usize])
            .map(|s| self.quiet_until[s as usize])
            .filter(|t| *t > now)
            .min()
    }

    fn spawn_wait(&mut self, shard: u32, max_records: u32, slice: Duration, now: Instant) {
        self.quiet_until[shard as usize] = now + slice;
        self.spawn_poll(shard, max_records, slice);
    }

    fn hand_out(&mut self, max: usize) -> Vec<ShardedRecord> {
        let n = max.min(self.ready.len());
        self.ready.drain(..n).collect()
    }

    /// Take in every answer already here; errors wait in `deferred`.
    fn drain(&mut self) {
        while let Ok(answer) = self.answers.try_recv() {
            if let Err(e) = self.take_answer(answer) {
                self.deferred.get_or_insert(e);
            }
        }
    }

    /// Take in one answer: an error is the caller's only when no records
    /// are at hand to return first.
    fn note(&mut self, answer: Answer) -> Result<()> {
        match self.take_answer(answer) {
            Err(e) if self.ready.is_empty() => Err(e),
            Err(e) => {
                self.deferred.get_or_insert(e);
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// An answer's records join `ready`; its error is returned.
    fn take_answer(&mut self, (shard, answer): Answer) -> Result<()> {
        self.waiting[shard as usize] = false;
        if let Err(ClientError::Disconnected | ClientError::Io(_)) = &answer {
            // The connection of the shard's core dropped. A member that
            // reclaims takes back, on its first poll of each shard over
            // the new connection, what the old one held, so records held
            // here from that core's shards would come out twice: let the
            // reclaim hand them out instead.
            if self.member.as_ref().is_some_and(GroupMember::reclaims) {
                let core = |s: u32| self.placement.get(s as usize).copied();
                let lost = core(shard);
                let same_core: Vec<bool> = (0..self.shards)
                    .map(|s| s == shard || (lost.is_some() && core(s) == lost))
                    .collect();
                self.ready.retain(|r| !same_core[r.shard as usize]);
            }
        }
        hold(&mut self.ready, shard, answer?);
        Ok(())
    }

    fn spawn_poll(&mut self, shard: u32, max_records: u32, wait: Duration) {
        self.waiting[shard as usize] = true;
        let (via, key) = (self.via.clone(), self.key(shard));
        let (member, visibility) = (self.member.clone(), self.visibility);
        let reply = Reply {
            shard,
            tx: Some(self.answers_tx.clone()),
        };
        tokio::spawn(async move {
            let answer = via.poll(key, max_records, wait, member, visibility).await;
            reply.send(answer);
        });
    }

    fn key(&self, shard: u32) -> felix_wire::GroupKey {
        Client::group_key(
            &self.tenant,
            &self.namespace,
            &self.stream,
            shard,
            &self.group,
        )
    }

    /// Finish a record.
    pub async fn ack(&self, record: &ShardedRecord) -> Result<()> {
        let (t, n, s, g) = self.names();
        let offsets = [record.record.offset];
        match &self.via {
            Via::Broker(c) => c.group_ack_many(t, n, s, record.shard, g, &offsets).await,
            Via::Cluster(c) => c.group_ack_many(t, n, s, record.shard, g, &offsets).await,
        }
    }

    /// Finish several records, one request per shard, all sent before any
    /// answer is awaited. On an error every request is still awaited and
    /// the first error returned, other than `stale_claim` if there is one
    /// (a shard's claims that lapsed, or went with its old leader, is the
    /// least of them: those records come again).
    pub async fn ack_many(&self, records: &[ShardedRecord]) -> Result<()> {
        let mut by_shard: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for r in records {
            by_shard.entry(r.shard).or_default().push(r.record.offset);
        }
        let (t, n, s, g) = self.names();
        let mut first_error = None;
        match &self.via {
            Via::Broker(client) => {
                let mut pending = Vec::with_capacity(by_shard.len());
                for (shard, offsets) in &by_shard {
                    match client
                        .begin_group_ack_many(t, n, s, *shard, g, offsets)
                        .await
                    {
                        Ok(p) => pending.push(p),
                        Err(e) => keep_first(&mut first_error, e),
                    }
                }
                for p in pending {
                    if let Err(e) = p.await {
                        keep_first(&mut first_error, e);
                    }
                }
            }
            Via::Cluster(cluster) => {
                // Shards lead on different brokers: one task each, all at
                // once.
                let mut acks = tokio::task::JoinSet::new();
                for (shard, offsets) in by_shard {
                    let (cluster, (t, n, s, g)) = (cluster.clone(), self.owned_names());
                    acks.spawn(async move {
                        cluster
                            .group_ack_many(&t, &n, &s, shard, &g, &offsets)
                            .await
                    });
                }
                while let Some(done) = acks.join_next().await {
                    if let Err(e) = done.map_err(joined).and_then(|r| r) {
                        keep_first(&mut first_error, e);
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Hand a record back now, owed to the group again.
    pub async fn nack(&self, record: &ShardedRecord) -> Result<()> {
        let (t, n, s, g) = self.names();
        self.via
            .nack(t, n, s, record.shard, g, &record.record)
            .await
    }

    /// Hand a record back, owed again once `delay` has passed.
    pub async fn nack_after(&self, record: &ShardedRecord, delay: Duration) -> Result<()> {
        let (t, n, s, g) = self.names();
        let r = &record.record;
        match &self.via {
            Via::Broker(c) => c.group_nack_after(t, n, s, record.shard, g, r, delay).await,
            Via::Cluster(c) => c.group_nack_after(t, n, s, record.shard, g, r, delay).await,
        }
    }

    /// Let the claim on a record stand for `by` from now (which can
    /// shorten it); returns how long it now stands.
    pub async fn extend(&self, record: &ShardedRecord, by: Duration) -> Result<Duration> {
        let (t, n, s, g) = self.names();
        let r = &record.record;
        match &self.via {
            Via::Broker(c) => c.group_extend(t, n, s, record.shard, g, r, by).await,
            Via::Cluster(c) => c.group_extend(t, n, s, record.shard, g, r, by).await,
        }
    }

    /// Give up on a record: list it as a dead letter of its shard's group
    /// and finish it.
    pub async fn dead_letter(&self, record: &ShardedRecord) -> Result<()> {
        let (t, n, s, g) = self.names();
        let r = &record.record;
        match &self.via {
            Via::Broker(c) => c.group_dead_letter(t, n, s, record.shard, g, r).await,
            Via::Cluster(c) => c.group_dead_letter(t, n, s, record.shard, g, r).await,
        }
    }

    /// [`dead_letter`](Self::dead_letter) with a short reason the
    /// dead-letter list keeps.
    pub async fn dead_letter_with_reason(
        &self,
        record: &ShardedRecord,
        reason: &str,
    ) -> Result<()> {
        let (t, n, s, g) = self.names();
        let r = &record.record;
        match &self.via {
            Via::Broker(c) => {
                c.group_dead_letter_with_reason(t, n, s, record.shard, g, r, reason)
                    .await
            }
            Via::Cluster(c) => {
                c.group_dead_letter_with_reason(t, n, s, record.shard, g, r, reason)
                    .await
            }
        }
    }

    /// The group on every shard, in shard order.
    pub async fn describe(&self) -> Result<Vec<GroupInfo>> {
        let (t, n, s, g) = self.names();
        match &self.via {
            Via::Broker(c) => c.group_describe_stream(t, n, s, g).await,
            Via::Cluster(c) => c.group_describe_stream(t, n, s, g).await,
        }
    }

    /// Records published to the stream and not yet finished by the group,
    /// over every shard.
    pub async fn lag(&self) -> Result<u64> {
        Ok(self.describe().await?.iter().map(GroupInfo::lag).sum())
    }

    fn names(&self) -> (&str, &str, &str, &str) {
        (&self.tenant, &self.namespace, &self.stream, &self.group)
    }

    fn owned_names(&self) -> (String, String, String, String) {
        (
            self.tenant.clone(),
            self.namespace.clone(),
            self.stream.clone(),
            self.group.clone(),
        )
    }

    /// Wait for the polls still out (about a wait slice; at most that
    /// plus 5 s, after which what they claim lapses back to the group) and
    /// hand back every record claimed and not yet returned by
    /// [`poll`](Self::poll), all nacks sent at once. Returns the first error
    /// met; every record is still tried.
    pub async fn close(mut self) -> Result<()> {
        let handback = self.take_handback();
        handback.run().await
    }

    fn take_handback(&mut self) -> HandBack {
        let (answers_tx, answers) = mpsc::unbounded_channel();
        // The polls still out hold the only senders left of the old
        // channel, so its receiver ends if one of them never answers.
        drop(std::mem::replace(&mut self.answers_tx, answers_tx));
        let out = self.waiting.iter().filter(|w| **w).count();
        self.waiting.fill(false);
        HandBack {
            via: self.via.clone(),
            names: self.owned_names(),
            ready: std::mem::take(&mut self.ready),
            out,
            deadline: Instant::now() + self.wait_slice + CLOSE_GRACE,
            answers: std::mem::replace(&mut self.answers, answers),
        }
    }
}

impl Drop for ShardedGroup {
    fn drop(&mut self) {
        if self.ready.is_empty() && !self.waiting.iter().any(|w| *w) {
            return;
        }
        let handback = self.take_handback();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    if let Err(e) = handback.run().await {
                        tracing::warn!("felix: a dropped ShardedGroup's hand-back failed: {e}");
                    }
                });
            }
            Err(_) => tracing::warn!(
                "felix: a ShardedGroup dropped outside a tokio runtime left {} records \
                 claimed and {} polls out; what they hold goes back to the group when \
                 its claims lapse",
                handback.ready.len(),
                handback.out
            ),
        }
    }
}

/// What a [`ShardedGroup`] sends its requests through: one broker, or the
/// leaders of a cluster.
#[derive(Debug, Clone)]
enum Via {
    Broker(Client),
    Cluster(ClusterClient),
}

impl Via {
    async fn poll(
        &self,
        key: felix_wire::GroupKey,
        max_records: u32,
        wait: Duration,
        member: Option<GroupMember>,
        visibility: Option<Duration>,
    ) -> Result<Vec<GroupRecord>> {
        match self {
            Via::Broker(c) => {
                c.poll_group(key, max_records, wait, member, visibility)
                    .await
            }
            Via::Cluster(c) => {
                c.poll_group(&key, max_records, wait, member.as_ref(), visibility)
                    .await
            }
        }
    }

    async fn nack(
        &self,
        t: &str,
        n: &str,
        s: &str,
        shard: u32,
        g: &str,
        record: &GroupRecord,
    ) -> Result<()> {
        match self {
            Via::Broker(c) => c.group_nack(t, n, s, shard, g, record).await,
            Via::Cluster(c) => c.group_nack(t, n, s, shard, g, record).await,
        }
    }
}

/// Keep the first error of several, unless it is a `stale_claim` and this
/// one is not: a caller that passes over stale claims must still see any
/// other shard's failure.
fn keep_first(kept: &mut Option<ClientError>, e: ClientError) {
    let stale = |e: &ClientError| e.code() == Some(crate::ErrorCode::StaleClaim);
    match kept {
        Some(k) if stale(k) && !stale(&e) => *kept = Some(e),
        Some(_) => {}
        None => *kept = Some(e),
    }
}

/// A task that panicked (or was cancelled) as a client error.
fn joined(e: tokio::task::JoinError) -> ClientError {
    ClientError::Protocol(format!("a ShardedGroup task failed: {e}"))
}

/// Where a shard's poll answers. Dropped unsent (the task panicked or its
/// runtime shut down), it answers `Disconnected`, so the shard is not left
/// marked as waiting for ever; the broker may have claimed records for it,
/// which lapse back to the group.
struct Reply {
    shard: u32,
    tx: Option<mpsc::UnboundedSender<Answer>>,
}

impl Reply {
    fn send(mut self, answer: Result<Vec<GroupRecord>>) {
        if let Some(tx) = self.tx.take() {
            // A closed channel: the group was dropped outside a runtime,
            // and these claims lapse back to the group.
            let _ = tx.send((self.shard, answer));
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send((self.shard, Err(ClientError::Disconnected)));
        }
    }
}

/// Hold `records` of `shard` in `ready`, once each. A record already held
/// can come again: its core's connection dropped and came back between this
/// group's polls (so no poll saw the error), and a reclaiming member's first
/// poll on the new connection took back what the old one held. The newer
/// delivery (more attempts) is the one its claim now stands for.
fn hold(ready: &mut VecDeque<ShardedRecord>, shard: u32, records: Vec<GroupRecord>) {
    if !ready.iter().any(|h| h.shard == shard) {
        // The usual case: nothing of this shard held, nothing to compare.
        ready.extend(
            records
                .into_iter()
                .map(|record| ShardedRecord { shard, record }),
        );
        return;
    }
    for record in records {
        let held = ready
            .iter_mut()
            .find(|h| h.shard == shard && h.record.offset == record.offset);
        match held {
            Some(h) if h.record.attempts < record.attempts => h.record = record,
            Some(_) => {}
            None => ready.push_back(ShardedRecord { shard, record }),
        }
    }
}

/// What [`ShardedGroup::close`] (or its drop) still owes the group.
struct HandBack {
    via: Via,
    names: (String, String, String, String),
    ready: VecDeque<ShardedRecord>,
    /// Polls still to answer.
    out: usize,
    /// When to stop waiting for them.
    deadline: Instant,
    answers: mpsc::UnboundedReceiver<Answer>,
}

impl HandBack {
    async fn run(mut self) -> Result<()> {
        let mut first_error = None;
        while self.out > 0 {
            let answer = tokio::time::timeout_at(self.deadline, self.answers.recv()).await;
            let Ok(Some((shard, answer))) = answer else {
                tracing::warn!(
                    "felix: {} polls of a closed ShardedGroup did not answer in time; \
                     what they claim goes back to the group when its claims lapse",
                    self.out
                );
                break;
            };
            self.out -= 1;
            match answer {
                Ok(records) => hold(&mut self.ready, shard, records),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let mut nacks = tokio::task::JoinSet::new();
        for r in self.ready.drain(..) {
            let (via, (t, n, s, g)) = (self.via.clone(), self.names.clone());
            nacks.spawn(async move { via.nack(&t, &n, &s, r.shard, &g, &r.record).await });
        }
        while let Some(done) = nacks.join_next().await {
            match done {
                // The claim lapsed and the record already went back.
                Ok(Err(e)) if e.code() == Some(ErrorCode::StaleClaim) => {}
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Ok(Ok(())) => {}
                Err(join) => {
                    first_error.get_or_insert(joined(join));
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn of_several_errors_a_stale_claim_gives_way_to_any_other() {
        let err = |code| ClientError::Server {
            code,
            message: String::new(),
            not_applied: false,
        };
        let mut kept = None;
        keep_first(&mut kept, err(crate::ErrorCode::StaleClaim));
        keep_first(&mut kept, err(crate::ErrorCode::NotFound));
        keep_first(&mut kept, err(crate::ErrorCode::InvalidRequest));
        assert_eq!(
            kept.and_then(|e| e.code()),
            Some(crate::ErrorCode::NotFound)
        );
        let mut kept = None;
        keep_first(&mut kept, err(crate::ErrorCode::StaleClaim));
        keep_first(&mut kept, err(crate::ErrorCode::StaleClaim));
        assert_eq!(
            kept.and_then(|e| e.code()),
            Some(crate::ErrorCode::StaleClaim)
        );
    }

    fn record(offset: u64, attempts: u32) -> GroupRecord {
        GroupRecord {
            offset,
            attempts,
            timestamp_ms: 0,
            key: None,
            headers: Default::default(),
            payload: bytes::Bytes::from_static(b"x"),
            skipped_before: None,
        }
    }

    fn held(ready: &VecDeque<ShardedRecord>) -> Vec<(u32, u64, u32)> {
        ready
            .iter()
            .map(|r| (r.shard, r.record.offset, r.record.attempts))
            .collect()
    }

    /// A record handed out again by a reclaim while it was held is held
    /// once, as its newer delivery; the same offset of another shard is a
    /// different record.
    #[test]
    fn a_record_handed_out_again_is_held_once() {
        let mut ready = VecDeque::new();
        hold(&mut ready, 0, vec![record(5, 1), record(6, 1)]);
        hold(&mut ready, 1, vec![record(5, 1)]);
        hold(
            &mut ready,
            0,
            vec![record(6, 2), record(7, 1), record(5, 1)],
        );
        assert_eq!(
            held(&ready),
            vec![(0, 5, 1), (0, 6, 2), (1, 5, 1), (0, 7, 1)]
        );
    }
}

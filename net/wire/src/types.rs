//! Value types carried inside requests and responses, with their encodings.

use std::fmt;
use std::str::FromStr;

use bytes::{BufMut, Bytes, BytesMut};

use crate::codec::{
    put_blob, put_bool, put_opt, put_opt_blob, put_opt_str, put_opt_u64, put_str, put_vec,
    put_wire_vec, Reader, Wire, BLOB, OPT, STR, U16, U32, U64, U8, VEC,
};
use crate::error::{DecodeError, ErrorCode, WireError};
use crate::headers::Headers;

type Result<T> = std::result::Result<T, DecodeError>;

/// Which shard a key is routed to: `crc32c(key) % shards`.
///
/// Both the broker and the client route keyed publishes with this function,
/// so changing it would move keys between shards and break per-key
/// ordering: it is part of the protocol. `shards == 0` returns 0 rather than
/// dividing by zero.
pub fn shard_for_key(key: &[u8], shards: u32) -> u32 {
    if shards == 0 {
        return 0;
    }
    crc32c::crc32c(key) % shards
}

/// Where a read or a new consumer group starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StartPosition {
    /// The oldest record still retained.
    Earliest,
    /// The end of the log: only records published from now on.
    Latest,
    /// This exact offset.
    Offset(u64),
}

impl fmt::Display for StartPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartPosition::Earliest => f.write_str("earliest"),
            StartPosition::Latest => f.write_str("latest"),
            StartPosition::Offset(o) => write!(f, "{o}"),
        }
    }
}

impl Wire for StartPosition {
    const MIN_BYTES: usize = U8;
    fn put(&self, out: &mut BytesMut) {
        match self {
            StartPosition::Earliest => out.put_u8(0),
            StartPosition::Latest => out.put_u8(1),
            StartPosition::Offset(o) => {
                out.put_u8(2);
                out.put_u64_le(*o);
            }
        }
    }
    fn get(r: &mut Reader) -> Result<Self> {
        match r.u8("start position")? {
            0 => Ok(StartPosition::Earliest),
            1 => Ok(StartPosition::Latest),
            2 => Ok(StartPosition::Offset(r.u64("start offset")?)),
            _ => Err(DecodeError::BadValue {
                what: "start position",
            }),
        }
    }
}

/// `tenant/namespace/stream`. Not validated here: the broker checks name
/// rules and answers `invalid_request`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamRef {
    pub tenant: String,
    pub namespace: String,
    pub stream: String,
}

/// `StreamRef::from_str` was not given three non-empty `/`-separated parts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stream path {0:?} must be tenant/namespace/stream")]
pub struct ParseStreamRefError(pub String);

impl StreamRef {
    pub fn new(
        tenant: impl Into<String>,
        namespace: impl Into<String>,
        stream: impl Into<String>,
    ) -> StreamRef {
        StreamRef {
            tenant: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
        }
    }

    /// Split `tenant/namespace/stream`; `None` unless there are exactly three
    /// non-empty parts.
    pub fn parse(path: &str) -> Option<StreamRef> {
        let mut parts = path.split('/');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(t), Some(n), Some(s), None)
                if !t.is_empty() && !n.is_empty() && !s.is_empty() =>
            {
                Some(StreamRef::new(t, n, s))
            }
            _ => None,
        }
    }
}

impl FromStr for StreamRef {
    type Err = ParseStreamRefError;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        StreamRef::parse(s).ok_or_else(|| ParseStreamRefError(s.to_string()))
    }
}

impl fmt::Display for StreamRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.tenant, self.namespace, self.stream)
    }
}

impl Wire for StreamRef {
    const MIN_BYTES: usize = 3 * STR;
    fn put(&self, out: &mut BytesMut) {
        put_str(out, &self.tenant);
        put_str(out, &self.namespace);
        put_str(out, &self.stream);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(StreamRef {
            tenant: r.string("tenant")?,
            namespace: r.string("namespace")?,
            stream: r.string("stream")?,
        })
    }
}

/// When the broker acknowledges a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum AckMode {
    /// Whatever the broker is configured to do.
    #[default]
    Default = 0,
    /// Once the records are accepted into the shard's queue.
    Queued = 1,
    /// Once the records are committed to durable storage ("commit ack").
    Durable = 2,
}

impl AckMode {
    pub fn from_u8(v: u8) -> Option<AckMode> {
        match v {
            0 => Some(AckMode::Default),
            1 => Some(AckMode::Queued),
            2 => Some(AckMode::Durable),
            _ => None,
        }
    }
}

impl Wire for AckMode {
    const MIN_BYTES: usize = U8;
    fn put(&self, out: &mut BytesMut) {
        out.put_u8(*self as u8);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        AckMode::from_u8(r.u8("ack mode")?).ok_or(DecodeError::BadValue { what: "ack mode" })
    }
}

/// Which shard a publish goes to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PublishTarget {
    /// This shard.
    Shard(u32),
    /// The shard [`shard_for_key`] picks for this key.
    Key(Bytes),
}

impl Wire for PublishTarget {
    const MIN_BYTES: usize = U8 + U32;
    fn put(&self, out: &mut BytesMut) {
        match self {
            PublishTarget::Shard(s) => {
                out.put_u8(0);
                out.put_u32_le(*s);
            }
            PublishTarget::Key(k) => {
                out.put_u8(1);
                put_blob(out, k);
            }
        }
    }
    fn get(r: &mut Reader) -> Result<Self> {
        match r.u8("publish target")? {
            0 => Ok(PublishTarget::Shard(r.u32("target shard")?)),
            1 => Ok(PublishTarget::Key(r.blob("target key")?)),
            _ => Err(DecodeError::BadValue {
                what: "publish target",
            }),
        }
    }
}

/// Headers: `u32 count`, then per header `str name, blob value`.
pub(crate) const HEADER: usize = STR + BLOB;

fn put_headers(out: &mut BytesMut, headers: &[(String, Bytes)]) {
    put_vec(out, headers, |o, (k, v)| {
        put_str(o, k);
        put_blob(o, v);
    });
}

pub(crate) fn get_headers(r: &mut Reader) -> Result<Vec<(String, Bytes)>> {
    r.vec("headers", HEADER, |r| {
        Ok((r.string("header name")?, r.blob("header value")?))
    })
}

/// A record as published. The broker assigns the offset, and the timestamp
/// when none is given.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordIn {
    pub timestamp_ms: Option<u64>,
    pub key: Option<Bytes>,
    pub headers: Vec<(String, Bytes)>,
    pub payload: Bytes,
}

/// The decoding below is the reference for a publish's records, which a
/// broker checks in place instead (`publish.rs`, tested to accept and refuse
/// exactly what this accepts and refuses): change both together.
impl Wire for RecordIn {
    const MIN_BYTES: usize = OPT + OPT + VEC + BLOB;
    fn put(&self, out: &mut BytesMut) {
        put_opt_u64(out, self.timestamp_ms);
        put_opt_blob(out, self.key.as_ref());
        put_headers(out, &self.headers);
        put_blob(out, &self.payload);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(RecordIn {
            timestamp_ms: r.opt_u64("record timestamp")?,
            key: r.opt_blob("record key")?,
            headers: get_headers(r)?,
            payload: r.blob("record payload")?,
        })
    }
}

/// A stored record, as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub offset: u64,
    pub timestamp_ms: u64,
    pub key: Option<Bytes>,
    pub headers: Headers,
    pub payload: Bytes,
}

impl Record {
    /// Bytes a record's fields take in a `Records` answer besides what it
    /// carries (its key, header names and values, and payload): with those,
    /// what the record adds to the answer (at most: a header name over
    /// 65,535 bytes is cut). Lets a sender fill a frame without encoding
    /// first.
    pub fn framing_bytes(has_key: bool, headers: usize) -> usize {
        <Self as Wire>::MIN_BYTES + if has_key { BLOB } else { 0 } + headers * (STR + BLOB)
    }
}

impl Wire for Record {
    const MIN_BYTES: usize = U64 + U64 + OPT + VEC + BLOB;
    fn put(&self, out: &mut BytesMut) {
        out.put_u64_le(self.offset);
        out.put_u64_le(self.timestamp_ms);
        put_opt_blob(out, self.key.as_ref());
        self.headers.put(out);
        put_blob(out, &self.payload);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(Record {
            offset: r.u64("record offset")?,
            timestamp_ms: r.u64("record timestamp")?,
            key: r.opt_blob("record key")?,
            headers: Headers::get_from(r)?,
            payload: r.blob("record payload")?,
        })
    }
}

/// A record claimed by a consumer group member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    pub offset: u64,
    /// How many times this record has been handed out, this time included.
    /// Echoed back in nack/extend/dead-letter so a stale claim is detected.
    pub attempts: u32,
    pub timestamp_ms: u64,
    pub key: Option<Bytes>,
    pub headers: Headers,
    pub payload: Bytes,
    /// How many offsets directly below `offset` the broker settled without
    /// delivering them (control records, records retention removed first).
    /// Present only on connections that negotiated
    /// [`FEATURE_GROUP_SKIPPED`](crate::FEATURE_GROUP_SKIPPED).
    pub skipped_before: Option<u64>,
}

impl GroupRecord {
    /// [`Record::framing_bytes`] for a `GroupRecords` answer: a claimed
    /// record's fields besides what it carries, `skipped_before` included
    /// when the connection negotiated it.
    pub fn framing_bytes(has_key: bool, headers: usize, skipped: bool) -> usize {
        <Self as Wire>::MIN_BYTES
            + if has_key { BLOB } else { 0 }
            + headers * (STR + BLOB)
            + if skipped { U64 } else { 0 }
    }
}

impl Wire for GroupRecord {
    const MIN_BYTES: usize = U64 + U32 + U64 + OPT + VEC + BLOB + OPT;
    fn put(&self, out: &mut BytesMut) {
        out.put_u64_le(self.offset);
        out.put_u32_le(self.attempts);
        out.put_u64_le(self.timestamp_ms);
        put_opt_blob(out, self.key.as_ref());
        self.headers.put(out);
        put_blob(out, &self.payload);
        put_opt_u64(out, self.skipped_before);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(GroupRecord {
            offset: r.u64("record offset")?,
            attempts: r.u32("record attempts")?,
            timestamp_ms: r.u64("record timestamp")?,
            key: r.opt_blob("record key")?,
            headers: Headers::get_from(r)?,
            payload: r.blob("record payload")?,
            skipped_before: r.opt_u64("skipped_before")?,
        })
    }
}

/// Identifies a consumer group member, for member-affine claims.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupMemberRef {
    pub name: String,
    /// Take back the claims this member held before it reconnected.
    pub reclaim: bool,
}

impl Wire for GroupMemberRef {
    const MIN_BYTES: usize = STR + U8;
    fn put(&self, out: &mut BytesMut) {
        put_str(out, &self.name);
        put_bool(out, self.reclaim);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(GroupMemberRef {
            name: r.string("member name")?,
            reclaim: r.bool("member reclaim")?,
        })
    }
}

/// A consumer group on one shard of one stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupKey {
    pub stream: StreamRef,
    pub shard: u32,
    pub group: String,
}

impl Wire for GroupKey {
    const MIN_BYTES: usize = StreamRef::MIN_BYTES + U32 + STR;
    fn put(&self, out: &mut BytesMut) {
        self.stream.put(out);
        out.put_u32_le(self.shard);
        put_str(out, &self.group);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(GroupKey {
            stream: StreamRef::get(r)?,
            shard: r.u32("shard")?,
            group: r.string("group")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    pub stream: StreamRef,
    pub shards: u32,
    pub retention_bytes: Option<u64>,
    pub retention_ms: Option<u64>,
    /// The core that owns each shard, indexed by shard.
    pub placement: Vec<u32>,
    /// In a cluster, to a client that negotiated
    /// [`FEATURE_STREAM_INCARNATION`](crate::FEATURE_STREAM_INCARNATION):
    /// the stream's incarnation (see `CreateStream`). Only a `Stream`
    /// answer carries it, as a trailing field; a list's entries never do.
    pub incarnation: Option<u64>,
}

impl Wire for StreamInfo {
    const MIN_BYTES: usize = StreamRef::MIN_BYTES + U32 + OPT + OPT + VEC;
    fn put(&self, out: &mut BytesMut) {
        self.stream.put(out);
        out.put_u32_le(self.shards);
        put_opt_u64(out, self.retention_bytes);
        put_opt_u64(out, self.retention_ms);
        put_vec(out, &self.placement, |o, c| o.put_u32_le(*c));
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(StreamInfo {
            stream: StreamRef::get(r)?,
            shards: r.u32("shards")?,
            retention_bytes: r.opt_u64("retention_bytes")?,
            retention_ms: r.opt_u64("retention_ms")?,
            placement: r.vec("placement", U32, |r| r.u32("placement"))?,
            incarnation: None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    pub stream: StreamRef,
    pub shard: u32,
    pub core: u32,
    /// Oldest retained offset.
    pub start_offset: u64,
    /// Offset the next published record will get.
    pub end_offset: u64,
    pub bytes: u64,
    pub segments: u32,
    /// Why the shard stopped accepting writes, if it did.
    pub stopped: Option<String>,
}

impl Wire for ShardInfo {
    const MIN_BYTES: usize = StreamRef::MIN_BYTES + U32 + U32 + U64 * 3 + U32 + OPT;
    fn put(&self, out: &mut BytesMut) {
        self.stream.put(out);
        out.put_u32_le(self.shard);
        out.put_u32_le(self.core);
        out.put_u64_le(self.start_offset);
        out.put_u64_le(self.end_offset);
        out.put_u64_le(self.bytes);
        out.put_u32_le(self.segments);
        put_opt_str(out, self.stopped.as_ref());
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(ShardInfo {
            stream: StreamRef::get(r)?,
            shard: r.u32("shard")?,
            core: r.u32("core")?,
            start_offset: r.u64("start_offset")?,
            end_offset: r.u64("end_offset")?,
            bytes: r.u64("bytes")?,
            segments: r.u32("segments")?,
            stopped: r.opt_string("stopped")?,
        })
    }
}

/// A replica's part in its shard's replica group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReplicaRole {
    /// Leads the shard and serves it.
    Leader = 0,
    /// Elected, still writing its generation start: refuses with
    /// `not_leader` for a moment.
    Elected = 1,
    /// Follows the leader it names: serves reads, refuses the rest.
    Follower = 2,
    /// Knows of no leader: an election is on, or it reaches no majority.
    Electing = 3,
    /// Stopped after an error it cannot go past (`stopped` says which).
    Stopped = 4,
}

impl ReplicaRole {
    pub fn from_u8(v: u8) -> Option<ReplicaRole> {
        match v {
            0 => Some(ReplicaRole::Leader),
            1 => Some(ReplicaRole::Elected),
            2 => Some(ReplicaRole::Follower),
            3 => Some(ReplicaRole::Electing),
            4 => Some(ReplicaRole::Stopped),
            _ => None,
        }
    }

    /// snake_case, as the CLI prints it.
    pub fn name(self) -> &'static str {
        match self {
            ReplicaRole::Leader => "leader",
            ReplicaRole::Elected => "elected",
            ReplicaRole::Follower => "follower",
            ReplicaRole::Electing => "electing",
            ReplicaRole::Stopped => "stopped",
        }
    }
}

impl Wire for ReplicaRole {
    const MIN_BYTES: usize = U8;
    fn put(&self, out: &mut BytesMut) {
        out.put_u8(*self as u8);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        ReplicaRole::from_u8(r.u8("replica role")?).ok_or(DecodeError::BadValue {
            what: "replica role",
        })
    }
}

/// How far another broker's replica has got, as the leader knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerProgress {
    pub node: u64,
    /// Highest replication index that broker is known to hold.
    pub matched: u64,
}

impl Wire for PeerProgress {
    const MIN_BYTES: usize = U64 + U64;
    fn put(&self, out: &mut BytesMut) {
        out.put_u64_le(self.node);
        out.put_u64_le(self.matched);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(PeerProgress {
            node: r.u64("peer node")?,
            matched: r.u64("peer matched")?,
        })
    }
}

/// One broker's replica of a shard, as that broker sees it: the answer to
/// `DescribeReplica`, from a broker in a cluster. Indices count
/// replication entries (a publish batch is one), not offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaInfo {
    pub stream: StreamRef,
    pub shard: u32,
    /// The answering broker's node id.
    pub node: u64,
    pub role: ReplicaRole,
    pub term: u64,
    /// The leader's node id, as far as this broker knows.
    pub leader: Option<u64>,
    /// The leader's client address (where publishes go).
    pub leader_addr: Option<String>,
    /// Highest index this broker knows committed.
    pub commit: u64,
    /// Highest index this broker applied to its shard log.
    pub applied: u64,
    /// Last index in this broker's replication log.
    pub last_index: u64,
    /// Entries up to this index were compacted away here.
    pub compacted: u64,
    /// Why the replica stopped, if it did.
    pub stopped: Option<String>,
    /// On the leader, each other broker's progress; empty elsewhere.
    pub peers: Vec<PeerProgress>,
}

impl Wire for ReplicaInfo {
    const MIN_BYTES: usize =
        StreamRef::MIN_BYTES + U32 + U64 + U8 + U64 + OPT + OPT + U64 * 4 + OPT + VEC;
    fn put(&self, out: &mut BytesMut) {
        self.stream.put(out);
        out.put_u32_le(self.shard);
        out.put_u64_le(self.node);
        self.role.put(out);
        out.put_u64_le(self.term);
        put_opt_u64(out, self.leader);
        put_opt_str(out, self.leader_addr.as_ref());
        out.put_u64_le(self.commit);
        out.put_u64_le(self.applied);
        out.put_u64_le(self.last_index);
        out.put_u64_le(self.compacted);
        put_opt_str(out, self.stopped.as_ref());
        put_wire_vec(out, &self.peers);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(ReplicaInfo {
            stream: StreamRef::get(r)?,
            shard: r.u32("shard")?,
            node: r.u64("node")?,
            role: ReplicaRole::get(r)?,
            term: r.u64("term")?,
            leader: r.opt_u64("leader")?,
            leader_addr: r.opt_string("leader_addr")?,
            commit: r.u64("commit")?,
            applied: r.u64("applied")?,
            last_index: r.u64("last_index")?,
            compacted: r.u64("compacted")?,
            stopped: r.opt_string("stopped")?,
            peers: r.wire_vec("peers")?,
        })
    }
}

/// One broker of a cluster, as `DescribeCluster` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterMember {
    /// Its node id.
    pub node: u64,
    /// Where clients reach it (its `server.listen`).
    pub addr: String,
}

impl Wire for ClusterMember {
    const MIN_BYTES: usize = U64 + STR;
    fn put(&self, out: &mut BytesMut) {
        out.put_u64_le(self.node);
        put_str(out, &self.addr);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(ClusterMember {
            node: r.u64("node")?,
            addr: r.string("addr")?,
        })
    }
}

/// The answer to `DescribeCluster`: the answering broker's node id and
/// every broker of its cluster (itself included), in node order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterInfo {
    pub node: u64,
    pub members: Vec<ClusterMember>,
}

impl Wire for ClusterInfo {
    const MIN_BYTES: usize = U64 + VEC;
    fn put(&self, out: &mut BytesMut) {
        out.put_u64_le(self.node);
        put_wire_vec(out, &self.members);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(ClusterInfo {
            node: r.u64("node")?,
            members: r.wire_vec("members")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterInfo {
    pub offset: u64,
    pub attempts: u32,
    /// When it was dead-lettered (unix ms).
    pub at_ms: u64,
    pub reason: Option<String>,
    /// True when a consumer dead-lettered it explicitly, false when the
    /// broker did after too many attempts.
    pub by_consumer: bool,
}

impl DeadLetterInfo {
    /// Bytes a dead letter with this reason takes in a message body (at
    /// most: a reason over 65,535 bytes is cut, possibly a little shorter
    /// at a character boundary). Lets a sender fill a frame without
    /// encoding first.
    pub fn wire_size(reason: Option<&str>) -> usize {
        Self::MIN_BYTES + reason.map_or(0, |r| STR + r.len().min(u16::MAX as usize))
    }
}

impl Wire for DeadLetterInfo {
    const MIN_BYTES: usize = U64 + U32 + U64 + OPT + U8;
    fn put(&self, out: &mut BytesMut) {
        out.put_u64_le(self.offset);
        out.put_u32_le(self.attempts);
        out.put_u64_le(self.at_ms);
        put_opt_str(out, self.reason.as_ref());
        put_bool(out, self.by_consumer);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(DeadLetterInfo {
            offset: r.u64("dead letter offset")?,
            attempts: r.u32("dead letter attempts")?,
            at_ms: r.u64("dead letter at_ms")?,
            reason: r.opt_string("dead letter reason")?,
            by_consumer: r.bool("dead letter by_consumer")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    pub group: String,
    /// The group's cursor: the lowest offset not yet finished (acked or
    /// dead-lettered); everything below it is finished. Durable.
    pub position: u64,
    pub end_offset: u64,
    pub start_offset: u64,
    /// Standing claims plus delayed nacks: what `FELIX_GROUP_MAX_IN_FLIGHT`
    /// caps.
    pub in_flight: u32,
    /// Nacked or expired, waiting to be handed out again.
    pub owed: u32,
    /// Nacked with a delay that has not yet passed.
    pub delayed: u32,
    pub dead_letters: u32,
    pub oldest_in_flight_age_ms: Option<u64>,
    pub oldest_owed_age_ms: Option<u64>,
    pub last_active_ms: Option<u64>,
}

impl GroupInfo {
    /// Records published and not yet finished by the group (acked or dead
    /// lettered): the shard's end minus the group's position, or minus the
    /// shard's start if retention removed records above the position (the
    /// broker settles those, never delivered).
    pub fn lag(&self) -> u64 {
        self.end_offset
            .saturating_sub(self.position.max(self.start_offset))
    }
}

impl Wire for GroupInfo {
    const MIN_BYTES: usize = STR + U64 * 3 + U32 * 4 + OPT * 3;
    fn put(&self, out: &mut BytesMut) {
        put_str(out, &self.group);
        out.put_u64_le(self.position);
        out.put_u64_le(self.end_offset);
        out.put_u64_le(self.start_offset);
        out.put_u32_le(self.in_flight);
        out.put_u32_le(self.owed);
        out.put_u32_le(self.delayed);
        out.put_u32_le(self.dead_letters);
        put_opt_u64(out, self.oldest_in_flight_age_ms);
        put_opt_u64(out, self.oldest_owed_age_ms);
        put_opt_u64(out, self.last_active_ms);
    }
    fn get(r: &mut Reader) -> Result<Self> {
        Ok(GroupInfo {
            group: r.string("group")?,
            position: r.u64("position")?,
            end_offset: r.u64("end_offset")?,
            start_offset: r.u64("start_offset")?,
            in_flight: r.u32("in_flight")?,
            owed: r.u32("owed")?,
            delayed: r.u32("delayed")?,
            dead_letters: r.u32("dead_letters")?,
            oldest_in_flight_age_ms: r.opt_u64("oldest_in_flight_age_ms")?,
            oldest_owed_age_ms: r.opt_u64("oldest_owed_age_ms")?,
            last_active_ms: r.opt_u64("last_active_ms")?,
        })
    }
}

/// Unknown error codes (from a newer broker) decode as
/// [`ErrorCode::Internal`] with the number kept in the message, rather than
/// failing the whole response: a client must be able to report an error it
/// does not understand.
impl Wire for WireError {
    const MIN_BYTES: usize = U16 + STR + OPT;
    fn put(&self, out: &mut BytesMut) {
        out.put_u16_le(self.code.as_u16());
        put_str(out, &self.message);
        put_opt(out, self.core.as_ref(), |o, c| o.put_u32_le(*c));
        // Only not_leader carries the leader (older decoders never see one:
        // a broker sends not_leader only in a cluster).
        if self.code == ErrorCode::NotLeader {
            put_opt(out, self.leader.as_ref(), |o, l| put_str(o, l));
        }
        // Trailing, and only when set (the broker clears it for a client
        // that did not negotiate it): one byte, 1.
        if self.not_applied {
            out.put_u8(1);
        }
    }
    fn get(r: &mut Reader) -> Result<Self> {
        let raw = r.u16("error code")?;
        let message = r.string("error message")?;
        let core = r.opt_u32("error core")?;
        let leader = if raw == ErrorCode::NotLeader.as_u16() {
            r.opt_string("error leader")?
        } else {
            None
        };
        let not_applied = if r.remaining() == 0 {
            false
        } else {
            match r.u8("error not_applied")? {
                1 => true,
                _ => {
                    return Err(DecodeError::BadValue {
                        what: "error not_applied",
                    })
                }
            }
        };
        let (code, message) = match ErrorCode::from_u16(raw) {
            Some(code) => (code, message),
            None => (
                ErrorCode::Internal,
                format!("unknown error code {raw}: {message}"),
            ),
        };
        Ok(WireError {
            code,
            message,
            core,
            leader,
            not_applied,
        })
    }
}

pub(crate) fn put_u64s(out: &mut BytesMut, v: &[u64]) {
    put_vec(out, v, |o, x| o.put_u64_le(*x));
}

pub(crate) fn get_u64s(r: &mut Reader, what: &'static str) -> Result<Vec<u64>> {
    r.vec(what, U64, |r| r.u64(what))
}

pub(crate) fn put_strings(out: &mut BytesMut, v: &[String]) {
    put_vec(out, v, |o, s| put_str(o, s));
}

pub(crate) fn get_strings(r: &mut Reader, what: &'static str) -> Result<Vec<String>> {
    r.vec(what, STR, |r| r.string(what))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lag counts what the group has yet to finish: not the records
    /// retention removed above its position (settled, never delivered).
    #[test]
    fn lag_leaves_out_what_retention_removed() {
        let info = |position, start_offset, end_offset| GroupInfo {
            group: "g".into(),
            position,
            end_offset,
            start_offset,
            in_flight: 0,
            owed: 0,
            delayed: 0,
            dead_letters: 0,
            oldest_in_flight_age_ms: None,
            oldest_owed_age_ms: None,
            last_active_ms: None,
        };
        assert_eq!(info(0, 0, 500).lag(), 500);
        assert_eq!(info(0, 400, 500).lag(), 100);
        assert_eq!(info(450, 400, 500).lag(), 50);
        assert_eq!(info(500, 400, 500).lag(), 0);
        assert_eq!(info(600, 0, 500).lag(), 0, "never negative");
    }
}

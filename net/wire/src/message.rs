//! Requests, responses, their opcodes and body encodings.

use bytes::{BufMut, BytesMut};

use crate::codec::{
    put_opt, put_opt_str, put_opt_u32, put_opt_u64, put_str, put_wire_vec, Reader, Wire, BLOB, STR,
    U64, VEC,
};
use crate::error::{DecodeError, WireError};
use crate::publish::{PublishRecords, RecordView};
use crate::types::{
    get_strings, get_u64s, put_strings, put_u64s, AckMode, ClusterInfo, DeadLetterInfo, GroupInfo,
    GroupKey, GroupMemberRef, GroupRecord, PublishTarget, Record, RecordIn, ReplicaInfo, ShardInfo,
    StartPosition, StreamInfo, StreamRef,
};

type Result<T> = std::result::Result<T, DecodeError>;

/// A field added at the end of a message after it first shipped: absent
/// when nothing is left, else a `u64` that is never 0.
fn trailing_u64(r: &mut Reader, what: &'static str) -> Result<Option<u64>> {
    if r.remaining() == 0 {
        return Ok(None);
    }
    match r.u64(what)? {
        0 => Err(DecodeError::BadValue { what }),
        v => Ok(Some(v)),
    }
}

/// Stable opcode numbers. Request and response opcodes are separate
/// namespaces (the frame kind says which applies). Never renumber; new
/// messages take new numbers.
pub mod opcodes {
    /// Request opcodes, grouped by area in the high nibble.
    pub mod request {
        pub const HELLO: u8 = 0x01;
        pub const PING: u8 = 0x02;

        pub const CREATE_STREAM: u8 = 0x10;
        pub const DESCRIBE_STREAM: u8 = 0x11;
        pub const LIST_STREAMS: u8 = 0x12;
        pub const DELETE_STREAM: u8 = 0x13;
        pub const DESCRIBE_SHARD: u8 = 0x14;
        pub const DESCRIBE_REPLICA: u8 = 0x15;
        pub const DESCRIBE_CLUSTER: u8 = 0x16;

        pub const PUBLISH: u8 = 0x20;
        pub const READ: u8 = 0x21;

        pub const GROUP_POLL: u8 = 0x30;
        pub const GROUP_ACK: u8 = 0x31;
        pub const GROUP_NACK: u8 = 0x32;
        pub const GROUP_EXTEND: u8 = 0x33;
        pub const GROUP_DEAD_LETTER: u8 = 0x34;
        pub const GROUP_DEAD_LETTERS: u8 = 0x35;
        pub const GROUP_REDRIVE: u8 = 0x36;
        pub const GROUP_DISCARD: u8 = 0x37;
        pub const GROUP_DEAD_LETTERS_PAGE: u8 = 0x38;

        pub const GROUP_CREATE: u8 = 0x40;
        pub const GROUP_SEEK: u8 = 0x41;
        pub const GROUP_DESCRIBE: u8 = 0x42;
        pub const GROUP_DELETE: u8 = 0x43;
        pub const LIST_GROUPS: u8 = 0x44;
    }

    /// Response opcodes: each response variant has its own, so a response
    /// decodes without knowing which request it answers.
    pub mod response {
        pub const HELLO_OK: u8 = 0x01;
        pub const PONG: u8 = 0x02;
        pub const OK: u8 = 0x03;

        pub const STREAM: u8 = 0x10;
        pub const STREAMS: u8 = 0x11;
        pub const SHARD: u8 = 0x12;
        pub const REPLICA: u8 = 0x13;
        pub const CLUSTER: u8 = 0x14;

        pub const PUBLISHED: u8 = 0x20;
        pub const RECORDS: u8 = 0x21;

        pub const GROUP_RECORDS: u8 = 0x30;
        pub const EXTENDED: u8 = 0x31;
        pub const DEAD_LETTERS: u8 = 0x32;
        pub const DEAD_LETTER_PAGE: u8 = 0x33;

        pub const GROUP: u8 = 0x40;
        pub const GROUPS: u8 = 0x41;

        pub const ERROR: u8 = 0xFF;
    }
}

use opcodes::request as rq;
use opcodes::response as rs;

/// A client-to-broker message. Which requests a broker honours depends on
/// the feature bits it returned in [`Response::HelloOk`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First request on a connection: version and feature negotiation,
    /// optional authentication and, with `want_core`, a request to be served
    /// by a particular core.
    Hello {
        version: u16,
        features: u64,
        want_core: Option<u32>,
        client_name: String,
        token: Option<String>,
    },
    CreateStream {
        stream: StreamRef,
        shards: u32,
        retention_bytes: Option<u64>,
        retention_ms: Option<u64>,
        /// In a cluster: the stream's incarnation, the same on every broker
        /// (never 0). A trailing field, sent only when set, which needs
        /// [`FEATURE_STREAM_INCARNATION`](crate::FEATURE_STREAM_INCARNATION).
        incarnation: Option<u64>,
    },
    DescribeStream {
        stream: StreamRef,
    },
    /// All streams, or those of one tenant.
    ListStreams {
        tenant: Option<String>,
    },
    DeleteStream {
        stream: StreamRef,
    },
    DescribeShard {
        stream: StreamRef,
        shard: u32,
    },
    /// The answering broker's replica of a shard: its role, term, leader
    /// and indices. Needs
    /// [`FEATURE_REPLICA_INFO`](crate::FEATURE_REPLICA_INFO) (a broker in a
    /// cluster).
    DescribeReplica {
        stream: StreamRef,
        shard: u32,
    },
    Publish {
        stream: StreamRef,
        target: PublishTarget,
        ack: AckMode,
        records: PublishRecords,
    },
    /// Plain offset read; `wait_ms > 0` long-polls for new records.
    Read {
        stream: StreamRef,
        shard: u32,
        from: StartPosition,
        max_records: u32,
        max_bytes: u32,
        wait_ms: u32,
    },
    GroupPoll {
        key: GroupKey,
        max_records: u32,
        wait_ms: u32,
        member: Option<GroupMemberRef>,
        visibility_ms: Option<u64>,
    },
    GroupAck {
        key: GroupKey,
        offsets: Vec<u64>,
    },
    GroupNack {
        key: GroupKey,
        offset: u64,
        attempts: u32,
        delay_ms: Option<u64>,
        reason: Option<String>,
    },
    GroupExtend {
        key: GroupKey,
        offset: u64,
        attempts: u32,
        extend_ms: u64,
    },
    GroupDeadLetter {
        key: GroupKey,
        offset: u64,
        attempts: u32,
        reason: Option<String>,
    },
    /// The whole dead-letter list in one answer. A broker refuses it with
    /// `too_large` when the list would not fit in one frame; page with
    /// [`GroupDeadLettersPage`](Request::GroupDeadLettersPage) instead.
    GroupDeadLetters {
        key: GroupKey,
    },
    /// One page of the dead-letter list: the dead letters at offsets
    /// `from` and above, in offset order, at most `max` of them (the broker
    /// caps it further). Needs
    /// [`FEATURE_GROUP_DEAD_LETTER_PAGES`](crate::FEATURE_GROUP_DEAD_LETTER_PAGES).
    GroupDeadLettersPage {
        key: GroupKey,
        from: u64,
        max: u32,
    },
    GroupRedrive {
        key: GroupKey,
        offset: u64,
    },
    GroupDiscard {
        key: GroupKey,
        offset: u64,
    },
    GroupCreate {
        key: GroupKey,
        start: StartPosition,
    },
    GroupSeek {
        key: GroupKey,
        start: StartPosition,
    },
    GroupDescribe {
        key: GroupKey,
    },
    GroupDelete {
        key: GroupKey,
    },
    ListGroups {
        stream: StreamRef,
        shard: u32,
    },
    /// Every broker of the answering broker's cluster, with the address
    /// clients reach it at. Needs
    /// [`FEATURE_CLUSTER_INFO`](crate::FEATURE_CLUSTER_INFO) (a broker in a
    /// cluster).
    DescribeCluster,
    Ping,
}

/// Every request opcode with its name, in opcode order.
const REQUEST_NAMES: [(u8, &str); 25] = [
    (rq::HELLO, "hello"),
    (rq::PING, "ping"),
    (rq::CREATE_STREAM, "create_stream"),
    (rq::DESCRIBE_STREAM, "describe_stream"),
    (rq::LIST_STREAMS, "list_streams"),
    (rq::DELETE_STREAM, "delete_stream"),
    (rq::DESCRIBE_SHARD, "describe_shard"),
    (rq::DESCRIBE_REPLICA, "describe_replica"),
    (rq::DESCRIBE_CLUSTER, "describe_cluster"),
    (rq::PUBLISH, "publish"),
    (rq::READ, "read"),
    (rq::GROUP_POLL, "group_poll"),
    (rq::GROUP_ACK, "group_ack"),
    (rq::GROUP_NACK, "group_nack"),
    (rq::GROUP_EXTEND, "group_extend"),
    (rq::GROUP_DEAD_LETTER, "group_dead_letter"),
    (rq::GROUP_DEAD_LETTERS, "group_dead_letters"),
    (rq::GROUP_REDRIVE, "group_redrive"),
    (rq::GROUP_DISCARD, "group_discard"),
    (rq::GROUP_DEAD_LETTERS_PAGE, "group_dead_letters_page"),
    (rq::GROUP_CREATE, "group_create"),
    (rq::GROUP_SEEK, "group_seek"),
    (rq::GROUP_DESCRIBE, "group_describe"),
    (rq::GROUP_DELETE, "group_delete"),
    (rq::LIST_GROUPS, "list_groups"),
];

impl Request {
    /// Every request opcode, in numeric order.
    pub fn all_opcodes() -> impl Iterator<Item = u8> {
        REQUEST_NAMES.iter().map(|(op, _)| *op)
    }

    /// The snake_case name of the request with this opcode, for logging a
    /// frame whose body did not decode.
    pub fn name_of(opcode: u8) -> Option<&'static str> {
        REQUEST_NAMES
            .iter()
            .find(|(op, _)| *op == opcode)
            .map(|(_, n)| *n)
    }

    pub fn opcode(&self) -> u8 {
        match self {
            Request::Hello { .. } => rq::HELLO,
            Request::CreateStream { .. } => rq::CREATE_STREAM,
            Request::DescribeStream { .. } => rq::DESCRIBE_STREAM,
            Request::ListStreams { .. } => rq::LIST_STREAMS,
            Request::DeleteStream { .. } => rq::DELETE_STREAM,
            Request::DescribeShard { .. } => rq::DESCRIBE_SHARD,
            Request::DescribeReplica { .. } => rq::DESCRIBE_REPLICA,
            Request::DescribeCluster => rq::DESCRIBE_CLUSTER,
            Request::Publish { .. } => rq::PUBLISH,
            Request::Read { .. } => rq::READ,
            Request::GroupPoll { .. } => rq::GROUP_POLL,
            Request::GroupAck { .. } => rq::GROUP_ACK,
            Request::GroupNack { .. } => rq::GROUP_NACK,
            Request::GroupExtend { .. } => rq::GROUP_EXTEND,
            Request::GroupDeadLetter { .. } => rq::GROUP_DEAD_LETTER,
            Request::GroupDeadLetters { .. } => rq::GROUP_DEAD_LETTERS,
            Request::GroupRedrive { .. } => rq::GROUP_REDRIVE,
            Request::GroupDiscard { .. } => rq::GROUP_DISCARD,
            Request::GroupDeadLettersPage { .. } => rq::GROUP_DEAD_LETTERS_PAGE,
            Request::GroupCreate { .. } => rq::GROUP_CREATE,
            Request::GroupSeek { .. } => rq::GROUP_SEEK,
            Request::GroupDescribe { .. } => rq::GROUP_DESCRIBE,
            Request::GroupDelete { .. } => rq::GROUP_DELETE,
            Request::ListGroups { .. } => rq::LIST_GROUPS,
            Request::Ping => rq::PING,
        }
    }

    /// The feature bits a broker must have advertised for this request, as
    /// sent, to be understood: the table in the wire-protocol doc. A client
    /// checks it against the connection the request goes on, never sending
    /// a field the broker did not advertise.
    pub fn required_features(&self) -> u64 {
        use crate::{
            FEATURE_CLUSTER_INFO as CLUSTER, FEATURE_GROUPS as G, FEATURE_GROUP_ADMIN as ADMIN,
            FEATURE_GROUP_CLAIM_CONTROL as CC, FEATURE_GROUP_DEAD_LETTER_PAGES as PAGES,
            FEATURE_PUBLISH_ACK_MODE as ACK, FEATURE_REPLICA_INFO as REPLICA,
            FEATURE_STREAM_INCARNATION as INCARNATION,
        };
        match self {
            Request::Publish { ack, .. } if *ack != AckMode::Default => ACK,
            Request::DescribeReplica { .. } => REPLICA,
            Request::DescribeCluster => CLUSTER,
            Request::CreateStream {
                incarnation: Some(_),
                ..
            } => INCARNATION,
            Request::GroupPoll { visibility_ms, .. } => {
                G | if visibility_ms.is_some() { CC } else { 0 }
            }
            Request::GroupNack { delay_ms, .. } => G | if delay_ms.is_some() { CC } else { 0 },
            Request::GroupExtend { .. } | Request::GroupDeadLetter { .. } => G | CC,
            Request::GroupDeadLettersPage { .. } => G | PAGES,
            Request::GroupCreate { .. }
            | Request::GroupSeek { .. }
            | Request::GroupDescribe { .. }
            | Request::GroupDelete { .. } => G | ADMIN,
            Request::GroupAck { .. }
            | Request::GroupDeadLetters { .. }
            | Request::GroupRedrive { .. }
            | Request::GroupDiscard { .. }
            | Request::ListGroups { .. } => G,
            _ => 0,
        }
    }

    /// snake_case name for metrics labels and logs, e.g. `"group_poll"`.
    pub fn name(&self) -> &'static str {
        // Every opcode() value is in REQUEST_NAMES (checked by a unit test).
        Request::name_of(self.opcode()).unwrap_or("unknown")
    }

    /// Bytes to reserve before [`encode_request`](crate::encode_request)
    /// encodes this request: at least its frame's size for a publish (so a
    /// large batch is encoded without growing the buffer, which copies what
    /// it holds each time), a small guess for everything else.
    pub fn frame_size_hint(&self) -> usize {
        const SMALL: usize = 256;
        match self {
            Request::Publish {
                stream, records, ..
            } => {
                let per_record = |r: RecordView| {
                    RecordIn::MIN_BYTES
                        + U64
                        + r.key.map_or(0, |_| BLOB)
                        + r.headers.len() * (STR + BLOB)
                        + r.carried_bytes()
                };
                SMALL
                    + stream.tenant.len()
                    + stream.namespace.len()
                    + stream.stream.len()
                    + records.iter().map(per_record).sum::<usize>()
            }
            _ => SMALL,
        }
    }

    /// Memory a request holds besides its frame's bytes: the vectors a
    /// decoder builds (offsets of an ack), or a producer's owned records. A
    /// decoded publish holds none but its stream's names (its records are
    /// a checked view of the frame), so a frame of empty records or short
    /// headers costs what it is; a broker that bounds what requests in flight hold counts this
    /// too, not the frame's length alone.
    pub fn decoded_overhead(&self) -> usize {
        use std::mem::size_of;
        match self {
            Request::Publish { records, .. } => records.overhead(),
            Request::GroupAck { offsets, .. } => offsets.capacity() * size_of::<u64>(),
            _ => 0,
        }
    }

    pub(crate) fn encode_body(&self, out: &mut BytesMut) {
        match self {
            Request::Hello {
                version,
                features,
                want_core,
                client_name,
                token,
            } => {
                out.put_u16_le(*version);
                out.put_u64_le(*features);
                put_opt_u32(out, *want_core);
                put_str(out, client_name);
                put_opt_str(out, token.as_ref());
            }
            Request::CreateStream {
                stream,
                shards,
                retention_bytes,
                retention_ms,
                incarnation,
            } => {
                stream.put(out);
                out.put_u32_le(*shards);
                put_opt_u64(out, *retention_bytes);
                put_opt_u64(out, *retention_ms);
                if let Some(i) = incarnation {
                    out.put_u64_le(*i);
                }
            }
            Request::DescribeStream { stream } | Request::DeleteStream { stream } => {
                stream.put(out);
            }
            Request::ListStreams { tenant } => put_opt_str(out, tenant.as_ref()),
            Request::DescribeShard { stream, shard }
            | Request::DescribeReplica { stream, shard }
            | Request::ListGroups { stream, shard } => {
                stream.put(out);
                out.put_u32_le(*shard);
            }
            Request::Publish {
                stream,
                target,
                ack,
                records,
            } => {
                stream.put(out);
                target.put(out);
                ack.put(out);
                records.put(out);
            }
            Request::Read {
                stream,
                shard,
                from,
                max_records,
                max_bytes,
                wait_ms,
            } => {
                stream.put(out);
                out.put_u32_le(*shard);
                from.put(out);
                out.put_u32_le(*max_records);
                out.put_u32_le(*max_bytes);
                out.put_u32_le(*wait_ms);
            }
            Request::GroupPoll {
                key,
                max_records,
                wait_ms,
                member,
                visibility_ms,
            } => {
                key.put(out);
                out.put_u32_le(*max_records);
                out.put_u32_le(*wait_ms);
                put_opt(out, member.as_ref(), |o, m| m.put(o));
                put_opt_u64(out, *visibility_ms);
            }
            Request::GroupAck { key, offsets } => {
                key.put(out);
                put_u64s(out, offsets);
            }
            Request::GroupNack {
                key,
                offset,
                attempts,
                delay_ms,
                reason,
            } => {
                key.put(out);
                out.put_u64_le(*offset);
                out.put_u32_le(*attempts);
                put_opt_u64(out, *delay_ms);
                put_opt_str(out, reason.as_ref());
            }
            Request::GroupExtend {
                key,
                offset,
                attempts,
                extend_ms,
            } => {
                key.put(out);
                out.put_u64_le(*offset);
                out.put_u32_le(*attempts);
                out.put_u64_le(*extend_ms);
            }
            Request::GroupDeadLetter {
                key,
                offset,
                attempts,
                reason,
            } => {
                key.put(out);
                out.put_u64_le(*offset);
                out.put_u32_le(*attempts);
                put_opt_str(out, reason.as_ref());
            }
            Request::GroupDeadLetters { key }
            | Request::GroupDescribe { key }
            | Request::GroupDelete { key } => key.put(out),
            Request::GroupRedrive { key, offset } | Request::GroupDiscard { key, offset } => {
                key.put(out);
                out.put_u64_le(*offset);
            }
            Request::GroupDeadLettersPage { key, from, max } => {
                key.put(out);
                out.put_u64_le(*from);
                out.put_u32_le(*max);
            }
            Request::GroupCreate { key, start } | Request::GroupSeek { key, start } => {
                key.put(out);
                start.put(out);
            }
            Request::Ping | Request::DescribeCluster => {}
        }
    }

    /// Decode a body; the caller checks that nothing is left over.
    pub(crate) fn decode_body(opcode: u8, r: &mut Reader) -> Result<Request> {
        Ok(match opcode {
            rq::HELLO => Request::Hello {
                version: r.u16("version")?,
                features: r.u64("features")?,
                want_core: r.opt_u32("want_core")?,
                client_name: r.string("client_name")?,
                token: r.opt_string("token")?,
            },
            rq::CREATE_STREAM => Request::CreateStream {
                stream: StreamRef::get(r)?,
                shards: r.u32("shards")?,
                retention_bytes: r.opt_u64("retention_bytes")?,
                retention_ms: r.opt_u64("retention_ms")?,
                incarnation: trailing_u64(r, "incarnation")?,
            },
            rq::DESCRIBE_STREAM => Request::DescribeStream {
                stream: StreamRef::get(r)?,
            },
            rq::LIST_STREAMS => Request::ListStreams {
                tenant: r.opt_string("tenant")?,
            },
            rq::DELETE_STREAM => Request::DeleteStream {
                stream: StreamRef::get(r)?,
            },
            rq::DESCRIBE_SHARD => Request::DescribeShard {
                stream: StreamRef::get(r)?,
                shard: r.u32("shard")?,
            },
            rq::DESCRIBE_REPLICA => Request::DescribeReplica {
                stream: StreamRef::get(r)?,
                shard: r.u32("shard")?,
            },
            rq::PUBLISH => Request::Publish {
                stream: StreamRef::get(r)?,
                target: PublishTarget::get(r)?,
                ack: AckMode::get(r)?,
                records: PublishRecords::get(r)?,
            },
            rq::READ => Request::Read {
                stream: StreamRef::get(r)?,
                shard: r.u32("shard")?,
                from: StartPosition::get(r)?,
                max_records: r.u32("max_records")?,
                max_bytes: r.u32("max_bytes")?,
                wait_ms: r.u32("wait_ms")?,
            },
            rq::GROUP_POLL => Request::GroupPoll {
                key: GroupKey::get(r)?,
                max_records: r.u32("max_records")?,
                wait_ms: r.u32("wait_ms")?,
                member: r.opt("member", GroupMemberRef::get)?,
                visibility_ms: r.opt_u64("visibility_ms")?,
            },
            rq::GROUP_ACK => Request::GroupAck {
                key: GroupKey::get(r)?,
                offsets: get_u64s(r, "offsets")?,
            },
            rq::GROUP_NACK => Request::GroupNack {
                key: GroupKey::get(r)?,
                offset: r.u64("offset")?,
                attempts: r.u32("attempts")?,
                delay_ms: r.opt_u64("delay_ms")?,
                reason: r.opt_string("reason")?,
            },
            rq::GROUP_EXTEND => Request::GroupExtend {
                key: GroupKey::get(r)?,
                offset: r.u64("offset")?,
                attempts: r.u32("attempts")?,
                extend_ms: r.u64("extend_ms")?,
            },
            rq::GROUP_DEAD_LETTER => Request::GroupDeadLetter {
                key: GroupKey::get(r)?,
                offset: r.u64("offset")?,
                attempts: r.u32("attempts")?,
                reason: r.opt_string("reason")?,
            },
            rq::GROUP_DEAD_LETTERS => Request::GroupDeadLetters {
                key: GroupKey::get(r)?,
            },
            rq::GROUP_REDRIVE => Request::GroupRedrive {
                key: GroupKey::get(r)?,
                offset: r.u64("offset")?,
            },
            rq::GROUP_DISCARD => Request::GroupDiscard {
                key: GroupKey::get(r)?,
                offset: r.u64("offset")?,
            },
            rq::GROUP_DEAD_LETTERS_PAGE => Request::GroupDeadLettersPage {
                key: GroupKey::get(r)?,
                from: r.u64("from")?,
                max: r.u32("max")?,
            },
            rq::GROUP_CREATE => Request::GroupCreate {
                key: GroupKey::get(r)?,
                start: StartPosition::get(r)?,
            },
            rq::GROUP_SEEK => Request::GroupSeek {
                key: GroupKey::get(r)?,
                start: StartPosition::get(r)?,
            },
            rq::GROUP_DESCRIBE => Request::GroupDescribe {
                key: GroupKey::get(r)?,
            },
            rq::GROUP_DELETE => Request::GroupDelete {
                key: GroupKey::get(r)?,
            },
            rq::LIST_GROUPS => Request::ListGroups {
                stream: StreamRef::get(r)?,
                shard: r.u32("shard")?,
            },
            rq::PING => Request::Ping,
            rq::DESCRIBE_CLUSTER => Request::DescribeCluster,
            other => return Err(DecodeError::UnknownOpcode(other)),
        })
    }
}

/// A broker-to-client message, answering the request with the same id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// Answer to `Hello`: the version and features the connection will use
    /// (the broker's, intersected with the client's) and the limits the
    /// client must respect.
    HelloOk {
        version: u16,
        features: u64,
        /// Number of cores (shard owners) in the broker.
        cores: u32,
        /// The core serving this connection.
        core: u32,
        max_frame_bytes: u32,
        /// Broker name and version, for logs.
        broker: String,
    },
    /// Success with nothing to report.
    Ok,
    Stream(StreamInfo),
    Streams(Vec<StreamInfo>),
    Shard(ShardInfo),
    /// Answer to `DescribeReplica`.
    Replica(Box<ReplicaInfo>),
    /// Answer to `DescribeCluster`.
    Cluster(ClusterInfo),
    /// Records `base_offset .. base_offset + count` were written to `shard`.
    Published {
        shard: u32,
        base_offset: u64,
        count: u32,
    },
    /// `next_offset` is where the following read should start;
    /// `start_offset`/`end_offset` bound the shard's retained log.
    Records {
        start_offset: u64,
        next_offset: u64,
        end_offset: u64,
        records: Vec<Record>,
    },
    GroupRecords {
        records: Vec<GroupRecord>,
    },
    /// How long the claim now stands, in milliseconds from when the broker
    /// answered (the guide: `group_extend` returns how long the claim stands).
    Extended {
        stands_ms: u64,
    },
    DeadLetters(Vec<DeadLetterInfo>),
    /// Answer to `GroupDeadLettersPage`: dead letters in offset order, and
    /// the `from` of the following page (`None`: the list ends here).
    DeadLetterPage {
        letters: Vec<DeadLetterInfo>,
        next: Option<u64>,
    },
    Group(GroupInfo),
    Groups(Vec<String>),
    Pong,
    Error(WireError),
}

impl Response {
    /// Bytes of a `Records` answer's body besides its records (the three
    /// offsets and the record count).
    pub const RECORDS_FIXED_BYTES: usize = 3 * U64 + VEC;
    /// Bytes of a `GroupRecords` answer's body besides its records.
    pub const GROUP_RECORDS_FIXED_BYTES: usize = VEC;

    pub fn opcode(&self) -> u8 {
        match self {
            Response::HelloOk { .. } => rs::HELLO_OK,
            Response::Ok => rs::OK,
            Response::Stream(_) => rs::STREAM,
            Response::Streams(_) => rs::STREAMS,
            Response::Shard(_) => rs::SHARD,
            Response::Replica(_) => rs::REPLICA,
            Response::Cluster(_) => rs::CLUSTER,
            Response::Published { .. } => rs::PUBLISHED,
            Response::Records { .. } => rs::RECORDS,
            Response::GroupRecords { .. } => rs::GROUP_RECORDS,
            Response::Extended { .. } => rs::EXTENDED,
            Response::DeadLetters(_) => rs::DEAD_LETTERS,
            Response::DeadLetterPage { .. } => rs::DEAD_LETTER_PAGE,
            Response::Group(_) => rs::GROUP,
            Response::Groups(_) => rs::GROUPS,
            Response::Pong => rs::PONG,
            Response::Error(_) => rs::ERROR,
        }
    }

    /// snake_case name for logs, e.g. `"group_records"`.
    pub fn name(&self) -> &'static str {
        match self {
            Response::HelloOk { .. } => "hello_ok",
            Response::Ok => "ok",
            Response::Stream(_) => "stream",
            Response::Streams(_) => "streams",
            Response::Shard(_) => "shard",
            Response::Replica(_) => "replica",
            Response::Cluster(_) => "cluster",
            Response::Published { .. } => "published",
            Response::Records { .. } => "records",
            Response::GroupRecords { .. } => "group_records",
            Response::Extended { .. } => "extended",
            Response::DeadLetters(_) => "dead_letters",
            Response::DeadLetterPage { .. } => "dead_letter_page",
            Response::Group(_) => "group",
            Response::Groups(_) => "groups",
            Response::Pong => "pong",
            Response::Error(_) => "error",
        }
    }

    pub(crate) fn encode_body(&self, out: &mut BytesMut) {
        match self {
            Response::HelloOk {
                version,
                features,
                cores,
                core,
                max_frame_bytes,
                broker,
            } => {
                out.put_u16_le(*version);
                out.put_u64_le(*features);
                out.put_u32_le(*cores);
                out.put_u32_le(*core);
                out.put_u32_le(*max_frame_bytes);
                put_str(out, broker);
            }
            Response::Ok | Response::Pong => {}
            Response::Stream(info) => {
                info.put(out);
                // Trailing, so a `Stream` without it reads as before; a
                // list's entries never carry it.
                if let Some(i) = info.incarnation {
                    out.put_u64_le(i);
                }
            }
            Response::Streams(infos) => put_wire_vec(out, infos),
            Response::Shard(info) => info.put(out),
            Response::Replica(info) => info.put(out),
            Response::Cluster(info) => info.put(out),
            Response::Published {
                shard,
                base_offset,
                count,
            } => {
                out.put_u32_le(*shard);
                out.put_u64_le(*base_offset);
                out.put_u32_le(*count);
            }
            Response::Records {
                start_offset,
                next_offset,
                end_offset,
                records,
            } => {
                out.put_u64_le(*start_offset);
                out.put_u64_le(*next_offset);
                out.put_u64_le(*end_offset);
                put_wire_vec(out, records);
            }
            Response::GroupRecords { records } => put_wire_vec(out, records),
            Response::Extended { stands_ms } => out.put_u64_le(*stands_ms),
            Response::DeadLetters(v) => put_wire_vec(out, v),
            Response::DeadLetterPage { letters, next } => {
                put_wire_vec(out, letters);
                put_opt_u64(out, *next);
            }
            Response::Group(info) => info.put(out),
            Response::Groups(names) => put_strings(out, names),
            Response::Error(e) => e.put(out),
        }
    }

    /// Decode a body; the caller checks that nothing is left over.
    pub(crate) fn decode_body(opcode: u8, r: &mut Reader) -> Result<Response> {
        Ok(match opcode {
            rs::HELLO_OK => Response::HelloOk {
                version: r.u16("version")?,
                features: r.u64("features")?,
                cores: r.u32("cores")?,
                core: r.u32("core")?,
                max_frame_bytes: r.u32("max_frame_bytes")?,
                broker: r.string("broker")?,
            },
            rs::OK => Response::Ok,
            rs::STREAM => {
                let mut info = StreamInfo::get(r)?;
                info.incarnation = trailing_u64(r, "incarnation")?;
                Response::Stream(info)
            }
            rs::STREAMS => Response::Streams(r.wire_vec("streams")?),
            rs::SHARD => Response::Shard(ShardInfo::get(r)?),
            rs::REPLICA => Response::Replica(Box::new(ReplicaInfo::get(r)?)),
            rs::CLUSTER => Response::Cluster(ClusterInfo::get(r)?),
            rs::PUBLISHED => Response::Published {
                shard: r.u32("shard")?,
                base_offset: r.u64("base_offset")?,
                count: r.u32("count")?,
            },
            rs::RECORDS => Response::Records {
                start_offset: r.u64("start_offset")?,
                next_offset: r.u64("next_offset")?,
                end_offset: r.u64("end_offset")?,
                records: r.wire_vec("records")?,
            },
            rs::GROUP_RECORDS => Response::GroupRecords {
                records: r.wire_vec("records")?,
            },
            rs::EXTENDED => Response::Extended {
                stands_ms: r.u64("stands_ms")?,
            },
            rs::DEAD_LETTERS => Response::DeadLetters(r.wire_vec("dead letters")?),
            rs::DEAD_LETTER_PAGE => Response::DeadLetterPage {
                letters: r.wire_vec("dead letters")?,
                next: r.opt_u64("next")?,
            },
            rs::GROUP => Response::Group(GroupInfo::get(r)?),
            rs::GROUPS => Response::Groups(get_strings(r, "group names")?),
            rs::PONG => Response::Pong,
            rs::ERROR => Response::Error(WireError::get(r)?),
            other => return Err(DecodeError::UnknownOpcode(other)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feature_names_spell_out_the_bits() {
        use crate::{feature_names, FEATURE_GROUPS, FEATURE_GROUP_ADMIN};
        assert_eq!(feature_names(0), "");
        assert_eq!(
            feature_names(FEATURE_GROUPS | FEATURE_GROUP_ADMIN),
            "FEATURE_GROUPS | FEATURE_GROUP_ADMIN"
        );
        assert_eq!(
            feature_names(FEATURE_GROUPS | 1 << 40),
            "FEATURE_GROUPS | 0x10000000000"
        );
    }

    /// The stream incarnation is a trailing field: a message without it
    /// reads as it always did, one with it needs the feature, 0 is not
    /// one, and a list's entries never carry it.
    #[test]
    fn an_incarnation_trails_and_is_never_zero() {
        use crate::{decode_request, decode_response, encode_request, encode_response};
        let stream = StreamRef {
            tenant: "t".into(),
            namespace: "n".into(),
            stream: "s".into(),
        };
        let create = |incarnation| Request::CreateStream {
            stream: stream.clone(),
            shards: 1,
            retention_bytes: None,
            retention_ms: None,
            incarnation,
        };
        let frame = |req: &Request| {
            let mut out = BytesMut::new();
            encode_request(7, req, &mut out);
            out
        };
        let (plain, with) = (frame(&create(None)), frame(&create(Some(9))));
        assert_eq!(with.len(), plain.len() + 8);
        for (mut f, want) in [(plain.clone(), create(None)), (with, create(Some(9)))] {
            assert_eq!(decode_request(&mut f, 1 << 20).unwrap(), Some((7, want)));
        }
        assert_eq!(create(None).required_features(), 0);
        assert_eq!(
            create(Some(9)).required_features(),
            crate::FEATURE_STREAM_INCARNATION
        );
        // A zero written where the field goes.
        let mut zero = plain.clone();
        zero.extend_from_slice(&0u64.to_le_bytes());
        let len = (zero.len() - 4) as u32;
        zero[..4].copy_from_slice(&len.to_le_bytes());
        assert!(decode_request(&mut zero, 1 << 20).is_err());
        // Half a field is cut short.
        let mut half = plain;
        half.extend_from_slice(&[1, 2, 3]);
        let len = (half.len() - 4) as u32;
        half[..4].copy_from_slice(&len.to_le_bytes());
        assert!(decode_request(&mut half, 1 << 20).is_err());

        let info = StreamInfo {
            stream: stream.clone(),
            shards: 1,
            retention_bytes: None,
            retention_ms: None,
            placement: vec![0],
            incarnation: Some(5),
        };
        let mut out = BytesMut::new();
        encode_response(3, &Response::Stream(info.clone()), &mut out);
        let (_, got) = decode_response(&mut out, 1 << 20).unwrap().unwrap();
        assert_eq!(got, Response::Stream(info.clone()));
        encode_response(3, &Response::Streams(vec![info.clone()]), &mut out);
        let (_, got) = decode_response(&mut out, 1 << 20).unwrap().unwrap();
        let listed = StreamInfo {
            incarnation: None,
            ..info
        };
        assert_eq!(got, Response::Streams(vec![listed]));
    }

    /// `not_applied` trails an error, only when set: an error without it
    /// reads as it always did, one byte 1 sets it, anything else is refused.
    #[test]
    fn not_applied_trails_an_error_only_when_set() {
        use crate::{decode_response, encode_response, ErrorCode};
        let frame = |e: WireError| {
            let mut out = BytesMut::new();
            encode_response(4, &Response::Error(e), &mut out);
            out
        };
        let unknown = WireError::new(ErrorCode::Unavailable, "stopped mid-write");
        let refused = WireError::refused(ErrorCode::Unavailable, "disk nearly full");
        let (plain, with) = (frame(unknown.clone()), frame(refused.clone()));
        assert_eq!(
            with.len(),
            frame(WireError::new(ErrorCode::Unavailable, "disk nearly full")).len() + 1
        );
        for (mut f, want) in [(plain.clone(), unknown), (with, refused)] {
            assert_eq!(
                decode_response(&mut f, 1 << 20).unwrap(),
                Some((4, Response::Error(want)))
            );
        }
        // After a not_leader error's leader too.
        let mut deposed = WireError::not_leader(Some("b:1".into()), "deposed");
        deposed.not_applied = true;
        let mut f = frame(deposed.clone());
        assert_eq!(
            decode_response(&mut f, 1 << 20).unwrap(),
            Some((4, Response::Error(deposed)))
        );
        // Any other byte where the flag goes, or more than one, is refused.
        for tail in [&[0u8][..], &[2], &[1, 1]] {
            let mut bad = plain.clone();
            bad.extend_from_slice(tail);
            let len = (bad.len() - 4) as u32;
            bad[..4].copy_from_slice(&len.to_le_bytes());
            assert!(decode_response(&mut bad, 1 << 20).is_err(), "{tail:?}");
        }
    }

    #[test]
    fn required_features_follow_the_table() {
        use crate::{
            FEATURE_GROUPS as G, FEATURE_GROUP_ADMIN as ADMIN, FEATURE_GROUP_CLAIM_CONTROL as CC,
            FEATURE_GROUP_DEAD_LETTER_PAGES as PAGES, FEATURE_PUBLISH_ACK_MODE as ACK,
        };
        let key = GroupKey {
            stream: StreamRef {
                tenant: "t".into(),
                namespace: "n".into(),
                stream: "s".into(),
            },
            shard: 0,
            group: "g".into(),
        };
        let publish = |ack| Request::Publish {
            stream: key.stream.clone(),
            target: PublishTarget::Shard(0),
            ack,
            records: Vec::new().into(),
        };
        let poll = |visibility_ms| Request::GroupPoll {
            key: key.clone(),
            max_records: 1,
            wait_ms: 0,
            member: None,
            visibility_ms,
        };
        let nack = |delay_ms| Request::GroupNack {
            key: key.clone(),
            offset: 0,
            attempts: 1,
            delay_ms,
            reason: None,
        };
        assert_eq!(Request::Ping.required_features(), 0);
        assert_eq!(publish(AckMode::Default).required_features(), 0);
        assert_eq!(publish(AckMode::Durable).required_features(), ACK);
        assert_eq!(poll(None).required_features(), G);
        assert_eq!(poll(Some(5)).required_features(), G | CC);
        assert_eq!(nack(None).required_features(), G);
        assert_eq!(nack(Some(0)).required_features(), G | CC);
        assert_eq!(
            Request::GroupDescribe { key: key.clone() }.required_features(),
            G | ADMIN
        );
        assert_eq!(
            Request::GroupDeadLettersPage {
                key: key.clone(),
                from: 0,
                max: 1
            }
            .required_features(),
            G | PAGES
        );
        assert_eq!(
            Request::DescribeReplica {
                stream: key.stream.clone(),
                shard: 0
            }
            .required_features(),
            crate::FEATURE_REPLICA_INFO
        );
        assert_eq!(
            Request::DescribeCluster.required_features(),
            crate::FEATURE_CLUSTER_INFO
        );
    }

    #[test]
    fn request_opcodes_are_unique_and_named() {
        let ops: Vec<u8> = Request::all_opcodes().collect();
        let mut sorted = ops.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ops.len(), "duplicate request opcode");
        let mut names: Vec<&str> = REQUEST_NAMES.iter().map(|(_, n)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ops.len(), "duplicate request name");
        // Every opcode decodes to something other than UnknownOpcode, even
        // if the (empty) body is then too short.
        for op in ops {
            let mut r = Reader::new(bytes::Bytes::new());
            let res = Request::decode_body(op, &mut r);
            assert_ne!(res, Err(DecodeError::UnknownOpcode(op)));
        }
    }
}

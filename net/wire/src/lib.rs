//! The Felix wire protocol.
//!
//! This crate owns everything that crosses the socket between a Felix client
//! and a broker: the frame layout, the [`Request`] and [`Response`] messages,
//! [`ErrorCode`]s, feature bits and shared value types such as
//! [`StartPosition`] and [`StreamRef`]. It has no async runtime dependency so
//! the tokio client and the glommio broker can both use it.
//!
//! The byte layout is specified in `docs/internals/wire-protocol.md`; keep
//! that document and the code in step.
//!
//! # Decoding untrusted input
//!
//! [`decode_request`] and [`decode_response`] are written for bytes straight
//! off a socket. They never panic, never loop more than the input allows, and
//! never allocate more than the frame's declared length (itself capped by
//! `max_frame_bytes`): every length and element count is checked against the
//! bytes actually remaining before anything is allocated.

#![forbid(unsafe_code)]

mod codec;
mod error;
mod frame;
mod headers;
mod message;
mod publish;
mod types;

pub use error::{DecodeError, ErrorCode, WireError};
pub use frame::{
    decode_request, decode_response, encode_request, encode_response, peek_header, FrameHeader,
    KIND_REQUEST, KIND_RESPONSE,
};
pub use headers::{Headers, Iter as RecordHeadersIter};
pub use message::{opcodes, Request, Response};
pub use publish::{HeadersIter, HeadersView, PublishRecords, RawHeadersIter, RecordView};
pub use types::{
    shard_for_key, AckMode, ClusterInfo, ClusterMember, DeadLetterInfo, GroupInfo, GroupKey,
    GroupMemberRef, GroupRecord, ParseStreamRefError, PeerProgress, PublishTarget, Record,
    RecordIn, ReplicaInfo, ReplicaRole, ShardInfo, StartPosition, StreamInfo, StreamRef,
};

/// Version of the message layouts described in `wire-protocol.md`.
///
/// Bumped only when an existing message's byte layout changes. Adding
/// behaviour behind a feature bit, a new opcode or a new error code does not
/// bump it.
pub const PROTOCOL_VERSION: u16 = 1;

/// Largest frame (bytes after the length field) either side accepts unless
/// configured otherwise. The broker announces its own limit in
/// [`Response::HelloOk`].
pub const DEFAULT_MAX_FRAME_BYTES: u32 = 16 * 1024 * 1024;

/// Most elements any one list in a message may hold (records in a publish,
/// offsets in an ack, ...). Bounds the memory a decoded frame can take to a
/// small multiple of the frame itself.
pub const MAX_ITEMS_PER_VEC: usize = 100_000;

/// Size of the fixed frame header: `u32 len`, `u8 kind`, `u8 opcode`,
/// `u16 flags`, `u64 request_id`.
pub const FRAME_HEADER_BYTES: usize = 4 + 1 + 1 + 2 + 8;

/// Consumer groups at all. Not advertised by a broker without durable
/// storage, since group positions would not survive a restart.
pub const FEATURE_GROUPS: u64 = 1 << 0;
/// The broker fills [`GroupRecord::skipped_before`]: how many offsets directly
/// below a record were settled and never delivered (control records, or
/// records retention removed before the group reached them).
pub const FEATURE_GROUP_SKIPPED: u64 = 1 << 1;
/// Claim control: `GroupPoll.visibility_ms`, `GroupNack.delay_ms`,
/// `GroupExtend` and consumer-initiated `GroupDeadLetter`.
pub const FEATURE_GROUP_CLAIM_CONTROL: u64 = 1 << 2;
/// Group administration: `GroupCreate`, `GroupSeek`, `GroupDescribe`,
/// `GroupDelete`.
pub const FEATURE_GROUP_ADMIN: u64 = 1 << 3;
/// The broker honours `Publish.ack`; without it every publish gets the
/// broker's default acknowledgement.
pub const FEATURE_PUBLISH_ACK_MODE: u64 = 1 << 4;
/// Paged dead-letter lists: `GroupDeadLettersPage` and its
/// `DeadLetterPage` answer, for lists too long for one frame (the
/// whole-list `GroupDeadLetters` is then refused with `too_large`).
pub const FEATURE_GROUP_DEAD_LETTER_PAGES: u64 = 1 << 5;
/// The broker is in a cluster and answers `DescribeReplica`: its own
/// replica of a shard (role, term, leader, indices).
pub const FEATURE_REPLICA_INFO: u64 = 1 << 6;
/// The broker is in a cluster and keeps a stream's incarnation: the
/// number, the same on every broker, that tells this stream's replicas
/// from those of an earlier stream of the same name
/// (`CreateStream.incarnation`, `StreamInfo.incarnation` in a `Stream`
/// answer).
pub const FEATURE_STREAM_INCARNATION: u64 = 1 << 7;
/// The broker is in a cluster and answers `DescribeCluster`: every broker
/// of the cluster with the address clients reach it at, so a client given
/// one of them finds the others.
pub const FEATURE_CLUSTER_INFO: u64 = 1 << 8;
/// An error may say the request was not applied at all
/// ([`WireError::not_applied`], a trailing field of the error): refused
/// before the broker did anything of it, so sending it again cannot apply
/// it twice. A broker sends the field only on a connection that negotiated
/// this bit.
pub const FEATURE_ERROR_NOT_APPLIED: u64 = 1 << 9;

/// Every feature bit this version of the crate knows about.
pub const FEATURES_ALL: u64 = FEATURE_GROUPS
    | FEATURE_GROUP_SKIPPED
    | FEATURE_GROUP_CLAIM_CONTROL
    | FEATURE_GROUP_ADMIN
    | FEATURE_PUBLISH_ACK_MODE
    | FEATURE_GROUP_DEAD_LETTER_PAGES
    | FEATURE_REPLICA_INFO
    | FEATURE_STREAM_INCARNATION
    | FEATURE_CLUSTER_INFO
    | FEATURE_ERROR_NOT_APPLIED;

/// The names of the feature bits set in `bits` (unknown bits as hex), for
/// messages: `"FEATURE_GROUPS | FEATURE_GROUP_ADMIN"`.
pub fn feature_names(bits: u64) -> String {
    const NAMES: [(u64, &str); 10] = [
        (FEATURE_GROUPS, "FEATURE_GROUPS"),
        (FEATURE_GROUP_SKIPPED, "FEATURE_GROUP_SKIPPED"),
        (FEATURE_GROUP_CLAIM_CONTROL, "FEATURE_GROUP_CLAIM_CONTROL"),
        (FEATURE_GROUP_ADMIN, "FEATURE_GROUP_ADMIN"),
        (FEATURE_PUBLISH_ACK_MODE, "FEATURE_PUBLISH_ACK_MODE"),
        (
            FEATURE_GROUP_DEAD_LETTER_PAGES,
            "FEATURE_GROUP_DEAD_LETTER_PAGES",
        ),
        (FEATURE_REPLICA_INFO, "FEATURE_REPLICA_INFO"),
        (FEATURE_STREAM_INCARNATION, "FEATURE_STREAM_INCARNATION"),
        (FEATURE_CLUSTER_INFO, "FEATURE_CLUSTER_INFO"),
        (FEATURE_ERROR_NOT_APPLIED, "FEATURE_ERROR_NOT_APPLIED"),
    ];
    let mut out: Vec<String> = NAMES
        .iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| n.to_string())
        .collect();
    let unknown = bits & !FEATURES_ALL;
    if unknown != 0 {
        out.push(format!("{unknown:#x}"));
    }
    out.join(" | ")
}

//! proptest strategies for every message, shared by the test binaries.
#![allow(dead_code)]

use bytes::{Bytes, BytesMut};
use felix_wire::*;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::strategy::Union;

/// Short strings, often empty, with some multi-byte characters.
pub fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => Just(String::new()),
        6 => "[a-z0-9._-]{1,12}",
        2 => "\\PC{0,8}",
    ]
}

pub fn blob() -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..24).prop_map(Bytes::from)
}

pub fn stream_ref() -> impl Strategy<Value = StreamRef> {
    (text(), text(), text()).prop_map(|(t, n, s)| StreamRef::new(t, n, s))
}

pub fn group_key() -> impl Strategy<Value = GroupKey> {
    (stream_ref(), any::<u32>(), text()).prop_map(|(stream, shard, group)| GroupKey {
        stream,
        shard,
        group,
    })
}

pub fn start() -> impl Strategy<Value = StartPosition> {
    prop_oneof![
        Just(StartPosition::Earliest),
        Just(StartPosition::Latest),
        any::<u64>().prop_map(StartPosition::Offset),
    ]
}

pub fn headers() -> impl Strategy<Value = Vec<(String, Bytes)>> {
    vec((text(), blob()), 0..3)
}

pub fn record_in() -> impl Strategy<Value = RecordIn> {
    (
        option::of(any::<u64>()),
        option::of(blob()),
        headers(),
        blob(),
    )
        .prop_map(|(timestamp_ms, key, headers, payload)| RecordIn {
            timestamp_ms,
            key,
            headers,
            payload,
        })
}

pub fn record() -> impl Strategy<Value = Record> {
    (
        any::<u64>(),
        any::<u64>(),
        option::of(blob()),
        headers(),
        blob(),
    )
        .prop_map(|(offset, timestamp_ms, key, headers, payload)| Record {
            offset,
            timestamp_ms,
            key,
            headers: headers.into(),
            payload,
        })
}

pub fn group_record() -> impl Strategy<Value = GroupRecord> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        option::of(blob()),
        headers(),
        blob(),
        option::of(any::<u64>()),
    )
        .prop_map(
            |(offset, attempts, timestamp_ms, key, headers, payload, skipped_before)| GroupRecord {
                offset,
                attempts,
                timestamp_ms,
                key,
                headers: headers.into(),
                payload,
                skipped_before,
            },
        )
}

pub fn ack_mode() -> impl Strategy<Value = AckMode> {
    prop_oneof![
        Just(AckMode::Default),
        Just(AckMode::Queued),
        Just(AckMode::Durable)
    ]
}

pub fn publish_target() -> impl Strategy<Value = PublishTarget> {
    prop_oneof![
        any::<u32>().prop_map(PublishTarget::Shard),
        blob().prop_map(PublishTarget::Key),
    ]
}

pub fn member() -> impl Strategy<Value = GroupMemberRef> {
    (text(), any::<bool>()).prop_map(|(name, reclaim)| GroupMemberRef { name, reclaim })
}

pub fn error_code() -> impl Strategy<Value = ErrorCode> {
    proptest::sample::select(ErrorCode::ALL.to_vec())
}

pub fn wire_error() -> impl Strategy<Value = WireError> {
    (
        error_code(),
        text(),
        option::of(any::<u32>()),
        option::of(text()),
        any::<bool>(),
    )
        .prop_map(|(code, message, core, leader, not_applied)| WireError {
            code,
            message,
            core,
            // Only not_leader errors carry one.
            leader: leader.filter(|_| code == ErrorCode::NotLeader),
            not_applied,
        })
}

pub fn stream_info() -> impl Strategy<Value = StreamInfo> {
    (
        stream_ref(),
        any::<u32>(),
        option::of(any::<u64>()),
        option::of(any::<u64>()),
        vec(any::<u32>(), 0..5),
    )
        .prop_map(
            |(stream, shards, retention_bytes, retention_ms, placement)| StreamInfo {
                stream,
                shards,
                retention_bytes,
                retention_ms,
                placement,
                incarnation: None,
            },
        )
}

/// A nonzero incarnation, or none (a trailing field).
fn incarnation() -> impl Strategy<Value = Option<u64>> {
    option::of(1..=u64::MAX)
}

pub fn shard_info() -> impl Strategy<Value = ShardInfo> {
    (
        stream_ref(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        option::of(text()),
    )
        .prop_map(
            |(stream, shard, core, start_offset, end_offset, bytes, segments, stopped)| ShardInfo {
                stream,
                shard,
                core,
                start_offset,
                end_offset,
                bytes,
                segments,
                stopped,
            },
        )
}

pub fn replica_info() -> impl Strategy<Value = ReplicaInfo> {
    let role = prop_oneof![
        Just(ReplicaRole::Leader),
        Just(ReplicaRole::Elected),
        Just(ReplicaRole::Follower),
        Just(ReplicaRole::Electing),
        Just(ReplicaRole::Stopped),
    ];
    let peer =
        (any::<u64>(), any::<u64>()).prop_map(|(node, matched)| PeerProgress { node, matched });
    (
        (stream_ref(), any::<u32>(), any::<u64>(), role, any::<u64>()),
        (option::of(any::<u64>()), option::of(text())),
        any::<[u64; 4]>(),
        option::of(text()),
        vec(peer, 0..4),
    )
        .prop_map(
            |(
                (stream, shard, node, role, term),
                (leader, leader_addr),
                [commit, applied, last_index, compacted],
                stopped,
                peers,
            )| ReplicaInfo {
                stream,
                shard,
                node,
                role,
                term,
                leader,
                leader_addr,
                commit,
                applied,
                last_index,
                compacted,
                stopped,
                peers,
            },
        )
}

pub fn dead_letter() -> impl Strategy<Value = DeadLetterInfo> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        option::of(text()),
        any::<bool>(),
    )
        .prop_map(
            |(offset, attempts, at_ms, reason, by_consumer)| DeadLetterInfo {
                offset,
                attempts,
                at_ms,
                reason,
                by_consumer,
            },
        )
}

pub fn group_info() -> impl Strategy<Value = GroupInfo> {
    (
        text(),
        any::<[u64; 3]>(),
        any::<[u32; 4]>(),
        option::of(any::<u64>()),
        option::of(any::<u64>()),
        option::of(any::<u64>()),
    )
        .prop_map(|(group, [p, e, s], [i, o, d, dl], a, b, c)| GroupInfo {
            group,
            position: p,
            end_offset: e,
            start_offset: s,
            in_flight: i,
            owed: o,
            delayed: d,
            dead_letters: dl,
            oldest_in_flight_age_ms: a,
            oldest_owed_age_ms: b,
            last_active_ms: c,
        })
}

/// Any request, every variant equally likely.
pub fn request() -> impl Strategy<Value = Request> {
    let o64 = || option::of(any::<u64>());
    Union::new(vec![
        (
            any::<u16>(),
            any::<u64>(),
            option::of(any::<u32>()),
            text(),
            option::of(text()),
        )
            .prop_map(
                |(version, features, want_core, client_name, token)| Request::Hello {
                    version,
                    features,
                    want_core,
                    client_name,
                    token,
                },
            )
            .boxed(),
        (stream_ref(), any::<u32>(), o64(), o64(), incarnation())
            .prop_map(
                |(stream, shards, retention_bytes, retention_ms, incarnation)| {
                    Request::CreateStream {
                        stream,
                        shards,
                        retention_bytes,
                        retention_ms,
                        incarnation,
                    }
                },
            )
            .boxed(),
        stream_ref()
            .prop_map(|stream| Request::DescribeStream { stream })
            .boxed(),
        option::of(text())
            .prop_map(|tenant| Request::ListStreams { tenant })
            .boxed(),
        stream_ref()
            .prop_map(|stream| Request::DeleteStream { stream })
            .boxed(),
        (stream_ref(), any::<u32>())
            .prop_map(|(stream, shard)| Request::DescribeShard { stream, shard })
            .boxed(),
        (stream_ref(), any::<u32>())
            .prop_map(|(stream, shard)| Request::DescribeReplica { stream, shard })
            .boxed(),
        (
            stream_ref(),
            publish_target(),
            ack_mode(),
            vec(record_in(), 0..4),
        )
            .prop_map(|(stream, target, ack, records)| Request::Publish {
                stream,
                target,
                ack,
                records: records.into(),
            })
            .boxed(),
        (stream_ref(), any::<u32>(), start(), any::<[u32; 3]>())
            .prop_map(
                |(stream, shard, from, [max_records, max_bytes, wait_ms])| Request::Read {
                    stream,
                    shard,
                    from,
                    max_records,
                    max_bytes,
                    wait_ms,
                },
            )
            .boxed(),
        (
            group_key(),
            any::<u32>(),
            any::<u32>(),
            option::of(member()),
            o64(),
        )
            .prop_map(
                |(key, max_records, wait_ms, member, visibility_ms)| Request::GroupPoll {
                    key,
                    max_records,
                    wait_ms,
                    member,
                    visibility_ms,
                },
            )
            .boxed(),
        (group_key(), vec(any::<u64>(), 0..6))
            .prop_map(|(key, offsets)| Request::GroupAck { key, offsets })
            .boxed(),
        (
            group_key(),
            any::<u64>(),
            any::<u32>(),
            o64(),
            option::of(text()),
        )
            .prop_map(
                |(key, offset, attempts, delay_ms, reason)| Request::GroupNack {
                    key,
                    offset,
                    attempts,
                    delay_ms,
                    reason,
                },
            )
            .boxed(),
        (group_key(), any::<u64>(), any::<u32>(), any::<u64>())
            .prop_map(|(key, offset, attempts, extend_ms)| Request::GroupExtend {
                key,
                offset,
                attempts,
                extend_ms,
            })
            .boxed(),
        (group_key(), any::<u64>(), any::<u32>(), option::of(text()))
            .prop_map(|(key, offset, attempts, reason)| Request::GroupDeadLetter {
                key,
                offset,
                attempts,
                reason,
            })
            .boxed(),
        group_key()
            .prop_map(|key| Request::GroupDeadLetters { key })
            .boxed(),
        (group_key(), any::<u64>())
            .prop_map(|(key, offset)| Request::GroupRedrive { key, offset })
            .boxed(),
        (group_key(), any::<u64>())
            .prop_map(|(key, offset)| Request::GroupDiscard { key, offset })
            .boxed(),
        (group_key(), any::<u64>(), any::<u32>())
            .prop_map(|(key, from, max)| Request::GroupDeadLettersPage { key, from, max })
            .boxed(),
        (group_key(), start())
            .prop_map(|(key, start)| Request::GroupCreate { key, start })
            .boxed(),
        (group_key(), start())
            .prop_map(|(key, start)| Request::GroupSeek { key, start })
            .boxed(),
        group_key()
            .prop_map(|key| Request::GroupDescribe { key })
            .boxed(),
        group_key()
            .prop_map(|key| Request::GroupDelete { key })
            .boxed(),
        (stream_ref(), any::<u32>())
            .prop_map(|(stream, shard)| Request::ListGroups { stream, shard })
            .boxed(),
        Just(Request::Ping).boxed(),
        Just(Request::DescribeCluster).boxed(),
    ])
}

/// Any response, every variant equally likely.
pub fn response() -> impl Strategy<Value = Response> {
    Union::new(vec![
        (any::<u16>(), any::<u64>(), any::<[u32; 3]>(), text())
            .prop_map(
                |(version, features, [cores, core, max_frame_bytes], broker)| Response::HelloOk {
                    version,
                    features,
                    cores,
                    core,
                    max_frame_bytes,
                    broker,
                },
            )
            .boxed(),
        Just(Response::Ok).boxed(),
        (stream_info(), incarnation())
            .prop_map(|(mut info, incarnation)| {
                info.incarnation = incarnation;
                Response::Stream(info)
            })
            .boxed(),
        vec(stream_info(), 0..3).prop_map(Response::Streams).boxed(),
        shard_info().prop_map(Response::Shard).boxed(),
        replica_info()
            .prop_map(|i| Response::Replica(Box::new(i)))
            .boxed(),
        (
            any::<u64>(),
            vec(
                (any::<u64>(), text()).prop_map(|(node, addr)| ClusterMember { node, addr }),
                0..4,
            ),
        )
            .prop_map(|(node, members)| Response::Cluster(ClusterInfo { node, members }))
            .boxed(),
        (any::<u32>(), any::<u64>(), any::<u32>())
            .prop_map(|(shard, base_offset, count)| Response::Published {
                shard,
                base_offset,
                count,
            })
            .boxed(),
        (any::<[u64; 3]>(), vec(record(), 0..4))
            .prop_map(
                |([start_offset, next_offset, end_offset], records)| Response::Records {
                    start_offset,
                    next_offset,
                    end_offset,
                    records,
                },
            )
            .boxed(),
        vec(group_record(), 0..4)
            .prop_map(|records| Response::GroupRecords { records })
            .boxed(),
        any::<u64>()
            .prop_map(|stands_ms| Response::Extended { stands_ms })
            .boxed(),
        vec(dead_letter(), 0..4)
            .prop_map(Response::DeadLetters)
            .boxed(),
        (vec(dead_letter(), 0..4), option::of(any::<u64>()))
            .prop_map(|(letters, next)| Response::DeadLetterPage { letters, next })
            .boxed(),
        group_info().prop_map(Response::Group).boxed(),
        vec(text(), 0..5).prop_map(Response::Groups).boxed(),
        Just(Response::Pong).boxed(),
        wire_error().prop_map(Response::Error).boxed(),
    ])
}

pub fn encode_req(id: u64, req: &Request) -> BytesMut {
    let mut out = BytesMut::new();
    encode_request(id, req, &mut out);
    out
}

pub fn encode_resp(id: u64, resp: &Response) -> BytesMut {
    let mut out = BytesMut::new();
    encode_response(id, resp, &mut out);
    out
}

/// Result of feeding `bytes` to a decoder, reduced to what the invariants
/// talk about.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    NeedMore,
    Decoded { consumed: usize },
    BodyError { consumed: usize },
    Fatal,
}

/// Run a decoder over `bytes` and check the buffer contract:
/// * `Ok(None)` and fatal errors consume nothing;
/// * success and body errors consume exactly the declared frame;
/// * a decoded message re-encodes and decodes to itself.
pub fn check_decoder_contract(bytes: &[u8], max: u32) -> (Outcome, Outcome) {
    (
        check_one(bytes, max, decode_request, |id, m, _| {
            let enc = encode_req(id, m);
            let mut again = enc.clone();
            assert_eq!(
                decode_request(&mut again, u32::MAX).unwrap(),
                Some((id, m.clone()))
            );
            Some(enc)
        }),
        check_one(bytes, max, decode_response, |id, m, frame| {
            let enc = encode_resp(id, m);
            let mut again = enc.clone();
            assert_eq!(
                decode_response(&mut again, u32::MAX).unwrap(),
                Some((id, m.clone()))
            );
            // The one non-canonical case: an error code this crate does not
            // know decodes as `internal` with the number in the message.
            let unknown_code = matches!(m, Response::Error(_))
                && ErrorCode::from_u16(u16::from_le_bytes([frame[16], frame[17]])).is_none();
            (!unknown_code).then_some(enc)
        }),
    )
}

pub type Decoder<T> = fn(&mut BytesMut, u32) -> Result<Option<(u64, T)>, DecodeError>;

fn check_one<T>(
    bytes: &[u8],
    max: u32,
    decode: Decoder<T>,
    reencode: impl Fn(u64, &T, &[u8]) -> Option<BytesMut>,
) -> Outcome {
    let mut buf = BytesMut::from(bytes);
    let declared = bytes
        .get(..4)
        .map(|l| 4 + u32::from_le_bytes(l.try_into().unwrap()) as usize);
    match decode(&mut buf, max) {
        Ok(None) => {
            assert_eq!(&buf[..], bytes, "Ok(None) must not consume");
            Outcome::NeedMore
        }
        Ok(Some((id, msg))) => {
            let consumed = bytes.len() - buf.len();
            assert_eq!(Some(consumed), declared);
            // A frame that decodes is canonical: encoding it gives back the
            // same bytes (there is exactly one encoding of every message).
            if let Some(enc) = reencode(id, &msg, &bytes[..consumed]) {
                assert_eq!(
                    &enc[..],
                    &bytes[..consumed],
                    "non-canonical encoding accepted"
                );
            }
            Outcome::Decoded { consumed }
        }
        Err(e) if e.request_id().is_some() => {
            let consumed = bytes.len() - buf.len();
            assert_eq!(
                Some(consumed),
                declared,
                "body error must consume the frame"
            );
            let _ = e.to_string();
            let _ = e.to_wire_error();
            Outcome::BodyError { consumed }
        }
        Err(e) => {
            assert_eq!(&buf[..], bytes, "fatal error must not consume");
            let _ = e.to_string();
            Outcome::Fatal
        }
    }
}

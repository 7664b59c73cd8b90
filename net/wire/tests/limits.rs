//! Hand-built hostile and edge-case frames, and the small helpers.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use common::*;
use felix_wire::*;

/// Build a frame by hand: header then `body`, length computed.
fn raw_frame(kind: u8, opcode: u8, flags: u16, id: u64, body: &[u8]) -> BytesMut {
    let mut b = BytesMut::new();
    b.put_u32_le((12 + body.len()) as u32);
    b.put_u8(kind);
    b.put_u8(opcode);
    b.put_u16_le(flags);
    b.put_u64_le(id);
    b.put_slice(body);
    b
}

fn stream_body(b: &mut BytesMut) {
    for part in ["t", "n", "s"] {
        b.put_u16_le(part.len() as u16);
        b.put_slice(part.as_bytes());
    }
}

fn group_key_body(b: &mut BytesMut) {
    stream_body(b);
    b.put_u32_le(0); // shard
    b.put_u16_le(1);
    b.put_slice(b"g");
}

fn key() -> GroupKey {
    GroupKey {
        stream: StreamRef::new("t", "n", "s"),
        shard: 0,
        group: "g".into(),
    }
}

/// Expect a body error for request `id`, with the frame consumed.
fn expect_body_error(mut buf: BytesMut, id: u64, reason: DecodeError) {
    let err = decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap_err();
    assert_eq!(err.request_id(), Some(id), "{err}");
    assert_eq!(err.reason(), &reason, "{err}");
    assert!(!err.is_fatal());
    assert!(buf.is_empty(), "frame not consumed");
}

#[test]
fn too_large_is_rejected_from_the_length_alone() {
    let mut buf = BytesMut::with_capacity(8);
    buf.put_u32_le(DEFAULT_MAX_FRAME_BYTES + 1);
    let cap = buf.capacity();
    let err = decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap_err();
    assert_eq!(
        err,
        DecodeError::TooLarge {
            declared: DEFAULT_MAX_FRAME_BYTES + 1,
            max: DEFAULT_MAX_FRAME_BYTES
        }
    );
    assert!(err.is_fatal());
    assert_eq!(err.to_wire_error().code, ErrorCode::TooLarge);
    assert_eq!(buf.len(), 4, "nothing consumed");
    assert_eq!(buf.capacity(), cap, "nothing reserved");

    let mut buf = BytesMut::from(&u32::MAX.to_le_bytes()[..]);
    assert!(matches!(
        decode_response(&mut buf, DEFAULT_MAX_FRAME_BYTES),
        Err(DecodeError::TooLarge { .. })
    ));
}

#[test]
fn exactly_max_is_accepted() {
    let req = Request::ListStreams { tenant: None };
    let mut buf = encode_req(1, &req);
    let len = peek_header(&buf).unwrap().len;
    assert_eq!(
        decode_request(&mut buf.clone(), len).unwrap(),
        Some((1, req))
    );
    assert!(matches!(
        decode_request(&mut buf, len - 1),
        Err(DecodeError::TooLarge { .. })
    ));
}

#[test]
fn length_shorter_than_header_is_fatal() {
    for len in 0..12u32 {
        let mut buf = BytesMut::new();
        buf.put_u32_le(len);
        buf.put_slice(&[0; 32]);
        let err = decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap_err();
        assert_eq!(
            err,
            DecodeError::BadValue {
                what: "frame length"
            }
        );
        assert!(err.is_fatal());
        assert_eq!(buf.len(), 36);
    }
}

#[test]
fn huge_vector_counts_are_errors() {
    // Publish claiming a billion records with ten bytes left.
    let mut body = BytesMut::new();
    stream_body(&mut body);
    body.put_u8(0); // target: shard
    body.put_u32_le(0);
    body.put_u8(0); // ack: default
    body.put_u32_le(1_000_000_000);
    body.put_slice(&[0; 10]);
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::PUBLISH, 0, 7, &body),
        7,
        DecodeError::Truncated { what: "records" },
    );

    // GroupAck with u32::MAX offsets.
    let mut body = BytesMut::new();
    group_key_body(&mut body);
    body.put_u32_le(u32::MAX);
    body.put_u64_le(1);
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::GROUP_ACK, 0, 8, &body),
        8,
        DecodeError::Truncated { what: "offsets" },
    );

    // A count that fits the bytes only if elements were smaller than their
    // minimum size: 3 offsets need 24 bytes, 23 are there.
    let mut body = BytesMut::new();
    group_key_body(&mut body);
    body.put_u32_le(3);
    body.put_slice(&[0; 23]);
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::GROUP_ACK, 0, 9, &body),
        9,
        DecodeError::Truncated { what: "offsets" },
    );

    // Responses too: a Records response with a huge count.
    let mut body = BytesMut::new();
    body.put_u64_le(0);
    body.put_u64_le(0);
    body.put_u64_le(0);
    body.put_u32_le(u32::MAX);
    let mut buf = raw_frame(KIND_RESPONSE, opcodes::response::RECORDS, 0, 3, &body);
    let err = decode_response(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap_err();
    assert_eq!(err.reason(), &DecodeError::Truncated { what: "records" });
    assert!(buf.is_empty());
}

#[test]
fn huge_blob_and_string_lengths_are_errors() {
    let mut body = BytesMut::new();
    stream_body(&mut body);
    body.put_u8(1); // target: key
    body.put_u32_le(u32::MAX); // key length
    body.put_slice(b"abc");
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::PUBLISH, 0, 1, &body),
        1,
        DecodeError::Truncated { what: "target key" },
    );

    let mut body = BytesMut::new();
    body.put_u16_le(u16::MAX);
    body.put_slice(b"t");
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::DESCRIBE_STREAM, 0, 2, &body),
        2,
        DecodeError::Truncated { what: "tenant" },
    );
}

#[test]
fn body_errors_name_the_problem() {
    // Unknown opcode: answered `unsupported`, connection kept.
    let buf = raw_frame(KIND_REQUEST, 0xEE, 0, 5, &[]);
    let mut b = buf.clone();
    let err = decode_request(&mut b, DEFAULT_MAX_FRAME_BYTES).unwrap_err();
    assert_eq!(err.opcode(), Some(0xEE));
    assert_eq!(err.to_wire_error().code, ErrorCode::Unsupported);
    expect_body_error(buf, 5, DecodeError::UnknownOpcode(0xEE));

    // A response frame sent to the broker.
    expect_body_error(
        raw_frame(KIND_RESPONSE, opcodes::request::PING, 0, 6, &[]),
        6,
        DecodeError::BadKind(KIND_RESPONSE),
    );
    // Reserved flags.
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::PING, 1, 6, &[]),
        6,
        DecodeError::BadValue { what: "flags" },
    );
    // Trailing bytes.
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::PING, 0, 6, &[0]),
        6,
        DecodeError::TrailingBytes,
    );
    // Bad UTF-8 in a name.
    let mut body = BytesMut::new();
    body.put_u16_le(2);
    body.put_slice(&[0xC3, 0x28]);
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::DESCRIBE_STREAM, 0, 6, &body),
        6,
        DecodeError::BadUtf8 { what: "tenant" },
    );
    // Presence byte other than 0/1.
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::LIST_STREAMS, 0, 6, &[2]),
        6,
        DecodeError::BadValue { what: "tenant" },
    );
    // Unknown enum tags.
    let mut body = BytesMut::new();
    group_key_body(&mut body);
    body.put_u8(3);
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::GROUP_SEEK, 0, 6, &body),
        6,
        DecodeError::BadValue {
            what: "start position",
        },
    );
    let mut body = BytesMut::new();
    stream_body(&mut body);
    body.put_u8(0);
    body.put_u32_le(0);
    body.put_u8(9); // ack mode
    body.put_u32_le(0);
    expect_body_error(
        raw_frame(KIND_REQUEST, opcodes::request::PUBLISH, 0, 6, &body),
        6,
        DecodeError::BadValue { what: "ack mode" },
    );
    let err = DecodeError::Truncated { what: "records" }.to_wire_error();
    assert_eq!(err.code, ErrorCode::InvalidRequest);
    assert_eq!(err.message, "truncated records");
}

#[test]
fn stream_stays_in_sync_after_a_bad_body() {
    let mut buf = raw_frame(KIND_REQUEST, opcodes::request::PING, 0, 1, &[1, 2, 3]);
    encode_request(2, &Request::Ping, &mut buf);
    let err = decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap_err();
    assert_eq!(err.request_id(), Some(1));
    assert_eq!(
        decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap(),
        Some((2, Request::Ping))
    );
    assert!(buf.is_empty());
}

#[test]
fn payloads_share_the_receive_buffer() {
    let payload = Bytes::from(vec![0xAB; 1000]);
    let req = Request::Publish {
        stream: StreamRef::new("t", "n", "s"),
        target: PublishTarget::Shard(0),
        ack: AckMode::Durable,
        records: vec![RecordIn {
            payload: payload.clone(),
            ..RecordIn::default()
        }]
        .into(),
    };
    let mut buf = encode_req(1, &req);
    let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
    let Some((_, Request::Publish { records, .. })) =
        decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap()
    else {
        panic!("not a publish")
    };
    // The view reads the payload in place, and an owned copy shares it.
    let view = records.iter().next().unwrap();
    assert_eq!(view.payload, &payload[..]);
    assert!(range.contains(&(view.payload.as_ptr() as usize)));
    let owned = records.to_records();
    assert_eq!(owned[0].payload, payload);
    assert!(range.contains(&(owned[0].payload.as_ptr() as usize)));
}

#[test]
fn unknown_error_codes_decode_as_internal() {
    let mut body = BytesMut::new();
    body.put_u16_le(999);
    body.put_u16_le(4);
    body.put_slice(b"nope");
    body.put_u8(0);
    let mut buf = raw_frame(KIND_RESPONSE, opcodes::response::ERROR, 0, 4, &body);
    let (id, resp) = decode_response(&mut buf, DEFAULT_MAX_FRAME_BYTES)
        .unwrap()
        .unwrap();
    assert_eq!(id, 4);
    assert_eq!(
        resp,
        Response::Error(WireError::new(
            ErrorCode::Internal,
            "unknown error code 999: nope"
        ))
    );
}

#[test]
fn long_strings_are_truncated_on_a_char_boundary() {
    // 'é' is two bytes; 40_000 of them is 80_000 bytes.
    let message = "é".repeat(40_000);
    let resp = Response::Error(WireError::new(ErrorCode::Internal, message.clone()));
    let mut buf = encode_resp(1, &resp);
    let Some((_, Response::Error(e))) = decode_response(&mut buf, u32::MAX).unwrap() else {
        panic!("not an error")
    };
    assert_eq!(e.message.len(), 65_534);
    assert!(message.starts_with(&e.message));
}

#[test]
fn error_codes() {
    let mut names: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    for (i, code) in ErrorCode::ALL.iter().enumerate() {
        assert_eq!(code.as_u16() as usize, i + 1);
        assert_eq!(ErrorCode::from_u16(code.as_u16()), Some(*code));
        assert_eq!(code.to_string(), code.as_str());
    }
    assert_eq!(ErrorCode::from_u16(0), None);
    assert_eq!(ErrorCode::from_u16(13), None);
    assert_eq!(ErrorCode::StaleClaim.as_str(), "stale_claim");
    assert_eq!(ErrorCode::Busy.as_str(), "busy");
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), ErrorCode::ALL.len());
    assert_eq!(
        WireError::wrong_core(3, "shard 7 lives elsewhere").to_string(),
        "wrong_core: shard 7 lives elsewhere (core 3)"
    );
}

#[test]
fn shard_for_key_is_crc32c_mod_shards() {
    // Standard CRC-32C check value.
    assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(shard_for_key(b"123456789", 10), 0xE306_9283 % 10);
    assert_eq!(shard_for_key(b"", 7), 0);
    assert_eq!(shard_for_key(b"anything", 1), 0);
    assert_eq!(shard_for_key(b"anything", 0), 0);
    for shards in 1..20 {
        assert!(shard_for_key(b"user-42", shards) < shards);
    }
}

#[test]
fn stream_ref_parse_and_display() {
    let s = StreamRef::parse("acme/orders/created").unwrap();
    assert_eq!(s, StreamRef::new("acme", "orders", "created"));
    assert_eq!(s.to_string(), "acme/orders/created");
    assert_eq!("acme/orders/created".parse::<StreamRef>().unwrap(), s);
    for bad in ["", "a", "a/b", "a/b/c/d", "a//c", "/b/c", "a/b/"] {
        assert_eq!(StreamRef::parse(bad), None, "{bad:?}");
        assert!(bad.parse::<StreamRef>().is_err());
    }
}

#[test]
fn small_helpers() {
    let info = GroupInfo {
        group: "g".into(),
        position: 10,
        end_offset: 25,
        start_offset: 0,
        in_flight: 0,
        owed: 0,
        delayed: 0,
        dead_letters: 0,
        oldest_in_flight_age_ms: None,
        oldest_owed_age_ms: None,
        last_active_ms: None,
    };
    assert_eq!(info.lag(), 15);
    assert_eq!(
        GroupInfo {
            position: 30,
            ..info
        }
        .lag(),
        0
    );
    assert_eq!(AckMode::default(), AckMode::Default);
    assert_eq!(StartPosition::Offset(5).to_string(), "5");
    assert_eq!(FRAME_HEADER_BYTES, 16);
    let req = Request::GroupPoll {
        key: key(),
        max_records: 1,
        wait_ms: 0,
        member: None,
        visibility_ms: None,
    };
    assert_eq!(req.name(), "group_poll");
    assert_eq!(Request::Ping.name(), "ping");
    assert_eq!(Response::Pong.name(), "pong");
    assert_eq!(Request::DescribeCluster.name(), "describe_cluster");
    assert_eq!(Request::name_of(0xEE), None);
    assert_eq!(Request::all_opcodes().count(), 25);
    let page = Request::GroupDeadLettersPage {
        key: key(),
        from: 0,
        max: 1000,
    };
    assert_eq!(page.name(), "group_dead_letters_page");
    assert_eq!(page.opcode(), opcodes::request::GROUP_DEAD_LETTERS_PAGE);
    let answer = Response::DeadLetterPage {
        letters: Vec::new(),
        next: None,
    };
    assert_eq!(answer.name(), "dead_letter_page");
    assert_eq!(answer.opcode(), opcodes::response::DEAD_LETTER_PAGE);
}

/// A dead-letter page's body is checked like any other: a count the bytes
/// cannot hold and a bad presence byte for `next` are errors, and a page
/// with nothing after its list is truncated.
#[test]
fn dead_letter_page_bodies_are_checked() {
    let decode = |body: &[u8]| {
        let mut buf = raw_frame(
            KIND_RESPONSE,
            opcodes::response::DEAD_LETTER_PAGE,
            0,
            5,
            body,
        );
        let r = decode_response(&mut buf, DEFAULT_MAX_FRAME_BYTES);
        assert!(buf.is_empty(), "frame consumed");
        r
    };
    // An empty last page: no letters, no next.
    let mut body = BytesMut::new();
    body.put_u32_le(0);
    body.put_u8(0);
    assert_eq!(
        decode(&body).unwrap(),
        Some((
            5,
            Response::DeadLetterPage {
                letters: Vec::new(),
                next: None
            }
        ))
    );
    // A billion letters claimed in a few bytes.
    let mut body = BytesMut::new();
    body.put_u32_le(1_000_000_000);
    body.put_u8(0);
    let err = decode(&body).unwrap_err();
    assert!(
        matches!(err.reason(), DecodeError::Truncated { .. }),
        "{err:?}"
    );
    // A presence byte that is neither 0 nor 1.
    let mut body = BytesMut::new();
    body.put_u32_le(0);
    body.put_u8(2);
    let err = decode(&body).unwrap_err();
    assert!(
        matches!(err.reason(), DecodeError::BadValue { .. }),
        "{err:?}"
    );
    // No `next` at all.
    let mut body = BytesMut::new();
    body.put_u32_le(0);
    let err = decode(&body).unwrap_err();
    assert!(
        matches!(err.reason(), DecodeError::Truncated { .. }),
        "{err:?}"
    );
    // The request: a group key then `from` and `max`; one byte short fails.
    let mut body = BytesMut::new();
    group_key_body(&mut body);
    body.put_u64_le(7);
    body.put_u32_le(100);
    let mut buf = raw_frame(
        KIND_REQUEST,
        opcodes::request::GROUP_DEAD_LETTERS_PAGE,
        0,
        6,
        &body,
    );
    assert_eq!(
        decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap(),
        Some((
            6,
            Request::GroupDeadLettersPage {
                key: key(),
                from: 7,
                max: 100
            }
        ))
    );
    expect_body_error(
        raw_frame(
            KIND_REQUEST,
            opcodes::request::GROUP_DEAD_LETTERS_PAGE,
            0,
            6,
            &body[..body.len() - 1],
        ),
        6,
        DecodeError::Truncated { what: "max" },
    );
}

#[test]
fn a_list_over_the_element_cap_is_too_large_not_malformed() {
    let records = vec![RecordIn::default(); MAX_ITEMS_PER_VEC + 1];
    let req = Request::Publish {
        stream: StreamRef::new("t", "n", "s"),
        target: PublishTarget::Shard(0),
        ack: AckMode::Default,
        records: records.into(),
    };
    let mut buf = BytesMut::new();
    encode_request(7, &req, &mut buf);
    let err = decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).unwrap_err();
    assert!(
        !err.is_fatal(),
        "the frame was consumed; the connection goes on"
    );
    assert_eq!(err.request_id(), Some(7));
    assert!(
        matches!(err.reason(), DecodeError::TooMany { count, .. } if *count == MAX_ITEMS_PER_VEC + 1),
        "{err:?}"
    );
    assert_eq!(err.to_wire_error().code, ErrorCode::TooLarge);
}

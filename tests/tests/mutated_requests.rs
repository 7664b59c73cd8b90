//! Mutational fuzzing of the broker over TCP: well-formed requests of every
//! kind, aimed at a real stream and group, with their bodies mutated (bytes
//! flipped, numbers set to 0 or to their largest values, bodies cut short or
//! grown) or their number fields set to edge values, sent after a HELLO that negotiated every feature. The decoder's
//! own fuzzing covers bytes that do not decode; this covers what decodes
//! into values no client would send and reaches the handlers. Every frame
//! must get exactly one answer under its own request id, the broker must
//! stay up, and afterwards keep serving and restart with its data.

use bytes::{Bytes, BytesMut};
use felix_client::{Client, ClientConfig, StreamOptions};
use felix_tests::BrokerOptions;
use felix_wire::{
    AckMode, GroupKey, GroupMemberRef, PublishTarget, RecordIn, Request, Response, StartPosition,
    StreamRef, FRAME_HEADER_BYTES,
};
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn stream() -> StreamRef {
    StreamRef {
        tenant: "t".into(),
        namespace: "ns".into(),
        stream: "fz".into(),
    }
}

fn key(shard: u32) -> GroupKey {
    GroupKey {
        stream: stream(),
        shard,
        group: "g".into(),
    }
}

/// One well-formed request of every kind the handlers serve, aimed at the
/// stream and group the test made, with values a client would send.
fn corpus() -> Vec<Request> {
    let rec = |p: &'static [u8]| RecordIn {
        timestamp_ms: Some(1_700_000_000_000),
        key: Some(Bytes::from_static(b"k")),
        headers: vec![("h".into(), Bytes::from_static(b"v"))],
        payload: Bytes::from_static(p),
    };
    let mut out = Vec::new();
    for shard in 0..2 {
        out.extend([
            Request::Publish {
                stream: stream(),
                target: PublishTarget::Shard(shard),
                ack: AckMode::Durable,
                records: vec![rec(b"one"), rec(b"two")].into(),
            },
            Request::Publish {
                stream: stream(),
                target: PublishTarget::Key(Bytes::from_static(b"route")),
                ack: AckMode::Default,
                records: vec![rec(b"keyed")].into(),
            },
            Request::Read {
                stream: stream(),
                shard,
                from: StartPosition::Offset(3),
                max_records: 10,
                max_bytes: 1 << 16,
                wait_ms: 0,
            },
            Request::Read {
                stream: stream(),
                shard,
                from: StartPosition::Latest,
                max_records: 10,
                max_bytes: 1 << 16,
                wait_ms: 20,
            },
            Request::DescribeShard {
                stream: stream(),
                shard,
            },
            Request::GroupPoll {
                key: key(shard),
                max_records: 5,
                wait_ms: 20,
                member: Some(GroupMemberRef {
                    name: "m".into(),
                    reclaim: true,
                }),
                visibility_ms: Some(50),
            },
            Request::GroupPoll {
                key: key(shard),
                max_records: 3,
                wait_ms: 0,
                member: None,
                visibility_ms: None,
            },
            Request::GroupAck {
                key: key(shard),
                offsets: vec![0, 1, 2],
            },
            Request::GroupNack {
                key: key(shard),
                offset: 4,
                attempts: 1,
                delay_ms: Some(30),
                reason: Some("why".into()),
            },
            Request::GroupExtend {
                key: key(shard),
                offset: 5,
                attempts: 1,
                extend_ms: 100,
            },
            Request::GroupDeadLetter {
                key: key(shard),
                offset: 6,
                attempts: 1,
                reason: Some("poison".into()),
            },
            Request::GroupDeadLetters { key: key(shard) },
            Request::GroupDeadLettersPage {
                key: key(shard),
                from: 0,
                max: 10,
            },
            Request::GroupRedrive {
                key: key(shard),
                offset: 6,
            },
            Request::GroupDiscard {
                key: key(shard),
                offset: 6,
            },
            Request::GroupCreate {
                key: key(shard),
                start: StartPosition::Earliest,
            },
            Request::GroupSeek {
                key: key(shard),
                start: StartPosition::Offset(2),
            },
            Request::GroupDescribe { key: key(shard) },
            Request::ListGroups {
                stream: stream(),
                shard,
            },
        ]);
    }
    out.extend([
        Request::DescribeStream { stream: stream() },
        Request::ListStreams {
            tenant: Some("t".into()),
        },
        Request::CreateStream {
            stream: StreamRef {
                tenant: "t".into(),
                namespace: "ns".into(),
                stream: "other".into(),
            },
            shards: 2,
            retention_bytes: Some(1 << 20),
            retention_ms: Some(60_000),
            incarnation: None,
        },
        Request::DeleteStream {
            stream: StreamRef {
                tenant: "t".into(),
                namespace: "ns".into(),
                stream: "other".into(),
            },
        },
        Request::GroupDelete {
            key: GroupKey {
                stream: stream(),
                shard: 1,
                group: "h".into(),
            },
        },
        Request::Ping,
    ]);
    out
}

/// Mutate a frame's body in place (the header is kept, with its length
/// fixed up, so the answer comes back under the same id).
fn mutate(frame: &mut Vec<u8>, rng: &mut rand::rngs::SmallRng) {
    let body = FRAME_HEADER_BYTES;
    for _ in 0..rng.gen_range(1..=4) {
        let len = frame.len() - body;
        match rng.gen_range(0..10) {
            // Flip or replace one byte.
            0..=2 if len > 0 => {
                let i = body + rng.gen_range(0..len);
                frame[i] = if rng.gen() {
                    frame[i] ^ (1 << rng.gen_range(0..8))
                } else {
                    rng.gen()
                };
            }
            // A 4- or 8-byte number set to an edge value.
            3..=6 if len >= 8 => {
                let i = body + rng.gen_range(0..=len - 8);
                let v: u64 = match rng.gen_range(0..6) {
                    0 => 0,
                    1 => u64::MAX,
                    2 => i64::MAX as u64,
                    3 => u32::MAX as u64,
                    4 => 1 << 31,
                    _ => rng.gen(),
                };
                if rng.gen() {
                    frame[i..i + 8].copy_from_slice(&v.to_le_bytes());
                } else {
                    frame[i..i + 4].copy_from_slice(&(v as u32).to_le_bytes());
                }
            }
            // Cut the body short.
            7 if len > 0 => frame.truncate(body + rng.gen_range(0..len)),
            // Grow it with random bytes.
            8 => {
                let n = rng.gen_range(1..64);
                frame.extend((0..n).map(|_| rng.gen::<u8>()));
            }
            // Duplicate a slice of it at its end (repeats, longer vectors).
            _ if len > 0 => {
                let a = body + rng.gen_range(0..len);
                let b = (a + rng.gen_range(1..=32)).min(frame.len());
                let piece = frame[a..b].to_vec();
                frame.extend_from_slice(&piece);
            }
            _ => {}
        }
    }
    let after_len = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&after_len.to_le_bytes());
}

/// An edge value for a number field: mostly small (a real shard, a real
/// offset), often 0 or the type's largest, sometimes anything.
fn edge64(rng: &mut rand::rngs::SmallRng) -> u64 {
    match rng.gen_range(0..8) {
        0 => 0,
        1 => u64::MAX,
        2 => i64::MAX as u64,
        3 => u32::MAX as u64,
        4 => rng.gen(),
        _ => rng.gen_range(0..64),
    }
}

fn edge32(rng: &mut rand::rngs::SmallRng) -> u32 {
    match rng.gen_range(0..6) {
        0 => 0,
        1 => u32::MAX,
        2 => rng.gen(),
        _ => rng.gen_range(0..64),
    }
}

fn edge_start(rng: &mut rand::rngs::SmallRng) -> StartPosition {
    match rng.gen_range(0..3) {
        0 => StartPosition::Earliest,
        1 => StartPosition::Latest,
        _ => StartPosition::Offset(edge64(rng)),
    }
}

/// The same request with its numbers (shards, offsets, counts, waits,
/// visibilities, delays, attempts) set to edge values: what decodes and
/// reaches the handlers' arithmetic. Names stay valid, so the requests land.
fn with_edge_numbers(req: &Request, rng: &mut rand::rngs::SmallRng) -> Request {
    let mut r = req.clone();
    let shard = |k: &mut GroupKey, rng: &mut rand::rngs::SmallRng| {
        if rng.gen_range(0..4) == 0 {
            k.shard = edge32(rng);
        }
    };
    match &mut r {
        Request::Publish {
            target, records, ..
        } => {
            if let PublishTarget::Shard(s) = target {
                if rng.gen_range(0..4) == 0 {
                    *s = edge32(rng);
                }
            }
            let mut owned = records.to_records();
            for rec in &mut owned {
                rec.timestamp_ms = Some(edge64(rng));
            }
            *records = owned.into();
        }
        Request::Read {
            shard,
            from,
            max_records,
            max_bytes,
            wait_ms,
            ..
        } => {
            if rng.gen_range(0..4) == 0 {
                *shard = edge32(rng);
            }
            *from = edge_start(rng);
            *max_records = edge32(rng);
            *max_bytes = edge32(rng);
            *wait_ms = edge32(rng).min(200);
        }
        Request::DescribeShard { shard, .. } | Request::ListGroups { shard, .. } => {
            *shard = edge32(rng)
        }
        Request::GroupPoll {
            key,
            max_records,
            wait_ms,
            visibility_ms,
            ..
        } => {
            shard(key, rng);
            *max_records = edge32(rng);
            *wait_ms = edge32(rng).min(200);
            *visibility_ms = rng.gen::<bool>().then(|| edge64(rng));
        }
        Request::GroupAck { key, offsets } => {
            shard(key, rng);
            *offsets = (0..rng.gen_range(0..20)).map(|_| edge64(rng)).collect();
        }
        Request::GroupNack {
            key,
            offset,
            attempts,
            delay_ms,
            ..
        } => {
            shard(key, rng);
            *offset = edge64(rng);
            *attempts = edge32(rng);
            *delay_ms = rng.gen::<bool>().then(|| edge64(rng));
        }
        Request::GroupExtend {
            key,
            offset,
            attempts,
            extend_ms,
        } => {
            shard(key, rng);
            *offset = edge64(rng);
            *attempts = edge32(rng);
            *extend_ms = edge64(rng);
        }
        Request::GroupDeadLetter {
            key,
            offset,
            attempts,
            ..
        } => {
            shard(key, rng);
            *offset = edge64(rng);
            *attempts = edge32(rng);
        }
        Request::GroupDeadLettersPage { key, from, max } => {
            shard(key, rng);
            *from = edge64(rng);
            *max = edge32(rng);
        }
        Request::GroupRedrive { key, offset } | Request::GroupDiscard { key, offset } => {
            shard(key, rng);
            *offset = edge64(rng);
        }
        Request::GroupCreate { key, start } | Request::GroupSeek { key, start } => {
            shard(key, rng);
            *start = edge_start(rng);
        }
        Request::CreateStream {
            shards,
            retention_bytes,
            retention_ms,
            ..
        } => {
            *shards = edge32(rng).min(64);
            *retention_bytes = rng.gen::<bool>().then(|| edge64(rng));
            *retention_ms = rng.gen::<bool>().then(|| edge64(rng));
        }
        _ => {}
    }
    r
}

async fn connect(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let hello = Request::Hello {
        version: felix_wire::PROTOCOL_VERSION,
        features: felix_wire::FEATURES_ALL,
        want_core: None,
        client_name: "mutated-requests".into(),
        token: None,
    };
    match felix_tests::raw_call(&mut s, 1, &hello).await {
        Response::HelloOk { .. } => {}
        other => panic!("HELLO refused: {other:?}"),
    }
    s
}

/// Send one frame and read its answer: `Some(answer)`, or `None` if the
/// broker closed the connection (it may, for a frame it cannot take).
async fn call(s: &mut TcpStream, id: u64, frame: &[u8]) -> Option<Response> {
    if s.write_all(frame).await.is_err() {
        return None;
    }
    let mut buf = BytesMut::new();
    loop {
        match felix_wire::decode_response(&mut buf, 64 << 20) {
            Ok(Some((rid, resp))) => {
                assert_eq!(rid, id, "an answer under another request's id");
                assert!(buf.is_empty(), "more than one answer to one frame");
                return Some(resp);
            }
            Ok(None) => {}
            Err(e) => panic!("the broker sent an undecodable answer: {e}"),
        }
        let mut chunk = [0u8; 65536];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
            .await
            .expect("the broker answers every frame within 10 s")
            .unwrap_or(0);
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_requests_get_answers_and_never_take_the_broker_down() {
    // Short waits and claims, so mutated values cannot stall the run.
    let mut broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(2)
        .env("FELIX_GROUP_MAX_WAIT_MS", 50)
        .env("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", 50)
        .env("FELIX_GROUP_MAX_VISIBILITY_MS", 200));
    let c = Client::connect(&broker.addr, ClientConfig::default())
        .await
        .unwrap();
    c.create_stream("t", "ns", "fz", 2, StreamOptions::default())
        .await
        .unwrap();
    c.create_stream("t", "ns", "safe", 1, StreamOptions::default())
        .await
        .unwrap();
    for shard in 0..2 {
        for i in 0..20 {
            c.publish("t", "ns", "fz", shard, format!("r{i}"))
                .await
                .unwrap();
        }
    }
    c.publish("t", "ns", "safe", 0, "before").await.unwrap();

    let seed: u64 = std::env::var("FELIX_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let corpus = corpus();
    let mut s = connect(&broker.addr).await;
    let (mut answered, mut closed, mut errors) = (0u32, 0u32, 0u32);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut id = 10u64;
    for n in 0..40_000u32 {
        if Instant::now() > deadline {
            break;
        }
        id += 1;
        let base = &corpus[rng.gen_range(0..corpus.len())];
        // A third go out with edge numbers, a half with mutated bytes, the
        // rest as they are (so the stream and the group move on).
        let how = rng.gen_range(0..6);
        let edged;
        let req = if how < 2 {
            edged = with_edge_numbers(base, &mut rng);
            &edged
        } else {
            base
        };
        let mut out = BytesMut::new();
        felix_wire::encode_request(id, req, &mut out);
        let mut frame = out.to_vec();
        if (2..5).contains(&how) {
            mutate(&mut frame, &mut rng);
        }
        match call(&mut s, id, &frame).await {
            Some(Response::Error(_)) => errors += 1,
            Some(_) => answered += 1,
            None => {
                closed += 1;
                assert!(
                    std::fs::metadata(format!("/proc/{}", broker.pid())).is_ok(),
                    "seed {seed}: the broker died at frame {n} ({}): {frame:?}",
                    req.name()
                );
                s = connect(&broker.addr).await;
            }
        }
    }
    eprintln!(
        "seed {seed}: {answered} answered, {errors} typed errors, {closed} connections closed"
    );
    assert!(
        answered > 0 && errors > 0,
        "seed {seed}: the mix exercised nothing"
    );

    // Still serving, and its data still opens after a restart.
    let c = Client::connect(&broker.addr, ClientConfig::default())
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    c.publish("t", "ns", "safe", 0, "after")
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    broker.restart();
    let c = Client::connect(&broker.addr, ClientConfig::default())
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let got = c
        .read("t", "ns", "safe", 0, StartPosition::Earliest, 10, None)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let payloads: Vec<&[u8]> = got.records.iter().map(|r| r.payload.as_ref()).collect();
    assert_eq!(
        payloads,
        [b"before".as_ref(), b"after".as_ref()],
        "seed {seed}"
    );
    c.describe_stream("t", "ns", "fz")
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: the fuzzed stream after a restart: {e}"));
}

/// A request whose frame does not decode (a trailing byte, header flags
/// set) is refused as not carried out, `not_applied`, so a client may send
/// it again corrected without fear of a double publish; and nothing of it
/// is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_that_does_not_decode_is_refused_as_not_applied() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = Client::connect(&broker.addr, ClientConfig::default())
        .await
        .unwrap();
    c.create_stream("t", "ns", "fz", 1, StreamOptions::default())
        .await
        .unwrap();
    let publish = Request::Publish {
        stream: stream(),
        target: PublishTarget::Shard(0),
        ack: AckMode::Default,
        records: vec![RecordIn {
            payload: Bytes::from_static(b"never"),
            ..RecordIn::default()
        }]
        .into(),
    };
    let mut s = connect(&broker.addr).await;
    let mut trailing = BytesMut::new();
    felix_wire::encode_request(20, &publish, &mut trailing);
    trailing.extend_from_slice(&[0]);
    let len = (trailing.len() - 4) as u32;
    trailing[..4].copy_from_slice(&len.to_le_bytes());
    let mut flagged = BytesMut::new();
    felix_wire::encode_request(21, &publish, &mut flagged);
    flagged[6] = 1;
    for (id, frame) in [(20, trailing), (21, flagged)] {
        match call(&mut s, id, &frame).await {
            Some(Response::Error(e)) => {
                assert_eq!(e.code, felix_wire::ErrorCode::InvalidRequest, "{e:?}");
                assert!(e.not_applied, "{e:?}");
            }
            other => panic!("frame {id}: {other:?}"),
        }
    }
    let got = c
        .read("t", "ns", "fz", 0, StartPosition::Earliest, 10, None)
        .await
        .unwrap();
    assert!(got.records.is_empty(), "{:?}", got.records);
    assert_eq!(got.end_offset, 0);
}

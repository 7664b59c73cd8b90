//! Frame encode/decode of the hot requests and responses (felix-wire): a
//! publish of N records, the records answer of a read, a group poll's
//! answer and a group ack.
//!
//! These live in felix-bench rather than net/wire/benches so felix-wire
//! keeps criterion out of its dev-dependencies. Run with
//! `cargo bench -p felix-bench --bench wire`.

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use felix_wire::{
    decode_request, decode_response, encode_request, encode_response, AckMode, GroupKey,
    GroupRecord, PublishTarget, Record, RecordIn, Request, Response, StreamRef,
    DEFAULT_MAX_FRAME_BYTES,
};
use std::hint::black_box;
use std::time::Duration;

const SIZES: [usize; 2] = [100, 1024];
const COUNTS: [usize; 3] = [1, 100, 1000];

fn stream() -> StreamRef {
    StreamRef::new("bench", "default", "events")
}

fn publish(n: usize, size: usize) -> Request {
    let payload = Bytes::from(vec![0x5a; size]);
    Request::Publish {
        stream: stream(),
        target: PublishTarget::Shard(3),
        ack: AckMode::Default,
        records: (0..n)
            .map(|_| RecordIn {
                payload: payload.clone(),
                ..RecordIn::default()
            })
            .collect(),
    }
}

fn records(n: usize, size: usize) -> Response {
    let payload = Bytes::from(vec![0x5a; size]);
    Response::Records {
        start_offset: 0,
        next_offset: 1_000 + n as u64,
        end_offset: 1_000_000,
        records: (0..n)
            .map(|i| Record {
                offset: 1_000 + i as u64,
                timestamp_ms: 1_700_000_000_000,
                key: None,
                headers: Default::default(),
                payload: payload.clone(),
            })
            .collect(),
    }
}

fn group_records(n: usize, size: usize) -> Response {
    let payload = Bytes::from(vec![0x5a; size]);
    Response::GroupRecords {
        records: (0..n)
            .map(|i| GroupRecord {
                offset: 1_000 + i as u64,
                attempts: 1,
                timestamp_ms: 1_700_000_000_000,
                key: None,
                headers: Default::default(),
                payload: payload.clone(),
                skipped_before: None,
            })
            .collect(),
    }
}

fn ack(n: usize) -> Request {
    Request::GroupAck {
        key: GroupKey {
            stream: stream(),
            shard: 3,
            group: "workers".into(),
        },
        offsets: (0..n as u64).map(|i| 1_000 + i).collect(),
    }
}

fn bench_request(
    c: &mut Criterion,
    group: &str,
    make: impl Fn(usize, usize) -> Request,
    sizes: &[usize],
) {
    let mut g = c.benchmark_group(group);
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for &size in sizes {
        for n in COUNTS {
            let req = make(n, size);
            let mut frame = BytesMut::new();
            encode_request(7, &req, &mut frame);
            let frame = frame.freeze();
            g.throughput(Throughput::Elements(n as u64));
            let id = format!("{size}B");
            g.bench_with_input(
                BenchmarkId::new(format!("encode/{id}"), n),
                &req,
                |b, req| {
                    let mut out = BytesMut::with_capacity(frame.len());
                    b.iter(|| {
                        out.clear();
                        encode_request(7, black_box(req), &mut out);
                        black_box(out.len())
                    })
                },
            );
            g.bench_with_input(
                BenchmarkId::new(format!("decode/{id}"), n),
                &frame,
                |b, frame| {
                    b.iter(|| {
                        let mut buf = BytesMut::from(&frame[..]);
                        let got = decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES).expect("valid");
                        black_box(got)
                    })
                },
            );
        }
    }
    g.finish();
}

fn bench_response(c: &mut Criterion, group: &str, make: impl Fn(usize, usize) -> Response) {
    let mut g = c.benchmark_group(group);
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for size in SIZES {
        for n in COUNTS {
            let resp = make(n, size);
            let mut frame = BytesMut::new();
            encode_response(7, &resp, &mut frame);
            let frame = frame.freeze();
            g.throughput(Throughput::Elements(n as u64));
            let id = format!("{size}B");
            g.bench_with_input(
                BenchmarkId::new(format!("encode/{id}"), n),
                &resp,
                |b, resp| {
                    let mut out = BytesMut::with_capacity(frame.len());
                    b.iter(|| {
                        out.clear();
                        encode_response(7, black_box(resp), &mut out);
                        black_box(out.len())
                    })
                },
            );
            g.bench_with_input(
                BenchmarkId::new(format!("decode/{id}"), n),
                &frame,
                |b, frame| {
                    b.iter(|| {
                        let mut buf = BytesMut::from(&frame[..]);
                        let got =
                            decode_response(&mut buf, DEFAULT_MAX_FRAME_BYTES).expect("valid");
                        black_box(got)
                    })
                },
            );
        }
    }
    g.finish();
}

fn wire(c: &mut Criterion) {
    bench_request(c, "publish", publish, &SIZES);
    bench_response(c, "read_records", records);
    bench_response(c, "group_records", group_records);
    bench_request(c, "group_ack", |n, _| ack(n), &[0]);
}

criterion_group!(benches, wire);
criterion_main!(benches);

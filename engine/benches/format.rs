//! CPU cost of the on-disk batch format: building a batch (framing every
//! record and the CRC32C over the batch), parsing one back (length, CRC
//! check, then every record), and a replica's two ways of writing a batch
//! it was sent into its own log (decoding every record and encoding them
//! again, or checking the body and copying it). No I/O. Figures are in
//! `perf/README.md`.
//!
//! Run with `cargo bench -p felix-engine --bench format`.

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use felix_engine::format::{
    check_records_body, encode_records, encode_records_copy_into, for_each_record, parse_batch,
    parse_header, RecordIn, BATCH_HEADER_BYTES,
};
use felix_engine::Offset;
use std::hint::black_box;

fn records(n: usize, size: usize) -> Vec<RecordIn> {
    (0..n)
        .map(|i| RecordIn {
            timestamp_ms: 1_700_000_000_000 + i as u64,
            key: None,
            headers: Vec::new(),
            payload: Bytes::from(vec![(i % 251) as u8; size]),
        })
        .collect()
}

const SHAPES: [(usize, usize); 4] = [(1, 100), (100, 100), (1000, 100), (64, 1024)];

fn build(c: &mut Criterion) {
    let mut g = c.benchmark_group("batch_build");
    for (n, size) in SHAPES {
        let recs = records(n, size);
        let mut out = Vec::with_capacity(n * (size + 64) + 64);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("{n}x{size}B")),
            &recs,
            |b, recs| {
                b.iter(|| {
                    out.clear();
                    black_box(encode_records(&mut out, Offset(42), 1, 0, black_box(recs)));
                })
            },
        );
    }
    g.finish();
}

fn parse(c: &mut Criterion) {
    let mut g = c.benchmark_group("batch_parse");
    // Records with three small headers: what a read pays for each.
    let shapes = SHAPES.iter().map(|&(n, size)| (n, size, 0));
    for (n, size, headers) in shapes.chain([(100, 100, 3)]) {
        let mut out = Vec::new();
        encode_records(&mut out, Offset(42), 1, 0, &with_headers(n, size, headers));
        let batch = Bytes::from(out);
        let name = match headers {
            0 => format!("{n}x{size}B"),
            h => format!("{n}x{size}B+{h}h"),
        };
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(name), &batch, |b, batch| {
            b.iter(|| {
                let h = parse_batch(black_box(batch)).expect("a valid batch");
                let mut count = 0usize;
                for_each_record(batch, &h, Offset(42), |r| {
                    count += r.payload.len();
                    true
                })
                .expect("valid records");
                black_box(count)
            })
        });
    }
    g.finish();
}

/// `n` records of `size` bytes, each with `headers` small headers.
fn with_headers(n: usize, size: usize, headers: usize) -> Vec<RecordIn> {
    let mut recs = records(n, size);
    for r in &mut recs {
        r.headers = (0..headers)
            .map(|h| (format!("header-{h}"), Bytes::from_static(b"value")))
            .collect();
    }
    recs
}

fn replica_apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("replica_apply");
    for headers in [0, 3] {
        let mut entry = Vec::new();
        encode_records(
            &mut entry,
            Offset(42),
            7,
            0,
            &with_headers(100, 100, headers),
        );
        let entry = Bytes::from(entry);
        let mut out = Vec::with_capacity(entry.len());
        g.throughput(Throughput::Elements(100));
        g.bench_with_input(
            BenchmarkId::new("decode_encode", format!("100x100B+{headers}h")),
            &entry,
            |b, entry| {
                b.iter(|| {
                    let h = parse_header(entry).expect("a valid batch");
                    let mut records = Vec::with_capacity(h.record_count as usize);
                    for_each_record(entry, &h, h.base_offset, |r| {
                        records.push(RecordIn {
                            timestamp_ms: r.timestamp_ms,
                            key: r.key,
                            headers: r.headers.to_vec(),
                            payload: r.payload,
                        });
                        true
                    })
                    .expect("valid records");
                    out.clear();
                    black_box(encode_records(&mut out, Offset(9), 0, 1, &records));
                })
            },
        );
        g.bench_with_input(
            BenchmarkId::new("check_copy", format!("100x100B+{headers}h")),
            &entry,
            |b, entry| {
                b.iter(|| {
                    let h = parse_header(entry).expect("a valid batch");
                    let body = &entry[BATCH_HEADER_BYTES..];
                    let max = check_records_body(body, h.record_count).expect("valid records");
                    out.clear();
                    let spare = &mut out.spare_capacity_mut()[..entry.len()];
                    black_box(encode_records_copy_into(
                        spare,
                        Offset(9),
                        (0, 1),
                        (h.record_count, max),
                        body,
                    ));
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, build, parse, replica_apply);
criterion_main!(benches);

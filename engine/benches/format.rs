//! CPU cost of the on-disk batch format: building a batch (framing every
//! record and the CRC32C over the batch) and parsing one back (length, CRC
//! check, then every record). No I/O. Figures are in `perf/README.md`.
//!
//! Run with `cargo bench -p felix-engine --bench format`.

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use felix_engine::format::{encode_records, for_each_record, parse_batch, RecordIn};
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
    for (n, size) in SHAPES {
        let mut out = Vec::new();
        encode_records(&mut out, Offset(42), 1, 0, &records(n, size));
        let batch = Bytes::from(out);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("{n}x{size}B")),
            &batch,
            |b, batch| {
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
            },
        );
    }
    g.finish();
}

criterion_group!(benches, build, parse);
criterion_main!(benches);

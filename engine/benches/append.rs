//! Durable append and sequential read throughput of the shard log on the real
//! disk (glommio DMA), and the CPU cost of appending to the in-memory disk.
//! Figures are recorded in `perf/README.md`.
//!
//! "Durable" means every appended byte is covered by a completed
//! `fdatasync` before the sample's clock stops. How often it syncs differs
//! between the two durable groups:
//!
//! * `durable_append/{size}B/{batch}` — the grid (100 B, 1 KiB, 64 KiB records
//!   × batches of 1, 64, 1024) with **one flush (one write + one fdatasync)
//!   per `FLUSH_EVERY_BYTES` (1 MiB) of batches**, plus a last flush at the
//!   end: fsyncs are amortised across batches the way group commit amortises
//!   them across concurrent publishers. A batch of 1 MiB or more is synced on
//!   its own, so for those sizes (1 KiB × 1024, 64 KiB × 64, 64 KiB × 1024)
//!   this is already one fdatasync per batch. For a 100 B record alone it is
//!   one fdatasync per ~10,000 appends: the throughput of a core under many
//!   publishers, not what one publisher waiting on each append sees.
//! * `durable_append_sync_each_batch/{size}B/{batch}` — **one flush per
//!   batch**: append, then write + fdatasync before the next append, as a
//!   lone publisher waiting for each append to be durable sees it (without
//!   the network). Only the combinations the grid amortises (under 1 MiB per
//!   batch) are run here; for the others the grid already is this.
//!
//! 64 KiB × 1024 is 64 MiB per batch (and a segment roll, with its own
//! syncs, about every batch at the default 128 MiB segments): it runs with
//! ten samples of one batch each (flat sampling) to keep memory (a few
//! hundred MiB) and time bounded.
//!
//! Each sample opens a fresh log in a new temporary directory, outside the
//! timed part.

use bytes::Bytes;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode,
    Throughput,
};
use felix_engine::format::RecordIn;
use felix_engine::log::{LogConfig, ReadLimits, ShardLog};
use felix_engine::runtime::warm_up_dma;
use felix_engine::storage::dma::DmaStorage;
use felix_engine::storage::sim::SimStorage;
use felix_engine::Offset;
use glommio::LocalExecutorBuilder;
use std::path::Path;
use std::time::{Duration, Instant};

/// The grid flushes once per this many bytes of batches (at least once per
/// batch).
const FLUSH_EVERY_BYTES: usize = 1 << 20;

const SIZES: [usize; 3] = [100, 1024, 64 * 1024];
const BATCHES: [usize; 3] = [1, 64, 1024];

fn batch(size: usize, n: usize) -> Vec<RecordIn> {
    let p = Bytes::from(vec![0x5a; size]);
    (0..n)
        .map(|_| RecordIn {
            payload: p.clone(),
            ..Default::default()
        })
        .collect()
}

fn on_executor<R: Send + 'static>(
    f: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = R>>> + Send + 'static,
) -> R {
    LocalExecutorBuilder::default()
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}

/// Time `iters` appends of `n` records of `size` bytes to a fresh log on the
/// real disk, flushing (write + fdatasync) after every `per_flush` batches
/// and once at the end.
fn durable_run(size: usize, n: usize, per_flush: u64, iters: u64) -> Duration {
    on_executor(move || {
        Box::pin(async move {
            let dir = tempfile::tempdir().unwrap();
            warm_up_dma(dir.path()).await.unwrap();
            let log = ShardLog::open(
                DmaStorage::new(),
                &dir.path().join("s"),
                LogConfig::default(),
                &mut |_| {},
            )
            .await
            .unwrap();
            let recs = batch(size, n);
            let t = Instant::now();
            for i in 0..iters {
                log.append(&recs).unwrap();
                if (i + 1) % per_flush == 0 {
                    log.flush().await.unwrap();
                }
            }
            log.flush().await.unwrap();
            t.elapsed()
        })
    })
}

fn bench_durable(
    g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    size: usize,
    n: usize,
    per_flush: u64,
) {
    g.throughput(Throughput::Bytes((size * n) as u64));
    g.bench_with_input(
        BenchmarkId::new(format!("{size}B"), n),
        &(size, n),
        |b, &(size, n)| b.iter_custom(|iters| durable_run(size, n, per_flush, iters)),
    );
}

/// The grid: fsyncs amortised over up to 1 MiB of batches.
fn durable_append(c: &mut Criterion) {
    let mut g = c.benchmark_group("durable_append");
    for size in SIZES {
        for n in BATCHES {
            let big = size * n > 16 << 20;
            if big {
                // 64 MiB a batch: ten samples of one batch each.
                g.sample_size(10)
                    .sampling_mode(SamplingMode::Flat)
                    .measurement_time(Duration::from_secs(1))
                    .warm_up_time(Duration::from_millis(100));
            } else {
                g.sample_size(10)
                    .sampling_mode(SamplingMode::Auto)
                    .measurement_time(Duration::from_secs(3))
                    .warm_up_time(Duration::from_millis(500));
            }
            let per_flush = (FLUSH_EVERY_BYTES / (size * n)).max(1) as u64;
            bench_durable(&mut g, size, n, per_flush);
        }
    }
    g.finish();
}

/// One fdatasync per batch, where the grid amortises.
fn durable_append_sync_each_batch(c: &mut Criterion) {
    let mut g = c.benchmark_group("durable_append_sync_each_batch");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    for size in SIZES {
        for n in BATCHES {
            if size * n < FLUSH_EVERY_BYTES {
                bench_durable(&mut g, size, n, 1);
            }
        }
    }
    g.finish();
}

fn sequential_read(c: &mut Criterion) {
    let mut g = c.benchmark_group("sequential_read");
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    let total = 64usize << 20;
    g.throughput(Throughput::Bytes(total as u64));
    g.bench_function("1KiB_cold", |b| {
        b.iter_custom(|iters| {
            on_executor(move || {
                Box::pin(async move {
                    let dir = tempfile::tempdir().unwrap();
                    warm_up_dma(dir.path()).await.unwrap();
                    let cfg = LogConfig {
                        read_cache_bytes: 0,
                        ..LogConfig::default()
                    };
                    let log =
                        ShardLog::open(DmaStorage::new(), &dir.path().join("s"), cfg, &mut |_| {})
                            .await
                            .unwrap();
                    let recs = batch(1024, 1024);
                    for _ in 0..(total / (1024 * 1024)) {
                        log.append(&recs).unwrap();
                        log.flush().await.unwrap();
                    }
                    let mut elapsed = Duration::ZERO;
                    for _ in 0..iters {
                        let t = Instant::now();
                        let mut at = Offset::ZERO;
                        loop {
                            let r = log
                                .read(
                                    at,
                                    ReadLimits {
                                        max_records: 1000,
                                        max_bytes: 4 << 20,
                                    },
                                )
                                .await
                                .unwrap();
                            if r.records.is_empty() {
                                break;
                            }
                            at = r.next;
                        }
                        elapsed += t.elapsed();
                    }
                    elapsed
                })
            })
        })
    });
    g.finish();
}

fn memory_append(c: &mut Criterion) {
    let mut g = c.benchmark_group("append_cpu_in_memory");
    for size in [100usize, 1024] {
        let n = 64;
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(
            BenchmarkId::new(format!("{size}B_x64"), n),
            &size,
            |b, &size| {
                let storage = SimStorage::new();
                let log = futures_lite::future::block_on(ShardLog::open(
                    storage,
                    Path::new("/b"),
                    LogConfig {
                        segment_bytes: 1 << 40,
                        ..LogConfig::default()
                    },
                    &mut |_| {},
                ))
                .unwrap();
                let recs = batch(size, n);
                let mut i = 0u64;
                b.iter(|| {
                    log.append(&recs).unwrap();
                    i += 1;
                    if i.is_multiple_of(64) {
                        futures_lite::future::block_on(log.flush()).unwrap();
                    }
                });
            },
        );
    }
    g.finish();
}

criterion_group!(
    benches,
    durable_append,
    durable_append_sync_each_batch,
    sequential_read,
    memory_append
);
criterion_main!(benches);

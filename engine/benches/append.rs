//! Durable append and sequential read throughput of the shard log on the real
//! disk (glommio DMA, fdatasync per flush), and the CPU cost of appending to
//! the in-memory disk. Figures are recorded in `perf/README.md`.
//!
//! Each durable sample appends `iters` batches; a flush (one write + one
//! fdatasync) covers up to `FLUSH_EVERY_BYTES` of them, the way group commit
//! covers whatever concurrent publishers queued.

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use felix_engine::format::RecordIn;
use felix_engine::log::{LogConfig, ReadLimits, ShardLog};
use felix_engine::runtime::warm_up_dma;
use felix_engine::storage::dma::DmaStorage;
use felix_engine::storage::sim::SimStorage;
use felix_engine::Offset;
use glommio::LocalExecutorBuilder;
use std::path::Path;
use std::time::{Duration, Instant};

const FLUSH_EVERY_BYTES: usize = 1 << 20;

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

fn durable_append(c: &mut Criterion) {
    let mut g = c.benchmark_group("durable_append");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    for size in [100usize, 1024, 64 * 1024] {
        for n in [1usize, 64, 1024] {
            if size * n > 16 << 20 {
                continue;
            }
            g.throughput(Throughput::Bytes((size * n) as u64));
            g.bench_with_input(
                BenchmarkId::new(format!("{size}B"), n),
                &(size, n),
                |b, &(size, n)| {
                    b.iter_custom(|iters| {
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
                                let per_flush = (FLUSH_EVERY_BYTES / (size * n)).max(1) as u64;
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
                    })
                },
            );
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

criterion_group!(benches, durable_append, sequential_read, memory_append);
criterion_main!(benches);

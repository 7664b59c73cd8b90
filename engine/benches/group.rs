//! CPU cost of the consumer-group tracker's hot path (no I/O): a poll that
//! claims N new records followed by one ack of all of them, acks arriving
//! out of order under a deep in-flight window, nack + redelivery, and
//! poll + ack of a group holding many dead letters (a poison queue never
//! cleaned up: the list has no bound, so nothing per ack may walk it).
//! Figures are recorded in `perf/README.md`.
//!
//! Run with `cargo bench -p felix-engine --bench group`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use felix_engine::group::{Caller, GroupConfig, GroupTracker, LogView, Lookup, StartAt};
use felix_engine::Offset;
use std::hint::black_box;
use std::time::{Duration, Instant};

const T0_MS: u64 = 1_700_000_000_000;
/// A log far longer than any benchmark consumes: the tail never limits.
const LOG: LogView = LogView {
    start: Offset(0),
    end: Offset(1 << 40),
};

fn tracker(max_in_flight: u32) -> GroupTracker {
    let config = GroupConfig {
        max_in_flight,
        ..GroupConfig::default()
    };
    let mut t = GroupTracker::new("workers", config);
    t.create(T0_MS, StartAt::Offset(Offset(0)), LOG)
        .expect("create at 0");
    t
}

fn record(_: Offset) -> Lookup {
    Lookup::Record { payload_bytes: 100 }
}

/// Poll `n` new records, then ack them all in one request: one consumer's
/// steady state.
fn poll_then_ack(c: &mut Criterion) {
    let mut g = c.benchmark_group("group_poll_ack");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let caller = Caller::anonymous(1);
    for n in [1u32, 100, 1000] {
        g.throughput(Throughput::Elements(u64::from(n)));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let mut t = tracker(10_000);
                let mut offsets = Vec::with_capacity(n as usize);
                let start = Instant::now();
                for i in 0..iters {
                    let now = T0_MS + i;
                    let out = t.poll(now, &caller, n, None, LOG, &mut record);
                    offsets.clear();
                    offsets.extend(out.deliveries.iter().map(|d| d.offset));
                    black_box(t.ack(now, &offsets, LOG).expect("ack"));
                }
                start.elapsed()
            })
        });
    }
    g.finish();
}

/// Polls only (claims accumulate up to a large in-flight cap, then the
/// tracker is replaced): the cost of handing out records.
fn poll_only(c: &mut Criterion) {
    let mut g = c.benchmark_group("group_poll");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let caller = Caller::anonymous(1);
    let n = 100u32;
    let cap = 1_000_000u32;
    g.throughput(Throughput::Elements(u64::from(n)));
    g.bench_function(BenchmarkId::from_parameter(n), |b| {
        b.iter_custom(|iters| {
            let mut t = tracker(cap);
            let mut elapsed = Duration::ZERO;
            let mut start = Instant::now();
            for i in 0..iters {
                if t.in_flight() + n > cap {
                    elapsed += start.elapsed();
                    t = tracker(cap);
                    start = Instant::now();
                }
                black_box(t.poll(T0_MS + i, &caller, n, None, LOG, &mut record));
            }
            elapsed + start.elapsed()
        })
    });
    g.finish();
}

/// Ten consumers keep 1,000 records in flight each and ack in the order
/// they finish (interleaved): the position settles through holes.
fn acks_out_of_order(c: &mut Criterion) {
    let mut g = c.benchmark_group("group_ack_interleaved");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let consumers: Vec<Caller> = (0..10).map(Caller::anonymous).collect();
    let per_poll = 100u32;
    g.throughput(Throughput::Elements(u64::from(per_poll)));
    g.bench_function("10x100", |b| {
        b.iter_custom(|iters| {
            let mut t = tracker(10_000);
            // Each consumer holds a queue of polled batches; the oldest batch
            // of consumer (i % 10) is acked, then it polls again.
            let mut held: Vec<std::collections::VecDeque<Vec<Offset>>> =
                vec![Default::default(); consumers.len()];
            for (k, caller) in consumers.iter().enumerate() {
                for _ in 0..(k % 3 + 1) {
                    let out = t.poll(T0_MS, caller, per_poll, None, LOG, &mut record);
                    held[k].push_back(out.deliveries.iter().map(|d| d.offset).collect());
                }
            }
            let start = Instant::now();
            for i in 0..iters {
                let k = (i as usize * 7) % consumers.len();
                let now = T0_MS + i;
                if let Some(batch) = held[k].pop_front() {
                    black_box(t.ack(now, &batch, LOG).expect("ack"));
                }
                let out = t.poll(now, &consumers[k], per_poll, None, LOG, &mut record);
                held[k].push_back(out.deliveries.iter().map(|d| d.offset).collect());
            }
            start.elapsed()
        })
    });
    g.finish();
}

/// Poll 100, nack 10 of them, ack the rest; the next poll hands the owed
/// records out first.
fn nack_and_redeliver(c: &mut Criterion) {
    let mut g = c.benchmark_group("group_nack_redeliver");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let caller = Caller::anonymous(1);
    let n = 100u32;
    g.throughput(Throughput::Elements(u64::from(n)));
    g.bench_function("100_nack_10pct", |b| {
        b.iter_custom(|iters| {
            let mut t = tracker(10_000);
            let mut acks = Vec::with_capacity(n as usize);
            let start = Instant::now();
            for i in 0..iters {
                let now = T0_MS + i;
                let out = t.poll(now, &caller, n, None, LOG, &mut record);
                acks.clear();
                for (j, d) in out.deliveries.iter().enumerate() {
                    if j % 10 == 0 && d.attempts == 1 {
                        black_box(
                            t.nack(now, d.offset, d.attempts, None, None, LOG)
                                .expect("nack"),
                        );
                    } else {
                        acks.push(d.offset);
                    }
                }
                black_box(t.ack(now, &acks, LOG).expect("ack"));
            }
            start.elapsed()
        })
    });
    g.finish();
}

/// Poll 1 and ack it, in a group whose first `n` records were given up on
/// by their consumer (dead letters below the position, never discarded).
fn ack_beside_dead_letters(c: &mut Criterion) {
    let mut g = c.benchmark_group("group_poll_ack_dead_letters");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let caller = Caller::anonymous(1);
    for n in [0u32, 100_000] {
        g.throughput(Throughput::Elements(1));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let mut t = tracker(n.max(1));
            let mut given_up = 0;
            while given_up < n {
                let out = t.poll(T0_MS, &caller, 1_000, None, LOG, &mut record);
                for d in &out.deliveries {
                    t.dead_letter(T0_MS, d.offset, d.attempts, None, LOG)
                        .expect("dead letter");
                }
                given_up += out.deliveries.len() as u32;
            }
            b.iter_custom(|iters| {
                let start = Instant::now();
                for i in 0..iters {
                    let now = T0_MS + 1 + i;
                    let out = t.poll(now, &caller, 1, None, LOG, &mut record);
                    let offset = out.deliveries[0].offset;
                    black_box(t.ack(now, &[offset], LOG).expect("ack"));
                }
                start.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    poll_then_ack,
    poll_only,
    acks_out_of_order,
    nack_and_redeliver,
    ack_beside_dead_letters
);
criterion_main!(benches);

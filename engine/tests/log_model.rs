//! Model-based and crash-consistency tests of the shard log on the simulated
//! disk. Each case is a random schedule from a seed; a failure prints the seed
//! and `FELIX_SIM_SEED=<seed>` replays exactly that case.

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::log::{
    Frontier, LogConfig, LogError, ReadLimits, ReadResult, Replayed, ShardLog,
};
use felix_engine::storage::sim::{CrashPlan, SimStorage};
use felix_engine::Offset;
use futures_lite::future::block_on;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::Path;

fn cases(default: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var("FELIX_SIM_SEED") {
        return vec![s.parse().expect("FELIX_SIM_SEED is a number")];
    }
    let n = std::env::var("FELIX_SIM_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    let base: u64 = rand::random();
    (0..n).map(|i| base.wrapping_add(i)).collect()
}

fn run_cases(name: &str, default: u64, f: impl Fn(u64) + std::panic::RefUnwindSafe) {
    for seed in cases(default) {
        if let Err(e) = std::panic::catch_unwind(|| f(seed)) {
            eprintln!("{name} failed; replay with FELIX_SIM_SEED={seed}");
            std::panic::resume_unwind(e);
        }
    }
}

fn small_config(rng: &mut SmallRng) -> LogConfig {
    LogConfig {
        segment_bytes: rng.gen_range(512..16_384),
        read_cache_bytes: rng.gen_range(0..8192),
        io_depth: rng.gen_range(1..4),
        write_chunk_bytes: 4096 * rng.gen_range(1..3),
        index_interval_bytes: rng.gen_range(64..2048),
        read_chunk_bytes: rng.gen_range(64..4096),
        cold_chunks: rng.gen_range(0..4),
        // Half the cases reserve each segment up front: recovery then meets
        // a last segment that reads as zeros past its data, and sealing
        // must cut that reservation off.
        preallocate: rng.gen_bool(0.5),
        preallocate_step: 4096 * rng.gen_range(1..5),
        ..LogConfig::default()
    }
}

fn payload(offset_hint: u64, rng: &mut SmallRng) -> Bytes {
    let len = if rng.gen_ratio(1, 20) {
        rng.gen_range(2000..6000)
    } else {
        rng.gen_range(0..300)
    };
    let mut v = format!("r{offset_hint}:").into_bytes();
    v.resize(v.len() + len, (offset_hint % 251) as u8);
    Bytes::from(v)
}

fn record(p: Bytes, rng: &mut SmallRng) -> RecordIn {
    RecordIn {
        timestamp_ms: 1_000 + rng.gen_range(0..100),
        key: rng.gen_bool(0.3).then(|| Bytes::from_static(b"key")),
        headers: if rng.gen_bool(0.2) {
            vec![("h".into(), Bytes::from_static(b"v"))]
        } else {
            vec![]
        },
        payload: p,
    }
}

/// What a record appended as `r` holds once read back
/// ([`felix_engine::format::Record::memory_bytes`]): what it carries (key,
/// header names and values, payload) and its headers' lengths, held with
/// them (two bytes for a name's, four for a value's).
fn held(r: &RecordIn) -> usize {
    r.key.as_ref().map_or(0, |k| k.len())
        + r.headers
            .iter()
            .map(|(n, v)| n.len() + v.len() + 6)
            .sum::<usize>()
        + r.payload.len()
}

async fn open(s: &SimStorage, cfg: &LogConfig) -> ShardLog<SimStorage> {
    ShardLog::open(s.clone(), Path::new("/d/t/n/s/0"), cfg.clone(), &mut |_| {})
        .await
        .expect("open")
}

async fn read_all(log: &ShardLog<SimStorage>, from: Offset) -> Vec<(u64, Bytes)> {
    let mut out = Vec::new();
    let mut at = from;
    loop {
        let r = log
            .read(
                at,
                ReadLimits {
                    max_records: 7,
                    max_bytes: 5000,
                },
            )
            .await
            .expect("read");
        if r.records.is_empty() {
            assert!(
                r.next >= r.end || r.next > at,
                "read made no progress at {at:?}"
            );
            if r.next >= r.end {
                return out;
            }
        }
        for rec in &r.records {
            out.push((rec.offset.0, rec.payload.clone()));
        }
        at = r.next;
    }
}

/// Limits for one read: tight, loose or unbounded in each unit.
fn random_limits(rng: &mut SmallRng) -> ReadLimits {
    ReadLimits {
        max_records: if rng.gen_bool(0.1) {
            usize::MAX
        } else {
            rng.gen_range(1..12)
        },
        max_bytes: match rng.gen_range(0..4) {
            0 => rng.gen_range(0..64),
            1 => rng.gen_range(64..1_000),
            2 => rng.gen_range(1_000..10_000),
            _ => usize::MAX,
        },
    }
}

/// Check one read from `at` within `limits` against the model (`model`:
/// offset and payload of every record appended, in order; `sizes`: the
/// bytes each holds once read, key and headers included). The read's contract:
///
/// * it starts at `at`, or at the log's start if `at` is below it, and
///   returns exactly the records from there up to `next`, none skipped;
/// * at most `max_records` of them;
/// * their bytes (key, headers and their table, payload) stay within `max_bytes`, except
///   that the first record is returned whatever its size (so a reader is
///   never stuck before a large record);
/// * it stops short of `max_records` with visible records left only when
///   the next would cross the byte cap (or the cap is reached);
/// * with neither cap reached and no record left, `next` is the end.
fn check_read(
    at: Offset,
    limits: ReadLimits,
    r: &ReadResult,
    start: Offset,
    end: Offset,
    model: &[(u64, Bytes)],
    sizes: &BTreeMap<u64, usize>,
) {
    let ctx = format!("read from {at:?} with {limits:?}");
    assert_eq!((r.start, r.end), (start, end), "{ctx}");
    let from = at.max(start);
    assert!(r.next >= from, "{ctx}: next {:?} went back", r.next);
    if from < end {
        assert!(r.next <= end, "{ctx}: next {:?} past the end", r.next);
    }
    assert!(
        r.records.len() <= limits.max_records,
        "{ctx}: {} records",
        r.records.len()
    );
    let held: usize = r.records.iter().map(|x| x.memory_bytes()).sum();
    assert_eq!(r.bytes, held, "{ctx}: the bytes reported");
    if r.records.len() > 1 {
        assert!(
            r.bytes <= limits.max_bytes,
            "{ctx}: {} records carrying {} bytes",
            r.records.len(),
            r.bytes
        );
    }
    let lo = model.partition_point(|(o, _)| *o < from.0);
    let hi = model.partition_point(|(o, _)| *o < r.next.0);
    let got: Vec<(u64, Bytes)> = r
        .records
        .iter()
        .map(|x| (x.offset.0, x.payload.clone()))
        .collect();
    assert_eq!(
        got,
        model[lo..hi.max(lo)],
        "{ctx}: not the records from {from:?} to {:?}",
        r.next
    );
    for rec in &r.records {
        assert_eq!(rec.memory_bytes(), sizes[&rec.offset.0], "{ctx}: {rec:?}");
    }
    let left = model[hi.max(lo)..].first().filter(|(o, _)| *o < end.0);
    let byte_capped =
        |next: usize| r.bytes >= limits.max_bytes || r.bytes + next > limits.max_bytes;
    match left {
        Some((o, _)) => {
            assert!(
                !r.records.is_empty() || limits.max_records == 0,
                "{ctx}: nothing returned, {o} there"
            );
            if r.records.len() < limits.max_records {
                assert!(
                    byte_capped(sizes[o]),
                    "{ctx}: stopped after {} records and {} bytes with record {o} ({} \
                     bytes) left",
                    r.records.len(),
                    r.bytes,
                    sizes[o]
                );
            }
        }
        None => {
            let capped = r.records.len() >= limits.max_records || r.bytes >= limits.max_bytes;
            if !capped && from < end {
                assert_eq!(r.next, end, "{ctx}: stopped short with nothing left");
            }
        }
    }
}

/// [`read_all`] with limits drawn for every read, each read checked by
/// [`check_read`] against the model.
async fn read_all_checked(
    log: &ShardLog<SimStorage>,
    from: Offset,
    model: &[(u64, Bytes)],
    sizes: &BTreeMap<u64, usize>,
    rng: &mut SmallRng,
) -> Vec<(u64, Bytes)> {
    let mut out = Vec::new();
    let mut at = from;
    loop {
        let limits = random_limits(rng);
        let r = log.read(at, limits).await.expect("read");
        check_read(at, limits, &r, log.start(), log.end(), model, sizes);
        if r.records.is_empty() && r.next >= r.end {
            return out;
        }
        assert!(r.next > at, "read made no progress at {at:?}");
        for rec in &r.records {
            out.push((rec.offset.0, rec.payload.clone()));
        }
        at = r.next;
    }
}

/// Check one pass of retention by bytes (`limit`) that removed `removed`
/// segments, given the segment sizes before and after it (everything
/// durable): it removed whole segments, oldest first, never the active one;
/// the start is the base of the oldest kept; and it removed exactly what
/// the rule asks: the oldest sealed segments while the shard holds more
/// than the limit. So with sealed segments left the shard is within the
/// limit, and before the last removal it was not.
fn check_retention_by_bytes(
    limit: Option<u64>,
    before: &[(Offset, u64)],
    removed: usize,
    after: &[(Offset, u64)],
    start: Offset,
) {
    let total = |s: &[(Offset, u64)]| s.iter().map(|x| x.1).sum::<u64>();
    let ctx = format!("limit {limit:?}, segments {before:?}, removed {removed}");
    assert!(removed < before.len(), "{ctx}: the active segment went");
    assert_eq!(
        after,
        &before[removed..],
        "{ctx}: not whole oldest segments"
    );
    assert_eq!(
        start, after[0].0,
        "{ctx}: start is not the oldest base kept"
    );
    match limit {
        None => assert_eq!(removed, 0, "{ctx}: no limit"),
        Some(limit) => {
            if after.len() > 1 {
                assert!(
                    total(after) <= limit,
                    "{ctx}: kept {} bytes with sealed segments left",
                    total(after)
                );
            }
            if removed > 0 {
                assert!(
                    total(&before[removed - 1..]) > limit,
                    "{ctx}: removed more than the limit asks"
                );
            }
        }
    }
}

/// Random appends, flushes, reads, retention and reopens against a model:
/// what the log returns is exactly the model's records from the start offset.
/// Reads use limits drawn per read and each is checked against the read
/// contract (see [`check_read`]); each retention pass against the rule.
#[test]
fn log_matches_model_under_random_operations() {
    run_cases("log_matches_model", 2000, |seed| {
        let mut rng = SmallRng::seed_from_u64(seed);
        let storage = SimStorage::new();
        let mut cfg = small_config(&mut rng);
        if rng.gen_bool(0.5) {
            cfg.retention_bytes = Some(rng.gen_range(2_000..20_000));
        }
        block_on(async {
            let mut log = open(&storage, &cfg).await;
            let mut model: Vec<(u64, Bytes)> = Vec::new();
            let mut sizes: BTreeMap<u64, usize> = BTreeMap::new();
            for _ in 0..rng.gen_range(10..120) {
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let n = rng.gen_range(1..6);
                        let base = log.queued_end().0;
                        let recs: Vec<RecordIn> = (0..n)
                            .map(|i| {
                                let p = payload(base + i, &mut rng);
                                record(p, &mut rng)
                            })
                            .collect();
                        let a = log.append(&recs).unwrap();
                        assert_eq!(a.base.0, base);
                        for (i, r) in recs.iter().enumerate() {
                            model.push((base + i as u64, r.payload.clone()));
                            sizes.insert(base + i as u64, held(r));
                        }
                        if rng.gen_bool(0.1) {
                            log.append_group(b"group-entry").unwrap();
                        }
                        if rng.gen_bool(0.05) {
                            log.append_control(b"ctl").unwrap();
                        }
                    }
                    5 => log.flush().await.unwrap(),
                    6 => {
                        // Appends arriving while a flush is in flight (a
                        // roll among them) join the next flush.
                        storage.set_yielding(true);
                        let mut flush = std::pin::pin!(log.flush());
                        let first = futures_lite::future::poll_once(&mut flush).await;
                        for _ in 0..rng.gen_range(1..4) {
                            let base = log.queued_end().0;
                            let r = record(payload(base, &mut rng), &mut rng);
                            log.append(std::slice::from_ref(&r)).unwrap();
                            model.push((base, r.payload.clone()));
                            sizes.insert(base, held(&r));
                        }
                        if first.is_none() {
                            if rng.gen_bool(0.5) {
                                // A second flush called meanwhile returns
                                // once all of it is durable too.
                                let (a, b) = futures_lite::future::zip(flush, async {
                                    let r = log.flush().await;
                                    assert_eq!(log.end(), log.queued_end(), "seed {seed}");
                                    r
                                })
                                .await;
                                a.unwrap();
                                b.unwrap();
                            } else {
                                flush.await.unwrap();
                            }
                        }
                        storage.set_yielding(false);
                    }
                    7 => {
                        // Mostly of everything; sometimes only up to the
                        // durable end, with more queued past it.
                        if rng.gen_bool(0.7) {
                            log.flush().await.unwrap();
                        }
                        let (start, end) = (log.start(), log.end());
                        let from = Offset(rng.gen_range(0..=end.0 + 1));
                        if rng.gen_bool(0.1) {
                            let limits = ReadLimits {
                                max_records: 0,
                                max_bytes: usize::MAX,
                            };
                            let r = log.read(from, limits).await.unwrap();
                            check_read(from, limits, &r, start, end, &model, &sizes);
                            assert!(r.records.is_empty(), "seed {seed}: read of 0 records");
                        }
                        let got = read_all_checked(&log, from, &model, &sizes, &mut rng).await;
                        let want: Vec<_> = model
                            .iter()
                            .filter(|(o, _)| *o >= from.max(start).0 && *o < end.0)
                            .cloned()
                            .collect();
                        assert_eq!(got, want, "seed {seed}: read from {from:?}");
                    }
                    8 => {
                        log.flush().await.unwrap();
                        let before = log.segment_sizes();
                        let removed = log.enforce_retention(u64::MAX / 2).await.unwrap();
                        let after = log.segment_sizes();
                        check_retention_by_bytes(
                            cfg.retention_bytes,
                            &before,
                            removed,
                            &after,
                            log.start(),
                        );
                        let s = log.stats();
                        assert_eq!(s.bytes, after.iter().map(|x| x.1).sum::<u64>());
                        assert_eq!(s.segments as usize, after.len());
                    }
                    _ => {
                        log.close().await.unwrap();
                        log = open(&storage, &cfg).await;
                    }
                }
            }
            log.flush().await.unwrap();
            let start = log.start();
            let got = read_all_checked(&log, Offset::ZERO, &model, &sizes, &mut rng).await;
            let want: Vec<_> = model
                .iter()
                .filter(|(o, _)| *o >= start.0)
                .cloned()
                .collect();
            assert_eq!(got, want);
            if cfg.retention_bytes.is_none() {
                assert_eq!(start, Offset::ZERO);
            }
        });
    });
}

/// After any prefix of operations and any crash (lose unsynced data, tear the
/// last write or land its pages in any subset, flip a bit in the unsynced
/// tail, lose directory entries not synced: a new segment vanishes, a
/// segment retention removed comes back), recovery yields exactly a run of
/// what was appended that includes everything acknowledged durable: never
/// less, never garbage.
#[test]
fn recovery_keeps_every_durable_record_and_nothing_else() {
    run_cases("recovery", 2000, |seed| {
        let mut rng = SmallRng::seed_from_u64(seed);
        let storage = SimStorage::new();
        let mut cfg = small_config(&mut rng);
        let retention = rng.gen_bool(0.3);
        if retention {
            cfg.retention_bytes = Some(rng.gen_range(1_000..10_000));
        }
        block_on(async {
            let mut appended: Vec<(u64, Bytes)> = Vec::new();
            let mut group_entries_durable = 0usize;
            let mut group_entries_all = 0usize;
            let mut durable_end = 0u64;
            for _round in 0..rng.gen_range(1..4) {
                let log = open(&storage, &cfg).await;
                assert!(log.end().0 >= durable_end);
                let mut mid_retention = false;
                for _ in 0..rng.gen_range(1..40) {
                    let n = rng.gen_range(1..5);
                    let base = log.queued_end().0;
                    let recs: Vec<RecordIn> = (0..n)
                        .map(|i| {
                            let p = payload(base + i, &mut rng);
                            record(p, &mut rng)
                        })
                        .collect();
                    log.append(&recs).unwrap();
                    for (i, r) in recs.iter().enumerate() {
                        appended.truncate((base + i as u64) as usize);
                        appended.push((base + i as u64, r.payload.clone()));
                    }
                    if rng.gen_bool(0.2) {
                        log.append_group(b"g").unwrap();
                        group_entries_all += 1;
                    }
                    if rng.gen_bool(0.4) {
                        log.flush().await.unwrap();
                        durable_end = log.end().0;
                        group_entries_durable = group_entries_all;
                        if retention && rng.gen_bool(0.2) {
                            // The power goes out while retention removes
                            // segments (between any two of its removals
                            // and directory syncs).
                            storage.set_yielding(true);
                            let mut run = std::pin::pin!(log.enforce_retention(u64::MAX / 2));
                            for _ in 0..rng.gen_range(0..8) {
                                if futures_lite::future::poll_once(&mut run).await.is_some() {
                                    break;
                                }
                            }
                            storage.set_yielding(false);
                            mid_retention = true;
                            break;
                        }
                        if retention && rng.gen_bool(0.3) {
                            log.enforce_retention(u64::MAX / 2).await.unwrap();
                        }
                    }
                }
                let start = log.start().0;
                // Partly written, never synced: write without the final sync
                // is not reachable through the API, so crash mid-way instead
                // by queuing more and crashing before/after a flush.
                if !mid_retention && rng.gen_bool(0.5) {
                    let base = log.queued_end().0;
                    let p = payload(base, &mut rng);
                    log.append(&[record(p.clone(), &mut rng)]).unwrap();
                    appended.truncate(base as usize);
                    appended.push((base, p));
                    if rng.gen_bool(0.3) {
                        storage.fail_sync_after(1);
                        let _ = log.flush().await;
                    } else if rng.gen_bool(0.7) {
                        // The power goes out while the flush's fsync is in
                        // flight: its writes are on the device, unsynced.
                        storage.hang_sync_after(1);
                        let pending = futures_lite::future::poll_once(log.flush()).await;
                        assert!(pending.is_none(), "flush should hang in fsync");
                    }
                }
                storage.crash(CrashPlan {
                    seed: rng.gen(),
                    tear: rng.gen_bool(0.7),
                    flip_bit: rng.gen_bool(0.5),
                    reorder: rng.gen_bool(0.3),
                    dir_entries: rng.gen_bool(0.7),
                });
                // Recovery: a run up to at least the durable end, from at
                // most where the log started (a segment whose removal was
                // not synced may come back).
                let mut groups = 0usize;
                let log = ShardLog::open(
                    storage.clone(),
                    Path::new("/d/t/n/s/0"),
                    cfg.clone(),
                    &mut |e| {
                        if let Replayed::Group(_) = e {
                            groups += 1
                        }
                    },
                )
                .await
                .unwrap_or_else(|e| panic!("seed {seed}: reopen failed: {e}"));
                let end = log.end().0;
                assert!(
                    end >= durable_end,
                    "seed {seed}: lost durable records: end {end} < {durable_end}"
                );
                let new_start = log.start().0;
                assert!(
                    new_start <= start,
                    "seed {seed}: lost records: start {new_start} > {start}"
                );
                if !retention {
                    // (Retention removes group entries with their segments.)
                    assert!(
                        groups >= group_entries_durable,
                        "seed {seed}: lost group entries"
                    );
                }
                let got = read_all(&log, Offset::ZERO).await;
                assert_eq!(got.len() as u64, end - new_start, "seed {seed}");
                assert_eq!(
                    &got[..],
                    &appended[new_start as usize..end as usize],
                    "seed {seed}: recovered garbage"
                );
                appended.truncate(end as usize);
                durable_end = end;
                group_entries_all = groups;
                group_entries_durable = groups;
                log.close().await.unwrap();
            }
        });
    });
}

/// A failed fsync stops the shard: the waiter gets an error, later appends
/// are refused, nothing pretends to be durable.
#[test]
fn failed_fsync_stops_the_shard() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage, &LogConfig::default()).await;
        let a = log
            .append(&[RecordIn {
                payload: Bytes::from_static(b"x"),
                ..Default::default()
            }])
            .unwrap();
        storage.fail_sync_after(1);
        assert!(log.flush().await.is_err());
        assert!(log.wait(a.lsn, Frontier::Durable).await.is_err());
        assert!(log.append(&[RecordIn::default()]).is_err());
        assert!(log.stopped().is_some());
        assert_eq!(log.end(), Offset::ZERO);
    });
}

/// A shard whose flush failed while it was being closed stays stopped: a
/// later flush is an error, not a round with nothing to sync that marks the
/// failed round's writes durable.
#[test]
fn a_failed_flush_during_close_is_never_marked_durable() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage, &LogConfig::default()).await;
        let a = log.append(&[RecordIn::default()]).unwrap();
        storage.fail_sync_after(1);
        assert!(log.close().await.is_err(), "close reports the failed round");
        assert!(log.stopped().is_some());
        assert!(log.flush().await.is_err(), "a stopped, closed log");
        assert!(log.wait(a.lsn, Frontier::Durable).await.is_err());
        assert_eq!(log.end(), Offset::ZERO, "nothing durable");
        assert!(log.close().await.is_err(), "closing again still says why");
    });
}

/// A failed write stops the shard the same way.
#[test]
fn failed_write_stops_the_shard() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage, &LogConfig::default()).await;
        log.append(&[RecordIn::default()]).unwrap();
        storage.fail_write_after(1);
        assert!(log.flush().await.is_err());
        assert!(log.append(&[RecordIn::default()]).is_err());
    });
}

/// A corrupt batch in the middle of a sealed segment is never skipped. An
/// open that takes the segment's summary for what it holds does not read
/// it: the first read that meets the batch fails, naming the file and byte,
/// and reads before it are served. An open that scans it (no summary, or
/// `verify_on_open`) refuses the shard and says the same.
#[test]
fn corruption_in_a_sealed_segment_is_met_by_reads_or_refuses_the_open_and_says_where() {
    let storage = SimStorage::new();
    let cfg = LogConfig {
        segment_bytes: 1000,
        read_cache_bytes: 0,
        cold_chunks: 0,
        ..LogConfig::default()
    };
    let at = |msg: &str| {
        assert!(msg.contains("00000000000000000000.log"), "{msg}");
        assert!(msg.contains("corrupt at byte"), "{msg}");
    };
    block_on(async {
        let log = open(&storage, &cfg).await;
        for i in 0..50u64 {
            log.append(&[RecordIn {
                payload: Bytes::from(vec![i as u8; 100]),
                ..Default::default()
            }])
            .unwrap();
            log.flush().await.unwrap();
        }
        log.close().await.unwrap();
        let first = storage
            .files()
            .into_iter()
            .find(|p| p.ends_with("00000000000000000000.log"))
            .unwrap();
        storage.corrupt(&first, 200, 3);

        let log = open(&storage, &cfg).await;
        let limits = ReadLimits {
            max_records: 1000,
            max_bytes: usize::MAX,
        };
        let err = log.read(Offset(0), limits).await.unwrap_err();
        assert!(matches!(err, LogError::Corrupt { .. }), "{err}");
        at(&err.to_string());
        assert!(log.stats().segments >= 3);
        let r = log.read(Offset(20), limits).await.unwrap();
        assert_eq!(r.records.first().map(|r| r.offset), Some(Offset(20)));
        log.close().await.unwrap();

        let verify = LogConfig {
            verify_on_open: true,
            ..cfg.clone()
        };
        let scanned = |cfg: LogConfig| {
            let storage = storage.clone();
            async move {
                ShardLog::open(storage, Path::new("/d/t/n/s/0"), cfg, &mut |_| {})
                    .await
                    .map(|_| ())
                    .unwrap_err()
                    .to_string()
            }
        };
        at(&scanned(verify).await);
        let summary = first.with_extension("sum");
        assert!(storage.files().contains(&summary));
        felix_engine::storage::Storage::remove_file(&storage, &summary)
            .await
            .unwrap();
        at(&scanned(cfg.clone()).await);
    });
}

/// A tail cut short after a crash (no clean close) is cut back to the last
/// whole batch.
#[test]
fn a_truncated_tail_recovers_to_the_last_whole_batch() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage, &LogConfig::default()).await;
        for i in 0..10u64 {
            log.append(&[RecordIn {
                payload: Bytes::from(vec![i as u8; 100]),
                ..Default::default()
            }])
            .unwrap();
        }
        log.flush().await.unwrap();
        drop(log);
        let seg = storage
            .files()
            .into_iter()
            .find(|p| p.ends_with("00000000000000000000.log"))
            .unwrap();
        let len = 10 * (40 + 26 + 100);
        storage.cut(&seg, len - 50);
        let log = open(&storage, &LogConfig::default()).await;
        assert_eq!(log.end(), Offset(9));
        let got = read_all(&log, Offset::ZERO).await;
        assert_eq!(got.len(), 9);
        // Appends continue at the recovered end.
        let a = log.append(&[RecordIn::default()]).unwrap();
        assert_eq!(a.base, Offset(9));
    });
}

/// Write amplification: bytes written / payload bytes for 1 KiB records in
/// batches of 64 stays at or under 1.1.
#[test]
fn write_amplification_of_1kib_records_in_batches_of_64() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage, &LogConfig::default()).await;
        let payload = Bytes::from(vec![7u8; 1024]);
        let batch: Vec<RecordIn> = (0..64)
            .map(|_| RecordIn {
                payload: payload.clone(),
                ..Default::default()
            })
            .collect();
        for _ in 0..200 {
            log.append(&batch).unwrap();
            log.flush().await.unwrap();
        }
        let payload_bytes = 200 * 64 * 1024u64;
        let wa = storage.bytes_written() as f64 / payload_bytes as f64;
        eprintln!("write amplification: {wa:.3}");
        assert!(wa <= 1.1, "write amplification {wa:.3}");
    });
}

/// Retention by age removes whole sealed segments whose newest record is
/// older than the limit, never the active segment, and the log's start
/// offset says how far it went.
#[test]
fn retention_by_age_removes_only_old_sealed_segments() {
    let storage = SimStorage::new();
    let cfg = LogConfig {
        segment_bytes: 1000,
        retention_ms: Some(10_000),
        ..LogConfig::default()
    };
    block_on(async {
        let log = open(&storage, &cfg).await;
        // 30 records at t=1000, then 30 at t=50_000; ~5 records per segment.
        for i in 0..60u64 {
            let ts = if i < 30 { 1_000 } else { 50_000 };
            log.append(&[RecordIn {
                timestamp_ms: ts,
                payload: Bytes::from(vec![1u8; 120]),
                ..Default::default()
            }])
            .unwrap();
            log.flush().await.unwrap();
        }
        let before = log.stats().segments;
        // At t=5_000 no segment's newest record is 10 s old yet.
        assert!(
            log.enforce_retention(5_000).await.unwrap() == 0,
            "nothing is old yet"
        );
        let removed = log.enforce_retention(30_000).await.unwrap();
        assert!(removed > 0);
        let start = log.start();
        assert!(start.0 > 0 && start.0 <= 30, "start {start:?}");
        assert_eq!(log.stats().segments, before - removed as u32);
        // Everything from the start is still readable; nothing newer went.
        let got = read_all(&log, Offset::ZERO).await;
        assert_eq!(got.first().unwrap().0, start.0);
        assert_eq!(got.len() as u64, 60 - start.0);
        // Far in the future, every sealed segment goes; the active one stays.
        log.enforce_retention(1_000_000).await.unwrap();
        assert_eq!(log.stats().segments, 1);
        assert_eq!(log.end(), Offset(60));
    });
}

/// A log whose every read below the tail is cold (no recent batches kept),
/// in chunks of 64 KiB.
fn cold_config() -> LogConfig {
    LogConfig {
        read_cache_bytes: 0,
        read_chunk_bytes: 64 << 10,
        ..LogConfig::default()
    }
}

/// A backlog read a few records at a time (a consumer group working through
/// it) goes to disk once a chunk, not once a read.
#[test]
fn small_cold_reads_are_served_from_the_chunk_read_before() {
    let storage = SimStorage::new();
    block_on(async {
        let cfg = cold_config();
        let log = open(&storage, &cfg).await;
        for i in 0..2000u64 {
            log.append(&[RecordIn {
                payload: Bytes::from(vec![(i % 251) as u8; 100]),
                ..Default::default()
            }])
            .unwrap();
        }
        log.flush().await.unwrap();
        let mut next = Offset::ZERO;
        let mut reads = 0u64;
        while next < log.end() {
            next = read_16_checked(&log, next).await;
            reads += 1;
        }
        assert_eq!(reads, 125);
        let s = log.stats();
        // 2,000 batches of 166 bytes: 332,000 bytes, about 6 chunks of 64 KiB.
        assert!(s.cold_reads <= 8, "disk reads {}", s.cold_reads);
        assert!(s.cold_hits >= 100, "chunk hits {}", s.cold_hits);
    });
}

/// Read up to 16 records from `at` and check them against how the backlogs
/// here are written (consecutive offsets, 100-byte payloads of `offset %
/// 251`), with the bytes the read reports; returns where the next read
/// starts, just past them.
async fn read_16_checked(log: &ShardLog<SimStorage>, at: Offset) -> Offset {
    let limits = ReadLimits {
        max_records: 16,
        max_bytes: usize::MAX,
    };
    let r = log.read(at, limits).await.unwrap();
    let held: usize = r.records.iter().map(|x| x.memory_bytes()).sum();
    assert_eq!(r.bytes, held, "the read reports the bytes it returns");
    for (j, rec) in r.records.iter().enumerate() {
        assert_eq!(rec.offset, at.plus(j as u64));
        assert_eq!(rec.payload, vec![(rec.offset.0 % 251) as u8; 100]);
    }
    assert_eq!(r.next, at.plus(r.records.len() as u64));
    r.next
}

/// Append records 0 to `total` (100-byte payloads of `offset % 251`) in
/// batches of 1 to `most` records (the k-th of `1 + k * step % most`), and
/// make them durable.
async fn append_varied_batches(log: &ShardLog<SimStorage>, total: u64, step: u64, most: u64) {
    let (mut n, mut k) = (0u64, 0u64);
    while n < total {
        let count = (1 + (k * step % most)).min(total - n);
        let batch: Vec<RecordIn> = (n..n + count)
            .map(|i| RecordIn {
                payload: Bytes::from(vec![(i % 251) as u8; 100]),
                ..Default::default()
            })
            .collect();
        log.append(&batch).unwrap();
        n += count;
        k += 1;
    }
    log.flush().await.unwrap();
}

/// A reader working forward through a backlog finds each next chunk read
/// ahead (by the shard's read-ahead task) instead of waiting on the disk,
/// including across batches that straddle two chunks; and it gets exactly
/// the records it would have got without.
#[test]
fn a_reader_moving_forward_finds_the_next_chunk_read_ahead() {
    let storage = SimStorage::new();
    block_on(async {
        let cfg = cold_config();
        let log = open(&storage, &cfg).await;
        // Batches of 1 to 60 records: many of them straddle two chunks.
        append_varied_batches(&log, 3000, 37, 60).await;
        storage.set_yielding(true);
        let end = log.end();
        let reader = async {
            let mut next = Offset::ZERO;
            while next < end {
                next = read_16_checked(&log, next).await;
                // The consumer's work: the read-ahead task runs meanwhile.
                for _ in 0..4 {
                    futures_lite::future::yield_now().await;
                }
            }
        };
        futures_lite::future::or(reader, log.run_read_ahead()).await;
        let s = log.stats();
        // About 400 KB of batches: 7 chunks of 64 KiB. The reader reads the
        // first two itself (the second one's miss shows it moving forward);
        // the rest were read ahead.
        assert!(s.cold_reads <= 2, "reader's disk reads {}", s.cold_reads);
        assert!(s.cold_read_ahead >= 4, "read ahead {}", s.cold_read_ahead);
        assert!(s.cold_hits >= 150, "chunk hits {}", s.cold_hits);
    });
}

/// Two readers moving through different parts of a backlog at once (two
/// consumer groups): with room for both, each finds its next chunk read
/// ahead; with room for only the chunks they are in, reading ahead would
/// push out the other's chunk, so it stands back and each reads its own
/// chunks once, as without read-ahead, rather than thrashing.
#[test]
fn read_ahead_for_two_readers_never_pushes_out_a_chunk_in_use() {
    // (chunks kept, most disk reads by the readers, least read ahead, most
    // reads in all): the two readers pass through about 15 chunks.
    for (chunks, most_disk_reads, least_ahead, most_reads) in
        [(4usize, 2u64, 12u64, 16u64), (2, 18, 0, 24)]
    {
        let storage = SimStorage::new();
        block_on(async {
            let cfg = LogConfig {
                cold_chunks: chunks,
                ..cold_config()
            };
            let log = open(&storage, &cfg).await;
            // 5,000 records in batches of 1 to 40: about ten chunks.
            append_varied_batches(&log, 5000, 13, 40).await;
            storage.set_yielding(true);
            let readers = async {
                let (mut a, mut b) = (Offset(0), Offset(2500));
                while a < Offset(5000) || b < Offset(5000) {
                    for at in [&mut a, &mut b] {
                        if *at >= Offset(5000) {
                            continue;
                        }
                        *at = read_16_checked(&log, *at).await;
                    }
                    for _ in 0..4 {
                        futures_lite::future::yield_now().await;
                    }
                }
            };
            futures_lite::future::or(readers, log.run_read_ahead()).await;
            let s = log.stats();
            eprintln!(
                "{chunks} chunks: readers' disk reads {}, read ahead {}, hits {}",
                s.cold_reads, s.cold_read_ahead, s.cold_hits
            );
            assert!(
                s.cold_reads <= most_disk_reads,
                "{chunks} chunks: readers' disk reads {} (read ahead {})",
                s.cold_reads,
                s.cold_read_ahead
            );
            assert!(
                s.cold_read_ahead >= least_ahead,
                "{chunks} chunks: read ahead {}",
                s.cold_read_ahead
            );
            assert!(
                s.cold_reads + s.cold_read_ahead <= most_reads,
                "{chunks} chunks: {} chunks read in all",
                s.cold_reads + s.cold_read_ahead
            );
        });
    }
}

/// A cold read dropped while its disk read is in flight (a poll given up
/// on) does not leave later readers of the same bytes waiting for it.
#[test]
fn a_cold_read_dropped_in_flight_strands_nobody() {
    let storage = SimStorage::new();
    block_on(async {
        let cfg = cold_config();
        let log = open(&storage, &cfg).await;
        for i in 0..100u64 {
            log.append(&[RecordIn {
                payload: Bytes::from(vec![i as u8; 100]),
                ..Default::default()
            }])
            .unwrap();
        }
        log.flush().await.unwrap();
        storage.set_yielding(true);
        let limits = ReadLimits {
            max_records: 10,
            max_bytes: usize::MAX,
        };
        let mut first = Box::pin(log.read(Offset(5), limits));
        assert!(futures_lite::future::poll_once(&mut first).await.is_none());
        drop(first);
        let r = log.read(Offset(5), limits).await.unwrap();
        assert_eq!(r.records.len(), 10);
        assert_eq!(r.records[0].payload[0], 5);
    });
}

/// The shard's flusher task (a round is written and synced while producers
/// keep appending to the next) never acknowledges a record as durable
/// before it is: producers append and wait on the durable frontier
/// while the flusher runs, the disk yields inside every write and sync (so
/// they interleave), syncs fail at random, and the power goes out at a
/// random moment. After recovery every acknowledged record is there, in
/// order, and nothing else but a prefix of what was appended.
#[test]
fn the_flusher_task_acknowledges_only_durable_records() {
    run_cases("flusher", 1000, |seed| {
        let mut rng = SmallRng::seed_from_u64(seed);
        let storage = SimStorage::new();
        storage.set_yielding(true);
        let cfg = small_config(&mut rng);
        let steps = rng.gen_range(5..120);
        let crash_at = rng.gen_range(0..steps + 10);
        let fail_sync = rng.gen_bool(0.2).then(|| rng.gen_range(1..20));
        let plan = CrashPlan {
            seed: rng.gen(),
            tear: rng.gen_bool(0.7),
            flip_bit: rng.gen_bool(0.5),
            reorder: rng.gen_bool(0.3),
            dir_entries: rng.gen_bool(0.7),
        };
        let mut producer_rng = SmallRng::seed_from_u64(rng.gen());
        block_on(async {
            let log = open(&storage, &cfg).await;
            if let Some(n) = fail_sync {
                storage.fail_sync_after(n);
            }
            let appended = std::cell::RefCell::new(Vec::<(u64, Bytes)>::new());
            let acked = std::cell::Cell::new(0u64);
            let producer = async {
                let mut waits = Vec::new();
                for step in 0..steps + 10 {
                    if step == crash_at {
                        break;
                    }
                    if step < steps {
                        let base = log.queued_end().0;
                        let n = producer_rng.gen_range(1..4);
                        let recs: Vec<RecordIn> = (0..n)
                            .map(|i| {
                                record(payload(base + i, &mut producer_rng), &mut producer_rng)
                            })
                            .collect();
                        let Ok(a) = log.append(&recs) else { break };
                        let mut ap = appended.borrow_mut();
                        for (i, r) in recs.iter().enumerate() {
                            ap.push((base + i as u64, r.payload.clone()));
                        }
                        waits.push((a.lsn, a.base.0 + a.count as u64));
                    }
                    // Wait for some acknowledgements (others stay queued
                    // behind, so rounds overlap).
                    if producer_rng.gen_bool(0.3) || step >= steps {
                        if let Some((lsn, end)) = waits.first().copied() {
                            match log.wait(lsn, Frontier::Durable).await {
                                Ok(()) => {
                                    acked.set(acked.get().max(end));
                                    waits.remove(0);
                                }
                                Err(_) => break,
                            }
                        }
                    }
                    futures_lite::future::yield_now().await;
                }
            };
            // The power goes out when the producer stops: the flusher is
            // dropped wherever it is (mid-write, mid-sync).
            futures_lite::future::or(producer, async {
                log.run_flusher().await;
                std::future::pending::<()>().await
            })
            .await;
            drop(log);
            storage.crash(plan);
            let log = open(&storage, &cfg).await;
            let end = log.end().0;
            assert!(
                end >= acked.get(),
                "seed {seed}: acknowledged up to {} but recovered only {end}",
                acked.get()
            );
            let got = read_all(&log, Offset::ZERO).await;
            assert_eq!(got.len() as u64, end, "seed {seed}");
            assert_eq!(
                &got[..],
                &appended.borrow()[..end as usize],
                "seed {seed}: recovered garbage"
            );
        });
    });
}

/// Deleting a shard whose files cannot be removed says so, naming the
/// directory, and leaves the files where they are.
#[test]
fn destroying_a_shard_whose_files_cannot_be_removed_fails_and_says_where() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage, &LogConfig::default()).await;
        log.append(&[RecordIn::default()]).unwrap();
        log.flush().await.unwrap();
        log.close().await.unwrap();
        let before = storage.files();
        storage.fail_remove_after(1);
        let err = log.destroy().await.unwrap_err().to_string();
        assert!(err.contains("/d/t/n/s/0"), "{err}");
        assert!(err.contains("simulated remove failure"), "{err}");
        assert_eq!(storage.files(), before);
        // Once the disk lets it, the files go.
        log.destroy().await.unwrap();
        assert!(storage.files().is_empty());
    });
}

/// A log of 40 records of 100 bytes, each its own flush, in 1,000-byte
/// segments under 3,000 bytes of size retention: older segments are due.
async fn past_retention(storage: &SimStorage) -> ShardLog<SimStorage> {
    let cfg = LogConfig {
        segment_bytes: 1000,
        retention_bytes: Some(3000),
        ..LogConfig::default()
    };
    let log = open(storage, &cfg).await;
    for i in 0..40u64 {
        log.append(&[RecordIn {
            payload: Bytes::from(vec![i as u8; 100]),
            ..Default::default()
        }])
        .unwrap();
        log.flush().await.unwrap();
    }
    log
}

/// Retention that cannot remove a segment says so, keeps serving the
/// segment (the start does not move) and removes it on a later pass.
#[test]
fn retention_that_cannot_remove_a_segment_fails_and_keeps_serving_it() {
    let storage = SimStorage::new();
    block_on(async {
        let log = past_retention(&storage).await;
        let segments = log.stats().segments;
        storage.fail_remove_after(1);
        let err = log.enforce_retention(0).await.unwrap_err().to_string();
        assert!(err.contains("00000000000000000000.log"), "{err}");
        assert_eq!(log.start(), Offset::ZERO);
        assert_eq!(log.stats().segments, segments);
        assert_eq!(read_all(&log, Offset::ZERO).await.len(), 40);
        assert!(log.enforce_retention(0).await.unwrap() > 0);
        assert!(log.start() > Offset::ZERO);
        let got = read_all(&log, Offset::ZERO).await;
        assert_eq!(got.first().unwrap().0, log.start().0);
        assert_eq!(got.last().unwrap().0, 39);
    });
}

/// Run `f` on a glommio executor of its own (tasks spawned with
/// `glommio::spawn_local` share its one thread).
fn on_executor<F: std::future::Future<Output = ()> + 'static>(
    f: impl FnOnce() -> F + Send + 'static,
) {
    glommio::LocalExecutorBuilder::default()
        .spawn(f)
        .expect("executor")
        .join()
        .expect("join");
}

/// Group commit: many appending tasks on one core join the open batch, and
/// one write plus one fdatasync by the shard's flusher task completes all
/// of them.
///
/// The schedule is deterministic: the flusher is already parked waiting for
/// work when the appenders are spawned, all at once; the first append wakes
/// it, but glommio runs ready tasks in order, so it runs after every
/// appender has appended and parked on its durable wait.
#[test]
fn appends_from_many_tasks_complete_with_one_write_and_one_fdatasync() {
    const TASKS: u64 = 64;
    on_executor(|| async {
        let storage = SimStorage::new();
        let cfg = LogConfig::default();
        let log = open(&storage, &cfg).await;
        let flusher = {
            let log = log.clone();
            glommio::spawn_local(async move { log.run_flusher().await }).detach()
        };
        futures_lite::future::yield_now().await;
        let before = storage.counts();
        let bytes_before = storage.bytes_written();
        let done = std::rc::Rc::new(std::cell::Cell::new(0u64));
        let appenders: Vec<_> = (0..TASKS)
            .map(|i| {
                let log = log.clone();
                let done = done.clone();
                glommio::spawn_local(async move {
                    let a = log
                        .append(&[RecordIn {
                            timestamp_ms: i,
                            payload: Bytes::from(vec![i as u8; 200]),
                            ..Default::default()
                        }])
                        .unwrap();
                    log.wait(a.lsn, Frontier::Durable).await.unwrap();
                    // Durable means readable: the whole group is visible.
                    assert!(log.end() > a.base);
                    done.set(done.get() + 1);
                    a
                })
                .detach()
            })
            .collect();
        let mut bases = Vec::new();
        for t in appenders {
            bases.push(t.await.expect("appender").base.0);
        }
        bases.sort();
        assert_eq!(bases, (0..TASKS).collect::<Vec<_>>());
        assert_eq!(done.get(), TASKS);
        let (writes, syncs) = storage.counts();
        let (writes, syncs) = (writes - before.0, syncs - before.1);
        let s = log.stats();
        assert_eq!(s.end, Offset(TASKS));
        assert_eq!(s.flushes, 1, "one group-commit round");
        assert_eq!(syncs, 1, "one fdatasync for all {TASKS} appends");
        // One flush of the whole group: its bytes, padded to a page, in as
        // many writes as that flush takes (`write_chunk_bytes` pieces; 1 MiB
        // by default, so one write for these ~15 KB).
        let padded = s.bytes.div_ceil(4096) * 4096;
        assert_eq!(storage.bytes_written() - bytes_before, padded);
        assert_eq!(writes, padded.div_ceil(cfg.write_chunk_bytes as u64));
        assert_eq!(writes, 1, "one write for all {TASKS} appends");
        log.close().await.unwrap();
        flusher.await;
    });
}

/// An append's wait resolves at the frontier asked for: `Queued` at once,
/// `Written` once the write completed while its fdatasync is still in
/// flight, `Durable` only when that fdatasync completed (and only then is
/// the record visible to readers).
#[test]
fn waits_resolve_at_the_frontier_asked_for() {
    on_executor(|| async {
        use std::cell::Cell;
        use std::rc::Rc;
        let storage = SimStorage::new();
        let log = open(&storage, &LogConfig::default()).await;
        storage.hold_syncs();
        let a = log
            .append(&[RecordIn {
                payload: Bytes::from_static(b"x"),
                ..Default::default()
            }])
            .unwrap();
        // Queued: encoded into the open batch, resolved without any I/O.
        assert!(
            futures_lite::future::poll_once(log.wait(a.lsn, Frontier::Queued))
                .await
                .is_some(),
            "queued resolves at once"
        );
        assert_eq!(storage.counts(), (0, 0));
        let reached = |frontier: Frontier| {
            let flag = Rc::new(Cell::new(false));
            let (log, f) = (log.clone(), flag.clone());
            glommio::spawn_local(async move {
                log.wait(a.lsn, frontier).await.unwrap();
                f.set(true);
            })
            .detach();
            flag
        };
        let written = reached(Frontier::Written);
        let durable = reached(Frontier::Durable);
        let flusher = {
            let log = log.clone();
            glommio::spawn_local(async move { log.run_flusher().await }).detach()
        };
        // Let everything run until the waiters have nothing left to do
        // (bounded: a waiter never woken leaves its flag unset).
        for _ in 0..100 {
            futures_lite::future::yield_now().await;
        }
        assert_eq!(storage.counts(), (1, 1), "written, and the sync issued");
        assert!(
            written.get(),
            "Written resolves while the sync is in flight"
        );
        assert!(!durable.get(), "Durable waits for the sync");
        assert_eq!(log.end(), Offset::ZERO, "not visible before it is durable");
        storage.release_syncs();
        for _ in 0..100 {
            if durable.get() {
                break;
            }
            futures_lite::future::yield_now().await;
        }
        assert!(durable.get(), "Durable resolves once the sync completed");
        assert_eq!(log.end(), Offset(1));
        log.close().await.unwrap();
        flusher.await;
    });
}

/// After retention removed segments, a read from below the log's start
/// reports the new start (so the reader learns how many offsets went) and
/// begins there, from disk and from the tail cache alike.
#[test]
fn a_read_below_the_start_after_retention_reports_the_start_and_begins_there() {
    for read_cache_bytes in [0, 1 << 20] {
        let storage = SimStorage::new();
        let cfg = LogConfig {
            segment_bytes: 1000,
            retention_bytes: Some(3000),
            read_cache_bytes,
            ..LogConfig::default()
        };
        block_on(async {
            let log = open(&storage, &cfg).await;
            for i in 0..40u64 {
                log.append(&[RecordIn {
                    payload: Bytes::from(vec![i as u8; 100]),
                    ..Default::default()
                }])
                .unwrap();
                log.flush().await.unwrap();
            }
            assert_eq!(log.start(), Offset::ZERO);
            assert!(log.enforce_retention(0).await.unwrap() > 0);
            let start = log.start();
            assert!(start > Offset(1), "retention removed segments: {start:?}");
            for from in [Offset::ZERO, Offset(start.0 - 1)] {
                let r = log
                    .read(
                        from,
                        ReadLimits {
                            max_records: 5,
                            max_bytes: 1 << 20,
                        },
                    )
                    .await
                    .unwrap();
                assert_eq!(r.start, start, "cache {read_cache_bytes}, from {from:?}");
                assert_eq!(r.end, Offset(40));
                let offsets: Vec<u64> = r.records.iter().map(|x| x.offset.0).collect();
                assert_eq!(offsets, (start.0..start.0 + 5).collect::<Vec<_>>());
                assert_eq!(r.records[0].payload[0], start.0 as u8);
                assert_eq!(r.next, Offset(start.0 + 5));
            }
        });
    }
}

/// A flush called while another is in flight does not return until what
/// was appended before it is durable: it waits out the round in flight (its
/// fsync held here), then writes and syncs its own batch, and only then
/// returns. The disk, crashed the moment it returns, still has the batch.
#[test]
fn a_flush_while_another_is_in_flight_returns_once_its_batch_is_durable() {
    let storage = SimStorage::new();
    let rec = |p: &'static [u8]| RecordIn {
        payload: Bytes::from_static(p),
        ..Default::default()
    };
    block_on(async {
        use futures_lite::future::poll_once;
        let log = open(&storage, &LogConfig::default()).await;
        storage.hold_syncs();
        log.append(&[rec(b"a")]).unwrap();
        let mut first = std::pin::pin!(log.flush());
        assert!(poll_once(&mut first).await.is_none(), "held in its fsync");
        assert_eq!(storage.counts(), (1, 1));
        let b = log.append(&[rec(b"b")]).unwrap();
        let crashed_at_return = std::cell::RefCell::new(None);
        let mut second = std::pin::pin!(async {
            log.flush().await.unwrap();
            // Everything the disk would keep if the power went out now.
            let disk = storage.fork();
            disk.crash_lose_unsynced();
            *crashed_at_return.borrow_mut() = Some(disk);
        });
        for _ in 0..10 {
            assert!(
                poll_once(&mut second).await.is_none(),
                "returned while the first flush's fsync is in flight and b not written"
            );
        }
        // It waits: no write of its own beside the round in flight.
        assert_eq!(storage.counts(), (1, 1));
        assert_eq!(log.end(), Offset::ZERO);
        storage.release_syncs();
        let (first, ()) = futures_lite::future::zip(first, second).await;
        first.unwrap();
        assert_eq!(storage.counts(), (2, 2), "one more round, for b");
        assert_eq!(log.end(), Offset(2));
        assert!(poll_once(log.wait(b.lsn, Frontier::Durable))
            .await
            .is_some());
        let disk = crashed_at_return
            .borrow_mut()
            .take()
            .expect("second returned");
        let log = open(&disk, &LogConfig::default()).await;
        let got = read_all(&log, Offset::ZERO).await;
        assert_eq!(
            got,
            vec![(0, Bytes::from_static(b"a")), (1, Bytes::from_static(b"b"))]
        );
    });
}

/// A flush whose batches the round in flight already covers waits for that
/// round and adds no write or sync of its own.
#[test]
fn a_flush_covered_by_the_round_in_flight_adds_no_io() {
    let storage = SimStorage::new();
    block_on(async {
        use futures_lite::future::poll_once;
        let log = open(&storage, &LogConfig::default()).await;
        storage.hold_syncs();
        log.append(&[RecordIn::default()]).unwrap();
        let mut first = std::pin::pin!(log.flush());
        assert!(poll_once(&mut first).await.is_none());
        let mut second = std::pin::pin!(log.flush());
        assert!(
            poll_once(&mut second).await.is_none(),
            "a is not durable yet"
        );
        storage.release_syncs();
        let (a, b) = futures_lite::future::zip(first, second).await;
        a.unwrap();
        b.unwrap();
        assert_eq!(storage.counts(), (1, 1));
        assert_eq!(log.stats().flushes, 1);
        assert_eq!(log.end(), Offset(1));
    });
}

/// A flush waiting for a round in flight that fails returns the error: its
/// batch was never made durable.
#[test]
fn a_flush_waiting_for_a_round_that_fails_fails() {
    let storage = SimStorage::new();
    block_on(async {
        use futures_lite::future::poll_once;
        let log = open(&storage, &LogConfig::default()).await;
        storage.hold_syncs();
        storage.fail_sync_after(1);
        log.append(&[RecordIn::default()]).unwrap();
        let mut first = std::pin::pin!(log.flush());
        assert!(poll_once(&mut first).await.is_none());
        log.append(&[RecordIn::default()]).unwrap();
        let mut second = std::pin::pin!(log.flush());
        assert!(poll_once(&mut second).await.is_none());
        storage.release_syncs();
        let (a, b) = futures_lite::future::zip(first, second).await;
        assert!(a.is_err());
        assert!(matches!(b, Err(LogError::Stopped(_))), "{b:?}");
        assert_eq!(log.end(), Offset::ZERO);
    });
}

/// A flush dropped while its round is in flight stops the shard (what it
/// took from the queue cannot be made durable any more): a flush waiting
/// for it, and waiters on the durable frontier, get an error instead of
/// waiting forever.
#[test]
fn a_flush_dropped_in_flight_stops_the_shard() {
    let storage = SimStorage::new();
    block_on(async {
        use futures_lite::future::poll_once;
        let log = open(&storage, &LogConfig::default()).await;
        storage.hold_syncs();
        let a = log.append(&[RecordIn::default()]).unwrap();
        let mut second = std::pin::pin!(log.flush());
        {
            let mut first = std::pin::pin!(log.flush());
            assert!(poll_once(&mut first).await.is_none());
            assert!(poll_once(&mut second).await.is_none());
        }
        // Polled once, not awaited: without the stop they would hang.
        let second = poll_once(&mut second).await;
        assert!(
            matches!(second, Some(Err(LogError::Stopped(_)))),
            "{second:?}"
        );
        let waited = poll_once(log.wait(a.lsn, Frontier::Durable)).await;
        assert!(matches!(waited, Some(Err(_))), "{waited:?}");
        assert!(log.stopped().is_some());
        assert!(log.append(&[RecordIn::default()]).is_err());
        assert_eq!(log.end(), Offset::ZERO);
    });
}

/// The read caps, from the tail cache and from disk alike: `max_records`
/// bounds the count; `max_bytes` counts what records hold (key, header
/// names, values and entries, payload), and is never crossed except by the
/// first record, which is
/// returned whatever its size (a reader is never stuck before it), unless
/// the read is `read_within`: then it is left, and the read says what it
/// would hold.
#[test]
fn reads_honour_the_record_and_byte_caps() {
    // 10 + 11 + 100 = 121 bytes carried each (and a header's lengths), then
    // one of 5,000 and 3 more small ones.
    let small = |i: u8| RecordIn {
        key: Some(Bytes::from(vec![b'k'; 10])),
        headers: vec![("h".into(), Bytes::from(vec![b'v'; 10]))],
        payload: Bytes::from(vec![i; 100]),
        ..Default::default()
    };
    for read_cache_bytes in [0, 1 << 20] {
        let storage = SimStorage::new();
        let cfg = LogConfig {
            read_cache_bytes,
            ..LogConfig::default()
        };
        block_on(async {
            let log = open(&storage, &cfg).await;
            for i in 0..5 {
                log.append(&[small(i)]).unwrap();
            }
            log.append(&[RecordIn {
                payload: Bytes::from(vec![9; 5000]),
                ..Default::default()
            }])
            .unwrap();
            log.append(&[small(6), small(7), small(8)]).unwrap();
            log.flush().await.unwrap();
            let read = |from: u64, max_records: usize, max_bytes: usize| {
                let log = log.clone();
                async move {
                    let r = log
                        .read(
                            Offset(from),
                            ReadLimits {
                                max_records,
                                max_bytes,
                            },
                        )
                        .await
                        .unwrap();
                    let offsets: Vec<u64> = r.records.iter().map(|x| x.offset.0).collect();
                    (offsets, r.bytes, r.next.0)
                }
            };
            let ctx = format!("cache {read_cache_bytes}");
            // A small record holds its 121 bytes and its one header's
            // lengths (two bytes for the name's, four for the value's).
            let one = 121 + 6;
            assert_eq!(
                read(0, 3, usize::MAX).await,
                (vec![0, 1, 2], 3 * one, 3),
                "{ctx}"
            );
            assert_eq!(
                read(0, 100, 3 * one).await,
                (vec![0, 1, 2], 3 * one, 3),
                "{ctx}"
            );
            assert_eq!(
                read(0, 100, 3 * one - 1).await,
                (vec![0, 1], 2 * one, 2),
                "{ctx}"
            );
            assert_eq!(read(0, 100, 0).await, (vec![0], one, 1), "{ctx}");
            assert_eq!(read(1, 100, 1).await, (vec![1], one, 2), "{ctx}");
            // The large record: alone when it crosses the cap, first or not.
            assert_eq!(read(5, 100, 100).await, (vec![5], 5000, 6), "{ctx}");
            assert_eq!(read(4, 100, 5000).await, (vec![4], one, 5), "{ctx}");
            assert_eq!(
                read(4, 100, 5000 + one).await,
                (vec![4, 5], 5000 + one, 6),
                "{ctx}"
            );
            // Within one batch of three.
            assert_eq!(
                read(6, 2, usize::MAX).await,
                (vec![6, 7], 2 * one, 8),
                "{ctx}"
            );
            assert_eq!(
                read(6, 100, 2 * one + 10).await,
                (vec![6, 7], 2 * one, 8),
                "{ctx}"
            );
            assert_eq!(read(0, 0, usize::MAX).await, (vec![], 0, 0), "{ctx}");
            // `read_within` (from the tail cache; from disk, what a read
            // brings counts too: see the test after this one): the first
            // record may pass the byte cap only up to the room given; one
            // that does not fit is left, with what it would hold. The
            // records after it keep to the byte cap.
            let within = |from: u64, max_bytes: usize, room: usize| {
                let log = log.clone();
                async move {
                    let limits = ReadLimits {
                        max_records: 100,
                        max_bytes,
                    };
                    let r = log.read_within(Offset(from), limits, room).await;
                    let r = r.unwrap();
                    let offsets: Vec<u64> = r.records.iter().map(|x| x.offset.0).collect();
                    (offsets, r.bytes, r.next.0, r.first_needs)
                }
            };
            // `read` still lets the first pass, and says nothing of it.
            let r = log
                .read(
                    Offset(5),
                    ReadLimits {
                        max_records: 100,
                        max_bytes: 1,
                    },
                )
                .await
                .unwrap();
            assert_eq!((r.records.len(), r.first_needs), (1, None), "{ctx}");
            if read_cache_bytes == 0 {
                return;
            }
            let roomy = 1 << 20;
            assert_eq!(
                within(5, 100, 100).await,
                (vec![], 0, 5, Some(5000)),
                "{ctx}"
            );
            assert_eq!(
                within(5, 1, 4999).await,
                (vec![], 0, 5, Some(5000)),
                "{ctx}"
            );
            assert_eq!(within(1, 1, 1).await, (vec![], 0, 1, Some(one)), "{ctx}");
            assert_eq!(within(5, 1, 5000).await, (vec![5], 5000, 6, None), "{ctx}");
            assert_eq!(within(5, 5000, 1).await, (vec![5], 5000, 6, None), "{ctx}");
            assert_eq!(
                within(4, 5000, roomy).await,
                (vec![4], one, 5, None),
                "{ctx}"
            );
            assert_eq!(within(7, one, 1).await, (vec![7], one, 8, None), "{ctx}");
            // The first past the cap within the room, and no more after it.
            assert_eq!(within(6, 1, roomy).await, (vec![6], one, 7, None), "{ctx}");
            assert_eq!(
                within(6, one + 1, roomy).await,
                (vec![6], one, 7, None),
                "{ctx}"
            );
        });
    }
}

/// `read_within` from disk: what a read brings from disk before it has a
/// record (a chunk, then a batch larger than one) must fit the room given,
/// as the record itself must; otherwise nothing is read and the read says
/// how much room it takes. Given that much, the same read returns the
/// record. (No chunks are kept here, so every read goes to disk.)
#[test]
fn reads_within_a_room_bring_no_more_than_it_from_disk() {
    let storage = SimStorage::new();
    let cfg = LogConfig {
        read_cache_bytes: 0,
        read_chunk_bytes: 4096,
        cold_chunks: 0,
        ..LogConfig::default()
    };
    block_on(async {
        let log = open(&storage, &cfg).await;
        log.append(&[RecordIn {
            payload: Bytes::from(vec![1; 20_000]),
            ..Default::default()
        }])
        .unwrap();
        log.append(&[RecordIn {
            payload: Bytes::from(vec![2; 10]),
            ..Default::default()
        }])
        .unwrap();
        log.flush().await.unwrap();
        let limits = ReadLimits {
            max_records: 10,
            max_bytes: 1,
        };
        let within = |from: u64, room: usize| {
            let log = log.clone();
            async move {
                let r = log.read_within(Offset(from), limits, room).await.unwrap();
                let offsets: Vec<u64> = r.records.iter().map(|x| x.offset.0).collect();
                (offsets, r.next.0, r.first_needs)
            }
        };
        // A chunk to read the batch's header.
        assert_eq!(within(0, 1).await, (vec![], 0, Some(4096)));
        // Then the whole batch (its header says how long).
        let (none, next, batch) = within(0, 4096).await;
        assert_eq!((none, next), (vec![], 0));
        let batch = batch.expect("the batch's length");
        assert!((20_000..21_000).contains(&batch), "{batch}");
        assert_eq!(within(0, batch - 1).await, (vec![], 0, Some(batch)));
        assert_eq!(within(0, batch).await, (vec![0], 1, None));
        // A small record after it, in a chunk of its own.
        assert_eq!(within(1, 4096).await, (vec![1], 2, None));
        // With a record in hand, a read ends rather than bring more than
        // is left of its room: a small record, then the large batch.
        log.append(&[RecordIn {
            payload: Bytes::from(vec![3; 30_000]),
            ..Default::default()
        }])
        .unwrap();
        log.flush().await.unwrap();
        let ample = ReadLimits {
            max_records: 10,
            max_bytes: 1 << 20,
        };
        let r = log.read_within(Offset(1), ample, 1 << 20).await.unwrap();
        let offsets: Vec<u64> = r.records.iter().map(|x| x.offset.0).collect();
        assert_eq!((offsets, r.first_needs), (vec![1, 2], None));
        let small = ReadLimits {
            max_records: 10,
            max_bytes: 8192,
        };
        let disk_reads = log.stats().cold_reads;
        let r = log.read_within(Offset(1), small, 8192).await.unwrap();
        let offsets: Vec<u64> = r.records.iter().map(|x| x.offset.0).collect();
        assert_eq!((offsets, r.next.0, r.first_needs), (vec![1], 2, None));
        // One chunk read, not the 30,000-byte batch after it.
        assert_eq!(log.stats().cold_reads, disk_reads + 1);
        // `read` brings what it must.
        let r = log.read(Offset(0), limits).await.unwrap();
        assert_eq!((r.records.len(), r.first_needs), (1, None));
    });
}

/// Zeros ahead of small flushes, in steady state: only about one flush in
/// every 192 KiB of data carries a piece (the rest overwrite written zeros),
/// and the file grows only by its reservation steps, never by a write.
#[test]
fn small_flushes_write_zeros_now_and_then_inside_the_reservation() {
    let storage = SimStorage::new();
    let step = 1u64 << 20;
    let cfg = LogConfig {
        segment_bytes: 8 << 20,
        preallocate: true,
        preallocate_step: step,
        ..LogConfig::default()
    };
    let seg = Path::new("/d/t/n/s/0/00000000000000000000.log");
    block_on(async {
        let log = open(&storage, &cfg).await;
        let (mut with_zeros, mut rounds) = (0u64, 0u64);
        for i in 0..600u64 {
            let (writes_before, _) = storage.counts();
            log.append(&[RecordIn {
                payload: Bytes::from(vec![i as u8; 3000]),
                ..Default::default()
            }])
            .unwrap();
            log.flush().await.unwrap();
            let (writes_after, _) = storage.counts();
            match writes_after - writes_before {
                1 => {}
                2 => with_zeros += 1,
                n => panic!("flush {i} made {n} writes"),
            }
            rounds += 1;
            let len = storage.file_len(seg).unwrap();
            // Reservations double from 256 KiB up to the step, then go a
            // step at a time: any other length was left by a write.
            assert!(
                len.is_multiple_of(step) || (len.is_power_of_two() && len >= 256 << 10),
                "flush {i}: the file grew to {len}, past its reservation"
            );
        }
        let data = log.stats().bytes;
        // A piece is 256 KiB, written when less than 64 KiB is left ahead.
        let most = data / (192 << 10) + 2;
        assert!(
            (1..=most).contains(&with_zeros),
            "{with_zeros} of {rounds} flushes wrote zeros for {data} bytes of data (at most {most})"
        );
    });
}

/// A failed write of zeros ahead costs only the speed-up: the flush
/// succeeds, the data is durable, the shard keeps serving.
#[test]
fn a_failed_write_of_zeros_ahead_does_not_stop_the_shard() {
    let storage = SimStorage::new();
    let cfg = LogConfig {
        preallocate: true,
        preallocate_step: 1 << 20,
        ..LogConfig::default()
    };
    block_on(async {
        let log = open(&storage, &cfg).await;
        log.append(&[RecordIn {
            payload: Bytes::from_static(b"first"),
            ..Default::default()
        }])
        .unwrap();
        // The first flush of a segment writes its data, then zeros ahead.
        storage.fail_write_after(2);
        log.flush().await.expect("zeros are not the data");
        assert!(log.stopped().is_none());
        log.append(&[RecordIn {
            payload: Bytes::from_static(b"second"),
            ..Default::default()
        }])
        .unwrap();
        log.flush().await.unwrap();
        let got = read_all(&log, Offset::ZERO).await;
        assert_eq!(got.len(), 2);
        log.close().await.unwrap();
        let log = open(&storage, &cfg).await;
        assert_eq!(log.end(), Offset(2));
    });
}

/// A directory sync that fails after retention removed a segment is owed:
/// the next pass syncs before it removes anything else, so a crash can never
/// bring back an older segment without the ones after it.
#[test]
fn retention_owes_a_failed_directory_sync_before_the_next_removal() {
    let storage = SimStorage::new();
    block_on(async {
        let log = past_retention(&storage).await;
        let segments = log.stats().segments;
        storage.fail_dir_sync_after(1);
        log.enforce_retention(0).await.unwrap_err();
        assert_eq!(log.stats().segments, segments - 1, "one segment went");
        // The owed sync fails again: nothing more is removed.
        storage.fail_dir_sync_after(1);
        log.enforce_retention(0).await.unwrap_err();
        assert_eq!(
            log.stats().segments,
            segments - 1,
            "no removal before the owed sync"
        );
        assert!(log.enforce_retention(0).await.unwrap() > 0);
        let got = read_all(&log, Offset::ZERO).await;
        assert_eq!(got.first().unwrap().0, log.start().0);
        assert_eq!(got.last().unwrap().0, 39);
    });
}

/// Two readers of a cold segment: one takes the segment's length, waits on
/// its first disk read, and meanwhile the log grows and a second reader
/// reads on from further in, in a chunk that runs past the first reader's
/// length into a batch it must not see cut short. The first reader, served
/// from that chunk, reads every record up to its end and reports no
/// corruption.
#[test]
fn a_cold_read_served_from_a_chunk_read_after_the_log_grew_stops_at_its_own_end() {
    // 16 batches of 256 bytes (one 190-byte record each) fill the first
    // 4 KiB chunk exactly; then 166-byte batches (100-byte records). The
    // first reader's log ends after 24 of those, at byte 8,080; the second
    // reader's chunk from byte 4,096 ends at 8,192, inside the batch there.
    let storage = SimStorage::new();
    let cfg = LogConfig {
        read_cache_bytes: 0,
        read_chunk_bytes: 4096,
        cold_chunks: 8,
        index_interval_bytes: 1,
        ..LogConfig::default()
    };
    let rec = |i: u64, size: usize| RecordIn {
        payload: Bytes::from(vec![i as u8; size]),
        ..Default::default()
    };
    block_on(async {
        let log = open(&storage, &cfg).await;
        for i in 0..40 {
            log.append(&[rec(i, if i < 16 { 190 } else { 100 })])
                .unwrap();
            log.flush().await.unwrap();
        }
        assert_eq!(log.stats().bytes, 8080);
        let limits = ReadLimits {
            max_records: 1000,
            max_bytes: usize::MAX,
        };
        storage.set_yielding(true);
        let mut first = std::pin::pin!(log.read(Offset::ZERO, limits));
        assert!(futures_lite::future::poll_once(&mut first).await.is_none());
        storage.set_yielding(false);
        for i in 40..100 {
            log.append(&[rec(i, 100)]).unwrap();
            log.flush().await.unwrap();
        }
        let second = log.read(Offset(16), limits).await.unwrap();
        assert_eq!(second.records.len(), 84);
        let first = first.await.expect("no false corruption");
        assert_eq!(first.records.len(), 40);
        assert_eq!(first.next, Offset(40));
        for (i, r) in first.records.iter().enumerate() {
            assert_eq!(r.offset, Offset(i as u64));
        }
    });
}

/// Blocks are reserved ahead of the writes only while the disk has room to
/// spare beyond the free space the broker keeps in hand: a reservation
/// takes its step at once, from the room that publishes admitted against
/// the free space will write into.
#[test]
fn no_blocks_are_reserved_ahead_on_a_disk_short_of_room() {
    let cfg = LogConfig {
        preallocate: true,
        preallocate_step: 1 << 20,
        min_free_bytes: 4 << 20,
        ..LogConfig::default()
    };
    let seg = Path::new("/d/t/n/s/0/00000000000000000000.log");
    // (free bytes, reserved ahead?): the first small round reserves 512 KiB
    // (its page and the zeros written ahead of it, to the next power of
    // two), so it needs 1 MiB free beyond the 4 MiB floor.
    let floor = 4 << 20;
    for (free, reserves) in [
        (1 << 30, true),
        (floor + (1 << 20), true),
        (floor + (1 << 20) - 4096, false),
    ] {
        let storage = SimStorage::new();
        storage.set_space(free, 1 << 40);
        block_on(async {
            let log = open(&storage, &cfg).await;
            log.append(&[RecordIn {
                payload: Bytes::from(vec![1u8; 100]),
                ..Default::default()
            }])
            .unwrap();
            log.flush().await.unwrap();
            let len = storage.file_len(seg).unwrap();
            if reserves {
                assert_eq!(len, 512 << 10, "free {free}");
            } else {
                assert_eq!(len, 4096, "free {free}: reserved on a disk short of room");
                // Room again: the next flush reserves.
                storage.set_space(1 << 30, 1 << 40);
                log.append(&[RecordIn {
                    payload: Bytes::from(vec![2u8; 100]),
                    ..Default::default()
                }])
                .unwrap();
                log.flush().await.unwrap();
                assert_eq!(storage.file_len(seg).unwrap(), 512 << 10, "not tried again");
            }
            assert_eq!(
                read_all(&log, Offset::ZERO).await.len(),
                if reserves { 1 } else { 2 }
            );
        });
    }
}

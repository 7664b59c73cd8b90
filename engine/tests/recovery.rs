//! Targeted recovery cases on the simulated disk: what a torn last write can
//! leave in the last segment (truncated, the shard opens) against damage to
//! data written before it (the shard refuses to open and says where).

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::log::{LogConfig, LogError, ReadLimits, ShardLog};
use felix_engine::storage::sim::{CrashPlan, ExactCrash, SimStorage};
use felix_engine::storage::Storage;
use felix_engine::Offset;
use futures_lite::future::block_on;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const DIR: &str = "/d/t/n/s/0";
/// Bytes of one batch of one record of [`PAYLOAD`] bytes (header 40, record
/// framing 26).
const PAYLOAD: usize = 100;
const BATCH: u64 = 40 + 26 + PAYLOAD as u64;

fn seg0() -> PathBuf {
    Path::new(DIR).join("00000000000000000000.log")
}

fn rec(i: u64) -> RecordIn {
    RecordIn {
        payload: Bytes::from(vec![(i % 251) as u8; PAYLOAD]),
        ..Default::default()
    }
}

async fn open(s: &SimStorage, cfg: &LogConfig) -> Result<ShardLog<SimStorage>, LogError> {
    ShardLog::open(s.clone(), Path::new(DIR), cfg.clone(), &mut |_| {}).await
}

async fn read_all(log: &ShardLog<SimStorage>) -> Vec<(u64, Bytes)> {
    let mut out = Vec::new();
    let mut at = Offset::ZERO;
    loop {
        let r = log
            .read(
                at,
                ReadLimits {
                    max_records: 100,
                    max_bytes: usize::MAX,
                },
            )
            .await
            .expect("read");
        for x in &r.records {
            out.push((x.offset.0, x.payload.clone()));
        }
        if r.next >= r.end {
            return out;
        }
        at = r.next;
    }
}

/// `n` records, one batch and one flush (so one flush stamp) each.
async fn flushed_one_by_one(s: &SimStorage, cfg: &LogConfig, n: u64) -> ShardLog<SimStorage> {
    let log = open(s, cfg).await.unwrap();
    for i in log.queued_end().0..log.queued_end().0 + n {
        log.append(&[rec(i)]).unwrap();
        log.flush().await.unwrap();
    }
    log
}

fn assert_records(got: &[(u64, Bytes)], n: u64) {
    assert_eq!(got.len() as u64, n);
    for (i, (o, p)) in got.iter().enumerate() {
        assert_eq!(*o, i as u64);
        assert_eq!(p[..], rec(i as u64).payload[..]);
    }
}

/// A batch in the middle of the last segment that is damaged after later
/// flushes wrote more batches behind it is not a torn write: cutting the
/// log there would drop acknowledged records. The shard refuses to open,
/// naming the file, the byte of the bad batch, the offset it should start
/// at and where the next valid batch is, and leaves the file as it was.
#[test]
fn damage_before_the_last_flush_in_the_last_segment_refuses_to_open_and_says_where() {
    // (what, damage, bad batch, next valid batch)
    type Damage = fn(&SimStorage);
    let cases: [(&str, Damage, u64, u64); 4] = [
        (
            "a flipped payload bit",
            |s| s.corrupt(&seg0(), 20 * BATCH + 100, 2),
            20,
            21,
        ),
        (
            "a flipped length bit",
            |s| s.corrupt(&seg0(), 20 * BATCH + 1, 4),
            20,
            21,
        ),
        (
            "a flipped offset bit",
            |s| s.corrupt(&seg0(), 20 * BATCH + 16, 0),
            20,
            21,
        ),
        (
            // Batch 24 starts at 3984 and runs into the page; batch 49 runs
            // out of it; batch 50 (at 8300) is whole.
            "a page that reads as zeros",
            |s| s.overwrite(&seg0(), 4096, &[0u8; 4096]),
            24,
            50,
        ),
    ];
    for (what, damage, bad, next) in cases {
        let storage = SimStorage::new();
        let cfg = LogConfig::default();
        block_on(async {
            let log = flushed_one_by_one(&storage, &cfg, 80).await;
            log.close().await.unwrap();
            damage(&storage);
            let len = storage.file_len(&seg0()).unwrap();
            for _ in 0..2 {
                let err = open(&storage, &cfg).await.expect_err(what);
                let msg = err.to_string();
                assert!(matches!(err, LogError::Corrupt { .. }), "{what}: {msg}");
                assert!(msg.contains("00000000000000000000.log"), "{what}: {msg}");
                assert!(
                    msg.contains(&format!("corrupt at byte {}:", bad * BATCH)),
                    "{what}: {msg}"
                );
                assert!(
                    msg.contains(&format!("should start at offset {bad}")),
                    "{what}: {msg}"
                );
                assert!(
                    msg.contains(&format!("the next at byte {}, offset {next}", next * BATCH)),
                    "{what}: {msg}"
                );
                // Nothing was cut: the refusal can be repeated, and the
                // file repaired by hand.
                assert_eq!(storage.file_len(&seg0()), Some(len), "{what}");
            }
        });
    }
}

/// The last flush's write is several pages written at once, and a power cut
/// can land a later page and not an earlier one. Its valid batches after
/// the hole were all written by that one flush, which never completed: a
/// torn write. The log is cut at the hole and opens with every batch synced
/// before it.
#[test]
fn a_last_write_torn_in_the_middle_is_cut_even_with_valid_pages_after_the_hole() {
    for fill in [0u8, 0xA5] {
        let storage = SimStorage::new();
        let cfg = LogConfig {
            write_chunk_bytes: 4096, // writes of a page or two
            io_depth: 4,
            ..LogConfig::default()
        };
        block_on(async {
            let log = flushed_one_by_one(&storage, &cfg, 10).await;
            assert_eq!(log.end(), Offset(10));
            // One flush of 40 batches: bytes 1660..8300, pages 0, 1 and 2,
            // in two writes (the second from the page the first ends in).
            for i in 10..50 {
                log.append(&[rec(i)]).unwrap();
            }
            storage.hang_sync_after(1);
            assert!(futures_lite::future::poll_once(log.flush()).await.is_none());
            drop(log);
            let writes = storage.unsynced_writes(&seg0());
            assert_eq!(writes, vec![(0, 4096), (4096, 8192)]);
            // Pages 0 and 2 land, page 1 does not (or lands as garbage).
            storage.crash_exact(&ExactCrash {
                file: seg0(),
                keep: 2,
                ..Default::default()
            });
            storage.overwrite(&seg0(), 4096, &[fill; 4096]);
            let log = open(&storage, &cfg).await.unwrap();
            // Batches 0..24 end at or before byte 4096.
            assert_eq!(log.end(), Offset(24), "fill {fill:#x}");
            assert_records(&read_all(&log).await, 24);
            assert_eq!(storage.file_len(&seg0()), Some(24 * BATCH));
            // Appends continue at the cut.
            assert_eq!(log.append(&[rec(24)]).unwrap().base, Offset(24));
            log.flush().await.unwrap();
            assert_records(&read_all(&log).await, 25);
        });
    }
}

/// Images of batches past the valid end that do not continue the log (their
/// offsets are behind it), or that continue it but all come from one flush,
/// are what an older write can leave beyond a torn end: they do not stop
/// the log from opening at its valid end.
#[test]
fn stale_batch_images_past_the_end_do_not_block_the_open() {
    let cfg = LogConfig::default();
    // Offsets behind the end: a copy of batches 3..7 after a gap of zeros.
    let storage = SimStorage::new();
    block_on(async {
        let log = flushed_one_by_one(&storage, &cfg, 10).await;
        drop(log); // a crash: no clean close
        let end = 10 * BATCH;
        let f = storage.clone();
        let image = {
            use felix_engine::storage::{Storage, StorageFile};
            let file = f.open(&seg0(), false).await.unwrap();
            file.read_at(3 * BATCH, 4 * BATCH as usize).await.unwrap()
        };
        storage.overwrite(&seg0(), end + 300, &image);
        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!(log.end(), Offset(10));
        assert_records(&read_all(&log).await, 10);
        assert_eq!(storage.file_len(&seg0()), Some(end));
    });
    // Offsets ahead of the end, all from one flush: batches 12..15 of a
    // flush whose first batches are gone.
    let storage = SimStorage::new();
    block_on(async {
        let log = flushed_one_by_one(&storage, &cfg, 10).await;
        for i in 10..15 {
            log.append(&[rec(i)]).unwrap();
        }
        log.flush().await.unwrap();
        drop(log); // a crash: no clean close
        let end = 10 * BATCH;
        let image = {
            use felix_engine::storage::{Storage, StorageFile};
            let file = storage.open(&seg0(), false).await.unwrap();
            file.read_at(12 * BATCH, 3 * BATCH as usize).await.unwrap()
        };
        storage.cut(&seg0(), end);
        storage.overwrite(&seg0(), end + 700, &image);
        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!(log.end(), Offset(10));
        assert_records(&read_all(&log).await, 10);
    });
}

/// A tail of garbage (a write torn into noise) or zeros to the end of the
/// file is cut, and the log opens at its last whole batch.
#[test]
fn garbage_or_zeros_to_the_end_are_cut() {
    let cfg = LogConfig::default();
    for garbage in [false, true] {
        let storage = SimStorage::new();
        block_on(async {
            let log = flushed_one_by_one(&storage, &cfg, 10).await;
            drop(log); // a crash: no clean close
            let mut x = 0x2545_F491_4F6C_DD1Du64;
            let tail: Vec<u8> = (0..3000)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if garbage {
                        x as u8
                    } else {
                        0
                    }
                })
                .collect();
            // From the middle of batch 9 on.
            storage.overwrite(&seg0(), 9 * BATCH + 50, &tail);
            let log = open(&storage, &cfg).await.unwrap();
            assert_eq!(log.end(), Offset(9));
            assert_records(&read_all(&log).await, 9);
        });
    }
}

/// A batch damaged on disk after the log opened is reported by the read
/// that meets it (a cold read, from disk) with the segment file and the
/// byte position of the batch, whether its checksum fails or its checksum
/// holds over records that do not decode.
#[test]
fn a_corrupt_batch_met_by_a_cold_read_names_the_file_and_byte() {
    let cfg = LogConfig {
        read_cache_bytes: 0,
        cold_chunks: 0,
        ..LogConfig::default()
    };
    let storage = SimStorage::new();
    block_on(async {
        use felix_engine::storage::{Storage, StorageFile};
        let log = flushed_one_by_one(&storage, &cfg, 20).await;
        let limits = ReadLimits {
            max_records: 100,
            max_bytes: usize::MAX,
        };
        let name = seg0().display().to_string();
        // A flipped payload bit in batch 7: the checksum fails.
        storage.corrupt(&seg0(), 7 * BATCH + 80, 1);
        let err = log.read(Offset(0), limits).await.unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, LogError::Corrupt { .. }), "{msg}");
        assert!(
            msg.starts_with(&format!("{name}: corrupt at byte {}: checksum", 7 * BATCH)),
            "{msg}"
        );
        storage.corrupt(&seg0(), 7 * BATCH + 80, 1); // repaired
                                                     // Batch 12 rewritten with a record out of sequence and a checksum
                                                     // that matches it.
        let file = storage.open(&seg0(), false).await.unwrap();
        let mut b = file
            .read_at(12 * BATCH, BATCH as usize)
            .await
            .unwrap()
            .to_vec();
        b[44..48].copy_from_slice(&5u32.to_le_bytes()); // offset delta
        let crc = crc32c::crc32c(&b[8..]);
        b[4..8].copy_from_slice(&crc.to_le_bytes());
        storage.overwrite(&seg0(), 12 * BATCH, &b);
        let err = log.read(Offset(12), limits).await.unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!("{name}: corrupt at byte {}: ", 12 * BATCH)),
            "{msg}"
        );
        assert!(msg.contains("offsets 12..13"), "{msg}");
        assert!(msg.contains("offset delta out of sequence"), "{msg}");
        // Reads that do not meet them are served.
        let r = log.read(Offset(13), limits).await.unwrap();
        assert_eq!(r.records.len(), 7);
    });
}

/// Polls `fut` up to `k` times; true if it finished.
async fn poll_times<F: std::future::Future>(fut: F, k: usize) -> bool {
    let mut fut = std::pin::pin!(fut);
    for _ in 0..k {
        if futures_lite::future::poll_once(&mut fut).await.is_some() {
            return true;
        }
    }
    false
}

/// A flush that rolls to a new segment, cut off by a power cut at every
/// point it can be (the disk yields before each write, sync, directory sync
/// and removal), then recovery on a disk that loses everything not synced,
/// directory entries included: whatever was acknowledged durable, in the new
/// segment too, is there.
#[test]
fn a_roll_cut_off_anywhere_keeps_what_was_acknowledged_in_the_new_segment() {
    let cfg = LogConfig {
        segment_bytes: 1000,
        ..LogConfig::default()
    };
    for k in 0.. {
        let storage = SimStorage::new();
        let done = block_on(async {
            // Five batches fill most of segment 0; the sixth rolls.
            let log = flushed_one_by_one(&storage, &cfg, 5).await;
            storage.set_yielding(true);
            log.append(&[rec(5)]).unwrap();
            log.append(&[rec(6)]).unwrap();
            let done = poll_times(log.flush(), k).await;
            let acked = log.end();
            let segments = log.stats().segments;
            drop(log);
            storage.set_yielding(false);
            storage.crash_lose_unsynced();
            let log = open(&storage, &cfg).await.unwrap();
            assert!(log.end() >= acked, "k {k}: {:?} < {acked:?}", log.end());
            assert_records(&read_all(&log).await, log.end().0);
            if done {
                assert_eq!(segments, 2);
                assert_eq!(acked, Offset(7));
            }
            done
        });
        if done {
            break;
        }
    }
}

/// Retention removing several segments, cut off by a power cut at every
/// point it can be, on a disk that brings back any of the removals not
/// synced (every one, and random choices of them): the log opens, starts no
/// later than it did, and holds every record from its start on.
#[test]
fn retention_cut_off_anywhere_leaves_a_log_that_opens_with_every_record_after_its_start() {
    let cfg = LogConfig {
        segment_bytes: 1000,
        retention_bytes: Some(1500),
        ..LogConfig::default()
    };
    for k in 0.. {
        let storage = SimStorage::new();
        let done = block_on(async {
            let log = flushed_one_by_one(&storage, &cfg, 40).await;
            assert!(log.stats().segments >= 6);
            storage.set_yielding(true);
            let done = poll_times(log.enforce_retention(0), k).await;
            let start = log.start();
            drop(log);
            storage.set_yielding(false);
            for seed in 0..17 {
                let disk = storage.fork();
                if seed == 16 {
                    disk.crash_lose_unsynced();
                } else {
                    disk.crash(CrashPlan {
                        seed,
                        dir_entries: true,
                        ..CrashPlan::default()
                    });
                }
                let log = open(&disk, &cfg)
                    .await
                    .unwrap_or_else(|e| panic!("k {k} seed {seed}: {e}"));
                assert!(log.start() <= start, "k {k} seed {seed}");
                assert_eq!(log.end(), Offset(40));
                let got = read_all(&log).await;
                assert_eq!(got.len() as u64, 40 - log.start().0, "k {k} seed {seed}");
                for (o, p) in &got {
                    assert_eq!(p[..], rec(*o).payload[..]);
                }
            }
            if done {
                assert!(start > Offset::ZERO);
            }
            done
        });
        if done {
            break;
        }
    }
}

/// Every crash point of a short log, enumerated rather than sampled: ten
/// batches durable (one flush each, ending mid-page), then a flush of twenty
/// more written as two one-page writes and cut off in its fsync.
///
/// * For every number of those writes that land, in order or with the first
///   lost, and every byte the next one can be torn at;
/// * with one or both landed, every bit of the unsynced bytes flipped;
///
/// recovery opens the log with the durable ten batches or more, and exactly
/// what was appended. And with both landed, every bit of the durable bytes
/// flipped (damage to acknowledged data, not a crash) refuses the open and
/// says where, except in the last batch before the last flush, which is
/// indistinguishable from that flush torn at its first batch and is cut.
#[test]
fn every_tear_byte_and_every_unsynced_bit_of_a_short_log_recovers_the_durable_prefix() {
    const TOTAL: u64 = 70;
    let cfg = LogConfig {
        write_chunk_bytes: 4096,
        io_depth: 1,
        ..LogConfig::default()
    };
    let storage = SimStorage::new();
    block_on(async {
        let log = flushed_one_by_one(&storage, &cfg, 10).await;
        for i in 10..TOTAL {
            log.append(&[rec(i)]).unwrap();
        }
        storage.hang_sync_after(1);
        assert!(futures_lite::future::poll_once(log.flush()).await.is_none());
        drop(log);
    });
    let durable = 10 * BATCH;
    assert_eq!(storage.synced_len(&seg0()), Some(4096));
    // Bytes 1660..11620 in two writes: the first piece closes inside page
    // 1, which the second writes again.
    let writes = storage.unsynced_writes(&seg0());
    assert_eq!(writes, vec![(0, 4096), (4096, 8192)]);

    let recover = |crash: &ExactCrash| {
        let disk = storage.fork();
        disk.crash_exact(crash);
        block_on(async {
            let log = open(&disk, &cfg).await?;
            let end = log.end().0;
            let got = read_all(&log).await;
            assert_eq!(got.len() as u64, end, "{crash:?}");
            for (o, p) in &got {
                assert_eq!(p[..], rec(*o).payload[..], "{crash:?}: offset {o}");
            }
            Ok::<u64, LogError>(end)
        })
    };
    let check = |crash: ExactCrash| {
        let end = recover(&crash).unwrap_or_else(|e| panic!("{crash:?}: {e}"));
        assert!((10..=TOTAL).contains(&end), "{crash:?}: end {end}");
        end
    };
    let mut cases = 0u64;
    // Every tear of every write, with the ones before it landed whole, and
    // of the second with the first lost.
    for (keep, lost) in [(0, vec![]), (1, vec![]), (1, vec![0])] {
        let w = writes[keep];
        for tear in 0..=w.1 {
            let end = check(ExactCrash {
                file: seg0(),
                keep,
                lost: lost.clone(),
                tear: Some(tear),
                ..Default::default()
            });
            // Batches wholly inside what landed before a hole are kept.
            let landed = if lost.is_empty() {
                w.0 + tear as u64
            } else {
                0
            };
            assert_eq!(
                end,
                (landed / BATCH).clamp(10, TOTAL),
                "keep {keep} lost {lost:?} tear {tear}"
            );
            cases += 1;
        }
    }
    // Every bit of the unsynced bytes, with the first write landed and with
    // both.
    for keep in [1, 2] {
        let top = writes[keep - 1].0 + writes[keep - 1].1 as u64;
        for byte in durable..top {
            for bit in 0..8 {
                let end = check(ExactCrash {
                    file: seg0(),
                    keep,
                    flip: Some((byte, bit)),
                    ..Default::default()
                });
                // A flip inside batch k cuts the log at k; one past the last
                // whole batch cuts nothing more.
                let whole = (top / BATCH).min(TOTAL);
                assert_eq!(
                    end,
                    (byte / BATCH).min(whole),
                    "keep {keep} byte {byte} bit {bit}"
                );
                cases += 1;
            }
        }
    }
    // Every bit of the durable bytes (damage, not a crash).
    for byte in 0..durable {
        for bit in 0..8 {
            let crash = ExactCrash {
                file: seg0(),
                keep: 2,
                flip: Some((byte, bit)),
                ..Default::default()
            };
            let k = byte / BATCH;
            match recover(&crash) {
                Err(e) if k < 9 => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains(&format!("corrupt at byte {}:", k * BATCH)),
                        "byte {byte} bit {bit}: {msg}"
                    );
                }
                Ok(end) if k == 9 => assert_eq!(end, 9, "byte {byte} bit {bit}"),
                other => panic!("byte {byte} bit {bit}: {other:?}"),
            }
            cases += 1;
        }
    }
    eprintln!("{cases} crash points recovered as they should");
}

// ---------------------------------------------------------------------------
// Zeros written ahead of small flushes (`LogConfig::preallocate`): a flush of
// at most 64 KiB, finding less than 64 KiB of written zeros past its end,
// also writes a piece of 256 KiB of zeros there, in the same writes as its
// data and before its fdatasync.

/// A piece of zeros ahead, and the largest round that writes one.
const ZERO_PIECE: usize = 256 << 10;
const SMALL_ROUND: u64 = 64 << 10;
const PAGE: u64 = 4096;

/// Payload of the records of the zeros-ahead crash tests: about 1 KiB a
/// batch, so a log reaches its second piece of zeros (past 192 KiB of data)
/// in under 200 flushes. No byte of it is zero: zeros written over it
/// cannot go unnoticed.
const ZPAYLOAD: usize = 1000;

fn zrec(i: u64) -> RecordIn {
    RecordIn {
        payload: Bytes::from(vec![(i % 250 + 1) as u8; ZPAYLOAD]),
        ..Default::default()
    }
}

fn assert_zrecords(got: &[(u64, Bytes)], n: u64, what: &dyn std::fmt::Debug) {
    assert_eq!(got.len() as u64, n, "{what:?}");
    for (i, (o, p)) in got.iter().enumerate() {
        assert_eq!(*o, i as u64, "{what:?}");
        assert_eq!(p[..], zrec(i as u64).payload[..], "{what:?}: offset {o}");
    }
}

fn zcfg(step: u64, io_depth: usize) -> LogConfig {
    LogConfig {
        segment_bytes: 4 << 20,
        preallocate: true,
        preallocate_step: step,
        io_depth,
        ..LogConfig::default()
    }
}

/// What the hung round left unsynced in the segment, in order.
#[derive(Clone, Copy, Debug, PartialEq)]
enum RoundOp {
    /// The reservation extended to this size (a size change).
    Extend(u64),
    /// The data write (position, length): the partial last page and the
    /// round's batch.
    Data(u64, usize),
    /// The piece of zeros ahead (position, length).
    Zeros(u64, usize),
}

/// Every power cut [`ExactCrash`] can make of `ops`: each of them landed
/// or lost, and the one after the last landed torn at every byte if it is
/// the data write, or at every 512th byte and its first and last 64 if it
/// is the zeros. With each, how many bytes of the data write landed.
fn every_cut(ops: &[RoundOp]) -> Vec<(ExactCrash, usize)> {
    let data = ops.iter().position(|o| matches!(o, RoundOp::Data(..)));
    let data = data.expect("a data write");
    let RoundOp::Data(_, data_len) = ops[data] else {
        unreachable!()
    };
    let mut out = Vec::new();
    for keep in 0..=ops.len() {
        for mask in 0..1u32 << keep {
            let lost: Vec<usize> = (0..keep).filter(|i| mask & 1 << i != 0).collect();
            let tears: Vec<Option<usize>> = match ops.get(keep) {
                Some(RoundOp::Data(_, len)) => (0..=*len).map(Some).collect(),
                Some(RoundOp::Zeros(_, len)) => {
                    let mut t: Vec<usize> = (0..=*len)
                        .step_by(512)
                        .chain(0..64)
                        .chain(len - 64..=*len)
                        .collect();
                    t.sort();
                    t.dedup();
                    t.into_iter().map(Some).collect()
                }
                _ => vec![None],
            };
            for tear in tears {
                let landed = if data < keep {
                    if lost.contains(&data) {
                        0
                    } else {
                        data_len
                    }
                } else if data == keep {
                    tear.unwrap_or(0)
                } else {
                    0
                };
                out.push((
                    ExactCrash {
                        file: seg0(),
                        keep,
                        lost: lost.clone(),
                        tear,
                        ..Default::default()
                    },
                    landed,
                ));
            }
        }
    }
    out
}

/// Where the bytes of a run of a crash image come from.
#[derive(Clone, Copy, Debug)]
enum Source {
    Synced,
    Zeros,
    /// The unsynced operation with this index.
    Op(usize),
}

/// A round hung in its fdatasync, as the simulated disk holds it: the
/// segment's synced bytes, and its unsynced operations with the bytes of
/// each write.
#[derive(Debug, PartialEq)]
struct Unsynced {
    synced: Vec<u8>,
    ops: Vec<RoundOp>,
    data: Vec<Vec<u8>>,
}

impl Unsynced {
    /// Read off `storage` (left as it is).
    fn of(storage: &SimStorage, ops: Vec<RoundOp>) -> Unsynced {
        let image = |crash: Option<ExactCrash>| {
            let disk = storage.fork();
            match crash {
                Some(c) => disk.crash_exact(&c),
                None => disk.crash_lose_unsynced(),
            }
            block_on(disk.read_file(&seg0())).unwrap().unwrap()
        };
        let synced = image(None);
        let data = (0..ops.len())
            .map(|i| match ops[i] {
                RoundOp::Extend(_) => Vec::new(),
                RoundOp::Data(pos, n) | RoundOp::Zeros(pos, n) => {
                    // Only this one lands.
                    let img = image(Some(ExactCrash {
                        file: seg0(),
                        keep: i + 1,
                        lost: (0..i).collect(),
                        ..Default::default()
                    }));
                    img[pos as usize..pos as usize + n].to_vec()
                }
            })
            .collect();
        Unsynced { synced, ops, data }
    }

    /// The segment as `crash` leaves it, as runs `[start, end)` over the
    /// synced bytes and the writes, applied the way
    /// `SimStorage::crash_exact` applies them: thousands of crashes are
    /// told apart by a checksum of this without a copy of the disk each.
    fn paint(&self, crash: &ExactCrash) -> Painted {
        let mut p = Painted {
            len: 0,
            runs: Vec::new(),
        };
        p.resize(self.synced.len() as u64, Source::Synced);
        for (i, op) in self.ops.iter().enumerate() {
            let cut = if i < crash.keep {
                if crash.lost.contains(&i) {
                    continue;
                }
                None
            } else {
                match (crash.tear, op) {
                    (Some(t), RoundOp::Data(..) | RoundOp::Zeros(..)) => Some(t),
                    _ => break,
                }
            };
            match *op {
                RoundOp::Extend(to) => p.resize(to, Source::Zeros),
                RoundOp::Data(pos, n) | RoundOp::Zeros(pos, n) => {
                    let end = pos + cut.map_or(n, |t| t.min(n)) as u64;
                    if p.len < end {
                        p.resize(end, Source::Zeros);
                    }
                    let mut runs = Vec::with_capacity(p.runs.len() + 2);
                    for &(s, e, src) in &p.runs {
                        if s < pos {
                            runs.push((s, e.min(pos), src));
                        }
                        if e > end {
                            runs.push((s.max(end), e, src));
                        }
                    }
                    if end > pos {
                        runs.push((pos, end, Source::Op(i)));
                    }
                    runs.sort_by_key(|r| r.0);
                    p.runs = runs;
                }
            }
            if i >= crash.keep {
                break;
            }
        }
        p
    }

    /// Calls `f` with the bytes of `p` from `a` to `b`, piece by piece.
    fn bytes(&self, p: &Painted, a: u64, b: u64, mut f: impl FnMut(&[u8])) {
        const ZEROS: [u8; 4096] = [0; 4096];
        for &(s, e, src) in &p.runs {
            let (s, e) = (s.max(a), e.min(b));
            if s >= e {
                continue;
            }
            match src {
                Source::Synced => f(&self.synced[s as usize..e as usize]),
                Source::Zeros => {
                    let mut n = e - s;
                    while n > 0 {
                        let k = n.min(ZEROS.len() as u64);
                        f(&ZEROS[..k as usize]);
                        n -= k;
                    }
                }
                Source::Op(i) => {
                    let (RoundOp::Data(pos, _) | RoundOp::Zeros(pos, _)) = self.ops[i] else {
                        unreachable!()
                    };
                    f(&self.data[i][(s - pos) as usize..(e - pos) as usize])
                }
            }
        }
    }
}

/// A crash image (see [`Unsynced::paint`]).
struct Painted {
    len: u64,
    runs: Vec<(u64, u64, Source)>,
}

impl Painted {
    fn resize(&mut self, to: u64, fill: Source) {
        if to > self.len {
            self.runs.push((self.len, to, fill));
        } else {
            self.runs.retain_mut(|r| {
                r.1 = r.1.min(to);
                r.0 < r.1
            });
        }
        self.len = to;
    }
}

/// Bytes of a batch of one [`zrec`].
fn zbatch() -> u64 {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage, &LogConfig::default()).await.unwrap();
        log.append(&[zrec(0)]).unwrap();
        log.flush().await.unwrap();
        log.stats().bytes
    })
}

/// The smallest count of batches from `at` on after which one more batch
/// fits in the same page (so the write of a round of one batch is one page).
fn batches_to_leave_room(at: u64) -> u64 {
    let b = zbatch();
    (at..).find(|n| n * b % PAGE + b <= PAGE).unwrap()
}

/// Which round with zeros ahead is cut off.
#[derive(Clone, Copy, Debug)]
enum ZeroRound {
    /// After a flush of more than 64 KiB (which writes no zeros), a round
    /// of one batch: its zeros start right past its data, inside the
    /// reservation that flush made.
    AfterABurst,
    /// Rounds of one batch each from the start: the first writes a piece of
    /// zeros, and the one cut off is the next to write a piece, when less
    /// than 64 KiB of the first is left: its zeros start where the first
    /// piece ends, past its data.
    SecondPiece,
    /// The first round after the log was killed and reopened (the reopen
    /// cuts the zeros off): its zeros start right past its data.
    AfterAReopen,
}

/// A round hung in its fdatasync after `durable` batches of `batch` bytes
/// each, of one more batch and a piece of zeros ahead.
struct HungRound {
    storage: SimStorage,
    durable: u64,
    batch: u64,
    unsynced: Unsynced,
}

fn hang_a_round_with_zeros_ahead(cfg: &LogConfig, round: ZeroRound) -> HungRound {
    let storage = SimStorage::new();
    let (durable, before, batch, writes, len, grew) = block_on(async {
        let mut log = open(&storage, cfg).await.unwrap();
        match round {
            ZeroRound::AfterABurst => {
                // One flush of more than 64 KiB, large enough that the
                // reservation it makes (the next power of two past it: 1
                // MiB) has room for a piece of zeros past it.
                for i in 0..batches_to_leave_room((600 << 10) / zbatch()) {
                    log.append(&[zrec(i)]).unwrap();
                }
                log.flush().await.unwrap();
                assert!(log.stats().bytes > SMALL_ROUND);
            }
            ZeroRound::SecondPiece => {}
            ZeroRound::AfterAReopen => {
                for i in 0..batches_to_leave_room(10) {
                    log.append(&[zrec(i)]).unwrap();
                    log.flush().await.unwrap();
                }
                let n = log.end();
                drop(log); // kill -9
                log = open(&storage, cfg).await.unwrap();
                assert_eq!(log.end(), n);
            }
        }
        let first = log.end().0;
        loop {
            let i = log.queued_end().0;
            assert!(i < first + 400, "no round wrote zeros ahead");
            let before = log.stats().bytes;
            log.append(&[zrec(i)]).unwrap();
            let len0 = storage.file_len(&seg0()).unwrap();
            storage.hold_syncs();
            let mut flush = Box::pin(log.flush());
            assert!(futures_lite::future::poll_once(&mut flush).await.is_none());
            let writes = storage.unsynced_writes(&seg0());
            let len = storage.file_len(&seg0()).unwrap();
            let batch = log.stats().bytes - before;
            let target = match round {
                ZeroRound::SecondPiece => i > first && writes.len() == 2,
                _ => {
                    assert_eq!(writes.len(), 2, "{round:?}: {writes:?}");
                    true
                }
            };
            if target {
                // The power goes out in the fdatasync.
                drop(flush);
                drop(log);
                storage.release_syncs();
                return (i, before, batch, writes, len, len > len0);
            }
            storage.release_syncs();
            flush.await.unwrap();
        }
    });
    // Every batch is one record of the same size.
    assert_eq!(before, durable * batch);
    let (d, z) = (writes[0], writes[1]);
    let from = before / PAGE * PAGE;
    let data_end = (before + batch).next_multiple_of(PAGE);
    assert_eq!(d, (from, (data_end - from) as usize), "{round:?}");
    assert_eq!(z.1, ZERO_PIECE, "{round:?}: {writes:?}");
    match round {
        ZeroRound::SecondPiece => {
            assert!(z.0 > data_end, "{round:?}: {writes:?}")
        }
        _ => {
            assert_eq!(d.1 as u64, PAGE, "{round:?}: the data write is one page");
            assert_eq!(
                z.0, data_end,
                "{round:?}: nothing known written past the data"
            );
        }
    }
    assert!(z.0 + z.1 as u64 <= len, "the zeros grew the file: {len}");
    let mut ops = vec![RoundOp::Data(d.0, d.1), RoundOp::Zeros(z.0, z.1)];
    if grew {
        // The reservation is extended before the writes (the writes
        // themselves stay inside it).
        assert!(
            len % cfg.preallocate_step == 0 || len.is_power_of_two(),
            "{round:?}: reserved to {len}"
        );
        ops.insert(0, RoundOp::Extend(len));
    }
    let unsynced = Unsynced::of(&storage, ops);
    let zeros = unsynced.data.last().unwrap();
    assert!(zeros.iter().all(|b| *b == 0), "the zeros ahead are zeros");
    HungRound {
        storage,
        durable,
        batch,
        unsynced,
    }
}

/// A round of one batch whose writes carry a piece of zeros ahead, hung in
/// its fdatasync, with `io_depth` 1 and the default (which leave the same
/// unsynced writes), and every crash of it (see [`every_cut`]): the log
/// opens with every record durable before the round, the round's batch
/// only if its write landed whole, nothing else; its torn tail and zeros
/// are cut off; and it takes appends (writing zeros ahead again) that
/// survive a kill and a reopen, with each `io_depth` in turn. Crashes that
/// leave the same bytes (a tear inside what was durable already, zeros
/// landing on zeros) are recovered once. Returns the unsynced operations, the crash
/// points and the distinct disks.
fn crash_a_round_with_zeros_ahead(step: u64, round: ZeroRound) -> (Vec<RoundOp>, u64, usize) {
    let hung: Vec<(LogConfig, HungRound)> = [1, LogConfig::default().io_depth]
        .into_iter()
        .map(|depth| {
            let cfg = zcfg(step, depth);
            let h = hang_a_round_with_zeros_ahead(&cfg, round);
            (cfg, h)
        })
        .collect();
    let first = &hung[0].1;
    for (cfg, h) in &hung[1..] {
        assert_eq!(
            (h.durable, h.batch, &h.unsynced),
            (first.durable, first.batch, &first.unsynced),
            "{round:?}: io_depth {} left other writes",
            cfg.io_depth
        );
    }
    let (durable, batch, u) = (first.durable, first.batch, &first.unsynced);
    let before = durable * batch;
    let RoundOp::Data(d0, dn) = u.ops[u.ops.len() - 2] else {
        unreachable!()
    };
    let mut seen: HashMap<(u64, u32, Vec<u8>), u64> = HashMap::new();
    let mut cases = 0u64;
    for (crash, landed) in every_cut(&u.ops) {
        cases += 1;
        // The round's batch is there if the data write landed to its end.
        let whole = d0 + landed as u64 >= before + batch;
        let end = durable + whole as u64;
        let what = (&crash, landed, &u.ops);
        let painted = u.paint(&crash);
        let mut crc = 0;
        u.bytes(&painted, 0, painted.len, |b| {
            crc = crc32c::crc32c_append(crc, b)
        });
        let mut data = Vec::new();
        u.bytes(&painted, d0, d0 + dn as u64, |b| data.extend_from_slice(b));
        if let Some(was) = seen.insert((painted.len, crc, data), end) {
            assert_eq!(was, end, "{what:?}: the same disk as another crash");
            continue;
        }
        let disk = first.storage.fork();
        disk.crash_exact(&crash);
        let image = block_on(disk.read_file(&seg0())).unwrap().unwrap();
        assert_eq!(
            (image.len() as u64, crc32c::crc32c(&image)),
            (painted.len, crc),
            "{what:?}: the painted image is the crash's"
        );
        drop(image);
        // Opened with each io_depth in turn (recovery does not depend on
        // it; the appends do), appended to (writing zeros ahead again),
        // killed; and opened once more.
        block_on(async {
            let mut n = end;
            for (k, (cfg, _)) in hung.iter().chain(&hung[..1]).enumerate() {
                let log = open(&disk, cfg)
                    .await
                    .unwrap_or_else(|e| panic!("{what:?}: open {k}: {e}"));
                assert_eq!(log.end(), Offset(n), "{what:?}: open {k}");
                assert_zrecords(&read_all(&log).await, n, &what);
                // The torn tail and the zeros are cut (to the data's last
                // page, which holds data and zeros).
                assert_cut_to_data(disk.file_len(&seg0()), n * batch, &what);
                if k < hung.len() {
                    for i in n..n + 2 {
                        log.append(&[zrec(i)]).unwrap();
                        log.flush().await.unwrap();
                    }
                    n += 2;
                }
            }
        });
    }
    eprintln!(
        "{round:?}: {:?}: {cases} crash points, {} distinct disks, each recovered and appended to with io_depth 1 and {}",
        u.ops,
        seen.len(),
        LogConfig::default().io_depth
    );
    (u.ops.clone(), cases, seen.len())
}

/// A round of one batch after a burst, whose zeros ahead start right past
/// its data inside the reservation the burst made (no size change), cut
/// off in its fdatasync: every subset of its two writes landed, the next
/// torn at every byte of the data write or every 512th of the zeros (and
/// their first and last 64).
#[test]
fn a_round_with_zeros_right_past_its_data_cut_off_anywhere_keeps_the_durable_prefix() {
    let (ops, ..) = crash_a_round_with_zeros_ahead(1 << 20, ZeroRound::AfterABurst);
    assert_eq!(ops.len(), 2, "inside the reservation: {ops:?}");
}

/// The next round to write zeros after a log's first (its zeros start
/// where the first piece ended, past its data), extending the reservation
/// for them (a 64 KiB step, smaller than a piece), cut off in its
/// fdatasync: every subset of the size change and the two writes, every
/// tear.
#[test]
fn a_round_with_a_second_piece_of_zeros_cut_off_anywhere_keeps_the_durable_prefix() {
    let (ops, ..) = crash_a_round_with_zeros_ahead(64 << 10, ZeroRound::SecondPiece);
    assert!(matches!(ops[0], RoundOp::Extend(_)), "{ops:?}");
}

/// The first round after a kill and a reopen, which cut the zeros and the
/// reservation off: its zeros start right past its data and extend the
/// reservation again. Cut off in its fdatasync: every subset of the size
/// change and the two writes, every tear.
#[test]
fn the_first_round_after_a_reopen_cut_off_anywhere_keeps_the_durable_prefix() {
    let (ops, ..) = crash_a_round_with_zeros_ahead(128 << 10, ZeroRound::AfterAReopen);
    assert!(matches!(ops[0], RoundOp::Extend(_)), "{ops:?}");
}

/// A flush that rolls to a new segment, with zeros ahead (the segment
/// before it holds a piece of zeros past its data, the round's chunk for it
/// is small, and the new segment gets a piece of its own), cut off at every
/// point it can be, then power cuts that lose everything unsynced, keep all
/// of the old or of the new segment's unsynced writes, or keep the new
/// segment's writes and lose its directory entry: what was acknowledged is
/// there, and every sealed segment ends at its data (its zeros and
/// reservation cut off: recovery would refuse zeros in a sealed segment).
#[test]
fn a_roll_with_zeros_ahead_cut_off_anywhere_keeps_what_was_acknowledged_and_seals_at_the_data() {
    let seg = |base: u64| Path::new(DIR).join(format!("{base:020}.log"));
    let mut cases = 0u64;
    for io_depth in [1, LogConfig::default().io_depth] {
        let cfg = LogConfig {
            // Not a multiple of a page: the zeros run to the page after it.
            segment_bytes: 12_000,
            preallocate: true,
            preallocate_step: 64 << 10,
            io_depth,
            ..LogConfig::default()
        };
        // 72 batches fit in segment 0; the 73rd rolls.
        let fit = cfg.segment_bytes / BATCH;
        for k in 0.. {
            let storage = SimStorage::new();
            let (done, acked) = block_on(async {
                let log = flushed_one_by_one(&storage, &cfg, fit - 2).await;
                // The first flush wrote zeros up to the segment's size.
                assert_eq!(
                    storage.counts().0,
                    fit - 2 + 1,
                    "a write a flush, and one piece of zeros"
                );
                assert_eq!(storage.file_len(&seg0()), Some(64 << 10));
                let writes = storage.counts().0;
                storage.set_yielding(true);
                for i in fit - 2..=fit {
                    log.append(&[rec(i)]).unwrap();
                }
                let done = poll_times(log.flush(), k).await;
                let acked = log.end();
                if done {
                    assert_eq!(log.stats().segments, 2);
                    assert_eq!(acked, Offset(fit + 1));
                    assert_eq!(storage.file_len(&seg0()), Some(fit * BATCH));
                    // One write to segment 0 (no zeros: it is sealed), and
                    // one to the new segment with a piece of zeros past it,
                    // inside the reservation.
                    assert_eq!(storage.counts().0, writes + 3);
                    assert_eq!(storage.file_len(&seg(fit)), Some(64 << 10));
                }
                drop(log);
                storage.set_yielding(false);
                (done, acked)
            });
            // Everything unsynced lost; or all of one segment's unsynced
            // writes kept (with the new segment's directory entry, or not).
            let crashes = [
                ("lose unsynced", None),
                ("keep segment 0", Some((seg0(), false))),
                ("keep segment 1", Some((seg(fit), false))),
                ("keep segment 1, lose its entry", Some((seg(fit), true))),
            ];
            for (what, exact) in crashes {
                let disk = storage.fork();
                match exact {
                    None => disk.crash_lose_unsynced(),
                    Some((file, lose_dir_entries)) => disk.crash_exact(&ExactCrash {
                        file,
                        keep: usize::MAX,
                        lose_dir_entries,
                        ..Default::default()
                    }),
                }
                block_on(async {
                    let log = open(&disk, &cfg)
                        .await
                        .unwrap_or_else(|e| panic!("depth {io_depth} k {k} {what}: {e}"));
                    let end = log.end();
                    assert!(end >= acked, "depth {io_depth} k {k} {what}: {end:?}");
                    assert_records(&read_all(&log).await, end.0);
                    let sizes = log.segment_sizes();
                    for (n, (base, len)) in sizes.iter().enumerate() {
                        let next = sizes.get(n + 1).map_or(end, |s| s.0);
                        // Sealed, a segment ends at its data; recovered,
                        // at its data's last page.
                        assert_eq!(len, &((next.0 - base.0) * BATCH), "{what}");
                        let file_len = disk.file_len(&seg(base.0));
                        let what = format!("depth {io_depth} k {k} {what}: segment {base:?}");
                        if n + 1 < sizes.len() {
                            assert_eq!(file_len, Some(*len), "{what}");
                        } else {
                            assert_cut_to_data(file_len, *len, &what);
                        }
                    }
                    if sizes.len() == 2 {
                        assert_eq!(sizes[1].0, Offset(fit));
                    }
                    // Appends continue.
                    log.append(&[rec(end.0)]).unwrap();
                    log.flush().await.unwrap();
                    drop(log);
                    let log = open(&disk, &cfg).await.unwrap();
                    assert_records(&read_all(&log).await, end.0 + 1);
                });
                cases += 1;
            }
            if done {
                break;
            }
        }
    }
    eprintln!("{cases} crash points recovered as they should");
}

/// Steady state with zeros ahead, across a kill and a reopen: many small
/// flushes (and a large one, which writes none), the log killed, reopened,
/// more small flushes, twice. Every round's writes are looked at before its
/// fdatasync: its data from its partial last page (in at most two writes
/// for a small round), then at most one piece of zeros, which starts past its data, and after a reopen (which cuts the
/// zeros off with the reservation) right past it. After every round the
/// file holds, up to the end of the data, exactly what a log without
/// preallocation (so without zeros) fed the same rounds holds; past it,
/// zeros. Every record reads back from disk before and after each reopen.
#[test]
fn zeros_ahead_never_cover_data_in_steady_state_or_across_a_reopen() {
    for io_depth in [1, LogConfig::default().io_depth] {
        let cfg = LogConfig {
            segment_bytes: 4 << 20,
            preallocate: true,
            preallocate_step: 256 << 10,
            io_depth,
            // Reads come from the disk.
            read_cache_bytes: 0,
            cold_chunks: 0,
            ..LogConfig::default()
        };
        let plain_cfg = LogConfig {
            preallocate: false,
            ..cfg.clone()
        };
        let storage = SimStorage::new();
        let plain = SimStorage::new();
        block_on(async {
            let mut log = open(&storage, &cfg).await.unwrap();
            let mut plain_log = open(&plain, &plain_cfg).await.unwrap();
            for phase in 0..3 {
                let mut pieces = 0;
                for r in 0..150u64 {
                    // 1 to 40 batches (166 B to 6.6 KiB), and one round of
                    // 83 KiB, larger than a round that writes zeros.
                    let m = if r == 60 { 500 } else { 1 + r * 7 % 40 };
                    let before = log.stats().bytes;
                    for _ in 0..m {
                        let i = log.queued_end().0;
                        log.append(&[rec(i)]).unwrap();
                        plain_log.append(&[rec(i)]).unwrap();
                    }
                    plain_log.flush().await.unwrap();
                    storage.hold_syncs();
                    let mut flush = Box::pin(log.flush());
                    assert!(futures_lite::future::poll_once(&mut flush).await.is_none());
                    let writes = storage.unsynced_writes(&seg0());
                    let len = storage.file_len(&seg0()).unwrap();
                    storage.release_syncs();
                    flush.await.unwrap();
                    let after = log.stats().bytes;
                    let what = format!("depth {io_depth} phase {phase} round {r}: {writes:?}");
                    let from = before / PAGE * PAGE;
                    let data_end = after.next_multiple_of(PAGE);
                    // The data: writes that tile the pages from the old
                    // end's page to the new end's (one each piece of the
                    // round), then at most one write of zeros.
                    let mut at = from;
                    let mut data_writes = 0;
                    while at < data_end {
                        assert_eq!(writes.get(data_writes).map(|w| w.0), Some(at), "{what}");
                        at += writes[data_writes].1 as u64;
                        data_writes += 1;
                    }
                    assert_eq!(at, data_end, "{what}");
                    if after - before <= SMALL_ROUND {
                        // A piece sized from the last round, and one more
                        // of at least 64 KiB if this round is larger.
                        assert!(
                            data_writes <= 2,
                            "a small round in {data_writes} pieces: {what}"
                        );
                    }
                    match writes[data_writes..] {
                        [] => {}
                        [(pos, n)] => {
                            assert!(after - before <= SMALL_ROUND, "{what}");
                            assert!(pos >= data_end, "zeros over the data: {what}");
                            assert!(pos + n as u64 <= len, "zeros grew the file: {what}");
                            assert_eq!((pos % PAGE, n as u64 % PAGE), (0, 0), "{what}");
                            assert_eq!(n, ZERO_PIECE, "{what}");
                            pieces += 1;
                        }
                        _ => panic!("{what}"),
                    }
                    if r == 0 {
                        // Nothing is known written past the data of a log
                        // just opened: its first round writes zeros at once,
                        // right past its data.
                        assert_eq!(
                            writes.get(data_writes).map(|w| w.0),
                            Some(data_end),
                            "{what}"
                        );
                    }
                    // The data on disk is the data.
                    let image = storage.read_file(&seg0()).await.unwrap().unwrap();
                    let plain_image = plain.read_file(&seg0()).await.unwrap().unwrap();
                    let after = after as usize;
                    if let Some(k) = (0..after).find(|&k| image[k] != plain_image[k]) {
                        panic!("{what}: byte {k} of the data is {:#x}", image[k]);
                    }
                    if let Some(k) = (after..image.len()).find(|&k| image[k] != 0) {
                        panic!("{what}: byte {k} past the data is {:#x}", image[k]);
                    }
                }
                // Three pieces or more: a new one whenever less than 64 KiB
                // of the last is left.
                assert!(
                    pieces >= 3,
                    "depth {io_depth} phase {phase}: {pieces} pieces"
                );
                let n = log.end().0;
                let data = log.stats().bytes;
                assert_eq!(data, n * BATCH);
                assert_records(&read_all(&log).await, n);
                // Killed; a power cut loses nothing (every round synced).
                drop(log);
                drop(plain_log);
                storage.crash_lose_unsynced();
                log = open(&storage, &cfg).await.unwrap();
                plain_log = open(&plain, &plain_cfg).await.unwrap();
                assert_eq!(log.end(), Offset(n));
                assert_cut_to_data(storage.file_len(&seg0()), data, &"zeros cut");
                assert_records(&read_all(&log).await, n);
            }
        });
    }
}

/// A segment named for an offset past any a log reaches (a stray or
/// crafted file) refuses the open with the file named, instead of opening a
/// log whose next offset would overflow.
#[test]
fn a_segment_named_past_the_offset_limit_refuses_to_open() {
    let storage = SimStorage::new();
    block_on(async {
        storage.create_dir_all(Path::new(DIR)).await.unwrap();
        let name = format!("{}.log", u64::MAX);
        storage
            .open(&Path::new(DIR).join(&name), true)
            .await
            .unwrap();
        let err = open(&storage, &LogConfig::default())
            .await
            .expect_err("a segment past the limit");
        let msg = err.to_string();
        assert!(matches!(err, LogError::Corrupt { .. }), "{msg}");
        assert!(msg.contains(&name), "{msg}");
    });
}

/// The log knows where its data records end: control records after the
/// last one (a new leader's generation starts) leave it where it was, and a
/// reopen finds it again from the segments, in an earlier segment than the
/// tail when the tail holds only control records.
#[test]
fn the_end_of_the_data_records_is_kept_across_control_records_and_a_reopen() {
    let cfg = LogConfig {
        segment_bytes: 4096,
        ..LogConfig::default()
    };
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!(log.data_end(), Offset::ZERO, "no data record yet");
        log.append_control(b"gen").unwrap();
        assert_eq!(log.data_end(), Offset::ZERO);
        log.append(&[rec(1), rec(2)]).unwrap();
        assert_eq!(log.data_end(), Offset(3));
        for _ in 0..3 {
            log.append_control(b"gen").unwrap();
        }
        log.flush().await.unwrap();
        assert_eq!((log.data_end(), log.end()), (Offset(3), Offset(6)));
        // Enough control records to roll past the segment with the data.
        for _ in 0..200 {
            log.append_control(&[7u8; 64]).unwrap();
            log.flush().await.unwrap();
        }
        assert!(log.segment_sizes().len() > 2, "rolled");
        log.close().await.unwrap();

        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!((log.data_end(), log.end()), (Offset(3), Offset(206)));
        log.append(&[rec(3)]).unwrap();
        assert_eq!(log.data_end(), Offset(207));
    });
}

/// After a clean close no write can have been torn, so the newest batches
/// are held to where the log ended then (`clean.mark`): damage there, or a
/// log that ends short, refuses the open and cuts nothing, where after a
/// crash the same damage is cut as a torn last write. The mark is gone
/// (durably) once the log opens, so a crash after that is a crash again.
#[test]
fn a_cleanly_closed_log_refuses_damage_a_crash_would_have_cut_as_a_torn_write() {
    type Damage = fn(&SimStorage);
    let cfg = LogConfig::default();
    // 10 batches of one flush each, then 5 in one last flush.
    let cases: [(&str, Damage, &str); 3] = [
        (
            "a flipped bit in the last batch",
            |s| s.corrupt(&seg0(), 14 * BATCH + 60, 3),
            "damaged at byte",
        ),
        (
            "a flipped bit in a batch of the flush before the last",
            |s| s.corrupt(&seg0(), 9 * BATCH + 60, 3),
            "damaged at byte",
        ),
        (
            "the last batch cut off whole",
            |s| s.cut(&seg0(), 14 * BATCH),
            "now ends at offset 14",
        ),
    ];
    for (what, damage, says) in cases {
        for clean in [true, false] {
            let storage = SimStorage::new();
            block_on(async {
                let log = flushed_one_by_one(&storage, &cfg, 10).await;
                for i in 10..15 {
                    log.append(&[rec(i)]).unwrap();
                }
                log.flush().await.unwrap();
                if clean {
                    log.close().await.unwrap();
                } else {
                    drop(log);
                }
                damage(&storage);
                let len = storage.file_len(&seg0());
                match open(&storage, &cfg).await {
                    Err(e) => {
                        let msg = e.to_string();
                        assert!(clean, "{what}: a crashed log refused: {msg}");
                        assert!(matches!(e, LogError::Corrupt { .. }), "{what}: {msg}");
                        assert!(msg.contains("closed cleanly"), "{what}: {msg}");
                        assert!(msg.contains("ending at offset 15"), "{what}: {msg}");
                        assert!(msg.contains(says), "{what}: {msg}");
                        assert_eq!(storage.file_len(&seg0()), len, "{what}: cut");
                    }
                    Ok(log) => {
                        assert!(!clean, "{what}: a cleanly closed log opened short");
                        assert!(log.end() < Offset(15), "{what}");
                        assert_records(&read_all(&log).await, log.end().0);
                    }
                }
            });
        }
    }
    // Undamaged, a clean close opens whole; the mark is then gone for good,
    // and a torn write after it is cut again.
    let storage = SimStorage::new();
    block_on(async {
        let log = flushed_one_by_one(&storage, &cfg, 10).await;
        log.close().await.unwrap();
        let clean = Path::new(DIR).join("clean.mark");
        assert!(storage.file_len(&clean).is_some());
        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!(log.end(), Offset(10));
        assert_eq!(storage.file_len(&clean), None);
        storage.crash_lose_unsynced();
        assert_eq!(
            storage.file_len(&clean),
            None,
            "the removal was not durable"
        );
        drop(log);
        storage.corrupt(&seg0(), 9 * BATCH + 60, 3);
        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!(log.end(), Offset(9));
        assert_records(&read_all(&log).await, 9);
    });
}

/// Segment files that went missing are noticed, not taken for a new or
/// shorter log: the newest segment the log rolled to is kept in
/// `tail.mark`, and an open that finds it gone (or every segment gone)
/// refuses rather than give the lost offsets out again. A log from before
/// the mark gets one at its next open; a mark that does not decode refuses.
#[test]
fn lost_segment_files_refuse_the_open_instead_of_reusing_their_offsets() {
    let cfg = LogConfig {
        segment_bytes: 1000,
        ..LogConfig::default()
    };
    let dir = Path::new(DIR);
    let fresh = || {
        let storage = SimStorage::new();
        block_on(async {
            // Six batches per segment of 1000 bytes: offsets 0..6, 6..12, 12..15.
            let log = flushed_one_by_one(&storage, &cfg, 15).await;
            assert_eq!(log.stats().segments, 3);
            drop(log);
        });
        storage
    };
    let newest = dir.join("00000000000000000012.log");
    type Loss = fn(&SimStorage, &Path);
    let losses: [(&str, Loss, &str); 3] = [
        (
            "the newest segment",
            |s, d| block_on(s.remove_file(&d.join("00000000000000000012.log"))).unwrap(),
            "the newest segment file left starts at offset 6",
        ),
        (
            "every segment",
            |s, d| {
                for f in s.files() {
                    if f.starts_with(d) && f.extension().is_some_and(|e| e == "log") {
                        block_on(s.remove_file(&f)).unwrap();
                    }
                }
            },
            "no segment file is left",
        ),
        (
            "a garbled mark",
            |s, d| s.overwrite(&d.join("tail.mark"), 9, &[0xFF]),
            "not a valid tail.mark",
        ),
    ];
    for (what, lose, says) in losses {
        let storage = fresh();
        lose(&storage, dir);
        for _ in 0..2 {
            let err = block_on(open(&storage, &cfg)).expect_err(what);
            let msg = err.to_string();
            assert!(matches!(err, LogError::Corrupt { .. }), "{what}: {msg}");
            assert!(msg.contains(says), "{what}: {msg}");
        }
    }
    // A log from before tail marks: it opens, and gets one.
    let storage = fresh();
    let mark = dir.join("tail.mark");
    block_on(storage.remove_file(&mark)).unwrap();
    block_on(async {
        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!(log.end(), Offset(15));
        drop(log);
    });
    assert!(storage.file_len(&mark).is_some());
    block_on(storage.remove_file(&newest)).unwrap();
    let err = block_on(open(&storage, &cfg)).expect_err("the mark written at open holds");
    assert!(err.to_string().contains("offset 12"), "{err}");
}

/// A clean mark vouches for the log up to where it was closed: a log found
/// longer than that (written on by a broker that did not take the mark
/// away, an older one) opens with everything, and only a log that ends
/// short of the mark is refused.
#[test]
fn a_log_longer_than_its_clean_mark_opens_and_a_shorter_one_does_not() {
    let cfg = LogConfig::default();
    let mark = Path::new(DIR).join("clean.mark");
    let storage = SimStorage::new();
    block_on(async {
        let log = flushed_one_by_one(&storage, &cfg, 10).await;
        log.close().await.unwrap();
        let saved = storage.read_file(&mark).await.unwrap().unwrap();
        let log = open(&storage, &cfg).await.unwrap();
        for i in 10..15 {
            log.append(&[rec(i)]).unwrap();
        }
        log.flush().await.unwrap();
        drop(log);
        // The mark as an older broker would have left it.
        storage.write_file_atomic(&mark, &saved).await.unwrap();
        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!(log.end(), Offset(15));
        assert_records(&read_all(&log).await, 15);
        drop(log);
        storage.write_file_atomic(&mark, &saved).await.unwrap();
        storage.cut(&seg0(), 9 * BATCH);
        let err = open(&storage, &cfg)
            .await
            .expect_err("shorter than its mark");
        assert!(err.to_string().contains("now ends at offset 9"), "{err}");
    });
}

/// A recovered tail segment is cut back to its data, or to the end of the
/// page its data ends in (kept when the rest of that page is zeros).
fn assert_cut_to_data(file_len: Option<u64>, data: u64, what: &dyn std::fmt::Debug) {
    let len = file_len.unwrap_or_else(|| panic!("{what:?}: no segment file"));
    assert!(
        (data..=data.next_multiple_of(4096)).contains(&len),
        "{what:?}: {len} bytes for {data} of data"
    );
}

/// A records batch another log encoded (a replica's committed entry) is
/// queued as a copy: its records come back exactly, at this log's offsets,
/// before and after a reopen; anything but a whole, well-formed records
/// batch is refused and queues nothing.
#[test]
fn a_copied_batch_reads_back_as_its_records_and_a_bad_one_is_refused() {
    use felix_engine::format::{encode_group, encode_records, BATCH_HEADER_BYTES};
    let cfg = LogConfig::default();
    let storage = SimStorage::new();
    block_on(async {
        let log = flushed_one_by_one(&storage, &cfg, 3).await;
        let records: Vec<RecordIn> = (0..5u64)
            .map(|i| RecordIn {
                timestamp_ms: 1_000 + i,
                key: (i % 2 == 0).then(|| Bytes::from(vec![i as u8; i as usize])),
                headers: (0..i % 3)
                    .map(|h| (format!("h{h}é"), Bytes::from(vec![h as u8; 3])))
                    .collect(),
                payload: Bytes::from(vec![i as u8; 10 * i as usize]),
            })
            .collect();
        let mut batch = Vec::new();
        encode_records(&mut batch, Offset(500), 7, 3, &records);
        let a = log.append_copy(&batch).unwrap();
        assert_eq!((a.base, a.count), (Offset(3), 5));

        // Refused, nothing queued: a cut batch, one whose first record's length
        // is wrong (no checksum is checked here), and a group batch.
        let end = log.queued_end();
        assert!(matches!(
            log.append_copy(&batch[..batch.len() - 1]),
            Err(LogError::Invalid(_))
        ));
        let mut short = batch.clone();
        short[BATCH_HEADER_BYTES] ^= 0x01; // the first record's length
        assert!(matches!(log.append_copy(&short), Err(LogError::Invalid(_))));
        let mut group = Vec::new();
        encode_group(&mut group, Offset(0), 1, 1, b"x");
        assert!(matches!(log.append_copy(&group), Err(LogError::Invalid(_))));
        assert_eq!(log.queued_end(), end);
        log.flush().await.unwrap();

        let check = |log: &ShardLog<SimStorage>| {
            let log = log.clone();
            let records = records.clone();
            async move {
                let r = log
                    .read(
                        Offset(3),
                        ReadLimits {
                            max_records: 100,
                            max_bytes: usize::MAX,
                        },
                    )
                    .await
                    .unwrap();
                assert_eq!(r.records.len(), records.len());
                for (i, (got, want)) in r.records.iter().zip(&records).enumerate() {
                    assert_eq!(got.offset, Offset(3 + i as u64));
                    assert_eq!(got.timestamp_ms, want.timestamp_ms);
                    assert_eq!(got.key, want.key);
                    assert_eq!(got.headers, want.headers);
                    assert_eq!(got.payload, want.payload);
                }
            }
        };
        check(&log).await;
        drop(log);
        let log = open(&storage, &cfg).await.unwrap();
        assert_eq!(log.end(), Offset(8));
        check(&log).await;
    });
}

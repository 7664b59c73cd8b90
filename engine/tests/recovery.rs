//! Targeted recovery cases on the simulated disk: what a torn last write can
//! leave in the last segment (truncated, the shard opens) against damage to
//! data written before it (the shard refuses to open and says where).

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::log::{LogConfig, LogError, ReadLimits, ShardLog};
use felix_engine::storage::sim::{CrashPlan, ExactCrash, SimStorage};
use felix_engine::Offset;
use futures_lite::future::block_on;
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
            write_chunk_bytes: 4096, // one write per page
            io_depth: 4,
            ..LogConfig::default()
        };
        block_on(async {
            let log = flushed_one_by_one(&storage, &cfg, 10).await;
            assert_eq!(log.end(), Offset(10));
            // One flush of 40 batches: bytes 1660..8300, pages 0, 1 and 2.
            for i in 10..50 {
                log.append(&[rec(i)]).unwrap();
            }
            storage.hang_sync_after(1);
            assert!(futures_lite::future::poll_once(log.flush()).await.is_none());
            drop(log);
            let writes = storage.unsynced_writes(&seg0());
            assert_eq!(writes, vec![(0, 4096), (4096, 4096), (8192, 4096)]);
            // Pages 0 and 2 land, page 1 does not (or lands as garbage).
            storage.crash_exact(&ExactCrash {
                file: seg0(),
                keep: 3,
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
        log.close().await.unwrap();
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
        log.close().await.unwrap();
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
            log.close().await.unwrap();
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
    let cfg = LogConfig {
        write_chunk_bytes: 4096,
        io_depth: 1,
        ..LogConfig::default()
    };
    let storage = SimStorage::new();
    block_on(async {
        let log = flushed_one_by_one(&storage, &cfg, 10).await;
        for i in 10..30 {
            log.append(&[rec(i)]).unwrap();
        }
        storage.hang_sync_after(1);
        assert!(futures_lite::future::poll_once(log.flush()).await.is_none());
        drop(log);
    });
    let durable = 10 * BATCH;
    assert_eq!(storage.synced_len(&seg0()), Some(4096));
    let writes = storage.unsynced_writes(&seg0());
    assert_eq!(writes, vec![(0, 4096), (4096, 4096)]);

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
        assert!((10..=30).contains(&end), "{crash:?}: end {end}");
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
                (landed / BATCH).clamp(10, 30),
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
                let whole = (top / BATCH).min(30);
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

//! Sealed segments' summaries on the simulated disk: an open takes one only
//! where it fits its segment, removes those that stand for no sealed
//! segment, and a read checks what the open then did not (every batch in
//! its place).
//!
//! Damage to a sealed segment shows which way an open went: one that took
//! the summary opens and leaves the damage to the read that meets it; one
//! that scanned the segment refuses the shard.

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::log::{LogConfig, LogError, ReadLimits, ShardLog};
use felix_engine::storage::sim::SimStorage;
use felix_engine::storage::Storage;
use felix_engine::Offset;
use futures_lite::future::block_on;
use std::path::{Path, PathBuf};

const DIR: &str = "/d/t/n/s/0";
/// One batch of one record of 100 bytes (header 40, record framing 26).
const BATCH: u64 = 166;

fn file(base: u64, ext: &str) -> PathBuf {
    Path::new(DIR).join(format!("{base:020}.{ext}"))
}

fn cfg() -> LogConfig {
    LogConfig {
        segment_bytes: 1000,
        read_cache_bytes: 0,
        cold_chunks: 0,
        ..LogConfig::default()
    }
}

const ALL: ReadLimits = ReadLimits {
    max_records: 1000,
    max_bytes: usize::MAX,
};

/// Record `i`: 100 bytes of `i`.
fn rec(i: u8) -> RecordIn {
    RecordIn {
        payload: Bytes::from(vec![i; 100]),
        ..Default::default()
    }
}

async fn open(s: &SimStorage) -> Result<ShardLog<SimStorage>, LogError> {
    ShardLog::open(s.clone(), Path::new(DIR), cfg(), &mut |_| {}).await
}

/// `cfg()` scanning every segment at open.
fn verify() -> LogConfig {
    LogConfig {
        verify_on_open: true,
        ..cfg()
    }
}

/// Open with `cfg`, and the lengths of the group entries it replayed.
async fn open_replaying(
    s: &SimStorage,
    cfg: LogConfig,
) -> (Result<ShardLog<SimStorage>, LogError>, Vec<usize>) {
    let mut lens = Vec::new();
    let log = ShardLog::open(s.clone(), Path::new(DIR), cfg, &mut |e| {
        if let felix_engine::log::Replayed::Group(b) = e {
            lens.push(b.len());
        }
    })
    .await;
    (log, lens)
}

/// The files with extension `ext`, in offset order.
fn with_ext(s: &SimStorage, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = s
        .files()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

/// Flip a bit of every segment but the newest (again: put it back).
fn flip_sealed(s: &SimStorage) {
    let logs = with_ext(s, "log");
    for p in &logs[..logs.len() - 1] {
        s.corrupt(p, 20, 1);
    }
}

fn count(lens: &[usize], len: usize) -> usize {
    lens.iter().filter(|l| **l == len).count()
}

/// A closed log of 50 records, one batch and one flush each: segments of
/// 6 batches (0, 6, 12, ... 48), each sealed one with its summary.
fn written() -> SimStorage {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage).await.unwrap();
        for i in 0..50u8 {
            log.append(&[rec(i)]).unwrap();
            log.flush().await.unwrap();
        }
        log.close().await.unwrap();
    });
    for base in (0..48).step_by(6) {
        assert!(storage.files().contains(&file(base, "sum")), "{base}");
    }
    assert!(!storage.files().contains(&file(48, "sum")));
    storage
}

fn says_corrupt_in_segment_0(e: &LogError) {
    let msg = e.to_string();
    assert!(matches!(e, LogError::Corrupt { .. }), "{msg}");
    assert!(msg.contains("00000000000000000000.log"), "{msg}");
}

/// Segment 0 with a bit flipped in its fourth batch.
fn damaged() -> SimStorage {
    let storage = written();
    storage.corrupt(&file(0, "log"), 3 * BATCH + 80, 2);
    storage
}

#[test]
fn an_open_takes_a_summary_that_fits_and_reads_meet_the_damage_it_hides() {
    let storage = damaged();
    block_on(async {
        let log = open(&storage).await.expect("summary taken");
        let err = log.read(Offset(0), ALL).await.unwrap_err();
        says_corrupt_in_segment_0(&err);
        // Before the damage and past it, reads are served.
        let r = log
            .read(
                Offset(0),
                ReadLimits {
                    max_records: 3,
                    max_bytes: usize::MAX,
                },
            )
            .await
            .unwrap();
        assert_eq!(r.records.len(), 3);
        let r = log.read(Offset(6), ALL).await.unwrap();
        assert_eq!(r.records.first().map(|r| r.offset), Some(Offset(6)));
        assert_eq!(log.stats().corrupt_reads, 1);
        // Just past it, in the same segment and reached by walking through
        // it: its header still places it, and the batch after it verifies
        // and follows on, so the read passes it (and counts it).
        let r = log.read(Offset(4), ALL).await.unwrap();
        let got: Vec<u64> = r.records.iter().map(|r| r.offset.0).take(3).collect();
        assert_eq!(got, vec![4, 5, 6]);
        assert_eq!(log.stats().corrupt_reads, 2);
        // A damaged length cannot be passed: the read fails at it.
        storage.overwrite(&file(0, "log"), 3 * BATCH, &[0xff; 4]);
        let err = log.read(Offset(4), ALL).await.unwrap_err();
        says_corrupt_in_segment_0(&err);
    });
}

#[test]
fn a_summary_of_another_segment_or_another_length_is_not_taken() {
    block_on(async {
        // Segment 6's summary under segment 0's name.
        let storage = damaged();
        let other = storage.read_file(&file(6, "sum")).await.unwrap().unwrap();
        storage
            .write_file_atomic(&file(0, "sum"), &other)
            .await
            .unwrap();
        says_corrupt_in_segment_0(&open(&storage).await.map(|_| ()).unwrap_err());

        // Segment 0 grown past the length its summary gives.
        let storage = damaged();
        let len = storage.file_len(&file(0, "log")).unwrap();
        storage.overwrite(&file(0, "log"), len, &[0u8; 10]);
        says_corrupt_in_segment_0(&open(&storage).await.map(|_| ()).unwrap_err());

        // A summary that does not decode.
        let storage = damaged();
        let mut bytes = storage.read_file(&file(0, "sum")).await.unwrap().unwrap();
        bytes[20] ^= 1;
        storage
            .write_file_atomic(&file(0, "sum"), &bytes)
            .await
            .unwrap();
        says_corrupt_in_segment_0(&open(&storage).await.map(|_| ()).unwrap_err());

        // None at all, or verify_on_open.
        let storage = damaged();
        storage.remove_file(&file(0, "sum")).await.unwrap();
        says_corrupt_in_segment_0(&open(&storage).await.map(|_| ()).unwrap_err());
        let (log, _) = open_replaying(&damaged(), verify()).await;
        says_corrupt_in_segment_0(&log.map(|_| ()).unwrap_err());
    });
}

/// A batch with a good checksum in the wrong place (a misdirected write, a
/// stale block) is damage a read finds, since an open that took the
/// summary never scanned for it.
#[test]
fn a_batch_with_a_good_checksum_in_the_wrong_place_fails_the_read() {
    let storage = written();
    block_on(async {
        let seg = file(0, "log");
        let whole = storage.read_file(&seg).await.unwrap().unwrap();
        let third = &whole[2 * BATCH as usize..3 * BATCH as usize];
        storage.overwrite(&seg, 3 * BATCH, third);
        let log = open(&storage).await.expect("summary taken");
        let err = log.read(Offset(0), ALL).await.unwrap_err();
        says_corrupt_in_segment_0(&err);
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("corrupt at byte {}", 3 * BATCH)),
            "{msg}"
        );
        assert!(
            msg.contains("at offset 2 where a batch at offset 3 was expected"),
            "{msg}"
        );
    });
}

#[test]
fn summaries_that_stand_for_no_sealed_segment_are_removed_at_open() {
    let storage = written();
    block_on(async {
        let one = storage.read_file(&file(6, "sum")).await.unwrap().unwrap();
        // The newest segment's (it may grow), one past every segment, one
        // below them (retention stopped between its two removals), and
        // what an interrupted summary write leaves.
        let stale = [
            file(48, "sum"),
            file(900, "sum"),
            file(0, "tmp"),
            Path::new(DIR).join("00000000000000000000.sum.extra"),
        ];
        for p in &stale {
            storage.write_file_atomic(p, &one).await.unwrap();
        }
        storage.remove_file(&file(0, "log")).await.unwrap();
        let log = open(&storage).await.unwrap();
        assert_eq!(log.start(), Offset(6));
        let files = storage.files();
        for p in &stale[..3] {
            assert!(!files.contains(p), "{} kept", p.display());
        }
        assert!(!files.contains(&file(0, "sum")), "segment 0's kept");
        // Not a name the log gives its files: left alone.
        assert!(files.contains(&stale[3]));
        assert!(files.contains(&file(6, "sum")));
        assert_eq!(log.read(Offset(6), ALL).await.unwrap().records.len(), 44);
    });
}

#[test]
fn retention_removes_a_segments_summary_with_it() {
    let storage = written();
    block_on(async {
        let cfg = LogConfig {
            retention_bytes: Some(3000),
            ..cfg()
        };
        let log = ShardLog::open(storage.clone(), Path::new(DIR), cfg, &mut |_| {})
            .await
            .unwrap();
        assert!(log.enforce_retention(0).await.unwrap() >= 3);
        let start = log.start().0;
        let files = storage.files();
        for base in (0..48).step_by(6) {
            assert_eq!(
                files.contains(&file(base, "sum")),
                base >= start,
                "segment {base}, log start {start}"
            );
        }
    });
}

/// A summary that could not be written leaves none: the next open reads
/// that segment, and every record is there.
#[test]
fn a_summary_that_cannot_be_written_leaves_the_segment_to_be_scanned() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage).await.unwrap();
        for i in 0..10u8 {
            if i == 6 {
                // The roll's tail mark, then the summary.
                storage.fail_atomic_write_after(2);
            }
            log.append(&[rec(i)]).unwrap();
            log.flush().await.unwrap();
        }
        assert!(storage.files().contains(&file(6, "log")));
        assert!(!storage.files().contains(&file(0, "sum")));
        log.close().await.unwrap();
        storage.corrupt(&file(0, "log"), 3 * BATCH + 80, 2);
        says_corrupt_in_segment_0(&open(&storage).await.map(|_| ()).unwrap_err());
        storage.corrupt(&file(0, "log"), 3 * BATCH + 80, 2); // repaired
        let log = open(&storage).await.unwrap();
        let r = log.read(Offset(0), ALL).await.unwrap();
        assert_eq!(r.records.len(), 10);
    });
}

/// With no group entries in the log (a provider that has no state to
/// write, so every snapshot is empty), no sealed segment is read at open.
#[test]
fn a_log_without_group_entries_reads_no_sealed_segment_at_open() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage).await.unwrap();
        log.set_snapshot_provider(Box::new(|_| {}));
        for i in 0..50u8 {
            log.append(&[rec(i)]).unwrap();
            log.flush().await.unwrap();
        }
        log.close().await.unwrap();
        for base in [0, 36, 42] {
            storage.corrupt(&file(base, "log"), 80, 2);
        }
        let log = open(&storage).await.expect("no sealed segment read");
        let err = log.read(Offset(42), ALL).await.unwrap_err();
        assert!(
            err.to_string().contains(&format!("{:020}.log", 42)),
            "{err}"
        );
        assert_eq!(log.read(Offset(48), ALL).await.unwrap().records.len(), 2);
    });
}

/// A sealed segment's summary vouches for the snapshot the next segment
/// opened with, so an open replays group entries from the newest
/// segment's start and reads no sealed segment. If that segment is found
/// to end inside the snapshot (durable data lost), the open refuses rather
/// than rebuild group state from part of it; without the summary it
/// rebuilds it from the segments before.
#[test]
fn replay_starts_at_the_newest_segments_snapshot_and_refuses_a_cut_one() {
    let storage = SimStorage::new();
    let state = || vec![vec![b'S'; 300]];
    block_on(async {
        let log = open(&storage).await.unwrap();
        log.set_snapshot_provider(Box::new(move |out| out.extend(state())));
        for i in 0..50u8 {
            log.append(&[rec(i)]).unwrap();
            log.append_group(b"entry").unwrap();
            log.flush().await.unwrap();
        }
        log.close().await.unwrap();
        let tail = with_ext(&storage, "log").pop().unwrap();
        let before = with_ext(&storage, "sum").pop().unwrap();
        // Every sealed segment damaged: none is read.
        flip_sealed(&storage);
        let (log, replayed) = open_replaying(&storage, cfg()).await;
        let log = log.expect("no sealed segment read");
        assert_eq!(replayed.first(), Some(&300), "{replayed:?}");
        assert_eq!(count(&replayed, 300), 1);
        log.close().await.unwrap();

        // The newest segment cut inside its opening snapshot, and taken as
        // torn (its clean mark removed, as after a crash).
        storage.cut(&tail, 100);
        storage
            .remove_file(&Path::new(DIR).join("clean.mark"))
            .await
            .unwrap();
        let err = open(&storage).await.map(|_| ()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("inside the group snapshot"), "{msg}");
        let name = before.file_name().unwrap().to_string_lossy().into_owned();
        assert!(msg.contains(&name), "{msg}");
        // Repaired: a scrub refuses the cut segment the same way.
        flip_sealed(&storage);
        let (log, _) = open_replaying(&storage, verify()).await;
        let err = log.map(|_| ()).unwrap_err();
        assert!(
            err.to_string().contains("inside the group snapshot"),
            "{err}"
        );
        // The summary the error names removed: the open replays from the
        // snapshot before.
        storage.remove_file(&before).await.unwrap();
        let (log, replayed) = open_replaying(&storage, cfg()).await;
        let log = log.unwrap();
        assert_eq!(count(&replayed, 300), 1);
        assert_eq!(log.end(), Offset(48));
    });
}

/// One round that rolls several segments: each sealed one gets its summary
/// once the round is durable, the last vouching for the newest segment's
/// opening snapshot, so a reopen reads none of them.
#[test]
fn a_round_that_rolls_several_segments_summarises_each() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage).await.unwrap();
        log.set_snapshot_provider(Box::new(|out| out.push(vec![b'S'; 300])));
        for i in 0..30u8 {
            log.append(&[rec(i)]).unwrap();
        }
        log.flush().await.unwrap();
        assert!(log.stats().segments >= 5);
        log.close().await.unwrap();
        let logs = with_ext(&storage, "log");
        for p in &logs[..logs.len() - 1] {
            assert!(storage.files().contains(&p.with_extension("sum")));
        }
        flip_sealed(&storage);
        let (log, replayed) = open_replaying(&storage, cfg()).await;
        let log = log.expect("no sealed segment read");
        assert_eq!(count(&replayed, 300), 1);
        let last = log.read(Offset(29), ALL).await.unwrap();
        assert_eq!(last.records.len(), 1);
    });
}

/// A sealed segment scanned at open for want of a summary (none written,
/// or one from an earlier layout) gets one, so the next open does not read
/// it.
#[test]
fn an_open_writes_the_summaries_it_lacked() {
    let storage = written();
    block_on(async {
        for base in [0, 12] {
            storage.remove_file(&file(base, "sum")).await.unwrap();
        }
        let log = open(&storage).await.unwrap();
        log.close().await.unwrap();
        for base in [0, 12] {
            assert!(storage.files().contains(&file(base, "sum")), "{base}");
        }
        storage.corrupt(&file(12, "log"), 20, 1);
        let log = open(&storage).await.expect("segment 12 not read");
        assert!(log.read(Offset(12), ALL).await.is_err());
    });
}

/// A log whose summaries give no snapshot to start from (written by an open
/// that had to scan, as after an upgrade from before summaries) replays
/// from the start once; the snapshot that open queues is vouched for, once
/// durable, by the summary of the segment before the newest, so the next
/// open reads no sealed segment.
#[test]
fn an_open_that_replayed_old_segments_vouches_for_its_own_snapshot() {
    let storage = SimStorage::new();
    let snapshots = |storage: &SimStorage| {
        let storage = storage.clone();
        async move {
            let (log, replayed) = open_replaying(&storage, cfg()).await;
            let log = log.inspect(|log| {
                log.set_snapshot_provider(Box::new(|out| out.push(vec![b'S'; 20])));
            });
            (log, count(&replayed, 20))
        }
    };
    block_on(async {
        let log = open(&storage).await.unwrap();
        log.set_snapshot_provider(Box::new(|out| out.push(vec![b'S'; 20])));
        for i in 0..50u8 {
            log.append(&[rec(i)]).unwrap();
            log.append_group(b"entry").unwrap();
            log.flush().await.unwrap();
        }
        log.close().await.unwrap();
        let sums = with_ext(&storage, "sum");
        assert!(sums.len() >= 4);
        for p in &sums {
            storage.remove_file(p).await.unwrap();
        }
        // First open: every snapshot replayed (one per segment); its own
        // is vouched for once its first flush is durable.
        let (log, n) = snapshots(&storage).await;
        let log = log.unwrap();
        assert_eq!(n, sums.len() + 1);
        let segments = log.stats().segments;
        log.flush().await.unwrap();
        assert_eq!(
            log.stats().segments,
            segments,
            "its snapshot rolled no segment"
        );
        log.close().await.unwrap();
        flip_sealed(&storage);
        // Second: only that snapshot, and no sealed segment read.
        let (log, n) = snapshots(&storage).await;
        let log = log.expect("no sealed segment read");
        assert_eq!(n, 1);
        assert_eq!(log.end(), Offset(50));
    });
}

/// A damaged batch is passed only when a verified batch follows it: the
/// last batch of a segment with its record count lowered (its checksum
/// fails, its header still seems to place it) would otherwise let a read
/// of its last record jump to the next segment and skip it.
#[test]
fn a_damaged_last_batch_of_a_segment_is_not_passed() {
    let storage = SimStorage::new();
    block_on(async {
        let log = open(&storage).await.unwrap();
        for i in 0..4u8 {
            log.append(&[rec(i), rec(i), rec(i)]).unwrap();
            log.flush().await.unwrap();
        }
        log.close().await.unwrap();
        // Two batches of three records a segment: offsets 3..6 end segment 0.
        assert!(storage.files().contains(&file(6, "log")));
        let second = 40 + 3 * 126;
        storage.overwrite(&file(0, "log"), second + 12, &2u32.to_le_bytes());
        let log = open(&storage).await.unwrap();
        let err = log.read(Offset(5), ALL).await.unwrap_err();
        says_corrupt_in_segment_0(&err);
        let r = log.read(Offset(6), ALL).await.unwrap();
        assert_eq!(r.records.first().map(|r| r.offset), Some(Offset(6)));
    });
}

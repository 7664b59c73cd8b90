//! The journal against a disk that fails the way disks fail: random runs
//! of appends, suffix cuts and syncs, a crash at a random point (unsynced
//! writes lost, kept in part, torn, reordered, a bit flipped; directory
//! entries not yet synced lost), sometimes an injected write or sync
//! failure first; then a reopen. After every crash the log read back holds
//! everything synced and is a prefix of a log that was written: never a
//! cut entry back behind newer ones, never a hole.
//!
//! `FELIX_JOURNAL_SEED` replays one seed; `FELIX_JOURNAL_ROUNDS` sets how
//! many run.

use std::path::Path;

use felix_engine::storage::sim::{CrashPlan, SimStorage};
use felix_engine::storage::Storage;
use felix_replication::journal::{Journal, JournalConfig, JournalError};
use felix_replication::Compacted;
use futures_lite::future::block_on;
use raft::eraftpb::Entry;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

type E = (u64, u64, Vec<u8>);

fn entry(e: &E) -> Entry {
    Entry {
        index: e.0,
        term: e.1,
        data: e.2.clone().into(),
        ..Entry::default()
    }
}

fn plain(entries: &[Entry]) -> Vec<E> {
    entries
        .iter()
        .map(|e| (e.index, e.term, e.data.to_vec()))
        .collect()
}

fn config() -> JournalConfig {
    JournalConfig {
        segment_bytes: 16 << 10,
    }
}

async fn open(storage: &SimStorage, dir: &Path) -> (Journal<SimStorage>, Vec<E>) {
    let (j, entries) = Journal::open(storage.clone(), dir, config())
        .await
        .expect("the journal opens");
    (j, plain(&entries))
}

/// An entry's data: a few sizes only, so that frames of different lives
/// often start at the same positions (where a stale frame left past the
/// end of the log would line up with the next index), and some past a page.
fn data(rng: &mut SmallRng) -> Vec<u8> {
    let len = [0, 0, 40, 40, 1000, 4000, 9000][rng.gen_range(0..7)];
    (0..len).map(|_| rng.gen()).collect()
}

#[test]
fn entries_read_back_and_a_cut_suffix_stays_cut() {
    block_on(async {
        let storage = SimStorage::new();
        let dir = Path::new("/j");
        let (mut j, got) = open(&storage, dir).await;
        assert!(got.is_empty());
        assert_eq!((j.first_index(), j.last_index()), (1, 0));
        let mut log: Vec<E> = (1..=40)
            .map(|i| (i, 1 + i / 20, vec![i as u8; (i * 97 % 1500) as usize]))
            .collect();
        j.append(&log.iter().map(entry).collect::<Vec<_>>())
            .await
            .unwrap();
        j.sync().await.unwrap();
        assert!(j.segment_count() > 1, "16 KiB segments roll");
        drop(j);
        let (mut j, got) = open(&storage, dir).await;
        assert_eq!(got, log);
        // A newer leader's entries from index 12: everything after goes,
        // across segments.
        let new: Vec<E> = (12..=15).map(|i| (i, 7, vec![0xEE; 300])).collect();
        j.append(&new.iter().map(entry).collect::<Vec<_>>())
            .await
            .unwrap();
        j.sync().await.unwrap();
        log.truncate(11);
        log.extend(new);
        assert_eq!(j.last_index(), 15);
        drop(j);
        let (mut j, got) = open(&storage, dir).await;
        assert_eq!(got, log);
        // The rules: no gaps, no index below the first, no term going back.
        let gap = j.append(&[entry(&(17, 7, vec![]))]).await.unwrap_err();
        assert!(matches!(gap, JournalError::Invalid(_)), "{gap}");
        let back = j.append(&[entry(&(16, 6, vec![]))]).await.unwrap_err();
        assert!(matches!(back, JournalError::Invalid(_)), "{back}");
        let zero = j.append(&[entry(&(0, 7, vec![]))]).await.unwrap_err();
        assert!(matches!(zero, JournalError::Invalid(_)), "{zero}");
        // None of that changed anything.
        drop(j);
        let (_, got) = open(&storage, dir).await;
        assert_eq!(got, log);
    });
}

#[test]
fn damage_before_the_last_segment_stops_the_open() {
    block_on(async {
        let storage = SimStorage::new();
        let dir = Path::new("/j");
        let (mut j, _) = open(&storage, dir).await;
        let log: Vec<E> = (1..=60).map(|i| (i, 1, vec![i as u8; 1000])).collect();
        j.append(&log.iter().map(entry).collect::<Vec<_>>())
            .await
            .unwrap();
        j.sync().await.unwrap();
        drop(j);
        let mut files = storage.files();
        files.sort();
        assert!(files.len() >= 2);
        // A flipped byte in the last segment reads as a torn write there
        // (and is cut); in an earlier one it is damage.
        storage.corrupt(&files[0], 100, 3);
        let err = Journal::open(storage.clone(), dir, config())
            .await
            .err()
            .expect("damage stops the open");
        assert!(matches!(err, JournalError::Damaged { .. }), "{err}");
        // So is a missing segment in the middle.
        let storage = SimStorage::new();
        let (mut j, _) = open(&storage, dir).await;
        j.append(&log.iter().map(entry).collect::<Vec<_>>())
            .await
            .unwrap();
        j.sync().await.unwrap();
        drop(j);
        let mut files = storage.files();
        files.sort();
        assert!(files.len() >= 3);
        storage.remove_file(&files[1]).await.unwrap();
        let err = Journal::open(storage.clone(), dir, config())
            .await
            .err()
            .expect("a hole stops the open");
        assert!(matches!(err, JournalError::Damaged { .. }), "{err}");
    });
}

#[test]
fn a_compacted_journal_drops_whole_segments_and_reopens_after_its_point() {
    block_on(async {
        let storage = SimStorage::new();
        let dir = Path::new("/j");
        let (mut j, _) = open(&storage, dir).await;
        let log: Vec<E> = (1..=60)
            .map(|i| (i, 1 + i / 30, vec![i as u8; 1000]))
            .collect();
        j.append(&log.iter().map(entry).collect::<Vec<_>>())
            .await
            .unwrap();
        j.sync().await.unwrap();
        let segments = j.segment_count();
        assert!(segments >= 4, "{segments}");
        let point = Compacted {
            index: 40,
            term: 2,
            end: 4000,
        };
        let removed = j.compact(point).await.unwrap();
        assert!(removed >= 2, "{removed}");
        assert_eq!(j.segment_count(), segments - removed);
        assert!(j.first_index() <= 41 && j.first_index() > 1);
        // Compacting to an older point changes nothing.
        assert_eq!(
            j.compact(Compacted { index: 10, ..point }).await.unwrap(),
            0
        );
        // Past the log: refused.
        let past = j
            .compact(Compacted { index: 61, ..point })
            .await
            .unwrap_err();
        assert!(matches!(past, JournalError::Invalid(_)), "{past}");
        // Nothing at or below the point is written again.
        let below = j.append(&[entry(&(40, 3, vec![]))]).await.unwrap_err();
        assert!(matches!(below, JournalError::Invalid(_)), "{below}");
        let more: Vec<E> = (61..=70).map(|i| (i, 3, vec![7; 500])).collect();
        j.append(&more.iter().map(entry).collect::<Vec<_>>())
            .await
            .unwrap();
        j.sync().await.unwrap();
        let first = j.first_index();
        drop(j);
        // Reopened: the point, and every entry from the kept segment's
        // first on (those up to the point are the caller's to drop).
        let (j, got) = open(&storage, dir).await;
        assert_eq!(j.compacted(), Some(point));
        let mut want = log[first as usize - 1..].to_vec();
        want.extend(more.clone());
        assert_eq!(got, want);
        drop(j);
        // A compaction cut short before it removed an old segment: the
        // next open removes what the point covers.
        let files_before = storage.files().len();
        let (mut j, _) = open(&storage, dir).await;
        j.compact(Compacted {
            index: 65,
            term: 3,
            end: 5000,
        })
        .await
        .unwrap();
        drop(j);
        assert!(storage.files().len() <= files_before);
        let (j, got) = open(&storage, dir).await;
        assert_eq!(j.compacted().map(|c| c.index), Some(65));
        assert!(got.first().is_some_and(|e| e.0 <= 66));
        assert_eq!(got.last().map(|e| e.0), Some(70));
    });
}

/// A compaction point stored, then a crash before any segment went: the
/// older segments are removed on the next open, and a hole between the
/// point and the first segment left is damage.
#[test]
fn segments_a_compaction_point_covers_go_at_open() {
    block_on(async {
        let storage = SimStorage::new();
        let dir = Path::new("/j");
        let (mut j, _) = open(&storage, dir).await;
        let log: Vec<E> = (1..=60).map(|i| (i, 1, vec![i as u8; 1000])).collect();
        j.append(&log.iter().map(entry).collect::<Vec<_>>())
            .await
            .unwrap();
        j.sync().await.unwrap();
        let mut files: Vec<String> = storage
            .files()
            .into_iter()
            .map(|f| f.display().to_string())
            .filter(|f| f.ends_with(".rlog"))
            .collect();
        files.sort();
        // Keep a copy of the oldest segment, compact, put it back.
        let oldest = std::path::PathBuf::from(&files[0]);
        let bytes = storage.read_file(&oldest).await.unwrap().unwrap();
        let point = Compacted {
            index: 50,
            term: 1,
            end: 50,
        };
        let removed = j.compact(point).await.unwrap();
        assert!(removed >= 2);
        drop(j);
        storage.write_file_atomic(&oldest, &bytes).await.unwrap();
        let (j, got) = open(&storage, dir).await;
        assert!(
            !storage.files().contains(&oldest),
            "the covered segment went"
        );
        assert!(got.first().is_some_and(|e| e.0 > 1 && e.0 <= 51));
        drop(j);
        // Every segment gone but one past the point: a hole.
        let storage = SimStorage::new();
        let (mut j, _) = open(&storage, dir).await;
        j.append(&log.iter().map(entry).collect::<Vec<_>>())
            .await
            .unwrap();
        j.sync().await.unwrap();
        j.compact(Compacted {
            index: 5,
            term: 1,
            end: 5,
        })
        .await
        .unwrap();
        drop(j);
        let mut files: Vec<_> = storage
            .files()
            .into_iter()
            .filter(|f| f.display().to_string().ends_with(".rlog"))
            .collect();
        files.sort();
        storage.remove_file(&files[0]).await.unwrap();
        let err = Journal::open(storage.clone(), dir, config())
            .await
            .err()
            .expect("a hole after the point stops the open");
        assert!(matches!(err, JournalError::Damaged { .. }), "{err}");
    });
}

/// Random lives of a journal, each ending in a crash and a reopen;
/// returns how many entries were read back in all (for the summary).
async fn crash_round(seed: u64) -> usize {
    let mut rng = SmallRng::seed_from_u64(seed);
    let storage = SimStorage::new();
    let dir = Path::new("/j");
    let (mut j, _) = open(&storage, dir).await;
    // What the journal holds now (from index 1: the entries compacted
    // away stay here, as the shard's own log would hold them).
    let mut current: Vec<E> = Vec::new();
    let mut term = 1u64;
    // The compaction point: Raft compacts only committed entries, which
    // are never cut, so no cut goes at or below it.
    let mut compacted = 0u64;
    let mut recovered = 0;
    for _life in 0..3 {
        match rng.gen_range(0..4) {
            0 => storage.fail_write_after(rng.gen_range(1..20)),
            1 => storage.fail_sync_after(rng.gen_range(1..12)),
            _ => {}
        }
        // A log read back must extend `floor` (what is certainly durable)
        // and be a prefix of one of `ceilings` (logs the disk may hold).
        let mut floor = current.clone();
        let mut ceilings = vec![current.clone()];
        for _ in 0..rng.gen_range(1..30) {
            let before = current.clone();
            let mut cut = None;
            let op = rng.gen_range(0..100);
            let is_sync = op < 25;
            // Compact to an entry certainly durable.
            let is_compact = !is_sync && op < 35 && floor.len() as u64 > compacted;
            let result = if is_sync {
                j.sync().await
            } else if is_compact {
                let to = rng.gen_range(compacted + 1..=floor.len() as u64);
                let point = Compacted {
                    index: to,
                    term: current[to as usize - 1].1,
                    end: to,
                };
                let r = j.compact(point).await.map(|_| ());
                if r.is_ok() {
                    compacted = to;
                }
                r
            } else {
                // Append, sometimes from an index already held (a cut).
                let last = current.len() as u64;
                let from = if last > compacted && rng.gen_bool(0.3) {
                    term += rng.gen_range(0..2);
                    rng.gen_range(compacted + 1..=last)
                } else {
                    last + 1
                };
                if rng.gen_bool(0.1) {
                    term += 1;
                }
                let n = rng.gen_range(1..6);
                let new: Vec<E> = (from..from + n)
                    .map(|i| (i, term, data(&mut rng)))
                    .collect();
                current.truncate(from as usize - 1);
                current.extend(new.iter().cloned());
                if from <= last {
                    cut = Some(from as usize - 1);
                    // Whatever happens next, the entries past the cut may
                    // be gone.
                    floor.truncate(from as usize - 1);
                }
                j.append(&new.iter().map(entry).collect::<Vec<_>>()).await
            };
            match result {
                Ok(()) if is_compact => {}
                Ok(()) if is_sync => {
                    // A sync: the disk holds exactly this now.
                    floor = current.clone();
                    ceilings = vec![current.clone()];
                }
                Ok(()) => {
                    if let Some(keep) = cut {
                        // The cut was synced before the new entries were
                        // written: the old suffix cannot come back.
                        for c in &mut ceilings {
                            c.truncate(keep);
                        }
                    }
                    ceilings.push(current.clone());
                }
                Err(e) => {
                    assert!(
                        matches!(e, JournalError::Io { .. }),
                        "seed {seed}: an injected failure reads as I/O: {e}"
                    );
                    // Every later call refuses.
                    assert!(matches!(j.sync().await, Err(JournalError::Stopped(_))));
                    // A cut cut short may or may not have reached the disk.
                    ceilings.push(before);
                    ceilings.push(current.clone());
                    break;
                }
            }
        }
        drop(j);
        storage.crash(CrashPlan {
            seed: rng.gen(),
            tear: rng.gen_bool(0.7),
            flip_bit: rng.gen_bool(0.2),
            reorder: rng.gen_bool(0.5),
            dir_entries: rng.gen_bool(0.5),
        });
        // No more injected failures (far enough never to come).
        storage.fail_write_after(u64::MAX / 2);
        storage.fail_sync_after(u64::MAX / 2);
        let (reopened, got) = open(&storage, dir).await;
        // Compared past the point read back: the one stored, or the one a
        // compaction cut short was storing.
        let point = reopened.compacted().map_or(0, |c| c.index);
        assert!(
            point >= compacted,
            "seed {seed}: the journal forgot it was compacted to {compacted} (reads {point})"
        );
        assert!(
            got.first().is_none_or(|e| e.0 <= point + 1),
            "seed {seed}: a hole after the compaction point {point}"
        );
        let kept = point as usize;
        assert!(
            floor.len() >= kept,
            "seed {seed}: compacted past what was durable"
        );
        let got: Vec<E> = current[..kept]
            .iter()
            .cloned()
            .chain(got.into_iter().filter(|e| e.0 > point))
            .collect();
        compacted = point;
        assert!(
            got.len() >= floor.len() && got[..floor.len()] == floor[..],
            "seed {seed}: lost durable entries: read back {} entries, {} were durable",
            got.len(),
            floor.len()
        );
        assert!(
            ceilings
                .iter()
                .any(|c| got.len() <= c.len() && got[..] == c[..got.len()]),
            "seed {seed}: read back a log never written ({} entries)",
            got.len()
        );
        recovered += got.len();
        j = reopened;
        term = got.last().map_or(term, |e| e.1.max(term));
        current = got;
    }
    recovered
}

#[test]
fn a_crash_at_any_point_keeps_what_was_synced_and_never_brings_back_a_cut_suffix() {
    let rounds: u64 = std::env::var("FELIX_JOURNAL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let seeds: Vec<u64> = match std::env::var("FELIX_JOURNAL_SEED") {
        Ok(s) => vec![s.parse().expect("a seed")],
        Err(_) => {
            let base: u64 = rand::random();
            (0..rounds).map(|i| base.wrapping_add(i)).collect()
        }
    };
    let mut total = 0;
    for seed in seeds {
        eprintln!("journal crash round, FELIX_JOURNAL_SEED={seed}");
        total += block_on(crash_round(seed));
    }
    assert!(total > 0, "the rounds read entries back");
}

//! The group-state snapshot every new segment opens with: it does not count
//! toward `segment_bytes`, so group state larger than a segment (a long
//! dead-letter list, say) costs one snapshot per segment, not one segment
//! (and one snapshot) per batch.

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::log::{LogConfig, Replayed, ShardLog};
use felix_engine::storage::sim::SimStorage;
use futures_lite::future::block_on;
use std::path::Path;

const DIR: &str = "/d/t/n/s/0";

fn rec() -> RecordIn {
    RecordIn {
        payload: Bytes::from(vec![7u8; 100]),
        ..Default::default()
    }
}

#[test]
fn a_snapshot_larger_than_a_segment_does_not_roll_one_per_batch() {
    block_on(async {
        let storage = SimStorage::new();
        let cfg = LogConfig {
            segment_bytes: 64 << 10,
            ..LogConfig::default()
        };
        let log = ShardLog::open(storage.clone(), Path::new(DIR), cfg.clone(), &mut |_| {})
            .await
            .unwrap();
        // Group state of 100 KiB, over the segment size.
        log.set_snapshot_provider(Box::new(|out| out.push(vec![0x5a; 100 << 10])));
        // 166 bytes a batch: about 395 fill a segment, so 2,000 span a few.
        for _ in 0..2_000 {
            log.append(&[rec()]).unwrap();
            log.flush().await.unwrap();
        }
        let segments = log.stats().segments;
        assert!(
            segments <= 8,
            "{segments} segments for 2,000 batches of 166 bytes in 64 KiB segments"
        );
        log.close().await.unwrap();

        // Reopened scanning every segment: one snapshot per segment (the
        // first one's was written when the provider was set), and every
        // record is there.
        let verify = LogConfig {
            verify_on_open: true,
            ..cfg.clone()
        };
        let snapshots = |cfg: LogConfig| {
            let storage = storage.clone();
            async move {
                let mut snapshots = 0;
                let log = ShardLog::open(storage, Path::new(DIR), cfg, &mut |e| {
                    if let Replayed::Group(body) = e {
                        assert_eq!(body.len(), 100 << 10);
                        snapshots += 1;
                    }
                })
                .await
                .unwrap();
                assert_eq!(log.end().0, 2_000);
                log.close().await.unwrap();
                snapshots
            }
        };
        assert_eq!(snapshots(verify).await, segments);
        // Reopened as usual: replayed from the newest segment's opening
        // snapshot, which the summary of the segment before it vouches for
        // (written once that snapshot was durable).
        assert!(segments >= 3);
        assert_eq!(snapshots(cfg).await, 1);
    });
}

/// Retention keeps the segments holding the only copy of group state until a
/// later segment holds a snapshot this process wrote and made durable. Here
/// the newer segments open with no snapshot at all (as after a crash that
/// cut one short): after a reopen, the older segment stays until the
/// snapshot queued when the provider is set is durable, and group state
/// survives its removal.
#[test]
fn retention_waits_for_a_durable_snapshot_before_removing_group_state() {
    block_on(async {
        let storage = SimStorage::new();
        let cfg = LogConfig {
            segment_bytes: 16 << 10,
            retention_bytes: Some(20 << 10),
            ..LogConfig::default()
        };
        let replayed = |cfg: LogConfig| {
            let storage = storage.clone();
            async move {
                let mut groups: Vec<Vec<u8>> = Vec::new();
                let log = ShardLog::open(storage, Path::new(DIR), cfg, &mut |e| {
                    if let Replayed::Group(body) = e {
                        groups.push(body.to_vec());
                    }
                })
                .await
                .unwrap();
                (log, groups)
            }
        };
        // The first segment holds the only group entry; 400 records of 166
        // bytes fill about four 16 KiB segments after it, none opening with
        // a snapshot (no provider yet).
        let (log, _) = replayed(cfg.clone()).await;
        log.append_group(b"group state").unwrap();
        for _ in 0..400 {
            log.append(&[rec()]).unwrap();
            log.flush().await.unwrap();
        }
        assert!(log.stats().segments >= 3);
        log.close().await.unwrap();

        let (log, groups) = replayed(cfg.clone()).await;
        assert_eq!(groups, vec![b"group state".to_vec()]);
        // The replayed state, snapshotted but not yet durable.
        log.set_snapshot_provider(Box::new(|out| out.push(b"group state".to_vec())));
        assert_eq!(
            log.enforce_retention(u64::MAX / 2).await.unwrap(),
            0,
            "no later durable snapshot holds the group state yet"
        );
        log.flush().await.unwrap();
        assert!(log.enforce_retention(u64::MAX / 2).await.unwrap() >= 1);
        log.close().await.unwrap();

        let (_log, groups) = replayed(cfg).await;
        assert_eq!(
            groups.last(),
            Some(&b"group state".to_vec()),
            "the group state outlived the segment it was written in"
        );
    });
}

/// A segment that holds only group entries cannot roll (a segment is named
/// by its first offset): they accumulate in it, with no snapshot repeated
/// among them, and the first record after them rolls as usual.
#[test]
fn group_entries_alone_do_not_roll_a_segment() {
    block_on(async {
        let storage = SimStorage::new();
        let cfg = LogConfig {
            segment_bytes: 16 << 10,
            ..LogConfig::default()
        };
        let log = ShardLog::open(storage.clone(), Path::new(DIR), cfg.clone(), &mut |_| {})
            .await
            .unwrap();
        log.set_snapshot_provider(Box::new(|out| out.push(b"state".to_vec())));
        for _ in 0..64 {
            log.append_group(&[1u8; 1024]).unwrap();
            log.flush().await.unwrap();
        }
        assert_eq!(log.stats().segments, 1);
        for _ in 0..200 {
            log.append(&[rec()]).unwrap();
            log.flush().await.unwrap();
        }
        assert!(log.stats().segments >= 2, "records roll as usual");
        log.close().await.unwrap();
        // Every segment's entries (the provider's snapshot is not the state
        // the entries build, so a replay from a snapshot would drop them).
        let cfg = LogConfig {
            verify_on_open: true,
            ..cfg
        };
        let mut entries = Vec::new();
        let log = ShardLog::open(storage.clone(), Path::new(DIR), cfg, &mut |e| {
            if let Replayed::Group(body) = e {
                entries.push(body.to_vec());
            }
        })
        .await
        .unwrap();
        let ones = entries.iter().filter(|b| b.len() == 1024).count();
        let snapshots = entries.iter().filter(|b| b.as_slice() == b"state").count();
        assert_eq!(ones, 64);
        assert!(
            snapshots <= log.stats().segments as usize,
            "{snapshots} snapshots"
        );
        assert_eq!(log.end().0, 200);
    });
}

/// Group state modelled as a map set one key at a time, with snapshots
/// written as the broker's are: pieces staged, then a head that replaces
/// the state with them (a crash that keeps only some pieces keeps no head).
#[derive(Default)]
struct Model {
    state: std::collections::BTreeMap<u8, u64>,
    staged: Vec<(u8, u64)>,
}

impl Model {
    fn apply(&mut self, body: &[u8]) {
        let kv = |b: &[u8]| (b[1], u64::from_le_bytes(b[2..10].try_into().unwrap()));
        match body[0] {
            b'E' => {
                let (k, v) = kv(body);
                self.state.insert(k, v);
            }
            b'P' => self.staged.push(kv(body)),
            b'S' => self.state = std::mem::take(&mut self.staged).into_iter().collect(),
            other => panic!("unknown entry {other}"),
        }
    }
}

fn entry(tag: u8, k: u8, v: u64) -> Vec<u8> {
    let mut b = vec![tag, k];
    b.extend_from_slice(&v.to_le_bytes());
    b
}

/// An open replays group entries only from the newest complete snapshot a
/// sealed segment's summary vouches for: across rolls, retention, clean
/// stops and crashes that tear the newest segment's own snapshot, the state
/// it rebuilds is the state every entry made durable builds, and the state
/// an open scanning every segment (`verify_on_open`) rebuilds.
#[test]
fn group_state_replayed_from_the_newest_summarised_snapshot_is_the_whole_state() {
    use felix_engine::storage::sim::CrashPlan;
    use rand::{Rng, SeedableRng};
    use std::cell::RefCell;
    use std::rc::Rc;
    for seed in 0..40u64 {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let storage = SimStorage::new();
        let cfg = LogConfig {
            segment_bytes: 4 << 10,
            retention_bytes: rng.gen_bool(0.5).then_some(24 << 10),
            ..LogConfig::default()
        };
        // What every entry made durable builds.
        let mut durable = std::collections::BTreeMap::new();
        let replay = |storage: &SimStorage, cfg: LogConfig| {
            let storage = storage.clone();
            async move {
                let mut m = Model::default();
                let mut entries = 0;
                let log = ShardLog::open(storage, Path::new(DIR), cfg, &mut |e| {
                    if let Replayed::Group(body) = e {
                        m.apply(body);
                        entries += 1;
                    }
                })
                .await
                .unwrap_or_else(|e| panic!("seed {seed}: open: {e}"));
                (log, m.state, entries)
            }
        };
        block_on(async {
            // Rounds whose open replayed fewer entries than a full scan.
            let mut spared = 0;
            for round in 0..12 {
                let verify = LogConfig {
                    verify_on_open: true,
                    ..cfg.clone()
                };
                let (_, all, scanned) = replay(&storage.fork(), verify).await;
                let (log, state, replayed) = replay(&storage, cfg.clone()).await;
                assert_eq!(state, durable, "seed {seed} round {round}");
                assert_eq!(all, durable, "seed {seed} round {round}: scanning all");
                assert!(replayed <= scanned, "seed {seed} round {round}");
                if replayed < scanned {
                    spared += 1;
                }
                let memory = Rc::new(RefCell::new(state));
                let snap = memory.clone();
                log.set_snapshot_provider(Box::new(move |out| {
                    for (k, v) in snap.borrow().iter() {
                        out.push(entry(b'P', *k, *v));
                    }
                    out.push(b"S".to_vec());
                }));
                for _ in 0..rng.gen_range(20..120) {
                    if rng.gen_bool(0.3) {
                        let (k, v) = (rng.gen_range(0..16u8), rng.gen::<u64>());
                        log.append_group(&entry(b'E', k, v)).unwrap();
                        memory.borrow_mut().insert(k, v);
                    } else {
                        for _ in 0..rng.gen_range(1..4) {
                            log.append(&[rec()]).unwrap();
                        }
                    }
                    log.flush().await.unwrap();
                    if rng.gen_bool(0.1) {
                        log.enforce_retention(u64::MAX / 2).await.unwrap();
                    }
                }
                durable = memory.borrow().clone();
                match rng.gen_range(0..3) {
                    0 => log.close().await.unwrap(),
                    _ => {
                        // Records enough to roll, the power cut while
                        // their flush is in flight: the newest segment's
                        // snapshot may be kept in part.
                        for _ in 0..rng.gen_range(1..40) {
                            log.append(&[rec()]).unwrap();
                        }
                        // (The second sync, when the flush rolls: the
                        // old segment's; else the flush completes.)
                        if rng.gen_bool(0.7) {
                            storage.hang_sync_after(rng.gen_range(1..3));
                            let _ = futures_lite::future::poll_once(log.flush()).await;
                        } else {
                            // A roll's tail mark (the shard stops) or its
                            // summary (none is left) fails to be written.
                            storage.fail_atomic_write_after(rng.gen_range(1..3));
                            let _ = log.flush().await;
                        }
                        drop(log);
                        storage.crash(CrashPlan {
                            seed: rng.gen(),
                            tear: rng.gen_bool(0.7),
                            reorder: rng.gen_bool(0.3),
                            dir_entries: rng.gen_bool(0.7),
                            ..CrashPlan::default()
                        });
                    }
                }
            }
            assert!(spared > 0, "seed {seed}: summaries never spared a replay");
        });
    }
}

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

        // Reopened: one snapshot per segment (the first one's was written
        // when the provider was set), and every record is there.
        let mut snapshots = 0;
        let log = ShardLog::open(storage.clone(), Path::new(DIR), cfg, &mut |e| {
            if let Replayed::Group(body) = e {
                assert_eq!(body.len(), 100 << 10);
                snapshots += 1;
            }
        })
        .await
        .unwrap();
        assert_eq!(snapshots, segments);
        assert_eq!(log.end().0, 2_000);
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

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

        // Reopened: one snapshot per segment after the first, and every
        // record is there.
        let mut snapshots = 0;
        let log = ShardLog::open(storage.clone(), Path::new(DIR), cfg, &mut |e| {
            if let Replayed::Group(body) = e {
                assert_eq!(body.len(), 100 << 10);
                snapshots += 1;
            }
        })
        .await
        .unwrap();
        assert_eq!(snapshots, segments - 1);
        assert_eq!(log.end().0, 2_000);
    });
}

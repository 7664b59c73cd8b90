//! The shard log on a real disk through glommio DMA files (O_DIRECT).

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::log::{Frontier, LogConfig, ReadLimits, ShardLog};
use felix_engine::runtime::warm_up_dma;
use felix_engine::storage::dma::DmaStorage;
use felix_engine::Offset;
use glommio::LocalExecutorBuilder;
use std::path::PathBuf;

fn run<F: std::future::Future<Output = ()> + 'static>(f: impl FnOnce() -> F + Send + 'static) {
    LocalExecutorBuilder::default()
        .spawn(f)
        .expect("executor")
        .join()
        .expect("join");
}

fn rec(i: u64) -> RecordIn {
    RecordIn {
        timestamp_ms: i,
        key: None,
        headers: vec![],
        payload: Bytes::from(format!("record-{i}-").repeat((i % 50) as usize + 1)),
    }
}

async fn read_all(log: &ShardLog<DmaStorage>) -> Vec<Bytes> {
    let mut out = Vec::new();
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
            return out;
        }
        out.extend(r.records.iter().map(|r| r.payload.clone()));
        at = r.next;
    }
}

#[test]
fn write_close_reopen_read_back_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let cfg = LogConfig {
            segment_bytes: 64 << 10,
            read_cache_bytes: 0,
            ..LogConfig::default()
        };
        let log = ShardLog::open(DmaStorage::new(), &path, cfg.clone(), &mut |_| {})
            .await
            .unwrap();
        for chunk in 0..40u64 {
            let batch: Vec<_> = (0..25).map(|i| rec(chunk * 25 + i)).collect();
            let a = log.append(&batch).unwrap();
            log.flush().await.unwrap();
            log.wait(a.lsn, Frontier::Durable).await.unwrap();
        }
        assert!(log.stats().segments > 1, "segments should roll");
        log.close().await.unwrap();
        let log = ShardLog::open(DmaStorage::new(), &path, cfg, &mut |_| {})
            .await
            .unwrap();
        assert_eq!(log.end(), Offset(1000));
        let got = read_all(&log).await;
        assert_eq!(got.len(), 1000);
        for (i, p) in got.iter().enumerate() {
            assert_eq!(p, &rec(i as u64).payload);
        }
    });
}

#[test]
fn a_hand_truncated_segment_reopens_at_the_last_whole_record() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    let p2 = path.clone();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let log = ShardLog::open(DmaStorage::new(), &p2, LogConfig::default(), &mut |_| {})
            .await
            .unwrap();
        for i in 0..100u64 {
            log.append(&[rec(i)]).unwrap();
        }
        log.flush().await.unwrap();
        log.close().await.unwrap();
    });
    // Cut the file in the middle of the last record, by hand.
    let seg = path.join("00000000000000000000.log");
    let bytes = std::fs::read(&seg).unwrap();
    let valid = bytes.iter().rposition(|b| *b != 0).unwrap() + 1;
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.set_len(valid as u64 - 10).unwrap();
    drop(f);
    run(move || async move {
        let log = ShardLog::open(DmaStorage::new(), &path, LogConfig::default(), &mut |_| {})
            .await
            .unwrap();
        assert_eq!(log.end(), Offset(99));
        let got = read_all(&log).await;
        assert_eq!(got.len(), 99);
        let a = log.append(&[rec(99)]).unwrap();
        assert_eq!(a.base, Offset(99));
        log.flush().await.unwrap();
        assert_eq!(read_all(&log).await.len(), 100);
    });
}

//! Durable append throughput on the real disk, with and without segment
//! preallocation, interleaved so both see the same machine load.
//! `cargo run --release -p felix-engine --example append_ab [record_bytes] [batch] [MiB]`

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::log::{Frontier, LogConfig, ShardLog};
use felix_engine::runtime::warm_up_dma;
use felix_engine::storage::dma::DmaStorage;
use glommio::LocalExecutorBuilder;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("number"))
        .collect();
    let size = args.first().copied().unwrap_or(1024);
    let batch = args.get(1).copied().unwrap_or(1024);
    let mib = args.get(2).copied().unwrap_or(512);
    LocalExecutorBuilder::default()
        .spawn(move || async move {
            let dir = tempfile::tempdir().unwrap();
            warm_up_dma(dir.path()).await.unwrap();
            let p = Bytes::from(vec![0x5a; size]);
            let recs: Vec<RecordIn> = (0..batch).map(|_| RecordIn { payload: p.clone(), ..Default::default() }).collect();
            let batches = (mib << 20) / (size * batch);
            for round in 0..3 {
                for pre in [false, true] {
                    let cfg = LogConfig { preallocate: pre, ..LogConfig::default() };
                    let path = dir.path().join(format!("r{round}-{pre}"));
                    let log = ShardLog::open(DmaStorage::new(), &path, cfg, &mut |_| {}).await.unwrap();
                    let t = Instant::now();
                    for _ in 0..batches {
                        log.append(&recs).unwrap();
                        log.flush().await.unwrap();
                    }
                    let secs = t.elapsed().as_secs_f64();
                    let mb = (batches * size * batch) as f64 / 1e6;
                    let st = log.stats();
                    println!(
                        "serial    preallocate={pre:<5} {size}B x{batch}: {:.0} MB/s payload, {:.0} records/s, {} fsyncs, mean fsync {:.0} us",
                        mb / secs,
                        (batches * batch) as f64 / secs,
                        st.sync.count,
                        st.sync.sum_us as f64 / st.sync.count.max(1) as f64
                    );
                    log.close().await.unwrap();
                    let _ = std::fs::remove_dir_all(&path);
                }
                // Group commit as the broker runs it: the shard's flusher
                // task, and a producer that keeps up to 4 batches appended
                // and unacknowledged (durable). The flusher takes whatever is
                // queued when it starts a round, so a flush covers up to 4
                // batches with one fdatasync: fewer syncs per byte than the
                // serial runs (and than fio with one sync per 1 MiB).
                for pre in [false, true] {
                let cfg = LogConfig { preallocate: pre, ..LogConfig::default() };
                let path = dir.path().join(format!("r{round}-pipelined-{pre}"));
                let log = ShardLog::open(DmaStorage::new(), &path, cfg, &mut |_| {}).await.unwrap();
                let flusher = log.clone();
                let task = glommio::spawn_local(async move { flusher.run_flusher().await }).detach();
                let t = Instant::now();
                let mut waiting = std::collections::VecDeque::new();
                for _ in 0..batches {
                    let a = log.append(&recs).unwrap();
                    waiting.push_back(a.lsn);
                    if waiting.len() >= 4 {
                        let lsn = waiting.pop_front().unwrap();
                        log.wait(lsn, Frontier::Durable).await.unwrap();
                    }
                }
                for lsn in waiting {
                    log.wait(lsn, Frontier::Durable).await.unwrap();
                }
                let secs = t.elapsed().as_secs_f64();
                let mb = (batches * size * batch) as f64 / 1e6;
                let st = log.stats();
                println!(
                    "pipelined preallocate={pre:<5} (flusher task, 4 batches in flight) {size}B x{batch}: {:.0} MB/s payload, {:.0} records/s, {} fsyncs, mean fsync {:.0} us",
                    mb / secs,
                    (batches * batch) as f64 / secs,
                    st.sync.count,
                    st.sync.sum_us as f64 / st.sync.count.max(1) as f64
                );
                log.close().await.unwrap();
                drop(task);
                let _ = std::fs::remove_dir_all(&path);
                }
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

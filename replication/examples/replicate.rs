//! Replicated publish over loopback: three hosts, each on its own glommio
//! executor thread, one replica group; the elected leader publishes batches
//! with a window in flight and reports records/s and the commit latency of
//! each batch (proposed → committed on a majority and applied). By default
//! the log is the in-memory `ReplicaLog`, so this measures the protocol,
//! the event loop and the transport, not the disk; with
//! `FELIX_REPLICATE_DIR=DIR` each host keeps its journal and hard state
//! under `DIR/host-N` (`Host::open`), and every commit waits for a
//! majority's journals to be synced (all three on this machine's one disk).
//!
//! ```text
//! cargo run --release -p felix-replication --example replicate -- [BATCHES] [RECORDS] [BYTES] [INFLIGHT]
//! ```
//! Defaults: 20000 batches of 100 records of 100 bytes, 32 in flight.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_replication::host::{Host, HostConfig};
use glommio::net::TcpListener;
use glommio::{LocalExecutorBuilder, Placement};
use hdrhistogram::Histogram;

const GROUP: u64 = 1;

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: BATCHES RECORDS BYTES INFLIGHT"))
        .collect();
    let batches = args.first().copied().unwrap_or(20_000);
    let per_batch = args.get(1).copied().unwrap_or(100) as usize;
    let size = args.get(2).copied().unwrap_or(100) as usize;
    let inflight = args.get(3).copied().unwrap_or(32) as usize;

    let listeners: Vec<std::net::TcpListener> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let claimed = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        let fd = listener.into_raw_fd();
        let addrs = addrs.clone();
        let (claimed, done) = (claimed.clone(), done.clone());
        threads.push(
            LocalExecutorBuilder::new(Placement::Unbound)
                .name(&format!("host-{}", i + 1))
                .spawn(move || async move {
                    // SAFETY: the fd came from a listener this process owns
                    // and nothing else uses it.
                    let listener = unsafe { TcpListener::from_raw_fd(fd) };
                    let id = i as u64 + 1;
                    let peers: BTreeMap<u64, SocketAddr> = (0..3)
                        .filter(|&j| j != i)
                        .map(|j| (j as u64 + 1, addrs[j]))
                        .collect();
                    let mut config = HostConfig::new(id, peers);
                    config.data_dir = std::env::var_os("FELIX_REPLICATE_DIR")
                        .map(|d| std::path::PathBuf::from(d).join(format!("host-{id}")));
                    let host = Host::open(
                        config,
                        listener,
                        &[(GROUP, vec![1, 2, 3])],
                        Box::new(|_, _| {}),
                    )
                    .await
                    .unwrap();
                    while !done.load(Ordering::Acquire) {
                        if host.serving(GROUP)
                            && claimed
                                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                                .is_ok()
                        {
                            run(&host, batches, per_batch, size, inflight).await;
                            done.store(true, Ordering::Release);
                        }
                        glommio::timer::sleep(Duration::from_millis(5)).await;
                    }
                    // Let the others see `done` before connections close.
                    glommio::timer::sleep(Duration::from_millis(50)).await;
                    host.close();
                })
                .unwrap(),
        );
    }
    for t in threads {
        t.join().unwrap();
    }
}

async fn run(host: &Host, batches: u64, per_batch: usize, size: usize, inflight: usize) {
    let records: Rc<Vec<RecordIn>> = Rc::new(
        (0..per_batch)
            .map(|_| RecordIn {
                payload: Bytes::from(vec![7u8; size]),
                ..RecordIn::default()
            })
            .collect(),
    );
    let hist = Rc::new(RefCell::new(Histogram::<u64>::new(3).unwrap()));
    let next = Rc::new(RefCell::new(0u64));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..inflight {
        let (host, records, hist, next) =
            (host.clone(), records.clone(), hist.clone(), next.clone());
        workers.push(glommio::spawn_local(async move {
            loop {
                {
                    let mut n = next.borrow_mut();
                    if *n >= batches {
                        return;
                    }
                    *n += 1;
                }
                let t = Instant::now();
                host.publish(GROUP, records.as_slice())
                    .await
                    .expect("the leader stays put for the run");
                hist.borrow_mut()
                    .record(t.elapsed().as_micros() as u64)
                    .unwrap();
            }
        }));
    }
    for w in workers {
        w.await;
    }
    let secs = start.elapsed().as_secs_f64();
    let h = hist.borrow();
    let n = batches as f64 * per_batch as f64;
    let log = if std::env::var_os("FELIX_REPLICATE_DIR").is_some() {
        "journals on disk"
    } else {
        "in memory"
    };
    println!(
        "replicated to 3 ({log}): {batches} batches x {per_batch} x {size} B, {inflight} in flight: \
         {:.0} records/s, {:.1} MB/s; commit latency p50 {} us, p99 {} us, p99.9 {} us, max {} us",
        n / secs,
        n * size as f64 / secs / 1e6,
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999),
        h.max()
    );
}

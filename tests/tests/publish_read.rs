//! Publish and read end to end, against a real broker process over TCP.

use bytes::Bytes;
use felix_client::{Client, ClientConfig, ClientError, StreamOptions};
use felix_tests::{raw_call, Broker, BrokerOptions};
use felix_wire::{ErrorCode, RecordIn, StartPosition};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

async fn client(b: &Broker) -> Client {
    Client::connect(b.addr.as_str(), ClientConfig::default())
        .await
        .expect("connect")
}

/// Every record of `t/ns/{stream}` shard `shard`, from the earliest.
async fn read_records(c: &Client, stream: &str, shard: u32) -> Vec<felix_wire::Record> {
    let mut out = Vec::new();
    let mut from = StartPosition::Earliest;
    loop {
        let b = c
            .read("t", "ns", stream, shard, from, 1000, None)
            .await
            .expect("read");
        if b.records.is_empty() {
            return out;
        }
        from = StartPosition::Offset(b.next_offset);
        out.extend(b.records);
    }
}

async fn read_shard(c: &Client, stream: &str, shard: u32) -> Vec<(u64, Bytes)> {
    read_records(c, stream, shard)
        .await
        .into_iter()
        .map(|r| (r.offset, r.payload))
        .collect()
}

/// Publish `n` records `r0, r1, ...` over `shards` in turn; each one's
/// (shard, offset, payload) as acknowledged, sorted.
async fn publish_in_turn(c: &Client, stream: &str, shards: u32, n: u32) -> Vec<(u32, u64, Bytes)> {
    let mut acked = Vec::new();
    for i in 0..n {
        let payload = Bytes::from(format!("r{i}"));
        let off = c
            .publish("t", "ns", stream, i % shards, payload.clone())
            .await
            .unwrap();
        acked.push((i % shards, off, payload));
    }
    acked.sort();
    acked
}

/// Every record of shards `0..shards` as (shard, offset, payload), sorted.
async fn read_shards(c: &Client, stream: &str, shards: u32) -> Vec<(u32, u64, Bytes)> {
    let mut got = Vec::new();
    for shard in 0..shards {
        for (off, payload) in read_shard(c, stream, shard).await {
            got.push((shard, off, payload));
        }
    }
    got.sort();
    got
}

/// N records from several concurrent clients to several shards on several
/// cores come back exactly once per shard, in offset order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishers_read_back_every_record_once_in_order() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let admin = client(&broker).await;
    let shards = 4u32;
    admin
        .create_stream("t", "ns", "events", shards, StreamOptions::default())
        .await
        .unwrap();
    let producers = 4u32;
    let per_producer = 500u32;
    let mut tasks = Vec::new();
    for p in 0..producers {
        let addr = broker.addr.clone();
        tasks.push(tokio::spawn(async move {
            let c = Client::connect(addr.as_str(), ClientConfig::default())
                .await
                .unwrap();
            let mut i = 0;
            while i < per_producer {
                let n = (per_producer - i).min(1 + (i % 37));
                let shard = (p + i) % shards;
                let batch: Vec<RecordIn> = (i..i + n)
                    .map(|j| RecordIn {
                        payload: Bytes::from(format!("p{p}-{j}")),
                        ..Default::default()
                    })
                    .collect();
                c.publish_batch("t", "ns", "events", shard, batch)
                    .await
                    .unwrap();
                i += n;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut seen = HashSet::new();
    for shard in 0..shards {
        let recs = read_shard(&admin, "events", shard).await;
        for (i, (off, payload)) in recs.iter().enumerate() {
            assert_eq!(
                *off, i as u64,
                "offsets are dense and ordered on shard {shard}"
            );
            assert!(seen.insert(payload.clone()), "duplicate {:?}", payload);
        }
        let info = admin
            .describe_shard("t", "ns", "events", shard)
            .await
            .unwrap();
        assert_eq!(info.end_offset, recs.len() as u64);
    }
    assert_eq!(seen.len() as u32, producers * per_producer);
}

/// kill -9 while clients publish (batches and single records, with a small
/// segment size so rolls happen under load); after each restart every
/// acknowledged record is present, in order, with no duplicates from the
/// broker's side. Three crash rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_record_survives_kill_9() {
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[storage]\nsegment_bytes = 8192\n").unwrap();
    let mut broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(2)
        .env("FELIX_TEST_CONFIG", cfg.path().display()));
    let admin = client(&broker).await;
    admin
        .create_stream("t", "ns", "durable", 2, StreamOptions::default())
        .await
        .unwrap();
    let acked: Arc<std::sync::Mutex<Vec<(u32, u64, String)>>> = Arc::default();
    let counter = Arc::new(AtomicU64::new(0));
    for round in 0..3 {
        let mut tasks = Vec::new();
        for p in 0..3u32 {
            let addr = broker.addr.clone();
            let acked = acked.clone();
            let counter = counter.clone();
            tasks.push(tokio::spawn(async move {
                let c = Client::connect(addr.as_str(), ClientConfig::default())
                    .await
                    .unwrap();
                loop {
                    let i = counter.fetch_add(1, Ordering::SeqCst);
                    let shard = (i % 2) as u32;
                    let n = 1 + (i % 5) as usize;
                    let payloads: Vec<String> = (0..n).map(|k| format!("p{p}-{i}-{k}")).collect();
                    let batch = payloads
                        .iter()
                        .map(|pl| RecordIn {
                            payload: Bytes::from(pl.clone()),
                            ..Default::default()
                        })
                        .collect();
                    match c.publish_batch("t", "ns", "durable", shard, batch).await {
                        Ok(pb) => {
                            let mut a = acked.lock().unwrap();
                            for (k, pl) in payloads.into_iter().enumerate() {
                                a.push((shard, pb.base_offset + k as u64, pl));
                            }
                        }
                        Err(_) => return,
                    }
                }
            }));
        }
        // Let some publishes land, then pull the plug.
        let want = 600 * (round + 1);
        felix_tests::wait_until(Duration::from_secs(20), || {
            acked.lock().unwrap().len() >= want
        })
        .unwrap();
        broker.kill9();
        for t in tasks {
            let _ = t.await;
        }
        broker.restart();
        let c = client(&broker).await;
        let acked = acked.lock().unwrap().clone();
        for shard in 0..2u32 {
            let recs = read_shard(&c, "durable", shard).await;
            let offsets: Vec<u64> = recs.iter().map(|r| r.0).collect();
            assert_eq!(
                offsets,
                (0..recs.len() as u64).collect::<Vec<_>>(),
                "round {round}: dense, in order"
            );
            let payloads: HashSet<_> = recs.iter().map(|r| r.1.clone()).collect();
            assert_eq!(payloads.len(), recs.len(), "round {round}: no duplicates");
            for (s, off, payload) in acked.iter().filter(|a| a.0 == shard) {
                let got = recs.get(*off as usize).unwrap_or_else(|| {
                    panic!("round {round}: acked offset {off} on shard {s} lost")
                });
                assert_eq!(
                    got.1,
                    Bytes::from(payload.clone()),
                    "round {round}: acked record changed"
                );
            }
            let info = c.describe_shard("t", "ns", "durable", shard).await.unwrap();
            if round == 2 {
                assert!(info.segments > 1, "segments rolled under load");
            }
        }
    }
}

/// Errors are typed: unknown streams, bad names, shards out of range,
/// offsets past the tail, duplicates, oversized frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_typed_errors_and_lose_nothing() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    fn code<T>(r: Result<T, ClientError>) -> Option<ErrorCode> {
        r.err().and_then(|e| e.code())
    }
    assert_eq!(
        code(c.publish("t", "ns", "nope", 0, "x").await),
        Some(ErrorCode::NotFound)
    );
    c.create_stream("t", "ns", "s", 2, StreamOptions::default())
        .await
        .unwrap();
    assert_eq!(
        code(
            c.create_stream("t", "ns", "s", 2, StreamOptions::default())
                .await
                .map(|_| ())
        ),
        Some(ErrorCode::AlreadyExists)
    );
    assert_eq!(
        code(
            c.create_stream("t", "n s", "x", 1, StreamOptions::default())
                .await
                .map(|_| ())
        ),
        Some(ErrorCode::InvalidRequest)
    );
    assert!(c
        .create_stream("t", "ns", "zero", 0, StreamOptions::default())
        .await
        .is_err());
    assert_eq!(
        code(c.publish("t", "ns", "s", 9, "x").await),
        Some(ErrorCode::NotFound)
    );
    c.publish("t", "ns", "s", 0, "one").await.unwrap();
    assert_eq!(
        code(
            c.read("t", "ns", "s", 0, StartPosition::Offset(5), 10, None)
                .await
                .map(|_| ())
        ),
        Some(ErrorCode::InvalidRequest)
    );
    // Oversized payload: refused, connection and data intact.
    let big = vec![0u8; 17 << 20];
    assert!(c.publish("t", "ns", "s", 0, big).await.is_err());
    let c = client(&broker).await;
    let recs = read_shard(&c, "s", 0).await;
    assert_eq!(recs.len(), 1);
    let list = c.list_streams(None).await.unwrap();
    assert_eq!(list.len(), 1);
    // A tenant no stream can have is a mistake, not an empty list; one
    // that merely has no streams is an empty list.
    assert_eq!(
        code(c.list_streams(Some("a/b")).await.map(|_| ())),
        Some(ErrorCode::InvalidRequest)
    );
    assert!(c.list_streams(Some("nobody")).await.unwrap().is_empty());
    // The data directory's lock file is no tenant.
    assert_eq!(
        code(
            c.create_stream("felix.lock", "ns", "x", 1, StreamOptions::default())
                .await
                .map(|_| ())
        ),
        Some(ErrorCode::InvalidRequest)
    );
    c.delete_stream("t", "ns", "s").await.unwrap();
    assert_eq!(
        code(
            c.read("t", "ns", "s", 0, StartPosition::Earliest, 1, None)
                .await
                .map(|_| ())
        ),
        Some(ErrorCode::NotFound)
    );
}

/// A long poll is woken by a publish and never blocks other requests on the
/// same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_wakes_on_publish_and_does_not_block_the_connection() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "tail", 1, StreamOptions::default())
        .await
        .unwrap();
    let c2 = c.clone();
    let poll = tokio::spawn(async move {
        c2.read(
            "t",
            "ns",
            "tail",
            0,
            StartPosition::Latest,
            10,
            Some(Duration::from_secs(20)),
        )
        .await
    });
    // The poll has begun (its `Latest` is the end before the publish).
    felix_tests::wait_until(Duration::from_secs(20), || {
        sample(&broker, "felix_requests_total{op=\"read\"}") >= 1.0
    })
    .expect("the broker received the poll");
    // Requests on the same connection still answer while the poll waits.
    for _ in 0..5 {
        c.describe_shard("t", "ns", "tail", 0).await.unwrap();
    }
    c.publish("t", "ns", "tail", 0, "wake").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .expect("poll woke")
        .unwrap()
        .unwrap();
    assert_eq!(got.records.len(), 1);
    assert_eq!(&got.records[0].payload[..], b"wake");
}

/// Streams survive a clean restart; SIGTERM exits 0 after finishing work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_down_cleanly_and_streams_survive() {
    let mut broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    c.create_stream(
        "t",
        "ns",
        "keep",
        3,
        StreamOptions {
            retention_bytes: Some(1 << 30),
            ..StreamOptions::default()
        },
    )
    .await
    .unwrap();
    for i in 0..30u32 {
        c.publish("t", "ns", "keep", i % 3, format!("r{i}"))
            .await
            .unwrap();
    }
    drop(c);
    let status = broker.terminate();
    assert!(status.success(), "exit status {status:?}");
    broker.restart();
    let c = client(&broker).await;
    let info = c.describe_stream("t", "ns", "keep").await.unwrap();
    assert_eq!(info.shards, 3);
    assert_eq!(info.retention_bytes, Some(1 << 30));
    let total: usize = {
        let mut n = 0;
        for s in 0..3 {
            n += read_shard(&c, "keep", s).await.len();
        }
        n
    };
    assert_eq!(total, 30);
}

/// SIGTERM a broker started by hand, and what it printed and how it
/// ended (killed if it has not exited within 30 s).
async fn stop_and_collect(mut child: std::process::Child) -> std::process::Output {
    // SAFETY: signalling our own child process (not yet waited for).
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::park_timeout(Duration::from_millis(20));
        }
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap()
}

/// A stop asked for before the broker has opened anything (here while it
/// waits for its port, which another process holds) ends it at once, with
/// exit code 0 and a line saying so, rather than by the signal's default
/// action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_before_start_up_ends_the_broker_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = holder.local_addr().unwrap().to_string();
    let child = felix_tests::broker_command!(Some(dir.path()), &listen)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Waiting for the port (up to 10 s) by now.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = std::time::Instant::now();
    let out = stop_and_collect(child).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{:?}: {stderr}", out.status);
    assert!(stderr.contains("stopped before start-up"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    drop(holder);
}

/// A stop asked for while the broker cannot finish starting (a shard's
/// tail mark here is a FIFO nobody writes to, so reading it never returns,
/// as with a disk that stopped answering) ends the process after a grace
/// instead of leaving it up until SIGKILL: a core takes its stop only once
/// started. The core that did start (shard 1's: two shards on two cores
/// land on different ones) stops cleanly first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_start_up_that_cannot_finish_exits() {
    let dir = tempfile::tempdir().unwrap();
    let on_two = |listen: &str| {
        felix_tests::broker_command_on_cores(
            env!("CARGO_BIN_EXE_felix-test-broker"),
            Some(dir.path()),
            listen,
            2,
        )
    };
    let (mut child, addr) = felix_tests::spawn_announcing(on_two("127.0.0.1:0"));
    let c = Client::connect(addr.as_str(), ClientConfig::default())
        .await
        .unwrap();
    c.create_stream("t", "ns", "stuck", 2, StreamOptions::default())
        .await
        .unwrap();
    drop(c);
    let pid = child.id() as libc::pid_t;
    // SAFETY: signalling our own child process (not yet waited for).
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let mark = dir.path().join("t/ns/stuck/0/tail.mark");
    std::fs::remove_file(&mark).unwrap();
    let path = std::ffi::CString::new(mark.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let listen = format!("127.0.0.1:{}", felix_tests::free_ports(1)[0]);
    let child = on_two(&listen)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let clean = |shard: u32| {
        dir.path()
            .join(format!("t/ns/stuck/{shard}/clean.mark"))
            .exists()
    };
    // Shard 1's core has started once its open took the mark away (shard
    // 0's core is stuck reading the FIFO).
    felix_tests::wait_until(Duration::from_secs(20), || !clean(1)).expect("shard 1 opened");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = stop_and_collect(child).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{:?}: {stderr}", out.status);
    assert!(
        stderr.contains("felix: stopped during start-up"),
        "{stderr}"
    );
    assert!(stderr.contains("1 of 2 cores had not started"), "{stderr}");
    // Its shard's mark from the first stop was taken away when it opened
    // again: it is there because that core stopped cleanly again.
    assert!(clean(1), "the core that started stopped cleanly");
    // The FIFO is a test's doing; with a real mark the same files open.
    std::fs::remove_file(&mark).unwrap();
}

/// Metrics are served in Prometheus text and count what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_publishes_and_shard_offsets() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "m", 2, StreamOptions::default())
        .await
        .unwrap();
    for i in 0..10u32 {
        c.publish("t", "ns", "m", i % 2, "x").await.unwrap();
    }
    assert_eq!(broker.metric("felix_publish_records_total"), 10.0);
    assert_eq!(broker.metric("felix_shard_end_offset"), 10.0);
    assert!(broker.metric("felix_fsync_seconds_count") >= 1.0);
    // Every publish waited for its fdatasync (the default), and is counted
    // once in the durable series of the broker-side publish histogram.
    let series = |m: &str, ack: &str| broker.metric_series(m, &[("ack", ack)]);
    assert_eq!(series("felix_publish_seconds_count", "durable"), Some(10.0));
    assert_eq!(series("felix_publish_seconds_count", "queued"), Some(0.0));
    assert_eq!(
        series("felix_publish_seconds_count", "replicated"),
        Some(0.0)
    );
    assert!(series("felix_publish_seconds_sum", "durable").unwrap() > 0.0);
    let text = broker.metrics();
    let buckets: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("felix_publish_seconds_bucket{ack=\"durable\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(buckets.len() > 2, "{text}");
    assert!(
        buckets.windows(2).all(|w| w[0] <= w[1]),
        "buckets are cumulative: {buckets:?}"
    );
    assert_eq!(*buckets.last().unwrap(), 10.0, "+Inf holds every publish");
    // The process's own figures, under the names every Prometheus client
    // library uses: CPU time, memory, threads (two executors at least),
    // descriptors (segment files and sockets among them), start time.
    let cpu = text
        .lines()
        .find_map(|l| l.strip_prefix("process_cpu_seconds_total "))
        .and_then(|v| v.parse::<f64>().ok());
    assert!(cpu.is_some_and(|c| c >= 0.0), "{text}");
    assert!(
        broker.metric("process_resident_memory_bytes") > 1e6,
        "{text}"
    );
    assert!(broker.metric("process_threads") >= 2.0, "{text}");
    assert!(broker.metric("process_open_fds") >= 4.0, "{text}");
    assert!(
        broker.metric("process_max_fds") >= broker.metric("process_open_fds"),
        "{text}"
    );
    let started = broker.metric("process_start_time_seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        started > now - 600.0 && started <= now + 5.0,
        "started at {started}, now {now}"
    );
    // Counters never go backwards: deleting the stream keeps what its
    // shards did in the broker's totals.
    let counters = [
        "felix_fsync_seconds_count",
        "felix_fsync_seconds_sum",
        "felix_flushes_total",
        "felix_disk_bytes_written_total",
    ];
    let before: Vec<f64> = counters.iter().map(|m| broker.metric(m)).collect();
    c.delete_stream("t", "ns", "m").await.unwrap();
    for (m, was) in counters.iter().zip(before) {
        let now = broker.metric(m);
        assert!(
            now >= was,
            "{m} went from {was} to {now} when the stream was deleted"
        );
    }
    assert_eq!(
        broker.metric("felix_shard_end_offset"),
        0.0,
        "the shards are gone"
    );
}

/// Without durable storage the broker runs in memory and does not offer groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_memory_broker_works_and_does_not_advertise_groups() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().in_memory());
    let c = client(&broker).await;
    assert_eq!(c.features() & felix_wire::FEATURE_GROUPS, 0);
    c.create_stream("t", "ns", "mem", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "mem", 0, "x").await.unwrap();
    assert_eq!(read_shard(&c, "mem", 0).await.len(), 1);
}

/// Untrusted bytes never take the broker down: garbage, truncated frames,
/// oversized length prefixes and a request before HELLO each get an error or
/// a closed connection, and the broker keeps serving everyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_never_take_the_broker_down() {
    use rand::{Rng, SeedableRng};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "safe", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "safe", 0, "before").await.unwrap();
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut inputs: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        vec![0xff; 64],
        // A length prefix of 4 GiB.
        vec![0xff, 0xff, 0xff, 0xff, 1, 1, 0, 0],
        // A well-formed header declaring an unknown opcode.
        vec![12, 0, 0, 0, 1, 0xee, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
    ];
    for _ in 0..40 {
        let n = rng.gen_range(1..300);
        inputs.push((0..n).map(|_| rng.gen()).collect());
    }
    for input in inputs {
        let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
        let _ = s.write_all(&input).await;
        let _ = s.shutdown().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut sink)).await;
    }
    // Still up, still correct.
    let c = client(&broker).await;
    c.publish("t", "ns", "safe", 0, "after")
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let recs = read_shard(&c, "safe", 0).await;
    assert_eq!(recs.len(), 2, "seed {seed}");
}

/// `server.max_connections` is enforced at accept (a connection over it is
/// answered `busy` and closed), and a connection with nothing in flight is
/// closed after `server.idle_timeout_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_limit_and_idle_timeout_are_enforced() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(1)
        .env("FELIX_MAX_CONNECTIONS", 2)
        .env("FELIX_IDLE_TIMEOUT_MS", 8000));
    // Fill the broker to its limit, one connection at a time (the start-up
    // probe's connection must be gone first).
    let open = |n: f64| {
        felix_tests::wait_until(Duration::from_secs(5), || {
            broker.metric("felix_connections_open") == n
        })
        .unwrap_or_else(|_| panic!("never {n} open: {}", broker.metrics()))
    };
    open(0.0);
    let mut a = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    open(1.0);
    let _b = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    open(2.0);
    // The third is over the limit: its HELLO is answered `busy`, then it
    // is closed.
    let mut c = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    let mut frame = bytes::BytesMut::new();
    felix_wire::encode_request(7, &hello(None, felix_wire::PROTOCOL_VERSION), &mut frame);
    c.write_all(&frame).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut got))
        .await
        .expect("closed promptly")
        .unwrap();
    let mut got = bytes::BytesMut::from(&got[..]);
    let (id, resp) = felix_wire::decode_response(&mut got, 1 << 20)
        .unwrap()
        .expect("an answer before the close");
    assert_eq!(id, 7);
    match resp {
        felix_wire::Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::Busy, "{e:?}");
            assert!(e.message.contains("max_connections = 2"), "{e:?}");
        }
        other => panic!("over-limit connection was served: {other:?}"),
    }
    assert!(got.is_empty(), "nothing after the refusal");
    // A client sees the typed error too.
    match Client::connect(&broker.addr, ClientConfig::default()).await {
        Err(e) => assert_eq!(e.code(), Some(ErrorCode::Busy), "{e}"),
        Ok(_) => panic!("a client over the limit was served"),
    }
    assert!(broker.metric("felix_connections_refused_total") >= 2.0);
    let mut buf = [0u8; 16];
    // The first two are idle: closed after the idle timeout.
    let n = tokio::time::timeout(Duration::from_secs(20), a.read(&mut buf))
        .await
        .expect("idle connection closed");
    assert!(matches!(n, Ok(0) | Err(_)));
    // Room again: a client connects and works.
    felix_tests::wait_until(Duration::from_secs(5), || {
        broker.metric("felix_connections_open") == 0.0
    })
    .unwrap();
    let cl = client(&broker).await;
    cl.create_stream("t", "ns", "x", 1, StreamOptions::default())
        .await
        .unwrap();
}

fn hello(want_core: Option<u32>, version: u16) -> felix_wire::Request {
    hello_offering(want_core, version, felix_wire::FEATURES_ALL)
}

fn hello_offering(want_core: Option<u32>, version: u16, features: u64) -> felix_wire::Request {
    felix_wire::Request::Hello {
        version,
        features,
        want_core,
        client_name: "raw-test".into(),
        token: None,
    }
}

/// A publish refused before anything of it was done says so
/// (`not_applied`), only to a client that negotiated
/// `FEATURE_ERROR_NOT_APPLIED` (a trailing field others would not
/// expect); a publish to a shard the stream does not have is one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_publish_says_it_stored_nothing_to_a_client_that_asked() {
    use felix_wire::{AckMode, PublishTarget, Request, Response, StreamRef};
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "refused", 1, StreamOptions::default())
        .await
        .unwrap();
    let to_shard_7 = Request::Publish {
        stream: StreamRef::new("t", "ns", "refused"),
        target: PublishTarget::Shard(7),
        ack: AckMode::Default,
        records: (0..5)
            .map(|i| RecordIn {
                payload: Bytes::from(format!("r{i}")),
                ..Default::default()
            })
            .collect(),
    };
    for (features, said) in [
        (felix_wire::FEATURES_ALL, true),
        (
            felix_wire::FEATURES_ALL & !felix_wire::FEATURE_ERROR_NOT_APPLIED,
            false,
        ),
    ] {
        let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
        let hello = hello_offering(None, felix_wire::PROTOCOL_VERSION, features);
        match raw_call(&mut s, 1, &hello).await {
            // The features both sides know.
            Response::HelloOk { features, .. } => {
                assert_eq!(features & felix_wire::FEATURE_ERROR_NOT_APPLIED != 0, said)
            }
            other => panic!("unexpected {other:?}"),
        }
        match raw_call(&mut s, 2, &to_shard_7).await {
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::NotFound, "{e:?}");
                assert_eq!(e.not_applied, said, "{e:?}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // Through the client, which asks for it.
    let e = c.publish("t", "ns", "refused", 7, "r").await.unwrap_err();
    assert!(e.not_applied(), "{e:?}");
    assert_eq!(
        c.describe_shard("t", "ns", "refused", 0)
            .await
            .unwrap()
            .end_offset,
        0
    );
}

/// On more than one core a client looks a stream up before its first
/// publish, to send it to the shard's core; when that lookup is refused
/// the publish was never sent, and its error says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_its_own_lookup_refused_was_not_applied() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    let e = c.publish("t", "ns", "missing", 0, "r").await.unwrap_err();
    assert_eq!(e.kind(), "not_found", "{e:?}");
    assert!(e.not_applied(), "{e:?}");
    // A keyed publish looks up the shard count (on any core count).
    let e = c
        .publish_keyed("t", "ns", "missing", "k", "r")
        .await
        .unwrap_err();
    assert_eq!(e.kind(), "not_found", "{e:?}");
    assert!(e.not_applied(), "{e:?}");
    // The lookup on its own is a describe, which applies nothing either
    // way: the broker does not mark it.
    let e = c.describe_stream("t", "ns", "missing").await.unwrap_err();
    assert!(!e.not_applied(), "{e:?}");
}

/// A HELLO naming a core moves the connection to that core; a request for a
/// shard another core owns gets `wrong_core` naming the right core; a HELLO
/// with an unsupported version is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_move_to_the_core_they_ask_for_and_wrong_core_names_the_owner() {
    use felix_wire::{Request, Response, StreamRef};
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    let info = c
        .create_stream("t", "ns", "placed", 2, StreamOptions::default())
        .await
        .unwrap();
    assert_eq!(info.placement.len(), 2);
    assert_ne!(
        info.placement[0], info.placement[1],
        "two shards on two cores"
    );
    for want in 0..2u32 {
        for _ in 0..4 {
            let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
            match raw_call(&mut s, 1, &hello(Some(want), felix_wire::PROTOCOL_VERSION)).await {
                Response::HelloOk { core, cores, .. } => {
                    assert_eq!(core, want, "served by the core it asked for");
                    assert_eq!(cores, 2);
                }
                other => panic!("unexpected {other:?}"),
            }
            // The shard this core does not own: wrong_core with the owner.
            let other_shard = info.placement.iter().position(|c| *c != want).unwrap() as u32;
            let req = Request::DescribeShard {
                stream: StreamRef::new("t", "ns", "placed"),
                shard: other_shard,
            };
            match raw_call(&mut s, 2, &req).await {
                Response::Error(e) => {
                    assert_eq!(e.code, ErrorCode::WrongCore);
                    assert_eq!(e.core, Some(info.placement[other_shard as usize]));
                }
                other => panic!("unexpected {other:?}"),
            }
            let own_shard = info.placement.iter().position(|c| *c == want).unwrap() as u32;
            let req = Request::DescribeShard {
                stream: StreamRef::new("t", "ns", "placed"),
                shard: own_shard,
            };
            assert!(matches!(
                raw_call(&mut s, 3, &req).await,
                Response::Shard(_)
            ));
        }
    }
    let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    match raw_call(&mut s, 1, &hello(None, 0)).await {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::Unsupported),
        other => panic!("version 0 accepted: {other:?}"),
    }
}

/// Every field of a record comes back as it was published, whatever the
/// record carries: keys absent, empty or binary; no headers, one, or several
/// with empty or non-ASCII names and empty or binary values; a timestamp
/// given, or stamped by the broker when none is; payloads empty or large.
/// The broker reads a publish's records in place from the frame and writes
/// them to the log from there, so this checks that path field by field, in
/// answers from memory and from disk after kill -9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_come_back_as_published_whatever_they_carry() {
    let mut broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "fields", 1, StreamOptions::default())
        .await
        .unwrap();
    let keys = [
        None,
        Some(Bytes::new()),
        Some(Bytes::from_static(b"\0k\xff")),
    ];
    let headers: [Vec<(String, Bytes)>; 4] = [
        vec![],
        vec![(String::new(), Bytes::new())],
        vec![("trace".into(), Bytes::from_static(b"\x01\x02"))],
        vec![
            ("é-名前".into(), Bytes::from(vec![7u8; 300])),
            ("b".into(), Bytes::new()),
            ("c".into(), Bytes::from_static(b"three")),
        ],
    ];
    let timestamps = [None, Some(0), Some(1_700_000_000_123)];
    let mut records = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        for (j, h) in headers.iter().enumerate() {
            for (k, ts) in timestamps.iter().enumerate() {
                let size = [0, 1, 100, 70_000][(i + j + k) % 4];
                records.push(RecordIn {
                    timestamp_ms: *ts,
                    key: key.clone(),
                    headers: h.clone(),
                    payload: Bytes::from(vec![(i * 16 + j * 4 + k) as u8; size]),
                });
            }
        }
    }
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let before = now();
    // In two publishes, and the last record alone.
    let (last, rest) = records.split_last().unwrap();
    let (a, b) = rest.split_at(rest.len() / 2);
    let mut base = Vec::new();
    for batch in [a.to_vec(), b.to_vec(), vec![last.clone()]] {
        let n = batch.len() as u32;
        let p = c
            .publish_batch("t", "ns", "fields", 0, batch)
            .await
            .unwrap();
        assert_eq!(p.count, n);
        base.push(p.base_offset);
    }
    let after = now();
    assert_eq!(base, [0, a.len() as u64, (a.len() + b.len()) as u64]);
    let check = |got: &[felix_wire::Record]| {
        assert_eq!(got.len(), records.len());
        for (i, (r, want)) in got.iter().zip(&records).enumerate() {
            assert_eq!(r.offset, i as u64);
            assert_eq!(r.key, want.key, "record {i}'s key");
            assert_eq!(r.headers, want.headers, "record {i}'s headers");
            assert_eq!(r.payload, want.payload, "record {i}'s payload");
            match want.timestamp_ms {
                Some(t) => assert_eq!(r.timestamp_ms, t, "record {i}'s timestamp"),
                None => assert!(
                    (before..=after).contains(&r.timestamp_ms),
                    "record {i} stamped {} outside {before}..={after}",
                    r.timestamp_ms
                ),
            }
        }
    };
    check(&read_records(&c, "fields", 0).await);
    // A consumer group hands them out the same, headers and all (its
    // answers carry them as reads do, beside each claim's fields).
    let mut polled = Vec::new();
    while polled.len() < records.len() {
        let got = c
            .group_poll("t", "ns", "fields", 0, "fields-group", 1000)
            .await
            .unwrap();
        assert!(!got.is_empty(), "the group stopped at {}", polled.len());
        polled.extend(got.into_iter().map(|g| felix_wire::Record {
            offset: g.offset,
            timestamp_ms: g.timestamp_ms,
            key: g.key,
            headers: g.headers,
            payload: g.payload,
        }));
    }
    check(&polled);
    broker.kill9();
    broker.restart();
    check(&read_records(&client(&broker).await, "fields", 0).await);
}

/// Records the storage format cannot hold (here: more headers than the
/// limit) are refused with invalid_request and never reach the disk, so the
/// shard still reads and the broker still restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstorable_records_are_refused_and_the_broker_still_restarts() {
    let mut broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "h", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "h", 0, "ok").await.unwrap();
    let headers = (0..70_000)
        .map(|i| (format!("h{i}"), Bytes::new()))
        .collect();
    let bad = RecordIn {
        headers,
        payload: Bytes::from_static(b"x"),
        ..Default::default()
    };
    let err = c
        .publish_batch("t", "ns", "h", 0, vec![bad])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::InvalidRequest), "{err}");
    c.publish("t", "ns", "h", 0, "still ok").await.unwrap();
    broker.kill9();
    broker.restart();
    let c = client(&broker).await;
    assert_eq!(read_shard(&c, "h", 0).await.len(), 2);
}

/// The read cap counts keys and headers, not only payloads: records with
/// large keys come back a few at a time, never in one oversized answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_records_with_large_keys_stay_within_the_byte_cap() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "k", 1, StreamOptions::default())
        .await
        .unwrap();
    for i in 0..12u32 {
        let rec = RecordIn {
            key: Some(Bytes::from(vec![b'k'; 1 << 20])),
            payload: Bytes::from(format!("r{i}")),
            ..Default::default()
        };
        c.publish_batch("t", "ns", "k", 0, vec![rec]).await.unwrap();
    }
    let b = c
        .read("t", "ns", "k", 0, StartPosition::Earliest, 1000, None)
        .await
        .unwrap();
    assert!(
        !b.records.is_empty() && b.records.len() <= 4,
        "{} records of 1 MiB keys in one read",
        b.records.len()
    );
    assert_eq!(read_shard(&c, "k", 0).await.len(), 12);
}

/// A one-core broker whose segments roll every 4 KiB (and the config file
/// that says so, to keep while it runs).
fn broker_with_4k_segments() -> (Broker, tempfile::NamedTempFile) {
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[storage]\nsegment_bytes = 4096\n").unwrap();
    let broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(1)
        .env("FELIX_TEST_CONFIG", cfg.path().display()));
    (broker, cfg)
}

/// Corruption in the middle of a shard's log (a sealed segment) is never
/// skipped. After a restart that takes sealed segments' summaries for what
/// they hold, a read that meets the damaged batch fails naming the file and
/// byte, and the rest of the shard is served (reads past it, publishes).
/// With `verify_on_open` the restart reads every segment: that shard
/// refuses requests naming the file and byte, its gauge says stopped, and
/// every other shard is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_sealed_segment_is_never_skipped() {
    let (mut broker, cfg) = broker_with_4k_segments();
    let c = client(&broker).await;
    c.create_stream("t", "ns", "rot", 2, StreamOptions::default())
        .await
        .unwrap();
    for i in 0..100u32 {
        c.publish("t", "ns", "rot", i % 2, vec![b'x'; 200])
            .await
            .unwrap();
    }
    broker.kill9();
    let shard0 = broker.data_dir().unwrap().join("t/ns/rot/0");
    let seg = shard0.join("00000000000000000000.log");
    assert!(shard0.join("00000000000000000000.sum").exists());
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[1000] ^= 0x40;
    std::fs::write(&seg, bytes).unwrap();
    let names_the_byte = |msg: String| {
        assert!(
            msg.contains("00000000000000000000.log") && msg.contains("byte"),
            "{msg}"
        );
    };

    broker.restart();
    let c = client(&broker).await;
    let err = c
        .read("t", "ns", "rot", 0, StartPosition::Earliest, 10, None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Internal), "{err}");
    names_the_byte(err.to_string());
    assert_eq!(broker.metric("felix_read_damage_total"), 1.0);
    let past = c
        .read("t", "ns", "rot", 0, StartPosition::Offset(40), 100, None)
        .await
        .unwrap();
    assert_eq!(past.records.len(), 10);
    assert_eq!(past.records[0].offset, 40);
    c.publish("t", "ns", "rot", 0, vec![b'y'; 10])
        .await
        .unwrap();
    assert_eq!(read_shard(&c, "rot", 1).await.len(), 50);
    assert_eq!(broker.metric("felix_shard_stopped"), 0.0);
    drop(c);

    std::fs::write(
        cfg.path(),
        "[storage]\nsegment_bytes = 4096\nverify_on_open = true\n",
    )
    .unwrap();
    broker.kill9();
    broker.restart();
    let c = client(&broker).await;
    let err = c
        .read("t", "ns", "rot", 0, StartPosition::Offset(40), 10, None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Unavailable));
    names_the_byte(err.to_string());
    assert_eq!(read_shard(&c, "rot", 1).await.len(), 50);
    assert_eq!(broker.metric("felix_shard_stopped"), 1.0);
}

/// After a clean stop (SIGTERM) a shard's log must end where it ended then:
/// damage to its newest batches, which after a crash would be cut as a torn
/// write, refuses the shard instead and nothing is cut; a shard whose newest
/// segment file is gone is refused rather than started again at a lower
/// offset. Every other shard is served, and removing the mark the error
/// names opens the shard as after a crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanly_stopped_shard_that_lost_records_is_refused_not_cut() {
    let (mut broker, _cfg) = broker_with_4k_segments();
    let c = client(&broker).await;
    c.create_stream("t", "ns", "mark", 3, StreamOptions::default())
        .await
        .unwrap();
    // 5 single-record publishes a shard, then one batch of 5.
    for shard in 0..3 {
        for _ in 0..5 {
            c.publish("t", "ns", "mark", shard, vec![b'x'; 100])
                .await
                .unwrap();
        }
        let batch = (0..5)
            .map(|_| RecordIn {
                payload: vec![b'y'; 100].into(),
                ..RecordIn::default()
            })
            .collect();
        c.publish_batch("t", "ns", "mark", shard, batch)
            .await
            .unwrap();
    }
    // Shard 1 rolls past its first segment.
    for _ in 0..60 {
        c.publish("t", "ns", "mark", 1, vec![b'z'; 200])
            .await
            .unwrap();
    }
    drop(c);
    assert!(broker.terminate().success());
    let dir = broker.data_dir().unwrap().join("t/ns/mark");
    // Shard 0: a bit of the last batch flipped.
    let seg = dir.join("0/00000000000000000000.log");
    let mut bytes = std::fs::read(&seg).unwrap();
    let len = bytes.len();
    // (The file ends at the page its data ends in: zeros after the data.)
    let data_end = bytes.iter().rposition(|&b| b != 0).unwrap() + 1;
    bytes[data_end - 20] ^= 0x08;
    std::fs::write(&seg, &bytes).unwrap();
    // Shard 1: its newest segment gone.
    let newest = std::fs::read_dir(dir.join("1"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".log"))
        .max()
        .unwrap();
    assert_ne!(newest, "00000000000000000000.log", "shard 1 did not roll");
    std::fs::remove_file(dir.join("1").join(&newest)).unwrap();
    broker.restart();
    let c = client(&broker).await;
    for (shard, says) in [(0, "closed cleanly"), (1, "segment files were lost")] {
        let err = c
            .read("t", "ns", "mark", shard, StartPosition::Earliest, 10, None)
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Some(ErrorCode::Unavailable),
            "shard {shard}: {err}"
        );
        assert!(err.to_string().contains(says), "shard {shard}: {err}");
    }
    assert_eq!(std::fs::read(&seg).unwrap().len(), len, "shard 0 was cut");
    assert_eq!(read_shard(&c, "mark", 2).await.len(), 10);
    assert_eq!(broker.metric("felix_shard_stopped"), 2.0);
    // The operator accepts the loss of shard 0's damaged batch.
    drop(c);
    assert!(broker.terminate().success());
    std::fs::remove_file(dir.join("0/clean.mark")).unwrap();
    broker.restart();
    let c = client(&broker).await;
    assert_eq!(read_shard(&c, "mark", 0).await.len(), 5);
    assert_eq!(read_shard(&c, "mark", 2).await.len(), 10);
}

/// One labelled sample of a metric, e.g. `felix_requests_total{op="read"}`
/// (0 when the broker has not printed it).
fn sample(b: &Broker, series: &str) -> f64 {
    b.metrics()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Read responses until the broker closes the connection: what came, and
/// whether the close was clean (an orderly EOF rather than a reset).
async fn read_until_closed(
    s: &mut tokio::net::TcpStream,
) -> (Vec<(u64, felix_wire::Response)>, std::io::Result<()>) {
    use tokio::io::AsyncReadExt;
    let mut buf = bytes::BytesMut::new();
    let mut got = Vec::new();
    let end = loop {
        while let Some(frame) = felix_wire::decode_response(&mut buf, 64 << 20).unwrap() {
            got.push(frame);
        }
        let mut chunk = [0u8; 65536];
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut chunk))
            .await
            .expect("the broker closed the connection")
        {
            Ok(0) => break Ok(()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => break Err(e),
        }
    };
    assert!(buf.is_empty(), "a partial frame before the close: {buf:?}");
    (got, end)
}

/// `limits.max_records_per_publish` and `server.max_frame_bytes` are
/// enforced with `too_large`: a publish over the record limit is refused
/// (connection kept, nothing of it written), a frame declaring more than the
/// frame limit gets an error with request id 0 and the connection is closed
/// (the stream cannot be resynchronised). The broker keeps serving and
/// nothing written before is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frames_and_publishes_get_too_large() {
    use felix_wire::{AckMode, PublishTarget, Request, Response, StreamRef};
    use tokio::io::AsyncWriteExt;
    // The record limit has no environment variable; the default (100000)
    // is also the codec's cap on any list, so set it below that.
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[limits]\nmax_records_per_publish = 10\n").unwrap();
    let broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(1)
        .env("FELIX_TEST_CONFIG", cfg.path().display())
        .env("FELIX_MAX_FRAME_BYTES", 65536));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "big", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "big", 0, "before").await.unwrap();

    let publish = |n: usize, tag: &str| Request::Publish {
        stream: StreamRef::new("t", "ns", "big"),
        target: PublishTarget::Shard(0),
        ack: AckMode::Default,
        records: (0..n)
            .map(|i| RecordIn {
                payload: Bytes::from(format!("{tag}-{i}")),
                ..Default::default()
            })
            .collect(),
    };
    let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    let max_frame = match raw_call(&mut s, 1, &hello(None, felix_wire::PROTOCOL_VERSION)).await {
        Response::HelloOk {
            max_frame_bytes, ..
        } => max_frame_bytes,
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(max_frame, 65536, "HELLO_OK announces the configured limit");

    // (a) At the record limit: accepted. One over: too_large.
    match raw_call(&mut s, 2, &publish(10, "at")).await {
        Response::Published {
            shard: 0,
            base_offset: 1,
            count: 10,
        } => {}
        other => panic!("a publish at the limit: {other:?}"),
    }
    match raw_call(&mut s, 3, &publish(11, "over")).await {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::TooLarge, "{e}");
            assert!(e.message.contains("10"), "names the limit: {e}");
        }
        other => panic!("11 records with a limit of 10: {other:?}"),
    }
    // The connection is kept and nothing of the refused batch was written.
    let shard = Request::DescribeShard {
        stream: StreamRef::new("t", "ns", "big"),
        shard: 0,
    };
    match raw_call(&mut s, 4, &shard).await {
        Response::Shard(info) => assert_eq!(info.end_offset, 11),
        other => panic!("unexpected {other:?}"),
    }

    // (b) A frame over the frame limit: the broker checks the declared
    // length in the header, before the body arrives.
    let mut frame = bytes::BytesMut::new();
    let huge = Request::Publish {
        stream: StreamRef::new("t", "ns", "big"),
        target: PublishTarget::Shard(0),
        ack: AckMode::Default,
        records: vec![RecordIn {
            payload: Bytes::from(vec![b'x'; max_frame as usize]),
            ..Default::default()
        }]
        .into(),
    };
    felix_wire::encode_request(5, &huge, &mut frame);
    let header = felix_wire::peek_header(&frame).unwrap();
    assert!(header.len > max_frame);
    s.write_all(&frame[..felix_wire::FRAME_HEADER_BYTES])
        .await
        .unwrap();
    let (answers, end) = read_until_closed(&mut s).await;
    assert_eq!(answers.len(), 1, "{answers:?}");
    match &answers[0] {
        (0, Response::Error(e)) => {
            assert_eq!(e.code, ErrorCode::TooLarge, "{e}");
            assert!(
                e.message.contains(&header.len.to_string())
                    && e.message.contains(&max_frame.to_string()),
                "names the declared size and the limit: {e}"
            );
        }
        other => panic!("an oversized frame: {other:?}"),
    }
    end.expect("closed cleanly after the error");
    assert_eq!(
        sample(&broker, "felix_errors_total{code=\"too_large\"}"),
        2.0
    );

    // Still serving, and everything acknowledged is there.
    let c = client(&broker).await;
    c.publish("t", "ns", "big", 0, "after").await.unwrap();
    // The client refuses what cannot fit a frame before sending it, and
    // says whether a smaller batch would help.
    let rec = |n: usize| RecordIn {
        payload: Bytes::from(vec![b'x'; n]),
        ..Default::default()
    };
    let frame = max_frame as usize;
    let e = c
        .publish_batch("t", "ns", "big", 0, vec![rec(10), rec(frame + 1), rec(10)])
        .await
        .unwrap_err();
    assert!(
        matches!(e, ClientError::InvalidArgument(_))
            && e.to_string().contains(&format!(
                "a record of {} bytes (the record at index 1 of the 3 in this publish)",
                frame + 1
            ))
            && e.to_string().contains("so no publish can carry it"),
        "{e}"
    );
    let e = c
        .publish_batch(
            "t",
            "ns",
            "big",
            0,
            vec![rec(frame / 2), rec(frame / 2 + 10)],
        )
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("send them in smaller batches"),
        "{e}"
    );
    let payloads: Vec<Bytes> = read_shard(&c, "big", 0)
        .await
        .into_iter()
        .map(|r| r.1)
        .collect();
    let mut want = vec![Bytes::from("before")];
    want.extend((0..10).map(|i| Bytes::from(format!("at-{i}"))));
    want.push(Bytes::from("after"));
    assert_eq!(payloads, want);
}

/// Send one frame of raw bytes (possibly malformed) and read one response
/// frame: the request id it carries and the response.
async fn raw_frame_call(
    s: &mut tokio::net::TcpStream,
    frame: &[u8],
) -> (u64, felix_wire::Response) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(frame).await.unwrap();
    let mut buf = bytes::BytesMut::new();
    loop {
        if let Some(got) = felix_wire::decode_response(&mut buf, 64 << 20).unwrap() {
            assert!(buf.is_empty(), "more than one answer to one frame: {buf:?}");
            return got;
        }
        let mut chunk = [0u8; 65536];
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut chunk))
            .await
            .expect("the broker answered")
            .unwrap();
        assert!(n > 0, "broker closed the connection");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// After HELLO, a frame that is framed correctly but whose contents are bad
/// is a per-frame error: a known opcode with a body cut short or with an
/// invalid field gets `invalid_request`, an unknown opcode `unsupported`,
/// each under the frame's own request id, and the connection keeps serving.
/// (A declared length over the frame limit, which is fatal, is in
/// `oversized_frames_and_publishes_get_too_large`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_request_after_hello_gets_a_typed_error_under_its_id_and_the_connection_keeps_working(
) {
    use bytes::BytesMut;
    use felix_wire::{opcodes, Request, Response, StreamRef, FRAME_HEADER_BYTES};
    // One core, so no request can be answered with wrong_core.
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "listed", 1, StreamOptions::default())
        .await
        .unwrap();
    let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    match raw_call(&mut s, 1, &hello(None, felix_wire::PROTOCOL_VERSION)).await {
        Response::HelloOk { .. } => {}
        other => panic!("unexpected {other:?}"),
    }
    let set_len = |frame: &mut BytesMut| {
        let len = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&len.to_le_bytes());
    };

    // (a) DESCRIBE_STREAM whose stream path stops three bytes short (the
    // length prefix says so, so the frame itself is whole).
    let mut frame = BytesMut::new();
    let describe = Request::DescribeStream {
        stream: StreamRef::new("t", "ns", "listed"),
    };
    felix_wire::encode_request(7, &describe, &mut frame);
    frame.truncate(frame.len() - 3);
    set_len(&mut frame);
    let header = felix_wire::peek_header(&frame).unwrap();
    assert_eq!(header.opcode, opcodes::request::DESCRIBE_STREAM);
    match raw_frame_call(&mut s, &frame).await {
        (7, Response::Error(e)) => {
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{e}");
            assert!(e.message.contains("truncated"), "{e}");
        }
        other => panic!("a truncated DESCRIBE_STREAM: {other:?}"),
    }
    // (a) again: LIST_STREAMS whose optional tenant has presence byte 2.
    let mut frame = BytesMut::new();
    felix_wire::encode_request(7, &Request::ListStreams { tenant: None }, &mut frame);
    assert_eq!(frame.len(), FRAME_HEADER_BYTES + 1, "{frame:?}");
    frame[FRAME_HEADER_BYTES] = 2;
    match raw_frame_call(&mut s, &frame).await {
        (7, Response::Error(e)) => {
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{e}");
            assert!(e.message.contains("invalid"), "{e}");
        }
        other => panic!("a LIST_STREAMS with presence byte 2: {other:?}"),
    }

    // (b) An opcode no request has, with a body the broker must skip.
    let mut frame = BytesMut::new();
    felix_wire::encode_request(8, &Request::Ping, &mut frame);
    frame[5] = 0xee;
    frame.extend_from_slice(&[1, 2, 3, 4, 5]);
    set_len(&mut frame);
    match raw_frame_call(&mut s, &frame).await {
        (8, Response::Error(e)) => {
            assert_eq!(e.code, ErrorCode::Unsupported, "{e}");
            assert!(e.message.contains("0xee"), "names the opcode: {e}");
            assert_eq!(e.core, None);
        }
        other => panic!("an unknown opcode: {other:?}"),
    }

    // (c) The same connection still serves, in sync.
    match raw_call(&mut s, 9, &Request::ListStreams { tenant: None }).await {
        Response::Streams(list) => {
            let names: Vec<_> = list.iter().map(|i| i.stream.stream.as_str()).collect();
            assert_eq!(names, ["listed"]);
        }
        other => panic!("list streams after the bad frames: {other:?}"),
    }
    assert_eq!(
        sample(&broker, "felix_errors_total{code=\"invalid_request\"}"),
        2.0
    );
    assert_eq!(
        sample(&broker, "felix_errors_total{code=\"unsupported\"}"),
        1.0
    );
}

/// A keyed publish goes to `shard_for_key(key, shards)`, whether the client
/// routes it (`publish_keyed`) or the broker does (a raw publish naming only
/// the key): every record of a key is on that one shard, in publish order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_publish_lands_on_the_shard_its_key_hashes_to() {
    use felix_wire::{shard_for_key, AckMode, PublishTarget, Request, Response, StreamRef};
    use std::collections::{BTreeSet, HashMap};
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    let shards = 5u32;
    let info = c
        .create_stream("t", "ns", "keyed", shards, StreamOptions::default())
        .await
        .unwrap();
    let keys: Vec<String> = (0..20).map(|i| format!("user-{i}")).collect();
    let mut want: HashMap<String, Vec<String>> = HashMap::new();
    for round in 0..3 {
        for k in &keys {
            let payload = format!("{k}#{round}");
            let p = c
                .publish_keyed("t", "ns", "keyed", k.clone(), payload.clone())
                .await
                .unwrap();
            assert_eq!(p.shard, shard_for_key(k.as_bytes(), shards), "key {k}");
            want.entry(k.clone()).or_default().push(payload);
        }
    }
    // The broker routes by the key itself: a raw publish that names no
    // shard, sent to the core that owns the key's shard.
    for k in keys.iter().take(6) {
        let expect = shard_for_key(k.as_bytes(), shards);
        let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
        let core = info.placement[expect as usize];
        match raw_call(&mut s, 1, &hello(Some(core), felix_wire::PROTOCOL_VERSION)).await {
            Response::HelloOk { core: got, .. } => assert_eq!(got, core),
            other => panic!("unexpected {other:?}"),
        }
        let payload = format!("{k}#raw");
        let req = Request::Publish {
            stream: StreamRef::new("t", "ns", "keyed"),
            target: PublishTarget::Key(Bytes::from(k.clone())),
            ack: AckMode::Default,
            records: vec![RecordIn {
                key: Some(Bytes::from(k.clone())),
                payload: Bytes::from(payload.clone()),
                ..Default::default()
            }]
            .into(),
        };
        match raw_call(&mut s, 2, &req).await {
            Response::Published { shard, .. } => assert_eq!(shard, expect, "key {k}"),
            other => panic!("keyed publish of {k}: {other:?}"),
        }
        want.get_mut(k).unwrap().push(payload);
    }
    let mut got: HashMap<String, Vec<String>> = HashMap::new();
    let mut used = BTreeSet::new();
    let mut total = 0;
    for shard in 0..shards {
        let b = c
            .read(
                "t",
                "ns",
                "keyed",
                shard,
                StartPosition::Earliest,
                1000,
                None,
            )
            .await
            .unwrap();
        for r in &b.records {
            let key =
                String::from_utf8(r.key.clone().expect("stored with its key").to_vec()).unwrap();
            assert_eq!(
                shard,
                shard_for_key(key.as_bytes(), shards),
                "key {key} found on shard {shard}"
            );
            let payload = String::from_utf8(r.payload.to_vec()).unwrap();
            assert!(
                payload.starts_with(&format!("{key}#")),
                "{payload} under key {key}"
            );
            got.entry(key).or_default().push(payload);
            used.insert(shard);
            total += 1;
        }
    }
    assert_eq!(total, 3 * keys.len() + 6);
    assert_eq!(got, want, "every key's records, in publish order");
    assert!(used.len() > 1, "20 keys all hashed to shards {used:?}");
}

/// SIGTERM with a long-polling read, a waiting group poll and a large
/// publish in flight: the polls are answered (empty, not cut off), the
/// publish is answered and acknowledged, the broker exits 0, and after a
/// restart the published records are all there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests_before_exit() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    let info = c
        .create_stream("t", "ns", "drain", 2, StreamOptions::default())
        .await
        .unwrap();
    assert_ne!(info.placement[0], info.placement[1], "one shard per core");
    // Long polls on shard 1, which nothing publishes to.
    let c1 = c.clone();
    let read_poll = tokio::spawn(async move {
        c1.read(
            "t",
            "ns",
            "drain",
            1,
            StartPosition::Latest,
            10,
            Some(Duration::from_secs(25)),
        )
        .await
    });
    let c2 = c.clone();
    let group_poll = tokio::spawn(async move {
        c2.group_poll_wait("t", "ns", "drain", 1, "g", 10, Duration::from_secs(25))
            .await
    });
    felix_tests::wait_until(Duration::from_secs(20), || {
        sample(&broker, "felix_requests_total{op=\"read\"}") >= 1.0
            && sample(&broker, "felix_requests_total{op=\"group_poll\"}") >= 1.0
    })
    .expect("the broker received both polls");
    // 12 MiB to shard 0, acknowledged once durable.
    let batch: Vec<RecordIn> = (0..3072)
        .map(|i| RecordIn {
            payload: Bytes::from(format!("{i:08}").repeat(512)),
            ..Default::default()
        })
        .collect();
    let c3 = c.clone();
    let publish = tokio::spawn(async move { c3.publish_batch("t", "ns", "drain", 0, batch).await });
    // Signal once the broker has the publish (it may or may not have
    // finished it by the time the signal lands; either way it is answered).
    // Scrape back to back (no pause between checks), so the signal
    // usually lands while the publish is still being written.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while sample(&broker, "felix_requests_total{op=\"publish\"}") < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the broker never received the publish"
        );
    }
    let (mut broker, status) = tokio::task::spawn_blocking(move || {
        let mut broker = broker;
        let status = broker.terminate();
        (broker, status)
    })
    .await
    .unwrap();
    assert!(status.success(), "exit status {status:?}");
    let polled = read_poll
        .await
        .unwrap()
        .expect("the long-polling read was answered");
    assert!(polled.records.is_empty(), "{polled:?}");
    let claimed = group_poll
        .await
        .unwrap()
        .expect("the waiting group poll was answered");
    assert!(claimed.is_empty(), "{claimed:?}");
    let p = publish.await.unwrap().expect("the publish was answered");
    assert_eq!((p.shard, p.base_offset, p.count), (0, 0, 3072));

    broker.restart();
    let c = client(&broker).await;
    let recs = read_shard(&c, "drain", 0).await;
    assert_eq!(recs.len(), 3072);
    for (i, (off, payload)) in recs.iter().enumerate() {
        assert_eq!(*off, i as u64);
        assert_eq!(payload, &Bytes::from(format!("{i:08}").repeat(512)));
    }
}

/// Read answers from `rd` until the broker closes the connection, stopping
/// the broker (SIGTERM) once `stop_after` answers have come; `each` sees
/// every answer as it arrives. The answers, in arrival order, and the
/// stopped broker with its exit status.
async fn answers_through_a_stop(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    broker: Broker,
    stop_after: usize,
    mut each: impl FnMut(&felix_wire::Response),
) -> (
    Vec<(u64, felix_wire::Response)>,
    Broker,
    std::process::ExitStatus,
) {
    use tokio::io::AsyncReadExt;
    let mut broker = Some(broker);
    let mut stopped = None;
    let mut buf = bytes::BytesMut::new();
    let mut got = Vec::new();
    loop {
        while let Some((id, r)) = felix_wire::decode_response(&mut buf, 64 << 20).unwrap() {
            each(&r);
            got.push((id, r));
        }
        if got.len() >= stop_after && stopped.is_none() {
            let mut b = broker.take().unwrap();
            stopped = Some(tokio::task::spawn_blocking(move || {
                let status = b.terminate();
                (b, status)
            }));
        }
        let mut chunk = [0u8; 65536];
        match tokio::time::timeout(Duration::from_secs(20), rd.read(&mut chunk))
            .await
            .expect("the broker kept the connection open")
        {
            Ok(0) => break,
            Err(e) => panic!("the connection was reset, answers lost with it: {e}"),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let (broker, status) = stopped
        .expect("the broker closed the connection before it was stopped")
        .await
        .unwrap();
    (got, broker, status)
}

/// Stream `t/ns/<name>` (one shard) on `broker`, and a raw connection to it
/// that has said HELLO.
async fn stream_and_raw_connection(broker: &Broker, name: &str) -> tokio::net::TcpStream {
    let c = client(broker).await;
    c.create_stream("t", "ns", name, 1, StreamOptions::default())
        .await
        .unwrap();
    let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    assert!(matches!(
        raw_call(&mut s, 1, &hello(None, felix_wire::PROTOCOL_VERSION)).await,
        felix_wire::Response::HelloOk { .. }
    ));
    s
}

/// Requests that reach the broker while it stops are answered, not dropped
/// with the connection: those it had taken finish (and are stored), those
/// it reads after the signal are refused with `unavailable` "shutting down"
/// (and are not stored), so the client knows the fate of each. A client
/// that goes on writing after the broker stops reading (half a second)
/// still loses those (the connection closes under it), and none of them is
/// stored either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_read_while_the_broker_stops_are_refused_not_dropped() {
    use felix_wire::{AckMode, PublishTarget, Request, Response, StreamRef};
    use tokio::io::AsyncWriteExt;
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let s = stream_and_raw_connection(&broker, "stop").await;
    let (rd, mut wr) = s.into_split();
    // Publishes of 10 records, written 50 at a time until the connection
    // closes.
    let writer = tokio::spawn(async move {
        let mut id = 2u64;
        loop {
            let mut frames = bytes::BytesMut::new();
            for _ in 0..50 {
                let req = Request::Publish {
                    stream: StreamRef::new("t", "ns", "stop"),
                    target: PublishTarget::Shard(0),
                    ack: AckMode::Default,
                    records: (0..10)
                        .map(|i| RecordIn {
                            payload: Bytes::from(format!("{id}-{i}")),
                            ..Default::default()
                        })
                        .collect(),
                };
                felix_wire::encode_request(id, &req, &mut frames);
                id += 1;
            }
            if wr.write_all(&frames).await.is_err() || id > 1_000_000 {
                return id;
            }
        }
    });
    // Stop the broker once 500 answers came; read until it closes.
    let (got, mut broker, status) = answers_through_a_stop(rd, broker, 500, |_| {}).await;
    let sent = writer.await.unwrap() - 2;
    let mut stored = Vec::new();
    let mut refused = 0;
    for (id, r) in &got {
        match r {
            Response::Published {
                base_offset, count, ..
            } => {
                assert_eq!(*count, 10);
                stored.push((*base_offset, *id));
            }
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
                assert!(e.message.contains("shutting down"), "{e:?}");
                // Said to be not stored (checked below after the restart).
                assert!(e.not_applied, "{e:?}");
                refused += 1;
            }
            other => panic!("request {id}: {other:?}"),
        }
    }
    assert!(
        refused > 0,
        "none of {sent} requests sent was refused ({} acknowledged)",
        stored.len()
    );
    assert!(status.success(), "exit status {status:?}");
    broker.restart();
    let c = client(&broker).await;
    let recs = read_shard(&c, "stop", 0).await;
    assert_eq!(
        recs.len(),
        stored.len() * 10,
        "stored: exactly the acknowledged"
    );
    for (base, id) in &stored {
        for i in 0..10u64 {
            let (off, payload) = &recs[(base + i) as usize];
            assert_eq!(*off, base + i);
            assert_eq!(payload, &Bytes::from(format!("{id}-{i}")));
        }
    }
}

/// A client that stops sending once it hears the broker is stopping hears
/// about every request it sent: the stopping broker goes on reading and
/// refusing until the client goes quiet, so none is lost with the
/// connection (and each refused one can be sent elsewhere, not stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_sending_when_refused_hears_about_every_request() {
    use felix_wire::{AckMode, PublishTarget, Request, Response, StreamRef};
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::AsyncWriteExt;
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let s = stream_and_raw_connection(&broker, "heard").await;
    let (rd, mut wr) = s.into_split();
    let refused_seen = std::sync::Arc::new(AtomicBool::new(false));
    // Publishes written 20 at a time every 20 ms (a client that takes a
    // while over its answers) until the first refusal is heard; the write
    // side then stays open (the client is still there, quiet).
    let heard = refused_seen.clone();
    let writer = tokio::spawn(async move {
        let mut id = 2u64;
        while !heard.load(Ordering::Acquire) {
            let mut frames = bytes::BytesMut::new();
            for _ in 0..20 {
                let req = Request::Publish {
                    stream: StreamRef::new("t", "ns", "heard"),
                    target: PublishTarget::Shard(0),
                    ack: AckMode::Default,
                    records: vec![RecordIn {
                        payload: Bytes::from(format!("{id}")),
                        ..Default::default()
                    }]
                    .into(),
                };
                felix_wire::encode_request(id, &req, &mut frames);
                id += 1;
            }
            if wr.write_all(&frames).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (id - 2, wr)
    });
    let (got, mut broker, status) = answers_through_a_stop(rd, broker, 100, |r| {
        if matches!(r, Response::Error(_)) {
            refused_seen.store(true, Ordering::Release);
        }
    })
    .await;
    let mut answered = std::collections::BTreeMap::new();
    for (id, r) in got {
        assert!(
            answered.insert(id, r).is_none(),
            "request {id} answered twice"
        );
    }
    let (sent, _wr) = writer.await.unwrap();
    assert_eq!(
        answered.len() as u64,
        sent,
        "every request sent was answered"
    );
    let mut stored = 0;
    for (id, r) in &answered {
        match r {
            Response::Published { .. } => stored += 1,
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
                assert!(e.not_applied, "{e:?}");
            }
            other => panic!("request {id}: {other:?}"),
        }
    }
    assert!(stored < sent, "none refused: the stop came too late");
    assert!(status.success(), "exit status {status:?}");
    broker.restart();
    let c = client(&broker).await;
    assert_eq!(read_shard(&c, "heard", 0).await.len(), stored as usize);
}

/// SIGINT (Ctrl-C) shuts down like SIGTERM: a long-polling read in flight
/// is answered (empty, not cut off), the broker exits 0, and after a
/// restart every acknowledged record is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_shuts_down_gracefully_like_sigterm() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(2));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "ctrl_c", 3, StreamOptions::default())
        .await
        .unwrap();
    let acked = publish_in_turn(&c, "ctrl_c", 3, 30).await;
    // A long poll at the tail of shard 0, which nothing publishes to now.
    let c1 = c.clone();
    let read_poll = tokio::spawn(async move {
        c1.read(
            "t",
            "ns",
            "ctrl_c",
            0,
            StartPosition::Latest,
            10,
            Some(Duration::from_secs(25)),
        )
        .await
    });
    felix_tests::wait_until(Duration::from_secs(20), || {
        sample(&broker, "felix_requests_total{op=\"read\"}") >= 1.0
    })
    .expect("the broker received the poll");
    let (mut broker, status) = tokio::task::spawn_blocking(move || {
        let mut broker = broker;
        let status = broker.interrupt();
        (broker, status)
    })
    .await
    .unwrap();
    assert!(status.success(), "exit status {status:?}");
    let polled = read_poll
        .await
        .unwrap()
        .expect("the long-polling read was answered");
    assert!(polled.records.is_empty(), "{polled:?}");
    drop(c);

    broker.restart();
    let c = client(&broker).await;
    assert_eq!(read_shards(&c, "ctrl_c", 3).await, acked);
}

/// `timeout` and process supervisors signal the broker and then its whole
/// process group: a second SIGTERM that lands while the broker is already
/// shutting down, a moment after the first, is the same request to stop.
/// The broker still drains and exits 0 with nothing lost, rather than taking
/// it as "exit now" (130).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_signal_repeated_at_once_still_shuts_down_gracefully() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = felix_tests::broker_command!(Some(dir.path()), "127.0.0.1:0");
    cmd.env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped());
    let (mut child, addr) = felix_tests::spawn_announcing(cmd);
    // Told when the broker has taken the first signal.
    let stderr = child.stderr.take().unwrap();
    let (stopping, stopping_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("shutting down") {
                let _ = stopping.send(());
            }
        }
    });
    let c = Client::connect(addr.as_str(), ClientConfig::default())
        .await
        .unwrap();
    c.create_stream("t", "ns", "twice", 2, StreamOptions::default())
        .await
        .unwrap();
    let acked = publish_in_turn(&c, "twice", 2, 20).await;
    drop(c);
    let pid = child.id() as libc::pid_t;
    let status = tokio::task::spawn_blocking(move || {
        // SAFETY: signalling our own child process (not yet waited for).
        unsafe { libc::kill(pid, libc::SIGTERM) };
        stopping_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the broker took the first signal");
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        child.wait().unwrap()
    })
    .await
    .unwrap();
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    let (mut child, addr) = felix_tests::spawn_announcing(felix_tests::broker_command!(
        Some(dir.path()),
        "127.0.0.1:0"
    ));
    let c = Client::connect(addr.as_str(), ClientConfig::default())
        .await
        .unwrap();
    let got = read_shards(&c, "twice", 2).await;
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(got, acked);
}

/// Start felix-test-broker with stderr captured; returns the process and the
/// address it announced on stdout.
fn spawn_capturing_stderr(data_dir: Option<&std::path::Path>) -> (felix_tests::Spawned, String) {
    let mut cmd = felix_tests::broker_command!(data_dir, "127.0.0.1:0");
    cmd.stderr(std::process::Stdio::piped());
    felix_tests::spawn_announcing(cmd)
}

/// Kill a broker and return everything it wrote to stderr.
fn stderr_of(mut child: felix_tests::Spawned) -> String {
    use std::io::Read;
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}

/// A broker without a data directory warns on stderr, before it announces
/// its address, that it runs in memory; a durable broker does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_memory_broker_says_so_at_start() {
    const WARNING: &str = "felix: WARNING: RUNNING IN MEMORY: storage.data_dir is empty, \
        so nothing survives a restart and consumer groups are disabled.";
    let (child, addr) = spawn_capturing_stderr(None);
    // It serves (the warning is not a refusal to start).
    let c = Client::connect(addr.as_str(), ClientConfig::default())
        .await
        .expect("connect");
    assert_eq!(c.features() & felix_wire::FEATURE_GROUPS, 0);
    drop(c);
    // The warning is written before the address is announced, so it is in
    // the pipe by now.
    let err = stderr_of(child);
    assert!(
        err.lines().any(|l| l.starts_with(WARNING)),
        "no in-memory warning on stderr:\n{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let (child, _addr) = spawn_capturing_stderr(Some(dir.path()));
    let err = stderr_of(child);
    assert!(
        !err.contains("RUNNING IN MEMORY"),
        "a durable broker warned:\n{err}"
    );
}

/// A deletion writes the stream's metadata as `deleted` before it removes
/// the files: cut short there (a crash), the stream does not come back, and
/// a stream created again under its name starts empty rather than with the
/// old records. Records whose metadata is simply missing are different:
/// they may be all that is left of a live stream, so a create under that
/// name is refused (naming the directory) and they are kept, and putting
/// the metadata back brings the stream back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_stream_never_shows_a_deleted_streams_records() {
    let mut broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    for name in ["again", "lost"] {
        c.create_stream("t", "ns", name, 1, StreamOptions::default())
            .await
            .unwrap();
        for i in 0..5 {
            c.publish("t", "ns", name, 0, format!("old-{i}"))
                .await
                .unwrap();
        }
    }
    drop(c);
    broker.kill9();
    let data = broker.data_dir().unwrap().to_path_buf();
    // The crash of a deletion: metadata marked deleted, files still there.
    let again = data.join("t/ns/again/stream.meta");
    let mut text = std::fs::read_to_string(&again).unwrap();
    text.push_str("deleted = true\n");
    std::fs::write(&again, text).unwrap();
    // Lost metadata: files without it.
    let lost = data.join("t/ns/lost/stream.meta");
    let saved = std::fs::read(&lost).unwrap();
    std::fs::remove_file(&lost).unwrap();
    broker.restart();
    let c = client(&broker).await;
    for name in ["again", "lost"] {
        let err = c.describe_stream("t", "ns", name).await.unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::NotFound), "{name}: {err}");
    }
    c.create_stream("t", "ns", "again", 1, StreamOptions::default())
        .await
        .unwrap();
    let r = c
        .read("t", "ns", "again", 0, StartPosition::Earliest, 100, None)
        .await
        .unwrap();
    assert!(
        r.records.is_empty(),
        "old records came back: {}",
        r.records.len()
    );
    assert_eq!(c.publish("t", "ns", "again", 0, "new").await.unwrap(), 0);

    let err = c
        .create_stream("t", "ns", "lost", 1, StreamOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Unavailable), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("t/ns/lost") && msg.contains("not cleared"),
        "{msg}"
    );
    drop(c);
    broker.kill9();
    std::fs::write(&lost, saved).unwrap();
    broker.restart();
    let c = client(&broker).await;
    let recs = read_shard(&c, "lost", 0).await;
    assert_eq!(recs.len(), 5);
    assert_eq!(recs[4], (4, Bytes::from_static(b"old-4")));
}

/// A second broker pointed at a data directory a running broker uses is
/// refused at start with a message naming the holder, and the first broker
/// keeps serving what it wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_broker_on_the_same_data_directory_is_refused() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "held", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "held", 0, "mine").await.unwrap();
    let out = felix_tests::broker_command!(broker.data_dir(), "127.0.0.1:0")
        .output()
        .expect("run a second broker");
    assert!(!out.status.success(), "the second broker started");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is in use by another process")
            && err.contains(&format!("pid {}", broker.pid())),
        "{err}"
    );
    let recs = read_shard(&c, "held", 0).await;
    assert_eq!(recs, vec![(0, Bytes::from_static(b"mine"))]);
}

/// A broker whose listen port is taken by a live listener refuses to start
/// (SO_REUSEPORT would otherwise let it share the port and split clients
/// between two brokers) after waiting briefly for the port to free.
#[test]
fn a_broker_refuses_a_listen_port_another_process_accepts_on() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = felix_tests::broker_command!(None, &addr)
        .output()
        .expect("run a broker");
    assert!(!out.status.success(), "the broker started on a taken port");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "cannot listen on {addr}: another process is accepting"
        )),
        "{err}"
    );
    drop(taken);
}

/// Retention by age goes by record timestamps, so a producer clock far in
/// the future could keep a segment forever: a record stamped more than
/// `limits.max_timestamp_ahead_ms` (1 h) ahead of the broker's clock is
/// refused with `invalid_request`, the whole publish with it, and nothing
/// is written. Timestamps in the past, or a little ahead, are kept as given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stamped_far_in_the_future_is_refused() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "clock", 1, StreamOptions::default())
        .await
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let at = |ts: Option<u64>| RecordIn {
        timestamp_ms: ts,
        payload: Bytes::from_static(b"x"),
        ..Default::default()
    };
    let far = now + 2 * 3_600_000;
    let err = c
        .publish_batch("t", "ns", "clock", 0, vec![at(None), at(Some(far))])
        .await
        .expect_err("a timestamp two hours ahead");
    match err {
        ClientError::Server { code, message, .. } => {
            assert_eq!(code, ErrorCode::InvalidRequest, "{message}");
            assert!(
                message.contains("record 1 has timestamp")
                    && message.contains("limits.max_timestamp_ahead_ms"),
                "{message}"
            );
        }
        other => panic!("unexpected error: {other}"),
    }
    let p = c
        .publish_batch(
            "t",
            "ns",
            "clock",
            0,
            vec![at(Some(1)), at(Some(now + 60_000)), at(None)],
        )
        .await
        .expect("past, slightly ahead and unstamped records are taken");
    assert_eq!(
        (p.base_offset, p.count),
        (0, 3),
        "the refused publish wrote nothing"
    );
    let b = c
        .read("t", "ns", "clock", 0, StartPosition::Earliest, 10, None)
        .await
        .unwrap();
    let ts: Vec<u64> = b.records.iter().map(|r| r.timestamp_ms).collect();
    assert_eq!(ts[..2], [1, now + 60_000]);
    assert!(ts[2] >= now, "an unstamped record gets the broker's clock");
}

/// A shard whose directory vanished while the broker was down has lost its
/// records: the broker says so and refuses that shard, rather than start it
/// again at offset 0 and hand out offsets a second time; the other shards
/// serve as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_shard_directory_is_refused_not_started_again_at_zero() {
    let mut broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "lost", 2, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "lost", 0, "kept").await.unwrap();
    c.publish("t", "ns", "lost", 1, "gone").await.unwrap();
    drop(c);
    let shard1 = broker.data_dir().unwrap().join("t/ns/lost/1");
    assert!(shard1.is_dir(), "{}", shard1.display());
    std::fs::remove_dir_all(&shard1).unwrap();
    broker.restart();
    let c = client(&broker).await;
    assert_eq!(
        read_shard(&c, "lost", 0).await,
        vec![(0, Bytes::from_static(b"kept"))]
    );
    for r in [
        c.publish("t", "ns", "lost", 1, "again").await.map(|_| ()),
        c.read("t", "ns", "lost", 1, StartPosition::Earliest, 10, None)
            .await
            .map(|_| ()),
    ] {
        match r {
            Err(ClientError::Server { code, message, .. }) => {
                assert_eq!(code, ErrorCode::Unavailable, "{message}");
                assert!(message.contains("is missing"), "{message}");
            }
            other => panic!("shard 1 served: {other:?}"),
        }
    }
    assert!(
        !shard1.exists(),
        "the broker did not make a new, empty shard"
    );
}

/// A core opens its shards side by side (at start-up, across streams, and
/// when a stream is created), yet each comes back in its own place: after
/// a `kill -9` and after a clean stop, every shard of three streams (52
/// shards on one core) holds exactly its own records and its own group's
/// position, a shard whose directory went missing in the middle of them is
/// refused alone, and publishing goes on where each shard left off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_opened_side_by_side_each_come_back_in_their_place() {
    const STREAMS: [(&str, u32); 3] = [("wide", 40), ("left", 5), ("right", 7)];
    let mut broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    let mut expected = Vec::new();
    for (stream, shards) in STREAMS {
        c.create_stream("t", "ns", stream, shards, StreamOptions::default())
            .await
            .unwrap();
        for shard in 0..shards {
            let records: Vec<RecordIn> = (0..shard % 4 + 1)
                .map(|k| RecordIn {
                    payload: Bytes::from(format!("{stream}/{shard}/{k}")),
                    ..Default::default()
                })
                .collect();
            c.publish_batch("t", "ns", stream, shard, records)
                .await
                .unwrap();
            expected.push((stream, shard, shard % 4 + 1));
            // A group on each shard claims and finishes its first record.
            let first = c
                .group_poll("t", "ns", stream, shard, "g", 1)
                .await
                .unwrap();
            assert_eq!(first[0].offset, 0);
            c.group_ack("t", "ns", stream, shard, "g", 0).await.unwrap();
        }
    }
    drop(c);
    let missing = broker.data_dir().unwrap().join("t/ns/wide/17");
    std::fs::remove_dir_all(&missing).unwrap();
    let check = |c: Client| {
        let expected = expected.clone();
        async move { check_places(&c, &expected).await }
    };
    broker.restart();
    check(client(&broker).await).await;
    assert!(broker.terminate().success());
    broker.restart();
    let c = client(&broker).await;
    check(c.clone()).await;
    let next = c.publish("t", "ns", "right", 6, "after").await.unwrap();
    assert_eq!(next, 6 % 4 + 1);
}

/// Each shard of `expected` (stream, shard, records) holds exactly the
/// records `stream/shard/k` for k in 0..records, and its group `g` stands
/// past the first of them; but `wide/17`, refused.
async fn check_places(c: &Client, expected: &[(&str, u32, u32)]) {
    for &(stream, shard, count) in expected {
        if (stream, shard) == ("wide", 17) {
            let refused = c
                .read("t", "ns", stream, shard, StartPosition::Earliest, 10, None)
                .await;
            assert!(
                matches!(&refused, Err(ClientError::Server { code: ErrorCode::Unavailable, message, .. }) if message.contains("is missing")),
                "{refused:?}"
            );
            continue;
        }
        let want: Vec<(u64, Bytes)> = (0..count)
            .map(|k| (k as u64, Bytes::from(format!("{stream}/{shard}/{k}"))))
            .collect();
        assert_eq!(read_shard(c, stream, shard).await, want, "{stream}/{shard}");
        let g = c
            .group_describe("t", "ns", stream, shard, "g")
            .await
            .unwrap();
        assert_eq!(
            (g.position, g.end_offset),
            (1, count as u64),
            "{stream}/{shard}"
        );
    }
}

/// Stream metadata is validated on start: a stream whose `stream.meta` does
/// not read is not served (each request for it, a create of its name
/// included, is refused with `unavailable` naming the file), its files are
/// kept, and every other stream is served. Repairing the file and
/// restarting brings it back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbled_stream_meta_refuses_that_stream_only_and_keeps_its_files() {
    let mut broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    for name in ["garbled", "fine"] {
        c.create_stream("t", "ns", name, 2, StreamOptions::default())
            .await
            .unwrap();
        c.publish("t", "ns", name, 0, "kept").await.unwrap();
    }
    drop(c);
    assert!(broker.terminate().success());
    let data_dir = broker.data_dir().unwrap().to_path_buf();
    let meta = data_dir.join("t/ns/garbled/stream.meta");
    let saved = std::fs::read(&meta).unwrap();
    std::fs::write(&meta, b"shards = many\n\x7f garbage {{{\n").unwrap();
    broker.restart();
    let c = client(&broker).await;
    let refusals = [
        c.describe_stream("t", "ns", "garbled").await.map(|_| ()),
        c.read("t", "ns", "garbled", 0, StartPosition::Earliest, 10, None)
            .await
            .map(|_| ()),
        c.publish("t", "ns", "garbled", 0, "x").await.map(|_| ()),
        c.create_stream("t", "ns", "garbled", 2, StreamOptions::default())
            .await
            .map(|_| ()),
        c.delete_stream("t", "ns", "garbled").await,
    ];
    for r in refusals {
        let err = r.expect_err("a request for the garbled stream");
        assert_eq!(err.code(), Some(ErrorCode::Unavailable), "{err}");
        assert!(
            err.to_string().contains(&meta.display().to_string()),
            "{err}"
        );
    }
    assert_eq!(read_shard(&c, "fine", 0).await.len(), 1);
    drop(c);
    assert!(broker.terminate().success());
    std::fs::write(&meta, saved).unwrap();
    broker.restart();
    let c = client(&broker).await;
    assert_eq!(
        read_shard(&c, "garbled", 0).await,
        vec![(0, Bytes::from_static(b"kept"))]
    );
}

/// The largest values every numeric field can carry, sent raw: each gets a
/// typed error or is clamped as the protocol says (a wait to the broker's
/// cap, a visibility, extension or delay to `max_visibility_ms`), the broker
/// keeps serving, and it still restarts on what those requests left on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_numbers_get_typed_errors_or_clamps_and_the_broker_still_restarts() {
    use felix_wire::{
        AckMode, GroupKey, PublishTarget, Request, Response, StreamRef, FEATURES_ALL,
    };
    let mut broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(1)
        .env("FELIX_GROUP_MAX_WAIT_MS", 200));
    let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    match raw_call(&mut s, 1, &hello(None, felix_wire::PROTOCOL_VERSION)).await {
        // Everything but what only a broker in a cluster offers.
        Response::HelloOk { features, .. } => {
            let cluster_only = felix_wire::FEATURE_REPLICA_INFO
                | felix_wire::FEATURE_STREAM_INCARNATION
                | felix_wire::FEATURE_CLUSTER_INFO;
            assert_eq!(features, FEATURES_ALL & !cluster_only)
        }
        other => panic!("unexpected {other:?}"),
    }
    let stream = StreamRef::new("t", "ns", "max");
    let code = |r: Response| match r {
        Response::Error(e) => e.code,
        other => panic!("expected an error, got {other:?}"),
    };

    // Retention of u64::MAX bytes and ms: refused with invalid_request (the
    // stream metadata could not be read back at the next start).
    for (bytes, ms) in [(Some(u64::MAX), None), (None, Some(u64::MAX))] {
        let create = Request::CreateStream {
            stream: StreamRef::new("t", "ns", "forever"),
            shards: 1,
            retention_bytes: bytes,
            retention_ms: ms,
            incarnation: None,
        };
        match raw_call(&mut s, 2, &create).await {
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::InvalidRequest, "{e}");
                assert!(e.message.contains("retention"), "{e}");
            }
            other => panic!("retention {bytes:?} / {ms:?} accepted: {other:?}"),
        }
    }
    // The largest retention that is stored is taken, and survives restarts.
    let create = Request::CreateStream {
        stream: stream.clone(),
        shards: 1,
        retention_bytes: Some(i64::MAX as u64),
        retention_ms: Some(i64::MAX as u64),
        incarnation: None,
    };
    match raw_call(&mut s, 3, &create).await {
        Response::Stream(info) => {
            assert_eq!(info.retention_bytes, Some(i64::MAX as u64));
            assert_eq!(info.retention_ms, Some(i64::MAX as u64));
        }
        other => panic!("create: {other:?}"),
    }
    let shard = Request::DescribeShard {
        stream: stream.clone(),
        shard: u32::MAX,
    };
    assert_eq!(code(raw_call(&mut s, 4, &shard).await), ErrorCode::NotFound);
    let publish = Request::Publish {
        stream: stream.clone(),
        target: PublishTarget::Shard(0),
        ack: AckMode::Durable,
        records: (0..3)
            .map(|i| RecordIn {
                payload: Bytes::from(format!("r{i}")),
                ..Default::default()
            })
            .collect(),
    };
    match raw_call(&mut s, 5, &publish).await {
        Response::Published { count: 3, .. } => {}
        other => panic!("publish: {other:?}"),
    }

    // Reads: an offset past the tail is refused; the widest limits are
    // clamped, and a wait of u32::MAX ms at the tail ends at the cap.
    let read = |from, wait_ms| Request::Read {
        stream: stream.clone(),
        shard: 0,
        from,
        max_records: u32::MAX,
        max_bytes: u32::MAX,
        wait_ms,
    };
    assert_eq!(
        code(raw_call(&mut s, 6, &read(StartPosition::Offset(u64::MAX), 0)).await),
        ErrorCode::InvalidRequest
    );
    match raw_call(&mut s, 7, &read(StartPosition::Earliest, u32::MAX)).await {
        Response::Records { records, .. } => assert_eq!(records.len(), 3),
        other => panic!("read: {other:?}"),
    }
    let began = std::time::Instant::now();
    match raw_call(&mut s, 8, &read(StartPosition::Latest, u32::MAX)).await {
        Response::Records { records, .. } => assert!(records.is_empty()),
        other => panic!("read at the tail: {other:?}"),
    }
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "the wait was not capped"
    );

    // Groups.
    let key = GroupKey {
        stream: stream.clone(),
        shard: 0,
        group: "g".into(),
    };
    for (id, start) in [(9, StartPosition::Offset(u64::MAX))] {
        let create = Request::GroupCreate {
            key: key.clone(),
            start,
        };
        assert_eq!(
            code(raw_call(&mut s, id, &create).await),
            ErrorCode::InvalidRequest
        );
    }
    let poll = Request::GroupPoll {
        key: key.clone(),
        max_records: u32::MAX,
        wait_ms: u32::MAX,
        member: None,
        visibility_ms: Some(u64::MAX),
    };
    let got = match raw_call(&mut s, 10, &poll).await {
        Response::GroupRecords { records } => records,
        other => panic!("poll: {other:?}"),
    };
    assert_eq!(got.len(), 3);
    let nack = |offset, attempts, delay_ms| Request::GroupNack {
        key: key.clone(),
        offset,
        attempts,
        delay_ms,
        reason: Some("r".repeat(u16::MAX as usize)),
    };
    let extend = |offset, attempts| Request::GroupExtend {
        key: key.clone(),
        offset,
        attempts,
        extend_ms: u64::MAX,
    };
    let dead = |offset, attempts| Request::GroupDeadLetter {
        key: key.clone(),
        offset,
        attempts,
        reason: Some("x".repeat(u16::MAX as usize)),
    };
    for (id, req, want) in [
        (11, nack(u64::MAX, 1, None), ErrorCode::InvalidRequest),
        (12, nack(0, u32::MAX, Some(u64::MAX)), ErrorCode::StaleClaim),
        (13, extend(u64::MAX, 1), ErrorCode::InvalidRequest),
        (14, extend(0, u32::MAX), ErrorCode::StaleClaim),
        (15, dead(u64::MAX, u32::MAX), ErrorCode::InvalidRequest),
        (16, dead(0, u32::MAX), ErrorCode::StaleClaim),
    ] {
        assert_eq!(code(raw_call(&mut s, id, &req).await), want, "request {id}");
    }
    // Clamped to max_visibility_ms (12 h by default).
    match raw_call(&mut s, 17, &extend(0, 1)).await {
        Response::Extended { stands_ms } => assert_eq!(stands_ms, 43_200_000),
        other => panic!("extend: {other:?}"),
    }
    match raw_call(&mut s, 18, &nack(1, 1, Some(u64::MAX))).await {
        Response::Ok => {}
        other => panic!("nack with the longest delay: {other:?}"),
    }
    match raw_call(&mut s, 19, &dead(2, 1)).await {
        Response::Ok => {}
        other => panic!("dead letter with the longest reason: {other:?}"),
    }
    let ack = Request::GroupAck {
        key: key.clone(),
        offsets: vec![0, u64::MAX],
    };
    assert_eq!(
        code(raw_call(&mut s, 20, &ack).await),
        ErrorCode::InvalidRequest
    );
    for (id, req, want) in [
        (
            21,
            Request::GroupRedrive {
                key: key.clone(),
                offset: u64::MAX,
            },
            ErrorCode::NotFound,
        ),
        (
            22,
            Request::GroupDiscard {
                key: key.clone(),
                offset: u64::MAX,
            },
            ErrorCode::NotFound,
        ),
        (
            23,
            Request::GroupSeek {
                key: key.clone(),
                start: StartPosition::Offset(u64::MAX),
            },
            ErrorCode::InvalidRequest,
        ),
    ] {
        assert_eq!(code(raw_call(&mut s, id, &req).await), want, "request {id}");
    }
    match raw_call(&mut s, 24, &Request::GroupDescribe { key: key.clone() }).await {
        Response::Group(g) => {
            assert_eq!((g.in_flight, g.delayed, g.dead_letters), (2, 1, 1), "{g:?}");
        }
        other => panic!("describe: {other:?}"),
    }
    match raw_call(&mut s, 25, &Request::GroupDeadLetters { key: key.clone() }).await {
        Response::DeadLetters(list) => {
            assert_eq!(list.len(), 1);
            // Cut to the 1 KiB a dead letter keeps.
            assert_eq!(list[0].reason.as_ref().map(|r| r.len()), Some(1024));
        }
        other => panic!("dead letters: {other:?}"),
    }
    drop(s);

    // Everything those requests wrote reads back after a restart.
    broker.restart();
    let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    match raw_call(&mut s, 1, &hello(None, felix_wire::PROTOCOL_VERSION)).await {
        Response::HelloOk { .. } => {}
        other => panic!("unexpected {other:?}"),
    }
    match raw_call(&mut s, 2, &read(StartPosition::Earliest, 0)).await {
        Response::Records { records, .. } => assert_eq!(records.len(), 3),
        other => panic!("read after the restart: {other:?}"),
    }
    match raw_call(&mut s, 3, &Request::DescribeStream { stream }).await {
        Response::Stream(info) => assert_eq!(info.retention_ms, Some(i64::MAX as u64)),
        other => panic!("describe after the restart: {other:?}"),
    }
    match raw_call(&mut s, 4, &Request::GroupDeadLetters { key }).await {
        Response::DeadLetters(list) => assert_eq!(list.len(), 1),
        other => panic!("dead letters after the restart: {other:?}"),
    }
}

/// Connections to the metrics endpoint that send nothing (or never read
/// the answer) cannot take the broker's file descriptors: past a few at
/// once the endpoint closes new ones straight away, so with the descriptor
/// limit close to what the broker uses, a flood of idle scrapers leaves
/// clients served, and the endpoint answers again once the flood stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_metrics_connections_cannot_starve_the_broker_of_descriptors() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "fds", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "fds", 0, "before").await.unwrap();
    drop(c);
    // Room for 64 more descriptors than the broker holds now.
    let pid = broker.pid() as libc::pid_t;
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64;
    let limit = libc::rlimit {
        rlim_cur: open + 64,
        rlim_max: open + 64,
    };
    // SAFETY: sets a resource limit of our own child process.
    let r = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &limit, std::ptr::null_mut()) };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());

    // 200 scrapers that connect and say nothing (the endpoint's read
    // timeout is 10 s; this test is done with them well before).
    let idle: Vec<std::net::TcpStream> = (0..200)
        .map(|_| std::net::TcpStream::connect(&broker.metrics_addr).unwrap())
        .collect();
    // Time for the broker to take them in (before the fix, to run out).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let served = tokio::time::timeout(Duration::from_secs(5), async {
        let mut conns = Vec::new();
        for id in 0..4 {
            let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
            match raw_call(&mut s, id, &hello(None, felix_wire::PROTOCOL_VERSION)).await {
                felix_wire::Response::HelloOk { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
            conns.push(s);
        }
        let c = client(&broker).await;
        c.publish("t", "ns", "fds", 0, "during").await.unwrap();
        read_shard(&c, "fds", 0).await.len()
    })
    .await
    .expect("clients are served while idle scrapers are connected");
    assert_eq!(served, 2);
    drop(idle);
    felix_tests::wait_until(Duration::from_secs(20), || {
        std::panic::catch_unwind(|| broker.metrics())
            .is_ok_and(|m| m.contains("felix_requests_total"))
    })
    .expect("the metrics endpoint answers again");
}

/// The broker takes a record only if an answer can carry it back within the
/// frame cap: the largest it takes is readable by a read and a group poll,
/// one byte more is `too_large` (with nothing stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_record_the_broker_takes_can_be_read_back() {
    const FRAME: usize = 65_536;
    let biggest = FRAME - 1024;
    let broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(1)
        .env("FELIX_MAX_FRAME_BYTES", FRAME));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "big", 1, StreamOptions::default())
        .await
        .unwrap();
    let err = c
        .publish("t", "ns", "big", 0, vec![9u8; biggest + 1])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TooLarge), "{err}");
    assert!(err.to_string().contains("read back"), "{err}");
    c.publish("t", "ns", "big", 0, vec![7u8; biggest])
        .await
        .unwrap();
    let recs = read_shard(&c, "big", 0).await;
    assert_eq!(recs.len(), 1, "only the record that fits was stored");
    assert_eq!(recs[0].1.len(), biggest);
    let polled = c.group_poll("t", "ns", "big", 0, "g", 10).await.unwrap();
    assert_eq!(polled.len(), 1);
    assert_eq!(polled[0].payload.len(), biggest);
}

/// A read or a group poll that would pass the frame cap stops at the last
/// record that fits, counting each record's fields (offset, lengths, one
/// per header) as well as what it carries: with a 64 KiB cap and records
/// of 100 empty-ish headers, a read asking for everything gets pages of
/// about fifty and reads the shard through, and a poll claims only what
/// its answer carries, so no claim lapses unseen into a dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_polls_stop_at_the_frame_cap_and_lose_nothing() {
    const FRAME: usize = 65_536;
    let broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(1)
        .env("FELIX_MAX_FRAME_BYTES", FRAME)
        .env("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", 200)
        .env("FELIX_GROUP_MAX_ATTEMPTS", 2));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "framed", 1, StreamOptions::default())
        .await
        .unwrap();
    // 604 bytes carried, 1,233 on the wire in a read's answer.
    let record = |i: u64| RecordIn {
        key: Some(Bytes::from(format!("{i:04}"))),
        headers: (0..100)
            .map(|_| ("h".to_string(), Bytes::from_static(b"v")))
            .collect(),
        payload: Bytes::from(vec![b'a' + (i % 26) as u8; 400]),
        ..RecordIn::default()
    };
    const N: u64 = 200;
    for batch in 0..N / 40 {
        c.publish_batch(
            "t",
            "ns",
            "framed",
            0,
            (batch * 40..(batch + 1) * 40).map(record).collect(),
        )
        .await
        .unwrap();
    }
    let mut from = StartPosition::Earliest;
    let mut seen = Vec::new();
    let mut reads = 0;
    loop {
        let b = c
            .read("t", "ns", "framed", 0, from, 10_000, None)
            .await
            .expect("a read within the frame cap");
        if b.records.is_empty() {
            break;
        }
        reads += 1;
        assert!(
            b.records.len() > 1 && b.records.len() < 60,
            "{} a read",
            b.records.len()
        );
        for r in &b.records {
            assert_eq!(r.payload, record(r.offset).payload);
            assert_eq!(r.headers.len(), 100);
            seen.push(r.offset);
        }
        from = StartPosition::Offset(b.next_offset);
    }
    assert_eq!(seen, (0..N).collect::<Vec<_>>());
    assert!(reads >= 4, "{reads} reads");

    // Polls asking for everything, each answered and acked before the
    // claims could lapse: every record once, none dead-lettered.
    let mut claimed = Vec::new();
    while (claimed.len() as u64) < N {
        let got = c
            .group_poll("t", "ns", "framed", 0, "workers", 10_000)
            .await
            .expect("a poll within the frame cap");
        assert!(!got.is_empty() && got.len() < 60, "{} a poll", got.len());
        let offsets: Vec<u64> = got.iter().map(|r| r.offset).collect();
        c.group_ack_many("t", "ns", "framed", 0, "workers", &offsets)
            .await
            .unwrap();
        claimed.extend(offsets);
    }
    assert_eq!(claimed, (0..N).collect::<Vec<_>>());
    let info = c
        .group_describe("t", "ns", "framed", 0, "workers")
        .await
        .unwrap();
    assert_eq!((info.dead_letters, info.in_flight, info.lag()), (0, 0, 0));
}

/// A record written under a larger frame cap than the broker runs with now
/// fits no answer: a read of it is `too_large`; a group poll gives it up at
/// once as a dead letter saying why, and hands out the records after it
/// (claimed, it would spend its attempts on answers never sent; left, it
/// would stop the group there for ever). Raising the cap again and
/// redriving it hands it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_a_lowered_frame_cap_is_dead_lettered_not_claimed() {
    let mut broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(1)
        .env("FELIX_MAX_FRAME_BYTES", 256 << 10));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "big", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "big", 0, vec![7u8; 100 << 10])
        .await
        .unwrap();
    c.publish("t", "ns", "big", 0, &b"small"[..]).await.unwrap();
    drop(c);
    broker.restart_with_env("FELIX_MAX_FRAME_BYTES", 64 << 10);
    let c = client(&broker).await;
    let err = c
        .read("t", "ns", "big", 0, StartPosition::Earliest, 10, None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TooLarge), "{err}");
    let got = c
        .group_poll("t", "ns", "big", 0, "workers", 10)
        .await
        .unwrap();
    assert_eq!(
        got.iter()
            .map(|r| (r.offset, r.attempts))
            .collect::<Vec<_>>(),
        [(1, 1)]
    );
    c.group_ack("t", "ns", "big", 0, "workers", 1)
        .await
        .unwrap();
    let letters = c
        .group_dead_letters_detailed("t", "ns", "big", 0, "workers")
        .await
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].offset, 0);
    assert!(!letters[0].by_consumer);
    let why = letters[0].reason.as_deref().unwrap_or_default();
    assert!(why.contains("server.max_frame_bytes"), "{why}");
    let info = c
        .group_describe("t", "ns", "big", 0, "workers")
        .await
        .unwrap();
    assert_eq!((info.in_flight, info.dead_letters, info.lag()), (0, 1, 0));
    drop(c);
    broker.restart_with_env("FELIX_MAX_FRAME_BYTES", 256 << 10);
    let c = client(&broker).await;
    c.group_redrive("t", "ns", "big", 0, "workers", 0)
        .await
        .unwrap();
    let got = c
        .group_poll("t", "ns", "big", 0, "workers", 10)
        .await
        .unwrap();
    assert_eq!(got.iter().map(|r| r.offset).collect::<Vec<_>>(), [0]);
    assert_eq!(got[0].payload.len(), 100 << 10);
}

/// Frames already read count against `server.max_requests_per_connection`
/// as they are taken from the buffer: a burst far over the limit in one
/// write is held in the buffer and answered in full, in as many turns as
/// the limit needs, without the client sending anything more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_the_request_limit_is_held_back_and_answered_in_full() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("felix.toml");
    std::fs::write(&cfg, "[server]\nmax_requests_per_connection = 2\n").unwrap();
    let broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(1)
        .env("FELIX_TEST_CONFIG", cfg.display()));
    let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    let ok = raw_call(&mut s, 1, &hello(None, felix_wire::PROTOCOL_VERSION)).await;
    assert!(matches!(ok, felix_wire::Response::HelloOk { .. }), "{ok:?}");
    const N: u64 = 500;
    let mut burst = bytes::BytesMut::new();
    for id in 100..100 + N {
        felix_wire::encode_request(id, &felix_wire::Request::Ping, &mut burst);
    }
    s.write_all(&burst).await.unwrap();
    let mut answered = HashSet::new();
    let mut buf = bytes::BytesMut::new();
    while (answered.len() as u64) < N {
        while let Some((id, resp)) = felix_wire::decode_response(&mut buf, 1 << 20).unwrap() {
            assert!(matches!(resp, felix_wire::Response::Pong), "{resp:?}");
            assert!(answered.insert(id), "{id} answered twice");
        }
        if (answered.len() as u64) == N {
            break;
        }
        let mut chunk = [0u8; 65536];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
            .await
            .unwrap_or_else(|_| panic!("stalled after {} answers", answered.len()))
            .unwrap();
        assert!(n > 0, "closed after {} answers", answered.len());
        buf.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(answered, (100..100 + N).collect::<HashSet<_>>());
}

/// Long polls waiting on a connection hold no answer room: with more of
/// them waiting than `max_pending_response_bytes` could hold answers for
/// (20 × 4 MiB against 64 MiB), a read on the same connection is answered
/// at once rather than after the polls time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_polls_do_not_hold_up_a_read_on_their_connection() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "quiet", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "quiet", 0, "only").await.unwrap();
    let mut polls = Vec::new();
    for g in 0..20 {
        let c = c.clone();
        polls.push(tokio::spawn(async move {
            // Past the one record, nothing comes: each waits it out.
            let group = format!("g{g}");
            let first = c
                .group_poll("t", "ns", "quiet", 0, &group, 1)
                .await
                .unwrap();
            assert_eq!(first.len(), 1);
            c.group_poll_wait("t", "ns", "quiet", 0, &group, 10, Duration::from_secs(8))
                .await
                .unwrap()
        }));
    }
    felix_tests::wait_until(Duration::from_secs(5), || {
        sample(&broker, "felix_requests_total{op=\"group_poll\"}") >= 40.0
    })
    .unwrap();
    let t = std::time::Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(4),
        c.read("t", "ns", "quiet", 0, StartPosition::Earliest, 10, None),
    )
    .await
    .expect("a read behind waiting polls is answered at once")
    .unwrap();
    assert_eq!(r.records.len(), 1);
    assert!(t.elapsed() < Duration::from_secs(4));
    for p in polls {
        assert!(p.await.unwrap().is_empty());
    }
}

/// `limits.max_total_shards` bounds the shards of all streams together:
/// a create past it is `too_large`, and deleting a stream makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_holds_at_most_its_total_shard_limit() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("felix.toml");
    std::fs::write(&cfg, "[limits]\nmax_total_shards = 5\n").unwrap();
    let broker = felix_tests::start_broker!(BrokerOptions::default()
        .cores(2)
        .env("FELIX_TEST_CONFIG", cfg.display()));
    let c = client(&broker).await;
    let create = |name: &'static str, shards: u32| {
        let c = c.clone();
        async move {
            c.create_stream("t", "ns", name, shards, StreamOptions::default())
                .await
                .map(|_| ())
        }
    };
    create("a", 3).await.unwrap();
    let err = create("b", 3).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TooLarge), "{err}");
    assert!(err.to_string().contains("max_total_shards"), "{err}");
    create("b", 2).await.unwrap();
    c.delete_stream("t", "ns", "a").await.unwrap();
    create("c", 3).await.unwrap();
}

/// A stream deleted while a read and a group poll wait on it: both end at
/// once with `not_found`, and the core goes on serving other streams (a
/// closed log must not turn their waits into a loop that never yields).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_on_a_deleted_stream_end_with_not_found_and_the_core_keeps_serving() {
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    for name in ["gone", "kept"] {
        c.create_stream("t", "ns", name, 1, StreamOptions::default())
            .await
            .unwrap();
    }
    let waiter = client(&broker).await;
    let poll = tokio::spawn({
        let w = waiter.clone();
        async move {
            w.group_poll_wait("t", "ns", "gone", 0, "g", 10, Duration::from_secs(20))
                .await
        }
    });
    let read = tokio::spawn({
        let w = waiter.clone();
        async move {
            w.read(
                "t",
                "ns",
                "gone",
                0,
                StartPosition::Latest,
                10,
                Some(Duration::from_secs(20)),
            )
            .await
        }
    });
    // Let both reach their waits (if one has not, it finds the stream gone
    // and the outcome is the same).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bound = Duration::from_secs(10);
    tokio::time::timeout(bound, c.delete_stream("t", "ns", "gone"))
        .await
        .expect("the delete finished")
        .unwrap();
    let polled = tokio::time::timeout(bound, poll)
        .await
        .expect("the waiting poll ended")
        .unwrap();
    assert_eq!(
        polled.unwrap_err().code(),
        Some(ErrorCode::NotFound),
        "a poll on a deleted stream"
    );
    let read = tokio::time::timeout(bound, read)
        .await
        .expect("the waiting read ended")
        .unwrap();
    assert_eq!(
        read.unwrap_err().code(),
        Some(ErrorCode::NotFound),
        "a read on a deleted stream"
    );
    let at = tokio::time::timeout(bound, c.publish("t", "ns", "kept", 0, "still here"))
        .await
        .expect("the core still serves")
        .unwrap();
    let r = c
        .read("t", "ns", "kept", 0, StartPosition::Offset(at), 1, None)
        .await
        .unwrap();
    assert_eq!(r.records[0].payload, Bytes::from_static(b"still here"));
}

/// A long poll whose client hangs up claims nothing: a record published
/// after it left goes to the next consumer at once, on its first attempt,
/// instead of waiting out a claim nobody holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_poll_whose_client_hung_up_claims_nothing() {
    use felix_wire::{GroupKey, Request, StreamRef};
    use tokio::io::AsyncWriteExt;
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "q", 1, StreamOptions::default())
        .await
        .unwrap();
    {
        let mut s = tokio::net::TcpStream::connect(broker.addr.as_str())
            .await
            .unwrap();
        raw_call(&mut s, 1, &hello(None, felix_wire::PROTOCOL_VERSION)).await;
        let poll = Request::GroupPoll {
            key: GroupKey {
                stream: StreamRef {
                    tenant: "t".into(),
                    namespace: "ns".into(),
                    stream: "q".into(),
                },
                shard: 0,
                group: "g".into(),
            },
            max_records: 10,
            wait_ms: 20_000,
            member: None,
            visibility_ms: None,
        };
        let mut frame = bytes::BytesMut::new();
        felix_wire::encode_request(2, &poll, &mut frame);
        s.write_all(&frame).await.unwrap();
        // Let the poll start waiting, then hang up without its answer.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.publish("t", "ns", "q", 0, "job").await.unwrap();
    let got = c
        .group_poll_wait("t", "ns", "q", 0, "g", 10, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        got.len(),
        1,
        "the record went to a poll nobody was waiting on"
    );
    assert_eq!(got[0].attempts, 1);
}

/// Clients whose connections sit on cores a broker no longer runs (it came
/// back with fewer) move to the cores it has: their next admin call and
/// their next publish to any shard succeed, without the caller retrying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_follow_a_broker_restarted_with_fewer_cores() {
    let mut broker = felix_tests::start_broker!(BrokerOptions::default().cores(4));
    let admin = client(&broker).await;
    admin
        .create_stream("t", "ns", "shrink", 4, StreamOptions::default())
        .await
        .unwrap();
    // Eight clients: their first connections land on cores at random
    // (SO_REUSEPORT), so some call core 1, 2 or 3 home; each also talks to
    // every core through the shards.
    let mut clients = Vec::new();
    for _ in 0..8 {
        let c = client(&broker).await;
        for shard in 0..4 {
            c.publish("t", "ns", "shrink", shard, "before")
                .await
                .unwrap();
        }
        clients.push(c);
    }
    broker.restart_with_cores(1);
    for (i, c) in clients.iter().enumerate() {
        let info = c
            .describe_stream("t", "ns", "shrink")
            .await
            .unwrap_or_else(|e| panic!("client {i}: describe after the restart: {e}"));
        assert_eq!(info.shards, 4);
        for shard in (0..4).rev() {
            c.publish("t", "ns", "shrink", shard, "after")
                .await
                .unwrap_or_else(|e| panic!("client {i}: publish to shard {shard}: {e}"));
        }
        assert_eq!(c.cores(), 1);
    }
    let c = client(&broker).await;
    for shard in 0..4 {
        let got = read_shard(&c, "shrink", shard).await;
        assert_eq!(got.len(), 16, "shard {shard}: 8 before and 8 after");
    }
}

/// A broker outside a cluster does not advertise `FEATURE_REPLICA_INFO`:
/// the client refuses `describe_replica` without sending it, and the
/// broker refuses one sent anyway with `unsupported`, then serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_broker_describes_no_replica() {
    use felix_wire::{Request, Response, StreamRef};
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    c.create_stream("t", "ns", "alone", 1, StreamOptions::default())
        .await
        .unwrap();
    assert!(!c.has_feature(felix_wire::FEATURE_REPLICA_INFO));
    match c.describe_replica("t", "ns", "alone", 0).await {
        Err(ClientError::Unsupported(why)) => {
            assert!(why.contains("FEATURE_REPLICA_INFO"), "{why}")
        }
        other => panic!("describe_replica on a single broker: {other:?}"),
    }
    let mut s = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    match raw_call(&mut s, 1, &hello(None, felix_wire::PROTOCOL_VERSION)).await {
        Response::HelloOk { features, .. } => {
            assert_eq!(features & felix_wire::FEATURE_REPLICA_INFO, 0)
        }
        other => panic!("unexpected {other:?}"),
    }
    let req = Request::DescribeReplica {
        stream: StreamRef::new("t", "ns", "alone"),
        shard: 0,
    };
    match raw_call(&mut s, 2, &req).await {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::Unsupported, "{e}");
            assert!(e.message.contains("FEATURE_REPLICA_INFO"), "{e}");
        }
        other => panic!("an unnegotiated describe_replica: {other:?}"),
    }
    let req = Request::DescribeShard {
        stream: StreamRef::new("t", "ns", "alone"),
        shard: 0,
    };
    assert!(matches!(
        raw_call(&mut s, 3, &req).await,
        Response::Shard(_)
    ));
}

/// A stream whose shards cannot all be opened (here: the broker runs out
/// of file descriptors) is not created at all: the answer is one short
/// `unavailable` saying so, the stream is not listed, its name can be
/// used again, and the broker restarts and serves what it had (a stream
/// left half-open would refuse requests, and stop the next start short of
/// descriptors too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_shards_cannot_open_is_not_created() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let start = || {
        let mut cmd = felix_tests::broker_command!(Some(data.as_path()), "127.0.0.1:0");
        felix_tests::limit_open_files(&mut cmd, 300);
        felix_tests::spawn_announcing(cmd)
    };
    let (mut child, addr) = start();
    let c = Client::connect(addr.as_str(), ClientConfig::default())
        .await
        .unwrap();
    c.create_stream("t", "ns", "kept", 2, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "kept", 0, "still here").await.unwrap();
    let err = c
        .create_stream("t", "ns", "wide", 600, StreamOptions::default())
        .await
        .expect_err("600 shards on 300 descriptors");
    assert_eq!(err.code(), Some(ErrorCode::Unavailable), "{err}");
    let msg = err.to_string();
    // Refused up front when the broker sees it is short of files (or,
    // when a shard fails to open anyway, rolled back).
    assert!(
        msg.contains("short of open files") || msg.contains("was not created"),
        "{msg}"
    );
    assert!(
        msg.len() < 1_000,
        "one short line, not one per shard: {msg}"
    );
    let listed = c.list_streams(None).await.unwrap();
    let names: Vec<&str> = listed.iter().map(|s| s.stream.stream.as_str()).collect();
    assert_eq!(names, ["kept"]);
    // The name is free, and a stream that fits is created under it.
    c.create_stream("t", "ns", "wide", 4, StreamOptions::default())
        .await
        .unwrap();
    c.publish("t", "ns", "wide", 3, "fits").await.unwrap();
    drop(c);
    let _ = child.kill();
    let _ = child.wait();

    let (mut child, addr) = start();
    let c = Client::connect(addr.as_str(), ClientConfig::default())
        .await
        .unwrap();
    let got = read_shard(&c, "kept", 0).await;
    assert_eq!(got, [(0, Bytes::from_static(b"still here"))]);
    assert_eq!(read_shard(&c, "wide", 3).await.len(), 1);
    let _ = child.kill();
    let _ = child.wait();
}

/// A client that shuts its side of the connection after sending (a
/// half-close, as `nc -N` does) still gets the answer to every request it
/// sent: durable publishes are acknowledged, and a read waiting at the
/// tail answers at once with what is there instead of waiting out its time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_connection_gets_its_answers() {
    use felix_wire::{AckMode, PublishTarget, Request, Response, StreamRef};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let broker = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = client(&broker).await;
    for name in ["half", "quiet"] {
        c.create_stream("t", "ns", name, 1, StreamOptions::default())
            .await
            .unwrap();
    }
    let mut out = bytes::BytesMut::new();
    felix_wire::encode_request(1, &hello(None, felix_wire::PROTOCOL_VERSION), &mut out);
    for id in 2..5u64 {
        let publish = Request::Publish {
            stream: StreamRef::new("t", "ns", "half"),
            target: PublishTarget::Shard(0),
            ack: AckMode::Default,
            records: vec![RecordIn {
                payload: Bytes::from(format!("r{id}")),
                ..Default::default()
            }]
            .into(),
        };
        felix_wire::encode_request(id, &publish, &mut out);
    }
    // A read waiting for a record on a stream nobody publishes to.
    let waiting_read = Request::Read {
        stream: StreamRef::new("t", "ns", "quiet"),
        shard: 0,
        from: StartPosition::Offset(0),
        max_records: 10,
        max_bytes: 1 << 20,
        wait_ms: 20_000,
    };
    felix_wire::encode_request(5, &waiting_read, &mut out);
    let mut sock = tokio::net::TcpStream::connect(&broker.addr).await.unwrap();
    sock.write_all(&out).await.unwrap();
    sock.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut got))
        .await
        .expect("answered and closed well before the read's wait")
        .unwrap();
    let mut got = bytes::BytesMut::from(&got[..]);
    let mut answers = std::collections::BTreeMap::new();
    while let Some((id, resp)) = felix_wire::decode_response(&mut got, 1 << 20).unwrap() {
        answers.insert(id, resp);
    }
    assert_eq!(answers.len(), 5, "{answers:?}");
    assert!(matches!(answers[&1], Response::HelloOk { .. }));
    for id in 2..5u64 {
        assert!(
            matches!(answers[&id], Response::Published { .. }),
            "{id}: {:?}",
            answers[&id]
        );
    }
    match &answers[&5] {
        Response::Records {
            end_offset,
            records,
            ..
        } => assert_eq!((*end_offset, records.len()), (0, 0)),
        other => panic!("the waiting read answered {other:?}"),
    }
    let stored = read_shard(&c, "half", 0).await;
    assert_eq!(stored.len(), 3);
}

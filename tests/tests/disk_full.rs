//! A data disk that fills up: publishes are refused with `unavailable` and a
//! message saying why before the disk runs out, nothing acknowledged is
//! lost, the shard keeps serving reads, and publishes are served again as
//! soon as space is freed, without a restart.
//!
//! Needs root (a small ext4 file system is loop-mounted); elsewhere the test
//! says so and passes without running.

use bytes::Bytes;
use felix_client::{Client, ClientConfig, ClientError, StreamOptions};
use felix_wire::{ErrorCode, RecordIn, StartPosition};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A loop-mounted ext4 image, unmounted on drop.
struct SmallDisk {
    _tmp: tempfile::TempDir,
    mnt: PathBuf,
}

impl SmallDisk {
    fn mount(mib: u32) -> Result<SmallDisk, String> {
        let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
        let img = tmp.path().join("disk.img");
        let mnt = tmp.path().join("mnt");
        std::fs::create_dir(&mnt).map_err(|e| e.to_string())?;
        let f = std::fs::File::create(&img).map_err(|e| e.to_string())?;
        f.set_len(u64::from(mib) << 20).map_err(|e| e.to_string())?;
        run("mkfs.ext4", &["-q", "-F", img.to_str().unwrap()])?;
        run(
            "mount",
            &["-o", "loop", img.to_str().unwrap(), mnt.to_str().unwrap()],
        )?;
        Ok(SmallDisk { _tmp: tmp, mnt })
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", self.mnt.to_str().unwrap()]);
    }
}

fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn start(data: &Path) -> (felix_tests::Spawned, String) {
    start_with(data, None)
}

/// With `config`: a config file for settings that have no variable.
fn start_with(data: &Path, config: Option<&Path>) -> (felix_tests::Spawned, String) {
    let mut cmd = felix_tests::broker_command!(Some(data), "127.0.0.1:0");
    cmd.env("FELIX_MIN_FREE_BYTES", (4u64 << 20).to_string());
    if let Some(c) = config {
        cmd.env("FELIX_TEST_CONFIG", c);
    }
    felix_tests::spawn_announcing(cmd)
}

/// A 40 MiB disk with about 12 MiB left for the broker (4 of them kept in
/// reserve), and the file filling the rest; `None` (the test is skipped)
/// where a disk cannot be loop-mounted.
fn nearly_full_disk() -> Option<(SmallDisk, PathBuf)> {
    let disk = small_disk(40)?;
    let filler = fill_until(&disk.mnt, 12 << 20);
    Some((disk, filler))
}

/// A `mib` MiB loop-mounted ext4 disk; `None` (the test is skipped, saying
/// so) where one cannot be mounted.
fn small_disk(mib: u32) -> Option<SmallDisk> {
    SmallDisk::mount(mib)
        .map_err(|e| eprintln!("skipped: cannot loop-mount a small disk here ({e})"))
        .ok()
}

async fn client(addr: &str) -> Client {
    Client::connect(addr, ClientConfig::default())
        .await
        .unwrap()
}

/// Fill the disk at `mnt` with one file until about `free` bytes are left.
fn fill_until(mnt: &Path, free: u64) -> PathBuf {
    let filler = mnt.join("filler");
    let avail = {
        let out = Command::new("df")
            .args(["--output=avail", "-B1", mnt.to_str().unwrap()])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.trim().parse::<u64>().ok())
            .expect("df")
    };
    let f = std::fs::File::create(&filler).unwrap();
    // Really allocate the blocks (set_len would make a sparse file).
    let chunk = vec![0u8; 1 << 20];
    let mut w = std::io::BufWriter::new(f);
    let mut left = avail.saturating_sub(free);
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        std::io::Write::write_all(&mut w, &chunk[..n]).unwrap();
        left -= n as u64;
    }
    let f = w.into_inner().unwrap();
    f.sync_all().unwrap();
    filler
}

fn batch(first: u64) -> Vec<RecordIn> {
    (first..first + 64)
        .map(|i| RecordIn {
            payload: Bytes::from(format!("{i:08}").repeat(128)),
            ..Default::default()
        })
        .collect()
}

async fn read_all(c: &Client) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut from = StartPosition::Earliest;
    loop {
        let b = c
            .read("t", "ns", "fill", 0, from, 1000, None)
            .await
            .expect("read");
        if b.records.is_empty() {
            return out;
        }
        out.extend(b.records.iter().map(|r| r.payload.clone()));
        from = StartPosition::Offset(b.next_offset);
    }
}

/// Publish [`batch`]`(next)` until the broker takes it again (space was
/// freed, and its next look sees it): it must land at `next`. Returns the
/// records stored.
async fn published_once_space_is_back(c: &Client, next: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.publish_batch("t", "ns", "fill", 0, batch(next)).await {
            Ok(p) => {
                assert_eq!(p.base_offset, next);
                return u64::from(p.count);
            }
            Err(e) => assert!(
                Instant::now() < deadline,
                "still refused 10 s after space was freed: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_publishes_until_space_is_freed_and_loses_nothing() {
    let Some((disk, filler)) = nearly_full_disk() else {
        return;
    };
    let data = disk.mnt.join("data");
    let (mut broker, addr) = start(&data);
    let c = client(&addr).await;
    c.create_stream("t", "ns", "fill", 1, StreamOptions::default())
        .await
        .unwrap();

    // Publish 64 KiB batches until the broker refuses one.
    let mut acked = 0u64;
    let refusal = loop {
        match c.publish_batch("t", "ns", "fill", 0, batch(acked)).await {
            Ok(p) => {
                assert_eq!(p.base_offset, acked);
                acked += p.count as u64;
                assert!(acked < 1_000_000, "the disk never filled");
            }
            Err(e) => break e,
        }
    };
    match &refusal {
        ClientError::Server { code, message, .. } => {
            assert_eq!(*code, ErrorCode::Unavailable, "{message}");
            assert!(message.contains("nearly full"), "{message}");
        }
        other => panic!("unexpected refusal: {other}"),
    }
    // And says none of it was stored, so the batch can be sent again.
    assert!(refusal.not_applied(), "{refusal:?}");
    assert!(acked > 0, "something was accepted before the disk filled");

    // The shard is not stopped: everything acknowledged reads back.
    let recs = read_all(&c).await;
    assert_eq!(recs.len() as u64, acked);

    // Free space: publishes are served again, without a restart.
    std::fs::remove_file(&filler).unwrap();
    acked += published_once_space_is_back(&c, acked).await;

    // And after kill -9, every acknowledged record is there, in order.
    drop(c);
    broker.kill().unwrap();
    broker.wait().unwrap();
    let (mut broker, addr) = start(&data);
    let c = client(&addr).await;
    let recs = read_all(&c).await;
    assert_eq!(recs.len() as u64, acked);
    for (i, r) in recs.iter().enumerate() {
        let want = format!("{:08}", i).repeat(128);
        assert_eq!(r, &Bytes::from(want), "record {i}");
    }
    broker.kill().unwrap();
    broker.wait().unwrap();
}

/// Publishes admitted together count against the free space together. With
/// a shard's queue small enough that a burst waits for room, each publish of
/// the burst used to look at the same free space before any was appended,
/// so together they wrote past it, the disk filled, and the write error
/// stopped the shard until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_publishes_is_refused_before_it_fills_the_disk() {
    let Some((disk, filler)) = nearly_full_disk() else {
        return;
    };
    let config = disk.mnt.join("felix.toml");
    std::fs::write(&config, "[storage]\nmax_queued_bytes = 1048576\n").unwrap();
    let data = disk.mnt.join("data");
    let (mut broker, addr) = start_with(&data, Some(&config));
    let c = client(&addr).await;
    c.create_stream("t", "ns", "fill", 1, StreamOptions::default())
        .await
        .unwrap();

    // 48 publishes of 512 KiB on one connection at once: 24 MiB, twice
    // what the disk has free.
    let one = |i: u64| RecordIn {
        payload: Bytes::from(vec![b'a' + (i % 26) as u8; 512 << 10]),
        ..Default::default()
    };
    let mut sends = tokio::task::JoinSet::new();
    for i in 0..48u64 {
        let c = c.clone();
        let rec = one(i);
        sends.spawn(async move { c.publish_batch("t", "ns", "fill", 0, vec![rec]).await });
    }
    let mut acked = 0u64;
    while let Some(r) = sends.join_next().await {
        match &r.unwrap() {
            Ok(p) => acked += p.count as u64,
            Err(ClientError::Server { code, message, .. }) => {
                assert_eq!(*code, ErrorCode::Unavailable, "{message}");
                assert!(
                    message.contains("nearly full"),
                    "refused for the free space, not by a stopped shard: {message}"
                );
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert!(acked > 0, "some of the burst fitted");
    assert!(acked < 48, "the burst did not all fit");

    // The shard is not stopped: what was acknowledged reads back, and once
    // space is freed publishes go on without a restart.
    assert_eq!(read_all(&c).await.len() as u64, acked);
    std::fs::remove_file(&filler).unwrap();
    published_once_space_is_back(&c, acked).await;
    drop(c);
    broker.kill().unwrap();
    broker.wait().unwrap();
}

/// Blocks reserved ahead of a shard's writes (`storage.preallocate_bytes`,
/// 16 MiB steps by default) come out of the same free space that admitted
/// publishes write into. Four shards filling a 64 MiB disk at once used to
/// reserve the room away between two looks of the free-space guard, and a
/// write then failed with ENOSPC and stopped its shard until a restart.
/// Now reservations are made only with room to spare: every refusal is the
/// guard's, and every shard keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_filling_a_small_disk_together_are_refused_not_stopped() {
    let Some(disk) = small_disk(64) else {
        return;
    };
    let data = disk.mnt.join("data");
    // Two cores, each with its own view of the free space; the automatic
    // reserve (5 % of the disk).
    let cmd = felix_tests::broker_command_on_cores(
        env!("CARGO_BIN_EXE_felix-test-broker"),
        Some(&data),
        "127.0.0.1:0",
        2,
    );
    let (mut broker, addr) = felix_tests::spawn_announcing(cmd);
    let c = client(&addr).await;
    c.create_stream("t", "ns", "fill", 4, StreamOptions::default())
        .await
        .unwrap();
    let mut shards = tokio::task::JoinSet::new();
    for shard in 0..4u32 {
        let c = c.clone();
        shards.spawn(async move {
            // 16 publishes in flight, each 256 records of 512 bytes.
            let mut acked = 0u64;
            let mut refused = None;
            let mut sends = tokio::task::JoinSet::new();
            for round in 0u64.. {
                for k in 0..16u64 {
                    let c = c.clone();
                    let first = (round * 16 + k) * 256;
                    sends.spawn(async move {
                        let recs = (first..first + 256)
                            .map(|i| RecordIn {
                                payload: Bytes::from(format!("{i:08}").repeat(64)),
                                ..Default::default()
                            })
                            .collect();
                        c.publish_batch("t", "ns", "fill", shard, recs).await
                    });
                }
                while let Some(r) = sends.join_next().await {
                    match r.unwrap() {
                        Ok(p) => acked += u64::from(p.count),
                        Err(e) => refused = Some(e),
                    }
                }
                if refused.is_some() || round > 100_000 {
                    break;
                }
            }
            (shard, acked, refused)
        });
    }
    while let Some(r) = shards.join_next().await {
        let (shard, acked, refused) = r.unwrap();
        match refused {
            Some(ClientError::Server { code, message, .. }) => {
                assert_eq!(code, ErrorCode::Unavailable, "shard {shard}: {message}");
                assert!(
                    message.contains("nearly full"),
                    "shard {shard} refused other than by the free-space guard: {message}"
                );
            }
            other => panic!("shard {shard}: {other:?}"),
        }
        // Served still (a stopped shard refuses reads too), with every
        // record it acknowledged.
        let mut read = 0u64;
        let mut from = StartPosition::Earliest;
        loop {
            let b = c
                .read("t", "ns", "fill", shard, from, 1000, None)
                .await
                .unwrap_or_else(|e| panic!("shard {shard}: {e}"));
            if b.records.is_empty() {
                break;
            }
            read += b.records.len() as u64;
            from = StartPosition::Offset(b.next_offset);
        }
        assert_eq!(read, acked, "shard {shard}");
    }
    drop(c);
    broker.kill().unwrap();
    broker.wait().unwrap();
}

/// Fill every block of the disk at `mnt`, the root reserve too (the tests
/// run as root), 1 KiB at a time at the end, until the disk refuses.
fn fill_completely(mnt: &Path) -> [PathBuf; 2] {
    let filler = fill_until(mnt, 0);
    let rest = mnt.join("filler-rest");
    let mut f = std::fs::File::create(&rest).unwrap();
    let chunk = [0u8; 1 << 10];
    while let Ok(1..) = std::io::Write::write(&mut f, &chunk) {}
    let _ = f.sync_all();
    [filler, rest]
}

/// A broker restarted on a disk that another program filled to the last
/// block (a small ext4 disk has 1 KiB blocks, under a page) still opens
/// its shards, those with consumer groups too (each open writes a snapshot
/// of their state): reads and group calls are served, publishes refused as
/// for a nearly full disk, and served again once space is freed, with no
/// second restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restarted_on_a_disk_filled_to_the_last_block_serves_its_groups() {
    let Some(disk) = small_disk(40) else {
        return;
    };
    let data = disk.mnt.join("data");
    let (mut broker, addr) = start(&data);
    let c = client(&addr).await;
    c.create_stream("t", "ns", "fill", 1, StreamOptions::default())
        .await
        .unwrap();
    c.publish_batch("t", "ns", "fill", 0, batch(0))
        .await
        .unwrap();
    let got = c
        .group_poll("t", "ns", "fill", 0, "workers", 10)
        .await
        .unwrap();
    assert_eq!(got.len(), 10);
    c.group_ack("t", "ns", "fill", 0, "workers", got[0].offset)
        .await
        .unwrap();
    drop(c);
    // Stopped cleanly, then the disk is filled from outside.
    // SAFETY: kill(2) on a child process this test started.
    assert_eq!(
        unsafe { libc::kill(broker.id() as libc::pid_t, libc::SIGTERM) },
        0
    );
    assert!(broker.wait().unwrap().success());
    let fillers = fill_completely(&disk.mnt);

    let (mut broker, addr) = start(&data);
    let c = client(&addr).await;
    let shard = c.describe_shard("t", "ns", "fill", 0).await.unwrap();
    assert_eq!(shard.stopped, None, "the shard stopped at open");
    assert_eq!(read_all(&c).await.len(), 64);
    let info = c
        .group_describe("t", "ns", "fill", 0, "workers")
        .await
        .unwrap();
    assert_eq!(info.position, 1);
    // Publishes are refused as for a nearly full disk, not by a stopped
    // shard.
    let refused = c
        .publish_batch("t", "ns", "fill", 0, batch(64))
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("nearly full"), "{refused}");
    assert!(refused.not_applied(), "{refused:?}");

    // Killed and started again on the full disk: the same.
    drop(c);
    broker.kill().unwrap();
    broker.wait().unwrap();
    let (mut broker, addr) = start(&data);
    let c = client(&addr).await;
    let shard = c.describe_shard("t", "ns", "fill", 0).await.unwrap();
    assert_eq!(
        shard.stopped, None,
        "the shard stopped at open after a crash"
    );
    assert_eq!(read_all(&c).await.len(), 64);
    let again = c
        .group_poll("t", "ns", "fill", 0, "workers", 100)
        .await
        .unwrap();
    assert_eq!(
        again.first().map(|r| r.offset),
        Some(1),
        "redelivered from the position"
    );

    for f in &fillers {
        std::fs::remove_file(f).unwrap();
    }
    published_once_space_is_back(&c, 64).await;
    assert_eq!(read_all(&c).await.len(), 128);
    broker.kill().unwrap();
    broker.wait().unwrap();
}

//! The shard log on a real disk through glommio DMA files (O_DIRECT).

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::log::{Frontier, LogConfig, ReadLimits, ShardLog};
use felix_engine::runtime::warm_up_dma;
use felix_engine::storage::dma::DmaStorage;
use felix_engine::Offset;
use glommio::LocalExecutorBuilder;
use std::path::PathBuf;
use std::time::Duration;

fn run<F: std::future::Future<Output = ()> + 'static>(f: impl FnOnce() -> F + Send + 'static) {
    run_and_return(f)
}

fn run_and_return<T: Send + 'static, F: std::future::Future<Output = T> + 'static>(
    f: impl FnOnce() -> F + Send + 'static,
) -> T {
    LocalExecutorBuilder::default()
        .spawn(f)
        .expect("executor")
        .join()
        .expect("join")
}

fn rec(i: u64) -> RecordIn {
    RecordIn {
        timestamp_ms: i,
        key: None,
        headers: vec![],
        payload: Bytes::from(format!("record-{i}-").repeat((i % 50) as usize + 1)),
    }
}

/// The log in `path` on the real disk, with no replay.
async fn open_dma(path: &std::path::Path, cfg: LogConfig) -> ShardLog<DmaStorage> {
    ShardLog::open(DmaStorage::new(), path, cfg, &mut |_| {})
        .await
        .unwrap()
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
        let log = open_dma(&path, cfg.clone()).await;
        for chunk in 0..40u64 {
            let batch: Vec<_> = (0..25).map(|i| rec(chunk * 25 + i)).collect();
            let a = log.append(&batch).unwrap();
            log.flush().await.unwrap();
            log.wait(a.lsn, Frontier::Durable).await.unwrap();
        }
        assert!(log.stats().segments > 1, "segments should roll");
        log.close().await.unwrap();
        let log = open_dma(&path, cfg).await;
        assert_eq!(log.end(), Offset(1000));
        let got = read_all(&log).await;
        assert_eq!(got.len(), 1000);
        for (i, p) in got.iter().enumerate() {
            assert_eq!(p, &rec(i as u64).payload);
        }
    });
}

/// With `preallocate`, the active segment is reserved ahead of its writes a
/// step at a time (fallocate), sealed segments are cut back to their data,
/// and the last one, still reserved when the log stops, reopens at its last
/// record with the zeros past it ignored and keeps appending.
#[test]
fn preallocated_segments_are_cut_when_sealed_and_reopen_past_their_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let cfg = LogConfig {
            segment_bytes: 64 << 10,
            read_cache_bytes: 0,
            preallocate: true,
            preallocate_step: 32 << 10,
            ..LogConfig::default()
        };
        let log = open_dma(&path, cfg.clone()).await;
        for chunk in 0..30u64 {
            let batch: Vec<_> = (0..25).map(|i| rec(chunk * 25 + i)).collect();
            log.append(&batch).unwrap();
            log.flush().await.unwrap();
        }
        assert!(log.stats().segments > 1, "segments should roll");
        // Stop without sealing, as a kill -9 would (everything was synced).
        drop(log);
        let mut sizes: Vec<(String, u64)> = std::fs::read_dir(&path)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    e.metadata().unwrap().len(),
                )
            })
            .filter(|(n, _)| n.ends_with(".log"))
            .collect();
        sizes.sort();
        let (last, sealed) = sizes.split_last().unwrap();
        assert_eq!(last.1, 64 << 10, "the open segment is reserved in full");
        for (name, len) in sealed {
            assert!(
                *len < 64 << 10,
                "{name} was sealed at {len} bytes, its data"
            );
        }
        let log = open_dma(&path, cfg).await;
        assert_eq!(log.end(), Offset(750));
        let more: Vec<_> = (750..800).map(rec).collect();
        log.append(&more).unwrap();
        log.flush().await.unwrap();
        let got = read_all(&log).await;
        assert_eq!(got.len(), 800);
        for (i, p) in got.iter().enumerate() {
            assert_eq!(p, &rec(i as u64).payload, "record {i}");
        }
        log.close().await.unwrap();
    });
}

#[test]
fn a_hand_truncated_segment_is_refused_after_a_clean_close_and_cut_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    let p2 = path.clone();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let log = open_dma(&p2, LogConfig::default()).await;
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
    // The log was closed cleanly, so no write can have been torn since: the
    // cut is damage, and the open refuses without cutting anything.
    let p3 = path.clone();
    run(move || async move {
        let err = ShardLog::open(DmaStorage::new(), &p3, LogConfig::default(), &mut |_| {})
            .await
            .expect_err("a cleanly closed log that lost records opens");
        let msg = err.to_string();
        assert!(msg.contains("closed cleanly"), "{msg}");
        assert!(msg.contains("clean.mark"), "{msg}");
    });
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), valid as u64 - 10);
    // What a crash leaves (and an operator who accepts the loss does by
    // hand): no clean mark. The open cuts back to the last whole record.
    std::fs::remove_file(path.join("clean.mark")).unwrap();
    run(move || async move {
        let log = open_dma(&path, LogConfig::default()).await;
        assert_eq!(log.end(), Offset(99));
        let got = read_all(&log).await;
        assert_eq!(got.len(), 99);
        let a = log.append(&[rec(99)]).unwrap();
        assert_eq!(a.base, Offset(99));
        log.flush().await.unwrap();
        assert_eq!(read_all(&log).await.len(), 100);
    });
}

/// The storage holds at most its queue depth of data-file I/Os in flight on
/// a core, however many are issued at once: 32 writes, then 32 reads mixed
/// with fdatasyncs, all issued together with a depth of 2 never have more
/// than 2 in flight; nor does a shard log that fans a flush out 8 wide. The
/// same load with a larger depth does go wider (the count measures it).
#[test]
fn io_in_flight_never_exceeds_the_queue_depth() {
    use felix_engine::storage::{Storage, StorageFile};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        async fn burst(storage: &DmaStorage, path: &std::path::Path) {
            const N: u64 = 32;
            let file = storage.open(path, true).await.unwrap();
            let writes = (0..N).map(|i| {
                let mut buf = felix_engine::storage::PageBuf::with_capacity(4096);
                buf.fill(4096, i as u8);
                file.write_at(buf, 4096, i * 4096)
            });
            for r in futures_util::future::join_all(writes).await {
                r.unwrap();
            }
            let reads =
                futures_util::future::join_all((0..N).map(|i| file.read_at(i * 4096, 4096)));
            let syncs = futures_util::future::join_all((0..4).map(|_| file.sync()));
            let (reads, syncs) = futures_util::future::join(reads, syncs).await;
            for (i, r) in reads.into_iter().enumerate() {
                assert!(r.unwrap().iter().all(|b| *b == i as u8));
            }
            for r in syncs {
                r.unwrap();
            }
            file.close().await.unwrap();
        }
        let narrow = DmaStorage::with_queue_depth(2);
        burst(&narrow, &root.join("narrow")).await;
        assert_eq!(narrow.in_flight_high_water(), 2);

        let wide = DmaStorage::with_queue_depth(64);
        burst(&wide, &root.join("wide")).await;
        assert!(
            wide.in_flight_high_water() > 2,
            "the unbounded burst went {} wide",
            wide.in_flight_high_water()
        );

        // A shard log writing a flush in 4 KiB pieces, 8 at a time, on
        // storage with a depth of 2 (a piece holds whole batches: 400 small
        // ones make a flush of more than 8 pieces).
        let storage = DmaStorage::with_queue_depth(2);
        let cfg = LogConfig {
            io_depth: 8,
            write_chunk_bytes: 4096,
            read_cache_bytes: 0,
            ..LogConfig::default()
        };
        let log = ShardLog::open(storage.clone(), &root.join("t/n/s/0"), cfg, &mut |_| {})
            .await
            .unwrap();
        for i in 0..400 {
            log.append(&[rec(i)]).unwrap();
        }
        log.flush().await.unwrap();
        let bytes = log.stats().bytes;
        assert!(
            bytes > 8 * 4096,
            "the flush takes more than 8 pieces: {bytes}"
        );
        assert_eq!(read_all(&log).await.len(), 400);
        assert_eq!(storage.in_flight_high_water(), 2);
        log.close().await.unwrap();
    });
}

/// Byte ranges of `file` that the filesystem holds as unwritten extents
/// (reserved by fallocate, never written), through the FIEMAP ioctl.
fn unwritten_ranges(file: &std::path::Path) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
    const FIEMAP_FLAG_SYNC: u32 = 0x1;
    const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
    const EXTENTS: usize = 256;
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Extent {
        logical: u64,
        physical: u64,
        length: u64,
        reserved64: [u64; 2],
        flags: u32,
        reserved: [u32; 3],
    }
    #[repr(C)]
    struct Map {
        start: u64,
        length: u64,
        flags: u32,
        mapped: u32,
        count: u32,
        reserved: u32,
        extents: [Extent; EXTENTS],
    }
    let f = std::fs::File::open(file).unwrap();
    let mut map = Map {
        start: 0,
        length: u64::MAX,
        flags: FIEMAP_FLAG_SYNC,
        mapped: 0,
        count: EXTENTS as u32,
        reserved: 0,
        extents: [Extent::default(); EXTENTS],
    };
    // SAFETY: FIEMAP fills at most `count` extents of the struct we own.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_FIEMAP as _, &mut map as *mut Map) };
    assert_eq!(rc, 0, "FIEMAP: {}", std::io::Error::last_os_error());
    map.extents[..map.mapped as usize]
        .iter()
        .filter(|e| e.flags & FIEMAP_EXTENT_UNWRITTEN != 0)
        .map(|e| (e.logical, e.logical + e.length))
        .collect()
}

/// The active segment's file.
fn active_segment(path: &std::path::Path) -> PathBuf {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(path)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    logs.sort();
    logs.pop().unwrap()
}

#[test]
fn small_flushes_write_zeros_ahead_so_later_ones_overwrite_written_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    let p2 = path.clone();
    let data_len = run_and_return(move || async move {
        warm_up_dma(&root).await.unwrap();
        let cfg = LogConfig {
            segment_bytes: 8 << 20,
            read_cache_bytes: 0,
            preallocate: true,
            preallocate_step: 1 << 20,
            ..LogConfig::default()
        };
        let log = open_dma(&p2, cfg).await;
        // Forty small rounds, a few KiB each.
        for chunk in 0..40u64 {
            let batch: Vec<_> = (0..10).map(|i| rec(chunk * 10 + i)).collect();
            log.append(&batch).unwrap();
            log.flush().await.unwrap();
        }
        let len = log.stats().bytes;
        drop(log); // as kill -9 would leave it (everything was synced)
        len
    });
    let seg = active_segment(&path);
    let size = std::fs::metadata(&seg).unwrap().len();
    // Reservations double from 256 KiB up to the step: the file ends at a
    // power of two past its data and zeros, never where a write left it.
    assert!(
        size.is_power_of_two() && (256 << 10..=1 << 20).contains(&size) && size >= data_len,
        "the file grows by its reservation only: {size} bytes for {data_len} of data"
    );
    // At least 64 KiB after the data hold written zeros, not reserved-only
    // blocks: the next flushes there have no extent to convert.
    let ahead = data_len + (64 << 10);
    for (from, to) in unwritten_ranges(&seg) {
        assert!(
            to <= data_len.next_multiple_of(4096) || from >= ahead,
            "unwritten extent {from}..{to} inside the zeroed stretch (data ends at {data_len})"
        );
    }
    // And the log reopens at its data, past the zeros, cut back to the
    // data's last page.
    let root = dir.path().to_path_buf();
    let p3 = path.clone();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let log = open_dma(&p3, LogConfig::default()).await;
        assert_eq!(log.end(), Offset(400));
        let size = std::fs::metadata(active_segment(&p3)).unwrap().len();
        assert_eq!(size, data_len.next_multiple_of(4096));
        let got = read_all(&log).await;
        for (i, p) in got.iter().enumerate() {
            assert_eq!(p, &rec(i as u64).payload, "record {i}");
        }
        log.close().await.unwrap();
    });
}

#[test]
fn large_flushes_reserve_without_writing_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    let p2 = path.clone();
    let data_len = run_and_return(move || async move {
        warm_up_dma(&root).await.unwrap();
        let cfg = LogConfig {
            segment_bytes: 64 << 20,
            read_cache_bytes: 0,
            preallocate: true,
            preallocate_step: 8 << 20,
            ..LogConfig::default()
        };
        let log = open_dma(&p2, cfg).await;
        // Rounds of about 1 MiB each: bandwidth-bound, no zeros.
        let big = Bytes::from(vec![7u8; 64 << 10]);
        for _ in 0..4 {
            let batch: Vec<_> = (0..16)
                .map(|_| RecordIn {
                    timestamp_ms: 1,
                    key: None,
                    headers: vec![],
                    payload: big.clone(),
                })
                .collect();
            log.append(&batch).unwrap();
            log.flush().await.unwrap();
        }
        let len = log.stats().bytes;
        drop(log);
        len
    });
    let seg = active_segment(&path);
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), 8 << 20);
    let unwritten: u64 = unwritten_ranges(&seg).iter().map(|(a, b)| b - a).sum();
    assert!(
        unwritten >= (8 << 20) - data_len.next_multiple_of(4096) - (1 << 20),
        "the reservation past {data_len} bytes of data stays unwritten (fallocated), \
         {unwritten} bytes are"
    );
}

#[test]
fn a_clean_close_gives_the_reservation_back() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    let p2 = path.clone();
    let cfg = LogConfig {
        segment_bytes: 8 << 20,
        read_cache_bytes: 0,
        preallocate: true,
        preallocate_step: 1 << 20,
        ..LogConfig::default()
    };
    let cfg2 = cfg.clone();
    let data_len = run_and_return(move || async move {
        warm_up_dma(&root).await.unwrap();
        let log = open_dma(&p2, cfg2).await;
        for chunk in 0..20u64 {
            let batch: Vec<_> = (0..10).map(|i| rec(chunk * 10 + i)).collect();
            log.append(&batch).unwrap();
            log.flush().await.unwrap();
        }
        let len = log.stats().bytes;
        log.close().await.unwrap();
        len
    });
    let seg = active_segment(&path);
    // Cut to the end of the data's last page (its padding is zeros), so
    // the next flush rewrites that page without needing a block for it.
    let bytes = std::fs::read(&seg).unwrap();
    assert_eq!(
        bytes.len() as u64,
        data_len.next_multiple_of(4096),
        "closed at its data's last page, reservation and zeros cut off"
    );
    assert!(bytes[data_len as usize..].iter().all(|&b| b == 0));
    let root = dir.path().to_path_buf();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let log = open_dma(&path, cfg).await;
        assert_eq!(log.end(), Offset(200));
        // And it reserves again as it is written.
        log.append(&[rec(200)]).unwrap();
        log.flush().await.unwrap();
        assert_eq!(read_all(&log).await.len(), 201);
        log.close().await.unwrap();
    });
}

/// A DMA file's size is tracked through its own writes, reservations and
/// truncations (one statx at open), reads stop at it, and a file unlinked
/// while open (retention deleting a segment a reader still holds) still
/// reads by its descriptor.
#[test]
fn a_dma_file_tracks_its_size_and_reads_after_it_is_unlinked() {
    use felix_engine::storage::{Storage, StorageFile};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seg");
    let root = dir.path().to_path_buf();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let storage = DmaStorage::new();
        let f = storage.open(&path, true).await.unwrap();
        assert_eq!(f.size().await.unwrap(), 0);
        assert!(f.read_at(0, 4096).await.unwrap().is_empty());
        // Only the asked length is written; the buffer comes back whole.
        let mut buf = felix_engine::storage::PageBuf::with_capacity(12288);
        buf.fill(8192, 7);
        buf.fill(100, 9);
        let buf = f.write_at(buf, 8192, 4096).await.unwrap();
        assert_eq!(buf.len(), 8292);
        assert!(buf.filled()[..8192].iter().all(|&b| b == 7));
        assert!(buf.filled()[8192..].iter().all(|&b| b == 9));
        assert_eq!(f.size().await.unwrap(), 12288);
        // A read past the end is cut at it.
        let r = f.read_at(8192, 16384).await.unwrap();
        assert_eq!(r.len(), 4096);
        assert!(r.iter().all(|&b| b == 7));
        // Reserving grows it (fallocate mode 0); reserved blocks read as zeros.
        f.allocate(65536).await.unwrap();
        assert_eq!(f.size().await.unwrap(), 65536);
        let r = f.read_at(61440, 16384).await.unwrap();
        assert_eq!(r.len(), 4096);
        assert!(r.iter().all(|&b| b == 0));
        // Truncating shrinks it, on disk and here.
        f.truncate(8192).await.unwrap();
        assert_eq!(f.size().await.unwrap(), 8192);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 8192);
        assert_eq!(f.read_at(0, 65536).await.unwrap().len(), 8192);
        // Another open sees the same size.
        let g = storage.open(&path, false).await.unwrap();
        assert_eq!(g.size().await.unwrap(), 8192);
        g.close().await.unwrap();
        // Unlinked while open: the descriptor still reads its bytes.
        std::fs::remove_file(&path).unwrap();
        let r = f.read_at(4096, 4096).await.unwrap();
        assert_eq!(r.len(), 4096);
        assert!(r.iter().all(|&b| b == 7));
        f.close().await.unwrap();
    });
}

/// A segment file cut short from outside while the log is open: a read of
/// what it lost answers an error naming the file, instead of reading the
/// same short bytes again for ever.
#[test]
fn a_segment_cut_short_while_open_fails_reads_instead_of_spinning() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let cfg = LogConfig {
            read_cache_bytes: 0,
            ..LogConfig::default()
        };
        let log = open_dma(&path, cfg).await;
        for chunk in 0..20u64 {
            let batch: Vec<_> = (0..10).map(|i| rec(chunk * 10 + i)).collect();
            log.append(&batch).unwrap();
            log.flush().await.unwrap();
        }
        let seg = active_segment(&path);
        let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
        f.set_len(4096).unwrap();
        drop(f);
        let read = glommio::timer::timeout(Duration::from_secs(10), async {
            Ok(log
                .read(
                    Offset(150),
                    ReadLimits {
                        max_records: 10,
                        max_bytes: 1 << 20,
                    },
                )
                .await)
        })
        .await
        .expect("the read answers");
        let err = read.expect_err("records the file no longer holds were read");
        assert!(err.to_string().contains("cut short"), "{err}");
        assert!(
            err.to_string().contains(&seg.display().to_string()),
            "{err}"
        );
    });
}

/// Only the names the log gives its segments are taken for segments: a
/// stray `5.log` is not segment 5 (whose file would then be missing), and
/// a file in a mark's place too large to be one is refused, not read whole.
#[test]
fn stray_names_are_not_segments_and_huge_marks_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t/n/s/0");
    let root = dir.path().to_path_buf();
    let p2 = path.clone();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let log = open_dma(&p2, LogConfig::default()).await;
        log.append(&[rec(0), rec(1)]).unwrap();
        log.flush().await.unwrap();
        log.close().await.unwrap();
    });
    for stray in ["5.log", "+5.log", "000000000000000000005.log"] {
        std::fs::write(path.join(stray), b"not a segment").unwrap();
    }
    let p3 = path.clone();
    let root = dir.path().to_path_buf();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let log = open_dma(&p3, LogConfig::default()).await;
        assert_eq!(read_all(&log).await.len(), 2);
        log.close().await.unwrap();
    });
    let mark = path.join("tail.mark");
    std::fs::File::create(&mark)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let root = dir.path().to_path_buf();
    run(move || async move {
        warm_up_dma(&root).await.unwrap();
        let err = ShardLog::open(DmaStorage::new(), &path, LogConfig::default(), &mut |_| {})
            .await
            .expect_err("a 64 MiB tail mark was read");
        assert!(err.to_string().contains("too large"), "{err}");
    });
}

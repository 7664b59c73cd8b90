//! [`Storage`] on glommio DMA files: O_DIRECT through io_uring.
//!
//! Data files go through `DmaFile` (aligned buffers, no page cache). Small
//! metadata files and directory operations are rare and off the hot path; they
//! run on glommio's blocking thread pool so the executor never blocks.

use super::{PageBuf, Storage, StorageFile, ALIGN};
use bytes::Bytes;
use glommio::io::{DmaFile, OpenOptions};
use glommio::sync::Semaphore;
use std::cell::Cell;
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Production storage: glommio DMA files.
///
/// One per core. Every data-file I/O (write, read, fdatasync) on the core
/// holds one of `queue_depth` permits while it is in flight, so the core
/// never has more than the configured queue depth of I/Os at the device,
/// however many shards, flushes and cold reads run at once.
#[derive(Clone)]
pub struct DmaStorage {
    depth: Rc<Depth>,
}

/// The core's I/O permits, and how many were held at once (for tests and
/// diagnostics; plain cells, the storage lives on one core).
struct Depth {
    permits: Semaphore,
    in_flight: Cell<usize>,
    high_water: Cell<usize>,
}

/// One I/O in flight: a permit, counted while held.
struct InFlight<'a> {
    _permit: glommio::sync::Permit<'a>,
    depth: &'a Depth,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.depth.in_flight.set(self.depth.in_flight.get() - 1);
    }
}

impl Default for DmaStorage {
    fn default() -> Self {
        Self::new()
    }
}

impl DmaStorage {
    /// A generous depth, for tools and tests.
    pub fn new() -> Self {
        Self::with_queue_depth(64)
    }

    /// At most `depth` data-file I/Os in flight on this core (at least 1).
    pub fn with_queue_depth(depth: usize) -> Self {
        DmaStorage {
            depth: Rc::new(Depth {
                permits: Semaphore::new(depth.max(1) as u64),
                in_flight: Cell::new(0),
                high_water: Cell::new(0),
            }),
        }
    }

    /// The most data-file I/Os (writes, reads, fdatasyncs) that were in
    /// flight at once on this storage so far: never more than the queue
    /// depth.
    pub fn in_flight_high_water(&self) -> usize {
        self.depth.high_water.get()
    }
}

async fn permit(depth: &Depth) -> io::Result<InFlight<'_>> {
    let permit = depth.permits.acquire_permit(1).await.map_err(gio)?;
    let n = depth.in_flight.get() + 1;
    depth.in_flight.set(n);
    depth.high_water.set(depth.high_water.get().max(n));
    Ok(InFlight {
        _permit: permit,
        depth,
    })
}

/// The error as an `io::Error`: the operating system's own (its text and
/// errno, e.g. "No space left on device (os error 28)") where there is one,
/// not glommio's debug rendering of the operation around it.
fn gio<T>(e: glommio::GlommioError<T>) -> io::Error {
    match e {
        glommio::GlommioError::IoError(e)
        | glommio::GlommioError::EnhancedIoError { source: e, .. } => e,
        other => io::Error::other(other.to_string()),
    }
}

async fn blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    glommio::executor().spawn_blocking(f).await
}

impl Storage for DmaStorage {
    type File = DmaStorageFile;

    async fn open(&self, path: &Path, create: bool) -> io::Result<DmaStorageFile> {
        // `DmaFile::create` would open write-only; reads need read + write.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .dma_open(path)
            .await
            .map_err(|e| {
                let e = gio(e);
                io::Error::new(e.kind(), format!("open {}: {e}", path.display()))
            })?;
        // The one statx of this file: from here its size is tracked by
        // the writes, reservations and truncations made through it.
        let size = file.file_size().await.map_err(gio)?;
        Ok(DmaStorageFile {
            file,
            depth: self.depth.clone(),
            size: Cell::new(size),
        })
    }

    async fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let p = path.to_path_buf();
        blocking(move || std::fs::create_dir_all(p)).await
    }

    async fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let p = path.to_path_buf();
        blocking(move || std::fs::File::open(p)?.sync_all()).await
    }

    async fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let p = path.to_path_buf();
        blocking(move || {
            let mut names = Vec::new();
            for entry in std::fs::read_dir(p)? {
                names.push(entry?.file_name().to_string_lossy().into_owned());
            }
            Ok(names)
        })
        .await
    }

    async fn remove_file(&self, path: &Path) -> io::Result<()> {
        let p = path.to_path_buf();
        blocking(move || std::fs::remove_file(p)).await
    }

    async fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        let p = path.to_path_buf();
        blocking(move || std::fs::remove_dir_all(p)).await
    }

    async fn write_file_atomic(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let p = path.to_path_buf();
        let data = data.to_vec();
        blocking(move || write_atomic_blocking(&p, &data)).await
    }

    fn space(&self, path: &Path) -> io::Result<(u64, u64)> {
        super::statvfs(path)
    }

    async fn read_file(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        let p = path.to_path_buf();
        blocking(move || {
            use std::io::Read;
            let f = match std::fs::File::open(&p) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            // Marks and metadata are a few hundred bytes: a larger file in
            // their place is not one (and is not read whole into memory).
            let len = f.metadata()?.len();
            if len > MAX_SMALL_FILE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{} is {len} bytes, too large to be a file the broker writes there",
                        p.display()
                    ),
                ));
            }
            let mut v = Vec::with_capacity(len as usize);
            f.take(MAX_SMALL_FILE).read_to_end(&mut v)?;
            Ok(Some(v))
        })
        .await
    }
}

/// The largest file [`Storage::read_file`] reads (they hold marks and
/// metadata).
const MAX_SMALL_FILE: u64 = 1 << 20;

/// Temporary file, fsync, rename over the target, fsync the directory.
pub(crate) fn write_atomic_blocking(path: &PathBuf, data: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other("metadata path has no parent"))?;
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// One DMA file.
///
/// Its size is kept here rather than asked of the kernel: glommio's
/// `file_size` is a statx *by path* on the blocking-op workers, which would
/// put a worker round trip ahead of every read, and fail (or stat another
/// file) once retention has unlinked the segment while a reader still holds
/// it. The engine opens each segment once, and every change of size goes
/// through this handle.
pub struct DmaStorageFile {
    file: DmaFile,
    depth: Rc<Depth>,
    size: Cell<u64>,
}

impl DmaStorageFile {
    fn grew_to(&self, end: u64) {
        self.size.set(self.size.get().max(end));
    }
}

impl StorageFile for DmaStorageFile {
    async fn write_at(&self, buf: PageBuf, len: usize, pos: u64) -> io::Result<PageBuf> {
        assert!(
            pos.is_multiple_of(ALIGN as u64) && len.is_multiple_of(ALIGN),
            "unaligned DMA write"
        );
        let (dma, parts) = buf.into_dma(len);
        let dma = Rc::new(dma);
        let n = {
            let _io = permit(&self.depth).await?;
            self.file.write_rc_at(dma.clone(), pos).await.map_err(gio)?
        };
        self.grew_to(pos + n as u64);
        if n != len {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("short DMA write: {n} of {len} bytes at {pos}"),
            ));
        }
        // glommio 0.9 drops its reference when the write completes, before
        // `write_rc_at` returns; should a later version keep one, the
        // bytes are copied rather than shared.
        Ok(match Rc::try_unwrap(dma) {
            Ok(dma) => PageBuf::from_written(dma, parts),
            Err(shared) => PageBuf::copy_of_written(&shared, &parts),
        })
    }

    async fn read_at(&self, pos: u64, len: usize) -> io::Result<Bytes> {
        let _io = permit(&self.depth).await?;
        // glommio pads reads past EOF with zeros: clamp to the real size.
        let size = self.size.get();
        if pos >= size {
            return Ok(Bytes::new());
        }
        let len = len.min((size - pos) as usize);
        let res = self.file.read_at(pos, len).await.map_err(gio)?;
        Ok(Bytes::copy_from_slice(&res[..len.min(res.len())]))
    }

    async fn sync(&self) -> io::Result<()> {
        let _io = permit(&self.depth).await?;
        self.file.fdatasync().await.map_err(gio)
    }

    async fn size(&self) -> io::Result<u64> {
        Ok(self.size.get())
    }

    async fn truncate(&self, len: u64) -> io::Result<()> {
        self.file.truncate(len).await.map_err(gio)?;
        self.size.set(len);
        Ok(())
    }

    async fn allocate(&self, len: u64) -> io::Result<()> {
        // Mode 0: the size grows to cover the reservation.
        self.file.pre_allocate(len, false).await.map_err(gio)?;
        self.grew_to(len);
        Ok(())
    }

    async fn close(self) -> io::Result<()> {
        self.file.close().await.map_err(gio)
    }
}

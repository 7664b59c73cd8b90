//! The storage seam: every byte Felix puts on disk or reads back passes through
//! [`Storage`] and [`StorageFile`].
//!
//! Two implementations:
//! * [`dma::DmaStorage`] — glommio DMA files (O_DIRECT, io_uring), with a bounded
//!   number of I/Os in flight per file.
//! * [`sim::SimStorage`] — memory only, for tests: it can lose every write that
//!   was not synced, tear the last write at any byte, flip bits, and fail a
//!   write or an fsync on the Nth call.
//!
//! Writes must start at a multiple of [`ALIGN`] and be a multiple of it long
//! (O_DIRECT rules); the simulator enforces the same so tests catch violations.

pub mod dma;
mod page;
pub mod sim;

pub use page::PageBuf;

use bytes::Bytes;
use std::io;
use std::path::Path;

/// Alignment of positions and lengths of writes (O_DIRECT, 4 KiB pages).
pub const ALIGN: usize = 4096;

#[inline]
pub fn align_down(x: u64) -> u64 {
    x & !(ALIGN as u64 - 1)
}

#[inline]
pub fn align_up(x: u64) -> u64 {
    (x + ALIGN as u64 - 1) & !(ALIGN as u64 - 1)
}

/// A filesystem as the engine sees it.
#[allow(async_fn_in_trait)] // used on one thread only; futures need not be Send
pub trait Storage: Clone + 'static {
    type File: StorageFile;

    /// Open a file for reading and writing, creating it (empty) if asked.
    async fn open(&self, path: &Path, create: bool) -> io::Result<Self::File>;
    /// Create a directory and its parents.
    async fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Make a directory's entries (files created or removed in it) durable.
    async fn sync_dir(&self, path: &Path) -> io::Result<()>;
    /// Names of the entries of a directory (files and directories).
    async fn list_dir(&self, path: &Path) -> io::Result<Vec<String>>;
    async fn remove_file(&self, path: &Path) -> io::Result<()>;
    async fn remove_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Replace a small file atomically and durably (write a temporary, sync,
    /// rename over, sync the directory). For metadata, not for logs. Two
    /// writes of one path must not run at once (the temporary is named
    /// after the path, and blocking operations run on several threads).
    async fn write_file_atomic(&self, path: &Path, data: &[u8]) -> io::Result<()>;
    /// Whole contents of a small file (marks, metadata: a real disk refuses
    /// one over 1 MiB), or `None` if it does not exist.
    async fn read_file(&self, path: &Path) -> io::Result<Option<Vec<u8>>>;
    /// Bytes free (to an unprivileged writer) and in all on the filesystem
    /// holding `path` (a `statvfs`: cheap, and asked rarely).
    fn space(&self, path: &Path) -> io::Result<(u64, u64)>;
}

/// Bytes free (to an unprivileged writer) and in all on the filesystem
/// holding `path`.
pub fn statvfs(path: &Path) -> io::Result<(u64, u64)> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))?;
    // SAFETY: statvfs fills the zeroed struct we own from a NUL-terminated
    // path.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        let unit = st.f_frsize as u64;
        Ok((
            (st.f_bavail as u64).saturating_mul(unit),
            (st.f_blocks as u64).saturating_mul(unit),
        ))
    }
}

/// The free space a broker keeps in hand on a disk of `total` bytes:
/// `configured` (`storage.min_free_bytes`), or when that is 0 the smaller of
/// 256 MiB and 5 % of the disk. Publishes are refused below it, and the log
/// reserves blocks ahead of its writes only well above it.
pub fn free_space_floor(configured: u64, total: u64) -> u64 {
    const AUTO_BYTES: u64 = 256 << 20;
    const AUTO_PERCENT: u64 = 5;
    if configured > 0 {
        configured
    } else {
        AUTO_BYTES.min(total / 100 * AUTO_PERCENT)
    }
}

/// One open file. Appends are the log's job; the file only does aligned I/O.
#[allow(async_fn_in_trait)]
pub trait StorageFile: 'static {
    /// Write the first `len` bytes of `buf` at `pos` (both multiples of
    /// [`ALIGN`], `len` at most what `buf` holds) and give the buffer back,
    /// its bytes unchanged: the log keeps what it wrote as its tail cache.
    async fn write_at(&self, buf: PageBuf, len: usize, pos: u64) -> io::Result<PageBuf>;
    /// Read up to `len` bytes at `pos`; fewer only at the end of the file.
    async fn read_at(&self, pos: u64, len: usize) -> io::Result<Bytes>;
    /// fdatasync: everything written so far is durable when this returns Ok.
    async fn sync(&self) -> io::Result<()>;
    /// The file's size in bytes.
    async fn size(&self) -> io::Result<u64>;
    /// Cut (or extend with zeros) the file to `len` bytes.
    async fn truncate(&self, len: u64) -> io::Result<()>;
    /// Reserve disk blocks for the file up to `len` bytes (the file reads as
    /// zeros past its data). Lets later writes land without growing the
    /// file, which makes each `fdatasync` cheaper. Best effort.
    async fn allocate(&self, len: u64) -> io::Result<()>;
    async fn close(self) -> io::Result<()>;
}

//! [`PageBuf`]: the memory a flush writes to disk and the read cache then
//! keeps, without a copy between the two.
//!
//! A batch is encoded straight into a page-aligned buffer that O_DIRECT can
//! write; once written, the same buffer becomes [`Bytes`] that the tail
//! cache hands to readers. Before, batches were encoded into a `Vec` and
//! copied into aligned buffers for the write: with 64 KiB batches that copy
//! was the broker core's largest single cost (15 % of its time, more than
//! encoding the records).

use super::{align_up, ALIGN};
use bytes::Bytes;
use glommio::io::DmaBuffer;
use std::mem::MaybeUninit;

/// A page-aligned heap buffer that fills front to back.
///
/// `len` bytes at the front are filled; the rest of the capacity is not
/// initialised and is never read. It can be written to a file (the storage
/// takes it and gives it back) and then turned into [`Bytes`].
pub struct PageBuf {
    /// Always from `glommio::allocate_dma_buffer_global`: a plain aligned
    /// heap allocation (never the executor's registered I/O memory). It is
    /// only reached through `ptr`, within `cap`.
    buf: DmaBuffer,
    ptr: *mut u8,
    cap: usize,
    len: usize,
    /// The most bytes a write may take from the front: the capacity, until
    /// a write of fewer bytes trims glommio's buffer to what it wrote
    /// (glommio cannot grow it back).
    writable: usize,
}

// SAFETY: the buffer is a global heap allocation owned by this value alone
// (`allocate_dma_buffer_global` never hands out the executor's registered
// memory, which is tied to its thread); glommio's `DmaBuffer` is `!Send`
// only because it can also hold such registered memory. Shared references
// only read the filled bytes.
unsafe impl Send for PageBuf {}
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// An empty buffer with room for at least `cap` bytes (rounded up to
    /// whole pages, at least one).
    pub fn with_capacity(cap: usize) -> PageBuf {
        let cap = align_up(cap.max(1) as u64) as usize;
        let mut buf = glommio::allocate_dma_buffer_global(cap);
        let ptr = buf.as_mut_ptr();
        PageBuf {
            buf,
            ptr,
            cap,
            len: 0,
            writable: cap,
        }
    }

    /// `len` zero bytes (`len` a multiple of [`ALIGN`]).
    pub fn zeroed(len: usize) -> PageBuf {
        let mut b = PageBuf::with_capacity(len);
        b.fill(len, 0);
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The most bytes a write can take from this buffer (see
    /// [`PageBuf::into_dma`]).
    pub fn writable(&self) -> usize {
        self.writable.min(self.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Bytes that can still be filled.
    pub fn room(&self) -> usize {
        self.cap - self.len
    }

    /// The filled bytes.
    pub fn filled(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `cap` bytes and the first `len` are
        // initialised.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The filled bytes, to change in place.
    pub fn filled_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `filled`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Append `b`. Panics past the capacity.
    pub fn extend_from_slice(&mut self, b: &[u8]) {
        assert!(b.len() <= self.room(), "PageBuf overflow");
        // SAFETY: the destination is inside the allocation (checked above)
        // and cannot overlap `b`, which `&mut self` rules out borrowing
        // from this buffer.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.ptr.add(self.len), b.len()) };
        self.len += b.len();
    }

    /// Append `n` copies of `byte`. Panics past the capacity.
    pub fn fill(&mut self, n: usize, byte: u8) {
        assert!(n <= self.room(), "PageBuf overflow");
        // SAFETY: inside the allocation (checked above).
        unsafe { std::ptr::write_bytes(self.ptr.add(self.len), byte, n) };
        self.len += n;
    }

    /// Append `n` bytes that `f` writes.
    ///
    /// # Safety
    /// `f` must write every one of the `n` bytes it is given before it
    /// returns (they start out uninitialised, and count as filled after).
    /// If `f` panics, nothing is appended. Panics past the capacity.
    pub unsafe fn append_with<R>(
        &mut self,
        n: usize,
        f: impl FnOnce(&mut [MaybeUninit<u8>]) -> R,
    ) -> R {
        assert!(n <= self.room(), "PageBuf overflow");
        // SAFETY: inside the allocation (checked above) and not otherwise
        // borrowed (`&mut self`); `MaybeUninit` asks nothing of the bytes.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(self.len).cast::<MaybeUninit<u8>>(), n)
        };
        let r = f(dst);
        self.len += n;
        r
    }

    /// Zero-fill up to the next page boundary.
    pub fn pad_to_page(&mut self) {
        let to = align_up(self.len as u64) as usize;
        self.fill(to - self.len, 0);
    }

    /// The glommio buffer to write the first `len` bytes from (`len` a
    /// multiple of [`ALIGN`], at most [`PageBuf::writable`]), and what
    /// [`PageBuf::from_written`] needs to rebuild this value after. Once
    /// written, at most `len` bytes of it can be written again.
    pub(crate) fn into_dma(self, len: usize) -> (DmaBuffer, Parts) {
        assert!(
            len.is_multiple_of(ALIGN) && len <= self.writable() && len > 0,
            "a write of {len} bytes from a buffer of {} ({} writable)",
            self.len,
            self.writable
        );
        let PageBuf {
            mut buf,
            ptr,
            cap,
            len: filled,
            writable: _,
        } = self;
        buf.trim_to_size(len);
        (
            buf,
            Parts {
                ptr,
                cap,
                filled,
                written: len,
            },
        )
    }

    /// Undo [`PageBuf::into_dma`] once the write is done.
    pub(crate) fn from_written(buf: DmaBuffer, parts: Parts) -> PageBuf {
        assert_eq!(
            buf.as_ptr(),
            parts.ptr.cast_const(),
            "not the buffer written"
        );
        PageBuf {
            buf,
            ptr: parts.ptr,
            cap: parts.cap,
            len: parts.filled,
            writable: parts.written,
        }
    }

    /// A copy of what [`PageBuf::into_dma`] handed out, for when the
    /// buffer cannot be taken back whole (something still shares it).
    pub(crate) fn copy_of_written(buf: &DmaBuffer, parts: &Parts) -> PageBuf {
        assert_eq!(
            buf.as_ptr(),
            parts.ptr.cast_const(),
            "not the buffer written"
        );
        // SAFETY: `buf` keeps the allocation alive; its first `filled`
        // bytes were initialised before it was handed out and are only read.
        let bytes = unsafe { std::slice::from_raw_parts(parts.ptr.cast_const(), parts.filled) };
        let mut copy = PageBuf::with_capacity(parts.cap);
        copy.extend_from_slice(bytes);
        copy
    }

    /// What a write of `len` bytes from this buffer leaves of it, for
    /// storage that does not go through [`PageBuf::into_dma`] (the
    /// simulation), so that it refuses what the real one would.
    pub(crate) fn written(mut self, len: usize) -> PageBuf {
        assert!(len <= self.writable(), "a write past what is writable");
        self.writable = len;
        self
    }

    /// The filled bytes as shared memory, without a copy.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

/// What [`PageBuf::into_dma`] keeps aside while glommio holds the buffer.
pub(crate) struct Parts {
    ptr: *mut u8,
    cap: usize,
    filled: usize,
    /// Bytes handed to the write (glommio's buffer is trimmed to them).
    written: usize,
}

impl AsRef<[u8]> for PageBuf {
    fn as_ref(&self) -> &[u8] {
        self.filled()
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_front_to_back_and_becomes_bytes_without_a_copy() {
        let mut b = PageBuf::with_capacity(10);
        assert_eq!(b.capacity(), ALIGN);
        assert_eq!(b.as_ref().as_ptr() as usize % ALIGN, 0);
        b.extend_from_slice(b"abc");
        // SAFETY: the closure writes all four bytes.
        let n = unsafe {
            b.append_with(4, |dst| {
                for (d, s) in dst.iter_mut().zip(b"defg") {
                    d.write(*s);
                }
                dst.len()
            })
        };
        assert_eq!(n, 4);
        b.filled_mut()[0] = b'A';
        assert_eq!(b.filled(), b"Abcdefg");
        assert_eq!(b.room(), ALIGN - 7);
        b.pad_to_page();
        assert_eq!(b.len(), ALIGN);
        assert!(b.filled()[7..].iter().all(|&x| x == 0));
        let at = b.filled().as_ptr();
        let bytes = b.into_bytes();
        assert_eq!(bytes.as_ptr(), at);
        assert_eq!(&bytes[..7], b"Abcdefg");
        // Shared across threads, as `Bytes` may be.
        let other = std::thread::spawn(move || bytes.slice(1..3))
            .join()
            .unwrap();
        assert_eq!(&other[..], b"bc");
    }

    #[test]
    #[should_panic(expected = "PageBuf overflow")]
    fn filling_past_the_capacity_panics() {
        let mut b = PageBuf::with_capacity(ALIGN);
        b.fill(ALIGN, 1);
        b.extend_from_slice(b"x");
    }

    #[test]
    fn a_written_buffer_comes_back_whole() {
        let mut b = PageBuf::with_capacity(3 * ALIGN);
        b.fill(2 * ALIGN + 5, 7);
        let (dma, parts) = b.into_dma(2 * ALIGN);
        assert_eq!(dma.len(), 2 * ALIGN);
        let copy = PageBuf::copy_of_written(&dma, &parts);
        let b = PageBuf::from_written(dma, parts);
        assert_eq!(b.len(), 2 * ALIGN + 5);
        assert_eq!(copy.filled(), b.filled());
        assert_eq!(copy.capacity(), b.capacity());
        assert_eq!(b.capacity(), 3 * ALIGN);
        assert!(b.filled().iter().all(|&x| x == 7));
        // glommio trimmed its buffer to what was written: the same bytes
        // can be written again, no more.
        assert_eq!(b.writable(), 2 * ALIGN);
        let (dma, parts) = b.into_dma(ALIGN);
        let b = PageBuf::from_written(dma, parts);
        assert_eq!(b.writable(), ALIGN);
        assert_eq!(PageBuf::zeroed(ALIGN).written(ALIGN).writable(), ALIGN);
    }

    #[test]
    #[should_panic(expected = "a write of 8192 bytes from a buffer of 8192 (4096 writable)")]
    fn writing_more_than_a_written_buffer_kept_panics() {
        let b = PageBuf::zeroed(2 * ALIGN);
        let (dma, parts) = b.into_dma(ALIGN);
        let b = PageBuf::from_written(dma, parts);
        let _ = b.into_dma(2 * ALIGN);
    }
}

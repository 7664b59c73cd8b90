//! Free space on the data disk, watched so that publishes are refused with a
//! clear error before the disk fills, instead of a write failing with
//! `ENOSPC` and stopping the shard.
//!
//! Each core keeps its own view (no shared state on the publish path): a
//! `statvfs` of the data directory every [`REFRESH`], minus what the core
//! admitted since, times the number of cores (the others write to the same
//! disk at a similar rate). This is a guard, not a guarantee: other writers,
//! or cores writing far more than their share, can still fill the disk
//! between two looks, and then the write error stops the shard as before
//! (nothing acknowledged is lost).

use std::cell::Cell;
use std::ffi::CString;
use std::path::Path;
use std::time::Duration;

/// How often each core looks at the disk.
pub(crate) const REFRESH: Duration = Duration::from_millis(100);

/// The automatic reserve: the smaller of this and [`AUTO_RESERVE_PERCENT`]
/// of the filesystem.
const AUTO_RESERVE_BYTES: u64 = 256 << 20;
const AUTO_RESERVE_PERCENT: u64 = 5;

pub(crate) struct DiskGuard {
    dir: Option<CString>,
    configured: u64,
    cores: u64,
    /// Free bytes at the last look (`u64::MAX` until the first).
    free: Cell<u64>,
    reserve: Cell<u64>,
    /// Bytes of publishes this core admitted since the last look.
    since: Cell<u64>,
    low: Cell<bool>,
    /// The last look failed (said once, not every 100 ms).
    unreadable: Cell<bool>,
}

impl DiskGuard {
    /// `dir` is the data directory (`None` in memory: never low).
    pub fn new(dir: Option<&Path>, configured: u64, cores: u32) -> DiskGuard {
        DiskGuard {
            dir: dir.and_then(|d| CString::new(d.as_os_str().as_encoded_bytes()).ok()),
            configured,
            cores: u64::from(cores.max(1)),
            free: Cell::new(u64::MAX),
            reserve: Cell::new(0),
            since: Cell::new(0),
            low: Cell::new(false),
            unreadable: Cell::new(false),
        }
    }

    /// Look at the disk again. Returns `Some(true)` when it just became
    /// low, `Some(false)` when it just recovered, `None` otherwise.
    pub fn refresh(&self) -> Option<bool> {
        let dir = self.dir.as_ref()?;
        let (avail, total) = match statvfs(dir) {
            Ok(v) => v,
            Err(e) => {
                if !self.unreadable.replace(true) {
                    tracing::warn!(
                        "cannot read the data disk's free space: {e} (said once until it reads again)"
                    );
                }
                return None;
            }
        };
        if self.unreadable.replace(false) {
            tracing::info!("the data disk's free space reads again");
        }
        let reserve = if self.configured > 0 {
            self.configured
        } else {
            AUTO_RESERVE_BYTES.min(total / 100 * AUTO_RESERVE_PERCENT)
        };
        self.free.set(avail);
        self.reserve.set(reserve);
        self.since.set(0);
        let low = avail < reserve;
        (low != self.low.replace(low)).then_some(low)
    }

    /// Admit a publish of about `incoming` bytes, counting them as spent
    /// at once (they are not yet in `free`): publishes admitted together,
    /// before any is appended, then add up against the reserve instead of
    /// each finding the same free space. One refused or failed after this
    /// is over-counted until the next look, which is the safe side.
    pub fn admit(&self, incoming: u64) -> Result<(), String> {
        self.check(incoming)?;
        self.since.set(self.since.get().saturating_add(incoming));
        Ok(())
    }

    /// Whether a publish of about `incoming` bytes may go ahead.
    pub fn check(&self, incoming: u64) -> Result<(), String> {
        if self.dir.is_none() {
            return Ok(());
        }
        let spent = self
            .since
            .get()
            .saturating_mul(self.cores)
            .saturating_add(incoming);
        let left = self.free.get().saturating_sub(spent);
        let reserve = self.reserve.get();
        if left >= reserve {
            return Ok(());
        }
        Err(format!(
            "the data disk is nearly full: about {} free, and the broker keeps {} free \
             (storage.min_free_bytes); publishes resume once space is freed \
             (retention, deleting streams, or other files on that disk)",
            human(left),
            human(reserve)
        ))
    }
}

fn human(b: u64) -> String {
    const MIB: u64 = 1 << 20;
    if b >= 10 * MIB {
        format!("{} MiB", b / MIB)
    } else {
        format!("{} KiB", b.div_ceil(1024))
    }
}

/// Bytes available to this process and the filesystem's size.
fn statvfs(dir: &CString) -> std::io::Result<(u64, u64)> {
    // SAFETY: statvfs fills the zeroed struct we own from a NUL-terminated
    // path.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(dir.as_ptr(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let unit = st.f_frsize as u64;
        Ok((
            (st.f_bavail as u64).saturating_mul(unit),
            (st.f_blocks as u64).saturating_mul(unit),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guard_refuses_below_its_reserve_and_counts_what_it_admitted() {
        let dir = std::env::temp_dir();
        let g = DiskGuard::new(Some(&dir), 1, 2);
        assert!(g.check(1 << 20).is_ok(), "before the first look");
        g.refresh();
        let free = g.free.get();
        assert!(g.check(0).is_ok());
        // Admitted publishes count once per core, from when they are
        // admitted: the second of two admitted together is refused.
        g.admit(free / 3).expect("a third of the free space");
        let err = g
            .admit(free / 3 + 1)
            .expect_err("two cores × a third, and a third more");
        assert!(err.contains("nearly full"), "{err}");
        // The refused one is not counted; a smaller one still fits.
        g.admit(free / 8).expect("an eighth more");
        g.refresh();
        assert!(g.check(0).is_ok(), "a fresh look forgets the estimate");
        // A reserve larger than the disk is always low.
        let g = DiskGuard::new(Some(&dir), u64::MAX, 1);
        assert_eq!(g.refresh(), Some(true));
        assert!(g.check(0).is_err());
        assert_eq!(g.refresh(), None, "no change, no transition");
        // In memory: never low.
        let g = DiskGuard::new(None, u64::MAX, 1);
        assert_eq!(g.refresh(), None);
        assert!(g.check(u64::MAX).is_ok());
    }
}

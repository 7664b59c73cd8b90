//! Free space on the data disk, watched so that publishes are refused with a
//! clear error before the disk fills, instead of a write failing with
//! `ENOSPC` and stopping the shard.
//!
//! Each core keeps its own view (no shared state on the publish path): a
//! `statvfs` of the data directory every [`REFRESH`], minus the publishes
//! the core is serving and those it finished since the look, times the
//! number of cores (the others write to the same disk at a similar rate). This is a guard, not a guarantee: other writers,
//! or cores writing far more than their share, can still fill the disk
//! between two looks, and then the write error stops the shard as before
//! (nothing acknowledged is lost).

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How often each core looks at the disk.
pub(crate) const REFRESH: Duration = Duration::from_millis(100);

pub(crate) struct DiskGuard {
    dir: Option<PathBuf>,
    configured: u64,
    cores: u64,
    /// Free bytes at the last look (`u64::MAX` until the first).
    free: Cell<u64>,
    reserve: Cell<u64>,
    /// Bytes of publishes this core admitted that are still being served
    /// (waiting for room, queued, being written): not on the disk yet,
    /// whenever the last look was.
    pending: Cell<u64>,
    /// Bytes of publishes this core finished since the last look: on the
    /// disk by the next look when acknowledged once durable (the default);
    /// acknowledged once queued (`storage.ack_on_commit = false`), up to a
    /// shard's `max_queued_bytes` may still be on their way then, which the
    /// reserve has to cover.
    since: Cell<u64>,
    low: Cell<bool>,
    /// The last look failed (said once, not every 100 ms).
    unreadable: Cell<bool>,
    /// A reserve of the whole disk was warned about.
    said_too_big: Cell<bool>,
}

impl DiskGuard {
    /// `dir` is the data directory (`None` in memory: never low).
    pub fn new(dir: Option<&Path>, configured: u64, cores: u32) -> DiskGuard {
        DiskGuard {
            dir: dir.map(Path::to_path_buf),
            configured,
            cores: u64::from(cores.max(1)),
            free: Cell::new(u64::MAX),
            reserve: Cell::new(0),
            pending: Cell::new(0),
            since: Cell::new(0),
            low: Cell::new(false),
            unreadable: Cell::new(false),
            said_too_big: Cell::new(false),
        }
    }

    /// Look at the disk again. Returns `Some(true)` when it just became
    /// low, `Some(false)` when it just recovered, `None` otherwise.
    pub fn refresh(&self) -> Option<bool> {
        let dir = self.dir.as_ref()?;
        let (avail, total) = match felix_engine::storage::statvfs(dir) {
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
        self.looked(avail, total)
    }

    /// Take in a look at the disk: `avail` bytes free of `total`.
    fn looked(&self, avail: u64, total: u64) -> Option<bool> {
        let reserve = felix_engine::storage::free_space_floor(self.configured, total);
        if reserve >= total && total > 0 && !self.said_too_big.replace(true) {
            tracing::warn!(
                "storage.min_free_bytes ({} MiB) is at least the whole data disk ({} MiB): \
                 every publish will be refused as the disk being nearly full",
                reserve >> 20,
                total >> 20
            );
        }
        self.free.set(avail);
        self.reserve.set(reserve);
        self.since.set(0);
        let low = avail < reserve;
        (low != self.low.replace(low)).then_some(low)
    }

    /// Admit a publish of about `incoming` bytes, counting them as spent
    /// from now until the answer (the [`Admitted`] is dropped), and then
    /// until the next look: publishes admitted together, or waiting
    /// together for room in a shard's queue, add up against the reserve
    /// instead of each finding the same free space. One refused or failed
    /// after this is over-counted until the next look, the safe side.
    pub fn admit(&self, incoming: u64) -> Result<Admitted<'_>, String> {
        self.check(incoming)?;
        self.pending
            .set(self.pending.get().saturating_add(incoming));
        Ok(Admitted {
            guard: self,
            bytes: incoming,
        })
    }

    /// Whether a publish of about `incoming` bytes may go ahead.
    pub fn check(&self, incoming: u64) -> Result<(), String> {
        if self.dir.is_none() {
            return Ok(());
        }
        let spent = self
            .since
            .get()
            .saturating_add(self.pending.get())
            .saturating_mul(self.cores)
            .saturating_add(incoming);
        let left = self.free.get().saturating_sub(spent);
        let reserve = self.reserve.get();
        if left >= reserve {
            return Ok(());
        }
        Err(format!(
            "the data disk is nearly full: about {} free, counting publishes being written, \
             and the broker keeps {} free \
             (storage.min_free_bytes); publishes resume once space is freed \
             (retention, deleting streams, or other files on that disk)",
            human(left),
            human(reserve)
        ))
    }
}

/// A publish let through, counted as spent while it is served.
#[must_use]
pub(crate) struct Admitted<'a> {
    guard: &'a DiskGuard,
    bytes: u64,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let g = self.guard;
        g.pending.set(g.pending.get().saturating_sub(self.bytes));
        g.since.set(g.since.get().saturating_add(self.bytes));
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
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guard_refuses_below_its_reserve_and_counts_what_it_admitted() {
        let dir = std::env::temp_dir();
        let g = DiskGuard::new(Some(&dir), 1_000, 2);
        assert!(g.check(1 << 20).is_ok(), "before the first look");
        // Looks taken by hand: the real disk's free space moves under a
        // test.
        g.looked(301_000, 10_000_000);
        assert!(g.check(0).is_ok());
        // Admitted publishes count once per core from when they are
        // admitted: of two together, the second is refused.
        let first = g.admit(100_000).expect("2 × 100,000 leaves 101,000");
        let err = g.admit(100_001).err().expect("2 × 100,000 + 100,001");
        assert!(err.contains("nearly full"), "{err}");
        // The refused one is not counted; a smaller one still fits.
        let second = g.admit(40_000).expect("2 × 140,000 leaves 21,000");
        // Still counted after a look while being served (not on the disk
        // yet), and after being served until the next look.
        g.looked(301_000, 10_000_000);
        assert!(g.check(20_001).is_err(), "pending across a look");
        assert!(g.check(20_000).is_ok());
        drop((first, second));
        assert!(g.check(20_001).is_err(), "finished, until the next look");
        g.looked(21_000, 10_000_000);
        assert!(g.check(20_000).is_ok(), "a fresh look counts only itself");
        assert!(g.check(20_001).is_err());
        // The real disk can be looked at.
        assert!(g.refresh().is_some() || g.free.get() != 21_000);
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

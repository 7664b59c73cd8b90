//! Open files: the process limit, raised at start, and the headroom kept for
//! storage.
//!
//! Segment files and sockets draw on the same limit (`RLIMIT_NOFILE`). A
//! client must not be able to take the last descriptors with connections
//! (idle ones, or ones that never say HELLO), or the next segment a shard
//! rolls to cannot be opened and the shard stops. So a connection is refused
//! (`busy`) once open files come within [`reserve`] of the limit, which
//! leaves that many for the shards.
//!
//! The test is cheap and needs no count of open files: Linux hands out the
//! lowest free descriptor, so every number below a new socket's is in use,
//! and a socket numbered at or above `limit - reserve` means at least that
//! many files are open.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The soft limit on open files once [`raise_limit`] ran (or as found).
static LIMIT: OnceLock<u64> = OnceLock::new();

/// The process's limit on open files, if it can be read.
fn current() -> Option<libc::rlimit> {
    // SAFETY: getrlimit on a struct we own.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        (libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0).then_some(lim)
    }
}

/// Raise the soft limit on open files to the hard limit (as the operator
/// allows), remember it, and say what it is, so running out is a
/// configuration the operator can see rather than a surprise.
pub(crate) fn raise_limit() {
    let Some(mut lim) = current() else {
        return;
    };
    if lim.rlim_cur < lim.rlim_max {
        let want = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit with a struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    let limit = lim.rlim_cur;
    let _ = LIMIT.set(limit);
    let kept = reserve(limit);
    if limit < 4096 {
        tracing::warn!(
            limit,
            kept_for_storage = kept,
            "the open-file limit is low: each segment file and each connection \
             takes one; raise it (ulimit -n, LimitNOFILE=) for many shards or clients"
        );
    } else {
        tracing::info!(limit, kept_for_storage = kept, "open-file limit");
    }
}

/// The soft limit on open files.
pub(crate) fn limit() -> u64 {
    *LIMIT.get_or_init(|| current().map_or(u64::MAX, |lim| lim.rlim_cur))
}

/// Descriptors kept for storage below `limit`: a sixteenth of it, at least
/// 64 and at most 16,384.
pub(crate) fn reserve(limit: u64) -> u64 {
    (limit / 16).clamp(64, 16_384)
}

/// Whether `fd`, a socket just accepted, says open files are within the
/// reserve of the limit (see the module's notes).
pub(crate) fn near_limit(fd: RawFd) -> bool {
    let limit = limit();
    u64::try_from(fd).is_ok_and(|fd| fd.saturating_add(reserve(limit)) >= limit)
}

/// Files open in this process (the entries of `/proc/self/fd`); `None` if
/// that cannot be read. Linux 6.2 and later give the count as the
/// directory's size (a `stat`, tens of microseconds); older kernels give 0
/// there, and the entries are listed instead (about a microsecond each:
/// milliseconds with thousands of connections).
pub(crate) fn open_count() -> Option<u64> {
    match std::fs::metadata("/proc/self/fd").map(|m| m.len()) {
        Ok(n) if n > 0 => Some(n),
        _ => std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64),
    }
}

/// Files a new shard opens: its first segment, and room for its replica's
/// journal in a cluster.
pub(crate) const FILES_PER_NEW_SHARD: u64 = 2;

/// Files promised to creates still opening their shards, all cores
/// together: not yet in `/proc/self/fd`, so counted here, or two creates at
/// once would each find the same descriptors free.
static PROMISED: AtomicU64 = AtomicU64::new(0);

/// Files set aside for a create until it has opened its shards.
#[must_use]
pub(crate) struct Promise(u64);

impl Drop for Promise {
    fn drop(&mut self) {
        PROMISED.fetch_sub(self.0, Ordering::Relaxed);
    }
}

/// Set aside the files `shards` new shards open, or say why they would not
/// leave the storage reserve free.
pub(crate) fn promise_for_shards(shards: u32) -> Result<Promise, String> {
    let need = u64::from(shards) * FILES_PER_NEW_SHARD;
    // Promised first, so a create counting at the same time sees it.
    let before = PROMISED.fetch_add(need, Ordering::Relaxed);
    let promise = Promise(need);
    let Some(open) = open_count() else {
        return Ok(promise);
    };
    let limit = limit();
    let kept = reserve(limit);
    if open
        .saturating_add(before)
        .saturating_add(need)
        .saturating_add(kept)
        <= limit
    {
        return Ok(promise);
    }
    Err(format!(
        "the broker is short of open files: {open} of its limit of {limit} are open, \
         {before} more are promised to streams being created, {shards} new shards \
         need about {need} more, and {kept} are kept free for the segments existing \
         shards roll to; raise the open-file limit (ulimit -n, LimitNOFILE=) or \
         delete streams"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_a_sixteenth_within_bounds() {
        assert_eq!(reserve(1024), 64);
        assert_eq!(reserve(20_000), 1_250);
        assert_eq!(reserve(1 << 20), 16_384);
        assert_eq!(reserve(u64::MAX), 16_384);
    }

    /// The tests that promise files, one at a time (promises are global).
    static PROMISING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn open_files_are_counted() {
        let _one = PROMISING.lock().unwrap();
        // Other tests' threads open files too: only a floor is certain.
        let _f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(open_count().unwrap() >= 4);
        assert!(promise_for_shards(0).is_ok() || limit() < 128);
        assert!(promise_for_shards(u32::MAX).is_err());
    }

    #[test]
    fn a_promise_holds_its_files_until_dropped() {
        let _one = PROMISING.lock().unwrap();
        let limit = limit();
        if limit > 1 << 30 {
            return; // no limit to run into
        }
        let kept = reserve(limit);
        let open = open_count().unwrap();
        // Just under what is left: one promise fits, a second does not, and
        // once the first is dropped a second fits again. (Other tests open
        // files too, so leave them some slack.)
        let room = limit.saturating_sub(open + kept + 64);
        let shards = (room / FILES_PER_NEW_SHARD / 2 + 64) as u32;
        let first = promise_for_shards(shards).expect("first");
        let err = promise_for_shards(shards)
            .err()
            .expect("second, with the first held");
        assert!(err.contains("promised"), "{err}");
        drop(first);
        let _again = promise_for_shards(shards).expect("after the first was dropped");
    }

    #[test]
    fn low_descriptors_are_not_near_the_limit() {
        assert!(!near_limit(3));
        let limit = limit();
        if let Ok(high) = RawFd::try_from(limit.saturating_sub(1)) {
            assert!(near_limit(high));
        }
    }
}

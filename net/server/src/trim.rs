//! Giving freed memory back to the kernel after a burst.
//!
//! The broker keeps glibc from returning freed memory at once
//! (`crate::tune_allocator`: frames up to 32 MiB come from the heap, and up
//! to 256 MiB of free top is kept per heap), which saves page faults while
//! it is busy. But a burst (many connections' large frames, or floods of
//! reads) can leave the heaps fragmented: free memory in their middle, which
//! glibc never trims, so the process stays at its peak (gigabytes) long
//! after the burst.
//!
//! A thread watches what the cores' connections hold (each core shares its
//! buffered bytes once a second). After they held at least [`BURST`] and
//! then little (see [`QUIET_BYTES`]) for [`QUIET`], it calls
//! `malloc_trim(0)`, which gives the free pages of every heap back. Only
//! then, once per burst: the trim takes each heap's lock while it walks
//! it, and a core that allocates meanwhile waits (a trim that took over
//! 5 ms is logged). Not at all when `GLIBC_TUNABLES` sets malloc tunables:
//! the operator's choice stands.
//!
//! `malloc_trim` alone sometimes misses most of a burst (in about one run
//! in six of the backpressure test, 50 – 90 MiB stayed). Each core's thread allocates from an arena of its own, and glibc
//! trims the free *top* of such an arena (the free memory at its end, where
//! everything freed after a burst merges when nothing live sits above it)
//! only when a free leaves more than the trim threshold there, never in
//! `malloc_trim`. The broker keeps that threshold at 256 MiB, more than
//! a thread's heap holds (64 MiB), so that top would stay for good. So the
//! trim lowers the threshold for a moment and asks every core to free a
//! block of its own (a [`Handshake`]): that free gives its arena's top back.

use crate::broker::Shared;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Held by the connections together, this much makes the next quiet spell
/// worth a trim (a 32 MiB budget's worth of unread answers did not always
/// reach 64 MiB between two samples; 16 MiB is a few large frames).
const BURST: u64 = 16 << 20;
/// At most this much held counts as quiet, or an eighth of the burst's
/// peak if more (parked long polls hold a few KiB each for as long as they
/// wait: a few hundred consumers must not keep the trim away for good).
const QUIET_BYTES: u64 = 1 << 20;
/// How long it must stay quiet.
const QUIET: Duration = Duration::from_secs(3);
/// The trim threshold while the cores answer a trim: a free that leaves
/// more than this at the top of its arena gives it back (keeping glibc's
/// top pad, 128 KiB).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIMMING_THRESHOLD: libc::c_int = 1 << 20;
/// How long a trim waits for the cores to answer (they look once a second;
/// a core that does not answer in time, busy again, is left out).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const ANSWER_WITHIN: Duration = Duration::from_millis(2500);
/// Freed by a core answering a trim: above glibc's 64 KiB, the size from
/// which a free looks at its arena's top.
const PROBE_BYTES: usize = 256 << 10;

/// The trimmer asks, the cores answer: each with a free of its own while
/// the trim threshold is low (see the module docs).
pub struct Handshake {
    /// The last trim asked for (0: none yet).
    asked: AtomicU64,
    /// The last trim each core answered.
    answered: Vec<AtomicU64>,
}

impl Handshake {
    pub fn new(cores: usize) -> Self {
        Handshake {
            asked: AtomicU64::new(0),
            answered: (0..cores).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Called by core `core` on its thread once a second: answer the trim
    /// asked for, if any, by freeing a block of this thread's arena.
    pub fn answer(&self, core: usize) {
        let asked = self.asked.load(Ordering::Acquire);
        let Some(mine) = self.answered.get(core) else {
            return;
        };
        if mine.load(Ordering::Relaxed) == asked {
            return;
        }
        // A free of at least 64 KiB makes glibc look at the top of the
        // arena it came from, and give back what is over the threshold.
        let probe: Vec<u8> = Vec::with_capacity(PROBE_BYTES);
        drop(std::hint::black_box(probe));
        mine.store(asked, Ordering::Release);
    }

    /// Ask the cores for trim number `n`.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn ask(&self, n: u64) {
        self.asked.store(n, Ordering::Release);
    }

    /// Whether every core answered trim `n`.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn answered(&self, n: u64) -> bool {
        self.answered.iter().all(|a| a.load(Ordering::Acquire) == n)
    }
}

pub(crate) fn start(shared: Arc<Shared>) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // Malloc tuned by the operator: left as they set it.
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("malloc.")) {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("felix-trim".into())
            .spawn(move || watch(&shared));
        if let Err(e) = spawned {
            tracing::warn!("cannot start the allocator trimmer: {e}");
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = shared;
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn watch(shared: &Shared) {
    // The most held since the last trim.
    let mut peak = 0u64;
    let mut quiet_since: Option<std::time::Instant> = None;
    let mut trims = 0u64;
    while !shared.shutting_down.load(Ordering::Relaxed) {
        // A thread of its own, not an executor: parking it blocks nothing.
        std::thread::park_timeout(Duration::from_secs(1));
        let held: u64 = shared
            .buffered
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .sum();
        peak = peak.max(held);
        if held > QUIET_BYTES.max(peak / 8) {
            quiet_since = None;
            continue;
        }
        let since = *quiet_since.get_or_insert_with(std::time::Instant::now);
        if peak >= BURST && since.elapsed() >= QUIET {
            trims += 1;
            // The cores' arenas' tops: a free on each while the threshold
            // is low (see the module docs).
            // SAFETY: mallopt only changes malloc's parameters (under the
            // main arena's lock; other threads read the threshold without
            // it, one word, as glibc's own free does when it moves it), and
            // the value is in range.
            unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, TRIMMING_THRESHOLD) };
            shared.trim.ask(trims);
            let asked = std::time::Instant::now();
            while !shared.trim.answered(trims)
                && asked.elapsed() < ANSWER_WITHIN
                && !shared.shutting_down.load(Ordering::Relaxed)
            {
                std::thread::park_timeout(Duration::from_millis(50));
            }
            let waited = asked.elapsed();
            // The free pages inside every heap, and the main heap's top.
            let t = std::time::Instant::now();
            // SAFETY: malloc_trim only returns free memory to the kernel.
            let gave = unsafe { libc::malloc_trim(0) };
            let took = t.elapsed();
            // SAFETY: as above; the value `tune_allocator` set.
            unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, crate::KEEP_FREE_TOP) };
            if !shared.trim.answered(trims) {
                tracing::debug!(
                    waited_ms = waited.as_millis() as u64,
                    "a core did not answer the allocator trim (busy again)"
                );
            }
            // A core that allocates meanwhile waits for its heap's walk.
            if took > Duration::from_millis(5) {
                tracing::info!(
                    took_ms = took.as_millis() as u64,
                    "trimming the allocator's heaps after a burst took a while"
                );
            } else {
                tracing::debug!(
                    took_us = took.as_micros() as u64,
                    gave_back = gave != 0,
                    "trimmed the allocator's heaps after a burst"
                );
            }
            peak = 0;
        }
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::Handshake;

    #[test]
    fn a_trim_is_answered_once_every_core_freed_a_block() {
        let h = Handshake::new(2);
        h.ask(1);
        assert!(!h.answered(1));
        h.answer(0);
        assert!(!h.answered(1), "core 1 has not answered");
        h.answer(1);
        assert!(h.answered(1));
        // The next trim needs new answers; a core out of range is ignored.
        h.ask(2);
        h.answer(7);
        assert!(!h.answered(2));
        h.answer(0);
        h.answer(1);
        assert!(h.answered(2));
    }
}

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

use crate::broker::Shared;
use std::sync::atomic::Ordering;
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
            let t = std::time::Instant::now();
            // SAFETY: malloc_trim only returns free memory to the kernel.
            let gave = unsafe { libc::malloc_trim(0) };
            let took = t.elapsed();
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

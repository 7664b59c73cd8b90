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
//! then next to nothing for [`QUIET`], it calls `malloc_trim(0)`, which
//! gives the free pages of every heap back. Only then: the trim takes each
//! heap's lock while it walks it, which a busy core would wait on.

use crate::broker::Shared;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Held by the connections together, this much makes the next quiet spell
/// worth a trim (a 32 MiB budget's worth of unread answers did not always
/// reach 64 MiB between two samples; 16 MiB is a few large frames).
const BURST: u64 = 16 << 20;
/// At most this much held counts as quiet.
const QUIET_BYTES: u64 = 1 << 20;
/// How long it must stay quiet.
const QUIET: Duration = Duration::from_secs(3);

pub(crate) fn start(shared: Arc<Shared>) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
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
    let mut burst = false;
    let mut quiet_since: Option<std::time::Instant> = None;
    while !shared.shutting_down.load(Ordering::Relaxed) {
        // A thread of its own, not an executor: parking it blocks nothing.
        std::thread::park_timeout(Duration::from_secs(1));
        let held: u64 = shared
            .buffered
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .sum();
        if held >= BURST {
            burst = true;
        }
        if held > QUIET_BYTES {
            quiet_since = None;
            continue;
        }
        let since = *quiet_since.get_or_insert_with(std::time::Instant::now);
        if burst && since.elapsed() >= QUIET {
            let t = std::time::Instant::now();
            // SAFETY: malloc_trim only returns free memory to the kernel.
            let gave = unsafe { libc::malloc_trim(0) };
            tracing::debug!(
                took_us = t.elapsed().as_micros() as u64,
                gave_back = gave != 0,
                "trimmed the allocator's heaps after a burst"
            );
            burst = false;
        }
    }
}

//! One core's budget for the bytes its connections hold
//! (`server.max_buffered_bytes_per_core`).
//!
//! Each connection is already bounded on its own (requests in flight,
//! request bytes, unsent answers), but those bounds multiply by the number of
//! connections: ten thousand connections each allowed 64 MiB of requests and
//! 64 MiB of answers would be far more memory than a machine has. The budget
//! counts, across every connection of the core,
//!
//! * the frame bytes of requests read and not yet answered,
//! * the answer room reads and polls reserve before they fetch records, and
//! * encoded answers waiting to be written to their sockets.
//!
//! * the bytes of a frame still arriving, and
//! * a fixed [`REQUEST_TASK_BYTES`] for each request in flight (its task,
//!   which a long poll keeps for as long as it waits).
//!
//! Once the core is at its budget, a connection that already holds something
//! (a request in flight, reserved room, an unsent answer or part of a frame)
//! is not read from, and a read or poll waits for room, until other work
//! finishes and frees some. A connection holding nothing may still go ahead
//! with one request, and its read or poll take its room, while the core is
//! under its ceiling, a quarter above the budget ([`Budget::overdraft`]): a
//! few clients that stop reading cannot starve the rest, yet many
//! connections cannot each add an answer without bound. Past the ceiling
//! everything waits; what is counted is released as requests finish,
//! clients read their answers and frames arrive, and clients that take no
//! answers, or leave a frame unfinished, are cut off after
//! `server.write_timeout_ms`, so the wait ends. The memory a core holds is
//! therefore the ceiling plus about one answer or frame.

use felix_engine::notify::WaitList;
use std::cell::Cell;

/// What one request in flight costs besides its frame: the task running it
/// and its state (about 3.2 KiB for a waiting read, 3.7 KiB for a waiting
/// poll, measured on x86-64), rounded up.
pub(crate) const REQUEST_TASK_BYTES: usize = 4096;

pub(crate) struct Budget {
    used: Cell<usize>,
    peak: Cell<usize>,
    limit: usize,
    /// Times a connection or a read was held back for the budget.
    waits: Cell<u64>,
    /// Woken when a release leaves the core under its budget.
    freed: WaitList,
}

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget {
            used: Cell::new(0),
            peak: Cell::new(0),
            limit,
            waits: Cell::new(0),
            freed: WaitList::new(),
        }
    }

    pub fn add(&self, n: usize) {
        let used = self.used.get() + n;
        self.used.set(used);
        if used > self.peak.get() {
            self.peak.set(used);
        }
    }

    pub fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        let used = self.used.get() - n;
        self.used.set(used);
        // Waiters need the core under its budget; below it, wake them to
        // look again (each re-checks its own condition).
        if used < self.limit {
            self.freed.wake_all();
        }
    }

    /// Whether `more` bytes would pass the budget.
    pub fn over(&self, more: usize) -> bool {
        self.used.get().saturating_add(more) > self.limit
    }

    /// Whether the core is at its budget.
    pub fn full(&self) -> bool {
        self.used.get() >= self.limit
    }

    /// How far past the budget a connection that holds nothing may take the
    /// core: a quarter of the budget.
    pub fn overdraft(&self) -> usize {
        self.limit / 4
    }

    /// Whether the core is at its ceiling (the budget and the overdraft),
    /// where even a connection holding nothing waits.
    pub fn past_ceiling(&self) -> bool {
        self.used.get() >= self.limit.saturating_add(self.overdraft())
    }

    /// Whether a connection that `holds` something (or, if not, nothing)
    /// must wait before it takes `more` bytes: past the budget if it holds
    /// something, past the ceiling if not.
    pub fn must_wait(&self, holds: bool, more: usize) -> bool {
        if holds {
            self.over(more)
        } else {
            self.past_ceiling()
        }
    }

    /// Resolves after the next release.
    pub fn wait_freed(&self) -> felix_engine::notify::Wait<'_> {
        self.freed.wait()
    }

    pub fn count_wait(&self) {
        self.waits.set(self.waits.get() + 1);
    }

    pub fn used(&self) -> usize {
        self.used.get()
    }

    pub fn peak(&self) -> usize {
        self.peak.get()
    }

    pub fn waits(&self) -> u64 {
        self.waits.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_use_peak_and_the_limit() {
        let b = Budget::new(100);
        assert!(!b.full());
        b.add(60);
        assert!(!b.full());
        assert!(b.over(41));
        assert!(!b.over(40));
        b.add(40);
        assert!(b.full());
        // A connection holding nothing may go on to the ceiling (125).
        assert!(b.must_wait(true, 1));
        assert!(!b.must_wait(false, 1 << 20));
        b.add(24);
        assert!(!b.past_ceiling());
        b.add(1);
        assert!(b.past_ceiling());
        assert!(b.must_wait(false, 0));
        b.release(95);
        assert_eq!(b.used(), 30);
        assert_eq!(b.peak(), 125);
        assert!(!b.full());
        // No overflow on absurd sizes.
        assert!(b.over(usize::MAX));
    }
}

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
//! * a fixed [`REQUEST_TASK_BYTES`] for each request in flight (its task,
//!   which a long poll keeps for as long as it waits),
//! * frames still arriving, at the size their headers declare,
//! * the answer room reads and polls reserve before they fetch records
//!   (grown to what a first record larger than their cap holds, or what
//!   reaching it brings from disk, before they keep or bring it), and
//! * encoded answers waiting to be written to their sockets.
//!
//! Once the core is at its budget, a connection that already holds something
//! (a request in flight, reserved room or an unsent answer) is not read from,
//! and a read or poll waits for room, until other work finishes and frees
//! some. A connection holding nothing may go ahead with one request, so no
//! connection is starved by clients that stop reading. The requests let
//! through that way are an overdraft, bounded too: while they hold a
//! quarter of the budget, a connection holding nothing waits for one of
//! them to finish (they are in flight, and what they may wait for, room
//! for a large answer, is freed as clients take answers or are cut off at
//! the write timeout, so the core cannot deadlock). Without that bound ten
//! thousand connections with one request each (its frame, its task, and
//! what its work goes on to take: a publish's copy in the log, a read's
//! answer) could hold far more than the machine has. The bound is kept
//! where a request starts: at the budget, a whole frame is decoded only by
//! a connection holding nothing, and only while the requests let through
//! hold less than their quarter.
//!
//! Frames arriving (once a connection's HELLO is through) are admitted the
//! same way: the broker reads past a frame's header only once the budget
//! has room for the whole frame, or, for a connection holding nothing,
//! while the overdraft (frames let in that way and requests together) holds
//! less than a quarter of the budget; the frame then counts in it until it
//! is whole. An admitted frame is never held back by the budget while it
//! arrives (its connection reads on until the frame is whole or its time is
//! up), so the frames begun cannot deadlock the core; whole, it is decoded
//! only when any frame of that connection would be (decoding starts the
//! request's work). A frame of at most 64 KiB (one read's worth)
//! from a connection holding nothing needs no admission: it is read on as
//! any read, so requests sent in such frames are never held up by clients
//! that begin larger frames and stall part way (those hold their room until
//! their time is up); larger frames wait for room like any other.
//!
//! Answers are let through the same way: a read, poll or list of a
//! connection holding nothing takes its answer room past the budget, and
//! that room, then the answer built in it, counts in an overdraft of its
//! own ([`Past::Answers`]) until the answer is written to the socket.
//! While the answers let through hold a quarter of the budget, such a read,
//! poll or page of dead letters takes at most [`PAST_BUDGET_ROOM`] (or what
//! is left under the budget, if more) and answers with fewer records, and
//! a list, or a first record (or the disk read reaching it), larger than
//! that waits for the overdraft to fall under its quarter. Those answers
//! are being written, or their clients are cut off at the write timeout,
//! so the wait ends; the answers cut short count apart
//! ([`Past::CutAnswers`]), so a stream of them cannot keep it waiting.
//! Kept apart from the frames and requests, clients that stop reading
//! their answers hold up nobody's requests, and nobody's reads of ordinary
//! records.
//!
//! The memory a core holds is therefore at most the budget and the request
//! that crossed it, a quarter of the budget of answers let through plus the
//! one that crossed it, a quarter of the budget of requests let through
//! plus the one that crossed it, a quarter of the budget of frames let in
//! plus the one that crossed it, and per connection holding nothing one
//! read (at most 64 KiB), which counts but is not held to the budget, and
//! one answer of at most [`PAST_BUDGET_ROOM`] past the answers' quarter.
//! The price is that a frame counts its declared
//! size from its header on: a client that sends headers and stalls takes
//! budget it does not fill, until its frames' time
//! (`server.write_timeout_ms`) is up. Tokens keep clients that cannot say
//! HELLO from doing that at all.

use felix_engine::notify::WaitList;
use std::cell::Cell;

/// What one request in flight costs besides its frame: the task running it
/// and its state (about 3.2 KiB for a waiting read, 3.7 KiB for a waiting
/// poll, measured on x86-64), rounded up.
pub(crate) const REQUEST_TASK_BYTES: usize = 4096;

/// The answer room a read or poll of a connection holding nothing takes
/// once the answers let through past the budget hold their quarter of it:
/// it answers with less rather than wait for clients that may not be
/// reading. Two of the engine's 256 KiB cold-read chunks, what reaching a
/// record on disk takes unless its batch is larger, so reads of ordinary
/// records still go ahead; a first record, or a batch to reach it, larger
/// than this waits for the overdraft to shrink.
pub(crate) const PAST_BUDGET_ROOM: usize = 512 << 10;

/// What a connection let through past the budget holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Past {
    /// A frame arriving, at its declared size.
    Frames = 0,
    /// A request in flight, decoded, with its task.
    Requests = 1,
    /// Answer room a read, poll or list took, and then its answer until it
    /// is written to the socket.
    Answers = 2,
    /// The same, taken once [`Past::Answers`] held its quarter: at most
    /// [`PAST_BUDGET_ROOM`] a connection, and not counted in that quarter,
    /// so that many small reads cannot keep a large one waiting.
    CutAnswers = 3,
}

pub(crate) struct Budget {
    used: Cell<usize>,
    peak: Cell<usize>,
    /// The most used since [`Self::take_recent_peak`] last looked.
    recent: Cell<usize>,
    limit: usize,
    /// Times a connection or a read was held back for the budget.
    waits: Cell<u64>,
    /// Bytes let through while the core was at its budget (see
    /// [`Self::overdrawn`]), by [`Past`]: of frames arriving, of requests
    /// in flight, and of answers (room, then unsent).
    overdraft: [Cell<usize>; 4],
    /// Woken when a release leaves the core under its budget, when what was
    /// let through past it (a frame, a request) is done, or when the
    /// answers let through fall under their quarter.
    freed: WaitList,
}

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget {
            used: Cell::new(0),
            peak: Cell::new(0),
            recent: Cell::new(0),
            limit,
            waits: Cell::new(0),
            overdraft: [Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0)],
            freed: WaitList::new(),
        }
    }

    pub fn add(&self, n: usize) {
        let used = self.used.get() + n;
        self.used.set(used);
        if used > self.peak.get() {
            self.peak.set(used);
        }
        if used > self.recent.get() {
            self.recent.set(used);
        }
    }

    /// The most used since the last call (a burst between two looks is
    /// seen whole), and start over from what is used now.
    pub fn take_recent_peak(&self) -> usize {
        let used = self.used.get();
        self.recent.replace(used).max(used)
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

    /// What is left under the budget.
    pub fn left(&self) -> usize {
        self.limit.saturating_sub(self.used.get())
    }

    /// Whether what was let through past the budget (by connections
    /// holding nothing), frames arriving and requests in flight together,
    /// holds a quarter of it already: then such a connection reads no
    /// further and begins no frame, until some of it is done.
    pub fn overdrawn(&self) -> bool {
        self.overdraft(Past::Frames) + self.overdraft(Past::Requests) >= self.limit / 4
    }

    /// Whether the answers let through past the budget (the room reads and
    /// polls took, then their answers until sent) hold a quarter of it
    /// already: then a read or poll of a connection holding nothing takes
    /// at most [`PAST_BUDGET_ROOM`], and a larger first record waits. Kept
    /// apart from the frames and requests, so that clients not reading
    /// their answers cannot hold up requests, nor they answers.
    pub fn answers_overdrawn(&self) -> bool {
        self.overdraft(Past::Answers) >= self.limit / 4
    }

    /// Whether the requests let through past the budget hold a quarter of
    /// it already: then a connection holding nothing decodes no whole
    /// frame, until one of them finishes. Frames still arriving do not
    /// count here, so clients that stall part way through their frames
    /// cannot hold up the frames others have finished.
    pub fn requests_overdrawn(&self) -> bool {
        self.overdraft[Past::Requests as usize].get() >= self.limit / 4
    }

    /// `n` bytes let through past the budget: counted in the overdraft
    /// until [`Self::repay`].
    pub fn overdraw(&self, past: Past, n: usize) {
        let c = &self.overdraft[past as usize];
        c.set(c.get() + n);
    }

    /// What was let through past the budget is done (a frame decoded or
    /// dropped, a request answered, an answer sent): its bytes leave the
    /// overdraft, and connections waiting for it look again. Only the
    /// quarter of [`Past::Answers`] is waited for, so those wake nobody
    /// until they fall under it (an answer sent is no reason for every
    /// connection held back to look again).
    pub fn repay(&self, past: Past, n: usize) {
        let c = &self.overdraft[past as usize];
        let was = c.get();
        c.set(was - n);
        let wake = match past {
            Past::Frames | Past::Requests => true,
            Past::Answers => was >= self.limit / 4 && was - n < self.limit / 4,
            Past::CutAnswers => false,
        };
        if wake {
            self.freed.wake_all();
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

    /// Bytes let through past the budget now, of `past`.
    pub fn overdraft(&self, past: Past) -> usize {
        self.overdraft[past as usize].get()
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
        b.release(70);
        assert_eq!(b.used(), 30);
        assert_eq!(b.peak(), 100);
        assert!(!b.full());
        // No overflow on absurd sizes.
        assert!(b.over(usize::MAX));
    }

    #[test]
    fn the_overdraft_is_a_quarter_of_the_budget_and_repaid_whole() {
        let b = Budget::new(100);
        assert!(!b.overdrawn());
        b.overdraw(Past::Requests, 20);
        assert!(!b.overdrawn() && !b.requests_overdrawn());
        b.overdraw(Past::Requests, 5);
        assert!(b.overdrawn() && b.requests_overdrawn());
        b.repay(Past::Requests, 5);
        assert!(!b.overdrawn());
        b.repay(Past::Requests, 20);
        // Frames arriving count for what is read and begun, not for what
        // is decoded.
        b.overdraw(Past::Frames, 25);
        assert!(b.overdrawn() && !b.requests_overdrawn());
        b.repay(Past::Frames, 25);
        assert!(b.overdraft.iter().all(|c| c.get() == 0));
    }

    #[test]
    fn answers_have_a_quarter_of_their_own() {
        let b = Budget::new(100);
        b.overdraw(Past::Answers, 24);
        // Cut answers are bounded per connection, not by the quarter.
        b.overdraw(Past::CutAnswers, 50);
        assert!(!b.answers_overdrawn());
        b.overdraw(Past::Answers, 1);
        assert!(b.answers_overdrawn());
        // Apart from the frames' and requests' quarter.
        assert!(!b.overdrawn() && !b.requests_overdrawn());
        assert_eq!(b.overdraft(Past::Answers), 25);
        b.repay(Past::Answers, 1);
        b.repay(Past::CutAnswers, 50);
        assert!(!b.answers_overdrawn());
        b.repay(Past::Answers, 24);
        assert!(b.overdraft.iter().all(|c| c.get() == 0));
        b.add(60);
        assert_eq!(b.left(), 40);
        b.add(50);
        assert_eq!(b.left(), 0);
    }
}

//! What a connection's read side holds in its core's budget (see `memory`),
//! and when the budget holds the connection back.
//!
//! A connection counts the bytes of its read buffer (frames held back, and
//! what has come of a frame still arriving), and a frame begun at the size
//! its header declares from the moment it is admitted. A frame begun is
//! admitted before the broker reads past its header: when the budget has
//! room for all of it, or, for a connection holding nothing, on the
//! overdraft while that is not taken; it otherwise waits, unread, for room.
//! Admitted, it counts whole and does not hold its connection back while it
//! arrives: the connection reads on until the frame is whole (within its
//! frame time), so the core cannot deadlock on frames it will not finish
//! reading, and however many connections begin large frames and stall, what
//! they hold stays within the budget and the overdraft. Whole, it waits to
//! be decoded like any other frame of its connection.

use super::{ConnInfo, Outbox};
use crate::broker::Core;
use crate::memory::Past;
use bytes::BytesMut;
use felix_engine::storage::Storage;
use std::cell::Cell;

pub(super) struct Intake<'c, S: Storage> {
    core: &'c Core<S>,
    /// Whether the connection's HELLO is through. Before it, a connection
    /// is never held back by the budget: a HELLO costs nothing, and a
    /// client that cannot even say it is there would hold its place without
    /// a deadline (frames before it are at most a HELLO's worth, and the
    /// connection's time to say HELLO bounds them).
    said_hello: Cell<bool>,
    /// Bytes of the read buffer (and of a frame arriving, at its declared
    /// size) counted in the core's budget.
    buffered: Cell<usize>,
    /// A frame begun and admitted: its declared size, counted until it is
    /// whole, and whether it was let in on the overdraft.
    admitted: Cell<Option<(usize, bool)>>,
}

impl<'c, S: Storage> Intake<'c, S> {
    pub(super) fn new(core: &'c Core<S>) -> Self {
        Intake {
            core,
            said_hello: Cell::new(false),
            buffered: Cell::new(0),
            admitted: Cell::new(None),
        }
    }

    pub(super) fn said_hello(&self) -> bool {
        self.said_hello.get()
    }

    pub(super) fn hello_through(&self) {
        self.said_hello.set(true);
    }

    /// What the read buffer holds: its bytes, or the admitted frame's
    /// declared size while that is larger.
    fn held(&self, rbuf: &BytesMut) -> usize {
        rbuf.len().max(self.admitted.get().map_or(0, |(n, _)| n))
    }

    /// Count what the read buffer holds now in the core's budget.
    pub(super) fn count(&self, rbuf: &BytesMut) {
        self.set(self.held(rbuf));
    }

    fn set(&self, now: usize) {
        let was = self.buffered.replace(now);
        if now > was {
            self.core.budget.add(now - was);
        } else {
            self.core.budget.release(was - now);
        }
    }

    /// The admitted frame was taken off the buffer (decoded, or refused
    /// whole): it leaves the overdraft it was let in on.
    pub(super) fn frame_taken(&self) {
        if let Some((n, true)) = self.admitted.take() {
            self.core.budget.repay(Past::Frames, n);
        }
    }

    /// The connection is closing: it holds nothing any more.
    pub(super) fn release(&self) {
        self.set(0);
        self.frame_taken();
    }

    /// Whether the core's budget stops this connection from reading, and
    /// from decoding the frames it holds: at the budget, a connection that
    /// holds something (a request in flight or an unsent answer) waits for
    /// room. One that holds nothing still decodes a whole frame, unless
    /// the requests let through that way already hold their part of the
    /// overdraft; reads on while what it holds is at most one read (a
    /// frame of at most [`super::MAX_READ`] arriving, or none); and reads
    /// on into a larger frame once that is admitted (see [`Self::admit`]).
    /// A frame admitted is read on until it is whole, and then waits like
    /// any other: decoding starts the request's work.
    pub(super) fn budget_bound(&self, info: &ConnInfo, outbox: &Outbox, rbuf: &BytesMut) -> bool {
        let frame = felix_wire::peek_header(rbuf).map(|h| h.frame_bytes());
        let whole = frame.is_some_and(|f| f <= rbuf.len());
        let arriving = self.admitted.get().is_some() && !whole;
        let budget = &self.core.budget;
        budget.full()
            && !arriving
            && (info.in_flight.get() > 0
                || outbox.unsent() > 0
                || (self.said_hello()
                    && if whole {
                        budget.requests_overdrawn()
                    } else {
                        frame.is_some_and(|f| f > super::MAX_READ) && budget.overdrawn()
                    }))
    }

    /// Admit the frame the buffer begins, if it is not whole yet and not
    /// admitted already (see the module's comment), waiting for room as
    /// long as it takes; returns whether it waited. Gives up, unadmitted,
    /// when the connection closes or the core stops.
    pub(super) async fn admit(
        &self,
        rbuf: &BytesMut,
        info: &ConnInfo,
        outbox: &Outbox,
        max_frame: u32,
    ) -> bool {
        let budget = &self.core.budget;
        let begun = felix_wire::peek_header(rbuf)
            .filter(|h| self.said_hello() && h.len <= max_frame)
            .map(|h| h.frame_bytes())
            .filter(|&frame| frame > rbuf.len());
        let (Some(frame), None) = (begun, self.admitted.get()) else {
            return false;
        };
        let holds_nothing =
            || info.in_flight.get() == 0 && outbox.unsent() == 0 && info.reserved.get() == 0;
        if frame <= super::MAX_READ && holds_nothing() {
            // No more than a read: it reads on, counted as what came, so
            // that requests sent whole are never held up by frames others
            // begin and stall.
            return false;
        }
        let mut waited = false;
        while !outbox.closed.get() && !self.core.stopping.get() {
            if !budget.over(frame.saturating_sub(self.buffered.get())) {
                self.admitted.set(Some((frame, false)));
                break;
            }
            if holds_nothing() && !budget.overdrawn() {
                budget.overdraw(Past::Frames, frame);
                self.admitted.set(Some((frame, true)));
                break;
            }
            if !waited {
                budget.count_wait();
                waited = true;
            }
            let drained = outbox.drained.wait();
            let finished = self.core.lifecycle.wait();
            let freed = budget.wait_freed();
            futures_lite::future::or(drained, futures_lite::future::or(finished, freed)).await;
        }
        if !outbox.closed.get() {
            self.count(rbuf);
        }
        waited
    }
}

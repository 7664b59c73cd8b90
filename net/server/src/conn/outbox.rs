//! A connection's way out: the answers queued for its socket, the writer
//! task that sends them in the order they were queued (cutting off a
//! client that takes too little of them), and the linger that lets a
//! closing connection's client take its last answers.

use crate::broker::wire_err;
use crate::memory::{Budget, Past};
use bytes::BytesMut;
use felix_engine::notify::WaitList;
use felix_wire::{ErrorCode, Response};
use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use glommio::net::TcpStream;
use std::cell::{Cell, RefCell};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

/// Reader and writer tasks share the socket; each borrows it only inside a
/// single `poll`, never across an await, so the two never conflict.
#[derive(Clone)]
pub(super) struct Shared(pub(super) Rc<RefCell<TcpStream>>);

impl AsyncRead for Shared {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_read(cx, buf)
    }
}

impl AsyncWrite for Shared {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_flush(cx)
    }
    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_close(cx)
    }
}

/// Responses waiting to be written.
pub(super) struct Outbox {
    pub(super) buf: RefCell<BytesMut>,
    pub(super) ready: WaitList,
    pub(super) closed: Cell<bool>,
    /// The socket moved to another core: close our descriptor only, never
    /// shut the connection down.
    pub(super) handed_off: Cell<bool>,
    /// Woken each time the writer sent a batch of responses.
    pub(super) drained: WaitList,
    /// Woken once, when the connection starts closing (`closed`).
    pub(super) hangup: WaitList,
    /// The frame cap announced in HELLO.
    pub(super) max_frame: u32,
    /// The core's budget, which counts the encoded answers not yet sent.
    pub(super) budget: Rc<Budget>,
    /// Bytes taken from `buf` by the writer and not yet fully written.
    pub(super) writing: Cell<usize>,
    /// Of the answers in `buf`, bytes counted in the core's overdraft
    /// ([`Past::Answers`], [`Past::CutAnswers`]): repaid once the writer
    /// has sent them.
    pub(super) past: Cell<PastAnswers>,
}

/// Bytes of answers counted in the core's overdraft, of each kind.
#[derive(Clone, Copy, Default)]
pub(super) struct PastAnswers {
    whole: usize,
    cut: usize,
}

impl PastAnswers {
    pub(super) fn add(&mut self, kind: Past, n: usize) {
        match kind {
            Past::CutAnswers => self.cut += n,
            _ => self.whole += n,
        }
    }

    pub(super) fn repay(self, budget: &Budget) {
        if self.whole > 0 {
            budget.repay(Past::Answers, self.whole);
        }
        if self.cut > 0 {
            budget.repay(Past::CutAnswers, self.cut);
        }
    }
}

impl Outbox {
    /// Encoded answers not yet sent, including those being written.
    pub(super) fn unsent(&self) -> usize {
        self.buf.borrow().len() + self.writing.get()
    }

    /// Queue the answer to `request_id` for the socket; returns the bytes
    /// it takes there (none once the connection is closing).
    pub(super) fn push(&self, request_id: u64, resp: &Response) -> usize {
        if self.closed.get() {
            return 0;
        }
        let queued = {
            let mut buf = self.buf.borrow_mut();
            let at = buf.len();
            felix_wire::encode_response(request_id, resp, &mut buf);
            // The client refuses a frame over the cap it was told in HELLO
            // (and drops the connection): answer too_large instead. Publish
            // keeps records small enough to come back; this catches a cap
            // lowered since they were written.
            // The cap is on the frame's `len`, which leaves out its own
            // 4-byte prefix.
            if buf.len() - at > self.max_frame as usize + 4 {
                let n = buf.len() - at - 4;
                buf.truncate(at);
                felix_wire::encode_response(
                    request_id,
                    &wire_err(
                        ErrorCode::TooLarge,
                        format!(
                            "the answer is {n} bytes, over this broker's {}-byte frame cap \
                             (server.max_frame_bytes); ask for fewer records or bytes (a record \
                             written before the cap was lowered may fit no answer: raise it \
                             again to read it)",
                            self.max_frame
                        ),
                    ),
                    &mut buf,
                );
            }
            self.budget.add(buf.len() - at);
            buf.len() - at
        };
        self.ready.wake_all();
        queued
    }
}

/// How long a closing connection waits for its client to close too, once
/// the client has its answers.
const LINGER: Duration = Duration::from_millis(500);
/// How long a closing connection waits for a client taking none of its
/// last answers (at most the write timeout).
const LINGER_STALL: Duration = Duration::from_secs(2);
/// Most bytes a closing connection reads and drops meanwhile.
const LINGER_BYTES: usize = 4 << 20;

/// Once the last answers are queued and the write side is shut (a FIN
/// after them), read and drop what the client still sends: until the
/// client has taken every answer (the kernel's send queue is empty, the FIN
/// acknowledged), while it takes some every [`LINGER_STALL`] and for at
/// most `stall` (the write timeout) in all; then until it closes too, for
/// at most [`LINGER`] and [`LINGER_BYTES`]. Closing a socket that has
/// unread bytes makes the kernel reset the connection and throw away what
/// it had not yet delivered: the answers to requests carried out, or the error that says
/// why the connection closes. (A client slow to read, on a busy machine,
/// could lose its last answers to a fixed linger.)
pub(super) async fn linger(reader: &mut Shared, stall: Duration) {
    let fd = reader.0.borrow().as_raw_fd();
    let start = std::time::Instant::now();
    let mut sink = vec![0u8; 4 << 10];
    let mut dropped = 0;
    let mut eof = false;
    let (mut unacked, mut moved) = (not_yet_taken(fd), start);
    let mut until = None;
    loop {
        let now = std::time::Instant::now();
        let left = not_yet_taken(fd);
        if left != unacked {
            (unacked, moved) = (left, now);
        }
        let deadline = if left > 0 {
            // Still taking its answers: wait while it takes some.
            if now - moved >= LINGER_STALL.min(stall) || now - start >= stall {
                break;
            }
            now + Duration::from_millis(20)
        } else {
            // All taken: the client has LINGER (and LINGER_BYTES) to close.
            let t = *until.get_or_insert_with(|| {
                dropped = 0;
                now + LINGER
            });
            if eof || dropped >= LINGER_BYTES || now >= t {
                break;
            }
            t
        };
        let wait = deadline.saturating_duration_since(now);
        if eof {
            glommio::timer::sleep(wait).await;
            continue;
        }
        let read = glommio::timer::timeout(wait, async {
            reader
                .read(&mut sink)
                .await
                .map_err(glommio::GlommioError::from)
        })
        .await;
        match read {
            Ok(n) if n > 0 => dropped += n,
            Err(glommio::GlommioError::TimedOut(_)) => {}
            // The client closed (or reset) its side.
            _ => eof = true,
        }
    }
}

/// Bytes written to the socket that its peer has not acknowledged yet
/// (`SIOCOUTQ`, the FIN included): 0 once it has taken everything, or when
/// the connection is gone.
fn not_yet_taken(fd: std::os::fd::RawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int for a socket descriptor
    // this task owns.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
    if r == 0 {
        n.max(0) as usize
    } else {
        0
    }
}

/// Make closing `fd` reset the connection (`SO_LINGER` of zero): what its
/// socket still holds is thrown away at once instead of being sent on.
fn reset_on_close(fd: std::os::fd::RawFd) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: SO_LINGER reads one `linger` from a pointer valid for the
    // call, on a socket descriptor this task owns.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(
            "could not set SO_LINGER on a connection being cut off: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The most of an outbox's buffer kept for the answers after those being
/// written (small ones, as a publisher's acks, then reuse it).
const KEEP_OUTBOX_BYTES: usize = 256 << 10;

/// The least a client must take of its answers within the write timeout
/// (`server.write_timeout_ms`) to keep its connection while they wait.
const MIN_TAKEN: usize = 64 << 10;

/// How long a write may wait before the writer starts watching what the
/// client takes (a socket full for a moment is the usual case, and not
/// looked at).
const STALL_FROM: Duration = Duration::from_millis(10);

/// What a connection's writer knows of what its client has taken.
#[derive(Default)]
struct Taking {
    /// Bytes the client had not acknowledged when last looked at
    /// (`SIOCOUTQ`; none on a new connection), and bytes written since.
    unacked: usize,
    written: usize,
    /// Since when answers have waited on a client taking too little, and
    /// what it has taken since: from a write that did not go in whole (or
    /// not within [`STALL_FROM`]), until the client has taken everything.
    stalled: Option<(std::time::Instant, usize)>,
}

impl Taking {
    /// Look at the socket: bytes the client has taken since the last look.
    fn look(&mut self, fd: std::os::fd::RawFd) -> usize {
        let now = not_yet_taken(fd);
        let taken = (self.unacked + self.written).saturating_sub(now);
        (self.unacked, self.written) = (now, 0);
        taken
    }

    /// Count what the client took since the last look into the stall;
    /// false once it has taken less than [`MIN_TAKEN`] in `stall`.
    fn keeps_up(&mut self, fd: std::os::fd::RawFd, stall: Duration) -> bool {
        let taken = self.look(fd);
        let now = std::time::Instant::now();
        match &mut self.stalled {
            // Watching starts here: what was taken before does not count.
            None => self.stalled = Some((now, 0)),
            Some((since, got)) => {
                *got += taken;
                if *got >= MIN_TAKEN {
                    (*since, *got) = (now, 0);
                } else if now >= *since + stall {
                    return false;
                }
            }
        }
        true
    }
}

/// Write `d` whole, giving up when the client takes less than
/// [`MIN_TAKEN`] of its answers within `stall`.
///
/// Once a write does not go in whole (or not within [`STALL_FROM`]), the
/// time runs until the client has taken everything, across this and later
/// calls, and starts again each time it has taken `MIN_TAKEN` more (its
/// kernel acknowledged them), not each time the socket lets a few more
/// bytes in. A client reading
/// nothing still lets a little in now and then (its kernel opening a small
/// window to a probe; glommio trying a plain send once more as its wait
/// times out), and restarting the time on that kept its answers held for
/// twice the timeout or more. The socket is looked at only while writes
/// wait, never on the usual path.
async fn write_all_or_stall(
    sock: &mut Shared,
    d: &[u8],
    stall: Duration,
    taking: &mut Taking,
) -> Result<(), Ended> {
    let fd = sock.0.borrow().as_raw_fd();
    if taking.stalled.is_some() {
        // Still behind from before: has it taken everything since?
        if !taking.keeps_up(fd, stall) {
            return Err(Ended::CutOff);
        }
        if taking.unacked == 0 {
            taking.stalled = None;
        }
    }
    let mut at = 0;
    while at < d.len() {
        // While the client is behind, look at the socket every quarter of
        // the timeout: the time starts again from the look that finds
        // another MIN_TAKEN taken, so a client that stops dead is cut off
        // within a quarter more than the timeout after it stopped (waiting
        // for the write alone looked only once a third of the socket's
        // buffer was free, or at the deadline: up to twice the timeout).
        let wait = match taking.stalled {
            None => STALL_FROM.min(stall),
            Some((since, _)) => (since + stall)
                .saturating_duration_since(std::time::Instant::now())
                .min(stall / 4),
        };
        let wrote = if wait.is_zero() {
            0
        } else {
            match glommio::timer::timeout(wait, async {
                sock.write(&d[at..])
                    .await
                    .map_err(glommio::GlommioError::from)
            })
            .await
            {
                Ok(n) if n > 0 => n,
                Err(glommio::GlommioError::TimedOut(_)) => 0,
                _ => return Err(Ended::Failed),
            }
        };
        at += wrote;
        taking.written += wrote;
        if at < d.len() && !taking.keeps_up(fd, stall) {
            return Err(Ended::CutOff);
        }
    }
    Ok(())
}

/// How a connection's writer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ended {
    /// Everything queued was sent, and the connection is closing.
    Delivered,
    /// The client took too little of its answers for the write timeout
    /// (see [`write_all_or_stall`]): cut off, its answers dropped.
    CutOff,
    /// A write failed (the client reset the connection): answers dropped.
    Failed,
}

/// Send what the outbox is given until it is closed and empty.
pub(super) async fn write_loop(mut sock: Shared, outbox: Rc<Outbox>, stall: Duration) -> Ended {
    let mut taking = Taking::default();
    loop {
        let data = {
            let mut b = outbox.buf.borrow_mut();
            if b.is_empty() {
                None
            } else {
                // A large buffer goes whole: what `split` leaves shares its
                // allocation, and would keep it (an answer's worth of
                // memory, uncounted) for as long as the connection lives.
                let d = if b.capacity() > KEEP_OUTBOX_BYTES {
                    std::mem::take(&mut *b)
                } else {
                    b.split()
                };
                // With it, the part of the overdraft its answers hold.
                Some((d.freeze(), outbox.past.take()))
            }
        };
        match data {
            Some((d, past)) => {
                outbox.writing.set(d.len());
                let sent = write_all_or_stall(&mut sock, &d, stall, &mut taking).await;
                outbox.writing.set(0);
                outbox.budget.release(d.len());
                past.repay(&outbox.budget);
                drop(d);
                if let Err(ended) = sent {
                    // Nothing more goes out: what is queued is dropped (and
                    // pushes from now on are ignored). A peer that stopped
                    // taking answers is cut off, so that the reader's pending
                    // read ends too and the connection lets go of everything,
                    // in the kernel too: closed with a reset rather than
                    // left sending its socket's last megabytes to a client
                    // that takes none (an orphan the kernel keeps for
                    // minutes).
                    tracing::debug!("closing a connection whose answers could not be sent");
                    if !outbox.handed_off.get() {
                        let fd = sock.0.borrow().as_raw_fd();
                        reset_on_close(fd);
                        // SAFETY: shutdown on a descriptor this task owns.
                        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                    }
                    outbox.closed.set(true);
                    let left = std::mem::take(&mut *outbox.buf.borrow_mut());
                    outbox.budget.release(left.len());
                    outbox.past.take().repay(&outbox.budget);
                    outbox.drained.wake_all();
                    outbox.hangup.wake_all();
                    return ended;
                }
                outbox.drained.wake_all();
            }
            None => {
                if outbox.closed.get() {
                    if !outbox.handed_off.get() {
                        // A plain shutdown(2): nothing to wait for, and no
                        // borrow of the socket held across an await.
                        let fd = sock.0.borrow().as_raw_fd();
                        // SAFETY: shutdown on a descriptor this task owns.
                        unsafe { libc::shutdown(fd, libc::SHUT_WR) };
                    }
                    return Ended::Delivered;
                }
                outbox.ready.wait().await;
            }
        }
    }
}

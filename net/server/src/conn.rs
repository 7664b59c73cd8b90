//! A client connection on its core: HELLO (and hand-off to the core it asks
//! for), then a read loop that decodes frames and runs each request as its
//! own task, and a writer task that sends responses in whatever order they
//! complete. A long poll therefore never blocks an ack on the same connection.

use crate::broker::{now_ms, to_name, wire_err, Core, CoreMsg, Handoff};
use crate::memory::{Budget, Past, PAST_BUDGET_ROOM, REQUEST_TASK_BYTES};
use crate::metrics::AckWait;
use crate::shard::Shard;
use bytes::BytesMut;
use felix_engine::format::AppendRecord;
use felix_engine::log::{Frontier, LogError, ReadLimits, ReadResult};
use felix_engine::notify::WaitList;
use felix_engine::storage::Storage;
use felix_engine::Offset;
use felix_wire::{
    AckMode, ErrorCode, GroupRecord, Headers, PublishRecords, PublishTarget, Record, RecordView,
    Request, Response, ShardInfo, StartPosition, StreamInfo, StreamRef, WireError,
};
use futures_lite::AsyncReadExt;
use glommio::net::TcpStream;
use hello::{hello, Hello};
use intake::Intake;
use outbox::{linger, write_loop, Ended, Outbox, PastAnswers, Shared};
use std::cell::{Cell, RefCell};
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

mod hello;
mod intake;
mod outbox;

/// Bytes of framing an answer may add around one record (frame header,
/// response fields, the record's offset, timestamp, attempts and lengths),
/// with room to spare: a record is accepted only if it fits the frame cap
/// with this much left, so that every record can be read back.
pub(crate) const ANSWER_HEADROOM: usize = 1024;

/// A published record as the log takes it: read in place from the request's
/// frame, stamped with the broker's clock when it carries no timestamp.
struct Stamped<'a> {
    record: RecordView<'a>,
    now: u64,
}

impl AppendRecord for Stamped<'_> {
    fn timestamp_ms(&self) -> u64 {
        self.record.timestamp_ms.unwrap_or(self.now)
    }
    fn key(&self) -> Option<&[u8]> {
        self.record.key
    }
    fn header_count(&self) -> usize {
        self.record.headers.len()
    }
    fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.record.headers.raw()
    }
    fn payload(&self) -> &[u8] {
        self.record.payload
    }
}

/// Per-connection facts a request handler needs.
pub(crate) struct ConnInfo {
    #[allow(dead_code)] // logged by request tracing
    pub id: u64,
    pub features: Cell<u64>,
    /// Who the connection acts as, set by its HELLO.
    pub principal: RefCell<Arc<str>>,
    pub in_flight: Cell<usize>,
    /// Bytes the requests in flight hold: their frames and what decoding
    /// them built (`Request::decoded_overhead`).
    pub in_flight_bytes: Cell<usize>,
    /// Answer bytes reserved by the reads, polls and lists running (see
    /// [`answer_reservation`] and [`AnswerRoom`]).
    pub reserved: Cell<usize>,
    /// Requests waiting to grow their room ([`AnswerRoom::grow`]): others
    /// of the connection take none meanwhile, so a large first record is
    /// not starved by a stream of small reads.
    growing: Cell<usize>,
    /// The client shut its side of the connection (or closed it): no more
    /// requests come, but the answers to those sent still go out.
    done_sending: Cell<bool>,
    outbox: Rc<Outbox>,
    /// `server.max_pending_response_bytes`.
    max_pending: usize,
}

impl ConnInfo {
    /// The connection is closing (the client hung up, or its answers could
    /// not be sent): an answer now would be dropped.
    pub fn hung_up(&self) -> bool {
        self.outbox.closed.get()
    }

    /// The client sends nothing more (it shut its side, or closed the
    /// connection, which looks the same from here): a read or poll waiting
    /// for records answers now with what there is, and a poll claims nothing
    /// it would have waited for.
    pub fn done_sending(&self) -> bool {
        self.done_sending.get()
    }

    /// Resolves once the connection is closing or the client sends nothing
    /// more ([`done_sending`](Self::done_sending)).
    pub async fn until_hung_up(&self) {
        let hangup = self.outbox.hangup.wait();
        if !self.hung_up() && !self.done_sending() {
            hangup.await;
        }
    }
}

/// How much of the room asked for a request must hold.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    /// Up to that much: past the core's budget it may take less (a read or
    /// poll answers within what it holds).
    UpTo,
    /// All of it (an answer built whole, such as a list).
    All,
    /// All of it, to grow the room to what a first record takes.
    Growth,
}

/// The answer bytes one request holds (see [`answer_reservation`]): taken
/// before it runs, or, for a read or poll that may wait for records, only
/// once it has something to read, so that long polls waiting on a
/// connection never hold up its other reads. Given back after the answer is
/// queued.
pub(crate) struct AnswerRoom {
    info: Rc<ConnInfo>,
    held: Cell<usize>,
    /// Whether `held` was taken past the core's budget (all of it), and
    /// so counts in its overdraft, as which.
    past: Cell<Option<Past>>,
}

impl AnswerRoom {
    fn new(info: &Rc<ConnInfo>) -> AnswerRoom {
        AnswerRoom {
            info: info.clone(),
            held: Cell::new(0),
            past: Cell::new(None),
        }
    }

    /// Hold `bytes` of answer room, unless this request already holds some;
    /// [`held`](Self::held) then says how much it holds, which may be less:
    /// the caller answers within it. Waits while the connection's unsent
    /// answers and the room held by its other requests would pass
    /// `max_pending_response_bytes`, or the core's budget would be passed.
    /// A request of a connection holding neither goes ahead past the
    /// budget (so nothing is starved by clients that stop reading), with
    /// all it asked while the answers let through that way hold less than
    /// a quarter of the budget, and after that with what is left under the
    /// budget or [`PAST_BUDGET_ROOM`], the larger.
    pub(crate) async fn take(&self, bytes: usize) {
        self.take_as(bytes, Want::UpTo).await;
    }

    /// [`take`](Self::take) for a request that answers within its room
    /// (`Want::UpTo`) or builds its answer whole whatever it (`Want::All`).
    async fn take_as(&self, bytes: usize, want: Want) {
        if self.held.get() > 0 || bytes == 0 {
            return;
        }
        self.wait_for_room(bytes, want).await;
    }

    async fn wait_for_room(&self, bytes: usize, want: Want) {
        let growing = want == Want::Growth;
        let info = &self.info;
        let outbox = &info.outbox;
        let budget = &outbox.budget;
        let mut counted = false;
        let (mut take, mut past) = (bytes, None);
        while !outbox.closed.get() {
            if !growing && info.growing.get() > 0 {
                // Behind a request of this connection growing its room.
                outbox.drained.wait().await;
                continue;
            }
            let unsent = outbox.unsent();
            let holds = info.reserved.get() > 0;
            // Room and unsent answers together keep to the connection's
            // bound; only a request of a connection holding neither may
            // pass it, alone. A request growing its room goes once the
            // others hold none, whatever is unsent: it holds up the
            // connection's other reads meanwhile, and answers that take no
            // room (publishes, acks) could keep something unsent for ever.
            let counts_unsent = unsent > 0 && !growing;
            let conn_full =
                (holds || counts_unsent) && unsent + info.reserved.get() + bytes > info.max_pending;
            // A connection holding no room and no unsent answer goes ahead
            // past the budget (see `memory`): nobody starves, nothing
            // deadlocks. What it takes there counts in the overdraft, until
            // its answer is sent; once that holds its quarter, it takes
            // little (a read answers with less), and a first record larger
            // than that waits (the answers holding it are being sent, or
            // cut off at the write timeout).
            let holds_nothing = !holds && unsent == 0;
            let over = budget.over(bytes);
            let core_full = if holds_nothing {
                over && budget.answers_overdrawn() && want != Want::UpTo && bytes > PAST_BUDGET_ROOM
            } else {
                over
            };
            if !conn_full && !core_full {
                if holds_nothing && over {
                    let kind = if budget.answers_overdrawn() {
                        if want == Want::UpTo {
                            take = bytes.min(PAST_BUDGET_ROOM.max(budget.left()));
                        }
                        Past::CutAnswers
                    } else {
                        Past::Answers
                    };
                    past = budget.over(take).then_some(kind);
                }
                break;
            }
            if core_full {
                if !counted {
                    budget.count_wait();
                    counted = true;
                }
                futures_lite::future::or(outbox.drained.wait(), budget.wait_freed()).await;
            } else {
                outbox.drained.wait().await;
            }
        }
        info.reserved.set(info.reserved.get() + take);
        budget.add(take);
        self.held.set(take);
        if let Some(kind) = past {
            budget.overdraw(kind, take);
            self.past.set(Some(kind));
        }
    }

    /// Answer room this request holds.
    pub(crate) fn held(&self) -> usize {
        self.held.get()
    }

    /// Hold `bytes` instead of what this request holds now (less than
    /// that). What it held is given back first, so requests of one
    /// connection that all need more cannot hold each other up for ever
    /// (one holding nothing always goes ahead); and other requests of the
    /// connection take no room until it has grown, so a stream of small
    /// reads cannot keep it waiting. The caller holds nothing it counted in
    /// the room meanwhile.
    pub(crate) async fn grow(&self, bytes: usize) {
        struct Growing<'a>(&'a ConnInfo);
        impl Drop for Growing<'_> {
            fn drop(&mut self) {
                self.0.growing.set(self.0.growing.get() - 1);
                self.0.outbox.drained.wake_all();
            }
        }
        self.give_back();
        self.info.growing.set(self.info.growing.get() + 1);
        let _growing = Growing(&self.info);
        self.wait_for_room(bytes, Want::Growth).await;
    }

    pub(crate) fn give_back(&self) {
        let n = self.held.replace(0);
        if n > 0 {
            self.info.reserved.set(self.info.reserved.get() - n);
            self.info.outbox.budget.release(n);
            if let Some(kind) = self.past.replace(None) {
                self.info.outbox.budget.repay(kind, n);
            }
            self.info.outbox.drained.wake_all();
        }
    }

    /// The answer, `queued` bytes, is in the outbox: if this room was taken
    /// past the budget, the answer stays in the overdraft in its place
    /// until it is sent. (The room itself is given back after.)
    fn pass_to_outbox(&self, queued: usize) {
        if let (Some(kind), true) = (self.past.get(), queued > 0) {
            let outbox = &self.info.outbox;
            outbox.budget.overdraw(kind, queued);
            let mut past = outbox.past.get();
            past.add(kind, queued);
            outbox.past.set(past);
        }
    }
}

impl Drop for AnswerRoom {
    fn drop(&mut self) {
        self.give_back();
    }
}

/// Smallest and largest read from a connection's socket (see `serve`).
const MIN_READ: usize = 4 << 10;
const MAX_READ: usize = 64 << 10;
/// Largest read for the rest of a large frame already begun.
const MAX_FRAME_READ: usize = 1 << 20;

/// How long a new connection has to send its HELLO (at most the idle
/// timeout).
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest frame read before a connection's HELLO is through.
const MAX_HELLO_FRAME: u32 = 64 * 1024;

/// A refused HELLO, logged at most once a second per core (a client
/// retrying a bad token, or many of them, cannot flood the log); the
/// client's own name is cut short and escaped.
fn log_refusal(conn: u64, sock: &Shared, client: &str, why: &str) {
    log_rate_limited(&REFUSED_HELLO_LOG, || {
        let peer = sock
            .0
            .borrow()
            .peer_addr()
            .map_or_else(|_| "?".to_string(), |a| a.to_string());
        let client: String = client.chars().take(64).collect();
        format!("conn {conn} from {peer} (client {client:?}) refused: {why}")
    });
}

/// Bytes a request's answer may take, reserved before it runs: a read,
/// poll or dead-letter list's answer holds the records it found (and, for cold reads, the disk
/// chunks they sit in) until it is sent, and a list of streams or groups
/// is built whole before it waits to be queued, so a client that asks for
/// many and reads none must be held up before the broker builds them, not
/// after. A list reserves what it can hold (the streams in the catalog
/// now, or the groups of the shard now), at most a frame.
fn answer_reservation<S: Storage>(req: &Request, core: &Core<S>) -> usize {
    let config = &core.shared.config;
    let cap = config.max_bytes_per_read as usize;
    let frame = config.max_frame_bytes as usize;
    match req {
        // One that may wait takes its room once it has records to read.
        Request::Read { wait_ms, .. } | Request::GroupPoll { wait_ms, .. } if *wait_ms > 0 => 0,
        Request::Read { max_bytes, .. } => (*max_bytes as usize).clamp(1, cap),
        Request::GroupPoll { .. } => cap,
        // A page of dead letters is capped like a read; the whole list only
        // by the frame.
        Request::GroupDeadLettersPage { .. } => cap.min(frame),
        Request::GroupDeadLetters { .. } => frame,
        Request::ListStreams { .. } => {
            let (streams, shards) = core
                .shared
                .catalog
                .lock()
                .unwrap()
                .values()
                .fold((0usize, 0usize), |(n, s), m| (n + 1, s + m.shards as usize));
            (streams * LISTED_STREAM_BYTES + shards * 4).min(frame)
        }
        Request::ListGroups { stream, shard } => core.shard(stream, *shard).map_or(0, |s| {
            (s.groups.borrow().len() * LISTED_GROUP_BYTES + LISTED_GROUP_BYTES).min(frame)
        }),
        _ => 0,
    }
}

/// What one stream of a stream list takes, encoded or decoded, at most
/// (its three names of up to 128 bytes, its settings; its placement apart).
const LISTED_STREAM_BYTES: usize = 640;
/// What one name of a group list takes, encoded or decoded, at most.
const LISTED_GROUP_BYTES: usize = 192;

/// Serve one connection until it closes. `buffered` holds bytes already read
/// (after a hand-off from another core); `handed` says it already moved once.
pub(crate) async fn serve<S: Storage>(
    core: Rc<Core<S>>,
    stream: TcpStream,
    buffered: Vec<u8>,
    handed: bool,
) {
    let _ = stream.set_nodelay(true);
    let idle = Duration::from_millis(core.shared.config.idle_timeout_ms);
    let max_frame = core.shared.config.max_frame_bytes;
    let sock = Shared(Rc::new(RefCell::new(stream)));
    let mut rbuf = BytesMut::with_capacity(MIN_READ);
    let mut read_size = MIN_READ;
    rbuf.extend_from_slice(&buffered);
    core.metrics
        .connections_open
        .set(core.metrics.connections_open.get() + 1);
    if !handed {
        core.metrics
            .connections_accepted
            .set(core.metrics.connections_accepted.get() + 1);
    }
    let conn_id = ((core.core_id() as u64) << 48) | {
        let n = core.next_conn.get() + 1;
        core.next_conn.set(n);
        n
    };
    let outbox = Rc::new(Outbox {
        buf: RefCell::new(BytesMut::new()),
        ready: WaitList::new(),
        closed: Cell::new(false),
        handed_off: Cell::new(false),
        drained: WaitList::new(),
        hangup: WaitList::new(),
        max_frame,
        budget: core.budget.clone(),
        writing: Cell::new(0),
        past: Cell::new(PastAnswers::default()),
    });
    let info = Rc::new(ConnInfo {
        id: conn_id,
        features: Cell::new(0),
        principal: RefCell::new(Arc::from(crate::auth::ANONYMOUS)),
        in_flight: Cell::new(0),
        in_flight_bytes: Cell::new(0),
        reserved: Cell::new(0),
        growing: Cell::new(0),
        done_sending: Cell::new(false),
        outbox: outbox.clone(),
        max_pending: core.shared.config.max_pending_response_bytes,
    });
    let writer = glommio::spawn_local(write_loop(
        sock.clone(),
        outbox.clone(),
        Duration::from_millis(core.shared.config.write_timeout_ms),
    ));
    let mut handed_off = false;
    let mut reader = sock.clone();
    let max_requests = core.shared.config.max_requests_per_connection;
    let max_request_bytes = core.shared.config.max_request_bytes_per_connection;
    let max_pending = core.shared.config.max_pending_response_bytes;
    let intake = Intake::new(&core);
    // A frame begun must be whole within `server.write_timeout_ms` of the
    // broker reading for it (from its first bytes, the last frame decoded
    // before it, or the end of a wait the broker imposed), so a client
    // cannot hold part of a frame, and the budget it counts in, for ever by
    // trickling it.
    let frame_time = Duration::from_millis(core.shared.config.write_timeout_ms);
    let mut frame_by: Option<std::time::Instant> = None;
    // What stops the connection decoding the frames it holds and reading
    // more: its own limits, or the core's budget.
    let waits = |info: &ConnInfo, outbox: &Outbox, rbuf: &BytesMut| {
        info.in_flight.get() >= max_requests
            || info.in_flight_bytes.get() >= max_request_bytes
            || outbox.unsent() >= max_pending
            || intake.budget_bound(info, outbox, rbuf)
    };
    // A connection has this long to say HELLO (however slowly its bytes
    // trickle in), so idle sockets cannot hold connection places.
    let hello_by = std::time::Instant::now() + HELLO_TIMEOUT.min(idle);
    // Stopping: once the requests in flight are done, what the client sends
    // is read and refused (see `STOPPING`) rather than left unanswered,
    // until a read finds nothing more (a client that hears the refusal
    // stops sending) or [`REFUSING`] has passed; then the connection
    // closes. So a client pipelining requests hears about every one it
    // sent before it heard the first refusal.
    let mut refusing_since: Option<std::time::Instant> = None;
    let mut read_nothing = false;
    'conn: loop {
        // Decode the complete frames in the buffer, up to the limits (the
        // rest wait in the buffer until requests finish).
        let mut held_back = false;
        let mut decoded_any = false;
        loop {
            if waits(&info, &outbox, &rbuf) {
                held_back = true;
                break;
            }
            let before = rbuf.len();
            // Until HELLO is through, a frame is at most a HELLO's worth:
            // a client that has not authenticated cannot make the broker
            // buffer (or hash) megabytes.
            let cap = if intake.said_hello() {
                max_frame
            } else {
                max_frame.min(MAX_HELLO_FRAME)
            };
            let decoded = felix_wire::decode_request(&mut rbuf, cap);
            let frame_len = before - rbuf.len();
            if frame_len > 0 {
                intake.frame_taken();
            }
            match decoded {
                Ok(Some((id, req))) => {
                    if !intake.said_hello() {
                        match hello(&core, &info, &outbox, &sock, handed, id, req, &rbuf) {
                            Hello::Said => {
                                intake.hello_through();
                                continue;
                            }
                            Hello::Close => break 'conn,
                            Hello::HandedOff => {
                                handed_off = true;
                                break 'conn;
                            }
                        }
                    }
                    decoded_any = true;
                    if core.stopping.get() {
                        core.metrics.count_error(ErrorCode::Unavailable);
                        let mut e = WireError::new(ErrorCode::Unavailable, STOPPING);
                        // Not handled at all.
                        e.not_applied =
                            info.features.get() & felix_wire::FEATURE_ERROR_NOT_APPLIED != 0;
                        outbox.push(id, &Response::Error(e));
                        continue;
                    }
                    spawn_request(&core, &info, &outbox, id, req, frame_len);
                }
                Ok(None) => break,
                Err(e) => {
                    core.metrics.count_error(e.to_wire_error().code);
                    match e.request_id() {
                        // Before HELLO, a request that does not decode (a
                        // HELLO whose token is not UTF-8, say) ends the
                        // connection as any refused HELLO does.
                        Some(id) if !intake.said_hello() => {
                            log_refusal(conn_id, &sock, "", &e.to_string());
                            outbox.push(id, &Response::Error(e.to_wire_error()));
                            break 'conn;
                        }
                        Some(id) if !e.is_fatal() => {
                            // A request that does not decode is not carried
                            // out at all.
                            let mut w = e.to_wire_error();
                            w.not_applied =
                                info.features.get() & felix_wire::FEATURE_ERROR_NOT_APPLIED != 0;
                            outbox.push(id, &Response::Error(w));
                        }
                        _ => {
                            tracing::debug!(
                                conn = conn_id,
                                "closing connection after malformed frame: {e}"
                            );
                            outbox.push(0, &Response::Error(e.to_wire_error()));
                            break 'conn;
                        }
                    }
                }
            }
        }
        intake.count(&rbuf);
        if rbuf.is_empty() || held_back {
            frame_by = None;
        } else if decoded_any || frame_by.is_none() {
            frame_by = Some(std::time::Instant::now() + frame_time);
        }
        if core.stopping.get() && !held_back {
            // Nothing more is read until the requests in flight are done
            // (a client that keeps sending would otherwise have its
            // refusals crowd out their answers); then one last read.
            while info.in_flight.get() > 0 && !outbox.closed.get() {
                futures_lite::future::or(core.lifecycle.wait(), outbox.hangup.wait()).await;
            }
            if !intake.said_hello() || outbox.closed.get() {
                break;
            }
            let since = match refusing_since {
                Some(since) => since,
                None => {
                    // A quiet read before the refusing began (one made
                    // while requests were still in flight) does not count.
                    read_nothing = false;
                    *refusing_since.insert(std::time::Instant::now())
                }
            };
            if read_nothing || since.elapsed() >= REFUSING {
                break;
            }
        }
        // Backpressure: stop reading a connection that has too many requests
        // (or request bytes) in flight or too many unsent response bytes, or
        // while the core is at its budget, until that drains.
        if intake.budget_bound(&info, &outbox, &rbuf) {
            core.budget.count_wait();
        }
        let stalled = waits(&info, &outbox, &rbuf);
        while waits(&info, &outbox, &rbuf) && !outbox.closed.get() {
            let drained = outbox.drained.wait();
            let finished = core.lifecycle.wait();
            if intake.budget_bound(&info, &outbox, &rbuf) {
                // Only connections the budget holds listen for it: a release
                // wakes every listener.
                let freed = core.budget.wait_freed();
                futures_lite::future::or(drained, futures_lite::future::or(finished, freed)).await;
            } else {
                futures_lite::future::or(drained, finished).await;
            }
        }
        if outbox.closed.get() {
            break;
        }
        if held_back {
            // Frames left in the buffer: decode them before reading more.
            continue;
        }
        // A frame begun and not yet admitted: room for all of it first.
        let waited = intake.admit(&rbuf, &info, &outbox, max_frame).await;
        if outbox.closed.get() {
            break;
        }
        if (stalled || waited) && frame_by.is_some() {
            // The broker stopped reading for a while: a frame begun gets
            // its full time again now that it reads on.
            frame_by = Some(std::time::Instant::now() + frame_time);
        }
        if !intake.said_hello() && std::time::Instant::now() >= hello_by {
            tracing::debug!(conn = conn_id, "closing a connection that never said HELLO");
            break;
        }
        // Read more, straight into the frame buffer (no bounce buffer held in
        // the connection's future), with the idle timeout while nothing is
        // in flight. Reads grow while they come back full and shrink when
        // they come back small, so that an idle connection holds a few KiB
        // (and the buffer is zeroed only as far as data is likely to come),
        // and a buffer a burst grew large is let go once it is empty.
        let filled = rbuf.len();
        make_room_to_read(&mut rbuf, read_size, max_frame, &core.budget);
        let spare = &mut rbuf[filled..];
        let wait = if intake.said_hello() {
            idle
        } else {
            hello_by
                .saturating_duration_since(std::time::Instant::now())
                .max(Duration::from_millis(1))
        };
        let wait = frame_by.map_or(wait, |t| {
            wait.min(
                t.saturating_duration_since(std::time::Instant::now())
                    .max(Duration::from_millis(1)),
            )
        });
        // Stopping: short reads, each finding nothing ending the refusing.
        let stopping = core.stopping.get();
        let wait = if stopping {
            wait.min(STOPPING_READ)
        } else {
            wait
        };
        let read = async {
            Some(
                glommio::timer::timeout(wait, async {
                    reader
                        .read(spare)
                        .await
                        .map_err(glommio::GlommioError::from)
                })
                .await,
            )
        };
        // The stop cuts a read short once; from then on the requests
        // decoded are refused while those in flight finish.
        let got = if stopping {
            read.await
        } else {
            futures_lite::future::or(read, async {
                core.until_stopping().await;
                None
            })
            .await
        };
        let Some(got) = got else {
            rbuf.truncate(filled);
            continue;
        };
        let n = *got.as_ref().unwrap_or(&0);
        rbuf.truncate(filled + n);
        intake.count(&rbuf);
        if n >= read_size {
            read_size = (read_size * 2).min(MAX_READ);
        } else if n < read_size / 4 {
            read_size = (read_size / 2).max(MIN_READ);
        }
        match got {
            Ok(0) => {
                // The client shut its side (a half-close) or closed: answer
                // what it sent before closing. A waiting read or poll stops
                // waiting (see `ConnInfo::done_sending`).
                info.done_sending.set(true);
                outbox.hangup.wake_all();
                while info.in_flight.get() > 0 && !outbox.closed.get() {
                    futures_lite::future::or(core.lifecycle.wait(), outbox.hangup.wait()).await;
                }
                break;
            }
            Ok(_) => read_nothing = false,
            Err(glommio::GlommioError::TimedOut(_)) if stopping => read_nothing = true,
            Err(glommio::GlommioError::TimedOut(_)) => {
                if frame_by.is_some_and(|t| std::time::Instant::now() >= t) {
                    tracing::debug!(
                        conn = conn_id,
                        "closing a connection that did not finish a frame it began in time"
                    );
                    core.metrics
                        .frame_timeouts
                        .set(core.metrics.frame_timeouts.get() + 1);
                    break;
                }
                if info.in_flight.get() == 0 {
                    tracing::debug!(conn = conn_id, "closing idle connection");
                    break;
                }
            }
            Err(_) => {
                if core.stopping.get() {
                    // Let in-flight requests answer, then close.
                    while info.in_flight.get() > 0 {
                        core.lifecycle.wait().await;
                    }
                }
                break;
            }
        }
    }
    intake.release();
    // Let the writer send what is queued, then close.
    outbox.closed.set(true);
    outbox.ready.wake_all();
    outbox.drained.wake_all();
    outbox.hangup.wake_all();
    // A client cut off for taking too little (or a failed connection) has
    // lost its answers already: nothing to linger for.
    let ended = writer.await;
    if ended == Ended::CutOff {
        core.metrics
            .connections_cut_off
            .set(core.metrics.connections_cut_off.get() + 1);
    }
    if !handed_off && ended == Ended::Delivered {
        linger(&mut reader, frame_time).await;
    }
    core.metrics
        .connections_open
        .set(core.metrics.connections_open.get() - 1);
    if !handed_off {
        core.shared.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Make the read buffer `rbuf` (holding what came of frames not yet whole)
/// longer by the next read's size: about `read_size` (what the
/// connection's recent reads suggest), more for a large frame partly here.
/// The read goes into the zeroed bytes past what it held.
fn make_room_to_read(rbuf: &mut BytesMut, read_size: usize, max_frame: u32, budget: &Budget) {
    let filled = rbuf.len();
    // A large frame partly here is read in pieces as big as what it
    // still lacks (up to 1 MiB), not 64 KiB at a time. Its declared size
    // was checked against the frame cap when it was decoded as
    // incomplete. The piece is at most four times what already came,
    // so a peer that sends a header declaring a large frame and then
    // nothing does not make the broker hold (and zero) a megabyte.
    let lacking = felix_wire::peek_header(rbuf)
        .filter(|h| h.len <= max_frame)
        .map_or(0, |h| h.frame_bytes().saturating_sub(filled));
    let read_size_now = read_size.max(
        lacking
            .min(MAX_FRAME_READ)
            .min(4 * filled.max(MAX_READ / 4)),
    );
    if filled > 0
        && rbuf.capacity() < filled + read_size_now
        && read_size >= MAX_READ
        && !budget.over(MAX_FRAME_READ)
    {
        // A new allocation copies what is buffered, the start of a frame
        // the last read ended inside (earlier frames still hold the old
        // one). A busy connection (its reads came back full) gets room
        // for many reads at once while the core has memory to spare, so
        // that copy is made once per MiB rather than on almost every
        // read: with 64 KiB publishes it was a copy of nearly every
        // byte. Not one whose only claim is a large declared frame.
        rbuf.reserve(MAX_FRAME_READ.max(read_size_now));
    }
    rbuf.resize(filled + read_size_now, 0);
    if filled == 0 && rbuf.capacity() > 4 * MAX_READ {
        // `resize` took back the whole allocation a large frame left
        // (nothing else holds it now): not for an idle wait.
        *rbuf = BytesMut::with_capacity(read_size_now);
        rbuf.resize(read_size_now, 0);
    }
}

/// The answer to a request that arrives while the broker stops: it was not
/// carried out, and another broker (or this one, restarted) can take it.
const STOPPING: &str = "the broker is shutting down: this request was not carried out";

/// How long a read waits while the broker stops: a read that finds
/// nothing for this long ends the refusing (the client has stopped
/// sending).
const STOPPING_READ: Duration = Duration::from_millis(100);

/// The longest a stopping broker goes on reading and refusing a
/// connection's requests (a client that never stops sending is then cut
/// off).
const REFUSING: Duration = Duration::from_millis(500);

/// How a hand-off to another core went.
enum HandOff {
    Sent,
    /// No descriptor to send (out of them): the connection stays here.
    Kept,
    /// The core takes no more (it is stopping).
    Refused,
}

/// Send the socket to core `to` through its mailbox.
fn hand_off<S: Storage>(core: &Rc<Core<S>>, sock: &Shared, to: u32, bytes: Vec<u8>) -> HandOff {
    let Some(tx) = core.shared.senders.get(to as usize) else {
        return HandOff::Refused;
    };
    // The other core gets its own descriptor; ours closes when this
    // connection's task ends.
    let raw = sock.0.borrow().as_raw_fd();
    // SAFETY: duplicates a descriptor this connection holds open.
    let dup = unsafe { libc::fcntl(raw, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return HandOff::Kept;
    }
    // SAFETY: `dup` is a new descriptor nobody else owns.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(dup) };
    match tx.send(CoreMsg::Handoff(Handoff {
        fd,
        buffered: bytes,
    })) {
        Ok(()) => {
            core.metrics.handoffs.set(core.metrics.handoffs.get() + 1);
            HandOff::Sent
        }
        // The message, and the duplicate with it, is dropped here.
        Err(_) => HandOff::Refused,
    }
}

fn spawn_request<S: Storage>(
    core: &Rc<Core<S>>,
    info: &Rc<ConnInfo>,
    outbox: &Rc<Outbox>,
    id: u64,
    req: Request,
    frame_len: usize,
) {
    // felix_publish_seconds runs from here (the request just decoded) to
    // its answer queued for the socket.
    let publish_wait = match &req {
        Request::Publish { ack, .. } => Some((
            std::time::Instant::now(),
            if core.replication.get().is_some() {
                AckWait::Replicated
            } else {
                AckWait::of(*ack, core.shared.config.ack_on_commit)
            },
        )),
        _ => None,
    };
    let core = core.clone();
    let info = info.clone();
    let outbox = outbox.clone();
    // What the request holds: its frame, and what decoding built beside it
    // (an ack's offsets; a publish is read in place).
    let held = frame_len + req.decoded_overhead();
    // Let through past the budget (this connection held nothing): counted
    // in the overdraft until it is done.
    let overdrawn = core.budget.full() && info.in_flight.get() == 0 && outbox.unsent() == 0;
    if overdrawn {
        core.budget
            .overdraw(Past::Requests, held + REQUEST_TASK_BYTES);
    }
    core.in_flight.set(core.in_flight.get() + 1);
    info.in_flight.set(info.in_flight.get() + 1);
    info.in_flight_bytes.set(info.in_flight_bytes.get() + held);
    // The core's budget also counts the task (a long poll keeps it).
    core.budget.add(held + REQUEST_TASK_BYTES);
    glommio::spawn_local(async move {
        let op = req.name();
        core.metrics.count_request(op);
        let max_pending = core.shared.config.max_pending_response_bytes;
        let room = AnswerRoom::new(&info);
        let refused = unnegotiated(&req, &info).or_else(|| forbidden(&core, &info, &req));
        let resp = match refused {
            Some(refused) => refused,
            None => {
                // Room for the answer first.
                // Reads, polls and pages answer within the room they hold.
                let want = match req {
                    Request::Read { .. }
                    | Request::GroupPoll { .. }
                    | Request::GroupDeadLettersPage { .. } => Want::UpTo,
                    _ => Want::All,
                };
                room.take_as(answer_reservation(&req, &core), want).await;
                handle(&core, &info, &room, req).await
            }
        };
        let mut resp = resp;
        if let Response::Error(e) = &mut resp {
            core.metrics.count_error(e.code);
            // A trailing field a client that did not negotiate it would
            // not expect.
            e.not_applied &= info.features.get() & felix_wire::FEATURE_ERROR_NOT_APPLIED != 0;
        }
        // A client that sends requests but does not read its answers holds
        // them here, not in an ever-growing outbox: at most
        // `max_pending_response_bytes` plus one answer is encoded and unsent.
        while outbox.unsent() >= max_pending && !outbox.closed.get() {
            outbox.drained.wait().await;
        }
        let published = matches!(resp, Response::Published { .. });
        let queued = outbox.push(id, &resp);
        room.pass_to_outbox(queued);
        drop(resp);
        if let (Some((decoded, wait)), true) = (publish_wait, published) {
            core.metrics
                .publish_latency
                .borrow_mut()
                .record(wait, decoded.elapsed());
        }
        room.give_back();
        core.in_flight.set(core.in_flight.get() - 1);
        info.in_flight.set(info.in_flight.get() - 1);
        info.in_flight_bytes.set(info.in_flight_bytes.get() - held);
        core.budget.release(held + REQUEST_TASK_BYTES);
        if overdrawn {
            core.budget.repay(Past::Requests, held + REQUEST_TASK_BYTES);
        }
        core.lifecycle.wake_all();
    })
    .detach();
}

/// The guide's rule: a client never sends a call or a field the broker did
/// not advertise; one that does is refused whole, not half-served. One check
/// for every request, from the same table the client uses, before it takes
/// any room.
fn unnegotiated(req: &Request, info: &ConnInfo) -> Option<Response> {
    let missing = req.required_features() & !info.features.get();
    if missing == 0 {
        return None;
    }
    let why = if missing & felix_wire::FEATURE_GROUPS != 0 {
        " (a broker without durable storage offers no consumer groups)"
    } else {
        ""
    };
    Some(refused(
        ErrorCode::Unsupported,
        format!(
            "{} needs {}, which this connection did not negotiate in HELLO{why}",
            req.name(),
            felix_wire::feature_names(missing)
        ),
    ))
}

/// A request the connection's principal holds no permission for
/// (`security.acl_file`), refused before it takes any room.
fn forbidden<S: Storage>(core: &Core<S>, info: &ConnInfo, req: &Request) -> Option<Response> {
    let why = core.with_security(|sec| {
        sec.acl
            .as_ref()
            .and_then(|a| a.refuses(&info.principal.borrow(), req))
    })?;
    // The names in `why` are the request's own, not yet checked: a client
    // must not be able to write lines of its own into the log.
    log_rate_limited(&FORBIDDEN_LOG, || {
        format!(
            "conn {}: {} refused: {}",
            info.id,
            req.name(),
            loggable(&why, 512)
        )
    });
    Some(refused(ErrorCode::Unauthorized, why))
}

thread_local! {
    /// When a core last logged a refused call, and how many it left out
    /// since.
    static FORBIDDEN_LOG: LogLimit = const { Cell::new(None) };
    /// The same for refused HELLOs.
    static REFUSED_HELLO_LOG: LogLimit = const { Cell::new(None) };
}

/// A `Stream` answer carries the stream's incarnation only to a client
/// that negotiated it (it is a trailing field others would not expect).
fn with_incarnation(info: &ConnInfo, mut resp: Response) -> Response {
    if info.features.get() & felix_wire::FEATURE_STREAM_INCARNATION == 0 {
        if let Response::Stream(s) = &mut resp {
            s.incarnation = None;
        }
    }
    resp
}

/// When a core last logged a line of one kind, and how many it left out
/// since (see [`log_rate_limited`]).
pub(crate) type LogLimit = Cell<Option<(std::time::Instant, u64)>>;

/// `text` from a client, fit for a log line: control characters (line
/// breaks, terminal escapes), Unicode line separators and bidirectional
/// controls escaped, and backslashes too (so an escape cannot be faked),
/// cut to its first `max` characters.
fn loggable(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push_str(&format!("... ({} bytes in all)", text.len()));
            break;
        }
        if c.is_control()
            || c == '\\'
            || matches!(c, '\u{2028}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
        {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Log at info at most once a second per core (per `last`), saying how
/// many lines were left out since.
fn log_rate_limited(last: &'static std::thread::LocalKey<LogLimit>, line: impl FnOnce() -> String) {
    if let Some(quiet) = rate_limit(last) {
        tracing::info!(also_refused = quiet, "{}", line());
    }
}

/// The same at warn: a condition the operator should act on.
pub(crate) fn warn_rate_limited(
    last: &'static std::thread::LocalKey<LogLimit>,
    line: impl FnOnce() -> String,
) {
    if let Some(quiet) = rate_limit(last) {
        tracing::warn!(left_out = quiet, "{}", line());
    }
}

/// Whether a line of `last`'s kind may be logged now (a second after the
/// last one), and if so how many were left out since.
fn rate_limit(last: &'static std::thread::LocalKey<LogLimit>) -> Option<u64> {
    let now = std::time::Instant::now();
    let quiet = match last.get() {
        Some((at, quiet)) if now.duration_since(at) < Duration::from_secs(1) => {
            last.set(Some((at, quiet + 1)));
            return None;
        }
        Some((_, quiet)) => quiet,
        None => 0,
    };
    last.set(Some((now, 0)));
    Some(quiet)
}

fn log_err(shard: &str, e: LogError) -> Response {
    match e {
        LogError::Stopped(r) => wire_err(
            ErrorCode::Unavailable,
            format!("shard {shard} is stopped: {r}"),
        ),
        LogError::Closed => wire_err(
            ErrorCode::Unavailable,
            format!("shard {shard} is shutting down"),
        ),
        LogError::Empty => wire_err(
            ErrorCode::InvalidRequest,
            "a publish needs at least one record",
        ),
        LogError::Invalid(why) => wire_err(ErrorCode::InvalidRequest, why),
        other => wire_err(ErrorCode::Internal, format!("shard {shard}: {other}")),
    }
}

/// `resp`, an error, marked as a request refused before anything of it
/// was done ([`WireError::not_applied`]): a publish answered so stored none
/// of its records, and the client may send it again.
fn not_applied(mut resp: Response) -> Response {
    if let Response::Error(e) = &mut resp {
        e.not_applied = true;
    }
    resp
}

fn refused(code: ErrorCode, msg: impl Into<String>) -> Response {
    Response::Error(WireError::refused(code, msg))
}

async fn handle<S: Storage>(
    core: &Rc<Core<S>>,
    info: &Rc<ConnInfo>,
    room: &AnswerRoom,
    req: Request,
) -> Response {
    match req {
        Request::Hello { .. } => wire_err(
            ErrorCode::InvalidRequest,
            "HELLO was already sent on this connection",
        ),
        Request::Ping => Response::Pong,
        Request::DescribeCluster => match &core.shared.config.cluster {
            Some(c) => Response::Cluster(felix_wire::ClusterInfo {
                node: c.node_id,
                members: c
                    .nodes
                    .iter()
                    .map(|n| felix_wire::ClusterMember {
                        node: n.id,
                        addr: n.client.clone(),
                    })
                    .collect(),
            }),
            None => wire_err(
                ErrorCode::Unsupported,
                "describe_cluster: this broker is not in a cluster",
            ),
        },
        Request::CreateStream {
            stream,
            shards,
            retention_bytes,
            retention_ms,
            incarnation,
        } => with_incarnation(
            info,
            core.create_stream(&stream, shards, retention_bytes, retention_ms, incarnation)
                .await,
        ),
        Request::DescribeStream { stream } => {
            let name = match to_name(&stream) {
                Ok(n) => n,
                Err(e) => return e,
            };
            let meta = core.shared.catalog.lock().unwrap().get(&name).cloned();
            match meta {
                Some(m) => with_incarnation(info, Response::Stream(core.stream_info(&m))),
                None => core.shared.no_stream(&name),
            }
        }
        Request::ListStreams { tenant } => {
            // A name no stream can have is a mistake, not an empty list.
            if let Some(Err(e)) = tenant
                .as_deref()
                .map(|t| felix_engine::types::validate_name("tenant", t))
            {
                return wire_err(ErrorCode::InvalidRequest, e.to_string());
            }
            let metas: Vec<_> = core
                .shared
                .catalog
                .lock()
                .unwrap()
                .values()
                .filter(|m| tenant.as_deref().is_none_or(|t| m.name.tenant() == t))
                .cloned()
                .collect();
            // Leave out what the principal holds nothing on.
            let metas = core.with_security(|sec| match &sec.acl {
                None => metas,
                Some(acl) => {
                    let principal = info.principal.borrow();
                    metas
                        .into_iter()
                        .filter(|m| acl.sees(&principal, &crate::broker::to_ref(&m.name)))
                        .collect()
                }
            });
            Response::Streams(
                metas
                    .iter()
                    .map(|m| StreamInfo {
                        incarnation: None,
                        ..core.stream_info(m)
                    })
                    .collect(),
            )
        }
        Request::DeleteStream { stream } => core.delete_stream(&stream).await,
        Request::DescribeShard { stream, shard } => match core.shard(&stream, shard) {
            Ok(s) => {
                let st = s.log.stats();
                Response::Shard(ShardInfo {
                    stream,
                    shard,
                    core: core.core_id(),
                    start_offset: st.start.0,
                    end_offset: st.end.0,
                    bytes: st.bytes,
                    segments: st.segments,
                    stopped: st.stopped,
                })
            }
            Err(e) => e,
        },
        Request::DescribeReplica { stream, shard } => match core.shard(&stream, shard) {
            Ok(s) => match core.replication.get() {
                Some(r) => r.describe(&s, stream),
                None => wire_err(
                    ErrorCode::Unsupported,
                    "describe_replica: this broker is not in a cluster",
                ),
            },
            Err(e) => e,
        },
        Request::Publish {
            stream,
            target,
            ack,
            records,
        } => publish(core, stream, target, ack, records).await,
        Request::Read {
            stream,
            shard,
            from,
            max_records,
            max_bytes,
            wait_ms,
        } => {
            read(
                core,
                room,
                stream,
                shard,
                from,
                max_records,
                max_bytes,
                wait_ms,
            )
            .await
        }
        other => crate::groups::handle(core, info, room, other).await,
    }
}

async fn publish<S: Storage>(
    core: &Rc<Core<S>>,
    stream: StreamRef,
    target: PublishTarget,
    ack: AckMode,
    records: PublishRecords,
) -> Response {
    let shard_no = match &target {
        PublishTarget::Shard(s) => *s,
        PublishTarget::Key(k) => match core.shard_count(&stream) {
            Some(n) => felix_wire::shard_for_key(k, n),
            None => match core.shard(&stream, 0) {
                Err(e) => return not_applied(e),
                Ok(_) => unreachable!("a stream with a shard has a count"),
            },
        },
    };
    let shard = match core.shard(&stream, shard_no) {
        Ok(s) => s,
        Err(e) => return not_applied(e),
    };
    if records.is_empty() {
        return refused(
            ErrorCode::InvalidRequest,
            "a publish needs at least one record",
        );
    }
    let max = core.shared.config.max_records_per_publish;
    if records.len() as u64 > max as u64 {
        return refused(
            ErrorCode::TooLarge,
            format!(
                "{} records in one publish; the limit is {max}",
                records.len()
            ),
        );
    }
    // One pass: the largest record the broker can answer, the bytes
    // published (as reads count them: key, header names and values,
    // payload), and the first record stamped past
    // limits.max_timestamp_ahead_ms (retention by age goes by timestamps, so
    // a clock far ahead would keep a segment forever).
    let biggest = core.shared.config.max_frame_bytes as usize - ANSWER_HEADROOM;
    let now = now_ms();
    let ahead = core.shared.config.max_timestamp_ahead_ms;
    let limit = ahead.map(|a| now.saturating_add(a));
    let mut too_far = None;
    let mut bytes = 0u64;
    for (i, r) in records.iter().enumerate() {
        let carried = r.carried_bytes();
        // As an answer carries it, less fixed framing: each header adds its
        // name's and value's lengths.
        let n = carried + r.headers.len() * 8;
        if n > biggest {
            return refused(
                ErrorCode::TooLarge,
                format!(
                    "record {i} carries {n} bytes; the largest record this broker takes is \
                     {biggest} bytes (server.max_frame_bytes less {ANSWER_HEADROOM} bytes of \
                     answer framing, so that it can be read back)"
                ),
            );
        }
        bytes += carried as u64;
        if let (Some(l), Some(t)) = (limit, r.timestamp_ms) {
            if t > l && too_far.is_none() {
                too_far = Some((i, t));
            }
        }
    }
    if let Some((i, ts)) = too_far {
        return refused(
            ErrorCode::InvalidRequest,
            format!(
                "record {i} has timestamp {ts}, {} ms ahead of the broker's clock; \
                 at most {} ms ahead is accepted (limits.max_timestamp_ahead_ms), \
                 because retention by age goes by timestamps",
                ts - now,
                ahead.unwrap_or(0)
            ),
        );
    }
    // Counted against the free space until answered.
    let _admitted = match core.disk.admit(bytes) {
        Ok(a) => a,
        Err(msg) => return refused(ErrorCode::Unavailable, msg),
    };
    if let Err(e) = shard.log.wait_room().await {
        if shard.log.is_closed() {
            // Deleted while the publish waited for room.
            return not_applied(shard.closed_answer());
        }
        return not_applied(log_err(&shard.name(), e));
    }
    // Read in place from the frame, copied once: into the log's batch.
    let recs = records.iter().map(|record| Stamped { record, now });
    if let Some(r) = core.replication.get() {
        // Through the shard's leader; every replica writes it to its log
        // once committed.
        let answer = r.publish(&shard, recs).await;
        if let Response::Published { count, .. } = &answer {
            let m = &core.metrics;
            m.publish_records
                .set(m.publish_records.get() + u64::from(*count));
            m.publish_bytes.set(m.publish_bytes.get() + bytes);
        }
        return answer;
    }
    let appended = match shard.log.append(recs) {
        Ok(a) => a,
        // Nothing of it queued.
        Err(e) => return not_applied(log_err(&shard.name(), e)),
    };
    // The log copied them: let go of the read buffer they are a view of
    // before waiting for the flush.
    drop(records);
    let frontier = match AckWait::of(ack, core.shared.config.ack_on_commit) {
        AckWait::Durable => Frontier::Durable,
        _ => Frontier::Queued,
    };
    if let Err(e) = shard.log.wait(appended.lsn, frontier).await {
        // Queued, perhaps written: what became of it is not known.
        return log_err(&shard.name(), e);
    }
    let m = &core.metrics;
    m.publish_records
        .set(m.publish_records.get() + appended.count as u64);
    m.publish_bytes.set(m.publish_bytes.get() + bytes);
    Response::Published {
        shard: shard_no,
        base_offset: appended.base.0,
        count: appended.count,
    }
}

pub(crate) fn to_wire_record(r: felix_engine::format::Record) -> Record {
    Record {
        offset: r.offset.0,
        timestamp_ms: r.timestamp_ms,
        key: r.key,
        headers: Headers::from_checked(r.headers.len() as u32, r.headers.encoded().clone()),
        payload: r.payload,
    }
}

/// What a record read back adds to an answer: what it carries and its
/// fields, as a `Records` answer (`claim: None`) or a `GroupRecords` one
/// (`Some(skipped_before is sent)`) encodes them.
pub(crate) fn answer_size(r: &felix_engine::format::Record, claim: Option<bool>) -> usize {
    let has_key = r.key.is_some();
    r.size_bytes()
        + match claim {
            None => Record::framing_bytes(has_key, r.headers.len()),
            Some(skipped) => GroupRecord::framing_bytes(has_key, r.headers.len(), skipped),
        }
}

/// Bytes an answer's records may take so that the frame stays within the
/// cap announced in HELLO (which counts the frame's `len`: the header after
/// it and the body).
pub(crate) fn records_room(max_frame: u32, fixed: usize) -> usize {
    (max_frame as usize).saturating_sub(felix_wire::FRAME_HEADER_BYTES - 4 + fixed)
}

/// Cut `records` (in offset order) to those whose answer fits in `room`
/// bytes, keeping at least the first (one that alone passes the cap is
/// answered `too_large` by [`Outbox::push`]). Returns the offset of the
/// first record cut, where the next read starts.
fn fit_in_frame(
    records: &mut Vec<felix_engine::format::Record>,
    room: usize,
    size: impl Fn(&felix_engine::format::Record) -> usize,
) -> Option<Offset> {
    let mut used = 0usize;
    let cut = records.iter().enumerate().position(|(i, r)| {
        used = used.saturating_add(size(r));
        i > 0 && used > room
    })?;
    let next = records[cut].offset;
    records.truncate(cut);
    Some(next)
}

/// Resolve a start position against a shard, refusing offsets past the tail.
pub(crate) fn resolve_start<S: Storage>(
    shard: &Shard<S>,
    from: StartPosition,
) -> Result<Offset, Response> {
    let (start, end) = (shard.log.start(), shard.log.end());
    match from {
        StartPosition::Earliest => Ok(start),
        StartPosition::Latest => Ok(end),
        StartPosition::Offset(n) if n > end.0 => Err(wire_err(
            ErrorCode::InvalidRequest,
            format!(
                "offset {n} is past the tail of shard {} (end {})",
                shard.name(),
                end.0
            ),
        )),
        StartPosition::Offset(n) => Ok(Offset(n)),
    }
}

/// Wait until `f` is ready or `ms` pass; `None` on timeout.
pub(crate) async fn with_timeout<T>(ms: u64, f: impl std::future::Future<Output = T>) -> Option<T> {
    let sleep = async {
        glommio::timer::sleep(Duration::from_millis(ms)).await;
        None
    };
    futures_lite::future::or(async { Some(f.await) }, sleep).await
}

#[allow(clippy::too_many_arguments)]
async fn read<S: Storage>(
    core: &Rc<Core<S>>,
    room: &AnswerRoom,
    stream: StreamRef,
    shard: u32,
    from: StartPosition,
    max_records: u32,
    max_bytes: u32,
    wait_ms: u32,
) -> Response {
    let s = match core.shard(&stream, shard) {
        Ok(s) => s,
        Err(e) => return e,
    };
    let from = match resolve_start(&s, from) {
        Ok(o) => o,
        Err(e) => return e,
    };
    let c = &core.shared.config;
    // The byte cap counts what records hold (what they carry, and their
    // headers' lengths), and never more than the frame cap leaves for them;
    // their fields are counted when the answer is cut to the frame below.
    let frame_room = records_room(c.max_frame_bytes, Response::RECORDS_FIXED_BYTES);
    let limits = ReadLimits {
        max_records: max_records.clamp(1, c.max_records_per_read) as usize,
        max_bytes: (max_bytes.clamp(1, c.max_bytes_per_read) as usize).min(frame_room.max(1)),
    };
    let wait = (wait_ms as u64).min(c.max_wait_ms);
    if wait > 0 && s.log.end() <= from {
        // A shutdown ends the wait early: the poll answers with what is
        // there. So does the client hanging up (nothing to answer).
        let _ = with_timeout(
            wait,
            futures_lite::future::or(
                async {
                    let _ = s.log.wait_for_offset(from).await;
                },
                futures_lite::future::or(core.until_stopping(), room.info.until_hung_up()),
            ),
        )
        .await;
    }
    if s.log.is_closed() {
        // Deleted while the read waited (or the broker is stopping).
        return s.closed_answer();
    }
    // Nobody to answer: read nothing (the answer would be dropped).
    let nobody = || Response::Records {
        start_offset: s.log.start().0,
        next_offset: from.0,
        end_offset: s.log.end().0,
        records: Vec::new(),
    };
    if room.info.hung_up() {
        return nobody();
    }
    // The room taken covers what the read holds, its first record too: a
    // first record larger than the room (a client may ask for one byte),
    // or a disk read larger than it to reach that record, is left, the
    // room grown to what it takes, and the read made again (the records
    // after the first still keep to the byte cap). So a client pipelining
    // reads of large records holds, and brings from disk, no more than the
    // room its connection may take.
    room.take(limits.max_bytes).await;
    let read = loop {
        let held = room.held();
        // Room taken past the core's budget may be less than the cap.
        let limits = ReadLimits {
            max_bytes: limits.max_bytes.min(held),
            ..limits
        };
        match s.log.read_within(from, limits, held).await {
            Ok(ReadResult {
                first_needs: Some(n),
                ..
            }) if n > held => {
                room.grow(n).await;
                if s.log.is_closed() {
                    return s.closed_answer();
                }
                if room.info.hung_up() {
                    return nobody();
                }
            }
            r => break r,
        }
    };
    match read {
        Ok(mut r) => {
            if let Some(next) = fit_in_frame(&mut r.records, frame_room, |r| answer_size(r, None)) {
                r.next = next;
            }
            let m = &core.metrics;
            m.read_records
                .set(m.read_records.get() + r.records.len() as u64);
            let carried: usize = r.records.iter().map(|r| r.size_bytes()).sum();
            m.read_bytes.set(m.read_bytes.get() + carried as u64);
            Response::Records {
                start_offset: r.start.0,
                next_offset: r.next.0,
                end_offset: r.end.0,
                records: r.records.into_iter().map(to_wire_record).collect(),
            }
        }
        Err(e) => log_err(&s.name(), e),
    }
}

#[cfg(test)]
mod tests {
    use super::loggable;

    #[test]
    fn a_clients_text_cannot_break_or_flood_a_log_line() {
        let forged = "t1/x/evil\n2026-12-04T23:59:59Z  INFO felix: forged\x1b[31m";
        let line = loggable(forged, 512);
        assert!(!line.contains('\n') && !line.contains('\x1b'), "{line}");
        assert!(line.contains("evil\\n2026") && line.contains("\\u{1b}[31m"));
        assert_eq!(loggable("t1/ns/stream", 512), "t1/ns/stream");
        // A faked escape, a line separator, a right-to-left override.
        assert_eq!(
            loggable("a\\nb\u{2028}c\u{202e}d", 512),
            "a\\\\nb\\u{2028}c\\u{202e}d"
        );
        let long = "é".repeat(70_000);
        let cut = loggable(&long, 512);
        assert!(cut.starts_with(&"é".repeat(512)));
        assert!(
            cut.ends_with("... (140000 bytes in all)"),
            "{}",
            &cut[1000..]
        );
    }
}

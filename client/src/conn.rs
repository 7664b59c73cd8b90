//! One TCP connection to one core of a broker.
//!
//! A connection runs two tasks: a writer that drains a channel of encoded
//! frames into the socket (batching whatever is queued into one flush), and
//! a reader that decodes response frames and hands each to the caller
//! waiting on its request id. Any number of requests can be in flight, and
//! they are answered in whatever order the broker finishes them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_wire::{
    decode_response, encode_request, peek_header, Request, Response, FEATURES_ALL, PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::config::ClientConfig;
use crate::error::{ClientError, Result};

/// What the broker said in answer to HELLO on one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HelloInfo {
    pub version: u16,
    pub features: u64,
    pub cores: u32,
    pub core: u32,
    pub max_frame_bytes: u32,
    pub broker: String,
}

type Reply = Result<Response>;

/// Requests waiting for an answer, and whether the connection is gone.
/// One lock covers both so a request is never registered on a connection
/// that has already failed its waiters.
struct Pending {
    closed: Option<String>,
    waiters: HashMap<u64, oneshot::Sender<Reply>>,
}

struct Shared {
    pending: Mutex<Pending>,
    /// The broker answered a request on this connection (see
    /// [`Conn::answered`]).
    answered: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        // A panic while holding this lock cannot leave the map inconsistent
        // (every operation is a single insert/remove), so poisoning is moot.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&self, id: u64, tx: oneshot::Sender<Reply>) -> Result<()> {
        let mut p = self.lock();
        if p.closed.is_some() {
            return Err(ClientError::Disconnected);
        }
        p.waiters.insert(id, tx);
        Ok(())
    }

    fn complete(&self, id: u64, reply: Reply) {
        let waiter = self.lock().waiters.remove(&id);
        match waiter {
            Some(tx) => {
                let _ = tx.send(reply);
            }
            // Timed out or cancelled: nobody is waiting any more.
            None => tracing::debug!(request_id = id, "answer to a request nobody waits for"),
        }
    }

    fn forget(&self, id: u64) {
        self.lock().waiters.remove(&id);
    }

    /// Mark the connection dead and fail every request in flight on it.
    fn close(&self, reason: String) {
        let waiters = {
            let mut p = self.lock();
            if p.closed.is_none() {
                tracing::debug!(%reason, in_flight = p.waiters.len(), "felix connection closed");
                p.closed = Some(reason);
            }
            std::mem::take(&mut p.waiters)
        };
        for (_, tx) in waiters {
            let _ = tx.send(Err(ClientError::Disconnected));
        }
    }

    fn is_closed(&self) -> bool {
        self.lock().closed.is_some()
    }
}

/// An answer still to come for a request already handed to the writer.
/// Dropping it forgets the request: a late answer is discarded.
pub(crate) struct Waiter {
    shared: Arc<Shared>,
    id: u64,
    rx: oneshot::Receiver<Reply>,
    deadline: tokio::time::Instant,
}

impl Waiter {
    /// The answer, or [`ClientError::Timeout`] at the request's deadline.
    /// An answer that already arrived is returned even past the deadline.
    pub(crate) async fn wait(mut self) -> Result<Response> {
        match tokio::time::timeout_at(self.deadline, &mut self.rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(ClientError::Disconnected),
            Err(_) => Err(ClientError::Timeout),
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.shared.forget(self.id);
    }
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter").field("id", &self.id).finish()
    }
}

pub(crate) struct Conn {
    tx: mpsc::Sender<Bytes>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    pub hello: HelloInfo,
    reader: tokio::task::JoinHandle<()>,
    opened: std::time::Instant,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The writer ends by itself once `tx` is gone and shuts the socket's
        // write side; the reader would otherwise wait for the broker to
        // close.
        self.reader.abort();
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("core", &self.hello.core)
            .field("closed", &self.shared.is_closed())
            .finish()
    }
}

/// TCP keepalive: first probe after this long without traffic, then one
/// every interval, the connection dropped after this many unanswered.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 3;
/// Longest sent bytes may go unacknowledged by the peer's TCP.
const UNACKED_TIMEOUT: Duration = Duration::from_secs(60);

impl Conn {
    /// Connect to the first address that answers, say HELLO (asking for
    /// `want_core` if given) and start the reader and writer tasks. The whole
    /// exchange is bounded by `config.connect_timeout`.
    pub(crate) async fn open(
        addrs: &[SocketAddr],
        want_core: Option<u32>,
        config: &ClientConfig,
    ) -> Result<Conn> {
        match tokio::time::timeout(
            config.connect_timeout,
            Conn::open_inner(addrs, want_core, config),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(ClientError::Timeout),
        }
    }

    async fn open_inner(
        addrs: &[SocketAddr],
        want_core: Option<u32>,
        config: &ClientConfig,
    ) -> Result<Conn> {
        let mut last_err = None;
        let mut socket = None;
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(s) => {
                    socket = Some(s);
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        let Some(mut socket) = socket else {
            return Err(ClientError::Io(last_err.unwrap_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address to connect to")
            })));
        };
        socket.set_nodelay(true)?;
        // A path that goes dead without a reset (a NAT or load balancer
        // forgetting the connection) is found in about a minute, not after
        // the kernel's retransmissions (about fifteen): keepalive probes a
        // quiet connection, and the user timeout bounds how long sent bytes
        // may go unacknowledged. The connection then fails its requests and
        // the next call reconnects. Tuning, not correctness: a socket that
        // refuses it is used as it is.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES);
        let sock = socket2::SockRef::from(&socket);
        if let Err(e) = sock
            .set_tcp_keepalive(&keepalive)
            .and_then(|()| sock.set_tcp_user_timeout(Some(UNACKED_TIMEOUT)))
        {
            tracing::debug!("TCP keepalive not set: {e}");
        }

        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            features: FEATURES_ALL,
            want_core,
            client_name: config.client_name.clone(),
            token: config.token.clone(),
        };
        let mut out = BytesMut::new();
        encode_request(0, &hello, &mut out);
        socket.write_all(&out).await?;

        let mut buf = BytesMut::with_capacity(8 * 1024);
        let answer = loop {
            match decode_response(&mut buf, config.max_frame_bytes) {
                Ok(Some((_, resp))) => break resp,
                Ok(None) => {
                    if socket.read_buf(&mut buf).await? == 0 {
                        return Err(ClientError::Io(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "broker closed the connection during HELLO",
                        )));
                    }
                }
                Err(e) => {
                    // The likeliest mistake named: the metrics port (HTTP).
                    let peer = socket
                        .peer_addr()
                        .map_or_else(|_| "that address".to_string(), |a| a.to_string());
                    return Err(ClientError::Protocol(if buf.starts_with(b"HTTP") {
                        format!(
                            "not a Felix broker at {peer} (it answered HTTP: the metrics port?)"
                        )
                    } else {
                        format!("not a Felix broker at {peer}? bad answer to HELLO: {e}")
                    }));
                }
            }
        };
        let info = match answer {
            Response::HelloOk {
                version,
                features,
                cores,
                core,
                max_frame_bytes,
                broker,
            } => HelloInfo {
                version,
                features,
                cores,
                core,
                max_frame_bytes,
                broker,
            },
            Response::Error(e) => return Err(e.into()),
            other => {
                return Err(ClientError::Protocol(format!(
                    "broker answered HELLO with {}",
                    other.name()
                )))
            }
        };
        if info.version != PROTOCOL_VERSION {
            return Err(ClientError::Unsupported(format!(
                "broker speaks protocol version {}, this client version {}",
                info.version, PROTOCOL_VERSION
            )));
        }
        if let Some(want) = want_core {
            if info.core != want {
                // Filed under the core asked for, it would get wrong_core
                // for every request; refuse it (the next call reconnects).
                return Err(ClientError::Io(std::io::Error::other(format!(
                    "broker put the connection on core {} instead of core {want}",
                    info.core
                ))));
            }
        }

        let (rd, wr) = socket.into_split();
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending {
                closed: None,
                waiters: HashMap::new(),
            }),
            answered: std::sync::atomic::AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(write_loop(wr, rx, shared.clone()));
        let reader = tokio::spawn(read_loop(rd, buf, shared.clone(), config.max_frame_bytes));
        Ok(Conn {
            tx,
            shared,
            next_id: AtomicU64::new(1),
            hello: info,
            reader,
            opened: std::time::Instant::now(),
        })
    }

    /// Whether this connection proved healthy: the broker answered a
    /// request on it, or it stayed open a while. One that closes at once
    /// without answering anything counts as a failed attempt (the reconnect
    /// backoff goes on growing).
    pub(crate) fn proved(&self) -> bool {
        self.shared.answered.load(Ordering::Relaxed)
            || self.opened.elapsed() >= Duration::from_secs(5)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.shared.is_closed() || self.tx.is_closed()
    }

    /// Send `req` and wait up to `timeout` for its answer. A
    /// [`Response::Error`] is returned as `Ok` so the caller can look at
    /// its details (a `wrong_core` error carries the right core).
    pub(crate) async fn call(&self, req: &Request, timeout: Duration) -> Result<Response> {
        self.send(req, timeout).await?.wait().await
    }

    /// Hand `req` to the writer and return a [`Waiter`] for its answer.
    /// Requests sent one after another (each `send` awaited before the
    /// next) go out on the socket in that order. `timeout` counts from now
    /// and covers queueing for the writer as well as the answer.
    pub(crate) async fn send(&self, req: &Request, timeout: Duration) -> Result<Waiter> {
        // The last word on the guide's rule: checked against this
        // connection's HELLO (the client's own checks use the latest HELLO
        // of any connection, which a broker restarted as an older version
        // may no longer match).
        let missing = req.required_features() & !self.hello.features;
        if missing != 0 {
            return Err(ClientError::Unsupported(format!(
                "{} needs feature bits {missing:#x}, which the broker on this connection did not advertise",
                req.name()
            )));
        }
        let now = tokio::time::Instant::now();
        let deadline = now
            .checked_add(timeout)
            .unwrap_or(now + Duration::from_secs(86_400 * 365));
        // A publish's records alone can pass the frame limit (or the 4 GiB a
        // frame can describe at all): refuse it before encoding any of it.
        if let Request::Publish { records, .. } = req {
            if records.len() > felix_wire::MAX_ITEMS_PER_VEC {
                return Err(ClientError::InvalidArgument(format!(
                    "publish of {} records: a request carries at most {}; split it",
                    records.len(),
                    felix_wire::MAX_ITEMS_PER_VEC
                )));
            }
            let size = |r: felix_wire::RecordView| r.carried_bytes() as u64;
            let bytes = records.iter().fold(0u64, |n, r| n.saturating_add(size(r)));
            let limit = self.hello.max_frame_bytes as u64;
            if bytes > limit {
                // The first record too large on its own: no batching helps it.
                let alone = records
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (i, size(r)))
                    .find(|(_, n)| *n > limit);
                return Err(ClientError::InvalidArgument(if let Some((i, n)) = alone {
                    let which = if records.len() == 1 {
                        String::new()
                    } else {
                        format!(
                            " (the record at index {i} of the {} in this publish)",
                            records.len()
                        )
                    };
                    format!(
                        "a record of {n} bytes{which} is over the broker's frame limit of \
                         {limit} bytes (server.max_frame_bytes), so no publish can carry it"
                    )
                } else {
                    format!(
                        "publish of {} records holds {bytes} bytes, over the broker's frame \
                         limit of {} bytes; send them in smaller batches",
                        records.len(),
                        self.hello.max_frame_bytes
                    )
                }));
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut frame = BytesMut::with_capacity(req.frame_size_hint());
        encode_request(id, req, &mut frame);
        let len = frame.len() - 4;
        if len > self.hello.max_frame_bytes as usize {
            return Err(ClientError::InvalidArgument(format!(
                "{} request is {} bytes, over the broker's frame limit of {} bytes",
                req.name(),
                len,
                self.hello.max_frame_bytes
            )));
        }
        let (tx, rx) = oneshot::channel();
        self.shared.register(id, tx)?;
        let waiter = Waiter {
            shared: self.shared.clone(),
            id,
            rx,
            deadline,
        };
        match tokio::time::timeout_at(deadline, self.tx.send(frame.freeze())).await {
            Ok(Ok(())) => Ok(waiter),
            Ok(Err(_)) => Err(ClientError::Disconnected),
            Err(_) => Err(ClientError::Timeout),
        }
    }
}

async fn write_loop(wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Bytes>, shared: Arc<Shared>) {
    let mut w = BufWriter::with_capacity(64 * 1024, wr);
    while let Some(frame) = rx.recv().await {
        let mut result = w.write_all(&frame).await;
        // Whatever else is already queued goes out in the same flush.
        while result.is_ok() {
            match rx.try_recv() {
                Ok(more) => result = w.write_all(&more).await,
                Err(_) => break,
            }
        }
        if result.is_ok() {
            result = w.flush().await;
        }
        if let Err(e) = result {
            shared.close(format!("write failed: {e}"));
            return;
        }
        if shared.is_closed() {
            return;
        }
    }
    let _ = w.shutdown().await;
}

async fn read_loop(mut rd: OwnedReadHalf, mut buf: BytesMut, shared: Arc<Shared>, max: u32) {
    let reason = loop {
        loop {
            match decode_response(&mut buf, max) {
                Ok(Some((id, resp))) => {
                    shared.answered.store(true, Ordering::Relaxed);
                    shared.complete(id, Ok(resp))
                }
                Ok(None) => break,
                Err(e) => match e.request_id() {
                    // The frame was consumed: fail that one request only.
                    Some(id) => shared.complete(
                        id,
                        Err(ClientError::Protocol(format!("undecodable answer: {e}"))),
                    ),
                    None => {
                        shared.close(format!("protocol error: {e}"));
                        return;
                    }
                },
            }
        }
        let want = match peek_header(&buf) {
            Some(h) => h.frame_bytes().saturating_sub(buf.len()).max(4096),
            None => 8 * 1024,
        };
        buf.reserve(want);
        match rd.read_buf(&mut buf).await {
            Ok(0) => break "broker closed the connection".to_string(),
            Ok(_) => {}
            Err(e) => break format!("read failed: {e}"),
        }
    };
    shared.close(reason);
}

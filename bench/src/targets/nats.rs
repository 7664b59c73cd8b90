//! The NATS JetStream driver: a minimal NATS protocol client over tokio.
//!
//! One JetStream stream per shard (`FB_<stream>_<shard>`, file storage,
//! subject `fb.<stream>.<shard>`). Publishing is JetStream's async publish:
//! every record is a PUB with its own reply inbox and the batch completes
//! when all its PubAcks are in. Replay is an ephemeral pull consumer with no
//! acks; the queue is a work-queue stream with a durable pull consumer and
//! explicit acks (`+ACK` / `-NAK` to the message's ack subject), pulled the
//! way the official clients' `consume` does: keep pull requests outstanding
//! and hand out whatever has arrived.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use super::{Delivery, Handle, Spec, StreamKind};

const CONSUMER: &str = "bench";
const PULL_EXPIRES: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const ACK_TIMEOUT: Duration = Duration::from_secs(60);
/// Like Felix's default FELIX_GROUP_MAX_IN_FLIGHT.
const MAX_ACK_PENDING: u64 = 10_000;

/// A message delivered to one of our subscriptions.
#[derive(Debug, Clone)]
pub struct Msg {
    pub subject: String,
    pub reply: Option<String>,
    /// Status code of a header-only status message (404, 408, 409, 100).
    pub status: Option<u16>,
    /// `Nats-Pending-Messages` of a status message.
    pub pending_msgs: Option<u64>,
    pub payload: Bytes,
}

#[derive(Debug, Default)]
struct Shared {
    subs: Mutex<HashMap<u64, mpsc::UnboundedSender<Msg>>>,
    pongs: Mutex<VecDeque<oneshot::Sender<()>>>,
    closed: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One NATS connection: a writer task fed by a channel and a reader task
/// that routes messages to subscriptions by sid.
#[derive(Debug, Clone)]
pub struct Conn {
    tx: mpsc::Sender<Bytes>,
    shared: Arc<Shared>,
    next_sid: Arc<AtomicU64>,
    pub inbox: String,
    pub server_version: String,
}

fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "{:x}{:x}{:x}",
        std::process::id(),
        t & 0xffff_ffff,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl Conn {
    pub async fn connect(addr: &str) -> Result<Conn, String> {
        let sock = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect to NATS at {addr}: {e}"))?;
        sock.set_nodelay(true).map_err(|e| e.to_string())?;
        let (mut rd, mut wr) = sock.into_split();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        // INFO {...}, which a NATS server sends at once (anything else on
        // that port may send nothing: do not wait forever).
        let info = tokio::time::timeout(REQUEST_TIMEOUT, read_line(&mut rd, &mut buf))
            .await
            .map_err(|_| {
                format!(
                    "{addr} sent no NATS INFO within {}s: is it a NATS server?",
                    REQUEST_TIMEOUT.as_secs()
                )
            })??;
        let info = info
            .strip_prefix("INFO ")
            .ok_or_else(|| format!("NATS server sent {info:?} instead of INFO"))?;
        let info: Value = serde_json::from_str(info).map_err(|e| format!("bad INFO: {e}"))?;
        let server_version = info["version"].as_str().unwrap_or("?").to_string();
        if !info["jetstream"].as_bool().unwrap_or(false) {
            return Err(
                "the NATS server does not have JetStream enabled (run nats-server -js)".into(),
            );
        }
        let connect = json!({
            "verbose": false, "pedantic": false, "headers": true, "no_responders": true,
            "lang": "rust", "version": env!("CARGO_PKG_VERSION"), "protocol": 1, "echo": false,
            "name": "felix-bench",
        });
        wr.write_all(format!("CONNECT {connect}\r\nPING\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        loop {
            let l = read_line(&mut rd, &mut buf).await?;
            if l == "PONG" {
                break;
            }
            if let Some(e) = l.strip_prefix("-ERR") {
                return Err(format!("NATS refused the connection: {}", e.trim()));
            }
        }
        let shared = Arc::new(Shared::default());
        let (tx, mut rx) = mpsc::channel::<Bytes>(4096);
        let sh = shared.clone();
        tokio::spawn(async move {
            let mut w = tokio::io::BufWriter::with_capacity(64 * 1024, wr);
            while let Some(b) = rx.recv().await {
                let mut r = w.write_all(&b).await;
                while r.is_ok() {
                    match rx.try_recv() {
                        Ok(more) => r = w.write_all(&more).await,
                        Err(_) => break,
                    }
                }
                if r.is_ok() {
                    r = w.flush().await;
                }
                if let Err(e) = r {
                    lock(&sh.closed).get_or_insert(format!("write failed: {e}"));
                    return;
                }
            }
        });
        tokio::spawn(read_loop(rd, buf, shared.clone(), tx.clone()));
        Ok(Conn {
            tx,
            shared,
            next_sid: Arc::new(AtomicU64::new(1)),
            inbox: format!("_INBOX.{}", unique()),
            server_version,
        })
    }

    async fn write(&self, b: Bytes) -> Result<(), String> {
        if let Some(e) = lock(&self.shared.closed).clone() {
            return Err(format!("NATS connection closed: {e}"));
        }
        self.tx
            .send(b)
            .await
            .map_err(|_| "NATS connection closed".to_string())
    }

    pub async fn subscribe(
        &self,
        subject: &str,
    ) -> Result<(u64, mpsc::UnboundedReceiver<Msg>), String> {
        let sid = self.next_sid.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.shared.subs).insert(sid, tx);
        self.write(Bytes::from(format!("SUB {subject} {sid}\r\n")))
            .await?;
        Ok((sid, rx))
    }

    pub async fn unsubscribe(&self, sid: u64) -> Result<(), String> {
        lock(&self.shared.subs).remove(&sid);
        self.write(Bytes::from(format!("UNSUB {sid}\r\n"))).await
    }

    /// Append a PUB to `out`.
    pub fn encode_pub(out: &mut BytesMut, subject: &str, reply: Option<&str>, payload: &[u8]) {
        let head = match reply {
            Some(r) => format!("PUB {subject} {r} {}\r\n", payload.len()),
            None => format!("PUB {subject} {}\r\n", payload.len()),
        };
        out.extend_from_slice(head.as_bytes());
        out.extend_from_slice(payload);
        out.extend_from_slice(b"\r\n");
    }

    pub async fn publish(
        &self,
        subject: &str,
        reply: Option<&str>,
        payload: &[u8],
    ) -> Result<(), String> {
        let mut out = BytesMut::with_capacity(payload.len() + 64);
        Conn::encode_pub(&mut out, subject, reply, payload);
        self.write(out.freeze()).await
    }

    pub async fn send_raw(&self, b: Bytes) -> Result<(), String> {
        self.write(b).await
    }

    /// Round trip: everything written before has been processed by the
    /// server when this returns.
    pub async fn flush(&self) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        lock(&self.shared.pongs).push_back(tx);
        self.write(Bytes::from_static(b"PING\r\n")).await?;
        tokio::time::timeout(REQUEST_TIMEOUT, rx)
            .await
            .map_err(|_| "NATS flush timed out".to_string())?
            .map_err(|_| "NATS connection closed".to_string())
    }

    /// A request with a fresh inbox; the first answer.
    pub async fn request(&self, subject: &str, payload: &[u8]) -> Result<Msg, String> {
        let inbox = format!("{}.{}", self.inbox, unique());
        let (sid, mut rx) = self.subscribe(&inbox).await?;
        self.publish(subject, Some(&inbox), payload).await?;
        let r = tokio::time::timeout(REQUEST_TIMEOUT, rx.recv()).await;
        self.unsubscribe(sid).await?;
        match r {
            Ok(Some(m)) if m.status == Some(503) => Err(format!(
                "no responders for {subject} (is JetStream enabled?)"
            )),
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err("NATS connection closed".into()),
            Err(_) => Err(format!("NATS request {subject} timed out")),
        }
    }

    /// A JetStream API call; refuses an answer carrying an error.
    pub async fn js(&self, api: &str, body: &Value) -> Result<Value, String> {
        let m = self
            .request(&format!("$JS.API.{api}"), body.to_string().as_bytes())
            .await?;
        let v: Value = serde_json::from_slice(&m.payload)
            .map_err(|e| format!("JetStream {api}: bad answer: {e}"))?;
        if let Some(err) = v.get("error") {
            return Err(format!("JetStream {api}: {err}"));
        }
        Ok(v)
    }
}

async fn read_line(rd: &mut OwnedReadHalf, buf: &mut BytesMut) -> Result<String, String> {
    loop {
        if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
            let l = String::from_utf8_lossy(&buf[..i]).into_owned();
            buf.advance(i + 2);
            return Ok(l);
        }
        if rd.read_buf(buf).await.map_err(|e| e.to_string())? == 0 {
            return Err("NATS closed the connection".into());
        }
    }
}

/// Parse `NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 5\r\n...`.
fn parse_status(headers: &[u8]) -> (Option<u16>, Option<u64>) {
    let text = String::from_utf8_lossy(headers);
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.strip_prefix("NATS/1.0"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|c| c.parse().ok());
    let pending = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("Nats-Pending-Messages"))
        .and_then(|(_, v)| v.trim().parse().ok());
    (status, pending)
}

enum Parsed {
    Msg(u64, Msg),
    Ping,
    Pong,
    Err(String),
    Other,
}

/// Parse one protocol message from the front of `buf`, if complete.
fn parse_one(buf: &mut BytesMut) -> Result<Option<Parsed>, String> {
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let line = String::from_utf8_lossy(&buf[..eol]).into_owned();
    let mut parts = line.split_ascii_whitespace();
    let op = parts.next().unwrap_or("").to_ascii_uppercase();
    let args: Vec<&str> = parts.collect();
    let bad = || format!("bad NATS line {line:?}");
    match op.as_str() {
        "MSG" | "HMSG" => {
            let with_headers = op == "HMSG";
            let (subject, sid, reply, hdr_len, total) = match (with_headers, args.as_slice()) {
                (false, [s, sid, n]) => (*s, *sid, None, 0usize, *n),
                (false, [s, sid, r, n]) => (*s, *sid, Some(*r), 0, *n),
                (true, [s, sid, h, n]) => (*s, *sid, None, h.parse().map_err(|_| bad())?, *n),
                (true, [s, sid, r, h, n]) => {
                    (*s, *sid, Some(*r), h.parse().map_err(|_| bad())?, *n)
                }
                _ => return Err(bad()),
            };
            let total: usize = total.parse().map_err(|_| bad())?;
            let sid: u64 = sid.parse().map_err(|_| bad())?;
            if buf.len() < eol + 2 + total + 2 {
                return Ok(None);
            }
            buf.advance(eol + 2);
            let body = buf.split_to(total).freeze();
            buf.advance(2);
            let (status, pending_msgs) = if with_headers {
                parse_status(&body[..hdr_len.min(body.len())])
            } else {
                (None, None)
            };
            let payload = body.slice(hdr_len.min(body.len())..);
            Ok(Some(Parsed::Msg(
                sid,
                Msg {
                    subject: subject.to_string(),
                    reply: reply.map(str::to_string),
                    status,
                    pending_msgs,
                    payload,
                },
            )))
        }
        _ => {
            buf.advance(eol + 2);
            Ok(Some(match op.as_str() {
                "PING" => Parsed::Ping,
                "PONG" => Parsed::Pong,
                "-ERR" => Parsed::Err(line),
                _ => Parsed::Other,
            }))
        }
    }
}

async fn read_loop(
    mut rd: OwnedReadHalf,
    mut buf: BytesMut,
    shared: Arc<Shared>,
    tx: mpsc::Sender<Bytes>,
) {
    let reason = 'outer: loop {
        loop {
            match parse_one(&mut buf) {
                Ok(Some(Parsed::Msg(sid, m))) => {
                    let sub = lock(&shared.subs).get(&sid).cloned();
                    if let Some(s) = sub {
                        let _ = s.send(m);
                    }
                }
                Ok(Some(Parsed::Ping)) => {
                    let _ = tx.send(Bytes::from_static(b"PONG\r\n")).await;
                }
                Ok(Some(Parsed::Pong)) => {
                    if let Some(w) = lock(&shared.pongs).pop_front() {
                        let _ = w.send(());
                    }
                }
                Ok(Some(Parsed::Err(e))) => eprintln!("nats: {e}"),
                Ok(Some(Parsed::Other)) => {}
                Ok(None) => break,
                Err(e) => break 'outer e,
            }
        }
        buf.reserve(64 * 1024);
        match rd.read_buf(&mut buf).await {
            Ok(0) => break "server closed the connection".to_string(),
            Ok(_) => {}
            Err(e) => break format!("read failed: {e}"),
        }
    };
    lock(&shared.closed).get_or_insert(reason);
    lock(&shared.subs).clear();
    lock(&shared.pongs).clear();
}

// ----------------------------------------------------------------- target

#[derive(Debug, Clone)]
pub struct NatsTarget {
    addr: String,
    admin: Conn,
    spec: Arc<Spec>,
    /// Streams this run created; `delete` removes only these.
    created: Arc<std::sync::Mutex<Vec<String>>>,
}

fn stream_name(spec: &Spec, shard: u32) -> String {
    format!("FB_{}_{shard}", spec.name.flat())
}

fn subject(spec: &Spec, shard: u32) -> String {
    format!("fb.{}.{shard}", spec.name.flat())
}

impl NatsTarget {
    pub async fn connect(addr: &str, spec: Arc<Spec>) -> Result<NatsTarget, String> {
        let admin = Conn::connect(addr).await?;
        Ok(NatsTarget {
            addr: addr.to_string(),
            admin,
            spec,
            created: Default::default(),
        })
    }

    pub fn version(&self) -> String {
        format!("nats-server {}", self.admin.server_version)
    }

    pub async fn create(&self) -> Result<(), String> {
        for shard in 0..self.spec.shards {
            let name = stream_name(&self.spec, shard);
            // Never replace a stream this run did not make.
            if self
                .admin
                .js(&format!("STREAM.INFO.{name}"), &json!({}))
                .await
                .is_ok()
            {
                return Err(format!(
                    "JetStream stream {name} already exists; felix-bench does not touch data it \
                     did not create (pick another --stream)"
                ));
            }
            let retention = match self.spec.kind {
                StreamKind::Queue => "workqueue",
                StreamKind::Log => "limits",
            };
            self.admin
                .js(
                    &format!("STREAM.CREATE.{name}"),
                    &json!({
                        "name": name,
                        "subjects": [subject(&self.spec, shard)],
                        "retention": retention,
                        "storage": "file",
                        "num_replicas": 1,
                        "discard": "old",
                    }),
                )
                .await?;
            self.created.lock().unwrap().push(name.clone());
            if self.spec.kind == StreamKind::Queue {
                self.admin
                    .js(
                        &format!("CONSUMER.CREATE.{name}.{CONSUMER}"),
                        &json!({
                            "stream_name": name,
                            "config": {
                                "durable_name": CONSUMER,
                                "name": CONSUMER,
                                "ack_policy": "explicit",
                                "deliver_policy": "all",
                                "ack_wait": 30_000_000_000u64,
                                "max_deliver": -1,
                                "max_ack_pending": MAX_ACK_PENDING,
                                "max_waiting": 512,
                            }
                        }),
                    )
                    .await?;
            }
        }
        Ok(())
    }

    /// Remove the streams this run created (and only those).
    pub async fn delete(&self) -> Result<(), String> {
        let names = std::mem::take(&mut *self.created.lock().unwrap());
        for name in names {
            self.admin
                .js(&format!("STREAM.DELETE.{name}"), &json!({}))
                .await?;
        }
        Ok(())
    }

    pub async fn stored(&self, shard: u32) -> Result<u64, String> {
        let name = stream_name(&self.spec, shard);
        let v = self
            .admin
            .js(&format!("STREAM.INFO.{name}"), &json!({}))
            .await?;
        v["state"]["messages"]
            .as_u64()
            .ok_or_else(|| format!("STREAM.INFO {name}: no state.messages"))
    }

    /// A work-queue stream keeps exactly the messages not yet acknowledged.
    pub async fn unfinished(&self, shard: u32) -> Result<Option<u64>, String> {
        self.stored(shard).await.map(Some)
    }

    pub async fn producer(&self) -> Result<(PubTx, PubRx), String> {
        let conn = Conn::connect(&self.addr).await?;
        let prefix = format!("{}.p", conn.inbox);
        let (_, acks) = conn.subscribe(&format!("{prefix}.*")).await?;
        Ok((
            PubTx {
                conn,
                spec: self.spec.clone(),
                prefix,
                seq: 0,
            },
            PubRx { acks },
        ))
    }

    pub async fn reader(&self) -> Result<Reader, String> {
        Ok(Reader {
            conn: Conn::connect(&self.addr).await?,
            spec: self.spec.clone(),
            pulls: HashMap::new(),
        })
    }

    pub async fn consumer(&self) -> Result<Consumer, String> {
        Ok(Consumer {
            conn: Conn::connect(&self.addr).await?,
            spec: self.spec.clone(),
            pulls: HashMap::new(),
        })
    }
}

/// JetStream async publish: a PUB per record, each with its own reply
/// subject under this producer's inbox.
#[derive(Debug)]
pub struct PubTx {
    conn: Conn,
    spec: Arc<Spec>,
    prefix: String,
    seq: u64,
}

impl PubTx {
    pub async fn send(&mut self, shard: u32, payloads: Vec<Bytes>) -> Result<usize, String> {
        let subj = subject(&self.spec, shard);
        let size: usize = payloads.iter().map(|p| p.len() + 96).sum();
        let mut out = BytesMut::with_capacity(size);
        for p in &payloads {
            self.seq += 1;
            let reply = format!("{}.{}", self.prefix, self.seq);
            Conn::encode_pub(&mut out, &subj, Some(&reply), p);
        }
        self.conn.send_raw(out.freeze()).await?;
        Ok(payloads.len())
    }
}

/// Counts PubAcks in arrival order against the oldest batch.
#[derive(Debug)]
pub struct PubRx {
    acks: mpsc::UnboundedReceiver<Msg>,
}

impl PubRx {
    pub async fn complete(&mut self, n: usize) -> Result<u64, String> {
        for _ in 0..n {
            let m = tokio::time::timeout(ACK_TIMEOUT, self.acks.recv())
                .await
                .map_err(|_| "no PubAck within 60s".to_string())?
                .ok_or("NATS connection closed")?;
            if m.status == Some(503) {
                return Err("no JetStream stream answered the publish (503)".into());
            }
            if m.payload.windows(7).any(|w| w == b"\"error\"") {
                return Err(format!(
                    "PubAck error: {}",
                    String::from_utf8_lossy(&m.payload)
                ));
            }
        }
        Ok(n as u64)
    }
}

/// Pull requests outstanding on one consumer and where their messages go.
#[derive(Debug)]
struct Pull {
    api: String,
    inbox: String,
    sid: u64,
    rx: mpsc::UnboundedReceiver<Msg>,
    /// Messages asked for and not yet delivered or expired.
    outstanding: u64,
}

impl Pull {
    async fn open(conn: &Conn, stream: &str, consumer: &str) -> Result<Pull, String> {
        let inbox = format!("{}.{}", conn.inbox, unique());
        let (sid, rx) = conn.subscribe(&inbox).await?;
        Ok(Pull {
            api: format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            inbox,
            sid,
            rx,
            outstanding: 0,
        })
    }

    /// Keep about two batches asked for; take what has arrived (waiting up
    /// to `wait` for the first message).
    async fn take(&mut self, conn: &Conn, max: u32, wait: Duration) -> Result<Vec<Msg>, String> {
        let max = u64::from(max);
        while self.outstanding < 2 * max {
            let body = json!({"batch": max, "expires": PULL_EXPIRES.as_nanos() as u64});
            conn.publish(&self.api, Some(&self.inbox), body.to_string().as_bytes())
                .await?;
            self.outstanding += max;
        }
        let mut out = Vec::new();
        let first = if wait.is_zero() {
            self.rx.try_recv().ok()
        } else {
            match tokio::time::timeout(wait, self.rx.recv()).await {
                Ok(Some(m)) => Some(m),
                Ok(None) => return Err("NATS connection closed".into()),
                Err(_) => None,
            }
        };
        let mut next = first;
        while let Some(m) = next {
            match m.status {
                None => {
                    self.outstanding = self.outstanding.saturating_sub(1);
                    out.push(m);
                }
                Some(100) => {}
                Some(404) | Some(408) | Some(409) => {
                    let gone = m.pending_msgs.unwrap_or(self.outstanding.min(max));
                    self.outstanding = self.outstanding.saturating_sub(gone);
                }
                Some(other) => return Err(format!("pull answered with status {other}")),
            }
            if out.len() as u64 >= max {
                break;
            }
            next = self.rx.try_recv().ok();
        }
        Ok(out)
    }
}

#[derive(Debug)]
pub struct Reader {
    conn: Conn,
    spec: Arc<Spec>,
    /// Per shard: the ephemeral consumer of the current pass.
    pulls: HashMap<u32, (String, Pull)>,
}

impl Reader {
    pub async fn seek_start(&mut self, shard: u32) -> Result<(), String> {
        let stream = stream_name(&self.spec, shard);
        if let Some((name, old)) = self.pulls.remove(&shard) {
            let _ = self.conn.unsubscribe(old.sid).await;
            let _ = self
                .conn
                .js(&format!("CONSUMER.DELETE.{stream}.{name}"), &json!({}))
                .await;
        }
        let v = self
            .conn
            .js(
                &format!("CONSUMER.CREATE.{stream}"),
                &json!({
                    "stream_name": stream,
                    "config": {
                        "ack_policy": "none",
                        "deliver_policy": "all",
                        "inactive_threshold": 30_000_000_000u64,
                        "mem_storage": true,
                        "num_replicas": 1,
                    }
                }),
            )
            .await?;
        let name = v["name"]
            .as_str()
            .ok_or("CONSUMER.CREATE answered without a name")?
            .to_string();
        let pull = Pull::open(&self.conn, &stream, &name).await?;
        self.pulls.insert(shard, (name, pull));
        Ok(())
    }

    pub async fn seek_end(&mut self, _shard: u32) -> Result<(), String> {
        Err("tail reads are not implemented for NATS".into())
    }

    pub async fn read(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Bytes>, String> {
        if !self.pulls.contains_key(&shard) {
            self.seek_start(shard).await?;
        }
        let (_, pull) = self.pulls.get_mut(&shard).expect("opened above");
        let wait = wait.max(Duration::from_millis(100));
        Ok(pull
            .take(&self.conn, max, wait)
            .await?
            .into_iter()
            .map(|m| m.payload)
            .collect())
    }
}

#[derive(Debug)]
pub struct Consumer {
    conn: Conn,
    spec: Arc<Spec>,
    pulls: HashMap<u32, Pull>,
}

/// Delivery count from an ack subject: `$JS.ACK.<stream>.<consumer>.<delivered>...`
/// (9 tokens) or, with domain and account hash, 12 or more tokens.
fn delivered(ack: &str) -> u32 {
    let t: Vec<&str> = ack.split('.').collect();
    let i = if t.len() == 9 { 4 } else { 6 };
    t.get(i).and_then(|s| s.parse().ok()).unwrap_or(1)
}

impl Consumer {
    pub async fn poll(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Delivery>, String> {
        if !self.pulls.contains_key(&shard) {
            let p = Pull::open(&self.conn, &stream_name(&self.spec, shard), CONSUMER).await?;
            self.pulls.insert(shard, p);
        }
        let pull = self.pulls.get_mut(&shard).expect("opened above");
        let wait = wait.max(Duration::from_millis(1));
        Ok(pull
            .take(&self.conn, max, wait)
            .await?
            .into_iter()
            .filter_map(|m| {
                let ack = m.reply?;
                Some(Delivery {
                    attempts: delivered(&ack),
                    handle: Handle::Nats(ack),
                    payload: m.payload,
                })
            })
            .collect())
    }

    /// `+ACK` each message (one write for the lot; no confirmation, as the
    /// official clients' default `ack`).
    pub async fn ack(&mut self, _shard: u32, handles: Vec<Handle>) -> Result<(), String> {
        if handles.is_empty() {
            return Ok(());
        }
        let mut out = BytesMut::with_capacity(handles.len() * 96);
        for h in handles {
            let Handle::Nats(subject) = h else {
                unreachable!("nats consumer got a foreign handle")
            };
            Conn::encode_pub(&mut out, &subject, None, b"+ACK");
        }
        self.conn.send_raw(out.freeze()).await
    }

    pub async fn nack(&mut self, _shard: u32, handle: Handle) -> Result<(), String> {
        let Handle::Nats(subject) = handle else {
            unreachable!("nats consumer got a foreign handle")
        };
        self.conn.publish(&subject, None, b"-NAK").await
    }

    pub async fn finish(&mut self) -> Result<(), String> {
        self.conn.flush().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_lines_parse_and_wait_for_payloads() {
        let wire = b"MSG fb.x.0 7 _INBOX.a.1 5\r\nhello\r\nPING\r\n";
        for cut in 0..27 {
            let mut b = BytesMut::from(&wire[..cut]);
            assert!(parse_one(&mut b).unwrap().is_none(), "cut at {cut}");
        }
        let mut b = BytesMut::from(&wire[..]);
        match parse_one(&mut b).unwrap().unwrap() {
            Parsed::Msg(7, m) => {
                assert_eq!(m.subject, "fb.x.0");
                assert_eq!(m.reply.as_deref(), Some("_INBOX.a.1"));
                assert_eq!(&m.payload[..], b"hello");
            }
            _ => panic!("expected MSG"),
        }
        assert!(matches!(parse_one(&mut b).unwrap(), Some(Parsed::Ping)));
    }

    #[test]
    fn status_messages_carry_code_and_pending() {
        let h = b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 17\r\nNats-Pending-Bytes: 0\r\n\r\n";
        let wire = [
            format!("HMSG _INBOX.a.b 3 {} {}\r\n", h.len(), h.len()).into_bytes(),
            h.to_vec(),
            b"\r\n".to_vec(),
        ]
        .concat();
        let mut b = BytesMut::from(&wire[..]);
        match parse_one(&mut b).unwrap().unwrap() {
            Parsed::Msg(3, m) => {
                assert_eq!(m.status, Some(408));
                assert_eq!(m.pending_msgs, Some(17));
                assert!(m.payload.is_empty());
            }
            _ => panic!("expected HMSG"),
        }
    }

    #[test]
    fn ack_subjects_give_the_delivery_count() {
        assert_eq!(delivered("$JS.ACK.S.C.3.10.9.1700000000.0"), 3);
        assert_eq!(
            delivered("$JS.ACK.dom.acchash.S.C.2.10.9.1700000000.0.tok"),
            2
        );
    }
}

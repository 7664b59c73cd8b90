//! The Redis Streams driver: a small RESP2 client over tokio.
//!
//! One stream key per shard (`fb:<stream>:<shard>`). Publishing is pipelined
//! XADD (a batch is `batch` XADD commands in one write; several batches in
//! flight on the connection); replay is XRANGE; the queue is a consumer
//! group read with XREADGROUP and acknowledged with XACK, the XACK sent in
//! the same write as the next XREADGROUP.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use super::{Delivery, Handle, Spec, StreamKind};

const GROUP: &str = "bench";

/// A RESP2 value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Bytes>),
    Array(Option<Vec<Value>>),
}

impl Value {
    fn bulk(&self) -> Option<&Bytes> {
        match self {
            Value::Bulk(Some(b)) => Some(b),
            _ => None,
        }
    }

    fn array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(Some(v)) => Some(v),
            _ => None,
        }
    }

    fn text(&self) -> String {
        match self {
            Value::Simple(s) | Value::Error(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            Value::Bulk(Some(b)) => String::from_utf8_lossy(b).into_owned(),
            Value::Bulk(None) | Value::Array(None) => "(nil)".into(),
            Value::Array(Some(v)) => format!("{v:?}"),
        }
    }
}

/// Parse one value from the front of `buf`: `Ok(None)` if incomplete.
pub fn parse(buf: &[u8]) -> Result<Option<(Value, usize)>, String> {
    fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
        let rest = buf.get(at..)?;
        let end = rest.windows(2).position(|w| w == b"\r\n")?;
        Some((&rest[..end], at + end + 2))
    }
    fn int(b: &[u8]) -> Result<i64, String> {
        std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad RESP integer {:?}", String::from_utf8_lossy(b)))
    }
    fn value(buf: &[u8], at: usize) -> Result<Option<(Value, usize)>, String> {
        let Some(&tag) = buf.get(at) else {
            return Ok(None);
        };
        let Some((l, next)) = line(buf, at + 1) else {
            return Ok(None);
        };
        match tag {
            b'+' => Ok(Some((
                Value::Simple(String::from_utf8_lossy(l).into()),
                next,
            ))),
            b'-' => Ok(Some((
                Value::Error(String::from_utf8_lossy(l).into()),
                next,
            ))),
            b':' => Ok(Some((Value::Int(int(l)?), next))),
            b'$' => {
                let n = int(l)?;
                if n < 0 {
                    return Ok(Some((Value::Bulk(None), next)));
                }
                let n = n as usize;
                if buf.len() < next + n + 2 {
                    return Ok(None);
                }
                let b = Bytes::copy_from_slice(&buf[next..next + n]);
                Ok(Some((Value::Bulk(Some(b)), next + n + 2)))
            }
            b'*' => {
                let n = int(l)?;
                if n < 0 {
                    return Ok(Some((Value::Array(None), next)));
                }
                let mut items = Vec::with_capacity((n as usize).min(4096));
                let mut pos = next;
                for _ in 0..n {
                    match value(buf, pos)? {
                        Some((v, p)) => {
                            items.push(v);
                            pos = p;
                        }
                        None => return Ok(None),
                    }
                }
                Ok(Some((Value::Array(Some(items)), pos)))
            }
            other => Err(format!("bad RESP type byte {other:#x}")),
        }
    }
    value(buf, 0)
}

/// Append a command (an array of bulk strings) to `out`.
pub fn encode(out: &mut BytesMut, args: &[&[u8]]) {
    use std::fmt::Write as _;
    let mut head = String::new();
    let _ = write!(head, "*{}\r\n", args.len());
    out.extend_from_slice(head.as_bytes());
    for a in args {
        head.clear();
        let _ = write!(head, "${}\r\n", a.len());
        out.extend_from_slice(head.as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// One pipelined RESP connection: commands are queued into a buffer,
/// written with `flush`, and replies read back in order.
#[derive(Debug)]
pub struct Conn {
    sock: TcpStream,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// Replies owed to commands already written or queued.
    pending: usize,
}

impl Conn {
    pub async fn connect(addr: &str) -> Result<Conn, String> {
        let sock = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect to Redis at {addr}: {e}"))?;
        sock.set_nodelay(true).map_err(|e| e.to_string())?;
        Ok(Conn {
            sock,
            rbuf: BytesMut::with_capacity(64 * 1024),
            wbuf: BytesMut::with_capacity(64 * 1024),
            pending: 0,
        })
    }

    pub fn queue(&mut self, args: &[&[u8]]) {
        encode(&mut self.wbuf, args);
        self.pending += 1;
    }

    pub async fn flush(&mut self) -> Result<(), String> {
        if !self.wbuf.is_empty() {
            self.sock
                .write_all(&self.wbuf)
                .await
                .map_err(|e| format!("redis write: {e}"))?;
            self.wbuf.clear();
        }
        Ok(())
    }

    /// The next reply (in command order). Flushes first.
    pub async fn reply(&mut self) -> Result<Value, String> {
        assert!(self.pending > 0, "no reply owed");
        self.flush().await?;
        loop {
            if let Some((v, used)) = parse(&self.rbuf)? {
                self.rbuf.advance(used);
                self.pending -= 1;
                return Ok(v);
            }
            self.rbuf.reserve(64 * 1024);
            let n = self
                .sock
                .read_buf(&mut self.rbuf)
                .await
                .map_err(|e| format!("redis read: {e}"))?;
            if n == 0 {
                return Err("redis closed the connection".into());
            }
        }
    }

    /// Send one command and return its reply (after any owed ones, which
    /// must be read first by the caller).
    pub async fn cmd(&mut self, args: &[&[u8]]) -> Result<Value, String> {
        assert_eq!(self.pending, 0, "replies still owed");
        self.queue(args);
        match self.reply().await? {
            Value::Error(e) => Err(format!("redis: {e}")),
            v => Ok(v),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RedisTarget {
    addr: String,
    spec: Arc<Spec>,
    /// Keys of the shards this run created; `delete` removes only these.
    created: Arc<std::sync::Mutex<Vec<String>>>,
}

impl RedisTarget {
    pub async fn connect(addr: &str, spec: Arc<Spec>) -> Result<RedisTarget, String> {
        let mut c = Conn::connect(addr).await?;
        c.cmd(&[b"PING"]).await?;
        Ok(RedisTarget {
            addr: addr.to_string(),
            spec,
            created: Default::default(),
        })
    }

    fn key(&self, shard: u32) -> String {
        key(&self.spec, shard)
    }

    pub async fn version(&self) -> Result<String, String> {
        let mut c = Conn::connect(&self.addr).await?;
        let info = c.cmd(&[b"INFO", b"server"]).await?.text();
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .map_or_else(
                || "redis (unknown version)".into(),
                |v| format!("redis {}", v.trim()),
            ))
    }

    /// `appendonly` and `appendfsync`, as the server reports them.
    pub async fn durability(&self) -> Result<(String, String), String> {
        let mut c = Conn::connect(&self.addr).await?;
        let get = |v: Value| {
            v.array()
                .and_then(|a| a.get(1))
                .map(Value::text)
                .unwrap_or_default()
        };
        let aof = get(c.cmd(&[b"CONFIG", b"GET", b"appendonly"]).await?);
        let fsync = get(c.cmd(&[b"CONFIG", b"GET", b"appendfsync"]).await?);
        Ok((aof, fsync))
    }

    pub async fn create(&self) -> Result<(), String> {
        let mut c = Conn::connect(&self.addr).await?;
        for shard in 0..self.spec.shards {
            let k = self.key(shard);
            // Never overwrite a key this run did not make.
            if let Value::Int(n) = c.cmd(&[b"EXISTS", k.as_bytes()]).await? {
                if n > 0 {
                    return Err(format!(
                        "Redis key {k} already exists; felix-bench does not touch data it did not \
                         create (pick another --stream)"
                    ));
                }
            }
            self.created.lock().unwrap().push(k.clone());
            if self.spec.kind == StreamKind::Queue {
                c.cmd(&[
                    b"XGROUP",
                    b"CREATE",
                    k.as_bytes(),
                    GROUP.as_bytes(),
                    b"0",
                    b"MKSTREAM",
                ])
                .await?;
            }
        }
        Ok(())
    }

    pub async fn delete(&self) -> Result<(), String> {
        let keys = std::mem::take(&mut *self.created.lock().unwrap());
        if keys.is_empty() {
            return Ok(());
        }
        let mut c = Conn::connect(&self.addr).await?;
        for k in keys {
            c.cmd(&[b"DEL", k.as_bytes()]).await?;
        }
        Ok(())
    }

    pub async fn stored(&self, shard: u32) -> Result<u64, String> {
        let mut c = Conn::connect(&self.addr).await?;
        match c.cmd(&[b"XLEN", self.key(shard).as_bytes()]).await? {
            Value::Int(n) => Ok(n.max(0) as u64),
            v => Err(format!("XLEN answered {}", v.text())),
        }
    }

    /// Entries not yet delivered plus delivered and not acknowledged;
    /// `None` before Redis 7.0, whose `XINFO GROUPS` has no `lag`.
    pub async fn unfinished(&self, shard: u32) -> Result<Option<u64>, String> {
        let mut c = Conn::connect(&self.addr).await?;
        let k = self.key(shard);
        let groups = c.cmd(&[b"XINFO", b"GROUPS", k.as_bytes()]).await?;
        let mut pending = 0u64;
        let mut lag = None;
        for g in groups.array().unwrap_or(&[]) {
            let fields = g.array().unwrap_or(&[]);
            for pair in fields.chunks(2) {
                if let [name, v] = pair {
                    match (name.text().as_str(), v) {
                        ("pending", Value::Int(n)) => pending = (*n).max(0) as u64,
                        ("lag", Value::Int(n)) => lag = Some((*n).max(0) as u64),
                        _ => {}
                    }
                }
            }
        }
        Ok(lag.map(|lag| pending + lag))
    }

    pub async fn producer(&self) -> Result<(PubTx, PubRx), String> {
        let conn = Conn::connect(&self.addr).await?;
        let (rd, wr) = conn.sock.into_split();
        Ok((
            PubTx {
                wr,
                spec: self.spec.clone(),
                buf: BytesMut::with_capacity(64 * 1024),
            },
            PubRx { rd, buf: conn.rbuf },
        ))
    }

    pub async fn reader(&self) -> Result<Reader, String> {
        Ok(Reader {
            conn: Conn::connect(&self.addr).await?,
            spec: self.spec.clone(),
            after: vec![None; self.spec.shards as usize],
        })
    }

    pub async fn consumer(&self, idx: usize) -> Result<Consumer, String> {
        Ok(Consumer {
            conn: Conn::connect(&self.addr).await?,
            spec: self.spec.clone(),
            name: format!("c{idx}"),
            acks_owed: 0,
        })
    }
}

fn key(spec: &Spec, shard: u32) -> String {
    format!("fb:{}:{shard}", spec.name.flat())
}

/// Writes pipelined XADDs; the replies are read by [`PubRx`] in order.
#[derive(Debug)]
pub struct PubTx {
    wr: OwnedWriteHalf,
    spec: Arc<Spec>,
    buf: BytesMut,
}

impl PubTx {
    pub async fn send(&mut self, shard: u32, payloads: Vec<Bytes>) -> Result<usize, String> {
        let k = key(&self.spec, shard);
        self.buf.clear();
        for p in &payloads {
            encode(&mut self.buf, &[b"XADD", k.as_bytes(), b"*", b"d", p]);
        }
        self.wr
            .write_all(&self.buf)
            .await
            .map_err(|e| format!("redis write: {e}"))?;
        Ok(payloads.len())
    }
}

#[derive(Debug)]
pub struct PubRx {
    rd: OwnedReadHalf,
    buf: BytesMut,
}

impl PubRx {
    /// Read the `n` XADD replies of the oldest batch.
    pub async fn complete(&mut self, n: usize) -> Result<u64, String> {
        let mut first_err = None;
        let mut left = n;
        while left > 0 {
            match parse(&self.buf)? {
                Some((v, used)) => {
                    self.buf.advance(used);
                    left -= 1;
                    if let Value::Error(e) = v {
                        first_err.get_or_insert(e);
                    }
                }
                None => {
                    self.buf.reserve(64 * 1024);
                    let got = self
                        .rd
                        .read_buf(&mut self.buf)
                        .await
                        .map_err(|e| format!("redis read: {e}"))?;
                    if got == 0 {
                        return Err("redis closed the connection".into());
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(format!("XADD: {e}")),
            None => Ok(n as u64),
        }
    }
}

/// `[[id, [field, value, ...]], ...]` -> (ids, payload of field `d`).
fn entries(v: &Value) -> Vec<(Bytes, Bytes)> {
    let mut out = Vec::new();
    for e in v.array().unwrap_or(&[]) {
        let Some([id, fields]) = e.array().and_then(|a| <&[Value; 2]>::try_from(a).ok()) else {
            continue;
        };
        let payload = fields
            .array()
            .and_then(|f| f.get(1))
            .and_then(Value::bulk)
            .cloned()
            .unwrap_or_default();
        if let Some(id) = id.bulk() {
            out.push((id.clone(), payload));
        }
    }
    out
}

#[derive(Debug)]
pub struct Reader {
    conn: Conn,
    spec: Arc<Spec>,
    /// Last id read per shard; `None`: from the start.
    after: Vec<Option<Bytes>>,
}

impl Reader {
    pub async fn seek_start(&mut self, shard: u32) -> Result<(), String> {
        self.after[shard as usize] = None;
        Ok(())
    }

    pub async fn seek_end(&mut self, shard: u32) -> Result<(), String> {
        let k = key(&self.spec, shard);
        let v = self
            .conn
            .cmd(&[b"XREVRANGE", k.as_bytes(), b"+", b"-", b"COUNT", b"1"])
            .await?;
        self.after[shard as usize] = Some(
            entries(&v)
                .first()
                .map(|(id, _)| id.clone())
                .unwrap_or_else(|| Bytes::from_static(b"0-0")),
        );
        Ok(())
    }

    pub async fn read(
        &mut self,
        shard: u32,
        max: u32,
        _wait: Duration,
    ) -> Result<Vec<Bytes>, String> {
        let k = key(&self.spec, shard);
        let from = match &self.after[shard as usize] {
            None => Bytes::from_static(b"-"),
            Some(id) => {
                let mut b = BytesMut::with_capacity(id.len() + 1);
                b.extend_from_slice(b"(");
                b.extend_from_slice(id);
                b.freeze()
            }
        };
        let count = max.to_string();
        let v = self
            .conn
            .cmd(&[
                b"XRANGE",
                k.as_bytes(),
                &from,
                b"+",
                b"COUNT",
                count.as_bytes(),
            ])
            .await?;
        let es = entries(&v);
        if let Some((id, _)) = es.last() {
            self.after[shard as usize] = Some(id.clone());
        }
        Ok(es.into_iter().map(|(_, p)| p).collect())
    }
}

#[derive(Debug)]
pub struct Consumer {
    conn: Conn,
    spec: Arc<Spec>,
    name: String,
    /// XACK replies still to read (sent with the next XREADGROUP).
    acks_owed: usize,
}

impl Consumer {
    pub async fn poll(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Delivery>, String> {
        let k = key(&self.spec, shard);
        let count = max.to_string();
        let block = wait.as_millis().max(1).to_string();
        let mut args: Vec<&[u8]> = vec![
            b"XREADGROUP",
            b"GROUP",
            GROUP.as_bytes(),
            self.name.as_bytes(),
            b"COUNT",
            count.as_bytes(),
        ];
        if !wait.is_zero() {
            args.push(b"BLOCK");
            args.push(block.as_bytes());
        }
        args.extend_from_slice(&[b"STREAMS", k.as_bytes(), b">"]);
        self.conn.queue(&args);
        self.read_acks().await?;
        let v = match self.conn.reply().await? {
            Value::Error(e) => return Err(format!("XREADGROUP: {e}")),
            v => v,
        };
        // [[key, [[id, [f, v]], ...]]] or nil on timeout.
        let list = v
            .array()
            .and_then(|streams| streams.first())
            .and_then(Value::array)
            .and_then(|kv| kv.get(1))
            .cloned()
            .unwrap_or(Value::Array(None));
        Ok(entries(&list)
            .into_iter()
            .map(|(id, payload)| Delivery {
                handle: Handle::Redis(id),
                payload,
                attempts: 1,
            })
            .collect())
    }

    async fn read_acks(&mut self) -> Result<(), String> {
        while self.acks_owed > 0 {
            self.acks_owed -= 1;
            if let Value::Error(e) = self.conn.reply().await? {
                return Err(format!("XACK: {e}"));
            }
        }
        Ok(())
    }

    /// Queue an XACK; it goes out with the next poll (or `finish`).
    pub async fn ack(&mut self, shard: u32, handles: Vec<Handle>) -> Result<(), String> {
        if handles.is_empty() {
            return Ok(());
        }
        let k = key(&self.spec, shard);
        let ids: Vec<Bytes> = handles
            .into_iter()
            .map(|h| match h {
                Handle::Redis(id) => id,
                _ => unreachable!("redis consumer got a foreign handle"),
            })
            .collect();
        let mut args: Vec<&[u8]> = vec![b"XACK", k.as_bytes(), GROUP.as_bytes()];
        args.extend(ids.iter().map(|b| &b[..]));
        self.conn.queue(&args);
        self.acks_owed += 1;
        Ok(())
    }

    pub async fn nack(&mut self, _shard: u32, _handle: Handle) -> Result<(), String> {
        Err("Redis Streams has no nack".into())
    }

    pub async fn finish(&mut self) -> Result<(), String> {
        self.conn.flush().await?;
        self.read_acks().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resp_round_trips_and_waits_for_whole_values() {
        let mut out = BytesMut::new();
        encode(&mut out, &[b"XADD", b"k", b"*", b"d", b"hi"]);
        assert_eq!(
            &out[..],
            b"*5\r\n$4\r\nXADD\r\n$1\r\nk\r\n$1\r\n*\r\n$1\r\nd\r\n$2\r\nhi\r\n"
        );
        let reply = b"*2\r\n$3\r\n1-0\r\n*2\r\n$1\r\nd\r\n$2\r\nhi\r\n";
        for cut in 0..reply.len() {
            assert_eq!(parse(&reply[..cut]).unwrap(), None, "cut at {cut}");
        }
        let (v, used) = parse(reply).unwrap().unwrap();
        assert_eq!(used, reply.len());
        assert_eq!(v.array().unwrap().len(), 2);
        assert_eq!(
            parse(b"-ERR no\r\n").unwrap().unwrap().0,
            Value::Error("ERR no".into())
        );
        assert_eq!(parse(b":42\r\n").unwrap().unwrap().0, Value::Int(42));
        assert_eq!(parse(b"$-1\r\n").unwrap().unwrap().0, Value::Bulk(None));
        assert!(parse(b"?x\r\n").is_err());
    }

    #[test]
    fn stream_entries_are_unpacked() {
        let reply = b"*2\r\n*2\r\n$3\r\n1-0\r\n*2\r\n$1\r\nd\r\n$1\r\na\r\n*2\r\n$3\r\n1-1\r\n*2\r\n$1\r\nd\r\n$1\r\nb\r\n";
        let (v, _) = parse(reply).unwrap().unwrap();
        let e = entries(&v);
        assert_eq!(e.len(), 2);
        assert_eq!(&e[1].0[..], b"1-1");
        assert_eq!(&e[1].1[..], b"b");
    }
}

//! A fake broker on a tokio TcpListener speaking felix-wire, for tests that
//! do not need a real broker.
//!
//! It answers HELLO itself (with the configured core count and features,
//! putting the connection on `want_core` or core 0) and hands every other
//! request, with the core of its connection, to a handler. Each request is
//! handled on its own task, so a handler that sleeps answers late without
//! holding up later requests: answers go out in whatever order handlers
//! finish, as a real broker's do.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use felix_wire::{decode_request, encode_response, Request, Response, DEFAULT_MAX_FRAME_BYTES};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// What a handler does with a request.
pub enum Action {
    Reply(Response),
    /// Never answer.
    Ignore,
    /// Drop the connection.
    Close,
}

impl From<Response> for Action {
    fn from(r: Response) -> Action {
        Action::Reply(r)
    }
}

pub type BoxFut = Pin<Box<dyn Future<Output = Action> + Send>>;
pub type Handler = Arc<dyn Fn(u32, Request) -> BoxFut + Send + Sync>;

/// One request as the fake saw it: the core of its connection, and the
/// request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub core: u32,
    pub request: Request,
}

pub struct Fake {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Fake {
    /// Start a fake with `cores` cores advertising `features`.
    pub async fn start<F, Fut>(cores: u32, features: u64, handler: F) -> Fake
    where
        F: Fn(u32, Request) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Action> + Send + 'static,
    {
        let handler: Handler = Arc::new(move |core, req| Box::pin(handler(core, req)));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(serve_conn(
                    socket,
                    cores,
                    features,
                    handler.clone(),
                    seen2.clone(),
                ));
            }
        });
        Fake { addr, seen, accept }
    }

    /// Stop listening: new connections are refused. Connections already
    /// open carry on.
    pub async fn stop_listening(&self) {
        self.accept.abort();
        while !self.accept.is_finished() {
            tokio::task::yield_now().await;
        }
    }

    /// Every request seen so far (HELLOs included).
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Requests seen, other than HELLO.
    pub fn requests(&self) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| !matches!(s.request, Request::Hello { .. }))
            .collect()
    }

    pub fn count(&self, pred: impl Fn(&Request) -> bool) -> usize {
        self.seen().iter().filter(|s| pred(&s.request)).count()
    }
}

enum Out {
    Frame(u64, Response),
    Close,
}

async fn serve_conn(
    socket: tokio::net::TcpStream,
    cores: u32,
    features: u64,
    handler: Handler,
    seen: Arc<Mutex<Vec<Seen>>>,
) {
    let (mut rd, mut wr) = socket.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Out>();
    let writer = tokio::spawn(async move {
        while let Some(out) = rx.recv().await {
            match out {
                Out::Frame(id, resp) => {
                    let mut buf = BytesMut::new();
                    encode_response(id, &resp, &mut buf);
                    if wr.write_all(&buf).await.is_err() {
                        return;
                    }
                }
                Out::Close => return,
            }
        }
    });
    let mut buf = BytesMut::new();
    let mut core = 0;
    'conn: loop {
        loop {
            match decode_request(&mut buf, DEFAULT_MAX_FRAME_BYTES) {
                Ok(Some((id, req))) => {
                    seen.lock().unwrap().push(Seen {
                        core,
                        request: req.clone(),
                    });
                    if let Request::Hello { want_core, .. } = &req {
                        core = want_core.filter(|c| *c < cores).unwrap_or(0);
                        let ok = Response::HelloOk {
                            version: felix_wire::PROTOCOL_VERSION,
                            features,
                            cores,
                            core,
                            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
                            broker: "fake".into(),
                        };
                        let _ = tx.send(Out::Frame(id, ok));
                        continue;
                    }
                    let h = handler.clone();
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        match h(core, req).await {
                            Action::Reply(r) => {
                                let _ = tx.send(Out::Frame(id, r));
                            }
                            Action::Ignore => {}
                            Action::Close => {
                                let _ = tx.send(Out::Close);
                            }
                        }
                    });
                }
                Ok(None) => break,
                Err(e) => panic!("fake broker got a bad frame: {e}"),
            }
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break 'conn,
            Ok(_) => {}
        }
        if writer.is_finished() {
            break;
        }
    }
    writer.abort();
}

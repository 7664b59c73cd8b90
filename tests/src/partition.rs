//! A loopback network between cluster brokers that a test can cut.
//!
//! Every broker dials every other through a relay of its own: broker `x`
//! is told that broker `y`'s replication address is the relay `x → y`,
//! which forwards to `y`'s real address (brokers name their peers in
//! their handshake and frames, not by address, so each may be given its
//! own view). A relay copies bytes in both directions until the test
//! *isolates* one end; from then on it holds whatever it has read (and
//! reads no more) until the test heals it, when the held bytes go on in
//! order, and it closes any new connection at once. To every broker that
//! looks like a network that stopped delivering: connections open before
//! the cut stall with nothing lost or corrupted, the same as a cable
//! pulled and put back within TCP's patience, and new ones fail.
//!
//! The relays run on their own thread's runtime, so a test that blocks
//! its own (starting or killing a broker) does not stall the network.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The relays between `n` brokers' replication ports.
pub struct Partition {
    isolated: Arc<Vec<AtomicBool>>,
    /// `relay[x][y]`: where broker `x` dials broker `y` (`x != y`).
    relay: Vec<Vec<Option<SocketAddr>>>,
    real: Vec<SocketAddr>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Partition {
    /// Relays for brokers whose real replication addresses are `real`.
    pub fn new(real: &[SocketAddr]) -> Partition {
        let n = real.len();
        let isolated: Arc<Vec<AtomicBool>> =
            Arc::new((0..n).map(|_| AtomicBool::new(false)).collect());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("partition-relay")
            .enable_all()
            .build()
            .expect("relay runtime");
        let mut relay = vec![vec![None; n]; n];
        for (x, row) in relay.iter_mut().enumerate() {
            for (y, slot) in row.iter_mut().enumerate() {
                if x == y {
                    continue;
                }
                let listener = rt
                    .block_on(TcpListener::bind("127.0.0.1:0"))
                    .expect("bind a relay");
                *slot = Some(listener.local_addr().expect("relay address"));
                let (to, isolated) = (real[y], isolated.clone());
                rt.spawn(accept(listener, to, move || {
                    isolated[x].load(Ordering::SeqCst) || isolated[y].load(Ordering::SeqCst)
                }));
            }
        }
        Partition {
            isolated,
            relay,
            real: real.to_vec(),
            rt: Some(rt),
        }
    }

    /// Broker `x`'s replication address for broker `y`: its own real one
    /// for itself, a relay for any other.
    pub fn address(&self, x: usize, y: usize) -> SocketAddr {
        self.relay[x][y].unwrap_or(self.real[y])
    }

    /// Cut broker `x` off from every other (both directions).
    pub fn isolate(&self, x: usize) {
        self.isolated[x].store(true, Ordering::SeqCst);
    }

    /// Let broker `x`'s traffic through again, what was held first.
    pub fn heal(&self, x: usize) {
        self.isolated[x].store(false, Ordering::SeqCst);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

async fn accept<F>(listener: TcpListener, to: SocketAddr, cut: F)
where
    F: Fn() -> bool + Clone + Send + Sync + 'static,
{
    loop {
        let Ok((a, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        if cut() {
            // A dial across the cut fails.
            drop(a);
            continue;
        }
        let cut = cut.clone();
        tokio::spawn(async move {
            let Ok(b) = TcpStream::connect(to).await else {
                return;
            };
            let _ = a.set_nodelay(true);
            let _ = b.set_nodelay(true);
            let (ar, aw) = a.into_split();
            let (br, bw) = b.into_split();
            tokio::spawn(copy(ar, bw, cut.clone()));
            tokio::spawn(copy(br, aw, cut));
        });
    }
}

/// Copy until either side closes; while cut, hold what was read and read
/// nothing more.
async fn copy<F: Fn() -> bool>(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: F,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        while cut() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        while cut() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

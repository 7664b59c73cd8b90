//! Cross-core mailboxes: how a core, or any other thread, hands a message to
//! one core. They carry connection hand-offs, admin fan-out and the replies
//! to it: never the publish, read or group path, which stays on one core.
//!
//! The queue is a `Mutex<VecDeque>` (held for one push or pop); the wake-up
//! is a byte written to a socket pair whose read end the receiving core reads
//! through its io_uring. A byte written after the receiver last looked at the
//! queue stays in the socket until the receiver reads it, so a wake-up cannot
//! be lost, whatever the receiving executor was doing when it came: the
//! kernel keeps the state, not a flag the two threads race on.
//!
//! Why not glommio's channel mesh: it needs every core to join before any
//! can send, so a core that is slow to start holds up the others; its
//! builder shares an `Rc` between executor threads (each core drops its
//! clone on its own thread: a non-atomic count touched from two threads); and
//! the signal thread, which is not an executor, could not use it for the
//! shutdown message anyway. One mailbox per core serves every sender.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

struct Inner<T> {
    queue: Mutex<VecDeque<T>>,
    receiver_gone: AtomicBool,
}

/// The sending side: any thread, any number of clones.
pub struct Sender<T> {
    inner: Arc<Inner<T>>,
    /// The write end of the bell. It closes when the last sender drops, which
    /// the receiver reads as end of file.
    bell: Arc<OwnedFd>,
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender {
            inner: self.inner.clone(),
            bell: self.bell.clone(),
        }
    }
}

/// The receiving side, before it reaches its core: `Send`, so it can be
/// made anywhere and moved to the core that will [`attach`](Self::attach) it.
pub struct Receiver<T> {
    inner: Owner<T>,
    bell: OwnedFd,
}

/// The receiving side on its core.
pub struct LocalReceiver<T> {
    inner: Owner<T>,
    bell: glommio::net::UnixStream,
    senders_gone: bool,
}

/// A mailbox: its sender and its receiver.
pub fn channel<T: Send>() -> io::Result<(Sender<T>, Receiver<T>)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded; both descriptors are new and ours alone.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // The write end never blocks: a full socket already holds a pending
    // wake-up, so a failed ring loses nothing.
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(write_end.as_raw_fd(), libc::F_GETFL);
        if flags < 0
            || libc::fcntl(
                write_end.as_raw_fd(),
                libc::F_SETFL,
                flags | libc::O_NONBLOCK,
            ) < 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    let inner = Arc::new(Inner {
        queue: Mutex::new(VecDeque::new()),
        receiver_gone: AtomicBool::new(false),
    });
    Ok((
        Sender {
            inner: inner.clone(),
            bell: Arc::new(write_end),
        },
        Receiver {
            inner: Owner(inner),
            bell: read_end,
        },
    ))
}

impl<T> Sender<T> {
    /// Queue `msg` for the receiver and wake it. Gives the message back if
    /// the receiver is gone.
    pub fn send(&self, msg: T) -> Result<(), T> {
        {
            // Checked under the queue's lock, which the receiver's drop also
            // takes: a message is either refused or dropped with the queue,
            // never left behind in it.
            let mut q = lock(&self.inner.queue);
            if self.inner.receiver_gone.load(Ordering::Relaxed) {
                return Err(msg);
            }
            q.push_back(msg);
        }
        self.ring();
        Ok(())
    }

    fn ring(&self) {
        let byte = 1u8;
        loop {
            // SAFETY: writes one byte from a live local to a descriptor we
            // hold open.
            let n = unsafe {
                libc::write(
                    self.bell.as_raw_fd(),
                    &byte as *const u8 as *const libc::c_void,
                    1,
                )
            };
            if n >= 0 {
                return;
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => continue,
                // EAGAIN: unread bytes are already waiting. EPIPE and the
                // like: the receiver is gone, and the message with it.
                _ => return,
            }
        }
    }
}

impl<T> Receiver<T> {
    /// Bind the mailbox to the calling core's executor (call it there).
    pub fn attach(self) -> LocalReceiver<T> {
        let Receiver { inner, bell } = self;
        LocalReceiver {
            inner,
            // SAFETY: ownership of the read end moves to glommio.
            bell: unsafe {
                glommio::net::UnixStream::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(bell))
            },
            senders_gone: false,
        }
    }
}

impl<T> LocalReceiver<T> {
    /// The next message, waiting for one; `None` once every sender is gone
    /// and the queue is empty. Call it on the core that owns the mailbox.
    pub async fn recv(&mut self) -> Option<T> {
        use futures_lite::AsyncReadExt;
        loop {
            if let Some(m) = lock(&self.inner.queue).pop_front() {
                return Some(m);
            }
            if self.senders_gone {
                return None;
            }
            // One read takes every pending ring: the queue is drained whole
            // before the next read, so no ring is left unanswered.
            let mut buf = [0u8; 256];
            match self.bell.read(&mut buf).await {
                Ok(0) => self.senders_gone = true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Not expected from a local socket; treat as closed
                    // rather than spin.
                    tracing::error!("mailbox wake-up read failed: {e}");
                    self.senders_gone = true;
                }
            }
        }
    }
}

/// The receiver's hold on the queue: when it goes, senders are refused and
/// what is queued is dropped.
struct Owner<T>(Arc<Inner<T>>);

impl<T> std::ops::Deref for Owner<T> {
    type Target = Inner<T>;
    fn deref(&self) -> &Inner<T> {
        &self.0
    }
}

impl<T> Drop for Owner<T> {
    fn drop(&mut self) {
        // Take the queued messages out under the lock (so no send slips in
        // after the flag) and drop them outside it: a message's own drop
        // (a reply mailbox, a socket) must not run under our lock.
        let queued = {
            let mut q = lock(&self.0.queue);
            self.0.receiver_gone.store(true, Ordering::Relaxed);
            std::mem::take(&mut *q)
        };
        drop(queued);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave a VecDeque half-updated in
    // a way that matters here; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use glommio::LocalExecutorBuilder;

    #[test]
    fn messages_from_other_threads_wake_a_parked_core() {
        let (tx, rx) = channel::<u64>().unwrap();
        let ex = LocalExecutorBuilder::default()
            .spawn(move || async move {
                let mut rx = rx.attach();
                let mut got = Vec::new();
                while let Some(v) = rx.recv().await {
                    got.push(v);
                }
                got
            })
            .unwrap();
        let senders: Vec<_> = (0..4u64)
            .map(|t| {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        tx.send(t * 1000 + i).unwrap();
                        if i % 100 == 0 {
                            // Let the core park between bursts.
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        drop(tx);
        for s in senders {
            s.join().unwrap();
        }
        let mut got = ex.join().unwrap();
        assert_eq!(got.len(), 4000);
        // Each sender's messages arrive in its order.
        for t in 0..4u64 {
            let mine: Vec<_> = got.iter().copied().filter(|v| v / 1000 == t).collect();
            assert_eq!(mine, (t * 1000..t * 1000 + 1000).collect::<Vec<_>>());
        }
        got.sort_unstable();
        got.dedup();
        assert_eq!(got.len(), 4000);
    }

    #[test]
    fn messages_queued_when_the_receiver_goes_are_dropped_not_kept() {
        // A queued reply mailbox stands in for a hand-off's socket or an
        // admin request's reply: dropping it must close it, so whoever
        // waits on it learns the core is gone.
        let (tx, rx) = channel::<Sender<u32>>().unwrap();
        let (reply_tx, reply_rx) = channel::<u32>().unwrap();
        assert!(tx.send(reply_tx).is_ok());
        drop(rx);
        let ex = LocalExecutorBuilder::default()
            .spawn(move || async move { reply_rx.attach().recv().await })
            .unwrap();
        assert_eq!(ex.join().unwrap(), None, "the reply's sender was dropped");
        assert!(tx.send(channel::<u32>().unwrap().0).is_err());
    }

    #[test]
    fn a_send_to_a_dropped_receiver_gives_the_message_back() {
        let (tx, rx) = channel::<String>().unwrap();
        drop(rx);
        assert_eq!(tx.send("x".into()), Err("x".to_string()));
    }

    #[test]
    fn cores_ping_pong_without_losing_a_wake_up() {
        // Two executors answer each other 2,000 times: every round trip
        // needs a wake-up of a parked core.
        let (to_b, b_rx) = channel::<u32>().unwrap();
        let (to_a, a_rx) = channel::<u32>().unwrap();
        let b = LocalExecutorBuilder::default()
            .spawn(move || async move {
                let mut b_rx = b_rx.attach();
                while let Some(v) = b_rx.recv().await {
                    if to_a.send(v + 1).is_err() {
                        break;
                    }
                }
            })
            .unwrap();
        let a = LocalExecutorBuilder::default()
            .spawn(move || async move {
                let mut a_rx = a_rx.attach();
                let mut v = 0;
                while v < 4000 {
                    to_b.send(v).unwrap();
                    v = a_rx.recv().await.unwrap() + 1;
                }
                v
            })
            .unwrap();
        assert_eq!(a.join().unwrap(), 4000);
        b.join().unwrap();
    }
}

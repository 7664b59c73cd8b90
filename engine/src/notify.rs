//! A level-triggered wake list for tasks on one core.
//!
//! glommio has no `Notify`; this is the small piece we need: tasks wait for
//! "something changed", re-check their condition, and wait again. No atomics,
//! no locks: it lives on one executor.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

#[derive(Default)]
pub struct WaitList {
    epoch: Cell<u64>,
    wakers: RefCell<Vec<Waker>>,
}

impl WaitList {
    pub fn new() -> Self {
        Self::default()
    }

    /// Wake every task currently waiting.
    pub fn wake_all(&self) {
        self.epoch.set(self.epoch.get() + 1);
        let wakers = std::mem::take(&mut *self.wakers.borrow_mut());
        for w in wakers {
            w.wake();
        }
    }

    /// Resolves after the next `wake_all` that follows this call.
    pub fn wait(&self) -> Wait<'_> {
        Wait {
            list: self,
            epoch: self.epoch.get(),
        }
    }

    pub fn waiting(&self) -> usize {
        self.wakers.borrow().len()
    }
}

pub struct Wait<'a> {
    list: &'a WaitList,
    epoch: u64,
}

impl Future for Wait<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.list.epoch.get() != self.epoch {
            return Poll::Ready(());
        }
        self.list.wakers.borrow_mut().push(cx.waker().clone());
        Poll::Pending
    }
}

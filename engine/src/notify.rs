//! A level-triggered wake list for tasks on one core.
//!
//! glommio has no `Notify`; this is the small piece we need: tasks wait for
//! "something changed", re-check their condition, and wait again. No atomics,
//! no locks: it lives on one executor.
//!
//! Each waiting future holds one slot. Polling it again (as `or`/`select`
//! combinators do whenever another branch wakes) updates its slot instead of
//! adding a waker, and dropping it frees the slot, so the list holds exactly
//! the live waiters. (Accumulating clones of one task's waker overflows
//! glommio's per-task reference count.)

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

#[derive(Default)]
pub struct WaitList {
    epoch: Cell<u64>,
    slots: RefCell<Vec<Option<Waker>>>,
    free: RefCell<Vec<usize>>,
}

impl WaitList {
    pub fn new() -> Self {
        Self::default()
    }

    /// Wake every task currently waiting.
    pub fn wake_all(&self) {
        // The epoch moves even with nobody listed: a `Wait` made but not yet
        // polled resolves on its first poll.
        self.epoch.set(self.epoch.get() + 1);
        if self.slots.borrow().is_empty() {
            return;
        }
        let slots = std::mem::take(&mut *self.slots.borrow_mut());
        self.free.borrow_mut().clear();
        for w in slots.into_iter().flatten() {
            w.wake();
        }
    }

    /// Resolves after the next `wake_all` that follows this call.
    pub fn wait(&self) -> Wait<'_> {
        Wait {
            list: self,
            epoch: self.epoch.get(),
            slot: None,
        }
    }

    /// Tasks waiting now.
    pub fn waiting(&self) -> usize {
        self.slots.borrow().iter().filter(|s| s.is_some()).count()
    }
}

pub struct Wait<'a> {
    list: &'a WaitList,
    epoch: u64,
    slot: Option<usize>,
}

impl Future for Wait<'_> {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let list = self.list;
        if list.epoch.get() != self.epoch {
            return Poll::Ready(());
        }
        let mut slots = list.slots.borrow_mut();
        match self.slot {
            Some(i) => match &mut slots[i] {
                Some(w) if w.will_wake(cx.waker()) => {}
                other => *other = Some(cx.waker().clone()),
            },
            None => {
                let i = match list.free.borrow_mut().pop() {
                    Some(i) => {
                        slots[i] = Some(cx.waker().clone());
                        i
                    }
                    None => {
                        slots.push(Some(cx.waker().clone()));
                        slots.len() - 1
                    }
                };
                drop(slots);
                self.slot = Some(i);
            }
        }
        Poll::Pending
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        // Slots of an older epoch were cleared by `wake_all`.
        if let (Some(i), true) = (self.slot, self.list.epoch.get() == self.epoch) {
            self.list.slots.borrow_mut()[i] = None;
            self.list.free.borrow_mut().push(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::task::Wake;

    struct Count(std::sync::atomic::AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn repolling_and_dropping_do_not_grow_the_list() {
        let list = WaitList::new();
        let counter = Arc::new(Count(0.into()));
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        let mut a = Box::pin(list.wait());
        for _ in 0..100_000 {
            assert!(a.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(list.waiting(), 1);
        for _ in 0..1000 {
            let mut b = Box::pin(list.wait());
            assert!(b.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(list.waiting(), 1, "dropped waiters leave no waker behind");
        list.wake_all();
        assert_eq!(counter.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(a.as_mut().poll(&mut cx).is_ready());
        assert_eq!(list.waiting(), 0);
    }
}

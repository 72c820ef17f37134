//! Completion slots: the meeting point between an operation's future and the
//! progress engine that finishes it.
//!
//! A slot is shared (`Arc`) by the future and by whoever owns the in-flight
//! operation (a transport queue, the RMA table). The engine calls
//! [`Completion::complete`] exactly once with the result; the future polls
//! [`Completion::poll`]. Dropping the future only drops its `Arc`: the engine
//! still completes the slot, nobody is woken, nothing dangles.

use std::task::{Context, Poll, Waker};

use std::sync::Arc;

use crate::sys::sync::{lock_model as lock, ModelMutex as Mutex};
use crate::Result;

enum State {
    Waiting(Option<Waker>),
    Done(Result<()>),
    Taken,
}

/// Keep `cx`'s waker in `w` (unless the one there wakes the same task).
fn register(w: &mut Option<Waker>, cx: &Context<'_>) {
    match w {
        Some(old) if old.will_wake(cx.waker()) => {}
        _ => *w = Some(cx.waker().clone()),
    }
}

/// A one-shot completion slot.
pub(crate) struct Completion {
    state: Mutex<State>,
    /// What a fetching operation returns (an atomic's previous value):
    /// stored before [`Completion::complete`], read after a `Ready(Ok)`.
    value: std::sync::atomic::AtomicU64,
}

impl Completion {
    /// A fresh, pending slot.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Completion {
            state: Mutex::new(State::Waiting(None)),
            value: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Complete with success and a value for the waiter (a fetching
    /// atomic's previous word). A slot completed already keeps its result;
    /// the value is only read after this call's success is seen.
    pub(crate) fn complete_value(&self, value: u64) {
        // Relaxed: the state mutex that `complete` takes (and `poll` takes
        // before the value is read) orders this store before that read.
        self.value
            .store(value, std::sync::atomic::Ordering::Relaxed);
        self.complete(Ok(()));
    }

    /// The value stored by [`Completion::complete_value`] (0 if none).
    /// Read it after `poll` returned `Ready(Ok(()))`.
    pub(crate) fn value(&self) -> u64 {
        self.value.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Record the result and wake the waiter. Later calls are ignored: the
    /// first result wins (a peer-loss sweep may race a late ACK).
    pub(crate) fn complete(&self, result: Result<()>) {
        let waker = {
            let mut st = lock(&self.state);
            match &mut *st {
                State::Waiting(w) => {
                    let w = w.take();
                    *st = State::Done(result);
                    w
                }
                _ => None,
            }
        };
        if let Some(w) = waker {
            crate::core::progress::wake(w);
        }
    }

    /// Whether the result is in (taken or not).
    pub(crate) fn is_done(&self) -> bool {
        !matches!(&*lock(&self.state), State::Waiting(_))
    }

    /// The result, if it is in and nobody took it yet (for an operation
    /// no future waits on); `None` while pending.
    pub(crate) fn take_done(&self) -> Option<Result<()>> {
        let mut st = lock(&self.state);
        match std::mem::replace(&mut *st, State::Taken) {
            State::Done(r) => Some(r),
            State::Taken => Some(Ok(())),
            w @ State::Waiting(_) => {
                *st = w;
                None
            }
        }
    }

    /// Have `cx`'s task woken when the result comes in, without taking
    /// it (for an operation no future waits on, whose slot has no waker of
    /// its own to displace). `false` when it is in already.
    pub(crate) fn wake_when_done(&self, cx: &mut Context<'_>) -> bool {
        let mut st = lock(&self.state);
        match &mut *st {
            State::Waiting(w) => {
                register(w, cx);
                true
            }
            _ => false,
        }
    }

    /// Poll for the result; registers the task's waker while pending.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut st = lock(&self.state);
        match &mut *st {
            State::Waiting(w) => {
                register(w, cx);
                Poll::Pending
            }
            State::Done(_) => match std::mem::replace(&mut *st, State::Taken) {
                State::Done(r) => Poll::Ready(r),
                _ => unreachable!("state was Done a line above"),
            },
            State::Taken => Poll::Ready(Err(crate::Error::Misuse(
                "operation future polled after it completed".into(),
            ))),
        }
    }
}

#[cfg(all(test, btl_loom))]
mod loom_tests {
    use super::*;
    use futures::task::noop_waker;
    use loom::thread;

    #[test]
    fn complete_races_poll_and_result_is_seen_once() {
        loom::model(|| {
            let c = Completion::new();
            let c2 = c.clone();
            let t = thread::spawn(move || c2.complete(Ok(())));
            let w = noop_waker();
            let mut cx = Context::from_waker(&w);
            let first = c.poll(&mut cx);
            t.join().unwrap();
            let second = c.poll(&mut cx);
            match (first, second) {
                (Poll::Pending, Poll::Ready(Ok(()))) => {}
                (Poll::Ready(Ok(())), Poll::Ready(Err(_))) => {}
                other => panic!(
                    "unexpected sequence: {:?}",
                    (other.0.is_ready(), other.1.is_ready())
                ),
            }
        });
    }

    #[test]
    fn double_complete_keeps_first() {
        loom::model(|| {
            let c = Completion::new();
            let a = c.clone();
            let b = c.clone();
            let ta = thread::spawn(move || a.complete(Ok(())));
            let tb = thread::spawn(move || b.complete(Err(crate::Error::Closed)));
            ta.join().unwrap();
            tb.join().unwrap();
            let w = noop_waker();
            let mut cx = Context::from_waker(&w);
            assert!(c.poll(&mut cx).is_ready());
        });
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;
    use futures::task::noop_waker;

    #[test]
    fn pending_then_ready_then_misuse() {
        let c = Completion::new();
        let w = noop_waker();
        let mut cx = Context::from_waker(&w);
        assert!(c.poll(&mut cx).is_pending());
        c.complete(Err(crate::Error::Closed));
        c.complete(Ok(()));
        assert!(matches!(
            c.poll(&mut cx),
            Poll::Ready(Err(crate::Error::Closed))
        ));
        assert!(matches!(
            c.poll(&mut cx),
            Poll::Ready(Err(crate::Error::Misuse(_)))
        ));
    }

    #[test]
    fn a_watcher_is_woken_and_the_result_left_for_its_owner() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let woken = Arc::new(Count(Default::default()));
        let w = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&w);
        let c = Completion::new();
        assert!(c.wake_when_done(&mut cx));
        assert!(c.wake_when_done(&mut cx), "the same waker again");
        c.complete(Err(crate::Error::Closed));
        assert_eq!(woken.0.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert!(!c.wake_when_done(&mut cx), "done: nothing to wait for");
        assert!(matches!(c.take_done(), Some(Err(crate::Error::Closed))));
    }
}

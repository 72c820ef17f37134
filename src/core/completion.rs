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

use crate::sys::sync::{lock_model as lock, AtomicU64, ModelMutex as Mutex, Ordering};
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

/// The operations to one peer that no future waits on (`put_nbi`,
/// `get_nbi` a transport carries natively), counted together instead of
/// given a slot each: starting one is an atomic add, finishing one an
/// atomic subtract, with no allocation, list or sweep per operation. A
/// `flush` waits for the count to reach zero and reports the first failure
/// recorded since the last one it reported. (Transports that count their
/// operations: `rdma`, and the crate's test double; in a build with
/// neither, only the core's side of it is used.)
pub(crate) struct Tally {
    /// Operations started and not finished.
    running: AtomicU64,
    /// The first failure since a flush last took it.
    failure: Mutex<Option<crate::Error>>,
    /// A flush waiting for `running` to reach zero.
    waiter: Mutex<Option<Waker>>,
}

impl Tally {
    /// A tally with nothing running.
    pub(crate) fn new() -> Arc<Tally> {
        Arc::new(Tally {
            running: AtomicU64::new(0),
            failure: Mutex::new(None),
            waiter: Mutex::new(None),
        })
    }

    /// Count one more operation; the token finishes it.
    #[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
    pub(crate) fn start(self: &Arc<Self>) -> Counted {
        // Relaxed: the count is read (Acquire) only after the finishing
        // subtract (AcqRel) of this same operation or a later one.
        self.running.fetch_add(1, Ordering::Relaxed);
        Counted(Some(self.clone()))
    }

    /// Operations started and not finished.
    pub(crate) fn running(&self) -> u64 {
        // Acquire: pairs with the finishing subtract, so a flush that sees
        // zero also sees each operation's effects and recorded failure.
        self.running.load(Ordering::Acquire)
    }

    /// The first failure since the last call, if any.
    pub(crate) fn take_failure(&self) -> Option<crate::Error> {
        lock(&self.failure).take()
    }

    /// Have `cx`'s task woken when the count reaches zero. The caller
    /// looks at [`running`](Self::running) again after this call: a
    /// finish between its last look and this call found no waker.
    pub(crate) fn wake_when_idle(&self, cx: &Context<'_>) {
        register(&mut lock(&self.waiter), cx);
    }

    #[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
    fn finish(&self, result: Result<()>) {
        if let Err(e) = result {
            lock(&self.failure).get_or_insert(e);
        }
        // AcqRel: the failure above is seen by whoever reads zero.
        if self.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Some(w) = lock(&self.waiter).take() {
                crate::core::progress::wake(w);
            }
        }
    }
}

/// One running operation of a [`Tally`]. Finished once: by
/// [`complete`](Self::complete), or, if it is dropped unfinished (the
/// transport gave the operation up), as failed with `Error::Closed`.
#[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
pub(crate) struct Counted(Option<Arc<Tally>>);

#[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
impl Counted {
    /// Record the operation's result and count it finished (later calls
    /// are ignored, as for [`Completion::complete`]).
    pub(crate) fn complete(&mut self, result: Result<()>) {
        if let Some(t) = self.0.take() {
            t.finish(result);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.complete(Err(crate::Error::Closed));
    }
}

/// Where a transport reports the end of an operation it carries: the
/// slot its future (or the core's list) waits on, or the peer's tally of
/// operations without a future.
#[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
pub(crate) enum Done {
    /// A slot of its own.
    Slot(Arc<Completion>),
    /// Counted in the peer's tally.
    Count(Counted),
}

#[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
impl Done {
    /// Record the result (the first one counts; later calls are ignored).
    pub(crate) fn complete(&mut self, result: Result<()>) {
        match self {
            Done::Slot(c) => c.complete(result),
            Done::Count(c) => c.complete(result),
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
    fn a_flush_waiting_on_a_tally_sees_its_last_finish() {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        struct Flag(AtomicBool);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, SeqCst);
            }
        }
        loom::model(|| {
            let t = Tally::new();
            let (mut a, mut b) = (t.start(), t.start());
            let ta = thread::spawn(move || a.complete(Ok(())));
            let tb = thread::spawn(move || b.complete(Err(crate::Error::Closed)));
            // The flush: register, then look again (as `Flush::poll`).
            let woken = Arc::new(Flag(AtomicBool::new(false)));
            let w = Waker::from(woken.clone());
            let cx = Context::from_waker(&w);
            let seen_idle = if t.running() == 0 {
                true
            } else {
                t.wake_when_idle(&cx);
                t.running() == 0
            };
            ta.join().unwrap();
            tb.join().unwrap();
            assert!(
                seen_idle || woken.0.load(SeqCst),
                "the flush neither saw the tally idle nor was woken"
            );
            assert_eq!(t.running(), 0);
            assert!(matches!(t.take_failure(), Some(crate::Error::Closed)));
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

    /// A waker that counts its wakes.
    fn counting_waker() -> (Arc<std::sync::atomic::AtomicUsize>, Waker) {
        struct Count(Arc<std::sync::atomic::AtomicUsize>);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        (n.clone(), Waker::from(Arc::new(Count(n))))
    }

    #[test]
    fn a_tally_counts_its_operations_and_keeps_the_first_failure() {
        let (woken, w) = counting_waker();
        let cx = Context::from_waker(&w);
        let t = Tally::new();
        let mut ops: Vec<Counted> = (0..4).map(|_| t.start()).collect();
        assert_eq!(t.running(), 4);
        t.wake_when_idle(&cx);
        ops[1].complete(Err(crate::Error::Misuse("first".into())));
        ops[1].complete(Ok(()));
        assert_eq!(t.running(), 3, "a second completion counts nothing");
        ops[0].complete(Ok(()));
        ops[2].complete(Err(crate::Error::Misuse("later".into())));
        assert_eq!(woken.load(std::sync::atomic::Ordering::Relaxed), 0);
        // One left unfinished and dropped: given up, counted as failed.
        drop(ops);
        assert_eq!(t.running(), 0);
        assert_eq!(
            woken.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "woken once, at zero"
        );
        assert!(matches!(t.take_failure(), Some(crate::Error::Misuse(m)) if m == "first"));
        assert!(t.take_failure().is_none(), "taken once");
        drop(t.start());
        assert!(matches!(t.take_failure(), Some(crate::Error::Closed)));
        // A slot and a count complete alike through `Done`.
        let slot = Completion::new();
        let mut d = [Done::Slot(slot.clone()), Done::Count(t.start())];
        for d in &mut d {
            d.complete(Ok(()));
        }
        assert!(slot.is_done());
        assert_eq!(t.running(), 0);
    }

    #[test]
    fn a_watcher_is_woken_and_the_result_left_for_its_owner() {
        let (woken, w) = counting_waker();
        let mut cx = Context::from_waker(&w);
        let c = Completion::new();
        assert!(c.wake_when_done(&mut cx));
        assert!(c.wake_when_done(&mut cx), "the same waker again");
        c.complete(Err(crate::Error::Closed));
        assert_eq!(woken.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert!(!c.wake_when_done(&mut cx), "done: nothing to wait for");
        assert!(matches!(c.take_done(), Some(Err(crate::Error::Closed))));
    }
}

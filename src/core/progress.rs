//! The one progress policy every transport runs under: poll while work
//! flows, then (Adaptive) park on the transport's doorbell after a spin
//! budget; BusyPoll never parks; Interrupt parks at once.
//!
//! No lost wake-ups: before parking the driver *arms* the transport (peers
//! will ring) and polls once more; anything that arrived between the last
//! poll and the arming is seen by that second poll.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::config::{Liveness, ProgressMode};
use crate::core::fabric::Core;
use crate::transport::Transport;

thread_local! {
    /// Tasks woken on this thread by deliveries and completions (see
    /// [`wake`]): the progress task compares it around a poll.
    static WOKEN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Wake `w`, the waiter of a delivered message or a finished operation,
/// and count it for this thread's progress task (see [`drive`]).
pub(crate) fn wake(w: std::task::Waker) {
    WOKEN.with(|c| c.set(c.get().wrapping_add(1)));
    w.wake();
}

/// The count [`wake`] keeps for this thread.
fn woken() -> u64 {
    WOKEN.with(std::cell::Cell::get)
}

/// How recent an inline poll by a receiver makes the progress task stand back.
const STAND_BACK: Duration = Duration::from_micros(50);

/// Spinning this long without work, also yield the CPU to the OS.
const OS_YIELD_AFTER: Duration = Duration::from_micros(20);

/// Progress polls between two yields to the runtime while hot.
const SPIN_TURNS: usize = 64;

/// When a transport's peers were last checked, in ms since `epoch`: by
/// its progress task, or by the liveness watchdog when that task is not
/// running.
pub(crate) struct Beat {
    epoch: Instant,
    ms: AtomicU64,
}

impl Beat {
    pub(crate) fn new() -> Arc<Beat> {
        Arc::new(Beat {
            epoch: Instant::now(),
            ms: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn touch(&self) {
        self.ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn age(&self) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.ms.load(Ordering::Relaxed)),
        )
    }
}

/// How many heartbeats a progress task may miss before the liveness
/// watch checks its peers itself.
const MISSED_BEATS: u32 = 3;

/// The liveness watch of a fabric: checks each transport's peers itself
/// whenever its progress task has not for [`MISSED_BEATS`] heartbeats (a
/// user task that never yields on a current-thread runtime, or a runtime
/// whose workers are all busy, starves the progress tasks: a dead peer
/// must still fail what waits on it), and expires unanswered one-sided
/// operations then too. Under [`Liveness::Thread`] a thread of its own
/// (`btl-liveness`) runs it; under [`Liveness::Inline`] the inline progress
/// paths do, until the process has a second thread (see [`Watch::inline`]).
/// It holds the transports and the core weakly.
pub(crate) struct Watch {
    transports: Vec<(Weak<dyn Transport>, Arc<Beat>)>,
    core: Weak<Core>,
    closed: Arc<AtomicBool>,
    heartbeat: Duration,
    /// Whether the thread was started.
    thread: AtomicBool,
    /// Whether starting it failed (it is not tried again).
    no_thread: AtomicBool,
    /// When the inline paths next run the watch, in ns on the dispatcher's
    /// clock (see [`Watch::inline`]).
    next_inline_ns: AtomicU64,
    /// Held by the inline check under way, so none nests in another.
    checking: std::sync::Mutex<()>,
}

impl Watch {
    /// The watch of `transports` (each with the beat its progress task
    /// keeps); under [`Liveness::Thread`], or in a process that already
    /// has several threads, its thread is started now.
    pub(crate) fn start(
        transports: Vec<(Weak<dyn Transport>, Arc<Beat>)>,
        core: &Arc<Core>,
    ) -> Arc<Watch> {
        let w = Arc::new(Watch {
            transports,
            core: Arc::downgrade(core),
            closed: core.closed.clone(),
            heartbeat: core.config.heartbeat,
            thread: AtomicBool::new(false),
            no_thread: AtomicBool::new(false),
            next_inline_ns: AtomicU64::new(0),
            checking: std::sync::Mutex::new(()),
        });
        if core.config.liveness == Liveness::Thread || !crate::sys::os::single_threaded() {
            w.start_thread();
        }
        w
    }

    /// Whether its thread runs.
    pub(crate) fn threaded(&self) -> bool {
        self.thread.load(Ordering::Relaxed)
    }

    /// Start the thread, once.
    fn start_thread(self: &Arc<Self>) {
        if self.no_thread.load(Ordering::Relaxed) || self.thread.swap(true, Ordering::Relaxed) {
            return;
        }
        let w = self.clone();
        let spawned = std::thread::Builder::new()
            .name("btl-liveness".into())
            .spawn(move || loop {
                std::thread::sleep(w.heartbeat);
                if w.closed.load(Ordering::Acquire) || !w.check() {
                    return;
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no liveness watchdog thread ({e}): peer losses are seen only while the progress tasks run or the library is called");
            // The inline checks go on (under `Inline`; no second try).
            self.no_thread.store(true, Ordering::Relaxed);
            self.thread.store(false, Ordering::Relaxed);
        }
    }

    /// One pass: check the peers of every transport whose progress task
    /// missed its beats, then expire unanswered operations if any did.
    /// `false` once the fabric's transports are gone.
    fn check(&self) -> bool {
        let mut alive = false;
        let mut starved = false;
        for (t, beat) in &self.transports {
            let Some(t) = t.upgrade() else { continue };
            alive = true;
            if beat.age() >= self.heartbeat * MISSED_BEATS && !self.closed.load(Ordering::Acquire) {
                t.check_peers();
                beat.touch();
                starved = true;
            }
        }
        if starved {
            if let Some(c) = self.core.upgrade() {
                c.expire_answers(c.config.answer_timeout);
            }
        }
        alive
    }

    /// From an inline progress path at `now_ns` (the dispatcher's clock),
    /// acting about once a heartbeat: while the process has one thread, do
    /// the thread's pass here; once it has several, start the thread (a
    /// starved runtime thread would no longer be the only one that could
    /// look).
    pub(crate) fn inline(self: &Arc<Self>, now_ns: u64) {
        if self.threaded() || now_ns < self.next_inline_ns.load(Ordering::Relaxed) {
            return;
        }
        let heartbeat_ns = u64::try_from(self.heartbeat.as_nanos()).unwrap_or(u64::MAX);
        self.next_inline_ns
            .store(now_ns.saturating_add(heartbeat_ns), Ordering::Relaxed);
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        if !crate::sys::os::single_threaded() {
            self.start_thread();
            if self.threaded() {
                return;
            }
        }
        // (A check that panicked leaves the lock poisoned: go on.)
        let _g = match self.checking.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        self.check();
    }

    /// From a progress task's heartbeat: start the thread once the process
    /// has several.
    fn on_beat(self: &Arc<Self>) {
        if !self.threaded()
            && !self.no_thread.load(Ordering::Relaxed)
            && !crate::sys::os::single_threaded()
        {
            self.start_thread();
        }
    }
}

/// Wait a while for a receiver polling progress inline: until it stops
/// (it notifies `cold` then), the fabric closes, or the timer wheel's next
/// tick (about 1 ms), whichever comes first.
async fn stand_back(core: &Core) {
    let closing = core.closing.clone();
    let cold = core.dispatcher.cold.clone();
    tokio::select! {
        _ = tokio::time::sleep(STAND_BACK) => {}
        _ = cold.notified() => {}
        _ = closing.notified() => {}
    }
}

/// Check `t`'s peers and expire unanswered operations when a heartbeat
/// has passed since `last_check`, and note the check on `beat`.
fn heartbeat(
    t: &dyn Transport,
    core: &Core,
    watch: &Arc<Watch>,
    beat: &Beat,
    last_check: &mut Instant,
    now: Instant,
) {
    if now.duration_since(*last_check) >= core.config.heartbeat {
        t.check_peers();
        core.expire_answers(core.config.answer_timeout);
        beat.touch();
        watch.on_beat();
        *last_check = now;
    }
}

/// Drive `t` until the fabric closes.
pub(crate) async fn drive(
    t: Arc<dyn Transport>,
    core: Arc<Core>,
    beat: Arc<Beat>,
    watch: Arc<Watch>,
) {
    let cfg = core.config.clone();
    let mut last_work = Instant::now();
    let mut last_check = Instant::now();
    let mut streak = 0u32;
    loop {
        if core.is_closed() {
            break;
        }
        if core.dispatcher.inline_polling(STAND_BACK) {
            // A receiver is polling progress itself: it finds what this
            // task would, and hands it over without a queue. Stand back
            // rather than race it for each message (what this task found
            // would be queued, in a buffer each), checking the peers on
            // time still.
            heartbeat(&*t, &core, &watch, &beat, &mut last_check, Instant::now());
            stand_back(&core).await;
            continue;
        }
        let before = woken();
        let work = t.progress();
        let now = Instant::now();
        heartbeat(&*t, &core, &watch, &beat, &mut last_check, now);
        if work > 0 {
            core.dispatcher.note_work();
            last_work = now;
            streak += 1;
            // Let the tasks this work woke (a receiver, the waiter of an
            // operation) run before polling again: on a current-thread
            // runtime they share this thread, and the answer one of them
            // sends must not wait for another poll, let alone for the
            // arming before a park. (Each yield costs the runtime an I/O
            // poll, so work that woke nobody yields only now and then.)
            if woken() != before || streak % 32 == 0 {
                tokio::task::yield_now().await;
            }
            continue;
        }
        let hot = match cfg.progress {
            ProgressMode::BusyPoll => true,
            ProgressMode::Adaptive => now.duration_since(last_work) < cfg.spin || t.keep_hot(),
            ProgressMode::Interrupt => false,
        };
        if hot {
            if core.dispatcher.inline_polling(STAND_BACK) {
                // A receiver is polling progress itself on its own thread:
                // spinning here too would only compete for the core.
                stand_back(&core).await;
            } else {
                // Spin on progress a while before handing the thread back:
                // each yield costs the runtime an I/O poll (epoll_wait).
                if (0..SPIN_TURNS).any(|_| {
                    std::hint::spin_loop();
                    t.progress() > 0
                }) {
                    core.dispatcher.note_work();
                    last_work = Instant::now();
                    continue;
                }
                if now.duration_since(last_work) > OS_YIELD_AFTER {
                    // Idle for a while: let a peer that shares this core run
                    // (returns at once when it does not).
                    std::thread::yield_now();
                }
                tokio::task::yield_now().await;
            }
            continue;
        }
        // Register for the local notifications before arming, so one sent
        // between the arming and the wait is not missed.
        let (space, closing) = (core.dispatcher.space.clone(), core.closing.clone());
        let space = space.notified();
        let closing = closing.notified();
        tokio::pin!(space, closing);
        space.as_mut().enable();
        closing.as_mut().enable();
        if !t.arm() {
            continue;
        }
        tokio::select! {
            _ = t.wait(cfg.heartbeat) => {}
            _ = space => {}
            _ = closing => {}
        }
        t.disarm();
        last_work = Instant::now();
    }
}

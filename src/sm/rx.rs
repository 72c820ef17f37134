//! Receive state of `sm`: [`RxState`] and its progress, which drains each
//! sender's fast box and rings (control first) and hands what it finds to
//! the protocols' receive halves — [`eager`](super::eager) (validate,
//! reassemble, deliver, return fragments), [`fastpath`](super::fastpath)
//! (runs of fast-box messages) and [`rendezvous`](super::rendezvous) —
//! and the idle check and peer loss that cover them all.

use super::eager::Partial;
use super::fbox;
use super::rendezvous::{Awaiting, SplitWait};
use super::segment::CHANNELS;
use super::split::{self, Tail};
use super::tx::USER;
use super::SmTransport;
use crate::core::stats::Counters;
use crate::sys::ring::{ConsumerState, ProducerState};

/// Fragments taken from one sender's ring per progress call, so one busy
/// sender cannot starve the others.
const BATCH: usize = 64;

/// Messages one progress call takes from a sender's fast box at most. A
/// run ends the call, so the receiving task works on those messages while
/// the sender writes the next ones; a longer run would hold a stream's
/// first message back until the sender paused (8 B streams of 64-message
/// windows ran 7-12% slower with runs of 64).
const FBOX_RUN: usize = 16;

/// Process-local receive state (behind the transport's `rx` mutex).
pub(crate) struct RxState {
    /// Consumer state per (sender, channel).
    pub(super) cons: Vec<ConsumerState>,
    /// Our producer state on each sender's return ring.
    pub(super) ret: Vec<ProducerState>,
    /// Our state on each sender's fast box.
    pub(super) fb: Vec<fbox::Receiver>,
    /// Message being reassembled per (sender, channel).
    pub(super) partial: Vec<Option<Partial>>,
    /// The sender's next user message waits for room in its tag's queue.
    pub(super) blocked: Vec<bool>,
    /// Per sender: a refused rendezvous waiting for its data.
    pub(super) awaiting: Vec<Option<Awaiting>>,
    /// Per sender: a split copy under way.
    pub(super) split: Vec<Option<SplitWait>>,
    /// Per sender: the last rendezvous handle whose tail we offered (never
    /// offered twice: a late request for the first offer could claim the
    /// second and write to the first buffer).
    pub(super) offered: Vec<u64>,
    /// Fast-box messages taken in the current progress call.
    pub(super) fast: u64,
    /// Messages taken directly (`take_direct`) since the last progress
    /// call.
    pub(super) direct_run: u32,
    /// Per sender: a direct take left the doorbell check to the next
    /// progress call.
    pub(super) owed: Vec<bool>,
    /// Peers (local ranks) caught misbehaving, to be cut off once the rx
    /// lock is released.
    pub(crate) misbehaved: Vec<(u32, String)>,
}

pub(super) enum Step {
    Took,
    Empty,
    Blocked,
    /// The next message is left where it is for its receiver, which lent
    /// a buffer and takes it there at its next look (`take_direct`).
    Later,
    Bad(&'static str),
}

impl RxState {
    pub(crate) fn new(n: usize) -> RxState {
        RxState {
            cons: vec![ConsumerState::default(); n * CHANNELS],
            ret: vec![ProducerState::default(); n],
            fb: vec![fbox::Receiver::default(); n],
            partial: (0..n * CHANNELS).map(|_| None).collect(),
            blocked: vec![false; n],
            awaiting: vec![None; n],
            split: (0..n).map(|_| None).collect(),
            offered: vec![0; n],
            fast: 0,
            direct_run: 0,
            owed: vec![false; n],
            misbehaved: Vec::new(),
        }
    }

    pub(crate) fn progress(&mut self, t: &SmTransport) -> usize {
        self.direct_run = 0;
        let mut work = 0;
        for p in t.peer_list().iter().flatten() {
            if p.is_lost() {
                continue;
            }
            let mut returned = 0;
            'channels: for ch in (0..CHANNELS).rev() {
                let mut budget = BATCH;
                let mut fbox_done = ch != USER;
                while budget > 0 {
                    // User messages: the fast box first (a run of messages
                    // under one dispatcher lock), then the ring (at most
                    // one of them holds messages at a time).
                    let (took, step) = if fbox_done {
                        (0, self.step(t, p, ch))
                    } else {
                        fbox_done = true;
                        // A run that emptied the box ends this call's look
                        // at the user channel: the ring, which may hold the
                        // sender's next messages once the box drained, is
                        // read by the next poll (peeking it here, between a
                        // ping-pong's message and its reply, costs 6% of an
                        // 8 B half round trip). Parking re-checks both under
                        // the lock (`looks_idle`), so nothing waits on it.
                        match self.fbox_run(t, p, budget.min(FBOX_RUN)) {
                            (0, Step::Empty) => (0, self.step(t, p, ch)),
                            r => r,
                        }
                    };
                    match step {
                        Step::Took => {
                            // A message from the ring (or a rendezvous done
                            // there): look in the box again first, which may
                            // hold the next ones (after a split copy of an
                            // announcement from the box, say).
                            if took == 0 {
                                fbox_done = ch != USER;
                            }
                            let n = took.max(1);
                            returned += n;
                            budget = budget.saturating_sub(n);
                        }
                        Step::Empty | Step::Blocked | Step::Later => {
                            returned += took;
                            break;
                        }
                        Step::Bad(what) => {
                            returned += took;
                            Counters::bump(&t.core.counters().bad_frames);
                            tracing::warn!(peer = p.rank, "bad shared-memory fragment: {what}");
                            self.misbehaved
                                .push((p.local, format!("it sent a bad fragment ({what})")));
                            break 'channels;
                        }
                    }
                }
            }
            if returned > 0 || std::mem::take(&mut self.owed[p.local as usize]) {
                t.notify(p);
                work += returned;
            }
        }
        let fast = std::mem::take(&mut self.fast);
        if fast > 0 {
            // Under `rx`, its only writer (see `SmCounters::fast_box_recvs`).
            let c = &t.counters.fast_box_recvs;
            let n = c.load(std::sync::atomic::Ordering::Relaxed);
            c.store(n.wrapping_add(fast), std::sync::atomic::Ordering::Relaxed);
        }
        work
    }

    /// Nothing waiting in any inbound ring (that we could take).
    pub(crate) fn looks_idle(&self, t: &SmTransport) -> bool {
        t.peer_list().iter().flatten().all(|p| {
            let l = p.local as usize;
            let empty = |ch: usize| {
                t.seg
                    .inbound(p.local, ch)
                    .looks_empty(&self.cons[l * CHANNELS + ch])
            };
            let b = t.seg.fbox(p.local);
            let box_empty = b.looks_empty(&self.fb[l]);
            // A split copy waits for the sender's DONE (or FAILED), which
            // it publishes before ringing us: re-read after arming, like
            // the rings, so that a DONE just before we armed is not missed.
            let split_waits = match &self.split[l] {
                Some(w) => split::state(b.split_word(), w.handle) == Tail::Claimed,
                None => true,
            };
            p.is_lost()
                || ((self.blocked[l] || (empty(USER) && box_empty)) && empty(1) && split_waits)
        })
    }

    pub(crate) fn peer_lost(&mut self, local: u32) {
        for ch in 0..CHANNELS {
            self.partial[local as usize * CHANNELS + ch] = None;
        }
        self.blocked[local as usize] = false;
        self.awaiting[local as usize] = None;
        // A split copy's buffer is leaked (dropping a SplitBuf does that):
        // the peer may have claimed its tail and still be writing.
        self.split[local as usize] = None;
    }
}

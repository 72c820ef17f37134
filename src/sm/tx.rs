//! Send state of `sm`: [`TxState`] (the fragment pool's bookkeeping, the
//! per-destination send queues, the rendezvous messages still out), the
//! entry points that queue or push a message, and the progress that
//! advances the queues. The protocols' send halves live with their receive
//! halves: [`eager`](super::eager) (fragments over the rings),
//! [`fastpath`](super::fastpath) (the fast box) and
//! [`rendezvous`](super::rendezvous); the [`Link`](crate::transport::Link)
//! impl is [`link`](super::link).
//!
//! Each destination has two channels — user messages and control messages
//! (put/get requests and answers, barrier, goodbye) — each with its own ring
//! and queue, so a receiver that holds back a full tag never blocks control
//! traffic. Order: only the head of a (destination, channel) queue may push
//! fragments, and a message's fragments are pushed back to back, so order per
//! pair and channel holds and the receiver never sees two messages
//! interleaved on one ring.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;

use super::adapt::{Adapt, Way};
use super::eager::{FreeList, FREE};
use super::fbox;
use super::kind::Kind;
use super::rendezvous::Rndv;
use super::segment::{Layout, CHANNELS};
use super::{SmPeer, SmTransport};
use crate::core::completion::Completion;
use crate::core::stats::Counters;
use crate::sys::mem::RawBuf;
use crate::sys::ring::{ConsumerState, ProducerState};
use crate::transport::Loss;
use crate::{Error, Result};

/// The user-message channel.
pub(crate) const USER: usize = 0;
/// Eager fragments only control messages may take (at most; an eighth of
/// the eager pool when that is smaller, so tiny pools keep working).
const CONTROL_RESERVE: usize = 4;

/// The channel a message kind travels on: user messages, their
/// rendezvous announcements and the core's lent messages on one (in order
/// with each other), the rest on the other.
pub(crate) fn channel(kind: Kind) -> usize {
    usize::from(!matches!(
        kind,
        Kind::User | Kind::UserCma | Kind::Core(crate::transport::Kind::Lent)
    ))
}

struct Queued {
    kind: Kind,
    tag: u64,
    data: Bytes,
    at: Cursor,
    done: Arc<Completion>,
}

/// Process-local send state (behind the transport's `tx` mutex).
pub(crate) struct TxState {
    pub(super) layout: Layout,
    /// Free fragments of each class, given back at the back. A user
    /// message takes the front one, which the receiver finished with
    /// longest ago, so its lines have left the receiver's nearest caches:
    /// against taking the back one (a stack), streaming 2-8 KiB is
    /// 1.08-1.16x as fast and latency 0.86-0.94x as long. A control
    /// message, sporadic, takes the back one: from the front, 64 KiB split
    /// copies (whose request is one) take 1.05x as long and 8-byte message
    /// rates are 0.93-0.99x.
    pub(super) free_eager: FreeList,
    pub(super) free_max: FreeList,
    /// For each fragment: the local rank holding it, or FREE.
    pub(super) dest: Vec<u32>,
    /// Fragments held by each local rank.
    pub(super) inflight: Vec<usize>,
    /// Messages in the send queues, all together.
    queued: usize,
    /// Most fragments one destination may hold, so one slow receiver cannot
    /// take the whole pool from the others.
    pub(super) cap: usize,
    /// Eager fragments kept for control messages.
    pub(super) reserve: usize,
    /// Our producer state on each peer's inbound rings (peer * CHANNELS + ch).
    pub(super) prod: Vec<ProducerState>,
    /// Our consumer state on each return ring in our segment.
    pub(super) ret: Vec<ConsumerState>,
    /// Our state on each peer's fast box for us.
    pub(super) fb: Vec<fbox::Sender>,
    /// Send queues (peer * CHANNELS + ch).
    queues: Vec<VecDeque<Queued>>,
    /// Rendezvous messages announced and not yet copied, by handle.
    pub(super) rndv: HashMap<u64, Rndv>,
    /// Per peer (local rank): the handles announced to it and still in
    /// `rndv`, oldest first, for its rendezvous-done word.
    pub(super) rndv_order: Vec<VecDeque<u64>>,
    /// Per peer: the highest value of its done word we acted on.
    pub(super) rndv_settled: Vec<u64>,
    pub(super) next_handle: u64,
    /// Single copy or fragments for mid-sized messages.
    pub(super) adapt: Adapt,
    /// While a push is timed for `adapt`: the time its copies into
    /// fragments took so far.
    pub(super) copy_time: Option<std::time::Duration>,
    /// The push under way takes the max fragment given back last, not the
    /// one free longest (see `submit`).
    pub(super) warm_max: bool,
    /// Peers (local ranks) caught misbehaving, cut off once `tx` is released.
    pub(crate) misbehaved: Vec<(u32, String)>,
}

/// How far a message has been pushed.
#[derive(Default)]
pub(super) struct Cursor {
    pub(super) sent: usize,
    pub(super) started: bool,
}

pub(super) enum Pushed {
    Done,
    Blocked,
}

impl TxState {
    pub(crate) fn new(layout: &Layout, n: usize) -> TxState {
        let ec = layout.p.eager_count;
        let frags = layout.frags();
        TxState {
            layout: *layout,
            free_eager: FreeList::new(0..ec),
            free_max: FreeList::new(ec..ec + layout.p.max_count),
            dest: vec![FREE; frags],
            inflight: vec![0; n],
            queued: 0,
            cap: if n > 2 { (frags * 3 / 4).max(1) } else { frags },
            reserve: (ec as usize / 8).min(CONTROL_RESERVE),
            prod: vec![ProducerState::default(); n * CHANNELS],
            ret: vec![ConsumerState::default(); n],
            fb: vec![fbox::Sender::default(); n],
            queues: (0..n * CHANNELS).map(|_| VecDeque::new()).collect(),
            rndv: HashMap::new(),
            rndv_order: vec![VecDeque::new(); n],
            rndv_settled: vec![0; n],
            next_handle: 1,
            // No band until the transport sets its own.
            adapt: Adapt::new(n, 0, 0),
            copy_time: None,
            warm_max: false,
            misbehaved: Vec::new(),
        }
    }

    /// Whether progress has anything to do for the send side: queued
    /// messages, rendezvous pending, or a pool running low (see `progress`).
    pub(crate) fn busy(&self) -> bool {
        self.queued > 0 || !self.rndv.is_empty() || !self.misbehaved.is_empty() || self.pool_low()
    }

    /// Note a peer that scribbled on shared state (cut off once `tx` is
    /// released) and make the error for the operation that found out.
    pub(super) fn corrupt(&mut self, peer: &SmPeer, what: &str) -> Error {
        self.misbehaved.push((peer.local, what.into()));
        Error::PeerMisbehaved {
            rank: peer.rank,
            what: what.into(),
        }
    }

    /// Send a borrowed message if one fragment that holds all of it is free
    /// now and nothing is queued ahead of it (the inline path). Never sends
    /// part of a message.
    // Its caller on the hot path (`SmLink::try_send`) is in another module,
    // so another codegen unit: without the hint it is not inlined there.
    #[inline]
    pub(super) fn try_send(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: &[u8],
    ) -> Result<bool> {
        if !self.one_ready(t, peer, kind, data.len())? {
            return Ok(false);
        }
        // The box carries user messages only (a lent message's
        // announcement goes on the ring behind them).
        if kind == Kind::User && data.len() <= fbox::MAX_PAYLOAD {
            if let Some(sent) = self.via_fbox(t, peer, false, tag, data)? {
                return Ok(sent);
            }
        }
        if !self.one_fits(t, peer, kind, data.len()) {
            return Ok(false);
        }
        // A fitting fragment is free, and `alloc` prefers the class that
        // fits, so the message goes out in exactly one fragment (or, while
        // the fast box still holds messages, not at all).
        let mut at = Cursor::default();
        match self.push(t, peer, kind, tag, data, &mut at)? {
            Pushed::Done => Ok(true),
            Pushed::Blocked if !at.started => Ok(false),
            Pushed::Blocked => Err(Error::Misuse(
                "internal: inline send pushed part of a message".into(),
            )),
        }
    }

    /// [`Link::try_send_filled`](crate::transport::Link::try_send_filled):
    /// `head` and `len` bytes `fill` writes straight into the fragment, in
    /// one fragment, if one is free now and nothing of the channel waits.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_send_filled(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        head: &[u8],
        len: usize,
        fill: &mut dyn FnMut(RawBuf) -> Result<()>,
    ) -> Result<bool> {
        // Not user messages: those must also wait for the fast box.
        if channel(kind) == USER {
            return Ok(false);
        }
        let total = head.len().saturating_add(len);
        if !self.one_ready(t, peer, kind, total)? || !self.one_fits(t, peer, kind, total) {
            return Ok(false);
        }
        self.push_filled(t, peer, kind, tag, head, len, fill)
    }

    /// Whether a message of `len` bytes of `kind` may go to `peer` now as
    /// one fragment, queue-wise: the fabric is open, the peer is there,
    /// the message fits a fragment, and nothing of its channel waits.
    #[inline]
    pub(super) fn one_ready(
        &self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        len: usize,
    ) -> Result<bool> {
        // Under `tx`: the fabric marks itself closed before its shutdown
        // takes `tx` to fail the queues, so nothing queued here is missed.
        if t.core.is_closed() {
            return Err(Error::Closed);
        }
        if peer.is_lost() {
            return Err(peer.lost_error());
        }
        let q = peer.local as usize * CHANNELS + channel(kind);
        Ok(len <= self.max_payload() && self.queues[q].is_empty())
    }

    /// Whether a fragment that holds `len` bytes of `kind` is free for
    /// `peer` (taking back what peers returned, if none is).
    #[inline]
    fn one_fits(&mut self, t: &SmTransport, peer: &SmPeer, kind: Kind, len: usize) -> bool {
        let need_max = len > self.eager_payload();
        let reserve = if channel(kind) == USER {
            self.reserve
        } else {
            0
        };
        let l = peer.local as usize;
        let fits = |s: &Self| {
            !(channel(kind) == USER && s.inflight[l] >= s.cap)
                && if need_max {
                    !s.free_max.is_empty()
                } else {
                    s.free_eager.len() > reserve || !s.free_max.is_empty()
                }
        };
        if !fits(self) {
            self.reclaim(t);
            return fits(self);
        }
        true
    }

    /// Send an owned message of `kind` to `peer`: a large user message by
    /// rendezvous, anything else through fragments (queued when they run
    /// out). What a peer's link does; the receive side calls it directly.
    pub(crate) fn submit(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: Bytes,
    ) -> Result<Option<Arc<Completion>>> {
        // Under `tx`: the fabric marks itself closed before its shutdown
        // takes `tx` to fail the queues, so nothing queued here is missed.
        if t.core.is_closed() {
            return Err(Error::Closed);
        }
        if peer.is_lost() {
            return Err(peer.lost_error());
        }
        let len = data.len();
        if kind == Kind::User
            && len >= t.config.cma_min
            && peer.cma_ok()
            && (len >= t.config.split_min || !self.rendezvous_out(t, peer))
        {
            let l = peer.local as usize;
            // The choice is made for a message that finds the peer caught
            // up with us (a request, an answer, the first of a burst): its
            // samples are clean, and within a burst the rule above (single
            // copy, then fragments while it is copied) already lets both
            // cores copy at once.
            let lone = self.adapt.in_band(len) && self.caught_up(t, peer);
            let way = if lone { self.adapt.way(l, len) } else { None };
            let Some((Way::Fragments, explored)) = way else {
                return self.announce(t, peer, tag, data, lone).map(Some);
            };
            // Its copies into fragments are timed (the rest of a push is
            // the same small cost either way), and counted only when it
            // all goes at once.
            // A message sent to measure fragments again takes the max
            // fragment given back last, as a sporadic message does: the
            // one free longest is cold, and its copy would measure that
            // rather than what fragments cost in use.
            self.copy_time = Some(std::time::Duration::ZERO);
            self.warm_max = explored;
            let at = self.push_now(t, peer, kind, tag, &data);
            self.warm_max = false;
            let copied = self.copy_time.take().unwrap_or_default();
            let at = at?;
            Counters::bump(&t.counters.chosen_fragment_sends);
            let Some(at) = at else {
                self.adapt.fragments_took(l, len, copied);
                return Ok(None);
            };
            return Ok(Some(self.enqueue(peer, kind, tag, data, at, None)));
        }
        self.send_owned(t, peer, kind, tag, data, None)
    }

    /// Whether a rendezvous of ours to `peer` is still being copied. Then a
    /// message below `split_min` goes through fragments instead: in a
    /// stream, both processes copy at once (the sender into fragments
    /// while the receiver copies out), where single copies one after
    /// another leave the sender's core idle (16 KiB streams about 1.4x as
    /// fast); a lone message, as in a request and its answer, takes the
    /// way `adapt` chooses (single copy with the choice off).
    fn rendezvous_out(&self, t: &SmTransport, peer: &SmPeer) -> bool {
        self.rndv_order[peer.local as usize]
            .back()
            .is_some_and(|&last| {
                // Acquire, as `reap_rendezvous` reads it.
                peer.seg
                    .fbox(t.seg.local_rank)
                    .rndv_done_word()
                    .load(std::sync::atomic::Ordering::Acquire)
                    < last
            })
    }

    /// Queue (or push at once) an owned message; `done` completes when its
    /// last byte is handed over (a new one is made if needed and none given).
    pub(super) fn send_owned(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: Bytes,
        done: Option<Arc<Completion>>,
    ) -> Result<Option<Arc<Completion>>> {
        match self.push_now(t, peer, kind, tag, &data)? {
            None => {
                if let Some(d) = done {
                    d.complete(Ok(()));
                }
                Ok(None)
            }
            Some(at) => Ok(Some(self.enqueue(peer, kind, tag, data, at, done))),
        }
    }

    /// Push `data` at once if nothing of its channel waits before it:
    /// `None` when it all went, else where queueing must pick it up.
    pub(super) fn push_now(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: &[u8],
    ) -> Result<Option<Cursor>> {
        let q = peer.local as usize * CHANNELS + channel(kind);
        let mut at = Cursor::default();
        if self.queues[q].is_empty() {
            if let Pushed::Done = self.push(t, peer, kind, tag, data, &mut at)? {
                return Ok(None);
            }
        }
        Ok(Some(at))
    }

    /// Queue the rest of a message (from `at`) behind its channel.
    pub(super) fn enqueue(
        &mut self,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: Bytes,
        at: Cursor,
        done: Option<Arc<Completion>>,
    ) -> Arc<Completion> {
        let q = peer.local as usize * CHANNELS + channel(kind);
        let done = done.unwrap_or_else(Completion::new);
        self.queued += 1;
        self.queues[q].push_back(Queued {
            kind,
            tag,
            data,
            at,
            done: done.clone(),
        });
        done
    }

    /// Advance queued messages as fragments come back.
    ///
    /// Returned fragments are polled for only while a quarter or more of a
    /// class is out (and taken back by a push that finds its class empty):
    /// a sender polling its return rings after every message keeps their
    /// lines moving between the cores, and the receiver's next return (on
    /// its critical path, before its doorbell fence) waits for the line to
    /// come back. A ping-pong so reads them once per quarter of a pool.
    #[inline]
    pub(crate) fn progress(&mut self, t: &SmTransport) -> usize {
        let mut work = 0;
        if self.pool_low() {
            work += self.reclaim(t);
        }
        if !self.rndv.is_empty() {
            work += self.reap_rendezvous(t);
        }
        for p in t.peer_list().iter().flatten() {
            if p.is_lost() {
                continue;
            }
            // Control first: it is small and others wait on it.
            for ch in (0..CHANNELS).rev() {
                let q = p.local as usize * CHANNELS + ch;
                while let Some(mut head) = self.queues[q].pop_front() {
                    self.queued -= 1;
                    match self.push(t, p, head.kind, head.tag, &head.data, &mut head.at) {
                        Ok(Pushed::Done) => {
                            work += 1;
                            head.done.complete(Ok(()));
                        }
                        Ok(Pushed::Blocked) => {
                            self.queued += 1;
                            self.queues[q].push_front(head);
                            break;
                        }
                        Err(e) => {
                            head.done.complete(Err(e));
                            work += 1;
                        }
                    }
                }
            }
        }
        work
    }

    /// Nothing to do: no queued message that a free fragment (or one
    /// waiting in a return ring) could move.
    #[inline]
    pub(crate) fn looks_idle(&self, t: &SmTransport) -> bool {
        let can_push = !self.free_eager.is_empty() || !self.free_max.is_empty();
        t.peer_list().iter().flatten().all(|p| {
            let l = p.local as usize;
            // A lost peer's ring is no longer read (see `reclaim`).
            let returns_empty = p.is_lost() || t.seg.returns(p.local).looks_empty(&self.ret[l]);
            // User messages also wait on the peer's fast box, which rings us
            // when it takes from it. A head that fits the box needs no
            // fragment while the pair's user ring is drained (it goes in
            // the box): it is stuck only while the box is busy. Otherwise
            // it goes on the ring, like any other head.
            let box_busy = !p.seg.fbox(t.seg.local_rank).looks_drained(&self.fb[l]);
            let needs_fragment = !can_push || self.inflight[l] >= self.cap;
            let user_stuck = match self.queues[l * CHANNELS + USER].front() {
                None => true,
                Some(h)
                    if matches!(h.kind, Kind::User | Kind::UserCma)
                        && !h.at.started
                        && h.data.len() <= fbox::MAX_PAYLOAD =>
                {
                    let ring = p.seg.inbound(t.seg.local_rank, USER);
                    if ring.looks_drained(&self.prod[l * CHANNELS + USER]) {
                        box_busy
                    } else {
                        needs_fragment
                    }
                }
                Some(_) => needs_fragment || box_busy,
            };
            let control_stuck = self.queues[l * CHANNELS + USER + 1].is_empty() || !can_push;
            let stuck = p.is_lost() || (user_stuck && control_stuck);
            // The peer's done word passed a rendezvous still out (it rings
            // us after storing it).
            let rndv_done = self.rndv_order[l].front().is_some_and(|&h| {
                let b = p.seg.fbox(t.seg.local_rank);
                b.rndv_done_word()
                    .load(std::sync::atomic::Ordering::Acquire)
                    >= h
            });
            // Returns matter only to a queue waiting for fragments.
            (returns_empty || self.queued == 0) && stuck && (p.is_lost() || !rndv_done)
        })
    }

    /// Every fragment is home (taking back what peers returned), every fast
    /// box emptied, and nothing is queued.
    pub(crate) fn drained(&mut self, t: &SmTransport) -> bool {
        self.reclaim(t);
        self.rndv.is_empty()
            && self.queues.iter().all(VecDeque::is_empty)
            && self.dest.iter().all(|d| *d == FREE)
            && t.peer_list().iter().flatten().all(|p| {
                p.is_lost()
                    || p.seg
                        .fbox(t.seg.local_rank)
                        .looks_drained(&self.fb[p.local as usize])
            })
    }

    /// Whether anything is queued towards local rank `l`.
    pub(crate) fn has_queued(&self, l: u32) -> bool {
        (0..CHANNELS).any(|ch| !self.queues[l as usize * CHANNELS + ch].is_empty())
            || self.rndv.values().any(|r| r.peer == l)
    }

    /// Fail the lost peer's queues and take back the fragments it held.
    /// `crashed`: its process is gone. Otherwise it may still be running
    /// (closed, cut off) and in the middle of copying a rendezvous message
    /// out of our memory, so those buffers are leaked, never freed (like
    /// the quarantine of single-copy regions).
    pub(crate) fn peer_lost(&mut self, t: &SmTransport, peer: &SmPeer, how: Loss) {
        let crashed = how == Loss::Crashed;
        // A peer that left in order handed back what it took: read that
        // first, so that its honest returns are not later found in the ring
        // for fragments already taken home (and it called a misbehaver).
        if how == Loss::Closed {
            self.reclaim_from(t, peer);
        }
        self.rndv_order[peer.local as usize].clear();
        for ch in 0..CHANNELS {
            let queue = &mut self.queues[peer.local as usize * CHANNELS + ch];
            self.queued -= queue.len();
            for q in queue.drain(..) {
                q.done.complete(Err(peer.lost_error()));
            }
        }
        for i in 0..self.dest.len() {
            if self.dest[i] == peer.local {
                self.free(i);
            }
        }
        let theirs: Vec<u64> = self
            .rndv
            .iter()
            .filter(|(_, r)| r.peer == peer.local)
            .map(|(h, _)| *h)
            .collect();
        for h in theirs {
            if let Some(r) = self.rndv.remove(&h) {
                r.done.complete(Err(peer.lost_error()));
                if !crashed {
                    std::mem::forget(r.data);
                }
            }
        }
    }

    /// Fail everything still queued (the fabric is closing).
    pub(crate) fn fail_all(&mut self) {
        for q in &mut self.queues {
            self.queued -= q.len();
            for m in q.drain(..) {
                m.done.complete(Err(Error::Closed));
            }
        }
        // Peers may still be copying these out of our memory: leak them
        // rather than free them under a running reader.
        self.rndv_order.iter_mut().for_each(VecDeque::clear);
        for (_, r) in self.rndv.drain() {
            r.done.complete(Err(Error::Closed));
            std::mem::forget(r.data);
        }
    }
}

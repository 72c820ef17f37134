//! Send side of `sm`: the fragment pool, per-destination send queues, and the
//! [`Link`] a user's endpoint talks to.
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

use super::fbox;
use super::frag::{FragHeader, FIRST, FRAG_HEADER, LAST};
use super::kind::Kind;
use super::segment::{Layout, CHANNELS};
use super::{SmPeer, SmTransport};
use crate::core::completion::Completion;
use crate::core::stats::Counters;
use crate::sys::ring::{ConsumerState, ProducerState};
use crate::sys::sync::lock;
use crate::transport::{Kind as CoreKind, Link, Loss};
use crate::{Error, Rank, Result};

const FREE: u32 = u32::MAX;
/// The user-message channel.
pub(crate) const USER: usize = 0;
/// Eager fragments only control messages may take (at most; an eighth of
/// the eager pool when that is smaller, so tiny pools keep working).
const CONTROL_RESERVE: usize = 4;

/// The channel a message kind travels on.
pub(crate) fn channel(kind: Kind) -> usize {
    usize::from(!matches!(kind, Kind::User | Kind::UserCma))
}

/// Bytes of a fragment whose lines a push asks for before it writes them
/// (`prefetchw`); beyond that, the copy streams on its own.
const PREFETCH_WRITE: usize = 8 * 1024;

/// Bytes of a rendezvous announcement: handle, address, length.
pub(crate) const RTS_LEN: usize = 24;

/// A rendezvous announcement: the sender's handle for the message, and
/// the address and length of its bytes in the sender's memory (three
/// little-endian words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rts {
    pub(crate) handle: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

impl Rts {
    /// Wire form.
    pub(crate) fn encode(&self) -> [u8; RTS_LEN] {
        let mut b = [0u8; RTS_LEN];
        b[..8].copy_from_slice(&self.handle.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Read an announcement (any bytes are one: the receiver checks the
    /// length against its limits and the range by copying from it).
    pub(crate) fn decode(b: &[u8; RTS_LEN]) -> Rts {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        Rts {
            handle: word(0),
            addr: word(1),
            len: word(2),
        }
    }
}

/// A large message the peer reads from our memory (rendezvous): kept alive,
/// unchanged (`Bytes` is immutable), until the peer says it is done.
struct Rndv {
    peer: u32,
    data: Bytes,
    done: Arc<Completion>,
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
    layout: Layout,
    /// Free fragments of each class, given back at the back. A user
    /// message takes the front one, which the receiver finished with
    /// longest ago, so its lines have left the receiver's nearest caches:
    /// against taking the back one (a stack), streaming 2-8 KiB is
    /// 1.08-1.16x as fast and latency 0.86-0.94x as long. A control
    /// message, sporadic, takes the back one: from the front, 64 KiB split
    /// copies (whose request is one) take 1.05x as long and 8-byte message
    /// rates are 0.93-0.99x.
    free_eager: FreeList,
    free_max: FreeList,
    /// For each fragment: the local rank holding it, or FREE.
    dest: Vec<u32>,
    /// Fragments held by each local rank.
    inflight: Vec<usize>,
    /// Messages in the send queues, all together.
    queued: usize,
    /// Most fragments one destination may hold, so one slow receiver cannot
    /// take the whole pool from the others.
    cap: usize,
    /// Eager fragments kept for control messages.
    reserve: usize,
    /// Our producer state on each peer's inbound rings (peer * CHANNELS + ch).
    prod: Vec<ProducerState>,
    /// Our consumer state on each return ring in our segment.
    ret: Vec<ConsumerState>,
    /// Our state on each peer's fast box for us.
    fb: Vec<fbox::Sender>,
    /// Send queues (peer * CHANNELS + ch).
    queues: Vec<VecDeque<Queued>>,
    /// Rendezvous messages announced and not yet copied, by handle.
    rndv: HashMap<u64, Rndv>,
    /// Per peer (local rank): the handles announced to it and still in
    /// `rndv`, oldest first, for its rendezvous-done word.
    rndv_order: Vec<VecDeque<u64>>,
    /// Per peer: the highest value of its done word we acted on.
    rndv_settled: Vec<u64>,
    next_handle: u64,
    /// Peers (local ranks) caught misbehaving, cut off once `tx` is released.
    pub(crate) misbehaved: Vec<(u32, String)>,
}

/// A queue of free fragment indices with room for every fragment of its
/// class: given back at the tail, taken from either end. (Not a
/// `VecDeque`: with one, whose growth path sits in every push, 8-byte
/// streaming, which never touches these lists, runs at 0.91-0.92x the
/// rate of this one.)
struct FreeList {
    slots: Box<[u32]>,
    head: usize,
    len: usize,
}

impl FreeList {
    fn new(all: std::ops::Range<u32>) -> FreeList {
        let slots: Box<[u32]> = all.collect();
        let len = slots.len();
        FreeList {
            slots,
            head: 0,
            len,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Give back `i`. (Each fragment is free at most once, so there is
    /// always room; a full list ignores the call.)
    fn push_back(&mut self, i: u32) {
        let cap = self.slots.len();
        if self.len < cap {
            let mut at = self.head + self.len;
            if at >= cap {
                at -= cap;
            }
            self.slots[at] = i;
            self.len += 1;
        }
    }

    /// Take the fragment given back last.
    fn pop_back(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        self.len -= 1;
        let mut at = self.head + self.len;
        if at >= self.slots.len() {
            at -= self.slots.len();
        }
        Some(self.slots[at])
    }

    /// Take the fragment given back longest ago.
    fn pop_front(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let i = self.slots[self.head];
        self.head += 1;
        if self.head == self.slots.len() {
            self.head = 0;
        }
        self.len -= 1;
        Some(i)
    }
}

/// How far a message has been pushed.
#[derive(Default)]
struct Cursor {
    sent: usize,
    started: bool,
}

enum Pushed {
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
            misbehaved: Vec::new(),
        }
    }

    fn eager_payload(&self) -> usize {
        self.layout.p.eager_size as usize - FRAG_HEADER
    }

    fn max_payload(&self) -> usize {
        self.layout.p.max_size as usize - FRAG_HEADER
    }

    /// Take back fragments peers returned. Returns how many.
    fn reclaim(&mut self, t: &SmTransport) -> usize {
        let mut n = 0;
        for p in t.peer_list().iter().flatten() {
            // A lost peer's fragments all came home when it was lost
            // (`peer_lost`): what it still hands back is no news.
            if !p.is_lost() {
                n += self.reclaim_from(t, p);
            }
        }
        n
    }

    /// Take back the fragments `p` returned.
    fn reclaim_from(&mut self, t: &SmTransport, p: &SmPeer) -> usize {
        let mut n = 0;
        let ring = t.seg.returns(p.local);
        let mut st = self.ret[p.local as usize];
        loop {
            match ring.peek(&mut st) {
                Ok(Some(off)) => {
                    ring.advance(&mut st);
                    match self.layout.frag_index(off) {
                        Some(i) if self.dest[i] == p.local => {
                            self.free(i);
                            n += 1;
                        }
                        _ => {
                            Counters::bump(&t.core.counters().bad_frames);
                            tracing::warn!(
                                peer = p.rank,
                                "peer returned a fragment it did not hold"
                            );
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    Counters::bump(&t.core.counters().bad_frames);
                    self.misbehaved
                        .push((p.local, "its fragment return ring is corrupt".into()));
                    break;
                }
            }
        }
        self.ret[p.local as usize] = st;
        n
    }

    /// Whether progress has anything to do for the send side: queued
    /// messages, rendezvous pending, or a pool running low (see `progress`).
    pub(crate) fn busy(&self) -> bool {
        self.queued > 0 || !self.rndv.is_empty() || !self.misbehaved.is_empty() || self.pool_low()
    }

    /// A quarter or more of a fragment class is out.
    fn pool_low(&self) -> bool {
        4 * self.free_eager.len() <= 3 * self.layout.p.eager_count as usize
            || 4 * self.free_max.len() <= 3 * self.layout.p.max_count as usize
    }

    fn free(&mut self, i: usize) {
        if let Some(held) = self.inflight.get_mut(self.dest[i] as usize) {
            *held = held.saturating_sub(1);
        }
        self.dest[i] = FREE;
        if i < self.layout.p.eager_count as usize {
            self.free_eager.push_back(i as u32);
        } else {
            self.free_max.push_back(i as u32);
        }
    }

    /// A free fragment of the class wanted, for a message to local rank `d`
    /// on channel `ch`; with `exact`, no max fragment for a message that
    /// wants an eager one.
    fn take(&mut self, d: u32, want_eager: bool, ch: usize, exact: bool) -> Option<usize> {
        // The per-destination cap is for user messages: control messages
        // (answers, barriers, the data of a refused rendezvous) must still
        // reach a receiver that holds our share of the pool.
        if ch == USER && self.inflight[d as usize] >= self.cap {
            return None;
        }
        // User messages leave the last few eager fragments to control
        // messages, so a receiver that holds back a full tag (and with it
        // our whole pool) cannot starve put/get answers or barriers.
        let eager_ok = ch != USER || self.free_eager.len() > self.reserve;
        // User messages take the fragment free longest (see `free_eager`);
        // control messages, sporadic, the one given back last.
        let user = ch == USER;
        let eager = |s: &mut Self| match (eager_ok, user) {
            (false, _) => None,
            (true, true) => s.free_eager.pop_front(),
            (true, false) => s.free_eager.pop_back(),
        };
        // (A large message takes eager fragments as readily as max ones:
        // more of it in flight at once.)
        let i = match (want_eager, exact) {
            (true, true) => eager(self),
            (true, false) => eager(self).or_else(|| self.free_max.pop_front()),
            (false, _) => self.free_max.pop_front().or_else(|| eager(self)),
        };
        i.map(|i| i as usize)
    }

    /// A fragment for a push: a small message takes an eager one if one is
    /// free or comes back from the return rings (not a max one while eager
    /// ones wait there), else any.
    fn alloc(&mut self, t: &SmTransport, d: u32, want_eager: bool, ch: usize) -> Option<usize> {
        self.take(d, want_eager, ch, true).or_else(|| {
            self.reclaim(t);
            self.take(d, want_eager, ch, false)
        })
    }

    /// Push as much of a message as fragments allow.
    fn push(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: &[u8],
        at: &mut Cursor,
    ) -> Result<Pushed> {
        if peer.is_lost() {
            return Err(peer.lost_error());
        }
        let total = data.len();
        let ch = channel(kind);
        if ch == USER {
            // Small user messages and rendezvous announcements take the box.
            if !at.started && total <= fbox::MAX_PAYLOAD {
                match self.via_fbox(t, peer, kind == Kind::UserCma, tag, data)? {
                    Some(true) => {
                        at.started = true;
                        at.sent = total;
                        return Ok(Pushed::Done);
                    }
                    Some(false) => return Ok(Pushed::Blocked),
                    None => {}
                }
            }
            // The ring may carry user messages only once the box is empty.
            if !self.fbox_drained(t, peer)? {
                return Ok(Pushed::Blocked);
            }
        }
        let ring = peer.seg.inbound(t.seg.local_rank, ch);
        let pi = peer.local as usize * CHANNELS + ch;
        let mut pushed = false;
        let r = loop {
            if at.started && at.sent == total {
                break Ok(Pushed::Done);
            }
            let rem = total - at.sent;
            let Some(i) = self.alloc(t, peer.local, rem <= self.eager_payload(), ch) else {
                break Ok(Pushed::Blocked);
            };
            let (off, size) = self.layout.frag(i);
            let n = rem.min(size - FRAG_HEADER);
            let mut flags = 0;
            if !at.started {
                flags |= FIRST;
            }
            if at.sent + n == total {
                flags |= LAST;
            }
            let h = FragHeader {
                kind,
                flags,
                len: n as u32,
                tag,
                total: total as u64,
            };
            let raw = t.seg.raw();
            // Ask for the fragment's lines for writing, all at once: the
            // receiver read them last, and a plain copy would wait for
            // each line's ownership in turn (the store buffer holds only
            // a few dozen stores).
            let end = off + (FRAG_HEADER + n).min(PREFETCH_WRITE) as u64;
            let mut line = off & !63;
            while line < end {
                raw.prefetch_write(line);
                line += 64;
            }
            raw.write(off, &h.encode())
                .and_then(|_| raw.write(off + FRAG_HEADER as u64, &data[at.sent..at.sent + n]))
                .map_err(|e| Error::Misuse(format!("fragment outside our own segment: {e}")))?;
            if !matches!(ring.push(&mut self.prod[pi], off), Ok(true)) {
                // Cannot happen with an honest peer: each ring holds every
                // fragment of our pool. A peer that scribbled on it is cut off.
                self.free(i);
                let what = "its inbound ring is full or corrupt";
                self.misbehaved.push((peer.local, what.into()));
                break Err(Error::PeerMisbehaved {
                    rank: peer.rank,
                    what: what.into(),
                });
            }
            self.dest[i] = peer.local;
            self.inflight[peer.local as usize] += 1;
            pushed = true;
            at.sent += n;
            at.started = true;
        };
        if pushed {
            t.notify(peer);
        }
        r
    }

    /// Put a small user message (or, with `rndv`, a rendezvous
    /// announcement) in the peer's fast box. `None`: the box may not be
    /// used now (the pair's user ring still holds messages, which must
    /// arrive first); `Some(false)`: the box is full.
    fn via_fbox(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        rndv: bool,
        tag: u64,
        data: &[u8],
    ) -> Result<Option<bool>> {
        let l = peer.local as usize;
        let ring = peer.seg.inbound(t.seg.local_rank, USER);
        match ring.drained(&mut self.prod[l * CHANNELS + USER]) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(_) => return Err(self.corrupt(peer, "its inbound ring is corrupt")),
        }
        // A load and a plain store, no locked instruction (this is the
        // hot path of small sends; the flag is only a hint).
        let reply = peer.heard.load(std::sync::atomic::Ordering::Relaxed);
        if reply {
            peer.heard
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        let b = peer.seg.fbox(t.seg.local_rank);
        let pushed = if rndv {
            b.push_rendezvous(&mut self.fb[l], tag, data)
        } else {
            b.push(&mut self.fb[l], tag, data, !reply)
        };
        match pushed {
            Ok(true) => {
                t.notify(peer);
                Ok(Some(true))
            }
            Ok(false) => Ok(Some(false)),
            Err(_) => Err(self.corrupt(peer, "its fast box is corrupt")),
        }
    }

    /// Whether the peer took every message we put in its fast box.
    fn fbox_drained(&mut self, t: &SmTransport, peer: &SmPeer) -> Result<bool> {
        let st = &mut self.fb[peer.local as usize];
        peer.seg
            .fbox(t.seg.local_rank)
            .drained(st)
            .map_err(|_| self.corrupt(peer, "its fast box is corrupt"))
    }

    /// Note a peer that scribbled on shared state (cut off once `tx` is
    /// released) and make the error for the operation that found out.
    fn corrupt(&mut self, peer: &SmPeer, what: &str) -> Error {
        self.misbehaved.push((peer.local, what.into()));
        Error::PeerMisbehaved {
            rank: peer.rank,
            what: what.into(),
        }
    }

    /// Send a borrowed message if one fragment that holds all of it is free
    /// now and nothing is queued ahead of it (the inline path). Never sends
    /// part of a message.
    fn try_send(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: &[u8],
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
        if data.len() > self.max_payload() || !self.queues[q].is_empty() {
            return Ok(false);
        }
        if channel(kind) == USER && data.len() <= fbox::MAX_PAYLOAD {
            if let Some(sent) = self.via_fbox(t, peer, false, tag, data)? {
                return Ok(sent);
            }
        }
        let need_max = data.len() > self.eager_payload();
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
            if !fits(self) {
                return Ok(false);
            }
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
        if kind == Kind::User && data.len() >= t.config.cma_min && peer.cma_ok() {
            return self.announce(t, peer, tag, data).map(Some);
        }
        self.send_owned(t, peer, kind, tag, data, None)
    }

    /// Queue (or push at once) an owned message; `done` completes when its
    /// last byte is handed over (a new one is made if needed and none given).
    fn send_owned(
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
    fn push_now(
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
    fn enqueue(
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

    /// Rendezvous: announce a large message in order with the other user
    /// messages; the receiver copies it straight out of `data` (one copy
    /// instead of two through fragments) and answers. Completes on the answer.
    fn announce(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        tag: u64,
        data: Bytes,
    ) -> Result<Arc<Completion>> {
        let handle = self.next_handle;
        self.next_handle += 1;
        let rts = Rts {
            handle,
            addr: data.as_ptr() as u64,
            len: data.len() as u64,
        }
        .encode();
        let done = Completion::new();
        self.rndv.insert(
            handle,
            Rndv {
                peer: peer.local,
                data,
                done: done.clone(),
            },
        );
        self.rndv_order[peer.local as usize].push_back(handle);
        // Pushed from the stack when it goes at once; an owned copy only
        // when it must queue.
        match self.push_now(t, peer, Kind::UserCma, tag, &rts) {
            Ok(None) => {}
            Ok(Some(at)) => {
                let rts = Bytes::copy_from_slice(&rts);
                self.enqueue(peer, Kind::UserCma, tag, rts, at, None);
            }
            Err(e) => {
                self.rndv.remove(&handle);
                self.rndv_order[peer.local as usize].pop_back();
                return Err(e);
            }
        }
        Counters::bump(&t.counters.rendezvous_sends);
        Ok(done)
    }

    /// The data of our rendezvous `handle` to local peer `local`, if it is
    /// still out (for a split-copy request).
    pub(crate) fn rendezvous_data(&self, local: u32, handle: u64) -> Option<Bytes> {
        self.rndv
            .get(&handle)
            .filter(|r| r.peer == local)
            .map(|r| r.data.clone())
    }

    /// Whether our rendezvous `handle` to local peer `local` is over: its
    /// done word passed it. (A split-copy request can arrive after that:
    /// the receiver took the tail back and finished without us. Handles
    /// are numbered across peers and this does not check that `handle` was
    /// announced to `local`; a request it admits is dropped, writing
    /// nothing.)
    pub(crate) fn rendezvous_settled(&self, local: u32, handle: u64) -> bool {
        self.rndv_settled
            .get(local as usize)
            .is_some_and(|&w| handle <= w)
    }

    /// The receiver's answer to a rendezvous: done, or refused (then the data
    /// goes as a control message, and single copy is off for this peer).
    pub(crate) fn rendezvous_done(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        handle: u64,
        copied: bool,
    ) {
        let ours = self.rndv.get(&handle).is_some_and(|r| r.peer == peer.local);
        if !ours {
            Counters::bump(&t.core.counters().bad_frames);
            self.misbehaved.push((
                peer.local,
                "it answered a rendezvous we never announced".into(),
            ));
            return;
        }
        let Some(r) = self.rndv.remove(&handle) else {
            return;
        };
        // Only handles still out stay in the order (so the done word is
        // looked at exactly while one is).
        self.rndv_order[peer.local as usize].retain(|&h| h != handle);
        if copied {
            r.done.complete(Ok(()));
            return;
        }
        tracing::info!(
            peer = peer.rank,
            "the peer could not copy from our memory: sending its data through fragments"
        );
        peer.cma.store(false, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) =
            self.send_owned(t, peer, Kind::CmaData, handle, r.data, Some(r.done.clone()))
        {
            r.done.complete(Err(e));
        }
    }

    /// Complete the rendezvous messages each peer's done word says it
    /// copied. Returns how many.
    fn reap_rendezvous(&mut self, t: &SmTransport) -> usize {
        let mut n = 0;
        for p in t.peer_list().iter().flatten() {
            let l = p.local as usize;
            let Some(&first) = self.rndv_order[l].front() else {
                continue;
            };
            // Acquire pairs with the receiver's Release store after its
            // copy: it is done reading our buffer before we drop it.
            let w = p
                .seg
                .fbox(t.seg.local_rank)
                .rndv_done_word()
                .load(std::sync::atomic::Ordering::Acquire);
            if w < first {
                continue;
            }
            if w >= self.next_handle {
                Counters::bump(&t.core.counters().bad_frames);
                self.misbehaved.push((
                    p.local,
                    "it answered a rendezvous we never announced".into(),
                ));
                continue;
            }
            self.rndv_settled[l] = self.rndv_settled[l].max(w);
            while let Some(&h) = self.rndv_order[l].front() {
                if h > w {
                    break;
                }
                self.rndv_order[l].pop_front();
                // (The order holds only this peer's handles still in `rndv`.)
                if let Some(r) = self.rndv.remove(&h) {
                    r.done.complete(Ok(()));
                    n += 1;
                }
            }
        }
        n
    }

    /// Advance queued messages as fragments come back.
    ///
    /// Returned fragments are polled for only while a quarter or more of a
    /// class is out (and taken back by a push that finds its class empty):
    /// a sender polling its return rings after every message keeps their
    /// lines moving between the cores, and the receiver's next return (on
    /// its critical path, before its doorbell fence) waits for the line to
    /// come back. A ping-pong so reads them once per quarter of a pool.
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

/// An endpoint's connection to one same-node peer.
pub(crate) struct SmLink {
    pub(crate) t: Arc<SmTransport>,
    pub(crate) peer: Arc<SmPeer>,
}

impl Link for SmLink {
    fn peer(&self) -> Rank {
        self.peer.rank
    }

    fn transport(&self) -> &'static str {
        "sm"
    }

    // A peer caught misbehaving here stays in `misbehaved` until the next
    // progress call cuts it off: these entry points may run inside the
    // receive path (answers to RMA requests), where `rx` is held.
    fn try_send(&self, kind: CoreKind, tag: u64, data: &[u8]) -> Result<bool> {
        self.t
            .with_tx(|tx| tx.try_send(&self.t, &self.peer, kind.into(), tag, data))
    }

    fn submit(&self, kind: CoreKind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>> {
        self.t
            .with_tx(|tx| tx.submit(&self.t, &self.peer, kind.into(), tag, data))
    }

    fn post(&self, op: crate::transport::OneSided<'_>) -> Result<crate::transport::Native> {
        use crate::transport::{Native, OneSided};
        let key = op.key();
        if !key.is_shared() {
            return self.post_registered(op);
        }
        if self.peer.is_lost() {
            return Err(self.peer.lost_error());
        }
        // The mapping the key keeps (made on its first use), checked live:
        // bounds below are the real file's, not the key's claim.
        let m = key.mapping(self.t.core.job_tag(), || self.t.map_cached(key))?;
        let remote = m.data();
        Ok(match op {
            OneSided::Put { src, offset, .. } => {
                remote.copy_from(offset, &src.raw, 0, src.raw.len())?;
                Native::Done(0)
            }
            OneSided::Get { dst, offset, .. } => {
                dst.raw.copy_from(0, &remote, offset, dst.raw.len())?;
                Native::Done(0)
            }
            OneSided::Atomic { offset, op, .. } => Native::Done(remote.atomic(offset, op)?),
        })
    }

    fn has_queued(&self) -> bool {
        lock(&self.t.tx).has_queued(self.peer.local)
    }
}

impl SmLink {
    /// [`Link::post`] into a registered buffer (a region no peer maps):
    /// single copy from `cma_min` bytes where the kernel lets the target
    /// copy our memory, else the core's emulation over messages. Kept out
    /// of `post`, whose mapped path is the hot one.
    #[inline(never)]
    fn post_registered(
        &self,
        op: crate::transport::OneSided<'_>,
    ) -> Result<crate::transport::Native> {
        use crate::transport::{Native, OneSided};
        let (put, local, key, offset) = match op {
            OneSided::Put { src, key, offset } => (true, src, key, offset),
            OneSided::Get { dst, key, offset } => (false, dst, key, offset),
            OneSided::Atomic { .. } => return Ok(Native::Emulate),
        };
        if local.raw.len() < self.t.config.cma_min || !self.peer.cma_ok() {
            return Ok(Native::Emulate);
        }
        if self.peer.is_lost() {
            return Err(self.peer.lost_error());
        }
        let done = self
            .t
            .cma
            .start(&self.t, &self.peer, put, local, &key.id, offset)?;
        Ok(Native::Posted(done))
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;
    use crate::sm::segment::Params;

    #[test]
    fn user_messages_take_the_fragment_free_longest_control_the_last_returned() {
        let layout = Layout::new(Params {
            local_size: 2,
            eager_size: 4096,
            eager_count: 8,
            max_size: 32768,
            max_count: 2,
        })
        .expect("layout");
        let mut tx = TxState::new(&layout, 2);
        assert_eq!(tx.take(1, true, USER, true), Some(0));
        assert_eq!(tx.take(1, true, USER, true), Some(1));
        tx.free(1);
        tx.free(0);
        // 2..8 were free longest; 1 and 0 came back last, 0 the latest.
        assert_eq!(tx.take(1, true, USER, true), Some(2));
        assert_eq!(tx.take(1, true, 1, true), Some(0));
        assert_eq!(tx.take(1, true, 1, true), Some(1));
        // Max fragments in the order freed, too.
        assert_eq!(tx.take(1, false, USER, true), Some(8));
        tx.free(8);
        assert_eq!(tx.take(1, false, USER, true), Some(9));
        assert_eq!(tx.take(1, false, USER, true), Some(8));
    }

    #[test]
    fn free_list_hands_out_the_fragment_given_back_longest_ago() {
        let mut f = FreeList::new(0..4);
        assert_eq!(f.len(), 4);
        assert_eq!(f.pop_front(), Some(0));
        assert_eq!(f.pop_front(), Some(1));
        f.push_back(1);
        f.push_back(0);
        // 2 and 3 were free longest, then 1 and 0 in the order given back,
        // across the wrap of the slots.
        let order: Vec<u32> = std::iter::from_fn(|| f.pop_front()).collect();
        assert_eq!(order, [2, 3, 1, 0]);
        assert!(f.is_empty() && f.pop_front().is_none());
        for i in [3, 2, 1, 0] {
            f.push_back(i);
        }
        // A full list ignores a fifth give-back rather than overwrite.
        f.push_back(9);
        // The last given back, from the other end.
        assert_eq!(f.pop_back(), Some(0));
        let order: Vec<u32> = std::iter::from_fn(|| f.pop_front()).collect();
        assert_eq!(order, [3, 2, 1]);
    }
}

//! Receive side of the `udp` driver: batch-receive from both sockets, drop
//! what is not from a known peer of this job, feed the protocol, decode
//! frames and hand messages to the core.
//!
//! Receive-side backpressure. The protocol acknowledges what it receives,
//! so it cannot slow a sender by itself. When a user message finds its
//! tag's queue full (`Dispatcher::has_room`), it and everything after it
//! from the same peer is *held* here (order is per peer), and from then on
//! that peer's DATA datagrams are *not fed* to the protocol: they are kept
//! raw in a small stash (at most a receive window's bytes of them; further
//! ones are dropped and will be retransmitted). Unacknowledged, the
//! sender's window closes and its futures wait. ACKs still go in at once
//! (ACK-only datagrams, and the ACK a stashed DATA datagram carries), so
//! our own sends to that peer keep flowing and complete (no deadlock when
//! both sides send). When
//! the application makes room, held messages go out first, then the stash
//! is fed in arrival order, so nothing is lost and there is no burst of
//! retransmissions. Memory: one window of datagrams plus what one datagram
//! can complete.
//!
//! Stalling the sender this way would make its protocol declare us lost
//! after its peer timeout, which is why liveness is driven by keepalives
//! (see [`super`]) and the protocol's own timer is only a long stall guard.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;

use super::frame::{Decoder, Frames};
use super::io::{self, RecvBatch};
use super::proto::{self, Event};
use super::UdpTransport;
use crate::core::stats::Counters;
use crate::sys::sync::lock;
use crate::transport::Kind;
use crate::Rank;

/// Receive-side state of one peer.
/// What a held message counts against [`HOLD_LIMIT`]: its bytes and a
/// fixed charge, so that a bundle of empty messages is not free.
fn held_cost(len: usize) -> usize {
    len + 64
}

#[derive(Default)]
pub(crate) struct PeerRx {
    dec: Decoder,
    /// User messages waiting for room in their tag (only user messages:
    /// control messages are never held, so a full tag never blocks an RMA
    /// answer, a barrier or a goodbye).
    held: VecDeque<(Kind, u64, Bytes)>,
    held_bytes: usize,
    stash: VecDeque<Vec<u8>>,
    /// Bytes charged for `stash` (see [`STASH_OVERHEAD`]).
    stash_bytes: usize,
}

/// Bytes charged per stashed datagram besides its length (its `Vec` and
/// the allocator's share), so a flood of tiny datagrams is bounded too.
pub(crate) const STASH_OVERHEAD: usize = 64;

/// Held user bytes per peer beyond which that peer's data datagrams are
/// stashed unprocessed (so the sender's window closes). Below it, datagrams
/// are still processed: ACKs and control messages keep flowing.
const HOLD_LIMIT: usize = 4 << 20;

impl PeerRx {
    fn paused(&self) -> bool {
        self.held_bytes > HOLD_LIMIT || !self.stash.is_empty()
    }

    fn has_held(&self) -> bool {
        !self.held.is_empty() || !self.stash.is_empty()
    }

    fn clear(&mut self) {
        self.dec.reset();
        self.held.clear();
        self.held_bytes = 0;
        self.stash.clear();
        self.stash_bytes = 0;
    }

    /// Keep a held-back datagram if the stash stays within `limit` bytes;
    /// otherwise drop it (the peer resends it). Returns whether it was kept.
    fn stash_push(&mut self, d: &[u8], limit: usize) -> bool {
        let cost = d.len() + STASH_OVERHEAD;
        if self.stash_bytes + cost > limit {
            return false;
        }
        self.stash_bytes += cost;
        self.stash.push_back(d.to_vec());
        true
    }

    fn stash_pop(&mut self) -> Option<Vec<u8>> {
        let d = self.stash.pop_front()?;
        self.stash_bytes -= d.len() + STASH_OVERHEAD;
        Some(d)
    }
}

/// State of the receive path (behind the transport's `rx` mutex: one
/// thread receives at a time, so messages reach the core in order).
pub(crate) struct RxState {
    batch: RecvBatch,
    /// For the priority socket, read after each data batch (see
    /// `rx_progress`).
    prio_batch: RecvBatch,
    peers: Vec<PeerRx>,
    events: Vec<Event>,
    /// The socket that delivered last (0: priority, 1: data): asked every
    /// call, the other one too if it delivered within [`ACTIVE_TURNS`]
    /// calls, else when tokio saw it readable or every [`OTHER_EVERY`]
    /// calls.
    hot: usize,
    /// Calls so far (wrapping), for [`OTHER_EVERY`].
    turn: u32,
    /// `turn` of the last call in which each socket delivered.
    last_got: [u32; 2],
    /// Per socket, how it answered the last time it was asked directly:
    /// [`EMPTY`] or [`LONE`] (a single datagram) mean it is asked with
    /// `recvfrom` (one datagram, cheaper than a batch), [`FLOWING`] (data
    /// two calls in a row) with `recvmmsg`. A ping-pong thus never pays for
    /// a batch call; a stream switches to batches on its second datagram.
    mode: [u8; 2],
    /// Whether a datagram fed in this call left a peer with something to
    /// do now (see [`UdpTransport::progress`]).
    pub(crate) urgent: bool,
    /// Messages handed to the core in this call.
    pub(crate) delivered: usize,
    /// The source address of the last datagram and its rank: a run of
    /// datagrams from one peer skips the address table's hashing.
    last_from: Option<(std::net::SocketAddr, Rank)>,
    /// The peer whose datagram came last on the data socket: while it is
    /// in the middle of a large message, the data socket's batches are
    /// received straight into that message's buffer
    /// ([`io::recv_in_place`]).
    stream: Option<Rank>,
}

/// [`RxState::mode`]: the socket had nothing.
const EMPTY: u8 = 0;
/// [`RxState::mode`]: the socket had one datagram, asked with `recvfrom`.
const LONE: u8 = 1;
/// [`RxState::mode`]: the socket had data in two calls in a row.
const FLOWING: u8 = 2;

impl RxState {
    /// Whether this call should also check the timers (one in
    /// [`TIMER_EVERY`] calls): a hot poll that received nothing saves the
    /// clock read.
    pub(crate) fn timer_turn(&self) -> bool {
        self.turn % TIMER_EVERY == 0
    }
}

/// The current time, read once, when first needed.
struct Clock(Option<Instant>);

impl Clock {
    fn get(&mut self) -> Instant {
        *self.0.get_or_insert_with(Instant::now)
    }
}

impl RxState {
    /// State for a job of `size` ranks whose datagrams end in trailers of
    /// `trailer` bytes.
    pub(crate) fn new(size: usize, trailer: usize) -> RxState {
        RxState {
            batch: RecvBatch::new(trailer),
            prio_batch: RecvBatch::new(trailer),
            peers: (0..size).map(|_| PeerRx::default()).collect(),
            events: Vec::new(),
            hot: 0,
            turn: 0,
            last_got: [0; 2],
            mode: [EMPTY; 2],
            urgent: false,
            delivered: 0,
            last_from: None,
            stream: None,
        }
    }
}

/// Rounds of `recvmmsg` per socket per progress call, so one socket cannot
/// starve the rest of the driver.
const ROUNDS: usize = 4;

/// Most `recvmmsg` batches per socket one [`UdpTransport::drain`] reads.
const DRAIN_BATCHES: usize = 4096;

/// Every this many progress calls, the socket that is not hot is also asked
/// directly (a system call), whatever tokio's readiness says.
const OTHER_EVERY: u32 = 8;

/// A socket that delivered within this many progress calls is asked
/// directly every call: while data streams, heads and ACKs arrive on the
/// priority socket and bodies on the data socket, and both must be read
/// at once.
const ACTIVE_TURNS: u32 = 64;

/// Room reserved ahead of a lent reassembly buffer, in the message's own
/// chunks: one receive batch (bounded by the message's stated length).
const LEND_AHEAD: usize = io::BATCH;

/// With GRO on, a peer's datagrams are received in place only from this
/// size (loopback's 64 KiB datagrams: nothing for GRO to join there).
const LEND_MIN_DATAGRAM: usize = 16 * 1024;

/// A progress call that received nothing checks the timers once in this
/// many calls (deadlines are tens of microseconds or more apart).
const TIMER_EVERY: u32 = 4;

impl UdpTransport {
    /// Receive and dispatch. Returns datagrams and messages handled; sets
    /// `rx.urgent` and `rx.delivered` for this call.
    pub(crate) fn rx_progress(&self, rx: &mut RxState) -> usize {
        let RxState {
            batch,
            prio_batch,
            peers,
            events,
            hot,
            turn,
            last_got,
            mode,
            urgent,
            delivered,
            last_from,
            stream,
        } = rx;
        *urgent = false;
        *delivered = 0;
        let mut cx = Feed {
            peers,
            events,
            urgent,
            delivered,
            last_from,
        };
        let mut now = Clock(None);
        let mut work = 0;
        for rank in 0..cx.peers.len() {
            let prx = &mut cx.peers[rank];
            if self.peer(rank as Rank).is_some_and(|p| p.is_lost()) {
                // Nothing from a lost peer is delivered after its loss was
                // announced; drop what was held for it.
                prx.clear();
            } else if prx.has_held() {
                work += self.release(&mut cx, rank as Rank, now.get());
            }
            let prx = &mut cx.peers[rank];
            if let Some(p) = self.peer(rank as Rank) {
                // Stored only when it changes: a hot poll does not dirty
                // the cache line that senders read.
                let held = prx.has_held();
                if p.busy.load(std::sync::atomic::Ordering::Relaxed) != held {
                    p.busy.store(held, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        // Polling while hot costs one system call per call: the socket that
        // delivered last is asked directly, so a datagram is found as soon
        // as it lands; the other one too while it is active, else only when
        // tokio's reactor saw it readable (free to check), or every
        // OTHER_EVERY calls.
        *turn = turn.wrapping_add(1);
        let mut got = [0usize; 2];
        for (i, sock) in [&self.io.prio, &self.io.data].into_iter().enumerate() {
            let direct = i == *hot
                || turn.wrapping_sub(last_got[i]) < ACTIVE_TURNS
                || *turn % OTHER_EVERY == 0;
            let one = direct && mode[i] != FLOWING;
            for _ in 0..ROUNDS {
                // A large message streaming in on the data socket: lend its
                // buffer, so the kernel writes the payloads in place.
                let (mut lent, single) = match *stream {
                    Some(r) if i == 1 && direct => self.lend(&mut cx, r),
                    _ => (None, false),
                };
                let gro = i == 1 && self.io.off.gro();
                let one = one || single;
                let r = if let Some((peer, lent)) = &mut lent {
                    let (chunk, remaining) = (lent.chunk(), lent.remaining());
                    let most = if one { 1 } else { io::BATCH };
                    io::recv_in_place(
                        sock,
                        batch,
                        &mut lent.buf,
                        chunk,
                        remaining.min(most * chunk),
                        peer.data_addr,
                    )
                } else if one {
                    io::recv_one_now(sock, batch, gro)
                } else if direct {
                    io::recv_now(sock, batch)
                } else {
                    io::recv(sock, batch)
                };
                if let Some((peer, lent)) = lent {
                    // Always given back, whatever the call found: what
                    // landed is checked there, in arrival order, before
                    // anything read after it.
                    let landed: Vec<proto::Landed<'_>> = batch.landed().collect();
                    {
                        let mut st = lock(&peer.st);
                        st.give_back(now.get(), lent, &landed, cx.events);
                        *cx.urgent |= st.wants_service(now.get());
                    }
                    self.on_events(&mut cx, peer.rank);
                }
                let n = r.unwrap_or_else(|e| {
                    tracing::debug!("udp: receive failed: {e}");
                    0
                });
                if batch.coalesced > 0 {
                    self.io
                        .off
                        .gro_receives
                        .fetch_add(batch.coalesced as u64, std::sync::atomic::Ordering::Relaxed);
                }
                got[i] += n;
                if direct {
                    mode[i] = match (n, mode[i]) {
                        (0, _) => EMPTY,
                        (_, EMPTY) => LONE,
                        _ => FLOWING,
                    };
                }
                if i == 1 && n > 0 {
                    // What the peer sent on the priority socket before this
                    // data (a large message's head goes there, its body
                    // here) is in that socket by now: feed it first, or the
                    // body looks out of order (each chunk copied aside and
                    // answered with a duplicate ACK).
                    let m = io::recv_now(&self.io.prio, prio_batch).unwrap_or(0);
                    got[0] += m;
                    for (from, d) in prio_batch.iter() {
                        self.on_datagram(&mut cx, from, d, now.get());
                    }
                }
                for (from, d) in batch.iter() {
                    self.on_datagram(&mut cx, from, d, now.get());
                }
                // After a lone datagram, the next call asks again; unless
                // it was read alone to start a large message, whose rest
                // the next round receives in place.
                if (one && !(single && n > 0)) || (!one && n < io::BATCH) {
                    break;
                }
            }
        }
        for (i, n) in got.iter().enumerate() {
            if *n > 0 {
                last_got[i] = *turn;
            }
        }
        if got[1] > 0 {
            *stream = cx.last_from.map(|(_, r)| r);
        }
        if got[*hot] == 0 && got[1 - *hot] > 0 {
            *hot = 1 - *hot;
        }
        work + got[0] + got[1]
    }

    /// Read everything already queued in both sockets, whatever tokio's
    /// readiness says (at most [`DRAIN_BATCHES`] batches per socket, so
    /// peers that keep sending cannot hold us here). Used before a peer is
    /// declared lost: after a stall of our own (the process was stopped),
    /// its keepalives may sit in our sockets behind other traffic. Returns
    /// datagrams read. Takes the `rx` lock: never call with it held.
    pub(crate) fn drain(&self, now: Instant) -> usize {
        let mut rx = lock(&self.rx);
        let RxState {
            batch,
            peers,
            events,
            urgent,
            delivered,
            last_from,
            ..
        } = &mut *rx;
        let mut cx = Feed {
            peers,
            events,
            urgent,
            delivered,
            last_from,
        };
        let mut read = 0;
        for sock in [&self.io.prio, &self.io.data] {
            for _ in 0..DRAIN_BATCHES {
                let n = io::recv_now(sock, batch).unwrap_or_else(|e| {
                    tracing::debug!("udp: receive failed: {e}");
                    0
                });
                read += n;
                self.io
                    .off
                    .gro_receives
                    .fetch_add(batch.coalesced as u64, std::sync::atomic::Ordering::Relaxed);
                for (from, d) in batch.iter() {
                    self.on_datagram(&mut cx, from, d, now);
                }
                if n < io::BATCH {
                    break;
                }
            }
        }
        read
    }

    fn on_datagram(
        &self,
        cx: &mut Feed<'_>,
        from: Option<std::net::SocketAddr>,
        d: &[u8],
        now: Instant,
    ) {
        let rank = match (from, *cx.last_from) {
            (Some(a), Some((last, r))) if a == last => Some(r),
            (Some(a), _) => {
                let r = self.by_addr.get().and_then(|m| m.get(&a).copied());
                if let Some(r) = r {
                    *cx.last_from = Some((a, r));
                }
                r
            }
            (None, _) => None,
        };
        let ids = proto::peek(d).ok();
        let (Some(rank), Some(ids)) = (rank, ids) else {
            return self.foreign();
        };
        if ids.job != self.job || ids.src != rank || ids.dst != self.core.rank() {
            return self.foreign();
        }
        let (Some(peer), Some(prx)) = (self.peer(rank), cx.peers.get_mut(rank as usize)) else {
            return self.foreign();
        };
        if peer.is_lost() {
            prx.clear();
            return;
        }
        if prx.paused() {
            let mut st = lock(&peer.st);
            match st.conn.decode(d) {
                Ok((h, _)) if h.job == self.job && h.src == rank && h.dst == self.core.rank() => {
                    if let proto::Kind::Data(_) = h.kind {
                        // Hold the data back, but act on the ACK it carries
                        // now: our own sends to this peer must not wait for
                        // our receiver to make room.
                        st.last_heard = now;
                        st.conn.handle_ack(now, &h);
                        cx.events
                            .extend(std::iter::from_fn(|| st.conn.poll_event()));
                        drop(st);
                        *cx.urgent = true;
                        self.on_events(cx, rank);
                        if let Some(prx) = cx.peers.get_mut(rank as usize) {
                            prx.stash_push(d, peer.stash_limit);
                        }
                        return;
                    }
                }
                // Corrupt or forged: let the connection count it.
                _ => {}
            }
        }
        {
            let mut st = lock(&peer.st);
            st.feed(now, d, cx.events);
            *cx.urgent |= st.wants_service(now);
        }
        self.on_events(cx, rank);
    }

    /// Lend the reassembly buffer of peer `rank`'s half-received message
    /// for an in-place receive, when it has one and its data is not being
    /// held back (a paused peer's datagrams are stashed whole). Else says
    /// whether to read one datagram alone: the peer is between two large
    /// messages, and the next datagram probably starts one.
    fn lend(
        &self,
        cx: &mut Feed<'_>,
        rank: Rank,
    ) -> (
        Option<(std::sync::Arc<super::peer::Peer>, proto::Lent)>,
        bool,
    ) {
        let Some(peer) = self.peer(rank) else {
            return (None, false);
        };
        if peer.is_lost() || cx.peers.get(rank as usize).map_or(true, |p| p.paused()) {
            return (None, false);
        }
        if self.io.off.gro() && peer.max_datagram < LEND_MIN_DATAGRAM {
            // Datagrams this small arrive joined by GRO, and a joined
            // receive never lands in place (it is cut apart and copied).
            return (None, false);
        }
        let mut st = lock(&peer.st);
        match st.conn.lend_reassembly(LEND_AHEAD) {
            Some(lent) => (Some((peer.clone(), lent)), false),
            None => (None, st.conn.between_large_messages()),
        }
    }

    fn foreign(&self) {
        Counters::bump(&self.foreign);
    }

    fn on_events(&self, cx: &mut Feed<'_>, rank: Rank) {
        let Some(prx) = cx.peers.get_mut(rank as usize) else {
            cx.events.clear();
            return;
        };
        for ev in cx.events.drain(..) {
            match ev {
                Event::Message(m) => match prx.dec.push(m) {
                    Ok(Frames::One(kind, tag, data)) => {
                        self.take_message(prx, cx.delivered, rank, (kind, tag, data));
                    }
                    Ok(Frames::Many(msgs)) => {
                        // A bundle of put/get requests or answers: one link
                        // lookup (a lock and a reference count) for all.
                        let mut link = None;
                        for m in msgs {
                            if m.0 == Kind::User {
                                self.take_message(prx, cx.delivered, rank, m);
                            } else if let Some(l) = link.get_or_insert_with(|| self.core.link(rank))
                            {
                                self.core.on_message(&**l, rank, m.0, m.1, m.2);
                                *cx.delivered += 1;
                            }
                        }
                    }
                    Ok(Frames::Head) => {}
                    Err(e) => {
                        Counters::bump(&self.core.counters().bad_frames);
                        tracing::warn!(peer = rank, "udp: dropped a malformed frame: {e:?}");
                    }
                },
                Event::Acked(_) => {}
                Event::PeerLost => self.lose(rank, &self.stall_reason()),
            }
        }
    }

    /// Deliver a decoded message now, or hold it (with everything after
    /// it from this peer) while its tag has no room.
    fn take_message(
        &self,
        prx: &mut PeerRx,
        delivered: &mut usize,
        rank: Rank,
        (kind, tag, data): (Kind, u64, Bytes),
    ) {
        if kind != Kind::User || (prx.held.is_empty() && self.core.has_room(tag, data.len())) {
            self.dispatch(rank, kind, tag, data);
            *delivered += 1;
        } else {
            prx.held_bytes += held_cost(data.len());
            prx.held.push_back((kind, tag, data));
        }
    }

    fn dispatch(&self, rank: Rank, kind: Kind, tag: u64, data: Bytes) {
        if kind == Kind::User {
            // A user message needs no link (saves the link table's lock).
            self.core.deliver(rank, tag, data);
        } else if let Some(link) = self.core.link(rank) {
            self.core.on_message(&*link, rank, kind, tag, data);
        }
    }

    /// Deliver held messages of peer `rank` that now fit, then feed its
    /// stash.
    fn release(&self, cx: &mut Feed<'_>, rank: Rank, now: Instant) -> usize {
        let mut work = 0;
        let Some(prx) = cx.peers.get_mut(rank as usize) else {
            return work;
        };
        while let Some((kind, tag, data)) = prx.held.front() {
            if *kind == Kind::User && !self.core.has_room(*tag, data.len()) {
                break;
            }
            if let Some((kind, tag, data)) = prx.held.pop_front() {
                prx.held_bytes -= held_cost(data.len());
                self.dispatch(rank, kind, tag, data);
                *cx.delivered += 1;
                work += 1;
            }
        }
        let Some(peer) = self.peer(rank) else {
            return work;
        };
        while let Some(prx) = cx.peers.get_mut(rank as usize) {
            if prx.held_bytes > HOLD_LIMIT {
                break;
            }
            let Some(d) = prx.stash_pop() else {
                break;
            };
            lock(&peer.st).feed(now, &d, cx.events);
            // Stashed data was never answered: let the service pass look.
            *cx.urgent = true;
            self.on_events(cx, rank);
            work += 1;
        }
        work
    }
}

/// What feeding datagrams needs of [`RxState`], borrowed apart from the
/// receive buffers the datagrams are read from.
struct Feed<'a> {
    peers: &'a mut [PeerRx],
    events: &'a mut Vec<Event>,
    urgent: &'a mut bool,
    delivered: &'a mut usize,
    last_from: &'a mut Option<(std::net::SocketAddr, Rank)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stash_is_bounded_by_bytes() {
        let limit = 4 * (1000 + STASH_OVERHEAD);
        let mut p = PeerRx::default();
        // Large datagrams: as many as fit in the byte limit.
        let big = vec![7u8; 1000];
        assert!((0..4).all(|_| p.stash_push(&big, limit)));
        assert!(!p.stash_push(&big, limit));
        // Tiny ones are charged their overhead too: bounded as well.
        let mut q = PeerRx::default();
        let kept = (0..10_000)
            .filter(|_| q.stash_push(&[1u8; 8], limit))
            .count();
        assert_eq!(kept, limit / (8 + STASH_OVERHEAD));
        // Popping gives the bytes back, in arrival order.
        assert_eq!(p.stash_pop().as_deref(), Some(&big[..]));
        assert!(p.stash_push(&[2u8; 10], limit));
        while p.stash_pop().is_some() {}
        assert_eq!(p.stash_bytes, 0);
        p.clear();
        assert_eq!((p.stash.len(), p.stash_bytes), (0, 0));
    }
}

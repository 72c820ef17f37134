//! Eager fragments over the rings, both halves.
//!
//! Send: the fragment pool (a [`FreeList`] per class, a per-destination
//! cap, eager fragments kept for control messages), taking back the
//! fragments peers return, and the push of a message's fragments onto the
//! peer's inbound ring (a small user message or a rendezvous announcement
//! tries the fast box first). Receive: the ring's `step` — validate every
//! offset and header, reassemble, hand complete messages to the core or to
//! the control-message handlers (a whole user message in one fragment is
//! copied once, into a receiver's lent buffer where one waits) — the
//! direct take of such a message into a lent buffer (`ring_direct`), and
//! the return of each fragment to its sender. The fragment header is
//! [`frag`](super::frag).

use bytes::Bytes;

use super::fbox;
use super::frag::{FragHeader, FIRST, FRAG_BODY, FRAG_HEADER, LAST};
use super::kind::Kind;
use super::rx::{RxState, Step};
use super::segment::CHANNELS;
use super::tx::{channel, Cursor, Pushed, TxState, USER};
use super::{SmPeer, SmTransport};
use crate::core::stats::Counters;
use crate::sys::mem::RawBuf;
use crate::transport::Kind as CoreKind;
use crate::{Error, Result};

/// Bytes of a fragment whose lines a push asks for before it writes them
/// (`prefetchw`); beyond that, the copy streams on its own.
const PREFETCH_WRITE: usize = 8 * 1024;

pub(super) const FREE: u32 = u32::MAX;

/// A queue of free fragment indices with room for every fragment of its
/// class: given back at the tail, taken from either end. (Not a
/// `VecDeque`: with one, whose growth path sits in every push, 8-byte
/// streaming, which never touches these lists, runs at 0.91-0.92x the
/// rate of this one.)
pub(super) struct FreeList {
    slots: Box<[u32]>,
    head: usize,
    len: usize,
}

impl FreeList {
    pub(super) fn new(all: std::ops::Range<u32>) -> FreeList {
        let slots: Box<[u32]> = all.collect();
        let len = slots.len();
        FreeList {
            slots,
            head: 0,
            len,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
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

impl TxState {
    pub(super) fn eager_payload(&self) -> usize {
        self.layout.p.eager_size as usize - FRAG_BODY
    }

    pub(super) fn max_payload(&self) -> usize {
        self.layout.p.max_size as usize - FRAG_BODY
    }

    /// Take back fragments peers returned. Returns how many.
    pub(super) fn reclaim(&mut self, t: &SmTransport) -> usize {
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
    pub(super) fn reclaim_from(&mut self, t: &SmTransport, p: &SmPeer) -> usize {
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

    /// A quarter or more of a fragment class is out.
    pub(super) fn pool_low(&self) -> bool {
        4 * self.free_eager.len() <= 3 * self.layout.p.eager_count as usize
            || 4 * self.free_max.len() <= 3 * self.layout.p.max_count as usize
    }

    pub(super) fn free(&mut self, i: usize) {
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
        let max = |s: &mut Self| match s.warm_max {
            false => s.free_max.pop_front(),
            true => s.free_max.pop_back(),
        };
        let i = match (want_eager, exact) {
            (true, true) => eager(self),
            (true, false) => eager(self).or_else(|| max(self)),
            (false, _) => max(self).or_else(|| eager(self)),
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
    pub(super) fn push(
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
            // Small user messages and rendezvous announcements take the
            // box (a lent message's announcement takes the ring, behind it).
            if !at.started
                && total <= fbox::MAX_PAYLOAD
                && matches!(kind, Kind::User | Kind::UserCma)
            {
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
            let n = rem.min(size - FRAG_BODY);
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
            let end = off + (FRAG_BODY + n).min(PREFETCH_WRITE) as u64;
            let mut line = off & !63;
            while line < end {
                raw.prefetch_write(line);
                line += 64;
            }
            let timing = self.copy_time.is_some().then(std::time::Instant::now);
            raw.write(off, &h.encode())
                .and_then(|_| raw.write(off + FRAG_BODY as u64, &data[at.sent..at.sent + n]))
                .map_err(|e| Error::Misuse(format!("fragment outside our own segment: {e}")))?;
            if let (Some(start), Some(sum)) = (timing, self.copy_time.as_mut()) {
                *sum += start.elapsed();
            }
            if let Err(e) = self.post_fragment(t, peer, ch, i, off) {
                break Err(e);
            }
            pushed = true;
            at.sent += n;
            at.started = true;
        };
        if pushed {
            t.notify(peer);
        }
        r
    }

    /// Put fragment `i` (at `off`, written) on `peer`'s inbound ring of
    /// channel `ch`: from now on it is the peer's until it comes back.
    fn post_fragment(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        ch: usize,
        i: usize,
        off: u64,
    ) -> Result<()> {
        let ring = peer.seg.inbound(t.seg.local_rank, ch);
        let pi = peer.local as usize * CHANNELS + ch;
        if !matches!(ring.push(&mut self.prod[pi], off), Ok(true)) {
            // Cannot happen with an honest peer: each ring holds every
            // fragment of our pool. A peer that scribbled on it is cut off.
            self.free(i);
            let what = "its inbound ring is full or corrupt";
            self.misbehaved.push((peer.local, what.into()));
            return Err(Error::PeerMisbehaved {
                rank: peer.rank,
                what: what.into(),
            });
        }
        self.dest[i] = peer.local;
        self.inflight[peer.local as usize] += 1;
        Ok(())
    }

    /// Push a message of `head` and `len` bytes that `fill` writes
    /// straight into the fragment (see `Link::try_send_filled`), in one
    /// fragment: `Ok(false)` when none that holds it is free. The caller
    /// checked that nothing of its channel waits (`TxState::one_ready`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_filled(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        head: &[u8],
        len: usize,
        fill: &mut dyn FnMut(RawBuf) -> Result<()>,
    ) -> Result<bool> {
        let total = head.len() + len;
        let ch = channel(kind);
        let Some(i) = self.alloc(t, peer.local, total <= self.eager_payload(), ch) else {
            return Ok(false);
        };
        let (off, size) = self.layout.frag(i);
        if size - FRAG_BODY < total {
            self.free(i);
            return Ok(false);
        }
        let h = FragHeader {
            kind,
            flags: FIRST | LAST,
            len: total as u32,
            tag,
            total: total as u64,
        };
        let raw = t.seg.raw();
        let body = off + FRAG_BODY as u64;
        let written = raw
            .write(off, &h.encode())
            .and_then(|_| raw.write(body, head))
            .and_then(|_| raw.slice(body + head.len() as u64, len))
            .map_err(|e| Error::Misuse(format!("fragment outside our own segment: {e}")))
            .and_then(&mut *fill);
        if let Err(e) = written {
            self.free(i);
            return Err(e);
        }
        self.post_fragment(t, peer, ch, i, off)?;
        t.notify(peer);
        Ok(true)
    }
}

/// Bytes of a fragment (header first) prefetched before its header is read.
const PREFETCH_FRAGMENT: usize = 1024;

/// Bytes of the fragment after it prefetched meanwhile, when the ring
/// already holds one: streaming 2-4 KiB messages about 1.04x as fast
/// (with 1 or 2 KiB of it, or two fragments ahead, the gain is smaller or
/// none).
const PREFETCH_NEXT: usize = 256;

/// Largest message we agree to reassemble (1 TiB guard against a lying
/// header; real limits are memory).
pub(super) const MAX_MESSAGE: u64 = 1 << 40;

/// Bytes reserved up front for a message; the rest grows as fragments come,
/// so a lying length costs nothing until the data really arrives.
pub(super) const RESERVE_LIMIT: usize = 16 << 20;

pub(super) struct Partial {
    kind: Kind,
    tag: u64,
    total: usize,
    buf: Vec<u8>,
}

impl RxState {
    pub(super) fn step(&mut self, t: &SmTransport, p: &SmPeer, ch: usize) -> Step {
        let l = p.local as usize;
        let idx = l * CHANNELS + ch;
        if ch == USER && self.split[l].is_some() {
            return self.split_resume(t, p, idx);
        }
        let ring = t.seg.inbound(p.local, ch);
        let off = match ring.peek(&mut self.cons[idx]) {
            Ok(Some(off)) => off,
            Ok(None) => return Step::Empty,
            Err(_) => return Step::Bad("corrupt ring indices"),
        };
        let Some(i) = p.seg.layout.frag_index(off) else {
            return Step::Bad("offset is not a fragment of its pool");
        };
        let (_, size) = p.seg.layout.frag(i);
        let raw = p.seg.raw();
        // Start on the header's and the first payload lines together: the
        // header read would otherwise be one more miss in a row before the
        // payload copy could start on its own.
        raw.prefetch_read(off, size.min(PREFETCH_FRAGMENT));
        // In a stream, start on the next fragment's first lines too, so its
        // header is not one more miss in a row once this one is copied.
        if let Some(next) = ring.peek_ahead(&self.cons[idx], 1) {
            raw.prefetch_read(next, PREFETCH_NEXT);
        }
        let mut hb = [0u8; FRAG_HEADER];
        if raw.read(off, &mut hb).is_err() {
            return Step::Bad("fragment outside its segment");
        }
        let h = match FragHeader::decode(&hb, size - FRAG_BODY) {
            Ok(h) => h,
            Err(_) => return Step::Bad("malformed fragment header"),
        };
        if channel(h.kind) != ch {
            return Step::Bad("message kind on the wrong channel");
        }
        let payload = off + FRAG_BODY as u64;
        match &mut self.partial[idx] {
            None => {
                if h.flags & FIRST == 0 {
                    return Step::Bad("continuation without a first fragment");
                }
                if h.total > MAX_MESSAGE {
                    return Step::Bad("message length beyond any limit");
                }
                if h.kind == Kind::UserCma {
                    return self.ring_rendezvous(t, p, idx, off, &h);
                }
                // A lent message's announcement waits for room as the
                // user messages it is in order with do.
                let user = h.kind == Kind::User || h.kind == Kind::Core(CoreKind::Lent);
                if user && !t.core.has_room(h.tag, h.total as usize) {
                    self.blocked[l] = true;
                    return Step::Blocked;
                }
                if user {
                    self.blocked[l] = false;
                }
                if h.kind == Kind::User && h.flags & LAST != 0 {
                    // A whole user message in this fragment: copied once,
                    // into its receiver's lent buffer if one waits on this
                    // thread, or into a pooled one.
                    if t.core.lent_taken(h.tag) == Some(p.rank) {
                        // That receiver took this sender's previous one
                        // this poll: it takes this one from here at its
                        // next look. (Another sender's is served as
                        // usual, so none waits on another's stream.)
                        return Step::Later;
                    }
                    let len = h.len as usize;
                    if raw.slice(payload, len).is_err() {
                        return Step::Bad("payload outside its segment");
                    }
                    let make = FragCopy {
                        raw: &raw,
                        at: payload,
                        len,
                        pool: t.core.buffers(),
                    };
                    t.core.deliver_with(p.rank, h.tag, len, make);
                    if let Err(what) = self.release(t, p, idx, off) {
                        return Step::Bad(what);
                    }
                    return Step::Took;
                }
                if h.flags & LAST != 0
                    && matches!(
                        h.kind.core(),
                        Some(CoreKind::PutReq | CoreKind::PutPart | CoreKind::GetResp)
                    )
                {
                    // A put's bytes, or a get's answer, in one fragment:
                    // written into the region from here (no copy out
                    // first), by the device for device memory. The
                    // fragment goes back only once that is done.
                    if h.total != u64::from(h.len) {
                        return Step::Bad("message shorter than announced");
                    }
                    let Ok(body) = raw.slice(payload, h.len as usize) else {
                        return Step::Bad("payload outside its segment");
                    };
                    if let (Some(kind), Some(link)) = (h.kind.core(), t.core.link(p.rank)) {
                        t.core
                            .on_message_in_place(&*link, p.rank, kind, h.tag, body);
                    }
                    if let Err(what) = self.release(t, p, idx, off) {
                        return Step::Bad(what);
                    }
                    return Step::Took;
                }
                let total = h.total as usize;
                let mut buf = t.core.buffers().take(total.min(RESERVE_LIMIT));
                if raw.read_into(payload, h.len as usize, &mut buf).is_err() {
                    return Step::Bad("payload outside its segment");
                }
                self.partial[idx] = Some(Partial {
                    kind: h.kind,
                    tag: h.tag,
                    total,
                    buf,
                });
            }
            Some(part) => {
                if h.flags & FIRST != 0 || h.kind != part.kind || h.tag != part.tag {
                    return Step::Bad("fragment does not continue the current message");
                }
                if part.buf.len() + h.len as usize > part.total {
                    return Step::Bad("fragments exceed the message length");
                }
                if raw
                    .read_into(payload, h.len as usize, &mut part.buf)
                    .is_err()
                {
                    return Step::Bad("payload outside its segment");
                }
            }
        }
        if let Err(what) = self.release(t, p, idx, off) {
            return Step::Bad(what);
        }
        if h.flags & LAST != 0 {
            let Some(part) = self.partial[idx].take() else {
                return Step::Bad("internal: no partial message");
            };
            if part.buf.len() != part.total {
                return Step::Bad("message shorter than announced");
            }
            let data: Bytes = t.core.buffers().freeze(part.buf);
            if part.kind == Kind::User {
                t.core.deliver(p.rank, part.tag, data);
            } else if part.kind == Kind::CmaData {
                return self.rendezvous_data(t, p, part.tag, data);
            } else if part.kind == Kind::CmaSplit {
                return self.split_write(t, p, part.tag, &data);
            } else if part.kind == Kind::PutCma || part.kind == Kind::GetCma {
                let put = part.kind == Kind::PutCma;
                if let Err(what) = super::rma::CmaOps::serve(t, p, put, part.tag, &data) {
                    return Step::Bad(what);
                }
            } else if part.kind == Kind::CmaAck {
                if let Err(what) = t.cma.answered(t, p, part.tag, &data) {
                    return Step::Bad(what);
                }
            } else if part.kind == Kind::CmaDone {
                if data.len() != 1 {
                    return Step::Bad("malformed rendezvous answer");
                }
                t.with_tx(|tx| tx.rendezvous_done(t, p, part.tag, data[0] == 1));
            } else if let (Some(kind), Some(link)) = (part.kind.core(), t.core.link(p.rank)) {
                t.core.on_message(&*link, p.rank, kind, part.tag, data);
            }
        }
        Step::Took
    }

    /// Take the message at the head of `p`'s user ring straight into `buf`
    /// if it is a whole user message for `tag` in one fragment (see
    /// `take_direct`); its sender. Anything else, and anything wrong with
    /// the fragment, is left where it is for progress to serve or report.
    pub(super) fn ring_direct(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        tag: u64,
        buf: &mut Vec<u8>,
    ) -> Option<crate::Rank> {
        let idx = p.local as usize * CHANNELS + USER;
        let ring = t.seg.inbound(p.local, USER);
        let off = ring.peek(&mut self.cons[idx]).ok()??;
        let i = p.seg.layout.frag_index(off)?;
        let (_, size) = p.seg.layout.frag(i);
        let raw = p.seg.raw();
        raw.prefetch_read(off, size.min(PREFETCH_FRAGMENT));
        let mut hb = [0u8; FRAG_HEADER];
        raw.read(off, &mut hb).ok()?;
        let h = FragHeader::decode(&hb, size - FRAG_BODY).ok()?;
        if h.kind != Kind::User || h.flags & (FIRST | LAST) != FIRST | LAST || h.tag != tag {
            return None;
        }
        buf.clear();
        raw.read_into(off + FRAG_BODY as u64, h.len as usize, buf)
            .ok()?;
        if let Err(what) = self.release(t, p, idx, off) {
            Counters::bump(&t.core.counters().bad_frames);
            self.misbehaved
                .push((p.local, format!("it sent a bad fragment ({what})")));
        }
        Some(p.rank)
    }

    /// Advance past the fragment at `off` (ring `idx`) and give it back; the
    /// return ring holds every fragment of the sender's pool, so an honest
    /// sender never sees it full.
    pub(super) fn release(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        idx: usize,
        off: u64,
    ) -> Result<(), &'static str> {
        t.seg
            .inbound(p.local, idx % CHANNELS)
            .advance(&mut self.cons[idx]);
        let back = p.seg.returns(t.seg.local_rank);
        match back.push(&mut self.ret[p.local as usize], off) {
            Ok(true) => Ok(()),
            _ => Err("its return ring is full or corrupt"),
        }
    }
}

/// A whole user message in a fragment, as the dispatcher takes it: copied
/// into a receiver's lent buffer, or into a pooled buffer of its own. (Not
/// into a receiver's kept buffer: for a message this size a second copy
/// out of it would cost more than the pooled buffer.)
struct FragCopy<'a> {
    raw: &'a crate::sys::mem::RawBuf,
    at: u64,
    len: usize,
    pool: &'a std::sync::Arc<crate::core::bufpool::BufPool>,
}

impl crate::core::dispatch::Payload for FragCopy<'_> {
    fn into_bytes(self) -> Bytes {
        let mut v = self.pool.take(self.len);
        // In bounds: checked before the payload was made.
        let _ = self.raw.read_into(self.at, self.len, &mut v);
        self.pool.freeze(v)
    }

    fn copy_into(self, out: &mut Vec<u8>) {
        let _ = self.raw.read_into(self.at, self.len, out);
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;
    use crate::sm::segment::{Layout, Params};

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

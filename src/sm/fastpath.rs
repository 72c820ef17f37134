//! The fast-box path of the transport, both halves: the send side puts a
//! small user message (or a rendezvous announcement) in the peer's box
//! while the pair's user ring is drained, and tells whether the peer took
//! everything from it; the receive side takes runs of messages from the
//! sender's box under one dispatcher lock, handing announcements to
//! [`rendezvous`](super::rendezvous), and takes the next message straight
//! into a receiver's lent buffer (`take_direct`), from the box or, when
//! the box is empty, from a single fragment at the head of the ring
//! ([`RxState::ring_direct`]). The box's layout, push and peek are
//! [`fbox`].

use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;

use super::fbox;
use super::rendezvous::{Held, RTS_LEN};
use super::rx::{RxState, Step};
use super::segment::CHANNELS;
use super::tx::{TxState, USER};
use super::{SmPeer, SmTransport};
use crate::core::dispatch::More;
use crate::sys::ring::Ring;
use crate::Result;

/// Messages [`RxState::take_direct`] takes between two progress calls at
/// most. The bound keeps returns, other senders to the same tag and the
/// other transports served within that many messages (about 3 µs of small
/// messages); a progress call inside a stream costs the receiver its place
/// behind the sender, so the bound is a whole window of an OSU-style
/// stream (64 messages streamed 1.06x as fast at 64 bytes as with 16, 1.01-
/// 1.04x at 8 and 256 bytes).
const DIRECT_RUN: u32 = 64;

/// Every this many direct takes, [`RxState::take_direct`] looks at the
/// senders' control rings, and a control message waiting there (a
/// one-sided request, a rendezvous answer) ends the run: control traffic
/// is served within this many messages of a stream, not [`DIRECT_RUN`].
const CONTROL_LOOK_EVERY: u32 = 16;

/// [`RxState::take_direct`] looks at the senders' rings in every this
/// many of its rounds.
const RING_LOOKS_EVERY: usize = 4;

impl TxState {
    /// Put a small user message (or, with `rndv`, a rendezvous
    /// announcement) in the peer's fast box. `None`: the box may not be
    /// used now (the pair's user ring still holds messages, which must
    /// arrive first); `Some(false)`: the box is full.
    #[inline]
    pub(super) fn via_fbox(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        rndv: bool,
        tag: u64,
        data: &[u8],
    ) -> Result<Option<bool>> {
        let l = peer.local as usize;
        match self.user_ring_drained(t, peer) {
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

    /// Whether the peer took every user message we pushed to its ring
    /// from us. The ring is looked at only when we pushed to it since it
    /// was last seen drained. `Err`: its indices are impossible.
    #[inline]
    pub(super) fn user_ring_drained(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
    ) -> std::result::Result<bool, crate::sys::ring::Corrupt> {
        let prod = &mut self.prod[peer.local as usize * CHANNELS + USER];
        if Ring::known_drained(prod) {
            return Ok(true);
        }
        peer.seg.inbound(t.seg.local_rank, USER).drained(prod)
    }

    /// Whether the peer took every message we put in its fast box.
    pub(super) fn fbox_drained(&mut self, t: &SmTransport, peer: &SmPeer) -> Result<bool> {
        let st = &mut self.fb[peer.local as usize];
        peer.seg
            .fbox(t.seg.local_rank)
            .drained(st)
            .map_err(|_| self.corrupt(peer, "its fast box is corrupt"))
    }
}

impl RxState {
    /// Take up to `max` messages from the sender's fast box: runs of user
    /// messages under one dispatcher lock, and rendezvous announcements
    /// (whose copy runs outside it). Returns how many, and why it stopped:
    /// `Took` (took `max`), `Empty`, `Blocked` (no room in a tag, or a
    /// rendezvous waits) or `Bad`.
    pub(super) fn fbox_run(&mut self, t: &SmTransport, p: &SmPeer, max: usize) -> (usize, Step) {
        let l = p.local as usize;
        // A rendezvous under way holds the box (and the ring path knows).
        if self.awaiting[l].is_some() || self.split[l].is_some() {
            return (0, Step::Empty);
        }
        let b = t.seg.fbox(p.local);
        // No lock for an empty box (the common look of an idle poll).
        if b.looks_empty(&self.fb[l]) {
            return (0, Step::Empty);
        }
        let mut total = 0;
        let (took, step) = loop {
            let (took, step, rndv) = self.fbox_messages(t, p, b, max - total);
            total += took;
            let Some(found) = rndv else {
                break (total, step);
            };
            if found.len != RTS_LEN {
                break (total, Step::Bad("malformed rendezvous announcement"));
            }
            let mut rts = [0u8; RTS_LEN];
            b.read(&self.fb[l], &mut rts);
            let idx = l * CHANNELS + USER;
            match self.rendezvous(t, p, idx, Held::Box, found.tag, &rts) {
                Step::Took => total += 1,
                other => break (total, other),
            }
            if total >= max {
                break (total, Step::Took);
            }
        };
        if took > 0 && !p.heard.load(std::sync::atomic::Ordering::Relaxed) {
            p.heard.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        (took, step)
    }

    /// Take the first message waiting in some sender's fast box, or with
    /// the box empty at the head of its user ring in one fragment, into
    /// `buf` if it is a user message for `tag` and nothing of that
    /// sender's comes before it (see `Transport::take_direct`); its sender.
    /// Makes up to `looks` looks at the senders' boxes (each box in turn)
    /// under one lock, and stops at the first sign of other work (a
    /// message of another tag or a rendezvous announcement at a box's
    /// head, a control message, a ring fragment of another kind or tag),
    /// which progress serves. A message is taken whether or not others
    /// follow it in the box. After
    /// [`DIRECT_RUN`] takes it takes none until the next progress call,
    /// which serves the rest (returns, other transports), and a message
    /// on a control channel ends a run after [`CONTROL_LOOK_EVERY`].
    pub(super) fn take_direct(
        &mut self,
        t: &SmTransport,
        tag: u64,
        queued: &AtomicUsize,
        buf: &mut Vec<u8>,
        more: &mut More<'_>,
        looks: u32,
    ) -> Option<crate::Rank> {
        // Read under `rx`, which orders every delivery of ours: a message
        // queued for the tag before this look is seen here, so none of a
        // sender's is taken ahead of an earlier one in the queue.
        if self.direct_run >= DIRECT_RUN || queued.load(Ordering::Relaxed) != 0 {
            return None;
        }
        let peers = t.peer_list();
        if self.direct_run > 0
            && self.direct_run % CONTROL_LOOK_EVERY == 0
            && peers
                .iter()
                .flatten()
                .any(|p| !self.ring_looks_empty(t, p, CHANNELS - 1))
        {
            return None;
        }
        // `looks` looks at one box each: fewer rounds with more senders.
        let rounds = (looks as usize / peers.len().max(1)).max(1);
        for round in 0..rounds {
            for p in peers.iter().flatten() {
                let l = p.local as usize;
                if p.is_lost() {
                    continue;
                }
                // Anything under way from this sender comes first, in
                // progress.
                if self.awaiting[l].is_some()
                    || self.split[l].is_some()
                    || self.blocked[l]
                    || self.partial[l * CHANNELS + USER].is_some()
                {
                    return None;
                }
                let b = t.seg.fbox(p.local);
                let st = &mut self.fb[l];
                match b.take_small(st, tag, buf, true) {
                    fbox::Take::Took(_) => {
                        // Found at the first look: the receiver is behind
                        // its sender, and more may wait. (A receiver that
                        // waited for it would only take the next slot's
                        // line from the sender writing it.)
                        let extra = if round == 0 {
                            self.take_more(t, p, tag, more)
                        } else {
                            0
                        };
                        self.took_direct(t, p, &t.counters.fast_box_recvs, 1 + extra);
                        return Some(p.rank);
                    }
                    fbox::Take::Empty if round % RING_LOOKS_EVERY != 0 => continue,
                    _ => {}
                }
                let found = match b.peek(st) {
                    // Taken even when more follow: a progress call would
                    // take the run behind it (up to `FBOX_RUN`) before the
                    // receiver sees the first, and in a stream that run
                    // chases the sender, holding every message back by as
                    // many sends; a direct take costs no more per message.
                    Ok(Some(f)) if !f.rndv && f.tag == tag => f,
                    // The rings too, every few rounds (a look at the box
                    // alone is quicker, so a message arriving there is
                    // seen sooner).
                    Ok(None) if round % RING_LOOKS_EVERY != 0 => continue,
                    Ok(None) => {
                        let control_empty = self.ring_looks_empty(t, p, CHANNELS - 1);
                        if control_empty && self.ring_looks_empty(t, p, USER) {
                            continue;
                        }
                        if !control_empty {
                            return None;
                        }
                        // A user message waits in the ring (the box is
                        // empty): taken from there if it is whole and ours.
                        let src = self.ring_direct(t, p, tag, buf)?;
                        self.took_direct(t, p, &t.counters.direct_ring_recvs, 1);
                        return Some(src);
                    }
                    _ => return None,
                };
                buf.clear();
                b.read_into(st, found.len, buf);
                // After the copy, under `rx` (see the order argument in
                // `fbox`).
                b.consume(st, found.len);
                self.took_direct(t, p, &t.counters.fast_box_recvs, 1);
                return Some(p.rank);
            }
        }
        None
    }

    /// After a direct take from `p`'s box (not yet counted in
    /// `direct_run`): the small messages for `tag` already waiting behind
    /// it there, into `more`, up to the take that looks at the control
    /// channel (`CONTROL_LOOK_EVERY`); how many. Under `rx`, as the take
    /// was: they are delivered in order behind it.
    fn take_more(&mut self, t: &SmTransport, p: &SmPeer, tag: u64, more: &mut More<'_>) -> u32 {
        let run = self.direct_run + 1;
        let room = (CONTROL_LOOK_EVERY - run % CONTROL_LOOK_EVERY) % CONTROL_LOOK_EVERY;
        let room = room.min(u32::try_from(more.wanted()).unwrap_or(u32::MAX));
        let b = t.seg.fbox(p.local);
        let st = &mut self.fb[p.local as usize];
        let mut n = 0;
        while n < room
            && more.take(p.rank, fbox::TWO_SLOTS, |k| {
                matches!(b.take_small(st, tag, k, false), fbox::Take::Took(_))
            })
        {
            n += 1;
        }
        n
    }

    /// Whether `p`'s inbound ring of channel `ch` looks empty (a racy
    /// hint: a fragment may be being pushed now).
    fn ring_looks_empty(&self, t: &SmTransport, p: &SmPeer, ch: usize) -> bool {
        self.cons[p.local as usize * CHANNELS + ch].looks_empty(t.seg.inbound_tail(p.local, ch))
    }

    /// After `n` direct takes from `p` (box or ring): count them in `counter`
    /// (written under `rx` only), note that we heard from `p`, and ring
    /// its doorbell if it sleeps waiting for room. The fenced check that
    /// catches one arming meanwhile (`notify`) is left to the next progress
    /// call, which comes within `DIRECT_RUN` takes (or from the progress
    /// task), so a stream of direct takes pays no fence per message.
    fn took_direct(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        counter: &std::sync::atomic::AtomicU64,
        n: u32,
    ) {
        self.direct_run += n;
        counter.store(
            counter.load(Ordering::Relaxed).wrapping_add(u64::from(n)),
            Ordering::Relaxed,
        );
        if !p.heard.load(Ordering::Relaxed) {
            p.heard.store(true, Ordering::Relaxed);
        }
        if t.peer_asleep(p) {
            t.notify(p);
        } else {
            self.owed[p.local as usize] = true;
        }
    }

    /// Take up to `max` user messages from the sender's fast box under one
    /// dispatcher lock, stopping before a rendezvous announcement (returned).
    fn fbox_messages(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        b: fbox::FBox<'_>,
        max: usize,
    ) -> (usize, Step, Option<fbox::Found>) {
        let l = p.local as usize;
        let st = &mut self.fb[l];
        let (took, step, rndv) = t.core.offers(|o| {
            let mut took = 0;
            while took < max {
                let found = match b.peek(st) {
                    Ok(Some(f)) if f.rndv => return (took, Step::Took, Some(f)),
                    Ok(Some(f)) => f,
                    Ok(None) => return (took, Step::Empty, None),
                    Err(_) => {
                        let bad = Step::Bad("fast-box message longer than its slot");
                        return (took, bad, None);
                    }
                };
                let read = FboxPayload {
                    b: &b,
                    st: &*st,
                    len: found.len,
                };
                if !o.offer(p.rank, found.tag, found.len, read) {
                    return (took, Step::Blocked, None);
                }
                // After the delivery, under `rx`: see the order argument in
                // `fbox`.
                b.consume(st, found.len);
                took += 1;
            }
            (took, Step::Took, None)
        });
        match step {
            Step::Blocked => self.blocked[l] = true,
            _ if took > 0 => self.blocked[l] = false,
            _ => {}
        }
        if took > 0 {
            // Counted by the caller, once per progress call (an atomic add
            // per message costs as much as the rest of taking it).
            self.fast += took as u64;
        }
        (took, step, rndv)
    }
}

/// A fast-box message as the dispatcher takes it: read into a buffer of
/// its own, or into one a receiver lent (no allocation then).
struct FboxPayload<'a, 'b> {
    b: &'a fbox::FBox<'b>,
    st: &'a fbox::Receiver,
    len: usize,
}

impl crate::core::dispatch::Payload for FboxPayload<'_, '_> {
    const COPIES: bool = true;
    fn into_bytes(self) -> Bytes {
        Bytes::from(self.b.read_vec(self.st, self.len))
    }
    fn copy_into(self, out: &mut Vec<u8>) {
        self.b.read_into(self.st, self.len, out);
    }
}

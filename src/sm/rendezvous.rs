//! Rendezvous: a large user message copied once, straight out of its
//! sender's memory (`process_vm_readv`), both halves.
//!
//! Send: announce the message ([`Rts`]) in order with the other user
//! messages, keep its bytes alive ([`Rndv`]) until the receiver answers,
//! and settle the answers — the pair's done word, or a refusal on the
//! control ring, after which the data goes through fragments. Receive: copy
//! the message, deliver it and answer; or refuse, holding the announcement
//! (and every later user message) until the data arrives. From
//! `SmConfig::split_min` bytes the copy may be split with the sender: the
//! transport's halves of [`split`] (offer the tail, read the head, take the
//! tail back or wait for it; on the sender's side, write the tail it was
//! asked for) are here too.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::eager::{MAX_MESSAGE, RESERVE_LIMIT};
use super::frag::{FragHeader, FIRST, FRAG_BODY, LAST};
use super::kind::Kind;
use super::rx::{RxState, Step};
use super::segment::CHANNELS;
use super::split::{self, SplitReq, Tail};
use super::tx::{TxState, USER};
use super::{SmPeer, SmTransport};
use crate::core::completion::Completion;
use crate::core::stats::Counters;
use crate::Result;

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
pub(super) struct Rndv {
    pub(super) peer: u32,
    pub(super) data: Bytes,
    pub(super) done: Arc<Completion>,
    /// When it was announced, if it is timed for `adapt`: a message in its
    /// band, announced to a peer that had taken all we sent it before,
    /// and at once (one that queued behind other messages, or reached a
    /// receiver still copying earlier ones, would count their time too).
    pub(super) start: Option<Instant>,
}

impl TxState {
    /// Rendezvous: announce a large message in order with the other user
    /// messages; the receiver copies it straight out of `data` (one copy
    /// instead of two through fragments) and answers. Completes on the answer.
    /// `timed`: its time to the answer is a sample for `adapt` (see
    /// `Rndv::start`).
    pub(super) fn announce(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        tag: u64,
        data: Bytes,
        timed: bool,
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
                start: timed.then(Instant::now),
            },
        );
        self.rndv_order[peer.local as usize].push_back(handle);
        // Pushed from the stack when it goes at once; an owned copy only
        // when it must queue.
        match self.push_now(t, peer, Kind::UserCma, tag, &rts) {
            Ok(None) => {}
            Ok(Some(at)) => {
                if let Some(r) = self.rndv.get_mut(&handle) {
                    r.start = None;
                }
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

    /// Whether `peer` has taken every user message we sent it: its user
    /// ring from us and our fast box to it are drained.
    pub(super) fn caught_up(&mut self, t: &SmTransport, peer: &SmPeer) -> bool {
        self.user_ring_drained(t, peer).unwrap_or(false)
            && self.fbox_drained(t, peer).unwrap_or(false)
    }

    /// Rendezvous `r` to local peer `l` was copied: complete it, and give
    /// its time to `adapt` if it was timed.
    fn copied(&mut self, l: usize, r: Rndv) {
        r.done.complete(Ok(()));
        if let Some(start) = r.start {
            self.adapt.single_took(l, r.data.len(), start.elapsed());
        }
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
            self.copied(peer.local as usize, r);
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
    pub(super) fn reap_rendezvous(&mut self, t: &SmTransport) -> usize {
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
                    self.copied(l, r);
                    n += 1;
                }
            }
        }
        n
    }
}

/// Largest message copied by split copy: the receive-buffer pool's largest
/// class. (Larger ones would take fresh buffers, which two processes
/// faulting in at once fill slower than the receiver alone: 32 MiB
/// streaming at about 0.55x the rate.)
const SPLIT_MAX: usize = 64 << 20;

/// Where a rendezvous announcement waits until its message is delivered:
/// at the head of the pair's user ring (a fragment at this offset) or of
/// its fast box. Either way it holds back the sender's later messages.
#[derive(Clone, Copy)]
pub(super) enum Held {
    Ring(u64),
    Box,
}

/// A rendezvous whose data comes through fragments after all (our single
/// copy was refused): its announcement stays where it is, holding back
/// later messages, until the data arrives.
#[derive(Clone, Copy)]
pub(super) struct Awaiting {
    handle: u64,
    tag: u64,
    len: usize,
    at: Held,
}

/// A rendezvous whose tail the sender was asked to write (split copy),
/// waiting for it; its announcement stays where it is (`at`).
pub(super) struct SplitWait {
    pub(super) handle: u64,
    tag: u64,
    /// The message's address in the sender.
    addr: u64,
    /// The announcement (released on delivery).
    at: Held,
    buf: crate::sys::os::SplitBuf,
}

impl RxState {
    /// A rendezvous announcement in one fragment at `off` of ring `idx`.
    pub(super) fn ring_rendezvous(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        idx: usize,
        off: u64,
        h: &FragHeader,
    ) -> Step {
        if h.flags & (FIRST | LAST) != FIRST | LAST
            || h.len as usize != RTS_LEN
            || h.total != RTS_LEN as u64
        {
            return Step::Bad("malformed rendezvous announcement");
        }
        let mut rts = [0u8; RTS_LEN];
        if p.seg.raw().read(off + FRAG_BODY as u64, &mut rts).is_err() {
            return Step::Bad("payload outside its segment");
        }
        self.rendezvous(t, p, idx, Held::Ring(off), h.tag, &rts)
    }

    /// A rendezvous announcement `rts` (held `at` the head of the user ring
    /// `idx` or of the box): copy the message straight from the sender's
    /// memory, deliver it, and answer. If the kernel refuses the copy, ask
    /// for the data instead and hold the announcement (and so every later
    /// user message) until then.
    pub(super) fn rendezvous(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        idx: usize,
        at: Held,
        tag: u64,
        rts: &[u8; RTS_LEN],
    ) -> Step {
        let l = p.local as usize;
        if self.awaiting[l].is_some() {
            self.blocked[l] = true;
            return Step::Blocked;
        }
        let Rts { handle, addr, len } = Rts::decode(rts);
        if len > MAX_MESSAGE {
            return Step::Bad("message length beyond any limit");
        }
        let len = len as usize;
        if !t.core.has_room(tag, len) {
            self.blocked[l] = true;
            return Step::Blocked;
        }
        self.blocked[l] = false;
        if let Some(head) = self.split_point(t, p, (handle, addr), len) {
            return self.split_start(t, p, idx, at, (handle, tag, addr, len), head);
        }
        // Read in slices, so the buffer grows only as real data arrives (a
        // lying length costs nothing up front).
        let mut buf = t.core.buffers().take(len.min(RESERVE_LIMIT));
        let mut copied = Ok(());
        while copied.is_ok() && buf.len() < len {
            let n = (len - buf.len()).min(RESERVE_LIMIT);
            let from = addr.wrapping_add(buf.len() as u64);
            copied = crate::sys::os::cma_read_into(p.seg.pid, from, n, &mut buf);
        }
        match copied {
            Ok(()) => self.rendezvous_copied(t, p, idx, at, (handle, tag), buf),
            Err(e) => self.rendezvous_failed(t, p, e, at, (handle, tag, len)),
        }
    }

    /// Let go of a rendezvous announcement whose message is delivered.
    fn release_held(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        idx: usize,
        at: Held,
    ) -> Result<(), &'static str> {
        match at {
            Held::Ring(off) => self.release(t, p, idx, off),
            Held::Box => {
                let l = p.local as usize;
                // After the delivery, under `rx` (the order argument in `fbox`).
                t.seg.fbox(p.local).consume(&mut self.fb[l], RTS_LEN);
                Ok(())
            }
        }
    }

    /// The whole rendezvous message is in `buf`: release its announcement,
    /// deliver, answer.
    fn rendezvous_copied(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        idx: usize,
        at: Held,
        (handle, tag): (u64, u64),
        buf: Vec<u8>,
    ) -> Step {
        if let Err(what) = self.release_held(t, p, idx, at) {
            return Step::Bad(what);
        }
        // The answer: Release, after every read of the sender's buffer
        // (its Acquire load lets it drop the buffer); our caller rings it.
        // Before the delivery, so that a sender answered by our receiver
        // sees the copy done (whether a rendezvous of its is still out
        // decides how its next message goes).
        t.seg
            .fbox(p.local)
            .rndv_done_word()
            .store(handle, std::sync::atomic::Ordering::Release);
        t.core.deliver(p.rank, tag, t.core.buffers().freeze(buf));
        Step::Took
    }

    /// Our copy of a rendezvous failed with `e`.
    fn rendezvous_failed(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        e: std::io::Error,
        at: Held,
        (handle, tag, len): (u64, u64, usize),
    ) -> Step {
        let l = p.local as usize;
        // The sender is exiting: the liveness check will say so. (A live
        // one that the kernel cannot find, as from another PID namespace,
        // is a refusal like any other.)
        if e.raw_os_error() == Some(libc::ESRCH) && p.watch.exited() {
            self.blocked[l] = true;
            return Step::Blocked;
        }
        tracing::info!(
            peer = p.rank,
            "single copy from the peer refused ({e}): asking for the data through fragments"
        );
        self.awaiting[l] = Some(Awaiting {
            handle,
            tag,
            len,
            at,
        });
        self.blocked[l] = true;
        refuse(t, p, handle);
        Step::Blocked
    }

    /// Where to split a rendezvous of `len` bytes between us (the head) and
    /// its sender (the tail), if it is worth it and allowed.
    fn split_point(
        &self,
        t: &SmTransport,
        p: &SmPeer,
        (handle, addr): (u64, u64),
        len: usize,
    ) -> Option<usize> {
        let on = p.split.load(std::sync::atomic::Ordering::Relaxed);
        // Page-aligned, so each side pins whole pages of its part.
        let head = (len / 2) & !4095;
        let ok = on
            && len >= t.config.split_min
            && len <= SPLIT_MAX
            && head > 0
            && self.offered[p.local as usize] != handle;
        // A split reserves the whole message at once. Beyond the slice an
        // unsplit copy reserves, first check that the sender's range really
        // reaches that far (its last byte is readable), so a lying length
        // cannot make us reserve memory that no data backs.
        let backed = || {
            let mut last = Vec::with_capacity(1);
            let end = addr.wrapping_add(len as u64 - 1);
            len <= RESERVE_LIMIT
                || crate::sys::os::cma_read_into(p.seg.pid, end, 1, &mut last).is_ok()
        };
        (ok && backed()).then_some(head)
    }

    /// Offer the tail of a rendezvous to its sender, read the head, then see
    /// who has the tail.
    fn split_start(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        idx: usize,
        at: Held,
        (handle, tag, addr, len): (u64, u64, u64, usize),
        head: usize,
    ) -> Step {
        let l = p.local as usize;
        let mut buf = crate::sys::os::SplitBuf::new(t.core.buffers().take(len), len, head);
        let w = t.seg.fbox(p.local).split_word();
        self.offered[l] = handle;
        split::offer(w, handle);
        ask_split(t, p, handle, buf.tail_addr(), head, len - head);
        if let Err(e) = buf.read_head(p.seg.pid, addr) {
            if split::take_back(w, handle) {
                // SAFETY: taken back before the sender claimed it: it never
                // writes into the buffer.
                drop(unsafe { buf.reclaim() });
            }
            // (Otherwise the sender may be writing: `buf` is leaked.)
            return self.rendezvous_failed(t, p, e, at, (handle, tag, len));
        }
        self.split[l] = Some(SplitWait {
            handle,
            tag,
            addr,
            at,
            buf,
        });
        self.split_resume(t, p, idx)
    }

    /// A split copy under way: deliver once the tail is in (the sender
    /// wrote it, or we take it back and copy it ourselves); wait while the
    /// sender writes it.
    pub(super) fn split_resume(&mut self, t: &SmTransport, p: &SmPeer, idx: usize) -> Step {
        let l = p.local as usize;
        let Some(handle) = self.split[l].as_ref().map(|s| s.handle) else {
            return Step::Bad("internal: no split copy under way");
        };
        let w = t.seg.fbox(p.local).split_word();
        let ours = loop {
            match split::state(w, handle) {
                Tail::Claimed => {
                    self.blocked[l] = true;
                    return Step::Blocked;
                }
                Tail::Done => break false,
                Tail::Offered => {
                    if split::take_back(w, handle) {
                        break true;
                    }
                    // Claimed meanwhile: look again.
                }
                Tail::Failed => {
                    p.split.store(false, std::sync::atomic::Ordering::Relaxed);
                    break true;
                }
                // The SplitWait (and so the buffer) is leaked with the peer.
                Tail::Corrupt => return Step::Bad("its split-copy word is corrupt"),
            }
        };
        let Some(mut s) = self.split[l].take() else {
            return Step::Bad("internal: no split copy under way");
        };
        let counters = &t.counters;
        if ours {
            Counters::bump(&counters.split_tails_taken_back);
            let at = s.addr.wrapping_add(s.buf.head() as u64);
            if let Err(e) = s.buf.read_tail(p.seg.pid, at) {
                let len = s.buf.len();
                // SAFETY: taken back (or the sender failed and stopped): no
                // write into the buffer is under way or will come.
                drop(unsafe { s.buf.reclaim() });
                return self.rendezvous_failed(t, p, e, s.at, (handle, s.tag, len));
            }
        } else {
            Counters::bump(&counters.split_tails_written);
        }
        self.blocked[l] = false;
        // SAFETY: the head was read before the SplitWait was stored; the
        // tail was just read by us, or the sender published DONE (Acquire
        // in `split::state`) after writing every byte of it.
        let buf = unsafe { s.buf.complete() };
        self.rendezvous_copied(t, p, idx, s.at, (handle, s.tag), buf)
    }

    /// The receiver of our rendezvous `handle` asks us to write part of it
    /// into its buffer at `dst`: claim the part, write it, say how it went.
    pub(super) fn split_write(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        handle: u64,
        req: &[u8],
    ) -> Step {
        let Some(req) = SplitReq::decode(req) else {
            return Step::Bad("malformed split-copy request");
        };
        let found = t.with_tx(|tx| {
            let data = tx.rendezvous_data(p.local, handle);
            (data, tx.rendezvous_settled(p.local, handle))
        });
        let data = match found {
            (Some(data), _) => data,
            // The request crossed the done word (which overtakes the
            // control ring): the receiver took the tail back.
            (None, true) => return Step::Took,
            (None, false) => {
                return Step::Bad("split-copy request for a message we never announced")
            }
        };
        let Some(range) = req.range(data.len()) else {
            return Step::Bad("split-copy request outside its message");
        };
        let w = p.seg.fbox(t.seg.local_rank).split_word();
        // Without single copy (refused once) we leave the tail to the
        // receiver, which takes it back.
        if p.cma_ok() && split::claim(w, handle) {
            let r = crate::sys::os::cma_write_from(p.seg.pid, req.dst, &data[range]);
            if let Err(e) = &r {
                tracing::info!(peer = p.rank, "split copy into the peer refused ({e})");
            }
            split::finish(w, handle, r.is_ok());
            t.notify(p);
        }
        Step::Took
    }

    /// The data of a refused rendezvous arrived: deliver it in the place of
    /// its announcement, which leaves the user ring now.
    pub(super) fn rendezvous_data(
        &mut self,
        t: &SmTransport,
        p: &SmPeer,
        handle: u64,
        data: Bytes,
    ) -> Step {
        let l = p.local as usize;
        let Some(a) = self.awaiting[l] else {
            return Step::Bad("rendezvous data that nobody asked for");
        };
        if a.handle != handle || a.len != data.len() {
            return Step::Bad("rendezvous data does not match its announcement");
        }
        let idx = l * CHANNELS + USER;
        // The announcement still waits where it was (we never moved past it).
        let at = match a.at {
            Held::Ring(_) => match t.seg.inbound(p.local, USER).peek(&mut self.cons[idx]) {
                Ok(Some(off)) => Held::Ring(off),
                _ => return Step::Bad("rendezvous announcement vanished from the ring"),
            },
            Held::Box => match t.seg.fbox(p.local).peek(&mut self.fb[l]) {
                Ok(Some(f)) if f.rndv && f.len == RTS_LEN => Held::Box,
                _ => return Step::Bad("rendezvous announcement vanished from the box"),
            },
        };
        if let Err(what) = self.release_held(t, p, idx, at) {
            return Step::Bad(what);
        }
        self.awaiting[l] = None;
        self.blocked[l] = false;
        t.core.deliver(p.rank, a.tag, data);
        Step::Took
    }
}

/// Ask the sender of rendezvous `handle` to write `n` bytes of it, from
/// offset `at`, to `dst` in our memory (split copy).
fn ask_split(t: &SmTransport, p: &SmPeer, handle: u64, dst: u64, at: usize, n: usize) {
    let req = SplitReq {
        dst,
        at: at as u64,
        n: n as u64,
    }
    .encode();
    // A failure means the peer is gone; its loss is reported elsewhere
    // (and the offer is taken back when we look at it).
    let data = Bytes::copy_from_slice(&req);
    let _ = t.with_tx(|tx| tx.submit(t, p, Kind::CmaSplit, handle, data));
}

/// Tell the sender of a rendezvous that we could not copy its data (a copy
/// that worked is answered through the pair's done word instead).
fn refuse(t: &SmTransport, p: &SmPeer, handle: u64) {
    // Straight to the send side (what the peer's link would do, without
    // looking the link up). A failure means the peer is gone; its loss is
    // reported elsewhere.
    let _ = t.with_tx(|tx| tx.submit(t, p, Kind::CmaDone, handle, Bytes::from_static(&[0])));
}

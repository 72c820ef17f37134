//! Receive side of `sm`: drain each sender's rings (control first), validate
//! every offset and header, reassemble, hand complete messages to the core,
//! return fragments.

use bytes::Bytes;

use super::fbox;
use super::frag::{FragHeader, FIRST, FRAG_HEADER, LAST};
use super::kind::Kind;
use super::segment::CHANNELS;
use super::split::{self, SplitReq, Tail};
use super::tx::{channel, Rts, RTS_LEN, USER};
use super::{SmPeer, SmTransport};
use crate::core::stats::Counters;
use crate::sys::ring::{ConsumerState, ProducerState};

/// Fragments taken from one sender's ring per progress call, so one busy
/// sender cannot starve the others.
const BATCH: usize = 64;
/// Bytes of a fragment (header first) prefetched before its header is read.
const PREFETCH_FRAGMENT: usize = 1024;
/// Bytes of the fragment after it prefetched meanwhile, when the ring
/// already holds one: streaming 2-4 KiB messages about 1.04x as fast
/// (with 1 or 2 KiB of it, or two fragments ahead, the gain is smaller or
/// none).
const PREFETCH_NEXT: usize = 256;

/// Largest message we agree to reassemble (1 TiB guard against a lying
/// header; real limits are memory).
const MAX_MESSAGE: u64 = 1 << 40;

/// Bytes reserved up front for a message; the rest grows as fragments come,
/// so a lying length costs nothing until the data really arrives.
const RESERVE_LIMIT: usize = 16 << 20;

/// Largest message copied by split copy: the receive-buffer pool's largest
/// class. (Larger ones would take fresh buffers, which two processes
/// faulting in at once fill slower than the receiver alone: 32 MiB
/// streaming at about 0.55x the rate.)
const SPLIT_MAX: usize = 64 << 20;

/// Where a rendezvous announcement waits until its message is delivered:
/// at the head of the pair's user ring (a fragment at this offset) or of
/// its fast box. Either way it holds back the sender's later messages.
#[derive(Clone, Copy)]
enum Held {
    Ring(u64),
    Box,
}

/// A rendezvous whose data comes through fragments after all (our single
/// copy was refused): its announcement stays where it is, holding back
/// later messages, until the data arrives.
#[derive(Clone, Copy)]
struct Awaiting {
    handle: u64,
    tag: u64,
    len: usize,
    at: Held,
}

/// A rendezvous whose tail the sender was asked to write (split copy),
/// waiting for it; its announcement stays where it is (`at`).
struct SplitWait {
    handle: u64,
    tag: u64,
    /// The message's address in the sender.
    addr: u64,
    /// The announcement (released on delivery).
    at: Held,
    buf: crate::sys::os::SplitBuf,
}

struct Partial {
    kind: Kind,
    tag: u64,
    total: usize,
    buf: Vec<u8>,
}

/// Process-local receive state (behind the transport's `rx` mutex).
pub(crate) struct RxState {
    /// Consumer state per (sender, channel).
    cons: Vec<ConsumerState>,
    /// Our producer state on each sender's return ring.
    ret: Vec<ProducerState>,
    /// Our state on each sender's fast box.
    fb: Vec<fbox::Receiver>,
    /// Message being reassembled per (sender, channel).
    partial: Vec<Option<Partial>>,
    /// The sender's next user message waits for room in its tag's queue.
    blocked: Vec<bool>,
    /// Per sender: a refused rendezvous waiting for its data.
    awaiting: Vec<Option<Awaiting>>,
    /// Per sender: a split copy under way.
    split: Vec<Option<SplitWait>>,
    /// Per sender: the last rendezvous handle whose tail we offered (never
    /// offered twice: a late request for the first offer could claim the
    /// second and write to the first buffer).
    offered: Vec<u64>,
    /// Fast-box messages taken in the current progress call.
    fast: u64,
    /// Peers (local ranks) caught misbehaving, to be cut off once the rx
    /// lock is released.
    pub(crate) misbehaved: Vec<(u32, String)>,
}

enum Step {
    Took,
    Empty,
    Blocked,
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
            misbehaved: Vec::new(),
        }
    }

    pub(crate) fn progress(&mut self, t: &SmTransport) -> usize {
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
                        match self.fbox_run(t, p, budget) {
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
                        Step::Empty | Step::Blocked => {
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
            if returned > 0 {
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

    /// Take up to `max` messages from the sender's fast box: runs of user
    /// messages under one dispatcher lock, and rendezvous announcements
    /// (whose copy runs outside it). Returns how many, and why it stopped:
    /// `Took` (took `max`), `Empty`, `Blocked` (no room in a tag, or a
    /// rendezvous waits) or `Bad`.
    fn fbox_run(&mut self, t: &SmTransport, p: &SmPeer, max: usize) -> (usize, Step) {
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

    fn step(&mut self, t: &SmTransport, p: &SmPeer, ch: usize) -> Step {
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
        let h = match FragHeader::decode(&hb, size - FRAG_HEADER) {
            Ok(h) => h,
            Err(_) => return Step::Bad("malformed fragment header"),
        };
        if channel(h.kind) != ch {
            return Step::Bad("message kind on the wrong channel");
        }
        let payload = off + FRAG_HEADER as u64;
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
                if h.kind == Kind::User && !t.core.has_room(h.tag, h.total as usize) {
                    self.blocked[l] = true;
                    return Step::Blocked;
                }
                if h.kind == Kind::User {
                    self.blocked[l] = false;
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

    /// Advance past the fragment at `off` (ring `idx`) and give it back; the
    /// return ring holds every fragment of the sender's pool, so an honest
    /// sender never sees it full.
    fn release(
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

    /// A rendezvous announcement in one fragment at `off` of ring `idx`.
    fn ring_rendezvous(
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
        if p.seg
            .raw()
            .read(off + FRAG_HEADER as u64, &mut rts)
            .is_err()
        {
            return Step::Bad("payload outside its segment");
        }
        self.rendezvous(t, p, idx, Held::Ring(off), h.tag, &rts)
    }

    /// A rendezvous announcement `rts` (held `at` the head of the user ring
    /// `idx` or of the box): copy the message straight from the sender's
    /// memory, deliver it, and answer. If the kernel refuses the copy, ask
    /// for the data instead and hold the announcement (and so every later
    /// user message) until then.
    fn rendezvous(
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
        t.core.deliver(p.rank, tag, t.core.buffers().freeze(buf));
        // The answer: Release, after every read of the sender's buffer
        // (its Acquire load lets it drop the buffer); our caller rings it.
        t.seg
            .fbox(p.local)
            .rndv_done_word()
            .store(handle, std::sync::atomic::Ordering::Release);
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
    fn split_resume(&mut self, t: &SmTransport, p: &SmPeer, idx: usize) -> Step {
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
    fn split_write(&mut self, t: &SmTransport, p: &SmPeer, handle: u64, req: &[u8]) -> Step {
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
    fn rendezvous_data(&mut self, t: &SmTransport, p: &SmPeer, handle: u64, data: Bytes) -> Step {
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

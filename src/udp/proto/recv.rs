//! Receive side: the receive window, out-of-order buffering, message
//! reassembly and the ACK schedule.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::config::{Config, MAX_WINDOW};
use super::conn::Event;
use super::header::{Chunk, Flags, Header, Kind, Sack, SackBlock};
use super::seq::Seq;
use super::stats::Stats;

/// First reservation for a multi-chunk message; later growth doubles, never
/// past the message's length. Keeps a lying `total_len` from reserving
/// memory that no data backs.
const FIRST_RESERVE: usize = 64 * 1024;

/// An out-of-order segment held until the hole before it is filled.
struct Stored {
    chunk: Chunk,
    payload: Bytes,
}

/// A multi-chunk message being put back together, in order.
struct Partial {
    id: u64,
    total: u64,
    buf: Vec<u8>,
    /// Payload length of the last chunk taken: the sender's chunk size, as
    /// a guess of where the next chunks end (see [`Lent`]).
    chunk: usize,
}

/// The buffer of a message being reassembled, lent to the driver so that
/// the kernel writes the next chunks' payloads straight into it, one after
/// the other from `buf.len()` (no copy out of a receive buffer). The
/// connection takes nothing for that message while it is lent; give it
/// back with [`Connection::return_reassembly`](super::Connection::return_reassembly),
/// which checks every chunk as if it had come whole.
pub struct Lent {
    /// The message's bytes so far (`len()`), with room reserved after them.
    /// The driver may only grow `len()` over bytes it had written, and
    /// must not change what is below the length it got.
    pub buf: Vec<u8>,
    id: u64,
    total: u64,
    filled: usize,
    chunk: usize,
}

impl Lent {
    /// Bytes still missing from the message.
    pub fn remaining(&self) -> usize {
        usize::try_from(self.total).map_or(usize::MAX, |t| t.saturating_sub(self.filled))
    }

    /// The payload length of the chunks that came so far: where the next
    /// ones probably end (the last one may be shorter).
    pub fn chunk(&self) -> usize {
        self.chunk
    }
}

/// One datagram the driver received into a [`Lent`] buffer: its first
/// [`DATA_HEADER_LEN`](super::header::DATA_HEADER_LEN) bytes (`head`), its
/// payload at `buf[at..at + len]`, its trailer.
#[derive(Debug, Clone, Copy)]
pub struct Landed<'a> {
    /// The datagram's header bytes.
    pub head: &'a [u8],
    /// Where its payload starts in the lent buffer.
    pub at: usize,
    /// Its payload length.
    pub len: usize,
    /// Its trailer (CRC or MAC, as the connection's guard is).
    pub trailer: super::seal::Trailer,
}

/// Where the buffer of a received message comes from (one that spans
/// several datagrams, or a one-datagram message copied out of the receive
/// buffer), and how it is handed over once whole. Without one, each such
/// message gets a fresh `Vec`; a driver can recycle large buffers instead,
/// since faulting in fresh pages costs more than the copy at these sizes
/// ([`Connection::set_buffers`](super::Connection::set_buffers)).
pub trait Buffers: Send + Sync {
    /// An empty buffer with room for at least `len` bytes.
    fn take(&self, len: usize) -> Vec<u8>;
    /// The whole message, as handed to the owner in
    /// [`Event::Message`].
    fn freeze(&self, buf: Vec<u8>) -> Bytes;
    /// Take back a buffer a message outgrew (its contents were copied to
    /// a larger one). The default drops it.
    fn recycle(&self, buf: Vec<u8>) {
        drop(buf);
    }
}

/// Rebuilds messages from in-order chunks and checks the framing.
struct Reassembly {
    next_msg: u64,
    /// Messages of one datagram may still come before the next large one:
    /// set to 2 when a message spanning several datagrams completes, one
    /// less after each message of one datagram (a large transport message
    /// travels as a small head, then its body).
    large_recent: u8,
    partial: Option<Partial>,
    max_message: u64,
    /// Most bytes reserved for a message before its data arrives: a
    /// receive window's payload, which the peer may legitimately have in
    /// flight. A larger message grows by doubling as data comes, so a
    /// lying `total_len` reserves nothing that data does not back.
    reserve_max: usize,
    buffers: Option<Arc<dyn Buffers>>,
}

impl Reassembly {
    /// Takes the next in-order chunk. Returns a message when this chunk
    /// completes one, or why the chunk breaks the framing. `owned` is the
    /// same bytes as `payload` when already in a `Bytes`, to avoid a copy.
    fn accept(
        &mut self,
        c: Chunk,
        payload: &[u8],
        owned: Option<&Bytes>,
    ) -> Result<Option<Bytes>, &'static str> {
        let Some(p) = &mut self.partial else {
            if c.msg_id != self.next_msg {
                return Err("unexpected message id");
            }
            if c.offset != 0 {
                return Err("message does not start at offset 0");
            }
            if c.total_len > self.max_message {
                return Err("message larger than max_message");
            }
            if payload.len() as u64 == c.total_len {
                self.next_msg = self.next_msg.wrapping_add(1);
                self.large_recent = self.large_recent.saturating_sub(1);
                let msg = owned.cloned().unwrap_or_else(|| self.copy(payload));
                return Ok(Some(msg));
            }
            let total = usize::try_from(c.total_len).map_err(|_| "message too large")?;
            let mut buf = match &self.buffers {
                // One buffer for the whole message: no copy when growing.
                Some(b) if total <= self.reserve_max => b.take(total),
                _ if total <= self.reserve_max => Vec::with_capacity(total),
                _ => Vec::new(),
            };
            grow(&mut buf, payload.len(), total, self.buffers.as_deref());
            buf.extend_from_slice(payload);
            self.partial = Some(Partial {
                id: c.msg_id,
                total: c.total_len,
                buf,
                chunk: payload.len(),
            });
            return Ok(None);
        };
        if c.msg_id != p.id || c.total_len != p.total || c.offset != p.buf.len() as u64 {
            return Err("chunk does not continue the message being reassembled");
        }
        let total = usize::try_from(p.total).map_err(|_| "message too large")?;
        grow(&mut p.buf, payload.len(), total, self.buffers.as_deref());
        p.buf.extend_from_slice(payload);
        p.chunk = payload.len();
        if (p.buf.len() as u64) < p.total {
            return Ok(None);
        }
        self.next_msg = self.next_msg.wrapping_add(1);
        self.large_recent = 2;
        Ok(self.partial.take().map(|p| self.finish(p.buf)))
    }

    /// A whole one-datagram message, copied out of the receive buffer
    /// into a pooled buffer: a fresh 4–64 KiB allocation per message made
    /// the allocator trim and regrow its heap (a page fault per 4 KiB).
    fn copy(&self, payload: &[u8]) -> Bytes {
        match &self.buffers {
            Some(b) => {
                let mut buf = b.take(payload.len());
                buf.extend_from_slice(payload);
                b.freeze(buf)
            }
            None => Bytes::copy_from_slice(payload),
        }
    }

    fn finish(&self, buf: Vec<u8>) -> Bytes {
        match &self.buffers {
            Some(b) => b.freeze(buf),
            None => Bytes::from(buf),
        }
    }
}

/// Makes room for `extra` more bytes, doubling, but never reserving past
/// `total` (the decoder guarantees offset + length <= total). With a
/// buffer source, the larger buffer comes from it and the outgrown one
/// goes back to it: growing by reallocation gave every large message on a
/// small-datagram path fresh pages to fault in (a fifth of the receiver's
/// time at 1 MiB over 1472-byte datagrams).
fn grow(buf: &mut Vec<u8>, extra: usize, total: usize, src: Option<&dyn Buffers>) {
    let need = buf.len().saturating_add(extra);
    if need <= buf.capacity() {
        return;
    }
    let target = (buf.capacity().saturating_mul(2))
        .max(FIRST_RESERVE)
        .min(total)
        .max(need);
    match src {
        Some(src) => {
            let mut bigger = src.take(target);
            bigger.extend_from_slice(buf);
            let old = std::mem::replace(buf, bigger);
            if old.capacity() > 0 {
                src.recycle(old);
            }
        }
        None => buf.reserve_exact(target - buf.len()),
    }
}

pub(super) struct RecvSide {
    /// Next sequence number expected in order.
    nxt: Seq,
    window: u64,
    /// `slots[i]` holds sequence number `nxt + i`; `slots[0]`, when present,
    /// is always empty (it is the hole).
    slots: VecDeque<Option<Stored>>,
    buffered: u64,
    reasm: Reassembly,
    ack_every: u32,
    ack_delay: Duration,
    reply_ack_delay: Duration,
    /// When the pending ACK must go out, if one is pending.
    ack_deadline: Option<Instant>,
    /// In-order segments received since the last ACK went out.
    since_ack: u32,
    /// ACK-only packets owed, one per out-of-order arrival (capped): these
    /// are the duplicate ACKs that drive the peer's fast retransmit.
    owed_acks: u32,
    owed_cap: u32,
    /// Whether ACK-only packets carry SACK blocks ([`Config::sack`]).
    sack: bool,
    /// The reassembly buffer is lent ([`RecvSide::lend`]): DATA is refused
    /// until it is back.
    lent: bool,
    /// The highest sequence number dropped for lying beyond the window, while
    /// `nxt` has not passed it: the peer's window overran ours, so there is
    /// a hole at `nxt` although nothing is buffered (see `has_gap`).
    overrun: Option<Seq>,
}

impl RecvSide {
    pub fn new(cfg: &Config, peer_isn: u64) -> Self {
        RecvSide {
            nxt: Seq(peer_isn),
            window: u64::from(cfg.recv_window),
            slots: VecDeque::new(),
            buffered: 0,
            overrun: None,
            reasm: Reassembly {
                next_msg: 0,
                large_recent: 0,
                partial: None,
                max_message: cfg.max_message,
                reserve_max: (cfg.recv_window as usize).saturating_mul(cfg.chunk_payload()),
                buffers: None,
            },
            ack_every: cfg.ack_every,
            ack_delay: cfg.ack_delay,
            reply_ack_delay: cfg.reply_ack_delay.min(cfg.ack_delay),
            ack_deadline: None,
            since_ack: 0,
            owed_acks: 0,
            owed_cap: cfg.dup_ack_threshold,
            sack: cfg.sack,
            lent: false,
        }
    }

    /// Use `b` for the buffers of received messages (multi-datagram ones,
    /// and the copies of one-datagram ones).
    pub fn set_buffers(&mut self, b: Arc<dyn Buffers>) {
        self.reasm.buffers = Some(b);
    }

    /// The cumulative ACK to put on outgoing packets.
    pub fn ack_value(&self) -> u64 {
        self.nxt.0
    }

    /// Whether our ACK points at a hole: out-of-order data is held, or data
    /// beyond the window was dropped (the peer's window is larger than
    /// ours). The flag on our ACKs makes the peer count duplicates and
    /// resend at each partial ACK, instead of waiting for its timer once
    /// per segment.
    pub fn has_gap(&self) -> bool {
        self.buffered > 0 || self.overrun.is_some()
    }

    /// `nxt` moved: forget an overrun it passed.
    fn advanced(&mut self) {
        if self.overrun.is_some_and(|h| h.is_before(self.nxt)) {
            self.overrun = None;
        }
    }

    fn ack_now(&mut self, now: Instant) {
        self.ack_by(now);
    }

    /// Make sure the pending ACK goes out by `t` at the latest.
    fn ack_by(&mut self, t: Instant) {
        self.ack_deadline = Some(self.ack_deadline.map_or(t, |d| d.min(t)));
    }

    fn owe_ack(&mut self) {
        self.owed_acks = (self.owed_acks + 1).min(self.owed_cap);
    }

    /// Processes one DATA segment: `hdr` is its header, `chunk` its position
    /// (from `hdr.kind`).
    pub fn on_data(
        &mut self,
        now: Instant,
        hdr: &Header,
        chunk: Chunk,
        payload: &[u8],
        events: &mut VecDeque<Event>,
        stats: &mut Stats,
    ) {
        if self.lent {
            // A driver bug: nothing may be fed while the buffer is out.
            stats.protocol_errors += 1;
            return;
        }
        let Ok(dist) = u64::try_from(Seq(hdr.seq).diff(self.nxt)) else {
            // Already delivered: our ACK was probably lost; repeat it.
            stats.duplicates_dropped += 1;
            self.ack_now(now);
            return;
        };
        if dist >= self.window {
            stats.out_of_window_dropped += 1;
            // (Only as far as an honest sender can be ahead: a stray or
            // forged datagram from far off must not keep the flag up.)
            let seq = Seq(hdr.seq);
            if dist < self.window + u64::from(MAX_WINDOW)
                && self.overrun.map_or(true, |h| h.is_before(seq))
            {
                self.overrun = Some(seq);
            }
            self.ack_now(now);
            return;
        }
        if dist > 0 {
            self.store(now, dist as usize, hdr, chunk, payload, stats);
            return;
        }
        match self.reasm.accept(chunk, payload, None) {
            Ok(msg) => deliver(msg, events, stats),
            Err(_) => {
                stats.protocol_errors += 1;
                return;
            }
        }
        stats.data_received += 1;
        self.nxt = self.nxt.wrapping_add(1);
        self.advanced();
        self.slots.pop_front();
        self.since_ack += 1;
        let filled = self.drain_buffered(events, stats);
        self.schedule_ack(now, hdr, filled);
    }

    /// When to acknowledge after the in-order segment `hdr`; `filled`: it
    /// filled a hole.
    fn schedule_ack(&mut self, now: Instant, hdr: &Header, filled: bool) {
        let asked = hdr.flags.contains(Flags::ACK_NOW);
        if filled
            || self.overrun.is_some()
            || self.since_ack >= self.ack_every
            || (asked && hdr.flags.contains(Flags::RETRANSMIT))
        {
            self.ack_now(now);
        } else if asked {
            // The tail of what the peer could send: it waits for this ACK,
            // but a reply sent within `reply_ack_delay` carries it for free.
            self.ack_by(now.checked_add(self.reply_ack_delay).unwrap_or(now));
        } else if self.ack_deadline.is_none() {
            self.ack_deadline = now.checked_add(self.ack_delay);
        }
    }

    /// Lend the buffer of the message being reassembled, with room for at
    /// least `chunks` more of its chunks reserved where the message allows
    /// (growing as [`grow`] does: at most about twice what arrived, or the
    /// chunks asked for, never past the stated length; so a lying length
    /// reserves no more than data backs). `None` when no message is
    /// half-received.
    pub fn lend(&mut self, chunks: usize) -> Option<Lent> {
        if self.lent {
            return None;
        }
        let total = usize::try_from(self.reasm.partial.as_ref()?.total).ok()?;
        let mut p = self.reasm.partial.take()?;
        self.lent = true;
        let want = chunks.saturating_mul(p.chunk);
        let more = want.min(total.saturating_sub(p.buf.len()));
        grow(&mut p.buf, more, total, self.reasm.buffers.as_deref());
        Some(Lent {
            filled: p.buf.len(),
            buf: p.buf,
            id: p.id,
            total: p.total,
            chunk: p.chunk,
        })
    }

    /// Whether no message is half-received, and one of the last two
    /// spanned several datagrams: the next data datagram probably starts
    /// another such message, and once it is in, the rest can be lent.
    pub fn between_large(&self) -> bool {
        self.reasm.partial.is_none() && !self.lent && self.reasm.large_recent > 0
    }

    /// Whether the DATA datagram `hdr` carries the next chunk of the lent
    /// message, landed where it belongs (`at`).
    pub fn fits_lent(&self, hdr: &Header, lent: &Lent, at: usize) -> bool {
        // The slot after the hole may hold a segment that came early (the
        // next message's head, overtaking on the priority channel): it goes
        // first, through the usual path, once the buffer is back.
        !matches!(self.slots.front(), Some(Some(_)))
            && matches!(hdr.kind, Kind::Data(c)
            if Seq(hdr.seq) == self.nxt
                && c.msg_id == lent.id
                && c.total_len == lent.total
                && c.offset == lent.filled as u64
                && at == lent.filled)
    }

    /// Take a chunk of `len` bytes that [`fits_lent`](Self::fits_lent):
    /// the same bookkeeping as an in-order chunk in [`on_data`](Self::on_data).
    /// Returns whether it completed the message.
    pub fn take_lent(
        &mut self,
        now: Instant,
        hdr: &Header,
        lent: &mut Lent,
        len: usize,
        stats: &mut Stats,
    ) -> bool {
        lent.filled += len;
        lent.chunk = len;
        stats.data_received += 1;
        self.nxt = self.nxt.wrapping_add(1);
        self.advanced();
        self.slots.pop_front();
        self.since_ack += 1;
        self.schedule_ack(now, hdr, false);
        lent.filled as u64 >= lent.total
    }

    /// Take back a lent buffer: bytes past what was taken are dropped; a
    /// complete message is delivered, then segments that came early and
    /// are now in order.
    pub fn restore(
        &mut self,
        now: Instant,
        mut lent: Lent,
        events: &mut VecDeque<Event>,
        stats: &mut Stats,
    ) {
        self.lent = false;
        lent.buf.truncate(lent.filled);
        if lent.filled as u64 >= lent.total {
            self.reasm.next_msg = self.reasm.next_msg.wrapping_add(1);
            self.reasm.large_recent = 2;
            let msg = self.reasm.finish(lent.buf);
            deliver(Some(msg), events, stats);
        } else {
            self.reasm.partial = Some(Partial {
                id: lent.id,
                total: lent.total,
                buf: lent.buf,
                chunk: lent.chunk,
            });
        }
        if self.drain_buffered(events, stats) {
            // A hole was filled, as in `on_data`.
            self.ack_now(now);
        }
    }

    /// Buffers an out-of-order segment `idx` places past the hole.
    fn store(
        &mut self,
        now: Instant,
        idx: usize,
        hdr: &Header,
        chunk: Chunk,
        payload: &[u8],
        stats: &mut Stats,
    ) {
        if self.slots.len() <= idx {
            self.slots.resize_with(idx + 1, || None);
        }
        if hdr.flags.contains(Flags::PRIORITY) {
            // Overtook the data channel, as priority packets may: no
            // duplicate ACK, just make sure an ACK goes out in time.
            if self.ack_deadline.is_none() {
                self.ack_deadline = now.checked_add(self.ack_delay);
            }
        } else {
            self.owe_ack();
        }
        match self.slots.get_mut(idx) {
            Some(slot @ None) => {
                *slot = Some(Stored {
                    chunk,
                    payload: Bytes::copy_from_slice(payload),
                });
                self.buffered += 1;
                stats.data_received += 1;
                stats.out_of_order += 1;
            }
            _ => stats.duplicates_dropped += 1,
        }
    }

    /// Delivers buffered segments that are now in order. Returns whether any
    /// were (a hole was filled).
    fn drain_buffered(&mut self, events: &mut VecDeque<Event>, stats: &mut Stats) -> bool {
        let mut filled = false;
        while let Some(slot) = self.slots.front_mut() {
            let Some(stored) = slot.take() else { break };
            self.buffered -= 1;
            match self
                .reasm
                .accept(stored.chunk, &stored.payload, Some(&stored.payload))
            {
                Ok(msg) => deliver(msg, events, stats),
                Err(_) => {
                    // Dropped; the slot is the hole again and the peer
                    // will have to resend it.
                    stats.protocol_errors += 1;
                    break;
                }
            }
            self.nxt = self.nxt.wrapping_add(1);
            self.slots.pop_front();
            self.since_ack += 1;
            filled = true;
        }
        self.advanced();
        filled
    }

    /// SACK blocks for an ACK-only packet: the lowest runs of buffered
    /// segments past the hole, in ascending order, at most
    /// [`MAX_SACK_BLOCKS`](super::header::MAX_SACK_BLOCKS). Lowest first, and consecutive, so that every
    /// sequence number between the cumulative ACK and the end of the last
    /// block that no block covers is certainly missing: the sender can
    /// resend exactly those, never one the receiver holds but did not
    /// mention. Those are also the holes that hold the window back. Empty
    /// when SACK is off or nothing is buffered. Costs at most one pass over
    /// the receive window.
    pub fn sack_blocks(&self) -> Sack {
        let mut out = Sack::EMPTY;
        if !self.sack || self.buffered == 0 {
            return out;
        }
        let mut i = 0;
        while i < self.slots.len() {
            if self.slots[i].is_none() {
                i += 1;
                continue;
            }
            let start = i;
            while self.slots.get(i).is_some_and(Option::is_some) {
                i += 1;
            }
            let block = SackBlock {
                start: self.nxt.wrapping_add(start as u64).0,
                // Runs are shorter than the receive window (at most 2^20).
                len: u32::try_from(i - start).unwrap_or(u32::MAX),
            };
            if !out.push(block) {
                break;
            }
        }
        out
    }

    /// Whether an ACK-only packet owed for out-of-order data is pending;
    /// consumes it.
    pub fn take_owed_ack(&mut self) -> bool {
        if self.owed_acks == 0 {
            return false;
        }
        self.owed_acks -= 1;
        true
    }

    /// Whether an ACK-only packet is owed now: for out-of-order data, or a
    /// delayed ACK that fell due at `now`.
    pub fn ack_owed(&self, now: Instant) -> bool {
        self.owed_acks > 0 || self.ack_due(now)
    }

    /// Whether the delayed ACK is due at `now`.
    pub fn ack_due(&self, now: Instant) -> bool {
        self.ack_deadline.is_some_and(|d| d <= now)
    }

    /// Records that the current ACK went out (piggy-backed or alone).
    pub fn ack_sent(&mut self) {
        self.since_ack = 0;
        self.ack_deadline = None;
    }

    /// When the delayed ACK falls due.
    pub fn deadline(&self) -> Option<Instant> {
        self.ack_deadline
    }

    /// Whether nothing is owed to the peer.
    pub fn is_idle(&self) -> bool {
        self.ack_deadline.is_none() && self.owed_acks == 0
    }

    pub fn fill_stats(&self, stats: &mut Stats) {
        stats.recv_base = self.nxt.0;
        stats.recv_buffered = self.buffered;
    }
}

fn deliver(msg: Option<Bytes>, events: &mut VecDeque<Event>, stats: &mut Stats) {
    if let Some(msg) = msg {
        stats.messages_delivered += 1;
        stats.bytes_delivered += msg.len() as u64;
        events.push_back(Event::Message(msg));
    }
}

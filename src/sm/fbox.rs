//! The fast box: one mailbox per (sender, receiver) pair for small user
//! messages, in the spirit of Open MPI's vader fast boxes.
//!
//! The ring path costs a small message several cache lines between the two
//! cores (ring slot, ring index, fragment header and payload, the return
//! ring and its index). A fast-box message of up to 48 bytes costs one: its
//! header and payload share a 64-byte slot, the receiver polls the slot
//! itself, and nothing comes back per message (the receiver publishes how
//! far it read on a line of its own, which the sender re-reads only when it
//! believes the box is full).
//!
//! Layout (in the receiver's segment; marks, tag, length and `consumed`
//! are accessed atomically, payload bytes by bulk copies that the marks
//! order: the sender writes a slot's payload only after the receiver
//! released it, the receiver reads it only after its head mark):
//!
//! ```text
//! word 0        consumed: slots the receiver is done with (written by the receiver)
//! word 1        the pair's split-copy word (`sm::split`; not used by the box)
//! word 2        the pair's rendezvous-done word: the last rendezvous handle
//!               whose data the receiver copied (written by the receiver;
//!               not used by the box)
//! words 8 ..    slots of 8 words (64 bytes):
//!   first slot of a message:  mark(HEAD) with the length in it, tag,
//!     6 payload words (mark(RNDV) for a rendezvous announcement, see
//!     `sm::rendezvous`)
//!   each further slot:        mark(CONT), 7 payload words
//!   a slot that sends the receiver back to slot 0: mark(SKIP)
//! ```
//!
//! Slots are numbered from 0 across laps; slot `n` sits at `n % slots` and
//! its mark is `(n + 1) << 16 | kind` (48 bits of number), a head mark
//! also carrying the message's length in bits 4-15 (the length has no word
//! of its own: a 41-48-byte message then fits one slot, where a second
//! slot costs it about 0.1 µs of half round trip). The sender writes
//! a mark into the first word of *every* slot it uses, so that word only
//! ever holds a mark: what the receiver finds where it expects the next
//! message is either that message's head (with the number it expects) or
//! an older mark — user bytes can never pass for a header. Payload words
//! are written first, the head mark last (Release), and the receiver loads
//! the head mark with Acquire.
//!
//! Order with the ring path: per pair, at most one of the two paths holds
//! unconsumed user messages at any time. The sender writes to the box only
//! when the pair's user ring is drained, and pushes to the ring only when the
//! box is drained; the receiver publishes either consumption (ring `head`,
//! box `consumed`) only under its receive lock, in the same critical section
//! as the delivery, so the next message on the other path cannot be
//! delivered first.

use crate::sys::mem::RawBuf;
use crate::sys::sync::{AtomicU64, Ordering};

/// Slots per box in a segment (16 KiB of slots).
pub(crate) const SLOTS: usize = 256;
/// Words per slot (one cache line).
pub(crate) const SLOT_WORDS: usize = 8;
/// Payload words in a message's first slot (after the mark, which holds
/// the length, and the tag).
const FIRST_WORDS: usize = 6;
/// Payload words in each further slot (after the mark).
const CONT_WORDS: usize = SLOT_WORDS - 1;
/// Largest payload a box carries (10 slots). Longer messages go through a
/// fragment: one contiguous copy each way, and a stream of them is not
/// held back by a box that holds only a couple of dozen (from 640 bytes a
/// fragment streamed 1.3-1.4 times the rate of the box, with a shorter
/// half round trip; at 512 bytes the box is still ahead).
pub(crate) const MAX_PAYLOAD: usize = 512;
/// Words before the first slot (the `consumed` counter on its own line).
const LEAD_WORDS: usize = 8;
/// Words in one box.
pub(crate) const BOX_WORDS: usize = LEAD_WORDS + SLOTS * SLOT_WORDS;
/// Bytes in one box.
pub(crate) const BOX_BYTES: usize = BOX_WORDS * 8;

/// Largest message of two slots (`FBox::push_two`, `FBox::take_small`).
pub(crate) const TWO_SLOTS: usize = FIRST_WORDS * 8 + CONT_WORDS * 8;

/// How many slots ahead of the next write a push prefetches for writing.
const PREFETCH_AHEAD: u64 = 8;

const SEQ_MASK: u64 = (1 << 48) - 1;
/// Where a head mark keeps the message's length (bits 4-15; the kind is in
/// bits 0-3).
const LEN_SHIFT: u32 = 4;
const LEN_BITS: u64 = 0xfff << LEN_SHIFT;
const _: () = assert!(MAX_PAYLOAD as u64 <= LEN_BITS >> LEN_SHIFT && RNDV < 1 << LEN_SHIFT);
const HEAD: u64 = 1;
const CONT: u64 = 2;
const SKIP: u64 = 3;
/// The head of a rendezvous announcement (its payload is the announcement).
const RNDV: u64 = 4;

fn mark(n: u64, kind: u64) -> u64 {
    (((n + 1) & SEQ_MASK) << 16) | kind
}

/// The mark of a message's first slot: [`mark`] with its length.
fn head_mark(n: u64, kind: u64, len: usize) -> u64 {
    mark(n, kind) | ((len as u64) << LEN_SHIFT) & LEN_BITS
}

/// Slots a message of `len` bytes takes.
fn slots_for(len: usize) -> u64 {
    if len <= FIRST_WORDS * 8 {
        return 1;
    }
    let rest = len.saturating_sub(FIRST_WORDS * 8);
    1 + rest.div_ceil(CONT_WORDS * 8) as u64
}

/// Store `bytes` into the first `ceil(len / 8)` of `words`, little-endian,
/// the last word zero-padded (`words` has the room: callers size it by
/// the slot layout; extra bytes would be dropped, never written past).
#[inline]
fn store_words(words: &[AtomicU64], bytes: &[u8]) {
    // Whole words by fixed-size chunks, then the zero-padded rest: a loop
    // the compiler unrolls in place (a zip over `chunks(8)` compiled to an
    // out-of-line call on every small send).
    let mut whole = bytes.chunks_exact(8);
    let mut at = 0;
    for chunk in whole.by_ref() {
        let Some(word) = words.get(at) else { return };
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        word.store(u64::from_le_bytes(b), Ordering::Relaxed);
        at += 1;
    }
    let rest = whole.remainder();
    if let (false, Some(word)) = (rest.is_empty(), words.get(at)) {
        let mut last = [0u8; 8];
        last[..rest.len()].copy_from_slice(rest);
        word.store(u64::from_le_bytes(last), Ordering::Relaxed);
    }
}

/// Append the first `len` bytes that [`store_words`] stored in `words` to
/// `out` (whole words by fixed-size appends).
#[inline]
fn load_words(words: &[AtomicU64], len: usize, out: &mut Vec<u8>) {
    let mut left = len;
    for word in words {
        if left == 0 {
            break;
        }
        let b = word.load(Ordering::Relaxed).to_le_bytes();
        if left >= 8 {
            out.extend_from_slice(&b);
            left -= 8;
        } else {
            out.extend_from_slice(&b[..left]);
            left = 0;
        }
    }
}

/// A peer's counter or header is impossible (it scribbled on the box).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Corrupt;

/// The words of one box.
#[derive(Clone, Copy)]
pub(crate) struct FBox<'a> {
    words: &'a [AtomicU64],
    /// The same memory as `words`, for the payload copies.
    raw: RawBuf,
    slots: u64,
    /// `slots` is a power of two (always in a segment): positions are
    /// masked, not divided (a 64-bit `div` per slot access costs tens of
    /// cycles on every poll and push).
    pow2: bool,
}

/// Sender-private state of one box.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Sender {
    /// Next slot number to write.
    next: u64,
    consumed_cache: u64,
}

/// Receiver-private state of one box.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Receiver {
    /// Next slot number to read.
    next: u64,
}

/// What [`FBox::take_small`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    /// Took a message of this many bytes.
    Took(usize),
    /// Nothing waits.
    Empty,
    /// Something waits that `take_small` leaves to `peek`.
    Other,
}

/// A message found in a box.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) tag: u64,
    pub(crate) len: usize,
    /// A rendezvous announcement, not a user message.
    pub(crate) rndv: bool,
}

impl<'a> FBox<'a> {
    /// A box over `words`: the lead words and a whole number of slots
    /// ([`BOX_WORDS`] in a segment; fewer slots in model tests). `raw` must
    /// be the same memory (checked: same address and length).
    pub(crate) fn new(words: &'a [AtomicU64], raw: RawBuf) -> Option<FBox<'a>> {
        let body = words.len().checked_sub(LEAD_WORDS)?;
        let slots = (body / SLOT_WORDS) as u64;
        // (Under loom the words are models, not memory: only they are used.)
        let same = cfg!(btl_loom)
            || (raw.addr() == words.as_ptr() as usize && raw.len() == words.len() * 8);
        (same && body % SLOT_WORDS == 0 && slots >= 1).then_some(FBox {
            words,
            raw,
            slots,
            pow2: slots.is_power_of_two(),
        })
    }

    /// Where slot number `n` sits: `n % slots`.
    fn pos(&self, n: u64) -> u64 {
        if self.pow2 {
            n & (self.slots - 1)
        } else {
            n % self.slots
        }
    }

    /// Byte offset in the box of word `w` of slot `n`.
    fn offset(&self, n: u64, w: usize) -> u64 {
        ((LEAD_WORDS + self.pos(n) as usize * SLOT_WORDS + w) * 8) as u64
    }

    /// The payload byte ranges (offset in the box, length) of a message of
    /// `len` bytes whose first slot is `n`: the rest of the first slot
    /// after mark, tag and length, then each further slot after its mark.
    #[cfg(btl_loom)]
    fn payload_ranges(&self, n: u64, len: usize) -> impl Iterator<Item = (u64, usize)> + 'a {
        let me = *self;
        let first = (
            me.offset(n, SLOT_WORDS - FIRST_WORDS),
            len.min(FIRST_WORDS * 8),
        );
        let rest = len.saturating_sub(FIRST_WORDS * 8);
        let conts = (0..rest.div_ceil(CONT_WORDS * 8)).map(move |i| {
            let done = i * CONT_WORDS * 8;
            (
                me.offset(n + 1 + i as u64, 1),
                (rest - done).min(CONT_WORDS * 8),
            )
        });
        std::iter::once(first).chain(conts)
    }

    fn slot(&self, n: u64) -> &'a [AtomicU64] {
        let start = LEAD_WORDS + self.pos(n) as usize * SLOT_WORDS;
        &self.words[start..start + SLOT_WORDS]
    }

    /// Copy a message's payload into its slots from slot `n`: the rest of
    /// the first slot, then 56 bytes after each further slot's mark, with
    /// fixed-size copies (in range: `offset` stays inside the box for any
    /// slot number, and a message never runs past the last slot; the
    /// copies check again and write nothing out of range).
    #[cfg(not(btl_loom))]
    fn payload_in(&self, n: u64, data: &[u8]) {
        let (first, rest) = data.split_at(data.len().min(FIRST_WORDS * 8));
        let _ = self
            .raw
            .write_strided::<{ FIRST_WORDS * 8 }, { FIRST_WORDS * 8 }>(
                self.offset(n, SLOT_WORDS - FIRST_WORDS),
                first,
            );
        if !rest.is_empty() {
            let _ = self
                .raw
                .write_strided::<{ CONT_WORDS * 8 }, { SLOT_WORDS * 8 }>(
                    self.offset(n + 1, 1),
                    rest,
                );
        }
    }

    /// The payload of `len` bytes from slot `n`, in a new vector (as
    /// [`FBox::payload_out`], without zeroing the vector first).
    #[inline]
    fn payload_vec(&self, n: u64, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len);
        self.payload_into(n, len, &mut v);
        v
    }

    /// The payload of `len` bytes from slot `n`, appended to `v` (no
    /// allocation where `v` has the room).
    #[cfg(not(btl_loom))]
    #[inline]
    fn payload_into(&self, n: u64, len: usize, v: &mut Vec<u8>) {
        let start = v.len();
        let first = len.min(FIRST_WORDS * 8);
        let _ = self
            .raw
            .read_strided_into::<{ FIRST_WORDS * 8 }, { FIRST_WORDS * 8 }>(
                self.offset(n, SLOT_WORDS - FIRST_WORDS),
                first,
                v,
            );
        if len > first {
            let _ = self
                .raw
                .read_strided_into::<{ CONT_WORDS * 8 }, { SLOT_WORDS * 8 }>(
                    self.offset(n + 1, 1),
                    len - first,
                    v,
                );
        }
        // (Both reads are in range for a message `peek` found.)
        debug_assert_eq!(v.len() - start, len);
    }

    #[cfg(btl_loom)]
    fn payload_into(&self, n: u64, len: usize, v: &mut Vec<u8>) {
        let start = v.len();
        v.resize(start + len, 0);
        self.payload_out(n, &mut v[start..]);
    }

    /// The inverse of [`FBox::payload_in`].
    #[cfg(not(btl_loom))]
    fn payload_out(&self, n: u64, out: &mut [u8]) {
        let (first, rest) = out.split_at_mut(out.len().min(FIRST_WORDS * 8));
        let _ = self
            .raw
            .read_strided::<{ FIRST_WORDS * 8 }, { FIRST_WORDS * 8 }>(
                self.offset(n, SLOT_WORDS - FIRST_WORDS),
                first,
            );
        if !rest.is_empty() {
            let _ = self
                .raw
                .read_strided::<{ CONT_WORDS * 8 }, { SLOT_WORDS * 8 }>(
                    self.offset(n + 1, 1),
                    rest,
                );
        }
    }

    #[cfg(btl_loom)]
    fn payload_in(&self, n: u64, data: &[u8]) {
        let mut at = 0;
        for (off, len) in self.payload_ranges(n, data.len()) {
            self.copy_in(off, &data[at..at + len]);
            at += len;
        }
    }

    #[cfg(btl_loom)]
    fn payload_out(&self, n: u64, out: &mut [u8]) {
        let mut at = 0;
        for (off, len) in self.payload_ranges(n, out.len()) {
            self.copy_out(off, &mut out[at..at + len]);
            at += len;
        }
    }

    /// Under loom, payload words are models too: copy word by word (`off`
    /// and lengths are whole words except a message's last piece).
    #[cfg(btl_loom)]
    fn copy_in(&self, off: u64, data: &[u8]) {
        let first = off as usize / 8;
        for (i, chunk) in data.chunks(8).enumerate() {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.words[first + i].store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
    }

    #[cfg(btl_loom)]
    fn copy_out(&self, off: u64, out: &mut [u8]) {
        let first = off as usize / 8;
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            let b = self.words[first + i].load(Ordering::Relaxed).to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }

    fn consumed(&self) -> &'a AtomicU64 {
        &self.words[0]
    }

    /// The pair's split-copy word (see `sm::split`), which shares the box's
    /// lead line: both are per-pair words in the receiver's segment. (The
    /// sender may keep filling the box behind a split rendezvous announced
    /// in it, so both sides write this line meanwhile: a cost only while a
    /// split copy of 64 KiB or more runs.)
    pub(crate) fn split_word(&self) -> &'a AtomicU64 {
        &self.words[1]
    }

    /// The pair's rendezvous-done word: the receiver stores (Release) the
    /// handle of each rendezvous whose data it copied, in announcement
    /// order; the sender loads it (Acquire) and completes every handle up
    /// to it. (A refused rendezvous is answered on the control ring, and
    /// the receiver goes on only once its data came, so the word never
    /// passes a refusal the sender has not seen.)
    pub(crate) fn rndv_done_word(&self) -> &'a AtomicU64 {
        &self.words[2]
    }

    /// Re-read how far the receiver got.
    fn refresh(&self, st: &mut Sender) -> Result<(), Corrupt> {
        // Acquire pairs with the receiver's Release store in `consume`: its
        // reads of the slots it released happen before we overwrite them.
        let c = self.consumed().load(Ordering::Acquire);
        if c > st.next || c < st.consumed_cache {
            return Err(Corrupt);
        }
        st.consumed_cache = c;
        Ok(())
    }

    fn free(&self, st: &Sender) -> u64 {
        self.slots - (st.next - st.consumed_cache)
    }

    /// Whether the receiver took every message we put in the box.
    pub(crate) fn drained(&self, st: &mut Sender) -> Result<bool, Corrupt> {
        if st.consumed_cache != st.next {
            self.refresh(st)?;
        }
        Ok(st.consumed_cache == st.next)
    }

    /// Whether the receiver took every message we put in the box, from a
    /// fresh look at its counter (for parking and drain checks).
    pub(crate) fn looks_drained(&self, st: &Sender) -> bool {
        st.consumed_cache == st.next || self.consumed().load(Ordering::Acquire) == st.next
    }

    /// Put a message in the box. `Ok(false)`: no room now (or the message is
    /// larger than [`MAX_PAYLOAD`], or too large for a box this small ever
    /// to take; a segment's box takes every message up to `MAX_PAYLOAD`).
    ///
    /// With `stream`, the push also prefetches the lines of the next slots
    /// for writing: worth it when messages follow each other (the receiver
    /// is behind), a loss in a ping-pong (the receiver polls the box, and
    /// 8 B half round trips take about 0.1 µs longer).
    #[inline]
    pub(crate) fn push(
        &self,
        st: &mut Sender,
        tag: u64,
        data: &[u8],
        stream: bool,
    ) -> Result<bool, Corrupt> {
        if st.next == 0 {
            self.touch_pages();
        }
        if data.len() <= FIRST_WORDS * 8 {
            return self.push_one(st, HEAD, tag, data, stream);
        }
        if data.len() <= TWO_SLOTS && self.pos(st.next) + 2 <= self.slots {
            return self.push_two(st, tag, data, stream);
        }
        self.push_as(st, HEAD, tag, data, stream)
    }

    /// [`FBox::push_as`] for a message that fits in its first slot (up to
    /// 48 bytes): one slot, which never has to skip to the box's start,
    /// and the payload stored word by word (for 8 bytes, one store) rather
    /// than through a strided copy. The common small send; it costs a
    /// third of the instructions of the general push.
    #[inline]
    fn push_one(
        &self,
        st: &mut Sender,
        kind: u64,
        tag: u64,
        data: &[u8],
        stream: bool,
    ) -> Result<bool, Corrupt> {
        // (`refresh` keeps consumed_cache <= next.)
        if st.next - st.consumed_cache >= self.slots {
            self.refresh(st)?;
            if st.next - st.consumed_cache >= self.slots {
                return Ok(false);
            }
        }
        let n = st.next;
        let slot = self.slot(n);
        slot[1].store(tag, Ordering::Relaxed);
        store_words(&slot[SLOT_WORDS - FIRST_WORDS..], data);
        st.next = n + 1;
        // Release pairs with the receiver's Acquire load in `peek`, as in
        // `push_as`.
        slot[0].store(head_mark(n, kind, data.len()), Ordering::Release);
        // The prefetch of `push_as`, for one slot.
        if stream && self.free(st) > PREFETCH_AHEAD {
            self.raw
                .prefetch_write(self.offset(st.next + PREFETCH_AHEAD, 0));
        }
        Ok(true)
    }

    /// [`FBox::push_as`] for a user message of 49 to [`TWO_SLOTS`] bytes
    /// whose two slots fit before the end of the box (the caller checked):
    /// no skip, and the payload stored as words, as in `push_one`.
    #[inline]
    fn push_two(
        &self,
        st: &mut Sender,
        tag: u64,
        data: &[u8],
        stream: bool,
    ) -> Result<bool, Corrupt> {
        if st.next - st.consumed_cache + 2 > self.slots {
            self.refresh(st)?;
            if st.next - st.consumed_cache + 2 > self.slots {
                return Ok(false);
            }
        }
        let n = st.next;
        let (first, rest) = data.split_at(data.len().min(FIRST_WORDS * 8));
        let cont = self.slot(n + 1);
        cont[0].store(mark(n + 1, CONT), Ordering::Relaxed);
        store_words(&cont[1..], rest);
        let head = self.slot(n);
        head[1].store(tag, Ordering::Relaxed);
        store_words(&head[SLOT_WORDS - FIRST_WORDS..], first);
        st.next = n + 2;
        // Release pairs with the receiver's Acquire load in `peek`: both
        // slots' words are visible before the head mark.
        head[0].store(head_mark(n, HEAD, data.len()), Ordering::Release);
        if stream {
            let free = self.free(st);
            for i in PREFETCH_AHEAD..(PREFETCH_AHEAD + 2).min(free) {
                self.raw.prefetch_write(self.offset(st.next + i, 0));
            }
        }
        Ok(true)
    }

    /// Put a rendezvous announcement in the box (as [`FBox::push`]; the
    /// receiver's [`Found::rndv`] tells it apart).
    pub(crate) fn push_rendezvous(
        &self,
        st: &mut Sender,
        tag: u64,
        rts: &[u8],
    ) -> Result<bool, Corrupt> {
        if st.next == 0 {
            self.touch_pages();
        }
        self.push_as(st, RNDV, tag, rts, false)
    }

    fn push_as(
        &self,
        st: &mut Sender,
        kind: u64,
        tag: u64,
        data: &[u8],
        stream: bool,
    ) -> Result<bool, Corrupt> {
        let k = slots_for(data.len());
        // A message may need to skip up to k - 1 slots at the end first.
        if data.len() > MAX_PAYLOAD || 2 * k - 1 > self.slots {
            return Ok(false);
        }
        // Slots wasted to go back to slot 0 when the message would not fit
        // before the end of the box.
        let to_end = self.slots - self.pos(st.next);
        let skip = if k > to_end { to_end } else { 0 };
        if self.free(st) < k + skip {
            self.refresh(st)?;
            if self.free(st) < k + skip {
                return Ok(false);
            }
        }
        if skip > 0 {
            // Release: as for a head (nothing else to publish, but the
            // receiver's Acquire pairs with one store per position).
            self.slot(st.next)[0].store(mark(st.next, SKIP), Ordering::Release);
            st.next += skip;
        }
        let n = st.next;
        for i in 1..k {
            self.slot(n + i)[0].store(mark(n + i, CONT), Ordering::Relaxed);
        }
        let head = self.slot(n);
        head[1].store(tag, Ordering::Relaxed);
        self.payload_in(n, data);
        st.next += k;
        // Release pairs with the receiver's Acquire load in `peek`: every
        // word of the message stored above is visible before its head mark.
        head[0].store(head_mark(n, kind, data.len()), Ordering::Release);
        // Start taking the lines of the next messages' slots from the
        // receiver's cache now (free slots: it read them a lap ago), so the
        // next push's stores find them here. Otherwise every push waits for
        // the previous one's line at its first locked instruction (the `tx`
        // lock): 8 B streaming ran about 25% slower, 64 B 40%.
        if stream {
            let free = self.free(st);
            for i in PREFETCH_AHEAD..(PREFETCH_AHEAD + k).min(free) {
                self.raw.prefetch_write(self.offset(st.next + i, 0));
            }
        }
        Ok(true)
    }

    /// The next message's tag and length, if it is there. Steps over a
    /// skip mark (publishing it) on the way. `Err`: impossible length.
    #[inline]
    pub(crate) fn peek(&self, st: &mut Receiver) -> Result<Option<Found>, Corrupt> {
        // Acquire pairs with the sender's Release store of the mark in `push`.
        let mut head = self.slot(st.next);
        let mut m = head[0].load(Ordering::Acquire);
        if m == mark(st.next, SKIP) {
            st.next += self.slots - self.pos(st.next);
            self.consumed().store(st.next, Ordering::Release);
            head = self.slot(st.next);
            m = head[0].load(Ordering::Acquire);
        }
        // One comparison for the number (an older mark fails it), then the
        // kind.
        if m & !0xffff != mark(st.next, 0) {
            return Ok(None);
        }
        let rndv = match m & !LEN_BITS & 0xffff {
            HEAD => false,
            RNDV => true,
            _ => return Ok(None),
        };
        let len = (m & LEN_BITS) >> LEN_SHIFT;
        // A message of one slot always fits; a longer one must end before
        // the box does.
        if len > (FIRST_WORDS * 8) as u64
            && (len > MAX_PAYLOAD as u64
                || slots_for(len as usize) > self.slots - self.pos(st.next))
        {
            return Err(Corrupt);
        }
        Ok(Some(Found {
            tag: head[1].load(Ordering::Relaxed),
            len: len as usize,
            rndv,
        }))
    }

    /// The receive path's common case in one step: if the next message is
    /// a user message of one or two slots (up to 104 bytes) on `tag`,
    /// append its payload to `out` (cleared first if `clear`), release its
    /// slots and give its length. [`Take::Empty`] when nothing is there
    /// (what `peek` would call `None`); [`Take::Other`] for anything else
    /// (longer messages, other tags, announcements, a skip, the box's
    /// first message), which the caller leaves to `peek`; `out` is then
    /// left as it was. It reads the same words in the same order as
    /// `peek`, `read_into` and `consume` do, minus their calls and their
    /// cases for longer messages.
    #[inline(always)]
    pub(crate) fn take_small(
        &self,
        st: &mut Receiver,
        tag: u64,
        out: &mut Vec<u8>,
        clear: bool,
    ) -> Take {
        let head = self.slot(st.next);
        // Acquire pairs with the sender's Release store of the mark in `push`.
        let m = head[0].load(Ordering::Acquire);
        if m & !0xffff != mark(st.next, 0) {
            return Take::Empty;
        }
        let len = ((m & LEN_BITS) >> LEN_SHIFT) as usize;
        if m & !LEN_BITS != mark(st.next, HEAD)
            || len > TWO_SLOTS
            || st.next == 0
            || head[1].load(Ordering::Relaxed) != tag
        {
            return Take::Other;
        }
        let first = len.min(FIRST_WORDS * 8);
        let k = if len > first {
            // Its second slot must lie inside the box (`peek` reports a
            // message that runs past it).
            if self.pos(st.next) + 2 > self.slots {
                return Take::Other;
            }
            2
        } else {
            1
        };
        if clear {
            out.clear();
        }
        out.reserve(len);
        load_words(&head[SLOT_WORDS - FIRST_WORDS..], first, out);
        if k == 2 {
            // The payload words after the second slot's mark (ordered by
            // the head mark's Acquire, as in `read_into`).
            load_words(&self.slot(st.next + 1)[1..], len - first, out);
        }
        st.next += k;
        // Release pairs with the sender's Acquire load in `refresh`.
        self.consumed().store(st.next, Ordering::Release);
        if k == 2 {
            // As `consume` does for a stream of two-slot messages.
            self.raw.prefetch_read(self.offset(st.next + 1, 0), 8);
        }
        Take::Took(len)
    }

    /// Copy the payload of the message `peek` found into `out` (its length).
    pub(crate) fn read(&self, st: &Receiver, out: &mut [u8]) {
        self.payload_out(st.next, out);
    }

    /// The payload of the message `peek` found, of `len` bytes (its
    /// length), in a new vector.
    pub(crate) fn read_vec(&self, st: &Receiver, len: usize) -> Vec<u8> {
        self.payload_vec(st.next, len)
    }

    /// The payload of the message `peek` found, of `len` bytes, appended to
    /// `out` (a buffer a receiver lent).
    #[inline]
    pub(crate) fn read_into(&self, st: &Receiver, len: usize, out: &mut Vec<u8>) {
        if len <= FIRST_WORDS * 8 {
            // The inverse of `push_one`: word loads, no copy call (the
            // head mark's Acquire in `peek` ordered them). Longer messages
            // read faster by the strided copy than word by word.
            out.reserve(len);
            load_words(&self.slot(st.next)[SLOT_WORDS - FIRST_WORDS..], len, out);
            return;
        }
        self.payload_into(st.next, len, out);
    }

    /// Map every page of the box into this process now (a load from
    /// each), at the pair's first message on each side. A fresh box's pages
    /// are mapped on first touch, so the first lap through it would
    /// otherwise stop for a page fault every 64 slots, on both sides, in
    /// the middle of the traffic (on a virtual machine, several
    /// microseconds each, where an 8-byte round trip takes a fifth of one).
    /// Done at the first message rather than when the segment is mapped,
    /// a pair that never talks maps no more of its box than the page its
    /// receiver polls.
    fn touch_pages(&self) {
        const PAGE_WORDS: usize = 4096 / 8;
        for w in self
            .words
            .iter()
            .step_by(PAGE_WORDS)
            .chain(self.words.last())
        {
            std::hint::black_box(w.load(Ordering::Relaxed));
        }
    }

    /// Release the message `peek` found (of `len` bytes): the sender may
    /// reuse its slots.
    pub(crate) fn consume(&self, st: &mut Receiver, len: usize) {
        if st.next == 0 {
            self.touch_pages();
        }
        let k = slots_for(len);
        st.next += k;
        // Release pairs with the sender's Acquire load in `refresh`.
        self.consumed().store(st.next, Ordering::Release);
        if k == 2 {
            // A stream of two-slot messages (49 to 104 bytes): start on the
            // second line of the next one now. Its head line is what the
            // next look waits for, and the rest of that message would
            // only be fetched after it; a receiver a few messages behind
            // its sender then pays one line's wait per message, not two.
            self.raw.prefetch_read(self.offset(st.next + 1, 0), 8);
        }
    }

    /// Whether a message waits (a racy hint for parking, and the receive
    /// path's first look, which prefetches a long message's further slots).
    pub(crate) fn looks_empty(&self, st: &Receiver) -> bool {
        let m = self.slot(st.next)[0].load(Ordering::Acquire);
        let bare = m & !LEN_BITS;
        let empty =
            bare != mark(st.next, HEAD) && m != mark(st.next, SKIP) && bare != mark(st.next, RNDV);
        if !empty {
            // A message of several slots: start on its further lines now,
            // before the dispatcher's lock and the allocation that come
            // before its payload is read (half round trip of messages of
            // two slots or more 0.94-0.97x). Only a hint: `peek` checks the
            // length.
            let k = slots_for(((m & LEN_BITS) >> LEN_SHIFT) as usize);
            if k > 1 && k <= self.slots - self.pos(st.next) {
                let rest = (k as usize - 1) * SLOT_WORDS * 8;
                self.raw.prefetch_read(self.offset(st.next + 1, 0), rest);
            }
        }
        empty
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// A box in ordinary memory, for tests.
    pub(crate) struct OwnedBox(pub(crate) Vec<AtomicU64>);

    impl OwnedBox {
        pub(crate) fn new() -> Self {
            Self::with_slots(SLOTS)
        }
        pub(crate) fn with_slots(n: usize) -> Self {
            OwnedBox(
                (0..LEAD_WORDS + n * SLOT_WORDS)
                    .map(|_| AtomicU64::new(0))
                    .collect(),
            )
        }
        pub(crate) fn fbox(&self) -> FBox<'_> {
            // SAFETY: the vector's memory is valid for reads and writes while
            // `self` lives, which the returned box borrows. (Under loom the
            // words are models and the box never uses this range.)
            let raw = unsafe { RawBuf::new(self.0.as_ptr() as *mut u8, self.0.len() * 8) };
            FBox::new(&self.0, raw).expect("right size")
        }
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::testing::OwnedBox;
    use super::*;

    fn take(b: &FBox<'_>, r: &mut Receiver) -> Option<(u64, Vec<u8>)> {
        let f = b.peek(r).unwrap()?;
        let mut out = vec![0u8; f.len];
        b.read(r, &mut out);
        assert_eq!(b.read_vec(r, f.len), out, "both reads agree");
        // Appending, as into a buffer a receiver lent (word loads up to 48
        // bytes, strided copies above).
        let mut lent = vec![0xEE];
        b.read_into(r, f.len, &mut lent);
        assert_eq!(
            (lent[0], &lent[1..]),
            (0xEE, &out[..]),
            "appended read agrees"
        );
        b.consume(r, f.len);
        Some((f.tag, out))
    }

    #[test]
    fn messages_of_every_size_round_trip_in_order_across_laps() {
        let o = OwnedBox::new();
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        for lap in 0..3u64 {
            for len in 0..=MAX_PAYLOAD {
                let data: Vec<u8> = (0..len).map(|i| (i as u64 * 7 + lap) as u8).collect();
                assert!(b
                    .push(&mut s, lap * 10_000 + len as u64, &data, true)
                    .unwrap());
                assert_eq!(take(&b, &mut r), Some((lap * 10_000 + len as u64, data)));
            }
        }
        assert!(b.drained(&mut s).unwrap());
        assert_eq!(b.peek(&mut r), Ok(None));
    }

    #[test]
    fn a_box_fills_up_wraps_and_drains_in_order() {
        let o = OwnedBox::new();
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        let len = |i: u64| [8usize, 100, MAX_PAYLOAD, 48, 49][(i % 5) as usize];
        let (mut sent, mut got) = (0u64, 0u64);
        while got < 5000 {
            // Fill until refused, then drain a few: the sender keeps lapping
            // the receiver with skips at the end of the box.
            while sent < 5000
                && b.push(&mut s, sent, &vec![sent as u8; len(sent)], true)
                    .unwrap()
            {
                sent += 1;
            }
            assert!(
                sent == 5000 || sent - got > 10,
                "a full box holds many messages"
            );
            for _ in 0..7 {
                if let Some((tag, data)) = take(&b, &mut r) {
                    assert_eq!((tag, data), (got, vec![got as u8; len(got)]));
                    got += 1;
                }
            }
        }
        assert!(b.drained(&mut s).unwrap());
        assert!(!b.push(&mut s, 0, &[0u8; MAX_PAYLOAD + 1], true).unwrap());
    }

    #[test]
    fn rendezvous_announcements_keep_their_place_and_kind() {
        let o = OwnedBox::with_slots(8);
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        for i in 0..40u64 {
            let rts = [i as u8; 24];
            assert!(b.push(&mut s, i, b"before", false).unwrap());
            assert!(b.push_rendezvous(&mut s, i, &rts).unwrap());
            assert!(!b.looks_empty(&r));
            let f = b.peek(&mut r).unwrap().unwrap();
            assert!(!f.rndv, "a user message reads as a user message");
            assert_eq!(take(&b, &mut r).map(|(t, d)| (t, d.len())), Some((i, 6)));
            let f = b.peek(&mut r).unwrap().unwrap();
            assert_eq!((f.tag, f.len, f.rndv), (i, 24, true));
            assert_eq!(take(&b, &mut r), Some((i, rts.to_vec())));
            assert!(b.looks_empty(&r));
        }
        assert!(b.drained(&mut s).unwrap());
    }

    #[test]
    fn user_bytes_never_pass_for_a_header() {
        let o = OwnedBox::with_slots(40);
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        // Payloads made of words that look like the head marks (with and
        // without a length) and tags of every slot number for the next laps.
        let forged: Vec<u8> = (0..128u64)
            .flat_map(|k| [head_mark(k, HEAD, 8), mark(k, HEAD), 1].map(u64::to_le_bytes))
            .flatten()
            .take(MAX_PAYLOAD)
            .collect();
        for i in 0..200usize {
            let len = [MAX_PAYLOAD, 300, 49][i % 3];
            assert!(b.push(&mut s, 1, &forged[..len], true).unwrap());
            assert_eq!(take(&b, &mut r).map(|(_, d)| d.len()), Some(len));
            assert_eq!(b.peek(&mut r), Ok(None), "a forged header was taken");
        }
    }

    #[test]
    fn take_small_takes_exactly_the_small_messages_of_its_tag_in_order() {
        // A small box, so that longer messages make the sender skip back to
        // slot 0 now and then; tags 1 and 2 and announcements interleaved.
        let o = OwnedBox::with_slots(24);
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        let mut out = vec![0xEE; 3];
        let (mut took, mut left, mut skips) = (0, 0, 0);
        assert_eq!(b.take_small(&mut r, 1, &mut out, true), Take::Empty);
        for i in 0..3000u64 {
            let len = [8usize, 0, 48, 49, 13, 104, MAX_PAYLOAD][(i % 7) as usize];
            let tag = 1 + i % 3 / 2;
            let data: Vec<u8> = (0..len).map(|k| (k as u64 + i) as u8).collect();
            let rndv = i % 11 == 5;
            let pushed = if rndv {
                b.push_rendezvous(&mut s, tag, &data[..len.min(24)])
            } else {
                b.push(&mut s, tag, &data, i % 2 == 0)
            };
            assert!(pushed.unwrap());
            let skip = b.slot(r.next)[0].load(Ordering::Relaxed) == mark(r.next, SKIP);
            skips += u32::from(skip);
            // Every other take appends to what `out` holds.
            let clear = i % 2 == 0;
            let before = out.clone();
            match b.take_small(&mut r, 1, &mut out, clear) {
                Take::Took(n) => {
                    assert!(!rndv && tag == 1 && len <= TWO_SLOTS && i > 0);
                    let kept = if clear { 0 } else { before.len() };
                    assert_eq!(&out[..kept], &before[..kept]);
                    assert_eq!((n, &out[kept..]), (len, &data[..]));
                    took += 1;
                }
                Take::Other => {
                    assert_eq!(out, before, "a message left changed the buffer");
                    let small = !rndv && tag == 1 && len <= TWO_SLOTS;
                    // Left to the general path: a longer message, another
                    // tag, an announcement, the box's first message, or a
                    // small message behind a skip.
                    assert!(!small || i == 0 || skip, "message {i} was left");
                    let f = b.peek(&mut r).unwrap().unwrap();
                    let sent = if rndv { len.min(24) } else { len };
                    assert_eq!((f.tag, f.len, f.rndv), (tag, sent, rndv));
                    assert_eq!(take(&b, &mut r).unwrap().1, data[..f.len]);
                    left += 1;
                }
                Take::Empty => panic!("message {i} was pushed but not seen"),
            }
            assert_eq!(b.take_small(&mut r, 1, &mut out, true), Take::Empty);
        }
        assert!(took > 1000 && left > 1300, "took {took}, left {left}");
        assert!(skips > 20, "{skips} skips");
        assert!(b.drained(&mut s).unwrap());
    }

    #[test]
    fn scribbled_counters_and_lengths_are_reported() {
        let o = OwnedBox::new();
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        o.0[LEAD_WORDS].store(head_mark(0, HEAD, MAX_PAYLOAD + 1), Ordering::Relaxed);
        assert_eq!(b.peek(&mut r), Err(Corrupt));
        b.push(&mut s, 0, b"a", true).unwrap();
        o.0[0].store(5, Ordering::Relaxed);
        assert_eq!(b.drained(&mut s), Err(Corrupt));
    }
}

#[cfg(all(test, btl_loom))]
mod loom_tests {
    use super::testing::OwnedBox;
    use super::*;
    use loom::thread;
    use std::sync::Arc;

    /// A three-slot box and two messages of two slots each, so the second
    /// must skip back to slot 0 and reuse the first message's slots:
    /// every payload must be visible with its head mark (the model fails if
    /// the head's Release store is weakened — checked), and reuse must wait
    /// until the receiver has read the slot. (A weakened `consumed` pair
    /// would allow load buffering, which loom does not explore: that half
    /// rests on the Release/Acquire argument in the code.)
    #[test]
    fn payload_is_visible_with_its_head_and_reuse_waits_for_consumed() {
        model_exchange(3, &[(7, &[5u8; 50]), (8, &[9u8; 49])]);
    }

    /// The same for messages that fit in one slot, which `push` stores
    /// word by word: a two-slot box and three messages (a whole word, a
    /// partial last word, a full slot), so the third reuses the first's
    /// slot.
    #[test]
    fn a_one_slot_payload_is_visible_with_its_head_and_reuse_waits_for_consumed() {
        model_exchange(2, &[(1, &[1u8; 8]), (2, &[2u8; 13]), (3, &[3u8; 48])]);
    }

    /// The same through `take_small`, the receive path's one-step take of
    /// one- and two-slot messages: a three-slot box, so that the last
    /// message reuses slots the first two released.
    #[test]
    fn a_small_take_sees_its_payload_and_reuse_waits_for_it() {
        model_exchange(3, &[(7, &[1u8; 8]), (7, &[5u8; 50]), (7, &[9u8; 49])]);
    }

    /// One sender pushes `msgs` into a box of `slots` slots (retrying while
    /// it is full), one receiver takes them: all arrive, in order, intact.
    fn model_exchange(slots: usize, msgs: &'static [(u64, &'static [u8])]) {
        loom::model(move || {
            let o = Arc::new(OwnedBox::with_slots(slots));
            let po = o.clone();
            let t = thread::spawn(move || {
                let b = po.fbox();
                let mut s = Sender::default();
                let mut next = 0;
                while next < msgs.len() {
                    if b.push(&mut s, msgs[next].0, msgs[next].1, true).unwrap() {
                        next += 1;
                    } else {
                        thread::yield_now();
                    }
                }
            });
            let b = o.fbox();
            let mut r = Receiver::default();
            let mut got = Vec::new();
            while got.len() < msgs.len() {
                let mut small = Vec::new();
                if let Take::Took(_) = b.take_small(&mut r, 7, &mut small, true) {
                    got.push((7, small));
                    continue;
                }
                match b.peek(&mut r).unwrap() {
                    Some(f) => {
                        let mut out = vec![0u8; f.len];
                        b.read(&r, &mut out);
                        b.consume(&mut r, f.len);
                        got.push((f.tag, out));
                    }
                    None => thread::yield_now(),
                }
            }
            let want: Vec<(u64, Vec<u8>)> = msgs.iter().map(|(t, d)| (*t, d.to_vec())).collect();
            assert_eq!(got, want);
            t.join().unwrap();
        });
    }
}

//! The fast box: one small mailbox per (sender, receiver) pair for small user
//! messages, in the spirit of Open MPI's vader fast boxes.
//!
//! The ring path costs a small message several cache lines between the two
//! cores (ring slot, ring index, fragment header and payload, the return
//! ring and its index). A fast-box message costs one: header and payload sit
//! in one slot, the receiver polls the slot itself, and nothing comes back
//! per message (the receiver publishes how many it consumed on a line of its
//! own, which the sender re-reads only when it believes the box is full).
//!
//! Layout (in the receiver's segment, all `u64` words accessed atomically, so
//! no byte of it is ever read while another process writes it non-atomically):
//!
//! ```text
//! word 0            consumed: messages the receiver took (written by the receiver)
//! words 8 ..        SLOTS slots of SLOT_WORDS words each:
//!   word 0          seq << 16 | len   (stored last, Release; seq starts at 1)
//!   word 1          tag
//!   words 2 ..      payload, little-endian, zero-padded to a whole word
//! ```
//!
//! Message `n` (counting from 0) goes to slot `n % SLOTS` with sequence
//! number `n + 1` (48 bits). A slot's first word is only ever written as a
//! header, so what the receiver finds there is either the header it expects
//! or an older one (or zero): user bytes can never pass for a header.
//!
//! Order with the ring path: per pair, at most one of the two paths holds
//! unconsumed user messages at any time. The sender writes to the box only
//! when the pair's user ring is drained, and pushes to the ring only when the
//! box is drained; the receiver publishes either consumption (ring `head`,
//! box `consumed`) only under its receive lock, in the same critical section
//! as the delivery, so the next message on the other path cannot be
//! delivered first.

use crate::sync::{AtomicU64, Ordering};

/// Slots per box.
pub(crate) const SLOTS: usize = 64;
/// Words per slot (256 bytes: four cache lines).
pub(crate) const SLOT_WORDS: usize = 32;
/// Header words per slot.
const HEADER_WORDS: usize = 2;
/// Largest payload a slot carries.
pub(crate) const MAX_PAYLOAD: usize = (SLOT_WORDS - HEADER_WORDS) * 8;
/// Words before the first slot (the `consumed` counter on its own line).
const LEAD_WORDS: usize = 8;
/// Words in one box.
pub(crate) const BOX_WORDS: usize = LEAD_WORDS + SLOTS * SLOT_WORDS;
/// Bytes in one box.
pub(crate) const BOX_BYTES: usize = BOX_WORDS * 8;

const SEQ_MASK: u64 = (1 << 48) - 1;

/// A peer's counter is impossible (it scribbled on the box).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Corrupt;

/// The words of one box.
#[derive(Clone, Copy)]
pub(crate) struct FBox<'a> {
    words: &'a [AtomicU64],
    slots: u64,
}

/// Sender-private state of one box.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Sender {
    sent: u64,
    consumed_cache: u64,
}

/// Receiver-private state of one box.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Receiver {
    taken: u64,
}

/// A message found in a box (its payload was copied out).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) tag: u64,
    pub(crate) len: usize,
}

impl<'a> FBox<'a> {
    /// A box over `words`: the lead words and a whole number of slots
    /// ([`BOX_WORDS`] in a segment; fewer slots in model tests).
    pub(crate) fn new(words: &'a [AtomicU64]) -> Option<FBox<'a>> {
        let body = words.len().checked_sub(LEAD_WORDS)?;
        (body > 0 && body % SLOT_WORDS == 0).then_some(FBox {
            words,
            slots: (body / SLOT_WORDS) as u64,
        })
    }

    fn slot(&self, n: u64) -> &'a [AtomicU64] {
        let i = (n % self.slots) as usize;
        let start = LEAD_WORDS + i * SLOT_WORDS;
        &self.words[start..start + SLOT_WORDS]
    }

    fn consumed(&self) -> &'a AtomicU64 {
        &self.words[0]
    }

    /// Re-read how many messages the receiver took.
    fn refresh(&self, st: &mut Sender) -> Result<(), Corrupt> {
        // Acquire pairs with the receiver's Release store in `consumed`: its
        // reads of the slots it released happen before we overwrite them.
        let c = self.consumed().load(Ordering::Acquire);
        if c > st.sent || c < st.consumed_cache {
            return Err(Corrupt);
        }
        st.consumed_cache = c;
        Ok(())
    }

    /// Whether the receiver took every message we put in the box.
    pub(crate) fn drained(&self, st: &mut Sender) -> Result<bool, Corrupt> {
        if st.consumed_cache != st.sent {
            self.refresh(st)?;
        }
        Ok(st.consumed_cache == st.sent)
    }

    /// Whether the receiver took every message we put in the box, from a
    /// fresh look at its counter (for parking and drain checks).
    pub(crate) fn looks_drained(&self, st: &Sender) -> bool {
        st.consumed_cache == st.sent || self.consumed().load(Ordering::Acquire) == st.sent
    }

    /// Put a message in the box. `Ok(false)`: the box is full (or the message
    /// too large: check [`MAX_PAYLOAD`] first).
    pub(crate) fn push(&self, st: &mut Sender, tag: u64, data: &[u8]) -> Result<bool, Corrupt> {
        if data.len() > MAX_PAYLOAD {
            return Ok(false);
        }
        if st.sent - st.consumed_cache >= self.slots {
            self.refresh(st)?;
            if st.sent - st.consumed_cache >= self.slots {
                return Ok(false);
            }
        }
        let slot = self.slot(st.sent);
        slot[1].store(tag, Ordering::Relaxed);
        for (w, chunk) in slot[HEADER_WORDS..].iter().zip(data.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            w.store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
        st.sent += 1;
        // Release pairs with the receiver's Acquire load in `peek`: the tag
        // and payload stored above are visible before the header.
        slot[0].store(
            ((st.sent & SEQ_MASK) << 16) | data.len() as u64,
            Ordering::Release,
        );
        Ok(true)
    }

    /// The next message's tag and length, if it is there. `Err`: the header
    /// claims a length no slot holds.
    pub(crate) fn peek(&self, st: &Receiver) -> Result<Option<Found>, Corrupt> {
        let slot = self.slot(st.taken);
        // Acquire pairs with the sender's Release store of the header in `push`.
        let h = slot[0].load(Ordering::Acquire);
        if h >> 16 != (st.taken + 1) & SEQ_MASK {
            return Ok(None);
        }
        let len = (h & 0xffff) as usize;
        if len > MAX_PAYLOAD {
            return Err(Corrupt);
        }
        Ok(Some(Found {
            tag: slot[1].load(Ordering::Relaxed),
            len,
        }))
    }

    /// Copy the payload of the message `peek` found into `out` (its length).
    pub(crate) fn read(&self, st: &Receiver, out: &mut [u8]) {
        let slot = self.slot(st.taken);
        for (w, chunk) in slot[HEADER_WORDS..].iter().zip(out.chunks_mut(8)) {
            let b = w.load(Ordering::Relaxed).to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }

    /// Release the message `peek` found: the sender may reuse its slot.
    pub(crate) fn consume(&self, st: &mut Receiver) {
        st.taken += 1;
        // Release pairs with the sender's Acquire load in `refresh`.
        self.consumed().store(st.taken, Ordering::Release);
    }

    /// Whether a message waits (a racy hint for parking).
    pub(crate) fn looks_empty(&self, st: &Receiver) -> bool {
        !matches!(self.peek(st), Ok(Some(_)))
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
            FBox::new(&self.0).expect("right size")
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
        b.consume(r);
        Some((f.tag, out))
    }

    #[test]
    fn messages_of_every_size_round_trip_in_order_across_laps() {
        let o = OwnedBox::new();
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        for lap in 0..5u64 {
            for len in 0..=MAX_PAYLOAD {
                let data: Vec<u8> = (0..len).map(|i| (i as u64 * 7 + lap) as u8).collect();
                assert!(b.push(&mut s, lap * 1000 + len as u64, &data).unwrap());
                assert_eq!(take(&b, &mut r), Some((lap * 1000 + len as u64, data)));
            }
        }
        assert!(b.drained(&mut s).unwrap());
        assert_eq!(b.peek(&r), Ok(None));
    }

    #[test]
    fn full_box_refuses_until_the_receiver_takes() {
        let o = OwnedBox::new();
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        for i in 0..SLOTS as u64 {
            assert!(b.push(&mut s, i, &i.to_le_bytes()).unwrap());
        }
        assert!(!b.push(&mut s, 99, b"x").unwrap());
        assert!(!b.drained(&mut s).unwrap());
        assert_eq!(take(&b, &mut r), Some((0, 0u64.to_le_bytes().to_vec())));
        assert!(b.push(&mut s, 99, b"x").unwrap());
        for i in 1..SLOTS as u64 {
            assert_eq!(take(&b, &mut r).unwrap().0, i);
        }
        assert_eq!(take(&b, &mut r), Some((99, b"x".to_vec())));
        assert!(b.drained(&mut s).unwrap());
        assert!(!b.push(&mut s, 0, &[0u8; MAX_PAYLOAD + 1]).unwrap());
    }

    #[test]
    fn user_bytes_never_pass_for_a_header() {
        let o = OwnedBox::new();
        let b = o.fbox();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        // Payload words that look like the header of every later message.
        let forged: Vec<u8> = (0..30u64)
            .flat_map(|k| (((k + 2) << 16) | 8).to_le_bytes())
            .collect();
        for _ in 0..SLOTS {
            assert!(b.push(&mut s, 1, &forged).unwrap());
            assert!(take(&b, &mut r).is_some());
        }
        assert_eq!(b.peek(&r), Ok(None));
    }

    #[test]
    fn scribbled_counters_and_lengths_are_reported() {
        let o = OwnedBox::new();
        let b = o.fbox();
        let (mut s, r) = (Sender::default(), Receiver::default());
        o.0[LEAD_WORDS].store((1 << 16) | 0xffff, Ordering::Relaxed);
        assert_eq!(b.peek(&r), Err(Corrupt));
        b.push(&mut s, 0, b"a").unwrap();
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

    /// A one-slot box, so the second message reuses the slot of the first:
    /// the payload must be visible with its header (the model fails if the
    /// header's Release store is weakened — checked), and the reuse must
    /// wait until the receiver has read the first message. (A weakened
    /// `consumed` pair would allow load buffering, which loom does not
    /// explore: that half rests on the Release/Acquire argument in the code.)
    #[test]
    fn payload_is_visible_with_its_header_and_reuse_waits_for_consumed() {
        loom::model(|| {
            let o = Arc::new(OwnedBox::with_slots(1));
            let po = o.clone();
            let t = thread::spawn(move || {
                let b = po.fbox();
                let mut s = Sender::default();
                let mut next = 0;
                let msgs: [(u64, &[u8]); 2] = [(7, &[1, 2, 3]), (8, &[4])];
                while next < 2 {
                    if b.push(&mut s, msgs[next].0, msgs[next].1).unwrap() {
                        next += 1;
                    } else {
                        thread::yield_now();
                    }
                }
            });
            let b = o.fbox();
            let mut r = Receiver::default();
            let mut got = Vec::new();
            while got.len() < 2 {
                match b.peek(&r).unwrap() {
                    Some(f) => {
                        let mut out = vec![0u8; f.len];
                        b.read(&r, &mut out);
                        b.consume(&mut r);
                        got.push((f.tag, out));
                    }
                    None => thread::yield_now(),
                }
            }
            assert_eq!(got, vec![(7, vec![1, 2, 3]), (8, vec![4])]);
            t.join().unwrap();
        });
    }
}

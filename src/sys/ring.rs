//! A single-producer single-consumer ring of `u64` words that lives in shared
//! memory (or, under loom, in a test allocation).
//!
//! Layout: the producer's `tail` and the consumer's `head` each sit on their
//! own cache line, then `cap` slots (`cap` a power of two). Both sides keep
//! their own index privately and only *publish* it. The producer caches the
//! consumer's head and re-reads it only when the cache says full (the rtrb
//! idea); the consumer polls the next slot itself, which carries the lap it
//! was written in above the value, and reads the tail only to tell an
//! empty ring from a corrupt one.
//! A peer that scribbles over the shared indices can make us see a corrupt
//! ring, never read or write out of bounds: every index is masked and every
//! distance checked against `cap`.

use crate::sys::sync::{AtomicU64, Ordering};

/// Bits of a slot that carry the value; the bits above carry the lap.
pub(crate) const VALUE_MASK: u64 = (1 << 40) - 1;

/// A slot's content for `v` pushed at position `pos`: the value and, above
/// it, the lap it was written in plus one, in 24 bits. A slot is rewritten
/// every lap, so a stale slot is exactly one lap behind and never matches;
/// the first lap expects 1, so the zeroed slots of a new segment do not
/// match either (a zero stamp is expected again only after 2^24 laps, when
/// every slot has long been written).
fn stamp(pos: u64, cap: u64, v: u64) -> u64 {
    // `cap` is a power of two: a shift, not a division (a 64-bit `div`
    // costs tens of cycles, and every poll of an empty ring stamps twice).
    let lap = (pos >> cap.trailing_zeros()).wrapping_add(1) & ((1 << 24) - 1);
    lap << 40 | v
}

/// Bytes of the ring header (two cache lines).
pub(crate) const RING_HEADER: usize = 128;

/// Bytes a ring of `cap` slots takes, header included.
pub(crate) const fn ring_bytes(cap: usize) -> usize {
    RING_HEADER + cap * 8
}

/// The shared indices and slots of one ring.
pub(crate) struct Ring<'a> {
    /// Next slot the producer writes; written only by the producer.
    pub(crate) tail: &'a AtomicU64,
    /// Next slot the consumer reads; written only by the consumer.
    pub(crate) head: &'a AtomicU64,
    /// The slots; `len()` is a power of two.
    pub(crate) slots: &'a [AtomicU64],
}

/// The ring's shared indices are inconsistent (a peer wrote garbage).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Corrupt;

/// Producer-private state: our tail and the last head we saw.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ProducerState {
    tail: u64,
    head_cache: u64,
}

/// Consumer-private state: our head.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ConsumerState {
    head: u64,
}

impl ConsumerState {
    /// Whether the ring whose tail word is `tail` looks empty right now
    /// (a racy hint; [`Ring::looks_empty`] without building the ring).
    pub(crate) fn looks_empty(&self, tail: &AtomicU64) -> bool {
        // (The tail may lag what we took by one: see `peek`.)
        let tail = tail.load(Ordering::Acquire);
        tail == self.head || tail.wrapping_add(1) == self.head
    }
}

impl Ring<'_> {
    fn cap(&self) -> u64 {
        self.slots.len() as u64
    }

    /// Append `v`. `Ok(false)` when the ring is full.
    pub(crate) fn push(&self, st: &mut ProducerState, v: u64) -> Result<bool, Corrupt> {
        let cap = self.cap();
        if st.tail.wrapping_sub(st.head_cache) >= cap {
            // Acquire pairs with the consumer's Release store of `head` in
            // `advance`: the consumer is done with the slots it released.
            st.head_cache = self.head.load(Ordering::Acquire);
            let used = st.tail.wrapping_sub(st.head_cache);
            if used > cap {
                return Err(Corrupt);
            }
            if used == cap {
                return Ok(false);
            }
        }
        let mask = cap - 1;
        if v > VALUE_MASK {
            return Err(Corrupt);
        }
        // Release pairs with the consumer's Acquire load of the slot in
        // `peek`: what the value stands for (a fragment's bytes) is visible
        // before the stamped slot is.
        self.slots[(st.tail & mask) as usize].store(stamp(st.tail, cap, v), Ordering::Release);
        st.tail = st.tail.wrapping_add(1);
        // Release pairs with the consumer's Acquire load of `tail` in `peek`:
        // the slot written above is visible before the new tail.
        self.tail.store(st.tail, Ordering::Release);
        Ok(true)
    }

    /// The oldest value without removing it; `Ok(None)` when empty.
    ///
    /// The consumer polls the slot itself: a value stamped with the lap
    /// the consumer expects is there, so an arriving value costs the
    /// consumer one cache line from the producer (the slot), not two (the
    /// tail, then the slot), and an empty poll reads only the slot (still
    /// the previous lap's). The tail is read only when the slot holds some
    /// other stamp: to tell an empty ring from a corrupt one.
    pub(crate) fn peek(&self, st: &mut ConsumerState) -> Result<Option<u64>, Corrupt> {
        let cap = self.cap();
        let slot = &self.slots[(st.head & (cap - 1)) as usize];
        // Acquire pairs with the producer's Release store of the slot.
        let s = slot.load(Ordering::Acquire);
        if s & !VALUE_MASK == stamp(st.head, cap, 0) {
            return Ok(Some(s & VALUE_MASK));
        }
        // Still the previous lap's value (or, in the first lap, the zeroed
        // slot of a new segment): empty, without touching the tail's line.
        let previous = match st.head.checked_sub(cap) {
            Some(pos) => s & !VALUE_MASK == stamp(pos, cap, 0),
            None => s == 0,
        };
        if previous {
            return Ok(None);
        }
        // Acquire pairs with the producer's Release store of `tail` in `push`.
        let tail = self.tail.load(Ordering::Acquire);
        // Empty; or the producer is between its two stores of a push whose
        // slot we already took (the tail may lag the slots by one).
        if tail == st.head || tail.wrapping_add(1) == st.head {
            return Ok(None);
        }
        if tail.wrapping_sub(st.head) > cap {
            return Err(Corrupt);
        }
        // The producer stores the slot before the tail: one the tail says
        // is there must now hold the expected stamp.
        let s = slot.load(Ordering::Acquire);
        if s & !VALUE_MASK == stamp(st.head, cap, 0) {
            Ok(Some(s & VALUE_MASK))
        } else {
            Err(Corrupt)
        }
    }

    /// The value `ahead` places after the head, if the producer has
    /// stored it: a hint (for prefetching), that changes no state and
    /// reads only that slot.
    pub(crate) fn peek_ahead(&self, st: &ConsumerState, ahead: u64) -> Option<u64> {
        let cap = self.cap();
        if ahead >= cap {
            return None;
        }
        let pos = st.head.wrapping_add(ahead);
        let s = self.slots[(pos & (cap - 1)) as usize].load(Ordering::Relaxed);
        (s & !VALUE_MASK == stamp(pos, cap, 0)).then_some(s & VALUE_MASK)
    }

    /// Remove the value `peek` returned.
    pub(crate) fn advance(&self, st: &mut ConsumerState) {
        st.head = st.head.wrapping_add(1);
        // Release pairs with the producer's Acquire load of `head` in `push`:
        // our read of the slot happens before the producer may reuse it.
        self.head.store(st.head, Ordering::Release);
    }

    /// Producer side: whether the consumer has taken everything we pushed,
    /// by what we last saw of it and without looking at the ring
    /// (`false` may be stale: then ask [`drained`](Self::drained)).
    pub(crate) fn known_drained(st: &ProducerState) -> bool {
        st.head_cache == st.tail
    }

    /// Producer side: whether the consumer has taken everything we pushed.
    pub(crate) fn drained(&self, st: &mut ProducerState) -> Result<bool, Corrupt> {
        if st.head_cache != st.tail {
            // Acquire pairs with the consumer's Release store of `head` in
            // `advance`: it is done with every slot it released.
            st.head_cache = self.head.load(Ordering::Acquire);
            if st.tail.wrapping_sub(st.head_cache) > self.cap() {
                return Err(Corrupt);
            }
        }
        Ok(st.head_cache == st.tail)
    }

    /// Whether the consumer looks done with every slot we pushed, from a
    /// fresh look at its `head` (a racy hint for parking; see `drained`).
    pub(crate) fn looks_drained(&self, st: &ProducerState) -> bool {
        st.head_cache == st.tail || self.head.load(Ordering::Acquire) == st.tail
    }

    /// Whether the ring looks empty right now (a racy hint for parking).
    pub(crate) fn looks_empty(&self, st: &ConsumerState) -> bool {
        st.looks_empty(self.tail)
    }
}

/// The sleeper's half of the doorbell protocol: announce "asleep, ring me",
/// then re-check the rings before actually sleeping.
pub(crate) fn arm(flag: &crate::sys::sync::AtomicU32) {
    flag.store(1, Ordering::SeqCst);
    // Pairs with the fence in `should_ring`: either the sleeper's re-check
    // sees the producer's data, or the producer sees this flag.
    crate::sys::sync::fence(Ordering::SeqCst);
}

/// The producer's half: after publishing data, whether the sleeper must be
/// woken. Clears the flag so exactly one producer rings per arming.
pub(crate) fn should_ring(flag: &crate::sys::sync::AtomicU32) -> bool {
    // Orders our earlier Release store of the ring's tail before the load of
    // the flag (pairs with the fence in `arm`).
    crate::sys::sync::fence(Ordering::SeqCst);
    flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// A ring in ordinary memory, for tests.
    pub(crate) struct OwnedRing {
        pub(crate) tail: AtomicU64,
        pub(crate) head: AtomicU64,
        pub(crate) slots: Vec<AtomicU64>,
    }

    impl OwnedRing {
        pub(crate) fn new(cap: usize) -> Self {
            OwnedRing {
                tail: AtomicU64::new(0),
                head: AtomicU64::new(0),
                slots: (0..cap).map(|_| AtomicU64::new(0)).collect(),
            }
        }
        pub(crate) fn ring(&self) -> Ring<'_> {
            Ring {
                tail: &self.tail,
                head: &self.head,
                slots: &self.slots,
            }
        }
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::testing::OwnedRing;
    use super::*;

    #[test]
    fn fifo_order_full_and_wrap() {
        let o = OwnedRing::new(4);
        let r = o.ring();
        let (mut p, mut c) = (ProducerState::default(), ConsumerState::default());
        for round in 0..10u64 {
            for i in 0..4 {
                assert_eq!(r.push(&mut p, round * 10 + i), Ok(true));
            }
            assert_eq!(r.push(&mut p, 99), Ok(false));
            for i in 0..4 {
                assert_eq!(r.peek(&mut c), Ok(Some(round * 10 + i)));
                r.advance(&mut c);
            }
            assert_eq!(r.peek(&mut c), Ok(None));
        }
    }

    #[test]
    fn peek_ahead_sees_only_what_was_pushed_this_lap() {
        let o = OwnedRing::new(4);
        let r = o.ring();
        let (mut p, mut c) = (ProducerState::default(), ConsumerState::default());
        assert_eq!(r.peek_ahead(&c, 1), None, "nothing pushed");
        for v in [10, 11, 12] {
            r.push(&mut p, v).unwrap();
        }
        assert_eq!(r.peek_ahead(&c, 1), Some(11));
        assert_eq!(r.peek_ahead(&c, 2), Some(12));
        assert_eq!(r.peek_ahead(&c, 3), None, "not pushed yet");
        assert_eq!(r.peek_ahead(&c, 4), None, "a lap ahead is never asked");
        r.peek(&mut c).unwrap();
        r.advance(&mut c);
        assert_eq!(r.peek_ahead(&c, 1), Some(12));
        // Slot 0 still holds the last lap's 10: not a value one ahead of 3.
        r.peek(&mut c).unwrap();
        r.advance(&mut c);
        r.peek(&mut c).unwrap();
        r.advance(&mut c);
        r.push(&mut p, 13).unwrap();
        assert_eq!(
            r.peek_ahead(&c, 1),
            None,
            "the old lap's value is not taken"
        );
        r.push(&mut p, 14).unwrap();
        assert_eq!(r.peek_ahead(&c, 1), Some(14));
        // Nothing changed for the consumer.
        assert_eq!(r.peek(&mut c), Ok(Some(13)));
    }

    #[test]
    fn scribbled_indices_are_reported_not_followed() {
        let o = OwnedRing::new(4);
        let r = o.ring();
        let (mut p, mut c) = (ProducerState::default(), ConsumerState::default());
        // A tail far beyond the head is noticed once the slot holds
        // something that is neither the expected nor the previous lap.
        o.tail.store(1000, Ordering::Relaxed);
        assert_eq!(
            r.peek(&mut c),
            Ok(None),
            "the slot decides while it is untouched"
        );
        o.slots[0].store(9 << 40, Ordering::Relaxed);
        assert_eq!(r.peek(&mut c), Err(Corrupt));
        o.slots[0].store(0, Ordering::Relaxed);
        o.tail.store(0, Ordering::Relaxed);
        for i in 0..4 {
            r.push(&mut p, i).unwrap();
        }
        o.head.store(u64::MAX - 5, Ordering::Relaxed);
        assert_eq!(r.push(&mut p, 5), Err(Corrupt));
    }

    #[test]
    fn a_slot_without_the_expected_lap_is_empty_or_corrupt() {
        let o = OwnedRing::new(4);
        let r = o.ring();
        let (mut p, mut c) = (ProducerState::default(), ConsumerState::default());
        // A lap's worth pushed and taken: the slots now hold lap-1 stamps,
        // which the next lap must not take for values.
        for i in 0..4 {
            r.push(&mut p, i).unwrap();
            assert_eq!(r.peek(&mut c), Ok(Some(i)));
            r.advance(&mut c);
        }
        assert_eq!(r.peek(&mut c), Ok(None));
        // A value taken before the producer published its tail (it stores
        // the slot first): the ring then reads as empty, not corrupt.
        r.push(&mut p, 9).unwrap();
        o.tail.store(4, Ordering::Relaxed);
        assert_eq!(r.peek(&mut c), Ok(Some(9)));
        r.advance(&mut c);
        assert_eq!(r.peek(&mut c), Ok(None));
        assert!(r.looks_empty(&c));
        o.tail.store(5, Ordering::Relaxed);
        // A peer that bumps the tail without writing the slot.
        // (While the slot still holds the previous lap, the tail is not
        // even read: the ring is empty as far as the slot says.)
        o.tail.store(7, Ordering::Relaxed);
        assert_eq!(r.peek(&mut c), Ok(None));
        o.slots[1].store(9 << 40 | 3, Ordering::Relaxed);
        assert_eq!(r.peek(&mut c), Err(Corrupt));
        // A peer that writes a slot with some other lap's stamp.
        o.tail.store(5, Ordering::Relaxed);
        o.slots[1].store(7 << 40 | 3, Ordering::Relaxed);
        assert_eq!(r.peek(&mut c), Ok(None));
        // Values wider than a slot's value bits are refused.
        assert_eq!(r.push(&mut p, VALUE_MASK + 1), Err(Corrupt));
    }
}

#[cfg(all(test, btl_loom))]
mod loom_tests {
    use super::testing::OwnedRing;
    use super::*;
    use loom::thread;
    use std::sync::Arc;

    #[test]
    fn spsc_delivers_in_order_without_loss() {
        loom::model(|| {
            let o = Arc::new(OwnedRing::new(2));
            let prod = o.clone();
            let t = thread::spawn(move || {
                let r = prod.ring();
                let mut p = ProducerState::default();
                let mut next = 0u64;
                while next < 3 {
                    if r.push(&mut p, next).unwrap() {
                        next += 1;
                    } else {
                        thread::yield_now();
                    }
                }
            });
            let r = o.ring();
            let mut c = ConsumerState::default();
            let mut want = 0u64;
            while want < 3 {
                match r.peek(&mut c).unwrap() {
                    Some(v) => {
                        assert_eq!(v, want);
                        r.advance(&mut c);
                        want += 1;
                    }
                    None => thread::yield_now(),
                }
            }
            t.join().unwrap();
        });
    }

    /// The consumer may take a value from its slot before the producer has
    /// published the tail; parking then relies on `looks_empty`, which
    /// treats a tail one behind as empty. Whatever the interleaving, a
    /// consumer that parks without the last value was rung.
    #[test]
    fn parking_ahead_of_a_lagging_tail_loses_no_wake_up() {
        loom::model(|| {
            let o = Arc::new(OwnedRing::new(2));
            let flag = Arc::new(crate::sys::sync::AtomicU32::new(0));
            let (po, pf) = (o.clone(), flag.clone());
            let producer = thread::spawn(move || {
                let r = po.ring();
                let mut p = ProducerState::default();
                assert!(r.push(&mut p, 1).unwrap());
                let first = should_ring(&pf);
                assert!(r.push(&mut p, 2).unwrap());
                first | should_ring(&pf)
            });
            let r = o.ring();
            let mut c = ConsumerState::default();
            let mut last = 0;
            while let Some(v) = r.peek(&mut c).unwrap() {
                r.advance(&mut c);
                last = v;
            }
            arm(&flag);
            let parks = r.looks_empty(&c);
            let rang = producer.join().unwrap();
            assert!(
                !parks || last == 2 || rang,
                "parked without the last value, and nobody rang"
            );
        });
    }

    #[test]
    fn doorbell_protocol_loses_no_wake_up() {
        loom::model(|| {
            let o = Arc::new(OwnedRing::new(2));
            let flag = Arc::new(crate::sys::sync::AtomicU32::new(0));
            let (po, pf) = (o.clone(), flag.clone());
            let producer = thread::spawn(move || {
                let mut p = ProducerState::default();
                assert!(po.ring().push(&mut p, 7).unwrap());
                should_ring(&pf)
            });
            arm(&flag);
            let mut c = ConsumerState::default();
            let saw = o.ring().peek(&mut c).unwrap().is_some();
            let rang = producer.join().unwrap();
            assert!(saw || rang, "the sleeper missed the data and nobody rang");
        });
    }
}

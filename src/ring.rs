//! A single-producer single-consumer ring of `u64` words that lives in shared
//! memory (or, under loom, in a test allocation).
//!
//! Layout: the producer's `tail` and the consumer's `head` each sit on their
//! own cache line, then `cap` slots (`cap` a power of two). Both sides keep
//! their own index privately and only *publish* it; the other side's index is
//! cached and re-read only when the cache says full/empty (the rtrb idea).
//! A peer that scribbles over the shared indices can make us see a corrupt
//! ring, never read or write out of bounds: every index is masked and every
//! distance checked against `cap`.

use crate::sync::{AtomicU64, Ordering};

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

/// Consumer-private state: our head and the last tail we saw.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ConsumerState {
    head: u64,
    tail_cache: u64,
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
        self.slots[(st.tail & mask) as usize].store(v, Ordering::Relaxed);
        st.tail = st.tail.wrapping_add(1);
        // Release pairs with the consumer's Acquire load of `tail` in `peek`:
        // the slot written above is visible before the new tail.
        self.tail.store(st.tail, Ordering::Release);
        Ok(true)
    }

    /// The oldest value without removing it; `Ok(None)` when empty.
    pub(crate) fn peek(&self, st: &mut ConsumerState) -> Result<Option<u64>, Corrupt> {
        if st.head == st.tail_cache {
            // Acquire pairs with the producer's Release store of `tail` in `push`.
            st.tail_cache = self.tail.load(Ordering::Acquire);
            let avail = st.tail_cache.wrapping_sub(st.head);
            if avail > self.cap() {
                return Err(Corrupt);
            }
            if avail == 0 {
                return Ok(None);
            }
        }
        let mask = self.cap() - 1;
        Ok(Some(
            self.slots[(st.head & mask) as usize].load(Ordering::Relaxed),
        ))
    }

    /// Remove the value `peek` returned.
    pub(crate) fn advance(&self, st: &mut ConsumerState) {
        st.head = st.head.wrapping_add(1);
        // Release pairs with the producer's Acquire load of `head` in `push`:
        // our read of the slot happens before the producer may reuse it.
        self.head.store(st.head, Ordering::Release);
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

    /// Whether the ring looks empty right now (a racy hint for parking).
    pub(crate) fn looks_empty(&self, st: &ConsumerState) -> bool {
        self.tail.load(Ordering::Acquire) == st.head
    }
}

/// The sleeper's half of the doorbell protocol: announce "asleep, ring me",
/// then re-check the rings before actually sleeping.
pub(crate) fn arm(flag: &crate::sync::AtomicU32) {
    flag.store(1, Ordering::SeqCst);
    // Pairs with the fence in `should_ring`: either the sleeper's re-check
    // sees the producer's data, or the producer sees this flag.
    crate::sync::fence(Ordering::SeqCst);
}

/// The producer's half: after publishing data, whether the sleeper must be
/// woken. Clears the flag so exactly one producer rings per arming.
pub(crate) fn should_ring(flag: &crate::sync::AtomicU32) -> bool {
    // Orders our earlier Release store of the ring's tail before the load of
    // the flag (pairs with the fence in `arm`).
    crate::sync::fence(Ordering::SeqCst);
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
    fn scribbled_indices_are_reported_not_followed() {
        let o = OwnedRing::new(4);
        let r = o.ring();
        let (mut p, mut c) = (ProducerState::default(), ConsumerState::default());
        o.tail.store(1000, Ordering::Relaxed);
        assert_eq!(r.peek(&mut c), Err(Corrupt));
        for i in 0..4 {
            r.push(&mut p, i).unwrap();
        }
        o.head.store(u64::MAX - 5, Ordering::Relaxed);
        assert_eq!(r.push(&mut p, 5), Err(Corrupt));
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

    #[test]
    fn doorbell_protocol_loses_no_wake_up() {
        loom::model(|| {
            let o = Arc::new(OwnedRing::new(2));
            let flag = Arc::new(crate::sync::AtomicU32::new(0));
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

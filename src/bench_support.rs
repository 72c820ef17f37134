//! Hooks for the criterion benches in `benches/`: small safe wrappers over
//! crate-private pieces (the shared-memory FIFO, the `sm` fragment header),
//! so the benches can time them without those pieces becoming public API.
//!
//! Not part of the supported API: hidden from the docs, may change at any
//! time.

use crate::sm::frag::{FragHeader, FIRST, LAST};
use crate::sm::kind::Kind;
use crate::sys::ring::{ConsumerState, ProducerState, Ring};
use crate::sys::sync::AtomicU64;

/// A FIFO ring of `u64` in ordinary memory, used by one thread as both
/// producer and consumer (what a push/pop costs without contention).
pub struct Fifo {
    tail: AtomicU64,
    head: AtomicU64,
    slots: Vec<AtomicU64>,
    prod: ProducerState,
    cons: ConsumerState,
}

impl Fifo {
    /// A ring of `cap` slots, rounded up to a power of two (at least 1).
    pub fn new(cap: usize) -> Fifo {
        let cap = cap.max(1).next_power_of_two();
        Fifo {
            tail: AtomicU64::new(0),
            head: AtomicU64::new(0),
            slots: (0..cap).map(|_| AtomicU64::new(0)).collect(),
            prod: ProducerState::default(),
            cons: ConsumerState::default(),
        }
    }

    fn ring(&self) -> Ring<'_> {
        Ring {
            tail: &self.tail,
            head: &self.head,
            slots: &self.slots,
        }
    }

    /// Append `v`; `false` when full.
    pub fn push(&mut self, v: u64) -> bool {
        let mut st = self.prod;
        let ok = matches!(self.ring().push(&mut st, v), Ok(true));
        self.prod = st;
        ok
    }

    /// Take the oldest value; `None` when empty.
    pub fn pop(&mut self) -> Option<u64> {
        let mut st = self.cons;
        let ring = self.ring();
        let v = ring.peek(&mut st).ok().flatten();
        if v.is_some() {
            ring.advance(&mut st);
        }
        self.cons = st;
        v
    }
}

/// Bytes of an `sm` fragment header.
pub const FRAG_HEADER: usize = crate::sm::frag::FRAG_HEADER;

/// Encode the header of a single-fragment user message of `len` bytes.
pub fn encode_frag_header(len: u32, tag: u64) -> [u8; FRAG_HEADER] {
    FragHeader {
        kind: Kind::User,
        flags: FIRST | LAST,
        len,
        tag,
        total: u64::from(len),
    }
    .encode()
}

/// Decode and check a fragment header against a fragment of `capacity`
/// payload bytes; `Some((len, tag, total))` when it is valid.
pub fn decode_frag_header(b: &[u8; FRAG_HEADER], capacity: usize) -> Option<(u32, u64, u64)> {
    FragHeader::decode(b, capacity)
        .ok()
        .map(|h| (h.len, h.tag, h.total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_and_header_wrappers_work() {
        let mut f = Fifo::new(3);
        assert!(f.push(1) && f.push(2) && f.push(3) && f.push(4));
        assert!(!f.push(5));
        assert_eq!((f.pop(), f.pop()), (Some(1), Some(2)));
        let h = encode_frag_header(100, 9);
        assert_eq!(decode_frag_header(&h, 4072), Some((100, 9, 100)));
        assert_eq!(decode_frag_header(&h, 10), None);
    }
}

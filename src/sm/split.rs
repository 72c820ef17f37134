//! Split copy: the two processes of a large rendezvous copy it together.
//!
//! A rendezvous receiver copies the whole message out of the sender's memory
//! with `process_vm_readv`, one core's worth of kernel copy (a quarter of
//! what a core's `memcpy` moves, or less), while the sender's core only waits. For messages of
//! `SmConfig::split_min` or more the receiver offers the tail to the
//! sender instead: it asks the sender (a control message) to write bytes
//! `[k, len)` into its receive buffer with `process_vm_writev` while it
//! reads `[0, k)` itself, so both cores copy at once.
//!
//! Who copies the tail is settled by one word per (sender, receiver) pair in
//! the receiver's segment, so a sender that is slow to look never holds the
//! receiver up:
//!
//! ```text
//!   receiver: offer   ->  OFFERED(h)
//!   sender:   claim      OFFERED(h) -> CLAIMED(h)   (compare-exchange)
//!   sender:   finish     CLAIMED(h) -> DONE(h) | FAILED(h)
//!   receiver: take back  OFFERED(h) -> TAKEN(h)     (compare-exchange)
//! ```
//!
//! Exactly one compare-exchange out of `OFFERED(h)` wins: either the sender
//! writes the tail (and the receiver waits for `DONE` or `FAILED` before it
//! touches or frees the buffer), or the receiver copies it itself (and the
//! sender never writes). `h` is the sender's rendezvous handle, unique per
//! sender, so a late request for an old message can never claim a new offer.
//! A pair has at most one offer out at a time: the announcement stays at
//! the head of the user ring or of the fast box until its message is
//! delivered.

use crate::sys::sync::{AtomicU64, Ordering};

/// Bytes of a split-copy request.
pub(crate) const SPLIT_REQ_LEN: usize = 24;

/// A split-copy request, receiver to sender (a control message tagged
/// with the rendezvous handle): write bytes `at..at + n` of the message to
/// `dst` in the receiver's memory. Three little-endian words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitReq {
    pub(crate) dst: u64,
    pub(crate) at: u64,
    pub(crate) n: u64,
}

impl SplitReq {
    /// Wire form.
    pub(crate) fn encode(&self) -> [u8; SPLIT_REQ_LEN] {
        let mut b = [0u8; SPLIT_REQ_LEN];
        b[..8].copy_from_slice(&self.dst.to_le_bytes());
        b[8..16].copy_from_slice(&self.at.to_le_bytes());
        b[16..].copy_from_slice(&self.n.to_le_bytes());
        b
    }

    /// Read a request: `None` unless it is exactly [`SPLIT_REQ_LEN`] bytes
    /// (the sender checks the range against its message).
    pub(crate) fn decode(b: &[u8]) -> Option<SplitReq> {
        let b: &[u8; SPLIT_REQ_LEN] = b.try_into().ok()?;
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        Some(SplitReq {
            dst: word(0),
            at: word(1),
            n: word(2),
        })
    }

    /// The bytes asked for, if they lie inside a message of `len` bytes.
    pub(crate) fn range(&self, len: usize) -> Option<std::ops::Range<usize>> {
        let at = usize::try_from(self.at).ok()?;
        let end = at.checked_add(usize::try_from(self.n).ok()?)?;
        (end <= len).then_some(at..end)
    }
}

const OFFERED: u64 = 1;
const CLAIMED: u64 = 2;
const DONE: u64 = 3;
const FAILED: u64 = 4;
const TAKEN: u64 = 5;
const STATE_BITS: u32 = 3;

fn word(handle: u64, state: u64) -> u64 {
    (handle << STATE_BITS) | state
}

/// Where the tail of an offered message stands, seen by the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tail {
    /// Nobody took it yet.
    Offered,
    /// The sender is writing it.
    Claimed,
    /// The sender wrote all of it.
    Done,
    /// The sender could not write it (the receiver copies it).
    Failed,
    /// The word holds something this offer cannot explain (a scribbling peer).
    Corrupt,
}

/// Receiver: offer the tail of message `handle` (the previous offer of this
/// pair is settled). Release: nothing to publish, but the sender's Acquire
/// in [`claim`] pairs with one store per offer.
pub(crate) fn offer(w: &AtomicU64, handle: u64) {
    w.store(word(handle, OFFERED), Ordering::Release);
}

/// Receiver: the offer's state now.
pub(crate) fn state(w: &AtomicU64, handle: u64) -> Tail {
    // Acquire pairs with the sender's Release in `finish`: the tail it wrote
    // before DONE is visible once DONE is.
    let v = w.load(Ordering::Acquire);
    if v >> STATE_BITS != handle & (u64::MAX >> STATE_BITS) {
        return Tail::Corrupt;
    }
    match v & ((1 << STATE_BITS) - 1) {
        OFFERED => Tail::Offered,
        CLAIMED => Tail::Claimed,
        DONE => Tail::Done,
        FAILED => Tail::Failed,
        _ => Tail::Corrupt,
    }
}

/// Receiver: take the tail back to copy it ourselves. `true`: the sender
/// will never write it; `false`: it claimed it first (wait for [`state`]
/// to say `Done` or `Failed`).
pub(crate) fn take_back(w: &AtomicU64, handle: u64) -> bool {
    w.compare_exchange(
        word(handle, OFFERED),
        word(handle, TAKEN),
        Ordering::AcqRel,
        Ordering::Acquire,
    )
    .is_ok()
}

/// Sender: claim the tail of `handle` to write it. `false`: the receiver
/// took it back (or the request is stale): write nothing.
pub(crate) fn claim(w: &AtomicU64, handle: u64) -> bool {
    w.compare_exchange(
        word(handle, OFFERED),
        word(handle, CLAIMED),
        Ordering::AcqRel,
        Ordering::Relaxed,
    )
    .is_ok()
}

/// Sender: the claimed tail is written (`ok`) or could not be.
pub(crate) fn finish(w: &AtomicU64, handle: u64, ok: bool) {
    // Release pairs with the receiver's Acquire in `state`.
    w.store(
        word(handle, if ok { DONE } else { FAILED }),
        Ordering::Release,
    );
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;

    #[test]
    fn one_side_wins_the_tail() {
        let w = AtomicU64::new(0);
        offer(&w, 7);
        assert_eq!(state(&w, 7), Tail::Offered);
        assert!(claim(&w, 7));
        assert!(!take_back(&w, 7), "claimed: the receiver must wait");
        assert_eq!(state(&w, 7), Tail::Claimed);
        finish(&w, 7, true);
        assert_eq!(state(&w, 7), Tail::Done);

        offer(&w, 8);
        assert!(!claim(&w, 7), "a stale request must not claim a new offer");
        assert!(take_back(&w, 8));
        assert!(!claim(&w, 8), "taken back: the sender must not write");
        offer(&w, 9);
        assert!(claim(&w, 9));
        finish(&w, 9, false);
        assert_eq!(state(&w, 9), Tail::Failed);
    }

    #[test]
    fn a_scribbled_word_reads_as_corrupt() {
        let w = AtomicU64::new(0);
        offer(&w, 3);
        w.store(u64::MAX, Ordering::Relaxed);
        assert_eq!(state(&w, 3), Tail::Corrupt);
        w.store(word(3, 0), Ordering::Relaxed);
        assert_eq!(state(&w, 3), Tail::Corrupt);
        w.store(word(4, DONE), Ordering::Relaxed);
        assert_eq!(state(&w, 3), Tail::Corrupt);
    }
}

#[cfg(all(test, btl_loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::thread;
    use std::sync::Arc;

    /// The tail is written by exactly one side, and the receiver reads the
    /// sender's bytes only after DONE: loom's cell reports any access that
    /// is not ordered (the model fails if `finish` is weakened to Relaxed —
    /// checked).
    #[test]
    fn the_tail_has_one_writer_and_is_read_after_done() {
        loom::model(|| {
            let w = Arc::new(AtomicU64::new(0));
            let tail = Arc::new(UnsafeCell::new(0u8));
            offer(&w, 5);
            let (sw, st) = (w.clone(), tail.clone());
            let sender = thread::spawn(move || {
                if claim(&sw, 5) {
                    // SAFETY: the claim won: nobody else touches the tail
                    // until DONE is published.
                    st.with_mut(|p| unsafe { *p = 1 });
                    finish(&sw, 5, true);
                }
            });
            let mine = take_back(&w, 5);
            if mine {
                // SAFETY: taken back: the sender will never write.
                tail.with_mut(|p| unsafe { *p = 2 });
            } else {
                while state(&w, 5) == Tail::Claimed {
                    thread::yield_now();
                }
                assert_eq!(state(&w, 5), Tail::Done);
            }
            // SAFETY: either we wrote it or DONE (Acquire) ordered the
            // sender's write before this read.
            let v = tail.with(|p| unsafe { *p });
            assert_eq!(v, if mine { 2 } else { 1 });
            sender.join().unwrap();
        });
    }
}

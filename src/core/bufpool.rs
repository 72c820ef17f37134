//! Recycled receive buffers.
//!
//! A received message is handed to the user as `Bytes`. A fresh allocation
//! per message means the kernel faults in its pages again and again (a
//! 1 MiB message: 256 faults; it cut streaming four-fold), and the allocator
//! trims and regrows its heap under a stream of 16 KiB messages. Instead,
//! buffers come from this pool and go back to it when the user drops the
//! last `Bytes` that shares them.
//!
//! Buffers are kept by size class (powers of two from 4 KiB), so taking and
//! returning one is O(1) and a buffer is at most twice the message. Each
//! class keeps enough for a window of messages in flight; all classes
//! together keep at most [`KEEP_BYTES`], and when a returned buffer would go
//! beyond that, buffers of the class holding the most bytes make room: a
//! pool full of small buffers never turns away the large ones now in use.

use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

use crate::sys::sync::lock;

/// Messages at least this large use pooled buffers.
pub(crate) const POOL_MIN: usize = 4 * 1024;
/// The largest class: 64 MiB (larger messages grow their buffer). A
/// buffer that large is kept only by making room (see [`KEEP_BYTES`]);
/// reusing it saves faulting in 16,384 pages per message.
const MAX_CLASS: u32 = 26;
const MIN_CLASS: u32 = POOL_MIN.trailing_zeros();
const CLASSES: usize = (MAX_CLASS - MIN_CLASS + 1) as usize;
/// Bytes one class keeps at most (and at least 2 buffers, at most 256).
const KEEP_PER_CLASS: usize = 32 << 20;
/// Bytes kept for reuse at most, all classes together.
const KEEP_BYTES: usize = 64 << 20;

/// A pool of receive buffers.
#[derive(Default)]
pub(crate) struct BufPool {
    inner: Mutex<Classes>,
}

#[derive(Default)]
struct Classes {
    free: [Vec<Vec<u8>>; CLASSES],
    kept: usize,
}

struct Pooled {
    buf: Vec<u8>,
    pool: Weak<BufPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give_back(std::mem::take(&mut self.buf));
        }
    }
}

/// The class whose buffers hold `len` bytes (`len` rounded up to a power of
/// two), if pooled.
fn class_for_len(len: usize) -> Option<usize> {
    if !(POOL_MIN..=1 << MAX_CLASS).contains(&len) {
        return None;
    }
    Some((len.next_power_of_two().trailing_zeros() - MIN_CLASS) as usize)
}

/// The largest class a buffer of `cap` bytes can serve.
fn class_for_cap(cap: usize) -> Option<usize> {
    if cap < POOL_MIN {
        return None;
    }
    let log = (usize::BITS - 1 - cap.leading_zeros()).min(MAX_CLASS);
    Some((log - MIN_CLASS) as usize)
}

fn class_bytes(c: usize) -> usize {
    1 << (c as u32 + MIN_CLASS)
}

fn class_keep(c: usize) -> usize {
    (KEEP_PER_CLASS / class_bytes(c)).clamp(2, 256)
}

impl BufPool {
    /// An empty buffer with room for `len` bytes.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let Some(c) = class_for_len(len) else {
            return Vec::with_capacity(len);
        };
        let mut inner = lock(&self.inner);
        if let Some(mut v) = inner.free[c].pop() {
            inner.kept -= v.capacity();
            drop(inner);
            v.clear();
            return v;
        }
        drop(inner);
        Vec::with_capacity(class_bytes(c))
    }

    /// An empty buffer with room for `len` bytes that, when newly
    /// allocated, has no more: for buffers of one size many of which are
    /// held at once (receives posted ahead), where rounding up to the next
    /// class would double their memory (a 16 KiB message and its header
    /// in a 32 KiB buffer). Such a buffer comes back to the class below
    /// its size, and is looked for there first, among the few returned
    /// last.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn take_exact(&self, len: usize) -> Vec<u8> {
        if let Some(below) = class_for_cap(len) {
            let mut inner = lock(&self.inner);
            let free = &mut inner.free[below];
            let fits = free
                .iter()
                .rev()
                .take(4)
                .position(|v| v.capacity() >= len)
                .map(|back| free.len() - 1 - back);
            if let Some(i) = fits {
                let mut v = free.swap_remove(i);
                inner.kept -= v.capacity();
                drop(inner);
                v.clear();
                return v;
            }
        }
        if len.is_power_of_two() {
            return self.take(len);
        }
        Vec::with_capacity(len)
    }

    /// Hand `buf` to the user; pooled-size buffers come back here when dropped.
    pub(crate) fn freeze(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        if buf.capacity() >= POOL_MIN {
            Bytes::from_owner(Pooled {
                buf,
                pool: Arc::downgrade(self),
            })
        } else {
            Bytes::from(buf)
        }
    }

    /// Keep `buf` for reuse, making room in the fullest other class if all
    /// classes together would keep too much.
    pub(crate) fn give_back(&self, buf: Vec<u8>) {
        let Some(c) = class_for_cap(buf.capacity()) else {
            return;
        };
        let size = buf.capacity();
        if size > KEEP_BYTES {
            return;
        }
        let mut inner = lock(&self.inner);
        if inner.free[c].len() >= class_keep(c) {
            return;
        }
        while inner.kept + size > KEEP_BYTES {
            let fullest = (0..CLASSES)
                .filter(|&o| o != c && !inner.free[o].is_empty())
                .max_by_key(|&o| inner.free[o].len() * class_bytes(o));
            let Some(o) = fullest else { return };
            if let Some(old) = inner.free[o].pop() {
                inner.kept -= old.capacity();
            }
        }
        inner.kept += size;
        inner.free[c].push(buf);
    }

    #[cfg(test)]
    fn kept(&self) -> (usize, usize) {
        let inner = lock(&self.inner);
        (inner.free.iter().map(Vec::len).sum(), inner.kept)
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_come_back_and_are_reused() {
        let pool = Arc::new(BufPool::default());
        let mut v = pool.take(POOL_MIN);
        v.resize(POOL_MIN, 7);
        let ptr = v.as_ptr();
        let b = pool.freeze(v);
        let b2 = b.slice(10..20);
        drop(b);
        assert_eq!(pool.kept().0, 0, "still shared by a slice");
        assert_eq!(&b2[..], &[7u8; 10]);
        drop(b2);
        let again = pool.take(POOL_MIN);
        assert_eq!(again.as_ptr(), ptr);
        assert!(again.is_empty());
        // Small ones are plain allocations.
        let small = pool.freeze(pool.take(10));
        drop(small);
        assert_eq!(pool.kept(), (0, 0));
    }

    #[test]
    fn classes_round_up_and_serve_any_length_they_hold() {
        let pool = Arc::new(BufPool::default());
        let v = pool.take(5000);
        assert_eq!(v.capacity(), 8192);
        drop(pool.freeze(v));
        let same = pool.take(8192);
        assert_eq!(same.capacity(), 8192, "same class");
        // A buffer that grew past a power of two serves the class below.
        let mut grown = Vec::with_capacity(3 << 20);
        grown.push(1u8);
        drop(pool.freeze(grown));
        let below = pool.take(2 << 20);
        assert!(below.capacity() >= 2 << 20);
        assert_eq!(pool.kept(), (0, 0));
    }

    #[test]
    fn exact_buffers_are_their_size_and_come_back_to_the_class_below() {
        let pool = Arc::new(BufPool::default());
        let len = (16 << 10) + 32;
        let v = pool.take_exact(len);
        assert_eq!(v.capacity(), len, "not rounded up to 32 KiB");
        let ptr = v.as_ptr();
        let plain = pool.take(16 << 10);
        assert_eq!(plain.capacity(), 16 << 10);
        drop(pool.freeze(v));
        // A 16 KiB buffer returned after it is too small, and passed over.
        drop(pool.freeze(plain));
        let again = pool.take_exact(len);
        assert_eq!(again.as_ptr(), ptr, "reused from the 16 KiB class");
        assert!(again.is_empty());
        // The class below serves ordinary takes too.
        assert_eq!(pool.take(16 << 10).capacity(), 16 << 10);
        assert_eq!(pool.kept(), (0, 0));
        // Powers of two are plain takes.
        assert_eq!(pool.take_exact(8 << 10).capacity(), 8 << 10);
    }

    #[test]
    fn a_full_pool_makes_room_for_the_size_now_in_use() {
        let pool = Arc::new(BufPool::default());
        // Fill the pool to its byte limit with 256 and 512 KiB buffers.
        let small: Vec<Bytes> = [256usize << 10, 512 << 10]
            .iter()
            .flat_map(|&len| (0..KEEP_PER_CLASS / len).map(move |_| len))
            .map(|len| pool.freeze(pool.take(len)))
            .collect();
        drop(small);
        assert_eq!(pool.kept().1, KEEP_BYTES, "full");
        let big = pool.take(1 << 20);
        let ptr = big.as_ptr();
        drop(pool.freeze(big));
        let again = pool.take(1 << 20);
        assert_eq!(again.as_ptr(), ptr, "the 1 MiB buffer was kept");
        assert!(pool.kept().1 <= KEEP_BYTES);
    }
}

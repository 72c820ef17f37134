//! Recycled receive buffers for large messages.
//!
//! A received message is handed to the user as `Bytes`. For large messages,
//! a fresh allocation each time means the kernel faults in every page again
//! (4,096 faults for 16 MiB, which capped 16 MiB streaming at a fraction of
//! the 1 MiB rate). Instead, large buffers come from this pool and go back to
//! it when the user drops the last `Bytes` that shares them.

use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

use crate::sync::lock;

/// Messages at least this large use pooled buffers (below, the allocator
/// reuses memory well; above, fresh mappings fault their pages in).
pub(crate) const POOL_MIN: usize = 32 * 1024;
/// Buffers kept for reuse (a window of large messages in flight).
const KEEP: usize = 256;
/// Bytes kept for reuse at most (two receive budgets' worth by default).
const KEEP_BYTES: usize = 64 << 20;

/// A pool of large buffers.
#[derive(Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
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

impl BufPool {
    /// An empty buffer with room for `len` bytes.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        if len >= POOL_MIN {
            let mut free = lock(&self.free);
            // The smallest kept buffer that fits and is not wastefully big.
            let best = (0..free.len())
                .filter(|i| {
                    free[*i].capacity() >= len && free[*i].capacity() <= len.saturating_mul(2)
                })
                .min_by_key(|i| free[*i].capacity());
            if let Some(i) = best {
                // `remove`, not `swap_remove`: the order is the age order.
                let mut v = free.remove(i);
                v.clear();
                return v;
            }
        }
        Vec::with_capacity(len)
    }

    /// Hand `buf` to the user; large buffers come back here when dropped.
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

    /// Keep `buf` for reuse. When the pool is full, the oldest buffers make
    /// room: they are likely of a size the program no longer receives (a
    /// pool full of 256 KiB buffers must not turn away the 1 MiB ones and
    /// leave every 1 MiB message to fault its pages in afresh).
    fn give_back(&self, buf: Vec<u8>) {
        if buf.capacity() > KEEP_BYTES {
            return;
        }
        let mut free = lock(&self.free);
        let mut kept: usize = free.iter().map(Vec::capacity).sum();
        while !free.is_empty() && (free.len() >= KEEP || kept + buf.capacity() > KEEP_BYTES) {
            kept -= free.remove(0).capacity();
        }
        free.push(buf);
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
        assert!(lock(&pool.free).is_empty(), "still shared by a slice");
        assert_eq!(&b2[..], &[7u8; 10]);
        drop(b2);
        let again = pool.take(POOL_MIN);
        assert_eq!(again.as_ptr(), ptr);
        assert!(again.is_empty());
        // Small ones are plain allocations.
        let small = pool.freeze(pool.take(10));
        drop(small);
        assert!(lock(&pool.free).is_empty());
    }

    #[test]
    fn a_full_pool_makes_room_for_the_size_now_in_use() {
        let pool = Arc::new(BufPool::default());
        let small: Vec<Bytes> = (0..KEEP)
            .map(|_| pool.freeze(pool.take(POOL_MIN)))
            .collect();
        drop(small);
        assert_eq!(lock(&pool.free).len(), KEEP);
        let big = pool.take(4 * POOL_MIN);
        let ptr = big.as_ptr();
        drop(pool.freeze(big));
        let again = pool.take(4 * POOL_MIN);
        assert_eq!(again.as_ptr(), ptr, "the large buffer was kept");
        assert_eq!(lock(&pool.free).len(), KEEP - 1);
    }
}

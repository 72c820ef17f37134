//! Synchronisation primitives of the model-checked parts (the ring's atomics,
//! the completion slot's mutex), swapped for loom's models under
//! `--cfg btl_loom`.
//!
//! (`--cfg loom` would also switch tokio into its own loom mode, which does not
//! build outside tokio's repository; hence a cfg name of our own.)
//!
//! Also [`SpinLock`], the lock of `sm`'s send side (plain std atomics in
//! every build: the code it guards is not model-checked).

#[cfg(btl_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(btl_loom)]
pub(crate) use loom::sync::{Mutex as ModelMutex, MutexGuard as ModelGuard};

#[cfg(not(btl_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(btl_loom))]
pub(crate) use std::sync::{Mutex as ModelMutex, MutexGuard as ModelGuard};

use std::sync::{Mutex, MutexGuard};

/// Lock a mutex, recovering the data if a panicking thread poisoned it: every
/// critical section in this crate leaves its data consistent between
/// statements, so the data is still usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// [`lock`] for the model-checked mutex.
pub(crate) fn lock_model<T>(m: &ModelMutex<T>) -> ModelGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Spins a waiter makes on a held [`SpinLock`] before it yields its
/// thread to the OS scheduler (the holder may have been preempted).
const SPINS_BEFORE_YIELD: u32 = 64;

/// A lock whose release is a plain store (Release): on x86 a store needs
/// no locked instruction, where `std::sync::Mutex`'s release is a swap,
/// which waits until every store of the critical section has left the
/// core's store buffer. On the send path of `sm` those stores are a fast
/// box's slot, whose line the receiver's core still holds: a small send
/// paid that wait at every release. Waiters spin a little and then yield
/// their thread; there is no queue and no fairness, so this is for short
/// critical sections that never block (a syscall that returns at once,
/// such as ringing a doorbell, is fine).
///
/// Like [`lock`], it has no poisoning: a panic inside a critical section
/// releases the lock as the guard unwinds, and every critical section that
/// uses it leaves its data consistent between statements.
pub(crate) struct SpinLock<T> {
    held: std::sync::atomic::AtomicBool,
    data: std::cell::UnsafeCell<T>,
}

// SAFETY: the lock hands out at most one guard at a time (the Acquire
// compare-exchange from false to true succeeds for one taker until the
// guard's Release store of false), and only a guard reaches `data`; so the
// value moves between threads as it would through a `Mutex<T>`, which is
// `Sync` for `T: Send`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

/// The held [`SpinLock`]; releases it when dropped.
pub(crate) struct SpinGuard<'a, T>(&'a SpinLock<T>);

impl<T> SpinLock<T> {
    pub(crate) fn new(value: T) -> Self {
        SpinLock {
            held: std::sync::atomic::AtomicBool::new(false),
            data: std::cell::UnsafeCell::new(value),
        }
    }

    /// Take the lock if it is free now.
    #[inline]
    pub(crate) fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        use std::sync::atomic::Ordering;
        // Acquire pairs with the Release store of the guard that last held
        // it: everything done under the lock before is visible to us.
        self.held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| SpinGuard(self))
    }

    /// Take the lock, waiting for it.
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        match self.try_lock() {
            Some(g) => g,
            None => self.lock_contended(),
        }
    }

    #[cold]
    #[inline(never)]
    fn lock_contended(&self) -> SpinGuard<'_, T> {
        let mut spins = 0u32;
        loop {
            // Wait with plain loads (no locked instruction while it is held).
            while self.held.load(std::sync::atomic::Ordering::Relaxed) {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if let Some(g) = self.try_lock() {
                return g;
            }
        }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // Release: the critical section's writes happen before the next
        // holder's Acquire in `try_lock`.
        self.0
            .held
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

impl<T> std::ops::Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see the `Sync` argument) and
        // lives no longer than the lock; no `&mut` to the value exists but
        // through this guard, which `&self` borrows.
        unsafe { &*self.0.data.get() }
    }
}

impl<T> std::ops::DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only
        // reference to the value while it lives.
        unsafe { &mut *self.0.data.get() }
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::SpinLock;

    #[test]
    fn a_spin_lock_keeps_its_holders_apart() {
        let l = std::sync::Arc::new(SpinLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        // Two steps under the lock: a lost update or a torn
                        // pair shows up in the count.
                        let mut g = l.lock();
                        let v = *g;
                        std::hint::black_box(&mut *g);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*l.lock(), 80_000);
    }

    #[test]
    fn try_lock_fails_while_held_and_a_panic_releases_it() {
        let l = SpinLock::new(1u8);
        let g = l.lock();
        assert!(l.try_lock().is_none());
        drop(g);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = l.lock();
            panic!("inside the critical section");
        }));
        assert!(r.is_err());
        assert_eq!(*l.try_lock().expect("released by the unwinding guard"), 1);
    }
}

//! Synchronisation primitives, swapped for loom's models under
//! `--cfg btl_loom` so the ring and completion slots can be model-checked.
//!
//! (`--cfg loom` would also switch tokio into its own loom mode, which does not
//! build outside tokio's repository; hence a cfg name of our own.)

#[cfg(btl_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(btl_loom)]
pub(crate) use loom::sync::{Arc, Mutex};

#[cfg(not(btl_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(btl_loom))]
pub(crate) use std::sync::{Arc, Mutex};

/// Lock a mutex, recovering the data if a panicking thread poisoned it: every
/// critical section in this crate leaves its data consistent between
/// statements, so the data is still usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

#[cfg(btl_loom)]
pub(crate) use loom::sync::MutexGuard;
#[cfg(not(btl_loom))]
pub(crate) use std::sync::MutexGuard;

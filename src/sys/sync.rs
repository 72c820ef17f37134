//! Synchronisation primitives of the model-checked parts (the ring's atomics,
//! the completion slot's mutex), swapped for loom's models under
//! `--cfg btl_loom`.
//!
//! (`--cfg loom` would also switch tokio into its own loom mode, which does not
//! build outside tokio's repository; hence a cfg name of our own.)

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

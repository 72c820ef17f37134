//! The cache of peers' allocations mapped into this process.
//!
//! Opening a peer's IPC handle costs about 100 µs on a real driver, so a
//! mapping is kept after its operation, keyed by the owner's rank, the
//! allocation's base and the handle identity (the VMM id the owner serves
//! it under, or a digest of the legacy handle): a key forged from a real
//! one by changing its id is not served from a mapping the real key
//! opened, and several regions the owner registered inside one allocation
//! (each exported under an id of its own) each keep their entry. A hit
//! also needs the same length and buffer id: a buffer freed and allocated
//! again at the same address has a new id, so it never reaches the old
//! mapping, and a miss drops every entry at that base whose length or
//! buffer id differs, since that memory is gone. Entries are shared (`Arc`):
//! an operation holds its mapping until its copy is done, and the bound
//! on the number of entries evicts the least recently used entry that no
//! operation holds, never one in use (an evicted entry in use is unmapped
//! when its last holder lets go, since the mapping's owner unmaps on
//! drop).
//!
//! When the driver says the allocation is already mapped here (a stale
//! entry for the same memory under another base or length still holds
//! it), the entries of that owner overlapping the range are dropped and
//! the open is tried again; failing that, every unused entry of that owner
//! is dropped and it is tried once more.

use std::collections::HashMap;
use std::sync::Arc;

use super::gpu::GpuError;
use crate::Rank;

/// What the cache did, for `Stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CacheCounts {
    /// Lookups that found a live mapping.
    pub(crate) hits: u64,
    /// Lookups that opened a new one.
    pub(crate) opens: u64,
    /// Entries dropped because the buffer id or length changed.
    pub(crate) stale: u64,
    /// Entries dropped for the bound.
    pub(crate) evicted: u64,
    /// Opens retried after "already mapped".
    pub(crate) remapped: u64,
}

struct Slot<M> {
    len: u64,
    buffer_id: u64,
    map: Arc<M>,
    used: u64,
}

/// Mappings of peers' allocations (see the module's documentation).
pub(crate) struct Cache<M> {
    entries: HashMap<(Rank, u64, [u8; 16]), Slot<M>>,
    limit: usize,
    tick: u64,
    counts: CacheCounts,
}

impl<M> Cache<M> {
    /// An empty cache holding at most `limit` entries no operation uses.
    pub(crate) fn new(limit: usize) -> Cache<M> {
        Cache {
            entries: HashMap::new(),
            limit: limit.max(1),
            tick: 0,
            counts: CacheCounts::default(),
        }
    }

    /// The mapping of `owner`'s allocation at `base` (`len` bytes, buffer
    /// `buffer_id`, reached through the handle that `handle` names): from
    /// the cache, or made by `open`. A key with another handle for the
    /// same memory (a forged one, or a region the owner dropped and
    /// offered again) does not hit: it is opened, and the owner decides.
    pub(crate) fn get_or_open(
        &mut self,
        owner: Rank,
        base: u64,
        len: u64,
        buffer_id: u64,
        handle: [u8; 16],
        mut open: impl FnMut() -> Result<M, GpuError>,
    ) -> Result<Arc<M>, GpuError> {
        self.tick += 1;
        if let Some(s) = self.entries.get_mut(&(owner, base, handle)) {
            if s.len == len && s.buffer_id == buffer_id {
                s.used = self.tick;
                self.counts.hits += 1;
                return Ok(s.map.clone());
            }
        }
        // A miss: whatever this owner mapped at `base` under another
        // length or buffer id is memory that no longer exists.
        let before = self.entries.len();
        self.entries.retain(|&(o, b, _), s| {
            o != owner || b != base || (s.len == len && s.buffer_id == buffer_id)
        });
        self.counts.stale += (before - self.entries.len()) as u64;
        let m = match open() {
            Err(GpuError::AlreadyMapped) => {
                self.counts.remapped += 1;
                let end = base.saturating_add(len);
                self.entries.retain(|&(o, b, _), s| {
                    o != owner || b >= end || b.saturating_add(s.len) <= base
                });
                match open() {
                    Err(GpuError::AlreadyMapped) => {
                        self.entries
                            .retain(|&(o, _, _), s| o != owner || Arc::strong_count(&s.map) > 1);
                        open()?
                    }
                    other => other?,
                }
            }
            other => other?,
        };
        self.counts.opens += 1;
        let map = Arc::new(m);
        self.entries.insert(
            (owner, base, handle),
            Slot {
                len,
                buffer_id,
                map: map.clone(),
                used: self.tick,
            },
        );
        self.trim();
        Ok(map)
    }

    /// Evict least recently used entries that nobody holds until at most
    /// `limit` remain (or only entries in use are left).
    fn trim(&mut self) {
        while self.entries.len() > self.limit {
            let victim = self
                .entries
                .iter()
                .filter(|(_, s)| Arc::strong_count(&s.map) == 1)
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| *k);
            match victim {
                Some(k) => {
                    self.entries.remove(&k);
                    self.counts.evicted += 1;
                }
                None => break,
            }
        }
    }

    /// Drop every entry of `owner` (it left or was lost); mappings still
    /// held by operations go when those do.
    pub(crate) fn forget(&mut self, owner: Rank) {
        self.entries.retain(|&(o, _, _), _| o != owner);
    }

    /// Entries held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// What the cache did so far.
    pub(crate) fn counts(&self) -> CacheCounts {
        self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A mapping that counts its unmaps.
    struct Map(Arc<AtomicUsize>, u64);
    impl Drop for Map {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn opener(unmaps: &Arc<AtomicUsize>, id: u64) -> impl FnMut() -> Result<Map, GpuError> {
        let u = unmaps.clone();
        move || Ok(Map(u.clone(), id))
    }

    #[test]
    fn a_hit_needs_the_same_buffer_id_and_length() {
        let unmaps = Arc::new(AtomicUsize::new(0));
        let mut c = Cache::new(8);
        let a = c
            .get_or_open(1, 0x1000, 4096, 7, [0; 16], opener(&unmaps, 1))
            .unwrap();
        let b = c
            .get_or_open(1, 0x1000, 4096, 7, [0; 16], opener(&unmaps, 2))
            .unwrap();
        assert_eq!((a.1, b.1), (1, 1), "the second lookup hits");
        assert!(
            c.get_or_open(2, 0x1000, 4096, 7, [0; 16], opener(&unmaps, 3))
                .unwrap()
                .1
                == 3
        );
        drop((a, b));
        // Freed and allocated again at the same address: a new buffer id.
        let fresh = c
            .get_or_open(1, 0x1000, 4096, 8, [0; 16], opener(&unmaps, 4))
            .unwrap();
        assert_eq!(fresh.1, 4);
        assert_eq!(
            unmaps.load(Ordering::Relaxed),
            1,
            "the stale mapping is gone"
        );
        // The same memory through another handle (a forged key, or one
        // offered again): opened anew.
        let other = c
            .get_or_open(1, 0x1000, 4096, 8, [9; 16], opener(&unmaps, 6))
            .unwrap();
        assert_eq!(other.1, 6);
        drop(other);
        let longer = c
            .get_or_open(1, 0x1000, 8192, 8, [0; 16], opener(&unmaps, 5))
            .unwrap();
        assert_eq!(longer.1, 5);
        let k = c.counts();
        assert_eq!((k.hits, k.opens, k.stale), (1, 5, 3));
    }

    #[test]
    fn regions_registered_inside_one_allocation_keep_an_entry_each() {
        let unmaps = Arc::new(AtomicUsize::new(0));
        let mut c = Cache::new(8);
        // Two regions of one allocation, exported under two ids: used in
        // turn, each opens once and hits from then on.
        for round in 0..3 {
            for (id, handle) in [(1, [1; 16]), (2, [2; 16])] {
                let m = c
                    .get_or_open(1, 0x1000, 1 << 20, 7, handle, opener(&unmaps, id))
                    .unwrap();
                assert_eq!(m.1, id, "round {round}: each region its own mapping");
            }
        }
        let k = c.counts();
        assert_eq!((k.hits, k.opens, k.stale), (4, 2, 0));
        assert_eq!(unmaps.load(Ordering::Relaxed), 0);
        // The allocation freed and another made at the same address: both
        // old entries go on the first miss.
        drop(
            c.get_or_open(1, 0x1000, 1 << 20, 8, [3; 16], opener(&unmaps, 3))
                .unwrap(),
        );
        assert_eq!(unmaps.load(Ordering::Relaxed), 2);
        assert_eq!((c.len(), c.counts().stale), (1, 2));
    }

    #[test]
    fn already_mapped_evicts_overlaps_then_everything_unused_of_that_owner() {
        let unmaps = Arc::new(AtomicUsize::new(0));
        let mut c = Cache::new(8);
        drop(
            c.get_or_open(1, 0x1000, 0x2000, 1, [0; 16], opener(&unmaps, 1))
                .unwrap(),
        );
        drop(
            c.get_or_open(1, 0x9000, 0x1000, 2, [0; 16], opener(&unmaps, 2))
                .unwrap(),
        );
        drop(
            c.get_or_open(2, 0x1800, 0x1000, 3, [0; 16], opener(&unmaps, 3))
                .unwrap(),
        );
        // The same memory again under another base: the driver refuses
        // once, while the overlapping entry of owner 1 maps it.
        let mut refusals = 1;
        let u = unmaps.clone();
        let m = c
            .get_or_open(1, 0x1800, 0x1000, 4, [0; 16], || {
                if refusals > 0 {
                    refusals -= 1;
                    Err(GpuError::AlreadyMapped)
                } else {
                    Ok(Map(u.clone(), 4))
                }
            })
            .unwrap();
        assert_eq!(m.1, 4);
        assert_eq!(unmaps.load(Ordering::Relaxed), 1, "only the overlap went");
        assert_eq!(c.len(), 3, "owner 2's entry and owner 1's other stay");
        // Refused twice: every unused entry of the owner goes, the one in
        // use stays.
        let mut refusals = 2;
        let u = unmaps.clone();
        let n = c
            .get_or_open(1, 0x20000, 0x1000, 5, [0; 16], || {
                if refusals > 0 {
                    refusals -= 1;
                    Err(GpuError::AlreadyMapped)
                } else {
                    Ok(Map(u.clone(), 5))
                }
            })
            .unwrap();
        assert_eq!(n.1, 5);
        assert_eq!(
            unmaps.load(Ordering::Relaxed),
            2,
            "0x9000 went, 0x1800 is in use"
        );
        assert_eq!(c.len(), 3);
        // Refused three times: the error reaches the caller.
        assert_eq!(
            c.get_or_open(1, 0x40000, 1, 6, [0; 16], || Err::<Map, _>(
                GpuError::AlreadyMapped
            ))
            .err(),
            Some(GpuError::AlreadyMapped)
        );
        assert_eq!(c.counts().remapped, 3);
    }

    #[test]
    fn the_bound_never_evicts_a_mapping_in_use() {
        let unmaps = Arc::new(AtomicUsize::new(0));
        let mut c = Cache::new(2);
        let held: Vec<_> = (0..3)
            .map(|i| {
                c.get_or_open(1, i * 0x1000, 0x1000, i, [0; 16], opener(&unmaps, i))
                    .unwrap()
            })
            .collect();
        assert_eq!(c.len(), 3, "all three are in use: none evicted");
        assert_eq!(unmaps.load(Ordering::Relaxed), 0);
        drop(held);
        // Touch 0 so that 1 is the least recently used.
        drop(
            c.get_or_open(1, 0, 0x1000, 0, [0; 16], opener(&unmaps, 9))
                .unwrap(),
        );
        drop(
            c.get_or_open(1, 0x10000, 0x1000, 10, [0; 16], opener(&unmaps, 10))
                .unwrap(),
        );
        assert_eq!(c.len(), 2);
        assert_eq!(unmaps.load(Ordering::Relaxed), 2);
        assert!(
            c.get_or_open(1, 0, 0x1000, 0, [0; 16], opener(&unmaps, 11))
                .unwrap()
                .1
                == 0
        );
        assert!(
            c.get_or_open(1, 0x10000, 0x1000, 10, [0; 16], opener(&unmaps, 12))
                .unwrap()
                .1
                == 10
        );
        // A third entry evicts the least recently used one (at 0).
        let kept = c
            .get_or_open(3, 0, 1, 1, [0; 16], opener(&unmaps, 13))
            .unwrap();
        assert_eq!(unmaps.load(Ordering::Relaxed), 3);
        // An entry dropped while held is unmapped when let go.
        c.forget(3);
        assert_eq!(unmaps.load(Ordering::Relaxed), 3);
        drop(kept);
        assert_eq!(unmaps.load(Ordering::Relaxed), 4);
    }
}

//! Counters of things that went wrong or that users want to see.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::sys::sync::lock;

/// Live counters of one fabric (shared by its transports).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) bad_frames: AtomicU64,
    pub(crate) access_refused: AtomicU64,
    /// Puts and gets with device memory taken by the host-staged path.
    pub(crate) staged_device_ops: AtomicU64,
    /// Sends of device memory whose bytes the receiver copied.
    pub(crate) lent_sends: AtomicU64,
    /// Emulated put requests and get answers built in place.
    pub(crate) emulated_sent_in_place: AtomicU64,
    /// Emulated puts and get answers written from where they arrived.
    pub(crate) emulated_landed_in_place: AtomicU64,
    pub(crate) peers_lost: AtomicU64,
    /// Set once the address exchange is done.
    pub(crate) rendezvous_refused: AtomicU64,
    /// Counters bumped once per operation (see [`Hot`]).
    hot: HotCounters,
}

/// The counters bumped once per send, receive, put or get.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Hot {
    Sends,
    Recvs,
    DirectPuts,
    DirectGets,
    EmulatedPuts,
    EmulatedGets,
    NativeAtomics,
    EmulatedAtomics,
}

const HOT: usize = 8;

/// Threads that get a row of their own (others share locked adds).
const ROWS: usize = 16;

/// One thread's hot counters: one cache line, written by that thread only.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Row([AtomicU64; HOT]);

/// [`Hot`] counters without a locked instruction per bump (a locked add
/// was a sixth of a small `put_nbi` into a mapped region): each thread
/// that claimed a row adds into it with a plain load and store, which is
/// exact because no other thread writes that row while it holds it; a
/// reader sums the rows. A row goes back to the pool when its thread
/// ends, and the next thread to claim it goes on adding to it (the claim
/// and the release pass through one lock, so it sees the last value).
/// Threads beyond [`ROWS`] at once share locked adds.
#[derive(Debug, Default)]
struct HotCounters {
    rows: [Row; ROWS],
    shared: [AtomicU64; HOT],
}

/// Rows released by threads that ended.
static FREE_ROWS: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// Rows never claimed start here.
static NEXT_ROW: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's row: `UNCLAIMED` until its first bump, `ROWS` when it
    /// has none (all taken, or the thread is ending). Constant-initialised
    /// and without a destructor, so reading it is one load.
    static ROW: Cell<usize> = const { Cell::new(UNCLAIMED) };
    /// Gives the row back when the thread ends.
    static RELEASE: RowRelease = const { RowRelease };
}

const UNCLAIMED: usize = usize::MAX;

struct RowRelease;

impl Drop for RowRelease {
    fn drop(&mut self) {
        let _ = ROW.try_with(|r| {
            let i = r.replace(ROWS);
            if i < ROWS {
                lock(&FREE_ROWS).push(i);
            }
        });
    }
}

/// This thread's row, claimed on first use.
#[inline]
fn row() -> usize {
    let i = ROW.with(Cell::get);
    if i != UNCLAIMED {
        return i;
    }
    claim_row()
}

/// [`row`]'s first use on a thread: kept out of line, so that what the
/// hot path inlines is a thread-local load and a compare.
#[cold]
#[inline(never)]
fn claim_row() -> usize {
    let claimed = lock(&FREE_ROWS).pop().unwrap_or_else(|| {
        let n = NEXT_ROW.fetch_add(1, Ordering::Relaxed);
        n.min(ROWS)
    });
    // Registers the release; if this thread is already ending, keep none.
    let i = match RELEASE.try_with(|_| ()) {
        Ok(()) => claimed,
        Err(_) => {
            if claimed < ROWS {
                lock(&FREE_ROWS).push(claimed);
            }
            ROWS
        }
    };
    ROW.with(|r| r.set(i));
    i
}

impl HotCounters {
    #[inline]
    fn add(&self, h: Hot) {
        match self.rows.get(row()) {
            Some(r) => {
                let c = &r.0[h as usize];
                c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
            }
            None => {
                self.shared[h as usize].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn get(&self, h: Hot) -> u64 {
        let h = h as usize;
        self.rows
            .iter()
            .fold(self.shared[h].load(Ordering::Relaxed), |n, r| {
                n.wrapping_add(r.0[h].load(Ordering::Relaxed))
            })
    }
}

impl Counters {
    /// Add one (statistics only: Relaxed, pairs with nothing).
    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Add one to a per-operation counter (no locked instruction).
    #[inline]
    pub(crate) fn add(&self, h: Hot) {
        self.hot.add(h);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            bad_frames: g(&self.bad_frames),
            access_refused: g(&self.access_refused),
            staged_device_ops: g(&self.staged_device_ops),
            lent_sends: g(&self.lent_sends),
            emulated_sent_in_place: g(&self.emulated_sent_in_place),
            emulated_landed_in_place: g(&self.emulated_landed_in_place),
            peers_lost: g(&self.peers_lost),
            rendezvous_refused: g(&self.rendezvous_refused),
            sends: self.hot.get(Hot::Sends),
            recvs: self.hot.get(Hot::Recvs),
            direct_puts: self.hot.get(Hot::DirectPuts),
            direct_gets: self.hot.get(Hot::DirectGets),
            emulated_puts: self.hot.get(Hot::EmulatedPuts),
            emulated_gets: self.hot.get(Hot::EmulatedGets),
            native_atomics: self.hot.get(Hot::NativeAtomics),
            emulated_atomics: self.hot.get(Hot::EmulatedAtomics),
            // (Filled by the transports: `Transport::add_stats`.)
            sm: Default::default(),
            udp: Default::default(),
            rdma: Default::default(),
        }
    }
}

/// A snapshot of a fabric's counters ([`Fabric::stats`](crate::Fabric::stats)).
///
/// Every field is a count since the fabric opened, and only grows:
/// subtract two snapshots for the activity between them. The struct is
/// `#[non_exhaustive]`: read fields by name, build none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Malformed frames or fragments received and dropped.
    pub bad_frames: u64,
    /// Remote accesses refused here (unknown key, out of range).
    pub access_refused: u64,
    /// Peers declared lost.
    pub peers_lost: u64,
    /// Connections the job's TCP rendezvous refused while this process
    /// served it (rank 0 with `BTL_RENDEZVOUS_HOST=rank0`; 0 elsewhere):
    /// wrong job keys, handshakes cut off or timed out, connections shed
    /// under a flood. The boot log's warning breaks it down by cause.
    pub rendezvous_refused: u64,
    /// Messages sent.
    pub sends: u64,
    /// Messages received and queued for a tag (fast-box messages are added
    /// at the end of the progress call that took them).
    pub recvs: u64,
    /// put operations done by direct copy into a mapped region.
    pub direct_puts: u64,
    /// get operations done by direct copy from a mapped region.
    pub direct_gets: u64,
    /// put operations emulated on messages.
    pub emulated_puts: u64,
    /// get operations emulated on messages.
    pub emulated_gets: u64,
    /// puts and gets with device memory on a side that went by the
    /// host-staged path (also counted as emulated): no transport carries
    /// device memory to that peer, or CUDA IPC with it was refused (the
    /// reason is logged once per peer).
    pub staged_device_ops: u64,
    /// `send_region`s of device memory that were lent: the receiver copied
    /// the bytes out of the sender's region (the others with device memory
    /// went through the host, counted in `staged_device_ops`).
    pub lent_sends: u64,
    /// Requests of emulated puts (whole or in parts) and answers to
    /// emulated gets whose bytes were read straight from their memory
    /// (a region, device memory through the device) into the message the
    /// transport sends (a fragment of `sm`, pinned for the device where
    /// `smcuda` runs), with no buffer between.
    pub emulated_sent_in_place: u64,
    /// Emulated put requests and get answers written into their region
    /// straight from where they arrived (a fragment of `sm`), not copied
    /// out first.
    pub emulated_landed_in_place: u64,
    /// Remote atomics the transport carried natively (a hardware atomic on
    /// a peer's region mapped here).
    pub native_atomics: u64,
    /// Remote atomics emulated over messages (applied by the target).
    pub emulated_atomics: u64,
    /// What `sm` counted of its own paths.
    pub sm: crate::SmStats,
    /// What `udp` counted of its own paths.
    pub udp: crate::UdpStats,
    /// What `rdma` counted of its own paths.
    pub rdma: crate::RdmaStats,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn hot_counters_are_exact_across_more_threads_than_rows_and_reused_rows() {
        let c = Arc::new(Counters::default());
        const PER: u64 = 10_000;
        // More threads at once than there are rows (the rest share locked
        // adds), then waves of short-lived threads that take over released
        // rows and go on adding to them.
        let mut total = 0;
        for wave in 0..4 {
            let n = if wave == 0 { ROWS as u64 + 8 } else { 6 };
            let barrier = Arc::new(std::sync::Barrier::new(n as usize));
            let threads: Vec<_> = (0..n)
                .map(|_| {
                    let (c, b) = (c.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        b.wait();
                        for _ in 0..PER {
                            c.add(Hot::DirectPuts);
                        }
                        c.add(Hot::Sends);
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            total += n;
            let s = c.snapshot();
            assert_eq!(s.direct_puts, total * PER, "wave {wave}");
            assert_eq!(s.sends, total, "wave {wave}");
            assert_eq!(s.direct_gets, 0);
        }
    }
}

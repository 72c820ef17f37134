//! Counters of things that went wrong or that users want to see.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of one fabric (shared by its transports).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) bad_frames: AtomicU64,
    pub(crate) access_refused: AtomicU64,
    pub(crate) peers_lost: AtomicU64,
    pub(crate) sends: AtomicU64,
    pub(crate) recvs: AtomicU64,
    pub(crate) direct_puts: AtomicU64,
    pub(crate) direct_gets: AtomicU64,
    pub(crate) emulated_puts: AtomicU64,
    pub(crate) emulated_gets: AtomicU64,
    pub(crate) cma_puts: AtomicU64,
    pub(crate) cma_gets: AtomicU64,
    pub(crate) stale_segments_removed: AtomicU64,
    pub(crate) foreign_datagrams: AtomicU64,
    /// Written only by the sm transport under its receive lock (a load and
    /// a store: no locked instruction on the receive path); counted in
    /// `recvs` too, which it is not added to.
    pub(crate) fast_box_recvs: AtomicU64,
    pub(crate) rendezvous_sends: AtomicU64,
    pub(crate) split_tails_written: AtomicU64,
    pub(crate) split_tails_taken_back: AtomicU64,
}

impl Counters {
    /// Add one (statistics only: Relaxed, pairs with nothing).
    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            bad_frames: g(&self.bad_frames),
            access_refused: g(&self.access_refused),
            peers_lost: g(&self.peers_lost),
            sends: g(&self.sends),
            recvs: g(&self.recvs).wrapping_add(g(&self.fast_box_recvs)),
            direct_puts: g(&self.direct_puts),
            direct_gets: g(&self.direct_gets),
            emulated_puts: g(&self.emulated_puts),
            emulated_gets: g(&self.emulated_gets),
            cma_puts: g(&self.cma_puts),
            cma_gets: g(&self.cma_gets),
            stale_segments_removed: g(&self.stale_segments_removed),
            foreign_datagrams: g(&self.foreign_datagrams),
            fast_box_recvs: g(&self.fast_box_recvs),
            rendezvous_sends: g(&self.rendezvous_sends),
            split_tails_written: g(&self.split_tails_written),
            split_tails_taken_back: g(&self.split_tails_taken_back),
            // (Kept by the udp transport; see `Fabric::stats`.)
            udp_gso_sends: 0,
            udp_gro_receives: 0,
            udp_gso_refusals: 0,
        }
    }
}

/// A snapshot of a fabric's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Malformed frames or fragments received and dropped.
    pub bad_frames: u64,
    /// Remote accesses refused here (unknown key, out of range).
    pub access_refused: u64,
    /// Peers declared lost.
    pub peers_lost: u64,
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
    /// put operations done by single copy (CMA) into a registered buffer.
    pub cma_puts: u64,
    /// get operations done by single copy (CMA) from a registered buffer.
    pub cma_gets: u64,
    /// Shared-memory files of crashed jobs removed at start-up.
    pub stale_segments_removed: u64,
    /// UDP datagrams dropped before the protocol saw them: from an unknown
    /// address, not ours (bad magic or version), or carrying another job's
    /// id or the wrong ranks.
    pub foreign_datagrams: u64,
    /// Small messages received through a shared-memory fast box (one slot
    /// per message, no fragment) rather than through fragments.
    pub fast_box_recvs: u64,
    /// Large messages sent by rendezvous: announced, then copied by the
    /// receiver straight from the sender's memory (single copy, CMA).
    pub rendezvous_sends: u64,
    /// Received rendezvous messages whose tail the sender wrote into our
    /// buffer while we read the head (split copy: both cores copying).
    pub split_tails_written: u64,
    /// Offered tails the sender did not take in time (or could not write),
    /// which we then copied ourselves.
    pub split_tails_taken_back: u64,
    /// UDP sends that left as one segmentation-offload (GSO) packet of
    /// several datagrams.
    pub udp_gso_sends: u64,
    /// UDP receives that held several datagrams the kernel joined (GRO).
    pub udp_gro_receives: u64,
    /// UDP GSO sends the kernel refused (a device without checksum
    /// offload, a path smaller than the datagrams): the first turns GSO
    /// off, and the datagrams go out one by one.
    pub udp_gso_refusals: u64,
}

//! What `rdma` reports of its own paths in [`crate::Stats::rdma`].

/// Counters of the `rdma` transport (`Stats::rdma`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaStats {
    /// Puts carried by one RDMA write each.
    pub writes: u64,
    /// Gets carried by one RDMA read each.
    pub reads: u64,
    /// Messages too large for an eager buffer, sent by rendezvous (the
    /// receiver read them with RDMA read).
    pub rendezvous: u64,
    /// Messages a little too large for an eager buffer (up to two
    /// buffers' worth), sent eagerly in two pieces instead of by
    /// rendezvous.
    pub in_pieces: u64,
    /// Times a sender waited for its receiver to return credits.
    pub credit_waits: u64,
    /// Operations posted again after the provider cancelled them (it
    /// tears a connection down after a refused key and rebuilds it).
    pub reposts: u64,
    /// Messages dropped before the protocol used them: from an address
    /// not in this job, another job's, malformed, or naming the wrong rank.
    pub foreign_messages: u64,
    /// Regions the provider could not register (peers reach those
    /// through the target's progress instead).
    pub registration_failures: u64,
    /// Times the runtime stopped watching the completion queue's wait fd
    /// because, over a heartbeat, progress found completions and the
    /// progress task never parked (a stream); its next park watches it
    /// again.
    pub cq_unwatches: u64,
    /// Bundle frames sent: one or more small messages gathered while a
    /// send to the peer was in flight (`BTL_RDMA_BUNDLE`).
    pub bundles: u64,
    /// Messages sent in those frames.
    pub bundled: u64,
}

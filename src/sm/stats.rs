//! What `sm` reports of its own paths in [`crate::Stats::sm`].

/// Counters of the `sm` transport's paths (`Stats::sm`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SmStats {
    /// Small messages received through a fast box (one slot per message,
    /// no fragment) rather than through fragments; counted in
    /// `Stats::recvs` too.
    pub fast_box_recvs: u64,
    /// Messages taken from a single fragment straight into a receiver's
    /// lent buffer (`recv_into`) with no progress turn; counted in
    /// `Stats::recvs` too.
    pub direct_ring_recvs: u64,
    /// Large messages sent by rendezvous: announced, then copied by the
    /// receiver straight from the sender's memory (single copy, CMA).
    pub rendezvous_sends: u64,
    /// Messages from `SmConfig::cma_min` up to `SmConfig::adapt_max` bytes
    /// the sender chose to send through fragments rather than by
    /// rendezvous (see `SmConfig::adapt_max`): because fragments measured
    /// cheaper lately, to measure them (a class's first message), or to
    /// measure them again (one in 64 while single copy is preferred).
    pub chosen_fragment_sends: u64,
    /// Received rendezvous messages whose tail the sender wrote into our
    /// buffer while we read the head (split copy: both cores copying).
    pub split_tails_written: u64,
    /// Offered tails the sender did not take in time (or could not write),
    /// which we then copied ourselves.
    pub split_tails_taken_back: u64,
    /// put operations done by single copy (CMA) into a registered buffer.
    pub cma_puts: u64,
    /// get operations done by single copy (CMA) from a registered buffer.
    pub cma_gets: u64,
    /// Shared-memory files of crashed jobs (of builds that kept segments
    /// in `/dev/shm`) removed at start-up.
    pub stale_segments_removed: u64,
    /// A peer's segment or region refused because its memory was not
    /// sealed against shrinking (mapping it could have killed this
    /// process with SIGBUS).
    pub unsealed_memory_refused: u64,
    /// Requests for this process's shared memory that it refused
    /// (another user, a malformed request, another job, an unknown id),
    /// counted for the whole process.
    pub share_requests_refused: u64,
}

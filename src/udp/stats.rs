//! What `udp` reports of its own paths in [`crate::Stats::udp`] (the
//! protocol's per-connection counters are `Fabric::udp_stats`).

/// Counters of the `udp` transport (`Stats::udp`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct UdpStats {
    /// Datagrams dropped before the protocol saw them: from an unknown
    /// address, not ours (bad magic or version), or carrying another job's
    /// id or the wrong ranks.
    pub foreign_datagrams: u64,
    /// Sends that left as one segmentation-offload (GSO) packet of several
    /// datagrams.
    pub gso_sends: u64,
    /// Receives that held several datagrams the kernel joined (GRO).
    pub gro_receives: u64,
    /// GSO sends the kernel refused (a device without checksum offload, a
    /// path smaller than the datagrams): each turns GSO off towards its
    /// peer, whose datagrams then go out one by one.
    pub gso_refusals: u64,
    /// Datagrams from a peer's address, addressed to us, whose trailer
    /// failed: a CRC mismatch (corruption), or, under `BTL_UDP_AUTH=mac`,
    /// a MAC no rank of the job made (a forgery, or corruption). Dropped.
    pub bad_trailers: u64,
}

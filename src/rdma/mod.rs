//! The `rdma` transport: RDMA write and read, registered memory and
//! completion queues through libfabric (the heir of Open MPI's
//! `btl_udapl`), for peers on other nodes. Built with the `rdma` cargo
//! feature; without it the transport is listed as not built, and its
//! settings are still read and checked.
//!
//! - **Provider.** `BTL_RDMA_PROVIDER` names one; else the best one
//!   libfabric offers: hardware (`verbs;ofi_rxm`, `efa`, `cxi`, `psm2/3`,
//!   `opx`) first, `tcp;ofi_rxm` last; never `shm` (same-node peers use
//!   `sm`), nor providers whose completion queue cannot be slept on, nor
//!   those that need every local buffer registered (`FI_MR_LOCAL`: eager
//!   frames and receive buffers are plain memory).
//!   `BTL_RDMA_ADDR` binds it to one address of this host (tests bind
//!   `127.0.0.1` or a test namespace's address). One reliable-datagram
//!   endpoint per process; peers' addresses travel in the job's exchange
//!   and go into an address vector.
//! - **Memory.** Every region (`Fabric::register`, `alloc_region`) is
//!   registered with the NIC. Where the provider takes requested keys, the
//!   key is 64 bits of a hash of the region's 128-bit random id, so a key
//!   with a forged id names no registration; else the provider's own key.
//!   Either way it travels in the `RemoteKey`'s `rdma` handle with the
//!   remote address (virtual address or offset, as the provider's MR mode
//!   wants) and the registered length, which the initiator checks before
//!   posting (the NIC checks again). A region the NIC could not register
//!   is reached through the target's progress, over messages.
//! - **One-sided.** `put` is one RDMA write with delivery completion (its
//!   future resolves when the data is in the target's memory), `get` one
//!   RDMA read; both are posted from the caller's task and completed by
//!   the progress task from the completion queue. Atomics are emulated
//!   over messages, applied by the target (the core's emulation).
//!   The provider tears a connection down after a refused key, cancelling
//!   its other operations, and builds it again on the next post: an
//!   operation cancelled that way is posted again after a short pause,
//!   until the connection is back or the peer is lost; a refusal is
//!   believed the second time and fails with `Error::Access`, the target's
//!   memory unchanged.
//! - **Messages.** Small messages go eagerly into receive buffers the
//!   receiver posted, under the seed's credit scheme: a sender may have
//!   `BTL_RDMA_CREDITS` frames unconsumed at a receiver, and the receiver
//!   returns credits in every frame it sends and in a credit frame once
//!   half are owed, so a receiver that stops reading holds its senders
//!   back (`Poll::Pending`). A message larger than `BTL_RDMA_EAGER` (64 KiB
//!   over `tcp`, 16 KiB over hardware providers, by default) goes in two
//!   frames if it fits them, else it is
//!   registered where it is and announced; the receiver reads it with RDMA
//!   read and answers when done, which completes the send. Frames carry a
//!   per-pair sequence number: the receiver delivers in order (and drops
//!   copies of frames posted again).
//! - **Progress.** The completion queue is read while hot; the parked task
//!   sleeps on its wait fd through tokio's `AsyncFd`, after `fi_trywait`
//!   says nothing is pending (with a short fallback timer while operations
//!   are in flight). The task runs in every process, also one that only
//!   exposes memory, which manual-progress providers need.
//! - **Liveness.** The provider answers new posts to a dead peer with
//!   EAGAIN forever, so liveness is ours: every peer hears from us at
//!   least every quarter of `BTL_RDMA_PEER_TIMEOUT_MS` (a ping when we
//!   have nothing else to send), and a peer silent for the whole timeout
//!   is lost: every pending operation on it fails with `PeerLost`.
//!   Memory a posted operation uses is kept until the provider completes
//!   it, or until the endpoint is closed.

pub(crate) mod config;
pub(crate) mod stats;
pub(crate) mod wire;

#[cfg(feature = "rdma")]
mod ofi;
#[cfg(feature = "rdma")]
mod transport;

use crate::transport::registry::{Entry, Job, Reach};

/// The RDMA devices the kernel lists.
fn rdma_devices() -> std::result::Result<String, String> {
    const DIR: &str = "/sys/class/infiniband";
    let mut names: Vec<String> = std::fs::read_dir(DIR)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    if names.is_empty() {
        Err(format!("{DIR}: no device"))
    } else {
        Ok(format!("{DIR}: {}", names.join(", ")))
    }
}

/// Whether this job opens `rdma`: when `BTL_TRANSPORTS` names it, or when
/// some rank is on another node (a job on one node has `sm`).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
fn wanted(core: &crate::core::fabric::Core, job: &Job) -> bool {
    let named = core.config().transports.iter().any(|t| t == "rdma");
    job.size >= 2 && (named || job.local_size < job.size)
}

#[cfg(feature = "rdma")]
fn open(
    core: &std::sync::Arc<crate::core::fabric::Core>,
    job: &Job,
) -> crate::Result<Option<std::sync::Arc<dyn crate::transport::Transport>>> {
    if !wanted(core, job) {
        return Ok(None);
    }
    let named = core.config().transports.iter().any(|t| t == "rdma");
    match transport::RdmaTransport::open(core.clone()) {
        Ok(t) => Ok(Some(t as std::sync::Arc<dyn crate::transport::Transport>)),
        Err(e) if named => Err(e),
        Err(e) => {
            tracing::info!("rdma not used: {e}");
            Ok(None)
        }
    }
}

#[cfg(feature = "rdma")]
fn probe() -> std::result::Result<String, String> {
    let devices = rdma_devices().unwrap_or_else(|e| e);
    transport::probe()
        .map(|s| format!("{s}; {devices}"))
        .map_err(|s| format!("{s}; {devices}"))
}

#[cfg(not(feature = "rdma"))]
fn probe() -> std::result::Result<String, String> {
    rdma_devices()
}

/// The registry's entry.
#[linkme::distributed_slice(crate::transport::registry::TRANSPORTS)]
pub(crate) static ENTRY: Entry = Entry {
    name: "rdma",
    rank: 30,
    implicit: false,
    messages: true,
    one_sided: true,
    device_memory: false,
    reach: Reach::Network,
    #[cfg(feature = "rdma")]
    not_built: None,
    #[cfg(not(feature = "rdma"))]
    not_built: Some("built without the `rdma` cargo feature (it needs libfabric: libfabric-dev)"),
    probe,
    #[cfg(feature = "rdma")]
    open,
    #[cfg(not(feature = "rdma"))]
    open: |_, _| Ok(None),
    alloc_shared: None,
};

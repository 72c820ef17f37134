//! The transports this build knows, in preference order, and what the
//! fabric needs of each to use it: a name, a host check that says why not,
//! and how to open it. `Fabric`, configuration (`BTL_TRANSPORTS`),
//! `btl-info` and the address exchange learn about transports only here.
//!
//! Each transport registers itself: its folder holds a
//! `#[linkme::distributed_slice(TRANSPORTS)]` static [`Entry`], which the
//! linker gathers into [`TRANSPORTS`], so neither this module nor the core
//! names any transport. Adding a transport: one folder that implements
//! [`Transport`] and [`Link`](super::Link) and registers its [`Entry`],
//! one `mod` line, and a cargo feature where it needs a system library.

use std::sync::Arc;

use super::Transport;
use crate::core::fabric::Core;
use crate::Result;

/// Where this process stands in its job, for a transport that opens.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Job {
    pub(crate) size: u32,
    pub(crate) local_rank: u32,
    pub(crate) local_size: u32,
}

/// Which peers a transport can reach at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Reach {
    /// Only this rank (`self`).
    ThisRank,
    /// Ranks on this node: two ranks of one node that both publish it need
    /// no network transport between them.
    Node,
    /// Ranks on any node (this one too).
    Network,
}

impl Reach {
    /// Whether it reaches a peer of `class`.
    pub(crate) fn covers(self, class: Reach) -> bool {
        match self {
            Reach::ThisRank => class == Reach::ThisRank,
            Reach::Node => class == Reach::Node,
            Reach::Network => class != Reach::ThisRank,
        }
    }
}

/// How an [`Entry`] allocates memory its peers map (`Fabric::alloc_region`):
/// for key id `id`, `len` zeroed bytes owned by `owner` in the job of
/// `job_tag`; returns the memory, what keeps it, and the key's handle.
pub(crate) type AllocShared = fn(
    id: &[u8; 16],
    len: usize,
    owner: crate::Rank,
    job_tag: [u64; 2],
) -> Result<(
    crate::sys::mem::RawBuf,
    Box<dyn std::any::Any + Send + Sync>,
    crate::core::region::KeyHandle,
)>;

/// How an [`Entry`] opens its transport.
pub(crate) type Open = fn(&Arc<Core>, &Job) -> Result<Option<Arc<dyn Transport>>>;

/// Every registered transport, in no particular order ([`entries`] sorts
/// them).
#[linkme::distributed_slice]
pub(crate) static TRANSPORTS: [Entry];

/// One transport of the registry.
pub(crate) struct Entry {
    /// Its name (`BTL_TRANSPORTS`, `btl-info`, `Endpoint::transport`).
    pub(crate) name: &'static str,
    /// Its place in the preference order (lower first): a peer's messages
    /// go over the first transport that reaches it and carries messages,
    /// its one-sided operations over the first that carries them natively.
    pub(crate) rank: u32,
    /// Used whatever `BTL_TRANSPORTS` says (`self`).
    pub(crate) implicit: bool,
    /// Its links carry messages (a transport may offer only one-sided
    /// operations, beside another that carries its peers' messages).
    pub(crate) messages: bool,
    /// Its links carry one-sided operations natively (`Link::post`), so
    /// that they route those even where another transport carries the
    /// messages.
    pub(crate) one_sided: bool,
    /// It carries one-sided operations on device (GPU) memory and
    /// allocates such memory (`Transport::alloc_device`); a fabric keeps
    /// it open even when it reaches no peer, for its allocations.
    pub(crate) device_memory: bool,
    /// Which peers it can reach at all.
    pub(crate) reach: Reach,
    /// `None` when compiled into this build; else why not (the cargo
    /// feature it needs, or that this version does not have it).
    pub(crate) not_built: Option<&'static str>,
    /// What this host offers it: `Ok(what works)` or `Err(why not)`.
    /// Cheap, no side effects that outlive it.
    pub(crate) probe: fn() -> std::result::Result<String, String>,
    /// Open it in this process: `Ok(None)` when it has nothing to do in
    /// this job (no peer it could reach), or when it only joins a fabric
    /// that names it in `BTL_TRANSPORTS`.
    pub(crate) open: Open,
    /// Allocates regions that peers reach by mapping them, if this
    /// transport has such memory (`sm`: a shared file).
    pub(crate) alloc_shared: Option<AllocShared>,
}

/// Whether the transport named `name` carries device memory (its key
/// handles name device memory).
pub(crate) fn carries_device(name: &str) -> bool {
    TRANSPORTS.iter().any(|e| e.device_memory && e.name == name)
}

/// Every transport this build knows, in preference order.
pub(crate) fn entries() -> Vec<&'static Entry> {
    let mut v: Vec<&'static Entry> = TRANSPORTS.iter().collect();
    v.sort_by_key(|e| (e.rank, e.name));
    v
}

/// The entry named `name`.
pub(crate) fn find(name: &str) -> Option<&'static Entry> {
    entries().into_iter().find(|e| e.name == name)
}

/// The names of every transport this build knows.
pub(crate) fn names() -> Vec<&'static str> {
    entries().iter().map(|e| e.name).collect()
}

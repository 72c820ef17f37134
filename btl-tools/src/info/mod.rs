//! What `btl-info` prints: the library's host report
//! ([`async_btl::info::report`]: transports, CMA, limits) and the CPU
//! topology, read from `/sys` or, with the `hwloc` feature, through hwloc.

#[cfg(feature = "hwloc")]
mod hwloc;
mod topology;

use serde::Serialize;

pub use topology::{format_cpu_list, from_sysfs, parse_cpu_list, topology, NumaNode, Topology};

/// Everything `btl-info` prints. As JSON, the host report's fields and
/// `topology` side by side.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Transports, CMA, limits and configuration errors, from the library.
    #[serde(flatten)]
    pub host: async_btl::info::Report,
    /// NUMA nodes, cores and this process's CPU binding.
    pub topology: Topology,
}

/// Look at this host: the library's report and the topology.
pub fn report() -> Report {
    Report {
        host: async_btl::info::report(),
        topology: topology(),
    }
}

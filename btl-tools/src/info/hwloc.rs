//! The topology through hwloc (the `hwloc` feature, `hwlocality` bindings).

use hwlocality::cpu::binding::CpuBindingFlags;
use hwlocality::cpu::cpuset::CpuSet;
use hwlocality::object::types::ObjectType;

use super::{NumaNode, Topology};

/// The CPUs of a finite set, ascending (an infinite set gives none).
fn cpus(set: &CpuSet) -> Vec<u32> {
    if set.weight().is_none() {
        return Vec::new();
    }
    set.iter_set()
        .filter_map(|i| u32::try_from(usize::from(i)).ok())
        .collect()
}

/// NUMA nodes, packages, cores, PUs and this process's binding, as hwloc
/// sees them.
pub(super) fn topology() -> Result<Topology, String> {
    let hw = hwlocality::Topology::new().map_err(|e| format!("loading the topology: {e}"))?;
    let numa_nodes = hw
        .objects_with_type(ObjectType::NUMANode)
        .map(|node| NumaNode {
            id: node.os_index().unwrap_or(node.logical_index()) as u32,
            cpus: node.cpuset().map(|s| cpus(&s)).unwrap_or_default(),
        })
        .collect();
    let mut pus: Vec<u32> = hw
        .objects_with_type(ObjectType::PU)
        .filter_map(|pu| pu.os_index().and_then(|i| u32::try_from(i).ok()))
        .collect();
    pus.sort_unstable();
    let (binding, note) = match hw.cpu_binding(CpuBindingFlags::PROCESS) {
        Ok(set) => (cpus(&set), None),
        Err(e) => (
            Vec::new(),
            Some(format!("hwloc cannot read the CPU binding: {e}")),
        ),
    };
    Ok(Topology {
        source: "hwloc".into(),
        numa_nodes,
        packages: Some(hw.objects_with_type(ObjectType::Package).count()),
        cores: Some(hw.objects_with_type(ObjectType::Core).count()),
        cpus: pus,
        binding,
        note,
    })
}

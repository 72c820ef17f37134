//! The CPU topology: NUMA nodes, cores and this process's binding. Read
//! from `/sys` by default; through hwloc with the `hwloc` feature (falling
//! back to `/sys` when hwloc fails).

use std::collections::BTreeSet;
use std::path::Path;

use serde::Serialize;

/// NUMA nodes, cores and this process's CPU binding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// Where it was read: `sysfs` or `hwloc`.
    pub source: String,
    /// The NUMA nodes with their CPUs; empty when the kernel exposes none.
    pub numa_nodes: Vec<NumaNode>,
    /// Processor packages (sockets), when known.
    pub packages: Option<usize>,
    /// Physical cores, when known.
    pub cores: Option<usize>,
    /// Online logical CPUs (hardware threads).
    pub cpus: Vec<u32>,
    /// The logical CPUs this process may run on.
    pub binding: Vec<u32>,
    /// What could not be read, if anything.
    pub note: Option<String>,
}

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    /// The node's number.
    pub id: u32,
    /// Its logical CPUs.
    pub cpus: Vec<u32>,
}

/// This host's topology: through hwloc with the `hwloc` feature, else from `/sys`.
pub fn topology() -> Topology {
    #[cfg(feature = "hwloc")]
    {
        match super::hwloc::topology() {
            Ok(t) => return t,
            Err(why) => {
                let mut t = from_sysfs();
                t.note = Some(format!("hwloc failed ({why}); read /sys instead"));
                return t;
            }
        }
    }
    #[allow(unreachable_code)]
    from_sysfs()
}

const CPU: &str = "/sys/devices/system/cpu";
const NODE: &str = "/sys/devices/system/node";

/// The topology as `/sys` and `sched_getaffinity` describe it.
pub fn from_sysfs() -> Topology {
    let mut notes = Vec::new();
    let cpus = read_list(&format!("{CPU}/online")).unwrap_or_else(|why| {
        notes.push(why);
        Vec::new()
    });
    let mut numa_nodes: Vec<NumaNode> = std::fs::read_dir(NODE)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let name = e.file_name();
                    let id = name.to_str()?.strip_prefix("node")?.parse().ok()?;
                    let cpus = read_list(&format!("{NODE}/node{id}/cpulist")).ok()?;
                    Some(NumaNode { id, cpus })
                })
                .collect()
        })
        .unwrap_or_default();
    numa_nodes.sort_by_key(|n| n.id);
    if numa_nodes.is_empty() {
        notes.push(format!("no NUMA nodes under {NODE}"));
    }
    let ids = |file: &str| -> Option<Vec<String>> {
        cpus.iter()
            .map(|c| std::fs::read_to_string(format!("{CPU}/cpu{c}/topology/{file}")).ok())
            .map(|s| s.map(|s| s.trim().to_string()))
            .collect()
    };
    let (packages, cores) = match (ids("physical_package_id"), ids("core_id")) {
        (Some(p), Some(c)) if !cpus.is_empty() => {
            let cores: BTreeSet<_> = p.iter().zip(&c).collect();
            let packages: BTreeSet<_> = p.iter().collect();
            (Some(packages.len()), Some(cores.len()))
        }
        _ => {
            notes.push(format!("no core topology under {CPU}/cpu*/topology"));
            (None, None)
        }
    };
    let binding = async_btl::info::cpu_affinity().unwrap_or_else(|e| {
        notes.push(format!("sched_getaffinity failed: {e}"));
        Vec::new()
    });
    Topology {
        source: "sysfs".into(),
        numa_nodes,
        packages,
        cores,
        cpus,
        binding,
        note: (!notes.is_empty()).then(|| notes.join("; ")),
    }
}

fn read_list(path: &str) -> Result<Vec<u32>, String> {
    let text = std::fs::read_to_string(Path::new(path)).map_err(|e| format!("{path}: {e}"))?;
    parse_cpu_list(&text).ok_or_else(|| format!("{path}: not a CPU list: {:?}", text.trim()))
}

/// Parse the kernel's CPU list format (`0-3,8,10-11`); `None` when malformed.
pub fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi): (u32, u32) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
            None => {
                let n = part.trim().parse().ok()?;
                (n, n)
            }
        };
        if lo > hi || hi - lo > 1 << 16 {
            return None;
        }
        out.extend(lo..=hi);
    }
    Some(out)
}

/// Format CPUs (ascending) in the kernel's list format: `0-3,8`.
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        while i + 1 < cpus.len() && cpus[i + 1] == cpus[i] + 1 {
            i += 1;
        }
        parts.push(match cpus[i] {
            end if end == start => start.to_string(),
            end => format!("{start}-{end}"),
        });
        i += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_round_trip() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(format_cpu_list(&[]), "");
        for bad in ["x", "3-1", "1-", "0-99999999", "1,,a"] {
            assert_eq!(parse_cpu_list(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn sysfs_sees_this_process_bound_somewhere() {
        let t = from_sysfs();
        assert!(!t.binding.is_empty(), "{t:?}");
        assert!(t
            .binding
            .iter()
            .all(|c| t.cpus.is_empty() || t.cpus.contains(c)));
    }
}

//! Pinning a rank to a core (`sched_setaffinity`), so that runs repeat and
//! the baselines run on the same cores as async-btl.

use async_btl::{Error, Result};

/// Which cores the ranks run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pinning {
    /// Rank i on core i (modulo the number of cores).
    Auto,
    /// Leave affinity alone.
    None,
    /// Rank i on the i-th listed core (modulo the list's length).
    Cores(Vec<usize>),
}

impl std::str::FromStr for Pinning {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "auto" | "" => Ok(Pinning::Auto),
            "none" | "off" => Ok(Pinning::None),
            list => list
                .split(',')
                .map(|c| c.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(Pinning::Cores)
                .map_err(|_| format!("--pin takes auto, none or a core list like 0,1 (got {s:?})")),
        }
    }
}

impl std::fmt::Display for Pinning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pinning::Auto => f.write_str("auto (rank i on core i)"),
            Pinning::None => f.write_str("none"),
            Pinning::Cores(c) => {
                let v: Vec<String> = c.iter().map(|c| c.to_string()).collect();
                write!(f, "cores {}", v.join(","))
            }
        }
    }
}

impl Pinning {
    /// The core for `rank`, or `None` when not pinning.
    pub fn core_for(&self, rank: u32, cores: usize) -> Option<usize> {
        match self {
            Pinning::None => None,
            Pinning::Auto => Some(rank as usize % cores.max(1)),
            Pinning::Cores(list) if list.is_empty() => None,
            Pinning::Cores(list) => Some(list[rank as usize % list.len()]),
        }
    }
}

/// Restrict the calling thread (and the threads it starts later) to `core`.
/// Call it before starting the runtime.
pub fn pin_current_thread(core: usize) -> Result<()> {
    if core >= libc::CPU_SETSIZE as usize {
        return Err(Error::Config(format!("core {core} is beyond CPU_SETSIZE")));
    }
    // SAFETY: `cpu_set_t` is a plain bit array for which all-zero is a valid
    // (empty) value; CPU_ZERO/CPU_SET only write inside it, and `core` was
    // checked against CPU_SETSIZE above. sched_setaffinity(0, ...) reads
    // exactly `size_of::<cpu_set_t>()` bytes from a live local.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(Error::last_os(format!("pinning to core {core}")));
    }
    Ok(())
}

/// The cores the calling thread may run on, lowest first (empty if the
/// kernel will not say).
pub fn allowed_cores() -> Vec<usize> {
    async_btl::info::cpu_affinity()
        .map(|v| v.into_iter().map(|c| c as usize).collect())
        .unwrap_or_default()
}

/// Let the calling thread run on every core the system allows it (the
/// kernel keeps only those of its cpuset). Async-signal-safe: a child
/// process can call it between fork and exec to shed a pinned parent's
/// affinity.
pub fn allow_all_cores() -> std::io::Result<()> {
    // SAFETY: as in `pin_current_thread`; every index is below CPU_SETSIZE.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in 0..libc::CPU_SETSIZE as usize {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_maps_ranks() {
        assert_eq!("auto".parse::<Pinning>(), Ok(Pinning::Auto));
        assert_eq!("none".parse::<Pinning>(), Ok(Pinning::None));
        let c: Pinning = "3, 5".parse().unwrap();
        assert_eq!(c.core_for(0, 8), Some(3));
        assert_eq!(c.core_for(3, 8), Some(5));
        assert_eq!(Pinning::Auto.core_for(3, 2), Some(1));
        assert_eq!(Pinning::None.core_for(0, 2), None);
        assert!("x".parse::<Pinning>().is_err());
    }
}

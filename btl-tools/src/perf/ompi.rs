//! Open MPI as a baseline (`--baseline ompi`, `--baseline ompi-tcp`).
//!
//! Rank 0, once everything else is measured and the other rank has left,
//! compiles the embedded [`SOURCE`] with `mpicc` into a temporary
//! directory and runs it under `mpirun -np 2 --bind-to core`, handing it
//! the run's sizes and, for each size, the same iterations, warm-up and
//! window as [`Counts::plan`](super::plan::Counts::plan) gave async-btl.
//! Its output ("TEST SIZE VALUE" lines) becomes samples named after the
//! baseline, so ratios, JSON, CSV and plots treat it like any other.
//!
//! `ompi` forces the shared-memory path (`--mca btl self,vader`, one-sided
//! through `osc sm`); `ompi-tcp` the TCP BTL on loopback (`--mca btl
//! self,tcp --mca btl_tcp_if_include lo`, one-sided through `osc pt2pt`,
//! which rides on that BTL). Both force `--mca pml ob1`, else UCX (when
//! built in) would carry the messages and bypass the BTL asked for.
//!
//! Whatever goes wrong (no `mpicc`, no `mpirun`, a failed or stuck run,
//! output that does not parse, btl-perf itself under an MPI launcher) is
//! a reason to skip, returned as text for the report's notes; never a
//! failure of the run.

use std::path::PathBuf;
use std::time::Duration;

use tokio::process::Command;

use super::plan::Plan;
use super::tool::{free_cores, parse_output, program_args, run_tool};
use super::{Baseline, Test};

/// The benchmark program, `btl-tools/baseline/mpi_pp.c`, built into btl-perf
/// so that an installed binary needs only Open MPI.
pub const SOURCE: &str = include_str!("../../baseline/mpi_pp.c");

/// Environment variables that MPI launchers (Open MPI, PMIx, PMI-1/2,
/// MPICH's Hydra) set in the processes they start. Running `mpirun` from
/// such a process is not done.
const LAUNCHER_VARS: [&str; 4] = [
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_RANK",
    "MPI_LOCALRANKID",
];

/// The tests the program implements: the atomics are
/// `MPI_Fetch_and_op`, `MPI_Compare_and_swap` and `MPI_Accumulate` on a
/// `uint64_t` of rank 1's window, each completed by `MPI_Win_flush`.
pub fn supports(test: Test) -> bool {
    matches!(test, Test::Lat | Test::Bw | Test::PutLat | Test::PutBw) || test.is_atomic()
}

/// The tests of [`supports`], by name, comma-separated.
pub fn supported_names() -> String {
    super::test_names(supports)
}

/// The MCA settings that select `b`'s transport (empty for a socket
/// baseline).
pub fn mca(b: Baseline) -> &'static [&'static str] {
    match b {
        Baseline::Ompi => &[
            "--mca",
            "pml",
            "ob1",
            "--mca",
            "btl",
            "self,vader",
            "--mca",
            "osc",
            "sm",
        ],
        Baseline::OmpiTcp => &[
            "--mca",
            "pml",
            "ob1",
            "--mca",
            "btl",
            "self,tcp",
            "--mca",
            "btl_tcp_if_include",
            "lo",
            "--mca",
            "osc",
            "pt2pt",
        ],
        Baseline::Unix
        | Baseline::Tcp
        | Baseline::Udp
        | Baseline::Ucx
        | Baseline::UcxTcp
        | Baseline::Ofi => &[],
    }
}

/// The `mpirun` options before the program: process count, binding,
/// `--allow-run-as-root` when `root`, and `b`'s MCA settings.
pub fn mpirun_args(b: Baseline, root: bool) -> Vec<String> {
    let mut v: Vec<&str> = vec!["-np", "2", "--bind-to", "core"];
    if root {
        v.push("--allow-run-as-root");
    }
    v.extend_from_slice(mca(b));
    v.into_iter().map(String::from).collect()
}

/// The launcher variable that says btl-perf itself runs under an MPI
/// launcher, if one is set.
pub fn nested_launcher() -> Option<&'static str> {
    LAUNCHER_VARS
        .into_iter()
        .find(|v| std::env::var_os(v).is_some())
}

/// The program, compiled into a temporary directory that is removed when
/// this is dropped.
pub struct Program {
    dir: PathBuf,
    exe: PathBuf,
    /// `mpirun --version`'s first line.
    pub version: String,
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Program {
    /// Check for `mpirun`, then write [`SOURCE`] out and compile it with
    /// `mpicc -O2`, each step limited to `limit`.
    pub async fn build(limit: Duration) -> Result<Program, String> {
        let mut probe = mpirun();
        probe.arg("--version");
        let v = run_tool(probe, "mpirun", "openmpi-bin", limit).await?;
        let version = String::from_utf8_lossy(&v.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string();
        let dir = std::env::temp_dir().join(format!(
            "btl-perf-ompi-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        // From here on, dropping `p` removes the directory.
        let p = Program {
            exe: dir.join("mpi_pp"),
            dir,
            version,
        };
        let src = p.dir.join("mpi_pp.c");
        std::fs::write(&src, SOURCE).map_err(|e| format!("cannot write {}: {e}", src.display()))?;
        let mut cc = Command::new("mpicc");
        cc.arg("-O2").arg("-o").arg(&p.exe).arg(&src);
        let done = run_tool(cc, "mpicc", "libopenmpi-dev", limit).await?;
        if !done.ok {
            return Err(done.failure("mpicc"));
        }
        Ok(p)
    }

    /// Measure `points` over baseline `b` in one `mpirun` limited to
    /// `limit`; one value per point, in order.
    pub async fn measure(
        &self,
        b: Baseline,
        points: &[(Test, usize, Plan)],
        limit: Duration,
    ) -> Result<Vec<f64>, String> {
        let mut cmd = mpirun();
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        cmd.args(mpirun_args(b, root))
            .arg(&self.exe)
            .args(program_args(points));
        // Rank 0 is pinned to one core, and children inherit that: give
        // mpirun every core back so that --bind-to core has two to use.
        free_cores(&mut cmd);
        let done = run_tool(cmd, "mpirun", "openmpi-bin", limit).await?;
        if !done.ok {
            return Err(done.failure("mpirun"));
        }
        let want: Vec<(Test, usize)> = points.iter().map(|(t, s, _)| (*t, *s)).collect();
        parse_output(&String::from_utf8_lossy(&done.stdout), &want)
    }
}

fn mpirun() -> Command {
    Command::new("mpirun")
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Plan = Plan {
        iters: 100,
        warmup: 10,
        window: 1,
    };

    #[test]
    fn arguments_group_points_by_test() {
        let w = Plan { window: 64, ..P };
        let a = program_args(&[(Test::Lat, 8, P), (Test::Lat, 16, P), (Test::Bw, 8, w)]);
        assert_eq!(a, ["lat", "8:100:10:1", "16:100:10:1", "bw", "8:100:10:64"]);
        let m = mpirun_args(Baseline::OmpiTcp, true);
        assert!(m.contains(&"--allow-run-as-root".to_string()));
        assert!(m.windows(2).any(|p| p == ["btl", "self,tcp"]));
        assert!(!mpirun_args(Baseline::Ompi, false).contains(&"--allow-run-as-root".to_string()));
        assert!(mca(Baseline::Unix).is_empty());
        assert!(SOURCE.contains("MPI_Put") && SOURCE.contains("put_bw"));
        for t in [Test::AtomicLat, Test::AtomicCswapLat, Test::AtomicRate] {
            assert!(
                supports(t) && SOURCE.contains(&format!("\"{}\"", t.name())),
                "{t}"
            );
        }
        assert!(SOURCE.contains("MPI_Fetch_and_op") && SOURCE.contains("MPI_Accumulate"));
    }
}

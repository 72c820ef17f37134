//! Every example, run as real processes: under `btl-run -n 2|3|4`, started
//! with no launcher (it launches itself), and under Open MPI's `mpirun -np 3`
//! (skipped with a note when `mpirun` is absent: `apt-get install
//! openmpi-bin`). Each run must exit 0, print its result line, and leave no
//! `abtl.*` file in its shared-memory directory.
//!
//! Neither the example binaries nor `btl-run` (of the workspace's
//! `btl-tools` package) are built by this test: run it with `cargo test`
//! or `cargo test --all-targets` from the workspace root, which build
//! `target/<profile>/examples/*` and `target/<profile>/btl-run` before
//! running any test. A filtered `cargo test --test examples` does not build
//! them; the tests then stop with a message saying so, and refuse binaries
//! older than their source.
//!
//! Each run gets its own shared-memory directory under `/dev/shm`
//! (`BTL_SHM_DIR`), so that jobs running at the same time on the machine
//! cannot hide or cause a leftover file.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Watchdog for one job (seconds); never a speed assertion.
const LIMIT: &str = "60";

/// `target/<profile>/<path>`, next to this test's `deps/` folder, checked
/// built and not older than any of `sources` (relative to the workspace
/// root); `build` says how to build it.
fn built(path: &str, sources: &[&str], build: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let bin = dir.join(path);
    let built = std::fs::metadata(&bin).and_then(|m| m.modified());
    let Ok(built) = built else {
        panic!(
            "{} is not built: run `cargo test` or `cargo test --all-targets` (they build it), \
             or `{build}` before a filtered run",
            bin.display()
        );
    };
    for source in sources {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(source);
        if let Ok(edited) = std::fs::metadata(&source).and_then(|m| m.modified()) {
            assert!(
                edited <= built,
                "{} is older than {}: rebuild it ({build})",
                bin.display(),
                source.display()
            );
        }
    }
    bin
}

/// `target/<profile>/examples/<name>`.
fn example(name: &str) -> PathBuf {
    built(
        &format!("examples/{name}"),
        &[&format!("examples/{name}.rs")],
        "cargo build --examples",
    )
}

/// The launcher, `target/<profile>/btl-run`.
fn btl_run() -> PathBuf {
    built(
        "btl-run",
        &["btl-tools/src/bin/btl-run.rs", "src/launch/mod.rs"],
        "cargo build -p btl-tools --bins",
    )
}

/// A private shared-memory directory for one job, checked empty on drop.
struct ShmDir(PathBuf);

impl ShmDir {
    fn new(label: &str) -> ShmDir {
        let dir = PathBuf::from(format!("/dev/shm/abtl-test-{}-{label}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a directory in /dev/shm");
        ShmDir(dir)
    }

    /// Files the job left behind.
    fn leftovers(&self) -> Vec<String> {
        std::fs::read_dir(&self.0)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("abtl."))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A command under a watchdog, with a clean environment: no launcher
/// variables inherited from whatever runs the tests.
fn command(shm: &ShmDir, program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=5", LIMIT]).arg(program);
    for (k, _) in std::env::vars() {
        let launcher = ["BTL_", "OMPI_", "PMIX_", "PMI_", "SLURM_"];
        if launcher.iter().any(|p| k.starts_with(p)) || ["RANK", "WORLD_SIZE"].contains(&&*k) {
            cmd.env_remove(k);
        }
    }
    cmd.env("BTL_SHM_DIR", &shm.0)
        .env("RUST_LOG", "error")
        .env("PINGPONG_ITERS", "2000")
        .stdin(Stdio::null());
    cmd
}

/// Run the job and check it: exit 0, `expect` printed `lines` times, no
/// shared-memory file left.
fn check(label: &str, out: Output, shm: &ShmDir, expect: &str, lines: usize) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{label}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let found = stdout.lines().filter(|l| l.contains(expect)).count();
    assert_eq!(found, lines, "{label}: want {lines} x {expect:?}\n{stdout}");
    assert_eq!(shm.leftovers(), Vec::<String>::new(), "{label}: files left");
}

/// Every way of launching one example.
struct Example {
    name: &'static str,
    /// Text of the result line.
    expect: &'static str,
    /// Ranks started when it launches itself.
    default_ranks: u32,
    /// Whether every rank prints the result line (else rank 0 only).
    every_rank: bool,
    /// Variables the job runs with.
    env: &'static [(&'static str, &'static str)],
}

impl Example {
    fn lines(&self, ranks: u32) -> usize {
        if self.every_rank {
            ranks as usize
        } else {
            1
        }
    }

    fn under_btl_run(&self, ranks: u32) {
        let label = format!("{} under btl-run -n {ranks}", self.name);
        let shm = ShmDir::new(&format!("{}-btl{ranks}", self.name));
        let out = command(&shm, btl_run())
            .envs(self.env.iter().copied())
            .args(["-n", &ranks.to_string()])
            .arg(example(self.name))
            .output()
            .expect("btl-run starts");
        check(&label, out, &shm, self.expect, self.lines(ranks));
    }

    fn launching_itself(&self) {
        let label = format!("{} with no launcher", self.name);
        let shm = ShmDir::new(&format!("{}-self", self.name));
        let bin = example(self.name);
        let out = command(&shm, &bin)
            .envs(self.env.iter().copied())
            .output()
            .expect("example starts");
        let ranks = self.default_ranks;
        check(&label, out, &shm, self.expect, self.lines(ranks));
    }

    fn under_mpirun(&self) {
        if Command::new("mpirun").arg("--version").output().is_err() {
            eprintln!("skipped: mpirun not found (apt-get install openmpi-bin)");
            return;
        }
        let label = format!("{} under mpirun -np 3", self.name);
        let shm = ShmDir::new(&format!("{}-mpi", self.name));
        let shm_env = format!("BTL_SHM_DIR={}", shm.0.display());
        // No BTL_JOB_KEY: the key comes from a per-user secret, kept here
        // rather than in the real home directory.
        let secret_env = format!("BTL_SECRET_FILE={}", shm.0.join("secret").display());
        let mut cmd = command(&shm, "mpirun");
        cmd.envs(self.env.iter().copied());
        for (k, _) in self.env {
            cmd.args(["-x", k]);
        }
        let out = cmd
            .args(["--allow-run-as-root", "--oversubscribe", "-np", "3"])
            .args(["-x", &shm_env, "-x", &secret_env])
            .args(["-x", "RUST_LOG", "-x", "PINGPONG_ITERS"])
            .arg(example(self.name))
            .output()
            .expect("mpirun starts");
        check(&label, out, &shm, self.expect, self.lines(3));
    }
}

macro_rules! example_tests {
    ($name:ident, $expect:literal, $default_ranks:literal, $every_rank:literal) => {
        example_tests!($name, $expect, $default_ranks, $every_rank, &[]);
    };
    ($name:ident, $expect:literal, $default_ranks:literal, $every_rank:literal, $env:expr) => {
        mod $name {
            const EXAMPLE: super::Example = super::Example {
                name: stringify!($name),
                expect: $expect,
                default_ranks: $default_ranks,
                every_rank: $every_rank,
                env: $env,
            };
            #[test]
            fn btl_run_2() {
                EXAMPLE.under_btl_run(2);
            }
            #[test]
            fn btl_run_3() {
                EXAMPLE.under_btl_run(3);
            }
            #[test]
            fn btl_run_4() {
                EXAMPLE.under_btl_run(4);
            }
            #[test]
            fn no_launcher() {
                EXAMPLE.launching_itself();
            }
            #[test]
            fn mpirun_3() {
                EXAMPLE.under_mpirun();
            }
        }
    };
}

example_tests!(pingpong, "µs over sm", 2, false);
example_tests!(
    tokio_service,
    "concurrent requests answered correctly",
    3,
    false
);
example_tests!(ring_allreduce, "result exact on every rank", 4, false);
example_tests!(kv_store, "read back all", 4, true);
// On the GPU test double (this machine may have no GPU): device memory
// lent around the ring, every byte checked.
example_tests!(
    gpu_ring,
    "every transfer checked",
    3,
    false,
    &[("BTL_SMCUDA_GPU", "test-double")]
);

/// Processes whose environment holds `entry` (`KEY=value`).
fn processes_with(entry: &str) -> Vec<u32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == entry.as_bytes()))
        })
        .collect()
}

/// A rank that panics with the fabric open (and peers waiting on it) makes
/// btl-run exit with the panic's code (101), stops the others, and leaves
/// neither processes nor shared memory behind. (Exit codes and killing of
/// plain programs are covered in `btl-tools/tests/launch.rs`.)
#[test]
fn a_panicking_rank_fails_the_job_and_leaves_nothing_behind() {
    let shm = ShmDir::new("panic");
    let marker = format!("ABTL_PANIC_TEST={}", std::process::id());
    let out = command(&shm, btl_run())
        .args(["-n", "3", "--grace", "2", "--env", &marker, "--"])
        .arg(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "panicking_rank",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("btl-run starts");
    assert_eq!(out.status.code(), Some(101), "{out:?}");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !processes_with(&marker).is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(processes_with(&marker), Vec::<u32>::new(), "ranks left");
    assert_eq!(shm.leftovers(), Vec::<String>::new(), "files left");
}

/// Not a test by itself: a rank of the job above (does nothing unless
/// started by it). Rank 1 panics once everybody is connected; the others
/// wait for a message that never comes.
#[test]
fn panicking_rank() {
    if std::env::var_os("ABTL_PANIC_TEST").is_none() {
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let fabric = async_btl::Fabric::from_env().await.expect("fabric");
        let mut rx = fabric.receiver(9).expect("receiver");
        fabric.barrier().await.expect("barrier");
        if fabric.rank() == 1 {
            panic!("rank 1 panics on purpose");
        }
        let _ = rx.recv().await;
        std::process::exit(3);
    });
}

/// An example started with too few ranks says why and fails.
#[test]
fn an_example_short_of_ranks_says_why_and_fails() {
    for name in ["pingpong", "tokio_service"] {
        let shm = ShmDir::new(&format!("{name}-alone"));
        let out = command(&shm, btl_run())
            .args(["-n", "1"])
            .arg(example(name))
            .output()
            .expect("btl-run starts");
        assert_eq!(out.status.code(), Some(1), "{name}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("needs at least 2 ranks"),
            "{name}: {stderr}"
        );
        assert_eq!(shm.leftovers(), Vec::<String>::new(), "{name}: files left");
    }
}

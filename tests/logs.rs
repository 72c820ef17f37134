//! What a job's log looks like to its user: the examples' logs carry no
//! terminal colour codes when stderr is not a terminal, and a job started
//! without `BTL_JOB_KEY` derives its key from a per-user secret file it
//! creates private (0600), says so once at `debug`, from rank 0, and warns
//! about nothing.
//!
//! Like `tests/examples.rs`, this runs the built example binaries
//! (`target/<profile>/examples/pingpong`) and `btl-run`: `cargo test` builds
//! them; before a filtered `cargo test --test logs`, run `cargo build
//! --examples -p async-btl` and `cargo build -p btl-tools --bins`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

/// Watchdog for one job (seconds); never a speed assertion.
const LIMIT: &str = "60";

/// The note rank 0 of a job without a key logs at `debug`.
const NO_KEY: &str = "BTL_JOB_KEY is not set";

/// `target/<profile>/<path>`, next to this test's `deps/` folder.
fn built(path: &str, build: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let bin = dir.join(path);
    assert!(
        bin.exists(),
        "{} is not built: run `cargo test` (it builds it), or `{build}` before a filtered run",
        bin.display()
    );
    bin
}

fn pingpong() -> PathBuf {
    built("examples/pingpong", "cargo build --examples -p async-btl")
}

/// A private shared-memory directory for one job.
struct ShmDir(PathBuf);

impl ShmDir {
    fn new(label: &str) -> ShmDir {
        let dir = PathBuf::from(format!("/dev/shm/abtl-logs-{}-{label}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a directory in /dev/shm");
        ShmDir(dir)
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `program` under a watchdog, with no launcher variables (and no
/// `BTL_JOB_KEY`) inherited from whatever runs the tests, stdout and stderr
/// piped.
fn command(shm: &ShmDir, program: impl AsRef<std::ffi::OsStr>, log: &str) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=5", LIMIT]).arg(program);
    for (k, _) in std::env::vars() {
        let launcher = ["BTL_", "OMPI_", "PMIX_", "PMI_", "SLURM_"];
        let torch = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"];
        if launcher.iter().any(|p| k.starts_with(p))
            || torch.contains(&&*k)
            || k.starts_with("MASTER_")
        {
            cmd.env_remove(k);
        }
    }
    cmd.env("BTL_SHM_DIR", &shm.0)
        .env("RUST_LOG", log)
        .env("PINGPONG_ITERS", "200")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// The job's stderr, after checking that it succeeded.
fn stderr_of(label: &str, out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{label}: {}\nstdout:\n{}\nstderr:\n{stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// A debug log that says something (the routes) and holds no escape code.
fn assert_plain(label: &str, stderr: &str) {
    assert!(
        stderr.contains("route"),
        "{label}: no route line at debug:\n{stderr}"
    );
    assert!(
        !stderr.contains("\x1b["),
        "{label}: colour codes in a piped log:\n{stderr:?}"
    );
}

#[test]
fn a_piped_log_has_no_colour_codes_when_the_example_launches_itself() {
    let shm = ShmDir::new("ansi-self");
    let out = command(&shm, pingpong(), "async_btl=debug")
        .output()
        .expect("pingpong starts");
    assert_plain("pingpong with no launcher", &stderr_of("self", out));
}

#[test]
fn a_piped_log_has_no_colour_codes_under_btl_run() {
    let btl_run = built("btl-run", "cargo build -p btl-tools --bins");
    let shm = ShmDir::new("ansi-btl");
    let out = command(&shm, btl_run, "async_btl=debug")
        .args(["-n", "2"])
        .arg(pingpong())
        .output()
        .expect("btl-run starts");
    assert_plain("pingpong under btl-run -n 2", &stderr_of("btl-run", out));
}

/// The lines of `stderr` that say the key was derived from the secret.
fn no_key_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains(NO_KEY)).collect()
}

/// A private directory for the per-user secret of one job, so that tests
/// never touch the real one in `$HOME`.
struct SecretDir(PathBuf);

impl SecretDir {
    fn new(label: &str) -> SecretDir {
        let dir =
            std::env::temp_dir().join(format!("abtl-logs-secret-{}-{label}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a secret directory");
        SecretDir(dir)
    }

    fn file(&self) -> PathBuf {
        self.0.join("secret")
    }

    /// The ranks created the secret, private to its owner.
    fn assert_private(&self) {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(self.file()).expect("the ranks created the secret");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }
}

impl Drop for SecretDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// No warning mentions the job key: without `BTL_JOB_KEY`, the key comes
/// from a secret, which is nothing to warn about.
fn assert_no_key_warning(stderr: &str) {
    let warned: Vec<_> = stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("key"))
        .collect();
    assert!(warned.is_empty(), "unexpected warnings: {warned:?}");
}

#[test]
fn a_job_without_a_key_under_mpirun_derives_it_from_a_private_secret() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("skipped: mpirun not found (apt-get install openmpi-bin)");
        return;
    }
    let shm = ShmDir::new("key-mpi");
    let secret = SecretDir::new("key-mpi");
    let shm_env = format!("BTL_SHM_DIR={}", shm.0.display());
    let secret_env = format!("BTL_SECRET_FILE={}", secret.file().display());
    let out = command(&shm, "mpirun", "async_btl::bootstrap=debug")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "3"])
        .args(["-x", &shm_env, "-x", &secret_env])
        .args(["-x", "RUST_LOG", "-x", "PINGPONG_ITERS"])
        .arg(pingpong())
        .output()
        .expect("mpirun starts");
    let stderr = stderr_of("mpirun -np 3", out);
    let lines = no_key_lines(&stderr);
    assert_eq!(lines.len(), 1, "want the note once, from rank 0:\n{stderr}");
    assert!(
        lines[0].contains(&*secret.file().to_string_lossy()),
        "the note should name the secret file:\n{stderr}"
    );
    assert_no_key_warning(&stderr);
    secret.assert_private();
}

#[test]
fn a_job_without_a_key_under_torchrun_variables_derives_it_from_a_private_secret() {
    // Three ranks started by hand with torchrun's variables, rank 0 serving
    // the rendezvous next to MASTER_PORT.
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("its address").port()
    };
    let shm = ShmDir::new("key-torch");
    let secret = SecretDir::new("key-torch");
    let ranks: Vec<Child> = (0..3)
        .map(|rank| {
            command(&shm, pingpong(), "async_btl::bootstrap=debug")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "3")
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", "3")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("BTL_SECRET_FILE", secret.file())
                .spawn()
                .expect("pingpong starts")
        })
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().expect("rank finishes");
        let stderr = stderr_of(&format!("rank {rank}"), out);
        let found = no_key_lines(&stderr).len();
        assert_eq!(found, usize::from(rank == 0), "rank {rank}:\n{stderr}");
        assert_no_key_warning(&stderr);
    }
    secret.assert_private();
}

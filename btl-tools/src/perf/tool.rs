//! Running the external tools of the Open MPI and UCX baselines (`mpicc`,
//! `mpirun`, `ucx_perftest`, `ucx_info`): captured output, a time limit,
//! and failures given back as text for the report's notes.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

/// How long a tool gets to wind down (`mpirun` its ranks) after SIGTERM.
pub const GRACE: Duration = Duration::from_secs(5);

/// The last few non-empty lines of a tool's output, on one line, for a note.
pub fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.chars().all(|c| c == '-'))
        .collect();
    let keep = &lines[lines.len().saturating_sub(3)..];
    if keep.is_empty() {
        "no output".into()
    } else {
        keep.join(" / ")
    }
}

/// What a finished tool left: its status and both outputs.
pub struct Finished {
    /// Whether it exited with status 0.
    pub ok: bool,
    /// Its exit status, in words.
    pub status: String,
    /// Everything it wrote to stdout.
    pub stdout: Vec<u8>,
    /// Everything it wrote to stderr.
    pub stderr: Vec<u8>,
}

impl Finished {
    /// Why it failed, for a note: its status and the tail of whichever
    /// output has something (tools differ in where they write errors).
    pub fn failure(&self, name: &str) -> String {
        let err = tail(&self.stderr);
        let said = if err == "no output" {
            tail(&self.stdout)
        } else {
            err
        };
        format!("{name} failed ({}): {said}", self.status)
    }
}

/// Start `cmd` (as `name`), turning a missing program into "apt-get
/// install `package`".
pub fn spawn(cmd: &mut Command, name: &str, package: &str) -> Result<Child, String> {
    cmd.spawn().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("{name} not found (apt-get install {package})"),
        _ => format!("cannot start {name}: {e}"),
    })
}

/// Give the child every core back: rank 0 is pinned, and children inherit
/// its affinity.
pub fn free_cores(cmd: &mut Command) {
    // SAFETY: the closure only makes one system call on a local value,
    // which is allowed between fork and exec.
    unsafe {
        cmd.pre_exec(super::pin::allow_all_cores);
    }
}

/// Run `cmd` (program `name`, from `package`) with its output captured,
/// for at most `limit`. On time-out the process gets SIGTERM (so that
/// `mpirun` takes its ranks down), then SIGKILL after [`GRACE`].
pub async fn run_tool(
    mut cmd: Command,
    name: &str,
    package: &str,
    limit: Duration,
) -> Result<Finished, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = spawn(&mut cmd, name, package)?;
    let drain = |r: Option<Box<dyn tokio::io::AsyncRead + Unpin + Send>>| {
        tokio::spawn(async move {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf).await;
            }
            buf
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as _));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as _));
    let status = match tokio::time::timeout(limit, child.wait()).await {
        Ok(s) => s.map_err(|e| format!("waiting for {name}: {e}"))?,
        Err(_) => {
            if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
                // SAFETY: kill(2) on the pid of our own child, which has not
                // been reaped yet (we still hold it), so the pid is its.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
            if tokio::time::timeout(GRACE, child.wait()).await.is_err() {
                let _ = child.kill().await;
            }
            return Err(format!("{name} ran past {} s", limit.as_secs()));
        }
    };
    Ok(Finished {
        ok: status.success(),
        status: status.to_string(),
        stdout: out.await.unwrap_or_default(),
        stderr: err.await.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tool_failures_are_reasons() {
        let e = run_tool(
            Command::new("btl-perf-no-such-tool"),
            "mpicc",
            "libopenmpi-dev",
            GRACE,
        )
        .await
        .err()
        .expect("a missing tool is an error");
        assert!(
            e.contains("not found") && e.contains("libopenmpi-dev"),
            "{e}"
        );
        let mut sleep = Command::new("sleep");
        sleep.arg("30");
        let e = run_tool(sleep, "sleep", "coreutils", Duration::from_millis(50))
            .await
            .err()
            .expect("a stuck tool is an error");
        assert!(e.contains("ran past"), "{e}");
        let mut sh = Command::new("sh");
        sh.args(["-c", "echo out; echo oops >&2; exit 3"]);
        let done = run_tool(sh, "sh", "dash", GRACE).await.expect("sh runs");
        assert!(!done.ok && done.status.contains('3'), "{}", done.status);
        assert_eq!(
            (&done.stdout[..], tail(&done.stderr)),
            (&b"out\n"[..], "oops".into())
        );
        assert!(
            done.failure("sh").ends_with(": oops"),
            "{}",
            done.failure("sh")
        );
        // A tool that reports on stdout only (as ucx_perftest does).
        let mut sh = Command::new("sh");
        sh.args(["-c", "echo 'UCX ERROR no such device'; exit 1"]);
        let done = run_tool(sh, "sh", "dash", GRACE).await.expect("sh runs");
        assert!(
            done.failure("sh").contains("UCX ERROR no such device"),
            "{}",
            done.failure("sh")
        );
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail(b"a\n----\nb\n\nc\nd\n"), "b / c / d");
        assert_eq!(tail(b""), "no output");
    }
}

//! Running the external tools of the Open MPI, libfabric and UCX baselines
//! (`mpicc`, `mpirun`, `cc`, `ucx_perftest`, `ucx_info`): captured output,
//! a time limit, and failures given back as text for the report's notes;
//! and the command line and output of the C programs built into btl-perf
//! (`baseline/mpi_pp.c`, `baseline/ofi_pp.c`), which take their points as
//! [`program_args`] and print "TEST SIZE VALUE" lines ([`parse_output`]).

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

use super::plan::Plan;
use super::Test;

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

/// A baseline program's arguments for `points`: each test's name, then one
/// `SIZE:ITERS:WARMUP:WINDOW` per size.
pub fn program_args(points: &[(Test, usize, Plan)]) -> Vec<String> {
    let mut out = Vec::new();
    let mut last = None;
    for &(test, size, plan) in points {
        if last != Some(test) {
            out.push(test.name().to_string());
            last = Some(test);
        }
        out.push(format!(
            "{size}:{}:{}:{}",
            plan.iters, plan.warmup, plan.window
        ));
    }
    out
}

/// Parse a baseline program's output into one value per (test, size) of `want`,
/// in `want`'s order. Comment and blank lines are skipped; any other line
/// must read `TEST SIZE VALUE` for a wanted point with a finite positive
/// value, and every wanted point must appear exactly once.
pub fn parse_output(text: &str, want: &[(Test, usize)]) -> Result<Vec<f64>, String> {
    let mut got: Vec<Option<f64>> = vec![None; want.len()];
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = || format!("unexpected output line {line:?}");
        let f: Vec<&str> = line.split_whitespace().collect();
        let [t, size, value] = f[..] else {
            return Err(bad());
        };
        let test: Test = t.parse().map_err(|_| bad())?;
        let size: usize = size.parse().map_err(|_| bad())?;
        let value: f64 = value.parse().map_err(|_| bad())?;
        if !(value.is_finite() && value > 0.0) {
            return Err(bad());
        }
        let i = want
            .iter()
            .position(|p| *p == (test, size))
            .ok_or_else(|| format!("output for a point not asked for: {line:?}"))?;
        if got[i].replace(value).is_some() {
            return Err(format!("{test} at {size} B reported twice"));
        }
    }
    got.into_iter()
        .zip(want)
        .map(|(v, (t, s))| v.ok_or_else(|| format!("no result for {t} at {s} B")))
        .collect()
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

    #[test]
    fn output_parses_in_request_order() {
        let want = [(Test::Lat, 8), (Test::Bw, 8)];
        let text = "# open-mpi\n\nbw 8 123.5\nlat 8 0.25\n";
        assert_eq!(parse_output(text, &want), Ok(vec![0.25, 123.5]));
    }

    #[test]
    fn malformed_output_is_an_error() {
        let want = [(Test::Lat, 8)];
        for bad in [
            "lat 8",
            "lat 8 0.5 extra",
            "lat eight 0.5",
            "lat 8 fast",
            "lat 8 -1",
            "lat 8 NaN",
            "lat 8 inf",
            "nope 8 0.5",
            "lat 16 0.5",
            "lat 8 0.5\nlat 8 0.6",
            "",
            "mpirun: something went wrong",
        ] {
            assert!(parse_output(bad, &want).is_err(), "{bad:?} was accepted");
        }
    }
}

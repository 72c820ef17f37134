//! btl-run with real processes: output prefixing, exit codes, killing, and
//! an all-gather across processes (this test binary re-executed in "rank
//! mode", see `rank_helper`).

use std::collections::BTreeSet;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use async_btl::bootstrap::{all_gather, JobInfo};
use async_btl::launch::run_self_if_unlaunched;

const BTL_RUN: &str = env!("CARGO_BIN_EXE_btl-run");

/// A value unique to one test, set in its ranks' environment.
fn marker(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{name}-{}-{nanos}", std::process::id())
}

/// Processes whose environment carries `BTL_TEST_MARKER=<marker>`.
fn tagged(marker: &str) -> Vec<u32> {
    let needle = format!("BTL_TEST_MARKER={marker}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
        })
        .collect()
}

/// Wait (bounded) until no tagged process remains; return the stragglers.
fn wait_gone(marker: &str) -> Vec<u32> {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let left = tagged(marker);
        if left.is_empty() || Instant::now() > until {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn btl_run(args: &[&str]) -> Output {
    Command::new(BTL_RUN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("btl-run starts")
}

fn lines(bytes: &[u8]) -> BTreeSet<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn output_lines_carry_their_rank() {
    let out = btl_run(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "echo out $BTL_RANK/$BTL_SIZE; echo err $BTL_RANK >&2",
    ]);
    assert!(out.status.success(), "{out:?}");
    let want: BTreeSet<String> = (0..3).map(|r| format!("[{r}] out {r}/3")).collect();
    assert_eq!(lines(&out.stdout), want);
    let want: BTreeSet<String> = (0..3).map(|r| format!("[{r}] err {r}")).collect();
    assert_eq!(lines(&out.stderr), want);
}

#[test]
fn lines_stay_whole_when_ranks_write_at_once() {
    let body = "x".repeat(300);
    let script =
        format!("i=0; while [ $i -lt 200 ]; do echo \"$BTL_RANK $i {body}\"; i=$((i+1)); done");
    let out = btl_run(&["-n", "3", "sh", "-c", &script]);
    assert!(out.status.success(), "{:?}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 600);
    for line in text.lines() {
        let (tag, rest) = line.split_once(' ').expect("prefixed");
        let rank = tag.trim_start_matches('[').trim_end_matches(']');
        assert!(
            rest.starts_with(&format!("{rank} ")) && rest.ends_with(&body),
            "torn line {line:?}"
        );
    }
}

#[test]
fn no_prefix_and_env_options() {
    let out = btl_run(&[
        "-n",
        "1",
        "--no-prefix",
        "--env",
        "GREETING=hi there",
        "sh",
        "-c",
        "echo $GREETING",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi there\n");
}

#[test]
fn first_failure_is_propagated_and_siblings_are_killed() {
    let m = marker("fail");
    let env = format!("BTL_TEST_MARKER={m}");
    let script = "if [ $BTL_RANK = 1 ]; then sleep 0.2; exit 7; fi; sleep 30";
    let started = Instant::now();
    let out = btl_run(&["-n", "3", "--grace", "1", "--env", &env, "sh", "-c", script]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "siblings were not stopped"
    );
    assert_eq!(wait_gone(&m), Vec::<u32>::new(), "processes left behind");
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_the_signal() {
    let out = btl_run(&[
        "-n",
        "2",
        "--grace",
        "1",
        "sh",
        "-c",
        "if [ $BTL_RANK = 0 ]; then kill -9 $$; fi; sleep 30",
    ]);
    assert_eq!(out.status.code(), Some(128 + 9), "{out:?}");
}

#[test]
fn timeout_stops_the_job_with_124() {
    let m = marker("timeout");
    let env = format!("BTL_TEST_MARKER={m}");
    let out = btl_run(&[
        "-n",
        "2",
        "--timeout",
        "0.5",
        "--grace",
        "1",
        "--env",
        &env,
        "sh",
        "-c",
        "sleep 30",
    ]);
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    assert_eq!(wait_gone(&m), Vec::<u32>::new());
}

/// Start btl-run with two long-sleeping ranks and wait until both run.
fn start_sleepers(m: &str) -> std::process::Child {
    let env = format!("BTL_TEST_MARKER={m}");
    let child = Command::new(BTL_RUN)
        .args([
            "-n",
            "2",
            "--grace",
            "1",
            "--env",
            &env,
            "sh",
            "-c",
            "exec sleep 30",
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("btl-run starts");
    let until = Instant::now() + Duration::from_secs(10);
    while tagged(m).len() < 2 {
        assert!(Instant::now() < until, "ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn send(pid: u32, sig: i32) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
    assert!(status.expect("kill runs").success());
}

#[test]
fn sigterm_is_forwarded_to_the_ranks() {
    let m = marker("sigterm");
    let mut child = start_sleepers(&m);
    send(child.id(), 15);
    let status = child.wait().expect("btl-run exits");
    assert_eq!(status.code(), Some(128 + 15));
    assert_eq!(wait_gone(&m), Vec::<u32>::new());
}

#[test]
fn ranks_die_when_the_launcher_is_killed() {
    let m = marker("sigkill");
    let mut child = start_sleepers(&m);
    send(child.id(), 9);
    let _ = child.wait();
    assert_eq!(
        wait_gone(&m),
        Vec::<u32>::new(),
        "PR_SET_PDEATHSIG did not fire"
    );
}

/// Runs the real exchange across processes, each rank a copy of this test
/// binary filtered down to `rank_helper`.
fn helper_args() -> [String; 4] {
    ["--exact", "rank_helper", "--nocapture", "--test-threads=1"].map(String::from)
}

fn check_gathered(out: &Output, n: u32) {
    assert!(out.status.success(), "{out:?}");
    let all: Vec<String> = (0..n).map(|r| format!("r{r}")).collect();
    let want: BTreeSet<String> = (0..n)
        .map(|r| format!("[{r}] gathered {r}: {}", all.join(",")))
        .collect();
    let got: BTreeSet<String> = lines(&out.stdout)
        .into_iter()
        .filter(|l| l.contains("gathered"))
        .collect();
    assert_eq!(
        got,
        want,
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn all_gather_across_processes_launched_by_btl_run() {
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new(BTL_RUN)
        .args([
            "-n",
            "3",
            "--timeout",
            "60",
            "--env",
            "BTL_TEST_MODE=gather",
            "--",
        ])
        .arg(exe)
        .args(helper_args())
        .output()
        .expect("btl-run starts");
    check_gathered(&out, 3);
}

#[test]
fn an_unlaunched_program_launches_itself() {
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = Command::new(exe);
    for (k, _) in std::env::vars() {
        if k.starts_with("BTL_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd
        .args(helper_args())
        .env("BTL_TEST_MODE", "selfrun")
        .env("BTL_NP", "2")
        .output()
        .expect("test binary starts");
    check_gathered(&out, 2);
}

#[test]
fn all_gather_under_open_mpi_mpirun() {
    // A real third-party launcher; skipped where openmpi-bin is absent.
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("skipped: mpirun not found (apt-get install openmpi-bin)");
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    // No BTL_JOB_KEY: the key comes from a per-user secret, kept here
    // rather than in the real home directory.
    let secret = std::env::temp_dir().join(format!("abtl-launch-secret-{}", std::process::id()));
    let secret_env = format!("BTL_SECRET_FILE={}", secret.join("secret").display());
    let out = Command::new("timeout")
        .args([
            "120",
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            "3",
        ])
        .args(["-x", "BTL_TEST_MODE=gather", "-x", "RUST_LOG=error"])
        .args(["-x", &secret_env])
        .arg(exe)
        .args(helper_args())
        .stdin(Stdio::null())
        .output()
        .expect("mpirun starts");
    let _ = std::fs::remove_dir_all(&secret);
    assert!(out.status.success(), "{out:?}");
    let got: BTreeSet<String> = lines(&out.stdout)
        .into_iter()
        .filter(|l| l.contains("gathered"))
        .collect();
    let want: BTreeSet<String> = (0..3).map(|r| format!("gathered {r}: r0,r1,r2")).collect();
    assert_eq!(got, want);
}

/// With `--keep-going`, a rank that dies does not take the job down: the
/// survivor sees `PeerLost` and finishes, and btl-run reports the dead
/// rank's code. Without it, the survivor is stopped first.
#[test]
fn keep_going_lets_survivors_see_the_loss() {
    let exe = std::env::current_exe().expect("test binary");
    let run = |keep: bool| {
        let mut cmd = Command::new(BTL_RUN);
        cmd.args(["-n", "2", "--timeout", "60", "--grace", "1"]);
        if keep {
            cmd.arg("--keep-going");
        }
        cmd.args(["--env", "BTL_TEST_MODE=survive", "--"])
            .arg(&exe)
            .args(helper_args())
            .output()
            .expect("btl-run starts")
    };
    let out = run(true);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(5), "{out:?}");
    assert!(
        text.contains("[0] survivor saw the loss of rank 1"),
        "{text}"
    );
    let out = run(false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(5), "{out:?}");
    assert!(!text.contains("survivor saw"), "{text}");
}

/// Not a test by itself: does nothing unless `BTL_TEST_MODE` is set by one
/// of the tests above, which run it as a rank.
#[test]
fn rank_helper() {
    let Ok(mode) = std::env::var("BTL_TEST_MODE") else {
        return;
    };
    if mode == "survive" {
        // Rank 1 dies after the job met; rank 0 waits for a message that
        // will never come and must see the loss instead.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let f = async_btl::Fabric::from_env().await.expect("fabric");
            let mut rx = f.receiver(1).expect("receiver");
            f.barrier().await.expect("barrier");
            if f.rank() == 1 {
                std::process::exit(5);
            }
            let e = tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .expect("the loss is reported in time")
                .expect_err("no message comes");
            assert!(e.is_peer_lost(), "{e}");
            println!("\nsurvivor saw the loss of rank 1: {e}");
        });
        return;
    }
    if mode == "selfrun" {
        if let Some(code) = run_self_if_unlaunched(3) {
            std::process::exit(code);
        }
    }
    let job = JobInfo::from_env()
        .expect("valid launcher variables")
        .expect("launched");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mine = format!("r{}", job.rank).into_bytes();
    let blobs = rt
        .block_on(all_gather(&job, mine, Duration::from_secs(30)))
        .expect("all_gather");
    let text: Vec<String> = blobs
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    // Own line: libtest has printed "test rank_helper ... " without one.
    println!("\ngathered {}: {}", job.rank, text.join(","));
}

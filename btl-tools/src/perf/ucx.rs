//! UCX as a baseline: its own `ucx_perftest` (Debian's `ucx-utils`), over
//! its shared-memory transports (`--baseline ucx`: `UCX_TLS=sm,self`) or
//! over its TCP transport on loopback (`--baseline ucx-tcp`:
//! `UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`), the twin of async-btl's `udp` and
//! of `rdma` over `tcp;ofi_rxm`. Over TCP, UCX carries puts, gets and
//! atomics as its own active messages (there is no NIC to do them).
//!
//! Rank 0, after everything else, runs one `ucx_perftest` pair per point:
//! a server on the core rank 1 used, then a client on rank 0's core that
//! connects to it on 127.0.0.1 (a fresh random port each time) and prints
//! its final result as CSV (`-f -v`). Each point gets the iterations and
//! warm-up [`Counts::plan`](super::plan::Counts::plan) gave async-btl; UCX
//! counts single operations, so a windowed test's counts are multiplied by
//! the window. How many operations UCX keeps in flight is its own default
//! (passing our window as `-O` makes `tag_bw` slower and changes
//! nothing for `ucp_put_bw` and `ucp_get`, which complete at once over
//! shared memory). Both tools die with rank 0 (`PR_SET_PDEATHSIG`), so a
//! killed run leaves no server waiting for a client.
//!
//! The tests map onto UCX's own:
//! - `lat`: `tag_lat`, tag-matched ping-pong, half the round trip;
//! - `bw`: `tag_bw`, tag-matched sends one way;
//! - `put_bw`: `ucp_put_bw`, puts into the peer's registered memory (over
//!   shared memory, into its mapping);
//! - `get_bw`: `ucp_get`;
//! - `msg_rate`: `tag_bw` at 8 B, its message rate (a stream with no
//!   answer until its end; ours is acknowledged once per 4096 messages,
//!   see `plan::MSG_RATE_WINDOWS`);
//! - `atomic_lat`: `ucp_fadd`, one 8-byte fetch-and-add at a time (UCX's
//!   default of one outstanding operation for it), the time per operation;
//! - `atomic_cswap_lat`: `ucp_cswap`, the same with compare-and-swap;
//! - `atomic_rate`: `ucp_add`, non-fetching 8-byte adds, their rate.
//!
//! Over `sm,self` UCX does the atomics with CPU atomics on the peer's
//! mapped memory, as async-btl's `sm` does into an `alloc_region` target.
//!
//! `put_lat` is left out: `ucp_put_lat` times a put seen by a peer that
//! polls the target memory (one way), not a put then a flush, so its
//! figure would not be the same thing as ours or `osu_put_latency`'s.
//!
//! UCX reports bandwidth in units of 2^20 bytes per second; the samples
//! are converted to 10^6 bytes per second, as every other series.
//!
//! As with Open MPI, anything that goes wrong (no `ucx_perftest`, a failed
//! or stuck pair, output that does not parse) is a reason to skip, given
//! back as text for the report's notes: a test whose point fails is
//! skipped (its other sizes are not tried), the other tests go on, and a
//! missing tool skips everything.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use super::plan::Plan;
use super::tool::{free_cores, run_tool, spawn, tail};
use super::{Baseline, Test};

/// The UCX transports `b` uses: shared memory and loopback to self for
/// `ucx`, TCP for `ucx-tcp`.
pub fn tls(b: Baseline) -> &'static str {
    if b == Baseline::UcxTcp {
        "tcp"
    } else {
        "sm,self"
    }
}

/// The environment of `b`'s tool: `UCX_TLS`, and for TCP the loopback
/// device alone (never the machine's own interface).
pub fn env(b: Baseline) -> Vec<(&'static str, &'static str)> {
    let mut v = vec![("UCX_TLS", tls(b))];
    if b == Baseline::UcxTcp {
        v.push(("UCX_NET_DEVICES", "lo"));
    }
    v
}

/// The tool's name.
const TOOL: &str = "ucx_perftest";

/// The Debian package that has it (and `ucx_info`).
const PACKAGE: &str = "ucx-utils";

/// Bytes in UCX's "MB".
const UCX_MB: f64 = 1_048_576.0;

/// How many ports a point tries before it is given up.
const PORT_TRIES: usize = 4;

/// How long a server gets to start listening.
const READY: Duration = Duration::from_secs(10);

/// The tests UCX's tool measures the same way as btl-perf.
pub fn supports(test: Test) -> bool {
    ucx_test(test).is_some()
}

/// The tests of [`supports`], by name, comma-separated.
pub fn supported_names() -> String {
    super::test_names(supports)
}

/// `ucx_perftest`'s name for `test`.
fn ucx_test(test: Test) -> Option<&'static str> {
    match test {
        Test::Lat => Some("tag_lat"),
        Test::Bw | Test::MsgRate => Some("tag_bw"),
        Test::PutBw => Some("ucp_put_bw"),
        Test::GetBw => Some("ucp_get"),
        Test::AtomicLat => Some("ucp_fadd"),
        Test::AtomicCswapLat => Some("ucp_cswap"),
        Test::AtomicRate => Some("ucp_add"),
        Test::Bibw | Test::PutLat | Test::GetLat => None,
    }
}

/// The arguments both sides of a point share: test, size, operations,
/// warm-up, port and (when pinned) core.
pub fn point_args(
    test: Test,
    size: usize,
    plan: &Plan,
    port: u16,
    core: Option<usize>,
) -> Result<Vec<String>, String> {
    let name = ucx_test(test).ok_or_else(|| format!("{test} has no ucx_perftest twin"))?;
    let per = plan.window.max(1);
    let mut v = vec![
        "-t".to_string(),
        name.to_string(),
        "-s".to_string(),
        size.to_string(),
        "-n".to_string(),
        plan.iters.saturating_mul(per).max(1).to_string(),
        "-w".to_string(),
        plan.warmup.saturating_mul(per).to_string(),
        "-p".to_string(),
        port.to_string(),
        "-f".to_string(),
        "-v".to_string(),
    ];
    if let Some(c) = core {
        v.push("-c".to_string());
        v.push(c.to_string());
    }
    Ok(v)
}

/// The value for `test` in the client's CSV output: a header line whose
/// fields include `overall_lat`, `overall_bw` and `overall_mr`, then rows
/// of numbers, the final result last (other lines, such as UCX's own log
/// lines, are skipped). Latency stays in µs; bandwidth becomes 10^6 B/s.
pub fn parse_csv(text: &str, test: Test) -> Result<f64, String> {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let header = lines
        .by_ref()
        .find(|l| l.contains("overall_lat"))
        .ok_or_else(|| format!("no result header in {:?}", tail(text.as_bytes())))?;
    let (column, scale) = match test.unit() {
        super::Unit::Micros => ("overall_lat", 1.0),
        super::Unit::MBps => ("overall_bw", UCX_MB / 1e6),
        super::Unit::MsgPerSec | super::Unit::OpsPerSec => ("overall_mr", 1.0),
    };
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    let at = names
        .iter()
        .position(|f| *f == column)
        .ok_or_else(|| format!("no {column} column in {header:?}"))?;
    let row = lines
        .rfind(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            f.len() == names.len() && f.iter().all(|v| v.parse::<f64>().is_ok())
        })
        .ok_or_else(|| format!("no result under {header:?}"))?;
    let value: f64 = row
        .split(',')
        .nth(at)
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("{column} is not a number in {row:?}"))?;
    if !(value.is_finite() && value > 0.0) {
        return Err(format!("{column} is {value} in {row:?}"));
    }
    Ok(value * scale)
}

/// UCX's version, from the first line of `ucx_info -v` (the tool itself
/// prints none), or a placeholder when that cannot be had.
pub async fn version(limit: Duration) -> String {
    let mut cmd = Command::new("ucx_info");
    cmd.arg("-v");
    match run_tool(cmd, "ucx_info", PACKAGE, limit).await {
        Ok(done) if done.ok => String::from_utf8_lossy(&done.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches('#')
            .trim()
            .to_string(),
        _ => "UCX (version unknown)".to_string(),
    }
}

/// `ucx_perftest` with `args` over `b`'s transports, on its own core when
/// `pinned` (else with rank 0's affinity, as `--pin none` asks), killed if
/// rank 0's thread ends.
fn tool(b: Baseline, args: &[String], pinned: bool) -> Command {
    let mut cmd = Command::new(TOOL);
    cmd.args(args).envs(env(b));
    if pinned {
        // Its `-c` then chooses among all cores.
        free_cores(&mut cmd);
    }
    // SAFETY: prctl is async-signal-safe and the closure touches nothing
    // but its arguments; failure is read from errno only. (The signal
    // follows the thread that spawned the tool: rank 0's runtime is
    // current-thread, so that is the rank itself.)
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Whether some socket listens on TCP `port` (any address, v4 or v6), as
/// `/proc/net/tcp{,6}` say: a line whose local address ends in the port
/// (hex) and whose state is `0A` (LISTEN).
pub fn listening(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f)
            .map(|t| listens_in(&t, port))
            .unwrap_or(false)
    })
}

fn listens_in(table: &str, port: u16) -> bool {
    let want = format!("{port:04X}");
    table.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3 && f[1].rsplit(':').next() == Some(want.as_str()) && f[3] == "0A"
    })
}

/// Start a server on `port` and wait until it listens (its output is
/// block-buffered into a pipe, so it cannot say so in time). `Err(None)`:
/// it exited before listening, most likely because the port was taken;
/// `Err(Some(why))`: give up.
async fn start_server(
    b: Baseline,
    args: &[String],
    port: u16,
    pinned: bool,
) -> Result<Child, Option<String>> {
    let mut cmd = tool(b, args, pinned);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut child = spawn(&mut cmd, TOOL, PACKAGE).map_err(Some)?;
    let since = std::time::Instant::now();
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return Err(None);
        }
        if listening(port) {
            return Ok(child);
        }
        if since.elapsed() > READY {
            return Err(Some(format!(
                "the server did not listen within {} s",
                READY.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Measure one point over `b`: a server on `cores.1`, a client on `cores.0`.
async fn point(
    b: Baseline,
    test: Test,
    size: usize,
    plan: &Plan,
    cores: (Option<usize>, Option<usize>),
    limit: Duration,
) -> Result<f64, String> {
    let pinned = cores.0.is_some() || cores.1.is_some();
    for _ in 0..PORT_TRIES {
        // Below Linux's ephemeral ports (32768 up), which clients take.
        let port = rand::random_range(20_000u16..32_768);
        if listening(port) {
            continue;
        }
        let args = point_args(test, size, plan, port, cores.1)?;
        let mut server = match start_server(b, &args, port, pinned).await {
            Ok(c) => c,
            Err(None) => continue,
            Err(Some(why)) => return Err(why),
        };
        let mut args = vec!["127.0.0.1".to_string()];
        args.extend(point_args(test, size, plan, port, cores.0)?);
        let done = run_tool(tool(b, &args, pinned), TOOL, PACKAGE, limit).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), server.wait()).await;
        let _ = server.kill().await;
        let done = done?;
        if !done.ok {
            return Err(done.failure(TOOL));
        }
        return parse_csv(&String::from_utf8_lossy(&done.stdout), test);
    }
    Err(format!(
        "no server came up on {PORT_TRIES} ports (each exited before listening)"
    ))
}

/// Measure `points` over `b`, one `ucx_perftest` pair each, every pair limited to
/// `limit`; the client runs on `cores.0` and the server on `cores.1`. One
/// result per point, in order: after a point fails, the test's other
/// points are not tried (they get the same reason), and when the tool
/// cannot be started at all, no further point is.
pub async fn measure(
    b: Baseline,
    points: &[(Test, usize, Plan)],
    cores: (Option<usize>, Option<usize>),
    limit: Duration,
    tick: &mut dyn FnMut(&str),
) -> Vec<Result<f64, String>> {
    let mut out: Vec<Result<f64, String>> = Vec::with_capacity(points.len());
    let mut failed: Vec<(Test, String)> = Vec::new();
    let mut missing: Option<String> = None;
    for &(test, size, plan) in points {
        if let Some(why) = &missing {
            out.push(Err(why.clone()));
            continue;
        }
        if let Some((_, why)) = failed.iter().find(|(t, _)| *t == test) {
            out.push(Err(why.clone()));
            continue;
        }
        let r = point(b, test, size, &plan, cores, limit)
            .await
            .map_err(|e| format!("{test} at {size} B: {e}"));
        match &r {
            Ok(_) => tick(&format!("{test} at {size} B over {}", b.name())),
            Err(why)
                if why.contains(&format!("{TOOL} not found"))
                    || why.contains(&format!("cannot start {TOOL}")) =>
            {
                missing = Some(why.clone());
            }
            Err(why) => failed.push((test, why.clone())),
        }
        out.push(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str =
        "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
                       20000,0.387,0.407,0.409,18.75,20.00,2457732,2457000\n";

    #[test]
    fn results_are_read_by_column_and_converted() {
        assert_eq!(parse_csv(OUT, Test::Lat), Ok(0.409));
        let bw = parse_csv(OUT, Test::Bw).unwrap();
        assert!((bw - 20.0 * 1.048_576).abs() < 1e-9, "{bw}");
        assert_eq!(parse_csv(OUT, Test::MsgRate), Ok(2_457_000.0));
        // Atomics: latency as is, the add rate from the message rate.
        assert_eq!(parse_csv(OUT, Test::AtomicLat), Ok(0.409));
        assert_eq!(parse_csv(OUT, Test::AtomicCswapLat), Ok(0.409));
        assert_eq!(parse_csv(OUT, Test::AtomicRate), Ok(2_457_000.0));
    }

    #[test]
    fn the_final_row_is_read_past_log_lines() {
        let text = "iterations,overall_lat,overall_bw,overall_mr\n\
                    [1796.5] [host:1:0] parser.c:1 UCX WARN unused variable\n\
                    1000,0.9,1.0,10\n\
                    2000,0.5,2.0,20\n";
        assert_eq!(parse_csv(text, Test::Lat), Ok(0.5));
        assert_eq!(parse_csv(text, Test::MsgRate), Ok(20.0));
    }

    #[test]
    fn bad_output_is_an_error() {
        for bad in [
            "",
            "Waiting for connection...",
            "iterations,overall_lat\n",
            "iterations,overall_lat\n100\n",
            "iterations,overall_lat\n100,fast\n",
            "iterations,overall_lat\n100,-1\n",
            "iterations,overall_lat\n100,NaN\n",
            "iterations,avg_lat\n100,0.5\n",
        ] {
            assert!(parse_csv(bad, Test::Lat).is_err(), "{bad:?} was accepted");
        }
        assert!(parse_csv("iterations,overall_lat\n100,0.5\n", Test::Bw).is_err());
    }

    #[test]
    fn points_scale_windowed_counts() {
        let lat = Plan {
            iters: 1000,
            warmup: 100,
            window: 1,
        };
        let a = point_args(Test::Lat, 8, &lat, 30000, Some(1)).unwrap();
        assert_eq!(
            a.join(" "),
            "-t tag_lat -s 8 -n 1000 -w 100 -p 30000 -f -v -c 1"
        );
        let bw = Plan {
            iters: 100,
            warmup: 10,
            window: 64,
        };
        let b = point_args(Test::PutBw, 1 << 20, &bw, 30001, None).unwrap();
        assert_eq!(
            b.join(" "),
            "-t ucp_put_bw -s 1048576 -n 6400 -w 640 -p 30001 -f -v"
        );
        assert!(point_args(Test::PutLat, 8, &lat, 1, None).is_err());
        let f = point_args(Test::AtomicLat, 8, &lat, 30002, None).unwrap();
        assert_eq!(
            f.join(" "),
            "-t ucp_fadd -s 8 -n 1000 -w 100 -p 30002 -f -v"
        );
        let c = point_args(Test::AtomicCswapLat, 8, &lat, 30003, None).unwrap();
        assert!(c.join(" ").starts_with("-t ucp_cswap -s 8 "), "{c:?}");
        let r = point_args(Test::AtomicRate, 8, &bw, 30004, None).unwrap();
        assert_eq!(r.join(" "), "-t ucp_add -s 8 -n 6400 -w 640 -p 30004 -f -v");
        assert!(supports(Test::GetBw) && !supports(Test::Bibw) && !supports(Test::PutLat));
    }

    #[test]
    fn tcp_stays_on_loopback() {
        assert_eq!(env(Baseline::Ucx), [("UCX_TLS", "sm,self")]);
        assert_eq!(
            env(Baseline::UcxTcp),
            [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")]
        );
    }

    #[test]
    fn listening_sockets_are_found_by_port_and_state() {
        let table = "  sl  local_address rem_address   st tx_queue\n\
                     \x20  0: 00000000:5BA0 00000000:0000 0A 00000000:00000000\n\
                     \x20  1: 0100007F:5BA1 0100007F:9C40 01 00000000:00000000\n";
        assert!(listens_in(table, 23456));
        assert!(
            !listens_in(table, 23457),
            "an established socket is not listening"
        );
        assert!(!listens_in(table, 1));
        let v6 = "sl local rem st\n 0: 00000000000000000000000000000000:0016 00000000000000000000000000000000:0000 0A 0\n";
        assert!(listens_in(v6, 22));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(listening(l.local_addr().unwrap().port()));
    }
}

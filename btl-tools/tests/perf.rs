//! `btl-perf` end to end: alone (it starts its own two ranks), under
//! `btl-run -n 2`, and under Open MPI's `mpirun -np 2` where installed.
//! Tiny sizes and few iterations; output is parsed, speed never asserted.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

const PERF: &str = env!("CARGO_BIN_EXE_btl-perf");
const RUN: &str = env!("CARGO_BIN_EXE_btl-run");

/// Small and quick: sizes 1..16 B, a few iterations, a watchdog.
const QUICK: &[&str] = &[
    "--max-size",
    "16",
    "--iters",
    "5",
    "--warmup",
    "1",
    "--window",
    "2",
    "--watchdog",
    "60",
];

/// Run `cmd` under `timeout` (its arguments and the variables it sets are
/// passed on; variables it removes are not), and require success.
fn run(cmd: &mut Command) -> Output {
    let out = Command::new("timeout")
        .arg("180")
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .envs(cmd.get_envs().filter_map(|(k, v)| v.map(|v| (k, v))))
        .stdin(Stdio::null())
        .output()
        .expect("command starts");
    assert!(
        out.status.success(),
        "{:?} failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        cmd,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("btl-perf-test-{}-{name}", std::process::id()))
}

/// (test, wire) pairs present in a JSON report.
fn series(j: &serde_json::Value) -> BTreeSet<(String, String)> {
    j["results"]
        .as_array()
        .expect("results array")
        .iter()
        .map(|r| {
            assert!(r["value"].as_f64().is_some_and(|v| v > 0.0), "{r}");
            (
                r["test"].as_str().unwrap().to_string(),
                r["wire"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn alone_runs_every_test_with_baselines_and_plots() {
    let svg = temp("all.svg");
    let out = run(Command::new(PERF)
        .args(["--test", "all", "--json", "--plot"])
        .arg(&svg)
        .args(QUICK));
    let j = json(&out);
    let got = series(&j);
    let tests = [
        "lat", "bw", "bibw", "put_lat", "put_bw", "get_lat", "get_bw", "msg_rate",
    ];
    for t in tests {
        assert!(
            got.contains(&(t.to_string(), "async-btl/sm".to_string())),
            "{t} over async-btl missing: {got:?}"
        );
        for b in ["unix", "tcp", "udp"] {
            if !(t == "bibw" && b == "udp") {
                assert!(
                    got.contains(&(t.to_string(), b.to_string())),
                    "{t} over {b} missing"
                );
            }
        }
    }
    // msg_rate is measured at 8 B only; the others at 1..16 B.
    let sizes: BTreeSet<u64> = j["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["test"] == "lat")
        .map(|r| r["size"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [1, 2, 4, 8, 16].into_iter().collect());
    assert!(!j["ratios"].as_array().unwrap().is_empty());
    let h = &j["header"];
    assert!(h["machine"]["cores"].as_u64().unwrap() >= 1);
    assert!(h["date"].as_str().unwrap().ends_with('Z'));
    for k in [
        "progress",
        "pin",
        "baselines",
        "transport",
        "sizes",
        "counts",
    ] {
        assert!(h["settings"][k].is_string(), "setting {k} missing: {h}");
    }

    let text = std::fs::read_to_string(&svg).expect("plot written");
    let _ = std::fs::remove_file(&svg);
    assert!(text.starts_with("<svg"), "{}", &text[..text.len().min(80)]);
    // One line per series in each panel: lat and bw, 4 series each.
    let lines = text.matches("<polyline").count();
    assert!(lines >= 8, "{lines} polylines");
    for name in ["async-btl/sm", "unix", "tcp", "udp"] {
        assert!(text.contains(name), "legend lacks {name}");
    }
}

#[test]
fn under_btl_run_with_csv_and_table() {
    let out = run(Command::new(RUN)
        .args(["-n", "2", "--no-prefix", "--timeout", "150", "--", PERF])
        .args(["--test", "lat,put_bw", "--baseline", "unix", "--csv"])
        .args(QUICK));
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(
        rows[0],
        ["test", "wire", "size", "value", "unit", "iters", "warmup", "window"]
    );
    let wires: BTreeSet<(&str, &str)> = rows[1..].iter().map(|r| (r[0], r[1])).collect();
    let want: BTreeSet<(&str, &str)> = [
        ("lat", "async-btl/sm"),
        ("lat", "unix"),
        ("put_bw", "async-btl/sm"),
        ("put_bw", "unix"),
    ]
    .into_iter()
    .collect();
    assert_eq!(wires, want);
    for r in &rows[1..] {
        assert!(r[3].parse::<f64>().is_ok_and(|v| v > 0.0), "{r:?}");
    }
    assert!(text.contains("# launcher: BtlRun"), "{text}");

    // Repeated runs under a launcher: each opens the fabric again, and the
    // report holds one row per point, the best of the runs.
    let table = run(Command::new(RUN)
        .args(["-n", "2", "--no-prefix", "--", PERF])
        .args(["--test", "lat", "--baseline", "tcp", "--progress", "busy"])
        .args(["--repeat", "2"])
        .args(QUICK));
    let t = String::from_utf8_lossy(&table.stdout);
    assert!(t.contains("# lat (us)") && t.contains("x tcp"), "{t}");
    assert!(t.contains("BusyPoll"), "{t}");
    assert!(t.contains("# note: best of 2 runs"), "{t}");
    let rows: Vec<&str> = t
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    let sizes: BTreeSet<&str> = rows
        .iter()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(rows.len(), sizes.len(), "one row per size: {t}");
}

#[test]
fn under_mpirun() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("skipped: mpirun not found (apt-get install openmpi-bin)");
        return;
    }
    // Asked for, the Open MPI baseline is skipped: no mpirun inside mpirun.
    // No BTL_JOB_KEY: the key comes from a per-user secret, kept here
    // rather than in the real home directory.
    let secret = std::env::temp_dir().join(format!("abtl-perf-secret-{}", std::process::id()));
    let secret_env = format!("BTL_SECRET_FILE={}", secret.join("secret").display());
    let out = run(Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args(["-x", &secret_env, PERF])
        .args(["--test", "bw", "--baseline", "ompi", "--json"])
        .args(QUICK));
    let _ = std::fs::remove_dir_all(&secret);
    let j = json(&out);
    let got = series(&j);
    assert_eq!(
        got,
        [("bw".to_string(), "async-btl/sm".to_string())]
            .into_iter()
            .collect()
    );
    assert_eq!(j["header"]["settings"]["launcher"], "OpenMpi");
    let notes = j["header"]["notes"].to_string();
    assert!(
        notes.contains("ompi skipped") && notes.contains("OMPI_COMM_WORLD_SIZE"),
        "{notes}"
    );
}

/// Whether `tool --version` runs.
fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The (test, size) points a report has for `wire`, each checked to carry
/// a positive value.
fn points_of(j: &serde_json::Value, wire: &str) -> BTreeSet<(String, u64)> {
    j["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["wire"] == wire)
        .map(|r| {
            assert!(r["value"].as_f64().unwrap() > 0.0, "{r}");
            (
                r["test"].as_str().unwrap().into(),
                r["size"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn open_mpi_baseline_beside_async_btl() {
    if !(have("mpicc") && have("mpirun")) {
        eprintln!(
            "skipped: mpicc or mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
        );
        return;
    }
    let args = ["--test", "lat,bw", "--baseline", "ompi", "--min-size", "8"];
    let out =
        run(Command::new(PERF)
            .args(args)
            .args(["--max-size", "64", "--iters", "50", "--json"]));
    let j = json(&out);
    let got = series(&j);
    for t in ["lat", "bw"] {
        for w in ["async-btl/sm", "ompi"] {
            assert!(
                got.contains(&(t.to_string(), w.to_string())),
                "{t} over {w} missing; notes: {}",
                j["header"]["notes"]
            );
        }
    }
    let ompi = points_of(&j, "ompi");
    assert_eq!(ompi.len(), 8, "lat and bw at 8..64 B: {ompi:?}");
    let ratios = j["ratios"].as_array().unwrap();
    assert!(ratios
        .iter()
        .any(|r| r["baseline"] == "ompi" && r["test"] == "bw"));

    // The table has the ompi column and its ratio column.
    let table = run(Command::new(PERF)
        .args(args)
        .args(["--max-size", "8", "--iters", "50"]));
    let t = String::from_utf8_lossy(&table.stdout);
    assert!(t.contains(" ompi") && t.contains("x ompi"), "{t}");
    assert!(t.contains("# note: ompi: "), "{t}");
}

/// Whether `ucx_perftest` can be started (it has no `--version`).
fn have_ucx() -> bool {
    Command::new("ucx_perftest")
        .arg("-h")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

#[test]
fn ucx_baseline_beside_async_btl() {
    if !have_ucx() {
        eprintln!("skipped: ucx_perftest not found (apt-get install ucx-utils)");
        return;
    }
    let out = run(Command::new(PERF).args([
        "--test",
        "lat,bw,put_lat,put_bw,get_bw,msg_rate",
        "--baseline",
        "ucx",
        "--min-size",
        "8",
        "--max-size",
        "16",
        "--iters",
        "50",
        "--json",
    ]));
    let j = json(&out);
    let notes = j["header"]["notes"].to_string();
    let ucx = points_of(&j, "ucx");
    let mut want: BTreeSet<(String, u64)> = ["lat", "bw", "put_bw", "get_bw"]
        .iter()
        .flat_map(|t| [8, 16].map(|s| (t.to_string(), s)))
        .collect();
    want.insert(("msg_rate".to_string(), 8));
    assert_eq!(ucx, want, "notes: {notes}");
    assert!(
        notes.contains("ucx: ") && notes.contains("UCX_TLS=sm,self"),
        "{notes}"
    );
    // Its bw streams where ours answers each window: the report says so.
    assert!(
        notes.contains("ucx: its bw (tag_bw) streams with no answer"),
        "{notes}"
    );
    assert!(j["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["baseline"] == "ucx" && r["test"] == "put_bw"));
}

/// A directory to use as PATH, holding `timeout` (which `run` needs) and
/// nothing else.
fn bare_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("btl-perf-path-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let timeout = std::env::split_paths(&std::env::var_os("PATH").unwrap())
        .map(|d| d.join("timeout"))
        .find(|p| p.exists())
        .expect("timeout is on PATH");
    let _ = std::fs::remove_file(dir.join("timeout"));
    std::os::unix::fs::symlink(timeout, dir.join("timeout")).unwrap();
    dir
}

#[test]
fn a_missing_ucx_is_a_note_not_a_failure() {
    let dir = bare_path("ucx");
    let out = run(Command::new(PERF)
        .env("PATH", &dir)
        .args(["--test", "lat", "--baseline", "ucx,ucx-tcp", "--json"])
        .args(QUICK));
    let j = json(&out);
    let notes = j["header"]["notes"].to_string();
    for b in ["ucx skipped", "ucx-tcp skipped"] {
        assert!(
            notes.contains(b) && notes.contains("apt-get install ucx-utils"),
            "{b}: {notes}"
        );
    }
    assert!(series(&j).contains(&("lat".to_string(), "async-btl/sm".to_string())));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ucx_tcp_baseline_beside_async_btl() {
    if !have_ucx() {
        eprintln!("skipped: ucx_perftest not found (apt-get install ucx-utils)");
        return;
    }
    let out = run(Command::new(PERF).args([
        "--test",
        "lat,put_lat,put_bw",
        "--baseline",
        "ucx-tcp",
        "--min-size",
        "8",
        "--max-size",
        "8",
        "--iters",
        "50",
        "--json",
    ]));
    let j = json(&out);
    let notes = j["header"]["notes"].to_string();
    let want: BTreeSet<(String, u64)> = [("lat".to_string(), 8), ("put_bw".to_string(), 8)].into();
    assert_eq!(points_of(&j, "ucx-tcp"), want, "notes: {notes}");
    assert!(
        notes.contains("ucx-tcp: ") && notes.contains("UCX_TLS=tcp UCX_NET_DEVICES=lo"),
        "{notes}"
    );
}

/// Whether the libfabric baseline can be built here: a C compiler and
/// libfabric's headers.
fn have_libfabric_dev() -> bool {
    have("cc") && std::path::Path::new("/usr/include/rdma/fabric.h").exists()
}

/// btl-perf's JSON report with `args`, its `ofi` baseline on the default
/// provider and address; `None` (with the reason printed) where the
/// program cannot be built.
fn with_ofi(args: &[&str]) -> Option<serde_json::Value> {
    if !have_libfabric_dev() {
        eprintln!("skipped: no cc or no libfabric headers (apt-get install libfabric-dev)");
        return None;
    }
    let out = run(Command::new(PERF)
        .env_remove("BTL_RDMA_PROVIDER")
        .env_remove("BTL_RDMA_ADDR")
        .args(["--baseline", "ofi", "--iters", "50", "--json"])
        .args(args));
    Some(json(&out))
}

#[test]
fn ofi_baseline_beside_async_btl() {
    let Some(j) = with_ofi(&[
        "--test",
        "lat,bw,put_lat,put_bw,get_bw,bibw,msg_rate",
        "--min-size",
        "8",
        "--max-size",
        "16",
    ]) else {
        return;
    };
    let notes = j["header"]["notes"].to_string();
    // msg_rate (8 B only) keeps a window of 4096 receives posted, twice
    // what tcp;ofi_rxm's receive queue takes.
    let want: BTreeSet<(String, u64)> = ["lat", "bw", "put_lat", "put_bw", "get_bw"]
        .iter()
        .flat_map(|t| [8, 16].map(|s| (t.to_string(), s)))
        .chain([("msg_rate".to_string(), 8)])
        .collect();
    assert_eq!(points_of(&j, "ofi"), want, "notes: {notes}");
    assert!(
        notes.contains("ofi: libfabric") && notes.contains("provider tcp;ofi_rxm"),
        "{notes}"
    );
    assert!(notes.contains("bound to 127.0.0.1"), "{notes}");
    assert!(j["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["baseline"] == "ofi" && r["test"] == "put_lat"));
}

#[test]
fn interleaved_ofi_points_follow_async_btls_own() {
    let Some(j) = with_ofi(&[
        "--test",
        "lat,put_bw,bibw",
        "--interleave",
        "--sizes",
        "8,16",
        "--repeat",
        "2",
        "--pick",
        "median",
    ]) else {
        return;
    };
    let notes = j["header"]["notes"].to_string();
    assert!(notes.contains("ofi_pp point by point"), "{notes}");
    assert!(notes.contains("median of the runs' own ratios"), "{notes}");
    // In the order measured: each ofi point right after async-btl's, and
    // nothing of ofi where it has no test (bibw).
    let order: Vec<(String, u64, String)> = j["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["test"].as_str().unwrap().to_string(),
                r["size"].as_u64().unwrap(),
                r["wire"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let ofi: Vec<_> = order.iter().filter(|p| p.2 == "ofi").collect();
    assert_eq!(ofi.len(), 4, "{order:?}");
    for (i, p) in order.iter().enumerate().filter(|(_, p)| p.2 == "ofi") {
        let before = &order[i - 1];
        assert_eq!(
            (&before.0, before.1),
            (&p.0, p.1),
            "{order:?}: ofi's point follows async-btl's"
        );
        assert!(before.2.starts_with("async-btl/"), "{order:?}");
    }
    assert!(order.iter().any(|p| p.0 == "bibw"), "{order:?}");
    assert_eq!(
        j["ratios"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["baseline"] == "ofi")
            .count(),
        4
    );
}

#[test]
fn a_missing_compiler_is_a_note_for_ofi() {
    let dir = bare_path("ofi");
    let out = run(Command::new(PERF)
        .env("PATH", &dir)
        .args(["--test", "lat", "--baseline", "ofi", "--json"])
        .args(QUICK));
    let j = json(&out);
    let notes = j["header"]["notes"].to_string();
    assert!(
        notes.contains("ofi skipped") && notes.contains("cc not found"),
        "{notes}"
    );
    assert!(series(&j).contains(&("lat".to_string(), "async-btl/sm".to_string())));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_options_are_refused_with_a_message() {
    for args in [
        &["--test", "nope"][..],
        &["--pin", "x"],
        &["--baseline", "sctp"],
        &["--min-size", "1M", "--max-size", "1K"],
        &["--repeat", "0"],
        &["--pick", "worst"],
        &["--sizes", "40,x"],
        &["--sizes", "40", "--max-size", "1K"],
        &["--atomic-target", "mapped"],
    ] {
        let out = Command::new(PERF).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(!out.stderr.is_empty());
    }
}

#[test]
fn compare_measures_one_series_per_transport() {
    let out = run(Command::new(PERF)
        .args([
            "--compare",
            "sm,udp",
            "--test",
            "lat",
            "--baseline",
            "unix",
            "--json",
        ])
        .args(QUICK));
    let s = series(&json(&out));
    for want in ["async-btl/sm", "async-btl/udp", "unix"] {
        assert!(
            s.iter().any(|(_, w)| w == want),
            "no {want} series in {s:?}"
        );
    }
}

#[test]
fn listed_sizes_are_run_exactly() {
    // Sizes around the fast box's second slot (41 B) and a size that is no
    // power of two, listed out of order: every series has exactly these
    // points, and the header says they were listed.
    let out = run(Command::new(PERF)
        .args(["--test", "lat,put_bw", "--baseline", "unix", "--json"])
        .args(["--sizes", "41,40,3K"])
        .args(["--iters", "5", "--warmup", "1", "--window", "2"]));
    let j = json(&out);
    for wire in ["async-btl/sm", "unix"] {
        let want: BTreeSet<(String, u64)> = ["lat", "put_bw"]
            .iter()
            .flat_map(|t| [40, 41, 3072].map(|n| (t.to_string(), n)))
            .collect();
        assert_eq!(points_of(&j, wire), want, "{wire}");
    }
    let header = j["header"].to_string();
    assert!(header.contains("41, 40, 3072 B, as listed"), "{header}");
}

const ATOMICS: [&str; 3] = ["atomic_lat", "atomic_cswap_lat", "atomic_rate"];

/// Few operations: 200 timed atomics, 20 windows of 8 adds.
const ATOMIC_QUICK: &[&str] = &[
    "--iters",
    "200",
    "--warmup",
    "10",
    "--window",
    "8",
    "--watchdog",
    "60",
];

/// Check that `wire` has one sane row per atomic test: 8 B, the test's
/// unit, a value in a believable range.
fn check_atomic_rows(j: &serde_json::Value, wire: &str) {
    for t in ATOMICS {
        let rows: Vec<&serde_json::Value> = j["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["test"] == t && r["wire"] == wire)
            .collect();
        assert_eq!(rows.len(), 1, "{t} over {wire}: {rows:?}");
        let r = rows[0];
        assert_eq!(r["size"], 8, "{r}");
        let v = r["value"].as_f64().unwrap();
        if t == "atomic_rate" {
            assert_eq!(r["unit"], "op/s", "{r}");
            assert_eq!(r["window"], 8, "{r}");
            // More than 100 operations a second, fewer than 10^10.
            assert!(v > 1e2 && v < 1e10, "{r}");
        } else {
            assert_eq!(r["unit"], "us", "{r}");
            // More than a nanosecond, less than 50 ms, per operation.
            assert!(v > 1e-3 && v < 5e4, "{r}");
        }
    }
}

#[test]
fn atomic_tests_report_one_row_each_and_their_path() {
    let out = run(Command::new(PERF)
        .args([
            "--transport",
            "sm",
            "--test",
            "atomic_lat,atomic_cswap_lat,atomic_rate",
        ])
        .args(["--baseline", "unix", "--json"])
        .args(ATOMIC_QUICK));
    let j = json(&out);
    check_atomic_rows(&j, "async-btl/sm");
    check_atomic_rows(&j, "unix");
    let notes = j["header"]["notes"].to_string();
    for t in ATOMICS {
        assert!(
            notes.contains(&format!("{t} over async-btl/sm: native atomics")),
            "an alloc_region target over sm is native: {notes}"
        );
    }
    assert!(j["header"]["settings"]["atomics"]
        .as_str()
        .unwrap()
        .contains("alloc_region"));
    assert!(j["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["baseline"] == "unix" && r["test"] == "atomic_rate"));

    // A registered buffer is private to rank 1: every atomic is emulated.
    // In the table, each test has one row, at 8 B.
    let out = run(Command::new(PERF)
        .args(["--transport", "sm", "--test", "atomic_lat,atomic_rate"])
        .args(["--baseline", "none", "--atomic-target", "registered"])
        .args(["--min-size", "64"])
        .args(ATOMIC_QUICK));
    let t = String::from_utf8_lossy(&out.stdout);
    for test in ["atomic_lat", "atomic_rate"] {
        assert!(
            t.contains(&format!(
                "# note: {test} over async-btl/sm: emulated atomics"
            )),
            "{t}"
        );
    }
    assert!(
        t.contains("# atomic_lat (us)") && t.contains("# atomic_rate (op/s)"),
        "{t}"
    );
    let rows: Vec<&str> = t
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    assert_eq!(rows.len(), 2, "{t}");
    assert!(rows.iter().all(|r| r.starts_with("8 ")), "{t}");
}

#[test]
fn atomic_tests_beside_ucx() {
    if !have_ucx() {
        eprintln!("skipped: ucx_perftest not found (apt-get install ucx-utils)");
        return;
    }
    let out = run(Command::new(PERF)
        .args([
            "--transport",
            "sm",
            "--test",
            "atomic_lat,atomic_cswap_lat,atomic_rate",
        ])
        .args(["--baseline", "ucx", "--json"])
        .args(ATOMIC_QUICK));
    let j = json(&out);
    check_atomic_rows(&j, "async-btl/sm");
    let notes = j["header"]["notes"].to_string();
    let ucx = points_of(&j, "ucx");
    // Each test is measured by UCX or, where its test cannot run here,
    // named in a note; never a failed run.
    for t in ATOMICS {
        let measured = ucx.contains(&(t.to_string(), 8));
        let noted = notes.contains(&format!("ucx: no {t}")) || notes.contains("ucx skipped");
        assert!(
            measured || noted,
            "{t}: neither a ucx row nor a note: {notes}"
        );
        if measured {
            assert!(
                j["ratios"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|r| r["baseline"] == "ucx" && r["test"] == t),
                "{t} has a ucx row but no ratio"
            );
        } else {
            eprintln!("note: ucx did not measure {t} here: {notes}");
        }
    }
}

#[test]
fn atomic_tests_beside_open_mpi() {
    if !(have("mpicc") && have("mpirun")) {
        eprintln!(
            "skipped: mpicc or mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
        );
        return;
    }
    let out = run(Command::new(PERF)
        .args([
            "--transport",
            "sm",
            "--test",
            "atomic_lat,atomic_cswap_lat,atomic_rate",
        ])
        .args(["--baseline", "ompi", "--json"])
        .args(ATOMIC_QUICK));
    let j = json(&out);
    check_atomic_rows(&j, "async-btl/sm");
    check_atomic_rows(&j, "ompi");
    assert!(j["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["baseline"] == "ompi" && r["test"] == "atomic_lat"));
}

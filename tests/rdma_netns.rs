//! The `rdma` transport between two hosts: two network namespaces joined by
//! a veth pair (10.79.N.1/24 and 10.79.N.2/24, which exist only inside
//! them), one rank in each, `tcp;ofi_rxm` bound to the rank's namespace
//! address, and `BTL_TRANSPORTS=rdma`. The `ring_allreduce` and `kv_store`
//! examples run under `btl-run` and under Open MPI's `mpirun`; the ranks
//! meet through a `dir:` rendezvous (a shared directory, which both
//! namespaces see).
//!
//! Needs root, `ip`, the `rdma` feature and libfabric's `tcp;ofi_rxm`
//! (and `mpirun` for the `mpirun` tests); without them each test prints
//! `skipped:` and why.
//!
//! Like `tests/examples.rs`, this test runs binaries that `cargo test` (or
//! `cargo build --examples --bins`) builds: `target/<profile>/examples/*`
//! and `target/<profile>/btl-run`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Watchdog for one job (seconds); never a speed assertion.
const LIMIT: &str = "90";

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Why these tests cannot run here, if they cannot.
fn unfit() -> Option<String> {
    if !cfg!(feature = "rdma") {
        return Some("built without the `rdma` feature (cargo test --features rdma)".into());
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1))
        == Some("0");
    if !root {
        return Some("not root (network namespaces need it)".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("`ip` is not installed (apt-get install iproute2)".into());
    }
    match Command::new("fi_info").args(["-p", "tcp;ofi_rxm"]).output() {
        Ok(o) if o.status.success() => None,
        Ok(_) => Some("libfabric offers no tcp;ofi_rxm".into()),
        Err(e) => Some(format!("fi_info (libfabric-bin) cannot run: {e}")),
    }
}

/// `target/<profile>/<path>`, beside this test's `deps/` folder.
fn built(path: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let bin = dir.join(path);
    assert!(
        bin.exists(),
        "{} is not built: run `cargo test --features rdma` (it builds it), or `cargo build --examples --bins --features async-btl/rdma,btl-tools/rdma`",
        bin.display()
    );
    bin
}

/// Two namespaces joined by a veth pair, a rendezvous directory, and a
/// wrapper that runs a rank's program inside its rank's namespace.
struct Hosts {
    ns: [String; 2],
    dir: PathBuf,
    wrap: PathBuf,
}

impl Hosts {
    fn new(net: u8) -> Result<Hosts, String> {
        let id = format!("{net}x{}", std::process::id() % 100_000);
        let ns = [format!("abtl-r{id}-a"), format!("abtl-r{id}-b")];
        let (va, vb) = (format!("ra{id}"), format!("rb{id}"));
        let addrs = [format!("10.79.{net}.1"), format!("10.79.{net}.2")];
        let dir = std::env::temp_dir().join(format!("abtl-rdma-netns-{id}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("rv")).map_err(|e| e.to_string())?;
        let wrap = dir.join("in-netns.sh");
        let hosts = Hosts {
            ns: ns.clone(),
            dir: dir.clone(),
            wrap: wrap.clone(),
        };
        sh(&["ip", "netns", "add", &ns[0]])?;
        sh(&["ip", "netns", "add", &ns[1]])?;
        sh(&[
            "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
        ])?;
        for (i, dev) in [&va, &vb].into_iter().enumerate() {
            sh(&["ip", "link", "set", dev, "netns", &ns[i]])?;
            let cidr = format!("{}/24", addrs[i]);
            sh(&["ip", "-n", &ns[i], "addr", "add", &cidr, "dev", dev])?;
            sh(&["ip", "-n", &ns[i], "link", "set", dev, "up"])?;
            sh(&["ip", "-n", &ns[i], "link", "set", "lo", "up"])?;
        }
        // The rank's number from either launcher; the provider bound to
        // the rank's own namespace address, never the machine's.
        let script = format!(
            "#!/bin/sh\n\
             r=${{OMPI_COMM_WORLD_RANK:-$BTL_RANK}}\n\
             if [ \"$r\" = 0 ]; then ns={a}; addr={aa}; else ns={b}; addr={ba}; fi\n\
             exec ip netns exec \"$ns\" env BTL_RDMA_ADDR=\"$addr\" \
             BTL_RENDEZVOUS=dir:{rv} \"$@\"\n",
            a = ns[0],
            b = ns[1],
            aa = addrs[0],
            ba = addrs[1],
            rv = dir.join("rv").display(),
        );
        std::fs::write(&wrap, script).map_err(|e| e.to_string())?;
        sh(&["chmod", "755", &wrap.display().to_string()])?;
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The variables every rank runs with.
const ENV: [(&str, &str); 3] = [
    ("BTL_TRANSPORTS", "rdma"),
    ("BTL_RDMA_PROVIDER", "tcp;ofi_rxm"),
    (
        "RUST_LOG",
        "async_btl::core::fabric=debug,async_btl::rdma=debug",
    ),
];

fn check(label: &str, out: Output, expect: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{label}: {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(expect),
        "{label}: no {expect:?} in\n{stdout}\n--- stderr\n{stderr}"
    );
    // Both ranks routed their peer over rdma, on their namespace's link.
    let routes = stderr.matches("messages=\"rdma\"").count();
    assert_eq!(routes, 2, "{label}: routes\n{stderr}");
    assert!(
        stderr.contains("fabric=10.79."),
        "{label}: provider not bound to the namespace address\n{stderr}"
    );
}

fn under_btl_run(net: u8, example: &str, expect: &str) {
    if let Some(why) = unfit() {
        println!("skipped: {why}");
        return;
    }
    let hosts = Hosts::new(net).expect("network namespaces");
    let mut c = Command::new("timeout");
    c.args([LIMIT])
        .arg(built("btl-run"))
        .args(["-n", "2", "--"])
        .arg(&hosts.wrap)
        .arg(built(&format!("examples/{example}")));
    for (k, v) in ENV {
        c.env(k, v);
    }
    let out = c.output().expect("btl-run starts");
    check(&format!("{example} under btl-run"), out, expect);
}

fn under_mpirun(net: u8, example: &str, expect: &str) {
    if let Some(why) = unfit() {
        println!("skipped: {why}");
        return;
    }
    if Command::new("mpirun").arg("--version").output().is_err() {
        println!("skipped: mpirun not found (apt-get install openmpi-bin)");
        return;
    }
    let hosts = Hosts::new(net).expect("network namespaces");
    let key: String = (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let mut c = Command::new("timeout");
    c.args([
        LIMIT,
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
    ]);
    for (k, _) in ENV {
        c.args(["-x", k]);
    }
    c.args(["-x", "BTL_JOB_KEY"])
        .arg(&hosts.wrap)
        .arg(built(&format!("examples/{example}")))
        .env("BTL_JOB_KEY", key);
    for (k, v) in ENV {
        c.env(k, v);
    }
    let out = c.output().expect("mpirun starts");
    check(&format!("{example} under mpirun"), out, expect);
}

#[test]
fn ring_allreduce_over_rdma_between_namespaces_under_btl_run() {
    under_btl_run(1, "ring_allreduce", "result exact on every rank");
}

#[test]
fn ring_allreduce_over_rdma_between_namespaces_under_mpirun() {
    under_mpirun(2, "ring_allreduce", "result exact on every rank");
}

#[test]
fn kv_store_over_rdma_between_namespaces_under_btl_run() {
    under_btl_run(3, "kv_store", "correct");
}

#[test]
fn kv_store_over_rdma_between_namespaces_under_mpirun() {
    under_mpirun(4, "kv_store", "correct");
}

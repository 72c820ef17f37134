//! `btl-gpu-check` and `scripts/gpu-check.sh` between two real processes:
//! on the GPU test double everywhere, and on the CUDA driver where this
//! machine has one (else the check must say why there is none).

use std::path::Path;
use std::process::{Command, Output};

const CHECK: &str = env!("CARGO_BIN_EXE_btl-gpu-check");

/// Small sizes: the double's "device memory" is host memory.
const SMALL: [&str; 6] = [
    "--max-size",
    "4194304",
    "--bandwidth-bytes",
    "16777216",
    "--order-fills",
    "4",
];

fn check(gpu: &str, faults: &str, json: &Path, extra: &[&str]) -> Output {
    let mut cmd = Command::new(CHECK);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("BTL_")) {
        cmd.env_remove(k);
    }
    if !gpu.is_empty() {
        cmd.env("BTL_SMCUDA_GPU", gpu);
    }
    cmd.env("BTL_SMCUDA_DOUBLE_FAULTS", faults)
        .args(SMALL)
        .args(extra)
        .arg("--json")
        .arg(json)
        .output()
        .expect("btl-gpu-check starts")
}

fn report(json: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(json).expect("the report was written"))
        .expect("valid JSON")
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("btl-gpu-check-{}-{name}.json", std::process::id()))
}

#[test]
fn both_handle_kinds_pass_on_the_test_double() {
    // A copy delay makes every copy complete well after it was queued, so
    // a wait that did not wait would read wrong bytes.
    let json = tmp("double");
    let out = check("test-double", "copy-delay-ms:2", &json, &[]);
    assert!(out.status.success(), "{out:?}");
    let r = report(&json);
    assert_eq!(r["backend"], "test double");
    assert!(r["failures"].as_array().unwrap().is_empty(), "{r}");
    for m in r["modes"].as_array().unwrap() {
        assert!(m["skipped"].is_null(), "{m}");
        let sizes: Vec<u64> = m["sizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_u64().unwrap())
            .collect();
        assert_eq!(sizes.first(), Some(&8));
        assert_eq!(sizes.last(), Some(&4194304));
        assert_eq!(m["ordered"], true);
        assert_eq!(m["new_buffer_id"], true);
        assert_eq!(m["realloc_read_new"], true);
        assert_eq!(m["registered"], true);
        assert_eq!(m["bandwidth"].as_array().unwrap().len(), 2, "1 and 4 MiB");
    }
    let _ = std::fs::remove_file(json);
}

#[test]
fn a_stream_that_does_not_wait_on_the_peer_event_fails_the_check() {
    let json = tmp("skip-wait");
    let out = check("test-double", "skip-wait,copy-delay-ms:5", &json, &[]);
    assert!(!out.status.success(), "{out:?}");
    let r = report(&json);
    let failures = r["failures"].to_string();
    assert!(failures.contains("owner's event"), "{r}");
    let _ = std::fs::remove_file(json);
}

#[test]
fn refused_handles_skip_their_kind_with_the_reason() {
    let json = tmp("no-vmm");
    let out = check("test-double", "no-vmm", &json, &[]);
    assert!(out.status.success(), "legacy handles still pass: {out:?}");
    let r = report(&json);
    let modes = r["modes"].as_array().unwrap();
    assert!(modes[0]["skipped"].as_str().unwrap().contains("VMM"), "{r}");
    assert!(modes[1]["skipped"].is_null(), "{r}");

    let out = check("test-double", "export", &json, &[]);
    assert!(!out.status.success(), "no kind left: {out:?}");

    // A retried open after "already mapped" reaches the memory.
    let out = check("test-double", "already-mapped:1", &json, &[]);
    assert!(out.status.success(), "{out:?}");
    let r = report(&json);
    assert_eq!(r["modes"][0]["cache"][3], 1, "{r}");
    let _ = std::fs::remove_file(json);
}

#[test]
fn the_cuda_check_runs_on_a_gpu_or_says_why_not() {
    let json = tmp("cuda");
    let out = check("", "", &json, &[]);
    let r = report(&json);
    if r["available"] == true {
        assert!(out.status.success(), "{out:?}");
        return;
    }
    let why = r["reason"].as_str().expect("a reason");
    println!("skipped: no GPU here ({why})");
    assert!(why.contains("cuda") || why.contains("CUDA"), "{why}");
    assert!(
        out.status.success(),
        "no GPU is reported, not failed: {out:?}"
    );
    let strict = check("", "", &json, &["--require-gpu"]);
    assert_eq!(strict.status.code(), Some(3));
    let _ = std::fs::remove_file(json);
}

#[test]
fn the_script_runs_prebuilt_binaries_and_writes_its_figures() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let bin = Path::new(CHECK).parent().unwrap();
    let out_dir = std::env::temp_dir().join(format!("btl-gpu-script-{}", std::process::id()));
    let out = Command::new(root.join("scripts/gpu-check.sh"))
        .env("BTL_GPU_BIN", bin)
        .env("BTL_SMCUDA_GPU", "test-double")
        .env("OUT", &out_dir)
        .args(SMALL)
        .output()
        .expect("the script starts");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("== btl-gpu-check") && text.contains("vmm: 8 sizes"),
        "{text}"
    );
    let r = report(&out_dir.join("gpu-check.json"));
    assert!(r["failures"].as_array().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(out_dir);
}

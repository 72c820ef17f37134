//! `btl-info` as users run it: plain text and `--json`.

use std::process::Command;

const BTL_INFO: &str = env!("CARGO_BIN_EXE_btl-info");

fn btl_info(args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(BTL_INFO);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("BTL_")) {
        cmd.env_remove(k);
    }
    cmd.args(args).output().expect("btl-info starts")
}

#[test]
fn json_report_parses_and_lists_every_transport() {
    let out = btl_info(&["--json"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let transports = v["transports"].as_array().expect("a transport list");
    let find = |name: &str| {
        transports
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("{name} missing from {transports:?}"))
    };
    for name in ["self", "sm", "udp", "smcuda", "rdma"] {
        assert!(find(name)["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }
    assert_eq!(find("self")["usable"], true);
    assert_eq!(find("sm")["built"], true);
    assert_eq!(find("smcuda")["usable"], false);
    assert!(v["limits"]["sm_eager_size"].as_u64().is_some_and(|n| n > 0));
    assert!(v["config_error"].is_null());
    assert!(!v["topology"]["binding"]
        .as_array()
        .expect("binding")
        .is_empty());
}

#[test]
fn text_report_names_the_transports() {
    let out = btl_info(&[]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["sm ", "self ", "rdma ", "limits", "topology"] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[test]
fn an_invalid_environment_is_reported_and_fails() {
    let out = Command::new(BTL_INFO)
        .arg("--json")
        .env("BTL_SM_EAGER", "seven")
        .output()
        .expect("btl-info starts");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert!(v["config_error"]
        .as_str()
        .is_some_and(|e| e.contains("BTL_SM_EAGER")));
}

/// The routes a job would take per kind of peer: `self` to this rank,
/// `sm` on the node (where /dev/shm works), and `udp` when
/// `BTL_TRANSPORTS` leaves only it.
#[test]
fn routes_follow_the_preference_order_and_the_allowed_transports() {
    let route = |v: &serde_json::Value, peer: &str| {
        let r = v["routes"]
            .as_array()
            .expect("a route list")
            .iter()
            .find(|r| r["peer"] == peer)
            .unwrap_or_else(|| panic!("no route for {peer}: {v}"))
            .clone();
        (r["messages"].clone(), r["one_sided"].clone())
    };
    let out = btl_info(&["--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(route(&v, "this rank"), ("self".into(), "self".into()));
    let sm_works = v["transports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == "sm" && t["usable"] == true);
    if sm_works {
        assert_eq!(route(&v, "same node"), ("sm".into(), "sm".into()));
    } else {
        println!("sm is not usable here: the same-node route is not checked");
    }
    let out = Command::new(BTL_INFO)
        .arg("--json")
        .env("BTL_TRANSPORTS", "udp")
        .output()
        .expect("btl-info starts");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(route(&v, "this rank"), ("self".into(), "self".into()));
    assert_eq!(route(&v, "same node"), ("udp".into(), "udp".into()));
    assert_eq!(route(&v, "other node"), ("udp".into(), "udp".into()));
}

/// Device memory's route per kind of peer: `smcuda` on the node where a
/// GPU layer opens (the test double here), host-staged elsewhere.
#[test]
fn device_memory_routes_name_smcuda_on_the_node_only() {
    let device = |v: &serde_json::Value, peer: &str| {
        v["routes"]
            .as_array()
            .expect("a route list")
            .iter()
            .find(|r| r["peer"] == peer)
            .unwrap_or_else(|| panic!("no route for {peer}: {v}"))["device_memory"]
            .clone()
    };
    let out = Command::new(BTL_INFO)
        .arg("--json")
        .env("BTL_SMCUDA_GPU", "test-double")
        .output()
        .expect("btl-info starts");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(device(&v, "same node"), "smcuda");
    assert_eq!(device(&v, "other node"), serde_json::Value::Null);
    let text = Command::new(BTL_INFO)
        .env("BTL_SMCUDA_GPU", "test-double")
        .output()
        .expect("btl-info starts");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("other node")
                && l.contains("staged through the host")),
        "{text}"
    );
    // No GPU layer: nothing carries device memory anywhere.
    let out = Command::new(BTL_INFO)
        .arg("--json")
        .env("BTL_SMCUDA_GPU", "none-such")
        .output()
        .expect("btl-info starts");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    for peer in ["this rank", "same node", "other node"] {
        assert_eq!(device(&v, peer), serde_json::Value::Null, "{peer}");
    }
}

//! Tests of launcher detection from environment variables.

use std::collections::HashMap;
use std::path::PathBuf;

use super::{Host, JobInfo, LauncherKind, RendezvousSpec};
use crate::Error;

/// A per-user secret for these tests (one per user, reused by every run),
/// never the real one in `$HOME`.
fn test_secret() -> PathBuf {
    std::env::temp_dir()
        .join(format!("abtl-env-tests-{}", super::current_uid()))
        .join("secret")
}

fn parse(vars: &[(&str, &str)]) -> crate::Result<Option<JobInfo>> {
    let mut map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if !vars.iter().any(|(k, _)| *k == "NO_SECRET") {
        map.entry("BTL_SECRET_FILE".into())
            .or_insert_with(|| test_secret().display().to_string());
    }
    JobInfo::from_lookup(move |k| map.get(k).cloned())
}

fn ok(vars: &[(&str, &str)]) -> JobInfo {
    parse(vars).expect("valid").expect("launched")
}

/// The error message, which must be a `Config` error mentioning every word.
fn config_err(vars: &[(&str, &str)], words: &[&str]) {
    match parse(vars) {
        Err(Error::Config(msg)) => {
            for w in words {
                assert!(msg.contains(w), "{msg:?} should mention {w}");
            }
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

fn uid_dir(job: &str) -> RendezvousSpec {
    RendezvousSpec::Dir(PathBuf::from(format!(
        "/tmp/async-btl-{}/{job}",
        super::current_uid()
    )))
}

const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

#[test]
fn nothing_set_means_not_launched() {
    assert!(parse(&[("HOME", "/root"), ("SLURM_NTASKS", "4")])
        .unwrap()
        .is_none());
}

#[test]
fn btl_run() {
    let j = ok(&[
        ("BTL_RANK", "2"),
        ("BTL_SIZE", "4"),
        ("BTL_LOCAL_RANK", "2"),
        ("BTL_LOCAL_SIZE", "4"),
        ("BTL_RENDEZVOUS", "tcp:127.0.0.1:4000"),
        ("BTL_RENDEZVOUS_HOST", "launcher"),
        ("BTL_JOB_KEY", KEY),
        ("BTL_JOB_ID", "j1"),
    ]);
    assert_eq!((j.rank, j.size, j.local_rank, j.local_size), (2, 4, 2, 4));
    assert_eq!(j.launcher, LauncherKind::BtlRun);
    assert_eq!(j.job_id, "j1");
    assert_eq!(j.job_key.to_hex(), KEY);
    assert_eq!(
        j.rendezvous,
        RendezvousSpec::Tcp {
            addr: "127.0.0.1:4000".into(),
            hosted_by: Host::Launcher
        }
    );
}

#[test]
fn open_mpi_defaults_to_a_job_directory() {
    let j = ok(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMIX_NAMESPACE", "prterun-host-123@1"),
    ]);
    assert_eq!(j.launcher, LauncherKind::OpenMpi);
    assert_eq!(j.job_id, "prterun-host-123@1");
    assert_eq!(j.rendezvous, uid_dir("prterun-host-123_1"));
    let j = ok(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_MCA_ess_base_jobid", "42"),
        ("TMPDIR", "/scratch"),
    ]);
    assert_eq!(j.job_id, "42");
    let uid = super::current_uid();
    assert_eq!(
        j.rendezvous,
        RendezvousSpec::Dir(format!("/scratch/async-btl-{uid}/42").into())
    );
}

#[test]
fn multi_node_without_rendezvous_is_an_error() {
    let multi = [
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMIX_NAMESPACE", "ns"),
    ];
    config_err(&multi, &["several nodes", "BTL_RENDEZVOUS"]);
    let mut with = multi.to_vec();
    with.push(("BTL_RENDEZVOUS", "tcp:node1:5000"));
    let j = ok(&with);
    assert_eq!(
        j.rendezvous,
        RendezvousSpec::Tcp {
            addr: "node1:5000".into(),
            hosted_by: Host::Rank0
        }
    );
}

#[test]
fn slurm() {
    let base = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "2"),
        ("SLURM_JOB_ID", "777"),
        ("SLURM_STEP_ID", "0"),
        ("BTL_RENDEZVOUS", "dir:/shared/rdv"),
    ];
    let mut v = base.to_vec();
    v.push(("SLURM_TASKS_PER_NODE", "3(x2),2"));
    let j = ok(&v);
    assert_eq!((j.rank, j.size, j.local_rank, j.local_size), (5, 8, 1, 2));
    assert_eq!(j.job_id, "777.0");
    assert_eq!(j.launcher, LauncherKind::Slurm);
    let mut v = base.to_vec();
    v.push(("SLURM_NTASKS_PER_NODE", "4"));
    assert_eq!(ok(&v).local_size, 4);
    config_err(&base, &["SLURM_TASKS_PER_NODE"]);
    let mut v = base.to_vec();
    v.push(("SLURM_TASKS_PER_NODE", "3(x"));
    config_err(&v, &["SLURM_TASKS_PER_NODE"]);
    // One node, no BTL_RENDEZVOUS: the job directory.
    let j = ok(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_TASKS_PER_NODE", "2"),
        ("SLURM_JOB_ID", "9"),
    ]);
    assert_eq!(j.rendezvous, uid_dir("9"));
}

#[test]
fn pmi_needs_a_rendezvous() {
    config_err(
        &[("PMI_RANK", "0"), ("PMI_SIZE", "2")],
        &["PMI", "BTL_RENDEZVOUS"],
    );
    let j = ok(&[
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("BTL_RENDEZVOUS", "tcp:h:1"),
    ]);
    assert_eq!(
        (j.launcher, j.rank, j.local_rank, j.local_size),
        (LauncherKind::Pmi, 1, 1, 2)
    );
    assert_eq!(j.job_id, "pmi-tcp:h:1");
    let j = ok(&[("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("BTL_JOB_ID", "x")]);
    assert_eq!(j.rendezvous, uid_dir("x"));
}

#[test]
fn torchrun() {
    let j = ok(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ]);
    assert_eq!(j.launcher, LauncherKind::Torchrun);
    assert_eq!(
        j.rendezvous,
        RendezvousSpec::Tcp {
            addr: "10.0.0.1:29500".into(),
            hosted_by: Host::Rank0
        }
    );
    assert_eq!(j.job_id, "torch-10.0.0.1:29500");
    let j = ok(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "::1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RUN_ID", "run7"),
    ]);
    assert_eq!(
        j.rendezvous,
        RendezvousSpec::Tcp {
            addr: "[::1]:29501".into(),
            hosted_by: Host::Rank0
        }
    );
    assert_eq!(j.job_id, "run7");
    config_err(&[("RANK", "0"), ("WORLD_SIZE", "2")], &["MASTER_ADDR"]);
    config_err(
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
        &["MASTER_PORT"],
    );
}

#[test]
fn partial_sets_name_the_variables() {
    config_err(&[("RANK", "0")], &["RANK", "WORLD_SIZE"]);
    config_err(
        &[("LOCAL_RANK", "0")],
        &["LOCAL_RANK", "RANK", "WORLD_SIZE"],
    );
    config_err(&[("BTL_SIZE", "2")], &["BTL_SIZE", "BTL_RANK"]);
    config_err(
        &[
            ("BTL_RANK", "0"),
            ("BTL_SIZE", "2"),
            ("BTL_LOCAL_RANK", "0"),
        ],
        &["BTL_LOCAL_SIZE"],
    );
    config_err(
        &[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "2")],
        &["OMPI_COMM_WORLD_RANK=2", "below"],
    );
    config_err(
        &[("PMI_RANK", "x"), ("PMI_SIZE", "2")],
        &["PMI_RANK", "\"x\""],
    );
    config_err(&[("SLURM_PROCID", "0")], &["SLURM_NTASKS"]);
    config_err(
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
        &["SLURM_LOCALID"],
    );
    config_err(
        &[("BTL_RANK", "0"), ("BTL_SIZE", "0")],
        &["BTL_RANK=0", "BTL_SIZE=0"],
    );
    config_err(
        &[("BTL_RENDEZVOUS", "tcp:h:1")],
        &["BTL_RENDEZVOUS", "rank"],
    );
}

#[test]
fn bad_generic_values() {
    let base = [("BTL_RANK", "0"), ("BTL_SIZE", "2")];
    let mut v = base.to_vec();
    v.extend([("BTL_JOB_KEY", "abc"), ("BTL_RENDEZVOUS", "tcp:h:1")]);
    config_err(&v, &["BTL_JOB_KEY", "64 hex"]);
    let mut v = base.to_vec();
    v.push(("BTL_RENDEZVOUS", "http://x"));
    config_err(&v, &["BTL_RENDEZVOUS"]);
    let mut v = base.to_vec();
    v.extend([
        ("BTL_RENDEZVOUS", "tcp:h:1"),
        ("BTL_RENDEZVOUS_HOST", "rank3"),
    ]);
    config_err(&v, &["BTL_RENDEZVOUS_HOST"]);
    config_err(&base, &["BTL_RENDEZVOUS"]);
}

#[test]
fn higher_launcher_wins_over_lower() {
    // mpirun inside a Slurm allocation (and a stray RANK): mpirun decides.
    let j = ok(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("PMIX_NAMESPACE", "ns"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_LOCALID", "0"),
        ("RANK", "7"),
    ]);
    assert_eq!((j.launcher, j.rank, j.size), (LauncherKind::OpenMpi, 1, 2));
}

#[test]
fn explicit_btl_rank_must_agree() {
    let agree = [
        ("BTL_RANK", "1"),
        ("BTL_SIZE", "2"),
        ("BTL_RENDEZVOUS", "tcp:h:1"),
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
    ];
    assert_eq!(ok(&agree).launcher, LauncherKind::BtlRun);
    let mut clash = agree.to_vec();
    clash[3] = ("OMPI_COMM_WORLD_RANK", "0");
    config_err(
        &clash,
        &["BTL_RANK=1", "OMPI_COMM_WORLD_RANK=0", "Open MPI"],
    );
    config_err(
        &[
            ("BTL_RANK", "0"),
            ("BTL_SIZE", "2"),
            ("BTL_RENDEZVOUS", "tcp:h:1"),
            ("RANK", "0"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ],
        &["BTL_SIZE=2", "WORLD_SIZE=3"],
    );
}

#[test]
fn derived_key_when_none_given() {
    let vars = [
        ("BTL_RANK", "0"),
        ("BTL_SIZE", "2"),
        ("BTL_RENDEZVOUS", "tcp:h:1"),
        ("BTL_JOB_ID", "j"),
    ];
    let a = ok(&vars);
    let secret = super::secret::load_or_create(&test_secret()).unwrap();
    assert!(a.job_key.ct_eq(&super::JobKey::for_job(&secret, "j")));
    // Another job id, another key; the key is never the hash of public
    // facts alone.
    let mut other = vars;
    other[3] = ("BTL_JOB_ID", "k");
    assert!(!ok(&other).job_key.ct_eq(&a.job_key));
}

#[test]
fn no_place_for_the_secret_is_an_error_with_the_ways_out() {
    let vars = [
        ("BTL_RANK", "0"),
        ("BTL_SIZE", "2"),
        ("BTL_RENDEZVOUS", "tcp:h:1"),
        ("NO_SECRET", "1"),
    ];
    config_err(&vars, &["HOME", "BTL_SECRET_FILE", "BTL_JOB_KEY"]);
    let mut with_key = vars.to_vec();
    with_key.push(("BTL_JOB_KEY", KEY));
    assert_eq!(ok(&with_key).job_key.to_hex(), KEY);
}

#[test]
fn builder_checks_its_settings() {
    let spec = RendezvousSpec::Dir("/tmp/x".into());
    assert!(JobInfo::builder(2, 2)
        .rendezvous(spec.clone())
        .build()
        .is_err());
    assert!(JobInfo::builder(0, 2)
        .local(1, 3)
        .rendezvous(spec.clone())
        .build()
        .is_err());
    assert!(JobInfo::builder(0, 2).build().is_err());
    let j = JobInfo::builder(1, 2)
        .rendezvous(spec)
        .job_id("x")
        .job_key(super::JobKey::random())
        .build()
        .unwrap();
    assert_eq!(
        (j.local_rank, j.local_size, j.launcher),
        (1, 2, LauncherKind::Explicit)
    );
}

//! A TCP rendezvous served by rank 0, attacked by strangers on the same
//! host: a process that knows only public facts (the user id and the job
//! id) cannot take a rank's place, and connections that never present a
//! join, however many, neither hold up the boot nor exhaust rank 0's
//! descriptors. Every refusal is counted and reported in rank 0's log.
//!
//! Ranks are real processes (this binary, re-executed); the rendezvous and
//! the strangers use real sockets on 127.0.0.1 only.

mod common;

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

use async_btl::bootstrap::{all_gather, Host, JobInfo, JobKey, RendezvousSpec};
use async_btl::{Error, Fabric};
use common::*;

/// Watchdog for one job; never a speed assertion.
const WATCHDOG: Duration = Duration::from_secs(90);

/// The child side: boot, report, synchronise, close.
#[test]
fn rank_main() {
    let Ok(scenario) = std::env::var("BTL_TEST_SCENARIO") else {
        return; // the parent test process: nothing to do here
    };
    assert_eq!(scenario, "boot", "unknown scenario");
    if let Some(limit) = std::env::var("BTL_TEST_NOFILE")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        lower_nofile(limit);
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let rt = rank_runtime();
    rt.block_on(async {
        let start = Instant::now();
        let f = Fabric::from_env().await.expect("fabric from launcher env");
        println!("boot_ms={}", start.elapsed().as_millis());
        // The whole snapshot, by name: `stat` picks one counter out.
        println!("stats={:?}", f.stats());
        f.barrier().await.unwrap();
        f.close().await.unwrap();
    });
}

/// Lower this process's soft and hard limits on open descriptors.
fn lower_nofile(limit: u64) {
    let lim = libc::rlimit {
        rlim_cur: limit as libc::rlim_t,
        rlim_max: limit as libc::rlim_t,
    };
    // SAFETY: setrlimit reads the struct we pass and changes only limits.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// Connect to 127.0.0.1:`port` until something listens there (rank 0's
/// server is up); the connection is returned open.
fn first_connection(port: u16) -> TcpStream {
    let start = Instant::now();
    loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            return s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "rank 0 never opened its rendezvous on port {port}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Up to `n` connections to 127.0.0.1:`port` that will never say anything
/// (fewer when the server's accept queue is full and the kernel stops
/// answering).
fn silent_connections(port: u16, n: usize) -> Vec<TcpStream> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut conns = vec![first_connection(port)];
    while conns.len() < n {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => conns.push(s),
            Err(e) => {
                eprintln!("stopped at {} connections of {n}: {e}", conns.len());
                break;
            }
        }
    }
    conns
}

/// The environment of a 2-rank job meeting at rank 0's server on `port`.
fn tcp_env(port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("BTL_RENDEZVOUS", format!("tcp:127.0.0.1:{port}")),
        ("BTL_RENDEZVOUS_HOST", "rank0".into()),
        ("RUST_LOG", "async_btl=info".into()),
    ]
}

fn as_refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn boot_ms(out: &Output) -> u64 {
    value(out, "boot_ms")
        .and_then(|v| v.parse().ok())
        .expect("rank printed boot_ms")
}

/// Rank 0's report of refused connections: (refused, timed out, bad key,
/// shed), from its last log line "rendezvous refused N connections in all
/// (T timed out, K bad key, S shed, O other)".
fn refusals(out: &Output) -> Option<(u64, u64, u64, u64)> {
    let log = String::from_utf8_lossy(&out.stderr);
    let line = log
        .lines()
        .filter(|l| l.contains("rendezvous refused "))
        .rfind(|l| total_of(l).is_some())?;
    let after = |word: &str| -> Option<u64> {
        let i = line.find(word)?;
        let n = line[..i].split_whitespace().last()?;
        n.trim_start_matches('(').parse().ok()
    };
    Some((
        total_of(line)?,
        after(" timed out")?,
        after(" bad key")?,
        after(" shed")?,
    ))
}

/// One counter of the `Stats` a rank printed.
fn stat(out: &Output, name: &str) -> Option<u64> {
    let stats = value(out, "stats")?;
    let rest = stats.split(&format!("{name}: ")).nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// N in "rendezvous refused N connections".
fn total_of(line: &str) -> Option<u64> {
    let rest = line.split("rendezvous refused ").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn twenty_silent_connections_do_not_hold_up_the_boot() {
    let port = free_port();
    let env = tcp_env(port);
    let mut job = prepare_job(2, "boot", &as_refs(&env));
    job.start(0);
    let silent = silent_connections(port, 20);
    job.start(1);
    let outs = job.wait(WATCHDOG);
    assert_ok(&outs);
    // Hang guard: a rendezvous that waits for the strangers' handshakes
    // holds rank 0 for at least 5 s; one that does not boots in well under.
    let ms = boot_ms(&outs[0]);
    assert!(
        ms < 4000,
        "rank 0 took {ms} ms to boot:\n{}",
        stderr_of(&outs[0])
    );
    assert_eq!(silent.len(), 20);
    let report = refusals(&outs[0]);
    assert_eq!(
        report,
        Some((20, 20, 0, 0)),
        "rank 0 should report the 20 silent connections as refused (timed out):\n{}",
        stderr_of(&outs[0])
    );
    assert_eq!(stat(&outs[0], "rendezvous_refused"), Some(20));
    assert_eq!(stat(&outs[1], "rendezvous_refused"), Some(0));
}

#[test]
fn a_flood_of_connections_beyond_the_descriptor_limit_does_not_stall_the_boot() {
    let port = free_port();
    let mut env = tcp_env(port);
    // Rank 0 may hold 40 descriptors: what its fabric needs (about 15),
    // and fewer to spare than the strangers below, or the connections the
    // rendezvous lets handshake at once (64).
    env.push(("BTL_TEST_NOFILE", "40".into()));
    let mut job = prepare_job(2, "boot", &as_refs(&env));
    job.start(0);
    let flood = silent_connections(port, 300);
    assert!(
        flood.len() >= 100,
        "only {} connections got in",
        flood.len()
    );
    job.start(1);
    let outs = job.wait(WATCHDOG);
    let flooded = flood.len() as u64;
    assert_ok(&outs);
    // Hang guard: a rendezvous that lets the strangers fill its descriptor
    // table boots only when their handshakes time out (10 s and more).
    let ms = boot_ms(&outs[0]);
    assert!(
        ms < 5000,
        "rank 0 took {ms} ms to boot:\n{}",
        stderr_of(&outs[0])
    );
    let (total, timed_out, bad_key, shed) = refusals(&outs[0]).unwrap_or_else(|| {
        panic!(
            "rank 0 should report the refused connections:\n{}",
            stderr_of(&outs[0])
        )
    });
    assert_eq!(bad_key, 0);
    assert!(
        shed > 0,
        "the flood should have been shed:\n{}",
        stderr_of(&outs[0])
    );
    assert_eq!(total, timed_out + shed, "{}", stderr_of(&outs[0]));
    // Every stranger is refused, and at most a few of rank 1's attempts
    // besides: a rank whose handshake is shed reconnects.
    assert!(
        (flooded..=flooded + 10).contains(&total),
        "{total} refused for {flooded} strangers:\n{}",
        stderr_of(&outs[0])
    );
    assert_eq!(stat(&outs[0], "rendezvous_refused"), Some(total));
}
/// A key computed from public facts only: a hash of the user id and the
/// job id, as a stranger who knows both would compute it.
fn key_from_public_facts(job_id: &str) -> JobKey {
    use sha2::{Digest, Sha256};
    // SAFETY: getuid cannot fail and touches no memory of ours.
    let uid = unsafe { libc::getuid() };
    let mut h = Sha256::new();
    h.update(b"async-btl derived job key v1\0");
    h.update(uid.to_le_bytes());
    h.update(job_id.as_bytes());
    JobKey::from_bytes(h.finalize().into())
}

fn secret_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "abtl-secret-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_stranger_with_the_public_facts_cannot_take_a_ranks_place() {
    let port = free_port();
    let dir = secret_dir();
    let secret = dir.join("secret");
    let mut env = tcp_env(port);
    // No BTL_JOB_KEY: the ranks derive the key from the user's secret.
    env.push(("BTL_JOB_KEY", String::new()));
    env.push(("BTL_SECRET_FILE", secret.display().to_string()));
    let mut job = prepare_job(2, "boot", &as_refs(&env));
    job.start(0);

    // The stranger joins as rank 1 with the key computed from public facts.
    let stranger = JobInfo::builder(1, 2)
        .rendezvous(RendezvousSpec::Tcp {
            addr: format!("127.0.0.1:{port}"),
            hosted_by: Host::Rank0,
        })
        .job_id("test-boot")
        .job_key(key_from_public_facts("test-boot"))
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let got = rt.block_on(all_gather(
        &stranger,
        b"stranger".to_vec(),
        Duration::from_secs(20),
    ));
    let err = match got {
        Ok(blobs) => {
            job.children.iter_mut().for_each(|c| drop(c.kill()));
            panic!(
                "the stranger joined as rank 1 and received {} address blobs",
                blobs.len()
            );
        }
        Err(e) => e,
    };
    assert!(
        matches!(&err, Error::Bootstrap(m) if m.contains("refused rank 1") && m.contains("wrong job key")),
        "the stranger should be told it was refused for its key: {err}"
    );

    // The real rank 1 still gets in, and rank 0 says whom it refused.
    job.start(1);
    let outs = job.wait(WATCHDOG);
    assert_ok(&outs);
    let log0 = stderr_of(&outs[0]);
    assert!(
        log0.contains("rank 1 at 127.0.0.1:") && log0.contains("presented a wrong job key"),
        "rank 0 should name the refused rank and its address:\n{log0}"
    );
    let (total, _, bad_key, _) = refusals(&outs[0]).expect("refusals reported");
    assert_eq!((total, bad_key), (1, 1), "{log0}");
    assert_eq!(stat(&outs[0], "rendezvous_refused"), Some(1));
    let meta = std::fs::metadata(&secret).expect("the secret file was created");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    std::fs::remove_dir_all(&dir).unwrap();
}

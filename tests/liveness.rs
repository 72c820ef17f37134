//! `BTL_LIVENESS=inline` in rank processes that really have one thread:
//! no libtest harness (it runs tests on threads of its own), `udp` only
//! (`sm` serves its memory from a thread), the launcher's TCP rendezvous
//! (the directory one reads files on tokio's blocking threads). The parent
//! starts two copies of this binary with [`LocalJob`]; rank 1 dies while
//! rank 0 polls `try_recv` in a loop that never yields, so the progress
//! task never runs: rank 0's own library calls must find the loss, and no
//! thread may have been started for it; over `udp` (whose own progress
//! pass also judges silence), then (built with the `rdma` feature, where
//! libfabric has `tcp;ofi_rxm`) over `rdma`, whose progress pass does not:
//! there only the liveness watch, run from the loop's calls, finds the
//! loss. A second `udp` job checks that a rank that starts a thread of its
//! own gets the liveness thread back. Rank 0 also allocates a region
//! (`alloc_region`), which must start no thread in a rank with no `sm`
//! peer.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_btl::launch::LocalJob;
use async_btl::Fabric;

mod common;

fn main() {
    if std::env::var_os("BTL_RANK").is_some() {
        common::current_thread_runtime().block_on(rank());
        return;
    }
    if !single_threaded_libc() {
        println!("skipped: this C library keeps no single-thread flag (glibc does), so BTL_LIVENESS=inline always starts the thread");
        return;
    }
    const UDP: &[(&str, &str)] = &[
        ("BTL_TRANSPORTS", "udp"),
        ("BTL_UDP_PEER_TIMEOUT_MS", "1000"),
    ];
    expect(
        &job("alone", UDP),
        &[("lost", "1"), ("threads", "1"), ("liveness_thread", "0")],
    );
    println!("test udp_single_threaded_rank_sees_the_loss_through_its_own_calls ... ok");

    expect(
        &job("joined", UDP),
        &[("lost", "1"), ("liveness_thread", "1")],
    );
    println!("test a_rank_that_starts_a_thread_gets_the_liveness_thread ... ok");

    // The directory rendezvous (Open MPI's and the test jobs' default)
    // keeps a rank single-threaded too.
    expect(
        &dir_job(UDP),
        &[("lost", "1"), ("threads", "1"), ("liveness_thread", "0")],
    );
    println!("test a_rank_booted_through_a_directory_stays_single_threaded ... ok");

    // `rdma` checks its peers' silence only when asked (`check_peers`):
    // here the liveness watch, run from the loop's `try_recv`, asks.
    if let Some(why) = common::no_rdma() {
        println!(
            "test rdma_single_threaded_rank_sees_the_loss_through_its_own_calls ... skipped: {why}"
        );
        return;
    }
    let rdma = job(
        "alone",
        &[
            ("BTL_TRANSPORTS", "rdma"),
            ("BTL_RDMA_PROVIDER", "tcp;ofi_rxm"),
            ("BTL_RDMA_ADDR", "127.0.0.1"),
            ("BTL_RDMA_PEER_TIMEOUT_MS", "1000"),
        ],
    );
    expect(
        &rdma,
        &[("lost", "1"), ("threads", "1"), ("liveness_thread", "0")],
    );
    println!("test rdma_single_threaded_rank_sees_the_loss_through_its_own_calls ... ok");
}

/// Check what rank 0 wrote against `want`.
fn expect(got: &std::collections::HashMap<String, String>, want: &[(&str, &str)]) {
    for (k, v) in want {
        assert_eq!(got.get(*k).map(String::as_str), Some(*v), "{k} in {got:?}");
    }
}

/// Whether glibc's `__libc_single_threaded` is there to read.
fn single_threaded_libc() -> bool {
    cfg!(all(target_os = "linux", target_env = "gnu"))
}

/// Run the scenario `how` in a 2-rank job with `env`; what rank 0 wrote.
fn job(how: &str, env: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    let dir = std::env::temp_dir().join(format!(
        "abtl-liveness-{}-{how}-{}",
        std::process::id(),
        env[0].1
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let code = common::current_thread_runtime()
        .block_on(
            env.iter()
                .fold(LocalJob::new(exe, 2), |j, (k, v)| j.env(k, v))
                .keep_going(true)
                .timeout(Some(Duration::from_secs(60)))
                .env("BTL_LIVENESS", "inline")
                .env("BTL_TEST_HOW", how)
                .env("BTL_TEST_OUT", &dir)
                .run(),
        )
        .unwrap();
    // Rank 1 aborts by design: the job's code is its signal's.
    assert_ne!(code, 124, "the job timed out");
    let text = std::fs::read_to_string(out_file(&dir)).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    parse(&text)
}

/// The `alone` scenario in a 2-rank job booted through a rendezvous
/// directory (`tests/common`'s jobs); what rank 0 wrote.
fn dir_job(env: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    let dir = std::env::temp_dir().join(format!("abtl-liveness-{}-dir", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.to_str().unwrap().to_string();
    let mut all = env.to_vec();
    all.extend([
        ("BTL_LIVENESS", "inline"),
        ("BTL_TEST_HOW", "alone"),
        ("BTL_TEST_OUT", out.as_str()),
    ]);
    let outs = common::spawn_job(2, "alone", &all).wait(Duration::from_secs(60));
    let text = std::fs::read_to_string(out_file(&dir)).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    if text.is_empty() {
        common::dump(&outs);
    }
    parse(&text)
}

/// `key=value` lines.
fn parse(text: &str) -> std::collections::HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn out_file(dir: &Path) -> PathBuf {
    dir.join("rank0.txt")
}

async fn rank() {
    let f = Fabric::from_env().await.expect("fabric from launcher env");
    if f.rank() == 1 {
        f.endpoint(0).unwrap().send(1, vec![7u8; 8]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        std::process::abort();
    }
    // Memory for peers to reach: with no same-node peer over `sm`, plain
    // registered memory, with no thread to hand it out.
    let _exposed = f.alloc_region(4096).unwrap();
    let mut rx = f.receiver(1).unwrap();
    rx.recv().await.unwrap();
    if std::env::var("BTL_TEST_HOW").as_deref() == Ok("joined") {
        // A thread of the application's own, alive while rank 0 waits.
        std::thread::spawn(|| std::thread::sleep(Duration::from_secs(30)));
    }
    let (lost, took) = common::spin_until_lost(&mut rx);
    let names = common::thread_names();
    let text = format!(
        "lost={}\nms={}\nthreads={}\nliveness_thread={}\nnames={names:?}\n",
        u8::from(lost),
        took.as_millis(),
        names.len(),
        u8::from(names.iter().any(|n| n == "btl-liveness")),
    );
    let dir = PathBuf::from(std::env::var_os("BTL_TEST_OUT").unwrap());
    std::fs::write(out_file(&dir), text).unwrap();
}

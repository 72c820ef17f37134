//! Address exchange between ranks running as tasks of one process, over
//! real loopback sockets and a real directory.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_btl::bootstrap::{
    all_gather, Host, JobInfo, JobKey, RendezvousServer, RendezvousSpec, ServerStats,
};
use async_btl::Error;

const T: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(500);

fn job(rank: u32, size: u32, spec: &RendezvousSpec, key: &JobKey) -> JobInfo {
    JobInfo::builder(rank, size)
        .rendezvous(spec.clone())
        .job_key(key.clone())
        .job_id("test")
        .build()
        .expect("valid job")
}

fn blob(rank: u32, round: u32) -> Vec<u8> {
    format!("rank {rank} round {round}").into_bytes()
}

/// Run `ranks` of a `size`-rank job as tasks, `rounds` exchanges each.
async fn run_ranks(
    ranks: &[u32],
    size: u32,
    spec: &RendezvousSpec,
    key: &JobKey,
    rounds: u32,
    timeout: Duration,
) -> Vec<async_btl::Result<Vec<Vec<u8>>>> {
    let tasks: Vec<_> = ranks
        .iter()
        .map(|&r| {
            let j = job(r, size, spec, key);
            tokio::spawn(async move {
                let mut last = Vec::new();
                for round in 0..rounds {
                    last = all_gather(&j, blob(r, round), timeout).await?;
                    let want: Vec<_> = (0..size).map(|p| blob(p, round)).collect();
                    assert_eq!(last, want, "rank {r} round {round}");
                }
                Ok(last)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("rank task panicked"));
    }
    out
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn temp_dir() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("async-btl-test-{}-{n}", std::process::id()))
}

#[tokio::test]
async fn four_ranks_over_tcp_served_by_rank0() {
    let spec = RendezvousSpec::Tcp {
        addr: format!("127.0.0.1:{}", free_port()),
        hosted_by: Host::Rank0,
    };
    for r in run_ranks(&[0, 1, 2, 3], 4, &spec, &JobKey::random(), 3, T).await {
        r.expect("gathered");
    }
}

#[tokio::test]
async fn four_ranks_over_tcp_served_by_a_launcher() {
    let key = JobKey::random();
    let server = RendezvousServer::bind("127.0.0.1:0", 4, key.clone(), T)
        .await
        .unwrap();
    let stats = server.stats();
    let addr = server.local_addr().unwrap().to_string();
    let serving = tokio::spawn(server.serve());
    let spec = RendezvousSpec::Tcp {
        addr,
        hosted_by: Host::Launcher,
    };
    for r in run_ranks(&[3, 1, 0, 2], 4, &spec, &key, 3, T).await {
        r.expect("gathered");
    }
    assert_eq!(stats.rounds_finished(), 3);
    assert_eq!(stats.refused(), 0);
    serving.abort();
}

#[tokio::test]
async fn four_ranks_over_a_directory_leave_nothing_behind() {
    let dir = temp_dir();
    let spec = RendezvousSpec::Dir(dir.clone());
    for r in run_ranks(&[0, 1, 2, 3], 4, &spec, &JobKey::random(), 3, T).await {
        r.expect("gathered");
    }
    assert!(!dir.exists(), "{} should be removed", dir.display());
}

#[tokio::test]
async fn wrong_key_is_refused_and_counted() {
    let key = JobKey::random();
    let server = RendezvousServer::bind("127.0.0.1:0", 2, key.clone(), T)
        .await
        .unwrap();
    let stats = server.stats();
    let spec = RendezvousSpec::Tcp {
        addr: server.local_addr().unwrap().to_string(),
        hosted_by: Host::Launcher,
    };
    let serving = tokio::spawn(server.serve());
    let intruder = job(1, 2, &spec, &JobKey::random());
    let err = all_gather(&intruder, b"x".to_vec(), T).await.unwrap_err();
    assert!(
        matches!(&err, Error::Bootstrap(m) if m.contains("refused") && m.contains("job key")),
        "{err}"
    );
    assert_eq!((stats.refused(), stats.bad_key()), (1, 1));
    // The right ranks still get through afterwards.
    for r in run_ranks(&[0, 1], 2, &spec, &key, 1, T).await {
        r.expect("gathered");
    }
    serving.abort();
}

#[tokio::test]
async fn missing_rank_is_named_over_tcp() {
    let spec = RendezvousSpec::Tcp {
        addr: format!("127.0.0.1:{}", free_port()),
        hosted_by: Host::Rank0,
    };
    for r in run_ranks(&[0, 1, 3], 4, &spec, &JobKey::random(), 1, SHORT).await {
        let err = r.unwrap_err();
        assert!(matches!(&err, Error::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("ranks [2]"), "{err}");
    }
}

#[tokio::test]
async fn missing_rank0_is_named_over_tcp() {
    let spec = RendezvousSpec::Tcp {
        addr: format!("127.0.0.1:{}", free_port()),
        hosted_by: Host::Rank0,
    };
    for r in run_ranks(&[1, 2], 3, &spec, &JobKey::random(), 1, SHORT).await {
        let err = r.unwrap_err();
        assert!(err.to_string().contains("ranks [0]"), "{err}");
    }
}

#[tokio::test]
async fn missing_rank_is_named_in_a_directory() {
    let dir = temp_dir();
    let spec = RendezvousSpec::Dir(dir.clone());
    for r in run_ranks(&[0, 2], 3, &spec, &JobKey::random(), 1, SHORT).await {
        let err = r.unwrap_err();
        assert!(err.to_string().contains("ranks [1]"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn directory_entry_with_another_key_is_rejected() {
    let dir = temp_dir();
    let spec = RendezvousSpec::Dir(dir.clone());
    let key = JobKey::random();
    let results = run_ranks(&[0], 2, &spec, &key, 1, SHORT);
    let other = job(1, 2, &spec, &JobKey::random());
    let (mine, theirs) = tokio::join!(results, all_gather(&other, blob(1, 0), SHORT));
    for err in [
        mine.into_iter().next().unwrap().unwrap_err(),
        theirs.unwrap_err(),
    ] {
        assert!(
            matches!(&err, Error::Bootstrap(m) if m.contains("another job key")),
            "{err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A launcher's server, serving in a task, and its counters.
async fn launcher_server(size: u32, key: &JobKey) -> (RendezvousSpec, ServerStats) {
    let server = RendezvousServer::bind("127.0.0.1:0", size, key.clone(), T)
        .await
        .unwrap();
    let stats = server.stats();
    let spec = RendezvousSpec::Tcp {
        addr: server.local_addr().unwrap().to_string(),
        hosted_by: Host::Launcher,
    };
    tokio::spawn(server.serve());
    (spec, stats)
}

#[tokio::test]
async fn silent_strangers_beyond_the_cap_are_shed_and_ranks_still_join() {
    let key = JobKey::random();
    let (spec, stats) = launcher_server(4, &key).await;
    let RendezvousSpec::Tcp { addr, .. } = &spec else {
        unreachable!()
    };
    // More silent connections than the server lets handshake at once (64).
    let mut silent = Vec::new();
    for _ in 0..100 {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let start = std::time::Instant::now();
    while stats.shed() < 36 {
        assert!(
            start.elapsed() < T,
            "only {} of the 100 shed, {} refused",
            stats.shed(),
            stats.refused()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for r in run_ranks(&[0, 1, 2, 3], 4, &spec, &key, 2, T).await {
        r.expect("gathered");
    }
    assert_eq!(stats.bad_key(), 0);
    assert!(stats.refused() >= stats.shed());
}

#[tokio::test]
async fn a_join_sent_halfway_is_cut_off_at_the_handshake_limit() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (spec, stats) = launcher_server(2, &JobKey::random()).await;
    let RendezvousSpec::Tcp { addr, .. } = &spec else {
        unreachable!()
    };
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The first two bytes of a length prefix, and nothing more.
    slow.write_all(&[8, 0]).await.unwrap();
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(T, slow.read_to_end(&mut sink)).await;
    assert!(
        closed.is_ok(),
        "the server kept a half-sent join open for {T:?}"
    );
    assert_eq!((stats.refused(), stats.timed_out()), (1, 1));
}

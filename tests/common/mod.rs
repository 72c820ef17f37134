//! Test support: run scenarios as real processes. The test binary re-executes
//! itself: the child runs only the `rank_main` test, which reads the scenario
//! from `BTL_TEST_SCENARIO` and the job from the `BTL_*` launcher variables.
#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A job of `n` ranks running `scenario`, rendezvous through a private dir.
pub struct Job {
    pub children: Vec<Child>,
    dir: std::path::PathBuf,
}

pub fn spawn_job(n: u32, scenario: &str, env: &[(&str, &str)]) -> Job {
    spawn_job_wrapped(n, scenario, env, &|_| Vec::new())
}

/// Like [`spawn_job`], each rank's command prefixed by `wrap(rank)` (for
/// example `ip netns exec NS env VAR=...`).
pub fn spawn_job_wrapped(
    n: u32,
    scenario: &str,
    env: &[(&str, &str)],
    wrap: &dyn Fn(u32) -> Vec<String>,
) -> Job {
    let dir = std::env::temp_dir().join(format!("abtl-test-{}-{}", std::process::id(), rand_hex()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = rand_hex() + &rand_hex();
    let exe = std::env::current_exe().unwrap();
    let children = (0..n)
        .map(|r| {
            let prefix = wrap(r);
            let mut c = match prefix.split_first() {
                Some((first, rest)) => {
                    let mut c = Command::new(first);
                    c.args(rest).arg(&exe);
                    c
                }
                None => Command::new(&exe),
            };
            c.args(["rank_main", "--exact", "--nocapture", "--test-threads=1"])
                .env("BTL_TEST_SCENARIO", scenario)
                .env("BTL_RANK", r.to_string())
                .env("BTL_SIZE", n.to_string())
                .env("BTL_LOCAL_RANK", r.to_string())
                .env("BTL_LOCAL_SIZE", n.to_string())
                .env("BTL_JOB_KEY", &key)
                .env("BTL_JOB_ID", format!("test-{scenario}"))
                .env("BTL_RENDEZVOUS", format!("dir:{}", dir.display()))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().expect("spawn rank")
        })
        .collect();
    Job { children, dir }
}

fn rand_hex() -> String {
    let mut b = [0u8; 16];
    rand::fill(&mut b[..]);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Job {
    /// Wait for every rank (watchdog: `limit`), returning outputs in rank order.
    pub fn wait(mut self, limit: Duration) -> Vec<Output> {
        let start = Instant::now();
        loop {
            let done = self
                .children
                .iter_mut()
                .all(|c| matches!(c.try_wait(), Ok(Some(_))));
            if done || start.elapsed() > limit {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let timed_out = start.elapsed() > limit;
        for c in &mut self.children {
            let _ = c.kill();
        }
        let outs: Vec<Output> = std::mem::take(&mut self.children)
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let _ = std::fs::remove_dir_all(&self.dir);
        if timed_out {
            dump(&outs);
            panic!("job did not finish within {limit:?} (watchdog)");
        }
        outs
    }
}

pub fn dump(outs: &[Output]) {
    for (r, o) in outs.iter().enumerate() {
        eprintln!(
            "--- rank {r}: {:?}\n{}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// Assert every rank exited 0.
pub fn assert_ok(outs: &[Output]) {
    if outs.iter().any(|o| !o.status.success()) {
        dump(outs);
        panic!("a rank failed");
    }
}

/// Lines a rank printed that start with `key=`.
pub fn value(out: &Output, key: &str) -> Option<String> {
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        l.split_once(&format!("{key}="))
            .map(|(_, v)| v.trim().to_string())
    })
}

/// Our abtl files in /dev/shm.
pub fn shm_files_of(pids: &[u32]) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| pids.iter().any(|p| n.starts_with(&format!("abtl.{p}."))))
                .collect()
        })
        .unwrap_or_default()
}

/// Resident set size of this process in KiB.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

pub fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// The bytes every scenario sends: a function of length and seed, so the
/// receiver can check content without being told it.
pub fn pattern(len: usize, seed: u64) -> bytes::Bytes {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2654435761).wrapping_add(seed) >> 7) as u8)
        .collect::<Vec<_>>()
        .into()
}

/// Rank 0 sends `n` small messages alternating between tags 10 and 11;
/// rank 1 checks that each tag's messages arrive in send order.
pub async fn order_check(f: &async_btl::Fabric, n: u64) {
    use futures::StreamExt;
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        for i in 0..n {
            ep.send_inline(10 + i % 2, &i.to_le_bytes()).await.unwrap();
        }
    } else {
        let (mut a, mut b) = (f.receiver(10).unwrap(), f.receiver(11).unwrap());
        let (mut na, mut nb) = (0u64, 1u64);
        let value = |m: Option<async_btl::Result<async_btl::Message>>| {
            u64::from_le_bytes(m.unwrap().unwrap().data[..].try_into().unwrap())
        };
        while na < n || nb < n {
            tokio::select! {
                m = a.next(), if na < n => {
                    assert_eq!(value(m), na, "tag 10 out of order");
                    na += 2;
                }
                m = b.next(), if nb < n => {
                    assert_eq!(value(m), nb, "tag 11 out of order");
                    nb += 2;
                }
            }
        }
    }
}

/// Every rank sends `k` messages of `len(i)` bytes to every rank (itself
/// included) at once, and checks content and per-sender order.
pub async fn all_to_all_check(f: &async_btl::Fabric, k: u64, len: fn(u64) -> usize) {
    let (me, n) = (f.rank(), f.size());
    let mut rx = f.receiver(1).unwrap();
    let eps: Vec<_> = (0..n).map(|r| f.endpoint(r).unwrap()).collect();
    let send = async {
        for i in 0..k {
            for ep in &eps {
                let data = pattern(len(i), (u64::from(me) << 32) | i);
                ep.send(1, data).await.unwrap();
            }
        }
    };
    let recv = async {
        let mut next = vec![0u64; n as usize];
        for _ in 0..k * u64::from(n) {
            let m = rx.recv().await.unwrap();
            let i = next[m.src as usize];
            let want = pattern(len(i), (u64::from(m.src) << 32) | i);
            assert_eq!(m.data, want, "message {i} from {}", m.src);
            next[m.src as usize] += 1;
        }
        assert!(next.iter().all(|c| *c == k));
    };
    futures::join!(send, recv);
}

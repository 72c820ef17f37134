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
    size: u32,
    scenario: String,
    env: Vec<(String, String)>,
    key: String,
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
    let mut job = prepare_job(n, scenario, env);
    for r in 0..n {
        job.start_wrapped(r, &wrap(r));
    }
    job
}

/// A job of `n` ranks with none started yet: start them one at a time with
/// [`Job::start`] (in rank order, so that [`Job::wait`] returns the outputs
/// by rank). `env` comes after the launcher variables, so it can replace
/// them; an empty value unsets one for the library (`("BTL_JOB_KEY", "")`).
pub fn prepare_job(n: u32, scenario: &str, env: &[(&str, &str)]) -> Job {
    let dir = std::env::temp_dir().join(format!("abtl-test-{}-{}", std::process::id(), rand_hex()));
    std::fs::create_dir_all(&dir).unwrap();
    Job {
        children: Vec::new(),
        dir,
        size: n,
        scenario: scenario.to_string(),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        key: rand_hex() + &rand_hex(),
    }
}

fn rand_hex() -> String {
    let mut b = [0u8; 16];
    rand::fill(&mut b[..]);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Job {
    /// Start `rank` (this binary, re-executed, running `rank_main`).
    pub fn start(&mut self, rank: u32) {
        self.start_wrapped(rank, &[]);
    }

    fn start_wrapped(&mut self, r: u32, prefix: &[String]) {
        let exe = std::env::current_exe().unwrap();
        let mut c = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let n = self.size;
        c.args(["rank_main", "--exact", "--nocapture", "--test-threads=1"])
            .env("BTL_TEST_SCENARIO", &self.scenario)
            .env("BTL_RANK", r.to_string())
            .env("BTL_SIZE", n.to_string())
            .env("BTL_LOCAL_RANK", r.to_string())
            .env("BTL_LOCAL_SIZE", n.to_string())
            .env("BTL_JOB_KEY", &self.key)
            .env("BTL_JOB_ID", format!("test-{}", self.scenario))
            .env("BTL_RENDEZVOUS", format!("dir:{}", self.dir.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &self.env {
            c.env(k, v);
        }
        self.children.push(c.spawn().expect("spawn rank"));
    }

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

/// A current-thread runtime, for a rank whose one thread must truly stop
/// (a blocking loop starves its tasks), or stay the process's only one.
pub fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Poll `rx.try_recv()` in a loop that never yields (the progress tasks
/// of a current-thread runtime never run) until it fails: whether it
/// failed with `PeerLost` (`false` after 15 s without), and when.
pub fn spin_until_lost(rx: &mut async_btl::Receiver) -> (bool, Duration) {
    let start = Instant::now();
    let lost = loop {
        match rx.try_recv() {
            Ok(Some(m)) => panic!("unexpected message {m:?}"),
            Ok(None) => {}
            Err(e) => break e.is_peer_lost(),
        }
        if start.elapsed() > Duration::from_secs(15) {
            break false;
        }
        std::hint::spin_loop();
    };
    (lost, start.elapsed())
}

/// The names of this process's threads.
pub fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .map(|t| {
            let comm = t.unwrap().path().join("comm");
            std::fs::read_to_string(comm).unwrap().trim().to_string()
        })
        .collect()
}

/// The runtime a rank of a test job runs its scenario on: multi-thread,
/// two workers, I/O and timers on.
pub fn rank_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
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

/// CPU time this process used so far (user + system), from getrusage.
pub fn cpu_time() -> std::time::Duration {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| {
        std::time::Duration::from_secs(t.tv_sec as u64)
            + std::time::Duration::from_micros(t.tv_usec as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
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

/// Send one [`pattern`] message per size on `tag` (seeded by its index),
/// then each of `inline` through the inline path on `tag + 1` (seed 99).
pub async fn send_sizes(ep: &async_btl::Endpoint, tag: u64, sizes: &[usize], inline: &[usize]) {
    for (i, s) in sizes.iter().enumerate() {
        ep.send(tag, pattern(*s, i as u64)).await.unwrap();
    }
    for s in inline {
        ep.send_inline(tag + 1, &pattern(*s, 99)).await.unwrap();
    }
}

/// Take the next message on `rx` into `kept` (`recv_into`, with `lend`)
/// or as a message of its own (`recv`), and check that it came from
/// `src` with the bytes `want`; `what` names it in a failure.
pub async fn recv_checked(
    rx: &mut async_btl::Receiver,
    kept: &mut Vec<u8>,
    lend: bool,
    src: async_btl::Rank,
    want: &[u8],
    what: &str,
) {
    if lend {
        assert_eq!(rx.recv_into(kept).await.unwrap(), src, "{what}: sender");
        assert!(kept[..] == want[..], "{what} lent: wrong bytes");
    } else {
        let m = rx.recv().await.unwrap();
        assert_eq!(m.src, src, "{what}: sender");
        assert!(m.data[..] == want[..], "{what}: wrong bytes");
    }
}

/// Receive what [`send_sizes`] sent from `src`, checking every length and
/// every byte, in order.
pub async fn expect_sizes(
    f: &async_btl::Fabric,
    src: async_btl::Rank,
    tag: u64,
    sizes: &[usize],
    inline: &[usize],
) {
    let mut rx = f.receiver(tag).unwrap();
    for (i, s) in sizes.iter().enumerate() {
        let m = rx.recv().await.unwrap();
        assert_eq!((m.src, m.data.len()), (src, *s));
        assert!(
            m.data == pattern(*s, i as u64),
            "content mismatch at size {s}"
        );
    }
    let mut rx = f.receiver(tag + 1).unwrap();
    for s in inline {
        let m = rx.recv().await.unwrap();
        assert!(
            m.data == pattern(*s, 99),
            "inline content mismatch at size {s}"
        );
    }
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

/// Rank 1 sleeps `sleep` before reading `msgs` messages of 1 MiB that rank 0
/// sends meanwhile; rank 0 prints its RSS before and at its peak.
pub async fn stall_scenario(f: &async_btl::Fabric, msgs: usize, sleep: std::time::Duration) {
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        let msg = pattern(1 << 20, 5);
        let before = rss_kib();
        let mut peak = before;
        for i in 0..msgs {
            ep.send(1, msg.clone()).await.unwrap();
            if i % 10 == 0 {
                peak = peak.max(rss_kib());
            }
        }
        println!("rss_before_kib={before}");
        println!("rss_peak_kib={peak}");
    } else {
        tokio::time::sleep(sleep).await;
        let mut rx = f.receiver(1).unwrap();
        for _ in 0..msgs {
            let m = rx.recv().await.unwrap();
            assert_eq!(m.data, pattern(1 << 20, 5));
        }
    }
}

/// The parent side of [`kill_scenario`]: wait until rank 0 says its
/// futures are pending (`armed_ms=`), SIGKILL rank 1, and return how many
/// milliseconds rank 0 took to see every future fail (`failed_ms=` less
/// the kill), with rank 1's pid. Panics (with rank 0's output) if rank 0
/// never blocks or fails.
pub fn kill_rank1_when_armed(mut job: Job) -> (u128, u32) {
    use std::io::{BufRead, BufReader};
    let start = Instant::now();
    let mut out0 = String::new();
    let stdout = job.children[0].stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    while let Some(Ok(l)) = lines.next() {
        out0.push_str(&l);
        out0.push('\n');
        if l.contains("armed_ms=") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "rank 0 never blocked"
        );
    }
    let victim = job.children[1].id();
    std::thread::sleep(Duration::from_millis(100));
    let killed_at = now_ms();
    job.children[1].kill().unwrap();
    let _ = job.children[1].wait();
    for l in lines.map_while(Result::ok) {
        out0.push_str(&l);
        out0.push('\n');
    }
    let outs = job.wait(Duration::from_secs(30));
    if !outs[0].status.success() {
        eprintln!("{out0}");
        dump(&outs);
        panic!("rank 0 failed");
    }
    let failed: u128 = out0
        .lines()
        .find_map(|l| l.split_once("failed_ms=").map(|x| x.1))
        .unwrap()
        .parse()
        .unwrap();
    (failed - killed_at, victim)
}

/// Rank 1 opens a tag it never reads and waits to be killed by the parent;
/// rank 0 fills that queue until sends block, prints `armed_ms`, and then
/// checks that every pending future fails with `PeerLost` once rank 1 is
/// killed. `control_free`: control traffic (a get) is answered while the
/// user queue is full (sm); otherwise the get is left pending and must fail
/// with the rest.
pub async fn kill_scenario(f: async_btl::Fabric, control_free: bool) {
    use async_btl::RemoteKey;
    use std::time::Duration;
    if f.rank() == 1 {
        // Open the tag so messages queue here but never consume them, then
        // wait to be killed.
        let _rx = f.receiver(1).unwrap();
        let region = f.register(vec![0u8; 4096]);
        f.endpoint(0)
            .unwrap()
            .send(2, region.remote_key().to_bytes())
            .await
            .unwrap();
        println!("ready");
        tokio::time::sleep(Duration::from_secs(60)).await;
        return;
    }
    let mut keys = f.receiver(2).unwrap();
    let key = RemoteKey::from_bytes(&keys.recv().await.unwrap().data).unwrap();
    let ep = f.endpoint(1).unwrap();
    let mut rx = f.receiver(3).unwrap();
    // Fill rank 1's queue (its tag budget) until sends block.
    let big = pattern(1 << 20, 1);
    let sends: Vec<_> = (0..64)
        .map(|_| tokio::spawn(ep.send(1, big.clone())))
        .collect();
    // Let everything that can complete do so; the rest is stuck behind the
    // full queue at rank 1.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (done, pending): (Vec<_>, Vec<_>) = sends.into_iter().partition(|s| s.is_finished());
    for d in done {
        d.await.unwrap().unwrap();
    }
    assert!(!pending.is_empty(), "sends never blocked");
    let local = f.register(vec![0u8; 64]);
    let get = if control_free {
        // Control traffic is not stuck behind the full queue: a get is answered.
        tokio::time::timeout(Duration::from_secs(5), ep.get(&local, 0..64, &key, 0))
            .await
            .expect("get answered while the user queue is full")
            .unwrap();
        None
    } else {
        Some(tokio::spawn(ep.get(&local, 0..64, &key, 0)))
    };
    // An implicit put and the flush that waits for it: it fails with the
    // rest (or, where control traffic is still answered, may be done).
    ep.put_nbi(&local, 0..64, &key, 0).unwrap();
    let flush = tokio::spawn(ep.flush());
    println!("blocked={}", pending.len());
    println!("armed_ms={}", now_ms());
    // The parent kills rank 1 now. Every pending future must fail, and
    // every failure, then and later, carries the cause of the loss.
    let mut cause = None;
    for p in pending {
        let e = p.await.unwrap().unwrap_err();
        assert!(e.is_peer_lost(), "send: {e}");
        cause.get_or_insert_with(|| e.to_string());
    }
    let cause = cause.unwrap();
    let same_cause = |e: async_btl::Error, what: &str| {
        assert!(e.is_peer_lost(), "{what}: {e}");
        assert_eq!(e.to_string(), cause, "{what} names another cause");
    };
    if let Some(get) = get {
        let e = get.await.unwrap().unwrap_err();
        assert!(e.is_peer_lost(), "get: {e}");
    }
    let e = rx.recv().await.unwrap_err();
    assert!(e.is_peer_lost(), "receiver: {e}");
    match flush.await.unwrap() {
        Ok(()) => assert!(control_free, "a flush over a stuck put succeeded"),
        Err(e) => assert!(e.is_peer_lost(), "flush: {e}"),
    }
    println!("failed_ms={}", now_ms());
    same_cause(
        ep.send(1, bytes::Bytes::new()).await.unwrap_err(),
        "send after the loss",
    );
    same_cause(ep.flush().await.unwrap_err(), "flush after the loss");
    same_cause(
        ep.put_nbi(&local, 0..64, &key, 0).unwrap_err(),
        "put_nbi after the loss",
    );
    same_cause(f.barrier().await.unwrap_err(), "barrier after the loss");
    same_cause(
        ep.get(&local, 0..64, &key, 0).await.unwrap_err(),
        "get after the loss",
    );
    drop(f);
}

/// Forged keys reach nothing: one claiming a huge length (put just inside
/// it, past the real region of `len` bytes) and one with a changed id (get)
/// are both refused by the target with `Error::Access`.
pub async fn assert_forged_keys_refused(
    ep: &async_btl::Endpoint,
    src: &async_btl::MemoryRegion,
    back: &async_btl::MemoryRegion,
    key: &async_btl::RemoteKey,
    len: u64,
) {
    use async_btl::{Error, RemoteKey};
    let mut big = key.to_bytes();
    // postcard varint of owner (1 byte) + 16 id bytes, then the length varint.
    big.truncate(17);
    big.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f, 0x00]);
    let forged = RemoteKey::from_bytes(&big).unwrap();
    let e = ep.put(src, 0..64, &forged, len - 32).await.unwrap_err();
    assert!(matches!(e, Error::Access(_)), "forged length: {e}");
    let mut bad = key.to_bytes();
    bad[5] ^= 0x55;
    let forged = RemoteKey::from_bytes(&bad).unwrap();
    let e = ep.get(back, 0..64, &forged, 0).await.unwrap_err();
    assert!(matches!(e, Error::Access(_)), "forged id: {e}");
}

/// How many puts [`assert_implicit_ops`] starts in its burst.
pub const IMPLICIT_PUTS: usize = 200;

/// `put_nbi`/`get_nbi` against the peer's region `key`, from `base` on (at
/// most 22 KiB of it): a burst of puts of 1–200 bytes at consecutive
/// offsets and one `flush`, then the same bytes read back by a burst of
/// gets and a `flush`, content-checked. A key with a forged id (which
/// names no region of the target) is refused at once or by the next flush,
/// and only that flush reports it. A local range outside the region fails
/// at once.
pub async fn assert_implicit_ops(
    f: &async_btl::Fabric,
    ep: &async_btl::Endpoint,
    key: &async_btl::RemoteKey,
    base: u64,
) {
    use async_btl::{Error, RemoteKey};
    let lens: Vec<usize> = (0..IMPLICIT_PUTS).map(|i| 1 + (i * 37) % 200).collect();
    let total: usize = lens.iter().sum();
    let data = pattern(total, 42);
    let src = f.register(data.to_vec());
    let mut off = 0;
    for n in &lens {
        ep.put_nbi(&src, off..off + n, key, base + off as u64)
            .expect("put_nbi");
        off += n;
    }
    ep.flush().await.expect("flush after implicit puts");
    let back = f.register(vec![0u8; total]);
    for (i, chunk) in (0..total).step_by(1000).enumerate() {
        let end = (chunk + 1000).min(total);
        ep.get_nbi(&back, chunk..end, key, base + chunk as u64)
            .unwrap_or_else(|e| panic!("get_nbi {i}: {e}"));
    }
    ep.flush().await.expect("flush after implicit gets");
    assert!(back.to_vec() == data.to_vec(), "implicit puts and gets");
    // Forged id: refused now (a mapped region cannot be opened) or by the
    // flush; reported once.
    let mut bad = key.to_bytes();
    bad[5] ^= 0x55;
    let forged = RemoteKey::from_bytes(&bad).unwrap();
    for put in [true, false] {
        let r = if put {
            ep.put_nbi(&src, 0..64, &forged, 0)
        } else {
            ep.get_nbi(&back, 0..64, &forged, 0)
        };
        let e = match r {
            Err(e) => e,
            Ok(()) => ep.flush().await.expect_err("flush reports the refusal"),
        };
        assert!(matches!(e, Error::Access(_)), "forged implicit op: {e}");
        ep.flush().await.expect("a refusal is reported once");
    }
    let e = ep.put_nbi(&src, 0..total + 1, key, base).unwrap_err();
    assert!(matches!(e, Error::Misuse(_)), "local range: {e}");
}

/// Remote atomics among all ranks on rank 0's region (`BTL_TEST_REGION`
/// `heap`: a registered buffer, emulated at the target; else a
/// fabric-allocated region, native where the transport maps it):
/// - every rank adds 1 to word 0 `adds` times with `fetch_add` (each rank's
///   results strictly rising), and `adds` times with `atomic_add_nbi` to
///   word 3 before one `flush`;
/// - a `compare_swap` spin lock on word 1 guards a non-atomic read-modify-
///   write of word 2 (a `get`, then a `put`), `locked` times per rank;
/// - misaligned, out-of-range and forged-key atomics fail with
///   `Error::Access`.
///
/// Rank 0 checks the totals exactly (prints `atomics_ok=1`), and that the
/// refused atomics changed nothing.
pub async fn atomics_scenario(f: async_btl::Fabric, adds: u64, locked: u64) {
    use async_btl::{Error, RemoteKey};
    let (me, n) = (f.rank(), u64::from(f.size()));
    let heap = std::env::var("BTL_TEST_REGION").as_deref() == Ok("heap");
    let region = (me == 0).then(|| {
        if heap {
            f.register(vec![0u8; 4096])
        } else {
            f.alloc_region(4096).unwrap()
        }
    });
    if let Some(r) = &region {
        let key = r.remote_key().to_bytes();
        for p in 1..f.size() {
            f.endpoint(p).unwrap().send(9, key.clone()).await.unwrap();
        }
    }
    let key = match &region {
        Some(r) => r.remote_key(),
        None => {
            let mut rx = f.receiver(9).unwrap();
            RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap()
        }
    };
    let ep = f.endpoint(0).unwrap();
    f.barrier().await.unwrap();

    let mut last = None;
    for _ in 0..adds {
        let old = ep.fetch_add(&key, 0, 1).await.unwrap();
        assert!(last.map_or(true, |l| old > l), "fetch_add results rise");
        last = Some(old);
        ep.atomic_add_nbi(&key, 24, 1).unwrap();
    }
    ep.flush().await.unwrap();

    let word = f.register(vec![0u8; 8]);
    for _ in 0..locked {
        while ep
            .compare_swap(&key, 8, 0, u64::from(me) + 1)
            .await
            .unwrap()
            != 0
        {
            tokio::task::yield_now().await;
        }
        ep.get(&word, 0..8, &key, 16).await.unwrap();
        let mut v = [0u8; 8];
        word.read(0, &mut v).unwrap();
        word.write(0, &(u64::from_le_bytes(v) + 1).to_le_bytes())
            .unwrap();
        ep.put(&word, 0..8, &key, 16).await.unwrap();
        let held = ep.swap(&key, 8, 0).await.unwrap();
        assert_eq!(held, u64::from(me) + 1, "the lock was ours while held");
    }

    // Refused: nothing may change (checked by rank 0 below).
    let access = |r: Result<u64, Error>, what: &str| match r {
        Err(Error::Access(_)) => {}
        other => panic!("{what}: expected Error::Access, got {other:?}"),
    };
    access(ep.fetch_add(&key, 4, 1).await, "misaligned fetch_add");
    access(ep.compare_swap(&key, 4089, 0, 1).await, "misaligned cas");
    access(ep.swap(&key, 4096, 1).await, "swap past the end");
    access(ep.fetch_add(&key, u64::MAX - 7, 1).await, "offset overflow");
    let e = ep.atomic_add_nbi(&key, 12, 1).unwrap_err();
    assert!(matches!(e, Error::Access(_)), "misaligned nbi: {e}");
    let mut bad = key.to_bytes();
    bad[5] ^= 0x55;
    let forged = RemoteKey::from_bytes(&bad).unwrap();
    access(ep.fetch_add(&forged, 0, 1000).await, "forged key");
    access(ep.compare_swap(&forged, 8, 0, 77).await, "forged key cas");
    match ep.atomic_add_nbi(&forged, 0, 1000) {
        Err(e) => assert!(matches!(e, Error::Access(_)), "forged nbi: {e}"),
        Ok(()) => {
            let e = ep.flush().await.expect_err("flush reports the refused add");
            assert!(matches!(e, Error::Access(_)), "forged nbi: {e}");
        }
    }
    ep.flush().await.unwrap();
    let s = f.stats();
    println!(
        "native_atomics={}\nemulated_atomics={}",
        s.native_atomics, s.emulated_atomics
    );
    f.barrier().await.unwrap();

    if let Some(r) = &region {
        let w = |i: usize| {
            let mut v = [0u8; 8];
            r.read(i * 8, &mut v).unwrap();
            u64::from_le_bytes(v)
        };
        assert_eq!(w(0), n * adds, "fetch_add total");
        assert_eq!(w(1), 0, "lock free at the end");
        assert_eq!(w(2), n * locked, "lock-protected counter");
        assert_eq!(w(3), n * adds, "atomic_add_nbi total");
        let rest = r.to_vec();
        assert!(
            rest[32..].iter().all(|b| *b == 0),
            "refused atomics wrote nothing"
        );
        println!("atomics_ok=1");
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Why these tests cannot run here, if they cannot.
pub fn no_rdma() -> Option<String> {
    if !cfg!(feature = "rdma") {
        return Some("built without the `rdma` feature (cargo test --features rdma)".into());
    }
    let out = std::process::Command::new("fi_info")
        .args(["-p", "tcp;ofi_rxm", "-t", "FI_EP_RDM", "-n", "127.0.0.1"])
        .output();
    match out {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "libfabric offers no tcp;ofi_rxm on 127.0.0.1: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("fi_info (libfabric-bin) cannot run: {e}")),
    }
}

/// Rank 0 computes for two and a half peer timeouts without yielding (its
/// one runtime thread blocked, the progress task starved), then sends:
/// neither rank may take the other for dead meanwhile.
pub async fn compute_scenario(f: async_btl::Fabric) {
    f.barrier().await.unwrap();
    if f.rank() == 0 {
        std::thread::sleep(std::time::Duration::from_millis(2500));
        let ep = f.endpoint(1).unwrap();
        ep.send(1, pattern(64, 3)).await.unwrap();
    } else {
        let mut rx = f.receiver(1).unwrap();
        assert_eq!(rx.recv().await.unwrap().data, pattern(64, 3));
    }
    f.barrier().await.unwrap();
    println!("peers_lost={}", f.stats().peers_lost);
    f.close().await.unwrap();
}

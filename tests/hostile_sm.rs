//! A neighbour of the same user (or root) damages a rank's shared memory
//! while the job runs: it opens every shared-memory object of rank 1 — its
//! `abtl.*` files in the shared-memory directory and the memory files it
//! holds open (`/proc/<pid>/fd/*` links to `/memfd:...`) — and truncates
//! each to zero bytes, mid-stream. No rank may die by a signal (a mapping
//! cut short under a process raises SIGBUS on its next touch): the job's
//! messages and one-sided operations stay correct, or the survivor reports
//! `PeerLost`. Either way no file is left in `/dev/shm`.
//!
//! Ranks are real processes (this binary, re-executed) over real shared
//! memory; the damage is done by this test process with `ftruncate`.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_btl::{Fabric, RemoteKey};
use common::*;

/// Watchdog for one job; never a speed assertion.
const WATCHDOG: Duration = Duration::from_secs(90);
/// Rounds each rank still runs after the damage was done.
const AFTER: u64 = 300;
/// Message sizes, by round: a fast box, one eager fragment, a max
/// fragment, several fragments.
const SIZES: [usize; 4] = [40, 3000, 20_000, 150_000];
/// Bytes of each rank's shared region.
const REGION: usize = 1 << 20;

/// The child side: runs the scenario named in BTL_TEST_SCENARIO.
#[test]
fn rank_main() {
    let Ok(scenario) = std::env::var("BTL_TEST_SCENARIO") else {
        return; // the parent test process: nothing to do here
    };
    assert_eq!(scenario, "truncated", "unknown scenario");
    let rt = rank_runtime();
    rt.block_on(async {
        let f = Fabric::from_env().await.expect("fabric from launcher env");
        let sync = PathBuf::from(std::env::var("BTL_TEST_SYNC").unwrap());
        match stream(&f, &sync).await {
            Ok(rounds) => {
                println!("done rounds={rounds}");
                f.close().await.unwrap();
            }
            Err(e) if e.is_peer_lost() => println!("peer_lost={e}"),
            Err(e) => panic!("rank {} failed with other than PeerLost: {e}", f.rank()),
        }
    });
}

/// Round trips between rank 0 and rank 1 until the parent says it did
/// its damage (file `go` in `sync`), then `AFTER` more: each round rank 0
/// sends a message that rank 1 checks and sends back, and each rank puts
/// into the other's shared region, gets it back and reads its own region.
/// Both ranks then meet in a barrier (so that neither drops its region
/// while the other may still use it). Returns the rounds run; any error
/// is returned for the caller to judge.
async fn stream(f: &Fabric, sync: &Path) -> async_btl::Result<u64> {
    let me = f.rank();
    let peer = 1 - me;
    let ep = f.endpoint(peer)?;
    let mut keys = f.receiver(9)?;
    let mut rx = f.receiver(1)?;
    let mut ctl = f.receiver(2)?;
    let mine = f.alloc_region(REGION)?;
    ep.send(9, mine.remote_key().to_bytes()).await?;
    let theirs = RemoteKey::from_bytes(&keys.recv().await?.data).unwrap();
    let mut round = 0u64;
    let mut last = None;
    loop {
        let size = SIZES[(round % SIZES.len() as u64) as usize];
        let msg = pattern(size, round);
        if me == 0 {
            ep.send(1, msg.clone()).await?;
            let back = rx.recv().await?;
            assert!(back.data == msg, "round {round}: echo differs");
        } else {
            let m = rx.recv().await?;
            assert!(m.data == msg, "round {round}: message differs");
            ep.send(1, m.data).await?;
        }
        // One-sided: into the peer's region, back, and our own region.
        let off = (round as usize * 4096) % (REGION - 8192);
        let src = f.register(pattern(4096, round + 7).to_vec());
        ep.put(&src, 0..4096, &theirs, off as u64).await?;
        let back = f.register(vec![0u8; 4096]);
        ep.get(&back, 0..4096, &theirs, off as u64).await?;
        assert!(back.to_vec() == src.to_vec(), "round {round}: get differs");
        let mut local = [0u8; 64];
        mine.read(off, &mut local).unwrap();
        round += 1;
        if round == 50 {
            std::fs::write(sync.join(format!("streaming.{me}")), b"").unwrap();
        }
        if me == 0 {
            // Rank 0 decides when to stop and tells rank 1 each round.
            if last.is_none() && sync.join("go").exists() {
                last = Some(round + AFTER);
            }
            let stop = last.is_some_and(|l| round >= l);
            ep.send(2, vec![u8::from(stop)]).await?;
            if stop {
                break;
            }
        } else if ctl.recv().await?.data[..] == [1] {
            break;
        }
    }
    f.barrier().await?;
    drop(mine);
    Ok(round)
}

/// Every shared-memory object of process `pid` that this user can open:
/// its `abtl.<pid>.*` files in /dev/shm and the memory files it holds open.
fn shared_objects_of(pid: u32) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = shm_files_of(&[pid])
        .into_iter()
        .map(|n| Path::new("/dev/shm").join(n))
        .collect();
    let fds = PathBuf::from(format!("/proc/{pid}/fd"));
    for e in std::fs::read_dir(&fds).into_iter().flatten().flatten() {
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        if link.to_string_lossy().starts_with("/memfd:") {
            found.push(e.path());
        }
    }
    found
}

/// Open `path` read-write and truncate it to nothing; whether it worked.
fn truncate(path: &Path) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    f.set_len(0)
}

#[test]
fn truncating_a_ranks_shared_memory_mid_stream_raises_no_signal() {
    let sync = std::env::temp_dir().join(format!(
        "abtl-hostile-sm-{}-{}",
        std::process::id(),
        now_ms()
    ));
    std::fs::create_dir_all(&sync).unwrap();
    let sync_env = sync.to_string_lossy().into_owned();
    let job = spawn_job(
        2,
        "truncated",
        &[
            ("BTL_TEST_SYNC", &sync_env),
            ("BTL_TRANSPORTS", "sm,self"),
            ("RUST_LOG", "async_btl=warn"),
        ],
    );
    let pids: Vec<u32> = job.children.iter().map(|c| c.id()).collect();
    let start = Instant::now();
    while !(0..2).all(|r| sync.join(format!("streaming.{r}")).exists()) {
        assert!(
            start.elapsed() < WATCHDOG,
            "the ranks never started streaming"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let objects = shared_objects_of(pids[1]);
    let mut truncated = 0;
    for o in &objects {
        match truncate(o) {
            Ok(()) => truncated += 1,
            Err(e) => eprintln!("truncating {} was refused: {e}", o.display()),
        }
    }
    eprintln!(
        "rank 1 (pid {}): {} shared-memory objects, {truncated} truncated",
        pids[1],
        objects.len()
    );
    std::fs::write(sync.join("go"), b"").unwrap();
    let outs = job.wait(WATCHDOG);
    let _ = std::fs::remove_dir_all(&sync);
    // Not vacuous: rank 1's segment and region were found and attacked.
    assert!(
        objects.len() >= 2,
        "found only {objects:?} of rank 1's shared memory"
    );
    for (r, o) in outs.iter().enumerate() {
        if let Some(sig) = o.status.signal() {
            dump(&outs);
            panic!("rank {r} was killed by signal {sig} after its shared memory was truncated");
        }
    }
    assert_ok(&outs);
    for (r, o) in outs.iter().enumerate() {
        let done = value(o, "done rounds").is_some();
        let lost = value(o, "peer_lost").is_some();
        assert!(
            done || lost,
            "rank {r} neither finished nor reported PeerLost"
        );
    }
    assert_eq!(
        shm_files_of(&pids),
        Vec::<String>::new(),
        "shared-memory files left behind"
    );
}

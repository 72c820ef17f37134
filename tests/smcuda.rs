//! The `smcuda` transport between real processes on the GPU test double
//! (`BTL_SMCUDA_GPU=test-double`: device memory is shared host memory, so
//! handles cross processes; copies complete later on worker threads),
//! beside `sm` for the messages. Each test re-executes this binary as the
//! ranks.

mod common;

use std::time::Duration;

use async_btl::{Error, Fabric, MemoryKind, RemoteKey};
use common::*;

/// `BTL_SMCUDA_TEST_GPU=cuda`: the test
/// `on_a_real_gpu_device_memory_goes_by_each_ipc_kind_and_through_the_host`
/// runs its scenarios on the CUDA driver (`scripts/gpu-check.sh` sets it on
/// a machine with a GPU; `test-double` runs them on the double); unset,
/// that test skips and says why.
fn gpu_under_test() -> Option<String> {
    std::env::var("BTL_SMCUDA_TEST_GPU")
        .ok()
        .filter(|v| !v.is_empty())
}

/// A job of `scenario` on the GPU under test, with `BTL_SMCUDA_IPC=ipc`.
fn gpu_job(gpu: &str, scenario: &str, ipc: &str, extra: &[(&str, &str)]) -> Job {
    let mut env = vec![
        ("BTL_SMCUDA_GPU", gpu),
        ("BTL_SMCUDA_IPC", ipc),
        ("BTL_SMCUDA_DOUBLE_FAULTS", ""),
    ];
    env.extend_from_slice(extra);
    spawn_job(2, scenario, &env)
}

/// Launch variables of every test: the test double, with copies that
/// complete a little later than they are queued.
fn job(n: u32, scenario: &str, faults: &str) -> Job {
    spawn_job(
        n,
        scenario,
        &[
            ("BTL_SMCUDA_GPU", "test-double"),
            ("BTL_SMCUDA_DOUBLE_FAULTS", faults),
        ],
    )
}

/// The child side: runs the scenario named in BTL_TEST_SCENARIO.
#[test]
fn rank_main() {
    let Ok(scenario) = std::env::var("BTL_TEST_SCENARIO") else {
        return; // the parent test process: nothing to do here
    };
    // Warnings to stderr, where a test reads why IPC was refused.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter("async_btl=warn")
        .try_init();
    rank_runtime().block_on(async {
        let f = Fabric::from_env().await.expect("fabric from launcher env");
        match scenario.as_str() {
            "putget" => putget(f).await,
            "kill" => kill(f).await,
            "parking" => parking(f).await,
            "whole" => whole_and_dropped(f).await,
            "registered" => registered(f).await,
            "unshareable" => unshareable(f).await,
            "lent" => lent(f).await,
            "crossing" => crossing(f).await,
            "lent_close" => lent_close(f).await,
            "lent_kill" => lent_kill(f).await,
            other => panic!("unknown scenario {other}"),
        }
    });
}

/// Each rank's device memory is of a kind no process can share (pool
/// memory, on a real GPU): registering it is refused with the reason, and
/// the fabric's own device regions still go between the ranks.
async fn unshareable(f: Fabric) {
    let peer = 1 - f.rank();
    let ep = f.endpoint(peer).unwrap();
    let own = f.alloc_device_region(0, 4096).unwrap();
    let base = own.device_ptr().unwrap();
    // SAFETY: refused before anything could reach the memory.
    let e = unsafe { f.register_device(base, 4096) }.unwrap_err();
    assert!(matches!(e, Error::Access(_)), "{e:?}");
    assert!(e.to_string().contains("neither"), "{e}");
    let theirs = exchange_keys(&f, &own.remote_key()).await;
    let local = f.register(vec![f.rank() as u8 + 1; 4096]);
    ep.put(&local, 0..4096, &theirs, 0).await.unwrap();
    f.barrier().await.unwrap();
    let mut got = vec![0u8; 4096];
    own.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == peer as u8 + 1), "the peer's put");
    println!("own_put=ok");
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Lengths of the device-memory messages of `lent`, each at its own
/// offset in the sender's region.
const LENT: [(usize, usize); 4] = [(8, 0), (4096, 64), (1 << 20, 1 << 16), (64 << 20, 2 << 20)];

/// Rank 0 sends device memory to rank 1 with `send_region`, between
/// carried messages on the same tag; rank 1 lands each where it chooses.
/// Prints what the sender's futures said, for the parent to check.
async fn lent(f: Fabric) {
    const TAG: u64 = 11;
    let me = f.rank();
    let peer = 1 - me;
    let ep = f.endpoint(peer).unwrap();
    if me == 0 {
        use futures::FutureExt;
        let src = f.alloc_device_region(0, 66 << 20).unwrap();
        // Each lent one between a carried one and an empty one, all in
        // flight at once: they take their places at their first polls.
        let mut sends = Vec::new();
        for (i, &(n, at)) in LENT.iter().enumerate() {
            src.write(at, &pattern(n, i as u64)).unwrap();
            sends.push(ep.send(TAG, format!("carried {i}").into_bytes()).boxed());
            sends.push(ep.send_region(TAG, &src, at..at + n).boxed());
            sends.push(ep.send(TAG, Vec::new()).boxed());
        }
        for s in futures::future::join_all(sends).await {
            s.unwrap();
        }
        // From host memory: carried, whatever the receiver does.
        let host = f.register(pattern(3000, 40).to_vec());
        ep.send_region(TAG, &host, 0..3000).await.unwrap();
        // One the receiver drops unread, one it meets with recv_into, one
        // too large for its first landing region.
        src.write(0, &pattern(512, 41)).unwrap();
        let direct = std::env::var("BTL_SMCUDA_IPC").as_deref() != Ok("off");
        let dropped = ep.send_region(TAG, &src, 0..512).await;
        let into = ep.send_region(TAG, &src, 0..512).await;
        if direct {
            let e = dropped.unwrap_err();
            assert!(
                matches!(&e, Error::Declined { rank: 1, why } if why.contains("dropped")),
                "{e}"
            );
            let e = into.unwrap_err();
            assert!(
                matches!(&e, Error::Declined { why, .. } if why.contains("recv_into")),
                "{e}"
            );
        } else {
            dropped.unwrap();
            into.unwrap();
        }
        ep.send_region(TAG, &src, 0..(2 << 20)).await.unwrap();
        // One whose future and region handle go at once, once announced:
        // the bytes stay alive for the receiver.
        let lone = f.alloc_device_region(0, 1 << 20).unwrap();
        lone.write(0, &pattern(1 << 20, 42)).unwrap();
        let mut lone_send = ep.send_region(TAG, &lone, 0..(1 << 20));
        let first = futures::poll!(&mut lone_send);
        assert!(!direct || first.is_pending());
        drop(lone_send);
        drop(lone);
        println!("lent_sends={}", f.stats().lent_sends);
        println!("staged={}", f.stats().staged_device_ops);
    } else {
        let mut rx = f.receiver(TAG).unwrap();
        let land = f.alloc_device_region(0, 68 << 20).unwrap();
        let direct = std::env::var("BTL_SMCUDA_IPC").as_deref() != Ok("off");
        for (i, &(n, _)) in LENT.iter().enumerate() {
            let m = rx.recv().await.unwrap();
            assert!(!m.is_lent());
            assert_eq!(&m.data[..], format!("carried {i}").as_bytes());
            let m = rx.recv().await.unwrap();
            assert_eq!(m.is_lent(), direct, "message {i}");
            assert_eq!(m.len(), n);
            // Into device memory at an offset of ours.
            assert_eq!(m.fetch_into(&land, 4096).await.unwrap(), n);
            let mut got = vec![0u8; n];
            land.read(4096, &mut got).unwrap();
            assert!(got == pattern(n, i as u64)[..], "lent message {i}");
            // Its empty twin sent behind it, to check the order.
            let m = rx.recv().await.unwrap();
            assert!(m.data.is_empty() && !m.is_lent());
        }
        // Carried from host memory, landed in device memory.
        let (src, n) = rx.recv_region(&land, 0).await.unwrap();
        assert_eq!((src, n), (0, 3000));
        let mut got = vec![0u8; 3000];
        land.read(0, &mut got).unwrap();
        assert!(got == pattern(3000, 40)[..]);
        if direct {
            drop(rx.recv().await.unwrap());
            let mut buf = Vec::new();
            let e = rx.recv_into(&mut buf).await.unwrap_err();
            assert!(e.to_string().contains("recv_into"), "{e}");
        } else {
            // Carried (staged): both land as bytes.
            assert_eq!(rx.recv().await.unwrap().data.len(), 512);
            let mut buf = Vec::new();
            rx.recv_into(&mut buf).await.unwrap();
            assert!(buf == pattern(512, 41)[..]);
        }
        // Too large for a 1 MiB region: left with the receiver.
        let small = f.alloc_device_region(0, 1 << 20).unwrap();
        let e = rx.recv_region(&small, 0).await.unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        assert_eq!(rx.probe().unwrap().map(|p| p.1), Some(2 << 20));
        let (_, n) = rx.recv_region(&land, 0).await.unwrap();
        assert_eq!(n, 2 << 20);
        // The lone one, into host memory this time.
        let host = f.register(vec![0u8; 1 << 20]);
        let m = rx.recv().await.unwrap();
        m.fetch_into(&host, 0).await.unwrap();
        assert!(host.to_vec() == pattern(1 << 20, 42)[..], "the lone send");
        let e = m.fetch_into(&host, 0).await;
        assert!(!direct || e.is_err(), "a lent message is taken once");
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Close with lent messages out. Rank 0 lends to rank 1, drops the
/// future, and closes at once: its close waits until rank 1, which looks
/// only later, has taken the bytes. Then each lends to the other and
/// closes without reading, rank 1's message arriving while rank 0 already
/// closes: each close declines what it holds or receives, so neither
/// waits out the close timeout.
async fn lent_close(f: Fabric) {
    let me = f.rank();
    let ep = f.endpoint(1 - me).unwrap();
    let src = f.alloc_device_region(0, 1 << 16).unwrap();
    src.write(0, &pattern(1 << 16, 9)).unwrap();
    let mut rx = f.receiver(6).unwrap();
    if me == 0 {
        let mut s = ep.send_region(6, &src, 0..(1 << 16));
        assert!(futures::poll!(&mut s).is_pending());
        drop(s);
    } else {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let land = f.alloc_device_region(0, 1 << 16).unwrap();
        let (_, n) = rx.recv_region(&land, 0).await.unwrap();
        let mut got = vec![0u8; n];
        land.read(0, &mut got).unwrap();
        assert!(
            got == pattern(1 << 16, 9)[..],
            "taken while its sender closed"
        );
    }
    // Both lend, neither reads; rank 1's arrives while rank 0 is already
    // closing.
    f.barrier().await.unwrap();
    if me == 1 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut s = ep.send_region(7, &src, 0..4096);
    assert!(futures::poll!(&mut s).is_pending());
    let start = std::time::Instant::now();
    f.close().await.unwrap();
    let e = s.await.unwrap_err();
    assert!(
        matches!(&e, Error::Declined { why, .. } if why.contains("closed"))
            || matches!(e, Error::Closed),
        "{e}"
    );
    println!("close_ms={}", start.elapsed().as_millis());
}

/// Both ranks' first device operations towards each other at once: their
/// IPC requests cross, and both settle on IPC.
async fn crossing(f: Fabric) {
    let peer = 1 - f.rank();
    let ep = f.endpoint(peer).unwrap();
    let region = f.alloc_device_region(0, 1 << 20).unwrap();
    let theirs = exchange_keys(&f, &region.remote_key()).await;
    let src = f.alloc_device_region(0, 1 << 20).unwrap();
    src.write(0, &pattern(1 << 20, u64::from(f.rank())))
        .unwrap();
    f.barrier().await.unwrap();
    let puts: Vec<_> = (0..4)
        .map(|i| ep.put(&src, i << 18..(i + 1) << 18, &theirs, (i << 18) as u64))
        .collect();
    for p in futures::future::join_all(puts).await {
        p.unwrap();
    }
    f.barrier().await.unwrap();
    let mut got = vec![0u8; 1 << 20];
    region.read(0, &mut got).unwrap();
    assert!(
        got == pattern(1 << 20, u64::from(peer))[..],
        "the peer's puts"
    );
    let s = f.stats();
    println!("direct_puts={}", s.direct_puts);
    println!("staged={}", s.staged_device_ops);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Rank 1 is killed holding a lent message unread: rank 0's future fails
/// with `PeerLost`.
async fn lent_kill(f: Fabric) {
    let ep = f.endpoint(1 - f.rank()).unwrap();
    if f.rank() == 1 {
        let m = f.receiver(3).unwrap().recv().await.unwrap();
        assert!(m.is_lent());
        println!("ready");
        tokio::time::sleep(Duration::from_secs(30)).await;
        return;
    }
    let src = f.alloc_device_region(0, 1 << 20).unwrap();
    let start = std::time::Instant::now();
    let e = ep.send_region(3, &src, 0..(1 << 20)).await.unwrap_err();
    assert!(matches!(e, Error::PeerLost { rank: 1, .. }), "{e}");
    println!("failed_after_ms={}", start.elapsed().as_millis());
}

/// Sizes of the puts and gets, and where each lands in the 64 MiB region
/// (disjoint ranges, below the implicit put's at 60 MiB).
const SIZES: [(usize, u64); 6] = [
    (8, 0),
    (1000, 8),
    (4096, 4096),
    (65_537, 1 << 20),
    (4 << 20, 8 << 20),
    (40 << 20, 16 << 20),
];
const REGION: usize = 64 << 20;

async fn exchange_keys(f: &Fabric, mine: &RemoteKey) -> RemoteKey {
    let peer = 1 - f.rank();
    f.endpoint(peer)
        .unwrap()
        .send(7, mine.to_bytes())
        .await
        .unwrap();
    let m = f.receiver(7).unwrap().recv().await.unwrap();
    RemoteKey::from_bytes(&m.data).unwrap()
}

/// A key's 16-byte id, as its encoding carries it (after the owner).
fn real_id(k: &RemoteKey) -> [u8; 16] {
    let b = k.to_bytes();
    // postcard: the owner as a varint, then the 16 id bytes.
    let skip = b.iter().position(|x| x & 0x80 == 0).unwrap() + 1;
    b[skip..skip + 16].try_into().unwrap()
}

async fn putget(f: Fabric) {
    let me = f.rank();
    let peer = 1 - me;
    assert_eq!(f.transport_for(peer), Some("sm"));
    assert_eq!(
        f.rma_transport_for(peer, MemoryKind::Device(0)),
        Some("smcuda")
    );
    let region = f.alloc_device_region(0, REGION).unwrap();
    assert_eq!(region.memory(), MemoryKind::Device(0));
    assert_eq!(region.len(), REGION);
    assert!(!region.is_shared(), "the CPU of a peer cannot map it");
    let theirs = exchange_keys(&f, &region.remote_key()).await;
    let ep = f.endpoint(peer).unwrap();
    if me == 0 {
        // Puts of every size from a device region of ours.
        let src = f.alloc_device_region(0, REGION).unwrap();
        for (i, &(n, at)) in SIZES.iter().enumerate() {
            src.write(0, &pattern(n, i as u64)).unwrap();
            ep.put(&src, 0..n, &theirs, at).await.unwrap();
        }
        // Implicit puts complete by the flush.
        src.write(0, &pattern(3000, 99)).unwrap();
        ep.put_nbi(&src, 0..3000, &theirs, 60 << 20).unwrap();
        ep.flush().await.unwrap();
        // Out of the key's range: refused before anything is queued.
        let e = ep
            .put(&src, 0..16, &theirs, REGION as u64 - 8)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
        // A forged key (its id, which also names the memory at the
        // owner's share server, replaced): refused, nothing written.
        let mut forged = theirs.to_bytes();
        let fake = [0x5au8; 16];
        let mut hits = 0;
        for i in 0..forged.len().saturating_sub(15) {
            if forged[i..i + 16] == real_id(&theirs)[..] {
                forged[i..i + 16].copy_from_slice(&fake);
                hits += 1;
            }
        }
        // A VMM key names its memory by that id at the owner's server,
        // which refuses the forged one; a legacy handle is itself the
        // capability (the driver opens it for whoever holds it), so
        // there only the key's own id changed.
        let legacy = std::env::var("BTL_SMCUDA_DOUBLE_FAULTS").is_ok_and(|f| f.contains("no-vmm"))
            || std::env::var("BTL_SMCUDA_IPC").is_ok_and(|v| v == "legacy" || v == "off");
        assert_eq!(
            hits,
            if legacy { 1 } else { 2 },
            "the key's id, and the handle's"
        );
        if !legacy {
            let forged = RemoteKey::from_bytes(&forged).unwrap();
            let e = ep.put(&src, 0..64, &forged, 0).await.unwrap_err();
            assert!(matches!(e, Error::Access(_)), "{e}");
            let e = ep.get(&src, 0..64, &forged, 0).await.unwrap_err();
            assert!(matches!(e, Error::Access(_)), "{e}");
            println!("forged_refused=1");
        }
        // Host memory on our side: the host-staged path, into the peer's
        // device memory by the peer.
        let host = f.register(pattern(5000, 77).to_vec());
        ep.put(&host, 0..5000, &theirs, 62 << 20).await.unwrap();
        let e = ep.fetch_add(&theirs, 0, 1).await.unwrap_err();
        assert!(e.to_string().contains("atomics on device memory"), "{e}");
        ep.send(8, &b"put"[..]).await.unwrap();
        // Gets of what rank 1 wrote into its own region.
        f.receiver(9).unwrap().recv().await.unwrap();
        let dst = f.alloc_device_region(0, REGION).unwrap();
        for (i, &(n, at)) in SIZES.iter().enumerate() {
            ep.get(&dst, 0..n, &theirs, at).await.unwrap();
            let mut got = vec![0u8; n];
            dst.read(0, &mut got).unwrap();
            assert!(got == pattern(n, 50 + i as u64)[..], "get of {n} bytes");
        }
        // And back out of it into host memory.
        let back = f.register(vec![0u8; 5000]);
        ep.get(&back, 0..5000, &theirs, 62 << 20).await.unwrap();
        assert!(back.to_vec() == pattern(5000, 77)[..], "staged get");
        let s = f.stats();
        println!("direct_puts={}", s.direct_puts);
        println!("staged={}", s.staged_device_ops);
    } else {
        f.receiver(8).unwrap().recv().await.unwrap();
        for (i, &(n, at)) in SIZES.iter().enumerate().rev() {
            let mut got = vec![0u8; n];
            region.read(at as usize, &mut got).unwrap();
            assert!(got == pattern(n, i as u64)[..], "put of {n} bytes at {at}");
        }
        let mut got = vec![0u8; 3000];
        region.read(60 << 20, &mut got).unwrap();
        assert!(got == pattern(3000, 99)[..], "implicit put");
        for (i, &(n, at)) in SIZES.iter().enumerate() {
            region
                .write(at as usize, &pattern(n, 50 + i as u64))
                .unwrap();
        }
        ep.send(9, &b"written"[..]).await.unwrap();
    }
    f.barrier().await.unwrap();
    let s = f.stats();
    println!("sent_in_place={}", s.emulated_sent_in_place);
    println!("landed_in_place={}", s.emulated_landed_in_place);
    f.close().await.unwrap();
}

/// Rank 1 registers part of a device allocation it holds (its own
/// region's memory, reached by `device_ptr`, as memory from another
/// allocator would be) at an offset in it; rank 0 puts into and gets from
/// that part, and nowhere else.
async fn registered(f: Fabric) {
    const WHOLE: usize = 1 << 20;
    const AT: usize = 65_536 + 4096;
    const PART: usize = 8192;
    let me = f.rank();
    let peer = 1 - me;
    let ep = f.endpoint(peer).unwrap();
    if me == 1 {
        let whole = f.alloc_device_region(0, WHOLE).unwrap();
        let base = whole
            .device_ptr()
            .expect("a device region has a device address");
        assert_eq!(f.register(vec![0u8; 8]).device_ptr(), None);
        // SAFETY: inside `whole`'s allocation, which outlives `part` (both
        // live to the end of this function; the barrier below comes after
        // every operation of the peer's).
        let part = unsafe { f.register_device(base + AT as u64, PART) }.unwrap();
        assert_eq!(part.memory(), MemoryKind::Device(0));
        assert_eq!(part.len(), PART);
        assert_eq!(part.device_ptr(), Some(base + AT as u64));
        // Past the allocation's end, and host memory: refused.
        // SAFETY: refused before anything could reach the memory.
        let past = unsafe { f.register_device(base + WHOLE as u64 - 8, 16) };
        assert!(matches!(past, Err(Error::Config(_))), "{past:?}");
        let host = [0u8; 64];
        // SAFETY: as above.
        let e = unsafe { f.register_device(host.as_ptr() as u64, 64) }.unwrap_err();
        assert!(e.to_string().contains("not device memory"), "{e}");
        part.write(0, &pattern(PART, 5)).unwrap();
        let theirs = exchange_keys(&f, &part.remote_key()).await;
        f.receiver(8).unwrap().recv().await.unwrap();
        // The put landed in the part, at its place in the allocation, and
        // nothing around it moved.
        let mut got = vec![0u8; PART + 2];
        whole.read(AT - 1, &mut got).unwrap();
        assert_eq!(got[0], 0, "before the part");
        assert_eq!(got[PART + 1], 0, "after the part");
        assert!(got[1..=PART] == pattern(PART, 6)[..], "the put");
        // The part as the local side: a put from it copies from its place.
        whole.write(AT, &pattern(PART, 7)).unwrap();
        ep.put(&part, 0..PART, &theirs, 0).await.unwrap();
        ep.send(9, &b"put back"[..]).await.unwrap();
        drop(part);
        // The allocation is still the fabric's: usable after the part went.
        whole.write(0, b"still here").unwrap();
    } else {
        let local = f.alloc_device_region(0, PART).unwrap();
        let theirs = exchange_keys(&f, &local.remote_key()).await;
        assert_eq!(theirs.len(), PART as u64);
        ep.get(&local, 0..PART, &theirs, 0).await.unwrap();
        let mut got = vec![0u8; PART];
        local.read(0, &mut got).unwrap();
        assert!(got == pattern(PART, 5)[..], "the get of the part");
        local.write(0, &pattern(PART, 6)).unwrap();
        ep.put(&local, 0..PART, &theirs, 0).await.unwrap();
        // One byte past the part: refused, though the allocation goes on.
        let e = ep
            .put(&local, 0..16, &theirs, PART as u64 - 8)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
        println!("direct_puts={}", f.stats().direct_puts);
        ep.send(8, &b"put"[..]).await.unwrap();
        f.receiver(9).unwrap().recv().await.unwrap();
        local.read(0, &mut got).unwrap();
        assert!(got == pattern(PART, 7)[..], "the put from the part");
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

async fn kill(f: Fabric) {
    let region = f.alloc_device_region(0, 16 << 20).unwrap();
    let theirs = exchange_keys(&f, &region.remote_key()).await;
    if f.rank() == 1 {
        println!("ready");
        // Killed by the test while rank 0's copies are queued.
        tokio::time::sleep(Duration::from_secs(30)).await;
        return;
    }
    let ep = f.endpoint(1).unwrap();
    let src = f.alloc_device_region(0, 16 << 20).unwrap();
    // Puts one after another until one fails (the double's copies each
    // take its copy delay; a GPU's take microseconds): the kill lands
    // among them.
    let start = std::time::Instant::now();
    let mut failed = None;
    while start.elapsed() < Duration::from_secs(25) {
        if let Err(e) = ep.put(&src, 0..(16 << 20), &theirs, 0).await {
            failed = Some(e);
            break;
        }
    }
    let e = failed.expect("a put failed once the peer was killed");
    assert!(matches!(e, Error::PeerLost { rank: 1, .. }), "{e}");
    println!("failed_after_ms={}", start.elapsed().as_millis());
}

/// A put and a get of the whole 64 MiB region, checked byte for byte; then
/// a put and a get whose futures are dropped at once, each with its only
/// handle on the local region: the copies still run (the double's copies
/// wait their delay first, so they run after the drops), into and out of
/// memory kept alive for them, and `flush` waits for them.
async fn whole_and_dropped(f: Fabric) {
    let me = f.rank();
    let peer = 1 - me;
    let region = f.alloc_device_region(0, REGION).unwrap();
    let theirs = exchange_keys(&f, &region.remote_key()).await;
    let ep = f.endpoint(peer).unwrap();
    let mut rx = f.receiver(8).unwrap();
    if me == 0 {
        let src = f.alloc_device_region(0, REGION).unwrap();
        src.write(0, &pattern(REGION, 1)).unwrap();
        ep.put(&src, 0..REGION, &theirs, 0).await.unwrap();
        ep.send(8, &b"whole"[..]).await.unwrap();
        rx.recv().await.unwrap();
        let dst = f.alloc_device_region(0, REGION).unwrap();
        ep.get(&dst, 0..REGION, &theirs, 0).await.unwrap();
        let mut got = vec![0u8; REGION];
        dst.read(0, &mut got).unwrap();
        assert!(got == pattern(REGION, 2)[..], "the whole get");
        // Dropped at once, with the only handle of their local regions.
        let lone = f.alloc_device_region(0, 1 << 20).unwrap();
        lone.write(0, &pattern(1 << 20, 3)).unwrap();
        drop(ep.put(&lone, 0..(1 << 20), &theirs, 0));
        drop(lone);
        let lone = f.alloc_device_region(0, 1 << 20).unwrap();
        drop(ep.get(&lone, 0..(1 << 20), &theirs, 8 << 20));
        drop(lone);
        ep.flush().await.unwrap();
        ep.send(8, &b"dropped"[..]).await.unwrap();
        rx.recv().await.unwrap();
        println!("dropped_ok=1");
    } else {
        rx.recv().await.unwrap();
        let mut got = vec![0u8; REGION];
        region.read(0, &mut got).unwrap();
        assert!(got == pattern(REGION, 1)[..], "the whole put");
        region.write(0, &pattern(REGION, 2)).unwrap();
        ep.send(8, &b"written"[..]).await.unwrap();
        rx.recv().await.unwrap();
        let mut got = vec![0u8; 1 << 20];
        region.read(0, &mut got).unwrap();
        assert!(got == pattern(1 << 20, 3)[..], "the dropped put landed");
        ep.send(8, &b"checked"[..]).await.unwrap();
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Ping-pong of puts in Interrupt mode: each rank puts into the other's
/// device region and then says so; every put's completion waits on the
/// GPU's host function ringing the parked progress task.
async fn parking(f: Fabric) {
    let me = f.rank();
    let peer = 1 - me;
    let region = f.alloc_device_region(0, 1 << 20).unwrap();
    let src = f.alloc_device_region(0, 1 << 20).unwrap();
    let theirs = exchange_keys(&f, &region.remote_key()).await;
    let ep = f.endpoint(peer).unwrap();
    let mut rx = f.receiver(5).unwrap();
    let len = |i: u64| [8usize, 4096, 300_000][(i % 3) as usize];
    for i in 0..300u64 {
        if (i % 2) as u32 != me {
            let m = rx.recv().await.unwrap();
            assert_eq!(m.data.len(), 8);
            let mut got = vec![0u8; len(i)];
            region.read(0, &mut got).unwrap();
            assert!(got == pattern(len(i), i)[..], "round {i}");
            continue;
        }
        src.write(0, &pattern(len(i), i)).unwrap();
        ep.put(&src, 0..len(i), &theirs, 0).await.unwrap();
        ep.send(5, i.to_le_bytes().to_vec()).await.unwrap();
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// No wake-up is lost when every wait parks: the heartbeat (the only
/// other thing that ends a parked wait) is longer than the watchdog, so
/// one put whose completion nobody announced fails the test.
#[test]
fn parked_put_ping_pong_loses_no_wake_up() {
    let outs = spawn_job(
        2,
        "parking",
        &[
            ("BTL_SMCUDA_GPU", "test-double"),
            ("BTL_SMCUDA_DOUBLE_FAULTS", "copy-delay-ms:1"),
            ("BTL_PROGRESS", "interrupt"),
            ("BTL_HEARTBEAT_MS", "120000"),
        ],
    )
    .wait(Duration::from_secs(60));
    assert_ok(&outs);
}

#[test]
fn device_regions_put_and_get_between_processes_through_the_double() {
    let outs = job(2, "putget", "copy-delay-ms:1").wait(Duration::from_secs(90));
    assert_ok(&outs);
    let n = |k: &str| -> u64 { value(&outs[0], k).unwrap().parse().unwrap() };
    // Every put and the implicit one by the GPU; the put from and the get
    // into host memory through the host.
    assert_eq!(n("direct_puts"), SIZES.len() as u64 + 1);
    assert_eq!(n("staged"), 2);
    assert_eq!(n("forged_refused"), 1);
}

#[test]
fn registered_device_memory_is_reached_at_its_offset_in_the_allocation() {
    // VMM descriptors through the owner's server, then legacy handles.
    for faults in ["copy-delay-ms:1", "copy-delay-ms:1,no-vmm"] {
        let outs = job(2, "registered", faults).wait(Duration::from_secs(60));
        assert_ok(&outs);
        assert_eq!(
            value(&outs[0], "direct_puts").as_deref(),
            Some("1"),
            "{faults}"
        );
    }
}

#[test]
fn registered_memory_staged_after_the_handshake_keeps_its_offset() {
    // The peer is never ready: the operations that waited for the
    // handshake go through the host, from and into the registered part at
    // its place in the allocation.
    let outs = job(2, "registered", "not-ready:50").wait(Duration::from_secs(60));
    assert_ok(&outs);
    assert_eq!(value(&outs[0], "direct_puts").as_deref(), Some("0"));
}

#[test]
fn memory_shareable_neither_way_is_refused_with_the_reason() {
    let outs = job(2, "unshareable", "unshareable").wait(Duration::from_secs(60));
    assert_ok(&outs);
    for o in &outs {
        assert_eq!(value(o, "own_put").as_deref(), Some("ok"));
    }
}

#[test]
fn whole_regions_and_dropped_futures_between_processes() {
    let outs = job(2, "whole", "copy-delay-ms:20").wait(Duration::from_secs(120));
    assert_ok(&outs);
    assert_eq!(value(&outs[0], "dropped_ok").as_deref(), Some("1"));
}

#[test]
fn refused_ipc_stages_every_operation_through_the_host() {
    // MIG instances: the pair refuses IPC at connect, and the same traffic
    // goes through the host, each side's device memory copied by its
    // own process.
    let outs = job(2, "putget", "mig").wait(Duration::from_secs(90));
    assert_ok(&outs);
    let n = |k: &str| -> u64 { value(&outs[0], k).unwrap().parse().unwrap() };
    assert_eq!(n("direct_puts"), 0);
    // Every put and get, the implicit put, the two with host memory, the
    // two with the forged key (refused by the target).
    assert_eq!(n("staged"), 2 * SIZES.len() as u64 + 5);
    let log = String::from_utf8_lossy(&outs[0].stderr);
    assert!(log.contains("MIG"), "the reason is logged: {log}");
}

/// Staged through the host, device memory is read by the device straight
/// into the `sm` fragments of put requests and get answers, and written
/// from the fragments they arrive in, and those fragments are pinned: with
/// `pinned-only` the double refuses any such copy with unpinned host
/// memory, which would fail the operation.
#[test]
fn staged_device_memory_goes_through_pinned_fragments() {
    let outs = job(2, "putget", "mig,pinned-only").wait(Duration::from_secs(90));
    assert_ok(&outs);
    let n = |o: &std::process::Output, k: &str| -> u64 { value(o, k).unwrap().parse().unwrap() };
    assert_eq!(n(&outs[0], "direct_puts"), 0);
    for (rank, o) in outs.iter().enumerate() {
        // Rank 0's puts and rank 1's get answers are built in place; each
        // lands at the other in place.
        assert!(
            n(o, "sent_in_place") >= 10,
            "rank {rank}: {}",
            n(o, "sent_in_place")
        );
        assert!(
            n(o, "landed_in_place") >= 10,
            "rank {rank}: {}",
            n(o, "landed_in_place")
        );
    }
}

/// `putget` with `BTL_SMCUDA_IPC=off` passed, every operation staged.
fn staged_by_choice(outs: &[std::process::Output]) {
    assert_ok(outs);
    let n = |k: &str| -> u64 { value(&outs[0], k).unwrap().parse().unwrap() };
    assert_eq!(n("direct_puts"), 0);
    // Every put and get, the implicit put, the two with host memory (the
    // allocations are legacy: no forged-key pair, see `putget`).
    assert_eq!(n("staged"), 2 * SIZES.len() as u64 + 3);
    // Through fragments: puts built in them, get answers written from them.
    assert!(n("sent_in_place") >= 10 && n("landed_in_place") >= 10);
    let log = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        log.contains("BTL_SMCUDA_IPC=off"),
        "the reason is logged: {log}"
    );
    for o in outs {
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(
            !log.contains("pinning the message links' memory"),
            "the fragments could not be pinned: {log}"
        );
    }
}

#[test]
fn ipc_turned_off_stages_every_operation_and_a_bad_choice_is_named() {
    let outs = spawn_job(
        2,
        "putget",
        &[("BTL_SMCUDA_GPU", "test-double"), ("BTL_SMCUDA_IPC", "off")],
    )
    .wait(Duration::from_secs(90));
    staged_by_choice(&outs);
    let outs = spawn_job(
        2,
        "putget",
        &[
            ("BTL_SMCUDA_GPU", "test-double"),
            ("BTL_SMCUDA_IPC", "sometimes"),
        ],
    )
    .wait(Duration::from_secs(60));
    for o in &outs {
        assert!(!o.status.success());
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(
            log.contains("BTL_SMCUDA_IPC=sometimes") && log.contains("`legacy`"),
            "{log}"
        );
    }
}

#[test]
fn device_memory_sent_is_lent_in_order_and_landed_where_the_receiver_says() {
    for faults in ["copy-delay-ms:1", "copy-delay-ms:1,no-vmm"] {
        let outs = job(2, "lent", faults).wait(Duration::from_secs(120));
        assert_ok(&outs);
        // The four between carried ones, the dropped one, the one met by
        // recv_into, the one too large at first, the lone one.
        assert_eq!(
            value(&outs[0], "lent_sends").as_deref(),
            Some("8"),
            "{faults}"
        );
        assert_eq!(value(&outs[0], "staged").as_deref(), Some("0"), "{faults}");
    }
}

#[test]
fn device_memory_sent_without_ipc_is_carried_through_the_host() {
    let outs = spawn_job(
        2,
        "lent",
        &[("BTL_SMCUDA_GPU", "test-double"), ("BTL_SMCUDA_IPC", "off")],
    )
    .wait(Duration::from_secs(120));
    assert_ok(&outs);
    assert_eq!(value(&outs[0], "lent_sends").as_deref(), Some("0"));
    assert_eq!(value(&outs[0], "staged").as_deref(), Some("8"));
}

#[test]
fn close_waits_for_lent_messages_and_declines_those_it_holds() {
    let outs = job(2, "lent_close", "copy-delay-ms:1").wait(Duration::from_secs(60));
    assert_ok(&outs);
    for o in &outs {
        let ms: u64 = value(o, "close_ms").unwrap().parse().unwrap();
        assert!(ms < 5_000, "close waited {ms} ms for unread lent messages");
    }
}

#[test]
fn a_receiver_killed_holding_a_lent_message_fails_the_send() {
    let ms = kill_rank_1(job(2, "lent_kill", "copy-delay-ms:1"), 1500);
    assert!(ms < 30_000, "the send failed only after {ms} ms");
}

/// SIGKILL rank 1 of `job` after `after_ms`, wait for rank 0 to pass, and
/// return the `failed_after_ms` it printed.
fn kill_rank_1(job: Job, after_ms: u64) -> u64 {
    let rank1 = job.children[1].id();
    std::thread::sleep(Duration::from_millis(after_ms));
    let _ = std::process::Command::new("kill")
        .args(["-9", &rank1.to_string()])
        .status();
    let outs = job.wait(Duration::from_secs(60));
    assert!(
        outs[0].status.success(),
        "{}",
        String::from_utf8_lossy(&outs[0].stderr)
    );
    value(&outs[0], "failed_after_ms").unwrap().parse().unwrap()
}

#[test]
fn the_ipc_handshake_settles_crossing_requests_and_retries_a_peer_not_ready() {
    // Both ranks ask at once; then a peer that answers `NotReady` twice
    // before it accepts: either way every put goes by IPC.
    for faults in ["copy-delay-ms:1", "copy-delay-ms:1,not-ready:2"] {
        let outs = job(2, "crossing", faults).wait(Duration::from_secs(60));
        assert_ok(&outs);
        for o in &outs {
            assert_eq!(value(o, "direct_puts").as_deref(), Some("4"), "{faults}");
            assert_eq!(value(o, "staged").as_deref(), Some("0"), "{faults}");
        }
    }
}

#[test]
fn a_peer_never_ready_for_ipc_sends_its_device_memory_through_the_host() {
    // Five `NotReady` answers, and the asker settles on the host path,
    // with the operations that waited for the answer.
    let outs = job(2, "crossing", "not-ready:50").wait(Duration::from_secs(90));
    assert_ok(&outs);
    for o in &outs {
        assert_eq!(value(o, "direct_puts").as_deref(), Some("0"));
        assert_eq!(value(o, "staged").as_deref(), Some("4"));
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(log.contains("not ready after 5 requests"), "{log}");
    }
}

#[test]
fn legacy_handles_carry_the_same_traffic() {
    // No VMM: allocations are legacy, and their handles travel in the key.
    let outs = job(2, "putget", "no-vmm").wait(Duration::from_secs(90));
    assert_ok(&outs);
}

#[test]
fn a_peer_killed_mid_copy_fails_the_pending_put() {
    // Let the copies start, then kill rank 1.
    let ms = kill_rank_1(job(2, "kill", "copy-delay-ms:20"), 1500);
    assert!(ms < 30_000, "the put failed only after {ms} ms");
}

#[test]
fn without_a_gpu_device_regions_say_why() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // The default backend is the CUDA driver: absent here (or not
        // built in), so no transport has device memory.
        if std::env::var_os("BTL_SMCUDA_GPU").is_some() {
            println!("skipped: BTL_SMCUDA_GPU is set for this process");
            return;
        }
        let f = Fabric::single().await.unwrap();
        match f.alloc_device_region(0, 4096) {
            Err(e) => assert!(e.to_string().contains("smcuda"), "{e}"),
            Ok(r) => {
                println!("a GPU is here: {:?}", r.memory());
            }
        }
        f.close().await.unwrap();
    });
}

/// The transport's scenarios on a real GPU through the CUDA driver: put,
/// get and lent sends between device regions with VMM descriptors, with
/// legacy handles, and with IPC turned off (every operation through the
/// host);
/// memory the user registered; whole 64 MiB regions and dropped futures;
/// an Interrupt-mode ping-pong woken by host functions; a peer killed
/// among the copies.
#[test]
fn on_a_real_gpu_device_memory_goes_by_each_ipc_kind_and_through_the_host() {
    let Some(gpu) = gpu_under_test() else {
        println!(
            "skipped: needs an NVIDIA GPU and BTL_SMCUDA_TEST_GPU=cuda (scripts/gpu-check.sh sets it)"
        );
        return;
    };
    let cuda_job =
        |scenario: &str, ipc: &str, extra: &[(&str, &str)]| gpu_job(&gpu, scenario, ipc, extra);
    let count = |outs: &[std::process::Output], k: &str| -> u64 {
        value(&outs[0], k).unwrap().parse().unwrap()
    };
    for ipc in ["auto", "legacy"] {
        let outs = cuda_job("putget", ipc, &[]).wait(Duration::from_secs(90));
        assert_ok(&outs);
        assert_eq!(count(&outs, "direct_puts"), SIZES.len() as u64 + 1, "{ipc}");
        assert_eq!(count(&outs, "staged"), 2, "{ipc}");
        println!("putget {ipc}: ok");
        let outs = cuda_job("registered", ipc, &[]).wait(Duration::from_secs(60));
        assert_ok(&outs);
        assert_eq!(
            value(&outs[0], "direct_puts").as_deref(),
            Some("1"),
            "{ipc}"
        );
        println!("registered {ipc}: ok");
        let outs = cuda_job("lent", ipc, &[]).wait(Duration::from_secs(90));
        assert_ok(&outs);
        assert_eq!(value(&outs[0], "lent_sends").as_deref(), Some("8"), "{ipc}");
        println!("lent {ipc}: ok");
    }
    let outs = cuda_job("lent", "off", &[]).wait(Duration::from_secs(90));
    assert_ok(&outs);
    assert_eq!(value(&outs[0], "staged").as_deref(), Some("8"));
    println!("lent off (carried): ok");
    let outs = cuda_job("putget", "off", &[]).wait(Duration::from_secs(90));
    staged_by_choice(&outs);
    println!("putget off (staged): ok");
    let outs = cuda_job("whole", "auto", &[]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    assert_eq!(value(&outs[0], "dropped_ok").as_deref(), Some("1"));
    println!("whole: ok");
    let interrupt = [
        ("BTL_PROGRESS", "interrupt"),
        ("BTL_HEARTBEAT_MS", "120000"),
    ];
    let outs = cuda_job("parking", "auto", &interrupt).wait(Duration::from_secs(60));
    assert_ok(&outs);
    println!("parking: ok");
    let ms = kill_rank_1(cuda_job("kill", "auto", &[]), 5000);
    assert!(ms < 30_000, "the put failed only after {ms} ms");
    println!("kill: failed_after_ms={ms}");
}

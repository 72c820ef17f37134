//! The `rdma` transport between real processes over real libfabric, forced
//! with `BTL_TRANSPORTS=rdma` on the `tcp;ofi_rxm` provider bound to
//! 127.0.0.1 (each test re-executes this binary as the ranks). Where the
//! build lacks the `rdma` feature, or libfabric has no `tcp;ofi_rxm` here,
//! each test prints `skipped:` and why, and returns.

mod common;

use std::time::Duration;

use async_btl::{Error, Fabric, RemoteKey};
use common::*;

/// Launch variables of every rdma test: rdma only, tcp;ofi_rxm on
/// loopback, a short peer timeout, and eager frames of 16 KiB and the
/// 32-byte header (the default over hardware providers; these tests place
/// their sizes around it).
const RDMA: [(&str, &str); 5] = [
    ("BTL_TRANSPORTS", "rdma"),
    ("BTL_RDMA_PROVIDER", "tcp;ofi_rxm"),
    ("BTL_RDMA_ADDR", "127.0.0.1"),
    ("BTL_RDMA_PEER_TIMEOUT_MS", "1000"),
    ("BTL_RDMA_EAGER", "16416"),
];

/// The eager limit of the tests' ranks less the header: the largest eager
/// message.
const EAGER_PAYLOAD: usize = 16384;

fn job(n: u32, scenario: &str, extra: &[(&str, &str)]) -> Job {
    let env: Vec<(&str, &str)> = RDMA.iter().chain(extra).copied().collect();
    spawn_job(n, scenario, &env)
}

macro_rules! need_rdma {
    () => {
        if let Some(why) = no_rdma() {
            println!("skipped: {why}");
            return;
        }
    };
}

/// The child side: runs the scenario named in BTL_TEST_SCENARIO.
#[test]
fn rank_main() {
    let Ok(scenario) = std::env::var("BTL_TEST_SCENARIO") else {
        return; // the parent test process: nothing to do here
    };
    let rt = if std::env::var_os("BTL_TEST_CURRENT_THREAD").is_some() {
        current_thread_runtime()
    } else {
        rank_runtime()
    };
    rt.block_on(async {
        if scenario == "mismatch" {
            return mismatch().await;
        }
        let f = Fabric::from_env().await.expect("fabric from launcher env");
        for r in (0..f.size()).filter(|r| *r != f.rank()) {
            assert_eq!(f.transport_for(r), Some("rdma"));
        }
        match scenario.as_str() {
            "sizes" => sizes(f).await,
            "tcp_frame" => tcp_frame(f).await,
            "order" => order(f).await,
            "alltoall" => alltoall(f).await,
            "putget" => putget(f).await,
            "atomics" => {
                let n = |k: &str| std::env::var(k).unwrap().parse().unwrap();
                atomics_scenario(f, n("BTL_TEST_ADDS"), n("BTL_TEST_LOCKED")).await
            }
            "stall" => stall(f).await,
            "kill" => kill_scenario(f, true).await,
            "serve3" => serve3(f).await,
            "idle" => idle(f).await,
            "one_sided" => one_sided(f).await,
            "wake" => wake(f).await,
            "held" => held(f).await,
            "held_alone" => held_alone(f).await,
            "bundle" => bundle(f).await,
            "lend" => lend(f).await,
            "compute" => compute_scenario(f).await,
            other => panic!("unknown scenario {other}"),
        }
    });
}

/// Around the eager limit, the limit of two pieces, and the rendezvous
/// sizes.
const SIZES: [usize; 13] = [
    0,
    1,
    8,
    EAGER_PAYLOAD - 1,
    EAGER_PAYLOAD,
    EAGER_PAYLOAD + 1,
    2 * EAGER_PAYLOAD,
    2 * EAGER_PAYLOAD + 1,
    64 << 10,
    1 << 20,
    (1 << 20) + 7,
    16 << 20,
    3,
];

async fn sizes(f: Fabric) {
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        send_sizes(
            &ep,
            3,
            &SIZES,
            &[0, 1, 100, EAGER_PAYLOAD, EAGER_PAYLOAD + 1],
        )
        .await;
    } else {
        expect_sizes(
            &f,
            0,
            3,
            &SIZES,
            &[0, 1, 100, EAGER_PAYLOAD, EAGER_PAYLOAD + 1],
        )
        .await;
    }
    let s = f.stats();
    println!("rendezvous={}", s.rdma.rendezvous);
    println!("in_pieces={}", s.rdma.in_pieces);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Around the default eager frame over `tcp` (64 KiB and the header):
/// one frame, two pieces, a rendezvous.
const TCP_SIZES: [usize; 4] = [64 << 10, (64 << 10) + 1, 128 << 10, (128 << 10) + 1];

async fn tcp_frame(f: Fabric) {
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        send_sizes(&ep, 3, &TCP_SIZES, &[]).await;
    } else {
        expect_sizes(&f, 0, 3, &TCP_SIZES, &[]).await;
    }
    let s = f.stats();
    println!("rendezvous={}", s.rdma.rendezvous);
    println!("in_pieces={}", s.rdma.in_pieces);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

#[test]
fn rdma_over_tcp_sends_up_to_64_kib_in_one_frame_by_default() {
    need_rdma!();
    // The tests' environment without its eager size.
    let env: Vec<(&str, &str)> = RDMA
        .iter()
        .filter(|(k, _)| *k != "BTL_RDMA_EAGER")
        .copied()
        .collect();
    let outs = spawn_job(2, "tcp_frame", &env).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let n = |k: &str| -> u64 { value(&outs[0], k).unwrap().parse().unwrap() };
    // 64 KiB in one frame; 64 KiB + 1 and 128 KiB in two pieces; only
    // 128 KiB + 1 read by the receiver.
    assert_eq!(
        n("in_pieces"),
        2,
        "the messages of two frames went in pieces"
    );
    assert_eq!(
        n("rendezvous"),
        1,
        "only the message above two frames was read"
    );
}

/// Sizes around the largest message delivered straight from its receive
/// buffer and the smallest one that keeps it (half a receive buffer of the
/// tests' 16 KiB frames: 8208 bytes).
const LEND_SIZES: [usize; 9] = [0, 1, 8, 100, 4096, 8191, 8207, 8208, 8209];

/// Rank 0 sends a stream of messages of `LEND_SIZES` in turn; rank 1 takes
/// them alternately into a buffer it lends (`recv_into`) and as messages of
/// their own (`recv`), checking each one's length and bytes.
async fn lend(f: Fabric) {
    const N: u64 = 3000;
    let size = |i: u64| LEND_SIZES[i as usize % LEND_SIZES.len()];
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        for i in 0..N {
            ep.send(5, pattern(size(i), i)).await.unwrap();
        }
    } else {
        let mut rx = f.receiver(5).unwrap();
        let mut kept = Vec::new();
        for i in 0..N {
            let what = format!("message {i} ({} bytes)", size(i));
            let want = pattern(size(i), i);
            recv_checked(&mut rx, &mut kept, i % 2 == 0, 0, &want, &what).await;
        }
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

async fn order(f: Fabric) {
    let n: u64 = std::env::var("ORDER_N").map_or(100_000, |v| v.parse().unwrap());
    order_check(&f, n).await;
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

async fn alltoall(f: Fabric) {
    all_to_all_check(&f, 300, |i| (i as usize * 337) % 70_000).await;
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Puts whose futures are dropped in `putget`: how many, their size, and
/// where in the target region they go.
const DROPPED: usize = 100;
const SLOT: usize = 64;
const DROPPED_AT: usize = 700_000;

async fn putget(f: Fabric) {
    if f.rank() == 1 {
        let heap = f.register(vec![0u8; 1 << 20]);
        let shared = f.alloc_region(1 << 16).unwrap();
        let ep = f.endpoint(0).unwrap();
        ep.send(1, heap.remote_key().to_bytes()).await.unwrap();
        ep.send(1, shared.remote_key().to_bytes()).await.unwrap();
        f.barrier().await.unwrap(); // rank 0 is done
        let mut got = vec![0u8; 200_000];
        heap.read(12345, &mut got).unwrap();
        assert_eq!(got, pattern(200_000, 1).to_vec(), "put into the region");
        assert!(heap.to_vec()[(1 << 20) - 64..].iter().all(|b| *b == 0));
        let mut got = vec![0u8; 100];
        shared.read(300, &mut got).unwrap();
        assert_eq!(got, pattern(100, 9).to_vec(), "put into alloc_region");
        for i in 0..DROPPED {
            let mut got = vec![0u8; SLOT];
            heap.read(DROPPED_AT + i * SLOT, &mut got).unwrap();
            assert_eq!(
                got,
                pattern(SLOT, 1000 + i as u64).to_vec(),
                "dropped put {i}"
            );
        }
    } else {
        let mut rx = f.receiver(1).unwrap();
        let heap = RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
        let shared = RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
        let ep = f.endpoint(1).unwrap();
        let src = f.register(pattern(200_000, 1).to_vec());
        ep.put(&src, 0..200_000, &heap, 12345).await.unwrap();
        let back = f.register(vec![0u8; 200_000]);
        ep.get(&back, 0..200_000, &heap, 12345).await.unwrap();
        assert_eq!(back.to_vec(), pattern(200_000, 1).to_vec());
        let small = f.register(pattern(100, 9).to_vec());
        ep.put(&small, 0..100, &shared, 300).await.unwrap();
        let e = ep
            .put(&src, 0..64, &heap, (1 << 20) - 10)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
        assert_forged_keys_refused(&ep, &src, &back, &heap, 1 << 20).await;
        // After refused keys the connection still carries everything.
        ep.get(&back, 0..200_000, &heap, 12345).await.unwrap();
        assert_eq!(back.to_vec(), pattern(200_000, 1).to_vec());
        assert_implicit_ops(&f, &ep, &heap, 500_000).await;
        // Puts whose futures (and source regions) are dropped, half after
        // one poll and half before any: each still lands whole, and no
        // memory the NIC reads is freed under it (the target checks).
        for i in 0..DROPPED {
            let src = f.register(pattern(SLOT, 1000 + i as u64).to_vec());
            let mut put = ep.put(&src, 0..SLOT, &heap, (DROPPED_AT + i * SLOT) as u64);
            if i % 2 == 0 {
                let _ = futures::poll!(&mut put);
            }
            drop(put);
            drop(src);
        }
        ep.flush().await.unwrap();
        let s = f.stats();
        println!("rdma_writes={}\nrdma_reads={}", s.rdma.writes, s.rdma.reads);
        println!("emulated_puts={}", s.emulated_puts);
        f.barrier().await.unwrap();
    }
    f.close().await.unwrap();
}

/// Rank 0 keeps using forged and out-of-range keys on rank 1's region
/// while rank 2 streams messages and puts to rank 1: rank 0 gets
/// `Error::Access` each time, and rank 2's traffic all arrives, in order,
/// with its puts in place.
async fn serve3(f: Fabric) {
    const MSGS: u64 = 3000;
    match f.rank() {
        1 => {
            let region = f.register(vec![0u8; 1 << 16]);
            for r in [0, 2] {
                let ep = f.endpoint(r).unwrap();
                ep.send(1, region.remote_key().to_bytes()).await.unwrap();
            }
            let mut rx = f.receiver(2).unwrap();
            for i in 0..MSGS {
                let m = rx.recv().await.unwrap();
                assert_eq!(m.src, 2);
                assert_eq!(m.data, pattern(100 + (i % 300) as usize, i), "message {i}");
            }
            f.barrier().await.unwrap();
            let mut got = vec![0u8; 32 * 1024];
            region.read(32 * 1024, &mut got).unwrap();
            assert_eq!(got, pattern(32 * 1024, 77).to_vec(), "rank 2's puts");
            assert!(
                region.to_vec()[..1024].iter().all(|b| *b == 0),
                "forged puts wrote"
            );
        }
        0 => {
            let mut rx = f.receiver(1).unwrap();
            let key = RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
            let ep = f.endpoint(1).unwrap();
            let src = f.register(pattern(1024, 5).to_vec());
            let mut bad = key.to_bytes();
            bad[5] ^= 0x55;
            let forged = RemoteKey::from_bytes(&bad).unwrap();
            for _ in 0..20 {
                let e = ep.put(&src, 0..1024, &forged, 0).await.unwrap_err();
                assert!(matches!(e, Error::Access(_)), "forged put: {e}");
                let e = ep
                    .put(&src, 0..1024, &key, (1 << 16) - 10)
                    .await
                    .unwrap_err();
                assert!(matches!(e, Error::Access(_)), "out of range: {e}");
            }
            f.barrier().await.unwrap();
        }
        _ => {
            let mut rx = f.receiver(1).unwrap();
            let key = RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
            let ep = f.endpoint(1).unwrap();
            let data = f.register(pattern(32 * 1024, 77).to_vec());
            for i in 0..MSGS {
                ep.send(2, pattern(100 + (i % 300) as usize, i))
                    .await
                    .unwrap();
                if i % 100 == 0 {
                    let k = (i / 100) as usize % 32;
                    ep.put(
                        &data,
                        k * 1024..(k + 1) * 1024,
                        &key,
                        (32 * 1024 + k * 1024) as u64,
                    )
                    .await
                    .unwrap();
                }
            }
            ep.put(&data, 0..32 * 1024, &key, 32 * 1024).await.unwrap();
            f.barrier().await.unwrap();
        }
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// After traffic of every kind (eager, rendezvous, put, get), both ranks
/// sit idle for 2 s: the progress task must sleep on the completion
/// queue's fd, not spin.
async fn idle(f: Fabric) {
    let peer = 1 - f.rank();
    let ep = f.endpoint(peer).unwrap();
    let mut rx = f.receiver(5).unwrap();
    let region = f.register(vec![0u8; 1 << 20]);
    ep.send(6, region.remote_key().to_bytes()).await.unwrap();
    let mut keys = f.receiver(6).unwrap();
    let key = RemoteKey::from_bytes(&keys.recv().await.unwrap().data).unwrap();
    for len in [8usize, 5000, 1 << 20] {
        ep.send(5, pattern(len, 1)).await.unwrap();
        assert_eq!(rx.recv().await.unwrap().data.len(), len);
        ep.put(&region, 0..len, &key, 0).await.unwrap();
        ep.get(&region, 0..len, &key, 0).await.unwrap();
    }
    f.barrier().await.unwrap();
    let before = cpu_time();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = cpu_time() - before;
    println!("idle_cpu_ms={}", used.as_millis());
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Rank 0 only writes into rank 1's region (puts, never a message) while
/// rank 1 sends it a small message every 50 ms, for 2.5 peer timeouts:
/// hearing its peer often must not keep rank 0 from sending keepalives,
/// or rank 1, which hears nothing from it, takes it for lost.
async fn one_sided(f: Fabric) {
    let me = f.rank();
    let ep = f.endpoint(1 - me).unwrap();
    let region = f.register(vec![0u8; 4096]);
    let span = Duration::from_millis(2500);
    let start = std::time::Instant::now();
    if me == 1 {
        ep.send(6, region.remote_key().to_bytes()).await.unwrap();
        let mut sent = 0u32;
        while start.elapsed() < span {
            ep.send(7, sent.to_le_bytes().to_vec()).await.unwrap();
            sent += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("messages={sent}");
    } else {
        let mut keys = f.receiver(6).unwrap();
        let key = RemoteKey::from_bytes(&keys.recv().await.unwrap().data).unwrap();
        let mut puts = 0u64;
        while start.elapsed() < span {
            for _ in 0..16 {
                ep.put_nbi(&region, 0..64, &key, 0).unwrap();
            }
            ep.flush().await.unwrap();
            puts += 16;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        println!("puts={puts}");
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Streams (over which a rank's progress finds completions for longer than
/// a heartbeat without parking, so the runtime stops watching the
/// completion queue's fd) and then, each rank in turn, a wait for one
/// message while the peer pauses: the waiting rank's progress task is
/// parked, and must be woken by the fd it watches again, not by the
/// heartbeat's timer. The pausing rank times the round trip (`wake_ms_R`).
async fn wake(f: Fabric) {
    let me = f.rank();
    let ep = f.endpoint(1 - me).unwrap();
    let mut rx = f.receiver(5).unwrap();
    let mut count = f.receiver(6).unwrap();
    for round in 0..2 {
        for sender in [0, 1] {
            // A stream of about 1.6 heartbeats, then its length.
            if me == sender {
                let start = std::time::Instant::now();
                let mut n = 0u32;
                while start.elapsed() < Duration::from_millis(1300) {
                    ep.send_inline(5, &n.to_le_bytes()).await.unwrap();
                    n += 1;
                }
                ep.send_inline(6, &n.to_le_bytes()).await.unwrap();
            } else {
                let mut i = 0u32;
                let n = loop {
                    tokio::select! {
                        biased;
                        m = rx.recv() => {
                            assert_eq!(m.unwrap().data[..], i.to_le_bytes());
                            i += 1;
                        }
                        m = count.recv() => {
                            let b: [u8; 4] = m.unwrap().data[..].try_into().unwrap();
                            break u32::from_le_bytes(b);
                        }
                    }
                };
                for i in i..n {
                    assert_eq!(rx.recv().await.unwrap().data[..], i.to_le_bytes());
                }
            }
        }
        f.barrier().await.unwrap();
        for pinger in [0, 1] {
            if me == pinger {
                tokio::time::sleep(Duration::from_millis(400)).await;
                let start = std::time::Instant::now();
                ep.send_inline(5, b"ping").await.unwrap();
                assert_eq!(&rx.recv().await.unwrap().data[..], b"pong");
                println!("wake_ms_{round}={}", start.elapsed().as_millis());
            } else {
                assert_eq!(&rx.recv().await.unwrap().data[..], b"ping");
                ep.send_inline(5, b"pong").await.unwrap();
            }
        }
    }
    println!("cq_unwatches={}", f.stats().rdma.cq_unwatches);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Sizes of the messages of [`bundle`]: those that may join a bundle (up
/// to 4 KiB) and some that may not, which close the open one.
const BUNDLE_SIZES: [usize; 9] = [0, 1, 8, 100, 1000, 4095, 4096, 4097, 9000];

/// Messages of [`bundle`]'s first part.
const BUNDLE_N: u64 = 20_000;

/// Messages of [`bundle`]'s second part, sent to a receiver that does
/// not read for a while.
const STALLED_N: u64 = 50_000;

/// Rank 0 streams messages of [`BUNDLE_SIZES`] in turn to rank 1, in runs
/// of four on tag 3 and three on tag 4, some with `send_inline` (copied at
/// once) and some with `send` (a `Bytes`); rank 1 checks each tag's
/// messages in order, with their bytes. Then rank 0 streams 512-byte
/// messages on tag 5 while rank 1 does not read for 1.5 s: rank 0 prints
/// how many of its sends completed in the first second
/// (`sent_before_read=`), which the receiver's budget and credits must
/// bound, and rank 1 then checks them all in order.
async fn bundle(f: Fabric) {
    let msg = |i: u64| pattern(BUNDLE_SIZES[i as usize % BUNDLE_SIZES.len()], i);
    let tag = |i: u64| if i % 7 < 4 { 3 } else { 4 };
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        for i in 0..BUNDLE_N {
            let m = msg(i);
            if i % 3 == 0 {
                ep.send(tag(i), m).await.unwrap();
            } else {
                ep.send_inline(tag(i), &m).await.unwrap();
            }
        }
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stream = {
            let (ep, sent) = (ep.clone(), sent.clone());
            tokio::spawn(async move {
                for i in 0..STALLED_N {
                    ep.send_inline(5, &pattern(512, i)).await.unwrap();
                    sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = sent.load(std::sync::atomic::Ordering::Relaxed);
        println!("sent_before_read={before}");
        stream.await.unwrap();
    } else {
        let mut rx = [f.receiver(3).unwrap(), f.receiver(4).unwrap()];
        for i in 0..BUNDLE_N {
            let m = rx[tag(i) as usize - 3].recv().await.unwrap();
            assert_eq!(m.data, msg(i), "message {i}");
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut rx = f.receiver(5).unwrap();
        for i in 0..STALLED_N {
            let m = rx.recv().await.unwrap();
            assert_eq!(m.data, pattern(512, i), "stalled message {i}");
        }
    }
    let s = f.stats();
    println!("bundles={}", s.rdma.bundles);
    println!("bundled={}", s.rdma.bundled);
    println!("peers_lost={}", s.peers_lost);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Messages of `HELD` from rank 1 on a tag over its budget are held by
/// rank 0 while rank 2 streams on another tag; rank 0 then takes them.
const HELD: u32 = 300;

/// Rank 1's messages wait in rank 0 for room, with no other traffic:
/// each message rank 0 takes must let the next held one through.
async fn held_alone(f: Fabric) {
    if f.rank() == 0 {
        let mut rx = f.receiver(7).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let start = std::time::Instant::now();
        for i in 0..HELD {
            let m = rx.recv().await.unwrap();
            assert_eq!(m.data[..4], i.to_le_bytes(), "message {i} of rank 1");
        }
        println!("held_ms={}", start.elapsed().as_millis());
    } else {
        let ep = f.endpoint(0).unwrap();
        for i in 0..HELD {
            let mut m = vec![0u8; 1024];
            m[..4].copy_from_slice(&i.to_le_bytes());
            ep.send_inline(7, &m).await.unwrap();
        }
    }
    println!("credit_waits={}", f.stats().rdma.credit_waits);
    println!("peers_lost={}", f.stats().peers_lost);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Rank 1 sends [`HELD`] 1 KiB messages on tag 7, more than rank 0's tag
/// budget and rank 1's credits hold, and waits; rank 2 streams on tag 8
/// until rank 0 says stop (tag 9). Rank 0 drains tag 8 all along, takes
/// tag 7 only after a pause, by when rank 1's frames wait in rank 0 for
/// room, and times taking them all: each take makes room, and what rank 1
/// has waiting must be delivered then, though rank 1, out of credits,
/// sends nothing more and rank 2's stream keeps rank 0's progress busy.
async fn held(f: Fabric) {
    match f.rank() {
        0 => {
            let mut stream = f.receiver(8).unwrap();
            let drain = tokio::spawn(async move {
                let mut n = 0u64;
                loop {
                    let m = stream.recv().await.unwrap();
                    if m.data[..] == b"end"[..] {
                        return n;
                    }
                    n += 1;
                }
            });
            let mut rx = f.receiver(7).unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let start = std::time::Instant::now();
            for i in 0..HELD {
                let m = rx.recv().await.unwrap();
                assert_eq!(m.src, 1);
                assert_eq!(m.data.len(), 1024);
                assert_eq!(m.data[..4], i.to_le_bytes(), "message {i} of rank 1");
            }
            println!("held_ms={}", start.elapsed().as_millis());
            f.endpoint(2)
                .unwrap()
                .send_inline(9, b"stop")
                .await
                .unwrap();
            let streamed = drain.await.unwrap();
            println!("streamed={streamed}");
        }
        1 => {
            let ep = f.endpoint(0).unwrap();
            for i in 0..HELD {
                let mut m = vec![0u8; 1024];
                m[..4].copy_from_slice(&i.to_le_bytes());
                ep.send_inline(7, &m).await.unwrap();
            }
        }
        _ => {
            let ep = f.endpoint(0).unwrap();
            let mut stop = f.receiver(9).unwrap();
            let stopped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let watch = {
                let stopped = stopped.clone();
                tokio::spawn(async move {
                    stop.recv().await.unwrap();
                    stopped.store(true, std::sync::atomic::Ordering::Relaxed);
                })
            };
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                ep.send_inline(8, &[0u8; 64]).await.unwrap();
                tokio::task::yield_now().await;
            }
            ep.send_inline(8, b"end").await.unwrap();
            watch.await.unwrap();
        }
    }
    println!("credit_waits={}", f.stats().rdma.credit_waits);
    println!("peers_lost={}", f.stats().peers_lost);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// The receiver does not read for three peer timeouts: the sender must wait
/// (bounded memory), not declare it lost, then everything arrives.
async fn stall(f: Fabric) {
    // The receiver's memory stays bounded too while it does not read:
    // sampled over its sleep.
    use std::sync::atomic::{AtomicU64, Ordering};
    let peak = std::sync::Arc::new(AtomicU64::new(rss_kib()));
    let before = rss_kib();
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            for _ in 0..30 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                peak.fetch_max(rss_kib(), Ordering::Relaxed);
            }
        })
    };
    stall_scenario(&f, 120, Duration::from_secs(3)).await;
    let _ = sampler.await;
    if f.rank() == 1 {
        println!("rx_rss_before_kib={before}");
        println!("rx_rss_peak_kib={}", peak.load(Ordering::Relaxed));
    }
    assert_eq!(f.stats().peers_lost, 0);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

#[test]
fn rdma_sizes_between_processes() {
    need_rdma!();
    let outs = job(2, "sizes", &[]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    // 2 * EAGER_PAYLOAD + 1, 64 KiB, 1 MiB, 1 MiB + 7 and 16 MiB are read
    // by the receiver; EAGER_PAYLOAD + 1 (sent twice: once inline) and
    // 2 * EAGER_PAYLOAD go in two eager pieces.
    let rdv: u64 = value(&outs[0], "rendezvous").unwrap().parse().unwrap();
    assert_eq!(rdv, 5, "the large messages went by rendezvous");
    let pieces: u64 = value(&outs[0], "in_pieces").unwrap().parse().unwrap();
    assert_eq!(
        pieces, 3,
        "the messages of two eager buffers went in pieces"
    );
}

#[test]
fn rdma_frames_stay_within_the_users_lower_rxm_eager_limit() {
    need_rdma!();
    // rxm sends frames of 16 KiB at most eagerly here: a 16 KiB message
    // and its header no longer fit one, so what sat at the limit goes in
    // pieces and two full buffers' worth by rendezvous.
    let outs =
        job(2, "sizes", &[("FI_OFI_RXM_EAGER_LIMIT", "16384")]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let n = |k: &str| -> u64 { value(&outs[0], k).unwrap().parse().unwrap() };
    assert_eq!(n("rendezvous"), 6, "2 * EAGER_PAYLOAD went by rendezvous");
    // EAGER_PAYLOAD - 1, EAGER_PAYLOAD and EAGER_PAYLOAD + 1, the last two
    // also sent inline.
    assert_eq!(n("in_pieces"), 5, "EAGER_PAYLOAD - 1 and up went in pieces");
}

/// Ranks whose eager buffers differ: the fabric does not open.
async fn mismatch() {
    match Fabric::from_env().await {
        Ok(_) => println!("opened"),
        Err(e) => println!("refused={e}"),
    }
}

#[test]
fn rdma_ranks_that_disagree_on_eager_buffers_are_refused_at_start() {
    need_rdma!();
    // Rank 1 alone posts smaller buffers: each rank's sender would
    // overrun the other's (or waste its room), so neither opens.
    let wrap = |r: u32| -> Vec<String> {
        if r == 1 {
            vec!["env".into(), "BTL_RDMA_EAGER=8224".into()]
        } else {
            Vec::new()
        }
    };
    let env: Vec<(&str, &str)> = RDMA.to_vec();
    let outs = spawn_job_wrapped(2, "mismatch", &env, &wrap).wait(Duration::from_secs(60));
    assert_ok(&outs);
    for (r, out) in outs.iter().enumerate() {
        let why = value(out, "refused")
            .unwrap_or_else(|| panic!("rank {r} opened: {}", String::from_utf8_lossy(&out.stdout)));
        assert!(
            why.contains("BTL_RDMA_EAGER") && why.contains("8224") && why.contains("16416"),
            "rank {r}: {why}"
        );
    }
}

#[test]
fn rdma_small_messages_land_in_lent_buffers_and_buffers_of_their_own() {
    need_rdma!();
    assert_ok(&job(2, "lend", &[]).wait(Duration::from_secs(60)));
}

#[test]
fn rdma_per_tag_order() {
    need_rdma!();
    assert_ok(&job(2, "order", &[]).wait(Duration::from_secs(180)));
}

#[test]
fn rdma_four_processes_all_to_all() {
    need_rdma!();
    assert_ok(&job(4, "alltoall", &[]).wait(Duration::from_secs(180)));
}

#[test]
fn rdma_put_get_by_rdma_write_and_read_with_bounds_and_forged_keys() {
    need_rdma!();
    let outs = job(2, "putget", &[]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let writes: u64 = value(&outs[0], "rdma_writes").unwrap().parse().unwrap();
    let reads: u64 = value(&outs[0], "rdma_reads").unwrap().parse().unwrap();
    assert!(writes >= 2 && reads >= 2, "writes {writes}, reads {reads}");
}

#[test]
fn rdma_forged_keys_fail_at_the_initiator_while_the_target_serves_others() {
    need_rdma!();
    assert_ok(&job(3, "serve3", &[]).wait(Duration::from_secs(120)));
}

/// A hardware provider, where this host has one (`verbs;ofi_rxm` on an
/// InfiniBand, RoCE or iWARP device, or `efa`): its name, or why not.
fn hardware_provider() -> Result<&'static str, String> {
    for p in ["verbs;ofi_rxm", "efa"] {
        let out = std::process::Command::new("fi_info")
            .args(["-p", p, "-t", "FI_EP_RDM"])
            .output();
        if out.is_ok_and(|o| o.status.success()) {
            return Ok(p);
        }
    }
    Err("no RDMA device here (fi_info finds neither verbs;ofi_rxm nor efa)".into())
}

#[test]
fn rdma_hardware_providers_run_the_suite_where_a_device_exists() {
    need_rdma!();
    let prov = match hardware_provider() {
        Ok(p) => p,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    // The provider binds its device's address (no BTL_RDMA_ADDR).
    for scenario in ["sizes", "putget", "order"] {
        let env = [
            ("BTL_TRANSPORTS", "rdma"),
            ("BTL_RDMA_PROVIDER", prov),
            ("BTL_RDMA_PEER_TIMEOUT_MS", "2000"),
            ("ORDER_N", "20000"),
        ];
        assert_ok(&spawn_job(2, scenario, &env).wait(Duration::from_secs(120)));
    }
}

#[test]
fn rdma_four_ranks_fetch_add_and_a_cas_lock() {
    need_rdma!();
    let env = [("BTL_TEST_ADDS", "5000"), ("BTL_TEST_LOCKED", "200")];
    let outs = job(4, "atomics", &env).wait(Duration::from_secs(180));
    assert_ok(&outs);
    assert_eq!(value(&outs[0], "atomics_ok").as_deref(), Some("1"));
}

#[test]
fn rdma_idle_ranks_sleep_on_the_completion_queue() {
    need_rdma!();
    let outs = job(2, "idle", &[]).wait(Duration::from_secs(60));
    assert_ok(&outs);
    for (r, o) in outs.iter().enumerate() {
        let ms: u64 = value(o, "idle_cpu_ms").unwrap().parse().unwrap();
        println!("rank {r}: {ms} ms of CPU in 2 s idle");
        // Adaptive spinning after the last work, keepalives and the
        // heartbeat cost a few ms; a spinning task would use ~2000.
        assert!(ms < 500, "rank {r} used {ms} ms of CPU in 2 s of idleness");
    }
}

#[test]
fn rdma_a_rank_that_only_writes_keeps_its_peer_hearing_from_it() {
    need_rdma!();
    let outs = job(2, "one_sided", &[]).wait(Duration::from_secs(60));
    assert_ok(&outs);
    let puts: u64 = value(&outs[0], "puts").unwrap().parse().unwrap();
    let messages: u32 = value(&outs[1], "messages").unwrap().parse().unwrap();
    assert!(puts > 0 && messages > 20, "puts={puts} messages={messages}");
}

#[test]
fn rdma_parked_progress_is_woken_by_the_fd_after_a_stream() {
    need_rdma!();
    // A missed wake-up would wait for the heartbeat (the parked task's
    // timer): 0.8 s here, with a peer timeout to match.
    // The progress tasks spin 100 ms before they park, so that a stream
    // (slow in a debug build, on a loaded machine) keeps them from parking.
    let slow_beat = [
        ("BTL_HEARTBEAT_MS", "800"),
        ("BTL_RDMA_PEER_TIMEOUT_MS", "10000"),
        ("BTL_SPIN_US", "100000"),
    ];
    let outs = job(2, "wake", &slow_beat).wait(Duration::from_secs(60));
    assert_ok(&outs);
    for (r, o) in outs.iter().enumerate() {
        let unwatches: u64 = value(o, "cq_unwatches").unwrap().parse().unwrap();
        println!("rank {r}: the fd unwatched {unwatches} times");
        assert!(unwatches > 0, "rank {r}: no stream stopped the fd's watch");
        for round in 0..2 {
            let ms: u64 = value(o, &format!("wake_ms_{round}"))
                .unwrap()
                .parse()
                .unwrap();
            println!("rank {r}, round {round}: a round trip to a parked peer in {ms} ms");
            // Woken by the fd, it takes a few milliseconds at most.
            assert!(ms < 350, "rank {r}: the round trip took {ms} ms");
        }
    }
}

#[test]
fn rdma_frames_held_for_room_are_delivered_while_another_peer_streams() {
    need_rdma!();
    // Tag budgets of 4 KiB: rank 1's messages wait in rank 0 for room.
    // Pings every 5 s: a held frame delivered only when its sender is
    // heard from again would wait that long.
    // A frame per message (no bundles): rank 1 runs out of credits.
    let env = [
        ("BTL_RECV_BUDGET", "4096"),
        ("BTL_RDMA_PEER_TIMEOUT_MS", "20000"),
        ("BTL_RDMA_BUNDLE", "0"),
    ];
    let outs = job(3, "held", &env).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let ms: u64 = value(&outs[0], "held_ms").unwrap().parse().unwrap();
    let streamed: u64 = value(&outs[0], "streamed").unwrap().parse().unwrap();
    println!("rank 0 took the held messages in {ms} ms, beside {streamed} streamed ones");
    assert!(streamed > 0, "rank 2 streamed nothing");
    // Rank 1 ran out of credits: its frames did wait in rank 0.
    let waits: u64 = value(&outs[1], "credit_waits").unwrap().parse().unwrap();
    assert!(waits > 0, "rank 1 never waited for credits");
    // Delivered as room is made, it takes milliseconds; one wait for the
    // sender's ping is 5 s.
    assert!(ms < 3000, "taking the held messages took {ms} ms");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(value(o, "peers_lost").as_deref(), Some("0"), "rank {r}");
    }
}

#[test]
fn rdma_room_made_by_a_receiver_lets_held_frames_through_at_once() {
    need_rdma!();
    // Tag budgets of 4 KiB hold rank 1's messages in rank 0; nothing else
    // moves. Progress never parks (a 100 s spin), peers are checked once a
    // second and ping only every 15 s: held frames that waited for a
    // completion, a park, a check or a ping before going through would
    // wait for rank 1's ping (15 s), where room made lets them through in
    // milliseconds.
    // A frame per message (no bundles): rank 1 runs out of credits.
    let env = [
        ("BTL_RDMA_BUNDLE", "0"),
        ("BTL_RECV_BUDGET", "4096"),
        ("BTL_SPIN_US", "100000000"),
        ("BTL_HEARTBEAT_MS", "1000"),
        ("BTL_RDMA_PEER_TIMEOUT_MS", "60000"),
    ];
    let outs = job(2, "held_alone", &env).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let ms: u64 = value(&outs[0], "held_ms").unwrap().parse().unwrap();
    println!("rank 0 took the held messages in {ms} ms");
    let waits: u64 = value(&outs[1], "credit_waits").unwrap().parse().unwrap();
    assert!(waits > 0, "rank 1 never waited for credits");
    assert!(ms < 5_000, "taking the held messages took {ms} ms");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(value(o, "peers_lost").as_deref(), Some("0"), "rank {r}");
    }
}

#[test]
fn rdma_small_messages_go_in_bundles_in_order_and_a_stalled_receiver_holds_them_back() {
    need_rdma!();
    // A 64 KiB tag budget: what rank 1 does not read stops at its budget,
    // the frames rank 0's credits let through, and one open bundle.
    let budget = [("BTL_RECV_BUDGET", "65536")];
    let outs = job(2, "bundle", &budget).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let n = |o: &std::process::Output, k: &str| -> u64 { value(o, k).unwrap().parse().unwrap() };
    let (bundles, bundled) = (n(&outs[0], "bundles"), n(&outs[0], "bundled"));
    println!("rank 0 sent {bundled} messages in {bundles} bundles");
    assert!(bundles > 0, "no bundle was sent");
    assert!(
        bundled >= 2 * bundles,
        "bundles of fewer than two messages on average: {bundled} in {bundles}"
    );
    // 64 KiB of 512-byte messages queued (each counts 64 B more), 128
    // frames held for room, each a bundle of at most 31, and one open
    // bundle: about 4100 sends. Without flow control, all 50 000.
    let before = n(&outs[0], "sent_before_read");
    println!("rank 0 completed {before} of {STALLED_N} sends to a receiver not reading");
    assert!(
        before < 10_000,
        "{before} sends completed while the receiver did not read"
    );
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(value(o, "peers_lost").as_deref(), Some("0"), "rank {r}");
    }
    // Off, every message is a frame of its own, and all still arrive.
    let env = [budget[0], ("BTL_RDMA_BUNDLE", "0")];
    let outs = job(2, "bundle", &env).wait(Duration::from_secs(120));
    assert_ok(&outs);
    assert_eq!(n(&outs[0], "bundles"), 0, "bundled with BTL_RDMA_BUNDLE=0");
    let before = n(&outs[0], "sent_before_read");
    assert!(
        before < 10_000,
        "{before} sends completed while the receiver did not read"
    );
}

#[test]
fn rdma_a_rank_that_computes_past_the_peer_timeout_is_not_lost() {
    need_rdma!();
    // Rank 0 on a current-thread runtime: its blocking loop starves the
    // progress task; the liveness thread reads what waits in the
    // completion queue (rank 1's pings) and pings rank 1.
    let outs = job(2, "compute", &[("BTL_TEST_CURRENT_THREAD", "1")]).wait(Duration::from_secs(60));
    assert_ok(&outs);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(value(o, "peers_lost").as_deref(), Some("0"), "rank {r}");
    }
}

#[test]
fn rdma_stalled_receiver_holds_the_sender_back_without_false_loss() {
    need_rdma!();
    let outs = job(2, "stall", &[("BTL_RECV_BUDGET", "4194304")]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let before: u64 = value(&outs[0], "rss_before_kib").unwrap().parse().unwrap();
    let peak: u64 = value(&outs[0], "rss_peak_kib").unwrap().parse().unwrap();
    assert!(
        peak < before + 48 * 1024,
        "sender RSS grew from {before} KiB to {peak} KiB"
    );
    // The receiver held at most its tag budget, its read-ahead and its
    // credits' eager buffers of the 120 MiB sent while it slept.
    let before: u64 = value(&outs[1], "rx_rss_before_kib")
        .unwrap()
        .parse()
        .unwrap();
    let peak: u64 = value(&outs[1], "rx_rss_peak_kib").unwrap().parse().unwrap();
    assert!(
        peak < before + 48 * 1024,
        "receiver RSS grew from {before} KiB to {peak} KiB"
    );
}

#[test]
fn rdma_killed_peer_fails_pending_futures_within_the_timeout() {
    need_rdma!();
    let (took, _) = kill_rank1_when_armed(job(2, "kill", &[("BTL_RECV_BUDGET", "4194304")]));
    // Timeout 1 s, checked on the heartbeat (100 ms): slack for a loaded
    // machine, far below the 5 s default.
    assert!(took < 2500, "peer loss took {took} ms");
}

#[test]
fn linking_libfabric_leaves_the_programs_signal_handling_alone() {
    need_rdma!();
    // Some libfabric builds link libinfinipath, which takes over SIGINT,
    // SIGTERM, SIGSEGV and others when loaded (ending the process with
    // code 1): this test binary links it through the `rdma` feature, and
    // must still have the default actions the harness started with.
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGABRT, libc::SIGILL] {
        // SAFETY: reading the current action into a zeroed struct; no
        // handler is installed.
        let handler = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut sa), 0);
            sa.sa_sigaction
        };
        assert_eq!(handler, libc::SIG_DFL, "signal {sig} has a handler");
    }
}

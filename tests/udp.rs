//! The `udp` transport between real processes on loopback, forced with
//! `BTL_TRANSPORTS=udp` (each test re-executes this binary as the ranks).
//! Tests named `udp_v6_*` run over `::1`; where this host has no IPv6
//! loopback they print `skipped:` and why, and return.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use async_btl::udp::proto;
use async_btl::{Error, Fabric, RemoteKey};
use common::*;

/// Launch variables of every udp test: udp only, on loopback, with a short
/// peer timeout.
const UDP: [(&str, &str); 3] = [
    ("BTL_TRANSPORTS", "udp"),
    ("BTL_UDP_ADDR", "127.0.0.1"),
    ("BTL_UDP_PEER_TIMEOUT_MS", "1000"),
];

fn job(n: u32, scenario: &str, extra: &[(&str, &str)]) -> Job {
    let env: Vec<(&str, &str)> = UDP.iter().chain(extra).copied().collect();
    spawn_job(n, scenario, &env)
}

/// Like [`job`], over IPv6 loopback (`BTL_UDP_ADDR=::1`).
fn job6(n: u32, scenario: &str, extra: &[(&str, &str)]) -> Job {
    let env: Vec<(&str, &str)> = UDP
        .iter()
        .map(|&(k, v)| {
            if k == "BTL_UDP_ADDR" {
                (k, "::1")
            } else {
                (k, v)
            }
        })
        .chain(extra.iter().copied())
        .collect();
    spawn_job(n, scenario, &env)
}

/// Why this host cannot run the IPv6 tests, if it cannot: IPv6 disabled
/// on loopback, or `::1` not bindable (no IPv6 stack, EADDRNOTAVAIL).
fn no_ipv6() -> Option<String> {
    let knob = "/proc/sys/net/ipv6/conf/lo/disable_ipv6";
    match std::fs::read_to_string(knob) {
        Ok(v) if v.trim() == "1" => return Some(format!("IPv6 is disabled on lo ({knob} = 1)")),
        Ok(_) => {}
        Err(e) => return Some(format!("no IPv6 on this host ({knob}: {e})")),
    }
    match std::net::UdpSocket::bind("[::1]:0") {
        Ok(_) => None,
        Err(e) => Some(format!("cannot bind a UDP socket on [::1]:0: {e}")),
    }
}

/// Skip (with the reason printed) where there is no IPv6 loopback.
macro_rules! need_ipv6 {
    () => {
        if let Some(why) = no_ipv6() {
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
        if scenario == "mixed" {
            return mixed().await;
        }
        let f = Fabric::from_env().await.expect("fabric from launcher env");
        for r in (0..f.size()).filter(|r| *r != f.rank()) {
            assert_eq!(f.transport_for(r), Some("udp"));
        }
        match scenario.as_str() {
            "sizes" => sizes(f).await,
            "order" => order(f).await,
            "alltoall" => alltoall(f).await,
            "putget" => putget(f).await,
            "atomics" => {
                let n = |k: &str| std::env::var(k).unwrap().parse().unwrap();
                atomics_scenario(f, n("BTL_TEST_ADDS"), n("BTL_TEST_LOCKED")).await
            }
            "stall" => stall(f).await,
            "kill" => kill(f).await,
            "foreign" => foreign(f).await,
            "stopped" => stopped(f).await,
            "v6sizes" => v6sizes(f).await,
            "bursts" => bursts(f).await,
            "dropped" => dropped(f).await,
            "compute" => compute_scenario(f).await,
            other => panic!("unknown scenario {other}"),
        }
    });
}

/// Around the frame split (32 KiB), one datagram's payload (65507 - 72),
/// the send budget (4 MiB) and beyond.
const SIZES: [usize; 14] = [
    0,
    1,
    8,
    1000,
    32 * 1024 - 1,
    32 * 1024,
    65_435 - 9,
    65_435 - 8,
    65_436,
    1 << 20,
    (4 << 20) + 1,
    9_999_991,
    16 << 20,
    3,
];

async fn sizes(f: Fabric) {
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        send_sizes(&ep, 3, &SIZES, &[0, 1, 100, 4072, 40_000]).await;
    } else {
        expect_sizes(&f, 0, 3, &SIZES, &[0, 1, 100, 4072, 40_000]).await;
        let st = f.udp_stats(0).unwrap();
        println!("udp_stats={st}");
    }
    let st = f.stats();
    println!("gso_sends={}", st.udp.gso_sends);
    println!("gro_receives={}", st.udp.gro_receives);
    f.close().await.unwrap();
}

async fn order(f: Fabric) {
    let n: u64 = std::env::var("ORDER_N").map_or(20_000, |v| v.parse().unwrap());
    order_check(&f, n).await;
    if f.rank() == 1 {
        println!("udp_stats={}", f.udp_stats(0).unwrap());
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

async fn alltoall(f: Fabric) {
    all_to_all_check(&f, 500, |i| (i as usize * 337) % 70_000).await;
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Where the large puts of [`large_puts`] end in the 2 MiB region.
const BIG_PUTS_END: usize = 1_800_000;

/// Puts larger than one request part (256 KiB) into a 2 MiB region: by
/// future and implicit, content-checked by gets; and one whose first part
/// lies inside the region but the rest not (a key forged to claim more):
/// refused whole.
async fn large_puts(f: &Fabric, ep: &async_btl::Endpoint, big: &RemoteKey) {
    let a = f.register(pattern(1_100_000, 3).to_vec());
    ep.put(&a, 0..1_100_000, big, 1000).await.unwrap();
    let b = f.register(pattern(600_000, 4).to_vec());
    ep.put_nbi(&b, 0..600_000, big, 1_200_000).unwrap();
    ep.flush().await.unwrap();
    let back = f.register(vec![0u8; 1_100_000]);
    ep.get(&back, 0..1_100_000, big, 1000).await.unwrap();
    assert!(back.to_vec() == pattern(1_100_000, 3).to_vec(), "large put");
    ep.get(&back, 0..600_000, big, 1_200_000).await.unwrap();
    assert!(
        back.to_vec()[..600_000] == pattern(600_000, 4)[..],
        "large put_nbi"
    );
    let mut claim = big.to_bytes();
    claim.truncate(17);
    claim.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f, 0x00]);
    let forged = RemoteKey::from_bytes(&claim).unwrap();
    // Its first part (256 KiB) lies inside the region and covers
    // BIG_PUTS_END, which the target checks stays untouched.
    let at = (2 << 20) - 300_000;
    let e = ep.put(&b, 0..600_000, &forged, at).await.unwrap_err();
    assert!(matches!(e, Error::Access(_)), "{e}");
    ep.put_nbi(&b, 0..600_000, &forged, at).unwrap();
    let e = ep.flush().await.unwrap_err();
    assert!(matches!(e, Error::Access(_)), "{e}");
    // Large gets go as parts too: implicit, then one whose first part is
    // inside the region and the rest not, refused once (by its future,
    // not again by the next flush).
    let back2 = f.register(vec![0u8; 600_000]);
    ep.get_nbi(&back2, 0..600_000, big, 1_200_000).unwrap();
    ep.flush().await.unwrap();
    assert!(
        back2.to_vec() == pattern(600_000, 4).to_vec(),
        "large get_nbi"
    );
    let e = ep.get(&back2, 0..600_000, &forged, at).await.unwrap_err();
    // The refusal names the whole get's range, not its last part's.
    match e {
        Error::Access(async_btl::AccessError::OutOfBounds { offset, end, len }) => {
            assert_eq!((offset, end), (at, at + 600_000), "refused range");
            assert_eq!(len, 2 << 20, "the region's real length");
        }
        other => panic!("forged get: {other}"),
    }
    ep.flush().await.expect("a refused get is reported once");
}

async fn putget(f: Fabric) {
    if f.rank() == 1 {
        let heap = f.register(vec![0u8; 1 << 20]);
        let big = f.register(vec![0u8; 2 << 20]);
        let ep = f.endpoint(0).unwrap();
        ep.send(1, heap.remote_key().to_bytes()).await.unwrap();
        ep.send(1, big.remote_key().to_bytes()).await.unwrap();
        f.barrier().await.unwrap(); // rank 0 is done
                                    // The large put refused as a whole wrote none of its parts.
        assert!(big.to_vec()[BIG_PUTS_END..].iter().all(|b| *b == 0));
        let mut got = vec![0u8; 200_000];
        heap.read(12345, &mut got).unwrap();
        assert_eq!(
            got,
            pattern(200_000, 1).to_vec(),
            "put into the registered region"
        );
        assert!(heap.to_vec()[(1 << 20) - 64..].iter().all(|b| *b == 0));
        println!("refused={}", f.stats().access_refused);
    } else {
        let mut rx = f.receiver(1).unwrap();
        let heap = RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
        let big = RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
        let ep = f.endpoint(1).unwrap();
        large_puts(&f, &ep, &big).await;
        let src = f.register(pattern(200_000, 1).to_vec());
        ep.put(&src, 0..200_000, &heap, 12345).await.unwrap();
        let back = f.register(vec![0u8; 200_000]);
        ep.get(&back, 0..200_000, &heap, 12345).await.unwrap();
        assert_eq!(back.to_vec(), pattern(200_000, 1).to_vec());
        ep.flush().await.unwrap();
        let e = ep
            .put(&src, 0..64, &heap, (1 << 20) - 10)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
        assert_forged_keys_refused(&ep, &src, &back, &heap, 1 << 20).await;
        assert_implicit_ops(&f, &ep, &heap, 500_000).await;
        // A lone put's request leaves at its future's first poll: it does
        // not wait in a bundle for the task to come back (which let the
        // progress task take the core first: a lone `put(..).await` took
        // 3-4 times its round trip).
        let before = f.udp_stats(1).unwrap().messages_sent;
        let mut put = ep.put(&src, 0..64, &heap, 600_000);
        let first = futures::poll!(&mut put);
        let after = f.udp_stats(1).unwrap().messages_sent;
        assert_eq!(after, before + 1, "the request went to the protocol");
        if first.is_pending() {
            put.await.unwrap();
        }
        let s = f.stats();
        println!(
            "direct_puts={}\nemulated_puts={}",
            s.direct_puts, s.emulated_puts
        );
        f.barrier().await.unwrap();
    }
    f.close().await.unwrap();
}

/// Bursts of small sends and of small puts: everything arrives whole and in
/// order (puts: at their offsets), and the bursts travel in bundles (the
/// sender's protocol messages are far fewer than its sends and puts).
async fn bursts(f: Fabric) {
    const SENDS: usize = 20_000;
    const PUTS: usize = 2_000;
    /// Puts whose futures are dropped (half after one poll), then flushed.
    const DROPPED: usize = 200;
    const SLOT: usize = 64;
    let msg = |i: usize| pattern(i % 300, i as u64);
    if f.rank() == 1 {
        let target = f.register(vec![0u8; (PUTS + DROPPED) * SLOT]);
        let ep = f.endpoint(0).unwrap();
        ep.send(1, target.remote_key().to_bytes()).await.unwrap();
        let mut rx = f.receiver(2).unwrap();
        for i in 0..SENDS {
            let m = rx.recv().await.unwrap();
            assert_eq!(m.data, msg(i), "message {i} whole and in order");
        }
        f.barrier().await.unwrap(); // rank 0's puts are done
        for i in 0..PUTS + DROPPED {
            let mut got = vec![0u8; SLOT];
            target.read(i * SLOT, &mut got).unwrap();
            let len = 1 + i % SLOT;
            assert_eq!(&got[..len], &pattern(len, i as u64)[..], "put {i}");
            assert!(
                got[len..].iter().all(|b| *b == 0),
                "put {i} stayed in bounds"
            );
        }
    } else {
        let mut rx = f.receiver(1).unwrap();
        let target = RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
        let ep = f.endpoint(1).unwrap();
        for i in 0..SENDS {
            ep.send(2, msg(i)).await.unwrap();
        }
        let sent_before_puts = f.udp_stats(1).unwrap().messages_sent;
        let src = f.register(
            (0..PUTS + DROPPED)
                .flat_map(|i| pattern(SLOT, i as u64))
                .collect::<Vec<u8>>(),
        );
        for window in (0..PUTS).collect::<Vec<_>>().chunks(100) {
            let puts = window.iter().map(|&i| {
                let len = 1 + i % SLOT;
                ep.put(&src, i * SLOT..i * SLOT + len, &target, (i * SLOT) as u64)
            });
            futures::future::try_join_all(puts).await.unwrap();
        }
        ep.flush().await.unwrap();
        // MPI style: start puts, keep no future, flush.
        for i in PUTS..PUTS + DROPPED {
            let len = 1 + i % SLOT;
            let mut put = ep.put(&src, i * SLOT..i * SLOT + len, &target, (i * SLOT) as u64);
            if i % 2 == 0 {
                // (Its content is checked at the target.)
                let _ = futures::poll!(&mut put);
            }
        }
        ep.flush().await.unwrap();
        let s = f.udp_stats(1).unwrap();
        println!("send_messages={sent_before_puts}");
        println!("put_messages={}", s.messages_sent - sent_before_puts);
        f.barrier().await.unwrap();
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// The receiver does not read for three peer timeouts: the sender must wait
/// (bounded memory), not declare it lost, then everything arrives.
async fn stall(f: Fabric) {
    stall_scenario(&f, 120, Duration::from_secs(3)).await;
    assert_eq!(f.stats().peers_lost, 0);
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

async fn kill(f: Fabric) {
    // One connection per pair: the get waits behind the blocked sends.
    kill_scenario(f, false).await;
}

/// Messages rank 0 sends in `stopped`, one every 20 ms.
const TICKS: u64 = 220;

/// Rank 0 stops rank 1 (SIGSTOP) for three of rank 1's peer timeouts,
/// fills rank 1's sockets with foreign datagrams, and keeps sending small
/// messages behind them. When rank 1 runs again, rank 0's datagrams are
/// queued in its sockets, fresh but behind more datagrams than one progress
/// call reads: rank 1 must read them before it calls rank 0 silent.
async fn stopped(f: Fabric) {
    if f.rank() == 1 {
        let (data, prio) = f.udp_addrs().unwrap();
        let ep = f.endpoint(0).unwrap();
        let me = format!("{} {data} {prio}", std::process::id());
        ep.send(1, me.into_bytes()).await.unwrap();
        let mut ticks = f.receiver(2).unwrap();
        for i in 0..TICKS {
            let m = ticks.recv().await.expect("rank 0 was declared lost");
            assert_eq!(m.data, pattern(8, i));
        }
        println!("peers_lost={}", f.stats().peers_lost);
    } else {
        let mut rx = f.receiver(1).unwrap();
        let m = rx.recv().await.unwrap();
        let text = String::from_utf8(m.data.to_vec()).unwrap();
        let mut words = text.split(' ');
        let pid: i32 = words.next().unwrap().parse().unwrap();
        let addrs: Vec<&str> = words.collect();
        let ep = f.endpoint(1).unwrap();
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for i in 0..TICKS {
            if i == 10 {
                // SAFETY: kill only sends a signal to the pid rank 1 gave us.
                assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
                // More than one progress call reads, on both sockets.
                for addr in &addrs {
                    for _ in 0..1000 {
                        sock.send_to(b"not ours", addr).unwrap();
                    }
                }
            }
            if i == 160 {
                // SAFETY: as above.
                assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
            }
            ep.send(2, pattern(8, i)).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Datagrams that are not ours reach rank 1's ports: garbage, and a
/// well-formed datagram with another job's id. They are counted and
/// dropped; the job carries on.
async fn foreign(f: Fabric) {
    if f.rank() == 1 {
        let (data, prio) = f.udp_addrs().unwrap();
        let ep = f.endpoint(0).unwrap();
        ep.send(1, format!("{data} {prio}").into_bytes())
            .await
            .unwrap();
        let mut rx = f.receiver(2).unwrap();
        for i in 0..100u64 {
            assert_eq!(rx.recv().await.unwrap().data, pattern(5000, i));
        }
        let s = f.stats();
        println!("foreign={}", s.udp.foreign_datagrams);
        assert!(s.udp.foreign_datagrams >= 4, "{s:?}");
        assert_eq!(s.peers_lost, 0);
    } else {
        let mut rx = f.receiver(1).unwrap();
        let m = rx.recv().await.unwrap();
        let text = String::from_utf8(m.data.to_vec()).unwrap();
        let addrs: Vec<SocketAddr> = text.split(' ').map(|a| a.parse().unwrap()).collect();
        // On the ranks' own address (127.0.0.1 or ::1), another port: only
        // the port tells this sender from rank 0.
        let sock = std::net::UdpSocket::bind(SocketAddr::new(addrs[0].ip(), 0)).unwrap();
        let ep = f.endpoint(1).unwrap();
        for addr in addrs {
            sock.send_to(b"definitely not a datagram of ours", addr)
                .unwrap();
            let h = proto::Header {
                job: 0x0bad_0bad,
                src: 0,
                dst: 1,
                flags: proto::Flags::NONE,
                seq: 1,
                ack: 1,
                kind: proto::Kind::Ack(proto::Sack::EMPTY),
            };
            let mut buf = Vec::new();
            h.encode(&[], &mut buf);
            sock.send_to(&buf, addr).unwrap();
        }
        for i in 0..100u64 {
            ep.send(2, pattern(5000, i)).await.unwrap();
        }
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Over `::1`: the datagram size is loopback's MTU less 48 bytes of IPv6
/// and UDP headers; messages of 0 and 1 bytes, around one datagram's
/// payload, and of several datagrams (1 MiB, past the send budget) arrive
/// whole and in order.
async fn v6sizes(f: Fabric) {
    let peer = 1 - f.rank();
    let (data, prio) = f.udp_addrs().unwrap();
    assert_eq!(data.ip(), "::1".parse::<std::net::IpAddr>().unwrap());
    assert_eq!(prio.ip(), data.ip());
    let mtu: usize = std::fs::read_to_string("/sys/class/net/lo/mtu")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let dgram = f.udp_max_datagram(peer).unwrap();
    assert_eq!(dgram, (mtu - 48).clamp(512, 65_507), "lo MTU {mtu}");
    println!("max_datagram={dgram}");
    // One DATA datagram's payload: the datagram less the 72-byte header.
    let chunk = dgram - 72;
    let sizes = [
        0,
        1,
        8,
        1000,
        chunk - 1,
        chunk,
        chunk + 1,
        1 << 20,
        (4 << 20) + 1,
        3,
    ];
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        send_sizes(&ep, 3, &sizes, &[1, 0]).await;
    } else {
        expect_sizes(&f, 0, 3, &sizes, &[1, 0]).await;
        let st = f.udp_stats(0).unwrap();
        println!("udp_stats={st}");
        // At least one datagram per chunk of the multi-datagram ones.
        assert!(st.data_received as usize >= (1 << 20) / chunk + (4 << 20) / chunk);
    }
    f.barrier().await.unwrap();
    f.close().await.unwrap();
}

/// Rank 0 binds 127.0.0.1, rank 1 ::1: opening the fabric must fail on
/// both, at once, with a configuration error naming both addresses.
async fn mixed() {
    let start = std::time::Instant::now();
    match Fabric::from_env().await {
        Ok(_) => panic!("a job mixing IPv4 and IPv6 udp addresses opened"),
        Err(e) => {
            assert!(matches!(e, Error::Config(_)), "{e:?}");
            println!("error={e}");
            println!("open_ms={}", start.elapsed().as_millis());
        }
    }
}

/// Rank 1 drops its fabric without closing it (its process lives on);
/// rank 0's put and get to it, started after, must fail with `PeerLost`
/// well before the peer timeout (20 s here), and name the cause.
async fn dropped(f: Fabric) {
    if f.rank() == 1 {
        let region = f.register(vec![0u8; 4096]);
        let ep = f.endpoint(0).unwrap();
        ep.send(1, region.remote_key().to_bytes()).await.unwrap();
        let mut rx = f.receiver(2).unwrap();
        rx.recv().await.unwrap();
        drop(rx);
        drop(region);
        drop(f);
        tokio::time::sleep(Duration::from_secs(6)).await;
        return;
    }
    let mut rx = f.receiver(1).unwrap();
    let key = RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
    let ep = f.endpoint(1).unwrap();
    ep.send(2, bytes::Bytes::from_static(b"drop it"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let src = f.register(vec![7u8; 64]);
    let start = std::time::Instant::now();
    let e = tokio::time::timeout(Duration::from_secs(5), ep.put(&src, 0..64, &key, 0))
        .await
        .expect("the put waited for the peer timeout")
        .unwrap_err();
    assert!(e.is_peer_lost(), "put: {e}");
    assert!(e.to_string().contains("without closing"), "{e}");
    println!("dropped_ms={}", start.elapsed().as_millis());
}

#[test]
fn udp_operations_on_a_peer_that_dropped_its_fabric_fail_at_once() {
    let outs =
        job(2, "dropped", &[("BTL_UDP_PEER_TIMEOUT_MS", "20000")]).wait(Duration::from_secs(60));
    assert_ok(&outs);
}

#[test]
fn udp_sizes_between_processes() {
    let outs = job(2, "sizes", &[]).wait(Duration::from_secs(120));
    assert_ok(&outs);
}

#[test]
fn udp_sizes_over_a_1500_byte_path_go_out_in_gso_packets() {
    // Loopback with the datagrams of an Ethernet path (1472 bytes): runs of
    // them leave as GSO packets and arrive joined (GRO), where the kernel
    // has both; every size still arrives intact.
    let outs = job(2, "sizes", &[("BTL_UDP_MTU", "1500")]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let n = |outs: &[std::process::Output], r: usize, k: &str| -> u64 {
        value(&outs[r], k).unwrap().parse().unwrap()
    };
    let (gso, gro) = async_btl::info::Limits::from(&async_btl::Config::default()).udp_gso_kernel;
    let (sends, joined) = (n(&outs, 0, "gso_sends"), n(&outs, 1, "gro_receives"));
    println!("gso_sends={sends} gro_receives={joined}");
    if gso && gro {
        assert!(sends > 100, "{sends} GSO sends");
        assert!(joined > 100, "{joined} GRO receives");
    } else {
        println!("skipped the offload checks: this kernel has no UDP GSO/GRO");
    }
    // Switched off, every datagram goes alone.
    let outs = job(2, "sizes", &[("BTL_UDP_MTU", "1500"), ("BTL_UDP_GSO", "0")])
        .wait(Duration::from_secs(120));
    assert_ok(&outs);
    assert_eq!(n(&outs, 0, "gso_sends"), 0);
    assert_eq!(n(&outs, 1, "gro_receives"), 0);
}

#[test]
fn udp_bursts_of_small_sends_and_puts_travel_in_bundles() {
    let outs = job(2, "bursts", &[]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let n = |k: &str| -> u64 { value(&outs[0], k).unwrap().parse().unwrap() };
    // 20 000 sends and 2 000 puts (plus the key and barrier messages):
    // bundles carry several each.
    let (sends, puts) = (n("send_messages"), n("put_messages"));
    println!("protocol messages: {sends} for 20000 sends, {puts} for 2000 puts");
    assert!(
        sends < 20_000 / 2,
        "{sends} protocol messages for 20000 sends"
    );
    assert!(puts < 2_000 / 2, "{puts} protocol messages for 2000 puts");
}

#[test]
fn udp_bundling_off_sends_each_message_by_itself() {
    let outs = job(2, "bursts", &[("BTL_UDP_BUNDLE", "0")]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let n = |k: &str| -> u64 { value(&outs[0], k).unwrap().parse().unwrap() };
    // One protocol message per send and per put.
    assert!(n("send_messages") >= 20_000, "{}", n("send_messages"));
    assert!(n("put_messages") >= 2_200, "{}", n("put_messages"));
}

#[test]
fn udp_per_tag_order() {
    assert_ok(&job(2, "order", &[]).wait(Duration::from_secs(120)));
}

#[test]
fn udp_four_processes_all_to_all() {
    assert_ok(&job(4, "alltoall", &[]).wait(Duration::from_secs(120)));
}

#[test]
fn udp_four_ranks_fetch_add_and_a_cas_lock_emulated_at_the_target() {
    // Every atomic is a round trip through rank 0's progress over loopback
    // datagrams: fewer than the sm test's 100,000 per rank keeps it short.
    let env = [("BTL_TEST_ADDS", "20000"), ("BTL_TEST_LOCKED", "500")];
    let outs = job(4, "atomics", &env).wait(Duration::from_secs(180));
    assert_ok(&outs);
    assert_eq!(value(&outs[0], "atomics_ok").as_deref(), Some("1"));
    for out in &outs {
        assert_eq!(value(out, "native_atomics").as_deref(), Some("0"));
    }
}

#[test]
fn udp_put_get_emulated_with_bounds_and_forged_keys() {
    let outs = job(2, "putget", &[]).wait(Duration::from_secs(60));
    assert_ok(&outs);
    let refused: u64 = value(&outs[1], "refused").unwrap().parse().unwrap();
    assert!(refused >= 2, "target counted {refused} refusals");
    assert_eq!(value(&outs[0], "direct_puts").as_deref(), Some("0"));
}

#[test]
fn udp_a_rank_that_computes_past_the_peer_timeout_is_not_lost() {
    // Rank 0 on a current-thread runtime: its blocking loop starves the
    // progress task; the liveness thread drains what waits in its socket
    // (rank 1's keep-alives) and sends its own.
    let outs = job(2, "compute", &[("BTL_TEST_CURRENT_THREAD", "1")]).wait(Duration::from_secs(60));
    assert_ok(&outs);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(value(o, "peers_lost").as_deref(), Some("0"), "rank {r}");
    }
}

#[test]
fn udp_stalled_receiver_slows_sender_without_false_loss() {
    // The stall guard (no ACK progress) is set below the 3 s the receiver
    // sleeps: its keepalives must say it is busy, not gone.
    let extra = [
        ("BTL_RECV_BUDGET", "4194304"),
        ("BTL_UDP_STALL_TIMEOUT_MS", "1000"),
    ];
    let outs = job(2, "stall", &extra).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let before: u64 = value(&outs[0], "rss_before_kib").unwrap().parse().unwrap();
    let peak: u64 = value(&outs[0], "rss_peak_kib").unwrap().parse().unwrap();
    // 120 MiB were sent while the receiver slept; the sender may hold its
    // send budget and a window more, not the stream.
    assert!(
        peak < before + 48 * 1024,
        "sender RSS grew from {before} KiB to {peak} KiB"
    );
}

#[test]
fn udp_stopped_process_reads_queued_keepalives_before_declaring_loss() {
    // Rank 0 keeps a long timeout (so it does not lose rank 1 while rank 1
    // is stopped) and ticks every 20 ms, well within rank 1's 1 s timeout.
    let wrap = |r: u32| {
        if r == 0 {
            vec![
                "env".to_string(),
                "BTL_UDP_PEER_TIMEOUT_MS=20000".to_string(),
            ]
        } else {
            Vec::new()
        }
    };
    let env: Vec<(&str, &str)> = UDP.to_vec();
    let outs = spawn_job_wrapped(2, "stopped", &env, &wrap).wait(Duration::from_secs(60));
    assert_ok(&outs);
    assert_eq!(value(&outs[1], "peers_lost").as_deref(), Some("0"));
}

#[test]
fn udp_foreign_datagrams_are_dropped_and_counted() {
    assert_ok(&job(2, "foreign", &[]).wait(Duration::from_secs(60)));
}

#[test]
fn udp_killed_peer_fails_pending_futures_within_the_timeout() {
    let (took, _) = kill_rank1_when_armed(job(2, "kill", &[("BTL_RECV_BUDGET", "4194304")]));
    // Timeout 1 s; detection runs on the heartbeat (100 ms): allow slack
    // for a loaded machine, but far below the 5 s default.
    assert!(took < 2500, "peer loss took {took} ms");
}

#[test]
fn udp_v6_sizes_between_processes() {
    need_ipv6!();
    let outs = job6(2, "v6sizes", &[]).wait(Duration::from_secs(120));
    assert_ok(&outs);
    let want = value(&outs[0], "max_datagram").unwrap();
    println!("max_datagram over ::1: {want}");
    println!("{}", value(&outs[1], "udp_stats").unwrap_or_default());
    assert_eq!(value(&outs[1], "max_datagram"), Some(want));
}

#[test]
fn udp_v6_put_get_emulated_with_bounds_and_forged_keys() {
    need_ipv6!();
    let outs = job6(2, "putget", &[]).wait(Duration::from_secs(60));
    assert_ok(&outs);
    let refused: u64 = value(&outs[1], "refused").unwrap().parse().unwrap();
    assert!(refused >= 2, "target counted {refused} refusals");
}

#[test]
fn udp_v6_foreign_datagrams_are_dropped_and_counted() {
    need_ipv6!();
    let outs = job6(2, "foreign", &[]).wait(Duration::from_secs(60));
    assert_ok(&outs);
    let n: u64 = value(&outs[1], "foreign").unwrap().parse().unwrap();
    assert!(n >= 4, "{n} foreign datagrams counted");
    println!("foreign datagrams counted over ::1: {n}");
}

#[test]
fn udp_v6_mixed_families_fail_at_open_naming_both_addresses() {
    need_ipv6!();
    let wrap = |r: u32| {
        if r == 1 {
            vec!["env".to_string(), "BTL_UDP_ADDR=::1".to_string()]
        } else {
            Vec::new()
        }
    };
    let env: Vec<(&str, &str)> = UDP.to_vec();
    let start = std::time::Instant::now();
    let outs = spawn_job_wrapped(2, "mixed", &env, &wrap).wait(Duration::from_secs(60));
    assert_ok(&outs);
    // Well within the boot timeout: nobody waited for anybody.
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    for out in &outs {
        let e = value(out, "error").unwrap();
        for want in ["127.0.0.1", "::1", "IPv4", "IPv6", "one address family"] {
            assert!(e.contains(want), "{want:?} missing from: {e}");
        }
    }
    assert_eq!(value(&outs[0], "error"), value(&outs[1], "error"));
    println!(
        "both ranks: {}",
        value(&outs[0], "error").unwrap_or_default()
    );
}

//! A forger on the path of a `udp` job: it reads every datagram off the
//! loopback interface (an `AF_PACKET` socket) and, for each DATA datagram
//! rank 0 sends rank 1, sends a datagram of its own for the next sequence
//! number and message id, from rank 0's own address and port (a raw socket
//! writing its own IP header), ahead of the real one. Under the CRC the
//! forgery is taken and the real datagram then drops as a duplicate; under
//! `BTL_UDP_AUTH=mac` every forgery is refused and counted, and rank 1
//! gets exactly what rank 0 sent.
//!
//! Needs `CAP_NET_RAW` (root in CI); without it the tests print
//! `skipped:` and why.

mod common;

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_btl::udp::proto;
use async_btl::Fabric;
use common::*;

/// Messages rank 0 streams, and their length (one datagram each, on the
/// data channel).
const N: u64 = 300;
const LEN: usize = 600;

#[test]
fn rank_main() {
    let Ok(scenario) = std::env::var("BTL_TEST_SCENARIO") else {
        return; // the parent test process: nothing to do here
    };
    let rt = rank_runtime();
    rt.block_on(async {
        let f = Fabric::from_env().await.expect("fabric from launcher env");
        assert_eq!(f.transport_for(1 - f.rank()), Some("udp"));
        match scenario.as_str() {
            "stream" => stream(f).await,
            other => panic!("unknown scenario {other}"),
        }
    });
}

/// Rank 0 sends `N` messages a few milliseconds apart (time enough for the
/// forger to answer each); rank 1 checks each. Then rank 0 gets and puts
/// into a region of rank 1's. Under the MAC both complete and the job
/// closes normally. Under the CRC the forger has replaced the get request
/// too (it is the next datagram): the get must fail within the answer
/// timeout rather than wait forever, and the ranks just exit.
async fn stream(f: Fabric) {
    let mac = std::env::var("BTL_UDP_AUTH").as_deref() == Ok("mac");
    let peer = 1 - f.rank();
    let ep = f.endpoint(peer).unwrap();
    if f.rank() == 0 {
        for i in 0..N {
            ep.send(1, pattern(LEN, i)).await.unwrap();
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        let mut rx = f.receiver(2).unwrap();
        let key = async_btl::RemoteKey::from_bytes(&rx.recv().await.unwrap().data).unwrap();
        let back = f.register(vec![0u8; 4096]);
        let t = std::time::Instant::now();
        let get = ep.get(&back, 0..4096, &key, 0);
        let r = tokio::time::timeout(Duration::from_secs(30), get).await;
        println!("get_ms={}", t.elapsed().as_millis());
        match r {
            Err(_) => println!("get=hung"),
            Ok(Err(e)) => println!("get=failed: {e}"),
            Ok(Ok(())) => {
                assert!(back.to_vec() == pattern(4096, 77).to_vec(), "get content");
                println!("get=ok");
            }
        }
        if !mac {
            return;
        }
        let src = f.register(pattern(4096, 78).to_vec());
        let put = ep.put(&src, 0..4096, &key, 4096);
        tokio::time::timeout(Duration::from_secs(10), put)
            .await
            .expect("put answered")
            .unwrap();
        f.barrier().await.unwrap();
        f.barrier().await.unwrap();
    } else {
        let mut rx = f.receiver(1).unwrap();
        let mut corrupt = 0;
        for i in 0..N {
            let m = tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .expect("every message arrives")
                .unwrap();
            if m.data != pattern(LEN, i) {
                corrupt += 1;
            }
        }
        println!("corrupt={corrupt}");
        let mut mem = pattern(4096, 77).to_vec();
        mem.resize(8192, 0);
        let region = f.register(mem);
        ep.send(2, region.remote_key().to_bytes()).await.unwrap();
        if !mac {
            // Serve rank 0's get while it waits on it, then go.
            tokio::time::sleep(Duration::from_secs(8)).await;
            println!("bad_trailers={}", f.stats().udp.bad_trailers);
            return;
        }
        f.barrier().await.unwrap();
        println!("bad_trailers={}", f.stats().udp.bad_trailers);
        println!("udp_stats={}", f.udp_stats(0).unwrap());
        assert!(
            region.to_vec()[4096..] == pattern(4096, 78)[..],
            "put content"
        );
        f.barrier().await.unwrap();
    }
    f.close().await.unwrap();
}

/// A raw socket: `Err` with the reason when this process may not open one.
fn raw(domain: i32, ty: i32, proto: i32) -> Result<OwnedFd, String> {
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(domain, ty, proto) };
    if fd < 0 {
        return Err(format!(
            "cannot open a raw socket ({}): the forger needs CAP_NET_RAW",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The forger: sniffs loopback until `stop`, forging as described above.
/// Counts what it sent in `sent`.
struct Forger {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl Forger {
    fn start() -> Result<Forger, String> {
        let sniff = raw(
            libc::AF_PACKET,
            libc::SOCK_DGRAM,
            i32::from((libc::ETH_P_IP as u16).to_be()),
        )?;
        let inject = raw(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW)?;
        // SAFETY: a valid NUL-terminated name.
        let lo = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        // SAFETY: all-zero is a valid sockaddr_ll.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_IP as u16).to_be();
        sll.sll_ifindex = lo as i32;
        // SAFETY: `sll` is a sockaddr_ll of the size passed.
        let r = unsafe {
            libc::bind(
                sniff.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if r != 0 {
            return Err(format!(
                "cannot bind a packet socket to lo: {}",
                std::io::Error::last_os_error()
            ));
        }
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: a timeval of the size passed.
        unsafe {
            libc::setsockopt(
                sniff.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (s, n) = (stop.clone(), sent.clone());
        let thread = std::thread::spawn(move || forge_loop(&sniff, &inject, &s, &n));
        Ok(Forger { stop, sent, thread })
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
        self.sent.load(Ordering::Relaxed)
    }
}

fn forge_loop(sniff: &OwnedFd, inject: &OwnedFd, stop: &AtomicBool, sent: &AtomicU64) {
    let mut buf = vec![0u8; 70_000];
    let mut done = HashSet::new();
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(sniff.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n <= 0 {
            continue;
        }
        let pkt = &buf[..n as usize];
        let Some((sport, dport, d)) = udp_of(pkt) else {
            continue;
        };
        // A DATA datagram of a one-datagram message, src rank 0 → rank 1,
        // read at the fixed offsets of the wire format.
        if d.len() < proto::DATA_HEADER_LEN || &d[..4] != b"BTLu" || d[5] != 1 {
            continue;
        }
        let u64_at = |o: usize| u64::from_le_bytes(d[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(d[o..o + 4].try_into().unwrap());
        let (src, dst, seq, ack, len) =
            (u32_at(16), u32_at(20), u64_at(24), u64_at(32), u32_at(40));
        let (msg, off, total) = (u64_at(44), u64_at(52), u64_at(60));
        if src != 0 || dst != 1 || off != 0 || total != u64::from(len) || !done.insert(seq) {
            continue;
        }
        // The next datagram as rank 0 would send it, with a correct CRC:
        // the most a forger without the key can make. Its payload is this
        // one's (a well-formed frame of the message before) with its last
        // byte changed.
        let h = proto::Header {
            job: u64_at(8),
            src,
            dst,
            flags: proto::Flags::NONE,
            seq: seq + 1,
            ack,
            kind: proto::Kind::Data(proto::Chunk {
                msg_id: msg + 1,
                offset: 0,
                total_len: total,
            }),
        };
        let end = proto::DATA_HEADER_LEN + len as usize;
        let Some(real) = d.get(proto::DATA_HEADER_LEN..end) else {
            continue;
        };
        let mut payload = real.to_vec();
        if let Some(b) = payload.last_mut() {
            *b ^= 0x5a;
        }
        let mut forged = Vec::new();
        h.encode(&payload, &mut forged);
        if send_spoofed(inject, sport, dport, &forged) {
            sent.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The TTL of the forger's packets, which tells them from the ranks' (64)
/// when they come back past its own packet socket.
const FORGED_TTL: u8 = 61;

/// The UDP ports and payload of an IPv4 packet between two loopback
/// addresses, not one of the forger's own.
fn udp_of(pkt: &[u8]) -> Option<(u16, u16, &[u8])> {
    let ihl = usize::from(pkt.first()? & 0x0f) * 4;
    if pkt.len() < ihl + 8
        || pkt[8] == FORGED_TTL
        || pkt[9] != 17
        || pkt[12] != 127
        || pkt[16] != 127
    {
        return None;
    }
    let u = &pkt[ihl..];
    let sport = u16::from_be_bytes([u[0], u[1]]);
    let dport = u16::from_be_bytes([u[2], u[3]]);
    Some((sport, dport, &u[8..]))
}

/// Send `payload` from 127.0.0.1:`sport` to 127.0.0.1:`dport`, IP and UDP
/// headers written by hand (no UDP checksum, which IPv4 allows).
fn send_spoofed(inject: &OwnedFd, sport: u16, dport: u16, payload: &[u8]) -> bool {
    let total = 20 + 8 + payload.len();
    let mut p = Vec::with_capacity(total);
    p.extend_from_slice(&[0x45, 0, 0, 0, 0, 0, 0x40, 0, FORGED_TTL, 17, 0, 0]);
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p.extend_from_slice(&Ipv4Addr::LOCALHOST.octets());
    p.extend_from_slice(&Ipv4Addr::LOCALHOST.octets());
    let sum = ip_checksum(&p);
    p[10..12].copy_from_slice(&sum.to_be_bytes());
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(payload);
    // SAFETY: all-zero is a valid sockaddr_in.
    let mut to: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    to.sin_family = libc::AF_INET as u16;
    to.sin_addr.s_addr = u32::from(Ipv4Addr::LOCALHOST).to_be();
    // SAFETY: `p` is readable for its length; `to` is a sockaddr_in of the
    // size passed.
    let n = unsafe {
        libc::sendto(
            inject.as_raw_fd(),
            p.as_ptr().cast(),
            p.len(),
            0,
            (&to as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as u32,
        )
    };
    n == p.len() as isize
}

fn ip_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Runs the stream with the forger on the path under `auth`; returns rank
/// 1's output and how many forgeries were sent, or `None` (printed) where
/// the forger cannot run.
fn attacked(auth: &str) -> Option<(Vec<std::process::Output>, u64)> {
    // One job at a time: a forger sees every job on the interface.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let forger = match Forger::start() {
        Ok(f) => f,
        Err(why) => {
            println!("skipped: {why}");
            return None;
        }
    };
    let env = [
        ("BTL_TRANSPORTS", "udp"),
        ("BTL_UDP_ADDR", "127.0.0.1"),
        ("BTL_UDP_AUTH", auth),
        // Every message leaves by itself, as its own datagram.
        ("BTL_UDP_BUNDLE", "0"),
    ];
    let outs = spawn_job(2, "stream", &env).wait(Duration::from_secs(90));
    let sent = forger.finish();
    assert_ok(&outs);
    Some((outs, sent))
}

#[test]
fn udp_forged_datagrams_from_a_sighted_forger_are_refused_under_the_mac() {
    let Some((outs, sent)) = attacked("mac") else {
        return;
    };
    let out = &outs[1];
    assert_eq!(value(&outs[0], "get").as_deref(), Some("ok"));
    let corrupt: u64 = value(out, "corrupt").unwrap().parse().unwrap();
    let refused: u64 = value(out, "bad_trailers").unwrap().parse().unwrap();
    println!("forgeries sent {sent}, refused {refused}, messages altered {corrupt}");
    println!("{}", value(out, "udp_stats").unwrap_or_default());
    assert!(sent >= N / 2, "the forger sent only {sent} datagrams");
    assert_eq!(corrupt, 0, "forged data was delivered");
    assert!(refused >= sent / 2, "{refused} of {sent} forgeries counted");
}

#[test]
fn udp_forged_datagrams_from_a_sighted_forger_replace_data_under_a_crc_yet_nothing_hangs() {
    // The threat the MAC answers, shown: with a checksum only, the same
    // forger replaces rank 0's messages, and what follows them (the get
    // request, or its neighbours): the get may fail, by a forged request
    // the target refuses or by an answer that never comes (then within
    // the answer timeout, 5 s), but it never waits forever.
    let Some((outs, sent)) = attacked("crc") else {
        return;
    };
    let corrupt: u64 = value(&outs[1], "corrupt").map_or(0, |v| v.parse().unwrap());
    let get = value(&outs[0], "get").unwrap_or_default();
    let ms: u64 = value(&outs[0], "get_ms").map_or(0, |v| v.parse().unwrap());
    println!("forgeries sent {sent}, messages altered {corrupt}; get after {ms} ms: {get}");
    assert!(corrupt > 0, "no forged message was taken ({sent} sent)");
    assert!(!get.is_empty() && get != "hung", "the get: {get:?}");
    assert!(ms < 15_000, "the get ended after {ms} ms");
}

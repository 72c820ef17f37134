//! The `udp` transport over a real kernel path with real faults: two network
//! namespaces joined by a veth pair (10.77.0.1/24 and 10.77.0.2/24, or for
//! the IPv6 variant the unique-local fd00:77::1/64 and fd00:77::2/64, added
//! `nodad` so they are usable at once; all exist only inside them), each
//! rank in its own namespace, and `nft` rules in one namespace that drop,
//! duplicate or corrupt a fifth of the datagrams.
//! Needs root, `ip` and `nft`; without them each test prints why and skips.
//!
//! Corruption: nft rewrites one payload byte (`@th,…set`) and fixes the UDP
//! checksum, so the datagram reaches our CRC32C, which must reject it.

mod common;

use std::process::Command;
use std::time::Duration;

use async_btl::Fabric;
use bytes::Bytes;
use common::*;
use futures::StreamExt;

fn pattern(len: usize, seed: u64) -> Bytes {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2654435761).wrapping_add(seed) >> 7) as u8)
        .collect::<Vec<_>>()
        .into()
}

/// Messages per run (`NETNS_N`, set per test).
fn n() -> u64 {
    std::env::var("NETNS_N").map_or(100_000, |v| v.parse().unwrap())
}

/// The child side.
#[test]
fn rank_main() {
    let Ok(scenario) = std::env::var("BTL_TEST_SCENARIO") else {
        return;
    };
    let rt = rank_runtime();
    rt.block_on(async {
        let f = Fabric::from_env().await.expect("fabric from launcher env");
        assert_eq!(scenario, "stream");
        // Diagnostics for a slow or stuck run: the protocol counters.
        let diag = async {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                eprintln!("progress: {}", f.udp_stats(1 - f.rank()).unwrap());
            }
        };
        tokio::select! {
            _ = stream(&f) => {}
            _ = diag => {}
        }
        f.close().await.unwrap();
    });
}

/// Rank 0 sends N messages of varied sizes (some span two datagrams, one
/// in a thousand spans dozens: those leave as GSO packets where the kernel
/// has it, so the faults hit whole packets too) on two tags; rank 1 checks
/// content and per-tag order, which also proves each arrived once.
async fn stream(f: &Fabric) {
    let len = |i: u64| {
        if i % 1000 == 999 {
            60_000 + (i as usize % 7) * 10_000
        } else {
            8 + (i as usize * 131) % 2500
        }
    };
    let n = n();
    if f.rank() == 0 {
        let ep = f.endpoint(1).unwrap();
        for i in 0..n {
            let mut m = i.to_le_bytes().to_vec();
            m.extend_from_slice(&pattern(len(i) - 8, i));
            ep.send(10 + i % 2, m).await.unwrap();
        }
    } else {
        let (mut a, mut b) = (f.receiver(10).unwrap(), f.receiver(11).unwrap());
        let (mut na, mut nb) = (0u64, 1u64);
        let check = |m: async_btl::Message, want: u64| {
            let v = u64::from_le_bytes(m.data[..8].try_into().unwrap());
            assert_eq!(v, want, "tag {} out of order", m.tag);
            assert!(
                m.data[8..] == pattern(len(v) - 8, v),
                "message {v} corrupted"
            );
        };
        while na < n || nb < n {
            tokio::select! {
                m = a.next(), if na < n => { check(m.unwrap().unwrap(), na); na += 2; }
                m = b.next(), if nb < n => { check(m.unwrap().unwrap(), nb); nb += 2; }
            }
        }
        let s = f.udp_stats(0).unwrap();
        println!("stats={s}");
        println!("max_datagram={}", f.udp_max_datagram(0).unwrap());
        println!("checksum_errors={}", s.checksum_errors);
        println!("duplicates={}", s.duplicates_dropped);
        println!("resends_seen_by_sender=see rank 0");
        println!("gro_receives={}", f.stats().udp.gro_receives);
    }
    f.barrier().await.unwrap();
    if f.rank() == 0 {
        println!("stats={}", f.udp_stats(1).unwrap());
        println!("resends={}", f.udp_stats(1).unwrap().resends);
        println!("gso_sends={}", f.stats().udp.gso_sends);
        println!("gso_refusals={}", f.stats().udp.gso_refusals);
        println!("max_datagram={}", f.udp_max_datagram(1).unwrap());
    }
}

/// Two namespaces and a veth pair, removed on drop (even when a test fails).
struct Net {
    ns: [String; 2],
    /// The ranks' addresses, one per namespace.
    addrs: [&'static str; 2],
    /// The veth ends, one per namespace.
    devs: [String; 2],
}

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{:?} failed: {}",
            args,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl Net {
    /// Set up with IPv4 addresses, or say why not.
    fn new(tag: &str) -> Result<Net, String> {
        Net::with_addrs(tag, false)
    }

    /// Set up with IPv4 addresses, or IPv6 ones when `v6`, or say why not.
    fn with_addrs(tag: &str, v6: bool) -> Result<Net, String> {
        // SAFETY-free check for root: /proc/self/status Uid line.
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let root = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().nth(1))
            == Some("0");
        if !root {
            return Err("not root".into());
        }
        for tool in ["ip", "nft"] {
            if Command::new(tool).arg("-V").output().is_err() {
                return Err(format!(
                    "`{tool}` is not installed (apt-get install iproute2 nftables)"
                ));
            }
        }
        let id = format!("{}{}", tag, std::process::id() % 100_000);
        let addrs = if v6 {
            ["fd00:77::1", "fd00:77::2"]
        } else {
            ["10.77.0.1", "10.77.0.2"]
        };
        let (va, vb) = (format!("va{id}"), format!("vb{id}"));
        let net = Net {
            ns: [format!("abtl-{id}-a"), format!("abtl-{id}-b")],
            addrs,
            devs: [va.clone(), vb.clone()],
        };
        let [a, b] = &net.ns;
        sh(&["ip", "netns", "add", a])?;
        sh(&["ip", "netns", "add", b])?;
        sh(&[
            "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
        ])?;
        sh(&["ip", "link", "set", &va, "netns", a])?;
        sh(&["ip", "link", "set", &vb, "netns", b])?;
        for ((ns, dev), addr) in [(a, &va), (b, &vb)].into_iter().zip(addrs) {
            if v6 {
                // No duplicate address detection: usable at once (nothing
                // else is on this link).
                let cidr = format!("{addr}/64");
                sh(&["ip", "-n", ns, "addr", "add", &cidr, "dev", dev, "nodad"])?;
            } else {
                let cidr = format!("{addr}/24");
                sh(&["ip", "-n", ns, "addr", "add", &cidr, "dev", dev])?;
            }
        }
        for (ns, dev) in [(a, &va), (b, &vb)] {
            sh(&["ip", "-n", ns, "link", "set", dev, "up"])?;
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// In namespace `i`, a route to the other namespace's address that
    /// allows only `mtu` bytes (less than the veth's 1500).
    fn route_mtu(&self, i: usize, mtu: u32) -> Result<(), String> {
        let to = self.addrs[1 - i];
        let host = if to.contains(':') {
            format!("{to}/128")
        } else {
            format!("{to}/32")
        };
        let mtu = mtu.to_string();
        sh(&[
            "ip",
            "-n",
            &self.ns[i],
            "route",
            "replace",
            &host,
            "dev",
            &self.devs[i],
            "mtu",
            &mtu,
        ])
    }

    /// Load an nft ruleset into namespace `i`.
    fn nft(&self, i: usize, rules: &str) -> Result<(), String> {
        use std::io::Write;
        let mut c = Command::new("ip")
            .args(["netns", "exec", &self.ns[i], "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        c.stdin
            .take()
            .unwrap()
            .write_all(rules.as_bytes())
            .map_err(|e| e.to_string())?;
        let out = c.wait_with_output().map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "nft refused the rules: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    fn run(&self, n: u64) -> Vec<std::process::Output> {
        self.run_with(n, &[])
    }

    /// [`run`](Self::run) with more environment for both ranks.
    fn run_with(&self, n: u64, extra: &[(&str, &str)]) -> Vec<std::process::Output> {
        let ns = self.ns.clone();
        let addrs = self.addrs;
        let wrap = move |r: u32| -> Vec<String> {
            let addr = addrs[r as usize];
            ["ip", "netns", "exec", &ns[r as usize], "env"]
                .iter()
                .map(|s| s.to_string())
                .chain([format!("BTL_UDP_ADDR={addr}")])
                .collect()
        };
        let n = n.to_string();
        let mut env = vec![
            ("BTL_TRANSPORTS", "udp"),
            ("BTL_UDP_PEER_TIMEOUT_MS", "5000"),
            ("NETNS_N", n.as_str()),
        ];
        env.extend_from_slice(extra);
        let outs = spawn_job_wrapped(2, "stream", &env, &wrap).wait(Duration::from_secs(100));
        assert_ok(&outs);
        outs
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.ns {
            // Deleting a namespace deletes the veth end inside it (and so
            // the pair).
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}

fn setup(tag: &str) -> Option<Net> {
    report(Net::new(tag))
}

fn report(net: Result<Net, String>) -> Option<Net> {
    match net {
        Ok(n) => Some(n),
        Err(why) => {
            println!("skipped: {why}");
            None
        }
    }
}

fn num(out: &std::process::Output, key: &str) -> u64 {
    value(out, key).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// nft rules (for table family `family`) that drop 20% of UDP datagrams
/// each way.
fn drop_20_percent(family: &str) -> String {
    format!(
        "table {family} abtl {{\n chain in {{\n type filter hook input priority 0;\n \
         meta l4proto udp numgen random mod 100 < 20 drop;\n }}\n \
         chain out {{\n type filter hook output priority 0;\n \
         meta l4proto udp numgen random mod 100 < 20 drop;\n }}\n}}\n"
    )
}

#[test]
fn netns_drop_20_percent() {
    let Some(net) = setup("d") else { return };
    net.nft(1, &drop_20_percent("ip")).unwrap();
    // 20% each way: SACK lets the sender repair every hole it learns of
    // in the same round trip, so this run is as long as the others.
    let t = std::time::Instant::now();
    let outs = net.run(100_000);
    println!("100000 messages in {:?}", t.elapsed());
    println!("sender {}", value(&outs[0], "stats").unwrap_or_default());
    println!(
        "GSO packets sent {}, GRO receives {}",
        value(&outs[0], "gso_sends").unwrap_or_default(),
        value(&outs[1], "gro_receives").unwrap_or_default()
    );
    println!("receiver {}", value(&outs[1], "stats").unwrap_or_default());
    assert!(num(&outs[0], "resends") > 0, "nothing was lost?");
}

#[test]
fn netns_duplicate_20_percent() {
    let Some(net) = setup("u") else { return };
    let rules = format!(
        "table ip abtl {{\n chain out {{\n type filter hook output priority 0;\n \
         ip daddr 10.77.0.2 meta l4proto udp numgen random mod 100 < 20 dup to 10.77.0.2 device \"va{}\";\n }}\n}}\n",
        net.ns[0].trim_start_matches("abtl-").trim_end_matches("-a")
    );
    net.nft(0, &rules).unwrap();
    let outs = net.run(100_000);
    assert!(
        num(&outs[1], "duplicates") > 0,
        "no duplicate reached the protocol"
    );
}

#[test]
fn netns_corrupt_5_percent() {
    let Some(net) = setup("c") else { return };
    // Byte 100 of the UDP payload: inside our header or data, never the
    // UDP header.
    net.nft(
        1,
        "table ip abtl {\n chain in {\n type filter hook input priority 0;\n \
         meta l4proto udp numgen random mod 100 < 5 @th,800,8 set 0x5a;\n }\n}\n",
    )
    .unwrap();
    let outs = net.run(100_000);
    assert!(
        num(&outs[1], "checksum_errors") > 0,
        "no corrupted datagram reached the CRC check"
    );
}

#[test]
fn netns_v6_drop_20_percent() {
    let Some(net) = report(Net::with_addrs("6", true)) else {
        return;
    };
    net.nft(1, &drop_20_percent("ip6")).unwrap();
    let t = std::time::Instant::now();
    let outs = net.run(20_000);
    println!("20000 messages over IPv6 in {:?}", t.elapsed());
    println!("receiver {}", value(&outs[1], "stats").unwrap_or_default());
    assert!(num(&outs[0], "resends") > 0, "nothing was lost?");
    // veth's 1500-byte MTU less 40 bytes of IPv6 and 8 of UDP header.
    assert_eq!(num(&outs[1], "max_datagram"), 1452);
}

#[test]
fn netns_route_mtu_below_the_interface_sizes_the_datagrams() {
    // Rank 0's route to rank 1 allows 1200 bytes, its veth 1500: it sends
    // its stream in 1172-byte datagrams (1200 less 28 bytes of IPv4 and UDP
    // headers), in GSO packets where the kernel has them, never as IP
    // fragments; rank 1's way back still takes 1472.
    let Some(net) = setup("m") else { return };
    net.route_mtu(0, 1200).unwrap();
    let outs = net.run(20_000);
    assert_eq!(num(&outs[0], "max_datagram"), 1172);
    assert_eq!(num(&outs[1], "max_datagram"), 1472);
    let gso = num(&outs[0], "gso_sends");
    println!(
        "rank 0 sent {gso} GSO packets; rank 1 took {} joined receives",
        num(&outs[1], "gro_receives")
    );
    // The kernel takes GSO packets of datagrams that fit the route (it
    // refuses larger ones, which would turn GSO off).
    let limits = async_btl::info::Limits::from(&async_btl::Config::default());
    if limits.udp_gso_kernel.0 {
        assert!(gso > 0, "no GSO packet left rank 0");
    }
}

#[test]
fn netns_gso_packets_the_path_refuses_fall_back_to_datagrams() {
    // BTL_UDP_MTU says 9000 on a 1500-byte veth: the kernel refuses GSO
    // packets of 8972-byte datagrams (EINVAL), so GSO turns off (counted)
    // and the datagrams go out one by one, as IP fragments; the stream
    // still arrives whole and in order.
    let Some(net) = setup("g") else { return };
    let outs = net.run_with(5_000, &[("BTL_UDP_MTU", "9000")]);
    assert_eq!(num(&outs[0], "max_datagram"), 8972);
    let limits = async_btl::info::Limits::from(&async_btl::Config::default());
    let refusals = num(&outs[0], "gso_refusals");
    println!(
        "rank 0: {refusals} GSO refusals, {} GSO packets",
        num(&outs[0], "gso_sends")
    );
    if limits.udp_gso_kernel.0 {
        assert!(
            refusals >= 1,
            "the kernel took GSO packets larger than the path"
        );
    }
}

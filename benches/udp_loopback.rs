//! udp transport on loopback against tokio baselines, in one group each:
//! 1 MiB message throughput (async-btl udp, tokio `TcpStream`, tokio
//! `UdpSocket` with 64 KiB datagrams) and 8 B half round trip (async-btl
//! udp vs a tokio `UdpSocket` ping-pong). A third group sends 1 MiB in an
//! Ethernet path's datagrams (`udp_mtu` 1500: 1472 bytes each) with GSO
//! and GRO on, beside the same with them off. Both ranks live in this
//! process (two fabrics, in-process address exchange), Adaptive progress.

use std::time::{Duration, Instant};

use async_btl::{Config, Fabric, FabricBuilder, LocalExchange, ProgressMode};
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

const MIB: usize = 1 << 20;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn pair() -> (Fabric, Fabric) {
    pair_with(None, true).await
}

/// Two fabrics talking udp with datagrams for `mtu` (loopback's when
/// `None`) and GSO/GRO as `gso` says.
async fn pair_with(mtu: Option<usize>, gso: bool) -> (Fabric, Fabric) {
    let ex = LocalExchange::new(2);
    let config = Config {
        transports: vec!["udp".into()],
        udp: async_btl::UdpConfig {
            addr: Some("127.0.0.1".parse().unwrap()),
            mtu,
            gso,
            ..Default::default()
        },
        progress: ProgressMode::Adaptive,
        ..Config::default()
    };
    let mk = |r| {
        let ex = ex.clone();
        let c = config.clone();
        async move {
            FabricBuilder::new(r, 2)
                .job_key([9; 32])
                .config(c)
                .build(&ex)
                .await
                .unwrap()
        }
    };
    tokio::join!(mk(0), mk(1))
}

fn throughput(c: &mut Criterion) {
    let rt = rt();
    let (a, b) = rt.block_on(pair());
    let mut g = c.benchmark_group("loopback_1MiB");
    g.throughput(Throughput::Bytes(MIB as u64));
    let msg = Bytes::from(vec![7u8; MIB]);
    let ep = a.endpoint(1).unwrap();
    let mut rx = b.receiver(1).unwrap();
    g.bench_function("async_btl_udp", |bch| {
        bch.to_custom_iter(|iters| rt.block_on(stream(&ep, &mut rx, &msg, iters)))
    });
    let (mut tx, mut trx) = rt.block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        (c.unwrap(), s.unwrap().0)
    });
    let mut buf = vec![0u8; MIB];
    g.bench_function("tokio_tcp", |bch| {
        bch.to_custom_iter(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                let send = async {
                    for _ in 0..iters {
                        tx.write_all(&msg).await.unwrap();
                    }
                };
                let recv = async {
                    for _ in 0..iters {
                        trx.read_exact(&mut buf).await.unwrap();
                    }
                };
                tokio::join!(send, recv);
                t.elapsed()
            })
        })
    });
    // Plain UDP, 64 KiB datagrams, no reliability: the receiver counts
    // bytes and the sender paces itself on a small credit so the socket
    // buffer is not overrun (a loss would hang the iteration).
    let (us, ur) = rt.block_on(async {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let r = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        s.connect(r.local_addr().unwrap()).await.unwrap();
        r.connect(s.local_addr().unwrap()).await.unwrap();
        for x in [&s, &r] {
            let _ = socket2::SockRef::from(x).set_recv_buffer_size(8 << 20);
            let _ = socket2::SockRef::from(x).set_send_buffer_size(8 << 20);
        }
        (s, r)
    });
    let dg = vec![1u8; 65_507];
    let wait = Duration::from_millis(50);
    g.bench_function("tokio_udp_64k", |bch| {
        bch.to_custom_iter(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                let total = iters as usize * MIB;
                let send = async {
                    let mut sent = 0;
                    let mut credit = [0u8; 8];
                    while sent < total {
                        // 512 KiB per credit: wait for the receiver's ack
                        // (or a loss timeout: plain UDP may drop).
                        let end = (sent + MIB / 2).min(total);
                        while sent < end {
                            let n = (end - sent).min(dg.len());
                            us.send(&dg[..n]).await.unwrap();
                            sent += n;
                        }
                        let _ = tokio::time::timeout(wait, us.recv(&mut credit)).await;
                    }
                };
                let recv = async {
                    let mut got = 0;
                    let mut rb = vec![0u8; 65_536];
                    let mut since = 0;
                    while got < total {
                        let Ok(n) = tokio::time::timeout(wait, ur.recv(&mut rb)).await else {
                            eprintln!("tokio_udp_64k: a datagram was lost");
                            break;
                        };
                        let n = n.unwrap();
                        got += n;
                        since += n;
                        if since >= MIB / 2 || got >= total {
                            since = 0;
                            ur.send(b"c").await.unwrap();
                        }
                    }
                };
                tokio::join!(send, recv);
                t.elapsed()
            })
        })
    });
    g.finish();
    rt.block_on(async {
        let (ra, rb) = tokio::join!(a.close(), b.close());
        ra.unwrap();
        rb.unwrap();
    });
}

/// Send `msg` `iters` times from `ep` while `rx` takes them; the time.
async fn stream(
    ep: &async_btl::Endpoint,
    rx: &mut async_btl::Receiver,
    msg: &Bytes,
    iters: u64,
) -> Duration {
    let t = Instant::now();
    let send = async {
        for _ in 0..iters {
            ep.send(1, msg.clone()).await.unwrap();
        }
    };
    let recv = async {
        for _ in 0..iters {
            rx.recv().await.unwrap();
        }
    };
    tokio::join!(send, recv);
    t.elapsed()
}

fn ethernet_mtu(c: &mut Criterion) {
    let rt = rt();
    let mut g = c.benchmark_group("ethernet_mtu_1MiB");
    g.throughput(Throughput::Bytes(MIB as u64));
    let msg = Bytes::from(vec![7u8; MIB]);
    for (name, gso) in [("async_btl_udp_gso", true), ("async_btl_udp_no_gso", false)] {
        let (a, b) = rt.block_on(pair_with(Some(1500), gso));
        let ep = a.endpoint(1).unwrap();
        let mut rx = b.receiver(1).unwrap();
        g.bench_function(name, |bch| {
            bch.to_custom_iter(|iters| rt.block_on(stream(&ep, &mut rx, &msg, iters)))
        });
        if gso {
            let s = a.stats();
            println!("gso: {} GSO packets sent", s.udp.gso_sends);
        }
        drop(rx);
        rt.block_on(async {
            let (ra, rb) = tokio::join!(a.close(), b.close());
            ra.unwrap();
            rb.unwrap();
        });
    }
    g.finish();
}

fn latency(c: &mut Criterion) {
    let rt = rt();
    let (a, b) = rt.block_on(pair());
    let mut g = c.benchmark_group("loopback_8B_half_rtt");
    let ea = a.endpoint(1).unwrap();
    let eb = b.endpoint(0).unwrap();
    let mut ra = a.receiver(2).unwrap();
    let mut rb = b.receiver(2).unwrap();
    // Echo task on side b.
    let echo = rt.spawn(async move {
        while let Ok(m) = rb.recv().await {
            if eb.send_inline(2, &m.data).await.is_err() {
                break;
            }
        }
    });
    g.bench_function("async_btl_udp", |bch| {
        bch.to_custom_iter(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    ea.send_inline(2, &[0u8; 8]).await.unwrap();
                    ra.recv().await.unwrap();
                }
                t.elapsed() / 2
            })
        })
    });
    let (us, ur) = rt.block_on(async {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let r = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        s.connect(r.local_addr().unwrap()).await.unwrap();
        r.connect(s.local_addr().unwrap()).await.unwrap();
        (s, r)
    });
    let ur = std::sync::Arc::new(ur);
    let ur2 = ur.clone();
    let uecho = rt.spawn(async move {
        let mut b = [0u8; 64];
        while let Ok(n) = ur2.recv(&mut b).await {
            let _ = ur2.send(&b[..n]).await;
        }
    });
    g.bench_function("tokio_udp", |bch| {
        bch.to_custom_iter(|iters| {
            rt.block_on(async {
                let mut b = [0u8; 64];
                let t = Instant::now();
                for _ in 0..iters {
                    us.send(&[0u8; 8]).await.unwrap();
                    us.recv(&mut b).await.unwrap();
                }
                t.elapsed() / 2
            })
        })
    });
    g.finish();
    echo.abort();
    uecho.abort();
    drop((a, b));
    let _ = Duration::ZERO;
}

/// criterion's `iter_custom`, named for what it does here.
trait CustomIter {
    fn to_custom_iter<F: FnMut(u64) -> Duration>(&mut self, f: F);
}

impl CustomIter for criterion::Bencher<'_> {
    fn to_custom_iter<F: FnMut(u64) -> Duration>(&mut self, f: F) {
        self.iter_custom(f)
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = throughput, latency, ethernet_mtu
}
criterion_main!(benches);

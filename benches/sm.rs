//! async-btl's `sm` transport between two fabrics in one process (ranks as
//! tasks on a 2-worker tokio runtime, real shared memory), each beside a
//! tokio `UnixStream` pair doing the same thing in the same group:
//!
//! - `pingpong_8B`: half a round trip of an 8-byte message;
//! - `send_1MiB`: a stream of 1 MiB messages (16 in flight), one ack at
//!   the end; throughput in bytes;
//! - `software_hop_8B`: one hop of an 8-byte message with both fabrics on
//!   one thread: our code's own cost, with no cache line crossing cores;
//! - `put_1MiB`: puts of 1 MiB into a region the peer made with
//!   `alloc_region` (16 per window, then `flush`); the Unix stream does what
//!   a put over a socket needs: the bytes, then an ack.
//!
//! async-btl runs in BusyPoll and in Adaptive mode. Short on purpose: a few
//! seconds a group. Speed is reported, never asserted.
//!
//! (The udp transport's benches belong beside these once it is integrated.)

use std::time::{Duration, Instant};

use async_btl::{Config, Endpoint, Fabric, FabricBuilder, LocalExchange, ProgressMode, Receiver};
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use futures::future::try_join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::runtime::Runtime;

const TAG: u64 = 1;
const MIB: usize = 1 << 20;
const WINDOW: usize = 16;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Two fabrics talking over sm, in `mode`.
fn pair(rt: &Runtime, mode: ProgressMode) -> (Fabric, Fabric) {
    rt.block_on(async {
        let ex = LocalExchange::new(2);
        let config = Config {
            progress: mode,
            ..Config::default()
        };
        let open = |r| {
            FabricBuilder::new(r, 2)
                .job_key([3; 32])
                .config(config.clone())
                .build(&ex)
        };
        let (a, b) = futures::future::try_join(open(0), open(1))
            .await
            .expect("fabrics open");
        assert_eq!(a.transport_for(1), Some("sm"));
        (a, b)
    })
}

fn mode_name(m: ProgressMode) -> &'static str {
    match m {
        ProgressMode::BusyPoll => "async-btl/sm busy",
        ProgressMode::Adaptive => "async-btl/sm adaptive",
        ProgressMode::Interrupt => "async-btl/sm interrupt",
    }
}

/// Rank 1's side of the ping-pong: echo every message.
fn btl_echo(rt: &Runtime, b: &Fabric) -> (Endpoint, Receiver) {
    let ep = b.endpoint(0).expect("endpoint");
    let mut rx = b.receiver(TAG).expect("receiver");
    let back = ep.clone();
    rt.spawn(async move {
        while let Ok(m) = rx.recv().await {
            if back.send(TAG, m.data).await.is_err() {
                break;
            }
        }
    });
    (ep, b.receiver(TAG + 1).expect("spare receiver"))
}

fn pingpong(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("pingpong_8B");
    for mode in [ProgressMode::BusyPoll, ProgressMode::Adaptive] {
        let (a, b) = pair(&rt, mode);
        let _keep = btl_echo(&rt, &b);
        let ep = a.endpoint(1).expect("endpoint");
        let mut rx = a.receiver(TAG).expect("receiver");
        let msg = Bytes::from_static(&[5u8; 8]);
        g.bench_function(BenchmarkId::from_parameter(mode_name(mode)), |bch| {
            bch.iter_custom(|iters| {
                rt.block_on(async {
                    let t = Instant::now();
                    for _ in 0..iters {
                        ep.send(TAG, msg.clone()).await.expect("send");
                        rx.recv().await.expect("recv");
                    }
                    t.elapsed() / 2
                })
            })
        });
        drop((ep, rx));
        rt.block_on(async {
            let _ = futures::join!(a.close(), b.close());
        });
    }
    let (mut x, mut y) = rt.block_on(async { UnixStream::pair().expect("unix pair") });
    rt.spawn(async move {
        let mut buf = [0u8; 8];
        while y.read_exact(&mut buf).await.is_ok() {
            if y.write_all(&buf).await.is_err() {
                break;
            }
        }
    });
    g.bench_function(BenchmarkId::from_parameter("tokio UnixStream"), |bch| {
        bch.iter_custom(|iters| {
            rt.block_on(async {
                let mut buf = [5u8; 8];
                let t = Instant::now();
                for _ in 0..iters {
                    x.write_all(&buf).await.expect("write");
                    x.read_exact(&mut buf).await.expect("read");
                }
                t.elapsed() / 2
            })
        })
    });
    g.finish();
}

/// A Unix stream pair whose far end reads `count` (a u64) then `count` MiB,
/// and answers one byte: the socket version of "stream, then one ack".
fn unix_sink(rt: &Runtime) -> UnixStream {
    let (x, mut y) = rt.block_on(async { UnixStream::pair().expect("unix pair") });
    rt.spawn(async move {
        let mut buf = vec![0u8; MIB];
        let mut n = [0u8; 8];
        while y.read_exact(&mut n).await.is_ok() {
            for _ in 0..u64::from_le_bytes(n) {
                if y.read_exact(&mut buf).await.is_err() {
                    return;
                }
            }
            if y.write_all(&[1]).await.is_err() {
                return;
            }
        }
    });
    x
}

async fn unix_stream_mib(x: &mut UnixStream, data: &[u8], iters: u64) -> Duration {
    let t = Instant::now();
    x.write_all(&iters.to_le_bytes()).await.expect("write");
    for _ in 0..iters {
        x.write_all(data).await.expect("write");
    }
    let mut ack = [0u8; 1];
    x.read_exact(&mut ack).await.expect("ack");
    t.elapsed()
}

fn send_bw(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("send_1MiB");
    g.throughput(Throughput::Bytes(MIB as u64));
    let data = Bytes::from(vec![9u8; MIB]);
    for mode in [ProgressMode::BusyPoll, ProgressMode::Adaptive] {
        let (a, b) = pair(&rt, mode);
        // Rank 1: an 8-byte count, then that many messages, then an ack.
        let back = b.endpoint(0).expect("endpoint");
        let mut rx1 = b.receiver(TAG).expect("receiver");
        rt.spawn(async move {
            while let Ok(m) = rx1.recv().await {
                let n = u64::from_le_bytes(m.data[..8].try_into().unwrap_or([0; 8]));
                for _ in 0..n {
                    if rx1.recv().await.is_err() {
                        return;
                    }
                }
                if back.send(TAG, Bytes::from_static(b"k")).await.is_err() {
                    return;
                }
            }
        });
        let ep = a.endpoint(1).expect("endpoint");
        let mut rx = a.receiver(TAG).expect("receiver");
        g.bench_function(BenchmarkId::from_parameter(mode_name(mode)), |bch| {
            bch.iter_custom(|iters| {
                rt.block_on(async {
                    let t = Instant::now();
                    ep.send(TAG, iters.to_le_bytes().to_vec())
                        .await
                        .expect("send");
                    let mut left = iters as usize;
                    while left > 0 {
                        let n = left.min(WINDOW);
                        try_join_all((0..n).map(|_| ep.send(TAG, data.clone())))
                            .await
                            .expect("send");
                        left -= n;
                    }
                    rx.recv().await.expect("ack");
                    t.elapsed()
                })
            })
        });
        drop((ep, rx));
        rt.block_on(async {
            let _ = futures::join!(a.close(), b.close());
        });
    }
    let mut x = unix_sink(&rt);
    g.bench_function(BenchmarkId::from_parameter("tokio UnixStream"), |bch| {
        bch.iter_custom(|iters| rt.block_on(unix_stream_mib(&mut x, &data, iters)))
    });
    g.finish();
}

fn put_bw(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("put_1MiB");
    g.throughput(Throughput::Bytes(MIB as u64));
    for mode in [ProgressMode::BusyPoll, ProgressMode::Adaptive] {
        let (a, b) = pair(&rt, mode);
        let target = b.alloc_region(MIB).expect("region");
        let key = target.remote_key();
        let local = a.register(vec![4u8; MIB]);
        let ep = a.endpoint(1).expect("endpoint");
        g.bench_function(BenchmarkId::from_parameter(mode_name(mode)), |bch| {
            bch.iter_custom(|iters| {
                rt.block_on(async {
                    let t = Instant::now();
                    let mut left = iters as usize;
                    while left > 0 {
                        let n = left.min(WINDOW);
                        try_join_all((0..n).map(|_| ep.put(&local, 0..MIB, &key, 0)))
                            .await
                            .expect("put");
                        ep.flush().await.expect("flush");
                        left -= n;
                    }
                    t.elapsed()
                })
            })
        });
        drop((ep, target, local));
        rt.block_on(async {
            let _ = futures::join!(a.close(), b.close());
        });
    }
    let data = vec![4u8; MIB];
    let mut x = unix_sink(&rt);
    g.bench_function(BenchmarkId::from_parameter("tokio UnixStream"), |bch| {
        bch.iter_custom(|iters| rt.block_on(unix_stream_mib(&mut x, &data, iters)))
    });
    g.finish();
}

/// The software path of one hop, with no cache line crossing cores: both
/// fabrics on one current-thread runtime, so each `recv` finds the message
/// its partner's `send_inline` just wrote and the time is our own code's
/// (send, progress, dispatch, receive). Steadier than the ping-pong on a
/// shared VM, and the number to cut for small-message latency: the hop
/// across cores adds the cache transfers on top of it.
fn software_hop(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (a, b) = pair(&rt, ProgressMode::Adaptive);
    let (ea, eb) = (a.endpoint(1).unwrap(), b.endpoint(0).unwrap());
    let (mut ra, mut rb) = (a.receiver(TAG).unwrap(), b.receiver(TAG).unwrap());
    let mut g = c.benchmark_group("software_hop_8B");
    g.bench_function(BenchmarkId::from_parameter("one thread"), |bch| {
        bch.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    ea.send_inline(TAG, &[7u8; 8]).await.unwrap();
                    rb.recv().await.unwrap();
                    eb.send_inline(TAG, &[7u8; 8]).await.unwrap();
                    ra.recv().await.unwrap();
                }
                // Two hops per iteration.
                t.elapsed() / 2
            })
        })
    });
    g.finish();
    drop((ra, rb));
    rt.block_on(async {
        let _ = futures::future::join(a.close(), b.close()).await;
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10);
    targets = pingpong, software_hop, send_bw, put_bw
}
criterion_main!(benches);

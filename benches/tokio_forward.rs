//! A tokio TCP service that forwards each request over async-btl: the
//! request's round trip as a TCP client sees it, with the service on a
//! current-thread runtime and on a multi-thread one, in the same run.
//!
//! The service is rank 0 of a two-rank job in this process (two fabrics
//! over `sm`, the worker on a thread of its own with its own runtime). A
//! client on a thread of its own sends an 8-byte request over a loopback
//! TCP connection; the service's connection task forwards it to the worker
//! over the fabric, and a reply task (which owns the fabric's receiver and
//! waits on it all the time, between requests too, as services that
//! multiplex many requests do) hands the worker's reply back through a
//! oneshot channel to be written out. The client waits for each
//! reply before the next request. Printed: p50, p90 and p99 of the round trip, per runtime
//! flavour, and the ratio of the current-thread p50 to the multi-thread
//! one.
//!
//! Settings come from the `BTL_*` variables (`BTL_TRANSPORTS=udp` runs
//! the two ranks over udp on loopback instead of `sm`).
//!
//! ```text
//! cargo bench --bench tokio_forward
//! ```

use std::time::{Duration, Instant};

use async_btl::{Config, Fabric, FabricBuilder, LocalExchange};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const REQUESTS: usize = 20_000;
const WARMUP: usize = 2_000;

fn runtime(multi: bool) -> tokio::runtime::Runtime {
    let mut b = if multi {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    b.enable_all().build().expect("runtime")
}

/// The round trips of `REQUESTS` requests, the service on a runtime of
/// the given flavour.
fn measure(multi: bool, job: u8) -> Vec<Duration> {
    let ex = LocalExchange::new(2);
    let key = [job; 32];
    let ex1 = ex.clone();
    // The worker: rank 1, echoes every request back.
    let worker = std::thread::spawn(move || {
        runtime(false).block_on(async move {
            let f = FabricBuilder::new(1, 2)
                .job_key(key)
                .config(Config::from_env().expect("BTL_* settings"))
                .build(&ex1)
                .await
                .expect("worker fabric");
            let mut rx = f.receiver(1).expect("receiver");
            let ep = f.endpoint(0).expect("endpoint");
            while let Ok(m) = rx.recv().await {
                if m.data.is_empty() {
                    break;
                }
                ep.send(2, m.data).await.expect("reply");
            }
            f.close().await.expect("close");
        })
    });
    let rt = runtime(multi);
    let times = rt.block_on(async move {
        let f: Fabric = FabricBuilder::new(0, 2)
            .job_key(key)
            .config(Config::default())
            .build(&ex)
            .await
            .expect("service fabric");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let ep = f.endpoint(1).expect("endpoint");
        let mut replies = f.receiver(2).expect("receiver");
        // Waiters for replies, oldest first.
        let waiters = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::<
            tokio::sync::oneshot::Sender<bytes::Bytes>,
        >::new()));
        // The reply task: owns the receiver and waits on it all the time
        // (between requests too, as a router of many requests' replies
        // does), answering the oldest waiter.
        let w = waiters.clone();
        let router = tokio::spawn(async move {
            while let Ok(m) = replies.recv().await {
                let waiter = w.lock().expect("waiters").pop_front();
                if let Some(waiter) = waiter {
                    let _ = waiter.send(m.data);
                }
            }
        });
        let service = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            s.set_nodelay(true).expect("nodelay");
            let mut buf = [0u8; 8];
            while s.read_exact(&mut buf).await.is_ok() {
                let (tx, rx) = tokio::sync::oneshot::channel();
                waiters.lock().expect("waiters").push_back(tx);
                ep.send_inline(1, &buf).await.expect("forward");
                let data = rx.await.expect("reply");
                s.write_all(&data).await.expect("write");
            }
            ep.send(1, Vec::new()).await.expect("stop");
        });
        let client = std::thread::spawn(move || {
            runtime(false).block_on(async move {
                let mut c = TcpStream::connect(addr).await.expect("connect");
                c.set_nodelay(true).expect("nodelay");
                let mut times = Vec::with_capacity(REQUESTS);
                let mut buf = [0u8; 8];
                for i in 0..WARMUP + REQUESTS {
                    let t = Instant::now();
                    c.write_all(&(i as u64).to_le_bytes()).await.expect("send");
                    c.read_exact(&mut buf).await.expect("recv");
                    if i >= WARMUP {
                        times.push(t.elapsed());
                    }
                    assert_eq!(u64::from_le_bytes(buf), i as u64, "reply out of order");
                }
                times
            })
        });
        let times = tokio::task::spawn_blocking(move || client.join().expect("client"))
            .await
            .expect("join");
        service.await.expect("service");
        router.abort();
        f.close().await.expect("close");
        times
    });
    worker.join().expect("worker");
    times
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let mut p50 = [0.0f64; 2];
    for round in 0..3u8 {
        for (i, multi) in [false, true].into_iter().enumerate() {
            let mut t = measure(multi, 10 + round * 2 + i as u8);
            t.sort();
            let name = if multi {
                "multi-thread"
            } else {
                "current-thread"
            };
            println!(
                "round {round} {name:<15} p50 {:7.1} us  p90 {:7.1} us  p99 {:7.1} us",
                pct(&t, 0.5),
                pct(&t, 0.9),
                pct(&t, 0.99)
            );
            p50[i] = pct(&t, 0.5);
        }
        println!(
            "round {round} current-thread p50 / multi-thread p50 = {:.2}",
            p50[0] / p50[1]
        );
    }
}

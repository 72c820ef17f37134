//! `sm`'s small-message path beside UCX's, in one run.
//!
//! Two groups, each at 8 and 64 bytes:
//!
//! - `small_lat`: half a round trip (an echo server answers each message);
//! - `small_stream`: a one-way stream of messages, one ack at the end of
//!   each sample; throughput in messages per second.
//!
//! Each group has two series:
//!
//! - `async-btl/sm`: two fabrics over `sm` (real shared memory) in this
//!   process, rank 0 on the bench thread, rank 1 on a thread of its own,
//!   each on a current-thread runtime pinned to its own core where two are
//!   allowed, in the default progress mode (`adaptive`: the server parks
//!   while the other series runs). Sends are `send_inline`, receives
//!   `recv_into` one kept buffer: what a program that knows the API does,
//!   and what `btl-perf` measures.
//! - `ucx`: UCX's own `ucx_perftest` (`tag_lat`, `tag_bw`) over `sm,self`,
//!   a server and a client pinned to the same two cores, run for the
//!   iterations criterion asks for (at least 20 000); the time is UCX's
//!   own figure per operation times criterion's iterations (its process
//!   start-up is not counted).
//!   Without `ucx_perftest` (Debian's `ucx-utils`) the series is skipped
//!   with the reason printed.
//!
//! Speed is reported, never asserted. `btl-perf --transport sm --test
//! lat,bw,msg_rate --baseline ompi,ucx` measures the same points with
//! interleaved repeats, and Open MPI beside them.

use std::time::{Duration, Instant};

use async_btl::{Endpoint, Fabric, FabricBuilder, LocalExchange, Receiver};
use btl_tools::perf::plan::Plan;
use btl_tools::perf::{pin, ucx, Baseline, Test};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// Rank 0 tells the server what comes next on this tag.
const CTRL: u64 = 1;
/// Messages of the measured runs, both ways.
const DATA: u64 = 2;
/// The server's end-of-stream ack.
const ACK: u64 = 3;

const SIZES: [usize; 2] = [8, 64];

/// See [`ucx_point`].
const UCX_MIN_ITERS: u64 = 20_000;

/// What the server does next: echo `n` messages, or take `n` and ack.
#[derive(Clone, Copy)]
enum Run {
    Echo(u64),
    Sink(u64),
    Stop,
}

impl Run {
    fn encode(self) -> [u8; 9] {
        let (k, n) = match self {
            Run::Echo(n) => (0, n),
            Run::Sink(n) => (1, n),
            Run::Stop => (2, 0),
        };
        let mut b = [0u8; 9];
        b[0] = k;
        b[1..].copy_from_slice(&n.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Run {
        let n = b
            .get(1..9)
            .and_then(|s| s.try_into().ok())
            .map_or(0, u64::from_le_bytes);
        match b.first() {
            Some(0) => Run::Echo(n),
            Some(1) => Run::Sink(n),
            _ => Run::Stop,
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The two cores to run on, if two are allowed (read once, before the
/// bench thread is pinned to the first).
fn cores() -> (Option<usize>, Option<usize>) {
    static CORES: std::sync::OnceLock<(Option<usize>, Option<usize>)> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| match pin::allowed_cores()[..] {
        [a, b, ..] => (Some(a), Some(b)),
        _ => (None, None),
    })
}

async fn fabric(ex: &LocalExchange, rank: u32) -> Fabric {
    FabricBuilder::new(rank, 2)
        .job_key([7; 32])
        .build(ex)
        .await
        .expect("fabric opens")
}

/// Rank 1: answers runs until told to stop.
async fn serve(f: Fabric) {
    let ep = f.endpoint(0).expect("endpoint");
    let mut ctrl = f.receiver(CTRL).expect("receiver");
    let mut rx = f.receiver(DATA).expect("receiver");
    let mut cmd = Vec::with_capacity(16);
    let mut buf = Vec::with_capacity(1024);
    while ctrl.recv_into(&mut cmd).await.is_ok() {
        match Run::decode(&cmd) {
            Run::Echo(n) => {
                for _ in 0..n {
                    rx.recv_into(&mut buf).await.expect("echo receive");
                    ep.send_inline(DATA, &buf).await.expect("echo send");
                }
            }
            Run::Sink(n) => {
                for _ in 0..n {
                    rx.recv_into(&mut buf).await.expect("stream receive");
                }
                ep.send_inline(ACK, &[1]).await.expect("ack");
            }
            Run::Stop => break,
        }
    }
    drop((ep, ctrl, rx));
    f.close().await.expect("server closes");
}

/// Rank 0's side: the fabric, its endpoint to rank 1 and its receivers.
struct Client {
    rt: tokio::runtime::Runtime,
    fabric: Option<Fabric>,
    ep: Endpoint,
    rx: Receiver,
    ack: Receiver,
    buf: Vec<u8>,
    server: Option<std::thread::JoinHandle<()>>,
}

impl Client {
    fn start() -> Client {
        let (c0, c1) = cores();
        if let Some(c) = c0 {
            pin::pin_current_thread(c).expect("pin the bench thread");
        }
        let ex = LocalExchange::new(2);
        let ex1 = ex.clone();
        let server = std::thread::spawn(move || {
            if let Some(c) = c1 {
                pin::pin_current_thread(c).expect("pin the server thread");
            }
            let rt = runtime();
            rt.block_on(async move { serve(fabric(&ex1, 1).await).await });
        });
        let rt = runtime();
        let f = rt.block_on(fabric(&ex, 0));
        assert_eq!(f.transport_for(1), Some("sm"), "the pair talks over sm");
        let ep = f.endpoint(1).expect("endpoint");
        let rx = f.receiver(DATA).expect("receiver");
        let ack = f.receiver(ACK).expect("receiver");
        Client {
            rt,
            fabric: Some(f),
            ep,
            rx,
            ack,
            buf: Vec::with_capacity(1024),
            server: Some(server),
        }
    }

    fn tell(&self, run: Run) {
        self.rt
            .block_on(self.ep.send_inline(CTRL, &run.encode()))
            .expect("control send");
    }

    /// `iters` round trips of `size` bytes; half their time.
    fn ping_pong(&mut self, size: usize, iters: u64) -> Duration {
        self.tell(Run::Echo(iters));
        let msg = vec![5u8; size];
        let Client {
            rt, ep, rx, buf, ..
        } = self;
        rt.block_on(async {
            let t = Instant::now();
            for _ in 0..iters {
                ep.send_inline(DATA, &msg).await.expect("send");
                rx.recv_into(buf).await.expect("receive");
            }
            t.elapsed() / 2
        })
    }

    /// `iters` messages of `size` bytes one way, then the server's ack.
    fn stream(&mut self, size: usize, iters: u64) -> Duration {
        self.tell(Run::Sink(iters));
        let msg = vec![5u8; size];
        let Client {
            rt, ep, ack, buf, ..
        } = self;
        rt.block_on(async {
            let t = Instant::now();
            for _ in 0..iters {
                ep.send_inline(DATA, &msg).await.expect("send");
            }
            ack.recv_into(buf).await.expect("ack");
            t.elapsed()
        })
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.tell(Run::Stop);
        if let Some(f) = self.fabric.take() {
            let _ = self.rt.block_on(f.close());
        }
        if let Some(s) = self.server.take() {
            let _ = s.join();
        }
    }
}

/// One `ucx_perftest` point: UCX's own figure (µs, or messages/s).
fn ucx_figure(
    rt: &tokio::runtime::Runtime,
    test: Test,
    size: usize,
    plan: Plan,
) -> Result<f64, String> {
    let got = rt.block_on(ucx::measure(
        Baseline::Ucx,
        &[(test, size, plan)],
        cores(),
        Duration::from_secs(120),
        &mut |_| {},
    ));
    got.into_iter()
        .next()
        .unwrap_or_else(|| Err("no result".into()))
}

/// One UCX point of `iters` operations: its own figure, as time for them.
///
/// UCX runs at least [`UCX_MIN_ITERS`] operations: its figure over a
/// handful is mostly its own start of the loop, so the few-iteration
/// samples criterion starts with would measure that instead.
fn ucx_point(rt: &tokio::runtime::Runtime, test: Test, size: usize, iters: u64) -> Duration {
    let plan = Plan {
        iters: iters.max(UCX_MIN_ITERS),
        warmup: 1000,
        window: 1,
    };
    let value =
        ucx_figure(rt, test, size, plan).unwrap_or_else(|why| panic!("ucx_perftest failed: {why}"));
    match test {
        // Microseconds per half round trip.
        Test::Lat => Duration::from_secs_f64(value * 1e-6 * iters as f64),
        // Messages per second.
        _ => Duration::from_secs_f64(iters as f64 / value),
    }
}

/// Whether `ucx_perftest` runs here; if not, why.
fn ucx_missing(rt: &tokio::runtime::Runtime) -> Option<String> {
    let plan = Plan {
        iters: 10,
        warmup: 0,
        window: 1,
    };
    ucx_figure(rt, Test::Lat, 8, plan).err()
}

fn small_messages(c: &mut Criterion) {
    let _ = cores();
    let tools = runtime();
    let missing = ucx_missing(&tools);
    if let Some(why) = &missing {
        println!("small_messages: the ucx series is skipped: {why}");
    }
    let mut client = Client::start();

    let mut g = c.benchmark_group("small_lat");
    g.sample_size(10).warm_up_time(Duration::from_millis(500));
    for size in SIZES {
        g.bench_function(BenchmarkId::new("async-btl/sm", size), |b| {
            b.iter_custom(|iters| client.ping_pong(size, iters))
        });
        if missing.is_none() {
            g.bench_function(BenchmarkId::new("ucx", size), |b| {
                b.iter_custom(|iters| ucx_point(&tools, Test::Lat, size, iters))
            });
        }
    }
    g.finish();

    let mut g = c.benchmark_group("small_stream");
    g.sample_size(10).warm_up_time(Duration::from_millis(500));
    g.throughput(Throughput::Elements(1));
    for size in SIZES {
        g.bench_function(BenchmarkId::new("async-btl/sm", size), |b| {
            b.iter_custom(|iters| client.stream(size, iters))
        });
        if missing.is_none() {
            g.bench_function(BenchmarkId::new("ucx", size), |b| {
                b.iter_custom(|iters| ucx_point(&tools, Test::MsgRate, size, iters))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, small_messages);
criterion_main!(benches);

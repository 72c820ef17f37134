//! async-btl inside an ordinary tokio service. Rank 0 runs a TCP server on
//! 127.0.0.1 (a port the OS picks, printed) speaking a line protocol: a
//! number in, `<number squared> by rank <k>` out. Each request handler
//! forwards its request to a worker rank (round-robin over ranks 1..N) over
//! async-btl and awaits the reply, exactly as it would await a database.
//! Rank 0 also runs a small client that sends 100 requests concurrently over
//! TCP, checks every reply, then shuts the service and the workers down.
//!
//! ```text
//! cargo run --example tokio_service             # launches 3 local ranks
//! btl-run -n 4 target/debug/examples/tokio_service
//! ```

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_btl::{Endpoint, Fabric, Receiver};
use common::{ensure, Outcome};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

const TAG_WORK: u64 = 4;
const TAG_REPLY: u64 = 5;
const REQUESTS: u64 = 100;

/// What rank 0 sends to a worker.
#[derive(Serialize, Deserialize)]
enum Work {
    Square { id: u64, x: i64 },
    Stop,
}

/// A worker's answer to `Work::Square`.
#[derive(Serialize, Deserialize)]
struct Reply {
    id: u64,
    square: i64,
}

fn main() {
    common::main("tokio_service", 3, |f| Box::pin(tokio_service(f)))
}

async fn tokio_service(fabric: &Fabric) -> Outcome {
    ensure(fabric.size() >= 2, || {
        "tokio_service needs at least 2 ranks: rank 0 serves, the others work".into()
    })?;
    if fabric.rank() == 0 {
        front_end(fabric).await?;
    } else {
        worker(fabric).await?;
    }
    fabric.barrier().await?;
    Ok(())
}

/// A worker: answer requests from rank 0 until told to stop.
async fn worker(fabric: &Fabric) -> Outcome {
    let boss = fabric.endpoint(0)?;
    let mut work = fabric.receiver(TAG_WORK)?;
    loop {
        match postcard::from_bytes(&work.recv().await?.data)? {
            Work::Square { id, x } => {
                let reply = Reply { id, square: x * x };
                boss.send(TAG_REPLY, postcard::to_allocvec(&reply)?).await?;
            }
            Work::Stop => return Ok(()),
        }
    }
}

/// Forwards requests to workers and matches their replies to the waiting
/// requests by id.
struct Workers {
    endpoints: Vec<Endpoint>,
    next_id: AtomicU64,
    waiting: Mutex<HashMap<u64, oneshot::Sender<(i64, u32)>>>,
}

impl Workers {
    /// Have a worker square `x`; returns the square and the rank that
    /// computed it.
    async fn square(&self, x: i64) -> Result<(i64, u32), Box<dyn std::error::Error + Send + Sync>> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let ep = &self.endpoints[id as usize % self.endpoints.len()];
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().map_err(|_| "poisoned")?.insert(id, tx);
        ep.send(TAG_WORK, postcard::to_allocvec(&Work::Square { id, x })?)
            .await?;
        Ok(rx.await.map_err(|_| "the reply router stopped")?)
    }

    /// Hand each reply to the request waiting for it (runs as its own task).
    /// When the replies stop (a worker was lost), every waiting request
    /// fails instead of hanging.
    async fn route_replies(self: Arc<Self>, mut replies: Receiver) -> async_btl::Error {
        loop {
            let msg = match replies.recv().await {
                Ok(msg) => msg,
                Err(e) => {
                    self.waiting.lock().map(|mut w| w.clear()).ok();
                    return e;
                }
            };
            let Ok(reply) = postcard::from_bytes::<Reply>(&msg.data) else {
                eprintln!("tokio_service: unreadable reply from rank {}", msg.src);
                continue;
            };
            let waiter = self
                .waiting
                .lock()
                .ok()
                .and_then(|mut w| w.remove(&reply.id));
            if let Some(tx) = waiter {
                let _ = tx.send((reply.square, msg.src));
            }
        }
    }

    async fn stop(&self) -> async_btl::Result<()> {
        let stop = postcard::to_allocvec(&Work::Stop).unwrap_or_default();
        for ep in &self.endpoints {
            ep.send(TAG_WORK, stop.clone()).await?;
        }
        Ok(())
    }
}

async fn front_end(fabric: &Fabric) -> Outcome {
    let workers = Arc::new(Workers {
        endpoints: (1..fabric.size())
            .map(|r| fabric.endpoint(r))
            .collect::<Result<_, _>>()?,
        next_id: AtomicU64::new(0),
        waiting: Mutex::new(HashMap::new()),
    });
    let router = tokio::spawn(workers.clone().route_replies(fabric.receiver(TAG_REPLY)?));

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("tokio_service: listening on {addr}");
    let (shutdown, stopped) = watch::channel(false);
    let server = tokio::spawn(serve(listener, workers.clone(), stopped));

    let outcome = client(addr).await;

    // Shut down in order: stop accepting, stop the workers, stop routing.
    let _ = shutdown.send(true);
    server.await??;
    workers.stop().await?;
    router.abort();
    let served = outcome?;
    ensure(
        served.keys().all(|r| (1..fabric.size()).contains(r)),
        || format!("replies claim ranks outside the workers: {served:?}"),
    )?;
    let spread: Vec<String> = served
        .iter()
        .map(|(r, n)| format!("rank {r}: {n}"))
        .collect();
    println!(
        "tokio_service: {REQUESTS} concurrent requests answered correctly ({})",
        spread.join(", ")
    );
    Ok(())
}

/// Accept connections until `stopped` turns true; one task per connection.
async fn serve(
    listener: TcpListener,
    workers: Arc<Workers>,
    mut stopped: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = accepted?;
                connections.spawn(handle(stream, workers.clone()));
            }
            _ = stopped.changed() => break,
        }
    }
    // Clients are done by now; let the handlers finish their last lines.
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// One connection: each line is a number, answered by a worker.
async fn handle(stream: TcpStream, workers: Arc<Workers>) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let answer = match line.trim().parse::<i64>() {
            Ok(x) if x.unsigned_abs() < 1 << 31 => match workers.square(x).await {
                Ok((square, rank)) => format!("{square} by rank {rank}"),
                Err(e) => format!("error: {e}"),
            },
            _ => format!("error: {line:?} is not a number below 2^31"),
        };
        if write
            .write_all(format!("{answer}\n").as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Send `REQUESTS` requests at once, one connection each; check the replies.
/// Returns how many requests each worker rank served.
async fn client(
    addr: std::net::SocketAddr,
) -> Result<BTreeMap<u32, u64>, Box<dyn std::error::Error>> {
    let mut requests = JoinSet::new();
    for i in 0..REQUESTS {
        requests.spawn(async move {
            let x = i as i64 * 7 - 300;
            let mut stream = TcpStream::connect(addr).await?;
            stream.write_all(format!("{x}\n").as_bytes()).await?;
            let mut line = String::new();
            BufReader::new(&mut stream).read_line(&mut line).await?;
            Ok::<_, std::io::Error>((x, line))
        });
    }
    let mut served = BTreeMap::new();
    while let Some(done) = requests.join_next().await {
        let (x, line) = done??;
        let rank = line
            .trim()
            .strip_prefix(&format!("{} by rank ", x * x))
            .and_then(|r| r.parse::<u32>().ok())
            .ok_or_else(|| format!("request {x}: wrong reply {line:?}"))?;
        *served.entry(rank).or_default() += 1;
    }
    Ok(served)
}

//! Latency: ranks 0 and 1 bounce an 8-byte message back and forth; rank 0
//! prints the half round-trip time and the transport that carried it. Any
//! other ranks just wait at the final barrier. Rank 1 receives every ping
//! into one buffer (`Receiver::recv_into`).
//!
//! ```text
//! cargo run --example pingpong                  # launches 2 local ranks
//! btl-run -n 2 target/debug/examples/pingpong
//! mpirun -np 2 target/debug/examples/pingpong
//! ```
//!
//! `PINGPONG_ITERS` sets the number of timed round trips (default 5000,
//! after 500 untimed ones). Build with `--release` for meaningful numbers.

mod common;

use std::time::Instant;

use async_btl::Fabric;
use common::{ensure, Outcome};

const TAG: u64 = 1;
const WARMUP: u64 = 500;

fn main() {
    common::main("pingpong", 2, |f| Box::pin(pingpong(f)))
}

async fn pingpong(fabric: &Fabric) -> Outcome {
    ensure(fabric.size() >= 2, || {
        "pingpong needs at least 2 ranks (btl-run -n 2)".into()
    })?;
    let iters: u64 = match std::env::var("PINGPONG_ITERS") {
        Ok(v) => v.parse().map_err(|_| format!("PINGPONG_ITERS={v:?}"))?,
        Err(_) => 5000,
    };
    match fabric.rank() {
        0 => {
            let peer = fabric.endpoint(1)?;
            let mut rx = fabric.receiver(TAG)?;
            let mut started = Instant::now();
            for i in 0..WARMUP + iters {
                if i == WARMUP {
                    started = Instant::now();
                }
                peer.send_inline(TAG, &i.to_le_bytes()).await?;
                let reply = rx.recv().await?;
                ensure(reply.src == 1 && reply.data[..] == i.to_le_bytes(), || {
                    format!(
                        "round trip {i}: got {:?} from rank {}",
                        reply.data, reply.src
                    )
                })?;
            }
            let half_rtt = started.elapsed().as_secs_f64() * 1e6 / (2 * iters.max(1)) as f64;
            println!(
                "pingpong: 8 B half round-trip {half_rtt:.2} µs over {} ({iters} iterations)",
                peer.transport()
            );
        }
        1 => {
            let peer = fabric.endpoint(0)?;
            let mut rx = fabric.receiver(TAG)?;
            // One buffer for every ping: over sm, nothing is allocated per
            // message.
            let mut ping = Vec::with_capacity(8);
            for i in 0..WARMUP + iters {
                let src = rx.recv_into(&mut ping).await?;
                ensure(src == 0 && ping[..] == i.to_le_bytes(), || {
                    format!("ping {i}: got {ping:?} from rank {src}")
                })?;
                peer.send_inline(TAG, &ping).await?;
            }
        }
        _ => {}
    }
    fabric.barrier().await?;
    Ok(())
}

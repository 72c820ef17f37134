//! Allreduce on a ring: every rank holds a vector of 1 Mi `f64`; afterwards
//! every rank holds the element-wise sum over all ranks. A reduce-scatter
//! (N-1 steps, each rank adds the chunk coming from its left neighbour) is
//! followed by an all-gather (N-1 steps, each rank forwards a finished
//! chunk), so every rank sends and receives about 2·(N-1)/N of the vector.
//!
//! ```text
//! cargo run --example ring_allreduce            # launches 4 local ranks
//! btl-run -n 3 target/debug/examples/ring_allreduce
//! ```
//!
//! The inputs are small integers, so every partial sum is exact in `f64`
//! whatever the order of additions, and the result is checked for equality
//! against the closed form.

mod common;

use std::ops::Range;
use std::time::Instant;

use async_btl::{Endpoint, Fabric, Receiver};
use common::{ensure, Outcome};

const TAG: u64 = 2;
const LEN: usize = 1 << 20;

fn main() {
    common::main("ring_allreduce", 4, |f| Box::pin(ring_allreduce(f)))
}

/// Rank `rank`'s input at index `i`.
fn input(rank: u32, i: usize) -> f64 {
    f64::from(rank + 1) * (i % 1000) as f64 + f64::from(rank)
}

/// The sum of `input(r, i)` over `r` in `0..n`, in closed form.
fn expected(n: u32, i: usize) -> f64 {
    let n = f64::from(n);
    (i % 1000) as f64 * n * (n + 1.0) / 2.0 + n * (n - 1.0) / 2.0
}

/// The index range of chunk `c` when `LEN` is cut into `n` chunks.
fn chunk(c: u32, n: u32) -> Range<usize> {
    let at = |k: u32| LEN * k as usize / n as usize;
    at(c)..at(c + 1)
}

async fn ring_allreduce(fabric: &Fabric) -> Outcome {
    let (rank, n) = (fabric.rank(), fabric.size());
    let mut data: Vec<f64> = (0..LEN).map(|i| input(rank, i)).collect();
    let mut ring = Ring {
        right: fabric.endpoint((rank + 1) % n)?,
        left: (rank + n - 1) % n,
        rx: fabric.receiver(TAG)?,
    };
    fabric.barrier().await?;
    let started = Instant::now();

    // Reduce-scatter: at step s, pass on chunk rank-s and add the incoming
    // chunk rank-s-1 into ours. Afterwards chunk rank+1 is complete here.
    for s in 0..n.saturating_sub(1) {
        let send = chunk((rank + n - s) % n, n);
        let recv = chunk((rank + 2 * n - s - 1) % n, n);
        let incoming = ring.exchange(&data[send], recv.len()).await?;
        for (x, y) in data[recv].iter_mut().zip(incoming) {
            *x += y;
        }
    }
    // All-gather: at step s, pass on the complete chunk rank+1-s and store
    // the complete chunk rank-s arriving from the left.
    for s in 0..n.saturating_sub(1) {
        let send = chunk((rank + 1 + n - s) % n, n);
        let recv = chunk((rank + n - s) % n, n);
        let incoming = ring.exchange(&data[send], recv.len()).await?;
        for (x, y) in data[recv].iter_mut().zip(incoming) {
            *x = y;
        }
    }
    let elapsed = started.elapsed();

    if let Some(i) = (0..LEN).find(|&i| data[i] != expected(n, i)) {
        return Err(format!(
            "rank {rank}: element {i} is {} but should be {}",
            data[i],
            expected(n, i)
        )
        .into());
    }
    fabric.barrier().await?;
    if rank == 0 {
        println!(
            "ring_allreduce: {n} ranks summed {LEN} f64 each, result exact on every rank ({:.1} ms)",
            elapsed.as_secs_f64() * 1e3
        );
    }
    Ok(())
}

/// This rank's place in the ring: it sends right and receives from the left.
struct Ring {
    right: Endpoint,
    left: u32,
    rx: Receiver,
}

impl Ring {
    /// Send `out` to the right neighbour while receiving `len` values from the
    /// left one. Both at once: a ring where everybody first waits for its
    /// send to finish relies on buffering; this needs none.
    async fn exchange(
        &mut self,
        out: &[f64],
        len: usize,
    ) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
        let bytes: Vec<u8> = out.iter().flat_map(|x| x.to_le_bytes()).collect();
        let (sent, received) = tokio::join!(self.right.send(TAG, bytes), self.rx.recv());
        sent?;
        let msg = received?;
        ensure(msg.src == self.left && msg.data.len() == len * 8, || {
            format!(
                "expected {len} values from rank {}, got {} bytes from rank {}",
                self.left,
                msg.data.len(),
                msg.src
            )
        })?;
        Ok(msg
            .data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect())
    }
}

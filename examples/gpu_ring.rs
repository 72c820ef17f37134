//! Device memory around a ring: every rank fills a buffer of GPU memory,
//! sends it to its right neighbour with `Endpoint::send_region` and lands
//! its left neighbour's in another GPU buffer with
//! `Receiver::recv_region`, for sizes from 4 KiB to 4 MiB, and checks every
//! byte. Between ranks of one node the messages are lent (the receiver
//! copies them out of the sender's GPU memory through CUDA IPC, one GPU
//! copy); rank 0 prints how many were, and the bandwidth of the largest.
//!
//! ```text
//! cargo run --features cuda --example gpu_ring      # launches 3 local ranks
//! BTL_SMCUDA_GPU=test-double cargo run --example gpu_ring   # no GPU needed
//! btl-run -n 4 target/debug/examples/gpu_ring
//! ```
//!
//! Without device memory (no GPU, no driver, or a build without the `cuda`
//! feature) rank 0 says why and the example ends without moving anything.
//! `BTL_SMCUDA_GPU=test-double` runs it on the test double, whose "GPU
//! memory" is shared host memory.

mod common;

use std::time::Instant;

use async_btl::{Fabric, MemoryRegion};
use common::{ensure, Outcome};

const TAG: u64 = 3;
const SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 4 << 20];
const ROUNDS: u64 = 8;

fn main() {
    common::main("gpu_ring", 3, |f| Box::pin(gpu_ring(f)))
}

/// The bytes rank `rank` sends in round `round` of size `len`.
fn pattern(rank: u32, round: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + round * 7 + u64::from(rank) * 101) as u8)
        .collect()
}

async fn gpu_ring(fabric: &Fabric) -> Outcome {
    let (rank, n) = (fabric.rank(), fabric.size());
    ensure(n >= 2, || "gpu_ring needs at least 2 ranks".into())?;
    let max = SIZES[SIZES.len() - 1];
    let (send, recv) = match (
        fabric.alloc_device_region(0, max),
        fabric.alloc_device_region(0, max),
    ) {
        (Ok(s), Ok(r)) => (s, r),
        (Err(e), _) | (_, Err(e)) => {
            if rank == 0 {
                println!(
                    "gpu_ring: no device memory here ({e}); set BTL_SMCUDA_GPU=test-double to run \
                     it on the test double"
                );
            }
            // Every rank finds the same: nothing to move.
            fabric.barrier().await?;
            return Ok(());
        }
    };
    let right = fabric.endpoint((rank + 1) % n)?;
    let left = (rank + n - 1) % n;
    let mut rx = fabric.receiver(TAG)?;
    let mut secs = 0.0;
    for len in SIZES {
        for round in 0..ROUNDS {
            send.write(0, &pattern(rank, round, len))?;
            fabric.barrier().await?;
            let started = Instant::now();
            let (sent, got) = futures::join!(
                right.send_region(TAG, &send, 0..len),
                rx.recv_region(&recv, 0)
            );
            sent?;
            let (src, got) = got?;
            if len == max {
                secs += started.elapsed().as_secs_f64();
            }
            ensure(src == left && got == len, || {
                format!("round {round} of {len} B: {got} bytes from rank {src}")
            })?;
            check(&recv, &pattern(left, round, len))?;
        }
    }
    fabric.barrier().await?;
    if rank == 0 {
        let s = fabric.stats();
        println!(
            "gpu_ring: {n} ranks over {}, {} of {} sends lent, {} through the host; \
             {} MiB at {:.2} GB/s per rank; every transfer checked",
            fabric
                .rma_transport_for(1, async_btl::MemoryKind::Device(0))
                .unwrap_or("no GPU route"),
            s.lent_sends,
            SIZES.len() as u64 * ROUNDS,
            s.staged_device_ops,
            max >> 20,
            (max as f64 * ROUNDS as f64) / secs.max(1e-9) / 1e9
        );
    }
    Ok(())
}

/// `region` starts with `want`.
fn check(region: &MemoryRegion, want: &[u8]) -> Outcome {
    let mut got = vec![0u8; want.len()];
    region.read(0, &mut got)?;
    let bad = got.iter().zip(want).position(|(a, b)| a != b);
    ensure(bad.is_none(), || {
        format!(
            "{} B from the left neighbour differ at byte {bad:?}",
            want.len()
        )
    })
}

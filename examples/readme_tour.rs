//! The README's API tour, kept compiling and running: each rank sends its
//! region's key to the next rank, then puts into and gets from the previous
//! rank's region. Runs with no flags (spawns 2 local ranks).

use async_btl::{Fabric, RemoteKey, Result};

fn main() -> Result<()> {
    if let Some(code) = async_btl::launch::run_self_if_unlaunched(2) {
        std::process::exit(code);
    }
    tokio::runtime::Runtime::new()
        .map_err(|e| async_btl::Error::os("starting tokio", e))?
        .block_on(tour())
}

async fn tour() -> Result<()> {
    let fabric = Fabric::from_env().await?;
    let peer = (fabric.rank() + 1) % fabric.size();
    let ep_next = fabric.endpoint(peer)?;
    let mut rx = fabric.receiver(7)?;

    let region = fabric.alloc_region(1 << 20)?;
    ep_next.send(7, region.remote_key().to_bytes()).await?;
    let msg = rx.recv().await?;
    let their_key = RemoteKey::from_bytes(&msg.data)?;
    let ep = fabric.endpoint(msg.src)?;

    let local = fabric.register(vec![42u8; 4096]);
    ep.put(&local, 0..4096, &their_key, 0).await?;
    let back = fabric.register(vec![0u8; 4096]);
    ep.get(&back, 0..4096, &their_key, 0).await?;
    assert_eq!(back.to_vec(), vec![42u8; 4096]);
    // A burst of small puts with no future each: the flush completes them.
    for i in 0..64 {
        ep.put_nbi(&local, i * 8..i * 8 + 8, &their_key, 8192 + i as u64 * 8)?;
    }
    ep.flush().await?;
    ep.get(&back, 0..512, &their_key, 8192).await?;
    assert_eq!(back.to_vec()[..512], [42u8; 512]);
    fabric.barrier().await?;
    println!(
        "rank {}: put and got 4096 bytes through {}",
        fabric.rank(),
        ep.transport()
    );
    fabric.close().await
}

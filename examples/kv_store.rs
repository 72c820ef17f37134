//! A distributed key-value store on one-sided put/get. Every rank owns a
//! shard: a shared-memory region of fixed-size slots from `alloc_region`,
//! whose `RemoteKey` it sends to everybody. A key hashes to a home shard
//! (rank) and a home slot; ranks then `put` their entries straight into the
//! owners' shards and, after a barrier, `get` every rank's entries back and
//! check them. The owners' CPUs take no part.
//!
//! ```text
//! cargo run --example kv_store                  # launches 4 local ranks
//! btl-run -n 3 target/debug/examples/kv_store
//! ```
//!
//! put/get have no remote atomics, so two ranks must never write the same
//! slot: each shard is cut into one partition per writer, a key lives in its
//! writer's partition of its home shard, and collisions probe linearly
//! within that partition (the writer knows which of its slots it used).

mod common;

use std::collections::HashSet;

use async_btl::{Endpoint, Fabric, MemoryRegion, RemoteKey};
use common::{ensure, Outcome};
use futures::future::try_join_all;

const TAG_KEYS: u64 = 3;
/// Slot layout: key hash (u64, 0 = empty), value length (u32), value.
const SLOT: usize = 64;
const HEADER: usize = 12;
const SLOTS_PER_WRITER: usize = 64;
const KEYS_PER_RANK: usize = 48;

fn main() {
    common::main("kv_store", 4, |f| Box::pin(kv_store(f)))
}

fn key_name(writer: u32, k: usize) -> String {
    format!("rank{writer}/key{k}")
}

fn value_of(writer: u32, k: usize) -> String {
    format!("value {k} written by rank {writer}")
}

/// FNV-1a, never 0 (0 marks an empty slot).
fn hash(key: &str) -> u64 {
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    h.max(1)
}

/// Every rank's shard, reachable through its key.
struct Store {
    endpoints: Vec<Endpoint>,
    shards: Vec<RemoteKey>,
}

impl Store {
    /// The home shard of `key` and the byte offset of probe `p` in the
    /// partition of `writer`.
    fn locate(&self, writer: u32, key: &str, p: usize) -> (usize, u64) {
        let (h, n) = (hash(key), self.shards.len() as u64);
        let slot = ((h / n) as usize + p) % SLOTS_PER_WRITER;
        let offset = (writer as usize * SLOTS_PER_WRITER + slot) * SLOT;
        ((h % n) as usize, offset as u64)
    }

    /// Find `key` written by `writer`: read slots with `get` until the key or
    /// an empty slot turns up.
    async fn lookup(
        &self,
        writer: u32,
        key: &str,
        scratch: MemoryRegion,
    ) -> Result<Option<String>, async_btl::Error> {
        for p in 0..SLOTS_PER_WRITER {
            let (owner, offset) = self.locate(writer, key, p);
            self.endpoints[owner]
                .get(&scratch, 0..SLOT, &self.shards[owner], offset)
                .await?;
            let slot = scratch.to_vec();
            let stored = u64::from_le_bytes(slot[..8].try_into().unwrap_or_default());
            if stored == 0 {
                return Ok(None);
            }
            if stored == hash(key) {
                let len = u32::from_le_bytes(slot[8..12].try_into().unwrap_or_default());
                let value = slot.get(HEADER..HEADER + len as usize).unwrap_or_default();
                return Ok(Some(String::from_utf8_lossy(value).into_owned()));
            }
        }
        Ok(None)
    }
}

async fn kv_store(fabric: &Fabric) -> Outcome {
    let (me, n) = (fabric.rank(), fabric.size());
    let shard = fabric.alloc_region(n as usize * SLOTS_PER_WRITER * SLOT)?;
    let store = Store {
        endpoints: (0..n)
            .map(|r| fabric.endpoint(r))
            .collect::<Result<_, _>>()?,
        shards: exchange_keys(fabric, &shard).await?,
    };

    // Write: encode our entries into a local staging region, pick a free
    // slot in our partition of each key's home shard, put them all at once.
    let staging = fabric.register(vec![0; KEYS_PER_RANK * SLOT]);
    let mut used = HashSet::new();
    let mut puts = Vec::new();
    for k in 0..KEYS_PER_RANK {
        let (key, value) = (key_name(me, k), value_of(me, k));
        let mut slot = [0u8; SLOT];
        slot[..8].copy_from_slice(&hash(&key).to_le_bytes());
        slot[8..12].copy_from_slice(&(value.len() as u32).to_le_bytes());
        slot[HEADER..HEADER + value.len()].copy_from_slice(value.as_bytes());
        staging.write(k * SLOT, &slot)?;
        let (owner, offset) = (0..SLOTS_PER_WRITER)
            .map(|p| store.locate(me, &key, p))
            .find(|at| used.insert(*at))
            .ok_or("a partition is full: raise SLOTS_PER_WRITER")?;
        let ep = &store.endpoints[owner];
        puts.push(ep.put(
            &staging,
            k * SLOT..(k + 1) * SLOT,
            &store.shards[owner],
            offset,
        ));
    }
    try_join_all(puts).await?;

    // Everybody's entries are in place once everybody passed the barrier.
    fabric.barrier().await?;
    let lookups = (0..n).flat_map(|w| (0..KEYS_PER_RANK).map(move |k| (w, k)));
    let found = try_join_all(lookups.map(|(w, k)| {
        let scratch = fabric.register(vec![0; SLOT]);
        let store = &store;
        async move {
            Ok::<_, async_btl::Error>((w, k, store.lookup(w, &key_name(w, k), scratch).await?))
        }
    }))
    .await?;
    for (w, k, value) in &found {
        ensure(value.as_deref() == Some(value_of(*w, *k).as_str()), || {
            format!("rank {me}: {} read back as {value:?}", key_name(*w, *k))
        })?;
    }
    let absent = store
        .lookup(me, "never/written", fabric.register(vec![0; SLOT]))
        .await?;
    ensure(absent.is_none(), || {
        format!("a key never written was found: {absent:?}")
    })?;

    // Our shard must outlive everybody's reads.
    fabric.barrier().await?;
    let stats = fabric.stats();
    println!(
        "kv_store: rank {me} put {KEYS_PER_RANK} entries and read back all {} of {n} ranks: correct \
         ({} direct / {} emulated puts, {} direct / {} emulated gets)",
        found.len(),
        stats.direct_puts,
        stats.emulated_puts,
        stats.direct_gets,
        stats.emulated_gets
    );
    Ok(())
}

/// Send our shard's key to every rank and collect theirs, in rank order.
async fn exchange_keys(
    fabric: &Fabric,
    shard: &MemoryRegion,
) -> Result<Vec<RemoteKey>, Box<dyn std::error::Error>> {
    let mut rx = fabric.receiver(TAG_KEYS)?;
    let mine = shard.remote_key();
    let blob = mine.to_bytes();
    let others = (0..fabric.size()).filter(|r| *r != fabric.rank());
    for r in others.clone() {
        fabric.endpoint(r)?.send(TAG_KEYS, blob.clone()).await?;
    }
    let mut keys = vec![mine.clone(); fabric.size() as usize];
    for _ in others {
        let msg = rx.recv().await?;
        let key = RemoteKey::from_bytes(&msg.data)?;
        ensure(key.owner() == msg.src, || {
            format!("rank {} sent a key owned by rank {}", msg.src, key.owner())
        })?;
        keys[msg.src as usize] = key;
    }
    Ok(keys)
}

//! Two or more fabrics in one process (ranks as tasks), talking through real
//! shared memory. Multi-process behaviour is in `tests/multiproc.rs`.

use std::time::Duration;

use async_btl::{Config, Error, Fabric, FabricBuilder, LocalExchange};
use bytes::Bytes;

async fn job(n: u32, config: Config) -> Vec<Fabric> {
    let ex = LocalExchange::new(n);
    let key = [7u8; 32];
    let futs = (0..n).map(|r| {
        let ex = ex.clone();
        let c = config.clone();
        async move {
            FabricBuilder::new(r, n)
                .job_key(key)
                .config(c)
                .build(&ex)
                .await
        }
    });
    futures::future::try_join_all(futs)
        .await
        .expect("fabrics open")
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<_>>()
        .into()
}

/// Send `sizes` from rank 0 to rank 1 of a job on `config`, in order, and
/// check each message's length and content.
async fn send_recv_sizes(config: Config, sizes: &[usize]) {
    let f = job(2, config).await;
    assert_eq!(f[0].transport_for(1), Some("sm"));
    let ep = f[0].endpoint(1).unwrap();
    let mut rx = f[1].receiver(5).unwrap();
    let list = sizes.to_vec();
    let sender = tokio::spawn(async move {
        for (i, s) in list.iter().enumerate() {
            ep.send(5, pattern(*s, i as u8)).await.unwrap();
        }
    });
    for (i, s) in sizes.iter().enumerate() {
        let m = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.src, 0);
        assert_eq!(m.data.len(), *s, "size #{i}");
        assert_eq!(m.data, pattern(*s, i as u8), "content of size {s}");
    }
    sender.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_all_sizes_over_sm() {
    // The default eager fragment carries 16384 - 64 bytes.
    let sizes = [0, 1, 4032, 16319, 16320, 16321, 65536, 1 << 20, 16 << 20];
    send_recv_sizes(Config::default(), &sizes).await;
}

/// Small fragment sizes (4 KiB eager, 32 KiB max, where our
/// defaults are 16 and 128 KiB, see ARCHITECTURE.md): every edge of both,
/// of the fast box and of single copy, with single copy on and off (off,
/// messages above a max fragment are pipelined through several).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_edges_with_4k_eager_and_32k_max_fragments() {
    let sizes = [
        0,
        1,
        48,
        49,
        1024,
        1025,
        4031,
        4032,
        4033,
        16383,
        16384,
        32703,
        32704,
        32705,
        65536,
        100_003,
        1 << 20,
    ];
    for cma_min in [Config::default().sm.cma_min, usize::MAX] {
        let config = Config {
            sm: async_btl::SmConfig {
                eager_size: 4096,
                max_size: 32 * 1024,
                cma_min,
                ..Default::default()
            },
            ..Config::default()
        };
        send_recv_sizes(config, &sizes).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_get_shared_and_registered_regions() {
    let f = job(2, Config::default()).await;
    let ep = f[0].endpoint(1).unwrap();
    for shared in [true, false] {
        let target = if shared {
            f[1].alloc_region(8192).unwrap()
        } else {
            f[1].register(vec![0u8; 8192])
        };
        let key = target.remote_key();
        let src = f[0].register(pattern(4096, 9).to_vec());
        ep.put(&src, 100..1100, &key, 3000).await.unwrap();
        let mut got = vec![0u8; 1000];
        target.read(3000, &mut got).unwrap();
        assert_eq!(&got[..], &pattern(4096, 9)[100..1100]);
        let dst = f[0].register(vec![0u8; 2000]);
        ep.get(&dst, 500..1500, &key, 3000).await.unwrap();
        assert_eq!(&dst.to_vec()[500..1500], &pattern(4096, 9)[100..1100]);
        // Out of range: refused, target untouched.
        let before = target.to_vec();
        let e = ep.put(&src, 0..4096, &key, 8000).await.unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
        // Forged key: same length, other id (byte 5 lies inside the id).
        let mut forged = key.to_bytes();
        forged[5] ^= 0xff;
        let fk = async_btl::RemoteKey::from_bytes(&forged).unwrap();
        let e = ep.put(&src, 0..10, &fk, 0).await.unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
        assert_eq!(target.to_vec(), before);
    }
    let s = f[0].stats();
    assert!(s.direct_puts >= 1 && s.emulated_puts >= 1, "{s:?}");
}

async fn job_with_key(n: u32, job_key: [u8; 32]) -> Vec<Fabric> {
    let ex = LocalExchange::new(n);
    let futs = (0..n).map(|r| {
        let ex = ex.clone();
        async move { FabricBuilder::new(r, n).job_key(job_key).build(&ex).await }
    });
    futures::future::try_join_all(futs)
        .await
        .expect("fabrics open")
}

/// A key keeps the mapping its first put made (UCX's unpacked rkey), but
/// that never outlives the owner's region nor crosses into another job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_keeps_its_mapping_but_not_past_revocation_or_into_another_job() {
    let a = job_with_key(2, [7u8; 32]).await;
    let b = job_with_key(2, [8u8; 32]).await;
    let target = a[1].alloc_region(4096).unwrap();
    let key = target.remote_key();
    let ep = a[0].endpoint(1).unwrap();
    let src = a[0].register(pattern(64, 3).to_vec());
    let puts = a[0].stats().direct_puts;
    for i in 0..10u64 {
        ep.put(&src, 0..64, &key, i * 64).await.unwrap();
    }
    // A clone carries the mapping; a copy decoded from bytes is equal (the
    // mapping is not part of the value) and maps on its own first use.
    let clone = key.clone();
    ep.put(&src, 0..64, &clone, 640).await.unwrap();
    let decoded = async_btl::RemoteKey::from_bytes(&key.to_bytes()).unwrap();
    assert_eq!(decoded, key);
    ep.put(&src, 0..64, &decoded, 704).await.unwrap();
    assert_eq!(a[0].stats().direct_puts - puts, 12);
    let mut got = vec![0u8; 64];
    for i in 0..12 {
        target.read(i * 64, &mut got).unwrap();
        assert_eq!(&got[..], &pattern(64, 3)[..], "slot {i}");
    }

    // The same key on another job's endpoint to the same rank number: the
    // other job's checks refuse it; nothing is written anywhere.
    let other = b[0].endpoint(1).unwrap();
    let before = target.to_vec();
    let bsrc = b[0].register(vec![0xAB; 64]);
    let e = other.put(&bsrc, 0..64, &key, 0).await.unwrap_err();
    assert!(matches!(e, Error::Access(_) | Error::Misuse(_)), "{e}");
    assert_eq!(target.to_vec(), before);

    // The owner drops the region: the cached mapping sees the revocation.
    drop(target);
    for k in [&key, &clone, &decoded] {
        let e = ep.put(&src, 0..64, k, 0).await.unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
    }
}

/// The futures users spawn must be `Send + 'static`.
#[test]
fn operation_futures_are_send_and_static() {
    fn check<T: Send + 'static>() {}
    check::<async_btl::SendFuture>();
    check::<async_btl::SendInlineFuture<'static>>();
    check::<async_btl::Put>();
    check::<async_btl::Get>();
    check::<async_btl::Flush>();
    check::<async_btl::AtomicFetch>();
    check::<async_btl::Receiver>();
    check::<async_btl::Endpoint>();
    fn check_sync<T: Send + Sync>() {}
    check_sync::<async_btl::Endpoint>();
    check_sync::<async_btl::Fabric>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_path_and_barrier_and_close() {
    let f = job(3, Config::default()).await;
    let ep = f[2].endpoint(2).unwrap();
    assert_eq!(ep.transport(), "self");
    let mut rx = f[2].receiver(1).unwrap();
    ep.send_inline(1, b"me").await.unwrap();
    assert_eq!(&rx.recv().await.unwrap().data[..], b"me");
    let bars = f.iter().map(|x| x.barrier());
    futures::future::try_join_all(bars).await.unwrap();
    let closes = f.into_iter().map(|x| x.close());
    futures::future::try_join_all(closes).await.unwrap();
}

/// Every owned buffer type `register` takes is reachable by put, get and
/// atomics from a peer, and a `Vec` comes back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_every_owned_buffer_type() {
    let f = job(2, Config::default()).await;
    let ep = f[0].endpoint(1).unwrap();
    let len = 4096;
    let regions = [
        f[1].register(vec![0u8; len]),
        f[1].register(vec![0u8; len].into_boxed_slice()),
        f[1].register(bytes::BytesMut::zeroed(len)),
        f[1].register(async_btl::PageBuf::zeroed(len)),
        f[1].register(memmap2::MmapMut::map_anon(len).unwrap()),
    ];
    let src = f[0].register(pattern(len, 9).to_vec());
    let back = f[0].register(vec![0u8; len]);
    for (i, r) in regions.iter().enumerate() {
        let key = r.remote_key();
        ep.put(&src, 0..len, &key, 0).await.unwrap();
        ep.get(&back, 0..len, &key, 0).await.unwrap();
        assert!(back.to_vec() == pattern(len, 9).to_vec(), "region {i}");
        // 8-byte words of a Vec, a boxed slice and a page buffer are
        // aligned here; the counter starts from the pattern's word.
        let start = u64::from_le_bytes(pattern(len, 9)[64..72].try_into().unwrap());
        if let Ok(old) = ep.fetch_add(&key, 64, 5).await {
            assert_eq!(old, start, "region {i}");
            let mut w = [0u8; 8];
            r.read(64, &mut w).unwrap();
            assert_eq!(u64::from_le_bytes(w), start.wrapping_add(5), "region {i}");
        }
    }
    let page = f[1].register(async_btl::PageBuf::zeroed(100));
    assert!(ep.fetch_add(&page.remote_key(), 88, 1).await.is_ok());
    assert!(ep.fetch_add(&page.remote_key(), 96, 1).await.is_err());
    let [vec_region, ..] = regions;
    let v = vec_region.try_into_vec().expect("only handle");
    assert_eq!(v.len(), len);
    drop(page);
    let closes = f.into_iter().map(|x| x.close());
    futures::future::try_join_all(closes).await.unwrap();
}

/// Atomics to one's own rank go through the self path (emulated at the
/// target, which is this process) on shared and registered regions, and
/// refuse what they must with memory unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atomics_on_the_self_path() {
    let f = Fabric::single().await.unwrap();
    let ep = f.endpoint(0).unwrap();
    for r in [
        f.alloc_region(64).unwrap(),
        f.register(async_btl::PageBuf::zeroed(64)),
    ] {
        let k = r.remote_key();
        assert_eq!(ep.fetch_add(&k, 8, 3).await.unwrap(), 0);
        assert_eq!(ep.fetch_add(&k, 8, 4).await.unwrap(), 3);
        assert_eq!(ep.compare_swap(&k, 8, 6, 1).await.unwrap(), 7, "no swap");
        assert_eq!(ep.compare_swap(&k, 8, 7, 1).await.unwrap(), 7, "swap");
        assert_eq!(ep.swap(&k, 8, 42).await.unwrap(), 1);
        for _ in 0..10 {
            ep.atomic_add_nbi(&k, 16, u64::MAX).unwrap(); // wraps: -1
        }
        ep.flush().await.unwrap();
        for (off, what) in [
            (4u64, "misaligned"),
            (64, "past the end"),
            (60, "straddling"),
        ] {
            let e = ep.fetch_add(&k, off, 1).await.unwrap_err();
            assert!(matches!(e, Error::Access(_)), "{what}: {e}");
        }
        let w = |i: usize| {
            let mut b = [0u8; 8];
            r.read(i, &mut b).unwrap();
            u64::from_le_bytes(b)
        };
        assert_eq!(w(8), 42);
        assert_eq!(w(16), 0u64.wrapping_sub(10));
        assert!([0, 24, 32, 40, 48, 56].iter().all(|i| w(*i) == 0));
    }
    assert!(f.stats().emulated_atomics >= 2 * 15);
    f.close().await.unwrap();
}

/// `RemoteKey::from_bytes` takes exactly what `to_bytes` gives: trailing
/// bytes are refused, and random or truncated bytes are errors, not panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_key_bytes_decode_exactly() {
    let f = job(2, Config::default()).await;
    for r in [
        f[1].alloc_region(100).unwrap(),
        f[1].register(vec![1u8; 10]),
    ] {
        let b = r.remote_key().to_bytes();
        let k = async_btl::RemoteKey::from_bytes(&b).unwrap();
        assert_eq!(k, r.remote_key());
        let mut extra = b.clone();
        extra.push(0);
        assert!(async_btl::RemoteKey::from_bytes(&extra).is_err());
        for n in 0..b.len() {
            assert!(
                async_btl::RemoteKey::from_bytes(&b[..n]).is_err(),
                "{n} bytes"
            );
        }
    }
    let shared = f[1].alloc_region(8).unwrap().remote_key();
    assert_eq!(shared.transports().collect::<Vec<_>>(), ["sm"]);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for len in 0..2000usize {
        let junk: Vec<u8> = (0..len % 97)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let _ = async_btl::RemoteKey::from_bytes(&junk);
    }
    let closes = f.into_iter().map(|x| x.close());
    futures::future::try_join_all(closes).await.unwrap();
}

/// Operations that complete at once (into a peer's mapping) still yield to
/// the runtime's other tasks: on a current-thread runtime a 10 ms ticker
/// keeps ticking beside a loop of puts, gets, atomics, or `put_nbi` and
/// `flush`, none of which ever waits.
#[tokio::test(flavor = "current_thread")]
async fn loops_of_immediate_operations_leave_room_for_other_tasks() {
    let f = job(2, Config::default()).await;
    let region = f[1].alloc_region(4096).unwrap();
    let key = region.remote_key();
    let ep = f[0].endpoint(1).unwrap();
    let local = f[0].register(vec![1u8; 64]);
    for what in ["put", "get", "fetch_add", "put_nbi+flush"] {
        let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let t = ticks.clone();
        let ticker = tokio::spawn(async move {
            let mut iv = tokio::time::interval(Duration::from_millis(10));
            loop {
                iv.tick().await;
                t.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        let until = std::time::Instant::now() + Duration::from_millis(300);
        let mut n = 0u64;
        while std::time::Instant::now() < until {
            match what {
                "put" => ep.put(&local, 0..64, &key, 0).await.unwrap(),
                "get" => ep.get(&local, 0..64, &key, 0).await.unwrap(),
                "fetch_add" => drop(ep.fetch_add(&key, 64, 1).await.unwrap()),
                _ => {
                    ep.put_nbi(&local, 0..8, &key, 128).unwrap();
                    ep.flush().await.unwrap();
                }
            }
            n += 1;
        }
        ticker.abort();
        let ticks = ticks.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            ticks >= 10,
            "{what}: the ticker ran {ticks} times in 300 ms beside {n} operations"
        );
    }
    let closes = f.into_iter().map(|x| x.close());
    futures::future::try_join_all(closes).await.unwrap();
}

/// A local read or write past a region's end is the caller's mistake
/// (`Misuse`, naming the range), not a remote refusal.
#[tokio::test(flavor = "current_thread")]
async fn local_access_past_the_end_is_misuse() {
    let f = Fabric::single().await.unwrap();
    let r = f.register(vec![0u8; 16]);
    let e = r.read(10, &mut [0u8; 8]).unwrap_err();
    assert!(matches!(e, Error::Misuse(_)), "{e}");
    assert!(
        e.to_string().contains("10..18") && !e.to_string().contains("remote"),
        "{e}"
    );
    let e = r.write(16, &[1]).unwrap_err();
    assert!(matches!(e, Error::Misuse(_)), "{e}");
    assert_eq!(r.to_vec(), vec![0u8; 16]);
    f.close().await.unwrap();
}

/// `try_recv` takes what has arrived without waiting, in order, and says
/// `None` when nothing has; the receiver still works as a stream after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_recv_takes_what_arrived_without_waiting() {
    let f = job(2, Config::default()).await;
    let mut rx = f[1].receiver(4).unwrap();
    assert!(rx.try_recv().unwrap().is_none(), "nothing sent yet");
    let ep = f[0].endpoint(1).unwrap();
    for i in 0..10u8 {
        ep.send(4, vec![i; 100]).await.unwrap();
    }
    let mut got = Vec::new();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while got.len() < 10 && std::time::Instant::now() < until {
        match rx.try_recv().unwrap() {
            Some(m) => got.push(m.data[0]),
            None => tokio::task::yield_now().await,
        }
    }
    assert_eq!(got, (0..10).collect::<Vec<u8>>());
    assert!(rx.try_recv().unwrap().is_none());
    ep.send(4, &b"after"[..]).await.unwrap();
    assert_eq!(&rx.recv().await.unwrap().data[..], b"after");
    let closes = f.into_iter().map(|x| x.close());
    futures::future::try_join_all(closes).await.unwrap();
}

/// After `close`, every operation through a kept endpoint fails with
/// `Closed`, `flush` included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_after_close_fail_with_closed() {
    let mut f = job(2, Config::default()).await;
    let ep = f[0].endpoint(1).unwrap();
    let region = f[1].alloc_region(64).unwrap();
    let key = region.remote_key();
    let local = f[0].register(vec![0u8; 8]);
    ep.put(&local, 0..8, &key, 0).await.unwrap(); // maps it
    let b = f.pop().unwrap();
    let a = f.pop().unwrap();
    futures::future::try_join(a.close(), b.close())
        .await
        .unwrap();
    assert!(matches!(ep.send(1, &b"x"[..]).await, Err(Error::Closed)));
    // A borrowed send small enough for the fast box, and one that would
    // take a fragment: each send path reports the close.
    assert!(matches!(ep.send_inline(1, b"x").await, Err(Error::Closed)));
    assert!(matches!(
        ep.send_inline(1, &[7u8; 600]).await,
        Err(Error::Closed)
    ));
    assert!(matches!(ep.flush().await, Err(Error::Closed)));
    for e in [
        ep.put(&local, 0..8, &key, 0).await.unwrap_err(),
        ep.get(&local, 0..8, &key, 0).await.unwrap_err(),
        ep.fetch_add(&key, 0, 1).await.unwrap_err(),
        ep.put_nbi(&local, 0..8, &key, 0).unwrap_err(),
    ] {
        assert!(matches!(e, Error::Closed), "{e}");
    }
    drop(region);
}

/// A receiver spinning on the fabric (busy polling, nothing arriving) on a
/// current-thread runtime still lets the runtime's sockets in: a TCP
/// request from another thread reaches its task within a few of the
/// receiver's polls. A receiver that had itself polled again at once every
/// time kept the runtime from looking at its I/O for 61 polls (tokio's
/// event interval), which made a TCP request forwarded over the fabric
/// twice as slow as on a multi-thread runtime.
#[test]
fn a_spinning_receiver_lets_the_runtimes_sockets_in() {
    use futures::StreamExt;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    const ROUNDS: usize = 40;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let worst = rt.block_on(async {
        let cfg = Config {
            progress: async_btl::ProgressMode::BusyPoll,
            ..Config::default()
        };
        let f = job(2, cfg).await;
        let polls = Arc::new(AtomicU64::new(0));
        let mut rx = f[1].receiver(9).unwrap();
        let p = polls.clone();
        let spinner = tokio::spawn(async move {
            futures::future::poll_fn(|cx| {
                p.fetch_add(1, Ordering::Relaxed);
                rx.poll_next_unpin(cx)
            })
            .await
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let at_write = Arc::new(AtomicU64::new(0));
        let (p, w) = (polls.clone(), at_write.clone());
        let client = std::thread::spawn(move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_nodelay(true).unwrap();
            let mut b = [0u8; 1];
            for i in 0..ROUNDS {
                std::thread::sleep(Duration::from_micros(200 + 37 * i as u64 % 300));
                w.store(p.load(Ordering::Relaxed), Ordering::Relaxed);
                c.write_all(&[i as u8]).unwrap();
                c.read_exact(&mut b).unwrap();
            }
        });
        let (mut s, _) = listener.accept().await.unwrap();
        let mut worst = 0;
        let mut b = [0u8; 1];
        for _ in 0..ROUNDS {
            tokio::io::AsyncReadExt::read_exact(&mut s, &mut b)
                .await
                .unwrap();
            let waited = polls.load(Ordering::Relaxed) - at_write.load(Ordering::Relaxed);
            worst = worst.max(waited);
            tokio::io::AsyncWriteExt::write_all(&mut s, &b)
                .await
                .unwrap();
        }
        tokio::task::spawn_blocking(move || client.join().unwrap())
            .await
            .unwrap();
        println!("receiver polls in all: {}", polls.load(Ordering::Relaxed));
        spinner.abort();
        futures::future::try_join_all(f.into_iter().map(|x| x.close()))
            .await
            .unwrap();
        worst
    });
    println!("the most receiver polls between a TCP write and its task: {worst}");
    assert!(
        worst <= 24,
        "the receiver polled {worst} times before the socket's task ran"
    );
}

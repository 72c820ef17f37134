//! Regressions found in review, over real shared memory between fabrics of
//! one process, with tiny pools and receive budgets to reach the edge cases.

use async_btl::{Config, Fabric, FabricBuilder, LocalExchange};
use bytes::Bytes;
use std::time::Duration;

async fn job(n: u32, config: Config) -> Vec<Fabric> {
    let ex = LocalExchange::new(n);
    let futs = (0..n).map(|r| {
        let ex = ex.clone();
        let c = config.clone();
        async move {
            FabricBuilder::new(r, n)
                .job_key([3u8; 32])
                .config(c)
                .build(&ex)
                .await
        }
    });
    futures::future::try_join_all(futs)
        .await
        .expect("fabrics open")
}

/// Tiny pools and budgets. Single copy is off: these cases are about
/// fragments (with it, a large send would wait for the receiver's copy).
fn small() -> Config {
    Config {
        sm: async_btl::SmConfig {
            eager_size: 4096,
            eager_count: 4,
            max_size: 32 * 1024,
            max_count: 1,
            cma_min: usize::MAX,
            ..Default::default()
        },
        recv_budget: 1024,
        ..Config::default()
    }
}

/// Leave rank 0's pool (`small()`: 4 eager fragments, 1 max) held by rank
/// 1, which reads nothing yet (tag 1 over budget): a 2000-byte message,
/// then one of a max fragment and 2 eager ones (32704 + 2*4032). The
/// second fits the free fragments whole, so its send completes without
/// rank 1 reading.
async fn hold_the_pool(e1: &async_btl::Endpoint) {
    e1.send(1, Bytes::from(vec![1u8; 2000])).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::time::timeout(
        Duration::from_secs(5),
        e1.send(1, Bytes::from(vec![2u8; 32704 + 8064])),
    )
    .await
    .expect("a message that fits the free fragments is handed over at once")
    .unwrap();
}

/// An inline send must never push part of a message (and then queue the
/// whole message again, which makes the receiver cut the sender off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_inline_send_never_pushes_part_of_a_message() {
    let f = job(3, small()).await;
    let e1 = f[0].endpoint(1).unwrap();
    let e2 = f[0].endpoint(2).unwrap();
    let mut rx2 = f[2].receiver(9).unwrap();
    hold_the_pool(&e1).await;
    let data = vec![5u8; 10000];
    let fut = e2.send_inline(9, &data);
    let h = {
        // drain rank 1 later so fragments come home
        let mut rx1 = f[1].receiver(1).unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            for _ in 0..2 {
                let _ = rx1.recv().await;
            }
            rx1
        })
    };
    let r = tokio::time::timeout(Duration::from_secs(5), fut).await;
    assert!(matches!(r, Ok(Ok(()))), "inline send: {r:?}");
    let _rx1 = h.await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(5), rx2.recv()).await;
    assert!(
        matches!(m, Ok(Ok(ref msg)) if msg.data.len() == 10000),
        "message lost / peer cut off"
    );
}

/// A user message held back by a full tag queue must not block control
/// traffic (get answers, barriers): those travel on their own ring.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2_full_tag_does_not_block_barrier_or_get() {
    let f = job(2, small()).await;
    let e01 = f[0].endpoint(1).unwrap();
    let e10 = f[1].endpoint(0).unwrap();
    e01.send(1, Bytes::from(vec![1u8; 2000])).await.unwrap();
    e01.send(1, Bytes::from(vec![1u8; 2000])).await.unwrap();
    let region = f[0].register(vec![7u8; 100]);
    let key = region.remote_key();
    let dst = f[1].register(vec![0u8; 100]);
    let g = tokio::time::timeout(Duration::from_secs(3), e10.get(&dst, 0..100, &key, 0)).await;
    let (a, b) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(3), f[0].barrier()),
        tokio::time::timeout(Duration::from_secs(3), f[1].barrier())
    );
    assert!(
        matches!(g, Ok(Ok(()))),
        "get stuck behind a blocked user message: {g:?}"
    );
    assert!(
        matches!(a, Ok(Ok(()))) && matches!(b, Ok(Ok(()))),
        "barrier: {a:?} {b:?}"
    );
    assert_eq!(dst.to_vec(), vec![7u8; 100]);
}

/// After the situation of r1, sends to the same peer keep flowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_sends_keep_flowing_after_a_busy_pool() {
    let f = job(3, small()).await;
    let e1 = f[0].endpoint(1).unwrap();
    let e2 = f[0].endpoint(2).unwrap();
    let mut rx2 = f[2].receiver(9).unwrap();
    hold_the_pool(&e1).await;
    let data = vec![5u8; 10000];
    let fut = e2.send_inline(9, &data);
    let mut rx1 = f[1].receiver(1).unwrap();
    let h = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        loop {
            if rx1.recv().await.is_err() {
                break;
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .expect("inline send completes")
        .expect("inline send succeeds");
    // Rank 2 keeps reading: every message arrives intact, nobody is cut off.
    let reader = tokio::spawn(async move {
        let first = rx2.recv().await.unwrap();
        assert_eq!(first.data.len(), 10000);
        for i in 0..50u8 {
            let m = rx2.recv().await.unwrap();
            assert_eq!(m.data, Bytes::from(vec![i; 30000]));
        }
    });
    let r = tokio::time::timeout(Duration::from_secs(10), async {
        for i in 0..50u8 {
            e2.send(9, Bytes::from(vec![i; 30000])).await.unwrap();
        }
    })
    .await;
    assert!(r.is_ok(), "sends to rank 2 hang");
    tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .unwrap()
        .unwrap();
    h.abort();
    assert_eq!(f[2].stats().bad_frames, 0);
    assert_eq!(f[0].stats().peers_lost, 0);
}

/// A peer that closed its fabric but whose process lives on: operations on
/// it fail instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_get_to_a_closed_peer_fails_instead_of_hanging() {
    let c = Config {
        close_timeout: Duration::from_millis(200),
        ..Config::default()
    };
    let mut f = job(2, c).await;
    let f1 = f.pop().unwrap();
    let region = f1.register(vec![7u8; 100]);
    let key = region.remote_key();
    // Rank 0 never says goodbye, so this close times out; what matters is
    // that rank 1's fabric is closed afterwards.
    let _ = f1.close().await;
    let e = f[0].endpoint(1).unwrap();
    let dst = f[0].register(vec![0u8; 100]);
    let g = tokio::time::timeout(Duration::from_secs(3), e.get(&dst, 0..100, &key, 0)).await;
    assert!(
        matches!(g, Ok(Err(ref e)) if e.is_peer_lost()),
        "get to a closed peer: {g:?}"
    );
}

/// An endpoint that outlives its fabric fails at once instead of queueing a
/// message nobody will send (sm and udp alike).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r5_sends_after_the_fabric_is_gone_fail_with_closed() {
    for transport in ["sm", "udp"] {
        let c = Config {
            transports: vec![transport.to_string()],
            ..Config::default()
        };
        let mut f = job(2, c).await;
        let ep = f[0].endpoint(1).unwrap();
        assert_eq!(ep.transport(), transport);
        drop(f.remove(0));
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            ep.send(1, Bytes::from(vec![1u8; 100_000])),
        )
        .await;
        assert!(
            matches!(r, Ok(Err(async_btl::Error::Closed))),
            "{transport}: {r:?}"
        );
        let r = tokio::time::timeout(Duration::from_secs(5), ep.send_inline(1, b"x")).await;
        assert!(
            matches!(r, Ok(Err(async_btl::Error::Closed))),
            "{transport}: {r:?}"
        );
    }
}

/// r2 over udp: a full tag must not block a get answer or a barrier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r6_udp_full_tag_does_not_block_barrier_or_get() {
    let c = Config {
        transports: vec!["udp".into()],
        recv_budget: 1024,
        ..Config::default()
    };
    let f = job(2, c).await;
    let e01 = f[0].endpoint(1).unwrap();
    let e10 = f[1].endpoint(0).unwrap();
    assert_eq!(e01.transport(), "udp");
    e01.send(1, Bytes::from(vec![1u8; 2000])).await.unwrap();
    e01.send(1, Bytes::from(vec![1u8; 2000])).await.unwrap();
    let region = f[0].register(vec![7u8; 100]);
    let key = region.remote_key();
    let dst = f[1].register(vec![0u8; 100]);
    let g = tokio::time::timeout(Duration::from_secs(3), e10.get(&dst, 0..100, &key, 0)).await;
    assert!(
        matches!(g, Ok(Ok(()))),
        "get stuck behind a held user message: {g:?}"
    );
    assert_eq!(dst.to_vec(), vec![7u8; 100]);
    let (a, b) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(3), f[0].barrier()),
        tokio::time::timeout(Duration::from_secs(3), f[1].barrier())
    );
    assert!(
        matches!(a, Ok(Ok(()))) && matches!(b, Ok(Ok(()))),
        "barrier: {a:?} {b:?}"
    );
    // The held messages are all there, in order, once the tag is read.
    let mut rx = f[1].receiver(1).unwrap();
    for _ in 0..2 {
        assert_eq!(rx.recv().await.unwrap().data.len(), 2000);
    }
}

/// A peer spreading messages over many tags that nobody reads cannot grow
/// the receiver's memory past the total budget: the receiver stops taking
/// messages (they wait on the sender's side) until the program consumes
/// some, then everything arrives, in order per tag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r7_messages_over_many_tags_stay_within_the_total_budget() {
    let c = Config {
        recv_budget: 1 << 20,
        recv_total_budget: 64 * (8 + 64),
        ..Config::default()
    };
    let f = job(2, c).await;
    let e = f[0].endpoint(1).unwrap();
    for t in 0..80u64 {
        e.send(100 + t, Bytes::copy_from_slice(&t.to_le_bytes()))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        f[1].stats().recvs,
        64,
        "64 messages of 8 B (and 64 B of bookkeeping each) fill the budget"
    );
    for t in 0..80u64 {
        let mut rx = f[1].receiver(100 + t).unwrap();
        let m = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("message after room was made")
            .unwrap();
        assert_eq!(m.data, Bytes::copy_from_slice(&t.to_le_bytes()));
    }
}

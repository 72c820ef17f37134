//! `Receiver::recv_into`: a receive loop that reuses one buffer allocates
//! nothing per message where the receiver's own progress finds it (sm's
//! fast boxes), and gets every message, whole and in order, either way.
//! Allocations are counted per thread by this binary's allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use async_btl::{Config, Fabric, FabricBuilder, LocalExchange, ProgressMode};

/// Counts the allocations of the calling thread, then asks the system.
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call goes to `System` with the same arguments; the count
// is a thread-local `Cell` of a const-initialised type without `Drop`,
// whose access allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

const ROUNDS: u64 = 5_000;

/// One test at a time: each keeps two busy-polling threads.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn fabric(ex: &LocalExchange, rank: u32) -> Fabric {
    FabricBuilder::new(rank, 2)
        .job_key([4; 32])
        .config(Config {
            progress: ProgressMode::BusyPoll,
            ..Config::default()
        })
        .build(ex)
        .await
        .unwrap()
}

/// Receive message `i` (24 bytes from rank 0, numbered in its first 8)
/// into `buf`, with `recv_into` (`lend`) or with `recv` and a copy.
async fn take(rx: &mut async_btl::Receiver, buf: &mut Vec<u8>, lend: bool, i: u64) {
    let next = async {
        if lend {
            rx.recv_into(buf).await
        } else {
            let m = rx.recv().await?;
            buf.clear();
            buf.extend_from_slice(&m.data);
            Ok(m.src)
        }
    };
    let src = tokio::time::timeout(Duration::from_secs(20), next)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(src, 0);
    assert_eq!(buf.len(), 24);
    assert_eq!(buf[..8], i.to_le_bytes(), "message {i} out of order");
}

/// A ping-pong of `ROUNDS` 24-byte messages; rank 1 receives with
/// `recv_into` (`lend`) or `recv`, checks each, and returns its thread's
/// allocations per message over the timed part.
fn ping_pong(lend: bool) -> f64 {
    let ex = LocalExchange::new(2);
    let ex0 = ex.clone();
    let pinger = std::thread::spawn(move || {
        runtime().block_on(async move {
            let f = fabric(&ex0, 0).await;
            let ep = f.endpoint(1).unwrap();
            let mut rx = f.receiver(2).unwrap();
            for i in 0..ROUNDS + 100 {
                let mut m = [0u8; 24];
                m[..8].copy_from_slice(&i.to_le_bytes());
                ep.send_inline(1, &m).await.unwrap();
                let back = rx.recv().await.unwrap();
                assert_eq!(back.data[..8], i.to_le_bytes());
            }
            f.close().await.unwrap();
        })
    });
    let per_message = runtime().block_on(async move {
        let f = fabric(&ex, 1).await;
        let ep = f.endpoint(0).unwrap();
        let mut rx = f.receiver(1).unwrap();
        let mut buf = Vec::with_capacity(64);
        let mut start = 0;
        for i in 0..ROUNDS + 100 {
            if i == 100 {
                start = allocs();
            }
            take(&mut rx, &mut buf, lend, i).await;
            ep.send_inline(2, &buf).await.unwrap();
        }
        let per = (allocs() - start) as f64 / ROUNDS as f64;
        f.close().await.unwrap();
        per
    });
    pinger.join().unwrap();
    per_message
}

#[test]
fn a_receive_loop_into_one_buffer_allocates_nothing_per_message() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let lent = ping_pong(true);
    let own = ping_pong(false);
    println!("allocations per message on the receiving thread: recv_into {lent:.3}, recv {own:.3}");
    // `recv` builds a buffer for every message; `recv_into` copies the
    // fast box straight into the lent one (the odd message the progress
    // task queued meanwhile still has its own).
    assert!(own >= 0.9, "recv allocated {own} per message");
    assert!(lent <= 0.25, "recv_into allocated {lent} per message");
}

/// A stream of `ROUNDS` 24-byte messages in windows of `WINDOW`, each
/// window answered by one ack: rank 1 receives with `recv_into` (`lend`)
/// or `recv`, checks each, and returns its thread's allocations per
/// message over the timed part.
fn stream(lend: bool) -> f64 {
    const WINDOW: u64 = 64;
    let ex = LocalExchange::new(2);
    let ex0 = ex.clone();
    let sender = std::thread::spawn(move || {
        runtime().block_on(async move {
            let f = fabric(&ex0, 0).await;
            let ep = f.endpoint(1).unwrap();
            let mut rx = f.receiver(2).unwrap();
            for w in 0..(ROUNDS + 128) / WINDOW {
                for j in 0..WINDOW {
                    let mut m = [0u8; 24];
                    m[..8].copy_from_slice(&(w * WINDOW + j).to_le_bytes());
                    ep.send_inline(1, &m).await.unwrap();
                }
                rx.recv().await.unwrap();
            }
            f.close().await.unwrap();
        })
    });
    let per_message = runtime().block_on(async move {
        let f = fabric(&ex, 1).await;
        let ep = f.endpoint(0).unwrap();
        let mut rx = f.receiver(1).unwrap();
        let mut buf = Vec::with_capacity(64);
        let mut start = 0;
        let total = (ROUNDS + 128) / WINDOW * WINDOW;
        for i in 0..total {
            if i == 128 {
                start = allocs();
            }
            take(&mut rx, &mut buf, lend, i).await;
            if i % WINDOW == WINDOW - 1 {
                ep.send_inline(2, &[1]).await.unwrap();
            }
        }
        let per = (allocs() - start) as f64 / (total - 128) as f64;
        f.close().await.unwrap();
        per
    });
    sender.join().unwrap();
    per_message
}

#[test]
fn a_stream_received_into_one_buffer_allocates_nothing_per_message() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let lent = stream(true);
    let own = stream(false);
    println!("allocations per streamed message on the receiving thread: recv_into {lent:.3}, recv {own:.3}");
    // Several messages arrive per progress call: the first goes into the
    // lent buffer, the others into the receiver's kept buffer.
    assert!(own >= 0.9, "recv allocated {own} per message");
    assert!(lent <= 0.25, "recv_into allocated {lent} per message");
}

#[test]
fn messages_queued_before_the_receive_come_whole_and_in_order() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    runtime().block_on(async {
        let ex = LocalExchange::new(2);
        let (a, b) = futures::join!(fabric(&ex, 0), fabric(&ex, 1));
        let ep = a.endpoint(1).unwrap();
        let sizes = [0usize, 1, 24, 1000, 5000, 70_000, 3];
        for (i, n) in sizes.iter().enumerate() {
            ep.send(9, vec![i as u8; *n]).await.unwrap();
        }
        let mut rx = b.receiver(9).unwrap();
        let mut buf = vec![0xffu8; 10];
        for (i, n) in sizes.iter().enumerate() {
            let src = rx.recv_into(&mut buf).await.unwrap();
            assert_eq!(src, 0);
            assert_eq!(buf.len(), *n, "message {i}");
            assert!(buf.iter().all(|x| *x == i as u8), "message {i}");
        }
        futures::try_join!(a.close(), b.close()).unwrap();
    });
}

/// While a ping-pong's ranks take every message straight from the fast
/// box (`recv_into`), their transports still serve the rest: a get of rank
/// 0's registered memory by rank 1, which rank 0's progress answers over
/// the control channel, completes within a few rounds. Both fabrics run on
/// one thread, so every receive finds its message at once and nothing but
/// the ping-pong's own polls makes progress; the get is polled once a
/// round.
#[test]
fn a_get_is_served_while_a_ping_pong_takes_its_messages_directly() {
    const LONG: u64 = 2_000;
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    runtime().block_on(async {
        let ex = LocalExchange::new(2);
        let (a, b) = futures::join!(fabric(&ex, 0), fabric(&ex, 1));
        let window = a.register((0..4096).map(|i| i as u8).collect::<Vec<u8>>());
        let key = window.remote_key();
        let local = b.register(vec![0u8; 64]);
        let (ea, eb) = (a.endpoint(1).unwrap(), b.endpoint(0).unwrap());
        let (mut ra, mut rb) = (a.receiver(2).unwrap(), b.receiver(1).unwrap());
        // A first get: the key's first use sets up its path, which is not
        // what is measured here.
        eb.get(&local, 0..64, &key, 0).await.unwrap();
        let mut get = std::pin::pin!(eb.get(&local, 0..64, &key, 100));
        let mut done_at = None;
        let (mut ba, mut bb) = (Vec::with_capacity(64), Vec::with_capacity(64));
        for i in 0..LONG {
            let mut m = [0u8; 24];
            m[..8].copy_from_slice(&i.to_le_bytes());
            ea.send_inline(1, &m).await.unwrap();
            take(&mut rb, &mut bb, true, i).await;
            eb.send_inline(2, &bb).await.unwrap();
            let src = ra.recv_into(&mut ba).await.unwrap();
            assert_eq!((src, &ba[..8]), (1, &i.to_le_bytes()[..]));
            if done_at.is_none() {
                if let std::task::Poll::Ready(r) = futures::poll!(get.as_mut()) {
                    r.unwrap();
                    done_at = Some(i);
                }
            }
        }
        let done_at = done_at.expect("the get completed during the ping-pong");
        println!("the get completed in round {done_at} of {LONG}");
        // Served at rank 0's next progress call: a request waiting on the
        // control channel ends a run of direct takes within a few of them,
        // however fast each finds its message.
        assert!(
            done_at <= 40,
            "the get waited {done_at} rounds of the ping-pong"
        );
        drop((ra, rb));
        let Ok(got) = local.try_into_vec() else {
            panic!("the region is ours alone");
        };
        assert_eq!(got, (100..164).map(|i| i as u8).collect::<Vec<u8>>());
        futures::try_join!(a.close(), b.close()).unwrap();
        drop(window);
    });
}

/// Small messages already waiting in the fast box when `recv_into` looks
/// (a receiver behind its sender takes several at once, handing out the
/// rest from its kept buffer): every one comes whole and in order, and
/// those taken but not yet handed out when the receiver is dropped go to
/// the next receiver of the tag, ahead of what the box still holds. The
/// ranks run on threads of their own, the receiver's blocked while the
/// sender fills the box, so that no progress of the receiver's takes the
/// messages out of the box first.
#[test]
fn small_messages_taken_ahead_survive_a_dropped_receiver_in_order() {
    // One- and two-slot sizes and their edges (48/49, 104/105), and a
    // longer one now and then; under the box's 256 slots in all.
    const SIZES: [usize; 11] = [0, 1, 8, 47, 48, 49, 64, 100, 104, 105, 300];
    const N: usize = 60;
    fn msg(i: usize) -> Vec<u8> {
        (0..SIZES[i % SIZES.len()])
            .map(|k| (i * 7 + k) as u8)
            .collect()
    }
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let ex = LocalExchange::new(2);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (sent_tx, sent_rx) = std::sync::mpsc::channel::<()>();
    let ex_a = ex.clone();
    let sender = std::thread::spawn(move || {
        runtime().block_on(async {
            let a = fabric(&ex_a, 0).await;
            let ep = a.endpoint(1).unwrap();
            // A first message gets the pair's box started (its first
            // message always goes the general way).
            ep.send(5, msg(0)).await.unwrap();
            ready_rx.recv().unwrap();
            for i in 1..N {
                ep.send(5, msg(i)).await.unwrap();
            }
            sent_tx.send(()).unwrap();
            a.close().await.unwrap();
        })
    });
    runtime().block_on(async {
        let b = fabric(&ex, 1).await;
        let mut rx = b.receiver(5).unwrap();
        let mut buf = Vec::new();
        let first = tokio::time::timeout(Duration::from_secs(20), rx.recv_into(&mut buf));
        assert_eq!(first.await.unwrap().unwrap(), 0);
        assert_eq!(buf, msg(0));
        ready_tx.send(()).unwrap();
        // Blocks this runtime, and with it this rank's progress.
        sent_rx.recv().unwrap();
        // The first take finds more waiting behind it (sizes 1 to 104)
        // and holds them: dropped with some of them held.
        for i in 1..4 {
            assert_eq!(rx.recv_into(&mut buf).await.unwrap(), 0);
            assert_eq!(buf, msg(i), "message {i}");
        }
        drop(rx);
        let mut rx = b.receiver(5).unwrap();
        for i in 4..N {
            let m = tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .unwrap()
                .unwrap();
            assert_eq!((m.src, &m.data[..]), (0, &msg(i)[..]), "message {i}");
        }
        b.close().await.unwrap();
    });
    sender.join().unwrap();
}

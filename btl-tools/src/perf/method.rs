//! What each test does, on rank 0 (which times) and rank 1 (which answers).
//!
//! Over any [`Wire`]:
//! - `lat`: ping-pong of `size`-byte messages; half the round trip.
//! - `bw`, `msg_rate`: rank 0 sends a window of messages, rank 1 receives
//!   them all and answers with a 4-byte ack; bytes (or messages) over time.
//! - `bibw`: both send a window and receive a window at once.
//! - `put_lat` / `get_lat` on a socket: the same semantics as a put or get
//!   that completes remotely: send `size` bytes and wait for a 4-byte ack,
//!   or send an 8-byte request and wait for `size` bytes. One at a time,
//!   the whole round trip (as OSU's one-sided latency tests report).
//! - `put_bw` / `get_bw` on a socket: a window of `size`-byte messages
//!   towards rank 1 then an ack, or an 8-byte request then a window back.
//!
//! - `atomic_lat` / `atomic_cswap_lat` on a socket: what an atomic carried
//!   by messages costs at the least: send a request ([`ATOMIC_REQUEST`] or
//!   [`CSWAP_REQUEST`] bytes: offset and operands), wait for the 8-byte
//!   previous value. `atomic_rate`: a window of requests, then an ack.
//!
//! Over async-btl, the one-sided tests use real `put`/`get` into a region
//! that rank 1 allocated with `alloc_region` ([`rma_timed`]), and the
//! atomic tests real `fetch_add`/`compare_swap`/`atomic_add_nbi` on words
//! of rank 1's region ([`atomic_timed`]); rank 1 only waits.

use std::time::{Duration, Instant};

use super::plan::Plan;
use super::wire::Wire;
use super::{Test, Unit};
use async_btl::{Endpoint, MemoryRegion, RemoteKey, Result};

/// Length of an acknowledgement.
pub const ACK: usize = 4;
/// Length of a get request on a socket wire.
pub const REQUEST: usize = 8;
/// Length of an atomic add request on a socket wire: offset and operand.
pub const ATOMIC_REQUEST: usize = 16;
/// Length of a compare-and-swap request on a socket wire: offset, the
/// expected and the new value.
pub const CSWAP_REQUEST: usize = 24;
/// Length of an atomic's answer: the word's previous value.
pub const ATOMIC_ANSWER: usize = 8;

/// The word of the atomic target `atomic_lat` adds to (each test has a
/// word of its own, a cache line apart, so that one test's value does not
/// disturb another's check).
pub const FADD_WORD: u64 = 0;
/// The word `atomic_cswap_lat` swaps.
pub const CSWAP_WORD: u64 = 64;
/// The word `atomic_rate` adds to.
pub const ADD_WORD: u64 = 128;
/// Bytes of the atomic target that rank 1 makes.
pub const ATOMIC_TARGET: usize = 192;

/// Times a loop whose first `warmup` turns are not counted.
struct Clock {
    warmup: u64,
    start: Instant,
}

impl Clock {
    fn new(plan: &Plan) -> Clock {
        Clock {
            warmup: plan.warmup,
            start: Instant::now(),
        }
    }
    /// Call at the top of turn `i`.
    fn tick(&mut self, i: u64) {
        if i == self.warmup {
            self.start = Instant::now();
        }
    }
    fn elapsed(&self) -> Duration {
        self.start.elapsed().max(Duration::from_nanos(1))
    }
}

/// Turn a timed loop into the test's unit.
fn value(test: Test, size: usize, plan: &Plan, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    let ops = (plan.iters * plan.window) as f64;
    match test.unit() {
        Unit::Micros => {
            let per = secs * 1e6 / plan.iters as f64;
            if test == Test::Lat {
                per / 2.0
            } else {
                per
            }
        }
        Unit::MBps => {
            let both = if test == Test::Bibw { 2.0 } else { 1.0 };
            both * ops * size as f64 / secs / 1e6
        }
        Unit::MsgPerSec | Unit::OpsPerSec => ops / secs,
    }
}

/// Run `test` at `size` over `w` as `rank` (0 or 1). Rank 0 returns the
/// measured value, rank 1 `None`.
pub async fn on_wire<W: Wire>(
    w: &mut W,
    rank: u32,
    test: Test,
    size: usize,
    plan: &Plan,
) -> Result<Option<f64>> {
    let turns = plan.warmup + plan.iters;
    let n = plan.window;
    let mut clock = Clock::new(plan);
    let timer = rank == 0;
    for i in 0..turns {
        clock.tick(i);
        match (test, timer) {
            (Test::Lat, true) => {
                w.send(size).await?;
                w.recv(size).await?;
            }
            (Test::Lat, false) => {
                w.recv(size).await?;
                w.send(size).await?;
            }
            (Test::Bw | Test::PutBw | Test::MsgRate, true) => {
                w.send_window(size, n).await?;
                w.recv(ACK).await?;
            }
            (Test::Bw | Test::PutBw | Test::MsgRate, false) => {
                w.recv_window(size, n).await?;
                w.send(ACK).await?;
            }
            (Test::Bibw, _) => w.exchange_window(size, n).await?,
            (Test::PutLat, true) => {
                w.send(size).await?;
                w.recv(ACK).await?;
            }
            (Test::PutLat, false) => {
                w.recv(size).await?;
                w.send(ACK).await?;
            }
            (Test::GetLat, true) => {
                w.send(REQUEST).await?;
                w.recv(size).await?;
            }
            (Test::GetLat, false) => {
                w.recv(REQUEST).await?;
                w.send(size).await?;
            }
            (Test::GetBw, true) => {
                w.send(REQUEST).await?;
                w.recv_window(size, n).await?;
            }
            (Test::GetBw, false) => {
                w.recv(REQUEST).await?;
                w.send_window(size, n).await?;
            }
            (Test::AtomicLat | Test::AtomicCswapLat, true) => {
                w.send(request_len(test)).await?;
                w.recv(ATOMIC_ANSWER).await?;
            }
            (Test::AtomicLat | Test::AtomicCswapLat, false) => {
                w.recv(request_len(test)).await?;
                w.send(ATOMIC_ANSWER).await?;
            }
            (Test::AtomicRate, true) => {
                w.send_window(ATOMIC_REQUEST, n).await?;
                w.recv(ACK).await?;
            }
            (Test::AtomicRate, false) => {
                w.recv_window(ATOMIC_REQUEST, n).await?;
                w.send(ACK).await?;
            }
        }
    }
    Ok(timer.then(|| value(test, size, plan, clock.elapsed())))
}

/// The request an atomic test sends on a socket wire.
fn request_len(test: Test) -> usize {
    if test == Test::AtomicCswapLat {
        CSWAP_REQUEST
    } else {
        ATOMIC_REQUEST
    }
}

/// Time an atomic test (`atomic_lat`, `atomic_cswap_lat`, `atomic_rate`)
/// over async-btl from rank 0, on the words of rank 1's region `key`
/// ([`FADD_WORD`], [`CSWAP_WORD`], [`ADD_WORD`]).
///
/// - `atomic_lat`: one `fetch_add(1)` at a time, each awaited (the
///   previous value is back: remote completion).
/// - `atomic_cswap_lat`: one `compare_swap(old, old + 1)` at a time, each
///   with the value the last one returned, so that every swap succeeds.
/// - `atomic_rate`: windows of `atomic_add_nbi(1)`, each window completed
///   by one `flush` (a shmem_atomic_add loop and a quiet; MPI_Accumulate
///   then MPI_Win_flush).
///
/// Every answer is checked (each fetch returns the last value plus one,
/// and the added word holds every add once the test is over), so a wrong
/// atomic fails the run instead of giving a figure.
pub async fn atomic_timed(ep: &Endpoint, key: &RemoteKey, test: Test, plan: &Plan) -> Result<f64> {
    let wrong = |what: &str, got: u64, want: u64| {
        async_btl::Error::Misuse(format!(
            "{test}: {what} returned {got} where {want} was due: the remote atomic is wrong"
        ))
    };
    let mut clock = Clock::new(plan);
    match test {
        Test::AtomicLat => {
            let mut last = ep.fetch_add(key, FADD_WORD, 0).await?;
            for i in 0..plan.warmup + plan.iters {
                clock.tick(i);
                let old = ep.fetch_add(key, FADD_WORD, 1).await?;
                if old != last {
                    return Err(wrong("fetch_add", old, last));
                }
                last = old.wrapping_add(1);
            }
        }
        Test::AtomicCswapLat => {
            let mut last = ep.fetch_add(key, CSWAP_WORD, 0).await?;
            for i in 0..plan.warmup + plan.iters {
                clock.tick(i);
                let next = last.wrapping_add(1);
                let old = ep.compare_swap(key, CSWAP_WORD, last, next).await?;
                if old != last {
                    return Err(wrong("compare_swap", old, last));
                }
                last = next;
            }
        }
        Test::AtomicRate => {
            let start = ep.fetch_add(key, ADD_WORD, 0).await?;
            let turns = plan.warmup + plan.iters;
            for i in 0..turns {
                clock.tick(i);
                for _ in 0..plan.window {
                    ep.atomic_add_nbi(key, ADD_WORD, 1)?;
                }
                ep.flush().await?;
            }
            let elapsed = clock.elapsed();
            let end = ep.fetch_add(key, ADD_WORD, 0).await?;
            let want = start.wrapping_add(turns * plan.window);
            if end != want {
                return Err(wrong("the word after every add", end, want));
            }
            return Ok(value(test, 8, plan, elapsed));
        }
        _ => {
            return Err(async_btl::Error::Misuse(format!(
                "{test} is not an atomic test"
            )))
        }
    }
    Ok(value(test, 8, plan, clock.elapsed()))
}

/// What rank 0 needs for async-btl's one-sided tests.
pub struct RmaSide<'a> {
    /// The endpoint to rank 1.
    pub ep: &'a Endpoint,
    /// Our buffer (source of puts, destination of gets).
    pub local: &'a MemoryRegion,
    /// Rank 1's region.
    pub key: &'a RemoteKey,
    /// In `put_bw`/`get_bw`: one `put`/`get` future per operation (each
    /// answered by the target) instead of `put_nbi`/`get_nbi`.
    pub futures: bool,
}

/// Time a one-sided test (`put_lat`, `put_bw`, `get_lat`, `get_bw`) over
/// async-btl from rank 0. Latency: one `put`/`get` future at a time (it
/// resolves at remote completion). Bandwidth: a window of `put_nbi`/
/// `get_nbi` (or, with `futures`, of futures all made, then awaited
/// together) and the `flush` that completes them.
pub async fn rma_timed(side: &RmaSide<'_>, test: Test, size: usize, plan: &Plan) -> Result<f64> {
    let RmaSide {
        ep,
        local,
        key,
        futures,
    } = side;
    let put = matches!(test, Test::PutLat | Test::PutBw);
    let mut clock = Clock::new(plan);
    for i in 0..plan.warmup + plan.iters {
        clock.tick(i);
        if !test.windowed() {
            // One operation and its future: the whole round trip.
            if put {
                ep.put(local, 0..size, key, 0).await?;
            } else {
                ep.get(local, 0..size, key, 0).await?;
            }
        } else if *futures {
            let n = plan.window;
            if put {
                window(n, || ep.put(local, 0..size, key, 0)).await?;
            } else {
                window(n, || ep.get(local, 0..size, key, 0)).await?;
            }
            ep.flush().await?;
        } else {
            // A window of implicit operations, then the flush that
            // completes them: MPI_Put/MPI_Get in a loop, then
            // MPI_Win_flush, as OSU's one-sided bandwidth tests do.
            for _ in 0..plan.window {
                if put {
                    ep.put_nbi(local, 0..size, key, 0)?;
                } else {
                    ep.get_nbi(local, 0..size, key, 0)?;
                }
            }
            ep.flush().await?;
        }
    }
    Ok(value(test, size, plan, clock.elapsed()))
}

/// Start `n` operations in order (each starts when its future is made;
/// a put into a mapped region is done then), then wait for them together:
/// the async form of MPI_Put in a loop before the flush.
async fn window<F>(n: u64, mut op: impl FnMut() -> F) -> Result<()>
where
    F: std::future::Future<Output = Result<()>> + Unpin,
{
    let mut pending: Vec<F> = (0..n).map(|_| op()).collect();
    // Wait for them by polling them in place, all with the task's
    // waker (`try_join_all` of more than 30 futures builds a
    // `FuturesOrdered`: an allocation and a waker per future, which cost
    // as much as an emulated put itself).
    futures::future::poll_fn(|cx| {
        let mut failed = None;
        pending.retain_mut(|f| match std::pin::Pin::new(f).poll(cx) {
            std::task::Poll::Ready(Ok(())) => false,
            std::task::Poll::Ready(Err(e)) => {
                failed.get_or_insert(e);
                false
            }
            std::task::Poll::Pending => true,
        });
        match failed {
            Some(e) => std::task::Poll::Ready(Err(e)),
            None if pending.is_empty() => std::task::Poll::Ready(Ok(())),
            None => std::task::Poll::Pending,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_osu_conventions() {
        let p = Plan {
            iters: 10,
            warmup: 0,
            window: 4,
        };
        let s = Duration::from_secs(1);
        // Ping-pong: half of (1 s / 10 round trips) = 50 ms.
        assert!((value(Test::Lat, 8, &p, s) - 50_000.0).abs() < 1e-6);
        // Puts: the whole operation, 100 ms each.
        assert!((value(Test::PutLat, 8, &p, s) - 100_000.0).abs() < 1e-6);
        // 40 messages of 1 MB in 1 s.
        assert!((value(Test::Bw, 1_000_000, &p, s) - 40.0).abs() < 1e-9);
        assert!((value(Test::Bibw, 1_000_000, &p, s) - 80.0).abs() < 1e-9);
        assert!((value(Test::MsgRate, 8, &p, s) - 40.0).abs() < 1e-9);
        // Atomics: a whole operation each, or operations per second.
        assert!((value(Test::AtomicLat, 8, &p, s) - 100_000.0).abs() < 1e-6);
        assert!((value(Test::AtomicCswapLat, 8, &p, s) - 100_000.0).abs() < 1e-6);
        assert!((value(Test::AtomicRate, 8, &p, s) - 40.0).abs() < 1e-9);
    }
}

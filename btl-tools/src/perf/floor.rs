//! The machine's own floor for a small-message hop, read around each run: an
//! 8-byte ping-pong between two threads, pinned to the two ranks' cores,
//! through two atomic words on cache lines of their own. No library, no
//! protocol: one line crossing between the cores per hop, which is what
//! any shared-memory transport's small-message latency rests on. Rank 0
//! reads it in a child process of its own ([`best_floor_apart`]), so the
//! rank keeps the threads it had: a rank with one thread keeps the C
//! library's single-thread fast paths (see `BTL_LIVENESS`).
//!
//! Why: shared and virtual machines change speed every few minutes (a
//! line crossing can take four times as long in one phase as in the
//! other, on the same machine). A run whose floor moved
//! between its start and its end compares points taken in different
//! phases, and the report says so.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pin::pin_current_thread;

/// Round trips timed per reading (after as many again to warm up).
pub const ROUND_TRIPS: u64 = 30_000;

/// Readings per floor, of which the fastest counts: a reading that another
/// process's burst of work on one of the cores slowed (rank 1 starting
/// up, say) is not the machine's speed.
pub const READINGS: usize = 3;

/// Give up (no figure) if the ping-pong has not finished by then: the two
/// threads may share a core after all, where each hop waits for a
/// scheduler tick.
const DEADLINE: Duration = Duration::from_secs(2);

/// Spins between two looks at the clock while waiting.
const SPINS_PER_CLOCK: u32 = 4096;

/// One word alone on its pair of cache lines (the adjacent-line prefetcher
/// fetches lines in 128-byte pairs).
#[repr(align(128))]
#[derive(Default)]
struct Line(AtomicU64);

#[derive(Default)]
struct Pair {
    ping: Line,
    pong: Line,
    /// Set by either side that gave up, so the other stops too.
    gave_up: AtomicBool,
}

/// Wait until `w` holds `want`; false if the deadline passed or the other
/// side gave up.
fn wait_for(w: &AtomicU64, want: u64, p: &Pair, deadline: Instant) -> bool {
    let mut spins = 0u32;
    while w.load(Ordering::Acquire) != want {
        spins += 1;
        if spins == SPINS_PER_CLOCK {
            spins = 0;
            if Instant::now() > deadline || p.gave_up.load(Ordering::Relaxed) {
                p.gave_up.store(true, Ordering::Relaxed);
                return false;
            }
        }
    }
    true
}

/// Half the round trip of an 8-byte ping-pong between a thread on
/// `cores.0` (the calling thread, which must already run there) and one on
/// `cores.1`, in µs; `None` when the cores are the same, a thread cannot
/// be pinned, or the exchange does not finish within two seconds.
pub fn line_floor(cores: (usize, usize), round_trips: u64) -> Option<f64> {
    if cores.0 == cores.1 || round_trips == 0 {
        return None;
    }
    let total = round_trips.checked_mul(2)?;
    let pair = Arc::new(Pair::default());
    let deadline = Instant::now() + DEADLINE;
    let theirs = pair.clone();
    let echo = std::thread::Builder::new()
        .name("btl-perf-floor".into())
        .spawn(move || {
            let p = &*theirs;
            if pin_current_thread(cores.1).is_err() {
                p.gave_up.store(true, Ordering::Relaxed);
                return;
            }
            for seq in 1..=total {
                if !wait_for(&p.ping.0, seq, p, deadline) {
                    return;
                }
                p.pong.0.store(seq, Ordering::Release);
            }
        })
        .ok()?;
    let p = &*pair;
    let mut start = Instant::now();
    let mut ok = true;
    for seq in 1..=total {
        if seq == round_trips + 1 {
            start = Instant::now();
        }
        p.ping.0.store(seq, Ordering::Release);
        if !wait_for(&p.pong.0, seq, p, deadline) {
            ok = false;
            break;
        }
    }
    let elapsed = start.elapsed();
    if !ok {
        p.gave_up.store(true, Ordering::Relaxed);
    }
    let joined = echo.join().is_ok();
    (ok && joined).then(|| half_round_trip_us(elapsed, round_trips))
}

/// The fastest of [`READINGS`] readings of [`line_floor`], or `None` if
/// none could be taken.
pub fn best_floor(cores: (usize, usize)) -> Option<f64> {
    (0..READINGS)
        .filter_map(|_| line_floor(cores, ROUND_TRIPS))
        .min_by(f64::total_cmp)
}

/// The variable that has a process started by [`best_floor_apart`] read
/// the floor and exit (see [`probe_main`]): the two cores, `A,B`.
pub const PROBE_VAR: &str = "BTL_PERF_FLOOR_PROBE";

/// [`best_floor`] read by a child process: this executable, run again with
/// [`PROBE_VAR`] (its `main` calls [`probe_main`] first). `None` when the
/// child cannot start or reads no floor.
pub fn best_floor_apart(cores: (usize, usize)) -> Option<f64> {
    let exe = std::env::current_exe().ok()?;
    let out = std::process::Command::new(exe)
        .env(PROBE_VAR, format!("{},{}", cores.0, cores.1))
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .ok()
        .filter(|f: &f64| f.is_finite() && *f > 0.0)
}

/// In a process started by [`best_floor_apart`]: pin to the first core,
/// read the floor, print it in µs and say how that went; `None` in any
/// other process.
pub fn probe_main() -> Option<std::process::ExitCode> {
    let v = std::env::var(PROBE_VAR).ok()?;
    let cores = v
        .split_once(',')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
    let floor = cores.and_then(|c: (usize, usize)| {
        pin_current_thread(c.0).ok()?;
        best_floor(c)
    });
    Some(match floor {
        Some(f) => {
            println!("{f}");
            std::process::ExitCode::SUCCESS
        }
        None => std::process::ExitCode::FAILURE,
    })
}

/// Half of one round trip, in µs, when `round_trips` took `elapsed`.
fn half_round_trip_us(elapsed: Duration, round_trips: u64) -> f64 {
    elapsed.as_secs_f64() * 1e6 / round_trips as f64 / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_core_twice_gives_no_floor() {
        assert_eq!(line_floor((0, 0), 10), None);
        assert_eq!(line_floor((0, 1), 0), None);
        assert_eq!(line_floor((0, 1), u64::MAX), None, "no overflow");
    }

    #[test]
    fn a_round_trip_is_two_hops_in_microseconds() {
        assert_eq!(half_round_trip_us(Duration::from_secs(1), 1_000_000), 0.5);
        assert_eq!(half_round_trip_us(Duration::from_micros(300), 1000), 0.15);
    }

    #[test]
    fn an_echo_that_cannot_be_pinned_gives_up_without_hanging() {
        let allowed = crate::perf::pin::allowed_cores();
        let Some(&first) = allowed.first() else {
            eprintln!("skipped: the kernel did not say which cores this process may use");
            return;
        };
        // A core outside this process's set: pinning the echo there fails.
        let Some(outside) = (0..1024).find(|c| !allowed.contains(c)) else {
            eprintln!("skipped: every core up to 1023 is allowed here");
            return;
        };
        let t = Instant::now();
        let got = std::thread::spawn(move || {
            pin_current_thread(first).expect("pin to an allowed core");
            line_floor((first, outside), 1000)
        })
        .join()
        .expect("floor thread");
        assert_eq!(got, None);
        assert!(
            t.elapsed() < DEADLINE + Duration::from_secs(1),
            "gave up in time"
        );
    }

    #[test]
    fn two_cores_give_a_positive_floor() {
        let cores = crate::perf::pin::allowed_cores();
        let &[a, b, ..] = cores.as_slice() else {
            eprintln!("skipped: this process may use {cores:?}; the floor needs two cores");
            return;
        };
        // Both threads pin themselves; the calling one first, as a rank does.
        let ok = std::thread::spawn(move || {
            pin_current_thread(a).expect("pin to the first allowed core");
            line_floor((a, b), 1000)
        })
        .join()
        .expect("floor thread");
        let v = ok.expect("a floor between two allowed cores");
        assert!(v.is_finite() && v > 0.0, "floor {v} µs");
        // A hop across cores takes less than a millisecond on any machine
        // this runs on (a sanity bound, not a speed claim).
        assert!(v < 1000.0, "floor {v} µs");
    }
}

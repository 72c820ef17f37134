//! How many iterations each size gets: the requested counts up to 8 KiB,
//! then fewer in proportion to the size (as the OSU benchmarks do), so that
//! a run up to 16 MiB still takes seconds.

use serde::{Deserialize, Serialize};

use super::Test;

/// Sizes up to this many bytes get the full counts.
pub const SMALL: usize = 8 << 10;

/// Bytes one window of a bandwidth test may hold before the window shrinks.
pub const WINDOW_BYTES: usize = 16 << 20;

/// `msg_rate`'s window, in windows of the bandwidth tests: its messages
/// go out as one long stream with an acknowledgement only every 64
/// windows (4096 messages by default), as UCX's `tag_bw` streams with no
/// answer until the end, so that the rate is the stream's and not that of
/// a round trip per 64 messages. (`bw` keeps the OSU window: a round trip
/// per window, as `osu_bw` and Open MPI's baseline do.)
pub const MSG_RATE_WINDOWS: u64 = 64;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Timed iterations of a latency test at small sizes. Windowed tests
    /// time a tenth as many windows.
    pub iters: u64,
    /// Untimed iterations first (a tenth as many for windowed tests).
    pub warmup: u64,
    /// Operations in flight per window.
    pub window: u64,
}

/// What one measurement runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Timed iterations (windows for windowed tests).
    pub iters: u64,
    /// Untimed iterations before them.
    pub warmup: u64,
    /// Operations per window (1 for latency tests).
    pub window: u64,
}

impl Counts {
    /// The plan for `test` at `size` bytes.
    pub fn plan(&self, test: Test, size: usize) -> Plan {
        let scale = |n: u64, floor: u64| -> u64 {
            if size <= SMALL {
                n.max(floor)
            } else {
                (n.saturating_mul(SMALL as u64) / size as u64).max(floor)
            }
        };
        if test.windowed() {
            let fits = WINDOW_BYTES
                .checked_div(size)
                .map_or(self.window, |n| n.max(2) as u64);
            let asked = if test == Test::MsgRate {
                self.window.saturating_mul(MSG_RATE_WINDOWS)
            } else {
                self.window
            };
            let window = asked.min(fits).max(1);
            let (iters, warmup) = ((self.iters / 10).max(1), self.warmup / 10);
            Plan {
                iters: scale(iters, 5.min(iters)),
                warmup: scale(warmup, 1.min(warmup)),
                window,
            }
        } else {
            Plan {
                iters: scale(self.iters.max(1), 10.min(self.iters.max(1))),
                warmup: scale(self.warmup, 2.min(self.warmup)),
                window: 1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_sizes_get_fewer_iterations() {
        let c = Counts {
            iters: 1000,
            warmup: 100,
            window: 64,
        };
        assert_eq!(
            c.plan(Test::Lat, 8),
            Plan {
                iters: 1000,
                warmup: 100,
                window: 1
            }
        );
        let big = c.plan(Test::Lat, 16 << 20);
        assert_eq!((big.iters, big.warmup), (10, 2));
        let bw = c.plan(Test::Bw, 8);
        assert_eq!((bw.iters, bw.warmup, bw.window), (100, 10, 64));
        let bwbig = c.plan(Test::Bw, 16 << 20);
        assert_eq!((bwbig.iters, bwbig.window), (5, 2));
        let rate = c.plan(Test::MsgRate, 8);
        assert_eq!((rate.iters, rate.window), (100, 64 * MSG_RATE_WINDOWS));
    }

    #[test]
    fn tiny_requests_are_kept() {
        let c = Counts {
            iters: 2,
            warmup: 0,
            window: 4,
        };
        let p = c.plan(Test::Bw, 1 << 20);
        assert_eq!((p.iters, p.warmup, p.window), (1, 0, 4));
        let l = c.plan(Test::Lat, 1 << 20);
        assert_eq!((l.iters, l.warmup), (2, 0));
    }
}

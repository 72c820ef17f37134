//! Mid-sized messages: single copy or fragments, whichever costs less on
//! this machine now, measured by the sender on its own data path.
//!
//! From [`SmConfig::cma_min`](super::config::SmConfig::cma_min) up to
//! [`SmConfig::adapt_max`](super::config::SmConfig::adapt_max) neither
//! protocol wins everywhere. A kernel single copy pays a fixed price per
//! message (a system call that pins the source's pages: on a KVM guest,
//! about 0.6x the time of a whole 16 KiB single copy) and reads lines the
//! sender left clean. Two copies through fragments pay nothing fixed, but
//! move each line between the two cores twice: cheap when the cores share
//! a cache, and several times dearer when they sit on different dies or
//! sockets, or a hypervisor puts them there for a while. On one guest, a
//! 16 KiB ping-pong took 0.6-0.8x as long through fragments as by single
//! copy while the two vCPUs shared a cache, and 1.8-2.2x as long while
//! they did not.
//!
//! So the sender keeps, per peer and per size class (a power of two from
//! `cma_min`, at most [`CLASSES`] of them), two running estimates:
//! - fragments: twice its own copies of a whole message into fragments
//!   (the receiver copies the message out again at about the same rate,
//!   and the copy in is what grows most when lines cross dies; taking and
//!   posting fragments costs little either way), from the messages it
//!   pushed at once; a message sent to measure fragments again takes the
//!   max fragment given back last, whose lines are as warm as those of
//!   fragments in steady use;
//! - single copy: the time from announcing a message to the sender's
//!   progress seeing the receiver's done word (the receiver's delay in
//!   taking the announcement, its copy, and both hand-overs), from the
//!   announcements that went out at once to a receiver that had taken
//!   everything sent to it before (in a stream, the first of a burst).
//!
//! A message in the band that finds its peer caught up with us (it took
//! everything we sent it before: a request, an answer, the first of a
//! burst) takes the cheaper one, and every [`EXPLORE`]th such message the
//! other, so an estimate that went stale (the machine changed) is
//! measured again; a way not measured yet is taken first. Within a burst
//! the older rule stands: single copy, and fragments while one of ours is
//! still being copied, so that both cores copy at once (where fragments
//! alone, across dies, streamed at half the rate). A message of
//! `split_min` bytes or more goes by (split) single copy, and a borrowed
//! one (`send_inline`) through one fragment when there is room: neither is
//! a choice here.

use std::time::Duration;

/// Every this many messages of a class take the way not preferred.
pub(super) const EXPLORE: u32 = 64;

/// Size classes per peer: 16 KiB up to 64 KiB with the defaults is two
/// (16-32 KiB, 32-64 KiB); the band ends after this many doublings of
/// `cma_min` whatever `adapt_max` says (see [`band_end`]).
pub(super) const CLASSES: usize = 4;

/// Where the band of `cma_min..adapt_max` ends: at `adapt_max`, but no
/// later than split copy's start or the last tracked class.
pub(crate) fn band_end(cma_min: usize, adapt_max: usize, split_min: usize) -> usize {
    adapt_max
        .min(split_min)
        .min(cma_min.max(1).saturating_mul(1 << CLASSES))
}

/// How a message in the band goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Way {
    /// Two copies through fragments.
    Fragments,
    /// Announced and copied once by the receiver (rendezvous).
    Single,
}

/// A running estimate in nanoseconds: each sample moves it a quarter of
/// the way, and a sample is counted as at most four times the estimate
/// (one descheduled sender does not flip the choice for long).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Estimate(Option<u64>);

impl Estimate {
    fn add(&mut self, ns: u64) {
        // At least 1, and rounded up: a tiny estimate must still grow
        // with larger samples (each is capped at 4x the estimate).
        let ns = ns.max(1);
        self.0 = Some(match self.0 {
            None => ns,
            Some(old) => {
                let ns = ns.min(old.saturating_mul(4));
                old.saturating_mul(3).saturating_add(ns).div_ceil(4)
            }
        });
    }
}

/// The estimates for one size class of one peer.
#[derive(Debug, Clone, Copy, Default)]
struct Class {
    fragments: Estimate,
    single: Estimate,
    /// Messages of the class decided so far.
    count: u32,
}

impl Class {
    /// The way, and whether it is the one not preferred (taken to measure
    /// it again).
    fn way(&mut self) -> (Way, bool) {
        self.count = self.count.wrapping_add(1);
        let best = match (self.fragments.0, self.single.0) {
            // A way not measured yet is taken first (fragments before
            // single copy). Each keeps its turn to be explored below, so a
            // way whose messages all had to queue (no sample) does not
            // hold the class forever.
            (None, _) => Way::Fragments,
            (Some(_), None) => Way::Single,
            (Some(f), Some(s)) if f.saturating_mul(2) < s => Way::Fragments,
            (Some(_), Some(_)) => Way::Single,
        };
        match (self.count % EXPLORE == 0, best) {
            (false, w) => (w, false),
            (true, Way::Fragments) => (Way::Single, true),
            (true, Way::Single) => (Way::Fragments, true),
        }
    }
}

/// The sender's choices for every peer.
pub(super) struct Adapt {
    /// Smallest message in the band (`cma_min`).
    min: usize,
    /// First size past the band.
    end: usize,
    /// Per peer (local rank), per class.
    classes: Vec<[Class; CLASSES]>,
}

impl Adapt {
    /// The choices for `peers` local ranks, for messages of `min` bytes up
    /// to (not including) `end` (an empty band turns choosing off).
    pub(super) fn new(peers: usize, min: usize, end: usize) -> Adapt {
        Adapt {
            min: min.max(1),
            end,
            classes: vec![[Class::default(); CLASSES]; peers],
        }
    }

    /// The class of a message of `len` bytes, if it is in the band.
    fn class(&self, len: usize) -> Option<usize> {
        if len < self.min || len >= self.end {
            return None;
        }
        let c = (len / self.min).ilog2() as usize;
        (c < CLASSES).then_some(c)
    }

    /// Whether a message of `len` bytes is in the band.
    pub(super) fn in_band(&self, len: usize) -> bool {
        self.class(len).is_some()
    }

    /// How a message of `len` bytes to local rank `peer` goes, and whether
    /// that is the way not preferred (taken to measure it again); `None`
    /// outside the band (the caller's rule applies).
    pub(super) fn way(&mut self, peer: usize, len: usize) -> Option<(Way, bool)> {
        Some(self.class_of(peer, len)?.way())
    }

    /// A message of `len` bytes to `peer` went through fragments, its copy
    /// into them taking `copy`.
    pub(super) fn fragments_took(&mut self, peer: usize, len: usize, copy: Duration) {
        if let Some(cl) = self.class_of(peer, len) {
            cl.fragments.add(nanos(copy));
        }
    }

    /// A rendezvous of `len` bytes to `peer` was done `took` after it was
    /// announced.
    pub(super) fn single_took(&mut self, peer: usize, len: usize, took: Duration) {
        if let Some(cl) = self.class_of(peer, len) {
            cl.single.add(nanos(took));
        }
    }

    /// The estimates for a message of `len` bytes to local rank `peer`, if
    /// it is in the band and the peer known.
    fn class_of(&mut self, peer: usize, len: usize) -> Option<&mut Class> {
        let c = self.class(len)?;
        self.classes.get_mut(peer)?.get_mut(c)
    }
}

/// `d` in nanoseconds, saturating.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: usize = 1024;
    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn only_the_band_is_chosen_and_each_doubling_is_a_class() {
        let a = Adapt::new(2, 16 * K, 64 * K);
        assert_eq!(a.class(16 * K - 1), None);
        assert_eq!(a.class(16 * K), Some(0));
        assert_eq!(a.class(32 * K - 1), Some(0));
        assert_eq!(a.class(32 * K), Some(1));
        assert_eq!(a.class(64 * K - 1), Some(1));
        assert_eq!(a.class(64 * K), None);
        let mut off = Adapt::new(2, 16 * K, 16 * K);
        assert_eq!(off.way(0, 16 * K), None);
        let mut wide = Adapt::new(1, 16 * K, 1 << 30);
        assert_eq!(
            wide.class((16 * K) << CLASSES),
            None,
            "past the tracked classes"
        );
        assert_eq!(wide.way(5, 16 * K), None, "an unknown peer");
    }

    #[test]
    fn each_way_is_measured_first_then_the_cheaper_one_is_taken() {
        let mut a = Adapt::new(1, 16 * K, 64 * K);
        assert_eq!(a.way(0, 16 * K).map(|w| w.0), Some(Way::Fragments));
        a.fragments_took(0, 16 * K, us(1));
        assert_eq!(a.way(0, 16 * K).map(|w| w.0), Some(Way::Single));
        a.single_took(0, 16 * K, us(3));
        // 2 x 1 µs < 3 µs: fragments, but every EXPLORE-th message tries
        // single copy again.
        let ways: Vec<Way> = (0..2 * EXPLORE)
            .map(|_| a.way(0, 16 * K).unwrap().0)
            .collect();
        let singles = ways.iter().filter(|w| **w == Way::Single).count();
        assert_eq!(singles, 2, "{ways:?}");
        // The other class has its own estimates.
        assert_eq!(a.way(0, 40 * K).map(|w| w.0), Some(Way::Fragments));
    }

    #[test]
    fn a_machine_whose_lines_cross_slowly_moves_to_single_copy_and_back() {
        let mut a = Adapt::new(1, 16 * K, 64 * K);
        a.fragments_took(0, 16 * K, us(1));
        a.single_took(0, 16 * K, us(3));
        assert_eq!(a.way(0, 16 * K).map(|w| w.0), Some(Way::Fragments));
        // Copies into fragments become 5x dearer (the cores now sit on two
        // dies): a few samples turn the choice.
        for _ in 0..3 {
            a.fragments_took(0, 16 * K, us(5));
        }
        assert_eq!(a.way(0, 16 * K).map(|w| w.0), Some(Way::Single));
        // And back, through the explored messages' samples.
        for _ in 0..8 {
            a.fragments_took(0, 16 * K, us(1));
        }
        assert_eq!(a.way(0, 16 * K).map(|w| w.0), Some(Way::Fragments));
    }

    #[test]
    fn one_outlier_counts_at_most_four_times_the_estimate() {
        let mut e = Estimate::default();
        e.add(1000);
        e.add(1_000_000_000);
        assert_eq!(e.0, Some((3 * 1000 + 4000_u64).div_ceil(4)));
        let mut z = Estimate::default();
        z.add(0);
        z.add(1000);
        assert!(
            z.0 > Some(1),
            "a zero sample does not pin the estimate: {z:?}"
        );
        z.add(u64::MAX);
        z.add(u64::MAX);
    }

    #[test]
    fn a_way_never_measured_still_gives_way_to_the_other_now_and_then() {
        // Every fragments push had to queue: no sample, yet single copy is
        // tried every EXPLORE-th message.
        let mut a = Adapt::new(1, 16 * K, 64 * K);
        let ways: Vec<Way> = (0..EXPLORE).map(|_| a.way(0, 16 * K).unwrap().0).collect();
        assert_eq!(ways.iter().filter(|w| **w == Way::Single).count(), 1);
    }

    #[test]
    fn the_band_ends_at_split_copy_or_the_last_class() {
        assert_eq!(band_end(16 * K, 64 * K, 64 * K), 64 * K);
        assert_eq!(band_end(16 * K, 1 << 30, 64 * K), 64 * K);
        assert_eq!(band_end(2 * K, 1 << 20, 1 << 20), 32 * K);
        assert_eq!(band_end(16 * K, 0, 64 * K), 0);
        assert_eq!(band_end(usize::MAX, 1 << 20, 1 << 20), 1 << 20);
    }
}

//! Wrapping 64-bit sequence numbers (serial-number arithmetic, RFC 1982).
//!
//! Sequence numbers start at a random ISN and may wrap past `u64::MAX`.
//! Two numbers compare by the sign of their wrapping difference: `a` is
//! before `b` when `b - a` (mod 2^64) lies in `1..2^63`. Numbers exactly 2^63
//! apart are unordered (neither is before the other); the windows used by
//! this protocol are far smaller, so that case never arises between live
//! sequence numbers.

/// A wrapping 64-bit sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Seq(pub u64);

impl Seq {
    /// The number `n` steps after `self`, wrapping.
    #[must_use]
    pub fn wrapping_add(self, n: u64) -> Seq {
        Seq(self.0.wrapping_add(n))
    }

    /// Signed distance from `base` to `self`: positive when `self` is after
    /// `base`. Exactly 2^63 apart reads as `i64::MIN`.
    pub fn diff(self, base: Seq) -> i64 {
        self.0.wrapping_sub(base.0) as i64
    }

    /// Whether `self` comes strictly before `other`.
    pub fn is_before(self, other: Seq) -> bool {
        other.diff(self) > 0
    }

    /// Whether `self` comes strictly after `other`.
    pub fn is_after(self, other: Seq) -> bool {
        other.is_before(self)
    }

    /// Whether `self` lies in the half-open range `start .. start + len`.
    pub fn in_window(self, start: Seq, len: u64) -> bool {
        self.0.wrapping_sub(start.0) < len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wraps() {
        let a = Seq(u64::MAX - 1);
        let b = a.wrapping_add(3);
        assert_eq!(b, Seq(1));
        assert!(a.is_before(b));
        assert!(b.is_after(a));
        assert_eq!(b.diff(a), 3);
        assert_eq!(a.diff(b), -3);
        assert!(Seq(0).in_window(a, 3));
        assert!(!Seq(1).in_window(a, 3));
        assert!(!Seq(0).is_before(Seq(0)));
        assert!(!Seq(0).is_before(Seq(1 << 63)));
        assert!(!Seq(1 << 63).is_before(Seq(0)));
    }

    proptest! {
        #[test]
        fn antisymmetric(a in any::<u64>(), b in any::<u64>()) {
            let (a, b) = (Seq(a), Seq(b));
            prop_assert!(!(a.is_before(b) && b.is_before(a)));
            prop_assert_eq!(a.is_before(b), b.is_after(a));
            if a != b && b.0.wrapping_sub(a.0) != 1 << 63 {
                prop_assert!(a.is_before(b) ^ b.is_before(a));
            }
        }

        #[test]
        fn correct_across_wrap(base in any::<u64>(), d in 1u64..(1 << 62)) {
            // However base sits relative to u64::MAX, base + d is after base.
            let a = Seq(base);
            let b = a.wrapping_add(d);
            prop_assert!(a.is_before(b));
            prop_assert!(!b.is_before(a));
            prop_assert_eq!(b.diff(a), d as i64);
            prop_assert_eq!(a.diff(b), -(d as i64));
            prop_assert!(b.in_window(a, d + 1));
            prop_assert!(!b.in_window(a, d));
        }

        #[test]
        fn near_max(off in 0u64..1000, d in 1u64..1000) {
            let a = Seq(u64::MAX - off);
            prop_assert!(a.is_before(a.wrapping_add(d)));
        }
    }
}

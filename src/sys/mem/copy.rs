//! How bytes are copied in and out of shared or registered memory: inline
//! up to 16 bytes, the C library's `memmove`, or, for bulk copies, our own
//! vector loop.
//!
//! Copies of [`BULK_MIN`] bytes and more (puts and gets into a peer's
//! mapping, copy-out of large messages) take the routine the process chose
//! when its first fabric opened ([`choose`]). By default that is a loop of
//! 32-byte (AVX2) loads and stores wherever the CPU has AVX2. Why not
//! glibc's copy, which picks `rep movsb` for these sizes: on CPUs that
//! lower a core's clock under sustained `rep movsb`, it copies fast for a
//! few milliseconds, then the core drops to a lower clock (and everything
//! else on that core slows with it) until several ms after it stops, while
//! the AVX2 loop runs a little slower at first and never lowers the clock
//! (`benches/c/copy_clock.c` prints both as time series). So a stream of
//! puts moves about 1.1x more with the loop, while a burst of a few
//! milliseconds moves about 0.95x as much. Streams are what bulk copies
//! are for; `BTL_COPY=libc` turns the loop off. The choice is not timed at
//! start-up: any timing short enough for start-up sees only `rep movsb`'s
//! first, fast milliseconds.
//!
//! Copies of half the L2 cache or more go back to `memmove` ([`bulk_max`]):
//! they miss the cache anyway, and `rep movsb` stores missing lines
//! faster.
//!
//! Copies below `BULK_MIN` stay in the L1 cache, where glibc's copy is
//! the faster (about 1.3x the loop's rate at 16 KiB), and use it, except the
//! tiniest (a put of a few bytes), which [`copy_small`] does inline.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::config::CopyMode;

/// Smallest copy that may take the vector loop.
pub(crate) const BULK_MIN: usize = 32 * 1024;

/// Copies from `BULK_MIN` bytes up to (not including) this size take the
/// vector loop: 0 until a fabric chooses it (and with `memmove` chosen),
/// then [`bulk_max`]. One load and compare on the copy path, as a routine
/// flag alone is (a second check there makes small puts 0.95x as fast:
/// the bigger body changes what the compiler inlines around it).
static VECTOR_BELOW: AtomicUsize = AtomicUsize::new(0);
static CHOICE: OnceLock<CopyChoice> = OnceLock::new();

/// The routine a process copies large buffers with, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyChoice {
    /// `"libc"` or `"vector"`.
    pub routine: &'static str,
    /// Why: the mode asked for, or what the CPU lacks.
    pub why: String,
}

impl std::fmt::Display for CopyChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.routine, self.why)
    }
}

/// Whether this CPU can run the vector loop.
fn vector_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Choose the bulk copy routine for this process (the first call decides;
/// later calls, from further fabrics, return that choice whatever their
/// mode).
pub(crate) fn choose(mode: CopyMode) -> &'static CopyChoice {
    CHOICE.get_or_init(|| {
        let c = decide(mode);
        let below = if c.routine == "vector" { bulk_max() } else { 0 };
        VECTOR_BELOW.store(below, Ordering::Relaxed);
        tracing::debug!(copy = %c, "bulk copy routine chosen");
        c
    })
}

/// The sizes the vector loop copies, in words.
fn span() -> String {
    match bulk_max() {
        usize::MAX => format!("from {} KiB", BULK_MIN >> 10),
        m => format!(
            "from {} KiB below {} KiB (half the L2)",
            BULK_MIN >> 10,
            m >> 10
        ),
    }
}

/// Where the vector loop stops: half this core's L2 cache. A copy that big
/// cannot keep both its source and its destination in L2, so most of the
/// lines it stores miss, and there glibc's `rep movsb`, which can write
/// whole missing lines without first reading them, is the faster (puts of
/// 1 MiB about 1.1x the loop's rate, gets about 1.03x, with a 2 MiB L2: a
/// small gain), while the clock drop that makes the loop the choice below
/// matters less to a copy that waits on memory. Unknown L2: no limit.
fn bulk_max() -> usize {
    // SAFETY: sysconf only reads system information.
    let l2 = unsafe { libc::sysconf(libc::_SC_LEVEL2_CACHE_SIZE) };
    match usize::try_from(l2) {
        Ok(l2) if l2 >= 2 * BULK_MIN => l2 / 2,
        _ => usize::MAX,
    }
}

fn decide(mode: CopyMode) -> CopyChoice {
    let pick = |routine, why: &str| CopyChoice {
        routine,
        why: why.to_string(),
    };
    match mode {
        CopyMode::Libc => pick("libc", "asked for"),
        _ if !vector_available() => pick("libc", "this CPU has no AVX2"),
        CopyMode::Vector => pick("vector", &format!("asked for; {}", span())),
        CopyMode::Auto => pick(
            "vector",
            &format!("AVX2 loop, keeps the clock up in long streams; {}", span()),
        ),
    }
}

/// Copy `n` bytes from `src` to `dst` (which may overlap) with the
/// process's routine.
///
/// # Safety
/// `src` must be valid for `n` bytes of reads and `dst` for `n` bytes of
/// writes.
#[inline]
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, n: usize) {
    if n <= 16 {
        // SAFETY: passed on from our contract.
        return unsafe { copy_small(src, dst, n) };
    }
    if n >= BULK_MIN && n < VECTOR_BELOW.load(Ordering::Relaxed) {
        let (s, d) = (src as usize, dst as usize);
        // The loop copies forwards: only for ranges apart.
        if s.saturating_add(n) <= d || d.saturating_add(n) <= s {
            // SAFETY: VECTOR_BELOW is above 0 only once `decide` saw AVX2;
            // the ranges are valid per our contract and do not overlap.
            unsafe { copy_with(true, src, dst, n) };
            return;
        }
    }
    // SAFETY: valid per our contract; `ptr::copy` allows overlap.
    unsafe { std::ptr::copy(src, dst, n) }
}

/// Up to 16 bytes without a call (a small put's bytes cost less than the
/// call to `memmove`): every byte is loaded before any is stored, so
/// overlapping ranges move as with `memmove`. (Not more: inlining 17-64
/// bytes too makes puts of every size about 0.92x as fast, as the bigger
/// body changes what the compiler inlines around it.)
///
/// # Safety
/// As [`copy`], with `n <= 16`.
#[inline(always)]
unsafe fn copy_small(src: *const u8, dst: *mut u8, n: usize) {
    use std::ptr::{read_unaligned as rd, write_unaligned as wr};
    // SAFETY: each access lies in the first or last 8 (4, 1) bytes of a
    // range of n bytes with n at least 8 (4, 1): inside both ranges, which
    // are valid per our contract; unaligned accesses are what these
    // functions are for.
    unsafe {
        if n >= 8 {
            let (a, b) = (rd(src.cast::<u64>()), rd(src.add(n - 8).cast::<u64>()));
            wr(dst.cast::<u64>(), a);
            wr(dst.add(n - 8).cast::<u64>(), b);
        } else if n >= 4 {
            let (a, b) = (rd(src.cast::<u32>()), rd(src.add(n - 4).cast::<u32>()));
            wr(dst.cast::<u32>(), a);
            wr(dst.add(n - 4).cast::<u32>(), b);
        } else if n > 0 {
            let (a, b, c) = (*src, *src.add(n / 2), *src.add(n - 1));
            *dst = a;
            *dst.add(n / 2) = b;
            *dst.add(n - 1) = c;
        }
    }
}

/// Fewer than 64 bytes between ranges that do not overlap, without a
/// call: two fixed-size copies, of the first and the last 32 (16) bytes,
/// or [`copy_small`]. For the last, shorter piece of a strided fast-box
/// copy, where a `memcpy` call for a few bytes cost a 64-byte message
/// about a quarter of its push.
///
/// # Safety
/// As [`copy`], with `n < 64` and ranges that do not overlap.
#[inline(always)]
pub(crate) unsafe fn copy_short(src: *const u8, dst: *mut u8, n: usize) {
    debug_assert!(n < 64);
    // SAFETY: each fixed-size copy covers the first or the last 32 (16)
    // bytes of a range of n bytes with n at least 32 (16): inside both
    // ranges, valid per our contract and apart, so `copy_nonoverlapping`
    // applies; below 16, `copy_small`'s contract holds.
    unsafe {
        if n >= 32 {
            std::ptr::copy_nonoverlapping(src, dst, 32);
            std::ptr::copy_nonoverlapping(src.add(n - 32), dst.add(n - 32), 32);
        } else if n >= 16 {
            std::ptr::copy_nonoverlapping(src, dst, 16);
            std::ptr::copy_nonoverlapping(src.add(n - 16), dst.add(n - 16), 16);
        } else {
            copy_small(src, dst, n);
        }
    }
}

/// `memmove` (`vector` false) or the vector loop.
///
/// # Safety
/// As [`copy`]; with `vector`, the ranges must not overlap and the CPU
/// must have AVX2.
#[inline]
unsafe fn copy_with(vector: bool, src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if vector {
        // SAFETY: passed on from our contract.
        return unsafe { copy_avx2(src, dst, n) };
    }
    let _ = vector;
    // SAFETY: valid per our contract.
    unsafe { std::ptr::copy(src, dst, n) }
}

/// Four 32-byte loads, then four 32-byte stores, per 128 bytes, the
/// stores aligned to whole cache lines: the bytes up to the destination's
/// next 64-byte boundary, and the tail, by `memcpy`. (Unaligned stores
/// that straddle lines make the loop a fifth slower than `memmove`.)
///
/// # Safety
/// `src` valid for `n` bytes of reads, `dst` for `n` bytes of writes, the
/// two not overlapping; the CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(src: *const u8, dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_store_si256};
    let head = (dst as usize).wrapping_neg() % 64;
    if n < head + 128 {
        // SAFETY: as our contract.
        return unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
    }
    // SAFETY: head < 64 <= n bytes at the start of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut i = head;
    while i + 128 <= n {
        // SAFETY: i + 128 <= n, so all four 32-byte loads lie inside
        // src..src+n and all four stores inside dst..dst+n; dst + i is
        // 64-byte aligned (dst + head is, and i - head is a multiple of
        // 128), as the aligned stores need; loads may be unaligned.
        unsafe {
            let s = src.add(i).cast::<__m256i>();
            let d = dst.add(i).cast::<__m256i>();
            let a = _mm256_loadu_si256(s);
            let b = _mm256_loadu_si256(s.add(1));
            let c = _mm256_loadu_si256(s.add(2));
            let e = _mm256_loadu_si256(s.add(3));
            _mm256_store_si256(d, a);
            _mm256_store_si256(d.add(1), b);
            _mm256_store_si256(d.add(2), c);
            _mm256_store_si256(d.add(3), e);
        }
        i += 128;
    }
    // SAFETY: the last n - i (< 128) bytes of both ranges, which do not
    // overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vector_loop_copies_every_length_and_alignment_exactly() {
        if !vector_available() {
            println!("skipped: this CPU has no AVX2, so the vector loop never runs here");
            return;
        }
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for n in [
            0,
            1,
            127,
            128,
            129,
            255,
            4096,
            BULK_MIN - 1,
            BULK_MIN,
            65_537,
        ] {
            for (so, d_off) in [(0, 0), (1, 0), (0, 3), (5, 63), (31, 17)] {
                let mut dst = vec![0xEEu8; n + 128];
                // SAFETY: src has so + n bytes (n <= 65_537, so <= 31);
                // dst has d_off + n (+ slack) bytes; distinct vectors.
                unsafe { copy_with(true, src.as_ptr().add(so), dst.as_mut_ptr().add(d_off), n) };
                assert_eq!(
                    &dst[d_off..d_off + n],
                    &src[so..so + n],
                    "n {n} src+{so} dst+{d_off}"
                );
                assert!(dst[..d_off].iter().all(|b| *b == 0xEE), "wrote before dst");
                assert!(
                    dst[d_off + n..].iter().all(|b| *b == 0xEE),
                    "wrote past dst"
                );
            }
        }
    }

    #[test]
    fn small_copies_move_like_memmove_even_overlapping() {
        for n in 0..=16usize {
            for shift in [0usize, 1, 3, 8, 20] {
                // Forwards and backwards overlap (or none, for shift 20).
                for (from, to) in [(0, shift), (shift, 0)] {
                    let mut ours: Vec<u8> = (0..40u8).collect();
                    let mut want = ours.clone();
                    want.copy_within(from..from + n, to);
                    let p = ours.as_mut_ptr();
                    // SAFETY: from + n and to + n are at most 36 <= 40.
                    unsafe { copy(p.add(from), p.add(to), n) };
                    assert_eq!(ours, want, "n {n} from {from} to {to}");
                }
            }
        }
    }

    #[test]
    fn overlapping_bulk_copies_fall_back_to_memmove() {
        // Whatever routine this process chose, an overlapping copy of
        // BULK_MIN or more must move the bytes as memmove does.
        let _ = choose(CopyMode::Vector);
        let n = BULK_MIN + 100;
        let mut buf: Vec<u8> = (0..n + 64).map(|i| i as u8).collect();
        let want: Vec<u8> = buf[..n].to_vec();
        let p = buf.as_mut_ptr();
        // SAFETY: both ranges lie in buf (n + 64 bytes); copy allows overlap.
        unsafe { copy(p, p.add(64), n) };
        assert_eq!(&buf[64..], &want[..]);
    }

    #[test]
    fn the_mode_decides_where_the_cpu_allows() {
        assert_eq!(decide(CopyMode::Libc).routine, "libc");
        let want = if vector_available() { "vector" } else { "libc" };
        assert_eq!(decide(CopyMode::Vector).routine, want);
        assert_eq!(decide(CopyMode::Auto).routine, want);
    }
}

//! Raw byte ranges that other processes may write concurrently (shared
//! mappings, registered buffers). We never hand out Rust references into such
//! memory — only copies in and out — so no `&[u8]` can observe a concurrent
//! write. This is one of the three places `unsafe` lives (with `shm` and `os`).

use std::ptr::NonNull;

use crate::AccessError;

mod copy;
pub(crate) use copy::choose as choose_copy;
pub use copy::CopyChoice;

/// A pointer and a length, valid for as long as its owner keeps the memory.
///
/// Every `RawBuf` is stored next to the owner of its memory (a mapping or a
/// boxed slice) inside the same struct, and dropped no later than that owner.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a RawBuf is a plain address range; all access goes through the
// bounds-checked copy methods below. The bytes are shared with other
// processes (and, for registered buffers, with the progress task applying a
// peer's put): concurrent copies to the same bytes are racy by nature, as in
// any shared-memory or RDMA API, and yield unspecified byte values; no
// Rust reference into the range exists, so no reference's guarantees break.
unsafe impl Send for RawBuf {}
// SAFETY: as above; no method hands out references into the range.
unsafe impl Sync for RawBuf {}

fn check(off: u64, n: usize, len: usize) -> Result<usize, AccessError> {
    let end = off.checked_add(n as u64).filter(|e| *e <= len as u64);
    match end {
        Some(_) => Ok(off as usize),
        None => Err(AccessError::OutOfBounds {
            offset: off,
            end: off.saturating_add(n as u64),
            len: len as u64,
        }),
    }
}

impl RawBuf {
    /// Wrap `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for as long as this
    /// `RawBuf` (and every copy of it) is used, and must not be accessed
    /// through Rust references while it is.
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize) -> RawBuf {
        RawBuf {
            ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()),
            len,
        }
    }

    /// A range of no bytes (what a region whose memory the CPU must not
    /// touch, device memory, shows to host paths: every copy into or out
    /// of it is out of bounds).
    pub(crate) fn empty() -> RawBuf {
        RawBuf {
            ptr: NonNull::dangling(),
            len: 0,
        }
    }

    /// The start address (for the kernel's cross-memory copies).
    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Ask the CPU to fetch the cache line at `off` for writing
    /// (`prefetchw`), so that a store to it soon after does not wait for
    /// the line to leave another core. A hint only: no effect on memory,
    /// and out-of-range offsets are ignored.
    #[inline]
    pub(crate) fn prefetch_write(&self, off: u64) {
        #[cfg(all(target_arch = "x86_64", not(btl_loom)))]
        if (off as usize) < self.len {
            let p = self.ptr.as_ptr().wrapping_add(off as usize);
            // SAFETY: prefetchw only loads a line into this core's cache;
            // it never faults (even on a bad address) and changes no memory
            // or register. `p` lies inside our mapping anyway. CPUs without
            // the instruction execute it as a no-op (it sits in the reserved
            // NOP space, 0F 0D).
            unsafe {
                std::arch::asm!("prefetchw [{}]", in(reg) p, options(nostack, preserves_flags, readonly));
            }
        }
        #[cfg(not(all(target_arch = "x86_64", not(btl_loom))))]
        let _ = off;
    }

    /// Ask the CPU to start loading the cache lines of `off .. off + n`
    /// (`prefetcht0`), so that reads soon after overlap their misses
    /// instead of waiting for each in turn. A hint only: no effect on
    /// memory; the range is clipped to ours.
    #[inline]
    pub(crate) fn prefetch_read(&self, off: u64, n: usize) {
        #[cfg(all(target_arch = "x86_64", not(btl_loom)))]
        {
            let start = (off as usize).min(self.len);
            let end = start.saturating_add(n).min(self.len);
            let mut at = start & !63;
            while at < end {
                let p = self.ptr.as_ptr().wrapping_add(at);
                // SAFETY: prefetcht0 only loads a line into the caches; it
                // never faults and changes no memory or register. `p` lies
                // inside our mapping (clipped above).
                unsafe {
                    std::arch::asm!("prefetcht0 [{}]", in(reg) p, options(nostack, preserves_flags, readonly));
                }
                at += 64;
            }
        }
        #[cfg(not(all(target_arch = "x86_64", not(btl_loom))))]
        let _ = (off, n);
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A sub-range, checked.
    pub(crate) fn slice(&self, off: u64, n: usize) -> Result<RawBuf, AccessError> {
        let o = check(off, n, self.len)?;
        // SAFETY: o + n <= len, so the sub-range lies inside ours and lives
        // exactly as long (same owner).
        Ok(unsafe { RawBuf::new(self.ptr.as_ptr().add(o), n) })
    }

    /// Copy `src` into the range at `off`.
    pub(crate) fn write(&self, off: u64, src: &[u8]) -> Result<(), AccessError> {
        let o = check(off, src.len(), self.len)?;
        // SAFETY: bounds checked above; the range is valid per `new`'s
        // contract; `src` is a Rust slice and so cannot alias this range (no
        // references into it exist); `copy` tolerates overlap anyway.
        unsafe { copy::copy(src.as_ptr(), self.ptr.as_ptr().add(o), src.len()) };
        Ok(())
    }

    /// Copy from the range at `off` into `dst`.
    pub(crate) fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), AccessError> {
        let o = check(off, dst.len(), self.len)?;
        // SAFETY: bounds checked; valid per `new`'s contract; `dst` is a
        // unique Rust slice, so not inside this range.
        unsafe { copy::copy(self.ptr.as_ptr().add(o), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Append `n` bytes from offset `off` to `dst`.
    pub(crate) fn read_into(
        &self,
        off: u64,
        n: usize,
        dst: &mut impl Grow,
    ) -> Result<(), AccessError> {
        let o = check(off, n, self.len)?;
        dst.reserve(n);
        let spare = dst.spare();
        // SAFETY: bounds checked; `spare` has at least n bytes after reserve;
        // the copy initialises them, so growing the length by n is sound.
        unsafe {
            copy::copy(self.ptr.as_ptr().add(o), spare.as_mut_ptr().cast::<u8>(), n);
            dst.grow(n);
        }
        Ok(())
    }

    /// Copy `n` bytes from `src` at `src_off` to this range at `off`.
    pub(crate) fn copy_from(
        &self,
        off: u64,
        src: &RawBuf,
        src_off: u64,
        n: usize,
    ) -> Result<(), AccessError> {
        let d = check(off, n, self.len)?;
        let s = check(src_off, n, src.len)?;
        // SAFETY: both ranges checked and valid per `new`; `copy` handles
        // the case where both name the same memory.
        unsafe { copy::copy(src.ptr.as_ptr().add(s), self.ptr.as_ptr().add(d), n) };
        Ok(())
    }

    /// The bytes a strided copy of `n` bytes touches from its start:
    /// `CHUNK`-byte pieces `STRIDE` bytes apart, the last one shorter
    /// (`None` if that does not fit in a `usize`).
    #[cfg(not(btl_loom))]
    fn strided_span<const CHUNK: usize, const STRIDE: usize>(n: usize) -> Option<usize> {
        match n {
            0 => Some(0),
            n => ((n - 1) / CHUNK)
                .checked_mul(STRIDE)?
                .checked_add((n - 1) % CHUNK + 1),
        }
    }

    /// Check a strided copy of `n` bytes at `off`; its start.
    #[cfg(not(btl_loom))]
    fn check_strided<const CHUNK: usize, const STRIDE: usize>(
        &self,
        off: u64,
        n: usize,
    ) -> Result<usize, AccessError> {
        let span = Self::strided_span::<CHUNK, STRIDE>(n).ok_or(AccessError::OutOfBounds {
            offset: off,
            end: u64::MAX,
            len: self.len as u64,
        })?;
        check(off, span, self.len)
    }

    /// Copy `src` into the range as `CHUNK`-byte pieces `STRIDE` bytes
    /// apart from `off` (the fast box's slots: payload between the marks).
    /// One bounds check for the whole span, and a fixed-size copy per whole
    /// piece, which the compiler turns into a few vector moves; a memmove
    /// call per piece cost more than the bytes.
    #[inline]
    #[cfg(not(btl_loom))]
    pub(crate) fn write_strided<const CHUNK: usize, const STRIDE: usize>(
        &self,
        off: u64,
        src: &[u8],
    ) -> Result<(), AccessError> {
        const { assert!(CHUNK > 0 && CHUNK <= STRIDE) };
        let o = self.check_strided::<CHUNK, STRIDE>(off, src.len())?;
        let mut pieces = src.chunks_exact(CHUNK);
        let mut at = o;
        for piece in pieces.by_ref() {
            // SAFETY: whole piece k lands at o + k * STRIDE .. + CHUNK,
            // inside the checked span o .. o + span; valid per `new`'s
            // contract; `src` is a Rust slice, so it cannot overlap memory
            // only reached through raw pointers.
            unsafe {
                std::ptr::copy_nonoverlapping(piece.as_ptr(), self.ptr.as_ptr().add(at), CHUNK)
            };
            at += STRIDE;
        }
        let rest = pieces.remainder();
        if !rest.is_empty() {
            // SAFETY: the last, shorter piece ends exactly at o + span.
            // (Only a piece that exists is addressed: with none left, `at`
            // may already point past the span.) It is shorter than CHUNK,
            // which is below 64 for every caller (checked below), and `src`
            // does not overlap this range.
            unsafe {
                if CHUNK < 64 {
                    copy::copy_short(rest.as_ptr(), self.ptr.as_ptr().add(at), rest.len())
                } else {
                    std::ptr::copy_nonoverlapping(
                        rest.as_ptr(),
                        self.ptr.as_ptr().add(at),
                        rest.len(),
                    )
                }
            };
        }
        Ok(())
    }

    /// The inverse of [`RawBuf::write_strided`]: fill `dst` from
    /// `CHUNK`-byte pieces `STRIDE` bytes apart from `off`.
    #[inline]
    #[cfg(not(btl_loom))]
    pub(crate) fn read_strided<const CHUNK: usize, const STRIDE: usize>(
        &self,
        off: u64,
        dst: &mut [u8],
    ) -> Result<(), AccessError> {
        let o = self.check_strided::<CHUNK, STRIDE>(off, dst.len())?;
        // SAFETY: the span from `o` was checked above; `dst` is a unique
        // Rust slice of `dst.len()` bytes, so writable and not inside this
        // range.
        unsafe { self.copy_strided_out::<CHUNK, STRIDE>(o, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// As [`RawBuf::read_strided`], appending the `n` bytes to `dst`
    /// (without zeroing them first, as a `vec![0; n]` to read into would:
    /// that is `calloc`, which glibc serves without its thread cache).
    #[inline]
    #[cfg(not(btl_loom))]
    pub(crate) fn read_strided_into<const CHUNK: usize, const STRIDE: usize>(
        &self,
        off: u64,
        n: usize,
        dst: &mut impl Grow,
    ) -> Result<(), AccessError> {
        let o = self.check_strided::<CHUNK, STRIDE>(off, n)?;
        dst.reserve(n);
        let spare = dst.spare();
        // SAFETY: the span from `o` was checked above; `spare` has at least
        // `n` bytes after `reserve`, is owned by `dst` (not inside this
        // range), and the copy initialises its first `n` bytes, so growing
        // the length by `n` is sound.
        unsafe {
            self.copy_strided_out::<CHUNK, STRIDE>(o, spare.as_mut_ptr().cast::<u8>(), n);
            dst.grow(n);
        }
        Ok(())
    }

    /// Copy `n` bytes out of `CHUNK`-byte pieces `STRIDE` bytes apart from
    /// byte `o` of the range to `dst`, with a fixed-size copy per whole
    /// piece.
    ///
    /// # Safety
    /// `o` and the strided span of `n` bytes from it must have passed
    /// `check_strided`; `dst` must be valid for `n` bytes of writes and not
    /// overlap this range.
    #[inline]
    #[cfg(not(btl_loom))]
    unsafe fn copy_strided_out<const CHUNK: usize, const STRIDE: usize>(
        &self,
        o: usize,
        dst: *mut u8,
        n: usize,
    ) {
        const { assert!(CHUNK > 0 && CHUNK <= STRIDE) };
        let (whole, rest) = (n / CHUNK, n % CHUNK);
        let mut at = o;
        for k in 0..whole {
            // SAFETY: whole piece k comes from o + k * STRIDE .. + CHUNK,
            // inside the checked span (caller's contract), valid per `new`;
            // it goes to dst + k * CHUNK, inside the n bytes the caller
            // vouches for, which do not overlap the range.
            unsafe {
                std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(at), dst.add(k * CHUNK), CHUNK)
            };
            at += STRIDE;
        }
        if rest > 0 {
            // SAFETY: the last, shorter piece ends exactly at o + span and
            // at dst + n; it is shorter than CHUNK (below 64 where
            // `copy_short` is used) and the ranges do not overlap.
            unsafe {
                if CHUNK < 64 {
                    copy::copy_short(self.ptr.as_ptr().add(at), dst.add(whole * CHUNK), rest)
                } else {
                    std::ptr::copy_nonoverlapping(
                        self.ptr.as_ptr().add(at),
                        dst.add(whole * CHUNK),
                        rest,
                    )
                }
            };
        }
    }

    /// The `AtomicU32` at `off` (must be 4-aligned and in range).
    pub(crate) fn atomic_u32(&self, off: usize) -> Option<&crate::sys::sync::AtomicU32> {
        if off % 4 != 0 || off.checked_add(4)? > self.len || (self.ptr.as_ptr() as usize) % 4 != 0 {
            return None;
        }
        // SAFETY: in range and aligned (checked); the memory stays valid while
        // `self`'s owner lives, which outlives the returned borrow of `self`;
        // every process touches these four bytes only atomically.
        Some(unsafe { &*(self.ptr.as_ptr().add(off) as *const crate::sys::sync::AtomicU32) })
    }

    /// Apply `op` to the 8-byte word at `off` with one hardware atomic
    /// instruction, correct between processes that map the same memory;
    /// returns the word's previous value. The word must lie in range and
    /// be 8-byte aligned in memory (the offset *and* the start address),
    /// else nothing is touched.
    pub(crate) fn atomic(&self, off: u64, op: AtomicOp) -> Result<u64, AccessError> {
        let at = check(off, 8, self.len)?;
        if (self.addr().wrapping_add(at)) % 8 != 0 {
            return Err(AccessError::Misaligned { offset: off });
        }
        // SAFETY: `at..at+8` is inside the range (checked above) and the
        // address is 8-aligned (checked above); the memory is valid while
        // `self`'s owner lives, which outlives this call; every process
        // that touches an atomic word does so through atomic instructions
        // (a plain put over it is a data race by the user's choice, as in
        // MPI and OpenSHMEM, and yields unspecified bytes, never UB here:
        // no Rust reference into the range outlives this call).
        let w = unsafe { &*(self.ptr.as_ptr().add(at) as *const std::sync::atomic::AtomicU64) };
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        Ok(match op {
            AtomicOp::Add(v) => w.fetch_add(v, AcqRel),
            AtomicOp::Swap(v) => w.swap(v, AcqRel),
            AtomicOp::CompareSwap { expected, new } => {
                match w.compare_exchange(expected, new, AcqRel, Acquire) {
                    Ok(old) | Err(old) => old,
                }
            }
        })
    }

    /// `n` `AtomicU64`s at `off` (must be 8-aligned and in range).
    pub(crate) fn atomics_u64(
        &self,
        off: usize,
        n: usize,
    ) -> Option<&[crate::sys::sync::AtomicU64]> {
        let end = off.checked_add(n.checked_mul(8)?)?;
        if off % 8 != 0 || end > self.len || (self.ptr.as_ptr() as usize) % 8 != 0 {
            return None;
        }
        // SAFETY: in range and aligned (checked); valid while the owner of
        // `self` lives, which outlives the borrow; these words are accessed
        // only atomically by every process (ring indices and slots).
        Some(unsafe {
            std::slice::from_raw_parts(
                self.ptr.as_ptr().add(off) as *const crate::sys::sync::AtomicU64,
                n,
            )
        })
    }
}

/// A 64-bit atomic operation on one word of a region (the remote atomics
/// of `Endpoint::fetch_add`, `compare_swap`, `swap`, `atomic_add_nbi`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtomicOp {
    /// Add (wrapping); returns the previous value.
    Add(u64),
    /// Store; returns the previous value.
    Swap(u64),
    /// Store `new` if the word equals `expected`; returns the previous
    /// value either way (equal to `expected` when it swapped).
    CompareSwap {
        /// The value the word must hold.
        expected: u64,
        /// The value stored if it does.
        new: u64,
    },
}

impl AtomicOp {
    /// Wire form: an opcode and two operands.
    pub(crate) fn encode(self) -> [u8; 17] {
        let (code, a, b) = match self {
            AtomicOp::Add(v) => (0u8, v, 0),
            AtomicOp::Swap(v) => (1, v, 0),
            AtomicOp::CompareSwap { expected, new } => (2, expected, new),
        };
        let mut w = [0u8; 17];
        w[0] = code;
        w[1..9].copy_from_slice(&a.to_le_bytes());
        w[9..17].copy_from_slice(&b.to_le_bytes());
        w
    }

    /// Decode [`AtomicOp::encode`]'s bytes: `None` for anything else.
    pub(crate) fn decode(b: &[u8]) -> Option<AtomicOp> {
        if b.len() != 17 {
            return None;
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let (a, c) = (word(1), word(9));
        match b[0] {
            0 => Some(AtomicOp::Add(a)),
            1 => Some(AtomicOp::Swap(a)),
            2 => Some(AtomicOp::CompareSwap {
                expected: a,
                new: c,
            }),
            _ => None,
        }
    }
}

/// A byte buffer that can be appended to in place (`Vec<u8>`, `BytesMut`).
///
/// # Safety
/// After `reserve(n)`, `spare()` must be at least `n` bytes long (the
/// copies into it rely on that).
pub(crate) unsafe trait Grow {
    /// Make room for `n` more bytes.
    fn reserve(&mut self, n: usize);
    /// The uninitialised room after the current length.
    fn spare(&mut self) -> &mut [std::mem::MaybeUninit<u8>];
    /// Extend the length by `n`.
    ///
    /// # Safety
    /// The first `n` bytes of `spare()` must have been initialised.
    unsafe fn grow(&mut self, n: usize);
}

// SAFETY: `Vec::reserve(n)` leaves capacity for at least `n` more bytes,
// all of which `spare_capacity_mut` returns.
unsafe impl Grow for Vec<u8> {
    fn reserve(&mut self, n: usize) {
        Vec::reserve(self, n);
    }
    fn spare(&mut self) -> &mut [std::mem::MaybeUninit<u8>] {
        self.spare_capacity_mut()
    }
    unsafe fn grow(&mut self, n: usize) {
        // SAFETY: the caller initialised these n bytes (trait contract).
        unsafe { self.set_len(self.len() + n) }
    }
}

// SAFETY: `BytesMut::reserve(n)` leaves capacity for at least `n` more
// bytes, all of which `spare_capacity_mut` returns.
unsafe impl Grow for bytes::BytesMut {
    fn reserve(&mut self, n: usize) {
        bytes::BytesMut::reserve(self, n);
    }
    fn spare(&mut self) -> &mut [std::mem::MaybeUninit<u8>] {
        self.spare_capacity_mut()
    }
    unsafe fn grow(&mut self, n: usize) {
        // SAFETY: the caller initialised these n bytes (trait contract).
        unsafe { self.set_len(self.len() + n) }
    }
}

/// Heap memory owned by a registered region.
pub(crate) struct HeapBuf {
    raw: RawBuf,
    cap: usize,
}

impl HeapBuf {
    /// Take ownership of `v`'s allocation.
    pub(crate) fn from_vec(v: Vec<u8>) -> HeapBuf {
        let mut v = std::mem::ManuallyDrop::new(v);
        let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
        // SAFETY: the Vec's buffer is valid for `len` bytes and is now owned
        // by this HeapBuf (ManuallyDrop), freed only in Drop below.
        let raw = unsafe { RawBuf::new(ptr, len) };
        HeapBuf { raw, cap }
    }

    /// The memory.
    pub(crate) fn raw(&self) -> RawBuf {
        self.raw
    }

    /// Give the buffer back as a Vec.
    pub(crate) fn into_vec(self) -> Vec<u8> {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: ptr/len/cap came from a Vec<u8> in from_vec and were never
        // freed (ManuallyDrop stops Drop from running).
        unsafe { Vec::from_raw_parts(me.raw.ptr.as_ptr(), me.raw.len, me.cap) }
    }
}

impl Drop for HeapBuf {
    fn drop(&mut self) {
        // SAFETY: as in into_vec: the parts came from a Vec and are freed once.
        drop(unsafe { Vec::from_raw_parts(self.raw.ptr.as_ptr(), self.raw.len, self.cap) });
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::HeapBuf;

    #[test]
    fn strided_copies_round_trip_and_touch_only_their_pieces() {
        for n in [0usize, 1, 55, 56, 57, 112, 113, 300] {
            let h = HeapBuf::from_vec(vec![0xEE; 1024]);
            let b = h.raw();
            let src: Vec<u8> = (0..n).map(|i| i as u8).collect();
            b.write_strided::<56, 64>(8, &src).unwrap();
            let mut all = vec![0u8; 1024];
            b.read(0, &mut all).unwrap();
            // Every byte outside the pieces is untouched.
            for (i, v) in all.iter().enumerate() {
                let rel = i.checked_sub(8);
                let inside = rel.is_some_and(|r| r % 64 < 56 && r / 64 * 56 + r % 64 < n);
                if !inside {
                    assert_eq!(*v, 0xEE, "byte {i} changed for n = {n}");
                }
            }
            let mut back = vec![0u8; n];
            b.read_strided::<56, 64>(8, &mut back).unwrap();
            assert_eq!(back, src);
            // Appended after what a buffer already holds.
            let mut grown = b"head".to_vec();
            b.read_strided_into::<56, 64>(8, n, &mut grown).unwrap();
            assert_eq!(&grown[..4], b"head");
            assert_eq!(&grown[4..], &src[..]);
        }
    }

    #[test]
    fn strided_copies_past_the_end_are_refused_whole() {
        let h = HeapBuf::from_vec(vec![0u8; 128]);
        let b = h.raw();
        // Pieces at 8..64 and 72..128: 112 bytes fit, 113 do not.
        assert!(b.write_strided::<56, 64>(8, &[1u8; 112]).is_ok());
        let h = HeapBuf::from_vec(vec![0u8; 128]);
        let b = h.raw();
        assert!(b.write_strided::<56, 64>(8, &[1u8; 113]).is_err());
        let mut all = [9u8; 128];
        b.read(0, &mut all).unwrap();
        assert!(all.iter().all(|v| *v == 0), "a refused copy wrote nothing");
        assert!(b.read_strided::<56, 64>(8, &mut [0u8; 113]).is_err());
        let mut v = Vec::new();
        assert!(b.read_strided_into::<56, 64>(8, 113, &mut v).is_err());
        assert!(v.is_empty(), "a refused read appends nothing");
    }
}

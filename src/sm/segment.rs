//! The per-process shared segment: a `#[repr(C)]`-style header page (written
//! and read as explicit little-endian fields, never transmuted), then the
//! rings, then the fragment pool.
//!
//! ```text
//! 0      header: magic, version, job tag, sizes, pid, local rank   (static)
//! 256    state  (AtomicU32: 1 ready, 2 closed)                     (dynamic)
//! 320    armed  (AtomicU32: owner asleep, ring its doorbell)       (dynamic)
//! 4096   inbound rings, two per local sender   (sender -> owner: fragment offsets;
//!        channel 0 user messages, channel 1 control: put/get, barrier, bye)
//! ...    return rings, one per local receiver  (receiver -> owner: owner's fragments back)
//! ...    fast boxes, one per local sender      (sender -> owner: small user messages)
//! ...    pool: eager fragments, then max fragments (owned by this process)
//! ```
//!
//! Everything that crosses processes is an offset into a segment, checked
//! against the layout recomputed from the validated header.
//!
//! The segment is a sealed memory file (`sys::shm`): peers fetch it from
//! its owner by id (`sm::share`), so no one can shrink it under a mapping.

use std::sync::Mutex;

use super::share::{self, Served};
use crate::sys::mem::RawBuf;
use crate::sys::ring::{ring_bytes, Ring, RING_HEADER};
use crate::sys::shm::SharedMem;
use crate::sys::sync::{lock, AtomicU32};
use crate::{Error, Result};

pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"ABTLSEG1");
/// The segment's format: its layout, and what travels in it (8: the fast
/// box carries up to 512 bytes, and a longer length in a head mark is a
/// peer's corruption).
pub(crate) const VERSION: u32 = 8;
pub(crate) const HEADER_LEN: usize = 4096;
const STATE_OFF: usize = 256;
const ARMED_OFF: usize = 320;
const PARAMS_LEN: usize = 72;
/// Channels per sender: user messages, control messages.
pub(crate) const CHANNELS: usize = 2;
/// Offset of the "refused" word inside a ring header (tail is at 0, head at 64).
const REFUSED_IN_RING: usize = 32;

/// Segment state values.
pub(crate) const STATE_READY: u32 = 1;
pub(crate) const STATE_CLOSED: u32 = 2;

/// Sizes that define a segment's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    pub(crate) local_size: u32,
    pub(crate) eager_size: u32,
    pub(crate) eager_count: u32,
    pub(crate) max_size: u32,
    pub(crate) max_count: u32,
}

/// Offsets derived from [`Params`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) p: Params,
    pub(crate) ring_cap: usize,
    pub(crate) ring_stride: usize,
    pub(crate) rings_off: usize,
    pub(crate) returns_off: usize,
    pub(crate) fbox_off: usize,
    pub(crate) pool_off: usize,
    pub(crate) total: usize,
}

const fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl Layout {
    /// Compute the layout; `None` if the sizes overflow or make no sense.
    pub(crate) fn new(p: Params) -> Option<Layout> {
        if p.local_size == 0
            || p.eager_count == 0
            || p.max_count == 0
            || p.eager_size < super::FRAG_BODY as u32 + 8
            || p.max_size < p.eager_size
            || p.eager_size % 8 != 0
            || p.max_size % 8 != 0
            || p.local_size > 4096
            || u64::from(p.eager_count) + u64::from(p.max_count) > 1 << 20
        {
            return None;
        }
        let frags = (p.eager_count as usize).checked_add(p.max_count as usize)?;
        let ring_cap = frags.checked_next_power_of_two()?;
        let ring_stride = align(ring_bytes(ring_cap), 64);
        let rings_off = HEADER_LEN;
        let rings = (p.local_size as usize).checked_mul(ring_stride)?;
        let returns_off = rings_off.checked_add(rings.checked_mul(CHANNELS)?)?;
        let fbox_off = align(returns_off.checked_add(rings)?, 64);
        let fboxes = (p.local_size as usize).checked_mul(super::fbox::BOX_BYTES)?;
        let pool_off = align(fbox_off.checked_add(fboxes)?, 4096);
        let pool = (p.eager_count as usize)
            .checked_mul(p.eager_size as usize)?
            .checked_add((p.max_count as usize).checked_mul(p.max_size as usize)?)?;
        let total = pool_off.checked_add(pool)?;
        // Ring slots carry fragment offsets in their low 40 bits.
        if total as u64 > crate::sys::ring::VALUE_MASK {
            return None;
        }
        Some(Layout {
            p,
            ring_cap,
            ring_stride,
            rings_off,
            returns_off,
            fbox_off,
            pool_off,
            total,
        })
    }

    /// Number of fragments in the pool.
    pub(crate) fn frags(&self) -> usize {
        (self.p.eager_count + self.p.max_count) as usize
    }

    /// Offset and size of fragment `i`.
    pub(crate) fn frag(&self, i: usize) -> (u64, usize) {
        let ec = self.p.eager_count as usize;
        let es = self.p.eager_size as usize;
        if i < ec {
            ((self.pool_off + i * es) as u64, es)
        } else {
            let base = self.pool_off + ec * es;
            (
                (base + (i - ec) * self.p.max_size as usize) as u64,
                self.p.max_size as usize,
            )
        }
    }

    /// Which fragment starts at `off`, if any (validates peer input).
    pub(crate) fn frag_index(&self, off: u64) -> Option<usize> {
        let off = usize::try_from(off).ok()?;
        let ec = self.p.eager_count as usize;
        let es = self.p.eager_size as usize;
        let ms = self.p.max_size as usize;
        let rel = off.checked_sub(self.pool_off)?;
        if rel < ec * es {
            return whole(rel, es);
        }
        let i = whole(rel - ec * es, ms)?;
        (i < self.p.max_count as usize).then_some(ec + i)
    }
}

/// `rel / size` if `size` divides `rel`: with a shift for a power of two
/// (the default sizes; this runs for every fragment received and taken
/// back, and a 64-bit `div` costs tens of cycles).
fn whole(rel: usize, size: usize) -> Option<usize> {
    if size.is_power_of_two() {
        (rel & (size - 1) == 0).then_some(rel >> size.trailing_zeros())
    } else {
        (rel % size == 0).then_some(rel / size)
    }
}

/// A mapped segment (ours or a peer's).
pub(crate) struct Segment {
    file: SharedMem,
    /// Ours only, until we close: peers may still fetch it.
    served: Mutex<Option<Served>>,
    id: [u8; 16],
    pub(crate) layout: Layout,
    pub(crate) pid: u32,
    pub(crate) local_rank: u32,
}

pub(crate) fn encode(
    params: &Params,
    job_tag: [u64; 2],
    total: usize,
    pid: u32,
    local_rank: u32,
) -> [u8; PARAMS_LEN] {
    let mut h = [0u8; PARAMS_LEN];
    let mut w = |o: usize, b: &[u8]| h[o..o + b.len()].copy_from_slice(b);
    w(0, &MAGIC.to_le_bytes());
    w(8, &VERSION.to_le_bytes());
    w(12, &(HEADER_LEN as u32).to_le_bytes());
    w(16, &job_tag[0].to_le_bytes());
    w(24, &job_tag[1].to_le_bytes());
    w(32, &(total as u64).to_le_bytes());
    w(40, &pid.to_le_bytes());
    w(44, &local_rank.to_le_bytes());
    w(48, &params.local_size.to_le_bytes());
    w(52, &params.eager_size.to_le_bytes());
    w(56, &params.eager_count.to_le_bytes());
    w(60, &params.max_size.to_le_bytes());
    w(64, &params.max_count.to_le_bytes());
    h
}

/// What a header says, before it is trusted.
#[derive(Debug)]
pub(crate) struct Header {
    pub(crate) magic: u64,
    pub(crate) version: u32,
    pub(crate) header_len: u32,
    pub(crate) job_tag: [u64; 2],
    pub(crate) total: u64,
    pub(crate) pid: u32,
    pub(crate) local_rank: u32,
    pub(crate) params: Params,
}

/// Decode a header from bytes; any bytes decode (validation is separate).
pub(crate) fn decode(h: &[u8; PARAMS_LEN]) -> Header {
    let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    let u64_at = |o: usize| u64::from(u32_at(o)) | (u64::from(u32_at(o + 4)) << 32);
    Header {
        magic: u64_at(0),
        version: u32_at(8),
        header_len: u32_at(12),
        job_tag: [u64_at(16), u64_at(24)],
        total: u64_at(32),
        pid: u32_at(40),
        local_rank: u32_at(44),
        params: Params {
            local_size: u32_at(48),
            eager_size: u32_at(52),
            eager_count: u32_at(56),
            max_size: u32_at(60),
            max_count: u32_at(64),
        },
    }
}

/// What we expect of a peer's segment.
pub(crate) struct Expect {
    pub(crate) job_tag: [u64; 2],
    pub(crate) pid: u32,
    pub(crate) local_rank: u32,
    pub(crate) local_size: u32,
}

/// Check a decoded header against expectations and the file size.
pub(crate) fn validate(h: &Header, file_len: usize, exp: &Expect) -> Result<Layout> {
    let bad = |what: String| Err(Error::Config(format!("shared segment rejected: {what}")));
    if h.magic != MAGIC {
        return bad(format!(
            "bad magic {:#018x}: not an async-btl segment (or a corrupted one)",
            h.magic
        ));
    }
    if h.version != VERSION {
        return bad(format!(
            "version {} but this build speaks {VERSION}: run the same async-btl on every rank",
            h.version
        ));
    }
    if h.job_tag != exp.job_tag {
        return bad("it belongs to another job (job key mismatch)".into());
    }
    if h.header_len as usize != HEADER_LEN || h.pid != exp.pid || h.local_rank != exp.local_rank {
        return bad(format!(
            "header says pid {} local rank {}, the address exchange said pid {} local rank {}",
            h.pid, h.local_rank, exp.pid, exp.local_rank
        ));
    }
    if h.params.local_size != exp.local_size {
        return bad(format!(
            "it was made for {} local ranks, this job has {}",
            h.params.local_size, exp.local_size
        ));
    }
    let Some(layout) = Layout::new(h.params) else {
        return bad(format!("impossible sizes {:?}", h.params));
    };
    if layout.total as u64 != h.total || layout.total > file_len {
        return bad(format!(
            "layout needs {} bytes, header says {}, file has {file_len}",
            layout.total, h.total
        ));
    }
    Ok(layout)
}

impl Segment {
    /// Create our own segment and initialise every ring (receiver-initialised).
    pub(crate) fn create(
        id: &[u8; 16],
        params: Params,
        job_tag: [u64; 2],
        local_rank: u32,
    ) -> Result<Segment> {
        let layout = Layout::new(params).ok_or_else(|| {
            Error::Config(format!("shared-memory sizes make no sense: {params:?}"))
        })?;
        let mut file = SharedMem::create(c"abtl-segment", layout.total)?;
        let pid = crate::sys::os::pid();
        // A fresh memory file is zero-filled by the kernel: rings start empty.
        file.raw()
            .write(0, &encode(&params, job_tag, layout.total, pid, local_rank))?;
        // Fault in our fragment pools now, a write per page: their first
        // lap would otherwise take a page fault on every page of every
        // fragment, on the path of the messages (a 16 KiB copy into a
        // fresh fragment took several times as long as into a used one).
        // (At the smallest page size: a larger page is touched more than
        // once, harmlessly.)
        const PAGE: usize = 4096;
        for (off, size) in (0..layout.frags()).map(|i| layout.frag(i)) {
            for page in (0..size).step_by(PAGE) {
                file.raw().write(off + page as u64, &[0])?;
            }
        }
        let served = share::serve(&mut file, share::Kind::Segment, *id, job_tag)?;
        let seg = Segment {
            file,
            served: Mutex::new(Some(served)),
            id: *id,
            layout,
            pid,
            local_rank,
        };
        // Peers attach only once they have our address, which we publish
        // after this returns: they see the state as READY.
        seg.state()
            .store(STATE_READY, crate::sys::sync::Ordering::Release);
        Ok(seg)
    }

    /// Validate a peer's segment, fetched and mapped (sealed, checked).
    pub(crate) fn attach(file: SharedMem, exp: &Expect) -> Result<Segment> {
        let mut h = [0u8; PARAMS_LEN];
        file.raw().read(0, &mut h)?;
        let layout = validate(&decode(&h), file.len(), exp)?;
        Ok(Segment {
            file,
            served: Mutex::new(None),
            id: [0; 16],
            layout,
            pid: exp.pid,
            local_rank: exp.local_rank,
        })
    }

    /// The whole mapping.
    pub(crate) fn raw(&self) -> RawBuf {
        self.file.raw()
    }

    /// The id peers fetch it by (for the address exchange).
    pub(crate) fn id(&self) -> [u8; 16] {
        self.id
    }

    /// Stop handing it to peers (those that mapped it keep their mapping).
    pub(crate) fn withdraw(&self) {
        lock(&self.served).take();
    }

    fn ring_at(&self, off: usize) -> Ring<'_> {
        let raw = &self.file;
        let words = |o: usize, n: usize| {
            raw.raw_ref()
                .atomics_u64(o, n)
                .expect("ring offsets come from a validated layout and are in range")
        };
        Ring {
            tail: &words(off, 1)[0],
            head: &words(off + 64, 1)[0],
            slots: words(off + RING_HEADER, self.layout.ring_cap),
        }
    }

    fn inbound_off(&self, from: u32, ch: usize) -> usize {
        self.layout.rings_off + (from as usize * CHANNELS + ch) * self.layout.ring_stride
    }

    /// The ring on which local rank `from` sends us fragment offsets on
    /// channel `ch` (0 user messages, 1 control).
    pub(crate) fn inbound(&self, from: u32, ch: usize) -> Ring<'_> {
        self.ring_at(self.inbound_off(from, ch))
    }

    /// The tail word alone of [`inbound`](Self::inbound)`(from, ch)`: what
    /// a look for new fragments reads.
    pub(crate) fn inbound_tail(&self, from: u32, ch: usize) -> &crate::sys::sync::AtomicU64 {
        &self
            .file
            .raw_ref()
            .atomics_u64(self.inbound_off(from, ch), 1)
            .expect("ring offsets come from a validated layout and are in range")[0]
    }

    /// Set by the owner when it cut local rank `from` off after a protocol
    /// error; `from` reads it and fails its own pending operations. Lives in
    /// the unused half of the tail's cache line of `from`'s user ring.
    pub(crate) fn refused(&self, from: u32) -> &AtomicU32 {
        self.word(self.inbound_off(from, 0) + REFUSED_IN_RING)
    }

    /// The ring on which local rank `from` returns our fragments.
    pub(crate) fn returns(&self, from: u32) -> Ring<'_> {
        self.ring_at(self.layout.returns_off + from as usize * self.layout.ring_stride)
    }

    /// The fast box that local rank `from` writes into this segment.
    pub(crate) fn fbox(&self, from: u32) -> super::fbox::FBox<'_> {
        let off = self.layout.fbox_off + from as usize * super::fbox::BOX_BYTES;
        let raw = self.file.raw_ref();
        raw.atomics_u64(off, super::fbox::BOX_WORDS)
            .zip(raw.slice(off as u64, super::fbox::BOX_BYTES).ok())
            .and_then(|(words, bytes)| super::fbox::FBox::new(words, bytes))
            .expect("fast-box offsets come from a validated layout and are in range")
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        self.file
            .raw_ref()
            .atomic_u32(off)
            .expect("word offsets come from a validated layout and are in range")
    }

    /// The segment's lifecycle state.
    pub(crate) fn state(&self) -> &AtomicU32 {
        self.word(STATE_OFF)
    }

    /// The owner's "asleep, ring my doorbell" flag.
    pub(crate) fn armed(&self) -> &AtomicU32 {
        self.word(ARMED_OFF)
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params() -> Params {
        Params {
            local_size: 3,
            eager_size: 4096,
            eager_count: 4,
            max_size: 32768,
            max_count: 2,
        }
    }

    #[test]
    fn frag_index_round_trips_and_rejects_the_rest() {
        let l = Layout::new(params()).unwrap();
        for i in 0..l.frags() {
            let (off, _) = l.frag(i);
            assert_eq!(l.frag_index(off), Some(i));
            assert_eq!(l.frag_index(off + 8), None);
        }
        assert_eq!(l.frag_index(0), None);
        assert_eq!(l.frag_index(l.total as u64), None);
        assert_eq!(l.frag_index(u64::MAX), None);
    }

    /// What a peer maps of `seg`: fetched from this process's server.
    fn fetched(seg: &Segment, job_tag: [u64; 2]) -> SharedMem {
        let req = share::Request {
            kind: share::Kind::Segment,
            job_tag,
            id: seg.id(),
        };
        share::fetch(&share::server().unwrap(), seg.pid, req, HEADER_LEN).unwrap()
    }

    #[test]
    fn corrupted_or_foreign_segments_are_refused_with_clear_errors() {
        let id = crate::sys::os::random_bytes::<16>();
        let seg = Segment::create(&id, params(), [1, 2], 0).unwrap();
        let exp = |tag| Expect {
            job_tag: tag,
            pid: seg.pid,
            local_rank: 0,
            local_size: 3,
        };
        let attach = |e: &Expect| Segment::attach(fetched(&seg, [1, 2]), e);
        assert!(attach(&exp([1, 2])).is_ok());
        let e = attach(&exp([9, 9])).err().unwrap().to_string();
        assert!(e.contains("another job"), "{e}");
        let e = attach(&Expect {
            local_rank: 1,
            ..exp([1, 2])
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("local rank"), "{e}");
        // Corrupt the magic, then the sizes.
        seg.raw().write(0, b"NOTOURS!").unwrap();
        let e = attach(&exp([1, 2])).err().unwrap().to_string();
        assert!(e.contains("bad magic"), "{e}");
        seg.raw().write(0, &MAGIC.to_le_bytes()).unwrap();
        seg.raw().write(56, &u32::MAX.to_le_bytes()).unwrap();
        let e = attach(&exp([1, 2])).err().unwrap().to_string();
        assert!(
            e.contains("impossible sizes") || e.contains("layout needs"),
            "{e}"
        );
        // Once withdrawn, no peer can fetch it any more.
        seg.withdraw();
        let req = share::Request {
            kind: share::Kind::Segment,
            job_tag: [1, 2],
            id,
        };
        let e = share::fetch(&share::server().unwrap(), seg.pid, req, HEADER_LEN);
        assert!(matches!(e, Err(share::FetchError::Unknown(_))));
    }

    proptest! {
        #[test]
        fn any_header_bytes_decode_and_validate_without_panic(bytes in proptest::collection::vec(any::<u8>(), PARAMS_LEN)) {
            let h: [u8; PARAMS_LEN] = bytes.try_into().unwrap();
            let d = decode(&h);
            let exp = Expect { job_tag: [1, 2], pid: 7, local_rank: 0, local_size: 3 };
            let _ = validate(&d, 1 << 30, &exp);
        }

        #[test]
        fn header_round_trips(ls in 1u32..64, ec in 1u32..128, mc in 1u32..32, tag0: u64, tag1: u64, pid: u32, lr in 0u32..64) {
            let p = Params { local_size: ls, eager_size: 4096, eager_count: ec, max_size: 65536, max_count: mc };
            let l = Layout::new(p).unwrap();
            let d = decode(&encode(&p, [tag0, tag1], l.total, pid, lr));
            prop_assert_eq!(d.params, p);
            prop_assert_eq!(d.job_tag, [tag0, tag1]);
            let exp = Expect { job_tag: [tag0, tag1], pid, local_rank: lr, local_size: ls };
            prop_assert_eq!(validate(&d, l.total, &exp).unwrap(), l);
        }
    }
}

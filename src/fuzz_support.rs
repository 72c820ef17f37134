//! For the crate's fuzz targets (`fuzz/`); not a stable API.
//!
//! Thin wrappers that hand bytes to the real parsers of everything that
//! arrives from another process or from the network — shared-memory
//! fragment and segment headers, fast boxes and rings as a peer leaves
//! them, the rendezvous and single-copy control messages, emulated RMA
//! requests and answers, published addresses, bootstrap frames and
//! directory entries, the `sm` share server's requests and answers, udp
//! frames and bundles — and, where an encoder
//! exists, re-encode what they accept, so that a target can check the
//! round trip. Hidden from the docs; may change at any time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use crate::core::completion::Completion;
use crate::core::region::{MemoryRegion, RegionTable};
use crate::core::rma::{self as core_rma, PutPart, Rma};
use crate::sm::fbox;
use crate::sm::frag::{FragHeader, FRAG_HEADER};
use crate::sm::segment;
use crate::sys::mem::{AtomicOp, RawBuf};
use crate::sys::ring::{self, ConsumerState, ProducerState, Ring};
use crate::sys::sync::{lock, AtomicU64, Ordering};
use crate::transport::{Kind, Link, Published};
use crate::udp::proto::sim;
use crate::{Rank, Result};

/// Bytes of an `sm` fragment header.
pub const SM_FRAG_HEADER: usize = FRAG_HEADER;

/// Decode an `sm` fragment header for a fragment of `capacity` payload
/// bytes: its payload length and its re-encoding, if accepted.
pub fn sm_frag_header(b: &[u8; FRAG_HEADER], capacity: usize) -> Option<(u32, [u8; FRAG_HEADER])> {
    FragHeader::decode(b, capacity)
        .ok()
        .map(|h| (h.len, h.encode()))
}

/// Bytes of an `sm` segment header that [`sm_segment_header`] reads.
pub const SM_SEGMENT_HEADER: usize = 72;

/// What a peer's segment must say to be attached.
#[derive(Debug, Clone, Copy)]
pub struct SegmentExpect {
    /// The job's tag.
    pub job_tag: [u64; 2],
    /// The peer's pid, from the address exchange.
    pub pid: u32,
    /// The peer's local rank.
    pub local_rank: u32,
    /// Ranks on the node.
    pub local_size: u32,
}

/// A validated segment's fragment pool (offsets a peer's rings may carry).
#[derive(Debug, Clone, Copy)]
pub struct SegmentLayout(segment::Layout);

impl SegmentLayout {
    /// Bytes the segment takes.
    pub fn total(&self) -> usize {
        self.0.total
    }
    /// Fragments in the pool.
    pub fn frags(&self) -> usize {
        self.0.frags()
    }
    /// Offset and size of fragment `i` (`i < frags()`).
    pub fn frag(&self, i: usize) -> (u64, usize) {
        self.0.frag(i)
    }
    /// Which fragment starts at `off` (an offset read from a peer's ring).
    pub fn frag_index(&self, off: u64) -> Option<usize> {
        self.0.frag_index(off)
    }
    /// Where the pool starts.
    pub fn pool_off(&self) -> usize {
        self.0.pool_off
    }
    /// Re-encode the header this layout was validated from, for `exp`.
    pub fn encode(&self, exp: &SegmentExpect) -> [u8; SM_SEGMENT_HEADER] {
        segment::encode(
            &self.0.p,
            exp.job_tag,
            self.0.total,
            exp.pid,
            exp.local_rank,
        )
    }
}

/// The expectations a segment header states about itself (so that a
/// fuzzer's header can pass the identity checks and reach the sizes).
pub fn sm_segment_claims(b: &[u8; SM_SEGMENT_HEADER]) -> SegmentExpect {
    let h = segment::decode(b);
    SegmentExpect {
        job_tag: h.job_tag,
        pid: h.pid,
        local_rank: h.local_rank,
        local_size: h.params.local_size,
    }
}

/// Decode and validate a peer's segment header, as attaching to a file of
/// `file_len` bytes does.
pub fn sm_segment_header(
    b: &[u8; SM_SEGMENT_HEADER],
    file_len: usize,
    exp: &SegmentExpect,
) -> Option<SegmentLayout> {
    let e = segment::Expect {
        job_tag: exp.job_tag,
        pid: exp.pid,
        local_rank: exp.local_rank,
        local_size: exp.local_size,
    };
    segment::validate(&segment::decode(b), file_len, &e)
        .ok()
        .map(SegmentLayout)
}

/// A shared structure's words are impossible (a peer scribbled on them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

/// A fast box in ordinary memory: an honest sender and the receiver, over
/// words a fuzzer may scribble on as a hostile peer would.
pub struct FastBox {
    words: Vec<AtomicU64>,
    tx: fbox::Sender,
    rx: fbox::Receiver,
}

/// What [`FastBox::take`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taken {
    /// The message's tag.
    pub tag: u64,
    /// A rendezvous announcement rather than a user message.
    pub rndv: bool,
    /// Its bytes.
    pub data: Vec<u8>,
}

impl FastBox {
    /// A box of `slots` slots (at least 1; a segment's boxes have 256).
    pub fn new(slots: usize) -> FastBox {
        let n = 8 + slots.max(1) * fbox::SLOT_WORDS;
        FastBox {
            words: (0..n).map(|_| AtomicU64::new(0)).collect(),
            tx: fbox::Sender::default(),
            rx: fbox::Receiver::default(),
        }
    }

    /// Slots of a box in a segment.
    pub const SEGMENT_SLOTS: usize = fbox::SLOTS;

    /// Largest payload a box carries.
    pub const MAX_PAYLOAD: usize = fbox::MAX_PAYLOAD;

    /// Words in the box (the lead words, then the slots).
    pub fn words(&self) -> usize {
        self.words.len()
    }

    fn fbox(&self) -> fbox::FBox<'_> {
        // SAFETY: the vector's memory is valid for reads and writes while
        // `self` lives, which the returned box borrows; every access to
        // it goes through the box (atomics or bounds-checked copies).
        let raw = unsafe { RawBuf::new(self.words.as_ptr() as *mut u8, self.words.len() * 8) };
        fbox::FBox::new(&self.words, raw).expect("a lead line and whole slots")
    }

    /// A hostile peer stores `v` into word `i` (modulo the box's words).
    pub fn scribble(&self, i: usize, v: u64) {
        self.words[i % self.words.len()].store(v, Ordering::Relaxed);
    }

    /// The honest sender puts a message (or, `rndv`, an announcement) in
    /// the box. `Ok(false)`: no room. `Err`: the receiver's counter is
    /// impossible.
    pub fn push(
        &mut self,
        tag: u64,
        data: &[u8],
        rndv: bool,
    ) -> std::result::Result<bool, Corrupt> {
        let b = self.fbox();
        let mut st = self.tx;
        let r = if rndv {
            b.push_rendezvous(&mut st, tag, data)
        } else {
            b.push(&mut st, tag, data, true)
        };
        self.tx = st;
        r.map_err(|_| Corrupt)
    }

    /// The sender's view: whether the receiver took everything.
    pub fn drained(&mut self) -> std::result::Result<bool, Corrupt> {
        let b = self.fbox();
        let mut st = self.tx;
        let r = b.drained(&mut st);
        let _ = b.looks_drained(&st);
        self.tx = st;
        r.map_err(|_| Corrupt)
    }

    /// The receiver takes the next message, reading it both ways the
    /// receive path does (which must agree). `Err`: the box is corrupt.
    pub fn take(&mut self) -> std::result::Result<Option<Taken>, Corrupt> {
        let b = self.fbox();
        let mut st = self.rx;
        let _ = b.looks_empty(&st);
        let found = match b.peek(&mut st) {
            Ok(Some(f)) => {
                let mut out = vec![0u8; f.len];
                b.read(&st, &mut out);
                assert_eq!(b.read_vec(&st, f.len), out, "the two reads disagree");
                b.consume(&mut st, f.len);
                Ok(Some((f, out)))
            }
            Ok(None) => Ok(None),
            Err(_) => Err(Corrupt),
        };
        self.rx = st;
        let Some((f, out)) = found? else {
            return Ok(None);
        };
        Ok(Some(Taken {
            tag: f.tag,
            rndv: f.rndv,
            data: out,
        }))
    }

    /// The receiver takes the next message as a receive for `tag` into a
    /// lent buffer does: a user message of up to two slots on `tag` in one
    /// step (`take_small`), anything else as [`take`](Self::take) reads it.
    pub fn take_direct(&mut self, tag: u64) -> std::result::Result<Option<Taken>, Corrupt> {
        let b = self.fbox();
        let mut st = self.rx;
        let mut out = vec![0xEE; 5];
        let r = b.take_small(&mut st, tag, &mut out, true);
        self.rx = st;
        match r {
            fbox::Take::Took(len) => {
                assert_eq!(out.len(), len, "the length taken is the bytes given");
                Ok(Some(Taken {
                    tag,
                    rndv: false,
                    data: out,
                }))
            }
            fbox::Take::Empty => Ok(None),
            fbox::Take::Other => self.take(),
        }
    }

    /// The pair's split-copy word as the receiver sees it for `handle`
    /// (any value a peer leaves there must read as some state).
    pub fn split_state(&self, handle: u64) -> u8 {
        crate::sm::split::state(self.fbox().split_word(), handle) as u8
    }
}

/// A ring in ordinary memory, with both sides' private state, over
/// indices and slots a fuzzer may scribble on as a hostile peer would.
pub struct PeerRing {
    tail: AtomicU64,
    head: AtomicU64,
    slots: Vec<AtomicU64>,
    prod: ProducerState,
    cons: ConsumerState,
}

impl PeerRing {
    /// A ring of `cap` slots, rounded up to a power of two (at least 1).
    pub fn new(cap: usize) -> PeerRing {
        let cap = cap.max(1).next_power_of_two();
        PeerRing {
            tail: AtomicU64::new(0),
            head: AtomicU64::new(0),
            slots: (0..cap).map(|_| AtomicU64::new(0)).collect(),
            prod: ProducerState::default(),
            cons: ConsumerState::default(),
        }
    }

    /// Largest value a slot carries.
    pub const VALUE_MASK: u64 = ring::VALUE_MASK;

    fn ring(&self) -> Ring<'_> {
        Ring {
            tail: &self.tail,
            head: &self.head,
            slots: &self.slots,
        }
    }

    /// A hostile peer stores `v`: into the tail (`at` 0), the head (1), or
    /// slot `at - 2` (modulo the slots).
    pub fn scribble(&self, at: usize, v: u64) {
        match at {
            0 => self.tail.store(v, Ordering::Relaxed),
            1 => self.head.store(v, Ordering::Relaxed),
            n => self.slots[(n - 2) % self.slots.len()].store(v, Ordering::Relaxed),
        }
    }

    /// The producer appends `v`. `Ok(false)`: full. `Err`: corrupt.
    pub fn push(&mut self, v: u64) -> std::result::Result<bool, Corrupt> {
        let mut st = self.prod;
        let r = self.ring().push(&mut st, v);
        self.prod = st;
        r.map_err(|_| Corrupt)
    }

    /// The consumer takes the oldest value (looking one ahead first, as
    /// the receive path does). `Err`: corrupt.
    pub fn pop(&mut self) -> std::result::Result<Option<u64>, Corrupt> {
        let mut st = self.cons;
        let ring = self.ring();
        let _ = ring.looks_empty(&st);
        let _ = ring.peek_ahead(&st, 1);
        let v = ring.peek(&mut st).map_err(|_| Corrupt)?;
        if v.is_some() {
            ring.advance(&mut st);
        }
        self.cons = st;
        Ok(v)
    }

    /// The producer's view: whether everything pushed was taken.
    pub fn drained(&mut self) -> std::result::Result<bool, Corrupt> {
        let mut st = self.prod;
        let ring = self.ring();
        let r = ring.drained(&mut st);
        let _ = ring.looks_drained(&st);
        self.prod = st;
        r.map_err(|_| Corrupt)
    }
}

/// Bytes of a rendezvous announcement.
pub const SM_RTS_LEN: usize = crate::sm::rendezvous::RTS_LEN;

/// Decode a rendezvous announcement: (handle, address, length) and its
/// re-encoding.
pub fn sm_rendezvous(b: &[u8; SM_RTS_LEN]) -> ((u64, u64, u64), [u8; SM_RTS_LEN]) {
    let r = crate::sm::rendezvous::Rts::decode(b);
    ((r.handle, r.addr, r.len), r.encode())
}

/// Decode a split-copy request against a message of `len` bytes: its
/// re-encoding and the byte range it asks for, if inside the message.
pub fn sm_split_request(
    b: &[u8],
    len: usize,
) -> Option<([u8; 24], Option<std::ops::Range<usize>>)> {
    let r = crate::sm::split::SplitReq::decode(b)?;
    Some((r.encode(), r.range(len)))
}

/// Decode an `sm` single-copy request; its re-encoding if accepted.
pub fn sm_cma_request(b: &[u8]) -> Option<Vec<u8>> {
    crate::sm::rma::CmaRequest::decode(b).map(|r| r.encode().to_vec())
}

/// Decode an `sm` single-copy answer; its re-encoding if accepted.
pub fn sm_cma_answer(b: &[u8]) -> Option<Vec<u8>> {
    crate::sm::rma::CmaAnswer::decode(b).map(|a| a.encode().to_vec())
}

/// Decode an emulated RMA request's header; the re-encoding (header and
/// the rest) if accepted.
pub fn rma_request(b: &[u8]) -> Option<Vec<u8>> {
    let (key, off, rest) = core_rma::decode_req(b)?;
    let mut v = core_rma::req_header(&key, off).to_vec();
    v.extend_from_slice(rest);
    Some(v)
}

/// Decode an emulated RMA answer's status; the re-encoding (status and
/// the rest) if accepted.
pub fn rma_status(b: &[u8]) -> Option<Vec<u8>> {
    let (r, rest) = core_rma::decode_status(b)?;
    let mut v = core_rma::encode_status(&r, rest.len());
    v.extend_from_slice(rest);
    Some(v.to_vec())
}

/// Decode an emulated put part; its re-encoding if accepted.
pub fn rma_put_part(b: &[u8]) -> Option<Vec<u8>> {
    PutPart::decode(b).map(|p| p.encode())
}

/// Decode an atomic operation; its re-encoding if accepted.
pub fn atomic_op(b: &[u8]) -> Option<[u8; 17]> {
    AtomicOp::decode(b).map(AtomicOp::encode)
}

/// Message kinds of the emulated RMA protocol, as they travel.
pub mod rma_kind {
    /// A put request.
    pub const PUT_REQ: u8 = 1;
    /// A put's answer.
    pub const PUT_ACK: u8 = 2;
    /// A get request.
    pub const GET_REQ: u8 = 3;
    /// A get's answer.
    pub const GET_RESP: u8 = 4;
    /// A flush request.
    pub const FLUSH_REQ: u8 = 7;
    /// A flush's answer.
    pub const FLUSH_ACK: u8 = 8;
    /// A part of a large put.
    pub const PUT_PART: u8 = 9;
    /// An atomic request.
    pub const ATOMIC_REQ: u8 = 10;
    /// An atomic's answer.
    pub const ATOMIC_RESP: u8 = 11;
}

/// A link that records what is submitted; the harness carries the
/// messages across by hand, in order.
struct Wire {
    peer: Rank,
    sent: Mutex<Vec<(Kind, u64, Bytes)>>,
    /// What one message built in place may hold (0: none is).
    room: usize,
    /// In-place sends asked for; every third is refused (no room just
    /// then), so the pooled path runs beside the in-place one.
    asked: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl Link for Wire {
    fn peer(&self) -> Rank {
        self.peer
    }
    fn transport(&self) -> &'static str {
        "fuzz"
    }
    fn try_send(&self, kind: Kind, tag: u64, data: &[u8]) -> Result<bool> {
        self.submit(kind, tag, Bytes::copy_from_slice(data))
            .map(|_| true)
    }
    fn submit(&self, kind: Kind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>> {
        lock(&self.sent).push((kind, tag, data));
        Ok(None)
    }
    fn fill_room(&self) -> usize {
        self.room
    }
    fn try_send_filled(
        &self,
        kind: Kind,
        tag: u64,
        head: &[u8],
        len: usize,
        fill: &mut dyn FnMut(crate::sys::mem::RawBuf) -> Result<()>,
    ) -> Result<bool> {
        let turn = self
            .asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.room == 0 || head.len() + len > self.room || turn % 3 == 2 {
            return Ok(false);
        }
        let body = crate::sys::mem::HeapBuf::from_vec(vec![0u8; len]);
        fill(body.raw())?;
        let mut data = head.to_vec();
        body.raw().read_into(0, len, &mut data)?;
        lock(&self.sent).push((kind, tag, Bytes::from(data)));
        Ok(true)
    }
    fn has_queued(&self) -> bool {
        false
    }
}

/// Two fabrics' emulated RMA engines joined by recording links: an
/// initiator (rank 0) with a destination region for gets, and a target
/// (rank 1) with one registered region. Requests and answers — honest
/// ones the initiator starts, or any bytes — go through the real entry
/// point, `Rma::handle`.
pub struct RmaPair {
    ini: Rma,
    tgt: Rma,
    _ini_regions: Arc<RegionTable>,
    _tgt_regions: Arc<RegionTable>,
    region: MemoryRegion,
    dst: MemoryRegion,
    to_tgt: Wire,
    to_ini: Wire,
    done: Vec<Arc<Completion>>,
    /// Hand messages over where they lie (`Rma::handle_in_place`, as `sm`
    /// does from its fragments) rather than as owned bytes.
    in_place: bool,
}

/// An honest operation's outcome, once answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Not answered yet.
    Pending,
    /// Done (a fetching atomic: with the previous value).
    Done(Option<u64>),
    /// Failed.
    Failed,
}

impl RmaPair {
    /// A pair whose target region holds `len` bytes (zeros) and whose
    /// destination region holds `dst_len` bytes.
    pub fn new(len: usize, dst_len: usize) -> RmaPair {
        let ini_regions = Arc::new(RegionTable::default());
        let tgt_regions = Arc::new(RegionTable::default());
        let ini = Rma::new(ini_regions.clone(), Arc::default(), Arc::default(), 2);
        let tgt = Rma::new(tgt_regions.clone(), Arc::default(), Arc::default(), 2);
        let region = tgt_regions.register(1, vec![0u8; len], &crate::core::region::no_nic);
        let dst = ini_regions.register(0, vec![0u8; dst_len], &crate::core::region::no_nic);
        RmaPair {
            ini,
            tgt,
            _ini_regions: ini_regions,
            _tgt_regions: tgt_regions,
            region,
            dst,
            to_tgt: Wire {
                peer: 1,
                sent: Mutex::new(Vec::new()),
                room: 0,
                asked: Default::default(),
            },
            to_ini: Wire {
                peer: 0,
                sent: Mutex::new(Vec::new()),
                room: 0,
                asked: Default::default(),
            },
            done: Vec::new(),
            in_place: false,
        }
    }

    /// Hand every message over where it lies, as `sm` hands over a
    /// message in one fragment (`true`), or as owned bytes (`false`, the
    /// default).
    pub fn set_in_place(&mut self, on: bool) {
        self.in_place = on;
        // Messages built in place of at most this many bytes: puts of up
        // to 255 bytes go in parts, gets in several answers.
        let room = if on { 100 } else { 0 };
        self.to_tgt.room = room;
        self.to_ini.room = room;
    }

    /// Give `rma` a message from `src` over `link`, as set.
    fn carry(&self, rma: &Rma, link: &Wire, src: u32, kind: Kind, id: u64, data: Bytes) {
        // As `sm`: what fits one fragment lies there; longer messages are
        // put together first.
        if self.in_place && data.len() <= link.room {
            let buf = crate::sys::mem::HeapBuf::from_vec(data.to_vec());
            rma.handle_in_place(link, src, kind, id, buf.raw());
        } else {
            rma.handle(link, src, kind, id, data);
        }
    }

    /// The target region's key id (what a request names).
    pub fn key(&self) -> [u8; 16] {
        self.region.remote_key().id
    }

    /// The target region's bytes.
    pub fn target_bytes(&self) -> Vec<u8> {
        self.region.to_vec()
    }

    /// The destination region's bytes.
    pub fn dst_bytes(&self) -> Vec<u8> {
        self.dst.to_vec()
    }

    fn track(&mut self, c: Arc<Completion>) -> usize {
        self.done.push(c);
        self.done.len() - 1
    }

    /// Start an honest put of `data` at `offset` of the target region;
    /// returns the operation's number.
    pub fn put(&mut self, offset: u64, data: &[u8]) -> usize {
        let src = crate::sys::mem::HeapBuf::from_vec(data.to_vec());
        let c = Completion::new();
        let key = self.key();
        self.ini.start_put(
            &self.to_tgt,
            &key,
            offset,
            (core_rma::PutSrc::Host(src.raw()), 0, data.len()),
            c.clone(),
        );
        // The request holds a copy of the data: `src` may go.
        drop(src);
        self.track(c)
    }

    /// Start an honest get of `len` bytes at `offset` into the
    /// destination region at `dst_offset`.
    pub fn get(&mut self, offset: u64, dst_offset: u64, len: usize) -> usize {
        let c = Completion::new();
        let key = self.key();
        let dst = (self.dst.inner.clone(), dst_offset, len);
        let _ = self
            .ini
            .start_get(&self.to_tgt, &key, offset, dst, Some(c.clone()));
        self.track(c)
    }

    /// Start an honest atomic (`op` in its wire form; ignored unless it
    /// decodes) on the word at `offset`.
    pub fn atomic(&mut self, offset: u64, op: &[u8]) -> Option<usize> {
        let op = AtomicOp::decode(op)?;
        let c = Completion::new();
        let key = self.key();
        self.ini
            .start_atomic(&self.to_tgt, &key, offset, op, c.clone());
        Some(self.track(c))
    }

    /// Ask for a flush of the implicit operations (none are started here:
    /// it answers at once).
    pub fn flush(&mut self) {
        let _ = self.ini.flush_request(&self.to_tgt);
    }

    /// Carry every request the initiator sent to the target, in order.
    pub fn deliver_requests(&self) -> usize {
        let msgs = std::mem::take(&mut *lock(&self.to_tgt.sent));
        let n = msgs.len();
        for (kind, id, data) in msgs {
            self.carry(&self.tgt, &self.to_ini, 0, kind, id, data);
        }
        n
    }

    /// Carry every answer the target sent to the initiator, in order.
    pub fn deliver_answers(&self) -> usize {
        let msgs = std::mem::take(&mut *lock(&self.to_ini.sent));
        let n = msgs.len();
        for (kind, id, data) in msgs {
            self.carry(&self.ini, &self.to_tgt, 1, kind, id, data);
        }
        n
    }

    /// Any message to the target (from rank 0): `kind` as it travels.
    pub fn forge_request(&self, kind: u8, id: u64, data: &[u8]) {
        if let Some(kind) = Kind::from_u8(kind) {
            let data = Bytes::copy_from_slice(data);
            self.carry(&self.tgt, &self.to_ini, 0, kind, id, data);
        }
    }

    /// Any message to the initiator (from rank 1).
    pub fn forge_answer(&self, kind: u8, id: u64, data: &[u8]) {
        if let Some(kind) = Kind::from_u8(kind) {
            let data = Bytes::copy_from_slice(data);
            self.carry(&self.ini, &self.to_tgt, 1, kind, id, data);
        }
    }

    /// Drop the target's pending answers (as if they were lost).
    pub fn drop_answers(&self) {
        lock(&self.to_ini.sent).clear();
    }

    /// Ids of the requests waiting to go to the target (an answer that
    /// names one of these can complete its operation).
    pub fn pending_ids(&self) -> Vec<u64> {
        lock(&self.to_tgt.sent).iter().map(|m| m.1).collect()
    }

    /// Operation `i`'s outcome.
    pub fn outcome(&self, i: usize) -> Outcome {
        let c = &self.done[i];
        if !c.is_done() {
            return Outcome::Pending;
        }
        let value = c.value();
        match c.take_done() {
            Some(Ok(())) => Outcome::Done(Some(value)),
            _ => Outcome::Failed,
        }
    }

    /// Operations (or settlements) the initiator still waits for.
    pub fn outstanding(&self) -> usize {
        self.ini.outstanding(1)
    }
}

/// Decode what a rank published in the address exchange (it must name
/// `rank`); its re-encoding if accepted.
pub fn published(rank: Rank, b: &[u8]) -> Option<Vec<u8>> {
    Published::decode(rank, b)
        .ok()
        .and_then(|p| postcard::to_allocvec(&p).ok())
}

/// Decode an `sm` address; its re-encoding if accepted.
pub fn sm_addr(b: &[u8]) -> Option<Vec<u8>> {
    let peer = crate::transport::Peer { rank: 1, addr: b };
    crate::sm::decode_addr(&peer)
        .ok()
        .and_then(|a| postcard::to_allocvec(&a).ok())
}

/// Decode the request a peer sends to `sm`'s share server (what memory
/// file it wants); its re-encoding if accepted.
pub fn sm_share_request(b: &[u8]) -> Option<Vec<u8>> {
    crate::sm::share::Request::decode(b)
        .ok()
        .map(|r| r.encode().to_vec())
}

/// Decode the share server's answer, as an asker does: with `fds`
/// descriptors attached it is accepted only if it says yes with exactly
/// one, or no with none. Its re-encoding if accepted.
pub fn sm_share_answer(b: &[u8], fds: usize) -> Option<Vec<u8>> {
    let a = crate::sm::share::Answer::decode(b).ok()?;
    crate::sm::share::acceptable(&a, fds).ok()?;
    Some(a.encode().to_vec())
}

/// Decode a `udp` address; its re-encoding if accepted.
pub fn udp_addr(b: &[u8]) -> Option<Vec<u8>> {
    crate::udp::decode_addr(1, b)
        .ok()
        .and_then(|a| postcard::to_allocvec(&a).ok())
}

/// Decode an `rdma` address; its re-encoding if accepted.
pub fn rdma_addr(b: &[u8]) -> Option<Vec<u8>> {
    crate::rdma::wire::decode_addr(1, b)
        .ok()
        .and_then(|a| postcard::to_allocvec(&a).ok())
}

/// Which side of the bootstrap protocol a frame goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameTo {
    /// Server to client.
    Client,
    /// Client to server.
    Server,
}

/// Decode a whole bootstrap frame (length prefix and body), under the
/// handshake's limit or the later one; its re-encoding if accepted.
pub fn bootstrap_frame(to: FrameTo, frame: &[u8], handshake: bool) -> Option<Vec<u8>> {
    use crate::bootstrap::wire;
    let max = if handshake {
        wire::MAX_HANDSHAKE
    } else {
        wire::MAX_FRAME
    };
    let (len, body) = frame.split_first_chunk::<4>()?;
    let len = wire::check_len(*len, max).ok()?;
    if body.len() != len {
        return None;
    }
    match to {
        FrameTo::Client => wire::decode_body::<wire::ToClient>(body)
            .ok()
            .and_then(|m| wire::encode_frame(&m).ok()),
        FrameTo::Server => wire::decode_body::<wire::ToServer>(body)
            .ok()
            .and_then(|m| wire::encode_frame(&m).ok()),
    }
}

/// A job for the directory rendezvous: `size` ranks sharing the key
/// made of `key`; this process is `rank`.
pub fn bootstrap_job(rank: u32, size: u32, key: [u8; 32]) -> Option<crate::bootstrap::JobInfo> {
    crate::bootstrap::JobInfo::builder(rank, size)
        .job_key(crate::bootstrap::JobKey::from_bytes(key))
        .build()
        .ok()
}

/// The directory entry `job`'s rank writes for `round` with `blob`.
pub fn bootstrap_dir_encode(job: &crate::bootstrap::JobInfo, round: u32, blob: &[u8]) -> Vec<u8> {
    crate::bootstrap::dir::encode_entry(job, round, blob.to_vec()).unwrap_or_default()
}

/// Check rank `rank`'s directory entry for `round` as `job` reads it;
/// its blob if accepted.
pub fn bootstrap_dir_entry(
    job: &crate::bootstrap::JobInfo,
    round: u32,
    rank: u32,
    bytes: &[u8],
) -> Option<Vec<u8>> {
    let path = std::path::Path::new("fuzz-entry");
    crate::bootstrap::dir::decode_entry(job, round, rank, bytes, path).ok()
}

/// A udp transport message as it comes out of the frame decoder: kind
/// byte, tag, data.
pub type UdpMessage = (u8, u64, Vec<u8>);

/// What one protocol message decoded to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UdpFrames {
    /// A split message's head: its data is the next protocol message.
    Head,
    /// One transport message.
    One(UdpMessage),
    /// A bundle's messages, in order.
    Many(Vec<UdpMessage>),
}

/// A peer's udp frame decoder (it keeps a head waiting for its data).
#[derive(Default)]
pub struct UdpDecoder(crate::udp::frame::Decoder);

impl UdpDecoder {
    /// Take the next protocol message; `None` if malformed.
    pub fn push(&mut self, msg: &[u8]) -> Option<UdpFrames> {
        use crate::udp::frame::Frames;
        let out = |(k, t, d): (Kind, u64, Bytes)| (k as u8, t, d.to_vec());
        Some(match self.0.push(Bytes::copy_from_slice(msg)).ok()? {
            Frames::Head => UdpFrames::Head,
            Frames::One(k, t, d) => UdpFrames::One(out((k, t, d))),
            Frames::Many(it) => UdpFrames::Many(it.map(out).collect()),
        })
    }
}

/// Encode a udp transport message as its protocol messages (a head and
/// the data from [`UDP_SPLIT_MIN`] bytes). `None`: unknown kind.
pub fn udp_encode(kind: u8, tag: u64, data: &[u8]) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
    let kind = Kind::from_u8(kind)?;
    let (a, b) =
        crate::udp::frame::encode(&Arc::default(), kind, tag, Bytes::copy_from_slice(data));
    Some((a.to_vec(), b.map(|b| b.to_vec())))
}

/// Messages from this many bytes go as a head and the data.
pub const UDP_SPLIT_MIN: usize = crate::udp::frame::SPLIT_MIN;

/// Bundle one-part messages as the driver does (a bundle of one is that
/// message itself). `None`: an unknown kind.
pub fn udp_bundle(msgs: &[UdpMessage]) -> Option<Vec<u8>> {
    let pool = Arc::default();
    let mut parts = msgs
        .iter()
        .map(|(k, t, d)| Kind::from_u8(*k).map(|k| crate::udp::frame::one_part(&pool, k, *t, d)));
    let mut b = crate::udp::frame::Bundle::new(parts.next()??);
    for p in parts {
        b.push(p?, usize::MAX).ok()?;
    }
    Some(b.finish().to_vec())
}

/// An honest exchange between two udp protocol connections over the
/// sans-IO simulator, into which a fuzzer mixes datagrams of its own.
pub struct UdpExchange {
    sim: sim::Sim,
}

/// What a side sent and what the other received.
#[derive(Debug)]
pub struct Delivered {
    /// Messages side `i` had accepted by `send`, in order.
    pub sent: [Vec<Vec<u8>>; 2],
    /// Messages side `i` received, in order.
    pub received: [Vec<Vec<u8>>; 2],
    /// Whether every message was delivered and acknowledged, and both
    /// connections are idle.
    pub complete: bool,
    /// Whether either side declared the other lost.
    pub lost: bool,
}

impl UdpExchange {
    /// Two connections with small datagrams and windows and the given ISNs,
    /// over a link that loses, duplicates and reorders as `seed` draws
    /// (each in `0..=255`ths: `loss`, `dup`, `reorder`).
    pub fn new(seed: u64, isns: [u64; 2], loss: u8, dup: u8, reorder: u8) -> UdpExchange {
        Self::guarded(seed, isns, loss, dup, reorder, false)
    }

    /// As [`new`](Self::new), the datagrams guarded by the keyed MAC when
    /// `mac` (`BTL_UDP_AUTH=mac`), else by the CRC.
    pub fn guarded(
        seed: u64,
        isns: [u64; 2],
        loss: u8,
        dup: u8,
        reorder: u8,
        mac: bool,
    ) -> UdpExchange {
        let cfg = crate::udp::proto::Config {
            max_datagram: 300,
            send_window: 16,
            recv_window: 16,
            guard: if mac {
                crate::udp::proto::Guard::Mac
            } else {
                crate::udp::proto::Guard::Crc
            },
            ..crate::udp::proto::Config::default()
        };
        let p = |x: u8| f64::from(x) / 1024.0;
        let link = sim::Link {
            loss: p(loss),
            dup: p(dup),
            reorder: p(reorder),
            ..sim::Link::default()
        };
        UdpExchange {
            sim: sim::Sim::with_isns(seed, cfg, link, isns),
        }
    }

    /// The job id both connections use.
    pub const JOB: u64 = sim::JOB;

    /// Queue a message from side `from` to the other.
    pub fn queue(&mut self, from: usize, msg: Vec<u8>) {
        self.sim.queue(from % 2, msg.into());
    }

    /// Deliver `data` to side `to`, `after` from now.
    pub fn inject(&mut self, to: usize, after: Duration, data: Vec<u8>) {
        let at = self.sim.now + after;
        self.sim.inject(to % 2, at, data);
    }

    /// A copy of the `i`-th datagram on the wire now (modulo their
    /// number), with its destination side.
    pub fn in_flight(&self, i: usize) -> Option<(usize, Vec<u8>)> {
        let n = self.sim.in_flight().count();
        if n == 0 {
            return None;
        }
        self.sim
            .in_flight()
            .nth(i % n)
            .map(|(to, d)| (to, d.to_vec()))
    }

    /// Advance to the next event; `false` when nothing is left to happen.
    pub fn step(&mut self) -> bool {
        self.sim.step()
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        self.sim.elapsed()
    }

    /// Run until complete, or `limit` of virtual time, or nothing is left.
    pub fn run(&mut self, limit: Duration) -> bool {
        self.sim.run_until(limit, sim::Sim::complete)
    }

    /// What was sent and delivered so far.
    pub fn delivered(&self) -> Delivered {
        let s = &self.sim.sides;
        let sent = |i: usize| s[i].sent.iter().map(|(_, m)| m.to_vec()).collect();
        let received = |i: usize| s[i].received.iter().map(|m| m.to_vec()).collect();
        Delivered {
            sent: [sent(0), sent(1)],
            received: [received(0), received(1)],
            complete: self.sim.complete(),
            lost: s.iter().any(|x| x.lost_at.is_some()),
        }
    }

    /// Messages still waiting for send budget on side `i`.
    pub fn unsent(&self, i: usize) -> usize {
        self.sim.sides[i % 2].outbox.len()
    }
}

/// Decode an `rdma` frame (header and body, as a receive buffer holds
/// it); its re-encoding if accepted.
pub fn rdma_frame(b: &[u8]) -> Option<Vec<u8>> {
    let (h, body) = crate::rdma::wire::decode(b).ok()?;
    Some(crate::rdma::wire::reencode(&h, &body))
}

/// Decode an `rdma` key handle (as a `RemoteKey` from a peer carries it);
/// its re-encoding if accepted.
pub fn rdma_key_handle(b: &[u8]) -> Option<Vec<u8>> {
    crate::rdma::wire::Handle::decode(b).map(|h| h.encode())
}

/// Decode an `smcuda` handshake message (what a peer's GPU layer sends
/// before any IPC handle); its re-encoding if accepted.
pub fn smcuda_handshake(b: &[u8]) -> Option<Vec<u8>> {
    crate::smcuda::handshake::Msg::decode(b)
        .ok()
        .map(|m| m.encode())
}

/// Decode an `smcuda` key handle (as a peer's `RemoteKey` carries it);
/// its re-encoding if accepted.
pub fn smcuda_key_handle(b: &[u8]) -> Option<Vec<u8>> {
    crate::smcuda::key::Handle::decode(b)
        .ok()
        .map(|h| h.encode())
}

/// Decode a lent message's announcement from rank `src` (what a peer's
/// `send_region` of device memory sends in place of the bytes); its
/// re-encoding if accepted.
pub fn lent_announce(src: u32, b: &[u8]) -> Option<Vec<u8>> {
    crate::core::lend::Announce::decode(src, b)
        .ok()
        .map(|a| a.encode())
}

/// Decode a receiver's answer to a lent message; its re-encoding if
/// accepted.
pub fn lent_answer(b: &[u8]) -> Option<Vec<u8>> {
    crate::core::lend::Answer::decode(b)
        .ok()
        .map(|a| a.encode())
}

/// Split a core control message (a transport's message to its peer, sent
/// over the pair's message link) into its transport name and payload.
pub fn control_message(b: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    crate::core::fabric::split_control(b)
        .ok()
        .map(|(n, p)| (n.to_vec(), p.to_vec()))
}

//! Emulated one-sided operations: put, get and atomics over messages, for
//! every operation a transport does not carry natively
//! ([`Link::post`](crate::transport::Link::post) answered `Emulate`).
//!
//! The initiator sends a request naming the key id and offset; the *target*
//! looks the id up in its own table, checks the range, then writes, reads
//! or applies the atomic (with the same hardware instruction a native
//! atomic uses, so both kinds are atomic with each other) and answers. A
//! forged, stale or out-of-range key is refused by the target with its
//! memory untouched, and counted.
//!
//! It also follows the operations a transport posted natively
//! ([`Rma::track`]), so that `flush` waits for those too.
//!
//! Ownership: an emulated get keeps the destination region alive (an `Arc`)
//! in the pending table until the answer lands, the peer is lost or the
//! wait times out ([`Rma::expire`]: a peer that answered none of ours for
//! `Config::answer_timeout` while its link held nothing of ours), so
//! dropping the future cannot free memory the engine will still write (a
//! late answer to an expired get is dropped unread).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{BufMut, Bytes, BytesMut};

use crate::core::bufpool::BufPool;
use crate::core::completion::{Completion, Tally};
use crate::core::region::{KeyId, RegionInner, RegionTable};
use crate::core::stats::Counters;
use crate::sys::mem::{AtomicOp, RawBuf};
use crate::sys::sync::lock;
use crate::transport::{Kind, Link};
use crate::{AccessError, Error, Rank, Result};

enum Pending {
    Put,
    Get {
        dst: Arc<RegionInner>,
        offset: u64,
        len: usize,
        /// A part of a large get other than its last: a refusal is left to
        /// the last part to report (it is refused too: same key, later
        /// range).
        quiet: bool,
        /// The last part of a get of several: the whole get's remote range,
        /// which its refusal reports (not the part's own).
        whole: Option<(u64, u64)>,
        /// A get of several parts: the first failure of a part other than
        /// the last that the last does not see itself (a device copy that
        /// failed, a malformed answer), which the last part reports.
        failed: Option<Arc<Mutex<Option<Error>>>>,
    },
    /// A flush request: once answered, every implicit put to the peer
    /// numbered up to `upto` is done (or its refusal is in the answer).
    Flush {
        upto: u64,
    },
    /// An emulated fetching atomic: the answer carries the previous value.
    Atomic,
}

/// Where an emulated put's bytes come from.
#[derive(Clone)]
pub(crate) enum PutSrc {
    /// Host memory.
    Host(RawBuf),
    /// A region, read through its device when it is device memory (the
    /// host-staged path of `smcuda`).
    Region(Arc<RegionInner>),
}

impl PutSrc {
    /// Append `n` bytes from `off` to `buf`.
    fn append(&self, off: u64, n: usize, buf: &mut Vec<u8>) -> Result<(), AccessError> {
        match self {
            PutSrc::Host(raw) => raw.read_into(off, n, buf),
            PutSrc::Region(r) => r.read_to(off, n, buf),
        }
    }

    /// Copy `dst.len()` bytes from `off` straight into `dst`.
    fn copy_to(&self, off: u64, dst: RawBuf) -> Result<(), AccessError> {
        match self {
            PutSrc::Host(raw) => dst.copy_from(0, raw, off, dst.len()),
            PutSrc::Region(r) => r.read_raw(off, dst),
        }
    }
}

/// The bytes of a request or answer after its header: in hand, or where
/// they arrived (a fragment of `sm`, see [`Rma::handle_in_place`]).
#[derive(Clone, Copy)]
enum Payload<'a> {
    Slice(&'a [u8]),
    Raw(RawBuf),
}

impl Payload<'_> {
    fn len(&self) -> usize {
        match self {
            Payload::Slice(s) => s.len(),
            Payload::Raw(r) => r.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Write the bytes into `region` at `off`.
    fn write_into(&self, region: &RegionInner, off: u64) -> Result<(), AccessError> {
        match self {
            Payload::Slice(s) => region.write_at(off, s),
            Payload::Raw(r) => region.write_from(off, *r),
        }
    }

    /// The bytes as a little-endian word, if there are 8.
    fn word(&self) -> Option<u64> {
        let mut w = [0u8; 8];
        match self {
            Payload::Slice(s) => w.copy_from_slice(s.get(..8).filter(|_| s.len() == 8)?),
            Payload::Raw(r) => r.read(0, &mut w).ok().filter(|_| r.len() == 8)?,
        }
        Some(u64::from_le_bytes(w))
    }
}

struct Op {
    peer: Rank,
    /// When it was registered, in ms since [`Rma::epoch`].
    since: u64,
    /// `None` for an implicit operation (`put_nbi`/`get_nbi`): its outcome
    /// goes to the peer's next `flush`.
    done: Option<Arc<Completion>>,
    what: Pending,
}

/// Implicit puts to one peer (see [`Rma::put_implicit`]).
#[derive(Default)]
struct Implicit {
    /// Implicit puts submitted so far (counted after the submission).
    issued: AtomicU64,
    /// The most of them an answered flush request has covered.
    covered: AtomicU64,
}

/// Outstanding emulated operations of one fabric.
pub(crate) struct Rma {
    next: AtomicU64,
    ops: Mutex<HashMap<u64, Op>>,
    pub(crate) regions: Arc<RegionTable>,
    counters: Arc<Counters>,
    /// Where emulated put requests are built (pooled: a fresh buffer per
    /// large put faulted its pages in every time).
    buffers: Arc<BufPool>,
    /// One-sided operations a transport carries natively
    /// ([`crate::transport::Native::Posted`]), until `outstanding` sees
    /// them complete: their peer, their slot, and whether they are
    /// implicit (whose failure goes to the next flush).
    native: Mutex<Vec<(Rank, Arc<Completion>, bool)>>,
    /// `native`'s length after its last whole sweep (see `track`).
    native_swept: std::sync::atomic::AtomicUsize,
    /// Per peer rank: implicit puts sent and covered by a flush.
    implicit: Vec<Implicit>,
    /// Per peer rank: the implicit operations a transport carries
    /// natively and counts instead of giving each a slot in `native`.
    tallies: Vec<Arc<Tally>>,
    /// Initiator side: the first failure of an implicit operation to each
    /// peer, until a `flush` reports it.
    failed: Mutex<HashMap<Rank, Error>>,
    /// Target side: the first implicit put each peer had refused here
    /// since its last flush request (the answer to that request says so).
    refused: Mutex<HashMap<Rank, AccessError>>,
    /// Target side: the first failure of a put part other than the last,
    /// by sender and put id, for the last part's answer.
    part_failed: Mutex<HashMap<(Rank, u64), AccessError>>,
    /// Per peer rank: operations taken out of `ops` whose outcome is not
    /// applied yet (an answer's data being written, an error being
    /// recorded, a retry being registered): counted by `outstanding`, so a
    /// `flush` cannot see the table drained before they are done.
    settling: Vec<AtomicU64>,
    /// Where operations on a rank beyond `settling` are counted.
    settling_other: AtomicU64,
    /// Per peer rank: when it last answered an operation of ours, in ms
    /// since `epoch` (see [`Rma::expire`]).
    heard: Vec<AtomicU64>,
    epoch: std::time::Instant,
    /// Operations [`Rma::expire`] failed, whose late answers are dropped
    /// quietly (at most [`EXPIRED_KEPT`]; forgotten all at once beyond).
    expired: Mutex<std::collections::HashSet<u64>>,
}

/// See [`Rma::expired`].
const EXPIRED_KEPT: usize = 1 << 16;

/// Holds counts of [`Rma::settling`] while operations are settled.
struct Settling<'a>(&'a AtomicU64, u64);

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        // Release: what the settling wrote is seen by a flush that reads
        // the count at zero.
        self.0.fetch_sub(self.1, Ordering::Release);
    }
}

const REQ_HEADER: usize = 16 + 8;

/// Puts larger than this go as parts whose requests are this many bytes
/// (a buffer class of the pool), each copied into its request as it is
/// submitted (sent at once while the window has room) and written at the
/// target as soon as it arrives: the copies at both ends overlap the
/// transfer instead of adding to it.
const PUT_PART: usize = 256 * 1024;

/// A put part's header after `REQ_HEADER` (key, extent start): the
/// extent's length and the part's offset in it.
const PART_HEADER: usize = REQ_HEADER + 16;

/// Failures of put parts other than the last kept at most, waiting for
/// their last parts (see `Rma::part_done`).
const PART_FAILURES_KEPT: usize = 4096;

/// Implicit puts up to this many bytes are written into the request by
/// the transport ([`Link::submit_gathered_with`]), where it bundles them.
const IMPLICIT_INLINE_MAX: usize = 1024;

/// A request's header: the key id, then the offset (little-endian).
pub(crate) fn req_header(key: &KeyId, offset: u64) -> [u8; REQ_HEADER] {
    let mut h = [0u8; REQ_HEADER];
    h[..16].copy_from_slice(key);
    h[16..].copy_from_slice(&offset.to_le_bytes());
    h
}

fn encode_req(key: &KeyId, offset: u64, extra: usize) -> BytesMut {
    let mut b = BytesMut::with_capacity(REQ_HEADER + extra);
    b.put_slice(&req_header(key, offset));
    b
}

/// Read a request's header: the key id, the offset, and the rest.
pub(crate) fn decode_req(data: &[u8]) -> Option<(KeyId, u64, &[u8])> {
    if data.len() < REQ_HEADER {
        return None;
    }
    let key: KeyId = data[..16].try_into().ok()?;
    let off = u64::from_le_bytes(data[16..24].try_into().ok()?);
    Some((key, off, &data[24..]))
}

/// An answer's status: 0, or 1 and the postcard refusal; `extra` bytes of
/// room for what follows.
pub(crate) fn encode_status(r: &Result<(), AccessError>, extra: usize) -> BytesMut {
    let mut b = BytesMut::with_capacity(1 + extra);
    match r {
        Ok(()) => b.put_u8(0),
        Err(e) => {
            b.put_u8(1);
            b.put_slice(&postcard::to_allocvec(e).unwrap_or_default());
        }
    }
    b
}

/// Read an answer's status and what follows it (nothing follows a
/// refusal: bytes after the error make the answer malformed).
pub(crate) fn decode_status(data: &[u8]) -> Option<(Result<(), AccessError>, &[u8])> {
    match data.split_first()? {
        (0, rest) => Some((Ok(()), rest)),
        (1, rest) => match postcard::take_from_bytes(rest).ok()? {
            (e, []) => Some((Err(e), &[][..])),
            _ => None,
        },
        _ => None,
    }
}

/// A put part's request (`Kind::PutPart`), decoded: the key, where the
/// whole put's extent starts at the target and its length, this part's
/// offset in it, and its bytes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PutPart<'a> {
    pub(crate) key: KeyId,
    pub(crate) start: u64,
    pub(crate) len: u64,
    pub(crate) at: u64,
    pub(crate) payload: &'a [u8],
}

impl PutPart<'_> {
    /// Wire form (the header, then the bytes).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(PART_HEADER + self.payload.len());
        b.extend_from_slice(&req_header(&self.key, self.start));
        b.extend_from_slice(&self.len.to_le_bytes());
        b.extend_from_slice(&self.at.to_le_bytes());
        b.extend_from_slice(self.payload);
        b
    }

    /// Read a part: `None` when its header is short or its bytes run past
    /// the extent it names.
    pub(crate) fn decode(data: &[u8]) -> Option<PutPart<'_>> {
        let (key, start, rest) = decode_req(data)?;
        let word = |i: usize| Some(u64::from_le_bytes(rest.get(i..i + 8)?.try_into().ok()?));
        let (len, at) = (word(0)?, word(8)?);
        let payload = &rest[16..];
        at.checked_add(payload.len() as u64).filter(|e| *e <= len)?;
        Some(PutPart {
            key,
            start,
            len,
            at,
            payload,
        })
    }
}

impl Rma {
    pub(crate) fn new(
        regions: Arc<RegionTable>,
        counters: Arc<Counters>,
        buffers: Arc<BufPool>,
        size: u32,
    ) -> Self {
        Rma {
            // Id 0 is never registered: it marks an implicit put, which
            // gets no answer.
            next: AtomicU64::new(1),
            ops: Mutex::new(HashMap::new()),
            regions,
            counters,
            buffers,
            native: Mutex::new(Vec::new()),
            native_swept: std::sync::atomic::AtomicUsize::new(0),
            implicit: (0..size).map(|_| Implicit::default()).collect(),
            tallies: (0..size).map(|_| Tally::new()).collect(),
            failed: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
            part_failed: Mutex::new(HashMap::new()),
            settling: (0..size).map(|_| AtomicU64::new(0)).collect(),
            settling_other: AtomicU64::new(0),
            heard: (0..size).map(|_| AtomicU64::new(0)).collect(),
            epoch: std::time::Instant::now(),
            expired: Mutex::new(std::collections::HashSet::new()),
        }
    }

    fn register(&self, peer: Rank, what: Pending, done: Option<Arc<Completion>>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let since = self.now_ms();
        lock(&self.ops).insert(
            id,
            Op {
                peer,
                since,
                done,
                what,
            },
        );
        id
    }

    /// Hand an operation's outcome over: to its future, or (implicit) to
    /// the peer's next `flush` when it failed.
    fn settle(&self, peer: Rank, done: Option<Arc<Completion>>, r: Result<()>) {
        match (done, r) {
            (Some(c), r) => c.complete(r),
            (None, Ok(())) => {}
            (None, Err(e)) => {
                lock(&self.failed).entry(peer).or_insert(e);
            }
        }
    }

    /// Send a request (gathered with the rest of a burst where the
    /// transport does that: see [`Link::submit_gathered`]). A request that
    /// could not be sent fails its operation: through its future, or
    /// (implicit) as the error returned here.
    fn send(&self, link: &dyn Link, kind: Kind, id: u64, body: Result<Bytes>) -> Result<()> {
        let Err(e) = body.and_then(|b| link.submit_gathered(kind, id, b).map(drop)) else {
            return Ok(());
        };
        self.unsend(id, e)
    }

    /// Operation `id` could not be (wholly) sent: fail it with `e`, through
    /// its future, or (implicit, or unregistered) as the error returned.
    fn unsend(&self, id: u64, e: Error) -> Result<()> {
        // Nothing (of a CMA operation) reached the peer: nothing of ours
        // is exposed. (Parts of a put that did are written or refused
        // there; the put has failed either way.)
        match lock(&self.ops).remove(&id).and_then(|op| op.done) {
            Some(c) => {
                c.complete(Err(e));
                Ok(())
            }
            None => Err(e),
        }
    }

    /// Start an emulated put of `len` bytes of `src` (from `src_off`) into
    /// the peer's region `key` at `offset`.
    pub(crate) fn start_put(
        &self,
        link: &dyn Link,
        key: &KeyId,
        offset: u64,
        src: (PutSrc, u64, usize),
        done: Arc<Completion>,
    ) {
        // A failure to send completes `done` (see `send`).
        let _ = self.put_with(link, key, offset, src, Some(done));
    }

    /// Send a put request: the key and offset, then the data, copied once
    /// from `src` into a pooled buffer. The target answers it.
    fn put_with(
        &self,
        link: &dyn Link,
        key: &KeyId,
        offset: u64,
        src: (PutSrc, u64, usize),
        done: Option<Arc<Completion>>,
    ) -> Result<()> {
        let id = self.register(link.peer(), Pending::Put, done);
        self.send_put(link, key, offset, src, id)
    }

    /// Send the request(s) of a put with `id` (0: implicit): one request,
    /// or from [`PUT_PART`] bytes a part at a time (from what one message
    /// built in place holds, where the link builds them: see
    /// [`Link::fill_room`]). A part that cannot be sent fails the put (see
    /// `send`) and no more parts go.
    fn send_put(
        &self,
        link: &dyn Link,
        key: &KeyId,
        offset: u64,
        src: (PutSrc, u64, usize),
        id: u64,
    ) -> Result<()> {
        let (src, src_off, len) = src;
        let (single, part) = match link.fill_room() {
            room if room > PART_HEADER => (
                (room - REQ_HEADER).min(PUT_PART),
                (room - PART_HEADER).min(PUT_PART - PART_HEADER),
            ),
            _ => (PUT_PART, PUT_PART - PART_HEADER),
        };
        if len <= single {
            let head = req_header(key, offset);
            let r = self.send_in_place(link, Kind::PutReq, id, &head, &src, src_off, len);
            return match r {
                Ok(true) => Ok(()),
                Ok(false) => {
                    let body = self.put_request(key, offset, (&src, src_off, len));
                    self.send(link, Kind::PutReq, id, body)
                }
                Err(e) => self.unsend(id, e),
            };
        }
        let mut at = 0;
        while at < len {
            let n = part.min(len - at);
            let mut head = [0u8; PART_HEADER];
            head[..REQ_HEADER].copy_from_slice(&req_header(key, offset));
            head[REQ_HEADER..REQ_HEADER + 8].copy_from_slice(&(len as u64).to_le_bytes());
            head[REQ_HEADER + 8..].copy_from_slice(&(at as u64).to_le_bytes());
            let from = src_off + at as u64;
            let r = match self.send_in_place(link, Kind::PutPart, id, &head, &src, from, n) {
                Ok(true) => Ok(()),
                Ok(false) => {
                    let mut req = self.buffers.take(PART_HEADER + n);
                    req.extend_from_slice(&head);
                    src.append(from, n, &mut req)
                        .map_err(Error::from)
                        .and_then(|()| {
                            link.submit_gathered(Kind::PutPart, id, self.buffers.freeze(req))
                        })
                        .map(drop)
                }
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                return self.unsend(id, e);
            }
            at += n;
        }
        Ok(())
    }

    /// Send a request of `head` and `n` bytes of `src` from `from` as one
    /// message the link builds in place, the bytes read straight into it,
    /// if it can now (see [`Link::try_send_filled`]).
    #[allow(clippy::too_many_arguments)]
    fn send_in_place(
        &self,
        link: &dyn Link,
        kind: Kind,
        id: u64,
        head: &[u8],
        src: &PutSrc,
        from: u64,
        n: usize,
    ) -> Result<bool> {
        if head.len() + n > link.fill_room() {
            return Ok(false);
        }
        let sent = link.try_send_filled(kind, id, head, n, &mut |dst| {
            src.copy_to(from, dst).map_err(Error::from)
        })?;
        if sent {
            Counters::bump(&self.counters.emulated_sent_in_place);
        }
        Ok(sent)
    }

    fn put_request(&self, key: &KeyId, offset: u64, src: (&PutSrc, u64, usize)) -> Result<Bytes> {
        let (src, src_off, len) = src;
        let mut req = self.buffers.take(REQ_HEADER + len);
        req.extend_from_slice(&req_header(key, offset));
        src.append(src_off, len, &mut req)
            .map(|()| self.buffers.freeze(req))
            .map_err(Error::from)
    }

    /// An implicit put (`put_nbi`): the request carries id 0 and gets no
    /// answer; the peer's next flush request covers it (the target then
    /// reports the first implicit put it refused). Nothing is registered,
    /// so nothing waits per put.
    pub(crate) fn put_implicit(
        &self,
        link: &dyn Link,
        key: &KeyId,
        offset: u64,
        src: (PutSrc, u64, usize),
    ) -> Result<()> {
        match src {
            (PutSrc::Host(raw), src_off, len) if len <= IMPLICIT_INLINE_MAX => {
                // Written straight into the transport's open bundle, if any.
                let head = req_header(key, offset);
                link.submit_gathered_with(Kind::PutReq, 0, REQ_HEADER + len, &mut |buf| {
                    buf.extend_from_slice(&head);
                    raw.read_into(src_off, len, buf).map_err(Error::from)
                })?;
            }
            src => self.send_put(link, key, offset, src, 0)?,
        }
        // Counted after the submission: a flush that reads the count sends
        // its request after this put's (one ordered stream per peer).
        if let Some(i) = self.implicit.get(link.peer() as usize) {
            i.issued.fetch_add(1, Ordering::Release);
        }
        Ok(())
    }

    /// Start an emulated atomic on the word at `offset` of the peer's
    /// region `key`: the target applies it with a hardware atomic (so it is
    /// atomic with the native atomics of peers that map the region) and
    /// answers the previous value, which completes `done` by
    /// [`Completion::complete_value`].
    pub(crate) fn start_atomic(
        &self,
        link: &dyn Link,
        key: &KeyId,
        offset: u64,
        op: AtomicOp,
        done: Arc<Completion>,
    ) {
        let id = self.register(link.peer(), Pending::Atomic, Some(done));
        let mut req = encode_req(key, offset, 17);
        req.put_slice(&op.encode());
        // A failure to send completes `done` (see `send`).
        let _ = self.send(link, Kind::AtomicReq, id, Ok(req.freeze()));
    }

    /// A non-fetching atomic with no answer of its own
    /// (`atomic_add_nbi`): id 0, covered by the peer's next flush request
    /// like an implicit put.
    pub(crate) fn atomic_implicit(
        &self,
        link: &dyn Link,
        key: &KeyId,
        offset: u64,
        op: AtomicOp,
    ) -> Result<()> {
        let head = req_header(key, offset);
        link.submit_gathered_with(Kind::AtomicReq, 0, REQ_HEADER + 17, &mut |buf| {
            buf.extend_from_slice(&head);
            buf.extend_from_slice(&op.encode());
            Ok(())
        })?;
        // Counted after the submission, as in `put_implicit`.
        if let Some(i) = self.implicit.get(link.peer() as usize) {
            i.issued.fetch_add(1, Ordering::Release);
        }
        Ok(())
    }

    /// Ask the peer to confirm the implicit puts sent to it so far, unless
    /// an answered request covers them already. The request is registered:
    /// `flush` waits for its answer like for any pending operation. A
    /// request that cannot be sent (peer lost, fabric closed) is the
    /// flush's error: those puts are unconfirmed.
    pub(crate) fn flush_request(&self, link: &dyn Link) -> Result<()> {
        let Some(i) = self.implicit.get(link.peer() as usize) else {
            return Ok(());
        };
        let upto = i.issued.load(Ordering::Acquire);
        if upto <= i.covered.load(Ordering::Acquire) {
            return Ok(());
        }
        let id = self.register(link.peer(), Pending::Flush { upto }, None);
        self.send(link, Kind::FlushReq, id, Ok(Bytes::new()))
    }

    /// The first failure of an implicit operation to `peer` not yet
    /// reported (taken: one flush reports it).
    pub(crate) fn take_failure(&self, peer: Rank) -> Option<Error> {
        let counted = self.tally(peer).and_then(|t| t.take_failure());
        lock(&self.failed).remove(&peer).or(counted)
    }

    /// The tally of `peer`'s natively carried implicit operations (`None`
    /// for a rank outside the job: such operations take a slot each).
    pub(crate) fn tally(&self, peer: Rank) -> Option<&Arc<Tally>> {
        self.tallies.get(peer as usize)
    }

    /// Counted implicit operations on `peer` still running.
    fn counted_running(&self, peer: Rank) -> u64 {
        self.tally(peer).map_or(0, |t| t.running())
    }

    /// Start an emulated get of `len` bytes from the peer's region into `dst`.
    pub(crate) fn start_get(
        &self,
        link: &dyn Link,
        key: &KeyId,
        offset: u64,
        (dst, dst_offset, len): (Arc<RegionInner>, u64, usize),
        done: Option<Arc<Completion>>,
    ) -> Result<()> {
        // Above PUT_PART, parts whose answers (a status byte, then the
        // data) fill one buffer class each, or where the link builds
        // messages in place, one such message each (`Link::fill_room`);
        // answered in order, so when the last part's answer lands every
        // part's data is in `dst`.
        let part = match link.fill_room() {
            room if room > 1 && len < room.min(PUT_PART) => len,
            room if room > 1 => room.min(PUT_PART) - 1,
            _ if len <= PUT_PART => len,
            _ => PUT_PART - 1,
        };
        let failed = (part < len).then(|| Arc::new(Mutex::new(None)));
        let mut at = 0;
        loop {
            let n = part.min(len - at);
            let last = at + n == len;
            let pending = Pending::Get {
                dst: dst.clone(),
                // (Saturating: ranges past the end are refused, by the
                // target or by the write of the answer, not wrapped.)
                offset: dst_offset.saturating_add(at as u64),
                len: n,
                quiet: !last,
                whole: (last && at > 0).then(|| (offset, offset.saturating_add(len as u64))),
                failed: failed.clone(),
            };
            let id = self.register(link.peer(), pending, done.clone().filter(|_| last));
            let mut req = encode_req(key, offset.saturating_add(at as u64), 8);
            req.put_u64_le(n as u64);
            if let Err(e) = self.send(link, Kind::GetReq, id, Ok(req.freeze())) {
                // A part that could not be sent fails the get: through its
                // future, or (implicit) as the error returned.
                return match done.filter(|_| !last) {
                    Some(c) => {
                        c.complete(Err(e));
                        Ok(())
                    }
                    None => Err(e),
                };
            }
            at += n;
            if last {
                return Ok(());
            }
        }
    }

    /// Follow a one-sided operation a transport posted natively, so that
    /// `flush` waits for it; an `implicit` one's failure goes to the next
    /// flush.
    pub(crate) fn track(&self, peer: Rank, done: Arc<Completion>, implicit: bool) {
        let mut native = lock(&self.native);
        // Finished entries leave at the next flush to their peer; a program
        // that never flushes must not grow the list: sweep every peer's
        // when it has doubled since the last sweep.
        if native.len() >= self.native_swept.load(Ordering::Relaxed).max(64) * 2 {
            self.sweep(&mut native, None, false);
            self.native_swept.store(native.len(), Ordering::Relaxed);
        }
        native.push((peer, done, implicit));
    }

    /// Drop the finished operations of `peer` (of every peer: `None`) from
    /// `native`, keeping an implicit one's failure for the next flush;
    /// returns how many of `peer`'s still run.
    /// With `first`, it stops at the first of them still running (the
    /// rest are kept as they are) and returns at most 1.
    fn sweep(
        &self,
        native: &mut Vec<(Rank, Arc<Completion>, bool)>,
        peer: Option<Rank>,
        first: bool,
    ) -> usize {
        if first {
            // Only up to the first of `peer`'s still running: the entries
            // kept before it close up over the finished ones, and the rest
            // is not walked (a flush polls while a window completes, about
            // in order).
            let mut kept = 0;
            let mut at = 0;
            let mut running = 0;
            while let Some((p, c, implicit)) = native.get(at) {
                if peer.is_some_and(|peer| *p != peer) {
                    native.swap(kept, at);
                    kept += 1;
                } else if !self.finished(*p, c, *implicit) {
                    running = 1;
                    break;
                }
                at += 1;
            }
            native.drain(kept..at);
            return running;
        }
        let mut running = 0;
        native.retain(|(p, c, implicit)| {
            if peer.is_some_and(|peer| *p != peer) {
                return true;
            }
            if self.finished(*p, c, *implicit) {
                return false;
            }
            running += 1;
            true
        });
        running
    }

    /// Whether `peer`'s natively posted operation `c` finished (an
    /// implicit one's failure is kept for the next flush).
    fn finished(&self, peer: Rank, c: &Completion, implicit: bool) -> bool {
        if !implicit {
            return c.is_done();
        }
        match c.take_done() {
            None => false,
            Some(Ok(())) => true,
            Some(Err(e)) => {
                lock(&self.failed).entry(peer).or_insert(e);
                true
            }
        }
    }

    /// Have `cx`'s task woken when the oldest implicit operation still
    /// running that a transport posted natively to `peer` finishes, and
    /// when the last of those it counts does (a flush waiting without
    /// spinning), if there is one. The caller looks again after this call.
    pub(crate) fn wake_on_native(&self, peer: Rank, cx: &mut std::task::Context<'_>) {
        if let Some(t) = self.tally(peer).filter(|t| t.running() > 0) {
            t.wake_when_idle(cx);
        }
        let native = lock(&self.native);
        if let Some((_, c, _)) = native
            .iter()
            .find(|(p, c, implicit)| *p == peer && *implicit && !c.is_done())
        {
            c.wake_when_done(cx);
        }
    }

    /// Natively posted operations on `peer` still running; the finished
    /// ones are dropped from the list (an implicit one's failure kept for
    /// the next flush).
    fn native_running(&self, peer: Rank) -> usize {
        self.sweep(&mut lock(&self.native), Some(peer), false)
    }

    /// Whether nothing waits on `peer` (`outstanding(peer) == 0`), without
    /// counting: the natively posted operations are looked at from the
    /// oldest only up to the first one still running. They finish in
    /// about the order they were posted, so a flush that polls while a
    /// window of them completes looks at each about once, not at the
    /// whole window at every poll (a lock per operation each time, which
    /// took a tenth of the initiator's time in a stream of 16 KiB gets).
    pub(crate) fn idle(&self, peer: Rank) -> bool {
        if self.counted_running(peer) > 0 {
            return false;
        }
        if self.sweep(&mut lock(&self.native), Some(peer), true) > 0 {
            return false;
        }
        let ops = lock(&self.ops);
        // Acquire: pairs with `Settling`'s release.
        self.settling_of(peer).load(Ordering::Acquire) == 0 && !ops.values().any(|o| o.peer == peer)
    }

    /// Number of operations still waiting on `peer` (or being settled).
    pub(crate) fn outstanding(&self, peer: Rank) -> usize {
        let native = self.native_running(peer);
        let ops = lock(&self.ops);
        // Acquire: pairs with `Settling`'s release.
        let settling = self.settling_of(peer).load(Ordering::Acquire) as usize;
        let counted = self.counted_running(peer) as usize;
        ops.values().filter(|o| o.peer == peer).count() + settling + native + counted
    }

    fn settling_of(&self, peer: Rank) -> &AtomicU64 {
        self.settling
            .get(peer as usize)
            .unwrap_or(&self.settling_other)
    }

    /// Count `n` operations on `peer` as settling (call under the `ops`
    /// lock, as they are taken out of the table).
    fn settling(&self, peer: Rank, n: u64) -> Settling<'_> {
        let c = self.settling_of(peer);
        c.fetch_add(n, Ordering::Relaxed);
        Settling(c, n)
    }

    /// Take the operations `pred` picks out of the table, each counted as
    /// settling on its peer until its guard goes.
    fn take_ops(&self, pred: impl Fn(&Op) -> bool) -> Vec<(Op, Settling<'_>)> {
        let mut ops = lock(&self.ops);
        let ids: Vec<u64> = ops
            .iter()
            .filter(|(_, o)| pred(o))
            .map(|(k, _)| *k)
            .collect();
        ids.into_iter()
            .filter_map(|k| ops.remove(&k))
            .map(|op| {
                let s = self.settling(op.peer, 1);
                (op, s)
            })
            .collect()
    }

    /// Fail `ops` with `err` (a part of a get other than its last
    /// excepted: the last reports for the whole get).
    fn fail(&self, ops: Vec<(Op, Settling<'_>)>, err: impl Fn() -> Error) {
        for (op, _settling) in ops {
            if matches!(op.what, Pending::Get { quiet: true, .. }) {
                continue;
            }
            // Implicit operations: the peer's next `flush` reports it.
            self.settle(op.peer, op.done, Err(err()));
        }
    }

    /// Fail everything pending on a lost peer.
    pub(crate) fn peer_lost(&self, peer: Rank, reason: &str) {
        lock(&self.refused).remove(&peer);
        lock(&self.part_failed).retain(|(p, _), _| *p != peer);
        let ops = self.take_ops(|o| o.peer == peer);
        let err = || Error::PeerLost {
            rank: peer,
            reason: reason.to_string(),
        };
        self.fail(ops, err);
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether any emulated operation waits for an answer.
    pub(crate) fn any_pending(&self) -> bool {
        !lock(&self.ops).is_empty()
    }

    /// Count `peer` as heard from now: its link still carries what we
    /// queued for it, so an answer may be on its way behind that.
    pub(crate) fn heard_now(&self, peer: Rank) {
        if let Some(h) = self.heard.get(peer as usize) {
            h.store(self.now_ms(), Ordering::Relaxed);
        }
    }

    /// Fail with [`Error::Timeout`] every operation waiting on a peer that
    /// has had one waiting for longer than `after` and answered none for
    /// that long (an answer that never comes, whatever the transport
    /// thinks of the peer). Called on the heartbeat, after peers whose
    /// links still hold queued data were counted as heard
    /// ([`heard_now`](Self::heard_now)). Returns how many failed.
    pub(crate) fn expire(&self, after: std::time::Duration) -> usize {
        let now = self.now_ms();
        let limit = (after.as_millis() as u64).max(1);
        let silent = |p: Rank| {
            let heard = self
                .heard
                .get(p as usize)
                .map_or(0, |h| h.load(Ordering::Relaxed));
            now.saturating_sub(heard) > limit
        };
        // Chosen and taken under one hold of the table, so that nothing
        // registered or answered meanwhile is failed with them.
        let (taken, peers) = {
            let mut ops = lock(&self.ops);
            let mut peers: Vec<Rank> = ops
                .values()
                .filter(|o| now.saturating_sub(o.since) > limit && silent(o.peer))
                .map(|o| o.peer)
                .collect();
            if peers.is_empty() {
                return 0;
            }
            peers.sort_unstable();
            peers.dedup();
            let ids: Vec<u64> = ops
                .iter()
                .filter(|(_, o)| peers.binary_search(&o.peer).is_ok())
                .map(|(k, _)| *k)
                .collect();
            let mut expired = lock(&self.expired);
            if expired.len() + ids.len() > EXPIRED_KEPT {
                expired.clear();
            }
            let taken: Vec<(Op, Settling<'_>)> = ids
                .into_iter()
                .filter_map(|k| {
                    expired.insert(k);
                    ops.remove(&k)
                })
                .map(|op| {
                    let s = self.settling(op.peer, 1);
                    (op, s)
                })
                .collect();
            (taken, peers)
        };
        let n = taken.len();
        for peer in peers {
            tracing::warn!(
                "rank {peer} answered none of our emulated one-sided operations for {after:?}: failing those waiting on it"
            );
        }
        for (op, _settling) in taken {
            let peer = op.peer;
            if matches!(op.what, Pending::Get { quiet: true, .. }) {
                // A part of a get whose last part reports it.
                continue;
            }
            self.settle(
                peer,
                op.done,
                Err(Error::Timeout {
                    what: format!(
                        "an answer from rank {peer} to an emulated put, get, atomic or flush"
                    ),
                    after,
                }),
            );
        }
        n
    }

    /// Fail everything pending (the fabric is closing).
    pub(crate) fn close(&self) {
        let ops = self.take_ops(|_| true);
        self.fail(ops, || Error::Closed);
    }

    /// Handle an RMA message from `src` (request or answer). Requests are
    /// answered through `link`.
    pub(crate) fn handle(&self, link: &dyn Link, src: Rank, kind: Kind, id: u64, data: Bytes) {
        match kind {
            Kind::PutReq => {
                let Some((key, off, payload)) = decode_req(&data) else {
                    return self.malformed_put(src, id, "short put request");
                };
                let r = self
                    .target(&key, off, payload.len())
                    .and_then(|reg| reg.write_at(off, payload));
                self.put_done(link, src, id, r);
            }
            Kind::PutPart => {
                let Some((r, first, last)) = self.put_part(&data) else {
                    return self.malformed_put(src, id, "malformed put part");
                };
                self.part_done(link, src, id, r, first, last);
            }
            Kind::FlushReq => {
                // Every implicit put the peer sent before this request was
                // handled above (one ordered stream per peer).
                let r = lock(&self.refused).remove(&src).map_or(Ok(()), Err);
                self.answer(link, Kind::FlushAck, id, encode_status(&r, 0));
            }
            Kind::GetReq => {
                let (key, off, rest) = match decode_req(&data) {
                    Some(x) if x.2.len() == 8 => x,
                    _ => return self.bad(src, "malformed get request"),
                };
                let len = u64::from_le_bytes(rest.try_into().unwrap_or_default());
                let r = usize::try_from(len)
                    .map_err(|_| AccessError::OutOfBounds {
                        offset: off,
                        end: u64::MAX,
                        len: 0,
                    })
                    .and_then(|len| self.target(&key, off, len).map(|reg| (reg, len)));
                let resp = match r {
                    Ok((reg, len)) => {
                        // Read straight into the answer where the link
                        // builds it in place.
                        let from = PutSrc::Region(reg.clone());
                        match self.send_in_place(link, Kind::GetResp, id, &[0], &from, off, len) {
                            Ok(true) => return,
                            Ok(false) => {}
                            Err(Error::Access(e)) => {
                                return self.answer(
                                    link,
                                    Kind::GetResp,
                                    id,
                                    encode_status(&Err(e), 0),
                                )
                            }
                            // The link failed: nothing can answer.
                            Err(_) => return,
                        }
                        // A pooled buffer: a fresh one per large answer
                        // faulted its pages in every time.
                        let mut b = self.buffers.take(1 + len);
                        b.push(0);
                        match reg.read_to(off, len, &mut b) {
                            Ok(()) => self.buffers.freeze(b),
                            Err(e) => encode_status(&Err(e), 0).freeze(),
                        }
                    }
                    Err(e) => encode_status(&Err(e), 0).freeze(),
                };
                self.answer(link, Kind::GetResp, id, resp);
            }
            Kind::AtomicReq => {
                let Some((key, off, op)) = decode_req(&data)
                    .and_then(|(k, o, rest)| Some((k, o, AtomicOp::decode(rest)?)))
                else {
                    return self.malformed_put(src, id, "malformed atomic request");
                };
                let r = self.target(&key, off, 8).and_then(|reg| match reg.device {
                    Some(_) => Err(AccessError::NotPermitted(
                        "atomics on device memory are not supported".into(),
                    )),
                    None => reg.raw().atomic(off, op),
                });
                if matches!(
                    r,
                    Err(AccessError::Misaligned { .. } | AccessError::NotPermitted(_))
                ) {
                    Counters::bump(&self.counters.access_refused);
                }
                if id == 0 {
                    // Implicit: a refusal waits for the next flush request.
                    if let Err(e) = r {
                        lock(&self.refused).entry(src).or_insert(e);
                    }
                    return;
                }
                let body = match r {
                    Ok(old) => {
                        let mut b = encode_status(&Ok(()), 8);
                        b.put_u64_le(old);
                        b
                    }
                    Err(e) => encode_status(&Err(e), 0),
                };
                self.answer(link, Kind::AtomicResp, id, body);
            }
            Kind::PutAck | Kind::GetResp | Kind::FlushAck | Kind::AtomicResp => {
                self.finish(src, kind, id, &data)
            }
            _ => {}
        }
    }

    /// [`handle`](Self::handle) for a message whose bytes stay where they
    /// arrived (`body`: a fragment of `sm`): a put's request or part, or a
    /// get's answer, is written into its region from there, with no copy
    /// first (device memory through the device). Anything else, and one
    /// too short for its header, is copied out and handled as usual.
    pub(crate) fn handle_in_place(
        &self,
        link: &dyn Link,
        src: Rank,
        kind: Kind,
        id: u64,
        body: RawBuf,
    ) {
        let head_len = match kind {
            Kind::PutReq => REQ_HEADER,
            Kind::PutPart => PART_HEADER,
            Kind::GetResp => 1,
            _ => usize::MAX,
        };
        let mut head = [0u8; PART_HEADER];
        let split = (body.len() >= head_len)
            .then(|| {
                body.read(0, &mut head[..head_len]).ok()?;
                body.slice(head_len as u64, body.len() - head_len).ok()
            })
            .flatten();
        let Some(rest) = split.filter(|_| kind != Kind::GetResp || head[0] == 0) else {
            // As it came (a refusal, too, is a few bytes).
            let mut data = Vec::with_capacity(body.len());
            if body.read_into(0, body.len(), &mut data).is_ok() {
                self.handle(link, src, kind, id, Bytes::from(data));
            }
            return;
        };
        let n = rest.len();
        let landed = |r: &Result<(), AccessError>| {
            if r.is_ok() {
                Counters::bump(&self.counters.emulated_landed_in_place);
            }
        };
        match kind {
            Kind::PutReq => {
                let Some((key, off, _)) = decode_req(&head[..REQ_HEADER]) else {
                    return self.malformed_put(src, id, "short put request");
                };
                let r = self
                    .target(&key, off, n)
                    .and_then(|reg| reg.write_from(off, rest));
                landed(&r);
                self.put_done(link, src, id, r);
            }
            Kind::PutPart => {
                let Some((r, first, last)) = self.put_part_with(&head, Payload::Raw(rest)) else {
                    return self.malformed_put(src, id, "malformed put part");
                };
                landed(&r);
                self.part_done(link, src, id, r, first, last);
            }
            _ => self.finish_with(src, kind, id, Some((Ok(()), Payload::Raw(rest)))),
        }
    }

    /// A put part was written or refused (see `handle`).
    fn part_done(
        &self,
        link: &dyn Link,
        src: Rank,
        id: u64,
        r: Result<(), AccessError>,
        first: bool,
        last: bool,
    ) {
        // The whole put is checked for every part: a refused put writes
        // nothing, is counted at its first part, and is answered (or
        // recorded) at its last. A part that failed otherwise (a device
        // copy) is remembered for the last to answer: an implicit put's
        // failure goes straight to the peer's next flush, whose request
        // comes after all its parts.
        if first && r.is_err() {
            Counters::bump(&self.counters.access_refused);
        }
        if !last {
            if let Err(e) = r {
                if id == 0 {
                    lock(&self.refused).entry(src).or_insert(e);
                } else {
                    let mut f = lock(&self.part_failed);
                    if f.len() >= PART_FAILURES_KEPT {
                        // Only a peer that never sends its puts' last
                        // parts gets here: forget, do not grow.
                        f.clear();
                    }
                    f.entry((src, id)).or_insert(e);
                }
            }
            return;
        }
        let first_failure = (id != 0)
            .then(|| lock(&self.part_failed).remove(&(src, id)))
            .flatten();
        let r = match (r, first_failure) {
            (Ok(()), Some(e)) => Err(e),
            (r, _) => r,
        };
        self.put_done(link, src, id, r);
    }

    /// A put was written or refused: answer it, or (implicit: no answer)
    /// keep the first refusal for the peer's next flush request.
    fn put_done(&self, link: &dyn Link, src: Rank, id: u64, r: Result<(), AccessError>) {
        match (id, r) {
            (0, Ok(())) => {}
            (0, Err(e)) => {
                lock(&self.refused).entry(src).or_insert(e);
            }
            (_, r) => self.answer(link, Kind::PutAck, id, encode_status(&r, 0)),
        }
    }

    /// A put or atomic request that does not decode: dropped and counted,
    /// and an implicit one is a refusal the next flush reports (it was not
    /// done).
    fn malformed_put(&self, src: Rank, id: u64, what: &str) {
        if id == 0 {
            let e = AccessError::NotPermitted("a request it could not decode".into());
            lock(&self.refused).entry(src).or_insert(e);
        }
        self.bad(src, what);
    }

    /// Check and write one part of a put (`Kind::PutPart`): `None` when
    /// malformed, else the outcome and whether it was the first and the
    /// last part.
    fn put_part(&self, data: &[u8]) -> Option<(Result<(), AccessError>, bool, bool)> {
        let head = data.get(..PART_HEADER)?;
        self.put_part_with(head, Payload::Slice(&data[PART_HEADER..]))
    }

    /// [`put_part`](Self::put_part) of a part whose header is `head` and
    /// whose bytes are `payload`.
    fn put_part_with(
        &self,
        head: &[u8],
        payload: Payload<'_>,
    ) -> Option<(Result<(), AccessError>, bool, bool)> {
        let PutPart {
            key,
            start,
            len,
            at,
            ..
        } = PutPart::decode(head)?;
        let end = at.checked_add(payload.len() as u64).filter(|e| *e <= len)?;
        let r = usize::try_from(len)
            .map_err(|_| AccessError::OutOfBounds {
                offset: start,
                end: u64::MAX,
                len: 0,
            })
            .and_then(|len| self.check_target(&key, start, len))
            .and_then(|reg| payload.write_into(&reg, start + at));
        Some((r, at == 0, end == len))
    }

    /// The live region behind `key` if `off..off+len` is inside it; a
    /// refusal is counted.
    pub(crate) fn target(
        &self,
        key: &KeyId,
        off: u64,
        len: usize,
    ) -> Result<Arc<RegionInner>, AccessError> {
        let r = self.check_target(key, off, len);
        if r.is_err() {
            Counters::bump(&self.counters.access_refused);
        }
        r
    }

    /// [`target`](Self::target) without counting a refusal.
    fn check_target(
        &self,
        key: &KeyId,
        off: u64,
        len: usize,
    ) -> Result<Arc<RegionInner>, AccessError> {
        self.regions
            .get(key)
            .ok_or(AccessError::UnknownKey)
            .and_then(|reg| {
                let n = reg.len() as u64;
                match off.checked_add(len as u64) {
                    Some(end) if end <= n => Ok(reg),
                    _ => Err(AccessError::OutOfBounds {
                        offset: off,
                        end: off.saturating_add(len as u64),
                        len: n,
                    }),
                }
            })
    }

    /// Answer a request. Gathered (see [`Link::submit_gathered`]): the
    /// requests of a burst arrive together, and their answers leave
    /// together after the progress call that read them.
    fn answer(&self, link: &dyn Link, kind: Kind, id: u64, body: impl Into<Bytes>) {
        if let Err(e) = link.submit_gathered(kind, id, body.into()) {
            tracing::debug!(peer = link.peer(), "could not answer RMA request: {e}");
        }
    }

    fn bad(&self, src: Rank, what: &str) {
        Counters::bump(&self.counters.bad_frames);
        tracing::warn!(peer = src, "dropped bad RMA message: {what}");
    }

    fn finish(&self, src: Rank, kind: Kind, id: u64, data: &[u8]) {
        let answer = decode_status(data).map(|(s, p)| (s, Payload::Slice(p)));
        self.finish_with(src, kind, id, answer)
    }

    /// [`finish`](Self::finish) of an answer read as its status and what
    /// follows (`None`: malformed).
    fn finish_with(
        &self,
        src: Rank,
        kind: Kind,
        id: u64,
        answer: Option<(Result<(), AccessError>, Payload<'_>)>,
    ) {
        let (op, _settling) = {
            let mut ops = lock(&self.ops);
            match ops.get(&id) {
                Some(op) if op.peer == src => (ops.remove(&id), self.settling(src, 1)),
                // The late answer of an operation that timed out.
                _ if lock(&self.expired).remove(&id) => return,
                _ => return self.bad(src, "answer to an unknown operation"),
            }
        };
        // An answer to one of ours: the peer is answering.
        self.heard_now(src);
        let Some(op) = op else {
            return self.bad(src, "answer to an unknown operation");
        };
        // A part of a get of several: what failed in a part before the
        // last goes to the last, which reports for the whole get.
        let (quiet, failed) = match &op.what {
            Pending::Get { quiet, failed, .. } => (*quiet, failed.clone()),
            _ => (false, None),
        };
        let keep = |e: Error| {
            if let Some(f) = &failed {
                lock(f).get_or_insert(e);
            }
        };
        let Some((status, payload)) = answer else {
            let e = Error::PeerMisbehaved {
                rank: src,
                what: "malformed RMA answer".into(),
            };
            if quiet {
                keep(e);
            } else {
                self.settle(src, op.done, Err(e));
            }
            return self.bad(src, "malformed RMA answer");
        };
        if quiet && status.is_err() {
            // The last part is refused for the range too (and reports
            // the whole get's); any other refusal it must be told of.
            if let Err(e) = status {
                if !matches!(e, AccessError::OutOfBounds { .. }) {
                    keep(Error::Access(e));
                }
            }
            return;
        }
        let in_place = matches!(payload, Payload::Raw(_));
        let r = match (status, op.what, kind) {
            (r, Pending::Flush { upto }, Kind::FlushAck) if payload.is_empty() => {
                if let Some(i) = self.implicit.get(src as usize) {
                    i.covered.fetch_max(upto, Ordering::AcqRel);
                }
                r.map_err(Error::Access)
            }
            (_, Pending::Flush { .. }, _) | (_, _, Kind::FlushAck) => Err(Error::PeerMisbehaved {
                rank: src,
                what: "RMA answer does not match the request".into(),
            }),
            (
                Err(AccessError::OutOfBounds { len, .. }),
                Pending::Get {
                    whole: Some((offset, end)),
                    ..
                },
                _,
            ) => Err(Error::Access(AccessError::OutOfBounds { offset, end, len })),
            (Err(e), _, _) => Err(Error::Access(e)),
            (Ok(()), Pending::Atomic, Kind::AtomicResp) if payload.len() == 8 => {
                if let (Some(c), Some(old)) = (op.done, payload.word()) {
                    c.complete_value(old);
                }
                return;
            }
            (Ok(()), Pending::Put, Kind::PutAck) => Ok(()),
            (
                Ok(()),
                Pending::Get {
                    dst, offset, len, ..
                },
                Kind::GetResp,
            ) if payload.len() == len => {
                let r = payload.write_into(&dst, offset).map_err(Error::from);
                if in_place && r.is_ok() {
                    Counters::bump(&self.counters.emulated_landed_in_place);
                }
                r
            }
            _ => Err(Error::PeerMisbehaved {
                rank: src,
                what: "RMA answer does not match the request".into(),
            }),
        };
        if quiet {
            if let Err(e) = r {
                keep(e);
            }
            return;
        }
        let r = match (r, &failed) {
            (Ok(()), Some(f)) => lock(f).take().map_or(Ok(()), Err),
            (r, _) => r,
        };
        self.settle(src, op.done, r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::mem::HeapBuf;
    use std::sync::atomic::AtomicBool;

    /// A link that records what is submitted (a mock of a transport: the
    /// test carries the messages across by hand, in order).
    struct Wire {
        peer: Rank,
        sent: Mutex<Vec<(Kind, u64, Bytes)>>,
        down: AtomicBool,
    }

    impl Wire {
        fn new(peer: Rank) -> Wire {
            Wire {
                peer,
                sent: Mutex::new(Vec::new()),
                down: AtomicBool::new(false),
            }
        }
        fn take(&self) -> Vec<(Kind, u64, Bytes)> {
            std::mem::take(&mut *lock(&self.sent))
        }
    }

    #[async_trait::async_trait]
    impl Link for Wire {
        fn peer(&self) -> Rank {
            self.peer
        }
        fn transport(&self) -> &'static str {
            "wire"
        }
        fn try_send(&self, kind: Kind, tag: u64, data: &[u8]) -> Result<bool> {
            self.submit(kind, tag, Bytes::copy_from_slice(data))
                .map(|_| true)
        }
        fn submit(&self, kind: Kind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>> {
            if self.down.load(Ordering::Relaxed) {
                return Err(Error::PeerLost {
                    rank: self.peer,
                    reason: "test".into(),
                });
            }
            lock(&self.sent).push((kind, tag, data));
            Ok(None)
        }
        fn has_queued(&self) -> bool {
            false
        }
    }

    /// Natively posted operations that finished leave the list even when
    /// the program never flushes; an implicit one's failure is kept for
    /// the next flush.
    #[test]
    fn posted_operations_do_not_pile_up_without_a_flush() {
        let (r, _) = rma(2);
        for i in 0..10_000u32 {
            let c = Completion::new();
            r.track(1, c.clone(), false);
            c.complete(Ok(()));
            assert!(
                lock(&r.native).len() <= 200,
                "{} entries after {i}",
                lock(&r.native).len()
            );
        }
        let failed = Completion::new();
        r.track(1, failed.clone(), true);
        failed.complete(Err(Error::Closed));
        for _ in 0..500 {
            let c = Completion::new();
            r.track(1, c.clone(), false);
            c.complete(Ok(()));
        }
        assert_eq!(r.outstanding(1), 0);
        assert!(matches!(r.take_failure(1), Some(Error::Closed)));
    }

    /// Puts and gets give the same bytes and outcomes whether their
    /// requests and answers are built in place and handed over where they
    /// lie (as over `sm`: parts the size of a message built in place,
    /// here 100 bytes) or as owned bytes; one out of range is refused
    /// either way, its region untouched.
    #[test]
    #[cfg(not(btl_loom))]
    fn puts_and_gets_in_place_match_those_in_owned_bytes() {
        use crate::fuzz_support::{Outcome, RmaPair};
        let data: Vec<u8> = (0..250u32).map(|i| (i * 7 + 1) as u8).collect();
        for in_place in [false, true] {
            let mut p = RmaPair::new(256, 256);
            p.set_in_place(in_place);
            let ops = [p.put(3, &data), p.put(250, &data[..10])];
            // In place: in parts of one 100-byte message each.
            let parts = p.pending_ids().len();
            assert_eq!(parts, if in_place { 6 } else { 2 }, "{in_place}");
            p.deliver_requests();
            p.deliver_answers();
            assert!(matches!(p.outcome(ops[0]), Outcome::Done(_)), "{in_place}");
            assert_eq!(p.outcome(ops[1]), Outcome::Failed, "{in_place}");
            let t = p.target_bytes();
            assert_eq!(&t[3..253], &data[..], "{in_place}");
            assert!(t[..3].iter().chain(&t[253..]).all(|b| *b == 0));
            let g = p.get(3, 5, 250);
            p.deliver_requests();
            p.deliver_answers();
            assert!(matches!(p.outcome(g), Outcome::Done(_)), "{in_place}");
            assert_eq!(&p.dst_bytes()[5..255], &data[..], "{in_place}");
            assert_eq!(p.outstanding(), 0);
        }
    }

    /// A part of a get before its last whose answer is malformed (as a
    /// failed device copy, or any failure the last part does not see
    /// itself) fails the whole get, through the last part's future, not
    /// the next flush; a get whose parts all land completes.
    #[test]
    #[cfg(not(btl_loom))]
    fn a_failed_part_before_the_last_fails_the_whole_get() {
        use crate::fuzz_support::{Outcome, RmaPair};
        for broken in [false, true] {
            let mut p = RmaPair::new(256, 256);
            p.set_in_place(true);
            let g = p.get(0, 0, 250);
            let ids = p.pending_ids();
            assert!(ids.len() >= 3, "in parts: {ids:?}");
            p.deliver_requests();
            p.drop_answers();
            let mut at = 0;
            for (i, id) in ids.iter().enumerate() {
                let n = 99.min(250 - at);
                let mut body = vec![0u8];
                body.extend(std::iter::repeat_n(i as u8, n));
                if broken && i == 0 {
                    body[0] = 7; // no such status
                }
                p.forge_answer(crate::fuzz_support::rma_kind::GET_RESP, *id, &body);
                at += n;
            }
            let want_done = !broken;
            assert_eq!(
                matches!(p.outcome(g), Outcome::Done(_)),
                want_done,
                "broken: {broken}"
            );
            assert_eq!(p.outstanding(), 0);
        }
    }

    /// A put part before the last that failed at the target (not for its
    /// range, which every part is refused for) is answered at the last
    /// part; an implicit put's goes to the next flush.
    #[test]
    fn a_put_part_that_failed_is_answered_at_the_last() {
        let (tgt, _) = rma(2);
        let to_ini = Wire::new(0);
        let e = || Err(AccessError::NotPermitted("device copy".into()));
        tgt.part_done(&to_ini, 0, 5, e(), false, false);
        tgt.part_done(&to_ini, 0, 5, Ok(()), false, false);
        assert!(to_ini.take().is_empty(), "nothing before the last part");
        tgt.part_done(&to_ini, 0, 5, Ok(()), false, true);
        let sent = to_ini.take();
        assert_eq!(sent.len(), 1);
        assert_eq!((sent[0].0, sent[0].1), (Kind::PutAck, 5));
        assert!(matches!(decode_status(&sent[0].2), Some((Err(_), _))));
        assert!(lock(&tgt.part_failed).is_empty());
        // Implicit: no answer, the refusal kept for the flush.
        tgt.part_done(&to_ini, 0, 0, e(), false, false);
        assert!(lock(&tgt.refused).contains_key(&0));
    }

    /// `idle` says what `outstanding(peer) == 0` says, whatever order the
    /// natively posted operations finish in, and an implicit one's failure
    /// behind one still running still reaches the next flush.
    #[test]
    fn idle_agrees_with_the_count_whatever_order_operations_finish_in() {
        let (r, _) = rma(3);
        let cs: Vec<_> = (0..6)
            .map(|i| {
                let c = Completion::new();
                r.track(1 + (i % 2), c.clone(), i == 3);
                c
            })
            .collect();
        // Rank 1 has 0, 2, 4; rank 2 has 1, 3 (implicit), 5.
        for (step, i) in [4usize, 3, 1, 0, 5, 2].into_iter().enumerate() {
            // `idle` first, on a list no full sweep tidied.
            let (i1, i2) = (r.idle(1), r.idle(2));
            assert_eq!(i1, r.outstanding(1) == 0, "rank 1 before step {step}");
            assert_eq!(i2, r.outstanding(2) == 0, "rank 2 before step {step}");
            let e = if i == 3 { Err(Error::Closed) } else { Ok(()) };
            cs[i].complete(e);
        }
        assert!(r.idle(1) && r.idle(2));
        assert!(matches!(r.take_failure(2), Some(Error::Closed)));
        assert!(r.take_failure(1).is_none());
        assert!(lock(&r.native).is_empty());
    }

    /// An operation whose answer never comes fails with `Timeout` once its
    /// peer has answered nothing for the limit; answers that keep coming
    /// keep the other waits alive; another peer's operations are left.
    #[test]
    fn operations_a_silent_peer_never_answers_time_out() {
        let (r, _) = rma(3);
        let to_1 = Wire::new(1);
        let to_2 = Wire::new(2);
        let src = HeapBuf::from_vec(vec![1; 8]);
        for to in [&to_1, &to_2] {
            r.put_implicit(to, &[7; 16], 0, (PutSrc::Host(src.raw()), 0, 8))
                .unwrap();
            r.flush_request(to).unwrap();
        }
        let (fa, fb) = (to_1.take(), to_2.take());
        assert_eq!((fa.len(), fb.len()), (2, 2), "a put and a flush each");
        let limit = std::time::Duration::from_millis(30);
        assert_eq!(r.expire(limit), 0, "young operations are left");
        std::thread::sleep(std::time::Duration::from_millis(40));
        // Rank 2 answers something (of another operation) just now: its
        // wait goes on.
        r.heard[2].store(r.now_ms(), Ordering::Relaxed);
        assert_eq!(r.expire(limit), 1, "rank 1's flush times out");
        assert_eq!(r.outstanding(1), 0);
        let e = r.take_failure(1).expect("the flush's failure");
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("rank 1"), "{e}");
        assert_eq!(r.outstanding(2), 1, "rank 2's wait goes on");
        // Rank 1's answer, late: dropped, not counted as a bad message.
        let (kind, id1, _) = fa.into_iter().nth(1).unwrap();
        assert_eq!(kind, Kind::FlushReq);
        r.handle(
            &to_1,
            1,
            Kind::FlushAck,
            id1,
            encode_status(&Ok(()), 0).freeze(),
        );
        assert_eq!(r.counters.bad_frames.load(Ordering::Relaxed), 0);
        assert!(r.take_failure(1).is_none());
        // Its answer, late, still settles it.
        let (kind, id, _) = fb.into_iter().nth(1).unwrap();
        assert_eq!(kind, Kind::FlushReq);
        r.handle(
            &to_2,
            2,
            Kind::FlushAck,
            id,
            encode_status(&Ok(()), 0).freeze(),
        );
        assert_eq!(r.outstanding(2), 0);
        assert!(r.take_failure(2).is_none());
    }

    fn rma(size: u32) -> (Rma, Arc<RegionTable>) {
        let regions = Arc::new(RegionTable::default());
        let r = Rma::new(regions.clone(), Arc::default(), Arc::default(), size);
        (r, regions)
    }

    #[test]
    fn implicit_puts_are_confirmed_by_one_flush_request_and_report_a_refusal_once() {
        let (ini, _) = rma(2);
        let (tgt, regions) = rma(2);
        let region = regions.register(1, vec![0u8; 256], &crate::core::region::no_nic);
        let key = region.remote_key().id;
        let to_tgt = Wire::new(1);
        let to_ini = Wire::new(0);
        let src = HeapBuf::from_vec((1..=64).collect());
        let raw = src.raw();
        // Two good puts (one inline-sized, one through a request buffer)
        // and one to a key the target does not have.
        ini.put_implicit(&to_tgt, &key, 10, (PutSrc::Host(raw), 0, 8))
            .unwrap();
        ini.put_implicit(&to_tgt, &[7; 16], 0, (PutSrc::Host(raw), 0, 8))
            .unwrap();
        ini.put_implicit(&to_tgt, &key, 100, (PutSrc::Host(raw), 8, 56))
            .unwrap();
        assert_eq!(ini.outstanding(1), 0, "implicit puts are not registered");
        ini.flush_request(&to_tgt).unwrap();
        assert_eq!(ini.outstanding(1), 1, "the flush request is");
        let msgs = to_tgt.take();
        let kinds: Vec<(Kind, u64)> = msgs.iter().map(|m| (m.0, m.1)).collect();
        assert_eq!(kinds[..3], [(Kind::PutReq, 0); 3], "no ids, no answers");
        assert_eq!(kinds[3].0, Kind::FlushReq, "behind the puts");
        for (kind, id, data) in msgs {
            tgt.handle(&to_ini, 0, kind, id, data);
        }
        let answers = to_ini.take();
        assert_eq!(answers.len(), 1, "one answer for the lot: {answers:?}");
        assert_eq!(answers[0].0, Kind::FlushAck);
        let v = region.to_vec();
        assert_eq!(&v[10..18], &(1..=8).collect::<Vec<u8>>()[..]);
        assert_eq!(&v[100..156], &(9..=64).collect::<Vec<u8>>()[..]);
        assert!(v[..10]
            .iter()
            .chain(&v[18..100])
            .chain(&v[156..])
            .all(|b| *b == 0));
        // Until the answer is in, a flush waits.
        assert_eq!(ini.outstanding(1), 1);
        assert!(ini.take_failure(1).is_none());
        for (kind, id, data) in answers {
            ini.handle(&to_tgt, 1, kind, id, data);
        }
        assert_eq!(ini.outstanding(1), 0);
        let e = ini.take_failure(1).expect("the refusal");
        assert!(matches!(e, Error::Access(AccessError::UnknownKey)), "{e}");
        assert!(ini.take_failure(1).is_none(), "reported once");
        // Covered: the next flush asks nothing.
        ini.flush_request(&to_tgt).unwrap();
        assert!(to_tgt.take().is_empty());
        // A peer that cannot be reached: the put and the flush fail now.
        ini.put_implicit(&to_tgt, &key, 0, (PutSrc::Host(raw), 0, 8))
            .unwrap();
        to_tgt.down.store(true, Ordering::Relaxed);
        assert!(ini
            .put_implicit(&to_tgt, &key, 0, (PutSrc::Host(raw), 0, 8))
            .is_err());
        let e = ini.flush_request(&to_tgt).unwrap_err();
        assert!(e.is_peer_lost(), "{e}");
        assert_eq!(
            ini.outstanding(1),
            0,
            "the failed request is not left behind"
        );
    }

    #[test]
    fn put_parts_are_checked_whole_and_hostile_ones_refused_without_a_panic() {
        let (tgt, regions) = rma(2);
        let region = regions.register(1, vec![0u8; 1000], &crate::core::region::no_nic);
        let key = region.remote_key().id;
        let to_ini = Wire::new(0);
        let part = |start: u64, len: u64, at: u64, data: &[u8]| {
            let mut b = req_header(&key, start).to_vec();
            b.extend_from_slice(&len.to_le_bytes());
            b.extend_from_slice(&at.to_le_bytes());
            b.extend_from_slice(data);
            Bytes::from(b)
        };
        // Two parts of a 600-byte put at 100: written, answered once.
        tgt.handle(&to_ini, 0, Kind::PutPart, 7, part(100, 600, 0, &[1; 300]));
        assert!(to_ini.take().is_empty(), "no answer before the last part");
        tgt.handle(&to_ini, 0, Kind::PutPart, 7, part(100, 600, 300, &[2; 300]));
        let answers = to_ini.take();
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].0, answers[0].1), (Kind::PutAck, 7));
        let v = region.to_vec();
        assert!(v[100..400].iter().all(|b| *b == 1) && v[400..700].iter().all(|b| *b == 2));
        // A put whose extent passes the end: its first part, inside the
        // region, is not written; refused at the last (answered with it).
        tgt.handle(&to_ini, 0, Kind::PutPart, 8, part(800, 400, 0, &[3; 150]));
        tgt.handle(&to_ini, 0, Kind::PutPart, 8, part(800, 400, 150, &[3; 250]));
        assert!(region.to_vec()[800..].iter().all(|b| *b == 0));
        let answers = to_ini.take();
        assert_eq!(answers.len(), 1);
        assert!(matches!(decode_status(&answers[0].2), Some((Err(_), _))));
        assert_eq!(tgt.counters.snapshot().access_refused, 1, "counted once");
        // Hostile parts: beyond their extent, a length past any address, a
        // short header. Dropped (counted as bad frames); an implicit one is
        // a refusal for the next flush request; no panic, nothing written.
        let bad_before = tgt.counters.snapshot().bad_frames;
        tgt.handle(&to_ini, 0, Kind::PutPart, 9, part(0, 10, 5, &[4; 20]));
        tgt.handle(
            &to_ini,
            0,
            Kind::PutPart,
            9,
            part(u64::MAX - 5, u64::MAX, 0, &[4; 20]),
        );
        tgt.handle(&to_ini, 0, Kind::PutPart, 9, Bytes::from_static(&[0; 30]));
        tgt.handle(&to_ini, 0, Kind::PutPart, 0, part(0, 10, 9, &[4; 2]));
        assert_eq!(tgt.counters.snapshot().bad_frames, bad_before + 3);
        assert!(region.to_vec()[..100].iter().all(|b| *b == 0));
        tgt.handle(&to_ini, 0, Kind::FlushReq, 11, Bytes::new());
        let answers = to_ini.take();
        let refusals: Vec<_> = answers
            .iter()
            .filter_map(|a| decode_status(&a.2).and_then(|(r, _)| r.err()))
            .collect();
        assert!(!refusals.is_empty(), "{answers:?}");
    }

    #[test]
    fn implicit_gets_wait_in_the_table_and_fail_into_the_next_flush() {
        let (ini, ini_regions) = rma(2);
        let (tgt, regions) = rma(2);
        let region = regions.register(
            1,
            (0..=255).collect::<Vec<u8>>(),
            &crate::core::region::no_nic,
        );
        let key = region.remote_key().id;
        let dst = ini_regions.register(0, vec![0u8; 32], &crate::core::region::no_nic);
        let (to_tgt, to_ini) = (Wire::new(1), Wire::new(0));
        ini.start_get(&to_tgt, &key, 40, (dst.inner.clone(), 0, 16), None)
            .unwrap();
        ini.start_get(&to_tgt, &[9; 16], 0, (dst.inner.clone(), 16, 16), None)
            .unwrap();
        assert_eq!(ini.outstanding(1), 2);
        for (kind, id, data) in to_tgt.take() {
            tgt.handle(&to_ini, 0, kind, id, data);
        }
        for (kind, id, data) in to_ini.take() {
            ini.handle(&to_tgt, 1, kind, id, data);
        }
        assert_eq!(ini.outstanding(1), 0);
        assert_eq!(&dst.to_vec()[..16], &(40..56).collect::<Vec<u8>>()[..]);
        assert!(dst.to_vec()[16..].iter().all(|b| *b == 0), "refused get");
        let e = ini.take_failure(1).expect("the refused get");
        assert!(matches!(e, Error::Access(_)), "{e}");
        // Closing fails what is pending; the flush hears of it.
        ini.start_get(&to_tgt, &key, 0, (dst.inner.clone(), 0, 8), None)
            .unwrap();
        ini.close();
        assert_eq!(ini.outstanding(1), 0);
        assert!(matches!(ini.take_failure(1), Some(Error::Closed)));
    }
}

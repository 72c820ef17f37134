//! put and get, transport-independent.
//!
//! Fastest path first: a transport that can map the target region
//! ([`Link::map_remote`], shared memory) copies directly and the operation
//! completes at once. Otherwise put/get are emulated on messages: the
//! initiator sends a request naming the key id and offset, the *target* looks
//! the id up in its own table, checks the range, then writes or reads and
//! answers. A forged, stale or out-of-range key is refused by the target with
//! its memory untouched, and counted.
//!
//! Ownership: an emulated get keeps the destination region alive (an `Arc`)
//! in the pending table until the answer lands or the peer is lost, so
//! dropping the future cannot free memory the engine will still write.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use bytes::{BufMut, Bytes, BytesMut};

use crate::completion::Completion;
use crate::mem::RawBuf;
use crate::os::Cma;
use crate::region::{KeyId, RegionInner, RegionTable};
use crate::stats::Counters;
use crate::sync::lock;
use crate::transport::{Kind, Link};
use crate::{AccessError, Error, Rank, Result};

enum Pending {
    /// `_src` keeps the source region alive while the target may still read
    /// it by CMA.
    Put { _src: Option<Arc<RegionInner>> },
    Get {
        dst: Arc<RegionInner>,
        offset: u64,
        len: usize,
        /// The target writes `dst` itself (CMA): the answer carries no data.
        cma: bool,
    },
}

struct Op {
    peer: Rank,
    done: Arc<Completion>,
    what: Pending,
}

/// Outstanding emulated operations of one fabric.
pub(crate) struct Rma {
    next: AtomicU64,
    ops: Mutex<HashMap<u64, Op>>,
    pub(crate) regions: Arc<RegionTable>,
    counters: Arc<Counters>,
}

const REQ_HEADER: usize = 16 + 8;

fn encode_req(key: &KeyId, offset: u64, extra: usize) -> BytesMut {
    let mut b = BytesMut::with_capacity(REQ_HEADER + extra);
    b.put_slice(key);
    b.put_u64_le(offset);
    b
}

fn decode_req(data: &[u8]) -> Option<(KeyId, u64, &[u8])> {
    if data.len() < REQ_HEADER {
        return None;
    }
    let key: KeyId = data[..16].try_into().ok()?;
    let off = u64::from_le_bytes(data[16..24].try_into().ok()?);
    Some((key, off, &data[24..]))
}

fn encode_status(r: &Result<(), AccessError>, extra: usize) -> BytesMut {
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

fn decode_status(data: &[u8]) -> Option<(Result<(), AccessError>, &[u8])> {
    match data.split_first()? {
        (0, rest) => Some((Ok(()), rest)),
        (1, rest) => Some((Err(postcard::from_bytes(rest).ok()?), &rest[rest.len()..])),
        _ => None,
    }
}

impl Rma {
    pub(crate) fn new(regions: Arc<RegionTable>, counters: Arc<Counters>) -> Self {
        Rma {
            next: AtomicU64::new(1),
            ops: Mutex::new(HashMap::new()),
            regions,
            counters,
        }
    }

    fn register(&self, peer: Rank, what: Pending) -> (u64, Arc<Completion>) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let done = Completion::new();
        lock(&self.ops).insert(
            id,
            Op {
                peer,
                done: done.clone(),
                what,
            },
        );
        (id, done)
    }

    fn fail_op(&self, id: u64, e: Error) {
        if let Some(op) = lock(&self.ops).remove(&id) {
            op.done.complete(Err(e));
        }
    }

    /// Start an emulated put of `data` into the peer's region `key` at `offset`.
    pub(crate) fn start_put(
        &self,
        link: &Arc<dyn Link>,
        key: &KeyId,
        offset: u64,
        data: &[u8],
    ) -> Arc<Completion> {
        let (id, done) = self.register(link.peer(), Pending::Put { _src: None });
        let mut req = encode_req(key, offset, data.len());
        req.put_slice(data);
        if let Err(e) = link.submit(Kind::PutReq, id, req.freeze()) {
            self.fail_op(id, e);
        }
        done
    }

    /// Start an emulated get of `len` bytes from the peer's region into `dst`.
    pub(crate) fn start_get(
        &self,
        link: &Arc<dyn Link>,
        key: &KeyId,
        offset: u64,
        dst: Arc<RegionInner>,
        dst_offset: u64,
        len: usize,
    ) -> Arc<Completion> {
        let (id, done) = self.register(
            link.peer(),
            Pending::Get {
                dst,
                offset: dst_offset,
                len,
                cma: false,
            },
        );
        let mut req = encode_req(key, offset, 8);
        req.put_u64_le(len as u64);
        if let Err(e) = link.submit(Kind::GetReq, id, req.freeze()) {
            self.fail_op(id, e);
        }
        done
    }

    /// Start a single-copy put: the target reads `src[src_off..+len]` out of
    /// our memory after checking its key. `src` stays alive until answered.
    pub(crate) fn start_put_cma(
        &self,
        link: &Arc<dyn Link>,
        key: &KeyId,
        offset: u64,
        src: Arc<RegionInner>,
        src_off: u64,
        len: usize,
    ) -> Arc<Completion> {
        let ours = src.raw().slice(src_off, len);
        self.start_cma(
            link,
            Kind::PutCma,
            key,
            offset,
            ours,
            Pending::Put { _src: Some(src) },
        )
    }

    /// Start a single-copy get: the target writes into `dst[dst_off..+len]`
    /// after checking its key. `dst` stays alive until answered.
    pub(crate) fn start_get_cma(
        &self,
        link: &Arc<dyn Link>,
        key: &KeyId,
        offset: u64,
        dst: Arc<RegionInner>,
        dst_off: u64,
        len: usize,
    ) -> Arc<Completion> {
        let ours = dst.raw().slice(dst_off, len);
        let pending = Pending::Get {
            dst,
            offset: dst_off,
            len,
            cma: true,
        };
        self.start_cma(link, Kind::GetCma, key, offset, ours, pending)
    }

    /// Register `pending` and ask the target to copy between its region and
    /// our range `ours` (address and length travel; the pid does not).
    fn start_cma(
        &self,
        link: &Arc<dyn Link>,
        kind: Kind,
        key: &KeyId,
        offset: u64,
        ours: Result<RawBuf, AccessError>,
        pending: Pending,
    ) -> Arc<Completion> {
        let (id, done) = self.register(link.peer(), pending);
        let sent = ours.map_err(Error::from).and_then(|ours| {
            let mut req = encode_req(key, offset, 16);
            req.put_u64_le(ours.addr() as u64);
            req.put_u64_le(ours.len() as u64);
            link.submit(kind, id, req.freeze())
        });
        if let Err(e) = sent {
            self.fail_op(id, e);
        }
        done
    }

    /// Number of operations still waiting on `peer`.
    pub(crate) fn outstanding(&self, peer: Rank) -> usize {
        lock(&self.ops).values().filter(|o| o.peer == peer).count()
    }

    /// Fail everything pending on a lost peer.
    pub(crate) fn peer_lost(&self, peer: Rank, reason: &str) {
        let lost: Vec<Op> = {
            let mut ops = lock(&self.ops);
            let ids: Vec<u64> = ops
                .iter()
                .filter(|(_, o)| o.peer == peer)
                .map(|(k, _)| *k)
                .collect();
            ids.into_iter().filter_map(|k| ops.remove(&k)).collect()
        };
        for op in lost {
            op.done.complete(Err(Error::PeerLost {
                rank: peer,
                reason: reason.to_string(),
            }));
        }
    }

    /// Handle an RMA message from `src` (request or answer). Requests are
    /// answered through `link`.
    pub(crate) fn handle(&self, link: &dyn Link, src: Rank, kind: Kind, id: u64, data: Bytes) {
        match kind {
            Kind::PutReq => {
                let r = match decode_req(&data) {
                    None => return self.bad(src, "short put request"),
                    Some((key, off, payload)) => self
                        .target(&key, off, payload.len())
                        .and_then(|reg| reg.raw().write(off, payload)),
                };
                self.answer(link, Kind::PutAck, id, encode_status(&r, 0));
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
                        let mut b = encode_status(&Ok(()), len);
                        match reg.raw().read_into(off, len, &mut b) {
                            Ok(()) => b,
                            Err(e) => encode_status(&Err(e), 0),
                        }
                    }
                    Err(e) => encode_status(&Err(e), 0),
                };
                self.answer(link, Kind::GetResp, id, resp);
            }
            Kind::PutCma | Kind::GetCma => {
                let (key, off, addr, len) = match decode_req(&data) {
                    Some((k, o, rest)) if rest.len() == 16 => {
                        let w = |i: usize| {
                            u64::from_le_bytes(rest[i..i + 8].try_into().unwrap_or_default())
                        };
                        (k, o, w(0), w(8))
                    }
                    _ => return self.bad(src, "malformed single-copy request"),
                };
                // The pid comes from our own connection to the peer, never
                // from the request: a peer cannot make us touch a third
                // process.
                let r = match (link.cma_pid(), usize::try_from(len)) {
                    (Some(pid), Ok(len)) => self.target(&key, off, len).and_then(|reg| {
                        let local = reg.raw().slice(off, len)?;
                        let dir = if kind == Kind::PutCma {
                            Cma::Read
                        } else {
                            Cma::Write
                        };
                        crate::os::cma_copy(dir, pid, local, addr).map_err(|e| {
                            AccessError::NotPermitted(format!("single-copy transfer failed: {e}"))
                        })
                    }),
                    _ => Err(AccessError::NotPermitted(
                        "single-copy transfer from this peer".into(),
                    )),
                };
                let answer = if kind == Kind::PutCma {
                    Kind::PutAck
                } else {
                    Kind::GetResp
                };
                self.answer(link, answer, id, encode_status(&r, 0));
            }
            Kind::PutAck | Kind::GetResp => self.finish(src, kind, id, &data),
            _ => {}
        }
    }

    fn target(&self, key: &KeyId, off: u64, len: usize) -> Result<Arc<RegionInner>, AccessError> {
        let r = self
            .regions
            .get(key)
            .ok_or(AccessError::UnknownKey)
            .and_then(|reg| {
                let n = reg.raw().len() as u64;
                match off.checked_add(len as u64) {
                    Some(end) if end <= n => Ok(reg),
                    _ => Err(AccessError::OutOfBounds {
                        offset: off,
                        end: off.saturating_add(len as u64),
                        len: n,
                    }),
                }
            });
        if r.is_err() {
            Counters::bump(&self.counters.access_refused);
        }
        r
    }

    fn answer(&self, link: &dyn Link, kind: Kind, id: u64, body: BytesMut) {
        if let Err(e) = link.submit(kind, id, body.freeze()) {
            tracing::debug!(peer = link.peer(), "could not answer RMA request: {e}");
        }
    }

    fn bad(&self, src: Rank, what: &str) {
        Counters::bump(&self.counters.bad_frames);
        tracing::warn!(peer = src, "dropped bad RMA message: {what}");
    }

    fn finish(&self, src: Rank, kind: Kind, id: u64, data: &[u8]) {
        let op = {
            let mut ops = lock(&self.ops);
            match ops.get(&id) {
                Some(op) if op.peer == src => ops.remove(&id),
                _ => None,
            }
        };
        let Some(op) = op else {
            return self.bad(src, "answer to an unknown operation");
        };
        let Some((status, payload)) = decode_status(data) else {
            op.done.complete(Err(Error::PeerMisbehaved {
                rank: src,
                what: "malformed RMA answer".into(),
            }));
            return self.bad(src, "malformed RMA answer");
        };
        let r = match (status, op.what, kind) {
            (Err(e), _, _) => Err(Error::Access(e)),
            (Ok(()), Pending::Put { .. }, Kind::PutAck) => Ok(()),
            (Ok(()), Pending::Get { cma: true, .. }, Kind::GetResp) if payload.is_empty() => Ok(()),
            (
                Ok(()),
                Pending::Get {
                    dst,
                    offset,
                    len,
                    cma: false,
                },
                Kind::GetResp,
            ) if payload.len() == len => dst.raw().write(offset, payload).map_err(Error::from),
            _ => Err(Error::PeerMisbehaved {
                rank: src,
                what: "RMA answer does not match the request".into(),
            }),
        };
        op.done.complete(r);
    }
}

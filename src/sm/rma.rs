//! `sm`'s single-copy put and get into memory the peer does not share.
//!
//! From `BTL_SM_CMA_MIN` bytes (16 KiB) into or out of a registered
//! buffer (a region no peer maps), the initiator sends a request — key
//! id, offset, and the address and length of its own range — on the
//! pair's control ring. The target checks the key and range against its
//! region table, copies straight between its region and the initiator's
//! memory with `process_vm_readv`/`process_vm_writev` (the pid comes from
//! its own connection to the peer, never from the request), and answers.
//! One copy instead of two through fragments.
//!
//! The kernel may refuse such copies (ptrace rules, seccomp, a container's
//! policy): the target answers "not allowed", and the initiator stops
//! single copies to that peer and redoes the operation through the core's
//! emulation over messages, with the same completion.
//!
//! Ownership: the initiator's region stays referenced here until the
//! answer; if the peer is cut off while it may still be running (it
//! misbehaved, or the fabric closes), the region is kept for the life of
//! the process (`quarantine`), since the peer's kernel copy may still
//! land in it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{BufMut, BytesMut};

use super::kind::Kind;
use super::{SmPeer, SmTransport};
use crate::core::completion::Completion;
use crate::core::region::{KeyId, RegionInner};
use crate::sys::os::Cma;
use crate::sys::sync::lock;
use crate::transport::Local;
use crate::{AccessError, Error, Rank, Result};

/// Request body after the key id: offset, our address, our length.
const REQUEST: usize = 16 + 8 + 8 + 8;

/// Answer codes (first byte).
const OK: u8 = 0;
/// Refused by the target's checks: a postcard `AccessError` follows.
const REFUSED: u8 = 1;
/// The kernel does not allow single copies between the pair: redo the
/// operation over messages.
const NOT_ALLOWED: u8 = 2;

/// A single-copy request, initiator to target: the key id and offset at
/// the target, then the address and length of the initiator's own range
/// (little-endian words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CmaRequest {
    pub(crate) key: KeyId,
    pub(crate) offset: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

impl CmaRequest {
    /// Wire form.
    pub(crate) fn encode(&self) -> BytesMut {
        let mut req = BytesMut::with_capacity(REQUEST);
        req.put_slice(&self.key);
        req.put_u64_le(self.offset);
        req.put_u64_le(self.addr);
        req.put_u64_le(self.len);
        req
    }

    /// Read a request: `None` unless it is exactly [`CmaRequest::encode`]'s
    /// length (the target checks key and range against its table).
    pub(crate) fn decode(req: &[u8]) -> Option<CmaRequest> {
        let req: &[u8; REQUEST] = req.try_into().ok()?;
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&req[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let mut key = KeyId::default();
        key.copy_from_slice(&req[..16]);
        Some(CmaRequest {
            key,
            offset: word(16),
            addr: word(24),
            len: word(32),
        })
    }
}

/// A single-copy answer, target to initiator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CmaAnswer {
    /// Copied.
    Done,
    /// Refused by the target's checks.
    Refused(AccessError),
    /// The kernel does not allow single copies between the pair.
    NotAllowed,
}

impl CmaAnswer {
    /// Wire form: a code byte, then (refused) the postcard error.
    pub(crate) fn encode(&self) -> BytesMut {
        let mut body = BytesMut::with_capacity(1);
        match self {
            CmaAnswer::Done => body.put_u8(OK),
            CmaAnswer::NotAllowed => body.put_u8(NOT_ALLOWED),
            CmaAnswer::Refused(e) => {
                body.put_u8(REFUSED);
                body.put_slice(&postcard::to_allocvec(e).unwrap_or_default());
            }
        }
        body
    }

    /// Read an answer: `None` for anything [`CmaAnswer::encode`] does not
    /// write (trailing bytes after the error included).
    pub(crate) fn decode(body: &[u8]) -> Option<CmaAnswer> {
        match body.split_first()? {
            (&OK, []) => Some(CmaAnswer::Done),
            (&NOT_ALLOWED, []) => Some(CmaAnswer::NotAllowed),
            (&REFUSED, e) => match postcard::take_from_bytes::<AccessError>(e) {
                Ok((e, [])) => Some(CmaAnswer::Refused(e)),
                _ => None,
            },
            _ => None,
        }
    }
}

struct Op {
    peer: Rank,
    put: bool,
    /// Our region, its range, and where it goes at the target.
    local: Arc<RegionInner>,
    at: u64,
    len: usize,
    key: KeyId,
    offset: u64,
    done: Arc<Completion>,
}

/// Single-copy operations this process started and not yet answered.
#[derive(Default)]
pub(crate) struct CmaOps {
    next: AtomicU64,
    ops: Mutex<HashMap<u64, Op>>,
    /// Regions a peer we stopped listening to may still write by CMA:
    /// never freed while this process runs.
    quarantine: Mutex<Vec<Arc<RegionInner>>>,
}

impl Drop for CmaOps {
    fn drop(&mut self) {
        // Operations still pending when the transport goes away may be
        // answered by a peer's kernel copy into their regions later: leak
        // those regions rather than free memory a peer may write.
        for op in std::mem::take(&mut *lock(&self.ops)).into_values() {
            std::mem::forget(op.local);
        }
        std::mem::forget(std::mem::take(&mut *lock(&self.quarantine)));
    }
}

impl CmaOps {
    /// Start a single-copy put (the target reads `local`) or get (the
    /// target writes it) of the peer's region `key` at `offset`. The
    /// returned completion resolves at remote completion.
    pub(crate) fn start(
        &self,
        t: &SmTransport,
        p: &SmPeer,
        put: bool,
        local: Local<'_>,
        key: &KeyId,
        offset: u64,
    ) -> Result<Arc<Completion>> {
        let done = Completion::new();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let op = Op {
            peer: p.rank,
            put,
            local: local.region.clone(),
            at: local.offset,
            len: local.raw.len(),
            key: *key,
            offset,
            done: done.clone(),
        };
        lock(&self.ops).insert(id, op);
        let req = CmaRequest {
            key: *key,
            offset,
            addr: local.raw.addr() as u64,
            len: local.raw.len() as u64,
        }
        .encode();
        let kind = if put { Kind::PutCma } else { Kind::GetCma };
        if let Err(e) = t.with_tx(|tx| tx.submit(t, p, kind, id, req.freeze())) {
            // Nothing reached the peer: nothing of ours is exposed.
            lock(&self.ops).remove(&id);
            return Err(e);
        }
        let c = &t.counters;
        crate::core::stats::Counters::bump(if put { &c.cma_puts } else { &c.cma_gets });
        Ok(done)
    }

    /// Target side: check and carry out a [`Kind::PutCma`] or
    /// [`Kind::GetCma`] request from `p`, and answer it. `Err`: the request
    /// is malformed (the caller cuts the peer off).
    pub(crate) fn serve(
        t: &SmTransport,
        p: &SmPeer,
        put: bool,
        id: u64,
        req: &[u8],
    ) -> std::result::Result<(), &'static str> {
        let Some(CmaRequest {
            key,
            offset: off,
            addr,
            len,
        }) = CmaRequest::decode(req)
        else {
            return Err("malformed single-copy request");
        };
        let answer = if !p.cma_ok() {
            CmaAnswer::NotAllowed
        } else {
            let r = usize::try_from(len)
                .map_err(|_| AccessError::OutOfBounds {
                    offset: off,
                    end: u64::MAX,
                    len: 0,
                })
                .and_then(|len| t.core.target_region(&key, off, len).map(|reg| (reg, len)))
                .and_then(|(reg, len)| reg.raw().slice(off, len));
            match r {
                Err(e) => CmaAnswer::Refused(e),
                Ok(local) => {
                    let dir = if put { Cma::Read } else { Cma::Write };
                    match crate::sys::os::cma_copy(dir, p.seg.pid, local, addr) {
                        Ok(()) => CmaAnswer::Done,
                        Err(e) => match e.raw_os_error() {
                            Some(libc::EPERM | libc::ENOSYS | libc::EACCES) => {
                                CmaAnswer::NotAllowed
                            }
                            _ => CmaAnswer::Refused(AccessError::NotPermitted(format!(
                                "single-copy transfer failed: {e}"
                            ))),
                        },
                    }
                }
            }
        };
        let body = answer.encode().freeze();
        // A failure means the peer is gone; its loss is reported elsewhere.
        let _ = t.with_tx(|tx| tx.submit(t, p, Kind::CmaAck, id, body));
        Ok(())
    }

    /// Initiator side: `p` answered operation `id`. `Err`: an answer that
    /// matches nothing we asked (the caller cuts the peer off).
    pub(crate) fn answered(
        &self,
        t: &SmTransport,
        p: &SmPeer,
        id: u64,
        body: &[u8],
    ) -> std::result::Result<(), &'static str> {
        let op = {
            let mut ops = lock(&self.ops);
            match ops.get(&id) {
                Some(op) if op.peer == p.rank => ops.remove(&id),
                _ => None,
            }
        };
        let Some(op) = op else {
            return Err("answer to an unknown single-copy operation");
        };
        match CmaAnswer::decode(body) {
            Some(CmaAnswer::Done) => op.done.complete(Ok(())),
            Some(CmaAnswer::Refused(e)) => op.done.complete(Err(Error::Access(e))),
            Some(CmaAnswer::NotAllowed) => {
                // Stop single copies with this peer; this operation goes
                // over messages, completing the same slot.
                p.cma.store(false, Ordering::Relaxed);
                Self::emulate(t, p, op);
            }
            None => {
                op.done.complete(Err(Error::PeerMisbehaved {
                    rank: p.rank,
                    what: "malformed single-copy answer".into(),
                }));
                return Err("malformed single-copy answer");
            }
        }
        Ok(())
    }

    /// Redo `op` through the core's emulation over messages.
    fn emulate(t: &SmTransport, p: &SmPeer, op: Op) {
        let Some(link) = t.core.link(p.rank) else {
            return op.done.complete(Err(Error::Closed));
        };
        if op.put {
            let src = (op.local.raw(), op.at, op.len);
            t.core.emulate_put(&*link, &op.key, op.offset, src, op.done);
        } else {
            let dst = (op.local, op.at, op.len);
            t.core.emulate_get(&*link, &op.key, op.offset, dst, op.done);
        }
    }

    /// Fail everything pending on `peer`; `exited`: its process is gone,
    /// so no copy of its can land in our regions any more.
    pub(crate) fn peer_lost(&self, peer: Rank, reason: &str, exited: bool) {
        let ops: Vec<Op> = {
            let mut all = lock(&self.ops);
            let ids: Vec<u64> = all
                .iter()
                .filter(|(_, o)| o.peer == peer)
                .map(|(k, _)| *k)
                .collect();
            ids.iter().filter_map(|k| all.remove(k)).collect()
        };
        for op in ops {
            op.done.complete(Err(Error::PeerLost {
                rank: peer,
                reason: reason.to_string(),
            }));
            if !exited {
                lock(&self.quarantine).push(op.local);
            }
        }
    }

    /// Fail everything pending (the fabric is closing); the peers may still
    /// copy into those regions, which are kept.
    pub(crate) fn close(&self) {
        let ops = std::mem::take(&mut *lock(&self.ops));
        for op in ops.into_values() {
            op.done.complete(Err(Error::Closed));
            lock(&self.quarantine).push(op.local);
        }
    }
}

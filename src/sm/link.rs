//! [`SmLink`]: an endpoint's connection to one same-node peer, the
//! [`Link`] a user's endpoint talks to. Messages go to the send side
//! ([`TxState`](super::tx::TxState)); one-sided operations into a region the
//! peer maps are one copy here, into a registered buffer a single copy
//! ([`rma`](super::rma)) or the core's emulation over messages.

use std::sync::Arc;

use bytes::Bytes;

use super::{SmPeer, SmTransport};
use crate::core::completion::Completion;
use crate::sys::mem::RawBuf;
use crate::transport::{Kind as CoreKind, Link};
use crate::{Rank, Result};

/// An endpoint's connection to one same-node peer.
pub(crate) struct SmLink {
    pub(crate) t: Arc<SmTransport>,
    pub(crate) peer: Arc<SmPeer>,
}

impl Link for SmLink {
    fn peer(&self) -> Rank {
        self.peer.rank
    }

    fn transport(&self) -> &'static str {
        "sm"
    }

    // A peer caught misbehaving here stays in `misbehaved` until the next
    // progress call cuts it off: these entry points may run inside the
    // receive path (answers to RMA requests), where `rx` is held.
    fn try_send(&self, kind: CoreKind, tag: u64, data: &[u8]) -> Result<bool> {
        // A small user message goes to the fast box on a path of its own
        // (no kind conversion, no fragment checks, and the send side's
        // `busy` flag left as it was: a push to the box changes none of
        // what it sums up).
        if kind == CoreKind::User && data.len() <= super::fbox::MAX_PAYLOAD {
            if let Some(sent) = self.t.try_fbox_send(&self.peer, tag, data) {
                return sent;
            }
        }
        self.t
            .with_tx(|tx| tx.try_send(&self.t, &self.peer, kind.into(), tag, data))
    }

    fn submit(&self, kind: CoreKind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>> {
        self.t
            .with_tx(|tx| tx.submit(&self.t, &self.peer, kind.into(), tag, data))
    }

    fn fill_room(&self) -> usize {
        // A max fragment's payload (`TxState::max_payload`, without its lock).
        self.t
            .config
            .max_size
            .saturating_sub(super::frag::FRAG_BODY)
    }

    fn try_send_filled(
        &self,
        kind: CoreKind,
        tag: u64,
        head: &[u8],
        len: usize,
        fill: &mut dyn FnMut(RawBuf) -> Result<()>,
    ) -> Result<bool> {
        self.t.with_tx(|tx| {
            tx.try_send_filled(&self.t, &self.peer, kind.into(), tag, head, len, fill)
        })
    }

    fn fill_memory(&self) -> Vec<RawBuf> {
        // Ours, where messages to the peer are built; the peer's, where
        // its messages to us are read.
        vec![self.t.seg.raw(), self.peer.seg.raw()]
    }

    fn post(
        &self,
        op: crate::transport::OneSided<'_>,
        _tally: Option<&std::sync::Arc<crate::core::completion::Tally>>,
    ) -> Result<crate::transport::Native> {
        use crate::transport::{Native, OneSided};
        let key = op.key();
        if !key.is_shared() {
            return self.post_registered(op);
        }
        if self.peer.is_lost() {
            return Err(self.peer.lost_error());
        }
        // The mapping the key keeps (made on its first use), checked live:
        // bounds below are the real file's, not the key's claim.
        let m = key.mapping(self.t.core.job_tag(), || self.t.map_cached(key))?;
        let remote = m.data();
        Ok(match op {
            OneSided::Put { src, offset, .. } => {
                remote.copy_from(offset, &src.raw, 0, src.raw.len())?;
                Native::Done(0)
            }
            OneSided::Get { dst, offset, .. } => {
                dst.raw.copy_from(0, &remote, offset, dst.raw.len())?;
                Native::Done(0)
            }
            OneSided::Atomic { offset, op, .. } => Native::Done(remote.atomic(offset, op)?),
        })
    }

    fn has_queued(&self) -> bool {
        self.t.tx.lock().has_queued(self.peer.local)
    }

    fn carries_lent(&self) -> bool {
        // `Kind::Lent` travels on the user channel (`tx::channel`).
        true
    }
}

impl SmLink {
    /// [`Link::post`] into a registered buffer (a region no peer maps):
    /// single copy from `cma_min` bytes where the kernel lets the target
    /// copy our memory, else the core's emulation over messages. Kept out
    /// of `post`, whose mapped path is the hot one.
    #[inline(never)]
    fn post_registered(
        &self,
        op: crate::transport::OneSided<'_>,
    ) -> Result<crate::transport::Native> {
        use crate::transport::{Native, OneSided};
        let (put, local, key, offset) = match op {
            OneSided::Put { src, key, offset } => (true, src, key, offset),
            OneSided::Get { dst, key, offset } => (false, dst, key, offset),
            OneSided::Atomic { .. } => return Ok(Native::Emulate),
        };
        if local.raw.len() < self.t.config.cma_min || !self.peer.cma_ok() {
            return Ok(Native::Emulate);
        }
        if self.peer.is_lost() {
            return Err(self.peer.lost_error());
        }
        let done = self
            .t
            .cma
            .start(&self.t, &self.peer, put, local, &key.id, offset)?;
        Ok(Native::Posted(done))
    }
}

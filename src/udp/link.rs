//! [`UdpLink`]: an endpoint's connection to one peer over `udp`.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::frame;
use super::peer::{Peer, Queued};
use super::UdpTransport;
use crate::core::completion::Completion;
use crate::sys::sync::lock;
use crate::transport::{Kind, Link};
use crate::{Error, Rank, Result};

/// The link to one peer.
pub(crate) struct UdpLink {
    pub(crate) t: Arc<UdpTransport>,
    pub(crate) peer: Arc<Peer>,
}

impl UdpLink {
    /// [`Link::submit`], or with `gather` [`Link::submit_gathered`]: a
    /// small message joins a held bundle, which the next progress call's
    /// service pass sends.
    fn submit_as(
        &self,
        kind: Kind,
        tag: u64,
        data: Bytes,
        gather: bool,
    ) -> Result<Option<Arc<Completion>>> {
        let now = Instant::now();
        let mut st = lock(&self.peer.st);
        self.check_alive()?;
        // Refuse what the protocol would refuse before any part goes out: a
        // head sent without its body would make the peer drop the next
        // message.
        let max = st.conn.max_message();
        if data.len() as u64 + frame::PREFIX as u64 + 32 > max {
            return Err(Error::Misuse(format!(
                "a {}-byte message is larger than the udp limit of {max} bytes",
                data.len()
            )));
        }
        let parts = frame::encode(self.t.core.buffers(), kind, tag, data);
        let r = if gather {
            let (r, gathered) = st.gather_held(now, self.peer.rank, parts)?;
            if gathered {
                self.t.hold_bundle();
            } else {
                st.flush(now, &self.t.io, &self.peer, usize::MAX);
            }
            r
        } else {
            let r = st.submit(now, self.peer.rank, parts)?;
            st.flush(now, &self.t.io, &self.peer, usize::MAX);
            r
        };
        self.t.after_send(&st);
        Ok(match r {
            Queued::Done => None,
            Queued::Waiting(c) => Some(c),
        })
    }

    fn check_alive(&self) -> Result<()> {
        if self.t.core.is_closed() {
            Err(Error::Closed)
        } else if self.peer.is_lost() {
            Err(Error::PeerLost {
                rank: self.peer.rank,
                reason: self
                    .peer
                    .lost_reason
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "it was lost".into()),
            })
        } else {
            Ok(())
        }
    }
}

impl Link for UdpLink {
    fn peer(&self) -> Rank {
        self.peer.rank
    }

    fn transport(&self) -> &'static str {
        "udp"
    }

    fn try_send(&self, kind: Kind, tag: u64, data: &[u8]) -> Result<bool> {
        let now = Instant::now();
        let mut st = lock(&self.peer.st);
        // Checked under `st`: `lose` and `shutdown` set their flags before
        // they take `st` to fail the queue, so nothing queued here is missed.
        self.check_alive()?;
        if !st.queue_is_empty() || !st.conn.can_send(data.len() + frame::PREFIX) {
            return Ok(false);
        }
        let msg = frame::one_part(self.t.core.buffers(), kind, tag, data);
        match st.submit(now, self.peer.rank, (msg, None))? {
            Queued::Done => {}
            // can_send said yes and nothing was queued: it cannot wait, but
            // if it did, its completion firing later is still correct.
            Queued::Waiting(_) => {}
        }
        st.flush(now, &self.t.io, &self.peer, usize::MAX);
        self.t.after_send(&st);
        Ok(true)
    }

    fn submit(&self, kind: Kind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>> {
        self.submit_as(kind, tag, data, false)
    }

    fn submit_gathered(
        &self,
        kind: Kind,
        tag: u64,
        data: Bytes,
    ) -> Result<Option<Arc<Completion>>> {
        self.submit_as(kind, tag, data, true)
    }

    fn submit_gathered_with(
        &self,
        kind: Kind,
        tag: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        {
            // Into the bundle already open for this burst: no buffer of its
            // own, no clock read, no timer to move.
            let mut st = lock(&self.peer.st);
            self.check_alive()?;
            if let Some(r) = st.append_held(kind, tag, len, fill) {
                drop(st);
                self.t.hold_bundle();
                return r;
            }
        }
        // No bundle to join: as any transport does.
        crate::transport::submit_filled(self, kind, tag, len, fill)
    }

    fn flush_gathered(&self) {
        let now = Instant::now();
        let mut st = lock(&self.peer.st);
        if st.holds_messages() {
            st.flush(now, &self.t.io, &self.peer, usize::MAX);
            self.t.after_send(&st);
        }
    }

    fn gathers(&self) -> bool {
        self.t.config.bundle
    }

    fn has_queued(&self) -> bool {
        lock(&self.peer.st).holds_messages()
    }
}

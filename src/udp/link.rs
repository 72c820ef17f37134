//! [`UdpLink`]: an endpoint's connection to one peer over `udp`.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::frame;
use super::peer::{Peer, Queued};
use super::UdpTransport;
use crate::completion::Completion;
use crate::sync::lock;
use crate::transport::{Kind, Link};
use crate::{Error, Rank, Result};

/// The link to one peer.
pub(crate) struct UdpLink {
    pub(crate) t: Arc<UdpTransport>,
    pub(crate) peer: Arc<Peer>,
}

impl UdpLink {
    fn check_alive(&self) -> Result<()> {
        if self.peer.is_lost() {
            Err(Error::PeerLost {
                rank: self.peer.rank,
                reason: "it was lost earlier".into(),
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
        self.check_alive()?;
        let now = Instant::now();
        let mut st = lock(&self.peer.st);
        if !st.queue_is_empty() || !st.conn.can_send(data.len() + frame::PREFIX) {
            return Ok(false);
        }
        let msg = frame::one_part(kind, tag, data);
        match st.submit(now, self.peer.rank, vec![msg])? {
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
        self.check_alive()?;
        let now = Instant::now();
        let parts = frame::encode(kind, tag, data);
        let mut st = lock(&self.peer.st);
        let r = st.submit(now, self.peer.rank, parts)?;
        st.flush(now, &self.t.io, &self.peer, usize::MAX);
        self.t.after_send(&st);
        Ok(match r {
            Queued::Done => None,
            Queued::Waiting(c) => Some(c),
        })
    }

    fn has_queued(&self) -> bool {
        !lock(&self.peer.st).queue_is_empty()
    }
}

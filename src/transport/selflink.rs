//! The `self` path: messages and put/get to one's own rank, without any
//! transport. Bounded like every other path: a full tag queue makes the
//! sender wait.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::core::completion::Completion;
use crate::core::fabric::Core;
use crate::sys::sync::lock;
use crate::transport::registry::{Entry, Job};
use crate::transport::{Kind, Link, Peer, Transport};
use crate::{Error, Rank, Result};

struct Queued {
    kind: Kind,
    tag: u64,
    data: Bytes,
    done: Arc<Completion>,
}

/// Link and transport to our own rank.
pub(crate) struct SelfLink {
    core: Weak<Core>,
    rank: Rank,
    /// Queued messages, and whether one is being delivered right now (then
    /// new messages queue behind it, keeping order).
    queue: Mutex<(VecDeque<Queued>, bool)>,
    /// Length of the queue, kept under its lock, so that progress, polled in
    /// every spin, need not take the lock when nothing waits (Release pairs
    /// with the Acquire load in `progress`).
    queued: AtomicUsize,
}

impl SelfLink {
    pub(crate) fn new(core: &Arc<Core>) -> Arc<SelfLink> {
        Arc::new(SelfLink {
            core: Arc::downgrade(core),
            rank: core.rank(),
            queue: Mutex::new((VecDeque::new(), false)),
            queued: AtomicUsize::new(0),
        })
    }

    fn core(&self) -> Result<Arc<Core>> {
        self.core.upgrade().ok_or(Error::Closed)
    }

    fn fits(core: &Core, kind: Kind, tag: u64, len: usize) -> bool {
        kind != Kind::User || core.has_room(tag, len)
    }
}

impl Link for SelfLink {
    fn peer(&self) -> Rank {
        self.rank
    }

    fn transport(&self) -> &'static str {
        "self"
    }

    fn try_send(&self, kind: Kind, tag: u64, data: &[u8]) -> Result<bool> {
        let core = self.core()?;
        {
            let mut q = lock(&self.queue);
            if !q.0.is_empty() || q.1 || !Self::fits(&core, kind, tag, data.len()) {
                return Ok(false);
            }
            q.1 = true;
        }
        core.on_message(self, self.rank, kind, tag, Bytes::copy_from_slice(data));
        lock(&self.queue).1 = false;
        Ok(true)
    }

    fn submit(&self, kind: Kind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>> {
        let core = self.core()?;
        let mut q = lock(&self.queue);
        if q.0.is_empty() && !q.1 && Self::fits(&core, kind, tag, data.len()) {
            q.1 = true;
            drop(q);
            core.on_message(self, self.rank, kind, tag, data);
            lock(&self.queue).1 = false;
            return Ok(None);
        }
        let done = Completion::new();
        q.0.push_back(Queued {
            kind,
            tag,
            data,
            done: done.clone(),
        });
        self.queued.store(q.0.len(), Ordering::Release);
        Ok(Some(done))
    }

    fn has_queued(&self) -> bool {
        !lock(&self.queue).0.is_empty()
    }
}

/// The registry's entry: always there, reaching this rank only.
#[linkme::distributed_slice(crate::transport::registry::TRANSPORTS)]
pub(crate) static ENTRY: Entry = Entry {
    rank: 0,
    name: "self",
    messages: true,
    one_sided: false,
    implicit: true,
    device_memory: false,
    reach: crate::transport::registry::Reach::ThisRank,
    not_built: None,
    probe: || Ok("always available: messages and one-sided operations to this process".into()),
    open: |core, _job: &Job| Ok(Some(SelfLink::new(core) as Arc<dyn Transport>)),
    alloc_shared: None,
};

#[async_trait]
impl Transport for SelfLink {
    fn name(&self) -> &'static str {
        "self"
    }

    fn address(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }

    fn reaches(&self, peer: &Peer<'_>) -> Result<bool> {
        Ok(peer.rank == self.rank)
    }

    fn connect(self: Arc<Self>, peers: &[Peer<'_>]) -> Result<Vec<(Rank, Arc<dyn Link>)>> {
        Ok(peers
            .iter()
            .filter(|p| p.rank == self.rank)
            .map(|p| (p.rank, self.clone() as Arc<dyn Link>))
            .collect())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn progress(&self) -> usize {
        if self.queued.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let Ok(core) = self.core() else { return 0 };
        let mut n = 0;
        loop {
            let item = {
                let mut q = lock(&self.queue);
                if q.1 {
                    break;
                }
                let item = match q.0.front() {
                    Some(h) if Self::fits(&core, h.kind, h.tag, h.data.len()) => q.0.pop_front(),
                    _ => None,
                };
                self.queued.store(q.0.len(), Ordering::Release);
                q.1 = item.is_some();
                item
            };
            let Some(m) = item else { break };
            core.on_message(self, self.rank, m.kind, m.tag, m.data);
            lock(&self.queue).1 = false;
            m.done.complete(Ok(()));
            n += 1;
        }
        n
    }

    fn arm(&self) -> bool {
        true
    }

    fn disarm(&self) {}

    async fn wait(&self, timeout: Duration) {
        // Nothing rings: queued self-sends wait for tag space, which the
        // dispatcher signals through the driver's `space` notification.
        tokio::time::sleep(timeout).await;
    }

    fn check_peers(&self) {}

    fn drained(&self) -> bool {
        lock(&self.queue).0.is_empty()
    }

    fn shutdown(&self) {
        let mut q = lock(&self.queue);
        self.queued.store(0, Ordering::Release);
        for m in q.0.drain(..) {
            m.done.complete(Err(Error::Closed));
        }
    }
}

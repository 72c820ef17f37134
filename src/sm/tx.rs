//! Send side of `sm`: the fragment pool, per-destination send queues, and the
//! [`Link`] a user's endpoint talks to.
//!
//! Order: only the head of a destination's queue may push fragments, and a
//! message's fragments are pushed back to back, so per-pair order holds and
//! the receiver never sees two messages interleaved on one ring.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;

use super::frag::{FragHeader, FIRST, FRAG_HEADER, LAST};
use super::segment::Layout;
use super::{SmPeer, SmTransport};
use crate::completion::Completion;
use crate::ring::{ConsumerState, ProducerState};
use crate::stats::Counters;
use crate::sync::lock;
use crate::transport::{Kind, Link};
use crate::{Error, Rank, Result};

const FREE: u32 = u32::MAX;

struct Queued {
    kind: Kind,
    tag: u64,
    data: Bytes,
    at: Cursor,
    done: Arc<Completion>,
}

/// Process-local send state (behind the transport's `tx` mutex).
pub(crate) struct TxState {
    layout: Layout,
    free_eager: Vec<u32>,
    free_max: Vec<u32>,
    /// For each fragment: the local rank holding it, or FREE.
    dest: Vec<u32>,
    /// Our producer state on each peer's inbound ring (indexed by peer local rank).
    prod: Vec<ProducerState>,
    /// Our consumer state on each return ring in our segment.
    ret: Vec<ConsumerState>,
    queues: Vec<VecDeque<Queued>>,
}

/// How far a message has been pushed.
#[derive(Default)]
struct Cursor {
    sent: usize,
    started: bool,
}

enum Pushed {
    Done,
    Blocked,
}

impl TxState {
    pub(crate) fn new(layout: &Layout, n: usize) -> TxState {
        let ec = layout.p.eager_count;
        TxState {
            layout: *layout,
            free_eager: (0..ec).rev().collect(),
            free_max: (ec..ec + layout.p.max_count).rev().collect(),
            dest: vec![FREE; layout.frags()],
            prod: vec![ProducerState::default(); n],
            ret: vec![ConsumerState::default(); n],
            queues: (0..n).map(|_| VecDeque::new()).collect(),
        }
    }

    fn eager_payload(&self) -> usize {
        self.layout.p.eager_size as usize - FRAG_HEADER
    }

    /// Take back fragments peers returned. Returns how many.
    fn reclaim(&mut self, t: &SmTransport) -> usize {
        let mut n = 0;
        for p in t.peer_list().iter().flatten() {
            let ring = t.seg.returns(p.local);
            let mut st = self.ret[p.local as usize];
            loop {
                match ring.peek(&mut st) {
                    Ok(Some(off)) => {
                        ring.advance(&mut st);
                        match self.layout.frag_index(off) {
                            Some(i) if self.dest[i] == p.local => {
                                self.free(i);
                                n += 1;
                            }
                            _ => {
                                Counters::bump(&t.core.counters.bad_frames);
                                tracing::warn!(
                                    peer = p.rank,
                                    "peer returned a fragment it did not hold"
                                );
                            }
                        }
                    }
                    Ok(None) => break,
                    Err(_) => {
                        Counters::bump(&t.core.counters.bad_frames);
                        break;
                    }
                }
            }
            self.ret[p.local as usize] = st;
        }
        n
    }

    fn free(&mut self, i: usize) {
        self.dest[i] = FREE;
        if i < self.layout.p.eager_count as usize {
            self.free_eager.push(i as u32);
        } else {
            self.free_max.push(i as u32);
        }
    }

    fn alloc(&mut self, t: &SmTransport, want_eager: bool) -> Option<usize> {
        let take = |s: &mut Self| {
            let (a, b) = if want_eager {
                (&mut s.free_eager, &mut s.free_max)
            } else {
                (&mut s.free_max, &mut s.free_eager)
            };
            a.pop().or_else(|| b.pop()).map(|i| i as usize)
        };
        take(self).or_else(|| {
            self.reclaim(t);
            take(self)
        })
    }

    /// Push as much of a message as fragments allow.
    fn push(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: &[u8],
        at: &mut Cursor,
    ) -> Result<Pushed> {
        let total = data.len();
        let ring = peer.seg.inbound(t.local_rank());
        let mut pushed = false;
        let r = loop {
            if at.started && at.sent == total {
                break Ok(Pushed::Done);
            }
            let rem = total - at.sent;
            let Some(i) = self.alloc(t, rem <= self.eager_payload()) else {
                break Ok(Pushed::Blocked);
            };
            let (off, size) = self.layout.frag(i);
            let n = rem.min(size - FRAG_HEADER);
            let mut flags = 0;
            if !at.started {
                flags |= FIRST;
            }
            if at.sent + n == total {
                flags |= LAST;
            }
            let h = FragHeader {
                kind,
                flags,
                len: n as u32,
                tag,
                total: total as u64,
            };
            let raw = t.seg.raw();
            raw.write(off, &h.encode())
                .and_then(|_| raw.write(off + FRAG_HEADER as u64, &data[at.sent..at.sent + n]))
                .map_err(|e| Error::Misuse(format!("fragment outside our own segment: {e}")))?;
            match ring.push(&mut self.prod[peer.local as usize], off) {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    // Cannot happen with an honest peer: the ring holds every
                    // fragment we own. A peer that scribbled on it is cut off.
                    self.free(i);
                    break Err(Error::PeerMisbehaved {
                        rank: peer.rank,
                        what: "its inbound ring is corrupt".into(),
                    });
                }
            }
            self.dest[i] = peer.local;
            pushed = true;
            at.sent += n;
            at.started = true;
        };
        if pushed {
            t.notify(peer);
        }
        r
    }

    /// Send a borrowed message only if it fits in one fragment that is free
    /// now and nothing is queued ahead of it (the inline path).
    fn try_send(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: &[u8],
    ) -> Result<bool> {
        let max_payload = self.layout.p.max_size as usize - FRAG_HEADER;
        if data.len() > max_payload || !self.queues[peer.local as usize].is_empty() {
            return Ok(false);
        }
        match self.push(t, peer, kind, tag, data, &mut Cursor::default())? {
            Pushed::Done => Ok(true),
            // One fragment or none: Blocked means nothing was pushed.
            Pushed::Blocked => Ok(false),
        }
    }

    fn submit(
        &mut self,
        t: &SmTransport,
        peer: &SmPeer,
        kind: Kind,
        tag: u64,
        data: Bytes,
    ) -> Result<Option<Arc<Completion>>> {
        let mut at = Cursor::default();
        if self.queues[peer.local as usize].is_empty() {
            if let Pushed::Done = self.push(t, peer, kind, tag, &data, &mut at)? {
                return Ok(None);
            }
        }
        let done = Completion::new();
        self.queues[peer.local as usize].push_back(Queued {
            kind,
            tag,
            data,
            at,
            done: done.clone(),
        });
        Ok(Some(done))
    }

    /// Advance queued messages as fragments come back.
    pub(crate) fn progress(&mut self, t: &SmTransport) -> usize {
        let mut work = self.reclaim(t);
        for p in t.peer_list().iter().flatten() {
            let q = p.local as usize;
            while let Some(mut head) = self.queues[q].pop_front() {
                let r = self.push(t, p, head.kind, head.tag, &head.data, &mut head.at);
                match r {
                    Ok(Pushed::Done) => {
                        work += 1;
                        head.done.complete(Ok(()));
                    }
                    Ok(Pushed::Blocked) => {
                        self.queues[q].push_front(head);
                        break;
                    }
                    Err(e) => {
                        head.done.complete(Err(e));
                        work += 1;
                    }
                }
            }
        }
        work
    }

    /// Nothing to do: no returns waiting (queues wait on returns).
    pub(crate) fn looks_idle(&self, t: &SmTransport) -> bool {
        t.peer_list().iter().flatten().all(|p| {
            t.seg
                .returns(p.local)
                .looks_empty(&self.ret[p.local as usize])
        })
    }

    /// Every fragment is home and nothing is queued.
    pub(crate) fn drained(&self) -> bool {
        self.queues.iter().all(VecDeque::is_empty) && self.dest.iter().all(|d| *d == FREE)
    }

    /// Fail the lost peer's queue and take back the fragments it held.
    pub(crate) fn peer_lost(&mut self, peer: &SmPeer, reason: &str) {
        for q in self.queues[peer.local as usize].drain(..) {
            q.done.complete(Err(Error::PeerLost {
                rank: peer.rank,
                reason: reason.to_string(),
            }));
        }
        for i in 0..self.dest.len() {
            if self.dest[i] == peer.local {
                self.free(i);
            }
        }
    }
}

impl SmTransport {
    fn local_rank(&self) -> u32 {
        self.seg.local_rank
    }
}

/// An endpoint's connection to one same-node peer.
pub(crate) struct SmLink {
    pub(crate) t: Arc<SmTransport>,
    pub(crate) peer: Arc<SmPeer>,
}

impl SmLink {
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

impl Link for SmLink {
    fn peer(&self) -> Rank {
        self.peer.rank
    }

    fn transport(&self) -> &'static str {
        "sm"
    }

    fn try_send(&self, kind: Kind, tag: u64, data: &[u8]) -> Result<bool> {
        self.check_alive()?;
        lock(&self.t.tx).try_send(&self.t, &self.peer, kind, tag, data)
    }

    fn submit(&self, kind: Kind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>> {
        self.check_alive()?;
        lock(&self.t.tx).submit(&self.t, &self.peer, kind, tag, data)
    }

    fn map_remote(
        &self,
        key: &crate::region::RemoteKey,
    ) -> Option<Result<crate::region::MappedRegion>> {
        key.shm_pid?;
        Some(self.t.map_cached(key))
    }

    fn cma_pid(&self) -> Option<u32> {
        self.peer.cma.then_some(self.peer.seg.pid)
    }

    fn has_queued(&self) -> bool {
        !lock(&self.t.tx).queues[self.peer.local as usize].is_empty()
    }
}

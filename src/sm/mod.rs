//! `sm`: shared memory between processes on one node — the heir of Open MPI's
//! `btl_sm` (and of the host-memory half of `btl_smcuda`).
//!
//! Kept from the seed: one segment per process, per-pair
//! FIFOs of fragment *offsets* (never pointers) initialised by the receiver,
//! eager and max fragments from per-sender pools that the receiver returns,
//! messages larger than a fragment pipelined through several.
//!
//! Changed: the FIFOs are SPSC rings (one per sender→receiver pair, plus one
//! per receiver→sender pair for returns) instead of lock-protected MPSC
//! queues, so no lock is shared between processes; a full pool makes the
//! send future wait (`Poll::Pending`) instead of returning
//! `OUT_OF_RESOURCE`; the receiver parks on a doorbell that senders ring only
//! when it armed it; every offset and header read from a peer is validated;
//! a dead peer (pidfd) fails everything pending on it; regions made by
//! `alloc_region` are mapped by peers so put/get are one copy (UCX's
//! rkey_ptr idea). Segments and regions are sealed memory files with no
//! name, handed to peers as descriptors ([`share`]): no one can shrink
//! them under a mapping (a SIGBUS), and nothing is left in `/dev/shm`.
//!
//! Module map: [`segment`] (layout, header checks), [`share`] (handing
//! memory to peers), [`frag`] (fragment header), [`doorbell`], [`eager`]
//! (fragments over the rings: pool, push, reassembly), [`fbox`] and
//! [`fastpath`] (the fast box, and its send and receive), [`rendezvous`]
//! (single copy of large messages, with split copy's transport side),
//! [`adapt`] (single copy or fragments for mid-sized messages, whichever
//! measured cheaper),
//! [`link`] (the [`Link`] impl), [`tx`] and [`rx`] (send and receive
//! state, queues, progress).

pub(crate) mod adapt;
pub(crate) mod config;
pub(crate) mod doorbell;
mod eager;
mod fastpath;
pub(crate) mod fbox;
pub(crate) mod frag;
pub(crate) mod kind;
mod link;
pub(crate) mod region;
pub(crate) mod rendezvous;
pub(crate) mod rma;
pub(crate) mod rx;
pub(crate) mod segment;
pub(crate) mod share;
pub(crate) mod split;
pub(crate) mod stats;
pub(crate) mod tx;

use std::collections::HashMap;
use std::os::unix::net::UnixDatagram as StdDatagram;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub(crate) use frag::FRAG_BODY;

use crate::core::fabric::Core;
use crate::core::region::{KeyId, Mapped, RemoteKey};
use crate::sys::os::ProcWatch;
use crate::sys::sync::{lock, Ordering};
use crate::transport::registry::{Entry, Job};
use crate::transport::{Link, Loss, Peer, Transport};
use crate::{Error, Rank, Result};
use doorbell::{Bell, Doorbell};
use segment::{Expect, Params, Segment};

/// What a process publishes about its `sm` transport.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SmAddr {
    pub(crate) node: String,
    pub(crate) pid: u32,
    pub(crate) local_rank: u32,
    pub(crate) local_size: u32,
    /// The id our segment is fetched by from our share server.
    pub(crate) segment: [u8; 16],
    /// Our share server (`share::server`).
    pub(crate) share: [u8; 16],
    /// Our network namespace: the share server's socket (abstract
    /// namespace) reaches only peers in the same one.
    pub(crate) netns: String,
    /// Our pid namespace: the share server checks that the asker is the
    /// pid it published, which a peer in another pid namespace sees as
    /// another number.
    pub(crate) pidns: String,
    pub(crate) bell: Vec<u8>,
    /// Whether peers may copy our memory with process_vm_readv/writev.
    pub(crate) cma: bool,
}

/// One same-node peer.
pub(crate) struct SmPeer {
    pub(crate) rank: Rank,
    pub(crate) local: u32,
    pub(crate) seg: Segment,
    bell: Bell,
    watch: ProcWatch,
    /// Both sides allow cross-memory copies (cleared when a copy is refused).
    pub(crate) cma: AtomicBool,
    /// Split copies with this peer are on (cleared when it could not write
    /// a tail we offered).
    pub(crate) split: AtomicBool,
    /// We took a user message from this peer since our last fast-box send
    /// to it: the next send is likely a reply in a ping-pong, whose peer
    /// polls the box (see `fbox::FBox::push`'s prefetch).
    pub(crate) heard: AtomicBool,
    pub(crate) lost: AtomicBool,
    /// Why it was lost (set before `lost`).
    lost_reason: OnceLock<String>,
}

impl SmPeer {
    /// Whether the peer was declared lost (Acquire pairs with the AcqRel
    /// swap in `lose`, which happens before its queues are failed).
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The error of an operation on this peer once it is lost, with the
    /// cause it was lost for.
    pub(crate) fn lost_error(&self) -> Error {
        Error::PeerLost {
            rank: self.rank,
            reason: self
                .lost_reason
                .get()
                .cloned()
                .unwrap_or_else(|| "it was lost".into()),
        }
    }

    pub(crate) fn cma_ok(&self) -> bool {
        self.cma.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Lock a mutex unless another thread holds it; a poisoned lock is taken
/// (the data is consistent between statements, see `sync::lock`).
fn try_lock<T>(m: &Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// The `sm` transport of one process.
pub(crate) struct SmTransport {
    pub(crate) core: Arc<Core>,
    pub(crate) seg: Segment,
    local_rank: u32,
    bell: Doorbell,
    ringer: StdDatagram,
    /// Peers by local rank, set once at connect.
    pub(crate) peers: OnceLock<Vec<Option<Arc<SmPeer>>>>,
    pub(crate) tx: crate::sys::sync::SpinLock<tx::TxState>,
    /// `TxState::busy` as of the last change under `tx` (Release; progress
    /// loads it with Acquire to skip the send side, and its lock, when there
    /// is nothing to do).
    tx_busy: AtomicBool,
    pub(crate) rx: Mutex<rx::RxState>,
    /// Peers' shared regions we mapped, by key id.
    maps: Mutex<HashMap<KeyId, Mapped>>,
    /// Single-copy puts and gets we started (`rma.rs`).
    pub(crate) cma: rma::CmaOps,
    /// Our settings (`Config::sm`, as the fabric opened with them).
    pub(crate) config: config::SmConfig,
    /// What `Stats` reports of `sm`'s paths.
    pub(crate) counters: SmCounters,
}

/// `sm`'s own counters (reported in `Stats` by `add_stats`).
#[derive(Debug, Default)]
pub(crate) struct SmCounters {
    /// Written only under the `rx` lock (a load and a store: no locked
    /// instruction on the receive path); added to `Stats::recvs` too.
    pub(crate) fast_box_recvs: std::sync::atomic::AtomicU64,
    /// As `fast_box_recvs`, for `RxState::ring_direct`.
    pub(crate) direct_ring_recvs: std::sync::atomic::AtomicU64,
    pub(crate) rendezvous_sends: std::sync::atomic::AtomicU64,
    pub(crate) chosen_fragment_sends: std::sync::atomic::AtomicU64,
    pub(crate) split_tails_written: std::sync::atomic::AtomicU64,
    pub(crate) split_tails_taken_back: std::sync::atomic::AtomicU64,
    pub(crate) cma_puts: std::sync::atomic::AtomicU64,
    pub(crate) cma_gets: std::sync::atomic::AtomicU64,
    pub(crate) stale_segments_removed: std::sync::atomic::AtomicU64,
    pub(crate) unsealed_memory_refused: std::sync::atomic::AtomicU64,
}

impl SmTransport {
    /// Create our segment and doorbell. Removes leftovers of crashed jobs first.
    pub(crate) fn new(
        core: Arc<Core>,
        local_rank: u32,
        local_size: u32,
    ) -> Result<Arc<SmTransport>> {
        let removed = crate::sys::shm::remove_stale();
        if removed > 0 {
            tracing::info!("removed {removed} shared-memory files left by crashed jobs");
        }
        let counters = SmCounters::default();
        counters
            .stale_segments_removed
            .store(removed as u64, std::sync::atomic::Ordering::Relaxed);
        if local_rank >= local_size {
            return Err(Error::Config(format!(
                "local rank {local_rank} is not below local size {local_size}"
            )));
        }
        let c = &core.config().clone();
        let as_u32 = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| Error::Config(format!("{what} {v} is too large")))
        };
        let params = Params {
            local_size,
            eager_size: as_u32(c.sm.eager_size, "sm eager size")?,
            eager_count: as_u32(c.sm.eager_count, "sm eager count")?,
            max_size: as_u32(c.sm.max_size, "sm max size")?,
            max_count: as_u32(c.sm.max_count, "sm max count")?,
        };
        let id = crate::sys::os::random_bytes::<16>();
        let seg = Segment::create(&id, params, core.job_tag(), local_rank)?;
        let n = local_size as usize;
        let mut tx = tx::TxState::new(&seg.layout, n);
        let end = adapt::band_end(c.sm.cma_min, c.sm.adapt_max, c.sm.split_min);
        tx.adapt = adapt::Adapt::new(n, c.sm.cma_min, end);
        let rx = rx::RxState::new(n);
        Ok(Arc::new(SmTransport {
            core,
            seg,
            local_rank,
            bell: Doorbell::new()?,
            ringer: doorbell::ringer()?,
            peers: OnceLock::new(),
            tx: crate::sys::sync::SpinLock::new(tx),
            tx_busy: AtomicBool::new(false),
            rx: Mutex::new(rx),
            maps: Mutex::new(HashMap::new()),
            cma: rma::CmaOps::default(),
            config: c.sm.clone(),
            counters,
        }))
    }

    /// Our address for the exchange.
    fn sm_address(&self) -> Result<SmAddr> {
        Ok(SmAddr {
            node: crate::sys::os::node_id(),
            pid: crate::sys::os::pid(),
            local_rank: self.local_rank,
            local_size: self.seg.layout.p.local_size,
            segment: self.seg.id(),
            share: share::server()?,
            netns: crate::sys::os::net_namespace(),
            pidns: crate::sys::os::pid_namespace(),
            bell: self.bell.name().to_vec(),
            cma: crate::sys::os::cma_status().is_ok(),
        })
    }

    /// Whether a peer with this address can be reached through shared memory.
    fn reaches_addr(&self, a: &SmAddr) -> bool {
        a.node == crate::sys::os::node_id()
            && a.netns == crate::sys::os::net_namespace()
            && a.pidns == crate::sys::os::pid_namespace()
            && a.local_size == self.seg.layout.p.local_size
            && a.local_rank < a.local_size
            && a.local_rank != self.local_rank
    }

    /// Attach every reachable peer's segment; returns a link per peer rank.
    fn connect_addrs(
        self: &Arc<Self>,
        peers: &[(Rank, SmAddr)],
    ) -> Result<Vec<(Rank, Arc<dyn Link>)>> {
        let n = self.seg.layout.p.local_size as usize;
        let mut by_local: Vec<Option<Arc<SmPeer>>> = (0..n).map(|_| None).collect();
        let mut links: Vec<(Rank, Arc<dyn Link>)> = Vec::new();
        for (rank, a) in peers {
            let slot = &mut by_local[a.local_rank as usize];
            if slot.is_some() {
                return Err(Error::Config(format!(
                    "two ranks claim local rank {} on this node: check the launcher's local rank variables",
                    a.local_rank
                )));
            }
            let exp = Expect {
                job_tag: self.core.job_tag(),
                pid: a.pid,
                local_rank: a.local_rank,
                local_size: a.local_size,
            };
            let seg = Segment::attach(self.fetch_segment(*rank, a)?, &exp)?;
            if seg.layout != self.seg.layout {
                return Err(Error::Config(format!(
                    "rank {rank} uses other shared-memory sizes ({:?}) than this rank ({:?}): give every rank the same BTL_SM_* settings",
                    seg.layout.p, self.seg.layout.p
                )));
            }
            let peer = Arc::new(SmPeer {
                rank: *rank,
                local: a.local_rank,
                seg,
                bell: Bell::new(&a.bell)?,
                watch: ProcWatch::new(a.pid),
                cma: AtomicBool::new(a.cma && crate::sys::os::cma_status().is_ok()),
                split: AtomicBool::new(true),
                heard: AtomicBool::new(false),
                lost: AtomicBool::new(false),
                lost_reason: OnceLock::new(),
            });
            *slot = Some(peer.clone());
            links.push((
                *rank,
                Arc::new(link::SmLink {
                    t: self.clone(),
                    peer,
                }),
            ));
        }
        self.peers
            .set(by_local)
            .map_err(|_| Error::Misuse("sm transport connected twice".into()))?;
        Ok(links)
    }

    /// Fetch and map the segment of `rank` (address `a`) from its share
    /// server: sealed, or refused and counted.
    fn fetch_segment(&self, rank: Rank, a: &SmAddr) -> Result<crate::sys::shm::SharedMem> {
        let req = share::Request {
            kind: share::Kind::Segment,
            job_tag: self.core.job_tag(),
            id: a.segment,
        };
        let bad = |what: String| Error::PeerMisbehaved { rank, what };
        share::fetch(&a.share, a.pid, req, segment::HEADER_LEN).map_err(|e| match e {
            share::FetchError::Refused(r) => {
                if matches!(r, crate::sys::shm::Refused::Unsealed { .. }) {
                    self.counters
                        .unsealed_memory_refused
                        .fetch_add(1, Ordering::Relaxed);
                }
                bad(format!("segment: {r}"))
            }
            share::FetchError::Misbehaved(why) => bad(format!("segment: {why}")),
            share::FetchError::Unknown(why) => Error::Config(format!(
                "rank {rank}'s shared-memory segment cannot be had: {why}"
            )),
            share::FetchError::Os(e) => {
                Error::os(format!("fetching rank {rank}'s shared-memory segment"), e)
            }
        })
    }

    /// Run `f` on the send state, then publish whether it has work left.
    pub(crate) fn with_tx<R>(&self, f: impl FnOnce(&mut tx::TxState) -> R) -> R {
        let mut tx = self.tx.lock();
        let r = f(&mut tx);
        self.tx_busy
            .store(tx.busy(), std::sync::atomic::Ordering::Release);
        r
    }

    /// [`Link::try_send`] of a user message of up to
    /// [`fbox::MAX_PAYLOAD`] bytes into `peer`'s fast box, under `tx`:
    /// `None` when the box may not be used now (its user channel has
    /// messages queued or in its ring, which go first) or the send side
    /// caught a peer misbehaving (the general path then runs, and reports);
    /// else what `try_send` returns. `tx_busy` is not recomputed: a push
    /// to the box queues nothing and takes no fragment.
    #[inline]
    pub(crate) fn try_fbox_send(
        &self,
        peer: &SmPeer,
        tag: u64,
        data: &[u8],
    ) -> Option<Result<bool>> {
        let mut tx = self.tx.lock();
        if !tx.misbehaved.is_empty() {
            return None;
        }
        // The general path's own check: closed, lost, nothing queued ahead.
        match tx.one_ready(self, peer, kind::Kind::User, data.len()) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => return Some(Err(e)),
        }
        match tx.via_fbox(self, peer, false, tag, data) {
            Ok(Some(sent)) => Some(Ok(sent)),
            Ok(None) => None,
            Err(e) => {
                // `corrupt` noted the peer: progress must run to cut it off.
                self.tx_busy
                    .store(true, std::sync::atomic::Ordering::Release);
                Some(Err(e))
            }
        }
    }

    pub(crate) fn peer_list(&self) -> &[Option<Arc<SmPeer>>] {
        self.peers.get().map(Vec::as_slice).unwrap_or(&[])
    }

    /// Whether `peer` armed its doorbell, without the fence of
    /// [`notify`](Self::notify) (a hint: it may be arming now).
    pub(crate) fn peer_asleep(&self, peer: &SmPeer) -> bool {
        peer.seg.armed().load(Ordering::Relaxed) != 0
    }

    /// After making data visible to `peer`, ring its doorbell if it sleeps.
    pub(crate) fn notify(&self, peer: &SmPeer) {
        // The protocol (and its loom model) lives in crate::sys::ring.
        if crate::sys::ring::should_ring(peer.seg.armed()) {
            peer.bell.ring(&self.ringer);
        }
    }

    /// Declare a peer lost: fail its queues, reclaim its fragments, tell the
    /// core. Must not be called with `tx` or `rx` held.
    pub(crate) fn lose(&self, peer: &SmPeer, reason: &str, how: Loss) {
        // The first cause wins; readers that see `lost` see it.
        let _ = peer.lost_reason.set(reason.to_string());
        if peer.lost.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        if how == Loss::Closed {
            tracing::debug!(peer = peer.rank, "shared-memory peer left: {reason}");
        } else {
            tracing::warn!(peer = peer.rank, "shared-memory peer lost: {reason}");
        }
        if how == Loss::Misbehaved {
            // Tell the peer, which still runs, so its own operations on us
            // fail instead of waiting for fragments we will never return.
            self.seg.refused(peer.local).store(1, Ordering::Release);
        }
        self.with_tx(|tx| tx.peer_lost(self, peer, how));
        lock(&self.rx).peer_lost(peer.local);
        self.cma.peer_lost(peer.rank, reason, how == Loss::Crashed);
        self.core.on_peer_lost(peer.rank, reason, how);
    }

    /// Cut off the peers that the send or receive path caught misbehaving.
    /// Must not be called with `tx` or `rx` held.
    fn cut_off_misbehaved(&self) {
        let mut bad = self.with_tx(|tx| std::mem::take(&mut tx.misbehaved));
        bad.append(&mut lock(&self.rx).misbehaved);
        for (local, why) in bad {
            if let Some(Some(p)) = self.peer_list().get(local as usize) {
                self.lose(p, &why, Loss::Misbehaved);
            }
        }
    }

    /// Map (or reuse a mapping of) a peer's shared region.
    pub(crate) fn map_cached(&self, key: &RemoteKey) -> Result<Mapped> {
        if let Some(m) = lock(&self.maps).get(&key.id) {
            if m.check_live().is_ok() {
                return Ok(m.clone());
            }
        }
        let m = region::open(
            key,
            self.core.job_tag(),
            &self.counters.unsealed_memory_refused,
        );
        let mut maps = lock(&self.maps);
        maps.retain(|_, m| m.check_live().is_ok());
        if let Ok(m) = &m {
            maps.insert(key.id, m.clone());
        }
        m
    }
}

/// Decode a peer's `sm` address.
pub(crate) fn decode_addr(peer: &Peer<'_>) -> Result<SmAddr> {
    postcard::from_bytes(peer.addr).map_err(|e| {
        Error::Bootstrap(format!(
            "rank {} published an unreadable sm address: {e}",
            peer.rank
        ))
    })
}

/// Create, seal and map a small memory file, and start the share server.
fn probe() -> std::result::Result<String, String> {
    let made =
        crate::sys::shm::SharedMem::create(c"abtl-probe", 4096).and_then(|_| share::server());
    match made {
        Ok(_) => {
            Ok("sealed memory files can be made and shared: same-node peers share memory".into())
        }
        Err(e) => Err(format!(
            "{e}; sm needs memfd_create with sealing (Linux 3.17 or later)"
        )),
    }
}

/// The registry's entry: opened when this node runs more than one rank.
#[linkme::distributed_slice(crate::transport::registry::TRANSPORTS)]
pub(crate) static ENTRY: Entry = Entry {
    rank: 20,
    name: "sm",
    messages: true,
    one_sided: true,
    implicit: false,
    device_memory: false,
    reach: crate::transport::registry::Reach::Node,
    not_built: None,
    probe,
    open: |core, job: &Job| {
        if job.local_size < 2 {
            return Ok(None);
        }
        let t = SmTransport::new(core.clone(), job.local_rank, job.local_size)?;
        Ok(Some(t as Arc<dyn Transport>))
    },
    alloc_shared: Some(|id, len, owner, job_tag| {
        let (raw, keep, handle) = region::create(id, len, owner, job_tag)?;
        Ok((raw, Box::new(keep), handle))
    }),
};

#[async_trait]
impl Transport for SmTransport {
    fn name(&self) -> &'static str {
        "sm"
    }

    fn address(&self) -> Result<Vec<u8>> {
        postcard::to_allocvec(&self.sm_address()?)
            .map_err(|e| Error::Bootstrap(format!("encoding our sm address: {e}")))
    }

    fn reaches(&self, peer: &Peer<'_>) -> Result<bool> {
        Ok(self.reaches_addr(&decode_addr(peer)?))
    }

    fn connect(self: Arc<Self>, peers: &[Peer<'_>]) -> Result<Vec<(Rank, Arc<dyn Link>)>> {
        let addrs = peers
            .iter()
            .map(|p| Ok((p.rank, decode_addr(p)?)))
            .collect::<Result<Vec<_>>>()?;
        self.connect_addrs(&addrs)
    }

    fn add_stats(&self, s: &mut crate::Stats) {
        let c = &self.counters;
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let m = &mut s.sm;
        m.fast_box_recvs = g(&c.fast_box_recvs);
        m.direct_ring_recvs = g(&c.direct_ring_recvs);
        m.rendezvous_sends = g(&c.rendezvous_sends);
        m.chosen_fragment_sends = g(&c.chosen_fragment_sends);
        m.split_tails_written = g(&c.split_tails_written);
        m.split_tails_taken_back = g(&c.split_tails_taken_back);
        m.cma_puts = g(&c.cma_puts);
        m.cma_gets = g(&c.cma_gets);
        m.stale_segments_removed = g(&c.stale_segments_removed);
        m.unsealed_memory_refused = g(&c.unsealed_memory_refused);
        m.share_requests_refused = share::refused_requests();
        s.recvs = s
            .recvs
            .wrapping_add(m.fast_box_recvs)
            .wrapping_add(m.direct_ring_recvs);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn takes_direct(&self) -> bool {
        true
    }

    fn take_direct(
        &self,
        tag: u64,
        queued: &std::sync::atomic::AtomicUsize,
        buf: &mut Vec<u8>,
        more: &mut crate::core::dispatch::More<'_>,
        looks: u32,
    ) -> Option<Rank> {
        // Our own sends wait on progress: look once only.
        let looks = if self.tx_busy.load(Ordering::Relaxed) {
            1
        } else {
            looks
        };
        try_lock(&self.rx)?.take_direct(self, tag, queued, buf, more, looks)
    }

    fn progress(&self) -> usize {
        let mut work = 0;
        let mut bad = false;
        if let Some(mut rx) = try_lock(&self.rx) {
            work += rx.progress(self);
            bad |= !rx.misbehaved.is_empty();
        }
        if self.tx_busy.load(std::sync::atomic::Ordering::Acquire) {
            if let Some(mut tx) = self.tx.try_lock() {
                work += tx.progress(self);
                bad |= !tx.misbehaved.is_empty();
                self.tx_busy
                    .store(tx.busy(), std::sync::atomic::Ordering::Release);
            }
        }
        if bad {
            self.cut_off_misbehaved();
        }
        work
    }

    fn arm(&self) -> bool {
        crate::sys::ring::arm(self.seg.armed());
        let rx_idle = lock(&self.rx).looks_idle(self);
        let tx_idle = self.tx.lock().looks_idle(self);
        if rx_idle && tx_idle {
            true
        } else {
            self.disarm();
            false
        }
    }

    fn disarm(&self) {
        self.seg.armed().store(0, Ordering::Relaxed);
    }

    async fn wait(&self, timeout: Duration) {
        self.bell.wait(timeout).await;
    }

    fn check_peers(&self) {
        for p in self.peer_list().iter().flatten() {
            if p.is_lost() {
                continue;
            }
            let closed = p.seg.state().load(Ordering::Acquire) == segment::STATE_CLOSED;
            if p.watch.exited() {
                if closed {
                    self.lose(p, "the peer closed its fabric and exited", Loss::Closed);
                } else {
                    self.lose(p, "the peer process died", Loss::Crashed);
                }
            } else if closed {
                self.lose(p, "the peer closed its fabric", Loss::Closed);
            } else if p.seg.refused(self.local_rank).load(Ordering::Acquire) != 0 {
                self.lose(
                    p,
                    "the peer cut us off after a protocol error",
                    Loss::Misbehaved,
                );
            }
        }
    }

    fn drained(&self) -> bool {
        self.with_tx(|tx| tx.drained(self))
    }

    fn shutdown(&self) {
        self.seg
            .state()
            .store(segment::STATE_CLOSED, Ordering::Release);
        self.seg.withdraw();
        self.with_tx(tx::TxState::fail_all);
        self.cma.close();
    }
}

//! [`Fabric`]: one per process; owns the transports, their progress tasks,
//! the tag dispatcher, the region table and the RMA bookkeeping.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::core::dispatch::{Dispatcher, Message, Receiver};
use crate::core::endpoint::Endpoint;
use crate::core::region::{MemoryRegion, RegionTable};
use crate::core::rma::{PutSrc, Rma};
use crate::exchange::AddressExchange;

use crate::core::stats::{Counters, Stats};
use crate::sys::sync::lock;
use crate::transport::registry::{self, Job};
use crate::transport::{Kind, Link, Loss, Peer, Published, Transport};
use crate::{Error, Rank, Result, Tag};

/// How long `close` lets its goodbye messages be acknowledged.
const CLOSE_GRACE: Duration = Duration::from_millis(200);

/// A 64-bit FNV-1a hash, used to derive non-secret tags from the job key.
fn fnv(seed: u64, data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The tag written into segments and region files to tell jobs apart.
pub(crate) fn job_tag(key: &[u8; 32]) -> [u64; 2] {
    [fnv(1, key), fnv(2, key)]
}

/// HMAC-SHA256 under `key` of `parts`, each preceded by its length (so
/// that no two lists of parts give the same input).
fn hmac_parts(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    use hmac::Mac;
    let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// State shared by the fabric, its endpoints and its transports.
///
/// Its fields are the core's own; a transport reaches the core only
/// through the methods below (see the list in `crate::transport`'s docs).
pub(crate) struct Core {
    pub(super) rank: Rank,
    pub(super) size: u32,
    pub(super) config: Config,
    pub(super) job_tag: [u64; 2],
    /// Derived from the job key, never the key itself: the root of the
    /// keys transports derive ([`Core::derive_key`]).
    pub(super) key_root: [u8; 32],
    pub(super) dispatcher: Arc<Dispatcher>,
    pub(super) rma: Rma,
    pub(super) counters: Arc<Counters>,
    /// Recycled buffers for large received messages.
    pub(super) buffers: Arc<crate::core::bufpool::BufPool>,
    pub(super) closed: Arc<AtomicBool>,
    pub(super) closing: Arc<Notify>,
    links: RwLock<Vec<Option<Route>>>,
    sync: Mutex<SyncState>,
    sync_notify: Notify,
    /// Per rank: declared lost (read on the one-sided fast path, which
    /// must not take `sync`'s lock).
    gone: Vec<AtomicBool>,
    /// Messages of ours whose bytes peers have yet to take.
    pub(super) lending: crate::core::lend::Lending,
    /// This core, for what a received lent message keeps to answer it.
    me: std::sync::Weak<Core>,
    /// The opened transports by name, for their control messages.
    controls: RwLock<Vec<(&'static str, std::sync::Weak<dyn Transport>)>>,
}

/// The longest transport name a control message carries.
const MAX_CONTROL_NAME: usize = 32;

/// A control message's transport name and payload.
pub(crate) fn split_control(data: &[u8]) -> std::result::Result<(&[u8], &[u8]), String> {
    let (&n, rest) = data.split_first().ok_or("an empty control message")?;
    let n = n as usize;
    if n > MAX_CONTROL_NAME || rest.len() < n {
        return Err("a malformed control message".into());
    }
    Ok(rest.split_at(n))
}

/// One lost rank, as barriers and closes report it.
struct Lost {
    /// It closed its fabric (a bystander of an earlier loss, perhaps).
    closed: bool,
    /// Its place in the order of losses.
    seq: u64,
    why: String,
}

impl SyncState {
    /// The rank to blame among the lost ones `need` picks: one that did
    /// not leave in order before one that did, then the one lost first.
    fn culprit(&self, need: impl Fn(Rank) -> bool) -> Option<Error> {
        self.lost
            .iter()
            .filter(|(r, _)| need(**r))
            .min_by_key(|(_, l)| (l.closed, l.seq))
            .map(|(r, l)| Error::PeerLost {
                rank: *r,
                reason: l.why.clone(),
            })
    }
}

#[derive(Default)]
struct SyncState {
    barrier: HashMap<u64, HashSet<Rank>>,
    byes: HashSet<Rank>,
    /// Lost ranks: whether they left in order, the order they were lost
    /// in, and why.
    lost: HashMap<Rank, Lost>,
}

impl Core {
    /// Whether the fabric is closed (or closing).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// This process's rank.
    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    /// Number of ranks in the job.
    pub(crate) fn size(&self) -> u32 {
        self.size
    }

    /// The fabric's settings (a transport reads its own part at open).
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// Have `flag` raised whenever a receiver makes room that was refused
    /// (see `Dispatcher::on_room`): for a transport that holds messages
    /// for room (`rdma`).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn on_room(&self, flag: Arc<AtomicBool>) {
        self.dispatcher.on_room(flag);
    }

    /// The tag that tells this job's shared files apart from others'.
    pub(crate) fn job_tag(&self) -> [u64; 2] {
        self.job_tag
    }

    /// Fail emulated one-sided operations a peer never answers (see
    /// [`Rma::expire`](crate::core::rma::Rma::expire)): a peer whose link
    /// still holds data of ours counts as heard from, since its answer may
    /// be waiting behind that data.
    pub(crate) fn expire_answers(&self, after: std::time::Duration) {
        self.answer_deferred();
        if !self.rma.any_pending() {
            return;
        }
        let links = self.links.read().unwrap_or_else(|e| e.into_inner());
        for (peer, route) in links.iter().enumerate() {
            if let Some(r) = route {
                if r.rma.has_queued() || r.msg.has_queued() {
                    self.rma.heard_now(peer as Rank);
                }
            }
        }
        drop(links);
        self.rma.expire(after);
    }

    /// A secret key for `purpose`, derived from the job key and `parts`:
    /// the same in every rank that holds the job key and passes the same
    /// parts, and unguessable to anyone else (HMAC-SHA256).
    pub(crate) fn derive_key(&self, purpose: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        let mut all = Vec::with_capacity(parts.len() + 1);
        all.push(purpose);
        all.extend_from_slice(parts);
        hmac_parts(&self.key_root, &all)
    }

    /// The fabric's counters.
    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Recycled buffers for received messages and requests.
    pub(crate) fn buffers(&self) -> &Arc<crate::core::bufpool::BufPool> {
        &self.buffers
    }

    /// Whether a user message of `len` bytes for `tag` may be taken now
    /// (else leave it where it is: backpressure).
    #[inline]
    pub(crate) fn has_room(&self, tag: Tag, len: usize) -> bool {
        self.dispatcher.has_room(tag, len)
    }

    /// See `Dispatcher::lent_taken`.
    pub(crate) fn lent_taken(&self, tag: u64) -> Option<Rank> {
        self.dispatcher.lent_taken(tag)
    }

    /// Deliver a user message of `len` bytes that `make` builds or copies
    /// into a waiting receiver's buffer (see `Dispatcher::deliver_payload`).
    pub(crate) fn deliver_with<P: crate::core::dispatch::Payload>(
        &self,
        src: Rank,
        tag: u64,
        len: usize,
        make: P,
    ) {
        self.counters.add(crate::core::stats::Hot::Recvs);
        self.dispatcher.deliver_payload(src, tag, len, make);
    }

    /// Deliver a run of user messages under one dispatcher lock (see
    /// `Dispatcher::offers`).
    #[inline]
    pub(crate) fn offers<R>(
        &self,
        f: impl FnOnce(&mut crate::core::dispatch::Offers<'_>) -> R,
    ) -> R {
        self.dispatcher.offers(f)
    }

    /// Emulate a put of `src` into the peer's region `key` at `offset`
    /// over `link`'s messages, completing `done` (for a transport whose
    /// native attempt was refused).
    pub(crate) fn emulate_put(
        &self,
        link: &dyn Link,
        key: &crate::core::region::KeyId,
        offset: u64,
        src: (crate::sys::mem::RawBuf, u64, usize),
        done: Arc<crate::core::completion::Completion>,
    ) {
        self.counters.add(crate::core::stats::Hot::EmulatedPuts);
        let (raw, at, len) = src;
        self.rma
            .start_put(link, key, offset, (PutSrc::Host(raw), at, len), done);
    }

    /// Emulate a get into `dst` from the peer's region `key` at `offset`
    /// over `link`'s messages, completing `done`.
    pub(crate) fn emulate_get(
        &self,
        link: &dyn Link,
        key: &crate::core::region::KeyId,
        offset: u64,
        dst: (Arc<crate::core::region::RegionInner>, u64, usize),
        done: Arc<crate::core::completion::Completion>,
    ) {
        self.counters.add(crate::core::stats::Hot::EmulatedGets);
        let d = done.clone();
        if let Err(e) = self.rma.start_get(link, key, offset, dst, Some(done)) {
            d.complete(Err(e));
        }
    }

    /// A put or get with device memory on our side taken through the host
    /// (no transport carries it on the device to that peer, or IPC with it
    /// was refused): emulated over `link`, a put's source read out of
    /// `local` (region, offset, length) through the device first, a get's
    /// answer written into it through the device. `done` completes it;
    /// `None` makes a put implicit (the next flush reports it).
    pub(crate) fn emulate_staged(
        &self,
        link: &dyn Link,
        local: (&Arc<crate::core::region::RegionInner>, u64, usize),
        key: &crate::core::region::KeyId,
        offset: u64,
        put: bool,
        done: Option<Arc<crate::core::completion::Completion>>,
    ) -> Result<()> {
        let (region, at, len) = local;
        Counters::bump(&self.counters.staged_device_ops);
        if put {
            self.counters.add(crate::core::stats::Hot::EmulatedPuts);
            // Read through the device straight into each request (into a
            // fragment of `sm`, where it builds them in place) before this
            // returns.
            let src = (PutSrc::Region(region.clone()), at, len);
            match done {
                Some(d) => self.rma.start_put(link, key, offset, src, d),
                None => self.rma.put_implicit(link, key, offset, src)?,
            }
        } else {
            self.counters.add(crate::core::stats::Hot::EmulatedGets);
            self.rma
                .start_get(link, key, offset, (region.clone(), at, len), done)?;
        }
        Ok(())
    }

    /// The link that carries messages to `rank`.
    pub(crate) fn link(&self, rank: Rank) -> Option<Arc<dyn Link>> {
        self.route(rank).map(|r| r.msg)
    }

    /// The links to `rank`.
    pub(crate) fn route(&self, rank: Rank) -> Option<Route> {
        self.links
            .read()
            .ok()
            .and_then(|l| l.get(rank as usize).cloned().flatten())
    }

    /// Whether `rank` was declared lost, without a lock.
    #[inline]
    pub(crate) fn is_gone(&self, rank: Rank) -> bool {
        self.gone
            .get(rank as usize)
            .is_some_and(|g| g.load(Ordering::Acquire))
    }

    /// Why `rank` was declared lost, if it was.
    pub(crate) fn lost_reason(&self, rank: Rank) -> Option<String> {
        lock(&self.sync).lost.get(&rank).map(|l| l.why.clone())
    }

    /// A complete user message arrived from `src` (no link needed).
    pub(crate) fn deliver(&self, src: Rank, tag: u64, data: Bytes) {
        self.counters.add(crate::core::stats::Hot::Recvs);
        self.dispatcher.deliver(Message::carried(src, tag, data));
    }

    /// A user message from `src` whose bytes lie in a transport's buffer,
    /// delivered by copy: into a receiver's waiting buffer when one takes
    /// it, else into a pooled buffer of its own (no allocation either way
    /// once the pool is warm).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn deliver_copy(&self, src: Rank, tag: u64, bytes: &[u8]) {
        let make = SliceCopy {
            bytes,
            pool: self.buffers(),
        };
        self.deliver_with(src, tag, bytes.len(), make);
    }

    /// [`on_message`](Self::on_message) of a message whose bytes stay
    /// where they arrived (`body`: a fragment of `sm`, valid until this
    /// returns). A put's request or part and a get's answer land in their
    /// region from there (device memory through the device); any other
    /// kind is copied out first.
    pub(crate) fn on_message_in_place(
        &self,
        link: &dyn Link,
        src: Rank,
        kind: Kind,
        tag: u64,
        body: crate::sys::mem::RawBuf,
    ) {
        match kind {
            Kind::PutReq | Kind::PutPart | Kind::GetResp => {
                self.rma.handle_in_place(link, src, kind, tag, body)
            }
            _ => {
                let mut data = Vec::with_capacity(body.len());
                if body.read_into(0, body.len(), &mut data).is_ok() {
                    self.on_message(link, src, kind, tag, Bytes::from(data));
                }
            }
        }
    }

    /// A complete message arrived from `src`.
    pub(crate) fn on_message(&self, link: &dyn Link, src: Rank, kind: Kind, tag: u64, data: Bytes) {
        match kind {
            Kind::User => self.deliver(src, tag, data),
            Kind::PutReq
            | Kind::PutAck
            | Kind::GetReq
            | Kind::GetResp
            | Kind::FlushReq
            | Kind::FlushAck
            | Kind::PutPart
            | Kind::AtomicReq
            | Kind::AtomicResp => self.rma.handle(link, src, kind, tag, data),
            Kind::Control => {
                if let Err(what) = self.control_arrived(src, &data) {
                    self.misbehaved(src, &what);
                }
            }
            Kind::Lent => self.lent_arrived(src, tag, &data),
            Kind::LentDone => {
                if let Err(what) = self.lending.answered(src, tag, &data) {
                    self.misbehaved(src, &what);
                }
            }
            Kind::Barrier => {
                lock(&self.sync).barrier.entry(tag).or_default().insert(src);
                self.sync_notify.notify_waiters();
            }
            Kind::Bye if tag == ABANDONED => {
                // It dropped its fabric without closing it: nothing it owed
                // us will come (answers to our puts and gets, its barrier
                // arrivals). Fail what waits on it now, not at the timeout.
                self.on_peer_lost(
                    src,
                    "it dropped its fabric without closing it",
                    Loss::Closed,
                );
            }
            Kind::Bye => {
                // It closed: it takes none of our lent messages now.
                self.lending.fail(Some(src), || Error::Declined {
                    rank: src,
                    why: "the receiver closed its fabric".into(),
                });
                lock(&self.sync).byes.insert(src);
                self.sync_notify.notify_waiters();
            }
        }
    }

    /// A lent message's announcement from `src` on `tag`: queued for the
    /// tag's receiver like any message (and in order with them), to be
    /// answered when taken or dropped. A malformed one is counted and
    /// dropped.
    fn lent_arrived(&self, src: Rank, tag: Tag, data: &[u8]) {
        match crate::core::lend::Announce::decode(src, data) {
            Ok(ann) => {
                let lent = Arc::new(crate::core::lend::Borrowed::new(src, ann, self.me.clone()));
                self.lending.hold(&lent);
                self.counters.add(crate::core::stats::Hot::Recvs);
                self.dispatcher.deliver(Message::lent(src, tag, lent));
            }
            Err(what) => self.misbehaved(src, &what),
        }
    }

    /// Send the declines of lent messages that waited for their copies
    /// (see `Lending::defer`); called on the heartbeat.
    pub(crate) fn answer_deferred(&self) {
        self.lending.sweep();
        for (src, id, why) in self.lending.ready_declines() {
            self.answer_lent(src, id, &crate::core::lend::Answer::Declined(why));
        }
    }

    /// Answer `src`'s lent message `id` with `a`.
    pub(crate) fn answer_lent(&self, src: Rank, id: u64, a: &crate::core::lend::Answer) {
        let Some(link) = self.link(src) else {
            return;
        };
        if let Err(e) = link.submit(Kind::LentDone, id, Bytes::from(a.encode())) {
            tracing::debug!("answering lent message {id} of rank {src}: {e}");
        }
    }

    /// Send `payload` to `peer`'s transport named `from` (a control
    /// message of a transport without messages of its own), over the
    /// pair's message link.
    pub(crate) fn send_control(
        &self,
        peer: Rank,
        from: &'static str,
        payload: &[u8],
    ) -> Result<()> {
        if from.len() > MAX_CONTROL_NAME {
            return Err(Error::Misuse(format!("transport name {from} is too long")));
        }
        let link = self.link(peer).ok_or_else(|| {
            Error::Misuse(format!(
                "no message link to rank {peer} for {from}'s control message"
            ))
        })?;
        let mut b = Vec::with_capacity(1 + from.len() + payload.len());
        b.push(from.len() as u8);
        b.extend_from_slice(from.as_bytes());
        b.extend_from_slice(payload);
        link.submit(Kind::Control, 0, Bytes::from(b)).map(drop)
    }

    /// A control message from `src`: handed to the transport it names.
    fn control_arrived(&self, src: Rank, data: &[u8]) -> std::result::Result<(), String> {
        let (name, payload) = split_control(data)?;
        let t = self
            .controls
            .read()
            .ok()
            .and_then(|c| {
                c.iter()
                    .find(|(t, _)| t.as_bytes() == name)
                    .map(|(_, w)| w.clone())
            })
            .and_then(|w| w.upgrade());
        match t {
            Some(t) => t.on_control(src, payload),
            None => Err(format!(
                "a control message for transport {:?}, not open here",
                String::from_utf8_lossy(name)
            )),
        }
    }

    /// `src` sent something malformed: counted, logged, dropped.
    fn misbehaved(&self, src: Rank, what: &str) {
        Counters::bump(&self.counters.bad_frames);
        tracing::warn!("rank {src} sent {what}; dropped");
    }

    /// The live region of ours behind key id `key` if `off..off+len` is
    /// inside it (a refusal is counted): for a transport that serves a
    /// one-sided request itself.
    pub(crate) fn target_region(
        &self,
        key: &crate::core::region::KeyId,
        off: u64,
        len: usize,
    ) -> std::result::Result<Arc<crate::core::region::RegionInner>, crate::AccessError> {
        self.rma.target(key, off, len)
    }

    /// A peer is gone: fail everything pending on it. Receivers hear of it
    /// (one `Err(PeerLost)` each) unless it left in order.
    pub(crate) fn on_peer_lost(&self, rank: Rank, reason: &str, how: Loss) {
        if let Some(g) = self.gone.get(rank as usize) {
            g.store(true, Ordering::Release);
        }
        if how != Loss::Closed {
            Counters::bump(&self.counters.peers_lost);
        }
        {
            let mut s = lock(&self.sync);
            let seq = s.lost.len() as u64;
            // The first cause wins (a later "closed" must not hide a crash).
            s.lost.entry(rank).or_insert_with(|| Lost {
                closed: how == Loss::Closed,
                seq,
                why: reason.to_string(),
            });
        }
        self.rma.peer_lost(rank, reason);
        self.lending.fail(Some(rank), || Error::PeerLost {
            rank,
            reason: reason.to_string(),
        });
        if how != Loss::Closed {
            self.dispatcher.peer_lost(rank, reason);
        }
        self.sync_notify.notify_waiters();
    }

    /// The error naming the rank to blame for a collective's failure, if
    /// any rank is lost: one that did not leave in order, else the first.
    pub(crate) fn first_lost(&self) -> Option<Error> {
        lock(&self.sync).culprit(|_| true)
    }

    /// Whether every rank lost so far left in order (closed or dropped its
    /// fabric): then the death that made them leave may not have been
    /// noticed here yet.
    fn only_departures(&self) -> bool {
        lock(&self.sync).lost.values().all(|l| l.closed)
    }

    /// Wait until `done(state)` holds, failing if a peer in `need` is lost.
    async fn wait_sync(
        &self,
        what: &str,
        timeout: Option<Duration>,
        mut done: impl FnMut(&SyncState) -> bool,
        need: impl Fn(Rank) -> bool,
    ) -> Result<()> {
        let fut = async {
            loop {
                let n = self.sync_notify.notified();
                tokio::pin!(n);
                n.as_mut().enable();
                {
                    let s = lock(&self.sync);
                    if done(&s) {
                        return Ok(());
                    }
                    // The rank lost first, with its cause: a peer that
                    // closed because another died is not the culprit.
                    if let Some(e) = s.culprit(&need) {
                        return Err(e);
                    }
                }
                n.await;
            }
        };
        match timeout {
            None => fut.await,
            Some(t) => tokio::time::timeout(t, fut)
                .await
                .map_err(|_| Error::Timeout {
                    what: what.to_string(),
                    after: t,
                })?,
        }
    }
}

/// The links to one peer: messages, and one-sided operations on host
/// memory (the same link unless a transport carries those natively where
/// another carries the messages).
#[derive(Clone)]
pub(crate) struct Route {
    pub(crate) msg: Arc<dyn Link>,
    pub(crate) rma: Arc<dyn Link>,
    /// One-sided operations on device memory, where a transport carries
    /// them to this peer.
    pub(crate) gpu: Option<Arc<dyn Link>>,
}

/// The progress receivers run inline: every transport in turn, and the
/// direct take of those that have one.
struct FabricProgress {
    all: Arc<Vec<Arc<dyn Transport>>>,
    /// The transports whose `takes_direct` is true.
    direct: Vec<Arc<dyn Transport>>,
    /// The liveness watch, while it runs without a thread
    /// ([`Liveness::Inline`](crate::Liveness::Inline)).
    watch: Option<Arc<crate::core::progress::Watch>>,
}

impl crate::core::dispatch::Progress for FabricProgress {
    fn turns(&self, turns: usize) -> usize {
        for _ in 0..turns {
            let work: usize = self.all.iter().map(|t| t.progress()).sum();
            if work > 0 {
                return work;
            }
            // No `pause` between turns: on some cores it takes tens of ns,
            // a detection delay that costs an 8 B ping-pong about 10% (the
            // poll itself, with its locked instructions, already spaces the
            // loads of the watched lines; a bare spin on them is slower
            // still). A poller idle for long yields to the OS instead
            // (`Hot::spinning_idle`).
        }
        0
    }

    fn idle(&self, now_ns: u64) {
        if let Some(w) = &self.watch {
            w.inline(now_ns);
        }
    }

    fn take_direct(
        &self,
        tag: Tag,
        queued: &std::sync::atomic::AtomicUsize,
        buf: &mut Vec<u8>,
        more: &mut crate::core::dispatch::More<'_>,
        looks: u32,
    ) -> Option<Rank> {
        // Several transports: each looks once per round.
        let (rounds, each) = match self.direct.len() {
            1 => (1, looks),
            _ => (looks.max(1), 1),
        };
        (0..rounds).find_map(|_| {
            self.direct
                .iter()
                .find_map(|t| t.take_direct(tag, queued, buf, more, each))
        })
    }
}

/// The allowed transports that this build leaves out, each with why, as
/// the start of an "unreachable" error: a transport that `BTL_TRANSPORTS`
/// names but the build lacks (a cargo feature off) is the likeliest cause.
fn left_out_of_build<'a>(allowed: impl Iterator<Item = (&'a str, Option<&'a str>)>) -> String {
    allowed
        .filter_map(|(name, not_built)| {
            not_built.map(|why| format!("{name} is not in this build: {why}; "))
        })
        .collect()
}

impl Fabric {
    /// The running transport of type `T`, for accessors of one transport's
    /// own (see `udp`'s).
    pub(crate) fn transport_of<T: 'static>(&self) -> Option<&T> {
        self.transports
            .iter()
            .find_map(|t| t.as_any().downcast_ref::<T>())
    }
}

/// A kind of memory a region lives in; one-sided operations are routed
/// per (peer, memory kind) ([`Fabric::rma_transport_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Host (CPU) memory.
    Host,
    /// The memory of the GPU with this ordinal (in the process that
    /// allocated it; `Fabric::alloc_device_region`).
    Device(u32),
}

/// Settings for building a [`Fabric`] by hand (no launcher).
#[derive(Clone)]
pub struct FabricBuilder {
    rank: Rank,
    size: u32,
    local_rank: Option<u32>,
    local_size: Option<u32>,
    job_key: [u8; 32],
    config: Config,
}

impl FabricBuilder {
    /// This process is `rank` of `size`.
    pub fn new(rank: Rank, size: u32) -> Self {
        FabricBuilder {
            rank,
            size,
            local_rank: None,
            local_size: None,
            job_key: [0; 32],
            config: Config::default(),
        }
    }
    /// Rank and number of ranks on this node (default: all ranks are local).
    pub fn local(mut self, local_rank: u32, local_size: u32) -> Self {
        self.local_rank = Some(local_rank);
        self.local_size = Some(local_size);
        self
    }
    /// The job key (all ranks must agree; keep it secret).
    pub fn job_key(mut self, key: [u8; 32]) -> Self {
        self.job_key = key;
        self
    }
    /// Settings.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Build the fabric, exchanging addresses through `exchange`. Must be
    /// called inside a tokio runtime (progress tasks are spawned on it).
    pub async fn build(self, exchange: &dyn AddressExchange) -> Result<Fabric> {
        Fabric::open(self, exchange).await
    }
}

/// One per process: hands out [`Endpoint`]s and [`Receiver`]s, registers
/// memory, and owns the progress tasks.
///
/// Open it inside a tokio runtime ([`Fabric::from_env`] under a launcher,
/// [`Fabric::single`] for a job of one, [`FabricBuilder`] with an
/// [`AddressExchange`](crate::AddressExchange) of your own); the progress
/// tasks run on that runtime until the fabric closes. End with
/// [`Fabric::close`], which drains and says goodbye; a fabric that is only
/// dropped stops at once, removes its shared memory, and its peers see it
/// as lost.
///
/// ```no_run
/// # async fn demo() -> async_btl::Result<()> {
/// let fabric = async_btl::Fabric::from_env().await?;
/// println!("rank {} of {}", fabric.rank(), fabric.size());
/// for peer in 0..fabric.size() {
///     println!("to {peer}: {:?}", fabric.transport_for(peer));
/// }
/// fabric.barrier().await?;
/// fabric.close().await
/// # }
/// ```
pub struct Fabric {
    core: Arc<Core>,
    /// Also held by `poller`.
    pub(crate) transports: Arc<Vec<Arc<dyn Transport>>>,
    /// Inline progress over `transports`, for receivers (the dispatcher
    /// holds it weakly); dropped at shutdown.
    poller: Option<crate::core::dispatch::Poller>,
    drivers: Vec<JoinHandle<()>>,
    epoch: AtomicU64,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric")
            .field("rank", &self.core.rank)
            .field("size", &self.core.size)
            .finish_non_exhaustive()
    }
}

impl Fabric {
    async fn open(b: FabricBuilder, exchange: &dyn AddressExchange) -> Result<Fabric> {
        b.config.validate()?;
        if b.size == 0 || b.rank >= b.size {
            return Err(Error::Config(format!(
                "rank {} is not below size {}",
                b.rank, b.size
            )));
        }
        let local_size = b.local_size.unwrap_or(b.size);
        let local_rank = b.local_rank.unwrap_or(b.rank);
        // Before any transport copies: the first fabric picks the bulk
        // copy routine for the process.
        crate::sys::mem::choose_copy(b.config.copy);
        let counters = Arc::new(Counters::default());
        let regions = Arc::new(RegionTable::default());
        let buffers: Arc<crate::core::bufpool::BufPool> = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        let core = Arc::new_cyclic(|me| Core {
            me: me.clone(),
            controls: RwLock::new(Vec::new()),
            lending: Default::default(),
            rank: b.rank,
            size: b.size,
            job_tag: job_tag(&b.job_key),
            key_root: hmac_parts(&b.job_key, &[b"async-btl transport keys"]),
            dispatcher: Dispatcher::new(
                (b.config.recv_budget, b.config.recv_total_budget),
                b.config.progress,
                b.config.spin,
            ),
            rma: Rma::new(regions, counters.clone(), buffers.clone(), b.size),
            counters,
            buffers,
            closed,
            closing: Arc::new(Notify::new()),
            links: RwLock::new(Vec::new()),
            sync: Mutex::new(SyncState::default()),
            sync_notify: Notify::new(),
            gone: (0..b.size).map(|_| AtomicBool::new(false)).collect(),
            config: b.config,
        });
        let job = Job {
            size: b.size,
            local_rank,
            local_size,
        };
        // Every transport of the registry that this job allows and needs,
        // in preference order.
        let mut opened: Vec<Arc<dyn Transport>> = Vec::new();
        let mut caps: Vec<(bool, bool)> = Vec::new();
        let mut device_caps: Vec<bool> = Vec::new();
        for e in registry::entries() {
            if e.not_built.is_some() || !(e.implicit || core.config.allows(e.name)) {
                continue;
            }
            if let Some(t) = (e.open)(&core, &job)? {
                opened.push(t);
                caps.push((e.messages, e.one_sided));
                device_caps.push(e.device_memory);
            }
        }
        if let Ok(mut c) = core.controls.write() {
            *c = opened
                .iter()
                .map(|t| (t.name(), Arc::downgrade(t)))
                .collect();
        }
        let me = Published {
            rank: b.rank,
            node: crate::sys::os::node_id(),
            addrs: opened
                .iter()
                .map(|t| Ok((t.name().to_string(), t.address()?)))
                .collect::<Result<_>>()?,
        };
        let blob = postcard::to_allocvec(&me)
            .map_err(|e| Error::Bootstrap(format!("encoding our address: {e}")))?;
        let all = exchange.all_gather(b.rank, blob).await?;
        core.counters
            .rendezvous_refused
            .store(exchange.refused(), std::sync::atomic::Ordering::Relaxed);
        if all.len() != b.size as usize {
            return Err(Error::Bootstrap(format!(
                "the exchange returned {} addresses for {} ranks",
                all.len(),
                b.size
            )));
        }
        let mut table = Vec::with_capacity(all.len());
        for (r, raw) in all.iter().enumerate() {
            let r = r as Rank;
            if r == b.rank {
                table.push(me.clone());
                continue;
            }
            table.push(Published::decode(r, raw)?);
        }
        for t in &opened {
            t.check_job(&table)?;
        }
        // Routes: per peer, messages over the first transport that reaches
        // it and carries messages; one-sided operations on host memory over
        // the first that reaches it and carries them natively, else with
        // the messages.
        let reaches = |t: &Arc<dyn Transport>, p: &Published| -> Result<bool> {
            match p.addr(t.name()) {
                Some(addr) => t.reaches(&Peer { rank: p.rank, addr }),
                None => Ok(false),
            }
        };
        let mut picks: Vec<Option<(usize, usize)>> = Vec::with_capacity(table.len());
        let mut gpu_picks: Vec<Option<usize>> = Vec::with_capacity(table.len());
        let mut unreachable = Vec::new();
        for p in &table {
            let mut msg = None;
            let mut rma = None;
            for (i, (t, &(messages, one_sided))) in opened.iter().zip(&caps).enumerate() {
                if (msg.is_some() || !messages) && (rma.is_some() || !one_sided) {
                    continue;
                }
                if !reaches(t, p)? {
                    continue;
                }
                if msg.is_none() && messages {
                    msg = Some(i);
                }
                if rma.is_none() && one_sided {
                    rma = Some(i);
                }
            }
            let mut gpu = None;
            for (i, t) in opened.iter().enumerate() {
                if device_caps[i] && reaches(t, p)? {
                    gpu = Some(i);
                    break;
                }
            }
            gpu_picks.push(gpu);
            match msg {
                Some(m) => picks.push(Some((m, rma.unwrap_or(m)))),
                None => {
                    unreachable.push(p.rank);
                    picks.push(None);
                }
            }
        }
        if !unreachable.is_empty() {
            let allowed = if core.config.transports.is_empty() {
                registry::names().join(", ")
            } else {
                core.config.transports.join(", ")
            };
            let left_out = left_out_of_build(
                registry::entries()
                    .into_iter()
                    .filter(|e| core.config.allows(e.name))
                    .map(|e| (e.name, e.not_built)),
            );
            return Err(Error::Config(format!(
                "ranks {unreachable:?} cannot be reached with the allowed transports ({allowed}): {left_out}sm needs the same node; udp needs an address they can reach (a loopback BTL_UDP_ADDR reaches only this host)"
            )));
        }
        // Connect each transport to the peers routed to it; one that
        // carries nobody is closed again.
        let mut by_transport: Vec<HashMap<Rank, Arc<dyn Link>>> =
            opened.iter().map(|_| HashMap::new()).collect();
        let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
        for (i, t) in opened.iter().enumerate() {
            let peers: Vec<Peer<'_>> = table
                .iter()
                .zip(picks.iter().zip(&gpu_picks))
                .filter(|(_, (pick, gpu))| {
                    pick.is_some_and(|(m, r)| m == i || r == i) || **gpu == Some(i)
                })
                .filter_map(|(p, _)| {
                    Some(Peer {
                        rank: p.rank,
                        addr: p.addr(t.name())?,
                    })
                })
                .collect();
            // A transport with device memory stays for its allocations.
            if peers.is_empty() && !device_caps[i] {
                t.shutdown();
                continue;
            }
            by_transport[i] = t.clone().connect(&peers)?.into_iter().collect();
            transports.push(t.clone());
        }
        let mut links: Vec<Option<Route>> = (0..b.size).map(|_| None).collect();
        for (r, pick) in picks.iter().enumerate() {
            let Some((m, x)) = *pick else { continue };
            let link = |i: usize| {
                by_transport[i].get(&(r as Rank)).cloned().ok_or_else(|| {
                    Error::Bootstrap(format!(
                        "{} did not connect rank {r}, which it reaches",
                        opened[i].name()
                    ))
                })
            };
            links[r] = Some(Route {
                msg: link(m)?,
                rma: link(x)?,
                gpu: gpu_picks[r].map(link).transpose()?,
            });
            tracing::debug!(
                peer = r,
                messages = opened[m].name(),
                one_sided = opened[x].name(),
                "route"
            );
        }
        *core
            .links
            .write()
            .map_err(|_| Error::Misuse("poisoned link table".into()))? = links;

        // The dispatcher holds the poller weakly (it lives in the core, which
        // transports hold: a strong reference would keep the fabric alive
        // forever); the fabric and, while it is open, each receiver that
        // used it hold it strongly. One list for all transports.
        let transports = Arc::new(transports);
        let beats: Vec<_> = transports
            .iter()
            .map(|_| crate::core::progress::Beat::new())
            .collect();
        // Liveness that no user loop can starve (see `progress::Watch`).
        let watch = crate::core::progress::Watch::start(
            transports
                .iter()
                .zip(&beats)
                .map(|(t, b)| (Arc::downgrade(t), b.clone()))
                .collect(),
            &core,
        );
        let poller: crate::core::dispatch::Poller = Arc::new(FabricProgress {
            direct: transports
                .iter()
                .filter(|t| t.takes_direct())
                .cloned()
                .collect(),
            all: transports.clone(),
            watch: (!watch.threaded()).then(|| watch.clone()),
        });
        core.dispatcher.set_progress_hook(&poller);
        let drivers = transports
            .iter()
            .zip(&beats)
            .map(|(t, b)| {
                tokio::spawn(crate::core::progress::drive(
                    t.clone(),
                    core.clone(),
                    b.clone(),
                    watch.clone(),
                ))
            })
            .collect();
        Ok(Fabric {
            core,
            transports,
            poller: Some(poller),
            drivers,
            epoch: AtomicU64::new(0),
        })
    }

    /// Open the fabric of a job started by a launcher: `btl-run`, Open MPI's
    /// `mpirun`, Slurm's `srun`, PMI, or torchrun-style variables (see
    /// [`crate::bootstrap`]). Settings come from `BTL_*` variables
    /// ([`Config::from_env`]). Started by no launcher, the process is a job
    /// of one. Must be called inside a tokio runtime.
    pub async fn from_env() -> Result<Fabric> {
        let config = Config::from_env()?;
        match crate::bootstrap::JobInfo::from_env()? {
            None => {
                FabricBuilder::new(0, 1)
                    .config(config)
                    .build(&crate::exchange::LocalExchange::new(1))
                    .await
            }
            Some(job) => Self::from_job(job, config).await,
        }
    }

    /// Open the fabric for an explicit job description.
    pub async fn from_job(job: crate::bootstrap::JobInfo, config: Config) -> Result<Fabric> {
        let timeout = config.boot_timeout;
        FabricBuilder::new(job.rank, job.size)
            .local(job.local_rank, job.local_size)
            .job_key(*job.job_key.as_bytes())
            .config(config)
            .build(&crate::exchange::JobExchange::new(job, timeout))
            .await
    }

    /// A fabric for a process that is the whole job (rank 0 of 1).
    pub async fn single() -> Result<Fabric> {
        FabricBuilder::new(0, 1)
            .build(&crate::exchange::LocalExchange::new(1))
            .await
    }

    /// This process's rank.
    pub fn rank(&self) -> Rank {
        self.core.rank
    }

    /// Number of ranks in the job.
    pub fn size(&self) -> u32 {
        self.core.size
    }

    /// The endpoint for `peer` (cheap to clone; keep it).
    pub fn endpoint(&self, peer: Rank) -> Result<Endpoint> {
        if self.core.is_closed() {
            return Err(Error::Closed);
        }
        let route = self.core.route(peer).ok_or_else(|| {
            Error::Misuse(format!(
                "rank {peer} is not in this job of {} ranks",
                self.core.size
            ))
        })?;
        Ok(Endpoint::new(route, self.core.clone()))
    }

    /// The stream of messages on `tag`, from every peer. One receiver per tag
    /// at a time.
    pub fn receiver(&self, tag: Tag) -> Result<Receiver> {
        self.core.dispatcher.take(tag, self.core.closed.clone())
    }

    /// Register memory the application owns — a `Vec<u8>`, `Box<[u8]>`,
    /// `BytesMut`, [`PageBuf`](crate::PageBuf), `memmap2::MmapMut`, or any
    /// [`RegisterMemory`](crate::RegisterMemory) — so that peers can put
    /// into, get from and apply atomics to it with its
    /// [`remote_key`](MemoryRegion::remote_key). The region owns the buffer
    /// from now on, and its memory lives until the last clone of the
    /// region *and* every operation using it are gone; a `Vec` can be
    /// taken back with [`MemoryRegion::try_into_vec`].
    ///
    /// Peers reach a registered buffer through the target's progress
    /// (emulated over messages, or by single copy on `sm` from
    /// `BTL_SM_CMA_MIN` bytes); [`alloc_region`](Self::alloc_region)
    /// memory is mapped by same-node peers instead. Atomics need 8-byte
    /// aligned words: a `PageBuf` guarantees it, a `Vec` in practice
    /// (the system allocator aligns to 16), other types may not.
    ///
    /// ```no_run
    /// # async fn demo(f: &async_btl::Fabric) {
    /// let window = f.register(async_btl::PageBuf::zeroed(1 << 20));
    /// let scratch = f.register(vec![0u8; 4096]);
    /// let from_bytes = f.register(bytes::BytesMut::zeroed(512));
    /// # let _ = (window, scratch, from_bytes); }
    /// ```
    pub fn register<B: crate::RegisterMemory>(&self, buffer: B) -> MemoryRegion {
        self.core
            .rma
            .regions
            .register(self.core.rank, buffer, &|id, raw| {
                self.register_nics(id, raw)
            })
    }

    /// Register a new region with every transport that reaches peers'
    /// memory through hardware.
    fn register_nics(
        &self,
        id: &crate::core::region::KeyId,
        raw: crate::sys::mem::RawBuf,
    ) -> (
        Vec<crate::core::region::KeyHandle>,
        Vec<crate::core::region::NicReg>,
    ) {
        self.transports
            .iter()
            .filter_map(|t| t.register_memory(id, raw))
            .unzip()
    }

    /// Allocate a zeroed, page-aligned region that peers reach at their
    /// best: where this fabric has same-node peers over `sm`, in shared
    /// memory they map, so put and get to it are a single copy and
    /// atomics one hardware instruction; otherwise in this process's own
    /// memory, registered with the NICs that reach the other peers (no
    /// shared file, and no thread to hand it out, in a rank alone on its
    /// node).
    pub fn alloc_region(&self, len: usize) -> Result<MemoryRegion> {
        let open = |name: &str| self.transports.iter().any(|t| t.name() == name);
        let hook = registry::entries()
            .into_iter()
            .filter(|e| e.not_built.is_none() && open(e.name))
            .find_map(|e| e.alloc_shared);
        let Some(alloc) = hook else {
            // No transport of this fabric has memory peers map: a
            // page-aligned buffer, which they reach through the target
            // or a NIC.
            return Ok(self.register(crate::PageBuf::zeroed(len)));
        };
        let id = crate::sys::os::random_bytes::<16>();
        let (raw, keep, handle) = alloc(&id, len, self.core.rank, self.core.job_tag)?;
        Ok(self
            .core
            .rma
            .regions
            .add_shared(self.core.rank, id, raw, keep, handle, &|id, raw| {
                self.register_nics(id, raw)
            }))
    }

    /// Allocate `len` zeroed bytes of device memory on GPU `device`, as a
    /// region: same-node peers put into and get from it with
    /// [`Endpoint::put`](crate::Endpoint::put) and
    /// [`Endpoint::get`](crate::Endpoint::get) from device regions of
    /// their own, copied by the GPU through CUDA IPC (`smcuda`), never
    /// through the host. `read` and `write` on it copy through the device.
    /// The memory is freed when the last clone of the region and every
    /// operation on it are gone.
    ///
    /// # Errors
    /// [`Error::Config`] when no transport of this fabric has device
    /// memory (`smcuda` needs a GPU and the `cuda` feature: `btl-info`
    /// says why not), or when the device refuses the allocation.
    pub fn alloc_device_region(&self, device: u32, len: usize) -> Result<MemoryRegion> {
        self.device_region(|t, id| t.alloc_device(device, len, id))
    }

    /// Register `len` bytes of device memory at `ptr`, allocated by the
    /// caller (through the CUDA driver, cudarc, or a framework's
    /// allocator), as a region: same-node peers put into and get from it
    /// as from one of [`alloc_device_region`](Self::alloc_device_region)'s,
    /// by one GPU copy through CUDA IPC. The range may be part of a larger
    /// allocation (a caching allocator's block): peers map the whole
    /// allocation and reach only the range. The fabric never frees the
    /// memory.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory this process allocated, and
    /// it must stay allocated, and not be handed out again by the
    /// allocator it came from, while the region, any clone of it, any
    /// operation on it, or any peer that holds its key lives: peers write
    /// into it and read from it through the GPU, and keep the allocation
    /// mapped, without asking this process. A peer that honours the key
    /// reaches only the range; one that forges the key's handle can reach
    /// the whole allocation the range lies in, so register memory only
    /// where every rank of the job may see that allocation.
    ///
    /// # Errors
    /// [`Error::Config`] when no transport of this fabric has device
    /// memory (see [`alloc_device_region`](Self::alloc_device_region)),
    /// or when `ptr..ptr + len` is not device memory of this process
    /// (host memory, a range past its allocation's end);
    /// [`Error::Access`] when the allocation can be shared with no other
    /// process (pool memory from `cudaMallocAsync`, a VMM allocation made
    /// without a POSIX-fd handle type).
    pub unsafe fn register_device(&self, ptr: u64, len: usize) -> Result<MemoryRegion> {
        self.device_region(|t, id| t.register_device(ptr, len, id))
    }

    /// A device region from the first transport with device memory that
    /// `make` gets one from (under a fresh key id).
    fn device_region(
        &self,
        make: impl Fn(
            &dyn crate::transport::Transport,
            &crate::core::region::KeyId,
        ) -> Option<crate::transport::DeviceMade>,
    ) -> Result<MemoryRegion> {
        let id = crate::sys::os::random_bytes::<16>();
        for t in self.transports.iter() {
            if let Some(made) = make(&**t, &id) {
                let (mem, handle) = made?;
                return Ok(self
                    .core
                    .rma
                    .regions
                    .add_device(self.core.rank, id, mem, handle));
            }
        }
        Err(Error::Config(
            "no transport of this fabric has device memory (smcuda needs a GPU and the `cuda` feature; btl-info says why not)".into(),
        ))
    }

    /// A snapshot of the fabric's counters, every transport's included.
    pub fn stats(&self) -> Stats {
        let mut s = self.core.counters.snapshot();
        for t in self.transports.iter() {
            t.add_stats(&mut s);
        }
        s
    }

    /// The routine this process copies 32 KiB up to half the L2 with, and why
    /// (chosen when the first fabric opened; see [`Config::copy`]).
    pub fn copy_routine(&self) -> &'static crate::CopyChoice {
        crate::sys::mem::choose_copy(self.core.config.copy)
    }

    /// The transports this process runs, by name.
    pub fn transports(&self) -> Vec<&'static str> {
        self.transports.iter().map(|t| t.name()).collect()
    }

    /// Which transport carries messages to `peer` ("self", "sm", "udp").
    pub fn transport_for(&self, peer: Rank) -> Option<&'static str> {
        self.core.link(peer).map(|l| l.transport())
    }

    /// Which transport carries one-sided operations (put, get, atomics)
    /// on `memory` to `peer`: the first in preference order that reaches
    /// it and carries them natively, else the one that carries its
    /// messages (and emulates them over those). Chosen once, at open.
    pub fn rma_transport_for(&self, peer: Rank, memory: MemoryKind) -> Option<&'static str> {
        match memory {
            MemoryKind::Host => self.core.route(peer).map(|r| r.rma.transport()),
            MemoryKind::Device(_) => self
                .core
                .route(peer)
                .and_then(|r| r.gpu.map(|l| l.transport())),
        }
    }

    /// Wait until every rank has called `barrier` as many times as we have.
    /// Fails with `PeerLost` if a rank dies meanwhile.
    ///
    /// Messages sent before the barrier are not ordered with it: a message
    /// may still be on its way when a barrier after it resolves.
    ///
    /// # Cancel safety
    /// Not cancel safe: a call counts once it is made, so a dropped barrier
    /// leaves this rank one barrier ahead of the others.
    pub async fn barrier(&self) -> Result<()> {
        let epoch = self.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        let me = self.core.rank;
        let mut sends = Vec::new();
        // A barrier over a lost peer fails naming the culprit with its
        // cause (not whichever lost link the loop reaches first, nor a peer
        // that closed because another died): the liveness checks run once
        // more first, so that a death this rank has not noticed yet is
        // found.
        // When every rank lost so far only left (it may have left because
        // of a death not noticed here yet), the checks run again for a few
        // heartbeats before a leaver is blamed.
        let blame = |e: Error| async move {
            match e {
                Error::PeerLost { .. } => {
                    for round in 0..=BLAME_ROUNDS {
                        for t in self.transports.iter() {
                            t.check_peers();
                        }
                        if round == BLAME_ROUNDS || !self.core.only_departures() {
                            break;
                        }
                        tokio::time::sleep(self.core.config.heartbeat / 2).await;
                    }
                    self.core.first_lost().unwrap_or(e)
                }
                e => e,
            }
        };
        for r in (0..self.core.size).filter(|r| *r != me) {
            let link = self.core.link(r).ok_or(Error::Closed)?;
            match link.submit(Kind::Barrier, epoch, Bytes::new()) {
                Ok(Some(c)) => sends.push(c),
                Ok(None) => {}
                Err(e) => return Err(blame(e).await),
            }
        }
        for c in sends {
            if let Err(e) = std::future::poll_fn(|cx| c.poll(cx)).await {
                return Err(blame(e).await);
            }
        }
        let need = self.core.size as usize - 1;
        if let Err(e) = self
            .core
            .wait_sync(
                "a barrier",
                None,
                |s| s.barrier.get(&epoch).map_or(0, HashSet::len) >= need,
                |_| true,
            )
            .await
        {
            return Err(blame(e).await);
        }
        lock(&self.core.sync).barrier.remove(&epoch);
        Ok(())
    }

    /// Close in order: wait until our sends are consumed, say goodbye to
    /// every peer and wait for theirs (up to `close_timeout`), then stop the
    /// progress tasks and remove our shared-memory names. Peers that died are
    /// skipped. Errors name what did not drain.
    ///
    /// # Cancel safety
    /// Dropping the future drops the fabric: it stops at once without the
    /// goodbye, its shared memory is still removed, and peers see this rank
    /// as lost.
    pub async fn close(mut self) -> Result<()> {
        let t = self.core.config.close_timeout;
        let deadline = tokio::time::Instant::now() + t;
        // Lent messages: ours wait for their receivers (who cannot take
        // them once we said goodbye); those lent to us are declined, also
        // those that arrive while we wait, so that two ranks closing with
        // each other's unread do not wait out the timeout.
        const CLOSED: &str = "the receiver closed its fabric";
        self.core.lending.decline_held(CLOSED);
        while !self.transports.iter().all(|t| t.drained()) || self.core.lending.has_loans() {
            self.core.lending.decline_held(CLOSED);
            if tokio::time::Instant::now() >= deadline {
                let left: Vec<String> =
                    self.transports.iter().flat_map(|t| t.undrained()).collect();
                let r = Err(Error::Timeout {
                    what: if left.is_empty() {
                        "peers to consume our last messages at close".into()
                    } else {
                        format!(
                            "peers to consume our last messages at close ({})",
                            left.join("; ")
                        )
                    },
                    after: t,
                });
                self.shutdown();
                return r;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let me = self.core.rank;
        for r in (0..self.core.size).filter(|r| *r != me) {
            if let Some(l) = self.core.link(r) {
                let _ = l.submit(Kind::Bye, 0, Bytes::new());
            }
        }
        let size = self.core.size;
        let res = self
            .core
            .wait_sync(
                "goodbyes from every peer at close",
                Some(deadline.saturating_duration_since(tokio::time::Instant::now())),
                |s| {
                    (0..size)
                        .filter(|r| *r != me)
                        .all(|r| s.byes.contains(&r) || s.lost.contains_key(&r))
                },
                |_| false,
            )
            .await;
        // A short grace for our goodbye itself to be acknowledged (udp) or
        // consumed (sm) before the progress tasks stop: a peer that lost it
        // would otherwise wait out its own close timeout.
        let grace = tokio::time::Instant::now() + CLOSE_GRACE.min(t);
        while !self.transports.iter().all(|t| t.drained()) && tokio::time::Instant::now() < grace {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        self.shutdown();
        res
    }

    fn shutdown(&mut self) {
        if self.core.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.core.closing.notify_waiters();
        // The one-sided fast path reads this, not `closed`: it then takes
        // the slow path, which fails with `Closed`.
        for g in &self.core.gone {
            g.store(true, Ordering::Release);
        }
        self.core.dispatcher.close();
        for t in self.transports.iter() {
            t.shutdown();
        }
        self.core.rma.close();
        self.core.lending.fail(None, || Error::Closed);
        for d in self.drivers.drain(..) {
            d.abort();
        }
        if let Ok(mut l) = self.core.links.write() {
            l.clear();
        }
        self.poller = None;
    }
}

/// Liveness rounds (half a heartbeat apart) a failed barrier runs before
/// it blames a rank that only left.
const BLAME_ROUNDS: u32 = 4;

/// The tag of a goodbye sent by a fabric dropped without `close` (a
/// closing one sends tag 0).
const ABANDONED: u64 = 1;

impl Drop for Fabric {
    fn drop(&mut self) {
        if !self.core.is_closed() {
            // Dropped without `close`: tell every peer at once (best effort:
            // whatever the transports can send now), so their operations on
            // this rank fail now rather than at their peer timeout.
            let me = self.core.rank;
            for r in (0..self.core.size).filter(|r| *r != me) {
                if let Some(l) = self.core.link(r) {
                    let _ = l.submit(Kind::Bye, ABANDONED, Bytes::new());
                }
            }
        }
        self.shutdown();
    }
}

/// A message's bytes in a transport's own buffer, as a
/// [`Payload`](crate::core::dispatch::Payload): copied once, into a
/// receiver's buffer or a pooled one.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
struct SliceCopy<'a> {
    bytes: &'a [u8],
    pool: &'a Arc<crate::core::bufpool::BufPool>,
}

impl crate::core::dispatch::Payload for SliceCopy<'_> {
    const COPIES: bool = true;

    fn into_bytes(self) -> Bytes {
        let mut v = self.pool.take(self.bytes.len());
        v.extend_from_slice(self.bytes);
        self.pool.freeze(v)
    }

    fn copy_into(self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::left_out_of_build;

    #[test]
    fn an_unreachable_error_names_the_allowed_transports_the_build_lacks() {
        let note = left_out_of_build(
            [
                ("sm", None),
                ("rdma", Some("built without the `rdma` cargo feature")),
                ("udp", None),
            ]
            .into_iter(),
        );
        assert_eq!(
            note,
            "rdma is not in this build: built without the `rdma` cargo feature; "
        );
        assert_eq!(left_out_of_build([("sm", None)].into_iter()), "");
    }
}

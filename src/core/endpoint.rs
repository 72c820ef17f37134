//! [`Endpoint`] and its operation futures.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;

use crate::core::completion::Completion;
use crate::core::dispatch::OP_UNSEEN;
use crate::core::fabric::Core;
use crate::core::region::{MemoryRegion, RemoteKey};
use crate::core::rma::PutSrc;
use crate::core::stats::{Counters, Hot};
use crate::sys::mem::AtomicOp;
use crate::transport::{Kind, Link, Local, Native, OneSided};
use crate::{AccessError, Error, Rank, Result, Tag};

/// The way to one peer: cheap to clone, `Send + Sync`.
///
/// Every operation returns a named future ([`SendFuture`], [`Put`], [`Get`],
/// [`AtomicFetch`], [`Flush`]):
/// - *Completion*: a send resolves at local completion (the data is no
///   longer needed and the message cannot be lost by this process); put,
///   get and the atomics resolve at remote completion.
/// - *Ordering*: messages on one tag arrive in the order this endpoint (and
///   its clones) sent them. One-sided operations have no order among
///   themselves or with messages: await them, or [`flush`](Self::flush),
///   before a message that tells the peer to look.
/// - *Backpressure*: a full FIFO or window keeps the future pending until
///   there is room; nothing is queued without bound.
/// - *Cancellation*: dropping a started future never loses the message nor
///   frees memory still in use; see each future's `# Cancel safety`.
/// - *Failure*: when the peer is lost, every pending operation on it fails
///   with [`Error::PeerLost`], and so do later ones.
///
/// ```no_run
/// # async fn demo(fabric: &async_btl::Fabric) -> async_btl::Result<()> {
/// let ep = fabric.endpoint(1)?;
/// ep.send(7, &b"request"[..]).await?; // local completion
/// let sends: Vec<_> = (0..4u8).map(|i| ep.send(7, vec![i; 64])).collect();
/// for s in sends {
///     s.await?; // several in flight; they arrive in this order
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Endpoint(Arc<Inner>);

/// What an endpoint and its futures share: one reference count to touch
/// per operation instead of two.
struct Inner {
    /// Carries messages (and the one-sided operations the `rma` link
    /// leaves to emulation).
    link: Arc<dyn Link>,
    /// Carries one-sided operations on host memory first
    /// ([`Link::post`]); usually the same link.
    rma: Arc<dyn Link>,
    /// Carries one-sided operations on device memory, if a transport
    /// reaches the peer's.
    gpu: Option<Arc<dyn Link>>,
    core: Arc<Core>,
    /// `link.peer()`, kept here: every put and get checks its key's owner
    /// against it, and a dynamic call per operation showed in profiles of
    /// small puts.
    peer: Rank,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("peer", &self.0.link.peer())
            .field("transport", &self.0.link.transport())
            .finish()
    }
}

impl Endpoint {
    pub(crate) fn new(route: crate::core::fabric::Route, core: Arc<Core>) -> Self {
        let peer = route.msg.peer();
        Endpoint(Arc::new(Inner {
            link: route.msg,
            rma: route.rma,
            gpu: route.gpu,
            core,
            peer,
        }))
    }

    /// The peer's rank.
    pub fn peer(&self) -> Rank {
        self.0.peer
    }

    /// The transport carrying this endpoint's messages ("sm", "self",
    /// "udp").
    pub fn transport(&self) -> &'static str {
        self.0.link.transport()
    }

    /// The transport carrying this endpoint's one-sided operations on host
    /// memory: the messages' transport unless another reaches the peer and
    /// carries them natively (see
    /// [`Fabric::rma_transport_for`](crate::Fabric::rma_transport_for)).
    pub fn rma_transport(&self) -> &'static str {
        self.0.rma.transport()
    }

    /// This endpoint as a [`futures::Sink`] of `(tag, bytes)` messages (see
    /// [`SendSink`]).
    pub fn into_sink(self) -> SendSink {
        SendSink {
            ep: self,
            inflight: None,
        }
    }

    /// Send `data` on `tag`. Resolves at local completion: the message is in
    /// the peer's FIFO (shared memory) and cannot be lost by this process.
    /// Messages on one tag from one sender arrive in send order.
    ///
    /// On `sm`, a message of `BTL_SM_CMA_MIN` bytes (16 KiB) or more may go
    /// by rendezvous where the kernel allows cross-memory copies: the
    /// receiver copies it straight out of `data` (one copy instead of two),
    /// and the future resolves once it has. `data` is kept alive until then
    /// even if the future is dropped (`SmStats::rendezvous_sends` counts
    /// these). From 64 KiB (`BTL_SM_ADAPT_MAX`) it always does. Below, a
    /// message that finds the peer caught up (a request, an answer) does
    /// when single copy measured cheaper than fragments lately, and
    /// otherwise goes through fragments and resolves as a small message
    /// does (`SmStats::chosen_fragment_sends`); in a burst, one goes by
    /// rendezvous and those sent while it is copied through fragments.
    pub fn send(&self, tag: Tag, data: impl Into<Bytes>) -> SendFuture {
        self.0.core.counters.add(Hot::Sends);
        SendFuture {
            state: SendState::Start {
                tag,
                data: data.into(),
            },
            ep: self.0.clone(),
            seen: OP_UNSEEN,
        }
    }

    /// Send a borrowed slice: when nothing is queued ahead and there is room
    /// (on `sm`: the peer's fast box for up to 512 bytes, else a free fragment),
    /// the bytes are copied straight into shared memory with no allocation
    /// (the inline path for small messages); otherwise they are copied once
    /// into an owned buffer and queued.
    ///
    /// The future borrows the endpoint as it borrows `data` (no reference
    /// count to take and drop per message).
    #[inline]
    pub fn send_inline<'a>(&'a self, tag: Tag, data: &'a [u8]) -> SendInlineFuture<'a> {
        self.0.core.counters.add(Hot::Sends);
        SendInlineFuture {
            ep: &self.0,
            tag,
            data,
            queued: None,
            seen: OP_UNSEEN,
        }
    }

    /// Send `region[range]` on `tag`, from host or device memory: what
    /// [`send`](Self::send) does for bytes in hand. The receiver takes it as
    /// any message; [`Receiver::recv_region`](crate::Receiver::recv_region)
    /// and [`Message::fetch_into`](crate::Message::fetch_into) land it in a
    /// region of its choosing.
    ///
    /// * Device memory to a peer on this node whose device memory a
    ///   transport reaches (`smcuda`): the message is *lent*. Only an
    ///   announcement travels, in order with this tag's other messages;
    ///   the receiver copies the bytes out of `region` (one GPU copy into
    ///   its device memory, no copy through the host) and says so, and the
    ///   future resolves then. It fails with [`Error::Declined`] if the
    ///   receiver drops the message unread (or its copy fails), with
    ///   [`Error::PeerLost`] if the receiver is lost. The receiver holds
    ///   the key of the whole region while it has the message, as a peer
    ///   given [`MemoryRegion::remote_key`] would
    ///   (`Stats::lent_sends` counts these).
    /// * Device memory otherwise (another node, this rank, or a peer this
    ///   rank's IPC handshake settled on the host path with, or with
    ///   `BTL_SMCUDA_IPC=off` here): its bytes are read through the device
    ///   and carried (`Stats::staged_device_ops`). A lent message whose
    ///   receiver has no IPC with this rank is fetched through the host.
    /// * Host memory: its bytes are carried.
    ///
    /// ```no_run
    /// # async fn demo(f: &async_btl::Fabric) -> async_btl::Result<()> {
    /// let gpu = f.alloc_device_region(0, 1 << 20)?;
    /// // ... a kernel fills it ...
    /// f.endpoint(1)?.send_region(9, &gpu, 0..4096).await?; // taken by rank 1
    /// # Ok(()) }
    /// ```
    pub fn send_region(&self, tag: Tag, region: &MemoryRegion, range: Range<usize>) -> SendRegion {
        self.0.core.counters.add(Hot::Sends);
        SendRegion(SendRegionState::Start {
            ep: self.clone(),
            tag,
            region: region.clone(),
            range,
        })
    }

    /// The first poll of a [`SendRegion`]: the message leaves now (its
    /// place in the tag's order), carried or lent.
    fn first_send_region(
        &self,
        tag: Tag,
        region: &MemoryRegion,
        range: Range<usize>,
    ) -> SendRegionState {
        match self.start_send_region(tag, region, range) {
            Ok(SendStart::Carried(data)) => SendRegionState::Carried(SendFuture {
                state: SendState::Start { tag, data },
                ep: self.0.clone(),
                seen: OP_UNSEEN,
            }),
            Ok(SendStart::Lent(done)) => {
                SendRegionState::Lent(OpState::Wait(done, self.0.core.clone(), None, OP_UNSEEN))
            }
            Err(e) => SendRegionState::Lent(OpState::Ready(Some(Err(e)))),
        }
    }

    fn start_send_region(
        &self,
        tag: Tag,
        region: &MemoryRegion,
        range: Range<usize>,
    ) -> Result<SendStart> {
        Self::local_range(region, &range)?;
        let len = range.end - range.start;
        let inner = &region.inner;
        let carried = |staged: bool| -> Result<SendStart> {
            if staged {
                Counters::bump(&self.0.core.counters.staged_device_ops);
            }
            let mut v = Vec::with_capacity(len);
            inner.read_to(range.start as u64, len, &mut v)?;
            Ok(SendStart::Carried(Bytes::from(v)))
        };
        if inner.device.is_none() || len == 0 {
            return carried(false);
        }
        let direct = self.0.gpu.as_ref().is_some_and(|g| g.device_direct());
        if !direct || !self.0.link.carries_lent() {
            return carried(true);
        }
        if self.0.core.is_closed() {
            return Err(Error::Closed);
        }
        self.check_not_lost()?;
        let core = &self.0.core;
        let done = Completion::new();
        let peer = self.0.peer;
        let Some(id) = core
            .lending
            .lend(peer, inner.clone(), done.clone(), || core.is_gone(peer))
        else {
            self.check_not_lost()?;
            return Err(Error::Closed);
        };
        let ann = crate::core::lend::Announce {
            id,
            offset: range.start as u64,
            len: len as u64,
            key: region.remote_key(),
        };
        if let Err(e) = self
            .0
            .link
            .submit(Kind::Lent, tag, Bytes::from(ann.encode()))
        {
            core.lending.cancel(id);
            return Err(e);
        }
        Counters::bump(&core.counters.lent_sends);
        Ok(SendStart::Lent(done))
    }

    /// A get into `local[range]` as [`get`](Self::get) starts it, with the
    /// completion it waits on (for a caller that must know when the copy
    /// is done even if the future is dropped).
    pub(crate) fn get_tracked(
        &self,
        local: &MemoryRegion,
        range: Range<usize>,
        remote: &RemoteKey,
        offset: u64,
    ) -> (Option<Arc<Completion>>, Get) {
        let op = self.rma(local, range, remote, offset, false);
        let done = match &op {
            OpState::Wait(c, ..) => Some(c.clone()),
            OpState::Ready(_) => None,
        };
        (done, Get(op))
    }

    fn check_key(&self, key: &RemoteKey, offset: u64, len: usize) -> Result<()> {
        if key.owner() != self.peer() {
            return Err(AccessError::WrongOwner {
                owner: key.owner(),
                endpoint: self.peer(),
            }
            .into());
        }
        Ok(key.check(offset, len)?)
    }

    fn local_range(region: &MemoryRegion, range: &Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > region.len() {
            return Err(Error::Misuse(format!(
                "local range {range:?} is outside the {}-byte region",
                region.len()
            )));
        }
        Ok(())
    }

    /// Write `local[range]` into the peer's region `remote` at `offset`.
    /// Resolves at remote completion: the bytes are in the target's memory.
    /// The target checks the key and the bounds; a refused put leaves its
    /// memory untouched and fails with [`Error::Access`].
    pub fn put(
        &self,
        local: &MemoryRegion,
        range: Range<usize>,
        remote: &RemoteKey,
        offset: u64,
    ) -> Put {
        Put(self.rma(local, range, remote, offset, true))
    }

    /// Read from the peer's region `remote` at `offset` into `local[range]`.
    /// Resolves when the data is in `local`.
    pub fn get(
        &self,
        local: &MemoryRegion,
        range: Range<usize>,
        remote: &RemoteKey,
        offset: u64,
    ) -> Get {
        Get(self.rma(local, range, remote, offset, false))
    }

    /// Start a put or get after the checks, by the fastest path: returns
    /// the completion to wait for, or `None` when it is done already (a
    /// copy into a mapped region) or `implicit` (`put_nbi`/`get_nbi`: the
    /// next `flush` waits for it and reports its failure).
    fn start_rma(
        &self,
        local: &MemoryRegion,
        range: Range<usize>,
        key: &RemoteKey,
        offset: u64,
        put: bool,
        implicit: bool,
    ) -> Result<Option<Arc<Completion>>> {
        let len = range.end.saturating_sub(range.start);
        Self::local_range(local, &range)?;
        self.check_key(key, offset, len)?;
        if local.inner.device.is_some() {
            return self.start_device_rma(local, range.start, len, key, offset, put, implicit);
        }
        let c = &self.0.core.counters;
        let lraw = local.inner.raw().slice(range.start as u64, len)?;
        // A key some transport mapped on its first use (UCX's `rkey_ptr`):
        // one copy, bounds from the real mapping, with no call into the
        // transport.
        if let Some(m) = key.mapped_for(self.0.core.job_tag) {
            if !self.0.core.is_gone(self.0.peer) {
                m.check_live()?;
                let remote = m.data();
                if put {
                    remote.copy_from(offset, &lraw, 0, len)?;
                    c.add(Hot::DirectPuts);
                } else {
                    lraw.copy_from(0, &remote, offset, len)?;
                    c.add(Hot::DirectGets);
                }
                return Ok(None);
            }
        }
        if key.on_device() {
            return self.start_device_rma(local, range.start, len, key, offset, put, implicit);
        }
        if self.0.core.is_closed() {
            return Err(Error::Closed);
        }
        self.check_not_lost()?;
        let at = Local {
            region: &local.inner,
            offset: range.start as u64,
            raw: lraw,
            len,
        };
        let op = OneSided::put_or_get(put, at, key, offset);
        let (link, rma) = (&*self.0.link, &self.0.core.rma);
        let tally = if implicit {
            rma.tally(self.0.peer)
        } else {
            None
        };
        match self.0.rma.post(op, tally)? {
            Native::Done(_) => {
                c.add(if put {
                    Hot::DirectPuts
                } else {
                    Hot::DirectGets
                });
                return Ok(None);
            }
            Native::Posted(done) => {
                rma.track(self.0.peer, done.clone(), implicit);
                return Ok((!implicit).then_some(done));
            }
            Native::Counted if tally.is_some() => return Ok(None),
            Native::Counted => return Err(uncounted()),
            Native::Emulate => {}
        }
        let done = (!implicit).then(Completion::new);
        if put {
            c.add(Hot::EmulatedPuts);
            let src = (PutSrc::Host(local.inner.raw()), range.start as u64, len);
            match &done {
                Some(d) => rma.start_put(link, &key.id, offset, src, d.clone()),
                None => rma.put_implicit(link, &key.id, offset, src)?,
            }
        } else {
            c.add(Hot::EmulatedGets);
            let dst = (local.inner.clone(), range.start as u64, len);
            rma.start_get(link, &key.id, offset, dst, done.clone())?;
        }
        Ok(done)
    }

    /// A put or get with device memory on either side: one GPU copy by
    /// the transport that carries device memory to the peer, where one
    /// does and takes it; else the host-staged path: the operation is
    /// emulated over the messages, and each side's device memory is copied
    /// through the device by its own process (a put's source out before
    /// the request leaves, a get's answer in when it lands, the target's
    /// memory by the target).
    #[allow(clippy::too_many_arguments)]
    fn start_device_rma(
        &self,
        local: &MemoryRegion,
        start: usize,
        len: usize,
        key: &RemoteKey,
        offset: u64,
        put: bool,
        implicit: bool,
    ) -> Result<Option<Arc<Completion>>> {
        if self.0.core.is_closed() {
            return Err(Error::Closed);
        }
        self.check_not_lost()?;
        let Some(gpu) = &self.0.gpu else {
            return self.staged_rma(local, start, len, key, offset, put, implicit);
        };
        let at = Local {
            region: &local.inner,
            offset: start as u64,
            raw: crate::sys::mem::RawBuf::empty(),
            len,
        };
        let op = OneSided::put_or_get(put, at, key, offset);
        let c = &self.0.core.counters;
        match gpu.post(op, None)? {
            Native::Done(_) => {
                c.add(if put {
                    Hot::DirectPuts
                } else {
                    Hot::DirectGets
                });
                Ok(None)
            }
            Native::Posted(done) => {
                // Counted by the transport when its copy is queued (it may
                // wait for a handshake and go through the host after all).
                self.0.core.rma.track(self.0.peer, done.clone(), implicit);
                Ok((!implicit).then_some(done))
            }
            Native::Counted => Err(uncounted()),
            Native::Emulate => self.staged_rma(local, start, len, key, offset, put, implicit),
        }
    }

    /// The host-staged path of [`start_device_rma`](Self::start_device_rma).
    #[allow(clippy::too_many_arguments)]
    fn staged_rma(
        &self,
        local: &MemoryRegion,
        start: usize,
        len: usize,
        key: &RemoteKey,
        offset: u64,
        put: bool,
        implicit: bool,
    ) -> Result<Option<Arc<Completion>>> {
        let done = (!implicit).then(Completion::new);
        self.0.core.emulate_staged(
            &*self.0.link,
            (&local.inner, start as u64, len),
            &key.id,
            offset,
            put,
            done.clone(),
        )?;
        Ok(done)
    }

    fn rma(
        &self,
        local: &MemoryRegion,
        range: Range<usize>,
        key: &RemoteKey,
        offset: u64,
        put: bool,
    ) -> OpState {
        match self.start_rma(local, range, key, offset, put, false) {
            Err(e) => OpState::Ready(Some(Err(e))),
            Ok(None) => OpState::Ready(Some(Ok(()))),
            Ok(Some(done)) => {
                // (A link that gathers has no single copy: no case to tell
                // apart here.)
                let gathered = self.0.link.gathers().then(|| self.0.link.clone());
                OpState::Wait(done, self.0.core.clone(), gathered, OP_UNSEEN)
            }
        }
    }

    /// Start a put of `local[range]` into the peer's region `remote` at
    /// `offset` with no future of its own (UCX's `ucp_put_nbi`, a bare
    /// `MPI_Put`): the next [`flush`](Self::flush) to this peer resolves
    /// once it is in the target's memory, and fails with [`Error::Access`]
    /// if the target refused it (its memory untouched).
    ///
    /// What can be checked here fails here: a local range outside `local`,
    /// a range outside the key's bounds, a key of another rank, a lost
    /// peer. Into a region the peer shares on this node it is one copy, done
    /// on return. Over messages (emulated) no answer is sent per put, so a
    /// burst of small puts costs a fraction of as many [`put`](Self::put)
    /// futures.
    ///
    /// The bytes are copied out of `local` before this returns, except for
    /// a single-copy (CMA) put of `BTL_SM_CMA_MIN` bytes or more, which the
    /// target reads later: leave those bytes alone until the flush. The
    /// region's memory is kept alive until then either way.
    pub fn put_nbi(
        &self,
        local: &MemoryRegion,
        range: Range<usize>,
        remote: &RemoteKey,
        offset: u64,
    ) -> Result<()> {
        self.start_rma(local, range, remote, offset, true, true)
            .map(drop)
    }

    /// Start a get of the peer's region `remote` at `offset` into
    /// `local[range]` with no future of its own (UCX's `ucp_get_nbi`): the
    /// data is in `local` once the next [`flush`](Self::flush) to this
    /// peer resolves, and a refused get fails that flush. Errors that can
    /// be found here are returned at once, as for
    /// [`put_nbi`](Self::put_nbi); `local` is kept alive until the data
    /// lands.
    pub fn get_nbi(
        &self,
        local: &MemoryRegion,
        range: Range<usize>,
        remote: &RemoteKey,
        offset: u64,
    ) -> Result<()> {
        self.start_rma(local, range, remote, offset, false, true)
            .map(drop)
    }

    /// Check an atomic's key and word, then offer it to the transport:
    /// `Ok(Ok(old))` when it was done natively, `Ok(Err(Some(slot)))` when
    /// the transport posted it, `Ok(Err(None))` when it must be emulated.
    /// `PeerLost` with its cause once the core declared the peer lost (a
    /// transport may not know yet: a peer that dropped its fabric told the
    /// core alone), so that nothing new waits on it.
    fn check_not_lost(&self) -> Result<()> {
        if self.0.core.is_gone(self.0.peer) {
            if let Some(reason) = self.0.core.lost_reason(self.0.peer) {
                return Err(Error::PeerLost {
                    rank: self.0.peer,
                    reason,
                });
            }
        }
        Ok(())
    }

    fn start_atomic(
        &self,
        key: &RemoteKey,
        offset: u64,
        op: AtomicOp,
    ) -> Result<std::result::Result<u64, Option<Arc<Completion>>>> {
        self.check_key(key, offset, 8)?;
        if offset % 8 != 0 {
            return Err(AccessError::Misaligned { offset }.into());
        }
        let c = &self.0.core.counters;
        if let Some(m) = key.mapped_for(self.0.core.job_tag) {
            if !self.0.core.is_gone(self.0.peer) {
                m.check_live()?;
                let old = m.data().atomic(offset, op)?;
                c.add(Hot::NativeAtomics);
                return Ok(Ok(old));
            }
        }
        if key.on_device() {
            return Err(Error::Misuse(
                "atomics on device memory are not supported".into(),
            ));
        }
        if self.0.core.is_closed() {
            return Err(Error::Closed);
        }
        self.check_not_lost()?;
        match self
            .0
            .rma
            .post(OneSided::Atomic { key, offset, op }, None)?
        {
            Native::Done(old) => {
                c.add(Hot::NativeAtomics);
                Ok(Ok(old))
            }
            Native::Posted(done) => {
                c.add(Hot::NativeAtomics);
                Ok(Err(Some(done)))
            }
            Native::Counted => Err(uncounted()),
            Native::Emulate => {
                c.add(Hot::EmulatedAtomics);
                Ok(Err(None))
            }
        }
    }

    fn atomic(&self, key: &RemoteKey, offset: u64, op: AtomicOp) -> AtomicFetch {
        AtomicFetch(match self.start_atomic(key, offset, op) {
            Err(e) => AtomicState::Ready(Some(Err(e))),
            Ok(Ok(old)) => AtomicState::Ready(Some(Ok(old))),
            Ok(Err(posted)) => {
                let link = &*self.0.link;
                let (done, gathered) = match posted {
                    Some(done) => {
                        self.0.core.rma.track(self.0.peer, done.clone(), false);
                        (done, None)
                    }
                    None => {
                        let done = Completion::new();
                        let rma = &self.0.core.rma;
                        rma.start_atomic(link, &key.id, offset, op, done.clone());
                        (done, link.gathers().then(|| self.0.link.clone()))
                    }
                };
                AtomicState::Wait(OpState::Wait(
                    done,
                    self.0.core.clone(),
                    gathered,
                    OP_UNSEEN,
                ))
            }
        })
    }

    /// Atomically add `value` (wrapping) to the 8-byte word at `offset` of
    /// the peer's region `remote`; resolves to the word's previous value
    /// once the add is done at the target (remote completion), like
    /// `MPI_Fetch_and_op(MPI_SUM)`, `shmem_atomic_fetch_add` and UCX's
    /// `ucp_atomic_op_nbx(UCP_ATOMIC_OP_ADD)` with a result buffer.
    ///
    /// The word must be 8-byte aligned (`offset` a multiple of 8 in a
    /// region whose start is, as every fabric-allocated region's is) and
    /// inside the key's bounds, else it fails with [`Error::Access`]
    /// (`Misaligned`, `OutOfBounds`, `UnknownKey`) and nothing changes.
    /// Atomics on one word are atomic with each other from every rank and
    /// every transport: into a region a peer on this node shares
    /// ([`Fabric::alloc_region`](crate::Fabric::alloc_region)) they are one
    /// hardware atomic instruction on its mapping; otherwise the target
    /// applies the same instruction on the initiator's behalf. They are
    /// not atomic with plain `put`s or local writes of the same word.
    /// Words are native-endian (little-endian on every supported CPU).
    ///
    /// ```no_run
    /// # async fn demo(f: &async_btl::Fabric, key: &async_btl::RemoteKey) -> async_btl::Result<()> {
    /// // A shared ticket counter in rank 0's region: each caller gets a
    /// // distinct ticket.
    /// let ticket = f.endpoint(0)?.fetch_add(key, 0, 1).await?;
    /// # let _ = ticket; Ok(()) }
    /// ```
    pub fn fetch_add(&self, remote: &RemoteKey, offset: u64, value: u64) -> AtomicFetch {
        self.atomic(remote, offset, AtomicOp::Add(value))
    }

    /// Atomically store `new` in the 8-byte word at `offset` of the peer's
    /// region if it holds `expected`; resolves to the word's previous value
    /// (equal to `expected` exactly when the swap happened). The rules of
    /// [`fetch_add`](Self::fetch_add) apply.
    ///
    /// ```no_run
    /// # async fn demo(ep: &async_btl::Endpoint, lock: &async_btl::RemoteKey) -> async_btl::Result<()> {
    /// // A spin lock: 0 is free, 1 is held.
    /// while ep.compare_swap(lock, 0, 0, 1).await? != 0 {
    ///     tokio::task::yield_now().await;
    /// }
    /// // ... the critical section ...
    /// ep.swap(lock, 0, 0).await?; // release
    /// # Ok(()) }
    /// ```
    pub fn compare_swap(
        &self,
        remote: &RemoteKey,
        offset: u64,
        expected: u64,
        new: u64,
    ) -> AtomicFetch {
        self.atomic(remote, offset, AtomicOp::CompareSwap { expected, new })
    }

    /// Atomically store `value` in the 8-byte word at `offset` of the
    /// peer's region; resolves to the word's previous value. The rules of
    /// [`fetch_add`](Self::fetch_add) apply.
    pub fn swap(&self, remote: &RemoteKey, offset: u64, value: u64) -> AtomicFetch {
        self.atomic(remote, offset, AtomicOp::Swap(value))
    }

    /// Atomically add `value` to the 8-byte word at `offset` of the peer's
    /// region with no future and no result (`shmem_atomic_add`,
    /// `MPI_Accumulate` then a flush, UCX's `ucp_atomic_post`): the next
    /// [`flush`](Self::flush) to this peer resolves once it is done at the
    /// target, and fails with [`Error::Access`] if the target refused it.
    /// What can be checked here (bounds, alignment, owner, a lost peer)
    /// fails here. Over messages a burst of these costs one request each
    /// and no answer.
    pub fn atomic_add_nbi(&self, remote: &RemoteKey, offset: u64, value: u64) -> Result<()> {
        let op = AtomicOp::Add(value);
        match self.start_atomic(remote, offset, op)? {
            Ok(_) => Ok(()),
            Err(Some(done)) => {
                self.0.core.rma.track(self.0.peer, done, true);
                Ok(())
            }
            Err(None) => self
                .0
                .core
                .rma
                .atomic_implicit(&*self.0.link, &remote.id, offset, op),
        }
    }

    /// Resolves once every send queued to this peer has been handed over and
    /// every put/get to it has completed (including those whose futures
    /// were dropped, and the implicit ones of [`put_nbi`](Self::put_nbi)
    /// and [`get_nbi`](Self::get_nbi) started before this call); fails
    /// with `PeerLost` if the peer is gone, and with the error of the first
    /// implicit operation that failed since the last flush that reported
    /// one.
    pub fn flush(&self) -> Flush {
        Flush {
            ep: self.0.clone(),
            tick: None,
            asked: false,
        }
    }
}

/// A transport answered [`Native::Counted`] for an operation it was given
/// no tally for: a fault of that transport, reported rather than trusted.
fn uncounted() -> Error {
    Error::Misuse("a transport counted an operation it was given no tally for".into())
}

/// Count one unit of tokio's cooperative budget for an operation whose
/// result is in hand: `Ready(())` to return it now, `Pending` (the task is
/// woken at once) when the task used up its budget, so that a loop of
/// operations that complete at once (copies and atomics into a mapped
/// region) still lets the runtime's other tasks run. Outside a tokio
/// runtime it always proceeds.
#[inline]
fn budget(cx: &mut Context<'_>) -> Poll<()> {
    match tokio::task::coop::poll_proceed(cx) {
        Poll::Ready(restore) => {
            restore.made_progress();
            Poll::Ready(())
        }
        Poll::Pending => Poll::Pending,
    }
}

enum SendState {
    Start { tag: Tag, data: Bytes },
    Wait(Arc<Completion>),
    Done,
}

/// An [`Endpoint`] as a [`futures::Sink`] of `(tag, bytes)` messages
/// ([`Endpoint::into_sink`]): one send in flight at a time, so the sink's
/// readiness is the previous send's completion (backpressure from a slow
/// receiver reaches the stream that feeds it). Messages keep their order.
///
/// ```no_run
/// # async fn demo(f: &async_btl::Fabric) -> async_btl::Result<()> {
/// use futures::{stream, SinkExt, StreamExt};
/// let mut sink = f.endpoint(1)?.into_sink();
/// let mut msgs = stream::iter((0..100u32).map(|i| Ok((7, bytes::Bytes::from(i.to_le_bytes().to_vec())))));
/// sink.send_all(&mut msgs).await?; // and flushed: the last one sent
/// # Ok(()) }
/// ```
///
/// # Cancel safety
/// Dropping the sink drops the send in flight, which goes on as a dropped
/// [`SendFuture`] does (queued messages are still sent).
#[must_use = "a sink does nothing unless messages are sent into it"]
pub struct SendSink {
    ep: Endpoint,
    inflight: Option<SendFuture>,
}

impl SendSink {
    /// The endpoint the sink sends through.
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    fn poll_inflight(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(f) = self.inflight.as_mut() {
            let r = std::task::ready!(Pin::new(f).poll(cx));
            self.inflight = None;
            r?;
        }
        Poll::Ready(Ok(()))
    }
}

impl futures::Sink<(Tag, Bytes)> for SendSink {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_inflight(cx)
    }

    fn start_send(self: Pin<&mut Self>, (tag, data): (Tag, Bytes)) -> Result<()> {
        let me = self.get_mut();
        if me.inflight.is_some() {
            return Err(Error::Misuse(
                "SendSink::start_send without poll_ready after the previous send".into(),
            ));
        }
        me.inflight = Some(me.ep.send(tag, data));
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_inflight(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_inflight(cx)
    }
}

/// Future of [`Endpoint::send`].
///
/// # Cancel safety
/// Dropped before its first poll, nothing is sent. Once polled, the message
/// is owned by the transport (the `Bytes` is kept, never freed early) and is
/// delivered even if the future is dropped.
///
/// # Cooperation
/// A send that finds room completes at its first poll without consuming
/// tokio's cooperative budget (streams of sends would pay a scheduler
/// round trip every 128 of them); a send loop yields when the peer's
/// queue fills and the send waits. A loop that must yield regardless
/// should await `tokio::task::consume_budget()` itself.
#[must_use = "futures do nothing unless polled"]
pub struct SendFuture {
    state: SendState,
    ep: Arc<Inner>,
    seen: u64,
}

impl Future for SendFuture {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            match std::mem::replace(&mut self.state, SendState::Done) {
                SendState::Start { tag, data } => {
                    match self.ep.link.submit(Kind::User, tag, data) {
                        Ok(None) => return Poll::Ready(Ok(())),
                        Ok(Some(c)) => self.state = SendState::Wait(c),
                        Err(e) => return Poll::Ready(Err(e)),
                    }
                }
                SendState::Wait(c) => {
                    let this = &mut *self;
                    let p = wait(&c, &this.ep.core, &mut this.seen, cx);
                    if p.is_pending() {
                        self.state = SendState::Wait(c);
                    }
                    return p;
                }
                SendState::Done => {
                    return Poll::Ready(Err(Error::Misuse(
                        "send future polled after completion".into(),
                    )))
                }
            }
        }
    }
}

/// Future of [`Endpoint::send_inline`].
///
/// # Cancel safety
/// Dropped before it first returns `Pending`, either nothing or the whole
/// message was sent (never part). After a `Pending`, the bytes were copied
/// and queued; they are delivered even if the future is dropped.
///
/// # Cooperation
/// As for [`SendFuture`].
#[must_use = "futures do nothing unless polled"]
pub struct SendInlineFuture<'a> {
    ep: &'a Inner,
    tag: Tag,
    data: &'a [u8],
    queued: Option<Arc<Completion>>,
    seen: u64,
}

impl Future for SendInlineFuture<'_> {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        if let Some(c) = &this.queued {
            return wait(c, &this.ep.core, &mut this.seen, cx);
        }
        match self.ep.link.try_send(Kind::User, self.tag, self.data) {
            Ok(true) => return Poll::Ready(Ok(())),
            Ok(false) => {}
            Err(e) => return Poll::Ready(Err(e)),
        }
        match self
            .ep
            .link
            .submit(Kind::User, self.tag, Bytes::copy_from_slice(self.data))
        {
            Ok(None) => Poll::Ready(Ok(())),
            Ok(Some(c)) => {
                let this = &mut *self;
                let p = wait(&c, &this.ep.core, &mut this.seen, cx);
                this.queued = Some(c);
                p
            }
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

/// Poll a completion; if it is not done, run progress inline once (unless
/// another waiting future did since this one's last poll: `seen`, see
/// `Dispatcher::progress_inline_for_op`) and look again, and keep the task
/// hot while traffic flows.
fn wait(c: &Completion, core: &Core, seen: &mut u64, cx: &mut Context<'_>) -> Poll<Result<()>> {
    if let Poll::Ready(r) = c.poll(cx) {
        return Poll::Ready(r);
    }
    if !core.is_closed() && core.dispatcher.progress_inline_for_op(seen) {
        if let Poll::Ready(r) = c.poll(cx) {
            return Poll::Ready(r);
        }
    }
    core.dispatcher.stay_hot(cx);
    Poll::Pending
}

enum OpState {
    Ready(Option<Result<()>>),
    /// The completion, the core, the link whose held bundle the request
    /// may be in (until the first poll: see [`Link::gathers`]), and what
    /// the future has seen of inline progress (see `wait`).
    Wait(Arc<Completion>, Arc<Core>, Option<Arc<dyn Link>>, u64),
}

impl OpState {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match self {
            OpState::Ready(r) => {
                // Done when the future was made (a copy into a mapped
                // region): still one unit of the task's budget.
                if r.is_some() && budget(cx).is_pending() {
                    return Poll::Pending;
                }
                Poll::Ready(r.take().unwrap_or_else(|| {
                    Err(Error::Misuse("operation polled after completion".into()))
                }))
            }
            OpState::Wait(c, core, gathered, seen) => {
                if let Some(link) = gathered.take() {
                    // Every request started before this first poll is in
                    // the bundle (an operation is started when its future
                    // is made): the burst leaves together, now. (Returning
                    // to the runtime first, for a burst still to come,
                    // would cost a lone `put(..).await` a wake-up of tens
                    // of µs: the progress task would take the core between.)
                    link.flush_gathered();
                }
                wait(c, core, seen, cx)
            }
        }
    }
}

/// How a [`Endpoint::send_region`] started.
enum SendStart {
    /// The bytes, to carry as a message.
    Carried(Bytes),
    /// Lent: resolves when the receiver answers.
    Lent(Arc<Completion>),
}

enum SendRegionState {
    /// Not polled yet: nothing sent.
    Start {
        ep: Endpoint,
        tag: Tag,
        region: MemoryRegion,
        range: Range<usize>,
    },
    Carried(SendFuture),
    Lent(OpState),
}

/// Future of [`Endpoint::send_region`].
///
/// # Cancel safety
/// Dropped before its first poll, nothing is sent. At the first poll the
/// message takes its place in the tag's order: a carried one (host memory,
/// or device memory staged through the host) is copied out and then goes
/// as a [`SendFuture`]'s does; a lent one (device memory to a peer on this
/// node) is announced, and dropping the future does not take it back: the
/// region's memory is kept alive until the receiver has taken the bytes or
/// declined them, or is lost, whatever the caller drops. Leave those bytes
/// alone until then.
#[must_use = "futures do nothing unless polled"]
pub struct SendRegion(SendRegionState);

impl Future for SendRegion {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let SendRegionState::Start {
            ep,
            tag,
            region,
            range,
        } = &self.0
        {
            let next = ep.first_send_region(*tag, region, range.clone());
            self.0 = next;
        }
        match &mut self.0 {
            SendRegionState::Carried(s) => Pin::new(s).poll(cx),
            SendRegionState::Lent(op) => op.poll(cx),
            // Replaced just above.
            SendRegionState::Start { .. } => Poll::Pending,
        }
    }
}

/// Future of [`Endpoint::put`].
///
/// # Cancel safety
/// The put is started when the future is created (validation, and into a
/// mapped shared region the copy itself). Dropping the future does not stop
/// a put in flight. Small puts copy the data out of the local region at
/// once; a single-copy (CMA) put of `BTL_SM_CMA_MIN` bytes or more lets the
/// target read the region later, so do not change those bytes until the put
/// resolves. Either way the region's memory stays alive until the target is
/// done with it, even if every handle is dropped.
#[must_use = "futures do nothing unless polled"]
pub struct Put(OpState);

impl Future for Put {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.0.poll(cx)
    }
}

/// Future of [`Endpoint::get`].
///
/// # Cancel safety
/// The get is started when the future is created. Dropping the future does
/// not stop it: the operation keeps the local region alive until the data
/// lands or the peer is lost, so no freed memory is ever written.
#[must_use = "futures do nothing unless polled"]
pub struct Get(OpState);

impl Future for Get {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.0.poll(cx)
    }
}

enum AtomicState {
    Ready(Option<Result<u64>>),
    /// Waiting on an emulated atomic: an [`OpState::Wait`], whose
    /// completion carries the previous value.
    Wait(OpState),
}

/// Future of [`Endpoint::fetch_add`], [`Endpoint::compare_swap`] and
/// [`Endpoint::swap`]: resolves to the word's previous value at remote
/// completion.
///
/// # Cancel safety
/// The atomic is started when the future is created (natively into a
/// mapped region it is done by then). Dropping the future does not undo
/// or stop it; only its result is lost.
#[must_use = "futures do nothing unless polled"]
pub struct AtomicFetch(AtomicState);

impl Future for AtomicFetch {
    type Output = Result<u64>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<u64>> {
        match &mut self.0 {
            AtomicState::Ready(r) => {
                // Done when the future was made (an atomic on a mapped
                // word): still one unit of the task's budget.
                if r.is_some() && budget(cx).is_pending() {
                    return Poll::Pending;
                }
                Poll::Ready(
                    r.take().unwrap_or_else(|| {
                        Err(Error::Misuse("atomic polled after completion".into()))
                    }),
                )
            }
            AtomicState::Wait(op) => match op.poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => match op {
                    OpState::Wait(c, ..) => Poll::Ready(Ok(c.value())),
                    OpState::Ready(_) => {
                        Poll::Ready(Err(Error::Misuse("atomic polled after completion".into())))
                    }
                },
            },
        }
    }
}

/// Future of [`Endpoint::flush`].
///
/// Like `MPI_Win_flush`, it completes what was started: puts and gets
/// whose futures were dropped after their first poll still complete, and
/// the flush waits for them (a `put` loop then `flush` is the one-sided
/// pattern; keep the futures to see each operation's own error).
///
/// # Cancel safety
/// Waiting only (it may send requests held back for their burst, which
/// would have left at the next progress call anyway, and once a request
/// that asks the peer to confirm implicit puts); dropping it changes
/// nothing the next flush would not redo. A failure of an implicit
/// operation it would have reported waits for the next flush.
#[must_use = "futures do nothing unless polled"]
pub struct Flush {
    ep: Arc<Inner>,
    tick: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether the first poll asked the peer to confirm implicit puts.
    asked: bool,
}

impl Flush {
    /// Whether the peer took everything: `Some` when the flush is over.
    fn over(&self) -> Option<Result<()>> {
        let peer = self.ep.peer;
        // (The flag without a lock first: a flush spins on this.)
        if self.ep.core.is_gone(peer) {
            if let Some(reason) = self.ep.core.lost_reason(peer) {
                return Some(Err(Error::PeerLost { rank: peer, reason }));
            }
        }
        if !self.ep.link.has_queued() && self.ep.core.rma.idle(peer) {
            return Some(self.ep.core.rma.take_failure(peer).map_or(Ok(()), Err));
        }
        if self.ep.core.is_closed() {
            return Some(Err(Error::Closed));
        }
        None
    }
}

/// Progress turns a flush runs inline per poll while each finds work.
const FLUSH_TURNS: usize = 16;

impl Future for Flush {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.asked && self.ep.core.is_closed() {
            // As send and put: nothing can be flushed through a closed
            // fabric (one started before the close still reports how the
            // drain went).
            return Poll::Ready(Err(Error::Closed));
        }
        if !self.asked {
            // One unit of the task's budget per flush: a `put_nbi` loop
            // with a flush per window, all done at once into a mapped
            // region, still lets other tasks run.
            if budget(cx).is_pending() {
                return Poll::Pending;
            }
            // Behind every implicit put sent so far (in the bundle that
            // holds the last of them, if it is still open): the answer
            // confirms them (the pending request keeps `over` false until
            // then).
            self.asked = true;
            if let Err(e) = self.ep.core.rma.flush_request(&*self.ep.link) {
                return Poll::Ready(Err(e));
            }
        }
        // Requests held back to leave with their burst (implicit puts,
        // puts whose futures were dropped unpolled, the flush request)
        // leave now: the burst is over.
        self.ep.link.flush_gathered();
        if let Some(r) = self.over() {
            return Poll::Ready(r);
        }
        // Make progress here, as the futures of the operations would, and
        // keep polling while traffic is hot (MPI_Win_flush spins too).
        for _ in 0..FLUSH_TURNS {
            if !self.ep.core.dispatcher.progress_inline() {
                break;
            }
            if let Some(r) = self.over() {
                return Poll::Ready(r);
            }
        }
        if self.ep.core.dispatcher.stay_hot(cx) {
            return Poll::Pending;
        }
        loop {
            // Cold: be woken by the oldest implicit operation a transport
            // still runs natively, when there is one (its completion found
            // by the progress task); else, and as a fallback, re-check on
            // a short timer (completions of many kinds feed this, and the
            // timer wheel rounds it up to its millisecond tick, longer
            // than a window of operations takes).
            self.ep.core.rma.wake_on_native(self.ep.peer, cx);
            // The last may have finished since the look above.
            if let Some(r) = self.over() {
                return Poll::Ready(r);
            }
            let tick = self.tick.get_or_insert_with(|| {
                Box::pin(tokio::time::sleep(std::time::Duration::from_micros(100)))
            });
            match tick.as_mut().poll(cx) {
                Poll::Ready(()) => self.tick = None,
                Poll::Pending => return Poll::Pending,
            }
            if let Some(r) = self.over() {
                return Poll::Ready(r);
            }
        }
    }
}

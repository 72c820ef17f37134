//! The `smcuda` transport: put and get between device regions of ranks on
//! one node, copied by the GPU through CUDA IPC, completed by the events
//! of the copies.
//!
//! It carries no messages (those go over `sm`) and no one-sided operations
//! on host memory; its links carry only operations with device memory on
//! both sides. A put or get is one copy queued on the stream of the local
//! region's device, between the local allocation and the peer's allocation
//! mapped here (`key::open`: from the mapping cache, or opened now: a VMM
//! descriptor fetched from the peer's share server, or the legacy handle in
//! the key), followed by an event; the progress task polls the events in
//! order and completes each operation when its event fired: then the bytes
//! are in the target's memory (put) or in ours (get). Each pending
//! operation holds its local region and the peer's mapping, so neither is
//! freed or unmapped while the GPU may still touch it, whatever the
//! future's owner drops.
//!
//! Parking: before the progress task sleeps, a host function queued on
//! every stream with work rings the transport's bell when the stream gets
//! there; an operation posted while armed queues one too, so no wake-up is
//! lost and an idle job takes no CPU.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::cache::Cache;
use super::gpu::{AllocKind, DeviceAlloc, Event, Gpu, GpuError, Mapping, Stream};
use super::handshake::{Caps, Handshake, Msg, State};
use super::key::{self, Exported, Handle};
use super::{IpcChoice, IPC_VAR};
use crate::core::completion::Completion;
use crate::core::fabric::Core;
use crate::core::region::{DeviceMemory, KeyHandle, KeyId, RegionInner};
use crate::error::AccessError;
use crate::sys::mem::RawBuf;
use crate::sys::os::ProcWatch;
use crate::sys::sync::lock;
use crate::transport::{Kind, Link, Loss, Native, OneSided, Peer, Transport};
use crate::{Error, Rank, Result};

/// The key handle's version.
const HANDLE_VERSION: u16 = 2;
/// Mapped peer allocations kept for reuse.
const CACHE_ENTRIES: usize = 256;

/// What a process publishes about its `smcuda` transport.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SmcudaAddr {
    pub(crate) node: String,
    pub(crate) netns: String,
    pub(crate) pid: u32,
    pub(crate) rank: Rank,
    /// Its side of the handshake (`handshake::Msg::Req`'s wire form).
    pub(crate) caps: Vec<u8>,
}

/// Device memory of ours behind a region: an allocation of the fabric's,
/// or part of one the user made and registered.
struct DeviceMem {
    gpu: Arc<dyn Gpu>,
    alloc: Option<DeviceAlloc>,
    /// Where the region starts in `alloc` (0 for the fabric's own).
    at: u64,
    /// Serves its descriptor; taken and dropped first, before the memory
    /// is freed or let go of.
    exported: Option<Exported>,
    len: usize,
}

impl DeviceMemory for DeviceMem {
    fn len(&self) -> usize {
        self.len
    }
    fn device(&self) -> u32 {
        self.alloc.as_ref().map_or(0, |a| a.device)
    }
    fn ptr(&self) -> u64 {
        self.alloc.as_ref().map_or(0, |a| a.ptr + self.at)
    }
    fn read(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        let a = self.alloc.as_ref().ok_or("freed")?;
        self.gpu
            .download(dst, a.ptr + self.at + offset)
            .map_err(|e| format!("reading device memory: {e}"))
    }
    fn write(&self, offset: u64, src: &[u8]) -> std::result::Result<(), String> {
        let a = self.alloc.as_ref().ok_or("freed")?;
        self.gpu
            .upload(a.ptr + self.at + offset, src)
            .map_err(|e| format!("writing device memory: {e}"))
    }
    fn read_raw(&self, offset: u64, dst: RawBuf) -> std::result::Result<(), String> {
        let a = self.alloc.as_ref().ok_or("freed")?;
        self.gpu
            .download_raw(dst, a.ptr + self.at + offset)
            .map_err(|e| format!("reading device memory: {e}"))
    }
    fn write_raw(&self, offset: u64, src: RawBuf) -> std::result::Result<(), String> {
        let a = self.alloc.as_ref().ok_or("freed")?;
        self.gpu
            .upload_raw(a.ptr + self.at + offset, src)
            .map_err(|e| format!("writing device memory: {e}"))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        drop(self.exported.take());
        if let Some(a) = self.alloc.take() {
            if a.adopted {
                if let Err(e) = self.gpu.release(a) {
                    tracing::warn!("smcuda: letting go of registered device memory: {e}");
                }
            } else if let Err(e) = self.gpu.free(a) {
                tracing::warn!("smcuda: freeing device memory: {e}");
            }
        }
    }
}

/// An operation whose copy is queued.
struct Pending {
    event: Event,
    done: Arc<Completion>,
    peer: Rank,
    /// Failed already (its peer was lost): the copy is still let finish
    /// before the memory it touches is let go.
    failed: bool,
    _mapping: Arc<Mapping>,
    _region: Arc<RegionInner>,
}

/// The `smcuda` transport of one process.
pub(crate) struct SmcudaTransport {
    core: Arc<Core>,
    gpu: Arc<dyn Gpu>,
    kind: AllocKind,
    /// The IPC this rank offers (`BTL_SMCUDA_IPC`).
    ipc: IpcChoice,
    streams: Mutex<HashMap<u32, Stream>>,
    cache: Mutex<Cache<Mapping>>,
    pending: Mutex<VecDeque<Pending>>,
    free_events: Mutex<Vec<(u32, Event)>>,
    armed: AtomicBool,
    bell: Arc<tokio::sync::Notify>,
    watches: Mutex<HashMap<Rank, ProcWatch>>,
    /// Peers whose device memory goes through the host, and why.
    staged: Mutex<HashMap<Rank, String>>,
    /// The IPC handshake with each peer a device operation went to, and
    /// the operations waiting for it to settle.
    handshakes: Mutex<HashMap<Rank, PeerIpc>>,
    /// Peers whose handshake settled on a message, whose waiting
    /// operations progress issues (not the receive path that took the
    /// answer: issuing opens the peer's memory).
    settle_due: Mutex<Vec<Rank>>,
    /// The host memory of the message links (`sm`'s segments) pinned for
    /// the device, so that the host-staged path's copies between device
    /// memory and fragments go by DMA; unpinned at shutdown.
    pinned: Mutex<Vec<RawBuf>>,
    /// A pin was refused (logged once).
    pin_refused: AtomicBool,
    /// Start addresses of the ranges `pin_staging` asked for.
    pin_tried: Mutex<std::collections::HashSet<usize>>,
}

/// Where the handshake with one peer stands.
struct PeerIpc {
    hs: Handshake,
    /// Operations posted before it settled, issued (or staged) once it
    /// has.
    waiting: Vec<Waiting>,
    /// When our request went out (for the answer's time limit).
    asked: Option<std::time::Instant>,
}

/// A put or get waiting for the handshake with its peer.
struct Waiting {
    region: Arc<RegionInner>,
    /// Where the local range starts in `region` (not in its allocation).
    at: u64,
    len: u64,
    handle: Handle,
    key: KeyId,
    /// The remote offset in the key's region.
    offset: u64,
    put: bool,
    done: Arc<Completion>,
}

/// What a device operation with a peer does now.
enum Go {
    /// Its copy is queued by IPC.
    Issue(Waiting),
    /// It goes through the host.
    Stage,
    /// It waits for the handshake, and completes through this.
    Wait(Arc<Completion>),
}

impl SmcudaTransport {
    /// The transport over `gpu`, offering its peers the IPC `ipc` names
    /// (an error when that is `vmm` and a device has no VMM).
    pub(crate) fn new(
        core: Arc<Core>,
        gpu: Arc<dyn Gpu>,
        ipc: IpcChoice,
    ) -> std::result::Result<Arc<SmcudaTransport>, String> {
        let all_vmm = gpu.devices().iter().all(|d| d.vmm);
        if ipc == IpcChoice::Vmm && !all_vmm {
            return Err(format!(
                "smcuda: {IPC_VAR}=vmm, but a device here has no VMM (virtual memory management)"
            ));
        }
        let kind = if all_vmm && matches!(ipc, IpcChoice::Auto | IpcChoice::Vmm) {
            AllocKind::Vmm
        } else {
            AllocKind::Legacy
        };
        Ok(Arc::new(SmcudaTransport {
            core,
            gpu,
            kind,
            ipc,
            streams: Mutex::new(HashMap::new()),
            cache: Mutex::new(Cache::new(CACHE_ENTRIES)),
            pending: Mutex::new(VecDeque::new()),
            free_events: Mutex::new(Vec::new()),
            armed: AtomicBool::new(false),
            bell: Arc::new(tokio::sync::Notify::new()),
            watches: Mutex::new(HashMap::new()),
            staged: Mutex::new(HashMap::new()),
            handshakes: Mutex::new(HashMap::new()),
            settle_due: Mutex::new(Vec::new()),
            pinned: Mutex::new(Vec::new()),
            pin_refused: AtomicBool::new(false),
            pin_tried: Mutex::new(std::collections::HashSet::new()),
        }))
    }

    fn gpu_error(what: &str, e: GpuError) -> Error {
        match e {
            GpuError::Refused(why) => {
                Error::Access(AccessError::NotPermitted(format!("smcuda: {what}: {why}")))
            }
            other => Error::Config(format!("smcuda: {what}: {other}")),
        }
    }

    fn stream(&self, device: u32) -> Result<Stream> {
        let mut s = lock(&self.streams);
        if let Some(st) = s.get(&device) {
            return Ok(*st);
        }
        let st = self
            .gpu
            .stream(device)
            .map_err(|e| Self::gpu_error("creating a stream", e))?;
        s.insert(device, st);
        Ok(st)
    }

    fn event(&self, device: u32) -> Result<Event> {
        let mut free = lock(&self.free_events);
        if let Some(i) = free.iter().position(|(d, _)| *d == device) {
            return Ok(free.swap_remove(i).1);
        }
        drop(free);
        self.gpu
            .event(device, false)
            .map_err(|e| Self::gpu_error("creating an event", e))
    }

    /// Queue the copy of one operation with peer `peer`.
    fn post_copy(&self, peer: Rank, op: OneSided<'_>) -> Result<Native> {
        let (local, key, offset, put) = match op {
            OneSided::Put { src, key, offset } => (src, key, offset, true),
            OneSided::Get { dst, key, offset } => (dst, key, offset, false),
            OneSided::Atomic { .. } => {
                return Err(Error::Misuse(
                    "atomics on device memory are not supported".into(),
                ))
            }
        };
        // A copy between device regions only; host memory on a side, or
        // a peer IPC is refused with, takes the host-staged path.
        if lock(&self.staged).contains_key(&peer) {
            return Ok(Native::Emulate);
        }
        let Some(mine) = local
            .region
            .device
            .as_ref()
            .and_then(|d| d.as_any().downcast_ref::<DeviceMem>())
        else {
            return Ok(Native::Emulate);
        };
        if mine.alloc.is_none() {
            return Err(Error::Misuse("the local device region was freed".into()));
        }
        let Some(kh) = key.handle("smcuda") else {
            return Ok(Native::Emulate);
        };
        let h = match (kh.version == HANDLE_VERSION).then(|| Handle::decode(&kh.data)) {
            Some(Ok(h)) => h,
            _ => {
                return Err(Error::Access(AccessError::NotPermitted(
                    "not a readable smcuda key handle".into(),
                )))
            }
        };
        let len = local.len as u64;
        // The key's own bounds were checked by the initiator; these are
        // the allocation's, which only the handle knows. From here on
        // `offset` is in the peer's allocation, not its region.
        let region_at = offset;
        let offset = h.offset.saturating_add(region_at);
        if !matches!(offset.checked_add(len), Some(end) if end <= h.len) {
            return Err(Error::Access(AccessError::OutOfBounds {
                offset: region_at,
                end: region_at.saturating_add(len),
                len: h.len.saturating_sub(h.offset),
            }));
        }
        if len == 0 {
            return Ok(Native::Done(0));
        }
        let w = Waiting {
            region: local.region.clone(),
            at: local.offset,
            len,
            handle: h,
            key: key.id,
            offset: region_at,
            put,
            done: Completion::new(),
        };
        match self.ipc_with(peer, w) {
            Go::Issue(w) => Ok(match self.issue(peer, &w)? {
                true => Native::Posted(w.done),
                false => Native::Emulate,
            }),
            Go::Stage => Ok(Native::Emulate),
            Go::Wait(done) => Ok(Native::Posted(done)),
        }
    }

    /// Queue the copy of `w` (IPC with `peer` accepted), to complete
    /// `w.done` when its event fired: `true`. `false`: opening the peer's
    /// memory was refused, and from now on operations with it are staged
    /// (`w` too: the caller's to do). An error is the operation's.
    fn issue(&self, peer: Rank, w: &Waiting) -> Result<bool> {
        let Waiting {
            region,
            at,
            len,
            handle: h,
            offset: region_at,
            put,
            done,
            ..
        } = w;
        let (at, len, region_at, put) = (*at, *len, *region_at, *put);
        let Some(mine) = region
            .device
            .as_ref()
            .and_then(|d| d.as_any().downcast_ref::<DeviceMem>())
        else {
            return Err(Error::Misuse("not a device region of smcuda's".into()));
        };
        let alloc = mine
            .alloc
            .as_ref()
            .ok_or_else(|| Error::Misuse("the local device region was freed".into()))?;
        let offset = h.offset.saturating_add(region_at);
        let device = alloc.device;
        let opened = key::open(
            &self.gpu,
            &mut lock(&self.cache),
            peer,
            h,
            self.core.job_tag(),
            device,
        );
        let mapping = match opened {
            Ok(m) => m,
            Err(GpuError::Refused(why)) => {
                self.stage(
                    peer,
                    format!("opening its device memory was refused: {why}"),
                );
                return Ok(false);
            }
            Err(GpuError::BadPointer(why)) => {
                tracing::debug!("smcuda: a key of rank {peer} names no memory it serves: {why}");
                return Err(Error::Access(AccessError::UnknownKey));
            }
            Err(e) => return Err(Self::gpu_error("opening the peer's device memory", e)),
        };
        // What the driver mapped bounds the copy too.
        if !matches!(offset.checked_add(len), Some(end) if end <= mapping.len()) {
            return Err(Error::Access(AccessError::OutOfBounds {
                offset: region_at,
                end: region_at.saturating_add(len),
                len: mapping.len().saturating_sub(h.offset),
            }));
        }
        let (theirs, ours) = (mapping.ptr() + offset, alloc.ptr + mine.at + at);
        let (dst, src) = if put { (theirs, ours) } else { (ours, theirs) };
        let stream = self.stream(device)?;
        let event = self.event(device)?;
        let queued = self
            .gpu
            .copy(stream, dst, src, len)
            .and_then(|_| self.gpu.record(event, stream));
        if let Err(e) = queued {
            lock(&self.free_events).push((device, event));
            return Err(Self::gpu_error("queueing the copy", e));
        }
        self.core.counters().add(if put {
            crate::core::stats::Hot::DirectPuts
        } else {
            crate::core::stats::Hot::DirectGets
        });
        lock(&self.pending).push_back(Pending {
            event,
            done: done.clone(),
            peer,
            failed: false,
            _mapping: mapping,
            _region: region.clone(),
        });
        if self.armed.load(Ordering::Acquire) {
            self.ring_when_done(stream);
        }
        Ok(true)
    }

    /// What device operation `w` with `peer` does now: issue it (IPC
    /// accepted), stage it (refused), or wait for the handshake, which
    /// the first operation with a peer starts (`w` is kept and issued or
    /// staged when it settles: see [`settled`](Self::settled)).
    fn ipc_with(&self, peer: Rank, w: Waiting) -> Go {
        // (Peers staged already were sent back by `post_copy`.)
        let mut all = lock(&self.handshakes);
        let p = all.entry(peer).or_insert_with(|| PeerIpc {
            hs: Handshake::new(self.core.rank(), peer),
            waiting: Vec::new(),
            asked: None,
        });
        match p.hs.state() {
            State::Ready(_) => return Go::Issue(w),
            State::Staged(_) => return Go::Stage,
            State::Init { .. } | State::Sent { .. } => {}
        }
        let done = w.done.clone();
        p.waiting.push(w);
        let req = p.hs.start(&self.caps());
        if req.is_some() {
            p.asked = Some(std::time::Instant::now());
        }
        drop(all);
        if let Some(req) = req {
            self.send_handshake(peer, &req);
        }
        Go::Wait(done)
    }

    fn send_handshake(&self, peer: Rank, m: &Msg) {
        if let Err(e) = self.core.send_control(peer, "smcuda", &m.encode()) {
            tracing::debug!("smcuda: sending the IPC handshake to rank {peer}: {e}");
        }
    }

    /// The handshake with `peer` settled (or was given up on): issue or
    /// stage what waited for it.
    fn settled(&self, peer: Rank) {
        let (outcome, waiting) = {
            let mut all = lock(&self.handshakes);
            let Some(p) = all.get_mut(&peer) else {
                return;
            };
            let outcome = match p.hs.state() {
                State::Ready(_) => Ok(()),
                State::Staged(why) => Err(why.clone()),
                State::Init { .. } | State::Sent { .. } => return,
            };
            p.asked = None;
            (outcome, std::mem::take(&mut p.waiting))
        };
        match outcome {
            Ok(()) => {
                for w in waiting {
                    // Once an open was refused, the rest go through the host.
                    if lock(&self.staged).contains_key(&peer) {
                        self.emulate(peer, w);
                        continue;
                    }
                    match self.issue(peer, &w) {
                        Ok(true) => {}
                        Ok(false) => self.emulate(peer, w),
                        Err(e) => w.done.complete(Err(e)),
                    }
                }
            }
            Err(why) => {
                self.stage(peer, why);
                for w in waiting {
                    self.emulate(peer, w);
                }
            }
        }
    }

    /// Take `w` by the host-staged path (its peer refused IPC after it
    /// was posted): the core emulates it over the messages' link, each
    /// side's device memory copied through its own device.
    fn emulate(&self, peer: Rank, w: Waiting) {
        let core = &self.core;
        let Some(link) = core.link(peer) else {
            w.done.complete(Err(Error::Closed));
            return;
        };
        let local = (&w.region, w.at, w.len as usize);
        let r = core.emulate_staged(&*link, local, &w.key, w.offset, w.put, Some(w.done.clone()));
        if let Err(e) = r {
            w.done.complete(Err(e));
        }
    }

    /// Handshakes that need a step without a message: a request again
    /// for operations still waiting (after `NotReady`, on the heartbeat,
    /// not at once), and the time limit on an answer.
    fn handshake_timers(&self) {
        let limit = self.core.config().answer_timeout;
        let mut requests = Vec::new();
        let mut expired = Vec::new();
        {
            let mut all = lock(&self.handshakes);
            let caps = self.caps();
            for (&peer, p) in all.iter_mut() {
                match p.hs.state() {
                    // Back at the start with operations waiting: after a
                    // `NotReady`, or our request was answered by theirs
                    // crossing it (the answer to theirs settled nothing).
                    State::Init { .. } if !p.waiting.is_empty() => {
                        if let Some(req) = p.hs.start(&caps) {
                            p.asked = Some(std::time::Instant::now());
                            requests.push((peer, req));
                        }
                    }
                    State::Sent { .. } if p.asked.is_some_and(|t| t.elapsed() > limit) => {
                        p.hs.give_up(format!(
                            "rank {peer} did not answer the IPC request within {limit:?}"
                        ));
                        expired.push(peer);
                    }
                    _ => {}
                }
            }
        }
        for (peer, req) in requests {
            self.send_handshake(peer, &req);
        }
        for peer in expired {
            self.settled(peer);
        }
    }

    /// Offer `len` bytes `at` bytes into allocation `a` to the peers under
    /// key id `id`: the region's memory and its key's handle. On failure
    /// `a` is given back (freed if ours, let go of if the user's).
    fn offer(
        &self,
        a: DeviceAlloc,
        at: u64,
        len: usize,
        id: &KeyId,
    ) -> Result<(Box<dyn DeviceMemory>, KeyHandle)> {
        let mut exported = match key::export(&*self.gpu, &a, *id, self.core.job_tag()) {
            Ok(x) => x,
            Err(e) => {
                let _ = if a.adopted {
                    self.gpu.release(a)
                } else {
                    self.gpu.free(a)
                };
                return Err(e);
            }
        };
        exported.handle.offset = at;
        let handle = KeyHandle::new("smcuda", HANDLE_VERSION, exported.handle.encode());
        let mem = DeviceMem {
            gpu: self.gpu.clone(),
            alloc: Some(a),
            at,
            exported: Some(exported),
            len,
        };
        Ok((Box::new(mem), handle))
    }

    /// Pin the host memory the message links build and read in-place
    /// messages in (`Link::fill_memory`: our `sm` segment and each peer's),
    /// once, before device memory exists here: the host-staged path copies
    /// between device memory and those fragments (puts and get answers
    /// read by the device straight into the fragment, and written from
    /// the fragment they arrive in), and from pageable memory the driver
    /// would copy through bounce buffers of its own. A refusal (a locked-
    /// memory limit, a driver that cannot pin shared mappings) is logged
    /// once; the copies then still work, slower.
    fn pin_staging(&self) {
        if self.core.is_closed() {
            // Nothing would unpin it.
            return;
        }
        let mut tried = lock(&self.pin_tried);
        let me = self.core.rank();
        for r in (0..self.core.size()).filter(|r| *r != me) {
            let Some(link) = self.core.link(r) else {
                continue;
            };
            for raw in link.fill_memory() {
                // Each range once, whatever came of it (our segment is in
                // every link; a refusal is not asked again).
                if raw.len() == 0 || !tried.insert(raw.addr()) {
                    continue;
                }
                match self.gpu.pin(raw) {
                    Ok(true) => lock(&self.pinned).push(raw),
                    Ok(false) => {}
                    Err(e) => {
                        if !self.pin_refused.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                "smcuda: pinning the message links' memory for the device refused ({e}): the host-staged path copies from pageable memory"
                            );
                        }
                    }
                }
            }
        }
    }

    /// From now on, operations with `peer` take the host-staged path.
    fn stage(&self, peer: Rank, why: String) {
        tracing::warn!(
            "smcuda: no CUDA IPC with rank {peer}, device memory goes through the host: {why}"
        );
        lock(&self.staged).insert(peer, why);
    }

    /// What this rank says of its GPU side in the handshake.
    fn caps(&self) -> Caps {
        let devs = self.gpu.devices();
        let first = devs.first();
        Caps {
            ready: first.is_some(),
            device: first.map_or([0; 16], |d| d.uuid),
            vmm: self.kind == AllocKind::Vmm && self.ipc != IpcChoice::Off,
            legacy: matches!(self.ipc, IpcChoice::Auto | IpcChoice::Legacy),
            mig: devs.iter().any(|d| d.mig),
            pidns: crate::sys::os::pid_namespace()
                .chars()
                .filter(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap_or(0),
        }
    }

    /// Whether our first device reaches the device with UUID `uuid`.
    fn reaches_device(&self, uuid: &[u8; 16]) -> bool {
        let devs = self.gpu.devices();
        match devs.iter().find(|d| &d.uuid == uuid) {
            Some(d) => self.gpu.can_access_peer(0, d.ordinal),
            None => false,
        }
    }

    /// Have `stream` ring our bell when it gets to the work queued now.
    fn ring_when_done(&self, stream: Stream) {
        let bell = self.bell.clone();
        if let Err(e) = self.gpu.notify(stream, Arc::new(move || bell.notify_one())) {
            // Without the host function the progress task still wakes at
            // its timeout.
            tracing::debug!("smcuda: queueing a wake-up: {e}");
            self.bell.notify_one();
        }
    }
}

/// The link to one peer.
struct SmcudaLink {
    peer: Rank,
    t: Arc<SmcudaTransport>,
}

impl Link for SmcudaLink {
    fn peer(&self) -> Rank {
        self.peer
    }
    fn transport(&self) -> &'static str {
        "smcuda"
    }
    fn try_send(&self, _kind: Kind, _tag: u64, _data: &[u8]) -> Result<bool> {
        Err(Error::Misuse("smcuda carries no messages".into()))
    }
    fn submit(
        &self,
        _kind: Kind,
        _tag: u64,
        _data: bytes::Bytes,
    ) -> Result<Option<Arc<Completion>>> {
        Err(Error::Misuse("smcuda carries no messages".into()))
    }
    fn post(
        &self,
        op: OneSided<'_>,
        _tally: Option<&Arc<crate::core::completion::Tally>>,
    ) -> Result<Native> {
        self.t.post_copy(self.peer, op)
    }
    fn has_queued(&self) -> bool {
        false
    }
    fn device_direct(&self) -> bool {
        !lock(&self.t.staged).contains_key(&self.peer)
    }
}

fn decode_addr(p: &Peer<'_>) -> Result<SmcudaAddr> {
    postcard::from_bytes(p.addr).map_err(|e| {
        Error::Bootstrap(format!(
            "rank {} published an unreadable smcuda address: {e}",
            p.rank
        ))
    })
}

#[async_trait]
impl Transport for SmcudaTransport {
    fn name(&self) -> &'static str {
        "smcuda"
    }

    fn address(&self) -> Result<Vec<u8>> {
        postcard::to_allocvec(&SmcudaAddr {
            node: crate::sys::os::node_id(),
            netns: crate::sys::os::net_namespace(),
            pid: crate::sys::os::pid(),
            rank: self.core.rank(),
            caps: Msg::Req(self.caps()).encode(),
        })
        .map_err(|e| Error::Bootstrap(format!("encoding the smcuda address: {e}")))
    }

    fn reaches(&self, peer: &Peer<'_>) -> Result<bool> {
        let a = decode_addr(peer)?;
        Ok(a.rank == peer.rank
            && peer.rank != self.core.rank()
            && a.node == crate::sys::os::node_id()
            && a.netns == crate::sys::os::net_namespace())
    }

    fn connect(self: Arc<Self>, peers: &[Peer<'_>]) -> Result<Vec<(Rank, Arc<dyn Link>)>> {
        let mut links: Vec<(Rank, Arc<dyn Link>)> = Vec::new();
        for p in peers {
            let a = decode_addr(p)?;
            lock(&self.watches).insert(p.rank, ProcWatch::new(a.pid));
            // Whether the pair uses IPC is settled by the handshake, on
            // its first device operation (`ipc_with`); the capabilities
            // published here are what `btl-info` and the logs show.
            match Msg::decode(&a.caps) {
                Ok(Msg::Req(_)) if self.ipc == IpcChoice::Off => {
                    self.stage(p.rank, format!("{IPC_VAR}=off on this rank"));
                }
                Ok(Msg::Req(_)) => {}
                _ => {
                    return Err(Error::Bootstrap(format!(
                        "rank {} published unreadable smcuda capabilities",
                        p.rank
                    )))
                }
            }
            links.push((
                p.rank,
                Arc::new(SmcudaLink {
                    peer: p.rank,
                    t: self.clone(),
                }),
            ));
        }
        Ok(links)
    }

    fn alloc_device(
        &self,
        device: u32,
        len: usize,
        id: &KeyId,
    ) -> Option<crate::transport::DeviceMade> {
        self.pin_staging();
        let made = self
            .gpu
            .alloc(device, len as u64, self.kind)
            .map_err(|e| Self::gpu_error("allocating device memory", e))
            .and_then(|a| self.offer(a, 0, len, id));
        Some(made)
    }

    fn register_device(
        &self,
        ptr: u64,
        len: usize,
        id: &KeyId,
    ) -> Option<crate::transport::DeviceMade> {
        self.pin_staging();
        let made = self
            .gpu
            .adopt(ptr, len as u64)
            .map_err(|e| Self::gpu_error("registering device memory", e))
            .and_then(|a| {
                let at = ptr - a.ptr;
                self.offer(a, at, len, id)
            });
        Some(made)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn progress(&self) -> usize {
        let due = std::mem::take(&mut *lock(&self.settle_due));
        let mut n = due.len();
        for peer in due {
            self.settled(peer);
        }
        let mut q = lock(&self.pending);
        while let Some(p) = q.front() {
            let r = self.gpu.query(p.event);
            if matches!(r, Ok(false)) {
                break;
            }
            let p = q.pop_front().expect("looked at above");
            if !p.failed {
                p.done.complete(match r {
                    Err(e) => Err(Self::gpu_error("the copy failed", e)),
                    _ => Ok(()),
                });
            }
            // Events come back to the pool by device; the stream's device
            // is the local region's.
            let device = p._region.device.as_ref().map_or(0, |d| d.device());
            lock(&self.free_events).push((device, p.event));
            n += 1;
        }
        n
    }

    fn arm(&self) -> bool {
        self.armed.store(true, Ordering::Release);
        if !lock(&self.settle_due).is_empty() {
            return false;
        }
        if lock(&self.pending).is_empty() {
            return true;
        }
        let streams: Vec<Stream> = lock(&self.streams).values().copied().collect();
        for s in streams {
            self.ring_when_done(s);
        }
        true
    }

    fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    async fn wait(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.bell.notified()).await;
    }

    fn on_control(&self, src: Rank, data: &[u8]) -> std::result::Result<(), String> {
        let msg = Msg::decode(data).map_err(|e| format!("an IPC handshake message: {e}"))?;
        if self.ipc == IpcChoice::Off {
            // Staged with every peer since connect: a request is refused
            // with the reason, anything else needs no answer.
            if let Msg::Req(_) = msg {
                let why = format!("{IPC_VAR}=off on rank {}", self.core.rank());
                self.send_handshake(src, &Msg::Refuse(why));
            }
            return Ok(());
        }
        let mut caps = self.caps();
        if let Msg::Req(_) = msg {
            // Asked once per request answered.
            caps.ready = caps.ready && self.gpu.ready();
        }
        let (reply, settled) = {
            let mut all = lock(&self.handshakes);
            let p = all.entry(src).or_insert_with(|| PeerIpc {
                hs: Handshake::new(self.core.rank(), src),
                waiting: Vec::new(),
                asked: None,
            });
            let before = p.hs.state().clone();
            let reply = p.hs.on_msg(msg, &caps, |u| self.reaches_device(u));
            let now = p.hs.state();
            let settled = matches!(now, State::Ready(_) | State::Staged(_)) && *now != before;
            // A `NotReady` answer sends us back to the start: asked again
            // on the heartbeat (`handshake_timers`).
            (reply, settled)
        };
        if let Some(r) = reply {
            self.send_handshake(src, &r);
        }
        if settled {
            // Issued by progress, off the message link's receive path.
            lock(&self.settle_due).push(src);
            self.bell.notify_one();
        }
        Ok(())
    }

    fn check_peers(&self) {
        self.handshake_timers();
        let dead: Vec<Rank> = lock(&self.watches)
            .iter()
            .filter(|(r, w)| !self.core.is_gone(**r) && w.exited())
            .map(|(r, _)| *r)
            .collect();
        for r in dead {
            self.core
                .on_peer_lost(r, "its process exited (smcuda)", Loss::Crashed);
        }
        let mut q = lock(&self.pending);
        let mut lost = Vec::new();
        for p in q
            .iter_mut()
            .filter(|p| !p.failed && self.core.is_gone(p.peer))
        {
            p.failed = true;
            lost.push((p.peer, p.done.clone()));
        }
        drop(q);
        for (peer, done) in lost {
            lock(&self.cache).forget(peer);
            done.complete(Err(Error::PeerLost {
                rank: peer,
                reason: "lost while a GPU copy with it was in flight".into(),
            }));
        }
        // Operations waiting for a lost peer's handshake answer.
        let waiting: Vec<(Rank, Waiting)> = lock(&self.handshakes)
            .iter_mut()
            .filter(|(r, p)| !p.waiting.is_empty() && self.core.is_gone(**r))
            .flat_map(|(r, p)| std::mem::take(&mut p.waiting).into_iter().map(|w| (*r, w)))
            .collect();
        for (peer, w) in waiting {
            w.done.complete(Err(Error::PeerLost {
                rank: peer,
                reason: "lost before it answered the IPC handshake".into(),
            }));
        }
    }

    fn drained(&self) -> bool {
        lock(&self.pending).is_empty()
            && lock(&self.handshakes)
                .values()
                .all(|p| p.waiting.is_empty())
    }

    fn shutdown(&self) {
        for raw in std::mem::take(&mut *lock(&self.pinned)) {
            if let Err(e) = self.gpu.unpin(raw) {
                tracing::debug!("smcuda: unpinning staging memory: {e}");
            }
        }
        // Operations still waiting for a handshake answer fail: nothing
        // will issue them now.
        let waiting: Vec<Waiting> = lock(&self.handshakes)
            .values_mut()
            .flat_map(|p| std::mem::take(&mut p.waiting))
            .collect();
        for w in waiting {
            w.done.complete(Err(Error::Closed));
        }
    }
}

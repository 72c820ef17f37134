//! Registered memory: [`MemoryRegion`] (owned, kept alive by every operation
//! that uses it) and [`RemoteKey`] (what a peer needs to reach it).
//!
//! A key names a region by a 128-bit random id, never by an address; the
//! owner looks the id up in its own table and checks the range on every
//! access, so a forged or stale key reaches nothing (except on device
//! memory, which the GPU copies without the owner's CPU: there the
//! transport's handle is checked by the initiator, and a peer that forges
//! one reaches the whole allocation it names; see
//! `Fabric::register_device`). Beside the id and the
//! bounds, a key carries one packed, versioned handle per transport that
//! registered the region (`sm`: what a same-node peer needs to map a
//! fabric-allocated region), which only that transport reads.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};

use crate::sys::mem::{HeapBuf, RawBuf};
use crate::sys::sync::{lock, Ordering};
use crate::{AccessError, Error, Rank, Result};

/// The 128-bit random identity of a region.
pub(crate) type KeyId = [u8; 16];

/// Most transport handles one key may carry (a decoded key with more is
/// refused).
const MAX_HANDLES: usize = 8;
/// Longest transport name in a handle.
const MAX_NAME: usize = 32;
/// Most bytes of one handle.
const MAX_HANDLE: usize = 1024;

/// One transport's packed handle for a region, inside a [`RemoteKey`]:
/// the transport's name, the version of its format, and its bytes (only
/// that transport reads them, and checks them before use).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct KeyHandle {
    pub(crate) transport: String,
    pub(crate) version: u16,
    pub(crate) data: Vec<u8>,
}

impl KeyHandle {
    pub(crate) fn new(transport: &str, version: u16, data: Vec<u8>) -> KeyHandle {
        KeyHandle {
            transport: transport.to_string(),
            version,
            data,
        }
    }
}

/// What a peer needs to `put` into, `get` from, or apply atomics to a
/// region: serde-serialisable, send it to peers in a message (or as bytes:
/// [`RemoteKey::to_bytes`]). Unguessable (128 random bits) and carrying
/// its bounds; the owner checks both on every access it serves, and a
/// transport that reaches the memory itself checks the real size.
///
/// A key to a region the peer shares (`Fabric::alloc_region`) on this node
/// keeps the mapping its first operation made, like UCX's unpacked remote
/// key: later operations through it (and its clones) skip the lookup and
/// are one bounds check, one revocation check and one copy. The mapping
/// goes when the last clone of the key is dropped. (It is not part of the
/// key's value: not serialised, not compared.)
#[derive(Clone, Serialize, Deserialize)]
pub struct RemoteKey {
    pub(crate) owner: Rank,
    pub(crate) id: KeyId,
    pub(crate) len: u64,
    /// One handle per transport that registered the region.
    pub(crate) handles: Vec<KeyHandle>,
    /// The mapping made on first use, with the job it was checked against.
    #[serde(skip)]
    mapped: std::sync::OnceLock<([u64; 2], Mapped)>,
}

impl PartialEq for RemoteKey {
    fn eq(&self, other: &Self) -> bool {
        (self.owner, self.id, self.len, &self.handles)
            == (other.owner, other.id, other.len, &other.handles)
    }
}

impl Eq for RemoteKey {}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKey")
            .field("owner", &self.owner)
            .field("len", &self.len)
            .field(
                "transports",
                &self
                    .handles
                    .iter()
                    .map(|h| &h.transport)
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl RemoteKey {
    /// The rank that owns the region.
    pub fn owner(&self) -> Rank {
        self.owner
    }
    /// The region's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Encode for sending (postcard).
    pub fn to_bytes(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }
    /// Decode what [`RemoteKey::to_bytes`] produced, exactly: anything else
    /// (trailing bytes, a number written longer than it needs, more than 8
    /// transport handles, a handle name over 32 bytes or a handle over
    /// 1 KiB) is an error, never a panic.
    pub fn from_bytes(b: &[u8]) -> Result<RemoteKey> {
        let bad = |why: String| Error::Misuse(format!("not a remote key: {why}"));
        let (key, rest): (RemoteKey, _) =
            postcard::take_from_bytes(b).map_err(|e| bad(e.to_string()))?;
        if !rest.is_empty() {
            return Err(bad(format!("{} bytes after the key", rest.len())));
        }
        key.validate().map_err(bad)?;
        // Postcard reads a varint padded with continuation bytes as the
        // same number: one key, one encoding.
        if key.to_bytes() != b {
            return Err(bad("a number written longer than it needs".into()));
        }
        Ok(key)
    }
    /// Refuse what no honest key holds.
    fn validate(&self) -> std::result::Result<(), String> {
        if self.handles.len() > MAX_HANDLES {
            return Err(format!("{} transport handles", self.handles.len()));
        }
        match self
            .handles
            .iter()
            .find(|h| h.transport.len() > MAX_NAME || h.data.len() > MAX_HANDLE)
        {
            Some(h) => Err(format!(
                "a transport handle of {} bytes named {} bytes long",
                h.data.len(),
                h.transport.len()
            )),
            None => Ok(()),
        }
    }
    /// The names of the transports that registered the region.
    pub fn transports(&self) -> impl Iterator<Item = &str> {
        self.handles.iter().map(|h| h.transport.as_str())
    }
    /// `transport`'s handle, if it registered the region.
    pub(crate) fn handle(&self, transport: &str) -> Option<&KeyHandle> {
        self.handles.iter().find(|h| h.transport == transport)
    }
    /// The mapping a transport made for this key on its first use, if it
    /// was made for the fabric of job `job_tag` (not checked for
    /// revocation: see [`Mapped::check_live`]).
    #[inline]
    pub(crate) fn mapped_for(&self, job_tag: [u64; 2]) -> Option<&Mapped> {
        match self.mapped.get() {
            Some((tag, m)) if *tag == job_tag => Some(m),
            _ => None,
        }
    }

    /// The peer's region mapped into this process for the fabric of job
    /// `job_tag`: the mapping this key made on first use, or a new one from
    /// `open` (which checks magic, job and owner) kept for next time. A
    /// revoked region (its owner dropped it) is an error, as is a key first
    /// used with another job's fabric (`open` refuses that region for this
    /// job).
    pub(crate) fn mapping(
        &self,
        job_tag: [u64; 2],
        open: impl FnOnce() -> Result<Mapped>,
    ) -> Result<&Mapped> {
        if let Some((tag, m)) = self.mapped.get() {
            if *tag == job_tag {
                m.check_live()?;
                return Ok(m);
            }
            // Mapped for another job: this one's checks decide.
            open()?;
            return Err(Error::Misuse(
                "this remote key was first used with another fabric's job".into(),
            ));
        }
        let m = open()?;
        // A racing first use may have set it: either mapping is the same
        // region, checked the same way.
        let _ = self.mapped.set((job_tag, m));
        match self.mapped.get() {
            Some((tag, m)) if *tag == job_tag => Ok(m),
            _ => Err(Error::Misuse(
                "this remote key was first used with another fabric's job".into(),
            )),
        }
    }

    /// Whether a transport registered the region for peers to map
    /// (`sm`'s shared files).
    pub(crate) fn is_shared(&self) -> bool {
        !self.handles.is_empty() && !self.on_device()
    }

    /// Whether the region lives in device (GPU) memory: a transport that
    /// carries device memory made it.
    pub(crate) fn on_device(&self) -> bool {
        self.handles
            .iter()
            .any(|h| crate::transport::registry::carries_device(&h.transport))
    }

    /// Check `offset..offset+len` against the key's stated bounds.
    pub(crate) fn check(&self, offset: u64, len: usize) -> Result<(), AccessError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(AccessError::OutOfBounds {
                offset,
                end: offset.saturating_add(len as u64),
                len: self.len,
            }),
        }
    }
}

/// What keeps a region's memory: a `Vec` (which [`MemoryRegion::try_into_vec`]
/// can give back), or any other owner (a registered buffer of another
/// type, a transport's shared file).
enum Backing {
    Heap(HeapBuf),
    /// Kept only to be dropped with the region.
    Owned {
        _keep: Box<dyn Any + Send + Sync>,
    },
}

/// A transport's registration of a region's memory with its hardware (a
/// NIC's memory registration), kept with the region: dropping it ends the
/// hardware's access, and it is always dropped before the memory is freed.
pub(crate) type NicReg = (&'static str, Box<dyn Any + Send + Sync>);

/// What registers a new region's memory with the transports that reach
/// peers' memory through hardware: their key handles and registrations.
pub(crate) type Registrar<'a> = &'a dyn Fn(&KeyId, RawBuf) -> (Vec<KeyHandle>, Vec<NicReg>);

/// A [`Registrar`] for a table no transport registers with.
pub(crate) fn no_nic(_: &KeyId, _: RawBuf) -> (Vec<KeyHandle>, Vec<NicReg>) {
    (Vec::new(), Vec::new())
}

/// Device memory behind a region, owned by the transport that allocated
/// it: the CPU never touches it (the region's `raw` is empty, so host
/// paths find nothing to copy), reads and writes go through the device,
/// and dropping it frees the memory. The region is dropped only after
/// every operation on it, so no copy still runs on freed memory.
pub(crate) trait DeviceMemory: Send + Sync {
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// The device it lives on.
    fn device(&self) -> u32;
    /// Its device address (as the CUDA driver API names it).
    fn ptr(&self) -> u64;
    /// Copy `dst.len()` bytes at `offset` out to the host (blocking).
    fn read(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String>;
    /// Copy `src` in at `offset` from the host (blocking).
    fn write(&self, offset: u64, src: &[u8]) -> std::result::Result<(), String>;
    /// Copy `dst.len()` bytes at `offset` out into host memory a peer may
    /// also reach (a fragment of `sm`), blocking.
    fn read_raw(&self, offset: u64, dst: RawBuf) -> std::result::Result<(), String>;
    /// Copy `src` (host memory a peer may also reach) in at `offset`,
    /// blocking.
    fn write_raw(&self, offset: u64, src: RawBuf) -> std::result::Result<(), String>;
    /// The transport's own type, for its own operations.
    fn as_any(&self) -> &dyn Any;
}

pub(crate) struct RegionInner {
    pub(crate) id: KeyId,
    /// The key peers use (handed out by `MemoryRegion::remote_key`).
    key: RemoteKey,
    /// The memory as the CPU reaches it (empty for device memory).
    raw: RawBuf,
    /// Device memory, for a region in a GPU's memory (declared before
    /// `backing`; dropped with the region).
    pub(crate) device: Option<Box<dyn DeviceMemory>>,
    /// Hardware registrations of `raw` (declared before `backing`, so
    /// dropped first: no NIC may still reach memory being freed).
    nic: Vec<NicReg>,
    backing: Option<Backing>,
    table: Weak<RegionTable>,
}

impl RegionInner {
    pub(crate) fn raw(&self) -> RawBuf {
        self.raw
    }

    /// Its length (device memory's, or the host range's).
    pub(crate) fn len(&self) -> usize {
        match &self.device {
            Some(d) => d.len(),
            None => self.raw.len(),
        }
    }

    /// `off..off+len` inside the region.
    fn check_range(&self, off: u64, len: usize) -> Result<(), AccessError> {
        match off.checked_add(len as u64) {
            Some(end) if end <= self.len() as u64 => Ok(()),
            _ => Err(AccessError::OutOfBounds {
                offset: off,
                end: off.saturating_add(len as u64),
                len: self.len() as u64,
            }),
        }
    }

    /// Write `src` at `off`: device memory through the device (the
    /// host-staged path of an operation no transport carries on the
    /// device), host memory by one copy.
    pub(crate) fn write_at(&self, off: u64, src: &[u8]) -> Result<(), AccessError> {
        match &self.device {
            Some(d) => {
                self.check_range(off, src.len())?;
                d.write(off, src).map_err(AccessError::NotPermitted)
            }
            None => self.raw.write(off, src),
        }
    }

    /// Write the bytes of `src` at `off`, straight from where they are
    /// (a message's bytes in a fragment of `sm`, not copied out first):
    /// device memory through the device, host memory by one copy.
    pub(crate) fn write_from(&self, off: u64, src: RawBuf) -> Result<(), AccessError> {
        match &self.device {
            Some(d) => {
                self.check_range(off, src.len())?;
                d.write_raw(off, src).map_err(AccessError::NotPermitted)
            }
            None => self.raw.copy_from(off, &src, 0, src.len()),
        }
    }

    /// Copy `dst.len()` bytes at `off` straight into `dst` (a fragment of
    /// `sm` a message is built in): device memory through the device.
    pub(crate) fn read_raw(&self, off: u64, dst: RawBuf) -> Result<(), AccessError> {
        match &self.device {
            Some(d) => {
                self.check_range(off, dst.len())?;
                d.read_raw(off, dst).map_err(AccessError::NotPermitted)
            }
            None => dst.copy_from(0, &self.raw, off, dst.len()),
        }
    }

    /// Append `len` bytes at `off` to `dst` (device memory through the
    /// device).
    pub(crate) fn read_to(
        &self,
        off: u64,
        len: usize,
        dst: &mut Vec<u8>,
    ) -> Result<(), AccessError> {
        match &self.device {
            Some(d) => {
                self.check_range(off, len)?;
                let at = dst.len();
                dst.resize(at + len, 0);
                d.read(off, &mut dst[at..]).map_err(|e| {
                    dst.truncate(at);
                    AccessError::NotPermitted(e)
                })
            }
            None => self.raw.read_into(off, len, dst),
        }
    }

    /// `transport`'s hardware registration of this region, if it made one.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn nic(&self, transport: &str) -> Option<&(dyn Any + Send + Sync)> {
        self.nic
            .iter()
            .find(|(t, _)| *t == transport)
            .map(|(_, r)| &**r)
    }
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        if let Some(t) = self.table.upgrade() {
            lock(&t.map).remove(&self.id);
        }
    }
}

/// A registered buffer. Cloning is cheap and shares the memory. The memory
/// lives until the last clone *and* every operation using it are gone, so
/// dropping a future can never free memory a peer may still write.
///
/// Contents are accessed by copy ([`MemoryRegion::read`],
/// [`MemoryRegion::write`]) because peers may write them at any time.
/// Nothing orders a peer's puts with a local `read`: learn that they are
/// done from a message the peer sends after its puts resolved.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> async_btl::Result<()> {
/// let fabric = async_btl::Fabric::single().await?;
/// let region = fabric.register(vec![0u8; 16]);
/// region.write(4, b"abcd")?;
/// let mut back = [0u8; 4];
/// region.read(4, &mut back)?;
/// assert_eq!(&back, b"abcd");
/// let vec = region.try_into_vec().expect("no clone and no operation holds it");
/// assert_eq!(&vec[4..8], b"abcd");
/// # fabric.close().await }
/// ```
#[derive(Clone)]
pub struct MemoryRegion {
    pub(crate) inner: Arc<RegionInner>,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.len())
            .field("shared", &self.inner.key.is_shared())
            .finish()
    }
}

impl MemoryRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.inner.device {
            Some(d) => d.len(),
            None => self.inner.raw.len(),
        }
    }
    /// The kind of memory the region lives in.
    pub fn memory(&self) -> crate::MemoryKind {
        match &self.inner.device {
            Some(d) => crate::MemoryKind::Device(d.device()),
            None => crate::MemoryKind::Host,
        }
    }
    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device address of a region in GPU memory (a `CUdeviceptr`:
    /// where kernels and CUDA copies of this process reach its first
    /// byte); `None` for host memory. The memory stays allocated while
    /// the region or a clone of it lives.
    pub fn device_ptr(&self) -> Option<u64> {
        self.inner.device.as_ref().map(|d| d.ptr())
    }
    /// The key peers use to reach this region.
    pub fn remote_key(&self) -> RemoteKey {
        self.inner.key.clone()
    }
    /// Whether peers on this node can map the region (one-copy put/get,
    /// hardware atomics).
    pub fn is_shared(&self) -> bool {
        self.inner.key.is_shared()
    }
    /// Copy `dst.len()` bytes from `offset` out of the region.
    ///
    /// # Errors
    /// [`Error::Misuse`] when `offset..offset + dst.len()` is not inside
    /// the region (nothing is copied).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if let Some(d) = &self.inner.device {
            self.check_local(offset, dst.len())?;
            return d.read(offset as u64, dst).map_err(Error::Misuse);
        }
        self.inner
            .raw
            .read(offset as u64, dst)
            .map_err(|_| self.local_range_error(offset, dst.len()))
    }
    /// Copy `src` into the region at `offset`.
    ///
    /// # Errors
    /// [`Error::Misuse`] when `offset..offset + src.len()` is not inside
    /// the region (nothing is written).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        if let Some(d) = &self.inner.device {
            self.check_local(offset, src.len())?;
            return d.write(offset as u64, src).map_err(Error::Misuse);
        }
        self.inner
            .raw
            .write(offset as u64, src)
            .map_err(|_| self.local_range_error(offset, src.len()))
    }

    /// `offset..offset + len` inside the region, or the caller's mistake.
    fn check_local(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(self.local_range_error(offset, len)),
        }
    }

    /// A local access outside the region: the caller's mistake, not a
    /// peer's refusal.
    fn local_range_error(&self, offset: usize, len: usize) -> Error {
        Error::Misuse(format!(
            "local range {offset}..{} is outside this {}-byte region",
            offset.saturating_add(len),
            self.len()
        ))
    }
    /// The whole region, copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        let _ = self.read(0, &mut v);
        v
    }
    /// Take a heap region's buffer back, if this is the only handle and no
    /// operation is using it; otherwise the region is returned unchanged.
    pub fn try_into_vec(self) -> Result<Vec<u8>, MemoryRegion> {
        if !matches!(self.inner.backing, Some(Backing::Heap(_))) {
            return Err(self);
        }
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => match inner.backing.take() {
                Some(Backing::Heap(h)) => {
                    // No NIC may reach the buffer once it is the caller's.
                    inner.nic.clear();
                    Ok(h.into_vec())
                }
                // (Checked above: never reached.)
                other => {
                    inner.backing = other;
                    let table = inner.table.upgrade().unwrap_or_default();
                    Err(table.insert(inner))
                }
            },
            Err(inner) => Err(MemoryRegion { inner }),
        }
    }
}

/// The regions this process registered, by id.
#[derive(Default)]
pub(crate) struct RegionTable {
    map: Mutex<HashMap<KeyId, Weak<RegionInner>>>,
}

impl RegionTable {
    fn insert(self: &Arc<Self>, inner: RegionInner) -> MemoryRegion {
        let inner = Arc::new(inner);
        lock(&self.map).insert(inner.id, Arc::downgrade(&inner));
        MemoryRegion { inner }
    }

    /// Register memory of `len` bytes at `raw`, kept by `backing`, with
    /// the transports' `handles`.
    fn add(
        self: &Arc<Self>,
        owner: Rank,
        id: KeyId,
        raw: RawBuf,
        backing: Backing,
        mut handles: Vec<KeyHandle>,
        nics: Registrar<'_>,
    ) -> MemoryRegion {
        let (more, nic) = nics(&id, raw);
        handles.extend(more);
        let key = RemoteKey {
            owner,
            id,
            len: raw.len() as u64,
            handles,
            mapped: Default::default(),
        };
        let inner = RegionInner {
            id,
            key,
            raw,
            device: None,
            nic,
            backing: Some(backing),
            table: Arc::downgrade(self),
        };
        self.insert(inner)
    }

    /// Register a buffer the application owns.
    pub(crate) fn register<B: RegisterMemory>(
        self: &Arc<Self>,
        owner: Rank,
        buf: B,
        nics: Registrar<'_>,
    ) -> MemoryRegion {
        let id = crate::sys::os::random_bytes::<16>();
        // A `Vec` keeps its own form, so that `try_into_vec` can give it
        // back.
        let mut buf = buf;
        let (raw, backing) = match (&mut buf as &mut dyn Any).downcast_mut::<Vec<u8>>() {
            Some(v) => {
                let heap = HeapBuf::from_vec(std::mem::take(v));
                (heap.raw(), Backing::Heap(heap))
            }
            None => {
                let mut buf = Box::new(buf);
                let (ptr, len) = (buf.as_mut_ptr(), buf.len());
                // SAFETY: the `RegisterMemory` contract: `ptr..ptr+len`
                // stays valid for reads and writes, at this address, until
                // `buf` is dropped, and is touched only through the region
                // meanwhile; `buf` is kept beside `raw` in the region and
                // dropped no earlier (see `RawBuf`).
                let raw = unsafe { RawBuf::new(ptr, len) };
                (raw, Backing::Owned { _keep: buf })
            }
        };
        self.add(owner, id, raw, backing, Vec::new(), nics)
    }

    /// Register memory a transport allocated for peers to map: `keep` owns
    /// it, `handle` says how to reach it.
    pub(crate) fn add_shared(
        self: &Arc<Self>,
        owner: Rank,
        id: KeyId,
        raw: RawBuf,
        keep: Box<dyn Any + Send + Sync>,
        handle: KeyHandle,
        nics: Registrar<'_>,
    ) -> MemoryRegion {
        self.add(
            owner,
            id,
            raw,
            Backing::Owned { _keep: keep },
            vec![handle],
            nics,
        )
    }

    /// Register device memory a transport allocated: `mem` owns it,
    /// `handle` says how peers reach it. No NIC registers it.
    pub(crate) fn add_device(
        self: &Arc<Self>,
        owner: Rank,
        id: KeyId,
        mem: Box<dyn DeviceMemory>,
        handle: KeyHandle,
    ) -> MemoryRegion {
        let key = RemoteKey {
            owner,
            id,
            len: mem.len() as u64,
            handles: vec![handle],
            mapped: Default::default(),
        };
        self.insert(RegionInner {
            id,
            key,
            raw: RawBuf::empty(),
            device: Some(mem),
            nic: Vec::new(),
            backing: None,
            table: Arc::downgrade(self),
        })
    }

    /// Look a live region up by id.
    pub(crate) fn get(&self, id: &KeyId) -> Option<Arc<RegionInner>> {
        lock(&self.map).get(id).and_then(Weak::upgrade)
    }
}

/// A peer's region that a transport mapped into this process (UCX's
/// `rkey_ptr`): its bytes, bounded by what the mapping really holds; the
/// word its owner sets when it drops the region; and whatever keeps the
/// mapping alive.
#[derive(Clone)]
pub(crate) struct Mapped {
    data: RawBuf,
    revoked: RawBuf,
    _keep: Arc<dyn Any + Send + Sync>,
}

impl Mapped {
    /// `data` and the 4-byte `revoked` word, both inside the memory `keep`
    /// maps.
    pub(crate) fn new(data: RawBuf, revoked: RawBuf, keep: Arc<dyn Any + Send + Sync>) -> Mapped {
        Mapped {
            data,
            revoked,
            _keep: keep,
        }
    }

    /// Fail if the owner has dropped the region since we mapped it.
    pub(crate) fn check_live(&self) -> Result<(), AccessError> {
        match self.revoked.atomic_u32(0) {
            // Acquire pairs with the owner's Release store when it revokes.
            Some(a) if a.load(Ordering::Acquire) == 0 => Ok(()),
            _ => Err(AccessError::UnknownKey),
        }
    }

    /// The data range (bounds: the real mapping, not the key's claim).
    pub(crate) fn data(&self) -> RawBuf {
        self.data
    }
}

/// Memory an application owns that [`Fabric::register`](crate::Fabric::register)
/// can register: `Vec<u8>`, `Box<[u8]>`, `bytes::BytesMut`, [`PageBuf`]
/// (page-aligned), `memmap2::MmapMut` (a file or huge-page mapping), or a
/// type of your own.
///
/// # Safety
/// From the moment `register` takes the value until the region drops it,
/// `as_mut_ptr()..as_mut_ptr() + len()` must stay valid for reads and
/// writes at the same address (moving the value must not move the bytes),
/// and nothing may access those bytes except through the region. `len`
/// must not change.
pub unsafe trait RegisterMemory: Send + Sync + 'static {
    /// The start of the bytes (called once, at registration).
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// How many bytes.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a Vec's heap buffer does not move when the Vec does; the region
// never grows it.
unsafe impl RegisterMemory for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        Vec::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

// SAFETY: a boxed slice's buffer does not move when the box does.
unsafe impl RegisterMemory for Box<[u8]> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[u8]>::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

// SAFETY: a `BytesMut`'s buffer does not move when the handle does, and
// the region never reserves, splits or freezes it.
unsafe impl RegisterMemory for bytes::BytesMut {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[u8]>::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

// SAFETY: a mapping stays at its address until it is unmapped, which
// happens when it is dropped.
unsafe impl RegisterMemory for memmap2::MmapMut {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[u8]>::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

// SAFETY: the allocation belongs to the `PageBuf` until it is dropped, and
// does not move with it.
unsafe impl RegisterMemory for PageBuf {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A zeroed, page-aligned (4 KiB) heap buffer to register: every 8-byte
/// word of it can take an atomic, and a NIC or GPU driver that pins whole
/// pages pins nothing else with it.
pub struct PageBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: `PageBuf` owns its allocation alone (no aliasing handle exists);
// sending it moves that ownership.
unsafe impl Send for PageBuf {}
// SAFETY: no method hands out access through `&PageBuf` but its length.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// The page size it aligns to.
    pub const ALIGN: usize = 4096;

    /// Exactly `len` zeroed bytes, starting on a page boundary.
    pub fn zeroed(len: usize) -> PageBuf {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (at least one byte).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(p) else {
            std::alloc::handle_alloc_error(layout)
        };
        PageBuf { ptr, len }
    }

    fn layout(len: usize) -> std::alloc::Layout {
        // At least one byte, so a zero-length buffer still has a real
        // allocation to free.
        std::alloc::Layout::from_size_align(len.max(1), Self::ALIGN)
            .unwrap_or_else(|_| panic!("PageBuf of {len} bytes is larger than memory"))
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageBuf").field("len", &self.len).finish()
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;

    /// Found by the `remote_key` fuzz target: postcard reads a varint
    /// padded with continuation bytes as the same number, so one key had
    /// many encodings.
    #[test]
    fn a_key_has_one_encoding() {
        let table = Arc::new(RegionTable::default());
        let region = table.register(3, vec![0u8; 100], &no_nic);
        let b = region.remote_key().to_bytes();
        assert_eq!(RemoteKey::from_bytes(&b).unwrap().to_bytes(), b);
        // The owner (3) written in two bytes instead of one.
        let mut long = vec![0x83, 0x00];
        long.extend_from_slice(&b[1..]);
        let e = RemoteKey::from_bytes(&long).unwrap_err().to_string();
        assert!(e.contains("longer than it needs"), "{e}");
    }
}

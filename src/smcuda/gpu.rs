//! The GPU operations `smcuda` needs, as one object-safe trait, so that the
//! transport is written once over two implementations: the CUDA driver
//! ([`super::cuda`], feature `cuda`) and a test double
//! ([`super::double`]) whose "device memory" is host memory in memory
//! files, for machines without a GPU.
//!
//! Device pointers are plain `u64` virtual addresses, as in the CUDA
//! driver API (unified addressing). Streams and events are opaque handles
//! the implementation hands out and takes back; the transport never
//! dereferences them.

use std::os::fd::OwnedFd;

use crate::sys::mem::RawBuf;
use std::sync::Arc;

/// Why device memory the user allocated cannot be registered: the driver
/// offers no way to share it with another process.
pub(crate) const UNSHAREABLE: &str = "the allocation can be shared neither as a POSIX file descriptor nor by legacy IPC (pool memory, or a VMM allocation made without a shareable handle type)";

/// What went wrong in a GPU call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum GpuError {
    /// No driver or no device: the transport is unavailable.
    #[error("no GPU: {0}")]
    Unavailable(String),
    /// Opening a handle found the allocation already mapped in this
    /// process (a stale cache entry still holds it): evict and retry.
    #[error("the allocation is already mapped in this process")]
    AlreadyMapped,
    /// The operation is not allowed for this memory or device (legacy IPC
    /// of pool memory, IPC under MIG, an export the driver refuses).
    #[error("refused: {0}")]
    Refused(String),
    /// The pointer or range is not memory the implementation knows.
    #[error("not device memory this process can use: {0}")]
    BadPointer(String),
    /// Any other failure, with the driver's words.
    #[error("{0}")]
    Failed(String),
}

/// A GPU of this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceInfo {
    /// Its ordinal in this process.
    pub(crate) ordinal: u32,
    /// Its UUID: the same device seen from two processes (whose ordinals
    /// may differ under `CUDA_VISIBLE_DEVICES`) has the same one.
    pub(crate) uuid: [u8; 16],
    /// A MIG instance: CUDA IPC is not supported there.
    pub(crate) mig: bool,
    /// Virtual memory management (`cuMemCreate`, POSIX-fd export).
    pub(crate) vmm: bool,
}

/// How an allocation was made, which decides how it is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum AllocKind {
    /// Virtual memory management: exported as a file descriptor (a
    /// capability; works across PID namespaces), freed only once every
    /// importer unmapped it.
    Vmm,
    /// `cuMemAlloc`: exported as a 64-byte legacy IPC handle (same PID
    /// namespace only; freeing it while a peer has it open is undefined
    /// behaviour, so the owner must outlive the importers' use).
    Legacy,
}

/// Device memory this process allocated ([`Gpu::alloc`], given back with
/// [`Gpu::free`]) or the user did ([`Gpu::adopt`], given back with
/// [`Gpu::release`]: `adopted`); the implementation's token names it.
#[derive(Debug)]
pub(crate) struct DeviceAlloc {
    /// The device it lives on.
    pub(crate) device: u32,
    /// Its address.
    pub(crate) ptr: u64,
    /// Its length in bytes (possibly rounded up to the granularity).
    pub(crate) len: u64,
    /// How it was made.
    pub(crate) kind: AllocKind,
    /// The implementation's own handle (VMM: the generic allocation
    /// handle; the test double: its table slot).
    pub(crate) token: u64,
    /// The user's memory, described by [`Gpu::adopt`]: never freed here
    /// ([`Gpu::free`] refuses it, as [`Gpu::release`] refuses memory
    /// [`Gpu::alloc`] made).
    pub(crate) adopted: bool,
}

/// What [`Gpu::classify`] learns about an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PtrInfo {
    /// Host memory (pageable or pinned): the CPU may touch it.
    Host,
    /// Device memory.
    Device {
        /// The device it lives on.
        device: u32,
        /// The base of the allocation it belongs to.
        base: u64,
        /// The allocation's length.
        len: u64,
        /// The allocation's buffer id: a freed and re-allocated buffer at
        /// the same address has a new one.
        buffer_id: u64,
        /// How it was made, where the implementation knows (`None`:
        /// memory the user allocated through another allocator).
        kind: Option<AllocKind>,
    },
}

/// An exported allocation, as it travels to a peer.
#[derive(Debug)]
pub(crate) enum MemHandle {
    /// A VMM allocation's POSIX file descriptor (sent with `SCM_RIGHTS`).
    Fd(OwnedFd),
    /// A legacy IPC handle.
    Legacy([u8; 64]),
}

/// A peer's allocation, mapped into this process. Given back with
/// [`Gpu::unmap`].
#[derive(Debug)]
pub(crate) struct Imported {
    /// Where it is mapped here.
    pub(crate) ptr: u64,
    /// Its length.
    pub(crate) len: u64,
    /// How it was shared.
    pub(crate) kind: AllocKind,
    /// The implementation's own handle.
    pub(crate) token: u64,
}

/// A stream (an ordered queue of GPU work), opaque.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Stream(pub(crate) u64);

/// An event (a marker in a stream that fires when the work before it is
/// done), opaque.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Event(pub(crate) u64);

/// A callback a stream runs when the work queued before it is done. It
/// must not call the GPU (the CUDA driver forbids it in host functions).
pub(crate) type Bell = Arc<dyn Fn() + Send + Sync>;

/// The GPU operations of `smcuda`.
///
/// Every call is non-blocking unless it says otherwise. A call that
/// takes a pointer checks it is memory the implementation knows before
/// queueing work on it ([`GpuError::BadPointer`]).
pub(crate) trait Gpu: Send + Sync {
    /// Which implementation this is ("cuda", "test double").
    fn backend(&self) -> &'static str;

    /// The devices this process sees.
    fn devices(&self) -> Vec<DeviceInfo>;

    /// Whether the GPU layer can take part in IPC now (what a rank
    /// answers a peer's handshake with: `NotReady` while not).
    fn ready(&self) -> bool {
        true
    }

    /// Whether `from` can access memory of `to` (peer access), for two
    /// devices of this process.
    fn can_access_peer(&self, from: u32, to: u32) -> bool;

    /// What kind of memory `ptr` is.
    fn classify(&self, ptr: u64) -> Result<PtrInfo, GpuError>;

    /// Allocate `len` bytes on `device`, zeroed.
    fn alloc(&self, device: u32, len: u64, kind: AllocKind) -> Result<DeviceAlloc, GpuError>;

    /// Give an allocation back. The caller waits first for every copy
    /// it queued on it (a VMM allocation stays alive in the driver until
    /// its importers unmap it too).
    fn free(&self, a: DeviceAlloc) -> Result<(), GpuError>;

    /// The allocation `ptr..ptr + len` lies in, made by the caller through
    /// another allocator (`cuMemAlloc`, or `cuMemCreate` with a POSIX-fd
    /// handle type): described as [`alloc`](Self::alloc) describes its
    /// own, so that it is exported alike, and given back with
    /// [`release`](Self::release), never [`free`](Self::free). Refused
    /// for memory that can be shared neither way (pool memory, say).
    fn adopt(&self, ptr: u64, len: u64) -> Result<DeviceAlloc, GpuError>;

    /// Let go of an allocation [`adopt`](Self::adopt) described, without
    /// freeing it (its owner does).
    fn release(&self, a: DeviceAlloc) -> Result<(), GpuError>;

    /// Export an allocation for a peer.
    fn export(&self, a: &DeviceAlloc) -> Result<MemHandle, GpuError>;

    /// Map a peer's exported allocation of `len` bytes for `device`.
    fn import(&self, device: u32, h: MemHandle, len: u64) -> Result<Imported, GpuError>;

    /// Unmap a peer's allocation. The caller waits first for every copy it
    /// queued on it.
    fn unmap(&self, m: Imported) -> Result<(), GpuError>;

    /// A new stream on `device`.
    fn stream(&self, device: u32) -> Result<Stream, GpuError>;

    /// A new event on `device`; `interprocess`: one a peer may open.
    fn event(&self, device: u32, interprocess: bool) -> Result<Event, GpuError>;

    /// The handle a peer opens an interprocess event by.
    fn export_event(&self, e: Event) -> Result<[u8; 64], GpuError>;

    /// Open a peer's interprocess event.
    fn open_event(&self, h: &[u8; 64]) -> Result<Event, GpuError>;

    /// Give an event back (created or opened).
    fn destroy_event(&self, e: Event);

    /// Mark `s`'s current end with `e`.
    fn record(&self, e: Event, s: Stream) -> Result<(), GpuError>;

    /// Whether the work before `e`'s last record is done. An event never
    /// recorded counts as done.
    fn query(&self, e: Event) -> Result<bool, GpuError>;

    /// Make later work on `s` wait for `e` (queued, not blocking).
    fn wait_event(&self, s: Stream, e: Event) -> Result<(), GpuError>;

    /// Queue a copy of `len` bytes from `src` to `dst` on `s` (device or
    /// host addresses on either side).
    fn copy(&self, s: Stream, dst: u64, src: u64, len: u64) -> Result<(), GpuError>;

    /// Queue a fill of `len` bytes at `dst` with `byte` on `s`.
    fn fill(&self, s: Stream, dst: u64, byte: u8, len: u64) -> Result<(), GpuError>;

    /// Queue `bell` on `s`: it runs once the work queued before it is
    /// done (`cuLaunchHostFunc`).
    fn notify(&self, s: Stream, bell: Bell) -> Result<(), GpuError>;

    /// Copy host bytes into device memory, waiting until done.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), GpuError>;

    /// Copy device memory into host bytes, waiting until done.
    fn download(&self, dst: &mut [u8], src: u64) -> Result<(), GpuError>;

    /// [`upload`](Self::upload) from host memory a peer may also reach
    /// (a fragment of `sm`, read where it arrived).
    fn upload_raw(&self, dst: u64, src: RawBuf) -> Result<(), GpuError>;

    /// [`download`](Self::download) into host memory a peer may also
    /// reach (a fragment of `sm` a message is built in).
    fn download_raw(&self, dst: RawBuf, src: u64) -> Result<(), GpuError>;

    /// Page-lock `host` for the device (`cuMemHostRegister`), so that
    /// copies to and from it go by DMA at the link's speed, not through
    /// the driver's own bounce buffers. Kept until [`unpin`](Self::unpin).
    /// `Ok(false)`: it was pinned already, by someone else (not ours to
    /// unpin).
    fn pin(&self, host: RawBuf) -> Result<bool, GpuError>;

    /// Undo [`pin`](Self::pin) of the range starting where `host` does.
    fn unpin(&self, host: RawBuf) -> Result<(), GpuError>;
}

/// A peer's allocation mapped here, unmapped when the last holder lets go
/// (what [`super::cache::Cache`] holds and operations borrow).
pub(crate) struct Mapping {
    gpu: Arc<dyn Gpu>,
    imported: Option<Imported>,
}

impl Mapping {
    /// Map `h` (`len` bytes) for `device`.
    pub(crate) fn import(
        gpu: &Arc<dyn Gpu>,
        device: u32,
        h: MemHandle,
        len: u64,
    ) -> Result<Mapping, GpuError> {
        let imported = gpu.import(device, h, len)?;
        Ok(Mapping {
            gpu: gpu.clone(),
            imported: Some(imported),
        })
    }

    /// Where the allocation is mapped here.
    pub(crate) fn ptr(&self) -> u64 {
        self.imported.as_ref().map_or(0, |m| m.ptr)
    }

    /// How many bytes are mapped.
    pub(crate) fn len(&self) -> u64 {
        self.imported.as_ref().map_or(0, |m| m.len)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Some(m) = self.imported.take() {
            if let Err(e) = self.gpu.unmap(m) {
                tracing::warn!("smcuda: unmapping a peer's allocation: {e}");
            }
        }
    }
}

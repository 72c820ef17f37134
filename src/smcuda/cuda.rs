//! [`Gpu`] over the CUDA driver API (cudarc's `sys` bindings, loaded at
//! run time, so the build needs no toolkit). The only unsafe code of
//! `smcuda` lives here.
//!
//! The driver library is looked for with `is_culib_present` before any
//! other call: without it, cudarc's loader panics at the first call. Every
//! call binds the device's primary context to the calling thread first
//! (progress runs on whichever runtime thread polls). Streams and events
//! live in tables of this object; the handles given out are indices.

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use cudarc::driver::sys as cu;

use super::gpu::{
    AllocKind, Bell, DeviceAlloc, DeviceInfo, Event, Gpu, GpuError, Imported, MemHandle, PtrInfo,
    Stream, UNSHAREABLE,
};
use crate::sys::mem::RawBuf;
use crate::sys::sync::lock;

/// Turn a driver result into ours.
fn check(r: cu::CUresult, what: &str) -> Result<(), GpuError> {
    match r {
        cu::CUresult::CUDA_SUCCESS => Ok(()),
        cu::CUresult::CUDA_ERROR_ALREADY_MAPPED => Err(GpuError::AlreadyMapped),
        cu::CUresult::CUDA_ERROR_NOT_SUPPORTED | cu::CUresult::CUDA_ERROR_INVALID_VALUE => {
            Err(GpuError::Refused(format!("{what}: {r:?}")))
        }
        _ => Err(GpuError::Failed(format!("{what}: {r:?}"))),
    }
}

/// Whether the driver library can be loaded (without loading symbols).
pub(crate) fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to open the library by its
    // candidate names and closes it again; it calls no CUDA function.
    unsafe { cu::is_culib_present() }
}

/// What the host offers: the devices and what they support, or why not.
pub(crate) fn probe() -> Result<String, String> {
    let cuda = Cuda::open().map_err(|e| e.to_string())?;
    let devs = cuda.devices();
    let list: Vec<String> = devs
        .iter()
        .map(|d| {
            format!(
                "{} ({}{})",
                cuda.names[d.ordinal as usize],
                if d.vmm { "VMM" } else { "legacy IPC only" },
                if d.mig { ", MIG: no IPC" } else { "" }
            )
        })
        .collect();
    Ok(format!("{} device(s): {}", devs.len(), list.join("; ")))
}

/// The CUDA driver, with a retained primary context per device.
pub(crate) struct Cuda {
    /// Primary contexts, by ordinal (as addresses: raw pointers are not
    /// `Send`).
    ctxs: Vec<usize>,
    names: Vec<String>,
    infos: Vec<DeviceInfo>,
    /// Streams: (stream, device).
    streams: Mutex<Vec<(usize, u32)>>,
    /// Events: (event, device), `None` once destroyed.
    events: Mutex<Vec<Option<(usize, u32)>>>,
    /// VMM allocations and mappings: token → (generic handle, reserved
    /// size).
    vmm: Mutex<std::collections::HashMap<u64, (u64, usize)>>,
    next: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda")
            .field("devices", &self.names)
            .finish()
    }
}

/// Run a driver call that may panic in cudarc's loader (a symbol this
/// driver lacks) as an error instead.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(GpuError::Unavailable(format!(
            "{what}: the CUDA driver lacks a function this build needs"
        )))
    })
}

impl Cuda {
    /// Load the driver, initialise it and retain every device's primary
    /// context. No driver, no device: [`GpuError::Unavailable`].
    pub(crate) fn open() -> Result<Cuda, GpuError> {
        if !driver_present() {
            return Err(GpuError::Unavailable(
                "no CUDA driver (libcuda.so.1 not found)".into(),
            ));
        }
        guarded("initialising CUDA", || {
            // SAFETY: the library is present (checked above); cuInit takes
            // flags 0 and touches no memory of ours.
            check(unsafe { cu::cuInit(0) }, "cuInit")
                .map_err(|e| GpuError::Unavailable(e.to_string()))?;
            let mut n: c_int = 0;
            // SAFETY: `n` is a valid out-pointer for the call.
            check(unsafe { cu::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
            if n <= 0 {
                return Err(GpuError::Unavailable(
                    "the CUDA driver sees no device".into(),
                ));
            }
            let mut ctxs = Vec::new();
            let mut names = Vec::new();
            let mut infos = Vec::new();
            for ordinal in 0..n {
                let mut dev: cu::CUdevice = 0;
                // SAFETY: valid out-pointer; ordinal < the device count.
                check(unsafe { cu::cuDeviceGet(&mut dev, ordinal) }, "cuDeviceGet")?;
                let mut ctx: cu::CUcontext = std::ptr::null_mut();
                check(
                    // SAFETY: valid out-pointer and device.
                    unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
                    "cuDevicePrimaryCtxRetain",
                )?;
                let mut name = [0 as std::ffi::c_char; 256];
                check(
                    // SAFETY: the buffer holds 256 bytes, the length passed.
                    unsafe { cu::cuDeviceGetName(name.as_mut_ptr(), 256, dev) },
                    "cuDeviceGetName",
                )?;
                // SAFETY: the driver wrote a NUL-terminated string into the
                // buffer (it truncates to the length given).
                let name = unsafe { CStr::from_ptr(name.as_ptr()) }
                    .to_string_lossy()
                    .into_owned();
                let mut uuid = cu::CUuuid { bytes: [0; 16] };
                check(
                    // SAFETY: valid out-pointer and device.
                    unsafe { cu::cuDeviceGetUuid_v2(&mut uuid, dev) },
                    "cuDeviceGetUuid",
                )?;
                let mut vmm: c_int = 0;
                check(
                    // SAFETY: valid out-pointer, attribute and device.
                    unsafe {
                        cu::cuDeviceGetAttribute(
                            &mut vmm,
                            cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                            dev,
                        )
                    },
                    "cuDeviceGetAttribute",
                )?;
                infos.push(DeviceInfo {
                    ordinal: ordinal as u32,
                    uuid: uuid.bytes.map(|b| b as u8),
                    // A MIG instance is named for its profile ("MIG 1g.10gb").
                    mig: name.contains("MIG"),
                    vmm: vmm != 0,
                });
                names.push(name);
                ctxs.push(ctx as usize);
            }
            Ok(Cuda {
                ctxs,
                names,
                infos,
                streams: Mutex::new(Vec::new()),
                events: Mutex::new(Vec::new()),
                vmm: Mutex::new(std::collections::HashMap::new()),
                next: std::sync::atomic::AtomicU64::new(1),
            })
        })
    }

    /// Make `device`'s primary context current on this thread.
    fn bind(&self, device: u32) -> Result<(), GpuError> {
        let ctx = *self
            .ctxs
            .get(device as usize)
            .ok_or_else(|| GpuError::BadPointer(format!("no device {device}")))?;
        check(
            // SAFETY: `ctx` is a primary context this object retained and
            // never released while it lives.
            unsafe { cu::cuCtxSetCurrent(ctx as cu::CUcontext) },
            "cuCtxSetCurrent",
        )
    }

    fn stream_of(&self, s: Stream) -> Result<(cu::CUstream, u32), GpuError> {
        let (st, dev) = *lock(&self.streams)
            .get(s.0 as usize)
            .ok_or_else(|| GpuError::BadPointer(format!("no stream {}", s.0)))?;
        self.bind(dev)?;
        Ok((st as cu::CUstream, dev))
    }

    fn event_of(&self, e: Event) -> Result<cu::CUevent, GpuError> {
        let (ev, dev) = lock(&self.events)
            .get(e.0 as usize)
            .copied()
            .flatten()
            .ok_or_else(|| GpuError::BadPointer(format!("no event {}", e.0)))?;
        self.bind(dev)?;
        Ok(ev as cu::CUevent)
    }

    fn alloc_prop(device: u32) -> cu::CUmemAllocationProp {
        // SAFETY: the property struct is plain data for which all zeroes
        // is a valid value (the driver's documented initialisation).
        let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device as c_int;
        prop
    }

    fn granularity(device: u32) -> Result<usize, GpuError> {
        let prop = Cuda::alloc_prop(device);
        let mut g = 0usize;
        check(
            // SAFETY: valid out-pointer and property struct.
            unsafe {
                cu::cuMemGetAllocationGranularity(
                    &mut g,
                    &prop,
                    cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            },
            "cuMemGetAllocationGranularity",
        )?;
        Ok(g.max(1))
    }

    /// Reserve address space for `handle` (`size` bytes), map it and give
    /// `device` read-write access; the address.
    fn map_vmm(device: u32, handle: u64, size: usize) -> Result<u64, GpuError> {
        let mut ptr: cu::CUdeviceptr = 0;
        check(
            // SAFETY: valid out-pointer; no fixed address is asked for.
            unsafe { cu::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) },
            "cuMemAddressReserve",
        )?;
        // SAFETY: `ptr..ptr+size` was just reserved and `handle` is a live
        // allocation handle of at least `size` bytes.
        if let Err(e) = check(unsafe { cu::cuMemMap(ptr, size, 0, handle, 0) }, "cuMemMap") {
            // SAFETY: the reservation made above, unused.
            unsafe { cu::cuMemAddressFree(ptr, size) };
            return Err(e);
        }
        let access = cu::CUmemAccessDesc {
            location: Cuda::alloc_prop(device).location,
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        if let Err(e) = check(
            // SAFETY: the range is mapped (above); one descriptor is passed.
            unsafe { cu::cuMemSetAccess(ptr, size, &access, 1) },
            "cuMemSetAccess",
        ) {
            // SAFETY: the mapping and reservation made above.
            unsafe {
                cu::cuMemUnmap(ptr, size);
                cu::cuMemAddressFree(ptr, size);
            }
            return Err(e);
        }
        Ok(ptr)
    }

    fn unmap_vmm(ptr: u64, handle: u64, size: usize) -> Result<(), GpuError> {
        // SAFETY: `ptr..ptr+size` is a mapping of `handle` made by
        // `map_vmm` and given back once (the caller removed its token);
        // the caller waited for the copies queued on it.
        unsafe {
            check(cu::cuMemUnmap(ptr, size), "cuMemUnmap")?;
            check(cu::cuMemAddressFree(ptr, size), "cuMemAddressFree")?;
            check(cu::cuMemRelease(handle), "cuMemRelease")
        }
    }

    fn token(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }
}

/// The driver calls this on its own thread when the stream reaches it.
unsafe extern "C" fn ring_bell(user: *mut c_void) {
    // SAFETY: `user` is the `Box<Bell>` leaked by `notify` for this one
    // call; the driver calls each host function exactly once.
    let bell = unsafe { Box::from_raw(user as *mut Bell) };
    bell();
}

impl Gpu for Cuda {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        self.infos.clone()
    }

    fn can_access_peer(&self, from: u32, to: u32) -> bool {
        if from == to {
            return true;
        }
        let (Some(_), Some(_)) = (self.ctxs.get(from as usize), self.ctxs.get(to as usize)) else {
            return false;
        };
        let mut ok: c_int = 0;
        // SAFETY: valid out-pointer; both ordinals are devices (checked).
        let r = unsafe { cu::cuDeviceCanAccessPeer(&mut ok, from as c_int, to as c_int) };
        r == cu::CUresult::CUDA_SUCCESS && ok != 0
    }

    fn classify(&self, ptr: u64) -> Result<PtrInfo, GpuError> {
        self.bind(0)?;
        let mut mtype: c_uint = 0;
        // SAFETY: MEMORY_TYPE writes one unsigned int to a valid pointer.
        let r = unsafe {
            cu::cuPointerGetAttribute(
                &mut mtype as *mut c_uint as *mut c_void,
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr,
            )
        };
        if r != cu::CUresult::CUDA_SUCCESS
            || mtype != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as c_uint
        {
            return Ok(PtrInfo::Host);
        }
        let mut ordinal: c_int = 0;
        let mut buffer_id: u64 = 0;
        let mut legacy: c_int = 0;
        let mut handles: u64 = 0;
        // SAFETY: each attribute writes a value of the type of the
        // variable passed (int, unsigned long long, int, unsigned long long).
        unsafe {
            check(
                cu::cuPointerGetAttribute(
                    &mut ordinal as *mut c_int as *mut c_void,
                    cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr,
                ),
                "device ordinal",
            )?;
            check(
                cu::cuPointerGetAttribute(
                    &mut buffer_id as *mut u64 as *mut c_void,
                    cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                    ptr,
                ),
                "buffer id",
            )?;
            // Older drivers do not know these two: they stay 0.
            cu::cuPointerGetAttribute(
                &mut legacy as *mut c_int as *mut c_void,
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                ptr,
            );
            cu::cuPointerGetAttribute(
                &mut handles as *mut u64 as *mut c_void,
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
                ptr,
            );
        }
        let (mut base, mut len): (cu::CUdeviceptr, usize) = (0, 0);
        check(
            // SAFETY: valid out-pointers; `ptr` is device memory (above).
            unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut len, ptr) },
            "cuMemGetAddressRange",
        )?;
        let posix_fd =
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as u64;
        let kind = if handles & posix_fd != 0 {
            Some(AllocKind::Vmm)
        } else if legacy != 0 {
            Some(AllocKind::Legacy)
        } else {
            None
        };
        Ok(PtrInfo::Device {
            device: ordinal as u32,
            base,
            len: len as u64,
            buffer_id,
            kind,
        })
    }

    fn alloc(&self, device: u32, len: u64, kind: AllocKind) -> Result<DeviceAlloc, GpuError> {
        self.bind(device)?;
        let len = usize::try_from(len.max(1))
            .map_err(|_| GpuError::Refused("allocation too large".into()))?;
        match kind {
            AllocKind::Vmm => {
                let size = len.next_multiple_of(Cuda::granularity(device)?);
                let prop = Cuda::alloc_prop(device);
                let mut handle: cu::CUmemGenericAllocationHandle = 0;
                check(
                    // SAFETY: valid out-pointer and property struct.
                    unsafe { cu::cuMemCreate(&mut handle, size, &prop, 0) },
                    "cuMemCreate",
                )?;
                let ptr = match Cuda::map_vmm(device, handle, size) {
                    Ok(p) => p,
                    Err(e) => {
                        // SAFETY: the handle created above, never mapped.
                        unsafe { cu::cuMemRelease(handle) };
                        return Err(e);
                    }
                };
                // SAFETY: `ptr..ptr+size` is mapped read-write for this
                // device (map_vmm).
                check(unsafe { cu::cuMemsetD8_v2(ptr, 0, size) }, "cuMemsetD8")?;
                let token = self.token();
                lock(&self.vmm).insert(token, (handle, size));
                Ok(DeviceAlloc {
                    device,
                    ptr,
                    len: size as u64,
                    kind,
                    token,
                    adopted: false,
                })
            }
            AllocKind::Legacy => {
                let mut ptr: cu::CUdeviceptr = 0;
                // SAFETY: valid out-pointer.
                check(unsafe { cu::cuMemAlloc_v2(&mut ptr, len) }, "cuMemAlloc")?;
                // SAFETY: `ptr..ptr+len` was just allocated.
                check(unsafe { cu::cuMemsetD8_v2(ptr, 0, len) }, "cuMemsetD8")?;
                Ok(DeviceAlloc {
                    device,
                    ptr,
                    len: len as u64,
                    kind,
                    token: 0,
                    adopted: false,
                })
            }
        }
    }

    fn free(&self, a: DeviceAlloc) -> Result<(), GpuError> {
        if a.adopted {
            return Err(GpuError::BadPointer(
                "the user's memory is released, not freed".into(),
            ));
        }
        self.bind(a.device)?;
        match a.kind {
            AllocKind::Vmm => {
                let (handle, size) = lock(&self.vmm)
                    .remove(&a.token)
                    .ok_or_else(|| GpuError::BadPointer(format!("no allocation {}", a.token)))?;
                Cuda::unmap_vmm(a.ptr, handle, size)
            }
            // SAFETY: `a` came from `alloc` (it is not Clone, so it is
            // freed once); the caller waited for copies queued on it.
            AllocKind::Legacy => check(unsafe { cu::cuMemFree_v2(a.ptr) }, "cuMemFree"),
        }
    }

    fn adopt(&self, ptr: u64, len: u64) -> Result<DeviceAlloc, GpuError> {
        let PtrInfo::Device {
            device,
            base,
            len: whole,
            kind,
            ..
        } = self.classify(ptr)?
        else {
            return Err(GpuError::BadPointer(format!(
                "{ptr:#x} is host memory, not device memory"
            )));
        };
        if !matches!(ptr.checked_add(len), Some(end) if base.checked_add(whole).is_some_and(|top| ptr >= base && end <= top))
        {
            return Err(GpuError::BadPointer(format!(
                "{len} bytes at {ptr:#x} run past the end of their allocation ({whole} bytes at {base:#x})"
            )));
        }
        self.bind(device)?;
        match kind {
            Some(AllocKind::Vmm) => {
                let mut handle: cu::CUmemGenericAllocationHandle = 0;
                guarded("cuMemRetainAllocationHandle", || {
                    check(
                        // SAFETY: valid out-pointer; `base` is mapped
                        // device memory (classified above). The handle
                        // taken is given back by `release`.
                        unsafe {
                            cu::cuMemRetainAllocationHandle(&mut handle, base as *mut c_void)
                        },
                        "cuMemRetainAllocationHandle",
                    )
                })?;
                let token = self.token();
                lock(&self.vmm).insert(token, (handle, whole as usize));
                Ok(DeviceAlloc {
                    device,
                    ptr: base,
                    len: whole,
                    kind: AllocKind::Vmm,
                    token,
                    adopted: true,
                })
            }
            Some(AllocKind::Legacy) => Ok(DeviceAlloc {
                device,
                ptr: base,
                len: whole,
                kind: AllocKind::Legacy,
                token: 0,
                adopted: true,
            }),
            None => Err(GpuError::Refused(UNSHAREABLE.into())),
        }
    }

    fn release(&self, a: DeviceAlloc) -> Result<(), GpuError> {
        if !a.adopted {
            return Err(GpuError::BadPointer(
                "memory of our own is freed, not released".into(),
            ));
        }
        if a.kind == AllocKind::Legacy {
            return Ok(());
        }
        let (handle, _) = lock(&self.vmm)
            .remove(&a.token)
            .ok_or_else(|| GpuError::BadPointer(format!("no allocation {}", a.token)))?;
        self.bind(a.device)?;
        // SAFETY: the reference `adopt` retained, released once (the
        // token is gone from the table); the mapping stays its owner's.
        check(unsafe { cu::cuMemRelease(handle) }, "cuMemRelease")
    }

    fn export(&self, a: &DeviceAlloc) -> Result<MemHandle, GpuError> {
        self.bind(a.device)?;
        match a.kind {
            AllocKind::Vmm => {
                let (handle, _) = *lock(&self.vmm)
                    .get(&a.token)
                    .ok_or_else(|| GpuError::BadPointer(format!("no allocation {}", a.token)))?;
                let mut fd: c_int = -1;
                check(
                    // SAFETY: for the POSIX-fd type the driver writes one int
                    // to the pointer passed.
                    unsafe {
                        cu::cuMemExportToShareableHandle(
                            &mut fd as *mut c_int as *mut c_void,
                            handle,
                            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                            0,
                        )
                    },
                    "cuMemExportToShareableHandle",
                )?;
                // SAFETY: the driver returned a new descriptor that nothing
                // else owns.
                Ok(MemHandle::Fd(unsafe { OwnedFd::from_raw_fd(fd) }))
            }
            AllocKind::Legacy => {
                let mut h = cu::CUipcMemHandle { reserved: [0; 64] };
                check(
                    // SAFETY: valid out-pointer; `a.ptr` is our allocation.
                    unsafe { cu::cuIpcGetMemHandle(&mut h, a.ptr) },
                    "cuIpcGetMemHandle",
                )?;
                Ok(MemHandle::Legacy(h.reserved.map(|b| b as u8)))
            }
        }
    }

    fn import(&self, device: u32, h: MemHandle, len: u64) -> Result<Imported, GpuError> {
        self.bind(device)?;
        match h {
            MemHandle::Fd(fd) => {
                let mut handle: cu::CUmemGenericAllocationHandle = 0;
                check(
                    // SAFETY: for the POSIX-fd type the driver reads the
                    // descriptor number from the pointer value; it does not
                    // take the descriptor (closed when `fd` drops).
                    unsafe {
                        cu::cuMemImportFromShareableHandle(
                            &mut handle,
                            fd.as_raw_fd() as isize as *mut c_void,
                            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        )
                    },
                    "cuMemImportFromShareableHandle",
                )?;
                drop(fd);
                let size = usize::try_from(len)
                    .map_err(|_| GpuError::Refused("mapping too large".into()))?
                    .next_multiple_of(Cuda::granularity(device)?);
                let ptr = match Cuda::map_vmm(device, handle, size) {
                    Ok(p) => p,
                    Err(e) => {
                        // SAFETY: the handle imported above, never mapped.
                        unsafe { cu::cuMemRelease(handle) };
                        return Err(e);
                    }
                };
                let token = self.token();
                lock(&self.vmm).insert(token, (handle, size));
                Ok(Imported {
                    ptr,
                    len: size as u64,
                    kind: AllocKind::Vmm,
                    token,
                })
            }
            MemHandle::Legacy(bytes) => {
                let h = cu::CUipcMemHandle {
                    reserved: bytes.map(|b| b as std::ffi::c_char),
                };
                let mut ptr: cu::CUdeviceptr = 0;
                check(
                    // SAFETY: valid out-pointer; the handle is plain bytes the
                    // driver validates.
                    unsafe {
                        cu::cuIpcOpenMemHandle_v2(
                            &mut ptr,
                            h,
                            cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
                        )
                    },
                    "cuIpcOpenMemHandle",
                )?;
                Ok(Imported {
                    ptr,
                    len,
                    kind: AllocKind::Legacy,
                    token: 0,
                })
            }
        }
    }

    fn unmap(&self, m: Imported) -> Result<(), GpuError> {
        self.bind(0)?;
        match m.kind {
            AllocKind::Vmm => {
                let (handle, size) = lock(&self.vmm)
                    .remove(&m.token)
                    .ok_or_else(|| GpuError::BadPointer(format!("no mapping {}", m.token)))?;
                Cuda::unmap_vmm(m.ptr, handle, size)
            }
            AllocKind::Legacy => check(
                // SAFETY: `m` came from `import` (not Clone: closed once); the
                // caller waited for copies queued on it.
                unsafe { cu::cuIpcCloseMemHandle(m.ptr) },
                "cuIpcCloseMemHandle",
            ),
        }
    }

    fn stream(&self, device: u32) -> Result<Stream, GpuError> {
        self.bind(device)?;
        let mut s: cu::CUstream = std::ptr::null_mut();
        check(
            // SAFETY: valid out-pointer; a non-blocking stream (no implicit
            // ordering with the legacy default stream).
            unsafe {
                cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint)
            },
            "cuStreamCreate",
        )?;
        let mut t = lock(&self.streams);
        t.push((s as usize, device));
        Ok(Stream(t.len() as u64 - 1))
    }

    fn event(&self, device: u32, interprocess: bool) -> Result<Event, GpuError> {
        self.bind(device)?;
        let mut flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        if interprocess {
            flags |= cu::CUevent_flags::CU_EVENT_INTERPROCESS as c_uint;
        }
        let mut e: cu::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the flags are a valid combination
        // (interprocess events must not time).
        check(unsafe { cu::cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        let mut t = lock(&self.events);
        t.push(Some((e as usize, device)));
        Ok(Event(t.len() as u64 - 1))
    }

    fn export_event(&self, e: Event) -> Result<[u8; 64], GpuError> {
        let ev = self.event_of(e)?;
        let mut h = cu::CUipcEventHandle { reserved: [0; 64] };
        check(
            // SAFETY: valid out-pointer and live event.
            unsafe { cu::cuIpcGetEventHandle(&mut h, ev) },
            "cuIpcGetEventHandle",
        )?;
        Ok(h.reserved.map(|b| b as u8))
    }

    fn open_event(&self, h: &[u8; 64]) -> Result<Event, GpuError> {
        self.bind(0)?;
        let handle = cu::CUipcEventHandle {
            reserved: h.map(|b| b as std::ffi::c_char),
        };
        let mut e: cu::CUevent = std::ptr::null_mut();
        check(
            // SAFETY: valid out-pointer; the handle is plain bytes the driver
            // validates.
            unsafe { cu::cuIpcOpenEventHandle(&mut e, handle) },
            "cuIpcOpenEventHandle",
        )?;
        let mut t = lock(&self.events);
        t.push(Some((e as usize, 0)));
        Ok(Event(t.len() as u64 - 1))
    }

    fn destroy_event(&self, e: Event) {
        let taken = lock(&self.events)
            .get_mut(e.0 as usize)
            .and_then(Option::take);
        if let Some((ev, dev)) = taken {
            if self.bind(dev).is_ok() {
                // SAFETY: a live event, removed from the table above so it
                // is destroyed once.
                unsafe { cu::cuEventDestroy_v2(ev as cu::CUevent) };
            }
        }
    }

    fn record(&self, e: Event, s: Stream) -> Result<(), GpuError> {
        let ev = self.event_of(e)?;
        let (st, _) = self.stream_of(s)?;
        // SAFETY: a live event and stream of this object.
        check(unsafe { cu::cuEventRecord(ev, st) }, "cuEventRecord")
    }

    fn query(&self, e: Event) -> Result<bool, GpuError> {
        let ev = self.event_of(e)?;
        // SAFETY: a live event of this object.
        match unsafe { cu::cuEventQuery(ev) } {
            cu::CUresult::CUDA_SUCCESS => Ok(true),
            cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(r, "cuEventQuery").map(|_| true),
        }
    }

    fn wait_event(&self, s: Stream, e: Event) -> Result<(), GpuError> {
        let ev = self.event_of(e)?;
        let (st, _) = self.stream_of(s)?;
        check(
            // SAFETY: a live event and stream; flags 0.
            unsafe { cu::cuStreamWaitEvent(st, ev, 0) },
            "cuStreamWaitEvent",
        )
    }

    fn copy(&self, s: Stream, dst: u64, src: u64, len: u64) -> Result<(), GpuError> {
        let (st, _) = self.stream_of(s)?;
        check(
            // SAFETY: the driver checks both ranges against its allocations
            // (unified addressing) and fails the call for unknown device
            // memory; the caller keeps both alive until the copy's event.
            unsafe { cu::cuMemcpyAsync(dst, src, len as usize, st) },
            "cuMemcpyAsync",
        )
    }

    fn fill(&self, s: Stream, dst: u64, byte: u8, len: u64) -> Result<(), GpuError> {
        let (st, _) = self.stream_of(s)?;
        check(
            // SAFETY: as for `copy`: the driver checks the range; the caller
            // keeps it alive until the stream passed this point.
            unsafe { cu::cuMemsetD8Async(dst, byte, len as usize, st) },
            "cuMemsetD8Async",
        )
    }

    fn notify(&self, s: Stream, bell: Bell) -> Result<(), GpuError> {
        let (st, _) = self.stream_of(s)?;
        let user = Box::into_raw(Box::new(bell)) as *mut c_void;
        // SAFETY: `ring_bell` takes back exactly the box passed as
        // `user`; on failure the driver never calls it and we do.
        let r = unsafe { cu::cuLaunchHostFunc(st, Some(ring_bell), user) };
        if r != cu::CUresult::CUDA_SUCCESS {
            // SAFETY: the launch failed, so the driver does not own `user`.
            drop(unsafe { Box::from_raw(user as *mut Bell) });
        }
        check(r, "cuLaunchHostFunc")
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        self.bind(0)?;
        check(
            // SAFETY: `src` is a live slice of the length passed; the driver
            // checks the device range.
            unsafe { cu::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len()) },
            "cuMemcpyHtoD",
        )
    }

    fn download(&self, dst: &mut [u8], src: u64) -> Result<(), GpuError> {
        self.bind(0)?;
        check(
            // SAFETY: `dst` is a live, exclusively borrowed slice of the length
            // passed; the driver checks the device range.
            unsafe { cu::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len()) },
            "cuMemcpyDtoH",
        )
    }

    fn upload_raw(&self, dst: u64, src: RawBuf) -> Result<(), GpuError> {
        self.bind(0)?;
        check(
            // SAFETY: a `RawBuf` is valid for reads of its length while its
            // owner (the mapping it was cut from) lives, which spans this
            // blocking call; no Rust reference into it exists. The driver
            // checks the device range.
            unsafe { cu::cuMemcpyHtoD_v2(dst, src.addr() as *const c_void, src.len()) },
            "cuMemcpyHtoD",
        )
    }

    fn download_raw(&self, dst: RawBuf, src: u64) -> Result<(), GpuError> {
        self.bind(0)?;
        check(
            // SAFETY: as in `upload_raw`, for writes: the range is valid
            // and no reference into it exists.
            unsafe { cu::cuMemcpyDtoH_v2(dst.addr() as *mut c_void, src, dst.len()) },
            "cuMemcpyDtoH",
        )
    }

    fn pin(&self, host: RawBuf) -> Result<bool, GpuError> {
        self.bind(0)?;
        let r = check(
            // SAFETY: the range is mapped for as long as its owner lives;
            // the caller unpins it before that owner unmaps it (or the
            // process ends). Page-locking changes no byte of it.
            unsafe {
                cu::cuMemHostRegister_v2(
                    host.addr() as *mut c_void,
                    host.len(),
                    cu::CU_MEMHOSTREGISTER_PORTABLE,
                )
            },
            "cuMemHostRegister",
        );
        match r {
            Ok(()) => Ok(true),
            // Pinned already, by other code of this process: not ours.
            Err(GpuError::Failed(e)) if e.contains("ALREADY_REGISTERED") => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn unpin(&self, host: RawBuf) -> Result<(), GpuError> {
        self.bind(0)?;
        check(
            // SAFETY: only undoes a registration of this address; touches
            // no memory.
            unsafe { cu::cuMemHostUnregister(host.addr() as *mut c_void) },
            "cuMemHostUnregister",
        )
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        let events = std::mem::take(&mut *lock(&self.events));
        let streams = std::mem::take(&mut *lock(&self.streams));
        for (ev, dev) in events.into_iter().flatten() {
            if self.bind(dev).is_ok() {
                // SAFETY: a live event of this object, destroyed once (the
                // table was emptied above).
                unsafe { cu::cuEventDestroy_v2(ev as cu::CUevent) };
            }
        }
        for (st, dev) in streams {
            if self.bind(dev).is_ok() {
                // SAFETY: a live stream of this object, destroyed once; the
                // driver lets queued work finish first.
                unsafe { cu::cuStreamDestroy_v2(st as cu::CUstream) };
            }
        }
        for dev in 0..self.ctxs.len() {
            // SAFETY: releases the retain made in `open`, once per device.
            unsafe { cu::cuDevicePrimaryCtxRelease_v2(dev as cu::CUdevice) };
        }
    }
}

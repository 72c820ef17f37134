//! What a peer needs to reach one of our GPU allocations, and how it gets
//! there: the `smcuda` handle a region's key carries, the owner's side
//! that exports an allocation under it ([`export`]), and the peer's side
//! that opens it through its mapping cache ([`open`]).
//!
//! A VMM allocation's descriptor is a capability, so it never travels in
//! the key: the key names the owner's share server (`sm::share`, which
//! checks the asker's uid and the job tag) and the allocation's id, and
//! the peer fetches the descriptor from there (`SCM_RIGHTS`), after
//! checking that the server is the owner's pid. A legacy IPC handle is
//! 64 bytes the driver itself checks, so it travels in the key, as in
//! UCX's `cuda_ipc` keys: there the handle is the capability (the driver
//! opens it for any process of the node that holds it), and a key whose
//! id was changed still reaches the memory. Prefer VMM memory where the
//! devices have it (the default), where the owner checks every open. Either way the key also says which device
//! holds the memory, its base, length and buffer id (the cache's key:
//! a freed and re-allocated buffer has a new id).

use std::sync::Arc;

use super::cache::Cache;
#[cfg(test)]
use super::gpu::AllocKind;
use super::gpu::{DeviceAlloc, Gpu, GpuError, Mapping, MemHandle, PtrInfo};
use crate::sm::share;
use crate::Rank;

/// Bytes of a VMM handle.
const VMM_LEN: usize = 85;
/// Bytes of a legacy handle.
const LEGACY_LEN: usize = 113;

/// How the allocation is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Fetch its VMM descriptor from the owner's share server.
    Vmm {
        /// The owner's pid (the server must be it).
        pid: u32,
        /// The owner's share server.
        server: [u8; 16],
        /// The allocation's id there.
        id: [u8; 16],
    },
    /// Open this legacy IPC handle.
    Legacy([u8; 64]),
}

/// The `smcuda` handle of a region's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handle {
    /// The UUID of the device holding the memory.
    pub(crate) device: [u8; 16],
    /// The allocation's base in the owner's address space.
    pub(crate) base: u64,
    /// Its length.
    pub(crate) len: u64,
    /// Its buffer id.
    pub(crate) buffer_id: u64,
    /// Where the region starts in the allocation (a region registered
    /// over part of an allocation the user made; 0 for one the fabric
    /// allocated): the peer maps the whole allocation and reaches the
    /// region at this offset in it.
    pub(crate) offset: u64,
    /// How it is reached.
    pub(crate) route: Route,
}

/// Why bytes are not an `smcuda` handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HandleError {
    /// The wrong length for its kind.
    #[error("an smcuda key handle of {0} bytes")]
    Length(usize),
    /// An unknown kind byte.
    #[error("an smcuda key handle of unknown kind {0}")]
    Kind(u8),
    /// An empty allocation, or one whose end does not fit the address
    /// space.
    #[error("an smcuda key handle with an impossible extent")]
    Extent,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Handle {
    /// The handle's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(LEGACY_LEN);
        b.push(match self.route {
            Route::Vmm { .. } => 1,
            Route::Legacy(_) => 2,
        });
        b.extend_from_slice(&self.device);
        b.extend_from_slice(&self.base.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b.extend_from_slice(&self.buffer_id.to_le_bytes());
        b.extend_from_slice(&self.offset.to_le_bytes());
        match &self.route {
            Route::Vmm { pid, server, id } => {
                b.extend_from_slice(&pid.to_le_bytes());
                b.extend_from_slice(server);
                b.extend_from_slice(id);
            }
            Route::Legacy(h) => b.extend_from_slice(h),
        }
        b
    }

    /// Read a handle from a peer's key; anything but what
    /// [`encode`](Self::encode) writes is an error.
    pub(crate) fn decode(b: &[u8]) -> Result<Handle, HandleError> {
        let kind = *b.first().ok_or(HandleError::Length(0))?;
        let want = match kind {
            1 => VMM_LEN,
            2 => LEGACY_LEN,
            k => return Err(HandleError::Kind(k)),
        };
        if b.len() != want {
            return Err(HandleError::Length(b.len()));
        }
        let (base, len, offset) = (u64_at(b, 17), u64_at(b, 25), u64_at(b, 41));
        if len == 0 || base.checked_add(len).is_none() || offset > len {
            return Err(HandleError::Extent);
        }
        let route = if kind == 1 {
            Route::Vmm {
                pid: u32::from_le_bytes(b[49..53].try_into().expect("4 bytes")),
                server: b[53..69].try_into().expect("16 bytes"),
                id: b[69..85].try_into().expect("16 bytes"),
            }
        } else {
            Route::Legacy(b[49..113].try_into().expect("64 bytes"))
        };
        Ok(Handle {
            device: b[1..17].try_into().expect("16 bytes"),
            base,
            len,
            buffer_id: u64_at(b, 33),
            offset,
            route,
        })
    }
}

/// An allocation of ours offered to peers; dropping it stops serving its
/// descriptor (mappings peers made stay valid: VMM memory lives until
/// every importer unmapped it).
pub(crate) struct Exported {
    /// The handle for the key.
    pub(crate) handle: Handle,
    _served: Option<share::Served>,
}

/// Offer `a` to the peers of `job_tag` under `id`.
pub(crate) fn export(
    gpu: &dyn Gpu,
    a: &DeviceAlloc,
    id: [u8; 16],
    job_tag: [u64; 2],
) -> crate::Result<Exported> {
    let gpu_err =
        |e: GpuError| crate::Error::Config(format!("smcuda: exporting device memory: {e}"));
    let PtrInfo::Device { buffer_id, .. } = gpu.classify(a.ptr).map_err(gpu_err)? else {
        return Err(gpu_err(GpuError::BadPointer("not device memory".into())));
    };
    let device = gpu
        .devices()
        .into_iter()
        .find(|d| d.ordinal == a.device)
        .map(|d| d.uuid)
        .ok_or_else(|| gpu_err(GpuError::BadPointer(format!("no device {}", a.device))))?;
    let (route, served) = match gpu.export(a).map_err(gpu_err)? {
        MemHandle::Fd(fd) => {
            let served = share::serve_fd(fd, a.len, share::Kind::Gpu, id, job_tag)?;
            let route = Route::Vmm {
                pid: crate::sys::os::pid(),
                server: share::server()?,
                id,
            };
            (route, Some(served))
        }
        MemHandle::Legacy(h) => (Route::Legacy(h), None),
    };
    Ok(Exported {
        handle: Handle {
            device,
            base: a.ptr,
            len: a.len,
            buffer_id,
            offset: 0,
            route,
        },
        _served: served,
    })
}

/// The mapping of `owner`'s allocation that `h` names, on our `device`,
/// from `cache` or opened now (a VMM descriptor fetched from the owner's
/// share server for job `job_tag`, or the legacy handle opened).
pub(crate) fn open(
    gpu: &Arc<dyn Gpu>,
    cache: &mut Cache<Mapping>,
    owner: Rank,
    h: &Handle,
    job_tag: [u64; 2],
    device: u32,
) -> Result<Arc<Mapping>, GpuError> {
    // What the cache must see again to hit: the VMM id (which the owner's
    // server checks), or a digest of the legacy handle.
    let ident = match &h.route {
        Route::Vmm { id, .. } => *id,
        Route::Legacy(bytes) => {
            use sha2::Digest;
            let d = sha2::Sha256::digest(bytes);
            d[..16].try_into().expect("16 bytes")
        }
    };
    cache.get_or_open(owner, h.base, h.len, h.buffer_id, ident, || {
        let mem = match h.route {
            Route::Vmm { pid, server, id } => {
                let req = share::Request {
                    kind: share::Kind::Gpu,
                    job_tag,
                    id,
                };
                let (fd, len) = share::fetch_fd(&server, pid, req).map_err(|e| match e {
                    // No such memory (a forged or stale key): the key's
                    // fault, not the pair's.
                    share::FetchError::Unknown(why) => GpuError::BadPointer(why),
                    e => GpuError::Refused(format!("fetching the peer's memory: {e}")),
                })?;
                if len != h.len {
                    return Err(GpuError::Refused(format!(
                        "the peer serves {len} bytes for an allocation of {}",
                        h.len
                    )));
                }
                MemHandle::Fd(fd)
            }
            Route::Legacy(bytes) => MemHandle::Legacy(bytes),
        };
        Mapping::import(gpu, device, mem, h.len)
    })
}

/// The allocation kind a route needs the importer to support.
#[cfg(test)]
pub(crate) fn kind_of(h: &Handle) -> AllocKind {
    match h.route {
        Route::Vmm { .. } => AllocKind::Vmm,
        Route::Legacy(_) => AllocKind::Legacy,
    }
}

#[cfg(test)]
mod tests {
    use super::super::double::{Faults, GpuDouble};
    use super::*;

    #[test]
    fn handles_round_trip_and_refuse_anything_else() {
        for route in [
            Route::Vmm {
                pid: 7,
                server: [1; 16],
                id: [2; 16],
            },
            Route::Legacy([9; 64]),
        ] {
            let h = Handle {
                device: [3; 16],
                base: 0x7000_0000,
                len: 4096,
                buffer_id: 11,
                offset: 512,
                route,
            };
            let b = h.encode();
            assert_eq!(Handle::decode(&b), Ok(h));
            for cut in 0..b.len() {
                assert!(Handle::decode(&b[..cut]).is_err());
            }
            let mut long = b.clone();
            long.push(0);
            assert!(Handle::decode(&long).is_err());
            let mut empty = b.clone();
            empty[25..33].copy_from_slice(&0u64.to_le_bytes());
            assert_eq!(Handle::decode(&empty), Err(HandleError::Extent));
            let mut wraps = b.clone();
            wraps[17..25].copy_from_slice(&u64::MAX.to_le_bytes());
            assert_eq!(Handle::decode(&wraps), Err(HandleError::Extent));
            let mut past = b.clone();
            past[41..49].copy_from_slice(&4097u64.to_le_bytes());
            assert_eq!(Handle::decode(&past), Err(HandleError::Extent));
        }
        assert_eq!(Handle::decode(&[3; VMM_LEN]), Err(HandleError::Kind(3)));
    }

    #[test]
    fn an_exported_allocation_opens_through_the_share_server_and_the_cache() {
        let owner: Arc<dyn Gpu> = Arc::new(GpuDouble::new(Faults::parse("").unwrap()).unwrap());
        let user: Arc<dyn Gpu> = Arc::new(GpuDouble::new(Faults::parse("").unwrap()).unwrap());
        let job = [5, 6];
        for kind in [AllocKind::Vmm, AllocKind::Legacy] {
            let a = owner.alloc(0, 8192, kind).unwrap();
            owner.upload(a.ptr + 10, b"on the device").unwrap();
            let id = crate::sys::os::random_bytes::<16>();
            let ex = export(&*owner, &a, id, job).unwrap();
            assert_eq!(kind_of(&ex.handle), kind);
            let h = Handle::decode(&ex.handle.encode()).unwrap();
            let mut cache = Cache::new(4);
            let m = open(&user, &mut cache, 0, &h, job, 0).unwrap();
            let mut got = [0u8; 13];
            user.download(&mut got, m.ptr() + 10).unwrap();
            assert_eq!(&got, b"on the device");
            let again = open(&user, &mut cache, 0, &h, job, 0).unwrap();
            assert_eq!(again.ptr(), m.ptr());
            assert_eq!(cache.counts().hits, 1);
            if kind == AllocKind::Vmm {
                // Another job's tag, and a forged id, are refused by the
                // owner's server.
                let mut other = Cache::new(4);
                let e = open(&user, &mut other, 0, &h, [5, 7], 0).err().unwrap();
                assert!(e.to_string().contains("refused"), "{e}");
                let mut forged = h;
                if let Route::Vmm { pid, server, .. } = h.route {
                    forged.route = Route::Vmm {
                        pid,
                        server,
                        id: [0; 16],
                    };
                }
                assert!(open(&user, &mut other, 0, &forged, job, 0).is_err());
                // A server that is not the published pid is refused.
                if let Route::Vmm { server, id, .. } = h.route {
                    forged.route = Route::Vmm { pid: 1, server, id };
                }
                let e = open(&user, &mut other, 0, &forged, job, 0).err().unwrap();
                assert!(e.to_string().contains("not by pid 1"), "{e}");
                // Once the export is dropped, nothing more is served.
                drop(ex);
                assert!(open(&user, &mut other, 0, &h, job, 0).is_err());
            }
            drop((m, again, cache));
            owner.free(a).unwrap();
        }
    }
}

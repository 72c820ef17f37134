//! Regions that same-node peers map: `Fabric::alloc_region` memory.
//!
//! Each region is a sealed memory file of its own (`sys::shm`): a page of
//! header — magic, the job tag, the length, the owner's rank, and a
//! revocation word the owner sets when it drops the region — then the
//! data, page-aligned (so every 8-byte word of it can take an atomic).
//! A peer fetches the file from the owner's share server (`sm::share`) by
//! the key's 128-bit random id on its first put, get or atomic through the
//! key, checks the seals, magic, job and owner, and bounds every access by
//! the real file, not by the key's claim; the revocation word is read on
//! every access.
//!
//! The key's `sm` handle (version 2) is the owner's pid and the id of its
//! share server (20 bytes).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::share::{self, FetchError, Served};
use crate::core::region::{KeyHandle, Mapped, RemoteKey};
use crate::sys::mem::RawBuf;
use crate::sys::shm::{Refused, SharedMem};
use crate::sys::sync::Ordering;
use crate::{AccessError, Error, Rank, Result};

/// Layout of a shared region file: a page of header, then the data.
const DATA_OFFSET: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"ABTLRGN1");
const REVOKED_OFF: usize = 64;
/// Version of the key handle below.
const HANDLE_VERSION: u16 = 2;

/// The owner's side of a shared region: the file, revoked when dropped
/// (peers that still map it see that and refuse further access), and no
/// longer served to peers.
pub(crate) struct SharedFile {
    mem: SharedMem,
    _served: Served,
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        if let Some(a) = self.mem.raw().atomic_u32(REVOKED_OFF) {
            // Release pairs with the Acquire load in `Mapped::check_live`:
            // peers that still map the file see the revocation.
            a.store(1, Ordering::Release);
        }
    }
}

/// Create a zeroed region of `len` bytes for key `id` of `owner`, in job
/// `job_tag`: the memory, what keeps it, and the key's handle.
pub(crate) fn create(
    id: &[u8; 16],
    len: usize,
    owner: Rank,
    job_tag: [u64; 2],
) -> Result<(RawBuf, SharedFile, KeyHandle)> {
    let mut file = SharedMem::create(c"abtl-region", DATA_OFFSET + len)?;
    let hdr = file.raw();
    let mut h = [0u8; 40];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&job_tag[0].to_le_bytes());
    h[16..24].copy_from_slice(&job_tag[1].to_le_bytes());
    h[24..32].copy_from_slice(&(len as u64).to_le_bytes());
    h[32..36].copy_from_slice(&owner.to_le_bytes());
    hdr.write(0, &h)?;
    let raw = hdr.slice(DATA_OFFSET as u64, len)?;
    let served = share::serve(&mut file, share::Kind::Region, *id, job_tag)?;
    let mut data = crate::sys::os::pid().to_le_bytes().to_vec();
    data.extend_from_slice(&share::server()?);
    let handle = KeyHandle::new("sm", HANDLE_VERSION, data);
    Ok((
        raw,
        SharedFile {
            mem: file,
            _served: served,
        },
        handle,
    ))
}

/// The owner's pid and share server in `key`'s `sm` handle, if it has one
/// of our version.
pub(crate) fn owner(key: &RemoteKey) -> Option<(u32, [u8; 16])> {
    let h = key.handle("sm")?;
    if h.version != HANDLE_VERSION || h.data.len() != 20 {
        return None;
    }
    let pid = u32::from_le_bytes(h.data[..4].try_into().ok()?);
    Some((pid, h.data[4..].try_into().ok()?))
}

/// Map the shared region behind `key`; checks seals, magic, job and owner.
/// Memory that is not sealed is refused and counted in `unsealed`.
pub(crate) fn open(key: &RemoteKey, job_tag: [u64; 2], unsealed: &AtomicU64) -> Result<Mapped> {
    let (pid, server) = owner(key).ok_or(AccessError::NotPermitted("direct mapping".into()))?;
    let req = share::Request {
        kind: share::Kind::Region,
        job_tag,
        id: key.id,
    };
    let bad = |what: String| Error::PeerMisbehaved {
        rank: key.owner,
        what,
    };
    let file = match share::fetch(&server, pid, req, DATA_OFFSET) {
        Ok(f) => f,
        Err(FetchError::Unknown(_)) => return Err(AccessError::UnknownKey.into()),
        Err(FetchError::Refused(r)) => {
            if matches!(r, Refused::Unsealed { .. }) {
                unsealed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            return Err(bad(format!("shared region: {r}")));
        }
        Err(FetchError::Misbehaved(why)) => return Err(bad(format!("shared region: {why}"))),
        Err(FetchError::Os(e)) => {
            return Err(Error::os(
                format!("fetching a shared region of rank {}", key.owner),
                e,
            ))
        }
    };
    let mut h = [0u8; 40];
    file.raw().read(0, &mut h)?;
    let word = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap_or_default());
    let owner = u32::from_le_bytes(h[32..36].try_into().unwrap_or_default());
    let len = word(24);
    if word(0) != MAGIC || [word(8), word(16)] != job_tag || owner != key.owner {
        return Err(AccessError::UnknownKey.into());
    }
    let avail = (file.len() - DATA_OFFSET) as u64;
    if len > avail {
        return Err(Error::PeerMisbehaved {
            rank: key.owner,
            what: format!("region file claims {len} bytes but holds {avail}"),
        });
    }
    let data = file.raw().slice(DATA_OFFSET as u64, len as usize)?;
    let revoked = file.raw().slice(REVOKED_OFF as u64, 4)?;
    Ok(Mapped::new(data, revoked, Arc::new(file)))
}

//! Regions that same-node peers map: `Fabric::alloc_region` memory.
//!
//! Each region is a file of its own in `/dev/shm`, `abtl.<pid>.<id hex>`
//! (mode 0600, `O_EXCL`, the key's 128-bit random id in the name): a page
//! of header — magic, the job tag, the length, the owner's rank, and a
//! revocation word the owner sets when it drops the region — then the
//! data, page-aligned (so every 8-byte word of it can take an atomic).
//! A peer maps the file on its first put, get or atomic through the key,
//! checks magic, job and owner, and bounds every access by the real file,
//! not by the key's claim; the revocation word is read on every access.
//!
//! The key's `sm` handle (version 1) is the owner's pid, which names the
//! file together with the id.

use std::sync::Arc;

use crate::core::region::{KeyHandle, Mapped, RemoteKey};
use crate::sys::mem::RawBuf;
use crate::sys::shm::ShmFile;
use crate::sys::sync::Ordering;
use crate::{AccessError, Error, Rank, Result};

/// Layout of a shared region file: a page of header, then the data.
const DATA_OFFSET: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"ABTLRGN1");
const REVOKED_OFF: usize = 64;
/// Version of the key handle below.
const HANDLE_VERSION: u16 = 1;

/// The owner's side of a shared region: the file, revoked when dropped
/// (peers that still map it see that and refuse further access).
pub(crate) struct SharedFile(ShmFile);

impl Drop for SharedFile {
    fn drop(&mut self) {
        if let Some(a) = self.0.raw().atomic_u32(REVOKED_OFF) {
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
    let file = ShmFile::create(id, DATA_OFFSET + len)?;
    let hdr = file.raw();
    let mut h = [0u8; 40];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&job_tag[0].to_le_bytes());
    h[16..24].copy_from_slice(&job_tag[1].to_le_bytes());
    h[24..32].copy_from_slice(&(len as u64).to_le_bytes());
    h[32..36].copy_from_slice(&owner.to_le_bytes());
    hdr.write(0, &h)?;
    let raw = hdr.slice(DATA_OFFSET as u64, len)?;
    let handle = KeyHandle::new(
        "sm",
        HANDLE_VERSION,
        crate::sys::os::pid().to_le_bytes().to_vec(),
    );
    Ok((raw, SharedFile(file), handle))
}

/// The owner's pid in `key`'s `sm` handle, if it has one of our version.
pub(crate) fn owner_pid(key: &RemoteKey) -> Option<u32> {
    let h = key.handle("sm")?;
    if h.version != HANDLE_VERSION {
        return None;
    }
    Some(u32::from_le_bytes(h.data.as_slice().try_into().ok()?))
}

/// Map the shared region behind `key`; checks magic, job and owner.
pub(crate) fn open(key: &RemoteKey, job_tag: [u64; 2]) -> Result<Mapped> {
    let pid = owner_pid(key).ok_or(AccessError::NotPermitted("direct mapping".into()))?;
    let path = crate::sys::shm::shm_dir().join(crate::sys::shm::name_for(pid, &key.id));
    let file = match ShmFile::open(&path, DATA_OFFSET) {
        Ok(f) => f,
        Err(Error::Os { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Err(AccessError::UnknownKey.into())
        }
        Err(e) => return Err(e),
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

//! Registered memory: [`MemoryRegion`] (owned, kept alive by every operation
//! that uses it) and [`RemoteKey`] (what a peer needs to reach it).
//!
//! A key names a region by a 128-bit random id, never by an address; the
//! owner looks the id up in its own table and checks the range on every
//! access, so a forged or stale key reaches nothing. Regions made by
//! [`Fabric::alloc_region`](crate::Fabric::alloc_region) live in a shared
//! file that same-node peers map, so `put`/`get` to them are one copy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};

use crate::mem::{HeapBuf, RawBuf};
use crate::shm::ShmFile;
use crate::sync::{lock, Ordering};
use crate::{AccessError, Error, Rank, Result};

/// The 128-bit random identity of a region.
pub(crate) type KeyId = [u8; 16];

/// What a peer needs to `put` into or `get` from a region: serde-serialisable,
/// send it to peers in a message. Unguessable (128 random bits) and carrying
/// its bounds; the owner checks both on every access.
///
/// A key to a region the peer shares (`Fabric::alloc_region`) on this node
/// keeps the mapping its first `put` or `get` made, like UCX's unpacked
/// remote key: later operations through it (and its clones) skip the
/// lookup and are one bounds check, one revocation check and one copy. The
/// mapping goes when the last clone of the key is dropped. (It is not part
/// of the key's value: not serialised, not compared.)
#[derive(Clone, Serialize, Deserialize)]
pub struct RemoteKey {
    pub(crate) owner: Rank,
    pub(crate) id: KeyId,
    pub(crate) len: u64,
    /// Owner's pid when the region is a shared file peers can map.
    pub(crate) shm_pid: Option<u32>,
    /// The mapping made on first use, with the job it was checked against.
    #[serde(skip)]
    mapped: std::sync::OnceLock<([u64; 2], MappedRegion)>,
}

impl PartialEq for RemoteKey {
    fn eq(&self, other: &Self) -> bool {
        (self.owner, self.id, self.len, self.shm_pid)
            == (other.owner, other.id, other.len, other.shm_pid)
    }
}

impl Eq for RemoteKey {}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKey")
            .field("owner", &self.owner)
            .field("len", &self.len)
            .field("shared", &self.shm_pid.is_some())
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
    /// Decode what [`RemoteKey::to_bytes`] produced.
    pub fn from_bytes(b: &[u8]) -> Result<RemoteKey> {
        postcard::from_bytes(b).map_err(|e| Error::Misuse(format!("not a remote key: {e}")))
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
        open: impl FnOnce() -> Result<MappedRegion>,
    ) -> Result<&MappedRegion> {
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

    /// Whether the region lives in a shared file that same-node peers map.
    pub(crate) fn is_shared(&self) -> bool {
        self.shm_pid.is_some()
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

/// Layout of a shared region file: a page of header, then the data.
pub(crate) const REGION_DATA_OFFSET: usize = 4096;
const REGION_MAGIC: u64 = u64::from_le_bytes(*b"ABTLRGN1");
const REVOKED_OFF: usize = 64;

enum Backing {
    Heap(HeapBuf),
    Shm(ShmFile),
}

pub(crate) struct RegionInner {
    pub(crate) id: KeyId,
    raw: RawBuf,
    backing: Option<Backing>,
    table: Weak<RegionTable>,
}

impl RegionInner {
    pub(crate) fn raw(&self) -> RawBuf {
        self.raw
    }
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        if let Some(t) = self.table.upgrade() {
            lock(&t.map).remove(&self.id);
        }
        if let Some(Backing::Shm(f)) = &self.backing {
            if let Some(a) = f.raw().atomic_u32(REVOKED_OFF) {
                // Release pairs with the Acquire load in MappedRegion::check:
                // peers that still map the file see the revocation.
                a.store(1, Ordering::Release);
            }
        }
    }
}

/// A registered buffer. Cloning is cheap and shares the memory. The memory
/// lives until the last clone *and* every operation using it are gone, so
/// dropping a future can never free memory a peer may still write.
///
/// Contents are accessed by copy ([`MemoryRegion::read`],
/// [`MemoryRegion::write`]) because peers may write them at any time.
#[derive(Clone)]
pub struct MemoryRegion {
    pub(crate) inner: Arc<RegionInner>,
    key: RemoteKey,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.len())
            .field("shared", &self.key.shm_pid.is_some())
            .finish()
    }
}

impl MemoryRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.raw.len()
    }
    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The key peers use to reach this region.
    pub fn remote_key(&self) -> RemoteKey {
        self.key.clone()
    }
    /// Whether peers on this node can map the region (one-copy put/get).
    pub fn is_shared(&self) -> bool {
        self.key.shm_pid.is_some()
    }
    /// Copy `dst.len()` bytes from `offset` out of the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        Ok(self.inner.raw.read(offset as u64, dst)?)
    }
    /// Copy `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        Ok(self.inner.raw.write(offset as u64, src)?)
    }
    /// The whole region, copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        let _ = self.inner.raw.read(0, &mut v);
        v
    }
    /// Take a heap region's buffer back, if this is the only handle and no
    /// operation is using it; otherwise the region is returned unchanged.
    pub fn try_into_vec(self) -> Result<Vec<u8>, MemoryRegion> {
        let key = self.key;
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => match inner.backing.take() {
                Some(Backing::Heap(h)) => Ok(h.into_vec()),
                other => {
                    inner.backing = other;
                    Err(MemoryRegion {
                        inner: Arc::new(inner),
                        key,
                    })
                }
            },
            Err(inner) => Err(MemoryRegion { inner, key }),
        }
    }
}

/// The regions this process registered, by id.
#[derive(Default)]
pub(crate) struct RegionTable {
    map: Mutex<HashMap<KeyId, Weak<RegionInner>>>,
}

impl RegionTable {
    fn insert(self: &Arc<Self>, inner: RegionInner, key: RemoteKey) -> MemoryRegion {
        let inner = Arc::new(inner);
        lock(&self.map).insert(inner.id, Arc::downgrade(&inner));
        MemoryRegion { inner, key }
    }

    /// Register a heap buffer.
    pub(crate) fn register(self: &Arc<Self>, owner: Rank, buf: Vec<u8>) -> MemoryRegion {
        let heap = HeapBuf::from_vec(buf);
        let id = crate::os::random_bytes::<16>();
        let key = RemoteKey {
            owner,
            id,
            len: heap.raw().len() as u64,
            shm_pid: None,
            mapped: Default::default(),
        };
        let inner = RegionInner {
            id,
            raw: heap.raw(),
            backing: Some(Backing::Heap(heap)),
            table: Arc::downgrade(self),
        };
        self.insert(inner, key)
    }

    /// Allocate a zeroed region in a shared file.
    pub(crate) fn alloc_shared(
        self: &Arc<Self>,
        owner: Rank,
        len: usize,
        job_tag: [u64; 2],
    ) -> Result<MemoryRegion> {
        let id = crate::os::random_bytes::<16>();
        let file = ShmFile::create(&id, REGION_DATA_OFFSET + len)?;
        let hdr = file.raw();
        let mut h = [0u8; 40];
        h[0..8].copy_from_slice(&REGION_MAGIC.to_le_bytes());
        h[8..16].copy_from_slice(&job_tag[0].to_le_bytes());
        h[16..24].copy_from_slice(&job_tag[1].to_le_bytes());
        h[24..32].copy_from_slice(&(len as u64).to_le_bytes());
        h[32..36].copy_from_slice(&owner.to_le_bytes());
        hdr.write(0, &h)?;
        let raw = hdr.slice(REGION_DATA_OFFSET as u64, len)?;
        let key = RemoteKey {
            owner,
            id,
            len: len as u64,
            shm_pid: Some(crate::os::pid()),
            mapped: Default::default(),
        };
        let inner = RegionInner {
            id,
            raw,
            backing: Some(Backing::Shm(file)),
            table: Arc::downgrade(self),
        };
        Ok(self.insert(inner, key))
    }

    /// Look a live region up by id.
    pub(crate) fn get(&self, id: &KeyId) -> Option<Arc<RegionInner>> {
        lock(&self.map).get(id).and_then(Weak::upgrade)
    }
}

/// A peer's shared region mapped into this process.
#[derive(Clone)]
pub(crate) struct MappedRegion {
    file: Arc<ShmFile>,
    data: RawBuf,
}

impl MappedRegion {
    /// Map the shared region behind `key`; checks magic, job and owner.
    pub(crate) fn open(key: &RemoteKey, job_tag: [u64; 2]) -> Result<MappedRegion> {
        let pid = key
            .shm_pid
            .ok_or(AccessError::NotPermitted("direct mapping".into()))?;
        let path = crate::shm::shm_dir().join(crate::shm::name_for(pid, &key.id));
        let file = match ShmFile::open(&path, REGION_DATA_OFFSET) {
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
        if word(0) != REGION_MAGIC || [word(8), word(16)] != job_tag || owner != key.owner {
            return Err(AccessError::UnknownKey.into());
        }
        let avail = (file.len() - REGION_DATA_OFFSET) as u64;
        if len > avail {
            return Err(Error::PeerMisbehaved {
                rank: key.owner,
                what: format!("region file claims {len} bytes but holds {avail}"),
            });
        }
        let data = file.raw().slice(REGION_DATA_OFFSET as u64, len as usize)?;
        Ok(MappedRegion {
            file: Arc::new(file),
            data,
        })
    }

    /// Fail if the owner has dropped the region since we mapped it.
    pub(crate) fn check_live(&self) -> Result<(), AccessError> {
        match self.file.raw().atomic_u32(REVOKED_OFF) {
            // Acquire pairs with the Release store in RegionInner::drop.
            Some(a) if a.load(Ordering::Acquire) == 0 => Ok(()),
            _ => Err(AccessError::UnknownKey),
        }
    }

    /// The data range (bounds: the real file, not the key's claim).
    pub(crate) fn data(&self) -> RawBuf {
        self.data
    }
}

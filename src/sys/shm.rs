//! Shared memory: anonymous memory files (`memfd_create`), sized once and
//! sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_SEAL`) before anyone maps them, then mapped shared. They have no
//! name in any directory: a peer gets one as a descriptor from its owner
//! (`sm::share`), checks the seals and the size and maps it. Since no one
//! — the owner, a peer, another process of the user, root — can make such a
//! file shorter while it is mapped, no access to a mapping inside its size
//! can ever fault with SIGBUS. The memory goes when the last mapping and
//! descriptor of it go, whoever dies first.
//!
//! Older builds put their segments in `/dev/shm` as `abtl.<pid>.<hex>`
//! files; what crashed jobs left there is still removed at start-up and by
//! `btl-run` (the pid in the name is dead).

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};

use crate::sys::mem::RawBuf;
use crate::sys::os;
use crate::{Error, Result};

/// Where older builds' shared-memory files lived (`BTL_SHM_DIR` overrides),
/// cleaned of crashed jobs' leftovers.
pub(crate) fn shm_dir() -> PathBuf {
    std::env::var_os("BTL_SHM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
}

/// File name prefix of everything async-btl put in the shm dir.
pub(crate) const PREFIX: &str = "abtl.";

/// The seals every shared memory file carries before it is mapped, and
/// that a peer's must carry before we map it.
pub(crate) const SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Why a peer's memory descriptor was refused.
#[derive(Debug)]
pub(crate) enum Refused {
    /// It is not sealed against shrinking (or growing, or more seals): a
    /// mapping of it could fault.
    Unsealed {
        /// The seals it has.
        seals: i32,
    },
    /// Not a memory file of this user with no access for others.
    Foreign(String),
    /// Smaller than the header its owner must have written.
    TooSmall {
        /// Its size.
        len: u64,
    },
    /// A system call on it failed.
    Os(&'static str, std::io::Error),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Unsealed { seals } => write!(
                f,
                "its shared memory is not sealed against shrinking (seals {seals:#x}, need \
                 {SEALS:#x}): a truncation could kill this process, so it is not mapped"
            ),
            Refused::Foreign(what) => write!(f, "{what}: refusing to map it"),
            Refused::TooSmall { len } => write!(
                f,
                "its shared memory is {len} bytes, smaller than a valid header"
            ),
            Refused::Os(what, e) => write!(f, "{what} of its shared memory: {e}"),
        }
    }
}

/// A mapped shared memory file (ours, or a peer's).
pub(crate) struct SharedMem {
    map: MmapRaw,
    raw: RawBuf,
    /// Kept by the owner, to hand to peers; a peer closes it once mapped.
    fd: Option<OwnedFd>,
}

impl SharedMem {
    /// Create zeroed memory of `len` bytes, sealed, mapped; `what` names
    /// it in `/proc/<pid>/fd` (`/memfd:abtl-<what>`).
    pub(crate) fn create(what: &CStr, len: usize) -> Result<SharedMem> {
        let fd = memfd(what)?;
        let file = File::from(fd);
        // A memory file starts as mode 0777; only its owner may reopen it
        // through /proc (and peers check this).
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::os("making shared memory private", e))?;
        file.set_len(len as u64)
            .map_err(|e| Error::os("sizing shared memory (out of memory?)", e))?;
        // SAFETY: fcntl F_ADD_SEALS takes an int argument and touches no
        // memory of ours; the descriptor is open.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) };
        if r != 0 {
            return Err(Error::os(
                "sealing shared memory",
                std::io::Error::last_os_error(),
            ));
        }
        let map = map(&file, len).map_err(|e| Error::os("mapping shared memory", e))?;
        Ok(Self::wrap(map, Some(OwnedFd::from(file))))
    }

    /// Map memory whose descriptor a peer sent, if it is a memory file of
    /// this user, private to it, sealed ([`SEALS`]) and at least `min_len`
    /// bytes. The mapping covers the whole file; the descriptor is closed.
    pub(crate) fn from_peer(
        fd: OwnedFd,
        min_len: usize,
    ) -> std::result::Result<SharedMem, Refused> {
        let file = File::from(fd);
        // The seals first, then the size: once shrinking is sealed (and
        // sealing too) the size read after cannot drop under the mapping.
        // Read the other way round, an owner could shrink the file between
        // the two reads and seal it after, and the mapping would reach
        // past its end (SIGBUS on touch).
        let seals = seals_of(file.as_fd()).map_err(|e| Refused::Os("reading the seals", e))?;
        if seals & SEALS != SEALS {
            return Err(Refused::Unsealed { seals });
        }
        let md = file.metadata().map_err(|e| Refused::Os("fstat", e))?;
        let ft = md.file_type();
        if !ft.is_file() {
            return Err(Refused::Foreign("it is not a memory file".into()));
        }
        if md.uid() != os::uid() || md.mode() & 0o077 != 0 {
            return Err(Refused::Foreign(format!(
                "its shared memory is not private to this user (uid {}, mode {:o})",
                md.uid(),
                md.mode() & 0o777
            )));
        }
        let len = md.len();
        if len < min_len as u64 {
            return Err(Refused::TooSmall { len });
        }
        let len = usize::try_from(len).map_err(|_| Refused::TooSmall { len })?;
        let map = map(&file, len).map_err(|e| Refused::Os("mapping", e))?;
        Ok(Self::wrap(map, None))
    }

    fn wrap(map: MmapRaw, fd: Option<OwnedFd>) -> SharedMem {
        let len = map.len();
        // SAFETY: the mapping is `len` bytes, readable and writable, and is
        // owned by the returned SharedMem next to this RawBuf; the RawBuf is
        // never used after the SharedMem drops (it is private and only lent
        // out by value to code that holds the SharedMem alive via Arc). The
        // file is sealed against shrinking, so every byte of the mapping
        // stays backed for as long as it exists.
        let raw = unsafe { RawBuf::new(map.as_mut_ptr(), len) };
        SharedMem { map, raw, fd }
    }

    /// The mapped bytes.
    pub(crate) fn raw(&self) -> RawBuf {
        self.raw
    }

    /// The mapped bytes, borrowed (for atomics that must not outlive us).
    pub(crate) fn raw_ref(&self) -> &RawBuf {
        &self.raw
    }

    /// Length of the mapping.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The descriptor to hand to peers (the owner's, until taken).
    #[cfg(test)]
    pub(crate) fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(AsFd::as_fd)
    }

    /// Take the descriptor (to serve it); the mapping stays.
    pub(crate) fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fd.take()
    }
}

/// A fresh sealable memory file, close-on-exec, not yet sealed.
pub(crate) fn memfd(what: &CStr) -> Result<OwnedFd> {
    // SAFETY: `what` is a NUL-terminated string that outlives the call;
    // memfd_create returns a new descriptor or -1.
    let r =
        unsafe { libc::memfd_create(what.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if r < 0 {
        return Err(Error::os(
            "creating shared memory (memfd_create)",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: r is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// The seals of a memory file (`F_GET_SEALS`).
pub(crate) fn seals_of(fd: BorrowedFd<'_>) -> std::io::Result<i32> {
    // SAFETY: fcntl F_GET_SEALS takes no argument and touches no memory of
    // ours; the descriptor is open for the borrow's lifetime.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn map(file: &File, len: usize) -> std::io::Result<MmapRaw> {
    MmapOptions::new().len(len).map_raw(file)
}

/// Remove shm files that crashed jobs of older builds left (this user's
/// `abtl.<pid>.*` whose pid no longer exists). Returns how many were
/// removed.
pub(crate) fn remove_stale() -> usize {
    remove_matching(|pid| !os::pid_exists(pid))
}

/// Remove the shm files in `dir` of processes that are known to be dead
/// (a launcher's reaped ranks, which a signal may have killed before they
/// could unlink). Returns how many were removed.
pub(crate) fn remove_of_dead_in(dir: &Path, dead: &[u32]) -> usize {
    remove_matching_in(dir, |pid| dead.contains(&pid))
}

fn remove_matching(pred: impl Fn(u32) -> bool) -> usize {
    remove_matching_in(&shm_dir(), pred)
}

fn remove_matching_in(dir: &Path, pred: impl Fn(u32) -> bool) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let me = os::uid();
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|s| s.strip_prefix(PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let ours = e.metadata().map(|m| m.uid() == me).unwrap_or(false);
        if ours && pred(pid) && std::fs::remove_file(e.path()).is_ok() {
            n += 1;
        }
    }
    n
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_cannot_be_shrunk_or_grown_and_peers_check_the_seals() {
        let mem = SharedMem::create(c"abtl-test", 3 * 4096).unwrap();
        let len = mem.len() as u64;
        let file = File::from(mem.fd().unwrap().try_clone_to_owned().unwrap());
        for to in [0, len - 1, len + 4096] {
            let e = file.set_len(to).expect_err("a sealed file keeps its size");
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "set_len({to}): {e}");
        }
        assert_eq!(seals_of(file.as_fd()).unwrap() & SEALS, SEALS);
        let peer = SharedMem::from_peer(OwnedFd::from(file), 4096).unwrap();
        assert_eq!(peer.len() as u64, len);
        assert!(peer.fd().is_none());
        let small = mem.fd().unwrap().try_clone_to_owned().unwrap();
        let e = SharedMem::from_peer(small, 1 << 20).err().unwrap();
        assert!(matches!(e, Refused::TooSmall { .. }), "{e}");
        let plain = File::open("/proc/self/status").unwrap();
        assert!(SharedMem::from_peer(OwnedFd::from(plain), 0).is_err());
    }
}

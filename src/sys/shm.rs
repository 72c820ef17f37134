//! Shared-memory files under `/dev/shm`: created `0600` with `O_EXCL` under an
//! unguessable name `abtl.<pid>.<128-bit hex>`, mapped shared, unlinked by
//! their owner on drop, by a survivor when the owner dies, and at the next
//! start when a crashed job left them behind (the pid in the name is dead).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};

use crate::sys::mem::RawBuf;
use crate::sys::os;
use crate::{Error, Result};

/// Where shared-memory files live (`BTL_SHM_DIR` overrides, for tests).
pub(crate) fn shm_dir() -> PathBuf {
    std::env::var_os("BTL_SHM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
}

/// File name prefix shared by everything async-btl puts in the shm dir.
pub(crate) const PREFIX: &str = "abtl.";

/// The name of a file owned by `pid` with random id `id`.
pub(crate) fn name_for(pid: u32, id: &[u8; 16]) -> String {
    format!("{PREFIX}{pid}.{}", os::hex(id))
}

/// A mapped shared-memory file.
pub(crate) struct ShmFile {
    map: MmapRaw,
    raw: RawBuf,
    path: PathBuf,
    owner: bool,
}

impl ShmFile {
    /// Create a new zeroed file of `len` bytes named for `pid`/`id`.
    pub(crate) fn create(id: &[u8; 16], len: usize) -> Result<ShmFile> {
        let path = shm_dir().join(name_for(os::pid(), id));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::os(format!("creating shared memory {}", path.display()), e))?;
        let cleanup = |e: std::io::Error, what: &str| {
            let _ = std::fs::remove_file(&path);
            Error::os(format!("{what} {}", path.display()), e)
        };
        file.set_len(len as u64).map_err(|e| {
            cleanup(
                e,
                "sizing shared memory (is /dev/shm full? raise its size or lower BTL_SM_* counts)",
            )
        })?;
        let mut f = Self::map(file, &path, len).inspect_err(|_| {
            let _ = std::fs::remove_file(&path);
        })?;
        f.owner = true;
        Ok(f)
    }

    /// Open and map an existing file made by a peer; it must be ours (uid),
    /// mode 0600 and at least `min_len` bytes.
    pub(crate) fn open(path: &Path, min_len: usize) -> Result<ShmFile> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::os(format!("opening peer shared memory {}", path.display()), e))?;
        let md = file
            .metadata()
            .map_err(|e| Error::os(format!("stat {}", path.display()), e))?;
        if md.uid() != os::uid() || md.mode() & 0o077 != 0 {
            return Err(Error::Config(format!(
                "{} is not private to this user (uid {}, mode {:o}): refusing to attach",
                path.display(),
                md.uid(),
                md.mode() & 0o777
            )));
        }
        let len = md.len() as usize;
        if len < min_len {
            return Err(Error::Config(format!(
                "{} is {len} bytes, smaller than a valid header ({min_len}): not an async-btl segment",
                path.display()
            )));
        }
        Self::map(file, path, len)
    }

    fn map(file: File, path: &Path, len: usize) -> Result<ShmFile> {
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| Error::os(format!("mapping {}", path.display()), e))?;
        // SAFETY: the mapping is `len` bytes, readable and writable, and is
        // owned by the returned ShmFile next to this RawBuf; the RawBuf is
        // never used after the ShmFile drops (it is private and only lent
        // out by value to code that holds the ShmFile alive via Arc).
        let raw = unsafe { RawBuf::new(map.as_mut_ptr(), len) };
        Ok(ShmFile {
            map,
            raw,
            path: path.to_path_buf(),
            owner: false,
        })
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

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Remove the name now (mappings stay valid).
    pub(crate) fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ShmFile {
    fn drop(&mut self) {
        if self.owner {
            self.unlink();
        }
    }
}

/// Remove shm files left by dead processes of this user (`abtl.<pid>.*`
/// whose pid no longer exists). Returns how many were removed.
pub(crate) fn remove_stale() -> usize {
    remove_matching(|pid| !os::pid_exists(pid))
}

/// Remove the shm files of one (dead) process.
pub(crate) fn remove_of_pid(dead: u32) -> usize {
    remove_matching(|pid| pid == dead)
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

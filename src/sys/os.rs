//! Thin, checked wrappers over the few libc calls we need: process liveness
//! (pidfd), doorbell sockets, identity of this node.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// This process's id.
pub(crate) fn pid() -> u32 {
    std::process::id()
}

/// This process's effective uid.
pub(crate) fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether this process has had only one thread so far, as the C library
/// keeps track of it for its own single-thread fast paths (glibc's
/// `__libc_single_threaded`, looked up once at run time). `false` where
/// the C library keeps no such flag, as if the process had several.
pub(crate) fn single_threaded() -> bool {
    static FLAG: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let flag = *FLAG.get_or_init(|| {
        // SAFETY: dlsym reads the NUL-terminated name and returns an
        // address or null; RTLD_DEFAULT searches the objects already loaded.
        unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__libc_single_threaded".as_ptr()) as usize }
    });
    if flag == 0 {
        return false;
    }
    // SAFETY: `flag` is the address of glibc's `char __libc_single_threaded`,
    // a global that lives as long as the process. glibc clears it (and never
    // sets it again) in `pthread_create`; a volatile byte read sees either
    // value whole, and a stale `true` is corrected on the next call.
    unsafe { std::ptr::read_volatile(flag as *const u8) != 0 }
}

/// Whether a process with this pid exists (zombies count as existing).
pub(crate) fn pid_exists(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: kill with signal 0 performs only the permission/existence check.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A handle that becomes readable when a process exits (Linux pidfd), with a
/// `kill(pid, 0)` fallback on kernels without pidfd.
pub(crate) struct ProcWatch {
    pid: u32,
    fd: Option<OwnedFd>,
}

impl ProcWatch {
    /// Start watching `pid`.
    pub(crate) fn new(pid: u32) -> ProcWatch {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1;
        // no memory is passed.
        let r =
            unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0 as libc::c_long) };
        let fd = if r >= 0 {
            // SAFETY: r is a fresh fd we own exclusively.
            Some(unsafe { OwnedFd::from_raw_fd(r as i32) })
        } else {
            None
        };
        ProcWatch { pid, fd }
    }

    /// Whether the process has exited (a zombie counts as exited).
    pub(crate) fn exited(&self) -> bool {
        match &self.fd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, timeout 0: never blocks.
                let r = unsafe { libc::poll(&mut p, 1, 0) };
                r > 0 && (p.revents & (libc::POLLIN | libc::POLLHUP)) != 0
            }
            None => !pid_exists(self.pid),
        }
    }
}

/// An identifier of this machine's running kernel: peers with the same node
/// id can share memory. Hostname plus boot id (so two containers with the
/// same hostname on different hosts differ).
pub(crate) fn node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", host.trim(), boot.trim())
}

/// This process's network namespace (`net:[inode]`, empty if unknown):
/// Unix sockets in the abstract namespace reach only processes that share
/// it.
pub(crate) fn net_namespace() -> String {
    namespace("net")
}

/// This process's pid namespace, as `/proc/self/ns/pid` names it (empty
/// where it cannot be read): peers in another see other pids for the same
/// processes.
pub(crate) fn pid_namespace() -> String {
    namespace("pid")
}

fn namespace(kind: &str) -> String {
    std::fs::read_link(format!("/proc/self/ns/{kind}"))
        .map(|l| l.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Fill a buffer with OS randomness.
pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    rand::fill(&mut b[..]);
    b
}

/// Lower-case hex.
pub(crate) fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// Whether CMA (process_vm_readv) may read this process from a sibling: the
/// Yama ptrace scope must be 0 (or we are root).
pub(crate) fn cma_status() -> std::result::Result<(), String> {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    if uid() == 0 || scope == 0 {
        Ok(())
    } else {
        Err(format!(
            "kernel.yama.ptrace_scope={scope} forbids process_vm_readv between sibling processes"
        ))
    }
}

/// The CPUs this process may run on (`sched_getaffinity`), ascending.
pub(crate) fn cpu_affinity() -> std::io::Result<Vec<u32>> {
    // SAFETY: cpu_set_t is a plain bit array; all-zero is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is this process; the size passed is exactly that of
    // `set`, which the kernel writes and nothing else.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let max = 8 * std::mem::size_of_val(&set);
    Ok((0..max)
        // SAFETY: `cpu` is below the set's capacity in bits, as CPU_ISSET
        // requires.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .map(|cpu| cpu as u32)
        .collect())
}

/// Which way a cross-memory copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cma {
    /// Copy from the other process into our memory (`process_vm_readv`).
    Read,
    /// Copy from our memory into the other process (`process_vm_writev`).
    Write,
}

/// Copy `local.len()` bytes between our `local` range and `remote_addr` in
/// process `pid`, in one system call per `IOV_MAX` chunk. The kernel checks
/// the remote range (EFAULT) and our right to touch that process (EPERM).
pub(crate) fn cma_copy(
    dir: Cma,
    pid: u32,
    local: crate::sys::mem::RawBuf,
    remote_addr: u64,
) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < local.len() {
        let n = local.len() - done;
        let liov = libc::iovec {
            iov_base: local.addr().wrapping_add(done) as *mut libc::c_void,
            iov_len: n,
        };
        let riov = libc::iovec {
            iov_base: (remote_addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: n,
        };
        // SAFETY: `liov` describes `local`'s remaining bytes, which are valid
        // for reads and writes (RawBuf's contract) and referenced by no Rust
        // reference; the remote iovec is only dereferenced by the kernel,
        // inside the other process, with its own checks (EFAULT on a bad
        // range). One iovec each side; flags must be 0.
        let r = unsafe {
            match dir {
                Cma::Read => libc::process_vm_readv(pid as libc::pid_t, &liov, 1, &riov, 1, 0),
                Cma::Write => libc::process_vm_writev(pid as libc::pid_t, &liov, 1, &riov, 1, 0),
            }
        };
        done += copied(r)?;
    }
    Ok(())
}

/// The bytes a `process_vm_readv/writev` call moved, or why it failed
/// (no progress at all counts as failure, so a caller's loop ends).
fn copied(r: isize) -> std::io::Result<usize> {
    match r {
        r if r < 0 => Err(std::io::Error::last_os_error()),
        0 => Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "cross-memory copy made no progress",
        )),
        r => Ok(r as usize),
    }
}

/// Append `n` bytes read from `remote_addr` in process `pid` to `dst`, by
/// single copy. On error `dst` keeps its length (its spare room may have
/// been written).
pub(crate) fn cma_read_into(
    pid: u32,
    remote_addr: u64,
    n: usize,
    dst: &mut Vec<u8>,
) -> std::io::Result<()> {
    dst.reserve(n);
    let spare = &mut dst.spare_capacity_mut()[..n];
    // SAFETY: `spare` is n bytes of `dst`'s allocation, valid for writes;
    // the mutable borrow keeps every other access away while `raw` is used,
    // and `raw` does not outlive this function.
    let raw = unsafe { crate::sys::mem::RawBuf::new(spare.as_mut_ptr().cast::<u8>(), n) };
    cma_copy(Cma::Read, pid, raw, remote_addr)?;
    // SAFETY: cma_copy returned Ok only once all n bytes were written.
    unsafe { dst.set_len(dst.len() + n) };
    Ok(())
}

/// Write `src` into process `pid` at `remote_addr` by single copy
/// (`process_vm_writev`). The kernel checks the remote range (EFAULT) and
/// our right to touch that process (EPERM).
pub(crate) fn cma_write_from(pid: u32, remote_addr: u64, src: &[u8]) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < src.len() {
        let rest = &src[done..];
        let liov = libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        };
        let riov = libc::iovec {
            iov_base: (remote_addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: `liov` describes `rest`, a live shared slice that the
        // kernel only reads (process_vm_writev never writes its local side);
        // the remote iovec is only dereferenced by the kernel, inside the
        // other process, with its own checks. One iovec each side; flags 0.
        let r = unsafe { libc::process_vm_writev(pid as libc::pid_t, &liov, 1, &riov, 1, 0) };
        done += copied(r)?;
    }
    Ok(())
}

/// A receive buffer whose tail another process may be writing by single
/// copy (the `sm` split copy, see `sm::split`) while we fill its head.
///
/// The tail is never reached through a Rust reference while the buffer is
/// out, only by address, and dropping a `SplitBuf` *leaks* the buffer: the
/// other process might still write there. Only [`SplitBuf::complete`] and
/// [`SplitBuf::reclaim`], whose callers vouch that no write is under way,
/// give the memory back.
pub(crate) struct SplitBuf {
    buf: std::mem::ManuallyDrop<Vec<u8>>,
    head: usize,
    len: usize,
}

impl SplitBuf {
    /// Use `buf` (emptied; its capacity grows to `len` first) for a message
    /// of `len` bytes whose first `head` bytes we copy ourselves.
    pub(crate) fn new(mut buf: Vec<u8>, len: usize, head: usize) -> SplitBuf {
        buf.clear();
        buf.reserve_exact(len);
        SplitBuf {
            buf: std::mem::ManuallyDrop::new(buf),
            head: head.min(len),
            len,
        }
    }

    /// Bytes in the head (ours to copy).
    pub(crate) fn head(&self) -> usize {
        self.head
    }

    /// Bytes in the whole message.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Where the tail starts, for the process asked to write it.
    pub(crate) fn tail_addr(&self) -> u64 {
        // An address only: no reference into the tail is made.
        self.buf.as_ptr() as u64 + self.head as u64
    }

    /// The raw range `[from, to)` of the allocation, made without a
    /// reference to any byte (the tail may be written concurrently).
    fn range(&mut self, from: usize, to: usize) -> crate::sys::mem::RawBuf {
        let base = self.buf.as_mut_ptr();
        // SAFETY: from <= to <= len <= capacity (callers pass head/len), so
        // the range lies inside the allocation, which stays put: nothing
        // grows or frees `buf` while this struct holds it. Its only other
        // writer is the kernel on behalf of the process that claimed the
        // *other* part (the tail while we fill the head; nobody once taken
        // back), never through a Rust reference.
        unsafe { crate::sys::mem::RawBuf::new(base.add(from), to - from) }
    }

    /// Copy the head from `remote_addr` in process `pid`.
    pub(crate) fn read_head(&mut self, pid: u32, remote_addr: u64) -> std::io::Result<()> {
        let raw = self.range(0, self.head);
        cma_copy(Cma::Read, pid, raw, remote_addr)
    }

    /// Copy the tail ourselves from `remote_addr` (the start of the tail in
    /// process `pid`), once it was taken back from the other process.
    pub(crate) fn read_tail(&mut self, pid: u32, remote_addr: u64) -> std::io::Result<()> {
        let raw = self.range(self.head, self.len);
        cma_copy(Cma::Read, pid, raw, remote_addr)
    }

    /// The whole message.
    ///
    /// # Safety
    /// The head was read ([`read_head`](Self::read_head) returned Ok) and
    /// the tail is written and no longer being written: by us
    /// ([`read_tail`](Self::read_tail) returned Ok), or by the other
    /// process, which said so (`DONE` in the split word, loaded with
    /// Acquire after its `process_vm_writev` of every tail byte returned).
    pub(crate) unsafe fn complete(mut self) -> Vec<u8> {
        let len = self.len;
        // SAFETY: the caller vouches all `len` bytes are initialised and
        // that no write is under way; the Vec's capacity is at least len.
        unsafe { self.buf.set_len(len) };
        // SAFETY: taken once, and `self` (which has no Drop of its own)
        // ends here, so the ManuallyDrop is never used again.
        unsafe { std::mem::ManuallyDrop::take(&mut self.buf) }
    }

    /// Give the (empty) buffer back for other uses.
    ///
    /// # Safety
    /// No other process writes into the buffer any more: the tail was taken
    /// back before anyone claimed it, or its writer finished (`DONE` or
    /// `FAILED`).
    pub(crate) unsafe fn reclaim(mut self) -> Vec<u8> {
        // SAFETY: as in `complete`; the length stays 0 (nothing claimed as
        // initialised).
        unsafe { std::mem::ManuallyDrop::take(&mut self.buf) }
    }
}

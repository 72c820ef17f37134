//! libfabric through the C shim (`shim.c`): the `extern "C"` declarations
//! and the safe types over them. The only unsafe code of `rdma` lives here.
//!
//! The endpoint is opened with `FI_THREAD_SAFE` (the provider serialises
//! its own calls), so an [`Ep`] is shared between threads, and a memory
//! registration can be closed from whatever thread drops its region.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::NonNull;

/// The shim's opaque endpoint object.
#[repr(C)]
struct RawEp {
    _private: [u8; 0],
}

/// libfabric's `struct fi_info`, opaque here.
#[repr(C)]
struct RawInfo {
    _private: [u8; 0],
}

/// libfabric's `struct fid_mr`, opaque here.
#[repr(C)]
struct RawMr {
    _private: [u8; 0],
}

/// The shim's `struct abtl_cqe`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct Cqe {
    /// The address of the context the operation was posted with (an
    /// address, not a pointer: an entry is only looked up by it, never
    /// read through it).
    pub(crate) ctx: usize,
    /// What completed (`FI_SEND`, `FI_RECV`, ...).
    pub(crate) flags: u64,
    /// Bytes received, for a receive.
    pub(crate) len: u64,
    /// The sender's address handle, for a receive (`FI_ADDR_NOTAVAIL`:
    /// an address we never inserted).
    pub(crate) src: u64,
}

/// The shim's `struct abtl_cqerr`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawCqErr {
    ctx: *mut c_void,
    flags: u64,
    err: i32,
    prov_errno: i32,
}

/// The shim's `struct abtl_prov`.
#[repr(C)]
struct RawProv {
    prov_name: *const c_char,
    fabric_name: *const c_char,
    domain_name: *const c_char,
    mr_mode: u64,
    mr_key_size: u64,
    max_msg_size: u64,
    inject_size: u64,
    progress: u32,
    wait_fd: u32,
    iov_limit: u64,
}

extern "C" {
    fn abtl_fi_version() -> u32;
    fn abtl_strerror(err: c_int) -> *const c_char;
    fn abtl_getinfo(prov: *const c_char, node: *const c_char, out: *mut *mut RawInfo) -> c_int;
    fn abtl_freeinfo(info: *mut RawInfo);
    fn abtl_info_next(info: *mut RawInfo) -> *mut RawInfo;
    fn abtl_info_describe(info: *const RawInfo, out: *mut RawProv);
    fn abtl_open(
        info: *const RawInfo,
        want_fd: c_int,
        cq_size: usize,
        out: *mut *mut RawEp,
    ) -> c_int;
    fn abtl_close(e: *mut RawEp);
    fn abtl_wait_fd(e: *mut RawEp) -> c_int;
    fn abtl_trywait(e: *mut RawEp) -> c_int;
    fn abtl_getname(e: *mut RawEp, buf: *mut c_void, len: *mut usize) -> c_int;
    fn abtl_av_insert(e: *mut RawEp, addr: *const c_void, out: *mut u64) -> c_int;
    fn abtl_mr_reg(
        e: *mut RawEp,
        buf: *mut c_void,
        len: usize,
        access: u64,
        requested_key: u64,
        mr: *mut *mut RawMr,
        key: *mut u64,
        desc: *mut *mut c_void,
    ) -> c_int;
    fn abtl_mr_close(mr: *mut RawMr) -> c_int;
    fn abtl_recv(
        e: *mut RawEp,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        ctx: *mut c_void,
    ) -> c_int;
    fn abtl_send(
        e: *mut RawEp,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        ctx: *mut c_void,
    ) -> c_int;
    fn abtl_sendv(
        e: *mut RawEp,
        hdr: *const c_void,
        hlen: usize,
        body: *const c_void,
        blen: usize,
        dest: u64,
        ctx: *mut c_void,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn abtl_rma(
        e: *mut RawEp,
        write: c_int,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        raddr: u64,
        rkey: u64,
        ctx: *mut c_void,
    ) -> c_int;
    fn abtl_cq_read(e: *mut RawEp, out: *mut Cqe, n: usize) -> c_int;
    fn abtl_cq_readerr(e: *mut RawEp, out: *mut RawCqErr) -> c_int;
    fn abtl_const(which: c_int) -> u64;
}

/// libfabric's constants, read from the headers through the shim.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Consts {
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) write: u64,
    pub(crate) read: u64,
    pub(crate) remote_read: u64,
    pub(crate) remote_write: u64,
    pub(crate) mr_virt_addr: u64,
    pub(crate) mr_prov_key: u64,
    pub(crate) progress_manual: u32,
    pub(crate) eagain: i32,
    pub(crate) eavail: i32,
}

/// The constants (read once).
pub(crate) fn consts() -> &'static Consts {
    static C: std::sync::OnceLock<Consts> = std::sync::OnceLock::new();
    C.get_or_init(|| {
        // SAFETY: `abtl_const` reads compile-time constants; no pointers.
        let k = |i: c_int| unsafe { abtl_const(i) };
        Consts {
            send: k(0),
            recv: k(1),
            write: k(2),
            read: k(3),
            remote_read: k(4),
            remote_write: k(5),
            mr_virt_addr: k(7),
            mr_prov_key: k(8),
            progress_manual: k(9) as u32,
            eagain: k(11) as i32,
            eavail: k(12) as i32,
        }
    })
}

/// libfabric's text for error code `err` (positive or negative).
pub(crate) fn strerror(err: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static, NUL-terminated
    // string for any code.
    unsafe {
        let p = abtl_strerror(err.abs());
        if p.is_null() {
            return format!("error {err}");
        }
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// The library's version as (major, minor).
pub(crate) fn version() -> (u32, u32) {
    // SAFETY: no arguments, returns a number.
    let v = unsafe { abtl_fi_version() };
    (v >> 16, v & 0xffff)
}

/// What one provider offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Provider {
    /// Its name as `BTL_RDMA_PROVIDER` takes it (`tcp;ofi_rxm`).
    pub(crate) name: String,
    /// Its fabric (a network, `127.0.0.0/8`).
    pub(crate) fabric: String,
    /// Its domain (a NIC or an interface: `lo`, `mlx5_0`).
    pub(crate) domain: String,
    /// Memory-registration mode bits it requires.
    pub(crate) mr_mode: u64,
    /// Bytes of its remote keys.
    pub(crate) key_size: u64,
    /// Largest message or RMA.
    pub(crate) max_msg: u64,
    /// Whether data moves only while the process calls into libfabric.
    pub(crate) manual_progress: bool,
    /// Pieces of memory one send may gather.
    pub(crate) iov_limit: u64,
}

fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the shim hands out strings of a live `fi_info` list, each
    // NUL-terminated; we copy before the list is freed.
    unsafe { CStr::from_ptr(p).to_string_lossy().into_owned() }
}

fn describe(info: *const RawInfo) -> Provider {
    let mut raw = RawProv {
        prov_name: std::ptr::null(),
        fabric_name: std::ptr::null(),
        domain_name: std::ptr::null(),
        mr_mode: 0,
        mr_key_size: 0,
        max_msg_size: 0,
        inject_size: 0,
        progress: 0,
        wait_fd: 0,
        iov_limit: 0,
    };
    // SAFETY: `info` is an entry of a live list (callers hold it), and
    // `raw` is a valid place for the shim to write.
    unsafe { abtl_info_describe(info, &mut raw) };
    Provider {
        name: c_str(raw.prov_name),
        fabric: c_str(raw.fabric_name),
        domain: c_str(raw.domain_name),
        mr_mode: raw.mr_mode,
        key_size: raw.mr_key_size,
        max_msg: raw.max_msg_size,
        manual_progress: raw.progress == consts().progress_manual,
        iov_limit: raw.iov_limit,
    }
}

/// A list from `fi_getinfo`, freed on drop.
struct InfoList(NonNull<RawInfo>);

impl Drop for InfoList {
    fn drop(&mut self) {
        // SAFETY: the list came from abtl_getinfo and is freed once, here.
        unsafe { abtl_freeinfo(self.0.as_ptr()) }
    }
}

impl InfoList {
    fn get(prov: Option<&str>, node: Option<&str>) -> Result<InfoList, String> {
        let cs = |s: Option<&str>| {
            s.map(CString::new)
                .transpose()
                .map_err(|_| "a NUL byte in a provider name or address".to_string())
        };
        let (prov_c, node_c) = (cs(prov)?, cs(node)?);
        let mut out: *mut RawInfo = std::ptr::null_mut();
        // SAFETY: the strings are NUL-terminated and outlive the call;
        // `out` is a valid place for the list pointer.
        let ret = unsafe {
            abtl_getinfo(
                prov_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                node_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                &mut out,
            )
        };
        if ret != 0 {
            return Err(strerror(ret));
        }
        NonNull::new(out)
            .map(InfoList)
            .ok_or_else(|| "no provider".to_string())
    }

    /// The entries, in libfabric's order.
    fn entries(&self) -> Vec<*mut RawInfo> {
        let mut v = Vec::new();
        let mut p = self.0.as_ptr();
        while !p.is_null() {
            v.push(p);
            // SAFETY: `p` is an entry of the live list.
            p = unsafe { abtl_info_next(p) };
        }
        v
    }
}

/// `ofi_rxm`'s sizes of its bounce buffers and of the largest message it
/// sends eagerly (one copy into a buffer posted at the receiver; above it,
/// segments or its own rendezvous). Over verbs the two must be equal.
const RXM_SIZES: [&str; 2] = ["FI_OFI_RXM_BUFFER_SIZE", "FI_OFI_RXM_EAGER_LIMIT"];
/// rxm's default of both.
const RXM_DEFAULT: usize = 16384;
/// The depth of rxm's shared receive queue: bounce buffers of
/// `FI_OFI_RXM_BUFFER_SIZE` bytes that every incoming eager frame lands in
/// before rxm matches it to a posted receive.
const RXM_SRX_SIZE: &str = "FI_OFI_RXM_MSG_RX_SIZE";
/// Whether rxm shares one receive queue between its connections (on by
/// default over `tcp`).
const RXM_USE_SRX: &str = "FI_OFI_RXM_USE_SRX";
/// The memory of rxm's default shared receive queue: 4096 buffers of its
/// default 16 KiB.
const RXM_SRX_BYTES: usize = 4096 * RXM_DEFAULT;

/// The shared receive queue depth that keeps rxm's bounce buffers of
/// `frame` bytes within the memory of its defaults ([`RXM_SRX_BYTES`]),
/// if that is below its default depth: with 64 KiB frames, 1023 buffers
/// (64 MiB) rather than 4096 (256 MiB in every process, touched at
/// start). At least 256: deeper than the credit window a sender may fill
/// (`BTL_RDMA_CREDITS`, 128 by default); a queue that runs dry only holds
/// the sockets back until rxm reposts, it loses nothing.
fn srx_depth(frame: usize) -> Option<usize> {
    let depth = (RXM_SRX_BYTES / frame.max(1)).max(256);
    (depth < 4096).then_some(depth)
}

/// Start libfabric with `ofi_rxm` sending frames of up to `frame` bytes
/// eagerly, and return the largest frame it will send so.
///
/// rxm's default, 16 KiB, is exactly a 16 KiB message, which with the
/// transport's header would go in two frames (or by rxm's slow path), so
/// unless the user set them, both of [`RXM_SIZES`] are set to `frame`,
/// and the depth of rxm's shared receive queue to [`srx_depth`] of the
/// buffer size.
/// Providers read their settings when libfabric starts, at the first
/// `fi_getinfo` of the process: this runs once, before it (every list of
/// providers comes through [`providers`]); what it returns reflects the
/// user's own settings, and rxm's default if one does not parse.
pub(crate) fn rxm_eager(frame: usize) -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        for var in RXM_SIZES {
            if std::env::var_os(var).is_none() {
                // Changing the environment races with C code reading it
                // on another thread. This runs once, from the thread that
                // opens the first fabric, before libfabric has started; a
                // program whose other threads read the environment from C
                // while it opens a fabric sets both variables itself.
                std::env::set_var(var, frame.to_string());
            }
        }
        // Bounce buffers of the frame size: as many as keep the shared
        // queue at rxm's default memory (see `srx_depth`), unless the user
        // chose the depth, or per-connection queues (whose depth the same
        // variable sets, per peer).
        let shared =
            std::env::var(RXM_USE_SRX).map_or(true, |v| crate::sys::env::switch(&v) != Some(false));
        let buffer = std::env::var(RXM_SIZES[0])
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(RXM_DEFAULT);
        if let (true, None, Some(depth)) =
            (shared, std::env::var_os(RXM_SRX_SIZE), srx_depth(buffer))
        {
            // As above: once, before libfabric starts.
            std::env::set_var(RXM_SRX_SIZE, depth.to_string());
        }
        RXM_SIZES
            .iter()
            .map(|v| {
                std::env::var(v)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(RXM_DEFAULT)
            })
            .min()
            .unwrap_or(RXM_DEFAULT)
    })
}

/// The providers that offer reliable datagrams with messages and RMA
/// (only `prov` when given), bound to `node` when given; libfabric starts
/// with rxm's eager frames of `frame` bytes ([`rxm_eager`]) if this is
/// the first call.
pub(crate) fn providers(
    prov: Option<&str>,
    node: Option<&str>,
    frame: usize,
) -> Result<Vec<Provider>, String> {
    rxm_eager(frame);
    let list = InfoList::get(prov, node)?;
    Ok(list.entries().into_iter().map(|i| describe(i)).collect())
}

/// Why an operation could not be posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PostError {
    /// The provider is busy (or the peer unreachable): try again later.
    Again,
    /// Another error (a libfabric code, negative).
    Other(i32),
}

fn posted(ret: c_int) -> Result<(), PostError> {
    match ret {
        0 => Ok(()),
        r if r == -consts().eagain => Err(PostError::Again),
        r => Err(PostError::Other(r)),
    }
}

/// An error completion.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CqErr {
    /// The failed operation's context.
    pub(crate) ctx: *mut c_void,
    /// libfabric's error code (positive).
    pub(crate) err: i32,
    /// The provider's own code.
    pub(crate) prov_errno: i32,
}

/// What one read of the completion queue found.
pub(crate) enum Read {
    /// `n` completions (0: none).
    Done(usize),
    /// An error completion (taken off the queue).
    Error(CqErr),
    /// The queue itself failed.
    Failed(i32),
}

/// An open endpoint: fabric, domain, completion queue, address vector.
pub(crate) struct Ep {
    raw: NonNull<RawEp>,
    /// The provider it runs on.
    pub(crate) provider: Provider,
    /// Memory of operations still posted when their owner went away: freed
    /// only after the endpoint is closed (a field, so dropped after
    /// `Drop::drop` closed it), never while the provider may touch it.
    graveyard: std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>>,
}

// SAFETY: the endpoint is opened with FI_THREAD_SAFE: the provider
// serialises concurrent calls on it, so it may be used and dropped from any
// thread. The buffers passed with posted operations are the callers' to keep
// alive (see each method).
unsafe impl Send for Ep {}
// SAFETY: as above: every call through `&Ep` is thread-safe in libfabric.
unsafe impl Sync for Ep {}

impl Drop for Ep {
    fn drop(&mut self) {
        // SAFETY: `raw` came from abtl_open and is closed once, here; no
        // registration outlives it (each `Mr` holds an `Arc` of its `Ep`).
        unsafe { abtl_close(self.raw.as_ptr()) }
    }
}

impl Ep {
    /// Open an endpoint on the first provider named `prov` bound to `node`.
    pub(crate) fn open(prov: &str, node: Option<&str>, cq_size: usize) -> Result<Ep, String> {
        let list = InfoList::get(Some(prov), node)?;
        let first = *list
            .entries()
            .first()
            .ok_or_else(|| format!("provider {prov} not found"))?;
        let provider = describe(first);
        let mut raw: *mut RawEp = std::ptr::null_mut();
        // SAFETY: `first` is an entry of the live list (the shim copies it),
        // `raw` a valid place for the result.
        let ret = unsafe { abtl_open(first, 1, cq_size, &mut raw) };
        if ret != 0 {
            return Err(format!("opening {prov}: {}", strerror(ret)));
        }
        let raw = NonNull::new(raw).ok_or_else(|| format!("opening {prov}: no endpoint"))?;
        Ok(Ep {
            raw,
            provider,
            graveyard: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Keep `what` (buffers of posted operations) until the endpoint is
    /// closed.
    pub(crate) fn bury(&self, what: Box<dyn std::any::Any + Send>) {
        crate::sys::sync::lock(&self.graveyard).push(what);
    }

    fn p(&self) -> *mut RawEp {
        self.raw.as_ptr()
    }

    /// The completion queue's file descriptor (owned by the endpoint).
    pub(crate) fn wait_fd(&self) -> Result<i32, String> {
        // SAFETY: a live endpoint; no pointers.
        let fd = unsafe { abtl_wait_fd(self.p()) };
        if fd < 0 {
            Err(format!(
                "the completion queue has no wait fd: {}",
                strerror(fd)
            ))
        } else {
            Ok(fd)
        }
    }

    /// Whether the wait fd may be slept on now (nothing is pending).
    pub(crate) fn trywait(&self) -> bool {
        // SAFETY: a live endpoint; no pointers.
        unsafe { abtl_trywait(self.p()) == 0 }
    }

    /// Our address, as peers insert it.
    pub(crate) fn name(&self) -> Result<Vec<u8>, String> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: `buf` holds `len` writable bytes; the shim sets `len`.
        let ret = unsafe { abtl_getname(self.p(), buf.as_mut_ptr().cast(), &mut len) };
        if ret != 0 {
            return Err(format!("reading our address: {}", strerror(ret)));
        }
        buf.truncate(len.min(256));
        Ok(buf)
    }

    /// Insert a peer's address; its handle for posts.
    pub(crate) fn insert(&self, addr: &[u8]) -> Result<u64, String> {
        // Providers read as many bytes as their address format has: never
        // hand one a shorter buffer than it may read.
        let mut a = addr.to_vec();
        a.resize(a.len().max(256), 0);
        let mut out = 0u64;
        // SAFETY: `a` is readable for as many bytes as any address format
        // takes (256); `out` a valid place for the handle.
        let ret = unsafe { abtl_av_insert(self.p(), a.as_ptr().cast(), &mut out) };
        if ret != 0 {
            return Err(format!("inserting a peer's address: {}", strerror(ret)));
        }
        Ok(out)
    }

    /// Read up to `out.len()` completions.
    pub(crate) fn read_cq(&self, out: &mut [Cqe; 32]) -> Read {
        // SAFETY: `out` has room for 32 entries, the most the shim writes.
        let ret = unsafe { abtl_cq_read(self.p(), out.as_mut_ptr(), out.len()) };
        if ret >= 0 {
            return Read::Done(ret as usize);
        }
        if ret != -consts().eavail {
            return Read::Failed(ret);
        }
        let mut e = RawCqErr {
            ctx: std::ptr::null_mut(),
            flags: 0,
            err: 0,
            prov_errno: 0,
        };
        // SAFETY: `e` is a valid place for one error entry.
        match unsafe { abtl_cq_readerr(self.p(), &mut e) } {
            1 => Read::Error(CqErr {
                ctx: e.ctx,
                err: e.err,
                prov_errno: e.prov_errno,
            }),
            0 => Read::Done(0),
            r => Read::Failed(r),
        }
    }

    /// Post a receive into `buf..buf+len`.
    ///
    /// # Safety
    /// The memory and `ctx` stay valid, and the memory untouched by us,
    /// until the receive's completion is read (or the endpoint is closed).
    pub(crate) unsafe fn post_recv(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        ctx: *mut c_void,
    ) -> Result<(), PostError> {
        posted(abtl_recv(self.p(), buf.cast(), len, desc, ctx))
    }

    /// Post a send of `buf..buf+len` to `dest`.
    ///
    /// # Safety
    /// As [`post_recv`](Self::post_recv): the bytes and `ctx` stay valid
    /// and unchanged until the completion is read.
    pub(crate) unsafe fn post_send(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        ctx: *mut c_void,
    ) -> Result<(), PostError> {
        posted(abtl_send(self.p(), buf.cast(), len, desc, dest, ctx))
    }

    /// Post a send of `hdr` followed by `body` (gathered, not copied by
    /// us) to `dest`; needs a provider whose `iov_limit` is 2 or more.
    ///
    /// # Safety
    /// As [`post_send`](Self::post_send), for both pieces of memory.
    pub(crate) unsafe fn post_sendv(
        &self,
        hdr: &[u8],
        body: &[u8],
        dest: u64,
        ctx: *mut c_void,
    ) -> Result<(), PostError> {
        posted(abtl_sendv(
            self.p(),
            hdr.as_ptr().cast(),
            hdr.len(),
            body.as_ptr().cast(),
            body.len(),
            dest,
            ctx,
        ))
    }

    /// Post an RDMA write (`write`) or read of `buf..buf+len` to or from
    /// the peer's `raddr` under `rkey`.
    ///
    /// # Safety
    /// As [`post_recv`](Self::post_recv): the local bytes and `ctx` stay
    /// valid until the completion is read (a read writes them).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post_rma(
        &self,
        write: bool,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        raddr: u64,
        rkey: u64,
        ctx: *mut c_void,
    ) -> Result<(), PostError> {
        posted(abtl_rma(
            self.p(),
            c_int::from(write),
            buf.cast(),
            len,
            desc,
            dest,
            raddr,
            rkey,
            ctx,
        ))
    }
}

/// A memory registration, closed on drop (before the memory it covers
/// may be freed: whoever holds an `Mr` drops it first).
pub(crate) struct Mr {
    /// Keeps the endpoint (and its domain) open while the registration
    /// exists.
    _ep: std::sync::Arc<Ep>,
    raw: NonNull<RawMr>,
    /// The key a peer names it by.
    pub(crate) key: u64,
    desc: *mut c_void,
}

// SAFETY: a registration is a provider object of a FI_THREAD_SAFE domain:
// closing it and using its descriptor from any thread is allowed.
unsafe impl Send for Mr {}
// SAFETY: as above; `&Mr` only reads the key and descriptor.
unsafe impl Sync for Mr {}

impl Mr {
    /// Register `len` bytes at `buf` for remote reads and writes (and
    /// local use), asking for `key` where the provider takes requested
    /// keys. `Err(code)` with libfabric's negative code.
    ///
    /// # Safety
    /// `buf..buf+len` stays allocated until the returned `Mr` is dropped.
    pub(crate) unsafe fn register(
        ep: &std::sync::Arc<Ep>,
        buf: *mut u8,
        len: usize,
        key: u64,
    ) -> Result<Mr, i32> {
        let c = consts();
        let access = c.send | c.recv | c.read | c.write | c.remote_read | c.remote_write;
        let mut raw: *mut RawMr = std::ptr::null_mut();
        let (mut out_key, mut desc) = (0u64, std::ptr::null_mut());
        let ret = abtl_mr_reg(
            ep.p(),
            buf.cast(),
            len,
            access,
            key,
            &mut raw,
            &mut out_key,
            &mut desc,
        );
        if ret != 0 {
            return Err(ret);
        }
        let raw = NonNull::new(raw).ok_or(-1)?;
        Ok(Mr {
            _ep: ep.clone(),
            raw,
            key: out_key,
            desc,
        })
    }

    /// The local descriptor for operations on this memory.
    pub(crate) fn desc(&self) -> *mut c_void {
        self.desc
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: `raw` came from abtl_mr_reg on the endpoint `_ep` holds
        // open, and is closed once, here.
        let ret = unsafe { abtl_mr_close(self.raw.as_ptr()) };
        if ret != 0 {
            tracing::warn!("rdma: closing a memory registration: {}", strerror(ret));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::srx_depth;

    #[test]
    fn rxm_shared_queue_keeps_the_memory_of_its_defaults() {
        // rxm's own buffers: its own depth.
        assert_eq!(srx_depth(16384), None);
        assert_eq!(srx_depth(0), None);
        // A 16 KiB message and the header (hardware providers).
        assert_eq!(srx_depth(16416), Some(4088));
        // A 64 KiB message and the header (`tcp`): 64 MiB, not 256.
        assert_eq!(srx_depth(65568), Some(1023));
        assert!(srx_depth(65568).unwrap() * 65568 <= 4096 * 16384);
        // Never shallower than a credit window.
        assert_eq!(srx_depth(1 << 20), Some(256));
    }
}

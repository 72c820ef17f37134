//! The GPU check of `smcuda`'s GPU layer between two real processes
//! (`btl-gpu-check`, `scripts/gpu-check.sh`): what a put and a get of the
//! transport do underneath, done by hand over a Unix socket.
//!
//! The owner (the parent process) allocates device memory and exports
//! it as `smcuda` keys do ([`super::key`]: a VMM descriptor served by its
//! share server, which checks the asker's uid and the job tag, or a legacy
//! handle in the key); the initiator (a child process it starts) opens the
//! key through the mapping cache and copies into the memory (put) and out
//! of it (get), with checksums of every size from 8 bytes to the largest
//! asked for. Then:
//! * ordering: the owner queues a long run of fills and records an
//!   interprocess event after them, and hands its handle over at once;
//!   the initiator's copy waits on the event, so it must read the last
//!   fill's bytes;
//! * free and allocate again: the owner frees its buffer and allocates the
//!   same size; the new buffer has a new buffer id, so the cache must not
//!   hit the old mapping, and a get reads the new contents;
//! * bandwidth: put and get from 1 MiB up (by factors of 4), beside a device-to-device
//!   copy between two of the initiator's own buffers of the same sizes.
//!
//! Both handle kinds (VMM descriptors over `SCM_RIGHTS`, legacy IPC
//! handles) are tried; one the device or sandbox refuses is reported as
//! skipped with the reason.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use socket2::Socket;

use super::cache::Cache;
use super::gpu::{AllocKind, DeviceAlloc, Gpu, GpuError, Mapping, Stream};
use super::key::{self, Exported, Handle};
use crate::sys::fdpass;

/// The variable naming the owner's socket, for the initiator.
const SOCKET_VAR: &str = "BTL_GPU_CHECK_SOCKET";
/// The variable carrying the options, for the initiator.
const OPTIONS_VAR: &str = "BTL_GPU_CHECK_OPTIONS";
/// How long one step may take before the check gives up.
const STEP_LIMIT: Duration = Duration::from_secs(120);

/// What to check.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Options {
    /// The largest transfer (and the size of each buffer).
    pub max_size: u64,
    /// The device both processes use.
    pub device: u32,
    /// Bytes each bandwidth point moves at least.
    pub bandwidth_bytes: u64,
    /// Fills of the whole buffer the owner queues before the event of the
    /// ordering check (long enough that the initiator's copy is queued
    /// well before they end).
    pub order_fills: u32,
    /// The tag the owner serves its memory under (set by [`run`]: random).
    pub job_tag: [u64; 2],
}

impl Default for Options {
    fn default() -> Options {
        Options {
            max_size: 256 << 20,
            device: 0,
            bandwidth_bytes: 4 << 30,
            order_fills: 256,
            job_tag: [0; 2],
        }
    }
}

/// One bandwidth point, in GB/s (10^9 bytes per second).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Bandwidth {
    /// Bytes per copy.
    pub size: u64,
    /// Into the owner's memory.
    pub put: f64,
    /// Out of the owner's memory.
    pub get: f64,
    /// Between two of the initiator's own buffers.
    pub local: f64,
}

/// What one handle kind showed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ModeReport {
    /// "vmm" or "legacy".
    pub mode: String,
    /// Why this kind was not checked, if it was not.
    pub skipped: Option<String>,
    /// Sizes put and got back with matching contents.
    pub sizes: Vec<u64>,
    /// The copy that waited on the owner's event read its last fill.
    pub ordered: bool,
    /// Allocating again at the same address gave a new buffer id.
    pub new_buffer_id: bool,
    /// The new allocation had the old one's address.
    pub same_address: bool,
    /// A get after reallocation read the new contents.
    pub realloc_read_new: bool,
    /// A range inside the owner's buffer, registered as memory the user
    /// allocated (`Fabric::register_device`'s path: the allocation
    /// described, exported whole, the range's offset in the handle), was
    /// reached at its offset by a put and a get.
    pub registered: bool,
    /// Bandwidth from 1 MiB up.
    pub bandwidth: Vec<Bandwidth>,
    /// What the mapping cache did: hits, opens, stale entries dropped,
    /// opens retried after "already mapped".
    pub cache: [u64; 4],
}

/// The check's result.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    /// The GPU implementation ("cuda", "test double").
    pub backend: String,
    /// A GPU was found.
    pub available: bool,
    /// Why not, if not.
    pub reason: Option<String>,
    /// Per handle kind.
    pub modes: Vec<ModeReport>,
    /// Every check that failed, in words (empty: all passed).
    pub failures: Vec<String>,
    /// Seconds the check took.
    pub seconds: f64,
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u32).wrapping_mul(7).wrapping_add((i >> 9) as u32) as u8 ^ seed)
        .collect()
}

/// Sizes from 8 bytes up to `max`, by factors of 8, and `max` itself.
fn sizes(max: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut n = 8u64;
    while n < max {
        v.push(n);
        n *= 8;
    }
    v.push(max);
    v
}

fn io(what: &str, e: std::io::Error) -> String {
    format!("{what}: {e}")
}

fn send(s: &Socket, b: &[u8], fd: Option<std::os::fd::BorrowedFd<'_>>) -> Result<(), String> {
    fdpass::send(s, b, fd).map_err(|e| io("sending to the other process", e))
}

fn recv(s: &Socket) -> Result<(Vec<u8>, Option<std::os::fd::OwnedFd>), String> {
    let mut buf = vec![0u8; 1 << 16];
    let r = fdpass::recv(s, &mut buf).map_err(|e| io("receiving from the other process", e))?;
    if r.len == 0 {
        return Err("the other process closed the connection".into());
    }
    buf.truncate(r.len);
    Ok((buf, r.fds.into_iter().next()))
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, String> {
    b.get(at..at + 8)
        .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
        .ok_or_else(|| "a short message from the other process".to_string())
}

/// Poll `e` until it fired (or the step limit passed).
fn wait(gpu: &dyn Gpu, e: super::gpu::Event) -> Result<(), String> {
    let start = Instant::now();
    loop {
        if gpu.query(e).map_err(|e| e.to_string())? {
            return Ok(());
        }
        if start.elapsed() > STEP_LIMIT {
            return Err("a GPU event never fired".into());
        }
        std::thread::yield_now();
    }
}

/// The owner's side: start the initiator (`child`, with the variables
/// this sets), serve it, and return both sides' findings.
pub fn run(opts: &Options, mut child: Command) -> Report {
    let start = Instant::now();
    let mut report = Report::default();
    let gpu = match super::open_gpu() {
        Ok(g) => g,
        Err(e) => {
            report.reason = Some(e.to_string());
            return report;
        }
    };
    report.backend = gpu.backend().to_string();
    report.available = true;
    if let Err(e) = serve(&gpu, opts, &mut child, &mut report) {
        report.failures.push(e);
    }
    report.seconds = start.elapsed().as_secs_f64();
    report
}

fn serve(
    gpu: &Arc<dyn Gpu>,
    opts: &Options,
    child: &mut Command,
    report: &mut Report,
) -> Result<(), String> {
    let name = crate::sys::os::hex(&crate::sys::os::random_bytes::<16>());
    let opts = &Options {
        job_tag: [rand::random(), rand::random()],
        ..opts.clone()
    };
    let listener = fdpass::listen(name.as_bytes()).map_err(|e| io("listening", e))?;
    let opts_json = postcard::to_allocvec(opts).map_err(|e| e.to_string())?;
    let mut proc = child
        .env(SOCKET_VAR, &name)
        .env(OPTIONS_VAR, crate::sys::os::hex(&opts_json))
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| io("starting the initiator", e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| io("listening", e))?;
    let began = Instant::now();
    let conn = loop {
        match listener.accept() {
            Ok((c, _)) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if began.elapsed() > STEP_LIMIT || proc.try_wait().ok().flatten().is_some() {
                    let _ = proc.kill();
                    return Err("the initiator never connected".into());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(io("accepting", e)),
        }
    };
    conn.set_nonblocking(false)
        .map_err(|e| io("accepting", e))?;
    fdpass::set_timeouts(&conn, STEP_LIMIT).map_err(|e| io("socket timeouts", e))?;
    let (pid, uid) = fdpass::peer_cred(&conn).map_err(|e| io("peer credentials", e))?;
    if pid != proc.id() || uid != crate::sys::os::uid() {
        let _ = proc.kill();
        return Err(format!("a stranger connected (pid {pid}, uid {uid})"));
    }
    let result = owner_loop(gpu, opts, &conn, report);
    let status = proc
        .wait()
        .map_err(|e| io("waiting for the initiator", e))?;
    result?;
    if !status.success() {
        return Err(format!("the initiator exited with {status}"));
    }
    Ok(())
}

/// The owner's buffer, and the stream its fills run on.
struct Owned {
    alloc: DeviceAlloc,
    _exported: Exported,
}

/// Where the initiator reaches a range registered in the owner's buffer
/// (request `A`).
const REGISTERED_AT: u64 = 4096 + 64;
/// Bytes of that range.
const REGISTERED_LEN: u64 = 65_536;

fn owner_loop(
    gpu: &Arc<dyn Gpu>,
    opts: &Options,
    conn: &Socket,
    report: &mut Report,
) -> Result<(), String> {
    let stream = gpu.stream(opts.device).map_err(|e| e.to_string())?;
    let mut owned: Option<Owned> = None;
    // A range of `owned` registered as the user's memory (request `A`):
    // let go of before `owned` is freed.
    let mut adopted: Option<(DeviceAlloc, Exported)> = None;
    let err = |s: &Socket, e: String| send(s, format!("E{e}").as_bytes(), None);
    loop {
        let (msg, _) = recv(conn)?;
        if matches!(msg[0], b'M' | b'R' | b'Q') {
            if let Some((a, _exported)) = adopted.take() {
                let _ = gpu.release(a);
            }
        }
        match msg[0] {
            b'A' => {
                let Some(o) = &owned else {
                    err(conn, "no buffer".into())?;
                    continue;
                };
                if let Some((a, _exported)) = adopted.take() {
                    let _ = gpu.release(a);
                }
                let ptr = o.alloc.ptr + REGISTERED_AT;
                let made = gpu
                    .adopt(ptr, REGISTERED_LEN)
                    .map_err(|e| e.to_string())
                    .and_then(|a| {
                        let id = crate::sys::os::random_bytes::<16>();
                        match key::export(&**gpu, &a, id, opts.job_tag) {
                            Ok(x) => Ok((a, x)),
                            Err(e) => {
                                let _ = gpu.release(a);
                                Err(e.to_string())
                            }
                        }
                    });
                match made {
                    Ok((a, mut exported)) => {
                        exported.handle.offset = ptr - a.ptr;
                        let mut b = vec![b'M', 0];
                        b.extend(exported.handle.encode());
                        send(conn, &b, None)?;
                        adopted = Some((a, exported));
                    }
                    Err(e) => err(conn, e)?,
                }
            }
            b'M' | b'R' => {
                let kind = if msg.get(1) == Some(&1) {
                    AllocKind::Legacy
                } else {
                    AllocKind::Vmm
                };
                let old = owned.take().map(|o| {
                    let p = o.alloc.ptr;
                    let _ = gpu.free(o.alloc);
                    p
                });
                match gpu.alloc(opts.device, opts.max_size, kind) {
                    Ok(a) => {
                        if msg[0] == b'R' {
                            let _ = gpu.upload(a.ptr, &pattern(0x5a, a.len as usize));
                        }
                        let id = crate::sys::os::random_bytes::<16>();
                        match key::export(&**gpu, &a, id, opts.job_tag) {
                            Ok(exported) => {
                                let mut b = vec![b'M', (old == Some(a.ptr)) as u8];
                                b.extend(exported.handle.encode());
                                send(conn, &b, None)?;
                                owned = Some(Owned {
                                    alloc: a,
                                    _exported: exported,
                                });
                            }
                            Err(e) => {
                                let _ = gpu.free(a);
                                err(conn, e.to_string())?
                            }
                        }
                    }
                    Err(e) => err(conn, e.to_string())?,
                }
            }
            b'C' | b'F' => {
                let (n, seed) = (u64_at(&msg, 1)? as usize, *msg.get(9).unwrap_or(&0));
                // Where in the buffer, if not at its start.
                let at = if msg.len() >= 18 {
                    u64_at(&msg, 10)?
                } else {
                    0
                };
                let Some(o) = &owned else {
                    err(conn, "no buffer".into())?;
                    continue;
                };
                if !matches!(at.checked_add(n as u64), Some(end) if end <= o.alloc.len) {
                    err(conn, format!("{n} bytes at {at} are outside the buffer"))?;
                    continue;
                }
                let want = pattern(seed, n);
                let r = if msg[0] == b'F' {
                    gpu.upload(o.alloc.ptr + at, &want)
                        .map_err(|e| e.to_string())
                } else {
                    let mut got = vec![0u8; n];
                    gpu.download(&mut got, o.alloc.ptr + at)
                        .map_err(|e| e.to_string())
                        .and_then(|_| match got.iter().zip(&want).position(|(a, b)| a != b) {
                            None => Ok(()),
                            Some(i) => Err(format!("a put of {n} bytes: byte {i} differs")),
                        })
                };
                match r {
                    Ok(()) => send(conn, b"K", None)?,
                    Err(e) => err(conn, e)?,
                }
            }
            b'O' => {
                let Some(o) = &owned else {
                    err(conn, "no buffer".into())?;
                    continue;
                };
                let r = (|| -> Result<[u8; 64], GpuError> {
                    for i in 0..opts.order_fills {
                        gpu.fill(stream, o.alloc.ptr, 0x10 + (i % 64) as u8, o.alloc.len)?;
                    }
                    gpu.fill(stream, o.alloc.ptr, 0xaa, o.alloc.len)?;
                    let e = gpu.event(opts.device, true)?;
                    gpu.record(e, stream)?;
                    gpu.export_event(e)
                })();
                match r {
                    Ok(h) => {
                        let mut b = vec![b'V'];
                        b.extend_from_slice(&h);
                        send(conn, &b, None)?;
                    }
                    Err(e) => err(conn, e.to_string())?,
                }
            }
            b'Q' => {
                if let Some(o) = owned.take() {
                    let _ = gpu.free(o.alloc);
                }
                let back: Report = postcard::from_bytes(&msg[1..])
                    .map_err(|e| format!("the initiator's report: {e}"))?;
                report.modes = back.modes;
                report.failures.extend(back.failures);
                return Ok(());
            }
            other => return Err(format!("unknown request {other}")),
        }
    }
}

/// The initiator's side (the child process `run` starts): returns the
/// process's exit status.
pub fn child() -> i32 {
    let Ok(name) = std::env::var(SOCKET_VAR) else {
        eprintln!("{SOCKET_VAR} is not set: the initiator is started by the owner");
        return 2;
    };
    let opts: Options = match std::env::var(OPTIONS_VAR)
        .ok()
        .and_then(|h| unhex(&h))
        .and_then(|b| postcard::from_bytes(&b).ok())
    {
        Some(o) => o,
        None => {
            eprintln!("{OPTIONS_VAR} is missing or unreadable");
            return 2;
        }
    };
    let conn = match fdpass::connect(name.as_bytes(), STEP_LIMIT) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("connecting to the owner: {e}");
            return 2;
        }
    };
    let mut report = Report::default();
    match super::open_gpu() {
        Ok(gpu) => {
            for kind in [AllocKind::Vmm, AllocKind::Legacy] {
                let mut m = ModeReport {
                    mode: match kind {
                        AllocKind::Vmm => "vmm",
                        AllocKind::Legacy => "legacy",
                    }
                    .into(),
                    ..ModeReport::default()
                };
                if let Err(e) = initiate(&gpu, &opts, &conn, kind, &mut m) {
                    if m.sizes.is_empty() {
                        m.skipped = Some(e);
                    } else {
                        report.failures.push(format!("{}: {e}", m.mode));
                    }
                }
                report.modes.push(m);
            }
        }
        Err(e) => report
            .failures
            .push(format!("the initiator has no GPU: {e}")),
    }
    let mut b = vec![b'Q'];
    b.extend(postcard::to_allocvec(&report).unwrap_or_default());
    match send(&conn, &b, None) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

/// Ask the owner for a buffer (`req`: `M`, or `R` to free and allocate
/// again); its mapping through the cache, and whether it has the old
/// address.
fn fetch(
    gpu: &Arc<dyn Gpu>,
    opts: &Options,
    conn: &Socket,
    cache: &mut Cache<Mapping>,
    req: u8,
    kind: AllocKind,
) -> Result<(Arc<Mapping>, u64, bool, u64), String> {
    send(conn, &[req, (kind == AllocKind::Legacy) as u8], None)?;
    let (msg, _) = recv(conn)?;
    if msg[0] == b'E' {
        return Err(String::from_utf8_lossy(&msg[1..]).into_owned());
    }
    let same = msg.get(1) == Some(&1);
    let h = Handle::decode(msg.get(2..).unwrap_or_default())
        .map_err(|e| format!("the owner's key: {e}"))?;
    let map = key::open(gpu, cache, 0, &h, opts.job_tag, opts.device)
        .map_err(|e| format!("importing the owner's memory: {e}"))?;
    Ok((map, h.len, same, h.buffer_id))
}

fn ask(conn: &Socket, req: u8, n: u64, seed: u8) -> Result<(), String> {
    ask_at(conn, req, n, seed, 0)
}

/// [`ask`] about `n` bytes `at` bytes into the owner's buffer.
fn ask_at(conn: &Socket, req: u8, n: u64, seed: u8, at: u64) -> Result<(), String> {
    let mut b = vec![req];
    b.extend_from_slice(&n.to_le_bytes());
    b.push(seed);
    b.extend_from_slice(&at.to_le_bytes());
    send(conn, &b, None)?;
    let (msg, _) = recv(conn)?;
    match msg[0] {
        b'K' => Ok(()),
        _ => Err(String::from_utf8_lossy(&msg[1..]).into_owned()),
    }
}

/// Time `reps` copies of `n` bytes from `src` to `dst` on `s`: GB/s.
fn time_copies(
    gpu: &dyn Gpu,
    (device, s): (u32, Stream),
    dst: u64,
    src: u64,
    n: u64,
    reps: u64,
) -> Result<f64, String> {
    let e = gpu.event(device, false).map_err(|e| e.to_string())?;
    let t = Instant::now();
    for _ in 0..reps {
        gpu.copy(s, dst, src, n).map_err(|e| e.to_string())?;
    }
    gpu.record(e, s).map_err(|e| e.to_string())?;
    wait(gpu, e)?;
    let secs = t.elapsed().as_secs_f64();
    gpu.destroy_event(e);
    Ok((n * reps) as f64 / secs / 1e9)
}

fn initiate(
    gpu: &Arc<dyn Gpu>,
    opts: &Options,
    conn: &Socket,
    kind: AllocKind,
    m: &mut ModeReport,
) -> Result<(), String> {
    let mut cache: Cache<Mapping> = Cache::new(16);
    let (remote, len, _, old_id) = fetch(gpu, opts, conn, &mut cache, b'M', kind)?;
    let local_kind = if gpu.devices().iter().all(|d| d.vmm) {
        AllocKind::Vmm
    } else {
        AllocKind::Legacy
    };
    let ge = |e: GpuError| e.to_string();
    let local = gpu.alloc(opts.device, len, local_kind).map_err(ge)?;
    let other = gpu.alloc(opts.device, len, local_kind).map_err(ge)?;
    let s = gpu.stream(opts.device).map_err(ge)?;
    let done = gpu.event(opts.device, false).map_err(ge)?;
    let r = remote.ptr();
    for (i, n) in sizes(len.min(opts.max_size)).into_iter().enumerate() {
        let seed = i as u8 * 2 + 1;
        gpu.upload(local.ptr, &pattern(seed, n as usize))
            .map_err(ge)?;
        gpu.copy(s, r, local.ptr, n).map_err(ge)?;
        gpu.record(done, s).map_err(ge)?;
        wait(&**gpu, done)?;
        ask(conn, b'C', n, seed)?;
        ask(conn, b'F', n, seed + 1)?;
        gpu.copy(s, local.ptr, r, n).map_err(ge)?;
        gpu.record(done, s).map_err(ge)?;
        wait(&**gpu, done)?;
        let mut got = vec![0u8; n as usize];
        gpu.download(&mut got, local.ptr).map_err(ge)?;
        if got != pattern(seed + 1, n as usize) {
            return Err(format!("a get of {n} bytes read wrong bytes"));
        }
        m.sizes.push(n);
    }

    // A range of the owner's buffer registered as the user's own memory:
    // the handle names the whole allocation and the range's offset in it.
    if len >= REGISTERED_AT + REGISTERED_LEN {
        send(conn, b"A", None)?;
        let (msg, _) = recv(conn)?;
        if msg[0] == b'E' {
            return Err(format!(
                "registering a range of the owner's buffer: {}",
                String::from_utf8_lossy(&msg[1..])
            ));
        }
        let h = Handle::decode(msg.get(2..).unwrap_or_default())
            .map_err(|e| format!("the registered range's key: {e}"))?;
        if h.offset != REGISTERED_AT || h.len != len {
            return Err(format!(
                "the registered range's key names {} bytes at offset {}, not the {len}-byte buffer at {REGISTERED_AT}",
                h.len, h.offset
            ));
        }
        let part = key::open(gpu, &mut cache, 0, &h, opts.job_tag, opts.device)
            .map_err(|e| format!("importing the registered range: {e}"))?;
        let n = REGISTERED_LEN;
        gpu.upload(local.ptr, &pattern(0x33, n as usize))
            .map_err(ge)?;
        gpu.copy(s, part.ptr() + h.offset, local.ptr, n)
            .map_err(ge)?;
        gpu.record(done, s).map_err(ge)?;
        wait(&**gpu, done)?;
        ask_at(conn, b'C', n, 0x33, REGISTERED_AT)
            .map_err(|e| format!("a put into the registered range: {e}"))?;
        ask_at(conn, b'F', n, 0x34, REGISTERED_AT)?;
        gpu.copy(s, local.ptr, part.ptr() + h.offset, n)
            .map_err(ge)?;
        gpu.record(done, s).map_err(ge)?;
        wait(&**gpu, done)?;
        let mut got = vec![0u8; n as usize];
        gpu.download(&mut got, local.ptr).map_err(ge)?;
        if got != pattern(0x34, n as usize) {
            return Err("a get from the registered range read wrong bytes".into());
        }
        m.registered = true;
    }

    // Ordering: the copy waits on the owner's event behind its fills.
    send(conn, b"O", None)?;
    let (msg, _) = recv(conn)?;
    if msg[0] != b'V' || msg.len() != 65 {
        return Err(format!("ordering: {}", String::from_utf8_lossy(&msg[1..])));
    }
    let theirs = gpu
        .open_event(&msg[1..65].try_into().expect("64 bytes"))
        .map_err(|e| format!("opening the owner's event: {e}"))?;
    gpu.wait_event(s, theirs).map_err(ge)?;
    gpu.copy(s, local.ptr, r, len).map_err(ge)?;
    gpu.record(done, s).map_err(ge)?;
    wait(&**gpu, done)?;
    gpu.destroy_event(theirs);
    let mut got = vec![0u8; len as usize];
    gpu.download(&mut got, local.ptr).map_err(ge)?;
    m.ordered = got.iter().all(|&b| b == 0xaa);
    if !m.ordered {
        return Err("a copy that waited on the owner's event read bytes of an earlier fill".into());
    }

    // Bandwidth from 1 MiB up, beside a local device-to-device copy.
    let points = std::iter::successors(Some(1u64 << 20), |n| Some(n * 4)).take_while(|&n| n <= len);
    for n in points {
        let reps = (opts.bandwidth_bytes / n).clamp(2, 1000);
        m.bandwidth.push(Bandwidth {
            size: n,
            put: time_copies(&**gpu, (opts.device, s), r, local.ptr, n, reps)?,
            get: time_copies(&**gpu, (opts.device, s), local.ptr, r, n, reps)?,
            local: time_copies(&**gpu, (opts.device, s), other.ptr, local.ptr, n, reps)?,
        });
    }

    // Free and allocate again. A legacy mapping must be closed before its
    // owner frees the memory; a VMM one keeps the old memory alive.
    drop(remote);
    if kind == AllocKind::Legacy {
        cache.forget(0);
    }
    let (remote, _, same, new_id) = fetch(gpu, opts, conn, &mut cache, b'R', kind)?;
    m.same_address = same;
    m.new_buffer_id = new_id != old_id;
    gpu.copy(s, local.ptr, remote.ptr(), len).map_err(ge)?;
    gpu.record(done, s).map_err(ge)?;
    wait(&**gpu, done)?;
    gpu.download(&mut got, local.ptr).map_err(ge)?;
    m.realloc_read_new = got == pattern(0x5a, len as usize);
    let c = cache.counts();
    m.cache = [c.hits, c.opens, c.stale, c.remapped];
    drop(remote);
    drop(cache);
    gpu.destroy_event(done);
    let _ = gpu.free(local);
    let _ = gpu.free(other);
    if !m.new_buffer_id {
        return Err("a buffer allocated again kept its buffer id".into());
    }
    if !m.realloc_read_new {
        return Err("a get after reallocation read the old buffer's bytes".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_run_by_eights_to_the_largest() {
        assert_eq!(sizes(8), vec![8]);
        assert_eq!(sizes(100), vec![8, 64, 100]);
        assert_eq!(sizes(4096), vec![8, 64, 512, 4096]);
        assert_eq!(unhex("00ff10"), Some(vec![0, 255, 16]));
        assert_ne!(pattern(1, 600), pattern(2, 600));
    }
}

//! A test double of a GPU, for machines without one: it implements
//! [`Gpu`] so that `smcuda` runs between real processes with no driver.
//! It is selected only by `BTL_SMCUDA_GPU=test-double` and is never
//! chosen on its own.
//!
//! Its "device memory" is host memory in sealed memory files, so exported
//! handles cross real processes the way CUDA's do: a VMM allocation
//! travels as its file descriptor, a legacy handle names the owner's pid,
//! descriptor number and inode, and is opened through `/proc/<pid>/fd`
//! (so, like CUDA's legacy IPC, it fails across PID namespaces). A second
//! open of a legacy handle this process already has mapped fails with
//! [`GpuError::AlreadyMapped`], as the driver's does. Each stream is a
//! worker thread, so copies complete later than the call that queued
//! them, in stream order. Events are pairs of counters (recorded, done)
//! in a shared page, so a peer can open one and wait on it.
//!
//! Faults are injected through `BTL_SMCUDA_DOUBLE_FAULTS`, a comma list:
//! `no-vmm` (devices without VMM; VMM allocations refused), `no-legacy`
//! (legacy export refused, as for pool memory), `mig` (devices are MIG
//! instances), `export` (every export refused), `import` (every import
//! refused), `already-mapped:N` (the next N imports fail with
//! `AlreadyMapped`), `copy-delay-ms:N` (every copy and fill waits N ms
//! on its stream first), `event` (queries fail), `skip-wait` (a stream
//! does not wait on the events it is told to: the broken ordering a GPU
//! check must catch), `unshareable` (allocations are reported as
//! shareable neither by descriptor nor by legacy IPC, as pool memory is,
//! so registering them is refused; the fabric's own allocations still
//! export), `devices:N` (N devices, default 1), `not-ready:N` (the GPU
//! layer says it is not ready the first N times it is asked, so a peer's
//! IPC handshake is answered `NotReady` that often), `pinned-only`
//! (a copy between device memory and host memory a peer may reach, a
//! fragment of `sm`, fails unless that host memory was pinned: the
//! check that the staged path goes through pinned memory).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::gpu::{
    AllocKind, Bell, DeviceAlloc, DeviceInfo, Event, Gpu, GpuError, Imported, MemHandle, PtrInfo,
    Stream, UNSHAREABLE,
};
use crate::sys::mem::RawBuf;
use crate::sys::shm::SharedMem;
use crate::sys::sync::lock;

/// What `BTL_SMCUDA_DOUBLE_FAULTS` asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Faults {
    pub(crate) no_vmm: bool,
    pub(crate) no_legacy: bool,
    pub(crate) mig: bool,
    pub(crate) export: bool,
    pub(crate) import: bool,
    pub(crate) already_mapped: u32,
    pub(crate) copy_delay: Duration,
    pub(crate) event: bool,
    pub(crate) skip_wait: bool,
    pub(crate) unshareable: bool,
    pub(crate) devices: u32,
    pub(crate) not_ready: u32,
    pub(crate) pinned_only: bool,
}

impl Faults {
    /// Parse the comma list (see the module's documentation).
    pub(crate) fn parse(s: &str) -> Result<Faults, String> {
        let mut f = Faults {
            devices: 1,
            ..Faults::default()
        };
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, arg) = match item.split_once(':') {
                Some((n, a)) => (n, Some(a)),
                None => (item, None),
            };
            let num = || -> Result<u64, String> {
                arg.and_then(|a| a.parse().ok())
                    .ok_or_else(|| format!("`{item}`: expected {name}:NUMBER"))
            };
            match name {
                "no-vmm" => f.no_vmm = true,
                "no-legacy" => f.no_legacy = true,
                "mig" => f.mig = true,
                "export" => f.export = true,
                "import" => f.import = true,
                "event" => f.event = true,
                "skip-wait" => f.skip_wait = true,
                "unshareable" => f.unshareable = true,
                "pinned-only" => f.pinned_only = true,
                "already-mapped" => f.already_mapped = num()?.min(u32::MAX as u64) as u32,
                "copy-delay-ms" => f.copy_delay = Duration::from_millis(num()?),
                "devices" => f.devices = num()?.clamp(1, 16) as u32,
                "not-ready" => f.not_ready = num()?.min(u32::MAX as u64) as u32,
                _ => return Err(format!("unknown test-double fault `{item}`")),
            }
        }
        Ok(f)
    }
}

/// The legacy handle's first bytes.
const LEGACY_MAGIC: &[u8; 8] = b"abtlDmem";
/// An exported event's first bytes.
const EVENT_MAGIC: &[u8; 8] = b"abtlDevt";
/// Events one process may have (slots of its event page).
const EVENT_SLOTS: usize = 4096;

/// One allocation's memory, shared by the tables and by queued work on it
/// (which keeps it mapped until done, whatever was freed meanwhile).
struct Mem {
    map: SharedMem,
    /// The descriptor (kept for exports).
    fd: OwnedFd,
    device: u32,
    kind: AllocKind,
    buffer_id: u64,
}

impl Mem {
    fn base(&self) -> u64 {
        self.map.raw().addr() as u64
    }
    fn len(&self) -> u64 {
        self.map.len() as u64
    }
    fn holds(&self, ptr: u64, len: u64) -> bool {
        ptr >= self.base()
            && ptr
                .checked_add(len)
                .is_some_and(|e| e <= self.base() + self.len())
    }
}

/// An event page: (recorded, done) counter pairs, ours or a peer's.
struct Page {
    map: SharedMem,
}

impl Page {
    fn words(&self, slot: usize) -> &[crate::sys::sync::AtomicU64] {
        self.map
            .raw_ref()
            .atomics_u64(slot * 16, 2)
            .expect("event slot inside the page")
    }
}

/// An event: a slot of a page.
#[derive(Clone)]
struct Ev {
    page: Arc<Page>,
    slot: usize,
}

/// Work queued on a stream.
enum Op {
    Copy {
        dst: (Arc<Mem>, u64),
        src: (Arc<Mem>, u64),
        len: u64,
    },
    Fill {
        dst: (Arc<Mem>, u64),
        byte: u8,
        len: u64,
    },
    Record {
        ev: Ev,
        generation: u64,
    },
    Wait {
        ev: Ev,
        generation: u64,
    },
    Notify(Bell),
}

/// A stream: a worker thread taking its queue in order.
struct Worker {
    queue: Mutex<(VecDeque<Op>, bool)>,
    more: Condvar,
    delay: Duration,
}

impl Worker {
    fn run(&self) {
        loop {
            let op = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(op) = q.0.pop_front() {
                        break op;
                    }
                    if q.1 {
                        return;
                    }
                    q = self.more.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            self.execute(op);
        }
    }

    fn execute(&self, op: Op) {
        match op {
            Op::Copy { dst, src, len } => {
                std::thread::sleep(self.delay);
                // Both ranges were checked against their allocations when
                // the copy was queued; a failure here cannot happen, and a
                // double has nowhere to report it but the log.
                let (d, s) = (&dst.0.map, &src.0.map);
                if let Err(e) = d.raw().copy_from(dst.1, &s.raw(), src.1, len as usize) {
                    tracing::error!("test double: copy failed: {e}");
                }
            }
            Op::Fill { dst, byte, len } => {
                std::thread::sleep(self.delay);
                let fill = vec![byte; len as usize];
                if let Err(e) = dst.0.map.raw().write(dst.1, &fill) {
                    tracing::error!("test double: fill failed: {e}");
                }
            }
            Op::Record { ev, generation } => {
                ev.page.words(ev.slot)[1].fetch_max(generation, Ordering::AcqRel);
            }
            Op::Wait { ev, generation } => {
                while ev.page.words(ev.slot)[1].load(Ordering::Acquire) < generation {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            Op::Notify(bell) => bell(),
        }
    }

    fn push(&self, op: Op) {
        lock(&self.queue).0.push_back(op);
        self.more.notify_one();
    }
}

/// A legacy handle's owner: (pid, inode of its memory file).
type LegacyKey = (u32, u64);

struct State {
    allocs: HashMap<u64, Arc<Mem>>,
    /// Mappings of peers' memory, with the legacy handle each came from.
    imports: HashMap<u64, (Arc<Mem>, Option<LegacyKey>)>,
    /// Legacy handles mapped here, by (owner pid, inode).
    legacy_open: HashSet<LegacyKey>,
    streams: Vec<(Arc<Worker>, Option<JoinHandle<()>>)>,
    events: HashMap<u64, Ev>,
    /// Slots of our page in use.
    slots: Vec<bool>,
    /// Peers' event pages, by (pid, inode).
    pages: HashMap<(u32, u64), Arc<Page>>,
    already_mapped: u32,
    next: u64,
    /// Host ranges pinned (`pin`), as start and length.
    pinned: Vec<(usize, usize)>,
}

/// The test double of a GPU (see the module's documentation).
pub(crate) struct GpuDouble {
    faults: Faults,
    page: Arc<Page>,
    page_fd: OwnedFd,
    state: Mutex<State>,
    buffer_ids: AtomicU64,
    /// Times `ready` was asked (for `not-ready:N`).
    asked_ready: AtomicU64,
}

impl std::fmt::Debug for GpuDouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDouble")
            .field("faults", &self.faults)
            .finish()
    }
}

fn failed(what: &str, e: impl std::fmt::Display) -> GpuError {
    GpuError::Failed(format!("test double: {what}: {e}"))
}

/// The inode of an open file.
fn inode(fd: &impl AsFd) -> Result<u64, GpuError> {
    let f = File::from(
        fd.as_fd()
            .try_clone_to_owned()
            .map_err(|e| failed("dup", e))?,
    );
    Ok(f.metadata().map_err(|e| failed("fstat", e))?.ino())
}

/// Open a peer's descriptor through `/proc/<pid>/fd/<fd>`, checking its
/// inode.
fn open_peer_fd(pid: u32, fd: u32, ino: u64) -> Result<OwnedFd, GpuError> {
    let f = File::options()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/fd/{fd}"))
        .map_err(|e| GpuError::Refused(format!("opening pid {pid}'s descriptor {fd}: {e}")))?;
    let owned = OwnedFd::from(f);
    if inode(&owned)? != ino {
        return Err(GpuError::Refused(format!(
            "pid {pid}'s descriptor {fd} is no longer the exported memory"
        )));
    }
    Ok(owned)
}

impl GpuDouble {
    /// A double with these faults.
    pub(crate) fn new(faults: Faults) -> Result<GpuDouble, GpuError> {
        let mut map = SharedMem::create(c"smcuda-double-events", EVENT_SLOTS * 16)
            .map_err(|e| failed("event page", e))?;
        let page_fd = map
            .take_fd()
            .ok_or_else(|| failed("event page", "no descriptor"))?;
        Ok(GpuDouble {
            state: Mutex::new(State {
                allocs: HashMap::new(),
                imports: HashMap::new(),
                legacy_open: HashSet::new(),
                streams: Vec::new(),
                events: HashMap::new(),
                slots: vec![false; EVENT_SLOTS],
                pages: HashMap::new(),
                already_mapped: faults.already_mapped,
                next: 1,
                pinned: Vec::new(),
            }),
            faults,
            page: Arc::new(Page { map }),
            page_fd,
            buffer_ids: AtomicU64::new(1),
            asked_ready: AtomicU64::new(0),
        })
    }

    /// A double with the faults `BTL_SMCUDA_DOUBLE_FAULTS` names.
    pub(crate) fn from_env() -> Result<GpuDouble, GpuError> {
        let spec = std::env::var("BTL_SMCUDA_DOUBLE_FAULTS").unwrap_or_default();
        GpuDouble::new(Faults::parse(&spec).map_err(GpuError::Failed)?)
    }

    fn device(&self, device: u32) -> Result<(), GpuError> {
        if device < self.faults.devices {
            Ok(())
        } else {
            Err(GpuError::BadPointer(format!("no device {device}")))
        }
    }

    /// The allocation or mapping holding `ptr..ptr+len`, and the offset.
    fn find(st: &State, ptr: u64, len: u64) -> Result<(Arc<Mem>, u64), GpuError> {
        st.allocs
            .values()
            .chain(st.imports.values().map(|(m, _)| m))
            .find(|m| m.holds(ptr, len))
            .map(|m| (m.clone(), ptr - m.base()))
            .ok_or_else(|| {
                GpuError::BadPointer(format!("{len} bytes at {ptr:#x} are not device memory"))
            })
    }

    fn worker(st: &State, s: Stream) -> Result<Arc<Worker>, GpuError> {
        st.streams
            .get(s.0 as usize)
            .map(|(w, _)| w.clone())
            .ok_or_else(|| GpuError::BadPointer(format!("no stream {}", s.0)))
    }

    fn ev(st: &State, e: Event) -> Result<Ev, GpuError> {
        st.events
            .get(&e.0)
            .cloned()
            .ok_or_else(|| GpuError::BadPointer(format!("no event {}", e.0)))
    }
}

impl Drop for GpuDouble {
    fn drop(&mut self) {
        let streams = std::mem::take(&mut lock(&self.state).streams);
        for (w, _) in &streams {
            lock(&w.queue).1 = true;
            w.more.notify_one();
        }
        for (_, h) in streams {
            if let Some(h) = h {
                let _ = h.join();
            }
        }
    }
}

impl Gpu for GpuDouble {
    fn backend(&self) -> &'static str {
        "test double"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        (0..self.faults.devices)
            .map(|ordinal| {
                let mut uuid = *b"abtl-test-double";
                uuid[15] = ordinal as u8;
                DeviceInfo {
                    ordinal,
                    uuid,
                    mig: self.faults.mig,
                    vmm: !self.faults.no_vmm,
                }
            })
            .collect()
    }

    fn ready(&self) -> bool {
        self.asked_ready.fetch_add(1, Ordering::Relaxed) >= u64::from(self.faults.not_ready)
    }

    fn can_access_peer(&self, from: u32, to: u32) -> bool {
        from < self.faults.devices && to < self.faults.devices
    }

    fn classify(&self, ptr: u64) -> Result<PtrInfo, GpuError> {
        let st = lock(&self.state);
        Ok(match GpuDouble::find(&st, ptr, 1) {
            Ok((m, _)) => PtrInfo::Device {
                device: m.device,
                base: m.base(),
                len: m.len(),
                buffer_id: m.buffer_id,
                kind: (!self.faults.unshareable).then_some(m.kind),
            },
            Err(_) => PtrInfo::Host,
        })
    }

    fn alloc(&self, device: u32, len: u64, kind: AllocKind) -> Result<DeviceAlloc, GpuError> {
        self.device(device)?;
        if kind == AllocKind::Vmm && self.faults.no_vmm {
            return Err(GpuError::Refused("the device has no VMM".into()));
        }
        let len = len.max(1).next_multiple_of(4096);
        let mut map = SharedMem::create(c"smcuda-double-mem", len as usize)
            .map_err(|e| failed("allocating", e))?;
        let fd = map
            .take_fd()
            .ok_or_else(|| failed("allocating", "no descriptor"))?;
        let mem = Arc::new(Mem {
            map,
            fd,
            device,
            kind,
            buffer_id: self.buffer_ids.fetch_add(1, Ordering::Relaxed),
        });
        let mut st = lock(&self.state);
        let token = st.next;
        st.next += 1;
        let a = DeviceAlloc {
            device,
            ptr: mem.base(),
            len: mem.len(),
            kind,
            token,
            adopted: false,
        };
        st.allocs.insert(token, mem);
        Ok(a)
    }

    fn free(&self, a: DeviceAlloc) -> Result<(), GpuError> {
        if a.adopted {
            return Err(GpuError::BadPointer(
                "the user's memory is released, not freed".into(),
            ));
        }
        let mut st = lock(&self.state);
        match st.allocs.get(&a.token) {
            Some(m) if m.device == a.device && m.kind == a.kind && m.base() == a.ptr => {
                st.allocs.remove(&a.token);
                Ok(())
            }
            _ => Err(GpuError::BadPointer(format!("no allocation {}", a.token))),
        }
    }

    fn adopt(&self, ptr: u64, len: u64) -> Result<DeviceAlloc, GpuError> {
        // Only this process's own allocations: a peer's memory mapped here
        // is not the caller's to offer.
        if self.faults.unshareable {
            return Err(GpuError::Refused(UNSHAREABLE.into()));
        }
        let st = lock(&self.state);
        st.allocs
            .iter()
            .find(|(_, m)| m.holds(ptr, len.max(1)))
            .map(|(token, m)| DeviceAlloc {
                device: m.device,
                ptr: m.base(),
                len: m.len(),
                kind: m.kind,
                token: *token,
                adopted: true,
            })
            .ok_or_else(|| {
                GpuError::BadPointer(format!(
                    "{len} bytes at {ptr:#x} are not device memory this process allocated"
                ))
            })
    }

    fn release(&self, a: DeviceAlloc) -> Result<(), GpuError> {
        if !a.adopted {
            return Err(GpuError::BadPointer(
                "memory of our own is freed, not released".into(),
            ));
        }
        match lock(&self.state).allocs.get(&a.token) {
            Some(m) if m.base() == a.ptr => Ok(()),
            _ => Err(GpuError::BadPointer(format!("no allocation {}", a.token))),
        }
    }

    fn export(&self, a: &DeviceAlloc) -> Result<MemHandle, GpuError> {
        if self.faults.export {
            return Err(GpuError::Refused("export refused (injected)".into()));
        }
        let st = lock(&self.state);
        let m = st
            .allocs
            .get(&a.token)
            .ok_or_else(|| GpuError::BadPointer(format!("no allocation {}", a.token)))?;
        match m.kind {
            AllocKind::Vmm => Ok(MemHandle::Fd(
                m.fd.try_clone().map_err(|e| failed("dup", e))?,
            )),
            AllocKind::Legacy => {
                if self.faults.no_legacy {
                    return Err(GpuError::Refused(
                        "legacy IPC is not supported for this memory".into(),
                    ));
                }
                let mut h = [0u8; 64];
                h[..8].copy_from_slice(LEGACY_MAGIC);
                h[8..12].copy_from_slice(&crate::sys::os::pid().to_le_bytes());
                h[12..16].copy_from_slice(&(m.fd.as_raw_fd() as u32).to_le_bytes());
                h[16..24].copy_from_slice(&inode(&m.fd)?.to_le_bytes());
                h[24..32].copy_from_slice(&m.len().to_le_bytes());
                Ok(MemHandle::Legacy(h))
            }
        }
    }

    fn import(&self, device: u32, h: MemHandle, len: u64) -> Result<Imported, GpuError> {
        self.device(device)?;
        if self.faults.import {
            return Err(GpuError::Refused("import refused (injected)".into()));
        }
        let mut st = lock(&self.state);
        if st.already_mapped > 0 {
            st.already_mapped -= 1;
            return Err(GpuError::AlreadyMapped);
        }
        let (fd, kind, legacy) = match h {
            MemHandle::Fd(fd) => (fd, AllocKind::Vmm, None),
            MemHandle::Legacy(h) => {
                if &h[..8] != LEGACY_MAGIC {
                    return Err(GpuError::Refused("not a legacy handle".into()));
                }
                let word = |r: std::ops::Range<usize>| {
                    let mut b = [0u8; 8];
                    b[..r.len()].copy_from_slice(&h[r]);
                    u64::from_le_bytes(b)
                };
                let (pid, fdn, ino) = (word(8..12) as u32, word(12..16) as u32, word(16..24));
                if st.legacy_open.contains(&(pid, ino)) {
                    return Err(GpuError::AlreadyMapped);
                }
                (
                    open_peer_fd(pid, fdn, ino)?,
                    AllocKind::Legacy,
                    Some((pid, ino)),
                )
            }
        };
        let map = SharedMem::from_peer(fd.try_clone().map_err(|e| failed("dup", e))?, len as usize)
            .map_err(|e| GpuError::Refused(format!("mapping the peer's memory: {e}")))?;
        let mem = Arc::new(Mem {
            map,
            fd,
            device,
            kind,
            buffer_id: self.buffer_ids.fetch_add(1, Ordering::Relaxed),
        });
        if let Some(k) = legacy {
            st.legacy_open.insert(k);
        }
        let token = st.next;
        st.next += 1;
        let m = Imported {
            ptr: mem.base(),
            len: mem.len(),
            kind,
            token,
        };
        st.imports.insert(token, (mem, legacy));
        Ok(m)
    }

    fn unmap(&self, m: Imported) -> Result<(), GpuError> {
        let mut st = lock(&self.state);
        if !st
            .imports
            .get(&m.token)
            .is_some_and(|(mem, _)| mem.kind == m.kind && mem.base() == m.ptr)
        {
            return Err(GpuError::BadPointer(format!("no mapping {}", m.token)));
        }
        let (_, legacy) = st.imports.remove(&m.token).expect("checked above");
        if let Some(k) = legacy {
            st.legacy_open.remove(&k);
        }
        Ok(())
    }

    fn stream(&self, device: u32) -> Result<Stream, GpuError> {
        self.device(device)?;
        let w = Arc::new(Worker {
            queue: Mutex::new((VecDeque::new(), false)),
            more: Condvar::new(),
            delay: self.faults.copy_delay,
        });
        let run = w.clone();
        let h = std::thread::Builder::new()
            .name("gpu-double-stream".into())
            .spawn(move || run.run())
            .map_err(|e| failed("starting a stream", e))?;
        let mut st = lock(&self.state);
        st.streams.push((w, Some(h)));
        Ok(Stream(st.streams.len() as u64 - 1))
    }

    fn event(&self, device: u32, _interprocess: bool) -> Result<Event, GpuError> {
        self.device(device)?;
        let mut st = lock(&self.state);
        let slot = st
            .slots
            .iter()
            .position(|used| !used)
            .ok_or_else(|| failed("event", "out of events"))?;
        st.slots[slot] = true;
        let words = self.page.words(slot);
        let at = words[1].load(Ordering::Acquire);
        words[0].store(at, Ordering::Release);
        let id = st.next;
        st.next += 1;
        st.events.insert(
            id,
            Ev {
                page: self.page.clone(),
                slot,
            },
        );
        Ok(Event(id))
    }

    fn export_event(&self, e: Event) -> Result<[u8; 64], GpuError> {
        let ev = GpuDouble::ev(&lock(&self.state), e)?;
        if !Arc::ptr_eq(&ev.page, &self.page) {
            return Err(GpuError::Refused(
                "an opened event cannot be exported".into(),
            ));
        }
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(EVENT_MAGIC);
        h[8..12].copy_from_slice(&crate::sys::os::pid().to_le_bytes());
        h[12..16].copy_from_slice(&(self.page_fd.as_raw_fd() as u32).to_le_bytes());
        h[16..24].copy_from_slice(&inode(&self.page_fd)?.to_le_bytes());
        h[24..32].copy_from_slice(&(ev.slot as u64).to_le_bytes());
        Ok(h)
    }

    fn open_event(&self, h: &[u8; 64]) -> Result<Event, GpuError> {
        if &h[..8] != EVENT_MAGIC {
            return Err(GpuError::Refused("not an event handle".into()));
        }
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        let (pid, fd, ino, slot) = (u32_at(8), u32_at(12), u64_at(16), u64_at(24));
        if slot >= EVENT_SLOTS as u64 {
            return Err(GpuError::Refused("event slot out of range".into()));
        }
        let mut st = lock(&self.state);
        let page = match st.pages.get(&(pid, ino)) {
            Some(p) => p.clone(),
            None => {
                let fd = open_peer_fd(pid, fd, ino)?;
                let map = SharedMem::from_peer(fd, EVENT_SLOTS * 16)
                    .map_err(|e| GpuError::Refused(format!("mapping the event page: {e}")))?;
                let p = Arc::new(Page { map });
                st.pages.insert((pid, ino), p.clone());
                p
            }
        };
        let id = st.next;
        st.next += 1;
        st.events.insert(
            id,
            Ev {
                page,
                slot: slot as usize,
            },
        );
        Ok(Event(id))
    }

    fn destroy_event(&self, e: Event) {
        let mut st = lock(&self.state);
        if let Some(ev) = st.events.remove(&e.0) {
            if Arc::ptr_eq(&ev.page, &self.page) {
                st.slots[ev.slot] = false;
            }
        }
    }

    fn record(&self, e: Event, s: Stream) -> Result<(), GpuError> {
        let st = lock(&self.state);
        let ev = GpuDouble::ev(&st, e)?;
        let w = GpuDouble::worker(&st, s)?;
        let generation = ev.page.words(ev.slot)[0].fetch_add(1, Ordering::AcqRel) + 1;
        w.push(Op::Record { ev, generation });
        Ok(())
    }

    fn query(&self, e: Event) -> Result<bool, GpuError> {
        if self.faults.event {
            return Err(GpuError::Failed("event query failed (injected)".into()));
        }
        let ev = GpuDouble::ev(&lock(&self.state), e)?;
        let w = ev.page.words(ev.slot);
        Ok(w[1].load(Ordering::Acquire) >= w[0].load(Ordering::Acquire))
    }

    fn wait_event(&self, s: Stream, e: Event) -> Result<(), GpuError> {
        let st = lock(&self.state);
        let ev = GpuDouble::ev(&st, e)?;
        let generation = ev.page.words(ev.slot)[0].load(Ordering::Acquire);
        if !self.faults.skip_wait {
            GpuDouble::worker(&st, s)?.push(Op::Wait { ev, generation });
        }
        Ok(())
    }

    fn copy(&self, s: Stream, dst: u64, src: u64, len: u64) -> Result<(), GpuError> {
        let st = lock(&self.state);
        let dst = GpuDouble::find(&st, dst, len)?;
        let src = GpuDouble::find(&st, src, len)?;
        GpuDouble::worker(&st, s)?.push(Op::Copy { dst, src, len });
        Ok(())
    }

    fn fill(&self, s: Stream, dst: u64, byte: u8, len: u64) -> Result<(), GpuError> {
        let st = lock(&self.state);
        let dst = GpuDouble::find(&st, dst, len)?;
        GpuDouble::worker(&st, s)?.push(Op::Fill { dst, byte, len });
        Ok(())
    }

    fn notify(&self, s: Stream, bell: Bell) -> Result<(), GpuError> {
        GpuDouble::worker(&lock(&self.state), s)?.push(Op::Notify(bell));
        Ok(())
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        let (m, off) = GpuDouble::find(&lock(&self.state), dst, src.len() as u64)?;
        m.map.raw().write(off, src).map_err(|e| failed("upload", e))
    }

    fn download(&self, dst: &mut [u8], src: u64) -> Result<(), GpuError> {
        let (m, off) = GpuDouble::find(&lock(&self.state), src, dst.len() as u64)?;
        m.map
            .raw()
            .read(off, dst)
            .map_err(|e| failed("download", e))
    }

    fn upload_raw(&self, dst: u64, src: RawBuf) -> Result<(), GpuError> {
        let st = lock(&self.state);
        self.check_pinned(&st, &src, "upload")?;
        let (m, off) = GpuDouble::find(&st, dst, src.len() as u64)?;
        m.map
            .raw()
            .copy_from(off, &src, 0, src.len())
            .map_err(|e| failed("upload", e))
    }

    fn download_raw(&self, dst: RawBuf, src: u64) -> Result<(), GpuError> {
        let st = lock(&self.state);
        self.check_pinned(&st, &dst, "download")?;
        let (m, off) = GpuDouble::find(&st, src, dst.len() as u64)?;
        dst.copy_from(0, &m.map.raw(), off, dst.len())
            .map_err(|e| failed("download", e))
    }

    fn pin(&self, host: RawBuf) -> Result<bool, GpuError> {
        let mut st = lock(&self.state);
        let (a, n) = (host.addr(), host.len());
        // As the driver: the same range again is "already registered", one
        // overlapping a pinned range otherwise is refused.
        if st.pinned.contains(&(a, n)) {
            return Ok(false);
        }
        if st.pinned.iter().any(|&(b, m)| a < b + m && b < a + n) {
            return Err(failed("pin", "the range overlaps a pinned one"));
        }
        st.pinned.push((a, n));
        Ok(true)
    }

    fn unpin(&self, host: RawBuf) -> Result<(), GpuError> {
        let mut st = lock(&self.state);
        match st.pinned.iter().position(|&(b, _)| b == host.addr()) {
            Some(i) => {
                st.pinned.swap_remove(i);
                Ok(())
            }
            None => Err(failed("unpin", "the range was not pinned")),
        }
    }
}

impl GpuDouble {
    /// With `pinned-only`, refuse a copy with host memory outside every
    /// pinned range.
    fn check_pinned(&self, st: &State, host: &RawBuf, what: &str) -> Result<(), GpuError> {
        let (a, n) = (host.addr(), host.len());
        let inside = st.pinned.iter().any(|&(b, m)| b <= a && a + n <= b + m);
        if self.faults.pinned_only && !inside {
            return Err(failed(what, "host memory not pinned (pinned-only)"));
        }
        Ok(())
    }
}

/// A raw view of device memory of the double, for tests in this crate.
#[cfg(test)]
pub(crate) fn raw_of(g: &GpuDouble, ptr: u64, len: u64) -> Option<crate::sys::mem::RawBuf> {
    let (m, off) = GpuDouble::find(&lock(&g.state), ptr, len).ok()?;
    m.map.raw().slice(off, len as usize).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(g: &GpuDouble, e: Event) {
        for _ in 0..20_000 {
            if g.query(e).unwrap() {
                return;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        panic!("event never fired");
    }

    #[test]
    fn faults_parse_and_refuse_nonsense() {
        let f = Faults::parse("no-vmm, already-mapped:2,copy-delay-ms:5,devices:2").unwrap();
        assert!(f.no_vmm && !f.mig);
        assert_eq!(f.already_mapped, 2);
        assert_eq!(f.copy_delay, Duration::from_millis(5));
        assert_eq!(f.devices, 2);
        assert_eq!(Faults::parse("").unwrap().devices, 1);
        assert!(Faults::parse("explode").is_err());
        assert!(Faults::parse("devices:x").is_err());
    }

    #[test]
    fn a_copy_completes_later_in_stream_order() {
        let g = GpuDouble::new(Faults::parse("copy-delay-ms:30").unwrap()).unwrap();
        let a = g.alloc(0, 1 << 16, AllocKind::Vmm).unwrap();
        let b = g.alloc(0, 1 << 16, AllocKind::Legacy).unwrap();
        g.upload(a.ptr, &[7u8; 1 << 16]).unwrap();
        let s = g.stream(0).unwrap();
        let e = g.event(0, false).unwrap();
        assert!(
            g.query(e).unwrap(),
            "an event never recorded counts as done"
        );
        g.copy(s, b.ptr + 100, a.ptr, 1000).unwrap();
        g.record(e, s).unwrap();
        assert!(
            !g.query(e).unwrap(),
            "the copy is still queued behind its delay"
        );
        wait(&g, e);
        let mut out = vec![0u8; 1200];
        g.download(&mut out, b.ptr).unwrap();
        assert!(out[..100].iter().all(|&x| x == 0));
        assert!(out[100..1100].iter().all(|&x| x == 7));
        assert!(out[1100..].iter().all(|&x| x == 0));
        assert!(matches!(
            g.classify(b.ptr + 5).unwrap(),
            PtrInfo::Device { base, kind: Some(AllocKind::Legacy), .. } if base == b.ptr
        ));
        let host = 0u64;
        assert_eq!(
            g.classify(&host as *const u64 as u64).unwrap(),
            PtrInfo::Host
        );
        assert!(matches!(
            g.copy(s, b.ptr, a.ptr, 1 << 20),
            Err(GpuError::BadPointer(_))
        ));
        g.free(a).unwrap();
        g.free(b).unwrap();
    }

    #[test]
    fn handles_open_once_and_reallocation_changes_the_buffer_id() {
        let owner = GpuDouble::new(Faults::parse("").unwrap()).unwrap();
        let user = GpuDouble::new(Faults::parse("").unwrap()).unwrap();
        let a = owner.alloc(0, 8192, AllocKind::Legacy).unwrap();
        owner.upload(a.ptr, b"device bytes").unwrap();
        let MemHandle::Legacy(h) = owner.export(&a).unwrap() else {
            panic!("legacy memory exports a legacy handle");
        };
        let m = user.import(0, MemHandle::Legacy(h), a.len).unwrap();
        let mut got = [0u8; 12];
        user.download(&mut got, m.ptr).unwrap();
        assert_eq!(&got, b"device bytes");
        assert_eq!(
            user.import(0, MemHandle::Legacy(h), a.len).unwrap_err(),
            GpuError::AlreadyMapped
        );
        user.unmap(m).unwrap();
        let m = user.import(0, MemHandle::Legacy(h), a.len).unwrap();
        user.unmap(m).unwrap();

        let id = |g: &GpuDouble, p| match g.classify(p).unwrap() {
            PtrInfo::Device { buffer_id, .. } => buffer_id,
            PtrInfo::Host => panic!("device memory"),
        };
        let first = id(&owner, a.ptr);
        owner.free(a).unwrap();
        let b = owner.alloc(0, 8192, AllocKind::Vmm).unwrap();
        assert_ne!(id(&owner, b.ptr), first);
        let MemHandle::Fd(fd) = owner.export(&b).unwrap() else {
            panic!("VMM memory exports a descriptor");
        };
        let m = user.import(0, MemHandle::Fd(fd), 4096).unwrap();
        assert!(m.len >= 8192);
        user.unmap(m).unwrap();
        let big = owner.export(&b).unwrap();
        assert!(matches!(
            user.import(0, big, 1 << 20),
            Err(GpuError::Refused(_))
        ));
    }

    #[test]
    fn an_opened_event_orders_a_peer_stream_and_host_functions_ring() {
        let owner = GpuDouble::new(Faults::parse("copy-delay-ms:40").unwrap()).unwrap();
        let user = GpuDouble::new(Faults::parse("").unwrap()).unwrap();
        let a = owner.alloc(0, 4096, AllocKind::Vmm).unwrap();
        let s = owner.stream(0).unwrap();
        let e = owner.event(0, true).unwrap();
        owner.fill(s, a.ptr, 0xab, 4096).unwrap();
        owner.record(e, s).unwrap();
        let theirs = user.open_event(&owner.export_event(e).unwrap()).unwrap();
        assert!(!user.query(theirs).unwrap());
        let MemHandle::Fd(fd) = owner.export(&a).unwrap() else {
            panic!("fd");
        };
        let m = user.import(0, MemHandle::Fd(fd), 4096).unwrap();
        let local = user.alloc(0, 4096, AllocKind::Vmm).unwrap();
        let us = user.stream(0).unwrap();
        let done = user.event(0, false).unwrap();
        user.wait_event(us, theirs).unwrap();
        user.copy(us, local.ptr, m.ptr, 4096).unwrap();
        user.record(done, us).unwrap();
        let rang = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = rang.clone();
        user.notify(us, Arc::new(move || r.store(true, Ordering::Release)))
            .unwrap();
        wait(&user, done);
        let mut out = vec![0u8; 4096];
        user.download(&mut out, local.ptr).unwrap();
        assert!(
            out.iter().all(|&b| b == 0xab),
            "the copy waited for the owner's fill"
        );
        for _ in 0..1000 {
            if rang.load(Ordering::Acquire) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(rang.load(Ordering::Acquire));
        assert!(raw_of(&user, local.ptr, 4096).is_some());
    }

    #[test]
    fn injected_faults_refuse() {
        let g =
            GpuDouble::new(Faults::parse("no-vmm,no-legacy,already-mapped:1").unwrap()).unwrap();
        assert!(matches!(
            g.alloc(0, 10, AllocKind::Vmm),
            Err(GpuError::Refused(_))
        ));
        let a = g.alloc(0, 10, AllocKind::Legacy).unwrap();
        assert!(matches!(g.export(&a), Err(GpuError::Refused(_))));
        assert!(matches!(
            g.import(0, MemHandle::Legacy([0; 64]), 10),
            Err(GpuError::AlreadyMapped)
        ));
        assert!(matches!(
            g.import(0, MemHandle::Legacy([0; 64]), 10),
            Err(GpuError::Refused(_))
        ));
        assert!(g.alloc(1, 10, AllocKind::Legacy).is_err());
        assert!(!g.can_access_peer(0, 1));
        let two = GpuDouble::new(Faults::parse("devices:2").unwrap()).unwrap();
        assert!(two.can_access_peer(0, 1) && !two.can_access_peer(0, 2));
        let b = two.alloc(1, 10, AllocKind::Vmm).unwrap();
        let forged = DeviceAlloc {
            device: 0,
            ptr: b.ptr,
            len: b.len,
            kind: b.kind,
            token: b.token,
            adopted: false,
        };
        assert!(matches!(two.free(forged), Err(GpuError::BadPointer(_))));
        // The user's memory is released, never freed; ours the reverse.
        let mine = two.alloc(0, 8192, AllocKind::Vmm).unwrap();
        let theirs = two.adopt(mine.ptr + 4096, 100).unwrap();
        assert_eq!((theirs.ptr, theirs.len), (mine.ptr, mine.len));
        assert!(theirs.adopted && !mine.adopted);
        assert!(two.adopt(mine.ptr + 8100, 100).is_err(), "past the end");
        let again = two.adopt(mine.ptr, 1).unwrap();
        assert!(matches!(two.free(again), Err(GpuError::BadPointer(_))));
        two.release(theirs).unwrap();
        let own = DeviceAlloc {
            device: mine.device,
            ptr: mine.ptr,
            len: mine.len,
            kind: mine.kind,
            token: mine.token,
            adopted: false,
        };
        assert!(matches!(two.release(own), Err(GpuError::BadPointer(_))));
        two.free(mine).unwrap();
        two.free(b).unwrap();
    }
}

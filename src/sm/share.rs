//! Handing sealed shared memory to same-node peers.
//!
//! A process's segment and its shared regions are memory files with no
//! name (`sys::shm`), so a peer cannot open them: it asks their owner.
//! Each process that shares memory runs one *share server*: a thread
//! listening on a Unix `SOCK_SEQPACKET` socket in the abstract namespace
//! under a random name `abtl-share-<128-bit hex>`, published in the `sm`
//! address and in region keys. A peer connects (every step under
//! [`FETCH_LIMIT`]), checks with `SO_PEERCRED` that the listener is the
//! published pid of the same user, and sends one [`Request`]: what it wants
//! (segment or region), its id, and the job tag. The server checks the
//! asker's uid and the job tag and answers one [`Answer`], with the memory
//! file's descriptor attached (`SCM_RIGHTS`) when it says yes. The asker
//! then checks the seals and the size before it maps anything
//! ([`SharedMem::from_peer`]).
//!
//! Both messages are fixed-size little-endian records with a magic; any
//! bytes decode to a record or a [`WireError`], never a panic
//! (`fuzz/fuzz_targets/sm_share.rs`). What the server refuses is counted in
//! [`refused_requests`]; what an asker refuses is its caller's to count.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::sys::fdpass;
use crate::sys::shm::{Refused, SharedMem};
use crate::sys::sync::lock;

/// Bytes of a request.
pub(crate) const REQUEST_LEN: usize = 48;
/// Bytes of an answer.
pub(crate) const ANSWER_LEN: usize = 24;
const REQUEST_MAGIC: [u8; 8] = *b"ABTLSHQ1";
const ANSWER_MAGIC: [u8; 8] = *b"ABTLSHA1";
/// The longest an asker waits for any step of a fetch (connect, send,
/// answer) before it fails. The server answers at once (one asker at a
/// time, each cut off after [`SERVE_LIMIT`]), so this is far above what a
/// fetch takes, and low enough that an operation whose first use of a key
/// fetches its memory is not held up long by a server that is gone.
pub(crate) const FETCH_LIMIT: Duration = Duration::from_secs(2);
/// The longest the server waits for one asker's request (an asker sends
/// it right after connecting), so a same-user process that connects and
/// says nothing delays the others by that at most.
const SERVE_LIMIT: Duration = Duration::from_millis(100);

/// What is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    /// A process's segment (rings, fast boxes, fragment pool).
    Segment = 1,
    /// A region made by `Fabric::alloc_region`.
    Region = 2,
    /// A GPU allocation's VMM descriptor (`smcuda`): not a memory file,
    /// so the asker hands it to the GPU driver instead of mapping it.
    Gpu = 3,
}

/// A peer's request for one memory file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) kind: Kind,
    pub(crate) job_tag: [u64; 2],
    pub(crate) id: [u8; 16],
}

/// The server's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Here it is (the descriptor is attached).
    Ok = 0,
    /// Nothing of that kind and id is served (never was, or dropped).
    Unknown = 1,
    /// It belongs to another job.
    OtherJob = 2,
    /// The request was not one.
    Malformed = 3,
    /// The asker runs as another user.
    Foreign = 4,
}

/// The server's answer: a status, and the memory's size when `Ok`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: Status,
    pub(crate) len: u64,
}

/// Why bytes are not a request or an answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    /// Wrong size for the record.
    #[error("{got} bytes where a {want}-byte record was expected")]
    Length { got: usize, want: usize },
    /// Not our magic.
    #[error("bad magic: not an async-btl share message")]
    Magic,
    /// An unknown kind or status byte.
    #[error("unknown {what} {value}")]
    Unknown { what: &'static str, value: u8 },
    /// Reserved bytes not zero, or a size with a refusal.
    #[error("reserved bytes are not zero")]
    Reserved,
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(w)
}

fn check_frame(b: &[u8], want: usize, magic: &[u8; 8]) -> Result<(), WireError> {
    if b.len() != want {
        return Err(WireError::Length { got: b.len(), want });
    }
    if b[..8] != magic[..] {
        return Err(WireError::Magic);
    }
    if b[9..16].iter().any(|&x| x != 0) {
        return Err(WireError::Reserved);
    }
    Ok(())
}

impl Request {
    /// The request's bytes: magic, kind, 7 zero bytes, the job tag, the id.
    pub(crate) fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[..8].copy_from_slice(&REQUEST_MAGIC);
        b[8] = self.kind as u8;
        b[16..24].copy_from_slice(&self.job_tag[0].to_le_bytes());
        b[24..32].copy_from_slice(&self.job_tag[1].to_le_bytes());
        b[32..48].copy_from_slice(&self.id);
        b
    }

    /// Decode a request; anything but exactly what [`encode`](Self::encode)
    /// writes is an error.
    pub(crate) fn decode(b: &[u8]) -> Result<Request, WireError> {
        check_frame(b, REQUEST_LEN, &REQUEST_MAGIC)?;
        let kind = match b[8] {
            1 => Kind::Segment,
            2 => Kind::Region,
            3 => Kind::Gpu,
            value => {
                return Err(WireError::Unknown {
                    what: "kind",
                    value,
                })
            }
        };
        let mut id = [0u8; 16];
        id.copy_from_slice(&b[32..48]);
        Ok(Request {
            kind,
            job_tag: [u64_at(b, 16), u64_at(b, 24)],
            id,
        })
    }
}

impl Answer {
    /// The answer's bytes: magic, status, 7 zero bytes, the size.
    pub(crate) fn encode(&self) -> [u8; ANSWER_LEN] {
        let mut b = [0u8; ANSWER_LEN];
        b[..8].copy_from_slice(&ANSWER_MAGIC);
        b[8] = self.status as u8;
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decode an answer; a refusal must say size 0.
    pub(crate) fn decode(b: &[u8]) -> Result<Answer, WireError> {
        check_frame(b, ANSWER_LEN, &ANSWER_MAGIC)?;
        let status = match b[8] {
            0 => Status::Ok,
            1 => Status::Unknown,
            2 => Status::OtherJob,
            3 => Status::Malformed,
            4 => Status::Foreign,
            value => {
                return Err(WireError::Unknown {
                    what: "status",
                    value,
                })
            }
        };
        let len = u64_at(b, 16);
        if status != Status::Ok && len != 0 {
            return Err(WireError::Reserved);
        }
        Ok(Answer { status, len })
    }
}

/// A memory file the server hands out.
struct Offer {
    job_tag: [u64; 2],
    fd: OwnedFd,
    len: u64,
}

/// What this process serves, by kind and id.
static OFFERS: Mutex<BTreeMap<(Kind, [u8; 16]), Offer>> = Mutex::new(BTreeMap::new());
/// Requests the server refused (any cause), in this process.
static REFUSED: AtomicU64 = AtomicU64::new(0);
/// The server's name, once it listens (or why it could not).
static SERVER: OnceLock<Result<[u8; 16], String>> = OnceLock::new();

/// Requests for shared memory this process's server refused: another
/// user, malformed, another job's tag, or an id it does not serve.
pub(crate) fn refused_requests() -> u64 {
    REFUSED.load(Ordering::Relaxed)
}

fn socket_name(server: &[u8; 16]) -> Vec<u8> {
    format!("abtl-share-{}", crate::sys::os::hex(server)).into_bytes()
}

/// This process's share server (started on first use): its id, which
/// names its socket.
pub(crate) fn server() -> crate::Result<[u8; 16]> {
    SERVER
        .get_or_init(|| {
            let id = crate::sys::os::random_bytes::<16>();
            let listener = fdpass::listen(&socket_name(&id))
                .map_err(|e| format!("binding the shared-memory socket: {e}"))?;
            std::thread::Builder::new()
                .name("btl-share".into())
                .spawn(move || serve_forever(listener))
                .map_err(|e| format!("starting the shared-memory server thread: {e}"))?;
            Ok(id)
        })
        .clone()
        .map_err(|e| crate::Error::Config(format!("sm cannot share memory: {e}")))
}

/// While alive, peers of job `job_tag` may fetch `mem` as `kind`/`id`;
/// dropping it stops that (mappings already made stay valid).
pub(crate) struct Served {
    key: (Kind, [u8; 16]),
}

impl Drop for Served {
    fn drop(&mut self) {
        lock(&OFFERS).remove(&self.key);
    }
}

/// Serve `mem` (ours: it has a descriptor, which the server takes over)
/// to peers of `job_tag`.
pub(crate) fn serve(
    mem: &mut SharedMem,
    kind: Kind,
    id: [u8; 16],
    job_tag: [u64; 2],
) -> crate::Result<Served> {
    server()?;
    let fd = mem
        .take_fd()
        .ok_or_else(|| crate::Error::Misuse("serving memory this process does not own".into()))?;
    serve_fd(fd, mem.len() as u64, kind, id, job_tag)
}

/// Serve the descriptor `fd` (of `len` bytes) as `kind`/`id` to peers of
/// `job_tag`; the server keeps it until the guard drops.
pub(crate) fn serve_fd(
    fd: OwnedFd,
    len: u64,
    kind: Kind,
    id: [u8; 16],
    job_tag: [u64; 2],
) -> crate::Result<Served> {
    server()?;
    let offer = Offer { job_tag, fd, len };
    let key = (kind, id);
    let mut offers = lock(&OFFERS);
    // Checked before inserting: the offer already there keeps its guard.
    if offers.contains_key(&key) {
        return Err(crate::Error::Misuse("shared memory id served twice".into()));
    }
    offers.insert(key, offer);
    Ok(Served { key })
}

fn serve_forever(listener: socket2::Socket) {
    loop {
        match listener.accept() {
            Ok((conn, _)) => answer(&conn),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors or memory: let it pass, never spin.
                tracing::debug!("shared-memory server: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Answer one asker (bounded by `SERVE_LIMIT` per step).
fn answer(conn: &socket2::Socket) {
    if let Err(e) = fdpass::set_timeouts(conn, SERVE_LIMIT) {
        // Unbounded, a silent asker would hold the server forever.
        tracing::debug!(
            "shared-memory server: dropped an asker whose socket takes no timeout: {e}"
        );
        return;
    }
    let (status, fd, len) = judge(conn);
    if status != Status::Ok {
        REFUSED.fetch_add(1, Ordering::Relaxed);
    }
    let bytes = Answer { status, len }.encode();
    if let Err(e) = fdpass::send(conn, &bytes, fd.as_ref().map(AsFd::as_fd)) {
        tracing::debug!("shared-memory server: answering failed: {e}");
    }
}

fn judge(conn: &socket2::Socket) -> (Status, Option<OwnedFd>, u64) {
    let refuse = |s: Status| (s, None, 0);
    match fdpass::peer_cred(conn) {
        Ok((_, uid)) if uid == crate::sys::os::uid() => {}
        Ok((pid, uid)) => {
            tracing::warn!("shared-memory server: refused pid {pid} of uid {uid} (another user)");
            return refuse(Status::Foreign);
        }
        Err(_) => return refuse(Status::Foreign),
    }
    let mut buf = [0u8; REQUEST_LEN + 1];
    let req = match fdpass::recv(conn, &mut buf) {
        Ok(got) if !got.truncated => Request::decode(&buf[..got.len]),
        Ok(got) => Err(WireError::Length {
            got: got.len + 1,
            want: REQUEST_LEN,
        }),
        Err(e) => {
            tracing::debug!("shared-memory server: no request: {e}");
            return refuse(Status::Malformed);
        }
    };
    let req = match req {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("shared-memory server: refused a malformed request: {e}");
            return refuse(Status::Malformed);
        }
    };
    let offers = lock(&OFFERS);
    let Some(offer) = offers.get(&(req.kind, req.id)) else {
        return refuse(Status::Unknown);
    };
    if offer.job_tag != req.job_tag {
        return refuse(Status::OtherJob);
    }
    match offer.fd.try_clone() {
        Ok(fd) => (Status::Ok, Some(fd), offer.len),
        Err(e) => {
            tracing::debug!("shared-memory server: duplicating a descriptor: {e}");
            refuse(Status::Unknown)
        }
    }
}

/// Why fetching a peer's memory failed.
#[derive(Debug)]
pub(crate) enum FetchError {
    /// Nobody listens at the address (the owner exited), or the owner no
    /// longer serves that memory, or it belongs to another job.
    Unknown(String),
    /// The memory came but is not safe to map (unsealed, foreign, short).
    Refused(Refused),
    /// The other end broke the protocol or is not who was published.
    Misbehaved(String),
    /// A system call failed, or a step timed out.
    Os(std::io::Error),
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FetchError::Unknown(why) | FetchError::Misbehaved(why) => f.write_str(why),
            FetchError::Refused(r) => r.fmt(f),
            FetchError::Os(e) => write!(f, "fetching its shared memory: {e}"),
        }
    }
}

/// Whether an answer came with the descriptors it should: one with a
/// yes, none with a refusal.
pub(crate) fn acceptable(answer: &Answer, fds: usize) -> Result<(), String> {
    match (answer.status, fds) {
        (Status::Ok, 1) => Ok(()),
        (Status::Ok, n) => Err(format!("said yes with {n} descriptors")),
        (_, 0) => Ok(()),
        (_, n) => Err(format!("refused with {n} descriptors")),
    }
}

/// Fetch and map memory `kind`/`id` of job `job_tag` from the share
/// server `server` of process `pid`: at least `min_len` bytes, sealed.
/// Every step is bounded by [`FETCH_LIMIT`].
pub(crate) fn fetch(
    server: &[u8; 16],
    pid: u32,
    req: Request,
    min_len: usize,
) -> Result<SharedMem, FetchError> {
    let (fd, len) = fetch_fd(server, pid, req)?;
    let mem = SharedMem::from_peer(fd, min_len).map_err(FetchError::Refused)?;
    if mem.len() as u64 != len {
        return Err(FetchError::Misbehaved(format!(
            "its shared-memory server said {len} bytes for memory of {}",
            mem.len()
        )));
    }
    Ok(mem)
}

/// Fetch the descriptor served as `req` by the share server `server` of
/// process `pid`, and the size it states, checking nothing of what the
/// descriptor is (the caller does). Every step is bounded by
/// [`FETCH_LIMIT`].
pub(crate) fn fetch_fd(
    server: &[u8; 16],
    pid: u32,
    req: Request,
) -> Result<(OwnedFd, u64), FetchError> {
    let conn = fdpass::connect(&socket_name(server), FETCH_LIMIT).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound => {
            FetchError::Unknown(format!(
                "nobody serves its shared memory any more (pid {pid} exited?): {e}"
            ))
        }
        _ => FetchError::Os(e),
    })?;
    let (got_pid, uid) = fdpass::peer_cred(&conn).map_err(FetchError::Os)?;
    if got_pid != pid || uid != crate::sys::os::uid() {
        return Err(FetchError::Misbehaved(format!(
            "its shared memory is served by pid {got_pid} of uid {uid}, not by pid {pid} of this user"
        )));
    }
    fdpass::send(&conn, &req.encode(), None).map_err(FetchError::Os)?;
    let mut buf = [0u8; ANSWER_LEN + 1];
    let got = fdpass::recv(&conn, &mut buf).map_err(FetchError::Os)?;
    let bad = |what: String| FetchError::Misbehaved(format!("its shared-memory server {what}"));
    if got.truncated || got.fds_truncated {
        return Err(bad("sent an over-long answer".into()));
    }
    let answer = Answer::decode(&buf[..got.len]).map_err(|e| bad(format!("answered: {e}")))?;
    let mut fds = got.fds;
    acceptable(&answer, fds.len()).map_err(bad)?;
    if answer.status != Status::Ok {
        return Err(FetchError::Unknown(format!(
            "its shared-memory server refused our request ({:?})",
            answer.status
        )));
    }
    Ok((fds.remove(0), answer.len))
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(kind: Kind, id: [u8; 16]) -> Request {
        Request {
            kind,
            job_tag: [3, 4],
            id,
        }
    }

    #[test]
    fn served_memory_is_fetched_sealed_and_refused_to_others() {
        let id = crate::sys::os::random_bytes::<16>();
        let mut mem = SharedMem::create(c"abtl-test", 8192).unwrap();
        mem.raw().write(100, b"shared").unwrap();
        let served = serve(&mut mem, Kind::Region, id, [3, 4]).unwrap();
        assert!(mem.take_fd().is_none(), "the server holds the descriptor");
        let server = server().unwrap();
        let me = crate::sys::os::pid();
        let peer = fetch(&server, me, req(Kind::Region, id), 4096).unwrap();
        let mut b = [0u8; 6];
        peer.raw().read(100, &mut b).unwrap();
        assert_eq!(&b, b"shared");
        assert_eq!(peer.len(), 8192);
        assert!(peer.fd().is_none(), "the peer keeps no descriptor");
        let e = serve(&mut mem, Kind::Region, id, [3, 4]).err().unwrap();
        assert!(e.to_string().contains("does not own"), "{e}");
        let before = refused_requests();
        let other_job = Request {
            job_tag: [9, 9],
            ..req(Kind::Region, id)
        };
        let e = fetch(&server, me, other_job, 4096).err().unwrap();
        assert!(matches!(e, FetchError::Unknown(_)), "{e}");
        let e = fetch(&server, me, req(Kind::Segment, id), 4096)
            .err()
            .unwrap();
        assert!(matches!(e, FetchError::Unknown(_)), "{e}");
        let e = fetch(&server, me + 1, req(Kind::Region, id), 4096)
            .err()
            .unwrap();
        assert!(e.to_string().contains("served by pid"), "{e}");
        let e = fetch(&server, me, req(Kind::Region, id), 1 << 20)
            .err()
            .unwrap();
        assert!(
            matches!(e, FetchError::Refused(Refused::TooSmall { .. })),
            "{e}"
        );
        assert!(refused_requests() >= before + 2);
        drop(served);
        let e = fetch(&server, me, req(Kind::Region, id), 4096)
            .err()
            .unwrap();
        assert!(matches!(e, FetchError::Unknown(_)), "{e}");
        let gone = crate::sys::os::random_bytes::<16>();
        let e = fetch(&gone, me, req(Kind::Region, id), 4096).err().unwrap();
        assert!(e.to_string().contains("nobody serves"), "{e}");
    }

    /// A server that answers yes with memory that is not sealed: the asker
    /// refuses to map it.
    #[test]
    fn unsealed_memory_is_never_mapped() {
        let name = crate::sys::os::random_bytes::<16>();
        let listener = fdpass::listen(&socket_name(&name)).unwrap();
        let fd = OwnedFd::from(unsealed_memfd());
        let t = std::thread::spawn(move || {
            let (c, _) = listener.accept().unwrap();
            let mut buf = [0u8; 64];
            fdpass::recv(&c, &mut buf).unwrap();
            let a = Answer {
                status: Status::Ok,
                len: 8192,
            };
            fdpass::send(&c, &a.encode(), Some(fd.as_fd())).unwrap();
        });
        let e = fetch(
            &name,
            crate::sys::os::pid(),
            req(Kind::Segment, [0; 16]),
            4096,
        )
        .err()
        .unwrap();
        t.join().unwrap();
        assert!(
            matches!(e, FetchError::Refused(Refused::Unsealed { .. })),
            "{e}"
        );
        assert!(e.to_string().contains("not sealed"), "{e}");
    }

    /// A memory file of 8 KiB, ours and private, with no seals.
    fn unsealed_memfd() -> std::fs::File {
        use std::os::unix::fs::PermissionsExt;
        let f = std::fs::File::from(crate::sys::shm::memfd(c"abtl-unsealed").unwrap());
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .unwrap();
        f.set_len(8192).unwrap();
        f
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panic_and_accepted_ones_round_trip(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(r) = Request::decode(&b) {
                prop_assert_eq!(&r.encode()[..], &b[..]);
            }
            if let Ok(a) = Answer::decode(&b) {
                prop_assert_eq!(&a.encode()[..], &b[..]);
            }
        }

        #[test]
        fn records_round_trip(kind in 1u8..=2, t0: u64, t1: u64, id: [u8; 16], status in 0u8..=4, len: u64) {
            let kind = if kind == 1 { Kind::Segment } else { Kind::Region };
            let r = Request { kind, job_tag: [t0, t1], id };
            prop_assert_eq!(Request::decode(&r.encode()), Ok(r));
            let a = Answer::decode(&Answer { status: Status::Ok, len }.encode()).unwrap();
            prop_assert_eq!(a.len, len);
            let mut b = Answer { status: Status::Unknown, len: 0 }.encode();
            b[8] = status;
            prop_assert!(Answer::decode(&b).is_ok());
        }
    }
}

//! The `rdma` transport over libfabric: one reliable-datagram endpoint per
//! process, a completion queue read by the progress task, and per-peer
//! credit, order and liveness state. See the module docs of `rdma`.

use std::any::Any;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use super::config::RdmaConfig;
use super::ofi::{self, Cqe, Ep, Mr, PostError, Read};
use super::wire::{self, decode_addr, Body, Handle, Header, RdmaAddr, Type};
use crate::core::completion::{Completion, Done, Tally};
use crate::core::fabric::Core;
use crate::core::region::{KeyHandle, KeyId, NicReg, RegionInner};
use crate::sys::mem::RawBuf;
use crate::sys::sync::lock;
use crate::transport::{Kind, Link, Loss, Native, OneSided, Peer as PeerInfo, Transport};
use crate::{AccessError, Error, Rank, Result};

/// The transport's name.
pub(crate) const NAME: &str = "rdma";
/// Version of the key handle format.
const HANDLE_VERSION: u16 = 1;
/// Attempts at an RDMA operation the target refused before it fails with
/// `Error::Access`: the refusal of another operation's key may cancel it
/// too, so a refusal is believed the second time. (Operations cancelled
/// because the connection went down are posted again until it is back or
/// the peer is lost.)
const KEY_ATTEMPTS: u32 = 2;
/// How long the posts to a peer wait after its connection went down (the
/// provider tears it down after a refused key, and builds it again on the
/// next post).
const BACKOFF: Duration = Duration::from_millis(5);

/// Whether an error completion says the connection to the peer went down
/// (rather than the target refusing the operation).
fn connection_down(e: &ofi::CqErr) -> bool {
    const DOWN: [i32; 7] = [
        libc::EPIPE,
        libc::ECONNABORTED,
        libc::ECONNRESET,
        libc::ENOTCONN,
        libc::ETIMEDOUT,
        libc::ECONNREFUSED,
        libc::EHOSTUNREACH,
    ];
    DOWN.contains(&e.err) || DOWN.contains(&e.prov_errno)
}
/// While operations are in flight, the parked task looks at the queue at
/// least this often (a wake-up of the wait fd may come without a
/// completion, and manual-progress providers move data only when called).
const BUSY_WAIT: Duration = Duration::from_millis(2);
/// Most receive buffers posted.
const MAX_POSTED: usize = 4096;
/// Completion queue entries.
const CQ_SIZE: usize = 4 * MAX_POSTED;
/// Most operations posted at once (receives included): the rest wait in
/// order until completions make room, so the completion queue never
/// overflows.
const MAX_OPS: usize = CQ_SIZE / 2;

/// The NIC key of the region with id `id`, where the provider takes
/// requested keys: 64 bits of a hash of the 128-bit random id, so a key
/// with a forged id names no registration.
fn derived_key(id: &KeyId) -> u64 {
    // The last key derived on this thread: a stream of operations on one
    // region hashes its id once, not once per operation (a hash costs
    // about what the rest of posting a read does).
    thread_local! {
        static LAST: std::cell::Cell<Option<(KeyId, u64)>> = const { std::cell::Cell::new(None) };
    }
    if let Ok(Some((last, key))) = LAST.try_with(std::cell::Cell::get) {
        if last == *id {
            return key;
        }
    }
    let key = hash_key(id);
    let _ = LAST.try_with(|l| l.set(Some((*id, key))));
    key
}

/// [`derived_key`], computed.
fn hash_key(id: &KeyId) -> u64 {
    use sha2::Digest;
    let d = sha2::Sha256::new()
        .chain_update(b"async-btl rdma key")
        .chain_update(id)
        .finalize();
    let mut a = [0u8; 8];
    a.copy_from_slice(&d[..8]);
    u64::from_le_bytes(a)
}

/// Counters, read by `add_stats`.
#[derive(Default)]
struct Counters {
    writes: AtomicU64,
    reads: AtomicU64,
    rendezvous: AtomicU64,
    in_pieces: AtomicU64,
    credit_waits: AtomicU64,
    reposts: AtomicU64,
    foreign: AtomicU64,
    reg_failures: AtomicU64,
    unwatches: AtomicU64,
    bundles: AtomicU64,
    bundled: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A posted operation's context: stable storage the provider may use
/// (`FI_CONTEXT`/`FI_CONTEXT2` modes), and whose address names the
/// operation in its completion.
type Ctx = Box<[u64; 8]>;

fn new_ctx() -> Ctx {
    Box::new([0u64; 8])
}

/// Most contexts kept for reuse (`State::spare`).
const SPARE_CTXS: usize = 256;

fn ctx_ptr(c: &mut Ctx) -> *mut std::ffi::c_void {
    c.as_mut_ptr().cast()
}

/// Hashes the context addresses that key posted operations: a multiply
/// and a fold, not SipHash (whose flooding resistance buys nothing here:
/// the keys are our own heap addresses), on the path of every send and
/// receive, twice each.
#[derive(Default)]
struct CtxHasher(u64);

impl std::hash::Hasher for CtxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_usize(&mut self, n: usize) {
        // Context boxes are 64 bytes apart at least: the low bits carry
        // nothing, the fold brings the product's high bits down to where
        // the table picks its bucket.
        let h = ((n as u64) >> 6).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = h ^ (h >> 29);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Posted operations by context address.
type Ops = HashMap<usize, Op, std::hash::BuildHasherDefault<CtxHasher>>;

/// A posted operation, kept (with the memory it touches) until its
/// completion is read.
enum Op {
    /// A receive buffer: empty, the provider writing an eager frame into
    /// its spare capacity.
    Recv { buf: Vec<u8>, ctx: Ctx },
    /// A frame sent to `peer` (its body, if apart, in `body`).
    Send {
        peer: Rank,
        frame: Vec<u8>,
        body: Option<Bytes>,
        ctx: Ctx,
    },
    /// A put or get.
    Rma(RmaOp),
    /// The receiver's read of a rendezvous message.
    Fetch(FetchOp),
}

struct RmaOp {
    write: bool,
    peer: Rank,
    /// Keeps the local memory (and its registration) alive.
    region: Arc<RegionInner>,
    offset: u64,
    len: usize,
    raddr: u64,
    rkey: u64,
    done: Done,
    attempts: u32,
    ctx: Ctx,
}

struct FetchOp {
    peer: Rank,
    seq: u32,
    kind: Kind,
    tag: u64,
    buf: Vec<u8>,
    rts: wire::Rts,
    attempts: u32,
    ctx: Ctx,
}

/// A frame waiting to be posted.
struct Out {
    frame: Vec<u8>,
    /// The body, sent from where it lies after `frame` (the header).
    body: Option<Bytes>,
    /// Uses a credit (and has its sequence number).
    sequenced: bool,
    /// Completes when posted (eager sends).
    done: Option<Arc<Completion>>,
}

/// A message on its way out of a progress call to the core: sender,
/// kind, tag, bytes.
type Delivery = (Rank, Kind, u64, Data);

/// The bytes of a message on its way to the core.
enum Data {
    /// In a buffer of their own.
    Own(Bytes),
    /// Still in the receive buffer they arrived in (the body is `at..`): a
    /// small user message (or, `many`, a bundle's entries), copied from
    /// there once, into its receiver's buffer if one waits; the buffer is
    /// then posted again.
    Frame {
        buf: Vec<u8>,
        ctx: Ctx,
        at: usize,
        many: bool,
    },
}

/// What one progress call at a time keeps between calls (under `turn`).
#[derive(Default)]
struct Turn {
    /// The messages a call delivers, kept for its capacity.
    out: Vec<Delivery>,
    /// Receive buffers whose messages were delivered from them, to be
    /// posted again by the next call.
    spent: Vec<(Vec<u8>, Ctx)>,
    /// Buffers wait in `State::returned` for the next call to post them.
    returned: bool,
    /// Where completions are read into.
    cqe: [Cqe; 32],
}

/// A sequenced frame that arrived, in its peer's order.
enum In {
    Ready(Kind, u64, Bytes),
    /// A piece of a message; the pieces that follow it, in the next
    /// sequence numbers, end with a `Ready`.
    Piece(Kind, u64, Bytes),
    /// A rendezvous message not yet read.
    Announced(Kind, u64, wire::Rts),
    /// A rendezvous message being read.
    Reading,
    /// A rendezvous message read (its bytes count in `PeerState::ahead`).
    Fetched(Kind, u64, Bytes),
    /// A bundle's entries (user messages of one tag), checked.
    Bundle(u64, Bytes),
}

/// Eager buffers a message may be sent in, as pieces, before it goes by
/// rendezvous instead. A read rendezvous costs two more one-way trips
/// (the read's request and its data) and a `Fin`; pieces cost one trip
/// and the receiver's copy of them into one buffer. Two pieces win (on
/// `tcp;ofi_rxm` at 16 KiB eager, a 16 KiB message takes 0.63x the time
/// and streams 1.45x as fast as by rendezvous; with its default 64 KiB
/// frames, a 128 KiB message 0.72x and 1.38x); three and four lose to one
/// read of the whole (32-48 KiB streams at 0.65-0.8x).
const PIECES: usize = 2;

/// A message in pieces at the front of a peer's arrivals.
enum Pieces {
    /// All its `n` pieces are in: `len` bytes in all.
    Whole {
        kind: Kind,
        tag: u64,
        n: u32,
        len: usize,
    },
    /// A piece is still to come.
    Incomplete,
    /// The peer broke the protocol.
    Bad(String),
}

/// The message in pieces starting at `ps.expect`, as far as it arrived;
/// longer than `window` frames, it can never be complete.
fn pieces(ps: &PeerState, window: u32) -> Pieces {
    let mut at = ps.expect;
    let mut len = 0usize;
    let mut first: Option<(Kind, u64)> = None;
    for n in 1..=window {
        let (kind, tag, d, last) = match ps.arrived.get(&at) {
            Some(In::Piece(k, t, d)) => (*k, *t, d, false),
            Some(In::Ready(k, t, d)) => (*k, *t, d, true),
            Some(_) => {
                return Pieces::Bad("it sent another frame inside a message in pieces".into())
            }
            None => return Pieces::Incomplete,
        };
        if *first.get_or_insert((kind, tag)) != (kind, tag) {
            return Pieces::Bad("the pieces of one message name different tags".into());
        }
        len = len.saturating_add(d.len());
        if last {
            return Pieces::Whole { kind, tag, n, len };
        }
        at = at.wrapping_add(1);
    }
    Pieces::Bad(format!("it sent a message in more than {window} pieces"))
}

/// An eager frame of header `h` and a copy of `data`: a small one in a
/// recycled buffer from `spare` (see [`recycle`]).
fn copied_frame(spare: &mut Vec<Vec<u8>>, h: Header, data: &[u8]) -> Vec<u8> {
    let len = wire::HEADER + data.len();
    let mut frame = if len <= SMALL_FRAME {
        spare
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(SMALL_FRAME))
    } else {
        Vec::with_capacity(len)
    };
    h.encode(&mut frame);
    frame.extend_from_slice(data);
    frame
}

/// The room a bundle's messages (`entries`, checked) ask of their tag's
/// budget: their bytes and, for every message after the first, the
/// bookkeeping `has_room` counts once per message.
fn bundle_room(entries: &[u8]) -> usize {
    let n = wire::entries(entries).count();
    entries.len() + crate::core::dispatch::MESSAGE_COST * n.saturating_sub(1)
}

/// Take `rank`'s next frame (`frame`, of body `body`) for delivery from its
/// receive buffer, by the progress call that read it: it is counted as
/// delivered and owed a credit, and its buffer is posted again by the next
/// call. Returns what `on_receive` hands its caller: sender, tag, where the
/// body starts, and whether it is a bundle's entries.
fn in_place(
    st: &mut State,
    rank: Rank,
    tag: u64,
    frame: &[u8],
    body: &[u8],
    many: bool,
) -> (Rank, u64, usize, bool) {
    st.deferred += 1;
    let ps = &mut st.peers[rank as usize];
    ps.expect = ps.expect.wrapping_add(1);
    ps.owed += 1;
    (
        rank,
        tag,
        body.as_ptr() as usize - frame.as_ptr() as usize,
        many,
    )
}

/// Frames up to this size (a header and a body up to [`SEND_IN_PLACE`])
/// are built in buffers kept for it: no allocation per small send.
const SMALL_FRAME: usize = wire::HEADER + SEND_IN_PLACE;

/// Small frames kept for reuse, at most.
const SPARE_FRAMES: usize = 256;

/// Keep the buffer of a sent frame for the next small one (`spare`) or the
/// next header sent before a body in place (`headers`), if it is one.
fn recycle(spare: &mut Vec<Vec<u8>>, headers: &mut Vec<Vec<u8>>, mut frame: Vec<u8>) {
    let keep = match frame.capacity() {
        SMALL_FRAME => spare,
        wire::HEADER => headers,
        _ => return,
    };
    if keep.len() < SPARE_FRAMES {
        frame.clear();
        keep.push(frame);
    }
}

/// User messages up to this size join a bundle (see [`RdmaTransport::bundle`]):
/// three of them fit the default eager frame.
const BUNDLE_MAX: usize = 4096;

/// Bundle frames kept for reuse, at most.
const SPARE_BUNDLES: usize = 16;

/// Small user messages to one peer and tag gathered into one `Bundle`
/// frame while a send to the peer is in flight (with credits in hand and
/// nothing queued when it opened).
struct Bundle {
    /// The frame: its header (sequence number still 0) and the entries.
    frame: Vec<u8>,
    tag: u64,
    count: u64,
}

/// An eager body at least this large is sent from where it lies, gathered
/// after its header, rather than copied into a frame.
const SEND_IN_PLACE: usize = 1024;

/// Receive buffers at most whose posting again waits for the next progress
/// call: the spare buffers each peer has beyond its credits in a full
/// receive cycle (see [`Cycle`]), so that a sender given its credits back
/// then always finds as many buffers posted.
const DEFERRED_MAX: usize = 4;

/// Receive buffers posted at first, and at least (while the full count,
/// every peer's credits and spares, is larger): a few, so that a message
/// lands in memory still in the cache from the last ones (posted receives
/// are taken in order, so the cycle of buffers is as long as the count:
/// at 16 KiB, 132 buffers are 2 MiB of cold memory per lap, and a 16 KiB
/// ping-pong takes about 1.1x as long as with 16). See [`RdmaTransport::fit_receives`].
const RECV_START: usize = 16;

/// Receive completions between two looks at whether the cycle of receive
/// buffers is longer than the flow needs.
const RECV_REVIEW: usize = 4096;

/// How many receive buffers to keep posted. A progress call that read half
/// the cycle's buffers or more doubles it, up to `full` (every peer's
/// credits and spares: a stream then always finds buffers posted, not the
/// provider's own, from which its frames would be copied once more);
/// every [`RECV_REVIEW`] receives, a cycle four times as long as the most
/// any call read is halved, down to [`RECV_START`]. A frame that finds no
/// buffer posted waits in the provider's memory until one is (its
/// sender's credits bound how many can): the cycle trades a copy at the
/// start of a burst for messages that land in memory still in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cycle {
    /// Buffers aimed at now.
    target: usize,
    /// The most it grows to.
    full: usize,
    /// The most receives one call read since the last review.
    peak: usize,
    /// Receives read since the last review.
    seen: usize,
}

impl Cycle {
    /// The cycle of a transport whose peers' credits and spares come to
    /// `full` buffers.
    fn new(full: usize) -> Cycle {
        Cycle {
            target: full.min(RECV_START),
            full,
            peak: 0,
            seen: 0,
        }
    }

    /// A progress call read `n` receive completions; whether the target
    /// grew.
    fn after_pass(&mut self, n: usize) -> bool {
        if n == 0 {
            return false;
        }
        if 2 * n >= self.target && self.target < self.full {
            self.target = (2 * self.target).min(self.full);
            (self.peak, self.seen) = (0, 0);
            return true;
        }
        self.peak = self.peak.max(n);
        self.seen += n;
        if self.seen >= RECV_REVIEW {
            let floor = self.full.min(RECV_START);
            if 4 * self.peak <= self.target && self.target > floor {
                self.target = (self.target / 2).max(floor);
            }
            (self.peak, self.seen) = (0, 0);
        }
        false
    }
}

/// An eager body at least this large keeps the buffer it arrived in
/// (another is posted in its place) rather than being copied out: the
/// copy costs more than taking a recycled buffer.
const KEEP_BUFFER: usize = 4096;

/// Bytes of rendezvous messages a receiver reads ahead of delivering them
/// (per sender): beyond it, a message is read only once those before it are
/// delivered, so a receiver that stops reading holds its senders back
/// instead of filling its memory.
const READ_AHEAD: usize = 8 << 20;

/// A rendezvous message of ours that a peer is to read.
struct Lent {
    /// Dropped first: the peer can no longer read the bytes.
    _mr: Mr,
    _data: Bytes,
    done: Arc<Completion>,
}

#[derive(Default)]
struct PeerState {
    credits: u32,
    /// Credits we owe the peer (its frames we delivered).
    owed: u32,
    next_seq: u32,
    queue: VecDeque<Out>,
    /// Control frames (credits, pings, fins): no credit, no order.
    ctrl: VecDeque<Vec<u8>>,
    expect: u32,
    arrived: BTreeMap<u32, In>,
    lent: HashMap<u64, Lent>,
    /// Sends posted and not completed.
    in_flight: usize,
    /// Bytes of rendezvous messages being read or read, not yet delivered.
    ahead: usize,
    /// RDMA writes and reads (puts, gets, rendezvous reads) posted and not
    /// completed.
    posted: usize,
    /// When a frame from the peer was last seen, and one to it last
    /// posted (or a keepalive queued), as of the last liveness check:
    /// `heard`/`sent` count frames on the path of each message (a clock
    /// read per message costs it), and the check stamps the time when they
    /// moved. `last_sent` is `None` until we first send the peer a frame.
    last_heard: Option<Instant>,
    last_sent: Option<Instant>,
    heard: u64,
    heard_seen: u64,
    sent: u64,
    sent_seen: u64,
    /// Puts and gets the provider refused for now (EAGAIN), to post again.
    rma_retry: VecDeque<RmaOp>,
    fetch_retry: VecDeque<FetchOp>,
    /// Posts to the peer wait until then (its connection went down).
    backoff_until: Option<Instant>,
    /// It is in `State::attend`.
    attend: bool,
    /// Messages gathered to leave in one frame; closed (given its
    /// sequence number and queued) before any other sequenced frame to the
    /// peer is made, and by the next progress pass.
    bundle: Option<Bundle>,
}

impl PeerState {
    /// Whether something of the peer's waits on a later pass: frames held
    /// or being read, frames or operations to post, credits to return.
    fn waiting(&self, half: u32) -> bool {
        !self.arrived.is_empty()
            || !self.queue.is_empty()
            || !self.ctrl.is_empty()
            || !self.rma_retry.is_empty()
            || !self.fetch_retry.is_empty()
            || self.backoff_until.is_some()
            || self.bundle.is_some()
            || self.owed >= half
    }

    /// Close the open bundle: it takes the next sequence number and joins
    /// the queue, so nothing made after it overtakes it. Returns the
    /// messages it holds.
    fn seal(&mut self) -> u64 {
        let Some(mut b) = self.bundle.take() else {
            return 0;
        };
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        Header::set_seq(&mut b.frame, seq);
        self.queue.push_back(Out {
            frame: b.frame,
            body: None,
            sequenced: true,
            done: None,
        });
        b.count
    }
}

struct Peer {
    rank: Rank,
    addr: u64,
    lost: AtomicBool,
    lost_reason: OnceLock<String>,
    /// It said goodbye (closed its fabric in order).
    left: AtomicBool,
}

/// Everything under the transport's lock.
struct State {
    peers: Vec<PeerState>,
    /// Posted operations by context address.
    ops: Ops,
    next_cookie: u64,
    /// Receive buffers whose repost the provider refused for now.
    unposted: Vec<(Vec<u8>, Ctx)>,
    /// Receive buffers whose frames were taken, to be posted again at the
    /// start of the next progress call (see `on_completion`).
    returned: Vec<(Vec<u8>, Ctx)>,
    /// Receive buffers not posted again yet (`returned`, and those
    /// delivered from, `Turn::spent`): at most [`DEFERRED_MAX`].
    deferred: usize,
    /// Receive buffers in the cycle: posted, or on their way to being
    /// posted again.
    recv_bufs: usize,
    /// How many buffers the cycle aims at.
    cycle: Cycle,
    /// Receive completions the progress call under way read.
    recv_pass: usize,
    /// Peers to declare lost once the lock is released (found where
    /// `lose` cannot run).
    lose_later: Vec<(Rank, String)>,
    /// Contexts of completed operations, for the next ones
    /// ([`State::take_ctx`]).
    spare: Vec<Ctx>,
    /// Buffers of completed small frames, for the next ones.
    frames: Vec<Vec<u8>>,
    /// Buffers of completed header-only frames, for the next ones.
    headers: Vec<Vec<u8>>,
    /// Buffers of completed bundles, for the next ones.
    bundles: Vec<Vec<u8>>,
    /// Peers the next progress pass looks at (delivers in order, starts
    /// reads, posts what waits): those a completion concerned, and those
    /// with something still waiting (see [`PeerState::waiting`]). A pass
    /// over every peer is made only when `backlog` asks for it, so a
    /// message costs the same in a job of two ranks or of thousands.
    attend: Vec<Rank>,
    /// The list a pass works through, kept for its capacity.
    attending: Vec<Rank>,
}

impl State {
    /// A context for an operation about to be posted: a spare one (whose
    /// operation's completion was read) or a new one.
    fn take_ctx(&mut self) -> Ctx {
        self.spare.pop().unwrap_or_else(new_ctx)
    }

    /// Keep the context of an operation whose completion was read, for
    /// the next (a put or send then allocates none).
    fn give_ctx(&mut self, ctx: Ctx) {
        if self.spare.len() < SPARE_CTXS {
            self.spare.push(ctx);
        }
    }

    /// The state of a transport with `peers` ranks, nothing posted yet.
    fn new(peers: usize) -> State {
        State {
            peers: (0..peers).map(|_| PeerState::default()).collect(),
            ops: Ops::default(),
            next_cookie: 1,
            unposted: Vec::new(),
            returned: Vec::new(),
            deferred: 0,
            recv_bufs: 0,
            cycle: Cycle::new(0),
            recv_pass: 0,
            lose_later: Vec::new(),
            spare: Vec::new(),
            frames: Vec::new(),
            headers: Vec::new(),
            bundles: Vec::new(),
            attend: Vec::new(),
            attending: Vec::new(),
        }
    }

    /// Have the next pass look at peer `r`.
    fn attend(&mut self, r: Rank) {
        if let Some(ps) = self.peers.get_mut(r as usize) {
            if !ps.attend {
                ps.attend = true;
                self.attend.push(r);
            }
        }
    }
}

/// The completion queue's fd, for tokio: the endpoint owns it, and is
/// kept open by the `Arc` beside it for as long as tokio watches the fd.
struct WaitFd {
    fd: RawFd,
    _ep: Arc<Ep>,
}

impl AsRawFd for WaitFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

/// A watch of the wait fd taken out for one wait, put back when dropped.
struct Kept<'a> {
    slot: &'a Mutex<Option<AsyncFd<WaitFd>>>,
    fd: Option<AsyncFd<WaitFd>>,
}

impl Drop for Kept<'_> {
    fn drop(&mut self) {
        if let Some(fd) = self.fd.take() {
            *lock(self.slot) = Some(fd);
        }
    }
}

/// Have the current runtime watch `fd`, the wait fd of `ep`'s completion
/// queue, for reading, until the returned handle is dropped.
fn watch(fd: RawFd, ep: &Arc<Ep>) -> std::io::Result<AsyncFd<WaitFd>> {
    // SAFETY: the fd belongs to the endpoint, which `WaitFd` keeps open
    // (it holds an `Arc` of it) for the whole life of the `AsyncFd`;
    // libfabric never closes or replaces a completion queue's wait fd
    // before the queue itself is closed.
    unsafe {
        AsyncFd::register_with_interest(
            WaitFd {
                fd,
                _ep: ep.clone(),
            },
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(Into::into)
}

/// Which providers the transport takes without being told, best first;
/// and why it passes over the others.
fn preference(name: &str) -> std::result::Result<u32, &'static str> {
    let core = name.split(';').next().unwrap_or(name);
    match core {
        "verbs" => Ok(0),
        "efa" => Ok(1),
        "cxi" | "opx" | "psm3" | "psm2" => Ok(2),
        "tcp" if name == "tcp;ofi_rxm" => Ok(9),
        "shm" => Err("same-node peers use the sm transport"),
        "net" => Err("its wait fd stays readable after the first transfer (a busy loop when idle)"),
        "udp" => Err("its completion queue has no wait fd"),
        "sockets" => Err("slow (hundreds of microseconds a write); name it in BTL_RDMA_PROVIDER to use it anyway"),
        _ => Err("not known to work here; name it in BTL_RDMA_PROVIDER to try it"),
    }
}

/// A provider found, with its rank in the preference order or why it is
/// not used.
type Surveyed = (ofi::Provider, std::result::Result<u32, String>);

/// The providers libfabric offers here, each with whether it would be
/// chosen and why not: (name, domain, Ok(rank) or Err(why)).
pub(crate) fn survey(cfg: &RdmaConfig) -> std::result::Result<Vec<Surveyed>, String> {
    let all = ofi::providers(None, cfg.addr.as_deref(), cfg.start_frame())?;
    let mut seen = std::collections::HashSet::new();
    Ok(all
        .into_iter()
        .filter(|p| seen.insert((p.name.clone(), p.domain.clone())))
        .map(|p| {
            let verdict = match &cfg.provider {
                Some(want) if *want == p.name => Ok(0),
                Some(want) => Err(format!("BTL_RDMA_PROVIDER={want}")),
                None => preference(&p.name).map_err(str::to_string),
            };
            (p, verdict)
        })
        .collect())
}

/// The provider to open: the one named, else the best found.
fn choose(cfg: &RdmaConfig) -> std::result::Result<String, String> {
    let found = survey(cfg)?;
    found
        .iter()
        .filter_map(|(p, v)| v.as_ref().ok().map(|r| (*r, p.name.clone())))
        .min()
        .map(|(_, n)| n)
        .ok_or_else(|| {
            let why: Vec<String> = found
                .iter()
                .map(|(p, v)| format!("{}: {}", p.name, v.as_ref().err().map_or("", |s| s)))
                .collect();
            match &cfg.provider {
                Some(want) => format!("provider {want} not found (found: {})", why.join("; ")),
                None => format!("no usable provider ({})", why.join("; ")),
            }
        })
}

/// Host check for `btl-info`: the providers found, the one chosen (and
/// on which domain: the first libfabric lists, which `BTL_RDMA_ADDR`
/// picks), and why each other is not used.
pub(crate) fn probe() -> std::result::Result<String, String> {
    let cfg = crate::Config::from_env()
        .map(|c| c.rdma)
        .unwrap_or_default();
    let (maj, min) = ofi::version();
    let found = survey(&cfg).map_err(|e| format!("libfabric {maj}.{min}: {e}"))?;
    let chosen = choose(&cfg).ok();
    let mut parts = vec![format!("libfabric {maj}.{min}")];
    let mut names: Vec<&str> = Vec::new();
    for (p, _) in &found {
        if !names.contains(&p.name.as_str()) {
            names.push(&p.name);
        }
    }
    let domains = |n: &str| -> String {
        found
            .iter()
            .filter(|(p, _)| p.name == n)
            .map(|(p, _)| p.domain.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(c) = &chosen {
        parts.push(format!("chosen: {c} on {}", domains(c)));
    }
    let mut unused = Vec::new();
    for n in &names {
        if chosen.as_deref() == Some(*n) {
            continue;
        }
        let why = found
            .iter()
            .find(|(p, _)| p.name == *n)
            .map(|(_, v)| match v {
                Ok(_) => "usable, ranked lower".to_string(),
                Err(why) => why.clone(),
            })
            .unwrap_or_default();
        unused.push(format!("{n} ({why})"));
    }
    if !unused.is_empty() {
        parts.push(format!("not used: {}", unused.join(", ")));
    }
    match chosen {
        Some(_) => Ok(parts.join("; ")),
        None => Err(parts.join("; ")),
    }
}

/// The `rdma` transport of one process.
pub(crate) struct RdmaTransport {
    core: Arc<Core>,
    config: RdmaConfig,
    /// The eager frame in use, chosen at open from `config.eager` (or the
    /// provider's default) and rxm's limit: the size of every receive
    /// buffer posted, and of the largest frame sent. (`config.eager` is
    /// left as the user set it.)
    eager: usize,
    ep: Arc<Ep>,
    /// The completion queue's wait fd (see `wait`).
    wait_fd: RawFd,
    /// The runtime's watch of it, kept between parks while the progress
    /// task parks often, dropped by a stream that runs long without one.
    watched: Mutex<Option<AsyncFd<WaitFd>>>,
    /// The progress task parked since the last liveness check.
    parked: AtomicBool,
    /// A progress call found completions since the last liveness check
    /// (with no park: a stream, see `wait`).
    found: AtomicBool,
    /// Watching the fd failed once (later failures are not warned of).
    watch_failed: AtomicBool,
    me: RdmaAddr,
    job: u64,
    /// Remote addresses are virtual addresses (`FI_MR_VIRT_ADDR`).
    virt_addr: bool,
    /// The provider gathers a send from two pieces of memory (eager
    /// bodies then go without a copy into the frame).
    gather: bool,
    /// The provider picks keys (`FI_MR_PROV_KEY`).
    prov_key: bool,
    /// Peers by rank.
    peers: OnceLock<Vec<Option<Arc<Peer>>>>,
    /// Peers by provider address, sorted by address (a binary search per
    /// received frame: cheaper than hashing it).
    by_addr: OnceLock<Vec<(u64, Rank)>>,
    st: Mutex<State>,
    /// One progress call at a time: deliveries leave in order.
    turn: Mutex<Turn>,
    counters: Counters,
    armed: AtomicBool,
    kick: Notify,
    /// The next poll takes the slow path and looks at every peer:
    /// something waits to be posted again (the provider said EAGAIN), the
    /// driver is about to park, or a receiver made room for frames held in
    /// their peers' arrivals (the dispatcher raises it: `Core::on_room`).
    backlog: Arc<AtomicBool>,
    /// A bundle was opened: the next poll takes the slow path, which
    /// closes and posts it.
    bundling: AtomicBool,
}

impl RdmaTransport {
    /// Open the endpoint. Must run inside a tokio runtime.
    pub(crate) fn open(core: Arc<Core>) -> Result<Arc<RdmaTransport>> {
        let config = core.config().rdma.clone();
        let prov = choose(&config).map_err(|e| Error::Config(format!("rdma: {e}")))?;
        let mut eager = config
            .eager
            .unwrap_or_else(|| super::config::eager_for(&prov));
        if prov.contains("ofi_rxm") {
            // Frames rxm would not send eagerly take its slowest path:
            // keep them within its limit (which the user may have set
            // lower than ours, or which libfabric started with for
            // another provider).
            let limit = ofi::rxm_eager(config.start_frame());
            if limit < eager {
                tracing::debug!(
                    "rdma: eager frames of {} bytes, ofi_rxm's eager limit, not {eager}",
                    limit.max(super::config::MIN_EAGER),
                );
                eager = limit.max(super::config::MIN_EAGER);
            }
        }
        let ep = Ep::open(&prov, config.addr.as_deref(), CQ_SIZE)
            .map_err(|e| Error::Config(format!("rdma: {e}")))?;
        let c = ofi::consts();
        let mr_mode = ep.provider.mr_mode;
        let fd = ep
            .wait_fd()
            .map_err(|e| Error::Config(format!("rdma {prov}: {e}")))?;
        let ep = Arc::new(ep);
        // Checked here, so that a runtime that cannot watch the fd is a
        // clear error at open rather than a progress task that only ever
        // sleeps.
        let watched =
            watch(fd, &ep).map_err(|e| Error::os("rdma: watching the completion queue's fd", e))?;
        let name = ep.name().map_err(|e| Error::Config(format!("rdma: {e}")))?;
        let me = RdmaAddr {
            provider: prov.clone(),
            fabric: ep.provider.fabric.clone(),
            name,
            eager: eager as u32,
            credits: config.credits,
        };
        tracing::debug!(
            provider = %prov,
            domain = %ep.provider.domain,
            fabric = %ep.provider.fabric,
            "rdma: opened"
        );
        let size = core.size() as usize;
        // Raised by the dispatcher when a receiver makes room for frames
        // held in their peers' arrivals.
        let backlog = Arc::new(AtomicBool::new(false));
        core.on_room(backlog.clone());
        Ok(Arc::new(RdmaTransport {
            job: core.job_tag()[0] ^ core.job_tag()[1].rotate_left(29),
            virt_addr: mr_mode & c.mr_virt_addr != 0,
            gather: ep.provider.iov_limit >= 2,
            prov_key: mr_mode & c.mr_prov_key != 0,
            config,
            eager,
            ep,
            wait_fd: fd,
            me,
            core,
            peers: OnceLock::new(),
            by_addr: OnceLock::new(),
            st: Mutex::new(State::new(size)),
            turn: Mutex::new(Turn::default()),
            counters: Counters::default(),
            armed: AtomicBool::new(false),
            kick: Notify::new(),
            watched: Mutex::new(Some(watched)),
            parked: AtomicBool::new(false),
            found: AtomicBool::new(false),
            watch_failed: AtomicBool::new(false),
            backlog,
            bundling: AtomicBool::new(false),
        }))
    }

    fn peer(&self, rank: Rank) -> Option<&Arc<Peer>> {
        self.peers.get()?.get(rank as usize)?.as_ref()
    }

    fn peer_list(&self) -> impl Iterator<Item = &Arc<Peer>> {
        self.peers.get().into_iter().flatten().flatten()
    }

    /// Owed credits worth a frame of their own.
    fn half_credits(&self) -> u32 {
        (self.config.credits / 2).max(1)
    }

    fn lost_error(&self, p: &Peer) -> Error {
        Error::PeerLost {
            rank: p.rank,
            reason: p
                .lost_reason
                .get()
                .cloned()
                .unwrap_or_else(|| "it was lost".into()),
        }
    }

    fn check_alive(&self, p: &Peer) -> Result<()> {
        if self.core.is_closed() {
            Err(Error::Closed)
        } else if p.lost.load(Ordering::Acquire) {
            Err(self.lost_error(p))
        } else {
            Ok(())
        }
    }

    /// Post the first receive buffers: [`RECV_START`] of the full count
    /// for every peer's credits and spares, which the cycle grows to as
    /// the flow asks (`fit_receives`).
    fn post_receives(&self, peers: usize) {
        let full = (peers * (self.config.credits as usize + DEFERRED_MAX)).clamp(16, MAX_POSTED);
        let mut st = lock(&self.st);
        st.cycle = Cycle::new(full);
        let n = st.cycle.target;
        self.post_new(&mut st, n);
    }

    /// Add `n` new buffers to the receive cycle and post them.
    fn post_new(&self, st: &mut State, n: usize) {
        for _ in 0..n {
            let mut buf = self.core.buffers().take_exact(self.eager);
            // Written once now, so that the pages are there before the
            // provider copies into them: a freshly allocated buffer faults
            // its pages in on its first message (a 16 KiB message, five
            // faults), in the timed path of the first pass through the
            // posted buffers.
            buf.resize(self.eager, 0);
            st.recv_bufs += 1;
            self.repost(st, buf, new_ctx());
        }
    }

    /// After a progress call: fit the receive cycle to the receive
    /// completions it read (see [`Cycle`]), posting new buffers where it
    /// grew; where it shrank, buffers are not posted again as they come
    /// back (`repost`).
    fn fit_receives(&self, st: &mut State) {
        let n = std::mem::take(&mut st.recv_pass);
        if st.cycle.after_pass(n) {
            let more = st.cycle.target.saturating_sub(st.recv_bufs);
            self.post_new(st, more);
        }
    }

    /// Post a receive buffer (again), unless the cycle is longer than its
    /// target (then the buffer goes back to the pool).
    fn repost(&self, st: &mut State, mut buf: Vec<u8>, mut ctx: Ctx) {
        if st.recv_bufs > st.cycle.target {
            st.recv_bufs -= 1;
            self.core.buffers().give_back(buf);
            return;
        }
        buf.clear();
        let room = self.eager.min(buf.capacity());
        let p = ctx_ptr(&mut ctx);
        // SAFETY: the buffer (its heap allocation, `room` bytes of
        // capacity, which no Vec operation touches while it sits in
        // `st.ops`) and the context (boxed) move into `st.ops` and stay
        // there until the receive's completion is read; at shutdown they
        // go to the endpoint's graveyard, freed only after the endpoint is
        // closed.
        let r = unsafe {
            self.ep
                .post_recv(buf.as_mut_ptr(), room, std::ptr::null_mut(), p)
        };
        match r {
            Ok(()) => {
                st.ops.insert(p as usize, Op::Recv { buf, ctx });
            }
            Err(e) => {
                if let PostError::Other(code) = e {
                    tracing::debug!("rdma: posting a receive: {}", ofi::strerror(code));
                }
                st.unposted.push((buf, ctx));
                self.backlog.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Post `frame` (followed by `body`, if any) to `peer` now. `Err`:
    /// the provider refused it for now.
    fn post_frame(
        &self,
        st: &mut State,
        peer: &Peer,
        mut frame: Vec<u8>,
        body: Option<Bytes>,
    ) -> std::result::Result<(), (Vec<u8>, Option<Bytes>)> {
        let mut ctx = st.take_ctx();
        let ps = &mut st.peers[peer.rank as usize];
        Header::set_credits(&mut frame, ps.owed);
        let p = ctx_ptr(&mut ctx);
        // SAFETY: `frame` (a Vec whose heap buffer does not move when the
        // Vec does), `body` (a `Bytes`, whose bytes never move) and the
        // context go into `st.ops` until the send's completion is read (or
        // the endpoint's graveyard at shutdown).
        let r = unsafe {
            match &body {
                Some(b) => self.ep.post_sendv(&frame, b, peer.addr, p),
                None => self.ep.post_send(
                    frame.as_ptr(),
                    frame.len(),
                    std::ptr::null_mut(),
                    peer.addr,
                    p,
                ),
            }
        };
        match r {
            Ok(()) => {
                ps.owed = 0;
                ps.in_flight += 1;
                ps.sent = ps.sent.wrapping_add(1);
                st.ops.insert(
                    p as usize,
                    Op::Send {
                        peer: peer.rank,
                        frame,
                        body,
                        ctx,
                    },
                );
                Ok(())
            }
            Err(e) => {
                if let PostError::Other(code) = e {
                    tracing::debug!(
                        peer = peer.rank,
                        "rdma: posting a send: {}",
                        ofi::strerror(code)
                    );
                }
                // Refused: the provider holds no reference to it.
                st.give_ctx(ctx);
                Err((frame, body))
            }
        }
    }

    /// Post what waits for `peer`: control frames, then sequenced ones
    /// while credits last. Returns frames posted.
    fn push(&self, st: &mut State, peer: &Peer) -> usize {
        let mut n = 0;
        let r = peer.rank as usize;
        if let Some(t) = st.peers[r].backoff_until {
            if Instant::now() < t {
                self.backlog.store(true, Ordering::Relaxed);
                return 0;
            }
            st.peers[r].backoff_until = None;
        }
        self.seal(&mut st.peers[r]);
        while let Some(f) = st.peers[r].ctrl.pop_front() {
            if let Err((f, _)) = self.post_frame(st, peer, f, None) {
                st.peers[r].ctrl.push_front(f);
                self.backlog.store(true, Ordering::Relaxed);
                return n;
            }
            n += 1;
        }
        loop {
            let ps = &mut st.peers[r];
            let Some(front) = ps.queue.front() else { break };
            if front.sequenced && ps.credits == 0 {
                break;
            }
            let Some(out) = ps.queue.pop_front() else {
                break;
            };
            let sequenced = out.sequenced;
            match self.post_frame(st, peer, out.frame, out.body) {
                Ok(()) => {
                    if sequenced {
                        st.peers[r].credits -= 1;
                    }
                    if let Some(d) = out.done {
                        d.complete(Ok(()));
                    }
                    n += 1;
                }
                Err((frame, body)) => {
                    st.peers[r].queue.push_front(Out {
                        frame,
                        body,
                        sequenced,
                        done: out.done,
                    });
                    self.backlog.store(true, Ordering::Relaxed);
                    break;
                }
            }
        }
        // Retries of one-sided operations the provider refused for now.
        while let Some(op) = st.peers[r].rma_retry.pop_front() {
            if let Err(op) = self.post_rma(st, op) {
                st.peers[r].rma_retry.push_front(op);
                self.backlog.store(true, Ordering::Relaxed);
                break;
            }
            n += 1;
        }
        while let Some(op) = st.peers[r].fetch_retry.pop_front() {
            if let Err(op) = self.post_fetch(st, op) {
                st.peers[r].fetch_retry.push_front(op);
                self.backlog.store(true, Ordering::Relaxed);
                break;
            }
            n += 1;
        }
        n
    }

    /// A header for a frame to `peer` (its sequence number taken when
    /// `typ` is sequenced).
    fn header(&self, ps: &mut PeerState, typ: Type, kind: Kind, tag: u64) -> Header {
        if typ.sequenced() {
            self.seal(ps);
        }
        let seq = if typ.sequenced() {
            let s = ps.next_seq;
            ps.next_seq = ps.next_seq.wrapping_add(1);
            s
        } else {
            0
        };
        Header {
            typ,
            kind: kind as u8,
            credits: 0,
            src: self.core.rank(),
            seq,
            tag,
            job: self.job,
        }
    }

    /// Close `ps`'s open bundle, if any (see [`PeerState::seal`]).
    fn seal(&self, ps: &mut PeerState) {
        let n = ps.seal();
        if n > 0 {
            bump(&self.counters.bundles);
            self.counters.bundled.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Add a user message to the bundle open for peer `r`, or open one for
    /// it, where it gains: bundling is on, the message is small, and a
    /// send to the peer is still in flight. A message that finds nothing in
    /// flight returns `false` and leaves on its own, at once; so does one
    /// that finds frames queued or no credits and no bundle open (it waits
    /// in the queue, its future pending: a receiver that does not return
    /// credits holds its sender back, and at most one bundle per peer is
    /// ever open). The bundle leaves at the next progress pass (or
    /// earlier, when full, or when another message to the peer does not
    /// join it). Returns whether the message was taken.
    fn bundle(&self, st: &mut State, r: usize, tag: u64, data: &[u8]) -> bool {
        if !self.config.bundle || data.len() > BUNDLE_MAX {
            return false;
        }
        let cap = self.eager;
        let ps = &mut st.peers[r];
        if let Some(b) = &mut ps.bundle {
            if b.tag == tag && b.frame.len() + wire::ENTRY + data.len() <= cap {
                wire::push_entry(&mut b.frame, data);
                b.count += 1;
                return true;
            }
            // Another tag, or full: it leaves first.
            self.seal(ps);
        }
        let opens =
            ps.in_flight > 0 && ps.queue.is_empty() && ps.credits > 0 && ps.backoff_until.is_none();
        if !opens || wire::HEADER + wire::ENTRY + data.len() > cap {
            return false;
        }
        let mut frame = st.bundles.pop().unwrap_or_else(|| Vec::with_capacity(cap));
        frame.clear();
        Header {
            typ: Type::Bundle,
            kind: Kind::User as u8,
            credits: 0,
            src: self.core.rank(),
            seq: 0,
            tag,
            job: self.job,
        }
        .encode(&mut frame);
        wire::push_entry(&mut frame, data);
        st.peers[r].bundle = Some(Bundle {
            frame,
            tag,
            count: 1,
        });
        st.attend(r as Rank);
        self.bundling.store(true, Ordering::Relaxed);
        if self.armed.load(Ordering::SeqCst) {
            // A parked driver would send it only at its next wake-up.
            self.kick.notify_one();
        }
        true
    }

    /// Queue a message (eager or rendezvous) to `peer` and post what can
    /// go. Returns the completion to wait for, if the message is not yet
    /// handed over.
    fn send_message(
        &self,
        peer: &Peer,
        kind: Kind,
        tag: u64,
        data: Bytes,
    ) -> Result<Option<Arc<Completion>>> {
        let eager = data.len() + wire::HEADER <= self.eager;
        if eager {
            let mut st = lock(&self.st);
            self.check_alive(peer)?;
            if kind == Kind::User && self.bundle(&mut st, peer.rank as usize, tag, &data) {
                return Ok(None);
            }
            let State {
                peers,
                frames,
                headers,
                ..
            } = &mut *st;
            let ps = &mut peers[peer.rank as usize];
            let h = self.header(ps, Type::Eager, kind, tag);
            let (mut frame, mut body) = self.frame(frames, headers, h, data);
            let free = ps.queue.is_empty() && ps.credits > 0 && ps.backoff_until.is_none();
            if free {
                // Nothing ahead of it and a credit in hand: post it now,
                // with no completion to wait on.
                match self.post_frame(&mut st, peer, frame, body) {
                    Ok(()) => {
                        st.peers[peer.rank as usize].credits -= 1;
                        return Ok(None);
                    }
                    Err((f, b)) => (frame, body) = (f, b),
                }
            }
            let ps = &mut st.peers[peer.rank as usize];
            let done = Completion::new();
            ps.queue.push_back(Out {
                frame,
                body,
                sequenced: true,
                done: Some(done.clone()),
            });
            if ps.queue.len() > 1 || ps.credits == 0 {
                bump(&self.counters.credit_waits);
            }
            self.push(&mut st, peer);
            return Ok((!done.is_done()).then_some(done));
        }
        if let Some(n) = self.pieces_for(data.len()) {
            // In pieces: consecutive eager frames, all but the last of
            // type `Part`, posted as credits allow; the send completes
            // when the last is posted.
            let mut st = lock(&self.st);
            self.check_alive(peer)?;
            bump(&self.counters.in_pieces);
            let piece = data.len().div_ceil(n);
            let count = data.len().div_ceil(piece);
            let State {
                peers,
                frames,
                headers,
                ..
            } = &mut *st;
            let ps = &mut peers[peer.rank as usize];
            if !ps.queue.is_empty() || ps.credits < count as u32 {
                bump(&self.counters.credit_waits);
            }
            let done = Completion::new();
            for i in 0..count {
                let last = i + 1 == count;
                let typ = if last { Type::Eager } else { Type::Part };
                let chunk = data.slice(i * piece..data.len().min((i + 1) * piece));
                let h = self.header(ps, typ, kind, tag);
                let (frame, body) = self.frame(frames, headers, h, chunk);
                ps.queue.push_back(Out {
                    frame,
                    body,
                    sequenced: true,
                    done: last.then(|| done.clone()),
                });
            }
            self.push(&mut st, peer);
            return Ok((!done.is_done()).then_some(done));
        }
        // Rendezvous: the peer reads the message from where it is.
        let mut st = lock(&self.st);
        self.check_alive(peer)?;
        let key = if self.prov_key {
            0
        } else {
            u64::from_le_bytes(crate::sys::os::random_bytes::<8>())
        };
        // SAFETY: `data` is kept beside the registration in `Lent` (the
        // registration is dropped first), so the bytes stay allocated
        // while it exists; the provider only reads them.
        let mr = unsafe { Mr::register(&self.ep, data.as_ptr().cast_mut(), data.len(), key) }
            .map_err(|code| Error::Exhausted {
                what: format!(
                    "rdma: registering a {}-byte message for the peer to read: {}",
                    data.len(),
                    ofi::strerror(code)
                ),
                hint: "raise the locked-memory limit (ulimit -l), or send smaller messages".into(),
            })?;
        bump(&self.counters.rendezvous);
        let cookie = st.next_cookie;
        st.next_cookie += 1;
        let rts = wire::Rts {
            len: data.len() as u64,
            addr: if self.virt_addr {
                data.as_ptr() as u64
            } else {
                0
            },
            key: mr.key,
            cookie,
        };
        let ps = &mut st.peers[peer.rank as usize];
        let mut frame = Vec::with_capacity(wire::HEADER + wire::RTS_BODY);
        self.header(ps, Type::Rts, kind, tag).encode(&mut frame);
        rts.encode(&mut frame);
        let done = Completion::new();
        ps.lent.insert(
            cookie,
            Lent {
                _mr: mr,
                _data: data,
                done: done.clone(),
            },
        );
        ps.queue.push_back(Out {
            frame,
            body: None,
            sequenced: true,
            done: None,
        });
        self.push(&mut st, peer);
        Ok(Some(done))
    }

    /// Post a put or get. `Err(op)`: refused for now.
    fn post_rma(&self, st: &mut State, mut op: RmaOp) -> std::result::Result<(), RmaOp> {
        if st.ops.len() >= MAX_OPS {
            return Err(op);
        }
        let Some(peer) = self.peer(op.peer).cloned() else {
            op.done
                .complete(Err(Error::Misuse("rdma: no such peer".into())));
            return Ok(());
        };
        let desc = op
            .region
            .nic(NAME)
            .and_then(|r| r.downcast_ref::<Mr>())
            .map_or(std::ptr::null_mut(), |m| m.desc());
        let raw = op.region.raw();
        let p = ctx_ptr(&mut op.ctx);
        // SAFETY: `op.region` keeps the local memory `raw` (checked by the
        // caller to hold `offset..offset+len`) allocated, and the context
        // boxed, while `op` sits in `st.ops` until the completion is read
        // (or in the endpoint's graveyard after shutdown).
        let r = unsafe {
            let buf = (raw.addr() as *mut u8).add(op.offset as usize);
            self.ep
                .post_rma(op.write, buf, op.len, desc, peer.addr, op.raddr, op.rkey, p)
        };
        match r {
            Ok(()) => {
                st.peers[op.peer as usize].posted += 1;
                st.ops.insert(p as usize, Op::Rma(op));
                Ok(())
            }
            Err(PostError::Again) => Err(op),
            Err(PostError::Other(code)) => {
                op.done.complete(Err(Error::Os {
                    context: format!(
                        "rdma: posting an RDMA {}",
                        if op.write { "write" } else { "read" }
                    ),
                    source: std::io::Error::other(ofi::strerror(code)),
                }));
                Ok(())
            }
        }
    }

    /// Post the read of a rendezvous message. `Err(op)`: refused for now.
    fn post_fetch(&self, st: &mut State, mut op: FetchOp) -> std::result::Result<(), FetchOp> {
        if st.ops.len() >= MAX_OPS {
            return Err(op);
        }
        let Some(peer) = self.peer(op.peer).cloned() else {
            return Ok(());
        };
        let desc = std::ptr::null_mut();
        let p = ctx_ptr(&mut op.ctx);
        // SAFETY: `op.buf` is empty with room for at least `rts.len` bytes
        // (`start_reads` reserved them), heap memory that does not move
        // with the Vec; it and the context stay in `st.ops` until the
        // completion is read.
        let r = unsafe {
            self.ep.post_rma(
                false,
                op.buf.as_mut_ptr(),
                op.rts.len as usize,
                desc,
                peer.addr,
                op.rts.addr,
                op.rts.key,
                p,
            )
        };
        match r {
            Ok(()) => {
                st.peers[op.peer as usize].posted += 1;
                st.ops.insert(p as usize, Op::Fetch(op));
                Ok(())
            }
            Err(PostError::Again) => Err(op),
            Err(PostError::Other(code)) => {
                // The message cannot be read, and everything after it from
                // this peer waits behind it: the peer is lost (by the next
                // progress call, outside the lock), never left hanging.
                self.backlog.store(true, Ordering::Relaxed);
                st.lose_later.push((
                    op.peer,
                    format!(
                        "its rendezvous message could not be read: {}",
                        ofi::strerror(code)
                    ),
                ));
                Ok(())
            }
        }
    }

    /// Handle one frame received into `frame` from address `src`. A large
    /// eager body keeps the buffer (taken, leaving `frame` without
    /// capacity) instead of being copied out. A whole message that is the
    /// next one expected, with none waiting before it, goes to `out` at
    /// once; others wait in their peer's arrivals for [`Self::deliver`].
    /// A small user message going out at once is left in `frame` for the
    /// caller to deliver from: `Some` (sender, tag, where its body starts).
    fn on_receive(
        &self,
        st: &mut State,
        src: u64,
        frame: &mut Vec<u8>,
        out: &mut Vec<Delivery>,
        lost: &mut Vec<(Rank, String, Loss)>,
    ) -> Option<(Rank, u64, usize, bool)> {
        let rank = self.by_addr.get().and_then(|m| {
            m.binary_search_by_key(&src, |&(a, _)| a)
                .ok()
                .map(|i| m[i].1)
        });
        let Some(rank) = rank else {
            bump(&self.counters.foreign);
            tracing::debug!("rdma: dropped a message from an address not in this job");
            return None;
        };
        let (h, body) = match wire::decode(frame.as_slice()) {
            Ok(x) => x,
            Err(e) => {
                bump(&self.counters.foreign);
                tracing::warn!(peer = rank, "rdma: dropped a malformed frame: {e}");
                return None;
            }
        };
        if h.job != self.job || h.src != rank {
            bump(&self.counters.foreign);
            tracing::warn!(peer = rank, "rdma: dropped a frame of another job or rank");
            return None;
        }
        let credits = self.config.credits;
        st.attend(rank);
        let ps = &mut st.peers[rank as usize];
        ps.heard = ps.heard.wrapping_add(1);
        ps.credits = ps.credits.saturating_add(h.credits).min(credits);
        let kind = if h.typ.sequenced() {
            match Kind::from_u8(h.kind) {
                Some(k) => Some(k),
                None => {
                    bump(&self.counters.foreign);
                    lost.push((
                        rank,
                        format!("it sent a frame of unknown kind {}", h.kind),
                        Loss::Misbehaved,
                    ));
                    return None;
                }
            }
        } else {
            None
        };
        if let Some(kind) = kind {
            // Duplicates (a send the provider reported cancelled that had
            // arrived after all) are dropped; a frame beyond the credit
            // window breaks the protocol.
            let ahead = h.seq.wrapping_sub(ps.expect);
            if ahead >= u32::MAX / 2 || ps.arrived.contains_key(&h.seq) {
                return None;
            }
            if ahead >= 2 * credits {
                lost.push((
                    rank,
                    format!("it sent frame {} while {} was next", h.seq, ps.expect),
                    Loss::Misbehaved,
                ));
                return None;
            }
            match body {
                Body::Eager(data) | Body::Part(data) => {
                    let piece = matches!(body, Body::Part(_));
                    let next = ahead == 0 && ps.arrived.is_empty() && !piece;
                    // The posted buffer becomes the message's (it is at
                    // most twice the message, as a pooled one would be).
                    let keeps = data.len() >= KEEP_BUFFER && 2 * data.len() >= frame.capacity();
                    if next
                        && kind == Kind::User
                        && !keeps
                        && st.deferred < DEFERRED_MAX
                        && self.core.has_room(h.tag, data.len())
                    {
                        // In order with nothing before it, and copied out
                        // anyway: the caller delivers it from the receive
                        // buffer, posted again by the next progress call.
                        return Some(in_place(st, rank, h.tag, frame, data, false));
                    }
                    let b = if keeps {
                        // The posted buffer becomes the message's (it is at
                        // most twice the message, as a pooled one would be).
                        let buf = std::mem::take(frame);
                        self.core.buffers().freeze(buf).slice(wire::HEADER..)
                    } else {
                        let mut v = self.core.buffers().take(data.len());
                        v.extend_from_slice(data);
                        self.core.buffers().freeze(v)
                    };
                    if piece {
                        ps.arrived.insert(h.seq, In::Piece(kind, h.tag, b));
                    } else if next
                        && kind != Kind::Bye
                        && (kind != Kind::User || self.core.has_room(h.tag, b.len()))
                    {
                        // In order with nothing before it: what `deliver`
                        // would do, without the round trip through the map.
                        out.push((rank, kind, h.tag, Data::Own(b)));
                        ps.expect = ps.expect.wrapping_add(1);
                        ps.owed += 1;
                    } else {
                        ps.arrived.insert(h.seq, In::Ready(kind, h.tag, b));
                    }
                }
                Body::Bundle(entries) => {
                    if kind != Kind::User {
                        bump(&self.counters.foreign);
                        lost.push((
                            rank,
                            format!("it bundled messages of kind {kind:?}"),
                            Loss::Misbehaved,
                        ));
                        return None;
                    }
                    let next = ahead == 0 && ps.arrived.is_empty();
                    if next
                        && st.deferred < DEFERRED_MAX
                        && self.core.has_room(h.tag, bundle_room(entries))
                    {
                        // As a small message: delivered from the receive
                        // buffer by the caller.
                        return Some(in_place(st, rank, h.tag, frame, entries, true));
                    }
                    let mut v = self.core.buffers().take(entries.len());
                    v.extend_from_slice(entries);
                    let b = self.core.buffers().freeze(v);
                    ps.arrived.insert(h.seq, In::Bundle(h.tag, b));
                }
                Body::Rts(rts) => {
                    let len = usize::try_from(rts.len).unwrap_or(usize::MAX);
                    if len > isize::MAX as usize / 2 {
                        lost.push((
                            rank,
                            format!("it announced a message of {len} bytes"),
                            Loss::Misbehaved,
                        ));
                        return None;
                    }
                    // Read when its turn comes (`start_reads`).
                    ps.arrived.insert(h.seq, In::Announced(kind, h.tag, rts));
                }
                _ => {}
            }
            return None;
        }
        if let Body::Fin { cookie } = body {
            match ps.lent.remove(&cookie) {
                Some(l) => {
                    let done = l.done.clone();
                    drop(l);
                    done.complete(Ok(()));
                }
                None => {
                    bump(&self.counters.foreign);
                    tracing::warn!(
                        peer = rank,
                        "rdma: a peer finished reading a message it was not lent"
                    );
                }
            }
        }
        None
    }

    /// Start reading announced rendezvous messages, in order, as far as
    /// [`READ_AHEAD`] and their tags' room allow (the first one waiting is
    /// read whatever its size, once its tag has room).
    fn start_reads(&self, st: &mut State, ranks: &[Rank]) {
        for p in ranks.iter().filter_map(|&r| self.peer(r)) {
            if p.lost.load(Ordering::Acquire) {
                continue;
            }
            let r = p.rank as usize;
            loop {
                let ps = &mut st.peers[r];
                let Some((&seq, kind, tag, rts)) = ps.arrived.iter().find_map(|(s, i)| match i {
                    In::Announced(k, t, rts) => Some((s, *k, *t, *rts)),
                    _ => None,
                }) else {
                    break;
                };
                let len = rts.len as usize;
                if ps.ahead > 0 && ps.ahead + len > READ_AHEAD {
                    break;
                }
                if kind == Kind::User && !self.core.has_room(tag, len) {
                    break;
                }
                ps.arrived.insert(seq, In::Reading);
                ps.ahead += len;
                // Room for `len` bytes, not initialised: the read fills them
                // (see the completion in `on_completion`).
                let mut buf = self.core.buffers().take(len);
                buf.reserve(len);
                let op = FetchOp {
                    peer: p.rank,
                    seq,
                    kind,
                    tag,
                    buf,
                    rts,
                    attempts: 0,
                    ctx: st.take_ctx(),
                };
                if let Err(op) = self.post_fetch(st, op) {
                    st.peers[r].fetch_retry.push_back(op);
                    self.backlog.store(true, Ordering::Relaxed);
                }
            }
        }
    }

    /// One pass over the peers in `st.attend`: deliver what is in order,
    /// start rendezvous reads, post what waits; those with something still
    /// waiting stay for the next pass. Returns the frames and operations
    /// posted.
    fn attend(&self, st: &mut State, out: &mut Vec<Delivery>) -> usize {
        // The list is swapped with the spare one (no allocation per pass
        // while peers keep waiting).
        let mut ranks = std::mem::take(&mut st.attending);
        std::mem::swap(&mut ranks, &mut st.attend);
        for &r in &ranks {
            st.peers[r as usize].attend = false;
        }
        self.deliver(st, out, &ranks);
        self.start_reads(st, &ranks);
        let mut work = 0;
        for p in ranks.iter().filter_map(|&r| self.peer(r)) {
            if !p.lost.load(Ordering::Acquire) {
                work += self.push(st, p);
            }
        }
        let half = self.half_credits();
        for &r in &ranks {
            let lost = self
                .peer(r)
                .map_or(true, |p| p.lost.load(Ordering::Acquire));
            if !lost && st.peers[r as usize].waiting(half) {
                st.attend(r);
            }
        }
        ranks.clear();
        st.attending = ranks;
        work
    }

    /// Move in-order frames of `ranks` to `out`, as far as their tags
    /// have room; return credits owed.
    fn deliver(&self, st: &mut State, out: &mut Vec<Delivery>, ranks: &[Rank]) {
        let half = self.half_credits();
        let window = 2 * self.config.credits;
        let mut bad = Vec::new();
        for p in ranks.iter().filter_map(|&r| self.peer(r)) {
            let r = p.rank as usize;
            let ps = &mut st.peers[r];
            loop {
                let (kind, tag, n, len) = match ps.arrived.get(&ps.expect) {
                    Some(In::Ready(k, t, d) | In::Fetched(k, t, d)) => (*k, *t, 1, d.len()),
                    Some(In::Bundle(t, d)) => (Kind::User, *t, 1, bundle_room(d)),
                    Some(In::Piece(..)) => match pieces(ps, window) {
                        Pieces::Whole { kind, tag, n, len } => (kind, tag, n, len),
                        Pieces::Incomplete => break,
                        Pieces::Bad(why) => {
                            bad.push((p.rank, why));
                            break;
                        }
                    },
                    _ => break,
                };
                if kind == Kind::User && !self.core.has_room(tag, len) {
                    break;
                }
                let data = match ps.arrived.remove(&ps.expect) {
                    Some(In::Ready(_, _, d)) => d,
                    Some(In::Fetched(_, _, d)) => {
                        ps.ahead = ps.ahead.saturating_sub(d.len());
                        d
                    }
                    Some(In::Piece(_, _, first)) => {
                        // One message again, in a buffer of its own.
                        let mut v = self.core.buffers().take(len);
                        v.extend_from_slice(&first);
                        for i in 1..n {
                            if let Some(In::Piece(_, _, d) | In::Ready(_, _, d)) =
                                ps.arrived.remove(&ps.expect.wrapping_add(i))
                            {
                                v.extend_from_slice(&d);
                            }
                        }
                        self.core.buffers().freeze(v)
                    }
                    Some(In::Bundle(_, d)) => {
                        // Its messages, each a slice of the one buffer.
                        for (at, len) in wire::entries(&d) {
                            out.push((p.rank, kind, tag, Data::Own(d.slice(at..at + len))));
                        }
                        ps.expect = ps.expect.wrapping_add(1);
                        ps.owed += 1;
                        continue;
                    }
                    // Not there: `get` just found it.
                    _ => break,
                };
                if kind == Kind::Bye {
                    // It closed in order: its silence from now on is
                    // no loss.
                    p.left.store(true, Ordering::Release);
                }
                out.push((p.rank, kind, tag, Data::Own(data)));
                ps.expect = ps.expect.wrapping_add(n);
                ps.owed += n;
            }
            // Returned in the next frame, unless none can leave soon (none
            // queued, or the queue waits for credits of the peer's: both
            // sides waiting on each other's credits would stall).
            if ps.owed >= half
                && ps.ctrl.is_empty()
                && ps.bundle.is_none()
                && (ps.queue.is_empty() || ps.credits == 0)
            {
                let f = wire::control(Type::Credit, self.core.rank(), self.job, 0, None);
                ps.ctrl.push_back(f);
            }
        }
        st.lose_later.extend(bad);
    }

    /// An eager frame of `h` and `data`: one buffer, or (a body worth not
    /// copying, and a provider that gathers) the header alone with the
    /// body sent from where it lies.
    fn frame(
        &self,
        spare: &mut Vec<Vec<u8>>,
        headers: &mut Vec<Vec<u8>>,
        h: Header,
        data: Bytes,
    ) -> (Vec<u8>, Option<Bytes>) {
        if self.gather && data.len() >= SEND_IN_PLACE {
            // The header alone, in a recycled header-sized buffer.
            let mut frame = headers
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(wire::HEADER));
            h.encode(&mut frame);
            return (frame, Some(data));
        }
        (copied_frame(spare, h, &data), None)
    }

    /// How many eager buffers a message of `len` bytes goes in as pieces,
    /// if it does: more than one, at most [`PIECES`], and at most half the
    /// credits (all its pieces must fit in the window, with the credits of
    /// what came before them still unreturned, or neither side could move).
    fn pieces_for(&self, len: usize) -> Option<usize> {
        let room = self.eager.checked_sub(wire::HEADER).filter(|r| *r > 0)?;
        let n = len.div_ceil(room);
        (n >= 2 && n <= PIECES && 2 * n <= self.config.credits as usize).then_some(n)
    }

    /// A completion: find its operation and finish it.
    /// Whether it did anything besides giving back a sent frame (see
    /// `progress`).
    fn on_completion(
        &self,
        st: &mut State,
        e: &Cqe,
        out: &mut Vec<Delivery>,
        lost: &mut Vec<(Rank, String, Loss)>,
    ) -> bool {
        let Some(op) = st.ops.remove(&e.ctx) else {
            return false;
        };
        match &op {
            Op::Rma(o) => st.peers[o.peer as usize].posted -= 1,
            Op::Fetch(o) => st.peers[o.peer as usize].posted -= 1,
            Op::Recv { .. } | Op::Send { .. } => {}
        }
        match op {
            Op::Recv { mut buf, ctx } => {
                st.recv_pass += 1;
                let n = (e.len as usize).min(self.eager.min(buf.capacity()));
                // SAFETY: the receive completed successfully: the provider
                // wrote the completion's `len` bytes at the start of the
                // buffer, posted with room for `eager.min(capacity)`.
                unsafe { buf.set_len(n) };
                if let Some((rank, tag, at, many)) = self.on_receive(st, e.src, &mut buf, out, lost)
                {
                    // A small user message (or a bundle of them),
                    // delivered from the buffer.
                    out.push((rank, Kind::User, tag, Data::Frame { buf, ctx, at, many }));
                    return true;
                }
                if buf.capacity() == 0 {
                    // The message kept the buffer: post another.
                    buf = self.core.buffers().take_exact(self.eager);
                }
                if st.deferred < DEFERRED_MAX {
                    // Posted again by the next progress call, not this one:
                    // the provider's receive call is then off the path from
                    // this message to its receiver (and to a reply).
                    st.deferred += 1;
                    st.returned.push((buf, ctx));
                } else {
                    self.repost(st, buf, ctx);
                }
                true
            }
            Op::Send {
                peer, ctx, frame, ..
            } => {
                let ps = &mut st.peers[peer as usize];
                ps.in_flight = ps.in_flight.saturating_sub(1);
                st.give_ctx(ctx);
                if frame.get(1) == Some(&(Type::Bundle as u8)) {
                    if st.bundles.len() < SPARE_BUNDLES {
                        st.bundles.push(frame);
                    }
                    return false;
                }
                let State {
                    frames, headers, ..
                } = st;
                recycle(frames, headers, frame);
                false
            }
            Op::Rma(mut op) => {
                bump(if op.write {
                    &self.counters.writes
                } else {
                    &self.counters.reads
                });
                op.done.complete(Ok(()));
                st.give_ctx(op.ctx);
                true
            }
            Op::Fetch(op) => {
                let FetchOp {
                    peer,
                    seq,
                    kind,
                    tag,
                    mut buf,
                    rts,
                    ctx,
                    ..
                } = op;
                // SAFETY: the read completed successfully: the provider
                // wrote all `rts.len` bytes into the buffer's first
                // `rts.len` bytes of capacity (`take` gave at least that
                // much room, and the read was posted for exactly that).
                unsafe { buf.set_len(rts.len as usize) };
                st.give_ctx(ctx);
                let ps = &mut st.peers[peer as usize];
                let data = self.core.buffers().freeze(buf);
                ps.arrived.insert(seq, In::Fetched(kind, tag, data));
                let fin = wire::control(Type::Fin, self.core.rank(), self.job, 0, Some(rts.cookie));
                ps.ctrl.push_back(fin);
                st.attend(peer);
                true
            }
        }
    }

    /// An error completion.
    fn on_error(&self, st: &mut State, e: &ofi::CqErr, lost: &mut Vec<(Rank, String, Loss)>) {
        let Some(op) = st.ops.remove(&(e.ctx as usize)) else {
            return;
        };
        match &op {
            Op::Rma(o) => st.peers[o.peer as usize].posted -= 1,
            Op::Fetch(o) => st.peers[o.peer as usize].posted -= 1,
            Op::Recv { .. } | Op::Send { .. } => {}
        }
        let closing = self.core.is_closed();
        let down = connection_down(e);
        let peer_of = match &op {
            Op::Recv { .. } => None,
            Op::Send { peer, .. } => Some(*peer),
            Op::Rma(o) => Some(o.peer),
            Op::Fetch(o) => Some(o.peer),
        };
        if let Some(ps) = peer_of.and_then(|r| st.peers.get_mut(r as usize)) {
            // Whatever failed, the provider may have torn the connection
            // down: give it a moment before posting to the peer again.
            ps.backoff_until.get_or_insert(Instant::now() + BACKOFF);
        }
        let is_lost = |r: Rank| {
            self.peer(r)
                .map_or(true, |p| p.lost.load(Ordering::Acquire))
        };
        match op {
            Op::Recv { buf, ctx } => {
                if !closing {
                    self.repost(st, buf, ctx);
                } else {
                    st.unposted.push((buf, ctx));
                }
            }
            Op::Send {
                peer, frame, body, ..
            } => {
                let ps = &mut st.peers[peer as usize];
                ps.in_flight = ps.in_flight.saturating_sub(1);
                if !closing && !is_lost(peer) {
                    // Sent again (the receiver drops a copy that did
                    // arrive); it used its credit already.
                    bump(&self.counters.reposts);
                    let sequenced = wire::sequenced(&frame);
                    if sequenced {
                        ps.credits += 1;
                    }
                    ps.queue.push_front(Out {
                        frame,
                        body,
                        sequenced,
                        done: None,
                    });
                    self.backlog.store(true, Ordering::Relaxed);
                }
            }
            Op::Rma(mut op) => {
                if !down {
                    op.attempts += 1;
                }
                if is_lost(op.peer) {
                    let err = self
                        .peer(op.peer)
                        .map_or(Error::Closed, |p| self.lost_error(p));
                    op.done.complete(Err(err));
                } else if closing {
                    op.done.complete(Err(Error::Closed));
                } else if op.attempts < KEY_ATTEMPTS {
                    bump(&self.counters.reposts);
                    op.ctx = new_ctx();
                    st.peers[op.peer as usize].rma_retry.push_back(op);
                    self.backlog.store(true, Ordering::Relaxed);
                } else {
                    tracing::debug!(
                        peer = op.peer,
                        "rdma: an RDMA {} failed: {} (provider error {})",
                        if op.write { "write" } else { "read" },
                        ofi::strerror(e.err),
                        e.prov_errno
                    );
                    op.done
                        .complete(Err(Error::Access(AccessError::UnknownKey)));
                }
            }
            Op::Fetch(mut op) => {
                if !down {
                    op.attempts += 1;
                }
                if closing || is_lost(op.peer) {
                    return;
                }
                if op.attempts < KEY_ATTEMPTS {
                    bump(&self.counters.reposts);
                    op.ctx = new_ctx();
                    st.peers[op.peer as usize].fetch_retry.push_back(op);
                    self.backlog.store(true, Ordering::Relaxed);
                } else {
                    lost.push((
                        op.peer,
                        format!(
                            "its rendezvous message could not be read: {}",
                            ofi::strerror(e.err)
                        ),
                        Loss::Misbehaved,
                    ));
                }
            }
        }
    }

    /// Declare a peer lost: fail what waits on it, tell the core.
    fn lose(&self, rank: Rank, reason: &str, how: Loss) {
        let Some(peer) = self.peer(rank) else { return };
        let _ = peer.lost_reason.set(reason.to_string());
        if peer.lost.swap(true, Ordering::AcqRel) {
            return;
        }
        if how != Loss::Closed {
            tracing::warn!(peer = rank, "rdma peer lost: {reason}");
        }
        self.fail_peer(rank, &|| self.lost_error(peer));
        self.core.on_peer_lost(rank, reason, how);
    }

    /// Fail everything queued or posted towards `rank` with `err()`.
    fn fail_peer(&self, rank: Rank, err: &dyn Fn() -> Error) {
        let (queued, lent, rma) = {
            let mut st = lock(&self.st);
            let ps = &mut st.peers[rank as usize];
            ps.ctrl.clear();
            ps.bundle = None;
            let queued: Vec<Out> = ps.queue.drain(..).collect();
            // Messages lent to the peer: their registration is closed
            // before their bytes are freed, so a peer still running reads
            // nothing more of them.
            let lent: Vec<Lent> = ps.lent.drain().map(|(_, l)| l).collect();
            let rma: Vec<RmaOp> = ps.rma_retry.drain(..).collect();
            ps.fetch_retry.clear();
            ps.arrived.clear();
            ps.ahead = 0;
            // Posted puts and gets keep their memory until the provider
            // completes them; their futures fail now.
            for op in st.ops.values_mut() {
                if let Op::Rma(o) = op {
                    if o.peer == rank {
                        o.done.complete(Err(err()));
                    }
                }
            }
            (queued, lent, rma)
        };
        for o in queued {
            if let Some(d) = o.done {
                d.complete(Err(err()));
            }
        }
        for l in lent {
            l.done.complete(Err(err()));
        }
        for mut o in rma {
            o.done.complete(Err(err()));
        }
    }

    /// Keepalives and liveness of every peer.
    fn service(&self) {
        let now = Instant::now();
        let timeout = self.config.peer_timeout;
        let every = timeout / 4;
        let mut silent = Vec::new();
        {
            let mut st = lock(&self.st);
            for p in self.peer_list() {
                if p.lost.load(Ordering::Acquire) || p.left.load(Ordering::Acquire) {
                    continue;
                }
                let ps = &mut st.peers[p.rank as usize];
                if ps.heard != ps.heard_seen {
                    ps.heard_seen = ps.heard;
                    ps.last_heard = Some(now);
                }
                if ps.sent != ps.sent_seen {
                    ps.sent_seen = ps.sent;
                    ps.last_sent = Some(now);
                }
                let heard = *ps.last_heard.get_or_insert(now);
                if now.saturating_duration_since(heard) > timeout {
                    silent.push(p.rank);
                    continue;
                }
                // A keepalive is due a quarter timeout after our last frame
                // to the peer, and at once if we never sent it one: what we
                // hear from it says nothing about what it hears from us (a
                // rank that only puts and gets sends no frames at all).
                let due = ps
                    .last_sent
                    .map_or(true, |sent| now.saturating_duration_since(sent) >= every);
                if due && ps.ctrl.is_empty() {
                    ps.ctrl.push_back(wire::control(
                        Type::Ping,
                        self.core.rank(),
                        self.job,
                        0,
                        None,
                    ));
                    // Counted as sent when queued, so a peer that refuses
                    // posts (EAGAIN) does not queue a ping every pass.
                    ps.last_sent = Some(now);
                }
                self.push(&mut st, p);
            }
        }
        for r in silent {
            self.lose(
                r,
                &format!("nothing heard from it for {timeout:?} (BTL_RDMA_PEER_TIMEOUT_MS)"),
                Loss::Crashed,
            );
        }
    }

    /// Whether anything is posted besides receive buffers, or waits.
    fn busy(&self, st: &State) -> bool {
        self.backlog.load(Ordering::Relaxed)
            || st.peers.iter().any(|p| p.posted > 0 || p.in_flight > 0)
            || st
                .peers
                .iter()
                .any(|p| !p.queue.is_empty() || !p.ctrl.is_empty() || p.bundle.is_some())
    }

    fn counters(&self) -> crate::RdmaStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let c = &self.counters;
        crate::RdmaStats {
            writes: g(&c.writes),
            reads: g(&c.reads),
            rendezvous: g(&c.rendezvous),
            in_pieces: g(&c.in_pieces),
            credit_waits: g(&c.credit_waits),
            reposts: g(&c.reposts),
            foreign_messages: g(&c.foreign),
            registration_failures: g(&c.reg_failures),
            cq_unwatches: g(&c.unwatches),
            bundles: g(&c.bundles),
            bundled: g(&c.bundled),
        }
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        // Posted buffers stay allocated until the endpoint is closed.
        let st = std::mem::replace(&mut *lock(&self.st), State::new(0));
        self.ep
            .bury(Box::new(st.ops.into_values().collect::<Vec<Op>>()));
    }
}

/// The link to one peer.
struct RdmaLink {
    t: Arc<RdmaTransport>,
    peer: Arc<Peer>,
}

impl Link for RdmaLink {
    fn peer(&self) -> Rank {
        self.peer.rank
    }

    fn transport(&self) -> &'static str {
        NAME
    }

    fn try_send(&self, kind: Kind, tag: u64, data: &[u8]) -> Result<bool> {
        if data.len() + wire::HEADER > self.t.eager {
            return Ok(false);
        }
        let mut st = lock(&self.t.st);
        self.t.check_alive(&self.peer)?;
        let r = self.peer.rank as usize;
        if kind == Kind::User && self.t.bundle(&mut st, r, tag, data) {
            return Ok(true);
        }
        {
            let ps = &mut st.peers[r];
            // Nothing overtakes an open bundle: it goes to the queue, and
            // this message behind it (`submit`).
            self.t.seal(ps);
            if !ps.queue.is_empty() || ps.credits == 0 {
                return Ok(false);
            }
        }
        let h = self.t.header(&mut st.peers[r], Type::Eager, kind, tag);
        let frame = copied_frame(&mut st.frames, h, data);
        match self.t.post_frame(&mut st, &self.peer, frame, None) {
            Ok(()) => {
                st.peers[r].credits -= 1;
                Ok(true)
            }
            Err((frame, _)) => {
                // It has its sequence number: it must go, in order.
                st.peers[r].queue.push_back(Out {
                    frame,
                    body: None,
                    sequenced: true,
                    done: None,
                });
                self.t.backlog.store(true, Ordering::Relaxed);
                Ok(true)
            }
        }
    }

    fn submit(&self, kind: Kind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>> {
        self.t.send_message(&self.peer, kind, tag, data)
    }

    fn post(&self, op: OneSided<'_>, tally: Option<&Arc<Tally>>) -> Result<Native> {
        let (write, local, key, offset) = match op {
            OneSided::Put { src, key, offset } => (true, src, key, offset),
            OneSided::Get { dst, key, offset } => (false, dst, key, offset),
            OneSided::Atomic { .. } => return Ok(Native::Emulate),
        };
        let Some(h) = key.handle(NAME).filter(|h| h.version == HANDLE_VERSION) else {
            return Ok(Native::Emulate);
        };
        let Some(h) = Handle::decode(&h.data) else {
            return Ok(Native::Emulate);
        };
        let len = local.raw.len();
        if len == 0 {
            return Ok(Native::Done(0));
        }
        if len as u64 > self.t.ep.provider.max_msg {
            return Ok(Native::Emulate);
        }
        let end = offset.saturating_add(len as u64);
        if end > h.len {
            return Err(Error::Access(AccessError::OutOfBounds {
                offset,
                end,
                len: h.len,
            }));
        }
        self.t.check_alive(&self.peer)?;
        let rkey = if h.derived {
            derived_key(&key.id)
        } else {
            h.key
        };
        // An operation without a future is counted in the peer's tally:
        // no slot to allocate, track and sweep for each.
        let (done, answer) = match tally {
            Some(t) => (Done::Count(t.start()), Native::Counted),
            None => {
                let c = Completion::new();
                (Done::Slot(c.clone()), Native::Posted(c))
            }
        };
        let mut st = lock(&self.t.st);
        let op = RmaOp {
            write,
            peer: self.peer.rank,
            region: local.region.clone(),
            offset: local.offset,
            len,
            raddr: h.base.wrapping_add(offset),
            rkey,
            done,
            attempts: 0,
            ctx: st.take_ctx(),
        };
        if let Err(op) = self.t.post_rma(&mut st, op) {
            st.peers[self.peer.rank as usize].rma_retry.push_back(op);
            self.t.backlog.store(true, Ordering::Relaxed);
            if self.t.armed.load(Ordering::SeqCst) {
                self.t.kick.notify_one();
            }
        }
        Ok(answer)
    }

    fn has_queued(&self) -> bool {
        let st = lock(&self.t.st);
        st.peers
            .get(self.peer.rank as usize)
            .is_some_and(|p| !p.queue.is_empty() || p.bundle.is_some())
    }
}

#[async_trait]
impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn address(&self) -> Result<Vec<u8>> {
        postcard::to_allocvec(&self.me)
            .map_err(|e| Error::Bootstrap(format!("encoding our rdma address: {e}")))
    }

    fn reaches(&self, peer: &PeerInfo<'_>) -> Result<bool> {
        let a = decode_addr(peer.rank, peer.addr)?;
        // Not this rank: `self` carries its messages, and one-sided
        // operations on its own memory take the same target checks as
        // everyone else's, emulated.
        Ok(peer.rank != self.core.rank()
            && a.provider == self.me.provider
            && a.fabric == self.me.fabric)
    }

    fn connect(self: Arc<Self>, peers: &[PeerInfo<'_>]) -> Result<Vec<(Rank, Arc<dyn Link>)>> {
        let mut table: Vec<Option<Arc<Peer>>> = (0..self.core.size()).map(|_| None).collect();
        let mut by_addr = HashMap::new();
        let mut links: Vec<(Rank, Arc<dyn Link>)> = Vec::new();
        {
            let mut st = lock(&self.st);
            for p in peers {
                let a = decode_addr(p.rank, p.addr)?;
                // A sender fills the receiver's buffers by its own idea of
                // their size and number: the two must agree.
                if (a.eager, a.credits) != (self.me.eager, self.me.credits) {
                    return Err(Error::Config(format!(
                        "rdma: rank {} posts {} eager buffers of {} bytes per sender, this rank {} of {}: give every rank the same BTL_RDMA_EAGER, BTL_RDMA_CREDITS and FI_OFI_RXM_EAGER_LIMIT",
                        p.rank, a.credits, a.eager, self.me.credits, self.me.eager
                    )));
                }
                let addr = self
                    .ep
                    .insert(&a.name)
                    .map_err(|e| Error::Bootstrap(format!("rdma: rank {}: {e}", p.rank)))?;
                let peer = Arc::new(Peer {
                    rank: p.rank,
                    addr,
                    lost: AtomicBool::new(false),
                    lost_reason: OnceLock::new(),
                    left: AtomicBool::new(false),
                });
                if by_addr.insert(addr, p.rank).is_some() {
                    return Err(Error::Bootstrap(format!(
                        "rdma: two ranks published one address (rank {})",
                        p.rank
                    )));
                }
                let slot = table.get_mut(p.rank as usize).ok_or_else(|| {
                    Error::Bootstrap(format!("rdma peer rank {} out of range", p.rank))
                })?;
                *slot = Some(peer.clone());
                st.peers[p.rank as usize].credits = self.config.credits;
                links.push((
                    p.rank,
                    Arc::new(RdmaLink {
                        t: self.clone(),
                        peer,
                    }),
                ));
            }
        }
        self.peers
            .set(table)
            .map_err(|_| Error::Misuse("rdma transport connected twice".into()))?;
        let mut by_addr: Vec<(u64, Rank)> = by_addr.into_iter().collect();
        by_addr.sort_unstable();
        let _ = self.by_addr.set(by_addr);
        self.post_receives(peers.len());
        Ok(links)
    }

    fn add_stats(&self, s: &mut crate::Stats) {
        s.rdma = self.counters();
    }

    fn register_memory(&self, id: &KeyId, raw: RawBuf) -> Option<(KeyHandle, NicReg)> {
        if raw.len() == 0 {
            return None;
        }
        let requested = if self.prov_key { 0 } else { derived_key(id) };
        // SAFETY: the registration is kept in the region beside the
        // memory and dropped before it (`RegionInner::nic`), so `raw`
        // stays allocated while it exists.
        let mr = match unsafe {
            Mr::register(&self.ep, raw.addr() as *mut u8, raw.len(), requested)
        } {
            Ok(m) => m,
            Err(code) => {
                bump(&self.counters.reg_failures);
                tracing::warn!(
                    "rdma: registering a region of {} bytes failed ({}); peers reach it through this process instead",
                    raw.len(),
                    ofi::strerror(code)
                );
                return None;
            }
        };
        let h = Handle {
            key: mr.key,
            base: if self.virt_addr { raw.addr() as u64 } else { 0 },
            len: raw.len() as u64,
            derived: !self.prov_key && mr.key == requested,
        };
        Some((
            KeyHandle::new(NAME, HANDLE_VERSION, h.encode()),
            (NAME, Box::new(mr) as Box<dyn Any + Send + Sync>),
        ))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn progress(&self) -> usize {
        let Ok(mut guard) = self.turn.try_lock() else {
            return 0;
        };
        let turn = &mut *guard;
        // With no buffer to post again and nothing held back, a poll looks
        // at the completion queue alone, without the transport's lock: an
        // idle poll costs little more than the provider's, and a poller
        // spinning on an empty queue sees a completion that much sooner.
        let mut first = None;
        if turn.spent.is_empty()
            && !turn.returned
            && !self.backlog.load(Ordering::Relaxed)
            && !self.bundling.load(Ordering::Relaxed)
        {
            match self.ep.read_cq(&mut turn.cqe) {
                Read::Done(0) => return 0,
                r => first = Some(r),
            }
        }
        let mut work = 0;
        let mut out = std::mem::take(&mut turn.out);
        // Completions read, and of those the ones that did something a
        // waiter may look for (all but those of eager sends, which only
        // give back their buffers): a poller that sees only the latter's
        // work polls on instead of ending its turn.
        let mut seen = 0;
        let mut lost = Vec::new();
        {
            let mut st = lock(&self.st);
            if !st.returned.is_empty() {
                let mut back = std::mem::take(&mut st.returned);
                for (buf, ctx) in back.drain(..) {
                    self.repost(&mut st, buf, ctx);
                }
                // Its capacity, for the next ones.
                st.returned = back;
            }
            for (buf, ctx) in turn.spent.drain(..) {
                self.repost(&mut st, buf, ctx);
            }
            st.deferred = 0;
            for _ in 0..4 {
                let read = match first.take() {
                    Some(r) => r,
                    None => self.ep.read_cq(&mut turn.cqe),
                };
                match read {
                    Read::Done(0) => break,
                    Read::Done(n) => {
                        seen += n;
                        for e in &turn.cqe[..n] {
                            if self.on_completion(&mut st, e, &mut out, &mut lost) {
                                work += 1;
                            }
                        }
                        if n < turn.cqe.len() {
                            // The queue is drained: reading it again costs
                            // the provider's progress (a system call on
                            // tcp) on the path of every message.
                            break;
                        }
                    }
                    Read::Error(e) => {
                        work += 1;
                        self.on_error(&mut st, &e, &mut lost);
                    }
                    Read::Failed(code) => {
                        tracing::warn!(
                            "rdma: reading the completion queue: {}",
                            ofi::strerror(code)
                        );
                        break;
                    }
                }
            }
            // (A load first: an idle poll takes no locked instruction.)
            let backlog = || {
                self.backlog.load(Ordering::Relaxed) && self.backlog.swap(false, Ordering::Relaxed)
            };
            if seen > 0 && !self.found.load(Ordering::Relaxed) {
                self.found.store(true, Ordering::Relaxed);
            }
            self.fit_receives(&mut st);
            let full = backlog();
            let sealing = self.bundling.load(Ordering::Relaxed)
                && self.bundling.swap(false, Ordering::Relaxed);
            if seen > 0 || full || sealing {
                for (buf, ctx) in std::mem::take(&mut st.unposted) {
                    self.repost(&mut st, buf, ctx);
                }
                if full {
                    for p in self.peer_list() {
                        st.attend(p.rank);
                    }
                }
                if !st.attend.is_empty() {
                    work += self.attend(&mut st, &mut out);
                }
            }
            lost.extend(
                st.lose_later
                    .drain(..)
                    .map(|(r, why)| (r, why, Loss::Misbehaved)),
            );
            turn.returned = !st.returned.is_empty();
        }
        for (rank, why, how) in lost {
            self.lose(rank, &why, how);
        }
        for (src, kind, tag, data) in out.drain(..) {
            work += 1;
            match data {
                Data::Own(data) if kind == Kind::User => self.core.deliver(src, tag, data),
                Data::Own(data) => {
                    if let Some(link) = self.core.link(src) {
                        self.core.on_message(&*link, src, kind, tag, data);
                    }
                }
                Data::Frame { buf, ctx, at, many } => {
                    let body = buf.get(at..).unwrap_or_default();
                    if many {
                        for (at, len) in wire::entries(body) {
                            self.core.deliver_copy(src, tag, &body[at..at + len]);
                        }
                    } else {
                        self.core.deliver_copy(src, tag, body);
                    }
                    turn.spent.push((buf, ctx));
                }
            }
        }
        turn.out = out;
        work
    }

    fn keep_hot(&self) -> bool {
        // Data is moving: keep the driver polling (a manual-progress
        // provider moves it only while called).
        let st = lock(&self.st);
        self.peer_list().any(|p| {
            let ps = &st.peers[p.rank as usize];
            !p.lost.load(Ordering::Acquire) && (ps.posted > 0 || ps.in_flight > 0)
        })
    }

    fn arm(&self) -> bool {
        self.armed.store(true, Ordering::SeqCst);
        // Messages held for room: the dispatcher's `space` signal wakes
        // the driver; deliver what fits now.
        self.backlog.store(true, Ordering::Relaxed);
        if self.progress() > 0 {
            return false;
        }
        self.ep.trywait()
    }

    fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }

    async fn wait(&self, timeout: Duration) {
        let busy = self.busy(&lock(&self.st));
        let until = if busy {
            BUSY_WAIT.min(timeout)
        } else {
            timeout
        };
        // While the fd is watched, every packet the provider's sockets take
        // may also run the runtime's epoll callback (over tcp the wait fd
        // is an epoll set of them): a cost on the path of every message of
        // a stream that never parks. So a liveness check that finds a
        // stream since the last one drops the watch (`check_peers`), and
        // the next park watches again; a fd already readable when watched
        // is reported at once, so a completion that came after `arm` is
        // not slept through.
        self.parked.store(true, Ordering::Relaxed);
        let kept = lock(&self.watched).take();
        let fd = match kept.map_or_else(|| watch(self.wait_fd, &self.ep), Ok) {
            Ok(fd) => fd,
            Err(e) => {
                // Polled every few milliseconds instead.
                if self.watch_failed.swap(true, Ordering::Relaxed) {
                    tracing::debug!("rdma: watching the completion queue's fd: {e}");
                } else {
                    tracing::warn!("rdma: watching the completion queue's fd: {e}");
                }
                tokio::select! {
                    _ = self.kick.notified() => {}
                    _ = tokio::time::sleep(until.min(BUSY_WAIT)) => {}
                }
                return;
            }
        };
        // Put back when the wait ends, also when it is cancelled (the
        // driver selects it against other wake-ups).
        let kept = Kept {
            slot: &self.watched,
            fd: Some(fd),
        };
        let Some(fd) = kept.fd.as_ref() else { return };
        tokio::select! {
            r = fd.readable() => {
                // Cleared here and checked again by the next `arm`
                // (`fi_trywait`), so a completion that came meanwhile is
                // never slept through.
                if let Ok(mut g) = r {
                    g.clear_ready();
                }
            }
            _ = self.kick.notified() => {}
            _ = tokio::time::sleep(until) => {}
        }
    }

    fn check_peers(&self) {
        // Read the completion queue first: called by the liveness watch
        // after a stall of this process (a user loop that starved the
        // progress task), the peers' pings wait there, and a
        // manual-progress provider (tcp) moves our own pings only while
        // it is read. (From the progress task it finds what is new since
        // its last poll.)
        self.progress();
        self.service();
        // Completions found since the last check, and no park: a stream,
        // which the runtime need not watch the fd for (see `wait`).
        let found = self.found.swap(false, Ordering::Relaxed);
        let parked = self.parked.swap(false, Ordering::Relaxed);
        if found && !parked {
            if let Ok(mut w) = self.watched.try_lock() {
                if w.take().is_some() {
                    bump(&self.counters.unwatches);
                }
            }
        }
    }

    fn drained(&self) -> bool {
        let st = lock(&self.st);
        self.peer_list().all(|p| {
            let ps = &st.peers[p.rank as usize];
            p.lost.load(Ordering::Acquire)
                || (ps.queue.is_empty()
                    && ps.bundle.is_none()
                    && ps.ctrl.is_empty()
                    && ps.lent.is_empty()
                    && ps.in_flight == 0)
        })
    }

    fn undrained(&self) -> Vec<String> {
        let st = lock(&self.st);
        self.peer_list()
            .filter(|p| !p.lost.load(Ordering::Acquire))
            .filter_map(|p| {
                let ps = &st.peers[p.rank as usize];
                let bundled = ps.bundle.as_ref().map_or(0, |b| b.count);
                (!ps.queue.is_empty() || bundled > 0 || !ps.lent.is_empty() || ps.in_flight > 0).then(|| {
                    format!(
                        "rdma rank {}: {} frames queued, {} messages in an open bundle, {} sends in flight, {} large messages not yet read",
                        p.rank,
                        ps.queue.len(),
                        bundled,
                        ps.in_flight,
                        ps.lent.len()
                    )
                })
            })
            .collect()
    }

    fn shutdown(&self) {
        for s in self.undrained() {
            tracing::warn!("closing with {s}");
        }
        for p in self.peer_list() {
            self.fail_peer(p.rank, &|| Error::Closed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_in_pieces_is_whole_at_its_last_piece_and_of_one_tag() {
        let b = |n: usize| Bytes::from(vec![7u8; n]);
        let mut ps = PeerState {
            expect: 10,
            ..Default::default()
        };
        ps.arrived.insert(10, In::Piece(Kind::User, 3, b(5)));
        assert!(matches!(pieces(&ps, 8), Pieces::Incomplete));
        ps.arrived.insert(11, In::Ready(Kind::User, 3, b(2)));
        assert!(matches!(
            pieces(&ps, 8),
            Pieces::Whole {
                kind: Kind::User,
                tag: 3,
                n: 2,
                len: 7
            }
        ));
        // Pieces of one message naming two tags, or a rendezvous inside
        // one: the peer broke the protocol.
        ps.arrived.insert(11, In::Ready(Kind::User, 4, b(2)));
        assert!(matches!(pieces(&ps, 8), Pieces::Bad(_)));
        ps.arrived.insert(11, In::Reading);
        assert!(matches!(pieces(&ps, 8), Pieces::Bad(_)));
        // Across the wrap of the sequence numbers; a run longer than the
        // window can never be whole.
        let mut ps = PeerState {
            expect: u32::MAX,
            ..Default::default()
        };
        for i in 0..3u32 {
            let at = u32::MAX.wrapping_add(i);
            ps.arrived.insert(at, In::Piece(Kind::User, 1, b(1)));
        }
        assert!(matches!(pieces(&ps, 3), Pieces::Bad(_)));
        ps.arrived.insert(2, In::Ready(Kind::User, 1, b(1)));
        assert!(matches!(pieces(&ps, 4), Pieces::Whole { n: 4, len: 4, .. }));
    }

    #[test]
    fn the_receive_cycle_grows_with_bursts_and_shrinks_back_when_they_stop() {
        let mut c = Cycle::new(132);
        assert_eq!(c.target, RECV_START);
        // A ping-pong: one receive per call, for ever.
        for _ in 0..3 * RECV_REVIEW {
            assert!(!c.after_pass(1));
        }
        assert_eq!(c.target, RECV_START);
        // A stream: calls that take half the cycle double it, to the full count.
        let mut grew = 0;
        while c.after_pass(c.target / 2) {
            grew += 1;
        }
        assert_eq!((c.target, grew), (132, 4));
        assert!(!c.after_pass(132), "never past the full count");
        // A steady stream keeps it.
        for _ in 0..2 * RECV_REVIEW / 40 {
            c.after_pass(40);
        }
        assert_eq!(c.target, 132);
        // Back to a ping-pong: halved at each review that saw only it (the
        // first one still saw the stream's tail), down to the start.
        let mut targets = vec![];
        for _ in 0..5 {
            for _ in 0..RECV_REVIEW {
                c.after_pass(1);
            }
            targets.push(c.target);
        }
        assert_eq!(targets, [132, 66, 33, 16, 16]);
        // A job whose full count is below the start never goes past it.
        let mut small = Cycle::new(10);
        assert_eq!(small.target, 10);
        assert!(!small.after_pass(10));
        for _ in 0..RECV_REVIEW {
            small.after_pass(1);
        }
        assert_eq!(small.target, 10);
    }

    #[test]
    fn a_remembered_key_is_the_derived_one() {
        let (a, b) = ([1u8; 16], [2u8; 16]);
        for id in [a, a, b, a, b, b] {
            assert_eq!(derived_key(&id), hash_key(&id));
        }
        assert_ne!(derived_key(&a), derived_key(&b));
    }

    #[test]
    fn derived_keys_change_with_every_bit_of_the_id() {
        let id = [7u8; 16];
        let k = derived_key(&id);
        for i in 0..16 {
            let mut f = id;
            f[i] ^= 1;
            assert_ne!(derived_key(&f), k, "byte {i}");
        }
    }

    #[test]
    fn providers_are_preferred_hardware_first_and_the_unfit_ones_say_why() {
        assert!(preference("verbs;ofi_rxm").unwrap() < preference("tcp;ofi_rxm").unwrap());
        assert!(preference("efa").unwrap() < preference("tcp;ofi_rxm").unwrap());
        for bad in [
            "shm",
            "net",
            "net;ofi_rxm",
            "udp;ofi_rxd",
            "sockets",
            "mystery",
        ] {
            assert!(preference(bad).is_err(), "{bad}");
        }
    }
}

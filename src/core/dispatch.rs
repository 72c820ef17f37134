//! Tag dispatch: every transport hands complete user messages here; each tag
//! has one bounded queue and at most one [`Receiver`] stream.
//!
//! Bounded: a tag whose queue holds more than the receive budget refuses
//! more (`has_room` is false), the transports stop reading from that sender,
//! the sender's fragments or window run out, and the sender's futures wait.
//! Popping from a full queue wakes the progress tasks.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::Stream;
use tokio::sync::Notify;

use crate::config::ProgressMode;
use crate::sys::sync::lock;
use crate::{Error, Rank, Result, Tag};

/// A received message.
///
/// Most messages carry their bytes in [`data`](Self::data). One sent with
/// [`Endpoint::send_region`](crate::Endpoint::send_region) from device
/// memory to a peer on the same node is *lent* instead
/// ([`is_lent`](Self::is_lent)): `data` is empty, the bytes stay in the
/// sender's region, and the receiver lands them where it chooses with
/// [`fetch_into`](Self::fetch_into) (between device memories, one GPU
/// copy). The sender's future resolves once they are taken; dropping the
/// message (its last clone) without taking them declines it, and the
/// sender's future fails with [`Error::Declined`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The sender's rank.
    pub src: Rank,
    /// The tag it was sent on.
    pub tag: Tag,
    /// The payload (empty for a lent message).
    pub data: Bytes,
    /// A lent message's announcement and the way to answer it.
    lent: Option<Lent>,
}

/// The lent part of a [`Message`]: shared by its clones, compared by
/// identity.
#[derive(Debug, Clone)]
struct Lent(Arc<crate::core::lend::Borrowed>);

impl PartialEq for Lent {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Lent {}

impl Message {
    /// A message that carries `data`.
    pub(crate) fn carried(src: Rank, tag: Tag, data: Bytes) -> Message {
        Message {
            src,
            tag,
            data,
            lent: None,
        }
    }

    /// A lent message from `src` on `tag`.
    pub(crate) fn lent(src: Rank, tag: Tag, lent: Arc<crate::core::lend::Borrowed>) -> Message {
        Message {
            src,
            tag,
            data: Bytes::new(),
            lent: Some(Lent(lent)),
        }
    }

    /// Whether the bytes stay with the sender until fetched (see the type's
    /// docs).
    pub fn is_lent(&self) -> bool {
        self.lent.is_some()
    }

    /// The message's length: of its bytes, or of the bytes it lends.
    pub fn len(&self) -> usize {
        match &self.lent {
            Some(l) => l.0.ann.len as usize,
            None => self.data.len(),
        }
    }

    /// Whether the message has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Land the message's bytes in `dst` at `offset`, returning how many:
    /// a lent message's are read from the sender's region (a get: between
    /// device memories of one node one GPU copy, else through the host),
    /// and the sender is told they are taken; a carried message's are
    /// written (into device memory through the device). Either kind may
    /// land in host or device memory.
    ///
    /// A message longer than `dst` has room for at `offset` is refused
    /// with [`Error::Misuse`] and nothing is copied (a lent one can still
    /// be fetched into a larger region). A lent message whose copy fails
    /// gets that error, and its sender [`Error::Declined`] with it.
    ///
    /// ```no_run
    /// # async fn demo(f: &async_btl::Fabric) -> async_btl::Result<()> {
    /// let mut rx = f.receiver(5)?;
    /// let landing = f.alloc_device_region(0, 1 << 20)?;
    /// let m = rx.recv().await?;
    /// let n = m.fetch_into(&landing, 0).await?; // lent or carried alike
    /// # let _ = n; Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// Dropping the future of a lent message's fetch leaves its copy to
    /// finish on its own (the regions stay alive for it); the sender is
    /// answered only when a fetch completes or the message is dropped.
    pub async fn fetch_into(&self, dst: &crate::MemoryRegion, offset: usize) -> Result<usize> {
        let len = self.len();
        if !offset.checked_add(len).is_some_and(|end| end <= dst.len()) {
            return Err(Error::Misuse(format!(
                "a message of {len} bytes does not fit at offset {offset} of a {}-byte region",
                dst.len()
            )));
        }
        let Some(Lent(b)) = &self.lent else {
            dst.write(offset, &self.data)?;
            return Ok(len);
        };
        if b.is_answered() {
            return Err(Error::Misuse(
                "this lent message was answered already (its bytes taken, or declined when this fabric closed)".into(),
            ));
        }
        let core = b.core()?;
        let Some(route) = core.route(b.src) else {
            return Err(Error::Closed);
        };
        let ep = crate::core::endpoint::Endpoint::new(route, core.clone());
        // One copy at a time (an earlier fetch whose future was dropped
        // may still run): the answer then follows every copy.
        let get = loop {
            match b.begin(|| ep.get_tracked(dst, offset..offset + len, &b.ann.key, b.ann.offset)) {
                Ok(get) => break get,
                Err(running) => {
                    let _ = futures::future::poll_fn(|cx| running.poll(cx)).await;
                    if b.is_answered() {
                        return Err(Error::Misuse(
                            "this lent message was answered while its fetch waited".into(),
                        ));
                    }
                }
            }
        };
        let r = get.await;
        match &r {
            Ok(()) => b.answer(crate::core::lend::Answer::Taken),
            // The sender is gone: nobody to answer.
            Err(Error::PeerLost { .. } | Error::Closed) => {}
            Err(e) => b.answer(crate::core::lend::Answer::Declined(format!(
                "the receiver's copy failed: {e}"
            ))),
        }
        r.map(|()| len)
    }

    /// Mark a lent message as met by a receive that takes only carried
    /// bytes: dropped unread, it is declined with that reason.
    fn refused_by(&self, what: &str) {
        if let Some(Lent(b)) = &self.lent {
            b.decline_with(format!(
                "it was received by {what}, which takes only carried bytes"
            ));
        }
    }
}

#[derive(Default)]
struct TagQueue {
    items: VecDeque<Result<Message>>,
    /// `items.len()`, stored after each change under the lock and shared
    /// with the tag's `Receiver`, which reads it without the lock (Relaxed:
    /// a hint; the lock decides) to skip a refill that would find nothing.
    queued: Arc<AtomicUsize>,
    /// A message was refused for lack of room: wake progress when one leaves.
    refused: bool,
    bytes: usize,
    waker: Option<Waker>,
    taken: bool,
}

/// Hashes a tag with one multiplication (Fibonacci hashing): tags are
/// chosen by the program, not by an attacker, and the default SipHash cost
/// more than the rest of a lookup on the receive path.
#[derive(Default, Clone, Copy)]
struct TagHasher(u64);

impl std::hash::Hasher for TagHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type TagMap = HashMap<Tag, TagQueue, std::hash::BuildHasherDefault<TagHasher>>;

/// A receiver running progress inline on this thread (`Receiver::poll_next`):
/// a message for its tag that finds the tag's queue empty is handed to it
/// here instead of being queued and then taken back out under a second
/// lock. Only while its poll runs progress; a guard takes whatever is left
/// when the poll ends, even by unwinding.
///
/// Without the tag lock ([`Dispatcher::hand_over`]): the registration
/// carries the queue's length word, and a transport hands over only under
/// the lock it delivered the pair's earlier messages under, so a zero read
/// there means nothing of that pair waits in the queue and order holds.
/// Handed messages are not charged to the queue's budgets (that needs the
/// lock); instead one registration takes at most one tag budget's worth
/// (`bytes`), and only while the total of all queues (read as a hint)
/// leaves room for it, so memory stays bounded as for a queue. (A message
/// that `has_room` admitted this way and that then takes the queue after
/// all may exceed the budgets by itself, as a first message may.)
struct Inline {
    /// The dispatcher's address (several fabrics may share a thread).
    disp: usize,
    tag: Tag,
    /// The tag queue's length word (see `TagQueue::queued`), lent by the
    /// receiver for the registration.
    queued: Arc<AtomicUsize>,
    items: VecDeque<Held>,
    /// The receiver's kept buffer (`Receiver::keep`), lent for the
    /// registration by `recv_into`: small payloads that would be copied into
    /// a buffer of their own are appended here instead (see [`Held::Kept`]).
    keep: Option<Vec<u8>>,
    /// What the items handed over cost (never charged to the budgets).
    bytes: usize,
    /// The receiver's `handed` bytes: given back to the budgets by the
    /// first hand-off that takes the lock anyway, since a receiver fed
    /// this way may never reach a refill while it stays hot.
    handed: usize,
    /// A buffer the receiver lent (`Receiver::recv_into`): the first
    /// message handed over is copied into it, straight from where the
    /// transport holds it, instead of into a buffer of its own. Valid for
    /// the registration (see `InlineGuard::register`).
    lent: Option<std::ptr::NonNull<Vec<u8>>>,
    /// The sender of the message copied into `lent`, once there is one.
    lent_src: Option<Rank>,
}

/// A message's payload as a transport offers it: made into a buffer of its
/// own ([`into_bytes`](Payload::into_bytes)), or copied into one a receiver
/// lent ([`copy_into`](Payload::copy_into)), whichever the dispatcher
/// needs. A closure making `Bytes` is one (its copy goes through them).
pub(crate) trait Payload {
    /// Whether [`into_bytes`](Payload::into_bytes) copies into a new buffer
    /// (rather than handing over one that exists): then a copy into a
    /// buffer the receiver keeps costs less, and is made where there is one.
    const COPIES: bool = false;
    /// The payload in a buffer of its own.
    fn into_bytes(self) -> Bytes;
    /// The payload appended to `out`.
    fn copy_into(self, out: &mut Vec<u8>);
}

impl<F: FnOnce() -> Bytes> Payload for F {
    fn into_bytes(self) -> Bytes {
        self()
    }
    fn copy_into(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self());
    }
}

impl Inline {
    /// Whether a message of `len` bytes for `tag` of dispatcher `d` may be
    /// handed over now (`empty`: its queue holds nothing).
    fn takes(&self, d: &Dispatcher, tag: Tag, len: usize, empty: bool) -> bool {
        let after = self.bytes.saturating_add(cost(len));
        let total = d.total.load(Ordering::Relaxed);
        self.disp == d as *const Dispatcher as usize
            && self.tag == tag
            && empty
            && (self.bytes == 0 || after <= d.budget)
            && ((self.bytes == 0 && total == 0) || total.saturating_add(after) <= d.total_budget)
    }
}

/// What a receiver holds, taken from its tag's queue or handed over inline.
enum Held {
    /// A queued item: a message in a buffer of its own, or a lost peer.
    Item(Result<Message>),
    /// A message handed over inline whose payload was copied into the
    /// receiver's kept buffer at `at..at + len` (no allocation per message:
    /// the buffer is reused from one registration to the next).
    Kept { src: Rank, at: u32, len: u32 },
}

impl Held {
    /// The sender (of a message, or the peer lost), if any.
    fn src(&self) -> Option<Rank> {
        match self {
            Held::Item(Ok(m)) => Some(m.src),
            Held::Item(Err(Error::PeerLost { rank, .. })) => Some(*rank),
            Held::Item(Err(_)) => None,
            Held::Kept { src, .. } => Some(*src),
        }
    }

    /// The item, a kept payload copied out of `keep` into a buffer of its own.
    fn resolve(self, tag: Tag, keep: &[u8]) -> Result<Message> {
        match self {
            Held::Item(item) => item,
            Held::Kept { src, at, len } => Ok(Message::carried(
                src,
                tag,
                Bytes::copy_from_slice(kept(keep, at, len)),
            )),
        }
    }
}

/// The bytes of a [`Held::Kept`] payload in `keep` (empty if out of range,
/// which no registration produces).
fn kept(keep: &[u8], at: u32, len: u32) -> &[u8] {
    let (at, len) = (at as usize, len as usize);
    keep.get(at..at.saturating_add(len)).unwrap_or(&[])
}

/// Where a direct take (see [`Progress::take_direct`]) puts the small
/// messages it finds already waiting behind the one it takes, from the
/// same sender on the same tag: appended to the receiver's kept buffer as
/// [`Held::Kept`] items, which its next receives hand out without another
/// look at the transport. In a stream the receiver falls behind its
/// sender; this way it catches up at a fraction of a take's cost per
/// message.
pub(crate) struct More<'a> {
    keep: &'a mut Vec<u8>,
    items: &'a mut VecDeque<Held>,
    left: usize,
}

impl<'a> More<'a> {
    /// Room for up to `left` messages (and no more bytes than
    /// [`KEEP_MAX`] in `keep`).
    fn new(keep: &'a mut Vec<u8>, items: &'a mut VecDeque<Held>, left: usize) -> Self {
        More { keep, items, left }
    }

    /// How many more messages are wanted (0: none).
    pub(crate) fn wanted(&self) -> usize {
        self.left
    }

    /// Take one more message from `src` of at most `max` bytes: `fill`
    /// appends its payload to the vector it is given and says whether it
    /// found one (it must append nothing when it did not). Whether it did.
    pub(crate) fn take(
        &mut self,
        src: Rank,
        max: usize,
        fill: impl FnOnce(&mut Vec<u8>) -> bool,
    ) -> bool {
        if self.left == 0 || self.keep.len().saturating_add(max) > KEEP_MAX {
            self.left = 0;
            return false;
        }
        let at = self.keep.len();
        if !fill(self.keep) {
            return false;
        }
        self.left -= 1;
        self.items.push_back(Held::Kept {
            src,
            at: at as u32,
            len: (self.keep.len() - at) as u32,
        });
        true
    }
}

/// Most messages one direct take adds behind the one it takes (see
/// [`More`]): each delays the first message's return by its copy.
const MORE_MAX: usize = 15;

/// Bytes of small payloads one registration copies into a receiver's kept
/// buffer at most (past them, messages get buffers of their own): what the
/// buffer may keep allocated between registrations.
const KEEP_MAX: usize = 64 * 1024;

/// Progress on every transport of a fabric, as receivers run it inline.
pub(crate) trait Progress: Send + Sync {
    /// Poll every transport, up to `turns` turns, until one does work;
    /// the work done.
    fn turns(&self, turns: usize) -> usize;

    /// An inline poll found nothing (or found work, once in
    /// [`IDLE_EVERY`] such polls), at `now_ns` on the dispatcher's clock:
    /// the moment for checks a starved progress task would have made
    /// (see [`Liveness::Inline`](crate::Liveness::Inline)). Default: none.
    fn idle(&self, _now_ns: u64) {}

    /// Take the next message for `tag` into `buf` from a transport that
    /// can hand it over without a progress turn (see
    /// [`Transport::take_direct`](crate::transport::Transport::take_direct));
    /// its sender; more that wait behind it from the same sender may go
    /// to `more`. Default: none can.
    fn take_direct(
        &self,
        _tag: Tag,
        _queued: &AtomicUsize,
        _buf: &mut Vec<u8>,
        _more: &mut More<'_>,
        _looks: u32,
    ) -> Option<Rank> {
        None
    }
}

impl<F: Fn(usize) -> usize + Send + Sync> Progress for F {
    fn turns(&self, turns: usize) -> usize {
        self(turns)
    }
}

/// A fabric's [`Progress`]. The fabric owns it; the dispatcher holds it
/// weakly, and a receiver keeps the one it upgraded while its fabric is
/// open (one upgrade per receiver, not one per poll).
pub(crate) type Poller = Arc<dyn Progress>;

thread_local! {
    static INLINE: std::cell::RefCell<Option<Inline>> = const { std::cell::RefCell::new(None) };
}

/// Copy `make` into the buffer `i` was lent (it has one, still empty of
/// any message), noting its sender. Out of the way of the usual hand-over.
#[cold]
#[inline(never)]
fn lend(i: &mut Inline, src: Rank, make: impl Payload) {
    if let Some(mut lent) = i.lent {
        // SAFETY: `register` was given a buffer that stays valid and
        // unused by its owner until the registration ends, and this
        // thread's registration is the only user meanwhile.
        let out = unsafe { lent.as_mut() };
        out.clear();
        make.copy_into(out);
        i.lent_src = Some(src);
    }
}

/// What [`InlineGuard::register`] gives back when it does not register:
/// the length word, the local queue and the kept buffer it was lent.
type Back = (Arc<AtomicUsize>, VecDeque<Held>, Option<Vec<u8>>);

/// Takes the inline registration back when dropped, returning what it
/// still holds to the tag's queue (only on unwinding: a normal poll takes
/// the items itself).
struct InlineGuard<'a> {
    disp: &'a Dispatcher,
    tag: Tag,
}

impl InlineGuard<'_> {
    /// Register `disp`'s receiver for `tag` on this thread, with `buf` (the
    /// receiver's empty local queue, reused so that no hand-off allocates)
    /// to collect what is handed over; unless one is registered already (a
    /// nested poll keeps the first): then `buf` comes back.
    ///
    /// `lent`, if any, must stay valid and unused by anything else until
    /// the guard is taken or dropped (the caller's poll holds it borrowed
    /// for that long): hand-offs on this thread write into it.
    fn register(
        disp: &Dispatcher,
        tag: Tag,
        queued: Arc<AtomicUsize>,
        buf: VecDeque<Held>,
        handed: usize,
        lent: Option<std::ptr::NonNull<Vec<u8>>>,
        keep: Option<Vec<u8>>,
    ) -> Result<InlineGuard<'_>, Back> {
        let mut buf = Some((queued, buf, keep));
        let ok = INLINE
            .try_with(|c| {
                let Ok(mut c) = c.try_borrow_mut() else {
                    return false;
                };
                if c.is_some() {
                    return false;
                }
                let Some((queued, items, keep)) = buf.take() else {
                    return false;
                };
                *c = Some(Inline {
                    disp: disp as *const Dispatcher as usize,
                    tag,
                    queued,
                    items,
                    keep,
                    bytes: 0,
                    handed,
                    lent,
                    lent_src: None,
                });
                true
            })
            .unwrap_or(false);
        match buf {
            Some(b) if !ok => Err(b),
            _ => Ok(InlineGuard { disp, tag }),
        }
    }

    /// The registration's end: the length word lent to `register`, what
    /// was handed over (in the buffer given to `register`; none of it
    /// charged to the budgets), and the handed bytes no hand-off gave
    /// back. `None` only if the thread-local cannot be reached, which no
    /// caller allows (the guard's drop then puts everything back in the
    /// queue).
    fn take(self) -> Option<Inline> {
        let inline = INLINE
            .try_with(|c| c.try_borrow_mut().ok()?.take())
            .ok()
            .flatten();
        if inline.is_some() {
            std::mem::forget(self);
        }
        inline
    }
}

impl Drop for InlineGuard<'_> {
    fn drop(&mut self) {
        let left = INLINE
            .try_with(|c| c.try_borrow_mut().ok()?.take())
            .ok()
            .flatten();
        if let Some(mut i) = left {
            if let (Some(src), Some(lent)) = (i.lent_src, i.lent) {
                // Unwinding after a message was copied into the lent
                // buffer: it goes back first, in a buffer of its own.
                // SAFETY: the poll that registered `lent` is still on the
                // stack (this drop runs in it), so the buffer is valid.
                let data = Bytes::copy_from_slice(unsafe { lent.as_ref() });
                let tag = self.tag;
                i.items
                    .push_front(Held::Item(Ok(Message::carried(src, tag, data))));
            }
            let n = i.items.len();
            let keep = i.keep.unwrap_or_default();
            let back = i.items.into_iter().map(|h| h.resolve(self.tag, &keep));
            self.disp.unpop(self.tag, i.handed, back.collect(), n);
        }
    }
}

/// Per-fabric tag dispatcher.
pub(crate) struct Dispatcher {
    tags: Mutex<TagMap>,
    budget: usize,
    /// Limit on the bytes queued for all tags together.
    total_budget: usize,
    /// Bytes queued for all tags (changed only under `tags`; Relaxed).
    total: AtomicUsize,
    /// A message was refused because all tags together were full: wake
    /// progress when any queue shrinks (changed only under `tags`).
    starved: AtomicBool,
    /// Signalled when a full queue drains, so progress tasks resume reading.
    pub(crate) space: Arc<Notify>,
    /// Signalled when a future stops polling inline (traffic went cold), so a
    /// progress task that stood back takes over at once.
    pub(crate) cold: Arc<Notify>,
    /// Set by a receiver poll that found nothing: try progress inline
    /// (see [`Poller`]).
    progress_hook: OnceLock<Weak<dyn Progress>>,
    /// Raised when refused room is made (see [`Dispatcher::on_room`]).
    room_flags: Mutex<Vec<Arc<AtomicBool>>>,
    /// Receivers keep polling inline (instead of sleeping until a progress
    /// task wakes them, a cross-thread wake-up of ~20 µs) while hot.
    policy: Hot,
}

/// What a queued message counts against the receive budgets: its bytes and
/// a fixed charge for its bookkeeping, so that empty messages are not free.
fn cost(len: usize) -> usize {
    len.saturating_add(MESSAGE_COST)
}

/// Bytes of bookkeeping a queued message counts for in its tag's budget
/// beside its own.
pub(crate) const MESSAGE_COST: usize = 64;

/// Items a receiver moves out of its tag's queue per lock.
const POP_BATCH: usize = 32;

/// Messages at least this large are taken off the budgets as soon as they
/// are handed out, not at the receiver's next refill.
const SETTLE_AT_ONCE: usize = 64 * 1024;

/// Progress polls a hot waiter makes per poll of its future.
const INLINE_TURNS: usize = 16;

/// Looks a receiver lending a buffer has a transport make for a direct
/// take per poll (see [`Dispatcher::take_direct`]): each is a few loads
/// of lines the sender writes, so a message that arrives meanwhile is seen
/// at once and taken without a progress turn, which is most of a small
/// ping-pong's hop. A spin of about a microsecond at most (3 ns a look on
/// a 2.6 GHz core): long enough to cover a round trip, which a stream waits
/// for at each window's acknowledgement and at the next window's first
/// message. A wait that outlasts the looks registers and runs progress
/// turns, and the next look comes a microsecond or so later: with a quarter
/// as many looks, a stream of 8-byte messages in windows of 64 took 1.1-1.2
/// times as long.
const DIRECT_LOOKS: u32 = 256;

/// What a waiting operation's future has seen of
/// [`Dispatcher::progress_inline_for_op`] before its first poll.
pub(crate) const OP_UNSEEN: u64 = u64::MAX;

/// See [`Hot::spinning_idle`].
const OS_YIELD_AFTER_NS: u64 = 20_000;

/// See [`Hot::give_way_due`]: once hot waiters have found no work for
/// this long...
const GIVE_WAY_IDLE_NS: u64 = 2_000;
/// ...every this many of their polls has the runtime look at its I/O and
/// timers first...
const GIVE_WAY_IDLE_POLLS: u32 = 4;
/// ...and while work keeps coming, once in this long.
const GIVE_WAY_BUSY_NS: u64 = 20_000;

/// When a waiting receiver polls again at once instead of sleeping.
struct Hot {
    mode: ProgressMode,
    spin_ns: u64,
    epoch: Instant,
    /// Nanoseconds since `epoch` of the last work seen (Relaxed: a hint).
    last: AtomicU64,
    /// Work was done since a poller last looked at the clock: the next
    /// poller stamps `last` with the time it reads anyway, so doing work
    /// costs no clock read (Relaxed: a hint).
    worked: AtomicBool,
    /// The time the latest inline progress poll read (Relaxed: reused by
    /// the same poll's `stay_hot` instead of a second clock read).
    polled: AtomicU64,
    /// Nanoseconds since `epoch` of the last inline poll by a hot receiver
    /// (Relaxed: a hint for the progress task to stand back).
    inline: AtomicU64,
    /// Inline progress calls made for futures waiting on operations
    /// (Relaxed: a hint; see `Dispatcher::progress_inline_for_op`).
    op_polls: AtomicU64,
    /// Nanoseconds since `epoch` of the last time a hot waiter gave way
    /// (Relaxed: a hint; see `give_way_due`).
    gave_way: AtomicU64,
    /// Hot polls that found nothing since then (Relaxed: a hint).
    misses: std::sync::atomic::AtomicU32,
    /// Inline polls whose first turn found work (Relaxed, a plain load
    /// and store: a hint; see [`IDLE_EVERY`]).
    found: std::sync::atomic::AtomicU32,
}

/// An inline poll whose first turn found work reads no clock, so it does
/// not reach [`Progress::idle`]; every this many of them it does, so the
/// checks made there still run while every poll finds a message.
const IDLE_EVERY: u32 = 256;

impl Hot {
    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }
    /// Work was done (no clock read: see `worked`).
    fn touch(&self) {
        // A load first: a receiver taking message after message writes the
        // shared line only once per clock read, not once per message.
        if !self.worked.load(Ordering::Relaxed) {
            self.worked.store(true, Ordering::Relaxed);
        }
    }
    /// Read the clock for a poll: stamps pending work, returns the time.
    fn poll_now(&self) -> u64 {
        let now = self.now_ns();
        if self.worked.load(Ordering::Relaxed) && self.worked.swap(false, Ordering::Relaxed) {
            self.last.store(now, Ordering::Relaxed);
        }
        self.polled.store(now, Ordering::Relaxed);
        now
    }
    /// Spinning for this long without work, a poller also yields the CPU to
    /// the OS between polls: if the peer runs on the same core (the kernel
    /// likes to wake a process next to its waker), spinning would only keep
    /// it from answering. On separate cores the yield returns at once.
    fn spinning_idle(&self, now: u64) -> bool {
        self.mode != ProgressMode::Interrupt
            && now.saturating_sub(self.last.load(Ordering::Relaxed)) > OS_YIELD_AFTER_NS
    }

    /// Whether a hot waiter should have its next poll wait for the runtime
    /// to look at its I/O and timers (see [`give_way`]) rather than come at
    /// once: every [`GIVE_WAY_IDLE_POLLS`]th poll once no work has come for
    /// [`GIVE_WAY_IDLE_NS`], else once in [`GIVE_WAY_BUSY_NS`] (a
    /// ping-pong, whose hops are far shorter, pays the runtime's I/O poll
    /// only that rarely). A task woken at once
    /// goes straight back to the run queue, and a current-thread runtime
    /// polls its I/O driver only when that queue runs empty or every 61
    /// polls, so a spinning receiver would hold back every socket of the
    /// program by that much (a TCP request forwarded over the fabric took
    /// twice as long as on a multi-thread runtime, more with a longer
    /// `BTL_SPIN_US`).
    fn give_way_due(&self, now: u64) -> bool {
        let since = now.saturating_sub(self.gave_way.load(Ordering::Relaxed));
        let idle = now.saturating_sub(self.last.load(Ordering::Relaxed));
        // Load and store, not an atomic add: a hint, off the hot path's
        // critical cost.
        let misses = self.misses.load(Ordering::Relaxed) + 1;
        if (idle >= GIVE_WAY_IDLE_NS && misses >= GIVE_WAY_IDLE_POLLS) || since >= GIVE_WAY_BUSY_NS
        {
            self.gave_way.store(now, Ordering::Relaxed);
            self.misses.store(0, Ordering::Relaxed);
            return true;
        }
        self.misses.store(misses, Ordering::Relaxed);
        false
    }

    /// Whether a waiter should keep polling at `now` (one clock read per
    /// poll: reading the clock is about 15% of a ping-pong's profile).
    fn is_hot(&self, now: u64) -> bool {
        match self.mode {
            ProgressMode::BusyPoll => true,
            ProgressMode::Interrupt => false,
            ProgressMode::Adaptive => {
                now.saturating_sub(self.last.load(Ordering::Relaxed)) < self.spin_ns
            }
        }
    }
}

/// Have the task polled again once the runtime has looked at its I/O
/// drivers and timers: tokio's `yield_now`, whose first poll hands the
/// waker to the scheduler's deferred list (woken after the next driver
/// poll; at once outside a runtime). Its future is dropped after that
/// first poll; the deferred waker is what counts.
fn give_way(cx: &mut Context<'_>) {
    let y = std::pin::pin!(tokio::task::yield_now());
    if std::future::Future::poll(y, cx).is_ready() {
        cx.waker().wake_by_ref();
    }
}

impl Dispatcher {
    /// `budgets`: bytes queued per tag, and for all tags together.
    pub(crate) fn new(budgets: (usize, usize), mode: ProgressMode, spin: Duration) -> Arc<Self> {
        Arc::new(Dispatcher {
            tags: Mutex::new(TagMap::default()),
            budget: budgets.0.max(1),
            total_budget: budgets.1.max(1),
            total: AtomicUsize::new(0),
            starved: AtomicBool::new(false),
            space: Arc::new(Notify::new()),
            cold: Arc::new(Notify::new()),
            progress_hook: OnceLock::new(),
            room_flags: Mutex::new(Vec::new()),
            policy: Hot {
                mode,
                spin_ns: spin.as_nanos() as u64,
                epoch: Instant::now(),
                last: AtomicU64::new(0),
                worked: AtomicBool::new(false),
                polled: AtomicU64::new(0),
                inline: AtomicU64::new(0),
                op_polls: AtomicU64::new(0),
                gave_way: AtomicU64::new(0),
                found: std::sync::atomic::AtomicU32::new(0),
                misses: std::sync::atomic::AtomicU32::new(0),
            },
        })
    }

    /// Install the function receivers call to make progress inline (held
    /// weakly: the caller keeps it alive).
    pub(crate) fn set_progress_hook(&self, f: &Poller) {
        let _ = self.progress_hook.set(Arc::downgrade(f));
    }

    /// The progress poller, if its fabric still has it.
    fn poller(&self) -> Option<Poller> {
        self.progress_hook.get()?.upgrade()
    }

    /// Run progress inline for a future that found nothing to return: the
    /// message or completion it waits for may be sitting in a ring already,
    /// and finding it here saves a cross-thread wake-up. Returns whether any
    /// work was done.
    ///
    /// While hot it polls a few times in a row before giving up: each trip
    /// through the runtime's scheduler costs more than a progress poll.
    pub(crate) fn progress_inline(&self) -> bool {
        let mut p = None;
        self.progress_inline_with(&mut p)
    }

    /// [`progress_inline`](Self::progress_inline) for a future waiting on
    /// an operation's completion, unless another such future ran it since
    /// this one's last poll (`seen`: the count of those calls it saw then,
    /// [`OP_UNSEEN`] before its first poll). A task waiting on many
    /// operations at once (a window of puts joined together) polls every
    /// one of them per wake-up, and one progress call, fabric-wide, serves
    /// them all (over udp each call is a system call: 64 per wake-up made
    /// small puts 8 times slower); a lone future runs it on every poll.
    /// Skipping is safe: a completion found by anyone's progress wakes its
    /// future.
    pub(crate) fn progress_inline_for_op(&self, seen: &mut u64) -> bool {
        let p = &self.policy;
        let n = p.op_polls.load(Ordering::Relaxed);
        if *seen != OP_UNSEEN && *seen != n {
            *seen = n;
            return false;
        }
        let n = n.wrapping_add(1) % OP_UNSEEN;
        p.op_polls.store(n, Ordering::Relaxed);
        *seen = n;
        self.progress_inline()
    }

    /// [`progress_inline`](Self::progress_inline) with the poller kept in
    /// `cache` (upgraded there on first use).
    fn progress_inline_with(&self, cache: &mut Option<Poller>) -> bool {
        if cache.is_none() {
            *cache = self.poller();
        }
        let Some(h) = cache.as_deref() else {
            return false;
        };
        // One turn first, without the clock: a receiver whose message is
        // already there (a ping-pong's usual case) reads no clock at all
        // (a clock read is about 8% of a hop's software path).
        if h.turns(1) > 0 {
            self.policy.touch();
            // No fresh time for `stay_hot`: it reads the clock if needed.
            self.policy.polled.store(0, Ordering::Relaxed);
            let found = &self.policy.found;
            let n = found.load(Ordering::Relaxed).wrapping_add(1);
            found.store(n, Ordering::Relaxed);
            if n % IDLE_EVERY == 0 {
                h.idle(self.policy.now_ns());
            }
            return true;
        }
        let now = self.policy.poll_now();
        if self.policy.is_hot(now) && h.turns(INLINE_TURNS - 1) > 0 {
            self.policy.touch();
            return true;
        }
        h.idle(now);
        false
    }

    /// Take the next message for `tag` into `buf` from a transport that
    /// hands it over without a progress turn (the poller kept in `cache`,
    /// as for [`progress_inline_with`](Self::progress_inline_with)). Unless
    /// progress is interrupt-driven, the transport looks up to
    /// [`DIRECT_LOOKS`] times while nothing else arrives.
    fn take_direct(
        &self,
        cache: &mut Option<Poller>,
        tag: Tag,
        queued: &AtomicUsize,
        buf: &mut Vec<u8>,
        more: &mut More<'_>,
    ) -> Option<Rank> {
        if cache.is_none() {
            *cache = self.poller();
        }
        let looks = match self.policy.mode {
            ProgressMode::Interrupt => 1,
            _ => DIRECT_LOOKS,
        };
        let src = cache
            .as_deref()?
            .take_direct(tag, queued, buf, more, looks)?;
        self.policy.touch();
        Some(src)
    }

    /// About to return `Pending`: while traffic is hot, have the task polled
    /// again at once on its own thread (busy-polling inside the caller's
    /// task, no cross-thread wake-up) and tell the progress task it may stand
    /// back. Returns whether it did (traffic is hot). Now and then the
    /// next poll waits for the runtime's I/O and timers instead (see
    /// [`Hot::give_way_due`]), so the program's other tasks are not held
    /// back.
    pub(crate) fn stay_hot(&self, cx: &mut Context<'_>) -> bool {
        let p = &self.policy;
        // The clock as this poll's inline progress read it (a microsecond
        // old at most).
        // (Zero: the poll found work on its first turn and read no clock.)
        let now = match p.polled.load(Ordering::Relaxed) {
            0 => p.poll_now(),
            now => now,
        };
        if p.is_hot(now) {
            p.inline.store(now, Ordering::Relaxed);
            if p.spinning_idle(now) {
                std::thread::yield_now();
            }
            if p.give_way_due(now) {
                give_way(cx);
            } else {
                cx.waker().wake_by_ref();
            }
            return true;
        }
        if p.inline.swap(0, Ordering::Relaxed) != 0 {
            // We were polling inline and stop now: hand over to the
            // progress task, which may be standing back.
            self.cold.notify_one();
        }
        false
    }

    /// The length word of `tag`'s queue (see `TagQueue::queued`).
    fn length_word(&self, tag: Tag) -> Option<Arc<AtomicUsize>> {
        lock(&self.tags).get(&tag).map(|q| q.queued.clone())
    }

    /// Whether a receiver has been polling progress inline within `window`:
    /// then a spinning progress task would only compete for the core.
    pub(crate) fn inline_polling(&self, window: Duration) -> bool {
        let p = &self.policy;
        p.now_ns().saturating_sub(p.inline.load(Ordering::Relaxed)) < window.as_nanos() as u64
    }

    /// Whether a message of `len` bytes may join a queue holding `queued`
    /// bytes (call under `tags`). An empty queue has room when the tags
    /// together have room, and everything empty always has room, so any
    /// single message gets through.
    fn room(&self, queued: usize, len: usize) -> (bool, bool) {
        let len = cost(len);
        let total = self.total.load(Ordering::Relaxed);
        let tag_ok = queued == 0 || queued + len <= self.budget;
        let all_ok = total == 0 || total + len <= self.total_budget;
        (tag_ok, all_ok)
    }

    /// Record a refusal (under `tags`): the queue's own, or the starvation
    /// of all tags together.
    fn refuse(&self, q: &mut TagQueue, tag_ok: bool) {
        if tag_ok {
            self.starved.store(true, Ordering::Relaxed);
        } else {
            q.refused = true;
        }
    }

    /// Whether a message of `len` bytes for `tag` may be accepted now.
    pub(crate) fn has_room(&self, tag: Tag, len: usize) -> bool {
        if self.would_hand_off(tag, len) {
            return true;
        }
        let mut tags = lock(&self.tags);
        // No entry is made for a tag only asked about: a peer naming many
        // tags must not grow the table.
        let queued = tags.get(&tag).map_or(0, |q| q.bytes);
        let (tag_ok, all_ok) = self.room(queued, len);
        if !tag_ok {
            if let Some(q) = tags.get_mut(&tag) {
                self.refuse(q, false);
            }
        } else if !all_ok {
            self.starved.store(true, Ordering::Relaxed);
        }
        tag_ok && all_ok
    }

    /// Progress did work: waiters stay hot a while longer. (Called once per
    /// progress call that did work, not per message: it reads the clock.)
    pub(crate) fn note_work(&self) {
        self.policy.touch();
    }

    /// The sender of the message this thread's inline receiver of `tag`
    /// (on this dispatcher) was handed into the buffer it lent, if it was:
    /// its poll ends with that one, so a transport may leave that sender's
    /// next message in place for the receiver's next look (see
    /// `Transport::take_direct`) instead of copying it into a buffer of its
    /// own.
    pub(crate) fn lent_taken(&self, tag: Tag) -> Option<Rank> {
        INLINE
            .try_with(|c| {
                let c = c.try_borrow().ok()?;
                let i = c.as_ref()?;
                let ours = i.disp == self as *const Dispatcher as usize && i.tag == tag;
                if ours && i.lent.is_some() {
                    i.lent_src
                } else {
                    None
                }
            })
            .ok()
            .flatten()
    }

    /// Whether [`hand_over`](Self::hand_over) would take a message of
    /// `len` bytes for `tag` now, without the lock (then it needs no room
    /// in the queue).
    fn would_hand_off(&self, tag: Tag, len: usize) -> bool {
        INLINE
            .try_with(|c| {
                let c = c.try_borrow().ok()?;
                let i = c.as_ref()?;
                let empty = i.queued.load(Ordering::Relaxed) == 0;
                Some(i.takes(self, tag, len, empty))
            })
            .ok()
            .flatten()
            .unwrap_or(false)
    }

    /// Hand the message `make` builds (`len` bytes from `src` on `tag`) to
    /// this thread's inline receiver of its tag if that one takes it (see
    /// [`Inline`]); else give `make` back, not called.
    ///
    /// Without `locked`, no lock is taken and the registration's length
    /// word says whether the queue is empty. The caller must then deliver
    /// after the same pair's earlier deliveries in the happens-before sense
    /// (transports deliver a pair's messages under one receive lock; the
    /// self link on the sending thread), so that the word is current for
    /// this pair and order holds.
    ///
    /// With `locked`, the caller holds `tags` and saw the queue empty; the
    /// receiver's `handed` bytes are then taken out and returned, for the
    /// caller to give back to the budgets.
    #[inline]
    fn hand_over<P: Payload>(
        &self,
        (src, tag, len): (Rank, Tag, usize),
        locked: bool,
        make: P,
    ) -> std::result::Result<usize, P> {
        let mut make = Some(make);
        let handed = INLINE
            .try_with(|c| {
                let mut c = c.try_borrow_mut().ok()?;
                let i = c.as_mut()?;
                let empty = locked || i.queued.load(Ordering::Relaxed) == 0;
                if !i.takes(self, tag, len, empty) {
                    return None;
                }
                if i.lent.is_some() && i.lent_src.is_none() && i.items.is_empty() {
                    lend(i, src, make.take()?);
                } else {
                    let make = make.take()?;
                    let item = match &mut i.keep {
                        Some(k) if P::COPIES && k.len().saturating_add(len) <= KEEP_MAX => {
                            let at = k.len();
                            make.copy_into(k);
                            let len = (k.len() - at) as u32;
                            Held::Kept {
                                src,
                                at: at as u32,
                                len,
                            }
                        }
                        _ => Held::Item(Ok(Message::carried(src, tag, make.into_bytes()))),
                    };
                    i.bytes = i.bytes.saturating_add(cost(len));
                    i.items.push_back(item);
                }
                Some(if locked {
                    std::mem::take(&mut i.handed)
                } else {
                    0
                })
            })
            .ok()
            .flatten();
        match make {
            None => Ok(handed.unwrap_or(0)),
            Some(f) => Err(f),
        }
    }

    /// Queue `msg` on `q` (under `tags`), or hand it to this thread's
    /// inline receiver of its tag when the queue is empty; returns the
    /// waker to wake, if any.
    fn enqueue(&self, q: &mut TagQueue, msg: Message) -> Option<Waker> {
        // A lent message is never handed over: the inline receiver takes
        // carried bytes only.
        let msg = if q.items.is_empty() && msg.lent.is_none() {
            let Message { src, tag, data, .. } = msg;
            match self.hand_over((src, tag, data.len()), true, move || data) {
                Ok(handed) => {
                    self.give_back_budget(q, handed);
                    return None;
                }
                Err(data) => Message::carried(src, tag, data.into_bytes()),
            }
        } else {
            msg
        };
        q.bytes += cost(msg.data.len());
        self.add_total(cost(msg.data.len()));
        q.items.push_back(Ok(msg));
        q.queued.store(q.items.len(), Ordering::Relaxed);
        q.waker.take()
    }

    /// Queue a complete message and wake its receiver.
    ///
    /// The caller delivers after the same pair's earlier deliveries in the
    /// happens-before sense (see [`hand_over`](Self::hand_over)).
    pub(crate) fn deliver(&self, msg: Message) {
        if msg.lent.is_none() {
            let Message { src, tag, data, .. } = msg;
            return self.deliver_payload(src, tag, data.len(), move || data);
        }
        self.queue_and_wake(msg);
    }

    /// [`deliver`](Self::deliver) of a message of `len` bytes that `make`
    /// builds: copied straight into a waiting receiver's buffer where one
    /// takes it (see [`Payload`]), else made into bytes of its own and
    /// queued. Same ordering contract as `deliver`.
    pub(crate) fn deliver_payload<P: Payload>(&self, src: Rank, tag: Tag, len: usize, make: P) {
        let data = match self.hand_over((src, tag, len), false, make) {
            Ok(_) => return,
            Err(make) => make.into_bytes(),
        };
        self.queue_and_wake(Message::carried(src, tag, data));
    }

    /// Queue `msg` (or hand it over, see `enqueue`) under the tag table's
    /// lock, and wake its receiver.
    fn queue_and_wake(&self, msg: Message) {
        let w = {
            let mut tags = lock(&self.tags);
            let q = tags.entry(msg.tag).or_default();
            self.enqueue(q, msg)
        };
        if let Some(w) = w {
            crate::core::progress::wake(w);
        }
    }

    /// Run `f` with the tag table locked once, for a run of
    /// [`Offers::offer`]s (a lock per message cost the receive path as much
    /// as the rest of taking a small message). Receivers are woken after
    /// the lock is released.
    pub(crate) fn offers<R>(&self, f: impl FnOnce(&mut Offers<'_>) -> R) -> R {
        let mut o = Offers {
            disp: self,
            tags: None,
            wake: Vec::new(),
        };
        let r = f(&mut o);
        let Offers { tags, wake, .. } = o;
        drop(tags);
        wake.into_iter().for_each(crate::core::progress::wake);
        r
    }

    /// Add to `total` (under `tags`, its only writers: a plain load and
    /// store, no locked read-modify-write on the receive path).
    fn add_total(&self, n: usize) {
        let t = self.total.load(Ordering::Relaxed);
        self.total.store(t.saturating_add(n), Ordering::Relaxed);
    }

    /// Subtract from `total` (under `tags`, as [`add_total`](Self::add_total)).
    fn sub_total(&self, n: usize) {
        let t = self.total.load(Ordering::Relaxed);
        self.total.store(t.saturating_sub(n), Ordering::Relaxed);
    }

    /// Tell every open receiver that `rank` is gone.
    pub(crate) fn peer_lost(&self, rank: Rank, reason: &str) {
        let mut wake = Vec::new();
        {
            let mut tags = lock(&self.tags);
            for q in tags.values_mut().filter(|q| q.taken) {
                q.items.push_back(Err(Error::PeerLost {
                    rank,
                    reason: reason.to_string(),
                }));
                q.queued.store(q.items.len(), Ordering::Relaxed);
                wake.extend(q.waker.take());
            }
        }
        wake.into_iter().for_each(Waker::wake);
    }

    /// Wake every receiver so it sees the fabric closed.
    pub(crate) fn close(&self) {
        let wakers: Vec<_> = lock(&self.tags)
            .values_mut()
            .filter_map(|q| q.waker.take())
            .collect();
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Open the receiver for `tag`; one at a time per tag.
    pub(crate) fn take(
        self: &Arc<Self>,
        tag: Tag,
        closed: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Receiver> {
        let mut tags = lock(&self.tags);
        let q = tags.entry(tag).or_default();
        if q.taken {
            return Err(Error::Misuse(format!(
                "tag {tag} already has a receiver: keep one Receiver per tag (clone the messages, or use more tags)"
            )));
        }
        q.taken = true;
        Ok(Receiver {
            disp: self.clone(),
            tag,
            closed,
            queued: Some(q.queued.clone()),
            local: VecDeque::new(),
            keep: Vec::new(),
            free: 0,
            poller: None,
            handed: 0,
        })
    }

    /// Move up to [`POP_BATCH`] items of `tag`'s queue into `out` (empty),
    /// first taking `handed` bytes (the cost of messages the caller handed
    /// out since its last call) off the budgets; with `cx`, register for a
    /// wake-up when there is none. `Ready(None)`: the tag has no queue.
    ///
    /// Messages moved out still count against the budgets until they are
    /// handed out and reported back here (large ones at once), so memory
    /// stays bounded as if they were still queued; batching saves a lock
    /// per small message.
    fn refill(
        &self,
        tag: Tag,
        handed: &mut usize,
        out: &mut VecDeque<Held>,
        cx: Option<&Context<'_>>,
    ) -> Poll<Option<()>> {
        let mut tags = lock(&self.tags);
        let Some(q) = tags.get_mut(&tag) else {
            return Poll::Ready(None);
        };
        self.give_back_budget(q, std::mem::take(handed));
        if q.items.is_empty() {
            if let Some(cx) = cx {
                match &mut q.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    w => *w = Some(cx.waker().clone()),
                }
            }
            return Poll::Pending;
        }
        let n = q.items.len().min(POP_BATCH);
        out.extend(q.items.drain(..n).map(Held::Item));
        q.queued.store(q.items.len(), Ordering::Relaxed);
        Poll::Ready(Some(()))
    }

    /// Take `gone` bytes of handed-out messages off `q`'s and the total
    /// budget (under `tags`), and wake progress if that makes room it was
    /// refused.
    fn give_back_budget(&self, q: &mut TagQueue, gone: usize) {
        if gone == 0 {
            return;
        }
        q.bytes = q.bytes.saturating_sub(gone);
        self.sub_total(gone);
        // Load first: a swap on every call would cost an atomic
        // read-modify-write.
        let starved =
            self.starved.load(Ordering::Relaxed) && self.starved.swap(false, Ordering::Relaxed);
        if std::mem::take(&mut q.refused) || starved {
            self.made_room();
        }
    }

    /// Room was made that was refused: wake a parked progress task, and
    /// raise the transports' room flags (see [`Dispatcher::on_room`]).
    fn made_room(&self) {
        self.space.notify_waiters();
        self.space.notify_one();
        for f in lock(&self.room_flags).iter() {
            f.store(true, Ordering::Relaxed);
        }
    }

    /// Set `flag` whenever room refused before is made (a receiver took
    /// messages off a full tag queue, or dropped them): a transport that
    /// holds messages for room and polls on while hot looks at them at its
    /// next poll, rather than only with other traffic or at a park.
    /// (`rdma` is the transport that holds messages so.)
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn on_room(&self, flag: Arc<AtomicBool>) {
        lock(&self.room_flags).push(flag);
    }

    /// Take a large handed-out message's `cost` off the budgets at once.
    fn settle(&self, tag: Tag, cost: usize) {
        if let Some(q) = lock(&self.tags).get_mut(&tag) {
            self.give_back_budget(q, cost);
        }
    }

    /// Put back the items a receiver moved out but did not hand out (it is
    /// dropped), in front and in order, and take `handed` bytes off. The
    /// first `uncharged` of them were handed over inline and are charged
    /// to the budgets now, like any queued message.
    fn unpop(&self, tag: Tag, handed: usize, back: VecDeque<Result<Message>>, uncharged: usize) {
        let mut tags = lock(&self.tags);
        if let Some(q) = tags.get_mut(&tag) {
            q.bytes = q.bytes.saturating_sub(handed);
            self.sub_total(handed);
            let charge: usize = back
                .iter()
                .take(uncharged)
                .map(|m| m.as_ref().map_or(0, |m| cost(m.data.len())))
                .sum();
            q.bytes = q.bytes.saturating_add(charge);
            self.add_total(charge);
            for item in back.into_iter().rev() {
                q.items.push_front(item);
            }
            q.queued.store(q.items.len(), Ordering::Relaxed);
            if handed > 0 {
                self.made_room();
            }
        }
    }

    fn release(&self, tag: Tag) {
        if let Some(q) = lock(&self.tags).get_mut(&tag) {
            q.taken = false;
            q.waker = None;
        }
    }
}

/// A run of offers under one lock of the tag table ([`Dispatcher::offers`]),
/// taken at the first offer that is not handed over inline (none, when all
/// are: see [`Inline`]).
pub(crate) struct Offers<'a> {
    disp: &'a Dispatcher,
    tags: Option<std::sync::MutexGuard<'a, TagMap>>,
    wake: Vec<Waker>,
}

impl Offers<'_> {
    /// [`Dispatcher::has_room`] and [`Dispatcher::deliver`] in one: if a
    /// message of `len` bytes for `tag` may be accepted, `make` builds it
    /// and it is queued or handed over. Returns whether it was. The caller
    /// delivers as [`Dispatcher::deliver`] requires.
    pub(crate) fn offer(&mut self, src: Rank, tag: Tag, len: usize, make: impl Payload) -> bool {
        let d = self.disp;
        // The caller holds its receive lock (see `Dispatcher::hand_over`).
        let make = match d.hand_over((src, tag, len), false, make) {
            Ok(_) => return true,
            Err(make) => make,
        };
        let q = self
            .tags
            .get_or_insert_with(|| lock(&d.tags))
            .entry(tag)
            .or_default();
        let (tag_ok, all_ok) = d.room(q.bytes, len);
        if !(tag_ok && all_ok) {
            d.refuse(q, tag_ok);
            return false;
        }
        let data = make.into_bytes();
        let w = d.enqueue(q, Message::carried(src, tag, data));
        self.wake.extend(w);
        true
    }
}

/// The stream of messages arriving on one tag, from every peer. Items are
/// `Err(PeerLost)` once for each peer that dies while the receiver is open.
///
/// Messages from one sender arrive in the order it sent them; messages from
/// different senders interleave in arrival order. Messages that arrive
/// before the tag has a receiver wait for one, within the tag's budget
/// (`BTL_RECV_BUDGET`): past it the senders are held back, not dropped.
///
/// ```no_run
/// # async fn demo(fabric: &async_btl::Fabric) -> async_btl::Result<()> {
/// use futures::StreamExt;
/// let mut rx = fabric.receiver(7)?;
/// let first = rx.recv().await?; // one message
/// while let Some(msg) = rx.next().await {
///     let msg = msg?; // or a peer lost
///     println!("{} bytes from rank {}", msg.data.len(), msg.src);
/// }
/// # let _ = first; Ok(()) }
/// ```
///
/// # Cancel safety
/// Dropping a pending `next()` loses nothing: messages stay queued. Dropping
/// the `Receiver` keeps queued messages for the next receiver of the tag.
#[must_use = "a receiver does nothing unless polled"]
pub struct Receiver {
    disp: Arc<Dispatcher>,
    tag: Tag,
    closed: Arc<std::sync::atomic::AtomicBool>,
    /// The tag queue's length as last stored under its lock (see
    /// `TagQueue::queued`); lent to the inline registration during a poll
    /// (`None` only if a poll unwound: then every poll looks in the queue).
    queued: Option<Arc<AtomicUsize>>,
    /// Items taken from the tag's queue in one lock, or handed over inline,
    /// handed out one by one.
    local: VecDeque<Held>,
    /// Where small messages handed over inline to `recv_into` keep their
    /// payloads (see [`Held::Kept`]); emptied at each registration, when
    /// `local` holds none of them.
    keep: Vec<u8>,
    /// How many of `local`'s first items were handed over inline and so
    /// were never charged to the budgets.
    free: usize,
    /// The fabric's progress poller, upgraded once while the receiver
    /// polls hot (dropped when it goes to sleep and when the fabric closes,
    /// so a receiver kept longer does not keep the transports).
    poller: Option<Poller>,
    /// Budget bytes of messages handed out since the last refill, given
    /// back to the budgets at the next one.
    handed: usize,
}

impl Receiver {
    /// The tag this receiver serves.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// Wait for the next message (shorthand for `StreamExt::next`, with the
    /// end of the stream as [`Error::Closed`]).
    pub async fn recv(&mut self) -> Result<Message> {
        futures::StreamExt::next(self)
            .await
            .unwrap_or(Err(Error::Closed))
    }

    /// The next message if one is here now, without waiting: what one poll
    /// of [`recv`](Self::recv) finds, after one progress call of its own
    /// (so a message already in shared memory is taken). `Ok(None)`: none
    /// yet. Errors are those of `recv`: a lost peer's
    /// [`Error::PeerLost`] once, [`Error::Closed`] when the fabric is
    /// closed and nothing is left.
    ///
    /// ```no_run
    /// # async fn demo(f: &async_btl::Fabric) -> async_btl::Result<()> {
    /// let mut rx = f.receiver(7)?;
    /// // Drain what has arrived, then go on with other work.
    /// while let Some(m) = rx.try_recv()? {
    ///     println!("{} bytes from rank {}", m.data.len(), m.src);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn try_recv(&mut self) -> Result<Option<Message>> {
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        match Pin::new(&mut *self).poll_next(&mut cx) {
            Poll::Ready(Some(Ok(m))) => Ok(Some(m)),
            Poll::Ready(Some(Err(e))) => Err(e),
            Poll::Ready(None) => Err(Error::Closed),
            Poll::Pending => Ok(None),
        }
    }
}

impl Receiver {
    /// Wait for the next message from `src` on this tag, leaving messages
    /// from other ranks queued, in order, for later receives: per-(source,
    /// tag) order holds across `recv` and `recv_from`. `Err(PeerLost)` when
    /// `src` is lost (other ranks' losses stay queued for `recv`).
    ///
    /// Messages from other ranks that arrive meanwhile wait within the
    /// tag's budget (`BTL_RECV_BUDGET`): once they fill it, every sender on
    /// the tag, `src` among them, is held back. A program that waits on one
    /// source while others keep sending on the same tag must read theirs
    /// too (or use a tag per source).
    ///
    /// ```no_run
    /// # async fn demo(f: &async_btl::Fabric) -> async_btl::Result<()> {
    /// let mut rx = f.receiver(3)?;
    /// let from_two = rx.recv_from(2).await?; // whatever rank 1 sent waits
    /// let next = rx.recv().await?;           // from anyone, in arrival order
    /// # let _ = (from_two, next); Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// Dropping the future loses nothing: messages stay with the receiver.
    pub async fn recv_from(&mut self, src: crate::Rank) -> Result<Message> {
        futures::future::poll_fn(|cx| self.poll_recv_from(src, cx)).await
    }

    /// Wait for the next message on this tag and put it in `buf` (cleared
    /// first; its capacity is kept and grown as needed), returning its
    /// sender: [`recv`](Self::recv) for a loop that reuses one buffer.
    ///
    /// When this receiver's own progress finds the message (a receiver
    /// waiting while traffic is hot, one message at a time, as in a
    /// request loop or a ping-pong), it is copied straight from where the
    /// transport holds it into `buf`: over `sm`'s fast boxes (messages up
    /// to 1 KiB) no buffer is allocated for it at all. The others that
    /// progress call finds (several arrived at once) are copied into one
    /// buffer the receiver keeps and reuses (up to 64 KiB of them), so a
    /// stream of small messages allocates nothing per message either. A
    /// message the progress task queued meanwhile is copied out of its
    /// queued buffer.
    ///
    /// ```no_run
    /// # async fn demo(f: &async_btl::Fabric) -> async_btl::Result<()> {
    /// let mut rx = f.receiver(3)?;
    /// let mut buf = Vec::with_capacity(1024);
    /// loop {
    ///     let src = rx.recv_into(&mut buf).await?;
    ///     if buf.is_empty() {
    ///         break;
    ///     }
    ///     println!("{} bytes from rank {src}", buf.len());
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// A lent message (device memory a same-node rank sent with
    /// [`Endpoint::send_region`](crate::Endpoint::send_region)) cannot be
    /// taken this way: it is taken and declined (its sender's future fails
    /// with [`Error::Declined`]), and this fails with [`Error::Misuse`].
    /// Receive such messages with [`recv`](Self::recv) or
    /// [`recv_region`](Self::recv_region).
    ///
    /// # Cancel safety
    /// Dropping the future loses nothing: a message is either in `buf`
    /// when the future completes, or still with the receiver.
    pub fn recv_into<'a>(&'a mut self, buf: &'a mut Vec<u8>) -> RecvInto<'a> {
        RecvInto { rx: self, buf }
    }

    /// Poll for the next message into `buf` (see
    /// [`recv_into`](Self::recv_into)). `Err(Closed)` once the fabric is
    /// closed and nothing is left.
    pub fn poll_recv_into(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut Vec<u8>,
    ) -> Poll<Result<crate::Rank>> {
        match self.poll_take(cx, Some(&mut *buf)) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => Poll::Ready(Err(Error::Closed)),
            Poll::Ready(Some(Took::Lent(src))) => Poll::Ready(Ok(src)),
            Poll::Ready(Some(Took::Item(Held::Kept { src, at, len }))) => {
                buf.clear();
                buf.extend_from_slice(kept(&self.keep, at, len));
                Poll::Ready(Ok(src))
            }
            Poll::Ready(Some(Took::Item(Held::Item(Ok(m))))) if m.is_lent() => {
                // Its bytes are the sender's: declined when `m` goes.
                m.refused_by("recv_into");
                Poll::Ready(Err(Error::Misuse(format!(
                    "rank {} lent {} bytes on tag {} (device memory), which recv_into cannot \
                     take: receive such messages with recv or recv_region; it was declined",
                    m.src,
                    m.len(),
                    self.tag
                ))))
            }
            Poll::Ready(Some(Took::Item(Held::Item(Ok(m))))) => {
                buf.clear();
                buf.extend_from_slice(&m.data);
                Poll::Ready(Ok(m.src))
            }
            Poll::Ready(Some(Took::Item(Held::Item(Err(e))))) => Poll::Ready(Err(e)),
        }
    }

    /// Wait for the next message on this tag and land its bytes in `dst`
    /// at `offset`, returning its sender and length: for device memory
    /// what [`recv_into`](Self::recv_into) is for a `Vec`. A lent message
    /// (sent by [`Endpoint::send_region`](crate::Endpoint::send_region)
    /// from device memory on this node) is read from the sender's region,
    /// one GPU copy when `dst` is device memory too; a carried message is
    /// written. See [`Message::fetch_into`].
    ///
    /// A message longer than `dst` has room for at `offset` is left with
    /// the receiver and this fails with [`Error::Misuse`]: take it with
    /// [`recv`](Self::recv), or into a larger region.
    ///
    /// ```no_run
    /// # async fn demo(f: &async_btl::Fabric) -> async_btl::Result<()> {
    /// let gpu = f.alloc_device_region(0, 64 << 20)?;
    /// let mut rx = f.receiver(9)?;
    /// let (src, len) = rx.recv_region(&gpu, 0).await?;
    /// # let _ = (src, len); Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// Dropping the future before the message is taken loses nothing.
    /// Once taken, a lent message whose copy was under way is declined
    /// (its copy still finishes into `dst`, which stays alive for it).
    pub async fn recv_region(
        &mut self,
        dst: &crate::MemoryRegion,
        offset: usize,
    ) -> Result<(crate::Rank, usize)> {
        let (src, len) = futures::future::poll_fn(|cx| self.poll_head(cx)).await?;
        if !offset.checked_add(len).is_some_and(|end| end <= dst.len()) {
            return Err(Error::Misuse(format!(
                "the next message on tag {} (rank {src}, {len} bytes) does not fit at offset \
                 {offset} of a {}-byte region; it stays with the receiver",
                self.tag,
                dst.len()
            )));
        }
        let m = self.take_at(0)?;
        let n = m.fetch_into(dst, offset).await?;
        Ok((m.src, n))
    }

    /// The sender and length of the item [`recv`](Self::recv) would take
    /// next, once there is one (a lost peer's error is taken).
    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Result<(crate::Rank, usize)>> {
        self.poll_local(cx, |me| match me.local.front()? {
            Held::Item(Ok(m)) => Some(Ok((m.src, m.len()))),
            Held::Kept { src, len, .. } => Some(Ok((*src, *len as usize))),
            Held::Item(Err(_)) => Some(me.take_at(0).map(|m| (m.src, m.len()))),
        })
    }

    /// Poll for the next message from `src` (see [`recv_from`](Self::recv_from)).
    pub fn poll_recv_from(
        &mut self,
        src: crate::Rank,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Message>> {
        self.poll_local(cx, |me| me.position_from(src).map(|i| me.take_at(i)))
    }

    /// Poll until `found` answers from what the receiver holds: after it
    /// finds nothing, more from the queue (appended after what is here),
    /// then our own progress once, before waiting.
    fn poll_local<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut found: impl FnMut(&mut Self) -> Option<Result<T>>,
    ) -> Poll<Result<T>> {
        let mut progressed = false;
        loop {
            if let Some(r) = found(self) {
                return Poll::Ready(r);
            }
            match self
                .disp
                .refill(self.tag, &mut self.handed, &mut self.local, Some(cx))
            {
                Poll::Ready(None) => return Poll::Ready(Err(Error::Closed)),
                Poll::Ready(Some(())) => continue,
                Poll::Pending => {}
            }
            if self.closed.load(std::sync::atomic::Ordering::Acquire) {
                return Poll::Ready(Err(Error::Closed));
            }
            if progressed {
                return Poll::Pending;
            }
            self.disp.progress_inline_with(&mut self.poller);
            progressed = true;
        }
    }

    /// Whether a message is waiting on this tag now, and from whom and how
    /// large: `(source, length)` of the one [`recv`](Self::recv) would
    /// return next, without taking it (after one progress call of its own,
    /// as [`try_recv`](Self::try_recv) makes). `Ok(None)`: none yet. A lost
    /// peer waiting to be reported is returned as its `Err(PeerLost)`, and
    /// stays for `recv`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> async_btl::Result<()> {
    /// let f = async_btl::Fabric::single().await?;
    /// let mut rx = f.receiver(7)?;
    /// f.endpoint(0)?.send(7, vec![0u8; 300]).await?;
    /// // Size the buffer before taking the message.
    /// let (src, len) = loop {
    ///     if let Some(p) = rx.probe()? {
    ///         break p;
    ///     }
    ///     tokio::task::yield_now().await;
    /// };
    /// let mut buf = Vec::with_capacity(len);
    /// assert_eq!(rx.recv_into(&mut buf).await?, src);
    /// assert_eq!(buf.len(), 300);
    /// # f.close().await }
    /// ```
    pub fn probe(&mut self) -> Result<Option<(crate::Rank, usize)>> {
        self.probe_where(|_| true)
    }

    /// [`probe`](Self::probe) for messages from `src` only (what
    /// [`recv_from`](Self::recv_from) would return next).
    pub fn probe_from(&mut self, src: crate::Rank) -> Result<Option<(crate::Rank, usize)>> {
        self.probe_where(|r| r == src)
    }

    fn probe_where(
        &mut self,
        want: impl Fn(crate::Rank) -> bool,
    ) -> Result<Option<(crate::Rank, usize)>> {
        let find = |local: &VecDeque<Held>| {
            local.iter().find_map(|it| match it {
                Held::Item(Ok(m)) if want(m.src) => Some(Ok((m.src, m.len()))),
                Held::Kept { src, len, .. } if want(*src) => Some(Ok((*src, *len as usize))),
                Held::Item(Err(Error::PeerLost { rank, reason })) if want(*rank) => {
                    Some(Err(Error::PeerLost {
                        rank: *rank,
                        reason: reason.clone(),
                    }))
                }
                _ => None,
            })
        };
        if let Some(r) = find(&self.local) {
            return r.map(Some);
        }
        while let Poll::Ready(Some(())) =
            self.disp
                .refill(self.tag, &mut self.handed, &mut self.local, None)
        {
            if let Some(r) = find(&self.local) {
                return r.map(Some);
            }
        }
        self.disp.progress_inline_with(&mut self.poller);
        while let Poll::Ready(Some(())) =
            self.disp
                .refill(self.tag, &mut self.handed, &mut self.local, None)
        {
            if let Some(r) = find(&self.local) {
                return r.map(Some);
            }
        }
        if self.closed.load(std::sync::atomic::Ordering::Acquire) && self.local.is_empty() {
            return Err(Error::Closed);
        }
        Ok(None)
    }

    /// Where in `local` the first item for `src` is.
    fn position_from(&self, src: crate::Rank) -> Option<usize> {
        self.local.iter().position(|it| it.src() == Some(src))
    }

    /// Take `local[i]` out, charging it as [`next_local`](Self::next_local)
    /// charges the first.
    fn take_at(&mut self, i: usize) -> Result<Message> {
        let Some(held) = self.local.remove(i) else {
            return Err(Error::Closed);
        };
        if i < self.free {
            self.free -= 1;
        } else {
            self.charge(&held);
        }
        held.resolve(self.tag, &self.keep)
    }
}

/// What one look of a receiver found: an item of its queue, or a message
/// copied into the buffer it lent.
enum Took {
    Item(Held),
    Lent(Rank),
}

impl Stream for Receiver {
    type Item = Result<Message>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let me = self.get_mut();
        // Look, make progress inline, and only then register for a wake-up:
        // a message found by our own progress needs no waker.
        if let Some(x) = me.next_message() {
            return Poll::Ready(Some(x));
        }
        if me.queued.is_none() {
            // Lost to a poll that unwound: take it again.
            me.queued = me.disp.length_word(me.tag);
        }
        // Look in the queue first only if something is there (the progress
        // task may have queued it), or to give back the budget of what we
        // handed out since the last look: a lock and a lookup less per
        // message when this receiver's own progress finds it. (A stale zero
        // only defers the look to the refill below.)
        if me.handed > 0
            || me
                .queued
                .as_ref()
                .map_or(true, |q| q.load(std::sync::atomic::Ordering::Relaxed) > 0)
        {
            match me.disp.refill(me.tag, &mut me.handed, &mut me.local, None) {
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(())) => return Poll::Ready(me.next_message()),
                Poll::Pending => {}
            }
        }
        if me.closed.load(std::sync::atomic::Ordering::Acquire) {
            // No more progress: let the transports go with their fabric,
            // and hand out what is queued, then end.
            me.poller = None;
            return match me.disp.refill(me.tag, &mut me.handed, &mut me.local, None) {
                Poll::Ready(Some(())) => Poll::Ready(me.next_message()),
                _ => Poll::Ready(None),
            };
        }
        // Messages for our tag that our own progress finds come straight
        // to us (see `Inline`), without a second trip through the queue.
        // (`local` is empty here: it was drained above.)
        match me.queued.take() {
            Some(queued) => {
                let buf = std::mem::take(&mut me.local);
                let handed = std::mem::take(&mut me.handed);
                match InlineGuard::register(&me.disp, me.tag, queued, buf, handed, None, None) {
                    Ok(guard) => {
                        me.disp.progress_inline_with(&mut me.poller);
                        if let Some(i) = guard.take() {
                            me.queued = Some(i.queued);
                            me.free = i.items.len();
                            me.local = i.items;
                            me.handed = i.handed;
                        }
                    }
                    Err((queued, buf, _)) => {
                        (me.queued, me.local, me.handed) = (Some(queued), buf, handed);
                        me.disp.progress_inline_with(&mut me.poller);
                    }
                }
            }
            None => {
                me.disp.progress_inline_with(&mut me.poller);
            }
        }
        if !me.local.is_empty() {
            return Poll::Ready(me.next_message());
        }
        match me
            .disp
            .refill(me.tag, &mut me.handed, &mut me.local, Some(cx))
        {
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Ready(Some(())) => return Poll::Ready(me.next_message()),
            Poll::Pending => {}
        }
        if me.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Poll::Ready(None);
        }
        if !me.disp.stay_hot(cx) {
            // Going to sleep: a receiver nobody polls keeps no transports.
            me.poller = None;
        }
        Poll::Pending
    }
}

impl Receiver {
    /// `poll_next` for `poll_recv_into`: the same steps, and the first
    /// message the receiver's own progress finds is copied into `lent`
    /// (see `Inline::lent`). (`poll_next` keeps its own copy of these
    /// steps: sharing this one cost its streams of small messages about a
    /// tenth of their rate.)
    fn poll_take(
        &mut self,
        cx: &mut Context<'_>,
        mut lent: Option<&mut Vec<u8>>,
    ) -> Poll<Option<Took>> {
        let me = self;
        // Look, make progress inline, and only then register for a wake-up:
        // a message found by our own progress needs no waker.
        if let Some(x) = me.next_local() {
            return Poll::Ready(Some(Took::Item(x)));
        }
        if me.queued.is_none() {
            // Lost to a poll that unwound: take it again.
            me.queued = me.disp.length_word(me.tag);
        }
        // Look in the queue first only if something is there (the progress
        // task may have queued it), or to give back the budget of what we
        // handed out since the last look: a lock and a lookup less per
        // message when this receiver's own progress finds it. (A stale zero
        // only defers the look to the refill below.)
        if me.handed > 0
            || me
                .queued
                .as_ref()
                .map_or(true, |q| q.load(std::sync::atomic::Ordering::Relaxed) > 0)
        {
            match me.disp.refill(me.tag, &mut me.handed, &mut me.local, None) {
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(())) => return Poll::Ready(me.next_local().map(Took::Item)),
                Poll::Pending => {}
            }
        }
        if me.closed.load(std::sync::atomic::Ordering::Acquire) {
            // No more progress: let the transports go with their fabric,
            // and hand out what is queued, then end.
            me.poller = None;
            return match me.disp.refill(me.tag, &mut me.handed, &mut me.local, None) {
                Poll::Ready(Some(())) => Poll::Ready(me.next_local().map(Took::Item)),
                _ => Poll::Ready(None),
            };
        }
        // A small message waiting at the head of a peer's stream goes
        // straight into a lent buffer (see `Transport::take_direct`), with
        // no registration and no progress turn; those waiting behind it
        // from the same sender come to `local`, handed over like those of
        // an inline registration (never charged). (`local` is empty here,
        // so nothing refers to the kept buffer.)
        if let (Some(buf), Some(queued)) = (lent.as_deref_mut(), me.queued.as_deref()) {
            me.keep.clear();
            let mut more = More::new(&mut me.keep, &mut me.local, MORE_MAX);
            let took = me
                .disp
                .take_direct(&mut me.poller, me.tag, queued, buf, &mut more);
            me.free = me.local.len();
            if let Some(src) = took {
                return Poll::Ready(Some(Took::Lent(src)));
            }
        }
        // Messages for our tag that our own progress finds come straight
        // to us (see `Inline`), without a second trip through the queue.
        // (`local` is empty here: it was drained above.)
        match me.queued.take() {
            Some(queued) => {
                let buf = std::mem::take(&mut me.local);
                let handed = std::mem::take(&mut me.handed);
                let lent_ptr = lent.take().map(std::ptr::NonNull::from);
                // `local` is empty: nothing refers to what the kept buffer
                // holds.
                let mut keep = std::mem::take(&mut me.keep);
                keep.clear();
                let keep = Some(keep);
                match InlineGuard::register(&me.disp, me.tag, queued, buf, handed, lent_ptr, keep) {
                    Ok(guard) => {
                        me.disp.progress_inline_with(&mut me.poller);
                        if let Some(i) = guard.take() {
                            me.keep = i.keep.unwrap_or_default();
                            me.queued = Some(i.queued);
                            me.free = i.items.len();
                            me.local = i.items;
                            me.handed = i.handed;
                            if let Some(src) = i.lent_src {
                                // First in order: whatever else was handed
                                // over came after it.
                                return Poll::Ready(Some(Took::Lent(src)));
                            }
                        }
                    }
                    Err((queued, buf, keep)) => {
                        (me.queued, me.local, me.handed) = (Some(queued), buf, handed);
                        me.keep = keep.unwrap_or_default();
                        me.disp.progress_inline_with(&mut me.poller);
                    }
                }
            }
            None => {
                me.disp.progress_inline_with(&mut me.poller);
            }
        }
        if !me.local.is_empty() {
            return Poll::Ready(me.next_local().map(Took::Item));
        }
        match me
            .disp
            .refill(me.tag, &mut me.handed, &mut me.local, Some(cx))
        {
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Ready(Some(())) => return Poll::Ready(me.next_local().map(Took::Item)),
            Poll::Pending => {}
        }
        if me.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Poll::Ready(None);
        }
        if !me.disp.stay_hot(cx) {
            // Going to sleep: a receiver nobody polls keeps no transports.
            me.poller = None;
        }
        Poll::Pending
    }
}

/// Future of [`Receiver::recv_into`]: the next message's sender, its
/// bytes in the buffer given. A named type (it polls
/// [`Receiver::poll_recv_into`] and nothing else), so a loop of receives
/// pays no generated state machine per message and the future can be kept
/// in a struct.
///
/// # Cancel safety
/// As for [`Receiver::recv_into`]: dropping it loses nothing.
#[must_use = "futures do nothing unless polled"]
pub struct RecvInto<'a> {
    rx: &'a mut Receiver,
    buf: &'a mut Vec<u8>,
}

impl Future for RecvInto<'_> {
    type Output = Result<crate::Rank>;
    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<crate::Rank>> {
        let this = &mut *self;
        this.rx.poll_recv_into(cx, this.buf)
    }
}

impl Receiver {
    /// Hand out the next item taken from the queue, if any, noting its cost
    /// for the next refill.
    ///
    /// A large message's cost leaves the budgets at once (one lock, small
    /// beside its size): a program working on it must not hold back the
    /// next one, which may arrive meanwhile.
    fn next_local(&mut self) -> Option<Held> {
        let item = self.local.pop_front()?;
        if self.free > 0 {
            // Handed over inline: never charged.
            self.free -= 1;
        } else {
            self.charge(&item);
        }
        Some(item)
    }

    /// Note the cost of `item`, taken out of `local` and charged to the
    /// budgets, for the next refill (a large message's at once).
    fn charge(&mut self, item: &Held) {
        let len = match item {
            Held::Item(Ok(m)) => m.data.len(),
            Held::Kept { len, .. } => *len as usize,
            Held::Item(Err(_)) => return,
        };
        if len >= SETTLE_AT_ONCE {
            self.disp.settle(self.tag, cost(len));
        } else {
            self.handed += cost(len);
        }
    }

    /// [`next_local`](Self::next_local) as a message in a buffer of its own.
    fn next_message(&mut self) -> Option<Result<Message>> {
        let held = self.next_local()?;
        Some(held.resolve(self.tag, &self.keep))
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let (tag, keep) = (self.tag, &self.keep);
        let back = std::mem::take(&mut self.local);
        let back = back.into_iter().map(|h| h.resolve(tag, keep)).collect();
        self.disp.unpop(self.tag, self.handed, back, self.free);
        self.disp.release(self.tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[test]
    fn more_takes_up_to_its_count_and_within_the_kept_buffer_bound() {
        let (mut keep, mut items) = (vec![9u8], VecDeque::new());
        let mut more = More::new(&mut keep, &mut items, 2);
        // Nothing found: nothing counted.
        assert!(!more.take(3, 8, |_| false));
        assert!(more.take(3, 8, |k| {
            k.extend_from_slice(b"ab");
            true
        }));
        assert!(more.take(4, 8, |k| {
            k.extend_from_slice(b"cde");
            true
        }));
        assert_eq!(more.wanted(), 0);
        assert!(!more.take(4, 8, |_| panic!("asked past its count")));
        let got: Vec<_> = items
            .iter()
            .map(|h| match h {
                Held::Kept { src, at, len } => (*src, kept(&keep, *at, *len).to_vec()),
                Held::Item(_) => panic!("a kept message became an item"),
            })
            .collect();
        assert_eq!(got, [(3, b"ab".to_vec()), (4, b"cde".to_vec())]);
        // A message that might not fit the kept buffer is not looked for.
        let (mut keep, mut items) = (vec![0u8; KEEP_MAX - 4], VecDeque::new());
        let mut more = More::new(&mut keep, &mut items, 5);
        assert!(!more.take(1, 8, |_| panic!("looked past the bound")));
        assert_eq!((more.wanted(), items.len()), (0, 0));
    }

    fn msg(i: u8, len: usize) -> Message {
        Message::carried(0, 1, Bytes::from(vec![i; len]))
    }

    fn queued(d: &Dispatcher, tag: Tag) -> usize {
        lock(&d.tags).get(&tag).map_or(0, |q| q.bytes)
    }

    /// A dispatcher with a tag budget of `budget` bytes, a receiver for
    /// tag 1, and a progress poller (keep it: the dispatcher holds it
    /// weakly) that runs `each` (with the dispatcher) on every inline
    /// progress call.
    fn hooked_with(
        budget: usize,
        each: impl Fn(&Dispatcher) -> usize + Send + Sync + 'static,
    ) -> (Arc<Dispatcher>, Receiver, Poller) {
        let d = Dispatcher::new((budget, 1 << 30), ProgressMode::BusyPoll, Duration::ZERO);
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rx = d.take(1, closed).unwrap();
        let weak = Arc::downgrade(&d);
        let p: Poller = Arc::new(move |_| weak.upgrade().map_or(0, |d| each(&d)));
        d.set_progress_hook(&p);
        (d, rx, p)
    }

    /// [`hooked_with`] a budget of 1 MiB.
    fn hooked(
        each: impl Fn(&Dispatcher) -> usize + Send + Sync + 'static,
    ) -> (Arc<Dispatcher>, Receiver, Poller) {
        hooked_with(1 << 20, each)
    }

    /// `each`, on the first call only.
    fn once(
        each: impl Fn(&Dispatcher) -> usize + Send + Sync + 'static,
    ) -> impl Fn(&Dispatcher) -> usize + Send + Sync + 'static {
        let done = std::sync::atomic::AtomicBool::new(false);
        move |d| {
            if done.swap(true, Ordering::Relaxed) {
                0
            } else {
                each(d)
            }
        }
    }

    /// Messages our own inline progress finds go straight to the polling
    /// receiver, in order, without the tag lock and without a charge to
    /// the budgets; messages for another tag take the queue.
    #[tokio::test]
    async fn inline_progress_hands_messages_straight_to_the_receiver() {
        let (d, mut rx, _p) = hooked(once(|d| {
            d.offers(|o| {
                for i in 0..3u8 {
                    assert!(o.offer(0, 1, 10, || Bytes::from(vec![i; 10])));
                }
                // No lock taken for tag 1's.
                assert!(o.tags.is_none());
                assert!(o.offer(0, 2, 10, || Bytes::from(vec![9; 10])));
                let tags = o.tags.as_ref().expect("tag 2's took the lock");
                assert_eq!(tags.get(&1).map(|q| q.items.len()), Some(0));
                assert_eq!(tags.get(&2).map(|q| q.items.len()), Some(1));
            });
            4
        }));
        for i in 0..3u8 {
            assert_eq!(rx.next().await.unwrap().unwrap().data[0], i);
            assert_eq!(queued(&d, 1), 0, "a message handed over is not charged");
        }
        assert_eq!(lock(&d.tags).get(&2).map(|q| q.items.len()), Some(1));
        assert!(futures::poll!(rx.next()).is_pending());
        assert_eq!(d.total.load(Ordering::Relaxed), cost(10));
    }

    /// A transport's direct take, as a test double: while the queue length
    /// word it is shown reads 0 it hands out message `n` (one byte) from
    /// rank 3, numbering them from 0; it refuses while anything is queued.
    struct DirectDouble {
        next: AtomicUsize,
        refused: AtomicUsize,
    }

    impl Progress for DirectDouble {
        fn turns(&self, _turns: usize) -> usize {
            0
        }
        fn take_direct(
            &self,
            tag: Tag,
            queued: &AtomicUsize,
            buf: &mut Vec<u8>,
            _more: &mut More<'_>,
            looks: u32,
        ) -> Option<Rank> {
            assert_eq!((tag, looks), (1, DIRECT_LOOKS));
            if queued.load(Ordering::Relaxed) != 0 {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            buf.clear();
            buf.push(self.next.fetch_add(1, Ordering::Relaxed) as u8);
            Some(3)
        }
    }

    /// `recv_into` takes what is queued for its tag first, then what a
    /// transport hands over directly, into the lent buffer; `recv` never
    /// asks for a direct take.
    #[tokio::test]
    async fn recv_into_takes_the_queue_first_then_direct_takes() {
        let d = Dispatcher::new((1 << 20, 1 << 30), ProgressMode::BusyPoll, Duration::ZERO);
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut rx = d.take(1, closed).unwrap();
        let double = Arc::new(DirectDouble {
            next: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
        });
        let p: Poller = double.clone();
        d.set_progress_hook(&p);
        d.offers(|o| (100..102u8).all(|i| o.offer(0, 1, 1, move || Bytes::from(vec![i]))));
        let mut buf = Vec::new();
        for want in [(0, 100u8), (0, 101), (3, 0), (3, 1)] {
            let src = rx.recv_into(&mut buf).await.unwrap();
            assert_eq!((src, buf.as_slice()), (want.0, &[want.1][..]));
        }
        assert_eq!(double.refused.load(Ordering::Relaxed), 0);
        // Queued again: the next `recv_into` takes it, not a direct one.
        d.deliver(msg(7, 1));
        assert_eq!(rx.recv_into(&mut buf).await.unwrap(), 0);
        assert_eq!(buf, [7]);
        assert_eq!(double.next.load(Ordering::Relaxed), 2);
        assert!(futures::poll!(rx.next()).is_pending());
        assert_eq!(double.next.load(Ordering::Relaxed), 2, "recv took directly");
    }

    /// A message that finds its tag's queue holding one (queued by another
    /// thread's progress, say) is queued behind it, not handed over; and
    /// one registration takes at most a tag budget's worth inline, the
    /// rest is queued and charged as usual.
    #[tokio::test]
    async fn hand_offs_keep_order_and_a_budget() {
        let budget = 4 * cost(10);
        let (d, mut rx, _p) = hooked_with(
            1 << 20,
            once(|d| {
                // Another thread's progress queues message 0 while this
                // receiver runs progress inline...
                std::thread::scope(|s| {
                    s.spawn(|| d.deliver(msg(0, 10)));
                });
                // ... so 1..8, found after it, must queue behind it.
                for i in 1..8u8 {
                    d.deliver(msg(i, 10));
                }
                8
            }),
        );
        for i in 0..8u8 {
            assert_eq!(rx.next().await.unwrap().unwrap().data[0], i, "message {i}");
        }
        assert!(futures::poll!(rx.next()).is_pending());
        assert_eq!(queued(&d, 1), 0);

        let (d, mut rx, _p) = hooked_with(
            budget,
            once(|d| {
                d.offers(|o| (0..8u8).all(|i| o.offer(0, 1, 10, || Bytes::from(vec![i; 10]))));
                8
            }),
        );
        assert_eq!(rx.next().await.unwrap().unwrap().data[0], 0);
        // Four handed over (the budget), four queued and charged.
        assert_eq!(rx.local.len(), 3);
        assert_eq!(lock(&d.tags).get(&1).map(|q| q.items.len()), Some(4));
        assert_eq!(queued(&d, 1), 4 * cost(10));
        for i in 1..8u8 {
            assert_eq!(rx.next().await.unwrap().unwrap().data[0], i, "message {i}");
        }
        assert!(futures::poll!(rx.next()).is_pending());
        assert_eq!(queued(&d, 1), 0);
        assert_eq!(d.total.load(Ordering::Relaxed), 0);
    }

    /// A payload that, like a fast-box message, is copied wherever it goes.
    struct Copied(u8, usize);

    impl Payload for Copied {
        const COPIES: bool = true;
        fn into_bytes(self) -> Bytes {
            Bytes::from(vec![self.0; self.1])
        }
        fn copy_into(self, out: &mut Vec<u8>) {
            out.resize(out.len() + self.1, self.0);
        }
    }

    /// `recv_into` keeps small copied payloads handed over inline in one
    /// reused buffer instead of a buffer each; every way of taking them
    /// (`recv_into`, `recv`, `recv_from`, `probe`) sees the same messages,
    /// a registration keeps at most `KEEP_MAX` bytes this way, and a
    /// dropped receiver puts what it kept back in the queue, in order and
    /// charged to the budgets.
    #[tokio::test]
    async fn recv_into_keeps_small_payloads_in_one_buffer() {
        // Message i is i + 1 bytes of i; the last two are large.
        let big = KEEP_MAX / 2;
        let len = move |i: u8| if i < 6 { usize::from(i) + 1 } else { big };
        let (d, mut rx, _p) = hooked(once(move |d| {
            d.offers(|o| (0..8u8).all(|i| o.offer(0, 1, len(i), Copied(i, len(i)))));
            8
        }));
        let mut buf = Vec::new();
        assert_eq!(rx.recv_into(&mut buf).await.unwrap(), 0);
        assert_eq!(buf, vec![0u8; 1], "the first goes into the lent buffer");
        let kept = rx
            .local
            .iter()
            .filter(|h| matches!(h, Held::Kept { .. }))
            .count();
        // 1..6 and the first large one fit; the second large one does not.
        assert_eq!(kept, 6);
        assert!(matches!(rx.local.back(), Some(Held::Item(Ok(_)))));
        assert_eq!(rx.recv_into(&mut buf).await.unwrap(), 0);
        assert_eq!(buf, vec![1u8; 2]);
        assert_eq!(rx.probe().unwrap(), Some((0, 3)));
        let m = rx.recv().await.unwrap();
        assert_eq!((m.src, m.tag, &m.data[..]), (0, 1, &[2u8; 3][..]));
        let m = rx.recv_from(0).await.unwrap();
        assert_eq!(&m.data[..], &[3u8; 4][..]);
        assert_eq!(queued(&d, 1), 0, "handed over inline: never charged");
        drop(rx);
        let left: usize = (4..8u8).map(|i| cost(len(i))).sum();
        assert_eq!(queued(&d, 1), left);
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut rx = d.take(1, closed).unwrap();
        for i in 4..8u8 {
            rx.recv_into(&mut buf).await.unwrap();
            assert_eq!(buf, vec![i; len(i)], "message {i}");
        }
        assert!(futures::poll!(rx.next()).is_pending());
        assert_eq!(queued(&d, 1), 0);
        assert_eq!(d.total.load(Ordering::Relaxed), 0);
    }

    /// A progress call that unwinds after handing over to `recv_into` puts
    /// the lent buffer's message and the kept payloads back, in order.
    #[tokio::test]
    async fn kept_payloads_survive_a_panicking_progress_call() {
        let (d, mut rx, _p) = hooked(once(|d| {
            d.offers(|o| (0..3u8).all(|i| o.offer(0, 1, 10, Copied(i, 10))));
            panic!("progress failed after handing over three messages");
        }));
        let mut buf = Vec::new();
        let poll = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            futures::executor::block_on(rx.recv_into(&mut buf))
        }));
        assert!(poll.is_err());
        assert_eq!(lock(&d.tags).get(&1).map(|q| q.items.len()), Some(3));
        assert_eq!(queued(&d, 1), 3 * cost(10));
        for i in 0..3u8 {
            rx.recv_into(&mut buf).await.unwrap();
            assert_eq!(buf, vec![i; 10], "message {i}");
        }
    }

    /// The kept buffer is emptied at each registration and reused: a
    /// second run of messages reads its own bytes, not the first run's.
    #[tokio::test]
    async fn the_kept_buffer_is_reused_across_registrations() {
        let round = Arc::new(AtomicUsize::new(0));
        let r = round.clone();
        let (_d, mut rx, _p) = hooked(move |d| {
            let k = r.fetch_add(1, Ordering::Relaxed) as u8;
            if k >= 2 {
                return 0;
            }
            d.offers(|o| (0..4u8).all(|i| o.offer(0, 1, 16, Copied(k * 10 + i, 16))));
            4
        });
        let mut buf = Vec::new();
        for k in 0..2u8 {
            for i in 0..4u8 {
                rx.recv_into(&mut buf).await.unwrap();
                assert_eq!(buf, vec![k * 10 + i; 16], "round {k}, message {i}");
            }
            assert!(rx.local.is_empty());
        }
        assert!(rx.keep.capacity() >= 3 * 16, "kept, not freed");
    }

    /// Futures waiting on operations share inline progress: a lone one
    /// runs it on every poll; of many polled in turn (a join), one per
    /// sweep does.
    #[test]
    fn waiting_operations_share_one_progress_call_per_sweep() {
        let calls = Arc::new(AtomicUsize::new(0));
        let d = Dispatcher::new((1 << 20, 1 << 30), ProgressMode::BusyPoll, Duration::ZERO);
        let c = calls.clone();
        let p: Poller = Arc::new(move |_| {
            c.fetch_add(1, Ordering::Relaxed);
            0
        });
        d.set_progress_hook(&p);
        // Hook calls one inline progress makes (a first turn, then more).
        d.progress_inline();
        let per = calls.swap(0, Ordering::Relaxed);
        assert!(per >= 1);
        let mut lone = OP_UNSEEN;
        for i in 1..=5 {
            d.progress_inline_for_op(&mut lone);
            assert_eq!(
                calls.swap(0, Ordering::Relaxed),
                per,
                "poll {i} of a lone future"
            );
        }
        let mut many = [OP_UNSEEN; 64];
        // First polls all run it (each future's first look).
        many.iter_mut().for_each(|s| {
            d.progress_inline_for_op(s);
        });
        calls.store(0, Ordering::Relaxed);
        for _ in 0..10 {
            many.iter_mut().for_each(|s| {
                d.progress_inline_for_op(s);
            });
            assert_eq!(calls.swap(0, Ordering::Relaxed), per, "one call per sweep");
        }
    }

    /// A receiver keeps the progress poller only while it polls hot: it
    /// lets it go when it goes to sleep and when its fabric closes (so a
    /// receiver kept longer never keeps the transports alive).
    #[tokio::test]
    async fn receivers_keep_the_poller_only_while_hot() {
        for mode in [ProgressMode::Interrupt, ProgressMode::BusyPoll] {
            let d = Dispatcher::new((1 << 20, 1 << 30), mode, Duration::ZERO);
            let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let mut rx = d.take(1, closed.clone()).unwrap();
            let p: Poller = Arc::new(|_| 0);
            d.set_progress_hook(&p);
            assert!(futures::poll!(rx.next()).is_pending());
            let held = Arc::strong_count(&p) - 1;
            match mode {
                // Asleep: nothing polls it until a wake-up.
                ProgressMode::Interrupt => assert_eq!(held, 0),
                // Hot: it polls again at once, with the poller.
                _ => assert_eq!(held, 1),
            }
            closed.store(true, Ordering::Release);
            assert!(matches!(futures::poll!(rx.next()), Poll::Ready(None)));
            assert_eq!(Arc::strong_count(&p), 1, "closed: the poller is let go");
        }
    }

    /// A receiver dropped with messages handed over inline but not handed
    /// out puts them back in its tag's queue, charged, in order.
    #[tokio::test]
    async fn a_dropped_receiver_requeues_what_was_handed_over() {
        let (d, mut rx, _p) = hooked(once(|d| {
            d.offers(|o| (0..3u8).all(|i| o.offer(0, 1, 10, || Bytes::from(vec![i; 10]))));
            3
        }));
        assert_eq!(rx.next().await.unwrap().unwrap().data[0], 0);
        drop(rx);
        assert_eq!(queued(&d, 1), 2 * cost(10));
        assert_eq!(d.total.load(Ordering::Relaxed), 2 * cost(10));
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut rx = d.take(1, closed).unwrap();
        for i in 1..3u8 {
            assert_eq!(rx.next().await.unwrap().unwrap().data[0], i);
        }
        assert!(futures::poll!(rx.next()).is_pending());
        assert_eq!(queued(&d, 1), 0);
    }

    /// A receiver fed only by hand-offs (it never reaches a refill while it
    /// stays hot) leaves nothing on the budgets, whether the hand-off took
    /// the tag lock or not.
    #[tokio::test]
    async fn hand_offs_keep_the_budget_flat() {
        let (d, mut rx, _p) = hooked(|d| {
            // One through the locked path, one not.
            d.offers(|o| assert!(o.offer(0, 1, 10, || Bytes::from(vec![1; 10]))));
            let w = {
                let mut tags = lock(&d.tags);
                let q = tags.entry(1).or_default();
                d.enqueue(q, msg(2, 10))
            };
            assert!(w.is_none(), "handed over, nobody to wake");
            2
        });
        for _ in 0..1000 {
            rx.next().await.unwrap().unwrap();
            assert_eq!(queued(&d, 1), 0);
            assert_eq!(d.total.load(Ordering::Relaxed), 0);
        }

        // A receiver that took charged messages from the queue and is then
        // fed only by hand-offs gives their budget back at once.
        let (d, mut rx, _p) = hooked(|d| {
            d.offers(|o| assert!(o.offer(0, 1, 10, || Bytes::from(vec![1; 10]))));
            1
        });
        for i in 0..3u8 {
            d.deliver(msg(i, 10));
        }
        rx.next().await.unwrap().unwrap();
        assert_eq!(
            queued(&d, 1),
            3 * cost(10),
            "handed out, not yet given back"
        );
        for _ in 0..10 {
            rx.next().await.unwrap().unwrap();
        }
        assert_eq!(queued(&d, 1), 0);
        assert_eq!(d.total.load(Ordering::Relaxed), 0);
    }

    /// A progress call that unwinds leaves nothing behind: what it handed
    /// over goes back to the queue, in order, for the next poll.
    #[tokio::test]
    async fn inline_hand_off_survives_a_panicking_progress_call() {
        let (d, mut rx, _p) = hooked(once(|d| {
            d.offers(|o| {
                for i in 0..2u8 {
                    assert!(o.offer(0, 1, 10, || Bytes::from(vec![i; 10])));
                }
            });
            panic!("progress failed after handing over two messages");
        }));
        let poll = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            futures::executor::block_on(futures::future::poll_fn(|cx| {
                std::pin::Pin::new(&mut rx).poll_next(cx).map(|_| ())
            }))
        }));
        assert!(poll.is_err());
        assert_eq!(lock(&d.tags).get(&1).map(|q| q.items.len()), Some(2));
        // Back in the queue, and charged like any queued message.
        assert_eq!(queued(&d, 1), 2 * cost(10));
        for i in 0..2u8 {
            assert_eq!(rx.next().await.unwrap().unwrap().data[0], i);
        }
        // The thread's registration is gone: a later offer is queued.
        d.deliver(msg(7, 10));
        assert_eq!(lock(&d.tags).get(&1).map(|q| q.items.len()), Some(1));
    }

    /// A receiver takes messages in batches, but they count against the
    /// budgets until handed out; dropped unread, they go back in order to
    /// the next receiver of the tag.
    #[tokio::test]
    async fn batched_receive_keeps_order_budgets_and_leftovers() {
        let d = Dispatcher::new((1 << 20, 1 << 30), ProgressMode::BusyPoll, Duration::ZERO);
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let n = (POP_BATCH * 2 + 5) as u8;
        for i in 0..n {
            d.deliver(msg(i, 100));
        }
        let all = usize::from(n) * cost(100);
        assert_eq!(queued(&d, 1), all);
        let mut rx = d.take(1, closed.clone()).unwrap();
        assert_eq!(rx.next().await.unwrap().unwrap().data[0], 0);
        // A batch left the queue, but only what was handed out may leave
        // the budget (at the next refill).
        assert_eq!(queued(&d, 1), all);
        assert_eq!(d.total.load(Ordering::Relaxed), all);
        assert_eq!(rx.next().await.unwrap().unwrap().data[0], 1);
        drop(rx);
        // Two handed out: their cost is given back, the rest is queued again.
        assert_eq!(queued(&d, 1), all - 2 * cost(100));
        assert_eq!(d.total.load(Ordering::Relaxed), all - 2 * cost(100));
        let mut rx = d.take(1, closed).unwrap();
        for i in 2..n {
            assert_eq!(rx.next().await.unwrap().unwrap().data[0], i, "message {i}");
        }
        // The last refill found nothing and settled the rest.
        let pending = futures::poll!(rx.next());
        assert!(pending.is_pending());
        assert_eq!(queued(&d, 1), 0);
        assert_eq!(d.total.load(Ordering::Relaxed), 0);
    }

    /// A large message leaves the budgets as soon as it is handed out, so
    /// the next one can arrive while the program works on it.
    #[tokio::test]
    async fn large_messages_leave_the_budget_when_handed_out() {
        let big = SETTLE_AT_ONCE;
        let d = Dispatcher::new((1 << 30, 1 << 30), ProgressMode::BusyPoll, Duration::ZERO);
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        d.deliver(msg(0, big));
        d.deliver(msg(1, 100));
        let mut rx = d.take(1, closed).unwrap();
        assert_eq!(rx.next().await.unwrap().unwrap().data.len(), big);
        assert_eq!(queued(&d, 1), cost(100), "the large one left at once");
        assert_eq!(rx.next().await.unwrap().unwrap().data.len(), 100);
        assert_eq!(queued(&d, 1), cost(100), "a small one waits for a refill");
    }

    /// A receiver that takes messages off a queue that refused one raises
    /// the room flags transports registered, and only then.
    #[tokio::test]
    async fn room_made_after_a_refusal_raises_the_room_flags() {
        let d = Dispatcher::new(
            (4 * cost(10), 1 << 30),
            ProgressMode::BusyPoll,
            Duration::ZERO,
        );
        let flag = Arc::new(AtomicBool::new(false));
        d.on_room(flag.clone());
        let closed = Arc::new(AtomicBool::new(false));
        let mut rx = d.take(1, closed).unwrap();
        // Taken with room to spare: nothing was refused.
        for i in 0..4u8 {
            d.deliver(msg(i, 10));
            assert_eq!(rx.next().await.unwrap().unwrap().data[0], i);
        }
        for i in 4..8u8 {
            d.deliver(msg(i, 10));
        }
        assert!(!flag.load(Ordering::Relaxed), "no room was refused");
        // A transport asks for room for a fifth: refused, and noted.
        let room = d.has_room(1, 10);
        assert!(!room, "the queue is full");
        for i in 4..8u8 {
            assert_eq!(rx.next().await.unwrap().unwrap().data[0], i);
        }
        assert!(flag.load(Ordering::Relaxed), "room made after a refusal");
    }

    /// Offers under one lock respect the tag's budget like single ones.
    #[test]
    fn offers_stop_at_the_budget() {
        let d = Dispatcher::new(
            (4 * cost(10), 1 << 30),
            ProgressMode::BusyPoll,
            Duration::ZERO,
        );
        let took = d.offers(|o| {
            (0..10)
                .take_while(|i| o.offer(0, 1, 10, || Bytes::from(vec![*i as u8; 10])))
                .count()
        });
        assert_eq!(took, 4);
        assert!(!d.has_room(1, 10));
    }
}

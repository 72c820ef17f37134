//! The one internal interface every transport implements.
//!
//! A transport moves *messages* — `(kind, tag, bytes)` — reliably and in order
//! between a pair of ranks, and may offer direct load/store access to a
//! peer's shared region. Everything above that (tag dispatch, emulated
//! put/get, barriers, completion bookkeeping) lives once in the core:
//! [`crate::core::dispatch`], [`crate::core::rma`], [`crate::core::fabric`].
//!
//! One-sided operations (put, get, atomics) are offered to the link first
//! ([`Link::post`]): `sm` carries them itself into a region the peer shares
//! (one copy, or one hardware atomic, through its mapping); a transport
//! without native one-sided support keeps the default, and the core emulates
//! them over its messages ([`crate::core::rma`]), checked at the target.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::core::completion::{Completion, Tally};
use crate::core::region::{RegionInner, RemoteKey};
use crate::sys::mem::{AtomicOp, RawBuf};
use crate::{Rank, Result};

#[cfg(test)]
pub(crate) mod double;
pub(crate) mod registry;
pub(crate) mod selflink;

/// What a rank publishes in the address exchange: its node and, per
/// transport it opened, that transport's address bytes.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct Published {
    pub(crate) rank: Rank,
    pub(crate) node: String,
    pub(crate) addrs: Vec<(String, Vec<u8>)>,
}

impl Published {
    /// Read what rank `rank` published in the exchange: it must decode and
    /// name that rank.
    pub(crate) fn decode(rank: Rank, raw: &[u8]) -> Result<Published> {
        let a: Published = postcard::from_bytes(raw).map_err(|e| {
            crate::Error::Bootstrap(format!("rank {rank} published an unreadable address: {e}"))
        })?;
        if a.rank != rank {
            return Err(crate::Error::Bootstrap(format!(
                "rank {rank} published an address claiming rank {}",
                a.rank
            )));
        }
        Ok(a)
    }

    /// The address `transport` published, if it did.
    pub(crate) fn addr(&self, transport: &str) -> Option<&[u8]> {
        self.addrs
            .iter()
            .find(|(n, _)| n == transport)
            .map(|(_, a)| a.as_slice())
    }

    /// Whether `self` and `other` are on one node and both publish a
    /// node-local transport (so no network transport carries the pair).
    pub(crate) fn share_node_transport(&self, other: &Published) -> bool {
        self.node == other.node
            && self.addrs.iter().any(|(n, _)| {
                registry::find(n).is_some_and(|e| e.reach == registry::Reach::Node)
                    && other.addr(n).is_some()
            })
    }
}

/// A peer as a transport sees it at connect time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peer<'a> {
    pub(crate) rank: Rank,
    /// What the peer's instance of this transport published.
    pub(crate) addr: &'a [u8],
}

/// What a transport with device memory makes for a region: the memory and
/// the key's handle (see [`Transport::alloc_device`]).
pub(crate) type DeviceMade = Result<(
    Box<dyn crate::core::region::DeviceMemory>,
    crate::core::region::KeyHandle,
)>;

/// What a message is for, as the core sees it. Travels in every
/// transport's frame header; a transport may carry kinds of its own beside
/// these (numbers from 64 up), which never reach the core (`sm`'s
/// rendezvous and single-copy requests: `sm::kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// A user message for the tag's receiver.
    User = 0,
    /// Emulated put: key, offset and data for the target to check and write.
    PutReq = 1,
    /// Target's answer to a put.
    PutAck = 2,
    /// Emulated get: key, offset and length.
    GetReq = 3,
    /// Target's answer to a get: status and data.
    GetResp = 4,
    /// Barrier arrival; the tag carries the epoch.
    Barrier = 5,
    /// Orderly goodbye at close.
    Bye = 6,
    /// The initiator asks the target to confirm the implicit puts it sent
    /// before (those with id 0, which get no answer of their own).
    FlushReq = 7,
    /// The target's answer to [`Kind::FlushReq`]: the status of the first
    /// implicit put it refused since the last one, else success.
    FlushAck = 8,
    /// A part of a large emulated put: the key, the whole put's extent
    /// (which the target checks for every part, so a refused put writes
    /// nothing), the part's place in it, and its data. Only the last part
    /// is answered (as [`Kind::PutAck`]).
    PutPart = 9,
    /// Emulated atomic: key, offset, the operation and its operands. Id 0
    /// (a non-fetching `atomic_add_nbi`) gets no answer of its own; the
    /// next [`Kind::FlushReq`] covers it, as for implicit puts.
    AtomicReq = 10,
    /// The target's answer to [`Kind::AtomicReq`]: status, then the word's
    /// previous value.
    AtomicResp = 11,
    /// A message whose bytes stay in the sender's region until the
    /// receiver copies them (`Endpoint::send_region` of device memory):
    /// id, range and key (`core::lend`). Travels in order with the pair's
    /// user messages on its tag, so only a link whose
    /// [`Link::carries_lent`] says so is given one.
    Lent = 12,
    /// The receiver's answer to a [`Kind::Lent`]: taken, or declined and
    /// why; the tag carries the lent message's id.
    LentDone = 13,
    /// A transport's own control message to its peer, carried over the
    /// pair's message link for a transport that has none (`smcuda`'s
    /// handshake): `[name length u8][transport name][payload]`, handed to
    /// that transport's [`Transport::on_control`].
    Control = 14,
}

impl Kind {
    /// Decode a kind byte.
    pub(crate) fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            0 => Kind::User,
            1 => Kind::PutReq,
            2 => Kind::PutAck,
            3 => Kind::GetReq,
            4 => Kind::GetResp,
            5 => Kind::Barrier,
            6 => Kind::Bye,
            7 => Kind::FlushReq,
            8 => Kind::FlushAck,
            9 => Kind::PutPart,
            10 => Kind::AtomicReq,
            11 => Kind::AtomicResp,
            12 => Kind::Lent,
            13 => Kind::LentDone,
            14 => Kind::Control,
            _ => return None,
        })
    }
}

/// [`Link::submit_gathered_with`] through a buffer of its own: `fill` it,
/// then [`Link::submit_gathered`] it.
pub(crate) fn submit_filled<L: Link + ?Sized>(
    link: &L,
    kind: Kind,
    tag: u64,
    len: usize,
    fill: &mut dyn FnMut(&mut Vec<u8>) -> Result<()>,
) -> Result<()> {
    let mut v = Vec::with_capacity(len);
    fill(&mut v)?;
    link.submit_gathered(kind, tag, Bytes::from(v)).map(drop)
}

/// The local side of a put or get: a range of a registered region.
#[derive(Clone, Copy)]
pub(crate) struct Local<'a> {
    /// The region (a transport that finishes the operation later keeps a
    /// clone, so its memory outlives the operation).
    pub(crate) region: &'a Arc<RegionInner>,
    /// Where the range starts in it.
    pub(crate) offset: u64,
    /// The range itself (already checked against the region; empty for
    /// device memory, which the CPU does not reach).
    pub(crate) raw: RawBuf,
    /// The range's length (`raw`'s, for host memory).
    pub(crate) len: usize,
}

/// A one-sided operation offered to [`Link::post`].
#[derive(Clone, Copy)]
pub(crate) enum OneSided<'a> {
    /// Write `src` into the peer's region `key` at `offset`.
    Put {
        /// The local bytes.
        src: Local<'a>,
        /// The target region's key.
        key: &'a RemoteKey,
        /// Where in it.
        offset: u64,
    },
    /// Read the peer's region `key` at `offset` into `dst`.
    Get {
        /// The local bytes to fill.
        dst: Local<'a>,
        /// The source region's key.
        key: &'a RemoteKey,
        /// Where in it.
        offset: u64,
    },
    /// Apply `op` to the 8-byte word at `offset` of the peer's region.
    Atomic {
        /// The target region's key.
        key: &'a RemoteKey,
        /// The word's offset (8-aligned: checked by the initiator).
        offset: u64,
        /// What to do to it.
        op: AtomicOp,
    },
}

impl<'a> OneSided<'a> {
    /// A put of `at` into `key` at `offset`, or (`put` false) a get of it.
    pub(crate) fn put_or_get(put: bool, at: Local<'a>, key: &'a RemoteKey, offset: u64) -> Self {
        if put {
            OneSided::Put {
                src: at,
                key,
                offset,
            }
        } else {
            OneSided::Get {
                dst: at,
                key,
                offset,
            }
        }
    }

    /// The key of the region the operation reaches.
    #[inline]
    pub(crate) fn key(&self) -> &'a RemoteKey {
        match *self {
            OneSided::Put { key, .. }
            | OneSided::Get { key, .. }
            | OneSided::Atomic { key, .. } => key,
        }
    }
}

/// What a transport did with a [`OneSided`] operation.
pub(crate) enum Native {
    /// Done (remote completion) before returning; for an atomic, the
    /// word's previous value (0 otherwise).
    Done(u64),
    /// Started: the transport completes the slot at remote completion (or
    /// with the error that stopped it, a lost peer's included), from its
    /// progress; for an atomic, with [`Completion::complete_value`].
    Posted(Arc<Completion>),
    /// Started and counted in the tally given to
    /// [`Link::post`]: the transport finishes its token at remote
    /// completion, as it would complete a slot.
    #[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
    Counted,
    /// Not offered for this operation: the core emulates it.
    Emulate,
}

/// How a peer was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loss {
    /// Its process died (or stopped answering): its memory is gone.
    Crashed,
    /// It closed its fabric in order.
    Closed,
    /// It broke the protocol; it may still be running.
    Misbehaved,
}

/// One connection to one peer over one transport.
pub(crate) trait Link: Send + Sync {
    /// The peer's rank.
    fn peer(&self) -> Rank;

    /// The transport's name, for reports.
    fn transport(&self) -> &'static str;

    /// Send a message from a borrowed slice if that is possible right now
    /// without queueing: nothing is queued ahead of it and resources are free.
    /// `Ok(false)`: nothing was sent; queue it with [`Link::submit`].
    fn try_send(&self, kind: Kind, tag: u64, data: &[u8]) -> Result<bool>;

    /// Send a message, pushing what fits now. `Ok(None)`: it is sent (local
    /// completion). `Ok(Some(c))`: the rest is queued in order and `c`
    /// completes when the last byte is handed over, or with the error that
    /// stopped it. Never blocks.
    fn submit(&self, kind: Kind, tag: u64, data: Bytes) -> Result<Option<Arc<Completion>>>;

    /// [`submit`](Self::submit) for a message that is likely one of a
    /// burst (an emulated put or get request): a transport that
    /// [`gathers`](Self::gathers) may hold a small one back until the next
    /// progress call, so that the burst leaves together. Order with every
    /// other message to the peer is kept.
    fn submit_gathered(
        &self,
        kind: Kind,
        tag: u64,
        data: Bytes,
    ) -> Result<Option<Arc<Completion>>> {
        self.submit(kind, tag, data)
    }

    /// [`submit_gathered`](Self::submit_gathered) of a small message whose
    /// `len` bytes `fill` appends to a buffer, for a sender that does not
    /// wait on it (an implicit put): a transport holding a bundle open for
    /// the peer may write it straight in, with no buffer of its own. An
    /// error (also from `fill`) is returned, and then nothing was sent.
    fn submit_gathered_with(
        &self,
        kind: Kind,
        tag: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        submit_filled(self, kind, tag, len, fill)
    }

    /// Send what [`submit_gathered`](Self::submit_gathered) held back for
    /// this peer, now (the caller's burst is complete).
    fn flush_gathered(&self) {}

    /// The most bytes one message may carry through
    /// [`try_send_filled`](Self::try_send_filled); 0 (the default): the
    /// transport builds no message in place.
    fn fill_room(&self) -> usize {
        0
    }

    /// Send a message of `head` followed by `len` bytes that `fill` writes
    /// straight into the transport's own memory for it (a fragment of
    /// `sm`: a put's bytes read there from their region, device memory
    /// included, with no buffer between), if it can go now as one piece:
    /// nothing queued ahead of it and room free. `Ok(false)`: nothing was
    /// sent (send it with [`submit`](Self::submit)). An error, also from
    /// `fill`, is returned, and then nothing was sent.
    fn try_send_filled(
        &self,
        _kind: Kind,
        _tag: u64,
        _head: &[u8],
        _len: usize,
        _fill: &mut dyn FnMut(RawBuf) -> Result<()>,
    ) -> Result<bool> {
        Ok(false)
    }

    /// The host memory this link's in-place messages are built in and
    /// read from (`sm`: our segment and the peer's), for a transport that
    /// pins memory for its device's copies.
    fn fill_memory(&self) -> Vec<RawBuf> {
        Vec::new()
    }

    /// Whether [`submit_gathered`](Self::submit_gathered) holds messages
    /// back until the next progress call: the future waiting on such a
    /// request sends its peer's held bundle at its first poll (with every
    /// request started before it), rather than leave it to the progress
    /// task.
    fn gathers(&self) -> bool {
        false
    }

    /// Carry a one-sided operation natively, if this transport can for
    /// this key (`sm`: a region the peer shares, through its mapping; a
    /// NIC: RDMA write/read/atomic). [`Native::Emulate`] (the default):
    /// not offered here, and the core emulates it over messages, where the
    /// target checks the key. The initiator checked the local range, the
    /// key's owner and its stated bounds before this call; a transport
    /// checks what only it can see (the real size of what it maps, a
    /// revocation).
    ///
    /// `tally`: the operation has no future of its own (`put_nbi`,
    /// `get_nbi`); a transport may count it there
    /// ([`Tally::start`](crate::core::completion::Tally::start)) instead of
    /// giving it a slot, and answer [`Native::Counted`].
    fn post(&self, _op: OneSided<'_>, _tally: Option<&Arc<Tally>>) -> Result<Native> {
        Ok(Native::Emulate)
    }

    /// Whether anything is still queued towards the peer.
    fn has_queued(&self) -> bool;

    /// Whether this link carries [`Kind::Lent`] in order with the pair's
    /// user messages on the same tag (the core announces lent messages
    /// only over such a link, and sends their bytes otherwise).
    fn carries_lent(&self) -> bool {
        false
    }

    /// For a link that carries device memory: whether operations with the
    /// peer's device memory go by the device now (not refused and staged
    /// through the host).
    fn device_direct(&self) -> bool {
        false
    }
}

/// A transport instance in one process.
#[async_trait]
pub(crate) trait Transport: Send + Sync {
    /// The transport's name.
    fn name(&self) -> &'static str;

    /// Our address for the exchange: what a peer's [`connect`](Self::connect)
    /// needs, packed by this transport.
    fn address(&self) -> Result<Vec<u8>>;

    /// Whether `peer` can be reached through this transport. `Err`: its
    /// address cannot be read (a bootstrap error: the job cannot start).
    fn reaches(&self, peer: &Peer<'_>) -> Result<bool>;

    /// Check the whole job's table before any rank connects (every rank
    /// runs the same check on the same table, so all of them fail alike).
    fn check_job(&self, _job: &[Published]) -> Result<()> {
        Ok(())
    }

    /// Connect the peers the fabric routed here; a link per peer.
    fn connect(self: Arc<Self>, peers: &[Peer<'_>]) -> Result<Vec<(Rank, Arc<dyn Link>)>>;

    /// Add this transport's counters to a snapshot.
    fn add_stats(&self, _s: &mut crate::Stats) {}

    /// Register a new region's memory `raw` (key id `id`) with this
    /// transport's hardware, if it reaches peers' memory that way (a NIC):
    /// the handle peers need, carried in the region's key, and the
    /// registration, kept with the region and dropped before its memory.
    /// `None`: nothing to register (or it failed, and was logged and
    /// counted: peers then reach the region through the target's
    /// progress).
    fn register_memory(
        &self,
        _id: &crate::core::region::KeyId,
        _raw: RawBuf,
    ) -> Option<(crate::core::region::KeyHandle, crate::core::region::NicReg)> {
        None
    }

    /// Allocate `len` zeroed bytes on GPU `device` for a region with key
    /// id `id`, if this transport has device memory: the memory and the
    /// key's handle. `None` (the default): it has none.
    fn alloc_device(
        &self,
        _device: u32,
        _len: usize,
        _id: &crate::core::region::KeyId,
    ) -> Option<DeviceMade> {
        None
    }

    /// Offer `len` bytes of device memory at `ptr`, which the user
    /// allocated and keeps allocated, for a region with key id `id`, if
    /// this transport has device memory: the memory (never freed by the
    /// transport) and the key's handle. `None` (the default): it has none.
    fn register_device(
        &self,
        _ptr: u64,
        _len: usize,
        _id: &crate::core::region::KeyId,
    ) -> Option<DeviceMade> {
        None
    }

    /// The concrete transport, for accessors of one transport's own
    /// (`Fabric::udp_stats`).
    fn as_any(&self) -> &dyn std::any::Any;

    /// Make progress without blocking: receive, dispatch, push queued data.
    /// Returns the amount of work done (0 = nothing to do).
    fn progress(&self) -> usize;

    /// Whether [`Transport::take_direct`] may find messages: only such
    /// transports are asked. Default: no.
    fn takes_direct(&self) -> bool {
        false
    }

    /// Take the next message for `tag` straight into `buf` (cleared
    /// first) when it is the first thing waiting from some peer on this
    /// transport's small-message path and can be taken without the rest of
    /// progress; its sender. It may look up to `looks` times while nothing
    /// else is waiting (a spin cheaper than progress turns). `queued` is
    /// the tag's queue length word, to be
    /// read under the lock that orders this transport's deliveries: a
    /// message may be taken only while it reads 0 (an earlier one from the
    /// same peer may be queued). `None`: nothing such was taken; the
    /// caller runs [`Transport::progress`] as usual. A transport must
    /// still hand the rest of its work to `progress` now and then although
    /// every look finds a message here (its control traffic, returns).
    /// Having taken one, it may take the messages for `tag` that already
    /// wait behind it from the same sender into `more` (in order, as many
    /// as [`More::wanted`](crate::core::dispatch::More::wanted)), never
    /// looking or waiting for more to arrive.
    /// Default: `None`.
    fn take_direct(
        &self,
        _tag: u64,
        _queued: &std::sync::atomic::AtomicUsize,
        _buf: &mut Vec<u8>,
        _more: &mut crate::core::dispatch::More<'_>,
        _looks: u32,
    ) -> Option<Rank> {
        None
    }

    /// Whether the progress task must keep polling although a poll found
    /// nothing (data of posted operations moves only while progress is
    /// called: a manual-progress NIC provider). Default: no.
    fn keep_hot(&self) -> bool {
        false
    }

    /// Prepare to park: ask peers to ring our doorbell. `false` when work
    /// arrived meanwhile (do not park).
    fn arm(&self) -> bool;

    /// Undo [`Transport::arm`] after waking.
    fn disarm(&self);

    /// Wait until a peer rings or `timeout` passes.
    async fn wait(&self, timeout: Duration);

    /// Check peers' liveness; fail everything pending on dead ones.
    fn check_peers(&self);

    /// Whether every peer has consumed what we sent (fragments returned,
    /// messages acknowledged).
    fn drained(&self) -> bool;

    /// What keeps [`Transport::drained`] false, one line per peer, for the
    /// error a close reports when it gives up waiting.
    fn undrained(&self) -> Vec<String> {
        Vec::new()
    }

    /// Release OS resources (unlink names); called once at close.
    fn shutdown(&self);

    /// A control message of ours from `src`'s transport of the same name
    /// ([`Kind::Control`], sent by `Core::send_control`). An error says
    /// what was wrong with it; the core counts and drops it.
    fn on_control(&self, src: Rank, data: &[u8]) -> std::result::Result<(), String> {
        let _ = (src, data);
        Err(format!(
            "a control message for {}, which takes none",
            self.name()
        ))
    }
}

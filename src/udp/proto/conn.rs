//! `Connection`: one reliable, ordered message stream pair with one peer.

use std::collections::VecDeque;
use std::fmt;
use std::time::Instant;

use bytes::Bytes;

use super::config::{Config, ConfigError};
use super::header::{decode_sealed, DecodeError, Flags, Header, Kind, Sack};
use super::recv::{Buffers, Landed, Lent, RecvSide};
use super::seal::{Seal, Trailer};
use super::send::{AckInfo, SendSide};
use super::stats::Stats;
use crate::Rank;

/// Who a connection belongs to. Datagrams whose job id or ranks do not match
/// are dropped (counted in [`Stats::misdirected`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnIds {
    /// Job id, derived from the job key by the caller.
    pub job: u64,
    /// This process's rank.
    pub local_rank: Rank,
    /// The peer's rank.
    pub peer_rank: Rank,
}

/// Identifies a message sent on a connection; ids count up from 0 in send
/// order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MsgId(pub u64);

impl fmt::Display for MsgId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "msg#{}", self.0)
    }
}

/// Something the connection reports to its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A whole message from the peer. Each message is delivered exactly
    /// once, intact, in the order the peer sent it.
    Message(Bytes),
    /// The peer acknowledged the last byte of this message. Reported in send
    /// order, once per message.
    Acked(MsgId),
    /// The peer stopped acknowledging data for [`Config::peer_timeout`]. The
    /// connection is dead: it sends nothing more, and
    /// [`Connection::unacked_messages`] lists what the peer may not have got.
    PeerLost,
}

/// Tells the driver how to send the datagram `poll_transmit` wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Send on the priority channel: ACK-only packets and first
    /// transmissions of messages up to [`Config::priority_threshold`] bytes.
    pub priority: bool,
}

/// Why [`Connection::send`] refused a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The send budget is used up. Nothing was queued and nothing is lost:
    /// the message is handed back unchanged. Retry once
    /// [`Connection::can_send`] says yes, which happens as ACKs arrive.
    #[error("send budget full: the message was handed back; retry when acknowledgements free space (Connection::can_send)")]
    WouldBlock(Bytes),
    /// The message exceeds [`Config::max_message`]; it never will fit.
    #[error(
        "message of {len} bytes exceeds max_message ({max}): split it or raise Config::max_message"
    )]
    TooLarge {
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The peer is lost; the connection accepts nothing more.
    #[error("the peer is lost; open a new connection once it is back")]
    PeerLost,
}

impl SendError {
    /// The refused message, when the error hands it back.
    pub fn into_message(self) -> Option<Bytes> {
        match self {
            SendError::WouldBlock(msg) => Some(msg),
            _ => None,
        }
    }
}

/// The protocol state for one peer: sequence numbers, windows, timers,
/// retransmission storage and reassembly. Sans-IO: see the
/// [module docs](super) for how a driver runs it.
pub struct Connection {
    ids: ConnIds,
    seal: Seal,
    send: SendSide,
    recv: RecvSide,
    events: VecDeque<Event>,
    stats: Stats,
    lost: bool,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("ids", &self.ids)
            .field("lost", &self.lost)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Creates a connection whose datagrams carry a CRC
    /// ([`Guard::Crc`](super::Guard::Crc), which `config` must name).
    /// `local_isn` is the first sequence number this side sends, `peer_isn`
    /// the first it expects; both are random values exchanged beforehand
    /// (the peer uses them the other way round).
    pub fn new(
        config: Config,
        ids: ConnIds,
        local_isn: u64,
        peer_isn: u64,
        now: Instant,
    ) -> Result<Self, ConfigError> {
        Self::with_seal(config, ids, local_isn, peer_isn, now, Seal::crc())
    }

    /// Creates a connection whose datagrams `seal` guards (its guard must
    /// be `config.guard`); otherwise as [`new`](Self::new).
    pub fn with_seal(
        config: Config,
        ids: ConnIds,
        local_isn: u64,
        peer_isn: u64,
        now: Instant,
        seal: Seal,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        if seal.guard() != config.guard {
            return Err(ConfigError(
                "the seal's guard differs from Config::guard (a MAC needs Connection::with_seal)",
            ));
        }
        Ok(Connection {
            ids,
            seal,
            send: SendSide::new(&config, local_isn, now),
            recv: RecvSide::new(&config, peer_isn),
            events: VecDeque::new(),
            stats: Stats::default(),
            lost: false,
        })
    }

    /// Take the buffers of received messages from `b` (for example a pool
    /// that recycles large buffers) instead of fresh allocations: those of
    /// messages that span several datagrams, and the copy of every
    /// one-datagram message out of the receive buffer (for every size:
    /// `b` decides what is worth pooling).
    pub fn set_buffers(&mut self, b: std::sync::Arc<dyn Buffers>) {
        self.recv.set_buffers(b);
    }

    /// What guards this connection's datagrams.
    pub fn guard(&self) -> super::Guard {
        self.seal.guard()
    }

    /// Who this connection belongs to.
    pub fn ids(&self) -> ConnIds {
        self.ids
    }

    /// Queues a whole message; it is cut into datagrams lazily, as slices of
    /// `msg` (no copy). The connection holds `msg` until the peer has
    /// acknowledged all of it ([`Event::Acked`]).
    ///
    /// Backpressure: once the bytes queued or unacknowledged would exceed
    /// [`Config::send_budget`], the message is refused with
    /// [`SendError::WouldBlock`], which hands it back untouched: nothing was
    /// queued and no id was used. A message larger than the budget is
    /// accepted when nothing else is queued or unacknowledged, so every size
    /// up to [`Config::max_message`] can be sent. `now` is unused today and
    /// kept for the sans-IO calling convention.
    pub fn send(&mut self, now: Instant, msg: Bytes) -> Result<MsgId, SendError> {
        let _ = now;
        if self.lost {
            return Err(SendError::PeerLost);
        }
        self.send.queue(msg, &mut self.stats)
    }

    /// Whether `send` would accept a message of `len` bytes now.
    /// The largest message [`Connection::send`] accepts
    /// ([`Config::max_message`]).
    pub fn max_message(&self) -> u64 {
        self.send.max_message()
    }

    /// Whether a message of `len` bytes would be accepted now.
    pub fn can_send(&self, len: usize) -> bool {
        !self.lost && self.send.can_send(len)
    }

    /// Data segments sent and not yet acknowledged, plus messages queued
    /// and not yet cut into segments: how busy the path to the peer is.
    pub fn in_flight(&self) -> usize {
        self.send.in_flight()
    }

    /// Payload bytes one datagram carries.
    pub fn chunk(&self) -> usize {
        self.send.chunk()
    }

    /// Processes one received datagram. Anything malformed, corrupted,
    /// misdirected, duplicated or outside the window is dropped and counted;
    /// peer input never panics and never grows memory beyond the windows
    /// and [`Config::max_message`].
    pub fn handle_datagram(&mut self, now: Instant, datagram: &[u8]) {
        self.stats.datagrams_received += 1;
        if self.lost {
            return;
        }
        let (hdr, payload) = match decode_sealed(datagram, &mut self.seal) {
            Ok(decoded) => decoded,
            Err(DecodeError::BadChecksum) => {
                self.stats.checksum_errors += 1;
                return;
            }
            Err(DecodeError::Replayed) => {
                self.stats.replays_dropped += 1;
                return;
            }
            Err(_) => {
                self.stats.decode_errors += 1;
                return;
            }
        };
        if hdr.job != self.ids.job
            || hdr.src != self.ids.peer_rank
            || hdr.dst != self.ids.local_rank
        {
            self.stats.misdirected += 1;
            return;
        }
        self.apply_ack(now, &hdr);
        match hdr.kind {
            Kind::Data(chunk) => {
                self.recv
                    .on_data(now, &hdr, chunk, payload, &mut self.events, &mut self.stats);
            }
            Kind::Ack(_) => self.stats.acks_received += 1,
        }
    }

    /// Lend the buffer of the message being reassembled, so that the
    /// next chunks' payloads can be received straight into it (see
    /// [`Lent`]), with room for `chunks` more of its chunks where the
    /// message allows. `None` when no message is half-received, or the peer
    /// is lost. Feed nothing to this connection until the buffer is back
    /// ([`return_reassembly`](Self::return_reassembly)).
    pub fn lend_reassembly(&mut self, chunks: usize) -> Option<Lent> {
        if self.lost {
            return None;
        }
        self.recv.lend(chunks)
    }

    /// Whether no message is half-received and one of the last two spanned
    /// several datagrams: a driver that receives in place reads the next
    /// data datagram alone (it probably starts another large message, whose
    /// buffer it can borrow once that datagram is in).
    pub fn between_large_messages(&self) -> bool {
        !self.lost && self.recv.between_large()
    }

    /// Give back a lent buffer with the datagrams received into it, in
    /// arrival order. Each is checked as [`handle_datagram`](Self::handle_datagram)
    /// would (checksum over its three parts, ids, sequence, chunk
    /// position); those that are the message's next chunks, in place, are
    /// taken without a copy. From the first that is not, each is joined
    /// into one datagram and handled as usual (so whatever it is, it
    /// counts and acts the same as if it had come whole). A `Landed` whose
    /// payload lies outside `lent.buf` is counted as a decode error.
    pub fn return_reassembly(&mut self, now: Instant, mut lent: Lent, landed: &[Landed<'_>]) {
        let mut taken = 0;
        for l in landed {
            if self.lost {
                break;
            }
            let Some(payload) =
                l.at.checked_add(l.len)
                    .and_then(|end| lent.buf.get(l.at..end))
            else {
                break;
            };
            let Ok(hdr) =
                super::header::decode_parts(l.head, payload, l.trailer.as_ref(), &mut self.seal)
            else {
                break;
            };
            if hdr.job != self.ids.job
                || hdr.src != self.ids.peer_rank
                || hdr.dst != self.ids.local_rank
                || !self.recv.fits_lent(&hdr, &lent, l.at)
            {
                break;
            }
            self.seal.take(l.trailer.as_ref());
            self.stats.datagrams_received += 1;
            self.apply_ack(now, &hdr);
            taken += 1;
            if self
                .recv
                .take_lent(now, &hdr, &mut lent, l.len, &mut self.stats)
            {
                break;
            }
        }
        // Join the rest before the buffer is cut back to what was taken.
        let rest: Vec<Vec<u8>> = landed[taken..]
            .iter()
            .map(|l| {
                let payload =
                    l.at.checked_add(l.len)
                        .and_then(|end| lent.buf.get(l.at..end));
                match payload {
                    Some(p) => [l.head, p, l.trailer.as_ref()].concat(),
                    // Not a datagram we can rebuild: counted below.
                    None => Vec::new(),
                }
            })
            .collect();
        self.recv
            .restore(now, lent, &mut self.events, &mut self.stats);
        for d in rest {
            self.handle_datagram(now, &d);
        }
    }

    /// Processes only the acknowledgement in a datagram's header (`hdr`,
    /// as [`decode`](Self::decode) returned it, trailer verified): its
    /// cumulative ACK, SACK blocks and flags; any data it carries is left
    /// unread. For a driver that holds a peer's DATA datagrams back
    /// (receive backpressure) but must keep acting on the peer's ACKs of
    /// our own data, so that our window and completions move on. Feeding
    /// the whole datagram later with
    /// [`handle_datagram`](Self::handle_datagram) is harmless: its ACK is
    /// old news then. A header for another connection is ignored (counted
    /// when the datagram itself is fed).
    pub fn handle_ack(&mut self, now: Instant, hdr: &Header) {
        if self.lost
            || hdr.job != self.ids.job
            || hdr.src != self.ids.peer_rank
            || hdr.dst != self.ids.local_rank
        {
            return;
        }
        self.apply_ack(now, hdr);
    }

    fn apply_ack(&mut self, now: Instant, hdr: &Header) {
        let ack = AckInfo {
            ack: hdr.ack,
            gap: hdr.flags.contains(Flags::GAP),
            ack_only: matches!(hdr.kind, Kind::Ack(_)),
            sack: match hdr.kind {
                Kind::Ack(sack) => sack,
                Kind::Data(_) => Sack::EMPTY,
            },
        };
        self.send
            .on_ack(now, ack, &mut self.events, &mut self.stats);
        if matches!(hdr.kind, Kind::Ack(_)) && hdr.flags.contains(Flags::BUSY) {
            self.send.peer_busy(now);
        }
    }

    /// Writes the next datagram to send into `buf` (cleared first) and says
    /// which channel it goes on; `None` when there is nothing to send now.
    /// Call until `None` after every `send`/`handle_*`.
    ///
    /// Order: ACKs owed for out-of-order data (they are the duplicate ACKs
    /// the peer's fast retransmit counts), then retransmissions, then new
    /// data within the send window (each carrying the current ACK), then a
    /// delayed ACK that fell due with no data to ride on.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        buf.clear();
        let (t, hdr, payload) = self.next_transmit(now)?;
        hdr.encode_sealed(&payload, buf, &mut self.seal);
        Some(t)
    }

    /// Like [`poll_transmit`](Self::poll_transmit), for a vectored send
    /// that never copies the payload: writes the header into `head`
    /// (cleared first) and returns the payload (a slice of the message sent,
    /// empty for ACKs) and the trailer. The datagram is `head`, then the
    /// payload, then the trailer.
    pub fn poll_transmit_split(
        &mut self,
        now: Instant,
        head: &mut Vec<u8>,
    ) -> Option<(Transmit, Bytes, Trailer)> {
        head.clear();
        let (t, hdr, payload) = self.next_transmit(now)?;
        let trailer = hdr.encode_split(&payload, head, &mut self.seal);
        Some((t, payload, trailer))
    }

    /// Encodes a datagram the driver makes itself (a keepalive ACK) under
    /// this connection's seal, as [`Header::encode_split`] does.
    pub fn encode_split(&mut self, hdr: &Header, payload: &[u8], head: &mut Vec<u8>) -> Trailer {
        hdr.encode_split(payload, head, &mut self.seal)
    }

    /// Decodes and verifies a datagram from the peer under this
    /// connection's seal without acting on it (a driver that holds data
    /// back but reads its ACK: see [`handle_ack`](Self::handle_ack)).
    /// Feed it later with [`handle_datagram`](Self::handle_datagram) as
    /// usual.
    /// Its MAC counter is checked, not taken: the later feed takes it.
    pub fn decode<'a>(&mut self, datagram: &'a [u8]) -> Result<(Header, &'a [u8]), DecodeError> {
        super::header::decode_opened(datagram, &mut self.seal, false)
    }

    /// The next datagram to send, as a header and its payload, with the
    /// bookkeeping of it being sent done.
    fn next_transmit(&mut self, now: Instant) -> Option<(Transmit, Header, Bytes)> {
        if self.lost {
            return None;
        }
        if self.recv.take_owed_ack() {
            return Some(self.ack_header());
        }
        if let Some(seg) = self.send.next_segment(now, &mut self.stats) {
            let flags = self.gap_flag(seg.flags);
            let hdr = self.header(seg.seq, flags, Kind::Data(seg.chunk));
            self.recv.ack_sent();
            self.stats.datagrams_sent += 1;
            if seg.priority {
                self.stats.priority_sent += 1;
            }
            let t = Transmit {
                priority: seg.priority,
            };
            return Some((t, hdr, seg.payload));
        }
        if self.recv.ack_due(now) {
            return Some(self.ack_header());
        }
        None
    }

    fn gap_flag(&self, flags: Flags) -> Flags {
        if self.recv.has_gap() {
            flags.with(Flags::GAP)
        } else {
            flags
        }
    }

    fn header(&self, seq: u64, flags: Flags, kind: Kind) -> Header {
        Header {
            job: self.ids.job,
            src: self.ids.local_rank,
            dst: self.ids.peer_rank,
            flags,
            seq,
            ack: self.recv.ack_value(),
            kind,
        }
    }

    fn ack_header(&mut self) -> (Transmit, Header, Bytes) {
        let sack = self.recv.sack_blocks();
        let hdr = self.header(
            self.send.nxt().0,
            self.gap_flag(Flags::NONE),
            Kind::Ack(sack),
        );
        self.recv.ack_sent();
        self.stats.datagrams_sent += 1;
        self.stats.priority_sent += 1;
        self.stats.acks_sent += 1;
        (Transmit { priority: true }, hdr, Bytes::new())
    }

    /// Whether [`poll_transmit`](Self::poll_transmit) would return a
    /// datagram at `now`: an ACK owed, a resend queued, or new data with an
    /// open window. Cheap (no clock, no allocation): a driver may use it to
    /// put off its transmit pass while only deadlines lie ahead.
    pub fn wants_transmit(&self, now: Instant) -> bool {
        !self.lost && (self.recv.ack_owed(now) || self.send.has_segment())
    }

    /// Datagrams received so far that decoded, passed the checksum and
    /// were addressed to this connection (what [`Stats`] would give as
    /// received minus rejected, without building the whole snapshot).
    pub fn datagrams_accepted(&self) -> u64 {
        let s = &self.stats;
        s.datagrams_received
            .saturating_sub(s.checksum_errors + s.replays_dropped + s.decode_errors + s.misdirected)
    }

    /// The earliest time at which [`handle_timeout`](Self::handle_timeout)
    /// (or, for a delayed ACK, `poll_transmit`) has work: the delayed ACK,
    /// the retransmission timer or the peer-loss timer. `None` when idle or
    /// lost.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.lost {
            return None;
        }
        match (self.recv.deadline(), self.send.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Fires the timers due at `now`: queues a retransmission (with
    /// backoff), or declares the peer lost. A due delayed ACK is sent by the
    /// next `poll_transmit`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.lost {
            return;
        }
        if self.send.on_timeout(now, &mut self.stats) {
            self.lost = true;
            self.events.push_back(Event::PeerLost);
        }
    }

    /// The next event, if any. Drain after every `handle_*`.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Counters and a snapshot of the windows.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats;
        self.send.fill_stats(&mut s);
        self.recv.fill_stats(&mut s);
        s
    }

    /// Whether nothing is queued, unacknowledged or owed to the peer: a
    /// close can stop driving the connection.
    pub fn is_idle(&self) -> bool {
        self.send.is_empty() && self.recv.is_idle()
    }

    /// Whether the peer was declared lost.
    pub fn is_lost(&self) -> bool {
        self.lost
    }

    /// Messages sent but not fully acknowledged, in send order: after
    /// [`Event::PeerLost`] (or an abandoned close), the ones the peer may not
    /// have received.
    pub fn unacked_messages(&self) -> Vec<MsgId> {
        self.send.unacked_messages()
    }
}

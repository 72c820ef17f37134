//! One remote rank as the `udp` driver sees it: the protocol connection,
//! the ordered queue of messages the protocol refused for now, datagrams
//! the kernel refused for now, and the liveness clocks.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::frame::{self, Bundle};
use super::io;
use super::proto::{self, Connection, Event, SendError};
use crate::core::completion::Completion;
use crate::{Error, Rank, Result};

/// A message (one or two protocol messages) waiting for send budget.
struct Pending {
    parts: VecDeque<Bytes>,
    done: Arc<Completion>,
}

/// Mutable state of one peer (behind [`Peer::st`]).
pub(crate) struct PeerState {
    pub(crate) conn: Connection,
    queue: VecDeque<Pending>,
    /// Datagrams the kernel had no room for, sent first next time.
    backlog: VecDeque<Out>,
    /// Recycled header buffers.
    spare: Vec<Vec<u8>>,
    pub(crate) last_sent: Instant,
    pub(crate) last_heard: Instant,
    /// Datagrams the connection accepted as well-formed and ours, so far.
    valid_seen: u64,
    /// Small messages gathered while the path is busy (see
    /// [`BUNDLE_AFTER`]) or on request ([`PeerState::gather_held`]).
    bundle: Option<Gathered>,
    /// Small messages submitted in a row (a larger one resets it).
    small_run: usize,
    /// Bundling is on (`UdpConfig::bundle`).
    bundling: bool,
}

/// An open bundle.
struct Gathered {
    bundle: Bundle,
    /// When the gathering began.
    since: Instant,
    /// Gathered on request: leaves at the next flush, busy path or not.
    held: bool,
}

/// Small messages are gathered into one protocol message (a bundle, see
/// `frame`) once more than this many were sent in a row and at least this
/// many data segments are in flight to the peer: a stream of small sends
/// then costs a datagram per bundle, not per message, while a lone
/// message, a ping-pong, a few requests before a reply, or a small message
/// after a large one goes out at once. The bundle leaves when an
/// acknowledgement brings the segments in flight below this (every
/// segment that empties our queue asks for a prompt one), when it is full,
/// or after [`BUNDLE_WAIT`] — Nagle's idea, with a few messages allowed in
/// flight instead of one. The price: in a stream of small messages, one
/// sent while the path is busy waits for an acknowledgement, at most a
/// round trip (or `BUNDLE_WAIT`). (Open MPI's TCP BTL sends each message
/// by itself; its one-sided layer gathers puts until a flush.)
pub(crate) const BUNDLE_AFTER: usize = 4;

/// The longest a bundle waits for an acknowledgement.
pub(crate) const BUNDLE_WAIT: Duration = Duration::from_micros(50);

/// One-part encodings larger than this are never bundled.
pub(crate) const BUNDLE_ITEM_MAX: usize = 4096 + 64;

/// Bytes of a bundle at most (and never more than one datagram carries).
pub(crate) const BUNDLE_MAX: usize = 32 * 1024;

/// A datagram to send, in parts, so the payload (a slice of the user's
/// message) is never copied: header, payload, trailer.
struct Out {
    priority: bool,
    head: Vec<u8>,
    payload: Bytes,
    trailer: proto::Trailer,
}

impl Out {
    fn parts(&self) -> io::Parts<'_> {
        [&self.head, &self.payload, self.trailer.as_ref()]
    }
}

/// Datagrams one send call takes at most with GSO on: a few packets of up
/// to 64 datagrams each.
const GSO_RUN: usize = 4 * super::offload::MAX_SEGS;

/// Bytes the first batch of a flush carries at most (see `flush`).
const FIRST_BATCH_BYTES: usize = 64 * 1024;

/// One remote rank.
pub(crate) struct Peer {
    pub(crate) rank: Rank,
    pub(crate) data_addr: SocketAddr,
    pub(crate) prio_addr: SocketAddr,
    /// Largest datagram (UDP payload) we send it: the path MTU less the
    /// IP and UDP headers of its family.
    pub(crate) max_datagram: usize,
    /// GSO may be used towards it: our datagrams fit the route whole, and
    /// the kernel has not refused a GSO send to it.
    pub(crate) gso: AtomicBool,
    /// Most bytes of raw datagrams kept while the peer is paused (receive
    /// backpressure).
    pub(crate) stash_limit: usize,
    pub(crate) lost: AtomicBool,
    /// Why it was lost (set before `lost`).
    pub(crate) lost_reason: std::sync::OnceLock<String>,
    /// Our receive side holds this peer's data back (its tag is full): our
    /// keepalives say so (`Flags::BUSY`). Relaxed: a hint for keepalives.
    pub(crate) busy: AtomicBool,
    pub(crate) st: Mutex<PeerState>,
}

/// What a `send`-like call did.
pub(crate) enum Queued {
    /// Every part was accepted by the protocol: locally complete.
    Done,
    /// Some parts wait in the queue; the completion fires when they go.
    Waiting(Arc<Completion>),
}

impl PeerState {
    /// `bundling`: gather small messages (`UdpConfig::bundle`).
    pub(crate) fn new(conn: Connection, now: Instant, bundling: bool) -> PeerState {
        PeerState {
            conn,
            queue: VecDeque::new(),
            backlog: VecDeque::new(),
            spare: Vec::new(),
            last_sent: now,
            last_heard: now,
            valid_seen: 0,
            bundle: None,
            small_run: 0,
            bundling,
        }
    }

    pub(crate) fn queue_is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether messages wait here for the protocol (queued, or in a
    /// bundle).
    pub(crate) fn holds_messages(&self) -> bool {
        !self.queue.is_empty() || self.bundle.is_some()
    }

    /// Whether nothing is queued, unsent or unacknowledged either way.
    pub(crate) fn is_idle(&self) -> bool {
        self.queue.is_empty()
            && self.bundle.is_none()
            && self.backlog.is_empty()
            && self.conn.is_idle()
    }

    /// The earliest deadline of the connection's timers and of an open
    /// bundle.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let b = self
            .bundle
            .as_ref()
            .and_then(|g| g.since.checked_add(BUNDLE_WAIT));
        match (self.conn.poll_timeout(), b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether the open bundle should leave now.
    fn bundle_due(&self, now: Instant) -> bool {
        self.bundle.as_ref().is_some_and(|g| {
            g.held
                || self.conn.in_flight() < BUNDLE_AFTER
                || now.saturating_duration_since(g.since) >= BUNDLE_WAIT
        })
    }

    /// Hand the open bundle to the protocol if it should leave now.
    fn close_due(&mut self, now: Instant, rank: Rank) {
        if self.bundle_due(now) && self.close_bundle(now, rank).is_err() {
            // The peer is lost: the loss path fails what is pending.
            self.bundle = None;
        }
    }

    /// Bytes a bundle may hold.
    fn bundle_cap(&self) -> usize {
        BUNDLE_MAX.min(self.conn.chunk())
    }

    /// Whether a one-part encoding of `len` bytes may join a bundle (at
    /// least two fit in one; on a 1500-byte path that is about 700 bytes).
    fn bundleable(&self, len: usize) -> bool {
        len <= BUNDLE_ITEM_MAX.min((self.bundle_cap() / 2).saturating_sub(frame::BUNDLE_ENTRY))
    }

    /// Gather `msg` (a one-part encoding when `one_part`) into the open
    /// bundle, or open one while the path is busy; otherwise close any
    /// open bundle, which nothing may overtake, and hand `msg` back.
    fn gather(
        &mut self,
        now: Instant,
        rank: Rank,
        msg: Bytes,
        one_part: bool,
    ) -> Result<Option<Bytes>> {
        let small = one_part && self.bundleable(msg.len());
        self.small_run = if small { self.small_run + 1 } else { 0 };
        let busy = self.small_run > BUNDLE_AFTER && self.conn.in_flight() >= BUNDLE_AFTER;
        self.gather_if(now, rank, msg, one_part, busy, false)
    }

    /// [`gather`](Self::gather) with the decision made: open a bundle
    /// when `open` (marked `held` or not).
    fn gather_if(
        &mut self,
        now: Instant,
        rank: Rank,
        msg: Bytes,
        one_part: bool,
        open: bool,
        held: bool,
    ) -> Result<Option<Bytes>> {
        let small =
            self.bundling && one_part && self.bundleable(msg.len()) && self.queue.is_empty();
        let cap = self.bundle_cap();
        let mut msg = msg;
        if let Some(g) = &mut self.bundle {
            if small {
                match g.bundle.push(msg, cap) {
                    Ok(()) => {
                        g.held |= held;
                        return Ok(None);
                    }
                    Err(m) => msg = m,
                }
            }
            self.close_bundle(now, rank)?;
        }
        if small && open {
            self.bundle = Some(Gathered {
                bundle: Bundle::new(msg),
                since: now,
                held,
            });
            return Ok(None);
        }
        Ok(Some(msg))
    }

    /// Write a small one-part message straight into the open bundle (held
    /// now) when it may join it: `None` when there is no open bundle, no
    /// room, or it may not (then `fill` was not called).
    pub(crate) fn append_held(
        &mut self,
        kind: crate::transport::Kind,
        tag: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut Vec<u8>) -> Result<()>,
    ) -> Option<Result<()>> {
        if !self.bundling || !self.queue.is_empty() || !self.bundleable(frame::PREFIX + len) {
            return None;
        }
        let cap = self.bundle_cap();
        let g = self.bundle.as_mut()?;
        let r = g.bundle.push_with(kind, tag, len, cap, fill)?;
        if r.is_ok() {
            g.held = true;
            // A small message, as `gather` counts them.
            self.small_run += 1;
        }
        Some(r)
    }

    /// Queue a message like [`submit`](Self::submit), but gather a small
    /// one into a bundle that leaves at the next flush, busy path or not
    /// (the caller does not flush now: the rest of a burst may follow).
    /// Returns whether it was gathered.
    pub(crate) fn gather_held(
        &mut self,
        now: Instant,
        rank: Rank,
        (first, second): super::frame::Parts,
    ) -> Result<(Queued, bool)> {
        match self.gather_if(now, rank, first, second.is_none(), true, true)? {
            None => Ok((Queued::Done, true)),
            Some(first) => Ok((self.submit_now(now, rank, (first, second))?, false)),
        }
    }

    /// Hand the open bundle to the protocol (or to the queue, behind what
    /// waits there).
    fn close_bundle(&mut self, now: Instant, rank: Rank) -> Result<()> {
        let Some(g) = self.bundle.take() else {
            return Ok(());
        };
        let mut msg = g.bundle.finish();
        if self.queue.is_empty() {
            match self.conn.send(now, msg) {
                Ok(_) => return Ok(()),
                Err(SendError::WouldBlock(m)) => msg = m,
                Err(e) => return Err(to_error(e, rank)),
            }
        }
        // Its messages were reported sent (accepted); nobody waits on this
        // completion.
        self.queue.push_back(Pending {
            parts: VecDeque::from([msg]),
            done: Completion::new(),
        });
        Ok(())
    }

    pub(crate) fn has_backlog(&self) -> bool {
        !self.backlog.is_empty()
    }

    /// Whether the driver's service pass has something to do for this peer
    /// at `now` besides deadlines further on: a datagram to send (an ACK
    /// owed, a resend, data with an open window), queued messages the
    /// protocol may now take, datagrams the kernel refused, or a bundle
    /// that should leave.
    pub(crate) fn wants_service(&self, now: Instant) -> bool {
        self.conn.wants_transmit(now)
            || !self.queue.is_empty()
            || !self.backlog.is_empty()
            || self.bundle_due(now)
    }

    /// Feed one datagram; events go to `out`. Refreshes the liveness clock
    /// when the connection found the datagram valid.
    pub(crate) fn feed(&mut self, now: Instant, dgram: &[u8], out: &mut Vec<Event>) {
        self.conn.handle_datagram(now, dgram);
        self.heard(now, out);
    }

    /// Give back a reassembly buffer lent for an in-place receive, with the
    /// datagrams that landed in it; like [`feed`](Self::feed) otherwise.
    pub(crate) fn give_back(
        &mut self,
        now: Instant,
        lent: proto::Lent,
        landed: &[proto::Landed<'_>],
        out: &mut Vec<Event>,
    ) {
        self.conn.return_reassembly(now, lent, landed);
        self.heard(now, out);
    }

    /// Refresh the liveness clock if the connection took new datagrams as
    /// valid; collect its events.
    fn heard(&mut self, now: Instant, out: &mut Vec<Event>) {
        let v = self.conn.datagrams_accepted();
        if v > self.valid_seen {
            self.valid_seen = v;
            self.last_heard = now;
        }
        out.extend(std::iter::from_fn(|| self.conn.poll_event()));
    }

    /// Offer queued messages to the protocol, in order. Returns how many
    /// messages completed locally.
    pub(crate) fn push_queue(&mut self, now: Instant, rank: Rank) -> usize {
        let mut n = 0;
        while let Some(head) = self.queue.front_mut() {
            while let Some(part) = head.parts.pop_front() {
                match self.conn.send(now, part) {
                    Ok(_) => {}
                    Err(SendError::WouldBlock(b)) => {
                        head.parts.push_front(b);
                        return n;
                    }
                    Err(e) => {
                        let err = to_error(e, rank);
                        if let Some(h) = self.queue.pop_front() {
                            h.done.complete(Err(err));
                        }
                        return n;
                    }
                }
            }
            if let Some(h) = self.queue.pop_front() {
                h.done.complete(Ok(()));
                n += 1;
            }
        }
        n
    }

    /// Queue a message's parts: what the protocol accepts now goes at once
    /// (nothing may overtake the queue), the rest waits.
    pub(crate) fn submit(
        &mut self,
        now: Instant,
        rank: Rank,
        (first, second): super::frame::Parts,
    ) -> Result<Queued> {
        let Some(first) = self.gather(now, rank, first, second.is_none())? else {
            return Ok(Queued::Done);
        };
        self.submit_now(now, rank, (first, second))
    }

    /// The protocol or the queue takes the message now (no bundle).
    fn submit_now(
        &mut self,
        now: Instant,
        rank: Rank,
        (first, second): super::frame::Parts,
    ) -> Result<Queued> {
        let mut rest: VecDeque<Bytes> = VecDeque::new();
        if self.queue.is_empty() {
            let mut next = Some(first);
            let mut second = second;
            while let Some(p) = next.take() {
                match self.conn.send(now, p) {
                    Ok(_) => next = second.take(),
                    Err(SendError::WouldBlock(b)) => {
                        rest.push_back(b);
                        rest.extend(second.take());
                        break;
                    }
                    Err(e) => return Err(to_error(e, rank)),
                }
            }
            if rest.is_empty() {
                return Ok(Queued::Done);
            }
        } else {
            rest.push_back(first);
            rest.extend(second);
        }
        let done = Completion::new();
        self.queue.push_back(Pending {
            parts: rest,
            done: done.clone(),
        });
        Ok(Queued::Waiting(done))
    }

    /// Fail every queued message (the peer is lost).
    pub(crate) fn fail_queue(&mut self, rank: Rank, reason: &str) {
        self.bundle = None;
        for p in self.queue.drain(..) {
            p.done.complete(Err(Error::PeerLost {
                rank,
                reason: reason.to_string(),
            }));
        }
        self.backlog.clear();
    }

    /// Send everything the connection has to send now. Returns datagrams sent.
    pub(crate) fn flush(&mut self, now: Instant, io: &Sockets, peer: &Peer, max: usize) -> usize {
        self.close_due(now, peer.rank);
        let mut sent = 0;
        // Bytes one batch may carry, doubling from batch to batch: each
        // datagram's CRC is computed before its batch goes out, so a first
        // batch of 16 large datagrams (1 MiB) kept the receiver idle for
        // the whole checksum; a small first batch starts the pipeline.
        let mut budget = FIRST_BATCH_BYTES;
        // With GSO, one call carries several packets of up to 64 datagrams.
        let fill = if gso_for(io, peer).is_some() {
            GSO_RUN
        } else {
            io::BATCH
        };
        loop {
            sent += self.send_backlog(now, io, peer);
            if !self.backlog.is_empty() || sent >= max {
                return sent;
            }
            let mut n = 0;
            let mut bytes = 0;
            while n < fill && bytes < budget {
                let mut head = self.spare.pop().unwrap_or_default();
                match self.conn.poll_transmit_split(now, &mut head) {
                    Some((t, payload, trailer)) => {
                        bytes += head.len() + payload.len();
                        self.backlog.push_back(Out {
                            priority: t.priority,
                            head,
                            payload,
                            trailer,
                        });
                        n += 1;
                    }
                    None => {
                        self.spare.push(head);
                        break;
                    }
                }
            }
            if n == 0 {
                return sent;
            }
            budget = budget.saturating_mul(2);
        }
    }

    /// Send queued datagrams, grouped by channel, until the kernel says full.
    fn send_backlog(&mut self, now: Instant, io: &Sockets, peer: &Peer) -> usize {
        let mut sent = 0;
        while let Some(first) = self.backlog.front() {
            let prio = first.priority;
            let gso = gso_for(io, peer).filter(|_| !prio);
            let most = if gso.is_some() { GSO_RUN } else { io::BATCH };
            let run = self
                .backlog
                .iter()
                .take(most)
                .take_while(|o| o.priority == prio)
                .count();
            let (sock, dst) = if prio {
                (&io.prio, peer.prio_addr)
            } else {
                (&io.data, peer.data_addr)
            };
            // A short run (every send on the latency path) takes its parts
            // from the stack; a long one (GSO) from the heap.
            let n = if run <= io::BATCH {
                let mut parts: [io::Parts<'_>; io::BATCH] = [[&[]; io::PARTS]; io::BATCH];
                for (slot, out) in parts.iter_mut().zip(&self.backlog) {
                    *slot = out.parts();
                }
                io::send(sock, dst, &parts[..run], gso)
            } else {
                let parts: Vec<io::Parts<'_>> =
                    self.backlog.iter().take(run).map(Out::parts).collect();
                io::send(sock, dst, &parts, gso)
            };
            for out in self.backlog.drain(..n) {
                if self.spare.len() < io::BATCH {
                    self.spare.push(out.head);
                }
            }
            sent += n;
            if n > 0 {
                // The caller's clock (a send or a progress call that just
                // read it): the keepalive schedule needs no more precision.
                self.last_sent = self.last_sent.max(now);
            }
            if n < run {
                break;
            }
        }
        sent
    }

    /// A keepalive: an ACK-only datagram carrying our current cumulative
    /// ACK, which the peer's connection takes as a harmless (possibly
    /// repeated) acknowledgement. Proves we are alive when we have nothing
    /// else to say.
    pub(crate) fn keepalive(&mut self, io: &Sockets, peer: &Peer, job: u64, me: Rank) {
        let s = self.conn.stats();
        let h = proto::Header {
            job,
            src: me,
            dst: peer.rank,
            flags: if peer.busy.load(std::sync::atomic::Ordering::Relaxed) {
                proto::Flags::BUSY
            } else {
                proto::Flags::NONE
            },
            seq: s.send_next,
            ack: s.recv_base,
            kind: proto::Kind::Ack(proto::Sack::EMPTY),
        };
        let mut head = Vec::new();
        let trailer = self.conn.encode_split(&h, &[], &mut head);
        self.backlog.push_back(Out {
            priority: true,
            head,
            payload: Bytes::new(),
            trailer,
        });
        self.send_backlog(Instant::now(), io, peer);
    }
}

/// The data socket's offload state, when GSO is on and `peer`'s datagrams
/// are small enough for two to share a GSO packet (not on loopback, whose
/// datagrams are 64 KiB: there batches stay as they were, 16 datagrams).
fn gso_for<'a>(io: &'a Sockets, peer: &'a Peer) -> Option<super::offload::Gso<'a>> {
    let g = super::offload::Gso {
        off: &io.off,
        allowed: &peer.gso,
    };
    (g.on() && peer.max_datagram * 2 <= super::offload::MAX_BYTES).then_some(g)
}

fn to_error(e: SendError, rank: Rank) -> Error {
    match e {
        SendError::PeerLost => Error::PeerLost {
            rank,
            reason: "the udp connection to it failed earlier".into(),
        },
        other => Error::Exhausted {
            what: format!("udp send to rank {rank}: {other}"),
            hint: "send smaller messages (split them) over udp".into(),
        },
    }
}

/// The two sockets of a process.
pub(crate) struct Sockets {
    pub(crate) data: tokio::net::UdpSocket,
    pub(crate) prio: tokio::net::UdpSocket,
    /// GSO/GRO on the data socket.
    pub(crate) off: super::offload::Offload,
}

impl Peer {
    pub(crate) fn is_lost(&self) -> bool {
        // Pairs with the AcqRel swap in `UdpTransport::lose`.
        self.lost.load(Ordering::Acquire)
    }
}

/// How long a peer may be silent before we prove we are alive.
pub(crate) fn keepalive_every(peer_timeout: Duration) -> Duration {
    (peer_timeout / 4).max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::super::frame::{Decoder, Frames};
    use super::super::proto::{Config, ConnIds};
    use super::*;
    use crate::transport::Kind;

    /// Our side of a connection (1500-byte path) and the peer's.
    fn pair(now: Instant) -> (PeerState, Connection, Decoder) {
        let ids = |local_rank, peer_rank| ConnIds {
            job: 9,
            local_rank,
            peer_rank,
        };
        let a = Connection::new(Config::default(), ids(0, 1), 11, 22, now).unwrap();
        let b = Connection::new(Config::default(), ids(1, 0), 22, 11, now).unwrap();
        (PeerState::new(a, now, true), b, Decoder::default())
    }

    fn small(tag: u64) -> super::super::frame::Parts {
        super::super::frame::encode(&Arc::default(), Kind::User, tag, Bytes::from(vec![7; 20]))
    }

    /// Carry every datagram we have to the peer and its acknowledgements
    /// back; the tags it delivers, in order, and how many protocol
    /// messages carried them.
    fn carry(
        a: &mut PeerState,
        b: &mut Connection,
        dec: &mut Decoder,
        now: Instant,
    ) -> (Vec<u64>, usize) {
        let mut buf = Vec::new();
        while a.conn.poll_transmit(now, &mut buf).is_some() {
            b.handle_datagram(now, &buf);
        }
        let (mut tags, mut msgs) = (Vec::new(), 0);
        while let Some(ev) = b.poll_event() {
            if let Event::Message(m) = ev {
                msgs += 1;
                match dec.push(m).unwrap() {
                    Frames::One(_, t, _) => tags.push(t),
                    Frames::Many(it) => tags.extend(it.map(|(_, t, _)| t)),
                    Frames::Head => {}
                }
            }
        }
        // (The peer holds an ACK back a while for a reply to carry it.)
        let later = now + Duration::from_millis(2);
        while b.poll_transmit(later, &mut buf).is_some() {
            a.conn.handle_datagram(now, &buf);
        }
        while a.conn.poll_event().is_some() {}
        (tags, msgs)
    }

    /// A few small messages go out by themselves; from the fifth in a row
    /// with four in flight they gather, until a large message closes the
    /// bundle ahead of itself; a small one after the large one goes out
    /// at once. Everything arrives in order.
    #[test]
    fn bundles_form_in_streams_and_nothing_overtakes_them() {
        let now = Instant::now();
        let (mut a, mut b, mut dec) = pair(now);
        for t in 0..7 {
            assert!(matches!(a.submit(now, 1, small(t)).unwrap(), Queued::Done));
        }
        assert!(a.bundle.as_ref().is_some_and(|g| g.bundle.count() == 3));
        let big = super::super::frame::encode(
            &Arc::default(),
            Kind::User,
            7,
            Bytes::from(vec![1; 70_000]),
        );
        a.submit(now, 1, big).unwrap();
        assert!(a.bundle.is_none(), "the large message closed the bundle");
        a.submit(now, 1, small(8)).unwrap();
        assert!(
            a.bundle.is_none(),
            "a small message after a large one is not held"
        );
        let (tags, msgs) = carry(&mut a, &mut b, &mut dec, now);
        assert_eq!(tags, (0..9).collect::<Vec<_>>());
        // 4 alone, 1 bundle of 3, the large one's head and body, 1 alone.
        assert_eq!(msgs, 8);
    }

    /// With bundling off (`BTL_UDP_BUNDLE=0`), a stream of small messages
    /// and gathered requests each go to the protocol at once.
    #[test]
    fn bundling_off_sends_every_message_by_itself() {
        let now = Instant::now();
        let (a, mut b, mut dec) = pair(now);
        let mut a = PeerState::new(a.conn, now, false);
        for t in 0..10 {
            a.submit(now, 1, small(t)).unwrap();
        }
        let (q, gathered) = a.gather_held(now, 1, small(10)).unwrap();
        assert!(matches!(q, Queued::Done) && !gathered);
        assert!(a.bundle.is_none());
        let (tags, msgs) = carry(&mut a, &mut b, &mut dec, now);
        assert_eq!(tags, (0..11).collect::<Vec<_>>());
        assert_eq!(msgs, 11);
    }

    /// An open bundle leaves when acknowledgements bring the segments in
    /// flight below the threshold, or at its deadline; a held one at the
    /// next flush whatever is in flight.
    #[test]
    fn bundles_leave_on_acknowledgement_deadline_or_flush() {
        let now = Instant::now();
        let (mut a, mut b, mut dec) = pair(now);
        for t in 0..6 {
            a.submit(now, 1, small(t)).unwrap();
        }
        a.close_due(now, 1);
        assert!(a.bundle.is_some(), "four in flight: the bundle waits");
        let (tags, _) = carry(&mut a, &mut b, &mut dec, now);
        assert_eq!(tags, (0..4).collect::<Vec<_>>());
        a.close_due(now, 1);
        assert!(a.bundle.is_none(), "acknowledged: the bundle left");
        assert_eq!(carry(&mut a, &mut b, &mut dec, now).0, vec![4, 5]);

        // Deadline: four more in flight, not acknowledged.
        for t in 6..16 {
            a.submit(now, 1, small(t)).unwrap();
        }
        assert!(a.bundle.is_some());
        a.close_due(now + BUNDLE_WAIT / 2, 1);
        assert!(a.bundle.is_some());
        assert_eq!(a.poll_timeout().map(|t| t >= now + BUNDLE_WAIT), Some(true));
        a.close_due(now + BUNDLE_WAIT, 1);
        assert!(a.bundle.is_none(), "the deadline passed: the bundle left");
        assert_eq!(
            carry(&mut a, &mut b, &mut dec, now).0,
            (6..16).collect::<Vec<_>>()
        );

        // Held: nothing in flight, gathered anyway, sent at the next flush.
        for t in 16..19 {
            let (q, gathered) = a.gather_held(now, 1, small(t)).unwrap();
            assert!(matches!(q, Queued::Done) && gathered);
        }
        a.close_due(now, 1);
        let (tags, msgs) = carry(&mut a, &mut b, &mut dec, now);
        assert_eq!((tags, msgs), (vec![16, 17, 18], 1));
    }
}

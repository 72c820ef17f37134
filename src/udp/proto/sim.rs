//! Deterministic network simulation for protocol tests: two connections, a
//! virtual clock and a seeded link that loses, duplicates, reorders, delays
//! and corrupts datagrams.
//!
//! Side 0 and side 1 each own a [`Connection`] and the [`Link`] carrying
//! their datagrams to the other side. The link serialises datagrams at a
//! fixed bandwidth (one queue for data, one for the priority channel) and
//! adds a fixed latency, so virtual time is meaningful for goodput. Messages
//! queued with [`Sim::queue`] are fed to `send` as the budget allows, so
//! every scenario exercises backpressure.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{
    Config, ConnIds, Connection, Event, Guard, Header, Kind, MsgId, Seal, SendError, Stats,
};

/// Job id used by simulated connections.
pub(crate) const JOB: u64 = 0x006a_6f62_5f6b_6579;

/// What the link does to datagrams going one way.
#[derive(Debug, Clone)]
pub(crate) struct Link {
    /// Probability a datagram is lost.
    pub loss: f64,
    /// Extra loss probability for ACK-only datagrams.
    pub ack_loss: f64,
    /// Probability a datagram is delivered twice.
    pub dup: f64,
    /// Probability a datagram gets an extra random delay (reordering).
    pub reorder: f64,
    /// Upper bound of that extra delay.
    pub reorder_delay: Duration,
    /// Probability one random bit of a datagram is flipped.
    pub corrupt: f64,
    /// One-way propagation delay.
    pub latency: Duration,
    /// Bytes per second of each channel; 0 means unlimited.
    pub bandwidth: u64,
    /// Drop everything.
    pub down: bool,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            loss: 0.0,
            ack_loss: 0.0,
            dup: 0.0,
            reorder: 0.0,
            reorder_delay: Duration::from_micros(300),
            corrupt: 0.0,
            latency: Duration::from_micros(50),
            bandwidth: 1_000_000_000,
            down: false,
        }
    }
}

/// Decides to drop a datagram (true) from its header; sees every datagram
/// its side emits, before the link's random effects.
pub(crate) type Filter = Box<dyn FnMut(&Header) -> bool>;

/// One endpoint of the simulation and what it observed.
pub(crate) struct Side {
    pub conn: Connection,
    pub link: Link,
    pub filter: Option<Filter>,
    /// Messages waiting for send budget.
    pub outbox: VecDeque<Bytes>,
    /// Messages accepted by `send`, in order, with their ids.
    pub sent: Vec<(MsgId, Bytes)>,
    pub received: Vec<Bytes>,
    pub acked: Vec<MsgId>,
    pub lost_at: Option<Instant>,
    pub last_delivery: Option<Instant>,
    pub would_block: u64,
    /// Every datagram emitted, with its send time (before the link).
    pub tx_log: Vec<(Instant, Header)>,
    /// Largest unacked-segment count and receive buffer seen.
    pub max_unacked: u64,
    pub max_recv_buffered: u64,
    free_at: [Instant; 2],
}

/// A datagram on the wire: (arrival, tie-break, destination side, bytes).
type InFlight = (Instant, u64, usize, Vec<u8>);

/// Two connections joined by simulated links, on a virtual clock.
pub(crate) struct Sim {
    pub base: Instant,
    pub now: Instant,
    pub sides: [Side; 2],
    rng: StdRng,
    /// In-flight datagrams: (arrival, tie-break, destination side, bytes).
    wire: BinaryHeap<Reverse<InFlight>>,
    tiebreak: u64,
    buf: Vec<u8>,
}

/// Deterministic, distinct content for message `i` of `len` bytes.
pub(crate) fn message(i: u64, len: usize) -> Bytes {
    let mut v: Vec<u8> = (0..len)
        .map(|j| (i.wrapping_mul(131) as usize ^ j.wrapping_mul(7) ^ (j >> 8)) as u8)
        .collect();
    for (k, b) in i.to_le_bytes().iter().enumerate().take(len) {
        v[k] = *b;
    }
    Bytes::from(v)
}

impl Sim {
    /// A simulation with the same config and link both ways and ISNs drawn
    /// from the seed.
    pub fn new(seed: u64, cfg: Config, link: Link) -> Sim {
        let mut rng = StdRng::seed_from_u64(seed);
        let isns = [rng.random(), rng.random()];
        Sim::with_isns(seed, cfg, link, isns)
    }

    /// As [`Sim::new`] with chosen ISNs (`isns[i]` is side `i`'s).
    pub fn with_isns(seed: u64, cfg: Config, link: Link, isns: [u64; 2]) -> Sim {
        Sim::with_configs(seed, [cfg.clone(), cfg], link, isns)
    }

    /// As [`Sim::with_isns`] with a config per side (`cfgs[i]` is side
    /// `i`'s).
    pub fn with_configs(seed: u64, cfgs: [Config; 2], link: Link, isns: [u64; 2]) -> Sim {
        let base = Instant::now();
        let side = |me: u32, peer: u32| {
            let cfg = &cfgs[me as usize];
            let ids = ConnIds {
                job: JOB,
                local_rank: me,
                peer_rank: peer,
            };
            // Fixed keys per direction, when the config asks for a MAC.
            let seal = match cfg.guard {
                Guard::Crc => Seal::crc(),
                Guard::Mac => Seal::mac(&[me as u8 + 1; 16], &[peer as u8 + 1; 16]),
            };
            let conn = Connection::with_seal(
                cfg.clone(),
                ids,
                isns[me as usize],
                isns[peer as usize],
                base,
                seal,
            )
            .expect("valid test config");
            Side {
                conn,
                link: link.clone(),
                filter: None,
                outbox: VecDeque::new(),
                sent: Vec::new(),
                received: Vec::new(),
                acked: Vec::new(),
                lost_at: None,
                last_delivery: None,
                would_block: 0,
                tx_log: Vec::new(),
                max_unacked: 0,
                max_recv_buffered: 0,
                free_at: [base; 2],
            }
        };
        Sim {
            base,
            now: base,
            sides: [side(0, 1), side(1, 0)],
            rng: StdRng::seed_from_u64(seed ^ 0x5eed),
            wire: BinaryHeap::new(),
            tiebreak: 0,
            buf: Vec::new(),
        }
    }

    /// Puts `data` on the wire to side `to`, arriving at `at` (a datagram
    /// that no connection sent: forged, or a replay).
    pub fn inject(&mut self, to: usize, at: Instant, data: Vec<u8>) {
        self.tiebreak += 1;
        self.wire.push(Reverse((at, self.tiebreak, to, data)));
    }

    /// The datagrams on the wire now: destination side and bytes.
    pub fn in_flight(&self) -> impl Iterator<Item = (usize, &[u8])> {
        self.wire.iter().map(|Reverse(d)| (d.2, d.3.as_slice()))
    }

    /// Queues a message from side `from` to the other side.
    pub fn queue(&mut self, from: usize, msg: Bytes) {
        self.sides[from].outbox.push_back(msg);
    }

    /// Queues messages of the given sizes, numbered from `first`.
    pub fn queue_sizes(&mut self, from: usize, first: u64, sizes: &[usize]) {
        for (i, &len) in sizes.iter().enumerate() {
            self.queue(from, message(first + i as u64, len));
        }
    }

    pub fn stats(&self, side: usize) -> Stats {
        self.sides[side].conn.stats()
    }

    pub fn elapsed(&self) -> Duration {
        self.now - self.base
    }

    /// Feeds the outbox to `send`, then sends every datagram `side` has.
    fn pump(&mut self, side: usize) {
        let now = self.now;
        let s = &mut self.sides[side];
        while let Some(msg) = s.outbox.pop_front() {
            match s.conn.send(now, msg.clone()) {
                Ok(id) => s.sent.push((id, msg)),
                Err(SendError::WouldBlock(back)) => {
                    assert_eq!(back, msg, "WouldBlock must hand the message back");
                    s.would_block += 1;
                    s.outbox.push_front(back);
                    break;
                }
                Err(e) => {
                    s.outbox.push_front(msg);
                    assert_eq!(e, SendError::PeerLost, "unexpected send error");
                    break;
                }
            }
        }
        let mut buf = std::mem::take(&mut self.buf);
        while let Some(t) = self.sides[side].conn.poll_transmit(now, &mut buf) {
            self.transmit(side, t.priority, &buf);
        }
        self.buf = buf;
    }

    fn transmit(&mut self, from: usize, priority: bool, bytes: &[u8]) {
        let guard = self.sides[from].conn.guard();
        let (hdr, _) = super::header::decode_unverified(bytes, guard)
            .expect("connections emit valid datagrams");
        let now = self.now;
        let s = &mut self.sides[from];
        s.tx_log.push((now, hdr));
        if s.link.down || s.filter.as_mut().is_some_and(|f| f(&hdr)) {
            return;
        }
        let link = s.link.clone();
        if self.rng.random_bool(link.loss)
            || (matches!(hdr.kind, Kind::Ack(_)) && self.rng.random_bool(link.ack_loss))
        {
            return;
        }
        let copies = if self.rng.random_bool(link.dup) { 2 } else { 1 };
        for _ in 0..copies {
            let mut data = bytes.to_vec();
            if self.rng.random_bool(link.corrupt) {
                let bit = self.rng.random_range(0..data.len() * 8);
                data[bit / 8] ^= 1 << (bit % 8);
            }
            let ser = (data.len() as u64 * 1_000_000_000)
                .checked_div(link.bandwidth)
                .map_or(Duration::ZERO, Duration::from_nanos);
            let ch = usize::from(priority);
            let s = &mut self.sides[from];
            let depart = s.free_at[ch].max(now) + ser;
            s.free_at[ch] = depart;
            let mut arrive = depart + link.latency;
            if self.rng.random_bool(link.reorder) {
                let extra = self
                    .rng
                    .random_range(0..=link.reorder_delay.as_nanos() as u64);
                arrive += Duration::from_nanos(extra);
            }
            self.tiebreak += 1;
            self.wire
                .push(Reverse((arrive, self.tiebreak, 1 - from, data)));
        }
    }

    fn collect(&mut self, side: usize) {
        let now = self.now;
        let s = &mut self.sides[side];
        while let Some(ev) = s.conn.poll_event() {
            match ev {
                Event::Message(m) => {
                    s.received.push(m);
                    s.last_delivery = Some(now);
                }
                Event::Acked(id) => s.acked.push(id),
                Event::PeerLost => {
                    assert!(s.lost_at.is_none(), "PeerLost reported twice");
                    s.lost_at = Some(now);
                }
            }
        }
        let st = s.conn.stats();
        s.max_unacked = s.max_unacked.max(st.send_unacked);
        s.max_recv_buffered = s.max_recv_buffered.max(st.recv_buffered);
    }

    /// Advances to the next arrival or timer and processes everything due
    /// then. Returns false when nothing is left to happen.
    pub fn step(&mut self) -> bool {
        for side in 0..2 {
            self.pump(side);
        }
        let arrival = self.wire.peek().map(|Reverse(d)| d.0);
        let next = [
            arrival,
            self.sides[0].conn.poll_timeout(),
            self.sides[1].conn.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(next) = next else { return false };
        self.now = self.now.max(next);
        while self.wire.peek().is_some_and(|Reverse(d)| d.0 <= self.now) {
            let Some(Reverse((_, _, to, data))) = self.wire.pop() else {
                break;
            };
            self.sides[to].conn.handle_datagram(self.now, &data);
        }
        for side in 0..2 {
            if self.sides[side]
                .conn
                .poll_timeout()
                .is_some_and(|t| t <= self.now)
            {
                self.sides[side].conn.handle_timeout(self.now);
            }
            self.collect(side);
        }
        for side in 0..2 {
            self.pump(side);
            self.collect(side);
        }
        true
    }

    /// Steps until `done` holds (true) or `limit` of virtual time passes or
    /// nothing is left to happen (then returns `done`).
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Sim) -> bool) -> bool {
        loop {
            if done(self) {
                return true;
            }
            if self.elapsed() > limit || !self.step() {
                return done(self);
            }
        }
    }

    /// Whether every queued message was delivered and acknowledged and both
    /// connections are idle.
    pub fn complete(&self) -> bool {
        (0..2).all(|i| {
            let (me, peer) = (&self.sides[i], &self.sides[1 - i]);
            me.outbox.is_empty()
                && peer.received.len() == me.sent.len()
                && me.acked.len() == me.sent.len()
                && me.conn.is_idle()
        })
    }

    /// Runs until [`Sim::complete`]; panics with both sides' stats if it
    /// does not get there within `limit` of virtual time.
    pub fn run_to_completion(&mut self, limit: Duration) {
        if !self.run_until(limit, Sim::complete) {
            panic!(
                "simulation incomplete after {:?} (lost: {:?}, {:?})\nside 0: {}\nside 1: {}",
                self.elapsed(),
                self.sides[0].lost_at.map(|t| t - self.base),
                self.sides[1].lost_at.map(|t| t - self.base),
                self.stats(0),
                self.stats(1)
            );
        }
    }

    /// Whether each side received exactly what the other sent so far, in
    /// order (a prefix of it while messages are still on their way).
    pub fn intact(&self) -> bool {
        (0..2).all(|i| {
            let (me, peer) = (&self.sides[i], &self.sides[1 - i]);
            peer.received.len() <= me.sent.len()
                && me.sent.iter().zip(&peer.received).all(|((_, s), r)| s == r)
        })
    }

    /// Asserts that each side received exactly what the other sent: every
    /// message once, intact, in order; and that every message was acked
    /// once, in order.
    pub fn assert_delivered(&self) {
        for i in 0..2 {
            let (me, peer) = (&self.sides[i], &self.sides[1 - i]);
            assert_eq!(
                peer.received.len(),
                me.sent.len(),
                "side {} received {} of {} messages",
                1 - i,
                peer.received.len(),
                me.sent.len()
            );
            for (k, ((_, sent), got)) in me.sent.iter().zip(&peer.received).enumerate() {
                assert!(sent == got, "message {k} from side {i} differs");
            }
            let ids: Vec<MsgId> = me.sent.iter().map(|(id, _)| *id).collect();
            assert_eq!(me.acked, ids, "side {i}: acks not once each, in order");
            let st = peer.conn.stats();
            assert_eq!(st.messages_delivered, me.sent.len() as u64);
        }
    }
}

/// Goodput in bytes per second of virtual time: `count` messages of `len`
/// bytes from side 0 to side 1 over `link` (both ways), checked for intact
/// in-order delivery.
pub(crate) fn goodput(seed: u64, cfg: Config, link: Link, count: usize, len: usize) -> f64 {
    let mut sim = Sim::new(seed, cfg, link);
    sim.queue_sizes(0, 0, &vec![len; count]);
    sim.run_to_completion(Duration::from_secs(600));
    sim.assert_delivered();
    let end = sim.sides[1].last_delivery.expect("something was delivered");
    let secs = (end - sim.base).as_secs_f64();
    (count * len) as f64 / secs
}

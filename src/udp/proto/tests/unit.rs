//! Single-connection tests: backpressure, the ACK policy, bad input, and
//! proptests feeding arbitrary or reordered datagrams.

use std::time::{Duration, Instant};

use bytes::Bytes;
use proptest::prelude::*;

use super::super::header::{Chunk, Flags, Header, Kind, Sack, SackBlock};
use super::super::sim::{message, JOB};
use super::super::{decode, Config, ConnIds, Connection, Event, MsgId, SendError};
use super::scenarios::lossy;

#[test]
fn would_block_hands_the_message_back() {
    let cfg = Config {
        send_budget: 16 * 1024,
        max_message: 1 << 20,
        ..Config::default()
    };
    let now = Instant::now();
    let mut c = Connection::new(cfg, ids(0, 1), 0, 0, now).unwrap();
    // Larger than the whole budget, but the queue is empty: accepted.
    assert!(c.can_send(100_000));
    assert_eq!(c.send(now, message(0, 100_000)), Ok(MsgId(0)));
    let m = message(1, 10);
    assert!(!c.can_send(10));
    match c.send(now, m.clone()) {
        Err(SendError::WouldBlock(back)) => assert_eq!(back, m),
        other => panic!("expected WouldBlock, got {other:?}"),
    }
    assert_eq!(
        c.send(now, message(2, 2 << 20)),
        Err(SendError::TooLarge {
            len: 2 << 20,
            max: 1 << 20
        })
    );
    assert_eq!(c.stats().messages_sent, 1);
    assert_eq!(c.unacked_messages(), vec![MsgId(0)]);
    assert!(!c.is_idle());
}

fn ids(local: u32, peer: u32) -> ConnIds {
    ConnIds {
        job: JOB,
        local_rank: local,
        peer_rank: peer,
    }
}

/// A DATA datagram from rank 1 to rank 0 carrying a one-segment message.
fn data(seq: u64, msg_id: u64, flags: Flags) -> Vec<u8> {
    let payload = message(msg_id, 10);
    let h = Header {
        job: JOB,
        src: 1,
        dst: 0,
        flags,
        seq,
        ack: 0,
        kind: Kind::Data(Chunk {
            msg_id,
            offset: 0,
            total_len: 10,
        }),
    };
    let mut buf = Vec::new();
    h.encode(&payload, &mut buf);
    buf
}

#[test]
fn ack_policy_delayed_every_n_and_immediate_on_gap() {
    let cfg = Config::default();
    let t0 = Instant::now();
    let mut c = Connection::new(cfg.clone(), ids(0, 1), 0, 0, t0).unwrap();
    let mut buf = Vec::new();
    // In order, no ACK_NOW: the ACK waits for ack_delay.
    c.handle_datagram(t0, &data(0, 0, Flags::NONE));
    assert_eq!(c.poll_transmit(t0, &mut buf), None);
    assert_eq!(c.poll_timeout(), Some(t0 + cfg.ack_delay));
    let t1 = t0 + cfg.ack_delay;
    let tx = c.poll_transmit(t1, &mut buf).expect("delayed ACK");
    assert!(tx.priority);
    let (h, _) = decode(&buf).unwrap();
    assert_eq!((h.kind, h.ack), (Kind::Ack(Sack::EMPTY), 1));
    // ack_every in-order segments: ACK at once.
    for i in 1..=u64::from(cfg.ack_every) {
        c.handle_datagram(t1, &data(i, i, Flags::NONE));
    }
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    let next = u64::from(cfg.ack_every) + 1;
    // Out of order (a hole at `next`): an immediate ACK-only with GAP.
    c.handle_datagram(t1, &data(next + 1, next + 1, Flags::NONE));
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    let (h, _) = decode(&buf).unwrap();
    let mut sack = Sack::EMPTY;
    sack.push(SackBlock {
        start: next + 1,
        len: 1,
    });
    assert_eq!(h.kind, Kind::Ack(sack), "the SACK block names what is held");
    assert_eq!(h.ack, next);
    assert!(h.flags.contains(Flags::GAP));
    // Filling the hole delivers both, in order, and ACKs at once.
    c.handle_datagram(t1, &data(next, next, Flags::NONE));
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    let (h, _) = decode(&buf).unwrap();
    assert_eq!(h.ack, next + 2);
    assert!(!h.flags.contains(Flags::GAP));
    let msgs: Vec<Event> = std::iter::from_fn(|| c.poll_event()).collect();
    let want: Vec<Event> = (0..next + 2)
        .map(|i| Event::Message(message(i, 10)))
        .collect();
    assert_eq!(msgs, want);
    // A duplicate is dropped and re-ACKed.
    c.handle_datagram(t1, &data(3, 3, Flags::NONE));
    assert_eq!(c.stats().duplicates_dropped, 1);
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    assert!(c.is_idle());
}

#[test]
fn a_requested_ack_rides_on_a_prompt_reply() {
    let cfg = Config::default();
    let t0 = Instant::now();
    let mut c = Connection::new(cfg.clone(), ids(0, 1), 0, 0, t0).unwrap();
    let mut buf = Vec::new();
    // ACK_NOW (the peer's tail): no ACK-only at once, one within
    // reply_ack_delay.
    c.handle_datagram(t0, &data(0, 0, Flags::ACK_NOW));
    assert_eq!(c.poll_transmit(t0, &mut buf), None);
    assert_eq!(c.poll_timeout(), Some(t0 + cfg.reply_ack_delay));
    // A reply sent before then carries the ACK: exactly one datagram.
    c.send(t0, message(0, 8)).unwrap();
    assert!(c.poll_transmit(t0, &mut buf).is_some());
    let (h, _) = decode(&buf).unwrap();
    assert!(matches!(h.kind, Kind::Data(_)));
    assert_eq!(h.ack, 1);
    assert_eq!(c.poll_transmit(t0, &mut buf), None);
    assert_eq!(c.stats().acks_sent, 0);
    // No reply: the ACK-only goes out when reply_ack_delay has passed.
    c.handle_datagram(t0, &data(1, 1, Flags::ACK_NOW));
    let t1 = t0 + cfg.reply_ack_delay;
    assert_eq!(
        c.poll_transmit(t1 - Duration::from_nanos(1), &mut buf),
        None
    );
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    let (h, _) = decode(&buf).unwrap();
    assert_eq!((h.kind, h.ack), (Kind::Ack(Sack::EMPTY), 2));
    // A retransmission asking for an ACK gets it at once.
    c.handle_datagram(t1, &data(2, 2, Flags::ACK_NOW.with(Flags::RETRANSMIT)));
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    let (h, _) = decode(&buf).unwrap();
    assert_eq!((h.kind, h.ack), (Kind::Ack(Sack::EMPTY), 3));
}

#[test]
fn a_requested_ack_never_waits_longer_than_ack_delay() {
    let cfg = Config {
        ack_delay: Duration::from_micros(10),
        ..Config::default()
    };
    assert!(cfg.reply_ack_delay > cfg.ack_delay);
    let t0 = Instant::now();
    let mut c = Connection::new(cfg.clone(), ids(0, 1), 0, 0, t0).unwrap();
    c.handle_datagram(t0, &data(0, 0, Flags::ACK_NOW));
    assert_eq!(c.poll_timeout(), Some(t0 + cfg.ack_delay));
}

#[test]
fn the_ack_of_a_held_back_datagram_applies_alone() {
    let t0 = Instant::now();
    let mut a = Connection::new(Config::default(), ids(0, 1), 0, 0, t0).unwrap();
    let mut b = Connection::new(Config::default(), ids(1, 0), 0, 0, t0).unwrap();
    let mut buf = Vec::new();
    a.send(t0, message(0, 100)).unwrap();
    a.poll_transmit(t0, &mut buf).unwrap();
    b.handle_datagram(t0, &buf);
    // b's reply carries the ACK of a's message.
    b.send(t0, message(1, 100)).unwrap();
    b.poll_transmit(t0, &mut buf).unwrap();
    let (h, _) = decode(&buf).unwrap();
    assert!(matches!(h.kind, Kind::Data(_)));
    // a holds the reply back but takes its ACK: its message completes.
    a.handle_ack(t0, &h);
    assert_eq!(a.poll_event(), Some(Event::Acked(MsgId(0))));
    assert_eq!(a.poll_event(), None);
    assert_eq!(a.stats().send_unacked, 0);
    assert_eq!(a.stats().messages_delivered, 0);
    // A header for another connection changes nothing.
    let mut other = h;
    other.src = 7;
    a.handle_ack(t0, &other);
    assert_eq!(a.poll_event(), None);
    // Fed whole later: the data is delivered once, the ACK is no news.
    a.handle_datagram(t0, &buf);
    assert_eq!(a.poll_event(), Some(Event::Message(message(1, 100))));
    assert_eq!(a.poll_event(), None);
    let s = a.stats();
    assert_eq!((s.messages_acked, s.old_acks, s.invalid_acks), (1, 0, 0));
}

/// Counts what the connection asks of its buffer source.
#[derive(Default)]
struct CountingBuffers {
    taken: std::sync::Mutex<Vec<usize>>,
    frozen: std::sync::atomic::AtomicUsize,
    /// Capacities of the buffers handed back after a message outgrew them.
    recycled: std::sync::Mutex<Vec<usize>>,
}

impl super::super::Buffers for CountingBuffers {
    fn take(&self, len: usize) -> Vec<u8> {
        self.taken.lock().unwrap().push(len);
        Vec::with_capacity(len)
    }
    fn freeze(&self, buf: Vec<u8>) -> Bytes {
        self.frozen
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Bytes::from(buf)
    }
    fn recycle(&self, buf: Vec<u8>) {
        self.recycled.lock().unwrap().push(buf.capacity());
    }
}

#[test]
fn received_messages_use_the_buffer_source_within_a_window() {
    let cfg = Config {
        max_datagram: 572,
        send_window: 8,
        recv_window: 8,
        ..Config::default()
    };
    let t0 = Instant::now();
    let mut a = Connection::new(cfg.clone(), ids(0, 1), 0, 0, t0).unwrap();
    let mut b = Connection::new(cfg.clone(), ids(1, 0), 0, 0, t0).unwrap();
    let bufs = std::sync::Arc::new(CountingBuffers::default());
    b.set_buffers(bufs.clone());
    let window_bytes = 8 * cfg.chunk_payload();
    // Fits a receive window: one buffer of the whole length, frozen once.
    // Larger: grows as data comes (the source is asked for 64 KiB at most
    // up front, then for twice as much each time it is full, and takes the
    // outgrown buffers back).
    let sizes = [window_bytes, window_bytes + 1, 100, 200_000];
    for (i, len) in sizes.iter().enumerate() {
        a.send(t0, message(i as u64, *len)).unwrap();
    }
    let mut buf = Vec::new();
    let mut got = Vec::new();
    for _ in 0..1000 {
        while a.poll_transmit(t0, &mut buf).is_some() {
            b.handle_datagram(t0, &buf);
        }
        while b.poll_transmit(t0, &mut buf).is_some() {
            a.handle_datagram(t0, &buf);
        }
        while let Some(e) = b.poll_event() {
            got.push(e);
        }
        if got.len() == sizes.len() {
            break;
        }
    }
    let want: Vec<Event> = sizes
        .iter()
        .enumerate()
        .map(|(i, len)| Event::Message(message(i as u64, *len)))
        .collect();
    assert_eq!(got, want);
    // The one-datagram message is copied into a buffer of its own length
    // from the source too.
    assert_eq!(
        *bufs.taken.lock().unwrap(),
        vec![
            window_bytes,
            window_bytes + 1,
            100,
            65_536,
            131_072,
            200_000
        ]
    );
    assert_eq!(*bufs.recycled.lock().unwrap(), vec![65_536, 131_072]);
    // All four are handed over through the source.
    assert_eq!(bufs.frozen.load(std::sync::atomic::Ordering::Relaxed), 4);
}

#[test]
fn foreign_and_broken_datagrams_are_counted() {
    let t0 = Instant::now();
    let mut c = Connection::new(Config::default(), ids(0, 1), 0, 0, t0).unwrap();
    let mut other_job = data(0, 0, Flags::NONE);
    let mut h = decode(&other_job).unwrap().0;
    h.job ^= 1;
    other_job.clear();
    h.encode(&message(0, 10), &mut other_job);
    c.handle_datagram(t0, &other_job);
    let mut corrupt = data(0, 0, Flags::NONE);
    corrupt[50] ^= 4;
    c.handle_datagram(t0, &corrupt);
    c.handle_datagram(t0, b"hello");
    // Right framing, wrong message id: a protocol error, not delivered.
    c.handle_datagram(t0, &data(0, 7, Flags::NONE));
    let s = c.stats();
    assert_eq!(
        (
            s.misdirected,
            s.checksum_errors,
            s.decode_errors,
            s.protocol_errors
        ),
        (1, 1, 1, 1)
    );
    assert_eq!(c.poll_event(), None);
    assert_eq!(s.recv_base, 0);
}

#[test]
fn stats_display_is_one_line() {
    let sim = lossy(15, 0.05);
    let line = sim.stats(0).to_string();
    assert!(!line.contains('\n'));
    assert!(line.starts_with("TX "));
}

/// Arbitrary datagrams: valid-CRC ones with random fields near the window,
/// and raw bytes.
fn arb_datagram() -> impl Strategy<Value = Vec<u8>> {
    let structured = (
        0u64..40,
        0u64..6,
        0u64..3000,
        0u64..3000,
        0usize..1500,
        0u16..16,
        any::<bool>(),
        0u64..40,
    )
        .prop_map(|(seq, msg_id, offset, extra, len, flags, ack_only, ack)| {
            let total_len = offset + len as u64 + extra;
            let h = Header {
                job: JOB,
                src: 1,
                dst: 0,
                flags: Flags::from_bits(flags).unwrap_or_default(),
                seq,
                ack,
                kind: if ack_only {
                    // A SACK block anywhere near the window, of any size.
                    let mut sack = Sack::EMPTY;
                    sack.push(SackBlock {
                        start: ack.wrapping_add(offset % 600).wrapping_sub(300),
                        len: len as u32 % 1000 + 1,
                    });
                    Kind::Ack(sack)
                } else {
                    Kind::Data(Chunk {
                        msg_id,
                        offset,
                        total_len,
                    })
                },
            };
            let payload = if ack_only { Vec::new() } else { vec![7u8; len] };
            let mut buf = Vec::new();
            h.encode(&payload, &mut buf);
            buf
        });
    prop_oneof![
        4 => structured,
        1 => proptest::collection::vec(any::<u8>(), 0..120),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn arbitrary_datagram_sequences_keep_invariants(
        dgrams in proptest::collection::vec((arb_datagram(), 0u64..50), 1..60),
    ) {
        let cfg = Config { recv_window: 16, send_window: 8, max_message: 10_000, ..Config::default() };
        let t0 = Instant::now();
        let mut c = Connection::new(cfg, ids(0, 1), 0, 0, t0).unwrap();
        let _ = c.send(t0, Bytes::from(vec![1u8; 20_000]).slice(..9_000));
        let mut now = t0;
        let mut buf = Vec::new();
        for (d, dt) in dgrams {
            now += Duration::from_millis(dt);
            c.handle_datagram(now, &d);
            c.handle_timeout(now);
            while c.poll_transmit(now, &mut buf).is_some() {
                prop_assert!(decode(&buf).is_ok());
            }
            while let Some(ev) = c.poll_event() {
                if let Event::Message(m) = ev {
                    prop_assert!(m.len() as u64 <= 10_000);
                }
            }
            let s = c.stats();
            prop_assert!(s.recv_buffered <= 16);
            prop_assert!(s.send_unacked <= 8);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Whatever subset, order and repetition of a real sender's datagrams
    /// reaches the receiver, it delivers a prefix of the sent messages,
    /// each intact, in order, once; and once everything has arrived, all of
    /// them.
    #[test]
    fn any_delivery_schedule_yields_an_in_order_prefix(
        lens in proptest::collection::vec(0usize..4000, 0..8),
        schedule in proptest::collection::vec(any::<proptest::sample::Index>(), 0..200),
    ) {
        let cfg = Config { max_datagram: 300, send_window: 16, recv_window: 16, ..Config::default() };
        let t0 = Instant::now();
        let mut tx = Connection::new(cfg.clone(), ids(1, 0), u64::MAX - 5, 3, t0).unwrap();
        let mut rx = Connection::new(cfg, ids(0, 1), 3, u64::MAX - 5, t0).unwrap();
        let sent: Vec<Bytes> = lens.iter().enumerate().map(|(i, &n)| message(i as u64, n)).collect();
        for m in &sent {
            tx.send(t0, m.clone()).unwrap();
        }
        let mut pool = Vec::new();
        let mut buf = Vec::new();
        let mut got = Vec::new();
        let drain = |rx: &mut Connection, got: &mut Vec<Bytes>| {
            while let Some(ev) = rx.poll_event() {
                if let Event::Message(m) = ev { got.push(m) }
            }
        };
        while tx.poll_transmit(t0, &mut buf).is_some() {
            pool.push(buf.clone());
        }
        for pick in schedule {
            if pool.is_empty() { break }
            rx.handle_datagram(t0, &pool[pick.index(pool.len())]);
            drain(&mut rx, &mut got);
        }
        prop_assert!(got.len() <= sent.len());
        prop_assert!(got.iter().zip(&sent).all(|(g, s)| g == s));
        // Now deliver everything, ACK back, repeat until done.
        let mut now = t0;
        for _ in 0..1000 {
            for d in pool.drain(..) {
                rx.handle_datagram(now, &d);
            }
            drain(&mut rx, &mut got);
            now += Duration::from_millis(1);
            while rx.poll_transmit(now, &mut buf).is_some() {
                tx.handle_datagram(now, &buf);
            }
            while tx.poll_transmit(now, &mut buf).is_some() {
                pool.push(buf.clone());
            }
            if pool.is_empty() && tx.is_idle() { break }
        }
        prop_assert_eq!(got, sent);
    }
}

/// Feed `d` to `rx` the way the driver's in-place receive would, if `rx`
/// lends its reassembly buffer: the datagrams of `ds` that have exactly
/// the shape of the next places (header, a whole place of payload, the
/// trailer), in order, land in the buffer; the first that does not, and
/// all after it, come back joined. Returns how many of `ds` were used.
fn feed_in_place(rx: &mut Connection, now: Instant, ds: &[Vec<u8>]) -> usize {
    use super::super::{Landed, Trailer, CRC_LEN, DATA_HEADER_LEN as H};
    let Some(mut lent) = rx.lend_reassembly(16) else {
        rx.handle_datagram(now, &ds[0]);
        return 1;
    };
    let chunk = lent.chunk().max(1);
    let room = (lent.buf.capacity() - lent.buf.len()).min(lent.remaining());
    let k = room.div_ceil(chunk).min(16).min(ds.len());
    let place = |i: usize| chunk.min(room - i * chunk);
    let mut at = lent.buf.len();
    let mut landed = Vec::new();
    for (i, d) in ds[..k].iter().enumerate() {
        if landed.len() < i || d.len() != H + place(i) + CRC_LEN {
            break;
        }
        // What the kernel does: the payload goes to its place.
        lent.buf.extend_from_slice(&d[H..H + place(i)]);
        landed.push(Landed {
            head: &d[..H],
            at,
            len: place(i),
            trailer: Trailer::from_slice(&d[d.len() - CRC_LEN..]),
        });
        at += place(i);
    }
    rx.return_reassembly(now, lent, &landed);
    for d in &ds[landed.len()..k.max(1)] {
        rx.handle_datagram(now, d);
    }
    k.max(1)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Receiving into a lent reassembly buffer changes nothing the
    /// protocol does: whatever a real sender's datagrams go through
    /// (loss, reordering, duplication, a flipped byte anywhere), a
    /// receiver fed in place delivers the same messages and keeps the same
    /// counters as one fed whole datagrams.
    #[test]
    fn receiving_in_place_is_the_same_as_receiving_whole(
        lens in proptest::collection::vec(0usize..5000, 1..6),
        schedule in proptest::collection::vec(
            (any::<proptest::sample::Index>(), 0u8..8, any::<proptest::sample::Index>()),
            0..120,
        ),
    ) {
        let cfg = Config { max_datagram: 400, send_window: 128, recv_window: 128, ..Config::default() };
        let t0 = Instant::now();
        let mut tx = Connection::new(cfg.clone(), ids(1, 0), 7, 9, t0).unwrap();
        let mut whole = Connection::new(cfg.clone(), ids(0, 1), 9, 7, t0).unwrap();
        let mut in_place = Connection::new(cfg, ids(0, 1), 9, 7, t0).unwrap();
        for (i, &n) in lens.iter().enumerate() {
            tx.send(t0, message(i as u64, n)).unwrap();
        }
        let mut pool = Vec::new();
        let mut buf = Vec::new();
        while tx.poll_transmit(t0, &mut buf).is_some() {
            pool.push(buf.clone());
        }
        // An arbitrary schedule of runs of datagrams as sent (in-order runs
        // are what lands in place): 0-3 clean runs of 1, 4, 7 or 10; 4 a
        // skip; 5 one truncated; 6 and 7 runs of 4 with a byte flipped in
        // the first or the last.
        let mut arrivals: Vec<Vec<u8>> = Vec::new();
        for (pick, how, byte) in schedule {
            let first = pick.index(pool.len());
            let run = match how {
                0..=3 => 1 + usize::from(how) * 3,
                4 => 0,
                5 => 1,
                _ => 4,
            };
            let end = (first + run).min(pool.len());
            for (j, d) in pool[first..end].iter().enumerate() {
                let mut d = d.clone();
                let hit = (how == 6 && j == 0) || (how == 7 && j + 1 == end - first);
                if hit {
                    let i = byte.index(d.len());
                    d[i] ^= 0x40;
                }
                if how == 5 {
                    d.truncate(byte.index(d.len()));
                }
                arrivals.push(d);
            }
        }
        arrivals.extend(pool.iter().cloned());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for d in &arrivals {
            whole.handle_datagram(t0, d);
        }
        let mut i = 0;
        while i < arrivals.len() {
            i += feed_in_place(&mut in_place, t0, &arrivals[i..]);
        }
        while let Some(e) = whole.poll_event() { a.push(e) }
        while let Some(e) = in_place.poll_event() { b.push(e) }
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(whole.stats(), in_place.stats());
        // Everything arrived in order once: every message, intact.
        let want: Vec<Event> = lens.iter().enumerate().map(|(i, &n)| Event::Message(message(i as u64, n))).collect();
        prop_assert_eq!(a, want);
    }
}

#[test]
fn chunks_landed_in_place_are_checked_like_whole_datagrams() {
    use super::super::{Landed, Trailer, CRC_LEN, DATA_HEADER_LEN as H};
    let cfg = Config {
        max_datagram: 400,
        ..Config::default()
    };
    let t0 = Instant::now();
    let mut tx = Connection::new(cfg.clone(), ids(1, 0), 0, 0, t0).unwrap();
    let mut rx = Connection::new(cfg, ids(0, 1), 0, 0, t0).unwrap();
    let msg = message(0, 1500);
    tx.send(t0, msg.clone()).unwrap();
    let mut buf = Vec::new();
    let mut ds = Vec::new();
    while tx.poll_transmit(t0, &mut buf).is_some() {
        ds.push(buf.clone());
    }
    assert!(ds.len() >= 4);
    // Nothing to lend before a large message has begun.
    assert!(rx.lend_reassembly(16).is_none());
    rx.handle_datagram(t0, &ds[0]);
    let land = |lent: &mut super::super::Lent, d: &[u8], flip: bool| {
        let at = lent.buf.len();
        let len = d.len() - H - CRC_LEN;
        lent.buf.extend_from_slice(&d[H..H + len]);
        if flip {
            lent.buf[at] ^= 1;
        }
        (at, len, Trailer::from_slice(&d[d.len() - CRC_LEN..]))
    };
    // A corrupted payload in place: counted as a checksum error, cut off,
    // nothing delivered; a chunk that is not the next one (the one after)
    // is kept out of order as usual, not taken in place.
    let mut lent = rx.lend_reassembly(16).unwrap();
    // While lent, nothing may be fed: refused and counted.
    rx.handle_datagram(t0, &ds[1]);
    assert_eq!(rx.stats().protocol_errors, 1);
    let (at, len, crc) = land(&mut lent, &ds[1], true);
    let bad = Landed {
        head: &ds[1][..H],
        at,
        len,
        trailer: crc,
    };
    rx.return_reassembly(t0, lent, &[bad]);
    let s = rx.stats();
    assert_eq!((s.checksum_errors, s.messages_delivered), (1, 0));
    let mut lent = rx.lend_reassembly(16).unwrap();
    let (at, len, crc) = land(&mut lent, &ds[2], false);
    let skipped = Landed {
        head: &ds[2][..H],
        at,
        len,
        trailer: crc,
    };
    rx.return_reassembly(t0, lent, &[skipped]);
    assert_eq!(rx.stats().out_of_order, 1);
    // The real next chunk in place, then the rest whole: the message is
    // intact.
    let mut lent = rx.lend_reassembly(16).unwrap();
    let (at, len, crc) = land(&mut lent, &ds[1], false);
    let good = Landed {
        head: &ds[1][..H],
        at,
        len,
        trailer: crc,
    };
    rx.return_reassembly(t0, lent, &[good]);
    for d in &ds[3..] {
        rx.handle_datagram(t0, d);
    }
    assert_eq!(rx.poll_event(), Some(Event::Message(msg)));
    assert_eq!(rx.stats().messages_delivered, 1);
}

#[test]
fn the_transmit_pass_is_wanted_only_when_something_is_due() {
    let cfg = Config::default();
    let t0 = Instant::now();
    let mut c = Connection::new(cfg.clone(), ids(0, 1), 0, 0, t0).unwrap();
    assert!(!c.wants_transmit(t0));
    // The peer's tail: its ACK may ride on a reply for a while.
    c.handle_datagram(t0, &data(0, 0, Flags::ACK_NOW));
    assert!(!c.wants_transmit(t0));
    assert!(c.wants_transmit(t0 + cfg.reply_ack_delay));
    // A retransmission wants its ACK now.
    c.handle_datagram(t0, &data(1, 1, Flags::ACK_NOW.with(Flags::RETRANSMIT)));
    assert!(c.wants_transmit(t0));
    let mut buf = Vec::new();
    while c.poll_transmit(t0, &mut buf).is_some() {}
    assert!(!c.wants_transmit(t0));
    // Data with an open window wants out.
    c.send(t0, message(0, 8)).unwrap();
    assert!(c.wants_transmit(t0));
    while c.poll_transmit(t0, &mut buf).is_some() {}
    assert!(!c.wants_transmit(t0));
}

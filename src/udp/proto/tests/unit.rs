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
}

#[test]
fn multi_datagram_messages_use_the_buffer_source_within_a_window() {
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
    // Larger: grows as data comes (the source is not asked to reserve it).
    let sizes = [window_bytes, window_bytes + 1, 100];
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
    assert_eq!(*bufs.taken.lock().unwrap(), vec![window_bytes]);
    // Both multi-datagram messages are handed over through the source.
    assert_eq!(bufs.frozen.load(std::sync::atomic::Ordering::Relaxed), 2);
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

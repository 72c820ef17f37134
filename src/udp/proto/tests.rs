//! Protocol scenarios on the deterministic simulation, and unit tests of the
//! ACK policy and backpressure on a single connection.

use std::time::{Duration, Instant};

use bytes::Bytes;
use proptest::prelude::*;

use super::header::{Chunk, Flags, Header, Kind};
use super::sim::{goodput, message, Link, Sim, JOB};
use super::{Config, ConnIds, Connection, Event, MsgId, SendError};

/// Sizes that hit the edges: empty, tiny (priority), around the priority
/// threshold, around one chunk (1400 bytes), multi-chunk.
const SIZES: [usize; 12] = [
    0, 1, 100, 256, 257, 1399, 1400, 1401, 5000, 70_000, 3, 200_000,
];

fn sizes(n: usize) -> Vec<usize> {
    SIZES.iter().copied().cycle().take(n).collect()
}

const LIMIT: Duration = Duration::from_secs(120);

fn lossy(seed: u64, loss: f64) -> Sim {
    let link = Link {
        loss,
        ..Link::default()
    };
    let mut sim = Sim::new(seed, Config::default(), link);
    sim.queue_sizes(0, 0, &sizes(60));
    sim.queue_sizes(1, 1000, &sizes(30));
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    println!("loss {loss}: {:?} virtual", sim.elapsed());
    println!("  side 0: {}\n  side 1: {}", sim.stats(0), sim.stats(1));
    sim
}

#[test]
fn lossless_delivers_everything_once_in_order() {
    let sim = lossy(1, 0.0);
    for side in 0..2 {
        let s = sim.stats(side);
        assert_eq!(s.resends, 0, "{s}");
        assert_eq!(
            s.duplicates_dropped + s.checksum_errors + s.decode_errors,
            0
        );
        assert!(s.priority_sent > 0 && s.acks_sent > 0);
        assert!(s.srtt > Duration::ZERO && s.rto >= Config::default().rto_min);
        assert_eq!(s.send_unacked, 0);
        assert_eq!(s.recv_buffered, 0);
    }
}

#[test]
fn loss_1_percent() {
    let sim = lossy(2, 0.01);
    assert!(sim.stats(0).resends > 0, "{}", sim.stats(0));
}

#[test]
fn loss_10_percent() {
    let sim = lossy(3, 0.10);
    let s = sim.stats(0);
    assert!(s.resends > 0 && s.fast_retransmits > 0, "{s}");
    assert!(sim.stats(1).out_of_order > 0);
}

#[test]
fn loss_30_percent() {
    let sim = lossy(4, 0.30);
    let s = sim.stats(0);
    assert!(s.resends > 0 && s.timeout_retransmits > 0, "{s}");
}

#[test]
fn many_seeds_moderate_loss_reorder_dup() {
    for seed in 10..16 {
        let link = Link {
            loss: 0.05,
            dup: 0.05,
            reorder: 0.2,
            ..Link::default()
        };
        let mut sim = Sim::new(seed, Config::default(), link);
        sim.queue_sizes(0, 0, &sizes(24));
        sim.queue_sizes(1, 500, &sizes(24));
        sim.run_to_completion(LIMIT);
        sim.assert_delivered();
    }
}

#[test]
fn tail_loss_recovers_by_timeout() {
    let mut sim = Sim::new(5, Config::default(), Link::default());
    let isn = sim.stats(0).send_base;
    // 20 one-segment messages: drop the first transmission of the last 3.
    sim.sides[0].filter = Some(Box::new(move |h: &Header| {
        let last3 = h.seq.wrapping_sub(isn) >= 17;
        matches!(h.kind, Kind::Data(_)) && last3 && !h.flags.contains(Flags::RETRANSMIT)
    }));
    sim.queue_sizes(0, 0, &[1000; 20]);
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    let s = sim.stats(0);
    assert!(s.timeout_retransmits >= 1, "{s}");
    assert!(s.resends >= 3, "{s}");
    assert_eq!(s.dup_acks, 0, "nothing follows a tail loss: {s}");
}

#[test]
fn ack_loss_only() {
    let link = Link {
        ack_loss: 0.5,
        ..Link::default()
    };
    let mut sim = Sim::new(6, Config::default(), link);
    sim.queue_sizes(0, 0, &[3000; 200]);
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    let (tx, rx) = (sim.stats(0), sim.stats(1));
    assert!(
        tx.acks_received < rx.acks_sent,
        "sender {tx}\nreceiver {rx}"
    );
    assert_eq!(rx.data_received, tx.data_sent);
}

#[test]
fn full_window_blocks_then_resumes() {
    let cfg = Config {
        send_window: 8,
        send_budget: 16 * 1024,
        ..Config::default()
    };
    let mut sim = Sim::new(7, cfg, Link::default());
    sim.queue_sizes(0, 0, &[4000; 100]);
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    let s = &sim.sides[0];
    assert!(s.would_block > 0, "the budget never pushed back");
    assert_eq!(s.max_unacked, 8, "the window must fill and never overflow");
    assert_eq!(sim.stats(0).would_block, s.would_block);
}

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

#[test]
fn large_messages_survive_chunk_reordering() {
    let link = Link {
        reorder: 0.3,
        reorder_delay: Duration::from_millis(1),
        ..Link::default()
    };
    let mut sim = Sim::new(8, Config::default(), link);
    sim.queue_sizes(0, 0, &[300_000, 1, 250_000, 0, 1_000_000, 17]);
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    let rx = sim.stats(1);
    assert!(rx.out_of_order > 0, "{rx}");
    let max = sim.sides[1].max_recv_buffered;
    assert!(max > 0 && max <= u64::from(Config::default().recv_window));
}

#[test]
fn retransmit_backoff_grows_and_is_capped() {
    let cfg = Config {
        rto_initial: Duration::from_millis(20),
        rto_max: Duration::from_millis(200),
        peer_timeout: Duration::from_secs(3),
        ..Config::default()
    };
    let link = Link {
        down: true,
        ..Link::default()
    };
    let mut sim = Sim::new(9, cfg.clone(), link);
    sim.queue(0, message(0, 10));
    assert!(sim.run_until(LIMIT, |s| s.sides[0].lost_at.is_some()));
    let times: Vec<Instant> = sim.sides[0]
        .tx_log
        .iter()
        .filter(|(_, h)| matches!(h.kind, Kind::Data(_)))
        .map(|(t, _)| *t)
        .collect();
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.len() >= 6, "too few retries: {gaps:?}");
    assert_eq!(gaps[0], cfg.rto_initial);
    for w in gaps.windows(2) {
        assert_eq!(w[1], (w[0] * 2).min(cfg.rto_max), "gaps {gaps:?}");
    }
    assert_eq!(*gaps.last().unwrap(), cfg.rto_max);
    let s = sim.stats(0);
    assert_eq!(s.timeout_retransmits, gaps.len() as u64);
    assert_eq!(s.rto, cfg.rto_max);
    // Lost exactly peer_timeout after the first send, which had no ACK.
    assert_eq!(sim.sides[0].lost_at.unwrap() - times[0], cfg.peer_timeout);
}

#[test]
fn sequence_numbers_wrap() {
    let link = Link {
        loss: 0.1,
        ..Link::default()
    };
    let isns = [u64::MAX - 20, u64::MAX - 3];
    let mut sim = Sim::with_isns(10, Config::default(), link, isns);
    sim.queue_sizes(0, 0, &sizes(30));
    sim.queue_sizes(1, 100, &sizes(30));
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    for side in 0..2 {
        let s = sim.stats(side);
        assert!(s.send_base < 10_000 && s.recv_base < 10_000, "no wrap: {s}");
        assert!(s.resends > 0);
    }
}

#[test]
fn corruption_is_caught_and_data_intact() {
    let link = Link {
        corrupt: 0.05,
        dup: 0.05,
        ..Link::default()
    };
    let mut sim = Sim::new(11, Config::default(), link);
    sim.queue_sizes(0, 0, &sizes(40));
    sim.queue_sizes(1, 100, &sizes(40));
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    let (a, b) = (sim.stats(0), sim.stats(1));
    assert!(a.checksum_errors + b.checksum_errors > 0, "{a}\n{b}");
    assert!(a.duplicates_dropped + b.duplicates_dropped > 0, "{a}\n{b}");
    assert!(a.resends + b.resends > 0);
}

#[test]
fn duplication_is_dropped() {
    let link = Link {
        dup: 0.3,
        ..Link::default()
    };
    let mut sim = Sim::new(12, Config::default(), link);
    sim.queue_sizes(0, 0, &sizes(40));
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    let rx = sim.stats(1);
    assert!(rx.duplicates_dropped > 0, "{rx}");
}

#[test]
fn peer_lost_within_peer_timeout() {
    let cfg = Config::default();
    let mut sim = Sim::new(13, cfg.clone(), Link::default());
    sim.queue_sizes(0, 0, &[100, 5000, 0, 70_000, 3]);
    sim.run_to_completion(LIMIT);
    sim.assert_delivered();
    // The peer vanishes: the link drops everything both ways.
    sim.sides[0].link.down = true;
    sim.sides[1].link.down = true;
    let down_at = sim.now;
    sim.queue_sizes(0, 5, &[10, 200_000, 1]);
    assert!(sim.run_until(LIMIT, |s| s.sides[0].lost_at.is_some()));
    let lost_after = sim.sides[0].lost_at.unwrap() - down_at;
    assert!(lost_after <= cfg.peer_timeout, "lost after {lost_after:?}");
    assert!(
        lost_after >= cfg.peer_timeout - cfg.rto_max,
        "too early: {lost_after:?}"
    );
    let c = &mut sim.sides[0].conn;
    assert!(c.is_lost());
    assert_eq!(c.unacked_messages(), vec![MsgId(5), MsgId(6), MsgId(7)]);
    assert_eq!(c.send(sim.now, message(9, 1)), Err(SendError::PeerLost));
    assert!(!c.can_send(1));
    assert_eq!(c.poll_transmit(sim.now, &mut Vec::new()), None);
    assert_eq!(c.poll_timeout(), None);
    assert_eq!(sim.sides[1].received.len(), 5);
}

#[test]
fn goodput_under_1_percent_loss_is_at_least_half_of_lossless() {
    let link = Link {
        bandwidth: 100_000_000,
        latency: Duration::from_micros(50),
        ..Link::default()
    };
    let lossless = goodput(14, Config::default(), link.clone(), 200, 40_000);
    let lossy = goodput(
        14,
        Config::default(),
        Link { loss: 0.01, ..link },
        200,
        40_000,
    );
    let ratio = lossy / lossless;
    println!("goodput lossless {lossless:.3e} B/s, 1% loss {lossy:.3e} B/s, ratio {ratio:.2}");
    assert!(lossless > 0.5e8, "lossless goodput far below the link rate");
    assert!(ratio >= 0.5, "goodput ratio {ratio:.2} under 1% loss");
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
    let (h, _) = super::decode(&buf).unwrap();
    assert_eq!((h.kind, h.ack), (Kind::Ack, 1));
    // ack_every in-order segments: ACK at once.
    for i in 1..=u64::from(cfg.ack_every) {
        c.handle_datagram(t1, &data(i, i, Flags::NONE));
    }
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    let next = u64::from(cfg.ack_every) + 1;
    // Out of order (a hole at `next`): an immediate ACK-only with GAP.
    c.handle_datagram(t1, &data(next + 1, next + 1, Flags::NONE));
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    let (h, _) = super::decode(&buf).unwrap();
    assert_eq!(h.kind, Kind::Ack);
    assert_eq!(h.ack, next);
    assert!(h.flags.contains(Flags::GAP));
    // Filling the hole delivers both, in order, and ACKs at once.
    c.handle_datagram(t1, &data(next, next, Flags::NONE));
    assert!(c.poll_transmit(t1, &mut buf).is_some());
    let (h, _) = super::decode(&buf).unwrap();
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
fn foreign_and_broken_datagrams_are_counted() {
    let t0 = Instant::now();
    let mut c = Connection::new(Config::default(), ids(0, 1), 0, 0, t0).unwrap();
    let mut other_job = data(0, 0, Flags::NONE);
    let mut h = super::decode(&other_job).unwrap().0;
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
                    Kind::Ack
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
                prop_assert!(super::decode(&buf).is_ok());
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

/// The goodput check above is a real measurement: a crippled configuration
/// (no fast retransmit, a long minimum timeout) fails it.
#[test]
fn goodput_check_detects_a_crippled_protocol() {
    let link = Link {
        bandwidth: 100_000_000,
        ..Link::default()
    };
    let crippled = Config {
        dup_ack_threshold: u32::MAX,
        rto_min: Duration::from_millis(200),
        rto_initial: Duration::from_millis(200),
        ..Config::default()
    };
    let lossless = goodput(14, crippled.clone(), link.clone(), 200, 40_000);
    let lossy = goodput(14, crippled, Link { loss: 0.01, ..link }, 200, 40_000);
    let ratio = lossy / lossless;
    println!("crippled: goodput ratio {ratio:.2} under 1% loss");
    assert!(ratio < 0.5, "crippled protocol still reached {ratio:.2}");
}

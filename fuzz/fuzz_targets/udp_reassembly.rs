//! Feeds datagram sequences chosen by the fuzzer to a `Connection`.
//!
//! The first byte picks a mode:
//! - even: replay. A real sender connection emits datagrams for messages
//!   whose sizes come from the input; the input then picks which of those
//!   datagrams reach the receiver, in which order, how often, and when time
//!   advances. Whatever the schedule, the receiver must deliver a prefix of
//!   the sent messages, each intact, in order, exactly once.
//! - odd: adversarial. The input is a list of raw or well-formed (valid
//!   checksum, matching ids) datagrams with arbitrary fields. Nothing may
//!   panic, and the windows must stay within their configured bounds.
#![no_main]

use std::time::{Duration, Instant};

use async_btl::udp::proto::{
    Chunk, Config, ConnIds, Connection, Event, Flags, Header, Kind, Sack, SackBlock,
};
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;

#[path = "input.rs"]
mod input;
use input::Input;

const JOB: u64 = 0xf022;
const SEND_WINDOW: u32 = 16;
const RECV_WINDOW: u32 = 16;
const MAX_MESSAGE: u64 = 20_000;

fn config() -> Config {
    Config {
        max_datagram: 300,
        send_window: SEND_WINDOW,
        recv_window: RECV_WINDOW,
        max_message: MAX_MESSAGE,
        ..Config::default()
    }
}

fn conn(local: u32, peer: u32, now: Instant) -> Connection {
    let ids = ConnIds {
        job: JOB,
        local_rank: local,
        peer_rank: peer,
    };
    Connection::new(config(), ids, 7, u64::MAX - 3, now).expect("valid config")
}

fn content(i: usize, len: usize) -> Bytes {
    (0..len)
        .map(|j| (i * 31 + j) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn check_bounds(c: &Connection) {
    let s = c.stats();
    assert!(s.recv_buffered <= u64::from(RECV_WINDOW));
    assert!(s.send_unacked <= u64::from(SEND_WINDOW));
}

fn replay(mut input: Input<'_>) {
    let t0 = Instant::now();
    // Side 0 sends with ISN u64::MAX - 3 and expects 7 from side 1.
    let mut tx = Connection::new(
        config(),
        ConnIds {
            job: JOB,
            local_rank: 0,
            peer_rank: 1,
        },
        u64::MAX - 3,
        7,
        t0,
    )
    .expect("valid config");
    let mut rx = conn(1, 0, t0);
    let count = usize::from(input.u8() % 8);
    let sent: Vec<Bytes> = (0..count)
        .map(|i| content(i, usize::from(input.u16()) % 3000))
        .collect();
    for m in &sent {
        tx.send(t0, m.clone()).expect("fits the default budget");
    }
    let mut now = t0;
    let mut pool: Vec<Vec<u8>> = Vec::new();
    let mut buf = Vec::new();
    let mut got: Vec<Bytes> = Vec::new();
    while !input.is_empty() {
        while tx.poll_transmit(now, &mut buf).is_some() {
            pool.push(buf.clone());
        }
        let op = input.u8();
        match op % 4 {
            // Deliver (again) one datagram from the pool.
            0 | 1 if !pool.is_empty() => {
                let i = usize::from(input.u8()) % pool.len();
                rx.handle_datagram(now, &pool[i]);
            }
            // Let the receiver's ACKs reach the sender.
            2 => {
                while rx.poll_transmit(now, &mut buf).is_some() {
                    if op & 0x80 == 0 {
                        tx.handle_datagram(now, &buf);
                    }
                }
            }
            // Time passes.
            _ => {
                now += Duration::from_millis(u64::from(input.u8()));
                tx.handle_timeout(now);
                rx.handle_timeout(now);
            }
        }
        while let Some(ev) = rx.poll_event() {
            if let Event::Message(m) = ev {
                got.push(m);
            }
        }
        while tx.poll_event().is_some() {}
        check_bounds(&rx);
        check_bounds(&tx);
    }
    assert!(got.len() <= sent.len(), "more messages than were sent");
    for (i, (g, s)) in got.iter().zip(&sent).enumerate() {
        assert!(g == s, "message {i} delivered corrupted or out of order");
    }
}

fn adversarial(mut input: Input<'_>) {
    let t0 = Instant::now();
    let mut c = conn(0, 1, t0);
    let _ = c.send(t0, content(0, 5000));
    let mut now = t0;
    let mut buf = Vec::new();
    while !input.is_empty() {
        let op = input.u8();
        match op % 4 {
            0 => {
                let n = usize::from(input.u16() % 400);
                let raw = input.bytes(n).to_vec();
                c.handle_datagram(now, &raw);
            }
            1 | 2 => {
                let ack_only = op % 4 == 2;
                let len = usize::from(input.u16() % 300);
                let offset = u64::from(input.u16());
                let header = Header {
                    job: JOB,
                    src: 1,
                    dst: 0,
                    flags: Flags::from_bits(u16::from(input.u8() & 0xf)).unwrap_or_default(),
                    seq: (u64::MAX - 3).wrapping_add(u64::from(input.u8() % 40)),
                    ack: 7 + u64::from(input.u8() % 40),
                    kind: if ack_only {
                        // Up to two SACK blocks near the window.
                        let mut sack = Sack::default();
                        for _ in 0..input.u8() % 3 {
                            sack.push(SackBlock {
                                start: 7 + u64::from(input.u8() % 40),
                                len: u32::from(input.u8() % 8) + 1,
                            });
                        }
                        Kind::Ack(sack)
                    } else {
                        Kind::Data(Chunk {
                            msg_id: u64::from(input.u8() % 4),
                            offset,
                            total_len: offset + len as u64 + u64::from(input.u16()),
                        })
                    },
                };
                let payload = if ack_only {
                    Vec::new()
                } else {
                    vec![0xa5; len]
                };
                let mut d = Vec::new();
                header.encode(&payload, &mut d);
                c.handle_datagram(now, &d);
            }
            _ => {
                now += Duration::from_millis(u64::from(input.u8()));
                c.handle_timeout(now);
            }
        }
        while c.poll_transmit(now, &mut buf).is_some() {}
        while let Some(ev) = c.poll_event() {
            if let Event::Message(m) = ev {
                assert!(m.len() as u64 <= MAX_MESSAGE);
            }
        }
        check_bounds(&c);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    if input.u8() % 2 == 0 {
        replay(input);
    } else {
        adversarial(input);
    }
});

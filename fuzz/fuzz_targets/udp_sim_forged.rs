//! An honest exchange between two udp protocol connections over the
//! sans-IO simulator (a lossy, duplicating, reordering link), into which
//! the fuzzer mixes datagrams of its own: raw bytes, exact replays of
//! datagrams on the wire, and altered copies of them. Whatever they are,
//! each side must receive exactly what the other sent — every message,
//! whole, once, in order — and the exchange must complete.
//!
//! Under the CRC (`BTL_UDP_AUTH=crc`) a datagram that passes the checksum
//! and is addressed to the connection is accepted by design (only its
//! 64-bit random initial sequence numbers keep blind forgers out of the
//! window, as TCP's do). So there such a forgery, unless an exact replay,
//! is made blind before it is sent: its sequence, ACK and SACK numbers are
//! moved half the sequence space away from where the exchange runs, which
//! a forger who does not see the traffic cannot tell apart from where it
//! runs. Under the MAC (chosen by the input's first byte) the forger sees
//! everything and sends its datagrams as they are, with the real sequence
//! numbers: none may be taken.
#![no_main]

use std::time::Duration;

use async_btl::fuzz_support::UdpExchange;
use async_btl::udp::proto::{decode, Header, Kind, Sack, SackBlock};
use libfuzzer_sys::fuzz_target;

#[path = "input.rs"]
mod input;
use input::Input;

const BLIND: u64 = 1 << 63;

/// `d` as a blind forger could send it to side `to` (see above); under the
/// MAC, `d` itself.
fn blind(d: Vec<u8>, to: usize, mac: bool) -> Vec<u8> {
    if mac {
        return d;
    }
    let Ok((h, payload)) = decode(&d) else {
        return d;
    };
    if h.job != UdpExchange::JOB || h.dst as usize != to || h.src as usize != 1 - to {
        return d;
    }
    let kind = match h.kind {
        Kind::Data(c) => Kind::Data(c),
        Kind::Ack(s) => {
            let mut far = Sack::default();
            for b in s.blocks() {
                far.push(SackBlock {
                    start: b.start.wrapping_add(BLIND),
                    len: b.len,
                });
            }
            Kind::Ack(far)
        }
    };
    let h = Header {
        seq: h.seq.wrapping_add(BLIND),
        ack: h.ack.wrapping_add(BLIND),
        kind,
        ..h
    };
    let mut out = Vec::new();
    h.encode(payload, &mut out);
    out
}

fn content(side: usize, i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (side * 101 + i * 31 + j) as u8).collect()
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let mac = input.u8() & 1 == 1;
    let seed = input.u64();
    let isns = [input.u64(), input.u64()];
    let (loss, dup, reorder) = (input.u8() % 64, input.u8() % 64, input.u8());
    let mut x = UdpExchange::guarded(seed, isns, loss, dup, reorder, mac);
    for side in 0..2 {
        for i in 0..usize::from(input.u8() % 6) {
            let len = usize::from(input.u16()) % 3000;
            x.queue(side, content(side, i, len));
        }
    }
    while !input.0.is_empty() && x.elapsed() < Duration::from_secs(10) {
        match input.u8() % 4 {
            0 => {
                for _ in 0..input.u8() % 8 {
                    x.step();
                }
            }
            1 => {
                let to = usize::from(input.u8() & 1);
                let after = Duration::from_micros(u64::from(input.u16()));
                let n = usize::from(input.u16() % 400);
                let d = input.bytes(n);
                x.inject(to, after, blind(d, to, mac));
            }
            2 => {
                // An exact replay, now or later.
                if let Some((to, d)) = x.in_flight(usize::from(input.u8())) {
                    let after = Duration::from_micros(u64::from(input.u16()) * 16);
                    x.inject(to, after, d);
                }
            }
            _ => {
                // An altered copy.
                if let Some((to, mut d)) = x.in_flight(usize::from(input.u8())) {
                    for _ in 0..input.u8() % 4 {
                        let at = usize::from(input.u16()) % d.len().max(1);
                        let v = input.u8();
                        if let Some(b) = d.get_mut(at) {
                            *b ^= v;
                        }
                    }
                    if input.u8() & 1 == 1 {
                        d.truncate(usize::from(input.u16()));
                    }
                    x.inject(to, Duration::ZERO, blind(d, to, mac));
                }
            }
        }
    }
    x.run(Duration::from_secs(600));
    let got = x.delivered();
    assert!(!got.lost, "a side declared its peer lost");
    for i in 0..2 {
        assert_eq!(x.unsent(i), 0, "side {i} could not send everything");
        assert_eq!(
            got.received[1 - i].len(),
            got.sent[i].len(),
            "side {} received {} of {} messages",
            1 - i,
            got.received[1 - i].len(),
            got.sent[i].len()
        );
        for (k, (s, r)) in got.sent[i].iter().zip(&got.received[1 - i]).enumerate() {
            assert!(s == r, "message {k} from side {i} delivered altered");
        }
    }
    assert!(got.complete, "the exchange did not complete");
});

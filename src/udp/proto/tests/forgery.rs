//! A forger who sees every datagram on the wire (job id, ranks and
//! sequence numbers travel in the clear) and sends an altered copy of each
//! DATA datagram ahead of the real one. Under a CRC the copies pass and
//! replace the real data (which then drops as a duplicate); under the MAC
//! every copy is refused and counted, and what arrives is exactly what was
//! sent.

use std::collections::HashSet;
use std::time::Duration;

use super::super::header::{decode_unverified, Kind};
use super::super::sim::{Link, Sim};
use super::super::{Config, Guard, Seal, MAX_TRAILER};

/// How the forger seals its copies: the guard's own checksum when it is a
/// CRC (anyone can compute one), else a key of its own, or the real
/// datagram's trailer left as it was.
fn forge(d: &[u8], guard: Guard, keep_trailer: bool) -> Option<(u64, Vec<u8>)> {
    let (h, payload) = decode_unverified(d, guard).ok()?;
    if !matches!(h.kind, Kind::Data(_)) || payload.is_empty() {
        return None;
    }
    let mut altered = payload.to_vec();
    altered[0] ^= 0x5a;
    let mut out = Vec::new();
    match guard {
        Guard::Crc => h.encode_sealed(&altered, &mut out, &mut Seal::crc()),
        Guard::Mac if keep_trailer => {
            out.extend_from_slice(&d[..d.len() - MAX_TRAILER - payload.len()]);
            out.extend_from_slice(&altered);
            out.extend_from_slice(&d[d.len() - MAX_TRAILER..]);
        }
        Guard::Mac => h.encode_sealed(&altered, &mut out, &mut Seal::mac(&[0xf0; 16], &[0; 16])),
    }
    Some((h.seq, out))
}

/// Runs an exchange in both directions with the forger on the path;
/// returns the simulation when it is over (complete, or out of time).
fn with_forger(guard: Guard, keep_trailer: bool) -> Sim {
    let cfg = Config {
        guard,
        ..Config::default()
    };
    let mut sim = Sim::new(11, cfg, Link::default());
    sim.queue_sizes(0, 0, &[1, 100, 1400, 5000, 70_000, 3]);
    sim.queue_sizes(1, 100, &[2000, 7, 300]);
    let mut forged = HashSet::new();
    while !sim.complete() && sim.elapsed() < Duration::from_secs(30) {
        let now = sim.now;
        let copies: Vec<(usize, Vec<u8>)> = sim
            .in_flight()
            .filter_map(|(to, d)| {
                let (seq, f) = forge(d, guard, keep_trailer)?;
                forged.insert((to, seq)).then_some((to, f))
            })
            .collect();
        for (to, f) in copies {
            sim.inject(to, now, f);
        }
        if !sim.step() {
            break;
        }
    }
    sim
}

#[test]
fn under_a_crc_a_sighted_forger_replaces_data() {
    // The threat the MAC answers, shown on the CRC.
    let sim = with_forger(Guard::Crc, false);
    assert!(!sim.intact(), "the forged copies were not taken");
}

#[test]
fn under_the_mac_every_forged_copy_is_refused() {
    for keep_trailer in [false, true] {
        let sim = with_forger(Guard::Mac, keep_trailer);
        assert!(sim.complete(), "the exchange did not complete");
        sim.assert_delivered();
        let refused = sim.stats(0).checksum_errors + sim.stats(1).checksum_errors;
        assert!(refused >= 9, "only {refused} forgeries refused");
    }
}

#[test]
fn the_mac_guards_a_lossy_exchange() {
    let cfg = Config {
        guard: Guard::Mac,
        ..Config::default()
    };
    let link = Link {
        loss: 0.05,
        dup: 0.05,
        reorder: 0.1,
        ..Link::default()
    };
    let mut sim = Sim::new(3, cfg, link);
    sim.queue_sizes(0, 0, &[0, 1, 1399, 1400, 70_000, 200_000]);
    sim.queue_sizes(1, 100, &[5000, 3, 256, 257]);
    sim.run_to_completion(Duration::from_secs(120));
    sim.assert_delivered();
    assert!(sim.stats(0).resends > 0);
}

#[test]
fn under_the_mac_every_datagram_played_back_is_dropped_and_counted() {
    let cfg = Config {
        guard: Guard::Mac,
        ..Config::default()
    };
    let mut sim = Sim::new(5, cfg, Link::default());
    sim.queue_sizes(0, 0, &[100, 2000, 70_000]);
    sim.queue_sizes(1, 10, &[300, 5]);
    // Record every datagram that went over the wire...
    let mut recorded = HashSet::new();
    while !sim.complete() && sim.elapsed() < Duration::from_secs(30) {
        recorded.extend(sim.in_flight().map(|(to, d)| (to, d.to_vec())));
        if !sim.step() {
            break;
        }
    }
    sim.assert_delivered();
    let accepted = |s: &Sim, i: usize| {
        let st = s.stats(i);
        st.datagrams_received - st.checksum_errors - st.replays_dropped - st.decode_errors
    };
    let before = [accepted(&sim, 0), accepted(&sim, 1)];
    // ...and play it all back: none is taken again, none counts as heard
    // from the peer.
    let now = sim.now;
    for (to, d) in &recorded {
        sim.inject(*to, now, d.clone());
    }
    sim.run_until(Duration::from_secs(60), |s| s.in_flight().count() == 0);
    sim.assert_delivered();
    let replays = sim.stats(0).replays_dropped + sim.stats(1).replays_dropped;
    assert_eq!(replays as usize, recorded.len());
    assert_eq!([accepted(&sim, 0), accepted(&sim, 1)], before);
}

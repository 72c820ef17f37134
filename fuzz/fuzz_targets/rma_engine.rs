//! Feeds emulated RMA messages through the real entry points,
//! `Rma::handle` and (as `sm` hands over a message in one fragment)
//! `Rma::handle_in_place`,
//! of an initiator and a target joined by recording links: honest puts,
//! gets and atomics the initiator starts, and forged requests and answers
//! of any kind and bytes. Nothing may panic or touch memory outside a
//! region (the address sanitiser watches). A request naming a key the
//! target does not have never changes its region. While nothing is forged
//! with the real key and no answer is forged, the target region ends as a
//! model of the honest operations says, and every operation is answered.
#![no_main]

use async_btl::fuzz_support::{rma_kind, Outcome, RmaPair};
use libfuzzer_sys::fuzz_target;

#[path = "input.rs"]
mod input;
use input::Input;

const LEN: usize = 256;

/// An offset near the region, sometimes anywhere.
fn offset(input: &mut Input) -> u64 {
    match input.u8() % 8 {
        0 => input.u64(),
        1 => u64::MAX - u64::from(input.u8()),
        _ => u64::from(input.u8()) + u64::from(input.u8() % 2) * 8,
    }
}

/// What the honest operations do to the target region, applied when their
/// requests are delivered.
enum Op {
    Put(u64, Vec<u8>),
    Atomic(u64, [u8; 17]),
    Get,
}

fn apply(model: &mut [u8], op: &Op) {
    match op {
        Op::Put(off, data) => {
            let Some(end) = off.checked_add(data.len() as u64) else {
                return;
            };
            if end <= model.len() as u64 {
                model[*off as usize..end as usize].copy_from_slice(data);
            }
        }
        Op::Atomic(off, op) => {
            // Regions start 8-aligned (a `Vec`'s heap memory).
            if off % 8 != 0 || off.checked_add(8).is_none_or(|e| e > model.len() as u64) {
                return;
            }
            let at = *off as usize;
            let word = u64::from_le_bytes(model[at..at + 8].try_into().unwrap());
            let a = u64::from_le_bytes(op[1..9].try_into().unwrap());
            let b = u64::from_le_bytes(op[9..17].try_into().unwrap());
            let new = match op[0] {
                0 => word.wrapping_add(a),
                1 => a,
                _ if word == a => b,
                _ => word,
            };
            model[at..at + 8].copy_from_slice(&new.to_le_bytes());
        }
        Op::Get => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let mut pair = RmaPair::new(LEN, LEN);
    // Messages handed over as owned bytes, or where they lie (as `sm`
    // hands over one in a fragment).
    pair.set_in_place(input.u8() & 1 == 1);
    let key = pair.key();
    let mut model = vec![0u8; LEN];
    let mut queued: Vec<Op> = Vec::new();
    let mut ops = Vec::new();
    let mut clean = true;
    while !input.0.is_empty() {
        match input.u8() % 8 {
            0 => {
                let off = offset(&mut input);
                let n = usize::from(input.u8());
                let d = input.bytes(n);
                ops.push(pair.put(off, &d));
                queued.push(Op::Put(off, d));
            }
            1 => {
                let (off, dst) = (offset(&mut input), offset(&mut input));
                let n = usize::from(input.u8());
                ops.push(pair.get(off, dst, n));
                queued.push(Op::Get);
            }
            2 => {
                let off = offset(&mut input);
                let mut op = [0u8; 17];
                op[0] = input.u8() % 3;
                op[1..].copy_from_slice(
                    &input
                        .bytes(16)
                        .iter()
                        .chain([0u8; 16].iter())
                        .copied()
                        .take(16)
                        .collect::<Vec<_>>(),
                );
                if let Some(i) = pair.atomic(off, &op) {
                    ops.push(i);
                    queued.push(Op::Atomic(off, op));
                }
            }
            3 => {
                for op in queued.drain(..) {
                    apply(&mut model, &op);
                }
                pair.deliver_requests();
                pair.flush();
            }
            4 => {
                pair.deliver_answers();
            }
            5 | 6 => {
                // A forged request: any kind, id, body; with the real key
                // (which may write the region) or a wrong one (which must
                // not).
                let kind = input.u8() % 12;
                let id = u64::from(input.u8() % 4);
                let n = usize::from(input.u8());
                let mut body = input.bytes(n);
                let real = input.u8() & 1 == 1 && body.len() >= 16;
                if real {
                    body[..16].copy_from_slice(&key);
                    clean = false;
                } else if body.len() >= 16 && body[..16] == key {
                    body[0] ^= 1;
                }
                // Requests still queued go first (one ordered stream).
                for op in queued.drain(..) {
                    apply(&mut model, &op);
                }
                pair.deliver_requests();
                let before = pair.target_bytes();
                pair.forge_request(kind, id, &body);
                if !real {
                    assert_eq!(
                        pair.target_bytes(),
                        before,
                        "a wrong key changed the region"
                    );
                }
            }
            _ => {
                // A forged answer, sometimes naming a pending request.
                let kind = [
                    rma_kind::PUT_ACK,
                    rma_kind::GET_RESP,
                    rma_kind::FLUSH_ACK,
                    rma_kind::ATOMIC_RESP,
                ][usize::from(input.u8() % 4)];
                let ids = pair.pending_ids();
                let id = match ids.get(usize::from(input.u8())) {
                    Some(id) => *id,
                    None => input.u64() % 64,
                };
                let n = usize::from(input.u8());
                let body = input.bytes(n);
                pair.forge_answer(kind, id, &body);
                clean = false;
            }
        }
    }
    for op in queued.drain(..) {
        apply(&mut model, &op);
    }
    pair.deliver_requests();
    pair.deliver_answers();
    if clean {
        assert_eq!(
            pair.target_bytes(),
            model,
            "the region differs from the model"
        );
        for i in ops {
            assert_ne!(
                pair.outcome(i),
                Outcome::Pending,
                "operation {i} unanswered"
            );
        }
        assert_eq!(pair.outstanding(), 0, "operations left waiting");
    }
});

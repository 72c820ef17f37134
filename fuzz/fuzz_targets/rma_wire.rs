//! Decodes arbitrary bytes as the pieces of emulated RMA messages: a
//! request's header, an answer's status, a put part, an atomic operation.
//! Must never panic; what is accepted re-encodes to the same bytes (a
//! refusal, postcard, to its normal form: no longer, and a fixed point; an
//! add or swap with its unused operand zeroed).
#![no_main]

use async_btl::fuzz_support::{atomic_op, rma_put_part, rma_request, rma_status};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => {
            if let Some(again) = rma_request(body) {
                assert_eq!(again, body, "request does not round-trip");
            }
        }
        1 => {
            if let Some(again) = rma_status(body) {
                if again != body {
                    assert!(
                        body[0] == 1 && again.len() < body.len(),
                        "status does not round-trip"
                    );
                    assert_eq!(rma_status(&again), Some(again), "not a normal form");
                }
            }
        }
        2 => {
            if let Some(again) = rma_put_part(body) {
                assert_eq!(again, body, "put part does not round-trip");
            }
        }
        _ => {
            if let Some(again) = atomic_op(body) {
                // Add and swap have one operand: the other word is zero in
                // the normal form.
                let mut normal = body.to_vec();
                if body[0] < 2 {
                    normal[9..].fill(0);
                }
                assert_eq!(&again[..], normal, "atomic does not round-trip");
            }
        }
    }
});

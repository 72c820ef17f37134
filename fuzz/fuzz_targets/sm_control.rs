//! Decodes arbitrary bytes as the `sm` control messages a peer sends: the
//! rendezvous announcement, the split-copy request (and the range it asks
//! of a message), and the single-copy request and answer. Must never
//! panic; what is accepted re-encodes to the same bytes (an answer's
//! refusal, postcard, to its normal form: no longer, and a fixed point), and a split-copy
//! range is always inside its message.
#![no_main]

use async_btl::fuzz_support::{
    sm_cma_answer, sm_cma_request, sm_rendezvous, sm_split_request, SM_RTS_LEN,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => {
            if let Some(b) = body.first_chunk::<SM_RTS_LEN>() {
                let (_, again) = sm_rendezvous(b);
                assert_eq!(&again, b, "announcement does not round-trip");
            }
        }
        1 => {
            let Some((len, req)) = body.split_first_chunk::<8>() else {
                return;
            };
            let len = u64::from_le_bytes(*len) as usize;
            if let Some((again, range)) = sm_split_request(req, len) {
                assert_eq!(&again[..], req, "split request does not round-trip");
                if let Some(r) = range {
                    assert!(
                        r.start <= r.end && r.end <= len,
                        "range outside the message"
                    );
                }
            }
        }
        2 => {
            if let Some(again) = sm_cma_request(body) {
                assert_eq!(again, body, "single-copy request does not round-trip");
            }
        }
        _ => {
            if let Some(again) = sm_cma_answer(body) {
                // Postcard's normal form: the shortest varints.
                assert!(again.len() <= body.len(), "re-encoding grew");
                assert_eq!(sm_cma_answer(&again), Some(again), "not a normal form");
            }
        }
    }
});

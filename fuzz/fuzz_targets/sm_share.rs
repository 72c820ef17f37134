//! Decodes arbitrary bytes as the messages of `sm`'s share server: the
//! request a peer sends for a memory file, and the answer the asker reads
//! (with 0 to 3 descriptors attached). Must never panic; what is accepted
//! re-encodes to exactly the same bytes.
#![no_main]

use async_btl::fuzz_support::{sm_share_answer, sm_share_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        if let Some(again) = sm_share_request(body) {
            assert_eq!(again, body, "request does not round-trip");
        }
    } else if let Some(again) = sm_share_answer(body, usize::from(which >> 1) % 4) {
        assert_eq!(again, body, "answer does not round-trip");
    }
});

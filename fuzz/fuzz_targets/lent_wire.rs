//! Decodes arbitrary bytes as a lent message's announcement (what a peer's
//! `send_region` of device memory sends: id, range and the key of its
//! region), from the rank the first byte names, and as a receiver's answer
//! to one: must never panic, and whatever is accepted must encode back to
//! exactly the bytes it came from.
#![no_main]

use async_btl::fuzz_support::{lent_announce, lent_answer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((&src, rest)) = data.split_first() {
        if let Some(back) = lent_announce(u32::from(src % 4), rest) {
            assert_eq!(back, rest, "accepted announcement does not round-trip");
        }
    }
    if let Some(back) = lent_answer(data) {
        assert_eq!(back, data, "accepted answer does not round-trip");
    }
});

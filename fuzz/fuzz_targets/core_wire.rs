//! Decodes arbitrary bytes as the core's own messages between ranks: a
//! lent message's announcement (what a peer's `send_region` of device
//! memory sends: id, range and the key of its region), from the rank the
//! first byte names; a receiver's answer to one; a transport's control
//! message (name and payload). Must never panic; whatever is accepted must
//! encode back to exactly the bytes it came from.
#![no_main]

use async_btl::fuzz_support::{control_message, lent_announce, lent_answer};
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
    if let Some((name, payload)) = control_message(data) {
        let mut back = vec![name.len() as u8];
        back.extend_from_slice(&name);
        back.extend_from_slice(&payload);
        assert_eq!(back, data, "accepted control message does not round-trip");
    }
});

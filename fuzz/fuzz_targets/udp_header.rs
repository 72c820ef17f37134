//! Decodes arbitrary bytes as a UDP datagram: must never panic, and anything
//! accepted must re-encode to the same bytes.
#![no_main]

use async_btl::udp::proto::{decode, peek};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let peeked = peek(data);
    if let Ok((header, payload)) = decode(data) {
        let mut again = Vec::new();
        header.encode(payload, &mut again);
        assert_eq!(again, data, "accepted datagram does not round-trip");
        let ids = peeked.expect("peek accepts what decode accepts");
        assert_eq!(
            (ids.job, ids.src, ids.dst),
            (header.job, header.src, header.dst)
        );
    }
});

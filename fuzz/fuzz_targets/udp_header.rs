//! Decodes arbitrary bytes as a UDP datagram, under the CRC and under the
//! keyed MAC: must never panic, and anything accepted must re-encode to
//! the same bytes (under the MAC nothing should be accepted but what the
//! peer's seal made, which arbitrary bytes are not).
#![no_main]

use async_btl::udp::proto::{decode, decode_sealed, peek, Seal};
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
    let mut rx = Seal::mac(&[1; 16], &[2; 16]);
    assert!(
        decode_sealed(data, &mut rx).is_err(),
        "arbitrary bytes passed the MAC"
    );
});

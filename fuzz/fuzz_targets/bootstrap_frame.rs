//! Decodes arbitrary bytes as one frame of the TCP rendezvous (length
//! prefix, then a postcard message), to the server or to the client,
//! under the handshake's limit or the later one. Must never panic; a
//! frame it accepts re-encodes to its normal form (the shortest varints:
//! no longer, and a fixed point), exactly when its varints are short.
#![no_main]

use async_btl::fuzz_support::{bootstrap_frame, FrameTo};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, frame)) = data.split_first() else {
        return;
    };
    let to = if which & 1 == 0 {
        FrameTo::Client
    } else {
        FrameTo::Server
    };
    let handshake = which & 2 == 0;
    if let Some(again) = bootstrap_frame(to, frame, handshake) {
        assert!(again.len() <= frame.len(), "re-encoding grew");
        assert_eq!(
            bootstrap_frame(to, &again, handshake).as_ref(),
            Some(&again),
            "not a normal form"
        );
    }
});

//! Decodes arbitrary bytes as an `smcuda` handshake message (what a peer
//! sends to ask for, accept or refuse CUDA IPC) and as an `smcuda` key
//! handle (what a peer's `RemoteKey` carries to reach its GPU memory):
//! must never panic, and whatever is accepted must encode back to exactly
//! the bytes it came from.
#![no_main]

use async_btl::fuzz_support::{smcuda_handshake, smcuda_key_handle};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(back) = smcuda_handshake(data) {
        assert_eq!(back, data, "accepted handshake message does not round-trip");
    }
    if let Some(back) = smcuda_key_handle(data) {
        assert_eq!(back, data, "accepted key handle does not round-trip");
    }
});

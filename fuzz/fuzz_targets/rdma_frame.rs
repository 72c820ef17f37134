//! Decodes arbitrary bytes as an `rdma` frame (what a peer's send leaves
//! in a receive buffer) and as an `rdma` key handle (what a peer's
//! `RemoteKey` carries): must never panic, and whatever is accepted must
//! encode back to exactly the bytes it came from.
#![no_main]

use async_btl::fuzz_support::{rdma_frame, rdma_key_handle};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(back) = rdma_frame(data) {
        assert_eq!(back, data, "accepted frame does not round-trip");
    }
    if let Some(back) = rdma_key_handle(data) {
        assert_eq!(back, data, "accepted key handle does not round-trip");
    }
});

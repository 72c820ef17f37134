//! Decodes arbitrary bytes as a `RemoteKey` (what a peer sends): must never
//! panic, and a key it accepts must encode back to exactly those bytes.
#![no_main]

use async_btl::RemoteKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(key) = RemoteKey::from_bytes(data) {
        assert_eq!(key.to_bytes(), data, "accepted key does not round-trip");
        let _ = key.transports().count();
    }
});

//! Decodes arbitrary bytes as an `sm` fragment header read from a peer's
//! fragment: must never panic, never accept a length beyond the
//! fragment's capacity, and what it accepts must re-encode to the same
//! bytes.
#![no_main]

use async_btl::fuzz_support::{sm_frag_header, SM_FRAG_HEADER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((cap, header)) = data.split_first_chunk::<4>() else {
        return;
    };
    let Some(header) = header.first_chunk::<SM_FRAG_HEADER>() else {
        return;
    };
    let cap = u32::from_le_bytes(*cap) as usize % (1 << 21);
    if let Some((len, again)) = sm_frag_header(header, cap) {
        assert!(len as usize <= cap, "length beyond the fragment");
        assert_eq!(&again, header, "accepted header does not round-trip");
    }
});

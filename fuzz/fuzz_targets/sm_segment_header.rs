//! Decodes arbitrary bytes as a peer's `sm` segment header and validates
//! it as attaching does: must never panic; a header it accepts must
//! re-encode to the same bytes (its four padding bytes zero: the normal
//! form), and its layout must fit the file, with every fragment inside it
//! and found again from its offset.
#![no_main]

use async_btl::fuzz_support::{sm_segment_claims, sm_segment_header, SM_SEGMENT_HEADER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Some((len, rest)) = rest.split_first_chunk::<8>() else {
        return;
    };
    let Some(header) = rest.first_chunk::<SM_SEGMENT_HEADER>() else {
        return;
    };
    let file_len = (u64::from_le_bytes(*len) % (1 << 34)) as usize;
    // Mostly expect what the header claims, so the fuzzer reaches the
    // size checks; sometimes another local size.
    let mut exp = sm_segment_claims(header);
    if mode & 1 == 1 {
        exp.local_size = exp.local_size.wrapping_add(u32::from(mode >> 1));
    }
    let Some(layout) = sm_segment_header(header, file_len, &exp) else {
        return;
    };
    let mut normal = *header;
    normal[68..].fill(0);
    assert_eq!(
        layout.encode(&exp),
        normal,
        "accepted header does not round-trip"
    );
    assert!(layout.total() <= file_len, "layout beyond the file");
    let n = layout.frags();
    for i in [0, n / 2, n - 1] {
        let (off, size) = layout.frag(i);
        assert!(
            off as usize + size <= layout.total(),
            "fragment beyond the segment"
        );
        assert_eq!(layout.frag_index(off), Some(i));
        assert_eq!(layout.frag_index(off + 8), None);
    }
    // Offsets a peer's ring may carry: anything found is a real fragment.
    for w in rest[SM_SEGMENT_HEADER..].chunks_exact(8) {
        let off = u64::from_le_bytes(w.try_into().unwrap());
        let off = off % (layout.total() as u64 + 64);
        if let Some(i) = layout.frag_index(off) {
            assert!(i < n);
            assert_eq!(layout.frag(i).0, off);
        }
    }
});

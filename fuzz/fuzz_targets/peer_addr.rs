//! Decodes arbitrary bytes as the addresses a peer publishes: the blob of
//! the address exchange (which must name its rank), `sm`'s, `udp`'s and
//! `rdma`'s addresses. Must never panic; what is accepted re-encodes to its
//! postcard normal form (no longer than the input's prefix it read, and a
//! fixed point of decode and encode).
#![no_main]

use async_btl::fuzz_support::{published, rdma_addr, sm_addr, udp_addr};
use libfuzzer_sys::fuzz_target;

fn normal(input: &[u8], again: Option<Vec<u8>>, decode: impl Fn(&[u8]) -> Option<Vec<u8>>) {
    if let Some(again) = again {
        if !input.starts_with(&again) {
            assert!(again.len() < input.len(), "re-encoding grew");
        }
        assert_eq!(decode(&again).as_ref(), Some(&again), "not a normal form");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => {
            let rank = u32::from(which >> 2);
            normal(body, published(rank, body), |b| published(rank, b));
        }
        1 => normal(body, sm_addr(body), sm_addr),
        2 => normal(body, udp_addr(body), udp_addr),
        _ => normal(body, rdma_addr(body), rdma_addr),
    }
});

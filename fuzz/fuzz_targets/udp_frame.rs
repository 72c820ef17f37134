//! Feeds a sequence of protocol messages, cut from the input, to a udp
//! frame decoder (one-part messages, split heads and their data, bundles).
//! Must never panic; whatever decodes re-encodes to the bytes it came
//! from: a one-part message and a bundle exactly (a bundle of one entry to
//! its normal form, the bare message), a head with its data as the
//! encoder's two parts.
#![no_main]

use async_btl::fuzz_support::{udp_bundle, udp_encode, UdpDecoder, UdpFrames, UDP_SPLIT_MIN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut d = UdpDecoder::default();
    let mut rest = data;
    let mut head: Option<Vec<u8>> = None;
    while let Some((len, tail)) = rest.split_first_chunk::<2>() {
        let n = usize::from(u16::from_le_bytes(*len)).min(tail.len());
        let (msg, tail) = tail.split_at(n);
        rest = tail;
        let Some(frames) = d.push(msg) else {
            head = None;
            continue;
        };
        match frames {
            UdpFrames::Head => head = Some(msg.to_vec()),
            UdpFrames::One((kind, tag, body)) => {
                let (first, second) = udp_encode(kind, tag, &body).expect("a known kind");
                match head.take() {
                    Some(h) if body.len() >= UDP_SPLIT_MIN => {
                        assert_eq!(first, h, "head does not round-trip");
                        assert_eq!(second.as_deref(), Some(msg));
                    }
                    Some(_) => {
                        // A small message sent split: the decoder takes it.
                        assert_eq!(body, msg);
                    }
                    None => {
                        assert!(body.len() < UDP_SPLIT_MIN);
                        assert_eq!(first, msg, "message does not round-trip");
                    }
                }
            }
            UdpFrames::Many(msgs) => {
                head = None;
                assert!(!msgs.is_empty(), "an empty bundle was accepted");
                let again = udp_bundle(&msgs).expect("known kinds");
                if msgs.len() == 1 {
                    let mut whole = vec![0x40];
                    whole.extend_from_slice(&(again.len() as u32).to_le_bytes());
                    whole.extend_from_slice(&again);
                    assert_eq!(whole, msg, "bundle of one does not round-trip");
                } else {
                    assert_eq!(again, msg, "bundle does not round-trip");
                }
            }
        }
    }
});

//! Drives an `sm` ring: an honest producer, the consumer, and a hostile
//! peer scribbling on the tail, the head or any slot. Nothing may panic or
//! index out of bounds; a value taken is always within the slot's value
//! bits. While nobody scribbles, the consumer gets exactly what was pushed,
//! in order, and never sees a corrupt ring.
#![no_main]

use async_btl::fuzz_support::PeerRing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cap, mut rest)) = data.split_first() else {
        return;
    };
    let mut r = PeerRing::new(usize::from(cap % 9));
    let mut scribbled = false;
    let mut queue = std::collections::VecDeque::new();
    let mut next = 0u64;
    while let Some((&op, tail)) = rest.split_first() {
        rest = tail;
        match op % 4 {
            0 => {
                let v = next & PeerRing::VALUE_MASK;
                next = next
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(u64::from(op) + 1);
                match r.push(v) {
                    Ok(true) => queue.push_back(v),
                    Ok(false) => assert!(scribbled || !queue.is_empty(), "full while empty"),
                    Err(_) => assert!(scribbled, "an honest ring read as corrupt"),
                }
            }
            1 | 2 => match r.pop() {
                Ok(v) => {
                    if let Some(v) = v {
                        assert!(v <= PeerRing::VALUE_MASK);
                    }
                    if !scribbled {
                        assert_eq!(v, queue.pop_front(), "not what was pushed");
                    }
                }
                Err(_) => assert!(scribbled, "an honest ring read as corrupt"),
            },
            _ => {
                let Some((word, tail)) = rest.split_first_chunk::<9>() else {
                    break;
                };
                rest = tail;
                let at = usize::from(word[0]);
                let mut v = u64::from_le_bytes(word[1..].try_into().unwrap());
                if at & 0x80 != 0 {
                    // Near the real indices: small values, a lap's stamp.
                    v %= 64;
                    if at & 0x40 != 0 {
                        v |= u64::from(word[1] % 4) << 40;
                    }
                }
                r.scribble(at % 0x40, v);
                scribbled = true;
            }
        }
        if r.drained().is_err() {
            assert!(scribbled, "an honest ring read as corrupt");
        }
    }
});

//! Drives an `sm` fast box: an honest sender, the receiver, and a hostile
//! peer scribbling on any word of the box (marks, tags, payload, the
//! `consumed` counter, the split-copy word). The receiver takes messages
//! both ways the receive path does (looking first, and a receive's direct
//! take of a message of one or two slots on the tag it waits for). Nothing may panic
//! or read out of bounds. While nobody scribbles, the receiver gets exactly
//! what was pushed, in order.
#![no_main]

use async_btl::fuzz_support::{FastBox, Taken};
use libfuzzer_sys::fuzz_target;

#[path = "input.rs"]
mod input;
use input::Input;

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let slots = match input.u8() % 4 {
        0 => FastBox::SEGMENT_SLOTS,
        n => usize::from(n) * 3,
    };
    let mut b = FastBox::new(slots);
    let mut scribbled = false;
    let mut corrupt = false;
    let mut pushed: std::collections::VecDeque<Taken> = Default::default();
    let mut tag = 0u64;
    while !input.0.is_empty() {
        match input.u8() % 4 {
            0 => {
                let len = usize::from(input.u16()) % (FastBox::MAX_PAYLOAD + 2);
                let rndv = input.u8() & 1 == 1;
                let data: Vec<u8> = (0..len).map(|i| (i as u64 ^ tag) as u8).collect();
                tag += 1;
                match b.push(tag, &data, rndv) {
                    Ok(true) => pushed.push_back(Taken { tag, rndv, data }),
                    Ok(false) => {}
                    Err(_) => corrupt = true,
                }
            }
            n @ (1 | 2) => match if n == 1 {
                b.take()
            } else {
                // The tag a receiver waits on: usually the next message's.
                let want = match pushed.front() {
                    Some(t) if input.u8() % 4 != 0 => t.tag,
                    _ => u64::from(input.u8()),
                };
                b.take_direct(want)
            } {
                Ok(Some(t)) => {
                    if !scribbled {
                        assert_eq!(Some(t), pushed.pop_front(), "not what was pushed");
                    }
                }
                Ok(None) => {
                    if !scribbled {
                        assert!(pushed.is_empty(), "a pushed message was not found");
                    }
                }
                Err(_) => corrupt = true,
            },
            _ => {
                let i = usize::from(input.u16()) % b.words();
                let v = match input.u8() % 3 {
                    // A mark-like value: slot number and kind.
                    0 => {
                        (u64::from(input.u16()) << 16)
                            | u64::from(input.u16() & 0xfff4)
                            | u64::from(input.u8() % 5)
                    }
                    1 => u64::from(input.u8()),
                    _ => input.u64(),
                };
                b.scribble(i, v);
                scribbled = true;
                let _ = b.split_state(input.u64());
            }
        }
        if b.drained().is_err() {
            corrupt = true;
        }
        assert!(scribbled || !corrupt, "an honest box read as corrupt");
    }
});

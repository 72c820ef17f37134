//! Checks arbitrary bytes as a rank's entry in the directory rendezvous,
//! and honest entries (made by the real encoder, possibly for another
//! rank, size, round or key, then possibly damaged). Must never panic; an
//! honest entry is accepted with its blob exactly when it was made for
//! what the reader expects, and a damaged one never yields another blob.
#![no_main]

use async_btl::fuzz_support::{bootstrap_dir_encode, bootstrap_dir_entry, bootstrap_job};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((head, rest)) = data.split_first_chunk::<6>() else {
        return;
    };
    let size = u32::from(head[0] % 8) + 1;
    let rank = u32::from(head[1]) % size;
    let round = u32::from(head[2] % 4);
    let Some(reader) = bootstrap_job(0, size, [7; 32]) else {
        return;
    };
    if head[3] & 1 == 0 {
        // Raw bytes.
        let _ = bootstrap_dir_entry(&reader, round, rank, rest);
        return;
    }
    // An honest entry, maybe from a different job layout or key.
    let (w_size, w_rank, w_round, w_key) = match head[3] >> 1 & 7 {
        0 => (size + 1, rank, round, [7; 32]),
        1 => (size, (rank + 1) % size, round, [7; 32]),
        2 => (size, rank, round + 1, [7; 32]),
        3 => (size, rank, round, [8; 32]),
        _ => (size, rank, round, [7; 32]),
    };
    let Some(writer) = bootstrap_job(w_rank, w_size, w_key) else {
        return;
    };
    let mut entry = bootstrap_dir_encode(&writer, w_round, rest);
    let honest = (w_size, w_rank, w_round, w_key) == (size, rank, round, [7; 32]);
    let damaged = head[4] & 1 == 1 && !entry.is_empty();
    if damaged {
        let at = usize::from(head[5]) % entry.len();
        entry[at] ^= 1 << (head[4] >> 5);
    }
    match bootstrap_dir_entry(&reader, round, rank, &entry) {
        Some(blob) => {
            assert!(honest, "an entry for another layout or key was accepted");
            assert_eq!(blob, rest, "accepted with another blob");
        }
        None => assert!(!honest || damaged, "an honest entry was refused"),
    }
});
